"""The embedded model (arr_coc_shapes.embedded) and its training (arr_coc_shapes.trainer and the modules it uses):
the tokenizer, the batch builder, the supervision, one two-step training run, and the train-vlm command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arr_coc.qwen.processing import render_prompt
from arr_coc_shapes import COLOR_NAMES, QUESTION_TYPES, SHAPES, make_item
from arr_coc_shapes.batching import Batcher, visual_tokens
from arr_coc_shapes.embedded import build_embedded, build_word_tokenizer
from arr_coc_shapes.supervision import answer_cells, choose_kept, training_item
from arr_coc_shapes.vlm_config import VLMTrainConfig


@pytest.fixture(scope="module")
def embedded():
    model, processor = build_embedded(seed=0)
    model.eval()
    return model, processor


def ids_at(inputs, row, positions, model):
    """Token ids of input embeddings (exact rows of the embedding table)."""
    table = model.get_input_embeddings().weight
    return [int((table - inputs[row, int(p)]).abs().sum(1).argmin()) for p in positions]


def test_word_tokenizer_covers_every_benchmark_question_and_answer():
    tok = build_word_tokenizer()
    for i in range(60):
        rec = make_item(5, "tok", i).record
        ids = tok(rec["question"] + " " + rec["answers"][0], add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, rec["question"]
        assert len(tok(rec["answers"][0], add_special_tokens=False)["input_ids"]) == 1
    assert tok.decode(tok("What color is the star?")["input_ids"]) == "what color is the star?"
    assert tok.unk_token_id in tok("What is a zebra?")["input_ids"]  # unknown words map to <unk>, no crash


def test_positions_match_get_rope_index_and_packed_questions_match_single_prompts(embedded):
    model, processor = embedded
    cfg = VLMTrainConfig()
    batcher = Batcher(model, processor)
    items = [training_item(cfg, i) for i in range(2)]
    feats, grids = visual_tokens(model, processor, [it[0] for it in items])
    with torch.no_grad():
        # Positions of a single-question prompt == the model's own get_rope_index.
        q = items[1][2][0]
        n = grids[1][0] * grids[1][1]
        _, pos, _, _, _, _ = batcher.build(feats[1:], grids[1:], [[q]], [torch.arange(n)])
        prefix, suffix = batcher.encode(q[0], n)
        ids = torch.tensor([prefix + suffix + [batcher.answer_id(q[1]), batcher.end_id]])
        grid_thw = processor.image_processor(images=[items[1][0]], return_tensors="pt")["image_grid_thw"]
        ref, _ = model.model.get_rope_index(ids, (ids == batcher.image_id).int(), grid_thw)
        assert torch.equal(ref[-3:, 0], pos[:, 0, : ids.shape[1]])
        # Four questions packed in one sequence (block mask) give the logits of four separate prompts.
        keep = [torch.arange(h * w)[::3] for h, w in grids]
        qs = [it[2][:4] for it in items]
        inputs, pos, mask, targets, types, supervision = batcher.build(feats, grids, qs, keep)
        sup, word_sup = supervision.cells, supervision.words
        # Attention supervision points at the answer positions and at the kept answer cells.
        assert sup and all(types[r][p] is not None for r, p, _ in sup)
        assert all(int(c.min()) >= 0 and int(c.max()) < inputs.shape[1] for _, _, c in sup)
        # ... and, for layer 0, at the question's colour / shape words, before the answer position.
        assert len(word_sup) == sum(len(q) for q in qs)
        words = {processor.tokenizer.convert_ids_to_tokens(int(t)) for r, p, w in word_sup for t in ids_at(inputs, r, w, model)}
        assert words and words <= set(COLOR_NAMES) | set(SHAPES) | {f"{s}s" for s in SHAPES}
        assert all(int(w.max()) < p for _, p, w in word_sup)
        lm = model.model.language_model
        logits = model.lm_head(lm(inputs_embeds=inputs, position_ids=pos, attention_mask=mask).last_hidden_state)
        for i in range(2):
            at = [j for j, t in enumerate(types[i]) if t is not None]
            assert len(at) == 4 and all(types[i][j] in QUESTION_TYPES for j in at)
            for s, question in enumerate(qs[i]):
                x, p, m, _, ty, _ = batcher.build([feats[i]], [grids[i]], [[question]], [keep[i]])
                single = model.lm_head(lm(inputs_embeds=x, position_ids=p, attention_mask=m).last_hidden_state)
                j = [k for k, t in enumerate(ty[0]) if t is not None][0]
                assert torch.allclose(single[0, j], logits[i, at[s]], atol=1e-5)


def test_visual_token_dropout_keeps_every_answer_cell():
    cfg = VLMTrainConfig(full_p=0.0, keep_min=0.0)
    gen = torch.Generator().manual_seed(0)
    for i in range(10):
        image, scene, questions = training_item(cfg, i)
        gh, gw = image.size[1] // 28, image.size[0] // 28
        kept = choose_kept(questions, gh, gw, gen, cfg)
        must = set().union(*(answer_cells(q[3], gh, gw) for q in questions))
        assert must <= set(kept.tolist())
        assert torch.equal(kept, kept.sort().values) and kept.numel() < gh * gw


def _loop_box_cells(boxes, gh: int, gw: int) -> set[int]:
    """train_vlm's own box -> cells loop before it used arr_coc.geometry (4732cd3), kept as the reference."""
    cells = set()
    for x0, y0, x1, y1 in boxes:
        for r in range(int(y0 // 28), min(gh, int(math.ceil(y1 / 28)))):
            for c in range(int(x0 // 28), min(gw, int(math.ceil(x1 / 28)))):
                cells.add(r * gw + c)
    return cells


def _loop_centre_cells(boxes, gh: int, gw: int) -> list[int]:
    """train_vlm's own centre-cell rule before it used arr_coc.geometry (4732cd3)."""
    return [min(gh - 1, int((y0 + y1) / 2 // 28)) * gw + min(gw - 1, int((x0 + x1) / 2 // 28))
            for x0, y0, x1, y1 in boxes]


def test_geometry_gives_train_vlms_old_answer_and_centre_cells_on_generated_scenes():
    """arr_coc.geometry (area overlap) == the old floor/ceil loop, on 2,000 scenes of every canvas size.

    Equal as sets for every whole scene and every group a count question names (all objects of one
    shape: together they cover every box), and `answer_cells` iterates in the same order as the old
    set (the attention loss sums in that order, so training stays bit-identical).
    """
    from arr_coc.geometry import box_cell_set, centre_cells
    from arr_coc_shapes import HARD_KINDS, generate_scene, item_rng
    from arr_coc_shapes.layout import draw_canvas

    checked = reordered = 0
    for i in range(2000):
        rng = item_rng(0, "geometry", i)
        size = draw_canvas(rng, "random")
        scene = generate_scene(rng, size, hard=(None, *HARD_KINDS)[i % 4])
        gh, gw = size[1] // 28, size[0] // 28
        boxes = [o.box for o in scene.objects]
        assert box_cell_set(boxes, (gh, gw), size) == _loop_box_cells(boxes, gh, gw), i
        assert centre_cells(boxes, (gh, gw), 28) == _loop_centre_cells(boxes, gh, gw), i
        for shape in sorted({o.shape for o in scene.objects}):
            group = [o.box for o in scene.objects if o.shape == shape]
            old, new = _loop_box_cells(group, gh, gw), answer_cells(group, gh, gw)
            assert new == old and list(new) == list(old), (i, group)
            reordered += list(old) != sorted(old)
            checked += 1
    assert checked > 9_000 and reordered > 100  # the order check is not vacuous: sets often iterate unsorted


def test_chat_prompt_has_qwen_layout(embedded):
    _, processor = embedded
    text = render_prompt(processor, 1, "What color is the star?")
    assert text.endswith("What color is the star?<|im_end|>\n<|im_start|>assistant\n")
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text


def test_recorded_attention_rows_equal_eager_attention_weights():
    from arr_coc_shapes.attention import SUPERVISED_SDPA, AttentionRecorder

    model, processor = build_embedded(seed=3)
    model.eval()
    lm = model.model.language_model
    batcher = Batcher(model, processor)
    cfg = VLMTrainConfig()
    items = [training_item(cfg, i) for i in range(2)]
    feats, grids = visual_tokens(model, processor, [it[0] for it in items])
    keep = [torch.arange(h * w)[::2] for h, w in grids]
    with torch.no_grad():
        inputs, pos, mask, _, _, sup = batcher.build(feats, grids, [it[2][:3] for it in items], keep)
        lm.set_attn_implementation("eager")
        ref = lm(inputs_embeds=inputs, position_ids=pos, attention_mask=mask, output_attentions=True)
        recorder = AttentionRecorder(lm, {0: (0,), 2: (0, 4)})
        lm.set_attn_implementation(SUPERVISED_SDPA)
        rows, positions, _ = sup.rows()
        recorder.request(rows, positions)
        out = lm(inputs_embeds=inputs, position_ids=pos, attention_mask=mask)
    assert len(rows) == 6 and set(recorder.probs) == {(0, 0), (2, 0), (2, 4)}
    for layer, head in recorder.probs:
        expected = ref.attentions[layer][rows, head, positions]
        assert torch.allclose(recorder.probs[(layer, head)], expected, atol=1e-6)
    assert torch.allclose(out.last_hidden_state, ref.last_hidden_state, atol=1e-5)  # the forward is plain sdpa


def test_count_supervision_marks_one_centre_cell_per_counted_object(embedded):
    from arr_coc.geometry import centre_cells
    from arr_coc_shapes.losses import count_loss

    model, processor = embedded
    batcher = Batcher(model, processor)
    cfg = VLMTrainConfig()
    image, scene, questions = training_item(cfg, 0)
    gh, gw = image.height // 28, image.width // 28
    shape = next(o.shape for o in scene.objects)
    n = sum(o.shape == shape for o in scene.objects)
    boxes = [o.box for o in scene.objects if o.shape == shape]
    count_q = (f"How many {shape}s are there?", str(n), "count", boxes)
    zero = next(s for s in SHAPES if all(o.shape != s for o in scene.objects)) if n < len(scene.objects) else None
    qs = [count_q] + ([(f"How many {zero}s are there?", "0", "count", [])] if zero else [])
    feats, grids = visual_tokens(model, processor, [image])
    _, _, _, _, _, sup = batcher.build(feats, grids, [qs], [torch.arange(gh * gw)])
    assert len(sup.count) == len(qs)
    n_text = len(batcher.encode(qs[0][0], 0)[0])
    assert sorted(int(c) - n_text for c in sup.count[0][2]) == sorted(centre_cells(boxes, (gh, gw), 28))
    assert len(sup.count[0][2]) == n
    if zero:
        assert sup.count[1][2].numel() == 0
    # The loss is minimal (the target's entropy) exactly at the target distribution.
    _, _, index = sup.rows()
    L = int(sup.count[0][1]) + 1
    target = torch.zeros(len(index), L)
    for r, p, cells in sup.count:
        target[index[(r, p)], 0] = 5.0
        target[index[(r, p)], cells] = 1.0
    target = target / target.sum(-1, keepdim=True).clamp_min(1)
    uniform = torch.full_like(target, 1.0 / L)
    at_target = count_loss({(2, 1): target}, sup.count, index, 2, 1, 5.0)
    assert at_target < count_loss({(2, 1): uniform}, sup.count, index, 2, 1, 5.0)


def test_vision_tiles_are_aligned_with_their_labels():
    import numpy as np

    from arr_coc_shapes import COLORS
    from arr_coc_shapes.supervision import crops_for_vision

    cfg = VLMTrainConfig()
    image, scene, _ = training_item(cfg, 3, letter_rate=0.9)
    tiles = crops_for_vision(image, scene, 8, np.random.default_rng(0))
    assert len(tiles) >= (image.height // 224) * (image.width // 224)
    checked = 0
    for tile, labels in tiles:
        assert tile.size == (224, 224) and labels["color"].shape == (64,)
        pixels = np.asarray(tile, dtype=np.int32).reshape(8, 28, 8, 28, 3).transpose(0, 2, 1, 3, 4).reshape(64, -1, 3)
        for cell in labels["color"].nonzero()[:, 0].tolist():
            rgb = np.asarray(COLORS[COLOR_NAMES[int(labels["color"][cell]) - 1]])
            near = (np.abs(pixels[cell] - rgb).max(axis=1) <= 20).mean()
            assert near > 0.05, f"cell {cell} labelled {COLOR_NAMES[int(labels['color'][cell]) - 1]} has no such pixels"
            checked += 1
    assert checked > 10


def test_letter_tiles_hold_one_whole_lettered_object_each():
    import numpy as np

    from arr_coc_shapes import LETTERS
    from arr_coc_shapes.supervision import letter_tiles
    from arr_coc_shapes.vlm_config import LETTER_TILE_CELLS

    cfg = VLMTrainConfig()
    image, scene, _ = training_item(cfg, 3, letter_rate=0.9)
    lettered = [o for o in scene.objects if o.letter]
    tiles = letter_tiles(image, scene, LETTER_TILE_CELLS, np.random.default_rng(0))
    assert len(lettered) >= 3 and len(tiles) == len(lettered)  # every object fits: boxes <= 64 px < 84 px
    side = LETTER_TILE_CELLS * 28
    for (tile, labels), obj in zip(tiles, lettered):
        assert tile.size == (side, side) and labels["letter"].shape == (LETTER_TILE_CELLS**2,)
        assert int((labels["letter"] == LETTERS.index(obj.letter) + 1).sum()) >= 1


def test_warm_start_from_a_checkpoint_folder_loads_every_weight(tmp_path, embedded):
    from arr_coc_shapes.checkpoint import warm_start
    from arr_coc_shapes.losses import DenseHead

    model, processor = embedded
    model.save_pretrained(tmp_path)
    (tmp_path / "training_log.json").write_text('{"progress": {"item": 4321}}')
    fresh, _ = build_embedded(seed=1)
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert warm_start(fresh, DenseHead(fresh, processor.tokenizer), str(tmp_path)) == 4321
    theirs = model.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in fresh.state_dict().items())


def test_count_heads_are_parsed_checked_against_the_lm_and_recorded_by_a_two_step_run(tmp_path):
    from arr_coc_shapes.cli.train_vlm import parse_count_heads
    from arr_coc_shapes.trainer import train

    assert parse_count_heads("2.1:5, 2.2:1.5") == ((2, 1, 5.0), (2, 2, 1.5))
    with pytest.raises(SystemExit, match="LAYER.HEAD:SINK"):
        parse_count_heads("2:5")
    with pytest.raises(ValueError, match="does not fit this LM"):
        train(VLMTrainConfig(out=str(tmp_path / "bad"), count_heads=((2, 6, 1.0),)), progress=False)

    cfg = VLMTrainConfig(out=str(tmp_path / "ckpt"), state=str(tmp_path / "state.pt"), steps=(0, 0, 2),
                         images_per_step=(2, 2, 2), questions_per_image=8, val_items=4, eval_every=2,
                         count_heads=((2, 1, 5.0), (2, 2, 1.5)), count_balance=8.0, count_prior_items=20)
    state = train(cfg, progress=False)
    assert state["step"] == 0 and state["stage"] == 3  # all three stages done
    log = json.loads((tmp_path / "ckpt" / "training_log.json").read_text())
    assert log["config"]["count_heads"] == [[2, 1, 5.0], [2, 2, 1.5]] and log["config"]["count_balance"] == 8.0
    assert any("val" in r for r in log["log"])


def test_count_balance_weights_count_answers_to_a_uniform_prior_and_leaves_others_alone(embedded):
    from collections import Counter

    from arr_coc_shapes.losses import count_answer_weights

    model, processor = embedded
    batcher = Batcher(model, processor)
    cfg = VLMTrainConfig(count_balance=8.0, count_prior_items=60)
    weights = count_answer_weights(cfg, batcher, model.config.text_config.vocab_size)
    tally = Counter(a for i in range(60) for _, a, t, _ in training_item(cfg, i)[2] if t == "count")
    w = {a: float(weights[batcher.answer_id(a)]) for a in map(str, range(10))}
    assert w["8"] > w["2"] > 0 and tally["8"] < tally["2"]  # rare large counts weigh more
    # Weighted, every count answer seen more often than the cap allows for carries the same mass ...
    mass = {a: tally[a] * w[a] for a in w if tally[a] * 8.0 * 10 > sum(tally.values())}
    assert max(mass.values()) == pytest.approx(min(mass.values()), rel=1e-5)
    # ... the mean weight over the training count answers is 1, and no other answer is reweighted.
    assert sum(tally[a] * w[a] for a in w) / sum(tally.values()) == pytest.approx(1.0, rel=1e-5)
    others = [i for i in range(len(weights)) if i not in {batcher.answer_id(a) for a in w}]
    assert torch.all(weights[others] == 1.0)


@pytest.mark.parametrize("command", ["gen-data", "train-vlm"])
def test_command_help_imports_no_torch(command):
    """The CLI imports only the chosen command's module, and these two read their defaults without torch."""
    code = ("import contextlib, io, sys\nfrom arr_coc_shapes.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            f"    try:\n        main([{command!r}, '--help'])\n    except SystemExit:\n        pass\n"
            "assert '--out' in out.getvalue()\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.strip() == "[]"
