"""Prompt sources of TextRLHF-v0: the ``prompts=`` argument resolved to a list of prompt strings.

A source is a list of str, a UTF-8 ``.txt`` or ``.jsonl`` file, a Hugging Face ``datasets`` folder
or cached dataset, the name of a shipped set (:data:`textgym.assets.PROMPT_SETS`), or a reasoning-gym
dataset's seeded split (``"reasoning-gym:<dataset>[:eval]"``, :mod:`textgym.reasoning_gym_task`). Every bad
source raises one error naming it, and the line or byte that is wrong.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from textgym.asset_paths import DEFAULT_PROMPTS, PROMPT_SETS
from textgym.errors import short_repr
from textgym.reasoning_gym_task import is_spec, split_questions

__all__ = ["load_prompts"]


def load_prompts(prompts: Sequence[str] | str | os.PathLike | None, column: str = "prompt") -> list[str]:
    """Resolve the ``prompts=`` argument to a non-empty list of prompt strings.

    Args:
        prompts: a list of str; a ``.txt`` path (one prompt per non-blank line); a ``.jsonl`` path
            (one JSON object per non-blank line, its ``column`` a str); a folder written by a Hugging
            Face ``datasets`` ``save_to_disk`` (a ``DatasetDict``'s ``"train"`` split, or its only one;
            ``FOLDER/SPLIT`` picks another); the name of a dataset in the local Hugging Face cache,
            ``"NAME"`` or ``"NAME:SPLIT"`` (default split ``"train"``); a shipped set's name
            (``textgym.assets.PROMPT_SETS``: ``"review-requests"``, ``"review-requests-eval"``); a reasoning-gym
            dataset's questions, ``"reasoning-gym:<dataset>"`` (train: 1,000 draws of seed 0) or
            ``"reasoning-gym:<dataset>:eval"`` (held out: 500 draws of another seed less the train questions),
            with options as ``?max_digits=2&operators=+`` (:mod:`textgym.reasoning_gym_task`); or
            ``None`` (the embedded train prompts). Files are read as UTF-8.
        column: the field holding the prompt in ``.jsonl`` rows and datasets.

    Raises:
        FileNotFoundError: the path does not exist (and is no cached dataset's name).
        ValueError: a bad ``reasoning-gym:`` spec (its dataset, split or options), a wrong suffix, a file that is
            not UTF-8, a bad ``.jsonl`` line (its number is named), a dataset without ``column`` or with several
            splits and no ``"train"``, or no prompts.
        ImportError: a ``reasoning-gym:`` spec without reasoning-gym installed.
        TypeError: ``prompts`` is not a list of str.
    """
    if prompts is None:
        prompts = DEFAULT_PROMPTS
    source = "prompts"
    if is_spec(prompts) and not Path(prompts).exists():
        prompts = split_questions(prompts)
    if isinstance(prompts, str) and prompts in PROMPT_SETS and not Path(prompts).exists():
        prompts = PROMPT_SETS[prompts]  # a shipped set by name
    if isinstance(prompts, (str, os.PathLike)):
        source = f"prompts={os.fspath(prompts)!r}"
        prompts = _prompts_from_source(Path(prompts), source, column)
    try:
        prompts = list(prompts)
    except TypeError as err:
        raise TypeError(f"prompts={short_repr(prompts)} must be a list of str or a .txt/.jsonl path") from err
    if not prompts:
        raise ValueError(f"{source} holds no prompts; give at least one prompt")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompts[{i}]={short_repr(p)} is not a str; every prompt must be a str")
    return prompts


def _prompts_from_source(path: Path, source: str, column: str) -> list:
    """The prompts of a text/JSONL file, a saved dataset folder or a cached dataset's name."""
    if path.is_dir():
        return _dataset_column(_load_dataset_folder(path, source), column, source)
    if not path.exists():
        if path.suffix not in (".txt", ".jsonl") and _DATASET_NAME.fullmatch(str(path)):
            return _dataset_column(_load_cached_dataset(str(path), source), column, source)
        raise FileNotFoundError(
            f"{source} does not exist; give a list of str, a .txt/.jsonl path, a folder saved with datasets' "
            "save_to_disk or the name of a dataset in the local Hugging Face cache"
        )
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"{source} must end in .txt or .jsonl (or be a dataset folder)")
    text = _read_utf8(path, source)
    if path.suffix == ".jsonl":
        return _read_jsonl_prompts(path, text, column)
    return [line for line in text.splitlines() if line.strip()]


_DATASET_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?(:[\w.-]+)?")  # "imdb", "org/name", "org/name:test"


def _load_dataset_folder(path: Path, source: str):
    """A ``datasets`` folder from ``save_to_disk``: a Dataset, or the ``"train"`` (or only) split of a DatasetDict."""
    datasets = _import_datasets(source)
    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise ValueError(f"{source} is a folder but not one written by datasets' save_to_disk ({err})") from err
    if isinstance(data, datasets.DatasetDict):
        splits = sorted(data)
        if "train" not in data and len(splits) != 1:
            raise ValueError(f"{source} holds the splits {splits} and no 'train'; give one split's folder, e.g. "
                             f"{str(path / splits[0])!r}")  # fmt: skip
        data = data["train" if "train" in data else splits[0]]
    return data


def _load_cached_dataset(name: str, source: str):
    """``NAME[:SPLIT]`` through ``datasets.load_dataset`` (with ``HF_HUB_OFFLINE=1``: the local cache only)."""
    datasets = _import_datasets(source)
    name, _, split = name.partition(":")
    try:
        return datasets.load_dataset(name, split=split or "train")
    except Exception as err:  # not cached, no such split, offline: one clear error
        raise FileNotFoundError(
            f"{source} is neither a file, a folder nor a dataset datasets can load from its cache "
            f"({type(err).__name__}: {err})"
        ) from err


def _import_datasets(source: str):
    try:
        import datasets
    except ImportError as err:
        raise ValueError(f"{source} names a Hugging Face dataset: pip install 'textgym[datasets]'") from err
    return datasets


def _dataset_column(data, column: str, source: str) -> list:
    if column not in data.column_names:
        raise ValueError(
            f"{source} has no column {column!r}; its columns are {data.column_names}: pass prompt_column= "
            "(--prompt-column) naming the one that holds the prompts"
        )
    return data[column]


def _read_utf8(path: Path, source: str) -> str:
    """The file's text; a file that is not UTF-8 raises one error naming it and the first bad byte."""
    try:
        return path.read_text(encoding="utf-8-sig")  # -sig: a BOM (Windows editors write one) is no prompt text
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{source} is not UTF-8 text: byte 0x{err.object[err.start]:02x} at offset {err.start} ({err.reason}); "
            "save it as UTF-8"
        ) from err


def _read_jsonl_prompts(path: Path, text: str, column: str = "prompt") -> list[str]:
    """The ``column`` of every non-blank line of a ``.jsonl`` file; a bad line raises naming its number."""
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ValueError(
                f"prompts={str(path)!r}: line {n} is not valid JSON ({err}); each line must be "
                f"a JSON object with a str {column!r}"
            ) from err
        if not isinstance(row, dict) or not isinstance(row.get(column), str):
            raise ValueError(
                f"prompts={str(path)!r}: line {n} is {line.strip()[:80]!r}; each line must be a JSON object "
                f"with a str {column!r}"
            )
        out.append(row[column])
    return out
