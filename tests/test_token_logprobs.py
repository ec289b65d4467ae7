"""The policy's token log-probs through a chunked LM head: exact against the full log-softmax, bounded in memory."""

import copy
import math
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from textgym.agents.ppo.advantages import sequence_batch
from textgym.agents.ppo.models import TokenLogProbs
from textgym.functional import pack_mask, position_ids_from_mask
from textgym.models import load_causal_lm
from textgym.token_logprobs import (
    CHUNK_BYTES,
    MAX_TILE_ROWS,
    cut_prompt_block,
    head_logprobs,
    policy_logprobs,
    tile_shape,
)

P, T = 8, 12  # prompt block, response columns


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(None)  # the embedded 4-layer Llama, V = 2048


def _batch(vocab: int, seed: int = 0):
    """Three rows, left-padded prompts of 3, 6 and 8 tokens; a policy mask with a partner's reply in row 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, P + T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5], mask[1, :2] = 0, 0
    select = torch.ones(3, T, dtype=torch.bool)
    select[1, 3:7] = False  # a partner's reply: observation, no log-prob
    select[2, 9:] = False  # past the response's end
    return ids, mask, select


def _full_logprobs(model, ids, mask, temperature=1.0, keep=None):
    """What the learner computed before: every column's logits, the log-softmax over V, the token's entry."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logits = logits[:, P - 1 : -1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # (B, T, V)
    if keep is not None:
        logits = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)


def test_head_logprobs_gradient_is_exact_on_a_small_case():
    """Forward and the hand-written backward against autograd's numerical Jacobian (float64), over row blocks and
    vocabulary slices (the online log-sum-exp across slices, the head's gradient summed across row blocks)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 7, 5, 11
    hidden = torch.randn(n, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, generator=g, requires_grad=True)
    tokens = torch.randint(0, v, (n,), generator=g)
    keep = torch.rand(n, v, generator=g) > 0.4
    keep[torch.arange(n), tokens] = True  # the sampled token is always in its kept set
    kept = pack_mask(keep)

    def f(hid, w, b):
        return head_logprobs(hid, w, tokens, b, temperature=0.7, kept=kept, tile=(3, 8))[0]  # 3 x 2 tiles

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))
    logp, entropy = head_logprobs(hidden, weight, tokens, bias, 0.7, kept, with_entropy=True, tile=(3, 8))
    full = torch.log_softmax(((hidden @ weight.T + bias) / 0.7).masked_fill(~keep, -torch.inf), -1)
    torch.testing.assert_close(logp, full[torch.arange(n), tokens], atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, -(full.exp() * full.nan_to_num(neginf=0.0)).sum(-1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("truncated", [False, True])
def test_policy_logprobs_equal_the_full_log_softmax_in_fp32(model, temperature, truncated):
    """Per-token log-probs equal the full-vocabulary log-softmax's (issue 41): the prompt block is cut to the
    longest prompt, the head runs on the selected positions only, in chunks."""
    V = model.config.vocab_size
    ids, mask, select = _batch(V)
    keep = None
    if truncated:
        keep = torch.rand(3, T, V, generator=torch.Generator().manual_seed(1)) > 0.5
        keep.scatter_(-1, ids[:, P:, None], True)
    with torch.no_grad():
        expected = _full_logprobs(model, ids, mask, temperature, keep)
        logp, entropy = policy_logprobs(model, ids, mask, P, select, temperature,
                                        None if keep is None else pack_mask(keep), with_entropy=True)  # fmt: skip
    # 1e-6, or 2 float32 ulps where |log p| > 4 (one ulp is 1.9e-6 at 17): the head's sums run in another order
    torch.testing.assert_close(logp[select], expected[select], atol=1e-6, rtol=2.4e-7)
    assert torch.all(logp[~select] == 0) and torch.all(entropy[~select] == 0)
    assert torch.all(entropy[select] > 0)


def test_policy_logprob_gradients_equal_the_full_log_softmax_ones():
    """d/dθ of Σ w_t log π(a_t|s_t) over the selected tokens: the chunked head's equals the full one's (float64)."""
    model = load_causal_lm(None).double().requires_grad_(True)
    twin = copy.deepcopy(model)
    V = model.config.vocab_size
    ids, mask, select = _batch(V, seed=2)
    w = torch.randn(3, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * select
    logp, _ = policy_logprobs(model, ids, mask, P, select, temperature=0.8)
    (logp * w).sum().backward()
    (_full_logprobs(twin, ids, mask, 0.8) * w).sum().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-8, msg=name)


def test_cut_prompt_block_keeps_the_longest_prompt_and_the_last_prompt_column():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    ids = torch.arange(12).view(2, 6)
    cut_ids, cut_mask, p = cut_prompt_block(ids, mask, prompt_len=4)
    assert p == 2 and torch.equal(cut_ids, ids[:, 2:]) and torch.equal(cut_mask, mask[:, 2:])
    empty = torch.tensor([[0, 0, 0, 0, 1, 1]])  # no prompt at all: column prompt_len - 1 predicts token 0
    assert cut_prompt_block(empty, empty, prompt_len=4)[2] == 1


class _LargestVocabTensor(TorchDispatchMode):
    """The most elements of any tensor with a vocabulary-sized dimension an operator returned while active
    (forward and backward), the head's own (V, H) weight and its gradient aside."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.weight_shape, self.largest = vocab, {(vocab, hidden), (hidden, vocab)}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and self.vocab in t.shape and tuple(t.shape) not in self.weight_shape:
                self.largest = max(self.largest, t.numel())
        return out


def test_the_update_never_forms_a_batch_by_columns_by_vocabulary_tensor(model, monkeypatch):
    """Forward and backward of the learner's log-probs: no (B, T, V) tensor, the largest one a chunk of the head.

    Before, the learner took the log-softmax of (B, T, V) logits and kept it for the backward (13.8 GB for a
    SmolLM2 conversation run, issue 41).
    """
    policy = copy.deepcopy(model).requires_grad_(True)
    V = policy.config.vocab_size
    B, width = 16, 40
    ids = torch.randint(5, V, (B, P + width), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    select = torch.zeros(B, width, dtype=torch.bool)
    select[:, :3] = True  # 3 policy tokens a row: 48 rows for the head
    head = TokenLogProbs(policy, P)
    seq, seq_mask = ids.unsqueeze(1).expand(B, width, -1), mask.unsqueeze(1).expand(B, width, -1)
    budget = 16 * 4 * V  # 16 rows' worth of logits: tiles of 48 rows x 680 columns
    monkeypatch.setattr("textgym.token_logprobs.CHUNK_BYTES", budget)
    with _LargestVocabTensor(V, policy.config.hidden_size) as spy:
        logp, _, _ = head(seq, seq_mask, select)
        logp.sum().backward()
    assert 0 < spy.largest <= budget // 4, spy.largest  # a tile of the head; the full logits: B·T·V = 1.3M elements


def test_tiles_are_sized_in_bytes_so_they_do_not_grow_with_the_vocabulary():
    for rows in (1, 40, 640, 10_000):
        for vocab in (2048, 49_152, 151_936):
            r, c = tile_shape(rows, vocab)
            assert r == min(rows, MAX_TILE_ROWS) and c % 8 == 0 and (r * c * 4 <= CHUNK_BYTES or c == 8)
            assert c == vocab or r * (c + 8) * 4 > CHUNK_BYTES  # the budget filled
    with pytest.raises(ValueError, match="tile=.* multiple of 8 or the whole vocabulary 16"):
        head_logprobs(torch.zeros(2, 3), torch.zeros(16, 3), torch.zeros(2, dtype=torch.long), tile=(2, 12))
    assert tile_shape(12, 15) == (12, 15)  # a vocabulary smaller than a slice is one slice of any width
    logp, _ = head_logprobs(torch.zeros(2, 3), torch.zeros(15, 3), torch.zeros(2, dtype=torch.long), tile=(2, 15))
    torch.testing.assert_close(logp, torch.full((2,), -math.log(15)))


# ---------------------------------------------------------------- gradient checkpointing of the update
def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_gradient_checkpointing_gives_the_same_update_and_saves_less(tmp_path, lora_rank):
    """Two trainers on one seed, one recomputing its decoder layers in the backward: the same weights after an
    iteration (policy and critic), far fewer bytes held across the backward, and no module left in training mode
    but the layers (no dropout turned on)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from textgym.agents.ppo import PPOConfig, Trainer
    from textgym.agents.ppo.config import PRESETS

    trainers, saved = [], []
    for ckpt in (False, True):
        cfg = {**PRESETS["tiny"], "out": str(tmp_path / str(ckpt)), "precision": "fp32", "max_new_tokens": 16,
               "num_envs": 8, "ppo_epochs": 1, "num_minibatches": 1, "gradient_checkpointing": ckpt,
               "lora_rank": lora_rank}  # fmt: skip
        t = Trainer.create(PPOConfig(**cfg))
        t.iteration()
        trainers.append(t)
        data = sequence_batch(t.last_episodes)
        saved.append(_saved_bytes(partial(t.actor_logprobs, data["sequence"], data["sequence_mask"], data["mask"])))
    for a, b in zip(trainers[0].trained().values(), trainers[1].trained().values()):
        torch.testing.assert_close(torch.cat([p.flatten() for p in a.parameters()]),
                                   torch.cat([p.flatten() for p in b.parameters()]), atol=1e-6, rtol=1e-5)  # fmt: skip
    assert saved[1] < saved[0] / 2, saved
    for model in trainers[1].trained().values():
        training = {type(m).__name__ for m in model.modules() if m.training}
        assert training and all(issubclass(type(m), GradientCheckpointingLayer) for m in model.modules() if m.training)
