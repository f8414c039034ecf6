"""Whisper, llama and Qwen3-TTS (tiny presets) loaded once on one engine, with the voice agent composed of them."""

from __future__ import annotations

import asyncio
import threading

import pytest

PARTS = {"asr": "whisper", "llm": "llama", "tts": "qwen3-tts"}


class Served:
    """An AsyncEngine on an event loop of its own thread: `run(coro)` from a test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = self.run(self._start())

    async def _start(self):
        from mstar_core.model import LoadOptions
        from mstar_core.runtime import AsyncEngine

        engine = AsyncEngine()
        for model in PARTS.values():
            await engine.load_model(model, LoadOptions(preset="tiny"))
        await engine.compose("agent", "voice_agent", PARTS)
        # one short spoken turn: every node's first call (allocations, kernels) is paid here, not by a test
        import torch

        await engine.generate("agent", {"audio": torch.randn(8000) * 0.1, "max_tokens": 4, "transcript_max_tokens": 2,
                                        "speech_options": {"max_frames": 4}})
        return engine

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="session")
def served():
    s = Served()
    yield s
    s.close()
