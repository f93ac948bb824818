"""The reference target's implementations of every graph op (plain float32 PyTorch), and the data-movement
ops every target shares (views cost nothing and launch no kernel)."""
from __future__ import annotations

import torch

from backends.registry import impl
from dsl.errors import MtcError

import backends.reference as R

REF = "reference"


def _mla_scores_bytes(c, shapes, elem) -> float:
    """What the reference mla_attention holds besides its output: float32 copies of q, k, v and the float32 output
    [B, H, T, D], and per query block (mla_query_rows) the scores, their masked copies and the softmax, float32
    [B, H, rows, T] each."""
    from .ops import mla_query_rows
    (B, T, H, dq), dv = shapes[0], shapes[2][3]
    rows = mla_query_rows(B, H, T)
    return 4.0 * B * H * T * (2 * dq + 2 * dv) + 4.0 * B * H * rows * T * 4


def _kda_chunk_bytes(c, shapes, elem) -> float:
    """What the reference kda_chunk allocates besides its output: its chunk tables, pairwise decays (in groups),
    per-chunk transitions and start states (backends/reference/kda.py kda_chunk_workspace)."""
    (B, T, H, K), V = shapes[0], shapes[2][3]
    return R.kda_chunk_workspace(B, T, H, K, V, in_bytes=elem(c.inputs[0][1]))


def _f32_copies(L, shapes, elem) -> float:
    """The elementwise reference ops compute in float32: a float32 copy of every 16-bit operand and of the result
    (before it is rounded to the output's dtype)."""
    def n(shape):
        out = 1
        for d in shape:
            out *= d
        return out
    ins = [(sh, t) for sh, (_r, t) in zip(shapes, L.inputs)]
    copies = sum(n(sh) * 4 for sh, t in ins if elem(t) < 4)
    out_t = L.outputs[0][1]
    return copies + (n([int(d) for d in shapes[0]]) * 4 if elem(out_t) < 4 else 0)


# -- fakes (backends/custom_ops.py): each op's outputs as empty tensors of the real ones' shapes, dtypes and strides
def like(i: int = 0, dtype=None):
    """fake: an output shaped and strided like input ``i`` (an elementwise result), in its dtype or ``dtype``."""
    return lambda c, *t: torch.empty_like(t[i], dtype=dtype)


def new(i: int = 0, dtype=None):
    """fake: a contiguous output of input ``i``'s shape, in its dtype or ``dtype``."""
    return lambda c, *t: t[i].new_empty(t[i].shape, dtype=dtype)


def fake_linear(c, x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def fake_conv(c, x, w):
    """short_conv's output: [B, T, C] laid out as the transpose of a contiguous [B, C, T] (its conv1d result)."""
    return x.new_empty((x.shape[0], x.shape[2], x.shape[1])).transpose(1, 2)


def fake_binary(c, a, b):
    return a.new_empty(torch.broadcast_shapes(a.shape, b.shape))


def fake_mla(c, q, k, v):
    return v.new_empty((*q.shape[:3], v.shape[3]))


def fake_route(c, x, w, b):
    n, k = x.shape[0], c.attr("top_k")
    f32 = dict(dtype=torch.float32, device=x.device)
    return (torch.empty((n, k), dtype=torch.int64, device=x.device), torch.empty((n, k), **f32),
            torch.empty((n, w.shape[0]), **f32))


def fake_glu(c, a, b):
    return torch.empty_like(a, dtype=torch.promote_types(a.dtype, b.dtype))


def fake_attn_residual(c, q, w, *src):
    return torch.empty(src[0].shape, dtype=src[0].dtype, device=src[0].device)


def fake_phase1(acc_dtype):
    """fake of attn_residual_phase1 (queries, norm weights, bank sources): acc [Q, ..., d] in acc_dtype(bank dtype),
    m and s [Q, ...] float32."""
    def fake(c, *a):
        Q = c.attr("n_queries")
        src = a[2 * Q]
        f32 = dict(dtype=torch.float32, device=src.device)
        return (torch.empty((Q, *src.shape), dtype=acc_dtype(src.dtype), device=src.device),
                torch.empty((Q, *src.shape[:-1]), **f32), torch.empty((Q, *src.shape[:-1]), **f32))
    return fake


def fake_merge(c, acc, m, s, q, w, *partial):
    return torch.empty(acc.shape[1:], dtype=partial[0].dtype if partial else q.dtype, device=acc.device)


impl(REF, "embedding", fake=lambda c, ids, w: w.new_empty((*ids.shape, w.shape[1])))(
    lambda c, ids, w: R.embedding(ids, w))
impl(REF, "linear", fake=fake_linear)(lambda c, x, w: R.linear(x, w))
impl(REF, "lm_head", fake=fake_linear)(lambda c, x, w: R.lm_head(x, w))
# (inplace: the elementwise ops and the row norms may write their output into an operand they no longer need, the
# row norms each row after reading it; backends/registry.py)
impl(REF, "rmsnorm", args="float eps", fake=like(), inplace={0: 0})(
    lambda c, x, w, out=None: R.rmsnorm(x, w, eps=c.attr("eps"), out=out))
impl(REF, "l2norm", args="float eps", fake=like(), inplace={0: 0})(
    lambda c, x, out=None: R.l2norm(x, eps=c.attr("eps"), out=out))
impl(REF, "short_conv", fake=fake_conv)(lambda c, x, w: R.short_conv(x, w)[0])
impl(REF, "silu", workspace=_f32_copies, fake=like(), inplace={0: 0})(lambda c, x, out=None: R.silu(x, out=out))
impl(REF, "sigmoid", workspace=_f32_copies, fake=like(), inplace={0: 0})(
    lambda c, x, out=None: R.sigmoid(x, out=out))
impl(REF, "add", workspace=_f32_copies, fake=fake_binary, inplace={0: (0, 1)})(
    lambda c, a, b, out=None: R.add(a, b, out=out))
impl(REF, "mul", workspace=_f32_copies, fake=fake_binary, inplace={0: (0, 1)})(
    lambda c, a, b, out=None: R.mul(a, b, out=out))
impl(REF, "kda_gate", args="float? lower_bound, str gate", fake=like(0, torch.float32))(
    lambda c, x, a, d: R.kda_gate(x, a, d, lower_bound=c.attr("lower_bound"), gate=c.attr("gate")))
impl(REF, "kda_chunk", args="float? scale", fake=new(2), workspace=_kda_chunk_bytes)(
    lambda c, q, k, v, g, b: R.kda_chunk(q, k, v, g, b, scale=c.attr("scale"))[0])
impl(REF, "mla_attention", workspace=_mla_scores_bytes, args="float? scale, bool causal", fake=fake_mla)(
    lambda c, q, k, v: R.mla_attention(q, k, v, scale=c.attr("scale"), causal=c.attr("causal")))
impl(REF, "qb_route", args="int top_k, float routed_scaling", fake=fake_route)(
    lambda c, x, w, b: R.qb_route(x, w, b, top_k=c.attr("top_k"), routed_scaling=c.attr("routed_scaling")))
impl(REF, "situ_glu", args="float beta_gate, float beta_up", fake=fake_glu, inplace={0: (0, 1)})(
    lambda c, a, b, out=None: R.situ_glu(a, b, beta_gate=c.attr("beta_gate"), beta_up=c.attr("beta_up"), out=out))
impl(REF, "moe_experts", args="str activation, float? beta_gate, float? beta_up", fake=like())(
    lambda c, x, i, w, w1, w3, w2: R.moe_experts(x, i, w, w1, w3, w2, activation=c.attr("activation"),
                                                 beta_gate=c.attr("beta_gate"), beta_up=c.attr("beta_up")))
impl(REF, "attn_residual", args="float eps", fake=fake_attn_residual)(
    lambda c, q, w, *src: R.attn_residual(q, list(src), w, eps=c.attr("eps")))


def phase1(fn, c, args, **kw):
    """attn_residual_phase1's graph inputs (n_queries queries, n_queries norm weights, the bank's sources) in the
    op's call form."""
    Q = c.attr("n_queries")
    return fn(torch.stack(args[:Q]), list(args[2 * Q:]), torch.stack(args[Q:2 * Q]), eps=c.attr("eps"), **kw)


def merge(fn, c, args, output_rms_weight=None):
    """attn_residual_merge's graph inputs (acc, m, s, query, norm weight[, partial]) in the op's call form; the
    output takes the activation dtype of the running module (that of the pseudo-query parameter)."""
    acc, m, s, q, w, *partial = args
    i = c.attr("index")
    return fn(acc[i], m[i], s[i], partial[0] if partial else None, q, w, eps=c.attr("eps"),
              out_dtype=partial[0].dtype if partial else q.dtype, output_rms_weight=output_rms_weight)


impl(REF, "attn_residual_phase1", args="int n_queries, float eps", fake=fake_phase1(lambda dt: torch.float32))(
    lambda c, *a: phase1(R.attn_residual_phase1, c, a))
impl(REF, "attn_residual_merge", args="int index, float eps", fake=fake_merge)(
    lambda c, *a: merge(R.attn_residual_merge, c, a))


# -- data movement: views of their input (reshape of a contiguous value, slice, broadcast) and concat -----------
VIEW = "view"


@impl(REF, "reshape", name="view.reshape")
def _reshape(c, x):
    return x.reshape(c.shape(c.attr("shape")))


@impl(REF, "slice", name="view.slice",
      meta=lambda n, types: {"dim": n.attr("dim"), "start": n.attr("start"), "end": n.attr("end")})
def _slice(c, x):
    dim, start, end = c.attr("dim"), c.attr("start"), c.attr("end")
    size = x.shape[dim]
    if end > size:                          # a symbolic dimension the spec could not bound
        raise MtcError(f"slice [{start}:{end}] needs dimension {c.in_types[0].shape[dim]} >= {end}, but this input "
                       f"has {size} there", c.loc)
    return x.narrow(dim, start, end - start)


@impl(REF, "broadcast", name="view.broadcast")
def _broadcast(c, x):
    return x.expand(c.shape(c.attr("shape")))


impl(REF, "concat")(lambda c, *xs: torch.cat(xs, dim=c.attr("dim")))
