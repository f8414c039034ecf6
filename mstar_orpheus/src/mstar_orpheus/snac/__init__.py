"""The SNAC neural audio codec's decoder (24 kHz configuration used by Orpheus), implemented in M*."""

from mstar_orpheus.snac.checkpoint import (
    SNACCheckpointError,
    load_snac,
    map_snac_state,
    save_snac,
    snac_name_map,
)
from mstar_orpheus.snac.config import SNACConfig
from mstar_orpheus.snac.model import SNACDecoder

__all__ = [
    "SNACCheckpointError",
    "SNACConfig",
    "SNACDecoder",
    "load_snac",
    "map_snac_state",
    "save_snac",
    "snac_name_map",
]
