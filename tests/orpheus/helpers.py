"""Shared tiny configs and helpers for the Orpheus tests."""

TINY_SNAC = dict(
    sampling_rate=24000,
    encoder_dim=8,
    encoder_rates=[2, 2],
    decoder_dim=16,
    decoder_rates=[2, 2],
    attn_window_size=None,
    codebook_size=16,
    codebook_dim=4,
    vq_strides=[4, 2, 1],
    noise=True,
    depthwise=True,
)


async def collect(handle):
    """(audio chunks, other outputs' values, the final env) of one streamed request."""
    audio, tokens = [], []
    async for out in handle:
        (audio if out.name == "audio" else tokens).append(out.value)
    return audio, tokens, await handle.result()
