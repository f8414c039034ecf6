"""Expert and tensor parallelism for every kvcache family built from the shared layers, on CPU over 2 gloo ranks.

An MoE layer at EP=2 (and with TP inside the experts) equals EP=1; the Qwen3-Omni Thinker (EP and TP MoE)
and Talker, BAGEL's MoT LLM, the pi0.5 VLM + action expert (with 2 KV heads, and with the preset's single KV
head, which each rank then keeps whole) and the Orpheus LM at TP=2 give TP=1's logits and greedy tokens. Each
rank reads only its slices of the checkpoint files and holds 1/2 of every split weight plus what is replicated.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar_core.errors import ConfigError
from mstar_core.nn.parallel import TensorParallelGroup, shard_layers

sys.path.insert(0, str(Path(__file__).parent))
from _tp_families import MOE_SIZES, SAME_FAMILY, WHOLE, MoEBlock, load_full, outputs

WORLD = 2
RANK_SCRIPT = Path(__file__).with_name("_tp_family_rank.py")
# (job name, family, expert_parallel)
JOBS = [("moe_ep", "moe", True), ("moe_tp", "moe", False), ("moe_shared_ep", "moe_shared", True),
        ("moe_shared_tp", "moe_shared", False), ("moe_dense_ep", "moe_dense", True),
        ("thinker_ep", "thinker", True), ("thinker_tp", "thinker", False), ("talker_ep", "talker", True),
        ("talker_tp", "talker", False), ("bagel", "bagel", False), ("pi05", "pi05", False),
        ("pi05_mqa", "pi05_mqa", False),
        ("orpheus", "orpheus", False), ("omni_ep", "omni", True), ("bagel_whole", "bagel_whole", False)]
LM_JOBS = [name for name, kind, _ in JOBS if kind not in MOE_SIZES]


def write_moe(directory: Path, kind: str) -> Path:
    from mstar_qwen_omni.checkpoint import expert_layout

    directory.mkdir()
    torch.manual_seed(3)
    block = MoEBlock(**MOE_SIZES[kind])
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    save_file({k: v.contiguous() for k, v in expert_layout(block.state_dict()).items()},
              str(directory / "model.safetensors"))
    return directory


#: jobs whose ranks each keep every KV head (fewer KV heads than ranks: replicated, as vLLM does)
KV_REPLICATED = {"pi05_mqa"}


def write_pi05(directory: Path, kv_heads: int | None = 2) -> Path:
    """pi0.5 at tiny sizes with 2 KV heads (split over the ranks), or (None) the preset's single KV head."""
    from mstar_pi05.checkpoint import tiny_config
    from mstar_pi05.config import PolicyConfig
    from mstar_pi05.modeling import Policy

    from mstar_core.checkpoint import save_hf_checkpoint

    config = copy.deepcopy(tiny_config("pi05"))  # (its sizes are the preset module's own dicts)
    for part in ("text", "expert") if kv_heads is not None else ():
        config["mstar_sizes"][part]["num_key_value_heads"] = kv_heads
    torch.manual_seed(4)
    policy = Policy(PolicyConfig.from_dict(config))
    with torch.no_grad():
        for p in policy.parameters():
            p.normal_(0.0, 0.1)
    save_hf_checkpoint(policy, directory, config)
    return directory


def write_checkpoints(root: Path, kinds: set[str]) -> dict[str, Path]:
    """A checkpoint per family in `kinds` (the Thinker and the Talker share one)."""
    from mstar_bagel.checkpoint import write_tiny as write_bagel
    from mstar_orpheus.preset import write_tiny as write_orpheus
    from mstar_qwen_omni.preset import write_tiny as write_omni

    paths = {kind: write_moe(root / kind, kind) for kind in MOE_SIZES if kind in kinds}
    writers = {"thinker": write_omni, "bagel": write_bagel, "pi05": write_pi05, "orpheus": write_orpheus,
               "pi05_mqa": lambda directory: write_pi05(directory, kv_heads=None)}
    for kind, write in writers.items():
        if kind in kinds or (kind == "thinker" and "talker" in kinds):
            (root / kind).mkdir()
            paths[kind] = write(root / kind)
    if "thinker" in paths:
        paths["talker"] = paths["thinker"]
    return paths


def run_jobs(root: Path, jobs: list[tuple[str, str, bool]]) -> dict:
    """Write the checkpoints `jobs` need, run 2 gloo ranks once over them; per job: (TP=1 module, TP=1 outputs,
    ranks' outputs, family, checkpoint, expert_parallel)."""
    kinds = {WHOLE.get(kind, kind) for _, kind, _ in jobs}
    paths = write_checkpoints(root, kinds)
    paths.update({whole: paths[part] for whole, part in WHOLE.items() if part in paths})
    g = torch.Generator().manual_seed(5)
    inputs = {"ids": torch.randint(0, 300, (16,), generator=g), "rows": torch.randn(16, 32, generator=g),
              "actions": torch.randn(5, 32, generator=g)}
    save_file(inputs, str(root / "inputs.safetensors"))
    spec = [{"name": name, "kind": kind, "checkpoint": str(paths[kind]), "expert_parallel": ep} for name, kind, ep in jobs]
    (root / "jobs.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(rank), str(WORLD), str(root)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(WORLD)]
    full = {}
    for kind in sorted(kinds):  # TP=1 meanwhile, in this process
        model = load_full(kind, paths[kind])
        full[kind] = (model, outputs(kind, model, inputs))
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {rank} did not finish in 240 s")
        assert proc.returncode == 0, f"rank {rank} failed:\n{output}"
    ranks = {name: [load_file(str(root / f"{name}.rank{r}.safetensors")) for r in range(WORLD)] for name, _, _ in jobs}
    return {name: (*full[WHOLE.get(kind, kind)], ranks[name], WHOLE.get(kind, kind), paths[kind], ep)
            for name, kind, ep in jobs}


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    return run_jobs(tmp_path_factory.mktemp("tp_moe"), [job for job in JOBS if job[1] in MOE_SIZES])


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    """The model families (tens of seconds on 2 busy cores: marked slow where used)."""
    return run_jobs(tmp_path_factory.mktemp("tp_models"), [job for job in JOBS if job[1] not in MOE_SIZES])


@pytest.fixture
def runs(request):
    """The run holding job `name` (the test's parameter)."""
    name = request.node.callspec.params["name"]
    kind = next(kind for job, kind, _ in JOBS if job == name)
    return request.getfixturevalue("moe_runs" if kind in MOE_SIZES else "family_runs")


@pytest.mark.parametrize("name", [name for name, kind, _ in JOBS if kind in MOE_SIZES])
def test_moe_layer_split_equals_unsplit(runs, name):
    _, want, ranks, *_ = runs[name]
    for rank, out in enumerate(ranks):
        err = (out["logits"] - want["logits"]).abs().max().item()
        assert err <= 1e-5, f"{name} rank {rank}: max abs diff {err} vs EP=1"


@pytest.mark.slow
@pytest.mark.parametrize("name", LM_JOBS)
def test_tp2_logits_and_greedy_tokens_equal_tp1(runs, name):
    _, want, ranks, *_ = runs[name]
    for rank, out in enumerate(ranks):
        assert out["tokens"].tolist() == want["tokens"].tolist(), f"{name} rank {rank}: greedy tokens differ"
        # each rank's cache holds keys and values of its half of the KV heads only (all of them where replicated)
        share = 1 if name in KV_REPLICATED else WORLD
        assert int(out["kv_bytes"]) * share == int(want["kv_bytes"]) > 0, f"{name} rank {rank}: KV bytes"
        for key in want:
            if key not in ("tokens", "kv_bytes"):
                got, ref = out[key], want[key]
                finite = ref.isfinite()  # (the Talker's suppressed codes are -inf on both sides)
                assert torch.equal(got.isfinite(), finite), f"{name} rank {rank} {key}: -inf at other places"
                err = (got[finite] - ref[finite]).abs().max().item()
                assert err <= 1e-4, f"{name} rank {rank} {key}: max abs diff {err} vs TP=1"


def _meta_shard(kind: str, path: Path, rank: int, expert_parallel: bool) -> dict:
    """Rank `rank`'s plan, built on meta without any collective (sizes only)."""
    from mstar_core.checkpoint import read_config
    from mstar_core.checkpoint.meta import on_meta

    group = TensorParallelGroup(rank, WORLD)
    with on_meta():
        if kind in MOE_SIZES:
            module = MoEBlock(**MOE_SIZES[kind])
            return shard_layers(module, group, module=kind, split=("mlp",), expert_parallel=expert_parallel)
        if kind in ("thinker", "talker"):
            from mstar_qwen_omni.config import OmniConfig
            from mstar_qwen_omni.parallel import shard_talker, shard_thinker
            from mstar_qwen_omni.talker import Talker
            from mstar_qwen_omni.thinker import Thinker

            cfg = OmniConfig.from_hf(read_config(path))
            if kind == "thinker":
                return shard_thinker(Thinker(cfg.thinker), group, expert_parallel=expert_parallel)
            return shard_talker(Talker(cfg.talker), group, expert_parallel=expert_parallel)
        if kind == "bagel":
            from mstar_bagel.checkpoint import EMA, table_sides
            from mstar_bagel.config import BagelConfig

            from mstar_core.nn.parallel.mot import shard_mot
            from mstar_core.nn.qwen2_mot import MoTForCausalLM

            cfg = BagelConfig.from_dir(path, table_sides(path / EMA))
            return shard_mot(MoTForCausalLM(cfg.llm), group)
        if SAME_FAMILY.get(kind, kind) == "pi05":
            from mstar_pi05.config import PolicyConfig
            from mstar_pi05.modeling import Policy
            from mstar_pi05.parallel import shard_policy

            return shard_policy(Policy(PolicyConfig.from_dict(read_config(path))), group)
        from mstar_core.nn import LlamaConfig, LlamaForCausalLM
        from mstar_core.nn.parallel import shard_llama

        model = LlamaForCausalLM(LlamaConfig.from_hf(read_config(path)))
        return shard_llama(model, group)


@pytest.mark.parametrize("name", [name if kind in MOE_SIZES else pytest.param(name, marks=pytest.mark.slow)
                                  for name, kind, _ in JOBS])
def test_rank_holds_half_the_split_weights_plus_the_replicated_and_reads_only_that(runs, name):
    model, _, ranks, kind, path, ep = runs[name]
    full = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    plan = _meta_shard(kind, path, 0, ep)
    whole = {n for n, entry in plan.items() if isinstance(entry, list) and all(p.dim is None for p in entry)}
    replicated = sum(full[n] for n in whole)
    if name in KV_REPLICATED:  # the k and v rows of each fused q/k/v: every rank reads and keeps them whole
        shapes = dict(model.named_parameters())
        for n, entry in plan.items():
            if n.endswith("qkv_proj.weight") or n.endswith("qkv_proj.bias"):
                rows = sum(p.stop - p.start for p in entry[1:])  # (q, k, v pieces)
                param = shapes[n]
                replicated += rows * (param.shape[1] if param.dim() == 2 else 1) * param.element_size()
    total = sum(full.values())
    assert whole < set(full), f"{name}: every parameter replicated"
    for rank, out in enumerate(ranks):
        held = int(out["param_bytes"])
        assert held == replicated + (total - replicated) // WORLD, f"{name} rank {rank}: {held} of {total} bytes"
        # what it read from the mapped files is what it holds: no rank materialises the full weights
        assert int(out["bytes_read"]) == held, f"{name} rank {rank}: read {int(out['bytes_read'])}, holds {held}"


@pytest.mark.slow
def test_sizes_that_do_not_divide_name_the_node_dimension_and_working_sizes(family_runs):
    thinker_path = family_runs["thinker_ep"][4]
    from mstar_qwen_omni.config import OmniConfig
    from mstar_qwen_omni.parallel import shard_thinker
    from mstar_qwen_omni.thinker import Thinker

    from mstar_core.checkpoint import read_config
    from mstar_core.checkpoint.meta import on_meta

    cfg = OmniConfig.from_hf(read_config(thinker_path))
    # 4 ranks over 2 KV heads: each keeps the head its query heads read (rank 3: head 1), replicated as vLLM does
    with on_meta():
        thinker = Thinker(cfg.thinker)
        plan = shard_thinker(thinker, TensorParallelGroup(3, 4), expert_parallel=True)
    attention = [m for m in thinker.modules() if type(m).__name__ == "GroupedQueryAttention"]
    assert attention and all((a.num_heads, a.num_kv_heads) == (1, 1) for a in attention)
    qkv = next(entry for name, entry in plan.items() if name.endswith("self_attn.qkv_proj.weight"))
    d = attention[0].head_dim
    assert [(p.start, p.stop) for p in qkv] == [(3 * d, 4 * d), (d, 2 * d), (d, 2 * d)]
    with on_meta(), pytest.raises(ConfigError) as err:
        shard_thinker(Thinker(cfg.thinker), TensorParallelGroup(0, 3))
    assert "thinker: tensor_parallel 3 does not divide num_attention_heads" in str(err.value)
    assert "[1, 2, 4]" in str(err.value)  # 4 ranks work now (the KV heads replicated)
    with on_meta(), pytest.raises(ConfigError, match=r"moe: tensor_parallel 3 does not divide num_experts \(8\)"):
        shard_layers(MoEBlock(shared=None, hidden=32), TensorParallelGroup(0, 3), module="moe", split=("mlp",),
                     expert_parallel=True)


def test_pi05_preset_single_kv_head_is_replicated_on_every_rank():
    """PaliGemma's one KV head (and the action expert's) at TP=2: each rank keeps it and half the query heads (the
    logits and velocities equal TP=1's: job `pi05_mqa`); a size that divides no dimension is still named."""
    from mstar_pi05.checkpoint import tiny_config
    from mstar_pi05.config import PolicyConfig
    from mstar_pi05.modeling import Policy
    from mstar_pi05.parallel import shard_policy
    from mstar_pi05.split import ACTION_EXPERT, LANGUAGE_MODEL

    from mstar_core.checkpoint.meta import on_meta

    config = tiny_config("pi05")
    assert {config["mstar_sizes"][p]["num_key_value_heads"] for p in ("text", "expert")} == {1}
    for rank in range(2):
        with on_meta():
            policy = Policy(PolicyConfig.from_dict(config))
            plan = shard_policy(policy, TensorParallelGroup(rank, 2))
        decoders = {name: m for name, m in policy.named_modules()
                    if name.startswith((LANGUAGE_MODEL, ACTION_EXPERT)) and type(m).__name__ == "GroupedQueryAttention"}
        assert decoders and all(a.num_kv_heads == 1 for a in decoders.values())
        for name, attn in decoders.items():
            pieces = plan[f"{name}.qkv_proj.weight"]
            d = attn.head_dim
            assert [(p.start, p.stop) for p in pieces[1:]] == [(0, d), (0, d)], name  # the whole KV head
            assert (pieces[0].start, pieces[0].stop) == (rank * attn.num_heads * d, (rank + 1) * attn.num_heads * d)
    with on_meta(), pytest.raises(ConfigError) as err:
        shard_policy(Policy(PolicyConfig.from_dict(config)), TensorParallelGroup(0, 3))
    assert "vlm: tensor_parallel 3 does not divide" in str(err.value)
    assert str(err.value).endswith("[1, 2, 4, 8]")  # up to 8 ranks, the one KV head on each


def test_a_module_without_splittable_layers_is_a_config_error_naming_it():
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    with pytest.raises(ConfigError, match=r"code2wav: Sequential cannot be split for tensor_parallel 2"):
        shard_layers(module, TensorParallelGroup(0, 2), module="code2wav")
