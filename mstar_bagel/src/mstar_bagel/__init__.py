"""BAGEL for M*: a mixture-of-transformers LLM over text, SigLIP and FLUX-VAE tokens, with three CFG cache labels."""
