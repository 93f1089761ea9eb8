"""What the vLLM plugin reads and computes outside vLLM: pure Python and torch, tested without vLLM.

- `ServeSettings.of(hf_config)`: the server's settings from `--hf-overrides '{"arr_coc": {...}}'` (the layer, the
  encode mode, the default budget), each refused in one line at start;
- `request_budget`: a request's budget from its `mm_processor_kwargs` (`arr_coc_budget`), read by the project's one
  parser (`arr_coc.budget.parse_budget`, as it came over JSON);
- `kept_count`: the placeholders the processor writes for an image, `count_of(budget, cells)`: the exact budget,
  known before the model runs (vLLM sizes the prompt then);
- `question_ids`: the question's token ids from the prompt's ids, as the Hugging Face path reads them
  (`PromptTokens.question`);
- `kept_positions`: each kept cell's M-RoPE (t, h, w) and the image's extent, vLLM's 4-channel convention for
  pruned media (`vllm/multimodal/video_prune/evs.py`): the kept tokens keep their own positions and the text after
  the image keeps its unpruned ones, as in `arr_coc/qwen/rewrite.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import numpy as np

import torch

from ...budget import Budget, BudgetError, count_of, parse_budget
from ...core.temporal import minimum_count
from ...paths import check_layer_folder

if TYPE_CHECKING:
    from ...qwen.prompt import PromptTokens

# The checkpoint's model_type -> the architecture name a server asks for (hf_overrides "architectures").
FAMILY_ARCHITECTURES: dict[str, str] = {"qwen2_vl": "ARRCOCQwen2VLForConditionalGeneration",
                                        "qwen2_5_vl": "ARRCOCQwen2_5_VLForConditionalGeneration",
                                        "qwen3_vl": "ARRCOCQwen3VLForConditionalGeneration"}
FAMILY_NAMES = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}
# Architecture name -> the plugin's class ("module:class" under arr_coc.serving.vllm), imported by vLLM only.
ARCHITECTURES: dict[str, str] = {
    FAMILY_ARCHITECTURES["qwen2_vl"]: "qwen:ARRCOCQwen2VL",
    FAMILY_ARCHITECTURES["qwen2_5_vl"]: "qwen2_5:ARRCOCQwen2_5_VL",
    FAMILY_ARCHITECTURES["qwen3_vl"]: "qwen3:ARRCOCQwen3VL",
}

BUDGET_KEY = "arr_coc_budget"        # per request, in mm_processor_kwargs
QUESTION_KEY = "arr_coc_question"    # set by the plugin's processor: the question's token ids (part of the hash)
COUNT_KEY = "arr_coc_count"          # per image: the kept count the processor wrote placeholders for
SERVER_KEY = "arr_coc_server"        # set by the plugin's processor: the server's layer, encode mode and adapter
PIXELS_KEY = "arr_coc_pixels"        # per image, below float32 serving: the processor's float32 patches (bits)
CLIP_QUESTION_KEY = "arr_coc_clip_question"   # per clip, as QUESTION_KEY / COUNT_KEY / PIXELS_KEY per image
CLIP_COUNT_KEY = "arr_coc_clip_count"
CLIP_PIXELS_KEY = "arr_coc_clip_pixels"
CLIP_KEPT_KEY = "arr_coc_clip_kept"  # per clip, chosen in the processor: its kept cells, raster over (t, h, w)
PLUGIN_KEYS = (BUDGET_KEY, QUESTION_KEY, SERVER_KEY)
INTERNAL_KEYS = (QUESTION_KEY, COUNT_KEY, SERVER_KEY, PIXELS_KEY, CLIP_QUESTION_KEY, CLIP_COUNT_KEY,
                 CLIP_PIXELS_KEY, CLIP_KEPT_KEY)   # a request's own are dropped, never read
# Families whose prompt holds a clip's pads per frame group, each group between its own timestamp text and
# <|vision_start|> / <|vision_end|> (Qwen3-VL): each group's count is fixed when the prompt is written, so their
# clips are chosen in the processor (`ARRCOCProcessor`), before the tower only (`clips_served`).
GROUPED_CLIP_FAMILIES = ("qwen3_vl",)
SETTINGS = ("layer", "encode", "budget", "method", "adapter")
ENCODES = ("after", "before")         # the choice after the tower (on its tokens) or before it (then only the
                                      # chosen cells are encoded); "before"'s gist, margin and windows: not served


class ServeError(ValueError):
    """A server setting the plugin cannot serve; the message is one line that says what to write instead."""


class RequestRefused(ValueError):
    """A request the plugin will not serve (vLLM answers it 400 with this one line, and serves on)."""


@dataclass(frozen=True)
class ServeSettings:
    """The server's ARR-COC settings. layer: a checked folder (None: the untrained layer); budget: the default
    budget (None: the layer's configured one); encode: where the choice runs relative to the tower."""

    layer: str | None = None
    encode: str = "after"
    budget: Budget | None = None
    method: str = "arr_coc"
    adapter: str | None = None       # the LoRA adapter folder its pruned requests run (vLLM's LoRA), None: none

    @classmethod
    def of(cls, hf_config: Any) -> ServeSettings:
        raw = getattr(hf_config, "arr_coc", None)
        if raw is None:
            return cls()
        if isinstance(raw, str):
            raw = json.loads(raw)
        if not isinstance(raw, Mapping):
            raise ServeError(f"hf_overrides 'arr_coc' must be a mapping with keys {list(SETTINGS)}, got {raw!r}")
        unknown = sorted(set(raw) - set(SETTINGS))
        if unknown:
            raise ServeError(f"hf_overrides 'arr_coc' has unknown keys {unknown}; it takes {list(SETTINGS)}")
        encode = str(raw.get("encode", "after"))
        if encode not in ENCODES:
            raise ServeError(f"arr_coc encode={encode!r} is not served (yet): the plugin serves {list(ENCODES)}")
        method = str(raw.get("method", "arr_coc"))
        if method != "arr_coc":
            raise ServeError(f"arr_coc method={method!r} is not served: the plugin serves 'arr_coc'")
        layer = raw.get("layer")
        layer = None if layer in (None, "", "untrained") else check_layer_folder(os.fspath(layer))
        budget = raw.get("budget")
        budget = None if budget is None else parse_budget(budget, "arr_coc budget", wire=True)
        adapter = served_adapter(layer, raw.get("adapter"), encode)
        return cls(layer=layer, encode=encode, budget=budget, method=method, adapter=adapter)

    def default_budget(self) -> Budget:
        """The budget a request gets when it names none: the server's, else the layer's configured budget."""
        if self.budget is not None:
            return self.budget
        if self.layer is None:
            from ... import ARRCOCConfig

            return ARRCOCConfig().attending.budget
        with open(os.path.join(self.layer, "config.json")) as f:
            return parse_budget(json.load(f)["attending"]["budget"], "the layer's budget")

    def min_per_group(self) -> int:
        """The fewest cells each frame group of a clip keeps (the layer's `temporal.min_per_group`)."""
        from ...core.config import TemporalConfig

        if self.layer is None:
            return TemporalConfig().min_per_group
        with open(os.path.join(self.layer, "config.json")) as f:
            temporal = json.load(f).get("temporal") or {}
        return int(temporal.get("min_per_group", TemporalConfig().min_per_group))

    def layer_mode_note(self) -> str | None:
        """One line for the server's log when the layer would meet budgets otherwise than exactly (its "mean" or
        "adaptive" modes decide counts from relevance, after the model runs; vLLM sizes prompts before)."""
        if self.layer is None:
            return None
        with open(os.path.join(self.layer, "config.json")) as f:
            attending = json.load(f)["attending"]
        if attending.get("mode") == "adaptive" or float(attending.get("spread_tau", 0.0)) > 0:
            return (f"ARR-COC: the layer at {self.layer} would scale each image's budget by its relevance ('mean' "
                    "or 'adaptive'); vLLM fixes an image's tokens before the model runs, so this server keeps "
                    "exactly each request's budget")
        return None


def served_adapter(layer: str | None, asked: Any, encode: str) -> str | None:
    """The adapter folder a server runs: the layer folder's `adapter/` unless asked `false` (on by default, as
    `ARRCOC.from_pretrained`), refused in one line where it cannot run (none shipped, or after the tower)."""
    if asked not in (None, True, False):
        raise ServeError(f"arr_coc adapter={asked!r}: write true (the layer's adapter/), false (none) or leave it out")
    shipped = None if layer is None else os.path.join(layer, "adapter")
    if asked is False or (asked is None and (shipped is None or not os.path.isdir(shipped))):
        return None
    if shipped is None or not os.path.isdir(shipped):
        raise ServeError(f"arr_coc adapter=true, but the layer ({layer or 'untrained'}) ships no adapter/ folder")
    if encode != "before":
        # vLLM sizes the tower's LoRA by the image's pads (get_mm_lora_token_counts: pads * merge**2,
        # qwen2_vl.py:1864-1875); after the tower, the tower runs on every cell, more than the pads.
        raise ServeError(f"the layer at {layer} ships a LoRA adapter, which the plugin runs before the tower only "
                         '(vLLM counts the tower\'s LoRA rows by the kept pads): serve encode "before", or '
                         '"adapter": false')
    return shipped


def lora_rank(adapter: str) -> int:
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        return int(json.load(f)["r"])


def check_lora(settings: ServeSettings, lora: Any) -> str | None:
    """Where the server runs the layer's adapter, vLLM's LoRA must be on for the tower too (vLLM's `LoRAConfig`,
    `lora`: None when off); ServeError (one line, with the flags) otherwise. Returns the line the server logs."""
    if settings.adapter is None:
        return None
    rank = lora_rank(settings.adapter)
    flags = (f"--enable-lora --enable-tower-connector-lora --max-lora-rank {max(rank, 16)} "
             f"--default-mm-loras '{{\"image\": \"{os.path.abspath(settings.adapter)}\"}}'")
    if lora is None or not getattr(lora, "enable_tower_connector_lora", False) or int(lora.max_lora_rank) < rank:
        raise ServeError(f"the layer at {settings.layer} ships a LoRA adapter (rank {rank}, on the tower and the "
                         f"language model) that vLLM runs through its LoRA support: start with {flags}, or serve "
                         'the layer alone with "adapter": false')
    mm = dict(getattr(lora, "default_mm_loras", None) or {})
    if os.path.realpath(mm.get("image", "")) == os.path.realpath(settings.adapter):
        return f"ARR-COC: every image request runs the layer's adapter ({settings.adapter}, --default-mm-loras)"
    return (f"ARR-COC: a request runs the layer's adapter ({settings.adapter}) only where it names it as a LoRA "
            f"(offline: lora_request=LoRARequest(...); the server: {flags})")


def clips_served(family: str, encode: str) -> bool:
    """Whether a server of `family` with the choice `encode` ("after" / "before" the tower) takes clips: every
    family before the tower; after it, not the families whose pads are counted per frame group
    (`GROUPED_CLIP_FAMILIES`): their choice runs in the processor, where no tower has run."""
    return family not in GROUPED_CLIP_FAMILIES or encode == "before"


def refuse_clips(limit_per_prompt: Mapping[str, Any] | None, family: str, encode: str) -> None:
    """A server started to take clips (`--limit-mm-per-prompt '{"video": N}'`, N > 0) that cannot serve them
    (`clips_served`) is refused in one line: Qwen3-VL after the tower. Qwen3-VL writes each frame group's own
    timestamp and <|vision_start|> into the prompt, so each group's pads are counted in the processor, where the
    space-time choice then runs, on the pixels, before any tower (docs/SERVING.md, "Clips")."""
    if clips_served(family, encode):
        return
    video = (limit_per_prompt or {}).get("video")
    count = getattr(video, "count", video)          # vLLM 0.32 keeps {modality: int or a per-modality options object}
    if count:
        raise ServeError(f"the ARR-COC plugin serves {FAMILY_NAMES[family]} clips before the tower only (each frame "
                         "group's pads are counted in the processor, where the choice runs): add \"encode\": "
                         "\"before\" to --hf-overrides' arr_coc, or start without \"video\" in "
                         "--limit-mm-per-prompt (a clip request is then refused, 400)")


def check_family(model_type: str | None, served: str) -> None:
    """Refuse, in one line naming the right architecture, a checkpoint of another family than the class `served`
    (a model_type in FAMILY_ARCHITECTURES) serves: each family's vLLM class reads its own config and tower."""
    if model_type == served:
        return
    right = FAMILY_ARCHITECTURES.get(str(model_type))
    fix = (f'serve it with --hf-overrides \'{{"architectures": ["{right}"], ...}}\'' if right else
           f"the plugin serves {', '.join(FAMILY_NAMES.values())} (model_type {', '.join(FAMILY_ARCHITECTURES)})")
    raise ServeError(f"{FAMILY_ARCHITECTURES[served]} serves {FAMILY_NAMES[served]} checkpoints (model_type "
                     f"{served!r}), and this one is {model_type!r}: {fix}")


def request_budget(kwargs: Mapping[str, Any], settings: ServeSettings,
                   server_kwargs: Mapping[str, Any] | None = None) -> Budget:
    """A request's budget (`mm_processor_kwargs["arr_coc_budget"]`), else the server's default: the operator's
    `--mm-processor-kwargs '{"arr_coc_budget": ...}'` (`server_kwargs`, as vLLM users give defaults), else
    `--hf-overrides` "budget", else the layer's. BudgetError (one line) for a bad one."""
    if kwargs.get(BUDGET_KEY) is not None:
        return parse_budget(kwargs[BUDGET_KEY], BUDGET_KEY, wire=True)
    if (server_kwargs or {}).get(BUDGET_KEY) is not None:
        return parse_budget(server_kwargs[BUDGET_KEY], f"--mm-processor-kwargs {BUDGET_KEY}", wire=True)
    return settings.default_budget()


def screen_request_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A request's own `mm_processor_kwargs` as the plugin serves them: the budget, nothing else.

    Every other key would change what is encoded, how large the picture becomes or how it is normalised
    (`min_pixels`, `max_pixels`, `size`, `image_mean`, `do_normalize`, `patch_size`, `merge_size`, ...): those are
    the server's (its checkpoint and `--mm-processor-kwargs`), so a request naming one is refused in one line
    (RequestRefused: HTTP 400). The plugin's internal keys are dropped: a client cannot set them."""
    foreign = sorted(str(k) for k in kwargs if k != BUDGET_KEY and k not in INTERNAL_KEYS)
    if foreign:
        raise RequestRefused(f"mm_processor_kwargs {foreign} refused: on this ARR-COC server a request sets "
                             f"'{BUDGET_KEY}' only; the picture's size and normalisation are the server's "
                             "(--mm-processor-kwargs)")
    return {k: v for k, v in kwargs.items() if k == BUDGET_KEY}


def check_picture(grid_thw: Sequence[int], merge: int, max_model_len: int, index: int, what: str = "image") -> None:
    """Refuse an image (or clip) whose every-token prompt could not fit this server (more merged cells than
    max-model-len): stock vLLM refuses it, and the choice would run over all of its cells, so no budget lets it in."""
    t, h, w = (int(v) for v in grid_thw)
    cells = t * (h // merge) * (w // merge)
    if cells > max_model_len:
        limit = "max_pixels and frame count bound it" if what == "clip" else "max_pixels bounds it"
        raise RequestRefused(f"{what} {index} is {cells:,} merged cells after resizing, more than this server's "
                             f"max-model-len {max_model_len:,} admits at every token: send a "
                             f"smaller {'clip' if what == 'clip' else 'picture'} (the server's {limit})")


def server_fingerprint(settings: ServeSettings) -> str:
    """What a server serves, in every processed item's hash (vLLM's caches key on the processor's kwargs): the
    layer's bytes, the encode mode and the adapter's bytes. Two servers that share a cache never mix rows."""
    digest = hashlib.sha256(f"{settings.encode}|{settings.method}".encode())
    for folder in (settings.layer, settings.adapter):
        digest.update(b"|none" if folder is None else _folder_bytes(folder))
    return digest.hexdigest()[:16]


def _folder_bytes(folder: str) -> bytes:
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(folder)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, folder).encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.digest()


def check_rows(rows: Sequence[int], counts: Sequence[int], what: str = "image") -> None:
    """Each image's (or clip's) kept rows against the placeholders its prompt holds (one count, written by the
    processor): a mismatch is a defect of the plugin, raised naming the item and both counts."""
    for i, (got, want) in enumerate(zip(rows, counts)):
        if int(got) != int(want):
            raise RuntimeError(f"ARR-COC: {what} {i} of this encoder batch kept {int(got)} rows for {int(want)} "
                               "placeholders (the processor's count); this is a plugin defect, please report it")


def kept_count(budget: Budget, grid_thw: Sequence[int], merge: int) -> int:
    """Placeholders for one image: its budget's count of its merged cells."""
    t, h, w = (int(v) for v in grid_thw)
    if t != 1:
        raise ServeError("kept_count counts an image's cells; a clip's are `clip_count`'s")
    return count_of(budget, (h // merge) * (w // merge))


def clip_count(budget: Budget, grid_thw: Sequence[int], merge: int, min_per_group: int = 1) -> int:
    """Placeholders for one clip: its budget's count of its t * h * w merged cells, at least `min_per_group` per
    frame group (one at the least): exactly what the space-time choice keeps (`core.temporal.allocate`), known
    before it runs, so a clip's count never waits for its scores."""
    t, h, w = (int(v) for v in grid_thw)
    n = (h // merge) * (w // merge)
    return max(minimum_count(t, n, min_per_group), count_of(budget, t * n))


def prompt_tokens(tokenizer: Any, image_token_id: int, video_token_id: int) -> PromptTokens:
    """The special token ids a prompt's question is read by (a Qwen `PromptTokens`), from the served checkpoint's
    tokenizer and config: the plugin's classes and the scripts that check them read the question alike."""
    from ...qwen.processing import IM_END, VISION_END
    from ...qwen.prompt import PromptTokens, user_header

    vocab = tokenizer.get_vocab()
    return PromptTokens(image=int(image_token_id), video=int(video_token_id), vision_end=vocab[VISION_END],
                        im_end=vocab[IM_END], pad=0, special=frozenset(getattr(tokenizer, "all_special_ids", []) or []),
                        user_turn=user_header(tokenizer))


def question_ids(prompt_ids: Sequence[int], tokens: Any) -> list[int]:
    """The question's token ids in a prompt's ids (`PromptTokens.question`: after the last <|vision_end|>, up to
    <|im_end|>), as the Hugging Face path reads them."""
    return tokens.question(list(prompt_ids))


def time_positions(groups: torch.Tensor | int, factor: float) -> torch.Tensor | int:
    """A frame group's M-RoPE temporal offset: its index times `factor` (Qwen2.5-VL: `second_per_grid_ts *
    tokens_per_second`; 1 elsewhere), truncated to an integer as vLLM's `iter_mm_grid_thw` (qwen2_5_vl.py:1328-1369)
    and transformers' rope index do."""
    if isinstance(groups, int):
        return int(np.int64(groups * factor)) if factor != 1.0 else groups
    return groups if factor == 1.0 else torch.from_numpy((groups.numpy() * factor).astype(np.int64))


def extent(grid_hw: tuple[int, int], groups: int = 1, factor: float = 1.0) -> int:
    """Where the text after an image or clip continues, relative to its first position: one past its largest
    offset, max(t_last + 1, h, w) (an image: max(h, w))."""
    h, w = grid_hw
    return max(time_positions(groups - 1, factor) + 1, h, w)


def kept_positions(kept: torch.Tensor, grid_hw: tuple[int, int], groups: int = 1, factor: float = 1.0
                   ) -> torch.Tensor:
    """[K, 4] long: each kept cell's (t, h, w) M-RoPE offsets within its image or clip (kept: raster indices over
    (t, h, w), a clip's groups one after the other) and the extent (`extent`: where the text after it starts,
    relative to its first position): vLLM's 4-channel convention for pruned media (`evs.recompute_mrope_positions`)."""
    h, w = grid_hw
    kept = kept.to(torch.long).cpu()
    out = torch.empty((kept.numel(), 4), dtype=torch.long)
    out[:, 0] = time_positions(kept // (h * w), factor)
    out[:, 1] = kept % (h * w) // w
    out[:, 2] = kept % w
    out[:, 3] = extent(grid_hw, groups, factor)
    return out


class Placed(NamedTuple):
    """An image's or clip's pads in a prompt: where they start, how many (its kept count), its merged grid, and
    for a clip its frame groups and their time factor (`time_positions`)."""

    offset: int
    length: int
    h: int
    w: int
    groups: int = 1
    factor: float = 1.0


def prompt_positions(n_tokens: int, items: Sequence[Sequence]) -> tuple[torch.Tensor, int]:
    """[3, n_tokens] M-RoPE positions of a prompt whose images and clips (`Placed`, or (offset, pads, h, w)) each
    hold K pads, and the decode delta (max + 1 - n_tokens). The text's are final: it continues from each item's
    first position plus its `extent`, whatever the item kept, as if it kept all (the Hugging Face path's rule); the
    pads' are provisional, the first K cells' of its first frame group, all at its first temporal position (vLLM
    recomputes them from the kept cells after the encoder). With K = every cell of an image this is vLLM's own
    `get_mrope_input_positions` (qwen2_vl.py:1354-1391)."""
    pieces, st, nxt = [], 0, 0
    for it in sorted(Placed(*x) for x in items):
        text = torch.arange(it.offset - st).expand(3, -1) + nxt
        base, cells = nxt + it.offset - st, torch.arange(it.length) % (it.h * it.w)
        pieces += [text, torch.stack([torch.zeros_like(cells), cells // it.w, cells % it.w]) + base]
        nxt, st = base + extent((it.h, it.w), it.groups, it.factor), it.offset + it.length
    pieces.append(torch.arange(n_tokens - st).expand(3, -1) + nxt)
    pos = torch.cat(pieces, dim=1).to(torch.long)
    return pos, int(pos.max()) + 1 - n_tokens if pos.numel() else 0


def place_kept_positions(input_ids: torch.Tensor, kept: Sequence[torch.Tensor], positions: torch.Tensor,
                         num_computed: int, pad_tokens: int | Sequence[int]) -> tuple[torch.Tensor, int]:
    """The prompt's positions with the pads of this prefill chunk at their kept cells' positions.

    input_ids [N] (the whole prompt), positions [3, N] (`prompt_positions`: the text's final, the pads'
    provisional), kept: this chunk's slices of its images' and clips' `kept_positions` rows ([K, >= 3], in prompt
    order, as vLLM hands them over: the part of each item inside the chunk); pad_tokens: the image and video pad
    ids. The slices fill the chunk's pads in order; a pad's item starts at its provisional temporal position
    (`prompt_positions` gives every pad of an item its item's first position there, whatever the chunk, with or
    without a <|vision_start|> before it). The text never moves, so the decode delta is the stock one. (vLLM's EVS
    helper, `evs.recompute_mrope_positions`, fails where a chunk ends between <|vision_start|> and the first pad,
    evs.py:290-300.)"""
    out = positions.clone()
    total = sum(int(k.shape[0]) for k in kept)
    if total:
        ids = input_ids.to(torch.long)
        pads_of = torch.as_tensor([pad_tokens] if isinstance(pad_tokens, int) else list(pad_tokens), device=ids.device)
        pads = torch.nonzero(torch.isin(ids, pads_of)).flatten()
        pads = pads[pads >= num_computed][:total]
        rel = torch.cat([k[:, :3] for k in kept]).to(out.device, torch.long)
        out[:, pads] = out[0, pads].unsqueeze(0) + rel[: len(pads)].T
    n = int(input_ids.numel())
    return out, int(out.max()) + 1 - n if out.numel() else -n


def frame_units(grid_thw: Sequence[Sequence[int]]) -> tuple[list[tuple[int, int, int]], list[int], list[int]]:
    """Clips as the choice and the tower read them: each frame group a picture of patch grid (1, h, w), in the
    clip's row order (the processor writes a clip's patch rows group after group), as the Hugging Face path splits
    them (`arr_coc.qwen.prompt.visual_units`; the towers attend within a group and give it the same rotary rows).
    -> (per unit its grid, its clip's index, its group)."""
    units, clips, groups = [], [], []
    for c, (t, h, w) in enumerate(grid_thw):
        units += [(1, int(h), int(w))] * int(t)
        clips += [c] * int(t)
        groups += list(range(int(t)))
    return units, clips, groups


def group_counts(cells: torch.Tensor, groups: int, per_group: int) -> list[int]:
    """How many of a clip's kept cells (raster indices over its (t, h, w) merged cells, `per_group` = h * w a
    group) fall in each of its `groups` frame groups: the pads each group's slot of a Qwen3-VL prompt holds."""
    return torch.bincount(cells.to(torch.long).cpu() // per_group, minlength=groups).tolist()


def unit_cells(cells: torch.Tensor, counts: Sequence[int], grid_thw: Sequence[Sequence[int]], merge: int
               ) -> list[torch.Tensor]:
    """The inverse of numbering a clip's kept cells over space and time: cells [sum K] (clips one after the other,
    `counts` each, raster over (t, h, w)) -> per frame group (`frame_units`' order) its kept cells over (h, w)."""
    out, start = [], 0
    for k, (t, h, w) in zip(counts, grid_thw):
        n = (int(h) // merge) * (int(w) // merge)
        mine = cells[start:start + int(k)].to(torch.long).cpu()
        start += int(k)
        out += [mine[mine // n == g] % n for g in range(int(t))]
    return out


def frame_group_positions(kept: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
    """[K, 4] long: a Qwen3-VL clip's kept cells (raster over (t, h, w)) each at (0, row, column) from its own frame
    group's first position, and the group's extent max(h, w): each group sits in the prompt like an image after its
    timestamp text (transformers' Qwen3-VL rope index splits a clip's grid into t grids of one frame, and
    vLLM's `_iter_mm_grid_hw`, qwen3_vl.py:2796-2874, places each frame group alone)."""
    h, w = grid_hw
    return kept_positions(kept.to(torch.long).cpu() % (h * w), grid_hw)


def frame_group_spans(tokens: Sequence[int], start: int, stop: int, vision_start: int, vision_end: int
                      ) -> list[tuple[int, int]]:
    """A Qwen3-VL clip's placeholder tokens[start:stop] (per frame group: its timestamp text, <|vision_start|>,
    its pads, <|vision_end|>) -> per group (its first pad's offset, its pads), as vLLM finds them
    (`_iter_mm_grid_hw`: from each group's <|vision_start|> to its <|vision_end|>)."""
    out: list[tuple[int, int]] = []
    begin = None
    for i in range(start, stop):
        if tokens[i] == vision_start:
            begin = i
        elif tokens[i] == vision_end and begin is not None:
            out.append((begin + 1, i - begin - 1))
            begin = None
    return out


def cell_rows(grid_thw: Sequence[Sequence[int]], kept: Sequence[torch.Tensor], merge: int) -> torch.Tensor:
    """The processor's patch rows of each image's kept cells, images one after the other: merged cell c of an image
    owns the merge**2 consecutive rows from merge**2 * c (`arr_coc/qwen/pixels.py`), which is also the order of
    vLLM's tower positions (`Qwen2VisionTransformer.rot_pos_emb`)."""
    m2, start, out = merge * merge, 0, []
    for (t, h, w), k in zip(grid_thw, kept):
        out.append(start + (k.to(torch.long).cpu()[:, None] * m2 + torch.arange(m2)).reshape(-1))
        start += int(t) * int(h) * int(w)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


__all__ = ["ARCHITECTURES", "BUDGET_KEY", "BudgetError", "CLIP_COUNT_KEY", "CLIP_KEPT_KEY", "CLIP_PIXELS_KEY",
           "CLIP_QUESTION_KEY", "COUNT_KEY", "FAMILY_ARCHITECTURES", "FAMILY_NAMES", "GROUPED_CLIP_FAMILIES",
           "INTERNAL_KEYS", "PIXELS_KEY", "PLUGIN_KEYS", "Placed", "QUESTION_KEY", "RequestRefused", "SERVER_KEY",
           "ServeError", "ServeSettings", "cell_rows", "check_family", "check_lora", "check_picture", "check_rows",
           "clip_count", "clips_served", "extent", "frame_group_positions", "frame_group_spans", "frame_units",
           "group_counts", "kept_count", "kept_positions", "place_kept_positions", "prompt_positions",
           "question_ids", "refuse_clips", "request_budget", "screen_request_kwargs", "served_adapter",
           "server_fingerprint", "time_positions", "unit_cells"]
