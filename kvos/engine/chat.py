"""Chat messages to prompt token ids through the model's own chat template."""
from __future__ import annotations

_ROLES = ("system", "user", "assistant", "tool", "developer")


def validate_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {_ROLES}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")
    return messages


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template and tokenize the text as is (the
    template already holds the special tokens)."""
    if not has_chat_template(tokenizer):
        raise ValueError("messages: this model has no chat template (a base model); send a plain "
                         "prompt (/v1/completions) instead")
    try:
        text = tokenizer.apply_chat_template(validate_messages(messages),
                                             add_generation_prompt=add_generation_prompt, tokenize=False)
    except ValueError:
        raise
    except Exception as e:  # template errors (e.g. jinja raise_exception) are the input's fault
        raise ValueError(f"messages: the chat template rejected them ({e})") from e
    try:
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    except Exception as e:
        raise ValueError(f"messages: cannot be tokenized ({type(e).__name__}: {e})") from e


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None
