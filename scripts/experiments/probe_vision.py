"""Probe a VLM's visual tokens: is the colour, shape and letter of the object under each cell in them?

    python scripts/experiments/probe_vision.py checkpoints/shapes-qwen2vl

For the object cells of 40 fresh ShapesVQA scenes: (1) the nearest word embedding by cosine
(what the embedded model's dense loss trains for), (2) a linear probe trained on half the
cells and tested on the other half. Chance: colour 1/8, shape 1/6, letter 1/26.
Then, per lettered OBJECT of 200 letter-rich scenes (90% of eligible objects lettered), the
letter whose embedding is nearest to the mean of the object's cells, by object size: what
the language model could at best read from the tokens.
"""

import sys

import numpy as np
import torch
import torch.nn.functional as F

from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout's root: arr_coc_shapes/ (not installed)
from arr_coc_shapes import COLOR_NAMES, LETTERS, SHAPES, cell_labels, make_item
from arr_coc import ARRCOC
from arr_coc_shapes.batching import visual_tokens


def main(path: str, n_scenes: int = 40) -> None:
    wrapper = ARRCOC.from_pretrained(path)
    model, processor, tok = wrapper.backend.model, wrapper.backend.processor, wrapper.tokenizer
    embed = model.get_input_embeddings().weight.detach()
    attributes = {"color": COLOR_NAMES, "shape": SHAPES, "letter": [c.lower() for c in LETTERS]}
    cells = {name: ([], []) for name in attributes}
    for i in range(n_scenes):
        item = make_item(77, "probe", i)
        with torch.no_grad():
            feats, grids = visual_tokens(model, processor, [item.image])
        v = F.normalize(feats[0], dim=-1)
        h, w = grids[0]
        labels = cell_labels(item.scene, 28, min_cover=0.3)
        for name in attributes:
            ids = torch.from_numpy(getattr(labels, name)[:h, :w].reshape(-1))
            on = ids > 0
            cells[name][0].append(v[on])
            cells[name][1].append(ids[on])
    for name, words in attributes.items():
        x, y = torch.cat(cells[name][0]), torch.cat(cells[name][1])
        word_ids = torch.tensor([tok.convert_tokens_to_ids(wd) for wd in words])
        nearest = float(((x @ F.normalize(embed[word_ids], dim=-1).T).argmax(1) + 1 == y).float().mean())
        half = len(y) // 2
        weight = torch.zeros(x.shape[1], len(words) + 1, requires_grad=True)
        opt = torch.optim.Adam([weight], lr=0.05)
        for _ in range(300):
            opt.zero_grad()
            F.cross_entropy(10 * x[:half] @ weight, y[:half]).backward()
            opt.step()
        probe = float(((x[half:] @ weight).argmax(1) == y[half:]).float().mean())
        print(f"{name:7s} cells {len(y):5d}  nearest word {nearest:.3f}  linear probe {probe:.3f}  chance {1 / len(words):.3f}")

    letters_by_object(model, processor, tok, embed)


def letters_by_object(model, processor, tok, embed, n_scenes: int = 200) -> None:
    letters = F.normalize(embed[torch.tensor([tok.convert_tokens_to_ids(c.lower()) for c in LETTERS])], dim=-1)
    sides, hits = [], []
    for i in range(n_scenes):
        item = make_item(77, "diag", i, canvas=(448, 448), letter_rate=0.9)
        with torch.no_grad():
            feats, _ = visual_tokens(model, processor, [item.image])
        v = F.normalize(feats[0], dim=-1)
        objects = cell_labels(item.scene, 28, min_cover=0.15).object.reshape(-1)
        for k, o in enumerate(item.scene.objects, start=1):
            on = np.nonzero(objects == k)[0]
            if o.letter and len(on):
                hits.append(int((v[on] @ letters.T).mean(0).argmax()) == LETTERS.index(o.letter))
                sides.append(min(o.width, o.height))
    sides, hits = np.array(sides), np.array(hits)
    print(f"letters by object: {hits.mean():.3f} of {len(hits)} lettered objects", end="")
    for lo, hi in ((28, 40), (40, 56), (56, 81)):
        m = (sides >= lo) & (sides < hi)
        print(f"; {lo}-{hi - 1} px {hits[m].mean():.3f} ({m.sum()})", end="")
    print()


if __name__ == "__main__":
    torch.manual_seed(0)
    np.random.seed(0)
    main(sys.argv[1] if len(sys.argv) > 1 else "checkpoints/shapes-qwen2vl")
