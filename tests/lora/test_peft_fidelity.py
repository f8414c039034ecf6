"""LoRA arithmetic against peft: the same tiny random Llama and adapters, merged by peft, run by transformers."""

from __future__ import annotations

import attrs
import pytest
import torch

from mstar_core.nn import DenseAttention, LlamaForCausalLM, load_llama
from mstar_core.nn.lora import LoraBank, read_peft_adapter
from tests.lora.peft_fixtures import make_adapter, make_base, merged_logits

pytest.importorskip("peft")
pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max abs logit difference allowed against peft's merged weights


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_base(root / "base")
    adapters = {
        # o/gate/up/down besides q and v: the fused gate_up takes both parts, qkv only q and v of its three
        "a1": make_adapter(base, root / "a1", seed=1),
        # all of qkv (three parts side by side in one rank block each), rsLoRA's scale, a rank of 8
        "a2": make_adapter(base, root / "a2", seed=2, r=8, targets=("q_proj", "k_proj", "v_proj", "down_proj"),
                           rslora=True),
    }
    ours = load_llama(root / "base", progress=False)
    # (plain linears here; the engine tests run the packed ones it serves with)
    bank = LoraBank(ours, max_loras=3, max_rank=8)
    slots = {name: bank.load(read_peft_adapter(name, root / name, max_rank=8)) for name in adapters}
    return base, adapters, ours, bank, slots


def _logits(model, bank, ids, runs, mask=None):
    bank.set_rows(runs)
    try:
        with torch.inference_mode():
            positions = torch.cat([torch.arange(n) for _, n in runs]) if mask is not None else torch.arange(len(ids))
            return model.compute_logits(model(ids, positions, DenseAttention(mask=mask)))
    finally:
        bank.clear_rows()


@pytest.mark.parametrize("name", ["a1", "a2"])
def test_adapter_matches_peft_merged(models, name):
    base, adapters, ours, bank, slots = models
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(3))
    got = _logits(ours, bank, ids, [(slots[name], 23)])
    want = merged_logits(adapters[name], ids)
    with torch.no_grad():
        plain = base(input_ids=ids[None]).logits[0]
    assert (want - plain).abs().max() > 0.05  # the adapter really changes the logits...
    assert (got - want).abs().max().item() <= TOLERANCE  # ...and M* changes them as peft's merge does


def test_rows_of_two_adapters_and_none_in_one_forward(models):
    """Three packed sequences (a1, base, a2; then a2's rows split around base's) equal each run alone."""
    base, adapters, ours, bank, slots = models
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in (7, 5, 9)]
    which = [slots["a1"], None, slots["a2"]]
    alone = [_logits(ours, bank, s, [(w, len(s))]) for s, w in zip(seqs, which, strict=True)]
    for order in ([0, 1, 2], [2, 1, 0, ]):
        ids = torch.cat([seqs[i] for i in order])
        owner = torch.cat([torch.full((len(seqs[i]),), k) for k, i in enumerate(order)])
        mask = (owner[:, None] == owner[None, :]) & torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        mixed = _logits(ours, bank, ids, [(which[i], len(seqs[i])) for i in order], mask)
        row = 0
        for i in order:
            n = len(seqs[i])
            assert (mixed[row : row + n] - alone[i]).abs().max().item() <= 1e-5
            row += n
    # the same adapter in two runs apart (a gathered group, not a slice)
    ids = torch.cat([seqs[2], seqs[1], seqs[2]])
    owner = torch.cat([torch.full((9,), 0), torch.full((5,), 1), torch.full((9,), 2)])
    mask = (owner[:, None] == owner[None, :]) & torch.ones(23, 23, dtype=torch.bool).tril()
    mixed = _logits(ours, bank, ids, [(slots["a2"], 9), (None, 5), (slots["a2"], 9)], mask)
    assert (mixed[:9] - alone[2]).abs().max().item() <= 1e-5
    assert (mixed[14:] - alone[2]).abs().max().item() <= 1e-5
    assert (mixed[9:14] - alone[1]).abs().max().item() <= 1e-5


def test_unload_frees_the_slot_and_the_hooks(models, tmp_path):
    base, adapters, ours, bank, slots = models
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = base(input_ids=ids[None]).logits[0]
    extra = make_adapter(base, tmp_path / "a3", seed=3, r=2, targets=("o_proj",))
    slot = bank.load(read_peft_adapter("a3", tmp_path / "a3"))
    assert (_logits(ours, bank, ids, [(slot, 11)]) - merged_logits(extra, ids)).abs().max() <= TOLERANCE
    with pytest.raises(Exception, match="all 3 LoRA slots are taken"):
        bank.load(read_peft_adapter("again", tmp_path / "a3"))
    bank.unload(slot)
    assert bank.slots[slot] is None
    # the o_proj layers only a3 targeted carry no hook any more, and the slot adds nothing
    assert all(layer.handle is None for layer in bank.layers if layer.linear.out_features == 64
               and not any(any(row) for row in layer.cols))
    assert (_logits(ours, bank, ids, [(slot, 11)]) - plain).abs().max() <= TOLERANCE
    again = bank.load(read_peft_adapter("a3", tmp_path / "a3"))
    assert again == slot
    bank.unload(again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_torch_ops(models, dtype):
    """lora.cpp (one call per linear, every slot) against the per-slot torch ops it replaces, mixed rows."""
    base, adapters, ours, bank, slots = models
    if not bank.native:
        pytest.skip("lora.cpp is not built here")
    model = LlamaForCausalLM(ours.config)  # (a fresh copy: `ours` carries the other bank's hooks)
    model.load_state_dict(ours.state_dict())
    model.to(dtype).eval()
    other = LoraBank(model, max_loras=3, max_rank=8)
    for name in ("a1", "a2"):
        other.load(attrs.evolve(bank.slots[slots[name]]))
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 256, (19,), generator=gen)
    runs = [(0, 5), (None, 3), (1, 6), (0, 5)]
    owner = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(runs)])
    mask = (owner[:, None] == owner[None, :]) & torch.ones(19, 19, dtype=torch.bool).tril()
    kernel = _logits(model, other, ids, runs, mask)
    other.native = False
    torch_ops = _logits(model, other, ids, runs, mask)
    other.close()
    tolerance = 1e-5 if dtype == torch.float32 else 0.1  # (bf16: sums in another order, roundings at other places)
    assert (kernel.float() - torch_ops.float()).abs().max().item() <= tolerance
