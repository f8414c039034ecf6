"""Engine module contracts are checked when the engine is built (model load), not on the first request.

Each case names the node, the engine and the method, and says what call the engine makes.
"""

from __future__ import annotations

import functools

import pytest
import torch
from mstar_kvcache import KVCacheEngine
from mstar_stateless import StatelessEngine

from mstar_core.errors import ModelLoadError, ModuleContractError
from mstar_core.graph import Graph, GraphNode, Walk
from mstar_core.model import LoadedModel
from mstar_core.nn.llama import LlamaForCausalLM
from mstar_core.runtime.async_engine import AsyncEngine
from mstar_core.runtime.engine import EngineContext
from mstar_core.runtime.function_engine import FunctionEngine
from tests.engines.helpers import TINY

CTX = EngineContext("t", torch.device("cpu"), {"num_pages": 8})
LM = GraphNode("lm", inputs="input_ids", outputs=("next_token", "finish_reason"), engine="kvcache",
               optional_inputs="sampling")
LM_EMBEDS = GraphNode("lm", inputs="input_ids", outputs=("next_token", "finish_reason"), engine="kvcache",
                      optional_inputs=("sampling", "input_embeds"))


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(dict(TINY)).eval()


class Decoder(torch.nn.Module):
    """A kvcache module built from parts, so each test can leave one out or bend one signature."""

    def __init__(self, inner, **replace):
        super().__init__()
        self.inner, self.config = inner, inner.config
        for name, fn in replace.items():
            if fn is None:
                object.__setattr__(self, f"_no_{name}", True)
            else:
                object.__setattr__(self, name, fn)

    def __getattr__(self, name):
        if name in ("embed", "compute_logits") and not self.__dict__.get(f"_no_{name}", False):
            return getattr(self.inner, name)
        return super().__getattr__(name)

    def forward(self, input_ids, positions, context, input_embeds=None):
        return self.inner(input_ids, positions, context, input_embeds=input_embeds)


def kv_error(node, module) -> str:
    with pytest.raises(ModuleContractError) as err:
        KVCacheEngine(node, module, CTX)
    assert isinstance(err.value, ModelLoadError) and err.value.node == "lm" and err.value.engine == "kvcache"
    message = str(err.value)
    assert "node 'lm'" in message and "engine 'kvcache'" in message
    return message


# -- kvcache ----------------------------------------------------------------------------------------


def test_the_real_decoder_meets_the_contract(llama):
    KVCacheEngine(LM_EMBEDS, llama, CTX)
    KVCacheEngine(LM, Decoder(llama), CTX)


def test_missing_compute_logits_is_a_load_error(llama):
    message = kv_error(LM, Decoder(llama, compute_logits=None))
    assert "compute_logits" in message and "compute_logits(hidden)" in message


def test_missing_embed_is_a_load_error_when_the_node_takes_embeddings(llama):
    message = kv_error(LM_EMBEDS, Decoder(llama, embed=None))
    assert "'embed'" in message and "embed(ids)" in message and "input_embeds" in message
    KVCacheEngine(LM, Decoder(llama, embed=None), CTX)  # never called without embeddings: not needed


def test_forward_without_input_embeds_is_a_load_error_when_the_node_takes_embeddings(llama):
    class NoEmbeds(Decoder):
        def forward(self, input_ids, positions, context):
            return self.inner(input_ids, positions, context)

    message = kv_error(LM_EMBEDS, NoEmbeds(llama))
    assert "forward" in message and "'input_embeds'" in message
    assert "forward(input_ids, positions, context, input_embeds=None)" in message  # the call it must take
    KVCacheEngine(LM, NoEmbeds(llama), CTX)


@pytest.mark.parametrize(
    ("forward", "problem"),
    [
        (lambda self, input_ids, positions: None, "takes 2 positional argument(s), the engine passes 3"),
        (lambda self, input_ids, positions, context, mask: None, "requires parameter 'mask'"),
        (lambda self, input_ids, positions, context, input_embeds: None, "'input_embeds' needs a default"),
        (lambda self, input_ids, positions, context, *, embeds=None: None, "no parameter 'input_embeds'"),
    ],
)
def test_incompatible_forward_signatures_say_what_is_wrong(llama, forward, problem):
    bent = type("Bent", (Decoder,), {"forward": forward})
    message = kv_error(LM_EMBEDS, bent(llama))
    assert problem in message, message


def test_compute_logits_that_takes_two_arguments_is_a_load_error(llama):
    message = kv_error(LM, Decoder(llama, compute_logits=lambda hidden, scale: hidden))
    assert "requires parameter 'scale'" in message and "compute_logits(hidden)" in message


def test_config_without_the_kv_shape_fields_is_a_load_error(llama):
    class Shapeless(Decoder):
        def __init__(self, inner):
            super().__init__(inner)
            self.config = {"hidden_size": 64}

    message = kv_error(LM, Shapeless(llama))
    assert "num_hidden_layers" in message and "vocab_size" in message and "kv_cache_spec" in message

    class Configless(Decoder):
        def __init__(self, inner):
            super().__init__(inner)
            self.config = None

    assert "no `config`" in kv_error(LM, Configless(llama))


def test_kv_cache_spec_stands_in_for_config_and_is_checked(llama):
    class Spec(Decoder):
        def __init__(self, inner):
            super().__init__(inner)
            self.config = None

        def kv_cache_spec(self):
            return (2, 2, 16, 256, 64)

    KVCacheEngine(LM, Spec(llama), CTX)

    class BadSpec(Spec):
        def kv_cache_spec(self):
            return (2, 2, 16)

    assert "kv_cache_spec() returned (2, 2, 16)" in kv_error(LM, BadSpec(llama))


def test_meta_device_hooked_and_wrapped_modules_pass():
    with torch.device("meta"):
        meta = LlamaForCausalLM(dict(TINY))
    KVCacheEngine(LM_EMBEDS, meta, CTX)  # checks the built object; no weights needed

    torch.manual_seed(0)
    hooked = LlamaForCausalLM(dict(TINY))
    hooked.register_forward_hook(lambda *args: None)
    KVCacheEngine(LM_EMBEDS, hooked, CTX)

    class Wrapped(torch.nn.Module):  # a wrapper whose forward is a decorated *args/**kwargs pass-through
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config
            self.embed, self.compute_logits = inner.embed, inner.compute_logits  # set on the object, not the class

        @functools.wraps(LlamaForCausalLM.forward)
        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    KVCacheEngine(LM_EMBEDS, Wrapped(hooked), CTX)


async def test_a_broken_module_fails_add_model_before_any_request(llama):
    node = GraphNode("lm", inputs="input_ids", outputs=("next_token", "finish_reason"), engine="kvcache",
                     optional_inputs="sampling", module=lambda: Decoder(llama, compute_logits=None))
    graph = Graph.build("m", [node], [Walk(name="gen", body="lm", inputs="input_ids", optional_inputs="sampling",
                                                   outputs="next_token")])
    engine = AsyncEngine()
    with pytest.raises(ModuleContractError, match=r"node 'lm' \(engine 'kvcache'\).*compute_logits"):
        await engine.add_model(LoadedModel("m", graph), settings={"lm": {"num_pages": 8}})
    assert "m" not in engine.models


# -- stateless and function -------------------------------------------------------------------------

ENCODE = GraphNode("enc", inputs="pixels", outputs="embeds", engine="stateless", optional_inputs="mask")


class Encoder(torch.nn.Module):
    def forward(self, pixels, mask=None):
        return pixels


@pytest.mark.parametrize("engine_cls", [StatelessEngine, FunctionEngine])
def test_keyword_modules_must_take_the_node_inputs(engine_cls):
    engine_cls(ENCODE, Encoder(), CTX)
    engine_cls(ENCODE, lambda **inputs: inputs["pixels"], CTX)

    class WrongName(torch.nn.Module):
        def forward(self, x):
            return x

    kind = engine_cls.kind
    with pytest.raises(ModuleContractError) as err:
        engine_cls(ENCODE, WrongName(), CTX)
    message = str(err.value)
    assert f"node 'enc' (engine '{kind}')" in message and "module(pixels, mask=None)" in message
    assert "no parameter 'pixels'" in message and "requires parameter 'x'" in message

    class MaskRequired(torch.nn.Module):
        def forward(self, pixels, mask):
            return pixels

    with pytest.raises(ModuleContractError, match="'mask' needs a default"):
        engine_cls(ENCODE, MaskRequired(), CTX)


@pytest.mark.parametrize("engine_cls", [StatelessEngine, FunctionEngine])
def test_batched_modules_take_one_list(engine_cls):
    class Batched:
        def forward_batch(self, calls):
            return [{"embeds": c["pixels"]} for c in calls]

    engine_cls(ENCODE, Batched(), CTX)

    class TwoArgs:
        def forward_batch(self, calls, device):
            return []

    with pytest.raises(ModuleContractError, match=r"forward_batch.*requires parameter 'device'"):
        engine_cls(ENCODE, TwoArgs(), CTX)


@pytest.mark.parametrize("engine_cls", [StatelessEngine, FunctionEngine])
def test_a_module_that_is_not_callable_is_a_load_error(engine_cls):
    with pytest.raises(ModuleContractError, match=r"node 'enc'.*must be callable.*module\(pixels, mask=None\)"):
        engine_cls(ENCODE, object(), CTX)
    with pytest.raises(TypeError):  # (still a TypeError, as before)
        engine_cls(ENCODE, None, CTX)


def test_inputs_that_are_not_python_names_need_a_kwargs_module():
    node = GraphNode("glue", inputs=("x", "class"), outputs="y", engine="function")
    FunctionEngine(node, lambda **inputs: inputs["x"], CTX)
    with pytest.raises(ModuleContractError, match=r"module\(x, \*\*inputs\).*no \*\*keyword arguments"):
        FunctionEngine(node, lambda x: x, CTX)
