"""Elementwise ops (role pointwise): silu, sigmoid, add, mul, situ_glu (which also anchors the dense GLU's fused
GEMM pair)."""
from __future__ import annotations

import sympy

from ..builder import ShapeError
from ..ir import TensorType
from .core import X, Fusion, SpecForm, _eq, _need_float, _shape, numel, register, spec_example


def _unary(ts, a):
    _need_float(ts[0], "input")
    return [ts[0]]


register("silu", _unary, role="pointwise", inputs=("x",), flops=lambda ts, os, a: 4 * numel(ts[0]),
         doc="x * sigmoid(x)", spec=SpecForm("y = silu(x)", "", spec_example(X, "y = silu(x)", "return y")))
register("sigmoid", _unary, role="pointwise", inputs=("x",), flops=lambda ts, os, a: 4 * numel(ts[0]),
         doc="1 / (1 + exp(-x))", spec=SpecForm("y = sigmoid(x)", "", spec_example(X, "y = sigmoid(x)", "return y")))


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


register("add", _binary, role="pointwise", n_data_inputs=2, inputs=("a", "b"), flops=lambda ts, os, a: numel(os[0]),
         doc="a + b (numpy broadcasting)",
         spec=SpecForm("y = add(a, b)", "numpy broadcasting; a and b have the same float dtype",
                       spec_example(f"{X}, b: f32[64]", "y = add(x, b)", "return y")))
register("mul", _binary, role="pointwise", n_data_inputs=2, inputs=("a", "b"), flops=lambda ts, os, a: numel(os[0]),
         doc="a * b (numpy broadcasting)",
         spec=SpecForm("y = mul(a, b)", "numpy broadcasting; a and b have the same float dtype",
                       spec_example(f"{X}, b: f32[B, T, 1]", "y = mul(x, b)", "return y")))


def _glu_from_dual_gemm(n, nodes):
    """situ_glu(linear(x, w_gate), linear(x, w_up)): both GEMMs read the same x."""
    a, b = (nodes[r.node] for r in n.inputs)
    return a.op == "linear" and b.op == "linear" and a.inputs[0] == b.inputs[0]


register("situ_glu", _binary, role="pointwise", n_data_inputs=2, inputs=("a", "b"),
         attrs={"beta_gate": 4.0, "beta_up": 25.0}, flops=lambda ts, os, a: 10 * numel(os[0]),
         doc="(bg*tanh(a/bg)*sigmoid(a)) * (bu*tanh(b/bu))",
         spec=SpecForm("h = situ_glu(a, b, beta_gate=4.0, beta_up=25.0)", "a: gate branch, b: up branch",
                       spec_example(f"{X}, b: f32[B, T, 64]", "h = situ_glu(x, b)", "return h")),
         fusion=Fusion("glu", prologue=("linear",), when=_glu_from_dual_gemm,
                       tiles=lambda n, m: {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64},
                       doc="gate and up projections in one GEMM pass with SiTU-GLU in the epilogue"))

