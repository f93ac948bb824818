"""Mixture of experts: qb_route, moe_experts and the latent_moe and moe blocks."""
from __future__ import annotations

import sympy

from ..builder import REQUIRED, GraphBuilder, ParamSpec, ShapeError
from ..ir import TensorType
from .core import WEIGHT_IN, Fusion, SpecForm, _eq, _need_rank, _shape, numel, register, spec_example
from .ffn import _ACT, _glu_apply, _glu_params
from .layers import _lin, _reshape_to, _x_only, layer_spec


def _qb_route(ts, a):
    x, w, b = ts
    _need_rank(x, 2, "router input x [N, d]")
    _need_rank(w, 2, "router weight [E, d]")
    if not _eq(x.shape[1], w.shape[1]):
        raise ShapeError(f"x {_shape(x)} and router weight {_shape(w)} disagree on d")
    if b.rank != 1 or not _eq(b.shape[0], w.shape[0]):
        raise ShapeError(f"bias {_shape(b)} must be [E] = [{w.shape[0]}]")
    k = a["top_k"]                            # routed_scaling > 0: its kind (OpDef.check_attrs)
    if w.shape[0].is_number and not 1 <= k <= int(w.shape[0]):
        raise ShapeError(f"top_k = {k} must be in [1, E = {w.shape[0]}]")
    N = x.shape[0]
    return [TensorType("i64", (N, k)), TensorType("f32", (N, k)), TensorType("f32", (N, w.shape[0]))]


register("qb_route", _qb_route, role="anchor", n_data_inputs=3, inputs=("x", "weight", "bias"),
         attrs={"top_k": REQUIRED, "routed_scaling": 1.0},
         flops=lambda ts, os, a: 2 * numel(ts[0]) * ts[1].shape[0],
         doc="sigmoid router, top-k on score + bias (Quantile Balancing), unbiased renormalised weights",
         spec=SpecForm(None, "three outputs (topk_idx, topk_weight, scores), which a spec cannot unpack: it runs "
                             "inside the latent_moe and moe layers"),
         fusion=Fusion("router", prologue=("role:view",), tiles=lambda n, m: {"BLOCK_N": 64, "BLOCK_E": 128},
                       doc="router GEMM + sigmoid + biased top-k (Quantile Balancing) + renormalisation"))


def _positive(a, *keys):
    """ShapeError unless each attribute is a finite number > 0 (the SiTU betas divide; a routed_scaling <= 0
    flips or zeroes the expert mix). Their kinds check the same in every op (OpDef.check_attrs); a MoE layer's
    parameter rule checks them first, to say so before anything is built from them."""
    for k in keys:
        v = a[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ShapeError(f"{k} must be a finite number > 0, got {v!r}")


def _moe_experts(ts, a):
    x, idx, w, w1, w3, w2 = ts
    _need_rank(x, 2, "x_lat [N, l]")
    if idx.dtype not in ("i64", "i32") or idx.rank != 2:
        raise ShapeError(f"topk_idx must be integer [N, k], got {idx}")
    if w.rank != 2 or not (_eq(w.shape[0], idx.shape[0]) and _eq(w.shape[1], idx.shape[1])):
        raise ShapeError(f"topk_weight {_shape(w)} must be [N, k] like topk_idx {_shape(idx)}")
    if not _eq(idx.shape[0], x.shape[0]):
        raise ShapeError(f"topk_idx {_shape(idx)} must have one row per token of x_lat {_shape(x)}")
    _need_rank(w1, 3, "w1 [E, I, l]")
    _need_rank(w3, 3, "w3 [E, I, l]")
    _need_rank(w2, 3, "w2 [E, l, I]")
    E, I, L = w1.shape
    if not (_eq(L, x.shape[1]) and all(_eq(p, q) for p, q in zip(w1.shape, w3.shape))):
        raise ShapeError(f"w1 {_shape(w1)} / w3 {_shape(w3)} must be [E, I, l] with l = {x.shape[1]}")
    if not (_eq(w2.shape[0], E) and _eq(w2.shape[1], L) and _eq(w2.shape[2], I)):
        raise ShapeError(f"w2 {_shape(w2)} must be [E, l, I] = [{E}, {L}, {I}]")
    return [x]                                # activation, beta_gate, beta_up: their kinds (OpDef.check_attrs)


def _moe_tiles(n, nodes):
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "sort": "by_expert"}


register("moe_experts", _moe_experts, role="anchor", n_data_inputs=6,
         inputs=("x_lat", "topk_idx", "topk_weight", "w1", "w3", "w2"),
         attrs={"activation": "situ", "beta_gate": 4.0, "beta_up": 25.0},
         flops=lambda ts, os, a: 2 * ts[0].shape[0] * ts[1].shape[1] * 3 * ts[3].shape[1] * ts[3].shape[2],
         doc="u = sum_k w_k * w2_e act(w1_e x, w3_e x), e = topk_idx[:, k]",
         spec=SpecForm('u = moe_experts(x_lat, topk_idx, topk_weight, w1, w3, w2, activation="situ")',
                       "x_lat [N, l] (N tokens; the example names them T), topk_idx/topk_weight [N, k], "
                       f"w1/w3 [E, I, l], w2 [E, l, I]; {WEIGHT_IN}; normally it runs inside latent_moe / moe, fed "
                       "by qb_route",
                       spec_example("x: f32[T, 16], idx: i64[T, 2], w: f32[T, 2], w1: f32[4, 16, 16], "
                                    "w3: f32[4, 16, 16], w2: f32[4, 16, 16]",
                                    "u = moe_experts(x, idx, w, w1, w3, w2)", "return u")),
         fusion=Fusion("experts", epilogue=("rmsnorm",), tiles=_moe_tiles,
                       doc="grouped GEMM (w1|w3) with SiTU-GLU epilogue, grouped GEMM w2, weighted combine, "
                           "RMSNorm(u)"))



def _moe_params(a, ts, latent: bool):
    d = ts[0].shape[-1]
    E, I, k = a["experts"], a["inter"], a["top_k"]
    w = a["latent"] if latent else d
    if E < 1:
        raise ShapeError(f"experts = {E} must be >= 1")
    if not 1 <= k <= E:
        raise ShapeError(f"top_k = {k} must be in [1, experts = {E}]")
    _positive(a, "routed_scaling", *(("beta_gate", "beta_up") if a["act"] == "situ" else ()))
    p = [ParamSpec("gate.weight", (E, d)),
         ParamSpec("gate.e_score_correction_bias", (E,), "zeros", kind="buffer", dtype="f32")]
    if latent:
        p += [ParamSpec("routed_expert_down_proj.weight", (w, d))]
    p += [ParamSpec("experts.w1", (E, I, w), "expert", active=k / E, dtype=a["expert_dtype"] or None),
          ParamSpec("experts.w3", (E, I, w), "expert", active=k / E, dtype=a["expert_dtype"] or None),
          ParamSpec("experts.w2", (E, w, I), "expert", active=k / E, dtype=a["expert_dtype"] or None)]
    if latent:
        p += [ParamSpec("routed_expert_norm.weight", (w,), "ones"), ParamSpec("routed_expert_up_proj.weight", (d, w))]
    if a["shared"]:
        p += _glu_params({"inter": a["shared"] * a["shared_inter"] if a["shared_inter"] else a["shared"] * I},
                         ts, "shared_experts.")
    return p


def _moe_expand_common(b: GraphBuilder, inputs, a, loc, latent: bool):
    x = inputs[0]
    xt = b.type(x)
    specs = _moe_params(a, [xt], latent)
    P = {s.suffix: r for s, r in zip(specs, inputs[1:])}
    d = xt.shape[-1]
    N = sympy.Mul(*xt.shape[:-1])
    xf = _reshape_to(b, x, (N, d), loc)
    idx, w, _scores = b.call("qb_route", xf, P["gate.weight"], P["gate.e_score_correction_bias"],
                             top_k=a["top_k"], routed_scaling=a["routed_scaling"], loc=loc)
    xl = _lin(b, xf, P["routed_expert_down_proj.weight"], loc) if latent else xf
    u = b.call("moe_experts", xl, idx, w, P["experts.w1"], P["experts.w3"], P["experts.w2"],
               activation=a["act"], beta_gate=a["beta_gate"], beta_up=a["beta_up"], loc=loc)
    if latent:
        u = b.call("rmsnorm", u, P["routed_expert_norm.weight"], eps=a["norm_eps"], loc=loc)
        u = _lin(b, u, P["routed_expert_up_proj.weight"], loc)
    if a["shared"]:
        ys = _glu_apply(b, xf, P["shared_experts.gate_proj.weight"], P["shared_experts.up_proj.weight"],
                        P["shared_experts.down_proj.weight"], a, loc)
        u = b.call("add", ys, u, loc=loc)
    return [_reshape_to(b, u, xt.shape, loc)]


_MOE_ATTRS = {"experts": REQUIRED, "top_k": REQUIRED, "inter": REQUIRED, "shared": 0, "shared_inter": 0,
              "routed_scaling": 1.0, "expert_dtype": "", "norm_eps": 1e-6, **_ACT}

register("latent_moe", _x_only("latent_moe"), role="layer", slot="ffn", params=lambda a, ts: _moe_params(a, ts, True),
         expand=lambda b, i, a, loc: _moe_expand_common(b, i, a, loc, True),
         spec=layer_spec("block moe = latent_moe(experts=E, top_k=k, inter=I, latent=L)",
                         "latent_moe(experts=8, top_k=2, inter=32, latent=32, shared=1)"),
         default_name="block_sparse_moe", inputs=("x",), attrs={**_MOE_ATTRS, "latent": REQUIRED},
         doc="Stable LatentMoE: y = shared(x) + W_up RMSNorm(sum_k p_k E_k(W_down x)), QB-routed")
register("moe", _x_only("moe"), role="layer", slot="ffn", params=lambda a, ts: _moe_params(a, ts, False),
         expand=lambda b, i, a, loc: _moe_expand_common(b, i, a, loc, False),
         spec=layer_spec("block moe = moe(experts=E, top_k=k, inter=I)", "moe(experts=8, top_k=2, inter=32)"),
         default_name="block_sparse_moe", inputs=("x",), attrs=_MOE_ATTRS,
         doc="sparse MoE at full width: y = shared(x) + sum_k p_k E_k(x), QB-routed")

