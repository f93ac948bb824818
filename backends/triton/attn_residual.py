"""Block Attention Residuals (attention over depth) as Triton kernels: forward, backward, two-phase form.

Math: "Attention Residuals" (arXiv 2603.15031), Block AttnRes; the contract is spec/OPS.md
"attn_residual" and the float32 reference is backends/reference/attn_residual.py (same signatures):

    logit_i = <query, x_i * r_i * rms_weight>,  r_i = rsqrt(mean_d x_i^2 + eps)
    p = softmax_i(logit) (float32),  out = sum_i p_i x_i,  optional out <- RMSNorm(out; output_rms_weight)

Kernels (all accumulate in float32, all index with int64, so tensors past 2^31/2^32 elements are fine):

* ``_fwd_kernel``: one pass over the L sources per token tile with an online softmax over depth
  (Milakov & Gimelshein 2018): each source row is read from memory exactly once, the running max ``m``,
  sum ``s`` and the weighted sum live in registers; the optional output RMSNorm is applied before the
  single store. The sources are reached through a table of int64 element offsets from one base
  pointer, so L is a runtime value (1 .. any) and nothing is specialised on it.
* ``_fwd2_kernel`` (launch setting ``impl: "v2"``): the same math with another schedule for bandwidth:
  one flat loop over (token tile, block of BL sources) pairs per persistent program, software-pipelined
  by the compiler (cp.async into shared memory, NS - 1 steps in flight, across tile boundaries), and the
  BL logits of a step reduced together, so the serial part of the online softmax (a row reduction, then
  the rescale) is paid once per BL sources. Little's law: ~4.2 TB/s x ~1 us needs ~32 KB in flight per
  SM; one step of one row and one source is 14 KB at d = 7168 (bf16).
* ``_fwd3_kernel`` (launch setting ``impl: "v3"``): _fwd2_kernel's schedule with the row held as up to three
  power-of-two column pieces (7168 = 4096 + 2048 + 1024) instead of one 8192-wide tile with 1024 masked
  columns: 7/8 of the registers for x, the running sum and q*w, no masked lanes, and one cross-warp
  reduction per step for x*x and x*qw of all pieces.
* ``_bwd_kernel``: recomputes the mix from the saved logits and log-sum-exp (one read of the sources),
  then one more read of every source to write every source's gradient; per-program partial sums of
  d(query*rms_weight) and d(output_rms_weight) are reduced on the host side.
  Derivation: with k_i = x_i r_i, logit_i = <qw, k_i>, qw = query*rms_weight, do = dL/d(mix):
  dlogit_i = p_i (<do, x_i> - <do, mix>),
  dx_i = p_i do + dlogit_i r_i (qw - logit_i r_i x_i / d),  dqw = sum dlogit_i r_i x_i.
* ``_phase1_logits_kernel`` + ``_phase1_mix_kernel``: the two-phase form. The logits of all Q queries of a
  block against every bank source come from one read of the bank with a tensor-core product
  [tokens, d] x [d, Q] (3xTF32, float32-accurate), together with the running max/sum; the weighted sums
  acc_q = sum_i exp(logit_qi - m_q) x_i are then formed per (token, d-chunk) tile.
  With ``mix_impl: "v2"``, ``_phase1_stats_kernel`` turns the logits into m, s and exp(logit - m) once per
  (token, query), and ``_phase1_mix2_kernel`` is then a single pipelined loop of independent loads.
  A bank of one source needs no mix: acc_q = x_0 exactly (s = 1), returned as a view.
* ``_merge_kernel``: the online-softmax merge of one query's bank result with the in-block partial source
  (plus the fused output RMSNorm).

Public functions: ``attn_residual``, ``attn_residual_phase1``, ``attn_residual_merge`` (documented below).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

import importlib

from backends.cuda_device import on_tensor_device
from .guard import (DeviceTableCache, cdiv, device_table, interpreted, next_power_of_2, no_create_graph, sm_count,
                    warn_interpreter_bf16)

# the module itself (backends.reference re-exports a function of the same name)
_ref = importlib.import_module("backends.reference.attn_residual")

__all__ = ["attn_residual", "attn_residual_phase1", "attn_residual_merge"]

_INTERPRET = interpreted()


# ----------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _fwd_kernel(
    base, offs,                   # base pointer (sources' dtype) and int64 element offsets [L]
    q_buf, w_buf, ow,             # [D] query, rms_weight (any float dtype; q*w is formed in float32 here),
                                  # output-norm weight (ow unused if not HAS_ONORM)
    out,                          # [N, D] sources' dtype
    logit_buf, lse_buf,           # [L, N] f32, [N] f32 (only written if SAVE)
    N, L, eps, TPP,               # TPP: token tiles per program (persistent loop)
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, VEC: tl.constexpr,
    HAS_ONORM: tl.constexpr, SAVE: tl.constexpr, PF: tl.constexpr, NS: tl.constexpr, QW_REG: tl.constexpr,
):
    # Program p owns the token tiles p*TPP .. p*TPP+TPP-1 and walks the (tile, source) pairs in order.
    # PF (0, 1 or 2) loads are kept in flight ahead of the pair being computed, across tile boundaries,
    # so that the memory system never idles at the end of a token (hand software-pipelining).
    # PF == 0 with NS > 1 instead lets the compiler stage the source loads through shared memory
    # (cp.async, NS - 1 loads in flight, no register cost). QW_REG keeps q*w in registers; without it
    # q*w is re-read from L1 each step, which frees registers for more programs per multiprocessor.
    pid = tl.program_id(0).to(tl.int64)
    r0 = tl.arange(0, BT).to(tl.int64)
    cols = tl.arange(0, BD)
    cmask = cols < D
    if QW_REG:
        qw = (tl.load(q_buf + cols, mask=cmask, other=0.0).to(tl.float32)
              * tl.load(w_buf + cols, mask=cmask, other=0.0).to(tl.float32))
        if HAS_ONORM:
            oww = tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)
    t0 = pid * TPP
    if PF >= 1:
        rows_a = t0 * BT + r0
        off_a = tl.multiple_of(tl.load(offs), VEC)
        buf_a = tl.load(base + off_a + rows_a[:, None] * D + cols[None, :],
                        mask=(rows_a < N)[:, None] & cmask[None, :], other=0.0, eviction_policy="evict_first")
    if PF >= 2:
        kt_b = 1 // L                                                   # pair 1 = (tile kt_b, source ki_b)
        ki_b = 1 - kt_b * L
        rows_b = (t0 + kt_b) * BT + r0
        off_b = tl.multiple_of(tl.load(offs + ki_b), VEC)
        # `!= 0` keeps the mask bool under the triton 3.9 interpreter (its loads take only bool masks, and it
        # broadcasts the scalar comparison kt_b < TPP as an integer); the compiler folds it away
        buf_b = tl.load(base + off_b + rows_b[:, None] * D + cols[None, :],
                        mask=(((rows_b < N) & (kt_b < TPP)) != 0)[:, None] & cmask[None, :], other=0.0,
                        eviction_policy="evict_first")
    for tt in range(0, TPP):
        rows = (t0 + tt) * BT + r0                                      # [BT] int64
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        tile = rows[:, None] * D + cols[None, :]                        # [BT, BD] int64 element offsets
        m = tl.full([BT], float("-inf"), tl.float32)
        s = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, BD], tl.float32)
        lgp = logit_buf                                                 # advances by N per source (64-bit)
        for i in tl.range(0, L, num_stages=NS):
            if not QW_REG:
                qw = (tl.load(q_buf + cols, mask=cmask, other=0.0).to(tl.float32)
                      * tl.load(w_buf + cols, mask=cmask, other=0.0).to(tl.float32))
            if PF == 0:
                off = tl.multiple_of(tl.load(offs + i), VEC)
                x = tl.load(base + off + tile, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            else:
                x = buf_a.to(tl.float32)
                if PF == 2:
                    buf_a = buf_b
                # the pair PF steps ahead: k = tt*L + i + PF = (tile kt, source ki)
                k = tt * L + i + PF
                kt = k // L
                ki = k - kt * L
                rows_n = (t0 + kt) * BT + r0
                off_n = tl.multiple_of(tl.load(offs + ki), VEC)
                nxt = tl.load(base + off_n + rows_n[:, None] * D + cols[None, :],
                              mask=(((rows_n < N) & (kt < TPP)) != 0)[:, None] & cmask[None, :], other=0.0,
                              eviction_policy="evict_first")
                if PF == 2:
                    buf_b = nxt
                else:
                    buf_a = nxt
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
            if not QW_REG:
                oww = tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)
            ro = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
            o = o * ro[:, None] * oww[None, :]
        tl.store(out + tile, o.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _flat_step(k, NB, t0, TSTEP, BT: tl.constexpr, r0, BL: tl.constexpr, ll, N, L, offs, VEC: tl.constexpr):
    # step k of the flat (token tile, source block) loop of _fwd2_kernel / _fwd3_kernel, whose tiles are
    # t0, t0 + TSTEP, ...: (source block j, the tile's rows [BT] int64 and their mask, the block's sources [BL]
    # and their mask, their element offsets)
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
def _fwd2_kernel(
    base, offs,                   # base pointer (sources' dtype) and int64 element offsets [L]
    q_buf, w_buf, ow,             # [D] query, rms_weight (any float dtype; q*w is formed in float32 here),
                                  # output-norm weight (ow unused if not HAS_ONORM)
    out,                          # [N, D] sources' dtype
    logit_buf, lse_buf,           # [L, N] f32, [N] f32 (only written if SAVE)
    N, L, NB, eps, TPP, TSTEP,    # NB = cdiv(L, BL) source blocks; TPP: token tiles per program, which are
                                  # p*TPP, p*TPP + 1, ... (TSTEP = 1) or p, p + TSTEP, ... (TSTEP = the grid)
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BL: tl.constexpr, VEC: tl.constexpr,
    HAS_ONORM: tl.constexpr, SAVE: tl.constexpr, NS: tl.constexpr, QW_REG: tl.constexpr, OW_REG: tl.constexpr,
):
    # Same math as _fwd_kernel, another schedule. Program p owns the token tiles p*TPP .. p*TPP+TPP-1 and
    # walks ONE flat loop over the (tile, source block) pairs, so the compiler's software pipeline
    # (tl.range num_stages: cp.async into shared memory, NS - 1 steps in flight) runs across tile
    # boundaries instead of draining at the end of every token tile (which costs most at small L).
    # Each step loads BL sources of the BT rows at once ([BL, BT, BD]) and reduces their BL*BT logits
    # together, so one cross-warp reduction round (the serial part of the online softmax) serves BL
    # sources. The running state is reset arithmetically at the first block of a tile (alpha = 0).
    # QW_REG keeps q*w in registers; without it q*w is re-read (L1 hits) every step, which frees
    # D / (32 * num_warps) registers per thread for a second program per multiprocessor. OW_REG keeps the
    # output-norm weight in registers (its own dtype) instead of loading it at the end of every tile.
    pid = tl.program_id(0).to(tl.int64)
    r0 = tl.arange(0, BT).to(tl.int64)
    cols = tl.arange(0, BD)
    cmask = cols < D
    ll = tl.arange(0, BL)
    if QW_REG:
        qw = (tl.load(q_buf + cols, mask=cmask, other=0.0).to(tl.float32)
              * tl.load(w_buf + cols, mask=cmask, other=0.0).to(tl.float32))
    if OW_REG and HAS_ONORM:
        ow_r = tl.load(ow + cols, mask=cmask, other=0.0)
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
        if not QW_REG:
            qw = (tl.load(q_buf + cols, mask=cmask, other=0.0).to(tl.float32)
                  * tl.load(w_buf + cols, mask=cmask, other=0.0).to(tl.float32))
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
                if OW_REG:
                    oww = ow_r.to(tl.float32)
                else:
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
def _fwd3_kernel(
    base, offs, q_buf, w_buf, ow, out, logit_buf, lse_buf, N, L, NB, eps, TPP, TSTEP,  # as _fwd2_kernel's
    D: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
    VEC: tl.constexpr, HAS_ONORM: tl.constexpr, SAVE: tl.constexpr, NS: tl.constexpr, QW_REG: tl.constexpr,
    OW_REG: tl.constexpr,
):
    # _fwd2_kernel's schedule, math and QW_REG / OW_REG, with a row held as exact power-of-two column pieces
    # instead of one next_power_of_2(D) tile with masked columns: D = P1 + P2 + P3 (_pow2_parts), columns
    # [0, P1), [P1, P1 + P2), [P1 + P2, D); a piece of width 0 compiles away (every use sits under `if P2 > 0:`
    # / `if P3 > 0:`). At D = 7168 = 4096 + 2048 + 1024 and 4 warps, x, acc and q*w take 56 float32 registers
    # per thread each instead of 64, and no instruction works on masked-off columns. The pieces' partial
    # sums of x*x and x*qw are folded to the narrowest piece's width PM (_fold) and added, and the two are
    # reduced joined ([BL, BT, PM, 2]), so one cross-warp reduction round per step serves all pieces and both
    # sums (_fwd2_kernel: two rounds).
    PM: tl.constexpr = P3 if P3 > 0 else (P2 if P2 > 0 else P1)
    pid = tl.program_id(0).to(tl.int64)
    r0 = tl.arange(0, BT).to(tl.int64)
    ll = tl.arange(0, BL)
    c1 = tl.arange(0, P1)
    if P2 > 0:
        c2 = P1 + tl.arange(0, P2)
    if P3 > 0:
        c3 = P1 + P2 + tl.arange(0, P3)
    if QW_REG:
        qw1 = _qw_piece(q_buf, w_buf, c1)
        if P2 > 0:
            qw2 = _qw_piece(q_buf, w_buf, c2)
        if P3 > 0:
            qw3 = _qw_piece(q_buf, w_buf, c3)
    if OW_REG and HAS_ONORM:
        ow1 = tl.load(ow + c1)
        if P2 > 0:
            ow2 = tl.load(ow + c2)
        if P3 > 0:
            ow3 = tl.load(ow + c3)
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
        if not QW_REG:
            qw1 = _qw_piece(q_buf, w_buf, c1)
        ss = _fold(x1 * x1, PM)                                         # [BL, BT, PM]
        dot = _fold(x1 * qw1[None, None, :], PM)
        if P2 > 0:
            x2 = _src_piece(base, off, rows, c2, m3, D)
            if not QW_REG:
                qw2 = _qw_piece(q_buf, w_buf, c2)
            ss += _fold(x2 * x2, PM)
            dot += _fold(x2 * qw2[None, None, :], PM)
        if P3 > 0:
            x3 = _src_piece(base, off, rows, c3, m3, D)
            if not QW_REG:
                qw3 = _qw_piece(q_buf, w_buf, c3)
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
                if not OW_REG:
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


@triton.jit
def _bwd_kernel(
    base, offs, dx,               # sources (base + offsets), dx [L, N, D] sources' dtype (stacked grads)
    q, w, ow, dy,                 # dy [N, D]
    logit_buf, lse_buf,           # saved by the forward
    dqw_part, dow_part,           # [G, D] f32 per-program partial sums
    N, ND, L, eps, tiles_per_prog,       # ND = N * D (a Python int: 64-bit when it needs to be)
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, VEC: tl.constexpr, HAS_ONORM: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    G = tl.num_programs(0)
    cols = tl.arange(0, BD)
    cmask = cols < D
    qw = tl.load(q + cols, mask=cmask, other=0.0).to(tl.float32) * \
        tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_ONORM:
        oww = tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)
    dqw_acc = tl.zeros([BD], tl.float32)
    dow_acc = tl.zeros([BD], tl.float32)
    for j in range(0, tiles_per_prog):
        t = pid + j * G                                               # tile index (int64); t >= n_tiles is masked
        rows = t * BT + tl.arange(0, BT).to(tl.int64)
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        tile = rows[:, None] * D + cols[None, :]
        lse = tl.load(lse_buf + rows, mask=rmask, other=0.0)
        # pass 1: the pre-norm mix o = sum_i p_i x_i, from the saved logits
        o = tl.zeros([BT, BD], tl.float32)
        lgp = logit_buf
        for i in range(L):
            off = tl.multiple_of(tl.load(offs + i), VEC)
            x = tl.load(base + off + tile, mask=mask, other=0.0).to(tl.float32)
            lg = tl.load(lgp + rows, mask=rmask, other=0.0)
            lgp += N
            o += tl.exp(lg - lse)[:, None] * x
        g = tl.load(dy + tile, mask=mask, other=0.0).to(tl.float32)
        if HAS_ONORM:
            ro = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
            xhat = o * ro[:, None]
            dow_acc += tl.sum(xhat * g, axis=0)
            gw = g * oww[None, :]
            do = ro[:, None] * (gw - xhat * (tl.sum(gw * xhat, axis=1) / D)[:, None])
        else:
            do = g
        delta = tl.sum(do * o, axis=1)
        # pass 2: every source's gradient
        lgp = logit_buf
        dxp = dx                                                      # advances by N*D per source (64-bit)
        for i in range(L):
            off = tl.multiple_of(tl.load(offs + i), VEC)
            x = tl.load(base + off + tile, mask=mask, other=0.0).to(tl.float32)
            lg = tl.load(lgp + rows, mask=rmask, other=0.0)
            lgp += N
            p = tl.exp(lg - lse)
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            dl = p * (tl.sum(x * do, axis=1) - delta)
            dlr = dl * r
            dxi = p[:, None] * do + dlr[:, None] * (qw[None, :] - (lg * r / D)[:, None] * x)
            tl.store(dxp + tile, dxi.to(dx.dtype.element_ty), mask=mask)
            dxp += ND
            dqw_acc += tl.sum(dlr[:, None] * x, axis=0)
    tl.store(dqw_part + pid * D + cols, dqw_acc, mask=cmask)
    if HAS_ONORM:
        tl.store(dow_part + pid * D + cols, dow_acc, mask=cmask)


@triton.jit
def _phase1_logits_kernel(
    base, offs,                   # bank (base + int64 element offsets [L])
    qwT,                          # [D, QP] f32: (queries * rms_weights)^T, zero-padded to QP columns
    logit_buf,                    # [L, N, QP] f32 out
    N,
    D: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, QP: tl.constexpr, VEC: tl.constexpr, eps,
    NS: tl.constexpr, SPLIT: tl.constexpr = False,
):
    # program (token tile, bank source i): logits of all queries for BT tokens of source i, one read.
    # SPLIT (bf16 banks): qwT is bf16 [D, 3 QP], queries * rms_weights split into three bf16 parts (hi, mid,
    # lo: 24 significant bits, float32's) in column blocks [0, QP), [QP, 2 QP), [2 QP, 3 QP); the bf16 tile
    # as loaded times each part is exact, and each step's three MMAs go into a fresh accumulator that is
    # added to the running sum in IEEE float32 (the tensor cores' own accumulation over the 7168-long
    # reduction loses ~3e-5 relative: measured on the H200 with the sum carried through the MMAs)
    pid = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    rows = pid * BT + tl.arange(0, BT).to(tl.int64)
    rmask = rows < N
    kk = tl.arange(0, BK)
    qq = tl.arange(0, QP)
    off = tl.multiple_of(tl.load(offs + i), VEC)
    ptr = base + off + rows[:, None] * D
    dots = tl.zeros([BT, QP], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    QW: tl.constexpr = 3 * QP if SPLIT else QP
    for k0 in tl.range(0, D, BK, num_stages=NS):
        cols = k0 + kk
        cm = cols < D
        x = tl.load(ptr + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        if SPLIT:
            bp = qwT + cols[:, None] * QW + qq[None, :]
            part = tl.dot(x, tl.load(bp + 2 * QP, mask=cm[:, None], other=0.0))
            part = tl.dot(x, tl.load(bp + QP, mask=cm[:, None], other=0.0), part)
            part = tl.dot(x, tl.load(bp, mask=cm[:, None], other=0.0), part)
            dots += part
        else:
            b = tl.load(qwT + cols[:, None] * QW + qq[None, :], mask=cm[:, None], other=0.0)
            dots = tl.dot(xf, b, dots, input_precision="tf32x3")
    lg = dots * tl.rsqrt(ss / D + eps)[:, None]                     # [BT, QP]
    dst = logit_buf + (i.to(tl.int64) * N + rows[:, None]) * QP + qq[None, :]
    tl.store(dst, lg, mask=rmask[:, None])


@triton.jit
def _phase1_mix_kernel(
    base, offs, logit_buf,        # bank, logits [L, N, QP] f32
    m_out, s_out,                 # [Q, N] f32 out (softmax max and sum per query and token)
    acc,                          # [Q, N, D] out (float32 or a lower precision)
    N, NQP, L, Q,
    D: tl.constexpr, BC: tl.constexpr, QP: tl.constexpr, QB: tl.constexpr, NG: tl.constexpr,
    VEC: tl.constexpr, NS: tl.constexpr,
):
    # flat grid, query group fastest, so the programs that read the same bank chunk run side by side
    pid = tl.program_id(0).to(tl.int64)
    NC: tl.constexpr = (D + BC - 1) // BC
    g = pid % NG                          # query group of QB queries
    c = (pid // NG) % NC                  # d-chunk
    n = pid // (NG * NC)                  # token
    cols = c * BC + tl.arange(0, BC)
    cm = cols < D
    qq = g * QB + tl.arange(0, QB)
    qm = qq < Q
    # the running max over the bank (logits are tiny: [L, QB] floats per token)
    lgp = logit_buf + n * QP + qq
    mq = tl.full([QB], float("-inf"), tl.float32)
    for i in range(L):
        mq = tl.maximum(mq, tl.load(lgp, mask=qm, other=0.0))
        lgp += NQP
    a = tl.zeros([QB, BC], tl.float32)
    sq = tl.zeros([QB], tl.float32)
    row = n * D + cols
    lgp = logit_buf + n * QP + qq
    for i in tl.range(0, L, num_stages=NS):
        off = tl.multiple_of(tl.load(offs + i), VEC)
        x = tl.load(base + off + row, mask=cm, other=0.0).to(tl.float32)
        e = tl.exp(tl.load(lgp, mask=qm, other=0.0) - mq)
        lgp += NQP
        sq += e
        a += e[:, None] * x[None, :]
    dst = acc + (qq[:, None].to(tl.int64) * N + n) * D + cols[None, :]
    tl.store(dst, a.to(acc.dtype.element_ty), mask=qm[:, None] & cm[None, :])
    stat = (qm & (c == 0)) != 0           # `!= 0`: a bool mask under the triton 3.9 interpreter (see _fwd_kernel)
    tl.store(m_out + qq.to(tl.int64) * N + n, mq, mask=stat)
    tl.store(s_out + qq.to(tl.int64) * N + n, sq, mask=stat)


@triton.jit
def _phase1_stats_kernel(
    logit_buf,                    # [L, N, QP] f32: logits in, softmax numerators exp(logit - m) out (in place)
    m_out, s_out,                 # [Q, N] f32 out (softmax max and sum per query and token)
    N, NQP, L, Q,
    QP: tl.constexpr, BN: tl.constexpr, NS: tl.constexpr,
):
    # the softmax statistics over the bank, once per (token, query), so that the mix kernel needs no
    # max loop and no exp: [BN tokens, QP queries] per program, two passes over the L logit planes
    pid = tl.program_id(0).to(tl.int64)
    nn = pid * BN + tl.arange(0, BN).to(tl.int64)
    qq = tl.arange(0, QP)
    mask = (nn < N)[:, None] & (qq < Q)[None, :]
    ptr = logit_buf + nn[:, None] * QP + qq[None, :]
    mq = tl.full([BN, QP], float("-inf"), tl.float32)
    p = ptr
    for i in tl.range(0, L, num_stages=NS):
        mq = tl.maximum(mq, tl.load(p, mask=mask, other=0.0))
        p += NQP                                                    # 64-bit pointer arithmetic
    sq = tl.zeros([BN, QP], tl.float32)
    p = ptr
    for i in tl.range(0, L, num_stages=NS):
        e = tl.exp(tl.load(p, mask=mask, other=0.0) - mq)
        tl.store(p, e, mask=mask)
        sq += e
        p += NQP
    dst = qq[None, :].to(tl.int64) * N + nn[:, None]
    tl.store(m_out + dst, mq, mask=mask)
    tl.store(s_out + dst, sq, mask=mask)


@triton.jit
def _phase1_mix2_kernel(
    base, offs, wts,              # bank, softmax numerators [L, N, QP] f32 (from _phase1_stats_kernel)
    acc,                          # [Q, N, D] out (float32 or a lower precision)
    N, NQP, L, Q,
    D: tl.constexpr, BC: tl.constexpr, QP: tl.constexpr, QB: tl.constexpr, NG: tl.constexpr,
    VEC: tl.constexpr, NS: tl.constexpr,
):
    # acc_q = sum_i wts[i, n, q] x_i over one (token, d-chunk, query group) tile: a single pipelined loop
    # of independent loads (no max loop, no exp), query group fastest in the flat grid
    pid = tl.program_id(0).to(tl.int64)
    NC: tl.constexpr = (D + BC - 1) // BC
    g = pid % NG
    c = (pid // NG) % NC
    n = pid // (NG * NC)
    cols = c * BC + tl.arange(0, BC)
    cm = cols < D
    qq = g * QB + tl.arange(0, QB)
    qm = qq < Q
    a = tl.zeros([QB, BC], tl.float32)
    row = n * D + cols
    wp = wts + n * QP + qq
    for i in tl.range(0, L, num_stages=NS):
        off = tl.multiple_of(tl.load(offs + i), VEC)
        x = tl.load(base + off + row, mask=cm, other=0.0).to(tl.float32)
        e = tl.load(wp, mask=qm, other=0.0)
        wp += NQP
        a += e[:, None] * x[None, :]
    dst = acc + (qq[:, None].to(tl.int64) * N + n) * D + cols[None, :]
    tl.store(dst, a.to(acc.dtype.element_ty), mask=qm[:, None] & cm[None, :])


@triton.jit
def _phase1_mix3_kernel(
    base, offs, wts,              # bank, softmax numerators [L, N, QP] f32 (from _phase1_stats_kernel)
    acc,                          # [Q, N, D] out (float32 or a lower precision)
    N, NQP, L,
    D: tl.constexpr, BC: tl.constexpr, QP: tl.constexpr, LB: tl.constexpr, Q: tl.constexpr,
    VEC: tl.constexpr,
):
    # acc_q = sum_i wts[i, n, q] x_i for one (token, d-chunk) and EVERY query: the chunks of all L <= LB bank
    # sources are loaded at once ([LB, BC], all in flight together; no shared-memory pipeline), held in
    # registers, and each query's row is a thread-local sum over the LB axis, stored as it is formed
    pid = tl.program_id(0).to(tl.int64)
    NC: tl.constexpr = (D + BC - 1) // BC
    c = pid % NC
    n = pid // NC
    cols = c * BC + tl.arange(0, BC)
    cm = cols < D
    ll = tl.arange(0, LB)
    lm = ll < L
    off = tl.multiple_of(tl.load(offs + ll, mask=lm, other=0), VEC)
    x = tl.load(base + off[:, None] + (n * D + cols)[None, :], mask=lm[:, None] & cm[None, :],
                other=0.0).to(tl.float32)                                        # [LB, BC]
    wp = wts + ll.to(tl.int64) * NQP + n * QP
    for q in tl.static_range(Q):
        e = tl.load(wp + q, mask=lm, other=0.0)                                  # [LB]
        a = tl.sum(e[:, None] * x, axis=0)                                       # [BC]
        tl.store(acc + (q * N + n) * D + cols, a.to(acc.dtype.element_ty), mask=cm)


@triton.jit
def _merge_rows(a, x, mb, sb, qw, eps, D: tl.constexpr, HAS_PART: tl.constexpr):
    # the phase-2 merge of rows along the last axis (a: the bank's acc, x: the partial, qw: q*w, both broadcast to
    # a row; mb, sb: each row's softmax max and sum from phase 1, shaped to broadcast against a row statistic
    # ([BT, 1], or scalars for one row)): the online-softmax merge of the bank with the partial, or acc / s
    if HAS_PART:
        lp = tl.sum(x * qw, axis=-1, keep_dims=True) * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
        big = tl.maximum(mb, lp)
        ea = tl.exp(mb - big)
        eb = tl.exp(lp - big)
        o = (a * ea + x * eb) * (1.0 / (sb * ea + eb))
    else:
        o = a * (1.0 / sb)
    return o


@triton.jit
def _merge_kernel(
    acc, m_in, s_in, part, q, w, ow, out,
    N, eps,
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_PART: tl.constexpr, HAS_ONORM: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BT + tl.arange(0, BT).to(tl.int64)
    cols = tl.arange(0, BD)
    rmask = rows < N
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    tile = rows[:, None] * D + cols[None, :]
    a = tl.load(acc + tile, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    mb = tl.load(m_in + rows, mask=rmask, other=0.0).to(tl.float32)
    sb = tl.load(s_in + rows, mask=rmask, other=1.0).to(tl.float32)
    x = a                                       # (placeholders where there is no partial: unused then)
    if HAS_PART:
        x = tl.load(part + tile, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        qw = tl.load(q + cols, mask=cmask, other=0.0).to(tl.float32) * \
            tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
    o = _merge_rows(a, x, mb[:, None], sb[:, None], qw[None, :] if HAS_PART else a, eps, D, HAS_PART)
    if HAS_ONORM:
        ro = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
        o = o * ro[:, None] * tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + tile, o.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _merge2_kernel(
    acc, m_in, s_in, part, q, w, ow, out,
    N, eps, TPP, TSTEP,
    D: tl.constexpr, BD: tl.constexpr, HAS_PART: tl.constexpr, HAS_ONORM: tl.constexpr, NS: tl.constexpr,
):
    # _merge_kernel's math on a persistent grid: program p merges the rows p, p + TSTEP, ... (TSTEP = the grid;
    # TSTEP = 1: the contiguous rows p*TPP ...), one row per step of a software-pipelined loop (cp.async into
    # shared memory, NS - 1 rows of acc and partial in flight), as the forward's v2 / v3 schedule. q*w is held in
    # registers; the output-norm weight is loaded under a runtime branch, which keeps it out of the pipeline's
    # shared memory (re-read from L1 each row)
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    cmask = cols < D
    if HAS_PART:
        qw = tl.load(q + cols, mask=cmask, other=0.0).to(tl.float32) * \
            tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
    t0 = tl.where(TSTEP == 1, pid * TPP, pid)
    for k in tl.range(0, TPP, num_stages=NS):
        row = t0 + k * TSTEP
        ok = row < N
        mask = (cmask & ok) != 0                # `!= 0`: a bool mask under the triton 3.9 interpreter (see _fwd_kernel)
        a = tl.load(acc + row * D + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        mb = tl.load(m_in + row, mask=ok, other=0.0).to(tl.float32)
        sb = tl.load(s_in + row, mask=ok, other=1.0).to(tl.float32)
        x = a                                   # (placeholders where there is no partial: unused then)
        if HAS_PART:
            x = tl.load(part + row * D + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        o = _merge_rows(a, x, mb, sb, qw if HAS_PART else a, eps, D, HAS_PART)
        if HAS_ONORM:
            ro = tl.rsqrt(tl.sum(o * o) / D + eps)
            if ok:
                o = o * ro * tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out + row * D + cols, o.to(out.dtype.element_ty), mask=mask)

# ----------------------------------------------------------------------------------------------------
# launch helpers
# ----------------------------------------------------------------------------------------------------

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)

#: Forward launch settings for wide rows (d >= 2048), measured on an H200 (benchmarks/attn_residual.py
#: --sweep): {"impl": "v1" (_fwd_kernel, default), "v2" (_fwd2_kernel) or "v3" (_fwd3_kernel: v2 on the row's
#: exact power-of-two column pieces, where _pow2_parts finds them, else v2), "num_warps", "bt": rows per tile,
#: "progs_per_sm": persistent programs per SM (v2/v3: 0 = one program per tile, no persistent loop),
#: "maxnreg": register cap per thread; v1 only: "pf": 0|1|2 register prefetch depth, "ns": shared-memory
#: pipeline stages (pf 0 only), "qw_reg": keep q*w in registers; v2/v3 only: "bl": sources loaded and reduced
#: per step, "ns": pipeline stages of its flat (tile, source block) loop, "ow_reg": keep the output-norm weight
#: in registers (default: as qw_reg), "strided": program p takes the tiles p, p + grid, ... (the programs
#: running together read neighbouring rows) instead of one contiguous range of tiles}.
#: (H200, 2026-11-29, N = 65536: v2 with 4 warps, 3 stages, 2 programs per SM reached 3.58 / 3.81 / 3.78 TB/s
#: at L = 2 / 8 / 25, 84-89% of the 4.28 TB/s copy; the v1 setting before it 2.61 / 2.92 / 3.12)
#: 25th session (same sweep, N = 16384 / 65536, L = 2, CUDA-graph time): strided tiles, 3.92 -> 4.05 / 4.08 -> 4.19
#: TB/s with v3 (v2: 4.03 / 4.20), 95% / 98% of the 4.28 TB/s copy
FWD_DEFAULT: dict = {"impl": "v3", "num_warps": 4, "bt": 1, "bl": 1, "ns": 3, "progs_per_sm": 2, "strided": True}
#: The same with two sources per step (one cross-warp reduction round per two sources), used from
#: FWD_WIDE_L sources on: H200, 5th session, N = 16384 sweep: 4.07 / 4.14 TB/s (95% / 97% of copy) at
#: L = 8 / 25 against 3.78 / 3.81 for FWD_DEFAULT, but 2.19 against 2.31 at L = 2
#: 25th session, N = 16384, L = 8 / 25: strided tiles 4.25 / 4.26 -> 4.29 / 4.33 TB/s (v3; v2 4.30 / 4.32)
FWD_DEFAULT_WIDE: dict = {"impl": "v3", "num_warps": 4, "bt": 1, "bl": 2, "ns": 3, "progs_per_sm": 2, "strided": True}
FWD_WIDE_L = 6
#: Changes to the above with the fused output norm (benchmarks/attn_residual.py --sweep-onorm). The norm's
#: weight held in registers and two sources per step take ptxas to its 255-register cap (with 260 B of spill
#: stores at two sources per step, sm_90a). H200, 17th session, N = 16384, L = 2 / 8 / 25, CUDA-graph time:
#: 87% / 71% / 83% of copy without a change, 87% / 82% / 81% with one source per step, 89% / 90% / 90% with
#: that and the weight re-read from cache at each row's end (fla fused_attnres, tuned for the shape: 82% at L = 8).
#: 24th session: the exact-width kernel v3 (_fwd3_kernel: no masked lanes, 254 registers and no spills at two
#: sources per step with the weight re-read, where v2 spills 40 B) at two sources per step: 89% / 99% / 100%,
#: against 89% / 91% / 92% for v2 at one (same run; 86% / 98% / 99% with 4 stages)
#: 25th session: strided tiles, L = 2 / 8 / 25: 89% / 99% / 100% -> 92% / 100% / 102% (3.81 / 4.20 / 4.24 -> 3.92 /
#: 4.27 / 4.33 TB/s)
FWD_DEFAULT_ONORM: dict = {"impl": "v3", "bl": 2, "ow_reg": False, "strided": True}
#: ... and where d has no exact pieces (_pow2_parts: None), the 17th session's v2 setting with the norm (v2 at two
#: sources per step spills)
FWD_DEFAULT_ONORM_V2: dict = {"impl": "v2", "bl": 1, "ow_reg": False}
#: Overrides of the above (for the benchmark's sweep); empty in normal use.
FWD_CONFIG: dict = {}


def _offset_table(tensors: Sequence[torch.Tensor], where: str):
    """(base tensor, int64 element-offset table on the device, VEC alignment hint) for a list of tensors."""
    base = tensors[0]
    es = base.element_size()
    ptrs = [t.data_ptr() for t in tensors]
    for i, p in enumerate(ptrs):
        if (p - ptrs[0]) % es:
            raise ValueError(f"{where}: source {i} is not element-aligned relative to source 0")
    offs = _cached_table(tuple((p - ptrs[0]) // es for p in ptrs), base.device)
    vec = 16 // es if all(p % 16 == 0 for p in ptrs) else 1
    return base, offs, vec


#: offset tables already on the device, keyed by (device, offsets); a model's activations come back at the same
#: relative offsets step after step (torch's caching allocator), so after the first step a call builds no
#: table (at L = 2, N = 16384 the whole kernel takes ~0.17 ms, so ~10 us of host work per call shows). The
#: tables hold offsets, not pointers: a stale entry is still a right table for the same offsets.
_TABLES_MAX = 256
_TABLES = DeviceTableCache(_TABLES_MAX)


def _cached_table(offsets: tuple, device: torch.device) -> torch.Tensor:
    return _TABLES.get((str(device), offsets), lambda: device_table(list(offsets), torch.int64, device), device)


def _flat(t: torch.Tensor, d: int) -> torch.Tensor:
    return t.reshape(-1, d).contiguous()


def _check_device(t: torch.Tensor, where: str) -> None:
    if t.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"{where}: the Triton backend needs CUDA tensors (got {t.device}); use "
                         f"backends.reference on CPU, or set TRITON_INTERPRET=1 before importing triton")
    if t.dtype not in _SUPPORTED:
        raise TypeError(f"{where}: dtype {t.dtype} is not supported (float32, float16, bfloat16)")


def _row_tile(d: int, n: int):
    """(BT, BD, num_warps) of the row kernels: one tile holds BT whole rows of BD >= d columns."""
    bd = next_power_of_2(d)
    bt = max(1, min(16, 4096 // bd, next_power_of_2(max(n, 1))))
    nw = 4 if bd * bt <= 2048 else (8 if bd * bt <= 8192 else 16)
    return bt, bd, nw


def _num_sms(dev: torch.device) -> int:
    return sm_count(dev) if dev.type == "cuda" else 4


def _pow2_parts(d: int):
    """(P1, P2, P3), the column pieces of _fwd3_kernel: d = P1 + P2 + P3, powers of two, P1 > P2 > P3, 0 for an
    absent piece (7168 -> (4096, 2048, 1024), 5120 -> (4096, 1024, 0)); None when d has more than three set bits
    or its smallest piece would be narrower than 512 columns (one 16-byte load per thread of 4 warps in float32:
    a narrower piece leaves lanes idle)."""
    parts = [1 << b for b in range(d.bit_length() - 1, -1, -1) if d >> b & 1]
    if not parts or len(parts) > 3 or parts[-1] < 512:
        return None
    return tuple(parts + [0] * (3 - len(parts)))


def _fwd(query, xs, w, ow, eps, save):
    d = xs[0].shape[-1]
    n = xs[0].shape[0]
    L = len(xs)
    base, offs, vec = _offset_table(xs, "attn_residual")
    out = torch.empty_like(xs[0])
    bt, bd, nw = _row_tile(d, n)
    big = bd * bt >= 2048 and not _INTERPRET
    cfg = dict((FWD_DEFAULT_WIDE if L >= FWD_WIDE_L else FWD_DEFAULT) if big else {})
    if big and ow is not None:
        cfg.update(FWD_DEFAULT_ONORM if _pow2_parts(d) else FWD_DEFAULT_ONORM_V2)
    cfg.update(FWD_CONFIG)
    bt = cfg.get("bt", bt)
    nw = cfg.get("num_warps", nw)
    pf = cfg.get("pf", 1)
    ns = cfg.get("ns", 1) if pf == 0 else 1
    qw_reg = cfg.get("qw_reg", True)
    dev = xs[0].device
    if save:
        logit = torch.empty((L, n), dtype=torch.float32, device=dev)
        lse = torch.empty((n,), dtype=torch.float32, device=dev)
    else:
        logit = lse = out  # never touched (SAVE is False)
    impl = cfg.get("impl", "v1")
    parts = _pow2_parts(d) if impl == "v3" else None                 # None: v3 falls back to v2
    if n > 0 and impl in ("v2", "v3"):
        n_tiles = cdiv(n, bt)
        pps = cfg.get("progs_per_sm", 2)
        tpp = max(1, cdiv(n_tiles, pps * _num_sms(dev))) if pps > 0 else 1
        grid = cdiv(n_tiles, tpp)
        bl = cfg.get("bl", 1)
        qw_reg = cfg.get("qw_reg", True)
        ns = cfg.get("ns", 1)
        # the pipeline keeps ns - 1 steps in shared memory (plus q*w when it is re-read), each of `width`
        # columns (v2: the padded tile, v3: the row's exact pieces): settings chosen for bf16 would not fit for
        # float32 sources, so fewer stages then (the same result)
        width = d if parts else bd
        while ns > 1 and (ns - 1) * (bl * bt * width * xs[0].element_size()
                                + (0 if qw_reg else (query.element_size() + w.element_size()) * width)) > 200 * 1024:
            ns -= 1
        args = (base, offs, query, w, ow if ow is not None else w, out, logit, lse,
                n, L, cdiv(L, bl), float(eps), tpp, grid if cfg.get("strided") else 1)
        meta = dict(D=d, BT=bt, BL=bl, VEC=vec, HAS_ONORM=ow is not None, SAVE=save, NS=ns, QW_REG=qw_reg,
                    OW_REG=cfg.get("ow_reg", qw_reg) and not cfg.get("maxnreg"), num_warps=nw,
                    **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
        if parts:
            _fwd3_kernel[(grid,)](*args, P1=parts[0], P2=parts[1], P3=parts[2], **meta)
        else:
            _fwd2_kernel[(grid,)](*args, BD=bd, **meta)
    elif n > 0:
        n_tiles = cdiv(n, bt)
        progs = cfg.get("progs_per_sm", 2) * _num_sms(dev)
        tpp = max(1, cdiv(n_tiles, progs))
        grid = cdiv(n_tiles, tpp)
        _fwd_kernel[(grid,)](
            base, offs, query, w, ow if ow is not None else w, out, logit, lse,
            n, L, float(eps), tpp, D=d, BT=bt, BD=bd, VEC=vec,
            HAS_ONORM=ow is not None, SAVE=save, PF=pf, NS=ns, QW_REG=qw_reg, num_warps=nw,
            **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
    return out, offs, (logit if save else None), (lse if save else None)


class _AttnResFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, rms_weight, output_rms_weight, eps, *xs):
        save = ctx.needs_input_grad is not None and any(ctx.needs_input_grad)
        out, _, logit, lse = _fwd(query, xs, rms_weight, output_rms_weight, eps, save)
        if save:
            ctx.save_for_backward(query, rms_weight, output_rms_weight, logit, lse, *xs)
            ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, dy):
        no_create_graph("backends.triton.attn_residual")
        query, w, ow, logit, lse, *xs = ctx.saved_tensors
        eps = ctx.eps
        L = len(xs)
        n, d = xs[0].shape
        dev = xs[0].device
        base, offs, vec = _offset_table(xs, "attn_residual backward")
        dx = torch.empty((L, n, d), dtype=xs[0].dtype, device=dev)
        bt, bd, nw = _row_tile(d, n)
        if bd * bt >= 8192:
            nw = 16
        n_tiles = cdiv(n, bt)
        G = max(1, min(n_tiles, 4 * _num_sms(dev)))
        dqw = torch.zeros((G, d), dtype=torch.float32, device=dev)
        dow = torch.zeros((G, d), dtype=torch.float32, device=dev) if ow is not None else dqw
        dy = dy.contiguous()
        if n > 0:
            _bwd_kernel[(G,)](
                base, offs, dx, query, w, ow if ow is not None else query, dy, logit, lse, dqw, dow,
                n, n * d, L, float(eps), cdiv(n_tiles, G), D=d, BT=bt, BD=bd, VEC=vec, HAS_ONORM=ow is not None,
                num_warps=nw)
        dqw_t = dqw.sum(0)
        dq = (dqw_t * w.float()).to(query.dtype)
        dw = (dqw_t * query.float()).to(w.dtype)
        dow_t = dow.sum(0).to(ow.dtype) if ow is not None else None
        return (dq, dw, dow_t, None, *dx.unbind(0))


@on_tensor_device
def attn_residual(query: torch.Tensor, sources: Sequence[torch.Tensor], rms_weight: torch.Tensor, *,
                  eps: float = 1e-6, output_rms_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over depth (Block AttnRes), one fused Triton pass over the sources; differentiable.

    Math: arXiv 2603.15031 (Attention Residuals), spec/OPS.md "attn_residual":
    ``logit_i = <query, RMSNorm(sources_i; rms_weight, eps)>``, ``p = softmax_i(logit)`` (float32),
    ``out = sum_i p_i sources_i``, then ``RMSNorm(out; output_rms_weight, eps)`` if that weight is given.
    Computed with an online softmax over depth: every source element is read once, float32 accumulation,
    int64 indexing (right past 2^32 elements). Backward (torch.autograd) gives gradients for query,
    rms_weight, output_rms_weight and every source; it re-reads the sources twice.

    Args:
        query: [d] float tensor; rms_weight: [d]; output_rms_weight: optional [d].
        sources: list/tuple of L >= 1 tensors [..., d], same shape and dtype (float32, float16 or
            bfloat16), on a CUDA device (or on CPU under TRITON_INTERPRET=1). Any L (runtime value).
        eps: RMSNorm epsilon of both norms, > 0.

    Returns:
        out: [..., d] in the sources' dtype.

    Huge values (CPU tensors, scanned as for NaN / inf; not scanned on the GPU): a source value or |query *
    rms_weight| past 2^40, where the kernel's float32 sums could overflow, gives the reference's result (which
    scales such rows exactly); a result that overflows its dtype is the reference's ValueError.

    Raises:
        ValueError: empty sources, mismatched shapes/devices, wrong weight shapes, bad eps, CPU tensors
            without the interpreter, a CPU result that overflows its dtype.
        TypeError: non-tensor arguments, mismatched or unsupported dtypes.
    """
    shape, dtype, d = _ref.check_attn_residual_args(query, sources, rms_weight, eps, output_rms_weight)
    _check_device(sources[0], "attn_residual")
    warn_interpreter_bf16("backends.triton.attn_residual", *sources)
    if _ref.needs_safe_path(query, sources, rms_weight):
        # values past 2^40 (CPU inputs, scanned as for NaN / inf): the kernel's float32 sums of x^2 or of the
        # logits could overflow; the reference scales those rows exactly (the same result as there)
        return _ref.attn_residual(query, sources, rms_weight, eps=eps, output_rms_weight=output_rms_weight)
    xs = [_flat(s, d) for s in sources]
    q, w = query.contiguous(), rms_weight.contiguous()
    ow = output_rms_weight.contiguous() if output_rms_weight is not None else None
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, w, ow, *xs))):
        # nothing to differentiate: the kernel alone, without autograd.Function's bookkeeping (~10 us of
        # host work per call; at L = 2, N = 16384 the kernel itself takes ~0.18 ms on an H200)
        out = _fwd(q, xs, w, ow, float(eps), False)[0].view(shape)
    else:
        out = _AttnResFn.apply(q, w, ow, float(eps), *xs).view(shape)
    _ref.check_attn_residual_result(out, dtype, "attn_residual")
    return out


# ----------------------------------------------------------------------------------------------------
# two-phase form
# ----------------------------------------------------------------------------------------------------

#: Phase-1 launch settings for wide rows on the GPU: logits tile (p1_bt tokens x p1_bk columns, p1_ns
#: pipeline stages, p1_nw warps) and mix tile (mix_bc columns x mix_qb queries, mix_ns stages, mix_nw warps);
#: "mix_impl": "v1" (_phase1_mix_kernel: each mix program finds the max over the bank itself, a serial loop
#: of logit loads, then exps) or "v2" (_phase1_stats_kernel computes m, s and exp(logit - m) once per
#: token and query, in place of the logits; _phase1_mix2_kernel is then one loop of independent loads).
#: "p1_split": for bf16 banks, the logits as bf16 MMAs of the tile as loaded against queries * rms_weights
#: split into three bf16 parts, each step's sum promoted to an IEEE float32 accumulator (_phase1_logits_kernel;
#: other banks keep 3xTF32).
#: (H200 sweep, 2026-11-29: mix v2 with 1024 columns, 7.19 / 5.75 ms with f32 / bf16 acc against 7.35 / 6.55.)
#: (H200, 17th session, N = 16384, B = 4, three runs: p1_split with 128-token tiles and 8 warps, logits kernel
#: 1.15 -> 0.34 ms (0.81 -> 2.78 TB/s of bank read), phase 1 with acc bf16 3.58 -> 2.78 ms, error of m and s
#: against float64 unchanged (GPU test < 5e-6); the same three bf16 parts with the sum carried through the
#: MMAs, as tried in the 14th session, lost precision (~3e-5). Tried and removed: streaming (.cs) stores of acc
#: (2.78 ms either way); a "v3" mix (each token's bank tile read once, all queries' sums as 3xTF32 MMAs), 4.11-5.54 ms
#: against v2's 3.60 with acc bf16; logits as two TF32 products against a tf32 head and remainder of
#: queries * rms_weights, 1.31 against 1.14 ms and 3.6e-5 error.)
#: "mix_impl": "v3" (25th session): _phase1_mix3_kernel, one program per (token, "mix3_bc" columns) for every
#: query, all bank sources' chunks loaded at once into registers (no shared-memory pipeline; banks of up to
#: MIX3_MAX_BANK sources and MIX3_MAX_Q queries, else v2). H200, N = 16384, d = 7168, 24 queries, acc bf16, the
#: mix kernel alone (CUDA-graph time): B = 7 1.90 ms (3.83 TB/s of bank read + acc write) against v2's 3.03, B = 4
#: 1.75 against 2.47, B = 2 1.64; v2 with 5 or 8 stages was slower still (3.26, 3.67 at B = 7); a store-only
#: kernel on v2's grid writes acc in 1.25 ms (4.50 TB/s), torch fill_ in 1.66.
P1_DEFAULT: dict = {"p1_bt": 128, "p1_bk": 64, "p1_ns": 4, "p1_nw": 8, "mix_bc": 1024, "mix_qb": 8, "mix_ns": 3,
                    "mix_nw": 4, "mix_impl": "v3", "mix3_bc": 1024, "mix3_nw": 4, "p1_split": True}
#: the largest bank (rounded up to a power of two) and query count of the v3 mix
MIX3_MAX_BANK = 16
MIX3_MAX_Q = 64
#: Overrides of the above (for the benchmark's sweep); empty in normal use.
P1_CONFIG: dict = {}
#: Merge-kernel launch settings for wide rows ({"impl": "v1" (_merge_kernel, one program per "bt" rows; the
#: default when absent) or "v2" (_merge2_kernel, persistent: "progs_per_sm", "ns" pipeline stages, "strided"
#: (default True)), "num_warps"}); empty = _row_tile's choice (1 row of 7168, 8 warps). H200, 17th session, three
#: runs, 24 merges of a block at N = 16384: 4 warps 5.02-5.05 ms against 8 warps 5.65-5.67 (the 6th session had
#: measured 5.11 against 4.96); streaming (.cs) stores, tried, within noise (4.99). 25th session: v2 with 4 warps,
#: 2 programs per SM, 3 stages: 24 merges with float32 queries / weights 5.00 -> 4.63 ms (8 warps 4.48; 3 programs
#: per SM 5.42, 2 stages 4.78, contiguous tiles 4.76); with bf16 ones (K3's), B = 2 / 5 / 7, three interleaved
#: repeats, CUDA-graph time: 4.20-4.22 against v1's 4.22-4.24 ms (3.9 TB/s: v1 was already near copy there), 8
#: warps 4.21-4.23
MERGE_DEFAULT: dict = {"impl": "v2", "num_warps": 4}
#: Overrides of the above (for the benchmark's sweep); empty in normal use.
MERGE_CONFIG: dict = {}


def _phase1_launch(queries, xs, rms_weights, eps, acc_dtype, logits_only=False):
    # logits_only: stop after the logits kernel (the benchmark times it alone); acc, m, s are then unset
    L = len(xs)
    n, d = xs[0].shape
    Q = queries.shape[0]
    dev = xs[0].device
    base, offs, vec = _offset_table(xs, "attn_residual_phase1")
    QP = max(16, next_power_of_2(Q))
    if _INTERPRET:
        cfg = {"p1_bt": 16, "p1_bk": min(64, next_power_of_2(d)), "p1_ns": 1, "p1_nw": 4,
               "mix_bc": min(64, next_power_of_2(d)), "mix_qb": min(8, next_power_of_2(Q)),
               "mix_ns": 1, "mix_nw": 4, "mix3_bc": min(64, next_power_of_2(d)), "mix3_nw": 4}
        cfg["mix_impl"] = P1_CONFIG.get("mix_impl", P1_DEFAULT.get("mix_impl"))
    else:
        cfg = dict(P1_DEFAULT)
        cfg.update(P1_CONFIG)
        cfg["mix_bc"] = min(cfg["mix_bc"], next_power_of_2(d))
        cfg["p1_bk"] = min(cfg["p1_bk"], next_power_of_2(d))
        cfg["mix_qb"] = min(cfg["mix_qb"], next_power_of_2(Q))
        cfg["mix3_bc"] = min(cfg["mix3_bc"], next_power_of_2(d))
    qw = (queries.float() * rms_weights.float()).t()                 # [d, Q]
    # (not under the interpreter: its bf16 dot is unreliable; the GPU tests cover this path)
    split = bool(cfg.get("p1_split")) and xs[0].dtype == torch.bfloat16 and not _INTERPRET
    if split:
        qwT = torch.zeros((d, 3 * QP), dtype=torch.bfloat16, device=dev)
        rest = qw
        for j in range(3):                                           # hi, mid, lo: 8 significant bits each
            qwT[:, j * QP:j * QP + Q] = rest
            rest = rest - qwT[:, j * QP:j * QP + Q].float()
    else:
        qwT = torch.zeros((d, QP), dtype=torch.float32, device=dev)
        qwT[:, :Q] = qw
    logit = torch.empty((L, n, QP), dtype=torch.float32, device=dev)
    m = torch.empty((Q, n), dtype=torch.float32, device=dev)
    s = torch.empty((Q, n), dtype=torch.float32, device=dev)
    one = L == 1 and not logits_only
    if one:
        # one source: logit = m, exp(logit - m) = 1, so s = 1 and acc_q = x_0 for every query, exactly. acc
        # is x_0 broadcast over the queries (a view; a converted copy when acc_dtype is not x_0's dtype)
        x0 = xs[0] if xs[0].dtype == acc_dtype else xs[0].to(acc_dtype)
        acc = x0.unsqueeze(0).expand(Q, n, d)
        s.fill_(1.0)
    else:
        acc = torch.empty((Q, n, d), dtype=acc_dtype, device=dev)
    if n == 0:
        return acc, m, s
    bt = cfg["p1_bt"]
    _phase1_logits_kernel[(cdiv(n, bt), L)](
        base, offs, qwT, logit, n, D=d, BT=bt, BK=cfg["p1_bk"], QP=QP, VEC=vec, eps=float(eps),
        NS=cfg["p1_ns"], SPLIT=split, num_warps=cfg["p1_nw"])
    if one:
        m.copy_(logit[0, :, :Q].t())
        return acc, m, s
    if logits_only:
        return acc, m, s
    qb = cfg["mix_qb"]
    bc = cfg["mix_bc"]
    ng = cdiv(Q, qb)
    impl = cfg.get("mix_impl", "v1")
    if impl == "v3" and (next_power_of_2(L) > MIX3_MAX_BANK or Q > MIX3_MAX_Q):
        impl = "v2"                     # the bank's chunks would not fit in registers, or too many unrolled queries
    if impl in ("v2", "v3"):
        bn = 16 if _INTERPRET else 64
        _phase1_stats_kernel[(cdiv(n, bn),)](logit, m, s, n, n * QP, L, Q, QP=QP, BN=bn,
                                                   NS=1 if _INTERPRET else 2, num_warps=4)
        if impl == "v3":
            bc3 = cfg["mix3_bc"]
            _phase1_mix3_kernel[(n * cdiv(d, bc3),)](
                base, offs, logit, acc, n, n * QP, L, D=d, BC=bc3, QP=QP, LB=next_power_of_2(L), Q=Q, VEC=vec,
                num_warps=max(1, min(cfg["mix3_nw"], bc3 // 256)))   # >= 8 columns per thread
        else:
            _phase1_mix2_kernel[(n * cdiv(d, bc) * ng,)](
                base, offs, logit, acc, n, n * QP, L, Q, D=d, BC=bc, QP=QP, QB=qb, NG=ng, VEC=vec,
                NS=cfg["mix_ns"], num_warps=cfg["mix_nw"])
        return acc, m, s
    _phase1_mix_kernel[(n * cdiv(d, bc) * ng,)](
        base, offs, logit, m, s, acc, n, n * QP, L, Q, D=d, BC=bc, QP=QP, QB=qb, NG=ng, VEC=vec,
        NS=cfg["mix_ns"], num_warps=cfg["mix_nw"])
    return acc, m, s


class _Phase1Fn(torch.autograd.Function):
    """Triton forward; backward by recomputation through the float32 reference (correct, not fast)."""

    @staticmethod
    def forward(ctx, queries, rms_weights, eps, acc_dtype, *xs):
        ctx.save_for_backward(queries, rms_weights, *xs)
        ctx.eps = eps
        acc, m, s = _phase1_launch(queries, xs, rms_weights, eps, acc_dtype)
        return acc, m, s

    @staticmethod
    def backward(ctx, dacc, dm, ds):
        no_create_graph("backends.triton.attn_residual_phase1")
        queries, rms_weights, *xs = ctx.saved_tensors
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(True) for t in (queries, rms_weights, *xs)]
            acc, m, s = _ref.attn_residual_phase1(ins[0], ins[2:], ins[1], eps=ctx.eps)
            outs, gs = [], []
            for o, g in ((acc, dacc), (m, dm), (s, ds)):
                if g is not None:
                    outs.append(o)
                    gs.append(g.float())
            grads = torch.autograd.grad(outs, ins, gs, allow_unused=True)
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, ins)]
        return (grads[0], grads[1], None, None, *grads[2:])


@on_tensor_device
def attn_residual_phase1(queries: torch.Tensor, bank: Sequence[torch.Tensor], rms_weights: torch.Tensor, *,
                         eps: float = 1e-6, acc_dtype: torch.dtype = torch.float32):
    """Phase 1 of the two-phase Block AttnRes: all Q queries of a block against the completed bank.

    Math: spec/OPS.md "Two-phase form" (online softmax, flash-attention merge rule). For query q and
    bank source i: ``logit_qi = <queries[q], RMSNorm(bank_i; rms_weights[q], eps)>``, ``m_q = max_i logit_qi``,
    ``s_q = sum_i exp(logit_qi - m_q)``, ``acc_q = sum_i exp(logit_qi - m_q) bank_i``.
    Kernels: the logits of all Q queries come from one read of the bank (a [tokens, d] x [d, Q]
    tensor-core product, float32-accurate: 3xTF32, or for bf16 banks the tile against queries * rms_weights in
    three bf16 parts), then the softmax max and sum per token and query; the weighted sums are formed per
    (token, d-chunk) tile for every query (banks of up to MIX3_MAX_BANK sources; larger ones per (token,
    d-chunk, query-group) tile) and written once.

    Args:
        queries: [Q, d] float tensor; rms_weights: [Q, d].
        bank: list/tuple of L >= 1 tensors [..., d], same shape/dtype (float32/float16/bfloat16), CUDA
            (or CPU under TRITON_INTERPRET=1).
        eps: RMSNorm epsilon, > 0.
        acc_dtype: dtype of ``acc``; float32 (the contract, default) or the bank's dtype to halve the
            bytes written and read by the merges (acc is then rounded once; m and s stay float32).

    Returns:
        (acc [Q, ..., d] acc_dtype, m [Q, ...] float32, s [Q, ...] float32), as the reference.
        For a bank of one source, acc is that source broadcast over the Q queries (a read-only expanded
        view, or of its copy in acc_dtype): the same values, Q - 1 fewer [..., d] tensors written.
        Differentiable (the backward recomputes through the float32 reference: correct but not fast).

    Raises:
        ValueError / TypeError: as the reference (empty bank, mismatched shapes or dtypes, bad eps, a CPU
            result that overflows), unsupported dtypes, CPU tensors without the interpreter. CPU inputs past
            2^40 give the reference's result (as attn_residual).
    """
    shape, dtype, Q, d = _ref.check_phase1_args(queries, bank, rms_weights, eps, acc_dtype=acc_dtype)
    _check_device(bank[0], "attn_residual_phase1")
    if _ref.needs_safe_path(queries, bank, rms_weights):
        # values past 2^40 (CPU inputs): the reference's exactly scaled rows, as attn_residual
        return _ref.attn_residual_phase1(queries, bank, rms_weights, eps=eps, acc_dtype=acc_dtype)
    xs = [_flat(b, d) for b in bank]
    acc, m, s = _Phase1Fn.apply(queries.contiguous(), rms_weights.contiguous(), float(eps), acc_dtype, *xs)
    tok = shape[:-1]
    acc, m, s = acc.view(Q, *tok, d), m.view(Q, *tok), s.view(Q, *tok)
    _ref.check_two_phase_result("attn_residual_phase1", m=m, s=s, acc=acc)
    return acc, m, s


class _MergeFn(torch.autograd.Function):
    """Triton forward; backward by recomputation through the float32 reference (correct, not fast)."""

    @staticmethod
    def forward(ctx, acc, m, s, partial, query, w, ow, eps, out_dtype):
        ctx.save_for_backward(acc, m, s, partial, query, w, ow)
        ctx.eps = eps
        n, d = acc.shape
        out = torch.empty((n, d), dtype=out_dtype, device=acc.device)
        if n > 0:
            bt, bd, nw = _row_tile(d, n)
            mcfg = {}
            if bd * bt >= 2048 and not _INTERPRET:
                mcfg = dict(MERGE_DEFAULT)
            mcfg.update(MERGE_CONFIG)                     # (the CPU tests set "impl" here)
            bt = mcfg.get("bt", bt)
            nw = mcfg.get("num_warps", nw)
            args = (acc, m, s, partial if partial is not None else acc, query, w, ow if ow is not None else query,
                    out, n, float(eps))
            if mcfg.get("impl") == "v2":
                pps = mcfg.get("progs_per_sm", 2)
                ns = mcfg.get("ns", 3)
                # the pipeline holds ns - 1 rows of acc and partial per program: with float32 ones two programs
                # would not fit an SM's shared memory at 3 stages (a second wave of programs), so fewer stages
                row_bytes = bd * (acc.element_size() + (partial.element_size() if partial is not None else 0))
                while ns > 2 and pps * (ns - 1) * row_bytes > 200 * 1024:
                    ns -= 1
                tpp = max(1, cdiv(n, pps * _num_sms(acc.device)))
                grid = cdiv(n, tpp)
                _merge2_kernel[(grid,)](*args, tpp, grid if mcfg.get("strided", True) else 1, D=d, BD=bd,
                                        HAS_PART=partial is not None, HAS_ONORM=ow is not None, NS=ns,
                                        num_warps=nw)
            else:
                _merge_kernel[(cdiv(n, bt),)](*args, D=d, BT=bt, BD=bd, HAS_PART=partial is not None,
                                              HAS_ONORM=ow is not None, num_warps=nw)
        return out

    @staticmethod
    def backward(ctx, dout):
        no_create_graph("backends.triton.attn_residual_merge")
        saved = ctx.saved_tensors
        with torch.enable_grad():
            ins = [None if t is None else t.detach().requires_grad_(t.dtype.is_floating_point) for t in saved]
            acc, m, s, partial, query, w, ow = ins
            out = _ref.attn_residual_merge(acc, m, s, partial, query, w, eps=ctx.eps, output_rms_weight=ow,
                                           out_dtype=torch.float32)
            used = [t for t in ins if t is not None]
            g = torch.autograd.grad(out, used, dout.float(), allow_unused=True)
        it = iter(g)
        grads = []
        for t in ins:
            if t is None:
                grads.append(None)
            else:
                gi = next(it)
                grads.append(None if gi is None else gi.to(t.dtype))
        return (*grads, None, None)


@on_tensor_device
def attn_residual_merge(acc: torch.Tensor, m: torch.Tensor, s: torch.Tensor, partial: Optional[torch.Tensor],
                        query: torch.Tensor, rms_weight: torch.Tensor, *, eps: float = 1e-6,
                        output_rms_weight: Optional[torch.Tensor] = None,
                        out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Phase 2 of the two-phase Block AttnRes: merge one query's bank result with the in-block partial.

    Math: online-softmax merge (flash-attention), spec/OPS.md "Two-phase form":
    ``l_p = <query, RMSNorm(partial; rms_weight, eps)>``, ``M = max(m, l_p)``,
    ``out = (exp(m-M) acc + exp(l_p-M) partial) / (exp(m-M) s + exp(l_p-M))`` (``acc / s`` without a
    partial), then the optional output RMSNorm; one read of acc and partial, one write, float32 math.
    Equals ``attn_residual(query, bank + [partial], rms_weight, ...)``.

    Args:
        acc: [..., d] one query's phase-1 result ``acc[q]`` (float32, or the reduced acc_dtype).
        m, s: [...] float32, ``m[q]``, ``s[q]`` from phase 1.
        partial: [..., d] the in-block partial source, or None.
        query, rms_weight: [d], row q of phase 1's queries / rms_weights.
        eps: RMSNorm epsilon, > 0. output_rms_weight: optional [d] fused output-norm weight.
        out_dtype: result dtype; default partial's dtype, or acc's dtype without a partial.

    Returns:
        out: [..., d] in ``out_dtype``. Differentiable (backward through the float32 reference).

    Raises:
        ValueError / TypeError: mismatched shapes, non-float tensors, bad eps, unsupported dtypes, CPU
            tensors without the interpreter, a CPU result that overflows. CPU inputs past 2^40 give the
            reference's result (as attn_residual).
    """
    tok, d = _ref.check_merge_args(acc, m, s, partial, query, rms_weight, eps, output_rms_weight)
    _check_device(acc, "attn_residual_merge")
    if partial is not None:
        _check_device(partial, "attn_residual_merge")
    if out_dtype is None:
        out_dtype = partial.dtype if partial is not None else acc.dtype
    if out_dtype not in _SUPPORTED:
        raise TypeError(f"attn_residual_merge: out_dtype {out_dtype} is not float32/float16/bfloat16")
    if _ref.needs_safe_path(query, [acc] + ([partial] if partial is not None else []), rms_weight):
        # values past 2^40 (CPU inputs): the reference's exactly scaled rows, as attn_residual
        return _ref.attn_residual_merge(acc, m, s, partial, query, rms_weight, eps=eps,
                                        output_rms_weight=output_rms_weight, out_dtype=out_dtype)
    out = _MergeFn.apply(_flat(acc, d), m.reshape(-1).float().contiguous(), s.reshape(-1).float().contiguous(),
                         _flat(partial, d) if partial is not None else None,
                         query.contiguous(), rms_weight.contiguous(),
                         output_rms_weight.contiguous() if output_rms_weight is not None else None,
                         float(eps), out_dtype)
    out = out.view(*tok, d)
    _ref.check_two_phase_result("attn_residual_merge", out=out)
    return out
