"""The three ways of knowing: each scorer maps a texture array to a [B, h, w] score in [0, 1].

Vervaeke's relevance-realisation framing, as the ARR-COC seeds use it:
- propositional  -> InformationScorer: how much a cell's neighbourhood varies
  (local Shannon information over texture channels, with learnable channel weights);
- perspectival   -> PerspectivalScorer: what stands out to a viewer (a small CNN
  whose untrained output IS a saliency prior, Itti/Koch-style);
- participatory  -> ParticipatoryScorer: how a cell couples with the question
  (cross-attention from cells to question tokens; plus a training-free path that
  compares the VLM's own visual tokens with the question's token embeddings).

All scorers take a `valid` mask [B, h, w] so padded batches of differently sized
grids score each image as if it were alone (border cells only see in-image cells).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import KnowingConfig, TextureConfig
from .texture import channel_names

SALIENCY_CHANNELS = ("sal_spectral", "sal_contrast", "sal_color", "cluster_rarity")


def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def box_sum(x: torch.Tensor, window: int) -> torch.Tensor:
    """Sum over each cell's window x window neighbourhood (zero outside the grid): x [..., h, w] -> same shape.

    Rows then columns, each the neighbours added in window order (offset -r first) onto zeros, in place in one
    buffer: bit for bit the sums of shifted slices of a zero-padded copy started from 0 (what this did before),
    since a sum started from +0 is never -0 and adding the padding's +0 then changes nothing; no padded copies.
    """
    if window == 1:
        return x
    return _running_sum(_running_sum(x, window, -2), window, -1)


def _running_sum(x: torch.Tensor, window: int, dim: int) -> torch.Tensor:
    """out[i] = x[i - r] + ... + x[i + r] along `dim` (r = window // 2; out-of-range terms left out), left to right."""
    r, n = window // 2, x.shape[dim]
    out = torch.zeros_like(x)
    for offset in range(-r, r + 1):             # term x[i + offset] of every out[i] that has one
        lo, hi = max(0, -offset), min(n, n - offset)
        if hi > lo:
            out.narrow(dim, lo, hi - lo).add_(x.narrow(dim, lo + offset, hi - lo))
    return out


def local_information(
    texture: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, bins: int, window: int
) -> torch.Tensor:
    """Weighted local information of each cell, in [0, 1].

    texture [B, C, h, w] in [0, 1], valid [B, h, w] bool, weights [C] >= 0.
    Per channel, each window value is soft-binned into `bins` Gaussian bins; the
    information is the entropy of the window's mixture histogram minus the mean
    entropy of its members (a generalised Jensen-Shannon divergence): 0 where the
    window is uniform, up to 1 (after dividing by log bins) where values spread
    over all bins. Vectorised over cells with window sums (`box_sum`); no loop over cells.
    """
    if texture.requires_grad:
        raise ValueError("local_information reads the texture as data (computed without gradients) and works on "
                         "it in place; pass texture.detach()")
    centres = (torch.arange(bins, dtype=texture.dtype, device=texture.device) + 0.5) / bins
    sigma = 1.0 / bins
    z = texture[:, :, None] - centres[:, None, None]                              # [B, C, K, h, w]
    z = z.mul_(z).div_(-2 * sigma**2)                    # -(d ** 2) / (2 sigma^2), the same floats, in place
    member = torch.softmax(z, dim=2)
    mask = valid[:, None].to(texture.dtype)                                       # [B, 1, h, w]
    count = box_sum(mask, window).clamp_min(1.0)                                  # cells in each window
    mixture = box_sum(member * mask[:, :, None], window).div_(count[:, :, None])  # [B, C, K, h, w]
    mixture_entropy = _entropy(mixture)                                           # [B, C, h, w]
    member_entropy = _entropy(member)
    # Mean member entropy over the window (members are masked, so use the same window sums).
    mean_member = box_sum(member_entropy.mul_(mask), window).div_(count)
    info = (mixture_entropy - mean_member).clamp_min_(0).div_(math.log(bins))    # [B, C, h, w]
    info = (weights[None, :, None, None] * info).sum(1) / weights.sum().clamp_min(1e-12)
    return info * valid


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """-(p * log(max(p, 1e-12))).sum(2) of [B, C, K, h, w] -> [B, C, h, w], in place on one temporary."""
    return p.clamp_min(1e-12).log_().mul_(p).sum(2).neg_()


class InformationScorer(nn.Module):
    """Propositional knowing: local information content with learnable channel weights."""

    def __init__(self, texture: TextureConfig, config: KnowingConfig):
        super().__init__()
        names = channel_names(texture)
        # Position ramps carry no local information worth scoring: start them near zero weight.
        init = torch.tensor([0.05 if n.startswith("pos_") else 1.0 for n in names])
        self.channel_weight_raw = nn.Parameter(_inv_softplus(init))
        self.bins = config.entropy_bins
        self.window = config.entropy_window

    @property
    def channel_weights(self) -> torch.Tensor:
        return F.softplus(self.channel_weight_raw)

    def forward(self, texture: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return local_information(texture, valid, self.channel_weights, self.bins, self.window)


class PerspectivalScorer(nn.Module):
    """Perspectival knowing: salience. sigmoid(saliency-prior logit + small CNN residual).

    The CNN's output layer starts near zero, so an untrained scorer is the saliency
    prior (a weighted mean of the saliency and cluster-rarity channels) and already
    prefers salient cells; training adds what the prior misses.
    """

    def __init__(self, texture: TextureConfig, config: KnowingConfig):
        super().__init__()
        names = channel_names(texture)
        idx = [names.index(n) for n in SALIENCY_CHANNELS if n in names]
        if not idx:
            raise ValueError(
                "PerspectivalScorer needs at least one of the texture channels "
                f"{SALIENCY_CHANNELS}; add 'saliency' or 'clusters' to texture.groups"
            )
        self.register_buffer("prior_index", torch.tensor(idx), persistent=False)
        self.prior_weight = nn.Parameter(torch.full((len(idx),), 1.0 / len(idx)))
        self.prior_gain = nn.Parameter(torch.tensor(10.0))
        self.prior_bias = nn.Parameter(torch.tensor(0.2))
        c, width = len(names), config.cnn_width
        self.cnn = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(width, 1, 1),
        )
        nn.init.normal_(self.cnn[-1].weight, std=1e-3)
        nn.init.zeros_(self.cnn[-1].bias)

    def forward(self, texture: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        mask = valid[:, None].to(texture.dtype)
        x = texture * mask  # zero outside the image == the convs' zero padding
        prior = (x.index_select(1, self.prior_index) * self.prior_weight[None, :, None, None]).sum(1)
        logit = self.prior_gain * (prior - self.prior_bias) + self.cnn(x)[:, 0]
        return torch.sigmoid(logit) * valid


def embedding_relevance(
    visual_tokens: torch.Tensor,
    valid: torch.Tensor,
    query: torch.Tensor,
    query_mask: torch.Tensor,
    tau: float = 0.05,
) -> torch.Tensor:
    """Training-free coupling of the VLM's visual tokens with the question, as z-scores.

    visual_tokens [B, N, D] (raster order over the padded grid), valid [B, N],
    query [B, L, D], query_mask [B, L]. The cosine similarity of every cell to every
    question token is centred over the image's cells per token (removing a word's
    baseline similarity to everything, as for "the") but NOT rescaled, so a word
    whose similarity really varies over the image ("triangle") outweighs words that
    only add noise; tokens are pooled by a soft maximum (temperature `tau`) and the
    result is standardised over the cells. Returns [B, N] (0 outside `valid`).
    """
    v = F.normalize(visual_tokens.float(), dim=-1)
    q = F.normalize(query.float(), dim=-1)
    sim = v @ q.transpose(1, 2)  # [B, N, L]
    m = valid[..., None].to(sim.dtype)
    mean = (sim * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1.0)
    centred = (sim - mean).masked_fill(~query_mask[:, None, :], -1e4)
    pooled = tau * torch.logsumexp(centred / tau, dim=-1)  # [B, N]
    return _masked_standardise(pooled, valid) * valid


def _masked_standardise(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std over dim 1 where mask is True; mask broadcasts to x."""
    m = mask.to(x.dtype).expand_as(x)
    n = m.sum(1, keepdim=True).clamp_min(1.0)
    mean = (x * m).sum(1, keepdim=True) / n
    var = (((x - mean) * m) ** 2).sum(1, keepdim=True) / n
    return (x - mean) / (var.sqrt() + 1e-6)


class ParticipatoryScorer(nn.Module):
    """Participatory knowing: how much each cell couples with the question.

    Learned path: cross-attention logits between cell features and the question's token
    embeddings, aggregated over tokens by a learnable mix of sum, max and mean. A cell's
    features are its texture channels plus, when `visual_tokens` are given, a projection
    of the VLM's own visual token there: the texture knows colour, the VLM's token also
    knows shape and letter. Two more terms see what a per-token dot product cannot:
    `context`, a 3x3 convolution over the cell features (an object's edge cells learn
    from its centre), and `pair`, a one-hidden-layer MLP on cell + pooled question, which
    can score a conjunction ("a red star": red AND star) above either half alone.
    All three start at zero, so an untrained layer (and a layer trained before they
    existed) scores exactly as without them.
    Training-free path (`visual_tokens` given): `embedding_relevance`.
    Output: sigmoid(w_learned * learned + w_embed * embedding), [B, h, w].
    """

    def __init__(self, texture: TextureConfig, config: KnowingConfig):
        super().__init__()
        c, d = len(channel_names(texture)), config.attn_dim
        self.cell_proj = nn.Sequential(nn.Conv2d(c, d, 1), nn.GELU(), nn.Conv2d(d, d, 1))
        self.query_norm = nn.LayerNorm(config.query_dim, elementwise_affine=False)
        self.query_proj = nn.Linear(config.query_dim, d)
        self.token_norm = nn.LayerNorm(config.query_dim, elementwise_affine=False)
        self.token_proj = nn.Linear(config.query_dim, d)
        self.context = nn.Conv2d(d, d, 3, padding=1)
        self.pair_query = nn.Linear(config.query_dim, d)
        self.pair_out = nn.Linear(d, 1)
        for zero in (self.token_proj, self.context, self.pair_out):
            nn.init.zeros_(zero.weight)
            nn.init.zeros_(zero.bias)
        self.aggregation = nn.Parameter(torch.zeros(3))  # softmax over (sum, max, mean)
        self.learned_weight = nn.Parameter(torch.tensor(float(config.learned_weight)))
        self.embed_weight = nn.Parameter(torch.tensor(float(config.embed_weight)))
        self.query_dim = config.query_dim
        self.embed_tau = config.embed_tau
        self.scale = 1.0 / math.sqrt(d)

    def _active(self, name: str) -> bool:
        """Training, or the weights of submodule `name` have moved from their zero initialisation.

        Whether they are all zero is read from the device once per version of the weights (loading, an
        optimiser step or any in-place change bumps a tensor's version), not on every forward. A compiled pass
        reads what `know_weights` knew, by name (no object identity in its guards: another layer of the same
        kind replays the same graph).
        """
        if self.training:
            return True
        if torch.compiler.is_compiling() and name in self.__dict__.get("_known", {}):
            return self.__dict__["_known"][name]
        module = getattr(self, name)
        cache = self.__dict__.setdefault("_nonzero", {})
        params = list(module.parameters())
        key = tuple(p._version for p in params)
        if cache.get(id(module), (None,))[0] != key:
            cache[id(module)] = (key, any(bool(p.any()) for p in params))
        return cache[id(module)][1]

    def know_weights(self) -> None:
        """Read now (on the CPU, before the layer moves to a GPU) which zero-initialised terms are still zero, so
        no forward ever reads it back from the device."""
        self.__dict__["_known"] = {name: self._active(name) for name in ("token_proj", "context", "pair_out")}

    def _apply(self, fn, recurse: bool = True):
        """Moving or casting the weights (`.to(device)`) keeps what `_active` knew of their values."""
        modules = [getattr(self, name) for name in ("token_proj", "context", "pair_out")]
        cache = self.__dict__.get("_nonzero", {})
        known = {id(m): cache[id(m)][1] for m in modules
                 if id(m) in cache and cache[id(m)][0] == tuple(p._version for p in m.parameters())}
        out = super()._apply(fn, recurse)
        for m in modules:
            if id(m) in known:
                cache[id(m)] = (tuple(p._version for p in m.parameters()), known[id(m)])
        return out

    def forward(
        self,
        texture: torch.Tensor,
        valid: torch.Tensor,
        query: torch.Tensor | None,
        query_mask: torch.Tensor | None,
        visual_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, _, h, w = texture.shape
        if query is None:
            return torch.full((b, h, w), 0.5, dtype=texture.dtype, device=texture.device) * valid
        if query.shape[-1] != self.query_dim:
            raise ValueError(
                f"question embeddings have width {query.shape[-1]} but knowing.query_dim is {self.query_dim}; "
                "build the config with ARRCOCConfig().with_query_dim(<VLM text hidden size>)"
            )
        if query_mask is None:
            query_mask = torch.ones(query.shape[:2], dtype=torch.bool, device=query.device)
        mask = valid[:, None].to(texture.dtype)
        cells = self.cell_proj(texture * mask).flatten(2).transpose(1, 2)  # [B, N, d]
        # The zero-initialised terms are skipped while they are still exactly zero (untrained): adding
        # zero changes nothing, and on a 2B-sized VLM they would be most of the layer's FLOPs
        # ([N, D] x [D, d] for the token projection alone).
        if visual_tokens is not None and self._active("token_proj"):
            cells = cells + self.token_proj(self.token_norm(visual_tokens.float()))
        if self._active("context"):
            grid = cells.transpose(1, 2).reshape(b, -1, h, w) * mask  # zero outside the image, as the conv's padding
            cells = cells + self.context(F.gelu(grid)).flatten(2).transpose(1, 2)
        query_n = self.query_norm(query.float())
        keys = self.query_proj(query_n)  # [B, L, d]
        logits = (cells @ keys.transpose(1, 2)) * self.scale  # [B, N, L]
        qm = query_mask[:, None, :].to(logits.dtype)
        n_tok = qm.sum(-1).clamp_min(1.0)
        agg_sum = (logits * qm).sum(-1) / n_tok.sqrt()
        agg_max = logits.masked_fill(qm == 0, -1e4).amax(-1)
        agg_mean = (logits * qm).sum(-1) / n_tok
        mix = torch.softmax(self.aggregation, 0)
        learned = mix[0] * agg_sum + mix[1] * agg_max + mix[2] * agg_mean  # [B, N]
        if self._active("pair_out"):
            pooled = (self.pair_query(query_n) * qm.transpose(1, 2)).sum(1) / n_tok  # [B, d] mean over the question
            learned = learned + self.pair_out(F.gelu(cells + pooled[:, None])).squeeze(-1)
        logit = self.learned_weight * learned
        if visual_tokens is not None:
            logit = logit + self.embed_weight * embedding_relevance(
                visual_tokens, valid.flatten(1), query, query_mask, self.embed_tau
            )
        return torch.sigmoid(logit).reshape(b, h, w) * valid
