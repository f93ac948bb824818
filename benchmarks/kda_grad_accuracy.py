"""Accuracy of kda_chunk's gradients: mtc's Triton kda_chunk and fla-core's chunk_kda against float64 autograd.

Same inputs for both, per shape: B = 1, K = V = 128, bf16 q / k / v / beta (q, k L2-normalised), float32 g, a random
bf16 output gradient dO, loss sum(o * dO).  Gates: "[-5,0]" g = -5 sigmoid(randn) (mtc with lower_bound=-5: its
dense diagonal tiles), "near 0" g = -1e-3 sigmoid(randn), "softplus" Kimi Linear's unbounded gate
g = -exp(A_log) softplus(x + dt_bias) with A_log = log U(1, 16) per head and x ~ 2 randn (strongly decaying
channels, g down to -80 and past it: each row prints its minimum; mtc with lower_bound=None, its safe path).
fla: plain chunk_kda (no safe gate).  The float64 reference is the chunked form of tests/test_kda_grad_accuracy.py
(chunked64) run in float64 throughout, which is the token recurrence up to float64 rounding
(tests/test_kda_grad_accuracy.py checks the two against each other on the CPU).
Printed per gradient: ||d - d64|| / ||d64|| for mtc and fla, and their ratio (the GPU test asks mtc <= 1.2 x fla).
Rows print as they finish (a run cut short keeps its rows).
Usage (a CUDA GPU; fla-core 0.6.0 for the fla columns, else they read "-"):
  python benchmarks/kda_grad_accuracy.py [--quick] [--gates "[-5,0]" "near 0" softplus] [--shapes 1024:2 8192:16]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import backends.triton.kda as tk  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")


def make_inputs(T, H, gate, K=128, V=128, device="cuda", dtype=torch.bfloat16):
    """(q, k, v, g, beta, dO): q, k normalised, v randn in dtype; g float32 from the gate family; beta U(0, 1)."""
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=device), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=device), dim=-1).to(dtype)
    v = torch.randn(1, T, H, V, device=device).to(dtype)
    if gate == "softplus":
        a_log = torch.log(torch.empty(H, device=device).uniform_(1, 16))
        dt = torch.exp(torch.empty(H * K, device=device).uniform_(math.log(1e-3), math.log(0.1)))
        dt_bias = dt + torch.log(-torch.expm1(-dt))          # softplus^-1(dt)
        x = 2 * torch.randn(1, T, H, K, device=device) + dt_bias.view(H, K)
        g = -torch.exp(a_log)[:, None] * torch.nn.functional.softplus(x)
    else:
        amp = {"[-5,0]": 5.0, "near 0": 1e-3}[gate]
        g = -amp * torch.sigmoid(torch.randn(1, T, H, K, device=device))
    beta = torch.rand(1, T, H, device=device).to(dtype)
    do = torch.randn(1, T, H, V, device=device).to(dtype)
    return q, k, v, g, beta, do


def _chunked64():
    """tests/test_kda_grad_accuracy.py's float64 chunked form (checked there against the token recurrence)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                        "test_kda_grad_accuracy.py")
    spec = importlib.util.spec_from_file_location("kda_grad_accuracy_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.chunked64


def float64_grads(q, k, v, g, beta, do):
    """Gradients of sum(o * dO) in float64 (the chunked form in float64: the recurrence to float64 rounding)."""
    ins = [t.detach().double().requires_grad_() for t in (q, k, v, g, beta)]
    o = _chunked64()(*(t[0] for t in ins), q.shape[-1] ** -0.5)
    return torch.autograd.grad(o[None], ins, do.double())


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def grad_errors(fn, q, k, v, g, beta, do, ref):
    """{name: ||d - d64|| / ||d64||} of fn(q, k, v, g, beta) -> o."""
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)]
    o = fn(*ins)
    gx = torch.autograd.grad(o, ins, do)
    return {n: rel(a, b) for n, a, b in zip(NAMES, gx, ref)}


def fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return lambda q, k, v, g, beta: chunk_kda(q, k, v, g, beta)[0]


def mtc_chunk_kda(lower_bound):
    return lambda q, k, v, g, beta: tk.kda_chunk(q, k, v, g, beta, lower_bound=lower_bound)[0]


def table(shapes, gates, seed=0):
    """Yield (T, H, gate, mtc errors, fla errors or None) per shape and gate, as each finishes."""
    fla = fla_chunk_kda()
    for T, H in shapes:
        for gate in gates:
            torch.manual_seed(seed)
            q, k, v, g, beta, do = make_inputs(T, H, gate)
            ref = float64_grads(q, k, v, g, beta, do)
            lb = None if gate == "softplus" else -5.0
            mine = grad_errors(mtc_chunk_kda(lb), q, k, v, g, beta, do, ref)
            theirs = grad_errors(fla, q, k, v, g, beta, do, ref) if fla is not None else None
            yield T, H, f"{gate} (g >= {float(g.min()):.1f})", mine, theirs
            del ref
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 1024 only")
    ap.add_argument("--gates", nargs="+", default=["[-5,0]", "near 0", "softplus"],
                    choices=["[-5,0]", "near 0", "softplus"], help="gate families (default: all three)")
    ap.add_argument("--shapes", nargs="+", metavar="T:H", help="shapes (default: T in {1024, 8192} x H in {2, 16})")
    args = ap.parse_args()
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes]
    else:
        shapes = [(1024, 2), (1024, 16)] + ([] if args.quick else [(8192, 2), (8192, 16)])
    print("| T | H | gate | " + " | ".join(f"d{n} mtc / fla (ratio)" for n in NAMES) + " |")
    print("|---|---|---|" + "---|" * len(NAMES), flush=True)
    for T, H, gate, mine, theirs in table(shapes, args.gates):
        cells = []
        for n in NAMES:
            if theirs is None:
                cells.append(f"{mine[n]:.2e} / -")
            else:
                cells.append(f"{mine[n]:.2e} / {theirs[n]:.2e} ({mine[n] / theirs[n]:.2f}x)")
        print(f"| {T} | {H} | {gate} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
