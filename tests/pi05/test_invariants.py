"""Exact invariants of the served policy: the expert reading the cached prefix read-only equals one joint forward
of prefix and suffix under the full attention mask (openpi's formulation), at every Euler step; and the prefix
pages (every label of every node) are freed when a request ends, fails mid-loop or is cancelled mid-loop."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from mstar_pi05.model import SPECS
from mstar_pi05.modeling import PrefixWriter

from mstar_core.errors import NodeExecutionError
from mstar_core.model import LoadOptions
from mstar_core.nn.attention import DenseAttention
from mstar_core.nn.rotary import apply_rotary
from mstar_core.runtime import AsyncEngine

SPEC = {s.name: s for s in SPECS}
KV_NODES = ("vlm", "expert")


def _request(i: int, **kw) -> dict:
    g = torch.Generator().manual_seed(300 + i)
    images = [torch.randint(0, 256, (24, 28 + i, 3), dtype=torch.uint8, generator=g) for _ in range(1 + i % 2)]
    return {"images": images, "prompt": f"stack block {i}", "state": torch.rand(4 + i, generator=g) * 2 - 1,
            "horizon": 5 - i % 2, "num_steps": 3 + i, "seed": 11 + i, "action_dim": 7, **kw}


def _project(attn, x, cos, sin):
    t = x.shape[0]
    q, k, v = attn.qkv_proj(x).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    q = apply_rotary(q.view(t, attn.num_heads, attn.head_dim), cos, sin)
    k = apply_rotary(k.view(t, attn.num_kv_heads, attn.head_dim), cos, sin)
    return q, k, v.view(t, attn.num_kv_heads, attn.head_dim)


@torch.inference_mode()
def joint_velocity(policy, prefix: torch.Tensor, actions: torch.Tensor, t: float,
                   state: torch.Tensor | None) -> torch.Tensor:
    """openpi's one forward over [prefix | (pi0: state) | actions], both towers layer by layer, no cache at all.

    Mask (True = may attend): the prefix sees the prefix; pi0's state token the prefix and itself; the action
    rows see everything. Positions run 0..total-1 over the whole sequence.
    """
    lm, ex = policy.language_model, policy.expert
    n, h = prefix.shape[0], actions.shape[0]
    xs, cond = policy.expert_inputs(actions, torch.full((h,), t))
    if state is not None:  # pi0: the state token opens the suffix, on the expert's weights, not time-conditioned
        xs = torch.cat([policy.state_proj(state.reshape(1, -1)), xs])
    total = n + xs.shape[0]
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:n, :n] = True
    mask[n:, :] = True
    if state is not None:
        mask[n, n + 1 :] = False
    cos, sin = lm.rotary_emb(torch.arange(total))
    dense = DenseAttention(mask=mask)
    xa = prefix
    for la, lb in zip(lm.layers, ex.layers, strict=True):
        ha, ga = la.attention_input(xa)
        hb, gb = lb.attention_input(xs, cond)
        qa, ka, va = _project(la.self_attn, ha, cos[:n], sin[:n])
        qb, kb, vb = _project(lb.self_attn, hb, cos[n:], sin[n:])
        out = dense.attend(la.self_attn.layer_idx, torch.cat([qa, qb]), torch.cat([ka, kb]), torch.cat([va, vb]),
                           la.self_attn.scale).reshape(total, -1)
        xa = la.finish(xa, la.self_attn.o_proj(out[:n]), ga)
        xs = lb.finish(xs, lb.self_attn.o_proj(out[n:]), gb, cond)
    hidden = ex.norm(xs) if cond is None else ex.norm(xs, cond)[0]
    return policy.action_out_proj(hidden[-h:])


def _joint_actions(loaded, inputs) -> torch.Tensor:
    policy, env = loaded.extras["policy"], loaded.prepare_inputs(inputs)
    n_image = env["image_at"].numel()
    with torch.inference_mode():
        images = policy.encode_images(env["pixels"]).reshape(n_image, -1)
        prefix = torch.cat([images, policy.language_model.embed(env["prefix_ids"][n_image:])])
    x = torch.randn(env["latent_shape"], generator=torch.Generator().manual_seed(env["seed"]))
    steps = env["num_steps"]
    dt = -1.0 / steps
    for step in range(steps):
        x = x + dt * joint_velocity(policy, prefix, x, 1.0 + step * dt, env.get("state_row"))
    return loaded.prepare.unnormalize_actions(x)[:, : env["action_dim"]]


async def _idle(engines, tries=300):
    for _ in range(tries):
        if not any(e.active_requests() for e in engines.values()):
            return
        await asyncio.sleep(0.01)


def _assert_all_freed(engines):
    vlm, expert = engines["vlm"], engines["expert"]
    assert vlm.pool is expert.pool  # the expert reads the VLM's pages in place: one pool
    for name, eng in engines.items():
        assert not eng.active_requests(), name
    for name in KV_NODES:
        eng = engines[name]
        assert not eng.seqs and not eng.readers and not eng.waiting_readers, name
        assert eng.pool.num_used == 0, (name, eng.pool.num_used)


def _serve(kind, requests, poison=None, during=None):
    """Serve `requests` at once; `poison(forward)` may wrap the expert's forward. -> (loaded, engines, envs, seen)."""

    async def go():
        async with AsyncEngine() as engine:
            loaded = await engine.load_model(kind, LoadOptions(preset="tiny"))
            engines = engine.node_engines(kind)
            if poison is not None:
                engines["expert"].forward_fn = poison(engines["expert"].forward_fn)
            handles = [engine.submit(kind, r) for r in requests]
            seen = await during(engines, handles) if during else None
            envs = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
            await _idle(engines)
            return loaded, engines, envs, seen

    return asyncio.run(go())


@pytest.mark.parametrize("kind", ["pi05", "pi0"])
def test_cached_prefix_read_only_equals_one_joint_forward(kind, monkeypatch):
    routed = []  # each vlm forward's routing ids: pi0's state token rides in its prefix's forward, not its own
    forward = PrefixWriter.forward

    def spy(self, input_ids, positions, context, /, **kwargs):
        routed.append(kwargs.get("routing"))
        return forward(self, input_ids, positions, context, **kwargs)

    monkeypatch.setattr(PrefixWriter, "forward", spy)
    requests = [_request(i) for i in range(2)]
    loaded, engines, envs, _ = _serve(kind, requests)
    for r, env in zip(requests, envs, strict=True):
        want = _joint_actions(loaded, r)
        assert env["actions"].shape == want.shape == (r["horizon"], 7)
        assert (env["actions"] - want).abs().max() <= 1e-5, (env["actions"] - want).abs().max()
    if kind == "pi0":
        assert sum(int((r == 1).sum()) for r in routed) == len(requests)
        assert all(int((r == 0).sum()) > 0 for r in routed)
    else:
        assert routed and all(r is None for r in routed)
    _assert_all_freed(engines)


def test_a_request_failing_mid_loop_frees_its_prefix_pages_and_its_batch_mate_finishes():
    # the poisoned request takes 4 steps (t = 1, .75, .5, .25): its second expert step raises; the other takes 3
    bad_t = 0.75

    def poison(forward):
        def run(*args, **kwargs):
            t = kwargs.get("timestep")
            if t is not None and bool(((t.reshape(-1) - bad_t).abs() < 1e-6).any()):
                raise ValueError("poisoned expert step")
            return forward(*args, **kwargs)
        return run

    good, bad = _request(0, num_steps=3), _request(1, num_steps=4)
    loaded, engines, (env, err), _ = _serve("pi05", [good, bad], poison=poison)
    assert isinstance(err, NodeExecutionError) and "node 'expert'" in str(err) and "poisoned" in str(err)
    assert (env["actions"] - _joint_actions(loaded, good)).abs().max() <= 1e-5
    _assert_all_freed(engines)


def test_a_request_cancelled_mid_loop_frees_its_prefix_pages():
    def slow(forward):
        def run(*args, **kwargs):
            time.sleep(0.01)  # room to cancel while the loop runs
            return forward(*args, **kwargs)
        return run

    async def cancel(engines, handles):
        expert, held = engines["expert"], 0
        for _ in range(2000):  # until the loop is under way: prefix pages held, the expert reading them
            if expert.num_steps >= 2 and expert.readers:
                held = expert.pool.num_used
                break
            await asyncio.sleep(0.002)
        handles[0].cancel()
        return held, expert.num_steps

    _, engines, (err,), (held, steps) = _serve("pi05", [_request(0, num_steps=100)], poison=slow, during=cancel)
    assert held > 0 and 2 <= steps < 100
    assert isinstance(err, BaseException)
    _assert_all_freed(engines)
