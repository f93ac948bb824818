"""Where kda_chunk's bf16 backward loses accuracy: torch autograd (float64) through an emulation of the chunked
algorithm in which each rounding point of the Triton kernels (backends/triton/kda) can be switched on alone,
against the float64 gradients of the same algorithm without rounding (= tests/test_kda_grad_accuracy.py's
chunked64).  CPU only, under a minute.

Forward values are rounded straight-through (the value is rounded, the gradient passes unchanged, the backward
reading the rounded value as its operand, as the kernels read their saved bf16 tensors); backward-only roundings
are identity functions whose backward rounds the incoming gradient.  The pair products P, Akk take their forward
values from the anchored strip dots of the forward (32-row blocks, anchor G before the block + 16 lb, as
_intra_strip32_kernel) but their gradient graph from the exact float64 products, so the backward's own operands
are exact except where a point below rounds them (the pair kernel's decay-scaled operand is split in two bf16
parts: ~2^-17, counted as exact; the strips' float32 G enters only with the operand points).
Points, forward (the values the backward reads):
  diag_op off_op  the forward strips' operands: dense diagonal tile (TF32, as main), earlier tiles (bf16)
  aqk kgb wk u qg kd h vn   the saved bf16 intermediates (see kda_rounding.py); h also in DGP = sum S0 dS
  t               T (float32 TB) and beta v rounded to bf16 as operands of the w/u dots and of the UT backward
backward:
  daqk            DAQK = tril(dO W^T) stored bf16 (_bwd_chunk_kernel)
  dp              dP = scale DAQK rounded to bf16 as the pair kernel's one-part operand (_dt_split's `a`)
  dbm             dBm = DB (float32) rounded to bf16 as the same operand
  dqg dkd dwk     DQG = dO S0^T, DKD = W X^T, DWK = -dW S0^T stored bf16 (_bwd_chunk_kernel)
  du              DU = dW = A^T dO + KD X stored bf16 (the chain's and the UT kernel's dW)
  dhb             X = dS rounded to bf16 as the operand of KD X and of W X^T (DHB, Xd)
  ut              dAkk = -bf16(bf16(T^T) bf16(dT)) bf16(T^T) (_bwd_ut_kernel)
  out             dq, dk, dv, dbeta stored in the inputs' dtype (bf16; dg float32)
Rows V1-V4: candidate kernel changes (V3 on branch bwdacc); "fla-like": fla-core 0.6.0's backward roundings as far
as they map onto these points (float32 dA into TF32 dots between sub-chunks and float32 token pairs inside; dq, dk
kept float32 until the output; its forward's own differences not modelled).

Usage: python benchmarks/kda_bwd_rounding.py [--T 256] [--trials 3] [--gate -5] [--lb -5] [--seed 0] [--quick]
"""
from __future__ import annotations

import argparse

import torch

torch.set_num_threads(1)

FWD = ("diag_op", "off_op", "aqk", "kgb", "wk", "u", "qg", "kd", "h", "vn", "t")
BWD = ("daqk", "dp", "dbm", "dqg", "dkd", "dwk", "du", "dhb", "ut")
NAMES = ("q", "k", "v", "g", "beta")


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float64)


def tf32(x):
    """Round to TF32 (10 explicit mantissa bits, round to nearest) as a Hopper tensor core reads float32."""
    i = x.to(torch.float32).view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32).to(torch.float64)


def _diag16(n):
    i = torch.arange(n)
    return (i[:, None] // 16) == (i[None, :] // 16)


def tf32_diag(x):
    """TF32 on the 16x16 diagonal tiles of a [n, n] chunk matrix, bf16 elsewhere."""
    return torch.where(_diag16(x.shape[0]), tf32(x), bf16(x))


def tf32_offdiag(x):
    """TF32 off the 16x16 diagonal tiles, exact on them (fla's intra backward: TF32 dots of float32 dA between
    sub-chunks, float32 token pairs inside)."""
    return torch.where(_diag16(x.shape[0]), x, tf32(x))


def st(x, fn):
    """Straight-through rounding: the value fn(x), the gradient of x."""
    return x + (fn(x) - x).detach()


class _GradRound(torch.autograd.Function):
    """Identity whose backward rounds the gradient with fn."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.fn(g), None


class _UT(torch.autograd.Function):
    """T = (I + N)^-1 for strictly lower N; backward dN = -T^T dT T^T, with rnd its products' bf16 operands as
    _bwd_ut_kernel's _dt(_dt(Tt, dT), Tt)."""

    @staticmethod
    def forward(ctx, N, rnd):
        T = torch.linalg.inv(torch.eye(N.shape[0], dtype=N.dtype) + N)
        ctx.save_for_backward(T)
        ctx.rnd = rnd
        return T

    @staticmethod
    def backward(ctx, dT):
        (T,) = ctx.saved_tensors
        Tt = T.T
        if ctx.rnd:
            dN = -(bf16(bf16(Tt) @ bf16(dT)) @ bf16(Tt))
        else:
            dN = -(Tt @ dT @ Tt)
        return torch.tril(dN, -1), None


def strips(qc, kc, G32, rnd, lb, rows=32):
    """Forward values of Akk (strictly lower) and P (lower) of one chunk from the anchored strip dots."""
    n = qc.shape[0]
    A = torch.zeros(n, n, dtype=torch.float64)
    P = torch.zeros(n, n, dtype=torch.float64)
    ro, rd = rnd.get("off_op", lambda x: x), rnd.get("diag_op", lambda x: x)
    for r0 in range(0, n, rows):
        blk = slice(r0, min(n, r0 + rows))
        c = (G32[r0 - 1] if r0 else torch.zeros_like(G32[0])) + (rows // 2) * lb
        ka, qa = kc[blk] * torch.exp(G32[blk] - c), qc[blk] * torch.exp(G32[blk] - c)
        col = kc[:blk.stop] * torch.exp(c - G32[:blk.stop])
        co = ro(col[:r0])
        A[blk, :r0], P[blk, :r0] = ro(ka) @ co.T, ro(qa) @ co.T
        cd = rd(col[r0:])
        A[blk, r0:blk.stop], P[blk, r0:blk.stop] = rd(ka) @ cd.T, rd(qa) @ cd.T
    return torch.tril(A, -1), torch.tril(P)


def emulate(q, k, v, g, beta, scale, R, lb, C=64):
    """The chunked forward (one head: q, k, g [T, K], v [T, V], beta [T]) with the rounding points of R
    (point -> function) in place; its autograd graph is the emulated backward."""
    f = lambda p, x: st(x, R[p]) if p in R else x              # noqa: E731
    gr = lambda p, x: _GradRound.apply(x, R[p]) if p in R else x   # noqa: E731
    K, V = q.shape[1], v.shape[1]
    S = torch.zeros(K, V, dtype=torch.float64)
    outs = []
    for c0 in range(0, q.shape[0], C):
        sl = slice(c0, min(q.shape[0], c0 + C))
        qc, kc, vc, gc, bc = q[sl], k[sl], v[sl], g[sl], beta[sl]
        n = qc.shape[0]
        G = torch.cumsum(gc, 0)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        decay = torch.where(causal[:, :, None], G[:, None] - G[None, :], float("-inf")).exp()
        A_ex = torch.einsum("ik,jk,ijk->ij", kc, kc, decay).tril(-1)
        P_ex = torch.einsum("ik,jk,ijk->ij", qc, kc, decay)
        if "diag_op" in R or "off_op" in R:
            with torch.no_grad():
                G32 = torch.cumsum(gc.detach().to(torch.float32), 0).to(torch.float64)
                A_v, P_v = strips(qc.detach(), kc.detach(), G32, R, lb)
            A_ex, P_ex = A_ex + (A_v - A_ex).detach(), P_ex + (P_v - P_ex).detach()
        A = gr("dbm", A_ex)
        P = gr("dp", P_ex)
        Aqk = gr("daqk", f("aqk", torch.tril(P) * scale))
        T = _UT.apply(bc[:, None] * A, "ut" in R)
        Tr = f("t", T)
        eG = torch.exp(G)
        kgb = f("kgb", bc[:, None] * kc * eG)
        bv = f("t", bc[:, None] * vc)
        WK = gr("dwk", f("wk", Tr @ kgb))
        U = f("u", Tr @ bv)
        QG = gr("dqg", f("qg", scale * qc * eG))
        KD = gr("dkd", f("kd", kc * torch.exp(G[-1] - G)))
        Sh = f("h", S)
        VN = gr("du", f("vn", U - WK @ Sh))
        outs.append(QG @ Sh + Aqk @ VN)
        gam = torch.exp(G[-1])[:, None]
        decayed = gam * S + ((gam - gam.detach()) * (Sh - S).detach() if "h" in R else 0.0)
        S = decayed + gr("dhb", KD.T @ VN)
    return torch.cat(outs)


def grads(ins, do, R, lb, scale):
    x = [t.detach().clone().requires_grad_() for t in ins]
    gx = torch.autograd.grad(emulate(*x, scale, R, lb), x, do)
    if "out" in R:
        gx = [bf16(t) if n != "g" else t.to(torch.float32).to(torch.float64) for n, t in zip(NAMES, gx)]
    return gx


def rel(a, b):
    return float((a - b).norm() / b.norm())


def make(T, K, V, gate, gen):
    q = bf16(torch.nn.functional.normalize(torch.randn(T, K, dtype=torch.float64, generator=gen), dim=-1))
    k = bf16(torch.nn.functional.normalize(torch.randn(T, K, dtype=torch.float64, generator=gen), dim=-1))
    v = bf16(torch.randn(T, V, dtype=torch.float64, generator=gen))
    g = (gate * torch.sigmoid(torch.randn(T, K, generator=gen))).to(torch.float32).to(torch.float64)
    beta = bf16(torch.rand(T, dtype=torch.float64, generator=gen))
    do = bf16(torch.randn(T, V, dtype=torch.float64, generator=gen))
    return (q, k, v, g, beta), do


def configs(quick):
    """(name, rounding dict) rows: each point alone, all (main's kernels), all but one, candidate fixes."""
    main = {p: bf16 for p in FWD + BWD}
    main["diag_op"] = tf32
    main["out"] = bf16
    rows = [("none (float64; check: ~1e-15)", {})]
    if not quick:
        rows += [(f"{p} alone (+out)", {p: main[p], "out": bf16}) for p in FWD + BWD]
        rows += [("out alone", {"out": bf16})]
    rows += [("all (main's kernels)", main)]
    rows += [(f"all but {p}", {x: f for x, f in main.items() if x != p}) for p in FWD + BWD]
    drop = lambda *ps: {x: f for x, f in main.items() if x not in ps}     # noqa: E731
    rows += [
        ("V1: scale after the dot (DAQK bf16, one rounding)", drop("dp")),
        ("V2: DAQK float32, dP one bf16 part", drop("daqk")),
        ("V3: DAQK float32, dP two bf16 parts (the fix)", drop("daqk", "dp")),
        ("V3 + dBm two parts", drop("daqk", "dp", "dbm")),
        ("V4: V3 + DQG, DKD float32", drop("daqk", "dp", "dqg", "dkd")),
        ("DAQK float32, dP / dBm TF32", {**drop("daqk"), "dp": tf32, "dbm": tf32}),
        ("DAQK float32, dP / dBm TF32 on diagonal tiles only", {**drop("daqk"), "dp": tf32_diag, "dbm": tf32_diag}),
        ("fla-like: float32 dA, dq, dk (TF32 off-diagonal dA)",
         {**drop("daqk", "dqg", "dkd"), "dp": tf32_offdiag, "dbm": tf32_offdiag}),
    ]
    return rows


def main(argv=None):
    head, rest = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=256, help="tokens per trial (default 256)")
    ap.add_argument("--trials", type=int, default=3, help="fresh random inputs per row, errors averaged (default 3)")
    ap.add_argument("--gate", type=float, default=-5.0,
                    help="g = gate * sigmoid(randn) (default -5)")
    ap.add_argument("--lb", type=float, default=-5.0, help="the promised bound (the strips' anchors; default -5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="skip the one-point-alone rows")
    a = ap.parse_args(argv)
    K = V = 128
    rows = configs(a.quick)
    err = {name: dict.fromkeys(NAMES, 0.0) for name, _ in rows}
    gen = torch.Generator().manual_seed(a.seed)
    lb = a.lb
    for _ in range(a.trials):
        ins, do = make(a.T, K, V, a.gate, gen)
        ref = grads(ins, do, {}, lb, K ** -0.5)
        for name, R in rows:
            for n, x, y in zip(NAMES, grads(ins, do, R, lb, K ** -0.5), ref):
                err[name][n] += rel(x, y) / a.trials
    print(f"T = {a.T}, K = V = {K}, g = {a.gate} sigmoid(randn), bound {lb}, bf16 inputs, {a.trials} trials; "
          "gradient error vs float64 (ratio to `all`)\n")
    print("| rounded | dq | dk | dv | dg | dbeta |\n|---|---|---|---|---|---|")
    base = err["all (main's kernels)"]
    for name, _ in rows:
        e = err[name]
        print(f"| {name} | " + " | ".join(f"{e[n]:.2e} ({e[n] / base[n]:.2f})" for n in NAMES) + " |")


if __name__ == "__main__":
    main()
