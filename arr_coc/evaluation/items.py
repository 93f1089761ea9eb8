"""What the evaluation reads: a split's records as items, whatever they show (an image or a clip).

    read_items(path, limit)   a VQA JSONL split (`arr_coc.data.read_jsonl`: images) or a ShapesVQA-video split
                              (`gen-data --video`: records with 'video' and 'boxes_over_time') -> items

An item gives the loop what it needs and nothing about where it came from: its id, question, type (what
`per_type` groups by), the record its answer is scored against (`arr_coc.data.score_record`), its visual, and
the answer's boxes (image items: for coverage and the oracle; clip items: per frame, for the oracle).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

from ..data import VQARecord, read_jsonl


@dataclass(frozen=True)
class ImageItem:
    """A record of an image split."""

    record: VQARecord
    kind = "image"

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def question(self) -> str:
        return self.record.question

    @property
    def type(self) -> str:
        return self.record.type or "other"

    @property
    def boxes(self) -> Any:
        return self.record.boxes

    def load(self, sampling: dict[str, Any] | None = None) -> Any:
        return self.record.load_image()


@dataclass(frozen=True)
class ClipItem:
    """A record of a ShapesVQA-video split (docs/SHAPESVQA.md, "ShapesVQA-video"): `clip_path` resolved."""

    record: dict[str, Any]
    kind = "clip"

    @property
    def id(self) -> str:
        return str(self.record.get("id"))

    @property
    def question(self) -> str:
        return self.record["question"]

    @property
    def type(self) -> str:
        return self.record.get("qtype") or self.record.get("type") or "other"

    @property
    def boxes(self) -> Any:
        return None        # per frame: `boxes_over_time` (the oracle reads it); no coverage for clips

    def load(self, sampling: dict[str, Any] | None = None) -> Any:
        """The clip read by the one clip reader and validator, as `generate` and `ask --video` read its file
        (`arr_coc.validation.clips.check_clip`: an animation by its frames' durations, a video file by PyAV), sampled by the
        model's rule (`sampling`, `VLMBackend.video_sampling`)."""
        from ..validation.clips import check_clip

        return check_clip(self.record["clip_path"], sampling=sampling)


Item = ImageItem | ClipItem


def is_video_split(path: str | os.PathLike) -> bool:
    """A ShapesVQA-video JSONL (`gen-data --video`): its first record names a clip and its boxes over time."""
    try:
        with open(path) as f:
            first = json.loads(next((line for line in f if line.strip()), "{}"))
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and "video" in first and "boxes_over_time" in first


def read_video_records(path: str | os.PathLike, n: int | None = None) -> list[dict[str, Any]]:
    """A ShapesVQA-video JSONL (`gen-data --video`) -> its records, each with `clip_path` resolved."""
    folder = os.path.dirname(os.fspath(path))
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if "video" not in rec or "boxes_over_time" not in rec:
                raise ValueError(f"{path} is not a ShapesVQA-video split (records need 'video' and "
                                 "'boxes_over_time'); write one with: python -m arr_coc_shapes gen-data --video ...")
            rec["clip_path"] = os.path.join(folder, rec["video"])
            out.append(rec)
            if n is not None and len(out) >= n:
                break
    return out


def read_items(path: str | os.PathLike, limit: int | None = None) -> list[Item]:
    """The split at `path` as items (its first `limit`): a video split's clips or a VQA split's images."""
    if is_video_split(path):
        return [ClipItem(r) for r in read_video_records(path, None if limit is None else max(0, limit))]
    records = read_jsonl(path)
    return [ImageItem(r) for r in (records if limit is None else records[: max(0, limit)])]


def as_items(records: Sequence[Any]) -> list[Item]:
    """Items from records of either kind (VQARecords, video-record dicts, or items already)."""
    return [r if isinstance(r, (ImageItem, ClipItem)) else ImageItem(r) if isinstance(r, VQARecord) else ClipItem(r)
            for r in records]


__all__ = ["ClipItem", "ImageItem", "Item", "as_items", "is_video_split", "read_items", "read_video_records"]
