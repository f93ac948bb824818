"""The kda_chunk forward: the intra-chunk kernels, the segment maps and state pass, the output; and, for one long
sequence without autograd, the same launches as a pipeline over pieces of the sequence on two streams."""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..guard import device_table, next_power_of_2, sm_count
from .common import _ch_grid, _head_major, _interm_dtype, _interpret, _mark
from .intra import _intra, _intra_launch, _intra_scratch, _wu_launch
from .settings import CHUNK, active
from .state import _entry_states, _output_kernel, _pass_stages, _state_pass, _state_pass_kernel
from .tables import _TABLE_CACHE

_SIDE_STREAMS: dict = {}


def _pipeline_pieces(tab, pipeline, dev, H, V, BV, cfg):
    """(chunk ranges [(a, b), ...], state columns per program) of the pipelined forward, or None where it does
    not apply: autograd on (pipeline False), cfg.pipeline off, not one unsplit sequence of at least
    cfg.pipe_min_chunks chunks, or a state pass that would hold more than half of the SMs (H x V / columns
    programs, one per SM, with the columns cfg.pipe_bv or wider: at H = 96 the chain fills the GPU, and the
    pipeline was slower there).  (Under the interpreter the pieces run one after another on the CPU: the tests
    check the piece bookkeeping there.)"""
    NC = tab["n_chunks"]
    if (not pipeline or not cfg.pipeline or (dev.type != "cuda" and not _interpret())
            or tab["n_seq"] != 1 or tab["n_seg"] != 1 or NC < max(2, int(cfg.pipe_min_chunks))):
        return None
    bv = min(V, int(cfg.pipe_bv or BV))
    if dev.type == "cuda":
        while bv < V and H * (V // bv) > sm_count(dev) // 2:
            bv *= 2
        if H * (V // bv) > sm_count(dev) // 2:
            return None
    P = max(2, min(int(cfg.pipe_max_pieces), NC // max(1, int(cfg.pipe_piece_chunks))))
    edges = [NC * i // P for i in range(P + 1)]
    return list(zip(edges[:-1], edges[1:])), bv


def _side_stream(dev):
    """The highest-priority stream of the pipelined forward's state passes on this device, made once."""
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(dev, priority=torch.cuda.Stream.priority_range()[1])
    return _SIDE_STREAMS[key]


def _fwd_pipelined(q2, k2, v2, g2, b2, scale, h0, tab, fast, lb, BV, pieces, H, K, V, idt, WK, U, QG, KD, AQK, GAM, o,
                   cfg):
    """The forward of one sequence as a two-stream pipeline over its pieces (chunk ranges (a, b)), with BV state
    columns per program of the state pass.

    The intra-chunk kernels (cumsum, strips, solve, w/u: independent per chunk, bandwidth- and issue-bound) of
    piece p run on the caller's stream; the serial state pass of piece p (BH x V/BV programs, latency-bound:
    at H = 16 one 4-warp program per SM that waits on its dependent products each chunk) runs on a
    high-priority side stream as soon as piece p's intra work is done, from piece p-1's final state, and forms
    the output itself (_state_pass_kernel FUSE_O: no HB / VN written).  So the chain overlaps the next pieces'
    intra work instead of running after all of it.  The same arithmetic as the one-stream forward with the same
    state columns per program (cfg.pipe_bv), except that Wk S and QG S are one product (rounded apart from the
    two-product form; the final state is the same bit for bit).  The caller's stream waits for the side stream
    before return, so the scratch tensors are free for it to reuse.
    Returns (final state [1, H, K, V] float32, entry state S_IN [1, H, K, V])."""
    dev = q2.device
    NC = tab["n_chunks"]
    P = len(pieces)
    cuda = dev.type == "cuda"
    main = torch.cuda.current_stream(dev) if cuda else None
    s_state = _side_stream(dev) if cuda else None

    def on(stream, after):
        """Run the next launches on `stream` once the work queued on `after` is done (CPU: in order)."""
        if not cuda:
            return contextlib.nullcontext()
        stream.wait_stream(after)
        return torch.cuda.stream(stream)

    # the intra kernels' scratch holds one piece (the caller's stream orders the pieces' use of it); each piece's
    # intra launches see token-indexed views that start at the piece's first token, with the chunk starts
    # relative to it (0, 64, 128, ...: one table for every piece of the one sequence)
    rows = max(b - a for a, b in pieces) * CHUNK
    NBUF, GCS, FB, TB, _ = _intra_scratch(rows, NC, H, K, idt, False, dev, cfg)
    HB = torch.empty(1, H, K, V, dtype=idt, device=dev)      # (neither is written: FUSE_O)
    VN = torch.empty(1, H, V, dtype=idt, device=dev)
    S = torch.empty(P + 1, H, K, V, dtype=torch.float32, device=dev)     # S[p]: the state entering piece p
    if h0 is None:
        S[0].zero_()
    else:
        S[0].copy_(h0.reshape(H, K, V))
    s0, e0 = tab["seq_bounds"][0]
    cln = tab["clen"]
    pt = _TABLE_CACHE.get(("pieces", str(dev), s0, e0, tuple(pieces)), lambda: device_table(np.asarray(
        [[s0 + a * CHUNK for a, _ in pieces], [min(e0, s0 + b * CHUNK) for _, b in pieces],
         [a for a, _ in pieces], [b for _, b in pieces]], dtype=np.int32), torch.int32, dev), dev)
    rel = _TABLE_CACHE.get(("piece starts", str(dev), rows), lambda: device_table(
        np.arange(0, rows, CHUNK, dtype=np.int32), torch.int32, dev), dev)
    nst = _pass_stages(V // BV * H, dev, cfg, WK.element_size())
    for p, (a, b) in enumerate(pieces):
        n, t = b - a, s0 + a * CHUNK
        _intra_launch(q2[t:], k2[t:], g2[t:], b2[t:], rel[:n], cln[a:b], n, H, K, scale, lb, fast, idt, QG[t:],
                      KD[t:], AQK[t:], GAM[a:b], FB[a:b], NBUF, GCS, TB, None, WK[t:], cfg, marks=False)
        _wu_launch(v2[t:], b2[t:], rel[:n], cln[a:b], n, H, K, V, idt, TB, WK[t:], U[t:], cfg)
        with on(s_state, main):
            _state_pass_kernel[(V // BV, H, 1)](WK, U, KD, GAM, VN, HB, S[p], S[p + 1], pt[0, p:], pt[1, p:],
                                                pt[2, p:], pt[3, p:], H, K=K, V=V, BV=BV, SW=V, MODE=0, STORE=False,
                                                STORE_VN=False, QG=QG, AQK=AQK, O=o, FUSE_O=True,
                                                num_warps=cfg.state_warps, num_stages=nst)
    if cuda:
        main.wait_stream(s_state)
    _mark(cfg, "pipelined forward")
    return S[P:P + 1], S[0:1]


def _fwd(q, k, v, g, beta, scale, h0, tab, fast, lb, BV, cfg, keep_t=False, pipeline=False):
    """The forward. keep_t (under autograd): also return T and Bm of every chunk ((TB, BM), float32 [N, H, 64]
    each) for the backward.  pipeline (no autograd): one long sequence runs as _fwd_pipelined where it applies
    (_pipeline_pieces)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B * T
    dev = q.device
    idt = _interm_dtype(q)
    q2, k2, g2 = q.reshape(N, H, K), k.reshape(N, H, K), g.reshape(N, H, K)
    v2, b2 = v.reshape(N, H, V), beta.reshape(N, H)
    NC = tab["n_chunks"]
    WK = torch.empty(N, H, K, dtype=idt, device=dev)
    QG, KD = torch.empty_like(WK), torch.empty_like(WK)
    U = torch.empty(N, H, V, dtype=idt, device=dev)
    AQK = torch.empty(N, H, 64, dtype=idt, device=dev)
    GAM = torch.empty(max(NC, 1), H, K, dtype=torch.float32, device=dev)
    kept = None
    _mark(cfg, "start")
    plan = _pipeline_pieces(tab, pipeline and not keep_t, dev, H, V, BV, cfg)
    if plan is not None:
        o = torch.empty(N, H, V, dtype=v.dtype, device=dev)
        final, S_IN = _fwd_pipelined(q2, k2, v2, g2, b2, scale, h0, tab, fast, lb, plan[1], plan[0], H, K, V, idt,
                                     WK, U, QG, KD, AQK, GAM, o, cfg)
        return o.view(B, T, H, V), final, (WK, U, QG, KD, AQK, GAM, S_IN), None
    if NC:
        # (WK first holds diag(beta) k e^G from the strips, which the w/u kernel turns into Wk in place)
        TB, GCS, BM = _intra(q2, k2, g2, b2, tab, H, K, scale, lb, fast, idt, QG, KD, AQK, GAM, keep_t, WK, cfg)
        _wu_launch(v2, b2, tab["cstart"], tab["clen"], NC, H, K, V, idt, TB, WK, U, cfg)
        del GCS
        if keep_t:
            kept = (TB, BM)
        del TB
    _mark(cfg, "w/u")
    S_IN = _entry_states(WK, U, QG, KD, AQK, GAM, h0, tab, H, K, V, BV, dev, False, cfg)
    _mark(cfg, "segment maps+combine")
    o = torch.empty(N, H, V, dtype=v.dtype, device=dev)
    HB, VN, S_OUT = _state_pass(WK, U, KD, GAM, S_IN, tab, H, K, V, BV, idt, True, cfg)
    _mark(cfg, "state pass")
    if NC:
        BVO = min(V, 128)
        hm = _head_major(NC, cfg)
        _output_kernel[_ch_grid(NC, H, hm, Z=V // BVO)](QG, AQK, VN, HB, o, tab["cstart"], tab["clen"], H, K=K, V=V,
                                                        BV=BVO, HM=hm, num_warps=4, num_stages=1)
    _mark(cfg, "o")
    del VN, HB
    final = S_OUT.index_select(0, tab["last_seg"])
    saved = (WK, U, QG, KD, AQK, GAM, S_IN)
    return o.view(B, T, H, V), final, saved, kept


def forward_workspace(B, T, H, K, V, elem, sms=132):
    """Bytes the forward without autograd allocates inside one kda_chunk call beyond its output o (B sequences
    of T tokens, elem bytes per element of q, k, v; sms: the GPU's SM count, the H200's by default), at the
    settings in force (settings.active()): the per-token intermediates WK, QG, KD [N, H, K], U [N, H, V],
    AQK [N, H, 64] and the chunk gates GAM, plus the larger of the intra kernels' scratch (NBUF, GCS, TB:
    intra._intra_scratch) and the state pass's HB [NC, H, K, V] and VN [N, H, V]; a pipelined sequence
    (_pipeline_pieces) holds the scratch of one piece and no HB. K and V as the kernels run them (powers of two
    >= 16; padded copies of q, k, v, g otherwise)."""
    cfg = active()
    KP, VP = max(16, next_power_of_2(K)), max(16, next_power_of_2(V))
    N, NC = B * T, -(-T // CHUNK) * B
    pad = 0 if (KP, VP) == (K, V) else N * H * ((3 * KP + VP) * elem + KP * 4)
    ib = elem                                                   # _interm_dtype: the inputs' dtype
    base = N * H * (3 * KP + VP + 64) * ib + max(NC, 1) * H * KP * 4

    def scratch(rows):
        nb = 2 if ib == 2 else 4                                # N in bfloat16 for 16-bit inputs
        return rows * H * (64 * nb + KP * 4 + 64 * ib)
    n_chunks = -(-T // CHUNK)
    bv = min(VP, int(cfg.pipe_bv or 32))
    while bv < VP and H * (VP // bv) > sms // 2:
        bv *= 2
    if (cfg.pipeline and B == 1 and n_chunks >= max(2, int(cfg.pipe_min_chunks))
            and H * (VP // bv) <= sms // 2):
        P = max(2, min(int(cfg.pipe_max_pieces), n_chunks // max(1, int(cfg.pipe_piece_chunks))))
        return pad + base + scratch(-(-N // P))
    return pad + base + max(scratch(N), max(NC, 1) * H * KP * VP * ib + N * H * VP * ib)
