"""Orpheus streaming TTS: M* (paged-KV LM streaming into batched SNAC windows) vs the no-serving-system pipeline.

Reference pipeline (what a user writes without a serving system): `transformers` `generate` over
all requests as one left-padded batch, then every 28-token window of every request decoded by the
`snac` package in batches of 16, keeping the reference slice. Same weights, same run.

Reported per concurrency (1, 4, 16): time to first audio (TTFA), real-time factor (request wall
time / its audio duration) and audio-seconds per second; requests differ in length, as utterances
do. `ttfa_ratio_c1` divides M*'s TTFA at concurrency 1 by the compute floor timed here: prefill +
28 decode steps with a dense KV cache and the same sampling rules + one SNAC window, with no
runtime around them (medians of interleaved pairs).

Streaming viability at 32 concurrent streams (`viability_c32_priority`, `viability_c32_fifo`): the
fraction of requests whose audio never stalls after its first chunk when played back in real time
(a chunk arriving after the audio before it has finished playing is a stall). The same load runs
with the LM's decode steps ranked by the listener's remaining audio (Orpheus's stream priority) and
in arrival order (FIFO), alternately, on one engine; the LM decodes at most `--viability-rows`
rows per step, so it has to choose. Final line: JSON.

    python benchmarks/orpheus_streaming.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hey there, my name is Tara, and I speak in real time.",
    "Streaming audio keeps the first sound early <laugh> even for long replies.",
    "The quick brown fox jumps over the lazy dog.",
    "How vexingly quick daft zebras jump!",
]
SNAC_WINDOW_BATCH = 16


def bench_config(quick: bool):
    """A small but structurally real Orpheus: Llama with llama3 rope + SNAC 24 kHz layout (hop 512, 4096 codes)."""
    from mstar_orpheus.snac import SNACConfig

    snac = SNACConfig(
        sampling_rate=24000, encoder_dim=8, encoder_rates=(2, 4, 8, 8), decoder_dim=64 if quick else 128,
        decoder_rates=(8, 8, 4, 2), codebook_size=4096, codebook_dim=8, vq_strides=(4, 2, 1),
    )
    lm = (
        {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4}
        if quick
        else {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 4}
    )
    return snac, lm


class DenseKVCache:
    """One sequence's KV cache in plain tensors: the compute floor's attention, no paging, no runtime."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer, q, k, v, scale):
        if layer in self.k:
            k = torch.cat([self.k[layer], k])
            v = torch.cat([self.v[layer], v])
        self.k[layer], self.v[layer] = k, v
        hq, hkv = q.shape[1], k.shape[1]
        kh = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vh = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        causal = q.shape[0] > 1  # prefill starts from an empty cache, so plain causal is right
        out = F.scaled_dot_product_attention(q.transpose(0, 1), kh, vh, is_causal=causal, scale=scale)
        return out.transpose(0, 1)


def sample_like_orpheus(logits: torch.Tensor, seen: torch.Tensor) -> int:
    """Repetition penalty 1.3, temperature 0.6, top-p 0.8: the work every implementation does per token."""
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / 1.3, picked * 1.3)
    probs = torch.softmax(logits / 0.6, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    keep = (sorted_probs.cumsum(0) - sorted_probs) < 0.8
    sorted_probs = sorted_probs * keep
    return int(order[torch.multinomial(sorted_probs, 1)])


@torch.inference_mode()
def compute_floor(lm, snac_node, prompt: list[int]) -> tuple[float, float]:
    """(wall, process CPU) seconds for prefill + 28 decode steps (same sampling rules) + one SNAC window."""
    from mstar_orpheus.codes import WINDOW_TOKENS

    audio = snac_node.tokens
    window = [audio.first + (i % 7) * audio.codebook_size + 1 for i in range(WINDOW_TOKENS)]
    t0, c0 = time.perf_counter(), time.process_time()
    cache = DenseKVCache()
    ids = torch.tensor(prompt[:-1])
    hidden = lm(ids, torch.arange(len(ids)), cache)
    pos = len(ids)
    token = prompt[-1]
    seen = torch.tensor(prompt)
    for _ in range(WINDOW_TOKENS):
        hidden = lm(torch.tensor([token]), torch.tensor([pos]), cache)
        token = sample_like_orpheus(lm.compute_logits(hidden[-1:])[0], seen)
        seen = torch.cat([seen, torch.tensor([token])])
        pos += 1
    snac_node.decode_windows([(window, 0, 0)])
    return time.perf_counter() - t0, time.process_time() - c0


def request_lengths(concurrency: int, shortest: int, longest: int) -> list[int]:
    """Tokens per request: utterances differ in length (spread evenly, whole frames, deterministic)."""
    frames = (longest - shortest) // 7
    return [shortest + 7 * ((i * 5) % (frames + 1)) for i in range(concurrency)]


async def run_mstar(engine, lengths: list[int], rate: int) -> dict:
    """Submit one request per entry of `lengths` at once; TTFA = first non-empty audio chunk."""
    t0, c0 = time.perf_counter(), time.process_time()
    handles = [
        engine.submit("orpheus", {"text": TEXTS[i % len(TEXTS)], "voice": "tara", "max_tokens": n, "seed": i})
        for i, n in enumerate(lengths)
    ]

    first_cpu = []

    async def one(handle):
        first, samples = None, 0
        async for out in handle:
            if out.name == "audio" and out.value.numel():
                if first is None:
                    first = time.perf_counter() - t0
                    first_cpu.append(time.process_time() - c0)
                samples += out.value.numel()
        await handle.result()
        return first, time.perf_counter() - t0, samples

    results = await asyncio.gather(*(one(h) for h in handles))
    wall = time.perf_counter() - t0
    summary = _summary([r[0] for r in results], [r[1] for r in results], [r[2] for r in results], wall, rate)
    summary["first_audio_cpu_s"] = min(first_cpu)
    return summary


async def run_viability(engine, model: str, lengths: list[int], gap: float, window_s: float) -> float:
    """Fraction of requests whose playback never stalls after the first chunk (arrivals `gap` s apart).

    Every SNAC window counts as `window_s` of audio, also one whose codes a random-weight LM left
    outside the codebook (decoded to nothing, as the reference skips it): the figure is about when
    windows arrive, which the serving system decides, not about what random weights say.
    """

    async def one(i: int, n: int) -> bool:
        await asyncio.sleep(i * gap)
        handle = engine.submit(model, {"text": TEXTS[i % len(TEXTS)], "voice": "tara", "max_tokens": n, "seed": i})
        start = None  # when playback started
        queued = 0.0  # seconds of audio received so far
        stalled = False
        async for out in handle:
            if out.name != "audio":
                continue
            now = time.perf_counter()
            if start is None:
                start = now
            elif now > start + queued + 1e-3:  # the listener already heard everything before this chunk
                stalled = True
            queued += window_s
        await handle.result()
        return not stalled

    ok = await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))
    return sum(ok) / len(ok)


def _summary(ttfa, ends, samples, wall, rate) -> dict:
    audio_s = [s / rate for s in samples]
    return {
        "ttfa_s": statistics.mean(ttfa),
        "rtf": statistics.mean(e / a for e, a in zip(ends, audio_s, strict=True) if a > 0),
        "audio_s_per_s": sum(audio_s) / wall,
        "audio_s": sum(audio_s),
        "wall_s": wall,
    }


def load_reference(directory: Path):
    """HF `LlamaForCausalLM` and the `snac` package's SNAC, from the same checkpoint files."""
    import snac
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    cfg = json.loads((directory / "snac" / "config.json").read_text())
    ref = snac.SNAC(**cfg).eval()
    missing, unexpected = ref.load_state_dict(load_file(str(directory / "snac" / "model.safetensors")), strict=False)
    assert not unexpected and all(k.startswith("encoder.") or ".in_proj." in k for k in missing), missing
    return hf, ref


@torch.inference_mode()
def run_reference(hf, snac_ref, prompts: list[list[int]], lengths: list[int], vocab, rate: int) -> dict:
    """HF generate over the left-padded batch, then all windows through SNAC in batches.

    The batch runs until its longest request is done; each row is then cut to its own length,
    as an end-of-speech token would cut it.
    """
    max_tokens = max(lengths)
    from mstar_orpheus.codes import reference_windows, tokens_to_codes, window_slice

    t0 = time.perf_counter()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.6, top_p=0.8, repetition_penalty=1.3,
        max_new_tokens=max_tokens, min_new_tokens=max_tokens, eos_token_id=vocab.end_of_speech, pad_token_id=0,
    )
    windows = []  # (request, codes)
    for r, row in enumerate(out[:, width:].tolist()):
        for start, window in reference_windows(row[: lengths[r]], vocab.audio):
            codes = tokens_to_codes(window, start, vocab.audio)
            if codes is not None:
                windows.append((r, codes))
    cut = window_slice(int(snac_ref.hop_length))
    samples = [0] * len(prompts)
    first = None
    for i in range(0, len(windows), SNAC_WINDOW_BATCH):
        group = windows[i : i + SNAC_WINDOW_BATCH]
        audio = snac_ref.decode([torch.cat([c[lv] for _, c in group]) for lv in range(3)])[:, 0, cut]
        first = first if first is not None else time.perf_counter() - t0
        for (r, _), _row in zip(group, audio, strict=True):
            samples[r] += cut.stop - cut.start
    wall = time.perf_counter() - t0
    # nothing is heard before the batch finishes: every request's first audio is the first SNAC batch
    return _summary([first] * len(prompts), [wall] * len(prompts), samples, wall, rate)


async def main_async(args) -> dict:
    from mstar_orpheus.model import load_orpheus
    from mstar_orpheus.preset import write_tiny

    from mstar_core.model import LoadOptions
    from mstar_core.runtime import AsyncEngine

    torch.manual_seed(0)
    snac_cfg, lm_cfg = bench_config(args.quick)
    shortest, longest = (35, 98) if args.quick else (63, 210)  # 2..11 and 6..27 windows of audio
    levels = (1, 4, 16)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_tiny(Path(tmp), seed=0, snac=snac_cfg, **lm_cfg)
        loaded = load_orpheus(LoadOptions(checkpoint=str(directory)), progress=False)
        hf, snac_ref = load_reference(directory)
    vocab, rate = loaded.extras["vocab"], loaded.extras["sample_rate"]
    prompts = [loaded.prepare.prompt_ids(t, "tara") for t in TEXTS]
    lm, snac_node = loaded.graph.nodes["lm"].module(), loaded.graph.nodes["snac"].module()

    engine = AsyncEngine()
    await engine.add_model(loaded, settings={"lm": {"num_pages": 1024}})
    # the same model twice more for the viability figure: decode ranked by stream priority, and FIFO
    from mstar_orpheus.graph import _seconds_per_window, build_graph

    rows = {"lm": {"num_pages": 2048, "max_num_seqs": args.viability_rows}}
    for alias, priority in (("orpheus-priority", True), ("orpheus-fifo", False)):
        graph = build_graph(lm, snac_node, vocab.audio, priority=priority)
        await engine.add_model(attrs.evolve(loaded, graph=graph), settings=rows, alias=alias)
    await run_mstar(engine, [35, 35], rate)  # warm-up (allocations, first-call paths)
    run_reference(hf, snac_ref, prompts[:2], [35, 35], vocab, rate)

    mstar, ref = {}, {}
    if args.only_viability:
        levels = ()
    for c in levels:
        # concurrency 1 uses the longest utterance, so its TTFA and RTF are not flattered by a short one
        lengths = [longest] if c == 1 else request_lengths(c, shortest, longest)
        mstar[c] = await run_mstar(engine, lengths, rate)
        ref[c] = run_reference(hf, snac_ref, [prompts[i % len(prompts)] for i in range(c)], lengths, vocab, rate)
        print(f"c={c:2d}  M*: TTFA {mstar[c]['ttfa_s'] * 1e3:7.1f} ms  RTF {mstar[c]['rtf']:.3f}  "
              f"{mstar[c]['audio_s_per_s']:.2f} audio-s/s   reference: TTFA {ref[c]['ttfa_s'] * 1e3:7.1f} ms  "
              f"RTF {ref[c]['rtf']:.3f}  {ref[c]['audio_s_per_s']:.2f} audio-s/s", flush=True)
    # TTFA vs the compute floor: interleaved pairs, so a noisy neighbour hits both sides alike; the
    # ratio of medians in wall time, and in process CPU time (which neighbours' load cannot inflate)
    viability = {"priority": [], "fifo": []}
    v_lengths = request_lengths(32, shortest, longest)
    for _ in range(args.viability_rounds):
        for kind in ("fifo", "priority"):
            viability[kind].append(await run_viability(engine, f"orpheus-{kind}", v_lengths, args.viability_gap,
                                                       _seconds_per_window(snac_node)))
    print(f"viability at c=32 (never stalls after the first chunk, {args.viability_rows} rows per step, arrivals "
          f"{args.viability_gap * 1e3:.0f} ms apart): priority {viability['priority']}, fifo {viability['fifo']}",
          flush=True)
    if args.only_viability:
        await engine.close()
        return {"viability_c32_priority": statistics.mean(viability["priority"]),
                "viability_c32_fifo": statistics.mean(viability["fifo"]), "viability": viability}
    probe, floors = [], []
    for _ in range(args.rounds):
        floors.append(compute_floor(lm, snac_node, prompts[0]))
        run = await run_mstar(engine, [35], rate)
        probe.append((run["ttfa_s"], run["first_audio_cpu_s"]))
    floor, floor_cpu = (statistics.median(f[i] for f in floors) for i in (0, 1))
    probe_ttfa, probe_cpu = (statistics.median(p[i] for p in probe) for i in (0, 1))
    await engine.close()
    print(f"TTFA at concurrency 1 (median of {args.rounds}): M* {probe_ttfa * 1e3:.1f} ms, compute floor "
          f"(prefill + 28 decode steps + 1 SNAC window) {floor * 1e3:.1f} ms; process CPU to first audio: "
          f"M* {probe_cpu * 1e3:.1f} ms, floor {floor_cpu * 1e3:.1f} ms")
    return {
        "benchmark": "orpheus_streaming",
        "quick": args.quick,
        "tokens_per_request": [shortest, longest],
        "ttfa_ratio_c1": probe_ttfa / floor,
        "ttfa_cpu_ratio_c1": probe_cpu / floor_cpu,
        "viability_c32_priority": statistics.mean(viability["priority"]),
        "viability_c32_fifo": statistics.mean(viability["fifo"]),
        "viability_setup": {"rows_per_step": args.viability_rows, "arrival_gap_s": args.viability_gap,
                            "rounds": args.viability_rounds},
        "throughput_vs_reference_c16": mstar[16]["audio_s_per_s"] / ref[16]["audio_s_per_s"],
        "reference_ttfa_s_c1": ref[1]["ttfa_s"],
        "mstar_ttfa_s_c1": probe_ttfa,
        "compute_floor_s": floor,
        "mstar": {str(c): mstar[c] for c in levels},
        "reference": {str(c): ref[c] for c in levels},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model and fewer tokens (< 60 s on 2 CPU cores)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved M*/floor TTFA pairs at concurrency 1")
    parser.add_argument("--viability-rows", type=int, default=12, help="LM rows per step in the viability runs")
    parser.add_argument("--viability-gap", type=float, default=0.05, help="seconds between arrivals (viability)")
    parser.add_argument("--viability-rounds", type=int, default=1, help="priority/FIFO pairs (viability)")
    parser.add_argument("--only-viability", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
