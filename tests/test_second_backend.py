"""A backend that is not Qwen runs the project's own tools end to end through the front door: `ask`, `eval` and the
lmms-eval harness (issue 62, part 2), and what it lacks is refused in one line naming the capability (training the
layer or an adapter through it: `TrainsThrough`).

The backend is docs/DESIGN.md's "VLM that is not Qwen" (a token per 16 px cell from its mean colour) reading PIL
images as the tools pass them, with the core and `CostsTower` (the evaluation counts the tower's FLOPs) only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from arr_coc import BackendEntry, register_backend
from arr_coc.cli import main
from arr_coc.pipeline import IMAGE, Prompt
from arr_coc.pipeline.pure import HostPixels
from arr_coc.pipeline.tokens import VisualRows

CELL = 16
MODEL_TYPE = "mean_colour_vl_tools"


@dataclass
class Rows:
    tokens: list
    kept_indices: list
    lengths: list
    adapted: list | None = None

    @property
    def width(self):
        return max(self.lengths)

    def rows(self, which):
        return Rows([self.tokens[b] for b in which], self.kept_indices, [self.lengths[b] for b in which])


@dataclass
class Out:
    logits: torch.Tensor = None
    new_tokens: torch.Tensor = None
    sequences: torch.Tensor = None
    prefill_s: float = 0.0
    first_logits: torch.Tensor = None


def picture(image) -> torch.Tensor:
    """A PIL image (or a [3, H, W] tensor) -> [3, H', W'] in [0, 1], cut to whole cells."""
    if not isinstance(image, torch.Tensor):
        image = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)
    h, w = image.shape[1] // CELL * CELL, image.shape[2] // CELL * CELL
    return image[:, :h, :w].contiguous()


class MeanColourTools:
    """The core's nine methods and four facts, and `CostsTower`: nothing else."""

    pad_token_id, eos_token_ids, device, text_hidden_size = 0, {1}, torch.device("cpu"), 32

    def __init__(self, folder):
        g = torch.Generator().manual_seed(0)
        self.colour, self.words = torch.randn(3, 32, generator=g), torch.randn(50, 32, generator=g)

    def build_inputs(self, visuals, questions):
        return {"pictures": [[picture(p) for p in v] for v in visuals],
                "ids": [[2 + sum(map(ord, w)) % 48 for w in str(q).split()] for q in questions]}

    def read_prompt(self, inputs, encode_all, clock=None):
        pics = [(b, p) for b, ps in enumerate(inputs["pictures"]) for p in ps]
        grids = [(p.shape[1] // CELL, p.shape[2] // CELL) for _, p in pics]
        prompt = Prompt(len(inputs["ids"]), [b for b, _ in pics], grids, [IMAGE] * len(pics), [-1] * len(pics),
                        [0] * len(pics), [0] * len(pics), native={"pictures": [p for _, p in pics],
                                                                  "ids": inputs["ids"]})
        if encode_all:
            prompt.feats = tuple(self.tower(p) for _, p in pics)
            prompt.visual = VisualRows.every_cell(prompt.feats, None)
        return prompt

    def tower(self, pic):
        h, w = pic.shape[1] // CELL, pic.shape[2] // CELL
        return torch.tanh(pic.reshape(3, h, CELL, w, CELL).mean((2, 4)).reshape(3, -1).T @ self.colour)

    def encode_units(self, prompt, units):
        return torch.cat([self.tower(prompt.native["pictures"][i]) for i in units])

    def pixels(self, prompt):
        return HostPixels(prompt.native["pictures"])

    def question_tokens(self, prompt):
        return prompt.native["ids"]

    def embed_tokens(self, ids):
        return self.words[ids]

    def decode_text(self, ids):
        return " ".join(f"w{t}" for t in ids if t > 1)

    def rewrite(self, prompt, visual, lm_cells):
        feats, _ = visual.gather([c.numpy() for c in lm_cells])
        rows = [torch.cat([feats[i] for i in prompt.units_of(b)] + [self.words[torch.tensor(q, dtype=torch.long)]])
                for b, q in enumerate(prompt.native["ids"])]
        return Rows(rows, [c.clone() for c in lm_cells], [len(r) for r in rows])

    def prefill(self, pruned, **forward):
        return Out(logits=torch.stack([r.mean(0) @ self.words.T for r in pruned.tokens]))

    def decode(self, pruned, first_logits=False, max_new_tokens=4, **generate):
        logits = self.prefill(pruned).logits
        new = torch.cat([logits.argmax(-1, keepdim=True), torch.ones(len(logits), 1, dtype=torch.long)], 1)
        return Out(new_tokens=new[:, :max_new_tokens], sequences=new, first_logits=logits if first_logits else None)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    register_backend(BackendEntry("mean-colour-tools", (MODEL_TYPE,), lambda folder, **runtime: MeanColourTools(folder)))
    out = tmp_path_factory.mktemp("mean_colour")
    (out / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE}))
    return out


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    from arr_coc_shapes import write_split

    return write_split(tmp_path_factory.mktemp("shapes"), split="test", n=6, seed=0)


def test_ask_answers_through_a_backend_that_is_not_qwen(folder, split, capsys):
    image = json.loads(open(split).readline())["image"]
    rc = main(["ask", "--model", str(folder), "--image", str(split.parent / image), "--question", "what is red",
               "--budget", "0.25", "--max-new-tokens", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["answer"].startswith("w")
    assert 0 < out["kept_tokens"] <= 0.25 * out["total_tokens"] + 1
    assert main(["ask", "--model", str(folder), "--image", str(split.parent / image), "--question", "what is red",
                 "--encode", "before"]) == 2                     # no `EncodesBefore`: said in one line, by name
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "EncodesBefore" in err[0], err


def test_eval_runs_on_a_backend_that_is_not_qwen_and_refuses_what_it_lacks(folder, split, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(folder), "--data", str(split), "--methods", "none,random,grid,arr_coc",
                 "--budgets", "0.25", "--out", str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"none", "random", "grid", "arr_coc"} and all(r["status"] == "ok" for r in rows.values())
    assert rows["arr_coc"]["kept_tokens_mean"] < rows["none"]["kept_tokens_mean"] == rows["none"]["total_tokens_mean"]
    assert rows["arr_coc"]["coverage"] is None            # no `LaysOutVisuals`: the boxes' cells are not known
    capsys.readouterr()
    assert main(["eval", "--model", str(folder), "--data", str(split), "--methods", "downscale", "--budgets", "0.25",
                 "--out", str(tmp_path / "no.json"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LaysOutVisuals" in err[0] and "downscale" in err[0], err
    assert not (tmp_path / "no.json").exists()


def test_the_lmms_eval_harness_answers_through_a_backend_that_is_not_qwen(folder, split):
    """lmms-eval's plugin, built from its --model_args, answers generate_until requests (simple layout) with it."""
    pytest.importorskip("lmms_eval")
    from lmms_eval.api.instance import Instance
    from PIL import Image

    from arr_coc.harness.lmms_eval import ARRCOCLmms

    lm = ARRCOCLmms.create_from_arg_string(f"pretrained={folder},budget=0.25,batch_size=2,device=cpu",
                                           {"batch_size": 1, "device": None})
    records = [json.loads(line) for line in open(split)][:3]
    lm.task_dict["toy"] = {"test": [dict(r, image=str(split.parent / r["image"])) for r in records]}
    requests = [Instance("generate_until", (f"<image>{r['question']}", {"max_new_tokens": 2},
                                            lambda doc: [Image.open(doc["image"]).convert("RGB")], i, "toy", "test"),
                         i, {"task": "toy", "doc_id": i, "repeats": 1}) for i, r in enumerate(records)]
    answers = [getattr(a, "text", a) for a in lm.generate_until(requests)]
    assert len(answers) == 3 and all(a.startswith("w") for a in answers)
    assert 0 < lm.usage["kept_tokens"] < lm.usage["total_tokens"] and lm.usage["requests"] == 3


def test_a_backend_without_from_scratch_is_refused_by_the_test_bed_s_kit_in_one_line(folder):
    """The ShapesVQA test bed and the bench ask the registry for a family's `FromScratch` by model type: a backend
    that builds nothing from scratch is refused by name; a Qwen family gives one (no backend import needed)."""
    from arr_coc.pipeline.registry import FromScratch, scratch_kit

    with pytest.raises(ValueError, match=r"'mean-colour-tools' .* builds no model from scratch: .*FromScratch") as no:
        scratch_kit(MODEL_TYPE)
    assert "\n" not in str(no.value)
    kit = scratch_kit("qwen2_vl")
    assert isinstance(kit, FromScratch) and kit.image_token == "<|image_pad|>"


@pytest.mark.parametrize("command", ["train", "train-adapter"])
def test_training_through_a_backend_without_trains_through_is_refused_in_one_line(folder, split, tmp_path, capsys,
                                                                                   command):
    """Both trainings need losses through the frozen VLM: refused by name right after the model loads, before a
    feature is extracted or a step runs (nothing written but the --out folder the command checks first)."""
    out = tmp_path / command
    args = ["--stage", "1", "--data", str(split)] if command == "train" else ["--data", str(split), "--val-items", "2"]
    assert main([command, "--model", str(folder), "--out", str(out), "--steps", "1", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not implement TrainsThrough" in err[0] and f"({command})" in err[0], err
    assert not out.exists() or list(out.iterdir()) == []


def test_the_front_door_saves_its_layer_through_a_backend_without_adapters_and_loads_it_back(folder, tmp_path):
    """`ARRCOC.save_pretrained` on a backend without `Adapts`: the layer's files alone (no adapter/), and a front
    door over that folder holds the same weights (a layer of its own seed differs: the check can fail)."""
    from arr_coc import ARRCOC

    torch.manual_seed(1)
    vlm = ARRCOC.from_pretrained(str(folder), arr_coc=None)
    vlm.save_pretrained(tmp_path / "layer")
    assert sorted(p.name for p in (tmp_path / "layer").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    again = ARRCOC.from_pretrained(str(folder), arr_coc=str(tmp_path / "layer"))
    saved, loaded = vlm.layer.state_dict(), again.layer.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    torch.manual_seed(2)
    other = ARRCOC.from_pretrained(str(folder), arr_coc=None).layer.state_dict()
    assert any(not torch.equal(saved[k], other[k]) for k in saved)
