"""Request schemas and preparation of `vjepa2` and `vjepa2-ac`: declared fields, then what the schema cannot say.

Frame inputs (`video`, `frames`, `goal`) are either model-ready float frames `[T, C, crop, crop]`, or, with
`"preprocess": true` (the default for uint8 tensors/arrays), raw pixels 0..255 `[T, H, W, C]` / `[T, C, H, W]`
of any size that get HF `VJEPA2VideoProcessor`'s preprocessing (`mstar_vjepa.preprocess`). The schema checks
kinds and bounds; `prepare_*` checks shapes, which depend on the checkpoint's config and on other fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.schema import RequestField, RequestSchema, sampling_field
from mstar_vjepa.preprocess import preprocess_video

#: 1-frame 2x2 RGB pixels: preprocessed (upsampled) to any checkpoint's crop size.
PIXELS = [[[[0, 64, 128], [255, 128, 0]], [[32, 32, 32], [200, 100, 50]]]]
HF_EXAMPLE = {"video": PIXELS, "preprocess": True}
AC_EXAMPLE = {"frames": PIXELS, "preprocess": True, "states": [0.0] * 7, "actions": [[0.01, 0, 0, 0, 0, 0, 0]] * 2}

_PREPROCESS = RequestField("preprocess", "boolean", "frames are pixels 0..255 of any size, to resize, crop and "
                           "normalise (default: on for uint8 tensors)")


def _indices(value: torch.Tensor, name: str) -> torch.Tensor:
    if value.dim() != 1 or value.numel() == 0 or value.is_floating_point() or value.dtype == torch.bool:
        raise RequestError(f"'{name}' must be a non-empty 1-D list of token indices", param=name)
    return value.long()


def hf_schema() -> RequestSchema:
    return RequestSchema(fields=(
        RequestField("walk", "string", "what to run", default="encode", choices=("encode", "predict")),
        RequestField("video", "tensor", "frames [T, C, crop, crop], or pixels with preprocess", required=True),
        _PREPROCESS,
        *(RequestField(name, "tensor", f"{what} token indices (with the other mask; default: all)", check=_indices)
          for name, what in (("context_mask", "visible"), ("target_mask", "predicted"))),
    ), example=HF_EXAMPLE, description="V-JEPA 2: video -> patch latents, and masked prediction")


def ac_schema(max_frames: int) -> RequestSchema:
    return RequestSchema(fields=(
        RequestField("walk", "string", "default: plan with a goal, rollout with actions, else encode",
                     choices=("encode", "rollout", "plan")),
        RequestField("frames", "tensor", "context frames [T, C, crop, crop], or pixels with preprocess",
                     required=True),
        _PREPROCESS,
        RequestField("states", "tensor", "robot state per context frame [T, 7] (xyz, euler xyz, gripper)"),
        RequestField("actions", "tensor", "rollout: one action per step [H, 7]"),
        RequestField("goal", "tensor", "plan: the goal frame (its last frame is used)"),
        RequestField("horizon", "integer", "plan: steps to plan", default=1, minimum=1, maximum=max_frames),
        RequestField("samples", "integer", "CEM samples per iteration", default=64, minimum=1, maximum=4096),
        RequestField("topk", "integer", "CEM elites (default: min(10, samples))", minimum=1, maximum=4096),
        RequestField("iterations", "integer", "CEM iterations", default=10, minimum=1, maximum=1000),
        sampling_field("seed", default=0, description="CEM's random stream"),
    ), example=AC_EXAMPLE, description="V-JEPA 2-AC world model: encode, roll out actions, or plan toward a goal")


def _bad(name: str, t: torch.Tensor, what: str) -> RequestError:
    return RequestError(f"input '{name}' has shape {tuple(t.shape)} and dtype {t.dtype}; expected {what}", param=name)


def frames(inputs: Mapping[str, Any], name: str, cfg) -> torch.Tensor:
    """Model-ready float frames `[T, C, crop, crop]` from `inputs[name]` (pixels when `preprocess` says so)."""
    t, c, crop = inputs[name], cfg.in_chans, cfg.crop_size
    if inputs.get("preprocess", t.dtype == torch.uint8):
        what = f"pixel frames (0..255) [T, H, W, {c}] or [T, {c}, H, W], any size"
        if t.dtype == torch.bool or t.is_complex() or t.dim() not in (3, 4) or t.numel() == 0:
            raise _bad(name, t, what)
        if not t.is_floating_point():
            if t.min() < 0 or t.max() > 255:
                raise RequestError(f"input '{name}' has pixel values outside 0..255; expected {what}", param=name)
            t = t.to(torch.uint8)
        try:
            return preprocess_video(t[None] if t.dim() == 3 else t, crop, c)
        except ValueError as exc:
            raise RequestError(f"input '{name}': {exc}", param=name) from None
    what = f"float frames [T, {c}, {crop}, {crop}] (or pixel frames of any size with 'preprocess': true)"
    t = t[None] if t.dim() == 3 else t
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)) or t.dim() != 4 or \
            tuple(t.shape[1:]) != (c, crop, crop) or t.shape[0] < 1:
        raise _bad(name, t, what)
    return t.float()


def _rows(inputs: Mapping[str, Any], name: str, rows: range, what: str) -> torch.Tensor:
    """`inputs[name]` as float `[n, 7]` with n in `rows` (a single row `[7]` is one row)."""
    t = inputs.get(name)
    if t is None:
        raise RequestError(f"missing input '{name}': {what}", param=name)
    t = t[None] if t.dim() == 1 else t
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)) or t.dim() != 2 or t.shape[1] != 7 or \
            t.shape[0] not in rows:
        raise _bad(name, t, what)
    return t.float()


def prepare_hf(inputs: Mapping[str, Any], cfg) -> dict[str, Any]:
    """A checked `vjepa2` request as the walks' env."""
    env: dict[str, Any] = {"walk": inputs["walk"], "video": frames(inputs, "video", cfg)}
    n = (max(env["video"].shape[0], cfg.tubelet_size) // cfg.tubelet_size) * cfg.grid_size**2
    masks = [name for name in ("context_mask", "target_mask") if name in inputs]
    if len(masks) == 1:
        raise RequestError("pass both 'context_mask' and 'target_mask', or neither (full coverage)", param=masks[0])
    for name in masks:
        if inputs[name].min() < 0 or inputs[name].max() >= n:
            raise RequestError(f"'{name}' must hold token indices in [0, {n})", param=name)
        env[name] = inputs[name]
    return env


def prepare_ac(inputs: Mapping[str, Any], ecfg, pcfg) -> dict[str, Any]:
    """A checked `vjepa2-ac` request as the walks' env; the walk defaults to `plan` with a goal, `rollout` with
    actions, else `encode`."""
    walk = inputs.get("walk") or ("plan" if "goal" in inputs else "rollout" if "actions" in inputs else "encode")
    env: dict[str, Any] = {"walk": walk, "frames": frames(inputs, "frames", ecfg)}
    if walk == "encode":
        return env
    n_ctx = env["frames"].shape[0]
    max_h = pcfg.max_frames - n_ctx + 1
    if max_h < 1:
        raise RequestError(f"input 'frames' has {n_ctx} frames; at most {pcfg.max_frames} fit the predictor's mask",
                           param="frames")
    env["states"] = _rows(inputs, "states", range(n_ctx, n_ctx + 1), f"states [7] or [{n_ctx}, 7], one per frame")
    if walk == "rollout":
        env["actions"] = _rows(inputs, "actions", range(1, max_h + 1), f"actions [H, 7] with 1 <= H <= {max_h}")
        env["horizon"] = env["actions"].shape[0]
        return env
    if "goal" not in inputs:
        raise RequestError("missing input 'goal': the goal frame to plan toward", param="goal")
    if inputs["horizon"] > max_h:
        raise RequestError(f"'horizon' must be an integer in [1, {max_h}], got {inputs['horizon']}", param="horizon")
    samples = inputs["samples"]
    topk = inputs.get("topk", min(10, samples))
    if topk > samples:
        raise RequestError(f"'topk' must be an integer in [1, {samples}] (samples), got {topk}", param="topk")
    env.update(goal=frames(inputs, "goal", ecfg)[-1:], horizon=inputs["horizon"], samples=samples,
               iterations=inputs["iterations"], seed=inputs["seed"],
               cem={"samples": samples, "topk": topk, "iterations": inputs["iterations"]})
    return env
