"""Dimension expressions: the text of one shape entry (``B``, ``64``, ``B*T``, ``T // 2``, ``min(T, 4096)``) read
into a sympy expression by a small grammar (dsl/dim.lark), built node by node from the parse tree.

No text is ever handed to ``sympy.sympify`` / ``eval``: a shape string in a spec or a type in printed IR is data.
What is evaluated is bounded: every integer in an expression (literal, folded constant or coefficient) is below
2**63 in magnitude, an exponent is an integer constant whose power stays below that, and an expression is at most
:data:`MAX_DIM_TEXT` characters long.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import lark
import sympy

from .errors import did_you_mean

#: every integer of a dimension expression is below this in magnitude (the int64 range)
DIM_LIMIT = 2**63
#: the longest dimension expression read (characters; printed dims are a few characters)
MAX_DIM_TEXT = 1000
#: the most digits an integer literal may have (in IR text and specs; Python's int() refuses more than 4300)
MAX_INT_DIGITS = 4000
#: the largest exponent of a shape symbol (B**2); past it a size passes 2**63 for any symbol value >= 2
MAX_EXPONENT = 62

#: the functions a dimension may call: name -> (sympy function, fewest arguments, most arguments or None)
FUNCTIONS = {
    "min": (sympy.Min, 2, None), "max": (sympy.Max, 2, None), "Min": (sympy.Min, 2, None),
    "Max": (sympy.Max, 2, None), "floor": (sympy.floor, 1, 1), "ceiling": (sympy.ceiling, 1, 1),
    "Mod": (sympy.Mod, 2, 2),
}

WHAT = ("a dimension is an integer, a shape symbol or an expression of them with + - * / // % **, ( ) and "
        "min/max(a, b, ...), such as B*T")


class DimError(ValueError):
    """A dimension expression that cannot be read. ``line`` / ``col``: 1-based position of the offending part
    in the text that was parsed (a dimension string, or the IR text whose type holds it), or None."""

    def __init__(self, msg: str, line: int | None = None, col: int | None = None):
        super().__init__(msg)
        self.msg, self.line, self.col = msg, line, col


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark((Path(__file__).parent / "dim.lark").read_text(), parser="lalr", start="dimexpr",
                     propagate_positions=True, maybe_placeholders=False)


def parse_dim_text(text: str) -> sympy.Expr:
    """The sympy expression of one dimension's text (shape symbols are positive integer Symbols).

    Raises:
        DimError: a syntax error, an unknown function, a size past 2**63, a division by zero, a bad exponent;
            ``col`` is the column in ``text``.
    """
    if len(text) > MAX_DIM_TEXT:
        raise DimError(f"the dimension expression is {len(text)} characters long, more than the limit of "
                       f"{MAX_DIM_TEXT}", 1, 1)
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        raise DimError(syntax_message(e, text), getattr(e, "line", 1), max(getattr(e, "column", 1), 1)) from None
    return from_tree(tree)


def syntax_message(e: lark.exceptions.UnexpectedInput, text: str) -> str:
    """What a lark error inside a dimension expression found, in words."""
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        return f"unexpected character {text[e.pos_in_stream]!r}"
    tok = getattr(e, "token", None)
    if tok is None or tok.type == "$END":
        return "the expression ends too early"
    return f"unexpected '{tok}'"


def _where(t: lark.Tree | None) -> tuple:
    return (getattr(t.meta, "line", None), getattr(t.meta, "column", None)) if t is not None else (None, None)


def _shown(v) -> str:
    s = str(v).replace(" ", "")
    return s if len(s) <= 40 else f"an integer of {len(s)} digits" if s.isdigit() else s[:37] + "..."


def check_size(v: sympy.Expr, t: lark.Tree | None = None) -> None:
    """DimError unless v is finite and every number in it is below DIM_LIMIT in magnitude."""
    if v.has(sympy.zoo, sympy.oo, -sympy.oo, sympy.nan):
        raise DimError(f"the dimension {_shown(v)} is not finite", *_where(t))
    for n in v.atoms(sympy.Number):
        if not n.is_Rational:
            raise DimError(f"the dimension {_shown(v)} holds the non-integer number {n}", *_where(t))
        if abs(n.p) >= DIM_LIMIT or n.q >= DIM_LIMIT:
            raise DimError(f"the dimension {_shown(v)} passes 2**63 (sizes are int64)", *_where(t))


def _pow(base: sympy.Expr, exp: sympy.Expr, t: lark.Tree) -> sympy.Expr:
    """base**exp with exp an integer constant, refused before it is computed when the result (or its denominator)
    would pass 2**63: a bit-length estimate, so that 9**9**9 is an error at once."""
    if not exp.is_Integer:
        raise DimError(f"an exponent must be an integer constant (B**2), got {_shown(exp)}", *_where(t))
    e = int(exp)
    if base.is_Rational:
        if base.is_zero and e < 0:
            raise DimError("division by zero in a dimension (0 to a negative power)", *_where(t))
        bits = max(abs(base.p), base.q).bit_length() - 1       # |base| or 1/|base| >= 2**bits
        if bits * abs(e) >= 63:
            shown = _shown(base) if base >= 0 and base.is_Integer else f"({_shown(base)})"
            raise DimError(f"{shown}**{e} passes 2**63 (sizes are int64)", *_where(t))
    elif abs(e) > MAX_EXPONENT:
        raise DimError(f"the exponent {e} of {_shown(base)} is past {MAX_EXPONENT}: the size passes 2**63",
                       *_where(t))
    return base ** exp


def _divisor(b: sympy.Expr, t: lark.Tree) -> sympy.Expr:
    if b.is_zero:
        raise DimError("division by zero in a dimension", *_where(t))
    return b


def _call(t: lark.Tree, args: list) -> sympy.Expr:
    name = str(t.children[0])
    if name not in FUNCTIONS:
        raise DimError(f"unknown function '{name}' in a dimension{did_you_mean(name, FUNCTIONS)}; the functions "
                       f"are min, max, floor, ceiling and Mod", *_where(t))
    fn, lo, hi = FUNCTIONS[name]
    if len(args) < lo or (hi is not None and len(args) > hi):
        want = f"{lo}" if lo == hi else f"{lo} or more"
        raise DimError(f"{name}(...) takes {want} argument{'s' if want != '1' else ''}, got {len(args)}",
                       *_where(t))
    if fn is sympy.Mod:
        _divisor(args[1], t)
    return fn(*args)


def _int(t: lark.Tree) -> sympy.Expr:
    s = str(t.children[0])
    digits = s.lstrip("0") or "0"
    if len(digits) > 19 or int(digits) >= DIM_LIMIT:          # (19 digits: int() of a huge text is slow)
        raise DimError(f"the dimension {_shown(digits)} passes 2**63 (sizes are int64)", *_where(t))
    return sympy.Integer(int(digits))


def from_tree(tree: lark.Tree) -> sympy.Expr:
    """The sympy expression of a ``dimexpr`` parse tree (from dsl/dim.lark, or imported into the IR grammar, whose
    rule names carry a ``dim__`` prefix). Built bottom-up without recursion, each step checked (check_size).

    Raises:
        DimError: at the offending subexpression's line:col of the parsed text.
    """
    vals: dict[int, sympy.Expr] = {}
    try:
        for t in tree.iter_subtrees():                   # children before their parent
            kind = str(t.data).rsplit("__", 1)[-1]
            args = [vals[id(c)] for c in t.children if isinstance(c, lark.Tree)]
            if kind == "d_int":
                v = _int(t)
            elif kind == "d_sym":
                v = sympy.Symbol(str(t.children[0]), integer=True, positive=True)
            elif kind == "d_add":
                v = args[0] + args[1]
            elif kind == "d_sub":
                v = args[0] - args[1]
            elif kind == "d_mul":
                v = args[0] * args[1]
            elif kind == "d_div":
                v = args[0] / _divisor(args[1], t)
            elif kind == "d_floordiv":
                v = sympy.floor(args[0] / _divisor(args[1], t))
            elif kind == "d_mod":
                v = sympy.Mod(args[0], _divisor(args[1], t))
            elif kind == "d_neg":
                v = -args[0]
            elif kind == "d_pow":
                v = _pow(args[0], args[1], t)
            elif kind == "d_call":
                v = _call(t, args)
            else:                                        # pragma: no cover - the grammar has no other rule
                raise DimError(f"unexpected '{kind}' in a dimension", *_where(t))
            check_size(v, t)
            vals[id(t)] = v
    except RecursionError:
        raise DimError("the dimension expression is nested too deeply", *_where(tree)) from None
    return vals[id(tree)]
