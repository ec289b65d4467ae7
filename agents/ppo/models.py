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
from torch.distributions import Distribution
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss

from textgym.functional import masked_mean, position_ids_from_mask
from textgym.models import quiet_peft, use_fp32_attention
from textgym.token_logprobs import cut_prompt_block, policy_logprobs

from .config import PPOConfig

log = logging.getLogger(__name__)

__all__ = [
    "ActionLogProb",
    "TokenLogProbs",
    "TokenValues",
    "make_actor",
    "make_critic",
    "make_lora_actor",
    "make_loss",
    "make_policy",
    "ppo_diagnostics",
    "set_update_mode",
    "trainable",
]


def _first_step(seq: torch.Tensor) -> torch.Tensor:
    """(B, T, L) expanded along T → (B, L); already (B, L) passes through."""
    return seq[:, 0] if seq.dim() == 3 else seq


class TokenLogProbs(nn.Module):
    """Wraps the whole policy LM: log π_θ(a_t | s_t) of every policy token from one teacher-forced forward.

    Returns ``(B, T)`` log-probs and entropies (of the tempered distribution; 0 where ``mask`` is
    False; None without ``with_entropy``: the loss's diagnostics read them, π_old does not) and the
    ``(B, T)`` tokens they are of (−1 elsewhere). Only the positions whose next token is
    a policy action meet the LM head, in chunks (:func:`textgym.token_logprobs.policy_logprobs`): no
    ``(B, T, V)`` tensor is formed, the prompt block, padding and a partner's reply cost no head. Given
    ``kept`` ``(B, T, W)``, the packed top-k/top-p sets the sampler drew each token from, the
    distribution is restricted to them: the update's distribution is the sampler's.
    """

    def __init__(self, model: nn.Module, prompt_len: int, temperature: float = 1.0):
        super().__init__()
        self.model = model
        self.prompt_len = prompt_len
        self.temperature = temperature

    def forward(self, sequence: torch.Tensor, sequence_mask: torch.Tensor, mask: torch.Tensor,
                kept: torch.Tensor | None = None,
                with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # fmt: skip
        ids, attn = _first_step(sequence), _first_step(sequence_mask)  # (B, L)
        select = mask.bool()  # (B, T)
        logp, entropy = policy_logprobs(self.model, ids, attn, self.prompt_len, select, self.temperature, kept,
                                        with_entropy)  # fmt: skip
        tokens = torch.where(select, ids[:, self.prompt_len :], -1)
        return logp, entropy, tokens


class ActionLogProb(Distribution):
    """The update's distribution seen through the one thing PPO asks of it: log π_θ of the action taken.

    TorchRL's ``ClipPPOLoss`` calls ``get_dist(td).log_prob(action)``; a ``Categorical`` over the
    logits would need all (B, T, V) of them. This holds the log-probs :class:`TokenLogProbs` computed
    for the sequence's tokens, and refuses an action that is not those tokens.
    """

    arg_constraints: dict = {}

    def __init__(self, log_prob: torch.Tensor, token: torch.Tensor):
        self._log_prob, self._token = log_prob, token
        super().__init__(batch_shape=log_prob.shape, validate_args=False)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        computed = self._token >= 0
        if value.shape != self._token.shape or not torch.equal(value[computed], self._token[computed]):
            raise ValueError(f"action of shape {tuple(value.shape)} is not the sequence's tokens "
                             f"{tuple(self._token.shape)} the log-probs were computed for")  # fmt: skip
        return self._log_prob


class TokenValues(nn.Module):
    """Wraps the whole critic: V(s_t) for every response position from one forward of a token-classification model.

    The prompt block is cut to the batch's longest prompt first (exact: see
    :func:`textgym.token_logprobs.cut_prompt_block`); the value head is one scalar per column.
    """

    def __init__(self, model: nn.Module, prompt_len: int):
        super().__init__()
        self.model = model
        self.prompt_len = prompt_len

    def forward(self, sequence: torch.Tensor, sequence_mask: torch.Tensor) -> torch.Tensor:
        ids, mask, p = cut_prompt_block(_first_step(sequence), _first_step(sequence_mask), self.prompt_len)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
        # state s_t ends at column p - 1 + t, like the log-prob of token t
        return out.logits[:, p - 1 : -1].float()  # (B, T, 1)


def set_update_mode(model: nn.Module | None, checkpointing: bool) -> None:
    """Eval mode (dropout off: N+ implementation details), with gradient checkpointing of the decoder layers if asked.

    transformers checkpoints a layer only while the layer itself is in training mode; here the layers
    alone get ``training = True`` (not their submodules), so no dropout turns on anywhere. Without
    gradients (the rollout, log π_old, the critic's old values) the layers run as they are.
    """
    if model is None:
        return
    model.train(False)
    if not checkpointing:
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"gradient_checkpointing=True: {type(model).__name__} has no transformers decoder layers "
                         "to checkpoint")  # fmt: skip
    if not layers[0].gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train(False)  # enabling may switch the model to training mode
    for layer in layers:
        layer.training = True


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
) -> tuple[ClipPPOLoss, TokenLogProbs]:
    """TorchRL's ``ClipPPOLoss`` over the sequence layout; ``"mask"`` excludes prompt, padding and a partner's tokens.

    Without a critic (GRPO, RLOO: the advantages come from groups) it is the clipped surrogate alone.
    ``truncated``: the rollout sampled top-k/top-p; the actor reads each token's kept set (``"kept"``).

    Returns the loss and its :class:`TokenLogProbs` (hook it to read the log-probs and entropies of the
    last call, for :func:`ppo_diagnostics` — ClipPPOLoss masks its ``loss_*`` terms, not its
    diagnostics — and for a loss-side KL term, which needs their gradient).
    """
    head = TokenLogProbs(policy, prompt_len, temperature)
    keys = ["sequence", "sequence_mask", "mask", *(["kept"] if truncated else [])]
    actor = ProbabilisticActor(
        TensorDictModule(head, keys, ["token_log_prob", "token_entropy", "token_id"]),
        in_keys={"log_prob": "token_log_prob", "token": "token_id"},
        distribution_class=ActionLogProb,
        return_log_prob=False,
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
    logprob: torch.Tensor, entropy: torch.Tensor, old_logprob: torch.Tensor, mask: torch.Tensor, clip_epsilon: float
) -> dict[str, float]:
    """approx_kl, clip_fraction and entropy over the valid tokens only.

    Args:
        logprob, entropy: ``(B, T)`` the current policy's log-probs of the actions and entropies
            (:class:`TokenLogProbs`); old_logprob, mask: ``(B, T)``.

    approx_kl is E[(ρ − 1) − log ρ] (the k3 estimate of KL(π_old ‖ π_θ), as in CleanRL/TRL).
    """
    log_ratio = logprob.detach() - old_logprob
    ratio = log_ratio.exp()
    return {
        "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item(),
        "clip_fraction": masked_mean(((ratio - 1).abs() > clip_epsilon).float(), mask).item(),
        "entropy": masked_mean(entropy, mask).item(),
    }
