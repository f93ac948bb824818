"""Triton kernels of the latent MoE (routing, Quantile Balancing, grouped expert GEMMs).

The Python entry points, argument checks and autograd live in ``backends/triton/moe.py``; this
module holds only ``@triton.jit`` code. Conventions shared by every kernel:

* Rows of the routed problem are the N*k (token, slot) pairs, SORTED by expert ("dispatch order"):
  rows offs[e] .. offs[e+1]-1 belong to expert e. ``tok[r]`` is the token of row r.
* A grouped GEMM is launched on a flat 1-D grid of ``max_tiles * n_tiles`` programs:
  program -> (m-tile t, n-tile) with the n-tile fastest, so the programs of one expert run
  together and share its weights and its token rows through L2. ``tile_expert[t]`` names the
  expert of m-tile t (E for the unused tail of the upper-bound grid: such programs return at
  once) and ``tile_start[e]`` is expert e's first m-tile, so the m-tile covers rows
  ``offs[e] + (t - tile_start[e]) * BM`` up to ``offs[e+1]`` (exclusive). No host sync is needed
  to launch: the grid is an upper bound, ``cdiv(N k, BM) + min(E, N k)``.
* Every row index is widened to int64 before it is multiplied by a stride, so N*k*width beyond
  2**31 elements is fine; expert offsets (e * stride_e) are int64 too.
"""
import triton
import triton.language as tl


# ------------------------------------------------------------------------------------------------
# elementwise helpers
# ------------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x, FAST: tl.constexpr):
    if FAST:
        # MUFU.TANH (max relative error about 2^-11): ample for bf16 outputs
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        big = (1.0 - e) / (1.0 + e)
        x2 = ax * ax
        small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
        t = tl.where(ax < 0.0625, small, big)
        return tl.where(x < 0, -t, t)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _sigmoid_act(x, FAST: tl.constexpr):
    """sigmoid for the GLU activations: with FAST 0.5 tanh(x/2) + 0.5 on MUFU.TANH (one special-function op, no
    division: the GLU epilogues and the backward's row pass are arithmetic-bound on the exact form's exp and IEEE
    division; benchmarks/results/moe.md); else the exact form. (The router's scores keep the exact _sigmoid.)"""
    if FAST:
        return 0.5 * _tanh(0.5 * x, FAST) + 0.5
    else:
        return _sigmoid(x)


@triton.jit
def _glu_fwd(a, b, beta_gate, beta_up, ACT: tl.constexpr, FAST: tl.constexpr):
    """ACT 0: SiTU-GLU  (bg tanh(a/bg) sigmoid(a)) (bu tanh(b/bu));  ACT 1: SwiGLU silu(a) b.
    (a / bg is formed as a * (1 / bg): one scalar division, not one per element.)"""
    sa = _sigmoid_act(a, FAST)
    if ACT == 0:
        g = beta_gate * _tanh(a * (1.0 / beta_gate), FAST) * sa
        v = beta_up * _tanh(b * (1.0 / beta_up), FAST)
    else:
        g = a * sa
        v = b
    return g * v


@triton.jit
def _glu_bwd(a, b, dh, beta_gate, beta_up, ACT: tl.constexpr, FAST: tl.constexpr):
    """Returns (h, dA, dB) for h = g(a) v(b): dA = dh v g'(a), dB = dh g v'(b)."""
    sa = _sigmoid_act(a, FAST)
    if ACT == 0:
        tg = _tanh(a * (1.0 / beta_gate), FAST)
        tb = _tanh(b * (1.0 / beta_up), FAST)
        g = beta_gate * tg * sa
        dg = (1.0 - tg * tg) * sa + g * (1.0 - sa)
        v = beta_up * tb
        dv = 1.0 - tb * tb
    else:
        g = a * sa
        dg = sa * (1.0 + a * (1.0 - sa))
        v = b
        dv = 1.0
    return g * v, dh * v * dg, dh * g * dv


# SiTU-GLU elementwise (the shared experts' activation)
@triton.jit
def _situ_fwd_ew(a_ptr, b_ptr, h_ptr, M, beta_gate, beta_up, ACT: tl.constexpr, FAST: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < M
    a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = _glu_fwd(a, b, beta_gate, beta_up, ACT, FAST)
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def _situ_bwd_ew(a_ptr, b_ptr, dh_ptr, da_ptr, db_ptr, M, beta_gate, beta_up, ACT: tl.constexpr,
                 FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < M
    a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=m, other=0.0).to(tl.float32)
    _, da, db = _glu_bwd(a, b, dh, beta_gate, beta_up, ACT, FAST)
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=m)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------------
# routing
# ------------------------------------------------------------------------------------------------
@triton.jit
def _route_topk_kernel(logit_ptr, bias_ptr, score_ptr, idx_ptr, wt_ptr, alpha_ptr, bad_ptr,
                       N, E, routed_scaling,
                       K_SEL: tl.constexpr, K_PAD: tl.constexpr, FROM_LOGITS: tl.constexpr, WRITE_TOPK: tl.constexpr,
                       WRITE_ALPHA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per row: scores = sigmoid(logits) (FROM_LOGITS) or the given scores; biased top-K_SEL by
    repeated (max, lowest index among equals) scans, so ties go to the lower expert index exactly.
    WRITE_TOPK: indices + renormalised unbiased weights of the first K_SEL picks (from logits: formed in log
    space, softmax of log sigmoid, so that picks whose scores all underflow to 0 still get finite weights).
    WRITE_ALPHA: the K_SEL-th largest biased value (qb_update's cut-off, with K_SEL = k + 1).
    A row with a non-finite input, or any non-finite bias, sets bad[row] = 1 (the host raises) and is computed
    on zeros."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < N
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    raw = tl.load(logit_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    finite = (raw == raw) & (tl.abs(raw) < float("inf"))
    nbad = tl.sum((m2 & (~finite)).to(tl.int32), axis=1)
    bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    bias_bad = tl.sum((cmask & ~((bias == bias) & (tl.abs(bias) < float("inf")))).to(tl.int32), axis=0)
    tl.store(bad_ptr + rows, ((nbad + bias_bad) > 0).to(tl.int32), mask=rmask)
    bias = tl.where(bias == bias, bias, 0.0)
    raw = tl.where(finite, raw, 0.0)
    if FROM_LOGITS:
        s = _sigmoid(raw)
        tl.store(score_ptr + offs, s, mask=m2)
        lw = tl.minimum(raw, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(raw)))       # log sigmoid, no underflow
    else:
        s = raw
        lw = tl.log(raw)
    v = tl.where(m2, s + bias[None, :], float("-inf"))
    kc = tl.arange(0, K_PAD)
    picked_w = tl.zeros([BLOCK_R, K_PAD], dtype=tl.float32)
    picked_i = tl.zeros([BLOCK_R, K_PAD], dtype=tl.int64)
    last = tl.zeros([BLOCK_R], dtype=tl.float32)
    for j in tl.static_range(K_SEL):
        mx = tl.max(v, axis=1)
        hit = v == mx[:, None]
        sel = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
        one = cols[None, :] == sel[:, None]
        last = mx
        if WRITE_TOPK:
            lj = tl.sum(tl.where(one, lw, 0.0), axis=1)
            picked_w = tl.where(kc[None, :] == j, lj[:, None], picked_w)
            picked_i = tl.where(kc[None, :] == j, sel.to(tl.int64)[:, None], picked_i)
        v = tl.where(one, float("-inf"), v)
    if WRITE_TOPK:
        picked_w = tl.where(kc[None, :] < K_SEL, picked_w, float("-inf"))     # log weights of the picks
        ew = tl.exp(picked_w - tl.max(picked_w, axis=1)[:, None])
        wt = ew * (routed_scaling / tl.sum(ew, axis=1))[:, None]
        ko = rows.to(tl.int64)[:, None] * K_SEL + kc[None, :]
        km = rmask[:, None] & (kc[None, :] < K_SEL)
        tl.store(idx_ptr + ko, picked_i, mask=km)
        tl.store(wt_ptr + ko, wt, mask=km)
    if WRITE_ALPHA:
        tl.store(alpha_ptr + rows, last, mask=rmask)


@triton.jit
def _qb_count_kernel(score_ptr, alpha_ptr, cnt_ptr, N, E, q, PASS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """One pass of a 4-bit-digit radix select of the (q+1)-th largest margin per expert column.

    Keys: margin = score - alpha[row] mapped to an order-preserving integer in [0, 2^32).
    The prefix of digits found by passes < PASS is rebuilt from their counts (cnt[p, e, c] =
    #(key >= prefix_p | c << shift_p)): digit_p = the largest c whose count is >= q + 1.
    This pass adds #(key >= prefix | c << shift) for c = 0..15 into cnt[PASS, e, c]."""
    pid_n = tl.program_id(0)
    pid_e = tl.program_id(1)
    cols = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < E
    dig = tl.arange(0, 16)
    prefix = tl.zeros([BLOCK_E], dtype=tl.int64)
    for p in tl.static_range(PASS):
        c = tl.load(cnt_ptr + (p * E + cols[:, None]) * 16 + dig[None, :], mask=cmask[:, None], other=0)
        d = tl.max(tl.where(c >= q + 1, dig[None, :], 0), axis=1)
        prefix = prefix | (d.to(tl.int64) << (28 - 4 * p))
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    m2 = rmask[:, None] & cmask[None, :]
    s = tl.load(score_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=m2, other=0.0)
    al = tl.load(alpha_ptr + rows, mask=rmask, other=0.0)
    marg = s.to(tl.float32) - al[:, None]
    bits = marg.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648
    key = tl.where(m2, key, -1)  # padding never counts
    for cc in tl.static_range(16):
        t = prefix | (cc << (28 - 4 * PASS))
        n_ge = tl.sum((key >= t[None, :]).to(tl.int32), axis=0)
        tl.atomic_add(cnt_ptr + (PASS * E + cols) * 16 + cc, n_ge, mask=cmask)


@triton.jit
def _qb_finish_kernel(cnt_ptr, bhat_ptr, E, q, BLOCK_E: tl.constexpr):
    """b_hat[e] = -(the (q+1)-th largest margin of column e), from the 8 passes' counts."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < E
    dig = tl.arange(0, 16)
    prefix = tl.zeros([BLOCK_E], dtype=tl.int64)
    for p in tl.static_range(8):
        c = tl.load(cnt_ptr + (p * E + cols[:, None]) * 16 + dig[None, :], mask=cmask[:, None], other=0)
        d = tl.max(tl.where(c >= q + 1, dig[None, :], 0), axis=1)
        prefix = prefix | (d.to(tl.int64) << (28 - 4 * p))
    key = (prefix - 2147483648).to(tl.int32)
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    val = bits.to(tl.float32, bitcast=True)
    tl.store(bhat_ptr + cols, -val, mask=cmask)


@triton.jit
def _expert_load_kernel(idx_ptr, load_ptr, M, E, bad_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < M
    e = tl.load(idx_ptr + offs, mask=m, other=0)
    ok = (e >= 0) & (e < E)
    tl.atomic_add(load_ptr + e, tl.full([BLOCK], 1, tl.int64), mask=m & ok)
    nbad = tl.sum((m & (~ok)).to(tl.int32), axis=0)
    tl.atomic_add(bad_ptr, nbad)


# ------------------------------------------------------------------------------------------------
# grouped GEMMs
# ------------------------------------------------------------------------------------------------
@triton.jit
def _e2m1(code):
    """float32 values of 4-bit E2M1 codes (sign bit 3, exponent bits 2-1, mantissa bit 0; OCP MX v1.0): the float32
    bits built from the fields (exponent e > 0: 2^(e - 1) (1 + m / 2); e = 0: m / 2), no table."""
    c = code.to(tl.uint32)
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
    return (bits | ((c >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(s):
    """float32 2^(s - 127) of E8M0 scale bytes: the exponent field s (s = 0: the subnormal 2^-127, which the GPU's
    flush-to-zero arithmetic may read as 0; 255, NaN, is refused on the host)."""
    s = s.to(tl.uint32)
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_tile(p_base, s_base, r, rmask, c0, C, stride_pr, stride_sr, R: tl.constexpr, BC: tl.constexpr):
    """The [R, BC] float32 tile W[r, c0 : c0 + BC] of one expert's MXFP4 weight W [rows, C], packed along C
    (compressed-tensors mxfp4-pack-quantized): p_base uint8 [rows, C / 2] (row stride stride_pr; byte c holds
    column 2c in its low nibble, 2c + 1 in its high one), s_base uint8 [rows, C / 32] (row stride stride_sr).
    Decoded in registers: the BC / 2 bytes of each row are loaded once, both nibbles decoded and interleaved
    (join + reshape), times the E8M0 scale of each column's group. Rows outside rmask and columns at or past C
    read 0."""
    r64 = r.to(tl.int64)
    cb = c0 // 2 + tl.arange(0, BC // 2)
    pk = tl.load(p_base + r64[:, None] * stride_pr + cb[None, :], mask=rmask[:, None] & (cb < C // 2)[None, :],
                 other=0)
    v = tl.reshape(tl.join(_e2m1(pk & 15), _e2m1(pk >> 4)), [R, BC])
    cs = c0 + tl.arange(0, BC)
    sc = tl.load(s_base + r64[:, None] * stride_sr + (cs // 32)[None, :], mask=rmask[:, None] & (cs < C)[None, :],
                 other=0)
    return v * _e8m0(sc)


@triton.jit
def _tile_rows(pid, n_tiles, tile_expert_ptr, tile_start_ptr, offs_ptr, E, BM: tl.constexpr):
    t = pid // n_tiles
    pid_n = pid % n_tiles
    e = tl.load(tile_expert_ptr + t)
    e_ok = e < E
    e_c = tl.where(e_ok, e, 0)  # unused programs return right after this
    m_begin = tl.load(offs_ptr + e_c) + (t - tl.load(tile_start_ptr + e_c)) * BM
    m_end = tl.load(offs_ptr + e_c + 1)
    m_end = tl.where(e_ok, m_end, m_begin)  # an unused program owns no row
    return e, e_ok, pid_n, m_begin.to(tl.int64), m_end.to(tl.int64)


@triton.jit
def _load_rows(ptrs, rmask, kmask, EVEN_K: tl.constexpr):
    """One [rows, BK] A tile through pointers: rows outside rmask, and (unless EVEN_K) columns outside kmask,
    read as 0."""
    if EVEN_K:
        x = tl.load(ptrs, mask=rmask[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
    return x


@triton.jit
def _gg_k_loop(acc, acc2, acct, acct2, a_src, a_ptrs, a2_src, a2_ptrs, at_src, at_ptrs, a2t_src, a2t_ptrs,
               w_src, b_ptrs, w2_src, b2_ptrs, e32, m32, n0, K, rmask, tmask, cmask, ks, stride_wk,
               PAIR: tl.constexpr, A_MODE: tl.constexpr, W_DESC: tl.constexpr, W_KN: tl.constexpr,
               PREC: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
               TAIL: tl.constexpr, s_ptr=None, s2_ptr=None, NN=0, stride_pr=0, stride_sr=0,
               W_MX: tl.constexpr = False):
    """The K loop of _grouped_gemm_kernel (PAIR 0 or 1 as there); returns (acc, acc2, acct, acct2).
    TAIL > 0: the tile's TAIL rows after its BM rows ride along on the same weight tiles, swapped (acct [BN, TAIL]
    = W^T A_tail^T), so that the weight tile is loaded once for BM + TAIL rows and the MMA has BN rows.
    W_MX: b_ptrs / b2_ptrs are the expert's MXFP4 weight_packed bases and s_ptr / s2_ptr its weight_scale bases
    (_mx_tile; packed along K, or along NN with W_KN), each weight tile decoded in registers and cast to A's dtype
    before the dot (W4A16)."""
    for k0 in range(0, K, BK):
        kmask = (k0 + ks) < K
        # ---- A tile(s) [BM, BK] (and the tail's [TAIL, BK])
        if A_MODE == 2:
            a = a_src.load([m32, k0])
            if TAIL > 0:
                at = at_src.load([m32 + BM, k0])
        else:
            a = _load_rows(a_ptrs, rmask, kmask, EVEN_K)
            a_ptrs += BK
            if TAIL > 0:
                at = _load_rows(at_ptrs, tmask, kmask, EVEN_K)
                at_ptrs += BK
        # ---- W tile(s) [BK, BN]
        if W_MX:
            if W_KN:
                b = _mx_tile(b_ptrs, s_ptr, k0 + ks, kmask, n0, NN, stride_pr, stride_sr, BK, BN).to(a.dtype)
                if PAIR != 0:
                    b2 = _mx_tile(b2_ptrs, s2_ptr, k0 + ks, kmask, n0, NN, stride_pr, stride_sr, BK, BN).to(a.dtype)
            else:
                b = tl.trans(_mx_tile(b_ptrs, s_ptr, n0 + tl.arange(0, BN), cmask, k0, K, stride_pr, stride_sr, BN,
                                      BK).to(a.dtype))
                if PAIR != 0:
                    b2 = tl.trans(_mx_tile(b2_ptrs, s2_ptr, n0 + tl.arange(0, BN), cmask, k0, K, stride_pr,
                                           stride_sr, BN, BK).to(a.dtype))
        elif W_DESC:
            if W_KN:
                b = tl.reshape(w_src.load([e32, k0, n0]), [BK, BN])
                if PAIR != 0:
                    b2 = tl.reshape(w2_src.load([e32, k0, n0]), [BK, BN])
            else:
                b = tl.trans(tl.reshape(w_src.load([e32, n0, k0]), [BN, BK]))
                if PAIR != 0:
                    b2 = tl.trans(tl.reshape(w2_src.load([e32, n0, k0]), [BN, BK]))
        else:
            if EVEN_K:
                b = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
                if PAIR != 0:
                    b2 = tl.load(b2_ptrs, mask=cmask[None, :], other=0.0)
            else:
                b = tl.load(b_ptrs, mask=cmask[None, :] & kmask[:, None], other=0.0)
                if PAIR != 0:
                    b2 = tl.load(b2_ptrs, mask=cmask[None, :] & kmask[:, None], other=0.0)
            b_ptrs += BK * stride_wk
            if PAIR != 0:
                b2_ptrs += BK * stride_wk
        acc = tl.dot(a, b, acc, input_precision=PREC)
        if PAIR == 1:
            acc2 = tl.dot(a, b2, acc2, input_precision=PREC)
        if TAIL > 0:
            # swap-AB: the weight tile is the MMA's A operand ([BN, BK]), the tail rows its B ([BK, TAIL]); the
            # MMA is BN rows tall, where TAIL token rows alone would be padded to the tensor core's 64
            acct = tl.dot(tl.trans(b), tl.trans(at), acct, input_precision=PREC)
            if PAIR == 1:
                acct2 = tl.dot(tl.trans(b2), tl.trans(at), acct2, input_precision=PREC)
    return acc, acc2, acct, acct2


@triton.jit
def _grouped_gemm_kernel(
        a_src, tok_ptr, w_src, a2_src, w2_src,
        c_ptr, c2_ptr, c3_ptr, wrow_ptr,
        tile_expert_ptr, tile_start_ptr, offs_ptr,
        K, NN, E, n_tiles,
        stride_am, stride_we, stride_wn, stride_wk, stride_cm,
        beta_gate, beta_up,
        PAIR: tl.constexpr, EPI: tl.constexpr, SAVE: tl.constexpr, ROW_SCALE: tl.constexpr,
        ACT: tl.constexpr, FAST: tl.constexpr, A_MODE: tl.constexpr, W_DESC: tl.constexpr, W_KN: tl.constexpr,
        PREC: tl.constexpr, EVEN_K: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HALF: tl.constexpr = False,
        a_h_src=None, a2_h_src=None, TAIL: tl.constexpr = 0, a_t_src=None, a2_t_src=None,
        ws_src=None, w2s_src=None, stride_se=0, stride_sr=0, W_MX: tl.constexpr = False):
    """One grouped GEMM over the experts; for the rows r of m-tile's expert e and n-tile cols:

        acc  = A[r] . W[e]          (K-deep dot; W[e] is [NN, K] (k fastest) or [K, NN] (W_KN))
        PAIR 1 (dual):  acc2 = A[r] . W2[e]            (one A tile against two weight tiles)
        PAIR 3 (sum):   acc += A2[r] . W2[e], one K loop over (A, W) and then one over (A2, W2) (A2 rows are never
                        gathered)

    A rows: A_MODE 0 gathered through tok (A[r] = a[tok[r]]), 1 contiguous, 2 a TMA descriptor
    over contiguous rows. W: pointers with (stride_we, stride_wn, stride_wk), or (W_DESC) a 3-D
    TMA descriptor over [E, rows, cols] with zero fill outside each expert's block.
    Epilogue EPI 0: c = acc.  EPI 1 (GLU forward): c = glu(acc, acc2) (times wrow[r] when
    ROW_SCALE; and, when SAVE, c2 = acc, c3 = acc2: the pre-activations for backward).

    HALF: an m-tile with at most BM / 2 rows (an expert's last tile) runs at BM / 2 rows, so its products cost
    half (at 8192 tokens of the K3 layer an expert has ~146 rows: 128 + 18, padded to 192 rows of MMA instead
    of 256); with A_MODE 2 its A rows come through a_h_src / a2_h_src, descriptors with [BM / 2, BK] blocks.
    TAIL > 0: m-tiles are BM + TAIL rows tall (the schedule's tile height); a tile with more than BM rows runs its
    last TAIL rows on the same weight tiles as its first BM, swapped (the weight tile as the MMA's A operand, see
    _gg_k_loop), so that 146 rows cost one weight pass and 128 + 32 rows of MMA (HALF: 128 + 64 in two programs,
    each streaming the weights); with A_MODE 2 the tail rows come through a_t_src / a2_t_src ([TAIL, BK] blocks).
    A tile of at most BM rows runs without the tail (and at BM / 2 under HALF when it has at most BM / 2).
    W_MX (W4A16): W and W2 are MXFP4 (compressed-tensors mxfp4-pack-quantized, packed along the weight's last
    dimension: K, or NN with W_KN): w_src / w2_src the uint8 weight_packed [E, rows, cols / 2] (expert stride
    stride_we, row stride stride_wn), ws_src / w2s_src the uint8 weight_scale [E, rows, cols / 32] (strides
    stride_se, stride_sr); each weight tile is decoded in registers (_mx_tile), never stored dequantized.
    """
    pid = tl.program_id(0)
    e, e_ok, pid_n, m_begin, m_end = _tile_rows(pid, n_tiles, tile_expert_ptr, tile_start_ptr,
                                                offs_ptr, E, BM + TAIL)
    if e >= E:
        return
    half: tl.constexpr = False              # a constexpr unless HALF: then the tile's height decides at run time
    if HALF:
        half = m_end - m_begin <= BM // 2
    tail: tl.constexpr = False              # likewise with TAIL
    if TAIL > 0:
        tail = m_end - m_begin > BM
    if half:
        _gg_tile(a_h_src, tok_ptr, w_src, a2_h_src, w2_src, c_ptr, c2_ptr, c3_ptr, wrow_ptr,
                 e, pid_n, m_begin, m_end, K, NN, stride_am, stride_we, stride_wn, stride_wk,
                 stride_cm, beta_gate, beta_up, PAIR, EPI, SAVE, ROW_SCALE, ACT, FAST, A_MODE, W_DESC, W_KN,
                 PREC, EVEN_K, BM // 2, BN, BK, 0, None, None, ws_src, w2s_src, stride_se, stride_sr, W_MX)
    elif tail:
        _gg_tile(a_src, tok_ptr, w_src, a2_src, w2_src, c_ptr, c2_ptr, c3_ptr, wrow_ptr,
                 e, pid_n, m_begin, m_end, K, NN, stride_am, stride_we, stride_wn, stride_wk,
                 stride_cm, beta_gate, beta_up, PAIR, EPI, SAVE, ROW_SCALE, ACT, FAST, A_MODE, W_DESC, W_KN,
                 PREC, EVEN_K, BM, BN, BK, TAIL, a_t_src, a2_t_src, ws_src, w2s_src, stride_se,
                 stride_sr, W_MX)
    else:
        _gg_tile(a_src, tok_ptr, w_src, a2_src, w2_src, c_ptr, c2_ptr, c3_ptr, wrow_ptr,
                 e, pid_n, m_begin, m_end, K, NN, stride_am, stride_we, stride_wn, stride_wk,
                 stride_cm, beta_gate, beta_up, PAIR, EPI, SAVE, ROW_SCALE, ACT, FAST, A_MODE, W_DESC, W_KN,
                 PREC, EVEN_K, BM, BN, BK, 0, None, None, ws_src, w2s_src, stride_se, stride_sr, W_MX)


@triton.jit
def _gg_epilogue(acc, acc2, rows, rmask, cmask, row0, n0, c_ptr, c2_ptr, c3_ptr, wrow_ptr,
                 stride_cm, beta_gate, beta_up, EPI: tl.constexpr, SAVE: tl.constexpr, ROW_SCALE: tl.constexpr,
                 ACT: tl.constexpr, FAST: tl.constexpr, R: tl.constexpr, BN: tl.constexpr):
    """The epilogue of _grouped_gemm_kernel (EPI 0, 1 as there) for the [R, BN] products acc (acc2) of the R rows
    `rows` = row0 + arange(R) (those in rmask are stored) and columns n0 .. n0 + BN - 1 (those in cmask). The caller
    forms rows and the masks before its K loop: formed after it, behind the last MMA, they made ptxas serialize the
    wgmma pipeline of the 128 x 256 GEMM 2 (C7515)."""
    # epilogue offsets: int32 within the tile (R * stride_cm < 2**31) from int64 tile bases: fewer registers than
    # int64 [BM, BN] offsets (ptxas spills: benchmarks/results/moe.md)
    lr = tl.arange(0, R)
    o = lr[:, None] * stride_cm + tl.arange(0, BN)[None, :]
    tile0 = row0 * stride_cm + n0
    c_ptr += tile0
    c2_ptr += tile0
    c3_ptr += tile0
    om = rmask[:, None] & cmask[None, :]
    if EPI == 0:
        tl.store(c_ptr + o, acc.to(c_ptr.dtype.element_ty), mask=om)
    else:
        if SAVE:
            # store the pre-activations rounded to the storage dtype and compute h from those
            # (what backward will see): fewer live registers than keeping acc and acc2 too
            a_st = acc.to(c2_ptr.dtype.element_ty)
            tl.store(c2_ptr + o, a_st, mask=om)
            b_st = acc2.to(c3_ptr.dtype.element_ty)
            tl.store(c3_ptr + o, b_st, mask=om)
            h = _glu_fwd(a_st.to(tl.float32), b_st.to(tl.float32), beta_gate, beta_up, ACT, FAST)
        else:
            h = _glu_fwd(acc, acc2, beta_gate, beta_up, ACT, FAST)
        if ROW_SCALE:
            # the routing weight of each row, applied here so that the combine is a plain sum
            # and dW2 = du^T (w h) needs no scaling in its K loop
            wr = tl.load(wrow_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            h = h * wr[:, None]
        tl.store(c_ptr + o, h.to(c_ptr.dtype.element_ty), mask=om)


@triton.jit
def _gg_tile(a_src, tok_ptr, w_src, a2_src, w2_src, c_ptr, c2_ptr, c3_ptr, wrow_ptr,
             e, pid_n, m_begin, m_end, K, NN, stride_am, stride_we, stride_wn, stride_wk, stride_cm,
             beta_gate, beta_up, PAIR: tl.constexpr, EPI: tl.constexpr, SAVE: tl.constexpr,
             ROW_SCALE: tl.constexpr, ACT: tl.constexpr, FAST: tl.constexpr, A_MODE: tl.constexpr,
             W_DESC: tl.constexpr, W_KN: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TAIL: tl.constexpr = 0, at_src=None,
             a2t_src=None, ws_src=None, w2s_src=None, stride_se=0, stride_sr=0, W_MX: tl.constexpr = False):
    """One (BM + TAIL) x BN output tile of _grouped_gemm_kernel (rows m_begin .. m_end - 1 of expert e): K loop
    and epilogue, as documented there."""
    rows = m_begin + tl.arange(0, BM)
    rmask = rows < m_end
    n0 = pid_n * BN
    cols = n0 + tl.arange(0, BN)
    cmask = cols < NN
    ks = tl.arange(0, BK)
    e32 = e.to(tl.int32)
    m32 = m_begin.to(tl.int32)
    # (pointer operands that a mode does not use are never loaded: the K loop selects on the same constexprs)
    a_ptrs = tok_ptr
    a2_ptrs = tok_ptr
    b_ptrs = tok_ptr
    b2_ptrs = tok_ptr
    at_ptrs = tok_ptr
    a2t_ptrs = tok_ptr
    tmask = rmask
    if TAIL > 0:
        trows = m_begin + BM + tl.arange(0, TAIL)
        tmask = trows < m_end
    if A_MODE == 0:
        arow = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
        a_ptrs = a_src + arow[:, None] * stride_am + ks[None, :]
        if TAIL > 0:
            trow = tl.load(tok_ptr + trows, mask=tmask, other=0).to(tl.int64)
            at_ptrs = a_src + trow[:, None] * stride_am + ks[None, :]
    elif A_MODE == 1:
        a_ptrs = a_src + rows[:, None] * stride_am + ks[None, :]
        if TAIL > 0:
            at_ptrs = a_src + trows[:, None] * stride_am + ks[None, :]
    if PAIR == 3:
        if A_MODE != 2:
            a2_ptrs = a2_src + rows[:, None] * stride_am + ks[None, :]
            if TAIL > 0:
                a2t_ptrs = a2_src + trows[:, None] * stride_am + ks[None, :]
    s_ptr = tok_ptr
    s2_ptr = tok_ptr
    if W_MX:
        # the expert's packed weight and scale bases (_mx_tile forms the tile addresses)
        b_ptrs = w_src + e.to(tl.int64) * stride_we
        b2_ptrs = w2_src + e.to(tl.int64) * stride_we
        s_ptr = ws_src + e.to(tl.int64) * stride_se
        s2_ptr = w2s_src + e.to(tl.int64) * stride_se
    elif not W_DESC:
        b_ptrs = (w_src + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
                  + ks[:, None] * stride_wk)
        if PAIR != 0:
            b2_ptrs = (w2_src + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
                       + ks[:, None] * stride_wk)
    # the accumulators a mode does not use are a [1, 1] stand-in that the K loop carries through untouched (not a
    # second name for a used accumulator's zeros)
    unused = tl.zeros([1, 1], dtype=tl.float32)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = unused
    if PAIR == 1:
        acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    acct = unused
    acct2 = unused
    if TAIL > 0:
        acct = tl.zeros([BN, TAIL], dtype=tl.float32)
        if PAIR == 1:
            acct2 = tl.zeros([BN, TAIL], dtype=tl.float32)
    if PAIR == 3:
        # sequential pair: the K loop over (A, W), then a second one over (A2, W2) into the same accumulator;
        # each loop a plain one-operand pipeline (fewer shared-memory bytes per stage than PAIR 2: wider tiles fit)
        acc, acc2, acct, acct2 = _gg_k_loop(
            acc, acc2, acct, acct2, a_src, a_ptrs, a_src, a_ptrs, at_src, at_ptrs, at_src, at_ptrs,
            w_src, b_ptrs, w_src, b_ptrs, e32, m32, n0, K, rmask, tmask, cmask, ks, stride_wk,
            0, A_MODE, W_DESC, W_KN, PREC, EVEN_K, BM, BK, BN, TAIL, s_ptr, s_ptr, NN, stride_wn, stride_sr, W_MX)
        acc, acc2, acct, acct2 = _gg_k_loop(
            acc, acc2, acct, acct2, a2_src, a2_ptrs, a2_src, a2_ptrs, a2t_src, a2t_ptrs, a2t_src, a2t_ptrs,
            w2_src, b2_ptrs, w2_src, b2_ptrs, e32, m32, n0, K, rmask, tmask, cmask, ks, stride_wk,
            0, A_MODE, W_DESC, W_KN, PREC, EVEN_K, BM, BK, BN, TAIL, s2_ptr, s2_ptr, NN, stride_wn, stride_sr, W_MX)
    else:
        acc, acc2, acct, acct2 = _gg_k_loop(
            acc, acc2, acct, acct2, a_src, a_ptrs, a2_src, a2_ptrs, at_src, at_ptrs, a2t_src, a2t_ptrs,
            w_src, b_ptrs, w2_src, b2_ptrs, e32, m32, n0, K, rmask, tmask, cmask, ks, stride_wk,
            PAIR, A_MODE, W_DESC, W_KN, PREC, EVEN_K, BM, BK, BN, TAIL, s_ptr, s2_ptr, NN, stride_wn, stride_sr, W_MX)
    if TAIL > 0:
        # the tail's products first (fewer registers live across the larger epilogue), transposed back to rows
        _gg_epilogue(tl.trans(acct), tl.trans(acct2), trows, tmask, cmask, m_begin + BM, n0, c_ptr, c2_ptr, c3_ptr,
                     wrow_ptr, stride_cm, beta_gate, beta_up, EPI, SAVE, ROW_SCALE, ACT,
                     FAST, TAIL, BN)
    _gg_epilogue(acc, acc2, rows, rmask, cmask, m_begin, n0, c_ptr, c2_ptr, c3_ptr, wrow_ptr,
                 stride_cm, beta_gate, beta_up, EPI, SAVE, ROW_SCALE, ACT, FAST, BM, BN)


@triton.jit
def _glu_bwd_rows_kernel(g_ptr, a_ptr, b_ptr, wrow_ptr, da_ptr, db_ptr, dwrow_ptr, M, N, stride_m,
                         beta_gate, beta_up, ACT: tl.constexpr, FAST: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """The GLU backward of BLOCK_R whole rows, after the plain GEMM G = du[tok] . w2[e]:
    dwrow[r] = sum_n G h (h recomputed from the saved pre-activations a, b), dA, dB = glu'(a, b) . (wrow[r] G).
    da / db may alias a / b (each element is read before it is written, by the same program)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    base = rows.to(tl.int64)[:, None] * stride_m
    wr = tl.load(wrow_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    part = tl.zeros([BLOCK_R], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        m = rmask[:, None] & (cols < N)[None, :]
        o = base + cols[None, :]
        g = tl.load(g_ptr + o, mask=m, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + o, mask=m, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + o, mask=m, other=0.0).to(tl.float32)
        h, da, db = _glu_bwd(av, bv, g * wr[:, None], beta_gate, beta_up, ACT, FAST)
        part += tl.sum(g * h, axis=1)  # masked entries have g = 0
        tl.store(da_ptr + o, da.to(da_ptr.dtype.element_ty), mask=m)
        tl.store(db_ptr + o, db.to(db_ptr.dtype.element_ty), mask=m)
    tl.store(dwrow_ptr + rows, part, mask=rmask)


@triton.jit
def _wgrad_tile_kernel(p_ptr, ptok_ptr, q_ptr, qtok_ptr, out_ptr, offs_ptr, exp_ptr,
                       MM, NN, m_tiles, n_tiles,
                       stride_pm, stride_qm, stride_oe, stride_om,
                       P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, PREC: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, O_DESC: tl.constexpr = False,
                       EXP_LIST: tl.constexpr = False):
    """Weight gradient of every expert, one program per output tile: out[e, m, n] = sum_{r in rows(e)} P[r, m] Q[r, n],
    with P rows gathered (P[r] = p[ptok[r]]) and Q rows gathered (Q[r] = q[qtok[r]]) on request.
    Experts with no row get an exact zero block. Grid: E * m_tiles * n_tiles, n fastest.
    O_DESC: out_ptr is a 3-D TMA descriptor over out [E, MM, NN] with block [1, BM, BN] (the tile goes out through
    shared memory and the copy engine, which clips the edges), else masked pointer stores.
    EXP_LIST: the programs cover only the experts exp_ptr[0 ..] (grid: len * m_tiles * n_tiles; the experts that
    the held kernel leaves over), else every expert."""
    pid = tl.program_id(0)
    per_e = m_tiles * n_tiles
    e = pid // per_e
    if EXP_LIST:
        e = tl.load(exp_ptr + e)
    rem = pid % per_e
    pid_m = rem // n_tiles
    pid_n = rem % n_tiles
    r0 = tl.load(offs_ptr + e).to(tl.int64)
    r1 = tl.load(offs_ptr + e + 1).to(tl.int64)
    ms = pid_m * BM + tl.arange(0, BM)
    ns = pid_n * BN + tl.arange(0, BN)
    mmask = ms < MM
    nmask = ns < NN
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(r0, r1, BK):
        rows = k0 + kk
        rmask = rows < r1
        if P_GATHER:
            prow = tl.load(ptok_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            prow = rows
        if Q_GATHER:
            qrow = tl.load(qtok_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            qrow = rows
        pm = mmask[:, None] & rmask[None, :]
        p = tl.load(p_ptr + prow[None, :] * stride_pm + ms[:, None], mask=pm, other=0.0)  # [BM, BK]
        qv = tl.load(q_ptr + qrow[:, None] * stride_qm + ns[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(p, qv, acc, input_precision=PREC)
    if O_DESC:
        e32 = e.to(tl.int32)
        _store_tile_desc(out_ptr, acc, e32, pid_m * BM, pid_n * BN, BM, BN)
    else:
        o = e.to(tl.int64) * stride_oe + ms.to(tl.int64)[:, None] * stride_om + ns[None, :]
        om = mmask[:, None] & nmask[None, :]
        tl.store(out_ptr + o, acc.to(out_ptr.dtype.element_ty), mask=om)


@triton.jit
def _store_tile_desc(dst, acc, e32, m0, n0, BM: tl.constexpr, BN: tl.constexpr):
    """Store the [BM, BN] tile acc, in dst's dtype, at (expert e32, m0, n0) through the 3-D TMA descriptor dst."""
    dst.store([e32, m0, n0], tl.reshape(acc.to(dst.dtype), [1, BM, BN]))


@triton.jit
def _wgrad_p_tile(p_ptr, ptok_ptr, k0, kk, rmask, ms, mmask, stride_pm, P_GATHER: tl.constexpr):
    """[BM, BK] tile P[k0 + kk, ms]^T through masked pointer loads (rows with rmask False read 0).
    Without a gather the 64-bit part of the address is the scalar row k0 and the per-element
    offsets are 32-bit (BK * stride_pm < 2**31), which keeps the tile's addresses in few registers."""
    if P_GATHER:
        prow = tl.load(ptok_ptr + k0 + kk, mask=rmask, other=0).to(tl.int64)
        ptrs = p_ptr + prow[None, :] * stride_pm + ms[:, None]
    else:
        ptrs = (p_ptr + k0 * stride_pm) + (kk[None, :] * stride_pm + ms[:, None])
    return tl.load(ptrs, mask=mmask[:, None] & rmask[None, :], other=0.0)


@triton.jit
def _wgrad_q_tile(q_ptr, qtok_ptr, k0, kk, rmask, ns, nmask, stride_qm, Q_GATHER: tl.constexpr):
    """[BK, BN] tile Q[k0 + kk, ns] through masked pointer loads (as _wgrad_p_tile)."""
    if Q_GATHER:
        qrow = tl.load(qtok_ptr + k0 + kk, mask=rmask, other=0).to(tl.int64)
        ptrs = q_ptr + qrow[:, None] * stride_qm + ns[None, :]
    else:
        ptrs = (q_ptr + k0 * stride_qm) + (kk[:, None] * stride_qm + ns[None, :])
    return tl.load(ptrs, mask=rmask[:, None] & nmask[None, :], other=0.0)


@triton.jit
def _wgrad_p_block(p_ptr, ptok_ptr, x0, kx, r1, ms, mmask, stride_pm, P_GATHER: tl.constexpr):
    """(row mask, [BM, KX] tile P[x0 + kx, ms]^T) for the rows x0 + kx, those at or past r1 masked to 0."""
    m = (x0 + kx) < r1
    return m, _wgrad_p_tile(p_ptr, ptok_ptr, x0, kx, m, ms, mmask, stride_pm, P_GATHER)


@triton.jit
def _wgrad_block_dot(acc, pb, q_ptr, qtok_ptr, x0, kx, m, ns, nmask, stride_qm, Q_GATHER: tl.constexpr,
                     PREC: tl.constexpr):
    """acc + pb [BM, KX] @ Q[x0 + kx, ns] [KX, BN] (rows with m False read 0)."""
    return tl.dot(pb, _wgrad_q_tile(q_ptr, qtok_ptr, x0, kx, m, ns, nmask, stride_qm, Q_GATHER), acc,
                  input_precision=PREC)


@triton.jit
def _wgrad_held_kernel(p_ptr, ptok_ptr, q_ptr, qtok_ptr, out_ptr, offs_ptr, exp_ptr, MM, NN, m_tiles,
                       stride_pm, stride_qm, stride_oe, stride_om,
                       P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, PREC: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, KP: tl.constexpr, KX: tl.constexpr = 16,
                       NX: tl.constexpr = 0, EXP_LIST: tl.constexpr = False, O_DESC: tl.constexpr = False):
    """Weight gradient for few rows per expert (same result as ``_wgrad_tile_kernel``):
    out[e, m, n] = sum_{r in rows(e)} P[r, m] Q[r, n], every expert having at most KP + NX * KX rows (the host
    checks).

    One program per (expert, m-tile): the expert's P^T tile is loaded once (rows past the expert read as 0), as
    one [BM, KP] block and NX [BM, KX] blocks after it (0 <= NX <= 4), so that the depth can follow the row count
    in KX steps (146 rows: 128 + 32 = 160, where one power-of-two block would be 256 deep). The loop over the
    n-tiles loads the matching Q blocks, forms the product and stores the [BM, BN] gradient tile; it is the
    software-pipelined loop, so the next Q tiles are in flight while a tile is multiplied and stored. Each Q
    element is read once per m-tile, against once per (m-tile, n-tile) pair with P too in the tile kernel: at a few
    hundred rows per expert that operand traffic, not the gradient's stores, bounds the tile kernel.
    EXP_LIST: program j // m_tiles works on expert exp_ptr[j // m_tiles] (the host groups experts by depth),
    else on expert j // m_tiles. O_DESC: out_ptr is a 3-D TMA descriptor over out [E, MM, NN] with block
    [1, BM, BN] (the copy engine writes the tile and clips the edges), else masked pointer stores."""
    pid = tl.program_id(0)
    e = pid // m_tiles
    pid_m = pid % m_tiles
    if EXP_LIST:
        e = tl.load(exp_ptr + e)
    r0 = tl.load(offs_ptr + e).to(tl.int64)
    r1 = tl.load(offs_ptr + e + 1).to(tl.int64)
    kk = tl.arange(0, KP)
    rmask = (r0 + kk) < r1
    kx = tl.arange(0, KX)
    ms = pid_m * BM + tl.arange(0, BM)
    mmask = ms < MM
    pt = _wgrad_p_tile(p_ptr, ptok_ptr, r0, kk, rmask, ms, mmask, stride_pm, P_GATHER)  # [BM, KP]
    # the NX blocks of KX rows after the first KP (Triton has no list of tiles: one name per block)
    if NX >= 1:
        x1 = r0 + KP
        m1, p1 = _wgrad_p_block(p_ptr, ptok_ptr, x1, kx, r1, ms, mmask, stride_pm, P_GATHER)  # [BM, KX]
    if NX >= 2:
        x2 = x1 + KX
        m2, p2 = _wgrad_p_block(p_ptr, ptok_ptr, x2, kx, r1, ms, mmask, stride_pm, P_GATHER)
    if NX >= 3:
        x3 = x2 + KX
        m3, p3 = _wgrad_p_block(p_ptr, ptok_ptr, x3, kx, r1, ms, mmask, stride_pm, P_GATHER)
    if NX >= 4:
        x4 = x3 + KX
        m4, p4 = _wgrad_p_block(p_ptr, ptok_ptr, x4, kx, r1, ms, mmask, stride_pm, P_GATHER)
    base = e.to(tl.int64) * stride_oe + (pid_m * BM).to(tl.int64) * stride_om
    o_rows = tl.arange(0, BM)[:, None] * stride_om  # 32-bit in-tile offsets (BM * stride_om < 2**31)
    for n0 in range(0, NN, BN):
        ns = n0 + tl.arange(0, BN)
        nmask = ns < NN
        qv = _wgrad_q_tile(q_ptr, qtok_ptr, r0, kk, rmask, ns, nmask, stride_qm, Q_GATHER)  # [KP, BN]
        acc = tl.dot(pt, qv, input_precision=PREC, out_dtype=tl.float32)
        if NX >= 1:
            acc = _wgrad_block_dot(acc, p1, q_ptr, qtok_ptr, x1, kx, m1, ns, nmask, stride_qm, Q_GATHER, PREC)
        if NX >= 2:
            acc = _wgrad_block_dot(acc, p2, q_ptr, qtok_ptr, x2, kx, m2, ns, nmask, stride_qm, Q_GATHER, PREC)
        if NX >= 3:
            acc = _wgrad_block_dot(acc, p3, q_ptr, qtok_ptr, x3, kx, m3, ns, nmask, stride_qm, Q_GATHER, PREC)
        if NX >= 4:
            acc = _wgrad_block_dot(acc, p4, q_ptr, qtok_ptr, x4, kx, m4, ns, nmask, stride_qm, Q_GATHER, PREC)
        if O_DESC:
            _store_tile_desc(out_ptr, acc, e.to(tl.int32), pid_m * BM, n0, BM, BN)
        else:
            tl.store(out_ptr + base + (o_rows + ns[None, :]), acc.to(out_ptr.dtype.element_ty),
                     mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, out_ptr, L, stride_ym, stride_om, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, c] = sum_j y[pos[t, j], c] in float32 (GEMM 1's epilogue applied the routing weights)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = cols < L
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        r = tl.load(pos_ptr + t * TOPK + j).to(tl.int64)
        v = tl.load(y_ptr + r * stride_ym + cols, mask=cm, other=0.0).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)
