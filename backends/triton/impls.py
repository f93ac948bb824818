"""The triton target's implementations: the Triton kernels of the heavy ops, the vendor libraries for GEMMs
(cuBLAS) and the MLA core (torch's flash SDPA), and the fused launches the lowering forms on this target (KDA's
conv + SiLU + L2 norm prologue, AttnRes with the next RMSNorm). Every other op runs on the reference (the
chain triton -> reference, backends/registry.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import backends.triton as T
from backends.reference.impls import (fake_attn_residual, fake_merge, fake_mla, fake_phase1, fake_route, like, merge,
                                      new, phase1)
from backends.registry import impl

from .kda import CHUNK, FAST_LOWER_BOUND_LIMIT, forward_workspace

TR = "triton"


def fast_bound(lower_bound):
    """kda_chunk's lower_bound for the Triton kernel: the gate's bound when its dense diagonal tiles can take it
    (>= FAST_LOWER_BOUND_LIMIT, -10), else None (the safe path, correct for any g <= 0)."""
    if lower_bound is None or float(lower_bound) < FAST_LOWER_BOUND_LIMIT:
        return None
    return lower_bound


def phase1_acc_dtype(bank_dtype):
    """Accumulator dtype of the Triton phase 1: the bank's dtype for bf16/fp16 banks (halves the bytes of the
    acc write and the merges' reads; benchmarks/results/attn_residual.md), float32 otherwise. m and s stay
    float32."""
    return bank_dtype if bank_dtype in (torch.bfloat16, torch.float16) else torch.float32


def _kda_meta(n, types):
    lb = fast_bound(n.attr("lower_bound"))
    return {"chunk": CHUNK, "tiles": "dense" if lb is not None else "safe"}


def _kda_workspace(L, shapes, elem):
    B, T, H, K = shapes[0]
    V = shapes[2][3]
    return forward_workspace(B, T, H, K, V, elem(L.inputs[0][1]))


def _sdpa_workspace(L, shapes, elem):
    """mla_attention on torch's SDPA (backends/triton/mla.py): q, k, v padded to one head dim d = max(Dqk, Dv)
    (a copy of each narrower one) and the kernel's [B, H, T, d] output before the slice to Dv."""
    (B, T, H, dq), dk, dv = shapes[0], shapes[1][3], shapes[2][3]
    d = max(dq, dk, dv)
    copies = sum(x < d for x in (dq, dk, dv)) + 1
    return copies * B * T * H * d * elem(L.inputs[2][1])


def _moe_workspace(L, shapes, elem):
    """moe_experts without autograd (backends/triton/moe.py _ExpertsFn): for the N k routed rows, the dispatch
    (sorted ids, permutation, token and position maps: int64), the routing weight per row (float32), the GLU
    output hw [Nk, I] and GEMM 2's y [Nk, l] before the combine."""
    (N, l), (_n, k), (_E, I, _l) = shapes[0], shapes[1], shapes[3]
    nk = N * k
    return nk * (4 * 8 + 4) + nk * (I + l) * elem(L.inputs[0][1])


def _route_workspace(L, shapes, elem):
    """qb_route: the float32 router scores [N, E] and per-token top-k scratch."""
    N, E = shapes[0][0], shapes[1][0]
    return N * (E * 4 + 16)


def _phase1_workspace(L, shapes, elem):
    """attn_residual_phase1 (backends/triton/attn_residual/phase1.py phase1_launch): the float32 logits [L, n, QP] of
    every bank source against the queries padded to QP = max(16, 2^ceil(log2 Q)) columns, and q * w in float32
    [d, Q] and split three ways [d, 3 QP]."""
    Q = L.meta.get("queries") or 1
    srcs = shapes[2 * Q:]
    n, d = 1, srcs[0][-1]
    for x in srcs[0][:-1]:
        n *= x
    QP = max(16, 1 << max(0, Q - 1).bit_length())
    return len(srcs) * n * QP * 4 + d * Q * 4 + d * 3 * QP * 4


def _phase1_aliases(n, types):
    """One bank source: every accumulator is that source, a broadcast view (phase1_acc_dtype keeps the source's
    dtype for 16-bit banks, and float32 ones are float32 already)."""
    Q = n.attr("n_queries")
    return {0: 2 * Q} if len(types) == 2 * Q + 1 else {}


impl(TR, "linear", name="library.gemm")(lambda c, x, w: F.linear(x, w.to(x.dtype)))
impl(TR, "lm_head", name="library.gemm")(lambda c, x, w: F.linear(x, w.to(x.dtype)))
impl(TR, "mla_attention", name="library.sdpa", workspace=_sdpa_workspace, args="float? scale, bool causal",
     fake=fake_mla)(lambda c, q, k, v: T.mla_attention(q, k, v, scale=c.attr("scale"), causal=c.attr("causal")))
impl(TR, "kda_chunk", meta=_kda_meta, workspace=_kda_workspace, args="float? scale, float? lower_bound", fake=new(2))(
    lambda c, q, k, v, g, b: T.kda_chunk(q, k, v, g, b, scale=c.attr("scale"),
                                         lower_bound=fast_bound(c.attr("lower_bound")))[0])
impl(TR, "kda_gate", grad=False, args="float? lower_bound, str gate", fake=like(0, torch.float32))(
    lambda c, x, a, d: T.kda_gate(x, a, d, lower_bound=c.attr("lower_bound"), gate=c.attr("gate")))
impl(TR, "attn_residual", args="float eps", fake=fake_attn_residual)(
    lambda c, q, w, *s: T.attn_residual(q, list(s), w, eps=c.attr("eps")))
impl(TR, "attn_residual_phase1", workspace=_phase1_workspace, aliases=_phase1_aliases,
     meta=lambda n, types: {"queries": n.attr("n_queries")}, args="int n_queries, float eps",
     fake=fake_phase1(phase1_acc_dtype))(
    lambda c, *a: phase1(T.attn_residual_phase1, c, a, acc_dtype=phase1_acc_dtype(a[-1].dtype)))
impl(TR, "attn_residual_merge", args="int index, float eps", fake=fake_merge)(
    lambda c, *a: merge(T.attn_residual_merge, c, a))
impl(TR, "qb_route", workspace=_route_workspace, args="int top_k, float routed_scaling", fake=fake_route)(
    lambda c, x, w, b: T.qb_route(x, w, b, top_k=c.attr("top_k"), routed_scaling=c.attr("routed_scaling")))
impl(TR, "moe_experts", workspace=_moe_workspace, args="str activation, float? beta_gate, float? beta_up",
     fake=like())(lambda c, x, i, w, w1, w3, w2: T.moe_experts(
         x, i, w, w1, w3, w2, activation=c.attr("activation"), beta_gate=c.attr("beta_gate"),
         beta_up=c.attr("beta_up")))


# -- fused launches (passes/lower.py forms them on this target when autograd does not record) ---------------------
def _conv_chain(node, members):
    """conv_silu_norm's attributes from its members: the L2 norm's head dim and eps and the reshape to heads before
    it (head_dim None: the chain ends at the SiLU)."""
    last = members[-1]
    norm = last.op == "l2norm"
    return {"head_dim": int(last.types[0].shape[-1]) if norm else None, "eps": last.attr("eps") if norm else 1e-6,
            "shape": members[2].attr("shape") if norm else None}


def _fake_conv_chain(c, x, w):
    return x.new_empty(c.shape(c.attr("shape"))) if c.attr("head_dim") is not None else torch.empty_like(x)


@impl(TR, "conv_silu_norm", grad=False, derive=_conv_chain, args="int? head_dim, float eps, SymInt[]? shape",
      fake=_fake_conv_chain)
def _conv_silu_norm(c, x, w):
    """short_conv -> silu [-> reshape to heads -> l2norm] in one kernel (backends/triton/conv.py)."""
    hd = c.attr("head_dim")
    y = T.conv_silu_norm(x, w, head_dim=hd, eps=c.attr("eps"))
    return y.reshape(c.shape(c.attr("shape"))) if hd is not None else y


@impl(TR, "attn_residual+rmsnorm", grad=False, args="float eps",
      fake=lambda c, q, w, *r: fake_attn_residual(c, q, w, *r[:-1]))
def _attn_residual_norm(c, q, w, *rest):
    """attn_residual and the RMSNorm (same eps) of its output in one kernel (the kernel's output norm)."""
    *src, norm_w = rest
    return T.attn_residual(q, list(src), w, eps=c.attr("eps"), output_rms_weight=norm_w)


@impl(TR, "attn_residual_merge+rmsnorm", grad=False, args="int index, float eps",
      fake=lambda c, *a: fake_merge(c, *a[:-1]))
def _merge_norm(c, *args):
    """attn_residual_merge and the RMSNorm (same eps) of its output in one kernel."""
    *ins, norm_w = args
    return merge(T.attn_residual_merge, c, ins, output_rms_weight=norm_w)
