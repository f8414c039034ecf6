"""Shared torch building blocks that model packages import (norms, rotary, attention, MLPs, MoE)."""
