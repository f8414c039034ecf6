"""Orpheus streaming TTS: M* (paged-KV LM streaming into batched SNAC windows) vs the no-serving-system pipeline.

Reference pipeline (what a user writes without a serving system): `transformers` `generate` over
all requests as one left-padded batch, then every 28-token window of every request decoded by the
`snac` package in batches of 16, keeping the reference slice. Same weights, same run.

Reported per concurrency (1, 4, 16): time to first audio (TTFA), real-time factor (request wall
time / its audio duration) and audio-seconds per second; requests differ in length, as utterances
do. `ttfa_ratio_c1` divides M*'s TTFA at concurrency 1 by the compute floor timed here: prefill +
28 decode steps with a dense KV cache and the same sampling rules + one SNAC window, with no
runtime around them (medians of interleaved pairs).

Streaming viability at 32 concurrent streams: the fraction of requests whose audio never stalls
after its first chunk when played back in real time (a chunk arriving after the audio before it has
finished playing is a stall). The same load runs on one engine, alternately, with the LM's decode
steps in three orders: ranked by the listener's remaining audio (Orpheus's stream priority,
`viability_c32_priority`); in submission order, the LM node's `call_order: "fifo"`, no stream
priority and no request age (`viability_c32_fifo`, the issue's FIFO: plain fairness, each decode
queues behind those submitted before it); and oldest request first without stream priority, the
runtime's default order for a model that declares none (`viability_c32_age`). The LM decodes at most
`--viability-rows` rows per step, so it has to choose. The issue's figure is priority vs fifo on
this metric (wall clock); age is reported beside them. Oldest first with a row cap is admission
control (a stream starts only when an older one ends, and the metric does not count the wait before
the first chunk), so each is also scored with that wait bounded (`*_bounded_start`, see
`run_viability`). It runs on its own, smaller Orpheus (`viability_config`: one stream alone is well
ahead of real time here), and is also scored on a CPU-time listener clock (`*_cpu_clock`), which
other jobs on a shared box cannot stall. Final line: JSON.

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

from mstar_core.nn.attention import DenseKVCache

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


async def run_mstar(engine, lengths: list[int], rate: int, model: str = "orpheus") -> dict:
    """Submit one request per entry of `lengths` at once; TTFA = first non-empty audio chunk."""
    t0, c0 = time.perf_counter(), time.process_time()
    handles = [
        engine.submit(model, {"text": TEXTS[i % len(TEXTS)], "voice": "tara", "max_tokens": n, "seed": i,
                                    "ignore_eos": True})
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


CLOCKS = ("wall", "cpu")


async def run_viability(engine, model: str, lengths: list[int], gap: float, window_s: float,
                        start_bound: float) -> dict:
    """Per-clock fractions of requests whose playback never stalls (arrivals `gap` s apart), and per-stream traces.

    Every SNAC window counts as `window_s` of audio, also one whose codes a random-weight LM left
    outside the codebook (decoded to nothing, as the reference skips it): the figure is about when
    windows arrive, which the serving system decides, not about what random weights say.

    Two listener clocks over the same arrivals: `wall` (real time, the figure the issue asks for)
    and `cpu` (this process's CPU time: what the streams would see with the machine to themselves,
    so other jobs on a shared box cannot stall them; stricter wherever the process's threads ran
    in parallel).

    `never_stalls` is the issue's metric: playback starts with the first chunk, however late.
    `bounded_start` also counts a stream as stalled when its first chunk comes more than
    `start_bound` s after its submission: a listener kept waiting that long has heard a gap too.
    The default bound is twice the stream priority's start lead: by `stream_priority`'s rule a stream
    that has waited the lead outranks playing ones with audio queued, so a wait of twice that is one
    the ranking means to prevent (the rule is read when a call is submitted, not while it queues).
    Without such a bound an order that starts a stream only when an older one ends scores perfectly
    however long the last ones wait.
    """

    async def one(i: int, n: int) -> dict:
        await asyncio.sleep(i * gap)
        submitted = (time.perf_counter(), time.process_time())
        handle = engine.submit(model, {"text": TEXTS[i % len(TEXTS)], "voice": "tara", "max_tokens": n, "seed": i,
                                    "ignore_eos": True})
        arrivals = []  # (wall, cpu) when each chunk arrived
        async for out in handle:
            if out.name == "audio":
                arrivals.append((time.perf_counter(), time.process_time()))
        await handle.result()
        trace = {}
        for c, clock in enumerate(CLOCKS):
            times = [a[c] for a in arrivals]
            first = times[0] - submitted[c] if times else 0.0
            stalls, silent = _playback(times, window_s)
            trace[clock] = {"first_chunk_s": round(first, 3), "stalls": stalls, "stalled_s": round(silent, 3)}
        return trace

    traces = await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))
    out: dict = {"traces": traces}
    for clock in CLOCKS:
        ok = [t[clock]["stalls"] == 0 for t in traces]
        bounded = [o and t[clock]["first_chunk_s"] <= start_bound for o, t in zip(ok, traces, strict=True)]
        out[clock] = sum(ok) / len(ok)
        out[f"{clock}_bounded_start"] = sum(bounded) / len(bounded)
    return out


def _playback(arrivals: list[float], window_s: float) -> tuple[int, float]:
    """Real-time playback of chunks arriving at `arrivals`: (how often it runs dry, seconds of silence).

    Playback starts with the first chunk; after running dry it resumes when the next chunk comes. A chunk
    less than 1 ms late does not count as a stall (timer noise), but its wait still counts as silence.
    """
    stalls, silent, played_until = 0, 0.0, None
    for now in arrivals:
        if played_until is None:
            played_until = now
        elif now > played_until:
            stalls += now > played_until + 1e-3
            silent += now - played_until
            played_until = now
        played_until += window_s
    return stalls, silent


def viability_config(args):
    """The viability figure's model: the Orpheus structure small enough that one stream is well ahead of real time here.

    Llama (llama3 rope) + SNAC 24 kHz layout (hop 512, rates 8-8-4-2, 28-token windows, 85 ms of
    audio per window), narrower than the main figure's, and a smaller SNAC codebook: the LM's vocabulary
    holds 7 x codebook audio tokens, and its head and sampler over 7 x 4096 are most of a token's CPU on
    this box (the real time a stream needs is fixed by SNAC: 7 tokens per 85 ms).
    """
    from mstar_orpheus.snac import SNACConfig

    snac = SNACConfig(
        sampling_rate=24000, encoder_dim=8, encoder_rates=(2, 4, 8, 8), decoder_dim=args.viability_snac_width,
        decoder_rates=(8, 8, 4, 2), codebook_size=args.viability_codebook, codebook_dim=8, vq_strides=(4, 2, 1),
    )
    width = args.viability_hidden
    lm = {"hidden_size": width, "intermediate_size": 3 * width, "num_hidden_layers": args.viability_layers,
          "num_attention_heads": max(2, width // 32), "num_key_value_heads": max(1, width // 64)}
    return snac, lm


#: The viability runs: model alias -> (Orpheus's stream priority on the LM's decode, the LM node's `call_order`).
VIABILITY_KINDS = {"priority": (True, "urgency"), "fifo": (False, "fifo"), "age": (False, "urgency")}


async def add_viability_models(engine, args) -> float:
    """Load the viability model once per kind in `VIABILITY_KINDS`; returns seconds of audio per window."""
    from mstar_orpheus.graph import START_LEAD, _seconds_per_window, build_graph
    from mstar_orpheus.model import load_orpheus
    from mstar_orpheus.preset import write_tiny

    from mstar_core.model import LoadOptions

    if args.viability_start_lead is None:
        args.viability_start_lead = START_LEAD
    snac_cfg, lm_cfg = viability_config(args)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_orpheus(LoadOptions(checkpoint=str(write_tiny(Path(tmp), seed=0, snac=snac_cfg, **lm_cfg)),
                                          dtype=args.dtype), progress=False)
    lm, snac_node = loaded.graph.nodes["lm"].module(), loaded.graph.nodes["snac"].module()
    for kind, (priority, order) in VIABILITY_KINDS.items():
        # the LM decodes at most `rows` rows a step and takes at most that many calls at once, so it has to choose
        rows = {"lm": {"num_pages": args.viability_pages, "max_num_seqs": args.viability_rows,
                       "max_batch_size": args.viability_batch or args.viability_rows, "call_order": order}}
        graph = build_graph(lm, snac_node, loaded.extras["vocab"].audio, priority=priority,
                            start_lead=args.viability_start_lead)
        await engine.add_model(attrs.evolve(loaded, graph=graph), settings=rows, alias=f"orpheus-{kind}")
    return _seconds_per_window(snac_node)


async def viability_runs(engine, args, lengths: list[int], window_s: float, rate: int) -> dict:
    """One stream alone (how far ahead of real time), then rounds of every kind at 32 streams, alternating."""
    for kind in VIABILITY_KINDS:  # warm-up (allocations, first-call paths)
        await run_mstar(engine, [35, 35], rate, model=f"orpheus-{kind}")
    solo = []
    for _ in range(2):
        c0 = time.process_time()
        run = await run_mstar(engine, [max(lengths)], rate, model="orpheus-priority")
        solo.append({"rtf_wall": run["rtf"], "rtf_cpu": (time.process_time() - c0) / run["audio_s"]})
    bound = args.viability_start_bound
    if bound is None:
        bound = 2 * args.viability_start_lead
    load = [os.getloadavg()[0]]
    runs: dict[str, list[dict]] = {kind: [] for kind in VIABILITY_KINDS}
    for _ in range(args.viability_rounds):
        for kind in ("fifo", "age", "priority"):
            runs[kind].append(await run_viability(engine, f"orpheus-{kind}", lengths, args.viability_gap, window_s,
                                                  bound))
            load.append(os.getloadavg()[0])
    scores = [f"{clock}{suffix}" for suffix in ("", "_bounded_start") for clock in CLOCKS]
    mean = {(k, s): statistics.mean(r[s] for r in runs[k]) for k in runs for s in scores}
    print(f"viability at c=32 ({args.viability_rows} rows per step, arrivals {args.viability_gap * 1e3:.0f} ms apart, "
          f"{len(lengths)} streams of {min(lengths)}-{max(lengths)} tokens; one stream alone: RTF "
          f"{solo[-1]['rtf_wall']:.2f} wall, {solo[-1]['rtf_cpu']:.2f} CPU; load average {load[0]:.1f} -> "
          f"{load[-1]:.1f})", flush=True)
    for score in scores:
        print(f"  {score:>18}: " + "   ".join(f"{kind} {mean[kind, score]:.3f} {[round(r[score], 3) for r in runs[kind]]}"
                                            for kind in runs), flush=True)
    for kind in runs:  # what the traces say: stalls per stream and when first chunks came (wall clock)
        traces = [t["wall"] for r in runs[kind] for t in r["traces"]]
        firsts = sorted(t["first_chunk_s"] for t in traces)
        print(f"  {kind:>8} traces (wall): streams stalled {sum(t['stalls'] > 0 for t in traces)}/{len(traces)}, "
              f"stalls {sum(t['stalls'] for t in traces)}, silent {sum(t['stalled_s'] for t in traces):.1f} s; "
              f"first chunk median {statistics.median(firsts):.2f} s, max {firsts[-1]:.2f} s", flush=True)
    result = {}
    for kind in runs:
        result[f"viability_c32_{kind}"] = mean[kind, "wall"]
        result[f"viability_c32_{kind}_cpu_clock"] = mean[kind, "cpu"]
        result[f"viability_c32_{kind}_bounded_start"] = mean[kind, "wall_bounded_start"]
        result[f"viability_c32_{kind}_bounded_start_cpu_clock"] = mean[kind, "cpu_bounded_start"]
    return {
        **result,
        "viability_runs": {k: [{s: r[s] for s in scores} for r in v] for k, v in runs.items()},
        "viability_traces": runs if args.viability_traces else None,
        "viability_setup": {"rows_per_step": args.viability_rows, "kv_pages": args.viability_pages,
                            "lm_max_batch_size": args.viability_batch or args.viability_rows,
                            "arrival_gap_s": args.viability_gap, "tokens_per_stream": [min(lengths), max(lengths)],
                            "rounds": args.viability_rounds, "start_lead_s": args.viability_start_lead,
                            "start_bound_s": bound,
                            "lm": viability_config(args)[1], "snac_decoder_dim": args.viability_snac_width,
                            "snac_codebook": args.viability_codebook, "solo": solo, "load_average": load},
    }


def _summary(ttfa, ends, samples, wall, rate) -> dict:
    audio_s = [s / rate for s in samples]
    return {
        "ttfa_s": statistics.mean(ttfa),
        "rtf": statistics.mean(e / a for e, a in zip(ends, audio_s, strict=True) if a > 0),
        "audio_s_per_s": sum(audio_s) / wall,
        "audio_s": sum(audio_s),
        "wall_s": wall,
    }


def load_reference(directory: Path, dtype: str = "float32"):
    """HF `LlamaForCausalLM` (in `dtype`, as M*'s LM) and the `snac` package's SNAC (fp32, as M*'s), from the same files."""
    import snac
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
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


async def throughput_rounds(engine, hf, snac_ref, prompts, lengths: list[int], vocab, rate: int, rounds: int) -> dict:
    """`--only-throughput`: M* and the reference at c=16 in alternating waves; wall and process-CPU ratios per round."""
    walls, cpus, load = [], [], [os.getloadavg()[0]]
    for _ in range(rounds):
        c0 = time.process_time()
        ours = await run_mstar(engine, lengths, rate)
        c1 = time.process_time()
        theirs = run_reference(hf, snac_ref, [prompts[i % len(prompts)] for i in range(len(lengths))], lengths, vocab,
                               rate)
        c2 = time.process_time()
        walls.append(ours["audio_s_per_s"] / theirs["audio_s_per_s"])
        # audio seconds per CPU second, M* over the reference: what neighbours' load inflates least
        cpus.append((ours["audio_s"] / (c1 - c0)) / (theirs["audio_s"] / (c2 - c1)))
        load.append(os.getloadavg()[0])
        print(f"c=16  M* {ours['audio_s_per_s']:.2f} audio-s/s, reference {theirs['audio_s_per_s']:.2f}: "
              f"{walls[-1]:.3f} wall, {cpus[-1]:.3f} CPU (load {load[-1]:.1f})", flush=True)
    return {"throughput_vs_reference_c16": statistics.median(walls), "throughput_cpu_vs_reference_c16":
            statistics.median(cpus), "throughput_rounds": [round(w, 3) for w in walls],
            "throughput_cpu_rounds": [round(c, 3) for c in cpus], "load_average": [round(x, 2) for x in load]}


async def main_async(args) -> dict:
    from mstar_orpheus.model import load_orpheus
    from mstar_orpheus.preset import write_tiny

    from mstar_core.model import LoadOptions
    from mstar_core.runtime import AsyncEngine

    torch.manual_seed(0)
    snac_cfg, lm_cfg = bench_config(args.quick)
    shortest, longest = (35, 98) if args.quick else (63, 210)  # 2..11 and 6..27 windows of audio
    if args.only_viability:  # without the main model and the reference
        engine = AsyncEngine()
        window_s = await add_viability_models(engine, args)
        viability = await viability_runs(engine, args, request_lengths(32, shortest, longest), window_s, 24000)
        await engine.close()
        return viability
    levels = (1, 4, 16)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_tiny(Path(tmp), seed=0, snac=snac_cfg, **lm_cfg)
        loaded = load_orpheus(LoadOptions(checkpoint=str(directory), dtype=args.dtype), progress=False)
        hf, snac_ref = load_reference(directory, args.dtype)
    vocab, rate = loaded.extras["vocab"], loaded.extras["sample_rate"]
    prompts = [loaded.prepare.prompt_ids(t, "tara") for t in TEXTS]
    lm, snac_node = loaded.graph.nodes["lm"].module(), loaded.graph.nodes["snac"].module()

    engine = AsyncEngine()
    await engine.add_model(loaded, settings={"lm": {"num_pages": 1024}})
    window_s = None if args.only_throughput else await add_viability_models(engine, args)
    await run_mstar(engine, [35, 35], rate)  # warm-up (allocations, first-call paths)
    run_reference(hf, snac_ref, prompts[:2], [35, 35], vocab, rate)
    if args.only_throughput:
        result = await throughput_rounds(engine, hf, snac_ref, prompts, request_lengths(16, shortest, longest), vocab,
                                         rate, args.throughput_rounds)
        await engine.close()
        return {"benchmark": "orpheus_streaming", "quick": args.quick, "dtype": args.dtype, **result}

    mstar, ref = {}, {}
    for c in levels:
        # concurrency 1 uses the longest utterance, so its TTFA and RTF are not flattered by a short one
        lengths = [longest] if c == 1 else request_lengths(c, shortest, longest)
        mstar[c] = await run_mstar(engine, lengths, rate)
        ref[c] = run_reference(hf, snac_ref, [prompts[i % len(prompts)] for i in range(c)], lengths, vocab, rate)
        print(f"c={c:2d}  M*: TTFA {mstar[c]['ttfa_s'] * 1e3:7.1f} ms  RTF {mstar[c]['rtf']:.3f}  "
              f"{mstar[c]['audio_s_per_s']:.2f} audio-s/s   reference: TTFA {ref[c]['ttfa_s'] * 1e3:7.1f} ms  "
              f"RTF {ref[c]['rtf']:.3f}  {ref[c]['audio_s_per_s']:.2f} audio-s/s", flush=True)
    viability = await viability_runs(engine, args, request_lengths(32, shortest, longest), window_s, rate)
    # TTFA vs the compute floor: interleaved pairs, so a noisy neighbour hits both sides alike; the
    # ratio of medians in wall time, and in process CPU time (which neighbours' load cannot inflate)
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
        "dtype": args.dtype,
        "tokens_per_request": [shortest, longest],
        "ttfa_ratio_c1": probe_ttfa / floor,
        "ttfa_cpu_ratio_c1": probe_cpu / floor_cpu,
        **viability,
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
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the LM's weights and KV on both sides (SNAC stays fp32 on both)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved M*/floor TTFA pairs at concurrency 1")
    parser.add_argument("--viability-rows", type=int, default=4, help="LM rows per step in the viability runs")
    parser.add_argument("--viability-batch", type=int, default=None,
                        help="calls the LM engine holds at once in the viability runs (default: the rows; more lets "
                             "the engine prefill streams it cannot yet decode every step, and choose among them)")
    parser.add_argument("--viability-gap", type=float, default=0.05, help="seconds between arrivals (viability)")
    parser.add_argument("--viability-rounds", type=int, default=3, help="rounds of the three orders (viability)")
    parser.add_argument("--viability-start-lead", type=float, default=None,
                        help="seconds of audio a stream that has not started counts as having (priority runs; "
                             "default: Orpheus's own, mstar_orpheus.graph.START_LEAD)")
    parser.add_argument("--viability-start-bound", type=float, default=None,
                        help="seconds before a stream's first chunk counts as a stall in the *_bounded_start scores "
                             "(default: twice the start lead)")
    parser.add_argument("--viability-traces", action="store_true", help="per-stream traces in the JSON")
    parser.add_argument("--viability-pages", type=int, default=2048, help="viability model: KV cache pages")
    parser.add_argument("--viability-hidden", type=int, default=64, help="viability model: LM width")
    parser.add_argument("--viability-layers", type=int, default=1, help="viability model: LM layers")
    parser.add_argument("--viability-codebook", type=int, default=256, help="viability model: SNAC codebook size")
    parser.add_argument("--viability-snac-width", type=int, default=16, help="viability model: SNAC decoder width")
    parser.add_argument("--only-viability", action="store_true", help="only the c=32 viability figure (and its JSON)")
    parser.add_argument("--only-throughput", action="store_true",
                        help="only the c=16 audio-s/s comparison with the reference (alternating waves, and its JSON)")
    parser.add_argument("--throughput-rounds", type=int, default=3, help="M*/reference c=16 wave pairs (--only-throughput)")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
