"""The model families the tensor-parallel tests split: how each loads (whole or as one rank's shard) and what it outputs.

Imported by the test (TP=1, in process) and by `_tp_family_rank.py` (each gloo rank), so both run the very
same forward on the same inputs: logits of a prompt, then greedy tokens over a few cached decode steps.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mstar_core.nn import DenseAttention, DenseKVCache
from mstar_core.nn.moe import TopKMoE
from mstar_core.nn.parallel import SafetensorsSlices, TensorParallelGroup, fill_from_plan, shard_layers

STEPS = 4  # greedy decode steps after the prompt
PROMPT = 9


class MoEBlock(nn.Module):
    """One MoE layer under the checkpoint prefix `mlp.` (experts stored one module per expert)."""

    def __init__(self, shared: int | None, hidden: int = 32, intermediate: int = 16):
        super().__init__()
        self.mlp = TopKMoE(hidden, intermediate, num_experts=8, top_k=2, norm_topk_prob=shared is None,
                           shared_intermediate=shared)


#: families loaded through the whole model's tensor-parallel loader, compared with the part they hold
WHOLE = {"omni": "thinker", "bagel_whole": "bagel"}
#: jobs of a family on a checkpoint of their own: pi0.5 with the preset's single KV head (replicated on each rank)
SAME_FAMILY = {"pi05_mqa": "pi05"}
MOE_SIZES = {"moe": dict(shared=None), "moe_shared": dict(shared=24), "moe_dense": dict(shared=None, intermediate=6)}


def load_full(kind: str, path: Path) -> nn.Module:
    """The unsplit module, loaded by the family's own loader."""
    kind = SAME_FAMILY.get(kind, kind)
    if kind in MOE_SIZES:
        from mstar_qwen_omni.checkpoint import expert_layout
        from safetensors.torch import load_file

        block = MoEBlock(**MOE_SIZES[kind])
        state = load_file(str(path / "model.safetensors"))
        fused = {k: v for k, v in block.state_dict().items()}
        for name in fused:  # fuse the per-expert tensors back, as the checkpoint loader does
            if name.endswith("experts.gate_up_proj"):
                e = fused[name].shape[0]
                fused[name] = torch.stack([torch.cat([state[f"mlp.experts.{i}.gate_proj.weight"],
                                                      state[f"mlp.experts.{i}.up_proj.weight"]]) for i in range(e)])
            elif name.endswith("experts.down_proj"):
                fused[name] = torch.stack([state[f"mlp.experts.{i}.down_proj.weight"]
                                           for i in range(fused[name].shape[0])])
            else:
                fused[name] = state[name]
        assert set(expert_layout(fused)) == set(state)
        block.load_state_dict(fused)
        return block.eval()
    if kind in ("thinker", "talker"):
        from mstar_qwen_omni.checkpoint import load_omni

        omni = load_omni(path, progress=False)
        return getattr(omni, kind)
    if kind == "bagel":
        from mstar_bagel.checkpoint import load_bagel

        return load_bagel(path, progress=False)[0].language_model
    if kind == "pi05":
        from mstar_pi05.checkpoint import load_policy

        return load_policy(path, progress=False)
    if kind == "orpheus":
        from mstar_core.nn import load_llama

        return load_llama(path, progress=False)
    raise ValueError(kind)


def load_shard(kind: str, path: Path, group: TensorParallelGroup, expert_parallel: bool) -> tuple[nn.Module, int]:
    """This rank's module, read from the checkpoint's slices; and how many bytes it read from the files."""
    from mstar_core.checkpoint.meta import on_meta

    kind = SAME_FAMILY.get(kind, kind)

    if kind in MOE_SIZES:
        with on_meta():
            block = MoEBlock(**MOE_SIZES[kind])
        plan = shard_layers(block, group, module=kind, split=("mlp",), expert_parallel=expert_parallel)
        with SafetensorsSlices(path) as source:
            fill_from_plan(block, plan, source)
            return block.eval(), source.bytes_read
    reads: list[int] = []
    original = SafetensorsSlices.close

    def counting_close(self):  # the family loaders open and close their own source: count what it read
        reads.append(self.bytes_read)
        original(self)

    SafetensorsSlices.close = counting_close
    try:
        if kind == "omni":  # the model spec's path: a rank hosting the Thinker, EP from the group itself
            import attrs
            from mstar_qwen_omni.parallel import load_omni_tensor_parallel

            from mstar_core.model import LoadOptions

            group = attrs.evolve(group, expert_parallel=expert_parallel)
            omni = load_omni_tensor_parallel(path, group, LoadOptions(checkpoint=str(path), nodes=("thinker",)))
            assert omni.talker.codec_head.weight.is_meta  # another process's node: nothing read
            model = omni.thinker
        elif kind == "bagel_whole":
            from mstar_bagel.parallel import load_bagel_tensor_parallel

            model = load_bagel_tensor_parallel(path, group)[0].language_model
        elif kind in ("thinker", "talker"):
            from mstar_qwen_omni.parallel import load_part_tensor_parallel

            model = load_part_tensor_parallel(path, kind, group, expert_parallel=expert_parallel)
        elif kind == "bagel":
            from mstar_bagel.parallel import load_bagel_llm_tensor_parallel

            model = load_bagel_llm_tensor_parallel(path, group)
        elif kind == "pi05":
            from mstar_pi05.parallel import load_policy_tensor_parallel

            model = load_policy_tensor_parallel(path, group)
        elif kind == "orpheus":
            from mstar_core.nn.parallel import load_llama_tensor_parallel

            model = load_llama_tensor_parallel(path, group)
        else:
            raise ValueError(kind)
    finally:
        SafetensorsSlices.close = original
    return model, sum(reads)


def _greedy(step, embed, logits_of, prompt_rows: torch.Tensor, cache: DenseKVCache) -> tuple[torch.Tensor, list[int]]:
    """Prompt logits `[T, V]`, then STEPS greedy tokens fed back one at a time through the same cache
    (`cache.nbytes()` afterwards: the keys and values this rank holds)."""
    positions = torch.arange(prompt_rows.shape[0])
    logits = logits_of(step(prompt_rows, positions, cache))
    tokens = [int(logits[-1].argmax())]
    for i in range(STEPS - 1):
        pos = torch.tensor([prompt_rows.shape[0] + i])
        tokens.append(int(logits_of(step(embed(torch.tensor([tokens[-1]])), pos, cache))[-1].argmax()))
    return logits, tokens


@torch.inference_mode()
def outputs(kind: str, model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the tests compare between TP=1 and each rank: `logits` (or hidden rows) and greedy `tokens`."""
    kind = SAME_FAMILY.get(kind, kind)
    ids = inputs["ids"][:PROMPT]
    if kind in MOE_SIZES:
        return {"logits": model.mlp(inputs["rows"])}
    if kind == "talker":  # input_embeds only; the next step embeds its code through codec_embedding
        rows = inputs["rows"][:PROMPT]
        logits, tokens = _greedy(lambda x, p, c: model(None, p, c, input_embeds=x), model.embed,
                                 model.compute_logits, rows, cache := DenseKVCache())
        return {"logits": logits, "tokens": torch.tensor(tokens), "kv_bytes": torch.tensor([cache.nbytes()])}
    if kind == "bagel":  # a mixed und/gen prompt: both experts' rows in one attention, then und-only decoding
        routing = torch.zeros(PROMPT, dtype=torch.long)
        routing[2:6] = 1
        hidden = model(ids, torch.arange(PROMPT), DenseAttention(), routing=routing)
        logits, tokens = _greedy(lambda x, p, c: model(None, p, c, input_embeds=x), model.embed,
                                 model.compute_logits, model.embed(ids), cache := DenseKVCache())
        return {"logits": logits, "tokens": torch.tensor(tokens), "mixed_hidden": hidden,
                "kv_bytes": torch.tensor([cache.nbytes()])}
    if kind == "pi05":  # the language model's tied logits; the action expert's velocity rows (adaRMS on time)
        from mstar_pi05.modeling import ActionExpert

        lm = model.language_model
        logits, tokens = _greedy(lambda x, p, c: lm(None, p, c, input_embeds=x), lm.embed, lm.compute_logits,
                                 lm.embed(ids), cache := DenseKVCache())
        expert = ActionExpert(model)
        actions = inputs["actions"]
        hidden = expert(None, torch.arange(actions.shape[0]), DenseAttention(), input_embeds=actions,
                        timestep=torch.tensor([0.3]))
        return {"logits": logits, "tokens": torch.tensor(tokens), "velocity": expert.compute_velocity(hidden),
                "kv_bytes": torch.tensor([cache.nbytes()])}
    embed = model.embed
    logits, tokens = _greedy(lambda x, p, c: model(None, p, c, input_embeds=x), embed, model.compute_logits,
                             embed(ids), cache := DenseKVCache())
    return {"logits": logits, "tokens": torch.tensor(tokens), "kv_bytes": torch.tensor([cache.nbytes()])}
