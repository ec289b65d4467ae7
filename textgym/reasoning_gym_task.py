"""reasoning-gym datasets as single-turn tasks: ``prompts="reasoning-gym:<dataset>"`` and its verifier.

reasoning-gym (``pip install reasoning-gym``) generates problems procedurally, each with its own checker
(``score_answer``). One name, a *spec*, says which problems::

    reasoning-gym:<dataset>[:eval][?<option>=<value>[&<option>=<value>...]]

- ``prompts="reasoning-gym:basic_arithmetic"``: the train split, the dataset's :data:`TRAIN_SIZE` questions of
  seed :data:`TRAIN_SEED` (repeats dropped);
- ``prompts="reasoning-gym:basic_arithmetic:eval"``: the held-out split, :data:`EVAL_SIZE` questions of seed
  :data:`EVAL_SEED` less every question also in the train split (and repeats), so no held-out question is trained
  on; how many remain depends on how many distinct questions the options allow;
- ``reward_model="reasoning-gym:basic_arithmetic"``: the verifier
  (:class:`textgym.rewards.reasoning_gym_verifier.ReasoningGymVerifier`), which finds each episode's
  prompt among both splits' questions and pays the dataset's ``score_answer`` of the response (stripped of
  surrounding whitespace); its verdict is full credit (score 1.0);
- options are fields of the dataset's config (``?max_digits=2&operators=+,-``): ints, floats, ``true``/``false``,
  strings, and comma-separated lists where the field is a list; ``seed`` and ``size`` are the split's. The prompts'
  spec and the reward model's must carry the same options: the verifier regenerates the entries from them.

Why regenerate instead of storing the answers: a run config saves names as JSON, so the name alone must give back
the same questions and their entries in any process; reasoning-gym makes item ``i`` of a seed from
``Random(seed + i)``, which is what makes that exact.
"""

from __future__ import annotations

import dataclasses
import difflib
from functools import lru_cache
from typing import Any, NamedTuple

from textgym.imports import import_optional

__all__ = [
    "EVAL_SEED",
    "EVAL_SIZE",
    "PREFIX",
    "TRAIN_SEED",
    "TRAIN_SIZE",
    "TaskSpec",
    "is_spec",
    "parse_spec",
    "dataset_object",
    "split_entries",
    "split_questions",
]

PREFIX = "reasoning-gym:"
TRAIN_SEED, TRAIN_SIZE = 0, 1000
# Item i of a seed comes from Random(seed + i): the eval split's streams start past any train stream (seeds
# 0..999), so the two splits share a question only where the options allow few distinct ones; those are removed.
EVAL_SEED, EVAL_SIZE = 1_000_000, 500
SPLITS = {"train": (TRAIN_SEED, TRAIN_SIZE), "eval": (EVAL_SEED, EVAL_SIZE)}
_SPLIT_FIELDS = ("seed", "size")  # set by the split, never by an option
GRAMMAR = "'reasoning-gym:<dataset>[:eval][?option=value&...]'"


class TaskSpec(NamedTuple):
    """A parsed spec: the dataset, the split and the config options (sorted, hashable: a cache key)."""

    dataset: str
    split: str
    options: tuple[tuple[str, Any], ...]

    def name(self) -> str:
        """The spec as text again, its options in sorted order (the verifier's ``name``)."""
        query = "&".join(f"{k}={_show(v)}" for k, v in self.options)
        return f"{PREFIX}{self.dataset}" + (":eval" if self.split == "eval" else "") + (f"?{query}" if query else "")


def is_spec(value: Any) -> bool:
    """Whether ``value`` is a name of this module's route (a str starting ``reasoning-gym:``)."""
    return isinstance(value, str) and value.startswith(PREFIX)


def held_out_name(prompts: Any) -> str | None:
    """The held-out split's name of a train-split name (``reasoning-gym:X?o=v`` → ``reasoning-gym:X:eval?o=v``), or
    None for anything else. Pure text, nothing imported: what a run evaluates on when it names no eval prompts."""
    if not is_spec(prompts):
        return None
    head, sep, query = prompts[len(PREFIX) :].partition("?")
    dataset, _, split = head.partition(":")
    if split not in ("", "train"):
        return None
    return f"{PREFIX}{dataset}:eval{sep}{query}"


def _reasoning_gym():
    """The reasoning_gym package, imported on first use: an optional dependency that takes a second to import."""
    return import_optional("reasoning_gym", "reasoning-gym tasks", "reasoning-gym",
                           "pip install reasoning-gym (or 'textgym[reasoning-gym]')")  # fmt: skip


def _registered() -> dict[str, tuple[type, type]]:
    _reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return DATASETS


def parse_spec(text: str, argument: str) -> TaskSpec:
    """``text`` as a :class:`TaskSpec`, checked against the installed reasoning-gym.

    Raises:
        ImportError: reasoning-gym is not installed (naming ``pip install reasoning-gym``).
        ValueError: naming ``argument``, the value and what is allowed: no such dataset (with close matches), a split
            other than ``eval``, an option the dataset's config lacks, a value of the wrong type, or options the
            dataset's own validation refuses.
    """
    head, _, query = text[len(PREFIX) :].partition("?")
    dataset, _, split = head.partition(":")
    datasets = _registered()
    if dataset not in datasets:
        near = difflib.get_close_matches(dataset, list(datasets), n=5, cutoff=0.6)
        hint = f"did you mean {', '.join(near)}?" if near else f"the datasets are: {', '.join(sorted(datasets))}"
        raise ValueError(f"{argument}={text!r}: reasoning-gym has no dataset {dataset!r}; {hint}")
    if split not in ("", "train", "eval"):
        raise ValueError(f"{argument}={text!r}: split {split!r} is not one of 'train' (the default) or 'eval'; "
                         f"the grammar is {GRAMMAR}")  # fmt: skip
    config_cls = datasets[dataset][1]
    options = tuple(sorted(_parse_options(query, config_cls, argument, text).items()))
    spec = TaskSpec(dataset, split or "train", options)
    _check_config(spec, argument, text)
    return spec


def _parse_options(query: str, config_cls: type, argument: str, text: str) -> dict[str, Any]:
    """``a=1&b=x,y`` as ``{"a": 1, "b": ("x", "y")}``, each value typed like the config field's default.

    Why no URL decoding: ``operators=+`` means the plus sign, which form decoding would turn into a space.
    """
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init and f.name not in _SPLIT_FIELDS}
    out: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, eq, raw = part.partition("=")
        if not eq or key in out:
            why = "is given twice" if key in out else "is not of the form option=value"
            raise ValueError(f"{argument}={text!r}: {part!r} {why}; the grammar is {GRAMMAR}")
        if key not in fields:
            allowed = ", ".join(sorted(fields)) or "none"
            near = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"{argument}={text!r}: {key!r} is no option of {config_cls.__name__} ({hint}its options "
                             f"are: {allowed}; seed and size are the split's)")  # fmt: skip
        out[key] = _typed(raw, _default(fields[key]), f"{argument}={text!r}: option {key}={raw!r}")
    return out


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _typed(raw: str, default: Any, where: str) -> Any:
    """``raw`` converted to the type of ``default`` (a list: comma-separated items of its first item's type)."""
    if isinstance(default, (list, tuple)):
        item = default[0] if default else ""
        return tuple(_typed(x, item, where) for x in raw.split(",") if x != "")
    if isinstance(default, bool):
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{where} must be true or false")
        return raw.lower() in ("true", "1")
    if default is None:  # an Optional field: a number where it reads as one, else the text
        for kind in (int, float):
            try:
                return kind(raw)
            except ValueError:
                continue
        return raw
    if isinstance(default, (int, float)):
        kind = type(default)
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{where} must be {'an int' if kind is int else 'a number'}") from None
    return raw


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(_show, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_config(spec: TaskSpec, argument: str, text: str) -> None:
    """Build the dataset's config once, so options its own ``validate`` refuses are reported here, by name."""
    config_cls = _registered()[spec.dataset][1]
    try:
        config = config_cls(**dict(spec.options), seed=TRAIN_SEED, size=1)
        if hasattr(config, "validate"):
            config.validate()
    except Exception as err:  # reasoning-gym validates with assert: one ValueError naming the spec
        shown = ", ".join(f"{k}={_show(v)}" for k, v in spec.options) or "its defaults"
        raise ValueError(f"{argument}={text!r}: reasoning-gym refuses {spec.dataset} with {shown} "
                         f"({type(err).__name__}: {err})") from err  # fmt: skip


@lru_cache(maxsize=16)
def _generate(dataset: str, options: tuple[tuple[str, Any], ...], split: str) -> tuple[Any, tuple[dict, ...]]:
    """The dataset object and the split's entries, first of each question kept (cached: prompts and verifier
    share one generation per process)."""
    seed, size = SPLITS[split]
    data = _reasoning_gym().create_dataset(dataset, **dict(options), seed=seed, size=size)
    seen: dict[str, dict] = {}
    for entry in data:
        seen.setdefault(entry["question"], entry)
    return data, tuple(seen.values())


def split_entries(spec: TaskSpec) -> tuple[dict, ...]:
    """The entries of ``spec``'s split; the eval split without any question of the train split."""
    _, entries = _generate(spec.dataset, spec.options, spec.split)
    if spec.split == "train":
        return entries
    train = {e["question"] for e in _generate(spec.dataset, spec.options, "train")[1]}
    return tuple(e for e in entries if e["question"] not in train)


def split_questions(text: str, argument: str = "prompts") -> list[str]:
    """The questions of the spec ``text`` (the ``prompts=`` route).

    Raises:
        ValueError: a bad spec (:func:`parse_spec`), or an eval split the train split leaves empty.
    """
    spec = parse_spec(text, argument)
    questions = [e["question"] for e in split_entries(spec)]
    if not questions:
        raise ValueError(f"{argument}={text!r}: every one of the {EVAL_SIZE} held-out questions is also a train "
                         "question; options that allow more distinct questions leave some held out")  # fmt: skip
    return questions


def dataset_object(spec: TaskSpec) -> Any:
    """The reasoning-gym dataset of ``spec``'s split (its ``score_answer`` scores an entry of either split)."""
    return _generate(spec.dataset, spec.options, spec.split)[0]
