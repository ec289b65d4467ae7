"""skyrl-gym environments as partners: ``partner="skyrl:gsm8k"``, ``"skyrl:gsm8k_multi_turn"``, ``"skyrl:aime"``.

skyrl-gym (0.4.0, ``import skyrl_gym``) envs are text-in/text-out ``BaseTextEnv``: built per episode from a
dataset row (``skyrl_gym.make(env_id, env_config=..., extras=row)``, the row carrying the ground truth),
``init(prompt)`` returns the row's chat prompt, and ``step(action: str)`` returns ``observations`` (chat
messages), ``reward`` and ``done``. Here the env is the partner: the row's prompt opens the episode, each policy
turn is one ``step``, the observations' contents are the user's next turn, ``reward`` the turn's reward. Needs
the extra: ``pip install 'textgym[skyrl]'``.

Which row an episode plays (skyrl-gym itself has no seeds: an env is its row):

- ``SkyRLPartner(env_id, rows=[...])``: rows in skyrl's dataset format, ``{"prompt": str | [{"role", "content"},
  ...], **extras}`` (for gsm8k ``"reward_spec": {"ground_truth": "72"}``, for aime ``"reward_model":
  {"ground_truth": ...}``); the episode of seed ``s`` plays ``rows[s % len(rows)]``. Pass the instance as
  ``partner=`` (each env slot gets a copy). A held-out set is another list of rows.
- without rows (``partner="skyrl:gsm8k"``): :func:`arithmetic_row` makes the seed's row, a problem
  ``a + b × c`` drawn by ``numpy.random.default_rng(seed)`` and worded in the env's answer format (gsm8k:
  ``#### N`` as SkyRL's GSM8K prompt asks; aime: ``Answer: N``). Seeds from 2**30 on (the env's held-out
  range) draw other problems from the same distribution.

The same seed gives the same row and, since these envs draw nothing at random, the same episode, in any process.

Offline (:data:`OFFLINE_ENVS`): ``gsm8k`` (one turn, 1.0 for the right ``#### N``), ``gsm8k_multi_turn`` (up to
5 turns; 1.0 for the right answer ends it, a well-formatted wrong one pays 0.2/max_turns), ``aime`` (one turn,
1.0 right, -1.0 wrong). Refused (:data:`REFUSED`): ``text2sql``, ``search``, ``searchcode``, ``lcb``, naming
what each needs.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from textgym.errors import short_repr
from textgym.imports import import_optional

__all__ = ["OFFLINE_ENVS", "REFUSED", "SkyRLPartner", "arithmetic_row"]

# The registered ids (skyrl_gym.envs) that run offline: ``make`` with a row, ``init``, a ``step`` in a process
# whose socket connect and getaddrinfo raise OSError (skyrl-gym 0.4.0); none of them reads a file or a server.
OFFLINE_ENVS = frozenset({"gsm8k", "gsm8k_multi_turn", "aime"})

_RUNS_CODE = "runs the policy's code on this machine without a sandbox"
REFUSED: dict[str, str] = {
    "text2sql": "the SQLite databases of Spider, BIRD or SynSQL-2.5M, downloaded into env_config.db_path",
    "search": "a Search-R1 retrieval server over HTTP (env_config.search_url)",
    "searchcode": f"a Search-R1 retrieval server over HTTP, and it {_RUNS_CODE} (python -c)",
    "lcb": f"LiveCodeBench's test cases (rows of its downloaded dataset), and it {_RUNS_CODE}",
}

# How each offline env reads its ground truth and wants the answer written (the generated rows' wording).
_GROUND_TRUTH_KEY = {"gsm8k": "reward_spec", "gsm8k_multi_turn": "reward_spec", "aime": "reward_model"}
_ANSWER_FORMAT = {
    "gsm8k": 'Let\'s think step by step and output the final answer after "####".',
    "gsm8k_multi_turn": 'Let\'s think step by step and output the final answer after "####".',
    "aime": 'Give the final answer on its own line as "Answer: N".',
}


def _skyrl():
    """The skyrl_gym module, imported on first use (an optional extra)."""
    return import_optional("skyrl_gym", "skyrl-gym environments", "skyrl-gym", "pip install 'textgym[skyrl]'")


def arithmetic_row(env_id: str, seed: int) -> dict[str, Any]:
    """The row an episode of ``env_id`` plays for ``seed`` when no rows are given: ``a + b × c``, a, b, c in 2..99.

    Returns:
        ``{"prompt": [{"role": "user", "content": ...}], <the env's ground-truth key>: {"ground_truth": "..."},
        "extra_info": {"seed": seed}}``, as a row of SkyRL's own datasets.
    """
    if env_id not in OFFLINE_ENVS:
        raise ValueError(f"env_id={env_id!r}: arithmetic rows are made for {', '.join(sorted(OFFLINE_ENVS))}")
    a, b, c = (int(x) for x in np.random.default_rng(seed).integers(2, 100, size=3))
    question = f"What is {a} + {b} × {c}? {_ANSWER_FORMAT[env_id]}"
    return {"prompt": [{"role": "user", "content": question}],
            _GROUND_TRUTH_KEY[env_id]: {"method": "rule", "ground_truth": str(a + b * c)},
            "extra_info": {"seed": seed}}  # fmt: skip


def _check_id(env_id: str) -> None:
    """Refuse an unknown id and an env that needs a database, a server or a download, naming it and the allowed ids.

    Raises:
        ValueError: naming the id, what it needs, and the offline ids.
    """
    registry = _skyrl().registry
    allowed = ", ".join(sorted(OFFLINE_ENVS))
    if env_id not in registry:
        near = difflib.get_close_matches(env_id, sorted(registry), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        raise ValueError(f"skyrl-gym has no env {env_id!r}; {hint}the envs that run offline are: {allowed}")
    if env_id in REFUSED or env_id not in OFFLINE_ENVS:
        need = REFUSED.get(env_id, "a check that it runs offline (it is not in textgym.partners.skyrl.OFFLINE_ENVS)")
        raise ValueError(f"skyrl-gym env {env_id!r} needs {need}, and textgym runs skyrl-gym envs offline; "
                         f"the envs that run offline are: {allowed}")  # fmt: skip


def _opening(prompt: Any, where: str) -> str:
    """A row's prompt as the episode's opening: a str as is, chat messages' contents joined by blank lines."""
    if isinstance(prompt, str):
        return prompt
    ok = isinstance(prompt, list) and prompt and all(
        isinstance(m, Mapping) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user")
        for m in prompt
    )  # fmt: skip
    if not ok:
        raise ValueError(f"{where}['prompt']={short_repr(prompt)} must be a str or a non-empty list of "
                         "{'role': 'system' | 'user', 'content': str} messages")  # fmt: skip
    return "\n\n".join(m["content"] for m in prompt)


class SkyRLPartner:
    """A skyrl-gym environment as a partner, one env per episode, built from the row the seed picks.

    Args:
        env_id: a registered skyrl-gym id that runs offline (:data:`OFFLINE_ENVS`).
        rows: the episodes, rows of a skyrl dataset (module docstring); default: :func:`arithmetic_row` per seed.

    Raises:
        ImportError: skyrl-gym is not installed (``pip install 'textgym[skyrl]'``).
        ValueError: an unknown or refused id; a row that is not a mapping with a ``prompt``, or that the env
            cannot be built from (naming ``rows[i]`` and skyrl's own message).

    Example:
        >>> env = SkyRLPartner("gsm8k", rows=[{"prompt": "2 + 2?", "reward_spec": {"ground_truth": "4"}}])
        >>> env.reset(seed=7, prompt="")
        '2 + 2?'
        >>> env.reply([{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "#### 4"}])
        ('', 1.0, True)
    """

    def __init__(self, env_id: str, rows: Iterable[Mapping[str, Any]] | None = None):
        if not isinstance(env_id, str):
            raise TypeError(f"env_id={env_id!r} must be a str, a skyrl-gym id such as 'gsm8k'")
        _check_id(env_id)
        self.env_id, self.name = env_id, f"skyrl:{env_id}"
        self.rows = None if rows is None else [dict(row) for row in self._checked(rows)]
        if self.rows is not None:
            for i, row in enumerate(self.rows):  # build each once: a row without its ground truth fails here
                self._build(row, f"rows[{i}]")
        self._env: Any = None
        self._last: tuple[tuple[int, str], tuple[str, float, bool]] | None = None  # (call key, its result)

    def reset(self, *, seed: int, prompt: str) -> str:
        """Build the env of the seed's row (module docstring); returns the row's prompt, which replaces ``prompt``."""
        if self.rows is None:
            row, where = arithmetic_row(self.env_id, seed), f"arithmetic_row({self.env_id!r}, {seed})"
        else:
            row, where = self.rows[seed % len(self.rows)], f"rows[{seed % len(self.rows)}]"
        self._env, opening = self._build(row, where)
        self._last = None
        return opening

    def reply(self, conversation: list[dict[str, str]]) -> tuple[str, float, bool]:
        """Step the env with the policy's last turn: the observations' text, the turn's reward, done.

        Idempotent for a retry (same conversation length and last turn: the previous result, no second step), as
        :class:`~textgym.partners.textarena.TextArenaPartner`: the env asks every slot again after an undone step.
        """
        key = (len(conversation), conversation[-1]["content"])
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        if self._env is None:
            raise RuntimeError(f"the skyrl-gym env {self.env_id!r} is over (or was never started); reset() starts one")
        out = self._env.step(key[1])
        text = "\n\n".join(str(m.get("content", "")) for m in out.get("observations") or [])
        result = text, float(out["reward"]), bool(out["done"])
        self._last = key, result
        if result[2]:
            self._env.close()
            self._env = None
        return result

    def verdict(self) -> bool:
        """Whether the episode ended solved: skyrl-gym's offline envs pay 1.0 for the right answer on the step
        that ends it (gsm8k 1/0, aime 1/−1, gsm8k_multi_turn 1 after its format rewards); an episode cut
        before its end was not solved."""
        return self._last is not None and self._last[1][2] and self._last[1][1] >= 1.0

    def _build(self, row: dict[str, Any], where: str) -> tuple[Any, str]:
        """``skyrl_gym.make`` with the row's extras, ``init`` with its prompt: the env and the opening text."""
        opening = _opening(row["prompt"], where)
        extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
        try:
            env = _skyrl().make(self.env_id, env_config=None, extras=extras)
            env.init(row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": opening}])
        except (AssertionError, KeyError, TypeError, ValueError) as err:  # skyrl checks a row with assert
            raise ValueError(f"{where}: skyrl-gym env {self.env_id!r} cannot be built from it "
                             f"({type(err).__name__}: {err})") from err  # fmt: skip
        return env, opening

    @staticmethod
    def _checked(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """``rows`` as a non-empty list of mappings with a ``prompt``, or one error naming the bad row."""
        if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Iterable):
            raise TypeError(f"rows={short_repr(rows)} must be a list of skyrl dataset rows (dicts with 'prompt')")
        rows = list(rows)
        if not rows:
            raise ValueError("rows=[]: give at least one row, or rows=None for the seeded arithmetic rows")
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping) or "prompt" not in row:
                raise ValueError(f"rows[{i}]={short_repr(row)} must be a dict with a 'prompt' and the env's extras")
        return rows
