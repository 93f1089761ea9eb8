"""The model shapes `bench` measures: real Qwen-VL widths at full depth, and the few layers it runs.

A `Shape` is a real model's architecture at FULL depth (what the full-depth FLOP shares are counted
for); a `Preset` is what `bench` builds and times: one shape's widths with random weights, fewer
vision blocks and language-model layers (configurable, labelled "vision 2 of 32 layers, LM 2 of 28"),
the tiny byte-level vocabulary (264 tokens; the prefill keeps the last position's logits only, so the
LM head is negligible), and an 896 x 896 image (a 64 x 64 patch grid, 1,024 merged tokens).

Where the numbers come from (transformers 5.23 config classes, and the models' config.json files as
published on the Hugging Face hub; checked again when these presets were written):
- Qwen2-VL vision tower: `Qwen2VLVisionConfig` defaults: depth 32, embed_dim 1280, num_heads 16,
  mlp_ratio 4, patch 14, spatial merge 2 (its `hidden_size`, the merger's output, is the LM's width:
  1536 in Qwen2-VL-2B-Instruct's config.json, 3584 in Qwen2-VL-7B-Instruct's).
- Qwen2-VL-2B LM (Qwen2-VL-2B-Instruct config.json): hidden 1536, 28 layers, 12 heads, 2 KV heads,
  MLP 8960, M-RoPE sections 16/24/24, rope theta 1e6.
- Qwen2.5-VL vision tower: `Qwen2_5_VLVisionConfig` defaults: depth 32, intermediate 3420, 16 heads,
  window 112 px, full attention in blocks 7, 15, 23, 31; its default hidden_size (3584) is NOT the
  tower's width: Qwen2.5-VL-3B/7B-Instruct's config.json set vision hidden_size 1280, and
  out_hidden_size 2048 (3B) or the default 3584 (7B).
- Qwen2.5-VL-3B LM (config.json): hidden 2048, 36 layers, 16 heads, 2 KV heads, MLP 11008.
- Qwen2-VL-7B / Qwen2.5-VL-7B LM (config.json): hidden 3584, 28 layers, 28 heads, 4 KV heads,
  MLP 18944. Their towers are their family's (only the merger's output width differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
_QWEN2_VL_TOWER = {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "patch_size": 14,
                   "spatial_merge_size": 2, "temporal_patch_size": 2}
_QWEN2_5_VL_TOWER = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
                     "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                     "fullatt_block_indexes": [7, 15, 23, 31]}


def _lm(hidden: int, layers: int, heads: int, kv_heads: int, mlp: int) -> dict[str, Any]:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": mlp, "max_position_embeddings": 32768,
            "rope_parameters": dict(_ROPE)}


@dataclass(frozen=True)
class Shape:
    """A model's architecture at full depth: the tower's and the LM's config overrides."""

    name: str                       # e.g. "Qwen2-VL-2B"
    family: str                     # "qwen2_vl" | "qwen2_5_vl"
    vision: dict[str, Any]          # vision_config at full depth
    text: dict[str, Any]            # text_config at full depth
    source: str                     # where the numbers come from

    @property
    def vision_depth(self) -> int:
        return int(self.vision["depth"])

    @property
    def lm_depth(self) -> int:
        return int(self.text["num_hidden_layers"])

    @property
    def tower_out(self) -> int:
        """Width of the merger's output (the LM's hidden size): Qwen2-VL's vision `hidden_size`, Qwen2.5-VL's
        `out_hidden_size`."""
        return int(self.vision["hidden_size" if self.family == "qwen2_vl" else "out_hidden_size"])

    def block_kinds(self, depth: int | None = None) -> list[str]:
        """Per vision block at `depth` blocks (default: full depth): "full" attention or "window"."""
        return block_kinds(self.family, self.fullatt(depth), depth or self.vision_depth)

    def fullatt(self, depth: int | None = None) -> list[int]:
        """Qwen2.5-VL's full-attention blocks for a tower of `depth` blocks: the real ones that exist, else the
        last block (the real tower's last block is a full-attention one). [] for towers without windows."""
        real = list(self.vision.get("fullatt_block_indexes", []))
        if self.family != "qwen2_5_vl":
            return []
        depth = depth or self.vision_depth
        return [i for i in real if i < depth] or [depth - 1]


def block_kinds(family: str, fullatt: list[int], depth: int) -> list[str]:
    if family != "qwen2_5_vl":
        return ["full"] * depth
    return ["full" if i in fullatt else "window" for i in range(depth)]


SHAPES: dict[str, Shape] = {
    "Qwen2-VL-2B": Shape(
        "Qwen2-VL-2B", "qwen2_vl", {**_QWEN2_VL_TOWER, "hidden_size": 1536}, _lm(1536, 28, 12, 2, 8960),
        "tower: transformers 5.23 Qwen2VLVisionConfig defaults; LM and merger width: Qwen2-VL-2B-Instruct "
        "config.json"),
    "Qwen2-VL-7B": Shape(
        "Qwen2-VL-7B", "qwen2_vl", {**_QWEN2_VL_TOWER, "hidden_size": 3584}, _lm(3584, 28, 28, 4, 18944),
        "tower: Qwen2VLVisionConfig defaults (its hidden_size 3584 is the 7B's merger width); LM: "
        "Qwen2-VL-7B-Instruct config.json"),
    "Qwen2.5-VL-3B": Shape(
        "Qwen2.5-VL-3B", "qwen2_5_vl", {**_QWEN2_5_VL_TOWER, "out_hidden_size": 2048}, _lm(2048, 36, 16, 2, 11008),
        "tower: transformers 5.23 Qwen2_5_VLVisionConfig defaults with Qwen2.5-VL-3B-Instruct config.json's "
        "hidden_size 1280 and out_hidden_size 2048; LM: the same config.json"),
    "Qwen2.5-VL-7B": Shape(
        "Qwen2.5-VL-7B", "qwen2_5_vl", {**_QWEN2_5_VL_TOWER, "out_hidden_size": 3584}, _lm(3584, 28, 28, 4, 18944),
        "tower: Qwen2_5_VLVisionConfig defaults with Qwen2.5-VL-7B-Instruct config.json's hidden_size 1280; "
        "LM: the same config.json"),
    # The tiny test models (`FromScratch.random_model`) at the depths the tests scale to; numbers mean nothing.
    "tiny-qwen2-vl": Shape("tiny-qwen2-vl", "qwen2_vl", {"depth": 2}, {"num_hidden_layers": 2},
                           "the tiny random Qwen defaults (hidden 64, vision width 32)"),
    "tiny-qwen2.5-vl": Shape("tiny-qwen2.5-vl", "qwen2_5_vl", {"depth": 4, "fullatt_block_indexes": [1, 3]},
                             {"num_hidden_layers": 2},
                             "the tiny random Qwen defaults (hidden 64, vision width 32), 4 blocks, full attention in "
                             "blocks 1 and 3"),
}


@dataclass(frozen=True)
class Preset:
    """What `bench --preset NAME` builds: `shape`'s widths, `vision_layers` / `lm_layers` of its depth."""

    shape: str                      # key of SHAPES: the widths and the full depth
    vision_layers: int              # blocks of the tower that run (default)
    lm_layers: int                  # LM layers that run (default)
    size: int                       # the bench scene's side, px (`scenes.bench_scene`: square)
    max_pixels: int                 # the image processor's limit
    repeats: int                    # timed repetitions (default)
    also: tuple[str, ...] = ()      # other shapes whose full-depth FLOP shares are printed (same tower)
    tiny: bool = False              # widths are the tiny test model's, not the shape's
    note: str = ""


PRESETS: dict[str, Preset] = {
    "qwen2-vl-2b": Preset("Qwen2-VL-2B", 2, 2, 896, 896 * 896, 3, also=("Qwen2-VL-7B",),
                          note="Qwen2-VL-2B widths, random weights"),
    "qwen2.5-vl-3b": Preset("Qwen2.5-VL-3B", 2, 2, 896, 896 * 896, 3, also=("Qwen2.5-VL-7B",),
                            note="Qwen2.5-VL-3B widths, random weights"),
    # Seconds, for tests: the tiny test models on a 336 x 336 image (144 merged tokens).
    "tiny": Preset("tiny-qwen2-vl", 2, 2, 336, 448 * 448, 2, tiny=True,
                   note="tiny random Qwen2-VL (hidden 64) for tests; numbers mean nothing"),
    "tiny-qwen2.5": Preset("tiny-qwen2.5-vl", 2, 2, 336, 448 * 448, 2, tiny=True,
                           note="tiny random Qwen2.5-VL (hidden 64) for tests; numbers mean nothing"),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]


def run_layers(preset: Preset, vision_layers: int | None, lm_layers: int | None) -> tuple[int, int]:
    """(vision blocks, LM layers) to run: the preset's defaults unless given; checked against the full depth."""
    shape = SHAPES[preset.shape]
    v = int(vision_layers or preset.vision_layers)
    t = int(lm_layers or preset.lm_layers)
    if not 1 <= v <= shape.vision_depth:
        raise ValueError(f"--vision-layers must be in [1, {shape.vision_depth}] for {shape.name}, got {v}")
    if not 1 <= t <= shape.lm_depth:
        raise ValueError(f"--lm-layers must be in [1, {shape.lm_depth}] for {shape.name}, got {t}")
    kinds_run = shape.block_kinds(v)
    missing = sorted(set(shape.block_kinds()) - set(kinds_run))
    if missing:
        raise ValueError(f"{shape.name}'s tower has {', '.join(missing)}-attention blocks but {v} block(s) run none, "
                         f"so their cost cannot be scaled to full depth; run --vision-layers 2 or more")
    return v, t


def label(preset: Preset, vision_layers: int, lm_layers: int) -> str:
    """e.g. "vision 2 of 32 layers (1 full-attention, 1 windowed), LM 2 of 28"."""
    shape = SHAPES[preset.shape]
    kinds = shape.block_kinds(vision_layers)
    split = f" ({kinds.count('full')} full-attention, {kinds.count('window')} windowed)" \
        if shape.family == "qwen2_5_vl" else ""
    return f"vision {vision_layers} of {shape.vision_depth} layers{split}, LM {lm_layers} of {shape.lm_depth}"


def build_model(preset: Preset, vision_layers: int, lm_layers: int, runtime: Any, seed: int = 0):
    """(model, processor, summary) for `preset` with random weights, on `runtime`'s device, dtype, attention (the
    family's `FromScratch.random_model`)."""
    from ..pipeline.registry import scratch_kit

    shape = SHAPES[preset.shape]
    text = {} if preset.tiny else dict(shape.text)
    vision = {} if preset.tiny else dict(shape.vision)
    text["num_hidden_layers"] = lm_layers
    vision["depth"] = vision_layers
    if shape.family == "qwen2_5_vl":
        vision["fullatt_block_indexes"] = shape.fullatt(vision_layers)
    model, processor = scratch_kit(shape.family).random_model(
        seed=seed, dtype=runtime.dtype, max_pixels=preset.max_pixels,
        attn_implementation=runtime.attn_implementation or "sdpa", text_config=text, vision_config=vision)
    model = model.to(runtime.device)
    tc, vc = model.config.text_config, model.config.vision_config
    summary = {
        "shape": shape.name, "source": shape.source, "note": preset.note,
        "lm": {"hidden_size": tc.hidden_size, "num_attention_heads": tc.num_attention_heads,
               "num_key_value_heads": tc.num_key_value_heads, "intermediate_size": tc.intermediate_size,
               "num_hidden_layers": tc.num_hidden_layers, "full_depth": shape.lm_depth, "vocab_size": tc.vocab_size,
               "parameters": sum(p.numel() for p in model.model.language_model.parameters())},
        "vision": {"depth": vc.depth, "full_depth": shape.vision_depth,
                   "width": getattr(vc, "embed_dim", None) or vc.hidden_size, "num_heads": vc.num_heads,
                   "block_kinds": shape.block_kinds(vision_layers),
                   "parameters": sum(p.numel() for p in model.model.visual.parameters())},
    }
    return model, processor, summary


def check_shape_encode(shape: Shape, encode: Any) -> None:
    """Refuse (ValueError) an encoding the shape's family cannot run (whole windows: Qwen2.5-VL only)."""
    from ..pipeline.registry import scratch_kit

    scratch_kit(shape.family).check_encode(encode)


def build_backend(preset: Preset, vision_layers: int, lm_layers: int, runtime: Any, seed: int = 0):
    """(the family's backend over `build_model`'s random model, that model, summary): what `ARRCOC(backend)` wraps;
    the model itself for the bench's probes on its tower."""
    from ..pipeline.registry import scratch_kit

    model, processor, summary = build_model(preset, vision_layers, lm_layers, runtime, seed)
    return scratch_kit(SHAPES[preset.shape].family).backend(model, processor), model, summary
