"""Fine-tuning the embedded model on ShapesVQA-video (issue 37): the vocabulary grows by the video words, the
checkpoint written reloads with them, and training steps run on clips and images through the wrapper's path."""

from __future__ import annotations

import json

import pytest
import torch

from arr_coc.paths import EMBEDDED_MODEL


def test_extend_vocabulary_adds_the_video_words_and_keeps_every_old_id():
    from arr_coc.qwen.loading import load_vlm
    from arr_coc_shapes.video import video_words
    from arr_coc_shapes.video.tuning import extend_vocabulary

    model, processor = load_vlm(EMBEDDED_MODEL, dtype="float32")
    tok = processor.tokenizer
    question = "Which way does the red circle move?"
    before_ids = tok(question, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id in before_ids                           # the negative control: words it lacked
    old_vocab, old_rows = dict(tok.get_vocab()), model.get_input_embeddings().weight.detach().clone()
    added = extend_vocabulary(model, processor, video_words())
    assert set(added) == {w for w in video_words() if w not in old_vocab} and "left" in added
    after_ids = tok(question, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in after_ids and len(after_ids) == len(before_ids)
    assert all(tok.get_vocab()[w] == i for w, i in old_vocab.items())     # no old word moved
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.shape[0] == head.shape[0] == len(old_vocab) + len(added) == model.config.text_config.vocab_size
    assert torch.equal(emb[:old_rows.shape[0]], old_rows)
    assert torch.allclose(emb[-1], old_rows.mean(0))
    assert extend_vocabulary(model, processor, video_words()) == []    # a second time adds nothing


def test_a_short_video_fine_tune_writes_a_checkpoint_that_answers_video_words(tmp_path):
    from arr_coc.qwen.loading import load_vlm
    from arr_coc_shapes.video.tuning import VIDEO_LOG, run

    torch.manual_seed(0)
    got = run(EMBEDDED_MODEL, str(tmp_path / "v"), steps=2, seconds=None, clips=1, images=1, lr=1e-4, seed=0)
    assert got["steps"] == 2 and "left" in got["words_added"]
    log = json.loads((tmp_path / "v" / VIDEO_LOG).read_text())
    assert len(log["log"]) == 2 and all(l["loss_video"] > 0 and l["loss_image"] >= 0 for l in log["log"])
    model, processor = load_vlm(str(tmp_path / "v"), dtype="float32")
    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids("left") != tok.unk_token_id     # the saved tokenizer keeps the new words
    assert model.get_output_embeddings().weight.shape[0] == len(tok.get_vocab())


def test_video_fine_tune_refuses_writing_over_its_start(tmp_path):
    from arr_coc_shapes.cli import main

    with pytest.raises(SystemExit, match="other than --init"):
        main(["train-vlm", "--video", "--init", EMBEDDED_MODEL, "--out", EMBEDDED_MODEL, "--video-steps", "1"])
