"""The decode step of each KV cache: its logits against the dynamic cache's, and its time per step at N slots.

For each N in ``--num-slots``, each decoder of :mod:`textgym.ring_decoder` that the device has
(``dynamic``, ``ring``, and ``graph`` on CUDA) runs the same schedule: N left-padded prompts of
``--prompt`` tokens, then ``--steps`` decode steps; every fourth step one slot restarts on a
context of another width (a new episode, or a conversation re-read after a partner's reply). The
script prints the largest |Δ logit| of each decoder against ``dynamic`` on the live slots, and the
median milliseconds per step (the rounds interleave the decoders; the steps of a round are timed
between device syncs). A step on a GPU that costs the same at N = 16 and N = 64 is launch-bound:
the ``graph`` row is the ring's step replayed as one CUDA graph. With ``--lora-rank R`` the model
carries peft adapters and the ``-merged`` rows run the same decoders over the rollout's merged copy
(one matmul per linear instead of three).

Usage::

    python bench/decode_step.py                                   # embedded LM, N = 16 64, CPU
    python bench/decode_step.py --model smollm2-135m-instruct --num-slots 16 64 256 --device cuda
    python bench/decode_step.py --lora-rank 16                    # peft's adapters vs the merged copy
    python bench/decode_step.py --quick                           # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import textgym  # noqa: E402,F401

# isort: split
import torch  # noqa: E402

from textgym.models import load_causal_lm, native_bf16  # noqa: E402
from textgym.ring_decoder import make_decoder  # noqa: E402
from textgym.threads import BENCH_THREADS_HELP, default_threads  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a causal LM folder or name (default: the embedded LM)")
    parser.add_argument("--num-slots", type=int, nargs="+", default=[16, 64], help="N values (default 16 64)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per slot (default 128)")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per round (default 48)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per decoder (default 3)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="bf16 autocast where the device has it natively (auto), or as given")  # fmt: skip
    parser.add_argument("--threads", type=int, default=default_threads(), help=BENCH_THREADS_HELP)
    parser.add_argument("--lora-rank", type=int, default=0, help="put LoRA adapters of this rank (B random, not 0) "
                        "on every linear and add a row for the ring over the merged copy "
                        "(agents/ppo/merged_policy.py)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="N = 2, 8 steps, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_slots, args.prompt, args.steps, args.rounds = [2], 8, 8, 1
    return args


def schedule(model, decoders: dict, n: int, prompt: int, steps: int, seed: int) -> tuple[dict, dict]:
    """Run every decoder through one schedule; return ({name: seconds per step}, {name: max |Δ| vs dynamic})."""
    vocab, device = model.config.vocab_size, next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[: n // 2, : prompt // 2] = 0  # half the slots left-padded
    for d in decoders.values():
        d.reset()
        d.prefill(torch.arange(n, device=device), ids, mask)
    length = mask.sum(1).cpu()
    seconds = dict.fromkeys(decoders, 0.0)
    diff = dict.fromkeys(decoders, 0.0)
    for t in range(steps):
        if t % 4 == 3:  # one slot starts again on a context of another width
            slot, width = torch.tensor([t % n], device=device), 2 + t % prompt
            new = torch.randint(5, vocab, (1, width), generator=g).to(device)
            for d in decoders.values():
                d.prefill(slot, new, torch.ones_like(new))
            length[t % n] = width
        tokens = torch.randint(5, vocab, (n,), generator=g).to(device)
        outs = {}
        for name, d in decoders.items():
            _sync(device)
            start = time.perf_counter()
            outs[name] = d.step(tokens)
            _sync(device)
            seconds[name] += time.perf_counter() - start
        length += 1
        live = (length <= decoders["dynamic"].max_len).nonzero().flatten().to(device)
        for name, out in outs.items():
            diff[name] = max(diff[name], float((out[live] - outs["dynamic"][live]).abs().max()))
    return {k: v / steps for k, v in seconds.items()}, diff


def with_lora(model, rank: int):
    """``model`` with LoRA adapters on every linear (B drawn, so they change the output), and its merged copy."""
    from peft import LoraConfig, get_peft_model

    from textgym.agents.ppo.merged_policy import MergedPolicy

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.01)
    peft_model.eval()
    merged = MergedPolicy(peft_model)
    merged.refresh()
    return peft_model, merged.model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = load_causal_lm(args.model, device=device)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and native_bf16(device))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    kinds = ["dynamic", "ring"] + (["graph"] if device.type == "cuda" else [])
    models = dict.fromkeys(kinds, model)
    if args.lora_rank:
        model, merged = with_lora(model, args.lora_rank)
        models = {**dict.fromkeys(kinds, model), **{f"{k}-merged": merged for k in kinds if k != "dynamic"}}
        kinds = list(models)
    print(f"decode step | model={args.model or 'embedded'} device={device} threads={torch.get_num_threads()} "
          f"{'bf16' if bf16 else 'fp32'} prompt={args.prompt} steps={args.steps} rounds={args.rounds} "
          f"lora_rank={args.lora_rank}")  # fmt: skip
    print(f"{'N':>5} {'decoder':>13} {'ms/step':>9} {'x dynamic':>9} {'max |dlogit|':>13}")
    for n in args.num_slots:
        max_len = args.prompt + args.steps
        decoders = {kind: make_decoder(kind.removesuffix("-merged"), models[kind], n, max_len) for kind in kinds}
        times = {kind: [] for kind in kinds}
        worst = dict.fromkeys(kinds, 0.0)
        with autocast:
            schedule(model, decoders, n, args.prompt, min(args.steps, 4), seed=0)  # warm-up (and the graph's capture)
            for r in range(args.rounds):
                per_step, diff = schedule(model, decoders, n, args.prompt, args.steps, seed=r + 1)
                for kind in kinds:
                    times[kind].append(per_step[kind])
                    worst[kind] = max(worst[kind], diff[kind])
        base = statistics.median(times["dynamic"])
        for kind in kinds:
            ms = statistics.median(times[kind])
            print(f"{n:>5} {kind:>13} {ms * 1e3:>9.2f} {base / ms:>9.2f} {worst[kind]:>13.2e}", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {rss:.2f} GiB" + (f", peak CUDA memory {peak:.2f} GiB" if device.type == "cuda" else ""))


if __name__ == "__main__":
    main()
