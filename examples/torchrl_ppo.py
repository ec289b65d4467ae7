"""Train on TextRLHF-v0 with TorchRL's own pieces only: GymEnv, Collector, GAE and ClipPPOLoss over an LM.

What a TorchRL user writes for any Gymnasium env, with a causal language model as the policy: the
action is the next token (``categorical_action_encoding=True``: an integer id, not a one-hot over the
vocabulary) and the observation is the padded prompt + response so far. The env pays
β·log π_ref(a_t|s_t) per token and the reward model's score at the end; subtracting β·log π(a_t|s_t) of
the sampled token makes the return that of E[score] − β·KL(π‖π_ref) (see the README). The policy
re-reads the whole observation at every step (no KV cache): simple, and slower than ``textgym train``,
which runs one cached forward per token and one teacher-forced forward per sequence in its update.

    python examples/torchrl_ppo.py [--frames 4096]
"""

import argparse
import copy

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torch.distributions import Categorical
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer, Unbounded
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.envs import GymEnv
from torchrl.envs.gym_like import default_info_dict_reader
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE
from transformers import AutoModelForCausalLM

import textgym  # noqa: F401  (registers TextRLHF-v0)
from textgym.models import DEFAULT_LM


def last_real_token(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``hidden`` (B, L, D) at each row's last real token, (B, D): the response is right-padded after it."""
    last = attention_mask.shape[-1] - 1 - attention_mask.flip(-1).argmax(-1)  # (B,)
    return hidden[torch.arange(hidden.shape[0]), last]


def as_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """(L,) observations of the collector's unbatched env as a batch of one; the position ids of left padding."""
    ids, mask = (input_ids, attention_mask) if input_ids.dim() == 2 else (input_ids[None], attention_mask[None])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)  # positions start at the first real token


class NextTokenLogits(nn.Module):
    """The LM's logits of the next token: (B, V), or (V,) for one observation."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        ids, mask, positions = as_batch(input_ids, attention_mask)
        logits = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # (B, L, V)
        out = last_real_token(logits, mask)
        return out if input_ids.dim() == 2 else out[0]


class LastTokenValue(nn.Module):
    """V(s): a zero-initialised linear head on the last real token's hidden state of an LM body."""

    def __init__(self, body: nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        ids, mask, positions = as_batch(input_ids, attention_mask)
        hidden = self.body(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        out = self.head(last_real_token(hidden, mask))  # (B, 1)
        return out if input_ids.dim() == 2 else out[0]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=4096, help="env steps (tokens) in all")
    parser.add_argument("--frames-per-batch", type=int, default=512)
    parser.add_argument("--minibatch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)

    # -- the env, as TorchRL wraps any Gymnasium env; the scores come in through TorchRL's info reader
    env = GymEnv("TextRLHF-v0", categorical_action_encoding=True, max_new_tokens=args.max_new_tokens,
                 kl_coef=args.kl_coef)  # fmt: skip
    env.set_info_dict_reader(default_info_dict_reader(["rm_score", "gold_score"],
                                                      spec=[Unbounded((), dtype=torch.float64)] * 2))  # fmt: skip
    env.set_seed(args.seed)

    # -- policy π_θ (starts as π_ref: the env's embedded LM) and critic, as TorchRL modules
    # float32 (the folder stores 16-bit weights); eval: no dropout, so the first ratio is 1
    lm = AutoModelForCausalLM.from_pretrained(DEFAULT_LM, dtype=torch.float32).eval()
    actor = ProbabilisticActor(TensorDictModule(NextTokenLogits(lm), ["input_ids", "attention_mask"], ["logits"]),
                               in_keys=["logits"], distribution_class=Categorical, return_log_prob=True,
                               log_prob_key="sample_log_prob")  # fmt: skip
    critic = ValueOperator(LastTokenValue(copy.deepcopy(lm.model), lm.config.hidden_size),
                           in_keys=["input_ids", "attention_mask"])  # fmt: skip

    # -- TorchRL's collector, advantage, loss and buffer
    collector = Collector(env, actor, frames_per_batch=args.frames_per_batch, total_frames=args.frames,
                          auto_register_policy_transforms=False)  # a feed-forward policy: no InitTracker  # fmt: skip
    # deactivate_vmap: a transformer's data-dependent attention masking cannot run under torch.vmap
    advantage = GAE(gamma=1.0, lmbda=0.95, value_network=critic, average_gae=True, deactivate_vmap=True)
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_bonus=False, critic_coeff=0.5)
    loss.set_keys(sample_log_prob="sample_log_prob")
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(args.frames_per_batch),
                                    sampler=SamplerWithoutReplacement(), batch_size=args.minibatch)  # fmt: skip
    optimizer = torch.optim.AdamW(loss.parameters(), lr=args.lr)

    for i, data in enumerate(collector):
        # -- the KL-regularised reward: the env's r_t minus β·log π(a_t|s_t) of the sampled token
        data["next", "reward"] = data["next", "reward"] - args.kl_coef * data["sample_log_prob"].unsqueeze(-1)
        with torch.no_grad():
            advantage(data)
        buffer.empty()
        buffer.extend(data.reshape(-1))
        # -- PPO epochs over minibatches of tokens
        for _ in range(args.epochs):
            for batch in buffer:
                out = loss(batch)
                total = sum(value for key, value in out.items() if key.startswith("loss_"))
                optimizer.zero_grad()
                total.backward()
                torch.nn.utils.clip_grad_norm_(loss.parameters(), 1.0)
                optimizer.step()
        collector.update_policy_weights_()
        # -- episodes that ended in this batch
        done = data["next", "done"].squeeze(-1)
        if done.any():
            print(f"batch {i}: {int(done.sum())} episodes, RM score {data['next', 'rm_score'][done].mean():+.3f}, "
                  f"gold {data['next', 'gold_score'][done].mean():+.3f}")  # fmt: skip
    collector.shutdown()


if __name__ == "__main__":
    main()
