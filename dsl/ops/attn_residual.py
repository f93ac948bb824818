"""Block Attention Residuals: attn_residual and its two-phase form (attn_residual_phase1, attn_residual_merge,
made by the batch_attn_residual pass)."""
from __future__ import annotations

from ..builder import REQUIRED, ShapeError
from ..ir import TensorType
from .core import WEIGHT_IN, Fusion, SpecForm, _eq, _need_float, _pow2, _shape, numel, register, spec_example


def _attn_residual(ts, a):
    q, w, *src = ts
    if not src:
        raise ShapeError("needs at least one source")
    _need_float(q, "query")
    _need_float(w, "rms_weight")
    _need_float(src[0], "source 0")
    d = src[0].shape[-1]
    if q.rank != 1 or not _eq(q.shape[0], d) or w.rank != 1 or not _eq(w.shape[0], d):
        raise ShapeError(f"query {_shape(q)} and rms_weight {_shape(w)} must be [d] = [{d}]")
    for i, s in enumerate(src):
        if not s.same(src[0]):
            raise ShapeError(f"source {i} is {s}, source 0 is {src[0]}")
    return [src[0]]


def _row_tiles(n, nodes):
    d = int(n.types[0].shape[-1])
    return {"BLOCK_D": _pow2(d), "ROWS": 2}


_BY_PASS = "made by the batch_attn_residual pass from attn_residual; not written in a spec"

register("attn_residual", _attn_residual, role="anchor", n_data_inputs=3, variadic=True,
         inputs=("query", "rms_weight", "*sources"), attrs={"eps": 1e-6},
         flops=lambda ts, os, a: 5 * numel(ts[2]) * (len(ts) - 2),
         doc="softmax over sources of query . RMSNorm(source) -> weighted sum of sources (Block AttnRes)",
         spec=SpecForm("h = attn_residual(query, rms_weight, s1, s2, ...)",
                       f"query, rms_weight [d], sources [..., d]; {WEIGHT_IN}; "
                       'stack(..., residual="attn_res") creates and wires them for every sublayer',
                       spec_example("q: f32[64], w: f32[64], a: f32[B, T, 64], b: f32[B, T, 64]",
                                    "h = attn_residual(q, w, a, b)", "return h")),
         fusion=Fusion("attn_res", epilogue=("rmsnorm",), tiles=_row_tiles,
                       doc="AttnRes over depth + the next sublayer's RMSNorm"))



def _phase1(ts, a):
    Q = a["n_queries"]
    qs, ws, bank = ts[:Q], ts[Q:2 * Q], ts[2 * Q:]
    if len(qs) != Q or len(ws) != Q or not bank:
        raise ShapeError(f"needs {Q} queries, {Q} rms weights and >= 1 bank source, got {len(ts)} inputs")
    for x in qs + ws:
        _attn_residual([x, x, bank[0]], a)
    for i, s in enumerate(bank):
        if not s.same(bank[0]):
            raise ShapeError(f"bank source {i} is {s}, source 0 is {bank[0]}")
    sh = bank[0].shape
    return [TensorType("f32", (Q,) + sh), TensorType("f32", (Q,) + sh[:-1]), TensorType("f32", (Q,) + sh[:-1])]


register("attn_residual_phase1", _phase1, role="anchor", n_data_inputs=3, variadic=True,
         inputs=("*queries", "*rms_weights", "*bank"), attrs={"n_queries": REQUIRED, "eps": 1e-6},
         flops=lambda ts, os, a: 5 * numel(ts[-1]) * (len(ts) - 2 * a["n_queries"]) * a["n_queries"],
         doc="every pseudo-query of a block against the completed bank in one read: (acc, max, sum) per query",
         spec=SpecForm(None, _BY_PASS),
         fusion=Fusion("attn_res_bank", tiles=_row_tiles,
                       doc="every query of a block against the completed bank in one read"))


def _merge(ts, a):
    acc, m, s, q, w, *partial = ts
    i = a["index"]
    if not 0 <= i < int(acc.shape[0]):
        raise ShapeError(f"index {i} out of range for {int(acc.shape[0])} queries")
    out = TensorType(a["dtype"], acc.shape[1:])
    if partial and not (partial[0].rank == out.rank and all(_eq(x, y) for x, y in zip(partial[0].shape, out.shape))):
        raise ShapeError(f"partial {partial[0]} does not match the bank's {out}")
    return [out]


register("attn_residual_merge", _merge, role="anchor", n_data_inputs=5, variadic=True,
         inputs=("acc", "m", "s", "query", "rms_weight", "*partial"),
         attrs={"index": REQUIRED, "eps": 1e-6, "dtype": REQUIRED},
         flops=lambda ts, os, a: 8 * numel(os[0]),
         doc="online-softmax merge of one query's bank result (phase 1, row index) with the in-block partial",
         spec=SpecForm(None, _BY_PASS),
         fusion=Fusion("attn_res", epilogue=("rmsnorm",), tiles=_row_tiles,
                       doc="online-softmax merge + the next sublayer's RMSNorm"))

