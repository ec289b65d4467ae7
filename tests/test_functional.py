"""The KL estimators' expected gradients, exactly, on a 6-way categorical (no sampling: sums over actions).

What a reward or a loss term built on each estimator does to the policy, against autograd of
the exact KL: only k1 belongs in a reward; k2/k3 in a loss give the forward/reverse KL gradient.
And the sampler's categorical draw: each index with its probability, never one of probability 0.
"""

import pytest
import torch

from textgym.functional import _invert_cdf, kl_penalty, sample_categorical

THETA = torch.tensor([0.3, -1.2, 0.8, 0.0, 2.0, -0.5], dtype=torch.float64)  # policy logits
REF = torch.log_softmax(torch.tensor([1.0, 0.2, -0.7, 0.4, 0.1, -1.5], dtype=torch.float64), -1)  # log π_ref


def _exact_grad(kind: str) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    kl = (logp.exp() * (logp - REF)).sum() if kind == "forward" else (REF.exp() * (REF - logp)).sum()
    (grad,) = torch.autograd.grad(kl, theta)
    return grad


def _grad_as_reward(estimator: str) -> torch.Tensor:
    """E_{a~π}[∇log π(a) · k(a)]: the expected policy gradient of a reward −k, negated (so it targets ∇KL)."""
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    k = kl_penalty(logp, REF, estimator).detach()  # a reward is a constant to the gradient
    (grad,) = torch.autograd.grad((logp.exp().detach() * logp * k).sum(), theta)
    return grad


def _grad_as_loss(estimator: str) -> torch.Tensor:
    """E_{a~π_old}[∇k(log π_θ(a))] at θ = θ_old: samples held fixed, the gradient flows through log π_θ."""
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    (grad,) = torch.autograd.grad((logp.exp().detach() * kl_penalty(logp, REF, estimator)).sum(), theta)
    return grad


def test_k1_as_a_reward_has_exactly_the_kl_gradient():
    torch.testing.assert_close(_grad_as_reward("k1"), _exact_grad("forward"), atol=1e-12, rtol=0)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_k2_and_k3_as_rewards_do_not(estimator):
    got, exact = _grad_as_reward(estimator), _exact_grad("forward")
    cosine = torch.nn.functional.cosine_similarity(got, exact, dim=0)
    assert (got - exact).norm() > 0.1 * exact.norm(), (estimator, got, exact)
    assert cosine < 0.95, cosine  # not even the right direction


def test_k2_in_the_loss_has_the_forward_kl_gradient():
    torch.testing.assert_close(_grad_as_loss("k2"), _exact_grad("forward"), atol=1e-12, rtol=0)


def test_k3_in_the_loss_has_the_reverse_kl_gradient():
    torch.testing.assert_close(_grad_as_loss("k3"), _exact_grad("reverse"), atol=1e-12, rtol=0)
    assert (_grad_as_loss("k3") - _exact_grad("forward")).norm() > 0.1  # ... not the forward KL's


def test_k1_in_the_loss_has_zero_expected_gradient():
    torch.testing.assert_close(_grad_as_loss("k1"), torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)


def test_estimator_values_on_a_known_case():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -2.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([torch.exp(torch.tensor(-2.0)) - 1 + 2, 0]))
    with pytest.raises(ValueError, match="estimator='k9'"):
        kl_penalty(logp, ref, "k9")


def test_pack_mask_round_trips_and_is_eight_times_smaller():
    from textgym.functional import pack_mask, unpack_mask

    torch.manual_seed(0)
    for v in (1, 8, 13, 2048):  # a vocabulary that is not a multiple of 8 too
        mask = torch.rand(3, 5, v) < 0.3
        packed = pack_mask(mask)
        assert packed.dtype == torch.uint8 and packed.shape == (3, 5, (v + 7) // 8)
        assert torch.equal(unpack_mask(packed, v), mask)
    assert pack_mask(torch.tensor([True, False, True, True, False, False, False, False, True])).tolist() == [13, 1]
    with pytest.raises(ValueError, match="pack_mask takes a bool tensor"):
        pack_mask(torch.ones(4))
    with pytest.raises(ValueError, match="size=17"):
        unpack_mask(torch.zeros(2, dtype=torch.uint8), 17)


@pytest.mark.parametrize("block", [4, 256])  # 4: two levels over a padded last block; 256: one block holds the row
def test_sample_categorical_draws_each_index_with_its_probability(block):
    probs = torch.tensor([0.05, 0.0, 0.3, 0.1, 0.0, 0.2, 0.15, 0.0, 0.2, 0.0])  # V = 10, zeros among them
    logp = probs.log().clamp(min=torch.finfo(torch.float32).min).expand(200_000, -1)  # (N, V)
    draws = sample_categorical(logp, torch.Generator().manual_seed(0), block=block)
    counts = torch.bincount(draws, minlength=10).double()
    assert counts[probs == 0].sum() == 0  # an excluded index is never drawn
    expected = probs.double() * len(draws)
    sigma = (expected * (1 - probs.double())).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 1e-9).all(), (counts, expected)


def test_sample_categorical_is_seeded_and_a_target_at_the_end_takes_the_last_index_of_positive_mass():
    logp = torch.log_softmax(torch.randn(64, 1000), -1)
    a = sample_categorical(logp, torch.Generator().manual_seed(3))
    assert torch.equal(a, sample_categorical(logp, torch.Generator().manual_seed(3)))
    assert not torch.equal(a, sample_categorical(logp, torch.Generator().manual_seed(4)))
    cdf = torch.tensor([[0.2, 0.7, 1.0, 1.0, 1.0]], dtype=torch.float64)  # indices 3 and 4 have no mass
    index, rest = _invert_cdf(cdf, torch.tensor([[1.0]], dtype=torch.float64))  # u * total rounded up to total
    assert index.tolist() == [2] and rest.tolist() == [pytest.approx(0.3)]
    index, rest = _invert_cdf(cdf, torch.tensor([[0.2]], dtype=torch.float64))  # exactly at a boundary: the next
    assert index.tolist() == [1] and rest.tolist() == [pytest.approx(0.0)]
    with pytest.raises(ValueError, match=r"logp has shape \(10,\); sample_categorical takes \(N, V\)"):
        sample_categorical(torch.zeros(10))
