"""The ``textgym`` command: ``info``, ``play``, ``train``, ``eval``, ``export``, ``trajectories``, ``rm-train``,
``rm-calibrate``, ``bench``, ``serve-rm``.

This is the only module of ``textgym/`` that imports ``textgym.agents`` (lazily, per command).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings
from pathlib import Path

from textgym.errors import RewardModelError
from textgym.files import FolderInUseError
from textgym.threads import use_threads

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _seed(text: str) -> int:
    """``--seed``: an int in numpy's seed range, checked by argparse so the error names the flag."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int in [0, 2**32 - 1]")
    return value


def _positive_int(text: str) -> int:
    """``--threads`` and the like: an int >= 1, checked by argparse so the error names the flag."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1")
    return value


def _positive_seconds(text: str) -> float:
    """``--client-timeout`` and the like: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _token_cap(text: str) -> int | str | None:
    """``--max-tokens``: ``auto`` (the reward model's context), ``none`` (no cap) or an int >= 1."""
    if text.lower() in ("auto", "none"):
        return None if text.lower() == "none" else "auto"
    return _positive_int(text)


def set_threads(requested: int | None) -> int:
    """Set torch's intra-op threads for a command: ``requested``, else :func:`textgym.threads.default_threads`
    (``OMP_NUM_THREADS`` if set, else one per core of this process under OpenMP's passive wait policy).

    Never a reading of the machine's load: the thread count changes torch's rounding, so a count
    that followed other jobs made one seeded command give other numbers on a re-run.

    Returns:
        The thread count torch now uses.
    """
    return use_threads(requested)


class _Renamed(argparse.Action):
    """A flag renamed for one name per quantity: still taken for one version, with a warning naming the new one."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(f"{option_string} is deprecated and will be removed in the next version: use {self.new}",
                      FutureWarning, stacklevel=2)  # fmt: skip
        setattr(namespace, self.dest, values)


def _set_flag_type(parser: argparse.ArgumentParser, flag: str, kind) -> None:
    """Give an existing flag another type (the train flags are made from the config's fields)."""
    for action in parser._actions:
        if flag in action.option_strings:
            action.type = kind


def _env_args(
    parser: argparse.ArgumentParser, model_help: str = "π_ref: HF causal-LM folder or id (default: embedded LM)"
) -> None:
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--reward-model", default=None, help="r_φ: name, folder, 'module:attr', "
                        "'reasoning-gym:<dataset>' (default: embedded)")  # fmt: skip
    parser.add_argument("--gold-scorer", default=None, help="what gold_score measures, any reward_model route "
                        "(default: the env's, VADER; for eval the run's)")  # fmt: skip
    parser.add_argument("--prompts", default=None, help=".txt/.jsonl prompt file, a folder saved with datasets' "
                        "save_to_disk, a cached dataset's NAME[:SPLIT], or 'reasoning-gym:<dataset>[:eval]' "
                        "(default: embedded set)")  # fmt: skip
    parser.add_argument("--prompt-column", default=None, help="the .jsonl field or dataset column of the prompts "
                        "(default: 'prompt')")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=None, help="response length cap (default: the env's)")
    parser.add_argument("--kl-coef", type=float, default=None, help="β (default: the env's, or the run's for eval)")
    parser.add_argument("--device", default="cpu", help="where π_ref and the reward model run: cpu, cuda, auto")
    parser.add_argument("--env-id", default=None, choices=ENV_IDS, help="the env (default: TextRLHF-v0; "
                        "TextMultiTurn-v0 with --partner, or a trained policy's run's)")  # fmt: skip
    parser.add_argument("--partner", default=None, help="who answers in TextMultiTurn-v0: 'textarena:<GameId>', "
                        "'guess-the-number-10', 'calculator', 'module:attr' or an entry point")  # fmt: skip
    parser.add_argument("--max-turns", type=int, default=None, help="a conversation's turn cap (default: none)")
    parser.add_argument("--max-turn-tokens", type=int, default=None, help="the policy's tokens per turn")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="the prompt block (default: sized by "
                        "the env from the prompts, or a game's openings)")  # fmt: skip
    parser.add_argument("--chat-template", action="store_true", default=None,
                        help="prompts as the user turn of the tokenizer's chat template")  # fmt: skip


ENV_IDS = ("TextRLHF-v0", "TextArithmetic-v0", "TextMultiTurn-v0")
_ENV_FLAGS = ("model", "reward_model", "gold_scorer", "prompts", "prompt_column", "max_new_tokens", "kl_coef",
              "partner", "max_turns", "max_turn_tokens", "max_prompt_tokens", "chat_template")  # fmt: skip


def _env_kwargs(args: argparse.Namespace) -> dict:
    """The env arguments given on the command line (the env's own defaults for the others)."""
    kwargs = {"device": args.device}
    for name in _ENV_FLAGS:
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def _env_id(args: argparse.Namespace) -> str:
    """``--env-id``, else TextMultiTurn-v0 when a ``--partner`` is given, else TextRLHF-v0."""
    return args.env_id or ("TextMultiTurn-v0" if args.partner is not None else "TextRLHF-v0")


def _calibration_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="pi_ref sampled for calibration (default: embedded LM)")
    parser.add_argument("--prompts", default=None, help="prompts for calibration (default: embedded set)")
    parser.add_argument("--episodes", type=int, default=512, help="samples of pi_ref to measure mean/std on")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="response length cap of the samples")
    parser.add_argument("--seed", type=_seed, default=0, help="seeds the prompts and the sampling")


def cmd_info(args: argparse.Namespace) -> None:
    import gymnasium as gym  # the env ids are registered: textgym's __init__ ran before this module

    env_id = _env_id(args)
    env = gym.make(env_id, **_env_kwargs(args))
    base = env.unwrapped
    n_params = sum(p.numel() for p in base.model.parameters())
    rm = base.reward_model
    rm_params = sum(p.numel() for p in rm.model.parameters()) if hasattr(rm, "model") else None
    norm = base.reward_norm
    print(env_id)
    print(f"  reference model  : {type(base.model).__name__}, {n_params / 1e6:.2f}M parameters, "
          f"{base.model.config.num_hidden_layers} layers, hidden {base.model.config.hidden_size}")  # fmt: skip
    print(f"  tokenizer        : vocab {len(base.tokenizer)}, BOS={base.tokenizer.bos_token_id} "
          f"EOS={base.eos_token_id} PAD={base.pad_token_id}")  # fmt: skip
    if rm is None:  # a conversation without one: the partner's rewards are the task's
        print("  reward model     : none (the partner's turn rewards)")
    else:
        print(f"  reward model     : {rm.name} ({type(rm).__name__}"
              + (f", {rm_params / 1e6:.2f}M parameters" if rm_params else "") + ")"
              + (f", normalised with mean {norm[0]:.4f} std {norm[1]:.4f}" if norm else ", raw scores"))  # fmt: skip
    if base.has_partner:
        from textgym.partners import partner_name

        print(f"  partner          : {partner_name(base.partner)}")
    print(f"  gold scorer      : {getattr(base.gold_scorer, 'name', None)}")
    print(f"  prompts          : {len(base.prompts)} (e.g. {base.prompts[0]!r})")
    print(f"  action space     : {env.action_space}")
    print(f"  observation space: {env.observation_space}")
    print(f"  max_prompt_tokens={base.max_prompt_tokens} max_new_tokens={base.max_new_tokens} kl_coef={base.kl_coef}")


def cmd_play(args: argparse.Namespace) -> None:
    from textgym.agents.evaluate import load_sampler
    from textgym.episodes import collect_episodes, make_episode_envs, sequence_kl

    policy_dir, env_id, temperature, sampling, kwargs = _played(args, "play")
    envs = make_episode_envs(env_id, 1, **kwargs)
    policy = load_sampler(envs, policy_dir, seed=args.seed, temperature=temperature, device=args.device, **sampling)
    normalised = envs.unwrapped.reward_norm is not None
    for episode in range(args.episodes):
        done = collect_episodes(envs, policy, seed=args.seed + episode)
        ep = done[0]
        kl = round(float(sequence_kl(done)[0]), 3) + 0.0  # no "-0.000"
        score = f" (normalised {float(ep['score_reward']):+.2f})" if normalised else ""
        turns = ""
        if "transcript" in done.keys():  # a conversation: every turn, the partner's too, and what the partner paid
            print(f"[{episode}] {done['transcript'][0]}".replace("\n", "\n     "))
            turns = f"partner's rewards {float(ep['turn_reward_sum']):+.3f}  "
        else:
            print(f"[{episode}] {ep['prompt']!r} -> {ep['response']!r}")
        print(f"     {turns}rm_score {float(ep['rm_score']):+.3f}{score}  gold {float(ep['gold_score']):+.3f}  "
              f"KL {kl:.3f}  tokens {int(ep['response_length'])}")  # fmt: skip


def _played(args: argparse.Namespace, command: str) -> tuple[str | None, str, float, dict, dict]:
    """(policy folder, or None for π_ref; env id; temperature; sampling truncation; env arguments) of ``play`` and
    ``trajectories`` (``command``).

    A policy saved by ``textgym train`` (``--policy OUT/policy``: its folder holds the run info) is played as
    ``eval`` measures it: against the run's π_ref, in the run's env, sampling as it was trained; it would
    otherwise be π_ref itself (KL 0) at the env's default length. ``--model`` is π_ref, as in ``train``.
    """
    from textgym.agents.evaluate import run_settings, run_settings_note, split_run_settings

    policy = _policy_flag(args, command)
    kwargs = _env_kwargs(args)
    if policy is None:
        if args.ref_model is not None:
            raise ValueError(f"--ref-model={args.ref_model!r} is the π_ref of a trained --policy, and none is given; "
                             "give π_ref with --model alone")  # fmt: skip
        return None, _env_id(args), 1.0 if args.temperature is None else args.temperature, {}, kwargs
    if args.ref_model is not None:
        kwargs["model"] = args.ref_model
    if note := run_settings_note(policy, kwargs):
        print(f"textgym {command}: {note}", file=sys.stderr)
    run = run_settings(policy, given=kwargs)
    run.pop("eval_prompts", None)  # play samples the env's prompts (or --prompts)
    env_id, temperature, sampling, kwargs = split_run_settings(run, args.temperature, kwargs)
    return policy, env_id, temperature, sampling, kwargs


def _policy_flag(args: argparse.Namespace, command: str) -> str | None:
    """``--policy``; or, for one more version, the trained policy given as ``--model`` (with a warning): ``--model``
    names π_ref, as in ``train`` and ``info``. In ``play`` and ``trajectories`` a ``--model`` folder without run info
    is π_ref."""
    from textgym.agents.evaluate import RUN_INFO

    if args.policy is not None or args.model is None:
        return args.policy
    if command in ("play", "trajectories") and not (Path(args.model) / RUN_INFO).is_file():
        return None
    warnings.warn(f"textgym {command} --model for the policy is deprecated and will be removed in the next version: "
                  f"use --policy {args.model} (--model names π_ref, as in `textgym train`)", FutureWarning,
                  stacklevel=2)  # fmt: skip
    policy, args.model = args.model, None
    return policy


RUN_OUTPUTS = ("metrics.jsonl", "policy", "value", "checkpoint")  # what `train` reports writing


def cmd_train(args: argparse.Namespace) -> None:
    from textgym.agents.ppo.config import config_from_args

    cfg = config_from_args(args)
    if args.print_config:  # a file to copy, edit and pass back with --config-file
        print(json.dumps(cfg.to_dict(), indent=2))
        return
    from textgym.agents.ppo import train  # imports TorchRL: only when training

    history = train(cfg, overwrite=args.overwrite)
    if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 reports (and wrote the run)
        last = history[-1] if history else {}
        print(json.dumps({k: last[k] for k in ("iteration", "score", "gold_score", "kl", "kl_coef") if k in last}))
        # what is on disk, not a fixed list: GRPO and RLOO have no critic, so no value/ folder
        wrote = [f"{cfg.out}/{name}" for name in RUN_OUTPUTS if (Path(cfg.out) / name).exists()]
        print(f"wrote {', '.join(wrote)}")


def cmd_eval(args: argparse.Namespace) -> None:
    from textgym.agents.evaluate import evaluate, format_eval, run_settings_note
    from textgym.models import check_model_source

    given = "--policy" if args.policy is not None else "--model"
    policy = _policy_flag(args, "eval")
    kwargs = _env_kwargs(args)  # with --policy, --model is π_ref
    if policy is not None:  # before π_ref's 128 episodes: a policy that cannot load is refused first
        check_model_source(given, policy)
    if args.env_id is not None or args.partner is not None:
        kwargs["env_id"] = _env_id(args)
    if args.ref_model:
        kwargs["model"] = args.ref_model
    if args.temperature is not None:
        kwargs["temperature"] = args.temperature
    if note := run_settings_note(policy, kwargs):  # the user sees what a model folder chose
        print(f"textgym eval: {note}", file=sys.stderr)
    # score − β·KL is the objective the policy was trained on: π_ref is measured in the same env
    # (the run's β, length cap, eval prompts, π_ref, RM and sampling; command-line flags override them).
    results = {}
    for name, model in (("pi_ref", None), ("policy", policy)) if policy else (("pi_ref", None),):
        results[name] = evaluate(model, episodes=args.episodes, num_envs=args.num_envs, seed=args.seed,
                                 progress=name if args.progress else False, run_of=policy, **kwargs)  # fmt: skip
        print(format_eval(name, results[name]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


def cmd_export(args: argparse.Namespace) -> None:
    """A saved policy as a folder of its own; ``--merge`` folds LoRA adapters into full weights."""
    import shutil

    from textgym.agents.evaluate import RUN_INFO
    from textgym.files import save_folder_atomically
    from textgym.models import load_causal_lm, load_tokenizer

    src, out = Path(args.policy), Path(args.out)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"--out={str(out)!r} exists; pass --overwrite to replace it")
    lora = (src / "adapter_config.json").is_file()
    if args.merge and not lora:
        raise ValueError(f"--merge: policy={str(src)!r} holds no LoRA adapters (no adapter_config.json): "
                         "it is already full weights; export it without --merge")  # fmt: skip

    def write(folder: Path) -> None:
        if args.merge:
            load_causal_lm(src, name="policy").save_pretrained(folder)
            load_tokenizer(src, name="policy").save_pretrained(folder)
            if (src / RUN_INFO).is_file():
                shutil.copy2(src / RUN_INFO, folder / RUN_INFO)
        else:
            shutil.copytree(src, folder, dirs_exist_ok=True)

    save_folder_atomically(out, write)
    print(f"wrote {out} ({'merged full weights' if args.merge else 'a copy of ' + str(src)})")


def cmd_trajectories(args: argparse.Namespace) -> None:
    """``--episodes`` episodes of a policy (π_ref without ``--policy``) as exact token trajectories in ``--out``.

    The env and the sampler are ``play``'s (a trained policy against its run's π_ref, in its run's env, sampling
    as it was trained); batches of ``--num-envs`` slots, each seeded with ``--seed`` plus the episodes before it.
    """
    from textgym.agents.evaluate import load_sampler
    from textgym.episodes import collect_episodes, make_episode_envs
    from textgym.trajectories import export_episodes, trajectory_format

    trajectory_format(args.out, args.format, argument="--out")  # refused before any model loads
    if Path(args.out).exists() and not args.overwrite:
        raise FileExistsError(f"--out={args.out!r} exists; pass --overwrite to replace it")
    policy_dir, env_id, temperature, sampling, kwargs = _played(args, "trajectories")
    envs = make_episode_envs(env_id, min(args.num_envs, args.episodes), **kwargs)
    policy = load_sampler(envs, policy_dir, seed=args.seed, temperature=temperature, device=args.device, **sampling)
    batches, done = [], 0
    while done < args.episodes:
        k = min(envs.num_envs, args.episodes - done)
        batches.append(collect_episodes(envs, policy, num_episodes=k, seed=args.seed + done))
        done += k
    envs.close()
    written = export_episodes(batches, args.out, args.format)
    print(f"wrote {written} episodes of {policy_dir or 'π_ref'} ({env_id}) to {args.out}")


def cmd_rm_train(args: argparse.Namespace) -> None:
    from textgym.models import DEFAULT_LM
    from textgym.rewards.training import load_pairs, train_reward_model

    pairs = load_pairs(args.pairs)
    val_pairs = load_pairs(args.val_pairs) if args.val_pairs else None
    result = train_reward_model(
        pairs, args.backbone or DEFAULT_LM, args.out, epochs=args.epochs, lr=args.learning_rate,
        batch_size=args.batch_size, val_pairs=val_pairs, val_fraction=args.val_fraction, seed=args.seed,
    )  # fmt: skip
    print(f"held-out pairwise accuracy {result.val_accuracy:.4f} (loss {result.val_loss:.4f}) on "
          f"{result.val_pairs} pairs after {result.epochs_run} epochs; saved {args.out}")  # fmt: skip
    if not args.no_calibrate:
        args.reward_model = args.out
        cmd_rm_calibrate(args)


def cmd_rm_calibrate(args: argparse.Namespace) -> None:
    from pathlib import Path

    from textgym.models import DEFAULT_LM
    from textgym.rewards import save_norm
    from textgym.rewards.calibrate import calibrate, reference_name

    if args.reward_model is None or not Path(args.reward_model).is_dir():
        raise ValueError(f"--reward-model={args.reward_model!r} must be a reward-model folder to store stats in")
    kwargs = {"reward_model": args.reward_model, "max_new_tokens": args.max_new_tokens}
    if args.model:
        kwargs["model"] = args.model
    if args.prompts:
        kwargs["prompts"] = args.prompts
    mean, std = calibrate(episodes=args.episodes, seed=args.seed, **kwargs)
    save_norm(
        args.reward_model,
        mean,
        std,
        max_new_tokens=args.max_new_tokens,
        measured_on=f"{args.episodes} samples of pi_ref",
        reference_model=reference_name(args.model or DEFAULT_LM),  # a run under another π_ref measures its own
    )
    print(f"reward model {args.reward_model}: mean {mean:+.4f}, std {std:.4f} under pi_ref (stored)")


def cmd_bench(args: argparse.Namespace) -> None:
    from textgym.agents.benchmark import ALGORITHMS, PRESETS, BenchConfig, refit, run_benchmark
    from textgym.agents.benchmark_report import smoke_note

    if args.refit:
        refit(args.refit, args.frontier_kl)
        print(f"rewrote the frontier columns, tables and plots in {args.refit} from its curves.json")
        return

    values = {k: v for k, v in PRESETS["quick" if args.quick else "default"].items() if v is not None}
    for name in ("task", "budget", "num_envs", "max_new_tokens", "kl_coef", "frontier_kl", "eval_episodes", "out",
                 "threads"):  # fmt: skip
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.algos:
        values["algos"] = [a.strip() for a in args.algos.split(",") if a.strip()]
    if args.seeds:
        values["seeds"] = [int(s) for s in args.seeds.split(",")]
    cfg = BenchConfig(**values)
    run_benchmark(cfg)
    print(f"wrote {cfg.out}/results.csv, results.md, rm_vs_steps.png, frontier.png (algorithms: {', '.join(cfg.algos)};"
          f" registered: {', '.join(sorted(ALGORITHMS))})")  # fmt: skip
    if note := smoke_note(cfg):
        print(note.replace("**", ""))


def cmd_serve_rm(args: argparse.Namespace) -> None:
    import importlib.util

    from textgym.models import DEFAULT_LM, load_tokenizer, resolve_device
    from textgym.rewards import make_reward_model

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"serve-rm needs {' and '.join(missing)}: pip install 'textgym[serve]'")
    from textgym.rewards.server import serve

    model = make_reward_model(args.reward_model, "--reward-model", device=resolve_device(args.device))
    tokenizer = load_tokenizer(args.tokenizer or DEFAULT_LM, name="--tokenizer", require_eos=False)
    print(f"textgym serve-rm: {model.name} on http://{args.host}:{args.port} (POST /get_reward, POST /score, "
          "GET /health)", flush=True)  # fmt: skip
    serve(model, args.host, args.port, tokenizer=tokenizer, max_batch=args.max_batch, max_items=args.max_items,
          max_tokens=args.max_tokens, max_pending=args.max_pending, client_timeout=args.client_timeout,
          request_timeout=args.request_timeout, max_connections=args.max_connections)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` and run the command; a user's error is one line on stderr and exit status 2, not a traceback."""
    args = build_parser().parse_args(argv)
    import torch  # after parsing: --help stays fast

    threads = torch.get_num_threads()
    try:
        set_threads(getattr(args, "threads", None))  # train: its config's field, set by the trainer
        args.func(args)
    except (ValueError, OSError, FolderInUseError, RewardModelError, FloatingPointError) as err:
        # OSError: a full disk or a read-only --out; FloatingPointError: a non-finite loss or weight refused
        print(f"textgym {args.command}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM during train (which said what its run folder holds)
        sys.exit(128 + getattr(err, "signum", signal.SIGINT))
    finally:
        torch.set_num_threads(threads)  # main() called from Python leaves the caller's setting


def build_parser() -> argparse.ArgumentParser:
    """The ``textgym`` parser: one adder per command, so each command's flags read in one place."""
    parser = argparse.ArgumentParser(prog="textgym", description="RLHF with PPO as a Gymnasium environment.")
    sub = _Subparsers(parser.add_subparsers(dest="command", required=True))
    for add in (_add_info, _add_play, _add_train, _add_eval, _add_export, _add_trajectories, _add_rm_train,
                _add_rm_calibrate, _add_bench, _add_serve_rm):  # fmt: skip
        add(sub)
    return parser


def _add_info(sub: _Subparsers) -> None:
    p = sub.add_parser("info", help="print the default env's models, sizes and spaces")
    _env_args(p)
    p.set_defaults(func=cmd_info)


def _add_play(sub: _Subparsers) -> None:
    p = sub.add_parser("play", help="run π_ref, or a policy saved by `textgym train`, on a few prompts")
    _env_args(p)
    p.add_argument("--policy", default=None, help="a policy saved by `textgym train` (OUT/policy), played against its "
                   "run's π_ref in its run's env (default: π_ref plays)")  # fmt: skip
    p.add_argument("--ref-model", default=None, help="π_ref of a trained --policy if not its run's")
    p.add_argument("--episodes", type=int, default=5, help="episodes to play and print")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the run's, else 1)")
    p.add_argument("--seed", type=_seed, default=0, help="seeds the prompts and the sampling")
    p.set_defaults(func=cmd_play)


def _add_train(sub: _Subparsers) -> None:
    """The train flags are the config's fields (``add_config_args``), plus what only the command decides."""
    p = sub.add_parser("train", help="train the policy with PPO (TorchRL)")
    from textgym.agents.ppo.config import add_config_args  # dataclass and flags only: no TorchRL import

    add_config_args(p)
    _set_flag_type(p, "--seed", _seed)
    p.add_argument("--overwrite", action="store_true", help="replace the run in --out (refused without it or --resume)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.set_defaults(func=cmd_train)


def _add_eval(sub: _Subparsers) -> None:
    p = sub.add_parser("eval", help="RM score, gold score and KL to π_ref of a policy on the eval prompts")
    _env_args(p, model_help="with --policy: π_ref, as --ref-model (default: the run's, or the embedded LM); alone: "
              "the policy to evaluate, deprecated (use --policy)")  # fmt: skip
    p.add_argument("--policy", default=None, help="the policy to evaluate: a causal-LM folder, e.g. OUT/policy "
                   "(default: π_ref alone)")  # fmt: skip
    p.add_argument("--ref-model", default=None, help="π_ref if not the run's (or the embedded LM; --model alike)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the run's, else 1)")
    p.add_argument("--episodes", type=int, default=128, help="episodes per policy (the eval prompts, in order)")
    p.add_argument("--num-envs", type=int, default=64, help="env slots sampled at once")
    p.add_argument("--seed", type=_seed, default=1234, help="seeds the sampling")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")
    p.set_defaults(func=cmd_eval)


def _add_export(sub: _Subparsers) -> None:
    p = sub.add_parser("export", help="copy a saved policy to a folder; --merge folds LoRA adapters into it")
    p.add_argument("policy", help="a saved policy folder, e.g. OUT/policy")
    p.add_argument("--out", required=True, help="the folder to write (refused if it exists, unless --overwrite)")
    p.add_argument("--merge", action="store_true", help="merge LoRA adapters into the base: a plain HF causal LM")
    p.add_argument("--overwrite", action="store_true", help="replace --out")
    p.set_defaults(func=cmd_export)


def _add_trajectories(sub: _Subparsers) -> None:
    p = sub.add_parser("trajectories", help="write episodes of a policy (or π_ref) as exact token trajectories: "
                       "JSONL or Parquet, one record per episode (docs/ecosystem.md)")  # fmt: skip
    _env_args(p)
    p.add_argument("--policy", default=None, help="a policy saved by `textgym train` (OUT/policy), sampled against "
                   "its run's π_ref in its run's env (default: π_ref samples)")  # fmt: skip
    p.add_argument("--ref-model", default=None, help="π_ref of a trained --policy if not its run's")
    p.add_argument("--episodes", type=_positive_int, default=16, help="episodes to write")
    p.add_argument("--num-envs", type=_positive_int, default=8, help="env slots sampled at once")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the run's, else 1)")
    p.add_argument("--seed", type=_seed, default=0, help="seeds the prompts, the partner's games and the sampling")
    p.add_argument("--out", required=True, help="the file: .jsonl or .parquet (or say which with --format)")
    p.add_argument("--format", default=None, choices=("jsonl", "parquet"), help="the file's format (default: by "
                   "--out's suffix)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_trajectories)


def _add_rm_train(sub: _Subparsers) -> None:
    p = sub.add_parser("rm-train", help="train a Bradley-Terry reward model from preference pairs (JSONL)")
    p.add_argument("--pairs", required=True, help='JSONL lines {"prompt", "chosen", "rejected"}')
    p.add_argument("--val-pairs", default=None, help="held-out pairs (default: a split of --pairs)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out share of --pairs without --val-pairs")
    p.add_argument("--out", required=True, help="folder to write the reward model to")
    p.add_argument("--backbone", default=None, help="causal-LM folder to start from (default: embedded LM)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the pairs (early stop on held-out loss)")
    p.add_argument("--learning-rate", type=float, default=1e-4, help="peak learning rate (linear warmup and decay)")
    p.add_argument(
        "--lr", type=float, dest="learning_rate", action=_Renamed, new="--learning-rate", help=argparse.SUPPRESS
    )  # the name before `textgym train`'s was taken for every command
    p.add_argument("--batch-size", type=int, default=32, help="pairs per step")
    p.add_argument("--no-calibrate", action="store_true", help="skip measuring mean/std under pi_ref")
    _calibration_args(p)
    p.set_defaults(func=cmd_rm_train)


def _add_rm_calibrate(sub: _Subparsers) -> None:
    p = sub.add_parser("rm-calibrate", help="store a reward model's score mean/std under pi_ref beside it")
    p.add_argument("--reward-model", required=True, help="reward-model folder")
    _calibration_args(p)
    p.set_defaults(func=cmd_rm_calibrate)


def _add_bench(sub: _Subparsers) -> None:
    p = sub.add_parser("bench", help="compare RL algorithms on the same env, budget and evaluator")
    p.add_argument("--task", default=None,
                   choices=["sentiment", "arithmetic", "arithmetic-proxy", "smollm2-sentiment", "smollm2-guess",
                            "smollm2-calculator"],
                   help="sentiment (TextRLHF-v0), arithmetic (TextArithmetic-v0, the verifier as reward), "
                   "arithmetic-proxy (its learned proxy as reward, the verifier as gold), smollm2-sentiment "
                   "(SmolLM2-135M-Instruct writing reviews, judged on held-out requests) or smollm2-guess "
                   "(TextMultiTurn-v0: SmolLM2 playing TextArena's GuessTheNumber, judged on held-out games) or "
                   "smollm2-calculator (SmolLM2 with the calculator tool on a * b + c at temperature 0.7, judged on "
                   "held-out problems) (default: sentiment)",
                   )  # fmt: skip
    p.add_argument("--algos", default=None, help="comma-separated registered algorithms (default: all)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the task's: 0,1 for "
                   "the SmolLM2 tasks, else 0,1,2)")  # fmt: skip
    p.add_argument("--budget", type=int, default=None, help="env steps (tokens) per trained algorithm")
    p.add_argument("--num-envs", type=int, default=None, help="env slots (default: the task's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="response length cap (default: the preset's)")
    p.add_argument("--kl-coef", type=float, default=None, help="β (default: the preset's)")
    p.add_argument("--frontier-kl", type=float, default=None, help="KL (nats) the frontier's area is taken up to "
                   "(default: the task's)")  # fmt: skip
    p.add_argument("--eval-episodes", type=int, default=None, help="evaluation episodes (default: the preset's)")
    p.add_argument("--out", default=None, help="output folder (default: the preset's)")
    p.add_argument("--quick", action="store_true", help="a few-minute smoke preset")
    p.add_argument("--refit", default=None, metavar="OUT", help="recompute a finished benchmark's frontier "
                   "columns, tables and plots from its files (with --frontier-kl: at another KL limit)")  # fmt: skip
    p.set_defaults(func=cmd_bench)


def _add_serve_rm(sub: _Subparsers) -> None:
    p = sub.add_parser("serve-rm", help="serve a reward model over HTTP (OpenRLHF's /get_reward and /score)")
    p.add_argument("--reward-model", default=None, help="r_φ: name, folder, 'module:attr', "
                        "'reasoning-gym:<dataset>' (default: embedded)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every one)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--device", default="auto", help="where the reward model runs: auto, cpu, cuda, cuda:N")
    p.add_argument("--tokenizer", default=None, help="encodes requests sent without token ids (default: embedded "
                   "LM's)")  # fmt: skip
    p.add_argument("--max-batch", type=_positive_int, default=64, help="episodes per joined forward")
    p.add_argument("--max-items", type=_positive_int, default=1024, help="episodes per request (more: HTTP 413)")
    p.add_argument("--max-tokens", type=_token_cap, default="auto", help="tokens of prompt + response + EOS per "
                   "episode (more: HTTP 413); auto: the reward model's context, none: no cap")  # fmt: skip
    p.add_argument("--max-pending", type=_positive_int, default=64, help="requests waiting or being scored at once "
                   "(more: HTTP 429, which the client retries)")  # fmt: skip
    p.add_argument("--client-timeout", type=_positive_seconds, default=10.0, help="seconds a client has to send its "
                   "request head, and again its body (more: HTTP 408)")  # fmt: skip
    p.add_argument("--request-timeout", type=_positive_seconds, default=60.0, help="seconds a request may wait and "
                   "be scored (more: HTTP 503)")  # fmt: skip
    p.add_argument("--max-connections", type=_positive_int, default=512, help="open connections (more: HTTP 503; "
                   "within the open-files limit)")  # fmt: skip
    p.set_defaults(func=cmd_serve_rm)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default in ``--help``; not a None default, whose meaning the help text gives."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class _Subparsers:
    """``add_subparsers()`` whose commands show their defaults in ``--help`` and share ``--threads``."""

    def __init__(self, action):
        self.action = action

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        p = self.action.add_parser(name, formatter_class=_HelpFormatter, **kwargs)
        if name != "train":  # train's --threads is a config field: recorded with the run and reused on resume
            p.add_argument("--threads", type=_positive_int, default=None,
                           help="torch threads (default: OMP_NUM_THREADS, else one per core)")  # fmt: skip
        return p


if __name__ == "__main__":
    main()
