"""A conversation through the front door (arr_coc/conversation.py): the question is the last user turn's."""

from __future__ import annotations

import pytest
from PIL import Image

from arr_coc.conversation import Conversation
from arr_coc.errors import InputError

MODEL, LAYER = "checkpoints/shapes-qwen2vl", "checkpoints/arr-coc-shapes-before"
IMAGE = "assets/examples/shapes_color.png"


def _chat(first: str, then: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": first}]},
            {"role": "assistant", "content": "orange"}, {"role": "user", "content": then}]


def test_a_conversation_is_checked_in_one_line():
    chat = Conversation.of(_chat("What color is the circle?", "How many shapes are there?"))
    assert chat.visuals == ["image"] and chat.question == "How many shapes are there?"
    for bad, code in (([], "conversation_not_messages"), ("hi", "conversation_not_messages"),
                      ([{"role": "robot", "content": "x"}], "conversation_bad_message"),
                      ([{"role": "user", "content": [{"type": "audio"}]}], "conversation_bad_part"),
                      (_chat("a", "b")[:2], "conversation_no_question"),
                      ([{"role": "user", "content": [{"type": "image"}]}], "question_empty")):
        with pytest.raises(InputError) as err:
            Conversation.of(bad)
        assert err.value.code == code and "\n" not in str(err.value)


def test_the_follow_up_turns_question_chooses_the_cells():
    """The cells of a two-turn chat are those of its second question asked alone (the choice reads the picture and
    the question's ids only), not the first turn's; the images must match the chat's image parts."""
    from arr_coc import ARRCOC

    vlm = ARRCOC.from_pretrained(MODEL, arr_coc=LAYER, adapter=False)
    image = Image.open(IMAGE).convert("RGB")
    first, then = "What color is the circle?", "What shape is in the top left corner?"

    def kept(question):
        return vlm.generate([image], question, budget=0.05, budget_mode="exact", encode="before",
                            max_new_tokens=2)[1].kept_indices[0].tolist()

    chat = kept(_chat(first, then))
    assert chat == kept(then) and chat != kept(first)
    with pytest.raises(ValueError, match="pass its images and clips in the order they appear"):
        vlm.generate([image, image], _chat(first, then), max_new_tokens=2)
