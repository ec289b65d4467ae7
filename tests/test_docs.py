"""Every fenced code block of the README and docs/ runs as written: the doc test.

Python blocks run with ``python -c`` in an empty folder, as a user pastes them (so SB3's
``SubprocVecEnv`` starts its workers with its default ``forkserver``, in whose children the
``__main__`` of ``-c`` cannot be re-imported). Bash blocks run line by line, with ``textgym`` as
this interpreter's ``-m textgym.cli``. A block too long for CI is marked in the markdown, right
before its fence: ``<!-- doctest: skip (why) -->`` (it must still parse, and every flag it gives a
``textgym`` command must exist) or ``<!-- doctest: tiny (why) -->`` (it runs with the small budget
written in ``TINY_FLAGS`` / ``TINY_PYTHON`` below, nothing else changed). No command run as
documented may print a warning.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PRESETS = ROOT / "agents" / "ppo" / "presets"
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```$", re.M | re.S)
MARKER = re.compile(r"<!-- doctest: (skip|tiny) \((.+)\) -->")
WARNING = re.compile(r"Warning\b|^W\d{4} ", re.M)  # "UserWarning: …"; torchrun's "W1202 11:32:25 …"
# the explicit small budgets of `doctest: tiny` blocks: flags appended per textgym command, Python replacements
TINY_FLAGS = {"train": ["--total-episodes", "8", "--num-envs", "8", "--no-progress"],
              "eval": ["--episodes", "8", "--num-envs", "8", "--no-progress"]}  # fmt: skip
TINY_PYTHON = {"model.learn(2048,": "model.learn(32,"}  # one rollout of n_steps=32 and its update
CROSSES_A_PROCESS = re.compile(r"SubprocVecEnv|vectorization_mode=\"async\"|AsyncVectorEnv|start_method")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its code and its doctest marker."""

    page: Path
    line: int
    lang: str
    code: str
    mode: str  # "run", "skip" or "tiny"

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of ``page`` (or of ``text`` standing for it), in order."""
    text = page.read_text() if text is None else text
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        marker = MARKER.fullmatch(before)
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match[1], match[2], marker[1] if marker else "run"))
    return found


def commands(code: str) -> list[list[str]]:
    """A bash block's commands as argument lists (continuations joined, comments dropped)."""
    joined = code.replace("\\\n", " ")
    return [args for line in joined.splitlines() if (args := shlex.split(line, comments=True))]


def textgym_args(args: list[str]) -> list[str] | None:
    """The arguments after ``textgym`` in a command line (behind ``.venv/bin/``, torchrun, VAR=…), or None."""
    for i, arg in enumerate(args):
        if arg == "textgym" or arg.endswith("/textgym"):
            return args[i + 1 :]
    return None


ALL = [b for page in PAGES for b in blocks(page) if b.lang in ("python", "bash")]
RUN_PYTHON = [b for b in ALL if b.lang == "python" and b.mode != "skip"]
RUN_BASH = [b for b in ALL if b.lang == "bash" and b.mode != "skip"]


def run_quiet(cmd: list[str], cwd: Path, timeout: int = 600, env: dict | None = None) -> str:
    """``cmd``'s stdout; it must succeed and print no warning."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert not WARNING.search(proc.stderr), f"{cmd} warned:\n{proc.stderr[-3000:]}"
    return proc.stdout


# ---------------------------------------------------------------- the blocks run


@pytest.mark.parametrize("block", RUN_PYTHON, ids=str)
def test_python_block_runs_as_written(block, tmp_path):
    code = block.code
    if block.mode == "tiny":
        used = [old for old in TINY_PYTHON if old in code]
        assert used, f"{block} is marked tiny but holds none of {list(TINY_PYTHON)}"
        for old in used:
            code = code.replace(old, TINY_PYTHON[old])
    run_quiet([sys.executable, "-c", code], cwd=tmp_path)


@pytest.mark.parametrize("block", RUN_BASH, ids=str)
def test_bash_block_runs_as_written(block, tmp_path):
    for args in commands(block.code):
        rest = textgym_args(args)
        assert rest is not None, f"{block}: only textgym commands run here; mark the block skip: {args}"
        if block.mode == "tiny":
            rest = [*rest, *TINY_FLAGS.get(rest[0], [])]
        run_quiet([sys.executable, "-m", "textgym.cli", *rest], cwd=tmp_path)


# ---------------------------------------------------------------- the blocks that do not run


def _help(command: str) -> str:
    from textgym.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    return out.getvalue()


def check_command(args: list[str], where: str) -> None:
    """One skipped command names what exists: textgym subcommands and flags, presets, make targets, extras."""
    rest = textgym_args(args)
    if rest is not None:
        help_text = _help(rest[0])
        for i, arg in enumerate(rest[1:], 1):
            if arg.startswith("--"):
                assert re.search(rf"{re.escape(arg.split('=')[0])}\b", help_text), f"{where}: no {arg} in {rest[0]}"
            if rest[i - 1] == "--config":
                assert (PRESETS / f"{arg}.json").is_file() or arg == "default", f"{where}: no preset {arg}"
    elif args[0] == "make":
        makefile = (ROOT / "Makefile").read_text()
        assert all(re.search(rf"^{t}:", makefile, re.M) for t in args[1:]), f"{where}: {args}"
    elif args[0].endswith("python") and len(args) > 1:
        if args[1] == "-m":
            assert importlib.util.find_spec(args[2]) is not None, f"{where}: no module {args[2]}"
        else:
            assert (ROOT / args[1]).is_file(), f"{where}: no script {args[1]}"
    elif args[:2] == ["pip", "install"]:
        extras = json.dumps(_pyproject()["project"]["optional-dependencies"])
        for spec in args[2:]:
            for extra in re.findall(r"textgym\[([\w,-]+)\]", spec):
                assert all(f'"{e}"' in extras for e in extra.split(",")), f"{where}: no extra {extra}"


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("block", [b for b in ALL if b.mode == "skip"], ids=str)
def test_skipped_block_parses_and_names_what_exists(block):
    if block.lang == "python":
        compile(block.code, str(block), "exec")
        return
    assert subprocess.run(["bash", "-n"], input=block.code, text=True).returncode == 0, f"{block} does not parse"
    for args in commands(block.code):
        check_command(args, str(block))


def test_every_block_is_python_or_bash_and_markers_sit_on_a_fence():
    for page in PAGES:
        text = page.read_text()
        langs = {b.lang for b in blocks(page)}
        assert langs <= {"python", "bash", "json", "text", "toml"}, (
            f"{page.name}: fenced blocks {langs}: label each ```python, ```bash (run or marked) or ```text (output)"
        )
        marked = sum(1 for line in text.splitlines() if MARKER.fullmatch(line.strip()))
        assert marked == sum(b.mode != "run" for b in blocks(page)), (
            f"{page}: a doctest marker not right before a fence"
        )


def test_readme_starts_with_make_demo_and_make_test():
    first = blocks(ROOT / "README.md")[0]
    assert [args[:2] for args in commands(first.code)] == [["make", "demo"], ["make", "test"]]


# ---------------------------------------------------------------- issue 26, items 3 and 4: the text itself


def process_crossing_ids(page: Path, text: str | None = None) -> list[str]:
    """Bare env ids where an env is made in another process (code blocks, and inline code in the prose)."""
    text = page.read_text() if text is None else text
    bad = [f"{b}" for b in blocks(page, text) if CROSSES_A_PROCESS.search(b.code)
           and re.search(r"[\"'](TextRLHF|TextArithmetic)-v\d", b.code)]  # fmt: skip
    bad += re.findall(r"make_vec_env\(\"(?!textgym:)[^\"]+\"", FENCE.sub("", text))
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_envs_made_in_another_process_use_the_textgym_namespace(page):
    """Issue 26.3: a worker started by forkserver/spawn never ran ``import textgym``: ``"textgym:…"`` imports it."""
    assert process_crossing_ids(page) == []


def output_clashes(page: Path, text: str | None = None) -> list[str]:
    """Commands of ``page`` that would be refused, run in order after ``make demo``: a folder written twice, an
    ``export --merge`` of a run without LoRA, a ``--refit`` of no benchmark run."""
    written, lora_runs, clashes = {"runs/demo"}, set(), []  # make demo writes runs/demo
    for block in blocks(page, text):
        for args in commands(block.code) if block.lang == "bash" else []:
            rest = textgym_args(args)
            if not rest or "--resume" in rest or "--overwrite" in rest:
                continue
            flags = dict(zip(rest, rest[1:]))
            out = flags.get("--out")
            if rest[0] == "train":
                preset = PRESETS / f"{flags.get('--config', 'default')}.json"
                out = out or (json.loads(preset.read_text())["out"] if preset.is_file() else "runs/ppo")
                if "--lora-rank" in flags and out not in written:  # a refused run writes nothing
                    lora_runs.add(out)
            elif rest[0] == "export" and "--merge" in rest and str(Path(rest[1]).parent) not in lora_runs:
                clashes.append(f"{block}: export --merge of {rest[1]}, no LoRA run above writes it")
            elif rest[0] == "bench":
                if "--refit" in flags:
                    clashes += [] if flags["--refit"] in written else [f"{block}: --refit {flags['--refit']}"]
                    continue
                out = out or "runs/bench"
            if out is not None:
                clashes += [f"{block}: {' '.join(rest[:3])} writes {out} again"] if out in written else []
                written.add(out)
    return clashes


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_documented_command_writes_its_own_folder(page):
    """Issue 26.4: every command runs as written in sequence (after ``make demo``): none is refused."""
    assert output_clashes(page) == []


def test_the_checks_catch_what_the_readme_of_issue_26_had():
    """The two checks above fail on the README before issue 26 (items 3 and 4)."""
    old = (ROOT / "tests" / "data" / "readme_before_issue_26.md").read_text()
    clashes = output_clashes(ROOT / "README.md", old)
    assert any("runs/demo again" in c for c in clashes)  # train --config demo --out runs/demo after make demo
    assert any("export --merge" in c for c in clashes)  # export --merge of the full-weight run
    assert any("runs/bench again" in c for c in clashes)  # bench --quick, then bench, into one folder
    assert process_crossing_ids(ROOT / "README.md", old)  # make_vec_env("TextRLHF-v0", … SubprocVecEnv)


# ---------------------------------------------------------------- links and the install


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_exist(page):
    text = FENCE.sub("", page.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target}"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", FENCE.sub("", dest.read_text()), re.M)
            assert anchor in {slug(h) for h in headings}, f"{page.name}: {target}"


def test_make_install_prints_no_warning(tmp_path):
    """Issue 26.5: setuptools' notice on every editable install, filtered by the Makefile's project line.

    The editable wheel is built as pip builds it (setuptools' ``build_editable`` hook, in a process
    with the line's environment) from a copy of the project: nothing is installed, so the venv the
    tests run in stays as it is (``pip install --prefix`` would uninstall its textgym first).
    """
    line = next(line.strip() for line in (ROOT / "Makefile").read_text().splitlines() if "pip install" in line
                and " -e " in line)  # fmt: skip
    env = dict(arg.split("=", 1) for arg in shlex.split(line) if re.match(r"^[A-Z_]+=", arg))
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    for name in ("textgym", "agents"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = f"from setuptools import build_meta; print(build_meta.build_editable({str(tmp_path / 'wheel')!r}))"
    (tmp_path / "wheel").mkdir()
    proc = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith(".whl"), proc.stderr[-3000:]
    # the notice is a Python warning (pip shows it as BuildBackendWarning even under --quiet); setuptools'
    # log lines ("Editable install will be performed …") pip's --quiet hides
    assert not re.search(r"Warning\b|InformationOnly:", proc.stderr), proc.stderr[-3000:]


def test_readme_commands_run_the_venvs_executables():
    """Issue 37.9: a bare ``textgym`` or ``torchrun`` line fails unless the venv is activated (``make`` sets up
    ``.venv`` and the README's other lines call ``.venv/bin/textgym``), so every command names the venv's."""
    bare = [f"{block}: {' '.join(args)}" for block in blocks(ROOT / "README.md") if block.lang == "bash"
            for args in commands(block.code) for arg in args
            if arg in ("textgym", "torchrun", "python", "python3", "pip", "ray", "wandb", "mlflow")]  # fmt: skip
    assert not bare, bare


def test_the_guess_results_table_holds_the_numbers_of_its_eval_files():
    """Issue 42.6: "+61.0 points" was 60.9 and PPO's KL std 3.58 was 3.57 in the run's eval.json."""
    import json

    page = (ROOT / "docs" / "multi-turn.md").read_text()
    runs = ROOT / "docs" / "multi-turn-runs"
    evals = {a: json.loads((runs / f"smollm2-guess-{a}-s0" / "eval.json").read_text()) for a in ("grpo", "ppo")}
    gains = [f"+{100 * (e['policy']['success'] - e['pi_ref']['success']):.1f} points" for e in evals.values()]
    assert f"| win rate over π_ref | | {gains[0]} | {gains[1]} |" in page  # files from before the rename: 'success'
    kls = [f"{e['policy']['kl'][0]:.2f} ± {e['policy']['kl'][1]:.2f}" for e in evals.values()]
    assert f"| KL to π_ref (nats per game) | 0 | {kls[0]} | {kls[1]} |" in page


def test_the_calculator_results_table_holds_the_numbers_of_its_eval_files():
    """The tool-use table's accuracy, gain, tool share and KL, for π_ref and each seed, as eval.json has them."""
    import json

    page = (ROOT / "docs" / "multi-turn.md").read_text()
    runs = ROOT / "docs" / "multi-turn-runs"
    evals = [json.loads((runs / f"smollm2-calculator-grpo-s{seed}" / "eval.json").read_text()) for seed in (0, 1)]
    assert evals[0]["pi_ref"] == {**evals[1]["pi_ref"], "seconds": evals[0]["pi_ref"]["seconds"]}  # same seeds

    def share(row: dict, key: str, bold: str = "") -> str:
        low, high = row[f"{key}_ci95"]
        return f"{bold}{100 * row[key]:.1f} %{bold} [{100 * low:.1f}, {100 * high:.1f}]"

    ref, pols = evals[0]["pi_ref"], [e["policy"] for e in evals]
    accuracy = " | ".join(share(p, "win_rate", "**") for p in pols)
    assert f"| exact-answer accuracy (Wilson 95 %) | {share(ref, 'win_rate')} | {accuracy} |" in page
    gains = " | ".join(f"**+{100 * (p['win_rate'] - ref['win_rate']):.1f} points**" for p in pols)
    assert f"| accuracy over π_ref | | {gains} |" in page
    tools = " | ".join(share(row, "multi_turn_share") for row in (ref, *pols))
    assert f"| conversations that call the tool (Wilson 95 %) | {tools} |" in page
    kls = " | ".join(f"{row['kl'][0]:.2f} ± {row['kl'][1]:.2f}" for row in (ref, *pols))
    assert f"| KL to π_ref (nats per conversation) | {kls} |" in page
