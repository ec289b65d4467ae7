"""Log-probs of the tokens that are policy actions, without a (B, T, V) tensor: the LM head in tiles.

Why: the learner and the scorers need log π(a_t | s_t) of the policy's own tokens only, yet a
full-vocabulary log-softmax over every column of a sequence costs B × T × V floats, several times
over once autograd keeps them for the backward (SmolLM2: V = 49,152, a conversation 250–400
columns for 20–38 policy tokens; issue 41 measured 13.8 GB for a 135M model). Here

1. the model's body runs once over the sequence (attention needs every column) and returns its
   final hidden states ``(B, L, H)``; the prompt block's columns that are padding in every row
   are cut first (:func:`cut_prompt_block`);
2. the hidden states of the *selected* positions, those whose next token is a policy action, are
   gathered into ``(n, H)``: the prompt, padding and a partner's reply never meet the LM head;
3. :class:`HeadLogProbs` runs the head and the log-softmax over V in tiles, keeping only
   each row's log-sum-exp for the backward, which recomputes a tile's logits to form its gradient
   (the idea of Liger's fused linear cross-entropy and Apple's cut-cross-entropy; TRL's
   ``selective_log_softmax`` and verl's chunked logsumexp slice the same way).

The working set is one tile of logits at a time (a block of rows by a slice of the vocabulary,
:func:`tile_shape`; a few of them alive at once), sized in bytes, so it does not grow with V
(docs/performance.md, "Memory (issue 41)").
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .functional import position_ids_from_mask, unpack_mask

__all__ = [
    "CHUNK_BYTES",
    "MAX_TILE_ROWS",
    "HeadLogProbs",
    "cut_prompt_block",
    "final_hidden",
    "head_logprobs",
    "output_head",
    "policy_logprobs",
    "takes_logits_to_keep",
    "tile_shape",
    "unwrap",
]

CHUNK_BYTES = 32 * 2**20  # one tile's fp32 logits: 32 MiB (docs/performance.md, "Memory": how it was chosen)
MAX_TILE_ROWS = 4096  # rows of a tile: more policy tokens than this go in row blocks


def tile_shape(rows: int, vocab: int, budget: int | None = None) -> tuple[int, int]:
    """(rows, columns) of one fp32 logits tile within ``budget`` bytes (default: CHUNK_BYTES).

    Rows come first (up to :data:`MAX_TILE_ROWS`, so the weight's gradient is written once per slice of
    the vocabulary, not summed over many row chunks); the vocabulary is cut into slices of a multiple
    of 8 columns (the packed kept sets' bytes) that fill the budget.
    """
    budget = CHUNK_BYTES if budget is None else budget
    r = max(1, min(rows, MAX_TILE_ROWS))
    cols = max(8, budget // (4 * r) // 8 * 8)
    return r, min(cols, vocab)


def unwrap(model):
    """The model under its DDP / DataParallel wrapper (peft's wrapper is kept: its adapters are part of it)."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def takes_logits_to_keep(model) -> bool:
    """Whether ``model`` (or the model under its DDP and peft wrappers) can run its LM head on the last columns only."""
    base = unwrap(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature: the head runs everywhere
        return False


def output_head(model) -> tuple[Tensor, Tensor | None]:
    """The LM head's ``(V, H)`` weight and ``(V,)`` bias (or None) of a causal LM, under DDP and peft too.

    peft's ``all-linear`` leaves the output layer alone, so the head is a plain ``nn.Linear`` (with
    tied embeddings, the same parameter as the input embedding: gradients reach it either way).
    """
    head = unwrap(model).get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"model {type(unwrap(model)).__name__} has output layer {type(head).__name__}; "
                        "token log-probs need an nn.Linear LM head")  # fmt: skip
    return head.weight, head.bias


def cut_prompt_block(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> tuple[Tensor, Tensor, int]:
    """Drop the leading columns that are padding in every row: the batch's longest prompt sets the width.

    Why it is exact: a left-padded column is masked for every query and position ids come from the
    mask, so no kept column's output depends on it. Column ``prompt_len − 1`` (it predicts the first
    response token) always stays. Returns the cut ids, mask and the new prompt width.
    """
    real = attention_mask[:, :prompt_len].bool().any(0)  # (P,)
    first = int(real.to(torch.int8).argmax()) if bool(real.any()) else prompt_len - 1
    first = min(first, prompt_len - 1)
    return input_ids[:, first:], attention_mask[:, first:], prompt_len - first


def final_hidden(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The last layer's normed hidden states ``(B, L, H)`` of a causal LM: what its head reads.

    Through the model's own forward (DDP's, peft's): a wrapper's hooks and a disabled adapter apply as
    for a logits call. ``logits_to_keep=1`` keeps the forward's own head to one column; ``use_cache=False``: a
    teacher-forced pass needs no KV cache (it would hold every layer's keys and values past the call).
    """
    keep = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                output_hidden_states=True, use_cache=False, **keep)  # fmt: skip
    return out.hidden_states[-1]


def policy_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    select: Tensor | None = None,
    temperature: float = 1.0,
    kept: Tensor | None = None,
    with_entropy: bool = False,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Teacher-forced log π(y_t | s_t) of the selected response tokens, in one forward and a chunked head.

    Args:
        model: a causal LM (under DDP or peft too).
        input_ids, attention_mask: ``(B, L)`` in the env's layout: the prompt left-padded into the first
            ``prompt_len`` columns, response token t at column ``prompt_len + t``.
        prompt_len: the prompt block's width.
        select: ``(B, T)`` bool, T = L − prompt_len: the tokens whose log-prob is wanted (the policy's
            actions); None selects every response column.
        temperature: logits are divided by it, as when sampling.
        kept: ``(B, T, W)`` packed top-k/top-p sets the sampler drew each token from
            (:func:`textgym.functional.pack_mask`), or None.
        with_entropy: also return each selected token's entropy (no gradient).
        vocab_size: the action space's V when the head has more rows (padded embeddings).

    Returns:
        ``(B, T)`` log-probs and entropies (or None): 0 outside ``select``; the log-probs carry the
        gradient of the selected positions only.
    """
    B, L = input_ids.shape
    T = L - prompt_len
    tokens = input_ids[:, prompt_len:]  # (B, T)
    select = torch.ones_like(tokens, dtype=torch.bool) if select is None else select.bool()
    if select.shape != (B, T):
        raise ValueError(f"select has shape {tuple(select.shape)}; needs (B, T) = {(B, T)}")
    ids, mask, p = cut_prompt_block(input_ids, attention_mask, prompt_len)
    hidden = final_hidden(model, ids, mask)[:, p - 1 : -1]  # (B, T, H): column p − 1 + t predicts token t
    rows = select.nonzero(as_tuple=True)
    weight, bias = output_head(model)
    if vocab_size is not None:
        weight, bias = weight[:vocab_size], None if bias is None else bias[:vocab_size]
    logp, entropy = head_logprobs(hidden[rows], weight, tokens[rows], bias, temperature,
                                  None if kept is None else kept[rows], with_entropy)  # fmt: skip
    out = logp.new_zeros(B, T).index_put(rows, logp)
    ent = entropy.new_zeros(B, T).index_put(rows, entropy) if entropy is not None else None
    return out, ent


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    kept: Tensor | None = None,
    with_entropy: bool = False,
    tile: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log-softmax(hidden @ weightᵀ + bias)/τ at ``tokens``, one tile of logits at a time (:class:`HeadLogProbs`).

    Args:
        hidden: ``(n, H)``; weight: ``(V, H)``; tokens: ``(n,)``; bias: ``(V,)`` or None.
        kept: ``(n, ceil(V / 8))`` packed kept sets (entries outside are at the dtype's lowest value), or None.
        tile: (rows, columns) of a tile, columns a multiple of 8 or all V (default: :func:`tile_shape`).

    Returns:
        ``(n,)`` fp32 log-probs (differentiable in ``hidden``, ``weight`` and ``bias``) and ``(n,)``
        entropies (detached) or None.
    """
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and tokens "
                         f"{tuple(tokens.shape)} must be (n, H), (V, H) and (n,)")  # fmt: skip
    tile = tile or tile_shape(hidden.shape[0], weight.shape[0])
    if tile[0] < 1 or tile[1] < 1 or (tile[1] % 8 and tile[1] < weight.shape[0]):
        raise ValueError(f"tile={tile} must be (rows >= 1, columns a positive multiple of 8 or the whole "
                         f"vocabulary {weight.shape[0]})")  # fmt: skip
    entropy = hidden.new_empty(hidden.shape[0] if with_entropy else 0, dtype=_softmax_dtype(hidden.dtype))
    logp = HeadLogProbs.apply(hidden, weight, bias, tokens.long(), kept, float(temperature), tile, entropy)
    return logp, (entropy if with_entropy else None)


class HeadLogProbs(torch.autograd.Function):
    """Token log-probs through the LM head, tile by tile; the backward recomputes each tile's logits.

    A tile is a block of rows by a slice of the vocabulary. The forward runs an online log-sum-exp over
    a row block's slices (as flash attention does over keys) and keeps only each row's log-sum-exp;
    the backward forms d log p_a / d z = (onehot(a) − softmax(z))/τ a tile at a time: the hidden
    states' gradient is summed over slices (``(rows, H)``, small), the head's is written once per
    slice. Under autocast the matmuls run in the autocast dtype, as ``nn.Linear`` would; the softmax
    is fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, kept, temperature, tile, entropy):  # noqa: D102
        dtype = _matmul_dtype(hidden)
        acc = _softmax_dtype(dtype)
        n = hidden.shape[0]
        logp, lse = hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc)
        w = weight.to(dtype)  # cast once, as autocast caches it
        with torch.no_grad():
            for rows, cols in _tiles(n, weight.shape[0], tile):
                if cols.start == 0:
                    top = hidden.new_full((rows.stop - rows.start,), -torch.inf, dtype=acc)  # running max
                    total, weighted, picked = torch.zeros_like(top), torch.zeros_like(top), torch.zeros_like(top)
                z = _tile_logits(hidden[rows], w, bias, kept, rows, cols, temperature, dtype)  # (r, c)
                new_top = torch.maximum(top, z.max(-1).values)
                scale, e = torch.exp(top - new_top), torch.exp(z - new_top[:, None])
                total = total * scale + e.sum(-1)
                if entropy.numel():
                    weighted = weighted * scale + (e * z).sum(-1)  # Σ e^(z − max)·z, for the entropy
                top = new_top
                picked += _pick(z, tokens[rows], cols)
                if cols.stop == weight.shape[0]:  # the row block's last slice: its log-sum-exp is complete
                    lse[rows] = top + total.log()
                    logp[rows] = picked - lse[rows]
                    if entropy.numel():
                        entropy[rows] = lse[rows] - weighted / total
        ctx.save_for_backward(hidden, w, bias, tokens, kept, lse)  # w: the cast weight, as nn.Linear's autocast keeps
        ctx.temperature, ctx.tile, ctx.dtype, ctx.weight_dtype = temperature, tile, dtype, weight.dtype
        return logp

    @staticmethod
    def backward(ctx, grad_logp):  # noqa: D102
        hidden, w, bias, tokens, kept, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc, dtype = _softmax_dtype(ctx.dtype), ctx.dtype
        grad_h = torch.zeros_like(hidden, dtype=acc) if need_h else None
        grad_w = torch.empty_like(w, dtype=acc) if need_w else None  # each slice written by the first row block
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        for rows, cols in _tiles(hidden.shape[0], w.shape[0], ctx.tile):
            h = hidden[rows].to(dtype)
            z = _tile_logits(h, w, bias, kept, rows, cols, ctx.temperature, dtype)  # (r, c)
            scale = grad_logp[rows] / ctx.temperature  # (r,): d loss / d log p, through the temperature
            g = torch.exp(z.sub_(lse[rows, None])).mul_(-scale[:, None])  # −softmax·scale
            _pick_add(g, tokens[rows], cols, scale)  # (onehot(a) − softmax)·scale = d loss / d logits
            if need_b:
                grad_b[cols] += g.sum(0)
            g = g.to(dtype)
            if need_h:
                grad_h[rows] += g @ w[cols]  # (r, H)
            if need_w and rows.start == 0:
                grad_w[cols] = g.t() @ h  # (c, H)
            elif need_w:
                grad_w[cols] += g.t() @ h
        grad_h = grad_h.to(hidden.dtype) if grad_h is not None else None
        grad_w = grad_w.to(ctx.weight_dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _tiles(n: int, vocab: int, tile: tuple[int, int]):
    """(rows, cols) slices of the tiles, row block by row block, each block's vocabulary slices in order."""
    r, c = tile
    for start in range(0, n, r):
        for col in range(0, vocab, c):
            yield slice(start, min(start + r, n)), slice(col, min(col + c, vocab))


def _pick(z: Tensor, tokens: Tensor, cols: slice) -> Tensor:
    """Each row's logit at its token where the token falls in ``cols``, else 0: ``(r,)``."""
    inside = (tokens >= cols.start) & (tokens < cols.stop)
    at = (tokens - cols.start).clamp(0, z.shape[1] - 1)
    return torch.where(inside, z.gather(-1, at[:, None]).squeeze(-1), 0.0)


def _pick_add(g: Tensor, tokens: Tensor, cols: slice, value: Tensor) -> None:
    """Add ``value`` ``(r,)`` at each row's token where it falls in ``cols`` (in place)."""
    inside = (tokens >= cols.start) & (tokens < cols.stop)
    at = (tokens - cols.start).clamp(0, g.shape[1] - 1)
    g.scatter_add_(-1, at[:, None], (value * inside).to(g.dtype)[:, None])


def _matmul_dtype(hidden: Tensor) -> torch.dtype:
    """The head's matmul dtype: autocast's where it is on for this device (as ``nn.Linear`` runs), else the input's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the log-softmax whatever the matmul's precision (float64 stays float64: exact tests)."""
    return torch.promote_types(dtype, torch.float32)


def _tile_logits(hidden, weight, bias, kept, rows: slice, cols: slice, temperature: float, dtype) -> Tensor:
    """One tile's logits (fp32, or float64) ``(r, c)``, tempered and restricted to its kept sets."""
    with torch.autocast(hidden.device.type, enabled=False):
        z = hidden.to(dtype) @ weight[cols].t()
        if bias is not None:
            z = z + bias[cols].to(dtype)
        z = z.to(_softmax_dtype(dtype))
        if temperature != 1.0:
            z /= temperature
    if kept is not None:  # cols.start is a multiple of 8: the slice's bits start a byte
        packed = kept[rows, cols.start // 8 : (cols.stop + 7) // 8]
        z = z.masked_fill(~unpack_mask(packed, z.shape[-1]), torch.finfo(z.dtype).min)
    return z
