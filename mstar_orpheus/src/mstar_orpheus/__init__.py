"""M* model package: Orpheus streaming text-to-speech (Llama backbone + SNAC 24 kHz codec)."""
