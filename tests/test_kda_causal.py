"""Causality of kda_chunk (issue #34 item 4): the outputs before position s, and the gradients of a loss on them,
are bit-identical when anything at or after s changes (fresh q, k, v, g, beta there, the gates still keeping a
promised bound) or when tokens are appended (a partial last chunk grows).  Chunked prefill and prefix caching
rely on it.  Both paths: a promised bound (dense anchored tiles: the 32-row pairs at lb = -5 for float32, the
16-row tiles at lb = -8) and none (the safe path).  CPU: float32 under the interpreter; GPU: bf16 up to T = 4097."""
import pytest
import torch

import backends.reference.kda as R

tk = pytest.importorskip("backends.triton.kda")

B, H, K, V = 1, 2, 32, 16


def fresh(T, lb, dtype=torch.float32, device="cpu", H=H, K=K, V=V):
    """Random inputs [B, T, ...]: q, k L2-normalised (times 2), v, g (the sigmoid gate with lower bound lb, or the
    softplus gate with strong channels for lb None), beta; q, k, v, beta in dtype, g float32."""
    q = 2 * torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    x = torch.randn(B, T, H, K) * 2
    if lb is None:
        g = R.kda_gate(x, torch.randn(H) * 0.5 + 1.0, torch.randn(H * K), gate="softplus")
    else:
        g = R.kda_gate(x, torch.randn(H) * 0.5, torch.randn(H * K), lower_bound=lb)
    beta = torch.rand(B, T, H)
    return [t.to(device) for t in (q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype))]


def prefix_run(ins, h0, s, w, lb, fn=None, **kw):
    """o[:, :s] of fn (default the Triton kda_chunk) and the gradients of sum(o[:, :s] w) w.r.t. the inputs (their
    rows before s) and h0."""
    xs = [t.detach().clone().requires_grad_() for t in ins] + [h0.detach().clone().requires_grad_()]
    o, _ = (fn or tk.kda_chunk)(*xs[:5], initial_state=xs[5], lower_bound=lb, **kw)
    grads = torch.autograd.grad((o[:, :s].float() * w).sum(), xs)
    return [o[:, :s].detach()] + [gr[:, :s] for gr in grads[:5]] + [grads[5]]


def check_causal(T, s, lb, extra, dtype=torch.float32, device="cpu", H=H, K=K, V=V, fn=None, **kw):
    ins = fresh(T, lb, dtype, device, H, K, V)
    h0 = torch.randn(B, H, K, V, device=device)
    w = torch.randn(B, s, H, V, device=device)
    base = prefix_run(ins, h0, s, w, lb, fn, **kw)
    assert all(torch.isfinite(t).all() for t in base)
    # everything at and after s replaced by fresh values (the gates keep the bound)
    new = fresh(T, lb, dtype, device, H, K, V)
    changed = [torch.cat([a[:, :s], b[:, s:]], dim=1) for a, b in zip(ins, new)]
    # tokens appended (T -> T + extra: the partial last chunk grows, or new chunks follow)
    more = fresh(extra, lb, dtype, device, H, K, V)
    longer = [torch.cat([a, b], dim=1) for a, b in zip(ins, more)]
    names = "o dq dk dv dg dbeta dh0".split()
    for what, other in (("future replaced", changed), ("tokens appended", longer)):
        got = prefix_run(other, h0, s, w, lb, fn, **kw)
        for name, a, b in zip(names, base, got):
            # bit-identical (torch.equal: -0.0 equals 0.0)
            assert torch.equal(a, b), (what, name, float((a.double() - b.double()).abs().max()))


# (T, s): s inside a 16-row block, past the first chunk, right after a chunk boundary; T not a multiple of 16
@pytest.mark.parametrize("T,s", [(22, 9), (37, 19), (100, 70)])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_prefix_bit_identical(T, s, lb):
    check_causal(T, s, lb, extra=T % 16 + 3)


@pytest.mark.parametrize("T,s", [(22, 9), (200, 130)])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_reference_prefix_bit_identical(T, s, lb):
    # the reference backend (float32, autograd through its chunk loop) has the same property
    check_causal(T, s, lb, extra=T % 16 + 3, fn=R.kda_chunk)


def test_prefix_bit_identical_16_row_dense_tiles():
    # lb = -8: below the 32-row pairs' range, the 16-row dense tiles (anchor G before the block - 64)
    check_causal(37, 21, -8.0, extra=30)


def test_prefix_bit_identical_float16():
    # float16 at its bound: the 16-row dense tiles with float32 operands
    check_causal(37, 5, -1.25, extra=11, dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("T,s,extra", [(22, 9, 5), (37, 19, 9), (100, 70, 13), (4097, 2085, 30),
                                       (4097, 4096, 200)])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_gpu_prefix_bit_identical_bf16(T, s, extra, lb):
    # bf16 at real head sizes.  The long-context split's segment length is chosen from the number of chunks (on
    # the GPU): appending that adds chunks (4097 + 200) may move the segment boundaries, and the chunk-entry
    # states then differ by rounding, so that case fixes segment_chunks
    kw = dict(segment_chunks=8) if (T + extra + 63) // 64 != (T + 63) // 64 else {}
    check_causal(T, s, lb, extra, dtype=torch.bfloat16, device="cuda", H=4, K=128, V=128, **kw)


def test_prefix_bit_identical_when_later_rows_overflow_the_dense_pair():
    # weak gates before s and none after, q x 1e6 after s: rows s.. of the first 32-row pair overflow its factors
    # (up to e^80 at lb = -5) and are redone as 16-row blocks; the pair's rows before s keep their dense results
    T, s, lb = 37, 19, -5.0
    ins = fresh(T, lb)
    ins[3][:, :s] = -0.01 * torch.rand(B, s, H, K)
    h0 = torch.randn(B, H, K, V)
    w = torch.randn(B, s, H, V)
    base = prefix_run(ins, h0, s, w, lb)
    big = [t.clone() for t in ins]
    big[0][:, s:] *= 1e6
    big[3][:, s:] = 0.0
    got = prefix_run(big, h0, s, w, lb)
    for name, a, b in zip("o dq dk dv dg dbeta dh0".split(), base, got):
        assert torch.equal(a, b), name
    # (and the redone rows are right: against the float64 reference)
    o, _ = tk.kda_chunk(*big, initial_state=h0, lower_bound=lb)
    o_r, _ = R.kda_chunk(*(t.double() for t in big), initial_state=h0.double())
    assert torch.isfinite(o).all() and rel_rms(o, o_r) < 2e-5


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@pytest.mark.parametrize("T", [37, 100])
def test_float16_dense_tiles_with_large_q(T):
    # issue #34 item 5: float16 at its dense bound (-1.25), every gate at the bound, q entries of 10-100: the
    # 16-row dense tile's factors (up to e^10) times q left float16's range (inf / NaN on the first row of every
    # 16-row block, or a ValueError blaming the recurrence with check_finite on); finite now, and as close to the
    # float64 reference as inputs of normal size
    lb = -1.25
    q, k, v, _, beta = fresh(T, lb)
    g = torch.full((B, T, H, K), lb)
    g[..., ::4] = lb * torch.rand(B, T, H, K)[..., ::4]
    do = torch.randn(B, T, H, V)
    errs = {}
    for name, qq in (("normal", q), ("large", q * (10 + 90 * torch.rand(B, T, H, 1)))):
        ins = [t.half() for t in (qq, k, v)] + [g, beta.half()]
        for check in (False, True):
            o, _ = tk.kda_chunk(*ins, lower_bound=lb, check_finite=check)
            assert torch.isfinite(o).all(), (name, check)
        xs = [t.detach().clone().requires_grad_() for t in ins]
        o, _ = tk.kda_chunk(*xs, lower_bound=lb)
        gx = torch.autograd.grad((o.float() * do).sum(), xs)
        x64 = [t.detach().double().requires_grad_() for t in ins]
        o_r, _ = R.kda_chunk(*x64)
        gr = torch.autograd.grad((o_r * do.double()).sum(), x64)
        errs[name] = [rel_rms(o, o_r)] + [rel_rms(a, b) for a, b in zip(gx, gr)]
        assert all(torch.isfinite(a).all() for a in gx), name
    for n, (e_norm, e_large) in enumerate(zip(errs["normal"], errs["large"])):
        what = "o dq dk dv dg dbeta".split()[n]
        # float16 rounding: ~5e-4 per operand; 2e-2 for the gradients (as the float16 test of test_kda_triton)
        assert e_large < (5e-3 if n == 0 else 2e-2), (what, e_large, e_norm)
        assert e_large < 4 * e_norm + 1e-3, (what, e_large, e_norm)


def test_float32_16_row_dense_overflow_redone_safe():
    # lb = -8 (the 16-row dense tiles, factors up to e^64): q x 1e16 on every fifth token overflows them in float32;
    # those rows are redone on the safe path, the others keep their dense results
    T, lb = 37, -8.0
    q, k, v, _, beta = fresh(T, lb)
    g = torch.full((B, T, H, K), lb)
    g[..., ::3] = lb * torch.rand(B, T, H, K)[..., ::3]
    q[:, ::5] *= 1e16
    o, S = tk.kda_chunk(q, k, v, g, beta, lower_bound=lb, output_final_state=True, check_finite=True)
    o_r, S_r = R.kda_chunk(*(t.double() for t in (q, k, v, g, beta)), output_final_state=True)
    assert rel_rms(o, o_r) < 2e-5 and rel_rms(S, S_r) < 2e-5
    plain = [i for i in range(T) if i % 5]
    assert rel_rms(o[:, plain], o_r[:, plain]) < 2e-5
