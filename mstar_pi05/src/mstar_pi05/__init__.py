"""pi0.5 and pi0 for M*: SigLIP + PaliGemma prefix cached once, a Gemma action expert denoising over it."""
