"""A safe calculator for the math environment's `calculator` tool.

The expression is parsed with Python's `ast` and only arithmetic nodes are evaluated, in exact
rational arithmetic (`fractions.Fraction`): numbers, `+ - * / // % **`, unary `+ -` and
parentheses. Nothing is `eval`-ed, no name or call is accepted. Everything is bounded, so an
evaluation takes microseconds whatever the input:

- the expression has at most `Bounds.max_chars` characters and `Bounds.max_nodes` syntax nodes;
- every number, operand and result has magnitude at most `Bounds.max_magnitude` (and a
  denominator no larger), checked after each operation;
- a power's exponent is an integer with |exponent| <= `Bounds.max_exponent`, and the result's
  size is estimated before it is computed.

Results: an integer prints as an integer, any other rational as a decimal with up to 12
significant digits (`7/2` -> `3.5`, `1/3` -> `0.333333333333`). A bad expression raises
`CalculatorError` with a message the agent can act on.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from fractions import Fraction


class CalculatorError(ValueError):
    """The expression cannot be evaluated; the message says why and what is allowed."""


@dataclass(frozen=True)
class Bounds:
    max_chars: int = 200
    max_nodes: int = 100
    max_magnitude: int = 10**30
    max_exponent: int = 100


ALLOWED = "numbers, + - * / // % ** and parentheses"

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}


def _check(value: Fraction, bounds: Bounds) -> Fraction:
    if abs(value.numerator) > bounds.max_magnitude * value.denominator or value.denominator > bounds.max_magnitude:
        raise CalculatorError(f"a number exceeds the calculator's range (magnitude and precision up to "
                              f"1e{len(str(bounds.max_magnitude)) - 1})")
    return value


def _power(base: Fraction, exponent: Fraction, bounds: Bounds) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only integer exponents are supported (no roots)")
    e = exponent.numerator
    if abs(e) > bounds.max_exponent:
        raise CalculatorError(f"exponent {e} is too large (at most {bounds.max_exponent} in magnitude)")
    if base == 0 and e < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    limit_bits = bounds.max_magnitude.bit_length()
    for part in (base.numerator, base.denominator):
        if abs(part) > 1 and (abs(part).bit_length() - 1) * abs(e) > limit_bits:
            raise CalculatorError("the power exceeds the calculator's range")
    return base**e


def _number(node: ast.Constant, bounds: Bounds) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"{value!r} is not a number; allowed: {ALLOWED}")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the number is too large")
    return _check(Fraction(value) if isinstance(value, int) else Fraction(repr(value)), bounds)


def _evaluate(node: ast.AST, bounds: Bounds) -> Fraction:
    if isinstance(node, ast.Constant):
        return _number(node, bounds)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, bounds)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, bounds), _evaluate(node.right, bounds)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right, bounds), bounds)
        if isinstance(node.op, ast.BitXor):
            raise CalculatorError("^ is not a power here; write ** (e.g. 2**10)")
        op = _BINARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed; allowed: {ALLOWED}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _check(op(left, right), bounds)
    raise CalculatorError(f"{type(node).__name__} is not allowed; allowed: {ALLOWED}")


def format_number(value: Fraction) -> str:
    """An integer as an integer, any other rational as a decimal (12 significant digits)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


def calculate(expression: str, bounds: Bounds = Bounds()) -> str:
    """The value of the arithmetic `expression` as text (see the module docstring)."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    if not text:
        raise CalculatorError(f"the expression is empty; write e.g. (12 + 7) * 3 using {ALLOWED}")
    if len(text) > bounds.max_chars:
        raise CalculatorError(f"the expression has {len(text)} characters (at most {bounds.max_chars})")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"cannot parse {text!r}: {type(exc).__name__}; allowed: {ALLOWED}") from None
    if sum(1 for _ in ast.walk(tree)) > bounds.max_nodes:
        raise CalculatorError(f"the expression is too long (at most {bounds.max_nodes} parts)")
    return format_number(_evaluate(tree.body, bounds))
