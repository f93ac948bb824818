"""Elementwise ops: silu, sigmoid, add, mul, situ_glu."""
from __future__ import annotations

import sympy

from ..builder import ShapeError
from ..ir import TensorType
from .core import _eq, _need_float, _shape, numel, register


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

register("situ_glu", _binary, n_data_inputs=2, inputs=("a", "b"), attrs={"beta_gate": 4.0, "beta_up": 25.0},
         flops=lambda ts, os, a: 10 * numel(os[0]),
         doc="(bg*tanh(a/bg)*sigmoid(a)) * (bu*tanh(b/bu))")

