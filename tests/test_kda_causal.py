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


def prefix_run(ins, h0, s, w, lb, **kw):
    """o[:, :s] and the gradients of sum(o[:, :s] w) w.r.t. the inputs (their rows before s) and h0."""
    xs = [t.detach().clone().requires_grad_() for t in ins] + [h0.detach().clone().requires_grad_()]
    o, _ = tk.kda_chunk(*xs[:5], initial_state=xs[5], lower_bound=lb, **kw)
    grads = torch.autograd.grad((o[:, :s].float() * w).sum(), xs)
    return [o[:, :s].detach()] + [gr[:, :s] for gr in grads[:5]] + [grads[5]]


def check_causal(T, s, lb, extra, dtype=torch.float32, device="cpu", H=H, K=K, V=V, **kw):
    ins = fresh(T, lb, dtype, device, H, K, V)
    h0 = torch.randn(B, H, K, V, device=device)
    w = torch.randn(B, s, H, V, device=device)
    base = prefix_run(ins, h0, s, w, lb, **kw)
    assert all(torch.isfinite(t).all() for t in base)
    # everything at and after s replaced by fresh values (the gates keep the bound)
    new = fresh(T, lb, dtype, device, H, K, V)
    changed = [torch.cat([a[:, :s], b[:, s:]], dim=1) for a, b in zip(ins, new)]
    # tokens appended (T -> T + extra: the partial last chunk grows, or new chunks follow)
    more = fresh(extra, lb, dtype, device, H, K, V)
    longer = [torch.cat([a, b], dim=1) for a, b in zip(ins, more)]
    names = "o dq dk dv dg dbeta dh0".split()
    for what, other in (("future replaced", changed), ("tokens appended", longer)):
        got = prefix_run(other, h0, s, w, lb, **kw)
        for name, a, b in zip(names, base, got):
            # bit-identical (torch.equal: -0.0 equals 0.0)
            assert torch.equal(a, b), (what, name, float((a.double() - b.double()).abs().max()))


# (T, s): s inside a 16-row block, past the first chunk, right after a chunk boundary; T not a multiple of 16
@pytest.mark.parametrize("T,s", [(22, 9), (37, 19), (100, 70)])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_prefix_bit_identical(T, s, lb):
    check_causal(T, s, lb, extra=T % 16 + 3)


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
