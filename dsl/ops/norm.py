"""Row norms (role row_norm): rmsnorm, l2norm."""
from __future__ import annotations

from ..builder import ParamSpec, ShapeError
from .core import X, SpecForm, _eq, _need_float, _shape, numel, register, spec_example
from .elementwise import _unary


def _rmsnorm(ts, a):
    x, w = ts
    _need_float(x, "x")
    if w.rank != 1 or not _eq(w.shape[0], x.shape[-1]):
        raise ShapeError(f"weight {_shape(w)} does not match the last dim of x {_shape(x)}")
    return [x]


register("rmsnorm", _rmsnorm, role="row_norm", n_data_inputs=1, inputs=("x", "weight"), attrs={"eps": 1e-6},
         params=lambda a, ts: [ParamSpec("weight", (ts[0].shape[-1],), "ones")], default_name="model.norm",
         flops=lambda ts, os, a: 4 * numel(ts[0]),
         doc="x / sqrt(mean(x^2) + eps) * weight, computed in float32",
         spec=SpecForm('y = rmsnorm(x, eps=1e-6, name="model.norm")',
                       'the weight <name>.weight is [d] (ones); name= optional (default "model.norm"): a second '
                       "rmsnorm needs its own name",
                       spec_example(X, 'h = rmsnorm(x, name="pre_norm")', "y = rmsnorm(h, eps=1e-5)", "return y")))


register("l2norm", _unary, role="row_norm", attrs={"eps": 1e-6}, inputs=("x",),
         flops=lambda ts, os, a: 3 * numel(ts[0]),
         doc="x / sqrt(sum(x^2) + eps) over the last dim",
         spec=SpecForm("y = l2norm(x, eps=1e-6)", "over the last dim; eps optional",
                       spec_example(X, "y = l2norm(x)", "return y")))


