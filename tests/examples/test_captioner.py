"""The worked example package (examples/mstar-example-captioner), used as a third party would use it.

It is installed as its own distribution, found through the `mstar` entry-point group, driven
through `AsyncEngine` and through `mstar serve`'s native endpoint, and its greedy captions equal a
dense reference computed here: the same modules re-run on the whole sequence every step, no cache.
"""

from __future__ import annotations

import asyncio
import base64
import json
from importlib import metadata

import httpx
import pytest
import torch

from mstar_core.errors import RequestError
from mstar_core.model import LoadOptions
from mstar_core.nn import DenseAttention
from mstar_core.runtime import AsyncEngine
from tests.server.helpers import Server

# no importorskip: requirements-dev.txt installs the example (CI included), and a lost install must fail these
# tests (the distribution lookup, the fixtures' imports), not skip them

MODEL = "example-captioner"
EOS = 2


def image(seed: int, h: int = 40, w: int = 56) -> torch.Tensor:
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def dense_caption(loaded, request: dict) -> tuple[list[int], str]:
    """Greedy caption with no KV cache: every step re-runs the decoder over prompt + tokens so far."""
    from mstar_example_captioner.modeling import ImageSplicer

    model = loaded.extras["model"]
    env = loaded.prepare_inputs(request)
    lm, stops, limit = model.language_model, env["sampling"].stop_token_ids, env["sampling"].max_tokens
    views = [model.vision_tower(env[v][None])[0] for v in ("global_view", "detail_view")]
    prompt = ImageSplicer(lm, model.config.image_token_id)(env["prompt_ids"], *views)
    tokens: list[int] = []
    while True:
        embeds = torch.cat([prompt, lm.embed(torch.tensor(tokens, dtype=torch.long))])
        hidden = lm(None, torch.arange(embeds.shape[0]), DenseAttention(), input_embeds=embeds)
        tokens.append(int(lm.compute_logits(hidden[-1:]).argmax()))
        if tokens[-1] in stops:
            return tokens, "stop"
        if len(tokens) == limit:
            return tokens, "length"


REQUESTS = [
    {"image": image(0), "prompt": "A photo of", "max_tokens": 10, "ignore_eos": True},
    {"image": image(1, 64, 30), "max_tokens": 8},
    {"image": image(2).float() / 255, "prompt": "Caption:\n", "max_tokens": 12},
]


@pytest.fixture(scope="module")
def served():
    # only the served test asks for it: under xdist every worker that ran a test using it would boot its own
    # only what the model needs, loaded from installed distributions' entry points (as a deployment would); it
    # boots while this process computes the reference, so one thread: do not fight over the cores
    srv = Server([MODEL], api_key=None, plugins=(), wait=False,
                 MSTAR_PLUGINS="core,kvcache,stateless,attn_torch,example_captioner", OMP_NUM_THREADS="1")
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()[-3000:]
    assert "Traceback" not in srv.output(), srv.output()[-3000:]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """A tiny model gains nothing from intra-op threads, and they spin against the server booting beside it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference():
    from mstar_example_captioner.model import SPEC

    return SPEC.load(LoadOptions(preset="tiny"))


def test_installed_as_its_own_distribution_and_listed(capsys):
    dist = metadata.distribution("mstar-example-captioner")
    [ep] = [ep for ep in dist.entry_points if ep.group == "mstar"]
    assert ep.value == "mstar_example_captioner.plugin"
    from mstar_core.cli import main

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "mstar-example-captioner" in line)
    assert line.split()[:3] == ["example_captioner", "mstar-example-captioner", "0.1.0"] and line.endswith("ok")
    assert f"{MODEL} (example_captioner)" in out


async def test_embedded_greedy_captions_equal_the_dense_reference(reference):
    async with AsyncEngine() as engine:
        await engine.load_model(MODEL, LoadOptions(preset="tiny"))

        async def run(request):
            handle = engine.submit(MODEL, request, timeout=60)
            outs = [out async for out in handle]
            env = await handle.result()
            return outs, env

        results = await asyncio.gather(*(run(r) for r in REQUESTS))  # batched together in every engine
        assert engine.stats()["models"][MODEL]["lm"]["kv_pages_used"] == 0
    captions = []
    for request, (outs, env) in zip(REQUESTS, results, strict=True):
        tokens = [o.value for o in outs if o.name == "next_token"]
        want, reason = dense_caption(reference, request)
        assert tokens == want and env["finish_reason"] == reason
        assert [o.walk for o in outs if o.name == "next_token"] == ["prefill"] + ["decode"] * (len(tokens) - 1)
        text = "".join(o.value for o in outs if o.name == "text")
        assert text == reference.extras["tokenizer"].decode(tokens)
        captions.append(tokens)
    assert len(captions[0]) == 10 and len({tuple(c[:5]) for c in captions}) == 3, "captions should depend on the image"


@pytest.mark.parametrize(
    ("request_fields", "says"),
    [
        ({"prompt": "hi"}, "missing field 'image'"),
        ({"image": image(0), "caption": "x"}, "unknown field(s) ['caption']"),
        ({"image": image(0)[..., :2]}, "'image' has shape [40, 56, 2]"),
        ({"image": image(0).float()}, "outside [0, 1]"),
        ({"image": image(0), "prompt": "caf\u00e9"}, "not printable ASCII"),
        ({"image": image(0), "max_tokens": 0}, "'max_tokens' must be an integer"),
        ({"image": image(0), "max_tokens": 10_000}, "at most"),
    ],
)
def test_prepare_refuses_bad_requests_with_what_to_fix(reference, request_fields, says):
    with pytest.raises(RequestError) as info:
        reference.prepare_inputs(request_fields)
    assert says in str(info.value)


def _tensor_json(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.contiguous().numpy().tobytes()).decode()}


def test_served_native_endpoint_streams_the_reference_caption(served, reference):
    request = REQUESTS[0]
    want, reason = dense_caption(reference, request)  # while the server boots
    served.wait_ready(90)
    body = {"inputs": {**request, "image": _tensor_json(request["image"])}}
    with httpx.stream("POST", f"{served.url}/v1/walks/{MODEL}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line) for line in r.iter_lines() if line]
    assert [e["value"] for e in events if e.get("name") == "next_token"] == want
    assert "".join(e["value"] for e in events if e.get("name") == "text") == reference.extras["tokenizer"].decode(want)
    assert events[-1] == {"event": "done", "outputs": {"next_token": want[-1], "finish_reason": reason}}

    whole = httpx.post(f"{served.url}/v1/walks/{MODEL}", json={**body, "stream": False}, timeout=60)
    assert whole.json() == {"outputs": {"next_token": want[-1], "finish_reason": reason}}

    bad = httpx.post(f"{served.url}/v1/walks/{MODEL}", json={"inputs": {"prompt": "no image"}}, timeout=60)
    assert bad.status_code == 400 and "missing field 'image'" in bad.json()["error"]["message"]
    models = httpx.get(f"{served.url}/v1/models").json()["data"]
    assert [(m["id"], m["walks"], m["random_weights"]) for m in models] == [(MODEL, ["decode", "prefill"], True)]
