"""Re-tokenisation drift on SmolLM2 conversations: what a turn-level trainer's tokens cost against the sampled ids.

π_ref (SmolLM2-135M-Instruct, temperature 1) plays ``TextMultiTurn-v0`` episodes through
``collect_episodes`` (the guess game with the ``smollm2-guess`` presets' env settings, and arithmetic
with the calculator tool). Each conversation is then rebuilt as chat messages, rendered with the chat
template and tokenised whole, as TRL / verifiers / SkyRL do (:mod:`textgym.retokenization`). Printed and
written as JSON, never asserted:

- the share of policy turns whose re-tokenised ids differ from the sampled ids, and why;
- |Δ log π| = |log π(exact ids) − log π(re-tokenised ids)|, both fp32 teacher-forced forwards of π_ref,
  per token where the turn's ids align (common prefix and suffix) and per turn's sum; and the PPO
  ratio exp(Δ) with π_old = the re-tokenised log-probs and π_θ = the exact ones (no update);
- the noise floor beside it: aligned tokens whose whole context is identical in both streams (the same
  numbers up to kernel shapes), and the sampler's cached decode against the exact teacher-forced forward.

Usage::

    python bench/drift.py --task both --episodes 80 --seed 0 --out docs/bench/drift/drift.json
    python bench/drift.py --task calculator --calculator-prompt example --episodes 160 --seed 0 \\
        --out docs/bench/drift/calculator-example.json
    python bench/drift.py --task guess --episodes 96 --seed 0 --out docs/bench/drift/guess.json
    python bench/drift.py --table docs/bench/drift/guess.json docs/bench/drift/drift.json:calculator \\
        docs/bench/drift/calculator-example.json  # the table of docs/multi-turn.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GUESS_PRESET = ROOT / "agents" / "ppo" / "presets" / "smollm2-guess-ppo.json"
ENV_KEYS = ("model", "chat_template", "partner", "max_turn_tokens", "max_turns", "max_new_tokens")
CALC_PROMPTS = {  # the calculator's question: plainly, or with a worked call (π_ref then calls the tool sometimes)
    "plain": "What is {a} * {b} + {c}? You have a calculator: write <calc>EXPRESSION</calc> and it answers "
             "<result>VALUE</result>. When you know the answer, reply with the number only.",
    "example": "Use the calculator to compute {a} * {b} + {c}. To use it, write <calc>EXPRESSION</calc>, for example "
               "<calc>12 * 34 + 5</calc>, and it answers <result>VALUE</result>. Then reply with the number only.",
}  # fmt: skip
CLIP = 0.2  # PPO's clip range [0.8, 1.2]
EXAMPLES = 8  # turns whose text re-tokenised otherwise, kept in the JSON as (sampled, re-tokenised) token strings


def env_settings(task: str) -> dict:
    """The env of ``task``: the guess game as the smollm2-guess presets play it; the calculator with room to talk."""
    if task == "guess":
        preset = json.loads(GUESS_PRESET.read_text())
        return {k: preset[k] for k in ENV_KEYS}
    return {"model": "smollm2-135m-instruct", "chat_template": True, "partner": "calculator", "max_turn_tokens": 64,
            "max_turns": 4, "max_new_tokens": 320, "max_prompt_tokens": 112}  # fmt: skip


def calculator_prompts(n: int, seed: int, wording: str = "plain") -> list[str]:
    """``n`` seeded multi-step problems (a 3-digit product plus a sum) π_ref rarely solves without the tool."""
    rng = np.random.default_rng(seed)
    return [CALC_PROMPTS[wording].format(a=rng.integers(100, 1000), b=rng.integers(10, 100), c=rng.integers(100, 1000))
            for _ in range(n)]  # fmt: skip


def collect(task: str, episodes: int, num_envs: int, seed: int, wording: str = "plain"):
    """``episodes`` episodes of π_ref on ``task``, in batches of ``num_envs`` slots; (envs, list of TensorDicts)."""
    from textgym.episodes import collect_episodes, make_episode_envs
    from textgym.policies import LMSampler

    envs = make_episode_envs("TextMultiTurn-v0", num_envs, **env_settings(task))
    sampler = LMSampler.for_env(envs.unwrapped.model, envs, temperature=1.0, seed=seed)
    prompts = calculator_prompts(episodes, seed, wording) if task == "calculator" else None
    batches = []
    for start in range(0, episodes, num_envs):
        k = min(num_envs, episodes - start)
        batch = None if prompts is None else prompts[start : start + k]
        games = None if prompts else list(range(seed + start, seed + start + k))  # the guess game's partner seeds
        batches.append(collect_episodes(envs, sampler, num_episodes=k, prompts=batch, seed=seed + start,
                                        partner_seeds=games))  # fmt: skip
    return envs, batches


def episode_record(base, td, i: int) -> dict:
    """One episode compared turn by turn: its exact ids against the re-tokenised conversation (both fp32 forwards)."""
    from textgym.envs.turns import ReplyTemplate
    from textgym.episodes import transcript
    from textgym.retokenization import episode_messages, retokenize, teacher_forced_logprobs

    tok, P = base.tokenizer, base.max_prompt_tokens
    stop_ids, end_id = set(base.stop_token_ids), tok.convert_tokens_to_ids("<|im_end|>")
    am = td["attention_mask"][i].bool()
    exact = td["input_ids"][i][am].tolist()
    n_prompt, used = int(am[:P].sum()), int(am[P:].sum())
    mask = td["mask"][i][:used].numpy()
    template = ReplyTemplate(tok, True, stop_ids)
    messages = episode_messages(tok, template, td["prompt"][i], exact[n_prompt:], mask, stop_ids)
    if transcript(messages) != td["transcript"][i]:
        raise RuntimeError(f"episode {i}: the rebuilt messages are not the env's conversation")
    retok, rturns = retokenize(tok, messages, end_id)
    longer = max(exact, retok, key=len)
    two = longer[: min(len(exact), len(retok))] != min(exact, retok, key=len)
    # one stream a prefix of the other (no turn's body drifted): one causal forward gives both streams' log-probs
    exact_lp = teacher_forced_logprobs(base.model, exact if two else longer)
    retok_lp = teacher_forced_logprobs(base.model, retok) if two else exact_lp
    return {"exact": exact, "retok": retok, "rturns": rturns, "n_prompt": n_prompt, "mask": mask, "two_forwards": two,
            "exact_lp": exact_lp[: len(exact) - 1], "retok_lp": retok_lp[: len(retok) - 1], "stop_ids": stop_ids,
            "end_id": end_id, "sample_lp": td["sample_log_prob"][i][:used][torch.as_tensor(mask)]}  # fmt: skip


def compare_turns(tok, rec: dict) -> list[dict]:
    """Each policy turn of one episode record: its causes, per-token Δ where aligned, and its turn sums."""
    from textgym.retokenization import common_ends, drift_causes, policy_turns

    exact, retok, n0 = rec["exact"], rec["retok"], rec["n_prompt"]
    diverge = next(
        (j for j, (x, y) in enumerate(zip(exact, retok, strict=False)) if x != y), min(len(exact), len(retok))
    )
    turns = policy_turns(rec["mask"])
    if len(turns) != len(rec["rturns"]):
        raise RuntimeError(f"{len(turns)} policy turns but {len(rec['rturns'])} assistant turns re-tokenised")
    out = []
    for (a, b), rt in zip(turns, rec["rturns"], strict=True):
        s, r = exact[n0 + a : n0 + b], retok[rt.start : rt.end]
        causes = drift_causes(tok, s, r, stop_ids=rec["stop_ids"], end_id=rec["end_id"],
                              crosses_boundary=rt.crosses_boundary, text_changed=rt.text_changed)  # fmt: skip
        p, q = common_ends(s, r)
        pairs = [(n0 + a + j, rt.start + j) for j in range(p)]
        pairs += [(n0 + b - 1 - j, rt.end - 1 - j) for j in range(q)]
        delta = [float(rec["exact_lp"][pe - 1] - rec["retok_lp"][pr - 1]) for pe, pr in pairs]
        # every earlier id equal in both streams, and both forwards run: what is left is numerical noise
        same = [rec["two_forwards"] and pe == pr and pe <= diverge for pe, pr in pairs]
        other = [not (pe == pr and pe <= diverge) for pe, pr in pairs]
        added = "no_end_token" in causes and r[-1:] == [rec["end_id"]]  # the end token the trainer adds to a cut turn
        end = rt.end - 1 if added else rt.end
        shown = {"sampled": tok.convert_ids_to_tokens(s), "retokenized": tok.convert_ids_to_tokens(r), "causes": causes}
        out.append({"causes": causes, "delta": delta, "same_context": same, "context_differs": other, "shown": shown,
                    "phantom_end_logprob": float(rec["retok_lp"][rt.end - 2]) if added else None,
                    "unaligned": len(s) - p - q, "exact_sum": float(rec["exact_lp"][n0 + a - 1 : n0 + b - 1].sum()),
                    "retok_sum": float(rec["retok_lp"][rt.start - 1 : end - 1].sum())})  # fmt: skip
    return out


def summarise(turns: list[dict], noise: torch.Tensor, episodes: int) -> dict:
    """The task's numbers from its turns: differing share and causes, token and turn Δ, the PPO ratio, the noise."""
    from textgym.agents.evaluate import wilson_interval
    from textgym.retokenization import CAUSES, ratio_stats

    n, differ = len(turns), sum(bool(t["causes"]) for t in turns)
    causes = {c: sum(c in t["causes"] for t in turns) for c in CAUSES}
    tokens = [
        (d, s, o) for t in turns for d, s, o in zip(t["delta"], t["same_context"], t["context_differs"], strict=True)
    ]

    def stats(keep) -> dict | None:
        d = [x for x, s, o in tokens if keep(s, o)]
        return ratio_stats(torch.tensor(d), CLIP) if d else None

    turn_delta = torch.tensor([t["exact_sum"] - t["retok_sum"] for t in turns], dtype=torch.float64)
    body = torch.tensor([any(c != "no_end_token" for c in t["causes"]) for t in turns])
    phantom = [t["phantom_end_logprob"] for t in turns if t["phantom_end_logprob"] is not None]
    return {"episodes": episodes, "turns": n, "turns_differing": differ, "turns_differing_share": differ / n,
            "turns_differing_wilson95": wilson_interval(differ, n), "causes": causes,
            "body_differs": int(body.sum()), "tokens_sampled": sum(len(t["delta"]) + t["unaligned"] for t in turns),
            "tokens_unaligned": sum(t["unaligned"] for t in turns),
            "tokens_aligned": stats(lambda s, o: True), "tokens_aligned_context_differs": stats(lambda s, o: o),
            "tokens_aligned_same_context": stats(lambda s, o: s),
            "turns_sum": ratio_stats(turn_delta, CLIP),
            "turns_sum_body_differs": ratio_stats(turn_delta[body], CLIP) if body.any() else None,
            "phantom_end_logprob_mean": float(np.mean(phantom)) if phantom else None,
            "phantom_end_logprob_min": float(np.min(phantom)) if phantom else None,
            "noise_sampler_vs_teacher_forced": ratio_stats(noise, CLIP),
            "examples": [t["shown"] for t, b in zip(turns, body.tolist(), strict=True) if b][:EXAMPLES]}  # fmt: skip


def run_task(task: str, episodes: int, num_envs: int, seed: int, wording: str = "plain") -> dict:
    """Collect, compare and summarise one task; with its timings."""
    start = time.perf_counter()
    envs, batches = collect(task, episodes, num_envs, seed, wording)
    sampled = time.perf_counter()
    base, turns, noise = envs.unwrapped, [], []
    for td in batches:
        for i in range(td.batch_size[0]):
            rec = episode_record(base, td, i)
            turns += compare_turns(base.tokenizer, rec)
            policy = rec["n_prompt"] + np.flatnonzero(rec["mask"])  # exact positions of the policy's tokens
            noise.append(rec["exact_lp"][torch.as_tensor(policy - 1)] - rec["sample_lp"])
    envs.close()
    out = summarise(turns, torch.cat(noise), episodes)
    out["env"] = env_settings(task)
    if task == "calculator":
        out["prompt"] = CALC_PROMPTS[wording]
    out["seconds"] = {"sampling": sampled - start, "comparing": time.perf_counter() - sampled}
    return out


def _machine() -> dict:
    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()

    commit = sh(f"git -C {ROOT} rev-parse --short HEAD") + (
        " (dirty)" if sh(f"git -C {ROOT} status --porcelain") else ""
    )
    return {"cpu": sh("lscpu | grep 'Model name' | sed 's/.*: *//'") or platform.processor(), "cores": os.cpu_count(),
            "load_at_start": os.getloadavg(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "commit": commit}  # fmt: skip


def _fmt(s: dict | None) -> str:
    if s is None:
        return "-"
    return (f"{s['tokens']:5d} tok  |Δ| mean {s['abs_delta_mean']:.2e} max {s['abs_delta_max']:.2e}  "
            f"|r-1| mean {s['abs_ratio_minus_1_mean']:.2e}  outside clip {s['outside_clip_share']:.3f}  "
            f"r in [{s['ratio_min']:.3g}, {s['ratio_max']:.3g}]")  # fmt: skip


def report(task: str, r: dict) -> None:
    """Print one task's numbers."""
    lo, hi = r["turns_differing_wilson95"]
    print(f"\n== {task}: {r['episodes']} episodes, {r['turns']} policy turns "
          f"(sampling {r['seconds']['sampling']:.0f} s, comparing {r['seconds']['comparing']:.0f} s)")  # fmt: skip
    print(f"turns whose re-tokenised ids differ: {r['turns_differing']} = {r['turns_differing_share']:.1%} "
          f"[{lo:.1%}, {hi:.1%}]; body differs (beyond the end token): {r['body_differs']}")  # fmt: skip
    print(f"policy tokens sampled {r['tokens_sampled']}, of them not aligned with a re-tokenised one "
          f"{r['tokens_unaligned']}")  # fmt: skip
    for cause, count in r["causes"].items():
        print(f"  {cause:22s} {count:4d}")
    for key in ("tokens_aligned", "tokens_aligned_context_differs", "tokens_aligned_same_context", "turns_sum",
                "turns_sum_body_differs", "noise_sampler_vs_teacher_forced"):  # fmt: skip
        print(f"{key:32s} {_fmt(r[key])}")
    if r["phantom_end_logprob_mean"] is not None:
        print(f"log π of the end token added to cut turns: mean {r['phantom_end_logprob_mean']:.2f}, "
              f"min {r['phantom_end_logprob_min']:.2f}")  # fmt: skip


def _cell(s: dict | None, *keys: str) -> str:
    """A table cell: ``keys`` of the ratio statistics ``s`` (``-`` when there were no tokens)."""
    if s is None:
        return "-"
    shown = {"tokens": "{:d}", "abs_delta_mean": "{:.2e}", "abs_delta_max": "{:.2e}",
             "abs_ratio_minus_1_mean": "{:.2e}", "outside_clip_share": "{:.1%}", "ratio_min": "{:.3g}",
             "ratio_max": "{:.3g}"}  # fmt: skip
    return " / ".join(shown[k].format(s[k]) for k in keys)


def columns(sources: list[str], root: Path = Path()) -> dict[str, dict]:
    """The tasks of written JSON files (``PATH`` or ``PATH:TASK``, relative to ``root``) as table columns, the
    calculator's named by its prompt's wording."""
    out = {}
    for source in sources:
        path, _, only = source.partition(":")
        results = json.loads((root / path).read_text())
        wording = results["args"].get("calculator_prompt", "plain")  # runs before the option asked plainly
        for task, r in results["tasks"].items():
            if only in ("", task):
                out[task if task == "guess" else f"{task}, {wording} prompt"] = r
    return out


def table(tasks: dict[str, dict]) -> str:
    """The docs' markdown table of written results ``{column: a task's numbers}``: never typed by hand."""
    rows = [("episodes / policy turns", lambda r: f"{r['episodes']} / {r['turns']}"),
            ("turns whose re-tokenised ids differ (Wilson 95 %)", lambda r: "{:.1%} [{:.1%}, {:.1%}]".format(
                r["turns_differing_share"], *r["turns_differing_wilson95"])),
            ("… beyond the end token (the text re-tokenised otherwise)", lambda r: str(r["body_differs"]))]  # fmt: skip
    rows += [(f"cause: `{c}`", lambda r, c=c: str(r["causes"][c])) for c in next(iter(tasks.values()))["causes"]]
    rows += [("policy tokens sampled / without an aligned re-tokenised token",
              lambda r: f"{r['tokens_sampled']} / {r['tokens_unaligned']}"),
             ("log π of the end token added to cut turns: mean / min", lambda r: "-" if r["phantom_end_logprob_mean"]
              is None else f"{r['phantom_end_logprob_mean']:.2f} / {r['phantom_end_logprob_min']:.2f}"),
             ("aligned tokens: n / mean abs Δ / max abs Δ",
              lambda r: _cell(r["tokens_aligned"], "tokens", "abs_delta_mean", "abs_delta_max")),
             ("aligned tokens: mean abs(ratio − 1) / outside [0.8, 1.2] / max ratio",
              lambda r: _cell(r["tokens_aligned"], "abs_ratio_minus_1_mean", "outside_clip_share", "ratio_max")),
             ("… whose context drifted (earlier in the turn or before): n / mean abs Δ / outside clip / ratio range",
              lambda r: _cell(r["tokens_aligned_context_differs"], "tokens", "abs_delta_mean", "outside_clip_share",
                              "ratio_min", "ratio_max")),
             ("turns whose text drifted: n / mean / max abs Δ of the turn's Σ log π",
              lambda r: _cell(r["turns_sum_body_differs"], "tokens", "abs_delta_mean", "abs_delta_max")),
             ("noise: same ids and context, two forwards: n / max abs Δ",
              lambda r: _cell(r["tokens_aligned_same_context"], "tokens", "abs_delta_max")),
             ("noise: sampler's cached decode vs teacher-forced: mean / max abs Δ",
              lambda r: _cell(r["noise_sampler_vs_teacher_forced"], "abs_delta_mean", "abs_delta_max"))]  # fmt: skip
    lines = ["| | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f(r) for r in tasks.values()) + " |" for name, f in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=128, help="episodes per task")
    parser.add_argument("--task", choices=("guess", "calculator", "both"), default="both")
    parser.add_argument(
        "--seed", type=int, default=0, help="sampling seed; also the partner seeds' and problems' start"
    )
    parser.add_argument("--num-envs", type=int, default=16, help="episode slots sampled together")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    parser.add_argument("--calculator-prompt", choices=sorted(CALC_PROMPTS), default="plain", help="its wording")
    parser.add_argument("--table", nargs="+", default=None, metavar="PATH[:TASK]",
                        help="only print the markdown table of these JSONs (a column per file and task)")  # fmt: skip
    args = parser.parse_args()
    if args.table is not None:
        print(table(columns(args.table)))
        return
    torch.set_num_threads(args.threads)
    results = {"machine": _machine(), "args": {k: str(v) for k, v in vars(args).items()}, "clip": CLIP, "tasks": {}}
    print(json.dumps(results["machine"]))
    for task in ("guess", "calculator") if args.task == "both" else (args.task,):
        results["tasks"][task] = r = run_task(task, args.episodes, args.num_envs, args.seed, args.calculator_prompt)
        report(task, r)
    results["machine"]["load_at_end"] = os.getloadavg()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
