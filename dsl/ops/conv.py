"""The causal depthwise short convolution of KDA's q, k, v branches."""
from __future__ import annotations

from ..builder import ShapeError
from .core import WEIGHT_IN, X, SpecForm, _eq, _need_rank, _shape, numel, register, spec_example


def _short_conv(ts, a):
    x, w = ts
    _need_rank(x, 3, "short_conv input [B, T, C]")
    if w.rank != 3 or not _eq(w.shape[0], x.shape[2]) or w.shape[1] != 1:
        raise ShapeError(f"weight {_shape(w)} must be [C, 1, W] with C = {x.shape[2]}")
    return [x]


register("short_conv", _short_conv, role="memory_bound", n_data_inputs=2, inputs=("x", "weight"),
         flops=lambda ts, os, a: 2 * numel(ts[0]) * ts[1].shape[2],
         doc="causal depthwise conv over T, weight [C, 1, W]",
         spec=SpecForm("y = short_conv(x, w)", f"x [B, T, C], w [C, 1, W]; {WEIGHT_IN}",
                       spec_example(f"{X}, w: f32[64, 1, 4]", "y = short_conv(x, w)", "return y")))


