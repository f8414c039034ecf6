"""benchmarks/vs_vllm.py without vLLM: every thread layout is served at every level and dtype, and each ratio is
against the layout that was best there (tok/s: the highest; TTFT p50: the lowest), named beside it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import pytest

# appended, not put first: a benchmark named after a package (benchmarks/qwen_tts.py) must not shadow it
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

import vllm_side
import vs_vllm


def _round(levels: dict[int, tuple[float, float]], startup: float = 10.0, texts=None) -> dict:
    """One server's round: per level (tok/s, TTFT p50 ms); the other figures derived so each is traceable."""
    out = {"startup_s": startup, "levels": {
        c: {"tok_s": tok, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 2, "itl_p50_ms": 1000 / tok,
            "cpu_s_per_1k_tok": tok / 10, "wall_s": 1000 / tok} for c, (tok, ttft) in levels.items()}}
    if texts is not None:
        out["texts"] = texts
    return out


def test_best_layout_highest_lowest_and_missing():
    assert vs_vllm.best_layout({"all": 10.0, "default": 12.0}) == "default"
    assert vs_vllm.best_layout({"all": 10.0, "default": 12.0}, lowest=True) == "all"
    assert vs_vllm.best_layout({"all": None, "default": 3.0}, lowest=True) == "default"  # a failed layout is no pick
    assert vs_vllm.best_layout({"all": 5.0, "default": 5.0}) == "all"  # equals: the first, deterministically
    assert vs_vllm.best_layout({"all": None}) is None and vs_vllm.best_layout({}) is None


def test_peer_at_level_takes_tok_s_and_ttft_from_their_own_winners():
    layouts = {"all": [_round({8: (150.0, 400.0)}), _round({8: (140.0, 380.0)})],
               "default": [_round({8: (100.0, 250.0)}), _round({8: (90.0, 270.0)})]}
    picks = vs_vllm.peer_at_level(layouts, 8)
    assert picks["tok_s"] == ("all", 145.0)  # median over its rounds, the highest layout
    assert picks["ttft_p50_ms"] == ("default", 260.0)  # the lowest TTFT, from the other layout
    assert picks["itl_p50_ms"][0] == "all" and picks["itl_p50_ms"][1] == pytest.approx((1000 / 150 + 1000 / 140) / 2)
    assert picks["ttft_p99_ms"] == ("all", 780.0)  # the rest describe the tok/s winner
    assert vs_vllm.peer_at_level(layouts, 32)["tok_s"] == (None, None)  # a level nobody measured


def _fixture_runs():
    """fp32: binding wins throughput at c=8, vLLM's own layout at c=1 and on TTFT at c=8; bf16 the reverse at c=1."""
    mstar = {
        "float32": [_round({1: (60.0, 40.0), 8: (300.0, 200.0)}, 4.0, ["a", "b", "c"])],
        "bfloat16": [_round({1: (80.0, 30.0), 8: (330.0, 180.0)}, 5.0, ["a", "b", "c"])],
    }
    vllm = {
        "float32": {"all": [_round({1: (30.0, 50.0), 8: (200.0, 300.0)}, 50.0, ["a", "x", "c"])],
                    "default": [_round({1: (40.0, 60.0), 8: (150.0, 250.0)}, 40.0, ["a", "b", "c"])]},
        "bfloat16": {"all": [_round({1: (50.0, 45.0), 8: (220.0, 260.0)}, 60.0, ["a", "b", "c"])],
                     "default": [{"error": "vllm 'default' bfloat16 round 0: exited"}]},
    }
    return mstar, vllm


def test_ratios_are_against_the_fastest_layout_per_level_and_dtype(capsys):
    mstar, vllm = _fixture_runs()
    out: dict = {}
    vs_vllm.summarize_layouts(out, mstar, vllm, ["float32", "bfloat16"], [1, 8], "vllm")
    assert out["tok_s_ratio_c1_fp32"] == round(60 / 40, 3)  # against 'default', the faster at c=1
    assert out["tok_s_ratio_c8_fp32"] == round(300 / 200, 3)  # against 'all', the faster at c=8
    assert out["ttft_p50_ratio_c8_float32"] == round(200 / 250, 3)  # the lowest TTFT: 'default' at c=8
    assert out["ttft_p50_ratio_c1_float32"] == round(40 / 50, 3)  # and 'all' at c=1
    assert out["tok_s_ratio_c1_bf16"] == round(80 / 50, 3)  # 'default' failed in bf16: 'all' is the only one
    assert out["ttft_p50_ratio_max"] == round(200 / 250, 3)
    assert out["tok_s_c8_float32"] == {"mstar": 300.0, "vllm": 200.0}
    assert out["ttft_p50_ms_c8_float32"] == {"mstar": 200.0, "vllm": 250.0}
    assert out["vllm_layout_used_c1_fp32"] == {"tok_s": "default", "ttft_p50": "all"}
    assert out["vllm_layout_used_c8_fp32"] == {"tok_s": "all", "ttft_p50": "default"}
    assert out["vllm_layout_used_c8_bf16"] == {"tok_s": "all", "ttft_p50": "all"}
    by_layout = out["vllm_layouts_c8_fp32"]
    assert by_layout["all"]["tok_s"] == 200.0 and by_layout["all"]["tok_s_ratio"] == 1.5
    assert by_layout["default"]["tok_s_ratio"] == 2.0 and by_layout["default"]["ttft_p50_ratio"] == 0.8
    assert out["vllm_layouts_c8_bf16"]["default"]["tok_s"] is None
    assert out["vllm_startup_s_fp32"] == {"all": 50.0, "default": 40.0}
    assert out["startup_s_float32"] == {"mstar": 4.0, "vllm": 40.0}  # the quickest layout
    assert out["startup_ratio"] == round(4.5 / 50.0, 3)  # medians over dtypes: M* (4, 5); vLLM (40, 60)
    # texts against the tok/s winner at the lowest level ('default' at c=1 in fp32), every layout beside it
    assert out["greedy_texts_identical_float32"] == "3/3"
    assert out["greedy_texts_identical_fp32_by_layout"] == {"all": "2/3", "default": "3/3"}
    assert out["errors_bfloat16"] == ["vllm 'default' bfloat16 round 0: exited"]
    printed = capsys.readouterr().out
    assert "tok/s ratio against 'all', TTFT p50 ratio against 'default'" in printed
    assert "tok/s ratio against 'default', TTFT p50 ratio against 'all'" in printed
    assert "vllm      'all': tok_s 200.0, ttft_p50_ms 300.0" in printed  # every layout's own figures
    assert "vllm  'default': tok_s 150.0, ttft_p50_ms 250.0" in printed


def test_a_peer_served_one_way_keeps_its_old_report():
    """vs_llamacpp's peer (one layout) through summarize_sides: the keys as before, no per-layout ones."""
    mstar, vllm = _fixture_runs()
    runs = {"float32": {"mstar": mstar["float32"], "llamacpp": vllm["float32"]["all"]}}
    out: dict = {}
    vs_vllm.summarize_sides(out, runs, ["float32"], [1, 8], "llamacpp")
    assert set(out) == {"tok_s_c1_float32", "ttft_p50_ms_c1_float32", "ttft_p99_ms_c1_float32", "itl_p50_ms_c1_float32",
                        "cpu_s_per_1k_tok_c1_float32", "tok_s_ratio_c1_fp32", "ttft_p50_ratio_c1_float32",
                        "tok_s_c8_float32", "ttft_p50_ms_c8_float32", "ttft_p99_ms_c8_float32", "itl_p50_ms_c8_float32",
                        "cpu_s_per_1k_tok_c8_float32", "tok_s_ratio_c8_fp32", "ttft_p50_ratio_c8_float32",
                        "startup_s_float32", "greedy_texts_identical_float32", "ttft_p50_ratio_max", "startup_ratio"}
    assert out["tok_s_ratio_c1_fp32"] == 2.0 and out["startup_s_float32"] == {"mstar": 4.0, "llamacpp": 50.0}
    assert out["greedy_texts_identical_float32"] == "2/3"


def test_side_order_turns_the_layouts_each_round():
    assert vs_vllm.side_order(["all", "default"], 0) == [None, "all", "default"]
    assert vs_vllm.side_order(["all", "default"], 1) == [None, "default", "all"]
    assert vs_vllm.side_order(["all", "default"], 2) == [None, "all", "default"]
    assert vs_vllm.side_order(["cuda"], 1) == [None, "cuda"]


def test_layouts_every_pinned_and_cuda(tmp_path):
    python = tmp_path / "bin" / "python"
    every = vs_vllm.vllm_layouts(python, False, "every", 2, 4, 32)
    assert list(every) == list(vllm_side.THREAD_LAYOUTS)
    assert every["all"][0]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "VLLM_CPU_OMP_THREADS_BIND" not in every["default"][0]
    assert list(vs_vllm.vllm_layouts(python, False, "default", 2, 4, 32)) == ["default"]
    assert list(vs_vllm.vllm_layouts(python, True, "every", 2, 4, 32)) == ["cuda"]


def test_main_serves_every_layout_at_every_level_and_dtype(monkeypatch, tmp_path):
    """The run itself with the servers faked: per round and dtype M* then each layout (order turned), each at every
    level, and the JSON's ratios against the faster layout."""
    served: list[tuple[str, str]] = []
    asked: list[tuple[tuple[int, ...], int]] = []
    speed = {"mstar": 300.0, "vllm all": 200.0, "vllm default": 100.0}

    async def fake_run_side(server, levels, prompts, warm, start_timeout, output_tokens):
        dtype = server.cmd[server.cmd.index("--dtype") + 1]
        served.append((server.name, dtype))
        asked.append((tuple(levels), output_tokens))
        boost = 3.0 if (server.name == "vllm default" and dtype == "bfloat16") else 1.0  # bf16: 'default' wins
        return _round({c: (speed[server.name] * boost / (1 + c / 100), 100.0) for c in levels}, 5.0)

    monkeypatch.setattr(vs_vllm, "run_side", fake_run_side)
    monkeypatch.setattr(vs_vllm.vllm_side, "ensure_venv", lambda cuda, install: (tmp_path / "python", "0.32.0", 0.0))
    monkeypatch.setattr(vs_vllm, "export_smollm2", lambda cache: tmp_path)
    monkeypatch.setattr(vs_vllm, "make_prompts", lambda model_dir, count, seed: [[1, 2, 3]] * count)
    monkeypatch.setattr(vs_vllm, "cpu_flags", lambda: {"bf16_units": True, "flags": []})
    monkeypatch.setattr(vs_vllm, "load", lambda: "load")
    args = argparse.Namespace(quick=False, concurrency="1,8", dtypes="float32,bfloat16", rounds=2, waves=1,
                              device="cpu", no_install=True, kv_gib=4, vllm_threads="every", mstar_env=[],
                              start_timeout=1.0, output_tokens=None)
    out = asyncio.run(vs_vllm.main(args))
    assert served == [("mstar", "float32"), ("vllm all", "float32"), ("vllm default", "float32"),
                      ("mstar", "bfloat16"), ("vllm all", "bfloat16"), ("vllm default", "bfloat16"),
                      ("mstar", "float32"), ("vllm default", "float32"), ("vllm all", "float32"),
                      ("mstar", "bfloat16"), ("vllm default", "bfloat16"), ("vllm all", "bfloat16")]
    assert out["vllm_threads"] == ["all", "default"] and set(asked) == {((1, 8), 128)}
    walls = [1000 / (speed[n] * (3.0 if (n, d) == ("vllm default", "bfloat16") else 1.0) / (1 + c / 100))
             for n, d in served for c in (1, 8)]
    assert out["measure_s"] == round(sum(walls), 1)  # every server's levels, start-ups not counted
    for c in (1, 8):
        assert out[f"tok_s_ratio_c{c}_fp32"] == 1.5 and out[f"vllm_layout_used_c{c}_fp32"]["tok_s"] == "all"
        assert out[f"tok_s_ratio_c{c}_bf16"] == 1.0 and out[f"vllm_layout_used_c{c}_bf16"]["tok_s"] == "default"
        assert out[f"vllm_layouts_c{c}_fp32"]["default"]["tok_s_ratio"] == 3.0

    served.clear()
    args.vllm_threads, args.rounds, args.dtypes = "all", 1, "float32"
    out = asyncio.run(vs_vllm.main(args))
    assert served == [("mstar", "float32"), ("vllm all", "float32")] and out["vllm_threads"] == ["all"]

    served.clear(), asked.clear()  # --quick: fewer levels and tokens, the same comparison (every layout)
    args.vllm_threads, args.quick = "every", True
    out = asyncio.run(vs_vllm.main(args))
    assert served == [("mstar", "float32"), ("vllm all", "float32"), ("vllm default", "float32")]
    assert set(asked) == {((8,), vs_vllm.QUICK_OUTPUT_TOKENS)} and out["output_tokens"] == vs_vllm.QUICK_OUTPUT_TOKENS
    assert out["tok_s_ratio_c8_fp32"] == 1.5 and out["vllm_layout_used_c8_fp32"]["tok_s"] == "all"
