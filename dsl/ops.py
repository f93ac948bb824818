"""The op registry: every graph op's signature, shape rule, parameters, FLOP count and (for layer-level
building blocks) its expansion into primitive ops.

Primitive ops are the ones of ../shared/spec/OPS.md (kda_gate, kda_chunk, mla_attention, qb_route,
situ_glu, moe_experts, attn_residual) plus the graph ops embedding, linear, rmsnorm, l2norm, short_conv,
silu, sigmoid, mul, add, lm_head and the data-movement ops reshape, slice, concat, broadcast.

Layer-level ops (kda_layer, mla_layer, glu_ffn, latent_moe, moe) own their parameters (created with
Hugging Face style state-dict names) and are expanded into primitive ops by the ``canonicalize`` pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import sympy

from .builder import REQUIRED, GraphBuilder, ParamSpec, ShapeError, check_param_shape
from .ir import DTYPES, Dim, Ref, TensorType, as_expr, dim, dims_equal

FLOAT = ("f32", "f16", "bf16", "f64")
#: the routed experts' storage dtypes ("" = the model dtype)
EXPERT_DTYPES = ("", "f32", "bf16", "f16", "mxfp4", "fp8")
#: the initialisers a param / buffer node names (backends/runtime.py _init_ implements them)
INITS = ("normal", "expert", "ones", "zeros", "conv", "a_log", "dt_bias", "dt_bias_sigmoid")


# ---------------------------------------------------------------------------------------------
# attribute kinds: what an attribute's value may be. One check per op (OpDef.check_attrs) serves the builder
# (specs, Python) and the IR path (parse_ir, verify, infer_shapes) alike.
def show_value(v) -> str:
    """An attribute value as a message shows it: none / true / false / [1, 2] / 'text' / 1e-06."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(show_value(x) for x in v) + "]"
    return repr(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Kind:
    """An attribute kind: ``type_ok`` is the type test (its failure says 'must be <what>'), ``value_ok`` the
    value constraint on a value of the right type (its failure says 'must be <rule>')."""

    what: str
    type_ok: Callable
    rule: str = ""
    value_ok: Callable | None = None
    optional: bool = False          # none is allowed (and means 'not set')
    options: tuple = ()             # the allowed strings (one_of): a misspelling gets a suggestion

    def error(self, v, values: bool = True) -> str | None:
        """None if ``v`` is a valid value, else what it must be."""
        if v is None and self.optional:
            return None
        if not self.type_ok(v):
            return ("none or " if self.optional else "") + self.what
        if values and self.value_ok is not None and not self.value_ok(v):
            return ("none or " if self.optional else "") + self.rule
        return None

    def or_none(self) -> "Kind":
        return Kind(self.what, self.type_ok, self.rule, self.value_ok, True, self.options)


INT = Kind("an integer", _is_int)
SIZE = Kind("an integer", _is_int, "an integer >= 1", lambda v: v >= 1)
COUNT = Kind("an integer", _is_int, "an integer >= 0", lambda v: v >= 0)
NUMBER = Kind("a number", _is_num, "a finite number", math.isfinite)
POSITIVE = Kind("a number", _is_num, "a positive number (finite, > 0)", lambda v: 0 < v < math.inf)
NEGATIVE = Kind("a number", _is_num, "a negative number (finite, < 0)", lambda v: -math.inf < v < 0)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
STRING = Kind("a string", lambda v: isinstance(v, str))
SHAPE = Kind("a list of integers and shape symbols",
             lambda v: isinstance(v, (tuple, list)) and all(_is_int(x) or isinstance(x, (str, sympy.Expr)) for x in v))
AXIS = INT                          # a dim index: its range (-rank..rank-1) is checked against the input


def one_of(*options: str) -> Kind:
    return Kind("a string", lambda v: isinstance(v, str), "one of " + ", ".join(repr(o) for o in options),
                lambda v: v in options, options=options)


def attr_error(key: str, kind: Kind, v, values: bool = True) -> str | None:
    """The message for a bad value of attribute ``key`` ('attribute 'eps' must be a number, got true'), or None."""
    bad = kind.error(v, values)
    if not bad:
        return None
    from .errors import did_you_mean
    hint = did_you_mean(v, [o for o in kind.options if o]) if kind.options and isinstance(v, str) else ""
    return f"attribute '{key}' must be {bad}, got {show_value(v)}{hint}"


#: attribute kinds by name, shared by the ops that use the name; an op declares its own in ``kinds`` where the
#: name means something else there (slice's dim is an axis, embedding's a size)
ATTR_KINDS: dict[str, Kind] = {
    **{k: SIZE for k in ("heads", "head_dim", "conv_size", "kv_lora_rank", "v_dim", "inter", "experts", "top_k",
                         "latent", "vocab", "out", "n_queries")},
    **{k: COUNT for k in ("v_head_dim", "forget_rank", "gate_rank", "q_lora_rank", "qk_nope_dim", "qk_rope_dim",
                          "shared", "shared_inter", "index")},
    **{k: POSITIVE for k in ("eps", "norm_eps", "routed_scaling", "beta_gate", "beta_up", "scale")},
    "lower_bound": NUMBER, "gated": BOOL, "causal": BOOL, "shape": SHAPE,
    "gate": one_of("sigmoid", "softplus"), "act": one_of("situ", "silu"), "activation": one_of("situ", "silu"),
    "expert_dtype": one_of(*EXPERT_DTYPES), "dtype": one_of(*DTYPES),
}


def _kind_from_default(default) -> Kind | None:
    if isinstance(default, bool):
        return BOOL
    if isinstance(default, int):
        return INT
    if isinstance(default, float):
        return NUMBER
    if isinstance(default, str):
        return STRING
    return None


@dataclass
class OpDef:
    name: str
    infer: Callable[[list[TensorType], dict], list[TensorType]]
    n_data_inputs: int = 1
    attrs: dict = field(default_factory=dict)
    param_attrs: dict = field(default_factory=dict)
    params: Callable | None = None
    expand: Callable | None = None
    flops: Callable | None = None
    default_name: str | None = None
    variadic: bool = False
    doc: str = ""
    inputs: tuple = ()
    is_layer: bool = False
    kinds: dict = field(default_factory=dict)   # attribute kinds that differ from ATTR_KINDS' by-name ones
    int_data: tuple = ()                        # data inputs that take integer tensors (embedding's ids)

    def __post_init__(self):
        for k, default in {**self.attrs, **self.param_attrs}.items():
            if self.kind(k) is None:
                raise TypeError(f"op '{self.name}': attribute '{k}' has no kind (declare it in kinds=)")

    def kind(self, key: str) -> Kind | None:
        """What attribute ``key`` may be: declared with the op, else by name (ATTR_KINDS), else the type of its
        default (bool, int, float, str)."""
        if key in self.kinds:
            return self.kinds[key]
        if key in ATTR_KINDS:
            return ATTR_KINDS[key]
        return _kind_from_default({**self.attrs, **self.param_attrs}.get(key))

    def check_attrs(self, attrs: dict, values: bool = True) -> None:
        """Check attribute types (and with ``values`` their value constraints: eps > 0 and finite, sizes >= 1,
        strings from the op's set ...); booleans are not numbers. Keys the op does not take and REQUIRED
        placeholders are left to the caller. Raises ShapeError naming the attribute."""
        for k, v in attrs.items():
            if v is REQUIRED or (k not in self.attrs and k not in self.param_attrs):
                continue
            kind = self.kind(k)
            bad = attr_error(k, kind, v, values) if kind is not None else None
            if bad:
                raise ShapeError(bad)

    def check_params(self, specs: list, param_types: list[TensorType]) -> None:
        """Check the parameter inputs' types against the ParamSpecs the op's attributes imply. Raises
        ShapeError."""
        for i, (s, t) in enumerate(zip(specs, param_types)):
            want = tuple(dim(d) for d in s.shape)
            if t.rank != len(want) or not all(dims_equal(p, q) for p, q in zip(t.shape, want)) \
                    or (s.dtype is not None and t.dtype != s.dtype):
                dt = s.dtype or t.dtype
                raise ShapeError(f"parameter '{s.suffix}' (input {self.n_data_inputs + i + 1}) is {t}, but the "
                                 f"attributes and the input give "
                                 f"{dt}[{', '.join(str(d).replace(' ', '') for d in want)}]")

    @property
    def data_inputs(self) -> tuple:
        """The names of the tensors a call passes (for ops that own parameters: without them)."""
        return self.inputs[:self.n_data_inputs] if self.params is not None else self.inputs

    def n_params(self, attrs: dict, data_types: list[TensorType]) -> int:
        """How many parameter inputs follow the data inputs once the op's parameters exist (0 for ops that
        own none). Layer ops derive the count from their attributes (``attrs`` complete, defaults filled in);
        the others list theirs after the data inputs in ``inputs``. Raises ShapeError as ``params`` does."""
        if self.params is None:
            return 0
        if not self.is_layer:
            return len(self.inputs) - self.n_data_inputs
        return len(self.params(attrs, data_types))

    def arity_message(self, got: int) -> str:
        """'takes 1 tensor input (x), got 0': the call-site count of data inputs (parameters excluded)."""
        names = [n.lstrip("*") for n in self.data_inputs]
        n = self.n_data_inputs
        if self.variadic:
            return f"takes at least {n} tensor inputs ({', '.join(names)}), got {got}"
        return f"takes {n} tensor input{'s' if n != 1 else ''} ({', '.join(names)}), got {got}"

    def check_and_infer(self, in_types: list[TensorType], attrs: dict) -> list[TensorType]:
        """Check the input count and types of a graph node (parameters included) and infer its output types.
        Raises ShapeError."""
        n, got = self.n_data_inputs, len(in_types)
        if got < n or (not self.variadic and self.params is None and got != n):
            raise ShapeError(self.arity_message(got))
        for t in in_types:
            if t is None:
                raise ShapeError("an input has no type (run infer_shapes first)")
        missing = [k for k, v in attrs.items() if v is REQUIRED]
        if missing:
            raise ShapeError(f"needs attribute '{missing[0]}'")
        # types first (the shape rules compute with the values); the value constraints after the op's own
        # parameter rules, whose messages are more specific (top_k in [1, experts], conv_size in [1, 64])
        self.check_attrs(attrs, values=False)
        specs = None
        if self.params is not None:
            if self.is_layer or not self.param_attrs:     # the parameters follow from attributes and input
                specs = self.params(attrs, in_types[:n])
            k = len(specs) if self.is_layer else len(self.inputs) - n
            if got != n + k:
                what = (f"its parameter {', '.join(self.inputs[n:])}" if not self.is_layer
                        else f"its {k} parameters")
                raise ShapeError(f"takes {n + k} inputs ({', '.join(self.data_inputs)} and {what}), got {got}")
        self.check_attrs(attrs)
        if specs is not None:
            self.check_params(specs, in_types[n:])
        return self.infer(in_types, attrs)


OPS: dict[str, OpDef] = {}


def register(name: str, infer, **kw) -> OpDef:
    od = OpDef(name, infer, **kw)
    OPS[name] = od
    return od


# ---------------------------------------------------------------------------------------------
# helpers
def _shape(t: TensorType) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def _eq(a: Dim, b: Dim) -> bool:
    return dims_equal(a, b)


def _need_float(t: TensorType, what: str):
    if t.dtype not in FLOAT:
        raise ShapeError(f"{what} must be a float tensor, got {t.dtype}")


def _need_rank(t: TensorType, r: int, what: str):
    if t.rank != r:
        raise ShapeError(f"{what} must have rank {r}, got {t}")


def numel(t: TensorType) -> Dim:
    return t.numel()


def _tokens(t: TensorType) -> Dim:
    return sympy.Mul(*t.shape[:-1]) if t.rank > 1 else sympy.Integer(1)


def _dims_attr(shape) -> tuple:
    """A shape as an attribute value: ints stay ints, symbolic dims become strings."""
    out = []
    for d in shape:
        d = dim(d)
        out.append(int(d) if d.is_number else str(d))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# elementwise and data movement
def _unary(ts, a):
    _need_float(ts[0], "input")
    return [ts[0]]


for _n, _doc in [("silu", "x * sigmoid(x)"), ("sigmoid", "1 / (1 + exp(-x))")]:
    register(_n, _unary, inputs=("x",), flops=lambda ts, os, a: 4 * numel(ts[0]), doc=_doc)


def _broadcast_shapes(a: TensorType, b: TensorType) -> tuple:
    ra, rb = list(a.shape), list(b.shape)
    n = max(len(ra), len(rb))
    ra = [sympy.Integer(1)] * (n - len(ra)) + ra
    rb = [sympy.Integer(1)] * (n - len(rb)) + rb
    out = []
    for x, y in zip(ra, rb):
        if _eq(x, y) or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ShapeError(f"shapes {_shape(a)} and {_shape(b)} do not broadcast")
    return tuple(out)


def _binary(ts, a):
    x, y = ts
    _need_float(x, "lhs")
    _need_float(y, "rhs")
    if x.dtype != y.dtype:
        raise ShapeError(f"dtypes differ: {x.dtype} and {y.dtype}")
    return [TensorType(x.dtype, _broadcast_shapes(x, y))]


register("add", _binary, n_data_inputs=2, inputs=("a", "b"), flops=lambda ts, os, a: numel(os[0]),
         doc="a + b (numpy broadcasting)")
register("mul", _binary, n_data_inputs=2, inputs=("a", "b"), flops=lambda ts, os, a: numel(os[0]),
         doc="a * b (numpy broadcasting)")


def _dims(shape) -> str:
    return "[" + ", ".join(str(d).replace(" ", "") for d in shape) + "]"


def _target_shape(x: TensorType, a: dict) -> tuple:
    """The ``shape`` attribute of reshape / broadcast as dims; a symbol that x's shape lacks is an error."""
    from .dim_expr import DimError
    try:
        shape = tuple(dim(d) for d in a["shape"])
    except (TypeError, ValueError) as e:
        got = a["shape"]
        got = "[" + ", ".join(map(str, got)) + "]" if isinstance(got, (list, tuple)) else repr(got)
        why = f": {e.msg}" if isinstance(e, DimError) else ""
        raise ShapeError(f"shape must list integers and shape symbols, got {got}{why}") from None
    for d in shape:
        if d.is_number and d < 1:
            hint = f" (no -1 to infer one: write it, e.g. {_dims(_filled(shape, x))})" if d < 0 else ""
            raise ShapeError(f"the shape {_dims(shape)} has a size {d}: every size is an integer >= 1 or a shape "
                             f"symbol{hint}")
    have = set().union(*(d.free_symbols for d in x.shape)) if x.shape else set()
    for d in shape:
        for s in sorted(d.free_symbols - have, key=str):
            names = ", ".join(sorted(str(v) for v in have)) or "none"
            raise ShapeError(f"unknown symbol '{s}' in the shape {_dims(shape)}: the input {_shape(x)} has "
                             f"symbols {names}")
    return shape


def _filled(shape: tuple, x: TensorType) -> tuple:
    """shape with one -1 replaced by what the element count of x leaves for it (for the error's example), or
    shape unchanged when that is not one integer or symbol product."""
    if sum(1 for d in shape if d.is_number and d < 0) != 1:
        return shape
    rest = sympy.Mul(*(d for d in shape if not (d.is_number and d < 0)))
    fill = sympy.simplify(x.numel() / rest)
    return tuple(fill if (d.is_number and d < 0) else d for d in shape)


def _reshape(ts, a):
    x = ts[0]
    shape = _target_shape(x, a)
    if not _eq(sympy.Mul(*shape), x.numel()):
        raise ShapeError(f"cannot reshape {_shape(x)} into {_dims(shape)}: element counts differ "
                         f"({_dims([x.numel()])[1:-1]} vs {_dims([sympy.Mul(*shape)])[1:-1]})")
    return [TensorType(x.dtype, shape)]


register("reshape", _reshape, attrs={"shape": REQUIRED}, inputs=("x",), doc="view x with a new shape")


def _axis(a: dict, x: TensorType) -> int:
    """The ``dim`` attribute as an index into x's shape; ShapeError unless -rank <= dim < rank (as torch)."""
    d, r = a["dim"], x.rank
    if not -r <= d < r:
        valid = f"{-r}..{r - 1}" if r else "none: the input is a scalar"
        raise ShapeError(f"dim {d} is out of range for the rank-{r} input {x} (valid: {valid})")
    return d % r


def _slice(ts, a):
    x = ts[0]
    d = _axis(a, x)
    size = x.shape[d]
    s, e = a["start"], a["end"]
    if not (0 <= s < e) or (size.is_number and e > int(size)):
        raise ShapeError(f"slice [{s}:{e}] out of range for dim {d} of size {size}")
    return [x.with_shape(x.shape[:d] + (sympy.Integer(e - s),) + x.shape[d + 1:])]


register("slice", _slice, attrs={"dim": -1, "start": REQUIRED, "end": REQUIRED}, inputs=("x",),
         kinds={"dim": AXIS, "start": INT, "end": INT}, doc="x[..., start:end, ...] along dim")


def _concat(ts, a):
    x, y = ts
    d = _axis(a, x)
    if x.rank != y.rank or x.dtype != y.dtype or any(
            not _eq(p, q) for i, (p, q) in enumerate(zip(x.shape, y.shape)) if i != d):
        raise ShapeError(f"cannot concatenate {x} and {y} along dim {d}")
    return [x.with_shape(x.shape[:d] + (x.shape[d] + y.shape[d],) + x.shape[d + 1:])]


register("concat", _concat, n_data_inputs=2, attrs={"dim": -1}, inputs=("a", "b"), kinds={"dim": AXIS},
         doc="cat([a, b], dim)")


def _broadcast(ts, a):
    x = ts[0]
    shape = _target_shape(x, a)
    if len(shape) != x.rank or any(not (_eq(p, q) or p == 1) for p, q in zip(x.shape, shape)):
        raise ShapeError(f"cannot broadcast {_shape(x)} to {_dims(shape)}")
    return [x.with_shape(shape)]


register("broadcast", _broadcast, attrs={"shape": REQUIRED}, inputs=("x",), doc="expand size-1 dims")


# ---------------------------------------------------------------------------------------------
# basic layers with parameters
def _embedding(ts, a):
    ids, w = ts
    if ids.dtype not in ("i64", "i32"):
        raise ShapeError(f"token ids must be integer, got {ids.dtype}")
    _need_rank(w, 2, "embedding weight")
    return [TensorType(w.dtype, ids.shape + (w.shape[1],))]


register("embedding", _embedding, n_data_inputs=1, inputs=("ids", "weight"), int_data=("ids",),
         param_attrs={"vocab": REQUIRED, "dim": REQUIRED}, kinds={"dim": SIZE},
         params=lambda a, ts: [ParamSpec("weight", (a["vocab"], a["dim"]), "normal", std=0.02)],
         default_name="model.embed_tokens", doc="weight[ids]")


def _linear(ts, a):
    x, w = ts[0], ts[1]
    _need_float(x, "x")
    _need_rank(w, 2, "linear weight")
    if not _eq(x.shape[-1], w.shape[1]):
        raise ShapeError(f"x has last dim {x.shape[-1]} but the weight {_shape(w)} expects {w.shape[1]}")
    return [TensorType(x.dtype, x.shape[:-1] + (w.shape[0],))]


register("linear", _linear, n_data_inputs=1, inputs=("x", "weight"), param_attrs={"out": REQUIRED},
         params=lambda a, ts: [ParamSpec("weight", (a["out"], ts[0].shape[-1]))],
         flops=lambda ts, os, a: 2 * numel(ts[0]) * ts[1].shape[0], doc="x @ weight^T; weight [out, in]")


def _lm_head(ts, a):
    return _linear(ts, a)


register("lm_head", _lm_head, n_data_inputs=1, inputs=("x", "weight"), param_attrs={"vocab": REQUIRED},
         params=lambda a, ts: [ParamSpec("weight", (a["vocab"], ts[0].shape[-1]))], default_name="lm_head",
         flops=lambda ts, os, a: 2 * numel(ts[0]) * ts[1].shape[0], doc="logits = x @ weight^T")


def _rmsnorm(ts, a):
    x, w = ts
    _need_float(x, "x")
    if w.rank != 1 or not _eq(w.shape[0], x.shape[-1]):
        raise ShapeError(f"weight {_shape(w)} does not match the last dim of x {_shape(x)}")
    return [x]


register("rmsnorm", _rmsnorm, n_data_inputs=1, inputs=("x", "weight"), attrs={"eps": 1e-6},
         params=lambda a, ts: [ParamSpec("weight", (ts[0].shape[-1],), "ones")], default_name="model.norm",
         flops=lambda ts, os, a: 4 * numel(ts[0]),
         doc="x / sqrt(mean(x^2) + eps) * weight, computed in float32")


register("l2norm", _unary, attrs={"eps": 1e-6}, inputs=("x",), flops=lambda ts, os, a: 3 * numel(ts[0]),
         doc="x / sqrt(sum(x^2) + eps) over the last dim")


def _short_conv(ts, a):
    x, w = ts
    _need_rank(x, 3, "short_conv input [B, T, C]")
    if w.rank != 3 or not _eq(w.shape[0], x.shape[2]) or w.shape[1] != 1:
        raise ShapeError(f"weight {_shape(w)} must be [C, 1, W] with C = {x.shape[2]}")
    return [x]


register("short_conv", _short_conv, n_data_inputs=2, inputs=("x", "weight"),
         flops=lambda ts, os, a: 2 * numel(ts[0]) * ts[1].shape[2],
         doc="causal depthwise conv over T, weight [C, 1, W]")


# ---------------------------------------------------------------------------------------------
# the ops of OPS.md
def _kda_gate(ts, a):
    x, A_log, dt_bias = ts
    _need_rank(x, 4, "kda_gate x [B, T, H, K]")
    H, K = x.shape[2], x.shape[3]
    if A_log.rank != 1 or not _eq(A_log.shape[0], H):
        raise ShapeError(f"A_log {_shape(A_log)} must be [H] with H = {H}")
    if dt_bias.rank != 1 or not _eq(dt_bias.shape[0], H * K):
        raise ShapeError(f"dt_bias {_shape(dt_bias)} must be [H*K] = [{H * K}]")
    if a["gate"] == "sigmoid" and not a["lower_bound"] < 0:
        raise ShapeError(f"lower_bound must be negative, got {a['lower_bound']}")
    return [x.with_dtype("f32")]


register("kda_gate", _kda_gate, n_data_inputs=3, inputs=("x", "A_log", "dt_bias"),
         attrs={"lower_bound": -5.0, "gate": "sigmoid"}, flops=lambda ts, os, a: 6 * numel(ts[0]),
         doc="float32 log decay g <= 0. gate=\"sigmoid\" (default, the lower-bounded gate that kda_chunk's "
             "dense tiles need): g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias)); gate=\"softplus\" "
             "(unbounded, Mamba-style): g = -exp(A_log) * softplus(x + dt_bias)")


def _kda_chunk(ts, a):
    q, k, v, g, beta = ts
    for t, nm in ((q, "q"), (k, "k"), (v, "v"), (g, "g")):
        _need_rank(t, 4, f"{nm} [B, T, H, D]")
    if not all(_eq(x, y) for x, y in zip(q.shape, k.shape)):
        raise ShapeError(f"q {_shape(q)} and k {_shape(k)} differ")
    if not all(_eq(x, y) for x, y in zip(q.shape, g.shape)):
        raise ShapeError(f"g {_shape(g)} must match q {_shape(q)}")
    if not all(_eq(x, y) for x, y in zip(q.shape[:3], v.shape[:3])):
        raise ShapeError(f"v {_shape(v)} must share [B, T, H] with q {_shape(q)}")
    if beta.rank != 3 or not all(_eq(x, y) for x, y in zip(beta.shape, q.shape[:3])):
        raise ShapeError(f"beta {_shape(beta)} must be [B, T, H]")
    return [v]


def _kda_flops(ts, os, a, C=64):
    q, v = ts[0], ts[2]
    B, T, H, K = q.shape
    V = v.shape[3]
    return 2 * B * T * H * (3 * C * K + 2 * C * V + 3 * K * V)


register("kda_chunk", _kda_chunk, n_data_inputs=5, inputs=("q", "k", "v", "g", "beta"),
         attrs={"scale": None, "lower_bound": None}, flops=_kda_flops,
         kinds={"scale": POSITIVE.or_none(), "lower_bound": NEGATIVE.or_none()},
         doc="Kimi Delta Attention, chunked (chunk 64, WY representation); o in v's dtype. lower_bound: the "
             "gate's proven bound (g >= lower_bound), set when g comes from the sigmoid kda_gate: lets every "
             "diagonal tile run as one dense GEMM; None = the safe path")


def _mla_attention(ts, a):
    q, k, v = ts
    for t, nm in ((q, "q"), (k, "k"), (v, "v")):
        _need_rank(t, 4, f"{nm} [B, T, H, D]")
    if not all(_eq(x, y) for x, y in zip(q.shape, k.shape)):
        raise ShapeError(f"q {_shape(q)} and k {_shape(k)} differ")
    if not all(_eq(x, y) for x, y in zip(q.shape[:3], v.shape[:3])):
        raise ShapeError(f"v {_shape(v)} must share [B, T, H] with q")
    return [v]


def _mla_flops(ts, os, a):
    q, v = ts[0], ts[2]
    B, T, H, D = q.shape
    pairs = T * (T + 1) / 2 if a["causal"] else T * T
    return 2 * B * H * pairs * (D + v.shape[3])


register("mla_attention", _mla_attention, n_data_inputs=3, inputs=("q", "k", "v"),
         attrs={"scale": REQUIRED, "causal": True}, flops=_mla_flops,
         doc="softmax(q k^T * scale) v, causal, softmax in float32")


def _qb_route(ts, a):
    x, w, b = ts
    _need_rank(x, 2, "router input x [N, d]")
    _need_rank(w, 2, "router weight [E, d]")
    if not _eq(x.shape[1], w.shape[1]):
        raise ShapeError(f"x {_shape(x)} and router weight {_shape(w)} disagree on d")
    if b.rank != 1 or not _eq(b.shape[0], w.shape[0]):
        raise ShapeError(f"bias {_shape(b)} must be [E] = [{w.shape[0]}]")
    k = a["top_k"]                            # routed_scaling > 0: its kind (OpDef.check_attrs)
    if w.shape[0].is_number and not 1 <= k <= int(w.shape[0]):
        raise ShapeError(f"top_k = {k} must be in [1, E = {w.shape[0]}]")
    N = x.shape[0]
    return [TensorType("i64", (N, k)), TensorType("f32", (N, k)), TensorType("f32", (N, w.shape[0]))]


register("qb_route", _qb_route, n_data_inputs=3, inputs=("x", "weight", "bias"),
         attrs={"top_k": REQUIRED, "routed_scaling": 1.0},
         flops=lambda ts, os, a: 2 * numel(ts[0]) * ts[1].shape[0],
         doc="sigmoid router, top-k on score + bias (Quantile Balancing), unbiased renormalised weights")


def _positive(a, *keys):
    """ShapeError unless each attribute is a finite number > 0 (the SiTU betas divide; a routed_scaling <= 0
    flips or zeroes the expert mix). Their kinds check the same in every op (OpDef.check_attrs); a MoE layer's
    parameter rule checks them first, to say so before anything is built from them."""
    for k in keys:
        v = a[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ShapeError(f"{k} must be a finite number > 0, got {v!r}")


register("situ_glu", _binary, n_data_inputs=2, inputs=("a", "b"), attrs={"beta_gate": 4.0, "beta_up": 25.0},
         flops=lambda ts, os, a: 10 * numel(os[0]),
         doc="(bg*tanh(a/bg)*sigmoid(a)) * (bu*tanh(b/bu))")


def _moe_experts(ts, a):
    x, idx, w, w1, w3, w2 = ts
    _need_rank(x, 2, "x_lat [N, l]")
    if idx.dtype not in ("i64", "i32") or idx.rank != 2:
        raise ShapeError(f"topk_idx must be integer [N, k], got {idx}")
    if w.rank != 2 or not (_eq(w.shape[0], idx.shape[0]) and _eq(w.shape[1], idx.shape[1])):
        raise ShapeError(f"topk_weight {_shape(w)} must be [N, k] like topk_idx {_shape(idx)}")
    if not _eq(idx.shape[0], x.shape[0]):
        raise ShapeError(f"topk_idx {_shape(idx)} must have one row per token of x_lat {_shape(x)}")
    _need_rank(w1, 3, "w1 [E, I, l]")
    _need_rank(w3, 3, "w3 [E, I, l]")
    _need_rank(w2, 3, "w2 [E, l, I]")
    E, I, L = w1.shape
    if not (_eq(L, x.shape[1]) and all(_eq(p, q) for p, q in zip(w1.shape, w3.shape))):
        raise ShapeError(f"w1 {_shape(w1)} / w3 {_shape(w3)} must be [E, I, l] with l = {x.shape[1]}")
    if not (_eq(w2.shape[0], E) and _eq(w2.shape[1], L) and _eq(w2.shape[2], I)):
        raise ShapeError(f"w2 {_shape(w2)} must be [E, l, I] = [{E}, {L}, {I}]")
    return [x]                                # activation, beta_gate, beta_up: their kinds (OpDef.check_attrs)


register("moe_experts", _moe_experts, n_data_inputs=6,
         inputs=("x_lat", "topk_idx", "topk_weight", "w1", "w3", "w2"),
         attrs={"activation": "situ", "beta_gate": 4.0, "beta_up": 25.0},
         flops=lambda ts, os, a: 2 * ts[0].shape[0] * ts[1].shape[1] * 3 * ts[3].shape[1] * ts[3].shape[2],
         doc="u = sum_k w_k * w2_e act(w1_e x, w3_e x), e = topk_idx[:, k]")


def _attn_residual(ts, a):
    q, w, *src = ts
    if not src:
        raise ShapeError("needs at least one source")
    _need_float(q, "query")
    _need_float(w, "rms_weight")
    _need_float(src[0], "source 0")
    d = src[0].shape[-1]
    if q.rank != 1 or not _eq(q.shape[0], d) or w.rank != 1 or not _eq(w.shape[0], d):
        raise ShapeError(f"query {_shape(q)} and rms_weight {_shape(w)} must be [d] = [{d}]")
    for i, s in enumerate(src):
        if not s.same(src[0]):
            raise ShapeError(f"source {i} is {s}, source 0 is {src[0]}")
    return [src[0]]


register("attn_residual", _attn_residual, n_data_inputs=3, variadic=True,
         inputs=("query", "rms_weight", "*sources"), attrs={"eps": 1e-6},
         flops=lambda ts, os, a: 5 * numel(ts[2]) * (len(ts) - 2),
         doc="softmax over sources of query . RMSNorm(source) -> weighted sum of sources (Block AttnRes)")


# ---------------------------------------------------------------------------------------------
# layer-level building blocks
def _x_only(what, sequence: bool = False):
    """Type rule of a layer op that keeps its input's type: x float [..., d]; sequence: exactly [B, T, d] (the
    sequence mixers, KDA and MLA, run along dim 1)."""
    def infer(ts, a):
        x = ts[0]
        _need_float(x, "x")
        if sequence and x.rank != 3:
            raise ShapeError(f"input must be [B, T, d] (batch, sequence, width), got {x}")
        if x.rank < 2:
            raise ShapeError(f"input must be [..., d], got {x}")
        return [x]
    return infer


def _lead(x: TensorType) -> tuple:
    return x.shape[:-1]


def _reshape_to(b: GraphBuilder, x: Ref, shape, loc) -> Ref:
    return b.call("reshape", x, shape=_dims_attr(shape), loc=loc)


def _lin(b, x, w, loc):
    return b.call("linear", x, w, loc=loc)


# -- KDA layer
def _kda_params(a, ts):
    d = ts[0].shape[-1]
    H, K = a["heads"], a["head_dim"]
    V = a["v_head_dim"] or K
    W, fr, gr = a["conv_size"], a["forget_rank"] or K, a["gate_rank"]
    if not 1 <= W <= 64:
        raise ShapeError(f"conv_size = {W} must be in [1, 64] (the short convolution's width, 4 in Kimi Linear)")
    if a["gate"] == "sigmoid" and not a["lower_bound"] < 0:     # kda_gate's rule, checked at the layer already
        raise ShapeError(f"lower_bound must be negative with gate 'sigmoid', got {a['lower_bound']}")
    p = [ParamSpec("q_proj.weight", (H * K, d)), ParamSpec("k_proj.weight", (H * K, d)),
         ParamSpec("v_proj.weight", (H * V, d)),
         ParamSpec("q_conv1d.weight", (H * K, 1, W), "conv"), ParamSpec("k_conv1d.weight", (H * K, 1, W), "conv"),
         ParamSpec("v_conv1d.weight", (H * V, 1, W), "conv"),
         ParamSpec("f_a_proj.weight", (fr, d)), ParamSpec("f_b_proj.weight", (H * K, fr)),
         ParamSpec("b_proj.weight", (H, d))]
    if gr:
        p += [ParamSpec("g_a_proj.weight", (gr, d)), ParamSpec("g_b_proj.weight", (H * V, gr))]
    else:
        p += [ParamSpec("g_proj.weight", (H * V, d))]
    # decay-gate parameters: Mamba's convention for the softplus gate (A in [1, 16], dt_bias = softplus^-1(dt));
    # for the sigmoid gate A = 1 and sigmoid(dt_bias) log-uniform in [2e-4, 0.2], i.e. g = lower_bound *
    # sigmoid(x + dt_bias) starts at 2e-4 .. 0.2 of the bound (at -5: decay per token exp(-1e-3) .. exp(-1)), where
    # it passes gradient. (Mamba's values inside the sigmoid put exp(A_log) (x + dt_bias) near -50: g ~ -1e-5, no
    # forgetting and no gradient to the gate.)
    if a["gate"] == "sigmoid":
        p += [ParamSpec("A_log", (H,), "zeros", dtype="f32"),
              ParamSpec("dt_bias", (H * K,), "dt_bias_sigmoid", dtype="f32")]
    else:
        p += [ParamSpec("A_log", (H,), "a_log", dtype="f32"), ParamSpec("dt_bias", (H * K,), "dt_bias", dtype="f32")]
    p += [ParamSpec("o_norm.weight", (V,), "ones"), ParamSpec("o_proj.weight", (d, H * V))]
    return p


def _slots(x: Ref, params: list[Ref], specs: list[ParamSpec]) -> dict:
    return {s.suffix.removesuffix(".weight"): r for s, r in zip(specs, params)}


def _kda_expand(b: GraphBuilder, inputs: list[Ref], a: dict, loc):
    x = inputs[0]
    xt = b.type(x)
    specs = _kda_params(a, [xt])
    P = _slots(x, inputs[1:], specs)
    H, K = a["heads"], a["head_dim"]
    V = a["v_head_dim"] or K
    lead = _lead(xt)

    def conv_branch(w, cw, D):
        y = b.call("short_conv", _lin(b, x, w, loc), cw, loc=loc)
        return _reshape_to(b, b.call("silu", y, loc=loc), lead + (H, D), loc)

    q = b.call("l2norm", conv_branch(P["q_proj"], P["q_conv1d"], K), eps=1e-6, loc=loc)
    k = b.call("l2norm", conv_branch(P["k_proj"], P["k_conv1d"], K), eps=1e-6, loc=loc)
    v = conv_branch(P["v_proj"], P["v_conv1d"], V)
    f = _reshape_to(b, _lin(b, _lin(b, x, P["f_a_proj"], loc), P["f_b_proj"], loc), lead + (H, K), loc)
    g = b.call("kda_gate", f, P["A_log"], P["dt_bias"], lower_bound=a["lower_bound"], gate=a["gate"], loc=loc)
    beta = b.call("sigmoid", _lin(b, x, P["b_proj"], loc), loc=loc)
    bound = float(a["lower_bound"]) if a["gate"] == "sigmoid" else None   # g = lb * sigmoid(.) > lb
    o = b.call("kda_chunk", q, k, v, g, beta, scale=float(K) ** -0.5, lower_bound=bound, loc=loc)
    o = b.call("rmsnorm", o, P["o_norm"], eps=a["norm_eps"], loc=loc)
    if "g_proj" in P:
        gl = _lin(b, x, P["g_proj"], loc)
    else:
        gl = _lin(b, _lin(b, x, P["g_a_proj"], loc), P["g_b_proj"], loc)
    gate = _reshape_to(b, b.call("sigmoid", gl, loc=loc), lead + (H, V), loc)
    o = _reshape_to(b, b.call("mul", o, gate, loc=loc), lead + (H * V,), loc)
    return [_lin(b, o, P["o_proj"], loc)]


register("kda_layer", _x_only("kda_layer", sequence=True), params=_kda_params, expand=_kda_expand, is_layer=True,
         default_name="self_attn", inputs=("x",),
         attrs={"heads": REQUIRED, "head_dim": REQUIRED, "v_head_dim": 0, "conv_size": 4, "lower_bound": -5.0,
                "gate": "sigmoid", "forget_rank": 0, "gate_rank": 0, "norm_eps": 1e-6},
         doc="KDA token mixer: projections -> short conv + SiLU -> L2 norm (q, k) -> kda_gate -> kda_chunk "
             "-> per-head RMSNorm * sigmoid output gate -> o_proj (Kimi Linear, arXiv 2510.26692). "
             "v_head_dim 0 = head_dim; forget_rank 0 = head_dim; gate_rank 0 = full-rank output gate; "
             "gate=\"sigmoid\" | \"softplus\": the decay gate (see `mtc ops kda_gate`)")


# -- gated MLA layer
def _mla_params(a, ts):
    d = ts[0].shape[-1]
    H, ql, kl = a["heads"], a["q_lora_rank"], a["kv_lora_rank"]
    dn, dr, dv = a["qk_nope_dim"], a["qk_rope_dim"], a["v_dim"]
    if dn < 0 or dr < 0 or dn + dr == 0:
        raise ShapeError(f"qk_nope_dim and qk_rope_dim must be >= 0 with a positive sum (the query/key head dim), "
                         f"got qk_nope_dim={dn}, qk_rope_dim={dr}")
    p = []
    if ql:
        p += [ParamSpec("q_a_proj.weight", (ql, d)), ParamSpec("q_a_layernorm.weight", (ql,), "ones"),
              ParamSpec("q_b_proj.weight", (H * (dn + dr), ql))]
    else:
        p += [ParamSpec("q_proj.weight", (H * (dn + dr), d))]
    p += [ParamSpec("kv_a_proj_with_mqa.weight", (kl + dr, d)), ParamSpec("kv_a_layernorm.weight", (kl,), "ones"),
          ParamSpec("kv_b_proj.weight", (H * (dn + dv), kl))]
    if a["gated"]:
        p += [ParamSpec("g_proj.weight", (H * dv, d))]
    p += [ParamSpec("o_proj.weight", (d, H * dv))]
    return p


def _mla_expand(b: GraphBuilder, inputs, a, loc):
    x = inputs[0]
    xt = b.type(x)
    specs = _mla_params(a, [xt])
    P = _slots(x, inputs[1:], specs)
    H, ql, kl = a["heads"], a["q_lora_rank"], a["kv_lora_rank"]
    dn, dr, dv = a["qk_nope_dim"], a["qk_rope_dim"], a["v_dim"]
    lead = _lead(xt)
    if ql:
        cq = b.call("rmsnorm", _lin(b, x, P["q_a_proj"], loc), P["q_a_layernorm"], eps=a["norm_eps"], loc=loc)
        q = _lin(b, cq, P["q_b_proj"], loc)
    else:
        q = _lin(b, x, P["q_proj"], loc)
    q = _reshape_to(b, q, lead + (H, dn + dr), loc)
    kv = _lin(b, x, P["kv_a_proj_with_mqa"], loc)
    # qk_rope_dim 0: no shared key part (k = the per-head part); qk_nope_dim 0: only the shared part
    c = b.call("slice", kv, dim=-1, start=0, end=kl, loc=loc) if dr else kv
    kr = b.call("slice", kv, dim=-1, start=kl, end=kl + dr, loc=loc) if dr else None
    c = b.call("rmsnorm", c, P["kv_a_layernorm"], eps=a["norm_eps"], loc=loc)
    kvb = _reshape_to(b, _lin(b, c, P["kv_b_proj"], loc), lead + (H, dn + dv), loc)
    kn = b.call("slice", kvb, dim=-1, start=0, end=dn, loc=loc) if dn else None
    v = b.call("slice", kvb, dim=-1, start=dn, end=dn + dv, loc=loc) if dn else kvb
    if dr:
        kr = b.call("broadcast", _reshape_to(b, kr, lead + (1, dr), loc), shape=_dims_attr(lead + (H, dr)),
                    loc=loc)
    k = b.call("concat", kn, kr, dim=-1, loc=loc) if dn and dr else (kn if dn else kr)
    o = b.call("mla_attention", q, k, v, scale=1.0 / math.sqrt(dn + dr), causal=True, loc=loc)
    if a["gated"]:
        gate = _reshape_to(b, b.call("sigmoid", _lin(b, x, P["g_proj"], loc), loc=loc), lead + (H, dv), loc)
        o = b.call("mul", o, gate, loc=loc)
    o = _reshape_to(b, o, lead + (H * dv,), loc)
    return [_lin(b, o, P["o_proj"], loc)]


register("mla_layer", _x_only("mla_layer", sequence=True), params=_mla_params, expand=_mla_expand, is_layer=True,
         default_name="self_attn", inputs=("x",),
         attrs={"heads": REQUIRED, "q_lora_rank": 0, "kv_lora_rank": REQUIRED, "qk_nope_dim": 128,
                "qk_rope_dim": 64, "v_dim": 128, "gated": True, "norm_eps": 1e-6},
         doc="gated multi-head latent attention (DeepSeek-V2 MLA, NoPE) with output gate sigmoid(W_g x) * o")


# -- GLU FFN (dense layer and shared experts)
def _glu_params(a, ts, prefix=""):
    d = ts[0].shape[-1]
    inter = a["inter"]
    return [ParamSpec(f"{prefix}gate_proj.weight", (inter, d)), ParamSpec(f"{prefix}up_proj.weight", (inter, d)),
            ParamSpec(f"{prefix}down_proj.weight", (d, inter))]


def _glu_apply(b, x, wg, wu, wd, a, loc):
    ga, up = _lin(b, x, wg, loc), _lin(b, x, wu, loc)
    if a["act"] == "situ":
        h = b.call("situ_glu", ga, up, beta_gate=a["beta_gate"], beta_up=a["beta_up"], loc=loc)
    else:
        h = b.call("mul", b.call("silu", ga, loc=loc), up, loc=loc)
    return _lin(b, h, wd, loc)


def _glu_expand(b, inputs, a, loc):
    return [_glu_apply(b, inputs[0], *inputs[1:4], a, loc)]


_ACT = {"act": "situ", "beta_gate": 4.0, "beta_up": 25.0}

register("glu_ffn", _x_only("glu_ffn"), params=_glu_params, expand=_glu_expand, is_layer=True,
         default_name="mlp", inputs=("x",), attrs={"inter": REQUIRED, **_ACT},
         doc="gated FFN: down(act(gate x) * up x); act=\"situ\" (SiTU-GLU, K3) or act=\"silu\" (SwiGLU)")


# -- MoE layers
def _moe_params(a, ts, latent: bool):
    d = ts[0].shape[-1]
    E, I, k = a["experts"], a["inter"], a["top_k"]
    w = a["latent"] if latent else d
    if E < 1:
        raise ShapeError(f"experts = {E} must be >= 1")
    if not 1 <= k <= E:
        raise ShapeError(f"top_k = {k} must be in [1, experts = {E}]")
    _positive(a, "routed_scaling", *(("beta_gate", "beta_up") if a["act"] == "situ" else ()))
    p = [ParamSpec("gate.weight", (E, d)),
         ParamSpec("gate.e_score_correction_bias", (E,), "zeros", kind="buffer", dtype="f32")]
    if latent:
        p += [ParamSpec("routed_expert_down_proj.weight", (w, d))]
    p += [ParamSpec("experts.w1", (E, I, w), "expert", active=k / E, dtype=a["expert_dtype"] or None),
          ParamSpec("experts.w3", (E, I, w), "expert", active=k / E, dtype=a["expert_dtype"] or None),
          ParamSpec("experts.w2", (E, w, I), "expert", active=k / E, dtype=a["expert_dtype"] or None)]
    if latent:
        p += [ParamSpec("routed_expert_norm.weight", (w,), "ones"), ParamSpec("routed_expert_up_proj.weight", (d, w))]
    if a["shared"]:
        p += _glu_params({"inter": a["shared"] * a["shared_inter"] if a["shared_inter"] else a["shared"] * I},
                         ts, "shared_experts.")
    return p


def _moe_expand_common(b: GraphBuilder, inputs, a, loc, latent: bool):
    x = inputs[0]
    xt = b.type(x)
    specs = _moe_params(a, [xt], latent)
    P = {s.suffix: r for s, r in zip(specs, inputs[1:])}
    d = xt.shape[-1]
    N = sympy.Mul(*xt.shape[:-1])
    xf = _reshape_to(b, x, (N, d), loc)
    idx, w, _scores = b.call("qb_route", xf, P["gate.weight"], P["gate.e_score_correction_bias"],
                             top_k=a["top_k"], routed_scaling=a["routed_scaling"], loc=loc)
    xl = _lin(b, xf, P["routed_expert_down_proj.weight"], loc) if latent else xf
    u = b.call("moe_experts", xl, idx, w, P["experts.w1"], P["experts.w3"], P["experts.w2"],
               activation=a["act"], beta_gate=a["beta_gate"], beta_up=a["beta_up"], loc=loc)
    if latent:
        u = b.call("rmsnorm", u, P["routed_expert_norm.weight"], eps=a["norm_eps"], loc=loc)
        u = _lin(b, u, P["routed_expert_up_proj.weight"], loc)
    if a["shared"]:
        ys = _glu_apply(b, xf, P["shared_experts.gate_proj.weight"], P["shared_experts.up_proj.weight"],
                        P["shared_experts.down_proj.weight"], a, loc)
        u = b.call("add", ys, u, loc=loc)
    return [_reshape_to(b, u, xt.shape, loc)]


_MOE_ATTRS = {"experts": REQUIRED, "top_k": REQUIRED, "inter": REQUIRED, "shared": 0, "shared_inter": 0,
              "routed_scaling": 1.0, "expert_dtype": "", "norm_eps": 1e-6, **_ACT}

register("latent_moe", _x_only("latent_moe"), params=lambda a, ts: _moe_params(a, ts, True),
         expand=lambda b, i, a, loc: _moe_expand_common(b, i, a, loc, True), is_layer=True,
         default_name="block_sparse_moe", inputs=("x",), attrs={**_MOE_ATTRS, "latent": REQUIRED},
         doc="Stable LatentMoE: y = shared(x) + W_up RMSNorm(sum_k p_k E_k(W_down x)), QB-routed")
register("moe", _x_only("moe"), params=lambda a, ts: _moe_params(a, ts, False),
         expand=lambda b, i, a, loc: _moe_expand_common(b, i, a, loc, False), is_layer=True,
         default_name="block_sparse_moe", inputs=("x",), attrs=_MOE_ATTRS,
         doc="sparse MoE at full width: y = shared(x) + sum_k p_k E_k(x), QB-routed")


def flops_of(node_op: str, in_types, out_types, attrs) -> sympy.Expr:
    od = OPS.get(node_op)
    if od is None or od.flops is None:
        return sympy.Integer(0)
    return as_expr(od.flops(in_types, out_types, attrs))


# ---------------------------------------------------------------------------------------------
# two-phase Block AttnRes (produced by the batch_attn_residual pass)
def _phase1(ts, a):
    Q = a["n_queries"]
    qs, ws, bank = ts[:Q], ts[Q:2 * Q], ts[2 * Q:]
    if len(qs) != Q or len(ws) != Q or not bank:
        raise ShapeError(f"needs {Q} queries, {Q} rms weights and >= 1 bank source, got {len(ts)} inputs")
    for x in qs + ws:
        _attn_residual([x, x, bank[0]], a)
    for i, s in enumerate(bank):
        if not s.same(bank[0]):
            raise ShapeError(f"bank source {i} is {s}, source 0 is {bank[0]}")
    sh = bank[0].shape
    return [TensorType("f32", (Q,) + sh), TensorType("f32", (Q,) + sh[:-1]), TensorType("f32", (Q,) + sh[:-1])]


register("attn_residual_phase1", _phase1, n_data_inputs=3, variadic=True,
         inputs=("*queries", "*rms_weights", "*bank"), attrs={"n_queries": REQUIRED, "eps": 1e-6},
         flops=lambda ts, os, a: 5 * numel(ts[-1]) * (len(ts) - 2 * a["n_queries"]) * a["n_queries"],
         doc="every pseudo-query of a block against the completed bank in one read: (acc, max, sum) per query")


def _merge(ts, a):
    acc, m, s, q, w, *partial = ts
    i = a["index"]
    if not 0 <= i < int(acc.shape[0]):
        raise ShapeError(f"index {i} out of range for {int(acc.shape[0])} queries")
    out = TensorType(a["dtype"], acc.shape[1:])
    if partial and not (partial[0].rank == out.rank and all(_eq(x, y) for x, y in zip(partial[0].shape, out.shape))):
        raise ShapeError(f"partial {partial[0]} does not match the bank's {out}")
    return [out]


register("attn_residual_merge", _merge, n_data_inputs=5, variadic=True,
         inputs=("acc", "m", "s", "query", "rms_weight", "*partial"),
         attrs={"index": REQUIRED, "eps": 1e-6, "dtype": REQUIRED},
         flops=lambda ts, os, a: 8 * numel(os[0]),
         doc="online-softmax merge of one query's bank result (phase 1, row index) with the in-block partial")

#: the layer blocks a stack's 'attn' slot and 'ffn' slot take
LAYER_OPS_ATTN = frozenset({"kda_layer", "mla_layer"})
LAYER_OPS_FFN = frozenset({"glu_ffn", "latent_moe", "moe"})


# ---------------------------------------------------------------------------------------------
# the source nodes' attributes (input, param, buffer): checked by parse_ir and verify like an op's
_NAME = Kind("a string", lambda v: isinstance(v, str), "a non-empty dotted name (model.layers.0.mlp.up_proj.weight)",
             lambda v: bool(v) and all(v.split(".")))
SOURCE_KINDS = {
    "input": {"name": STRING},
    "param": {"name": _NAME, "init": one_of(*INITS),
              "std": Kind("a number", _is_num, "a finite number >= 0", lambda v: 0 <= v < math.inf),
              "active": Kind("a number", _is_num, "a fraction in (0, 1]", lambda v: 0 < v <= 1),
              "pinned": BOOL},
}
SOURCE_KINDS["buffer"] = SOURCE_KINDS["param"]
SOURCE_REQUIRED = {"input": ("name",), "param": ("name", "init"), "buffer": ("name", "init")}


def check_source(op: str, attrs: dict, types: tuple, ignore=()) -> None:
    """Check an input / param / buffer node: its attributes (known, of the right kind, the required ones set), one
    type, and for parameters and buffers a shape of integers >= 1 within the size limits
    (builder.check_param_shape). ``ignore``: annotation keys a pass may add. Raises ShapeError."""
    kinds = SOURCE_KINDS[op]
    for k, v in attrs.items():
        if k in ignore:
            continue
        if k not in kinds:
            from .errors import did_you_mean
            raise ShapeError(f"{op} has no attribute '{k}'{did_you_mean(k, kinds)}; it takes: {', '.join(kinds)}")
        bad = attr_error(k, kinds[k], v)
        if bad:
            raise ShapeError(bad)
    for k in SOURCE_REQUIRED[op]:
        if k not in attrs:
            what = "its input name" if op == "input" else ("its state-dict name" if k == "name" else "its initialiser")
            raise ShapeError(f"{op} needs the attribute '{k}' ({what})")
    if len(types) != 1 or types[0] is None:
        raise ShapeError(f"{op} needs one type (e.g. ': f32[B, T, 64]')")
    if op != "input":
        check_param_shape(types[0].shape)
    else:
        for d in types[0].shape:
            if d.is_number and not (d.is_integer and int(d) >= 1):
                raise ShapeError(f"input shape {types[0]} has a dimension {d}; dimensions are integers >= 1 "
                                 f"or shape expressions")
