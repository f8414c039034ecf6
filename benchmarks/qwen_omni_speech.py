"""Qwen3-Omni speech: M* (Thinker, Talker, code predictor and Code2Wav as concurrent partitions) vs transformers.

Baseline: `Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)` request by request (its audio
path is batch 1), which returns the audio when everything is done. Same random weights (a realistic CPU
shape, written in the published layout and loaded by both), same run, text in, text and speech out with
fixed lengths: the Thinker writes `--text-tokens` tokens and the Talker `--frames` frames (80 ms each),
end tokens ignored on both sides.

- `ttfa_ratio_c1`: M*'s time to its first audio chunk (25 frames, as streamed) over the baseline's time to
  its audio (the whole generate call). Target <= 0.25.
- `throughput_ratio_c16`: audio seconds per wall second with 16 concurrent requests on M*, over the
  baseline's request-by-request rate. Target >= 2.7 (the published edge over vLLM-Omni).

Both sides sample the speech with the published defaults (Talker temperature 0.9, top-k 50, repetition
penalty 1.05; code predictor top-k 50, top-p 0.8), as a user runs the model; the Thinker stays greedy (fixed
text). `--greedy` decodes the speech greedily on both sides instead (the sampler then plays no part).
`ttfa_cpu_ratio_c1` is the TTFA ratio in process CPU seconds (M*'s to its first chunk over a whole baseline call).

Both sides get the same torch intra-op threads (`--threads`, default 1: on a small shared CPU box a
second thread makes the baseline's thousands of tiny ops wait at OpenMP barriers for a descheduled
thread) and never run at the same time: baseline and M* c=1 requests alternate, then the c=16 wave.
Beside the wall-clock ratios the JSON gives each side's process CPU seconds per audio second
(`*_cpu_per_audio_s`), which a loaded box inflates far less than wall time, and the load average.

`--dtype bfloat16` loads the Thinker, Talker and code predictor in bf16 on both sides (Code2Wav stays fp32 on both).
`--quick` runs the same model and the same c=1 requests with one baseline run, and a c=16 wave of half-length
requests (62 frames after 20 text tokens), so it reads the full run's ratios in about a third of its time.

    python benchmarks/qwen_omni_speech.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


#: The model's sizes, the same for `--quick` and the full run. Until session 7 `--quick` ran a smaller model (Thinker
#: 256 x 2, Talker 128 x 2, 8 code groups), 6 text tokens and 50 frames at c=2: its first 25-frame chunk was half
#: of the answer and two requests amortise little, so it read 0.435 / 2.2 against the full run's 0.243 / 6-7.
SIZE = {"thinker": 512, "thinker_layers": 8, "talker": 256, "talker_layers": 4, "groups": 16, "code2wav": 128,
        "code2wav_layers": 4}


def bench_config(tok) -> dict:
    """The tiny preset's config widened: Thinker 512 x 8 layers (8 experts, top 2), Talker 256 x 4,
    code predictor 2 layers, Code2Wav with the published codebooks and rates but narrower."""
    from mstar_qwen_omni.preset import tiny_config

    size = SIZE
    th, tk, groups, cw = size["thinker"], size["talker"], size["groups"], size["code2wav"]
    cfg = tiny_config(tok)
    text = cfg["thinker_config"]["text_config"]
    text.update(hidden_size=th, num_hidden_layers=size["thinker_layers"], num_attention_heads=th // 64,
                num_key_value_heads=2, head_dim=64, moe_intermediate_size=th // 2, intermediate_size=2 * th,
                rope_scaling={"rope_type": "default", "mrope_section": [12, 10, 10], "interleaved": True})
    cfg["thinker_config"]["audio_config"]["output_dim"] = th
    cfg["thinker_config"]["vision_config"]["out_hidden_size"] = th
    talker = cfg["talker_config"]
    talker["text_config"].update(vocab_size=2048 + 1024, hidden_size=tk, num_hidden_layers=size["talker_layers"],
                                 num_attention_heads=tk // 64, num_key_value_heads=2, head_dim=64,
                                 moe_intermediate_size=tk // 2, intermediate_size=2 * tk,
                                 shared_expert_intermediate_size=tk,
                                 rope_scaling={"rope_type": "default", "mrope_section": [12, 10, 10], "interleaved": True})
    talker["code_predictor_config"].update(vocab_size=2048, hidden_size=tk, intermediate_size=2 * tk,
                                           num_hidden_layers=2, num_attention_heads=tk // 64, num_key_value_heads=2,
                                           head_dim=64, num_code_groups=groups)
    talker.update(num_code_groups=groups, thinker_hidden_size=th, accept_hidden_layer=min(4, size["thinker_layers"]),
                  codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_nothink_id=2155,
                  codec_think_bos_id=2156, codec_think_eos_id=2157,
                  speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303})
    cfg["code2wav_config"].update(codebook_size=2048, num_quantizers=groups, hidden_size=cw, num_attention_heads=4,
                                  num_key_value_heads=4, intermediate_size=2 * cw,
                                  num_hidden_layers=size["code2wav_layers"], sliding_window=72,
                                  upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=cw)
    return cfg


def write_checkpoint(directory: Path) -> Path:
    from mstar_qwen_omni.checkpoint import QwenOmni, save_omni
    from mstar_qwen_omni.config import OmniConfig
    from mstar_qwen_omni.preset import build_tokenizer, randomize

    tok = build_tokenizer()
    cfg = bench_config(tok)
    model = QwenOmni(OmniConfig.from_hf(cfg))
    randomize(model, seed=0)
    save_omni(model, directory, cfg, extra_files={"tokenizer.json": tok.to_str()})
    return directory


def prompt_ids(tokenizer, i: int) -> list[int]:
    system = "<|im_start|>system\nYou are Qwen, a virtual human.<|im_end|>\n"
    text = f"{system}<|im_start|>user\nTell me story number {i}, please.<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False).ids


#: `--sample`: the speaking side's published sampling defaults, on both sides (the Talker's temperature, top-k and
#: repetition penalty; the code predictor's top-k 50 / top-p 0.8 are fixed in both implementations)
SAMPLED = {"temperature": 0.9, "top_k": 50, "repetition_penalty": 1.05}


def baseline(hf, ids: list[int], text_tokens: int, frames: int, im_end: int, sample: bool = False) -> tuple[float, float]:
    """(seconds to the audio, audio seconds) of one `generate(return_audio=True)` call, EOS ignored on both sides."""
    talker = ({f"talker_{k}": v for k, v in SAMPLED.items()} | {"talker_top_p": 1.0} if sample
              else {"talker_repetition_penalty": 1.0})
    start = time.perf_counter()
    with torch.no_grad():
        _, wav = hf.generate(torch.tensor([ids]), speaker="ethan", return_audio=True,
                             thinker_max_new_tokens=text_tokens, thinker_min_new_tokens=text_tokens,
                             thinker_eos_token_id=im_end, thinker_do_sample=False, talker_do_sample=sample,
                             talker_max_new_tokens=frames + 1, talker_min_new_tokens=frames + 1,  # min = max: no EOS
                             **talker)
    return time.perf_counter() - start, wav.shape[-1] / 24000


async def mstar_requests(engine, tokenizer, n: int, text_tokens: int, frames: int, sample: bool = False) -> list[dict]:
    talker = ({f"talker_{k}": v for k, v in SAMPLED.items()} if sample
              else {"talker_temperature": 0.0, "talker_repetition_penalty": 1.0})

    async def one(i: int) -> dict:
        start, cpu = time.perf_counter(), cpu_seconds()
        handle = engine.submit("qwen3-omni", {"prompt_ids": prompt_ids(tokenizer, i), "speaker": "ethan",
                                              "max_tokens": text_tokens, "talker_max_tokens": frames + 1,
                                              "ignore_eos": True, "seed": i, **talker})
        first, first_cpu, samples = None, None, 0
        async for out in handle:
            if out.name == "audio":
                if first is None:  # process CPU too: at c=1 the request is all this process does
                    first, first_cpu = time.perf_counter() - start, cpu_seconds() - cpu
                samples += out.value.numel()
        await handle.result()
        return {"ttfa": first, "ttfa_cpu": first_cpu, "seconds": time.perf_counter() - start, "audio": samples / 24000}

    return await asyncio.gather(*(one(i) for i in range(n)))


def cpu_seconds() -> float:
    """This process's user + system CPU seconds (every thread: M*'s device thread and event loop alike)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


async def main_async(args) -> dict:
    from mstar_qwen_omni.config import OmniConfig
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from mstar_core.checkpoint import load_tokenizer
    from mstar_core.model import LoadOptions
    from mstar_core.plugins import discover
    from mstar_core.runtime import AsyncEngine

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)  # both sides, same count
    load_start = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_checkpoint(Path(tmp))
        tokenizer = load_tokenizer(directory)
        hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(directory, dtype=getattr(torch, args.dtype)).eval()
        hf.code2wav.float()  # the codec runs in fp32 whatever the LM dtype, as on M*'s side
        # transformers' code predictor samples (top-k 50, top-p 0.8) only when its generation config says so
        hf.talker.code_predictor.generation_config.do_sample = args.sample
        im_end = OmniConfig.from_hf(json.loads((directory / "config.json").read_text())).im_end_token_id
        async with AsyncEngine(discover()) as engine:
            await engine.load_model("qwen3-omni", LoadOptions(checkpoint=str(directory), dtype=args.dtype))
            baseline(hf, prompt_ids(tokenizer, 0), 2, 2, im_end)  # warm-ups
            await mstar_requests(engine, tokenizer, 1, 2, 2)
            # one side at a time, alternating, so a change in the box's load falls on both
            base, c1, base_cpus, c1_cpu = [], [], [], 0.0
            for i in range(args.baseline_runs):
                cpu = cpu_seconds()
                base.append(baseline(hf, prompt_ids(tokenizer, i), args.text_tokens, args.frames, im_end,
                                     args.sample))
                base_cpus.append(cpu_seconds() - cpu)
                cpu = cpu_seconds()
                c1.append((await mstar_requests(engine, tokenizer, 1, args.text_tokens, args.frames, args.sample))[0])
                c1_cpu += cpu_seconds() - cpu
            cpu, start = cpu_seconds(), time.perf_counter()
            many = await mstar_requests(engine, tokenizer, args.concurrency, args.wave_text_tokens, args.wave_frames,
                                        args.sample)
            wall = time.perf_counter() - start
            many_cpu = cpu_seconds() - cpu
    base_time = statistics.median(t for t, _ in base)
    base_rate = sum(a for _, a in base) / sum(t for t, _ in base)
    mstar_ttfa = statistics.median(r["ttfa"] for r in c1)
    mstar_rate = sum(r["audio"] for r in many) / wall
    return {
        "benchmark": "qwen_omni_speech", "quick": args.quick, "dtype": args.dtype, "sample": args.sample,
        "text_tokens": args.text_tokens, "frames": args.frames, "wave_frames": args.wave_frames,
        "torch_threads": torch.get_num_threads(), "load_average_start": load_start, "load_average_end": load_average(),
        "audio_seconds_per_request": round(many[0]["audio"], 3),
        "baseline_seconds_to_audio": round(base_time, 3), "mstar_ttfa_c1": round(mstar_ttfa, 3),
        "ttfa_ratio_c1": round(mstar_ttfa / base_time, 3),
        # the same ratio in process CPU seconds (M*'s to its first chunk over a whole baseline call): less load-bound
        "ttfa_cpu_ratio_c1": round(statistics.median(r["ttfa_cpu"] for r in c1) / statistics.median(base_cpus), 3),
        "baseline_audio_s_per_s": round(base_rate, 3),
        # the key names stay those of the target (c=16); `concurrency` says how many ran at once
        "concurrency": args.concurrency,
        "mstar_audio_s_per_s_c16": round(mstar_rate, 3),
        "throughput_ratio_c16": round(mstar_rate / base_rate, 3),
        # CPU seconds per audio second (all threads of the process): less load-sensitive than the wall ratios
        "baseline_cpu_per_audio_s": round(sum(base_cpus) / sum(a for _, a in base), 3),
        "mstar_c1_cpu_per_audio_s": round(c1_cpu / sum(r["audio"] for r in c1), 3),
        "mstar_cpu_per_audio_s_c16": round(many_cpu / sum(r["audio"] for r in many), 3),
        "mstar_c1_seconds": [round(r["seconds"], 2) for r in c1],
        "baseline_seconds": [round(t, 2) for t, _ in base],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the same model and c=1 requests, one baseline run, a c=16 wave of half-length requests")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="Thinker, Talker and code predictor weights and KV on both sides (Code2Wav stays fp32)")
    parser.add_argument("--frames", type=int, default=None, help="audio frames per request (12.5 per second)")
    parser.add_argument("--text-tokens", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--baseline-runs", type=int, default=None)
    parser.add_argument("--greedy", action="store_true",
                        help="both sides decode the speech greedily (default: both sample it as published: Talker "
                             "temperature 0.9, top-k 50, repetition penalty 1.05; code predictor top-k 50, top-p 0.8)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both sides (default 1: a shared busy box gives one core at best)")
    args = parser.parse_args()
    args.sample = not args.greedy
    # --quick measures what the full run does (the first 25-frame chunk of a 125-frame answer after 40 text tokens;
    # 16 at once) with one baseline run and the c=16 wave's requests at half length in the same proportion
    args.frames = args.frames or 125
    args.text_tokens = args.text_tokens or 40
    args.baseline_runs = args.baseline_runs or (1 if args.quick else 2)
    args.wave_frames = args.frames // 2 if args.quick else args.frames
    args.wave_text_tokens = args.text_tokens // 2 if args.quick else args.text_tokens
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
