"""Configuration read strictly, errors naming the offending key: placement files and checkpoint configs (`hf`)."""

from mstar_core.config.placement import Placement, WorkerSpec, load_placement

__all__ = ["Placement", "WorkerSpec", "load_placement"]
