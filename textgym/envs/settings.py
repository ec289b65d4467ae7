"""What ``gym.make`` takes to build an agent's env, as one dataclass: the one list of env settings.

The agents' config (:class:`textgym.agents.ppo.PPOConfig`) is built on it, and the trainer, the
evaluator, the benchmark, the Ray workers and a saved policy's run info take the env settings from it
whole: a new env argument is added here, once, and reaches ``textgym train`` as a flag. Torch-free,
so a config is checked without loading a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from textgym.reasoning_gym_task import held_out_name

__all__ = ["ENV_FIELDS", "EnvSettings"]


@dataclass
class EnvSettings:
    """The env an agent trains in.

    Attributes:
        env_id: the registered env to train on: ``TextRLHF-v0`` (sentiment, learned RM),
            ``TextArithmetic-v0`` (verifiable "a+b=" answers) or ``TextMultiTurn-v0`` (a conversation with a
            ``partner``); its registered defaults apply.
        model: π_ref and the policy's initialisation (HF folder or id; default: the env's).
        reward_model: r_φ, by name (default embedded RM): a registered name, an HF folder or id, a URL,
            ``module:attr`` or ``reasoning-gym:<dataset>`` (that dataset's checker). A function or object is
            registered first (``textgym.rewards.register``), as the config is saved as JSON.
        gold_scorer: what ``gold_score`` measures beside the RM (the same routes; default: the env's, VADER
            for ``TextRLHF-v0``); a verifiable task names its checker here too.
        prompts: train prompts: a .txt/.jsonl file, a folder saved with datasets' save_to_disk or a cached dataset's
            name, ``NAME[:SPLIT]``, or ``reasoning-gym:<dataset>`` (its seeded train questions) (default: the env's
            set).
        prompt_column: the field of the .jsonl rows or the dataset column holding the prompts.
        eval_prompts: held-out prompts for ``eval_every`` and ``textgym eval`` of the saved policy (default: the
            held-out split of ``reasoning-gym:`` train prompts, else the env's eval split; see ``held_out_prompts``)
            (same forms as ``prompts``; default: the env's eval split; for ``reasoning-gym:<dataset>`` give
            ``reasoning-gym:<dataset>:eval``).
        chat_template: put each prompt into the tokenizer's chat template as the user turn (chat models).
        normalize_reward: standardise the RM score with its stored mean/std under π_ref (None: when
            stored). Turn it off for a policy model the stored statistics were not measured under.
        max_new_tokens: response length cap of the env (of a conversation: its tokens after the opening, the
            policy's and the partner's).
        max_prompt_tokens: the env's prompt block (None: the longest prompt, or with a partner the longest
            opening of seeds 0-3 plus a margin, ``textgym.envs.encoding.opening_margin``); give it when a game's
            opening for some seed is longer (the env's error names the width that fits).
        partner: who answers the policy in ``TextMultiTurn-v0``, by name: ``"textarena:<GameId>"``,
            ``"guess-the-number-10"``, ``"calculator"``, ``module:attr`` or an entry point (see
            :mod:`textgym.partners`); None: one turn.
        max_turns: the policy's turns per conversation (None: until the partner ends it or tokens run out).
        max_turn_tokens: the policy's tokens per turn (None: ``max_new_tokens`` bounds it).
        partner_timeout: seconds the env waits for a partner's reset or reply before the run stops with an error
            naming the partner and the slot (None: wait forever).
        missing_eos_penalty: env penalty for responses that reach the length cap without a stop token.
        reward_timeout: seconds the env waits for each reward-model call before the run stops with an error
            naming the model (None: wait forever). Generous: a large RM on a CPU scores a batch in seconds.
    """

    env_id: str = "TextRLHF-v0"
    model: str | None = None
    reward_model: str | None = None
    gold_scorer: str | None = None
    prompts: str | None = None
    prompt_column: str = "prompt"
    eval_prompts: str | None = None
    chat_template: bool = False
    normalize_reward: bool | None = None
    max_new_tokens: int = 32
    max_prompt_tokens: int | None = None
    partner: str | None = None
    max_turns: int | None = None
    max_turn_tokens: int | None = None
    partner_timeout: float | None = None
    missing_eos_penalty: float = 0.0
    reward_timeout: float | None = 300.0

    def check_env_settings(self) -> None:
        """The numbers an env would refuse, refused before any model is loaded (the env checks the rest)."""
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens!r} must be an int >= 1 or None (the env's)")
        if not math.isfinite(self.missing_eos_penalty) or self.missing_eos_penalty < 0:
            raise ValueError(f"missing_eos_penalty={self.missing_eos_penalty!r} must be a finite float >= 0")
        for name in ("reward_timeout", "partner_timeout"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a finite float > 0 (seconds) or None")

    def env_settings(self) -> EnvSettings:
        """These settings alone (of a config built on them), to pass on whole."""
        return EnvSettings(**{name: getattr(self, name) for name in ENV_FIELDS})

    def env_kwargs(self) -> dict[str, Any]:
        """The ``gym.make`` arguments these settings set (those left at None, the env's defaults, left out)."""
        kwargs = {"max_new_tokens": self.max_new_tokens, "missing_eos_penalty": self.missing_eos_penalty,
                  "reward_timeout": self.reward_timeout}  # fmt: skip
        optional = ("model", "reward_model", "gold_scorer", "prompts", "partner", "max_turns", "max_turn_tokens",
                    "partner_timeout", "max_prompt_tokens", "normalize_reward")  # fmt: skip
        kwargs |= {name: getattr(self, name) for name in optional if getattr(self, name) is not None}
        if self.prompt_column != "prompt":
            kwargs["prompt_column"] = self.prompt_column
        if self.chat_template:
            kwargs["chat_template"] = True
        return kwargs

    def held_out_prompts(self) -> str | None:
        """``eval_prompts``, else the held-out split of train prompts that have one (``reasoning-gym:X`` →
        ``reasoning-gym:X:eval``), else None (the env's eval split). Why: the env's default eval split belongs to
        its own task; a run on a reasoning-gym dataset evaluated on it would score review requests."""
        return self.eval_prompts if self.eval_prompts is not None else held_out_name(self.prompts)

    def run_info(self) -> dict[str, Any]:
        """What a saved policy's run info keeps of the env: the env id, the eval prompts and the ``gym.make``
        arguments that shape its objective; not the train prompts (a policy is evaluated on its held-out ones)
        nor the timeouts (the machine's, not the task's)."""
        info = {"env_id": self.env_id, **self.env_kwargs()}
        for name in ("prompts", "reward_timeout", "partner_timeout"):
            info.pop(name, None)
        held_out = self.held_out_prompts()
        return info | ({"eval_prompts": held_out} if held_out is not None else {})


ENV_FIELDS = tuple(f.name for f in fields(EnvSettings))
