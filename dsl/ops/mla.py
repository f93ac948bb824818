"""Multi-head latent attention: mla_attention and the gated mla_layer block."""
from __future__ import annotations

import math

from ..builder import REQUIRED, GraphBuilder, ParamSpec, ShapeError
from .core import Fusion, SpecForm, _dims_attr, _eq, _need_rank, _pow2, _shape, register, spec_example
from .layers import _lead, _lin, _reshape_to, _slots, _x_only, layer_spec


def _mla_attention(ts, a):
    q, k, v = ts
    for t, nm in ((q, "q"), (k, "k"), (v, "v")):
        _need_rank(t, 4, f"{nm} [B, T, H, D]")
    if not all(_eq(x, y) for x, y in zip(q.shape, k.shape)):
        raise ShapeError(f"q {_shape(q)} and k {_shape(k)} differ")
    if not all(_eq(x, y) for x, y in zip(q.shape[:3], v.shape[:3])):
        raise ShapeError(f"v {_shape(v)} must share [B, T, H] with q")
    return [v]


def _mla_flops(ts, os, a):
    q, v = ts[0], ts[2]
    B, T, H, D = q.shape
    pairs = T * (T + 1) / 2 if a["causal"] else T * T
    return 2 * B * H * pairs * (D + v.shape[3])


def _mla_tiles(n, nodes):
    dqk = int(nodes[n.inputs[0].node].types[n.inputs[0].index].shape[-1])
    return {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": _pow2(dqk)}


register("mla_attention", _mla_attention, role="anchor", n_data_inputs=3, inputs=("q", "k", "v"),
         attrs={"scale": REQUIRED, "causal": True}, flops=_mla_flops,
         doc="softmax(q k^T * scale) v, causal, softmax in float32",
         spec=SpecForm("o = mla_attention(q, k, v, scale=S, causal=true)",
                       "q, k [B, T, H, D], v [B, T, H, Dv]; scale required",
                       spec_example("q: f32[B, T, 2, 16], k: f32[B, T, 2, 16], v: f32[B, T, 2, 16]",
                                    "o = mla_attention(q, k, v, scale=0.25)", "return o")),
         fusion=Fusion("mla", prologue=("concat", "role:view"), epilogue=("mul", "role:view"),
                       side=("sigmoid", "role:view"), tiles=_mla_tiles,
                       doc="k = [k_nope, broadcast k_rope] built in the prologue; sigmoid output gate in the "
                           "epilogue"))



def _mla_params(a, ts):
    d = ts[0].shape[-1]
    H, ql, kl = a["heads"], a["q_lora_rank"], a["kv_lora_rank"]
    dn, dr, dv = a["qk_nope_dim"], a["qk_rope_dim"], a["v_dim"]
    if dn < 0 or dr < 0 or dn + dr == 0:
        raise ShapeError(f"qk_nope_dim and qk_rope_dim must be >= 0 with a positive sum (the query/key head dim), "
                         f"got qk_nope_dim={dn}, qk_rope_dim={dr}")
    p = []
    if ql:
        p += [ParamSpec("q_a_proj.weight", (ql, d)), ParamSpec("q_a_layernorm.weight", (ql,), "ones"),
              ParamSpec("q_b_proj.weight", (H * (dn + dr), ql))]
    else:
        p += [ParamSpec("q_proj.weight", (H * (dn + dr), d))]
    p += [ParamSpec("kv_a_proj_with_mqa.weight", (kl + dr, d)), ParamSpec("kv_a_layernorm.weight", (kl,), "ones"),
          ParamSpec("kv_b_proj.weight", (H * (dn + dv), kl))]
    if a["gated"]:
        p += [ParamSpec("g_proj.weight", (H * dv, d))]
    p += [ParamSpec("o_proj.weight", (d, H * dv))]
    return p


def _mla_expand(b: GraphBuilder, inputs, a, loc):
    x = inputs[0]
    xt = b.type(x)
    specs = _mla_params(a, [xt])
    P = _slots(x, inputs[1:], specs)
    H, ql, kl = a["heads"], a["q_lora_rank"], a["kv_lora_rank"]
    dn, dr, dv = a["qk_nope_dim"], a["qk_rope_dim"], a["v_dim"]
    lead = _lead(xt)
    if ql:
        cq = b.call("rmsnorm", _lin(b, x, P["q_a_proj"], loc), P["q_a_layernorm"], eps=a["norm_eps"], loc=loc)
        q = _lin(b, cq, P["q_b_proj"], loc)
    else:
        q = _lin(b, x, P["q_proj"], loc)
    q = _reshape_to(b, q, lead + (H, dn + dr), loc)
    kv = _lin(b, x, P["kv_a_proj_with_mqa"], loc)
    # qk_rope_dim 0: no shared key part (k = the per-head part); qk_nope_dim 0: only the shared part
    c = b.call("slice", kv, dim=-1, start=0, end=kl, loc=loc) if dr else kv
    kr = b.call("slice", kv, dim=-1, start=kl, end=kl + dr, loc=loc) if dr else None
    c = b.call("rmsnorm", c, P["kv_a_layernorm"], eps=a["norm_eps"], loc=loc)
    kvb = _reshape_to(b, _lin(b, c, P["kv_b_proj"], loc), lead + (H, dn + dv), loc)
    kn = b.call("slice", kvb, dim=-1, start=0, end=dn, loc=loc) if dn else None
    v = b.call("slice", kvb, dim=-1, start=dn, end=dn + dv, loc=loc) if dn else kvb
    if dr:
        kr = b.call("broadcast", _reshape_to(b, kr, lead + (1, dr), loc), shape=_dims_attr(lead + (H, dr)),
                    loc=loc)
    k = b.call("concat", kn, kr, dim=-1, loc=loc) if dn and dr else (kn if dn else kr)
    o = b.call("mla_attention", q, k, v, scale=1.0 / math.sqrt(dn + dr), causal=True, loc=loc)
    if a["gated"]:
        gate = _reshape_to(b, b.call("sigmoid", _lin(b, x, P["g_proj"], loc), loc=loc), lead + (H, dv), loc)
        o = b.call("mul", o, gate, loc=loc)
    o = _reshape_to(b, o, lead + (H * dv,), loc)
    return [_lin(b, o, P["o_proj"], loc)]


register("mla_layer", _x_only("mla_layer", sequence=True), role="layer", slot="attn", params=_mla_params,
         expand=_mla_expand, default_name="self_attn", inputs=("x",),
         spec=layer_spec("block mla = mla_layer(heads=H, kv_lora_rank=R)",
                         "mla_layer(heads=2, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=8, v_dim=16)"),
         attrs={"heads": REQUIRED, "q_lora_rank": 0, "kv_lora_rank": REQUIRED, "qk_nope_dim": 128,
                "qk_rope_dim": 64, "v_dim": 128, "gated": True, "norm_eps": 1e-6},
         doc="gated multi-head latent attention (DeepSeek-V2 MLA, NoPE) with output gate sigmoid(W_g x) * o")


