"""Triton KDA (backends/triton/kda/) vs the reference; interpreter (float32) on CPU, bf16 on the GPU."""
import contextlib
import math
import os

import pytest
import torch

import backends.reference.kda as R

tk = pytest.importorskip("backends.triton.kda")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def naive(q, k, v, g, beta, scale, S0):
    """Token recurrence of spec/OPS.md in float64 (one sequence): q,k,g [T,H,K], v [T,H,V], beta [T,H]."""
    T = q.shape[0]
    S = S0.double().clone()
    outs = []
    for t in range(T):
        S = S * g[t].double().exp()[..., None]
        kt = k[t].double()
        err = v[t].double() - torch.einsum("hkv,hk->hv", S, kt)
        S = S + beta[t].double()[:, None, None] * kt[..., None] * err[:, None, :]
        outs.append(scale * torch.einsum("hkv,hk->hv", S, q[t].double()))
    return (torch.stack(outs, 0) if outs else None), S


@pytest.fixture
def settings():
    """settings(**changes): backends.triton.kda's launch settings for the rest of the test (tk.config blocks,
    nested, left at the test's end)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(tk.config(**changes))


@pytest.fixture
def small_slices():
    """Run the test with the strip kernels' smallest channel slices (16), so that their slice loops run more
    than once."""
    with tk.config(bk=16):
        yield


def make(B, T, H, K, V, gate="sigmoid", at_bound=False, dtype=torch.float32, device="cpu"):
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    if at_bound:
        g = torch.full((B, T, H, K), -5.0)
        g[..., ::3] = -5.0 * torch.rand(B, T, H, K)[..., ::3]
    else:
        g = R.kda_gate(torch.randn(B, T, H, K) * 2, torch.randn(H) * 0.5, torch.randn(H * K), gate=gate)
    beta = torch.rand(B, T, H)
    S0 = torch.randn(B, H, K, V)
    out = [t.to(dtype) for t in (q, k, v)] + [g, beta.to(dtype), S0]
    return [t.to(device) for t in out]


@pytest.mark.parametrize("T", [1, 63, 64, 65, 100, 1000])
def test_forward_matches_reference(T, small_slices):
    B, H, K, V = (1, 1, 16, 16) if T == 1000 else (2, 2, 16, 32)
    q, k, v, g, beta, S0 = make(B, T, H, K, V)
    for lb in (None, -5.0):
        o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=lb)
        o_r, S_r = R.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        assert o.shape == o_r.shape and o.dtype == v.dtype and S.dtype == torch.float32
        assert rel_rms(o, o_r) < 2e-5 and rel_rms(S, S_r) < 2e-5


def test_head_major_grids_same_result():
    # the head-major grids (up to KdaConfig.head_major_max_chunks chunks; chunk-major past it) only reorder the
    # programs of the per-chunk kernels (forward and the backward's per-chunk kernels): forward, final state and
    # every gradient must be bit for bit those of the chunk-major grids, with 3 heads, T = 300 (5 chunks, the
    # last partial) and an initial state
    B, T, H, K, V = 1, 300, 3, 16, 32
    q, k, v, g, beta, S0 = make(B, T, H, K, V)
    do = torch.randn(B, T, H, V)
    res = []
    for hm in (False, True):
        ins = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
        with tk.config(bk=16, head_major_max_chunks=65535 if hm else 0):
            o, S = tk.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, lower_bound=-5.0)
        ((o * do).sum() + S.square().sum()).backward()
        res.append([o.detach(), S.detach()] + [x.grad for x in ins])
    assert all(torch.equal(a, b) for a, b in zip(*res))
    o_r, S_r = R.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert rel_rms(res[1][0], o_r) < 2e-5 and rel_rms(res[1][1], S_r) < 2e-5


@pytest.mark.parametrize("piece_chunks,max_pieces,pieces,both_gates", [(5, 32, 3, True), (1, 16, 16, False)])
def test_pipelined_forward_pieces(piece_chunks, max_pieces, pieces, both_gates, monkeypatch):
    # the no-autograd forward of one long sequence as a pipeline over chunk ranges (_fwd_pipelined; on the GPU
    # two streams, here the same launches in order): the same kernels over slices of the chunk tables, with the
    # output formed in the state pass (Wk S and QG S as one product), so the result must equal the one-stream
    # forward's up to that product's rounding, the final state exactly; T = 1000 is 16 chunks, the last one
    # partial. With the bound promised (dense diagonal tiles), and in the first case also without it (safe
    # tiles; the pipeline is the same code for both, so the other case runs the bound only)
    B, T, H, K, V = 1, 1000, 2, 16, 32
    q, k, v, g, beta, S0 = make(B, T, H, K, V)
    calls = []
    real = tk.forward._fwd_pipelined
    monkeypatch.setattr(tk.forward, "_fwd_pipelined", lambda *a: calls.append(len(a[11])) or real(*a))
    gates = ((-5.0, S0), (None, None)) if both_gates else ((-5.0, S0),)
    for lb, h0 in gates:
        want = {}
        for on in (False, True):
            with tk.config(bk=16, pipeline=on, pipe_min_chunks=2, pipe_piece_chunks=piece_chunks,
                           pipe_max_pieces=max_pieces):
                want[on] = tk.kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, lower_bound=lb)
        # (the merged [128, K] product may round its rows differently from two [64, K] ones)
        assert rel_rms(want[True][0], want[False][0]) < 1e-6 and torch.equal(want[True][1], want[False][1])
        o_r, S_r = R.kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert rel_rms(want[True][0], o_r) < 2e-5 and rel_rms(want[True][1], S_r) < 2e-5
    assert calls == [pieces] * len(gates)


def test_pipelined_forward_not_under_autograd(settings, monkeypatch):
    # under autograd the forward keeps what the backward needs: no pipeline, even where it would apply
    settings(bk=16, pipeline=True, pipe_min_chunks=2, pipe_piece_chunks=5, pipe_max_pieces=32)
    q, k, v, g, beta, _ = make(1, 1000, 2, 16, 32)
    calls = []
    real = tk.forward._fwd_pipelined
    monkeypatch.setattr(tk.forward, "_fwd_pipelined", lambda *a: calls.append(len(a[11])) or real(*a))
    with torch.no_grad():
        tk.kda_chunk(q, k, v, g, beta, lower_bound=-5.0)
    assert calls == [3]                              # (the same call without autograd does take it)
    qg = q.clone().requires_grad_()
    o, _ = tk.kda_chunk(qg, k, v, g, beta, lower_bound=-5.0, output_final_state=True)
    assert calls == [3]
    o.sum().backward()
    o_r, _ = R.kda_chunk(q, k, v, g, beta)
    assert rel_rms(o.detach(), o_r) < 2e-5 and qg.grad is not None and torch.isfinite(qg.grad).all()


def test_forward_against_token_loop_at_the_bound_segmented(small_slices):
    # every third channel random, the rest exactly at the bound; 3 segments of 1 chunk (+ a partial one);
    # V = 64 > K: two value blocks in the state pass, and the augmented [M | D] pass has unequal halves
    B, T, H, K, V = 1, 150, 2, 16, 64
    q, k, v, g, beta, S0 = make(B, T, H, K, V, at_bound=True)
    o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-5.0,
                        segment_chunks=1)
    o_n, S_n = naive(q[0], k[0], v[0], g[0], beta[0], K ** -0.5, S0[0])
    assert rel_rms(o[0], o_n) < 2e-5 and rel_rms(S[0], S_n) < 2e-5


def test_bound_violation_is_caught_not_assumed(small_slices):
    # promise lower_bound=-5 but feed g down to -40 in one chunk: the per-chunk check takes the safe path
    B, T, H, K, V = 1, 130, 1, 16, 16
    q, k, v, g, beta, S0 = make(B, T, H, K, V)
    g[:, 70:90] = -40.0 * torch.rand(1, 20, H, K)
    o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-5.0)
    o_n, S_n = naive(q[0], k[0], v[0], g[0], beta[0], K ** -0.5, S0[0])
    assert torch.isfinite(o).all()
    # decays of up to exp(-40) per step: the float32 G of that chunk reaches |G| ~ 400+ (the reference, with its
    # float64 G, was off the recurrence by up to ~1.9e-5 while it summed G in float32)
    assert rel_rms(o[0], o_n) < 2e-5
    assert rel_rms(S[0], S_n) < g32_bound(g)


@pytest.mark.parametrize("K,slices", [(16, 1), (32, 1), (32, 2)])
def test_rows32_dense_pairs_and_fallbacks(K, slices, settings):
    # _intra_strip32_kernel: a 32-row pair is one dense strip only when both its 16-row blocks keep the bound and
    # G falls by at most 161 across the pair in every channel; here lower_bound=-8 is promised and one chunk
    # holds a 16-row block at -8 <= g < -5 (its pair falls by more than 161: two 16-row dense blocks), another
    # a block at -40 (breaks the bound: safe path), the rest is in [-5, 0) with a third of the channels at -5;
    # slices = 2: the cumsum kernel's flags come from two channel slices (ANDed by the strip kernels), and the
    # low gates sit in the second slice's channels only; against the safe path (no bound promised: the 16-row
    # strip kernel, every diagonal tile pair by pair) as well
    cfg = settings(bk=16, cumsum_slices=slices)
    assert tk.intra._cumsum_slices(K, cfg) == slices
    B, T, H, V = 1, 230, 2, 16
    q, k, v, g, beta, S0 = make(B, T, H, K, V, at_bound=True)
    lo = K // 2 if slices == 2 else 0
    g[:, 80:96, :, lo:] = -5.0 - 3.0 * torch.rand(1, 16, H, K - lo)
    g[:, 150:160, :, lo:] = -40.0 * torch.rand(1, 10, H, K - lo)
    o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-8.0)
    o_n, S_n = naive(q[0], k[0], v[0], g[0], beta[0], K ** -0.5, S0[0])
    assert rel_rms(o[0], o_n) < 2e-5 and rel_rms(S[0], S_n) < g32_bound(g)
    o16, S16 = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=None)
    assert rel_rms(o, o16) < 1e-5 and rel_rms(S, S16) < 1e-5


def test_rows32_overflow_redone_as_16_row_blocks(settings):
    # a dense 32-row pair scales q and k by up to e^80.5: q entries of ~2e3 (q x 1e4, with G falling by 160.9
    # across each pair) or k x 2e5 (stable here: beta = 1e-11) overflow it; the pair must be redone as two
    # 16-row blocks, not return NaN (found by a user trial)
    settings(bk=16)
    B, T, H, K, V = 1, 64, 1, 16, 16
    q, k, v, _, beta, _ = make(B, T, H, K, V)
    g = torch.full((B, T, H, K), -5.19)
    g[:, 0] = g[:, 32] = 0.0
    for qq, kk, gg, bb, lb in ((q * 1e4, k, g, beta, -8.0), (q, k * 2e5, g.clamp(min=-5.0), beta * 1e-11, -5.0)):
        o, S = tk.kda_chunk(qq, kk, v, gg, bb, lower_bound=lb, output_final_state=True)
        o_r, S_r = R.kda_chunk(qq, kk, v, gg, bb, output_final_state=True)
        assert torch.isfinite(o).all() and torch.isfinite(S).all()
        assert rel_rms(o, o_r) < 2e-5 and rel_rms(S, S_r) < 2e-5


def test_numpy_scalars_and_meta_tensors():
    # numpy scalars for lower_bound / segment_chunks work on both backends (as for scale), and meta tensors get
    # the device message, not torch's "Tensor.item() cannot be called on meta tensors" from the value scan
    import numpy as np
    q, k, v, g, beta, S0 = make(1, 70, 1, 16, 16)
    want = R.kda_chunk(q, k, v, g, beta, lower_bound=-5.0, segment_chunks=1)[0]
    for f in (R.kda_chunk, tk.kda_chunk):
        o, _ = f(q, k, v, g, beta, lower_bound=np.float32(-5.0), segment_chunks=np.int64(1))
        assert rel_rms(o, want) < 2e-5
    meta = [t.to("meta") for t in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="meta tensors hold no data"):
        tk.kda_chunk(*meta)


def g32_bound(g, floor=2e-5):
    """The relative error that the kernels' float32 in-chunk cumulative gate G allows (fla keeps it in float32 as
    well; the reference sums it in float64): G_i - G_j is off by up to ulp(|G|), so the bound grows with the
    largest |G| within a chunk of 64 tokens, floor where that is small."""
    T = g.shape[1]
    gmax = max(float(g[:, a:a + 64].double().cumsum(1).abs().max()) for a in range(0, T, 64))
    return max(floor, 2.0 ** -23 * gmax)


def test_softplus_gate_strong_decay(small_slices):
    B, T, H, K, V = 1, 80, 1, 16, 16
    q, k, v, _, beta, S0 = make(B, T, H, K, V)
    g = -torch.rand(B, T, H, K) * 60          # far below any bound: cumulative sums overflow exp if misused
    o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_n, S_n = naive(q[0], k[0], v[0], g[0], beta[0], K ** -0.5, S0[0])
    assert torch.isfinite(o).all() and rel_rms(o[0], o_n) < 2e-5
    # the float32 G reaches |G| ~ 1900 here (ulp 1.2e-4): MTC_SEED=2118963447 gave 2.57e-5 on the final state
    assert rel_rms(S[0], S_n) < g32_bound(g)


def test_cu_seqlens_uneven(small_slices):
    lens = [1, 64, 37, 0, 65, 3]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T, H, K, V = int(cu[-1]), 2, 16, 16
    q, k, v, g, beta, _ = make(1, T, H, K, V)
    S0 = torch.randn(len(lens), H, K, V)
    o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu,
                        lower_bound=-5.0, segment_chunks=1)
    for n in range(len(lens)):
        s, e = int(cu[n]), int(cu[n + 1])
        o_n, S_n = naive(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], K ** -0.5, S0[n])
        if e > s:
            assert rel_rms(o[0, s:e], o_n) < 2e-5
        assert rel_rms(S[n], S_n) < 2e-5


@pytest.mark.parametrize("seg", [None, 2])
@pytest.mark.parametrize("bv", [16, 64])
def test_value_blocks_forward_and_backward(bv, seg, settings):
    # KdaConfig.bv = 16 / 64: the serial passes (state pass, segment maps, the backward's dS chain) on 16 / 64
    # state columns per program (16: what "auto" picks for forwards without autograd when 16-column programs
    # fit one per SM); V = 64 + initial and final state, gradients of every input against the reference.
    settings(bv=bv)
    B, T, H, K, V = 1, 150, 2, 16, 64
    q, k, v, g, beta, S0 = make(B, T, H, K, V)
    ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
    o, S = tk.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, lower_bound=-5.0,
                        segment_chunks=seg)
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
    o_r, S_r = R.kda_chunk(*ref_ins[:5], initial_state=ref_ins[5], output_final_state=True)
    assert rel_rms(o, o_r) < 2e-5 and rel_rms(S, S_r) < 2e-5
    go, gS = torch.randn_like(o), torch.randn_like(S)
    got = torch.autograd.grad((o * go).sum() + (S * gS).sum(), ins)
    exp = torch.autograd.grad((o_r * go).sum() + (S_r * gS).sum(), ref_ins)
    for name, a_, b_ in zip(("q", "k", "v", "g", "beta", "h0"), got, exp):
        assert rel_rms(a_, b_) < 1e-4, name


def test_segment_model_one_wave_forward():
    # H200 figures (132 SMs, 2 programs per SM): the forward without autograd at H=16, T=1M (16384 chunks, 16-column
    # programs, 128 <= 132) runs unsplit at the one-wave step cost; with autograd the split model stays (33
    # segments of 497 chunks at 32 columns); a pass with few programs (H=1) still splits, at either cost
    w = tk.KdaConfig().w_one_wave
    seg_model = tk.tables._seg_model
    assert seg_model(16384, 16, 128, 128, 16, 264, w) == 1 << 30
    assert seg_model(16384, 16, 128, 128, 32, 264) == 497
    assert seg_model(16384, 1, 128, 128, 16, 264, w) < 16384
    assert seg_model(16384, 1, 128, 128, 16, 264) < 16384


def test_value_block_rule():
    # "auto": 64 columns when 32-column programs would not fit one wave of slots (H=96, V=128: 384 > 264)
    vb = tk.state._value_block
    assert tk.KdaConfig().bv == "auto"
    assert vb(96, 128, 264) == 64 and vb(16, 128, 264) == 32
    assert vb(96, 32, 264) == 32 and vb(96, 128, None) == 32
    # without autograd: 16 columns when they fit one program per SM (H=16: 128 <= 132), else as before
    assert vb(16, 128, 264, 132, grad=False) == 16
    assert vb(16, 128, 264, 132, grad=True) == 32
    assert vb(32, 128, 264, 132, grad=False) == 32
    assert vb(96, 128, 264, 132, grad=False) == 64
    assert vb(96, 128, 264, bv=32) == 32 and vb(1, 16, 264, bv=32) == 16
    with pytest.raises(ValueError, match="must be 16, 32, 64 or 'auto'"):
        tk.config(bv=48).__enter__()


def test_chunk_tables_are_cached_per_geometry_and_right():
    # the chunk/segment tables are built once per (B, T, packing, segment length) and then reused; two
    # packings of the same T alternate (each keeps its own tables) and every call stays right
    H, K, V = 1, 16, 16
    packs = ([0, 30, 100, 130], [0, 64, 65, 130])
    q, k, v, g, beta, _ = make(1, 130, H, K, V)
    before = len(tk.tables._TABLE_CACHE)
    seen = {}
    for cs in packs + packs:
        cu = torch.tensor(cs, dtype=torch.int32)
        o, _ = tk.kda_chunk(q, k, v, g, beta, cu_seqlens=cu, lower_bound=-5.0, segment_chunks=1)
        bounds = list(zip(cs[:-1], cs[1:]))
        tab = tk.tables._tables(1, 130, bounds, 1, q.device)
        assert seen.setdefault(tuple(cs), tab) is tab           # the same dict on every call
        for s, e in bounds:
            o_n, _ = naive(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], K ** -0.5,
                           torch.zeros(H, K, V))
            assert rel_rms(o[0, s:e], o_n) < 2e-5
    assert seen[tuple(packs[0])] is not seen[tuple(packs[1])]
    assert seen[tuple(packs[0])]["clen"].tolist() == [30, 64, 6, 30]
    assert len(tk.tables._TABLE_CACHE) <= max(before + 2, tk.tables._TABLE_CACHE.max_entries)
    for n in range(tk.tables._TABLE_CACHE.max_entries + 3):                # bounded
        tk.tables._tables(1, 1000 + n, None, 4, q.device)
    assert len(tk.tables._TABLE_CACHE) == tk.tables._TABLE_CACHE.max_entries


@pytest.mark.parametrize("lb,seg,gate", [(None, None, "sigmoid"), (-5.0, 1, "sigmoid"), (None, 1, "softplus"),
                                         (-5.0, None, "sigmoid")])
def test_gradients_match_reference_autograd(lb, seg, gate):
    B, T, H, K, V = 1, 100, 2, 16, 16
    ins = [t.requires_grad_() for t in make(B, T, H, K, V, gate=gate)]
    do, dS = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    o, S = tk.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, lower_bound=lb,
                        segment_chunks=seg)
    gx = torch.autograd.grad((o * do).sum() + (S * dS).sum(), ins)
    o_r, S_r = R.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True)
    gr = torch.autograd.grad((o_r * do).sum() + (S_r * dS).sum(), ins)
    for name, a, b in zip("q k v g beta h0".split(), gx, gr):
        assert rel_rms(a, b) < 5e-5, name


@pytest.mark.parametrize("K,lb", [(16, -5.0), (64, -5.0), (64, None)])
def test_backward_with_cu_seqlens_segments_and_states(K, lb, settings):
    # the backward against the reference's autograd: packed sequences of uneven lengths (one empty, ones shorter
    # than a chunk), segments of 2 chunks, initial and final states; at K = 64 the intra backward runs in 4
    # channel slices of 16, with the bound promised (dense diagonal tiles; the gate breaks it in some channels of
    # some rows, so slices differ) and without (safe diagonal tiles)
    settings(bwd_pair_bk=16, bwd_chunk_kv=16 * K)      # (the chunk kernel's sums over V in two blocks of 16)
    lens = [130, 5, 0, 200, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T, H, V = int(cu[-1]), 2, 32
    q, k, v, g, beta, _ = make(1, T, H, K, V, at_bound=True)
    g[:, 140:170, :, K // 2:K // 2 + 8] = -12.0 * torch.rand(1, 30, H, 8)
    S0 = torch.randn(len(lens), H, K, V)
    ins = [t.requires_grad_() for t in (q, k, v, g, beta, S0)]
    do, dS = torch.randn(1, T, H, V), torch.randn(len(lens), H, K, V)
    o, S = tk.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, cu_seqlens=cu, lower_bound=lb,
                        segment_chunks=2)
    gx = torch.autograd.grad((o * do).sum() + (S * dS).sum(), ins)
    o_r, S_r = R.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, cu_seqlens=cu)
    gr = torch.autograd.grad((o_r * do).sum() + (S_r * dS).sum(), ins)
    for name, a, b in zip("q k v g beta h0".split(), gx, gr):
        assert rel_rms(a, b) < 5e-5, name


def test_argument_checks_and_no_double_backward():
    q, k, v, g, beta, S0 = make(1, 70, 1, 16, 16)
    with pytest.raises(ValueError, match="g must be <= 0"):
        tk.kda_chunk(q, k, v, -g, beta, check_finite=True)
    with pytest.raises(ValueError, match="g must be <= 0"):  # the default checks CPU tensors (as the reference)
        tk.kda_chunk(q, k, v, -g, beta)
    g_inf = g.clone()
    g_inf[0, 5, 0, 3] = float("-inf")
    with pytest.raises(ValueError, match="g holds NaN or inf"):
        tk.kda_chunk(q, k, v, g_inf, beta, check_finite=True)
    for bad in ("x", 0, -3, 2.5, True):
        with pytest.raises(ValueError, match="segment_chunks"):
            tk.kda_chunk(q, k, v, g, beta, segment_chunks=bad)
    for bad in ("-5", True):
        with pytest.raises(TypeError, match="lower_bound"):
            tk.kda_chunk(q, k, v, g, beta, lower_bound=bad)
    # the backward is not itself differentiable: a second derivative is an error, not a silent zero
    qq = q.clone().requires_grad_()
    o, _ = tk.kda_chunk(qq, k, v, g, beta, lower_bound=-5.0)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad((o ** 2).sum(), qq, create_graph=True)


def test_float16_with_a_bound_past_its_range():
    # float16 tiles hold at most e^11: with lower_bound -5 the dense diagonal tiles (factors up to e^40) gave
    # NaN / inf; such bounds now take the safe path, in the forward and the backward
    B, T, H, K, V = 1, 100, 2, 16, 16
    q, k, v, g, beta, S0 = make(B, T, H, K, V)
    g = R.kda_gate(torch.randn(B, T, H, K) * 2, torch.randn(H) * 0.5, torch.randn(H * K), lower_bound=-5.0)
    ins = [t.half().requires_grad_() for t in (q, k, v)] + [g.requires_grad_(), beta.half().requires_grad_()]
    do = torch.randn(B, T, H, V)
    o, _ = tk.kda_chunk(*ins, lower_bound=-5.0)
    gx = torch.autograd.grad((o.float() * do).sum(), ins)
    f32 = [t.detach().float().requires_grad_() for t in ins]
    o_r, _ = R.kda_chunk(*f32)
    gr = torch.autograd.grad((o_r * do).sum(), f32)
    assert torch.isfinite(o).all() and rel_rms(o.float(), o_r) < 5e-3
    for name, a, b in zip("q k v g beta".split(), gx, gr):
        assert torch.isfinite(a).all() and rel_rms(a.float(), b) < 2e-2, name


@pytest.mark.parametrize("T", [100, 333])
def test_forward_keeps_n_in_bfloat16_for_16bit_inputs(T, monkeypatch):
    # a 16-bit forward without autograd passes N = diag(beta) Akk from the strip to the solve kernel in bfloat16;
    # its result stays within float16 rounding of the forward under autograd (N and T in float32, kept for the
    # backward) and of the float32 reference
    B, H, K, V = 1, 2, 32, 32
    q, k, v, g, beta, S0 = make(B, T, H, K, V, dtype=torch.float16)
    seen = []
    scratch = tk.intra._intra_scratch

    def spy(*a, **kw):
        out = scratch(*a, **kw)
        seen.append(out[0].dtype)
        return out

    monkeypatch.setattr(tk.intra, "_intra_scratch", spy)
    runs = {}
    with torch.no_grad():
        runs[True] = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-1.0)
    o, S = tk.kda_chunk(q.clone().requires_grad_(), k, v, g, beta, initial_state=S0, output_final_state=True,
                        lower_bound=-1.0)
    runs[False] = o.detach(), S.detach()
    assert seen == [torch.bfloat16, torch.float32]
    f32 = [t.float() for t in (q, k, v, g, beta)]
    o_r, S_r = R.kda_chunk(*f32, initial_state=S0, output_final_state=True)
    (o, S), (o32, S32) = runs[True], runs[False]
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    assert rel_rms(o.float(), o32.float()) < 2e-3 and rel_rms(S, S32) < 2e-3
    assert rel_rms(o.float(), o_r) < 5e-3 and rel_rms(S, S_r) < 5e-3


def test_per_block_bound_check_with_channel_slices():
    # K = 64: the gate breaks the promised bound only in channels 20..40 of rows 70..90 (chunk 1, row blocks 0 and
    # 1), so fast and safe diagonal tiles mix inside one chunk (the check is per row block over all channels,
    # from _chunk_cumsum_kernel's flags; the 32-row strips take K in slices of 32)
    B, T, H, K, V = 1, 150, 1, 64, 32
    q, k, v, g, beta, S0 = make(B, T, H, K, V, at_bound=True)
    g[:, 70:90, :, 20:40] = -30.0 * torch.rand(1, 20, H, 20)
    o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-5.0)
    o_n, S_n = naive(q[0], k[0], v[0], g[0], beta[0], K ** -0.5, S0[0])
    assert torch.isfinite(o).all()
    # decays of up to exp(-30) per step in channels 20..40: the bound follows the float32 G's reach there
    assert rel_rms(o[0], o_n) < 2e-5
    assert rel_rms(S[0], S_n) < g32_bound(g)


def test_gate_and_step():
    B, T, H, K, V = 2, 5, 2, 16, 32
    x = torch.randn(B, T, H, K) * 3
    A_log, dt = torch.randn(H), torch.randn(H * K)
    for gate in ("sigmoid", "softplus"):
        g = tk.kda_gate(x, A_log, dt, lower_bound=-4.0, gate=gate)
        assert rel_rms(g, R.kda_gate(x, A_log, dt, lower_bound=-4.0, gate=gate)) < 1e-6
    q, k, v, g, beta, S0 = make(B, T, H, K, V)
    S0c = S0.clone()
    st = S0
    for t in range(T):
        o, new = tk.kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], st)
        o_r, new_r = R.kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], st)
        assert rel_rms(o, o_r) < 1e-5 and rel_rms(new, new_r) < 1e-5
        st = new
    assert torch.equal(S0, S0c)  # the state passed in was never written


@pytest.mark.parametrize("K,V", [(12, 24), (8, 16), (16, 40)])
def test_sizes_that_are_not_powers_of_two(K, V):
    # the contract puts no size limit on K / V: kda_chunk zero-pads to the kernels' sizes (value and gradient
    # checked against the reference), kda_gate and kda_step mask their columns
    B, T, H = 1, 70, 2
    ins = [t.requires_grad_() for t in make(B, T, H, K, V)]
    o, S = tk.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, lower_bound=-5.0)
    o_r, S_r = R.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True)
    assert o.shape == (B, T, H, V) and S.shape == (1, H, K, V)
    assert rel_rms(o, o_r) < 2e-5 and rel_rms(S, S_r) < 2e-5
    do, dS = torch.randn_like(o), torch.randn_like(S)
    grads = torch.autograd.grad((o * do).sum() + (S * dS).sum(), ins)
    grads_r = torch.autograd.grad((o_r * do).sum() + (S_r * dS).sum(), ins)
    for a, b in zip(grads, grads_r):
        assert rel_rms(a, b) < 1e-4
    x, A_log, dt = torch.randn(B, 9, H, K) * 3, torch.randn(H), torch.randn(H * K)
    assert rel_rms(tk.kda_gate(x, A_log, dt), R.kda_gate(x, A_log, dt)) < 1e-6
    q, k, v, g, beta, S0 = (t.detach() for t in make(3, 1, H, K, V))
    o1, S1 = tk.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
    o1r, S1r = R.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
    assert rel_rms(o1, o1r) < 1e-5 and rel_rms(S1, S1r) < 1e-5


def test_step_checks_every_batch_dimension():
    # the Triton kda_step checked shapes on zero-row slices, so a beta / state / k with another batch size went
    # through (reads and writes past the end: wrong numbers, heap corruption); now the reference's checks
    B, H, K, V = 2, 2, 16, 16
    q, k, v, g = torch.randn(B, H, K), torch.randn(B, H, K), torch.randn(B, H, V), -torch.rand(B, H, K)
    beta, S = torch.rand(B, H), torch.randn(B, H, K, V)
    with pytest.raises(ValueError, match=r"beta must be \[B,H\] = \(2, 2\), got \(1, 2\)"):
        tk.kda_step(q, k, v, g, beta[:1].clone(), S)
    with pytest.raises(ValueError, match=r"state must be \[B,H,K,V\] = \(2, 2, 16, 16\)"):
        tk.kda_step(q, k, v, g, beta, S[:1].clone())
    with pytest.raises(ValueError, match=r"state must be"):
        tk.kda_step(q, k, v, g, beta, torch.randn(3, H, K, V))
    with pytest.raises(ValueError, match=r"k and g must be"):
        tk.kda_step(q, k[:1].clone(), v, g, beta, S)
    with pytest.raises(ValueError, match=r"triton.kda_step: q must be \[B,H,K\]"):
        tk.kda_step(torch.randn(()), k, v, g, beta, S)


def test_errors():
    q, k, v, g, beta, S0 = make(1, 10, 1, 16, 16)
    for bad in (0.0, 0.5, -math.inf, math.nan):
        with pytest.raises(ValueError, match="lower_bound"):
            tk.kda_chunk(q, k, v, g, beta, lower_bound=bad)
    # a bound below the dense tiles' range is accepted, as the reference accepts it: the safe path, same result
    o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-20.0)
    o_r, S_r = R.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-20.0)
    assert rel_rms(o, o_r) < 2e-5 and rel_rms(S, S_r) < 2e-5
    with pytest.raises(ValueError, match="at most 256"):
        qb, kb, vb, gb, bb, _ = make(1, 3, 1, 320, 16)
        tk.kda_chunk(qb, kb, vb, gb, bb)
    with pytest.raises(TypeError, match=r"k is torch.float64; the Triton kernels take float32, float16 or bfloat16"):
        tk.kda_chunk(q, k.double(), v, g, beta)
    with pytest.raises(ValueError, match="B == 1"):
        q2, k2, v2, g2, b2, _ = make(2, 10, 1, 16, 16)
        tk.kda_chunk(q2, k2, v2, g2, b2, cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton.language as tl
import backends.triton.kda as tk
from backends.triton.kda import backward as kb, gate as kg, intra as ki, state as ks, step as kst
cfg = tk.KdaConfig()
P, F, I = "*bf16", "*fp32", "*i32"
def build(fn, sig, consts, nw, ns, **opts):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=nw, num_stages=ns, **opts))
def tc(ck, what):
    assert "mma.sync" in ck.asm["ptx"] or "wgmma" in ck.asm["ptx"], what + ": no tensor-core instruction"
sig = dict(KGB=P, v=P, beta=P, cstart=I, clen=I, TB=F, WK=P, U=P, H="i32", K="constexpr", V="constexpr",
           DT="constexpr", HM="constexpr")
ck = build(ki._wy_apply_kernel, sig, dict(K=128, V=128, DT=tl.bfloat16, HM=True), cfg.nw_wu, 1)
assert "wgmma" in ck.asm["ptx"], "w/u kernel: no wgmma"
sig5 = dict(q=P, k=P, GCS=F, FB=I, beta=P, cstart=I, clen=I, NB=F, QG=P, KD=P, AQK=P, GAM=F, scale="fp32",
            lb="fp32", H="i32", K="constexpr", BK="constexpr", DT="constexpr", BM=F, SAVE_B="constexpr", KGB=P,
            FTZ="constexpr", NS="constexpr")
for save_b in (False, True):
    ck = build(ki._intra_strip16_kernel, sig5, dict(K=128, BK=cfg.bk, DT=tl.bfloat16, SAVE_B=save_b, FTZ=True, NS=2),
               cfg.nw_strip, 1)
    tc(ck, "16-row strip kernel")
    assert "ex2.approx.ftz.f32" in ck.asm["ptx"], "16-row strip kernel (ftz): no flush-to-zero exponential"
for ns in (1, 2):
    # (the forward without autograd stores N in bfloat16)
    ck = build(ki._intra_strip32_kernel, dict(sig5, NB=P if ns == 2 else F, HM="constexpr"),
               dict(K=128, BK=cfg.bk_strip32, DT=tl.bfloat16, SAVE_B=ns == 1, FTZ=True, NS=ns, HM=True),
               cfg.nw_strip32, 1, maxnreg=cfg.maxnreg_strip32)
    tc(ck, "32-row strip kernel")
    assert ck.metadata.shared <= 227 * 1024, ck.metadata.shared
    ck = build(ki._chunk_cumsum_kernel, dict(g=F, cstart=I, clen=I, GCS=F, FB=I, lb="fp32", H="i32", K="constexpr",
                                             FAST="constexpr", ROWS32="constexpr", NS="constexpr", HM="constexpr"),
               dict(K=128, FAST=True, ROWS32=True, NS=ns, HM=True), cfg.nw_cumsum, 1)
    assert ck.metadata.shared <= 227 * 1024, ck.metadata.shared
build(kst._step_kernel, dict(q=P, k=P, v=P, g=F, beta=P, S_in=F, S_out=F, o=P, scale="fp32", K="constexpr",
                             V="constexpr", BV="constexpr", KP="constexpr"), dict(K=24, V=40, BV=64, KP=32), 4, 1)
build(kg._gate_kernel, dict(x=P, A_log=F, dt_bias=F, g=F, n_rows="i32", H="i32", lb="fp32", K="constexpr",
                            BR="constexpr", SOFTPLUS="constexpr", KP="constexpr"),
      dict(K=24, BR=32, SOFTPLUS=False, KP=32), 4, 1)
solve = dict(NB=F, cstart=I, clen=I, TB=F, H="i32", PREC="constexpr", HM="constexpr")
ck = build(ki._wy_solve_kernel, solve, dict(PREC="ieee", HM=True), cfg.nw_solve, 1)
assert ck.metadata.shared <= 227 * 1024, ck.metadata.shared
ck = build(ki._wy_solve_kernel, solve, dict(PREC=cfg.solve_prec, HM=True), cfg.nw_solve, 1)
tc(ck, "solve kernel (tf32x3)")
ck = build(ki._wy_solve_kernel, dict(solve, NB=P, TB=P), dict(PREC=cfg.solve_prec_fwd, HM=True), cfg.nw_solve, 1)
tc(ck, "solve kernel (tf32)")
sig = dict(WK=P, U=P, KD=P, GAM=F, VN=P, HB=P, S_IN=F, S_OUT=F, seg_t0=I, seg_t1=I, seg_c0=I, seg_c1=I,
           H="i32", K="constexpr", V="constexpr", BV="constexpr", SW="constexpr", MODE="constexpr",
           STORE="constexpr", STORE_VN="constexpr")
for mode, sw in ((0, 128), (1, 256)):
    for bv in (32, 64):                     # two programs per SM
        ck = build(ks._state_pass_kernel, sig, dict(K=128, V=128, BV=bv, SW=sw, MODE=mode, STORE=mode == 0,
                                                    STORE_VN=mode == 0), cfg.state_warps, cfg.state_stages)
        tc(ck, "state kernel")
        assert ck.metadata.shared * cfg.ctas_per_sm <= 227 * 1024, ck.metadata.shared
    for bv in (16, 32):     # one program per SM (_pass_stages): stages_one_wave
        ck = build(ks._state_pass_kernel, sig, dict(K=128, V=128, BV=bv, SW=sw, MODE=mode, STORE=mode == 0,
                                                    STORE_VN=mode == 0), cfg.state_warps, cfg.stages_one_wave)
        tc(ck, "state kernel")
        assert ck.metadata.shared <= 227 * 1024, ck.metadata.shared
ck = build(ks._state_pass_kernel, dict(sig, QG=P, AQK=P, O=P, FUSE_O="constexpr"),
           dict(K=128, V=128, BV=cfg.pipe_bv, SW=128, MODE=0, STORE=False, STORE_VN=False, FUSE_O=True),
           cfg.state_warps, cfg.stages_one_wave)
tc(ck, "fused state kernel")
assert ck.metadata.shared <= 227 * 1024, ck.metadata.shared
sig = dict(QG=P, WK=P, KD=P, AQK=P, GAM=F, DO=P, HB=P, DS_END=F, DHB=P, DU=P, DGP=F, DS_OUT=F, seg_t0=I,
           seg_t1=I, seg_c0=I, seg_c1=I, H="i32", K="constexpr", V="constexpr", BV="constexpr")
for bv in (32, 64):
    ck = build(kb._bwd_state_chain_kernel, sig, dict(K=128, V=128, BV=bv), cfg.bwd_chain_warps,
               cfg.bwd_chain_stages)
    tc(ck, "backward dS chain")
    assert ck.metadata.shared * cfg.ctas_per_sm <= 227 * 1024, ck.metadata.shared
sig = dict(k=P, v=P, g=F, beta=P, cstart=I, clen=I, TB=F, BM=F, DU=P, DWK=P, DB=F, DKG=F, dv_=P, dbeta=P, H="i32",
           K="constexpr", V="constexpr", DT="constexpr", HM="constexpr")
ck = build(kb._bwd_ut_kernel, sig, dict(K=128, V=128, DT=tl.bfloat16, HM=True), cfg.bwd_ut_warps, 1)
tc(ck, "backward UT kernel")
sig = dict(q=P, k=P, g=F, beta=P, cstart=I, clen=I, DKG=F, DB=F, DAQK=F, DQG=P, DKD=P, DGAM=F, dq=P, dk_=P,
           dg=F, scale="fp32", lb="fp32", H="i32", K="constexpr", BK="constexpr", FAST="constexpr", DT="constexpr",
           SAFE="constexpr", HM="constexpr")
for safe in (False, True):
    ck = build(kb._bwd_pair_kernel, sig, dict(K=128, BK=cfg.bwd_pair_bk, FAST=True, DT=tl.bfloat16, SAFE=safe,
                                              HM=True), cfg.bwd_pair_warps, 1)
    tc(ck, "backward pair kernel")
sig = dict(WK=P, U=P, QG=P, AQK=P, DO=P, HB=P, DHB=P, DU=P, DWK=P, DQG=P, DKD=P, DAQK=F, cstart=I, clen=I,
           H="i32", K="constexpr", V="constexpr", BVC="constexpr", HM="constexpr")
for K_, V_ in ((128, 128), (256, 256), (64, 256)):
    ck = build(kb._bwd_chunk_kernel, sig, dict(K=K_, V=V_, BVC=min(V_, cfg.bwd_chunk_kv // K_), HM=True), 8, 1)
    assert "wgmma" in ck.asm["ptx"], "backward chunk kernel: no wgmma"
    assert ck.metadata.shared <= 227 * 1024, (K_, V_, ck.metadata.shared)
sig = dict(QG=P, AQK=P, VN=P, HB=P, O=P, cstart=I, clen=I, H="i32", K="constexpr", V="constexpr",
           BV="constexpr", HM="constexpr")
ck = build(ks._output_kernel, sig, dict(K=128, V=128, BV=128, HM=True), 4, 1)
assert "wgmma" in ck.asm["ptx"], "o kernel: no wgmma"
sig = dict(MD=F, S_INIT=F, S_ENTRY=F, S_FIN=F, seq_s0=I, seq_s1=I, H="i32", K="constexpr", V="constexpr",
           BV="constexpr", HAS_INIT="constexpr", REVERSE="constexpr", PREC="constexpr")
ck = build(ks._combine_kernel, sig, dict(K=128, V=128, BV=32, HAS_INIT=True, REVERSE=False, PREC="tf32x3"), 8, 1)
assert "wgmma" in ck.asm["ptx"], "combine kernel: no wgmma (the float32 FMA dot spills ~14 KB)"
print("OK")
"""


def test_hopper_compile_uses_tensor_cores():
    """Compile the kernels for sm_90 without a GPU (fresh process, interpreter off); the PTX must use wgmma/mma
    and fit Hopper's shared memory."""
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


# ------------------------------------------------------------------ GPU (bf16, real sizes)
@pytest.mark.gpu
@pytest.mark.parametrize("H,seg,intra", [(4, None, "default"), (4, 8, "default"), (16, None, "default"),
                                         (4, 8, "tf32x3-solve"), (4, 8, "bv64"), (96, None, "bv64"), (4, 8, "bv16")])
def test_gpu_bf16_t4096(H, seg, intra, settings):
    # "default": the forward exactly as configured (the 32-row strips, the "tf32" solve of a forward without
    # autograd); the other rows set the solve's precision or the state columns
    settings(**{"default": {}, "tf32x3-solve": dict(solve_prec_fwd="tf32x3"), "bv64": dict(bv=64),
                "bv16": dict(bv=16)}[intra])
    B, T, K, V = 1, 4096, 128, 128
    q, k, v, g, beta, S0 = make(B, T, H, K, V, dtype=torch.bfloat16, device="cuda")
    o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-5.0,
                        segment_chunks=seg)
    o_r, S_r = R.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    eo, es = rel_rms(o, o_r), rel_rms(S, S_r)
    print(f"\nGPU bf16 T=4096 H={H} seg={seg} intra={intra}: rel RMS o {eo:.2e}, final state {es:.2e}")
    assert eo < 5e-3 and es < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("T,grad", [(1, False), (1000, False), (1000, True)])
def test_gpu_float32_one_wave(T, grad):
    # float32 inputs at a size whose state pass fits one wave of SMs (H = 12, the `small` model's KDA): the pass's
    # pipeline stages must fit the shared memory with 4-byte tiles (three stages needed 240 KB of 227)
    B, H, K, V = 1, 12, 128, 128
    q, k, v, g, beta, S0 = make(B, T, H, K, V, dtype=torch.float32, device="cuda")
    xs = [t.clone().requires_grad_(grad) for t in (q, k, v, g, beta)]
    xr = [t.clone().requires_grad_(grad) for t in (q, k, v, g, beta)]
    o, S = tk.kda_chunk(*xs, initial_state=S0, output_final_state=True, lower_bound=-5.0)
    o_r, S_r = R.kda_chunk(*xr, initial_state=S0, output_final_state=True)
    assert rel_rms(o, o_r) < 2e-3 and rel_rms(S, S_r) < 2e-3
    if grad:
        w = torch.randn_like(o)
        (o * w).sum().backward()
        (o_r * w).sum().backward()
        for a, b in zip(xs, xr):
            assert rel_rms(a.grad, b.grad) < 5e-3


@pytest.mark.gpu
def test_gpu_rows32_overflow_bf16():
    # the 32-row pairs' overflow guard on the GPU (bf16, T = 4097): G falls by 160.9 across every pair (dense), and
    # q x 1e4 (or k x 2e5 with beta 1e-11, a stable recurrence) overflows the dense tile; those pairs are redone
    # as 16-row blocks, so o must be finite and right against the float32 reference
    B, T, H, K, V = 1, 4097, 4, 128, 128
    q, k, v, _, beta, _ = make(B, T, H, K, V, dtype=torch.bfloat16, device="cuda")
    g = torch.full((B, T, H, K), -5.19, device="cuda")
    g[:, ::32] = 0.0
    for qq, kk, gg, bb, lb in ((q * 1e4, k, g, beta, -8.0), (q, k * 2e5, g.clamp(min=-5.0), beta * 1e-11, -5.0)):
        o, S = tk.kda_chunk(qq, kk, v, gg, bb, lower_bound=lb, output_final_state=True)
        o_r, S_r = R.kda_chunk(qq, kk, v, gg, bb, output_final_state=True)
        assert torch.isfinite(o).all() and torch.isfinite(S).all()
        eo, es = rel_rms(o, o_r), rel_rms(S, S_r)
        print(f"\nGPU bf16 rows32 overflow guard: rel RMS o {eo:.2e}, final state {es:.2e}")
        assert eo < 5e-3 and es < 5e-3


@pytest.mark.gpu
def test_gpu_pipelined_forward_bf16():
    # T = 140001 is 2188 chunks: past KdaConfig.pipe_min_chunks, so the no-autograd forward runs as the pipeline
    # over its pieces (the output formed in the state pass, Wk S and QG S as one product): the one-stream forward
    # with the same state columns within rounding (the final state bit for bit), right against the reference, and
    # the same again when captured in a CUDA graph (the side stream forks from and joins the capturing stream)
    B, T, H, K, V = 1, 140001, 4, 128, 128
    q, k, v, g, beta, S0 = make(B, T, H, K, V, dtype=torch.bfloat16, device="cuda")
    cfg = tk.KdaConfig()
    tab = tk.tables._tables(B, T, None, 1 << 30, q.device)
    plan = tk.forward._pipeline_pieces(tab, True, q.device, H, V, 16, cfg)
    assert plan is not None and plan[1] == cfg.pipe_bv
    # at H = 96 the state pass would hold every SM: no pipeline
    assert tk.forward._pipeline_pieces(tab, True, q.device, 96, V, 16, cfg) is None
    with torch.no_grad():
        o, S = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-5.0)
        with tk.config(bv=plan[1], pipeline=False):
            o1, S1 = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-5.0)
        assert rel_rms(o, o1) < 1e-3 and torch.equal(S, S1)
        o_r, S_r = R.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        eo, es = rel_rms(o, o_r), rel_rms(S, S_r)
        print(f"\nGPU bf16 T={T} H={H} pipelined: rel RMS o {eo:.2e}, final state {es:.2e}")
        assert eo < 5e-3 and es < 5e-3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            og, Sg = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-5.0)
        q.copy_(torch.flip(q, [1]))
        o2, S2 = tk.kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, lower_bound=-5.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(og, o2) and torch.equal(Sg, S2) and not torch.equal(o2, o)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_uses_live_tables():
    # kda_chunk captured in a CUDA graph (its chunk tables from the cache, built by the warm-up) replays on new
    # inputs to the eager result, after the table cache has been pushed past its size (an entry a graph uses
    # must not be evicted and freed under it)
    B, T, H, K, V = 1, 1000, 2, 128, 128
    static = make(B, T, H, K, V, dtype=torch.bfloat16, device="cuda")[:5]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            tk.kda_chunk(*static, lower_bound=-5.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = tk.kda_chunk(*static, lower_bound=-5.0)
    for n in range(tk.tables._TABLE_CACHE.max_entries + 4):
        tk.tables._tables(1, 2000 + 64 * n, None, 1 << 30, static[0].device)
    junk = [torch.full((1 << 20,), -7, dtype=torch.int32, device="cuda") for _ in range(8)]   # reuse freed blocks
    fresh = make(B, T, H, K, V, dtype=torch.bfloat16, device="cuda")[:5]
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = tk.kda_chunk(*fresh, lower_bound=-5.0)
    del junk
    assert rel_rms(out, ref) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("intra", ["default", "bv64"])
def test_gpu_bf16_grad(intra, settings):
    settings(**({"bv": 64} if intra == "bv64" else {}))
    B, T, H, K, V = 1, 1024, 2, 128, 128
    ins = make(B, T, H, K, V, dtype=torch.bfloat16, device="cuda")
    ins = [t.requires_grad_() for t in ins]
    do = torch.randn(B, T, H, V, device="cuda")
    o, S = tk.kda_chunk(*ins[:5], initial_state=ins[5], output_final_state=True, lower_bound=-5.0)
    gx = torch.autograd.grad((o.float() * do).sum() + S.sum(), ins)
    f32 = [t.detach().float().requires_grad_() for t in ins]
    o_r, S_r = R.kda_chunk(*f32[:5], initial_state=f32[5], output_final_state=True)
    gr = torch.autograd.grad((o_r * do).sum() + S_r.sum(), f32)
    errs = {n: rel_rms(a, b) for n, a, b in zip("q k v g beta h0".split(), gx, gr)}
    print(f"\nGPU bf16 grad rel RMS ({intra}):", {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e < 3e-2 for e in errs.values()), errs
