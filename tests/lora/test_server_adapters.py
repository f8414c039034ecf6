"""LoRA adapters over HTTP: named in the deploy file, loaded and unloaded with vLLM's routes, chosen by `model`
with the official openai client, listed by /v1/models with their parent."""

from __future__ import annotations

import httpx
import pytest
import yaml

from mstar_core.errors import ConfigError
from tests.server.helpers import Server

openai = pytest.importorskip("openai")
pytest.importorskip("mstar_llm")


@pytest.fixture(scope="module")
def server(tiny_adapters, tmp_path_factory):
    _, adapters = tiny_adapters
    deploy = tmp_path_factory.mktemp("deploy") / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"models": {"llama": {
        "preset": "tiny", "lora_adapters": {"sql": str(adapters["sql"][0])}, "max_loras": 2, "max_lora_rank": 8}}}))
    srv = Server([], "--config", str(deploy))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def _complete(client, model):
    # <|im_end|> (2) held off: the tiny preset ends its replies by itself and would write it at every other step
    out = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                    logit_bias={"2": -100}, extra_body={"ignore_eos": True})
    return out.choices[0].text, out.model


def test_chat_with_an_adapter_by_model_name(client):
    reply = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Name a colour."}],
                                           max_tokens=6, temperature=0)
    assert reply.model == "sql" and reply.choices[0].finish_reason in ("stop", "length")
    base, _ = _complete(client, "llama")
    adapted, model = _complete(client, "sql")
    assert model == "sql" and adapted != base
    assert _complete(client, "sql")[0] == adapted


def test_models_lists_adapters_with_their_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["sql"].model_extra["parent"] == "llama"
    assert "chat" in cards["sql"].model_extra["routes"]
    assert "parent" not in (cards["llama"].model_extra or {}) or cards["llama"].model_extra["parent"] is None


def test_load_and_unload_at_runtime(server, client, tiny_adapters):
    _, adapters = tiny_adapters
    post = lambda path, body: httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60)  # noqa: E731
    ok = post("/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(adapters["poet"][0])})
    assert ok.status_code == 200 and "poet" in ok.text
    assert "poet" in {m.id for m in client.models.list().data}
    poet, _ = _complete(client, "poet")
    assert poet != _complete(client, "llama")[0]
    # both slots taken: a third is refused, naming the bound
    full = post("/v1/load_lora_adapter", {"lora_name": "third", "lora_path": str(adapters["third"][0])})
    assert full.status_code == 400 and "max_loras" in full.json()["error"]["message"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "poet"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="poet"):
        _complete(client, "poet")
    gone = post("/v1/unload_lora_adapter", {"lora_name": "poet"})
    assert gone.status_code == 404 and "poet" in gone.json()["error"]["message"]
    # the freed slot takes another
    assert post("/v1/load_lora_adapter", {"lora_name": "third", "lora_path": str(adapters["third"][0])}).status_code == 200
    assert post("/v1/unload_lora_adapter", {"lora_name": "third"}).status_code == 200


def test_bad_load_requests_are_4xx_naming_the_problem(server, tmp_path):
    post = lambda body: httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=server.headers,  # noqa: E731
                                   timeout=60)
    missing = post({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 400 and "nowhere" in missing.json()["error"]["message"]
    taken = post({"lora_name": "llama", "lora_path": str(tmp_path)})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    unknown = post({"lora_name": "x", "lora_path": str(tmp_path), "lora_rank": 3})
    assert unknown.status_code in (400, 422) and "lora_rank" in unknown.text
    no_model = post({"lora_name": "x", "lora_path": str(tmp_path), "model": "nope"})
    assert no_model.status_code in (400, 404) and "nope" in no_model.text


def test_deploy_file_lora_keys_are_strict(tmp_path):
    from mstar_core.api.server.deploy import load_deploy

    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"models": {"llama": {"preset": "tiny", "max_lora": 2}}}))
    with pytest.raises(ConfigError, match=r"models.llama: unknown key\(s\) \['max_lora'\]"):
        load_deploy(path)
    path.write_text(yaml.safe_dump({"models": {"llama": {"preset": "tiny", "max_lora_rank": "big"}}}))
    with pytest.raises(ConfigError, match=r"models.llama.max_lora_rank must be an integer >= 1, got 'big'"):
        load_deploy(path)
    path.write_text(yaml.safe_dump({"models": {"llama": {"preset": "tiny", "lora_adapters": {"a": "/x"}}}}))
    assert dict(load_deploy(path)[1]["llama"].lora.adapters) == {"a": "/x"}


def test_serve_flags_name_adapters_like_vllm(tmp_path):
    import argparse

    from mstar_core.api.server.launch import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config, _, _ = build_config(parser.parse_args(["llama", "--lora-modules", "sql=/a/sql", "poet=/a/poet",
                                                   "--max-loras", "2"]))
    lora = config.models[0].lora
    assert (dict(lora.adapters), lora.max_loras, lora.max_lora_rank) == ({"sql": "/a/sql", "poet": "/a/poet"}, 2, 16)
    assert build_config(parser.parse_args(["llama"]))[0].models[0].lora is None
    with pytest.raises(ConfigError, match=r"--lora-modules 'sql': write NAME=PATH"):
        build_config(parser.parse_args(["llama", "--lora-modules", "sql"]))
    with pytest.raises(ConfigError, match=r"max_loras must be an integer >= 1, got 0"):
        build_config(parser.parse_args(["llama", "--max-loras", "0"]))
    with pytest.raises(ConfigError, match="apply to one served model"):
        build_config(parser.parse_args(["llama", "orpheus", "--max-loras", "2"]))
