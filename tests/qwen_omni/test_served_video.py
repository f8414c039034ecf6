"""Video parts in: frames sampled at 2 per second, patches over time, temporal M-RoPE positions; served greedy
text equals transformers' Qwen3-Omni generate with the same random weights and the same pixels."""

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.qwen_omni.test_served_speech import run

FRAMES = np.random.default_rng(5).integers(0, 256, (6, 64, 96, 3), dtype=np.uint8)  # 3 s at 2 frames a second


def messages(video, text="What happens here?"):
    return [{"role": "system", "content": "You are Qwen, a virtual human."},
            {"role": "user", "content": [video, {"type": "text", "text": text}]}]


def test_video_prompt_text_equals_transformers(hf):
    msgs = messages({"type": "video", "video": torch.from_numpy(FRAMES), "fps": 2.0})

    async def main():
        async with AsyncEngine(discover()) as engine:
            loaded = await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"))
            return loaded, await run(engine, {"messages": msgs, "max_tokens": 5})

    loaded, got = asyncio.run(main())
    cfg = loaded.extras["config"]
    prompt = loaded.prepare.build(msgs)
    assert prompt.video_grids == [[3, 4, 6]] and prompt.video_seconds == [1.0]
    t = cfg.thinker
    at = [i for i, tok in enumerate(prompt.ids) if tok == t.video_token_id]
    # temporal patch k of the video sits 13 k positions after its first (one second apart at 2 fps)
    first = prompt.positions[:, at[0]]
    assert prompt.positions[0, at[6]] - first[0] == 13 and prompt.positions[0, at[12]] - first[0] == 26
    inputs = {"input_ids": torch.tensor([prompt.ids]), "pixel_values_videos": torch.cat(prompt.video_patches),
              "video_grid_thw": torch.tensor(prompt.video_grids),
              "video_second_per_grid": torch.tensor(prompt.video_seconds)}
    with torch.no_grad():
        seqs = hf.thinker.generate(**inputs, max_new_tokens=5, eos_token_id=cfg.im_end_token_id, do_sample=False)
    assert got["next_token"] == seqs[0, len(prompt.ids):].tolist()
    # and the positions transformers computes for the same prompt
    with torch.no_grad():
        hf_pos, _ = hf.thinker.get_rope_index(inputs["input_ids"], video_grid_thw=inputs["video_grid_thw"],
                                              attention_mask=torch.ones_like(inputs["input_ids"]),
                                              second_per_grids=inputs["video_second_per_grid"])
    assert torch.equal(hf_pos[:, 0].long(), prompt.positions)


def _mp4(frames: np.ndarray, rate: int = 10, audio_seconds: float = 0.0) -> bytes:
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        video = c.add_stream("mpeg4", rate=rate)
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        audio = c.add_stream("aac", rate=16000) if audio_seconds else None
        for f in frames:
            for p in video.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in video.encode():
            c.mux(p)
        if audio is not None:
            t = np.arange(int(16000 * audio_seconds)) / 16000
            frame = av.AudioFrame.from_ndarray((0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None],
                                               format="flt", layout="mono")
            frame.sample_rate = 16000
            for p in [*audio.encode(frame), *audio.encode()]:
                c.mux(p)
    return buf.getvalue()


def test_video_url_parts_decode_sample_and_bound(monkeypatch):
    from mstar_core.api.media.video import VideoLimits, video_part
    from mstar_core.errors import RequestError

    frames = np.stack([np.full((48, 64, 3), 10 * i, np.uint8) for i in range(25)])  # 2.5 s at 10 fps
    url = "data:video/mp4;base64," + base64.b64encode(_mp4(frames, audio_seconds=2.5)).decode()
    part = video_part({"video_url": {"url": url, "audio": True}}, "messages[0].content[0].video_url")
    assert part.frames.shape == (5, 48, 64, 3) and part.fps == 2.0  # t = 0, 0.5, 1, 1.5, 2 s
    assert [round(float(f.mean()) / 10) for f in part.frames] == [0, 5, 10, 15, 20]
    assert part.audio is not None and part.audio_rate == 16000 and abs(part.audio.size / 16000 - 2.5) < 0.2
    field = "messages[0].content[0].video_url"
    for limits, words in ((VideoLimits(max_video_seconds=1.0), "at most 1 s"),
                          (VideoLimits(max_video_pixels=1000), "pixels per frame"),
                          (VideoLimits(max_video_frames=3), "more than 3 frames"),
                          (VideoLimits(max_video_bytes=100), "bytes")):
        with pytest.raises(RequestError) as err:
            video_part({"video_url": {"url": url}}, field, limits)
        assert words in str(err.value) and err.value.param == field and err.value.status == 413
    with pytest.raises(RequestError) as err:
        video_part({"video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"junk").decode()}}, field)
    assert err.value.param == field and err.value.status == 400
