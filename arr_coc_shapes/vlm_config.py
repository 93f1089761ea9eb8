"""The embedded model's training recipe: `VLMTrainConfig` (the shipped recipe's defaults) and the stages.

Dataclasses only (no torch), so `python -m arr_coc_shapes train-vlm --help` reads the defaults cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from arr_coc.paths import EMBEDDED_MODEL

STAGES = ("vision", "language", "joint")
LR_FLOOR = 0.1   # each stage's cosine decays to a tenth of its peak learning rate
LETTER_TILE_CELLS = 4


@dataclass
class VLMTrainConfig:
    out: str = EMBEDDED_MODEL                   # checkpoints/shapes-qwen2vl
    state: str = "runs/train_vlm_state.pt"     # optimiser + progress, for --resume (not shipped)
    seed: int = 1234
    steps: tuple[int, int, int] = (1100, 0, 2000)  # optimiser steps per stage (the shipped recipe; README)
    images_per_step: tuple[int, int, int] = (8, 8, 8)
    questions_per_image: int = 8
    lr: tuple[float, float, float] = (2e-3, 1.5e-3, 1.5e-3)
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    dense_weight: float = 1.0
    attn_weight: float = 0.5
    attn_layers: tuple[int, ...] = (1, 2, 3)   # head 0 of these LM layers is supervised onto the answer's cells;
                                                # head 0 of layer 0 onto the question's colour/shape words
    # (layer, head, sink): each head is supervised to spread over the counted objects and position 0
    # with weight `sink` (see count_loss); heads with different sinks resolve different ranges of n
    count_heads: tuple[tuple[int, int, float], ...] = ((2, 1, 5.0),)
    count_balance: float = 0.0      # > 0: reweight count answers to the benchmark's uniform 0-9 (weight cap; see
                                    # count_answer_weights); 0 = plain answer loss
    count_prior_items: int = 400    # training images that estimate the training distribution of count answers
    random_canvas_p: float = 0.3    # else the default 448 x 448 canvas
    keep_min: float = 0.05          # visual-token dropout: share of non-answer cells kept ~ U(keep_min, 1)
    vision_crop: int = 8            # vision stage trains on 8 x 8-cell tiles of its scenes (0 = whole images)
    letter_weight: float = 2.0      # letters are the slowest attribute to learn ...
    vision_letter_rate: float = 0.9  # ... and rare (35% of eligible objects): the vision stage sees more
    letter_tiles: int = 0           # per step, this many 4 x 4-cell tiles around lettered objects join the dense loss
    full_p: float = 0.35            # chance a sequence keeps every visual token
    val_items: int = 300
    val_seed: int = 99              # validation items: split "val", never the test seed
    eval_every: int = 200
    save_every: int = 100
    init: str | None = None         # start from the weights of another run's --state file
    log: list = field(default_factory=list)
