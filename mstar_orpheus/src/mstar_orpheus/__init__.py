"""M* model package: Orpheus streaming text-to-speech (Llama backbone + SNAC 24 kHz codec)."""

from mstar_orpheus.codes import AudioTokenMap
from mstar_orpheus.model import SPEC, load_orpheus
from mstar_orpheus.prompt import VOICES, OrpheusVocab
from mstar_orpheus.synthesize import synthesize, synthesize_to_wav, write_wav

__all__ = ["SPEC", "VOICES", "AudioTokenMap", "OrpheusVocab", "load_orpheus", "synthesize", "synthesize_to_wav", "write_wav"]
