"""M* model package for V-JEPA 2 (encoder, masked predictor) and V-JEPA 2-AC (cached rollouts, CEM planning)."""
