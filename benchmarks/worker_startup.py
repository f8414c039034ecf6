"""Worker start-up: placed engines with workers forked from the zygote vs fresh interpreters; meta builds with `on_meta`.

    python benchmarks/worker_startup.py [--quick] [--placement examples/placement/llama-prefill-decode.yaml]

Each side runs in a fresh interpreter of its own, the sides in turn (ABBA), so a burst of other jobs'
load hits both. A side loads the placed model `--engines` times one after another (as a test module
or a restarted server does) and reports each `load_model`'s wall seconds and the CPU seconds its
workers had spent when it returned (read from /proc: a load-independent figure). The meta side builds
the Orpheus model on the meta device (what a serving process or a worker does for nodes it does not host)
in a fresh interpreter, with `on_meta` and with a plain `torch.device("meta")`.
Prints one JSON line of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _engines(model: str, placement: str, n: int) -> dict:
    from mstar_core.cluster.strategy import placed_engine
    from mstar_core.config import load_placement
    from mstar_core.model import LoadOptions
    from mstar_core.plugins import discover

    walls, cpus = [], []
    for _ in range(n):
        engine = placed_engine(discover())
        t0 = time.perf_counter()
        await engine.load_model(model, LoadOptions(preset="tiny"), placement=load_placement(placement))
        walls.append(time.perf_counter() - t0)
        cpus.append(sum(_proc_cpu(w.process.pid) for w in engine.cluster.workers.values()))
        await engine.close()
    return {"wall_s": walls, "worker_cpu_s": cpus}


def _meta_build(plain: bool) -> dict:
    import torch
    from mstar_orpheus.model import load_orpheus

    from mstar_core.checkpoint import loader, meta
    from mstar_core.model import LoadOptions

    if plain:  # the build as it was: random initialisers run on the meta tensors
        loader.on_meta = meta.on_meta = lambda: torch.device("meta")
    t0 = time.perf_counter()
    load_orpheus(LoadOptions(preset="tiny", device="meta"), progress=False)
    return {"wall_s": [time.perf_counter() - t0], "dynamo_imported": "torch._dynamo" in sys.modules}


def _side(args: argparse.Namespace, side: str) -> dict:
    env = {**os.environ, "MSTAR_WORKER_ZYGOTE": "0" if side == "fresh" else "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, __file__, "--child", side, "--engines", str(args.engines), "--placement", args.placement,
           "--model", args.model]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"side {side} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, two engines a side (under 60 s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--model", default="llama")
    parser.add_argument("--placement", default=str(ROOT / "examples" / "placement" / "llama-prefill-decode.yaml"))
    parser.add_argument("--child", choices=("zygote", "fresh", "meta_plain", "meta_on_meta"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child in ("zygote", "fresh"):
        print(json.dumps(asyncio.run(_engines(args.model, args.placement, args.engines))))
        return
    if args.child:
        print(json.dumps(_meta_build(args.child == "meta_plain")))
        return
    if args.quick:
        args.rounds, args.engines = 1, 2
    runs: dict[str, list[dict]] = {}
    for i in range(args.rounds):
        order = ("zygote", "fresh", "meta_on_meta", "meta_plain")
        for side in order if i % 2 == 0 else order[::-1]:
            runs.setdefault(side, []).append(_side(args, side))

    def med(side: str, key: str, pick=lambda xs: xs) -> float:
        return round(statistics.median(v for r in runs[side] for v in pick(r[key])), 3)

    result = {
        "first_engine_wall_s": {s: med(s, "wall_s", lambda xs: xs[:1]) for s in ("zygote", "fresh")},
        "later_engine_wall_s": {s: med(s, "wall_s", lambda xs: xs[1:]) for s in ("zygote", "fresh")},
        "worker_cpu_at_ready_s": {s: med(s, "worker_cpu_s") for s in ("zygote", "fresh")},
        "orpheus_meta_build_s": {"on_meta": med("meta_on_meta", "wall_s"), "plain": med("meta_plain", "wall_s")},
        "dynamo_imported_by_meta_build": {"on_meta": runs["meta_on_meta"][0]["dynamo_imported"],
                                          "plain": runs["meta_plain"][0]["dynamo_imported"]},
        "model": args.model, "placement": Path(args.placement).name, "rounds": args.rounds, "engines": args.engines,
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
