"""The partner protocol, the checks every partner call goes through, and ``partner=`` resolution.

In a multi-turn env the policy speaks, and when its turn ends a *partner* answers: a game, a tool,
a simulated user. A partner is any object with::

    def reply(self, conversation: list[dict[str, str]]) -> tuple[str, float, bool]: ...
    def reset(self, *, seed: int, prompt: str) -> str | None: ...  # optional
    def verdict(self) -> bool: ...  # optional

``conversation`` is ``[{"role": "user" | "assistant", "content": str}, ...]``: the user's opening
(the episode's prompt) first, roles alternating, the policy's ("assistant") turn that just ended last;
a new list each call, which the partner may keep. ``reply`` returns the partner's next message (the
user's next turn unless the episode is over), the reward for the policy's turn that just ended and
whether the episode is over. ``reset`` is called at the start of every episode, before any reply, and
returns the episode's opening text (a game's rules and board) or None to keep the env's ``prompt``.
``close()`` (optional) is called once when the env closes: a partner holding a session or a socket
releases it there. ``verdict`` is asked when the episode ends, whatever ended it: did the policy win (a
game cut before its end was not won)? It is the task's own verdict, which evaluation's ``win_rate``
counts; a partner without one leaves it to the reward model (a verifier's ``verdicts``), and an episode
with neither has none.

``partner=`` routes (:func:`make_partner`), tried in this order:

1. a class: each env slot gets ``spec()``;
2. an object with a callable ``reply``: the first slot gets the object, each later one a deep copy;
3. a plain function ``f(conversation) -> (text, reward, done)``: one stateless partner all slots share;
4. ``"<prefix>:<rest>"`` for another package's environments (:data:`ADAPTERS`): ``"textarena:<GameId>"``, a
   TextArena single-player game (:class:`~textgym.partners.textarena.TextArenaPartner`); ``"gem:<env_id>"``,
   GEM's (:mod:`textgym.partners.gem`); ``"skyrl:<env_id>"``, skyrl-gym's (:mod:`textgym.partners.skyrl`);
   ``"openenv:<base_url>"``, an OpenEnv server's environment (:mod:`textgym.partners.openenv`);
5. a built-in name (``"calculator"``, ``"guess-the-number-10"``: TextArena's GuessTheNumber over 1..10 in 4 guesses);
6. ``"package.module:attr"``: the attribute, resolved as above;
7. a name published by an installed package in the entry-point group ``textgym.partners``.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import numpy as np

from textgym.errors import short_repr
from textgym.imports import import_module_named
from textgym.partners.gem import GEMPartner
from textgym.partners.openenv import OpenEnvPartner
from textgym.partners.skyrl import SkyRLPartner
from textgym.partners.textarena import GuessTheNumber10, TextArenaPartner
from textgym.partners.tools import Calculator
from textgym.rewards.base import FLOAT32_MAX
from textgym.timeouts import CallAbandoned, call_within

ENTRY_POINT_GROUP = "textgym.partners"
TEXTARENA_PREFIX = "textarena:"
# ``"<prefix><rest>"`` partners from other packages, with what they are called in errors: the class is built with
# ``rest`` (a game id, a URL), once per env slot. Each class imports its package only when built, so a missing
# extra fails that spec alone, naming it.
ADAPTERS: dict[str, tuple[type, str]] = {
    TEXTARENA_PREFIX: (TextArenaPartner, "TextArena games"),
    "gem:": (GEMPartner, "GEM environments"),
    "skyrl:": (SkyRLPartner, "skyrl-gym environments"),
    "openenv:": (OpenEnvPartner, "OpenEnv environments"),
}

__all__ = [
    "ADAPTERS",
    "ENTRY_POINT_GROUP",
    "FunctionPartner",
    "Partner",
    "PartnerError",
    "available_partners",
    "close_checked",
    "make_partner",
    "partner_name",
    "reply_checked",
    "reset_checked",
    "verdict_checked",
]

_BUILTINS: dict[str, type] = {"calculator": Calculator, "guess-the-number-10": GuessTheNumber10}

_FORMS = (
    "a partner class, an object with a reply(conversation) method, a function f(conversation) -> "
    "(text, reward, done), 'textarena:<GameId>', 'gem:<env_id>', 'skyrl:<env_id>', 'openenv:<base_url>', "
    "a 'package.module:attr' string or a registered name"
)
_REPLY_CONTRACT = "reply(conversation) must return (text: str, reward: finite real number, not bool, done: bool)"


class PartnerError(RuntimeError):
    """A partner failed, hung or returned something malformed (the env undoes the step)."""


@runtime_checkable
class Partner(Protocol):
    """What a multi-turn env needs from a partner; ``reset(*, seed, prompt) -> str | None`` and
    ``verdict() -> bool`` are optional (the module docstring)."""

    def reply(self, conversation: list[dict[str, str]]) -> tuple[str, float, bool]:
        """The partner's next message, the reward for the policy's turn just ended, and whether the episode is over."""
        ...


class FunctionPartner:
    """A plain function ``f(conversation) -> (text, reward, done)`` as a partner.

    It has no state and no ``reset``, so every env slot may share one.
    """

    def __init__(self, fn: Callable[[list[dict[str, str]]], tuple[str, float, bool]]):
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__

    def reply(self, conversation: list[dict[str, str]]) -> tuple[str, float, bool]:
        return self.fn(conversation)


def available_partners() -> list[str]:
    """Names usable as ``partner=``: the built-ins and installed entry points (plus ``textarena:<GameId>``)."""
    return sorted(set(_BUILTINS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def partner_name(partner: Any) -> str:
    """How errors name a partner: its ``name`` attribute if a str, else its class name."""
    name = getattr(partner, "name", None)
    return name if isinstance(name, str) and name else type(partner).__name__


# ---------------------------------------------------------------- partner= resolution


def make_partner(spec: Any, name: str = "partner") -> Callable[[], Partner]:
    """A factory giving each env slot its partner, from any ``partner=`` form (the module docstring's routes).

    The first partner is built here, at once, and handed out by the factory's first call: a bad spec
    (an unknown game, a class whose constructor fails) then fails at ``gym.make``, not at the first turn.

    Args:
        spec: the ``partner=`` value.
        name: the argument's name in error messages (``partner``).

    Returns:
        A zero-argument callable; the env calls it once per slot.

    Raises:
        TypeError / ValueError: naming ``name=``, the value and the allowed forms or names.
    """
    if isinstance(spec, str):
        return _from_string(spec, name)
    return _from_object(spec, name, shown=short_repr(spec))


def _from_string(text: str, name: str) -> Callable[[], Partner]:
    """Resolve a str spec: ``textarena:<GameId>``, a built-in, ``package.module:attr`` or an entry point."""
    shown = short_repr(text)
    for prefix, (adapter, what) in ADAPTERS.items():
        if text.startswith(prefix):
            rest = text[len(prefix) :]
            return _from_class(lambda adapter=adapter, rest=rest: adapter(rest), name, shown)
        if text[: len(prefix)].lower() == prefix:  # 'TextArena:...' would be read as a module path otherwise
            raise ValueError(f"{name}={shown}: {what} are named with a lower-case prefix, "
                             f"{prefix + text[len(prefix) :]!r}")  # fmt: skip
    if text in _BUILTINS:
        return _from_object(_BUILTINS[text], name, shown)
    if ":" in text:
        module_name, _, attr = text.partition(":")
        module = import_module_named(module_name, name, text)
        if not hasattr(module, attr):
            raise ValueError(f"{name}={shown}: module {module_name!r} has no attribute {attr!r}")
        return _from_object(getattr(module, attr), name, shown)
    eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == text]
    if not eps:
        raise ValueError(
            f"{name}={shown} is not a registered partner ({', '.join(available_partners())}), "
            f"an adapter's '<prefix><id>' ({', '.join(ADAPTERS)}) or a 'package.module:attr' string"
        )
    try:
        obj = eps[0].load()
    except Exception as err:  # a broken plug-in: say which entry point, not just the import error
        raise ValueError(f"{name}={shown}: entry point {eps[0].value!r} cannot be loaded ({err})") from err
    return _from_object(obj, name, shown)


def _from_object(spec: Any, name: str, shown: str) -> Callable[[], Partner]:
    """Resolve a class, an object with ``reply`` or a plain function (see the module docstring)."""
    if isinstance(spec, type):
        return _from_class(spec, name, shown)
    if callable(getattr(spec, "reply", None)):
        return _from_instance(spec, name, shown)
    if callable(spec):
        partner = FunctionPartner(spec)
        return lambda: partner
    raise TypeError(f"{name}={shown} ({type(spec).__name__}) is not a partner; expected {_FORMS}")


def _from_class(build: Callable[[], Any], name: str, shown: str) -> Callable[[], Partner]:
    """A factory calling ``build()`` per slot; the first partner is built now to fail early."""
    first = [_built(build, name, shown)]

    def factory() -> Partner:
        return first.pop() if first else build()

    return factory


def _built(build: Callable[[], Any], name: str, shown: str) -> Partner:
    """``build()``, with its failure (or a result without ``reply``) naming ``name=``."""
    try:
        partner = build()
    except (ValueError, ImportError) as err:  # an unknown game, a missing extra: the user's spec is wrong
        raise ValueError(f"{name}={shown}: {err}") from err
    except TypeError as err:
        raise TypeError(f"{name}={shown}: building the partner raised TypeError: {err}") from err
    except Exception as err:
        raise PartnerError(f"{name}={shown}: building the partner raised {type(err).__name__}: {err}") from err
    if not callable(getattr(partner, "reply", None)):
        raise TypeError(
            f"{name}={shown} built {type(partner).__name__}, which has no reply() method; expected {_FORMS}"
        )
    return partner


def _from_instance(obj: Any, name: str, shown: str) -> Callable[[], Partner]:
    """The object for the first slot, a deep copy of it for each later one.

    Why copies: a partner keeps an episode's state (a game's board, the turn count), and N env slots
    play N episodes at once; sharing one object would let slot 2's move land on slot 1's board.
    Why a copy of a snapshot taken now: by the time the env asks for the second slot's partner, the
    first may be mid-episode; a copy of it then would start in that state. An object that cannot be
    deep-copied still serves one slot; a second slot then raises, telling to pass its class instead.
    """
    try:
        snapshot, failure = copy.deepcopy(obj), None
    except Exception as err:  # a lock, a socket, a client: fine for one slot
        snapshot, failure = None, err
    handed_out = [False]

    def factory() -> Partner:
        if not handed_out[0]:
            handed_out[0] = True
            return obj
        if failure is not None:
            raise TypeError(
                f"{name}={shown} cannot be deep-copied ({type(failure).__name__}: {failure}), and each env slot "
                "needs a partner of its own; pass its class instead (one instance per slot)"
            )
        return copy.deepcopy(snapshot)

    return factory


# ---------------------------------------------------------------- checked calls


def reply_checked(
    partner: Partner, conversation: list[dict[str, str]], timeout: float | None, slot: int | None = None
) -> tuple[str, float, bool]:
    """``partner.reply(conversation)`` within ``timeout`` seconds, its result checked.

    Args:
        timeout: seconds to wait (None: no limit); a hung call is abandoned on its thread.
        slot: the env slot, named in errors.

    Returns:
        ``(text, reward, done)`` as ``(str, float, bool)``.

    Raises:
        PartnerError: ``reply`` raised, hung, or returned something else than ``(str, finite real, bool)``;
            the message names the partner, the slot, the value and what is allowed.
    """
    out = _call("reply", lambda: partner.reply(conversation), partner, timeout, slot)
    bad = _reply_problem(out)
    if bad:
        raise PartnerError(f"{_who(partner, slot)}.reply returned {short_repr(out)}: {bad}; {_REPLY_CONTRACT}")
    text, reward, done = out
    return text, float(reward), bool(done)


def reset_checked(
    partner: Partner, seed: int, prompt: str, timeout: float | None, slot: int | None = None
) -> str | None:
    """``partner.reset(seed=seed, prompt=prompt)`` within ``timeout`` seconds if it has a ``reset``; else None.

    Returns:
        The episode's opening text, or None to keep the env's ``prompt``.

    Raises:
        PartnerError: ``reset`` raised, hung, or returned something else than a str or None.
    """
    reset = getattr(partner, "reset", None)
    if not callable(reset):
        return None
    out = _call("reset", lambda: reset(seed=seed, prompt=prompt), partner, timeout, slot)
    if out is not None and not isinstance(out, str):
        raise PartnerError(
            f"{_who(partner, slot)}.reset returned {type(out).__name__} {short_repr(out)}; "
            "reset(seed=..., prompt=...) must return the opening text (str) or None to keep the env's prompt"
        )
    if out is not None and (bad := _not_unicode(out)) is not None:
        raise PartnerError(f"{_who(partner, slot)}.reset returned {short_repr(out)}, whose text {bad}")
    return out


def close_checked(partner: Partner, timeout: float | None, slot: int | None = None) -> None:
    """``partner.close()`` within ``timeout`` seconds if it has a ``close``; a failure or a hang is a
    :class:`PartnerError` naming the partner and the slot."""
    close = getattr(partner, "close", None)
    if callable(close):
        _call("close", close, partner, timeout, slot)


def verdict_checked(partner: Partner, timeout: float | None, slot: int | None = None) -> bool | None:
    """``partner.verdict()`` within ``timeout`` seconds if it has a ``verdict``; else None.

    Raises:
        PartnerError: ``verdict`` raised, hung, or returned something else than a bool.
    """
    verdict = getattr(partner, "verdict", None)
    if not callable(verdict):
        return None
    out = _call("verdict", verdict, partner, timeout, slot)
    if not isinstance(out, (bool, np.bool_)):
        raise PartnerError(f"{_who(partner, slot)}.verdict returned {type(out).__name__} {short_repr(out)}; "
                           "verdict() must return a bool: did the policy win the episode that just ended")  # fmt: skip
    return bool(out)


def _who(partner: Any, slot: int | None) -> str:
    return f"partner {partner_name(partner)!r}" + (f" (env slot {slot})" if slot is not None else "")


def _call(method: str, fn: Callable[[], Any], partner: Any, timeout: float | None, slot: int | None) -> Any:
    """``fn()`` within ``timeout``; a failure or a hang becomes one :class:`PartnerError` naming the partner."""
    try:
        return fn() if timeout is None else call_within(fn, timeout, "textgym-partner")
    except CallAbandoned:
        raise PartnerError(
            f"{_who(partner, slot)}.{method} did not return within partner_timeout={timeout} s; "
            "the call was abandoned and the step undone"
        ) from None
    except Exception as err:  # surface any failure with the partner's name and slot attached
        raise PartnerError(f"{_who(partner, slot)}.{method} raised {type(err).__name__}: {err}") from err


def _not_unicode(text: str) -> str | None:
    """What makes ``text`` no valid Unicode (a lone surrogate, which no tokenizer encodes), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"has a lone surrogate {text[err.start]!r} at index {err.start}: not valid Unicode"
    return None


def _reply_problem(out: Any) -> str | None:
    """What is wrong with a ``reply`` result, or None when it is ``(str, finite real, bool)``."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        length = f"of length {len(out)}" if isinstance(out, (tuple, list)) else f"a {type(out).__name__}"
        return f"expected a tuple of 3, got {length}"
    text, reward, done = out
    if not isinstance(text, str):
        return f"text is {type(text).__name__}, not str"
    if (bad := _not_unicode(text)) is not None:
        return f"text {bad}"
    # bool is a number to Python; here it is a verdict, not a reward: return 1.0 or 0.0 to mean one
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
        return f"reward is {type(reward).__name__}, not a real number"
    try:
        finite = math.isfinite(value := float(reward)) and abs(value) <= FLOAT32_MAX
    except OverflowError:  # an int past float's range
        finite = False
    if not finite:  # float32: the rollout buffers' dtype, where 1e308 becomes inf
        return f"reward {short_repr(reward)} is not finite in float32 (|reward| <= {FLOAT32_MAX:.4g})"
    if not isinstance(done, (bool, np.bool_)):
        return f"done is {type(done).__name__}, not bool"
    return None
