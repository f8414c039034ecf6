"""SNAC decoder fidelity against the `snac` package, and SNAC checkpoint loading."""

import pytest
import torch
from mstar_orpheus.snac import (
    SNACCheckpointError,
    SNACConfig,
    SNACDecoder,
    load_snac,
    map_snac_state,
    save_snac,
)

from tests.orpheus.helpers import TINY_SNAC


def _ours(reference) -> SNACDecoder:
    cfg = SNACConfig.from_dict(TINY_SNAC)
    model = SNACDecoder(cfg)
    model.load_state_dict(map_snac_state(reference.state_dict(), cfg), strict=True)
    return model.fold_weight_norm().eval()


def _codes(batch: int, frames: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, TINY_SNAC["codebook_size"], (batch, frames * n), generator=gen) for n in (1, 2, 4)]


@torch.no_grad()
def test_batch1_matches_reference(reference_snac):
    """Same weights; our per-window generator seeded s draws the same normals as the global RNG seeded s."""
    ours = _ours(reference_snac)
    codes = _codes(1, 4, torch.Generator().manual_seed(1))
    torch.manual_seed(123)
    expected = reference_snac.decode(codes)
    got = ours.decode(codes, seeds=[123])
    assert got.shape == expected.shape == (1, 1, 4 * 4 * 4)
    assert (got - expected).abs().max().item() <= 1e-5


@torch.no_grad()
def test_batched_windows_match_reference_run_separately(reference_snac):
    """Row i of a batched decode equals the reference decoding window i alone with its noise seed."""
    ours = _ours(reference_snac)
    codes = _codes(5, 4, torch.Generator().manual_seed(2))
    seeds = [7, 8, 9, 1000, 31337]
    got = ours.decode(codes, seeds=seeds)
    for i, seed in enumerate(seeds):
        torch.manual_seed(seed)
        expected = reference_snac.decode([c[i : i + 1] for c in codes])
        assert (got[i : i + 1] - expected).abs().max().item() <= 1e-5


@torch.no_grad()
def test_noise_is_used(reference_snac):
    """Different seeds give different audio, so the seeded comparisons above are not vacuous."""
    ours = _ours(reference_snac)
    codes = _codes(1, 4, torch.Generator().manual_seed(3))
    assert (ours.decode(codes, seeds=[1]) - ours.decode(codes, seeds=[2])).abs().max().item() > 1e-3


@torch.no_grad()
def test_legacy_bin_checkpoint_round_trip(tmp_path, reference_snac):
    """A `pytorch_model.bin` with legacy weight_g/weight_v keys loads and decodes like the reference."""
    import json

    legacy = {}
    for name, tensor in reference_snac.state_dict().items():
        name = name.replace("parametrizations.weight.original0", "weight_g")
        legacy[name.replace("parametrizations.weight.original1", "weight_v")] = tensor
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(TINY_SNAC))
    loaded = load_snac(tmp_path)
    codes = _codes(1, 4, torch.Generator().manual_seed(4))
    torch.manual_seed(11)
    expected = reference_snac.decode(codes)
    assert (loaded.decode(codes, seeds=[11]) - expected).abs().max().item() <= 1e-5


@torch.no_grad()
def test_safetensors_round_trip(tmp_path, reference_snac):
    ours = _ours(reference_snac)
    fresh = SNACDecoder(ours.config)
    fresh.load_state_dict(map_snac_state(reference_snac.state_dict(), ours.config))
    save_snac(fresh, tmp_path)
    loaded = load_snac(tmp_path)
    codes = _codes(2, 4, torch.Generator().manual_seed(5))
    assert torch.equal(loaded.decode(codes, seeds=[1, 2]), ours.decode(codes, seeds=[1, 2]))


def test_missing_tensor_is_named(tmp_path, reference_snac):
    import json

    state = dict(reference_snac.state_dict())
    del state["decoder.model.2.block.1.bias"]
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(TINY_SNAC))
    with pytest.raises(SNACCheckpointError, match=r"missing tensors: decoder\.model\.2\.block\.1\.bias"):
        load_snac(tmp_path)


def test_misshaped_and_unexpected_tensors_are_named(reference_snac):
    cfg = SNACConfig.from_dict(TINY_SNAC)
    state = dict(reference_snac.state_dict())
    state["decoder.model.0.bias"] = torch.zeros(3)
    state["decoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(SNACCheckpointError, match=r"unexpected tensors: decoder\.extra\.weight.*mis-shaped tensors: decoder\.model\.0\.bias"):
        map_snac_state(state, cfg)


@torch.no_grad()
def test_24khz_shaped_config_matches_reference():
    """The real codec's layout (hop 512, rates 8-8-4-2, 4096 codes, depthwise, noise) at narrow width."""
    snac = pytest.importorskip("snac")
    cfg = {**TINY_SNAC, "encoder_rates": [2, 4, 8, 8], "decoder_rates": [8, 8, 4, 2], "decoder_dim": 32,
           "codebook_size": 4096, "codebook_dim": 8}
    torch.manual_seed(1)
    ref = snac.SNAC(**cfg).eval()
    ours = SNACDecoder(SNACConfig.from_dict(cfg))
    ours.load_state_dict(map_snac_state(ref.state_dict(), ours.config), strict=True)
    ours.fold_weight_norm().eval()
    codes = [torch.randint(0, 4096, (2, 4 * n), generator=torch.Generator().manual_seed(6)) for n in (1, 2, 4)]
    got = ours.decode(codes, seeds=[21, 22])
    assert got.shape == (2, 1, 4 * 4 * 512)
    for i, seed in enumerate((21, 22)):
        torch.manual_seed(seed)
        expected = ref.decode([c[i : i + 1] for c in codes])
        assert (got[i : i + 1] - expected).abs().max().item() <= 1e-5


def test_unknown_config_key_is_named():
    from mstar_core.errors import ConfigError

    with pytest.raises(ConfigError, match="decoder_dims"):
        SNACConfig.from_dict({**TINY_SNAC, "decoder_dims": 3})


@pytest.mark.parametrize(("key", "value", "message"), [
    ("codebook_size", "4096", r"key 'codebook_size' must be an integer like 4096, got \"4096\""),
    ("decoder_rates", [8, "8"], r"key 'decoder_rates' must be a list of integers"),
    ("noise", "false", r"key 'noise' must be true or false, got \"false\""),
    ("decoder_dim", 0, r"key 'decoder_dim' must be a positive integer"),
])
def test_a_wrong_typed_config_key_names_the_file_and_the_key(tmp_path, key, value, message):
    import json
    import re

    from mstar_core.errors import ConfigError

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_SNAC, key: value}))
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ": " + message):
        SNACConfig.from_file(path)
