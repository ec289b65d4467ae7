"""What stops a run before it saves something wrong or asks for more than the machine has.

Three guards the trainer calls: non-finite numbers (a loss, a gradient, a weight) refuse the update
or the save, so the last good checkpoint stays the run's; a batch whose rollout and update cannot
fit in memory is refused before the run folder is touched, with the estimate; SIGTERM stops a run as
Ctrl-C does, so the caller can say what the run folder holds.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from textgym import memory

__all__ = ["NonFiniteError", "Stopped", "check_finite", "check_finite_weights", "check_memory",
           "estimate_rollout_bytes", "first_non_finite", "stop_on_sigterm"]  # fmt: skip


class NonFiniteError(FloatingPointError):
    """A loss, gradient, reward or weight of the run is NaN or infinite: the update or save is refused."""


def first_non_finite(named: Mapping[str, torch.Tensor | float | None]) -> tuple[str, float] | None:
    """The first ``(name, value)`` of ``named`` (in its order) that is not finite, or None when all are."""
    for name, value in named.items():
        if value is None:
            continue
        tensor = torch.as_tensor(value).detach()
        if not bool(torch.isfinite(tensor).all()):
            bad = tensor[~torch.isfinite(tensor)].reshape(-1)[0]
            return name, float(bad)
    return None


def check_finite(named: Mapping[str, torch.Tensor | float | None], iteration: int, what: str) -> None:
    """Raise :class:`NonFiniteError` naming the first non-finite quantity of ``named``.

    Args:
        named: quantities in the order they are computed (the first bad one is the cause).
        iteration: the iteration being computed (1-based), named in the message.
        what: what is refused (``"the update"``, ``"the save"``).
    """
    bad = first_non_finite(named)
    if bad is not None:
        name, value = bad
        raise NonFiniteError(
            f"iteration {iteration}: the {name} is {value} (not finite); {what} refused, so nothing non-finite "
            "reaches a checkpoint: the run folder keeps its last good checkpoint. Lower learning_rate or "
            "max_grad_norm, or check the reward model's scores"
        )


def check_finite_weights(models: Mapping[str, torch.nn.Module], iteration: int) -> None:
    """Refuse to save models with a non-finite weight, naming the model and the tensor."""
    for model_name, model in models.items():
        for key, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise NonFiniteError(
                    f"iteration {iteration}: the {model_name} weight {key} is not finite; it is not saved, and "
                    "the run folder keeps its last good checkpoint"
                )


# ---------------------------------------------------------------------- memory
# The estimate is a lower bound (models, optimizer and the update's activations not counted): one
# smollm2-guess-grpo iteration peaked at 11 times it (4.42 GiB against 0.40), the tiny preset's at far more
# (the libraries alone are 0.85 GiB). A batch is refused when 10 times it would not fit: past the machine's
# memory whatever is free (the answer depends on the machine, not the moment), or past the memory free now.
PEAK_OVER_ESTIMATE = 10


def _model_dims(cfg) -> dict[str, int] | None:
    """Layers, KV width and vocabulary of the run's π_ref from its ``config.json`` (no weights load), or None."""
    import gymnasium as gym
    from transformers import AutoConfig

    from textgym.models import DEFAULT_LM
    from textgym.named_models import resolve_named_model

    model = cfg.model or gym.spec(cfg.env_id).kwargs.get("model") or DEFAULT_LM
    try:
        model = resolve_named_model(str(model)) or str(model)  # a name (smollm2-135m-instruct): its folder
        config = AutoConfig.from_pretrained(model, local_files_only=True)  # a folder, or a hub id in the local cache
        config = getattr(config, "text_config", None) or config
        return {"layers": config.num_hidden_layers, "kv_width": memory.kv_width(config), "vocab": config.vocab_size}
    except Exception:  # an unreadable config: the model's own load will name the problem
        return None


def check_memory(cfg, prompt_block: int | None = None) -> None:
    """Refuse a batch whose rollout and update would not fit in memory, with the margin the estimate leaves out.

    The estimate times ``PEAK_OVER_ESTIMATE`` (the measured peak) is held against the machine's memory
    (refused whatever is free now) and against the memory free now. ``prompt_block``: the env's, once it is
    built (before: ``max_prompt_tokens`` if given, else none counted).

    Raises:
        ValueError: naming ``num_envs``, the estimate, the peak it implies and the memory it was held against.
    """
    need = estimate_rollout_bytes(cfg, prompt_block)
    if need is None:
        return
    peak = need * PEAK_OVER_ESTIMATE
    over = memory.exceeded(peak)
    if over is None:
        return
    limit = over[0]
    raise ValueError(
        f"num_envs={cfg.num_envs} needs about {need / 2**30:.2f} GiB for its rollout caches, a lower bound: with "
        f"the models, optimizer and the update's activations a run's peak was about {PEAK_OVER_ESTIMATE} times it, "
        f"{peak / 2**30:.2f} GiB, more than {limit}; lower num_envs"
    )


def estimate_rollout_bytes(cfg, prompt_block: int | None = None) -> int | None:
    """A lower bound of the memory ``cfg``'s batch takes in this process, or None when the model is unknown.

    Counted per slot: the sampler's KV cache (K and V of every layer over the prompt block's and the
    response's columns, bf16 under autocast: 2 bytes, 4 with ``precision="fp32"``) and the next-token
    logits of the env and the sampler (float32). Not counted: π_ref's cache (the trainer's collector
    scores π_ref once per episode, without one), the update's logits (the LM head runs in tiles of
    ``textgym.token_logprobs.CHUNK_BYTES``), models, optimizer and activations: a refusal never stops a
    run that would fit.
    """
    dims = _model_dims(cfg)
    if dims is None:
        return None
    block = prompt_block or cfg.max_prompt_tokens or 1  # at least BOS
    columns = block + cfg.max_new_tokens + 1  # the sampler's ring: max_len + 1
    kv = memory.kv_cache_bytes(dims["layers"], dims["kv_width"], columns, 4 if cfg.precision == "fp32" else 2)
    per_slot = 0 if cfg.num_workers else kv + 2 * dims["vocab"] * 4  # with Ray workers the rollout runs there
    return cfg.num_envs * per_slot


# ---------------------------------------------------------------------- SIGTERM
class Stopped(KeyboardInterrupt):
    """The run was stopped by a signal (SIGTERM); a KeyboardInterrupt so no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_sigterm(grace: float = 30.0) -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Stopped` and Ctrl-C KeyboardInterrupt, each arming a stack dump.

    Why: the default SIGTERM ends the process at once, with no word of what the run folder holds;
    an exception unwinds through the trainer's ``finally`` blocks (the lock, the Ray workers) and
    lets the caller report the last checkpoint. A stop that does not finish unwinding within
    ``grace`` seconds (one Ctrl-C in a fault trial hung over a minute) prints every thread's stack
    to stderr, so the hang can be found. Only in the main thread, and only for signals whose
    handler is still Python's default.
    """
    defaults = {signal.SIGTERM: (signal.SIG_DFL, None), signal.SIGINT: (signal.default_int_handler,)}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = [s for s, default in defaults.items() if signal.getsignal(s) in default]

    def handler(signum: int, frame: Any) -> None:
        faulthandler.dump_traceback_later(grace, exit=False, file=sys.stderr)
        raise Stopped(signum) if signum == signal.SIGTERM else KeyboardInterrupt

    previous = {s: signal.signal(s, handler) for s in ours}
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()  # unwound in time: no stack dump
        for s, old in previous.items():
            signal.signal(s, old)
