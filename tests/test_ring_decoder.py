"""The ring decoder: the dynamic cache's logits at fixed shapes, a failed step undone, the choice of decoder."""

import copy

import numpy as np
import pytest
import torch

from textgym.models import CachedDecoder, load_causal_lm
from textgym.policies import LMSampler
from textgym.ring_decoder import RingDecoder, make_decoder, resolve_decoder

N, P, L = 4, 6, 20  # slots, prompt block, max_len


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(None)  # the embedded 4-layer Llama, sdpa


def _prompts(vocab: int, k: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (k, width), generator=g)
    mask = torch.ones_like(ids)
    mask[0, : width // 2] = 0  # a left-padded row
    return ids, mask


def _schedule(model, decoders, seed=0, steps=40):
    """Drive every decoder through the same prefills (restarts, longer re-read contexts) and steps.

    Yields, per step, each decoder's logits of the slots that are live (context within max_len).
    """
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids, mask = _prompts(vocab, N, P, seed)
    for d in decoders:
        d.prefill(torch.arange(N), ids, mask)
    length = mask.sum(1).clone()  # (N,) tokens in each slot's context
    for t in range(steps):
        if t % 2:  # a slot restarts on a context of another width (a prompt, or a conversation re-read)
            slot = torch.tensor([t // 2 % N])
            width = 3 + t % 9
            new_ids, new_mask = _prompts(vocab, 1, width, seed + t)
            new_mask[:] = 1
            outs = [d.prefill(slot, new_ids, new_mask) for d in decoders]
            yield slot, outs
            length[slot] = width
        tokens = torch.randint(5, vocab, (N,), generator=g)
        outs = [d.step(tokens) for d in decoders]
        length += 1
        live = torch.nonzero(length <= L).flatten()
        yield live, [o[live] for o in outs]


def test_ring_logits_equal_the_dynamic_cache(model):
    for live, (dyn, ring) in _schedule(model, [CachedDecoder(model, N, L), RingDecoder(model, N, L)]):
        assert live.numel() > 0
        torch.testing.assert_close(ring, dyn, atol=2e-5, rtol=0)


def test_ring_logits_equal_an_uncached_forward(model):
    ring = RingDecoder(model, 1, L)
    ids, mask = _prompts(model.config.vocab_size, 1, P, seed=3)
    mask[:] = 1
    ring.prefill(torch.tensor([0]), ids, mask)
    seq = ids
    for t in range(L - P):
        token = torch.tensor([5 + 7 * t])
        logits = ring.step(token)
        seq = torch.cat([seq, token.view(1, 1)], dim=1)
        with torch.no_grad():
            full = model(input_ids=seq).logits[:, -1]
        torch.testing.assert_close(logits, full, atol=2e-5, rtol=0)


def test_eager_attention_reads_the_additive_mask(model):
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    for _live, (dyn, ring) in _schedule(eager, [CachedDecoder(eager, N, L), RingDecoder(eager, N, L)], steps=12):
        torch.testing.assert_close(ring, dyn, atol=2e-5, rtol=0)


def test_the_ring_keeps_its_tensors(model):
    """Fixed addresses and shapes through prefills, steps and resets: what a CUDA graph replays over."""
    ring = RingDecoder(model, N, L)
    ids, mask = _prompts(model.config.vocab_size, N, P, 0)
    ring.prefill(torch.arange(N), ids, mask)
    before = [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.keys.shape) for layer in ring.layers]
    for t in range(3 * L):
        ring.step(torch.full((N,), 5 + t))
    ring.reset()
    ring.prefill(torch.tensor([1]), ids[:1], mask[:1])
    assert [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.keys.shape) for layer in ring.layers] == before
    assert before[0][2] == (N, model.config.num_key_value_heads, L + 1, model.config.head_dim)


def test_a_failed_step_leaves_every_context_as_it_was(model, monkeypatch):
    ids, mask = _prompts(model.config.vocab_size, N, P, 1)
    ring, clean = RingDecoder(model, N, L), RingDecoder(model, N, L)
    for d in (ring, clean):
        d.prefill(torch.arange(N), ids, mask)
        d.step(torch.full((N,), 9))
    calls = {"n": 0}
    forward = type(model).forward

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", failing)
    with pytest.raises(KeyboardInterrupt):
        ring.step(torch.full((N,), 11))
    monkeypatch.setattr(type(model), "forward", forward)
    assert not ring.valid[:, ring.head].any()  # the half-written column is in no context
    for t in range(5):
        tokens = torch.full((N,), 20 + t)
        torch.testing.assert_close(ring.step(tokens), clean.step(tokens), atol=1e-6, rtol=0)


def test_step_before_prefill_and_contexts_too_long_are_refused(model):
    ring = RingDecoder(model, N, L)
    with pytest.raises(RuntimeError, match="before any prefill"):
        ring.step(torch.zeros(N, dtype=torch.long))
    ids, mask = _prompts(model.config.vocab_size, 1, L + 1, 0)
    with pytest.raises(ValueError, match=f"does not fit max_len={L}"):
        ring.prefill(torch.tensor([0]), ids, mask)


def test_decoder_choice_and_its_errors(model):
    cpu = torch.device("cpu")
    assert resolve_decoder("auto", cpu) == "ring"
    assert resolve_decoder("auto", torch.device("cuda")) == "ring"  # graph by name until checked on a GPU
    assert isinstance(make_decoder("dynamic", model, N, L), CachedDecoder)
    assert isinstance(make_decoder("auto", model, N, L), RingDecoder)
    with pytest.raises(ValueError, match=r"decoder='static' must be one of \('auto', 'dynamic', 'ring', 'graph'\)"):
        resolve_decoder("static", cpu)
    with pytest.raises(ValueError, match="decoder='graph' captures CUDA graphs; the model is on cpu"):
        make_decoder("graph", model, N, L)
    flex = copy.deepcopy(model)
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' .*use decoder='dynamic'"):
        RingDecoder(flex, N, L)


def test_the_sampler_draws_the_same_tokens_with_either_cache(vec):
    """One seeded episode batch on the native vector env: the same actions, log-probs within float noise."""
    runs = []
    for decoder in ("dynamic", "ring"):
        sampler = LMSampler.for_env(vec.unwrapped.model, vec, seed=0, decoder=decoder)
        obs, _ = vec.reset(seed=0)
        actions, logps = [], []
        for _ in range(12):
            action, logp = sampler.act(obs)
            obs, *_ = vec.step(action.numpy())
            actions.append(action.numpy())
            logps.append(logp.numpy())
        runs.append((np.stack(actions), np.stack(logps)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_allclose(runs[0][1], runs[1][1], atol=1e-5)


def test_release_frees_the_ring_and_the_next_prefill_allocates_it_again(model):
    ring = RingDecoder(model, N, L)
    ids, mask = _prompts(model.config.vocab_size, N, P, 0)
    first = ring.prefill(torch.arange(N), ids, mask)
    ring.step(torch.full((N,), 7))
    ring.release()
    assert not ring.started and ring.cache is None and all(layer.keys is None for layer in ring.layers)
    torch.testing.assert_close(ring.prefill(torch.arange(N), ids, mask), first, atol=0, rtol=0)
    assert ring.layers[0].keys.shape[2] == L + 1
