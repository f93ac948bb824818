"""Tests of attn_residual (Block AttnRes): the float32 reference and the Triton kernels.

Every result is compared with `_naive` below, an independent float64 re-derivation of spec/OPS.md
"attn_residual" written as a plain loop over the sources (division by the RMS rather than rsqrt, the
softmax written out by hand), on fresh random inputs, at token counts that are not multiples of any tile.
The Triton kernels run under TRITON_INTERPRET=1 on CPU (set by conftest.py), in float32/float16 at small
sizes; the `gpu` tests run in bf16 at the model's size (d = 7168) on the device machine.
"""
import importlib

import pytest
import torch

# the modules themselves (the package __init__ files re-export functions of the same names)
R = importlib.import_module("backends.reference.attn_residual")
T = importlib.import_module("backends.triton.attn_residual")
TF = importlib.import_module("backends.triton.attn_residual.forward")

EPS = 1e-6


# ------------------------------------------------------------------------------------------------
# independent reference and helpers
# ------------------------------------------------------------------------------------------------

def _naive(query, sources, rms_weight, eps=EPS, output_rms_weight=None):
    """float64, one source at a time: logit_i = sum(q * w * x_i / rms(x_i)); softmax; sum_i p_i x_i."""
    q = query.double()
    w = rms_weight.double()
    xs = [s.double() for s in sources]
    logits = []
    for x in xs:
        rms = torch.sqrt((x * x).mean(dim=-1) + eps)
        logits.append((x * (q * w)).sum(dim=-1) / rms)
    top = logits[0]
    for lg in logits[1:]:
        top = torch.maximum(top, lg)
    ex = [torch.exp(lg - top) for lg in logits]
    z = ex[0]
    for e in ex[1:]:
        z = z + e
    out = torch.zeros_like(xs[0])
    for e, x in zip(ex, xs):
        out = out + (e / z).unsqueeze(-1) * x
    if output_rms_weight is not None:
        out = out / torch.sqrt((out * out).mean(dim=-1, keepdim=True) + eps) * output_rms_weight.double()
    return out


def _rel(a, b):
    """relative RMS error of a against b (float64)."""
    a = a.double()
    b = b.double()
    den = b.norm()
    assert torch.isfinite(a).all(), "non-finite values in the result"
    if den == 0:
        return a.norm().item()
    return ((a - b).norm() / den).item()


def _inputs(L, shape, dtype, device="cpu", scale_q=1.0):
    d = shape[-1]
    # sources of different scales, as in a residual stream; queries large enough that the softmax is peaked
    sources = [torch.randn(shape, device=device, dtype=torch.float32).mul_(0.5 + 2 * torch.rand(1).item()).to(dtype)
               for _ in range(L)]
    query = (torch.randn(d, device=device) * scale_q).to(dtype)
    rms_weight = (1 + 0.5 * torch.randn(d, device=device)).to(dtype)
    return query, sources, rms_weight


def _tol(dtype):
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]


# ------------------------------------------------------------------------------------------------
# reference backend
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L", [1, 2, 3, 16, 25, 64])
@pytest.mark.parametrize("onorm", [False, True])
def test_reference_matches_naive(L, onorm):
    query, sources, w = _inputs(L, (3, 37, 48), torch.float32)
    ow = torch.randn(48) if onorm else None
    out = R.attn_residual(query, sources, w, eps=EPS, output_rms_weight=ow)
    assert out.shape == (3, 37, 48) and out.dtype == torch.float32
    assert _rel(out, _naive(query, sources, w, EPS, ow)) < 2e-6


def test_reference_keeps_dtype_and_scores_query_zero_as_mean():
    # a zero query (the initialisation) gives a uniform mix: out = mean of the sources
    L = 5
    _, sources, w = _inputs(L, (65, 32), torch.float16)
    out = R.attn_residual(torch.zeros(32), sources, w)
    assert out.dtype == torch.float16
    mean = sum(s.double() for s in sources) / L
    assert _rel(out, mean) < 2e-3


@pytest.mark.parametrize("with_partial", [False, True])
@pytest.mark.parametrize("onorm", [False, True])
def test_reference_two_phase_equals_direct(with_partial, onorm):
    Q, B, d = 5, 4, 40
    bank = [torch.randn(2, 33, d) for _ in range(B)]
    queries = torch.randn(Q, d) * 2
    ws = 1 + 0.3 * torch.randn(Q, d)
    ow = torch.randn(d) if onorm else None
    partial = torch.randn(2, 33, d) if with_partial else None
    acc, m, s = R.attn_residual_phase1(queries, bank, ws)
    assert acc.shape == (Q, 2, 33, d) and m.shape == (Q, 2, 33) and s.shape == (Q, 2, 33)
    assert acc.dtype == m.dtype == s.dtype == torch.float32
    assert (s >= 1 - 1e-6).all()
    for k in range(Q):
        out = R.attn_residual_merge(acc[k], m[k], s[k], partial, queries[k], ws[k], output_rms_weight=ow)
        srcs = bank + ([partial] if with_partial else [])
        assert _rel(out, _naive(queries[k], srcs, ws[k], EPS, ow)) < 2e-6


# ------------------------------------------------------------------------------------------------
# argument checks (both backends share them)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mod", [R, T], ids=["reference", "triton"])
def test_errors(mod):
    d = 16
    q, w = torch.randn(d), torch.randn(d)
    x = torch.randn(4, d)
    with pytest.raises(ValueError, match="empty"):
        mod.attn_residual(q, [], w)
    with pytest.raises(ValueError, match="same shape"):
        mod.attn_residual(q, [x, torch.randn(5, d)], w)
    with pytest.raises(TypeError, match="dtype"):
        mod.attn_residual(q, [x, x.half()], w)
    with pytest.raises(ValueError, match="query"):
        mod.attn_residual(torch.randn(d + 1), [x], w)
    with pytest.raises(ValueError, match="output_rms_weight"):
        mod.attn_residual(q, [x], w, output_rms_weight=torch.randn(2, d))
    with pytest.raises(TypeError, match="list"):
        mod.attn_residual(q, torch.stack([x, x]), w)
    with pytest.raises(TypeError, match="floating"):
        mod.attn_residual(q, [x.long()], w)
    with pytest.raises(ValueError, match="eps"):
        mod.attn_residual(q, [x], w, eps=0.0)
    with pytest.raises(ValueError, match="empty"):
        mod.attn_residual_phase1(torch.randn(3, d), [], torch.randn(3, d))
    with pytest.raises(ValueError, match=r"\[Q, 16\]"):
        mod.attn_residual_phase1(torch.randn(3, d + 1), [x], torch.randn(3, d + 1))
    with pytest.raises(ValueError, match="same shape"):
        mod.attn_residual_phase1(torch.randn(3, d), [x], torch.randn(2, d))
    with pytest.raises(ValueError, match="token shape"):
        mod.attn_residual_merge(x, torch.randn(5), torch.randn(4), None, q, w)
    with pytest.raises(ValueError, match="partial"):
        mod.attn_residual_merge(x, torch.randn(4), torch.rand(4) + 1, torch.randn(4, d + 1), q, w)


def test_triton_rejects_unsupported_dtype():
    d = 8
    with pytest.raises(TypeError, match="not supported"):
        T.attn_residual(torch.randn(d), [torch.randn(3, d, dtype=torch.float64)], torch.randn(d))


# ------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (CPU) or on the GPU
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L,n", [(1, 100), (2, 1000), (3, 63), (16, 100), (25, 65), (64, 100)])
@pytest.mark.parametrize("onorm", [False, True])
def test_triton_forward_fp32(L, n, onorm):
    d = 48  # not a power of two: masked columns
    query, sources, w = _inputs(L, (n, d), torch.float32, scale_q=0.5)
    ow = torch.randn(d) if onorm else None
    out = T.attn_residual(query, sources, w, output_rms_weight=ow)
    assert out.shape == (n, d) and out.dtype == torch.float32
    assert _rel(out, _naive(query, sources, w, EPS, ow)) < _tol(torch.float32)


@pytest.mark.parametrize("L,shape", [(1, (1, 1, 64)), (3, (2, 50, 64)), (25, (1, 65, 64))])
@pytest.mark.parametrize("onorm", [False, True])
def test_triton_forward_fp16_batched(L, shape, onorm):
    query, sources, w = _inputs(L, shape, torch.float16)
    ow = torch.randn(shape[-1]).half() if onorm else None
    out = T.attn_residual(query, sources, w, output_rms_weight=ow)
    assert out.shape == shape and out.dtype == torch.float16
    assert _rel(out, _naive(query, sources, w, EPS, ow)) < _tol(torch.float16)


def _pipelined(bl=None, **settings):
    """T.config forcing the pipelined forward (the GPU's kernels for wide rows) under the interpreter, with bl
    sources per step for every L and with or without the output norm."""
    if bl is not None:
        settings.update(fwd_bl=bl, fwd_bl_wide=bl, fwd_bl_onorm=bl, fwd_bl_onorm_padded=bl)
    return T.config(fwd_pipelined=True, **settings)


@pytest.mark.parametrize("cfg", [{"bl": 1, "fwd_ns": 3}, {"bl": 2, "fwd_ns": 2}, {"bl": 4, "fwd_ns": 1, "fwd_bt": 2}])
def test_triton_forward_launch_settings(cfg):
    # the pipelined forward on padded rows (d = 40) with few programs, so that the flat (tile, source block) loop
    # crosses token tiles; L not a multiple of its source block bl
    with _pipelined(**dict({"fwd_progs_per_sm": 1, "fwd_bt": 4}, **cfg)):
        for L, n, onorm in ((1, 37, False), (2, 30, True), (5, 19, False), (7, 3, True)):
            query, sources, w = _inputs(L, (n, 40), torch.float32)
            ow = torch.randn(40) if onorm else None
            out = T.attn_residual(query, sources, w, output_rms_weight=ow)
            assert _rel(out, _naive(query, sources, w, EPS, ow)) < _tol(torch.float32)


def test_triton_forward_padded_backward():
    # the pipelined forward on padded rows also saves the logits and log-sum-exp that the backward reads
    L, n, d = 5, 23, 40
    query, sources, w = _inputs(L, (n, d), torch.float32, scale_q=0.5)
    gy = torch.randn(n, d)
    with _pipelined(bl=2, fwd_ns=2, fwd_progs_per_sm=1, fwd_bt=2):
        got = _grads(lambda q, s, w_, e, o: T.attn_residual(q, s, w_, eps=e, output_rms_weight=o),
                     query, sources, w, None, gy)
    want = _grads(lambda q, s, w_, e, o: _naive(q, s, w_, e, o), query.double(), [s.double() for s in sources],
                  w.double(), None, gy.double())
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-4


def test_pow2_parts():
    # the exact-width forward's column pieces: at most three powers of two, none narrower than 512
    assert T._pow2_parts(7168) == (4096, 2048, 1024)
    assert T._pow2_parts(4096) == (4096, 0, 0)
    assert T._pow2_parts(5120) == (4096, 1024, 0)
    assert T._pow2_parts(3584) == (2048, 1024, 512)
    for d in (1, 48, 768, 7168 + 512, 4096 + 256):
        assert T._pow2_parts(d) is None, d


@pytest.mark.parametrize("d", [1024, 1536, 3584], ids=["1024", "1024+512", "2048+1024+512"])
@pytest.mark.parametrize("bl", [1, 2])
def test_triton_forward_pieces(d, bl, monkeypatch):
    # the exact-width forward (row as one, two or three power-of-two pieces), forced under the interpreter;
    # _fwd_padded_kernel removed, so a silent fall-back to it fails. L = 5 with bl = 2: a half-empty last block;
    # N = 37 in tiles of 4 / 2 / 1 rows (_row_tile at d = 1024 / 1536 / 3584) over 8 programs: every program
    # walks several token tiles (the reset at a tile's first block) and the last tile is partly past N
    monkeypatch.setattr(TF, "_fwd_padded_kernel", None)
    n = 37
    with _pipelined(bl=bl, fwd_progs_per_sm=2, fwd_ns=2, fwd_bt=T._row_tile(d, n)[0]):
        for L in (1, 2, 3, 5):
            for onorm in (False, True):
                query, sources, w = _inputs(L, (n, d), torch.float32, scale_q=3 / d ** 0.5)
                ow = torch.randn(d) if onorm else None
                out = T.attn_residual(query, sources, w, output_rms_weight=ow)
                assert out.shape == (n, d) and out.dtype == torch.float32
                assert _rel(out, _naive(query, sources, w, EPS, ow)) < 1e-5, (L, onorm)


@pytest.mark.parametrize("kernel,d", [("padded", 1500), ("pieces", 1536)])
def test_triton_forward_strided_tiles(kernel, d, monkeypatch):
    # program p takes the token tiles p, p + grid, ... (N = 37 in tiles of 2 rows at d = 1500 / 1536: 19 tiles
    # over 7 programs of 3, the last ones past N), with and without the output norm
    monkeypatch.setattr(TF, "_fwd_pieces_kernel" if kernel == "padded" else "_fwd_padded_kernel", None)
    n = 37
    with _pipelined(bl=2, fwd_progs_per_sm=2, fwd_ns=2, fwd_bt=T._row_tile(d, n)[0]):
        for L in (1, 3):
            for onorm in (False, True):
                query, sources, w = _inputs(L, (n, d), torch.float32, scale_q=3 / d ** 0.5)
                ow = torch.randn(d) if onorm else None
                out = T.attn_residual(query, sources, w, output_rms_weight=ow)
                assert _rel(out, _naive(query, sources, w, EPS, ow)) < 1e-5, (L, onorm)


def test_triton_forward_padded_where_no_pieces(monkeypatch):
    # d = 40 has no power-of-two pieces of >= 512 columns: the pipelined forward runs _fwd_padded_kernel
    monkeypatch.setattr(TF, "_fwd_pieces_kernel", None)
    query, sources, w = _inputs(3, (29, 40), torch.float32)
    with _pipelined(bl=2, fwd_progs_per_sm=1, fwd_ns=2, fwd_bt=T._row_tile(40, 29)[0]):
        out = T.attn_residual(query, sources, w)
    assert _rel(out, _naive(query, sources, w)) < _tol(torch.float32)


@pytest.mark.parametrize("onorm", [False, True])
def test_triton_forward_pieces_backward(onorm, monkeypatch):
    # the exact-width forward saves the logits and log-sum-exp that the (unchanged) backward reads
    monkeypatch.setattr(TF, "_fwd_padded_kernel", None)
    L, n, d = 5, 23, 1536
    query, sources, w = _inputs(L, (n, d), torch.float32, scale_q=3 / d ** 0.5)
    ow = torch.randn(d) if onorm else None
    gy = torch.randn(n, d)
    with _pipelined(bl=2, fwd_ns=2, fwd_progs_per_sm=2, fwd_bt=T._row_tile(d, n)[0]):
        got = _grads(lambda q, s, w_, e, o: T.attn_residual(q, s, w_, eps=e, output_rms_weight=o),
                     query, sources, w, ow, gy)
    want = _grads(lambda q, s, w_, e, o: _naive(q, s, w_, e, o), query.double(), [s.double() for s in sources],
                  w.double(), ow.double() if ow is not None else None, gy.double())
    names = ["query", "rms_weight"] + [f"source{i}" for i in range(L)] + (["output_rms_weight"] if onorm else [])
    for name, a, b in zip(names, got, want):
        assert _rel(a, b) < 1e-4, name


def test_triton_forward_views_and_aliases():
    # sources that are slices of one stacked buffer, a non-contiguous one, and one passed twice
    n, d = 70, 32
    bank = torch.randn(4, n, d)
    other = torch.randn(d, n).t()                       # non-contiguous
    sources = [bank[2], bank[0], other, bank[2]]
    query, _, w = _inputs(1, (n, d), torch.float32)
    out = T.attn_residual(query, sources, w)
    assert _rel(out, _naive(query, sources, w)) < _tol(torch.float32)



def test_triton_argument_checks_and_no_double_backward():
    n, d = 9, 16
    query, sources, w = _inputs(3, (n, d), torch.float32)
    with pytest.raises(ValueError, match="eps"):
        T.attn_residual(query, sources, w, eps=True)
    with pytest.raises(ValueError, match="query is on meta"):
        T.attn_residual(query.to("meta"), sources, w)
    q_ = query.clone().requires_grad_()
    out = T.attn_residual(q_, sources, w)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad((out ** 2).sum(), q_, create_graph=True)
    g, = torch.autograd.grad((out ** 2).sum(), q_)          # a plain backward still works
    assert torch.isfinite(g).all()


def test_triton_offset_tables_are_reused_and_right():
    # the int64 offset table of a source list is built once per set of relative offsets and then reused;
    # a list at other offsets gets its own table, and both calls stay right
    n, d = 33, 24
    bank = torch.randn(6, n, d)
    query, _, w = _inputs(1, (n, d), torch.float32)
    a = [bank[4], bank[1], bank[3]]
    b = [bank[1], bank[5], bank[0], bank[2]]
    _, ta, _ = T._offset_table(a, "test")
    _, ta2, _ = T._offset_table(list(a), "test")
    _, tb, _ = T._offset_table(b, "test")
    assert ta is ta2
    assert ta.tolist() == [0, -3 * n * d, -1 * n * d]
    assert tb.tolist() == [0, 4 * n * d, -1 * n * d, 1 * n * d]
    for srcs in (a, b, a):
        assert _rel(T.attn_residual(query, srcs, w), _naive(query, srcs, w)) < _tol(torch.float32)
    # the cache is bounded
    for k in range(T._TABLES_MAX + 5):
        T._cached_table((0, k + 10_000), torch.device("cpu"))
    assert len(T._TABLES) <= T._TABLES_MAX


def test_device_table_cache_keeps_what_a_captured_graph_uses():
    # LRU eviction skips the entries a CUDA graph capture has used (the graph reads them on every replay);
    # the capture itself needs a GPU, so the pinned set is filled by hand here
    from backends.triton.guard import DeviceTableCache
    cpu = torch.device("cpu")
    c = DeviceTableCache(3)
    built = []

    def build(k):
        built.append(k)
        return torch.tensor([k])

    first = c.get("a", lambda: build(0), cpu)
    c._pinned.add("a")
    for k in range(1, 6):
        c.get(k, lambda k=k: build(k), cpu)
    assert len(c) == 3 and c.get("a", lambda: build(-1), cpu) is first      # still there, not rebuilt
    assert c.get(5, lambda: build(-1), cpu).item() == 5 and -1 not in built
    assert c.get(1, lambda: build(11), cpu).item() == 11                     # evicted, rebuilt

def _grads(fn, query, sources, w, ow, gy):
    ins = [query, w] + list(sources) + ([ow] if ow is not None else [])
    ins = [t.detach().clone().requires_grad_(True) for t in ins]
    q_, w_ = ins[0], ins[1]
    srcs = ins[2:2 + len(sources)]
    ow_ = ins[-1] if ow is not None else None
    out = fn(q_, srcs, w_, EPS, ow_)
    return torch.autograd.grad(out, ins, gy.to(out.dtype))


@pytest.mark.parametrize("L,n", [(1, 65), (2, 100), (3, 63), (16, 37), (25, 20), (64, 19)])
@pytest.mark.parametrize("onorm", [False, True])
def test_triton_backward_fp32(L, n, onorm):
    d = 40
    query, sources, w = _inputs(L, (n, d), torch.float32)
    ow = torch.randn(d) if onorm else None
    gy = torch.randn(n, d)
    got = _grads(lambda q, s, w_, e, o: T.attn_residual(q, s, w_, eps=e, output_rms_weight=o), query, sources, w, ow, gy)
    want = _grads(lambda q, s, w_, e, o: _naive(q, s, w_, e, o), query.double(), [s.double() for s in sources],
                  w.double(), ow.double() if ow is not None else None, gy.double())
    names = ["query", "rms_weight"] + [f"source{i}" for i in range(L)] + (["output_rms_weight"] if onorm else [])
    for name, a, b in zip(names, got, want):
        assert a.dtype == torch.float32
        if b.norm() < 1e-9:          # L == 1: the softmax is constant, query/weight gradients vanish
            assert a.abs().max() < 1e-4, name
        else:
            assert _rel(a, b) < 1e-4, name


def test_triton_backward_aliased_source():
    # the same tensor twice: autograd must add both gradients
    n, d = 33, 32
    x = torch.randn(n, d, requires_grad=True)
    y = torch.randn(n, d, requires_grad=True)
    q = torch.randn(d)
    w = torch.randn(d)
    gy = torch.randn(n, d)
    (gx, gyy) = torch.autograd.grad(T.attn_residual(q, [x, y, x], w), [x, y], gy)
    x64, y64 = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    (hx, hy) = torch.autograd.grad(_naive(q, [x64, y64, x64], w), [x64, y64], gy.double())
    assert _rel(gx, hx) < 1e-4 and _rel(gyy, hy) < 1e-4


@pytest.mark.parametrize("mix", ["groups", "bank"])
@pytest.mark.parametrize("Q,B,n,dtype", [(1, 1, 20, torch.float32), (5, 3, 100, torch.float32),
                                         (24, 8, 37, torch.float32), (4, 13, 29, torch.float32),
                                         (3, 25, 17, torch.float16), (24, 1, 33, torch.float16)])
def test_triton_phase1_matches_naive(Q, B, n, dtype, mix):
    # "bank": the default rule (the bank mix up to 16 sources, the query-group mix for B = 25), "groups": the
    # query-group mix at every B
    d = 48
    bank = [torch.randn(n, d).mul_(1 + i % 3).to(dtype) for i in range(B)]
    queries = torch.randn(Q, d)
    ws = 1 + 0.3 * torch.randn(Q, d)
    with T.config(**({"mix_bank_max_sources": 0} if mix == "groups" else {})):
        acc, m, s = T.attn_residual_phase1(queries, bank, ws)
    assert acc.shape == (Q, n, d) and acc.dtype == torch.float32
    for k in range(Q):
        # independent: acc/s is the attn_residual of the bank; m is the max logit; s = sum exp(logit - m)
        want = _naive(queries[k], bank, ws[k])
        assert _rel(acc[k] / s[k].unsqueeze(-1), want) < 2e-5
        lg = torch.stack([(x.double() * (queries[k] * ws[k]).double()).sum(-1)
                          / torch.sqrt((x.double() ** 2).mean(-1) + EPS) for x in bank])
        assert _rel(m[k], lg.max(0).values) < 2e-5
        assert _rel(s[k], torch.exp(lg - lg.max(0).values).sum(0)) < 2e-5


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float16])
def test_triton_phase1_of_one_source_writes_no_acc(acc_dtype):
    # one source: softmax over one logit, so s = 1 and acc_q = x_0 exactly for every query; acc is x_0 broadcast
    # over the queries (stride 0), or its one converted copy, instead of Q written tensors
    Q, n, d = 5, 37, 48
    x = torch.randn(n, d).to(torch.float16)
    queries, ws = torch.randn(Q, d), 1 + 0.3 * torch.randn(Q, d)
    acc, m, s = T.attn_residual_phase1(queries, [x], ws, acc_dtype=acc_dtype)
    assert acc.shape == (Q, n, d) and acc.dtype == acc_dtype and acc.stride(0) == 0
    assert torch.equal(acc[Q - 1], x.to(acc_dtype)) and torch.equal(s, torch.ones(Q, n))
    if acc_dtype == torch.float16:
        assert acc.data_ptr() == x.data_ptr()
    lg = torch.stack([(x.double() * (queries[k] * ws[k]).double()).sum(-1)
                      / torch.sqrt((x.double() ** 2).mean(-1) + EPS) for k in range(Q)])
    assert _rel(m, lg) < 2e-5


@pytest.mark.parametrize("B", [1, 2, 16])
@pytest.mark.parametrize("with_partial", [False, True])
@pytest.mark.parametrize("onorm", [False, True])
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float16])
def test_triton_two_phase_equals_direct(B, with_partial, onorm, acc_dtype):
    Q, n, d = 4, 65, 32
    dtype = torch.float16 if acc_dtype == torch.float16 else torch.float32
    bank = [torch.randn(n, d).to(dtype) for _ in range(B)]
    queries = torch.randn(Q, d)
    ws = 1 + 0.3 * torch.randn(Q, d)
    ow = torch.randn(d) if onorm else None
    partial = torch.randn(n, d).to(dtype) if with_partial else None
    acc, m, s = T.attn_residual_phase1(queries, bank, ws, acc_dtype=acc_dtype)
    srcs = bank + ([partial] if with_partial else [])
    for k in range(Q):
        out = T.attn_residual_merge(acc[k], m[k], s[k], partial, queries[k], ws[k], output_rms_weight=ow,
                                    out_dtype=dtype)
        direct = T.attn_residual(queries[k], srcs, ws[k], output_rms_weight=ow)
        assert out.dtype == dtype == direct.dtype
        assert _rel(out, direct) < (2 * _tol(dtype) if acc_dtype == torch.float16 else _tol(dtype))
        assert _rel(out, _naive(queries[k], srcs, ws[k], EPS, ow)) < (2 * _tol(dtype) if acc_dtype == torch.float16
                                                                       else _tol(dtype))


@pytest.mark.parametrize("mcfg", [{}, {"merge_ns": 1}])
@pytest.mark.parametrize("with_partial,onorm", [(False, False), (True, False), (True, True)])
def test_triton_merge_persistent(mcfg, with_partial, onorm):
    # the persistent merge (_merge_persistent_kernel: several rows per program, the last program's rows partly past
    # N, d not a power of two) against the float64 naive form and the row kernel
    Q, B, n, d = 3, 4, 65, 48
    bank = [torch.randn(n, d) * (1 + i) for i in range(B)]
    queries = torch.randn(Q, d)
    ws = 1 + 0.3 * torch.randn(Q, d)
    ow = torch.randn(d) if onorm else None
    partial = torch.randn(n, d) if with_partial else None
    acc, m, s = T.attn_residual_phase1(queries, bank, ws)
    srcs = bank + ([partial] if with_partial else [])
    for k in range(Q):
        rows = T.attn_residual_merge(acc[k], m[k], s[k], partial, queries[k], ws[k], output_rms_weight=ow)
        with T.config(merge_persistent=True, **mcfg):
            out = T.attn_residual_merge(acc[k], m[k], s[k], partial, queries[k], ws[k], output_rms_weight=ow)
        assert _rel(out, _naive(queries[k], srcs, ws[k], EPS, ow)) < _tol(torch.float32)
        assert _rel(out, rows) < 1e-6


@pytest.mark.parametrize("B", [1, 3])
def test_triton_two_phase_gradients(B):
    # phase 1 + merge are differentiable (through the reference): check against the naive direct form (B = 1:
    # acc is the source broadcast over the queries, a view, and the gradient must still reach the source)
    Q, n, d = 2, 20, 32
    bank = [torch.randn(n, d, dtype=torch.float64).float().requires_grad_() for _ in range(B)]
    part = torch.randn(n, d).requires_grad_()
    queries = torch.randn(Q, d).requires_grad_()
    ws = (1 + 0.3 * torch.randn(Q, d)).requires_grad_()
    acc, m, s = T.attn_residual_phase1(queries, bank, ws)
    gys = [torch.randn(n, d) for _ in range(Q)]
    loss = sum((T.attn_residual_merge(acc[k], m[k], s[k], part, queries[k], ws[k]) * gys[k]).sum() for k in range(Q))
    got = torch.autograd.grad(loss, [queries, ws, part] + bank)
    b64 = [b.detach().double().requires_grad_() for b in bank]
    p64 = part.detach().double().requires_grad_()
    q64 = queries.detach().double().requires_grad_()
    w64 = ws.detach().double().requires_grad_()
    loss64 = sum((_naive(q64[k], b64 + [p64], w64[k]) * gys[k].double()).sum() for k in range(Q))
    want = torch.autograd.grad(loss64, [q64, w64, p64] + b64)
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-4


_HOPPER_CHECK = r"""
import importlib, re, triton
from triton.backends.compiler import GPUTarget
T = importlib.import_module("backends.triton.attn_residual")

def compile_(fn, sig, const, nw):
    sig = dict(sig)
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw}).asm["ptx"]

fsig = {"base": "*bf16", "offs": "*i64", "q_buf": "*bf16", "w_buf": "*bf16", "ow": "*bf16", "out": "*bf16", "logit_buf": "*fp32",
        "lse_buf": "*fp32", "N": "i32", "L": "i32", "eps": "fp32", "TPP": "i32"}
ptx = compile_(T._fwd_rows_kernel, fsig, {"D": 7168, "BT": 2, "BD": 8192, "VEC": 8, "HAS_ONORM": True,
                                          "SAVE": False}, 16)
assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, "forward: no 16-byte loads/stores"
for split, qt, kind in ((False, "*fp32", "tf32"), (True, "*bf16", "bf16")):
    ptx = compile_(T._phase1_logits_kernel, {"base": "*bf16", "offs": "*i64", "qwT": qt, "logit_buf": "*fp32",
                                             "N": "i32"},
                   {"D": 7168, "BT": 64, "BK": 64, "QP": 32, "VEC": 8, "eps": 1e-6, "NS": 4, "SPLIT": split}, 4)
    assert "wgmma" in ptx and kind in ptx, ("phase 1 logits: no wgmma of the expected kind", split)
f2sig = dict(fsig, NB="i32", TSTEP="i32")
f2sig = {k: f2sig[k] for k in ("base", "offs", "q_buf", "w_buf", "ow", "out", "logit_buf", "lse_buf", "N", "L", "NB", "eps",
                               "TPP", "TSTEP")}
for bt, bl, ns, nw in ((1, 1, 4, 16), (1, 2, 3, 16), (2, 1, 3, 16), (1, 1, 4, 8), (1, 2, 1, 16), (2, 2, 2, 16)):
    ptx = compile_(T._fwd_padded_kernel, f2sig, {"D": 7168, "BT": bt, "BD": 8192, "BL": bl, "VEC": 8,
                                                 "HAS_ONORM": True, "SAVE": True, "NS": ns}, nw)
    assert "st.global.v4.b32" in ptx, ("forward, padded rows: no 16-byte stores", bt, bl, ns)
    assert ("cp.async" in ptx) == (ns > 1), ("forward, padded rows: shared-memory staging iff NS > 1", bt, bl, ns)
    assert ns > 1 or "ld.global.v4.b32" in ptx, ("forward, padded rows: no 16-byte loads", bt, bl, ns)
for parts, bl, on in (((4096, 2048, 1024), 1, True), ((4096, 2048, 1024), 2, True), ((4096, 0, 0), 2, False)):
    ptx = compile_(T._fwd_pieces_kernel, f2sig, {"D": sum(parts), "BT": 1, "BL": bl, "P1": parts[0], "P2": parts[1],
                                                 "P3": parts[2], "VEC": 8, "HAS_ONORM": on, "SAVE": True, "NS": 3}, 4)
    assert "cp.async" in ptx and "st.global.v4.b32" in ptx, ("forward, pieces: loads not staged / narrow stores", parts,
                                                             bl)
msig = {"base": "*bf16", "offs": "*i64", "wts": "*fp32", "acc": "*fp32", "N": "i32", "NQP": "i32", "L": "i32",
        "Q": "i32"}
for acc_t in ("*fp32", "*bf16"):
    ptx = compile_(T._phase1_mix_groups_kernel, dict(msig, acc=acc_t),
                   {"D": 7168, "BC": 1024, "QP": 32, "QB": 8, "NG": 3, "VEC": 8, "NS": 3}, 8)
    assert "cp.async" in ptx and "st.global.v4.b32" in ptx, "phase 1 group mix: loads not staged / narrow stores"
compile_(T._phase1_stats_kernel, {"logit_buf": "*fp32", "m_out": "*fp32", "s_out": "*fp32", "N": "i32",
                                  "NQP": "i32", "L": "i32", "Q": "i32"}, {"QP": 32, "BN": 64, "NS": 2}, 4)
m3sig = {k: v for k, v in msig.items() if k != "Q"}
for acc_t in ("*fp32", "*bf16"):
    ptx = compile_(T._phase1_mix_bank_kernel, dict(m3sig, acc=acc_t),
                   {"D": 7168, "BC": 1024, "QP": 32, "LB": 8, "Q": 24, "VEC": 8}, 4)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, "phase 1 bank mix: narrow loads or stores"
    assert "cp.async" not in ptx, "phase 1 bank mix: the bank chunks go to registers, not through shared memory"
gsig = {"acc": "*bf16", "m_in": "*fp32", "s_in": "*fp32", "part": "*bf16", "q": "*bf16", "w": "*bf16", "ow": "*bf16",
        "out": "*bf16", "N": "i32", "eps": "fp32", "TPP": "i32", "TSTEP": "i32"}
for part, on in ((True, True), (False, True), (True, False)):
    const = {"D": 7168, "BD": 8192, "HAS_PART": part, "HAS_ONORM": on, "NS": 3}
    sig = dict(gsig)
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    k = triton.compile(triton.compiler.ASTSource(fn=T._merge_persistent_kernel, signature=sig, constexprs=const,
                                                 attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cp.async" in k.asm["ptx"] and "st.global.v4.b32" in k.asm["ptx"], ("persistent merge", part, on)
    # only acc and the partial are staged (2 stages x 2 x 16 KB): two programs fit an SM's 228 KB
    assert k.metadata.shared <= 96 * 1024, ("persistent merge: the pipeline stages more than acc and partial",
                                            k.metadata.shared)
print("OK")
"""


def test_hopper_compile_uses_vector_loads_and_tensor_cores():
    # compiles for sm_90 without a GPU (in a subprocess: the interpreter patches triton.language in this
    # one): the forward must use 16-byte loads and stores and no local memory, phase 1 the tensor cores
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _HOPPER_CHECK], capture_output=True, text=True, env=env, cwd=root,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# GPU: bf16 at the model's size
# ------------------------------------------------------------------------------------------------

def _naive_rows(query, sources, w, ow, rows, chunk=2048):
    """the naive float64 reference on the token rows `rows` only (sources [N, d]), chunked."""
    outs = []
    for i in range(0, rows.numel(), chunk):
        r = rows[i:i + chunk]
        outs.append(_naive(query, [s[r] for s in sources], w, EPS, ow))
    return torch.cat(outs)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_uses_live_tables():
    # attn_residual captured in a CUDA graph (its offset table from the cache, built by the warm-up) replays on
    # new sources to the eager result after the cache has been pushed past its size
    n, d, L = 1000, 7168, 3
    query, static, w = _inputs(L, (n, d), torch.bfloat16, device="cuda", scale_q=0.05)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            T.attn_residual(query, static, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = T.attn_residual(query, static, w)
    for k in range(T._TABLES_MAX + 4):
        T._cached_table((0, 10_000 + k), torch.device("cuda"))
    junk = [torch.full((1 << 20,), -7, dtype=torch.int64, device="cuda") for _ in range(8)]   # reuse freed blocks
    _, fresh, _ = _inputs(L, (n, d), torch.bfloat16, device="cuda", scale_q=0.05)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    del junk
    assert _rel(out, T.attn_residual(query, fresh, w)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("L", [2, 8, 25])
@pytest.mark.parametrize("onorm", [False, True])
def test_gpu_forward_bf16(L, onorm):
    n, d = 16384 + 17, 7168
    query, sources, w = _inputs(L, (n, d), torch.bfloat16, device="cuda", scale_q=0.05)
    ow = torch.randn(d, device="cuda", dtype=torch.bfloat16) if onorm else None
    out = T.attn_residual(query, sources, w, output_rms_weight=ow)
    rows = torch.arange(n, device="cuda")
    assert _rel(out, _naive_rows(query, sources, w, ow, rows)) < _tol(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("bl", [1, 2])
def test_gpu_forward_pieces_bf16(bl):
    # the exact-width schedule (7168 = 4096 + 2048 + 1024) at the model's size with one and two sources per step,
    # L = 3 (not a multiple of bl = 2), forward and the saved logits
    n, d, L = 16384 + 17, 7168, 3
    query, sources, w = _inputs(L, (n, d), torch.bfloat16, device="cuda", scale_q=0.05)
    ow = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    with T.config(fwd_bl=bl, fwd_bl_wide=bl, fwd_bl_onorm=bl):
        out = T.attn_residual(query, sources, w, output_rms_weight=ow)
    rows = torch.arange(n, device="cuda")
    assert _rel(out, _naive_rows(query, sources, w, ow, rows)) < _tol(torch.bfloat16)
    small = [s[:1000 + 3] for s in sources]
    gy = torch.randn(1003, d, device="cuda")
    with T.config(fwd_bl=bl, fwd_bl_wide=bl, fwd_bl_onorm=bl):
        got = _grads(lambda q, s, w_, e, o: T.attn_residual(q, s, w_, eps=e, output_rms_weight=o), query, small, w,
                     None, gy)
    want = _grads(lambda q, s, w_, e, o: _naive(q, s, w_, e, o), query.double(), [s.double() for s in small],
                  w.double(), None, gy.double())
    for a, b in zip(got, want):
        assert _rel(a, b) < 2e-2


@pytest.mark.gpu
def test_gpu_forward_float32_fits():
    # a setting sized for bf16 (4 sources x 4 stages) on float32 rows of 7168: stages are cut to fit
    n, d, L = 1000 + 3, 7168, 6
    query, sources, w = _inputs(L, (n, d), torch.float32, device="cuda", scale_q=0.05)
    with T.config(fwd_num_warps=16, fwd_bl_wide=4, fwd_ns=4, fwd_progs_per_sm=1):
        out = T.attn_residual(query, sources, w)
    assert _rel(out, _naive(query, sources, w)) < _tol(torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [{}, {"fwd_bl_wide": 1}], ids=["default", "bl1"])
def test_gpu_forward_past_2_32_elements(cfg):
    # N = 65536, L = 16, d = 7168: 7.5e9 source elements, every offset past 2^32 must be right
    n, d, L = 65536, 7168, 16
    query, sources, w = _inputs(L, (n, d), torch.bfloat16, device="cuda", scale_q=0.05)
    with T.config(**cfg):
        out = T.attn_residual(query, sources, w)
    rows = torch.cat([torch.arange(512, device="cuda"), torch.arange(n - 4096, n, device="cuda"),
                      torch.randint(0, n, (2048,), device="cuda")])
    assert _rel(out[rows], _naive_rows(query, sources, w, None, rows)) < _tol(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("onorm", [False, True])
def test_gpu_backward_bf16(onorm):
    n, d, L = 4096 + 3, 7168, 8
    query, sources, w = _inputs(L, (n, d), torch.bfloat16, device="cuda", scale_q=0.05)
    ow = torch.randn(d, device="cuda", dtype=torch.bfloat16) if onorm else None
    gy = torch.randn(n, d, device="cuda")
    got = _grads(lambda q, s, w_, e, o: T.attn_residual(q, s, w_, eps=e, output_rms_weight=o), query, sources, w, ow, gy)
    want = _grads(lambda q, s, w_, e, o: _naive(q, s, w_, e, o), query.double(), [s.double() for s in sources],
                  w.double(), ow.double() if ow is not None else None, gy.double())
    for a, b in zip(got, want):
        assert _rel(a, b) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cfg,B", [({"mix_bank_max_sources": 0}, 8), ({}, 7), ({}, 16), ({}, 3),
                                   ({"merge_persistent": False, "merge_num_warps": 4}, 3), ({}, 1)])
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16])
def test_gpu_two_phase_bf16(acc_dtype, cfg, B):
    # the bank mix (B <= 16), the query-group mix (forced at B = 8), the row merge (forced), a bank of one source
    n, d, Q = 4096 + 5, 7168, 24
    bank = [torch.randn(n, d, device="cuda", dtype=torch.bfloat16) * (1 + i) for i in range(B)]
    partial = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    queries = torch.randn(Q, d, device="cuda") * 0.05
    ws = 1 + 0.3 * torch.randn(Q, d, device="cuda")
    ow = torch.randn(d, device="cuda")
    with T.config(**cfg):
        acc, m, s = T.attn_residual_phase1(queries, bank, ws, acc_dtype=acc_dtype)
        outs = {k: T.attn_residual_merge(acc[k], m[k], s[k], partial, queries[k], ws[k], output_rms_weight=ow)
                for k in (0, 11, 23)}
    for k, out in outs.items():
        assert out.dtype == torch.bfloat16
        want = _naive(queries[k], bank + [partial], ws[k], EPS, ow)
        assert _rel(out, want) < (2 if acc_dtype == torch.bfloat16 else 1) * _tol(torch.bfloat16)


@pytest.mark.gpu
def test_gpu_phase1_logits_of_a_bf16_bank_keep_float32_precision():
    # the phase-1 logits of a bf16 bank (bf16 MMAs of the tile against queries * rms_weights in three bf16 parts,
    # each step promoted to a float32 sum): the max logit m and the softmax sum s match float64 to float32 accuracy
    n, d, Q, B = 1000 + 3, 7168, 24, 4
    bank = [torch.randn(n, d, device="cuda", dtype=torch.bfloat16) * (1 + i) for i in range(B)]
    queries = torch.randn(Q, d, device="cuda") * 0.05
    ws = 1 + 0.3 * torch.randn(Q, d, device="cuda")
    acc, m, s = T.attn_residual_phase1(queries, bank, ws)
    errs = []
    for k in range(Q):
        lg = torch.stack([(x.double() * (queries[k] * ws[k]).double()).sum(-1)
                          / torch.sqrt((x.double() ** 2).mean(-1) + EPS) for x in bank])
        errs.append(max(_rel(m[k], lg.max(0).values), _rel(s[k], torch.exp(lg - lg.max(0).values).sum(0))))
    print(f"max relative error of m, s over {Q} queries: {max(errs):.1e}")
    assert max(errs) < 5e-6, max(errs)


@pytest.mark.gpu
def test_gpu_forward_does_not_synchronise():
    # the source-offset table reaches the GPU through pinned memory (guard.device_table): no stream
    # synchronisation per call, so the CPU can queue the following kernels while this one runs
    n, d, L = 4096 + 5, 7168, 5
    query, sources, w = _inputs(L, (n, d), torch.bfloat16, device="cuda", scale_q=0.05)
    T.attn_residual(query, sources, w)                              # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = T.attn_residual(query, sources, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rows = torch.arange(n, device="cuda")
    assert _rel(y, _naive_rows(query, sources, w, None, rows)) < _tol(torch.bfloat16)


def test_interpreter_bf16_warns_once(monkeypatch):
    # under TRITON_INTERPRET=1 bf16 results are rounded toward zero by the interpreter: a warning, once
    import backends.triton.guard as G
    if not G.interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (the CPU interpreter)")
    monkeypatch.setattr(G, "_BF16_WARNED", set())
    query, sources, w = _inputs(3, (5, 64), torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="rounds bfloat16 results toward zero"):
        T.attn_residual(query, sources, w)
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        T.attn_residual(query, sources, w)                   # the second call is quiet
    assert not [x for x in seen if "rounds bfloat16" in str(x.message)]
