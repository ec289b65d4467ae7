"""Safe arithmetic: the calculator tool's expression evaluator and its call syntax, with no tool attached.

Why a module of its own: the calculator partner (:mod:`textgym.partners.tools`) evaluates a call and the
``calculator-answer`` verifier (:mod:`textgym.rewards.verifiers`) computes the value a question asks for;
both read arithmetic the same way, and neither package may import the other (partners already import
rewards).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

__all__ = ["MAX_DIGITS", "MAX_EXPRESSION_CHARS", "Refused", "calls", "evaluate"]
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


class Refused(ValueError):
    """The expression is not plain arithmetic, or its result would be too large to compute."""


def calls(turn: str) -> list[str]:
    """The expressions of the ``<calc>EXPRESSION</calc>`` calls in a policy's ``turn``, in order (an unclosed
    ``<calc>`` is no call): the one reading of a call, for the tool and for a verifier of its conversations."""
    return _CALL.findall(turn)


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``, computed by walking its syntax tree (never ``eval``).

    Raises:
        Refused: (a ValueError) the expression is not arithmetic, is too long, divides by zero, or its
            result is complex, not finite or too large; the message is the reason shown to the policy.
    """
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise Refused(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        raise Refused(f"not an arithmetic expression: {text[:40]!r}") from None
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
            raise Refused("division by zero") from None
        except OverflowError:
            raise Refused("result too large") from None
    raise Refused(f"only numbers, + - * / // % ** and parentheses are allowed, not {_what(node)}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose integer result would pass ``10**MAX_DIGITS`` before computing it.

    Why here: ``9**9**9`` has 370 million digits; computing it first and checking after would take
    minutes and gigabytes. A float power overflows quickly by itself (``OverflowError``).
    """
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log10(abs(base)) >= MAX_DIGITS:
            raise Refused(f"result too large (more than {MAX_DIGITS} digits)")


def _checked(value: int | float | complex) -> int | float:
    """``value`` if it is a real number small enough to show; refused otherwise."""
    if isinstance(value, complex):  # (-8) ** 0.5
        raise Refused("complex result")
    if isinstance(value, int) and abs(value) >= 10**MAX_DIGITS:
        raise Refused(f"result too large (more than {MAX_DIGITS} digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise Refused("result is not finite")
    return value


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
