"""Kimi Delta Attention: kda_gate, kda_chunk and the kda_layer block."""
from __future__ import annotations

from ..builder import REQUIRED, GraphBuilder, ParamSpec, ShapeError
from ..ir import Ref
from .core import (NEGATIVE, POSITIVE, WEIGHT_IN, Fusion, SpecForm, _eq, _need_rank, _pow2, _shape, numel, register,
                   spec_example)
from .layers import _lead, _lin, _reshape_to, _slots, _x_only, layer_spec


def _kda_gate(ts, a):
    x, A_log, dt_bias = ts
    _need_rank(x, 4, "kda_gate x [B, T, H, K]")
    H, K = x.shape[2], x.shape[3]
    if A_log.rank != 1 or not _eq(A_log.shape[0], H):
        raise ShapeError(f"A_log {_shape(A_log)} must be [H] with H = {H}")
    if dt_bias.rank != 1 or not _eq(dt_bias.shape[0], H * K):
        raise ShapeError(f"dt_bias {_shape(dt_bias)} must be [H*K] = [{H * K}]")
    if a["gate"] == "sigmoid" and not a["lower_bound"] < 0:
        raise ShapeError(f"lower_bound must be negative, got {a['lower_bound']}")
    return [x.with_dtype("f32")]


register("kda_gate", _kda_gate, role="memory_bound", n_data_inputs=3, inputs=("x", "A_log", "dt_bias"),
         attrs={"lower_bound": -5.0, "gate": "sigmoid"}, flops=lambda ts, os, a: 6 * numel(ts[0]),
         doc="float32 log decay g <= 0. gate=\"sigmoid\" (default, the lower-bounded gate that kda_chunk's "
             "dense tiles need): g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias)); gate=\"softplus\" "
             "(unbounded, Mamba-style): g = -exp(A_log) * softplus(x + dt_bias)",
         spec=SpecForm('g = kda_gate(x, A_log, dt_bias, lower_bound=-5.0, gate="sigmoid")',
                       f"x [B, T, H, K], A_log [H], dt_bias [H*K]; {WEIGHT_IN}",
                       spec_example("x: f32[B, T, 2, 16], A_log: f32[2], dt_bias: f32[32]",
                                    "g = kda_gate(x, A_log, dt_bias)", "return g")))


def _kda_chunk(ts, a):
    q, k, v, g, beta = ts
    for t, nm in ((q, "q"), (k, "k"), (v, "v"), (g, "g")):
        _need_rank(t, 4, f"{nm} [B, T, H, D]")
    if not all(_eq(x, y) for x, y in zip(q.shape, k.shape)):
        raise ShapeError(f"q {_shape(q)} and k {_shape(k)} differ")
    if not all(_eq(x, y) for x, y in zip(q.shape, g.shape)):
        raise ShapeError(f"g {_shape(g)} must match q {_shape(q)}")
    if not all(_eq(x, y) for x, y in zip(q.shape[:3], v.shape[:3])):
        raise ShapeError(f"v {_shape(v)} must share [B, T, H] with q {_shape(q)}")
    if beta.rank != 3 or not all(_eq(x, y) for x, y in zip(beta.shape, q.shape[:3])):
        raise ShapeError(f"beta {_shape(beta)} must be [B, T, H]")
    return [v]


def _kda_flops(ts, os, a, C=64):
    q, v = ts[0], ts[2]
    B, T, H, K = q.shape
    V = v.shape[3]
    return 2 * B * T * H * (3 * C * K + 2 * C * V + 3 * K * V)


def _kda_tiles(n, nodes):
    V = int(n.types[0].shape[-1])
    return {"chunk": 64, "sub_tile": 16, "BLOCK_V": min(64, _pow2(V)), "state": "f32"}


register("kda_chunk", _kda_chunk, role="anchor", n_data_inputs=5, inputs=("q", "k", "v", "g", "beta"),
         attrs={"scale": None, "lower_bound": None}, flops=_kda_flops,
         kinds={"scale": POSITIVE.or_none(), "lower_bound": NEGATIVE.or_none()},
         doc="Kimi Delta Attention, chunked (chunk 64, WY representation); o in v's dtype. lower_bound: the "
             "gate's proven bound (g >= lower_bound), set when g comes from the sigmoid kda_gate: lets every "
             "diagonal tile run as one dense GEMM; None = the safe path",
         spec=SpecForm("o = kda_chunk(q, k, v, g, beta, scale=S)",
                       "q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H]; scale optional (default K^-0.5)",
                       spec_example("q: f32[B, T, 2, 16], k: f32[B, T, 2, 16], v: f32[B, T, 2, 16], "
                                    "g: f32[B, T, 2, 16], beta: f32[B, T, 2]",
                                    "o = kda_chunk(q, k, v, g, beta)", "return o")),
         fusion=Fusion("kda", prologue=("short_conv", "silu", "l2norm", "kda_gate", "sigmoid", "role:view"),
                       epilogue=("rmsnorm", "mul", "role:view"), side=("sigmoid", "role:view"), tiles=_kda_tiles,
                       doc="short conv + SiLU -> L2 norm -> gate -> kda_chunk -> per-head RMSNorm * sigmoid gate"))


def _kda_params(a, ts):
    d = ts[0].shape[-1]
    H, K = a["heads"], a["head_dim"]
    V = a["v_head_dim"] or K
    W, fr, gr = a["conv_size"], a["forget_rank"] or K, a["gate_rank"]
    if not 1 <= W <= 64:
        raise ShapeError(f"conv_size = {W} must be in [1, 64] (the short convolution's width, 4 in Kimi Linear)")
    if a["gate"] == "sigmoid" and not a["lower_bound"] < 0:     # kda_gate's rule, checked at the layer already
        raise ShapeError(f"lower_bound must be negative with gate 'sigmoid', got {a['lower_bound']}")
    p = [ParamSpec("q_proj.weight", (H * K, d)), ParamSpec("k_proj.weight", (H * K, d)),
         ParamSpec("v_proj.weight", (H * V, d)),
         ParamSpec("q_conv1d.weight", (H * K, 1, W), "conv"), ParamSpec("k_conv1d.weight", (H * K, 1, W), "conv"),
         ParamSpec("v_conv1d.weight", (H * V, 1, W), "conv"),
         ParamSpec("f_a_proj.weight", (fr, d)), ParamSpec("f_b_proj.weight", (H * K, fr)),
         ParamSpec("b_proj.weight", (H, d))]
    if gr:
        p += [ParamSpec("g_a_proj.weight", (gr, d)), ParamSpec("g_b_proj.weight", (H * V, gr))]
    else:
        p += [ParamSpec("g_proj.weight", (H * V, d))]
    # decay-gate parameters: Mamba's convention for the softplus gate (A in [1, 16], dt_bias = softplus^-1(dt));
    # for the sigmoid gate A = 1 and sigmoid(dt_bias) log-uniform in [2e-4, 0.2], i.e. g = lower_bound *
    # sigmoid(x + dt_bias) starts at 2e-4 .. 0.2 of the bound (at -5: decay per token exp(-1e-3) .. exp(-1)), where
    # it passes gradient. (Mamba's values inside the sigmoid put exp(A_log) (x + dt_bias) near -50: g ~ -1e-5, no
    # forgetting and no gradient to the gate.)
    if a["gate"] == "sigmoid":
        p += [ParamSpec("A_log", (H,), "zeros", dtype="f32"),
              ParamSpec("dt_bias", (H * K,), "dt_bias_sigmoid", dtype="f32")]
    else:
        p += [ParamSpec("A_log", (H,), "a_log", dtype="f32"), ParamSpec("dt_bias", (H * K,), "dt_bias", dtype="f32")]
    p += [ParamSpec("o_norm.weight", (V,), "ones"), ParamSpec("o_proj.weight", (d, H * V))]
    return p



def _kda_expand(b: GraphBuilder, inputs: list[Ref], a: dict, loc):
    x = inputs[0]
    xt = b.type(x)
    specs = _kda_params(a, [xt])
    P = _slots(x, inputs[1:], specs)
    H, K = a["heads"], a["head_dim"]
    V = a["v_head_dim"] or K
    lead = _lead(xt)

    def conv_branch(w, cw, D):
        y = b.call("short_conv", _lin(b, x, w, loc), cw, loc=loc)
        return _reshape_to(b, b.call("silu", y, loc=loc), lead + (H, D), loc)

    q = b.call("l2norm", conv_branch(P["q_proj"], P["q_conv1d"], K), eps=1e-6, loc=loc)
    k = b.call("l2norm", conv_branch(P["k_proj"], P["k_conv1d"], K), eps=1e-6, loc=loc)
    v = conv_branch(P["v_proj"], P["v_conv1d"], V)
    f = _reshape_to(b, _lin(b, _lin(b, x, P["f_a_proj"], loc), P["f_b_proj"], loc), lead + (H, K), loc)
    g = b.call("kda_gate", f, P["A_log"], P["dt_bias"], lower_bound=a["lower_bound"], gate=a["gate"], loc=loc)
    beta = b.call("sigmoid", _lin(b, x, P["b_proj"], loc), loc=loc)
    bound = float(a["lower_bound"]) if a["gate"] == "sigmoid" else None   # g = lb * sigmoid(.) > lb
    o = b.call("kda_chunk", q, k, v, g, beta, scale=float(K) ** -0.5, lower_bound=bound, loc=loc)
    o = b.call("rmsnorm", o, P["o_norm"], eps=a["norm_eps"], loc=loc)
    if "g_proj" in P:
        gl = _lin(b, x, P["g_proj"], loc)
    else:
        gl = _lin(b, _lin(b, x, P["g_a_proj"], loc), P["g_b_proj"], loc)
    gate = _reshape_to(b, b.call("sigmoid", gl, loc=loc), lead + (H, V), loc)
    o = _reshape_to(b, b.call("mul", o, gate, loc=loc), lead + (H * V,), loc)
    return [_lin(b, o, P["o_proj"], loc)]


register("kda_layer", _x_only("kda_layer", sequence=True), role="layer", slot="attn", params=_kda_params,
         expand=_kda_expand, default_name="self_attn", inputs=("x",),
         spec=layer_spec("block kda = kda_layer(heads=H, head_dim=K)", "kda_layer(heads=2, head_dim=16)"),
         attrs={"heads": REQUIRED, "head_dim": REQUIRED, "v_head_dim": 0, "conv_size": 4, "lower_bound": -5.0,
                "gate": "sigmoid", "forget_rank": 0, "gate_rank": 0, "norm_eps": 1e-6},
         doc="KDA token mixer: projections -> short conv + SiLU -> L2 norm (q, k) -> kda_gate -> kda_chunk "
             "-> per-head RMSNorm * sigmoid output gate -> o_proj (Kimi Linear, arXiv 2510.26692). "
             "v_head_dim 0 = head_dim; forget_rank 0 = head_dim; gate_rank 0 = full-rank output gate; "
             "gate=\"sigmoid\" | \"softplus\": the decay gate (see `mtc ops kda_gate`)")


