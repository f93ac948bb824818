"""Data movement: the views reshape, slice, broadcast (no launch, no storage of their own) and concat."""
from __future__ import annotations

import sympy

from ..builder import REQUIRED, ShapeError
from ..ir import TensorType, dim
from .core import AXIS, INT, X, Rewrite, SpecForm, _dims, _eq, _shape, register, spec_example


def _target_shape(x: TensorType, a: dict) -> tuple:
    """The ``shape`` attribute of reshape / broadcast as dims; a symbol that x's shape lacks is an error."""
    from ..dim_expr import DimError
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


register("reshape", _reshape, role="view", attrs={"shape": REQUIRED}, inputs=("x",), doc="view x with a new shape",
         spec=SpecForm('y = reshape(x, shape=["B", "T", 2, 32])',
                       "shape: a list of integers and quoted symbol names (\"B\", \"T\"); the element count must "
                       "stay the same",
                       spec_example(X, 'y = reshape(x, shape=["B", "T", 2, 32])', "return y")),
         rewrites=(
             # reshape to the shape it already has: drop
             Rewrite("reshape-noop", lambda n, m: m[n.inputs[0].node].types[n.inputs[0].index].same(n.types[0]),
                     lambda n, m: n.inputs[0]),
             # reshape of a reshape: reshape the original
             Rewrite("reshape-reshape", lambda n, m: m[n.inputs[0].node].op == "reshape",
                     lambda n, m: ("reshape", m[n.inputs[0].node].inputs[0]))))


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


register("slice", _slice, role="view", attrs={"dim": -1, "start": REQUIRED, "end": REQUIRED}, inputs=("x",),
         kinds={"dim": AXIS, "start": INT, "end": INT}, doc="x[..., start:end, ...] along dim",
         spec=SpecForm("y = slice(x, start=S, end=E, dim=-1)", "x[..., S:E] along dim (default -1, the last)",
                       spec_example(X, "y = slice(x, start=0, end=16)", "return y")))


def _concat(ts, a):
    x, y = ts
    d = _axis(a, x)
    if x.rank != y.rank or x.dtype != y.dtype or any(
            not _eq(p, q) for i, (p, q) in enumerate(zip(x.shape, y.shape)) if i != d):
        raise ShapeError(f"cannot concatenate {x} and {y} along dim {d}")
    return [x.with_shape(x.shape[:d] + (x.shape[d] + y.shape[d],) + x.shape[d + 1:])]


register("concat", _concat, role="memory_bound", n_data_inputs=2, attrs={"dim": -1}, inputs=("a", "b"),
         kinds={"dim": AXIS},
         doc="cat([a, b], dim)",
         spec=SpecForm("y = concat(a, b, dim=-1)", "same rank and dtype; other dims equal",
                       spec_example(X, "y = concat(x, x, dim=-1)", "return y")))


def _broadcast(ts, a):
    x = ts[0]
    shape = _target_shape(x, a)
    if len(shape) != x.rank or any(not (_eq(p, q) or p == 1) for p, q in zip(x.shape, shape)):
        raise ShapeError(f"cannot broadcast {_shape(x)} to {_dims(shape)}")
    return [x.with_shape(shape)]


register("broadcast", _broadcast, role="view", attrs={"shape": REQUIRED}, inputs=("x",), doc="expand size-1 dims",
         spec=SpecForm('y = broadcast(x, shape=["B", "T", 4, 8])',
                       "same rank; only size-1 dims expand; symbol names quoted as in reshape",
                       spec_example("x: f32[B, T, 1, 8]", 'y = broadcast(x, shape=["B", "T", 4, 8])', "return y")))

