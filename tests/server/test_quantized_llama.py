"""A llama served with `quantize: int8` (deploy file, per node) answers with the quantized model's own greedy text."""

from __future__ import annotations

import httpx
import pytest
import torch

from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from tests.server.helpers import Server

pytest.importorskip("mstar_llm")
pytest.importorskip("mstar_kvcache")

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def quantized_server(tmp_path_factory):
    deploy = tmp_path_factory.mktemp("deploy") / "deploy.yaml"
    deploy.write_text("models:\n  llama:\n    preset: tiny\n    engines: {lm: {quantize: int8, num_pages: 64}}\n")
    srv = Server(["llama"], "--config", str(deploy))
    yield srv
    srv.stop()


def _dense_greedy(lm, ids: list[int], steps: int, no_token: tuple[int, ...] = ()) -> list[int]:
    """Greedy by full recompute; ids no token stands for (the padded vocabulary) are never picked, as in the engine."""
    from mstar_core.nn import DenseAttention

    out, ids = [], list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            logits = lm.compute_logits(lm(torch.tensor(ids), torch.arange(len(ids)), DenseAttention())[-1:])
            logits[:, list(no_token)] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out


def test_served_int8_llama_answers_with_the_quantized_models_greedy_text(quantized_server):
    from mstar_core.nn.quant import Int8Linear, quantize_linears
    from mstar_llm import load_llm

    resp = httpx.post(f"{quantized_server.url}/v1/completions", headers=quantized_server.headers, timeout=120,
                      json={"model": "llama", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                            "logit_bias": {"2": -100}})  # <|im_end|> held off: the preset's replies end by themselves
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["text"]
    # the same quantization here (same weights, same per-channel scales and kernel) decoded densely, token by token
    loaded = load_llm(LoadOptions(preset="tiny"), progress=False)
    lm = loaded.graph.nodes["lm"].module()
    assert quantize_linears(lm, "int8") > 0 and any(isinstance(m, Int8Linear) for m in lm.modules())
    ids = loaded.prepare_inputs({"prompt": PROMPT})["input_ids"]
    never = (*loaded.extras["grammar_vocab"].no_token_ids, 2)
    assert text == loaded.extras["tokenizer"].decode(_dense_greedy(lm, ids, 10, never))
    metrics = httpx.get(f"{quantized_server.url}/metrics", headers=quantized_server.headers, timeout=30).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("mstar_node_stat{") and 'stat="quantized_linears"' in ln)
    assert float(line.rsplit(" ", 1)[1]) == 4 * loaded.extras["config"].num_hidden_layers + 1  # every linear + the head


async def test_a_bad_quantize_value_stops_the_load_naming_the_key_and_the_choices(preset_cache):
    from mstar_core.runtime import AsyncEngine

    async with AsyncEngine() as engine:
        with pytest.raises(ConfigError, match=r"setting 'quantize' must be one of \['int8', 'int8_dynamic', 'int8_token', 'fp8'\]"):
            await engine.load_model("llama", LoadOptions(preset="tiny"), settings={"lm": {"quantize": "int4"}})
