"""Parse the printed graph IR back into a :class:`~dsl.ir.Graph`."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import lark

from .errors import Loc, MtcError
from .ir import Graph, Node, Ref, TensorType, canon_dtype, dim, make_attrs


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark((Path(__file__).parent / "ir.lark").read_text(), parser="lalr", maybe_placeholders=False)


class _ToGraph(lark.Transformer):
    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def number(self, t):
        s = str(t[0])
        return float(s) if any(c in s for c in ".eE") else int(s)

    def string(self, t):
        return json.loads(t[0])

    def true(self, _):
        return True

    def false(self, _):
        return False

    def none(self, _):
        return None

    def pinf(self, _):
        return float("inf")

    def ninf(self, _):
        return float("-inf")

    def nan(self, _):
        return float("nan")

    def list(self, t):
        return tuple(x for x in t)

    def dict(self, t):
        return tuple(sorted(t))

    def attr(self, t):
        return (str(t[0]), t[1])

    def attrs(self, t):
        return dict(t)

    def ref(self, t):
        return Ref(str(t[0]), int(t[1]) if len(t) > 1 else 0)

    def args(self, t):
        return list(t)

    def tensor(self, t):
        return TensorType(canon_dtype(str(t[0])), tuple(dim(str(d).strip()) for d in t[1:]))

    def unknown(self, _):
        return None

    def types(self, t):
        return tuple(t)

    def loc(self, t):
        return Loc(json.loads(t[0]), int(t[1]), int(t[2]))

    def ret(self, t):
        return ("ret", tuple(t))

    def node(self, t):
        name, op = str(t[0]), str(t[1])
        inputs, attrs, types, loc = [], {}, (), None
        for x in t[2:]:
            if isinstance(x, list):
                inputs = x
            elif isinstance(x, dict):
                attrs = x
            elif isinstance(x, tuple):
                types = x
            elif isinstance(x, Loc):
                loc = x
        return Node(name, op, tuple(inputs), make_attrs(attrs), types, loc)

    def start(self, t):
        name = str(t[0])
        symbols = tuple(str(x) for x in t[1:] if isinstance(x, lark.Token))
        nodes = tuple(x for x in t if isinstance(x, Node))
        outputs = next(x[1] for x in t if isinstance(x, tuple) and x and x[0] == "ret")
        return Graph(name, nodes, outputs, symbols)


def parse_ir(text: str, file: str = "<ir>") -> Graph:
    """Parse printed IR text. Raises MtcError with file:line:col on a syntax error."""
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        raise MtcError(f"syntax error in IR: {str(e).splitlines()[0]}", Loc(file, e.line, e.column), text) from None
    return _ToGraph(file).transform(tree)
