"""The embedded default VLM: a small Qwen2-VL trained from scratch on ShapesVQA.

Nothing can be downloaded here, so the project ships its own model of the real
`Qwen2VLForConditionalGeneration` architecture at toy width, with a word-level
tokenizer over the benchmark's vocabulary, Qwen's chat template and a PIL image
processor config. It loads through the same `ARRCOC.from_pretrained` path as
a real checkpoint. Training lives in `arr_coc.shapes.trainer`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..paths import EMBEDDED_MODEL
from ..qwen.processing import (
    ENDOFTEXT, IM_END, IM_START, IMAGE_TOKEN, QWEN_CHAT_TEMPLATE, VIDEO_TOKEN, VISION_END, VISION_START,
    ImageOnlyQwenProcessor,
)
from .vocabulary import CELL_PX, COLOR_NAMES, LETTERS, SHAPES, TEMPLATES

DEFAULT_CHECKPOINT = EMBEDDED_MODEL   # checkpoints/shapes-qwen2vl (arr_coc.paths owns the location)
UNK = "<unk>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, "<|vision_pad|>", IMAGE_TOKEN, VIDEO_TOKEN, UNK)
MAX_PIXELS = 896 * 896  # the largest ShapesVQA canvas: 32 x 32 merged tokens
MIN_PIXELS = 4 * CELL_PX * CELL_PX

# Model size (see the README's training section for why these numbers).
VISION = {"depth": 4, "embed_dim": 96, "num_heads": 4, "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
          "temporal_patch_size": 2}
TEXT = {"hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 6,
        "num_key_value_heads": 2, "max_position_embeddings": 4096,
        # head_dim 32 -> 16 rotary frequencies split (t, h, w) = (4, 6, 6). theta 1e6 (as Qwen2-VL
        # itself) rather than 1e4: more rotary dimensions turn slowly, so the answer position can
        # match a word to an image token by content whatever their relative position. Measured:
        # the answer-cell attention loss fell to 1.4 in 190 steps instead of plateauing at 2.2.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]}}


def vocabulary() -> list[str]:
    """Every word the benchmark, its answers and the chat template use (lowercased)."""
    words = {"\n", "?", ".", ",", "!", "'", "system", "user", "assistant", "you", "are", "a", "helpful"}
    for template in TEMPLATES.values():
        for shape in SHAPES:
            for color in COLOR_NAMES:
                words.update(_split_words(template.format(shape=shape, color=color)))
    words.update(COLOR_NAMES)
    words.update(SHAPES)
    words.update(letter.lower() for letter in LETTERS)
    words.update(str(d) for d in range(10))
    words.update(("yes", "no", "object", "objects", "an"))
    return sorted(words)


def _split_words(text: str) -> list[str]:
    import re

    return re.findall(r"\n|[a-z0-9]+|[^\sa-z0-9]", text.lower())


def build_word_tokenizer() -> Any:
    """Word-level tokenizer (lowercased words, digits, punctuation, newline) + Qwen special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in vocabulary():
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n|[a-z0-9]+|[^\sa-z0-9]"), behavior="isolated"),
    ])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=UNK, padding_side="left",
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def build_image_processor() -> Any:
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )


def build_embedded(seed: int = 0, attn_implementation: str = "sdpa") -> tuple[Any, ImageOnlyQwenProcessor]:
    """A freshly initialised (untrained) embedded model and its processor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = build_word_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(TEXT, vocab_size=len(tokenizer), bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END],
                pad_token_id=ids[ENDOFTEXT], tie_word_embeddings=False)
    vision = dict(VISION, hidden_size=TEXT["hidden_size"])
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=ids[IMAGE_TOKEN], video_token_id=ids[VIDEO_TOKEN],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration._from_config(config, attn_implementation=attn_implementation)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = [ids[IM_END], ids[ENDOFTEXT]], ids[ENDOFTEXT], ids[ENDOFTEXT]
    gen.do_sample = False
    gen.max_new_tokens = 4
    processor = ImageOnlyQwenProcessor(build_image_processor(), tokenizer, chat_template=QWEN_CHAT_TEMPLATE)
    return model, processor
