"""`QwenScratch`: a Qwen-VL model built from scratch, the registry's `FromScratch` for the three families.

What the ShapesVQA test bed (the embedded model: its word-level tokenizer, its training, the video fine-tune) and
the bench's random models at real widths need of the family, so neither imports this backend: they ask the
registry by model type (`arr_coc.pipeline.registry.scratch_kit`), as the front door asks it for a checkpoint.

    kit = scratch_kit("qwen2_vl")
    model, processor = kit.word_model(words, vision={...}, text={...}, min_pixels=..., max_pixels=...)
    feats, grids = kit.visual_tokens(model, processor, images)     # merged tokens per image, merged grids
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..encode import EncodeConfig
from .families import Family
from .processing import (
    ENDOFTEXT, IM_END, IM_START, IMAGE_TOKEN, QWEN_CHAT_TEMPLATE, VIDEO_TOKEN, VISION_END, VISION_START,
    ImageOnlyQwenProcessor, encode_prompts, render_prompt,
)

UNK = "<unk>"
# Order fixes a word-level tokenizer's first ids (the embedded model's: its checkpoint depends on them).
WORD_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, "<|vision_pad|>", IMAGE_TOKEN,
                       VIDEO_TOKEN, UNK)
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class QwenScratch:
    """`FromScratch` for one Qwen-VL family; `load` is `loading.load_vlm` (handed in: loading builds this)."""

    family: Family
    load: Callable[..., tuple[Any, Any]]     # (path, device=, dtype=) -> (model, processor), trainable as loaded
    image_token: str = IMAGE_TOKEN
    end_token: str = IM_END

    def word_tokenizer(self, words: Sequence[str]) -> Any:
        """Word-level tokenizer (lowercased words, digits, punctuation, newline) + Qwen's special tokens and chat
        template; ids: the special tokens, then `words` in order."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {tok: i for i, tok in enumerate(WORD_SPECIAL_TOKENS)}
        for word in words:
            vocab.setdefault(word, len(vocab))
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Split(Regex(r"\n|[a-z0-9]+|[^\sa-z0-9]"), behavior="isolated"),
        ])
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in WORD_SPECIAL_TOKENS])
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=UNK, padding_side="left",
        )
        tokenizer.chat_template = QWEN_CHAT_TEMPLATE
        return tokenizer

    def image_processor(self, min_pixels: int, max_pixels: int) -> Any:
        """The PIL image processor of a word model (Qwen2-VL's patches and normalisation) within these limits."""
        from transformers import Qwen2VLImageProcessorPil

        self._word_family()
        return Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=CLIP_MEAN,
                                        image_std=CLIP_STD,
                                        size={"shortest_edge": min_pixels, "longest_edge": max_pixels})

    def word_model(self, words: Sequence[str], vision: Mapping[str, Any], text: Mapping[str, Any],
                   min_pixels: int, max_pixels: int, seed: int = 0,
                   attn_implementation: str = "sdpa") -> tuple[Any, ImageOnlyQwenProcessor]:
        """A freshly initialised (untrained) model over `word_tokenizer(words)`, its tower `vision` and language
        model `text` (config keys), answering 4 tokens greedily by default; and its processor."""
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        self._word_family()
        tokenizer = self.word_tokenizer(words)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in WORD_SPECIAL_TOKENS}
        text_cfg = dict(text, vocab_size=len(tokenizer), bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END],
                        pad_token_id=ids[ENDOFTEXT], tie_word_embeddings=False)
        config = Qwen2VLConfig(
            text_config=text_cfg, vision_config=dict(vision, hidden_size=text["hidden_size"]),
            tie_word_embeddings=False, image_token_id=ids[IMAGE_TOKEN], video_token_id=ids[VIDEO_TOKEN],
            vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2VLForConditionalGeneration._from_config(config, attn_implementation=attn_implementation)
        gen = model.generation_config
        gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = [ids[IM_END], ids[ENDOFTEXT]], ids[ENDOFTEXT], \
            ids[ENDOFTEXT]
        gen.do_sample = False
        gen.max_new_tokens = 4
        processor = ImageOnlyQwenProcessor(self.image_processor(min_pixels, max_pixels), tokenizer,
                                           chat_template=QWEN_CHAT_TEMPLATE)
        return model, processor

    def _word_family(self) -> None:
        if self.family.name != "qwen2_vl":
            raise ValueError(f"a word-level model from scratch is built as Qwen2-VL only (the embedded model's "
                             f"architecture), not {self.family.name}: ask scratch_kit('qwen2_vl')")

    def random_model(self, seed: int, dtype: torch.dtype, max_pixels: int | None, attn_implementation: str,
                     text_config: Mapping[str, Any], vision_config: Mapping[str, Any]) -> tuple[Any, Any]:
        """A random model of this family (the byte-level tiny model, `tiny.build_tiny_qwen`) with these config
        parts over the tiny defaults; frozen, in eval mode."""
        from .tiny import build_tiny_qwen

        return build_tiny_qwen(self.family.name, seed=seed, dtype=dtype, max_pixels=max_pixels,
                               attn_implementation=attn_implementation, text_config=dict(text_config),
                               vision_config=dict(vision_config))

    def backend(self, model: Any, processor: Any) -> Any:
        """The pipeline's backend over a model this kit built (frozen)."""
        from .backend import QwenBackend

        return QwenBackend(model.eval().requires_grad_(False), processor)

    def check_encode(self, encode: EncodeConfig) -> None:
        """Refuse (ValueError) an encoding this family's tower cannot run, before any model is built."""
        self.family.check_encode(encode)

    def render_prompt(self, processor: Any, images: int, question: str) -> str:
        """The chat-template text of one user turn with `images` image placeholders, then `question`."""
        return render_prompt(processor, images, question)

    def encode_prompts(self, processor: Any, visuals: Sequence[Sequence[Any]], questions: Sequence[str]
                       ) -> dict[str, torch.Tensor]:
        """The processor's tensors for a batch (visuals[b]: question b's images and clips), left-padded."""
        return encode_prompts(processor, visuals, questions)

    def visual_tokens(self, model: Any, processor: Any, images: Sequence[Any]
                      ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Per image, its merged visual tokens [h * w, D] (differentiable through the tower) and merged grid."""
        vis = processor.image_processor(images=list(images), return_tensors="pt")
        out = model.model.get_image_features(vis["pixel_values"], vis["image_grid_thw"])
        merge = int(model.config.vision_config.spatial_merge_size)
        grids = [(int(h) // merge, int(w) // merge) for _, h, w in vis["image_grid_thw"].tolist()]
        return list(out.pooler_output), grids
