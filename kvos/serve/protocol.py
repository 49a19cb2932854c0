"""OpenAI request bodies (pydantic), validated strictly.

Contract: unknown fields are rejected; scalars are never coerced (``true`` is not an integer,
``"2"`` is not a number, ``"yes"`` is not a boolean; only an integer is accepted where a float is
expected, as OpenAI does); floats must be finite; a model name is at most ``MODEL_NAME_MAX``
characters. Every failure is a 400 whose ``param`` names the field (``kvos.serve.errors``)."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvos.core.sampling_params import SamplingParams
from kvos.core.structured_outputs import StructuredOutputsParams

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]

MODEL_NAME_MAX = 256
ModelName = Annotated[str, Field(max_length=MODEL_NAME_MAX)]

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""Every request model's config: no unknown fields, no type coercion, no inf/NaN."""


def _token_id_key(key: object) -> object:
    """JSON object keys are strings: ``"123"`` is token id 123 (nothing else is coerced)."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
        return int(key)
    return key


TokenIdKey = Annotated[int, BeforeValidator(_token_id_key)]


SEED_DOMAIN = 1 << 63
"""The engine's sampler seeds a generator with ``seed % 2**63``; the API takes any 64-bit signed
integer (OpenAI's and vLLM's range) and maps it there the same way."""


def _nullable(field) -> bool:
    """Whether a pydantic field's type admits None (``int | None``, ``None``)."""
    return field.annotation is None or field.annotation is type(None) or type(None) in get_args(field.annotation)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: cumulative usage in every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object) or
    ``json_schema`` (``{"name", "schema", "strict"}``; the schema is always enforced)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` request field: one of ``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_flexible: bool = False


_UNSUPPORTED = {"functions": "the legacy function calling (use tools)",
                "function_call": "the legacy function calling (use tool_choice)"}
"""Chat fields that are a 400 naming the field."""


MODEL_DEFAULT_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
"""The sampling fields a model's recommended values fill when a request leaves them unset, with
``SamplingParams``' own defaults behind those."""


def with_model_defaults(given: dict, defaults: dict | None) -> dict:
    """Each of ``MODEL_DEFAULT_FIELDS``: as ``given`` (None or absent: unset), else the model's
    ``defaults``, else ``SamplingParams``' own."""
    d = defaults or {}
    return {k: given[k] if given.get(k) is not None else d.get(k, fallback)
            for k, fallback in MODEL_DEFAULT_FIELDS.items()}


class _Common(BaseModel):
    """Fields shared by both endpoints; ``top_k``, ``min_p``, ``ignore_eos``, ``cache_salt``,
    ``priority``, ``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens`` and
    ``prompt_logprobs`` are kvos (and vLLM) extensions, ``speculative`` (false: this request never verifies drafts) is kvos's."""

    model_config = STRICT

    model: ModelName | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[TokenIdKey, float] | None = None  # JSON sends the token ids as strings
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    return_token_ids: bool | None = None
    speculative: bool = True
    include_stop_str_in_output: bool = False  # vLLM: the matched stop string stays in the text
    skip_special_tokens: bool = True  # vLLM: false keeps special tokens' text in the output

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: object) -> object:
        """A field that cannot hold ``null`` takes its default when sent as ``null`` (OpenAI's and
        vLLM's reading: ``"stream": null``, ``"n": null``), so clients that serialise every
        optional field still validate; a field that can keeps its own meaning of it
        (``"max_tokens": null``: up to the context)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if not (v is None and k in fields and not _nullable(fields[k]))}

    @model_validator(mode="after")
    def _check(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        if self.logit_bias is not None:
            if len(self.logit_bias) > 300:
                raise ValueError("logit_bias: at most 300 token ids")
            if any(t < 0 for t in self.logit_bias) or any(not -100 <= b <= 100 for b in self.logit_bias.values()):
                raise ValueError("logit_bias: token ids must be >= 0 and biases in [-100, 100]")
        self.structured()
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint, from whichever one field gives it (OpenAI's ``response_format``,
        vLLM's ``structured_outputs`` or its older ``guided_*``); a ValueError naming the field
        when two are given or one is malformed."""
        found: list[StructuredOutputsParams] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutputsParams(json_object=True, field_name="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema: required for type json_schema")
            found.append(StructuredOutputsParams(json=rf.json_schema.schema_, field_name="response_format.json_schema"))
        so = self.structured_outputs
        if so is not None:
            found.append(StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                                 json_object=bool(so.json_object),
                                                 whitespace_flexible=so.whitespace_flexible,
                                                 field_name="structured_outputs"))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append(StructuredOutputsParams(**{key: value}, field_name=name))
        if len(found) > 1:
            raise ValueError(f"{found[1].field_name}: give one output constraint, not also {found[0].field_name}")
        return found[0] if found else None

    def engine_seed(self) -> int | None:
        return None if self.seed is None else self.seed % SEED_DOMAIN

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """``defaults`` (the model's, ``generation_config``) fill the sampling fields left unset."""
        return SamplingParams(
            n=self.n, **with_model_defaults({k: getattr(self, k) for k in MODEL_DEFAULT_FIELDS}, defaults),
            seed=self.engine_seed(), max_tokens=max_tokens, stop=self.stop, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, speculative=self.speculative,
            structured_outputs=self.structured(), include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)


class TextSegment(BaseModel):
    """One part of a prompt given as parts (segment reuse): text. The parts make one prompt;
    their boundaries are the segments."""

    model_config = STRICT
    text: str


class TokenSegment(BaseModel):
    """One part of a prompt given as parts (segment reuse): token ids."""

    model_config = STRICT
    token_ids: TokenIds


SegmentPart = TextSegment | TokenSegment


class CompletionRequest(_Common):
    """``echo`` prepends the prompt's text to each completion's text (OpenAI); ``prompt_logprobs``
    (vLLM) returns each choice's prompt token logprobs plus the top-k's. A ``prompt`` given as a
    list of ``{"text"}``/``{"token_ids"}`` parts is one prompt whose parts are its segments."""

    prompt: str | list[str] | TokenIds | list[TokenIds] | list[SegmentPart]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _parts(cls, p: object) -> object:
        """A list holding an object is a prompt given as parts: each part is checked alone, so a
        bad one is named (``segments[i]``) instead of every union member's complaint."""
        if not (isinstance(p, list) and any(isinstance(x, dict) for x in p)):
            return p
        parts: list[SegmentPart] = []
        for i, x in enumerate(p):
            try:
                kind = TokenSegment if isinstance(x, dict) and "token_ids" in x else TextSegment
                parts.append(kind.model_validate(x))
            except ValidationError:
                raise ValueError(f'segments[{i}] must be {{"text": a string}} or {{"token_ids": a non-empty list '
                                 f"of non-negative integers}}") from None
        return parts

    @model_validator(mode="after")
    def _prompts(self):
        p = self.prompt
        if isinstance(p, list) and not p:
            raise ValueError("prompt: must not be empty")
        if isinstance(p, list) and len(p) > 64 and not isinstance(p[0], int):
            raise ValueError("prompt: at most 64 prompts per request")
        if self.suffix:
            raise ValueError("suffix: text after the insertion point is not supported by this server")
        return self

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [{"prompt_token_ids": p}]
        if p and isinstance(p[0], (TextSegment, TokenSegment)):
            return [{"segments": [x.text if isinstance(x, TextSegment) else x.token_ids for x in p]}]
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = STRICT
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(BaseModel):
    """An image in a chat message (OpenAI's shape): a ``data:image/...;base64,`` URL, or an
    http(s) URL where the server allows them (``--allow-remote-images``)."""

    model_config = STRICT
    type: Literal["image_url"]
    image_url: ImageURL


class ToolCallFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str


class ToolCallItem(BaseModel):
    """An assistant turn's earlier call (OpenAI's ``message.tool_calls[i]``)."""

    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart | ImageURLPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    # an assistant message as the openai client returns it (``message.model_dump()``) can be sent
    # back: its refusal text, empty annotations and null audio / function_call are not prompt text
    refusal: str | None = None
    annotations: list[dict] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message holds tool calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message answers a call, named by its tool_call_id")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def parts(self) -> list[dict] | None:
        """The content as parts when it holds an image (``kvos.engine.chat.split_image_parts``
        takes them), else None (the text alone is the content)."""
        if not isinstance(self.content, list) or all(isinstance(p, TextPart) for p in self.content):
            return None
        return [p.model_dump(exclude_none=True) for p in self.content]


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields accepted and not acted on: nothing is stored, there is one service tier, a
    # prediction only speeds generation up where a server uses it, these models do not reason
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prediction: dict | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None
    # vLLM's chat template controls
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _no_legacy_functions(self):
        for name, feature in _UNSUPPORTED.items():
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: {feature} is not supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not returned in a stream on /v1/chat/completions (send stream: false)")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def effective_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class _PromptOrMessages(BaseModel):
    """A body that names its input once: ``prompt`` or ``messages``."""

    PROMPT_KINDS: ClassVar[str]

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"prompt: send exactly one of prompt ({self.PROMPT_KINDS}) or messages (a chat)")
        return self


class TokenizeRequest(_PromptOrMessages):
    """vLLM's ``/tokenize``: either ``prompt`` (``add_special_tokens`` defaults to true) or
    ``messages`` rendered with the chat template (``add_special_tokens`` defaults to false: the
    template holds them)."""

    model_config = STRICT
    model: ModelName | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    PROMPT_KINDS: ClassVar[str] = "a string"


class PinRequest(_PromptOrMessages):
    """``POST /v1/cache/pins``: a prefix (``prompt`` text or token ids, or ``messages`` rendered
    with the chat template without the generation prompt) whose full blocks stay cached for the
    caller's tenant until deleted or ``ttl_s`` seconds pass."""

    model_config = STRICT
    model: ModelName | None = None
    prompt: str | list[int] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    ttl_s: Annotated[float, Field(gt=0)] | None = None
    cache_salt: str | None = None

    PROMPT_KINDS: ClassVar[str] = "text or token ids"


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: ModelName | None = None
    tokens: list[int]
