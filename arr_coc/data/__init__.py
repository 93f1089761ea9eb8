"""The project's VQA JSONL record format: reader, writer and scorer (format: docs/SHAPESVQA.md, "Files").

ShapesVQA (`arr_coc.shapes`) writes it and real data sets are converted to it::

    from arr_coc.data import read_jsonl, score
    for rec in read_jsonl("data/shapes/test.jsonl"):
        score(prediction, rec.answers)
"""

from .jsonl import (
    JSONLFormatError,
    VQARecord,
    iter_jsonl,
    normalize_answer,
    read_jsonl,
    score,
    write_jsonl,
)

__all__ = [
    "JSONLFormatError",
    "VQARecord",
    "iter_jsonl",
    "normalize_answer",
    "read_jsonl",
    "score",
    "write_jsonl",
]
