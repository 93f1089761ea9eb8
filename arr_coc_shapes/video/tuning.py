"""Fine-tuning the embedded VLM on ShapesVQA-video (issue 37): `python -m arr_coc_shapes train-vlm --video`.

The embedded model was trained on images only, and its word-level tokenizer lacks 18 of the video
questions' words ("which", "way", "left", "start", ...): every direction answer was out of its vocabulary.
So:

1. `extend_vocabulary`: the missing words (`spec.video_words`) join the tokenizer's
   word-level vocabulary with new ids, and the input embeddings and the (untied) LM head grow by as
   many rows, each new row the mean of the old ones;
2. `finetune`: every step takes a batch of clips and a batch of images (so the model keeps answering
   images), each through the same processor path the backend uses (`FromScratch.encode_prompts`: Qwen2-VL's video
   input, temporal groups and all), the answer word and `<|im_end|>` appended, and the loss is the
   language model's cross-entropy on those two tokens; AdamW on every weight, a warm-up then a cosine
   decay over the steps or the seconds (whichever ends first), on any device; the next step's items are
   drawn on two threads while a step trains;
3. the result is saved like any checkpoint (`save_pretrained`, the processor and tokenizer beside it),
   with `training_log_video.json`.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from arr_coc.pipeline.registry import FromScratch, model_type_of, scratch_kit
from ..embedded import kit

VIDEO_LOG = "training_log_video.json"


def extend_vocabulary(model: Any, processor: Any, words: list[str]) -> list[str]:
    """Add the words the word-level tokenizer lacks; grow the embeddings and the LM head to match.
    -> the words added (in id order)."""
    from tokenizers import Tokenizer

    tok = processor.tokenizer
    spec = json.loads(tok.backend_tokenizer.to_str())
    if spec["model"]["type"] != "WordLevel":
        raise ValueError("extend_vocabulary grows a word-level tokenizer (the embedded model's); this one is "
                         f"{spec['model']['type']}")
    vocab = spec["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in spec.get("added_tokens", [])}
    added, next_id = [], max(taken) + 1
    for w in words:
        if w not in vocab:
            vocab[w] = next_id
            added.append(w)
            next_id += 1
    if not added:
        return []
    tok._tokenizer = Tokenizer.from_str(json.dumps(spec))
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(next_id, mean_resizing=False)
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            if layer is not None:
                layer.weight[old:] = layer.weight[:old].mean(0, keepdim=True)
    return added


def _batch(family: FromScratch, processor: Any, visuals: list[Any], questions: list[str], answers: list[str],
           device: Any):
    """Processor tensors with each answer word and the turn's end (<|im_end|>) appended; labels only on those two
    tokens. `family`: the model's `FromScratch`."""
    tok = processor.tokenizer
    inputs = family.encode_prompts(processor, [[v] for v in visuals], questions)
    ids = []
    for a in answers:
        got = tok(a, add_special_tokens=False)["input_ids"]
        if len(got) != 1 or got[0] == tok.unk_token_id:
            raise ValueError(f"answer {a!r} is not one word of the tokenizer: extend_vocabulary first")
        ids.append([got[0], tok.convert_tokens_to_ids(family.end_token)])
    tail = torch.tensor(ids, dtype=inputs["input_ids"].dtype)
    shape = tuple(inputs["input_ids"].shape)
    for name, value in list(inputs.items()):      # every per-token row grows by the two tokens (text: type 0)
        if value.dim() == 2 and tuple(value.shape) == shape:
            more = tail if name == "input_ids" else torch.ones_like(tail) if name == "attention_mask" else \
                torch.zeros_like(tail)
            inputs[name] = torch.cat([value, more.to(value.dtype)], 1)
    labels = torch.full_like(inputs["input_ids"], -100)
    labels[:, -2:] = tail
    inputs["labels"] = labels
    return {k: v.to(device) for k, v in inputs.items()}


def _clip_batch(seed: int, start: int, n: int):
    from arr_coc.video import load_clip
    from .items import make_clip_item

    visuals, questions, answers = [], [], []
    for i in range(start, start + n):
        frames, record, _ = make_clip_item(seed=seed, split="train", index=i)
        visuals.append(load_clip(frames, frame_rate=float(record.get("fps", 2))))
        questions.append(record["question"])
        answers.append(record["answers"][0])
    return visuals, questions, answers


def _image_batch(seed: int, start: int, n: int):
    from ..items import make_item

    visuals, questions, answers = [], [], []
    for i in range(start, start + n):
        image, record, _ = make_item(seed, "train", i)
        visuals.append(image)
        questions.append(record["question"])
        answers.append(record["answers"][0])
    return visuals, questions, answers


def finetune(model: Any, processor: Any, steps: int = 2000, seconds: float | None = None, clips: int = 8,
             images: int = 8, lr: float = 2e-4, warmup: int = 50, seed: int = 0, progress: bool = True,
             on_save: Any = None, save_every_s: float = 60.0) -> list[dict[str, float]]:
    """Train on clips + images (module docstring) for `steps` or `seconds`; -> the log (one dict per step).
    on_save(log): called every `save_every_s` seconds and at the end (write the checkpoint there)."""
    device = model.device
    family = kit(model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    log: list[dict[str, float]] = []
    t0 = last_save = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="video fine-tune", unit="step", dynamic_ncols=True)
    kinds = [(name, make, n) for name, make, n in (("video", _clip_batch, clips), ("image", _image_batch, images))
             if n > 0]
    pool = ThreadPoolExecutor(max_workers=2)      # the next step's items are drawn while this one trains

    def items(step: int) -> dict[str, Any]:
        return {name: pool.submit(make, seed + 1000 * (name == "image"), step * n, n) for name, make, n in kinds}

    ahead = items(0)
    for step in range(steps):
        done = max(step / steps, (time.perf_counter() - t0) / seconds if seconds else 0.0)   # steps or time
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        losses = {}
        opt.zero_grad(set_to_none=True)
        now, ahead = ahead, items(step + 1)
        for name, _, _ in kinds:
            visuals, questions, answers = now[name].result()
            loss = model(**_batch(family, processor, visuals, questions, answers, device)).loss
            loss.backward()
            losses[name] = float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - t0
        log.append({"step": step, "lr": lr * scale, "seconds": round(elapsed, 2),
                    **{f"loss_{k}": round(v, 5) for k, v in losses.items()}})
        if bar is not None:
            bar.update(1)
            bar.set_postfix({k: f"{v:.3f}" for k, v in losses.items()})
        if on_save is not None and time.perf_counter() - last_save > save_every_s:
            on_save(log)
            last_save = time.perf_counter()
        if seconds is not None and elapsed > seconds:
            break
    pool.shutdown(wait=False, cancel_futures=True)
    if bar is not None:
        bar.close()
    model.eval()
    if on_save is not None:
        on_save(log)
    return log


def run(init: str, out: str, steps: int, seconds: float | None, clips: int, images: int, lr: float, seed: int,
        device: str = "cpu") -> dict[str, Any]:
    """Load `init`, extend the vocabulary, fine-tune, save to `out` (model, processor, log)."""
    import os

    from .spec import video_words

    model, processor = scratch_kit(model_type_of(init)).load(init, device=device, dtype="float32")
    model.requires_grad_(True)
    added = extend_vocabulary(model, processor, video_words())
    os.makedirs(out, exist_ok=True)

    def save(log: list[dict[str, float]]) -> None:
        model.save_pretrained(out)
        processor.save_pretrained(out)
        with open(os.path.join(out, VIDEO_LOG), "w") as f:
            json.dump({"init": init, "words_added": added, "steps": len(log), "clips_per_step": clips,
                       "images_per_step": images, "lr": lr, "seed": seed, "device": str(model.device),
                       "log": log}, f)

    torch.manual_seed(seed)
    log = finetune(model, processor, steps=steps, seconds=seconds, clips=clips, images=images, lr=lr, seed=seed,
                   on_save=save)
    return {"out": out, "words_added": added, "steps": len(log), "last": log[-1] if log else None}
