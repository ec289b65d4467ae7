"""Re-tokenisation drift: the tokens a turn-level trainer trains on, against the ids the policy sampled.

Why this module: a turn-level stack (TRL, verifiers, SkyRL's text mode) keeps a rollout as chat
*messages*. To train, it decodes each sampled turn to text, applies the chat template to the whole
conversation and tokenises it again. Text → tokens is not the inverse of tokens → text: a model may
sample a split the tokenizer never writes (``"[" "5"`` where the tokenizer writes ``"[5"``), a turn cut
at ``max_turn_tokens`` gets the template's end-of-turn token it never sampled, special tokens vanish in
decoding, a split multi-byte character decodes to U+FFFD. The trainer then computes log π of tokens
(and contexts) the sampler never produced. textgym's envs keep the sampled ids, so this drift is
zero by construction; these pure helpers measure it on a conversation (``bench/drift.py``):

1. :func:`episode_messages` rebuilds the chat messages from an episode's exact ids, as the env wrote them;
2. :func:`retokenize` renders and tokenises them as a turn-level trainer does, and locates each assistant
   turn's tokens in the result;
3. :func:`drift_causes` says whether a turn's re-tokenised ids differ from the sampled ones, and why;
4. :func:`common_ends` aligns the two id sequences of a turn token by token where they agree;
5. :func:`ratio_stats` summarises the PPO ratio exp(Δ log π) the drift would cause.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CAUSES",
    "RetokenizedTurn",
    "common_ends",
    "drift_causes",
    "episode_messages",
    "policy_turns",
    "ratio_stats",
    "retokenize",
    "teacher_forced_logprobs",
    "turn_text",
]

# Why a re-tokenised turn differs from the sampled ids; a turn may have several causes.
CAUSES = {
    "no_end_token": "the turn was cut at max_turn_tokens: the template closes it with an end token never sampled",
    "other_stop_token": "the turn ended on a stop id that is not the template's end-of-turn token",
    "special_token_dropped": "a special token sampled inside the turn is lost when the turn is decoded to text",
    "invalid_utf8": "the sampled bytes are not valid UTF-8: decoding writes U+FFFD, which re-encodes otherwise",
    "non_canonical_split": "the tokenizer splits the turn's text otherwise than the model sampled it",
    "boundary_merge": "a token of the re-tokenised turn crosses the turn's edge (merged with the template's text)",
    "template_changed_text": "the chat template rewrote the turn's text (trimmed whitespace, ...)",
    "other": "the ids differ for none of the reasons above",
}


def policy_turns(mask: Sequence[bool] | np.ndarray) -> list[tuple[int, int]]:
    """The policy's turns in a response block: ``(start, end)`` column spans of the runs of True in ``mask`` ``(T,)``.

    Why runs: in a conversation the partner's reply (never empty with a chat template: it carries the
    template's own tokens) makes a hole in the policy mask between two turns.
    """
    m = np.asarray(mask, dtype=bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[False], m, [False]]).astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def turn_text(tokenizer, ids: Sequence[int], stop_ids: set[int]) -> str:
    """A turn's text as the env hands it to the partner (``Encoding.text``): stop and special tokens left out."""
    return tokenizer.decode([t for t in ids if t not in stop_ids], skip_special_tokens=True)


def episode_messages(tokenizer, template, prompt: str, response_ids: Sequence[int], mask: Sequence[bool],
                     stop_ids: set[int]) -> list[dict[str, str]]:  # fmt: skip
    """The chat messages of one episode, rebuilt from its exact response ids: what a turn-level stack would store.

    Each policy turn is decoded as the env decodes it; each partner reply is the text between the reply
    template's pieces (:class:`textgym.envs.turns.ReplyTemplate`, which tokenised pieces and text apart, so
    they split off exactly). ``response_ids`` ``(T,)`` and ``mask`` ``(T,)`` are the episode's used columns.
    """
    ids = [int(t) for t in response_ids]
    turns = policy_turns(mask)
    after = len(tokenizer(template.after, add_special_tokens=False)["input_ids"]) if template.after else 0
    messages = [{"role": "user", "content": prompt}]
    for k, (a, b) in enumerate(turns):
        messages.append({"role": "assistant", "content": turn_text(tokenizer, ids[a:b], stop_ids)})
        reply_end = turns[k + 1][0] if k + 1 < len(turns) else None
        if reply_end is None:
            break
        before = len(template.ids("", ids[b - 1])) - after  # the closing pieces' tokens, as the env wrote them
        messages.append({"role": "user", "content": tokenizer.decode(ids[b + before : reply_end - after])})
    return messages


@dataclasses.dataclass(frozen=True)
class RetokenizedTurn:
    """Where one assistant turn lies in the re-tokenised conversation: ids ``[start, end)``."""

    start: int
    end: int  # past the template's end-of-turn token when it follows the text (trainers train on it)
    crosses_boundary: bool  # a token covers text on both sides of the turn's edge
    text_changed: bool  # the rendered template does not hold the turn's text verbatim


def retokenize(tokenizer, messages: list[dict[str, str]], end_id: int) -> tuple[list[int], list[RetokenizedTurn]]:
    """The conversation as a turn-level trainer tokenises it, and where each assistant turn lies in it.

    The ids are ``apply_chat_template(messages, tokenize=True)`` (checked). A turn's tokens are those
    whose characters overlap its text in the rendered template, plus ``end_id`` when the template writes
    it right after (TRL's assistant masks and verifiers' incremental masks include the end-of-turn token).
    The text's place comes from rendering the messages before it with the generation prompt: the template
    is then a prefix of the full rendering (true of ChatML; checked, with an error otherwise).
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    if ids != list(expected):
        raise ValueError("tokenising the rendered chat template differs from apply_chat_template(tokenize=True)")
    turns = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        if not text.startswith(head):
            raise ValueError(f"the chat template is not prefix-stable at message {k}: turns cannot be located")
        lo, hi = len(head), len(head) + len(m["content"])
        inside = [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]
        first = inside[0] if inside else next(i for i, (a, _) in enumerate(offsets) if a >= lo)
        last = inside[-1] + 1 if inside else first
        crosses = bool(inside) and (offsets[first][0] < lo or offsets[last - 1][1] > hi)
        end = last + 1 if last < len(ids) and ids[last] == end_id else last
        turns.append(RetokenizedTurn(first, end, crosses, text[lo:hi] != m["content"]))
    return ids, turns


def drift_causes(tokenizer, sampled: Sequence[int], retokenized: Sequence[int], *, stop_ids: set[int], end_id: int,
                 crosses_boundary: bool = False, text_changed: bool = False) -> tuple[str, ...]:  # fmt: skip
    """Why a turn's ``retokenized`` ids differ from its ``sampled`` ids (keys of :data:`CAUSES`); () when equal.

    The end token and the body (the turn without it) are judged apart: a turn cut at ``max_turn_tokens``
    whose body re-tokenises exactly has the one cause ``no_end_token``.
    """
    s, r = [int(t) for t in sampled], [int(t) for t in retokenized]
    if s == r:
        return ()
    stopped = bool(s) and s[-1] in stop_ids
    s_body, r_body = (s[:-1] if stopped else s), (r[:-1] if r and r[-1] == end_id else r)
    causes = []
    if not stopped:
        causes.append("no_end_token")
    elif s[-1] != end_id:
        causes.append("other_stop_token")
    if s_body != r_body:
        causes.extend(_body_causes(tokenizer, s_body, r_body, crosses_boundary, text_changed))
    return tuple(causes) or ("other",)


def _body_causes(tokenizer, s_body: list[int], r_body: list[int], crosses: bool, text_changed: bool) -> list[str]:
    """The causes of a differing turn body, in the order they act: decoding, the tokenizer, the template."""
    special = set(tokenizer.all_special_ids)
    causes = ["special_token_dropped"] if any(t in special for t in s_body) else []
    plain = [t for t in s_body if t not in special]
    text = tokenizer.decode(plain)
    if "\ufffd" in text:
        causes.append("invalid_utf8")
    elif tokenizer(text, add_special_tokens=False)["input_ids"] != plain:
        causes.append("non_canonical_split")
    if crosses:
        causes.append("boundary_merge")
    if text_changed:
        causes.append("template_changed_text")
    return causes or ["other"]


def common_ends(a: Sequence[int], b: Sequence[int]) -> tuple[int, int]:
    """Lengths ``(p, q)`` of the longest common prefix and then suffix of ``a`` and ``b`` (never overlapping).

    Why both ends: a turn whose middle re-tokenised otherwise still has tokens before and after the change
    that name the same text; those are compared token by token, the rest by the turn's sum.
    """
    n = min(len(a), len(b))
    p = next((i for i in range(n) if a[i] != b[i]), n)
    q = next((i for i in range(n - p) if a[len(a) - 1 - i] != b[len(b) - 1 - i]), n - p)
    return p, q


def ratio_stats(delta: Tensor, clip: float = 0.2) -> dict[str, float]:
    """The PPO ratio exp(``delta``) of log-prob differences ``delta`` ``(n,)`` (log π_θ − log π_old), summarised.

    Returns the mean |Δ|, max |Δ|, mean |ratio − 1|, the share of ratios outside ``[1 − clip, 1 + clip]``
    (the tokens whose gradient PPO's clip would cut at the first step), and the min and max ratio.
    """
    if delta.ndim != 1 or not delta.numel():
        raise ValueError(f"delta has shape {tuple(delta.shape)}; give a non-empty 1-D tensor of log-prob differences")
    d = delta.double()
    ratio = d.exp()
    return {"abs_delta_mean": d.abs().mean().item(), "abs_delta_max": d.abs().max().item(),
            "abs_ratio_minus_1_mean": (ratio - 1).abs().mean().item(),
            "outside_clip_share": ((ratio < 1 - clip) | (ratio > 1 + clip)).double().mean().item(),
            "ratio_min": ratio.min().item(), "ratio_max": ratio.max().item(), "tokens": int(d.numel())}  # fmt: skip


@torch.no_grad()
def teacher_forced_logprobs(model, ids: Sequence[int]) -> Tensor:
    """fp32 teacher-forced log π(ids[t] | ids[:t]) for t ≥ 1, ``(len(ids) − 1,)``; one forward, no cache.

    fp32 on purpose: the drift is measured against the numerical noise of two forwards, which bf16 would
    raise to the size of the effect.
    """
    x = torch.as_tensor([list(ids)], dtype=torch.long)
    logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()  # (L-1, V)
    return logits.log_softmax(-1).gather(-1, x[0, 1:, None]).squeeze(-1)
