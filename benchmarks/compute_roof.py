"""The compute roof of a decoder workload: the least time this machine's arithmetic allows for it.

A request's FLOPs: every layer's linears for each token that passes through them (the prompt's, and each generated
token but the last), the LM head for each token sampled (the prompt's last row, then each decode row), and causal
attention over the context each of those tokens sees (QK and PV). The machine's peak is `cpu_ceilings.c`'s
(register-only fp32 FMA, or AVX512-BF16 dot products, every core), built here with the system compiler. The roof
leaves memory out entirely, so no server reaches it; a target that needs most of it is out of reach of any lever
short of doing less arithmetic.

vs_llamacpp.py prints, per level above 1 and per dtype, the roof's output tokens/s and the share of it each side reached and each
target needs, and the roof's TTFT for the median prompt at c=1.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

CEILINGS = Path(__file__).with_name("cpu_ceilings.c")


def model_dims(model_dir: Path) -> dict[str, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"hidden": cfg["hidden_size"], "mlp": cfg["intermediate_size"], "layers": cfg["num_hidden_layers"],
            "heads": heads, "kv_heads": cfg.get("num_key_value_heads", heads),
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads, "vocab": cfg["vocab_size"]}


def _layer_linear_params(d: dict[str, int]) -> int:
    q_and_o = 2 * d["hidden"] * d["heads"] * d["head_dim"]
    k_and_v = 2 * d["hidden"] * d["kv_heads"] * d["head_dim"]
    return q_and_o + k_and_v + 3 * d["hidden"] * d["mlp"]  # gate, up, down


def _forward_flops(d: dict[str, int], first_position: int, tokens: int, sampled: int) -> float:
    """`tokens` tokens through every layer from `first_position`, `sampled` rows through the LM head."""
    linears = 2 * _layer_linear_params(d) * d["layers"] * tokens
    head = 2 * d["vocab"] * d["hidden"] * sampled
    # token at position t attends to t + 1 keys: 2 FLOPs a multiply-add, QK and PV, every query head and layer
    keys = sum(range(first_position + 1, first_position + tokens + 1))
    attention = 4 * d["heads"] * d["head_dim"] * d["layers"] * keys
    return float(linears + head + attention)


def request_flops(d: dict[str, int], prompt_tokens: int, output_tokens: int) -> float:
    """A whole request: the prompt's step (it samples the first token), then a decode step per further token."""
    return (_forward_flops(d, 0, prompt_tokens, 1)
            + _forward_flops(d, prompt_tokens, output_tokens - 1, output_tokens - 1))


def prompt_flops(d: dict[str, int], prompt_tokens: int) -> float:
    """The prompt's step alone: what stands between a request and its first token."""
    return _forward_flops(d, 0, prompt_tokens, 1)


def machine_peaks() -> dict[str, float] | str:
    """GFLOP/s every core can do: {"float32": FMA, "bfloat16": vdpbf16ps}; or why they were not measured."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return "no C compiler"
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "cpu_ceilings"
        build = subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", str(CEILINGS), "-o", str(binary)],
                               capture_output=True, text=True)
        if build.returncode != 0:
            return f"cpu_ceilings.c did not build here (it needs AVX512-BF16): {build.stderr.strip()[-200:]}"
        out = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300).stdout
    fp32 = re.search(r"fp32 FMA:\s+([\d.]+)", out)
    bf16 = re.search(r"bf16 vdpbf16ps:\s+([\d.]+)", out)
    if not (fp32 and bf16):
        return f"cpu_ceilings printed no peaks: {out[-200:]}"
    return {"float32": float(fp32.group(1)), "bfloat16": float(bf16.group(1))}


def roof_tok_s(d: dict[str, int], prompts: list[list[int]], output_tokens: int, gflop_s: float) -> float:
    """Output tokens/s if every FLOP of the level's requests ran at the peak, nothing else taking any time."""
    flops = sum(request_flops(d, len(p), output_tokens) for p in prompts)
    return len(prompts) * output_tokens / (flops / (gflop_s * 1e9))


def roof_ttft_ms(d: dict[str, int], prompt_tokens: int, gflop_s: float) -> float:
    return prompt_flops(d, prompt_tokens) / (gflop_s * 1e9) * 1e3


def share(value: float | None, roof: float) -> float | None:
    return None if value is None else round(value / roof, 3)


def _roof_over(roof_ms: float, ms: float | None) -> float | None:
    """The share of a TTFT that the roof's own time is (1.0: at the roof)."""
    return None if not ms else round(roof_ms / ms, 3)


def summary(d: dict[str, int], peaks: dict[str, float], prompts: dict[int, list[list[int]]], output_tokens: int,
            tok_s: dict[str, dict[int, dict[str, float | None]]], ttft_c1: dict[str, dict[str, float | None]],
            targets: dict[int, float], ttft_target: float, short: dict[str, str]) -> dict[str, Any]:
    """The roof per level and dtype, and what share of it each side reached (`tok_s[dtype][c][side]`) and each
    target needs (`targets[c]` times llama.cpp's figure); for TTFT at c=1, the roof's time over each side's."""
    out: dict[str, Any] = {"peak_gflop_s": peaks}
    for dtype, by_level in tok_s.items():
        for c, sides in by_level.items():
            if c == 1:
                continue  # one stream reads every weight a token: memory sets its pace (vs_llamacpp's floor), not this
            roof = roof_tok_s(d, prompts[c], output_tokens, peaks[dtype])
            peer = sides.get("llamacpp")
            out[f"c{c}_{short[dtype]}"] = {
                "roof_tok_s": round(roof, 1), "mstar": share(sides.get("mstar"), roof), "llamacpp": share(peer, roof),
                "target": share(None if peer is None else targets[c] * peer, roof)}
        if 1 in prompts and dtype in ttft_c1:
            lengths = sorted(len(p) for p in prompts[1])
            roof_ms = roof_ttft_ms(d, lengths[len(lengths) // 2], peaks[dtype])
            sides = ttft_c1[dtype]
            peer = sides.get("llamacpp")
            out[f"ttft_c1_{short[dtype]}"] = {
                "roof_ms": round(roof_ms, 1), "mstar": _roof_over(roof_ms, sides.get("mstar")),
                "llamacpp": _roof_over(roof_ms, peer), "target": _roof_over(roof_ms, None if peer is None else ttft_target * peer)}
    return out
