"""Tool partners: the policy calls a tool inside its turn, the partner answers with the tool's output.

The built-in one is :class:`Calculator` (``partner="calculator"``), a safe arithmetic evaluator:
the smallest tool that makes a policy learn *when* to call a tool and how to use its answer.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

__all__ = ["Calculator", "calls", "evaluate"]

MAX_EXPRESSION_CHARS = 500  # a longer "expression" is not arithmetic a policy needs; it also bounds parse depth
MAX_DIGITS = 100  # integers stay below 10**100: exact results a reader can check, never a memory blow-up

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)

_BINARY: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Refused(ValueError):
    """The expression is not plain arithmetic, or its result would be too large to compute."""


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
      env's reward model scores the whole conversation.

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
        except _Refused as err:
            shown = f"error: {err}"
        return f"<result>{shown}</result>", 0.0, False


def calls(turn: str) -> list[str]:
    """The expressions of the ``<calc>EXPRESSION</calc>`` calls in a policy's ``turn``, in order (an unclosed
    ``<calc>`` is no call): the one reading of a call, for the tool and for a verifier of its conversations."""
    return _CALL.findall(turn)


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``, computed by walking its syntax tree (never ``eval``).

    Raises:
        ValueError: the expression is not arithmetic, is too long, divides by zero, or its result is
            complex, not finite or too large; the message is the reason shown to the policy.
    """
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise _Refused(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        raise _Refused(f"not an arithmetic expression: {text[:40]!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    """One node of the tree: a number, a unary or a binary operation; anything else is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # type(): True is not a number here
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise _Refused("division by zero") from None
        except OverflowError:
            raise _Refused("result too large") from None
    raise _Refused(f"only numbers, + - * / // % ** and parentheses are allowed, not {_what(node)}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose integer result would pass ``10**MAX_DIGITS`` before computing it.

    Why here: ``9**9**9`` has 370 million digits; computing it first and checking after would take
    minutes and gigabytes. A float power overflows quickly by itself (``OverflowError``).
    """
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log10(abs(base)) >= MAX_DIGITS:
            raise _Refused(f"result too large (more than {MAX_DIGITS} digits)")


def _checked(value: int | float | complex) -> int | float:
    """``value`` if it is a real number small enough to show; refused otherwise."""
    if isinstance(value, complex):  # (-8) ** 0.5
        raise _Refused("complex result")
    if isinstance(value, int) and abs(value) >= 10**MAX_DIGITS:
        raise _Refused(f"result too large (more than {MAX_DIGITS} digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused("result is not finite")
    return value


def _show(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.15g}"


def _what(node: ast.AST) -> str:
    """How an error names a refused node: ``a name (x)``, ``a call``, ``an attribute``, ``<<``."""
    if isinstance(node, ast.Name):
        return f"a name ({node.id})"
    if isinstance(node, ast.Call):
        return "a call"
    if isinstance(node, ast.Attribute):
        return "an attribute"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    return type(node).__name__
