"""The PPO learner under torch.distributed: 2 gloo processes update as one process does on the same rollout."""

import gc
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from textgym.agents.ppo import PPOConfig, Trainer, train
from textgym.agents.ppo.config import PRESETS

# what the update computes (rollout-only columns are equal by construction)
UPDATE = ("policy_loss", "value_loss", "approx_kl", "clip_fraction", "entropy", "explained_variance", "kl", "kl_coef")


def tiny(out, **changes) -> PPOConfig:
    """8 episodes in minibatches of 4 (2 rows per rank), 2 epochs: 4 optimizer steps per iteration.

    The arithmetic env's answers end on EOS after 2 to 4 tokens: ranks hold unequal token counts, which
    is what the loss scale is for (the sentiment LM's 8-token responses all reach the cap).
    """
    base = {"env_id": "TextArithmetic-v0", "max_new_tokens": 8, "precision": "fp32", "ppo_epochs": 2,
            "learning_rate": 1e-3, "out": str(out)}  # fmt: skip
    return PPOConfig(**{**PRESETS["tiny"], **base, **changes})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, folder: str) -> None:
    """One torchrun-like rank: the environment torchrun sets, then one iteration of a Trainer."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    from textgym.agents.ppo import distributed

    t = Trainer.create(tiny(os.path.join(folder, "run")))
    row = t.iteration()
    saved = {"row": row, "policy": t.policy.state_dict(), "critic": t.critic.state_dict(), "grad": _grad(t),
             "action": t.last_episodes["action"]}  # fmt: skip
    wrapped = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    t.close()  # frees both wrappers by reference count alone, before leave()'s collection
    # what leave() relies on: no DDP Reducer left to free the destroyed group's last reference with the GIL held
    saved["ddp"] = (wrapped, sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))
    distributed.leave()


def _grad(t: Trainer) -> torch.Tensor:
    """The last optimizer step's gradient (all-reduced under DDP, then clipped), policy and critic as one vector."""
    return torch.cat([p.grad.flatten() for m in (t.policy, t.critic) for p in m.parameters() if p.grad is not None])


def _single_process(out) -> tuple[dict, Trainer]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same rollout, bit for bit
    try:
        t = Trainer.create(tiny(out))
        return t.iteration(), t
    finally:
        torch.set_num_threads(threads)


def test_two_gloo_processes_update_as_one_process_on_the_same_rollout(tmp_path):
    mp.spawn(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    row, t = _single_process(tmp_path / "single")
    # the policy and the critic trained through DDP, and closing the trainer let both wrappers go
    assert [rank["ddp"] for rank in ranks] == [(2, 0), (2, 0)]
    # rank 0's rollout reached rank 1, and it is the single process's (same seed)
    assert torch.equal(ranks[0]["action"], ranks[1]["action"])
    assert torch.equal(ranks[0]["action"], t.last_episodes["action"])
    for name in ("policy", "critic"):
        for key, value in ranks[0][name].items():
            assert torch.equal(value, ranks[1][name][key]), f"{name}.{key} differs between the ranks"
    # AdamW's first steps move each weight by about lr·sign(g): the weights alone would hide a wrong gradient
    grad = _grad(t)
    assert (ranks[0]["grad"] - grad).norm() < 1e-4 * grad.norm()
    for name, model in (("policy", t.policy), ("critic", t.critic)):
        for key, value in model.state_dict().items():
            torch.testing.assert_close(ranks[0][name][key], value, rtol=1e-4, atol=1e-6, msg=f"{name}.{key}")
    assert any(not torch.equal(v, t.envs.unwrapped.model.state_dict()[k]) for k, v in ranks[0]["policy"].items())
    for key in UPDATE:
        for rank in ranks:
            assert rank["row"][key] == pytest.approx(row[key], rel=1e-4, abs=1e-6), key
    t.close()


def test_torchrun_trains_with_rank_0_alone_writing_and_resumes(tmp_path):
    out = tmp_path / "ddp"
    flags = ["--config", "tiny", "--env-id", "TextArithmetic-v0", "--max-new-tokens", "8", "--precision", "fp32",
             "--ppo-epochs", "2", "--learning-rate", "1e-3", "--out", str(out), "--no-progress",
             "--checkpoint-every", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # OMP_NUM_THREADS as the README says

    def torchrun(*extra):
        # --standalone: torchrun binds its own free port. A port picked here first raced the other test worker's
        # Ray cluster, which binds ports of its own: one suite run hung its 300 s with rank 1 gone
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "textgym.cli", "train", *flags, *extra]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        # issue 26.5: no FutureWarning (DDP's broadcast_buffers) or launcher warning; the resume below warns, by
        # design, that it applies the new total_episodes
        assert "--resume" in extra or "Warning" not in done.stderr, done.stderr[-3000:]

    torchrun("--total-episodes", "8")
    torchrun("--total-episodes", "16", "--resume")  # every rank reads the checkpoint, rank 0 appends
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]  # one writer: no row twice
    assert (out / "checkpoint" / "state.json").is_file() and (out / "policy").is_dir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = train(tiny(tmp_path / "single", total_episodes=8))
    finally:
        torch.set_num_threads(threads)
    assert rows[0]["rm_score"] == single[0]["rm_score"]  # the same rollout
    for key in UPDATE:
        assert rows[0][key] == pytest.approx(single[0][key], rel=1e-4, abs=1e-6), key
