"""Whisper in M* against faster-whisper (CTranslate2), one checkpoint, the same clips, in one run.

The checkpoint: random weights at whisper-base size (d_model 512, 6 + 6 layers, 8 heads, 51865 tokens, 80 mels),
written by `mstar_whisper.preset.write_random` in Hugging Face's layout with its positions leaning toward
end-of-text, so both sides write replies of similar length that end (`CACHE/whisper-base-random`). faster-whisper is
never a dependency of M*: it lives in its own venv (`CACHE/faster-whisper-venv`, `pip install faster-whisper==1.2.1`,
created the first time), and CTranslate2's converter runs offline on the same directory (`CACHE/whisper-base-ct2-*`;
the converter runs under this interpreter, which has transformers and torch, with the venv's ctranslate2 on its path).

Both sides decode greedily (faster-whisper's `beam_size=1, best_of=1`, `temperature=0`, no fallback, no VAD,
`without_timestamps=True`, `condition_on_previous_text=False`: its documented knobs set to what M* runs; listed in
the output), each decoding up to the same number of tokens a window: CTranslate2 decodes at most half of its
`max_length` (openai-whisper's `sample_len` rule: `min(max_length // 2, max_length - prompt)`), and faster-whisper
sets `max_length` to its prompt plus `max_new_tokens`, so it is given `max_new_tokens` = 2 x N - its prompt's length
to decode up to the N tokens M* does (given N, it decoded at most (N + 4) // 2: 50 of 96, before this; `decode_steps_c1`
shows each side's steps). faster-whisper gets `cpu_threads` = the cores and `num_workers` = the
concurrency (its documented way to run parallel `transcribe` calls). Clips are 30 s of espeak-ng speech (sentences,
voices and speeds varied by clip; speech-like harmonics where espeak-ng is missing) ending in 0.1 s of silence.
The full run adds 4 clips of 5 minutes (`--long-clips N` sets how many, in `--quick` too): Whisper's sequential long-form on both
sides, timestamps on (M* seeks after each window's last timestamp pair; faster-whisper's `without_timestamps=False`,
the rest as above), at c=1 and c=8, reported under `long` with the same figures. Random weights write timestamps
where they like, so the two sides may cut a clip into different windows: `long.text_tokens_c1` gives each side's
text tokens beside the timings.

Figures: audio seconds per wall second at c=8, latency p50 / p99 at c=1, CPU seconds per audio minute (each side's
process, all its threads), the ratios (M* over faster-whisper for throughput and latency; faster-whisper's CPU seconds
over M*'s for `cpu_time_ratio_c8`, higher is better for M*), and the fraction of clips whose text both sides wrote
identically. Timings on a shared, loaded CPU box are noisy, wall times most: the CPU-time ratio is the steadier one.

faster-whisper's default `suppress_tokens=[-1]` means openai-whisper's non-speech symbols as its tokenizer spells
them, which real checkpoints also list in `generation_config.suppress_tokens`; the random checkpoints' tokenizer
spells them elsewhere, so faster-whisper is given the checkpoint's own list (`suppress_tokens`, its documented
parameter).

Why `text_agreement` is 0 (measured, and printed beside it):
- The audio: both sides now compute the log-mel of the same samples. Clips are exactly 30 s (faster-whisper takes
  the log-mel of the clip as it is and pads the window with zeros *in log-mel space*, where transformers'
  `WhisperFeatureExtractor`, and M* within 1e-4 of it, pads the *audio* to 30 s first) and end in silence (the last
  frame's STFT window reaches past the samples, where faster-whisper pads zeros and transformers reflects them).
  The two feature sets then agree within 3e-5 (measured on the benchmark's clips).
- The prompt: both sides prompt `[SOT, <|en|>, <|transcribe|>, <|notimestamps|>]` (`faster_whisper_prompt`). Until
  the random checkpoint's vocabulary had the multilingual one's empty text token (id 50256; preset version 3),
  CTranslate2 4.7+ ran it as English-only, prompted `[SOT, <|notimestamps|>]`, wrote other text from the first token
  on, and reached end-of-text after about half of M*'s tokens.
- With M*'s prompt, CTranslate2's own greedy `generate` on faster-whisper's features (`text_agreement_ct2_same_prompt`,
  `token_prefix_agreement_ct2_same_prompt`) writes M*'s tokens until a near-tie (random weights have many) flips
  under the fp32 rounding differences between the two encoders (~1e-4): about half of the tokens before the first
  difference at base size, 0.63 at tiny size.

M* runs in this process as `mstar serve` runs it: the script re-executes itself once on Intel's OpenMP with malloc's
huge pages (`mstar_core.openmp`, what the server does before loading torch), and turns huge pages off once the model
is loaded; `--torch-openmp` keeps torch's own runtime. faster-whisper's process gets the caller's environment as it
was (CTranslate2 brings its own OpenMP runtime).

    python benchmarks/whisper.py [--quick] [--compute-type float32|int8] [--long-clips N] [--torch-openmp]

Final line: JSON with `throughput_ratio_c8`, `latency_p50_ratio_c1`, `text_agreement`, `cpu_flags`, ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mstar_core import openmp

#: the caller's values of what the re-execution changes, for faster-whisper's process
CALLER_ENV = {"LD_PRELOAD": "MSTAR_BENCH_CALLER_LD_PRELOAD", openmp.TUNABLES_ENV: "MSTAR_BENCH_CALLER_TUNABLES"}
if __name__ == "__main__" and "--torch-openmp" not in sys.argv:  # before torch loads: as `mstar serve` does
    _served = openmp.preload_env(dict(os.environ))
    if _served is not None:
        _served.update({saved: os.environ.get(name, "") for name, saved in CALLER_ENV.items()})
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], _served)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_side import cache_dir  # noqa: E402
from vs_vllm import cpu_flags  # noqa: E402

FASTER_WHISPER = "faster-whisper==1.2.1"
SIZES = {
    "base": {"d_model": 512, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 8,
             "decoder_attention_heads": 8, "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048},
    "tiny": {"d_model": 384, "encoder_layers": 4, "decoder_layers": 4, "encoder_attention_heads": 6,
             "decoder_attention_heads": 6, "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536},
}
#: what real checkpoints suppress beside their text list: the task and start tokens and <|nospeech|> (faster-whisper,
#: like openai-whisper, suppresses them whatever the config says; the random checkpoints say it too, so both agree)
SPECIAL_SUPPRESS = [50358, 50359, 50360, 50361, 50362]
#: the long clips' length: ten 30-second windows or more each (more where a window seeks back to its last timestamp)
LONG_SECONDS = 300.0
#: the prompt M* (and transformers) write for language "en", task transcribe, no timestamps
MSTAR_PROMPT = [50258, 50259, 50359, 50363]

FW_SCRIPT = r"""
import json, sys, time, numpy as np
from concurrent.futures import ThreadPoolExecutor
from faster_whisper import WhisperModel
args = json.loads(sys.argv[1])
out = {}
# faster-whisper's CTranslate2 model as it is, counting the tokens its generate calls return: the decoder steps it
# ran (segments it then drops, e.g. as no speech, count too), an instrument that changes none of its settings
class Counting:
    def __init__(self, inner):
        self.inner, self.generated = inner, 0
    def __getattr__(self, name):
        return getattr(self.inner, name)
    def generate(self, *a, **k):
        results = self.inner.generate(*a, **k)
        self.generated += sum(len(r.sequences_ids[0]) for r in results)
        return results
for phase in args["phases"]:
    clips = [np.load(p) for p in phase["clips"]]
    for conc in phase["concurrency"]:
        model = WhisperModel(args["model"], device="cpu", compute_type=args["compute_type"], cpu_threads=args["threads"],
                             num_workers=conc)
        model.model = Counting(model.model)
        def one(audio):
            t0 = time.perf_counter()
            segments, _ = model.transcribe(audio, language="en", task="transcribe", beam_size=1, best_of=1,
                                           temperature=0.0, without_timestamps=not phase["timestamps"],
                                           condition_on_previous_text=False, vad_filter=False,
                                           max_new_tokens=phase["max_new_tokens"], suppress_blank=True,
                                           log_progress=False, suppress_tokens=args["suppress_tokens"])
            segs = list(segments)
            return time.perf_counter() - t0, [t for s in segs for t in s.tokens]
        one(clips[0][:480000])  # warm-up (one window)
        model.model.generated = 0
        c0, t0 = time.process_time(), time.perf_counter()
        with ThreadPoolExecutor(conc) as pool:
            res = list(pool.map(one, clips))
        out[phase["label"] + str(conc)] = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                                           "latency": [r[0] for r in res], "tokens": [r[1] for r in res],
                                           "generated": model.model.generated}
clips = [np.load(p) for p in args["phases"][0]["clips"]]
# the diagnostic: CTranslate2's own greedy generate on faster-whisper's features of each clip, with M*'s prompt
from faster_whisper.transcribe import get_suppressed_tokens
from faster_whisper.tokenizer import Tokenizer
tokenizer = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, task="transcribe", language="en")
suppress = list(get_suppressed_tokens(tokenizer, list(args["suppress_tokens"])))
same_prompt = []
for audio in clips:
    features = model.feature_extractor(audio)[:, :3000]
    encoded = model.encode(features)
    res = model.model.generate(encoded, [args["prompt"]], beam_size=1, max_length=2 * args["max_new_tokens"],
                               suppress_blank=True, suppress_tokens=suppress)
    same_prompt.append([t for t in res[0].sequences_ids[0] if t < tokenizer.eot])
out["same_prompt_tokens"] = same_prompt
out["multilingual"] = bool(model.model.is_multilingual)
out["prompt"] = model.get_prompt(tokenizer, [], without_timestamps=True)
print(json.dumps(out))
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_faster_whisper() -> Path:
    venv = cache_dir() / "faster-whisper-venv"
    python = venv / "bin" / "python"
    marker = venv / ".mstar-bench-installed"
    if python.exists() and marker.exists():
        return python
    log(f"installing {FASTER_WHISPER} into {venv} (once)")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", FASTER_WHISPER], check=True)
    marker.write_text(FASTER_WHISPER + "\n")
    return python


def ensure_checkpoint(size: str) -> Path:
    from mstar_whisper.preset import PRESET_VERSION, TINY_CONFIG, write_random

    directory = cache_dir() / f"whisper-{size}-random-v{PRESET_VERSION}"
    if not (directory / "config.json").is_file():
        log(f"writing the whisper-{size}-size random checkpoint to {directory}")
        tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
        write_random(tmp, {**TINY_CONFIG, **SIZES[size], "suppress_tokens": SPECIAL_SUPPRESS}, seed=0, ramp=0.3)
        gen = json.loads((tmp / "generation_config.json").read_text())
        (tmp / "generation_config.json").write_text(json.dumps({**gen, "suppress_tokens": SPECIAL_SUPPRESS}))
        tmp.rename(directory)
    return directory


def ensure_ct2(fw_python: Path, checkpoint: Path, compute_type: str) -> Path:
    out = cache_dir() / f"{checkpoint.name}-ct2-{compute_type}"
    if (out / "model.bin").is_file():
        return out
    site = subprocess.run([str(fw_python), "-c", "import ctranslate2, os; print(os.path.dirname(os.path.dirname("
                           "ctranslate2.__file__)))"], capture_output=True, text=True, check=True).stdout.strip()
    log(f"converting {checkpoint} with CTranslate2 ({compute_type}), offline")
    env = {**os.environ, "PYTHONPATH": site, "HF_HUB_OFFLINE": "1"}
    quant = {"float32": "float32", "int8": "int8_float32"}[compute_type]
    code = ("from ctranslate2.converters.transformers import main; main()")
    subprocess.run([sys.executable, "-c", code, "--model", str(checkpoint), "--output_dir", str(out), "--quantization",
                    quant, "--copy_files", "tokenizer.json", "preprocessor_config.json", "--force"], check=True, env=env)
    return out


SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Speech recognition turns spoken words into written text for everyone.",
    "A composite model serves its encoder and decoder on shared engines.",
    "Every morning the train leaves the station at a quarter past seven.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Numbers like three hundred and twelve are read aloud one word at a time.",
)
#: the clips end in this much silence: both sides' log-mel then agree in the window's last frame too (its STFT
#: window reaches past the audio, where faster-whisper pads with zeros and transformers reflects the samples)
TAIL_SILENCE_S = 0.1


def _espeak(text: str, speed: int, voice: str) -> np.ndarray:
    """espeak-ng's 22.05 kHz speech of `text`, at 16 kHz (linear interpolation)."""
    import wave

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text], check=True,
                       capture_output=True)
        with wave.open(str(path)) as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0
    t = np.arange(int(len(pcm) * 16000 / rate)) / 16000
    return np.interp(t, np.arange(len(pcm)) / rate, pcm).astype(np.float32)


def clips(n: int, seconds: float) -> list[np.ndarray]:
    """`n` clips of `seconds`: espeak-ng's speech (sentences, voices and speeds varied by clip) where it is installed,
    else speech-like harmonics; each ends in `TAIL_SILENCE_S` of silence."""
    rng = np.random.default_rng(0)
    size, tail = int(seconds * 16000), int(TAIL_SILENCE_S * 16000)
    out = []
    for i in range(n):
        if shutil.which("espeak-ng"):
            parts, have, k = [], 0, i
            while have < size - tail:
                text = SENTENCES[k % len(SENTENCES)]
                parts.append(_espeak(text, 140 + 10 * (i % 5), ("en", "en-us", "en-gb-x-rp")[i % 3]))
                parts.append(np.zeros(int(0.3 * 16000), np.float32))
                have += len(parts[-2]) + len(parts[-1])
                k += 1
            wave = 0.8 * np.concatenate(parts)[: size - tail]
        else:
            t = np.arange(size - tail) / 16000
            f0 = 100 + 60 * rng.random()
            harmonics = sum(np.sin(2 * np.pi * f0 * k * t + rng.random()) / k for k in range(1, 6))
            envelope = 0.5 + 0.5 * np.sin(2 * np.pi * (2 + i % 3) * t)
            wave = 0.3 * harmonics * envelope + 0.01 * rng.standard_normal(t.shape)
        out.append(np.concatenate([wave, np.zeros(size - len(wave))]).astype(np.float32))
    return out


async def mstar_side(checkpoint: Path, phases: list[dict], max_tokens: int, quantize: str | None) -> dict:
    """Each phase's clips at each of its concurrencies: wall, process CPU, latencies and text tokens, by label + c."""
    from mstar_core.model import LoadOptions
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    settings = {"decoder": {"num_pages": 1024, **({"quantize": quantize} if quantize else {})}}
    await engine.load_model("whisper", LoadOptions(checkpoint=str(checkpoint)), settings=settings)
    openmp.stop_huge_pages_after_load()  # as the server does once its models are in

    async def one(a: np.ndarray) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        handle = engine.submit("whisper", {"audio": torch.from_numpy(a), "language": "en", "max_tokens": max_tokens})
        tokens = [int(o.value) for o in [o async for o in handle] if o.name == "next_token"]
        await handle.result()
        return time.perf_counter() - t0, [t for t in tokens if t < 50257], len(tokens)

    await one(phases[0]["audio"][0])  # warm-up
    out = {}
    try:
        for phase in phases:
            for conc in phase["concurrency"]:
                sem = asyncio.Semaphore(conc)

                async def limited(a, sem=sem):
                    async with sem:
                        return await one(a)

                c0, t0 = time.process_time(), time.perf_counter()
                res = await asyncio.gather(*(limited(a) for a in phase["audio"]))
                out[phase["label"] + str(conc)] = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                                                   "latency": [r[0] for r in res], "tokens": [r[1] for r in res],
                                                   "next_tokens": [r[2] for r in res]}
    finally:
        await engine.close()
    return out


def _prefix_agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The tokens both sides wrote before they first differ, over the longer side's tokens, summed over clips."""
    common = longest = 0
    for a, b in zip(ours, theirs, strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        common, longest = common + k, longest + max(len(a), len(b))
    return common / max(longest, 1)


def fw_max_new_tokens(tokens: int, timestamps: bool) -> int:
    """faster-whisper's `max_new_tokens` for decoding up to `tokens` a window, as M* does: CTranslate2 decodes at most
    `min(max_length // 2, max_length - prompt)` where faster-whisper's `max_length` is its prompt plus this value
    (its prompt: SOT, language, task, and <|notimestamps|> when timestamps are off)."""
    prompt = 3 if timestamps else 4
    return 2 * tokens - prompt


def caller_env() -> dict[str, str]:
    """The environment this script was started with (before its re-execution for the M* side)."""
    env = dict(os.environ)
    if openmp.REEXEC_ENV not in env:
        return env
    for name, saved in CALLER_ENV.items():
        value = env.pop(saved, "")
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    env.pop(openmp.REEXEC_ENV)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="whisper-tiny size, 4 clips of 30 s, 16 tokens (under a minute once installed)")
    parser.add_argument("--compute-type", default="float32", choices=("float32", "int8"))
    parser.add_argument("--torch-openmp", action="store_true",
                        help="run the M* side on torch's own OpenMP runtime instead of the one `mstar serve` preloads")
    parser.add_argument("--long-clips", type=int, default=None,
                        help="clips of 5 minutes (Whisper's sequential long-form): 4 in the full run, none in --quick")
    args = parser.parse_args()
    # clips of exactly 30 s: both sides then compute the log-mel of the same samples (see the docstring)
    n, seconds, max_tokens, size = (4, 30.0, 16, "tiny") if args.quick else (16, 30.0, 96, "base")
    threads = os.cpu_count() or 2
    torch.set_num_threads(threads)
    fw_python = ensure_faster_whisper()
    checkpoint = ensure_checkpoint(size)
    ct2 = ensure_ct2(fw_python, checkpoint, args.compute_type)
    concurrency = [1, 8]
    # short: one 30-second window per clip, no timestamps; long (full run only): Whisper's sequential long-form,
    # timestamps on both sides (M* seeks by them; faster-whisper too, with its documented defaults otherwise)
    phases = [{"label": "short", "audio": clips(n, seconds), "concurrency": concurrency, "timestamps": False}]
    long_clips = (0 if args.quick else 4) if args.long_clips is None else args.long_clips
    if long_clips:
        phases.append({"label": "long", "audio": clips(long_clips, LONG_SECONDS), "concurrency": concurrency,
                       "timestamps": True})
    total_seconds = n * seconds

    t0 = time.perf_counter()
    ours = asyncio.run(mstar_side(checkpoint, phases, max_tokens, "int8" if args.compute_type == "int8" else None))
    log(f"M* done in {time.perf_counter() - t0:.1f} s: " + ", ".join(
        f"{k} wall {v['wall']:.1f} s cpu {v['cpu']:.1f} s" for k, v in ours.items()))  # (kept if the other side fails)
    with tempfile.TemporaryDirectory() as tmp:
        fw_phases = []
        for phase in phases:
            paths = []
            for i, a in enumerate(phase["audio"]):
                paths.append(str(Path(tmp) / f"{phase['label']}{i}.npy"))
                np.save(paths[-1], a)
            fw_phases.append({"label": phase["label"], "clips": paths, "concurrency": phase["concurrency"],
                              "timestamps": phase["timestamps"],
                              "max_new_tokens": fw_max_new_tokens(max_tokens, phase["timestamps"])})
        spec = {"model": str(ct2), "phases": fw_phases, "compute_type": args.compute_type,
                "threads": threads, "max_new_tokens": max_tokens, "suppress_tokens": SPECIAL_SUPPRESS,
                "prompt": MSTAR_PROMPT}
        t0 = time.perf_counter()
        run = subprocess.run([str(fw_python), "-c", FW_SCRIPT, json.dumps(spec)], capture_output=True, text=True,
                             env={**caller_env(), "OMP_NUM_THREADS": str(threads)})
        if run.returncode:
            raise SystemExit(f"faster-whisper failed:\n{run.stderr[-3000:]}")
        theirs = json.loads(run.stdout.strip().splitlines()[-1])
        log(f"faster-whisper done in {time.perf_counter() - t0:.1f} s")

    def figures(side: dict, label: str = "short", seconds: float = total_seconds) -> dict:
        c1, c8 = side[label + "1"], side[label + "8"]
        return {"audio_s_per_wall_s_c8": seconds / c8["wall"], "latency_p50_c1": float(np.median(c1["latency"])),
                "latency_p99_c1": float(np.percentile(c1["latency"], 99)),
                "cpu_s_per_audio_min_c8": c8["cpu"] / (seconds / 60),
                "cpu_s_per_audio_min_c1": c1["cpu"] / (seconds / 60)}

    m, f = figures(ours), figures(theirs)
    same = sum(a == b for a, b in zip(ours["short1"]["tokens"], theirs["short1"]["tokens"], strict=True))
    result = {
        "benchmark": "whisper", "quick": args.quick, "size": size, "compute_type": args.compute_type, "clips": n,
        "clip_seconds": seconds, "max_new_tokens": max_tokens, "threads": threads,
        "audio": "espeak-ng" if shutil.which("espeak-ng") else "synthetic harmonics (espeak-ng not installed)",
        "mstar": m, "faster_whisper": f,
        "mstar_runtime": "torch's OpenMP" if args.torch_openmp or openmp.REEXEC_ENV not in os.environ
        else "as served (Intel OpenMP, malloc huge pages while loading)",
        "faster_whisper_settings": {"beam_size": 1, "best_of": 1, "temperature": 0.0, "without_timestamps": True,
                                    "suppress_tokens": SPECIAL_SUPPRESS,
                                    "condition_on_previous_text": False, "vad_filter": False, "cpu_threads": threads,
                                    "num_workers": "= concurrency", "compute_type": args.compute_type,
                                    "max_new_tokens": fw_max_new_tokens(max_tokens, False)},
        "throughput_ratio_c8": m["audio_s_per_wall_s_c8"] / f["audio_s_per_wall_s_c8"],
        "latency_p50_ratio_c1": m["latency_p50_c1"] / f["latency_p50_c1"],
        # the CPU seconds each side's process spent on the c=8 run, faster-whisper's over M*'s (higher: M* cheaper):
        # less swayed than wall time by other jobs on a shared box, which both runs share unevenly
        "cpu_time_ratio_c8": f["cpu_s_per_audio_min_c8"] / m["cpu_s_per_audio_min_c8"],
        "text_agreement": same / n,
        # why it is what it is: faster-whisper's prompt for this checkpoint (multilingual by CTranslate2's test: the
        # empty text token), and the agreement when CTranslate2's own greedy generate gets M*'s prompt on
        # faster-whisper's features
        "faster_whisper_prompt": theirs["prompt"], "mstar_prompt": MSTAR_PROMPT,
        "faster_whisper_multilingual": theirs["multilingual"],
        "text_agreement_ct2_same_prompt": sum(a == b for a, b in zip(ours["short1"]["tokens"], theirs["same_prompt_tokens"],
                                                                     strict=True)) / n,
        # tokens the two agree on before they first differ, over all clips' tokens (random weights leave near-ties
        # that fp32 rounding differences between the two encoders flip)
        "token_prefix_agreement_ct2_same_prompt": _prefix_agreement(ours["short1"]["tokens"], theirs["same_prompt_tokens"]),
        # is the c=1 latency race even? the mean text tokens each side wrote per clip (neither counts its prompt)
        "decode_tokens_c1": [float(np.mean([len(t) for t in ours["short1"]["tokens"]])),
                             float(np.mean([len(t) for t in theirs["short1"]["tokens"]]))],
        # the decoder steps each ran per clip: every token M* sampled, every token CTranslate2's generate returned
        # to faster-whisper (its text tokens above leave out the windows it drops as no speech)
        "decode_steps_c1": [float(np.mean(ours["short1"]["next_tokens"])), theirs["short1"]["generated"] / n],
        "cpu_flags": cpu_flags(),
    }
    if len(phases) > 1:  # the long clips: the same figures, and the text tokens each side wrote (windows differ)
        long_seconds = long_clips * LONG_SECONDS
        ml, fl = figures(ours, "long", long_seconds), figures(theirs, "long", long_seconds)
        result["long"] = {
            "clips": long_clips, "clip_seconds": LONG_SECONDS, "mstar": ml, "faster_whisper": fl,
            "faster_whisper_settings": {"without_timestamps": False, "condition_on_previous_text": False},
            "throughput_ratio_c8": ml["audio_s_per_wall_s_c8"] / fl["audio_s_per_wall_s_c8"],
            "latency_p50_ratio_c1": ml["latency_p50_c1"] / fl["latency_p50_c1"],
            "cpu_time_ratio_c8": fl["cpu_s_per_audio_min_c8"] / ml["cpu_s_per_audio_min_c8"],
            "text_tokens_c1": [sum(map(len, ours["long1"]["tokens"])), sum(map(len, theirs["long1"]["tokens"]))],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
