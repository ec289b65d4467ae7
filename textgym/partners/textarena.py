"""TextArena single-player games as partners: ``partner="textarena:GuessTheNumber-v0"``.

The game is the partner: its rules and board open the episode, each policy turn is one move, and
the game's messages are the user's next turn. Needs the extra: ``pip install 'textgym[textarena]'``
(textarena 0.7.4).

How a game's messages read: as TextArena's own ``LLMObservationWrapper`` shows them to a model, one
``[GAME] message`` line each, without the policy's own moves (the conversation holds those already)::

    [GAME] You are Player 0. You are playing Guess The Number.
    You have to guess the number between 1 and 20 within 10 turns.
    ...
    Enter your guess.

and after ``"[10]"`` the reply is ``[GAME] The target number is lower.``; the game's end adds its
reason (``[GAME] Congratulations! You guessed the correct number.``) and its reward for player 0.

Single-player games checked to work offline (textarena 0.7.4, every registered id of each: reset,
three moves, close), with their ids:

- Game2048: ``2048-v0`` and its ``-ultra-easy``, ``-mega-easy``, ``-super-easy``, ``-very-easy``,
  ``-easy``, ``-hard``, ``-very-hard``, ``-extreme``, ``-3x3``, ``-5x5``, ``-6x6``, ``-8x8``, ``-10x10``
- Bandit (``Bandit-v0``, ``-hard``), Blackjack (``Blackjack-v0``, ``-long``), Countdown (``Countdown-v0``),
  Crosswords (``Crosswords-v0``, ``-hardcore``), Cryptarithm (``Cryptarithm-v0``),
  FifteenPuzzle (``FifteenPuzzle-v0``), FrozenLake (``FrozenLake-v0``, ``-random``, ``-hardcore``),
  GuessTheNumber (``GuessTheNumber-v0``, ``-hardcore``), LightsOut (``LightsOut-v0``),
  LogicPuzzle (``LogicPuzzle-v0``, ``-hard``), Mastermind (``Mastermind-v0``, ``-hard``, ``-extreme``),
  Minesweeper (``Minesweeper-v0``, ``-small``, ``-medium``, ``-hard``), PegJump (``PegJump-v0``),
  RushHour (``RushHour-v0``), Secretary (``Secretary-v0``, ``-long``), Set (``Set-v0``),
  Slitherlink (``Slitherlink-v0``), Sokoban (``Sokoban-v0``, ``-medium``),
  Sudoku (``Sudoku-v0``, ``-very-easy``, ``-easy``, ``-medium``, ``-hard``), ThreeCardMonte (``ThreeCardMonte-v0``),
  TowerOfHanoi (``TowerOfHanoi-v0``, ``-medium``, ``-hard``, ``-hardcore``, ``-extreme``)

Each of them gives the same game and the same replies for the same seed and moves, also in another
process (another ``PYTHONHASHSEED``). Refused: the single-player games in :data:`REFUSED_GAMES` (they
download data or call an LLM over the network) and every multi-player game.
"""

from __future__ import annotations

import contextlib
import difflib
import random
import sys
import threading
from collections.abc import Iterator
from typing import Any

from textgym.imports import import_optional

__all__ = ["OFFLINE_GAMES", "REFUSED_GAMES", "GuessTheNumber10", "TextArenaPartner", "single_player_ids"]

# The games (TextArena's folders, ``textarena.envs.<Game>``) found to work offline: each registered id
# reset with num_players=1, stepped three times and closed, in a subprocess per game with the socket
# module's connect and getaddrinfo raising OSError (textarena 0.7.4, Python 3.11).
OFFLINE_GAMES = frozenset(
    "Game2048 Bandit Blackjack Countdown Crosswords Cryptarithm FifteenPuzzle FrozenLake GuessTheNumber LightsOut "
    "LogicPuzzle Mastermind Minesweeper PegJump RushHour Secretary Set Slitherlink Sokoban Sudoku ThreeCardMonte "
    "TowerOfHanoi".split()
)

# The single-player games (marked "[1 Player]" in textarena/envs/__init__.py) that the same probe found
# to need something textgym cannot offer offline, and what. Refused before their module is imported:
# the nltk ones call nltk.download() on import, which waits on the network.
_NLTK_WORDS = "the nltk 'words' corpus, which it downloads from the internet when imported (nltk.download)"
_LLM_HOST = "an LLM game master over the network (OpenRouter: OPENROUTER_API_KEY and internet access)"
REFUSED_GAMES: dict[str, str] = {
    "Hangman": _NLTK_WORDS,
    "WordLadder": _NLTK_WORDS,
    "Wordle": _NLTK_WORDS,
    "WordSearch": _NLTK_WORDS,
    "GuessWho": _LLM_HOST,
    "TwentyQuestions": _LLM_HOST,
    "BabyAiText": "the gym, babyai and babyai_text packages (github.com/flowersteam/Grounding_LLMs_with_online_RL)",
}
if sys.version_info < (3, 12):  # their source uses f-strings only Python 3.12 parses (PEP 701): a SyntaxError here
    REFUSED_GAMES |= {
        g: "Python >= 3.12 (its source uses PEP 701 f-strings)" for g in ("Klondike", "UltimateTexasHoldem")
    }

# Every game's randomness runs on Python's global `random`, which the game's state seeds at reset (TextArena's
# behaviour, kept). Each partner swaps its own generator state in around each game call, under this lock, so a
# game is a function of its seed and moves, whatever other slots or the caller draw in between.
_RANDOM_LOCK = threading.Lock()


def _textarena():
    """The textarena module, imported on first use (it is an optional extra)."""
    return import_optional("textarena", "TextArena games", "textarena", "pip install 'textgym[textarena]'")


def _game(spec: Any) -> str | None:
    """The TextArena game folder of a registry entry (``GuessTheNumber``), None for a game registered elsewhere."""
    entry = spec.entry_point  # "module:Class", or the class itself
    module = (entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")).split(".")
    return module[2] if module[:2] == ["textarena", "envs"] and len(module) > 2 else None


def single_player_ids() -> list[str]:
    """The registered ids of the single-player games checked to work offline (without ``-raw``/``-train`` variants)."""
    _textarena()  # first: its ImportError says which extra to install
    from textarena.envs.registration import ENV_REGISTRY

    return sorted(
        gid
        for gid, spec in ENV_REGISTRY.items()
        if _game(spec) in OFFLINE_GAMES and not gid.endswith(("-raw", "-train"))
    )


def _check_game(game_id: str) -> None:
    """Refuse an unknown id, a game that needs a download or a network host, and a multi-player game.

    Raises:
        ValueError: naming the id and what is allowed (nearby ids, or all single-player ones).
    """
    from textarena.envs.registration import ENV_REGISTRY

    ids = single_player_ids()
    if game_id not in ENV_REGISTRY:
        near = difflib.get_close_matches(game_id, ids, n=5, cutoff=0.6)
        shown = f"did you mean {', '.join(near)}?" if near else f"the single-player games are: {', '.join(ids)}"
        raise ValueError(f"TextArena has no game {game_id!r}; {shown}")
    game = _game(ENV_REGISTRY[game_id])
    if game in REFUSED_GAMES:
        raise ValueError(
            f"TextArena game {game_id!r} needs {REFUSED_GAMES[game]}, and textgym runs games offline; "
            f"the single-player games checked to work offline are: {', '.join(ids)}"
        )
    if game is not None and game not in OFFLINE_GAMES:
        raise ValueError(
            f"TextArena game {game_id!r} is a multi-player game; only single-player games are supported "
            f"(the policy is player 0 and the game is its only partner): {', '.join(ids)}"
        )


@contextlib.contextmanager
def _missing_data_refused(game_id: str) -> Iterator[None]:
    """Turn an error that means data the game could not find or fetch into a ValueError naming the game.

    nltk raises a plain LookupError for a missing corpus (KeyError and IndexError, LookupErrors too, are
    bugs, not missing data, and pass through); a fetch or a read fails with an OSError (URLError,
    ConnectionError, requests' errors and FileNotFoundError all are).
    """
    try:
        yield
    except (LookupError, OSError) as err:
        if isinstance(err, (KeyError, IndexError)):
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(
            f"TextArena game {game_id!r} needs data it could not find or fetch ({type(err).__name__}: {first}); "
            f"textgym runs games offline: pick one of {', '.join(single_player_ids())}"
        ) from err


class TextArenaPartner:
    """A TextArena single-player game as a partner; the policy is player 0.

    Args:
        game_id: a registered TextArena id (``"GuessTheNumber-v0"``; see the module docstring's list).
        **game_kwargs: passed to the game's constructor over its registered ones (``max_turns=20``).

    Raises:
        ImportError: textarena is not installed (``pip install 'textgym[textarena]'``).
        ValueError: an unknown id, a multi-player game, or a game that needs a download or a network host.

    Example:
        >>> game = TextArenaPartner("GuessTheNumber-v0")
        >>> opening = game.reset(seed=0, prompt="")
        >>> game.reply([{"role": "user", "content": opening}, {"role": "assistant", "content": "[10]"}])
        ('[GAME] The target number is higher.', 0.0, False)
    """

    def __init__(self, game_id: str, **game_kwargs: Any):
        ta = _textarena()
        if not isinstance(game_id, str):
            raise TypeError(f"game_id={game_id!r} must be a str, a TextArena id such as 'GuessTheNumber-v0'")
        _check_game(game_id)
        self.game_id = game_id
        self.name = f"textarena:{game_id}"
        with _missing_data_refused(game_id):
            env = ta.make(game_id, **game_kwargs)
        while isinstance(env, ta.Wrapper):  # the bare game, as its "-raw" id gives: textgym keeps the conversation
            env = env.env
        self._env = env
        self._random_state: Any = None  # the game's own state of Python's `random` between calls
        self._last: tuple[tuple[int, str], tuple[str, float, bool]] | None = None  # (call key, its result)
        self._over = True  # no game until reset

    def reset(self, *, seed: int, prompt: str) -> str:
        """Start a new game from ``seed``; returns its opening (rules and board), which replaces ``prompt``."""
        with _missing_data_refused(self.game_id):
            messages = self._in_own_random(lambda: self._start(seed))
        self._last, self._over = None, False
        return _render(messages)

    def reply(self, conversation: list[dict[str, str]]) -> tuple[str, float, bool]:
        """Play the policy's last turn as a move; the game's new messages, the reward (0.0 until the end), done.

        Idempotent for a retry: a call with the same conversation as the previous one (same length, same
        last turn) returns the previous result without moving again. Why: when a step fails elsewhere
        (another slot's partner, the reward model) the env undoes it and steps again, asking every slot
        again; a second move would spend one of the game's turns twice.
        """
        key = (len(conversation), conversation[-1]["content"])
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        if self._over:
            raise RuntimeError(f"the game {self.game_id!r} is over (or was never started); reset() starts a new one")
        result = self._in_own_random(lambda: self._move(key[1]))
        self._last, self._over = (key, result), result[2]
        return result

    def verdict(self) -> bool:
        """Whether the game ended with the policy's win: TextArena's single-player games pay 1 for a win and
        less for a loss; a game cut before its end was not won."""
        return self._last is not None and self._last[1][2] and self._last[1][1] >= 1.0

    def _start(self, seed: int) -> list:
        self._env.reset(num_players=1, seed=seed)
        return self._env.get_observation()[1]

    def _move(self, action: str) -> tuple[str, float, bool]:
        done, _ = self._env.step(action)
        text = _render(self._env.get_observation()[1])
        if not done:
            return text, 0.0, False
        rewards, game_info = self._env.close()
        if not rewards or 0 not in rewards:
            raise RuntimeError(f"the game {self.game_id!r} ended without a reward for player 0 (rewards={rewards!r})")
        reason = (game_info or {}).get(0, {}).get("reason")
        closing = "\n".join(part for part in (text, f"[GAME] {reason}" if reason else "") if part)
        return closing, float(rewards[0]), True

    def _in_own_random(self, fn):
        """``fn()`` with this game's state of Python's global ``random`` swapped in, the caller's put back after."""
        with _RANDOM_LOCK:
            outside = random.getstate()
            if self._random_state is not None:
                random.setstate(self._random_state)
            try:
                return fn()
            finally:
                self._random_state = random.getstate()
                random.setstate(outside)


class GuessTheNumber10(TextArenaPartner):
    """TextArena's GuessTheNumber over 1..10 in 4 guesses, paying for wins: built-in ``partner="guess-the-number-10"``.

    Rewards: 1 for the winning guess, 0.1 for each valid new guess (the game's hint follows it), 0 for an
    invalid answer; a lost game pays nothing more. Why not the game's own reward: a lost game there pays
    1 − |last valid guess − target| / 9, and GRPO on it learnt to guess the middle once and quit (held-out
    game reward 0.10 → 0.71, wins only 3 % → 11 %; docs/multi-turn.md); here a win always pays more
    than any loss (≤ 0.5), and a valid guess keeps the game going.

    Why this setting: SmolLM2-135M-Instruct's π_ref wins 3 % of it (it rarely writes a guess as ``[k]``,
    and two bad answers in a row end the game); games are short (about 240 tokens with the rules). The
    rules say 4 guesses, but TextArena's turn check lets a fifth through (tested), so a player answering
    valid distinct numbers wins 5/10 and binary search every game.
    """

    WIN, VALID_GUESS = 1.0, 0.1

    def __init__(self):
        super().__init__("GuessTheNumber-v0", min_number=1, max_number=10, max_turns=4)
        self.name = "guess-the-number-10"

    def reply(self, conversation: list[dict[str, str]]) -> tuple[str, float, bool]:
        text, reward, done = super().reply(conversation)
        valid = "invalid move" not in text.lower()  # the warning, or the end after a second invalid answer
        return text, (self.VALID_GUESS if valid else 0.0) + (self.WIN if done and reward == 1.0 else 0.0), done


def _render(messages: list) -> str:
    """The player's observation messages as TextArena's LLMObservationWrapper writes them, less the player's moves.

    The wrapper writes ``[GAME] message`` per game message and ``[Player] move`` per move; the moves are the
    policy's own turns, which the conversation holds already.
    """
    ta = _textarena()
    lines = [f"[GAME] {text}" if sender == ta.GAME_ID else f"[Player {sender}] {text}"
             for sender, text, kind in messages if kind is not ta.ObservationType.PLAYER_ACTION]  # fmt: skip
    return "\n".join(lines)
