"""Offline synthesis: text -> WAV file, with a progress bar (what `mstar run orpheus` calls)."""

from __future__ import annotations

import asyncio
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar_core.model import LoadedModel, LoadOptions
from mstar_orpheus.codes import to_int16


async def synthesize(
    engine: Any, text: str, voice: str = "tara", *, model: str = "orpheus", progress: bool = True, **inputs: Any
) -> tuple[np.ndarray, int]:
    """Run one request on a running `AsyncEngine`; return (int16 samples, sample rate)."""
    from tqdm.auto import tqdm

    loaded = engine.models[model]
    rate = int(loaded.extras.get("sample_rate", 24000))
    handle = engine.submit(model, {"text": text, "voice": voice, **inputs})
    chunks: list[torch.Tensor] = []
    total = inputs.get("max_tokens") or None
    with tqdm(total=total, desc=f"{model} ({voice})", unit="tok", disable=not progress, leave=False) as bar:
        async for out in handle:
            if out.name == "next_token":
                bar.update()
            elif out.name == "audio":
                chunks.append(out.value)
                bar.set_postfix(audio=f"{sum(len(c) for c in chunks) / rate:.2f}s")
    await handle.result()
    audio = torch.cat(chunks) if chunks else torch.zeros(0)
    return to_int16(audio).numpy(), rate


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int) -> Path:
    """Write mono int16 PCM as a WAV file."""
    path = Path(path)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(np.asarray(samples, dtype=np.int16).tobytes())
    return path


def synthesize_to_wav(
    engine_or_model: LoadedModel | LoadOptions | str | None,
    text: str,
    voice: str,
    out_path: str | Path,
    progress: bool = True,
    **inputs: Any,
) -> Path:
    """Synthesize `text` to `out_path` (blocking; starts its own event loop).

    `engine_or_model`: a `LoadedModel`, `LoadOptions`, a checkpoint directory, or None for the tiny
    preset. Extra keyword inputs (`max_tokens`, `seed`, sampling fields) go to the request. From
    inside a running event loop, use `await synthesize(engine, ...)` and `write_wav` instead.
    """

    async def run() -> Path:
        # the runtime is imported when synthesis runs: `import mstar_orpheus` (this module with it) stays light
        from mstar_core.runtime import AsyncEngine

        async with AsyncEngine() as engine:
            if isinstance(engine_or_model, LoadedModel):
                await engine.add_model(engine_or_model)
                name = engine_or_model.name
            else:
                options = engine_or_model
                if options is None or isinstance(options, str):
                    options = LoadOptions(checkpoint=options) if options else LoadOptions(preset="tiny")
                name = (await engine.load_model("orpheus", options)).name
            samples, rate = await synthesize(engine, text, voice, model=name, progress=progress, **inputs)
        return write_wav(out_path, samples, rate)

    return asyncio.run(run())
