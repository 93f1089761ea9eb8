"""Processor helpers for Qwen-VL models: chat prompts, a processor without torchvision, un-patchify.

Why this module exists: without torchvision (docs/DESIGN.md, "Environment")
transformers cannot build the stock Qwen-VL processors, because their video
processor needs torchvision. `ImageOnlyQwenProcessor` reproduces what the stock
processor does — render the chat template, expand each `<|image_pad|>` into one
pad per merged visual token, tokenize, run the PIL image processor — and returns
the same tensors (`input_ids`, `attention_mask`, `pixel_values`, `image_grid_thw`,
`mm_token_type_ids`). Given a `video_processor` (`arr_coc.qwen.video_processor.VideoProcessor`,
torch only) it reads videos too, as its family's stock processor does: clips
(`arr_coc.video.Clip`) become `pixel_values_videos`, `video_grid_thw` (and
Qwen2.5-VL's `second_per_grid_ts`), and each `<|video_pad|>` becomes the clip's
pads (Qwen3-VL: one "<t seconds>" block per temporal group).

`unpatchify_images` inverts the image processor's patchify + normalise, so the
ARR-COC texture array is computed from exactly the resized image the VLM saw
(no second resize that could disagree by a pixel).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from ..video.clip import Clip

logger = logging.getLogger(__name__)

@runtime_checkable
class QwenProcessor(Protocol):
    """What the pruning path uses of a processor: the stock Qwen-VL `AutoProcessor` or `ImageOnlyQwenProcessor`.

    Called with text and images it returns the model's tensors; `tokenizer` renders and decodes text;
    `image_processor` holds the patch size, merge size, normalisation and pixel limits the texture reads.
    """

    tokenizer: Any
    image_processor: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any: ...


IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

# Qwen2-VL's chat template: images, videos and text (one <|image_pad|> per image, one <|video_pad|> per video,
# each between <|vision_start|> and <|vision_end|>, as Qwen's own template writes them; the processor expands
# each pad to the visual's merged-token count).
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_messages(visuals: int | Sequence[Any], question: str) -> list[dict[str, Any]]:
    """One user turn: the visuals first, in order, then the question (Qwen's own examples do this).

    `visuals` is a number of images (the old call), or the item's visuals in order, each an image (anything
    but a Clip) or an `arr_coc.video.Clip`, which is a video entry."""
    kinds = ["image"] * visuals if isinstance(visuals, int) else \
        ["video" if isinstance(v, Clip) else "image" for v in visuals]
    content: list[dict[str, Any]] = [{"type": kind} for kind in kinds]
    content.append({"type": "text", "text": question})
    return [{"role": "user", "content": content}]


def render_prompt(processor: Any, visuals: int | Sequence[Any], question: str) -> str:
    """The chat-template text for (visuals, question), ending with the assistant generation prompt.

    A template with no video branch (a folder saved before videos) renders a video as nothing, so a prompt
    with a video falls back to `QWEN_CHAT_TEMPLATE`, Qwen's own layout, for that template."""
    return render_messages(processor, build_messages(visuals, question))


def render_messages(processor: Any, messages: list[dict[str, Any]]) -> str:
    """`render_prompt` for a whole chat (`arr_coc.conversation.Conversation.messages`)."""
    has_video = any(c["type"] == "video" for m in messages if isinstance(m["content"], list) for c in m["content"])

    def usable(template: Any) -> bool:
        return bool(template) and not (has_video and isinstance(template, str) and "video" not in template)

    if usable(getattr(processor, "chat_template", None)):
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokenizer = getattr(processor, "tokenizer", processor)
    template = getattr(tokenizer, "chat_template", None)
    template = template if usable(template) else QWEN_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def video_inputs(processor: Any, clips: Sequence[Clip]) -> dict[str, Any]:
    """The keyword arguments that hand `clips` to `processor`: this project's processor takes the clips; a stock
    transformers processor takes their frames with their metadata, already sampled (`do_sample_frames=False`),
    so its timestamps and `second_per_grid_ts` come from the clips' own frame rate and indices."""
    if not clips:
        return {}
    vp = getattr(processor, "video_processor", None)
    if isinstance(processor, ImageOnlyQwenProcessor) or getattr(vp, "is_arr_coc", False):
        return {"videos": list(clips)}
    if vp is None:
        raise ValueError(f"this processor ({type(processor).__name__}) has no video processor, so it cannot read "
                         "videos; load the model's processor with arr_coc.qwen.processing.load_processor")
    return {"videos": [c.frames for c in clips], "video_metadata": [c.metadata() for c in clips],
            "do_sample_frames": False}


def video_sampling(processor: Any) -> dict[str, Any]:
    """`arr_coc.video.load_clip` keywords that sample a video as `processor`'s family does (family, fps, min and
    max frames); {} when the processor has no video processor of ours (load_clip's defaults: Qwen2-VL's rule)."""
    vp = getattr(processor, "video_processor", None)
    return vp.sampling() if getattr(vp, "is_arr_coc", False) else {}


def encode_prompts(processor: Any, images: Sequence[Sequence[Any]], questions: Sequence[str]) -> dict[str, torch.Tensor]:
    """Processor tensors for a batch (images[b]: the visuals of question b in order, each an image or an
    `arr_coc.video.Clip`; left padding), every question tokenized as plain text.

    User text is text: a question holding `<|im_end|>`, `<|image_pad|>` or any other special-token string
    must not end its turn, forge another or add an image placeholder. So the chat template is rendered
    with an empty question and run through the processor as usual (images expanded to their pads, any
    processor: the stock one or `ImageOnlyQwenProcessor`), each question is tokenized on its own with
    special tokens split (`split_special_tokens=True`: the characters <, |, i, m, ... never the control
    token), and its tokens are spliced in where the question goes: right before the `<|im_end|>` that
    closes the user turn, the last one in the prompt (which ends with the assistant's generation prompt).
    A question without special-token strings gets exactly the ids of the whole rendered prompt: it sits
    between two special tokens, where tokenizers split the text anyway (tests/test_fuzz.py checks this on
    every family and the embedded model).
    """
    from ..conversation import Conversation

    tok = getattr(processor, "tokenizer", processor)
    texts = []
    for ims, question in zip(images, questions):
        if not isinstance(question, Conversation):
            texts.append(render_prompt(processor, list(ims), ""))
            continue
        kinds = ["video" if isinstance(v, Clip) else "image" for v in ims]
        if kinds != question.visuals:
            raise ValueError(f"the conversation shows {question.visuals} but got visuals {kinds}: pass its images "
                             "and clips in the order they appear")
        texts.append(render_messages(processor, list(question.messages)))
    flat = [im for ims in images for im in ims if not isinstance(im, Clip)]
    clips = [v for ims in images for v in ims if isinstance(v, Clip)]
    kw: dict[str, Any] = {"text": texts, "padding": True, "padding_side": "left", "return_tensors": "pt"}
    if flat:
        kw["images"] = flat
    kw.update(video_inputs(processor, clips))
    tensors = {k: v for k, v in processor(**kw).items() if isinstance(v, torch.Tensor)}
    ids = tensors["input_ids"]
    mask = tensors.get("attention_mask")
    if mask is None:
        mask = tensors["attention_mask"] = torch.ones_like(ids)
    im_end = tok.convert_tokens_to_ids(IM_END)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows_of = [k for k, v in tensors.items() if v.dim() >= 2 and tuple(v.shape[:2]) == tuple(ids.shape)]
    rows: list[dict[str, torch.Tensor]] = []
    for b, question in enumerate(questions):
        if isinstance(question, Conversation):      # rendered and tokenized whole, as a chat server does
            rows.append({k: tensors[k][b][mask[b].bool()] for k in rows_of})
            continue
        q = torch.tensor(tok(question, add_special_tokens=False, split_special_tokens=True)["input_ids"],
                         dtype=ids.dtype)
        keep = mask[b].bool()
        ends = (ids[b][keep] == im_end).nonzero().flatten()
        if len(ends) == 0:
            raise ValueError(f"the chat template rendered no {IM_END} to close the user turn; "
                             "load the processor and chat template that ship with the Qwen-VL checkpoint")
        at = int(ends[-1])
        row = {}
        for k in rows_of:
            v = tensors[k][b][keep]
            fill = q if k == "input_ids" else torch.full((len(q), *v.shape[1:]), 1 if k == "attention_mask" else 0,
                                                          dtype=v.dtype)
            row[k] = torch.cat([v[:at], fill.to(v.device), v[at:]])
        rows.append(row)
    length = max(len(r["input_ids"]) for r in rows)
    for k in rows_of:
        value = pad if k == "input_ids" else 0
        tensors[k] = torch.stack([torch.cat([torch.full((length - len(r[k]), *r[k].shape[1:]), value,
                                                        dtype=r[k].dtype), r[k]]) for r in rows])
    return tensors


class ImageOnlyQwenProcessor:
    """The stock Qwen-VL processor without torchvision: the PIL image processor for images and, when given one,
    `arr_coc.video.VideoProcessor` for videos (the name is older than its video path).

    `processor(text=[...], images=[...], videos=[...], padding=True, return_tensors="pt")` returns what the
    stock processor of `family` returns. Images and videos are flat lists in prompt order (nested per-prompt
    lists are flattened); a video is a `Clip`, or anything `video_processor.load` reads (a path, a list of
    frames, an array). Each `<|video_pad|>` expands as the family's stock processor expands it: Qwen2-VL and
    Qwen2.5-VL one run of t*h*w/m^2 pads; Qwen3-VL, per temporal group, "<{t:.1f} seconds>" +
    `<|vision_start|>` + h*w/m^2 pads + `<|vision_end|>`, replacing the template's whole
    `<|vision_start|><|video_pad|><|vision_end|>` (Qwen's reference processor and transformers 4.57 do this;
    transformers 5.23's replaces only the pad and keeps the outer pair: two more tokens per video).
    """

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None,
                 family: str = "qwen2_vl", video_processor: Any = None):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None) or QWEN_CHAT_TEMPLATE
        self.family = family
        self.video_processor = video_processor
        self.image_token = IMAGE_TOKEN
        self.video_token = VIDEO_TOKEN
        self.fallback_reason = "the stock Qwen-VL processor needs torchvision, which does not import here"
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(
                f"the tokenizer has no {IMAGE_TOKEN} token; load the tokenizer that ships with the Qwen-VL checkpoint"
            )

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True, **kw):
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=tokenize,
            add_generation_prompt=add_generation_prompt, **kw,
        )

    def __call__(
        self,
        text: str | Sequence[str],
        images: Any = None,
        videos: Any = None,
        padding: bool | str = True,
        padding_side: str = "left",
        return_tensors: str = "pt",
        **kwargs: Any,
    ):
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        vision: dict[str, Any] = {}
        if images is not None:
            image_list = list(images) if isinstance(images, (list, tuple)) else [images]
            # Nested per-prompt lists (the stock processor accepts them) flatten to prompt order.
            image_list = [im for x in image_list for im in (x if isinstance(x, (list, tuple)) else [x])]
            if image_list:
                vision = dict(self.image_processor(images=image_list, return_tensors="pt"))
        video_list = _flat_videos(videos)
        video: dict[str, Any] = {}
        if video_list:
            if self.video_processor is None:
                raise ValueError(f"this processor was built without a video processor, so it reads images only "
                                 f"({self.fallback_reason}); build it with video_processor=arr_coc.qwen."
                                 "video_processor.VideoProcessor(family), as load_processor and build_tiny_qwen do")
            video = dict(self.video_processor(video_list))
        merge = int(getattr(self.image_processor, "merge_size", 2))
        counts = [] if not vision else (vision["image_grid_thw"].prod(-1) // merge**2).tolist()
        expanded = self._expand(texts, counts, video)
        enc = self.tokenizer(
            expanded, padding=padding, padding_side=padding_side, return_tensors=return_tensors,
            add_special_tokens=False,
        )
        data = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        ids = data["input_ids"]
        data["mm_token_type_ids"] = (ids == self.image_token_id).long() + 2 * (ids == self.video_token_id).long()
        data.update(vision)
        data.update(video)
        return BatchFeature(data=data)

    def _expand(self, texts: list[str], image_counts: list[int], video: dict[str, Any]) -> list[str]:
        """Each `<|image_pad|>` and `<|video_pad|>` expanded to its visual's pads, in prompt order (class doc)."""
        grids = video["video_grid_thw"].tolist() if video else []
        stamps = video.get("video_timestamps") or [[] for _ in grids]
        vmerge = int(getattr(self.video_processor, "merge_size", 2))
        qwen3 = self.family == "qwen3_vl"
        triple = re.escape(VISION_START + VIDEO_TOKEN + VISION_END)
        pads = f"(?P<pad>{re.escape(VIDEO_TOKEN)})|(?P<image>{re.escape(IMAGE_TOKEN)})"
        pattern = re.compile(f"(?P<video>{triple})|{pads}" if qwen3 else pads)
        k_image = k_video = 0

        def expand(match: re.Match) -> str:
            nonlocal k_image, k_video
            if match.lastgroup == "image":
                if k_image >= len(image_counts):
                    raise ValueError(f"the prompts hold more {IMAGE_TOKEN} placeholders than the "
                                     f"{len(image_counts)} images passed")
                k_image += 1
                return IMAGE_TOKEN * image_counts[k_image - 1]
            if k_video >= len(grids):
                raise ValueError(f"the prompts hold more {VIDEO_TOKEN} placeholders than the {len(grids)} videos "
                                 "passed")
            t, h, w = grids[k_video]
            times = stamps[k_video]
            k_video += 1
            if not qwen3:
                return VIDEO_TOKEN * (t * h * w // vmerge**2)
            per_group = VIDEO_TOKEN * (h * w // vmerge**2)
            return "".join(f"<{times[g]:.1f} seconds>{VISION_START}{per_group}{VISION_END}" for g in range(t))

        expanded = [pattern.sub(expand, t) for t in texts]
        if k_image != len(image_counts):
            raise ValueError(f"{len(image_counts)} images were passed but the prompts hold {k_image} {IMAGE_TOKEN} "
                             "placeholders")
        if k_video != len(grids):
            raise ValueError(f"{len(grids)} videos were passed but the prompts hold {k_video} {VIDEO_TOKEN} "
                             "placeholders")
        return expanded

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    def save_pretrained(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.image_processor.save_pretrained(folder)
        if self.video_processor is not None:
            self.video_processor.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
            f.write(self.chat_template)


def _flat_videos(videos: Any) -> list[Any]:
    """`videos=` as a flat list in prompt order. A list whose items are all Clips is one prompt's videos (flattened);
    any other list inside is one video given as frames (the stock processor's convention)."""
    if videos is None:
        return []
    if isinstance(videos, Clip) or not isinstance(videos, (list, tuple)):
        return [videos]
    out: list[Any] = []
    for v in videos:
        if isinstance(v, (list, tuple)) and v and all(isinstance(c, Clip) for c in v):
            out.extend(v)
        else:
            out.append(v)
    return out


def load_processor(path: str, family: str | None = None, **kwargs: Any) -> Any:
    """`AutoProcessor` if it can be built here, else the PIL image processor + tokenizer + `VideoProcessor`.

    family: the checkpoint's model_type ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"); None reads it from the folder's
    config.json. The video processor's settings are read where transformers reads them
    (`arr_coc.qwen.video_processor.read_video_config`), on top of the family's stock defaults."""
    from transformers import AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the image-only fallback
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
    # Nothing a user can act on (images and videos give the stock tensors), so this is a debug line; the reason
    # is kept and said if a video reaches a processor built without a video processor (an unknown family).
    logger.debug("AutoProcessor could not be built for %s (%s); using the PIL image processor + tokenizer + "
                 "the torch video processor", path, reason)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    image_processor = _load_pil_image_processor(path)
    family = family or _read_family(path)
    video_processor = None
    if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        from .video_processor import VideoProcessor, read_video_config

        video_processor = VideoProcessor.from_image_processor(family, image_processor, read_video_config(path))
    processor = ImageOnlyQwenProcessor(image_processor, tokenizer, chat_template=_read_chat_template(path, tokenizer),
                                       family=family or "qwen2_vl", video_processor=video_processor)
    processor.fallback_reason = f"the stock processor could not be built here: {reason}"
    return processor


def _read_family(path: str) -> str | None:
    """The checkpoint's model_type from its config.json (a folder, or a hub id's cached copy); None if unknown."""
    from .video_processor import read_json

    config = read_json(path, "config.json")
    return config.get("model_type") if isinstance(config, dict) else None


def _load_pil_image_processor(path: str) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    config: dict[str, Any] = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                data = json.load(f)
            config = data.get("image_processor", data)
            break
    else:
        if not os.path.isdir(path):
            try:
                from huggingface_hub import hf_hub_download

                with open(hf_hub_download(path, "preprocessor_config.json")) as f:
                    config = json.load(f)
            except Exception as exc:  # noqa: BLE001
                raise RuntimeError(
                    f"could not read preprocessor_config.json for {path!r} ({exc}); pass a local folder that holds it"
                ) from exc
    keep = {"patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "size",
            "min_pixels", "max_pixels", "do_rescale", "rescale_factor", "do_normalize", "do_resize",
            "do_convert_rgb", "resample"}
    return Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if k in keep})


def _read_chat_template(path: str, tokenizer: Any) -> str | None:
    if os.path.isdir(path):
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja) as f:
                return f.read()
        js = os.path.join(path, "chat_template.json")
        if os.path.isfile(js):
            with open(js) as f:
                return json.load(f).get("chat_template")
    return getattr(tokenizer, "chat_template", None)


def image_processor_of(processor: Any) -> Any:
    return getattr(processor, "image_processor", processor)


def unpatchify_images(
    pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, image_processor: Any
) -> list[torch.Tensor]:
    """Invert the Qwen-VL image processor: pixel_values [sum t*h*w, C*T*p*p] -> images [3, H, W] in [0, 1].

    Row layout per image (see `Qwen2VLImageProcessorPil.patchify`): rows ordered
    (h/m, w/m, m, m) over the patch grid, columns (C, T, p, p); the T copies of a
    still image are equal, so temporal copy 0 is the image. Then undo normalise
    (x * std + mean) and the 1/255 rescale if the processor did not apply it.
    """
    p = int(image_processor.patch_size)
    m = int(image_processor.merge_size)
    tp = int(image_processor.temporal_patch_size)
    images, start = [], 0
    pv = pixel_values.detach().float().cpu()
    c = pv.shape[-1] // (tp * p * p)
    for t, gh, gw in image_grid_thw.tolist():
        n = t * gh * gw
        rows = pv[start:start + n]
        start += n
        x = rows[: gh * gw].reshape(gh // m, gw // m, m, m, c, tp, p, p)[:, :, :, :, :, 0]
        # (gh/m, gw/m, mh, mw, C, ph, pw) -> (C, gh/m, mh, ph, gw/m, mw, pw)
        x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(c, gh * p, gw * p)
        if getattr(image_processor, "do_normalize", True):
            mean = torch.tensor(image_processor.image_mean, dtype=x.dtype).view(-1, 1, 1)
            std = torch.tensor(image_processor.image_std, dtype=x.dtype).view(-1, 1, 1)
            x = x * std + mean
        if not getattr(image_processor, "do_rescale", True):
            x = x / 255.0
        images.append(x.clamp_(0.0, 1.0))
    return images
