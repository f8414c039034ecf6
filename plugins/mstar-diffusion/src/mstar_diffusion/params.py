"""Reading a diffusion invocation's settings: each from the request's env, else the node's options, else a default.

Every value is checked here, when the engine takes the invocation, and a bad one is a
`RequestError` (400) naming the field, answered to that invocation alone.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mstar_core.errors import ModelLoadError, RequestError
from mstar_core.sampling import check_int, check_number, check_seed, is_integer
from mstar_diffusion.guidance import RENORM_MODES, Guidance
from mstar_diffusion.schedules import SCHEDULES
from mstar_diffusion.solvers import SOLVERS

#: Settings a request may send (as node inputs) or a node may fix (as options), with their defaults.
SETTINGS: dict[str, Any] = {
    "num_steps": None,
    "shift": 1.0,
    "seed": None,
    "latent_shape": None,
    "guidance_scale": 1.0,
    "image_guidance_scale": 1.0,
    "cfg_interval": (0.0, 1.0),
    "cfg_renorm": "none",
    "cfg_renorm_min": 0.0,
}

#: Static node options (not settable per request).
NODE_OPTIONS = (
    "role",              # "init" (draws the first latents) or "step" (one denoising step; the default)
    "schedule",          # a name in SCHEDULES (default "flow_euler")
    "timestep_scale",    # the module's / velocity node's timestep is sigma * timestep_scale (default 1)
    "max_steps",         # the largest num_steps a request may ask for (default 1000)
    "max_latent_numel",  # the largest latent a request may ask for (default 2**24 elements)
    "channel_dim",       # the latents' channel dim, for `channel` / `text_channel` renorm (default -1)
    "uncond_inputs",     # DiT nodes: {conditioning input: its text-unconditional counterpart}
    "uncond_image_inputs",  # DiT nodes: {conditioning input: its image-unconditional counterpart}
    "solver",            # step nodes: "euler" (default) or "unipc" (multistep; carries input/output solver_history)
    "integer_timesteps",  # the module's timestep is truncated to an integer (diffusers' UniPC and DPM schedulers)
    "inline",            # read by the runtime's scheduler
)

KNOWN_OPTIONS = frozenset(NODE_OPTIONS) | frozenset(SETTINGS)

#: What a walk's NodeCall may set per call: the settings' defaults. The node options are the model's
#: (read once at load, or limits the author fixes for every request), so a call site may not change them.
CALL_OPTIONS = frozenset(SETTINGS)

#: The inputs the engine itself reads; a DiT node's other inputs are the module's conditioning.
LOOP_INPUTS = ("latents", "step", "velocity", "velocity_uncond", "velocity_uncond_image", "solver_history", "step_cache")

MAX_LATENT_RANK = 8


def _fail(node: str, field: str, message: str) -> RequestError:
    return RequestError(f"node '{node}': '{field}' {message}", param=field)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def setting(inputs: Mapping[str, Any], options: Mapping[str, Any], name: str) -> Any:
    """The request's value (None counts as absent), else the node's option, else the default."""
    value = inputs.get(name)
    if value is None:
        value = options.get(name, SETTINGS[name])
    return value


def _checked(node: str, check, *args: Any) -> Any:
    try:
        return check(*args)
    except RequestError as exc:
        raise RequestError(f"node '{node}': {exc}", param=exc.param) from None


def num_steps(node: str, inputs: Mapping[str, Any], options: Mapping[str, Any]) -> int:
    value = setting(inputs, options, "num_steps")
    if value is None:
        raise _fail(node, "num_steps", "is required (the request sends it, or the node sets it as an option)")
    limit = int(options.get("max_steps", 1000))
    return _checked(node, check_int, value, "num_steps", 1, limit)


def shift(node: str, inputs: Mapping[str, Any], options: Mapping[str, Any]) -> float:
    value = _checked(node, check_number, setting(inputs, options, "shift"), "shift")
    if not value > 0:
        raise _fail(node, "shift", f"must be a positive number (1 means no shift), got {value!r}")
    return value


def seed(node: str, inputs: Mapping[str, Any], options: Mapping[str, Any]) -> int:
    """The request's seed; without one, a fresh random seed (an init node may output it to repeat the run)."""
    value = setting(inputs, options, "seed")
    if value is None:
        return secrets.randbits(63)
    return _checked(node, check_seed, value, "seed")


def latent_shape(node: str, inputs: Mapping[str, Any], options: Mapping[str, Any]) -> tuple[int, ...]:
    """The request's latent shape, checked against the node's template (option `latent_shape`, None = free dim)."""
    template = options.get("latent_shape")
    value = inputs.get("latent_shape")
    if value is None:
        if template is None or any(d is None for d in template):
            raise _fail(node, "latent_shape", f"is required{'' if template is None else f' (the node takes {_template(template)})'}")
        value = template
    if isinstance(value, torch.Size):
        value = tuple(value)
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence) or not value:
        raise _fail(node, "latent_shape", f"must be a non-empty list of positive integers, got {_show(value)}")
    if len(value) > MAX_LATENT_RANK or not all(is_integer(d) and d > 0 for d in value):
        raise _fail(node, "latent_shape", f"must be a list of at most {MAX_LATENT_RANK} positive integers, got {_show(value)}")
    shape = tuple(int(d) for d in value)
    if template is not None and not _fits(shape, template):
        raise _fail(node, "latent_shape", f"must be {_template(template)}, got {list(shape)}")
    numel = 1
    for d in shape:
        numel *= d
    limit = int(options.get("max_latent_numel", 2**24))
    if numel > limit:
        raise _fail(node, "latent_shape", f"asks for {numel} latent elements; the node allows at most {limit}")
    return shape


def _fits(shape: Sequence[int], template: Sequence[int | None]) -> bool:
    return len(shape) == len(template) and all(t is None or t == d for d, t in zip(shape, template, strict=True))


def _template(template: Sequence[int | None]) -> str:
    return "[" + ", ".join("any" if d is None else str(d) for d in template) + "]"


def latents(node: str, value: Any, template: Sequence[int | None] | None, field: str = "latents") -> torch.Tensor:
    """A floating-point latents tensor of the node's shape."""
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        shown = f"{value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise _fail(node, field, f"must be a floating-point tensor, got {shown}")
    if value.dim() == 0 or value.dim() > MAX_LATENT_RANK:
        raise _fail(node, field, f"must have 1 to {MAX_LATENT_RANK} dims, got shape {list(value.shape)}")
    if template is not None and not _fits(value.shape, template):
        raise _fail(node, field, f"must have shape {_template(template)}, got {list(value.shape)}")
    return value


def guidance(node: str, inputs: Mapping[str, Any], options: Mapping[str, Any]) -> Guidance:
    scale = _checked(node, check_number, setting(inputs, options, "guidance_scale"), "guidance_scale")
    image_scale = _checked(node, check_number, setting(inputs, options, "image_guidance_scale"), "image_guidance_scale")
    for field, value in (("guidance_scale", scale), ("image_guidance_scale", image_scale)):
        if value < 0:
            raise _fail(node, field, f"must be >= 0 (1 means no guidance), got {value!r}")
    interval = setting(inputs, options, "cfg_interval")
    if isinstance(interval, str | bytes | Mapping) or not isinstance(interval, Sequence) or len(interval) != 2:
        raise _fail(node, "cfg_interval", f"must be [lo, hi] with 0 <= lo <= hi <= 1, got {_show(interval)}")
    lo, hi = (_checked(node, check_number, v, "cfg_interval") for v in interval)
    if not 0.0 <= lo <= hi <= 1.0:
        raise _fail(node, "cfg_interval", f"must be [lo, hi] with 0 <= lo <= hi <= 1, got {[lo, hi]}")
    renorm = setting(inputs, options, "cfg_renorm")
    if renorm not in RENORM_MODES:
        raise _fail(node, "cfg_renorm", f"must be one of {', '.join(RENORM_MODES)}; got {_show(renorm)}")
    floor = _checked(node, check_number, setting(inputs, options, "cfg_renorm_min"), "cfg_renorm_min")
    if not 0.0 <= floor <= 1.0:
        raise _fail(node, "cfg_renorm_min", f"must be in [0, 1], got {floor!r}")
    return Guidance(scale, image_scale, (lo, hi), renorm, floor, int(options.get("channel_dim", -1)))


def step_index(node: str, value: Any, steps: int) -> int:
    return _checked(node, check_int, value, "step", 0, steps - 1)


def unknown_options(options: Mapping[str, Any]) -> list[str]:
    return sorted(set(options) - KNOWN_OPTIONS)


def check_node_options(node: Any, role: str) -> None:
    """Unknown or ill-typed static options fail the model's load, naming the node and the known options."""
    unknown = unknown_options(node.options)
    if unknown:
        raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): unknown options {unknown}; "
                             f"known: {', '.join(sorted(KNOWN_OPTIONS))}")
    if role not in ("init", "step"):
        raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): option role must be 'init' or 'step', got {role!r}")
    schedule = node.options.get("schedule", "flow_euler")
    if schedule not in SCHEDULES:
        raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): unknown schedule {schedule!r}; "
                             f"known: {', '.join(sorted(SCHEDULES))}")
    solver = node.options.get("solver", "euler")
    if solver not in SOLVERS:
        raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): unknown solver {solver!r}; known: {', '.join(SOLVERS)}")
    if solver == "unipc" and role == "step" and not {"solver_history"} <= set(node.all_inputs) & set(node.outputs):
        raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): solver 'unipc' carries its history from step to "
                             "step: declare 'solver_history' as an optional input and an output")
    template = node.options.get("latent_shape")
    if template is not None and (
        isinstance(template, str) or not isinstance(template, Sequence) or not template
        or not all(d is None or (is_integer(d) and d > 0) for d in template)
    ):
        raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): option latent_shape must be a list of "
                             f"positive ints or None (a free dim), got {template!r}")
    # the request-settable defaults must themselves be valid: check them as a request without values would be
    try:
        if "num_steps" in node.options:
            num_steps(node.name, {}, node.options)
        shift(node.name, {}, node.options)
        guidance(node.name, {}, node.options)
        if node.options.get("seed") is not None:
            seed(node.name, {}, node.options)
    except RequestError as exc:
        raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): a default in its options is invalid: {exc}") from None
