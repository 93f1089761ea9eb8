"""What a request asks about: an image or a clip, opened and checked by the library's one validator, and how the
page draws one unit of it (an image, or a clip's temporal group) at the size the processor gave it.

The handler asks the same things of both: how many pixels to admit the request by, the visual to hand the
pipeline, the notes the validator made, a picture per unit and what the trace says about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image

    from arr_coc.validation.images import ImageInfo, OpenedImage
    from arr_coc.validation.limits import InputLimits
    from arr_coc.video.clip import Clip


@dataclass
class AskedImage:
    """An uploaded image: opened (header checked), decoded and normalised once admitted (`finish`)."""

    opened: OpenedImage
    picture: Image | None = None
    info: ImageInfo | None = None
    kind = "image"

    @property
    def pixels(self) -> int:
        return self.opened.pixels

    def finish(self, limits: InputLimits) -> list[str]:
        """Decode and normalise (EXIF rotation, modes, size): the validator's notes."""
        from arr_coc.validation.images import finish_image

        self.picture, self.info = finish_image(self.opened, limits)
        return list(self.info.notes)

    @property
    def visual(self) -> Image:
        return self.picture

    def frame(self, trace: Any, j: int, cell_px: int) -> Image:
        """The image as the processor resized it: one cell_px square per merged token."""
        h, w = trace.grid_hw[j]
        return self.picture.resize((w * cell_px, h * cell_px))

    def describe(self) -> dict[str, Any]:
        info = self.info
        return {"image": {"original_size": list(info.original_size or ()), "used_size": list(info.used_size or ()),
                          "mode": info.mode, "format": info.format, "frames": info.frames}}

    def close(self) -> None:
        self.opened.close()


@dataclass
class AskedClip:
    """An uploaded clip, read by the one clip reader (`arr_coc.validation.clips.check_clip`), sampled by the model's rule."""

    clip: Clip
    notes: list[str] = field(default_factory=list)
    kind = "clip"

    @property
    def pixels(self) -> int:
        return self.clip.num_frames * self.clip.height * self.clip.width

    def finish(self, limits: InputLimits) -> list[str]:
        return list(self.notes)

    @property
    def visual(self) -> Clip:
        return self.clip

    def frame(self, trace: Any, j: int, cell_px: int) -> Image:
        """Temporal group j's first frame at the processor's size."""
        from PIL import Image as PILImage

        h, w = trace.grid_hw[j]
        picture = PILImage.fromarray(self.clip.frames[min(2 * trace.group_per_image[j], self.clip.num_frames - 1)])
        return picture.resize((w * cell_px, h * cell_px), PILImage.BICUBIC)

    def describe(self) -> dict[str, Any]:
        clip = self.clip
        return {"video": {"frames": clip.num_frames, "size": [clip.width, clip.height],
                          "timestamps": [round(float(t), 3) for t in clip.timestamps]}}

    def close(self) -> None:
        pass


Asked = AskedImage | AskedClip


def open_asked(image: Any, video: Any, limits: InputLimits, sampling: dict[str, Any]) -> Asked:
    """The request's visual: the clip or the image, whichever was sent (opened, not decoded yet); both, or an upload
    the app did not receive, is refused with what to do. An animated GIF / PNG is a clip wherever it is sent (as
    `generate` reads its path)."""
    from arr_coc.errors import InputError
    from arr_coc.validation.clips import check_clip
    from arr_coc.video.reading import is_clip_path
    from arr_coc_microscope.inputs import Refused, Unreadable, open_upload

    if video and image:
        raise InputError("Both an image and a video were sent: ask about one of them (clear the other box, or pass "
                         "image=None or video=None through the API).", "two_visuals")
    if isinstance(video, Unreadable):
        raise InputError(str(video) if isinstance(video, Refused) else f"Could not read the video ({video}).",
                         "video_refused")
    clip = video or (image if isinstance(image, str) and not isinstance(image, Unreadable) and is_clip_path(image)
                     else None)
    if clip:
        from arr_coc.video.animation import animated_notes

        path = clip if isinstance(clip, str) else getattr(clip, "path", None) or (clip or {}).get("path")
        notes = [] if clip is video else animated_notes(path)
        return AskedClip(check_clip(path, limits, name=None, sampling=sampling), notes)
    return AskedImage(open_upload(image, limits))


__all__ = ["Asked", "AskedClip", "AskedImage", "open_asked"]
