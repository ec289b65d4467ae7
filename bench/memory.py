"""Peak memory of one PPO and one GRPO iteration per task, and what each extra token costs.

Each row runs in a process of its own (so its peak is its own): the trainer of a preset is built and
one iteration (rollout → advantages → update) runs. Printed per row: peak RSS (``ru_maxrss``; on
CUDA also ``torch.cuda.max_memory_allocated``), the iteration's wall time, its policy tokens and its
context columns. Rows:

* ``embedded``: the ``demo`` preset (the 3.7M embedded Llama, V = 2,048);
* ``smollm2-sentiment``: SmolLM2-135M-Instruct writing reviews (V = 49,152);
* ``smollm2-guess``: SmolLM2 playing GuessTheNumber (the ``smollm2-guess-ppo`` / ``-grpo`` presets);
* ``qwen0.5b-lora``: a randomly initialised Qwen2-0.5B-shaped model (24 layers, hidden 896,
  V = 151,936; no weights are needed for memory or speed) with LoRA rank 16, 16 episodes × 64 tokens.

Then the slopes: bytes the learner holds across the backward (tensors autograd saves) per extra
context token at a fixed number of policy tokens, and per extra policy token at a fixed context,
for three vocabularies, with the full-vocabulary log-softmax the learner used before issue 41 beside
the chunked head of :mod:`textgym.token_logprobs`.

Usage::

    python bench/memory.py                       # every row, then the slopes (about 30 min on 2 cores)
    python bench/memory.py --rows embedded --algos ppo --slopes-only
    python bench/memory.py --device cuda         # torch.cuda.max_memory_allocated beside the RSS
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from textgym.threads import BENCH_THREADS_HELP, cpu_name, default_threads  # noqa: E402

QWEN_SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151_936, "max_position_embeddings": 4096,
              "tie_word_embeddings": True, "rope_theta": 1_000_000.0}  # Qwen2-0.5B's config.json  # fmt: skip
QWEN_FOLDER = Path(tempfile.gettempdir()) / "textgym-qwen0.5b-shaped"
ROWS = {
    "embedded": ("demo", {}),
    "smollm2-sentiment": ("smollm2-sentiment", {"num_envs": 16}),
    "smollm2-guess": ("smollm2-guess-{algo}", {}),
    "qwen0.5b-lora": (
        None,
        {
            "model": str(QWEN_FOLDER),
            "lora_rank": 16,
            "num_envs": 16,
            "max_new_tokens": 64,
            "normalize_reward": False,
            "num_minibatches": 4,
        },
    ),  # fmt: skip
}
ALGOS = ("ppo", "grpo")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=default_threads(), help=BENCH_THREADS_HELP)
    parser.add_argument("--slopes-only", action="store_true", help="only the per-token slopes (in this process)")
    parser.add_argument("--no-slopes", action="store_true", help="only the rows")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of the embedded rows")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=JSON",
                        help="config fields over every row's, e.g. gradient_checkpointing=true")  # fmt: skip
    parser.add_argument("--one", nargs=2, metavar=("ROW", "ALGO"), help=argparse.SUPPRESS)  # a child's row
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_row(*args.one, args.device, args.threads, args.quick, overrides(args.set))))
        return
    print(f"peak memory, one iteration per row: device {args.device}, torch threads {args.threads}, "
          f"CPU {cpu_name()}{', ' + ' '.join(args.set) if args.set else ''}")  # fmt: skip
    if not args.slopes_only:
        print(f"  {'row':<20} {'algo':<5} {'peak RSS':>9} {'CUDA peak':>10} {'seconds':>8} {'policy tok':>10} "
              f"{'context':>8}  (context: mean real columns of a sequence)")  # fmt: skip
        for row in args.rows:
            for algo in args.algos:
                print_row(row, algo, child_row(row, algo, args), flush=True)
    if not args.no_slopes:
        print_slopes(args.device)


def child_row(row: str, algo: str, args) -> dict:
    """One row in a fresh process: its ``ru_maxrss`` is that row's peak alone."""
    cmd = [sys.executable, __file__, "--one", row, algo, "--device", args.device, "--threads", str(args.threads),
           "--set", *args.set]  # fmt: skip
    done = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_row(row: str, algo: str, result: dict, flush: bool = False) -> None:
    if "error" in result:
        print(f"  {row:<20} {algo:<5} failed: {result['error']}", flush=flush)
        return
    cuda = f"{result['cuda_peak_gb']:.2f} GiB" if result["cuda_peak_gb"] is not None else "-"
    print(f"  {row:<20} {algo:<5} {result['peak_rss_gb']:6.2f} GiB {cuda:>10} {result['seconds']:8.1f} "
          f"{result['policy_tokens']:>10} {result['context_columns']:>8}", flush=flush)  # fmt: skip


def overrides(pairs: list[str]) -> dict:
    """``["gradient_checkpointing=true"]`` → ``{"gradient_checkpointing": True}`` (values are JSON)."""
    return {key: json.loads(value) for key, value in (pair.split("=", 1) for pair in pairs)}


def run_row(row: str, algo: str, device: str, threads: int, quick: bool = False, extra: dict | None = None) -> dict:
    """Build the row's trainer and run one iteration; its peak RSS, CUDA peak and time."""
    from textgym.agents.ppo import PPOConfig, Trainer
    from textgym.agents.ppo.config import PRESETS

    preset, changes = ROWS[row]
    if row == "qwen0.5b-lora":
        make_qwen_shaped(QWEN_FOLDER)
    base = dict(PRESETS[preset.format(algo=algo)]) if preset else {}
    changes = {**changes, "algo": algo, **(extra or {})}
    if algo == "grpo" and "group_size" not in base:
        changes["group_size"] = 4  # 16 or 64 slots: 4 or 16 groups
    if quick:
        changes |= {"num_envs": 8, "max_new_tokens": 8, "group_size": 4, "num_minibatches": 2}
    with tempfile.TemporaryDirectory() as out:
        cfg = {**base, **changes}
        cfg |= {"total_episodes": cfg.get("num_envs", 64), "out": out, "progress": False, "eval_every": 0,
                "samples_every": 0, "device": device, "threads": threads}  # fmt: skip
        trainer = Trainer.create(PPOConfig(**cfg))
        start = time.perf_counter()
        result = trainer.iteration()
        seconds = time.perf_counter() - start
        episodes = trainer.last_episodes
        trainer.close()
    cuda = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() and device != "cpu" else None
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "cuda_peak_gb": cuda,
            "seconds": seconds, "policy_tokens": int(result["response_length"] * episodes.batch_size[0]),
            "context_columns": round(float(episodes["attention_mask"].sum(1).float().mean()))}  # fmt: skip


def make_qwen_shaped(folder: Path):
    """A randomly initialised Qwen2-0.5B-shaped causal LM and a word-level tokenizer of its 151,936 ids, saved once.

    Random weights: memory and speed depend on the shapes only. The tokenizer is a real one (every id
    decodes to a word ``t<id>``), so the env, the reward model and the logs run as with a trained model.
    """
    if (folder / "config.json").is_file():
        return folder
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"t{i}": i for i in range(2, QWEN_SHAPE["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # words joined with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN_SHAPE, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    os.replace(tmp, folder)  # whole or not at all: a killed build leaves no half folder under the name
    return folder


# ---------------------------------------------------------------------------------------------- slopes
def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``fn()`` runs (its loss's graph)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


LEARNERS = {"full": "full log-softmax", "chunked": "chunked head (now)", "checkpointed": "+ gradient_checkpointing"}


def learner_bytes(model, vocab: int, context: int, policy_tokens: int, rows: int, learner: str) -> int:
    """Saved bytes of the learner's log-probs of ``policy_tokens`` tokens a row spread over ``rows`` sequences of
    ``context`` columns: a 32-token prompt, then a response block where the rest are a partner's tokens (as in a
    conversation). ``learner``: ``full``, the full-vocabulary log-softmax over the response block (the learner before
    issue 41); ``chunked``, :func:`textgym.token_logprobs.policy_logprobs`; ``checkpointed``, that with the decoder
    layers checkpointed (``gradient_checkpointing=True``)."""
    from textgym.agents.ppo.models import set_update_mode
    from textgym.functional import position_ids_from_mask
    from textgym.models import native_bf16
    from textgym.token_logprobs import policy_logprobs

    P, device = 32, next(model.parameters()).device
    ids = torch.randint(2, vocab, (rows, context), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    select = torch.zeros(rows, context - P, dtype=torch.bool, device=device)
    select[:, torch.linspace(0, context - P - 1, policy_tokens).long()] = True

    def chunked():
        return policy_logprobs(model, ids, mask, P, select)[0].sum()

    def full_softmax():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                       logits_to_keep=context - P + 1).logits  # fmt: skip
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, P:, None]).squeeze(-1)
        return (logp * select).sum()

    set_update_mode(model, learner == "checkpointed")
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=native_bf16(device)):  # textgym's default
        return saved_bytes(full_softmax if learner == "full" else chunked)


def slope_models(device: str):
    """(name, model, V) for the three vocabularies: random weights of each shape (the slope needs no training)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    from textgym.models import DEFAULT_LM
    from textgym.named_models import resolve_named_model

    shapes = [("embedded", AutoConfig.from_pretrained(DEFAULT_LM)),
              ("smollm2-135m", AutoConfig.from_pretrained(resolve_named_model("smollm2-135m-instruct"))),
              ("qwen0.5b-shaped", Qwen2Config(**QWEN_SHAPE))]  # fmt: skip
    for name, config in shapes:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(device).requires_grad_(True)
        yield name, model, config.vocab_size


def print_slopes(device: str) -> None:
    print(
        "bytes held across the backward (saved by autograd; bf16 autocast where the CPU has it), per extra token "
        "of a sequence (4 sequences; context: a partner's tokens in the response block):"
    )
    print(f"  {'model':<16} {'V':>7} {'learner':<24} {'per context token':>18} {'per policy token':>17}")
    rows, base_ctx, base_pol = 4, 128, 16
    for name, model, vocab in slope_models(device):
        for learner, what in LEARNERS.items():
            at = {}
            for ctx, pol in ((base_ctx, base_pol), (2 * base_ctx, base_pol), (base_ctx, 2 * base_pol)):
                at[ctx, pol] = learner_bytes(model, vocab, ctx, pol, rows, learner)
            per_ctx = (at[2 * base_ctx, base_pol] - at[base_ctx, base_pol]) / (rows * base_ctx)
            per_pol = (at[base_ctx, 2 * base_pol] - at[base_ctx, base_pol]) / (rows * base_pol)
            print(f"  {name:<16} {vocab:>7} {what:<24} {per_ctx / 1024:15.1f} KiB {per_pol / 1024:14.1f} KiB",
                  flush=True)  # fmt: skip
        del model


if __name__ == "__main__":
    main()
