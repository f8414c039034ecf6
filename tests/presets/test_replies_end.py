"""Every tiny preset's replies end by themselves: at seeds 0..9, with the model's default sampling (and at temperature 1
where the default is greedy, so the seeds matter), the reply's finish reason is `stop` (its own end token: <|im_end|>,
end-of-speech, EOS, <eos>, end-of-text), never `length`, within a few dozen tokens (frames for speech), and it says
something first (at least one token, or frame of audio). Random weights made the end token one among hundreds, so
replies ran to their limit; each preset's weights now carry an end (see the `end_*` function of each preset module).
The limits below are far under every request's `max_tokens`, which stays the model's default."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine

SEEDS = range(10)
CHAT = [{"role": "user", "content": "Hello there! What is the capital of France?"}]


@attrs.frozen
class Case:
    model: str
    preset: str
    request: Callable[[int], dict[str, Any]]  # seed -> request
    most: int  # the most tokens (frames) a reply may take before it ends
    counted: str = "next_token"  # the streamed output a token (frame) of the reply is
    finish: str = "finish_reason"  # where the final env says why it ended
    least: int = 1


def _image(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (40, 56, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _speech(seed: int) -> torch.Tensor:
    from tests.whisper.helpers import speech

    return speech(2.0, seed=seed)


def _frames(out: Any) -> bool:
    return out.name == "codes" and out.value is not None


CASES = {
    "llama": Case("llama", "tiny", lambda s: {"messages": CHAT, "seed": s}, 32),
    "llama-t1": Case("llama", "tiny", lambda s: {"messages": CHAT, "seed": s, "temperature": 1.0}, 32),
    "bagel": Case("bagel", "tiny", lambda s: {"task": "understand", "prompt": "What is in the picture?", "seed": s}, 32),
    "bagel-t1": Case("bagel", "tiny", lambda s: {"task": "understand", "content": ["Describe it.", _image(s)],
                                                 "seed": s, "temperature": 1.0}, 32),
    # (the captioner's default max_tokens is 32)
    "captioner": Case("example-captioner", "tiny", lambda s: {"image": _image(s), "seed": s}, 24),
    "captioner-t1": Case("example-captioner", "tiny", lambda s: {"image": _image(s), "seed": s, "temperature": 1.0}, 24),
    # 7 tokens a frame: end-of-speech within 40 frames (about five audio tokens per prompt token)
    "orpheus": Case("orpheus", "tiny", lambda s: {"text": "Hello there.", "voice": "tara", "seed": s}, 280, least=28),
    "qwen3-tts": Case("qwen3-tts", "tiny", lambda s: {"input": "Hello there.", "voice": "ryan", "seed": s}, 32,
                      counted="codes", finish="talker_finish"),
    "qwen3-tts-design": Case("qwen3-tts", "tiny-design", lambda s: {"input": "Hello there.", "seed": s,
                                                                   "instructions": "A calm voice."}, 32,
                             counted="codes", finish="talker_finish"),
    # (greedy, Whisper's default; its preset's positions ramp toward end-of-text, see mstar_whisper.preset)
    "whisper": Case("whisper", "tiny", lambda s: {"audio": _speech(s), "seed": s}, 64),
    "qwen3-omni": Case("qwen3-omni", "tiny", lambda s: {"messages": CHAT, "seed": s}, 48),
}
#: loads and replies that took more than a few seconds on a busy 2-core box (the others: 0.1 to 2.5 s on a quiet one)
SLOW = {"qwen3-tts-design", "whisper"}


async def _replies(case: Case) -> list[tuple[int, Any]]:
    async with AsyncEngine() as engine:
        await engine.load_model(case.model, LoadOptions(preset=case.preset))

        async def one(seed: int) -> tuple[int, Any]:
            handle = engine.submit(case.model, case.request(seed))
            count = 0
            async for out in handle:
                count += _frames(out) if case.counted == "codes" else out.name == case.counted
            return count, (await handle.result()).get(case.finish)

        return await asyncio.gather(*(one(seed) for seed in SEEDS))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_every_seed_ends_by_itself_within_a_few_dozen(name, preset_cache):
    case = CASES[name]
    replies = asyncio.run(asyncio.wait_for(_replies(case), 300))
    bad = {seed: reply for seed, reply in zip(SEEDS, replies, strict=True)
           if reply[1] != "stop" or not case.least <= reply[0] <= case.most}
    assert not bad, f"{name}: (tokens, finish reason) by seed, want 'stop' within {case.least}..{case.most}: {bad}"


#: `ignore_eos` still runs a reply to its limit: the end each preset's weights carry stays within the -100 bias that
#: holds the end token off (llama, orpheus and qwen3-tts bias it; their end logits are bounded by the final norm)
IGNORING = {
    "llama": (Case("llama", "tiny", lambda s: {"messages": CHAT, "seed": s, "max_tokens": 40, "ignore_eos": True}, 40,
                   least=40), "length"),
    "orpheus": (Case("orpheus", "tiny", lambda s: {"text": "Hi.", "voice": "tara", "seed": s, "max_tokens": 350,
                                                   "ignore_eos": True}, 350, least=350), "length"),
    # 48 frames: the last code 0's slot has no frame of codes
    "qwen3-tts": (Case("qwen3-tts", "tiny", lambda s: {"input": "Hello there.", "voice": "ryan", "seed": s,
                                                      "max_frames": 48, "ignore_eos": True}, 47, least=47,
                       counted="codes", finish="talker_finish"), "length"),
}


@pytest.mark.parametrize("name", ["llama", *(pytest.param(n, marks=pytest.mark.slow) for n in ("orpheus", "qwen3-tts"))])
def test_ignore_eos_runs_to_the_limit(name, preset_cache):
    case, finish = IGNORING[name]
    replies = asyncio.run(asyncio.wait_for(_replies(case), 300))
    assert all(reply == (case.most, finish) for reply in replies), replies
