"""The example captioner as it was at the previous release (commit 705e323), run against the current tree.

`captioner_705e323/` is a frozen copy of examples/mstar-example-captioner at that commit: never edit it
(a plugin already published does not change when the core does). It is not pip-installed: its plugin
module is registered with the plugin manager here, in process, and passed with `--plugin` to a served
`mstar serve`, with the installed (current) captioner kept out, so every module it imports is its own.
Its greedy captions must equal a dense reference computed from its own modules (no cache).
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import sys
import warnings
from pathlib import Path

import httpx
import pytest
import torch

from tests.server.helpers import TOY_DIR, Server

FROZEN = Path(__file__).parent / "captioner_705e323" / "src"
PACKAGE = "mstar_example_captioner"
MODEL = "example-captioner"
#: the current tree's plugins the captioner needs, by entry-point name; the installed captioner stays out
CORE_PLUGINS = "core,kvcache,stateless,attn_torch"


def _image(seed: int, h: int, w: int) -> torch.Tensor:
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


REQUESTS = [
    {"image": _image(0, 40, 56), "prompt": "A photo of", "max_tokens": 9, "ignore_eos": True},
    {"image": _image(1, 64, 30), "max_tokens": 7},
]


@pytest.fixture(scope="module")
def frozen():
    """The frozen package imported in place of the installed one, for this module's tests only."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == PACKAGE or k.startswith(PACKAGE + ".")}
    sys.path.insert(0, str(FROZEN))
    try:
        plugin = importlib.import_module(f"{PACKAGE}.plugin")
        assert Path(plugin.__file__).is_relative_to(FROZEN), plugin.__file__
        yield plugin
    finally:
        sys.path.remove(str(FROZEN))
        for k in [k for k in sys.modules if k == PACKAGE or k.startswith(PACKAGE + ".")]:
            del sys.modules[k]
        sys.modules.update(saved)


@torch.no_grad()
def _dense_caption(loaded, request: dict) -> list[int]:
    """Greedy tokens with no KV cache, from the frozen package's own modules."""
    from mstar_example_captioner.modeling import ImageSplicer

    from mstar_core.nn import DenseAttention

    model = loaded.extras["model"]
    env = loaded.prepare_inputs(request)
    lm, stops, limit = model.language_model, env["sampling"].stop_token_ids, env["sampling"].max_tokens
    views = [model.vision_tower(env[v][None])[0] for v in ("global_view", "detail_view")]
    prompt = ImageSplicer(lm, model.config.image_token_id)(env["prompt_ids"], *views)
    tokens: list[int] = []
    while len(tokens) < limit and (not tokens or tokens[-1] not in stops):
        embeds = torch.cat([prompt, lm.embed(torch.tensor(tokens, dtype=torch.long))])
        hidden = lm(None, torch.arange(embeds.shape[0]), DenseAttention(), input_embeds=embeds)
        tokens.append(int(lm.compute_logits(hidden[-1:]).argmax()))
    return tokens


@pytest.fixture(scope="module")
def reference(frozen):
    from mstar_example_captioner.model import SPEC

    from mstar_core.model import LoadOptions

    loaded = SPEC.load(LoadOptions(preset="tiny"))
    return loaded, [_dense_caption(loaded, r) for r in REQUESTS]


async def test_the_previous_releases_captioner_loads_and_captions_as_its_dense_reference(frozen, reference, monkeypatch):
    from mstar_core.model import LoadOptions
    from mstar_core.plugins import discover
    from mstar_core.runtime import AsyncEngine

    monkeypatch.setenv("MSTAR_PLUGINS", CORE_PLUGINS)
    registry = discover(extra_modules=[frozen])
    assert registry.models.origin[MODEL] == f"{PACKAGE}.plugin"
    loaded_ref, want = reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plugin of the previous minor version may warn, but this one needs not
        async with AsyncEngine(registry) as engine:
            loaded = await engine.load_model(MODEL, LoadOptions(preset="tiny"))
            assert Path(sys.modules[type(loaded.extras["model"]).__module__].__file__).is_relative_to(FROZEN)

            async def run(request):
                handle = engine.submit(MODEL, request, timeout=60)
                return [o.value for o in [o async for o in handle] if o.name == "next_token"]

            got = await asyncio.gather(*(run(r) for r in REQUESTS))
    assert got == want
    assert len(want[0]) == 9 and want[0][:4] != want[1][:4]  # the captions depend on the image


def _tensor_json(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.contiguous().numpy().tobytes()).decode()}


def test_the_previous_releases_captioner_serves_over_http(reference):
    # a fresh `mstar serve` whose import path puts the frozen package first: it is what `--plugin` registers
    srv = Server([MODEL], api_key=None, plugins=(f"{PACKAGE}.plugin",), wait=False, MSTAR_PLUGINS=CORE_PLUGINS,
                 PYTHONPATH=f"{FROZEN}:{TOY_DIR}", OMP_NUM_THREADS="1")
    try:
        srv.wait_ready(120)
        _, want = reference
        request = REQUESTS[0]
        body = {"inputs": {**request, "image": _tensor_json(request["image"])}}
        with httpx.stream("POST", f"{srv.url}/v1/walks/{MODEL}", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line) for line in r.iter_lines() if line]
        assert [e["value"] for e in events if e.get("name") == "next_token"] == want[0]
        assert events[-1]["outputs"]["next_token"] == want[0][-1]
        bad = httpx.post(f"{srv.url}/v1/walks/{MODEL}", json={"inputs": {"prompt": "no image"}}, timeout=60)
        assert bad.status_code == 400 and "missing field 'image'" in bad.json()["error"]["message"]
    finally:
        code = srv.stop()
    assert code == 0, srv.output()[-3000:]
    assert "Traceback" not in srv.output(), srv.output()[-3000:]
