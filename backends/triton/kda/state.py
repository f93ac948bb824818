"""The inter-chunk state: the serial state pass, the segment maps of the long-context split and their combine,
and the output from the chunk-entry states.

The state S [K, V] (float32) between chunks obeys  S <- diag(e^(G_C)) S + (k e^(G_C - G))^T (U - Wk S).
``_state_pass_kernel`` walks one segment's chunks for one head and BV state columns, with nothing else on the
serial path (its tile addresses are affine in the loop counter, so the compiler prefetches chunk j+1 while chunk
j computes).  Long contexts are cut into segments (tables._seg_chunks_for): per segment, in parallel, the pass on
the augmented state [M | D] (K x (K+V), from [I | 0], values [0 | U]) gives the affine map S_out = M S_in + D
(context-parallel algebra for linear attention); ``_combine_kernel`` chains the maps serially (one K x K x V
product per segment), and then every segment runs the state pass in parallel from its own entry state.  The
backward's state gradient obeys the transposed recurrence and uses the same algebra in reverse
(``_bwd_segment_map_kernel``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..guard import sm_count
from .common import _chunk_head, _interpret, _seg_range


@triton.jit
def _state_pass_kernel(WK, U, KD, GAM, VN, HB, S_IN, S_OUT, seg_t0, seg_t1, seg_c0, seg_c1, H,
                       K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, SW: tl.constexpr,
                       MODE: tl.constexpr, STORE: tl.constexpr, STORE_VN: tl.constexpr, QG=None, AQK=None, O=None,
                       FUSE_O: tl.constexpr = False):
    """The serial state chain of one segment, one head and BV state columns; nothing else on it.

    Per chunk c (tokens t0 .. t0+63 of the segment, rows past the segment end read as 0):
        HB[c] = S (the chunk-entry state, intermediate dtype)      [STORE]
        W = U - Wk S;  VN[rows] = W                                [STORE_VN]
        S <- diag(e^(G_C)) S + (k e^(G_C - G))^T W.
    FUSE_O (MODE 0, the pipelined forward): also the chunk's output columns, O[rows] = QG S + AQK W, so that
    neither HB nor VN needs to be stored; Wk S and QG S are then one [128, K] x [K, BV] product, its operand's rows
    0-63 from WK and 64-127 from QG (the base pointer chosen per row): Triton waits for every wgmma group right
    after issuing it, so each product is a step of the chain's latency, and the merged one costs one wait where
    two products cost two.
    MODE 0: S [K, BV] starts from S_IN (width V), columns vb*BV..; MODE 1: the augmented transition
    [M | D] (width SW = K+V): columns < K start as the identity and see no U, columns >= K start at 0 and
    see U.  S_OUT gets the state after the segment.  The token addresses are affine in the loop counter
    (t0 = segment start + 64 j), so the loads of chunk j+1 are issued while chunk j computes."""
    vb = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ts, te, c0, c1 = _seg_range(seg_t0, seg_t1, seg_c0, seg_c1, s)
    rows = tl.arange(0, 64)
    dk = tl.arange(0, K)
    cols = vb * BV + tl.arange(0, BV)
    if MODE == 0:
        S = tl.load(S_IN + ((tl.cast(s, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :])
        ucol = cols
        umask = cols < V
    else:
        S = tl.where(dk[:, None] == cols[None, :], 1.0, 0.0)
        ucol = cols - K
        umask = cols >= K
    # scalar bases advanced per chunk + loop-invariant int32 tile offsets (no 64-bit pointer tiles carried)
    ok = rows[:, None] * (H * K) + dk[None, :]
    ou = rows[:, None] * (H * V) + ucol[None, :]
    oh = dk[:, None] * V + cols[None, :]
    bk = WK + (ts * H + h) * K
    bd = KD + (ts * H + h) * K
    bu = U + (ts * H + h) * V
    bn = VN + (ts * H + h) * V
    bg = GAM + (tl.cast(c0, tl.int64) * H + h) * K
    bh = HB + (tl.cast(c0, tl.int64) * H + h) * K * V
    nch = c1 - c0
    if FUSE_O:
        bq = QG + (ts * H + h) * K
        ba = AQK + (ts * H + h) * 64
        bo = O + (ts * H + h) * V
        oa = rows[:, None] * (H * 64) + rows[None, :]
        r2 = tl.arange(0, 128)
        okq = (r2 % 64)[:, None] * (H * K) + dk[None, :]
        upper = (r2 >= 64)[:, None]
    # `!= 0`: a bool mask under the triton 3.9 interpreter (see intra._strip_block)
    gam = tl.load(bg + dk, mask=((dk < K) & (nch > 0)) != 0, other=1.0)
    for j in range(0, nch):
        # the next chunk's decay is fetched a whole step ahead (the tiles are pipelined by the compiler)
        gnext = tl.load(bg + H * K + dk, mask=((dk < K) & (j + 1 < nch)) != 0, other=1.0)
        rm = (ts + j * 64 + rows) < te
        if STORE:
            tl.store(bh + oh, S.to(HB.dtype.element_ty))
        if FUSE_O:
            rmq = (ts + j * 64 + r2 % 64) < te
            wk = tl.load(tl.where(upper, bq, bk) + okq, mask=rmq[:, None], other=0.0)    # [Wk; QG] [128, K]
        else:
            wk = tl.load(bk + ok, mask=rm[:, None], other=0.0)
        uu = tl.load(bu + ou, mask=rm[:, None] & umask[None, :], other=0.0).to(tl.float32)
        Sb = S.to(wk.dtype)
        if FUSE_O:
            xs = tl.dot(wk, Sb)                                    # [Wk; QG] S, [128, BV]
            ws, qs = tl.split(tl.permute(tl.reshape(xs, [2, 64, BV]), (1, 2, 0)))
            W = uu - ws
        else:
            W = uu - tl.dot(wk, Sb)
        if STORE_VN:
            tl.store(bn + ou, W.to(VN.dtype.element_ty), mask=rm[:, None])
        kd = tl.load(bd + ok, mask=rm[:, None], other=0.0)
        Wb = W.to(kd.dtype)
        if FUSE_O:
            A = tl.load(ba + oa, mask=rm[:, None], other=0.0)
            oo = qs + tl.dot(A, Wb.to(A.dtype))
            tl.store(bo + ou, oo.to(O.dtype.element_ty), mask=rm[:, None])
            bq += 64 * H * K
            ba += 64 * H * 64
            bo += 64 * H * V
        S = S * gam[:, None] + tl.dot(tl.trans(kd), Wb)
        gam = gnext
        bk += 64 * H * K
        bd += 64 * H * K
        bu += 64 * H * V
        bn += 64 * H * V
        bg += H * K
        bh += H * K * V
    tl.store(S_OUT + ((tl.cast(s, tl.int64) * H + h) * K + dk[:, None]) * SW + cols[None, :], S)


@triton.jit
def _output_kernel(QG, AQK, VN, HB, O, cstart, clen, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                   HM: tl.constexpr):
    """All chunks at once: O = (scale q e^G) HB[c] + (scale P) VN for one (chunk, head, BV columns); grid
    (NC, H, V / BV), or head-major (HM) (H, NC, V / BV)."""
    c, h, _ = _chunk_head(HM)
    vb = tl.program_id(2)
    t0 = tl.load(cstart + c).to(tl.int64)
    L = tl.load(clen + c)
    rows = tl.arange(0, 64)
    rm = rows < L
    dk = tl.arange(0, K)
    cols = vb * BV + tl.arange(0, BV)
    tok = (t0 + rows)[:, None]
    qg = tl.load(QG + tok * (H * K) + h * K + dk[None, :], mask=rm[:, None], other=0.0)
    hb = tl.load(HB + ((tl.cast(c, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :])
    A = tl.load(AQK + tok * (H * 64) + h * 64 + rows[None, :], mask=rm[:, None], other=0.0)
    vn = tl.load(VN + tok * (H * V) + h * V + cols[None, :], mask=rm[:, None], other=0.0)
    o = tl.dot(qg, hb.to(qg.dtype)) + tl.dot(A, vn.to(A.dtype))
    tl.store(O + tok * (H * V) + h * V + cols[None, :], o.to(O.dtype.element_ty), mask=rm[:, None])


@triton.jit
def _combine_kernel(MD, S_INIT, S_ENTRY, S_FIN, seq_s0, seq_s1, H, K: tl.constexpr, V: tl.constexpr,
                    BV: tl.constexpr, HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, PREC: tl.constexpr):
    """Chain the segment maps S <- M S + D (MD [NSEG,H,K,K+V]); store each segment's entry state.

    PREC: "tf32x3" on the GPU (three tensor-core tf32 products, about float32 accuracy; the float32 "ieee"
    FMA dot of a 128x128 M does not fit the registers and spills), "ieee" under the interpreter."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    s0 = tl.load(seq_s0 + n)
    s1 = tl.load(seq_s1 + n)
    dk = tl.arange(0, K)
    cols = vb * BV + tl.arange(0, BV)
    if HAS_INIT:
        S = tl.load(S_INIT + ((tl.cast(n, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :])
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for j in range(0, s1 - s0):
        if REVERSE:
            i = s1 - 1 - j
        else:
            i = s0 + j
        tl.store(S_ENTRY + ((tl.cast(i, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :], S)
        base = MD + (tl.cast(i, tl.int64) * H + h) * K * (K + V)
        M = tl.load(base + dk[:, None] * (K + V) + dk[None, :])
        D = tl.load(base + dk[:, None] * (K + V) + K + cols[None, :])
        S = tl.dot(M, S, input_precision=PREC) + D
    tl.store(S_FIN + ((tl.cast(n, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :], S)


@triton.jit
def _bwd_segment_map_kernel(WK, QG, KD, AQK, GAM, DO, DS_OUT, cstart, clen, seg_c0, seg_c1, H,
                            K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """The backward's segment maps: the augmented transition of the state gradient dS over one segment ([N | E],
    width K+V, starting from [I | 0]; columns >= K see dO) under the transposed recurrence
    dS_prev = (diag(e^(G_C)) - Wk^T Kd) dS + (q e^G)^T dO - Wk^T P^T dO, chunk by chunk from the segment end."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    c0 = tl.load(seg_c0 + s)
    c1 = tl.load(seg_c1 + s)
    rows = tl.arange(0, 64)
    dk = tl.arange(0, K)
    cols = vb * BV + tl.arange(0, BV)
    X = tl.where(dk[:, None] == cols[None, :], 1.0, 0.0)
    ocol = cols - K
    omask = cols >= K
    for j in range(0, c1 - c0):
        c = c1 - 1 - j
        t0 = tl.load(cstart + c)
        L = tl.load(clen + c)
        rm = rows < L
        offk = (t0 + rows).to(tl.int64)[:, None] * (H * K) + h * K + dk[None, :]
        offo = (t0 + rows).to(tl.int64)[:, None] * (H * V) + h * V + ocol[None, :]
        offa = (t0 + rows).to(tl.int64)[:, None] * (H * 64) + h * 64 + rows[None, :]
        wk = tl.load(WK + offk, mask=rm[:, None], other=0.0)
        kd = tl.load(KD + offk, mask=rm[:, None], other=0.0)
        qg = tl.load(QG + offk, mask=rm[:, None], other=0.0)
        A = tl.load(AQK + offa, mask=rm[:, None], other=0.0)
        gam = tl.load(GAM + (tl.cast(c, tl.int64) * H + h) * K + dk)
        do = tl.load(DO + offo, mask=rm[:, None] & omask[None, :], other=0.0).to(wk.dtype)
        Xd = X.to(wk.dtype)
        dW = tl.dot(tl.trans(A), do) + tl.dot(kd, Xd)
        X = X * gam[:, None] + tl.dot(tl.trans(qg), do) - tl.dot(tl.trans(wk), dW.to(wk.dtype))
    tl.store(DS_OUT + ((tl.cast(s, tl.int64) * H + h) * K + dk[:, None]) * (K + V) + cols[None, :], X)


# ----------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------
def _value_block(BH, V, slots, sms=None, grad=True, bv="auto"):
    """State columns per program of the serial passes (the forward state pass, its segment maps and the
    backward's dS chain): bv (KdaConfig.bv) when 16, 32 or 64, else ("auto"): without autograd (grad False,
    sms = the SM count) 16 when 16-column programs fit one per SM (the unsplit pass is latency-bound); else 64 when
    32-column programs (sequences x heads x V / 32) would not fit one wave of slots (slots = SMs x ctas_per_sm;
    None off the GPU), else 32.  With autograd the backward's dS chain shares the forward's columns."""
    if bv == "auto":
        if not grad and sms is not None and V >= 16 and BH * (V // 16) <= sms:
            bv = 16
        else:
            bv = 64 if slots is not None and V >= 64 and BH * (V // 32) > slots else 32
    return min(bv, V)


def _pass_stages(programs, device, cfg, elem=2):
    """Pipeline stages of a serial state pass with this many programs: cfg.stages_one_wave when they fit one per
    SM (latency-bound: loads issued two chunks ahead), else cfg.state_stages (two programs per SM share the
    bandwidth and the shared memory).  With 4-byte operands (elem, float32 inputs) at most cfg.state_stages: three
    stages of a chunk's float32 WK, KD [64, 128] and U tiles need 240 KB, past the 227 KB of an SM."""
    if device.type == "cuda" and programs <= sm_count(device) and elem < 4:
        return cfg.stages_one_wave
    return cfg.state_stages


def _state_pass(WK, U, KD, GAM, S_IN, tab, H, K, V, BV, idt, store_vn, cfg):
    """Chunk-entry states HB [NC, H, K, V] (idt), new values VN [N, H, V] (idt, or None) and the state after
    each segment S_OUT [NS, H, K, V] float32, from the segment entry states S_IN."""
    dev = WK.device
    NC, NS = tab["n_chunks"], tab["n_seg"]
    HB = torch.empty(max(NC, 1), H, K, V, dtype=idt, device=dev)
    VN = torch.empty(U.shape, dtype=idt, device=dev) if store_vn else HB
    S_OUT = torch.empty(NS, H, K, V, dtype=torch.float32, device=dev)
    _state_pass_kernel[(V // BV, H, NS)](WK, U, KD, GAM, VN, HB, S_IN, S_OUT, tab["seg_t0"], tab["seg_t1"],
                                         tab["seg_c0"], tab["seg_c1"], H, K=K, V=V, BV=BV, SW=V, MODE=0, STORE=True,
                                         STORE_VN=store_vn, num_warps=cfg.state_warps,
                                         num_stages=_pass_stages(V // BV * H * NS, dev, cfg, WK.element_size()))
    return HB, (VN if store_vn else None), S_OUT


def _entry_states(WK, U, QG, KD, AQK, GAM, h0, tab, H, K, V, BV, dev, mode_bwd, cfg, DO=None):
    """Entry state of every segment (forward) or dS at every segment end (backward, h0 = dS_final)."""
    NS, NQ = tab["n_seg"], tab["n_seq"]
    if not tab["segmented"]:
        if h0 is None:
            return torch.zeros(NS, H, K, V, dtype=torch.float32, device=dev)
        return h0.float().index_select(0, tab["seg_seq"]).contiguous()
    MD = torch.empty(NS, H, K, K + V, dtype=torch.float32, device=dev)
    if not mode_bwd:
        B1 = min(BV, K)                      # divides K and V (powers of two), hence K + V
        _state_pass_kernel[((K + V) // B1, H, NS)](WK, U, KD, GAM, MD, MD, MD, MD, tab["seg_t0"], tab["seg_t1"],
                                                   tab["seg_c0"], tab["seg_c1"], H, K=K, V=V, BV=B1, SW=K + V,
                                                   MODE=1, STORE=False, STORE_VN=False, num_warps=cfg.state_warps,
                                                   num_stages=_pass_stages((K + V) // B1 * H * NS, dev, cfg,
                                                                              WK.element_size()))
    else:
        BA = 64 if (K + V) % 64 == 0 else math.gcd(K, V)
        _bwd_segment_map_kernel[(NS, H, (K + V) // BA)](WK, QG, KD, AQK, GAM, DO, MD, tab["cstart"], tab["clen"],
                                                         tab["seg_c0"], tab["seg_c1"], H, K=K, V=V, BV=BA,
                                                         num_warps=4, num_stages=2)
    S_ENTRY = torch.empty(NS, H, K, V, dtype=torch.float32, device=dev)
    S_FIN = torch.empty(NQ, H, K, V, dtype=torch.float32, device=dev)
    init = h0.float().contiguous() if h0 is not None else S_FIN
    _combine_kernel[(NQ, H, V // BV)](MD, init, S_ENTRY, S_FIN, tab["seq_s0"], tab["seq_s1"], H, K=K, V=V,
                                      BV=BV, HAS_INIT=h0 is not None, REVERSE=mode_bwd,
                                      PREC="ieee" if _interpret() else "tf32x3", num_warps=8)
    return S_ENTRY
