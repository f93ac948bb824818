"""kda_chunk's gradients against float64 autograd through the token recurrence: the gate gradient dg within a
small factor of the other gradients' errors (issue 34 item 1: with bf16 inputs dg was 6.5% off against 0.4% for dq,
from the bf16 rounding of the decay-scaled operands of the pair-product backward's dense dots). CPU: float32 and
float16 under the interpreter (float16 shows the same defect: dg 5x the others' error before the fix); GPU: bf16
against fla-core's chunk_kda on the same inputs."""
import pytest
import torch

tk = pytest.importorskip("backends.triton.kda")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from backends.triton.kda import backward as kb  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")


def recurrence64(q, k, v, g, beta, scale):
    """spec/OPS.md's token recurrence in float64, one sequence: q, k, g [T, H, K], v [T, H, V], beta [T, H]."""
    T, H, K = q.shape
    S = torch.zeros(H, K, v.shape[-1], dtype=torch.float64, device=q.device)
    outs = []
    for t in range(T):
        S = S * g[t].exp()[..., None]
        err = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
        S = S + beta[t][:, None, None] * k[t][..., None] * err[:, None, :]
        outs.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(outs, 0)


def chunked64(q, k, v, g, beta, scale, C=64):
    """The chunked WY/UT form of the same recurrence, in the inputs' dtype (float64 here), one sequence: q, k, g
    [T, H, K], v [T, H, V], beta [T, H] -> o [T, H, V]. Cheap at T = 8192 where the token loop's autograd is not
    (the GPU test's and benchmarks/kda_grad_accuracy.py's float64 truth; checked against recurrence64 below)."""
    q, k, v, g, beta = (t.transpose(0, 1) for t in (q, k, v, g, beta))       # [H, T, ...]
    H, T, K = q.shape
    S = torch.zeros(H, K, v.shape[-1], dtype=q.dtype, device=q.device)
    outs = []
    for s in range(0, T, C):
        qc, kc, vc, gc, bc = (t[:, s:s + C] for t in (q, k, v, g, beta))
        n = qc.shape[1]
        G = gc.cumsum(1)                                                      # [H, n, K]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = torch.where(causal[None, :, :, None], G[:, :, None] - G[:, None], float("-inf"))
        decay = diff.exp()                                                    # e^(G_i - G_j), j <= i
        A = torch.einsum("hik,hjk,hijk->hij", kc, kc, decay).tril(-1) * bc[..., None]
        P = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay) * scale
        eG = G.exp()
        W = torch.linalg.solve_triangular(torch.eye(n, dtype=q.dtype, device=q.device) + A,
                                          bc[..., None] * (vc - (kc * eG) @ S), upper=False, unitriangular=True)
        outs.append(scale * (qc * eG) @ S + P @ W)
        GL = G[:, -1:]
        S = GL.transpose(1, 2).exp() * S + (kc * (GL - G).exp()).transpose(1, 2) @ W
    return torch.cat(outs, 1).transpose(0, 1)


def make(T, H, K, V, gate, dtype, device="cpu"):
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=device), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=device), dim=-1).to(dtype)
    v = torch.randn(1, T, H, V, device=device).to(dtype)
    g = -gate * torch.sigmoid(torch.randn(1, T, H, K, device=device))
    beta = torch.rand(1, T, H, device=device).to(dtype)
    do = torch.randn(1, T, H, V, device=device).to(dtype)
    return (q, k, v, g, beta), do


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def errors(fn, ins, do, ref):
    x = [t.detach().clone().requires_grad_() for t in ins]
    gx = torch.autograd.grad(fn(*x), x, do)
    return {n: rel(a, b) for n, a, b in zip(NAMES, gx, ref)}


def grads64(ins, do, forward):
    x = [t.detach().double().requires_grad_() for t in ins]
    o = forward(*(t[0] for t in x), ins[0].shape[-1] ** -0.5)[None]
    return torch.autograd.grad(o, x, do.double())


# one case per path: float32 dense diagonal tiles (bound -5), float16 dense tiles (its bound -1.25; gates down to it,
# and near 0), float16 token-pair diagonal tiles (bound -5 is past float16's dense range); T with a partial chunk
@pytest.mark.parametrize("dtype,T,gate,lb,factor,bound", [
    (torch.float32, 100, 5.0, -5.0, 10.0, 2e-5),
    (torch.float16, 257, 1.25, -1.25, 2.0, 1.5e-3),
    (torch.float16, 100, 1e-3, -1.25, 2.0, 1.5e-3),
    (torch.float16, 100, 5.0, -5.0, 2.0, 1.5e-3),
])
def test_gate_gradient_as_accurate_as_the_others(dtype, T, gate, lb, factor, bound):
    # float32: every gradient's error is float32 rounding, dg's a few times the others' (its reverse sums over
    # the chunk; 3e-6 against 5e-7 at T = 256, with or without the dense tiles); float16: dg was 2.4e-3 against
    # 4.6e-4 for the others (5x) with the dense tiles before the split operands, 5.2e-4 after
    H, K, V = 2, 64, 64
    ins, do = make(T, H, K, V, gate, dtype)
    ref = grads64(ins, do, recurrence64)
    e = errors(lambda *x: tk.kda_chunk(*x, lower_bound=lb)[0], ins, do, ref)
    others = max(e[n] for n in NAMES if n != "g")
    assert e["g"] <= factor * others and e["g"] < bound, e
    assert others < bound, e


def test_float64_chunked_form_is_the_recurrence():
    # the GPU test's and benchmarks/kda_grad_accuracy.py's float64 reference (the chunked form, cheap at T = 8192)
    # against the token recurrence, gradients included
    ins, do = make(100, 2, 16, 16, 5.0, torch.float32)
    a, b = grads64(ins, do, recurrence64), grads64(ins, do, chunked64)
    assert all(rel(x, y) < 1e-12 for x, y in zip(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1024, 8192])
@pytest.mark.parametrize("H", [2, 16])
@pytest.mark.parametrize("gate", [5.0, 1e-3])
def test_gpu_bf16_gradients_against_fla(T, H, gate):
    # every gradient's error against float64 at most 1.2x fla-core's chunk_kda on the same inputs (mtc with the
    # bound -5 promised: dense diagonal tiles); without fla an absolute bound. H200, K = V = 128, after the split
    # operands: dg 3.2e-3 / 3.3e-3 at T = 1024 H = 2 / T = 8192 H = 16 (6.7e-2 / 6.5e-2 before), dq 3.7e-3;
    # gates near 0: every gradient 4.5e-3 .. 5.7e-3 (unchanged)
    ins, do = make(T, H, 128, 128, gate, torch.bfloat16, device="cuda")
    ref = grads64(ins, do, chunked64)
    mine = errors(lambda *x: tk.kda_chunk(*x, lower_bound=-5.0)[0], ins, do, ref)
    print(f"\nmtc T={T} H={H} gate=-{gate} sigmoid:", {n: f"{x:.2e}" for n, x in mine.items()})
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        chunk_kda = None
    if chunk_kda is None:
        assert all(x < 8e-3 for x in mine.values()), mine
        return
    theirs = errors(lambda *x: chunk_kda(*x)[0], ins, do, ref)
    print(f"fla T={T} H={H} gate=-{gate} sigmoid:", {n: f"{x:.2e}" for n, x in theirs.items()})
    assert all(mine[n] <= 1.2 * theirs[n] for n in NAMES), (mine, theirs)


@triton.jit
def _split_dots_kernel(A, B, O1, O2, M: tl.constexpr, N: tl.constexpr, R: tl.constexpr):
    rm, rn, rr = tl.arange(0, M), tl.arange(0, N), tl.arange(0, R)
    a = tl.load(A + rm[:, None] * R + rr[None, :])
    b = tl.load(B + rr[:, None] * N + rn[None, :])
    tl.store(O1 + rm[:, None] * N + rn[None, :], kb._dt_split(a, b, tl.float16))
    tl.store(O2 + rm[:, None] * N + rn[None, :], kb._dt_split2(a, b, tl.float16))


def test_two_part_operands_carry_float32_accuracy():
    # the pair backward's dots with 16-bit tensor-core operands (float16 here: bf16 dots do not run under the
    # interpreter): _dt_split2 (both operands in two parts) against float64 at float32 accuracy (~2e-7), where
    # _dt_split's one-part `a` leaves float16's rounding (~2e-4)
    a = torch.randn(16, 64) * torch.rand(16, 64).mul(4).exp()
    b = torch.randn(64, 32) * torch.rand(64, 32).mul(4).exp()
    o1, o2 = torch.empty(16, 32), torch.empty(16, 32)
    _split_dots_kernel[(1,)](a, b, o1, o2, M=16, N=32, R=64)
    ref = a.double() @ b.double()
    e1, e2 = rel(o1, ref), rel(o2, ref)
    assert e2 < 2e-6 and e2 < e1 / 30, (e1, e2)
