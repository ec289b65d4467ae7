"""Model builders of the PPO agent: actor, critic, and the TorchRL modules and loss around them.

The four models of the seed: π_ref and r_φ live in the environment (frozen); the agent owns
the actor (policy, initialised from π_ref) and the critic (value model, initialised from the
reward model's backbone with a fresh per-token scalar head, zero-initialised, as in the N+
implementation details).

Data layout of the update: a TensorDict of batch size ``(B, T)``, one row per episode and one
column per response token. ``sequence``/``sequence_mask`` hold the finished episode in the
env's observation layout (``(B, T, L)``, expanded — not copied — along T), so the actor and the
critic run ONE forward per sequence and return all T per-token outputs at once.
"""

from __future__ import annotations

import copy
import logging

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss

from textgym.episodes import make_episode_envs
from textgym.functional import position_ids_from_mask, unpack_mask
from textgym.models import quiet_peft, response_logits, use_fp32_attention
from textgym.policies import restrict_logits

from .config import PPOConfig

log = logging.getLogger(__name__)

__all__ = [
    "TokenLogits",
    "TokenValues",
    "make_actor",
    "make_critic",
    "make_envs",
    "make_lora_actor",
    "make_loss",
    "make_policy",
    "ppo_diagnostics",
    "trainable",
]


def _first_step(seq: torch.Tensor) -> torch.Tensor:
    """(B, T, L) expanded along T → (B, L); already (B, L) passes through."""
    return seq[:, 0] if seq.dim() == 3 else seq


class TokenLogits(nn.Module):
    """Wraps the whole policy LM: the logits of every response token from one teacher-forced forward.

    Returns ``(B, T, V)`` logits (divided by the sampling temperature): the logit at column
    ``P − 1 + t`` is the distribution of response token t (the off-by-one between logits and
    tokens). Given ``kept`` ``(B, T, W)``, the packed top-k/top-p sets the sampler drew each token
    from, the logits outside them are at the lowest float: the update's distribution is the
    sampler's, the sampled token always inside it.
    """

    def __init__(self, model: nn.Module, prompt_len: int, temperature: float = 1.0):
        super().__init__()
        self.model = model
        self.prompt_len = prompt_len
        self.temperature = temperature

    def forward(
        self, sequence: torch.Tensor, sequence_mask: torch.Tensor, kept: torch.Tensor | None = None
    ) -> torch.Tensor:
        ids, mask = _first_step(sequence), _first_step(sequence_mask)  # (B, L)
        logits = response_logits(self.model, ids, mask, self.prompt_len).float() / self.temperature  # (B, T, V)
        if kept is None:
            return logits
        return restrict_logits(logits, unpack_mask(kept, logits.shape[-1]))


class TokenValues(nn.Module):
    """Wraps the whole critic: V(s_t) for every response position from one forward of a token-classification model."""

    def __init__(self, model: nn.Module, prompt_len: int):
        super().__init__()
        self.model = model
        self.prompt_len = prompt_len

    def forward(self, sequence: torch.Tensor, sequence_mask: torch.Tensor) -> torch.Tensor:
        ids, mask = _first_step(sequence), _first_step(sequence_mask)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
        # state s_t ends at column P - 1 + t, like the logits of token t
        return out.logits[:, self.prompt_len - 1 : -1].float()  # (B, T, 1)


def make_envs(cfg: PPOConfig, num_envs: int, device: torch.device, env_overrides: dict | None = None):
    """The episode env of ``cfg`` with ``num_envs`` slots (the learner's, or a rollout worker's share)."""
    return make_episode_envs(cfg.env_id, num_envs, device=device, **{**cfg.env_kwargs(), **(env_overrides or {})})


def make_policy(cfg: PPOConfig, base) -> nn.Module:
    """The trainable policy over the env ``base``'s π_ref: a full copy, or LoRA adapters on π_ref itself."""
    lora = (cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank else None
    return make_lora_actor(base.model, *lora, base) if lora else make_actor(base.model)


def make_actor(ref_model: nn.Module) -> nn.Module:
    """The trainable policy: a copy of π_ref (dropout stays off: eval mode; fp32 attention under CPU autocast)."""
    policy = copy.deepcopy(ref_model)
    use_fp32_attention(policy)
    policy.requires_grad_(True)
    policy.eval()
    return policy


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer gets: all of a full model, the adapters (and head) of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


def make_lora_actor(ref_model: nn.Module, rank: int, alpha: float | None, env) -> nn.Module:
    """The policy as LoRA adapters on π_ref's own weights (peft); the env's π_ref forwards disable them.

    Why share: the base weights are the largest thing in memory, and π_ref is exactly the base
    with the adapters off. peft's B matrices start at 0, so the initial policy is π_ref.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ModuleNotFoundError(f"lora_rank={rank} needs peft: pip install 'textgym[lora]'") from err
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0, target_modules="all-linear",
                        task_type="CAUSAL_LM")  # fmt: skip
    use_fp32_attention(ref_model)  # call for call the same outside autocast, where the env's π_ref runs
    with quiet_peft():
        policy = get_peft_model(ref_model, config)  # adapters injected into ref_model's modules, only they train
    env.reference_context = policy.disable_adapter
    policy.eval()
    return policy


def _body(model: nn.Module) -> nn.Module:
    """The transformer body under a causal LM, under its peft wrapper too (adapters disabled by the caller)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model


def make_critic(reward_model, policy: nn.Module, lora: tuple[int, float | None] | None = None) -> nn.Module:
    """A per-token value model: ``AutoModelForTokenClassification`` with ``num_labels=1``.

    Its body is copied from the reward model's backbone when the reward model is a
    transformer over the policy's tokenizer, else from the policy's own body (with a warning:
    a plug-in or Python reward model has no backbone to share). The head is zero-initialised,
    so every initial value is 0. With ``lora=(rank, alpha)`` a body copied from a LoRA policy
    is frozen and gets adapters of its own (the head trains in full): no optimizer state for
    the body's weights.
    """
    from transformers import AutoModelForTokenClassification

    source = None
    if getattr(reward_model, "shares_tokenizer", False) and hasattr(reward_model, "backbone"):
        source = reward_model.backbone
    else:
        log.warning(
            "reward model %r is not a transformer sharing the policy tokenizer: "
            "the critic starts from a copy of the policy backbone",
            getattr(reward_model, "name", reward_model),
        )
        source = _body(policy)
    config = copy.deepcopy(source.config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    critic = AutoModelForTokenClassification.from_config(config)
    use_fp32_attention(critic)
    state = {k.replace(".base_layer.", "."): v for k, v in source.state_dict().items() if "lora_" not in k}
    missing, unexpected = critic.base_model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"critic backbone does not match its source: missing={missing}, unexpected={unexpected}")
    head = critic.score if hasattr(critic, "score") else critic.classifier
    nn.init.zeros_(head.weight)
    if head.bias is not None:
        nn.init.zeros_(head.bias)
    critic.to(next(policy.parameters()).device, dtype=next(policy.parameters()).dtype)
    if lora is not None and source is not getattr(reward_model, "backbone", None):
        from peft import LoraConfig, get_peft_model

        rank, alpha = lora
        head = "score" if hasattr(critic, "score") else "classifier"  # trained in full (peft's modules_to_save)
        config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0, target_modules="all-linear",
                            exclude_modules=[head], task_type="TOKEN_CLS")  # fmt: skip
        with quiet_peft():
            critic = get_peft_model(critic, config)
    critic.eval()
    return critic


def make_loss(
    policy: nn.Module,
    critic: nn.Module | None,
    prompt_len: int,
    temperature: float,
    clip_epsilon: float,
    clip_value: float | None,
    critic_coef: float,
    truncated: bool = False,
) -> tuple[ClipPPOLoss, TokenLogits]:
    """TorchRL's ``ClipPPOLoss`` over the sequence layout; ``"mask"`` excludes prompt and padding.

    Without a critic (GRPO, RLOO: the advantages come from groups) it is the clipped surrogate alone.
    ``truncated``: the rollout sampled top-k/top-p; the actor reads each token's kept set (``"kept"``).

    Returns the loss and its :class:`TokenLogits` (hook it to read the logits of the last call, for
    :func:`ppo_diagnostics` — ClipPPOLoss masks its ``loss_*`` terms, not its diagnostics — and
    for a loss-side KL term, which needs their gradient).
    """
    from torch.distributions import Categorical

    head = TokenLogits(policy, prompt_len, temperature)
    actor = ProbabilisticActor(
        TensorDictModule(head, ["sequence", "sequence_mask", *(["kept"] if truncated else [])], ["logits"]),
        in_keys=["logits"],
        distribution_class=Categorical,
        return_log_prob=True,
    )
    value = None
    if critic is not None:
        value = ValueOperator(TokenValues(critic, prompt_len), in_keys=["sequence", "sequence_mask"])
    loss = ClipPPOLoss(
        actor,
        value,
        clip_epsilon=clip_epsilon,
        entropy_bonus=False,  # the KL penalty regularises; entropy is reported (ppo_diagnostics), not a graph to build
        critic_coeff=critic_coef if critic is not None else None,
        loss_critic_type="l2",
        clip_value=clip_value if critic is not None else None,
        normalize_advantage=False,  # whitened over valid tokens before the loss (masked_whiten)
        functional=False,
    )
    loss.set_keys(sample_log_prob="sample_log_prob", action="action", value="state_value")
    loss.loss_mask_key = "mask"
    return loss, head


@torch.no_grad()
def ppo_diagnostics(
    logits: torch.Tensor, action: torch.Tensor, old_logprob: torch.Tensor, mask: torch.Tensor, clip_epsilon: float
) -> dict[str, float]:
    """approx_kl, clip_fraction and entropy over the valid tokens only.

    Args:
        logits: ``(B, T, V)`` current policy logits; action, old_logprob, mask: ``(B, T)``.

    approx_kl is E[(ρ − 1) − log ρ] (the k3 estimate of KL(π_old ‖ π_θ), as in CleanRL/TRL).
    """
    from textgym.functional import masked_mean

    logp_all = torch.log_softmax(logits.float(), dim=-1)
    log_ratio = logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1) - old_logprob
    ratio = log_ratio.exp()
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return {
        "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item(),
        "clip_fraction": masked_mean(((ratio - 1).abs() > clip_epsilon).float(), mask).item(),
        "entropy": masked_mean(entropy, mask).item(),
    }
