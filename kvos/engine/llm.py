"""The offline Python API, mirroring vLLM's ``LLM``."""
from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from kvos.config import EngineConfig
from kvos.core.outputs import RequestOutput
from kvos.core.sampling_params import SamplingParams
from kvos.engine.chat import chat_prompt_ids, message_spans, split_image_parts
from kvos.engine.llm_engine import LLMEngine, PromptType
from kvos.engine.media import PreparedImage, expand_image_text

Message = dict[str, str]


class LLM:
    """``LLM()`` loads the default model (SmolLM2-135M-Instruct); keyword arguments are
    ``EngineConfig`` fields (``block_size``, ``enable_prefix_caching``, ``kv_cache_memory_bytes``,
    ``max_num_batched_tokens``, ``max_num_seqs``, ``dtype``, ...)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def shutdown(self) -> None:
        """Release the engine's worker processes (tensor parallelism); the LLM is unusable after."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's recommended values (``generation_config``), as the
        server gives a request that sets none."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of ``prompts``.

        Every prompt is validated before any is queued, so a bad one raises ``ValueError``
        without leaving work behind.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"priority must be one per prompt: {len(prios)} for {len(prompts)} prompts")
        tokenized = [self.engine.tokenize_request(p) for p in prompts]
        for sp in params_list:
            sp.validate()
        ids: list[str] = []
        try:
            for (text, token_ids, spans), sp, pr, p in zip(tokenized, params_list, prios, prompts):
                prompt = {"prompt": text, "prompt_token_ids": token_ids, "segment_spans": spans}
                if isinstance(p, dict) and p.get("multi_modal_data") is not None:
                    prompt["multi_modal_data"] = p["multi_modal_data"]
                ids.append(self.engine.add_request(prompt, sp, priority=pr, cache_salt=cache_salt))
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, cache_salt: str | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate
        (with ``segment_reuse``, each message is a segment). ``continue_final_message``: the model
        continues the last (assistant) message (with ``add_generation_prompt=False``);
        ``chat_template_kwargs``: variables for the template (vLLM's names)."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        template = {"continue_final_message": continue_final_message, "template_kwargs": chat_template_kwargs}
        prompts = []
        for c in convs:
            c, images = split_image_parts(c)
            if images:
                prepared = self.engine.prompt_images({"image": [src for _, src in images]},
                                                      [where for where, _ in images])
                ids = chat_prompt_ids(self.engine.tokenizer, c, add_generation_prompt,
                                      expand=lambda text, p=prepared: self._expand(text, p), **template)
                prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": prepared}})
                continue
            ids = chat_prompt_ids(self.engine.tokenizer, c, add_generation_prompt, **template)
            spans = message_spans(self.engine.tokenizer, c, ids) if self.engine.config.segment_reuse else ()
            prompts.append({"prompt_token_ids": ids, "segment_spans": spans})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)

    def chat_token_ids(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """The chat's prompt ids; each image part becomes the model's image tokens."""
        messages, images = split_image_parts(messages)
        if not images:
            return chat_prompt_ids(self.engine.tokenizer, messages, add_generation_prompt)
        prepared = self.engine.prompt_images({"image": [src for _, src in images]}, [where for where, _ in images])
        return chat_prompt_ids(self.engine.tokenizer, messages, add_generation_prompt,
                               expand=lambda text: self._expand(text, prepared))

    def _expand(self, text: str, images: list[PreparedImage]) -> str:
        if self.engine.media is None:
            raise ValueError("messages: this model takes no images")
        return expand_image_text(text, self.engine.tokenizer, self.engine.media.vision, images)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(final_only=True):
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def pin_prefix(self, prompt, ttl_s: float | None = None, cache_salt: str | None = None,
                   pin_id: str | None = None) -> dict:
        """Compute ``prompt``'s KV and pin its full blocks (never evicted while pinned) for
        ``cache_salt``'s tenant, until ``unpin_prefix(pin_id)`` or ``ttl_s`` seconds. Returns
        ``{"pin_id", "pinned_tokens", "pinned_blocks", "expires_at"}`` (``time.monotonic``
        clock). Raises ValueError past ``max_pinned_fraction`` of the pool."""
        done: list = []
        self.engine.pin_prefix(prompt, ttl_s, cache_salt, pin_id, on_done=done.append)
        while not done and self.engine.has_unfinished_requests():
            self.engine.step()
        if isinstance(done[0], Exception):
            raise done[0]
        return done[0].describe()

    def unpin_prefix(self, pin_id: str) -> bool:
        return self.engine.unpin_prefix(pin_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()
