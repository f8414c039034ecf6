"""Replayed decode steps (`mstar_kvcache.replay`): recorded once per layout, then the same logits as eager steps."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from mstar_core.errors import ConfigError
from mstar_core.nn import tape
from mstar_core.runtime.engine import Invocation
from tests.engines.driver import generate, make_engine
from tests.engines.test_decode_lanes import _engine, _scenario

pytestmark = pytest.mark.skipif(not tape.available(), reason="no C++ compiler here: tapes do not replay")


def _replays(model) -> bool:
    """Whether this CPU runs the model's linears on M*'s own kernels (oneDNN is a torch op: no replay)."""
    return getattr(model.model.layers[0].mlp.gate_up_proj, "runs_own_kernel", False)


def test_replayed_steps_give_the_eager_logits_bit_for_bit(llama_pair):
    """Forks, a rolled-back peek, releases and refills: every replayed step's logits equal the eager step's."""
    _, ours = llama_pair
    replaying = _engine(ours, True)
    got = _scenario(replaying)
    eager = _engine(ours, True, replay_steps=False)
    assert eager.replay is None
    ref = _scenario(eager)
    assert len(got) == len(ref) > 100
    assert torch.equal(torch.stack(got), torch.stack(ref))
    if not _replays(ours):
        pytest.skip("no own linear kernel on this CPU: every step ran eagerly")
    stats = replaying.stats()
    assert stats["replayed_steps"] >= 20 and 0 < stats["recorded_steps"] <= stats["replayed_steps"]
    assert replaying.pool.num_used == 0


def test_bf16_steps_replay_the_same_tokens(llama_pair):
    _, ours = llama_pair
    model = copy.deepcopy(ours).to(torch.bfloat16)
    prompts = {"a": [1, 2, 3, 4], "b": [9, 8, 7], "c": list(range(20, 41))}
    replaying = make_engine(model, num_pages=256, page_size=4)  # (room for the lanes to grow past 32 tokens)
    got = generate(replaying, prompts, 20)
    assert got == generate(make_engine(model, num_pages=256, page_size=4, replay_steps=False), prompts, 20)
    if _replays(model):
        assert replaying.replay.replayed >= 17
        # the lanes grew past 32 tokens: recordings over the old storage were dropped, not kept pinning it
        assert replaying.backend.lanes.capacity > 32
        assert {k[0] for k in replaying.replay.programs} == {(replaying.backend.lanes.kv.data_ptr(),
                                                             tuple(replaying.backend.lanes.kv.shape),
                                                             replaying.pool.kv.data_ptr())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_steps_run_the_lm_head_in_the_tape(llama_pair, dtype):
    """A sampling node's recordings take the LM head after the layers (no Python between the last layer and the
    head): every step's logits equal the eager step's head, bit for bit, forks, peeks and refills included."""
    _, ours = llama_pair
    model = copy.deepcopy(ours).to(dtype)
    replaying = _engine(model, True)
    got = _scenario(replaying)
    ref = _scenario(_engine(model, True, replay_steps=False))
    assert len(got) == len(ref) > 100
    assert torch.equal(torch.stack(got), torch.stack(ref))
    if not _replays(model):
        pytest.skip("no own linear kernel on this CPU: every step ran eagerly")
    programs = list(replaying.replay.programs.values())
    assert programs and all(p.head is not None for p in programs)
    assert replaying.replay.replayed >= 20


def test_a_head_with_a_torch_op_runs_after_the_replayed_layers(llama_pair, caplog):
    _, ours = llama_pair
    model = copy.deepcopy(ours)
    plain = model.compute_logits
    model.compute_logits = lambda hidden: plain(hidden) * 1.0  # a multiply no kernel does
    prompts = {"a": [1, 2, 3], "b": [4, 5]}
    engine = make_engine(model, num_pages=64, page_size=4)
    with caplog.at_level(logging.INFO, logger="mstar.kvcache.replay"):
        got = generate(engine, prompts, 10)
    assert got == generate(make_engine(model, num_pages=64, page_size=4, replay_steps=False), prompts, 10)
    if _replays(model):
        assert engine.replay.replayed >= 6  # the layers still replay
        assert all(p.head is None for p in engine.replay.programs.values())
        assert "runs after the replayed layers" in caplog.text and "aten.mul" in caplog.text


def test_changed_weights_are_not_replayed(llama_pair):
    """After `load_state_dict` a replay would run the packed copies of the old weights: the step runs anew."""
    _, ours = llama_pair
    model = copy.deepcopy(ours)
    engine = make_engine(model, num_pages=64, page_size=4)
    generate(engine, {"a": [1, 2, 3]}, 12)
    state = {k: v * 1.5 if v.dim() == 2 else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    changed = copy.deepcopy(ours)
    changed.load_state_dict(state)
    fresh = make_engine(changed, num_pages=64, page_size=4)

    def logits(engine) -> torch.Tensor:
        out = []
        engine.add(Invocation("b", "lm", {"input_ids": [5, 6, 7]}, {}))
        while engine.has_work():
            for _, res in engine.step():
                out.append(res["logits"])
                if len(out) < 10:
                    engine.add(Invocation("b", "lm", {"input_ids": res["next_token"]}, {}))
        return torch.stack(out)

    torch.testing.assert_close(logits(engine), logits(fresh), atol=1e-5, rtol=1e-5)


def test_layers_with_a_torch_op_run_eagerly(llama_pair, caplog):
    _, ours = llama_pair
    model = copy.deepcopy(ours)
    mlp = model.model.layers[1].mlp
    plain = mlp.forward
    mlp.forward = lambda h: plain(h) * 1.0  # a multiply the kernels do not do
    engine = make_engine(model, num_pages=64, page_size=4)
    with caplog.at_level(logging.INFO, logger="mstar.kvcache.replay"):
        got = generate(engine, {"a": [1, 2, 3], "b": [4, 5]}, 10)
    assert got == generate(make_engine(model, num_pages=64, page_size=4, replay_steps=False), {"a": [1, 2, 3], "b": [4, 5]}, 10)
    if _replays(model):
        assert engine.replay.replayed == 0 and engine.replay.refused == {2}
        assert "aten.mul" in caplog.text
        for rows in (5, 4, 3):  # a fourth row count refused, none recorded: it stops recording
            generate(engine, {f"r{i}": [i + 1] for i in range(rows)}, 3)
        assert not engine.replay.enabled and engine.replay.replayed == 0 and engine.replay.refused == {2, 3, 4, 5}


def test_a_row_count_a_kernel_refuses_runs_eagerly_alone(llama_pair):
    """Kernels that take only so many rows (AMX tiles: 32) refuse those steps' recordings, not every step's."""
    _, ours = llama_pair
    model = copy.deepcopy(ours)
    mlp = model.model.layers[0].mlp
    plain = mlp.forward
    mlp.forward = lambda h: plain(h) if h.shape[0] != 3 else plain(h) * 1.0  # three rows: a torch op
    engine = make_engine(model, num_pages=256, page_size=4)
    if not _replays(model):
        pytest.skip("no own linear kernel on this CPU: every step runs eagerly")
    prompts = {"a": [1, 2], "b": [3, 4, 5], "c": [6]}
    got = generate(engine, prompts, 12)
    assert got == generate(make_engine(model, num_pages=256, page_size=4, replay_steps=False), prompts, 12)
    assert engine.replay.refused == {3} and engine.replay.enabled
    generate(engine, {"d": [7], "e": [8]}, 12)
    assert engine.replay.replayed >= 10


def test_a_subclass_overriding_forward_alone_is_not_replayed(llama_pair):
    _, ours = llama_pair

    class Shifted(type(ours)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) + 1.0

    model = copy.deepcopy(ours)
    model.__class__ = Shifted
    assert make_engine(model, num_pages=64).replay is None
    hooked = copy.deepcopy(ours)
    hooked.register_forward_hook(lambda module, args, out: out)
    assert make_engine(hooked, num_pages=64).replay is None
    assert make_engine(copy.deepcopy(ours), num_pages=64).replay is not None


def test_replay_steps_must_be_a_bool(llama_pair):
    _, ours = llama_pair
    with pytest.raises(ConfigError, match="replay_steps"):
        make_engine(ours, replay_steps="yes")


def test_qwen3_qk_norm_layers_replay_too(tmp_path):
    """Per-head q/k norms over the fused qkv's view run as one kernel (no copy), so Qwen3-style layers replay."""
    from mstar_core.checkpoint import save_hf_checkpoint
    from mstar_core.nn.llama import load_llama
    from tests.nn.test_llama_fidelity import make_hf

    hf = make_hf("qwen3")
    save_hf_checkpoint(hf, tmp_path, hf.config.to_dict())
    model = load_llama(tmp_path, progress=False).eval()
    prompts = {"a": [1, 2, 3, 4], "b": list(range(30, 50))}
    replaying = make_engine(model, num_pages=128, page_size=4)
    got = generate(replaying, prompts, 16)
    assert got == generate(make_engine(model, num_pages=128, page_size=4, replay_steps=False), prompts, 16)
    if _replays(model):
        assert replaying.replay.enabled and replaying.replay.replayed >= 12


def _hidden_node():
    from mstar_core.graph import GraphNode

    return GraphNode("lm", inputs=("input_ids",), outputs=("next_token", "finish_reason", "hidden"), engine="kvcache",
                     optional_inputs=("sampling",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_replayed_steps_pick_their_tokens_with_the_head(llama_pair, dtype, monkeypatch):
    """A step whose rows are all greedy replays the argmax after the head (no sampler call): the same tokens as eager
    steps; a step with a sampled row leaves the tokens to the sampler, and its seeded draws are unchanged."""
    from mstar_kvcache import sampler

    from mstar_core.sampling import SamplingParams

    _, ours = llama_pair
    model = copy.deepcopy(ours).to(dtype)
    prompts = {"a": [1, 2, 3, 4], "b": [9, 8, 7], "c": list(range(20, 31))}
    picked = [0]
    plain = sampler.greedy_tokens

    def counted(logits):
        picked[0] += 1
        return plain(logits)

    monkeypatch.setattr(sampler, "greedy_tokens", counted)
    eager = generate(make_engine(model, num_pages=256, page_size=4, replay_steps=False), prompts, 16)
    eager_picks, picked[0] = picked[0], 0
    replaying = make_engine(model, num_pages=256, page_size=4)
    assert generate(replaying, prompts, 16) == eager
    if not _replays(model):
        pytest.skip("no own linear kernel on this CPU: every step ran eagerly")
    assert any(p.tokens for p in replaying.replay.programs.values())
    # every replayed step took the head's tokens: the sampler picked only the recorded and eager steps' tokens
    assert replaying.replay.replayed >= 10 and picked[0] == eager_picks - replaying.replay.replayed
    # a sampled row in the batch: the sampler draws every row, as without a replay
    params = {"a": {"sampling": SamplingParams(temperature=0.9, seed=3, max_tokens=64)}}
    drawn = generate(make_engine(model, num_pages=256, page_size=4), prompts, 16, inputs=params)
    assert drawn == generate(make_engine(model, num_pages=256, page_size=4, replay_steps=False), prompts, 16,
                             inputs=params)


def test_returned_hidden_rows_are_not_overwritten_by_later_replays(llama_pair):
    """A replayed step hands out its own buffer only where nothing reads it after the step: returned hidden rows are
    copies, each equal to the eager step's."""
    from mstar_kvcache import KVCacheEngine

    from mstar_core.runtime.engine import EngineContext

    _, ours = llama_pair

    def run(replay: bool) -> list[torch.Tensor]:
        engine = KVCacheEngine(_hidden_node(), ours, EngineContext("test", torch.device("cpu"),
                                                                   {"num_pages": 96, "page_size": 4,
                                                                    "replay_steps": replay}))
        rows = []
        engine.add(Invocation("r", "lm", {"input_ids": [5, 6, 7]}, {}))
        while engine.has_work():
            for _, out in engine.step():
                rows.append(out["hidden"])
                if len(rows) < 12:
                    engine.add(Invocation("r", "lm", {"input_ids": out["next_token"]}, {}))
        return rows

    got, ref = run(True), run(False)
    assert len(got) == len(ref) == 12
    assert torch.equal(torch.stack(got), torch.stack(ref))
    assert len({t.data_ptr() for t in got}) == len(got)


def test_a_replaying_engine_pays_the_recordings_one_off_imports_while_it_is_built():
    """The first recording's dispatch mode imports torch._dynamo (seconds on a 2-core box): building a replay does it
    up front, so the first request's step does not (a fresh interpreter: this one may have imported it already)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from mstar_kvcache.replay import StepReplay\n"
            "from mstar_core.nn.llama import LlamaForCausalLM\n"
            "m = LlamaForCausalLM({'vocab_size': 64, 'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 1,"
            " 'num_attention_heads': 2, 'num_key_value_heads': 1, 'max_position_embeddings': 64})\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "assert StepReplay.for_module(m, 'lm', torch.device('cpu')) is not None\n"
            "assert 'torch._dynamo' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
