"""TextMultiTurn-v0: conversations at token level — the policy speaks, a partner answers, the policy speaks again.

The same engine and episode layout as ``TextRLHF-v0`` (:class:`~textgym.envs.engine.Engine` with a
partner, :mod:`textgym.envs.turns`); these classes only require the partner and change two defaults.
"""

from __future__ import annotations

from typing import Any

from textgym.envs.text_rlhf import _DOC_ARGS, TextRLHFEnv, TextRLHFVectorEnv

__all__ = ["TextMultiTurnEnv", "TextMultiTurnVectorEnv"]

DEFAULT_MAX_NEW_TOKENS = 64  # the conversation's tokens after the opening: the embedded LM has 128 positions

_DOC_TURN_ARGS = """
    Arguments of a conversation (beside those of ``TextRLHF-v0`` below, whose ``reward_model`` and
    ``gold_scorer`` default to None here: the partner's rewards alone):
        partner: who answers the policy (required): a class (one instance per slot), a function
            ``f(conversation) -> (text, reward, done)``, an object with ``reply`` (deep-copied per slot),
            ``"textarena:<GameId>"`` (TextArena's single-player games; ``pip install 'textgym[textarena]'``),
            ``"calculator"`` (a tool), ``"package.module:attr"`` or an entry point of the
            ``textgym.partners`` group. See :mod:`textgym.partners`.
        max_turns: the policy's turns per episode (default None: until the partner says done or the tokens
            run out).
        max_turn_tokens: the policy's tokens per turn (default None: ``max_new_tokens`` bounds it).
        partner_timeout: seconds a partner's ``reply`` or ``reset`` may take (default None: no limit).
        max_new_tokens: the whole conversation's tokens after the opening, the policy's and the partner's
            (default 64).
"""

_DOC = """Token-level multi-turn RLHF: the policy writes its turn token by token, a partner answers.

    Description:
        ``TextRLHF-v0`` over a conversation. The state is the opening (the prompt, or the partner's own
        opening such as a game's rules), every token the policy wrote and every reply of the partner so
        far; the action is the policy's next token. When the policy ends its turn (a stop token or
        ``max_turn_tokens``), the partner receives the conversation as chat messages and answers
        ``(text, reward, done)``. The reply's tokens are appended to the state as observation: π_ref
        reads them (no KL, no loss is charged on them) and the policy's next turn starts after them.

    Action Space:
        ``Discrete(vocab_size)``: a token id of the policy's turn.

    Observation Space:
        As ``TextRLHF-v0``: ``input_ids`` and ``attention_mask`` of length ``max_prompt_tokens +
        max_new_tokens``; the response block holds the conversation after the opening. With
        ``chat_template=True`` each turn is in its role (the partner's as the user's).

    Rewards:
        ``r_t = kl_coef · log π_ref(a_t | s_t)`` on every policy token, plus the partner's reward for a
        turn on the turn's last token, plus the reward model's score (when one is given; it scores the
        opening and the policy's last turn) on the episode's last token. The return is Σ turn rewards +
        final score + β·Σ_t log π_ref over the policy's tokens. With ``reference_scoring="episode"``
        the π_ref part is paid on the last step (a turn's reward still at its own step) and the info's
        ``token_rewards`` lays every part out by response column (0 on the partner's columns).

    Starting State:
        Each episode resets its slot's partner with a seed drawn by ``self.np_random`` (or
        ``reset(options={"partner_seed": s})``; drawn seeds are below 2**30, so seeds from 2**30 on
        are held out); a partner may open with its own text, else a prompt is drawn as in ``TextRLHF-v0``.

    Episode End:
        Terminated when the partner says done, after ``max_turns`` turns, or when the conversation
        reaches ``max_new_tokens`` (mid-turn: ``length_capped``; or when a reply leaves no column for
        the policy). ``truncated`` is always False. A turn's step info has ``turn_reward`` and
        ``reply``; the last step's adds ``turns``, ``turn_reward_sum``, ``conversation`` (the chat
        messages) and ``conversation_length`` to ``TextRLHF-v0``'s. A partner that raises, hangs past
        ``partner_timeout``, or answers anything but ``(str, finite float, bool)`` raises
        :class:`textgym.partners.PartnerError` naming it and the slot, and the step is undone.
"""


def _defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A conversation's defaults: no reward model or gold scorer unless given, a longer token budget."""
    return {"reward_model": None, "gold_scorer": None, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **kwargs}


class TextMultiTurnEnv(TextRLHFEnv):
    __doc__ = (
        _DOC
        + _DOC_TURN_ARGS
        + _DOC_ARGS
        + """
    Vectorized Environment:
        ``gym.make_vec("TextMultiTurn-v0", num_envs=N, partner=..., vectorization_mode="vector_entry_point")``
        gives :class:`TextMultiTurnVectorEnv`; each slot has its own partner.

    Version History:
        v0: initial release.

    Example:
        >>> import gymnasium as gym, textgym
        >>> def partner(conversation):  # answers once, then ends the episode with a reward of 1
        ...     return "Tell me more.", 1.0, len(conversation) > 2
        >>> env = gym.make("TextMultiTurn-v0", partner=partner, max_turn_tokens=3)
        >>> obs, info = env.reset(seed=0)
        >>> total, done = 0.0, False
        >>> while not done:
        ...     obs, reward, done, truncated, info = env.step(env.action_space.sample())
        ...     total += reward
        >>> int(info["turns"]), float(info["turn_reward_sum"])
        (2, 2.0)
    """
    )

    conversation = True  # takes partner= and the turn arguments

    def __init__(self, partner=None, render_mode: str | None = None, **kwargs: Any):
        if partner is None:
            raise TypeError(_NO_PARTNER)
        super().__init__(render_mode=render_mode, partner=partner, **_defaults(kwargs))


class TextMultiTurnVectorEnv(TextRLHFVectorEnv):
    __doc__ = (
        """N slots of :class:`TextMultiTurnEnv` stepped together, each with its own partner.

    Autoreset, seeding and ``reset`` options as :class:`~textgym.envs.text_rlhf.TextRLHFVectorEnv`, plus
    ``reset(options={"partner_seed": int | list[int]})``. :meth:`draw_partner_seeds` draws a slot's seed as
    its reset would (for groups on one game).
"""
        + _DOC_TURN_ARGS
        + _DOC_ARGS
        + """        num_envs: number of slots N.
        autoreset_mode: see ``TextRLHFVectorEnv``.
    """
    )

    conversation = True

    def __init__(self, num_envs: int = 1, partner=None, **kwargs: Any):
        if partner is None:
            raise TypeError(_NO_PARTNER)
        super().__init__(num_envs=num_envs, partner=partner, **_defaults(kwargs))


_NO_PARTNER = (
    "partner=None: TextMultiTurn-v0 needs a partner, e.g. partner='calculator', a function f(conversation) -> "
    "(text, reward, done), or a TextArena game, whose rules need a model of more positions than the embedded "
    "LM's 128: partner='textarena:GuessTheNumber-v0', model='smollm2-135m-instruct', chat_template=True; "
    "see textgym.partners"
)
