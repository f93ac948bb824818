"""Register-tile helpers and host-side helpers shared by the KDA kernel stages."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..guard import interpreted, mark_phase

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _interpret():
    return interpreted()


def _interm_dtype(x):
    """The dtype of the per-token intermediates (WK, QG, KD, U, AQK, HB, ...): 16-bit inputs keep theirs."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _tile_dtype(idt):
    """The operand dtype of the anchored dense dots (the 16-row strips, the backward's pair kernel): the input
    dtype, but float32 for float16 inputs (TF32 dots on the GPU: float16's 10-bit mantissa with float32's range;
    the anchored factors e^(+-8 |lb|) and q, k of entries past ~3 overflow float16's 65504 ~ e^11.1 at the
    float16 bound, and their small side falls into its subnormals)."""
    return torch.float32 if idt == torch.float16 else idt


def _maxnreg(n):
    """Launch option dict for a register cap (ptxas maxnreg; dropped under the interpreter)."""
    return {} if n is None or _interpret() else dict(maxnreg=int(n))


def _mark(cfg, name):
    """A phase boundary for the benchmarks' phase timing (KdaConfig.profile)."""
    mark_phase(cfg.profile, name)


def _head_major(NC, cfg):
    """Whether the per-chunk kernels run head-major grids: the programs of one chunk's heads next to each other,
    so that concurrent programs read neighbouring parts of each token's [H, K] rows; the chunk index is then the
    grid's second axis, at most 65535 (KdaConfig.head_major_max_chunks), chunk-major past it."""
    return NC <= min(cfg.head_major_max_chunks, 65535)


def _ch_grid(NC, H, hm, S=1, Z=1):
    """The grid of a kernel that decodes its program with _chunk_head(hm, S): (NC, H, S * Z), or head-major
    (H * S, NC, Z); Z: a further axis of its own (S = 1 then), program_id(2) either way."""
    return (H * S, NC, Z) if hm else (NC, H, S * Z)


# ----------------------------------------------------------------------------------------------------
# register-tile helpers
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _get_rows(X, r, NB: tl.constexpr, BR: tl.constexpr, NC: tl.constexpr):
    """X [NB*BR, NC] -> rows r*BR .. r*BR+BR-1 as [BR, NC]."""
    X3 = tl.reshape(X, [NB, BR, NC])
    idx = tl.arange(0, NB)
    return tl.sum(tl.where(idx[:, None, None] == r, X3, 0.0), axis=0)


@triton.jit
def _put_rows(X, blk, r, NB: tl.constexpr, BR: tl.constexpr, NC: tl.constexpr):
    """X [NB*BR, NC] with rows r*BR.. replaced by blk [BR, NC]."""
    X3 = tl.reshape(X, [NB, BR, NC])
    idx = tl.arange(0, NB)
    X3 = tl.where(idx[:, None, None] == r, blk[None, :, :], X3)
    return tl.reshape(X3, [NB * BR, NC])


@triton.jit
def _add_cols(X, blk, r, NR: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr):
    """X [NR, NB*BC] plus blk [NR, BC] added into columns r*BC.."""
    X3 = tl.reshape(X, [NR, NB, BC])
    idx = tl.arange(0, NB)
    X3 = X3 + tl.where(idx[None, :, None] == r, blk[:, None, :], 0.0)
    return tl.reshape(X3, [NR, NB * BC])


@triton.jit
def _row_of(X, rows, i):
    return tl.sum(tl.where(rows[:, None] == i, X, 0.0), axis=0)


@triton.jit
def _diag_pair(a_r, b_r, G_r):
    """Safe diagonal tile: M[i,j] = sum_d a_id b_jd exp(G_id - G_jd) for j <= i (exponents <= 0)."""
    r16 = tl.arange(0, 16)
    M = tl.zeros([16, 16], dtype=tl.float32)
    for j in range(16):
        bj = _row_of(b_r, r16, j)
        Gj = _row_of(G_r, r16, j)
        e = tl.exp(tl.where(r16[:, None] >= j, G_r - Gj[None, :], float("-inf")))
        col = tl.sum(a_r * bj[None, :] * e, axis=1)
        M = tl.where(r16[None, :] == j, col[:, None], M)
    return M


# The dense diagonal tiles of the unbounded (safe) path: operands anchored at c - _DIAG_HALF, with c = G at or
# before the block's first row (every row's past), so a row whose G fell by at most 2 _DIAG_HALF since c in every
# channel has both exponents within [-_DIAG_HALF, _DIAG_HALF] (e^64 ~ 6e27: products of entries up to ~1e5 stay
# in float32 range); rows past that fall (a channel decaying by more than 8 nats a token on average) are summed
# token pair by token pair (_diag_pair, _diag_da, _diag_db).  Each row's choice reads only rows at or before it.
_DIAG_HALF = tl.constexpr(64.0)


@triton.jit
def _diag_exps(G_r, c, FTZ: tl.constexpr):
    """(e^(x), e^(-x), ok) for x = G_r - c + _DIAG_HALF [16, BK] (clamped to +-_DIAG_HALF) and ok [16] = the rows
    whose x stays >= -_DIAG_HALF in every channel (the dense tile is exact for them)."""
    x = G_r - c[None, :] + _DIAG_HALF
    ok = tl.min(x, axis=1) >= -_DIAG_HALF
    x = tl.minimum(tl.maximum(x, -_DIAG_HALF), _DIAG_HALF)
    return _ex(x, FTZ), _ex(-x, FTZ), ok


@triton.jit
def _diag_grads(dP, dB, q_r, k_r, G_r, c, FTZ: tl.constexpr):
    """The backward of the diagonal tile of intra.py's _safe_slice for P (a = q, b = k) and Bm (a = b = k) given
    their diagonal tiles' gradients dP, dB [16, 16] (entries above the diagonal ignored), c [BK] = G at or before
    the block's first row: (dq, dk_row, dk_col) [16, BK] with da_i = sum_{j<=i} dM_ij b_j e^(G_i - G_j) and db_j = sum_{i>=j} dM_ij a_i e^(G_i - G_j),
    as float32-accurate dots on the anchored operands; rows that fell too far (see _diag_exps) pair by pair."""
    ea, eb, ok = _diag_exps(G_r, c, FTZ)
    r16 = tl.arange(0, 16)
    keep = (r16[None, :] <= r16[:, None]) & ok[:, None]
    dPk = tl.where(keep, dP, 0.0)
    dBk = tl.where(keep, dB, 0.0)
    # tf32x3 (float32-accurate) dots: the row and column sides round their decay-scaled operands differently,
    # and dg, a reverse sum of a_i da_i - b_i db_i, is the small difference of such products (see _dt_split)
    kb = k_r * eb
    dq = ea * tl.dot(dPk, kb, input_precision="tf32x3")
    dkr = ea * tl.dot(dBk, kb, input_precision="tf32x3")
    dkc = eb * (tl.dot(tl.trans(dPk), q_r * ea, input_precision="tf32x3")
                + tl.dot(tl.trans(dBk), k_r * ea, input_precision="tf32x3"))
    if tl.min(ok.to(tl.int32), axis=0) == 0:
        bad = ~ok[:, None]
        dq = tl.where(ok[:, None], dq, _diag_da(dP, k_r, G_r))
        dkr = tl.where(ok[:, None], dkr, _diag_da(dB, k_r, G_r))
        dkc += _diag_db(tl.where(bad, dP, 0.0), q_r, G_r) + _diag_db(tl.where(bad, dB, 0.0), k_r, G_r)
    return dq, dkr, dkc


@triton.jit
def _diag_da(dM, b_r, G_r):
    """Safe diagonal tile backward, row side: da_i = sum_{j<=i} dM_ij b_j exp(G_i - G_j)."""
    r16 = tl.arange(0, 16)
    da = tl.zeros_like(b_r)
    for j in range(16):
        bj = _row_of(b_r, r16, j)
        Gj = _row_of(G_r, r16, j)
        e = tl.exp(tl.where(r16[:, None] >= j, G_r - Gj[None, :], float("-inf")))
        dmj = tl.sum(tl.where(r16[None, :] == j, dM, 0.0), axis=1)
        da += dmj[:, None] * bj[None, :] * e
    return da


@triton.jit
def _diag_db(dM, a_r, G_r):
    """Safe diagonal tile backward, column side: db_j = sum_{i>=j} dM_ij a_i exp(G_i - G_j)."""
    r16 = tl.arange(0, 16)
    db = tl.zeros_like(a_r)
    for j in range(16):
        Gj = _row_of(G_r, r16, j)
        e = tl.exp(tl.where(r16[:, None] >= j, G_r - Gj[None, :], float("-inf")))
        dmj = tl.sum(tl.where(r16[None, :] == j, dM, 0.0), axis=1)
        row = tl.sum(dmj[:, None] * a_r * e, axis=0)
        db = tl.where(r16[:, None] == j, row[None, :], db)
    return db


@triton.jit
def _dt(a, b, DT: tl.constexpr):
    """dot with both operands cast to DT (the input dtype: bf16/fp16 tensor cores, or float32)."""
    return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _mmp(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _put(ptr, x, t0, L, h, H, R: tl.constexpr, W: tl.constexpr, C0: tl.constexpr):
    """Store x [16, CW] into rows R*16.. and columns C0.. of one chunk of a [N, H, W] tensor."""
    rows = R * 16 + tl.arange(0, 16)
    d = C0 + tl.arange(0, x.shape[1])
    off = (t0 + rows).to(tl.int64)[:, None] * (H * W) + h * W + d[None, :]
    tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=(rows < L)[:, None])


@triton.jit
def _chunk_head(HM: tl.constexpr, S: tl.constexpr = 1):
    """(chunk, head, sub-program) of a per-(chunk, head) kernel with S programs per (chunk, head): grid (NC, H, S),
    or head-major (HM) (H * S, NC), a chunk's heads (and their S programs) next to each other (_ch_grid)."""
    if HM:
        c = tl.program_id(1)
        h = tl.program_id(0) // S
        sub = tl.program_id(0) % S
    else:
        c = tl.program_id(0)
        h = tl.program_id(1)
        sub = tl.program_id(2)
    return c, h, sub


@triton.jit
def _seg_range(seg_t0, seg_t1, seg_c0, seg_c1, s):
    """Segment s of the long-context split: (first token, end token) as int64 and (first chunk, end chunk)."""
    return (tl.load(seg_t0 + s).to(tl.int64), tl.load(seg_t1 + s).to(tl.int64), tl.load(seg_c0 + s),
            tl.load(seg_c1 + s))


@triton.jit
def _ex(x, FTZ: tl.constexpr):
    """e^x (float32). FTZ (on the GPU): the log2(e) multiply and one ex2.approx.ftz.f32 (MUFU.EX2); results below
    2^-126 flush to 0. tl.exp keeps denormal results, which costs a compare and two predicated multiplies per call
    on sm_90. Off under the interpreter (inline PTX)."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x)
