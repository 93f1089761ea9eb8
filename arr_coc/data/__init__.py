"""The project's VQA JSONL record format: reader, writer and scorers (format: docs/SHAPESVQA.md, "Files").

ShapesVQA (`arr_coc_shapes`) writes it and real data sets are converted to it::

    from arr_coc.data import read_jsonl, score
    for rec in read_jsonl("data/shapes/test.jsonl"):
        score(prediction, rec.answers)        # exact match
        score_record(prediction, rec)         # the record's own metric: exact, "vqa" or "yesno" (metrics.py)

Real data sets are converted by `arr_coc.data.convert` (`python -m arr_coc convert`, docs/DATA.md).
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
from .metrics import METRICS, metric_of, score_record, vqa_accuracy, vqa_normalize, yes_no_score

__all__ = [
    "METRICS",
    "JSONLFormatError",
    "VQARecord",
    "iter_jsonl",
    "metric_of",
    "normalize_answer",
    "read_jsonl",
    "score",
    "score_record",
    "vqa_accuracy",
    "vqa_normalize",
    "write_jsonl",
    "yes_no_score",
]
