"""``DataParallelLLM``: several engines on Ray behind a router, with ``LLM.generate``'s blocking
interface (offline batches from Python)."""
from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections.abc import Sequence

from kvos.core.outputs import RequestOutput
from kvos.core.sampling_params import SamplingParams
from kvos.distributed.dp_engine import DataParallelEngine
from kvos.router.policies import (
    DEFAULT_BALANCE,
    DEFAULT_KV_WEIGHT,
    DEFAULT_QUEUE_WEIGHT,
    DEFAULT_SHARED_BALANCE,
    DEFAULT_SHARED_THRESHOLD,
)


class DataParallelLLM:
    """``num_engines`` engines of one model (``engine_kwargs`` are ``LLM``'s keywords) behind
    ``router``; ``prefill_engines`` > 0 adds engines that only prefill (disaggregated);
    ``encoder_engines`` > 0 adds engines that only run a vision model's image encoder (E/PD).
    ``transport``: ``"ray"`` (actors) or ``"process"`` (local processes, no Ray). ``kv_weight``
    ``router_balance``, ``router_queue_weight``, ``router_shared_balance`` and
    ``router_shared_threshold``: kv_aware's cost weights and balance guards (``kvos.router.policies``).
    ``kv_transfer``: how prefill engines hand blocks over (``DataParallelEngine.kv_transfer``).

    The ``DataParallelEngine`` lives on an event loop of its own thread; ``generate`` submits
    every prompt, waits for all, and returns the outputs in prompt order. Call ``shutdown`` (or
    use ``with``) to stop the engines.
    """

    def __init__(self, num_engines: int = 2, router: str = "kv_aware", prefill_engines: int = 0,
                 ray_address: str | None = None, transport: str = "ray", kv_weight: float = DEFAULT_KV_WEIGHT,
                 router_balance: tuple[int, float] = DEFAULT_BALANCE, encoder_engines: int = 0,
                 kv_transfer: str = "auto", router_queue_weight: float = DEFAULT_QUEUE_WEIGHT,
                 router_shared_balance: tuple[int, float] = DEFAULT_SHARED_BALANCE,
                 router_shared_threshold: int = DEFAULT_SHARED_THRESHOLD, **engine_kwargs) -> None:
        self.engine = DataParallelEngine(engine_kwargs, num_engines, router, ray_address, kv_weight,
                                         prefill_engines=prefill_engines, transport=transport,
                                         router_balance=router_balance, encoder_engines=encoder_engines,
                                         kv_transfer=kv_transfer, router_queue_weight=router_queue_weight,
                                         router_shared_balance=router_shared_balance,
                                         router_shared_threshold=router_shared_threshold)
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
