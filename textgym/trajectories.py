"""Exact trajectories out: :func:`~textgym.episodes.collect_episodes`' episodes as one record per episode, in
JSONL or Parquet, and back.

Why token ids and not text: a trainer that re-tokenises a conversation's text trains on ids the policy never
sampled (a turn's text need not round-trip), and its log-probs no longer match the sampler's. A record holds
the ids as sampled, the sampler's and π_ref's log-prob of each, and what the env paid for each, so another
trainer (TRL, OpenRLHF, verl, OpenEnv's harness) reads exactly what textgym's own PPO update sees.

A record (one per episode; lists are variable-length: the prompt's real tokens and the R response columns the
episode used, never the padded blocks):

- ``prompt_token_ids`` (P',) int: the prompt's tokens, left padding removed;
- ``completion_token_ids`` (R,) int: the response block as the env laid it out: the policy's tokens and, in a
  conversation, the partner's replies between its turns;
- ``loss_mask`` (P' + R,) 0/1 over prompt and completion: 1 on the policy's tokens (the ``mask`` column);
- ``per_token_logps`` (R,) float32: the sampler's log-prob of each token (``sample_log_prob``; 0 on a partner's);
- ``ref_logprob`` (R,) float32: log π_ref (0 on a partner's tokens); ``env_reward`` (R,) float32: what the env
  paid per token (β·log π_ref, a turn's reward on its last token, the score minus the penalty at the end);
- ``turn_rewards``, ``turn_ends`` (K,): each answered turn's partner reward (float64) and its last token's index
  in ``completion_token_ids`` (none without a partner);
- ``rm_score``, ``score_reward``, ``missing_eos_penalty``, ``gold_score``, ``verdict`` (NaN: none),
  ``turn_reward_sum`` float;
  ``response_length``, ``turns`` int; ``length_capped`` bool; ``prompt``, ``response``, ``transcript`` (a
  conversation's messages as text; null in a single-turn episode) str;
- ``max_prompt_tokens``, ``max_new_tokens``, ``pad_token_id`` (null when the episode's observation has no
  padding): the env's blocks, so :func:`read_episodes` rebuilds the padded tensors exactly.

The first four are the fields of OpenEnv's ``TrainingTurn`` (``openenv`` 0.10.0,
``openenv.core.harness.training``), with its meanings: a record whose ``node_id`` is added is one. Only the
policy's sampled ids are stored; a truncating sampler's kept sets (``kept``) are not.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from textgym.files import write_file_atomically

__all__ = ["FORMATS", "episode_records", "episodes_from_records", "export_episodes", "read_episodes",
           "read_records", "trajectory_format", "write_records"]  # fmt: skip

FORMATS = {"jsonl": ".jsonl", "parquet": ".parquet"}  # format -> the file suffix that chooses it
# per-token lists over the completion, with the TensorDict column each comes from and its dtype
PER_TOKEN = {"per_token_logps": ("sample_log_prob", torch.float32), "ref_logprob": ("ref_logprob", torch.float32),
             "env_reward": ("env_reward", torch.float32)}  # fmt: skip
SCALARS = {"rm_score": torch.float64, "score_reward": torch.float64, "missing_eos_penalty": torch.float64,
           "gold_score": torch.float64, "verdict": torch.float64, "turn_reward_sum": torch.float64,
           "response_length": torch.int64,
           "turns": torch.int64, "length_capped": torch.bool}  # fmt: skip
TEXTS = ("prompt", "response", "transcript")
BLOCKS = ("max_prompt_tokens", "max_new_tokens", "pad_token_id")
FIELDS = ("prompt_token_ids", "completion_token_ids", "loss_mask", *PER_TOKEN, "turn_rewards", "turn_ends",
          *SCALARS, *TEXTS, *BLOCKS)  # fmt: skip


def export_episodes(episodes: TensorDict | Sequence[TensorDict], path: str | Path, format: str | None = None) -> int:
    """Write episodes of :func:`~textgym.episodes.collect_episodes` (one TensorDict or several) to ``path``.

    Args:
        episodes: the TensorDict(s) ``collect_episodes`` returned.
        path: the file; written through a temp file and a rename, so nothing half-written is ever at it.
        format: ``"jsonl"`` or ``"parquet"`` (default: chosen by the suffix, ``.jsonl`` or ``.parquet``).

    Returns:
        The number of episodes written.
    """
    batches = [episodes] if isinstance(episodes, TensorDict) else list(episodes)
    records = [record for batch in batches for record in episode_records(batch)]
    write_records(records, path, format)
    return len(records)


def read_episodes(path: str | Path, format: str | None = None) -> TensorDict:
    """The episodes of a file :func:`export_episodes` wrote, as the TensorDict ``collect_episodes`` returned
    (every column but ``kept``, equal to the last bit)."""
    return episodes_from_records(read_records(path, format))


def trajectory_format(path: str | Path, format: str | None = None, argument: str = "path") -> str:
    """``format``, checked, or the one ``path``'s suffix names: one error naming what is wrong and what is allowed
    (``argument``: the path's name in it, e.g. a CLI flag)."""
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"format={format!r} is not a trajectory format; allowed: {sorted(FORMATS)} "
                             "(or None: chosen by the file's suffix)")  # fmt: skip
        return format
    suffix = Path(path).suffix.lower()
    for name, known in FORMATS.items():
        if suffix == known:
            return name
    raise ValueError(f"{argument}={str(path)!r} has the suffix {suffix!r}, which names no trajectory format; allowed: "
                     f"{sorted(FORMATS.values())}, or give format= one of {sorted(FORMATS)}")  # fmt: skip


# ---------------------------------------------------------------- TensorDict -> records
def episode_records(episodes: TensorDict) -> list[dict[str, Any]]:
    """One record (module docstring) per episode of a ``collect_episodes`` TensorDict, as plain Python values."""
    missing = [k for k in ("input_ids", "attention_mask", "action", "mask", "turn_reward", "turn_end",
                           *(c for c, _ in PER_TOKEN.values()), *SCALARS, "prompt", "response")
               if k not in episodes.keys()]  # fmt: skip
    if missing:
        raise ValueError(f"episodes lacks the columns {missing}: give a TensorDict from textgym.episodes."
                         "collect_episodes")  # fmt: skip
    cols = {k: episodes[k].cpu().numpy() for k in episodes.keys() if k not in (*TEXTS, "kept")}
    texts = {k: episodes.get(k).tolist() for k in TEXTS if k in episodes.keys()}
    return [_record(cols, texts, i) for i in range(episodes.batch_size[0])]


def _record(cols: dict[str, np.ndarray], texts: dict[str, list[str]], i: int) -> dict[str, Any]:
    T = cols["action"].shape[1]
    P = cols["input_ids"].shape[1] - T
    ids, real = cols["input_ids"][i], cols["attention_mask"][i].astype(bool)
    R = int(real[P:].sum())  # the response columns the episode used: its tokens and a partner's replies
    prompt = ids[:P][real[:P]].tolist()
    ends = np.flatnonzero(cols["turn_end"][i])
    pads = np.unique(ids[~real])
    # what read_episodes rebuilds: the prompt right-aligned in its block, the response from its first column
    laid_out = real[P - len(prompt) : P + R].all() and len(pads) <= 1
    if not laid_out:
        raise ValueError(f"episodes: episode {i}'s observation is not a left-padded prompt block and a response "
                         f"block filled from its start, padded with one id (pads {pads.tolist()}): give a "
                         "TensorDict from textgym.episodes.collect_episodes")  # fmt: skip
    return {
        "prompt_token_ids": prompt,
        "completion_token_ids": ids[P : P + R].tolist(),
        "loss_mask": [0] * len(prompt) + cols["mask"][i, :R].astype(int).tolist(),
        **{name: cols[column][i, :R].tolist() for name, (column, _) in PER_TOKEN.items()},
        "turn_rewards": cols["turn_reward"][i, ends].tolist(),
        "turn_ends": ends.tolist(),
        **{k: cols[k][i].item() for k in SCALARS},
        **{k: texts[k][i] if k in texts else None for k in TEXTS},
        "max_prompt_tokens": P,
        "max_new_tokens": T,
        "pad_token_id": int(pads[0]) if len(pads) else None,
    }


# ---------------------------------------------------------------- records -> TensorDict
def episodes_from_records(records: Sequence[dict[str, Any]]) -> TensorDict:
    """The TensorDict of ``collect_episodes`` the records were made from (``kept`` aside): the padded blocks are
    rebuilt from ``max_prompt_tokens``, ``max_new_tokens`` and ``pad_token_id``."""
    if not records:
        raise ValueError("records=[] holds no episode: a TensorDict needs at least one")
    P, T = (_same(records, k) for k in ("max_prompt_tokens", "max_new_tokens"))
    B = len(records)
    obs = {k: torch.zeros(B, P + T, dtype=torch.int64) for k in ("input_ids", "attention_mask")}  # (B, P + T)
    per_token = {c: torch.zeros(B, T, dtype=d) for c, d in PER_TOKEN.values()}
    turn_reward, turn_end = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.bool)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, r in enumerate(records):
        prompt, completion = r["prompt_token_ids"], r["completion_token_ids"]
        n, R = len(prompt), len(completion)
        obs["input_ids"][i] = r["pad_token_id"] if r["pad_token_id"] is not None else 0
        obs["input_ids"][i, P - n : P + R] = torch.tensor(prompt + completion, dtype=torch.int64)
        obs["attention_mask"][i, P - n : P + R] = 1
        mask[i, :R] = torch.tensor(r["loss_mask"][n:], dtype=torch.bool)
        for name, (column, dtype) in PER_TOKEN.items():
            per_token[column][i, :R] = torch.tensor(r[name], dtype=dtype)
        turn_reward[i, r["turn_ends"]] = torch.tensor(r["turn_rewards"], dtype=torch.float64)
        turn_end[i, r["turn_ends"]] = True
    action = torch.where(mask, obs["input_ids"][:, P:], 0)  # collect_episodes leaves 0 on a partner's columns
    scalars = {k: torch.tensor([r[k] for r in records], dtype=d) for k, d in SCALARS.items()}
    scalars["eos_penalty"] = -scalars["missing_eos_penalty"]  # the deprecated column (issue 43), for one version
    td = TensorDict({**obs, **per_token, **scalars, "action": action, "mask": mask, "turn_reward": turn_reward,
                     "turn_end": turn_end}, batch_size=[B])  # fmt: skip
    for key in ("prompt", "response"):
        td[key] = NonTensorStack.from_list([r[key] for r in records])
    if any(r["transcript"] is not None for r in records):
        td["transcript"] = NonTensorStack.from_list([r["transcript"] or "" for r in records])
    return td


def _same(records: Sequence[dict[str, Any]], key: str) -> int:
    values = sorted({int(r[key]) for r in records})
    if len(values) > 1:
        raise ValueError(f"records: {key} takes the values {values}; one TensorDict holds episodes of one env "
                         "(read them in separate files, one per env)")  # fmt: skip
    return values[0]


# ---------------------------------------------------------------- files
def write_records(records: Sequence[dict[str, Any]], path: str | Path, format: str | None = None) -> None:
    """Write records (:func:`episode_records`) to ``path`` as JSONL or Parquet (:func:`trajectory_format`),
    through a temp file beside it and a rename: a failure leaves no file, or the old one."""
    kind = trajectory_format(path, format)
    records = [_checked(r, k, "records") for k, r in enumerate(records)]
    if kind == "jsonl":
        lines = [_json_line(r, k) for k, r in enumerate(records)]
        write_file_atomically(path, lambda f: f.write("".join(lines).encode("utf-8")), "path")
    else:
        import datasets

        dataset = datasets.Dataset.from_list(records, features=_features())
        with _quiet(datasets):
            write_file_atomically(path, dataset.to_parquet, "path")


def read_records(path: str | Path, format: str | None = None) -> list[dict[str, Any]]:
    """The records of a file :func:`write_records` wrote. JSONL's null scores (JSON has no NaN) are NaN again."""
    kind, where = trajectory_format(path, format), f"path={str(path)!r}"
    rows = _read_jsonl(path, where) if kind == "jsonl" else _read_parquet(path, where)
    records = [_checked(r, k, where) for k, r in enumerate(rows)]
    for r in records:
        for k, d in SCALARS.items():
            if d == torch.float64 and r[k] is None:
                r[k] = math.nan
    return records


def _read_jsonl(path: str | Path, where: str) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as err:
                raise ValueError(f"{where}: line {number} is not JSON ({err}); a .jsonl file of trajectories holds "
                                 "one record per line (textgym.trajectories)") from None  # fmt: skip
    return rows


def _read_parquet(path: str | Path, where: str) -> list[dict[str, Any]]:
    """Read through ``datasets``, as other trainers do, with the records' schema; no copy in the user's HF cache."""
    import datasets

    with tempfile.TemporaryDirectory() as cache, _quiet(datasets):
        try:
            dataset = datasets.Dataset.from_parquet(str(path), features=_features(), cache_dir=cache,
                                                    keep_in_memory=True)  # fmt: skip
        except datasets.exceptions.DatasetGenerationError as err:
            raise ValueError(f"{where} is not a Parquet file of trajectory records ({err.__cause__ or err}); "
                             "write one with textgym.trajectories.export_episodes") from err  # fmt: skip
        return dataset.to_list()


def _checked(record: dict[str, Any], k: int, where: str) -> dict[str, Any]:
    """``record`` if it has exactly the fields and consistent lengths; else one error naming the record."""
    if set(record) != set(FIELDS):
        raise ValueError(f"{where}: record {k} has the fields {sorted(record)}; a trajectory record has "
                         f"{sorted(FIELDS)} (textgym.trajectories)")  # fmt: skip
    n, R = len(record["prompt_token_ids"]), len(record["completion_token_ids"])
    lengths = {name: len(record[name]) for name in PER_TOKEN}
    turns = len(record["turn_rewards"]), len(record["turn_ends"])
    if len(record["loss_mask"]) != n + R or set(lengths.values()) - {R} or turns[0] != turns[1]:
        raise ValueError(f"{where}: record {k} has {n} prompt and {R} completion tokens but a loss_mask of "
                         f"{len(record['loss_mask'])} (prompt + completion), per-token lists of {lengths} ({R} "
                         f"each) and {turns[0]} turn_rewards for {turns[1]} turn_ends")  # fmt: skip
    fits = (
        n <= record["max_prompt_tokens"]
        and R <= record["max_new_tokens"]
        and all(0 <= e < R for e in record["turn_ends"])
    )
    if not fits:
        raise ValueError(f"{where}: record {k}'s {n} prompt and {R} completion tokens (turn_ends "
                         f"{record['turn_ends']}) do not fit its blocks: max_prompt_tokens="
                         f"{record['max_prompt_tokens']}, max_new_tokens={record['max_new_tokens']}")  # fmt: skip
    return record


def _json_line(record: dict[str, Any], k: int) -> str:
    """One JSON line; a NaN score becomes null (JSON has no NaN); any other non-finite number is refused."""
    plain = {key: None if isinstance(v, float) and math.isnan(v) else v for key, v in record.items()}
    try:
        return json.dumps(plain, allow_nan=False, ensure_ascii=False) + "\n"
    except ValueError as err:
        bad = [key for key, v in record.items() if not _finite(v)]
        raise ValueError(f"records: record {k} has non-finite numbers in {bad}, which JSON cannot hold; write "
                         "it as Parquet (format='parquet')") from err  # fmt: skip


def _finite(value: Any) -> bool:
    values = value if isinstance(value, list) else [value]
    return all(not isinstance(v, float) or math.isfinite(v) or math.isnan(v) for v in values)


def _features():
    """The records' schema for ``datasets``: declared, so an empty list or an all-null column keeps its type."""
    from datasets import Features, List, Value

    ints, floats = List(Value("int64")), List(Value("float32"))
    scalar = {torch.float64: Value("float64"), torch.int64: Value("int64"), torch.bool: Value("bool")}
    return Features({"prompt_token_ids": ints, "completion_token_ids": ints, "loss_mask": List(Value("int8")),
                     **{name: floats for name in PER_TOKEN}, "turn_rewards": List(Value("float64")),
                     "turn_ends": ints, **{k: scalar[d] for k, d in SCALARS.items()},
                     **{k: Value("string") for k in TEXTS}, **{k: Value("int64") for k in BLOCKS}})  # fmt: skip


@contextlib.contextmanager
def _quiet(datasets) -> Iterator[None]:
    """``datasets``' progress bars off for a file of a few records, and back as they were."""
    shown = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.utils.enable_progress_bars()
