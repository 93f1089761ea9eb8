"""Answer metrics, chosen per record: exact match (the default), VQA accuracy, POPE's yes/no.

A record says which metric scores it with a ``"metric"`` key (kept by the reader in
``VQARecord.extra``); records without one (ShapesVQA, GQA) use exact match, ``score``.
The converters (``arr_coc.data.convert``) write ``"vqa"`` for VQAv2 and TextVQA and ``"yesno"``
for POPE. Every metric returns a float in [0, 1].

``vqa``: the VQA challenge's accuracy. The prediction counts as right for a group of humans
when at least 3 of them gave it, min(#matching / 3, 1), averaged over the 10 leave-one-out
subsets of 9 of the 10 annotators, as the official evaluation does (3 of 10 humans -> 0.9, not
1.0; 4 or more -> 1.0). Answers are compared after the official normalisation
(processPunctuation + processDigitArticle of the VQA evaluation code): some punctuation is
dropped or turned into a space, a period not followed by a digit is dropped, lowercase, number
words "none"/"zero".."ten" -> digits, articles a/an/the dropped, apostrophe-less contractions
restored ("dont" -> "don't"). One difference from the official script, on purpose: it normalises
the human answers only when they disagree, and then only their punctuation; here both sides get
the whole normalisation always, as lmms-eval's processor does, so "two" and "2" match whichever
side they are on. With a single reference answer there are no subsets to average: the score is
exact match after that normalisation.

``yesno``: POPE's rule. The prediction's first sentence is read as "no" when it holds the word
"no" or "not", otherwise as "yes", and compared with the (yes/no) answer.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Sequence

from .jsonl import score

# -- the VQA evaluation's normalisation ------------------------------------------------------

_PUNCT = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",",
          "?", "!")
_NUMBER_WORDS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
                 "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = frozenset(("a", "an", "the"))
_DIGIT_COMMA_DIGIT = re.compile(r"(\d),(\d)")
_PERIOD = re.compile(r"\.(?!\d)")   # a period not followed by a digit ("3.5" keeps its point)

# English contractions as people type them; the key is the form without apostrophes
# ("dont" -> "don't"). Contractions that are ordinary words without their apostrophe
# ("well", "were", "its", "id", "ill", "wed", "shed", "hell", "lets") are left out.
_CONTRACTED = (
    "ain't aren't can't could've couldn't couldn't've didn't doesn't don't hadn't hadn't've hasn't haven't "
    "he'd he'd've he's how'd how'll how's i'd've i'm i've isn't it'd it'd've it'll ma'am mightn't mightn't've "
    "might've mustn't must've needn't not've o'clock oughtn't shan't she'd've should've shouldn't shouldn't've "
    "somebody'd somebody'd've somebody'll somebody's someone'd someone'd've someone'll someone's something'd "
    "something'd've something'll that's there'd there'd've there're there's they'd they'd've they'll they're "
    "they've 'twas wasn't we'd've we've weren't what'll what're what's what've when's where'd where's where've "
    "who'd who'd've who'll who's who've why'll why're why's won't would've wouldn't wouldn't've y'all y'all'll "
    "y'all'd've you'd you'd've you'll you're you've"
).split()
_CONTRACTIONS = {c.replace("'", ""): c for c in _CONTRACTED}
# half-typed double contractions ("couldnt've", "couldn'tve") mean the same
for _c in _CONTRACTED:
    if _c.count("'") == 2:
        first, _, rest = _c.partition("'")
        middle, _, last = rest.partition("'")
        _CONTRACTIONS[f"{first}{middle}'{last}"] = _c
        _CONTRACTIONS[f"{first}'{middle}{last}"] = _c


def vqa_normalize(text: str) -> str:
    """The VQA evaluation's answer normalisation ("Two dogs." -> "2 dogs", "the dog" -> "dog")."""
    text = str(text).replace("\n", " ").replace("\t", " ").strip()
    # punctuation: removed where it touches a space (or the text has a digit,digit comma),
    # otherwise replaced by a space ("black-and-white" -> "black and white", "3,000" -> "3000")
    glued = _DIGIT_COMMA_DIGIT.search(text) is not None
    out = text
    for p in _PUNCT:
        out = out.replace(p, "" if glued or f"{p} " in text or f" {p}" in text else " ")
    out = _PERIOD.sub("", out)
    words = [_NUMBER_WORDS.get(w, w) for w in out.lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


def vqa_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """VQA accuracy of `prediction` against the human `answers` (10 in VQAv2 / TextVQA).

    Mean over the leave-one-out subsets of min(#answers in the subset equal to it / 3, 1),
    after `vqa_normalize` on both sides; exact match when there is a single answer.
    """
    answers = [vqa_normalize(a) for a in answers]
    if not answers:
        raise ValueError("vqa_accuracy needs at least one reference answer")
    pred = vqa_normalize(prediction)
    if len(answers) == 1:
        return float(pred == answers[0])
    same = sum(a == pred for a in answers)
    # leaving out one of the `same` matching humans leaves same - 1 matches, any other leaves same
    total = same * min(1.0, (same - 1) / 3) + (len(answers) - same) * min(1.0, same / 3)
    return round(total / len(answers), 10)   # 0.6, not 0.6000000000000001, in the reports


# -- POPE -----------------------------------------------------------------------------------


def yes_no(prediction: str) -> str:
    """POPE's reading of a free-form reply: "no" if its first sentence has the word no / not, else "yes"."""
    first = str(prediction).split(".")[0].replace(",", " ").lower()
    return "no" if {"no", "not"} & set(first.split()) else "yes"


def yes_no_score(prediction: str, answers: Iterable[str]) -> float:
    """1.0 when POPE's reading of `prediction` equals the (normalised) yes/no answer."""
    return float(any(yes_no(prediction) == vqa_normalize(a) for a in answers))


# -- per-record choice ----------------------------------------------------------------------

METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "exact": score,
    "vqa": vqa_accuracy,
    "yesno": yes_no_score,
}
DEFAULT_METRIC = "exact"


def metric_of(record: Any) -> str:
    """The metric a record asks for: its ``extra["metric"]`` (or a ``metric`` key of a dict), else exact."""
    extra = record.get("extra", record) if isinstance(record, dict) else getattr(record, "extra", {})
    name = (extra or {}).get("metric") or DEFAULT_METRIC
    if name not in METRICS:
        where = getattr(record, "id", None) or (record.get("id") if isinstance(record, dict) else None)
        raise ValueError(f"record {where!r} asks for metric {name!r}; known metrics: {', '.join(METRICS)}")
    return name


def score_record(prediction: str, record: Any) -> float:
    """Score `prediction` against `record.answers` with the record's own metric (see the module doc)."""
    answers = record["answers"] if isinstance(record, dict) else record.answers
    return METRICS[metric_of(record)](prediction, answers)
