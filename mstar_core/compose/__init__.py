"""Models built from other loaded models' nodes (`CompositionSpec`), and the compositions the core registers."""

from mstar_core.compose.spec import CompositionSpec, check_roles

__all__ = ["CompositionSpec", "check_roles"]
