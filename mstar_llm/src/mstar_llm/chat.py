"""Chat templates (HF Jinja) rendered in a sandbox, as `transformers.apply_chat_template` does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from mstar_core.errors import RequestError

#: ChatML, used by the tiny preset (SmolLM2 and Qwen ship the same shape).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def check_messages(messages: Any) -> list[dict[str, str]]:
    """Validate chat messages: a non-empty list of `{"role", "content"}` with string content."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}] must be an object with string 'role' and 'content'", param="messages")
        if m["role"] not in ROLES:
            raise RequestError(f"messages[{i}].role is {m['role']!r}; use one of {list(ROLES)}", param="messages")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def render_chat(template: str, messages: list[dict[str, str]], **special_tokens: str) -> str:
    """The prompt text for `messages`, ending with the assistant's turn opener."""
    from jinja2.exceptions import TemplateError

    try:
        return _compile(template).render(messages=messages, add_generation_prompt=True, **special_tokens)
    except TemplateError as exc:
        raise RequestError(f"the model's chat template rejected these messages: {exc}") from None
