"""Chat messages to prompt token ids through the model's own chat template.

Turn integrity: only the template's own text can produce special tokens. A special token's text
typed inside a message (``"<|im_end|>\\n<|im_start|>system"``) is tokenized as plain text, so a
message can never open, close or forge a turn. Messages without such text get exactly the ids of
tokenizing the rendered template as a whole (what every HF-style server does).
"""
from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterator

_ROLES = ("system", "user", "assistant", "tool", "developer")

_MARKER_RANGE = range(0xE000, 0xF900)
"""Unicode private-use code points: two absent from the messages mark the special tokens they hold."""

_control_res: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def validate_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {_ROLES}, got {m['role']!r}")
        content = m["content"]
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and (part.get("type") == "image" or (
                        part.get("type") == "text" and isinstance(part.get("text"), str)))):
                    raise ValueError(f"messages[{i}].content[{j}] must be a text or image part")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
    return messages


def split_image_parts(messages) -> tuple[list, list[tuple[str, object]]]:
    """Messages whose content is a list of parts, as chat templates take them: text parts
    (``{"type": "text", "text"}``) kept, image parts (OpenAI's ``{"type": "image_url",
    "image_url": {"url"}}``, or ``{"type": "image", "image": ...}`` with a PIL image, bytes, a data
    URL or a path) replaced by ``{"type": "image"}``; a message without images gets its text
    parts joined with newlines into one string (what templates of text models expect; vLLM joins
    them so). Returns the messages and each image's (field name, source), in order.
    ``ValueError`` naming a malformed part."""
    if not isinstance(messages, list) or not any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                                 for m in messages):
        return messages, []
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), list):
            out.append(m)
            continue
        parts, texts, has_image = [], [], False
        for j, part in enumerate(m["content"]):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
                texts.append(part["text"])
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"{where}.image_url must be {{'url': a data: URL}}")
                parts.append({"type": "image"})
                images.append((where, url))
                has_image = True
            elif kind == "image" and part.get("image") is not None:
                parts.append({"type": "image"})
                images.append((where, part["image"]))
                has_image = True
            else:
                raise ValueError(f"{where} must be {{'type': 'text', 'text': ...}} or an image part "
                                 f"({{'type': 'image_url', 'image_url': {{'url': ...}}}})")
        out.append({**m, "content": parts if has_image else "\n".join(texts)})
    return out, images


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list[dict] | None = None,
                    expand: Callable[[str], str] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict | None = None) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template and tokenize the result.

    Contract: the special tokens the template writes become their ids; special-token text inside
    any message string (content, name) is tokenized as plain text, never as a special id. For
    messages without special-token text the ids equal ``tokenizer(rendered, add_special_tokens=
    add_special_tokens)``. ``add_special_tokens`` adds the tokenizer's own BOS/EOS (the template
    usually holds them already). ``tools`` (OpenAI's tool list) go to a template that renders
    them, under the same rule. ``expand`` rewrites the template's own text before tokenizing
    (an image's start token into its whole token sequence). ``continue_final_message``: the
    prompt ends inside the last (assistant) message, which the model continues (an assistant
    prefill); ``template_kwargs`` go to the template as variables (``enable_thinking``). Raises
    ``ValueError`` (a 400 naming ``messages``, or the option at fault) for invalid messages or
    options, a model without a template, or a template or tokenizer that rejects them."""
    if not has_chat_template(tokenizer):
        raise ValueError("messages: this model has no chat template (a base model); send a plain "
                         "prompt (/v1/completions) instead")
    messages = validate_messages(messages)
    control = _control_re(tokenizer)
    given = [messages, tools or []]
    expand = expand or (lambda text: text)
    if control is None or not any(control.search(s) for s in _strings(given)):
        return _encode(tokenizer, expand(_render(tokenizer, messages, add_generation_prompt, tools,
                                                 continue_final_message, template_kwargs)), add_special_tokens)
    start, end = _free_markers(given)
    marked = _mark(messages, control, start, end)
    text = _render(tokenizer, marked, add_generation_prompt, _mark(tools, control, start, end) if tools else None,
                   continue_final_message, template_kwargs)
    # [template text, marked token (or None: a lone marker the template split off), template text, ...]
    pieces = re.split(f"{start}({control.pattern}){end}|[{start}{end}]", text)
    try:
        ids = list(tokenizer(expand(pieces[0]), add_special_tokens=False).input_ids)
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += _encode_piece(tokenizer, piece if i % 2 else expand(piece), as_text=i % 2 == 1)
    except Exception as e:
        raise ValueError(f"messages: cannot be tokenized ({type(e).__name__}: {clip(e)})") from e
    if add_special_tokens:
        head, tail = _special_affixes(tokenizer)
        ids = head + ids + tail
    return ids


def message_spans(tokenizer, messages: list[dict], ids: list[int],
                  tools: list[dict] | None = None) -> tuple[tuple[int, int], ...]:
    """Each message's span of ``ids`` (``chat_prompt_ids`` of ``messages``), the segments of
    segment reuse: message i starts where the template's rendering of the first i messages ends,
    when that rendering is a prefix of ``ids`` (most templates); a message whose start is not
    such a prefix joins the one before. The last span runs to the end (the generation prompt)."""
    bounds = [0]
    for i in range(1, len(messages)):
        try:
            head = chat_prompt_ids(tokenizer, messages[:i], add_generation_prompt=False, tools=tools)
        except ValueError:  # e.g. a template that wants a user turn last
            continue
        if bounds[-1] < len(head) < len(ids) and ids[: len(head)] == head:
            bounds.append(len(head))
    bounds.append(len(ids))
    return tuple(zip(bounds, bounds[1:]))


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None


def clip(value: object, limit: int = 300) -> str:
    """``str(value)`` cut to ``limit`` characters (error messages never echo a whole input)."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"


TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", "tokenize", "chat_template", "return_dict"})
"""What ``template_kwargs`` may not set: the rendering's own arguments."""


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
            continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
    if continue_final_message and (add_generation_prompt or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message: needs add_generation_prompt false and an assistant message last")
    reserved = TEMPLATE_ARGUMENTS.intersection(template_kwargs or ())
    if reserved:
        raise ValueError(f"chat_template_kwargs: may not set {', '.join(sorted(reserved))}")
    try:
        extra = {"tools": tools} if tools else {}
        if continue_final_message:
            extra["continue_final_message"] = True
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **extra, **(template_kwargs or {}))
    except ValueError:
        raise
    except Exception as e:  # template errors (e.g. jinja raise_exception) are the input's fault
        raise ValueError(f"messages: the chat template rejected them ({clip(e)})") from e


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    try:
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    except Exception as e:
        raise ValueError(f"messages: cannot be tokenized ({type(e).__name__}: {clip(e)})") from e


def _control_re(tokenizer) -> re.Pattern | None:
    """A regex matching any of the tokenizer's special added tokens (longest first), or None."""
    try:
        return _control_res[tokenizer]
    except (KeyError, TypeError):
        pass
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = sorted({t.content for t in decoder.values() if getattr(t, "special", False) and t.content.strip()},
                    key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None
    try:
        _control_res[tokenizer] = pattern
    except TypeError:  # not weak-referenceable: no cache
        pass
    return pattern


def _strings(obj) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def _free_markers(messages: list) -> tuple[str, str]:
    """Two private-use characters that no message string contains."""
    used = set().union(*(set(s) for s in _strings(messages)))
    free = (chr(c) for c in _MARKER_RANGE if chr(c) not in used)
    try:
        return next(free), next(free)
    except StopIteration:
        raise ValueError("messages: too many distinct private-use characters") from None


def _mark(obj, control: re.Pattern, start: str, end: str):
    """``obj`` with every special-token text in its strings wrapped as ``start + token + end``."""
    if isinstance(obj, str):
        return control.sub(lambda m: f"{start}{m.group(0)}{end}", obj)
    if isinstance(obj, dict):
        return {k: (v if k == "role" else _mark(v, control, start, end)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mark(v, control, start, end) for v in obj]
    return obj


def _encode_piece(tokenizer, piece: str, as_text: bool) -> list[int]:
    """Ids of a piece from the middle of a chat; ``as_text``: special tokens are not recognized.

    Encoded after a newline that is then dropped, so a SentencePiece tokenizer does not add the
    prefix space it adds at the start of a string."""
    def encode(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False, split_special_tokens=as_text).input_ids)

    newline = encode("\n")
    ids = encode("\n" + piece)
    ids = ids[len(newline):] if ids[:len(newline)] == newline else encode(piece)
    if as_text and tokenizer.convert_tokens_to_ids(piece) in ids:
        raise ValueError(f"cannot encode {piece!r} as plain text")
    return ids


def _special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The ids ``add_special_tokens=True`` puts before and after a text's own ids."""
    plain = list(tokenizer("a", add_special_tokens=False).input_ids)
    full = list(tokenizer("a", add_special_tokens=True).input_ids)
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return [], []
