"""Benchmark: one KDA layer's decode step (one token, B = 1) at K3 width, H = 96, K = V = 128, conv width 4, bf16.

Rows (medians of triton.testing.do_bench, CUDA events, "eager": what a Python caller waits, the host's launch work
included; and of do_bench_cudagraph, "CUDA graph": the same launches replayed from a graph, the GPU's time alone;
the projections' GEMMs are outside every row):
  fused          backends/triton/kda/decode.py kda_decode_step: one launch (3 short convs + conv-state update, SiLU,
                 L2 norms, gate, beta, the recurrence on the cache state in place, rmsnorm * sigmoid gate)
  per-launch     what the inference session ran before (and runs with inference.FUSE_KDA_DECODE = False): per conv
                 the cached inputs gathered in front (torch.cat) -> triton conv_silu_norm -> the state written
                 back, then triton kda_gate, sigmoid, the recurrence, and the output norm (torch ops here, a
                 generated kernel in the program); the recurrence as kda_step_rows (in place) and as the public
                 kda_step on a gathered copy with the result scattered back
  fla            fla's fused_recurrent_kda (the recurrence with in-kernel q/k L2 norm; conv, gate, norm not
                 included) when fla.ops.kda imports
floor: the recurrent state's bytes, read and written once, at the H200 copy rate: H K V 4 B x 2 / 4.2 TB/s.
Usage (a CUDA GPU): python benchmarks/kda_decode.py [--heads 96] [--dim 128] [--batch 1]
"""
from __future__ import annotations

import argparse

import torch

BW_PEAK = 4.2e12


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--conv", type=int, default=4)
    a = ap.parse_args()
    import triton.testing
    from backends.triton import conv_silu_norm, kda_gate, kda_step
    from backends.triton.kda.decode import kda_decode_step
    from backends.triton.kda.step import kda_step_rows

    dev, dt = "cuda", torch.bfloat16
    B, H, K, W = a.batch, a.heads, a.dim, a.conv
    V, C = K, a.heads * a.dim
    torch.manual_seed(0)
    r = lambda *s, dtype=dt: torch.randn(*s, device=dev, dtype=dtype)
    xq, xk, xv, f, gl = (r(B, C) for _ in range(5))
    b = r(B, H)
    cq, ck, cv = (r(B, W - 1, C) for _ in range(3))
    wq, wk, wv = (r(C, 1, W) * 0.5 for _ in range(3))
    A_log, dt_bias = torch.zeros(H, device=dev), r(C, dtype=torch.float32)
    w_o = torch.ones(V, device=dev, dtype=dt)
    S = r(B, H, K, V, dtype=torch.float32) * 0.1
    rows = torch.arange(B, device=dev)
    scale, lb = K ** -0.5, -5.0

    def fused():
        return kda_decode_step(xq, xk, xv, cq, ck, cv, wq, wk, wv, f, A_log, dt_bias, b, S, rows, scale=scale,
                               lower_bound=lb, norm=(w_o, gl, 1e-5))

    def convs():
        out = []
        for x, st, w, hd in ((xq, cq, wq, K), (xk, ck, wk, K), (xv, cv, wv, None)):
            xe = torch.cat([st[rows].to(x.dtype), x[:, None]], dim=1)
            out.append(conv_silu_norm(xe, w, head_dim=hd, eps=1e-6)[:, W - 1:])
            st[rows] = xe[:, 1:]
        g = kda_gate(f.view(B, 1, H, K), A_log, dt_bias, lower_bound=lb)[:, 0]
        return [o.reshape(B, H, -1) for o in out], g, torch.sigmoid(b)

    def epilogue(o):
        of = o.float()
        y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + 1e-5) * w_o.float()
        return (y.to(dt) * torch.sigmoid(gl).view(B, H, V)).view(B, C)

    def per_launch_rows():
        (q, k, v), g, beta = convs()
        return epilogue(kda_step_rows(q, k, v, g, beta, S, rows, scale=scale))

    def per_launch_copy():
        (q, k, v), g, beta = convs()
        o, S1 = kda_step(q, k, v, g, beta, S[rows], scale=scale)
        S[rows] = S1
        return epilogue(o)

    cases = [("fused (one launch)", fused), ("per-launch, kda_step_rows in place", per_launch_rows),
             ("per-launch, kda_step gather/scatter", per_launch_copy)]
    note = ""
    try:
        from fla.ops.kda import fused_recurrent_kda
        q4, k4, v4 = (t.view(B, 1, H, K) for t in (xq, xk, xv))
        g4 = (-torch.rand(B, 1, H, K, device=dev)).to(torch.float32)
        b4 = torch.sigmoid(b).view(B, 1, H)
        S_fla = S.clone()

        def fla():
            return fused_recurrent_kda(q4, k4, v4, g4, b4, scale=scale, initial_state=S_fla,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        fla()
        cases.append(("fla fused_recurrent_kda (recurrence only)", fla))
    except Exception as e:                        # (not installed, or another signature: reported under the table)
        note = f"fla fused_recurrent_kda not run: {type(e).__name__}: {e}"
    floor = H * K * V * 4 * 2 * B / BW_PEAK * 1e6
    print(f"KDA decode step, B = {B}, H = {H}, K = V = {K}, conv {W}, bf16 activations, float32 state\n")
    print("| implementation | us eager | x floor | us CUDA graph | x floor |")
    print("|---|---:|---:|---:|---:|")
    times = {}
    for name, fn in cases:
        fn()
        torch.cuda.synchronize()
        t = triton.testing.do_bench(fn, warmup=50, rep=300) * 1e3
        times[name] = t
        try:                # the launches replayed from a CUDA graph: the GPU time without the host's
            tg = triton.testing.do_bench_cudagraph(fn, rep=300) * 1e3
            graph = f"{tg:.1f} | {tg / floor:.1f}"
        except Exception as e:                    # (a step that cannot be captured: reported in the row)
            graph = f"- ({type(e).__name__}) | -"
        print(f"| {name} | {t:.1f} | {t / floor:.1f} | {graph} |", flush=True)
    print(f"| state-bytes floor (H K V 4 B x 2 / 4.2 TB/s) | {floor:.2f} | 1.0 | {floor:.2f} | 1.0 |")
    if note:
        print("\n" + note)
    base = times["per-launch, kda_step_rows in place"]
    print(f"\nfused / per-launch: {times['fused (one launch)'] / base:.3f}")


if __name__ == "__main__":
    main()
