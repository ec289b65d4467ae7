"""Every CLI command, example and bench script runs with a tiny budget (subprocesses, as a user runs them)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXTGYM = [sys.executable, "-m", "textgym.cli"]
WARNING = re.compile(r"Warning\b|^W\d{4} ", re.M)  # "UserWarning: …", torchrun's "W1202 11:32:25 …"


def run(cmd, timeout=300, quiet=False):
    """``cmd``'s stdout; it must succeed, and with ``quiet`` print no warning (Python's, or a launcher's W-line)."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert not (quiet and WARNING.search(proc.stderr)), f"{cmd} warned:\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_info():
    out = run([*TEXTGYM, "info"])
    assert "LlamaForCausalLM" in out and "Discrete(" in out and "normalised with mean" in out


def test_play():
    out = run([*TEXTGYM, "play", "--episodes", "2", "--max-new-tokens", "8"])
    assert out.count("rm_score") == 2 and "gold" in out and "KL" in out


def test_info_and_play_take_a_partner_so_pi_ref_can_be_watched_in_a_conversation():
    """Issue 42.10: play, eval and info had no --partner/--env-id."""
    out = run([*TEXTGYM, "info", "--partner", "calculator", "--max-turn-tokens", "4"])
    assert out.startswith("TextMultiTurn-v0\n")
    out = run([*TEXTGYM, "play", "--partner", "calculator", "--episodes", "2", "--max-new-tokens", "16",
               "--max-turn-tokens", "4"])  # fmt: skip
    assert out.count("partner's rewards") == 2 and "assistant:" in out


def test_eval_refuses_a_policy_that_does_not_exist_before_evaluating_pi_ref(monkeypatch, capsys):
    """Issue 42.10: eval first ran pi_ref's 128 episodes, then refused naming policy= for the --model flag."""
    from textgym.agents import evaluate
    from textgym.cli import main

    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: pytest.fail("pi_ref was evaluated first"))
    with pytest.raises(SystemExit):
        main(["eval", "--policy", "/no/such/policy"])
    assert "--policy='/no/such/policy' does not exist (no such folder)" in capsys.readouterr().err


def test_play_of_a_trained_policy_samples_it_in_its_runs_env_against_its_pi_ref(tmp_path):
    """Issue 37.9: ``play --model OUT/policy`` made the policy π_ref (KL 0.000) at the env's 32 tokens, not at 6.
    Issue 43.3: the policy is ``--policy`` (``--model`` names π_ref, as in train); ``--model OUT/policy`` still plays
    it for one version, with a FutureWarning naming ``--policy``."""
    run([*TEXTGYM, "train", "--config", "tiny", "--out", str(tmp_path / "run"), "--total-episodes", "8",
         "--learning-rate", "0.01", "--no-progress"])  # fmt: skip
    out = run([*TEXTGYM, "play", "--policy", str(tmp_path / "run" / "policy"), "--episodes", "3"], quiet=True)
    old = subprocess.run([*TEXTGYM, "play", "--model", str(tmp_path / "run" / "policy"), "--episodes", "3"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert old.returncode == 0 and old.stdout == out
    assert "FutureWarning: textgym play --model for the policy is deprecated" in old.stderr and "--policy" in old.stderr
    lengths = [int(n) for n in re.findall(r"tokens (\d+)", out)]
    kls = [float(k) for k in re.findall(r"KL (-?[\d.]+)", out)]
    assert len(lengths) == 3 and max(lengths) <= 6  # the run's length cap
    assert any(k != 0.0 for k in kls)  # the policy against the run's π_ref, not against itself


def test_train_then_eval_the_result_with_the_runs_beta_and_plot_it(tmp_path):
    """A user's first run: train, evaluate, plot (one run serves all three: the suite's time is a budget)."""
    from textgym.models import DEFAULT_LM

    run([*TEXTGYM, "train", "--config", "tiny", "--out", str(tmp_path / "run"), "--total-episodes", "16",
         "--kl-coef", "0.2", "--target-kl", "none"])  # fmt: skip
    assert (tmp_path / "run" / "policy" / "config.json").exists()
    run([sys.executable, "-m", "textgym.agents.ppo.plot", str(tmp_path / "run")])
    assert (tmp_path / "run" / "curves.png").stat().st_size > 10_000
    out = run([*TEXTGYM, "eval", "--policy", str(tmp_path / "run" / "policy"), "--model", str(DEFAULT_LM),
               "--episodes", "8", "--num-envs", "8", "--out", str(tmp_path / "eval.json")])  # fmt: skip
    assert "pi_ref:" in out and "policy:" in out
    result = json.loads((tmp_path / "eval.json").read_text())
    assert set(result) == {"pi_ref", "policy"} and len(result["policy"]["kl"]) == 2
    policy = result["policy"]
    assert policy["kl_coef"] == 0.2 and result["pi_ref"]["kl_coef"] == 0.2  # the run's β, not the env default
    assert policy["response_length"][0] <= 6  # the run's length cap
    assert policy["objective"][0] == pytest.approx(policy["score"][0] - 0.2 * policy["kl"][0])


def test_eval_of_a_run_with_eval_prompts_and_top_k_measures_both_in_the_runs_env(tmp_path):
    """Issue 26.1: π_ref's half of ``textgym eval`` gets the run's settings as the policy's half does.

    The run's ``eval_prompts`` and sampling truncation used to reach ``gym.make`` unfiltered for π_ref
    (``_Engine.__init__() got an unexpected keyword argument 'eval_prompts'``).
    """
    prompts = ["The movie", "I just saw", "The film was"]
    (tmp_path / "eval.txt").write_text("\n".join(prompts) + "\n")
    run([*TEXTGYM, "train", "--config", "tiny", "--out", str(tmp_path / "run"), "--total-episodes", "8",
         "--eval-prompts", str(tmp_path / "eval.txt"), "--top-k", "50"])  # fmt: skip
    out = run([*TEXTGYM, "eval", "--policy", str(tmp_path / "run" / "policy"), "--episodes", "6", "--num-envs", "6",
               "--out", str(tmp_path / "eval.json")])  # fmt: skip
    assert "pi_ref:" in out and "policy:" in out
    result = json.loads((tmp_path / "eval.json").read_text())
    for name in ("pi_ref", "policy"):
        assert {s["prompt"] for s in result[name]["samples"]} <= set(prompts), name  # the run's eval prompts
        assert result[name]["response_length"][0] <= 6, name  # the run's length cap


def test_train_names_only_the_folders_it_wrote(tmp_path):
    """Issue 26.6: a critic-free run has no ``value/`` folder, so ``train`` does not say it wrote one."""
    out = run([*TEXTGYM, "train", "--config", "tiny", "--algo", "grpo", "--group-size", "4", "--out",
               str(tmp_path / "run"), "--total-episodes", "8"])  # fmt: skip
    wrote = next(line for line in out.splitlines() if line.startswith("wrote "))
    named = [Path(p) for p in wrote.removeprefix("wrote ").split(", ")]
    assert {p.name for p in named} == {"metrics.jsonl", "policy", "checkpoint"}
    assert all(p.exists() for p in named) and not (tmp_path / "run" / "value").exists()


def test_the_demo_preset_trains_and_evaluates_without_a_warning(tmp_path):
    """Issue 26.5: the embedded RM's stored mean/std were measured at 32 tokens, the demo runs 24.

    The run measures them under π_ref at its own length cap (and records them, so ``eval`` pays the
    same score) instead of warning that π_ref's standardised score is not 0.
    """
    run([*TEXTGYM, "train", "--config", "demo", "--out", str(tmp_path / "run"), "--total-episodes", "8",
         "--num-envs", "8", "--no-progress"], quiet=True)  # fmt: skip
    mean, std = json.loads((tmp_path / "run" / "policy" / "textgym_run.json").read_text())["normalize_reward"]
    stored = json.loads((ROOT / "textgym" / "assets" / "rm" / "textgym_reward.json").read_text())
    assert stored["max_new_tokens"] == 32 and (mean, std) != (stored["mean"], stored["std"]) and std > 0
    run([*TEXTGYM, "eval", "--policy", str(tmp_path / "run" / "policy"), "--episodes", "8", "--num-envs", "8",
         "--no-progress"], quiet=True)  # fmt: skip


def test_a_lora_run_and_its_merged_export_print_no_warning(tmp_path):
    """Issue 26.5: peft's wrap read a property transformers 5 deprecated: a FutureWarning on every LoRA load."""
    run([*TEXTGYM, "train", "--config", "tiny", "--lora-rank", "2", "--out", str(tmp_path / "run"),
         "--total-episodes", "8"], quiet=True)  # fmt: skip
    run([*TEXTGYM, "export", str(tmp_path / "run" / "policy"), "--merge", "--out", str(tmp_path / "merged")],
        quiet=True)  # fmt: skip
    assert (tmp_path / "merged" / "model.safetensors").is_file()


def test_help_and_info_do_not_import_torchrl():
    code = (
        "import sys\nfrom textgym.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torchrl' not in sys.modules, 'help'\nmain(['info'])\nassert 'torchrl' not in sys.modules, 'info'"
    )
    assert "TextRLHF-v0" in run([sys.executable, "-c", code])


def test_bench_quick_preset(tmp_path):
    out = run([*TEXTGYM, "bench", "--quick", "--out", str(tmp_path / "bench")])
    assert "results.csv" in out and "Smoke run, not results" in out  # issue 37.9: labelled, not read as results
    table = [line for line in (tmp_path / "bench" / "results.md").read_text().splitlines() if line.startswith("|")]
    assert len(table) == 2 + 9  # header + one row per algorithm


def test_cli_errors_name_the_argument():
    proc = subprocess.run([*TEXTGYM, "play", "--model", "/no/such/model"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "model='/no/such/model'" in proc.stderr
    proc = subprocess.run([*TEXTGYM, "train", "--num-envs", "0"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "num_envs=0" in proc.stderr


@pytest.mark.parametrize(
    "cmd",
    [
        ["examples/quickstart.py"],
        ["examples/vector_rollout.py", "--num-envs", "4", "--episodes", "4"],
        [
            "examples/train_ppo.py",
            "--total-episodes",
            "8",
            "--num-envs",
            "8",
            "--max-new-tokens",
            "6",
            "--eval-episodes",
            "8",
            "--out",
            "{tmp}/ex",
        ],
        [
            "examples/custom_reward_model.py",
            "--total-episodes",
            "16",
            "--num-envs",
            "8",
            "--max-new-tokens",
            "6",
            "--out",
            "{tmp}/crm",
        ],
        ["examples/train_reward_model.py", "--samples", "32", "--epochs", "1", "--out", "{tmp}/arm"],
        ["examples/reasoning_gym_verifier.py", "--problems", "64", "--iterations", "2", "--out", "{tmp}/rg"],
        # the speed benches default to every core; beside the other test worker one thread is faster (no spinning)
        ["bench/ppo_iteration.py", "--quick", "--threads", "1"],
        ["bench/env_throughput.py", "--quick", "--threads", "1"],
        ["bench/profile_iteration.py", "--config", "tiny", "--num-envs", "4", "--max-new-tokens", "4", "--threads=1"],
        ["bench/rm_ceiling.py", "--quick", "--threads", "1"],
        ["bench/head_columns.py", "--config", "tiny", "--rounds", "1", "--threads", "1"],
        ["bench/collector_overhead.py", "--quick", "--threads", "1"],
        ["bench/head_chunk.py", "--quick", "--threads", "1"],
    ],
    ids=lambda c: Path(c[0]).stem,
)
def test_example_and_bench_scripts(cmd, tmp_path):
    out = run([sys.executable, *[c.replace("{tmp}", str(tmp_path)) for c in cmd]])
    assert out.strip()


def test_decode_step_bench_prints_each_decoders_time_and_its_gap_to_the_dynamic_cache():
    out = run([sys.executable, "bench/decode_step.py", "--quick", "--precision", "fp32", "--threads", "1"])
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.split()[:1] == ["2"]}
    assert set(rows) == {"dynamic", "ring"}  # no CUDA: no graph row
    assert float(rows["dynamic"][4]) == 0.0 and float(rows["ring"][4]) < 1e-4  # fp32: rounding only
    assert float(rows["ring"][2]) > 0 and "peak RSS" in out


def test_memory_bench_prints_a_peak_for_each_algorithm(tmp_path):
    """bench/memory.py runs each row in a process of its own and prints its peak RSS, policy tokens and context."""
    out = run([sys.executable, "bench/memory.py", "--rows", "embedded", "--quick", "--no-slopes", "--threads", "1"])
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("embedded")]
    assert [r[1] for r in rows] == ["ppo", "grpo"], out
    for r in rows:
        assert r[3] == "GiB" and 0.1 < float(r[2]) < 8 and int(r[-2]) > 0 and int(r[-1]) > 0, out


def _bench_module(name: str):
    """Import ``bench/<name>.py`` (the bench folder is not a package)."""
    import importlib

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_trl_is_timed_on_float32_models_like_textgym():
    """The assets are stored in float16: TRL's side of bench/ppo_vs_trl.py must not compute in it (10x slower)."""
    import torch

    models = _bench_module("ppo_vs_trl").trl_models(None)
    assert sorted(models) == ["model", "ref_model", "reward_model", "value_model"]
    for name, model in models.items():
        assert {p.dtype for p in model.parameters()} == {torch.float32}, name
    assert models["value_model"] is not models["reward_model"]  # the critic trains; the RM must not move


def test_trl_and_textgym_do_the_smollm2_presets_work_alike():
    """bench/ppo_vs_trl.py --config smollm2-sentiment --lora-rank 16: both sides get the preset's batch, epochs and
    minibatches; textgym keeps its env and does every epoch; TRL's models are SmolLM2 (no π_ref copy under LoRA)."""
    import torch

    from textgym.named_models import smollm2_folder

    bench = _bench_module("ppo_vs_trl")
    args = bench.parse_args(["--config", "smollm2-sentiment", "--lora-rank", "16"])
    assert (args.episodes, args.tokens, args.epochs, args.minibatches) == (16, 48, 2, 4)
    cfg = bench.textgym_config(args, "auto")
    assert (cfg.model, cfg.chat_template, cfg.prompts, cfg.lora_rank) == ("smollm2-135m-instruct", True,
                                                                           "review-requests", 16)  # fmt: skip
    assert (cfg.num_envs, cfg.max_new_tokens, cfg.ppo_epochs, cfg.num_minibatches) == (16, 48, 2, 4)
    assert cfg.early_stop_kl is None
    # textgym's side on the TRL side's count, every core: a count set before `import textgym` is capped by it
    assert cfg.threads == args.threads == len(os.sched_getaffinity(0))
    work = {"model": str(smollm2_folder()), "pad_id": 0, "vocab_size": 49152, "lora_rank": 16}
    models = bench.trl_models(work)
    assert models["ref_model"] is None  # TRL's π_ref is the policy with its adapters off, as textgym's
    value, policy = models["value_model"], models["model"]
    assert sum(p.numel() for p in value.base_model.parameters()) == sum(p.numel() for p in policy.model.parameters())
    assert models["reward_model"].config.vocab_size == 49152
    assert {p.dtype for m in models.values() if m is not None for p in m.parameters()} == {torch.float32}


def test_rm_ceiling_search_climbs_to_the_best_response():
    """The ceiling search keeps every improvement: on a score that counts token 7, all positions become 7."""
    import argparse

    import numpy as np

    ascend = _bench_module("rm_ceiling").ascend

    def count_sevens(prompt_ids, rows):
        return np.array([sum(t == 7 for t in row) for row in rows], dtype=float)

    args = argparse.Namespace(sweeps=2, candidates=4)
    history = ascend(count_sevens, [1], [5, 6, 5, 8, 5], np.array([5, 6, 7, 8]), args, np.random.default_rng(0))
    assert history == [0.0, 5.0, 5.0]


def test_asset_build_quick(tmp_path):
    """The asset build runs end to end (tiny sizes) and writes loadable HF folders and its report."""
    run([sys.executable, "-m", "textgym.assets.build", "--quick", "--out", str(tmp_path)], timeout=600)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    report = json.loads((tmp_path / "data" / "build_report.json").read_text())
    assert report["rm"]["val_pairs"] > 0 and report["calibration"]["rm_std"] > 0
    assert (tmp_path / "rm" / "textgym_reward.json").exists()


def test_rm_train_and_calibrate(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "The film", "chosen": f" was great {i}.", "rejected": f" was awful {i}."} for i in range(24)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run([*TEXTGYM, "rm-train", "--pairs", str(pairs), "--out", str(tmp_path / "rm"), "--epochs", "1",
               "--episodes", "16", "--max-new-tokens", "4"])  # fmt: skip
    assert "held-out pairwise accuracy" in out and "stored" in out
    assert (tmp_path / "rm" / "textgym_reward.json").exists()
    out = run([*TEXTGYM, "rm-calibrate", "--reward-model", str(tmp_path / "rm"), "--episodes", "8",
               "--max-new-tokens", "4"])  # fmt: skip
    assert "under pi_ref (stored)" in out
    pairs.write_text(json.dumps(rows[0]) + "\n{oops\n")
    proc = subprocess.run([*TEXTGYM, "rm-train", "--pairs", str(pairs), "--out", str(tmp_path / "rm2")], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "pairs.jsonl:2: invalid JSON" in proc.stderr
    assert not (tmp_path / "rm2").exists()


def test_renamed_flags_still_work_for_one_version_with_a_warning_naming_the_new_one():
    """Issue 43.3: one name per quantity: rm-train's --lr is --learning-rate (as in train), eval's policy is --policy
    (--model names π_ref, as in train and info)."""
    import argparse

    from textgym.cli import _policy_flag, build_parser

    parser = build_parser()
    with pytest.warns(FutureWarning, match=r"^--lr is deprecated and will be removed in the next version: use "
                      r"--learning-rate$"):  # fmt: skip
        args = parser.parse_args(["rm-train", "--pairs", "p.jsonl", "--out", "rm", "--lr", "0.003"])
    assert args.learning_rate == 0.003
    assert parser.parse_args(["rm-train", "--pairs", "p.jsonl", "--out", "rm"]).learning_rate == 1e-4
    args = parser.parse_args(["eval", "--model", "runs/x/policy"])
    with pytest.warns(FutureWarning, match=r"textgym eval --model for the policy is deprecated .* use --policy "
                      r"runs/x/policy \(--model names π_ref"):  # fmt: skip
        assert _policy_flag(args, "eval") == "runs/x/policy"
    assert args.model is None  # not also π_ref
    new = parser.parse_args(["eval", "--policy", "runs/x/policy", "--model", "lm"])
    assert _policy_flag(new, "eval") == "runs/x/policy" and new.model == "lm"
    assert _policy_flag(argparse.Namespace(policy=None, model="some/lm"), "play") is None  # play: π_ref itself
