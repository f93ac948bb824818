"""Chunk and segment tables of a kda_chunk call, and the segment length of the long-context split."""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..guard import DeviceTableCache, device_table, sm_count
from .settings import CHUNK

#: chunk/segment tables already on the device, keyed by (device, B, T, sequence bounds, segment length):
#: a training or benchmark loop calls with the same geometry every step, so only the first call builds them
#: (11 host-to-device copies and the numpy work). Small (16 entries): a 1M-token table set is ~0.7 MB.
_TABLE_CACHE = DeviceTableCache(16)


def _tables(B, T, bounds, seg_chunks, device):
    """Chunk and segment tables of B sequences of T tokens (bounds None) or of the packed sequences
    [(start, end), ...] (bounds).  Returns a dict of int32 / int64 device tensors plus host counts; cached
    (_TABLE_CACHE), so the dict and its tensors are shared: read only."""
    key = (str(device), B, T, None if bounds is None else tuple(bounds), int(seg_chunks))
    return _TABLE_CACHE.get(key, lambda: _build_tables(B, T, bounds, seg_chunks, device), device)


def _build_tables(B, T, bounds, seg_chunks, device):
    if bounds is None:
        bounds = [(b * T, (b + 1) * T) for b in range(B)]
    cst, cln, seg0, seg1, segseq, sq0, sq1, st0, st1 = [], [], [], [], [], [], [], [], []
    nc = 0
    for n, (s, e) in enumerate(bounds):
        starts = np.arange(s, e, CHUNK, dtype=np.int64)
        cst.append(starts)
        cln.append(np.minimum(CHUNK, e - starts))
        m = len(starts)
        sq0.append(len(seg0))
        if m == 0:
            seg0.append(nc), seg1.append(nc), segseq.append(n), st0.append(s), st1.append(s)
        for a in range(0, m, seg_chunks):
            seg0.append(nc + a)
            seg1.append(nc + min(m, a + seg_chunks))
            segseq.append(n)
            st0.append(s + a * CHUNK)
            st1.append(min(e, s + (a + seg_chunks) * CHUNK))
        sq1.append(len(seg0))
        nc += m
    cst = np.concatenate(cst) if nc else np.zeros(0, np.int64)
    cln = np.concatenate(cln) if nc else np.zeros(0, np.int64)

    def dev(x, dt=np.int32):              # host table -> device, without a stream synchronisation
        return device_table(np.asarray(x, dtype=dt), torch.int32 if dt == np.int32 else torch.int64, device)

    sq0a, sq1a = np.asarray(sq0), np.asarray(sq1)
    return dict(cstart=dev(cst), clen=dev(cln), seg_c0=dev(seg0), seg_c1=dev(seg1), seg_t0=dev(st0),
                seg_t1=dev(st1), seg_seq=dev(segseq, np.int64),
                seq_s0=dev(sq0), seq_s1=dev(sq1), n_chunks=nc, n_seg=len(seg0), n_seq=len(bounds),
                first_seg=dev(sq0a, np.int64), last_seg=dev(sq1a - 1, np.int64),
                segmented=bool((sq1a - sq0a > 1).any()), seq_bounds=tuple((int(s), int(e)) for s, e in bounds))


def _seg_chunks_for(n_chunks_longest, BH, K, V, BV, device, seg_chunks, cfg, grad=True):
    """Segment length (in chunks) for the long-context split, from a wave model of the serial passes.

    Every program of a state pass walks its whole segment, so a pass over NS segments takes
    ceil(n / NS) steps per wave, and ceil(programs / slots) waves (slots = SMs x cfg.ctas_per_sm).
    Unsplit (NS = 1) the forward has one pass of BH * V/BV programs over n steps; split, it adds the
    augmented transition pass (BH * (K+V)/BV programs) and NS serial combine steps.  The step costs are the
    H200 phase timings at H=16, K=V=128, BV=32 (benchmarks/results/kda.md): state pass ~2.4 us per step and wave,
    transition pass ~1.4; a combine step is an estimate (~10).  A forward without autograd (grad False) whose
    unsplit pass has at most one program per SM runs it with cfg.stages_one_wave pipeline stages at
    cfg.w_one_wave us per step.  With autograd the backward's passes share the split, and the 2.4 us model
    stays.  The NS with the lowest modelled time wins (1 << 30 = no split)."""
    if seg_chunks is not None:
        return max(1, int(seg_chunks))
    if device.type != "cuda" or n_chunks_longest <= 1:
        return 1 << 30
    sms = sm_count(device)
    w_un = None if grad or BH * (V // BV) > sms else float(cfg.w_one_wave)
    return _seg_model(n_chunks_longest, BH, K, V, BV, sms * cfg.ctas_per_sm, w_un)


@functools.lru_cache(maxsize=256)
def _seg_model(n_chunks_longest, BH, K, V, BV, slots, w_unsplit=None):
    """_seg_chunks_for's wave model (memoised: ~20-40 us of Python per call otherwise); w_unsplit: the step
    cost of the unsplit pass when it differs from the split passes' (us)."""
    w0, w1, wc = 2.4, 1.4, 10.0
    p0, p1 = BH * (V // BV), BH * ((K + V) // BV)
    best, best_ns = n_chunks_longest * (w_unsplit or w0) * math.ceil(p0 / slots), 1
    for ns in range(2, min(256, n_chunks_longest) + 1):
        steps = math.ceil(n_chunks_longest / ns)
        cost = steps * (w0 * math.ceil(ns * p0 / slots) + w1 * math.ceil(ns * p1 / slots)) + wc * ns
        if cost < best:
            best, best_ns = cost, ns
    return 1 << 30 if best_ns == 1 else math.ceil(n_chunks_longest / best_ns)
