"""A composition's parts stay where their placement put them: with llama's `lm` on a worker process, the voice agent's
LLM calls go to that worker (the part's own scheduler, by the part's node name), and a turn is the same, token for
token and sample for sample, as the one composed of parts all in this process."""

from __future__ import annotations

import asyncio

import torch

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config.placement import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover


async def _turn(engine, model: str) -> list[tuple[str, object]]:
    audio = torch.randn(16000, generator=torch.Generator().manual_seed(0)) * 0.1
    request = {"audio": audio, "max_tokens": 12, "transcript_max_tokens": 6, "seed": 1,
               "speech_options": {"max_frames": 12, "seed": 3}}
    return [(out.name, out.value.tolist() if hasattr(out.value, "tolist") else out.value)
            async for out in engine.submit(model, request)]


def test_an_llm_on_a_worker_speaks_the_same_turn_as_one_in_process(tmp_path):
    placement = tmp_path / "placement.yaml"
    placement.write_text("workers:\n  talk: {device: cpu}\nnodes:\n  lm: talk\n")

    async def go():
        engine = placed_engine(discover())
        try:
            for model in ("whisper", "qwen3-tts", "llama"):
                await engine.load_model(model, LoadOptions(preset="tiny"))
            await engine.load_model("llama", LoadOptions(preset="tiny"), alias="llama-placed",
                                    placement=load_placement(placement))
            await engine.compose("here", "voice_agent", {"asr": "whisper", "llm": "llama", "tts": "qwen3-tts"})
            await engine.compose("split", "voice_agent", {"asr": "whisper", "llm": "llama-placed", "tts": "qwen3-tts"})
            scheds = engine.node_schedulers("split")
            assert type(scheds["llm/lm"]).__name__ == "RemoteNodeScheduler"
            assert scheds["llm/lm"] is engine.node_schedulers("llama-placed")["lm"]
            assert "llm/lm" not in engine.node_engines("split")  # its engine is in the worker
            here, split = await _turn(engine, "here"), await _turn(engine, "split")
            assert [name for name, _ in split].count("llm:next_token") >= 1 and "tts:audio" in dict(split)
            assert split == here
            assert [n for n, _, _ in engine.node_stats("split")].count("llm/lm") == 0  # reported by llama-placed
        finally:
            await engine.close()

    asyncio.run(go())


def test_a_part_node_placed_per_walk_serves_the_composition_from_its_default_place(tmp_path):
    """llama's prefill walk on a worker: the composition runs walks of its own, which the placement does not name,
    so its LLM calls take the node's default scheduler (this process's, as for any walk not named)."""
    placement = tmp_path / "placement.yaml"
    placement.write_text("workers:\n  prefill: {device: cpu}\nnodes:\n  lm: {prefill: prefill}\n")

    async def go():
        engine = placed_engine(discover())
        try:
            for model in ("whisper", "qwen3-tts"):
                await engine.load_model(model, LoadOptions(preset="tiny"))
            await engine.load_model("llama", LoadOptions(preset="tiny"), placement=load_placement(placement))
            await engine.compose("agent", "voice_agent", {"asr": "whisper", "llm": "llama", "tts": "qwen3-tts"})
            lm = engine.node_schedulers("agent")["llm/lm"]
            assert lm is engine.node_schedulers("llama")["lm"] and type(lm).__name__ == "NodeScheduler"
        finally:
            await engine.close()

    asyncio.run(go())
