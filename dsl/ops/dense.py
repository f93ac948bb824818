"""Ops with a weight matrix: embedding, linear, lm_head."""
from __future__ import annotations

from ..builder import REQUIRED, ParamSpec, ShapeError
from ..ir import TensorType
from .core import SIZE, X, SpecForm, _eq, _need_float, _need_rank, _shape, numel, register, spec_example


def _embedding(ts, a):
    ids, w = ts
    if ids.dtype not in ("i64", "i32"):
        raise ShapeError(f"token ids must be integer, got {ids.dtype}")
    _need_rank(w, 2, "embedding weight")
    return [TensorType(w.dtype, ids.shape + (w.shape[1],))]


register("embedding", _embedding, role="memory_bound", n_data_inputs=1, inputs=("ids", "weight"), int_data=("ids",),
         param_attrs={"vocab": REQUIRED, "dim": REQUIRED}, kinds={"dim": SIZE},
         params=lambda a, ts: [ParamSpec("weight", (a["vocab"], a["dim"]), "normal", std=0.02)],
         default_name="model.embed_tokens", doc="weight[ids]",
         spec=SpecForm('x = embedding(ids, vocab=V, dim=D, name="model.embed_tokens")',
                       'ids integer [..]; the table <name>.weight is [vocab, dim]; name= optional (default '
                       '"model.embed_tokens")',
                       spec_example("ids: i64[B, T]", "x = embedding(ids, vocab=256, dim=64)", "return x")))


def _linear(ts, a):
    x, w = ts[0], ts[1]
    _need_float(x, "x")
    _need_rank(w, 2, "linear weight")
    if not _eq(x.shape[-1], w.shape[1]):
        raise ShapeError(f"x has last dim {x.shape[-1]} but the weight {_shape(w)} expects {w.shape[1]}")
    return [TensorType(x.dtype, x.shape[:-1] + (w.shape[0],))]


register("linear", _linear, role="gemm", n_data_inputs=1, inputs=("x", "weight"), param_attrs={"out": REQUIRED},
         params=lambda a, ts: [ParamSpec("weight", (a["out"], ts[0].shape[-1]))],
         flops=lambda ts, os, a: 2 * numel(ts[0]) * ts[1].shape[0], doc="x @ weight^T; weight [out, in]",
         spec=SpecForm('y = linear(x, out=N, name="...")',
                       "name= required: the weight <name>.weight is [out, in], in = the last dim of x",
                       spec_example(X, 'y = linear(x, out=32, name="proj")', "return y")))


def _lm_head(ts, a):
    return _linear(ts, a)


register("lm_head", _lm_head, role="gemm", n_data_inputs=1, inputs=("x", "weight"), param_attrs={"vocab": REQUIRED},
         params=lambda a, ts: [ParamSpec("weight", (a["vocab"], ts[0].shape[-1]))], default_name="lm_head",
         flops=lambda ts, os, a: 2 * numel(ts[0]) * ts[1].shape[0], doc="logits = x @ weight^T",
         spec=SpecForm('logits = lm_head(x, vocab=V, name="lm_head")',
                       'the weight <name>.weight is [vocab, d]; name= optional (default "lm_head")',
                       spec_example(X, "return lm_head(x, vocab=256)")))

