"""Deployment configuration: strict schemas that name the offending key."""

from mstar_core.config.placement import Placement, WorkerSpec, load_placement

__all__ = ["Placement", "WorkerSpec", "load_placement"]
