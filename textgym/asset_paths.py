"""The embedded models and prompt files: where each one is, and the names prompt sets go by.

The folders are Hugging Face model folders in ``textgym/assets``, built by the scripts there
(``python -m textgym.assets.build``, ``build_arithmetic``, ``build_arith_proxy``); the prompt files
hold one prompt per line. Only paths here: the env, the models and the reward models import this
module, never the ``textgym.assets`` package, whose build scripts import them (no folder cycle).
"""

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_LM = ASSETS / "lm"
DEFAULT_RM = ASSETS / "rm"
DEFAULT_PROMPTS = ASSETS / "data" / "prompts_train.txt"
EVAL_PROMPTS = ASSETS / "data" / "prompts_eval.txt"
ARITH_LM = ASSETS / "arith_lm"  # TextArithmetic-v0's π_ref (textgym.assets.build_arithmetic)
# Its learned proxy of the verifier, reward_model="arithmetic-proxy" (textgym.assets.build_arith_proxy)
ARITH_PROXY_RM = ASSETS / "arith_proxy_rm"
ARITH_TRAIN = ASSETS / "data" / "arith_train.txt"
ARITH_EVAL = ASSETS / "data" / "arith_eval.txt"
# The held-out prompts each registered env is evaluated on (disjoint from its train prompts).
EVAL_PROMPTS_BY_ENV = {"TextRLHF-v0": EVAL_PROMPTS, "TextArithmetic-v0": ARITH_EVAL}
# Shipped prompt sets by name (``prompts="review-requests"``): the review openings as instructions to a
# chat model ('Write a short movie review that begins with "The movie".'), train and eval splits, and the
# eval openings asked in other words (written by textgym.assets.review_requests).
PROMPT_SETS = {
    "review-requests": ASSETS / "data" / "review_requests_train.txt",
    "review-requests-eval": ASSETS / "data" / "review_requests_eval.txt",
    "review-requests-reworded": ASSETS / "data" / "review_requests_reworded.txt",
    "addition-requests": ASSETS / "data" / "addition_requests_train.txt",
    "addition-requests-eval": ASSETS / "data" / "addition_requests_eval.txt",
    # a * b + c for a chat model with the calculator tool, one worked call in each prompt (multi-line: JSONL)
    "calculator-problems": ASSETS / "data" / "calculator_problems_train.jsonl",
    "calculator-problems-eval": ASSETS / "data" / "calculator_problems_eval.jsonl",
}

__all__ = [
    "ARITH_EVAL",
    "ARITH_LM",
    "ARITH_PROXY_RM",
    "ARITH_TRAIN",
    "ASSETS",
    "DEFAULT_LM",
    "DEFAULT_PROMPTS",
    "DEFAULT_RM",
    "EVAL_PROMPTS",
    "EVAL_PROMPTS_BY_ENV",
    "PROMPT_SETS",
]
