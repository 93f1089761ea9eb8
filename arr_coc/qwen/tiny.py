"""Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models built from configs, offline.

Nothing can be downloaded here, so tests, benchmarks and the embedded model start
from these builders: a byte-level tokenizer (256 byte tokens + the Qwen special
tokens, no merges, so any text round-trips), Qwen's chat template, the PIL image
processor with each family's patch size / normalisation, the torch-only video
processor (`arr_coc.qwen.video_processor.VideoProcessor`) with the same geometry, and a model whose
architecture is the real one at toy width. Weights are random (seeded).

    model, processor = build_tiny_qwen("qwen3_vl", seed=0)
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .processing import (
    ENDOFTEXT, IM_END, IM_START, IMAGE_TOKEN, QWEN_CHAT_TEMPLATE, VIDEO_TOKEN, VISION_END, VISION_START,
    ImageOnlyQwenProcessor,
)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

# Order fixes the ids: bytes are 0..255, then these from 256 on.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, "<|vision_pad|>", IMAGE_TOKEN, VIDEO_TOKEN)


def build_tiny_tokenizer() -> Any:
    """Byte-level tokenizer with the Qwen special tokens and chat template (vocab 264)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, padding_side="left",
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def _token_ids(tokenizer: Any) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "image_token_id": ids[IMAGE_TOKEN],
        "video_token_id": ids[VIDEO_TOKEN],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
        "eos": ids[IM_END],
        "pad": ids[ENDOFTEXT],
    }


def _deep_update(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_update(out[k], v)
        else:
            out[k] = v
    return out


def tiny_config_dict(family: str, vocab_size: int = 264, **overrides: Any) -> dict[str, Any]:
    """Config dict of a tiny model; `overrides` may hold `text_config={...}` / `vision_config={...}` parts."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    hidden = 64
    text = {
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        # head_dim 16 -> 8 rotary frequencies split (t, h, w) = (4, 2, 2)
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        "tie_word_embeddings": False,
    }
    if family == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": hidden, "num_heads": 2, "mlp_ratio": 2,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    elif family == "qwen2_5_vl":
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": hidden,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                  "fullatt_block_indexes": [1]}
    else:
        text["head_dim"] = 16
        text["num_hidden_layers"] = 3  # deepstack feeds layers 0 and 1; one more layer after
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": hidden,
                  "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                  "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]}
    base = {"model_type": family, "text_config": text, "vision_config": vision, "tie_word_embeddings": False}
    return _deep_update(base, overrides)


def build_tiny_image_processor(family: str, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The PIL image processor with the family's real patch size and normalisation."""
    from transformers import Qwen2VLImageProcessorPil

    if family == "qwen3_vl":
        unit, mean, std = 32, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
        patch = 16
    else:
        unit, mean, std = 28, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
        patch = 14
    return Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, temporal_patch_size=2, image_mean=mean, image_std=std,
        size={"shortest_edge": min_pixels or (2 * unit) ** 2, "longest_edge": max_pixels or (16 * unit) ** 2},
    )


def build_tiny_video_processor(family: str, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The family's video processor with the tiny image processor's geometry, normalisation and pixel limits
    (per frame for Qwen2-VL / Qwen2.5-VL; for Qwen3-VL the limits bound the whole clip, as its stock processor's do)."""
    from .video_processor import VideoProcessor

    image_processor = build_tiny_image_processor(family, min_pixels, max_pixels)
    return VideoProcessor.from_image_processor(family, image_processor, {"size": dict(image_processor.size)})


def build_tiny_qwen(
    family: str,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    **overrides: Any,
) -> tuple[Any, ImageOnlyQwenProcessor]:
    """(model, processor) for a tiny random VLM of `family`, frozen in eval mode.

    `overrides` are merged into the config dict (e.g. `text_config={"num_hidden_layers": 4,
    "hidden_size": 1536, ...}`, `vision_config={...}`) so a benchmark can build a
    2B-shaped language model behind a tiny vision tower.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    tokenizer = build_tiny_tokenizer()
    ids = _token_ids(tokenizer)
    cfg_dict = tiny_config_dict(family, vocab_size=len(tokenizer), **overrides)
    text = cfg_dict["text_config"]
    text.setdefault("bos_token_id", ids["pad"])
    text.setdefault("eos_token_id", ids["eos"])
    text.setdefault("pad_token_id", ids["pad"])
    if family != "qwen2_vl":
        cfg_dict["vision_config"].setdefault("out_hidden_size", text["hidden_size"])
    else:
        cfg_dict["vision_config"]["hidden_size"] = text["hidden_size"]
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        **cfg_dict,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    model.generation_config.eos_token_id = [ids["eos"], ids["pad"]]
    model.generation_config.pad_token_id = ids["pad"]
    model.generation_config.bos_token_id = ids["pad"]
    model.generation_config.do_sample = False
    model.eval().requires_grad_(False)
    processor = ImageOnlyQwenProcessor(
        build_tiny_image_processor(family, min_pixels, max_pixels), tokenizer, chat_template=QWEN_CHAT_TEMPLATE,
        family=family, video_processor=build_tiny_video_processor(family, min_pixels, max_pixels),
    )
    return model, processor


# vLLM's CPU attention kernels take head sizes of 32 and up ("Unsupported CPU attention configuration: head_dim=16"),
# so a tiny model vLLM serves has 2 heads of 32 (hidden 64) and rotary sections (4, 6, 6) summing to 32 / 2.
SERVABLE_TEXT = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}}


def save_tiny_qwen(family: str, folder: str, seed: int = 0) -> str:
    """A tiny random model of `family` (`build_tiny_qwen`, with `SERVABLE_TEXT`) saved as a checkpoint folder that
    the Hugging Face path and vLLM both load: weights, config, tokenizer, chat template, image and video
    processor configs (vLLM builds the family's stock processor from them). Returns the folder.

    Qwen3-VL's config says `mrope_interleaved`, as the released checkpoints' do: transformers' Qwen3-VL always
    interleaves the rotary sections (modeling_qwen3_vl.py, `recomposition_frequencies`), vLLM only where the config
    says so (model_executor/layers/rotary_embedding/__init__.py:335-345)."""
    text = copy.deepcopy(SERVABLE_TEXT)
    if family == "qwen3_vl":
        text["rope_parameters"]["mrope_interleaved"] = True
    model, processor = build_tiny_qwen(family, seed=seed, text_config=text)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
