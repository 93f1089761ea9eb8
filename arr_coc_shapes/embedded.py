"""The embedded default VLM: a small Qwen2-VL trained from scratch on ShapesVQA.

Nothing can be downloaded here, so the project ships its own model of the real
`Qwen2VLForConditionalGeneration` architecture at toy width, with a word-level
tokenizer over the benchmark's vocabulary, Qwen's chat template and a PIL image
processor config. It loads through the same `ARRCOC.from_pretrained` path as
a real checkpoint. Training lives in `arr_coc_shapes.trainer`. The family's pieces (its tokenizer's special
tokens, processor, model class) are its backend's, asked for by model type (`FromScratch`, `kit`).
"""

from __future__ import annotations

from typing import Any

from arr_coc.paths import EMBEDDED_MODEL
from arr_coc.pipeline.registry import FromScratch, scratch_kit
from .vocabulary import CELL_PX, COLOR_NAMES, LETTERS, SHAPES, TEMPLATES

DEFAULT_CHECKPOINT = EMBEDDED_MODEL   # checkpoints/shapes-qwen2vl (arr_coc.paths owns the location)
FAMILY = "qwen2_vl"                   # its architecture: the model type whose `FromScratch` builds it
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


def kit(model: Any = None) -> FromScratch:
    """The `FromScratch` that builds the embedded model (or, given a model, the one of its model type)."""
    return scratch_kit(getattr(getattr(model, "config", None), "model_type", None) or FAMILY)


def build_word_tokenizer() -> Any:
    """Word-level tokenizer (lowercased words, digits, punctuation, newline) + Qwen special tokens."""
    return kit().word_tokenizer(vocabulary())


def build_image_processor() -> Any:
    return kit().image_processor(MIN_PIXELS, MAX_PIXELS)


def build_embedded(seed: int = 0, attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """A freshly initialised (untrained) embedded model and its processor."""
    return kit().word_model(vocabulary(), VISION, TEXT, MIN_PIXELS, MAX_PIXELS, seed=seed,
                            attn_implementation=attn_implementation)
