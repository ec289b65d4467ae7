"""How often a chat model's π_ref answers sums right, for a few wordings and sizes of the question.

RL with a verifiable reward needs a π_ref that is sometimes right (GRPO learns nothing from a group
that is all wrong or all right): this samples π_ref at temperature 1 under its chat template on
held-out problems of each candidate task and prints its exact-answer accuracy under
:class:`textgym.rewards.AdditionAnswerVerifier` and how many responses commit to no answer. Printed, never asserted::

    python bench/task_accuracy.py [--model smollm2-135m-instruct] [--episodes 64] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CANDIDATES = {  # name: (digits of a and b, the question)
    "1+1 digits, number only": ((1, 1), "What is {a} + {b}? Reply with the number only."),
    "1+1 digits, plain": ((1, 1), "What is {a} + {b}?"),
    "2+2 digits, number only": ((2, 2), "What is {a} + {b}? Reply with the number only."),
    "2+2 digits, plain": ((2, 2), "What is {a} + {b}?"),
    "1+2 digits, number only": ((1, 2), "What is {a} + {b}? Reply with the number only."),
    "3+3 digits, number only": ((3, 3), "What is {a} + {b}? Reply with the number only."),
}


def measure(model: str, digits: tuple[int, int], template: str, episodes: int, max_new_tokens: int,
            seed: int) -> dict[str, float]:  # fmt: skip
    """π_ref's accuracy on ``episodes`` problems of ``digits`` asked with ``template`` (seed 1: not the sets' order)."""
    from textgym.assets.addition_requests import problems
    from textgym.rewards import AdditionAnswerVerifier
    from textgym.rewards.answers import committed_answer
    from textgym.rewards.calibrate import sample_episodes

    pool = problems(digits, None, seed=1)
    prompts = [template.format(a=a, b=b) for a, b in (pool * episodes)[:episodes]]  # small pools repeat
    rows = sample_episodes(episodes, num_envs=min(64, episodes), seed=seed, model=model, chat_template=True,
                           prompts=prompts, reward_model="addition-answer", gold_scorer="addition-answer",
                           normalize_reward=False, max_new_tokens=max_new_tokens)  # fmt: skip
    none = sum(committed_answer(r["response"], AdditionAnswerVerifier.operands(r["prompt"])) is None for r in rows)
    right = sum(r["rm_score"] for r in rows)
    return {"accuracy": right / len(rows), "no_answer": none / len(rows), "n": len(rows), "rows": rows}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="candidate names separated by ; (default: all)")
    parser.add_argument("--show", type=int, default=1, help="responses printed per candidate")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {platform.processor() or platform.machine()}; torch {torch.__version__}; threads {args.threads}; "
          f"{args.episodes} problems, temperature 1, <= {args.max_new_tokens} tokens")  # fmt: skip
    names = args.only.split(";") if args.only else list(CANDIDATES)
    for name in names:
        digits, template = CANDIDATES[name]
        start = time.perf_counter()
        m = measure(args.model, digits, template, args.episodes, args.max_new_tokens, args.seed)
        se = math.sqrt(m["accuracy"] * (1 - m["accuracy"]) / m["n"])
        print(f"{name:26s} accuracy {m['accuracy']:.3f} ± {se:.3f} (SE)  no answer {m['no_answer']:.3f}  "
              f"{time.perf_counter() - start:5.1f} s")  # fmt: skip
        for row in m["rows"][: args.show]:
            print(f"    {row['rm_score']:.0f}  {row['prompt']!r} -> {row['response'][:100]!r}")


if __name__ == "__main__":
    main()
