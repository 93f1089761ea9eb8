"""ARRCOCQwen on tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models (CPU, offline).

What a user would notice if the pruning path were wrong: different logits with
every token kept, answers that change when the batch changes, a cache that
changes greedy output, beams that crash, one bad item taking the batch down,
or the prompt echoed in the answer. The masked-attention reference pins the
exact semantics of pruning: a kept token must see exactly the kept tokens, at
their ORIGINAL positions. Negative controls prove that comparison can fail.
"""

from __future__ import annotations

from _pruned import forward_pruned, prepare_state  # noqa: F401
import argparse
import json
import logging

import pytest
import torch

from arr_coc.budget import resolve_count
from arr_coc.qwen import ARRCOCQwen, PrunedInputs
from arr_coc.pipeline.selection import SELECTORS, Selection, get_selector, register_selector
from arr_coc.qwen.processing import ImageOnlyQwenProcessor, unpatchify_images

from conftest import FAMILIES

Q = "What colour is the circle?"
Q2 = "Is there a red square on the left?"
ATTN = ("sdpa", "eager")


def _wrapper(tiny_vlm, family: str, attn: str = "sdpa", **kw) -> ARRCOCQwen:
    model, processor = tiny_vlm(family, attn)
    return ARRCOCQwen(model, processor, **kw)


def _strip(row: torch.Tensor, pad: int) -> list[int]:
    out = row.tolist()
    while out and out[-1] == pad:
        out.pop()
    return out


@torch.no_grad()
def masked_reference_logits(w: ARRCOCQwen, inputs: dict, pruned: PrunedInputs) -> torch.Tensor:
    """The full unpruned sequence, stock positions, but every dropped visual token masked out of
    attention as a key (4-D additive mask). Kept tokens then see exactly what they see pruned."""
    ids = inputs["input_ids"]
    B, S = ids.shape
    pos3, _ = w.model.model.get_rope_index(
        ids, mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    kept = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        o = pruned.orig_index[b]
        kept[b, o[o >= 0]] = True
    allowed = torch.tril(torch.ones(S, S, dtype=torch.bool))[None] & kept[:, None, :]
    allowed |= torch.eye(S, dtype=torch.bool)[None]  # a dropped row still sees itself (its output is unused)
    mask = torch.zeros(B, 1, S, S).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    out = w.model(
        input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
        attention_mask=mask, position_ids=pos3,
    )
    return out.logits


def _diff_at_kept(logits: torch.Tensor, ref: torch.Tensor, pruned: PrunedInputs) -> float:
    worst = 0.0
    for b in range(logits.shape[0]):
        o = pruned.orig_index[b]
        valid = o >= 0
        worst = max(worst, (logits[b, valid] - ref[b, o[valid]]).abs().max().item())
    return worst


def _two_image_prompt(w: ARRCOCQwen, make_image) -> dict:
    return w.build_inputs([[make_image(120, 150, 0), make_image(90, 200, 1)]], [Q])


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_keep_all_equals_stock_logits_and_tokens(tiny_vlm, make_image, family, attn):
    w = _wrapper(tiny_vlm, family, attn)
    # Two rows, different image sizes -> left padding is exercised too.
    inputs = w.build_inputs([[make_image(120, 150, 0)], [make_image(90, 200, 1)]], [Q, Q2])
    with torch.no_grad():
        stock = w.model(**inputs).logits
    for method, budget in (("none", None), ("arr_coc", 1.0), ("grid", 1.0), ("random", 1.0)):
        out = forward_pruned(w, method=method, budget=budget, **inputs)
        assert out.logits.shape == stock.shape, method
        assert (out.logits - stock).abs().max().item() <= 1e-6, method
        assert all(t.kept_tokens == t.total_tokens for t in out.traces), method
    with torch.no_grad():
        stock_tokens = w.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    ours = w.model_generate(method="none", max_new_tokens=6, **inputs)
    assert torch.equal(ours, stock_tokens)


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_prefill_equals_masked_reference(tiny_vlm, make_image, family, attn):
    w = _wrapper(tiny_vlm, family, attn)
    inputs = _two_image_prompt(w, make_image)  # one question, two images, each its own budget
    out = forward_pruned(w, method="random", budget=[[0.25, 0.5]], **inputs)
    n = out.traces[0].total_per_image
    assert out.traces[0].kept_per_image == [resolve_count(0.25, n[0]), resolve_count(0.5, n[1])]
    pads = (out.pruned.input_ids == w.image_token_id).sum().item()
    assert pads == sum(out.traces[0].kept_per_image)  # exactly K image pads per image
    ref = masked_reference_logits(w, inputs, out.pruned)
    assert _diff_at_kept(out.logits, ref, out.pruned) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_controls_fail_the_reference_comparison(tiny_vlm, make_image, family):
    """Each broken variant must miss the masked reference by far more than the 1e-5 tolerance."""
    w = _wrapper(tiny_vlm, family)
    inputs = _two_image_prompt(w, make_image)
    out = forward_pruned(w, method="random", budget=[[0.25, 0.5]], **inputs)
    p = out.pruned
    ref = masked_reference_logits(w, inputs, p)
    assert _diff_at_kept(out.logits, ref, p) <= 1e-5  # the correct path passes

    def miss(variant: PrunedInputs) -> float:
        return _diff_at_kept(w.backend.prefill(variant).logits, ref, p)

    # 1. 1-D positions (the text counter on all three M-RoPE axes).
    assert miss(p.with_features(position_ids=p.position_ids[0])) > 1e-4

    # 2. Text after each image shifted back by that image's dropped count (as if the
    #    pruned sequence were re-numbered), visual (t, h, w) left as they are.
    pos = p.position_ids.clone()
    is_img = (p.input_ids[0] == w.image_token_id).tolist()
    dropped = [f.shape[0] - k for f, k in zip(p.full_features, p.kept_counts)]
    shift, image_no = 0, 0
    for j in range(1, len(is_img)):
        if is_img[j - 1] and not is_img[j]:
            shift += dropped[image_no]
            image_no += 1
        if not is_img[j]:
            pos[1:, 0, j] -= shift
    assert miss(p.with_features(position_ids=pos)) > 1e-4

    # 3. Right positions, features of the wrong tokens (the neighbour of each kept one).
    wrong = [f[(k + 1) % f.shape[0]] for f, k in zip(p.full_features, p.kept_indices)]
    assert miss(p.with_features(image_features=wrong)) > 1e-4

    # 4. Qwen3-VL: deepstack features indexed with other indices than the main tokens.
    if family == "qwen3_vl":
        assert p.deepstack_features is not None
        bad = [[f[(k + 1) % f.shape[0]] for f, k in zip(layer, p.kept_indices)] for layer in p.full_deepstack]
        assert miss(p.with_features(deepstack_features=bad)) > 1e-4
    else:
        assert p.deepstack_features is None


# ----------------------------------------------------------------------------- generation


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_and_without_cache_identical(tiny_vlm, make_image, family):
    w = _wrapper(tiny_vlm, family)
    inputs = w.build_inputs([[make_image(120, 150, 0)], [make_image(90, 200, 1)]], [Q, Q2])
    cached = w.model_generate(budget=0.25, method="arr_coc", max_new_tokens=6, use_cache=True, **inputs)
    uncached = w.model_generate(budget=0.25, method="arr_coc", max_new_tokens=6, use_cache=False, **inputs)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ("arr_coc", "random"))
def test_batch_equals_each_item_alone(tiny_vlm, make_image, family, method):
    w = _wrapper(tiny_vlm, family)
    images = [make_image(120, 150, 0), make_image(90, 200, 1)]
    questions, budgets = [Q, Q2], [0.25, 0.5]
    batch = w.build_inputs([[im] for im in images], questions)
    out_b = forward_pruned(w, method=method, budget=budgets, **batch)
    gen_b = w.model_generate(method=method, budget=budgets, max_new_tokens=6, **batch)
    new_b = gen_b[:, batch["input_ids"].shape[1]:]
    assert out_b.traces[0].total_tokens != out_b.traces[1].total_tokens  # different sizes
    for i, (im, q, bud) in enumerate(zip(images, questions, budgets)):
        alone = w.build_inputs([[im]], [q])
        out_a = forward_pruned(w, method=method, budget=bud, **alone)
        assert torch.equal(out_a.traces[0].kept_indices[0], out_b.traces[i].kept_indices[0])
        if method == "arr_coc":  # the trace carries this item's slice of the layer output
            arr = out_b.traces[i].arr_coc
            assert type(arr).__name__ == "ARRCOCOutput" and len(arr) == 1 and arr.relevance.shape[0] == 1
            assert torch.equal(arr.kept_indices[0], out_b.traces[i].kept_indices[0])
        assert out_a.traces[0].kept_tokens < out_a.traces[0].total_tokens
        assert (out_a.logits[0, -1] - out_b.logits[i, -1]).abs().max().item() <= 1e-5
        gen_a = w.model_generate(method=method, budget=bud, max_new_tokens=6, **alone)
        new_a = gen_a[0, alone["input_ids"].shape[1]:]
        assert _strip(new_a, w.pad_token_id) == _strip(new_b[i], w.pad_token_id)


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_on_pruned_inputs(tiny_vlm, make_image, family):
    w = _wrapper(tiny_vlm, family)
    images, questions = [make_image(120, 150, 0), [make_image(90, 200, 1), make_image(64, 64, 2)]], [Q, Q2]
    answers, traces = w.generate(images, questions, budget=0.25, max_new_tokens=4,
                                 num_beams=3, num_return_sequences=2)
    assert len(answers) == 2 and all(isinstance(a, list) and len(a) == 2 for a in answers)
    assert all(t.kept_tokens < t.total_tokens for t in traces)
    # Kept-all beams equal the stock beams: the encoder outputs are expanded per beam correctly.
    inputs = w.build_inputs([[images[0]], images[1]], questions)
    with torch.no_grad():
        stock = w.model.generate(**inputs, max_new_tokens=4, num_beams=3, num_return_sequences=2, do_sample=False)
    ours = w.model_generate(method="none", max_new_tokens=4, num_beams=3, num_return_sequences=2, **inputs)
    assert torch.equal(ours, stock)


@pytest.mark.parametrize("family", FAMILIES)
def test_answers_never_contain_the_prompt(tiny_vlm, make_image, family):
    w = _wrapper(tiny_vlm, family)
    images, questions = [make_image(120, 150, 0), make_image(90, 200, 1)], [Q, Q2]
    answers, traces = w.generate(images, questions, budget=0.25, max_new_tokens=6)
    inputs = w.build_inputs([[im] for im in images], questions)
    seqs = w.model_generate(budget=0.25, max_new_tokens=6, **inputs)
    S = inputs["input_ids"].shape[1]
    assert torch.equal(seqs[:, :S], inputs["input_ids"])  # drop-in: the caller's prompt, then new tokens
    assert answers == w.tokenizer.batch_decode(seqs[:, S:], skip_special_tokens=True)
    for a, q, t in zip(answers, questions, traces):
        assert q not in a and "assistant" not in a and "You are a helpful" not in a
        assert 0 < t.new_tokens <= 6
        assert t.prompt_tokens < inputs["attention_mask"][0].numel() + 1


# ----------------------------------------------------------------------------- failure isolation


class _FailOnCells(torch.nn.Module):
    """A scorer stage that raises for any batch holding an image of `n_cells` merged tokens."""

    def __init__(self, inner: torch.nn.Module, n_cells: int):
        super().__init__()
        self.inner, self.n_cells = inner, n_cells

    def forward(self, texture, valid, *args, **kwargs):
        if (valid.flatten(1).sum(1) == self.n_cells).any():
            raise RuntimeError("forced scorer failure")
        return self.inner(texture, valid, *args, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_scorer_failure_falls_back_to_all_tokens_for_that_item_only(tiny_vlm, make_image, family):
    from arr_coc import ARRCOCConfig, ARRCOCLayer

    model, processor = tiny_vlm(family)
    d = model.get_input_embeddings().weight.shape[1]
    cfg = ARRCOCConfig().with_query_dim(d)
    images, questions = [make_image(120, 150, 0), make_image(90, 200, 1)], [Q, Q2]
    plain = ARRCOCQwen(model, processor)
    n_fail = forward_pruned(plain, method="none", **plain.build_inputs([[images[1]]], [Q2])).traces[0].total_tokens
    good = ARRCOCLayer(cfg)
    # The layer receives its stages: the same stages, one wrapped to fail on item 1's image.
    bad = ARRCOCLayer(cfg, information=good.information, perspectival=good.perspectival,
                      participatory=_FailOnCells(good.participatory, n_fail), balancer=good.balancer,
                      allocator=good.allocator)
    w = ARRCOCQwen(model, processor, arr_coc=bad)
    answers, traces = w.generate(images, questions, budget=0.25, max_new_tokens=5)
    assert traces[0].kept_tokens < traces[0].total_tokens and traces[0].fallback != ["keep_all"]
    assert traces[1].kept_tokens == traces[1].total_tokens == n_fail
    assert traces[1].fallback == ["keep_all"] and "forced scorer failure" in traces[1].error
    # The failed item answers exactly as unpruned; the other exactly as with a healthy layer.
    assert answers[1] == w.generate(images[1], Q2, method="none", max_new_tokens=5)[0]
    healthy = ARRCOCQwen(model, processor, arr_coc=good)
    assert answers[0] == healthy.generate(images[0], Q, budget=0.25, max_new_tokens=5)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_selector_exception_isolated_to_its_item(tiny_vlm, make_image, family):
    w = _wrapper(tiny_vlm, family)
    images = [make_image(120, 150, 0), make_image(90, 200, 1)]
    bad_n = w.generate(images[1], Q2, method="none", max_new_tokens=1)[1].total_tokens

    def flaky(ctx):
        if any(h * ww == bad_n for h, ww in ctx.grid_hw):
            raise RuntimeError("selector blew up")
        return get_selector("grid")(ctx)

    answers, traces = w.generate(images, [Q, Q2], method=flaky, budget=0.25, max_new_tokens=3)
    assert traces[0].kept_tokens < traces[0].total_tokens and traces[0].error is None
    assert traces[1].kept_tokens == traces[1].total_tokens and "selector blew up" in traces[1].error
    assert traces[1].fallback == ["keep_all"]


# ----------------------------------------------------------------------------- API surface


@pytest.mark.parametrize("family", FAMILIES)
def test_texture_source_is_the_processor_resized_image(tiny_vlm, make_image, family):
    from PIL import Image

    w = _wrapper(tiny_vlm, family)
    img = make_image(90, 200, 3)
    inputs = w.build_inputs([[img]], [Q])
    (rec,) = unpatchify_images(inputs["pixel_values"], inputs["image_grid_thw"], w.processor.image_processor)
    _, H, W = rec.shape
    unit = 32 if family == "qwen3_vl" else 28
    assert H % unit == 0 and W % unit == 0
    resized = torch.tensor(list(img.resize((W, H), Image.BICUBIC).getdata()), dtype=torch.float32)
    resized = resized.reshape(H, W, 3).permute(2, 0, 1) / 255.0
    assert (rec - resized).abs().max().item() <= 1e-5


def test_budget_forms_and_selector_registry(tiny_vlm, make_image):
    w = _wrapper(tiny_vlm, "qwen2_vl")
    a, b, c = make_image(120, 150, 0), make_image(90, 200, 1), make_image(64, 64, 2)
    # int count, per-row, per-image-within-row
    _, tr = w.generate([[a, b], c], [Q, Q2], budget=[[3, 0.5], 2], method="grid", max_new_tokens=1)
    assert tr[0].kept_per_image == [3, resolve_count(0.5, tr[0].total_per_image[1])] and tr[1].kept_per_image == [2]
    with pytest.raises(ValueError, match="one per question"):
        w.generate([a, b], [Q, Q2], budget=[0.1, 0.2, 0.3], method="grid", max_new_tokens=1)
    with pytest.raises(ValueError, match="registered"):
        w.generate(a, Q, method="no-such-method", max_new_tokens=1)

    @register_selector("test_first_k", overwrite=True)
    def first_k(ctx):
        return Selection(kept=[torch.arange(k) for k in ctx.counts])

    try:
        _, t = w.generate(a, Q, budget=4, method="test_first_k", max_new_tokens=1)
        assert t.method == "test_first_k" and t.kept_indices[0].tolist() == [0, 1, 2, 3]
        # An invalid selection (out of range) keeps all tokens and says why.
        register_selector("test_bad", lambda ctx: [torch.tensor([10_000])], overwrite=True)
        _, t = w.generate(a, Q, method="test_bad", max_new_tokens=1)
        assert t.kept_tokens == t.total_tokens and t.fallback == ["keep_all"] and "outside" in t.error
    finally:
        SELECTORS.pop("test_first_k", None)
        SELECTORS.pop("test_bad", None)


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_offline_folder(tiny_vlm, make_image, family, tmp_path, caplog):
    model, processor = tiny_vlm(family)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="arr_coc.qwen.processing"):
        w = ARRCOCQwen.from_pretrained(str(tmp_path))
    assert w.family == family and not any(p.requires_grad for p in w.model.parameters()) and not w.model.training
    if isinstance(w.processor, ImageOnlyQwenProcessor):  # no torchvision here: our processor reads videos itself
        assert "torchvision" not in caplog.text and "image-only" not in caplog.text
        from arr_coc.video import load_clip
        enc = w.processor(text=["<|vision_start|><|video_pad|><|vision_end|>"],
                          videos=[load_clip([make_image(56, 56, 0)] * 2)])
        assert enc["video_grid_thw"].shape == (1, 3) and int(enc["video_grid_thw"][0, 0]) == 1
    ref = _wrapper(tiny_vlm, family)
    img = make_image(120, 150, 0)
    assert w.generate(img, Q, budget=0.25, method="grid", max_new_tokens=4)[0] == \
        ref.generate(img, Q, budget=0.25, method="grid", max_new_tokens=4)[0]


def test_cli_ask_json(tiny_vlm, make_image, tmp_path, capsys):
    from arr_coc.cli import ask as cli_ask

    model, processor = tiny_vlm("qwen2_vl")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    processor.save_pretrained(str(folder))
    image = tmp_path / "img.png"
    make_image(120, 150, 0).save(image)
    parser = argparse.ArgumentParser()
    cli_ask.add_arguments(parser)
    for method, budget in (("arr_coc", "0.25"), ("none", "0.25")):
        args = parser.parse_args(["--model", str(folder), "--image", str(image), "--question", Q,
                                  "--budget", budget, "--method", method, "--max-new-tokens", "3", "--json"])
        assert cli_ask.run(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert set(out) >= {"answer", "kept_tokens", "total_tokens", "latency_s", "method", "budget"}
        assert out["method"] == method and out["total_tokens"] == 20
        assert (out["kept_tokens"] == 5) if method == "arr_coc" else (out["kept_tokens"] == 20)
    missing = parser.parse_args(["--model", str(tmp_path / "nope"), "--image", str(image), "--question", Q])
    with pytest.raises(SystemExit, match="--model"):
        cli_ask.run(missing)


def _joined(parts):
    """The contexts a selector saw, one per image, read as one (the fields this test checks)."""
    from types import SimpleNamespace

    return SimpleNamespace(item_of_image=[r for c in parts for r in c.item_of_image],
                           query_embeds=[q for c in parts for q in c.query_embeds],
                           grid_hw=[g for c in parts for g in c.grid_hw], images=[im for c in parts for im in c.images],
                           visual_tokens=[t for c in parts for t in c.visual_tokens],
                           counts=[k for c in parts for k in c.counts])


@pytest.mark.parametrize("family", FAMILIES)
def test_selectors_see_question_embeddings_texture_image_and_tokens(tiny_vlm, make_image, family):
    w = _wrapper(tiny_vlm, family)
    seen = []

    def capture(ctx):
        seen.append(ctx)
        return get_selector("grid")(ctx)

    w.generate([[make_image(120, 150, 0), make_image(90, 200, 1)], make_image(64, 64, 2)], [Q, Q2],
               method=capture, budget=0.25, max_new_tokens=1)
    assert [len(c) for c in seen] == [1, 1, 1]          # each image chosen alone (batch invariance)
    ctx = _joined(seen)
    embed = w.model.get_input_embeddings()
    unit = 32 if family == "qwen3_vl" else 28
    assert ctx.item_of_image == [0, 0, 1]
    for i, q in enumerate([Q, Q, Q2]):
        ids = torch.tensor(w.tokenizer(q, add_special_tokens=False)["input_ids"])
        assert torch.equal(ctx.query_embeds[i], embed(ids))  # the VLM's own embeddings of the question
        h, ww = ctx.grid_hw[i]
        assert ctx.images[i].shape == (3, h * unit, ww * unit)
        assert ctx.visual_tokens[i].shape == (h * ww, embed.weight.shape[1])
        assert ctx.counts[i] == resolve_count(0.25, h * ww)
