"""Training ARR-COC's scorers (stage 1 and 2) on a tiny random Qwen2-VL: losses fall, gradients flow, resume is exact."""

from __future__ import annotations

import json

import pytest
import torch

from arr_coc_shapes import write_split
from arr_coc.budget import resolve_count
from arr_coc.core.layer import ARRCOCLayer
from arr_coc.qwen import ARRCOCQwen
from arr_coc.training.config import TrainConfig
from arr_coc.training.features import extract_features
from arr_coc.training.losses import answer_loss, batch_scores, ranking_loss
from arr_coc.training.loop import train
from arr_coc.data import read_jsonl


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_vlm):
    folder = tmp_path_factory.mktemp("shapes")
    path = write_split(folder, split="train", n=16, seed=3, canvas=(336, 336))
    model, processor = tiny_vlm("qwen2_vl")
    return ARRCOCQwen(model, processor), str(path)


def _cfg(tmp_path, **kw):
    base = dict(out=str(tmp_path / "layer"), steps=12, batch_size=6, eval_every=6, val_fraction=0.2, warmup=2)
    base.update(kw)
    return TrainConfig(**base)


def _fixed_batch(wrapper, data):
    feats = extract_features(wrapper, list(read_jsonl(data)), progress=False)
    return [f for f in feats if f.target.any()][:6]


def test_stage1_lowers_the_ranking_loss_on_a_fixed_batch(setup, tmp_path):
    wrapper, data = setup
    cfg = _cfg(tmp_path, stage=1, steps=25, lr=1e-2)
    batch = _fixed_batch(wrapper, data)
    torch.manual_seed(cfg.seed)
    from arr_coc import ARRCOCConfig

    before_layer = ARRCOCLayer(ARRCOCConfig(strict=True).with_query_dim(wrapper.text_hidden_size))
    m = batch_scores(before_layer, batch)
    before = float(ranking_loss(m["relevance"], m["valid"], m["target"], cfg.tau).detach())
    train(cfg, "", data, progress=False, vlm=wrapper)
    after_layer = ARRCOCLayer.from_pretrained(cfg.out)
    m = batch_scores(after_layer, batch)
    after = float(ranking_loss(m["relevance"], m["valid"], m["target"], cfg.tau).detach())
    assert after < before - 0.05, (before, after)


def test_stage2_gradients_reach_every_scorer_parameter_and_the_loss_falls(setup, tmp_path):
    wrapper, data = setup
    batch = _fixed_batch(wrapper, data)[:3]
    from arr_coc import ARRCOCConfig

    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig(strict=True).with_query_dim(wrapper.text_hidden_size))
    maps = batch_scores(layer, batch)
    loss, penalty, share = answer_loss(wrapper, batch, maps["relevance"], 0.25, 0.3)
    (loss + penalty).backward()
    def reached():
        return {n for n, p in layer.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}

    # The pair MLP's input projection sits behind a zero-initialised output layer: it is reached
    # once that layer has moved (checked after the steps below); everything else at once.
    late = {"participatory.pair_query.weight", "participatory.pair_query.bias"}
    everything = {n for n, _ in layer.named_parameters()}
    assert reached() >= everything - late, f"no gradient reaches {sorted(everything - late - reached())}"
    assert 0.1 < share < 0.5  # the soft mask keeps about the budget
    # A few gradient steps on this fixed batch lower its loss (plain SGD: on a random VLM the
    # answer barely depends on the image, and Adam's normalised steps would overshoot that).
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss, penalty, _ = answer_loss(wrapper, batch, batch_scores(layer, batch)["relevance"], 0.25, 0.3)
        (loss + penalty).backward()
        opt.step()
        losses.append(float((loss + penalty).detach()))
        late -= reached()
    assert not late, f"no gradient reaches {sorted(late)}"
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[0] - losses[-1] > 1e-3, losses


def test_checkpoint_round_trips_and_resume_continues_the_same_run(setup, tmp_path):
    wrapper, data = setup
    straight = _cfg(tmp_path / "a", stage=1, steps=8)
    train(straight, "", data, progress=False, vlm=wrapper)
    resumed = _cfg(tmp_path / "b", stage=1, steps=8)
    assert train(resumed, "", data, progress=False, vlm=wrapper, stop_after=5)["step"] == 5
    state = train(resumed, "", data, resume=True, progress=False, vlm=wrapper)
    assert state["step"] == 8 and len(state["log"]) == 8
    a = ARRCOCLayer.from_pretrained(straight.out).state_dict()
    b = ARRCOCLayer.from_pretrained(resumed.out).state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert ARRCOCLayer.from_pretrained(straight.out).config.strict is False  # shipped layers degrade gracefully


def test_a_trained_layers_budget_follows_the_question_and_holds_on_average(setup, tmp_path):
    wrapper, data = setup
    records = list(read_jsonl(data))[3:]  # the 13 items the stage trained on (the first 20% are held out)
    spread, exact = tmp_path / "spread", tmp_path / "exact"
    train(_cfg(spread, stage=1, steps=6), "", data, progress=False, vlm=wrapper)
    train(_cfg(exact, stage=1, steps=6, spread_tau=0.0), "", data, progress=False, vlm=wrapper)

    def kept(folder, **attending):
        layer = ARRCOCLayer.from_pretrained(str(folder / "layer"))
        for name, value in attending.items():
            setattr(layer.config.attending, name, value)
        w = ARRCOCQwen(wrapper.model, wrapper.processor, arr_coc=layer)
        out = []
        for rec in records:
            _, traces = w.prepare(w.build_inputs([[rec.load_image()]], [rec.question]), budget=0.25).outputs
            out.append(traces[0].kept_tokens)
        return out

    budget = resolve_count(0.25, 12 * 12)  # 336 px canvas: a 12 x 12 grid of merged tokens
    assert kept(exact) == [budget] * len(records)
    scaled = kept(spread, spread_per_cell=1e9)  # the scale alone, no cap
    assert len(set(scaled)) > 1, scaled                                  # images keep different numbers of tokens
    assert abs(sum(scaled) / len(scaled) - budget) <= 1.0, scaled        # ... and the budget on average
    assert min(scaled) >= round(0.6 * budget) and max(scaled) <= 2 * budget
    capped = kept(spread)                                                # as saved: raised at most to 2 per cell
    assert all(c <= s for c, s in zip(capped, scaled)) and sum(capped) / len(capped) <= budget + 0.5, capped
    saved = ARRCOCLayer.from_pretrained(str(spread / "layer")).config.attending
    log = json.loads((spread / "layer" / "training_log_stage1.json").read_text())["budget_spread"]
    assert saved.spread_tau == log["tau"] == 0.02 and saved.spread_reference == pytest.approx(log["reference"])


def test_a_fresh_layer_takes_attn_dim_and_a_warm_start_refuses_it(setup, tmp_path):
    wrapper, data = setup
    train(_cfg(tmp_path / "a", stage=1, steps=1), "", data, progress=False, vlm=wrapper)
    assert ARRCOCLayer.from_pretrained(str(tmp_path / "a" / "layer")).config.knowing.attn_dim == 32  # the default
    train(_cfg(tmp_path / "b", stage=1, steps=1, attn_dim=16), "", data, progress=False, vlm=wrapper)
    narrow = ARRCOCLayer.from_pretrained(str(tmp_path / "b" / "layer"))
    assert narrow.config.knowing.attn_dim == 16 and narrow.participatory.query_proj.out_features == 16
    with pytest.raises(ValueError, match="drop --attn-dim"):
        train(_cfg(tmp_path / "c", stage=2, steps=1, attn_dim=16), "", data, init=str(tmp_path / "b" / "layer"),
              progress=False, vlm=wrapper)


def test_stage2_can_keep_stage1s_ranking_loss_as_an_auxiliary_term(setup, tmp_path):
    wrapper, data = setup
    plain = train(_cfg(tmp_path / "a", stage=2, steps=2), "", data, progress=False, vlm=wrapper)
    assert "ranking_loss" not in plain["log"][0]
    state = train(_cfg(tmp_path / "b", stage=2, steps=2, rank_weight=0.5), "", data, progress=False, vlm=wrapper)
    for rec in state["log"]:
        # loss = answer + budget penalty (>= 0) + 0.5 x ranking
        assert rec["ranking_loss"] > 0
        assert rec["loss"] >= rec["answer_loss"] + 0.5 * rec["ranking_loss"] - 1e-5
        assert rec["loss"] <= rec["answer_loss"] + 0.5 * rec["ranking_loss"] + 1.0


def test_stage2_draws_only_the_given_budgets_and_holds_out_part_of_every_data_file(setup, tmp_path):
    import argparse

    from arr_coc.cli.train import add_arguments

    wrapper, data = setup
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--data", data, data, "--stage", "2", "--budgets", "0.05,0.1"])
    assert args.data == [data, data] and args.budgets == (0.05, 0.1)
    with pytest.raises(SystemExit):
        parser.parse_args(["--data", data, "--stage", "2", "--budgets", "0.05,2.5"])  # neither a share nor a count

    state = train(_cfg(tmp_path, stage=2, steps=6, budgets=args.budgets), "", args.data, progress=False, vlm=wrapper)
    assert {rec["budget"] for rec in state["log"]} <= {0.05, 0.1}
    # 16 records per file, val_fraction 0.2: 3 held out of each file, so validation sees 6 items.
    assert state["val_items"] == 6 and state["train_items"] == 26


def test_feature_cache_reuses_the_vlms_features_until_the_vlm_or_data_change(setup, tmp_path, monkeypatch):
    from arr_coc.training.features import load_features

    wrapper, data = setup
    records = list(read_jsonl(data))
    cache = str(tmp_path / "cache")
    fresh = load_features(wrapper, data, records, cache, progress=False)
    (file,) = list((tmp_path / "cache").iterdir())

    def no_vlm(*args, **kwargs):
        raise AssertionError("the VLM ran although its features were cached")

    with monkeypatch.context() as m:
        m.setattr(wrapper, "prepare", no_vlm)
        cached = load_features(wrapper, data, records, cache, progress=False)
        with pytest.raises(AssertionError, match="features were cached"):
            load_features(wrapper, data, records[:-1], cache, progress=False)  # other data: extracted anew
    assert len(cached) == len(fresh)
    for a, b in zip(fresh, cached):
        for name in ("image", "visual_tokens", "query", "target"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.prompt.keys() == b.prompt.keys() and all(torch.equal(a.prompt[k], b.prompt[k]) for k in a.prompt)
        assert (a.grid_hw, a.answer, a.question, a.image_path) == (b.grid_hw, b.answer, b.question, b.image_path)

    # Targets are the code's, not the cache's: a cache holding other ones (older code) is corrected on load.
    stale = torch.load(file, weights_only=True)
    for d in stale:
        d["target"] = torch.zeros_like(d["target"], dtype=torch.bool)
    torch.save(stale, file)
    reloaded = load_features(wrapper, data, records, cache, progress=False)
    assert all(torch.equal(a.target, b.target) for a, b in zip(fresh, reloaded))
    n_boxes = sum(len(r.boxes or []) for r in records)
    assert sum(float(f.target.sum()) for f in fresh) == pytest.approx(n_boxes, abs=0.01)  # every box weighs 1

    # A VLM that changed (one weight nudged) gets its own file; the old one stays.
    embed = wrapper.model.get_input_embeddings().weight
    original = embed[0, 0].item()
    with torch.no_grad():
        embed[0, 0] += 1.0
    try:
        load_features(wrapper, data, records, cache, progress=False)
    finally:
        with torch.no_grad():
            embed[0, 0] = original  # exactly (x + 1 - 1 need not be x): the model is shared by this module's tests
    assert len(list((tmp_path / "cache").iterdir())) == 2 and file.exists()


def test_features_for_encode_before_are_the_gists_tokens_and_keep_the_full_encoding_for_the_lm(setup):
    """train --gist: the layer learns from what it reads with encode='before' (the gist's token under each
    cell), while stage 2's language model keeps reading the full encoding."""
    from arr_coc.pipeline.fovea import encode_gist, nearest_cells

    wrapper, data = setup
    records = list(read_jsonl(data))[:2]
    plain = extract_features(wrapper, records, progress=False)
    gist = extract_features(wrapper, records, progress=False, gist=0.25)
    for p, g in zip(plain, gist):
        assert g.lm_tokens is not None and torch.equal(g.lm_tokens, p.visual_tokens) and p.lm_tokens is None
        assert g.visual_tokens.shape == p.visual_tokens.shape and not torch.equal(g.visual_tokens, p.visual_tokens)
        h, w = g.grid_hw
        ref = encode_gist(wrapper.backend, _prompt_of(wrapper, g.image.float() / 255), 0.25)
        assert torch.allclose(g.visual_tokens, ref.on_full_grid[0].float(), atol=1e-5)
        assert len(set(nearest_cells((h, w), ref.grid_hw[0]).tolist())) == ref.grid_hw[0][0] * ref.grid_hw[0][1]


@pytest.mark.parametrize("encode", ["before", "after"])
def test_a_layer_trained_for_encode_before_without_a_gist_never_reads_visual_tokens(setup, tmp_path, monkeypatch,
                                                                                       encode):
    """train --encode before (no gist): the layer learns from the texture array and the question only, which
    is all it gets at inference in that mode, so replacing the VLM's visual tokens by noise changes no weight.
    Negative control: trained for encode='after', the same noise changes the weights."""
    import arr_coc.training.loop as loop

    wrapper, data = setup
    real = loop.load_features

    def noisy(*args, **kwargs):
        feats = real(*args, **kwargs)
        g = torch.Generator().manual_seed(5)
        for f in feats:
            f.visual_tokens = torch.randn(f.visual_tokens.shape, generator=g)
        return feats

    weights = []
    for i, features in enumerate((real, noisy)):
        monkeypatch.setattr(loop, "load_features", features)
        cfg = _cfg(tmp_path / str(i), stage=1, steps=6, encode=encode)
        assert cfg.reads_tokens == (encode == "after")
        train(cfg, "", data, progress=False, vlm=wrapper)
        weights.append(ARRCOCLayer.from_pretrained(cfg.out).state_dict())
    same = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert same == (encode == "before")


def test_train_config_ties_a_gist_to_encode_before():
    assert TrainConfig(gist=0.25).encode == "before" and TrainConfig(gist=0.25).reads_tokens
    assert not TrainConfig(encode="before").reads_tokens and TrainConfig().reads_tokens
    with pytest.raises(ValueError, match="'after' or 'before'"):
        TrainConfig(encode="sideways")


def test_zero_steps_refit_only_the_budget_to_the_answers_extent(setup, tmp_path):
    """`train --init L --steps 0 --budget-follows extent` keeps L's scorers and fits an extent head to the training
    items' answer cells; the saved layer then scales budgets by its predictions."""
    wrapper, data = setup
    first = _cfg(tmp_path / "first", stage=1, steps=6)
    train(first, "", data, progress=False, vlm=wrapper)
    refit = _cfg(tmp_path / "refit", stage=1, steps=0, budget_follows="extent", spread_bounds=(0.3, 4.0),
                 spread_per_cell=4.0)
    state = train(refit, "", data, init=first.out, progress=False, vlm=wrapper)
    before, after = ARRCOCLayer.from_pretrained(first.out), ARRCOCLayer.from_pretrained(refit.out)
    assert before.extent is None and after.extent is not None
    old, new = before.state_dict(), after.state_dict()
    assert set(new) - set(old) == {"extent.mean", "extent.std", "extent.weight", "extent.bias"}
    assert all(torch.equal(old[k], new[k]) for k in old)  # the scorers did not move
    cfg = after.config.attending
    assert (cfg.spread_source, cfg.spread_min, cfg.spread_max, cfg.spread_per_cell) == ("extent", 0.3, 4.0, 4.0)
    assert cfg.spread_reference == pytest.approx(state["budget_spread"]["reference"])
    # In-sample (13 items, a few hundred features) the ridge fit follows the answers' cells closely.
    items = [f for f in extract_features(wrapper, list(read_jsonl(data)), progress=False)][3:]
    maps = batch_scores(after.eval(), items)
    predicted = torch.cat([after.extent(maps["relevance"][i : i + 1], maps["valid"][i : i + 1], f.query[None])
                           for i, f in enumerate(items)])
    answer = torch.tensor([float((f.target > 0).sum()) for f in items])
    assert state["budget_spread"]["extent_r2"] > 0.9
    assert torch.corrcoef(torch.stack([predicted.log1p(), answer.log1p()]))[0, 1] > 0.9


def _prompt_of(wrapper, image):
    """The prompt of one resized image ([3, H, W] in [0, 1]) as the pipeline reads it (no tower)."""
    from PIL import Image

    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    inputs = wrapper.build_inputs([[Image.fromarray(pixels)]], ["What is it?"])
    return wrapper.backend.read_prompt(inputs, encode_all=False)
