"""A conversation as the front door takes it: several turns of a chat, its visuals in order of appearance.

    ARRCOC.generate([image], Conversation.of([
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is red?"}]},
        {"role": "assistant", "content": "The circle."},
        {"role": "user", "content": "How many shapes are there?"}]))

The messages are those a chat client sends (OpenAI's or transformers' shape: `content` a string or a list of parts;
an image part is `{"type": "image"}`, or an `image_url` / `image_pil` part, whose picture is passed to `generate` in
order). The question the cells are chosen for is the last user turn's (`arr_coc.qwen.prompt.PromptTokens.question`),
as a chat server such as the vLLM plugin reads it. A conversation is rendered by the checkpoint's chat template and
tokenized whole, as a chat server does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .errors import InputError

ROLES = ("system", "user", "assistant")
IMAGE_PARTS = ("image", "image_url", "image_pil")
VIDEO_PARTS = ("video", "video_url")


@dataclass(frozen=True)
class Conversation:
    """Checked messages, each {"role", "content": str | list of {"type": "image"|"video"|"text", "text"?}}."""

    messages: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, messages: Conversation | Sequence[Mapping[str, Any]]) -> Conversation:
        """Check a chat's messages (InputError, one line, naming the message) and keep them in template form."""
        if isinstance(messages, Conversation):
            return messages
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InputError("A conversation is a non-empty list of messages, each {\"role\": ..., \"content\": "
                             "...}", "conversation_not_messages")
        out = tuple(_message(m, i) for i, m in enumerate(messages))
        if out[-1]["role"] != "user":
            raise InputError(f"The conversation's last message is the {out[-1]['role']}'s: end it with the user's "
                             "question", "conversation_no_question")
        if not _text(out[-1]).strip():
            raise InputError("The conversation's last user message has no text: ask a question about the image",
                             "question_empty")
        return cls(out)

    @property
    def visuals(self) -> list[str]:
        """"image" or "video" per visual part, in order of appearance."""
        return [p["type"] for m in self.messages if isinstance(m["content"], list) for p in m["content"]
                if p["type"] != "text"]

    @property
    def question(self) -> str:
        """The last user turn's text: what the user asks now."""
        return _text(self.messages[-1]).strip()


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, Mapping) or m.get("role") not in ROLES:
        raise InputError(f"Message {i} of the conversation needs a role among {list(ROLES)} and a content",
                         "conversation_bad_message")
    content = m.get("content")
    if isinstance(content, str):
        return {"role": m["role"], "content": content}
    if not isinstance(content, Sequence) or isinstance(content, (bytes, str)):
        raise InputError(f"Message {i}'s content must be text or a list of parts", "conversation_bad_message")
    return {"role": m["role"], "content": [_part(p, i) for p in content]}


def _part(p: Any, i: int) -> dict[str, Any]:
    kind = p.get("type") if isinstance(p, Mapping) else None
    if kind in IMAGE_PARTS:
        return {"type": "image"}
    if kind in VIDEO_PARTS:
        return {"type": "video"}
    if kind == "text" and isinstance(p.get("text"), str):
        return {"type": "text", "text": p["text"]}
    raise InputError(f"Message {i} has a part of type {kind!r}: parts are text, image or video",
                     "conversation_bad_part")


def _text(m: Mapping[str, Any]) -> str:
    c = m["content"]
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c if p["type"] == "text")


__all__ = ["Conversation"]
