"""Text form of the graph IR. :func:`print_graph` output parses back with :func:`dsl.ir_parser.parse_ir`
into an equal :class:`~dsl.ir.Graph` (a round-trip the tests check on every model file)."""
from __future__ import annotations

import json
import math

from .ir import Graph, Node


def format_value(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if math.isnan(v):
            return "nan"
        r = repr(v)
        return r if ("." in r or "e" in r or "inf" in r) else r + ".0"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        if v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in v):
            return "{" + ", ".join(f"{k} = {format_value(x)}" for k, x in v) + "}"
        return "[" + ", ".join(format_value(x) for x in v) + "]"
    raise TypeError(f"cannot print attribute value {v!r}")


def format_node(n: Node, with_loc: bool = True) -> str:
    s = f"%{n.name} = {n.op}"
    if n.inputs or n.op not in ("input", "param", "buffer"):
        s += "(" + ", ".join(str(r) for r in n.inputs) + ")"
    if n.attrs:
        s += " {" + ", ".join(f"{k} = {format_value(v)}" for k, v in n.attrs) + "}"
    if n.types:
        ts = [str(t) if t is not None else "?" for t in n.types]
        s += " : " + (ts[0] if len(ts) == 1 else "(" + ", ".join(ts) + ")")
    if with_loc and n.loc is not None:
        s += f"  @{json.dumps(n.loc.file)}:{n.loc.line}:{n.loc.col}"
    return s


def print_graph(g: Graph, with_loc: bool = True) -> str:
    lines = [f"graph {g.name}({', '.join(g.symbols)}) {{"]
    lines += ["  " + format_node(n, with_loc) for n in g.nodes]
    lines.append("  return " + ", ".join(str(r) for r in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"
