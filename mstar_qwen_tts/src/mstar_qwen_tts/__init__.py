"""M* model package: Qwen3-TTS (`mstar serve qwen3-tts`)."""
