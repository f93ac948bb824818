"""Routed experts of one Kimi K3 MoE layer on the GPU: the Triton grouped GEMMs with MXFP4 weights (W4A16: packed
E2M1 nibbles + E8M0 scales decoded per weight tile in registers, backends/triton/moe_kernels.py W_MX) beside the
same kernels on bf16 weights, in one process, on random data.

Layer (spec/MODEL.md): latent l 3584, 896 routed experts, top-16, expert intermediate I 3072, SiTU-GLU, bf16
activations. The bf16 weights are the MXFP4 weights decoded (the same numbers), so the two outputs agree to bf16
rounding (the relative difference is printed). Timing: triton.testing.do_bench (median, CUDA events), forward of
the routed experts (``moe_experts``) and, with --bwd, forward + backward in the activations (x, topk_weight; the
MXFP4 weights are frozen, so the bf16 case runs with frozen weights too). Bytes: the weights read once (bf16: 2 B
per element, MXFP4: 0.53125 B) plus the token rows in and out: the floor of a weight-streaming layer at few tokens
per expert. FLOPs: 6 N k l I forward, 12 N k l I forward + activation gradients (weights frozen).

Usage: python benchmarks/moe_mxfp4.py [--tokens 1024 8192 32768] [--experts 896] [--bwd] [--out FILE]
       TRITON_INTERPRET=1 python benchmarks/moe_mxfp4.py --cpu-smoke   (tiny shapes on CPU, float32, no timing)
The last line of the table is the ratio bf16 / mxfp4 time at the largest token count.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PEAK_TFLOPS = 720.0
PEAK_TBS = 4.2


def random_mxfp4(e, out, n_in, device):
    from backends.mxfp4 import MXFP4Experts
    w = MXFP4Experts(e, out, n_in, device=device)
    w.weight_packed.copy_(torch.randint(0, 256, w.weight_packed.shape, dtype=torch.uint8, device=device))
    # scales 2^-8 .. 2^-6: weights of the size of a trained layer's (|w| <= 6 * 2^-6)
    w.weight_scale.copy_(torch.randint(119, 122, w.weight_scale.shape, dtype=torch.uint8, device=device))
    return w


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--latent", type=int, default=3584)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--bwd", action="store_true", help="also forward + backward (activation gradients)")
    ap.add_argument("--out", default=None, help="write the table (markdown) here")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1), no timing")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.tokens, a.experts, a.top_k, a.latent, a.inter = [37], 6, 2, 64, 96
        device, dtype = "cpu", torch.float32
    else:
        device, dtype = "cuda", torch.bfloat16
    from backends.triton import moe as tm
    E, k, L, I = a.experts, a.top_k, a.latent, a.inter
    torch.manual_seed(0)
    ws = [random_mxfp4(E, I, L, device), random_mxfp4(E, I, L, device), random_mxfp4(E, L, I, device)]
    dense = []
    for w in ws:                      # decoded expert by expert (a whole-tensor decode would need int64 codes)
        d = torch.empty(w.shape, dtype=dtype, device=device)
        for j in range(E):
            d[j] = w.expert(j, dtype)
        dense.append(d)
    rows = []
    for n in a.tokens:
        x = torch.randn(n, L, device=device, dtype=dtype)
        idx = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(n)]) if n <= 4096 else \
            torch.rand(n, E, device=device).topk(k, dim=1).indices
        wt = torch.softmax(torch.randn(n, k, device=device), -1)
        u_mx = tm.moe_experts(x, idx, wt, *ws)
        u_bf = tm.moe_experts(x, idx, wt, *dense)
        rel = ((u_mx.float() - u_bf.float()).norm() / u_bf.float().norm()).item()
        if a.cpu_smoke:
            print(f"cpu smoke: N={n} rel(mxfp4, decoded dense) = {rel:.2e}")
            assert rel < 1e-5
            continue
        from triton.testing import do_bench
        cases = {"bf16": dense, "mxfp4": ws}
        for name, w in cases.items():
            t = do_bench(lambda: tm.moe_experts(x, idx, wt, *w), warmup=25, rep=200)
            wbytes = 3 * E * I * L * (2 if name == "bf16" else 0.53125)
            act = 2 * n * L * x.element_size()
            rows.append((n, name, "fwd", t, 6 * n * k * L * I / t / 1e9, (wbytes + act) / t / 1e6, rel))   # t in ms
            if a.bwd:
                xg = x.clone().requires_grad_()
                wg = wt.clone().requires_grad_()
                g = torch.randn_like(x)

                def step():
                    xg.grad = wg.grad = None
                    tm.moe_experts(xg, idx, wg, *w).backward(g)
                t = do_bench(step, warmup=10, rep=200)
                rows.append((n, name, "fwd+bwd(x)", t, 12 * n * k * L * I / t / 1e9, float("nan"), rel))
    if a.cpu_smoke:
        return
    lines = [f"MoE experts, E={E} top-{k} l={L} I={I}, {torch.cuda.get_device_name()}", "",
             "| tokens | weights | pass | ms | TFLOP/s | GB/s (weights once + rows) | rel vs decoded bf16 |",
             "|---|---|---|---|---|---|---|"]
    for n, name, p, t, tf, gbs, rel in rows:
        lines.append(f"| {n} | {name} | {p} | {t:.3f} | {tf:.0f} | {gbs:.0f} | {rel:.1e} |")
    n_max = max(a.tokens)
    tb = next(t for n, name, p, t, *_ in rows if n == n_max and name == "bf16" and p == "fwd")
    tq = next(t for n, name, p, t, *_ in rows if n == n_max and name == "mxfp4" and p == "fwd")
    lines += ["", f"ratio bf16 / mxfp4 forward time at {n_max} tokens: {tb / tq:.2f}"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
