"""The names a voice agent's composed graph uses for its own glue: its nodes (`agent/<name>`), its env names
(`agent:<name>`), the roles it fills, and what it emits."""

from __future__ import annotations

ROLES = ("asr", "llm", "tts")
GLUE = "agent"
#: what the composed model emits, by meaning (the realtime route reads these names from `extras["outputs"]`)
OUTPUTS = {"transcript": "agent:transcript", "prompt_ids": "agent:prompt_ids", "token": "llm:next_token",
           "audio": "tts:audio", "spoken_text": "agent:spoken_text"}
#: the request fields the chat model's part takes from a turn (checked by its own schema)
LLM_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "grammar")


def env(name: str) -> str:
    return f"{GLUE}:{name}"


def node(name: str) -> str:
    return f"{GLUE}/{name}"
