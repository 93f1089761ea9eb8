"""Writing a ShapesVQA-video split to disk: one clip file per item and one JSONL."""

from __future__ import annotations

from pathlib import Path

from ..files import check_split, run_jobs
from ..vocabulary import DEFAULT_CANVAS, Canvas
from .spec import VideoOptions


def _write_one(args: tuple[str, str, int, int, Canvas, VideoOptions]) -> dict:
    """Generate clip ``index`` and save its file; returns the record (pool worker)."""
    from .clips import save_clip
    from .items import make_clip_item

    out_dir, split, seed, index, canvas, opts = args
    frames, record, _ = make_clip_item(seed, split, index, canvas, opts)
    save_clip(frames, Path(out_dir) / record["video"])
    return record


def write_video_split(out_dir: str | Path, split: str = "test", n: int = 2000, seed: int = 0,
                      canvas: Canvas = DEFAULT_CANVAS, opts: VideoOptions | None = None,
                      workers: int = 1, progress: bool = True) -> Path:
    """Write ``out_dir/clips/<split>-NNNNNN.gif`` (or .png) and ``out_dir/<split>.jsonl``; returns the JSONL path.

    Output depends only on the arguments (not on ``workers``): clips are seeded independently and
    records are written in index order.
    """
    from arr_coc.data.jsonl import write_jsonl

    check_split(split, n, workers, canvas)
    opts = (opts or VideoOptions()).checked()
    out = Path(out_dir)
    (out / "clips").mkdir(parents=True, exist_ok=True)
    jobs = [(str(out), split, seed, i, canvas, opts) for i in range(n)]

    from tqdm import tqdm

    with tqdm(total=n, desc=f"gen-data --video {split}", unit="clip", disable=not progress) as bar:
        records = run_jobs(_write_one, jobs, workers, bar)
    return write_jsonl(records, out / f"{split}.jsonl")
