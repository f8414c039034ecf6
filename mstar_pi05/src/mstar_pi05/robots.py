"""The observation keys openpi's example robots send, mapped to this package's request fields.

`mstar_pi05.policy_ws` serves these on `/` (openpi's websocket policy protocol); `MSTAR_POLICY_MAPPING`
picks one by name or names a JSON file of the same shape, else each observation uses the first mapping
whose keys it carries.
"""

from __future__ import annotations

from typing import Any

from mstar_pi05.config import PolicyConfig

#: openpi's `examples/libero`: agent-view and wrist cameras, an 8-value state (eef pos, axis-angle, gripper), 7 DoF.
LIBERO = {"fields": {"images": ["observation/image", "observation/wrist_image"], "state": ["observation/state"],
                     "prompt": "prompt"},
          "fixed": {"action_dim": 7}}
#: openpi's `examples/droid`: one exterior and the wrist camera, 7 joints then the gripper as state, 8 DoF.
DROID = {"fields": {"images": ["observation/exterior_image_1_left", "observation/wrist_image_left"],
                    "state": ["observation/joint_position", "observation/gripper_position"], "prompt": "prompt"},
         "fixed": {"action_dim": 8}}


def policy_server(cfg: PolicyConfig) -> dict[str, Any]:
    """`LoadedModel.extras["policy_server"]`: the mappings and the metadata sent on connect."""
    return {"mappings": {"libero": LIBERO, "droid": DROID},
            "metadata": {"policy": cfg.type, "action_horizon": cfg.chunk_size, "max_action_dim": cfg.max_action_dim,
                         "num_inference_steps": cfg.num_inference_steps}}
