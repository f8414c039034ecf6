"""`mstar bench serve --sweep/--plot`: one report per concurrency and a chart of them; a clear message without matplotlib."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from mstar_core.bench import serve


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(["--model", "m", "--kind", "chat", *extra])


def _fake_report(args, concurrency):
    lat = {"p50": 0.01 * concurrency, "p90": 0.02 * concurrency, "p99": 0.03 * concurrency, "mean": 0.015}
    return {"kind": "chat", "model": "m", "url": args.url, "mode": f"closed-loop x{concurrency}", "requests": 4,
            "succeeded": 4, "failed": 0, "wall_s": 1.0, "requests_per_s": 4.0, "latency_s": lat, "ttft_s": lat,
            "tpot_s": lat, "completion_tokens_total": 40, "tokens_per_s": 10.0 * concurrency}


def test_without_matplotlib_plot_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed

    async def never(args):
        raise AssertionError("no load may be sent when the plot cannot be drawn")

    monkeypatch.setattr(serve, "run_bench", never)
    assert serve.main(_args("--plot", "x.png")) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_sweep_draws_latency_and_throughput_against_concurrency(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    seen = []

    async def fake(args):
        seen.append(args.concurrency)
        return _fake_report(args, args.concurrency)

    monkeypatch.setattr(serve, "run_bench", fake)
    png = tmp_path / "serve.png"
    assert serve.main(_args("--sweep", "1,4,16", "--plot", str(png), "--json")) == 0
    assert seen == [1, 4, 16]
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["concurrency"] for r in out["sweep"]] == [1, 4, 16] and out["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_refuses_open_loop_and_bad_sweeps(monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    assert serve.main(_args("--rate", "5", "--plot", "x.png")) == 2
    assert "not --rate" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="positive integers"):
        serve.main(_args("--sweep", "1,zero"))
