"""Processor helpers for Qwen-VL models: chat prompts, an image-only processor, un-patchify.

Why this module exists: without torchvision (docs/DESIGN.md, "Environment")
transformers cannot build the stock Qwen-VL processors, because their video
processor needs torchvision. `ImageOnlyQwenProcessor` reproduces what the stock
processor does for images — render the chat template, expand each
`<|image_pad|>` into one pad per merged visual token, tokenize, run the PIL image
processor — and returns the same tensors (`input_ids`, `attention_mask`,
`pixel_values`, `image_grid_thw`, `mm_token_type_ids`).

`unpatchify_images` inverts the image processor's patchify + normalise, so the
ARR-COC texture array is computed from exactly the resized image the VLM saw
(no second resize that could disagree by a pixel).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

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

# Qwen2-VL's chat template, images and text only (one <|image_pad|> per image; the
# processor expands it to the image's merged-token count).
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
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
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_messages(n_images: int, question: str) -> list[dict[str, Any]]:
    """One user turn: the images first, then the question (Qwen's own examples do this)."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    content.append({"type": "text", "text": question})
    return [{"role": "user", "content": content}]


def render_prompt(processor: Any, n_images: int, question: str) -> str:
    """The chat-template text for (images, question), ending with the assistant generation prompt."""
    messages = build_messages(n_images, question)
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokenizer = getattr(processor, "tokenizer", processor)
    template = getattr(tokenizer, "chat_template", None) or QWEN_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def encode_prompts(processor: Any, images: Sequence[Sequence[Any]], questions: Sequence[str]) -> dict[str, torch.Tensor]:
    """Processor tensors for a batch (images[b]: the images of question b; left padding), every question
    tokenized as plain text.

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
    tok = getattr(processor, "tokenizer", processor)
    texts = [render_prompt(processor, len(ims), "") for ims in images]
    flat = [im for ims in images for im in ims]
    kw: dict[str, Any] = {"text": texts, "padding": True, "padding_side": "left", "return_tensors": "pt"}
    if flat:
        kw["images"] = flat
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
    """The stock Qwen-VL processor's image path, with no torchvision and no video processor.

    `processor(text=[...], images=[...], padding=True, return_tensors="pt")` returns what
    the stock processor returns for images. Images are a flat list in prompt order.
    """

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None) or QWEN_CHAT_TEMPLATE
        self.image_token = IMAGE_TOKEN
        self.fallback_reason = "the stock Qwen-VL processor needs torchvision for videos"
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
        padding: bool | str = True,
        padding_side: str = "left",
        return_tensors: str = "pt",
        **kwargs: Any,
    ):
        from transformers import BatchFeature

        if kwargs.get("videos") is not None:
            raise ValueError(f"this processor reads images only, not videos ({self.fallback_reason}); pass a video as "
                             "a list of frames (images), or install a torchvision that imports beside this torch")
        texts = [text] if isinstance(text, str) else list(text)
        vision: dict[str, Any] = {}
        if images is not None:
            image_list = list(images) if isinstance(images, (list, tuple)) else [images]
            # Nested per-prompt lists (the stock processor accepts them) flatten to prompt order.
            image_list = [im for x in image_list for im in (x if isinstance(x, (list, tuple)) else [x])]
            if image_list:
                vision = dict(self.image_processor(images=image_list, return_tensors="pt"))
        merge = int(getattr(self.image_processor, "merge_size", 2))
        counts = [] if not vision else (vision["image_grid_thw"].prod(-1) // merge**2).tolist()
        # Expand each <|image_pad|> to its image's merged-token count, in prompt order.
        expanded, k = [], 0
        for t in texts:
            parts = t.split(IMAGE_TOKEN)
            out = [parts[0]]
            for part in parts[1:]:
                if k >= len(counts):
                    raise ValueError(
                        f"the prompts hold more {IMAGE_TOKEN} placeholders than the {len(counts)} images passed"
                    )
                out.append(IMAGE_TOKEN * counts[k])
                out.append(part)
                k += 1
            expanded.append("".join(out))
        if k != len(counts):
            raise ValueError(f"{len(counts)} images were passed but the prompts hold {k} {IMAGE_TOKEN} placeholders")
        enc = self.tokenizer(
            expanded, padding=padding, padding_side=padding_side, return_tensors=return_tensors,
            add_special_tokens=False,
        )
        data = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        ids = data["input_ids"]
        data["mm_token_type_ids"] = (ids == self.image_token_id).long() + 2 * (ids == self.video_token_id).long()
        data.update(vision)
        return BatchFeature(data=data)

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    def save_pretrained(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.image_processor.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
            f.write(self.chat_template)


def load_processor(path: str, **kwargs: Any) -> Any:
    """`AutoProcessor` if it can be built here, else the PIL image processor + tokenizer (image-only)."""
    from transformers import AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the image-only fallback
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
    # Nothing a user can act on while they pass images (the image path is the same tensors), so this is a
    # debug line; the reason is kept and said when a video is actually passed (ImageOnlyQwenProcessor).
    logger.debug("AutoProcessor could not be built for %s (%s); using the PIL image processor + tokenizer "
                 "(image-only)", path, reason)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    image_processor = _load_pil_image_processor(path)
    processor = ImageOnlyQwenProcessor(image_processor, tokenizer, chat_template=_read_chat_template(path, tokenizer))
    processor.fallback_reason = f"the stock processor could not be built here: {reason}"
    return processor


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
