"""Where kda_chunk's bf16 forward loses accuracy: a float64 emulation of the chunked algorithm that rounds one
intermediate at a time to bf16 (or the diagonal tile's operands to TF32), against the float64 token-by-token
recurrence.  CPU only, a few seconds.

The emulated algorithm is the Triton forward's (backends/triton/kda): chunks of C = 64 tokens, in-chunk cumulative
gate G in float32, the strips Akk / P of each 32-row block as dots of the anchored operands x_i e^(G_i - c) and
k_j e^(c - G_j) with c = G before the block + 16 lb (the bounded path), the WY solve T = (I + diag(beta) Akk)^-1,
Wk = T diag(beta) k e^G, U = T diag(beta) v, then per chunk v_new = U - Wk S, o = QG S + Aqk v_new,
S' = e^(G_C) S + KD^T v_new (Yang et al. 2024, "Gated Delta Networks", the chunked WY form; Kimi Linear's KDA,
arXiv:2510.26692, Sec. 3, for the channel-wise gate).  Rounding points:
  diag_op  the dense diagonal tile's operands (bf16; the fix rounds them to TF32: --diag tf32)
  off_op   the strictly earlier tiles' operands
  nb aqk kgb wk u qg kd h vn   the stored intermediates diag(beta) Akk, scale P, diag(beta) k e^G, Wk, U,
           scale q e^G, k e^(G_C - G), the chunk-entry state S, v_new (bf16, as the kernels store them)
Each row: the relative error ||o - o_64|| / ||o_64|| with only that point rounded, then with all of them.

Usage: python benchmarks/kda_rounding.py [--T 512] [--trials 2] [--gate -5] [--seed 0]
"""
from __future__ import annotations

import argparse

import torch

POINTS = ("diag_op", "off_op", "nb", "aqk", "kgb", "wk", "u", "qg", "kd", "h", "vn")


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float64)


def tf32(x):
    """Round to TF32 (10 explicit mantissa bits, round to nearest) as a Hopper tensor core reads float32."""
    i = x.to(torch.float32).view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32).to(torch.float64)


def recurrence(q, k, v, g, beta, scale):
    """float64 truth: S_t = diag(e^g_t) S_(t-1) + beta_t k_t (v_t - k_t^T diag(e^g_t) S_(t-1)), o_t = scale q_t S_t."""
    S = torch.zeros(q.shape[1], v.shape[1], dtype=torch.float64)
    o = torch.empty(q.shape[0], v.shape[1], dtype=torch.float64)
    for t in range(q.shape[0]):
        S = torch.exp(g[t])[:, None] * S
        S = S + beta[t] * k[t][:, None] * (v[t] - k[t] @ S)[None, :]
        o[t] = scale * q[t] @ S
    return o


def chunked(q, k, v, g, beta, scale, rnd, lb, C=64, rows=32):
    """The chunked forward with rnd[point] applied at each rounding point (identity where absent)."""
    r = {p: rnd.get(p, lambda x: x) for p in POINTS}
    S = torch.zeros(q.shape[1], v.shape[1], dtype=torch.float64)
    out = []
    for c0 in range(0, q.shape[0], C):
        sl = slice(c0, min(q.shape[0], c0 + C))
        qc, kc, vc, bc = q[sl], k[sl], v[sl], beta[sl]
        n = qc.shape[0]
        G = torch.cumsum(g[sl].to(torch.float32), 0).to(torch.float64)
        A = torch.zeros(n, n, dtype=torch.float64)
        P = torch.zeros(n, n, dtype=torch.float64)
        for r0 in range(0, n, rows):
            blk = slice(r0, min(n, r0 + rows))
            c = (G[r0 - 1] if r0 else torch.zeros_like(G[0])) + (rows // 2) * lb
            ka, qa = kc[blk] * torch.exp(G[blk] - c), qc[blk] * torch.exp(G[blk] - c)
            col = kc[:blk.stop] * torch.exp(c - G[:blk.stop])
            co = r["off_op"](col[:r0])
            A[blk, :r0], P[blk, :r0] = r["off_op"](ka) @ co.T, r["off_op"](qa) @ co.T
            cd = r["diag_op"](col[r0:])
            A[blk, r0:blk.stop], P[blk, r0:blk.stop] = r["diag_op"](ka) @ cd.T, r["diag_op"](qa) @ cd.T
        NB = r["nb"](bc[:, None] * torch.tril(A, -1))
        Aqk = r["aqk"](torch.tril(P) * scale)
        T = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + NB)
        WK = r["wk"](T @ r["kgb"](bc[:, None] * kc * torch.exp(G)))
        U = r["u"](T @ (bc[:, None] * vc))
        QG, KD = r["qg"](scale * qc * torch.exp(G)), r["kd"](kc * torch.exp(G[-1] - G))
        Sh = r["h"](S)
        VN = r["vn"](U - WK @ Sh)
        out.append(QG @ Sh + Aqk @ VN)
        S = torch.exp(G[-1])[:, None] * S + KD.T @ VN
    return torch.cat(out)


def main(argv=None):
    head, rest = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=512, help="tokens per trial (default 512)")
    ap.add_argument("--trials", type=int, default=2, help="fresh random inputs per row, errors averaged (default 2)")
    ap.add_argument("--gate", type=float, default=-5.0,
                    help="g = gate * sigmoid(randn), also the promised bound (default -5)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    K = V = 128
    rows = [(p, {p: bf16}) for p in POINTS]
    every = {p: bf16 for p in POINTS}
    rows += [("all (bf16 diagonal operands)", every), ("all, TF32 diagonal operands", {**every, "diag_op": tf32}),
             ("all, exact diagonal operands", {k_: f for k_, f in every.items() if k_ != "diag_op"})]
    err = {name: 0.0 for name, _ in rows}
    for _ in range(a.trials):
        q = bf16(torch.nn.functional.normalize(torch.randn(a.T, K, dtype=torch.float64), dim=-1))
        k = bf16(torch.nn.functional.normalize(torch.randn(a.T, K, dtype=torch.float64), dim=-1))
        v, beta = bf16(torch.randn(a.T, V, dtype=torch.float64)), bf16(torch.rand(a.T, dtype=torch.float64))
        g = (a.gate * torch.sigmoid(torch.randn(a.T, K))).to(torch.float64)
        o64 = recurrence(q, k, v, g, beta, K ** -0.5)
        for name, rnd in rows:
            o = chunked(q, k, v, g, beta, K ** -0.5, rnd, a.gate)
            err[name] += float((o - o64).norm() / o64.norm()) / a.trials
    print(f"T = {a.T}, K = V = {K}, g = {a.gate} sigmoid(randn), bf16 inputs, {a.trials} trials\n")
    print("| rounded | rel. error of o vs float64 |\n|---|---|")
    for name, _ in rows:
        print(f"| {name} | {err[name]:.3e} |")


if __name__ == "__main__":
    main()
