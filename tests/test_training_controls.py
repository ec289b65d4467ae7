"""PPO training controls: approx-KL early stop, learning-rate warmup and schedules, top-k/top-p sampling
under the same distribution in the update, sample logging and periodic evaluation, config files and
presets, and the CLI's thread count."""

import copy
import json
import math

import numpy as np
import pytest
import torch

from textgym import cli, threads
from textgym.agents.evaluate import evaluate, run_settings
from textgym.agents.ppo import PPOConfig, Trainer, train
from textgym.agents.ppo.config import PRESET_DIR, PRESETS
from textgym.cli import main
from textgym.functional import unpack_mask
from textgym.policies import LMSampler, truncate_logits


def tiny(tmp_path, **changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["tiny"], "out": str(tmp_path / "run"), **changes})


# ---------------------------------------------------------------- the update
def test_early_stop_kl_ends_the_epochs_of_an_iteration(tmp_path):
    """CleanRL's target_kl: once an epoch's mean approx_kl passes the threshold, the iteration's update ends."""
    rows = {}
    for stop in (None, 1e-9):
        trainer = Trainer.create(tiny(tmp_path, ppo_epochs=3, learning_rate=1e-3, early_stop_kl=stop))
        rows[stop] = trainer.iteration()
    assert rows[None]["ppo_epochs_run"] == 3
    assert rows[1e-9]["ppo_epochs_run"] == 1 and rows[1e-9]["approx_kl"] > 1e-9


def test_learning_rate_warmup_then_linear_decay(tmp_path):
    """transformers' linear schedule stepped per iteration: 0, ½, 1 over 2 warmup iterations, then down to 0."""
    cfg = tiny(tmp_path, total_episodes=32, lr_schedule="linear", warmup_iterations=2, learning_rate=1e-3,
               critic_learning_rate=2e-3)  # fmt: skip
    trainer = Trainer.create(cfg)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    rates = []
    for _ in range(cfg.num_iterations):
        rates.append(trainer.iteration()["learning_rate"])
        if len(rates) == 1:  # rate 0: the first warmup iteration leaves the policy as it was
            assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    np.testing.assert_allclose(rates, [0.0, 5e-4, 1e-3, 5e-4])
    assert trainer.optimizer.param_groups[1]["lr"] == pytest.approx(1e-3)  # the critic's 2e-3 · ½
    with pytest.raises(ValueError, match="lr_schedule='exp' is not one of"):
        tiny(tmp_path, lr_schedule="exp")


def test_truncate_logits_by_hand():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])  # softmax: 0.644, 0.237, 0.087, 0.032
    low = torch.finfo(torch.float32).min
    assert truncate_logits(logits, top_k=2).tolist() == [2.0, 1.0, low, low]
    assert truncate_logits(logits, top_p=0.7).tolist() == [2.0, 1.0, low, low]  # 0.644 < 0.7 <= 0.881
    assert truncate_logits(logits, top_p=0.5).tolist() == [2.0, low, low, low]  # the top token is always kept
    assert truncate_logits(logits, top_k=3, top_p=0.99).tolist() == [2.0, 1.0, 0.0, low]
    assert truncate_logits(logits) is logits


def test_the_kept_set_is_stored_with_each_token_and_holds_the_sampled_one(tmp_path):
    trainer = Trainer.create(tiny(tmp_path, top_k=20, top_p=0.9, precision="fp32"))
    trainer.iteration()
    ep = trainer.last_episodes
    vocab = trainer.policy.config.vocab_size
    keep = unpack_mask(ep["kept"], vocab)  # (B, T, V)
    mask = ep["mask"]
    inside = keep.gather(-1, ep["action"].unsqueeze(-1)).squeeze(-1)
    assert inside[mask].all()
    assert (keep[mask].sum(-1) <= 20).all() and (keep[mask].sum(-1) >= 1).all()


def test_the_update_uses_the_kept_set_the_sampler_drew_from_not_its_own(tmp_path):
    """The issue's NaN: a set recomputed from the learner's logits (bf16 against the sampler's) can leave out
    the sampled token, whose log π_old was then -3.4e38. A sampler whose logits differ makes it happen every time."""
    trainer = Trainer.create(tiny(tmp_path, top_p=0.5, precision="fp32", num_envs=16, max_new_tokens=8))
    noisy = copy.deepcopy(trainer.policy)
    with torch.no_grad():
        head = noisy.get_output_embeddings().weight
        head.add_(0.05 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    trainer.sampler = LMSampler.for_env(noisy, trainer.envs, top_p=0.5, seed=0)
    old, real = [], trainer._old_logprobs
    trainer._old_logprobs = lambda data: old.append(real(data)) or old[-1]
    row = trainer.iteration()
    assert row["logprob_mismatch_max"] > 1e-2  # the two distributions do differ
    assert (old[0][trainer.last_episodes["mask"]] > -1e3).all()  # every sampled token is inside the update's set
    assert all(np.isfinite(v) for v in row.values()), row


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "kl_penalty"), [("ppo", "k1_reward"), ("grpo", "k3_loss")])
def test_top_k_top_p_under_bf16_stays_finite_with_first_ratio_one(tmp_path, algo, kl_penalty):
    """8 iterations under bf16 autocast with top_p 0.9 and top_k 20: every metric finite, every update's first
    minibatch at ratio 1 (clip fraction 0, approx_kl ~ 0)."""
    trainer = Trainer.create(tiny(tmp_path, algo=algo, group_size=4, kl_penalty=kl_penalty, top_k=20, top_p=0.9,
                                  precision="bf16", learning_rate=1e-3))  # fmt: skip
    firsts, real = [], trainer._minibatch_step
    trainer._minibatch_step = lambda mb, beta: (lambda d: firsts.append(d) or d)(real(mb, beta))
    for _ in range(8):
        n = len(firsts)
        row = trainer.iteration()
        assert all(np.isfinite(v) for v in row.values()), row
        assert firsts[n]["clip_fraction"] == 0.0 and firsts[n]["approx_kl"] < 1e-5, firsts[n]


def test_top_k_top_p_sampling_and_the_update_agree(tmp_path):
    """The sampler draws from the truncated distribution and the update's teacher-forced log-probs use it too."""
    trainer = Trainer.create(tiny(tmp_path, top_k=8, top_p=0.9, precision="fp32"))
    row = trainer.iteration()
    assert row["logprob_mismatch_max"] < 1e-4  # fp32: sampled and teacher-forced log-probs agree
    episodes = trainer.last_episodes
    sampled = episodes["sample_log_prob"][episodes["mask"]]
    assert (sampled > -30).all()  # drawn from kept tokens only
    envs, model = trainer.envs, trainer.envs.unwrapped.model
    obs, _ = envs.reset(seed=0)
    greedy = LMSampler.for_env(model, envs).logits(obs).argmax(-1)
    top1 = LMSampler.for_env(model, envs, top_k=1, seed=0)
    actions, logp = top1.act(obs)
    assert torch.equal(actions, greedy) and (logp == 0).all()  # top-1: the most likely token, with certainty
    kept = unpack_mask(top1.last_kept, model.config.vocab_size)
    assert torch.equal(kept.sum(-1), torch.ones(len(actions), dtype=torch.long))
    with pytest.raises(ValueError, match="top_p=1.5 must be a float in"):
        tiny(tmp_path, top_p=1.5)
    # the saved policy is evaluated sampling as it was trained
    trainer.save(tmp_path / "run")
    assert {"top_k": 8, "top_p": 0.9}.items() <= run_settings(str(tmp_path / "run" / "policy")).items()
    assert np.isfinite(evaluate(str(tmp_path / "run" / "policy"), episodes=2, num_envs=2)["kl"][0])


# ---------------------------------------------------------------- logging, evaluation, config files
def test_samples_and_periodic_evaluation_are_logged(tmp_path, capsys):
    cfg = tiny(tmp_path, samples_every=1, num_samples=2, eval_every=2, eval_episodes=4)
    history = train(cfg)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["iteration"] for s in samples] == [1, 1, 2, 2]
    assert all(isinstance(s["response"], str) and np.isfinite(s["score"]) for s in samples)
    assert "eval_score" not in history[0] and {"eval_score", "eval_gold_score", "eval_kl"} <= set(history[1])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert "samples/text_summary" in events.Tags()["tensors"] and "eval/score" in events.Tags()["scalars"]
    # the run's config.json is a config file: passed back, it gives the same run (here in another folder)
    main(["train", "--config-file", str(tmp_path / "run" / "config.json"), "--out", "elsewhere", "--print-config"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == {**cfg.to_dict(), "out": "elsewhere"}


def test_presets_are_files_and_flags_apply_over_a_config_file(tmp_path, capsys):
    assert json.loads((PRESET_DIR / "demo.json").read_text()) == PRESETS["demo"]
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({**PRESETS["demo"], "learning_rate": 5e-5}))
    main(["train", "--config", "tiny", "--config-file", str(mine), "--seed", "3", "--print-config"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["learning_rate"] == 5e-5 and printed["total_episodes"] == 3072 and printed["seed"] == 3
    assert printed["ppo_epochs"] == 1  # from the tiny preset, which the file does not set
    mine.write_text(json.dumps({"learning_rat": 1e-4}))
    with pytest.raises(SystemExit):
        main(["train", "--config-file", str(mine), "--print-config"])
    assert "unknown fields ['learning_rat']" in capsys.readouterr().err


# ---------------------------------------------------------------- threads
def test_threads_flag_and_the_default_from_the_cores_not_their_load(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli, "cmd_info", lambda args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    main(["info", "--threads", "1"])
    assert seen == [1] and torch.get_num_threads() == before  # set for the command, restored after
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    main(["info"])
    assert seen[-1] == 2 and capsys.readouterr().err == ""  # one fewer than the CPU set's cores, whatever their load


def test_truncated_importance_weights_by_hand():
    from textgym.agents.ppo.advantages import sampler_mismatch

    old = torch.tensor([[0.0, math.log(3.0), 5.0]])  # log π_old
    sampled = torch.tensor([[math.log(2.0), 0.0, 0.0]])  # log π_sampler: ratios 1/2 and 3, then padding
    mask = torch.tensor([[True, True, False]])
    out = sampler_mismatch(old, sampled, mask, cap=2.0)
    torch.testing.assert_close(out["tis_weight"], torch.tensor([[0.5, 2.0, 0.0]]))  # capped at C, 0 on padding
    assert out["logprob_mismatch_max"] == pytest.approx(math.log(3))
    assert out["logprob_mismatch_mean"] == pytest.approx((math.log(2) + math.log(3)) / 2)
    assert out["tis_weight_mean"] == pytest.approx(1.25) and out["tis_capped_fraction"] == 0.5
    uncapped = sampler_mismatch(old, sampled, mask, cap=None)["tis_weight"]
    torch.testing.assert_close(uncapped, torch.tensor([[1.0, 1.0, 0.0]]))  # None: reported, not applied
    with pytest.raises(ValueError, match="must have one shape"):
        sampler_mismatch(old, sampled[:, :2], mask, cap=2.0)


def test_each_tokens_advantage_is_weighted_by_pi_old_over_pi_sampler(tmp_path):
    """A sampler whose logits differ from the learner's: the update gets A·min(π_old/π_sampler, C), token by token."""
    trainer = Trainer.create(tiny(tmp_path, precision="fp32", tis_cap=1.05))
    noisy = copy.deepcopy(trainer.policy)
    with torch.no_grad():
        head = noisy.get_output_embeddings().weight
        head.add_(0.05 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    trainer.sampler = LMSampler.for_env(noisy, trainer.envs, seed=0)
    seen, advantages, update = {}, trainer.estimator.advantages, trainer._update

    def spy_advantages(data, *args):
        out = advantages(data, *args)
        seen["before"] = data["advantage"].clone()
        return out

    trainer.estimator.advantages = spy_advantages
    trainer._update = lambda data, beta: seen.setdefault("data", data) is None or update(data, beta)
    row = trainer.iteration()
    data, ep = seen["data"], trainer.last_episodes
    mask = data["mask"]
    sampled = ep["sample_log_prob"][:, : mask.shape[1]]
    weight = (data["sample_log_prob"] - sampled).exp().clamp(max=1.05) * mask
    torch.testing.assert_close(data["advantage"][..., 0], seen["before"][..., 0] * weight)
    assert row["tis_capped_fraction"] > 0 and row["tis_weight_mean"] != 1.0


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_periodic_evaluation_samples_in_the_runs_precision(tmp_path, monkeypatch, precision):
    """The policy is measured in the precision it samples in during training (it was always fp32)."""
    import contextlib

    from textgym.agents import evaluate as evaluate_module

    seen, real = [], evaluate_module.collect_episodes

    def spy(*args, autocast=contextlib.nullcontext, **kwargs):
        with autocast():
            seen.append(torch.is_autocast_enabled("cpu"))
        return real(*args, autocast=autocast, **kwargs)

    monkeypatch.setattr(evaluate_module, "collect_episodes", spy)
    trainer = Trainer.create(tiny(tmp_path, precision=precision, eval_episodes=4))
    try:
        assert math.isfinite(trainer.evaluate()["eval_score"])
    finally:
        trainer.close()
    assert seen and set(seen) == {precision == "bf16"}


def test_train_help_gives_each_flag_its_own_text_without_markup_and_names_every_choice():
    """Issue 42.12: --gamma/--lmbda and the two learning rates shared a text, --partner showed Sphinx markup and
    left out guess-the-number-10, --env-id left out TextMultiTurn-v0, --resume named internal constants."""
    import argparse
    import re

    from textgym.agents.ppo.config import RESUME_APPLIED, RESUME_FREE, add_config_args
    from textgym.partners import available_partners

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    texts = {a.option_strings[0]: re.sub(r" \(default: .*\)$", "", a.help) for a in parser._actions if a.help}
    shared = {t for t in texts.values() if list(texts.values()).count(t) > 1}
    assert not shared
    assert not any(mark in t for t in texts.values() for mark in ("``", ":mod:", ":class:", ":func:"))
    assert all(env in texts["--env-id"] for env in ("TextRLHF-v0", "TextArithmetic-v0", "TextMultiTurn-v0"))
    assert all(f'"{name}"' in texts["--partner"] for name in available_partners())
    assert "RESUME_" not in texts["--resume"]
    assert all(name in texts["--resume"] for name in (*RESUME_APPLIED, *RESUME_FREE) if name not in ("out", "resume"))
    assert "one fewer" not in texts["--threads"]
