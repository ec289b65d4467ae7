"""How the chunked LM head's time depends on its tile: forward + backward of the policy's token log-probs.

:class:`textgym.token_logprobs.HeadLogProbs` runs the head and the log-softmax over V a tile at a time (a block
of rows by a slice of the vocabulary; again in the backward). A small tile bounds the working set but runs
more, smaller matmuls; this prints seconds per call against the tile's bytes, rounds alternating, under
textgym's default precision (bf16 autocast where the CPU has it), at SmolLM2's shape (H = 576, V = 49,152)
and a Qwen2-0.5B shape (H = 896, V = 151,936), beside the full-vocabulary log-softmax (the learner before
issue 41).

    python bench/head_chunk.py [--rows 640] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from textgym.models import native_bf16
from textgym.threads import BENCH_THREADS_HELP, default_threads
from textgym.token_logprobs import head_logprobs, tile_shape

SHAPES = {"smollm2-135m": (576, 49_152), "qwen0.5b-shaped": (896, 151_936)}
BUDGETS_MIB = (1, 2, 4, 8, 16, 32)


def one_call(hidden, weight, tokens, tile: tuple[int, int] | None) -> float:
    """Seconds of one forward + backward (tile None: the full log-softmax over (rows, V) logits)."""
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_bf16(torch.device("cpu"))):
        if tile is None:
            logp = torch.log_softmax((h @ w.t()).float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
        else:
            logp, _ = head_logprobs(h, w, tokens, tile=tile)
    logp.sum().backward()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=640, help="policy tokens in the call (16 episodes x 40)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=default_threads(), help=BENCH_THREADS_HELP)
    parser.add_argument("--quick", action="store_true", help="64 rows, one round, SmolLM2's shape: a smoke run")
    args = parser.parse_args(argv)
    shapes = dict(SHAPES)
    if args.quick:
        args.rows, args.rounds, shapes = 64, 1, {"smollm2-135m": SHAPES["smollm2-135m"]}
    torch.set_num_threads(args.threads)
    print(f"{args.rows} rows, median of {args.rounds} alternating rounds, {args.threads} threads, "
          f"bf16 autocast {native_bf16(torch.device('cpu'))}")  # fmt: skip
    for name, (h, v) in shapes.items():
        g = torch.Generator().manual_seed(0)
        hidden, weight = torch.randn(args.rows, h, generator=g), torch.randn(v, h, generator=g) * 0.02
        tokens = torch.randint(0, v, (args.rows,), generator=g)
        tiles = {mib: tile_shape(args.rows, v, mib * 2**20) for mib in BUDGETS_MIB}
        chunks = {f"{mib} MiB ({r} x {c})": (r, c) for mib, (r, c) in tiles.items()}
        chunks["full log-softmax"] = None
        times: dict[str, list[float]] = {k: [] for k in chunks}
        for _ in range(args.rounds):
            for label, tile in chunks.items():
                times[label].append(one_call(hidden, weight, tokens, tile))
        best = min(statistics.median(t) for t in times.values())
        print(f"{name} (H {h}, V {v}):")
        for label, t in times.items():
            print(f"  {label:<26} {statistics.median(t):7.3f} s  {statistics.median(t) / best:5.2f}x")


if __name__ == "__main__":
    main()
