"""lmms-eval's requests in the front door's terms: `Instance.args` -> a question with its images, the task's
`gen_kwargs` -> `ARRCOC.generate` keywords, and the batches they run in. Pure Python: no lmms-eval import.

lmms-eval 0.7.x builds a `generate_until` request's `Instance.args` in one of two layouts
(lmms_eval/api/task.py, `construct_requests`):

    chat    ConfigurableMessagesTask, what a chat model (is_simple = False, like this one) gets:
            (ctx, doc_to_messages, gen_kwargs, doc_id, task, split)
    simple  ConfigurableTask (and a task written as a Python class, whatever the model):
            (ctx, gen_kwargs, doc_to_visual, doc_id, task, split)

A 5-element tuple is one of the two without its split (the doc is then looked up in the task's only
split). The second element tells the layouts apart: a dict is the simple layout's gen_kwargs, a callable
the chat layout's doc_to_messages. Multi-round and agentic requests have 7 elements; they are refused.

The backend renders its chat template itself from (images, question), so a chat request must be one
user turn: its images and videos (in order; a video is a file path, read by the front door with the model's own
sampling rule) and its text parts (joined as the template joins them, with nothing in between). A system
prompt, an assistant turn (few-shot as chat) or an audio clip cannot be said that way and raises
NotImplementedError naming what was sent.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

IMAGE_EXTS = frozenset((".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"))  # a path read as an image


@dataclass(frozen=True)
class RequestSpec:
    """One `generate_until` request, before its doc is read (cheap: no image is opened)."""

    index: int                      # position in the list lmms-eval passed (answers go back in that order)
    layout: str                     # "chat" | "simple"
    context: str                    # ctx: the task's text for the doc (the chat layout rebuilds it from messages)
    gen_kwargs: dict[str, Any]      # the task's generation_kwargs, as sent
    doc_fn: Callable[..., Any]      # doc_to_messages (chat) or doc_to_visual (simple)
    doc_id: int
    task: str
    split: str | None               # None: the 5-element layout, the task's only split


@dataclass(frozen=True)
class Prompt:
    """What the front door is asked: one question and its images (PIL images or file paths), in prompt order."""

    question: str
    images: tuple[Any, ...]


@dataclass(frozen=True)
class Generation:
    """The task's gen_kwargs as `ARRCOC.generate` keywords, and the stop strings applied to the answer."""

    kwargs: dict[str, Any]          # max_new_tokens, do_sample, and temperature / top_p / top_k / num_beams if asked
    until: tuple[str, ...]          # the answer is cut at the first of these
    ignored: tuple[str, ...]        # gen_kwargs keys that mean nothing to this model


def parse_args(index: int, args: Sequence[Any]) -> RequestSpec:
    """`Instance.args` (5 or 6 elements, chat or simple layout) -> RequestSpec; anything else is refused."""
    args = tuple(args)
    if len(args) == 7:
        raise NotImplementedError(
            "arr_coc answers generate_until requests only; a 7-element request is lmms-eval's multi-round or "
            "agentic layout (ctx, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split), which this model "
            "does not run: choose a single-turn task")
    if len(args) not in (5, 6):
        raise ValueError(
            f"an lmms-eval generate_until request has 6 elements, (ctx, doc_to_messages, gen_kwargs, doc_id, task, "
            f"split) or (ctx, gen_kwargs, doc_to_visual, doc_id, task, split), or 5 without the split; got "
            f"{len(args)}: {_kinds(args)}")
    ctx, second, third, doc_id, task = args[:5]
    split = args[5] if len(args) == 6 else None
    if callable(second) and isinstance(third, Mapping):
        layout, doc_fn, gen_kwargs = "chat", second, third
    elif isinstance(second, Mapping) and callable(third):
        layout, doc_fn, gen_kwargs = "simple", third, second
    else:
        raise ValueError(
            "cannot tell the request's layout: expected (ctx, doc_to_messages, gen_kwargs, ...) or (ctx, gen_kwargs, "
            f"doc_to_visual, ...), got {_kinds(args)}")
    return RequestSpec(index, layout, str(ctx), dict(gen_kwargs), doc_fn, doc_id, str(task),
                       None if split is None else str(split))


def find_doc(task_dict: Mapping[str, Any], spec: RequestSpec) -> Any:
    """The doc the request is about: task_dict[task][split][doc_id] (lmms-eval fills `lm.task_dict`)."""
    if spec.task not in task_dict:
        raise KeyError(f"task {spec.task!r} is not in the model's task_dict (lmms-eval's evaluator fills it; "
                       f"known: {sorted(task_dict)})")
    splits = task_dict[spec.task]
    split = spec.split
    if split is None:
        names = list(splits.keys())
        if len(names) != 1:
            raise ValueError(f"a request without a split names task {spec.task!r}, which has splits {names}; "
                             "send the 6-element request with its split")
        split = names[0]
    return splits[split][spec.doc_id]


def read_prompt(spec: RequestSpec, doc: Any) -> Prompt:
    """The question and images of a request, from its doc."""
    if spec.layout == "simple":
        visuals = spec.doc_fn(doc) or []
        return Prompt(spec.context.replace("<image>", ""), tuple(_image(v) for v in visuals))
    return prompt_from_messages(spec.doc_fn(doc))


def prompt_from_messages(messages: Any) -> Prompt:
    """One user turn (lmms-eval's chat messages: dicts or its pydantic ChatMessages) -> Prompt."""
    if hasattr(messages, "messages"):          # lmms_eval.protocol.ChatMessages
        messages = messages.messages
    messages = [m.model_dump() if hasattr(m, "model_dump") else m for m in messages]
    roles = [m.get("role") for m in messages]
    if "system" in roles:
        raise NotImplementedError(
            "the request carries a system prompt; arr_coc renders Qwen's chat template with the checkpoint's own "
            "system prompt and one user turn, so a task's system message cannot be honoured")
    if roles != ["user"]:
        raise NotImplementedError(
            f"the request is a conversation with turns {roles}; arr_coc answers one user turn (few-shot examples "
            "as chat turns and multi-round tasks are not supported)")
    content = messages[0].get("content")
    if isinstance(content, str):
        return Prompt(content, ())
    texts, images = [], []
    for part in content or []:
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "image":
            images.append(part.get("url", part.get("image")))
        elif kind == "video":
            images.append(_image(part.get("url", part.get("video"))))
        else:
            raise NotImplementedError(
                f"the request holds {kind!r} content; arr_coc prunes the visual tokens of images and videos only "
                "(no audio): choose an image or video task")
    return Prompt("".join(texts), tuple(images))


def generation(gen_kwargs: Mapping[str, Any], default_max_new_tokens: int) -> Generation:
    """The task's gen_kwargs as lmms-eval's Qwen models read them: temperature 0 (or none) is greedy and a
    positive temperature samples (with top_p / top_k when given); max_new_tokens defaults to the model's."""
    until = gen_kwargs.get("until")
    if until is None:
        stops: tuple[str, ...] = ()
    elif isinstance(until, str):
        stops = (until,)
    elif isinstance(until, (list, tuple)) and all(isinstance(u, str) for u in until):
        stops = tuple(until)
    else:
        raise ValueError(f"gen_kwargs['until'] must be a string or a list of strings, got {until!r}")
    max_new = gen_kwargs.get("max_new_tokens")
    max_new = default_max_new_tokens if max_new is None else int(max_new)
    if max_new < 1:
        raise ValueError(f"gen_kwargs['max_new_tokens'] must be at least 1, got {max_new}")
    temperature = float(gen_kwargs.get("temperature") or 0.0)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new, "do_sample": temperature > 0}
    if temperature > 0:
        kwargs["temperature"] = temperature
        for key in ("top_p", "top_k"):
            if gen_kwargs.get(key) is not None:
                kwargs[key] = gen_kwargs[key]
    beams = int(gen_kwargs.get("num_beams") or 1)
    if beams > 1:
        kwargs["num_beams"] = beams
    known = {"until", "max_new_tokens", "temperature", "do_sample", "top_p", "top_k", "num_beams"}
    return Generation(kwargs, stops, tuple(sorted(k for k in gen_kwargs if k not in known)))


def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """The answer up to the first occurrence of any stop string (lmms-eval's `until`)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def plan_batches(specs: Sequence[RequestSpec], batch_size: int) -> list[list[RequestSpec]]:
    """Batches of at most `batch_size` requests that share their gen_kwargs (one generate() call each),
    longest context first within each group (as lmms-eval's models sort), ties in the order sent."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    groups: dict[str, list[RequestSpec]] = {}
    for spec in specs:
        groups.setdefault(_key(spec.gen_kwargs), []).append(spec)
    batches = []
    for group in groups.values():
        ordered = sorted(group, key=lambda s: -len(s.context))   # stable: ties keep lmms-eval's order
        batches.extend(ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size))
    return batches


def _key(gen_kwargs: Mapping[str, Any]) -> str:
    return json.dumps(gen_kwargs, sort_keys=True, default=repr)


def _image(visual: Any) -> Any:
    """A visual of doc_to_visual: an image (PIL, or a path with an image extension, as lmms-eval reads them) or a
    video file path (mp4, webm, ...: `generate` reads it as a clip, sampled by the model's rule, one budget over
    it); an audio clip or anything else (a dict, another path) is refused."""
    from ..video.reading import is_clip_path

    if isinstance(visual, str) and is_clip_path(visual):
        return visual
    if isinstance(visual, dict) or (isinstance(visual, str) and os.path.splitext(visual)[1].lower() not in IMAGE_EXTS):
        raise NotImplementedError(
            f"doc_to_visual returned {str(visual)[:80]!r}, neither an image nor a video file; arr_coc prunes the "
            "visual tokens of images and videos: choose an image or video task")
    return visual


def _kinds(args: Sequence[Any]) -> str:
    return "(" + ", ".join("callable" if callable(a) else type(a).__name__ for a in args) + ")"
