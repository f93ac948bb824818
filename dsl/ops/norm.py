"""Row norms: rmsnorm, l2norm."""
from __future__ import annotations

from ..builder import ParamSpec, ShapeError
from .core import _eq, _need_float, _shape, numel, register
from .elementwise import _unary


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


