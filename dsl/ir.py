"""The graph IR: immutable nodes with symbolic shapes.

A :class:`Graph` is a list of :class:`Node` in topological (SSA) order plus a tuple of outputs. Each node
has an op name, input references, attributes, one :class:`TensorType` per output and an optional source
location. Shapes are tuples of sympy expressions over named symbols (``B``, ``T`` ...), so one graph
serves every batch size and sequence length.

Special ops: ``input`` (a graph input, attr ``name``), ``param`` (a trained weight, attr ``name`` = its
state-dict key, ``init``, optional ``std``/``active``) and ``buffer`` (state that is not trained by
gradient, e.g. the Quantile Balancing router bias).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Iterator

import sympy

from .errors import Loc, MtcError

DTYPES = {
    "f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i64": 8, "i32": 4, "bool": 1, "mxfp4": 0.53125, "fp8": 1,
}
"""Bytes per element of every IR dtype (mxfp4: 4 bits + one E8M0 scale per group of 32 = 4.25 bits)."""

DEFAULT_DTYPE = "f32"
"""The model dtype of a spec without a ``dtype`` config field (and of a GraphBuilder without ``dtype=``): what
its parameters are typed in and what ``mtc stats`` / the memory plan count its activations, KV cache and
residual stream in."""

DTYPE_ALIASES = {
    "float32": "f32", "fp32": "f32", "float16": "f16", "fp16": "f16", "bfloat16": "bf16", "int64": "i64",
    "int32": "i32", "float64": "f64",
}


def canon_dtype(name: str, loc: Loc | None = None) -> str:
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise MtcError(f"unknown dtype '{name}' (known: {', '.join(DTYPES)})", loc)
    return name


Dim = sympy.Expr


def dim(x) -> Dim:
    """Coerce an int, string or sympy expression to a dimension expression.

    A string is read by the dimension grammar (dsl/dim.lark: integers, shape symbols, + - * / // % **, min/max),
    never evaluated as Python or sympy source.

    Raises:
        TypeError: a bool or another type.
        dsl.dim_expr.DimError (a ValueError): a string that is not a dimension expression, or a size past 2**63.
    """
    if isinstance(x, sympy.Basic):
        return x
    if isinstance(x, bool):
        raise TypeError("a dimension cannot be a bool")
    if isinstance(x, int):
        return sympy.Integer(x)
    if isinstance(x, str):
        return _parse_dim(x)
    raise TypeError(f"not a dimension: {x!r}")


@lru_cache(maxsize=4096)
def _parse_dim(x: str) -> Dim:
    from .dim_expr import parse_dim_text
    return parse_dim_text(x)


def as_expr(v) -> sympy.Expr:
    """A computed size or count (a sympy expression, int or float) as a sympy expression; the internal
    counterpart of sympify that never reads a string."""
    if isinstance(v, sympy.Basic):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"not a number or sympy expression: {v!r}")
    return sympy.Integer(v) if isinstance(v, int) else sympy.Float(v)


def sym(name: str) -> sympy.Symbol:
    """The shape symbol ``name`` (a positive integer)."""
    return sympy.Symbol(name, integer=True, positive=True)


def dims_equal(a: Dim, b: Dim) -> bool:
    if a == b:
        return True
    return sympy.simplify(a - b) == 0


@dataclass(frozen=True)
class TensorType:
    """dtype + symbolic shape of one value."""

    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(dim(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self) -> Dim:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    def with_shape(self, shape) -> "TensorType":
        return TensorType(self.dtype, tuple(shape))

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(dtype, self.shape)

    def same(self, other: "TensorType") -> bool:
        return (self.dtype == other.dtype and self.rank == other.rank
                and all(dims_equal(a, b) for a, b in zip(self.shape, other.shape)))

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(_dim_str(d) for d in self.shape)}]"


def _dim_str(d: Dim) -> str:
    return str(d).replace(" ", "")


@dataclass(frozen=True)
class Ref:
    """A reference to output ``index`` of node ``node``."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return f"%{self.node}" if self.index == 0 else f"%{self.node}#{self.index}"


def freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, freeze(x)) for k, x in v.items()))
    return v


@dataclass(frozen=True, eq=True)
class Node:
    """One operation. Immutable; rewrite by building a new node (:meth:`replace`)."""

    name: str
    op: str
    inputs: tuple[Ref, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()
    types: tuple[TensorType | None, ...] = ()
    loc: Loc | None = field(default=None, compare=False)

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def attr_dict(self) -> dict:
        return dict(self.attrs)

    @property
    def type(self) -> TensorType | None:
        return self.types[0] if self.types else None

    def out(self, i: int = 0) -> Ref:
        return Ref(self.name, i)

    def replace(self, **kw) -> "Node":
        d = dict(name=self.name, op=self.op, inputs=self.inputs, attrs=self.attrs, types=self.types,
                 loc=self.loc)
        if "attrs" in kw and isinstance(kw["attrs"], dict):
            kw["attrs"] = tuple(sorted((k, freeze(v)) for k, v in kw["attrs"].items()))
        d.update(kw)
        return Node(**d)


def make_attrs(attrs: dict | None) -> tuple:
    return tuple(sorted((k, freeze(v)) for k, v in (attrs or {}).items()))


SOURCE_OPS = ("input", "param", "buffer")

#: attributes the compiler's passes add to nodes (fuse_tiles: the fusion group and the anchor's tiles); any op
#: may carry them in printed IR
ANNOTATIONS = ("fusion", "tiles")


def undeclared_symbols(g: "Graph", n: Node) -> tuple[str, TensorType] | None:
    """(symbol, type) for the first shape symbol in ``n``'s types that ``g``'s signature does not declare, or None.
    A graph's signature (``graph m(B, T)``) lists every symbol its types may use."""
    declared = set(g.symbols)
    for t in n.types:
        if t is None:
            continue
        for d in t.shape:
            for s in sorted(map(str, d.free_symbols)):
                if s not in declared:
                    return s, t
    return None


@dataclass(frozen=True)
class Graph:
    """An immutable graph: nodes in topological order, outputs, and its shape symbols."""

    name: str
    nodes: tuple[Node, ...]
    outputs: tuple[Ref, ...]
    symbols: tuple[str, ...] = ("B", "T")
    meta: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    # -- lookup -------------------------------------------------------------------------------
    def node_map(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def type_of(self, ref: Ref, nodes: dict[str, Node] | None = None) -> TensorType:
        n = (nodes or self.node_map())[ref.node]
        return n.types[ref.index]

    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "input"]

    def params(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "param"]

    def buffers(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "buffer"]

    def ops(self) -> Iterator[Node]:
        return (n for n in self.nodes if n.op not in SOURCE_OPS)

    def meta_get(self, key, default=None):
        return dict(self.meta).get(key, default)

    def with_nodes(self, nodes: Iterable[Node], outputs: Iterable[Ref] | None = None) -> "Graph":
        return Graph(self.name, tuple(nodes), tuple(outputs if outputs is not None else self.outputs),
                     self.symbols, self.meta)

    def to_networkx(self):
        """A networkx DiGraph of node names, edges from producer to consumer (with the output index)."""
        import networkx as nx
        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, op=n.op)
            for i, r in enumerate(n.inputs):
                g.add_edge(r.node, n.name, index=r.index, slot=i)
        return g

    def users(self) -> dict[str, list[str]]:
        u: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for r in n.inputs:
                u[r.node].append(n.name)
        return u

    def __str__(self) -> str:
        from .printer import print_graph
        return print_graph(self)

    def show(self) -> None:
        print(str(self))


def live_nodes(g: Graph) -> set[str]:
    """Names of the nodes the graph's outputs depend on (nodes are in topological order)."""
    live = {r.node for r in g.outputs}
    for n in reversed(g.nodes):
        if n.name in live:
            live.update(r.node for r in n.inputs)
    return live
