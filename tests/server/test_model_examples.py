"""Every model's own example request (issue 13): served, it answers 200 on the native endpoint; the serve banner
prints it instead of an `{"inputs": {}}` that gets a 400; `mstar run --help` lists it; `/openapi.json` documents
each model's inputs for `/v1/walks/<model>`."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import httpx
import pytest

from mstar_core.api.server.launch import BANNER_EXAMPLE_CHARS
from mstar_core.plugins.manager import discover
from tests.server.helpers import Server

#: Models whose package has not declared its request schema with an example yet (issue 13): none left.
NOT_YET: set[str] = set()


def _models() -> dict:
    registry = discover()
    return {name: registry.models.get(name) for name in registry.models
            if not registry.models.origin.get(name, "").startswith("fixture")}


@pytest.fixture(scope="module")
def examples_server():
    names = sorted(n for n, spec in _models().items() if spec.example is not None)
    srv = Server(names)
    yield srv, names
    assert srv.stop() == 0
    assert "Traceback" not in srv.serving_output(), srv.serving_output()[-3000:]


def test_every_installed_model_declares_an_example():
    missing = sorted(n for n, spec in _models().items() if spec.example is None)
    assert set(missing) <= NOT_YET, f"models without an example request: {missing}"


def test_each_example_is_answered_with_a_200(examples_server):
    srv, names = examples_server
    assert {"llama", "orpheus", "example-captioner"} <= set(names)
    for name in names:
        example = _models()[name].example
        resp = httpx.post(f"{srv.url}/v1/walks/{name}", json={"inputs": example, "stream": False},
                          headers=srv.headers, timeout=120)
        assert resp.status_code == 200, (name, resp.text)
        assert resp.json()["outputs"], name


def test_banner_prints_each_models_example_and_it_works(examples_server):
    srv, names = examples_server
    deadline = time.monotonic() + 10
    while "M* serving at" not in srv.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    banner = srv.output()
    for name in names:
        line = next(ln for ln in banner.splitlines() if f"/v1/walks/{name} " in ln)
        assert '"inputs": {}' not in line
        argv = shlex.split(line.strip())
        data, example = argv[argv.index("-d") + 1], _models()[name].example
        if data == "@request.json":  # too long to paste (a waveform): the banner points at the graphs route's copy
            assert len(json.dumps({"inputs": example, "stream": False})) > BANNER_EXAMPLE_CHARS, name
            assert f"/v1/graphs/{name}" in banner
            shown = httpx.get(f"{srv.url}/v1/graphs/{name}", headers=srv.headers, timeout=30).json()["example"]
            body = {"inputs": shown, "stream": False}
        else:
            body = json.loads(data)
            assert body["inputs"] == example
        resp = httpx.post(argv[1], json=body, headers=srv.headers, timeout=120)
        assert resp.status_code == 200, (name, resp.text)


def test_openapi_documents_each_models_inputs(examples_server):
    srv, names = examples_server
    doc = httpx.get(f"{srv.url}/openapi.json", headers=srv.headers, timeout=30).json()
    schemas = doc["components"]["schemas"]
    for name in names:
        op = doc["paths"][f"/v1/walks/{name}"]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = schemas[ref.rsplit("/", 1)[1]]
        inputs = schemas[body["properties"]["inputs"]["$ref"].rsplit("/", 1)[1]]
        assert inputs["additionalProperties"] is False and inputs["properties"], name
        assert body["examples"][0]["inputs"] == _models()[name].example
    llama = schemas["llama.inputs"]["properties"]
    assert llama["seed"]["maximum"] == 2**63 - 1 and llama["top_p"]["exclusiveMinimum"] == 0
    assert {"required": ["prompt"]} in schemas["llama.inputs"]["oneOf"]
    orpheus = schemas["orpheus.inputs"]
    assert orpheus["required"] == ["text"] and "tara" in orpheus["properties"]["voice"]["enum"]
    assert orpheus["properties"]["temperature"]["default"] == 0.6
    assert "Tensor" in schemas and "/v1/walks/{model}" in doc["paths"]
    docs = httpx.get(f"{srv.url}/docs", headers=srv.headers, timeout=30)
    assert docs.status_code == 200 and "openapi.json" in docs.text


def test_unknown_native_field_is_a_400_listing_the_known_ones(examples_server):
    srv, _ = examples_server
    resp = httpx.post(f"{srv.url}/v1/walks/orpheus", json={"inputs": {"text": "Hi", "pitch": 2}},
                      headers=srv.headers, timeout=30)
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "pitch", err
    assert "unknown field(s) ['pitch']" in err["message"] and "'voice'" in err["message"]


def test_run_help_lists_each_models_example():
    out = subprocess.run([sys.executable, "-m", "mstar_core.cli", "run", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for name, spec in _models().items():
        if spec.example is not None:
            assert f"mstar run {name} --inputs '{json.dumps(spec.example)}'" in out.stdout


def test_banner_shows_each_routes_client_call_and_keeps_long_examples_out():
    """A newcomer's first call for every route family a model serves, and no wall of numbers for a waveform input."""
    from types import SimpleNamespace

    from mstar_core.api.server.app import ModelToServe, ServerConfig
    from mstar_core.api.server.launch import banner

    models = {name: SimpleNamespace(random_weights=True, example=example) for name, example in
              (("whisper", {"audio": [0.0] * 4000}), ("wan", None), ("bagel", None))}
    config = ServerConfig(models=[ModelToServe(n) for n in models])
    text = banner(config, "127.0.0.1", 8000, models,
                  {"whisper": ["transcriptions"], "wan": ["videos"], "bagel": ["images"]})
    assert "audio.transcriptions.create(model='whisper'" in text and "-F file=@speech.wav" in text
    assert "videos.create_and_poll(model='wan'" in text and "images.generate(model='bagel'" in text
    assert "0.0, 0.0" not in text and "-d @request.json" in text and len(text) < 4000
