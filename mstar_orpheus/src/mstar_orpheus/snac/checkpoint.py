"""SNAC checkpoints: `config.json` + `pytorch_model.bin` or `model.safetensors`, in the `snac` package's names.

Only the decode path is loaded; encoder weights and the quantizers' input projections are skipped.
Legacy weight-norm keys (`weight_g`, `weight_v`) are renamed to the parametrization's
`original0`/`original1`, which hold the same tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mstar_core.checkpoint.errors import CheckpointError
from mstar_orpheus.snac.config import SNACConfig
from mstar_orpheus.snac.model import SNACDecoder

_WN = ("parametrizations.weight.original0", "parametrizations.weight.original1")
_SKIPPED_PREFIXES = ("encoder.",)


class SNACCheckpointError(CheckpointError):
    """A SNAC checkpoint is missing files or has missing, unexpected or mis-shaped tensors."""


def _conv(ref: str, ours: str, bias: bool = True) -> dict[str, str]:
    names = {f"{ref}.{wn}": f"{ours}.{wn}" for wn in _WN}
    if bias:
        names[f"{ref}.bias"] = f"{ours}.bias"
    return names


def snac_name_map(cfg: SNACConfig) -> dict[str, str]:
    """Reference (`snac` package) tensor name -> this decoder's name, for every decode-path tensor."""
    names: dict[str, str] = {}
    for i in range(len(cfg.vq_strides)):
        ref, ours = f"quantizer.quantizers.{i}", f"quantizer.levels.{i}"
        names[f"{ref}.codebook.weight"] = f"{ours}.codebook.weight"
        names.update(_conv(f"{ref}.out_proj", f"{ours}.out_proj"))
    n = 0
    if cfg.depthwise:
        names.update(_conv("decoder.model.0", "decoder.input_depthwise"))
        n = 1
    names.update(_conv(f"decoder.model.{n}", "decoder.input_proj"))
    n += 1
    for b in range(len(cfg.decoder_rates)):
        ref, ours = f"decoder.model.{n + b}.block", f"decoder.blocks.{b}"
        names[f"{ref}.0.alpha"] = f"{ours}.act.alpha"
        names.update(_conv(f"{ref}.1", f"{ours}.upsample"))
        first_residual = 2
        if cfg.noise:
            names.update(_conv(f"{ref}.2.linear", f"{ours}.noise.proj", bias=False))
            first_residual = 3
        for r in range(3):
            rref, rours = f"{ref}.{first_residual + r}.block", f"{ours}.residuals.{r}"
            names[f"{rref}.0.alpha"] = f"{rours}.act1.alpha"
            names.update(_conv(f"{rref}.1", f"{rours}.conv"))
            names[f"{rref}.2.alpha"] = f"{rours}.act2.alpha"
            names.update(_conv(f"{rref}.3", f"{rours}.proj"))
    n += len(cfg.decoder_rates)
    names[f"decoder.model.{n}.alpha"] = "decoder.output_act.alpha"
    names.update(_conv(f"decoder.model.{n + 1}", "decoder.output_conv"))
    return names


def _skipped(name: str) -> bool:
    return name.startswith(_SKIPPED_PREFIXES) or (name.startswith("quantizer.quantizers.") and ".in_proj." in name)


def _modernise(name: str) -> str:
    if name.endswith(".weight_g"):
        return name[: -len("weight_g")] + _WN[0]
    if name.endswith(".weight_v"):
        return name[: -len("weight_v")] + _WN[1]
    return name


def read_snac_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """The raw tensors of a SNAC checkpoint dir (safetensors preferred; .bin read with weights_only=True)."""
    d = Path(directory)
    if (d / "model.safetensors").is_file():
        return load_file(str(d / "model.safetensors"))
    if (d / "pytorch_model.bin").is_file():
        state = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise SNACCheckpointError(f"{d / 'pytorch_model.bin'} does not hold a state dict")
        return state
    raise SNACCheckpointError(
        f"no SNAC weights in {d}: expected model.safetensors or pytorch_model.bin next to config.json"
    )


def map_snac_state(tensors: dict[str, torch.Tensor], cfg: SNACConfig) -> dict[str, torch.Tensor]:
    """Rename reference tensors to this decoder's names; fail listing missing/unexpected/mis-shaped ones."""
    names = snac_name_map(cfg)
    expected = {k: tuple(v.shape) for k, v in SNACDecoder(cfg).state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for raw_name, tensor in tensors.items():
        name = _modernise(raw_name)
        if _skipped(name):
            continue
        if name not in names:
            unexpected.append(raw_name)
            continue
        state[names[name]] = tensor
    inverse = {v: k for k, v in names.items()}
    missing = [inverse[k] for k in expected if k not in state]
    misshaped = [
        f"{inverse[k]} {tuple(state[k].shape)} (expected {shape})"
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {', '.join(misshaped)}")
    if problems:
        raise SNACCheckpointError("SNAC checkpoint does not match its config.json; " + "; ".join(problems))
    return state


def load_snac(directory: str | Path, device: str | torch.device = "cpu") -> SNACDecoder:
    """Load a SNAC checkpoint dir as an fp32 decoder with weight norm folded, ready for inference."""
    cfg = SNACConfig.from_file(Path(directory) / "config.json")
    model = SNACDecoder(cfg)
    state = map_snac_state(read_snac_tensors(directory), cfg)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.fold_weight_norm().to(device).eval()


def save_snac(model: SNACDecoder, directory: str | Path) -> None:
    """Write a decoder as `config.json` + `model.safetensors` in the reference names (for presets)."""
    import json

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    inverse = {v: k for k, v in snac_name_map(model.config).items()}
    tensors = {inverse[k]: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
