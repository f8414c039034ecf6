"""Qwen3-TTS: M* (Talker, code predictor and speech decoder streaming on the shared engines) vs the `qwen-tts` package.

Baseline: the package's `Qwen3TTSForConditionalGeneration.generate` (the transformers-5 build `qwen-tts-compat`
0.1.1.post1) then its tokenizer decoder's `chunked_decode`, request by request, as its wrapper runs them; it returns
audio when everything is done. Same random weights (a CPU-sized model in the published layout, loaded by both), same
run, fixed lengths (`--frames` frames of 80 ms; end of speech ruled out on both sides), the published sampling
defaults on both sides.

- `ttfa_ratio_c1`: M*'s time to its first audio chunk (the first 25-frame window) over the baseline's time to its
  audio. Target <= 0.3.
- `throughput_ratio_c16`: audio seconds per wall second with 16 concurrent requests on M* over the baseline's
  request-by-request rate, every request admitted at once (the Talker's `admit_streams` off: what a batch
  deployment sets). Target >= 3. `throughput_ratio_c16_served_default`: the same wave on the model as served, whose
  admission holds requests back to keep listeners ahead (it cannot tell a played stream from a whole file).
- `viability_c32`: the share of 32 concurrent streams that never run dry once playing (each chunk arrives before the
  audio before it has played out, playback starting at the first chunk), with the walk's stream priority (every call
  of a request's frame loop ranked by how close its listener is to running dry, `priority: true` in the JSON) and the
  Talker's adaptive admission (node setting `admit_streams`, on by default: the model as served): a new stream waits until the admitted
  ones each stay ahead of their listeners at a measured speed with room for one more; a waiting stream has not
  started playing, so it cannot run dry, its listener hears a later start (`crowd_ttfa_s`: p50 / p99 seconds from
  submission to first audio in each crowd; `crowd_audio_per_s`: the crowd's audio seconds per wall second).
  `viability_c32_fixed_admission`: a fixed admission instead, the Talker and code predictor admitting
  `admitted_streams` requests at a time (`max_active_requests` sized to the throughput wave's audio seconds per
  second / `ADMIT_MARGIN` (2), as an operator sizes it to one measurement of the machine).
  `viability_c32_unbounded`: the same with every stream admitted at once (32 streams share every step, so on a box
  that speaks fewer than 32 in real time all of them run dry).
- `viability_c32_fifo`: the same crowd on the same weights served FIFO: the graph built with `priority=False` and
  the frame loop's kvcache nodes (Talker, code predictor) taking calls in submission order (`call_order: "fifo"`,
  as Orpheus's benchmark defines FIFO), every stream admitted; `viability_c32_fifo_admitted`: FIFO with the fixed
  admission (which of the two levers, priority or admission, holds the streams).
- `clone_cached_speedup`: a cloned voice's request time with the stored x-vector (what `/v1/audio/voices` keeps)
  over the time with the speaker encoder run per request on the reference audio (what an uncached server does).
- `clone_icl_cached_speedup`: the same for a voice created with its transcript (in-context cloning): the stored
  x-vector and reference codes, against running the speaker encoder and the tokenizer's encoder per request.
- `stream_first_audio_ms`: text arriving word by word (as from an LLM), cut by `TextChunker`: milliseconds from the
  word that completes the first sentence to that sentence's first audio.

`--quick` (< 60 s on an idle box) runs smaller lengths and counts (27 frames; c=1 once, c=4 for throughput, c=4 for
each viability crowd; the keys keep their names, `concurrency` says what ran). Timings on a
small shared CPU box are noisy; the ratios are what to read.

    python benchmarks/qwen_tts.py --quick
    python benchmarks/qwen_tts.py --diagnose --trace crowds.json   # the admitted crowds alone, every chunk and step
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# this file is `qwen_tts.py`: its own folder off the path, so `import qwen_tts` finds the package, not this script
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

SIZE = {"talker": 256, "talker_layers": 4, "groups": 16, "decoder": 64, "encoder": 32}


def write_checkpoint(directory: Path) -> Path:
    """The tiny Base preset widened (Talker 256 x 4, 16 code groups, the published decoder and encoder rates; the
    encoder's 32 quantizers of which 16 are kept, as published), seeded weights."""
    from mstar_qwen_tts.checkpoint import QwenTTS
    from mstar_qwen_tts.config import SpeechDecoderConfig, SpeechEncoderConfig, TTSConfig
    from mstar_qwen_tts.preset import (
        build_tokenizer,
        random_speech_encoder,
        randomize,
        tiny_config,
        tiny_speech_tokenizer_config,
    )
    from mstar_qwen_tts.speech_decoder import SpeechDecoder

    from mstar_core.checkpoint import save_hf_checkpoint

    tok = build_tokenizer()
    cfg = tiny_config(tok, "base")
    tk, groups = SIZE["talker"], SIZE["groups"]
    cfg["talker_config"].update(hidden_size=tk, intermediate_size=2 * tk, num_hidden_layers=SIZE["talker_layers"],
                                num_attention_heads=tk // 64, num_key_value_heads=2, head_dim=64,
                                num_code_groups=groups,
                                rope_scaling={"rope_type": "default", "mrope_section": [12, 10, 10],
                                              "interleaved": True})
    cfg["talker_config"]["code_predictor_config"].update(hidden_size=tk, intermediate_size=2 * tk,
                                                         num_hidden_layers=2, num_attention_heads=tk // 64,
                                                         num_key_value_heads=2, head_dim=64, num_code_groups=groups)
    cfg["speaker_encoder_config"]["enc_dim"] = tk
    model = QwenTTS(TTSConfig.from_hf(cfg))
    randomize(model, 0)
    save_hf_checkpoint(model.state_dict(), directory, cfg, extra_files={"tokenizer.json": tok.to_str()})
    speech = tiny_speech_tokenizer_config()
    dec = SIZE["decoder"]
    speech["decoder_config"].update(codebook_dim=dec, hidden_size=dec, latent_dim=dec, num_attention_heads=4,
                                    num_key_value_heads=4, intermediate_size=2 * dec, num_hidden_layers=2,
                                    num_quantizers=groups, sliding_window=72, upsample_rates=[8, 5, 4, 3],
                                    upsampling_ratios=[2, 2], decoder_dim=dec)
    enc = SIZE["encoder"]
    speech["encoder_config"].update(hidden_size=enc, num_filters=enc // 16, codebook_dim=enc // 2,
                                    vector_quantization_hidden_dimension=enc // 2, num_quantizers=2 * groups,
                                    upsample_groups=enc, intermediate_size=4 * enc, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=2, head_dim=enc // 2,
                                    sliding_window=250)
    speech.update(decode_upsample_rate=1920, encode_downsample_rate=1920, encoder_valid_num_quantizers=groups)
    decoder = SpeechDecoder(SpeechDecoderConfig.from_hf(speech))
    randomize(decoder, 1)
    encoder = random_speech_encoder(SpeechEncoderConfig.from_hf(speech), 2)
    save_hf_checkpoint({**{f"decoder.{k}": v for k, v in decoder.state_dict().items()}, **encoder.state_dict()},
                       directory / "speech_tokenizer", speech)
    return directory


def log(*what) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *what, file=sys.stderr, flush=True)


def reference_voice(seconds: float = 3.0) -> torch.Tensor:
    t = torch.arange(int(seconds * 24000)) / 24000
    return (0.3 * torch.sin(2 * torch.pi * 160 * t) * (1 + 0.3 * torch.sin(2 * torch.pi * 3 * t))).clamp(-1, 1)


SAMPLING = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05}
TEXT = "Hello there, this is a benchmark of streaming speech."
#: Every request admitted at once (the Talker's default `admit_streams` turned off): the throughput wave, the unbounded
#: and the FIFO crowds
ADMIT_ALL = {"talker": {"admit_streams": False}}
#: Real-time speed each admitted stream keeps in the crowd: the admitted count is the c=16 wave's audio seconds per
#: second over this (fewer streams batch less well than 16, and a joining request's prefill slows the others)
ADMIT_MARGIN = 2.0


def baseline(ref, decoder, ids: list[int], embedding: torch.Tensor, frames: int) -> tuple[float, float]:
    """(seconds to the audio, audio seconds) of one upstream generate + decode, end of speech ruled out."""
    start = time.perf_counter()
    vocab = ref.config.talker_config.vocab_size
    with torch.no_grad():
        codes, _ = ref.generate(
            input_ids=[torch.tensor([ids])], languages=["auto"], speakers=[None], non_streaming_mode=False,
            voice_clone_prompt={"ref_spk_embedding": [embedding], "x_vector_only_mode": [True], "icl_mode": [False],
                                "ref_code": None},
            max_new_tokens=frames + 1, eos_token_id=vocab - 1,  # a suppressed id: never sampled, so no early end
            subtalker_temperature=0.9, subtalker_top_k=50, subtalker_top_p=1.0, **SAMPLING)
        wav = decoder.chunked_decode(codes[0].t()[None], chunk_size=300, left_context_size=25)
    return time.perf_counter() - start, wav.shape[-1] / 24000


async def mstar_one(engine, embedding: list[float], frames: int, seed: int, model: str = "qwen3-tts",
                    icl: dict | None = None) -> dict:
    """One request; `icl`: the in-context prompt (`ref_text`, `ref_codes`) of a voice created with its transcript."""
    start = time.perf_counter()
    handle = engine.submit(model, {"input": TEXT, "speaker_embedding": embedding, "max_frames": frames + 1,
                                   "ignore_eos": True, "seed": seed, **(icl or {}), **SAMPLING})
    arrivals, samples = [], 0
    async for out in handle:
        if out.name == "audio":
            samples += out.value.numel()
            arrivals.append((time.perf_counter() - start, samples / 24000))
    await handle.result()
    return {"ttfa": arrivals[0][0], "total": time.perf_counter() - start, "audio": samples / 24000,
            "arrivals": arrivals, "start": start, "request_id": handle.request_id}


def viable(arrivals: list[tuple[float, float]]) -> bool:
    """Playback starts at the first chunk; chunk i must arrive before the audio of the chunks before it played."""
    return not stalls(arrivals)


def stalls(arrivals: list[tuple[float, float]]) -> list[tuple[int, float]]:
    """(chunk index, seconds late) for each chunk that arrived after the audio before it had played out."""
    t0, played, late = arrivals[0][0], 0.0, []
    for i, (at, total) in enumerate(arrivals):
        if at - t0 > played + 1e-3:
            late.append((i, at - t0 - played))
        played = total
    return late


async def stream_first_audio(engine, embedding: list[float], frames: int) -> float:
    """Words arrive every 50 ms; ms from the word that ends the first sentence to that sentence's first audio."""
    from mstar_core.api.requests.text_chunks import TextChunker

    chunker, words = TextChunker(), "Hello there friend. And then more words follow here".split(" ")
    for i, word in enumerate(words):
        segments = chunker.push(word + " ")
        if segments:
            said = time.perf_counter()
            handle = engine.submit("qwen3-tts", {"input": segments[0].strip(), "speaker_embedding": embedding,
                                                 "max_frames": frames + 1, "ignore_eos": True, "seed": i})
            async for out in handle:
                if out.name == "audio":
                    first = time.perf_counter() - said
                    handle.cancel()
                    return 1000 * first
        await asyncio.sleep(0.05)
    raise RuntimeError("no sentence ended")


class StepTrace:
    """Records every step of a model's nodes (node, start, end, calls answered) and when each request's first call
    reached each node's engine (its admission there) while installed."""

    def __init__(self, engine, model: str):
        self.steps: list[tuple[str, float, float, int]] = []
        self.first_calls: dict[str, dict[str, float]] = {}  # node -> request id -> time
        self._undo = []
        for name, scheduler in engine.node_schedulers(model).items():
            inner = scheduler.engine
            step, add = inner.step, inner.add
            firsts = self.first_calls.setdefault(name, {})

            def traced(step=step, name=name):
                began = time.perf_counter()
                results = step()
                self.steps.append((name, began, time.perf_counter(), len(results)))
                return results

            def added(invocation, add=add, firsts=firsts):
                firsts.setdefault(invocation.request_id, time.perf_counter())
                return add(invocation)

            inner.step, inner.add = traced, added
            self._undo.append(inner)

    def remove(self) -> None:
        for inner in self._undo:
            del inner.step, inner.add  # (the instance attributes set above: the class's methods again)


async def crowd_viability(engine, model: str, emb: list[float], frames: int, count: int, seed: int,
                          trace: list | None = None) -> dict:
    """The crowd's viability, its time-to-first-audio p50/p99 and wall time; with `trace`, each stream's arrivals
    and every step of the model's nodes are appended to it."""
    steps = StepTrace(engine, model) if trace is not None else None
    began = time.perf_counter()
    crowd = await asyncio.gather(*(mstar_one(engine, emb, frames, seed + i, model) for i in range(count)))
    wall = time.perf_counter() - began
    if steps is not None:
        steps.remove()
        trace.append({"model": model, "began": began, "streams": crowd, "steps": steps.steps,
                      "admitted": steps.first_calls.get("talker", {})})
    ttfa = sorted(r["ttfa"] for r in crowd)
    return {"viability": sum(viable(r["arrivals"]) for r in crowd) / len(crowd),
            "ttfa_p50": statistics.median(ttfa), "ttfa_p99": ttfa[min(len(ttfa) - 1, round(0.99 * (len(ttfa) - 1)))],
            "wall": wall, "audio_per_s": sum(r["audio"] for r in crowd) / wall}


async def run_mstar(directory: Path, args, voice: torch.Tensor) -> dict:
    import attrs
    from mstar_qwen_tts.graph import build_graph

    from mstar_core.model import LoadOptions
    from mstar_core.plugins import discover
    from mstar_core.runtime import AsyncEngine

    out: dict = {}
    async with AsyncEngine(discover()) as engine:
        loaded = await engine.load_model("qwen3-tts", LoadOptions(checkpoint=str(directory)))
        # the same weights served FIFO: no stream priority, the frame loop's calls taken in submission order
        fifo_graph = build_graph(loaded.extras["model"], loaded.extras["decoder"], priority=False)
        fifo = {"talker": {"call_order": "fifo", "admit_streams": False}, "code_predictor": {"call_order": "fifo"}}
        await engine.add_model(attrs.evolve(loaded, graph=fifo_graph), alias="qwen3-tts-fifo", settings=fifo)
        await engine.add_model(loaded, alias="qwen3-tts-all", settings=ADMIT_ALL)
        encoder, codec_encoder = loaded.extras["model"].speaker_encoder, loaded.extras["speech_encoder"]
        out["embedding"] = encoder.embed(voice)  # the voice as `/v1/audio/voices` stores it
        emb = out["embedding"].tolist()
        # a voice created with its transcript also keeps its reference codes
        icl = {"ref_text": "A warm voice.", "ref_codes": codec_encoder.encode(voice).flatten().tolist()}
        await mstar_one(engine, emb, 4, 0)  # warm-up
        await mstar_one(engine, emb, 4, 0, "qwen3-tts-fifo")
        await mstar_one(engine, emb, 4, 0, "qwen3-tts-all")
        log("loaded and warm")
        c1 = [await mstar_one(engine, emb, args.frames, i) for i in range(args.c1)]
        out["ttfa_c1"] = statistics.median(r["ttfa"] for r in c1)
        log("c1", c1[0]["ttfa"], c1[0]["total"])
        start = time.perf_counter()
        wave = await asyncio.gather(*(mstar_one(engine, emb, args.frames, 100 + i, "qwen3-tts-all")
                                      for i in range(args.cthroughput)))
        out["audio_per_s"] = sum(r["audio"] for r in wave) / (time.perf_counter() - start)
        log("throughput wave", time.perf_counter() - start)
        # the crowd exceeds what the box speaks in real time. Adaptive admission (the target figure): the model as
        # served, whose Talker admits a new stream only while the admitted ones stay ahead of their listeners (its
        # default `admit_streams`; `--admit-streams` tries other margins)
        adaptive = "qwen3-tts"
        if args.admit_streams is not None:
            adaptive = "qwen3-tts-adaptive"
            await engine.add_model(loaded, alias=adaptive,
                                   settings={"talker": {"admit_streams": json.loads(args.admit_streams)}})
        trace = [] if args.trace else None
        crowds = out["crowds"] = {}
        policy = engine.node_schedulers(adaptive)["talker"].engine.admit_streams
        out["admit_streams"] = attrs.asdict(policy)
        # the throughput wave again on the model as served: its admission holds requests back whether or not a
        # listener plays them (the model cannot tell), so a batch of whole files gets this rate unless it is turned off
        start = time.perf_counter()
        wave = await asyncio.gather(*(mstar_one(engine, emb, args.frames, 100 + i, adaptive)
                                      for i in range(args.cthroughput)))
        out["audio_per_s_served_default"] = sum(r["audio"] for r in wave) / (time.perf_counter() - start)
        log("throughput wave, the served default's admission", time.perf_counter() - start)
        crowds["adaptive"] = await crowd_viability(engine, adaptive, emb, args.frames, args.cviable, 200, trace)
        log("viability wave (priority, adaptive admission)", crowds["adaptive"])
        # fixed admission: as many streams as the throughput wave showed the box sustains at ADMIT_MARGIN x real
        # time (the node setting an operator sizes to the machine), the rest wait
        out["admitted"] = admitted = max(1, int(out["audio_per_s"] / ADMIT_MARGIN))
        admit = {"talker": {"max_active_requests": admitted, "admit_streams": False},
                 "code_predictor": {"max_active_requests": admitted}}
        await engine.add_model(loaded, alias="qwen3-tts-admit", settings=admit)
        crowds["fixed"] = await crowd_viability(engine, "qwen3-tts-admit", emb, args.frames, args.cviable, 200, trace)
        log("viability wave (priority, admitting", admitted, ")", crowds["fixed"])
        if args.trace:
            write_trace(args.trace, trace)
        if args.diagnose:
            return out
        crowds["unbounded"] = await crowd_viability(engine, "qwen3-tts-all", emb, args.frames, args.cviable, 200)
        log("viability wave (priority, every stream admitted)", crowds["unbounded"])
        crowds["fifo"] = await crowd_viability(engine, "qwen3-tts-fifo", emb, args.frames, args.cviable, 200)
        log("viability wave (fifo)", crowds["fifo"])
        fifo_admit = {node: {**admit[node], "call_order": "fifo"} for node in admit}
        await engine.add_model(attrs.evolve(loaded, graph=fifo_graph), alias="qwen3-tts-fifo-admit", settings=fifo_admit)
        crowds["fifo_admitted"] = await crowd_viability(engine, "qwen3-tts-fifo-admit", emb, args.frames, args.cviable,
                                                        200)
        log("viability wave (fifo, admitting", admitted, ")", crowds["fifo_admitted"])
        cached, uncached = [], []
        for i in range(args.c1):
            cached.append((await mstar_one(engine, emb, args.clone_frames, 300 + i))["total"])
            start = time.perf_counter()
            fresh = encoder.embed(voice).tolist()  # an uncached server: the encoder on every request
            r = await mstar_one(engine, fresh, args.clone_frames, 300 + i)
            assert r["audio"] > 0
            uncached.append(time.perf_counter() - start)
        out["clone_cached_speedup"] = statistics.median(uncached) / statistics.median(cached)
        cached, uncached = [], []
        for i in range(args.c1):
            cached.append((await mstar_one(engine, emb, args.clone_frames, 400 + i, icl=icl))["total"])
            start = time.perf_counter()
            fresh = encoder.embed(voice).tolist()  # uncached: both encoders on every request
            fresh_icl = {**icl, "ref_codes": codec_encoder.encode(voice).flatten().tolist()}
            r = await mstar_one(engine, fresh, args.clone_frames, 400 + i, icl=fresh_icl)
            assert r["audio"] > 0
            uncached.append(time.perf_counter() - start)
        out["clone_icl_cached_speedup"] = statistics.median(uncached) / statistics.median(cached)
        out["stream_first_audio_ms"] = await stream_first_audio(engine, emb, args.clone_frames)
    return out


def write_trace(path: str, trace: list) -> None:
    """Each crowd's streams (submitted, chunk arrivals and stalls, on the crowd's clock) and steps, as JSON."""
    crowds = []
    for crowd in trace:
        began = crowd["began"]
        streams = [{"request_id": r["request_id"], "submitted": r["start"] - began,
                    "admitted": crowd["admitted"].get(r["request_id"], began) - began,
                    "arrivals": [(r["start"] - began + at, audio) for at, audio in r["arrivals"]],
                    "stalls": stalls(r["arrivals"])} for r in crowd["streams"]]
        steps = [(node, t0 - began, t1 - began, calls) for node, t0, t1, calls in crowd["steps"]]
        crowds.append({"model": crowd["model"], "streams": streams, "steps": steps})
    Path(path).write_text(json.dumps(crowds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--frames", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trace", help="write each stream's chunk arrivals and every step of the admitted crowds here "
                                   "(JSON), with the stalls found")
    p.add_argument("--admit-streams", help="the adaptive crowd's Talker `admit_streams` as JSON (default: the "
                                           "model's own), e.g. '{\"max_starting\": 2}'")
    p.add_argument("--diagnose", action="store_true", help="only the throughput wave and the admitted crowds (with "
                                                           "--trace: to explain stalls); no baseline")
    args = p.parse_args()
    args.c1, args.cthroughput, args.cviable, args.clone_frames = 3, 16, 32, 25
    if args.quick:
        args.frames, args.c1, args.cthroughput, args.cviable, args.clone_frames = 27, 1, 4, 4, 4
    torch.set_num_threads(args.threads)
    from mstar_qwen_tts.prepare import assistant_text

    from mstar_core.checkpoint import load_tokenizer
    from tests.qwen_tts.oracle import load_reference, load_reference_decoder

    with tempfile.TemporaryDirectory() as tmp:
        directory = write_checkpoint(Path(tmp) / "qwen3-tts-bench")
        voice = reference_voice()
        mstar = asyncio.run(run_mstar(directory, args, voice))
        if args.diagnose:
            print(json.dumps({"audio_per_s": round(mstar["audio_per_s"], 2), "admitted": mstar["admitted"],
                              "admit_streams": mstar["admit_streams"],
                              "crowds": mstar["crowds"], "loadavg": os.getloadavg()[0]}))
            return
        embedding = mstar["embedding"]
        ref, ref_decoder = load_reference(directory), load_reference_decoder(directory)
        ids = load_tokenizer(directory).encode(assistant_text(TEXT), add_special_tokens=False).ids
        log("baseline loaded")
        runs = [baseline(ref, ref_decoder, ids, embedding, args.frames) for _ in range(1 if args.quick else 2)]
        log("baseline", runs)
    crowds = mstar["crowds"]
    base_ttfa = statistics.median(t for t, _ in runs)
    base_rate = sum(a for _, a in runs) / sum(t for t, _ in runs)
    result = {
        "ttfa_ratio_c1": round(mstar["ttfa_c1"] / base_ttfa, 3),
        # (the keys keep their names under --quick, which runs fewer concurrent requests: see "concurrency")
        "throughput_ratio_c16": round(mstar["audio_per_s"] / base_rate, 3),
        "throughput_ratio_c16_served_default": round(mstar["audio_per_s_served_default"] / base_rate, 3),
        "viability_c32": round(crowds["adaptive"]["viability"], 3),
        "viability_c32_fixed_admission": round(crowds["fixed"]["viability"], 3),
        "admitted_streams": mstar["admitted"],
        "admit_streams": mstar["admit_streams"],  # the adaptive crowd's policy (the model's default unless given)
        "viability_c32_unbounded": round(crowds["unbounded"]["viability"], 3),
        "viability_c32_fifo": round(crowds["fifo"]["viability"], 3),
        "viability_c32_fifo_admitted": round(crowds["fifo_admitted"]["viability"], 3),
        # time to first audio in the c=32 crowds (admitted-late streams wait for a place), and audio seconds a second
        "crowd_ttfa_s": {name: [round(c["ttfa_p50"], 2), round(c["ttfa_p99"], 2)] for name, c in crowds.items()},
        "crowd_audio_per_s": {name: round(c["audio_per_s"], 2) for name, c in crowds.items()},
        "concurrency": {"throughput": args.cthroughput, "viability": args.cviable},
        "priority": True,
        "clone_cached_speedup": round(mstar["clone_cached_speedup"], 3),
        "clone_icl_cached_speedup": round(mstar["clone_icl_cached_speedup"], 3),
        "stream_first_audio_ms": round(mstar["stream_first_audio_ms"], 1),
        "mstar_ttfa_c1_s": round(mstar["ttfa_c1"], 3), "baseline_audio_s": round(base_ttfa, 3),
        "frames": args.frames, "quick": args.quick, "baseline": "qwen-tts-compat 0.1.1.post1",
        "loadavg": os.getloadavg()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
