"""A trained layer is shared like a checkpoint: a folder, or a Hugging Face hub id read through the usual cache.

Offline, against a local folder laid out as the hub cache lays one out (models--owner--name/snapshots/<commit>
+ refs/main): nothing is downloaded. The model card is written beside the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arr_coc import ARRCOCConfig, ARRCOCLayer
from arr_coc.core.persistence import LayerCard

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "someone/arr-coc-test"


def _hub_cache(tmp_path: Path, layer: ARRCOCLayer, card: LayerCard | None = None) -> Path:
    """tmp_path/hub laid out as huggingface_hub's cache holds REPO at COMMIT (its main branch)."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    layer.save_pretrained(repo / "snapshots" / COMMIT, card)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def _layer() -> ARRCOCLayer:
    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(64))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return layer


def test_a_hub_id_loads_from_the_cache_offline_at_a_branch_or_a_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    layer = _layer()
    cache = _hub_cache(tmp_path, layer)
    for name, revision in ((REPO, None), (REPO, "main"), (REPO, COMMIT), (f"{REPO}@{COMMIT}", None)):
        again = ARRCOCLayer.from_pretrained(name, revision=revision, cache_dir=cache)
        for (name, a), (_, b) in zip(layer.state_dict().items(), again.state_dict().items()):
            assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE.*download it once"):
        ARRCOCLayer.from_pretrained("someone/not-there", cache_dir=cache)
    with pytest.raises(FileNotFoundError, match="revision 'v2'"):
        ARRCOCLayer.from_pretrained(REPO, revision="v2", cache_dir=cache)
    with pytest.raises(FileNotFoundError, match="not a folder"):   # a path that is not there and no hub id
        ARRCOCLayer.from_pretrained(str(tmp_path / "nowhere" / "deeper" / "layer"))


def test_the_wrapper_takes_a_hub_id_and_refuses_one_that_is_not_there_before_loading(tiny_vlm, make_image, tmp_path,
                                                                                     monkeypatch):
    import huggingface_hub.constants

    from arr_coc.paths import LayerNotFound
    from arr_coc.qwen import ARRCOCQwen

    model, processor = tiny_vlm("qwen2_vl")
    layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(model.config.text_config.hidden_size))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path, layer)))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    vlm = ARRCOCQwen(model, processor, arr_coc=REPO)
    _, trace = vlm.generate(make_image(112, 112), "What is red?", budget=0.25, max_new_tokens=1)
    assert trace.fallback == [None] and trace.kept_tokens < trace.total_tokens
    with pytest.raises(LayerNotFound, match="someone/missing.*HF_HUB_OFFLINE"):
        ARRCOCQwen(model, processor, arr_coc="someone/missing")


def test_save_pretrained_writes_a_model_card(tmp_path):
    layer = _layer()
    card = LayerCard(vlm="someone/tiny-qwen2-vl", encode="before", data=["data/gqa/train.jsonl"],
                     training="stage 1, 300 steps", results=["- coverage 0.9"])
    layer.save_pretrained(tmp_path / "l", card)
    text = (tmp_path / "l" / "README.md").read_text()
    assert text.startswith("---\nlibrary_name: arr-coc") and "base_model: someone/tiny-qwen2-vl" in text
    for needle in ("before the vision tower", "data/gqa/train.jsonl", "stage 1, 300 steps", "- coverage 0.9",
                   "question embeddings of width 64"):
        assert needle in text, needle
    # a folder saved again without a card keeps the card it has; a layer saved with none gets a default one
    layer.save_pretrained(tmp_path / "l")
    assert (tmp_path / "l" / "README.md").read_text() == text
    layer.save_pretrained(tmp_path / "bare")
    assert "trained against | unknown" in (tmp_path / "bare" / "README.md").read_text()
