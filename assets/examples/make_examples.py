"""Regenerate the microscope's example scenes: `python assets/examples/make_examples.py`.

ShapesVQA items (arr_coc_shapes.make_item, seed 7, split "demo" — neither the
embedded model's training split nor its validation split) are picked as the
first item of each kind below, written as PNGs, and listed with their question
and ground-truth answer in examples.json together with the photographs
(see LICENSES.md; those are copied by hand, not generated).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout's root: arr_coc_shapes/ (not installed)


HERE = os.path.dirname(os.path.abspath(__file__))
SEED, SPLIT = 7, "demo"
# (kind, canvas): a kind is a question type or a hard-case kind (arr_coc_shapes.HARD_KINDS)
WANTED = [("color", (448, 448)), ("letter", (448, 448)), ("count", "random"),
          ("low_contrast", (448, 448)), ("void", (448, 448)), ("border", "random")]
NOTES = {
    "low_contrast": "hard case: the lettered target has low contrast next to a bright distractor",
    "void": "hard case: small objects on a flat background with faint decoy outlines",
    "border": "hard case: the target touches the image border",
}
PHOTOS = [
    {"image": "photo_chelsea.jpg", "question": "What color is the cat?", "answer": None,
     "note": "photograph (CC0, scikit-image); the embedded model only knows ShapesVQA words"},
    {"image": "photo_coffee.jpg", "question": "What shape is the cup?", "answer": None,
     "note": "photograph (CC0, scikit-image)"},
    {"image": "photo_rocket.jpg", "question": "Is there a rocket?", "answer": None,
     "note": "photograph (public domain, SpaceX via scikit-image)"},
]


def main(max_index: int = 400) -> None:
    from arr_coc_shapes import make_item

    entries, todo = [], list(WANTED)
    for index in range(max_index):
        for kind, canvas in list(todo):
            image, record, _ = make_item(SEED, SPLIT, index, canvas=canvas)
            if (record.get("hard") or record["type"]) != kind:
                continue
            name = f"shapes_{kind}.png"
            image.save(os.path.join(HERE, name), format="PNG", optimize=True)
            entries.append({"image": name, "question": record["question"], "answer": record["answers"][0],
                            "note": NOTES.get(kind, f"ShapesVQA {kind} question"),
                            "source": f"make_item(seed={SEED}, split={SPLIT!r}, index={index}, canvas={canvas!r})"})
            todo.remove((kind, canvas))
        if not todo:
            break
    if todo:
        raise SystemExit(f"no item of kinds {todo} in the first {max_index} indices")
    entries.sort(key=lambda e: [k for k, _ in WANTED].index(e["image"][len("shapes_"):-len(".png")]))
    entries += [p for p in PHOTOS if os.path.exists(os.path.join(HERE, p["image"]))]
    with open(os.path.join(HERE, "examples.json"), "w") as f:
        json.dump(entries, f, indent=2)
        f.write("\n")
    print(f"wrote {len(entries)} examples to {HERE}")


if __name__ == "__main__":
    main()
