"""Cached AC rollout == re-prefill rollout; forked CEM prefixes == copied ones; poses agree with scipy."""

import pytest
import torch
from mstar_vjepa.planner import CEMSettings, plan_cem
from mstar_vjepa.pose import compute_new_pose, poses_to_actions
from mstar_vjepa.rollout import normalize, rollout_cached, rollout_reprefill

from tests.vjepa.helpers import random_states


def _inputs(batch, context_frames, horizon, seed=3):
    g = torch.Generator().manual_seed(seed)
    ctx = normalize(torch.randn(batch, context_frames, 4, 32, generator=g))
    states = torch.stack([random_states(context_frames, seed + i) for i in range(batch)])
    actions = torch.randn(batch, horizon, 7, generator=g) * 0.05
    return ctx, states, actions


@pytest.mark.parametrize("horizon", [1, 5, 30])
def test_cached_rollout_equals_reprefill(ac_predictor, horizon):
    ctx, states, actions = _inputs(2, 2, horizon)
    z_ref, s_ref = rollout_reprefill(ac_predictor, ctx, states, actions)
    z, s = rollout_cached(ac_predictor, ctx, states, actions)
    assert z.shape == (2, horizon, 4, 32)
    assert (z - z_ref).abs().max().item() <= 1e-5
    assert (s - s_ref).abs().max().item() <= 1e-6
    # the rollout is not trivially constant: later steps differ from the first
    if horizon > 1:
        assert (z[:, -1] - z[:, 0]).abs().max() > 1e-3


def test_single_context_frame_and_max_horizon(ac_predictor):
    ctx, states, actions = _inputs(1, 1, 31)
    z_ref, _ = rollout_reprefill(ac_predictor, ctx, states, actions)
    z, _ = rollout_cached(ac_predictor, ctx, states, actions)
    assert (z - z_ref).abs().max().item() <= 1e-5


def test_horizon_past_the_mask_is_rejected(ac_predictor):
    ctx, states, actions = _inputs(1, 2, 32)
    with pytest.raises(ValueError, match="horizon must be between 1 and 31"):
        rollout_cached(ac_predictor, ctx, states, actions)


def test_rollout_depends_on_actions(ac_predictor):
    ctx, states, actions = _inputs(1, 2, 3)
    z1, _ = rollout_cached(ac_predictor, ctx, states, actions)
    z2, _ = rollout_cached(ac_predictor, ctx, states, actions + 0.5)
    assert (z1 - z2).abs().max() > 1e-3


def test_cem_plan_from_a_copied_prefix_equals_rolling_out_each_sample_alone(ac_predictor):
    ctx, states, _ = _inputs(1, 3, 1)
    goal = normalize(torch.randn(4, 32, generator=torch.Generator().manual_seed(9)))
    cfg = CEMSettings(samples=12, topk=3, iterations=1)
    plan = plan_cem(ac_predictor, ctx, states, goal, 4, cfg, torch.Generator().manual_seed(5))
    assert plan["plan"].shape == (4, 7) and plan["costs"].shape == (1,)
    assert (plan["plan"][:, 3:6] == 0).all()
    assert plan["plan"][:, :3].abs().max() <= 0.05
    # the best sample's cost is its own rollout's: each sample continued from its own copy of the prefix
    z, _ = rollout_cached(ac_predictor, ctx, states, plan["best_actions"][None])
    assert abs((z[0, -1] - goal).abs().mean().item() - plan["best_cost"]) <= 1e-5


def test_pose_matches_scipy():
    rot = pytest.importorskip("scipy.spatial.transform").Rotation
    pose, action = random_states(16, 4), random_states(16, 5) * 0.5
    got = compute_new_pose(pose.double(), action.double())
    for i in range(16):
        r = rot.from_euler("xyz", action[i, 3:6].double().numpy()).as_matrix() @ rot.from_euler(
            "xyz", pose[i, 3:6].double().numpy()
        ).as_matrix()
        ref = rot.from_matrix(r).as_euler("xyz")
        assert torch.allclose(got[i, 3:6], torch.from_numpy(ref), atol=1e-9)
    assert torch.allclose(got[:, :3], (pose[:, :3] + action[:, :3]).double())
    assert ((got[:, 6] >= 0) & (got[:, 6] <= 1)).all()


def test_poses_to_actions_inverts_compute_new_pose():
    poses = random_states(6, 7).double()
    poses[:, 6] = 0.5
    acts = poses_to_actions(poses)
    rebuilt = compute_new_pose(poses[:-1], acts)
    assert torch.allclose(rebuilt, poses[1:], atol=1e-9)
