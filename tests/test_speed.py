"""The speed levers change no numbers: trimmed minibatch columns, bf16 where native, no entropy graph,
attention in fp32 under CPU autocast, a fused optimizer."""

from pathlib import Path

import numpy as np
import pytest
import torch

from textgym.agents.ppo import PPOConfig, Trainer
from textgym.agents.ppo.advantages import sequence_batch, trim_columns
from textgym.agents.ppo.config import PRESETS
from textgym.functional import position_ids_from_mask
from textgym.models import FP32_ATTENTION, load_causal_lm, native_bf16, use_fp32_attention


def tiny(tmp_path, **changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["tiny"], "out": str(tmp_path / "run"), **changes})


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


def test_trimmed_logprobs_and_values_equal_the_full_width_ones(tmp_path):
    """Causal attention: the columns after every row's end change nothing before them."""
    t, data = _rollout(tmp_path, max_new_tokens=16, num_envs=8)
    P = t.envs.unwrapped.max_prompt_tokens
    data["mask"][:, 6:] = False
    trimmed = trim_columns(data, P)
    from textgym.agents.ppo.models import TokenValues

    with torch.no_grad():
        full = t.actor_logprobs(data["sequence"], data["sequence_mask"], data["mask"])[0][:, :6]
        cut = t.actor_logprobs(trimmed["sequence"], trimmed["sequence_mask"], trimmed["mask"])[0]
        values = TokenValues(t.critic, P)
        v_full = values(data["sequence"], data["sequence_mask"])[:, :6]
        v_cut = values(trimmed["sequence"], trimmed["sequence_mask"])
    torch.testing.assert_close(cut, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cut, v_full, atol=1e-5, rtol=1e-5)


def test_the_lm_head_runs_on_the_response_columns_only_and_gives_the_full_forwards_logits():
    """A left-padded prompt needs no vocabulary logits: before, the head ran (and back-propagated) on all L columns.

    ``response_logprobs`` runs the forward's own head on one column (``logits_to_keep=1``) and its chunked head
    (textgym.token_logprobs) on the response's hidden states; ``response_logits`` keeps the T + 1 last columns."""
    from textgym.models import response_logits, response_logprobs

    model = load_causal_lm(None)
    ids = torch.randint(5, 200, (3, 20))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a shorter, left-padded prompt

    class NoKeep(torch.nn.Module):  # a causal LM whose forward takes no logits_to_keep: every column, the same slice
        def forward(self, input_ids, attention_mask, position_ids):
            return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    head_rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[1]))
    try:
        logp, _ = response_logprobs(model, ids, mask, prompt_len=8)
        full = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        no_keep = response_logits(NoKeep(), ids, mask, 8)
        # the torchrun learner's policy is under DDP, whose forward passes every keyword on (DataParallel: the same)
        wrapped = response_logits(torch.nn.DataParallel(model), ids, mask, 8)
    finally:
        hook.remove()
    assert head_rows == [1, 20, 20, 13]  # 1; all 20 where no cut is asked; T + 1 = 20 - 8 + 1 for the response
    expected = torch.log_softmax(full[:, 7:-1], -1).gather(-1, ids[:, 8:, None]).squeeze(-1)
    torch.testing.assert_close(logp, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(no_keep, full[:, 7:-1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(wrapped, full[:, 7:-1])


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
        t.estimator.advantages(data, t.last_episodes, torch.zeros_like(data["reward"]), 0.0, t.autocast)  # PPO: GAE
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
    t.estimator.advantages(data, t.last_episodes, torch.zeros_like(data["reward"]), 0.0, t.autocast)  # PPO: GAE
    assert "loss_entropy" not in t.loss(data).keys()


# ---------------------------------------------------------------- attention in fp32 under CPU autocast
def test_fp32_attention_is_sdpa_outside_cpu_autocast_and_fp32_inside():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ours, theirs = load_causal_lm(), load_causal_lm()
    use_fp32_attention(ours)
    assert ours.config._attn_implementation == FP32_ATTENTION and theirs.config._attn_implementation == "sdpa"
    ids, mask = torch.randint(3, 2000, (3, 9)), torch.tensor([[0, 0] + [1] * 7, [1] * 9, [0] * 5 + [1] * 4])
    with torch.no_grad():  # fp32: the same call, to the bit, padding mask included
        assert torch.equal(ours(input_ids=ids, attention_mask=mask).logits,
                           theirs(input_ids=ids, attention_mask=mask).logits)  # fmt: skip
    module = ours.model.layers[0].self_attn
    q, k, v = (torch.randn(2, 4, 6, 64, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = ALL_ATTENTION_FUNCTIONS[FP32_ATTENTION](module, q, k, v, None, scaling=module.scaling, dropout=0.0)
        low, _ = sdpa_attention_forward(module, q, k, v, None, scaling=module.scaling, dropout=0.0)
    exact, _ = sdpa_attention_forward(module, q, k, v, None, scaling=module.scaling, dropout=0.0)
    assert out.dtype == low.dtype == torch.bfloat16
    assert torch.equal(out, exact.to(torch.bfloat16)) and not torch.equal(low, exact.to(torch.bfloat16))
    out.float().sum().backward()  # the backward runs in fp32 too: the gradient of the fp32 attention
    grad = q.grad.clone()
    q.grad = None
    exact.sum().backward()
    torch.testing.assert_close(grad, q.grad, atol=1e-6, rtol=0)


def test_the_trainer_trains_with_fp32_attention(tmp_path):
    t = Trainer.create(tiny(tmp_path))
    assert t.policy.config._attn_implementation == FP32_ATTENTION
    assert t.critic.config._attn_implementation == FP32_ATTENTION
    assert t.envs.unwrapped.model.config._attn_implementation == "sdpa"  # π_ref as loaded


# ---------------------------------------------------------------- fused AdamW
def test_the_fused_optimizer_steps_like_the_foreach_one(tmp_path):
    """The trainer's AdamW is fused (one kernel for all parameters); its steps match the foreach loop's."""
    t = Trainer.create(tiny(tmp_path))
    assert t.optimizer.defaults["fused"] is True
    params = [p for group in t.optimizer.param_groups for p in group["params"]]
    start = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]
    finals = []
    for fused in (True, False):
        for p, s in zip(params, start):
            p.data.copy_(s)
        opt = torch.optim.AdamW([{"params": params, "lr": 1e-3}], eps=1e-5, fused=fused, foreach=not fused)
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = grad.clone()
            opt.step()
        finals.append(torch.cat([p.detach().flatten() for p in params]))
    assert not torch.equal(finals[0], torch.cat([s.flatten() for s in start]))  # the steps moved the weights
    torch.testing.assert_close(finals[0], finals[1], atol=1e-6, rtol=0)
