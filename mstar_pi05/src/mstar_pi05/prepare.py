"""Requests: cameras resized and padded, the prompt with the binned state (pi0.5), normalisation, bounds."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mstar_core.errors import ConfigError, RequestError
from mstar_core.schema import RequestField, RequestSchema
from mstar_pi05.config import PolicyConfig

MAX_CAMERAS = 3
MAX_STEPS = 100
STATE_BINS = np.linspace(-1.0, 1.0, 256 + 1)[:-1]
#: A request every pi0 / pi0.5 answers (JSON form): one 2x2 camera image in 0..255, a 3-value state.
EXAMPLE = {"images": [[[[0, 64, 128], [255, 255, 255]], [[10, 20, 30], [200, 100, 0]]]],
           "prompt": "pick up the cube", "state": [0.1, -0.2, 0.3], "horizon": 5, "action_dim": 7, "seed": 0}


def bin_state(state: np.ndarray) -> np.ndarray:
    """openpi's discretisation: `digitize(state, linspace(-1, 1, 257)[:-1]) - 1` (not rounding), 0..255 in range."""
    return np.digitize(state, bins=STATE_BINS) - 1


def clean_task(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


def pi05_prompt(task: str, state: np.ndarray) -> str:
    return f"Task: {clean_task(task)}, State: {' '.join(str(int(b)) for b in bin_state(state))};\nAction: "


def prompt_ids(tokenizer: Any, task: str, state: np.ndarray | None) -> list[int]:
    """openpi's PaliGemma prompt: pi0.5 (`state` given) BOS + the prompt with the binned state; pi0 BOS + the cleaned
    task, then the newline encoded on its own (so a SentencePiece model does not merge it into the task's last piece)."""
    if state is not None:
        return tokenizer.encode(pi05_prompt(task, state))
    return tokenizer.encode(clean_task(task)) + tokenizer.encode("\n", bos=False)


class ByteTokenizer:
    """The tiny preset's tokenizer (the real PaliGemma SentencePiece model is not in the checkpoint): BOS then bytes."""

    bos = 2
    vocab_size = 259

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return [self.bos] * bos + [b + 3 for b in text.encode("utf-8")]


class SentencePieceTokenizer:
    """PaliGemma's tokenizer (Gemma's SentencePiece model, 257152 pieces) read from a `.model` file."""

    def __init__(self, path: str):
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError("pi05: reading the PaliGemma tokenizer needs `pip install sentencepiece`") from None
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(f"pi05: {path} is not a SentencePiece model: {exc}") from None
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return [self.sp.bos_id()] * bos + self.sp.encode(text)


def tokenizer_for(directory: str | None, preset: bool, config: Mapping[str, Any] | None = None):
    """Bytes for presets; else, first found: config.json's `mstar_tokenizer` (`"bytes"`, or a SentencePiece model path,
    relative to the checkpoint), `tokenizer.model` in the checkpoint, `$MSTAR_PALIGEMMA_TOKENIZER`."""
    if preset:
        return ByteTokenizer()
    named = (config or {}).get("mstar_tokenizer")
    if named == "bytes":
        return ByteTokenizer()
    if named is not None:
        if not isinstance(named, str) or not named:
            raise ConfigError(f"config.json: key 'mstar_tokenizer' must be 'bytes' or a path, got {named!r}")
        path = os.path.join(directory or "", os.path.expanduser(named))
        if not os.path.isfile(path):
            raise ConfigError(f"config.json: 'mstar_tokenizer' names {path}, which is not a file")
        return SentencePieceTokenizer(path)
    if directory and os.path.isfile(os.path.join(directory, "tokenizer.model")):
        return SentencePieceTokenizer(os.path.join(directory, "tokenizer.model"))
    path = os.environ.get("MSTAR_PALIGEMMA_TOKENIZER")
    if not path:
        raise ConfigError("pi05: the checkpoint has no tokenizer; set MSTAR_PALIGEMMA_TOKENIZER to PaliGemma's "
                          "SentencePiece model (paligemma_tokenizer.model) or put it in the checkpoint as tokenizer.model")
    if not os.path.isfile(path):
        raise ConfigError(f"MSTAR_PALIGEMMA_TOKENIZER is {path}, which is not a file")
    return SentencePieceTokenizer(path)


def resize_with_pad(image: torch.Tensor, size: int) -> torch.Tensor:
    """`[H, W, 3]` integers in 0..255 (or floats in [0, 1]) -> `[3, size, size]` in [-1, 1], aspect kept, padded
    with black. Integers of any dtype count as 0..255: JSON lists arrive as int64."""
    h, w = image.shape[:2]
    if (h, w) == (size, size):  # what openpi's clients send (they resize first): only scale, in place (~3x faster)
        x = torch.empty(3, size, size).copy_(image.permute(2, 0, 1))
        if not image.is_floating_point():
            x.div_(255.0)
        return x.clamp_(0, 1).mul_(2).sub_(1)
    # contiguous: the antialiased kernel is ~50x slower on the permuted view
    x = image.permute(2, 0, 1).float().contiguous()
    if not image.is_floating_point():
        x = x / 255.0
    scale = size / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    x = F.interpolate(x[None], size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)[0].clamp(0, 1)
    top, left = (size - nh) // 2, (size - nw) // 2
    out = torch.zeros(3, size, size)
    out[:, top:top + nh, left:left + nw] = x
    return out * 2 - 1


def _image(value: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() != 3 or t.shape[-1] != 3 or min(t.shape[:2]) < 1:
        raise RequestError(f"'{name}' must be an RGB image [H, W, 3], got shape {list(t.shape)}", param=name)
    if t.dtype == torch.bool or t.is_complex():
        raise RequestError(f"'{name}' must hold integers in 0..255 or floats in [0, 1], got {t.dtype}", param=name)
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise RequestError(f"'{name}' holds non-finite pixels (NaN or Inf); send floats in [0, 1]", param=name)
    return t


def _state(value: torch.Tensor, limit: int) -> np.ndarray:
    """The robot state exactly as openpi takes it: one non-empty 1-D vector of finite values."""
    if value.dim() != 1:
        raise RequestError(f"'state' must be a 1-D vector [n], got shape {list(value.shape)}", param="state")
    if value.shape[0] < 1:
        raise RequestError("'state' is empty; send the robot's state values", param="state")
    if value.shape[0] > limit:
        raise RequestError(f"'state' has {value.shape[0]} values; this policy takes at most {limit}", param="state")
    if value.dtype == torch.bool or value.is_complex():
        raise RequestError(f"'state' must hold real numbers, got {value.dtype}", param="state")
    state = value.double().numpy()
    if not np.isfinite(state).all():
        raise RequestError("'state' holds non-finite values (NaN or Inf)", param="state")
    return state


class Preparer:
    """`prepare(inputs) -> env` for one loaded policy."""

    def __init__(self, cfg: PolicyConfig, tokenizer: Any, stats: Mapping[str, Any] | None):
        if tokenizer.vocab_size > cfg.text.vocab_size:
            raise ConfigError(f"pi05: the tokenizer has {tokenizer.vocab_size} pieces but the language model's vocabulary "
                              f"is {cfg.text.vocab_size}; use the model's own (PaliGemma) tokenizer")
        self.cfg, self.tokenizer, self.stats = cfg, tokenizer, stats or {}
        self.schema = RequestSchema(
            fields=(
                RequestField("images", "array", f"1 to {MAX_CAMERAS} RGB camera images [H, W, 3]", required=True,
                             items="tensor", min_length=1, max_length=MAX_CAMERAS),
                RequestField("prompt", "string", "the task", required=True, max_length=512),
                RequestField("state", "tensor", f"robot state, at most {cfg.max_state_dim} values", required=True),
                RequestField("horizon", "integer", "actions to return", default=cfg.chunk_size, minimum=1,
                             maximum=cfg.chunk_size),
                RequestField("num_steps", "integer", "flow-matching Euler steps", default=cfg.num_inference_steps,
                             minimum=1, maximum=MAX_STEPS),
                RequestField("seed", "integer", "noise seed", default=0, minimum=0, maximum=2**63 - 1),
                RequestField("action_dim", "integer", "the robot's degrees of freedom (actions are sliced to it)",
                             default=cfg.max_action_dim, minimum=1, maximum=cfg.max_action_dim),
            ),
            example=EXAMPLE,
        )

    def _quantiles(self, key: str, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        entry = self.stats.get(key)
        if not entry or "q01" not in entry:
            return None
        q01, q99 = (np.asarray(entry[k], dtype=np.float64)[:n] for k in ("q01", "q99"))
        return q01, q99

    def normalize_state(self, state: np.ndarray) -> np.ndarray:
        q = self._quantiles("observation.state", state.shape[0])
        if q is not None:
            state = (state - q[0]) / np.maximum(q[1] - q[0], 1e-8) * 2.0 - 1.0
        return state

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        q = self._quantiles("action", actions.shape[-1])
        if q is None:
            return actions
        q01, q99 = (torch.as_tensor(v, dtype=actions.dtype) for v in q)
        return (actions + 1.0) / 2.0 * (q99 - q01) + q01

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        size = cfg.vision.image_size
        pixels = torch.stack([resize_with_pad(_image(im, f"images[{i}]"), size) for i, im in enumerate(inputs["images"])])
        if not inputs["prompt"].strip():
            raise RequestError("'prompt' is empty; send the task, e.g. 'pick up the cube'", param="prompt")
        state = _state(torch.as_tensor(inputs["state"]), cfg.max_state_dim)
        state = np.pad(self.normalize_state(state), (0, cfg.max_state_dim - state.shape[0]))
        ids = prompt_ids(self.tokenizer, inputs["prompt"], state if cfg.pi05 else None)[: cfg.tokenizer_max_length]
        if max(ids) >= cfg.text.vocab_size:
            raise RequestError("the prompt has tokens outside the model's vocabulary", param="prompt")
        n_image = pixels.shape[0] * cfg.vision.num_patches
        env = {
            "pixels": pixels,
            "prefix_ids": torch.tensor([0] * n_image + ids),
            "image_at": torch.arange(n_image),
            "num_steps": inputs["num_steps"],
            "latent_shape": [inputs["horizon"], cfg.max_action_dim],
            "seed": inputs["seed"],
            "action_dim": inputs["action_dim"],
        }
        if not cfg.pi05:  # the state token after the prefix, in the prefix's call: routed to the expert, its row
            n = env["prefix_ids"].shape[0]
            env["state_row"] = torch.tensor(state, dtype=torch.float32)[None]
            env["prefix_state_ids"] = F.pad(env["prefix_ids"], (0, 1))
            env["prefix_routing"] = torch.zeros(n + 1, dtype=torch.long)
            env["prefix_routing"][n] = 1
            env["prefix_state"] = F.pad(env["state_row"], (0, 0, n, 0))  # per token: zeros, then the state
            env["prefix_length"] = n
        return env
