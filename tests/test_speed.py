"""The speed levers change no numbers: CDF sampling, trimmed minibatch columns, bf16 where native, no entropy graph."""

from pathlib import Path

import numpy as np
import pytest
import torch

from textgym.agents.ppo import PPOConfig, Trainer
from textgym.agents.ppo.config import PRESETS
from textgym.agents.ppo.rollout import sequence_batch, trim_columns
from textgym.models import native_bf16
from textgym.policies import sample_categorical


def tiny(tmp_path, **changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["tiny"], "out": str(tmp_path / "run"), **changes})


# ---------------------------------------------------------------- sampling
def test_cdf_sampling_draws_each_token_with_its_probability():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 2.0]])  # rows need not sum to 1
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_categorical(probs.expand(2, 4), g) for _ in range(20000)])  # (20000, 2)
    freq = torch.stack([(draws[:, 0] == k).float().mean() for k in range(4)])
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.0, 0.3, 0.2]), atol=0.012, rtol=0)  # 3.5 sigma at n=20000
    assert (draws[:, 1] == 3).all(), "a row with one token of mass must always draw it"


def test_cdf_sampling_never_draws_a_zero_mass_token_even_at_u_zero(monkeypatch):
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(1, 1))
    assert sample_categorical(probs).item() == 2


def test_cdf_sampling_is_reproducible_under_a_generator():
    probs = torch.softmax(torch.randn(64, 2048, generator=torch.Generator().manual_seed(1)), -1)
    first = sample_categorical(probs, torch.Generator().manual_seed(7))
    again = sample_categorical(probs, torch.Generator().manual_seed(7))
    assert torch.equal(first, again)


# ---------------------------------------------------------------- trimmed columns
def _rollout(tmp_path, **changes):
    t = Trainer.create(tiny(tmp_path, precision="fp32", **changes))
    t.iteration()
    return t, sequence_batch(t.last_episodes)


def test_trim_columns_cuts_to_the_longest_response_and_keeps_every_valid_token(tmp_path):
    t, data = _rollout(tmp_path, max_new_tokens=16, num_envs=8)
    P = t.envs.unwrapped.max_prompt_tokens
    data["mask"][:, 5:] = False  # every row ends by token 5
    trimmed = trim_columns(data, P)
    assert trimmed.batch_size == torch.Size([8, 5]) and trimmed["sequence"].shape == (8, 5, P + 5)
    assert torch.equal(trimmed["action"], data["action"][:, :5])
    assert torch.equal(trimmed["sequence"][:, 0], data["sequence"][:, 0, : P + 5])


def test_trimmed_logits_and_values_equal_the_full_width_ones(tmp_path):
    """Causal attention: the columns after every row's end change nothing before them."""
    t, data = _rollout(tmp_path, max_new_tokens=16, num_envs=8)
    P = t.envs.unwrapped.max_prompt_tokens
    data["mask"][:, 6:] = False
    trimmed = trim_columns(data, P)
    from textgym.agents.ppo.models import TokenValues

    with torch.no_grad():
        full = t.actor_logits(data["sequence"], data["sequence_mask"])[:, :6]
        cut = t.actor_logits(trimmed["sequence"], trimmed["sequence_mask"])
        values = TokenValues(t.critic, P)
        v_full = values(data["sequence"], data["sequence_mask"])[:, :6]
        v_cut = values(trimmed["sequence"], trimmed["sequence_mask"])
    torch.testing.assert_close(cut, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cut, v_full, atol=1e-5, rtol=1e-5)


def test_an_update_on_trimmed_minibatches_gives_the_same_weights(tmp_path):
    """The trainer trims every minibatch; padding columns carry no loss, so the step is the same."""
    weights = []
    for trim in (True, False):
        t = Trainer.create(tiny(tmp_path / str(trim), precision="fp32", max_new_tokens=16, num_envs=8,
                                ppo_epochs=1, num_minibatches=1))  # fmt: skip
        t.iteration()  # one rollout and update with the trainer's own trimming
        data = sequence_batch(t.last_episodes)
        data["sample_log_prob"] = t._old_logprobs(data)
        data["reward"] = data["env_reward"]
        t._advantages(data)
        data["mask"][:, 4:] = False
        mb = trim_columns(data, t.envs.unwrapped.max_prompt_tokens) if trim else data
        t._minibatch_step(mb, 0.05)
        weights.append(torch.cat([p.detach().flatten() for p in t.policy.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- precision and entropy
def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    return set(next(line for line in text.splitlines() if line.startswith("flags")).split(":")[1].split())


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU flags from /proc/cpuinfo (Linux)")
def test_native_bf16_follows_the_cpu_flags():
    flags = _cpu_flags()
    assert native_bf16(torch.device("cpu")) == bool({"avx512_bf16", "amx_bf16"} & flags)


def test_auto_precision_is_bf16_exactly_where_the_device_has_native_bf16(tmp_path, monkeypatch):
    t = Trainer.create(tiny(tmp_path))
    for native in (True, False):
        monkeypatch.setattr("textgym.agents.ppo.trainer.native_bf16", lambda device, v=native: v)
        assert t.bf16 is native
        with t.autocast():
            assert torch.is_autocast_enabled("cpu") is native
    t.cfg.precision = "fp32"
    monkeypatch.setattr("textgym.agents.ppo.trainer.native_bf16", lambda device: True)
    assert t.bf16 is False


def test_the_loss_builds_no_entropy_graph_yet_entropy_is_reported(tmp_path):
    t = Trainer.create(tiny(tmp_path, precision="fp32"))
    row = t.iteration()
    assert np.isfinite(row["entropy"]) and row["entropy"] > 0
    data = sequence_batch(t.last_episodes)
    data["sample_log_prob"] = data["sample_log_prob"].clone()
    data["reward"] = data["env_reward"]
    t._advantages(data)
    assert "loss_entropy" not in t.loss(data).keys()
