"""OpenAI routes for BAGEL: `/v1/images/generations` (t2i), `/v1/images/edits` (edit), `/v1/chat/completions`
(understanding: the messages' images, in order, before their text)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mstar_core.api.requests.adapters import ApiAdapter
from mstar_core.errors import RequestError
from mstar_core.sampling import sampling_names

#: Request fields of the images routes that are OpenAI's, not BAGEL's settings.
_OPENAI_IMAGE_FIELDS = {"model", "prompt", "n", "size", "seed", "response_format", "index", "image", "user",
                        "quality", "style", "background", "output_format", "moderation", "mask"}
#: What chat forwards to understand's sampling (`grammar`: from response_format, or tools with a required call).
_CHAT_FIELDS = sampling_names("max_tokens", "temperature", "top_k", "top_p", "seed", "grammar")


class BagelImagesAdapter(ApiAdapter):
    model = "bagel"
    routes = {"images", "chat"}
    chat_media = frozenset({"image"})
    image_output = "image"
    token_output = "next_token"

    def bind(self, loaded: Any) -> None:
        super().bind(loaded)
        self.tokenizer = loaded.extras["tokenizer"]
        self.ids = loaded.extras["special_ids"]
        self.prepare = loaded.prepare

    def image_inputs(self, body: Mapping[str, Any], *, edit: bool) -> dict[str, Any]:
        """Renames only: `size` "WxH" -> width, height (the schema's bounds and grid check them); BAGEL's settings
        (num_steps, guidance, ...) pass through; `n` and `seed` as the route gives them (image i: seed + i)."""
        inputs: dict[str, Any] = {"task": "edit" if edit else "t2i", "prompt": body["prompt"], "n": body.get("n", 1)}
        if body.get("seed") is not None:
            inputs["seed"] = body["seed"]
        if edit:
            inputs["image"] = bytes(body["image"])
            if body.get("size") is not None:  # without one (or with "auto"), the answer has the input's size
                inputs["edit_size"] = [int(v) for v in str(body["size"]).split("x")]
        elif body.get("size") is not None:  # without one, the schema's default size
            width, height = (int(v) for v in str(body["size"]).split("x"))
            inputs.update(width=width, height=height)
        inputs.update({k: v for k, v in body.items() if k not in _OPENAI_IMAGE_FIELDS and v is not None})
        return inputs

    def api_param(self, route: str, param: str | None) -> str | None:
        return "size" if route == "images" and param in ("width", "height", "edit_size") else param

    def prompt_tokens(self, env: Mapping[str, Any], inputs: Mapping[str, Any]) -> int:
        """Every token the reply attends to: text blocks and image blocks (their placeholders and delimiters)."""
        parts = inputs.get("parts")
        if parts is None:
            return super().prompt_tokens(env, inputs)
        return sum(len(p["text_ids"]) if "text_ids" in p else len(p["vit_block_ids"]) for p in parts)

    def chat_message_inputs(self, body: Mapping[str, Any], messages: Sequence[Any]) -> dict[str, Any]:
        """Every message's text and image parts, in order (BAGEL's understanding takes no roles)."""
        content: list[Any] = []
        for turn in messages:
            for part in turn.parts:
                if hasattr(part, "tensor") and hasattr(part, "image"):
                    content.append(part.tensor())
                elif getattr(part, "text", None):
                    content.append(part.text)
        if not content:
            raise RequestError("the messages have nothing to answer", param="messages")
        inputs = {"task": "understand", "content": content}
        inputs.update({k: body[k] for k in _CHAT_FIELDS if body.get(k) is not None})
        return inputs

    def images_from_env(self, env: Mapping[str, Any]) -> list[bytes]:
        """The images; a think request whose thought opened no image is answered 422 with the thought's text.

        An OpenAI images client cannot read text from an images response, and an empty `data` list would
        look like success: the error says what the model said and where to get it (task think, native route).
        """
        if env.get("image") is None and "text" in env:
            raise RequestError(f"the model answered in text and drew no image (its thought ended with "
                               f"{env.get('finish_reason')!r}, not <|vision_start|>): {env['text']!r}; the native "
                               f"route returns this text with task 'think'", param="task", status=422)
        return super().images_from_env(env)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True)

    def is_stop_token(self, token_id: int) -> bool:
        return int(token_id) == self.ids.eos
