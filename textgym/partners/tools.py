"""Tool partners: the policy calls a tool inside its turn, the partner answers with the tool's output.

The built-in one is :class:`Calculator` (``partner="calculator"``), a safe arithmetic evaluator:
the smallest tool that makes a policy learn *when* to call a tool and how to use its answer.
"""

from __future__ import annotations

from textgym.arithmetic import Refused, calls, evaluate

__all__ = ["Calculator", "evaluate"]  # evaluate: public here before it moved to textgym.arithmetic


class Calculator:
    """A calculator tool: evaluates the last ``<calc>EXPRESSION</calc>`` of the policy's turn.

    Protocol (what the policy sees and must write):

    - The policy calls the tool by writing ``<calc>EXPRESSION</calc>`` anywhere in its turn; when the
      turn holds several calls, the last one is evaluated (a policy that corrects itself writes the
      corrected call last).
    - The partner replies ``<result>VALUE</result>`` (``<result>14</result>``), or
      ``<result>error: REASON</result>`` for an expression it cannot or will not evaluate
      (``1/0``, ``9**9**9``, ``abs(3)``), with reward 0.0 and the episode going on.
    - A turn without a call is the policy's final answer: the reply is ``("", 0.0, True)`` and the
      env's reward model scores the conversation (it is handed this final turn).

    EXPRESSION is arithmetic only: numbers, ``+ - * / // % **``, unary ``+``/``-`` and parentheses;
    names, calls, attributes and everything else are refused. Integers are exact and stay below
    ``10**MAX_DIGITS`` (a power that would pass it is refused before it is computed); floats are shown
    with 15 significant digits.

    Example:
        >>> Calculator().reply([{"role": "user", "content": "2+3*4?"},
        ...                     {"role": "assistant", "content": "<calc>2+3*4</calc>"}])
        ('<result>14</result>', 0.0, False)
    """

    def reply(self, conversation: list[dict[str, str]]) -> tuple[str, float, bool]:
        """Evaluate the policy's last call, or end the episode when its turn made none."""
        made = calls(conversation[-1]["content"])
        if not made:
            return "", 0.0, True
        try:
            shown = _show(evaluate(made[-1]))
        except Refused as err:
            shown = f"error: {err}"
        return f"<result>{shown}</result>", 0.0, False


def _show(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.15g}"
