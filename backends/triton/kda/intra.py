"""Intra-chunk kernels: the in-chunk cumulative gate, the decay products Akk and P (strips), the solve
T = (I + diag(beta) Akk)^-1 (WY / UT representation) and Wk = T diag(beta) (k e^G), U = T diag(beta) v.

Per (chunk, head) of C = 64 tokens, in 16-row blocks:
* ``_chunk_cumsum_kernel``: G = the in-chunk cumulative gate (float32) and per-block flags: bit 0 = the block's
  gates are >= lb (its diagonal tile can be one dense dot), bit 1 = both blocks of a 32-row pair have bit 0 (the
  pair can be one dense 32-row strip; asked for only at lb >= ROWS32_LOWER_BOUND_LIMIT, where 32 gates fall by at
  most _SPAN32).
* ``_intra_strip32_kernel`` (a bound >= ROWS32_LOWER_BOUND_LIMIT is promised, bf16 / float32 inputs) or
  ``_intra_strip16_kernel`` (otherwise): the strips Akk[r] and P[r] [16, 64] of each row block r from one dense
  dot per channel slice with the anchored operands  x_i e^(G_i - c)  and  k_j e^(c - G_j).  Where the flags allow,
  the anchor is c = G before the block (pair) + lb ROWS / 2: every exponent within +-|lb| ROWS / 2, and nothing of
  the block's own rows in it, so that a row's results never depend on a later row (causal: changing a later
  token, or appending tokens to a partial chunk, leaves earlier outputs and their gradients bit for bit as they
  were).  Otherwise, and for the rows whose dense entries overflow (checked row by row, again causal), the anchor
  is G before the block (all exponents <= 0), and the diagonal 16x16 tile a second dense dot anchored 64 nats below
  it, token pair by token pair on the rows that fell too far for that (_safe_slice; in the 32-row kernel's 16-row
  blocks, always pair by pair).  They
  also store QG = scale q e^G, KD = k e^(G_C - G), GAM = e^(G_C) and KGB = diag(beta) k e^G (into WK's buffer).
* ``_wy_solve_kernel``: T by inverting the diagonal 16x16 tiles and blocked forward substitution.
* ``_wy_apply_kernel``: Wk = T KGB, U = T diag(beta) V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (_TL, _add_cols, _ch_grid, _chunk_head, _DIAG_HALF, _diag_exps, _diag_pair, _ex, _head_major, _interpret,
                     _mark, _maxnreg, _mmp, _put, _tile_dtype)

# _intra_strip32_kernel's dense 32-row pairs: G may fall by at most this much across a pair (exponents within
# +-80.5 about the anchor G before the pair + 16 lb); 32 gates at the bound -5 fall by 160, the slack absorbs the
# rounding of the float32 G.  The host runs them only where the bound itself keeps that: lb >= -_SPAN32 / 32
_SPAN32 = 161.0
ROWS32_LOWER_BOUND_LIMIT = -_SPAN32 / 32


@triton.jit
def _chunk_cumsum_kernel(g, cstart, clen, GCS, FB, lb, H, K: tl.constexpr, FAST: tl.constexpr,
                         ROWS32: tl.constexpr = False, NS: tl.constexpr = 1, HM: tl.constexpr = False):
    """One (chunk, head): GCS = the in-chunk cumulative gate G (float32 [N, H, K]; rows past the chunk's end
    not written) and FB[c, h, r] = 1 when every g of 16-row block r (all K channels) is >= lb (the dense
    diagonal tile is in range), else 0 (always 0 without FAST); ROWS32: plus 2 in both blocks of a 32-row pair
    when both have bit 0 (_intra_strip32_kernel's dense pair; the host asks for it only where the bound keeps the
    pair's exponents within +-16 |lb| <= 80.5).
    NS: grid (NC, H, NS), each program one slice of K / NS channels; FB [NC, H, NS * 4] then holds each slice's
    flags at s * 4 + r (_fb ANDs them).  HM (head-major): grid (H * NS, NC) instead."""
    c_, h, sl = _chunk_head(HM, NS)
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    rows = tl.arange(0, 64)
    if NS == 1:
        dk = tl.arange(0, K)
    else:
        dk = sl * (K // NS) + tl.arange(0, K // NS)
    off = (t0.to(tl.int64) * H + h) * K + rows[:, None] * (H * K) + dk[None, :]
    m = (rows < L)[:, None]
    gg = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
    Gc = tl.cumsum(gg, axis=0)
    tl.store(GCS + off, Gc, mask=m)
    r4 = tl.arange(0, 4)
    if FAST:
        low = tl.min(tl.reshape(gg, [4, 16 * (K // NS)]), axis=1)       # padded rows read 0 >= lb
        fb = (low >= lb).to(tl.int32)
        if ROWS32:
            # bit 1 in both blocks of a 32-row pair when both have bit 0 (the host asks for ROWS32 only at
            # lb >= ROWS32_LOWER_BOUND_LIMIT, where G then falls by at most 32 |lb| <= _SPAN32 across the pair)
            okp = tl.min(tl.reshape(fb, [2, 2]), axis=1)
            fb += 2 * tl.reshape(tl.broadcast_to(okp[:, None], [2, 2]), [4])
    else:
        fb = tl.zeros([4], dtype=tl.int32)
    tl.store(FB + (tl.cast(c_, tl.int64) * H + h) * (4 * NS) + sl * 4 + r4, fb)


@triton.jit
def _fb(FB, c_, h, H, r, NS: tl.constexpr):
    """The flags of 16-row block r of chunk c_, head h from _chunk_cumsum_kernel's FB [NC, H, NS * 4]: the AND
    over its NS channel slices."""
    ptr = FB + (tl.cast(c_, tl.int64) * H + h) * (4 * NS) + r
    f = tl.load(ptr)
    for s in tl.static_range(1, NS):
        f = f & tl.load(ptr + 4 * s)
    return f


@triton.jit
def _strip_rows(cstart, clen, c_, h, R, H, K: tl.constexpr, ROWS: tl.constexpr = 16):
    """The row geometry of strip program (chunk c_, head h, row block R of ROWS rows): (t0, L, rows64, rows, base,
    m64, mr) = chunk start and length, the chunk's 64 rows and the block's ROWS, the 64-bit element base of
    (t0, h) and the in-chunk row masks of both."""
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    rows64 = tl.arange(0, 64)
    rows = R * ROWS + tl.arange(0, ROWS)
    base = (t0.to(tl.int64) * H + h) * K                 # 64-bit scalar base, 32-bit offsets in the chunk
    return t0, L, rows64, rows, base, (rows64 < L)[:, None], (rows < L)[:, None]


@triton.jit
def _strip_slice(a, p, qr, kr, k64, G64, Gr, GC, cl, lb, fr, R, rows64, orr, mr, d, base, QG, KD, GAM, c_, h, H,
                 scale, K: tl.constexpr, DT: tl.constexpr, FTZ: tl.constexpr = False, ROWS: tl.constexpr = 16,
                 DENSE_DIAG: tl.constexpr = True):
    """One channel slice of a strip program, given the slice's operands and cumulative gates: G64 [64, BK] of the
    chunk, Gr [ROWS, BK] of row block R, GC / cl [BK] at the chunk's last row / before the block, lb the promised
    bound, fr = 1 when the block is dense (its gates are >= lb; always 1 for ROWS = 32).  The anchor c: cl for the
    safe path (every exponent <= 0), else cl + lb ROWS / 2, which needs nothing of the block's own rows (causal:
    a row's result never depends on a later row's gate) and puts every exponent within +-|lb| ROWS / 2, as the
    gates of the block fall by at most |lb| ROWS below cl.  Adds the slice's share to the strips a (Akk) and p (P)
    [ROWS, 64] and stores its QG, KD (and GAM for R = 0); returns (a, p, e^Gr). FTZ: the exponentials through
    _ex's flush-to-zero form (GPU only).  A safe block (fr = 0) runs _safe_slice (DENSE_DIAG: the 16-row strip
    kernel's blocks, where no bound is promised or float16) or, in _intra_strip32_kernel's 16-row blocks (a
    promised bound broken in a block, a rare case), its diagonal tile token pair by token pair: that kernel's
    registers stay those of its dense pairs."""
    if ROWS == 16:
        c = cl + 8.0 * lb * fr
    else:
        c = cl + 16.0 * lb
    er = _ex(Gr - c[None, :], FTZ)
    if DENSE_DIAG and ROWS == 16 and fr == 0:
        a, p = _safe_slice(a, p, qr, kr, k64, G64, Gr, cl, er, R, rows64, DT, FTZ)
    else:
        # the strictly earlier tiles: one DT dot (decayed entries: their operands' rounding barely shows)
        col = (k64 * _ex(tl.where(rows64[:, None] < R * ROWS, c[None, :] - G64, float("-inf")), FTZ)).to(DT)
        ka = kr * er
        qa = qr * er
        a += tl.dot(ka.to(DT), tl.trans(col))
        p += tl.dot(qa.to(DT), tl.trans(col))
        if ROWS == 16 and fr == 0:
            a = _add_cols(a, _diag_pair(kr, kr, Gr), R, 16, 4, 16)
            p = _add_cols(p, _diag_pair(qr, kr, Gr), R, 16, 4, 16)
        else:
            # the dense diagonal tile, which holds the largest entries (e^0 at i = j, and with decaying gates
            # nearly all of a row's weight): float32 operands in a TF32 dot (10-bit mantissa), as bf16 operands
            # rounded both anchored factors to 2^-9 and made every gradient ~1.3x less accurate than fla's,
            # which sums its diagonal tiles in float32
            cd = kr * _ex(c[None, :] - Gr, FTZ)
            a = _add_cols(a, tl.dot(ka, tl.trans(cd), input_precision="tf32"), R, ROWS, 64 // ROWS, ROWS)
            p = _add_cols(p, tl.dot(qa, tl.trans(cd), input_precision="tf32"), R, ROWS, 64 // ROWS, ROWS)
    eG = _ex(Gr, FTZ)
    tl.store(QG + base + orr, (qr * eG * scale).to(QG.dtype.element_ty), mask=mr)
    tl.store(KD + base + orr, (kr * _ex(GC[None, :] - Gr, FTZ)).to(KD.dtype.element_ty), mask=mr)
    if R == 0:
        tl.store(GAM + (tl.cast(c_, tl.int64) * H + h) * K + d, tl.exp(GC))
    return a, p, eG


@triton.jit
def _safe_slice(a, p, qr, kr, k64, G64, Gr, cl, er, R, rows64, DT: tl.constexpr, FTZ: tl.constexpr):
    """_strip_slice's share of a 16-row block R without a usable bound (any g <= 0): the strictly earlier tiles on
    operands anchored at cl = G before the block (every exponent <= 0: er = e^(Gr - cl) from the caller), the
    diagonal tile on operands anchored at cd = cl - _DIAG_HALF (exponents within +-_DIAG_HALF on the rows whose G
    fell by at most 2 _DIAG_HALF since cl in every channel), as two dense dots sharing one exponential per column
    element; the diagonal entries of rows that fell further, or whose dense entries overflowed, are summed token
    pair by token pair (_diag_pair).  Every row's choice reads only rows at or before it."""
    cd = cl - _DIAG_HALF
    er2, _, ok = _diag_exps(Gr, cl, FTZ)        # (the backward's _diag_grads takes the same rule)
    early = rows64[:, None] < R * 16
    inb = (rows64[:, None] >= R * 16) & (rows64[:, None] < R * 16 + 16)
    xc = tl.where(early, cl[None, :] - G64, tl.where(inb, tl.minimum(cd[None, :] - G64, _DIAG_HALF), float("-inf")))
    col = k64 * _ex(xc, FTZ)
    colA = tl.trans(tl.where(early, col, 0.0).to(DT))
    # (DT: bf16 or float32; float16 inputs run float32 operands, _tile_dtype, which hold e^_DIAG_HALF)
    colB = tl.trans(tl.where(inb, col, 0.0).to(DT))
    # the earlier tiles (colA: columns before the block, all causal, exponents <= 0) and the diagonal tile (colB)
    # as separate dots: a row whose diagonal operand overflows (inf there, inf * 0 = NaN in every column of its dot)
    # keeps its earlier tiles
    dga = tl.dot((kr * er2).to(DT), colB)
    dgp = tl.dot((qr * er2).to(DT), colB)
    rows = R * 16 + tl.arange(0, 16)
    cols = tl.arange(0, 64)
    diag = (cols[None, :] >= R * 16) & (cols[None, :] < R * 16 + 16) & (cols[None, :] <= rows[:, None])
    # a row whose causal diagonal entries overflowed (|q| or |k| entries beyond ~e^(88 - _DIAG_HALF)) also goes
    # pair by pair (exponents <= 0 there: the safe path never overflows for finite products q_i k_j)
    fin = ((tl.abs(dga) < float("inf")) & (tl.abs(dgp) < float("inf"))) | ~diag
    ok = ok & (tl.min(fin.to(tl.int32), axis=1) != 0)
    # (entries above the diagonal, where e^(G_i - G_j) > 1 may overflow, and the far-fallen rows' diagonal dropped)
    keep = diag & ok[:, None]
    sa = tl.dot((kr * er).to(DT), colA) + tl.where(keep, dga, 0.0)
    sp = tl.dot((qr * er).to(DT), colA) + tl.where(keep, dgp, 0.0)
    if tl.min(ok.to(tl.int32), axis=0) == 0:
        far = ~ok[:, None]
        sa = _add_cols(sa, tl.where(far, _diag_pair(kr, kr, Gr), 0.0), R, 16, 4, 16)
        sp = _add_cols(sp, tl.where(far, _diag_pair(qr, kr, Gr), 0.0), R, 16, 4, 16)
    return a + sa, p + sp


@triton.jit
def _strip_store(NB, AQK, beta, t0, L, h, H, rows, mr, a, p, scale, BM, SAVE_B: tl.constexpr):
    """A strip program's outputs: NB = diag(beta) Akk (strictly lower) and AQK = scale P (lower incl. the
    diagonal) for the rows of its block where mr; with SAVE_B also BM = Akk before beta (for the backward)."""
    bb = tl.load(beta + (t0.to(tl.int64) * H + h) + rows * H, mask=rows < L, other=0.0).to(tl.float32)
    cols = tl.arange(0, 64)
    ob = (t0.to(tl.int64) * H + h) * 64 + rows[:, None] * (H * 64) + cols[None, :]
    a = tl.where(cols[None, :] < rows[:, None], a, 0.0)
    tl.store(NB + ob, (a * bb[:, None]).to(NB.dtype.element_ty), mask=mr)
    if SAVE_B:
        tl.store(BM + ob, a, mask=mr)
    tl.store(AQK + ob, (tl.where(cols[None, :] <= rows[:, None], p, 0.0) * scale).to(AQK.dtype.element_ty),
             mask=mr)


@triton.jit
def _strip_block(q, k, GCS, fr, beta, cstart, clen, c_, R, h, NB, QG, KD, AQK, GAM, scale, lb, H, K: tl.constexpr,
                 BK: tl.constexpr, DT: tl.constexpr, BM, SAVE_B: tl.constexpr, KGB, FTZ: tl.constexpr, todo,
                 ROWS: tl.constexpr = 16, CHECK: tl.constexpr = True,
                 DENSE_DIAG: tl.constexpr = True):
    """The strip kernels' work for row block R (ROWS = 16 or 32 rows) of chunk c_ and head h, stored for the rows
    whose bits are set in todo (int32 scalar, bit i = row R * ROWS + i).  ROWS = 16: fr = 1 when the block's gates
    are >= lb (the dense diagonal tile, anchor cl + 8 lb: exponents within +-8 |lb|), 0 for the safe path.
    ROWS = 32 (fr = 1): a dense pair (FB bit 1; lb >= ROWS32_LOWER_BOUND_LIMIT), anchor cl + 16 lb, so
    |G_i - c| <= 16 |lb| <= 80.5 on its rows (e^80.5 ~ 9e34, within float32 / bf16 range), and every causal
    tile of the strip, the two diagonal 16x16 tiles and the one between them included, is one dense
    [32, BK] x [BK, 64] dot.  Loads only the column-operand rows
    that the block uses (rows < R * ROWS + ROWS; the others are masked to 0 in the dot anyway) and also stores
    KGB = diag(beta) (k e^G) (input dtype) for the block's rows, the w/u kernel's operand (as QG, KD, GAM: the
    same values whichever path, so a redo may store them again).
    Returns the rows of todo left undone (bits as todo): with CHECK, on a dense path, those whose causal entries
    came out inf / NaN (the anchored factors up to e^(|lb| ROWS / 2) overflow with |q| or |k| entries beyond
    ~e^(88 - |lb| ROWS / 2); never a wrong finite value), not stored; each row's own entries decide it, so the
    choice is causal too.  Without CHECK every row of todo is stored."""
    t0, L, rows64, rows, base, m64, mr = _strip_rows(cstart, clen, c_, h, R, H, K, ROWS)
    m64 = m64 & (rows64 < R * ROWS + ROWS)[:, None]
    bkg = tl.load(beta + (t0.to(tl.int64) * H + h) + rows * H, mask=rows < L, other=0.0).to(tl.float32)
    # rows past the chunk's end have G = G of its last row (as a scan of zero-padded gates gives)
    last = L - 1
    row_lo = tl.minimum(R * ROWS - 1, last)
    row_hi = tl.minimum(R * ROWS + ROWS - 1, last)
    a = tl.zeros([ROWS, 64], dtype=tl.float32)
    p = tl.zeros([ROWS, 64], dtype=tl.float32)
    for ks in range(0, K, BK):
        d = ks + tl.arange(0, BK)
        o64 = rows64[:, None] * (H * K) + d[None, :]
        orr = rows[:, None] * (H * K) + d[None, :]
        G64 = tl.load(GCS + base + o64, mask=m64, other=0.0)
        k64 = tl.load(k + base + o64, mask=m64, other=0.0).to(tl.float32)
        kr = tl.load(k + base + orr, mask=mr, other=0.0).to(tl.float32)
        qr = tl.load(q + base + orr, mask=mr, other=0.0).to(tl.float32)
        # `!= 0` keeps a mask with a scalar term bool under the triton 3.9 interpreter (its loads and stores take
        # only bool masks, and it broadcasts a scalar comparison as int32); the compiler folds it away
        cl = tl.load(GCS + base + row_lo * (H * K) + d, mask=((R > 0) & (d < K)) != 0, other=0.0)
        ch = tl.load(GCS + base + row_hi * (H * K) + d)
        GC = tl.load(GCS + base + last * (H * K) + d)
        Gr = tl.load(GCS + base + orr, mask=mr, other=0.0)
        Gr = tl.where(mr, Gr, ch[None, :])
        a, p, eG = _strip_slice(a, p, qr, kr, k64, G64, Gr, GC, cl, lb, fr, R, rows64, orr, mr, d, base, QG, KD,
                                GAM, c_, h, H, scale, K, DT, FTZ, ROWS, DENSE_DIAG)
        tl.store(KGB + base + orr, (kr * eG * bkg[:, None]).to(KGB.dtype.element_ty), mask=mr)
    bit = tl.arange(0, ROWS)
    if CHECK:
        cols = tl.arange(0, 64)
        fin = (tl.abs(a) < float("inf")) & (tl.abs(p) < float("inf"))
        fin = tl.where(cols[None, :] <= rows[:, None], fin, True)
        ok = tl.min(fin.to(tl.int32), axis=1) != 0
        if ROWS == 16:
            ok = ok | (fr == 0)                         # (the safe path never redoes a row)
    else:
        ok = bit >= 0
    want = ((todo >> bit) & 1) != 0
    _strip_store(NB, AQK, beta, t0, L, h, H, rows, mr & (want & ok)[:, None], a, p, scale, BM, SAVE_B)
    return tl.sum(tl.where(want & (ok == 0), 1, 0) << bit, axis=0)


@triton.jit
def _intra_strip16_kernel(q, k, GCS, FB, beta, cstart, clen, NB, QG, KD, AQK, GAM, scale, lb, H,
                          K: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, BM, SAVE_B: tl.constexpr, KGB,
                          FTZ: tl.constexpr, NS: tl.constexpr, DENSE: tl.constexpr = True):
    """One (chunk, head, 16-row block R), from the cumulative gate GCS and the flags FB of _chunk_cumsum_kernel:
    NB[rows of R] = diag(beta) Akk (strictly lower, 64 columns), AQK[rows of R] = scale P (lower incl. the
    diagonal), QG, KD and KGB for the rows of R, GAM (R = 0 only); with SAVE_B also BM = Akk before beta.  When
    FB bit 0 says the block's gates are >= lb, one dense [16, BK] x [BK, 64] dot covers every causal tile, the
    diagonal one included, with the anchor c = G before the block + 8 lb (exponents within +-8 |lb|); rows whose
    entries overflow there (|q| or |k| entries beyond ~e^(88 - 8 |lb|)) and blocks without the bit take the safe
    path (_safe_slice: the earlier tiles anchored at G before the block, exponents <= 0; the diagonal tile a second
    dense dot, pair by pair on the rows that fell too far for it).
    Grid (4 NC, H): the 4 row blocks of a chunk as consecutive programs, so that the [64, K] column operands (k, G)
    the 4 programs each load are still in L2 for 3 of them.  FTZ: the dense path's exponentials as
    ex2.approx.ftz (see _ex; GPU only).  NS: the cumsum kernel's channel slices (FB [NC, H, NS * 4], ANDed by
    _fb).  DT: the dots' operand dtype (float32 for float16 inputs: TF32 holds float16's mantissa with
    float32's range, which the anchored factors need).  DENSE = False (no bound promised): the safe path only."""
    c_ = tl.program_id(0) // 4
    R = tl.program_id(0) % 4
    h = tl.program_id(1)
    if not DENSE:
        # no bound promised: every block on the safe path, compiled without the dense path and its redo (the
        # kernel's registers are the safe path's alone)
        _strip_block(q, k, GCS, 0, beta, cstart, clen, c_, R, h, NB, QG, KD, AQK, GAM, scale, lb, H, K, BK, DT,
                     BM, SAVE_B, KGB, FTZ, tl.full([], 0xFFFF, tl.int32), 16, False)
        return
    # (fr as a literal in each call: every inlined _strip_block is compiled for one path only)
    left = tl.full([], 0xFFFF, tl.int32)
    if (_fb(FB, c_, h, H, R, NS) & 1) != 0:
        left = _strip_block(q, k, GCS, 1, beta, cstart, clen, c_, R, h, NB, QG, KD, AQK, GAM, scale, lb, H, K, BK,
                            DT, BM, SAVE_B, KGB, FTZ, left)
    if left != 0:
        # a block without the bit, or the rows whose dense entries overflowed: the safe path
        _strip_block(q, k, GCS, 0, beta, cstart, clen, c_, R, h, NB, QG, KD, AQK, GAM, scale, lb, H, K, BK, DT,
                     BM, SAVE_B, KGB, FTZ, left, 16, False)


@triton.jit
def _intra_strip32_kernel(q, k, GCS, FB, beta, cstart, clen, NB, QG, KD, AQK, GAM, scale, lb, H,
                          K: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, BM, SAVE_B: tl.constexpr, KGB,
                          FTZ: tl.constexpr, NS: tl.constexpr, HM: tl.constexpr):
    """_intra_strip16_kernel's outputs with one program per (chunk, head, 32-row pair RR): grid (2 NC, H) (HM,
    head-major: (2 H, NC)), the two pairs of a chunk as consecutive programs.  When FB bit 1 says both blocks keep
    the bound, it is one dense 32-row strip (_strip_block with ROWS = 32, anchor G before the pair + 16 lb: the
    [64, BK] column operand k_j e^(c - G_j) and its exponentials are formed twice per chunk instead of four
    times); otherwise, and for the rows whose entries overflow that strip (|q| or |k| entries beyond ~3e3; only
    those rows), its two 16-row blocks run as in _intra_strip16_kernel, one after the other, each dense or safe by
    its own FB bit 0 (without the 16-row kernel's overflow redo: see below)."""
    if HM:
        c_ = tl.program_id(1)
        h = tl.program_id(0) // 2
    else:
        c_ = tl.program_id(0) // 2
        h = tl.program_id(1)
    RR = tl.program_id(0) % 2
    f0 = _fb(FB, c_, h, H, 2 * RR, NS)
    todo = tl.full([], -1, tl.int32)                  # the pair's rows not stored yet, one bit each
    if (f0 & 2) != 0:
        todo = _strip_block(q, k, GCS, 1, beta, cstart, clen, c_, RR, h, NB, QG, KD, AQK, GAM, scale, lb, H, K, BK,
                            DT, BM, SAVE_B, KGB, FTZ, todo, 32)
    # (also keeps the 16-row blocks' work below from being scheduled into the dense pair's: fewer registers)
    tl.debug_barrier()
    if todo != 0:
        # one block after the other, each dense or safe by its FB bit 0, stored as they come out: the 16-row
        # dense factors reach e^(8 |lb|) <= e^40.25 here, so only |q| or |k| entries beyond ~e^48 (1e21) overflow
        # them (to inf / NaN: check_finite's result check names it)
        f1 = _fb(FB, c_, h, H, 2 * RR + 1, NS)
        _strip_block(q, k, GCS, f0 & 1, beta, cstart, clen, c_, 2 * RR, h, NB, QG, KD, AQK, GAM, scale, lb, H, K, BK,
                     DT, BM, SAVE_B, KGB, FTZ, todo & 0xFFFF, 16, False, False)
        _strip_block(q, k, GCS, f1 & 1, beta, cstart, clen, c_, 2 * RR + 1, h, NB, QG, KD, AQK, GAM, scale, lb, H, K,
                     BK, DT, BM, SAVE_B, KGB, FTZ, (todo >> 16) & 0xFFFF, 16, False, False)


@triton.jit
def _inv16p(N, PREC: tl.constexpr):
    """(I + N)^-1 for a strictly lower-triangular N [16, 16] (float32), by recursive block doubling:
    with T the inverse of the diagonal s-blocks, the inverse of the 2s-blocks is T - T (N restricted to
    the lower-left s-blocks inside each 2s-block) T.  Eight 16x16 products (tl.dot input precision PREC),
    no per-row loop."""
    i = tl.arange(0, 16)
    lower1 = ((i[:, None] // 2) == (i[None, :] // 2)) & (i[:, None] > i[None, :])
    T = tl.where(i[:, None] == i[None, :], 1.0, 0.0) - tl.where(lower1, N, 0.0)
    for lvl in tl.static_range(1, 4):
        m = ((i[:, None] >> (lvl + 1)) == (i[None, :] >> (lvl + 1))) & ((i[:, None] >> lvl) > (i[None, :] >> lvl))
        Nm = tl.where(m, N, 0.0)
        T = T - tl.dot(tl.dot(T, Nm, input_precision=PREC), T, input_precision=PREC)
    return T


@triton.jit
def _tile16(ptr, t0, L, h, H, R: tl.constexpr, C: tl.constexpr):
    """The 16x16 tile (row block R, column block C) of one chunk of a [N, H, 64] float32 tensor."""
    r16 = tl.arange(0, 16)
    rows = R * 16 + r16
    off = (t0.to(tl.int64) * H + h) * 64 + rows[:, None] * (H * 64) + C * 16 + r16[None, :]
    return tl.load(ptr + off, mask=(rows < L)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _wy_solve_kernel(NB, cstart, clen, TB, H, PREC: tl.constexpr, HM: tl.constexpr):
    """One (chunk, head): TB = T = (I + N)^-1 (the 10 lower 16x16 tiles) from N = NB (float32 or bfloat16,
    computed in float32), by inverting the diagonal tiles (_inv16p) and blocked forward substitution
    T_rj = -T_rr sum_{j<=m<r} N_rm T_mj.  PREC: the 16x16 products' tl.dot input precision ("ieee": float32 FMAs;
    "tf32x3": three TF32 tensor-core products, about float32 accuracy; "tf32": one, inputs rounded to 10 mantissa
    bits)."""
    c_, h, _ = _chunk_head(HM)
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    T00 = _inv16p(_tile16(NB, t0, L, h, H, 0, 0), PREC)
    T11 = _inv16p(_tile16(NB, t0, L, h, H, 1, 1), PREC)
    N10 = _tile16(NB, t0, L, h, H, 1, 0)
    T10 = -_mmp(T11, _mmp(N10, T00, PREC), PREC)
    _put(TB, T00, t0, L, h, H, 0, 64, 0)
    _put(TB, T10, t0, L, h, H, 1, 64, 0)
    _put(TB, T11, t0, L, h, H, 1, 64, 16)
    T22 = _inv16p(_tile16(NB, t0, L, h, H, 2, 2), PREC)
    N21 = _tile16(NB, t0, L, h, H, 2, 1)
    N20 = _tile16(NB, t0, L, h, H, 2, 0)
    T21 = -_mmp(T22, _mmp(N21, T11, PREC), PREC)
    T20 = -_mmp(T22, _mmp(N20, T00, PREC) + _mmp(N21, T10, PREC), PREC)
    _put(TB, T20, t0, L, h, H, 2, 64, 0)
    _put(TB, T21, t0, L, h, H, 2, 64, 16)
    _put(TB, T22, t0, L, h, H, 2, 64, 32)
    T33 = _inv16p(_tile16(NB, t0, L, h, H, 3, 3), PREC)
    N32 = _tile16(NB, t0, L, h, H, 3, 2)
    N31 = _tile16(NB, t0, L, h, H, 3, 1)
    N30 = _tile16(NB, t0, L, h, H, 3, 0)
    T32 = -_mmp(T33, _mmp(N32, T22, PREC), PREC)
    T31 = -_mmp(T33, _mmp(N31, T11, PREC) + _mmp(N32, T21, PREC), PREC)
    T30 = -_mmp(T33, _mmp(N30, T00, PREC) + _mmp(N31, T10, PREC) + _mmp(N32, T20, PREC), PREC)
    _put(TB, T30, t0, L, h, H, 3, 64, 0)
    _put(TB, T31, t0, L, h, H, 3, 64, 16)
    _put(TB, T32, t0, L, h, H, 3, 64, 32)
    _put(TB, T33, t0, L, h, H, 3, 64, 48)


@triton.jit
def _wy_apply_kernel(KGB, v, beta, cstart, clen, TB, WK, U, H, K: tl.constexpr, V: tl.constexpr,
                     DT: tl.constexpr, HM: tl.constexpr):
    """One (chunk, head): Wk = T KGB, U = T (beta v) with T [64, 64] from _wy_solve_kernel (lower
    block-triangular; the blocks above the diagonal are never written and are masked here; float32 or the input
    dtype: it is rounded to the input dtype for the dots either way) and KGB = diag(beta) k e^G from the strip
    kernels (WK's own buffer: each program reads its chunk's rows before it writes them)."""
    c_, h, _ = _chunk_head(HM)
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    rows = tl.arange(0, 64)
    rm = rows < L
    tok = (t0.to(tl.int64) * H + h)
    bb = tl.load(beta + tok + rows * H, mask=rm, other=0.0).to(tl.float32)
    T = tl.load(TB + tok * 64 + rows[:, None] * (H * 64) + rows[None, :],
                mask=rm[:, None] & ((rows[None, :] // 16) <= (rows[:, None] // 16)), other=0.0)
    T = T.to(DT)
    # [64, K] / [64, V] tiles of the chunk's rows (rows past L masked: zero loads, no stores), 64-bit offsets:
    # plain pointers, as the compiler rewrites block pointers (triton 3.9 removed tl.make_block_ptr)
    rows64 = rows.to(tl.int64)[:, None]
    ok = tok * K + rows64 * (H * K) + tl.arange(0, K)[None, :]
    ov = tok * V + rows64 * (H * V) + tl.arange(0, V)[None, :]
    m2 = rm[:, None]
    kg = tl.load(KGB + ok, mask=m2, other=0.0).to(DT)
    tl.store(WK + ok, tl.dot(T, kg).to(WK.dtype.element_ty), mask=m2)
    vb = (tl.load(v + ov, mask=m2, other=0.0).to(tl.float32) * bb[:, None]).to(DT)
    tl.store(U + ov, tl.dot(T, vb).to(U.dtype.element_ty), mask=m2)


# ----------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------
def _solve_prec(cfg, fwd_only=False):
    """tl.dot input precision of the solve kernel: cfg.solve_prec, or cfg.solve_prec_fwd for a forward that keeps
    no T for the backward (fwd_only); "ieee" under the interpreter."""
    if _interpret():
        return "ieee"
    return cfg.solve_prec_fwd if fwd_only else cfg.solve_prec


def _cumsum_slices(K, cfg):
    """Channel slices of _chunk_cumsum_kernel (cfg.cumsum_slices, at most K / 16 and dividing K)."""
    ns = int(cfg.cumsum_slices or 1)
    while ns > 1 and (K % ns or K // ns < 16):
        ns //= 2
    return max(ns, 1)


def _intra_scratch(rows, NC, H, K, idt, save_b, dev, cfg):
    """The intra kernels' scratch for `rows` tokens and NC chunks: (NBUF [rows, H, 64], GCS [rows, H, K] float32,
    FB [NC, H, 4 * _cumsum_slices(K)] int32, TB [rows, H, 64], BM [rows, H, 64] float32 with save_b, else None).
    save_b (autograd: the backward reads T and BM) keeps N and T in float32; without it, 16-bit inputs pass N in
    bfloat16 (the solve's products round it to TF32 anyway) and T is in the input dtype (the w/u kernel rounds it to
    that dtype for its dots anyway)."""
    tdt = torch.float32 if save_b else idt
    ndt = torch.float32 if save_b or idt == torch.float32 else torch.bfloat16
    return (torch.empty(rows, H, 64, dtype=ndt, device=dev),
            torch.empty(rows, H, K, dtype=torch.float32, device=dev),
            torch.empty(NC, H, 4 * _cumsum_slices(K, cfg), dtype=torch.int32, device=dev),
            torch.empty(rows, H, 64, dtype=tdt, device=dev),
            torch.empty(rows, H, 64, dtype=torch.float32, device=dev) if save_b else None)


def _intra_launch(q2, k2, g2, b2, cstart, clen, NC, H, K, scale, lb, fast, idt, QG, KD, AQK, GAM, FB, NBUF, GCS, TB,
                  BM, KGB, cfg, marks=True):
    """The cumsum, strip and solve launches over the NC chunks of the tables cstart / clen (a slice of a chunk
    table is a range of chunks): the token-indexed outputs go to their tokens' rows, the chunk-indexed ones (GAM,
    FB [NC, H, ...]) to rows 0 .. NC-1 of the given tensors.  BM: Akk before beta for the backward, or None.
    marks: record the phase boundaries (cfg.profile)."""
    mark = (lambda name: _mark(cfg, name)) if marks else (lambda name: None)
    # the dense 32-row pairs where a promised bound keeps their factors within e^(16 |lb|) <= e^80.5 (not float16)
    rows32 = fast and idt != torch.float16 and lb >= ROWS32_LOWER_BOUND_LIMIT
    ns = FB.shape[-1] // 4
    hm = _head_major(NC, cfg)
    _chunk_cumsum_kernel[_ch_grid(NC, H, hm, ns)](g2, cstart, clen, GCS, FB, lb, H, K=K, FAST=fast, ROWS32=rows32,
                                                  NS=ns, HM=hm, num_warps=cfg.nw_cumsum, num_stages=1)
    mark("intra: cumsum")
    save_b = BM is not None
    common = dict(NS=ns, BM=BM if save_b else NBUF, SAVE_B=save_b, KGB=KGB, FTZ=not _interpret())
    if rows32:
        _intra_strip32_kernel[(2 * H, NC) if hm else (2 * NC, H)](
            q2, k2, GCS, FB, b2, cstart, clen, NBUF, QG, KD, AQK, GAM, scale, lb, H, K=K, HM=hm,
            BK=min(K, cfg.bk_strip32), DT=_TL[idt], **common, num_warps=cfg.nw_strip32, num_stages=1,
            **_maxnreg(cfg.maxnreg_strip32))
    else:
        _intra_strip16_kernel[(4 * NC, H, 1)](
            q2, k2, GCS, FB, b2, cstart, clen, NBUF, QG, KD, AQK, GAM, scale, lb, H, K=K,
            BK=min(K, cfg.bk), DT=_TL[_tile_dtype(idt)], DENSE=fast, **common, num_warps=cfg.nw_strip,
            num_stages=1)
    mark("intra: strip")
    _wy_solve_kernel[_ch_grid(NC, H, hm)](NBUF, cstart, clen, TB, H, PREC=_solve_prec(cfg, BM is None), HM=hm,
                                          num_warps=cfg.nw_solve, num_stages=1)
    mark("intra: solve")


def _intra(q2, k2, g2, b2, tab, H, K, scale, lb, fast, idt, QG, KD, AQK, GAM, save_b, KGB, cfg):
    """The intra-chunk products of every (chunk, head): the in-chunk cumulative gate GCS, the strips (QG, KD, AQK,
    GAM and KGB = diag(beta) k e^G written into the given tensors) and T = (I + diag(beta) Akk)^-1 (TB
    [N, H, 64]); with save_b also Bm = Akk before beta (BM, float32 [N, H, 64], for the backward).
    Returns (TB, GCS, BM or None)."""
    NC = tab["n_chunks"]
    NBUF, GCS, FB, TB, BM = _intra_scratch(q2.shape[0], NC, H, K, idt, save_b, q2.device, cfg)
    _intra_launch(q2, k2, g2, b2, tab["cstart"], tab["clen"], NC, H, K, scale, lb, fast, idt, QG, KD, AQK, GAM,
                  FB, NBUF, GCS, TB, BM, KGB, cfg)
    return TB, GCS, BM


def _wu_launch(v2, b2, cstart, clen, NC, H, K, V, idt, TB, WK, U, cfg):
    """The w/u kernel over the NC chunks of cstart / clen; WK holds diag(beta) k e^G on entry (the strips' KGB)."""
    hm = _head_major(NC, cfg)
    _wy_apply_kernel[_ch_grid(NC, H, hm)](WK, v2, b2, cstart, clen, TB, WK, U, H, K=K, V=V, DT=_TL[idt], HM=hm,
                                          num_warps=cfg.nw_wu, num_stages=1)
