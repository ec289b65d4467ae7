"""Stable-Baselines3 policies for TextRLHF-v0 that start as the reference (SFT) language model.

The features extractor embeds the Dict observation's token ids with the LM body (SB3 casts Box
observations to float; the ids are cast back with ``.long()``) and returns the hidden state of
the last real token; the action head is a copy of π_ref's LM head, so the initial action
distribution is π_ref's next-token distribution; the value head is zero-initialised.

Cost: SB3 re-encodes the whole observation every step (no KV cache): one forward over
``max_prompt_tokens + max_new_tokens`` positions per token, where the TorchRL agent runs one
cached forward of one token.

For the KL-regularised objective E[score] − β·KL(π‖π_ref), train with ``ent_coef = 0`` and
:class:`textgym.agents.sb3.KLPenaltyCallback`, which subtracts β·log π_θ(a|s) of each sampled
token from its reward. ``ent_coef = β`` is not equivalent (see :mod:`textgym.agents.sb3.kl`).

The LM body stays in eval mode, also during SB3's update (no dropout): the update's log-probs
are then those the rollout stored, so PPO's first ratio is exactly 1.
"""

from __future__ import annotations

from typing import Any

import torch
from gymnasium import spaces
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

from textgym.functional import position_ids_from_mask
from textgym.models import load_causal_lm

__all__ = ["LMFeaturesExtractor", "LMPolicy", "MaskableLMPolicy"]


class LMFeaturesExtractor(BaseFeaturesExtractor):
    """Hidden state of the last real token of ``input_ids`` under a causal-LM body.

    Args:
        observation_space: the env's Dict space (``input_ids``, ``attention_mask``).
        model_path: the causal LM to start from (default: the embedded reference LM).
    """

    def __init__(self, observation_space: spaces.Dict, model_path: str | None = None):
        lm = load_causal_lm(model_path, device="cpu", name="model_path", trainable=True)
        super().__init__(observation_space, features_dim=lm.config.hidden_size)
        self.body = lm.base_model
        # kept only until the policy has copied it into its action head
        self.lm_head_weight = lm.get_output_embeddings().weight.detach().clone()

    def train(self, mode: bool = True) -> LMFeaturesExtractor:
        """Switch the mode but keep the LM body in eval mode.

        Why: SB3 calls ``policy.set_training_mode(True)`` before its update while rollouts run in
        eval mode; the body's dropout (GPT-2: 0.1) would make the update's log-probs differ from
        the stored ones, so PPO's first ratio would not be 1 (and A2C's gradient would be noisy).
        """
        super().train(mode)
        self.body.eval()
        return self

    def forward(self, observations: dict[str, torch.Tensor]) -> torch.Tensor:
        _check_token_ids(observations, self.body.get_input_embeddings().num_embeddings)
        ids = observations["input_ids"].long()  # SB3 hands Box observations over as float
        mask = observations["attention_mask"].long()
        hidden = self.body(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
        hidden = hidden.last_hidden_state  # (B, L, H)
        length = mask.shape[1]
        last = length - 1 - mask.flip(-1).argmax(-1)  # column of the last real token, (B,)
        return hidden[torch.arange(ids.shape[0], device=ids.device), last]  # (B, H)


def _check_token_ids(observations: dict[str, torch.Tensor], vocab_size: int) -> None:
    """Refuse observations that are not token ids, naming the usual cause: ``VecNormalize(norm_obs=True)``.

    Why: SB3 passes the ids as floats; a wrapper that standardises them hands over values like
    -0.37 that ``.long()`` turns into wrong or negative ids, and the embedding fails with an opaque
    ``IndexError`` (or, worse, embeds the wrong tokens).
    """
    for key, high in (("input_ids", vocab_size - 1), ("attention_mask", 1)):
        values = observations[key]
        bad = (values != values.round()) | (values < 0) | (values > high)
        if bad.any():
            raise ValueError(
                f"observations[{key!r}] holds {values[bad][0].item():.4g} (values in [{values.min().item():.4g}, "
                f"{values.max().item():.4g}]), not token ids in [0, {high}]: the observations were changed before "
                "the policy (SB3's VecNormalize(norm_obs=True), its default, standardises them as floats). Token "
                "ids are categories, not measurements: wrap the env with VecNormalize(venv, norm_obs=False) "
                "(and norm_reward=False with KLPenaltyCallback)"
            )


class _FromLM:
    """Build SB3's heads from the LM: action head = LM head, value head = 0."""

    def _build(self, lr_schedule) -> None:
        super()._build(lr_schedule)
        extractor = self.features_extractor
        with torch.no_grad():
            weight = extractor.lm_head_weight[: self.action_net.out_features]
            self.action_net.weight.copy_(weight)
            self.action_net.bias.zero_()
            nn.init.zeros_(self.value_net.weight)
            nn.init.zeros_(self.value_net.bias)
        del extractor.lm_head_weight
        # the heads changed after the optimizer was built: rebuild it over the same parameters
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)


def _lm_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    fe_kwargs = {"model_path": kwargs.pop("model_path", None), **kwargs.pop("features_extractor_kwargs", {})}
    return {
        "net_arch": [],  # latent = the LM's hidden state
        "ortho_init": False,  # orthogonal init would overwrite the LM head copy
        "features_extractor_class": LMFeaturesExtractor,
        "features_extractor_kwargs": fe_kwargs,
        "share_features_extractor": True,
        **kwargs,
    }


class LMPolicy(_FromLM, ActorCriticPolicy):
    """SB3 ``PPO``/``A2C`` policy over TextRLHF-v0 (``policy_kwargs={"model_path": ...}``)."""

    def __init__(self, observation_space, action_space, lr_schedule, **kwargs: Any):
        super().__init__(observation_space, action_space, lr_schedule, **_lm_kwargs(kwargs))


class MaskableLMPolicy(_FromLM, MaskableActorCriticPolicy):
    """sb3-contrib ``MaskablePPO`` policy; pair with ``gym.make(..., action_mask_top_p=p)`` (NLPO)."""

    def __init__(self, observation_space, action_space, lr_schedule, **kwargs: Any):
        super().__init__(observation_space, action_space, lr_schedule, **_lm_kwargs(kwargs))
