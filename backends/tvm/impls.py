"""The tvm target's implementations: TensorIR kernels for the memory-bound ops (backends/tvm), each running the
reference op where a dtype or device has no TVM kernel and where autograd needs a gradient (both give the same
values); every other op falls back along the chain tvm -> triton -> reference (backends/registry.py)."""
from __future__ import annotations

from backends.registry import impl

from . import op_table

for _op, _fn in op_table().items():
    impl("tvm", _op)(_fn)
