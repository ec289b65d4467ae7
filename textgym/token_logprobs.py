"""Log-probs of the tokens that are policy actions, without a (B, T, V) tensor: the LM head in chunks.

Why: the learner and the scorers need log π(a_t | s_t) of the policy's own tokens only, yet a
full-vocabulary log-softmax over every column of a sequence costs B × T × V floats, several times
over once autograd keeps them for the backward (SmolLM2: V = 49,152, a conversation 250–400
columns for 20–38 policy tokens; issue 41 measured 13.8 GB for a 135M model). Here

1. the model's body runs once over the sequence (attention needs every column) and returns its
   final hidden states ``(B, L, H)``; the prompt block's columns that are padding in every row
   are cut first (:func:`cut_prompt_block`);
2. the hidden states of the *selected* positions, those whose next token is a policy action, are
   gathered into ``(n, H)``: the prompt, padding and a partner's reply never meet the LM head;
3. :class:`HeadLogProbs` runs the head and the log-softmax over V in chunks of rows, keeping only
   each row's log-sum-exp for the backward, which recomputes a chunk's logits to form its gradient
   (the idea of Liger's fused linear cross-entropy and Apple's cut-cross-entropy; TRL's
   ``selective_log_softmax`` and verl's chunked logsumexp slice the same way).

The working set is one chunk of logits at a time, ``chunk_rows(V)`` rows of V floats (a few
of them alive at once); the chunk is sized in bytes, so it does not grow with V
(docs/performance.md, "Memory").
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .functional import position_ids_from_mask, unpack_mask

__all__ = [
    "CHUNK_BYTES",
    "HeadLogProbs",
    "chunk_rows",
    "cut_prompt_block",
    "final_hidden",
    "head_logprobs",
    "output_head",
    "policy_logprobs",
    "unwrap",
]

CHUNK_BYTES = 32 * 2**20  # one chunk's fp32 logits: 32 MiB (170 rows at V = 49,152; docs/performance.md, "Memory")


def chunk_rows(vocab: int, budget: int | None = None) -> int:
    """Rows of a (rows, ``vocab``) fp32 logits chunk within ``budget`` bytes (default: CHUNK_BYTES), at least 1."""
    return max(1, (CHUNK_BYTES if budget is None else budget) // (4 * vocab))


def unwrap(model):
    """The model under its DDP / DataParallel wrapper (peft's wrapper is kept: its adapters are part of it)."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


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
    for a logits call. ``logits_to_keep=1`` keeps the forward's own head to one column.
    """
    base = unwrap(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    try:
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
    except (TypeError, ValueError):
        keep = {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                output_hidden_states=True, **keep)  # fmt: skip
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
    chunk: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log-softmax(hidden @ weightᵀ + bias)/τ at ``tokens``, in chunks of rows (see :class:`HeadLogProbs`).

    Args:
        hidden: ``(n, H)``; weight: ``(V, H)``; tokens: ``(n,)``; bias: ``(V,)`` or None.
        kept: ``(n, W)`` packed kept sets (entries outside are at the dtype's lowest value), or None.
        chunk: rows per chunk (default :func:`chunk_rows` of V).

    Returns:
        ``(n,)`` fp32 log-probs (differentiable in ``hidden``, ``weight`` and ``bias``) and ``(n,)``
        entropies (detached) or None.
    """
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and tokens "
                         f"{tuple(tokens.shape)} must be (n, H), (V, H) and (n,)")  # fmt: skip
    chunk = chunk or chunk_rows(weight.shape[0])
    entropy = hidden.new_empty(hidden.shape[0] if with_entropy else 0, dtype=_softmax_dtype(hidden.dtype))
    logp = HeadLogProbs.apply(hidden, weight, bias, tokens, kept, float(temperature), chunk, entropy)
    return logp, (entropy if with_entropy else None)


class HeadLogProbs(torch.autograd.Function):
    """Token log-probs through the LM head, chunk by chunk; the backward recomputes each chunk's logits.

    Forward keeps, per row, only the log-sum-exp; backward forms d log p_a / d z = (onehot(a) − softmax(z))/τ
    a chunk at a time and multiplies it into the hidden states' and the head's gradients. Under autocast
    the head's matmul runs in the autocast dtype, as ``nn.Linear`` would; the softmax is fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, kept, temperature, chunk, entropy):  # noqa: D102
        dtype = _matmul_dtype(hidden)
        logp = torch.empty(hidden.shape[0], device=hidden.device, dtype=_softmax_dtype(dtype))
        lse = torch.empty_like(logp)
        w = weight.to(dtype)  # cast once, as autocast caches it
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                z = _chunk_logits(hidden[rows], w, bias, kept, rows, temperature, dtype)  # (c, V) fp32
                lse[rows] = torch.logsumexp(z, dim=-1)
                logp[rows] = z.gather(-1, tokens[rows, None]).squeeze(-1) - lse[rows]
                if entropy.numel():
                    p = torch.exp(z - lse[rows, None])
                    entropy[rows] = lse[rows] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, tokens, kept, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        return logp

    @staticmethod
    def backward(ctx, grad_logp):  # noqa: D102
        hidden, weight, bias, tokens, kept, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = _softmax_dtype(ctx.dtype)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        w = weight.to(ctx.dtype)  # cast once, as autocast caches it
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            z = _chunk_logits(hidden[rows], w, bias, kept, rows, ctx.temperature, ctx.dtype)  # (c, V)
            g = torch.exp(z - lse[rows, None]).neg_()  # −softmax
            g.scatter_add_(-1, tokens[rows, None], torch.ones_like(g[:, :1]))  # onehot(a) − softmax
            g.mul_((grad_logp[rows] / ctx.temperature).unsqueeze(-1))  # (c, V): d loss / d logits
            if need_b:
                grad_b += g.sum(0)
            g = g.to(ctx.dtype)
            if need_h:
                grad_h[rows] = (g @ w).to(hidden.dtype)  # (c, H)
            if need_w:
                grad_w += (g.t() @ hidden[rows].to(ctx.dtype)).to(acc)  # (V, H)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _matmul_dtype(hidden: Tensor) -> torch.dtype:
    """The head's matmul dtype: autocast's where it is on for this device (as ``nn.Linear`` runs), else the input's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the log-softmax whatever the matmul's precision (float64 stays float64: exact tests)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden, weight, bias, kept, rows: slice, temperature: float, dtype) -> Tensor:
    """One chunk's logits (fp32, or float64) ``(c, V)``, tempered and restricted to its kept sets."""
    with torch.autocast(hidden.device.type, enabled=False):
        z = hidden.to(dtype) @ weight.to(dtype).t()
        if bias is not None:
            z = z + bias.to(dtype)
        z = z.to(_softmax_dtype(dtype)) / temperature
    if kept is not None:
        z = z.masked_fill(~unpack_mask(kept[rows], z.shape[-1]), torch.finfo(z.dtype).min)
    return z
