"""Questions about a clip, with the ground truth always derived from its track (``ask_clip``), and
the relevance target: per frame, the boxes of the objects the answer needs in that frame.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..vocabulary import Box
from .spec import DIRECTIONS, MOTION_TYPES, VIDEO_QUESTION_TYPES, VIDEO_TEMPLATES
from .track import Track


@dataclass(frozen=True)
class ClipQuestion:
    qtype: str
    text: str
    answer: str
    relevant: tuple[tuple[int, ...], ...]  # per frame: indices of the actors the answer needs there
    color: str | None = None  # attributes named in the question
    shape: str | None = None

    def boxes_over_time(self, track: Track) -> list[list[Box]]:
        """Per frame, the canvas boxes of the relevant actors (always in view: see Track.safe_region)."""
        return [[track.box_at(i, t) for i in ids] for t, ids in enumerate(self.relevant)]


def movers(track: Track) -> list[int]:
    """Actors that move in the scene while on screen (at least two frames present)."""
    return [i for i, a in enumerate(track.actors) if a.moving and len(track.frames_of(i)) >= 2]


def direction_of(velocity: tuple[int, int]) -> str | None:
    """'left' / 'right' / 'up' / 'down' for an axis-aligned velocity, else None."""
    vx, vy = velocity
    if (vx == 0) == (vy == 0):
        return None
    unit = ((vx > 0) - (vx < 0), (vy > 0) - (vy < 0))
    return next(name for name, d in DIRECTIONS.items() if d == unit)


def _only_in(track: Track, ids: list[int], frames: list[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """Per frame: those of ``ids`` present (in ``frames`` only, when given)."""
    keep = range(track.n_frames) if frames is None else frames
    return tuple(tuple(i for i in ids if t in keep and track.present(i, t)) for t in range(track.n_frames))


def ask_clip(track: Track, qtype: str, color: str | None = None, shape: str | None = None) -> ClipQuestion | None:
    """The question of type ``qtype`` about ``color`` / ``shape`` with its answer from the track.

    Returns None when it is not valid for this clip: the motion questions need no pan, no cut and
    exactly one mover (moving_shape, and moving_color with a mover that keeps its colour) or exactly
    one object of the shape, moving along one axis (direction); appears_last needs no cut and one
    object that appears after the first frame later than every other; color_start / color_end need
    exactly one object of the shape in that frame.
    """
    last = track.n_frames - 1
    text = VIDEO_TEMPLATES.get(qtype, "").format(color=color, shape=shape)
    if qtype in MOTION_TYPES:
        if track.pan is not None or track.cut is not None:
            return None
        if qtype == "direction":
            hits = [i for i, a in enumerate(track.actors) if a.shape == shape]
            if len(hits) != 1 or hits[0] not in movers(track):
                return None
            answer = direction_of(track.actors[hits[0]].velocity)
            return None if answer is None else ClipQuestion(qtype, text, answer, _only_in(track, hits), None, shape)
        ids = movers(track)
        if len(ids) != 1:
            return None
        mover = track.actors[ids[0]]
        if qtype == "moving_shape":
            return ClipQuestion(qtype, text, mover.shape, _only_in(track, ids))
        colors = {mover.color_at(t)[0] for t in track.frames_of(ids[0])}
        return ClipQuestion(qtype, text, colors.pop(), _only_in(track, ids)) if len(colors) == 1 else None
    if qtype == "appears_last":
        if track.cut is not None:
            return None
        first = {i: frames[0] for i in range(len(track.actors)) if (frames := track.frames_of(i))}
        late = sorted((f, i) for i, f in first.items() if f > 0)
        if not late or (len(late) > 1 and late[-1][0] == late[-2][0]):
            return None
        target = late[-1][1]
        return ClipQuestion(qtype, text, track.actors[target].shape, _only_in(track, [target]))
    if qtype in ("color_start", "color_end"):
        t = 0 if qtype == "color_start" else last
        hits = [i for i, obj in track.objects_at(t) if obj.shape == shape]
        if len(hits) != 1:
            return None
        answer = track.actors[hits[0]].color_at(t)[0]
        return ClipQuestion(qtype, text, answer, _only_in(track, hits, [t]), None, shape)
    if qtype in ("exists_first", "exists_last"):
        t = 0 if qtype == "exists_first" else last
        hits = [i for i, obj in track.objects_at(t) if obj.shape == shape and obj.color == color]
        return ClipQuestion(qtype, text, "yes" if hits else "no", _only_in(track, hits, [t]), color, shape)
    raise ValueError(f"unknown video question type {qtype!r}; expected one of {VIDEO_QUESTION_TYPES}")
