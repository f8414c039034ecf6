"""The diffusion engine's rules on their own: CFG combination (scales, interval, renorm modes), the Euler update
in velocity nodes, dual guidance in DiT nodes, module contracts and options checked at load, failures kept
with their request. Engines are driven directly (add/step), as the node scheduler does."""

from __future__ import annotations

import math

import pytest
import torch
from mstar_diffusion import DiffusionEngine, Guidance, combine
from mstar_diffusion.schedules import flow_euler

from mstar_core.errors import ConfigError, ModelLoadError, ModuleContractError, RequestError
from mstar_core.graph import GraphNode
from mstar_core.runtime.engine import EngineContext, Invocation


def _velocities(seed: int = 0, shape=(6, 5)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3)]


def _norm(t: torch.Tensor) -> float:
    return math.sqrt(sum(float(v) ** 2 for v in t.flatten()))


def _row_scales(ref: torch.Tensor, guided: torch.Tensor, floor: float) -> torch.Tensor:
    """Per position (row of the last dim): min(max(|ref| / (|guided| + 1e-8), floor), 1), written out by hand."""
    out = []
    for r, g in zip(ref.reshape(-1, ref.shape[-1]), guided.reshape(-1, guided.shape[-1]), strict=True):
        out.append(min(max(_norm(r) / (_norm(g) + 1e-8), floor), 1.0))
    return torch.tensor(out, dtype=ref.dtype).reshape(*ref.shape[:-1], 1)


# -- combination rules ------------------------------------------------------------------------------


def test_text_guidance_without_renorm_is_the_plain_cfg_formula():
    vc, vu, _ = _velocities()
    got = combine(Guidance(scale=4.0), 0.5, vc, vu)
    torch.testing.assert_close(got, vu + 4.0 * (vc - vu))


@pytest.mark.parametrize("floor", [0.0, 0.7])
def test_global_renorm_scales_the_dual_guided_velocity_by_one_norm_ratio(floor):
    vc, vu, vi = _velocities(1)
    got = combine(Guidance(scale=4.0, image_scale=2.0, renorm="global", renorm_min=floor), 0.5, vc, vu, vi)
    text = vu + 4.0 * (vc - vu)
    guided = vi + 2.0 * (text - vi)
    ratio = min(max(_norm(vc) / (_norm(guided) + 1e-8), floor), 1.0)
    torch.testing.assert_close(got, guided * ratio)
    if floor:
        assert ratio == floor  # the floor is what bounds it here (the guided norm is far larger)


def test_channel_renorm_scales_each_position_by_its_own_ratio_after_both_steps():
    vc, vu, vi = _velocities(2)
    got = combine(Guidance(scale=3.0, image_scale=1.5, renorm="channel"), 0.9, vc, vu, vi)
    guided = vi + 1.5 * ((vu + 3.0 * (vc - vu)) - vi)
    torch.testing.assert_close(got, guided * _row_scales(vc, guided, 0.0))


def test_text_channel_renorm_applies_after_the_text_step_only():
    vc, vu, vi = _velocities(3)
    got = combine(Guidance(scale=4.0, image_scale=2.0, renorm="text_channel", renorm_min=0.1), 0.3, vc, vu, vi)
    text = vu + 4.0 * (vc - vu)
    text = text * _row_scales(vc, text, 0.1)
    torch.testing.assert_close(got, vi + 2.0 * (text - vi))


def test_channel_dim_picks_which_axis_holds_the_channels():
    vc, vu, _ = _velocities(4, shape=(5, 6))
    got = combine(Guidance(scale=2.0, renorm="channel", channel_dim=0), 0.5, vc, vu)
    guided = vu + 2.0 * (vc - vu)
    torch.testing.assert_close(got, (guided.T * _row_scales(vc.T, guided.T, 0.0)).T)


def test_renorm_never_scales_up():
    vc, _, _ = _velocities(5)
    vu = vc * 1.5  # guidance pulls towards a smaller norm: |v_cond| / |v| > 1, clamped to 1
    for mode in ("global", "channel", "text_channel"):
        got = combine(Guidance(scale=2.0, renorm=mode), 0.5, vc, vu)
        torch.testing.assert_close(got, vu + 2.0 * (vc - vu))


def test_interval_is_open_below_and_closed_above():
    vc, vu, vi = _velocities(6)
    g = Guidance(scale=4.0, image_scale=2.0, interval=(0.4, 0.8))
    assert combine(g, 0.4, vc, vu, vi) is vc  # sigma == lo: outside
    assert combine(g, 0.2, vc, None, None) is vc  # outside: the uncond branches are not needed at all
    assert combine(g, 0.9, vc, None, None) is vc
    torch.testing.assert_close(combine(g, 0.8, vc, vu, vi), vi + 2.0 * ((vu + 4.0 * (vc - vu)) - vi))
    assert g.text_active(0.8) and g.image_active(0.5) and not g.text_active(0.4)


def test_scales_at_most_one_skip_their_branch_as_upstream_does():
    vc, vu, vi = _velocities(7)
    assert combine(Guidance(scale=1.0, image_scale=3.0), 0.5, vc, vu, vi) is vc  # no text guidance, no guidance
    torch.testing.assert_close(combine(Guidance(scale=2.0, image_scale=1.0), 0.5, vc, vu, vi), vu + 2.0 * (vc - vu))
    with pytest.raises(ValueError, match="unconditional"):
        combine(Guidance(scale=2.0), 0.5, vc)


# -- engines driven directly ------------------------------------------------------------------------


def _engine(node: GraphNode, settings=None) -> DiffusionEngine:
    return DiffusionEngine(node, node.module() if node.module else None, EngineContext("w", torch.device("cpu"), settings or {}))


def _euler_node(**options) -> GraphNode:
    return GraphNode("euler", engine="diffusion", inputs=("latents", "step", "num_steps", "velocity"),
                     optional_inputs=("velocity_uncond", "velocity_uncond_image", "guidance_scale",
                                      "image_guidance_scale", "cfg_renorm", "cfg_interval"),
                     outputs=("latents", "timestep", "sigma", "guided_velocity"), options=options)


def _run(engine: DiffusionEngine, *invocations: Invocation) -> dict[str, object]:
    for inv in invocations:
        engine.add(inv)
    results = {}
    while engine.has_work():
        for inv, out in engine.step():
            results[inv.request_id] = out
    return results


def test_velocity_node_guides_and_steps_each_request_at_its_own_sigma():
    engine = _engine(_euler_node(shift=3.0))
    vc, vu, vi = (v.float() for v in _velocities(8))
    x = torch.randn(6, 5)
    a = Invocation("a", "euler", {"latents": x, "step": 0, "num_steps": 4, "velocity": vc}, {"shift": 3.0})
    b = Invocation("b", "euler", {"latents": x, "step": 2, "num_steps": 4, "velocity": vc, "velocity_uncond": vu,
                                  "velocity_uncond_image": vi, "guidance_scale": 4.0, "image_guidance_scale": 2.0,
                                  "cfg_renorm": "text_channel"}, {"shift": 3.0})
    out = _run(engine, a, b)
    sigmas = flow_euler(4, 3.0).float()
    torch.testing.assert_close(out["a"]["latents"], x + (sigmas[1] - sigmas[0]) * vc)
    guided = combine(Guidance(4.0, 2.0, renorm="text_channel"), float(sigmas[2]), vc, vu, vi)
    torch.testing.assert_close(out["b"]["guided_velocity"], guided)
    torch.testing.assert_close(out["b"]["latents"], x + (sigmas[3] - sigmas[2]) * guided)
    assert out["b"]["sigma"] == float(sigmas[3]) and float(out["b"]["timestep"]) == float(sigmas[3])
    assert engine.stats()["diffusion_mixed_sigma_steps"] == 1 and not engine.active_requests()


def test_velocity_node_refuses_what_its_request_got_wrong_and_serves_the_rest():
    engine = _engine(_euler_node())
    x, v = torch.zeros(2, 3), torch.ones(2, 3)
    good = {"latents": x, "step": 0, "num_steps": 2, "velocity": v}
    cases = {
        "no_uncond": (good | {"guidance_scale": 3.0}, "velocity_uncond"),
        "shape": (good | {"velocity": torch.ones(3, 2)}, "velocity"),
        "step": (good | {"step": 2}, "step"),
        "int_latents": (good | {"latents": torch.zeros(2, 3, dtype=torch.long)}, "latents"),
        "renorm": (good | {"cfg_renorm": "norm"}, "cfg_renorm"),
    }
    out = _run(engine, Invocation("ok", "euler", good, {}),
               *(Invocation(rid, "euler", inputs, {}) for rid, (inputs, _) in cases.items()))
    assert isinstance(out["ok"], dict)
    for rid, (_, field) in cases.items():
        assert isinstance(out[rid], RequestError) and out[rid].status == 400, (rid, out[rid])
        assert out[rid].param == field and f"'{field}'" in str(out[rid])


class _Recorder(torch.nn.Module):
    """v = x * 0.5 + context (broadcast); raises on a NaN context, to test failure isolation. Records batch sizes."""

    def __init__(self):
        super().__init__()
        self.batches: list[int] = []

    def forward(self, x, t, /, *, context, image=None):
        self.batches.append(x.shape[0])
        if torch.isnan(context).any():
            raise ValueError("poisoned conditioning")
        extra = 0 if image is None else image[:, :, None]
        return x * 0.5 + context[:, :, None] + extra + t[:, None, None] * 0


def _dit_node(module) -> GraphNode:
    return GraphNode(
        "dit", engine="diffusion",
        inputs=("latents", "step", "num_steps", "context", "image"),
        optional_inputs=("context_uncond", "image_uncond", "guidance_scale", "image_guidance_scale"),
        outputs=("latents", "guided_velocity"), module=lambda: module,
        options={"uncond_inputs": {"context": "context_uncond"}, "uncond_image_inputs": {"image": "image_uncond"}},
    )


def test_dit_node_runs_every_branch_of_every_request_in_one_forward_and_isolates_a_failure():
    module = _Recorder()
    engine = _engine(_dit_node(module))
    x = torch.randn(2, 3)
    base = {"latents": x, "step": 0, "num_steps": 3, "context": torch.ones(2), "image": torch.full((2,), 2.0)}
    dual = base | {"context_uncond": torch.zeros(2), "image_uncond": torch.zeros(2), "guidance_scale": 3.0,
                   "image_guidance_scale": 2.0}
    poisoned = base | {"context": torch.full((2,), float("nan"))}
    out = _run(engine, Invocation("dual", "dit", dual, {}), Invocation("plain", "dit", base, {}),
               Invocation("bad", "dit", poisoned, {}))
    assert module.batches[0] == 5  # 3 branches + 1 + 1 rows in one forward, then retried per request
    assert isinstance(out["bad"], ValueError) and isinstance(out["plain"], dict)
    vc = x * 0.5 + 1 + 2
    vu = x * 0.5 + 0 + 2  # text-unconditional: context swapped, image kept
    vi = x * 0.5 + 1 + 0  # image-unconditional: image swapped, context kept
    torch.testing.assert_close(out["dual"]["guided_velocity"], vi + 2.0 * ((vu + 3.0 * (vc - vu)) - vi))
    sigmas = flow_euler(3, 1.0).float()
    torch.testing.assert_close(out["plain"]["latents"], x + (sigmas[1] - sigmas[0]) * vc)


def test_dit_node_asks_for_its_unconditional_inputs_by_name():
    engine = _engine(_dit_node(_Recorder()))
    inputs = {"latents": torch.zeros(2, 3), "step": 0, "num_steps": 3, "context": torch.ones(2),
              "image": torch.ones(2), "guidance_scale": 2.0, "context_uncond": torch.zeros(2),
              "image_guidance_scale": 2.0}
    out = _run(engine, Invocation("r", "dit", inputs, {}))
    assert isinstance(out["r"], RequestError) and out["r"].param == "image_uncond"


# -- checked when the model loads -------------------------------------------------------------------


def test_a_module_that_cannot_take_the_call_fails_at_load_naming_node_and_method():
    class NoContext(torch.nn.Module):
        def forward(self, x, t):
            return x

    node = GraphNode("dit", engine="diffusion", inputs=("latents", "step", "num_steps", "context"),
                     outputs=("latents",), module=NoContext)
    with pytest.raises(ModuleContractError, match=r"node 'dit' \(engine 'diffusion'\).*context") as failure:
        _engine(node)
    assert failure.value.method == "forward"


@pytest.mark.parametrize(
    ("options", "outputs", "match"),
    [
        ({"sheduler": "x"}, ("latents",), "unknown options"),
        ({"schedule": "ddim"}, ("latents",), "unknown schedule"),
        ({"shift": -2}, ("latents",), "shift"),
        ({"role": "sample"}, ("latents",), "role"),
        ({}, ("latents", "noise"), "unknown outputs"),
        ({"latent_shape": [4, 0]}, ("latents",), "latent_shape"),
    ],
)
def test_bad_node_options_fail_at_load(options, outputs, match):
    node = GraphNode("euler", engine="diffusion", inputs=("latents", "step", "num_steps", "velocity"),
                     outputs=outputs, options=options)
    with pytest.raises(ModelLoadError, match=match):
        _engine(node)


def test_a_velocity_node_takes_no_module_and_unknown_settings_fail():
    node = GraphNode("euler", engine="diffusion", inputs=("latents", "step", "num_steps", "velocity"),
                     outputs=("latents",), module=lambda: torch.nn.Identity())
    with pytest.raises(ModelLoadError, match="takes no module"):
        _engine(node)
    with pytest.raises(ConfigError, match="max_rows"):
        _engine(_euler_node(), settings={"max_row": 4})


def test_the_plugin_registers_the_engine_kind():
    from mstar_core.plugins.manager import default_registry

    assert default_registry().engines.get("diffusion") is DiffusionEngine


def test_an_unknown_call_option_fails_the_call_naming_the_known_ones():
    engine = _engine(_euler_node())
    inputs = {"latents": torch.zeros(2, 3), "step": 0, "num_steps": 2, "velocity": torch.ones(2, 3)}
    out = _run(engine, Invocation("r", "euler", inputs, {"sheduler": "flow_euler"}))
    assert isinstance(out["r"], ValueError) and not isinstance(out["r"], RequestError)
    assert "sheduler" in str(out["r"]) and "schedule" in str(out["r"])
