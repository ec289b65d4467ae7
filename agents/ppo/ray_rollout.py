"""Rollout workers on Ray: K actors, each with its own TextRLHF vector env and a copy of the policy.

Each iteration the learner puts the policy's trained weights into the object store once
(``ray.put``); every worker loads them, runs :func:`textgym.episodes.collect_episodes` (the one
episode loop) on its share of the slots, and returns its episodes as a TensorDict; the learner
concatenates the shares in slot order. π_ref and the reward model live in the workers' envs.

Why the layout makes K workers behave like one process:

- slot s of the run is slot s − start of the worker that owns it, and a seeded reset seeds it with
  ``seed + s`` as the in-process env would: the same prompts whatever K;
- each worker samples with its own generator, seeded from ``(seed, worker index)``;
- every RNG a collection draws from (the slots' prompt RNGs and the sampler's generator) travels
  *with the call*: the learner sends the state a share starts from and keeps the state it ends
  in. A worker that dies mid-iteration is replaced and its share collected again from the same
  state with the same weights: the same episodes, none lost and none counted twice; and the
  states go into the checkpoint, so ``--resume`` is exact.

Ray is optional (``pip install 'textgym[ray]'``) and imported only here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from .checkpoint import expected_weights, fill_tied, load_weights
from .config import PPOConfig
from .envs import make_envs
from .models import make_policy

__all__ = ["AsyncRayRollouts", "RayRollouts", "Rollout", "RolloutPool", "RolloutWorker", "episodes_from_state",
           "episodes_to_state", "pack_weights", "slot_shares", "unpack_weights", "worker_seed"]  # fmt: skip

MAX_REPLACEMENTS = 3  # per worker and iteration: a worker that keeps dying is a bug to report, not to retry


def slot_shares(num_envs: int, num_workers: int) -> list[range]:
    """The run's slots each worker owns: contiguous, in order, sizes differing by at most one."""
    bounds = [round(i * num_envs / num_workers) for i in range(num_workers + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(num_workers)]


def worker_seed(seed: int, index: int) -> int:
    """The sampling seed of worker ``index``: derived from the run seed, distinct per worker."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


# ---------------------------------------------------------------------- weights through the object store
def pack_weights(model: torch.nn.Module) -> dict[str, Any]:
    """The trained state of ``model`` as numpy arrays (Ray hands them to every worker on a node zero-copy).

    Only what trains travels: a LoRA policy's adapters, else every weight once (a tied embedding
    and head are one tensor, sent once). bf16 tensors travel as their int16 bits.
    """
    arrays, dtypes, seen = {}, {}, set()
    for key, tensor in expected_weights(model).items():
        if tensor.data_ptr() in seen:  # tied: the worker's own tie fills it
            continue
        seen.add(tensor.data_ptr())
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor, dtypes[key] = tensor.view(torch.int16), "bfloat16"
        arrays[key] = tensor.numpy()
    return {"arrays": arrays, "dtypes": dtypes}


def unpack_weights(model: torch.nn.Module, packed: dict[str, Any]) -> None:
    """Load :func:`pack_weights`' output into ``model`` (the same architecture); strict about every key."""
    weights = {}
    with warnings.catch_warnings():  # the object store's memory is read-only: load_state_dict copies from it
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for key, array in packed["arrays"].items():
            tensor = torch.from_numpy(array)
            weights[key] = tensor.view(torch.bfloat16) if packed["dtypes"].get(key) == "bfloat16" else tensor
    expected = expected_weights(model)
    fill_tied(model, weights)
    missing, unexpected = set(expected) - set(weights), set(weights) - set(expected)
    if missing or unexpected:
        raise ValueError(f"policy weights do not fit the worker's policy: missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")  # fmt: skip
    load_weights(model, weights)


def episodes_to_state(episodes: TensorDict) -> dict[str, Any]:
    """``episodes`` as tensors and lists of str (what ``torch.load(weights_only=True)`` reads back)."""
    text = ("prompt", "response")
    return {**episodes.exclude(*text).to_dict(), **{k: list(episodes[k]) for k in text}}


def episodes_from_state(state: dict[str, Any]) -> TensorDict:
    """The inverse of :func:`episodes_to_state`."""
    from tensordict import NonTensorStack

    tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
    batch = len(state["prompt"])
    episodes = TensorDict(tensors, batch_size=[batch])
    for key in ("prompt", "response"):
        episodes[key] = NonTensorStack.from_list(list(state[key]))
    return episodes


# ---------------------------------------------------------------------- the worker (a Ray actor)
class RolloutWorker:
    """One rollout worker: a TextRLHF vector env over its share of the slots and a policy copy.

    Args:
        config: the run's ``PPOConfig`` as a dict.
        env_overrides: ``gym.make`` arguments beyond the config's (as ``Trainer.create`` takes them).
        index: the worker's index (seeds its sampler with :func:`worker_seed`).
        num_slots: its env's ``num_envs``.
        bf16: sample under bf16 autocast (the learner's decision: one precision for the whole run).
        learner_home: the folder the learner imported ``textgym`` from (:func:`package_home`): the worker
            refuses to run another copy.
    """

    def __init__(self, config: dict[str, Any], env_overrides: dict[str, Any], index: int, num_slots: int,
                 bf16: bool, learner_home: str | None = None):  # fmt: skip
        if learner_home is not None:
            check_package_home(learner_home)
        from textgym.models import resolve_device
        from textgym.policies import LMSampler
        from textgym.threads import use_threads

        cfg = PPOConfig(**config)
        device = resolve_device(cfg.device)
        # as many torch threads as CPUs Ray gave it (no oversubscription), in the run's deterministic mode:
        # the worker's sampling kernels are part of the run's numbers, as the learner's are
        use_threads(_assigned_cpus(), cfg.deterministic)
        self.envs = make_envs(cfg, num_slots, device, env_overrides)
        self.policy = make_policy(cfg, self.envs.unwrapped)
        self.policy.requires_grad_(False)  # sampling only
        generator = torch.Generator(device=device).manual_seed(worker_seed(cfg.seed, index))
        self.sampler = LMSampler.for_env(self.policy, self.envs, temperature=cfg.temperature, generator=generator,
                                         top_k=cfg.top_k, top_p=cfg.top_p)  # fmt: skip
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        self.version = -1  # the weights version loaded

    def pid(self) -> int:
        return os.getpid()

    def rng_state(self) -> dict[str, Any]:
        """The slots' prompt RNG states and the sampler's generator state."""
        return {"env": self.envs.unwrapped.rng_state(), "sampler": self.sampler.generator.get_state()}

    def collect(
        self,
        weights: dict[str, Any],
        version: int,
        beta: float,
        num_episodes: int,
        starts: dict[str, list] | None,
        seed: int | None,
        rng: dict[str, Any],
    ) -> tuple[TensorDict, dict, dict]:
        """Complete episodes on the first ``num_episodes`` slots, from RNG state ``rng`` with policy ``weights``.

        Returns:
            The episodes (``collect_episodes``' layout), its timing, and the RNG state it ends in.
        """
        from textgym.episodes import collect_episodes

        start = time.perf_counter()
        if version != self.version:
            unpack_weights(self.policy, weights)
            self.version = version
        load_seconds = time.perf_counter() - start
        self.envs.unwrapped.set_rng_state(rng["env"])
        self.sampler.generator.set_state(rng["sampler"])
        self.envs.unwrapped.kl_coef = beta
        timing: dict[str, float] = {}
        episodes = collect_episodes(self.envs, self.sampler, num_episodes=num_episodes, seed=seed,
                                    autocast=self.autocast, timing=timing, **(starts or {}))  # fmt: skip
        timing["load_seconds"] = load_seconds
        return episodes, timing, self.rng_state()

    def close(self) -> None:
        self.envs.close()


def package_home() -> str:
    """The folder ``textgym`` was imported from in this process (this module's own package root: already imported)."""
    return str(Path(sys.modules["textgym"].__file__).resolve().parent)


def check_no_shadowing_checkout() -> None:
    """Refuse, before Ray starts, a working directory whose ``textgym/`` would shadow this package on the workers.

    Raises:
        FileExistsError: naming the folder in the way, the package the learner runs, and the fix (see
            :func:`check_package_home`).
    """
    found = Path.cwd() / "textgym" / "__init__.py"
    if found.is_file() and str(found.resolve().parent) != package_home():
        raise FileExistsError(
            f"num_workers > 0 from {os.getcwd()}: its textgym/ folder would shadow the textgym this run imported "
            f"({package_home()}) on Ray's workers (Ray puts the driver's working directory first on their path); "
            "start the run from another folder"
        )


def check_package_home(learner_home: str) -> None:
    """Refuse a worker that imported another ``textgym`` than the learner did.

    Why: Ray puts the driver's working directory first on its workers' module path, so a ``textgym/``
    folder there (a checkout, perhaps of another version) shadows the installed package on the workers
    alone; they failed later with an unrelated error (the env id not registered) or would run other code.

    Raises:
        ImportError: naming both folders and the fix.
    """
    home = package_home()
    if home != learner_home:
        raise ImportError(
            f"this Ray rollout worker imported textgym from {home}, the learner from {learner_home}: the textgym/ "
            f"folder in the working directory ({os.getcwd()}) shadows the learner's package on Ray's workers (Ray "
            "puts the driver's working directory first on their path); start the run from another folder"
        )


def _assigned_cpus() -> int:
    """The CPUs Ray assigned to this actor (1 outside Ray)."""
    import ray

    if not ray.is_initialized():
        return 1
    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))


# ---------------------------------------------------------------------- the pool (learner side)
@dataclass
class _Share:
    """One worker's part of a rollout: its call's arguments (kept to call again) and its result."""

    worker: int
    args: tuple
    ref: Any = None
    result: Any = None
    attempts: int = 0


@dataclass
class Rollout:
    """A rollout in flight on the workers; :meth:`RolloutPool.gather` turns it into episodes."""

    shares: list[_Share]
    weights: Any  # the ObjectRef of the weights (kept alive until every share is back)
    beta: float
    started: float
    episodes: TensorDict | None = None
    timing: dict[str, float] = field(default_factory=dict)


class RolloutPool:
    """K :class:`RolloutWorker` actors on Ray and the RNG state each share continues from.

    Joins the cluster at ``cfg.ray_address``, or starts an embedded local one (``ray.init()``)
    when Ray is not running yet; each worker asks Ray for one CPU (one GPU when the learner runs
    on CUDA).

    Args:
        cfg: the run's config (``num_workers``, ``ray_address``, ``seed``, the env's settings).
        env_overrides: further ``gym.make`` arguments for the workers' envs.
        device: the learner's device (CUDA: each worker asks for a GPU).
        bf16: whether the learner's forwards run under bf16 autocast (the workers sample so too).
    """

    def __init__(self, cfg: PPOConfig, env_overrides: dict[str, Any], device: torch.device, bf16: bool = False):
        try:
            import ray
        except ImportError as err:
            raise ModuleNotFoundError(f"num_workers={cfg.num_workers} needs Ray: pip install 'textgym[ray]'") from err
        check_no_shadowing_checkout()
        self.ray = ray
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            num_cpus = None if cfg.ray_address else max(os.cpu_count() or 1, cfg.num_workers)
            ray.init(address=cfg.ray_address, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        self.cfg, self.env_overrides, self.bf16 = cfg, dict(env_overrides), bf16
        self.slots = slot_shares(cfg.num_envs, cfg.num_workers)
        gpus = 1 if device.type == "cuda" else 0
        self.actor_cls = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)(RolloutWorker)  # we replace the dead
        self.workers = [self._start(i) for i in range(cfg.num_workers)]
        self.rng = ray.get([w.rng_state.remote() for w in self.workers])
        self.version = 0
        self.replaced = 0  # workers replaced after dying (over the pool's life)

    def _start(self, index: int):
        return self.actor_cls.remote(self.cfg.to_dict(), self.env_overrides, index, len(self.slots[index]), self.bf16,
                                     package_home())  # fmt: skip

    # -- one rollout
    def launch(self, policy: torch.nn.Module, beta: float, num_episodes: int | None,
               starts: dict[str, list] | None, seed: int | None) -> Rollout:  # fmt: skip
        """Put ``policy``'s weights into the object store once and start every worker on its share."""
        started = time.perf_counter()
        weights = self.ray.put(pack_weights(policy))
        self.version += 1
        n = self.cfg.num_envs if num_episodes is None else num_episodes
        shares = []
        for w, slots in enumerate(self.slots):
            k = min(slots.stop, n) - slots.start
            if k <= 0:
                continue  # the rollout is shorter than the slots before this worker: its RNGs stay as they are
            part = None if starts is None else {key: list(v[slots.start : slots.start + k])
                                                for key, v in starts.items()}  # fmt: skip
            share_seed = None if seed is None else seed + slots.start  # slot s seeded with seed + s, as in process
            shares.append(_Share(w, (weights, self.version, beta, k, part, share_seed)))
        rollout = Rollout(shares, weights, beta, started)
        for share in shares:
            self._submit(share)
        return rollout

    def _submit(self, share: _Share) -> None:
        share.attempts += 1
        share.ref = self.workers[share.worker].collect.remote(*share.args, self.rng[share.worker])

    def gather(self, rollout: Rollout) -> TensorDict:
        """The rollout's episodes in slot order (waiting for them; replacing workers that died).

        Raises:
            RuntimeError: a worker died more than ``MAX_REPLACEMENTS`` times in this rollout.
        """
        if rollout.episodes is not None:
            return rollout.episodes
        waiting = {share.ref: share for share in rollout.shares}
        while waiting:
            [ref], _ = self.ray.wait(list(waiting), num_returns=1)
            share = waiting.pop(ref)
            try:
                share.result = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as err:
                self._replace(share, err)
                waiting[share.ref] = share
                continue
            self.rng[share.worker] = share.result[2]  # the state the next share of this worker starts from
        rollout.episodes = torch.cat([share.result[0] for share in rollout.shares])
        slowest = max(rollout.shares, key=lambda s: s.result[1]["seconds"]).result[1]
        rollout.timing = {"seconds": time.perf_counter() - rollout.started, "policy_seconds": slowest["policy_seconds"],
                          "worker_seconds": slowest["seconds"],
                          "load_seconds": max(s.result[1]["load_seconds"] for s in rollout.shares)}  # fmt: skip
        rollout.weights = None  # the object store may free them
        return rollout.episodes

    def _replace(self, share: _Share, err: Exception) -> None:
        """Start a new actor in place of the dead one and submit its share again from the same RNG state."""
        w = share.worker
        if share.attempts > MAX_REPLACEMENTS:
            raise RuntimeError(f"rollout worker {w} died {share.attempts} times in one iteration; last: {err}") from err
        warnings.warn(f"rollout worker {w} died ({type(err).__name__}); replaced, and its share of "
                      f"{share.args[3]} episodes collected again from the same RNG state", stacklevel=3)  # fmt: skip
        self.workers[w] = self._start(w)
        self.replaced += 1
        self._submit(share)

    # -- checkpoints
    def state(self) -> tuple[list[Any], list[torch.Tensor]]:
        """Every worker's RNG state: the slots' (JSON-able) and the samplers' (tensors)."""
        return [r["env"] for r in self.rng], [r["sampler"] for r in self.rng]

    def load_state(self, env_states: list[Any], sampler_states: list[torch.Tensor]) -> None:
        """Continue from :meth:`state`'s output (a checkpoint of a run with as many workers).

        Raises:
            ValueError: the checkpoint holds another number of workers.
        """
        if len(env_states) != len(self.workers) or len(sampler_states) != len(self.workers):
            raise ValueError(f"the checkpoint holds RNG states of {len(env_states)} rollout workers; "
                             f"this run has num_workers={len(self.workers)}")  # fmt: skip
        self.rng = [{"env": e, "sampler": s} for e, s in zip(env_states, sampler_states)]

    def close(self) -> None:
        """End the actors (and the embedded cluster, if this pool started it)."""
        for worker in self.workers:
            self.ray.kill(worker)
        self.workers = []
        if self.owns_ray:
            self.ray.shutdown()


# ---------------------------------------------------------------------- the rollout sources (see .sources)
class RayRollouts:
    """Each rollout on the pool's workers with the current weights and β; the learner waits for it.

    The workers sample with samplers of their own (seeded per worker): ``collect``'s ``sampler`` is unused.
    """

    def __init__(self, pool: RolloutPool, cfg: PPOConfig):
        self.pool, self.cfg = pool, cfg

    def collect(self, policy: torch.nn.Module, sampler, beta: float, num_episodes: int | None, seed: int | None,
                draw, timing: dict[str, float]) -> TensorDict:  # fmt: skip
        rollout = self._launch(policy, beta, num_episodes, seed, draw)
        episodes = self.pool.gather(rollout)
        timing.update(rollout.timing)
        return episodes

    def _launch(self, policy: torch.nn.Module, beta: float, num_episodes: int | None, seed: int | None,
                draw) -> Rollout:  # fmt: skip
        """Start the workers on a rollout with ``policy``'s weights and β (GRPO/RLOO: the learner's prompts)."""
        starts, seed = draw(num_episodes or self.cfg.num_envs, seed)
        return self.pool.launch(policy, beta, num_episodes, starts, seed)

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The RNG states the workers' next shares start from (JSON: the slots'; tensors: the samplers')."""
        env_states, sampler_states = self.pool.state()
        return {"worker_env_rng": env_states}, {"worker_sampler_rng": sampler_states}

    def load_state(self, ckpt, state: dict[str, Any], tensors: dict[str, Any]) -> None:
        """The workers' RNG states from ``ckpt``'s ``state``/``tensors`` (see :meth:`state`)."""
        if "worker_env_rng" not in state or "worker_sampler_rng" not in tensors:
            raise ValueError(f"checkpoint {ckpt} holds no rollout-worker RNG states (saved with num_workers=0); "
                             f"this run has num_workers={self.cfg.num_workers}")  # fmt: skip
        self.pool.load_state(state["worker_env_rng"], tensors["worker_sampler_rng"])

    def close(self) -> None:
        """End the workers (and the local Ray cluster the pool started)."""
        self.pool.close()


class AsyncRayRollouts(RayRollouts):
    """One-step asynchronous rollouts: each iteration trains on the episodes the workers collected during the
    last update (with the last iteration's weights); its own weights start the next rollout at once."""

    def __init__(self, pool: RolloutPool, cfg: PPOConfig):
        super().__init__(pool, cfg)
        self.pending: Rollout | None = None  # the next iteration's rollout, collecting while this one updates
        self.launched = 0  # rollouts started (the last iteration starts none ahead)

    def collect(self, policy: torch.nn.Module, sampler, beta: float, num_episodes: int | None, seed: int | None,
                draw, timing: dict[str, float]) -> TensorDict:  # fmt: skip
        """The rollout collected ahead (the first one now), its env rewards brought to β; the next one started.

        Raises:
            ValueError: ``num_episodes`` is not the whole batch (the next rollout is sized before it is asked for).
        """
        if num_episodes not in (None, self.cfg.num_envs):
            raise ValueError(f"num_episodes={num_episodes} with async_rollout=True: the rollout collected ahead is "
                             f"num_envs={self.cfg.num_envs} episodes; pass None or turn async_rollout off")  # fmt: skip
        start = time.perf_counter()
        rollout = self.pending if self.pending is not None else self._launch(policy, beta, None, seed, draw)
        self.pending = None
        episodes = self.pool.gather(rollout)  # waits only for what the last update did not cover
        # the env paid β_then·log π_ref per token; the reward contract r_t = β·log π_ref (+ score) at this β:
        episodes["env_reward"] = episodes["env_reward"] + (beta - rollout.beta) * episodes["ref_logprob"]
        self.launched += 1
        if self.launched < self.cfg.num_iterations:
            self.pending = self._launch(policy, beta, None, None, draw)
        timing.update(seconds=time.perf_counter() - start, policy_seconds=rollout.timing["policy_seconds"])
        return episodes

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """As :meth:`RayRollouts.state`, with the rollout already collected for the next iteration and its β."""
        if self.pending is None:
            return super().state()
        pending = episodes_to_state(self.pool.gather(self.pending))  # first: the workers' RNG states are after it
        json_state, tensors = super().state()
        return {**json_state, "pending_beta": self.pending.beta}, {**tensors, "pending_episodes": pending}

    def load_state(self, ckpt, state: dict[str, Any], tensors: dict[str, Any]) -> None:
        super().load_state(ckpt, state, tensors)
        self.launched = state["iteration"]
        self.pending = None
        if "pending_episodes" in tensors:
            episodes = episodes_from_state(tensors["pending_episodes"])
            self.pending = Rollout([], None, state["pending_beta"], 0.0, episodes, {"policy_seconds": 0.0})

    def close(self) -> None:
        self.pending = None
        super().close()
