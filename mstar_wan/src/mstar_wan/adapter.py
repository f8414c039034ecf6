"""`/v1/videos` for Wan: OpenAI's `size` and `seconds` mapped onto Wan's grid, `input_reference` as the first frame.

The mapping (documented in the model's README section of docs/OPERATIONS.md):

- `size` "WxH" (OpenAI's 720x1280, 1280x720, 1024x1792, 1792x1024, or any other) -> width, height: each side times
  the checkpoint's `size_scale` (1 for a real checkpoint, 1/20 for the tiny preset), floored to a multiple of 32
  (at least 32): 720x1280 -> 704x1280, Wan2.2-TI2V-5B's native portrait size.
- `seconds` s -> `num_frames = s * fps + 1` rounded to 4k + 1 (24 fps: 4, 8, 12 s -> 97, 193, 289 frames).
- `input_reference` (an image file) -> `image`: text+image-to-video, the image resized to the video's size.
- `seed` and Wan's own fields (`negative_prompt`, `num_steps`, `guidance_scale`, `shift`) pass through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_core.api.requests.adapters import ApiAdapter

_PASS = ("seed", "negative_prompt", "num_steps", "guidance_scale", "shift")
_OPENAI = {"prompt", "model", "size", "seconds", "input_reference", *_PASS}


def wan_side(pixels: int, scale: float) -> int:
    return max(32, int(pixels * scale) // 32 * 32)


def wan_frames(seconds: int, fps: int) -> int:
    return 4 * round(seconds * fps / 4) + 1


class WanVideosAdapter(ApiAdapter):
    model = "wan"
    routes = {"videos"}

    def bind(self, loaded: Any) -> None:
        super().bind(loaded)
        self.defaults = loaded.extras["defaults"]

    def video_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        width, height = (int(v) for v in str(body["size"]).lower().replace(" ", "").split("x"))
        scale = self.defaults.size_scale
        inputs: dict[str, Any] = {"prompt": body["prompt"], "width": wan_side(width, scale),
                                  "height": wan_side(height, scale),
                                  "num_frames": wan_frames(int(body["seconds"]), self.defaults.fps)}
        if body.get("input_reference") is not None:
            inputs["image"] = bytes(body["input_reference"])
        inputs.update({k: body[k] for k in _PASS if body.get(k) is not None})
        # any other extra field goes to the model's schema as sent (an unknown one is a 400 naming it)
        inputs.update({k: v for k, v in body.items() if k not in _OPENAI and v is not None})
        return inputs

    def api_param(self, route: str, param: str | None) -> str | None:
        return {"width": "size", "height": "size", "num_frames": "seconds", "image": "input_reference"}.get(param, param)

    def video_progress(self, prepared: Mapping[str, Any], emitted: Mapping[str, int]) -> float:
        """Denoising steps and decoded chunks, each one unit of work."""
        total = int(prepared.get("num_steps", 1)) + int(prepared.get("decode_chunks", 1))
        return (emitted.get("sigma", 0) + emitted.get("frames", 0)) / max(1, total)

    #: each decode chunk's frames, emitted as the VAE's decode loop produces them: the MP4 is written meanwhile
    video_frames_output = "frames"

    def video_fps(self, prepared: Mapping[str, Any]) -> int:
        return int(prepared.get("fps", self.defaults.fps))

    def video_from_env(self, env: Mapping[str, Any], prepared: Mapping[str, Any]) -> Any:
        return env["video"]
