"""End-effector poses `[x, y, z, roll, pitch, yaw, gripper]`: integrate actions, and derive actions from poses.

Angles are extrinsic "xyz" Euler angles (R = Rz @ Ry @ Rx), as upstream's scipy calls use; an action's rotation
is applied on the left (R_new = R_action @ R_pose) and the gripper is clipped to [0, 1].
"""

from __future__ import annotations

import torch


def euler_to_matrix(angles: torch.Tensor) -> torch.Tensor:
    """`[..., 3]` extrinsic xyz angles -> `[..., 3, 3]` rotation matrices."""
    cx, cy, cz = angles.cos().unbind(-1)
    sx, sy, sz = angles.sin().unbind(-1)
    rows = [
        [cz * cy, cz * sy * sx - sz * cx, cz * sy * cx + sz * sx],
        [sz * cy, sz * sy * sx + cz * cx, sz * sy * cx - cz * sx],
        [-sy, cy * sx, cy * cx],
    ]
    return torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)


def matrix_to_euler(m: torch.Tensor) -> torch.Tensor:
    """`[..., 3, 3]` rotation matrices -> extrinsic xyz angles (pitch in [-pi/2, pi/2])."""
    pitch = torch.asin((-m[..., 2, 0]).clamp(-1.0, 1.0))
    roll = torch.atan2(m[..., 2, 1], m[..., 2, 2])
    yaw = torch.atan2(m[..., 1, 0], m[..., 0, 0])
    return torch.stack([roll, pitch, yaw], dim=-1)


def compute_new_pose(pose: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Integrate `action [..., 7]` into `pose [..., 7]`."""
    xyz = pose[..., :3] + action[..., :3]
    rot = euler_to_matrix(action[..., 3:6]) @ euler_to_matrix(pose[..., 3:6])
    grip = (pose[..., 6:] + action[..., 6:]).clamp(0.0, 1.0)
    return torch.cat([xyz, matrix_to_euler(rot), grip], dim=-1)


def poses_to_actions(poses: torch.Tensor) -> torch.Tensor:
    """Actions between consecutive poses `[..., T, 7]` -> `[..., T-1, 7]` (the inverse of compute_new_pose)."""
    start, end = poses[..., :-1, :], poses[..., 1:, :]
    rot = euler_to_matrix(end[..., 3:6]) @ euler_to_matrix(start[..., 3:6]).transpose(-1, -2)
    return torch.cat([end[..., :3] - start[..., :3], matrix_to_euler(rot), end[..., 6:] - start[..., 6:]], dim=-1)
