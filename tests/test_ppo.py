"""The TorchRL PPO agent: analytic checks of its pieces, then short real runs."""

import json
import math

import numpy as np
import pytest
import torch

from textgym.agents.ppo import PPOConfig, Trainer, train
from textgym.agents.ppo.advantages import compute_advantages, per_token_rewards, sequence_batch
from textgym.agents.ppo.config import PRESETS
from textgym.agents.ppo.kl import AdaptiveKLController
from textgym.agents.ppo.models import TokenLogProbs, TokenValues, ppo_diagnostics
from textgym.episodes import collect_episodes


def tiny(tmp_path, **changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["tiny"], "out": str(tmp_path / "run"), **changes})


# ---------------------------------------------------------------- pure pieces
def test_gae_matches_hand_computation_on_terminal_reward_episode():
    # 3 tokens, reward only at the end, gamma=1, lambda=0.95; a 4th padding column
    reward = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    values = torch.tensor([0.1, 0.2, 0.3])
    lam = 0.95
    data = {"reward": reward, "mask": mask, "sequence": torch.zeros(1, 4, 2), "sequence_mask": torch.zeros(1, 4, 2)}

    from tensordict import TensorDict

    td = TensorDict(data, batch_size=[1, 4])
    value_fn = lambda seq, m: torch.tensor([[[0.1], [0.2], [0.3], [9.0]]])  # padding value must not leak
    compute_advantages(td, value_fn, gamma=1.0, lmbda=lam)
    d2 = 1.0 - values[2]  # terminal: no bootstrap
    d1 = 0.0 + values[2] - values[1]
    d0 = 0.0 + values[1] - values[0]
    a2, a1 = d2, d1 + lam * d2
    a0 = d0 + lam * a1
    expected_adv = torch.tensor([a0, a1, a2])
    expected_target = expected_adv + values
    np.testing.assert_allclose(td["value_target"][0, :3, 0], expected_target, atol=1e-6)
    # advantages are whitened over the 3 valid tokens
    whitened = (expected_adv - expected_adv.mean()) / expected_adv.std()
    np.testing.assert_allclose(td["advantage"][0, :3, 0], whitened, atol=1e-4)


def test_per_token_reward_is_the_seed_formula():
    beta = 0.1
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-3.0, -2.0, -1.0]])
    score = 0.7
    env_reward = beta * ref + torch.tensor([[0.0, 0.0, score]])  # what the env pays
    mask = torch.ones(1, 3, dtype=torch.bool)
    r, kl = per_token_rewards(env_reward, logp, ref, mask, beta, beta)
    seed = -beta * (logp - ref)
    seed[0, -1] += score
    torch.testing.assert_close(r, seed)
    # Exercise 2: a token e^2 times more likely than under pi_ref costs -0.2; equally likely costs 0
    r2, _ = per_token_rewards(beta * ref[:, :2], ref[:, :2] + torch.tensor([[2.0, 0.0]]), ref[:, :2],
                              mask[:, :2], beta, beta)  # fmt: skip
    torch.testing.assert_close(r2, torch.tensor([[-0.2, 0.0]]))


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 1000)  # error clipped at +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    ctl2 = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl2.update(3.0, 1000)  # error -0.5 clipped to -0.2
    assert ctl2.value == pytest.approx(0.1 * (1 - 0.2 * 0.1))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_envs=0"):
        PPOConfig(num_envs=0)
    with pytest.raises(ValueError, match="num_minibatches"):
        PPOConfig(num_envs=10, num_minibatches=3)
    with pytest.raises(ValueError, match="kl_penalty='k3_reward' is not one of .*only k1 belongs in a reward"):
        PPOConfig(kl_penalty="k3_reward")
    with pytest.raises(ValueError, match="precision='fp8'"):
        PPOConfig(precision="fp8")
    with pytest.raises(ValueError, match="target_kl=-1"):
        PPOConfig(target_kl=-1)
    assert PPOConfig(total_episodes=130, num_envs=64).num_iterations == 3


# ---------------------------------------------------------------- on real models
@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    t = Trainer.create(tiny(tmp_path_factory.mktemp("t")))
    return t


def _batch(trainer):
    data = sequence_batch(collect_episodes(trainer.envs, trainer.sampler, seed=0))
    beta = trainer.envs.unwrapped.kl_coef
    data["reward"], _ = per_token_rewards(data["env_reward"], data["sample_log_prob"], data["ref_logprob"],
                                          data["mask"], beta, beta)  # fmt: skip
    compute_advantages(data, TokenValues(trainer.critic, trainer.envs.unwrapped.max_prompt_tokens), 1.0, 0.95)
    return data


def _logprobs(trainer, data, temperature: float = 1.0) -> torch.Tensor:
    """log π_θ of the batch's actions by :class:`TokenLogProbs` (0 off the mask), without gradient."""
    head = TokenLogProbs(trainer.policy, trainer.envs.unwrapped.max_prompt_tokens, temperature)
    with torch.no_grad():
        return head(data["sequence"], data["sequence_mask"], data["mask"])[0]


def test_rollout_logprobs_equal_teacher_forced_logprobs(trainer):
    """The cached sampling log-probs equal one forward over the finished sequences (off-by-one check)."""
    data = _batch(trainer)
    tf = _logprobs(trainer, data, trainer.cfg.temperature)
    m = data["mask"]
    torch.testing.assert_close(tf[m], data["sample_log_prob"][m], atol=1e-5, rtol=0)
    # and the env's ref log-probs are the policy's at initialisation (the policy is a copy of pi_ref)
    torch.testing.assert_close(data["ref_logprob"][m], data["sample_log_prob"][m], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("rho", "adv", "expected"), [(1.5, 3.0, 3.6), (1.5, -3.0, -4.5), (0.5, 3.0, 1.5)])
def test_clipped_objective_on_known_ratio_and_advantage(trainer, rho, adv, expected):
    data = _batch(trainer)[:1]
    only_first = torch.zeros_like(data["mask"])
    only_first[:, 0] = True
    data["mask"] = only_first
    logp = _logprobs(trainer, data)
    data["sample_log_prob"] = logp - math.log(rho)  # so pi/pi_old = rho at token 0
    data["advantage"] = torch.full_like(data["advantage"], adv)
    out = trainer.loss(data)
    assert -out["loss_objective"].item() == pytest.approx(expected, rel=1e-4)


def test_clipped_objective_never_exceeds_one_plus_eps_times_a(trainer):
    data = _batch(trainer)[:1]
    logp = _logprobs(trainer, data)
    data["advantage"] = torch.full_like(data["advantage"], 2.0)
    for rho in np.random.default_rng(0).uniform(0.1, 5.0, 20):
        data["sample_log_prob"] = logp - math.log(rho)
        assert -trainer.loss(data)["loss_objective"].item() <= 1.2 * 2.0 + 1e-5


def test_gradients_are_isolated_between_actor_and_critic(trainer):
    data = _batch(trainer)
    data["advantage"] = torch.randn_like(data["advantage"])  # a non-zero policy gradient
    data["value_target"] = data["value_target"] + 1.0  # a non-zero value gradient
    for key, owner, other in (("loss_objective", trainer.policy, trainer.critic),
                              ("loss_critic", trainer.critic, trainer.policy)):  # fmt: skip
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.loss(data)[key].backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in owner.parameters()), key
        assert all(p.grad is None or p.grad.abs().sum() == 0 for p in other.parameters()), key
    trainer.optimizer.zero_grad(set_to_none=True)


def test_parameters_change_after_one_iteration(tmp_path):
    t = Trainer.create(tiny(tmp_path, learning_rate=1e-3))
    before_p = [p.detach().clone() for p in t.policy.parameters()]
    before_v = [p.detach().clone() for p in t.critic.parameters()]
    row = t.iteration()
    assert any(not torch.equal(a, b) for a, b in zip(before_p, t.policy.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(before_v, t.critic.parameters()))
    for key in (
        "rm_score",
        "gold_score",
        "kl",
        "kl_coef",
        "entropy",
        "approx_kl",
        "clip_fraction",
        "value_loss",
        "explained_variance",
        "response_length",
        "tokens_per_s",
        "logprob_mismatch_max",
    ):
        assert key in row and math.isfinite(row[key]), key
    assert row["env_steps"] == row["response_length"] * t.cfg.num_envs  # one env step per generated token


def test_first_minibatch_has_ratio_one_under_bf16_autocast(tmp_path):
    """log π_old is recomputed in the update's precision: sampled fp32 log-probs would differ under bf16."""
    t = Trainer.create(tiny(tmp_path, precision="bf16", num_envs=16, max_new_tokens=8, ppo_epochs=1))
    firsts = []  # the first minibatch's diagnostics of each update
    orig, update = t.loss.forward, t._update

    def spy(td):
        out = orig(td)
        if not firsts[-1]:
            logp, entropy, _ = t._last_logprobs[-1]
            firsts[-1].update(ppo_diagnostics(logp, entropy, td["sample_log_prob"], td["mask"], t.cfg.clip_epsilon))
        return out

    def each_update(*args):
        firsts.append({})
        return update(*args)

    t.loss.forward, t._update = spy, each_update
    rows = [t.iteration() for _ in range(2)]
    assert all(r["logprob_mismatch_max"] > 1e-4 for r in rows), (
        "bf16 and fp32 log-probs should differ, else the test shows nothing"
    )
    for first in firsts:
        assert first["clip_fraction"] == 0.0 and first["approx_kl"] < 1e-6, firsts


@pytest.mark.parametrize("kl_penalty", ["k2_loss", "k3_loss"])
def test_loss_side_kl_penalty_enters_the_loss_not_the_reward(tmp_path, kl_penalty):
    t = Trainer.create(tiny(tmp_path, kl_penalty=kl_penalty, learning_rate=1e-3))
    row = t.iteration()
    assert "kl_loss" in row and math.isfinite(row["kl_loss"]) and row["kl_loss"] >= 0
    row = t.iteration()
    assert row["kl_loss"] > 0  # the policy moved away from π_ref after one update


def test_an_iteration_on_fewer_episodes_than_slots(tmp_path):
    t = Trainer.create(tiny(tmp_path))
    row = t.iteration(num_episodes=3)  # the benchmark's last batch: what is left of the budget
    assert row["episodes"] == 3 and row["env_steps"] == round(row["response_length"] * 3)


# ---------------------------------------------------------------- runs
def test_train_writes_outputs_and_resume_continues_exactly(tmp_path):
    import gymnasium as gym
    from transformers import AutoModelForCausalLM

    full = train(tiny(tmp_path / "a", total_episodes=24, checkpoint_every=1))
    # the same run, killed after iteration 2 (checkpoint_every=2), then resumed
    b = tiny(tmp_path / "b", total_episodes=16, checkpoint_every=2)
    train(b)
    resumed = train(tiny(tmp_path / "b", total_episodes=24, checkpoint_every=2, resume=True))
    assert [r["iteration"] for r in resumed] == [1, 2, 3]
    for key in ("rm_score", "kl", "kl_coef", "policy_loss", "value_loss", "gold_score"):
        assert resumed[2][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-7), key
    out = tmp_path / "a" / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert any(p.name.startswith("events") for p in (out / "tensorboard").iterdir())
    AutoModelForCausalLM.from_pretrained(out / "policy")
    env = gym.make("TextRLHF-v0", model=str(out / "policy"), normalize_reward=False)  # a new π_ref: its own scale
    env.reset(seed=0)
    assert not any(p.name.startswith(".") for p in out.iterdir()), "no temp folders left behind"


@pytest.mark.slow
def test_ppo_raises_the_rm_score_on_a_fixed_seed(tmp_path):
    """A short seeded run on the default env: the normalised RM score climbs, KL stays bounded."""
    cfg = PPOConfig(total_episodes=32 * 14, num_envs=32, max_new_tokens=12, num_minibatches=2, seed=0,
                    learning_rate=5e-4, critic_learning_rate=1e-3, target_kl=None, kl_coef=0.05,
                    out=str(tmp_path / "run"), progress=False, checkpoint_every=100)  # fmt: skip
    history = train(cfg)
    first = np.mean([r["score"] for r in history[:3]])
    last = np.mean([r["score"] for r in history[-3:]])
    assert last > first + 0.5, (first, last)
    assert all(math.isfinite(r["kl"]) for r in history)
