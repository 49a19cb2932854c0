"""``DataParallelLLM``: several engines on Ray behind a router, with ``LLM.generate``'s blocking
interface (offline batches from Python)."""
from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections.abc import Sequence
from dataclasses import fields

from kvos.core.outputs import RequestOutput
from kvos.core.sampling_params import SamplingParams
from kvos.distributed.dp_engine import DataParallelEngine
from kvos.router.config import RouterConfig

ROUTER_KEYWORDS = frozenset(f.name for f in fields(RouterConfig)) - {"router"}
"""``DataParallelLLM``'s keywords that go to the router (``RouterConfig``'s fields), not the engines."""


class DataParallelLLM:
    """``num_engines`` engines of one model (``engine_kwargs`` are ``LLM``'s keywords) behind
    ``router``; ``prefill_engines`` > 0 adds engines that only prefill (disaggregated);
    ``encoder_engines`` > 0 adds engines that only run a vision model's image encoder (E/PD).
    ``transport``: ``"ray"`` (actors) or ``"process"`` (local processes, no Ray). ``router``: a
    router's name or a ``RouterConfig``; with a name, keywords named as ``RouterConfig``'s fields
    (``kv_weight``, ``router_balance``, ``router_queue_weight``, ...: ``ROUTER_KEYWORDS``) set the
    router and the rest are the engines'.
    ``kv_transfer``: how prefill engines hand blocks over (``DataParallelEngine.kv_transfer``).

    The ``DataParallelEngine`` lives on an event loop of its own thread; ``generate`` submits
    every prompt, waits for all, and returns the outputs in prompt order. Call ``shutdown`` (or
    use ``with``) to stop the engines.
    """

    def __init__(self, num_engines: int = 2, router: RouterConfig | str = "kv_aware", prefill_engines: int = 0,
                 ray_address: str | None = None, transport: str = "ray", encoder_engines: int = 0,
                 kv_transfer: str = "auto", **engine_kwargs) -> None:
        settings = {k: engine_kwargs.pop(k) for k in list(engine_kwargs) if k in ROUTER_KEYWORDS}
        if isinstance(router, RouterConfig):
            if settings:
                raise ValueError(f"router: give {', '.join(sorted(settings))} in the RouterConfig, not beside it")
        else:
            router = RouterConfig(router, **settings)
        self.engine = DataParallelEngine(engine_kwargs, num_engines, router, ray_address,
                                         prefill_engines=prefill_engines, transport=transport,
                                         encoder_engines=encoder_engines, kv_transfer=kv_transfer)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvos-dp-loop", daemon=True)
        self._thread.start()
        self._run(self._start())
        self._ids = 0
        self._closed = False
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    async def _start(self) -> None:
        self.engine.start()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompts: str | Sequence, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Outputs in the order of ``prompts`` (strings, token-id lists or ``{"prompt_token_ids": ...}``)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [{"prompt_token_ids": list(p)} if isinstance(p, list) else p for p in prompts]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        for sp in params_list:
            sp.validate()
        first = self._ids
        self._ids += len(prompts)

        async def run() -> list[RequestOutput]:
            streams = [await self.engine.submit(p, sp, f"dp-{first + i}", cache_salt=cache_salt, retriable=True)
                       for i, (p, sp) in enumerate(zip(prompts, params_list))]
            return list(await asyncio.gather(*(s.result() for s in streams)))

        return self._run(run())

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the engines (once; also at interpreter exit if never called)."""
        if self._closed:
            return
        self._closed = True
        self._run(self.engine.stop_polling())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.engine.shutdown()

    def __enter__(self) -> DataParallelLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _shutdown_if_alive(ref: weakref.ref) -> None:
    """At exit: a ``DataParallelLLM`` never shut down stops its engines before the interpreter
    tears down the threads its event loop uses."""
    llm = ref()
    if llm is not None:
        llm.shutdown()
