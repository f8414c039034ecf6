"""What a chat adapter receives: a message as a `ChatTurn` whose `parts` keep the client's order (`TextPart`,
`ImagePart`: an RGB PIL image, `AudioPart`: mono float32 samples and their rate)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from mstar_core.api.media.resample import resample


@attrs.frozen
class TextPart:
    """A text content part (or a message whose content is a plain string)."""

    text: str


@attrs.frozen(eq=False)
class ImagePart:
    """A decoded image: `image` is an RGB `PIL.Image.Image` (EXIF orientation applied); `field` names the part."""

    image: Any
    field: str
    detail: str | None = None

    @property
    def width(self) -> int:
        return self.image.width

    @property
    def height(self) -> int:
        return self.image.height

    def array(self) -> np.ndarray:
        """uint8 pixels `[H, W, 3]`."""
        return np.asarray(self.image, dtype=np.uint8)

    def tensor(self) -> Any:
        """uint8 `torch.Tensor` `[H, W, 3]` (the native endpoint's image layout)."""
        import torch

        return torch.from_numpy(self.array().copy())


@attrs.frozen(eq=False)
class AudioPart:
    """Decoded audio: mono float32 `samples` in [-1, 1] at `sample_rate` Hz; `field` names the part."""

    samples: np.ndarray
    sample_rate: int
    field: str
    format: str = "wav"

    @property
    def seconds(self) -> float:
        return self.samples.size / self.sample_rate

    def tensor(self) -> Any:
        """float32 `torch.Tensor` `[samples]`."""
        import torch

        return torch.from_numpy(self.samples.copy())

    def resampled(self, rate: int) -> np.ndarray:
        """The samples at `rate` Hz (band-limited; the part's own samples when the rates match)."""
        return resample(self.samples, self.sample_rate, rate)


Part = TextPart | ImagePart | AudioPart


@attrs.frozen
class ChatTurn:
    """One chat message: its role (`developer` read as `system`), its parts in order, and its optional name."""

    role: str
    parts: tuple[Part, ...]
    name: str | None = None

    @property
    def text(self) -> str:
        """The message's text parts joined (images and audio left out)."""
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))

    @property
    def media(self) -> list[ImagePart | AudioPart]:
        return [p for p in self.parts if not isinstance(p, TextPart)]
