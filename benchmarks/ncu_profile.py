"""One call of a hot op between cudaProfilerStart / cudaProfilerStop, for Nsight Compute (GPU only).

Warms the op up (Triton compiles, autotunes) outside the profiled range, then runs it once inside, so that

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed \\
        python benchmarks/ncu_profile.py experts --tokens 8192

reports each kernel of exactly one call (leave the clocks alone: --clock-control none). Ops, bf16:
  attn_residual  backends.triton.attn_residual, N tokens x d 7168, L sources (default 16384, 2), beside a torch add
                 that moves the same DRAM bytes (reads 2 [N, d], writes 1) as a streaming reference
  experts        backends.triton.moe_experts forward + backward, the K3 layer's experts (896, top-16, latent 3584,
                 intermediate 3072) at --tokens (default 8192); with many sections ncu replays each kernel, and
                 the 20 GB weight-gradient writes may not fit a replay's save/restore: ask for metrics only
  wgrad          one dW2 weight-gradient launch of the K3 experts (dW2[e] = du_e^T h_e over dispatch-order
                 rows) at --tokens (default 8192), by the kernel --wgrad-kernel with its tile settings from
                 --wgrad-set (e.g. "BN=128,KX=32" for the held kernel); metrics only, as for experts
  kda            backends.triton.kda_chunk forward (no autograd), B 1, H --heads (16), T --tokens (65536),
                 K = V = 128, gate lower bound -5
The 12th session's profiles (benchmarks/results/*.md) were taken this way.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("op", choices=["attn_residual", "experts", "wgrad", "kda"])
    ap.add_argument("--tokens", type=int, default=None, help="tokens (default: see above)")
    ap.add_argument("--sources", type=int, default=2, help="attn_residual: number of sources L (default 2)")
    ap.add_argument("--heads", type=int, default=16, help="kda: heads (default 16)")
    ap.add_argument("--wgrad-kernel", default="held", choices=["held", "tile"],
                    help="wgrad: the held kernel (the default at few rows per expert) or the tile kernel for every "
                         "expert (MoeConfig.wgrad_few_rows 0; default held)")
    ap.add_argument("--wgrad-set", default="", metavar="K=V,...",
                    help="wgrad: integer settings of that kernel's tile entry (held: wgrad_held, tile: wgrad)")
    ap.add_argument("--warmup", type=int, default=3, help="unprofiled calls first (default 3)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (this script only brackets one GPU call for ncu)")
    if args.tokens is not None and args.tokens < 1:
        ap.error(f"--tokens must be >= 1, got {args.tokens}")
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    after = None
    if args.op == "attn_residual":
        ar = importlib.import_module("backends.triton.attn_residual")
        n, d = args.tokens or 16384, 7168
        xs = [torch.randn(n, d, device=dev, dtype=bf) for _ in range(args.sources)]
        q, w = torch.randn(d, device=dev, dtype=bf), torch.rand(d, device=dev, dtype=bf)
        fn = lambda: ar.attn_residual(q, xs, w)  # noqa: E731
        after = (lambda: torch.add(xs[0], xs[1])) if len(xs) >= 2 else None
    elif args.op == "experts":
        from backends.triton import moe as tm
        e, lat, inter, k = 896, 3584, 3072, 16
        t = args.tokens or 8192
        xl = torch.randn(t, lat, device=dev, dtype=bf, requires_grad=True)
        idx = torch.randn(t, e, device=dev).topk(k, dim=1).indices
        wt = torch.rand(t, k, device=dev, requires_grad=True)
        w1, w3 = ((torch.randn(e, inter, lat, device=dev, dtype=bf) * 0.02).requires_grad_() for _ in range(2))
        w2 = (torch.randn(e, lat, inter, device=dev, dtype=bf) * 0.02).requires_grad_()
        gu = torch.randn(t, lat, device=dev, dtype=bf)

        def fn():
            u = tm.moe_experts(xl, idx, wt, w1, w3, w2)
            torch.autograd.grad(u, (xl, wt, w1, w3, w2), gu)
    elif args.op == "wgrad":
        from backends.triton import moe as tm
        e, lat, inter, k = 896, 3584, 3072, 16
        t = args.tokens or 8192
        entry = {"held": "wgrad_held", "tile": "wgrad"}[args.wgrad_kernel]
        change = {}
        for kv in filter(None, args.wgrad_set.split(",")):
            key, _, val = kv.partition("=")
            if not val.lstrip("-").isdigit():
                ap.error(f"--wgrad-set: expected KEY=INTEGER items, got {kv!r}")
            change[key.strip()] = int(val)
        d = tm._Dispatch(torch.randn(t, e, device=dev).topk(k, dim=1).indices, e)
        dus = torch.randn(d.nk, lat, device=dev, dtype=bf)
        hw = torch.randn(d.nk, inter, device=dev, dtype=bf)
        dw2 = torch.empty(e, lat, inter, device=dev, dtype=bf)
        fields = {"wgrad_few_rows": 0} if args.wgrad_kernel == "tile" else {}

        def fn():
            with tm.config(tiles={"cuda": {entry: change}}, **fields):
                tm._wgrad(dus, hw, d, lat, inter, dw2)
    else:
        from backends.triton.kda import kda_chunk
        h, t = args.heads, args.tokens or 65536
        q, k_, v = (torch.randn(1, t, h, 128, device=dev, dtype=bf) for _ in range(3))
        q = torch.nn.functional.normalize(q.float(), dim=-1).to(bf)
        k_ = torch.nn.functional.normalize(k_.float(), dim=-1).to(bf)
        g = -5 * torch.rand(1, t, h, 128, device=dev)
        beta = torch.rand(1, t, h, device=dev, dtype=bf)

        def fn():
            with torch.no_grad():
                kda_chunk(q, k_, v, g, beta, lower_bound=-5.0)
    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    if after is not None:
        after()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one {args.op} call", flush=True)


if __name__ == "__main__":
    main()
