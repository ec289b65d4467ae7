"""A reasoning-gym dataset as a textgym task, by name: its seeded questions as prompts, its checker as the reward.

    prompts="reasoning-gym:basic_arithmetic?..."           1,000 seeded train questions ("Calculate 37 + 48.")
    eval_prompts="reasoning-gym:basic_arithmetic:eval?..."  held-out questions, none of them a train question
    reward_model="reasoning-gym:basic_arithmetic?..."      the dataset's score_answer; full credit is the verdict

The names are plain strings, so the config is saved as JSON and any process regenerates the same questions.
The run measures the held-out win rate (reasoning-gym's verdict, with its Wilson interval) beside our own
checker of a sum asked in words (``AdditionAnswerVerifier``, the gold scorer), trains GRPO on reasoning-gym's
reward and measures again. The embedded π_ref writes movie reviews and solves none of these sums, so its
reward gives GRPO nothing to learn from; a model that reads the questions does, e.g.
``--model smollm2-135m-instruct --chat-template`` (a longer run).

    pip install reasoning-gym
    python examples/reasoning_gym_verifier.py [--iterations 20] [--model smollm2-135m-instruct --chat-template]
"""

import argparse

import torch

import textgym  # noqa: F401  (registers TextRLHF-v0)
from textgym.agents.evaluate import evaluate
from textgym.agents.ppo import PPOConfig, Trainer
from textgym.policies import LMSampler

# two-term sums of numbers up to two digits, without parentheses or negation: what "a + b" asks in words
OPTIONS = "?max_terms=2&max_digits=2&operators=+&allow_parentheses=false&allow_negation=false"
TRAIN, HELD_OUT = f"reasoning-gym:basic_arithmetic{OPTIONS}", f"reasoning-gym:basic_arithmetic:eval{OPTIONS}"


def report(label: str, result: dict) -> None:
    low, high = result["win_rate_ci95"]
    print(f"{label}: win rate {result['win_rate']:.3f} [{low:.3f}, {high:.3f}] over {result['judged_episodes']} "
          f"held-out questions; reasoning-gym score {result['rm_score'][0]:.3f}, "
          f"our checker (gold) {result['gold_score'][0]:.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=20, help="GRPO iterations of --num-envs episodes")
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--eval-episodes", type=int, default=256)
    parser.add_argument("--model", default=None, help="π_ref and the policy's start (default: the embedded LM)")
    parser.add_argument("--chat-template", action="store_true", help="the question as a chat model's user turn")
    parser.add_argument("--out", default="runs/reasoning-gym")
    args = parser.parse_args()

    cfg = PPOConfig(env_id="TextRLHF-v0", model=args.model, chat_template=args.chat_template, prompts=TRAIN,
                    eval_prompts=HELD_OUT, reward_model=TRAIN, gold_scorer="addition-answer", normalize_reward=False,
                    max_new_tokens=6, algo="grpo", group_size=8, num_envs=args.num_envs, kl_coef=0.05, target_kl=None,
                    total_episodes=args.num_envs * args.iterations, learning_rate=1e-4, ppo_epochs=2,
                    num_minibatches=2, device="cpu", out=args.out, progress=False)  # fmt: skip
    held_out = {"env_id": cfg.env_id, **cfg.env_kwargs(), "prompts": HELD_OUT}
    sizes = {"episodes": args.eval_episodes, "num_envs": min(args.num_envs, args.eval_episodes)}
    report("pi_ref", evaluate(None, **held_out, **sizes))

    trainer = Trainer.create(cfg)  # the env pays reasoning-gym's score
    for _ in range(args.iterations):
        trainer.iteration()
    factory = lambda envs: LMSampler.for_env(trainer.policy, envs, generator=torch.Generator().manual_seed(0))  # noqa: E731
    report("after GRPO", evaluate(policy_factory=factory, **held_out, **sizes))


if __name__ == "__main__":
    main()
