"""`ModelSpec`s `pi05` and `pi0`: a LeRobot checkpoint directory or the `tiny` preset -> `LoadedModel`."""

from __future__ import annotations

import json
from pathlib import Path

from mstar_core.errors import ConfigError
from mstar_core.model import LoadedModel, LoadOptions, ModelSpec
from mstar_pi05.checkpoint import ensure_tiny, load_policy
from mstar_pi05.graph import build_graph
from mstar_pi05.parallel import load_policy_tensor_parallel
from mstar_pi05.prepare import EXAMPLE, Preparer, tokenizer_for
from mstar_pi05.robots import policy_server

PRESETS = ("tiny",)
STATS_FILES = ("stats.json", "norm_stats.json")
#: One pool (the expert reads the VLM's pages): 1024 pages of 16 hold 16 robots' ~968-token pi0.5 prefixes, so eight
#: robots at once never preempt (a preempted prefix is recomputed). Budgets large enough that the prefixes of robots
#: arriving together share one forward, and every robot's expert step then runs in one batch.
ENGINE_SETTINGS = {"vlm": {"num_pages": 1024, "page_size": 16, "max_num_batched_tokens": 8192},
                   "expert": {"num_pages": 1024, "page_size": 16, "max_num_batched_tokens": 4096}}


def _stats(directory: Path) -> dict | None:
    for name in STATS_FILES:
        if (directory / name).is_file():
            data = json.loads((directory / name).read_text())
            return data.get("norm_stats", data)
    return None


def _loader(kind: str):
    def load(options: LoadOptions) -> LoadedModel:
        preset = options.preset_or_checkpoint(kind, PRESETS)
        directory = Path(ensure_tiny(kind) if preset else options.checkpoint)
        group = options.tensor_parallel  # (the rank group, if any)
        if group is not None and group.world_size > 1 and options.device != "meta":
            # this rank's heads of both decoders, read from the checkpoint's slices
            policy = load_policy_tensor_parallel(directory, group, dtype=options.torch_dtype(kind),
                                                 device=options.device, module=f"{kind} (vlm + expert)")
        else:
            policy = load_policy(directory, device=options.device, dtype=options.torch_dtype(kind))
        if policy.config.type != kind:
            raise ConfigError(f"{kind}: {directory}/config.json has type {policy.config.type!r}; "
                              f"serve it as model '{policy.config.type}'")
        prepare = Preparer(policy.config, tokenizer_for(str(directory), preset is not None, policy.config.raw), _stats(directory))
        return LoadedModel(
            name=kind,
            graph=build_graph(policy, prepare.unnormalize_actions, kind),
            random_weights=preset is not None,
            prepare=prepare,
            request_schema=prepare.schema,
            engine_settings=ENGINE_SETTINGS,
            extras={"policy": policy, "config": policy.config, "checkpoint": str(directory),
                    "policy_server": policy_server(policy.config)},
        )

    return load


SPECS = (
    ModelSpec(name="pi05", load=_loader("pi05"), presets=PRESETS, example=EXAMPLE,
              description="pi0.5 VLA: SigLIP + PaliGemma prefix cached once, adaRMS Gemma action expert, 10 Euler steps"),
    ModelSpec(name="pi0", load=_loader("pi0"), presets=PRESETS, example=EXAMPLE,
              description="pi0 VLA: as pi05 with a continuous state token and the action-time MLP"),
)
