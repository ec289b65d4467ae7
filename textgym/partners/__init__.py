"""Partners of the multi-turn envs: what answers when the policy's turn ends (a game, a tool, a user).

``gym.make("TextMultiTurn-v0", partner=...)`` takes any form :func:`make_partner` resolves; the env calls
every partner through :func:`reset_checked` and :func:`reply_checked`. :mod:`textgym.partners.base` states
the protocol.
"""

from textgym.partners.base import (
    ENTRY_POINT_GROUP,
    FunctionPartner,
    Partner,
    PartnerError,
    available_partners,
    close_checked,
    make_partner,
    partner_name,
    reply_checked,
    reset_checked,
    verdict_checked,
)
from textgym.partners.textarena import GuessTheNumber10, TextArenaPartner
from textgym.partners.tools import Calculator

__all__ = [
    "ENTRY_POINT_GROUP",
    "Calculator",
    "FunctionPartner",
    "GuessTheNumber10",
    "Partner",
    "PartnerError",
    "TextArenaPartner",
    "available_partners",
    "close_checked",
    "make_partner",
    "partner_name",
    "reply_checked",
    "reset_checked",
    "verdict_checked",
]
