"""From .mtc spec text to the graph IR: lark parse, typed config evaluation with variants and overrides,
and the graph builder walk (with layer stacks unrolled and Block AttnRes wired in).

Errors point at the spec: ``file:line:col`` with the offending line and a caret.
"""
from __future__ import annotations

import math
import numbers
import operator
import re
import warnings
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import lark
import sympy

from .builder import GraphBuilder, ShapeError
from .dim_expr import MAX_INT_DIGITS, DimError, check_size
from .errors import Loc, MtcError, MtcWarning, did_you_mean
from .ir import DEFAULT_DTYPE, Ref, canon_dtype, sym
from .ops import EXPERT_DTYPES, FLOAT

#: the largest dimension a forward input may have (an int32 index; larger is a typo)
MAX_DIM = 2**31 - 1
#: the most layers a stack may have (the graph is built layer by layer; K3 has 93)
MAX_LAYERS = 4096
#: config arithmetic stays below this in magnitude (int64): a larger result is an error at once (a power is
#: refused before it is computed, so 9**9**9 does not run for ever)
INT_LIMIT = 2**63
#: the longest string '+' may build (strings are names and dtypes; doubling a field field after field
#: would otherwise exhaust memory)
MAX_STRING = 1 << 16
#: the largest spec file read (bytes); a larger one, or one that is not a regular file (/dev/zero, a pipe), is
#: refused before it is read
MAX_SPEC_BYTES = 16 << 20

CONFIG_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "dtype": str}

#: the dtypes a model's parameters and activations may have (config field ``dtype``)
FLOAT_DTYPES = ("f32", "bf16", "f16")
#: a state-dict name: dot-separated identifiers or layer indices
_NAME_RE = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*|\d+)(?:\.(?:[A-Za-z_][A-Za-z0-9_]*|\d+))*")


@lru_cache(maxsize=1)
def _pass_only_ops() -> frozenset:
    """Ops that only compiler passes create (``mtc ops``: "not written in a spec")."""
    from .ops import OPS
    return frozenset(k for k, od in OPS.items() if not od.spec.form)


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark((Path(__file__).parent / "spec.lark").read_text(), parser="lalr",
                     propagate_positions=True, maybe_placeholders=False)


@dataclass(frozen=True)
class Block:
    """A layer-level op with its attributes bound, not yet applied to a tensor."""

    op: str
    attrs: tuple
    loc: Loc | None


def describe(v) -> str:
    """A spec value as a message shows it: spec syntax (true, "text", [B, T, 4]), never a Python repr."""
    if isinstance(v, Ref):
        return "a tensor"
    if isinstance(v, Block):
        return f"a {v.op} block (a layer op called without a tensor is configured, not applied)"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(describe(x) for x in v) + "]"
    if isinstance(v, sympy.Basic):
        return str(v).replace(" ", "")
    return repr(v)


def _attr_value(v):
    """A keyword value as an op attribute: shape-symbol expressions become what a quoted dim would be."""
    if isinstance(v, sympy.Basic):
        return int(v) if v.is_number else str(v).replace(" ", "")
    if isinstance(v, list):
        return [_attr_value(x) for x in v]
    return v


def _has_symbol(v) -> bool:
    """A keyword value holding a shape-symbol expression (known only when the block is applied)."""
    if isinstance(v, list):
        return any(_has_symbol(x) for x in v)
    return isinstance(v, sympy.Basic) and not v.is_number


class SpecModel:
    """A parsed spec: the model name, the config schema, variants, blocks and forward body."""

    def __init__(self, tree: lark.Tree, file: str, text: str):
        self.file, self.text = file, text
        self._tree = tree
        model = tree.children[0]
        self.name = str(model.children[0])
        self.config: list[tuple[str, str, Any, Loc]] = []      # (name, type, expr tree, loc)
        self.variants: dict[str, list[tuple[str, Any, Loc]]] = {}
        self.variant_bases: dict[str, tuple[str, Loc]] = {}    # variant -> (the variant it extends, where)
        self.blocks: list[tuple[str, Any, Loc]] = []
        self.forward = None
        n_config = 0
        for item in model.children[1:]:
            if item.data == "config":
                n_config += 1
                if n_config > 1:
                    raise self.err("a model has one config { ... } section (put every field in it)", self.loc(item))
                for f in item.children:
                    name, typ, expr = str(f.children[0]), str(f.children[1]), f.children[2]
                    loc = self.loc(f)
                    if typ not in CONFIG_TYPES:
                        raise self.err(f"unknown config type '{typ}'{did_you_mean(typ, CONFIG_TYPES)}; "
                                       f"use one of {', '.join(CONFIG_TYPES)}", self.loc(f.children[1]))
                    if any(c[0] == name for c in self.config):
                        raise self.err(f"config field '{name}' is defined twice", loc)
                    self.config.append((name, typ, expr, loc))
            elif item.data == "variant":
                vname = str(item.children[0])
                if vname in self.variants:
                    raise self.err(f"variant '{vname}' is defined twice", self.loc(item))
                rest = item.children[1:]
                if rest and getattr(rest[0], "data", None) == "variant_base":
                    self.variant_bases[vname] = (str(rest[0].children[0]), self.loc(rest[0]))
                    rest = rest[1:]
                sets = [(str(a.children[0]), a.children[1], self.loc(a)) for a in rest]
                for j, (aname, _e, aloc) in enumerate(sets):
                    first = next((x for x in sets[:j] if x[0] == aname), None)
                    if first is not None:
                        raise self.err(f"variant '{vname}' sets '{aname}' twice (first at line {first[2].line})",
                                       aloc)
                self.variants[vname] = sets
            elif item.data == "block_def":
                bname = str(item.children[0])
                first = next((b for b in self.blocks if b[0] == bname), None)
                if first is not None:
                    raise self.err(f"block '{bname}' is defined twice (first at line {first[2].line}); "
                                   f"give the second one another name", self.loc(item))
                self.blocks.append((bname, item.children[1], self.loc(item)))
            elif item.data == "forward":
                if self.forward is not None:
                    raise self.err("a model has one forward", self.loc(item))
                self.forward = item
        for vname, (base, bloc) in self.variant_bases.items():
            if base not in self.variants:
                raise self.err(f"variant '{vname}' extends '{base}', which is not a variant of this model"
                               f"{did_you_mean(base, self.variants)}", bloc)
            seen, b = [vname], base
            while b is not None:
                if b in seen:
                    raise self.err(f"variant '{vname}' extends itself through {' : '.join(seen + [b])}", bloc)
                seen.append(b)
                b = self.variant_bases.get(b, (None, None))[0]
        fields = {c[0] for c in self.config}
        for bname, _e, bloc in self.blocks:
            if bname in fields:
                raise self.err(f"block '{bname}' has the name of a config field; give the block another name", bloc)
        if self.forward is None:
            raise MtcError(f"model '{self.name}' has no forward(...) {{ ... }} section", Loc(file, 1, 1), text)

    @cached_property
    def bound_names(self) -> set:
        """Every name the spec binds anywhere (config fields, variant settings, blocks, forward inputs and lets,
        stack results and sublayer slots, the stack's layer index i, shape symbols): what a name in an expression
        may be."""
        names = {"i"}
        for st in self._tree.iter_subtrees():
            if st.data in ("field", "assign", "block_def", "param", "let", "stack", "dim_sym") and st.children:
                names.add(str(st.children[0]))
        return names

    def loc(self, t) -> Loc:
        if isinstance(t, lark.Token):
            return Loc(self.file, t.line, t.column)
        m = t.meta
        return Loc(self.file, getattr(m, "line", 1), getattr(m, "column", 1))

    def err(self, msg: str, loc: Loc | None, hint: str | None = None) -> MtcError:
        return MtcError(msg, loc, self.text, hint)

    def eval_guarded(self, ev: "Evaluator", expr, loc: Loc, run=None):
        """``ev.eval(expr)`` (or ``run()``), with an expression nested past Python's recursion limit reported as
        an MtcError at ``loc`` (the statement or field), not a RecursionError."""
        try:
            return run() if run is not None else ev.eval(expr)
        except RecursionError:
            raise self.err("expression nested too deeply to evaluate (past Python's recursion limit)", loc,
                           "split it over several config fields or statements") from None

    # -- config -----------------------------------------------------------------------------------
    def resolve_config(self, variant: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
        exprs = {name: (expr, loc) for name, _t, expr, loc in self.config}
        if variant is not None:
            if variant not in self.variants:
                raise MtcError(f"model '{self.name}' has no variant '{variant}'{did_you_mean(variant, self.variants)}"
                               f"; variants: {', '.join(self.variants) or 'none'}")
            chain = [variant]                  # a variant's base's settings first, then its own
            while chain[-1] in self.variant_bases:
                chain.append(self.variant_bases[chain[-1]][0])
            for name, expr, loc in [s for v in reversed(chain) for s in self.variants[v]]:
                if name not in exprs:
                    raise self.err(f"variant '{variant}' sets '{name}', which is not a config field"
                                   f"{did_you_mean(name, exprs)}", loc)
                exprs[name] = (expr, loc)
        for k in overrides:
            if k not in exprs:
                raise MtcError(f"override '{k}' is not a config field of model '{self.name}'"
                               f"{did_you_mean(k, exprs)}")
        env: dict[str, Any] = {}
        for name, typ, _e, _l in self.config:
            if name in overrides:
                val, loc = overrides[name], None
                if isinstance(val, str) and typ != "str" and typ != "dtype":
                    val = _parse_literal(val, name)
            else:
                expr, loc = exprs[name]
                try:
                    val = self.eval_guarded(Evaluator(self, env), expr, loc)
                except MtcError as e:
                    if e.msg.startswith(f"unknown name '{name}'") and e.hint is None:
                        e.hint = (f"a config field cannot read its own value: a variant assigns '{name}' a new "
                                  f"value and cannot read the one it replaces; write the value "
                                  f"({name} = 128) or compute it from other fields")
                    raise
            env[name] = self._coerce(name, typ, val, loc)
        return env

    def _coerce(self, name, typ, val, loc):
        py = CONFIG_TYPES[typ]
        if not isinstance(val, (bool, int, float)):  # numpy / torch scalars from Python overrides
            if isinstance(val, numbers.Integral):
                val = int(val)
            elif isinstance(val, numbers.Real):
                val = float(val)
        if typ == "float" and isinstance(val, int) and not isinstance(val, bool):
            val = float(val)
        if typ == "int" and isinstance(val, float) and val.is_integer():
            val = int(val)
        if not isinstance(val, py) or (py is int and isinstance(val, bool)):
            hint = "booleans are written true / false" if typ == "bool" and val in ("True", "False") else None
            raise self.err(f"config field '{name}' is declared {typ} but its value is {describe(val)}", loc, hint)
        if typ == "float" and not math.isfinite(val):
            raise self.err(f"config field '{name}' must be a finite number, got {val}", loc)
        if name == "max_seq_len" and typ == "int" and val < 1:
            raise self.err(f"config field 'max_seq_len' (the context the model is declared for, in tokens) must be "
                           f">= 1, got {val}", loc)
        if name == "dtype" and typ in ("dtype", "str"):
            try:
                val = canon_dtype(val, loc)
            except MtcError:      # not a dtype at all: the field's own choices, not every dtype of the IR
                raise self.err(f"config field 'dtype' (the parameter and activation dtype) must be a floating "
                               f"type ({', '.join(FLOAT_DTYPES)}), got \"{val}\"", loc) from None
        elif typ == "dtype":
            val = canon_dtype(val, loc)
        if name == "dtype" and val not in FLOAT_DTYPES:
            if not isinstance(val, str):          # (a field declared int, float or bool named dtype)
                raise self.err(f"config field 'dtype' (the parameter and activation dtype) must be a floating "
                               f"type ({', '.join(FLOAT_DTYPES)}; write it `dtype: dtype = \"bf16\"`), got "
                               f"{describe(val)}", loc)
            hint = ("integer dtypes are for token ids: write them on the forward's inputs (ids: i64[B, T])"
                    if val[0] in "ib" else "quantised formats are for expert weights: moe(..., expert_dtype=...)"
                    if val in EXPERT_DTYPES else None)
            raise self.err(f"config field 'dtype' (the parameter and activation dtype) must be a floating "
                           f"type ({', '.join(FLOAT_DTYPES)}), got \"{val}\"", loc, hint)
        return val


def _parse_literal(text: str, name: str):
    t = text.strip()
    if t in ("true", "false"):
        return t == "true"
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


_BINOPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
           "//": operator.floordiv, "%": operator.mod}
_CMPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
         ">=": operator.ge}


class Evaluator:
    """Evaluates spec expressions. Values: numbers, strings, bools, Refs (tensors), Blocks."""

    def __init__(self, spec: SpecModel, env: dict, builder: "SpecBuilder | None" = None):
        self.spec, self.env, self.b = spec, env, builder
        self._lists = 0                      # > 0 while inside [...] (a shape, usually)

    def err(self, msg, t, hint=None):
        return self.spec.err(msg, self.spec.loc(t), hint)

    def eval(self, t):
        if isinstance(t, lark.Token):
            raise self.err(f"unexpected token {t!r}", t)
        fn = getattr(self, "e_" + t.data, None)
        if fn is None:
            raise self.err(f"unsupported expression '{t.data}'", t)
        return fn(t)

    def e_int(self, t):
        text = str(t.children[0])
        if len(text) > MAX_INT_DIGITS:          # (int() refuses more than 4300 digits, and nothing needs them)
            raise self.err(f"integer literal of {len(text)} digits is too large", t)
        return int(text)

    def e_float(self, t):
        v = float(t.children[0])
        if not math.isfinite(v):
            raise self.err(f"number {t.children[0]} is too large (it is not a finite float)", t)
        return v

    def e_string(self, t):
        return str(t.children[0])[1:-1]

    def e_true(self, t):
        return True

    def e_false(self, t):
        return False

    def e_list(self, t):
        self._lists += 1
        try:
            return [self.eval(c) for c in t.children]
        finally:
            self._lists -= 1

    def e_var(self, t):
        name = str(t.children[0])
        if name not in self.env:
            syms = self.b.dim_syms if self.b is not None else {}
            if name in syms:                   # a shape symbol of the forward's inputs (B, T): a dim
                return syms[name]
            hint = None
            if name in ("True", "False", "TRUE", "FALSE"):
                hint = f"booleans are written {name.lower()} (lower case): use true / false"
            elif self._lists and syms:
                hint = (f"the shape symbols are {', '.join(syms)} (from the forward's inputs); "
                        f"a shape lists those, integers and config values")
            raise self._unknown_name(name, t, syms, "", hint)
        if self.b is not None:
            self.b.used.add(name)
            self.b._read_since.add(name)
        return self.env[name]

    def _num(self, v, t, what, symbols=False):
        if symbols and isinstance(v, sympy.Expr):
            return v
        if isinstance(v, sympy.Expr):
            raise self.err(f"{what} needs numbers, got the shape expression {describe(v)} "
                           f"(shape symbols take +, - and *)", t)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.err(f"{what} needs numbers, got {describe(v)}", t)
        return v

    def e_binop(self, t):
        a, op, b = t.children
        x, y = self.eval(a), self.eval(b)
        if str(op) == "+" and isinstance(x, str) and isinstance(y, str):
            if len(x) + len(y) > MAX_STRING:
                raise self.err(f"'+' would make a string of {len(x) + len(y)} characters, more than the limit "
                               f"of {MAX_STRING}", t)
            return x + y
        symbolic = str(op) in ("+", "-", "*") and not isinstance(x, float) and not isinstance(y, float)
        x, y = self._num(x, a, f"'{op}'", symbolic), self._num(y, b, f"'{op}'", symbolic)
        if str(op) in ("/", "//", "%") and y == 0:
            raise self.err("division by zero", t)
        return self._arith(t, f"'{op}'", _BINOPS[str(op)], x, y)

    def e_pow(self, t):
        x = self._num(self.eval(t.children[0]), t.children[0], "'**'")
        y = self._num(self.eval(t.children[1]), t.children[1], "'**'")
        if x == 0 and y < 0:
            raise self.err("division by zero (0 to a negative power)", t)
        if isinstance(x, int) and isinstance(y, int) and y > 0 and (abs(x).bit_length() - 1) * y >= 63:
            # refused before it is computed (9**9**9 would not finish): |x| >= 2**(bits - 1)
            raise self.err(f"{f'({x})' if x < 0 else x}**{y} passes 2**63: config integers are int64", t)
        return self._arith(t, "'**'", operator.pow, x, y)

    def e_neg(self, t):
        return self._arith(t, "'-'", operator.neg, self._num(self.eval(t.children[0]), t, "'-'"))

    def _arith(self, t, what: str, fn, *args):
        """fn(*args) for the arithmetic at t, an MtcError there when it fails or leaves what a config holds:
        an integer past 2**63 (and a shape expression's integers), a float past the float range, a complex number."""
        try:
            v = fn(*args)
        except OverflowError:
            raise self.err(f"{what}: the result is too large for a float", t) from None
        except ZeroDivisionError:
            raise self.err("division by zero", t) from None
        if isinstance(v, complex):
            raise self.err(f"{what}: the result is not a real number ({describe(args[0])} to a fractional power)", t)
        if isinstance(v, int) and abs(v) >= INT_LIMIT:
            raise self.err(f"{what}: the result passes 2**63 (config integers are int64)", t)
        if isinstance(v, sympy.Basic):
            try:
                check_size(v)
            except DimError:
                raise self.err(f"{what}: the shape expression {describe(v)[:60]} has an integer past 2**63", t) \
                    from None
        return v

    def e_compare(self, t):
        a, op, b = t.children
        x, y = self.eval(a), self.eval(b)
        for v, c in ((x, a), (y, b)):
            if isinstance(v, sympy.Expr):
                raise self.err(f"'{op}' cannot compare the shape expression {describe(v)}: its value is only "
                               f"known when the model runs", c)
        if str(op) not in ("==", "!="):
            def num(v):
                return isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ((num(x) and num(y)) or (isinstance(x, str) and isinstance(y, str))):
                raise self.err(f"'{op}' compares two numbers or two strings, got {describe(x)} {op} {describe(y)}",
                               a if not (num(x) or isinstance(x, str)) else b)
        return _CMPS[str(op)](x, y)

    def e_and_(self, t):
        return bool(self.eval(t.children[0])) and bool(self.eval(t.children[1]))

    def e_or_(self, t):
        return bool(self.eval(t.children[0])) or bool(self.eval(t.children[1]))

    def e_not_(self, t):
        return not self.eval(t.children[0])

    def _unknown_name(self, name, t, syms, where, hint=None):
        """The MtcError for a name bound neither in the environment nor as a shape symbol (where: after the name)."""
        return self.err(f"unknown name '{name}'{where}{did_you_mean(name, list(self.env) + list(syms))}", t, hint)

    def e_cond(self, t):
        a, c, b = t.children
        cond = self.eval(c)
        if not isinstance(cond, bool):
            raise self.err(f"the condition of 'if' must be true or false, got {describe(cond)}", c)
        self._check_untaken(b if cond else a)
        return self.eval(a) if cond else self.eval(b)

    def _check_untaken(self, t):
        """A name in the branch not taken that the spec binds nowhere is a typo: an error now, not only once a
        config change takes that branch."""
        if not isinstance(t, lark.Tree):
            return
        syms = self.b.dim_syms if self.b is not None else {}
        for st in t.iter_subtrees_topdown():
            if st.data == "var":
                name = str(st.children[0])
                if name not in self.env and name not in syms and name not in self.spec.bound_names:
                    raise self._unknown_name(name, st, syms, " (in the branch of 'if' not taken here)")

    def split_args(self, arglist, what: str, usage: str, dup_prefix: str = ""):
        """The arguments of a call's arglist tree, unevaluated: (positional trees, [(key, value tree, kwarg tree)]).
        MtcError at the argument for a positional one after keywords ("{what}: ...; {usage}") and for a keyword
        given twice ("{dup_prefix}keyword 'k' given twice")."""
        pos, kws = [], []
        for a in arglist.children:
            if isinstance(a, lark.Tree) and a.data == "kwarg":
                k = str(a.children[0])
                if any(k == k2 for k2, _v, _a in kws):
                    raise self.err(f"{dup_prefix}keyword '{k}' given twice", a)
                kws.append((k, a.children[1], a))
            else:
                if kws:
                    raise self.err(f"{what}: a positional argument after keywords; {usage}", a)
                pos.append(a)
        return pos, kws

    def e_call(self, t):
        fname = str(t.children[0])
        args, kwargs, arg_locs = [], {}, []
        if len(t.children) > 1:
            pos, kws = self.split_args(t.children[1], f"'{fname}'",
                                       f"tensors go first, then keywords ({fname}(x, ..., key=value))")
            for a in pos:
                args.append(self.eval(a))
                arg_locs.append(self.spec.loc(a))
            for k, vt, _a in kws:
                v = self.eval(vt)
                if isinstance(v, (Ref, Block)):
                    raise self.err(f"keyword '{k}' of '{fname}' is {describe(v)}; keywords are attributes "
                                   f"(numbers, strings, lists): tensors go first, without a key", vt)
                kwargs[k] = _attr_value(v)
        loc = self.spec.loc(t)
        if fname in ("min", "max") and not isinstance(self.env.get(fname), Block):
            if kwargs or len(args) < 2:
                got = "keywords" if kwargs else f"{len(args)} argument{'s' if len(args) != 1 else ''}"
                raise self.err(f"{fname}(a, b, ...) takes two or more numbers, got {got}", t)
            for a, aloc in zip(args, arg_locs):
                if isinstance(a, bool) or not isinstance(a, (int, float)):
                    raise self.spec.err(f"{fname}(a, b, ...) takes numbers, got {describe(a)}", aloc,
                                        "a shape symbol's value is known only when the model runs" if
                                        isinstance(a, sympy.Expr) else None)
            return (min if fname == "min" else max)(*args)
        if self.b is None:
            raise self.err(f"'{fname}(...)' cannot be used in the config (only arithmetic, min and max)", t)
        return self.b.apply(fname, args, kwargs, loc, arg_locs)


class SpecBuilder:
    """Walks the forward body, emitting graph nodes through a GraphBuilder."""

    def __init__(self, spec: SpecModel, config: dict, name: str):
        self.spec = spec
        self.config = config
        dtype = config.get("dtype", DEFAULT_DTYPE)
        self.b = GraphBuilder(name, dtype=dtype, source=spec.text)
        self.b.meta["config"] = tuple(sorted(config.items()))
        self.env: dict[str, Any] = dict(config)
        self.blocks: dict[str, Block] = {}
        self.used: set[str] = set()            # names read by the forward (for the unused-name warnings)
        self.dim_syms: dict[str, sympy.Symbol] = {}   # the forward inputs' shape symbols (bare B, T in shapes)
        self._assigned: dict[str, Loc] = {}     # forward name -> where it was last assigned
        self._read_since: set[str] = set()      # names read since their last assignment
        self._values: list[tuple[str, Any, Loc]] = []   # (name, value, loc) of every forward assignment
        self._dead_said: set[tuple] = set()     # (line, col) of values already reported unused (redefined)

    def apply(self, fname: str, args: list, kwargs: dict, loc: Loc, arg_locs: list | None = None):
        from .ops import OPS
        target = self.env.get(fname)          # a block shadows an op of its name (`block moe = latent_moe(...)`)
        if isinstance(target, Block):
            self.used.add(fname)
            if kwargs.keys() - {"name"}:
                raise self.spec.err(f"block '{fname}' is already configured; pass only name= when applying it", loc)
            self._check_attrs(fname, OPS[target.op], kwargs, loc)
            return self._apply_block(target, args, kwargs.get("name"), loc)
        if fname not in OPS:
            raise self.spec.err(f"unknown op '{fname}'{did_you_mean(fname, list(OPS) + list(self.blocks))}", loc)
        od = OPS[fname]
        if fname in _pass_only_ops():
            raise self.spec.err(f"'{fname}' is not written in a spec: only the compiler's passes create it "
                                f"(it has no spec form)", loc,
                                "`mtc ops` lists the ops a spec can call")
        self._check_attrs(fname, od, kwargs, loc)
        if od.is_layer and not args:
            for k in kwargs:
                if k not in od.attrs and k not in od.param_attrs:
                    raise self.spec.err(f"op '{fname}' has no attribute '{k}'"
                                        f"{did_you_mean(k, list(od.attrs))}; it takes: {', '.join(od.attrs)}", loc)
            # the attribute values too, where the block is defined (not first where it is used); values with
            # shape symbols are left to the call, where they resolve
            plain = {k: _attr_value(v) for k, v in kwargs.items() if k != "name" and not _has_symbol(v)}
            try:
                od.check_attrs(plain)
            except ShapeError as e:
                raise self.spec.err(f"{fname}: {e}", loc) from None
            return Block(fname, tuple(sorted(kwargs.items())), loc)
        if od.params is not None and len(args) != od.n_data_inputs:
            # in a spec an op creates its own parameters (the Python builder also takes them given)
            raise self.spec.err(f"{fname}: {od.arity_message(len(args))}", loc,
                                f"{fname} creates its parameters itself; name=\"...\" sets their state-dict prefix"
                                if len(args) > od.n_data_inputs else None)
        for i, a in enumerate(args):
            if not isinstance(a, Ref):
                if isinstance(a, Block):
                    hint = f"give the layer its input tensor: {a.op}(x, ...)"
                else:
                    hint = "attributes go as key=value"
                raise self.spec.err(f"argument {i + 1} of '{fname}' must be a tensor, got {describe(a)}",
                                    arg_locs[i] if arg_locs else loc, hint)
        return self.b.call(fname, *args, loc=loc, **kwargs)

    def _check_attrs(self, fname: str, od, kwargs: dict, loc: Loc) -> None:
        """Spec-level checks of a call's keywords, at the call: booleans are true/false, floats are finite,
        name= is a dotted state-dict path, dtypes are floating. Raises MtcError at ``loc``."""
        defaults = {**od.attrs, **od.param_attrs}
        for k, v in kwargs.items():
            if isinstance(defaults.get(k), bool) and not isinstance(v, bool):
                raise self.spec.err(f"{fname}: {k} must be true or false, got {describe(v)}", loc)
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, float) and not math.isfinite(x):
                    raise self.spec.err(f"{fname}: {k} must be a finite number, got {x}", loc)
            if k == "name" and v is not None:
                if not isinstance(v, str) or not _NAME_RE.fullmatch(v):
                    raise self.spec.err(f"{fname}: name must be a string of dot-separated identifiers "
                                        f"(model.layers.0.mlp), got {describe(v)}", loc,
                                        "each part is an ASCII letter or '_' then ASCII letters, digits or '_', or "
                                        "a layer index (digits); no empty parts, spaces or leading/trailing dots")
            if k == "expert_dtype" and v not in EXPERT_DTYPES:
                raise self.spec.err(f"{fname}: expert_dtype must be one of "
                                    f"{', '.join(describe(x) for x in EXPERT_DTYPES)}, got {describe(v)}", loc,
                                    "\"\" keeps the model dtype; integer dtypes cannot hold weights")
        # keywords given but without effect with the others as given: a MtcWarning at the call
        op, eff = od.name, {**defaults, **kwargs}
        unused = []
        if op == "kda_layer" and eff.get("gate") == "softplus" and "lower_bound" in kwargs:
            unused.append(("lower_bound", "the softplus gate is unbounded (lower_bound applies to gate=\"sigmoid\")"))
        if op in ("moe", "latent_moe") and eff.get("shared") == 0 and kwargs.get("shared_inter"):
            unused.append(("shared_inter", "shared=0: there is no shared expert"))
        for k, why in unused:
            warnings.warn(MtcWarning(f"{fname}: {k}= has no effect here: {why}", loc), stacklevel=4)

    def _apply_block(self, blk: Block, args, name, loc):
        if len(args) != 1 or not isinstance(args[0], Ref):
            raise self.spec.err(f"a layer block takes one tensor argument, got {len(args)}", loc)
        return self.b.call(blk.op, args[0], loc=loc, name=name, **dict(blk.attrs))

    def run(self):
        ev = Evaluator(self.spec, self.env, self)
        from .ops import OPS, ops_with_role
        layer_ops = ", ".join(sorted(ops_with_role("layer")))
        for bname, expr, loc in self.spec.blocks:
            if isinstance(expr, lark.Tree) and expr.data == "call" and str(expr.children[0]) in OPS \
                    and not OPS[str(expr.children[0])].is_layer:
                op = str(expr.children[0])
                raise self.spec.err(f"block '{bname}': {op} is not a layer op; a block is one of {layer_ops}",
                                    self.spec.loc(expr), f"apply {op} in the forward instead: y = {op}(x, ...)")
            v = self.spec.eval_guarded(ev, expr, loc)
            if not isinstance(v, Block):
                raise self.spec.err(f"block '{bname}' must be a layer op ({layer_ops}) configured without a "
                                    f"tensor, got {describe(v)}", loc)
            self.blocks[bname] = v
            self.env[bname] = v
        fwd = self.spec.forward
        outputs = None
        ret_loc = None
        inputs: dict[str, Loc] = {}
        for ch in fwd.children:
            if isinstance(ch, lark.Tree) and ch.data == "param":
                pname, dt = str(ch.children[0]), str(ch.children[1])
                ploc = self.spec.loc(ch)
                if pname in inputs:
                    raise self.spec.err(f"forward input '{pname}' is defined twice (first at line "
                                        f"{inputs[pname].line}); every input needs its own name", ploc)
                what = self._reserved(pname)
                if what:
                    raise self.spec.err(f"forward input '{pname}' has the name of a {what}; give the input "
                                        f"another name", ploc)
                inputs[pname] = ploc
                self.env[pname] = self.b.input(pname, canon_dtype(dt, ploc),
                                               [self._input_dim(pname, d, i, len(ch.children) - 2, dt)
                                                for i, d in enumerate(ch.children[2:])], ploc)
                continue
            if ret_loc is not None and ch.data in ("let", "stack"):
                raise self.spec.err(f"statement after the return (line {ret_loc.line}): it would never run; "
                                    f"the return comes last in forward", self.spec.loc(ch))
            if ch.data in ("let", "stack"):
                name = str(ch.children[0])
                what = self._reserved(name)
                if what:
                    # (it would hide the field or block from every later statement, silently)
                    raise self.spec.err(f"'{name}' has the name of a {what}; give the value another name",
                                        self.spec.loc(ch))
                val = self._eval_statement(ev, ch)
                self._assign(name, self.spec.loc(ch))
                self.env[name] = val
                self._values.append((name, val, self.spec.loc(ch)))
            elif ch.data == "ret":
                ret_loc = self.spec.loc(ch)
                if outputs is not None:
                    raise self.spec.err("forward has a second return; one return lists every output "
                                        "(return a, b)", self.spec.loc(ch))
                outputs = [self._eval_statement(ev, ch, e) for e in ch.children]
                for o in outputs:
                    if not isinstance(o, Ref):
                        raise self.spec.err(f"return needs tensors, got {describe(o)}", self.spec.loc(ch))
        if outputs is None:
            raise self.spec.err("forward has no return statement", self.spec.loc(fwd))
        g = self.b.build(outputs)
        self._warn_unused(fwd, g)
        return g

    def _reserved(self, name: str) -> str | None:
        """"config field" or "block" when a forward input or value would take that name (and hide it), else None."""
        return "config field" if name in self.config else "block" if name in self.blocks else None

    def _eval_statement(self, ev: "Evaluator", stmt, expr=None):
        """Evaluate a forward statement (``expr`` of it, or the whole let / stack), too-deep nesting an MtcError
        at the statement (SpecModel.eval_guarded)."""
        if expr is None and stmt.data == "stack":
            return self.spec.eval_guarded(ev, None, self.spec.loc(stmt), run=lambda: self._stack(stmt, ev))
        return self.spec.eval_guarded(ev, stmt.children[1] if expr is None else expr, self.spec.loc(stmt))

    def _assign(self, name: str, loc: Loc) -> None:
        """Record a forward assignment; warn when it replaces a value assigned before and never read."""
        first = self._assigned.get(name)
        if first is not None and name not in self._read_since:
            self._dead_said.add((first.line, first.col))
            warnings.warn(MtcWarning(f"'{name}' is redefined; the first value (line {first.line}) is never used",
                                     loc), stacklevel=3)
        self._assigned[name] = loc
        self._read_since.discard(name)

    def _input_dim(self, pname: str, d, pos: int = 2, rank: int = 0, dtype: str = "f32") -> int | sympy.Symbol:
        """One dim (at position pos of a rank-`rank` input of `dtype`) of a forward input's shape: an integer, a
        config int (replaced by its value, as in a reshape shape) or a shape symbol (B, T: bound when the model
        runs). Raises MtcError at the dim otherwise. A config int as the batch or sequence dim (dim 0; dim 1 of
        token ids [B, T] or of a [B, T, ...] input) is a MtcWarning there: it fixes that size, which a field named
        like a shape symbol (config { T: int = 64 }) does without the writer meaning to.  For float inputs only
        fields named like a shape symbol (an uppercase first letter) warn: a lowercase one (d, h) there sizes a
        weight passed as an input."""
        tok = d.children[0]
        text, loc = str(tok), self.spec.loc(tok)
        if text.isdigit():
            # (a literal longer than MAX_DIM's digits is out of range unread: int() refuses 4300 digits)
            digits = text.lstrip("0") or "0"
            if len(digits) > len(str(MAX_DIM)) or not 1 <= int(digits) <= MAX_DIM:
                shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"
                raise self.spec.err(f"input '{pname}': dimension {shown} must be between 1 and {MAX_DIM}", loc)
            return int(digits)
        if text in self.config:
            v = self.config[text]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v > MAX_DIM:
                raise self.spec.err(f"input '{pname}': dimension '{text}' names a config field whose value is "
                                    f"{describe(v)}; a dimension is an integer from 1 to {MAX_DIM} or a shape symbol", loc)
            self.used.add(text)
            ids = dtype.startswith(("i", "u"))
            # a float input's first dim named by a lowercase field (w: f32[d], A_log: f32[h], conv: f32[d, 1, 4])
            # is a weight's size, not a batch: only shape-symbol-like fields (B, T, N, ...) warn there
            if (pos == 0 or (pos == 1 and (rank >= 3 or ids))) and (ids or text[:1].isupper()):
                warnings.warn(MtcWarning(
                    f"input '{pname}': dimension {pos} is '{text}', the config field {text} = {v}, so the model takes "
                    f"exactly {v} there (a config value in a shape is a constant); to keep it a free "
                    f"{'batch size' if pos == 0 else 'length'}, give the config field another name (e.g. "
                    f"max_{text})", loc), stacklevel=4)
            return v
        if text in self.blocks:
            raise self.spec.err(f"input '{pname}': dimension '{text}' names a block; a dimension is an integer, "
                                f"a config int or a shape symbol (B, T)", loc)
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", text):
            raise self.spec.err(f"input '{pname}': '{text}' is not a usable shape symbol; a dimension is an "
                                f"integer, a config int or a symbol such as B or T", loc)
        return self.dim_syms.setdefault(text, sym(text))   # (a Symbol, not a text for the dim parser to read)

    def _warn_unused(self, fwd, g) -> None:
        """MtcWarning for blocks never applied, forward inputs the outputs do not depend on, and assigned values
        the outputs do not depend on (dropped from the graph with their parameters by canonicalize), whether
        or not their name is read again (x = f(ids); x = g(x); return ids drops both)."""
        from .ir import live_nodes
        live = live_nodes(g)
        # (a block the forward names but this config's conditions never pick, e.g. kda in an all-MLA variant,
        # is in use by the spec: no warning)
        named = {str(t) for t in fwd.scan_values(lambda v: isinstance(v, lark.Token) and v.type == "NAME")}
        for bname, _expr, loc in self.spec.blocks:
            if bname not in self.used and bname not in named:
                warnings.warn(MtcWarning(f"block '{bname}' is defined but never used", loc), stacklevel=2)
        for ch in fwd.children:
            if isinstance(ch, lark.Tree) and ch.data == "param":
                pname = str(ch.children[0])
                ref = self.env.get(pname)
                if isinstance(ref, Ref) and ref.node not in live:
                    warnings.warn(MtcWarning(f"forward input '{pname}' is never used (the model ignores it, but a "
                                             f"caller must still pass it)", self.spec.loc(ch)), stacklevel=2)
        for name, val, loc in self._values:
            if isinstance(val, Ref) and val.node not in live and (loc.line, loc.col) not in self._dead_said:
                warnings.warn(MtcWarning(f"'{name}' is computed but never used by the outputs (dropped from the "
                                         f"graph, with the parameters only it uses)", loc), stacklevel=2)

    # -- layer stacks -----------------------------------------------------------------------------
    def _stack(self, node, ev: Evaluator) -> Ref:
        loc = self.spec.loc(node)
        arglist = node.children[1]
        usage = "the tensor goes first, then keywords (stack(x, layers=N, ...))"
        pos, kws = ev.split_args(arglist, "stack(...)", usage, dup_prefix="stack(...): ")
        args = [ev.eval(a) for a in pos]
        kw = {k: ev.eval(vt) for k, vt, _a in kws}
        if len(args) != 1 or not isinstance(args[0], Ref):
            raise self.spec.err("stack(...) takes one tensor (the residual stream) and keywords", loc)
        known = {"layers", "residual", "block_size", "prefix", "norm_eps"}
        for k in kw:
            if k not in known:
                raise self.spec.err(f"stack has no keyword '{k}'{did_you_mean(k, known)}; "
                                    f"it takes: {', '.join(sorted(known))}", loc)
        n = kw.get("layers")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise self.spec.err(f"stack needs layers=<positive int>, got {describe(n)}", loc)
        if n > MAX_LAYERS:
            raise self.spec.err(f"stack(layers={n}): more than {MAX_LAYERS} layers; the graph is built layer by layer "
                                f"(the largest K3-family models have ~100), so this is almost certainly a typo", loc)
        residual = kw.get("residual", "add")
        if residual not in ("add", "attn_res"):
            raise self.spec.err(f"residual must be \"add\" or \"attn_res\", got {describe(residual)}", loc)
        block_size = kw.get("block_size")
        if residual == "attn_res" and block_size is None:
            raise self.spec.err("residual=\"attn_res\" needs block_size=<positive int> (layers per block of "
                                "Block Attention Residuals); none given", loc)
        if residual == "attn_res" and (not isinstance(block_size, int) or isinstance(block_size, bool)
                                       or block_size < 1):
            raise self.spec.err(f"residual=\"attn_res\" needs block_size=<positive int>, "
                                f"got {describe(block_size)}", loc)
        if residual != "attn_res" and block_size is not None:
            raise self.spec.err(f"block_size applies to residual=\"attn_res\" only (residual is "
                                f"\"{residual}\": a plain residual has no blocks)", loc,
                                "drop block_size=, or set residual=\"attn_res\"")
        prefix = kw.get("prefix", "model.layers")
        if not isinstance(prefix, str) or not _NAME_RE.fullmatch(prefix):
            raise self.spec.err(f"stack: prefix must be a string of dot-separated identifiers (model.layers), "
                                f"got {describe(prefix)}", loc)
        eps = kw.get("norm_eps", 1e-6)
        slots = [(str(s.children[0]), s.children[1], self.spec.loc(s)) for s in node.children[2:]]
        names = [s[0] for s in slots]
        if names != ["attn", "ffn"]:
            # the caret goes to the first slot that differs from attn, ffn (the extra one, or the misplaced one)
            bad = next((i for i, nm in enumerate(names) if i > 1 or nm != ("attn", "ffn")[i]), None)
            raise self.spec.err(f"a stack body sets exactly two sublayers, 'attn' then 'ffn'; got {names}",
                                slots[bad][2] if bad is not None else loc)
        x = args[0]
        b = self.b
        xt = b.type(x)
        if xt.dtype not in FLOAT or xt.rank != 3:
            hint = "embed the token ids first: x = embedding(input_ids, vocab=V, dim=d)" if xt.dtype not in FLOAT else None
            raise self.spec.err(f"stack(...) runs over the residual stream, a float [B, T, d] tensor; got {xt}", loc,
                                hint)
        d = xt.shape[-1]
        if residual == "attn_res":  # the memory planner's checkpoint unit (plan_memory checkpointing="block")
            b.meta["attn_res_block_size"] = block_size
        bank, partial = [x], None
        from .ops import OPS, ops_in_slot
        for i in range(1, n + 1):
            lenv = dict(self.env, i=i)
            lev = Evaluator(self.spec, lenv, self)
            chosen = []
            for sname, expr, sloc in slots:
                blk = lev.eval(expr)
                if not isinstance(blk, Block):
                    raise self.spec.err(f"sublayer '{sname}' of layer {i} must be a layer block, "
                                        f"got {describe(blk)}", sloc)
                kinds = ops_in_slot(sname)
                if blk.op not in kinds:
                    raise self.spec.err(f"sublayer '{sname}' of layer {i} is a {blk.op} block; the '{sname}' slot takes "
                                        f"{' or '.join(sorted(kinds))}", sloc)
                chosen.append((blk, sloc))
            p = f"{prefix}.{i - 1}"
            for j, (blk, sloc) in enumerate(chosen):
                norm_name = "input_layernorm" if j == 0 else "post_attention_layernorm"
                res_name = "self_attention_res" if j == 0 else "mlp_res"
                if residual == "attn_res":
                    qp = b.param(f"{p}.{res_name}.proj_weight", (d,), "zeros", loc=sloc)
                    wp = b.param(f"{p}.{res_name}.norm_weight", (d,), "ones", loc=sloc)
                    srcs = bank + ([partial] if partial is not None else [])
                    h = b.call("attn_residual", qp, wp, *srcs, eps=eps, loc=sloc)
                else:
                    h = x
                h = b.call("rmsnorm", h, eps=eps, name=f"{p}.{norm_name}", loc=sloc)
                sub = b.call(blk.op, h, loc=blk.loc, name=f"{p}.{OPS[blk.op].default_name}", **dict(blk.attrs))
                if residual == "attn_res":
                    partial = sub if partial is None else b.call("add", partial, sub, loc=sloc)
                else:
                    x = b.call("add", x, sub, loc=sloc)
            if residual == "attn_res" and i % block_size == 0:
                bank.append(partial)
                partial = None
        if residual == "attn_res":
            # the final mix's weights sit beside the layers: model.layers -> model.final_attn_res, enc ->
            # enc.final_attn_res (so that two attn_res stacks with their own prefixes do not collide)
            base = prefix.removesuffix(".layers") if prefix != "layers" else ""
            fin = f"{base}.final_attn_res" if base else "final_attn_res"
            qp = b.param(f"{fin}.proj_weight", (d,), "zeros", loc=loc)
            wp = b.param(f"{fin}.norm_weight", (d,), "ones", loc=loc)
            srcs = bank + ([partial] if partial is not None else [])
            x = b.call("attn_residual", qp, wp, *srcs, eps=eps, loc=loc)
        return x


_TERMINAL_WORDS = {"NAME": "a name", "INT": "an integer", "DECIMAL": "a number", "STRING": "a string",
                   "COMP_OP": "a comparison", "ADD_OP": "'+' or '-'", "MUL_OP": "'*', '/', '//' or '%'"}


def _describe(term: str) -> str:
    """A grammar terminal as a user reads it: the literal for keywords and punctuation, words for the rest."""
    if term in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[term]
    try:
        pat = _parser().get_terminal(term).pattern
        if type(pat).__name__ == "PatternStr":
            return f"'{pat.value}'"
    except (KeyError, AttributeError):
        pass
    return term


#: a string, a comment, or something that starts like a number (a digit not inside a name): its full run of
#: name characters and dots, with a signed exponent (1e-5) kept whole
_NUMBERISH = re.compile(r'"[^"\n]*"|#[^\n]*|(?<![A-Za-z0-9_.])(\d[A-Za-z0-9_.]*(?:(?<=[eE])[+-][A-Za-z0-9_.]*)?)')
_NUMBER_OK = re.compile(r"\d+|\d+\.\d*([eE][+-]?\d+)?|\d+[eE][+-]?\d+")


def _bad_number(text: str, file: str, before: int | None = None) -> MtcError | None:
    """The first malformed number literal (6_4, 0x40, 1.2.3, 3k) of the text as an MtcError at its position,
    or None. ``before``: only one that starts before that offset (the place a syntax error was found)."""
    for m in _NUMBERISH.finditer(text):
        lit = m.group(1)
        if lit is None or _NUMBER_OK.fullmatch(lit):
            continue
        if before is not None and m.start(1) > before:
            return None
        line = text.count("\n", 0, m.start(1)) + 1
        col = m.start(1) - (text.rfind("\n", 0, m.start(1)) + 1) + 1
        hint = "numbers are decimal: 64, 1.5, 1e-6"
        try:
            hint += f"; write {int(lit, 0)}"
        except ValueError:
            pass
        return MtcError(f"invalid number literal '{lit}'", Loc(file, line, col), text, hint)
    return None


def read_spec_file(path) -> str:
    """The text of a spec file, refused at once (an MtcError naming the file) when it is not a regular file (a
    directory, /dev/zero, a pipe), is larger than MAX_SPEC_BYTES, or is not UTF-8 (located at the first bad
    byte). The file is opened without blocking (a pipe with no writer) and checked as opened; at most
    MAX_SPEC_BYTES + 1 bytes are read, whatever the file system reports as its size."""
    import os
    import stat
    limit = f"more than the limit of {MAX_SPEC_BYTES >> 20} MiB for a spec"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise MtcError(f"cannot read spec '{path}': {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for f, k in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                                        (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe"),
                                        (stat.S_ISSOCK, "a socket")) if f(st.st_mode)), None)
            raise MtcError(f"cannot read spec '{path}': it is {kind + ', ' if kind else ''}not a regular file")
        if st.st_size > MAX_SPEC_BYTES:
            raise MtcError(f"spec '{path}' is {st.st_size:,} bytes, {limit}")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise MtcError(f"cannot read spec '{path}': {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SPEC_BYTES:
        raise MtcError(f"spec '{path}' is {limit}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = len(data[data.rfind(b"\n", 0, e.start) + 1:e.start].decode("utf-8", "replace")) + 1
        raise MtcError(f"spec '{path}' is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})",
                       Loc(str(path), line, col), data.decode("utf-8", "replace")) from None


def parse_spec(text: str, file: str = "<spec>") -> SpecModel:
    """Parse .mtc text into a :class:`SpecModel`. Raises MtcError (syntax errors and malformed number
    literals, at file:line:col)."""
    if text.startswith("\ufeff"):             # a UTF-8 byte-order mark (some editors write one)
        text = " " + text[1:]                  # keep every column where it was
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        # a number typo (6_4 lexes as 6 then the name _4) surfaces as a syntax error a token or a line later
        pos = getattr(e, "pos_in_stream", None)
        if pos is None and getattr(e, "token", None) is not None:
            pos = getattr(e.token, "start_pos", None)
        bad = _bad_number(text, file, before=pos if isinstance(pos, int) and pos >= 0 else len(text))
        err = bad or _syntax_error(e, text, file)
        head = text.lstrip()
        if err.hint is None and head.startswith(("graph ", "kernels ")):
            kind = "graph IR" if head.startswith("graph ") else "kernel IR (a listing, not read back)"
            err.hint = (f"'{file}' is {kind} text (what `mtc ir` prints), not a .mtc spec; the mtc commands "
                        f"and dsl.load / dsl.parse take specs. Load graph IR in Python: g = dsl.parse_ir("
                        f"open('{file}').read(), file='{file}'); m = dsl.compile(g)")
        raise err from None
    bad = _bad_number(text, file)
    if bad is not None:
        raise bad
    return SpecModel(tree, file, text)


def _open_brackets(text: str, end: int) -> list:
    """The brackets '(' / '[' / '{' still open at offset ``end`` of a spec, outermost first, each as (bracket, line,
    column); strings and # comments are skipped."""
    stack, line, col, i, pairs = [], 1, 1, 0, {")": "(", "]": "[", "}": "{"}
    while i < end:
        c = text[i]
        if c == '"':                                   # a string: to its closing quote on the same line
            j = i + 1
            while j < end and text[j] not in '"\n':
                j += 1
            col += j - i
            i = j
        elif c == "#":                                 # a comment: to the end of the line
            while i < end and text[i] != "\n":
                i += 1
            continue
        elif c in "([{":
            stack.append((c, line, col))
        elif c in ")]}" and stack and stack[-1][0] == pairs[c]:
            stack.pop()
        if i < end and text[i] == "\n":
            line, col = line + 1, 1
        else:
            col += 1
        i += 1
    return stack


def _unclosed(text: str, end: int):
    """The innermost bracket still open at offset ``end`` of a spec (see _open_brackets), or None."""
    stack = _open_brackets(text, end)
    return stack[-1] if stack else None


def _syntax_error(e: lark.exceptions.UnexpectedInput, text: str, file: str) -> MtcError:
    """A lark parse failure as an MtcError at the place it was found."""
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        if text[e.pos_in_stream] == '"':
            return MtcError("unterminated string: a '\"' is missing before the end of the line",
                            Loc(file, e.line, e.column), text, "a string is on one line: \"text\"")
        return MtcError(f"unexpected character {text[e.pos_in_stream]!r}", Loc(file, e.line, e.column), text)
    if isinstance(e, lark.exceptions.UnexpectedToken):
        tok = e.token
        exp = sorted({_describe(x) for x in e.expected if not x.startswith("__")})
        more = f" (or {len(exp) - 10} more)" if len(exp) > 10 else ""
        what = "end of file" if tok.type == "$END" else f"'{tok}'"
        hint = None
        closers = {"')'": "(", "']'": "[", "'}'": "{"}
        want = [closers[x] for x in exp if x in closers]
        if want and str(tok) not in (")", "]"):
            pos = getattr(tok, "start_pos", None)
            opened = _unclosed(text, len(text) if pos is None or tok.type == "$END" else pos)
            # a '{' is named only when the file as a whole leaves one open: a body's '{' is open at every bad
            # statement inside it, and its '}' may well come later
            if opened and opened[0] == "{" and not any(b[0] == "{" for b in _open_brackets(text, len(text))):
                opened = None
            if opened and opened[0] in want:
                hint = f"the '{opened[0]}' opened at line {opened[1]}, column {opened[2]} is not closed"
        return MtcError(f"syntax error: unexpected {what}; expected {', '.join(exp[:10])}{more}",
                        Loc(file, e.line if e.line > 0 else text.count(chr(10)) + 1, max(e.column, 1)), text,
                        hint)
    return MtcError("syntax error: unexpected end of file (a '}' missing?)", Loc(file, text.count("\n") + 1, 1), text)


def build_graph(spec: SpecModel, variant: str | None = None, **overrides):
    config = spec.resolve_config(variant, overrides)
    for other in spec.variants:        # every variant's config is checked, not only the one selected
        if other != variant:
            spec.resolve_config(other, {})
    name = spec.name + (f".{variant}" if variant else "")
    return SpecBuilder(spec, config, name).run()
