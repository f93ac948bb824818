"""The registry's core: attribute kinds, the compiler roles, :class:`SpecForm`, :class:`Fusion`,
:class:`Rewrite`, :class:`OpDef`, :data:`OPS`, :func:`register` and the helpers the families' shape rules share."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import sympy

from ..builder import REQUIRED, ShapeError
from ..ir import DTYPES, Dim, TensorType, as_expr, dim, dims_equal

FLOAT = ("f32", "f16", "bf16", "f64")
#: the routed experts' storage dtypes ("" = the model dtype)
EXPERT_DTYPES = ("", "f32", "bf16", "f16", "mxfp4", "fp8")


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
    from ..errors import did_you_mean
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


# ---------------------------------------------------------------------------------------------
# what the compiler does with an op: its role (one per op) and, for an op that anchors a fused kernel, its fusion rule
ROLES: dict[str, str] = {
    "view": "shares its input's storage and launches nothing (lower: view.*; the memory plan counts no bytes)",
    "pointwise": "an elementwise expression: the Triton kernel generator (backends/triton/codegen.py) fuses chains "
                 "of them",
    "row_norm": "a normalisation over the last dim: generated like a pointwise op, with a row reduction",
    "memory_bound": "a memory-bound op with a kernel of its own (not an expression the generator writes); lower "
                    "still groups it with the elementwise chains around it",
    "gemm": "a matrix product with a weight: runs on the vendor GEMM library",
    "anchor": "a heavy op with a kernel template: it anchors a fusion group (its Fusion rule)",
    "layer": "a layer block that owns parameters and is expanded into primitive ops by canonicalize",
}


@dataclass(frozen=True)
class SpecForm:
    """How a ``.mtc`` spec writes an op (``mtc ops`` prints it). ``form`` is None for an op a spec cannot write
    (made by a pass, or with several outputs); ``example`` is then None too, else a whole spec that builds
    (tests/test_cli.py builds every one, at every stage and on the reference and Triton targets)."""

    form: str | None
    notes: str = ""
    example: str | None = None


@dataclass(frozen=True)
class Fusion:
    """The fused kernel an op anchors (passes/fuse_tiles.py): the ops its ``prologue`` may absorb (walking up its
    inputs), its ``epilogue`` (walking down its single-use output), the ops that may feed an epilogue op from the
    ``side`` (the sigmoid of an output gate); each an op name or ``"role:<role>"`` (every op of that role).
    ``tiles(node, nodes)``: the tile sizes the compiler picks; ``when(node, nodes)``: whether the rule applies."""

    name: str
    prologue: tuple = ()
    epilogue: tuple = ()
    side: tuple = ()
    tiles: Callable = lambda n, nodes: {}
    when: Callable = lambda n, nodes: True
    doc: str = ""


@dataclass(frozen=True)
class Rewrite:
    """A canonicalize rewrite of the op: where ``match(node, nodes)`` holds, ``rewrite(node, nodes)`` gives the Ref
    that replaces the node's output, or (op, new first input) for the same node on another input."""

    name: str
    match: Callable
    rewrite: Callable


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
    role: str | None = None                     # what the compiler does with it: one of ROLES
    spec: SpecForm | None = None                # how a spec writes it (mtc ops)
    fusion: Fusion | None = None                # the fused kernel it anchors (fuse_tiles)
    rewrites: tuple = ()                        # its canonicalize rewrites (Rewrite)
    slot: str | None = None                     # a layer block: the stack slot it fills ("attn" or "ffn")

    def __post_init__(self):
        if self.role is None and self.is_layer:
            self.role = "layer"
        self.is_layer = self.is_layer or self.role == "layer"
        if self.role is not None and self.role not in ROLES:
            raise TypeError(f"op '{self.name}': role {self.role!r} is not one of {', '.join(ROLES)}")
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


def register(name: str, infer, *, role: str, spec, **kw) -> OpDef:
    """Declare op ``name`` (see dsl/ops/__init__.py, "Adding an op"): its shape rule ``infer(types, attrs)``, its
    compiler ``role`` (one of ROLES), its ``spec`` form (a SpecForm, or a function of the OpDef returning one) and
    the OpDef fields in ``kw``. TypeError for a name already registered, an unknown role, or an anchor without its
    fusion rule."""
    if name in OPS:
        raise TypeError(f"op '{name}' is already registered (dsl.ops.unregister removes it)")
    od = OpDef(name, infer, role=role, **kw)
    od.spec = spec(od) if callable(spec) else spec
    if not isinstance(od.spec, SpecForm):
        raise TypeError(f"op '{name}': spec must be a SpecForm, got {od.spec!r}")
    if (role == "anchor") != (od.fusion is not None) and role != "pointwise":
        raise TypeError(f"op '{name}': an anchor op declares its fusion rule (fusion=Fusion(...)), and only an "
                        f"anchor or a pointwise op has one")
    if (role == "layer") != (od.slot is not None) or od.slot not in (None, "attn", "ffn"):
        raise TypeError(f"op '{name}': a layer op declares its stack slot (slot='attn' or 'ffn'), no other op does")
    OPS[name] = od
    return od


def unregister(name: str) -> None:
    """Remove op ``name`` from the registry (a test's or a plugin's op). KeyError if it is not registered."""
    del OPS[name]


def ops_with_role(*roles: str) -> frozenset:
    """The names of the registered ops whose role is one of ``roles`` (ValueError for an unknown role)."""
    for r in roles:
        if r not in ROLES:
            raise ValueError(f"unknown role {r!r}; roles: {', '.join(ROLES)}")
    return frozenset(n for n, od in OPS.items() if od.role in roles)


def op_set(names) -> frozenset:
    """Op names with each ``"role:<role>"`` entry replaced by the ops of that role (a Fusion's prologue ...)."""
    out = set()
    for n in names:
        out |= ops_with_role(n[5:]) if n.startswith("role:") else {n}
    return frozenset(out)


def ops_in_slot(slot: str) -> frozenset:
    """The layer blocks a stack's ``slot`` ("attn" or "ffn") takes."""
    return frozenset(n for n, od in OPS.items() if od.slot == slot)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def spec_example(inputs: str, *body: str, blocks: str = "") -> str:
    """A minimal model around forward(inputs) { body } (the example of a SpecForm)."""
    lines = ["model example {"]
    if blocks:
        lines += [f"  {b}" for b in blocks.splitlines()]
    lines.append(f"  forward({inputs}) {{")
    lines += [f"    {b}" for b in body]
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


#: the usual example input, and the note of ops whose weights are tensor inputs
X = "x: f32[B, T, 64]"
WEIGHT_IN = ("its weights are tensor inputs (declare them as forward(...) parameters); it creates no "
             "parameters of its own")


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


def _dims(shape) -> str:
    return "[" + ", ".join(str(d).replace(" ", "") for d in shape) + "]"



def flops_of(node_op: str, in_types, out_types, attrs) -> sympy.Expr:
    od = OPS.get(node_op)
    if od is None or od.flops is None:
        return sympy.Integer(0)
    return as_expr(od.flops(in_types, out_types, attrs))

