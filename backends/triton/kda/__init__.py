"""Triton Kimi Delta Attention: kda_gate, kda_chunk (forward + backward), kda_step.

Same signatures and results as backends/reference/kda.py (spec/OPS.md); math from Kimi Linear
(arXiv 2510.26692, eqs. 1-8, WY/UT representation of the chunked delta rule).  One module per stage:

* ``intra.py`` -- per (chunk of C = 64 tokens, head), in parallel: the in-chunk cumulative log decay G
  (``_chunk_cumsum_kernel``), the two causal 64x64 matrices  Akk_ij = beta_i sum_d k_id k_jd e^(G_id - G_jd)
  (j < i)  and  P_ij = sum_d q_id k_jd e^(G_id - G_jd)  (j <= i)  as one dense ``tl.dot`` per row block with
  anchored operands (``_intra_strip32_kernel`` on 32-row pairs where a promised bound allows,
  ``_intra_strip16_kernel`` on 16-row blocks otherwise), T = (I + diag(beta) Akk)^-1 (``_wy_solve_kernel``),
  and Wk = T diag(beta) (K e^G), U = T diag(beta) V (``_wy_apply_kernel``), plus the decayed operands q e^G,
  k e^(G_C - G), e^(G_C).  With a lower-bounded gate (g >= L >= FAST_LOWER_BOUND_LIMIT) the anchor is G before
  the block plus L times half its rows, so every factor stays within e^(+-80) (float32 / bf16 range; float16
  inputs form these operands in float32) and no row's result depends on a later row's gate (causal: see
  kda_chunk).  The bound is CHECKED per block in the kernels (min of g); a block that breaks it, every block
  when no bound is promised (``lower_bound=None``, e.g. the softplus gate), and the rows whose dense entries
  overflow (huge q or k) take the safe path: the strictly-earlier tiles on operands anchored at G before the block
  (all exponents <= 0) and the diagonal 16x16 tile as a second dense dot on operands anchored 64 nats below it
  (intra.py ``_safe_slice``; exact on every row whose G fell by at most 128 nats since the block began); the rows
  that fell further, or whose diagonal entries overflow, sum that tile token pair by token pair with exponents
  G_i - G_j <= 0 (row by row: causal too).
* ``state.py`` -- the serial state pass S <- diag(e^(G_C)) S + (k e^(G_C - G))^T (U - Wk S) over the chunks of a
  segment (``_state_pass_kernel``, grid V/BV x heads x segments), storing the chunk-entry states HB and the new
  values VN, then ``_output_kernel`` (parallel) O = (q e^G) h_c + P VN.  Long contexts: segments whose affine
  maps S_out = M S_in + D are formed in parallel and chained by ``_combine_kernel``.
* ``forward.py`` -- the forward; without autograd, one long unsplit sequence (from KdaConfig.pipe_min_chunks
  chunks) runs as a pipeline over pieces of the sequence: piece p's intra kernels on the caller's stream while
  piece p-1's state pass, which forms the output itself (no HB / VN), runs on a high-priority side stream.
* ``backward.py`` -- the backward: the reverse chain of the state gradient alone on the serial path, the
  per-chunk products, the UT-transform backward and the pair-product backward in parallel.
* ``gate.py`` (kda_gate), ``step.py`` (kda_step), ``tables.py`` (chunk / segment tables, the segment model),
  ``settings.py`` (KdaConfig, the ``config`` override context), ``common.py`` (shared helpers).
"""
from __future__ import annotations

import math
import numbers

import torch

from backends.cuda_device import on_tensor_device
from backends.reference import kda as _ref
from backends.reference.ops import check_flag

from ..guard import (check_interpreter_dot_dtype, check_kernel_device, check_kernel_dtype, next_power_of_2,
                     no_create_graph, scan_values, sm_count)
from .backward import _bwd
from .forward import _fwd, forward_workspace  # noqa: F401  (imported from here by backends/triton/impls.py)
from .gate import kda_gate
from .settings import CHUNK, FAST_LOWER_BOUND_LIMIT, FP16_FAST_LOWER_BOUND_LIMIT, KdaConfig, active, config
from .state import _value_block
from .step import kda_step
from .tables import _seg_chunks_for, _tables

__all__ = ["kda_gate", "kda_chunk", "kda_step", "FAST_LOWER_BOUND_LIMIT", "config", "KdaConfig"]


def _pow2(n):
    return n >= 16 and (n & (n - 1)) == 0


class _KDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, tab, fast, lb, BV, grad, cfg):
        # grad: autograd was on at the call and an input needs a gradient (inside forward grad mode is off,
        # and needs_input_grad says True under no_grad too); then the forward keeps T and Bm for the backward
        keep = tab["n_chunks"] > 0 and grad
        o, final, saved, kept = _fwd(q, k, v, g, beta, scale, h0, tab, fast, lb, BV, cfg, keep_t=keep,
                                     pipeline=not grad)
        kept = kept or ()
        ctx.save_for_backward(q, k, v, g, beta, h0, *saved, *kept)
        ctx.n_kept = len(kept)
        ctx.meta = (scale, tab, fast, lb, BV, cfg)
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        no_create_graph("backends.triton.kda_chunk")
        q, k, v, g, beta, h0, *saved = ctx.saved_tensors
        kept = tuple(saved[len(saved) - ctx.n_kept:]) if ctx.n_kept else None
        saved = saved[:len(saved) - ctx.n_kept]
        scale, tab, fast, lb, BV, cfg = ctx.meta
        if dht is not None:
            dht = dht.float().contiguous()
        dq, dk, dv, dg, db, dh0 = _bwd(q, k, v, g, beta, scale, h0, tab, fast, lb, BV, saved,
                                       do.contiguous(), dht, kept, cfg)
        return dq, dk, dv, dg, db, dh0, None, None, None, None, None, None, None


@on_tensor_device
def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, lower_bound=None, segment_chunks=None, check_finite=None):
    """Kimi Delta Attention, chunked WY/UT algorithm as Triton kernels, differentiable (torch.autograd).

    Args:
        q, k: [B, T, H, K] (float32/float16/bfloat16); K <= 256 (a power of two >= 16 runs as is; other sizes
            are zero-padded to the next one, which costs the padded size).
        v: [B, T, H, V] (float32/float16/bfloat16); V <= 256 (padded likewise).  q, k, v of different dtypes
            run in their promoted dtype (a cast of each), o is in v's dtype.
        g: [B, T, H, K] log decay (<= 0), float32 recommended (any float dtype).
        beta: [B, T, H] in (0, 1).
        scale: default K ** -0.5.
        initial_state: [N_seq, H, K, V] float32 or None.
        output_final_state: also return the state after each sequence.
        cu_seqlens: int [N_seq+1] packed variable-length offsets (then B == 1).  Read on the host once.
        lower_bound: None (default: no bound promised; every diagonal 16x16 tile takes the safe
            token-pair path, right for any g <= 0, e.g. the softplus gate) or a float L with
            L < 0 promised by the gate (kda_gate's sigmoid form): with FAST_LOWER_BOUND_LIMIT (-10) <= L the
            diagonal tiles are dense tensor-core dots (a lower L runs the safe path: same result, slower).  The
            promise is checked per 16-row block inside the kernels (min of g); a block that breaks it takes the
            safe path, so the result is right anyway.
            float16 q/k/v: the dense tiles run at L >= FP16_FAST_LOWER_BOUND_LIMIT (-1.25), with their
            anchored operands in float32 (TF32 dots on the GPU); a lower L runs the safe path everywhere (same
            result, slower).  bf16 / float32 at L >= -5.03125 (32 gates fall by at most 161): 32-row pairs are
            one dense tile each, which scales q and k by up to e^(16 |L|) <= e^80.5; the rows where that
            overflows (|q| or |k| entries beyond ~3e3) are redone as 16-row tiles (up to e^(8 |L|)).  The 16-row
            dense tiles (L below -5.03125, or float16) redo their overflowing rows on the safe path.
        segment_chunks: chunks per segment for the long-context split (None: chosen from the GPU size;
            a huge value disables it).  The result does not depend on it beyond rounding.
        check_finite: scan the inputs for NaN/inf and g for values > 0 first (reductions and a host sync;
            ValueError naming the input, as the reference).  None (default): on for CPU tensors (the
            interpreter; the scan costs nothing beside it), off on the GPU, so that a call never waits for
            the GPU (at T = 1M, H = 16 the scan would read 8.6 GB of g): there NaN in -> NaN out (never a
            hang), and g > 0 or g = -inf (outside the contract g in (-inf, 0]) give NaN or huge values, not
            an error.  Pass True to check on the GPU too.  When it scans, it also checks the result: inf / NaN
            from finite inputs (a diverging recurrence, beta ||k||^2 > 2: a RuntimeWarning names the first such
            token before the run) is a ValueError, as in the reference; and g below a promised lower_bound gets
            the reference's RuntimeWarning naming the first such token (check_lower_bound_kept).

    Returns:
        (o [B, T, H, V] in v's dtype, final_state [N_seq, H, K, V] float32 or None).

    Causality: with the gates keeping a promised bound (or none promised), o at the positions before any s and
    the gradients of a loss on them are bit for bit the same whatever q, k, v, g, beta hold at s and after, and
    when tokens are appended (the intra-chunk anchors, the row-by-row overflow redo, the solve and the state
    pass read no later row but through exact zeros; tests/test_kda_causal.py).  Not covered: a gate that breaks
    the promise (its 16-row block, and in the backward its chunk's channel slice, then takes the safe path, also
    for the rows before it: the same result within rounding), and on the GPU, appending tokens that change the
    number of chunks when segment_chunks is None (the long-context split's segment length follows the chunk
    count, and the chunk-entry states past the first segment differ by rounding with the split; pass
    segment_chunks for bit-identical prefixes across lengths), or that cross KdaConfig.pipe_min_chunks without
    autograd (the pipelined forward, again the same result within rounding).

    Accuracy: float32 inputs agree with the reference to ~1e-6 relative for gates in [-5, 0].  The in-chunk
    cumulative gate G is float32, so channels whose decay alternates between strong and near-zero lose more
    (CPU, T = 130, g either lo or -1e-4 per token: relative error of o 5e-6 at lo = -5, 1.4e-5 at -20, 1.1e-4 at
    -80, reachable with the softplus gate; the reference forms G in float64 there).  16-bit inputs: ~4e-3.

    Streams: without autograd, one sequence of at least KdaConfig.pipe_min_chunks chunks (64K tokens) runs as
    a pipeline over the caller's stream and a side stream of this package (the serial state chain beside the
    parallel work; the same final state bit for bit, the output within rounding, see the module docstring).
    The caller's stream waits for the side stream before the call returns, so the result is ordered on it as
    usual, and a CUDA-graph capture takes the side stream in.  ``with backends.triton.kda.config(pipeline=False)``
    runs one stream.

    Settings: the launch settings in force at the call (``config``, KdaConfig) apply to its forward and backward.

    Math: Kimi Linear (arXiv 2510.26692) eqs. 1-8, spec/OPS.md "kda_chunk"; see the module docstring for
    the kernel decomposition.  Raises TypeError/ValueError on bad dtypes/shapes (same checks as the
    reference), on a lower_bound that is not a finite number < 0, and on K or V above 256.
    """
    where = "triton.kda_chunk"
    B, T, H, K, V, bounds, n_seq = _ref._validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, where)
    output_final_state = check_flag(output_final_state, "output_final_state", where)
    check_kernel_dtype(where, q=q, k=k, v=v)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        # the kernels take one dtype: q, k, v in their promoted one (float16 with bfloat16: float32), o in v's
        # dtype as OPS.md asks (the reference computes in float32 whatever they are)
        pdt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        o, final = kda_chunk(q.to(pdt), k.to(pdt), v.to(pdt), g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens, lower_bound=lower_bound,
                             segment_chunks=segment_chunks, check_finite=check_finite)
        return o.to(v.dtype), final
    check_interpreter_dot_dtype(where, q=q)
    if K > 256 or V > 256:
        raise ValueError(f"{where}: K and V must be at most 256 (the chunk kernels hold [64, K] and [K, V] tiles); "
                         f"got K={K}, V={V}")
    if lower_bound is not None:
        lb = _ref.check_lower_bound_type(lower_bound, where)
        if not -math.inf < lb < 0:
            raise ValueError(f"{where}: lower_bound must be a finite number < 0 or None, got {lower_bound!r}")
        # the dense diagonal tiles hold e^(8 |L|): past L = -10 that leaves float32's range; float16 keeps its
        # dense tiles to L >= -1.25 (the safe path below it: the same result, slower)
        fast = lb >= FAST_LOWER_BOUND_LIMIT and not (q.dtype == torch.float16 and lb < FP16_FAST_LOWER_BOUND_LIMIT)
    else:
        lb, fast = 0.0, False
    check_kernel_device(where, q=q)      # (before the value scan: meta tensors have no values to scan)
    scan = scan_values(check_finite, q)
    if scan:
        _ref.check_inputs_finite_and_decay(q, k, v, g, beta, where)
        if initial_state is not None:
            _ref._check_finite("initial_state", initial_state, where)
        _ref.check_lower_bound_kept(g, lower_bound, where)
    if not (_pow2(K) and _pow2(V)):
        # the kernels take powers of two >= 16: zero channels / value columns (q = k = 0, g = 0, v = 0, a zero
        # state) change nothing in the others and stay zero; the scale stays that of the real K
        KP, VP = max(16, next_power_of_2(K)), max(16, next_power_of_2(V))
        pk, pv = (0, KP - K), (0, VP - V)
        h0 = initial_state
        if h0 is not None:
            h0 = torch.nn.functional.pad(h0, (0, VP - V, 0, KP - K))
        o, final = kda_chunk(*(torch.nn.functional.pad(t, pk) for t in (q, k)),
                             torch.nn.functional.pad(v, pv), torch.nn.functional.pad(g, pk), beta,
                             scale=K ** -0.5 if scale is None else scale, initial_state=h0,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                             lower_bound=lower_bound, segment_chunks=segment_chunks,
                             check_finite=False)     # (scanned above, when asked or on the CPU)
        # (contiguous, like the unpadded result, not a view into the padded one)
        o, final = o[..., :V].contiguous(), (final[:, :, :K, :V].contiguous() if final is not None else None)
        if scan:
            _ref.check_result_finite(o, final, k, beta, where)
        return o, final
    if segment_chunks is not None and (isinstance(segment_chunks, bool)
                                       or not isinstance(segment_chunks, numbers.Integral) or segment_chunks < 1):
        raise ValueError(f"{where}: segment_chunks must be a positive int or None, got {segment_chunks!r}")
    scale = K ** -0.5 if scale is None else float(scale)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, g, beta, initial_state))
    cfg = active()
    sms = sm_count(q.device) if q.is_cuda else None
    BV = _value_block(n_seq * H, V, sms * cfg.ctas_per_sm if sms else None, sms, grad, cfg.bv)
    n_longest = max(((e - s + CHUNK - 1) // CHUNK for (s, e) in bounds), default=0) if bounds else \
        (T + CHUNK - 1) // CHUNK
    seg = _seg_chunks_for(n_longest, n_seq * H, K, V, BV, q.device, segment_chunks, cfg, grad=grad)
    tab = _tables(B, T, bounds if cu_seqlens is not None else None, seg, q.device)
    qc, kc, vc, gc, bc = (t.contiguous() for t in (q, k, v, g, beta))
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    o, final = _KDAFunction.apply(qc, kc, vc, gc, bc, h0, scale, tab, fast, lb, BV, grad, cfg)
    final = final if output_final_state else None
    if scan:
        _ref.check_result_finite(o, final, k, beta, where)
    return o, final
