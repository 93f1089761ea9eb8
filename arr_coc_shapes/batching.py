"""Visual tokens of a batch of images, and the LM batch built from them: several questions per image in one
sequence, each in its own attention block at the positions a single-question prompt would have, with the
batch's attention-supervision targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arr_coc.geometry import centre_cells
from .attention import supervised_rows
from .embedded import kit
from .supervision import answer_cells
from .vocabulary import CELL_PX, COLOR_NAMES, SHAPES


def visual_tokens(model, processor, images):
    """Merged visual tokens per image [N_i, D] and merged grids (h, w) (the model's `FromScratch.visual_tokens`)."""
    return kit(model).visual_tokens(model, processor, images)


@dataclass
class Supervision:
    """Attention targets of one batch, each a list of (batch row, answer position, key positions [K])."""

    cells: list   # the answer's kept cells (heads 0 of the attn_layers)
    words: list   # the question's colour / shape words (head 0 of layer 0)
    count: list   # count questions: the centre cell of each counted object (may be empty)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int], int]]:
        return supervised_rows(self.cells, self.words, self.count)


class Batcher:
    """Turns items into one padded LM batch with block-diagonal question segments."""

    def __init__(self, model, processor):
        self.model = model
        self.processor = processor
        self.tok = processor.tokenizer
        self.kit = kit(model)
        self.image_id = self.tok.convert_tokens_to_ids(self.kit.image_token)
        self.end_id = self.tok.convert_tokens_to_ids(self.kit.end_token)
        self.pad_id = self.tok.pad_token_id
        # The words a question selects its object by: colours and shapes (singular or plural).
        keys = list(COLOR_NAMES) + list(SHAPES) + [f"{s}s" for s in SHAPES]
        self.key_ids = {i for i in self.tok.convert_tokens_to_ids(keys) if i != self.tok.unk_token_id}

    def encode(self, question: str, n_visual: int) -> tuple[list[int], list[int]]:
        """(prefix ids up to and including the image pads, suffix ids after them) of the single-question prompt."""
        text = self.kit.render_prompt(self.processor, 1, question)
        head, tail = text.split(self.kit.image_token)
        prefix = self.tok(head, add_special_tokens=False)["input_ids"] + [self.image_id] * n_visual
        return prefix, self.tok(tail, add_special_tokens=False)["input_ids"]

    def answer_id(self, answer: str) -> int:
        ids = self.tok(answer, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or ids[0] == self.tok.unk_token_id:
            raise ValueError(f"answer {answer!r} is not one known word of the tokenizer")
        return ids[0]

    def build(self, feats: list[torch.Tensor], grids: list[tuple[int, int]], questions: list[list], keep: list[torch.Tensor]):
        """feats: per image [N_i, D] visual tokens; keep: per image kept raster indices (ascending).

        Returns inputs_embeds [B, L, D], position_ids [3, B, L], mask [B, 1, L, L] (additive float:
        0 = attend, -inf = not), targets [B, L] (-100 = no loss), types (question type per target
        position, list of lists), and the batch's attention `Supervision`.
        """
        embed = self.model.get_input_embeddings()
        seqs = []
        for f, (gh, gw), qs, kept in zip(feats, grids, questions, keep):
            prefix, _ = self.encode(qs[0][0], gh * gw)
            n_text = len(prefix) - gh * gw
            # Unpruned Qwen2-VL positions: text 0..n_text-1, image (t, h, w) offset by n_text,
            # text after the image continues from n_text + max(gh, gw) (what get_rope_index gives).
            rows, cols = kept // gw, kept % gw
            pos = [torch.arange(n_text).repeat(3, 1),
                   torch.stack([torch.full_like(kept, n_text), rows + n_text, cols + n_text])]
            start = n_text + max(gh, gw)
            ids = prefix[:n_text]
            seg = [0] * (n_text + len(kept))
            target = [-100] * (n_text + len(kept))
            qtypes = [None] * (n_text + len(kept))
            slot = {int(c): n_text + i for i, c in enumerate(kept.tolist())}  # cell -> sequence position
            sup, word_sup, count_sup = [], [], []
            suffix_ids = []
            for j, (q, a, qtype, boxes) in enumerate(qs, start=1):
                _, suffix = self.encode(q, 0)
                body = suffix + [self.answer_id(a), self.end_id]
                suffix_ids += body
                pos.append(torch.arange(start, start + len(body)).repeat(3, 1))
                seg += [j] * len(body)
                t = [-100] * len(body)
                t[len(suffix) - 1], t[len(suffix)] = body[len(suffix)], self.end_id
                target += t
                qt = [None] * len(body)
                qt[len(suffix) - 1] = qtype
                cells = [slot[c] for c in answer_cells(boxes, gh, gw) if c in slot]
                answer_pos = len(qtypes) + len(suffix) - 1
                if cells:
                    sup.append((answer_pos, torch.tensor(cells)))
                words = [len(qtypes) + k for k, t in enumerate(suffix) if t in self.key_ids]
                if words:
                    word_sup.append((answer_pos, torch.tensor(words)))
                if qtype == "count":
                    centres = [slot[c] for c in centre_cells(boxes, (gh, gw), CELL_PX) if c in slot]
                    count_sup.append((answer_pos, torch.tensor(centres, dtype=torch.long)))
                qtypes += qt
            emb = torch.cat([embed(torch.tensor(ids)), f[kept], embed(torch.tensor(suffix_ids))])
            seqs.append((emb, torch.cat(pos, 1), torch.tensor(seg), torch.tensor(target), qtypes, sup, word_sup, count_sup))
        length = max(s[0].shape[0] for s in seqs)
        b = len(seqs)
        d = seqs[0][0].shape[1]
        inputs = torch.zeros(b, length, d)
        positions = torch.zeros(3, b, length, dtype=torch.long)
        segs = torch.full((b, length), -1)
        targets = torch.full((b, length), -100)
        types, supervision = [], Supervision([], [], [])
        for i, (emb, pos, seg, tgt, qt, sup, word_sup, count_sup) in enumerate(seqs):
            n = emb.shape[0]
            inputs[i, :n], positions[:, i, :n], segs[i, :n], targets[i, :n] = emb, pos, seg, tgt
            types.append(qt + [None] * (length - n))
            supervision.cells += [(i, p, cells) for p, cells in sup]
            supervision.words += [(i, p, words) for p, words in word_sup]
            supervision.count += [(i, p, cells) for p, cells in count_sup]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        same = (segs[:, None, :] == 0) | (segs[:, None, :] == segs[:, :, None])
        mask = causal & same & (segs[:, None, :] >= 0)
        mask |= torch.eye(length, dtype=torch.bool)  # padded rows attend to themselves (no NaN)
        additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # eager and sdpa alike
        return inputs, positions, additive[:, None], targets, types, supervision
