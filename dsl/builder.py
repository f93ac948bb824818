"""The Python builder API: constructs a :class:`~dsl.ir.Graph` node by node with eager shape inference.

Example::

    from dsl.builder import GraphBuilder
    b = GraphBuilder("toy", dtype="f32")
    ids = b.input("input_ids", "i64", ["B", "T"])
    x = b.call("embedding", ids, vocab=256, dim=64, name="model.embed_tokens")
    x = b.call("kda_layer", x, heads=2, head_dim=16, name="model.layers.0.self_attn")
    g = b.build([b.call("lm_head", b.call("rmsnorm", x, name="model.norm"), vocab=256)])

The spec parser (:mod:`dsl.spec`) drives the same builder, so a spec and the equivalent Python produce
equal graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .errors import Loc, MtcError, did_you_mean
from .ir import DEFAULT_DTYPE, Graph, Node, Ref, TensorType, canon_dtype, dim, make_attrs


class ShapeError(Exception):
    """Raised by shape rules; the builder turns it into an MtcError at the user's source location."""


@dataclass
class ParamSpec:
    """A parameter (or buffer) an op creates: state-dict suffix, shape, initialiser."""

    suffix: str
    shape: tuple
    init: str = "normal"
    kind: str = "param"          # "param" or "buffer"
    dtype: str | None = None     # None: the model dtype
    std: float | None = None
    active: float | None = None  # fraction of this tensor used per token (routed experts: top_k / E)


#: the largest parameter the builder and the verifier accept: no dimension above MAX_PARAM_DIM, no more than
#: MAX_PARAM_NUMEL elements (the largest K3 tensor, a layer's routed experts, is ~6e9 elements)
MAX_PARAM_DIM = 2**40
MAX_PARAM_NUMEL = 2**48


def check_param_shape(shape) -> None:
    """ShapeError unless every numeric dimension of a parameter's shape is in 1..MAX_PARAM_DIM and its element
    count (of the numeric dims) is at most MAX_PARAM_NUMEL."""
    shape = tuple(dim(d) for d in shape)
    shown = "[" + ", ".join(str(d).replace(" ", "") for d in shape) + "]"
    numel = 1
    for d in shape:
        if not d.is_number:
            continue
        if not d.is_integer or int(d) < 1:
            raise ShapeError(f"the shape {shown} has a dimension {d}; a parameter's dimensions are integers >= 1")
        if int(d) > MAX_PARAM_DIM:
            raise ShapeError(f"the shape {shown} has a dimension of {int(d)}, more than the limit of 2**40 "
                             f"({MAX_PARAM_DIM:.3g}) per dimension")
        numel *= int(d)
    if numel > MAX_PARAM_NUMEL:
        raise ShapeError(f"the shape {shown} has {numel:.3g} elements, more than the limit of 2**48 "
                         f"({MAX_PARAM_NUMEL:.3g}) per parameter")


class GraphBuilder:
    """Builds a graph. ``dtype`` is the model's parameter/activation dtype recorded in the IR. ``symbols``: the
    graph's shape symbols (its signature); by default the symbols of its inputs' shapes, in order; given
    explicitly, an input shape using another symbol is an error."""

    def __init__(self, name: str, symbols: Sequence[str] | None = None, dtype: str = DEFAULT_DTYPE,
                 source: str | None = None):
        self.name = name
        self._auto_symbols = symbols is None
        self.symbols = () if symbols is None else tuple(symbols)
        self.dtype = canon_dtype(dtype)
        self.nodes: list[Node] = []
        self._by_name: dict[str, Node] = {}
        self._param_names: dict[str, Ref] = {}
        self._param_prefixes: set[str] = set()   # every proper dotted prefix of a parameter name (its modules)
        self._count = 0
        self.source = source      # spec text, for error excerpts
        self.meta: dict[str, Any] = {}
        self.name_prefix = ""     # fresh node names are f"{name_prefix}{n}" (passes set it per expansion)

    # -- basics -----------------------------------------------------------------------------
    def _fresh(self, hint: str | None = None) -> str:
        if hint and hint not in self._by_name:
            return hint
        name = f"{self.name_prefix}{self._count}"
        self._count += 1
        while name in self._by_name:
            name = f"{self.name_prefix}{self._count}"
            self._count += 1
        return name

    def add_node(self, node: Node) -> Node:
        if node.name in self._by_name:
            raise MtcError(f"duplicate node name %{node.name}", node.loc)
        self.nodes.append(node)
        self._by_name[node.name] = node
        return node

    def type(self, ref: Ref) -> TensorType:
        return self._by_name[ref.node].types[ref.index]

    def error(self, msg: str, loc: Loc | None, hint: str | None = None) -> MtcError:
        return MtcError(msg, loc, self.source if loc is not None else None, hint)

    # -- sources ----------------------------------------------------------------------------
    def input(self, name: str, dtype: str, shape, loc: Loc | None = None) -> Ref:
        t = TensorType(canon_dtype(dtype, loc), tuple(dim(d) for d in shape))
        for d in t.shape:
            for s in sorted(map(str, d.free_symbols)):
                if s in self.symbols:
                    continue
                if not self._auto_symbols:
                    raise self.error(f"input '{name}': the shape symbol '{s}' is not one of the graph's symbols "
                                     f"({', '.join(self.symbols) or 'none'})", loc)
                self.symbols += (s,)
        n = self.add_node(Node(self._fresh(name), "input", (), make_attrs({"name": name}), (t,), loc))
        return n.out()

    def param(self, name: str, shape, init: str = "normal", *, kind: str = "param", dtype: str | None = None,
              std: float | None = None, active: float | None = None, pinned: bool = False,
              loc: Loc | None = None) -> Ref:
        """A parameter (or buffer). ``pinned``: keep ``dtype`` whatever the compile dtype (precision-critical
        tensors such as A_log, dt_bias and the router bias stay float32)."""
        if name in self._param_names:
            raise self.error(f"parameter '{name}' is defined twice: parameters are named after their place in the "
                             f"model (Hugging Face layout), so a second top-level call of the same layer op, a second "
                             f"stack, or a layer block in a slot meant for another kind collides; give the second "
                             f"one its own name (name=\"...\" on a top-level op, prefix=\"...\" on a stack)", loc)
        parts = name.split(".")
        for j in range(1, len(parts)):
            head = ".".join(parts[:j])
            if head in self._param_names:
                raise self.error(f"parameter '{name}' lies under parameter '{head}': one path cannot be both a "
                                 f"tensor and a module (a state dict cannot hold both); rename one of them", loc)
        if name in self._param_prefixes:
            other = next(p for p in self._param_names if p.startswith(name + "."))
            raise self.error(f"parameter '{name}' is the module path of parameter '{other}': one path cannot be "
                             f"both a tensor and a module (a state dict cannot hold both); rename one of them", loc)
        if dtype is not None:
            dtype = canon_dtype(dtype, loc)
        attrs: dict[str, Any] = {"name": name, "init": init}
        if pinned:
            attrs["pinned"] = True
        if std is not None:
            attrs["std"] = float(std)
        if active is not None:
            attrs["active"] = float(active)
        shape = tuple(dim(d) for d in shape)
        for d in shape:
            if d.is_number and int(d) <= 0:
                raise self.error(f"parameter '{name}' would have a non-positive dimension {list(shape)}", loc)
        free = sorted({str(x) for d in shape for x in d.free_symbols})
        if free:
            shown = "[" + ", ".join(str(d).replace(" ", "") for d in shape) + "]"
            what = "is a symbolic dimension" if len(free) == 1 else "are symbolic dimensions"
            raise self.error(f"parameter '{name}' would have the shape {shown}: a parameter's size is fixed when the "
                             f"model is built, but {', '.join(free)} {what} of an input (the op sized its weight "
                             f"from its input's axis); declare that axis with a number (e.g. f32[B, T, 64]) or a "
                             f"config value", loc)
        try:
            check_param_shape(shape)
        except ShapeError as e:
            raise self.error(f"parameter '{name}': {e}", loc) from None
        t = TensorType(dtype or self.dtype, shape)
        n = self.add_node(Node(self._fresh(f"p{len(self._param_names)}"), kind, (), make_attrs(attrs), (t,), loc))
        self._param_names[name] = n.out()
        self._param_prefixes.update(".".join(parts[:j]) for j in range(1, len(parts)))
        return n.out()

    # -- ops --------------------------------------------------------------------------------
    def call(self, op: str, *inputs: Ref, loc: Loc | None = None, name: str | None = None, **attrs):
        """Emit op ``op`` on ``inputs``. Ops that own parameters (layers, embedding, rmsnorm, ...)
        create them under the state-dict prefix ``name`` when their parameter inputs are not given.
        Returns a Ref, or a tuple of Refs for multi-output ops."""
        OPS = _ops()
        if op not in OPS:
            raise self.error(f"unknown op '{op}'{did_you_mean(op, OPS)}", loc)
        od = OPS[op]
        attrs = {k: v for k, v in attrs.items()}
        # split attrs that only size parameters (not stored on the node)
        pattrs = {k: attrs.pop(k) for k in list(attrs) if k in od.param_attrs}
        unknown = [k for k in attrs if k not in od.attrs]
        if unknown:
            # ops that own parameters also take name= (their state-dict prefix)
            allowed = sorted(set(od.attrs) | set(od.param_attrs) | ({"name"} if od.params is not None else set()))
            raise self.error(f"op '{op}' has no attribute '{unknown[0]}'{did_you_mean(unknown[0], allowed)}; "
                             f"it takes: {', '.join(allowed) or 'none'}", loc)
        try:
            # types first: the parameter rules below compute with these values; then the parameter-sizing
            # attributes' values (the node does not keep them, so only the builder sees them)
            od.check_attrs({**attrs, **pattrs}, values=False)
            od.check_attrs(pattrs)
        except ShapeError as e:
            raise self.error(f"{op}: {e}", loc) from None
        full = {}
        for k, default in od.attrs.items():
            if k in attrs:
                full[k] = attrs[k]
            elif default is REQUIRED:
                raise self.error(f"op '{op}' needs attribute '{k}'", loc)
            else:
                full[k] = default
        inputs = list(inputs)
        in_types = [self.type(r) for r in inputs]
        if od.params is not None and len(inputs) != od.n_data_inputs:
            # given its parameters explicitly (expansions, parsed IR) or a wrong count: the latter is an error
            # here, at the call, not an unpacking failure inside a shape rule or an op expansion
            k = None
            if len(inputs) > od.n_data_inputs:
                try:
                    k = od.n_params({**full, **pattrs}, in_types[:od.n_data_inputs])
                except ShapeError as e:
                    raise self.error(f"{op}: {e}", loc) from None
            if k is None or len(inputs) != od.n_data_inputs + k:
                raise self.error(f"{op}: {od.arity_message(len(inputs))}", loc)
        if od.params is not None and len(inputs) == od.n_data_inputs:
            # a float op given an integer tensor says so before its parameters are sized from that tensor (else
            # rmsnorm(ids [B, T]) reported a weight of the symbolic size T)
            from .ops import _need_float
            try:
                for nm, t in zip(od.data_inputs, in_types):
                    if nm not in od.int_data:
                        _need_float(t, nm)
            except ShapeError as e:
                raise self.error(f"{op}: {e}", loc) from None
            for k, default in od.param_attrs.items():
                if k not in pattrs:
                    if default is REQUIRED:
                        raise self.error(f"op '{op}' needs attribute '{k}' (to size its parameters)", loc)
                    pattrs[k] = default
            prefix = name or od.default_name
            if prefix is None:
                raise self.error(f"op '{op}' owns parameters: give it a name= (its state-dict prefix)", loc)
            try:
                specs = od.params({**full, **pattrs}, in_types)
                od.check_attrs(full)                  # the node's attribute values, before its parameters exist
            except ShapeError as e:
                raise self.error(f"{op}: {e}", loc) from None
            for s in specs:
                pname = f"{prefix}.{s.suffix}" if prefix else s.suffix
                inputs.append(self.param(pname, s.shape, s.init, kind=s.kind, dtype=s.dtype, std=s.std,
                                         active=s.active, pinned=s.dtype == "f32", loc=loc))
            in_types = [self.type(r) for r in inputs]
        try:
            out_types = od.check_and_infer(in_types, full)
        except ShapeError as e:
            raise self.error(f"{op}: {e}", loc) from None
        n = self.add_node(Node(self._fresh(), op, tuple(inputs), make_attrs(full), tuple(out_types), loc))
        if len(out_types) == 1:
            return n.out()
        return tuple(n.out(i) for i in range(len(out_types)))

    def __getattr__(self, op: str):
        if op.startswith("_") or op not in _ops():
            raise AttributeError(op)
        return lambda *inputs, **kw: self.call(op, *inputs, **kw)

    def build(self, outputs: Sequence[Ref]) -> Graph:
        if not outputs:
            raise MtcError(f"graph '{self.name}' needs at least one output")
        meta = tuple(sorted((k, v) for k, v in self.meta.items()))
        return Graph(self.name, tuple(self.nodes), tuple(outputs), self.symbols, meta)


def _ops() -> dict:
    global _OPS
    if _OPS is None:
        from .ops import OPS
        _OPS = OPS
    return _OPS


_OPS = None


class _Required:
    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()
