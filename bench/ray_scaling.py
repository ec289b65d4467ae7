"""Ray rollout workers on this machine: rollout tokens/s for K = 1 and 2, and the weight broadcast per iteration.

    .venv/bin/python bench/ray_scaling.py                      # embedded 3.7M model
    .venv/bin/python bench/ray_scaling.py --sync-model smollm2-135m-instruct

**Rollout**: the demo preset's rollout (24 new tokens, its precision) collected ``--iterations``
times, timed end to end as the learner sees it: ``ray.put`` of the weights, every worker loading
them and collecting its share, the shares back in the learner and concatenated. Baselines: the
demo's 64 episodes in process (``collect_episodes``) on 1 and on 2 torch threads, measured before
Ray starts. Then K = 1 and 2 workers on the same 64 episodes (strong scaling), and K = 2 with 64
episodes each (weak scaling: the batch grows with the workers). Each worker is a Ray actor with
one CPU (one torch thread); the first rollout of each setting is a warm-up and not counted.

**Weight broadcast**: for each model (the embedded LM, and ``--sync-model``), the bytes that
travel, the learner's ``ray.put`` time, and the slowest worker's load time (unpack + load into its
policy copy), over rollouts of one 1-token episode per worker so the sync dominates.
"in worker ms" is the slowest worker's own collection time: the rest of "rollout ms" is Ray's
(task dispatch, the weights, the episodes back) and the learner's concatenation.

Prints one table per part, and ratios to the in-process 1-thread rollout. Speed is measured here,
never asserted in a test.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from textgym.agents.ppo.config import PRESETS, PPOConfig  # noqa: E402
from textgym.agents.ppo.envs import make_envs  # noqa: E402
from textgym.agents.ppo.models import make_actor  # noqa: E402
from textgym.agents.ppo.ray_rollout import RolloutPool, pack_weights  # noqa: E402
from textgym.episodes import collect_episodes  # noqa: E402
from textgym.models import native_bf16  # noqa: E402
from textgym.policies import LMSampler  # noqa: E402


def demo_config(**changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["demo"], "progress": False, **changes})


def bf16_of(cfg: PPOConfig) -> bool:
    """The learner's autocast decision (``Trainer.bf16``) for a CPU run."""
    return cfg.precision == "bf16" or (cfg.precision == "auto" and native_bf16(torch.device("cpu")))


def in_process(cfg: PPOConfig, threads: int, iterations: int) -> tuple[float, float]:
    """Tokens/s and seconds per rollout in this process on ``threads`` torch threads."""
    torch.set_num_threads(threads)
    envs = make_envs(cfg, cfg.num_envs, torch.device("cpu"))
    policy = make_actor(envs.unwrapped.model)
    sampler = LMSampler.for_env(policy, envs, generator=torch.Generator().manual_seed(cfg.seed))
    bf16 = bf16_of(cfg)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else None
    kwargs = {"autocast": autocast} if autocast else {}
    tokens, seconds = 0, 0.0
    for i in range(iterations + 1):
        start = time.perf_counter()
        episodes = collect_episodes(envs, sampler, seed=cfg.seed if i == 0 else None, **kwargs)
        if i:  # the first is a warm-up
            seconds += time.perf_counter() - start
            tokens += int(episodes["mask"].sum())
    envs.close()
    torch.set_num_threads(1)
    return tokens / seconds, seconds / iterations


def with_workers(cfg: PPOConfig, iterations: int) -> dict[str, float]:
    """Tokens/s of the rollout on ``cfg.num_workers`` Ray workers, and its sync parts."""
    envs = make_envs(cfg, 1, torch.device("cpu"))
    policy = make_actor(envs.unwrapped.model)
    pool = RolloutPool(cfg, {}, torch.device("cpu"), bf16=bf16_of(cfg))
    tokens, seconds, put, load, work = 0, 0.0, [], [], []
    try:
        for i in range(iterations + 1):
            start = time.perf_counter()
            rollout = pool.launch(policy, cfg.kl_coef, None, None, cfg.seed if i == 0 else None)
            put.append(time.perf_counter() - start)
            episodes = pool.gather(rollout)
            if i:
                seconds += time.perf_counter() - start
                tokens += int(episodes["mask"].sum())
                load.append(rollout.timing["load_seconds"])
                work.append(rollout.timing["worker_seconds"])
    finally:
        pool.close()
        envs.close()
    return {"tokens_per_s": tokens / seconds, "rollout_s": seconds / iterations, "put_s": float(np.mean(put[1:])),
            "load_s": float(np.mean(load)), "worker_s": float(np.mean(work))}  # fmt: skip


def broadcast(model: str | None, workers: int, repeats: int) -> dict[str, float]:
    """The weight sync alone: rollouts of one 1-token episode per worker, new weights each time."""
    cfg = demo_config(num_envs=workers, num_minibatches=1, num_workers=workers, max_new_tokens=1, model=model,
                      normalize_reward=False)  # fmt: skip
    envs = make_envs(cfg, 1, torch.device("cpu"))
    policy = make_actor(envs.unwrapped.model)
    packed = pack_weights(policy)
    size = sum(a.nbytes for a in packed["arrays"].values())
    params = sum(p.numel() for p in policy.parameters())
    pool = RolloutPool(cfg, {}, torch.device("cpu"), bf16=bf16_of(cfg))
    put, load, total = [], [], []
    try:
        for i in range(repeats + 1):
            start = time.perf_counter()
            rollout = pool.launch(policy, cfg.kl_coef, None, None, None)
            put_s = time.perf_counter() - start
            pool.gather(rollout)
            if i:
                put.append(put_s)
                load.append(rollout.timing["load_seconds"])
                total.append(time.perf_counter() - start)
    finally:
        pool.close()
        envs.close()
    return {"params_M": params / 1e6, "MB": size / 1e6, "put_s": float(np.median(put)),
            "load_s": float(np.median(load)), "rollout_s": float(np.median(total))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=4, help="timed rollouts per setting (after one warm-up)")
    parser.add_argument("--sync-model", default="smollm2-135m-instruct",
                        help="a second, larger model for the broadcast timing ('none': skip)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="timed weight syncs per model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cfg = demo_config()
    print(f"rollout: {cfg.max_new_tokens} new tokens per episode (demo preset), bf16 autocast {bf16_of(cfg)}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    # in process first: Ray's own processes are not started yet
    rows = [(f"in process, {n} thread{'s' * (n > 1)}", cfg.num_envs, *in_process(cfg, n, args.iterations), None)
            for n in (1, 2)]  # fmt: skip
    base = rows[0][2]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for k, per_worker in ((1, 64), (2, 32), (2, 64)):  # 64 episodes on K workers, then 64 per worker
            r = with_workers(demo_config(num_workers=k, num_envs=k * per_worker), args.iterations)
            rows.append((f"Ray, K={k}, {per_worker}/worker", k * per_worker, r["tokens_per_s"], r["rollout_s"], r))
        print(f"{'setting':<26}{'episodes':>9}{'tokens/s':>10}{'x 1-thread':>12}{'rollout ms':>12}{'in worker ms':>14}"
              f"{'put ms':>9}{'load ms':>9}")  # fmt: skip
        for name, n, tps, sec, r in rows:
            sync = f"{1e3 * r['worker_s']:>14.0f}{1e3 * r['put_s']:>9.1f}{1e3 * r['load_s']:>9.1f}" if r else ""
            print(f"{name:<26}{n:>9}{tps:>10.0f}{tps / base:>12.2f}{1e3 * sec:>12.0f}{sync}")
        print("\nweight broadcast per iteration (K=2 workers, median)")
        print(f"{'model':<26}{'params M':>9}{'MB sent':>9}{'put ms':>9}{'load ms':>9}{'1-token rollout ms':>20}")
        models = [None] + ([] if args.sync_model.lower() == "none" else [args.sync_model])
        for model in models:
            r = broadcast(model, 2, args.repeats)
            print(f"{model or 'embedded LM':<26}{r['params_M']:>9.1f}{r['MB']:>9.1f}{1e3 * r['put_s']:>9.1f}"
                  f"{1e3 * r['load_s']:>9.1f}{1e3 * r['rollout_s']:>20.1f}")  # fmt: skip
        print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
