"""Requests: the task, the prompt laid out as BAGEL's blocks, images resized to the VAE / ViT grids, CFG bounds.

Positions follow BAGEL: text tokens advance the RoPE position one by one; an image block
[<|vision_start|>, rows, <|vision_end|>] sits at one position and advances it by one. Each cache
label has its own next position (`main` after everything, `cfg_text` before the last text, `cfg_img`
after the text alone), so each CFG branch's latent block gets its label's position.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from mstar_bagel.config import BagelConfig
from mstar_bagel.graph import MAX_STEPS
from mstar_bagel.tokenizer import SpecialIds
from mstar_core.errors import RequestError
from mstar_core.nn.sincos import flattened_grid_ids
from mstar_core.sampling import SamplingParams, sampling_names
from mstar_core.schema import RequestField, RequestSchema, sampling_fields

TASKS = ("t2i", "edit", "understand", "think")
#: The system prompt of think mode when the checkpoint's config.json gives none (`think_system_prompt`).
THINK_SYSTEM_PROMPT = ("Plan the picture before drawing it: reason about it step by step inside <think> </think>, "
                       "then generate the image.")
RENORMS = ("none", "global", "channel", "text_channel")
#: Published defaults per task: (text scale, image scale, interval, renorm).
CFG_DEFAULTS = {"t2i": (4.0, 1.0, (0.4, 1.0), "global"), "edit": (4.0, 2.0, (0.0, 1.0), "text_channel"),
                "think": (4.0, 1.0, (0.4, 1.0), "global")}
MAX_SCALE = 30.0
MAX_IMAGES = 8
MAX_N = 10
MAX_PROMPT = 4096
#: The request's fields that make the text tasks' `SamplingParams` (a `grammar`: structured output, tool calls).
_TEXT_SAMPLING = sampling_names("max_tokens", "temperature", "top_k", "top_p", "logit_bias", "seed", "grammar")


def _interval(value: Any, name: str) -> tuple[float, float]:
    if not isinstance(value, list | tuple) or len(value) != 2 or not all(isinstance(v, int | float) for v in value):
        raise RequestError(f"'{name}' must be [lo, hi] with 0 <= lo <= hi <= 1", param=name)
    lo, hi = float(value[0]), float(value[1])
    if not 0.0 <= lo <= hi <= 1.0:
        raise RequestError(f"'{name}' must be [lo, hi] with 0 <= lo <= hi <= 1, got {[lo, hi]}", param=name)
    return lo, hi


#: The largest side an edit's answer may be resized to.
MAX_EDIT_SIDE = 4096


def _edit_size(value: Any, name: str) -> list[int]:
    if not all(1 <= v <= MAX_EDIT_SIDE for v in value):
        raise RequestError(f"'{name}' must be [width, height], each in [1, {MAX_EDIT_SIDE}], got {value}", param=name)
    return [int(v) for v in value]


def decode_image(value: Any, name: str) -> torch.Tensor:
    """An image as `[H, W, 3]` uint8: a tensor (uint8, or float in [0, 1]) or PNG/JPEG bytes."""
    if isinstance(value, bytes | bytearray):
        try:
            from PIL import Image

            with Image.open(io.BytesIO(value)) as im:
                import numpy as np

                value = torch.from_numpy(np.array(im.convert("RGB")))
        except Exception:
            raise RequestError(f"'{name}' could not be decoded as an image (send a PNG or JPEG)", param=name) from None
    t = torch.as_tensor(value)
    if t.dim() != 3 or t.shape[-1] != 3 or min(t.shape[:2]) < 1:
        raise RequestError(f"'{name}' must be an RGB image [H, W, 3], got shape {list(t.shape)}", param=name)
    if t.dtype != torch.uint8:
        if not t.dtype.is_floating_point:
            raise RequestError(f"'{name}' must be uint8 or float in [0, 1], got {t.dtype}", param=name)
        t = (t.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return t


def fit_size(h: int, w: int, max_side: int, min_side: int, stride: int) -> tuple[int, int]:
    """BAGEL's resize rule: the long side at most `max_side`, the short at least `min_side`, both multiples of `stride`."""
    scale = min(1.0, max_side / max(h, w))
    if min(h, w) * scale < min_side:
        scale = min_side / min(h, w)
    cap = max_side // stride * stride
    return tuple(min(cap, max(stride, round(s * scale) // stride * stride)) for s in (h, w))  # type: ignore[return-value]


def to_pixels(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """`[H, W, 3]` uint8 -> `[3, h, w]` float in [-1, 1] at `size` (bilinear with antialiasing)."""
    x = image.permute(2, 0, 1).float()[None] / 255.0
    if tuple(x.shape[2:]) != size:
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True).clamp(0, 1)
    return x[0] * 2 - 1


def _block(n: int, ids: SpecialIds, position: int, gen: bool) -> dict[str, torch.Tensor]:
    out = {
        "block_ids": torch.tensor([ids.boi] + [0] * n + [ids.eoi]),
        "block_at": torch.arange(1, n + 1),
        "block_positions": torch.full((n + 2,), position, dtype=torch.long),
    }
    if gen:
        out["block_routing"] = torch.tensor([0] + [1] * n + [0])
    return out


class Preparer:
    """`prepare(inputs) -> env` for one loaded BAGEL."""

    def __init__(self, cfg: BagelConfig, tokenizer, ids: SpecialIds, think_system_prompt: str | None = None):
        self.cfg, self.tokenizer, self.ids = cfg, tokenizer, ids
        self.think_system_prompt = think_system_prompt or THINK_SYSTEM_PROMPT
        down = cfg.latent_downsample
        self.vae_max = min(1024, cfg.max_latent_size * down)
        self.vae_min = max(down, min(512, self.vae_max // 2) // down * down)
        p = cfg.vit.patch_size
        self.vit_max = min(980, cfg.vit_max_num_patch_per_side * p)
        self.vit_min = max(p, min(224, self.vit_max // 2) // p * p)
        side = self.vae_max
        default = min(cfg.default_image_size or side, side) // down * down
        self.schema = RequestSchema(
            fields=(
                RequestField("task", "string", "t2i (text to image), edit (image + instruction), understand (images -> "
                             "text), think (a thought, then the image if the thought opens one with "
                             "<|vision_start|>, else the text alone; with 'image': an edit)",
                             default="t2i", choices=TASKS),
                RequestField("prompt", "string", "the prompt or instruction (understand: the last text)", min_length=1,
                             max_length=MAX_PROMPT, blank=False),
                RequestField("content", "array", "understand: text and images in order (strings; [H, W, 3] tensors "
                             "or PNG/JPEG bytes), before 'images' and 'prompt'", items="any", max_length=4 * MAX_IMAGES),
                RequestField("image", "any", "edit: the input image ([H, W, 3] tensor, or PNG/JPEG bytes)"),
                RequestField("edit_size", "array", "edit: [width, height] of the answer (default: the input image's "
                             "size; the edit is drawn on the VAE grid at the input's aspect, then resized)",
                             items="integer", min_length=2, max_length=2, check=_edit_size),
                RequestField("images", "array", "understand: images before the prompt", items="any",
                             max_length=MAX_IMAGES),
                RequestField("width", "integer", f"t2i: output width, a multiple of {down}", default=default,
                             minimum=down, maximum=side, multiple_of=down),
                RequestField("height", "integer", f"t2i: output height, a multiple of {down}", default=default,
                             minimum=down, maximum=side, multiple_of=down),
                RequestField("n", "integer", "images from one prompt (they share its cached labels); image i is "
                             "what one request seeded seed + i draws", default=1, minimum=1, maximum=MAX_N),
                RequestField("num_steps", "integer", "flow Euler steps", default=cfg.num_timesteps - 1, minimum=1,
                             maximum=MAX_STEPS),
                RequestField("shift", "number", "timestep shift", default=cfg.timestep_shift, minimum=0.05,
                             maximum=20.0),
                RequestField("guidance_scale", "number", "text CFG scale (1: off)", minimum=0.0, maximum=MAX_SCALE),
                RequestField("image_guidance_scale", "number", "image CFG scale (1: off)", minimum=0.0,
                             maximum=MAX_SCALE),
                RequestField("cfg_interval", "array", "[lo, hi]: CFG applies where lo < t <= hi", items="number",
                             check=_interval),
                RequestField("cfg_renorm", "string", "velocity renormalisation", choices=RENORMS),
                RequestField("cfg_renorm_min", "number", "renorm floor", default=0.0, minimum=0.0, maximum=1.0),
                RequestField("seed", "integer", "noise / sampling seed", minimum=0, maximum=2**63 - 1),
                RequestField("system_prompt", "string", "think: the system prompt (default: the checkpoint's)",
                             max_length=MAX_PROMPT),
                *sampling_fields("max_tokens", "temperature", "top_k", "top_p", "logit_bias", "grammar",
                                 defaults={"max_tokens": 64}),
            ),
            example={"task": "t2i", "prompt": "a red fox in the snow", "num_steps": 3},
            draws_n=True,
        )

    def text_ids(self, text: str, field: str = "prompt") -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if ids and max(ids) >= self.cfg.llm.vocab_size:
            raise RequestError(f"'{field}' has tokens outside the model's vocabulary", param=field)
        return ids

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        task = inputs["task"]
        if task == "understand":
            return self._understand(inputs)
        if inputs.get("prompt") is None:
            raise RequestError(f"task '{task}' needs 'prompt'", param="prompt")
        if task == "think":
            return self._think(inputs)
        if inputs.get("grammar") is not None:
            raise RequestError(f"'grammar' constrains text; task '{task}' draws an image (use understand or think)",
                               param="grammar")
        if task == "edit" and inputs.get("image") is None:
            raise RequestError("task 'edit' needs 'image' (the picture to edit)", param="image")
        prompt = [self.ids.bos, *self.text_ids(inputs["prompt"]), self.ids.eos]
        env: dict[str, Any] = {"walk": task, "prompt_ids": torch.tensor(prompt)}
        n_text = len(prompt)
        if task == "edit":
            h, w = self._edit_image(inputs, env, 0)
            env["prompt_positions"] = torch.arange(2, 2 + n_text)
            env["text_only_positions"] = torch.arange(n_text)
            next_pos = (2 + n_text, 2, n_text)  # main, cfg_text (the images), cfg_img (the text)
        else:
            h, w = self._size(inputs)
            env["prompt_positions"] = torch.arange(n_text)
            next_pos = (n_text, 0, n_text)
        env.update(self._flow(task, inputs, h, w, next_pos))
        return env

    def _flow(self, task: str, inputs: Mapping[str, Any], h: int, w: int, next_pos: tuple[int, int, int]) -> dict:
        cfg = self.cfg
        rows, cols = h // cfg.latent_downsample, w // cfg.latent_downsample
        n = rows * cols
        scale, image_scale, interval, renorm = CFG_DEFAULTS[task]
        pick = lambda key, default: default if inputs.get(key) is None else inputs[key]  # noqa: E731
        block = _block(n, self.ids, 0, gen=True)
        env = {
            "n": inputs["n"], "num_steps": inputs["num_steps"], "shift": float(inputs["shift"]),
            "latent_shape": [n, cfg.patch_latent_dim], "latent_ids": flattened_grid_ids(rows, cols, cfg.max_latent_size),
            "latent_grid": [rows, cols],
            "gen_block_ids": block["block_ids"], "gen_block_at": block["block_at"],
            "gen_block_routing": block["block_routing"], "gen_rows": torch.arange(1, n + 1),
            "gen_position_table": torch.tensor(next_pos)[:, None].expand(3, n + 2).contiguous(),
            "guidance_scale": float(pick("guidance_scale", scale)),
            "image_guidance_scale": float(pick("image_guidance_scale", image_scale)),
            "cfg_interval": list(pick("cfg_interval", interval)),
            "cfg_renorm": pick("cfg_renorm", renorm), "cfg_renorm_min": float(inputs["cfg_renorm_min"]),
        }
        if inputs.get("seed") is not None:
            env["seed"] = inputs["seed"]
        return env

    def _sampling(self, inputs: Mapping[str, Any], stops: list[int]) -> SamplingParams:
        """Text sampling: greedy unless the request sets a temperature (upstream BAGEL decodes greedily).

        The prompt writes carry no sampling, so `max_tokens` and a `grammar` count the reply's tokens alone.
        """
        fields = {n: inputs[n] for n in _TEXT_SAMPLING if inputs.get(n) is not None}
        fields.setdefault("temperature", 0.0)
        return SamplingParams.from_mapping({**fields, "stop_token_ids": stops}).check_vocab(self.cfg.llm.vocab_size)

    def _size(self, inputs: Mapping[str, Any]) -> tuple[int, int]:
        return inputs["height"], inputs["width"]  # on the latent grid: the schema's bounds and multiple_of

    def _edit_image(self, inputs: Mapping[str, Any], env: dict[str, Any], position: int) -> tuple[int, int]:
        """The input image as a VAE block at `position` and a ViT block at `position + 1`; the output's size."""
        image = decode_image(inputs["image"], "image")
        h, w = fit_size(image.shape[0], image.shape[1], self.vae_max, self.vae_min, self.cfg.latent_downsample)
        vh, vw = fit_size(image.shape[0], image.shape[1], self.vit_max, self.vit_min, self.cfg.vit.patch_size)
        n_vae = (h // self.cfg.latent_downsample) * (w // self.cfg.latent_downsample)
        n_vit = (vh // self.cfg.vit.patch_size) * (vw // self.cfg.vit.patch_size)
        env.update({"vae_pixels": to_pixels(image, (h, w)), "vit_pixels": to_pixels(image, (vh, vw))})
        # the answer's size: asked for, else the input's (as OpenAI's edits answer); drawn at (h, w), then resized
        wanted = inputs.get("edit_size")
        env["output_size"] = [wanted[1], wanted[0]] if wanted is not None else [image.shape[0], image.shape[1]]
        env.update({f"vae_{k}": v for k, v in _block(n_vae, self.ids, position, gen=True).items()})
        env.update({f"vit_{k}": v for k, v in _block(n_vit, self.ids, position + 1, gen=False).items()})
        return h, w

    def _think(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        system = [self.ids.bos, *self.text_ids(inputs.get("system_prompt") or self.think_system_prompt), self.ids.eos]
        prompt = [self.ids.bos, *self.text_ids(inputs["prompt"]), self.ids.eos]
        ls, lp = len(system), len(prompt)
        env = {"system_ids": torch.tensor(system), "system_positions": torch.arange(ls),
               "prompt_ids": torch.tensor(prompt), "think_start": [self.ids.bos]}
        if inputs.get("image") is None:
            h, w = self._size(inputs)
            p0 = ls + lp
            env.update({"walk": "think", "prompt_positions": torch.arange(ls, p0),
                        "sampling": self._sampling(inputs, [self.ids.eos, self.ids.boi]),
                        # main continues after the thought (ThinkClose adds its length); cfg_text: the system
                        # prompt; cfg_img: system prompt and prompt
                        "gen_position_base": [p0 + 1, ls, p0]})
        else:  # the image's VAE and ViT blocks at ls and ls + 1, as in edit, after the system prompt
            h, w = self._edit_image(inputs, env, ls)
            p0 = ls + 2 + lp
            env.update({"walk": "think_edit", "prompt_positions": torch.arange(ls + 2, p0),
                        "text_only_positions": torch.arange(ls, ls + lp),
                        "sampling": self._sampling(inputs, [self.ids.eos, self.ids.boi]),
                        "gen_position_base": [p0 + 1, ls + 2, ls + lp]})
        flow = self._flow("edit" if inputs.get("image") is not None else "think", inputs, h, w, (0, 0, 0))
        del flow["gen_position_table"]
        env.update(flow)
        return env

    def _understand(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if inputs["n"] != 1:
            raise RequestError("'n' > 1 is for images (t2i, edit, think); ask for one reply", param="n")
        items = [(f"content[{i}]", v) for i, v in enumerate(inputs.get("content") or [])]
        items += [(f"images[{i}]", v) for i, v in enumerate(inputs.get("images") or [])]
        if inputs.get("prompt") is not None:
            items.append(("prompt", inputs["prompt"]))
        if not items:
            raise RequestError("task 'understand' needs 'prompt' (or 'content')", param="prompt")
        if sum(not isinstance(v, str) for _, v in items) > MAX_IMAGES:
            raise RequestError(f"at most {MAX_IMAGES} images per request", param="content")
        parts, pos = [], 0
        for name, value in items:
            if isinstance(value, str):
                ids = [self.ids.bos, *self.text_ids(value, name), self.ids.eos]
                parts.append({"text_ids": torch.tensor(ids), "text_positions": torch.arange(pos, pos + len(ids))})
                pos += len(ids)
                continue
            image = decode_image(value, name)
            vh, vw = fit_size(image.shape[0], image.shape[1], self.vit_max, self.vit_min, self.cfg.vit.patch_size)
            n = (vh // self.cfg.vit.patch_size) * (vw // self.cfg.vit.patch_size)
            part = {"vit_pixels": to_pixels(image, (vh, vw))}
            part.update({f"vit_{k}": v for k, v in _block(n, self.ids, pos, gen=False).items()})
            parts.append(part)
            pos += 1
        return {"walk": "understand", "parts": parts, "num_parts": len(parts), "reply_start": [self.ids.bos],
                "reply_positions": torch.tensor([pos]), "sampling": self._sampling(inputs, [self.ids.eos])}
