"""LoRA policies that share π_ref's weights: the env's reference forward runs with the adapters disabled."""

import json

import numpy as np
import pytest
import torch

from textgym.agents.ppo import PPOConfig, Trainer
from textgym.agents.ppo.config import PRESETS
from textgym.episodes import collect_episodes
from textgym.models import DEFAULT_LM, load_causal_lm, response_logprobs


def lora_cfg(out, **changes) -> PPOConfig:
    """fp32: these tests check identities (the first policy is π_ref, KL 0) that bf16 rounding would blur."""
    base = {"out": str(out), "lora_rank": 4, "learning_rate": 1e-2, "precision": "fp32"}
    return PPOConfig(**{**PRESETS["tiny"], **base, **changes})


# KL of a policy equal to π_ref is fp32 roundoff: log π from the update's full forward against the env's
# cached per-token log π_ref, summed over up to 6 tokens. It depends on the CPU's kernels: under 1e-6 on
# the machine of earlier sessions, 1.1e-6 on a Xeon with AMX.
KL_AT_INIT = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA trainer after two iterations at a large learning rate (the adapters moved), saved."""
    out = tmp_path_factory.mktemp("lora") / "run"
    trainer = Trainer.create(lora_cfg(out))
    first = trainer.iteration()
    trainer.iteration()
    trainer.save(out)
    return trainer, first, out


def test_one_copy_of_the_base_weights_serves_pi_ref_and_the_policy(trained):
    trainer, first, _ = trained
    base = trainer.envs.unwrapped
    assert trainer.policy.get_base_model() is base.model  # not a copy
    trained_names = {n for g in trainer.optimizer.param_groups for p in g["params"] for n, q in
                     trainer.policy.named_parameters() if q is p}  # fmt: skip
    assert trained_names and all("lora_" in n for n in trained_names)
    assert abs(first["kl"]) < KL_AT_INIT and first["logprob_mismatch_max"] < 1e-5  # B = 0: the first policy is π_ref


def test_the_adapters_never_leak_into_pi_ref(trained):
    trainer, _, _ = trained
    base = trainer.envs.unwrapped
    episodes = collect_episodes(trainer.envs, trainer.sampler, seed=7)
    P = base.max_prompt_tokens
    fresh_ref = load_causal_lm(DEFAULT_LM)  # π_ref as shipped: the ground truth
    mask = episodes["mask"].bool()
    with torch.no_grad():
        truth, _ = response_logprobs(fresh_ref, episodes["input_ids"], episodes["attention_mask"], P)
        policy_lp, _ = response_logprobs(trainer.policy, episodes["input_ids"], episodes["attention_mask"], P)
    torch.testing.assert_close(episodes["ref_logprob"][mask], truth[mask], atol=1e-5, rtol=0)
    assert (policy_lp[mask] - truth[mask]).abs().max() > 1e-2  # while the policy itself has moved


def test_a_lora_run_saves_adapters_resumes_them_and_exports_merged_weights(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from textgym.cli import main

    trainer, _, out = trained
    policy_dir = out / "policy"
    assert (policy_dir / "adapter_config.json").is_file() and not (policy_dir / "model.safetensors").exists()
    assert (policy_dir / "adapter_model.safetensors").stat().st_size < (DEFAULT_LM / "model.safetensors").stat().st_size
    resumed = Trainer.create(lora_cfg(tmp_path / "other"))
    resumed.load(out / "checkpoint")
    for (name, a), b in zip(trainer.policy.named_parameters(), resumed.policy.parameters()):
        if "lora_" in name:
            assert torch.equal(a, b), name
    main(["export", str(policy_dir), "--merge", "--out", str(tmp_path / "merged")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trainer.policy(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    assert json.loads((tmp_path / "merged" / "textgym_run.json").read_text())["max_new_tokens"] == 6
    with pytest.raises(SystemExit):  # a second export onto the same folder is refused
        main(["export", str(policy_dir), "--merge", "--out", str(tmp_path / "merged")])


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="lora_rank=-1 must be an int >= 0"):
        PPOConfig(lora_rank=-1)
    with pytest.raises(ValueError, match="lora_alpha=0.0 must be a finite float > 0"):
        PPOConfig(lora_rank=4, lora_alpha=0.0)
    assert np.isclose(PPOConfig(lora_rank=4).lora_rank, 4)


def test_a_lora_policy_folder_evaluates_as_its_merged_model(trained):
    from textgym.agents.evaluate import evaluate

    trainer, _, out = trained
    result = evaluate(str(out / "policy"), episodes=4, num_envs=4)  # adapters merged into the base they name
    assert np.isfinite(result["kl"][0]) and result["kl"][0] != 0.0 and result["kl_coef"] == trainer.last_beta


def test_a_critic_copied_from_the_lora_policy_body_trains_its_adapters_and_head_only(tmp_path):
    trainer = Trainer.create(lora_cfg(tmp_path, reward_model="vader"))  # no RM backbone to share: the policy body
    critic_names = {n for n, p in trainer.critic.named_parameters() if p.requires_grad}
    assert critic_names and all("lora_" in n or "score" in n for n in critic_names)
    assert any("score" in n for n in critic_names)  # the value head trains in full
    row = trainer.iteration()
    assert np.isfinite(row["value_loss"]) and abs(row["kl"]) < KL_AT_INIT
    trainer.save(tmp_path)
    resumed = Trainer.create(lora_cfg(tmp_path / "again", reward_model="vader"))
    resumed.load(tmp_path / "checkpoint")
    for (name, a), b in zip(trainer.critic.named_parameters(), resumed.critic.parameters()):
        assert torch.equal(a, b), name


def test_pi_ref_scored_at_the_episodes_end_runs_with_the_adapters_off(trained):
    """The collectors' teacher-forced π_ref pass goes through reference_context (adapters disabled), as each step's
    cached π_ref forward does: both give the shipped π_ref's log-probs, never the moved policy's."""
    from test_reference_scoring import assert_same_episodes, both_ways

    from textgym.policies import LMSampler

    trainer, _, _ = trained
    step, episode = both_ways(trainer.envs, lambda: LMSampler.for_env(trainer.policy, trainer.envs, seed=0), seed=11)
    assert_same_episodes(step, episode)
    base = trainer.envs.unwrapped
    mask = episode["mask"].bool()
    with torch.no_grad():
        truth, _ = response_logprobs(load_causal_lm(DEFAULT_LM), episode["input_ids"], episode["attention_mask"],
                                     base.max_prompt_tokens)  # fmt: skip
    torch.testing.assert_close(episode["ref_logprob"][mask], truth[mask], atol=1e-5, rtol=0)


def test_the_merged_rollout_copy_samples_the_trained_policy(tmp_path):
    """merged_rollout: the sampler reads a plain copy whose weights are W + ΔW of the current adapters."""
    from textgym.agents.ppo.merged_policy import MergedPolicy

    trainer = Trainer.create(lora_cfg(tmp_path / "run", merged_rollout=True))
    merged = trainer.merged
    assert trainer.sampler.model is merged.model and merged.model is not trainer.envs.unwrapped.model
    assert not any(p.requires_grad for p in merged.model.parameters())
    trainer.iteration()  # the update moves the adapters; the next rollout refreshes the copy first
    ptrs = [p.data_ptr() for p in merged.model.parameters()]
    episodes = collect_episodes(trainer.envs, trainer.sampler, seed=3)  # the copy as the first update left it
    P, ids, attn = trainer.envs.unwrapped.max_prompt_tokens, episodes["input_ids"], episodes["attention_mask"]
    mask = episodes["mask"].bool()
    with torch.no_grad():
        peft_lp, _ = response_logprobs(trainer.policy, ids, attn, P)
        stale_lp, _ = response_logprobs(merged.model, ids, attn, P)
    assert (stale_lp[mask] - peft_lp[mask]).abs().max() > 1e-3  # not yet refreshed: the adapters moved
    merged.refresh()
    with torch.no_grad():
        merged_lp, _ = response_logprobs(merged.model, ids, attn, P)
    torch.testing.assert_close(merged_lp[mask], peft_lp[mask], atol=1e-5, rtol=0)
    assert [p.data_ptr() for p in merged.model.parameters()] == ptrs  # in place: a captured graph sees it
    stats = trainer.iteration()
    assert stats["logprob_mismatch_max"] < 1e-4  # the sampler's log-probs are π_old's: refreshed before the rollout
    head = trainer.policy.base_model.model.lm_head.weight  # tied to the embedding
    head.requires_grad_(True)
    try:
        with pytest.raises(ValueError, match=r"LoRA adapters only; the policy also trains \[.base_model.model.model"):
            MergedPolicy(trainer.policy)
    finally:
        head.requires_grad_(False)


def test_merged_rollout_and_decoder_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="merged_rollout=True merges LoRA adapters into a copy; lora_rank=0"):
        PPOConfig(**{**PRESETS["tiny"], "merged_rollout": True})
    with pytest.raises(ValueError, match="merged_rollout='yes' is a str; merged_rollout takes a bool or None"):
        PPOConfig(**{**PRESETS["tiny"], "lora_rank": 2, "merged_rollout": "yes"})
    with pytest.raises(ValueError, match=r"decoder='static' is not one of \('auto', 'dynamic', 'ring', 'graph'\)"):
        PPOConfig(**{**PRESETS["tiny"], "decoder": "static"})
    with pytest.raises(ValueError, match="decoder='graph' captures CUDA graphs; device='cpu'"):
        PPOConfig(**{**PRESETS["tiny"], "decoder": "graph", "device": "cpu"})
