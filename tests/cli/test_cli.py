"""The `mstar` command: plugins, graph, run (offline, through the adapters), bench serve against a live server."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from tests.server.helpers import Server, server_env
from tests.server.toy.mstar_toy_models import SAMPLE_RATE, SAMPLES_PER_CHUNK


def mstar(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "mstar_core.cli", *args], capture_output=True, text=True,
                         env=server_env(), timeout=timeout)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_plugins_lists_versions_and_failures():
    out = mstar("plugins", "--plugin", "mstar_toy_models").stdout
    core = next(line for line in out.splitlines() if line.strip().startswith("core "))
    assert "mstar-core" in core and "0.1.0" in core and core.rstrip().endswith("ok")
    broken = next(line for line in out.splitlines() if "fixture_broken" in line)
    assert "mstar-fixture-plugin" in broken and "FAILED: ImportError: fixture plugin is broken on purpose" in broken
    assert "toy-tts (mstar_toy_models)" in out and "function (core)" in out
    assert "toy-tts[speech]" in out
    assert mstar("plugins", "--strict", check=False).returncode == 1


def test_graph_mermaid_and_dot():
    mermaid = mstar("graph", "toy-chat", "--plugin", "mstar_toy_models").stdout
    assert mermaid.startswith("flowchart TD") and "lm [toy_paged]" in mermaid and "DynamicLoop" in mermaid
    dot = mstar("graph", "toy-tts", "--walk", "speak", "--format", "dot", "--plugin", "mstar_toy_models").stdout
    assert dot.startswith('digraph "speak" {') and "gen [toy_paged]" in dot and dot.rstrip().endswith("}")
    bad = mstar("graph", "toy-tts", "--walk", "nope", "--plugin", "mstar_toy_models", check=False)
    assert bad.returncode == 2 and "walks: speak" in bad.stderr
    unknown = mstar("graph", "nosuch", check=False)
    assert unknown.returncode == 2 and "known:" in unknown.stderr


def test_serve_an_unknown_model_names_the_close_one():
    pytest.importorskip("mstar_vjepa")
    out = mstar("serve", "vjepa", "--port", "1", check=False)  # refused before anything binds
    assert out.returncode == 2 and "unknown model 'vjepa' (did you mean 'vjepa2'?); installed:" in out.stderr


def test_run_speech_and_chat_offline(tmp_path):
    wav = tmp_path / "out.wav"
    out = mstar("run", "toy-tts", "--text", "hey", "--voice", "beta", "--out", str(wav), "--plugin", "mstar_toy_models")
    assert "wrote" in out.stdout and "random weights" in out.stderr
    audio, rate = soundfile.read(wav, dtype="int16")
    assert rate == SAMPLE_RATE and audio.shape == (3 * SAMPLES_PER_CHUNK,)
    t = np.arange(3 * SAMPLES_PER_CHUNK) / SAMPLE_RATE
    np.testing.assert_array_equal(audio, (0.5 * np.sin(2 * np.pi * 330.0 * t).astype(np.float32) * 32767).round())
    reply = tmp_path / "reply.txt"
    mstar("run", "toy-chat", "--prompt", "echo me", "--out", str(reply), "--plugin", "mstar_toy_models")
    assert reply.read_text() == "echo me"
    bad = mstar("run", "toy-image", "--text", "hi", "--plugin", "mstar_toy_models", check=False)
    assert bad.returncode == 2 and "no speech adapter" in bad.stderr


@pytest.fixture(scope="module")
def bench_server():
    srv = Server(["toy-tts", "toy-chat"], api_key="k", MSTAR_TOY_STEP_DELAY="0.002")
    yield srv
    srv.stop()


def test_bench_serve_speech_closed_loop(bench_server):
    text = "benchmark text"
    out = mstar("bench", "serve", "--url", bench_server.url, "--api-key", "k", "--model", "toy-tts", "--kind", "speech",
                "--voice", "alpha", "--input", text, "--concurrency", "4", "--num-requests", "12")
    assert "TTFA" in out.stdout and "RTF" in out.stdout and "streaming" in out.stdout
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["succeeded"] == 12 and report["failed"] == 0
    assert report["audio_s_total"] == pytest.approx(12 * len(text) * SAMPLES_PER_CHUNK / SAMPLE_RATE)
    assert 0 < report["ttfa_s"]["p50"] <= report["ttfa_s"]["p99"] <= report["latency_s"]["p99"]
    assert report["rtf"]["p50"] > 0 and 0 <= report["streaming_viable_fraction"] <= 1


def test_bench_serve_chat_poisson_json(bench_server):
    out = mstar("bench", "serve", "--url", bench_server.url, "--api-key", "k", "--model", "toy-chat", "--kind", "chat",
                "--input", "twelve chars", "--rate", "20", "--num-requests", "8", "--json")
    report = json.loads(out.stdout)
    assert report["mode"] == "poisson 20.0/s" and report["succeeded"] == 8
    assert report["completion_tokens_total"] == 8 * (len("twelve chars") + 1)
    assert report["ttft_s"]["p50"] > 0 and report["tokens_per_s"] > 0


def test_bench_serve_reports_failures(bench_server):
    out = mstar("bench", "serve", "--url", bench_server.url, "--model", "toy-tts", "--num-requests", "2", "--json",
                check=False)
    report = json.loads(out.stdout)
    assert out.returncode == 1 and report["failed"] == 2 and "401" in report["errors"][0]
