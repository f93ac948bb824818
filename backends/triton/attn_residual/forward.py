"""The attn_residual forward: one pass over the L sources per token tile with an online softmax over depth.

Three kernels, one per input class (the launch, ``forward``, picks by the input):

* ``_fwd_rows_kernel``: row tiles under ``pipelined_tile`` elements (small d and few rows) and the interpreter.
  Program p owns the token tiles p*TPP .. p*TPP+TPP-1 and walks the (tile, source) pairs in order with the
  next pair's load in flight (one register-prefetched load, across tile boundaries).
* ``_fwd_padded_kernel``: wider tiles on the GPU where d is not up to three power-of-two pieces of >= 512 columns:
  one flat loop over (token tile, block of BL sources) pairs per persistent program, software-pipelined by the
  compiler (cp.async into shared memory, NS - 1 steps in flight, across tile boundaries), the BL logits of a step
  reduced together, so that the serial part of the online softmax (a row reduction, then the rescale) is paid once
  per BL sources. Little's law: ~4.2 TB/s x ~1 us needs ~32 KB in flight per SM; one step of one row and one source
  is 14 KB at d = 7168 (bf16).
* ``_fwd_pieces_kernel``: the same schedule with the row held as up to three power-of-two column pieces (7168 =
  4096 + 2048 + 1024) instead of one 8192-wide tile with 1024 masked columns: 7/8 of the registers for x, the
  running sum and q*w, no masked lanes, and one cross-warp reduction per step for x*x and x*qw of all pieces.

All accumulate in float32 and index with int64; the sources are reached through a table of int64 element offsets
from one base pointer, so L is a runtime value. With SAVE they write the logits [L, N] and the log-sum-exp [N]
that the backward reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..guard import cdiv
from .common import INTERPRET, num_sms, offset_table, row_tile
from .config import current


@triton.jit
def _fwd_rows_kernel(
    base, offs,                   # base pointer (sources' dtype) and int64 element offsets [L]
    q_buf, w_buf, ow,             # [D] query, rms_weight (any float dtype; q*w is formed in float32 here),
                                  # output-norm weight (ow unused if not HAS_ONORM)
    out,                          # [N, D] sources' dtype
    logit_buf, lse_buf,           # [L, N] f32, [N] f32 (only written if SAVE)
    N, L, eps, TPP,               # TPP: token tiles per program (persistent loop)
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, VEC: tl.constexpr,
    HAS_ONORM: tl.constexpr, SAVE: tl.constexpr,
):
    # Program p owns the token tiles p*TPP .. p*TPP+TPP-1 and walks the (tile, source) pairs in order. The load of
    # the next pair is kept in flight ahead of the pair being computed, across tile boundaries, so that the memory
    # system never idles at the end of a token (hand software-pipelining); q*w stays in registers.
    pid = tl.program_id(0).to(tl.int64)
    r0 = tl.arange(0, BT).to(tl.int64)
    cols = tl.arange(0, BD)
    cmask = cols < D
    qw = (tl.load(q_buf + cols, mask=cmask, other=0.0).to(tl.float32)
          * tl.load(w_buf + cols, mask=cmask, other=0.0).to(tl.float32))
    if HAS_ONORM:
        oww = tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)
    t0 = pid * TPP
    rows_a = t0 * BT + r0
    off_a = tl.multiple_of(tl.load(offs), VEC)
    buf_a = tl.load(base + off_a + rows_a[:, None] * D + cols[None, :],
                    mask=(rows_a < N)[:, None] & cmask[None, :], other=0.0, eviction_policy="evict_first")
    for tt in range(0, TPP):
        rows = (t0 + tt) * BT + r0                                      # [BT] int64
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        tile = rows[:, None] * D + cols[None, :]                        # [BT, BD] int64 element offsets
        m = tl.full([BT], float("-inf"), tl.float32)
        s = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, BD], tl.float32)
        lgp = logit_buf                                                 # advances by N per source (64-bit)
        for i in tl.range(0, L, num_stages=1):
            x = buf_a.to(tl.float32)
            # the pair one step ahead: k = tt*L + i + 1 = (tile kt, source ki)
            k = tt * L + i + 1
            kt = k // L
            ki = k - kt * L
            rows_n = (t0 + kt) * BT + r0
            off_n = tl.multiple_of(tl.load(offs + ki), VEC)
            # `!= 0` keeps the mask bool under the triton 3.9 interpreter (its loads take only bool masks, and it
            # broadcasts the scalar comparison kt < TPP as an integer); the compiler folds it away
            buf_a = tl.load(base + off_n + rows_n[:, None] * D + cols[None, :],
                            mask=(((rows_n < N) & (kt < TPP)) != 0)[:, None] & cmask[None, :], other=0.0,
                            eviction_policy="evict_first")
            ss = tl.sum(x * x, axis=1)
            dot = tl.sum(x * qw[None, :], axis=1)
            lg = dot * tl.rsqrt(ss / D + eps)                           # [BT]
            m_new = tl.maximum(m, lg)
            alpha = tl.exp(m - m_new)
            pe = tl.exp(lg - m_new)
            s = s * alpha + pe
            acc = acc * alpha[:, None] + pe[:, None] * x
            m = m_new
            if SAVE:
                tl.store(lgp + rows, lg, mask=rmask)
                lgp += N
        o = acc * (1.0 / s)[:, None]                                    # one division per row, not per element
        if SAVE:
            tl.store(lse_buf + rows, m + tl.log(s), mask=rmask)
        if HAS_ONORM:
            ro = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
            o = o * ro[:, None] * oww[None, :]
        tl.store(out + tile, o.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _flat_step(k, NB, t0, TSTEP, BT: tl.constexpr, r0, BL: tl.constexpr, ll, N, L, offs, VEC: tl.constexpr):
    # step k of the flat (token tile, source block) loop of the pipelined kernels, whose tiles are t0, t0 + TSTEP,
    # ...: (source block j, the tile's rows [BT] int64 and their mask, the block's sources [BL] and their mask,
    # their element offsets)
    tt = k // NB
    j = k - tt * NB
    rows = (t0 + tt * TSTEP) * BT + r0
    src = j * BL + ll
    smask = src < L
    return j, rows, rows < N, src, smask, tl.multiple_of(tl.load(offs + src, mask=smask, other=0), VEC)


@triton.jit
def _online_softmax(lg, smask, j, m, s):
    # the online softmax over depth for the logits lg [BL, BT] of source block j (absent sources masked): the
    # running max m and sum s [BT] reset at a tile's first block (j == 0: alpha = 0); returns (new max, new sum,
    # alpha, the block's weights p [BL, BT]) for acc = acc * alpha + sum(p x)
    lgm = tl.where(smask[:, None], lg, float("-inf"))
    m_old = tl.where(j == 0, float("-inf"), m)
    m_new = tl.maximum(m_old, tl.max(lgm, axis=0))
    alpha = tl.exp(m_old - m_new)
    p = tl.exp(lgm - m_new[None, :])
    return m_new, s * alpha + tl.sum(p, axis=0), alpha, p


@triton.jit
def _fwd_padded_kernel(
    base, offs,                   # base pointer (sources' dtype) and int64 element offsets [L]
    q_buf, w_buf, ow,             # [D] query, rms_weight (any float dtype; q*w is formed in float32 here),
                                  # output-norm weight (ow unused if not HAS_ONORM)
    out,                          # [N, D] sources' dtype
    logit_buf, lse_buf,           # [L, N] f32, [N] f32 (only written if SAVE)
    N, L, NB, eps, TPP, TSTEP,    # NB = cdiv(L, BL) source blocks; TPP: token tiles per program, which are
                                  # p, p + TSTEP, ... (TSTEP: the grid)
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BL: tl.constexpr, VEC: tl.constexpr,
    HAS_ONORM: tl.constexpr, SAVE: tl.constexpr, NS: tl.constexpr,
):
    # _fwd_rows_kernel's math, another schedule. Program p owns TPP token tiles and walks ONE flat loop over the
    # (tile, source block) pairs, so the compiler's software pipeline (tl.range num_stages: cp.async into shared
    # memory, NS - 1 steps in flight) runs across tile boundaries instead of draining at the end of every token tile
    # (which costs most at small L). Each step loads BL sources of the BT rows at once ([BL, BT, BD]) and reduces
    # their BL*BT logits together, so one cross-warp reduction round (the serial part of the online softmax) serves
    # BL sources. The running state is reset arithmetically at the first block of a tile (alpha = 0). q*w stays in
    # registers; the output-norm weight is re-read (L1 hits) at the end of each tile, which keeps the registers
    # under ptxas' cap. (t0: with TSTEP = 1, i.e. one program, pid * TPP = pid = 0.)
    pid = tl.program_id(0).to(tl.int64)
    r0 = tl.arange(0, BT).to(tl.int64)
    cols = tl.arange(0, BD)
    cmask = cols < D
    ll = tl.arange(0, BL)
    qw = (tl.load(q_buf + cols, mask=cmask, other=0.0).to(tl.float32)
          * tl.load(w_buf + cols, mask=cmask, other=0.0).to(tl.float32))
    m = tl.full([BT], float("-inf"), tl.float32)
    s = tl.zeros([BT], tl.float32)
    acc = tl.zeros([BT, BD], tl.float32)
    t0 = tl.where(TSTEP == 1, pid * TPP, pid)
    for k in tl.range(0, TPP * NB, num_stages=NS):
        j, rows, rmask, src, smask, off = _flat_step(k, NB, t0, TSTEP, BT, r0, BL, ll, N, L, offs, VEC)
        tile = rows[:, None] * D + cols[None, :]                        # [BT, BD] int64
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(base + off[:, None, None] + tile[None, :, :], mask=smask[:, None, None] & mask[None, :, :],
                    other=0.0, eviction_policy="evict_first").to(tl.float32)   # [BL, BT, BD]
        ss = tl.sum(x * x, axis=2)                                      # [BL, BT]
        dot = tl.sum(x * qw[None, None, :], axis=2)
        lg = dot * tl.rsqrt(ss / D + eps)
        m_new, s, alpha, p = _online_softmax(lg, smask, j, m, s)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * x, axis=0)
        m = m_new
        if SAVE:
            tl.store(logit_buf + src[:, None].to(tl.int64) * N + rows[None, :], lg,
                     mask=smask[:, None] & rmask[None, :])
        if j == NB - 1:
            o = acc * (1.0 / s)[:, None]        # one division per row: per element it was ~1/4 of the instructions
            if SAVE:
                tl.store(lse_buf + rows, m + tl.log(s), mask=rmask)
            if HAS_ONORM:
                oww = tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)
                ro = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
                o = o * ro[:, None] * oww[None, :]
            tl.store(out + tile, o.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _fold(t, W: tl.constexpr):
    # [..., P] -> [..., W]: the sum of the P // W column blocks of width W (P a multiple of W, both powers of
    # two). When W is a multiple of the row layout's width (VEC * 32 * num_warps columns: 1024 for bf16 at 4
    # warps) every thread holds the same columns of each block, so these are adds in registers (narrower W:
    # a layout conversion through shared memory), and pieces of different widths folded to one width then
    # share one cross-warp reduction.
    R: tl.constexpr = len(t.shape)
    return tl.sum(tl.reshape(t, t.shape[:-1] + [t.shape[-1] // W, W]), axis=R - 1)


@triton.jit
def _qw_piece(q_buf, w_buf, cols):
    # [P] float32 q*w of the columns `cols` (whole pieces: no mask)
    return tl.load(q_buf + cols).to(tl.float32) * tl.load(w_buf + cols).to(tl.float32)


@triton.jit
def _src_piece(base, off, rows, cols, m3, D: tl.constexpr):
    # [BL, BT, P] float32: the columns `cols` of the rows `rows` of the BL sources at element offsets `off`;
    # m3 [BL, BT, 1] masks whole rows (absent sources, rows past N), never columns
    return tl.load(base + off[:, None, None] + (rows[:, None] * D + cols[None, :])[None, :, :], mask=m3, other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _fwd_pieces_kernel(
    base, offs, q_buf, w_buf, ow, out, logit_buf, lse_buf, N, L, NB, eps, TPP, TSTEP,  # as _fwd_padded_kernel's
    D: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
    VEC: tl.constexpr, HAS_ONORM: tl.constexpr, SAVE: tl.constexpr, NS: tl.constexpr,
):
    # _fwd_padded_kernel's schedule and math, with a row held as exact power-of-two column pieces instead of one
    # next_power_of_2(D) tile with masked columns: D = P1 + P2 + P3 (pow2_parts), columns [0, P1), [P1, P1 + P2),
    # [P1 + P2, D); a piece of width 0 compiles away (every use sits under `if P2 > 0:` / `if P3 > 0:`). At D = 7168
    # = 4096 + 2048 + 1024 and 4 warps, x, acc and q*w take 56 float32 registers per thread each instead of 64, and
    # no instruction works on masked-off columns. The pieces' partial sums of x*x and x*qw are folded to the
    # narrowest piece's width PM (_fold) and added, and the two are reduced joined ([BL, BT, PM, 2]), so one
    # cross-warp reduction round per step serves all pieces and both sums (_fwd_padded_kernel: two rounds).
    PM: tl.constexpr = P3 if P3 > 0 else (P2 if P2 > 0 else P1)
    pid = tl.program_id(0).to(tl.int64)
    r0 = tl.arange(0, BT).to(tl.int64)
    ll = tl.arange(0, BL)
    c1 = tl.arange(0, P1)
    if P2 > 0:
        c2 = P1 + tl.arange(0, P2)
    if P3 > 0:
        c3 = P1 + P2 + tl.arange(0, P3)
    qw1 = _qw_piece(q_buf, w_buf, c1)
    if P2 > 0:
        qw2 = _qw_piece(q_buf, w_buf, c2)
    if P3 > 0:
        qw3 = _qw_piece(q_buf, w_buf, c3)
    m = tl.full([BT], float("-inf"), tl.float32)
    s = tl.zeros([BT], tl.float32)
    acc1 = tl.zeros([BT, P1], tl.float32)
    if P2 > 0:
        acc2 = tl.zeros([BT, P2], tl.float32)
    if P3 > 0:
        acc3 = tl.zeros([BT, P3], tl.float32)
    t0 = tl.where(TSTEP == 1, pid * TPP, pid)
    for k in tl.range(0, TPP * NB, num_stages=NS):
        j, rows, rmask, src, smask, off = _flat_step(k, NB, t0, TSTEP, BT, r0, BL, ll, N, L, offs, VEC)
        m3 = smask[:, None, None] & rmask[None, :, None]                # [BL, BT, 1]
        x1 = _src_piece(base, off, rows, c1, m3, D)                     # [BL, BT, P1]
        ss = _fold(x1 * x1, PM)                                         # [BL, BT, PM]
        dot = _fold(x1 * qw1[None, None, :], PM)
        if P2 > 0:
            x2 = _src_piece(base, off, rows, c2, m3, D)
            ss += _fold(x2 * x2, PM)
            dot += _fold(x2 * qw2[None, None, :], PM)
        if P3 > 0:
            x3 = _src_piece(base, off, rows, c3, m3, D)
            ss += _fold(x3 * x3, PM)
            dot += _fold(x3 * qw3[None, None, :], PM)
        ss, dot = tl.split(tl.sum(tl.join(ss, dot), axis=2))            # [BL, BT] each
        lg = dot * tl.rsqrt(ss / D + eps)
        m_new, s, alpha, p = _online_softmax(lg, smask, j, m, s)
        acc1 = acc1 * alpha[:, None] + tl.sum(p[:, :, None] * x1, axis=0)
        if P2 > 0:
            acc2 = acc2 * alpha[:, None] + tl.sum(p[:, :, None] * x2, axis=0)
        if P3 > 0:
            acc3 = acc3 * alpha[:, None] + tl.sum(p[:, :, None] * x3, axis=0)
        m = m_new
        if SAVE:
            tl.store(logit_buf + src[:, None].to(tl.int64) * N + rows[None, :], lg,
                     mask=smask[:, None] & rmask[None, :])
        if j == NB - 1:
            inv = (1.0 / s)[:, None]                                    # one division per row
            o1 = acc1 * inv
            if P2 > 0:
                o2 = acc2 * inv
            if P3 > 0:
                o3 = acc3 * inv
            if SAVE:
                tl.store(lse_buf + rows, m + tl.log(s), mask=rmask)
            if HAS_ONORM:
                so = _fold(o1 * o1, PM)                                 # [BT, PM]
                if P2 > 0:
                    so += _fold(o2 * o2, PM)
                if P3 > 0:
                    so += _fold(o3 * o3, PM)
                ro = tl.rsqrt(tl.sum(so, axis=1) / D + eps)[:, None]
                # the norm's weight re-read at each tile's end (L1 hits), not held: registers stay under the cap
                ow1 = tl.load(ow + c1)
                if P2 > 0:
                    ow2 = tl.load(ow + c2)
                if P3 > 0:
                    ow3 = tl.load(ow + c3)
                o1 = o1 * ro * ow1.to(tl.float32)[None, :]
                if P2 > 0:
                    o2 = o2 * ro * ow2.to(tl.float32)[None, :]
                if P3 > 0:
                    o3 = o3 * ro * ow3.to(tl.float32)[None, :]
            rm = rmask[:, None]
            tl.store(out + rows[:, None] * D + c1[None, :], o1.to(out.dtype.element_ty), mask=rm)
            if P2 > 0:
                tl.store(out + rows[:, None] * D + c2[None, :], o2.to(out.dtype.element_ty), mask=rm)
            if P3 > 0:
                tl.store(out + rows[:, None] * D + c3[None, :], o3.to(out.dtype.element_ty), mask=rm)


def pow2_parts(d: int):
    """(P1, P2, P3), the column pieces of _fwd_pieces_kernel: d = P1 + P2 + P3, powers of two, P1 > P2 > P3, 0 for
    an absent piece (7168 -> (4096, 2048, 1024), 5120 -> (4096, 1024, 0)); None when d has more than three set bits
    or its smallest piece would be narrower than 512 columns (one 16-byte load per thread of 4 warps in float32:
    a narrower piece leaves lanes idle)."""
    parts = [1 << b for b in range(d.bit_length() - 1, -1, -1) if d >> b & 1]
    if not parts or len(parts) > 3 or parts[-1] < 512:
        return None
    return tuple(parts + [0] * (3 - len(parts)))


def forward(query, xs, w, ow, eps, save):
    """Launch the forward on the sources xs [N, d]: (out, offset table, logits [L, N] or None, lse [N] or None)."""
    d = xs[0].shape[-1]
    n = xs[0].shape[0]
    L = len(xs)
    base, offs, vec = offset_table(xs, "attn_residual")
    out = torch.empty_like(xs[0])
    bt, bd, nw = row_tile(d, n)
    cfg = current()
    pipelined = cfg.fwd_pipelined
    if pipelined is None:
        pipelined = bd * bt >= cfg.pipelined_tile and not INTERPRET
    dev = xs[0].device
    if save:
        logit = torch.empty((L, n), dtype=torch.float32, device=dev)
        lse = torch.empty((n,), dtype=torch.float32, device=dev)
    else:
        logit = lse = out  # never touched (SAVE is False)
    if n > 0 and pipelined:
        parts = pow2_parts(d)
        if ow is not None:
            bl = cfg.fwd_bl_onorm if parts else cfg.fwd_bl_onorm_padded
        else:
            bl = cfg.fwd_bl_wide if L >= cfg.fwd_wide_l else cfg.fwd_bl
        bt = cfg.fwd_bt
        n_tiles = cdiv(n, bt)
        tpp = max(1, cdiv(n_tiles, cfg.fwd_progs_per_sm * num_sms(dev)))
        grid = cdiv(n_tiles, tpp)
        # the pipeline keeps ns - 1 steps in shared memory, each of `width` columns (the padded tile, or the row's
        # exact pieces): stages chosen for bf16 would not fit for float32 sources, so fewer then (the same result)
        ns = cfg.fwd_ns
        width = d if parts else bd
        while ns > 1 and (ns - 1) * bl * bt * width * xs[0].element_size() > 200 * 1024:
            ns -= 1
        args = (base, offs, query, w, ow if ow is not None else w, out, logit, lse,
                n, L, cdiv(L, bl), float(eps), tpp, grid)
        meta = dict(D=d, BT=bt, BL=bl, VEC=vec, HAS_ONORM=ow is not None, SAVE=save, NS=ns,
                    num_warps=cfg.fwd_num_warps)
        if parts:
            _fwd_pieces_kernel[(grid,)](*args, P1=parts[0], P2=parts[1], P3=parts[2], **meta)
        else:
            _fwd_padded_kernel[(grid,)](*args, BD=bd, **meta)
    elif n > 0:
        n_tiles = cdiv(n, bt)
        tpp = max(1, cdiv(n_tiles, 2 * num_sms(dev)))                  # two programs per SM
        grid = cdiv(n_tiles, tpp)
        _fwd_rows_kernel[(grid,)](
            base, offs, query, w, ow if ow is not None else w, out, logit, lse,
            n, L, float(eps), tpp, D=d, BT=bt, BD=bd, VEC=vec,
            HAS_ONORM=ow is not None, SAVE=save, num_warps=nw)
    return out, offs, (logit if save else None), (lse if save else None)
