"""Checkpoints by Hugging Face Hub id: parsed, resolved through a Hub cache written in the test (HF_HUB_OFFLINE=1, as
every test runs), a local path winning over an id, and errors that name the id and the cache; `mstar pull`; the
deploy file's per-part `checkpoint:`."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from mstar_core.checkpoint.errors import CheckpointError
from mstar_core.checkpoint.hub import HubId, hub_cache_dir, pull, resolve_checkpoint, resolve_options
from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from tests.checkpoint.hub_cache import cache_repo

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def files(tmp_path) -> Path:
    src = tmp_path / "files"
    (src / "snac").mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "snac" / "config.json").write_text("{}")
    return src


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache under HF_HOME, offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


@pytest.mark.parametrize("text,want", [
    (REPO, HubId(REPO)),
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct@main", HubId("Qwen/Qwen3-Omni-30B-A3B-Instruct", "main")),
    ("org/name@0123456789abcdef0123456789abcdef01234567", HubId("org/name", "0123456789abcdef0123456789abcdef01234567")),
    ("org/name@refs/pr/3", HubId("org/name", "refs/pr/3")),
    ("/ckpt/orpheus", None), ("./org/name", None), ("~/org/name", None), ("a/b/c", None), ("gpt2", None),
    ("org/../name", None), ("org/name@", None), ("model.safetensors", None),
])
def test_hub_id_parse(text, want):
    assert HubId.parse(text) == want
    if want is not None:
        assert str(want) == text


def test_cache_dir_follows_the_environment_now(tmp_path, monkeypatch):
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert hub_cache_dir() == tmp_path / "direct"


def test_offline_reads_the_snapshot_its_ref_names(cache, files):
    main = cache_repo(cache, REPO, files)
    (files / "config.json").write_text('{"model_type": "llama", "v": 2}')
    v2 = cache_repo(cache, REPO, files, branch="v2")
    assert main != v2
    assert resolve_checkpoint(REPO) == str(main)
    assert resolve_checkpoint(f"{REPO}@v2") == str(v2)
    assert resolve_checkpoint(f"{REPO}@{v2.name}") == str(v2)  # a commit: its snapshot, no ref needed
    assert (Path(resolve_checkpoint(f"{REPO}@v2")) / "config.json").read_text().endswith('"v": 2}')


def test_a_local_path_wins_over_an_id(cache, files, tmp_path, monkeypatch):
    cache_repo(cache, REPO, files)
    local = tmp_path / "cwd" / REPO
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "cwd")
    assert resolve_checkpoint(REPO) == REPO  # the directory ./HuggingFaceTB/SmolLM2-135M-Instruct
    assert resolve_checkpoint(str(files)) == str(files)
    # neither a path nor an id: given back as is, for the loader to say it does not exist
    assert resolve_checkpoint("/no/such/dir") == "/no/such/dir"


def test_unknown_id_offline_names_the_id_and_the_cache(cache):
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("nobody/nothing@v1")
    message = str(err.value)
    assert "nobody/nothing@v1" in message and str(cache) in message and "HF_HUB_OFFLINE" in message
    assert "mstar pull nobody/nothing@v1" in message


def test_unreachable_hub_falls_back_to_the_cache_or_says_both(cache, files, monkeypatch):
    """Online with no Hub to reach (a closed port): a cached snapshot still serves; an uncached id is an error
    that names the id and the cache."""
    snapshot = cache_repo(cache, REPO, files)
    with monkeypatch.context() as m:
        m.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
        from huggingface_hub import constants

        m.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
        m.setattr(constants, "HF_HUB_OFFLINE", False)
        assert pull(REPO, offline=False) == snapshot
        with pytest.raises(CheckpointError) as err:
            pull("nobody/nothing", offline=False)
    assert "nobody/nothing" in str(err.value) and str(cache) in str(err.value)


def test_resolve_options_resolves_the_model_and_its_parts(cache, files, tmp_path):
    snapshot = cache_repo(cache, REPO, files)
    snac = cache_repo(cache, "hubertsiuzdak/snac_24khz", files / "snac")
    options = LoadOptions(checkpoint=REPO, parts={"snac": "hubertsiuzdak/snac_24khz"}, device="cpu")
    local = resolve_options(options)
    assert (local.checkpoint, dict(local.parts), local.device) == (str(snapshot), {"snac": str(snac)}, "cpu")
    preset = LoadOptions(preset="tiny")
    assert resolve_options(preset) is preset


def _cli(*args: str) -> tuple[int, str, str]:
    from mstar_core.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_pull_prints_where_each_id_is_and_fails_clearly(cache, files):
    snapshot = cache_repo(cache, REPO, files)
    assert _cli("pull", REPO) == (0, f"{REPO}: {snapshot}\n", "")
    code, _out, err = _cli("pull", "nobody/nothing")
    assert code == 1 and "nobody/nothing" in err and str(cache) in err
    code, _out, err = _cli("pull", "./not-an-id")
    assert code == 2 and "not a Hugging Face Hub id" in err


def test_deploy_file_checkpoint_per_model_and_per_part(tmp_path):
    from mstar_core.api.server.deploy import load_deploy

    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"""
models:
  llama: {{checkpoint: {REPO}, generation_config: none}}
  orpheus:
    checkpoint: {{model: canopylabs/orpheus-3b-0.1-ft, snac: hubertsiuzdak/snac_24khz}}
""")
    _server, models = load_deploy(deploy)
    assert (models["llama"].options.checkpoint, models["llama"].options.generation_config) == (REPO, "none")
    orpheus = models["orpheus"].options
    assert orpheus.checkpoint == "canopylabs/orpheus-3b-0.1-ft" and orpheus.preset is None
    assert dict(orpheus.parts) == {"snac": "hubertsiuzdak/snac_24khz"}
    assert orpheus.generation_config == "auto"
    deploy.write_text("models:\n  llama: {checkpoint: [a, b]}\n")
    with pytest.raises(ConfigError, match=r"models\.llama\.checkpoint must be a path or Hub id"):
        load_deploy(deploy)
    deploy.write_text("models:\n  llama: {generation_config: greedy}\n")
    with pytest.raises(ConfigError, match=r"models\.llama\.generation_config: 'greedy' is not 'auto', 'none'"):
        load_deploy(deploy)


def test_checkpoint_flag_for_a_part_and_generation_config_flag(tmp_path):
    import argparse

    from mstar_core.api.server.launch import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["orpheus", "llama", "--checkpoint", "orpheus.snac=hubertsiuzdak/snac_24khz",
                              "--checkpoint", f"llama={REPO}", "--generation-config", "llama=none"])
    config, _host, _port = build_config(args)
    by_name = {m.name: m.options for m in config.models}
    assert dict(by_name["orpheus"].parts) == {"snac": "hubertsiuzdak/snac_24khz"}
    assert by_name["orpheus"].preset == "tiny" and by_name["orpheus"].generation_config == "auto"
    assert (by_name["llama"].checkpoint, by_name["llama"].generation_config) == (REPO, "none")
    with pytest.raises(ConfigError, match="--generation-config 'greedy'"):
        build_config(parser.parse_args(["llama", "--generation-config", "greedy"]))
