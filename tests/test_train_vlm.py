"""The embedded model's tokenizer and the training batch builder (no training run here)."""

from __future__ import annotations

import pytest
import torch

from arr_coc.data.shapesvqa import COLOR_NAMES, QUESTION_TYPES, SHAPES, make_item
from arr_coc.embedded import build_embedded, build_word_tokenizer
from arr_coc.processing import render_prompt
from arr_coc.train_vlm import Batcher, VLMTrainConfig, box_cells, choose_kept, training_item, visual_tokens


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
        _, pos, _, _, _, _, _ = batcher.build(feats[1:], grids[1:], [[q]], [torch.arange(n)])
        prefix, suffix = batcher.encode(q[0], n)
        ids = torch.tensor([prefix + suffix + [batcher.answer_id(q[1]), batcher.end_id]])
        grid_thw = processor.image_processor(images=[items[1][0]], return_tensors="pt")["image_grid_thw"]
        ref, _ = model.model.get_rope_index(ids, (ids == batcher.image_id).int(), grid_thw)
        assert torch.equal(ref[-3:, 0], pos[:, 0, : ids.shape[1]])
        # Four questions packed in one sequence (block mask) give the logits of four separate prompts.
        keep = [torch.arange(h * w)[::3] for h, w in grids]
        qs = [it[2][:4] for it in items]
        inputs, pos, mask, targets, types, sup, word_sup = batcher.build(feats, grids, qs, keep)
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
                x, p, m, _, ty, _, _ = batcher.build([feats[i]], [grids[i]], [[question]], [keep[i]])
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
        must = set().union(*(box_cells(q[3], gh, gw) for q in questions))
        assert must <= set(kept.tolist())
        assert torch.equal(kept, kept.sort().values) and kept.numel() < gh * gw


def test_chat_prompt_has_qwen_layout(embedded):
    _, processor = embedded
    text = render_prompt(processor, 1, "What color is the star?")
    assert text.endswith("What color is the star?<|im_end|>\n<|im_start|>assistant\n")
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text
