"""GEM environments as partners: ``partner="gem:game:GuessTheNumber-v0-easy"``, ``partner="gem:rg:basic_arithmetic"``.

GEM (gem-llm 0.1.0, ``import gem``) steps whole turns: ``reset(seed) -> (observation, info)`` and
``step(action: str) -> (observation, reward, terminated, truncated, info)``. Here the env is the partner:
its reset observation opens the episode, each policy turn is one ``step``, and the step's observation is
the user's next turn; GEM's reward for the turn is the turn's reward, ``terminated or truncated`` ends the
episode. Needs the extra: ``pip install 'textgym[gem]'``.

How a message reads: as GEM's ``concat`` observation wrapper adds it to the model's context — the
observation, then on a new line the info's ``suffix`` (a game's board and "Enter your next guess."). GEM's
single-turn reasoning-gym envs answer GEM's end-of-episode marker, which becomes an empty reply.

Envs checked to work offline (gem-llm 0.1.0 with reasoning-gym 0.1.25, every registered id: ``gem.make``,
``reset(seed=0)``, up to three steps, in a subprocess per id with the socket module's connect and
getaddrinfo raising OSError):

- games: ``game:<Game>-v0-easy``, ``-hard``, ``-random`` for GuessTheNumber, Mastermind, Minesweeper, Sudoku,
  TowerofHanoi, Game2048 (also ``-extreme-hard``) and Sokoban; ``-easy``, ``-hard`` for FifteenPuzzle and
  Crosswords (their ``-random`` fails in GEM's own constructor);
- single-turn tasks: ``rg:<dataset>``, reasoning-gym's procedurally generated datasets as GEM wraps them
  (the question opens, the policy answers once, ``\\boxed{answer}`` is scored by the dataset's
  ``score_answer``, and the episode ends; an answer whose scorer raises scores 0), except those in
  :data:`REFUSED`.

Refused (:data:`REFUSED`): Wordle, Hangman and WordSearch (the nltk ``words`` corpus, downloaded), every
``math:``, ``code:``, ``logic:``, ``qa:`` and ``eval:`` env (a Hugging Face dataset, downloaded; the code
envs also run the policy's code), ``rg:composite`` (GEM registers it without the datasets to mix), and the two
broken ``-random`` games.

Seeds: GEM's ``reset(seed)`` seeds Python's global ``random`` and NumPy's global RNG, and its games draw from
them in ``reset`` and ``step`` (2048's new tile, Minesweeper's mines at the first reveal). Each partner swaps
its own state of both generators in around every call under one lock, so an episode is a function of its
seed and the policy's turns, whatever other slots or the caller draw in between, also in another process.
NumPy's global RNG takes seeds below 2**32: a larger seed is refused.

reasoning-gym pin: gem-llm 0.1.0 pins reasoning-gym 0.1.23, textgym's dev extra has 0.1.25; ``import gem``
imports reasoning_gym and registers one ``rg:`` env per dataset of the installed version. ``make`` installs
gem-llm with ``--no-deps`` beside 0.1.25: what GEM uses of reasoning-gym (``create_dataset``, ``score_answer``,
the dataset registry) is there in 0.1.25, the offline probe ran every ``rg:`` id on it, and the tests play one.
"""

from __future__ import annotations

import difflib
import logging
import random
import threading
from typing import Any

import numpy as np

from textgym.imports import import_optional

__all__ = ["OFFLINE_GAMES", "REFUSED", "GEMPartner", "offline_ids"]

# The game families (``game:<Game>-v0-…``) whose every registered id passed the offline probe (module docstring).
OFFLINE_GAMES = frozenset(
    "GuessTheNumber Mastermind Minesweeper FifteenPuzzle Sudoku TowerofHanoi Game2048 Sokoban Crosswords".split()
)

_NLTK_WORDS = "the nltk 'words' corpus, which it downloads from the internet (nltk.download('words'))"
_HF_DATASET = "the Hugging Face dataset {dataset!r}, which it downloads (datasets.load_dataset)"
# What the refused envs need, by exact id first, then by family (``game:Wordle``) or namespace (``math:``).
# ``{dataset}`` is filled from the env's registered ``dataset_name``.
REFUSED: dict[str, str] = {
    "game:Wordle": _NLTK_WORDS,
    "game:Hangman": _NLTK_WORDS,
    "game:WordSearch": _NLTK_WORDS,
    "game:FifteenPuzzle-v0-random": "a fix in GEM: its constructor fails in gem-llm 0.1.0 (num_rows=None: TypeError)",
    "game:Crosswords-v0-random": "a fix in GEM: its constructor fails in gem-llm 0.1.0 (hardcore=None: no words)",
    "rg:composite": "a list of reasoning-gym datasets to mix, which GEM registers it without (AssertionError)",
    "math:Geometry3K": _HF_DATASET + " with images (a vision-language env)",
    "math:": _HF_DATASET,
    "code:": _HF_DATASET + ", and it runs the policy's code in a sandbox",
    "logic:": _HF_DATASET,
    "qa:": _HF_DATASET,
    "eval:": _HF_DATASET,
}

# GEM's envs draw from Python's `random` and NumPy's global RNG, which their reset seeds (GEM's behaviour, kept).
# Each partner swaps its own state of both in around each call, under this lock (module docstring, Seeds).
_RNG_LOCK = threading.Lock()
_NUMPY_SEEDS = 2**32  # np.random.seed takes 0 <= seed < 2**32
_END_MARKER = "<｜TERMINAL_STATE｜>"  # gem.utils.constants.TERMINAL_STATE: a single-turn env's "no next observation"


def _gem():
    """The gem module, imported on first use (an optional extra), without the root log handler it installs.

    Why undo it: ``import gem`` calls ``logging.basicConfig(level=INFO)``, which would make every library's
    INFO records print in the user's process.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        gem = import_optional("gem", "GEM environments", "gem-llm", "pip install 'textgym[gem]'")
    finally:
        for handler in root.handlers[len(handlers) :]:
            root.removeHandler(handler)
        root.setLevel(level)
    return gem


def _registry() -> dict[str, Any]:
    _gem()
    from gem.envs.registration import ENV_REGISTRY

    return ENV_REGISTRY


def _family(env_id: str) -> str:
    """``game:Wordle`` for ``game:Wordle-v0-hard``; the namespace (``math:``) for the other envs."""
    namespace, _, name = env_id.partition(":")
    return f"{namespace}:{name.partition('-v')[0]}" if namespace == "game" else f"{namespace}:"


def _refusal(env_id: str) -> str | None:
    """What ``env_id`` needs that textgym cannot offer offline, or None."""
    need = REFUSED.get(env_id) or REFUSED.get(_family(env_id))
    if need is None:
        return None
    return need.format(dataset=_registry()[env_id].kwargs.get("dataset_name", "?"))


def offline_ids() -> list[str]:
    """The registered GEM ids that run offline: the games of :data:`OFFLINE_GAMES` and the ``rg:`` envs."""
    return sorted(gid for gid in _registry() if _refusal(gid) is None and _offline(gid))


def _offline(env_id: str) -> bool:
    return env_id.startswith("rg:") or _family(env_id).partition(":")[2] in OFFLINE_GAMES


def _check_id(env_id: str) -> None:
    """Refuse an unknown id and an env that needs a download, naming the id and what is allowed.

    Raises:
        ValueError: naming the id and the nearby offline ids, or all offline games.
    """
    registry = _registry()
    allowed = offline_ids()
    games = ", ".join(g for g in allowed if g.startswith("game:"))
    if env_id not in registry:
        near = difflib.get_close_matches(env_id, allowed, n=5, cutoff=0.6)
        shown = f"did you mean {', '.join(near)}?" if near else f"the offline games are: {games}; and rg:<dataset>"
        raise ValueError(f"GEM has no env {env_id!r}; {shown}")
    need = _refusal(env_id)
    if need is None and not _offline(env_id):  # a namespace or game registered after this list was made
        need = "a check that it runs offline (it is not in textgym.partners.gem.OFFLINE_GAMES)"
    if need is not None:
        raise ValueError(f"GEM env {env_id!r} needs {need}, and textgym runs GEM envs offline; "
                         f"the offline games are: {games}; and rg:<dataset> (reasoning-gym)")  # fmt: skip


class GEMPartner:
    """A GEM environment as a partner: its observations are the user's turns, its rewards the turns' rewards.

    Args:
        env_id: a registered GEM id (``"game:GuessTheNumber-v0-easy"``; see the module docstring's list).
        **env_kwargs: passed to the env's constructor over its registered ones (``max_turns=5``).

    Raises:
        ImportError: gem-llm is not installed (``pip install 'textgym[gem]'``).
        ValueError: an unknown id, or an env that needs a download.

    Example:
        >>> game = GEMPartner("game:GuessTheNumber-v0-easy")
        >>> opening = game.reset(seed=0, prompt="")
        >>> game.reply([{"role": "user", "content": opening}, {"role": "assistant", "content": "\\\\boxed{5}"}])[1:]
        (0.0, False)
    """

    def __init__(self, env_id: str, **env_kwargs: Any):
        gem = _gem()
        if not isinstance(env_id, str):
            raise TypeError(f"env_id={env_id!r} must be a str, a GEM id such as 'game:GuessTheNumber-v0-easy'")
        _check_id(env_id)
        self.env_id = env_id
        self.name = f"gem:{env_id}"
        self._rng: tuple[Any, Any] | None = None  # this env's states of `random` and np.random between calls
        self._env = self._in_own_rng(lambda: gem.make(env_id, **env_kwargs))  # its constructor resets: draws
        self._last: tuple[tuple[int, str], tuple[str, float, bool]] | None = None  # (call key, its result)
        self._over = True  # no episode until reset

    def reset(self, *, seed: int, prompt: str) -> str:
        """Start an episode from ``seed``; returns its opening (a game's rules and board), which replaces ``prompt``."""
        if not 0 <= seed < _NUMPY_SEEDS:
            raise ValueError(f"seed={seed}: GEM seeds NumPy's global RNG, which takes seeds in [0, 2**32)")
        if self.env_id.startswith("rg:"):  # GEM swaps in a new problem set when its reset counter reaches 499;
            self._env.idx = 0  # keeping the counter at 0 keeps one set, so a seed always picks the same problem
        observation, info = self._in_own_rng(lambda: self._env.reset(seed=seed))
        self._last, self._over = None, False
        return _message(observation, info)

    def reply(self, conversation: list[dict[str, str]]) -> tuple[str, float, bool]:
        """Step the env with the policy's last turn; its observation (and suffix), the turn's reward, done.

        Idempotent for a retry: a call with the same conversation as the previous one (same length, same last
        turn) returns the previous result without stepping again. Why: when a step fails elsewhere (another
        slot's partner, the reward model) the env undoes it and asks every slot again; a second step would
        spend one of the game's turns twice.
        """
        key = (len(conversation), conversation[-1]["content"])
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        if self._over:
            raise RuntimeError(f"the GEM env {self.env_id!r} is over (or was never started); reset() starts a new one")
        observation, reward, terminated, truncated, info = self._in_own_rng(lambda: self._step(key[1]))
        result = _message(observation, info), float(reward), bool(terminated or truncated)
        self._last, self._over = (key, result), result[2]
        return result

    def verdict(self) -> bool:
        """Whether the episode ended solved: GEM pays ``LanguageGameReward.success_reward`` (1.0) on the step
        that completes a game, and a reasoning-gym task's full credit is 1.0; an episode cut before its end
        was not solved."""
        return self._last is not None and self._last[1][2] and self._last[1][1] >= 1.0

    def _step(self, action: str) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """GEM's ``step``; for a reasoning-gym task, an answer whose scorer raises scores 0 and ends the episode.

        Why: some reasoning-gym scorers raise on an answer they cannot parse instead of scoring it 0 (three of
        105 in 0.1.25: boxnet on ``\\boxed{1}``, game_of_life on a JSON object, prime_factorization on
        ``\\boxed{abc}``), and a policy writes such answers; 0 is the scorer's own verdict for an answer it cannot
        read (no ``\\boxed{}``).
        """
        if not self.env_id.startswith("rg:"):
            return self._env.step(action)
        try:
            return self._env.step(action)
        except Exception:  # the step is the extraction of the boxed answer and score_answer: nothing else to fail
            return _END_MARKER, 0.0, True, True, {}

    def _in_own_rng(self, fn):
        """``fn()`` with this env's states of ``random`` and NumPy's global RNG swapped in, the caller's put back."""
        with _RNG_LOCK:
            outside = random.getstate(), np.random.get_state()
            if self._rng is not None:
                random.setstate(self._rng[0])
                np.random.set_state(self._rng[1])
            try:
                return fn()
            finally:
                self._rng = random.getstate(), np.random.get_state()
                random.setstate(outside[0])
                np.random.set_state(outside[1])


def _message(observation: Any, info: dict[str, Any]) -> str:
    """One GEM observation as its ``concat`` wrapper writes it: the text, a newline, the info's suffix."""
    text = "" if observation == _END_MARKER else str(observation)
    suffix = str((info or {}).get("suffix", ""))
    if text and suffix and not text.endswith("\n"):
        text += "\n"
    return text + suffix
