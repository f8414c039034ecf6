"""`mstar serve llama --checkpoint HuggingFaceTB/SmolLM2-135M-Instruct` with HF_HUB_OFFLINE=1, from a Hub cache this
test writes (the tiny Llama preset's files as that repository's snapshot, with a generation_config.json that sets
sampling): the server loads it, says the checkpoint's defaults on GET /v1/models, applies them to a request that
leaves sampling unset (a request's own fields win), and `--generation-config none` keeps greedy decoding. An id
the cache lacks stops the server with a message naming the id and the cache."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.checkpoint.hub_cache import cache_repo
from tests.server.helpers import Server, free_port, server_env

pytest.importorskip("mstar_llm")
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1,
              "max_new_tokens": 5, "eos_token_id": [2]}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    from mstar_llm.preset import ensure_tiny

    home = tmp_path_factory.mktemp("hf")
    files = home / "files"
    shutil.copytree(ensure_tiny(), files)
    generation = json.loads((files / "generation_config.json").read_text())
    (files / "generation_config.json").write_text(json.dumps({**generation, **GENERATION}))
    cache_repo(home / "hub", REPO, files)
    shutil.rmtree(files)
    return home


@pytest.fixture(scope="module")
def server(hf_home):
    srv = Server(["llama"], "--checkpoint", REPO, api_key=None, plugins=(), HF_HOME=str(hf_home))
    try:
        yield srv
    finally:
        srv.stop()


def _chat(server: Server, **fields) -> dict:
    body = {"model": "llama", "messages": [{"role": "user", "content": "Hello"}], **fields}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _text(server: Server, **fields) -> str:
    return _chat(server, **fields)["choices"][0]["message"]["content"]


def test_serves_the_cached_snapshot_and_says_its_defaults(server, hf_home):
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    (card,) = models
    assert card["id"] == "llama" and card["random_weights"] is False
    defaults = card["defaults"]
    assert {k: defaults[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "max_tokens": 5}
    assert httpx.get(f"{server.url}/v1/models/llama").json() == card
    missing = httpx.get(f"{server.url}/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert REPO in server.output()  # the banner names the checkpoint as given


def test_the_checkpoint_defaults_apply_and_a_request_overrides_them(server):
    # max_new_tokens 5: a chat that leaves max_tokens unset stops at 5 (not at SamplingParams' own 256)
    # (<|im_end|>, id 2, held off: the tiny preset ends its replies by itself, and under ignore_eos alone writes it
    # between its tokens; with it the usage said 3 of the 5)
    default = _chat(server, ignore_eos=True, logit_bias={"2": -100})
    assert default["usage"]["completion_tokens"] == 5 and default["choices"][0]["finish_reason"] == "length"
    assert _chat(server, ignore_eos=True, logit_bias={"2": -100}, max_tokens=9)["usage"]["completion_tokens"] == 9
    # temperature 0.7 by default: different seeds draw different texts; temperature 0 from the request is greedy
    sampled = {_text(server, seed=s, ignore_eos=True, max_tokens=12) for s in range(4)}
    assert len(sampled) > 1
    greedy = {_text(server, seed=s, ignore_eos=True, max_tokens=12, temperature=0) for s in range(3)}
    assert len(greedy) == 1


@pytest.mark.slow  # a second server (tests/llm/test_generation_defaults.py covers `none` in process)
def test_generation_config_none_keeps_greedy(hf_home):
    srv = Server(["llama"], "--checkpoint", REPO, "--generation-config", "none", api_key=None, plugins=(),
                 HF_HOME=str(hf_home))
    try:
        defaults = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["defaults"]
        assert (defaults["temperature"], defaults["max_tokens"]) == (0.0, 256)
        texts = {_text(srv, seed=s, ignore_eos=True, max_tokens=8) for s in range(3)}
        assert len(texts) == 1
    finally:
        srv.stop()


@pytest.mark.slow  # a third start (tests/checkpoint/test_hub.py covers the error in process)
def test_an_id_missing_from_the_cache_stops_the_server_naming_it(hf_home):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "mstar_core.cli", "serve", "llama", "--checkpoint", "nobody/nothing@v1",
           "--port", str(free_port())]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=server_env(HF_HOME=str(hf_home)))
    assert out.returncode == 1
    assert "nobody/nothing@v1" in out.stderr and str(hf_home / "hub") in out.stderr and "mstar pull" in out.stderr
