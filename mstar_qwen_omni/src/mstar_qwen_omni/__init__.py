"""M* model package for Qwen3-Omni: Thinker (MoE, audio + vision encoders), Talker, code predictor, Code2Wav."""
