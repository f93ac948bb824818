"""End-to-end forward throughput of a K3-family model: mtc target="triton" vs the same model in eager
PyTorch (reference ops, with fla-core 0.6.0's kernels where fla has them: chunk_kda, fused_attnres) and
vs torch.compile of that eager model. One process, the same weights, bf16, B = 1.

Columns: tokens/s (median of CUDA-event timings), the relative RMS difference of the logits against a
float32 reference (the same graph, target="reference", float32, same weights) and against the eager+fla
model, and the speed-up of mtc over each baseline (last line).

Tolerance: a routed MoE at random initialisation has near-tied router scores, so bf16 rounding of the hidden
state flips some top-k choices and the logits of ANY bf16 implementation move far from float32 (the small
variant on the CPU, reference ops: 0.85 after 12 layers, the first MoE layer's output alone 0.19).  The bf16
yardstick is therefore the eager+fla model's own error against the float32 reference: mtc's should be of
the same size.

Usage (a CUDA GPU; benchmarks/README.md):  python benchmarks/e2e.py [--variant small] [--quick]
                      [--seq-lens 8192 65536] [--no-compile] [--out benchmarks/results/e2e.md]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def eager_fla_table():
    """Reference ops, but GEMMs/SDPA in bf16 and fla-core's chunk_kda and fused_attnres."""
    import torch.nn.functional as F
    from fla.ops.attnres import fused_attnres
    from fla.ops.kda import chunk_kda

    from backends.runtime import _reference_table
    from backends.triton.mla import mla_attention
    t = _reference_table()
    t["linear"] = lambda n, x, w: F.linear(x, w)
    t["lm_head"] = lambda n, x, w: F.linear(x, w)
    t["mla_attention"] = lambda n, q, k, v: mla_attention(q, k, v, scale=n.attr("scale"), causal=n.attr("causal"))
    t["kda_chunk"] = lambda n, q, k, v, g, b: chunk_kda(q, k, v, g, b, scale=n.attr("scale"), safe_gate=True,
                                                        lower_bound=n.attr("lower_bound"))[0]
    t["attn_residual"] = lambda n, q, w, *s: fused_attnres(q, list(s), w, rms_eps=n.attr("eps"))
    return t


def _time(m, ids, dev) -> float:
    """Seconds for one forward: CUDA events on the GPU, a wall clock on the CPU."""
    if dev == "cpu":
        t = time.perf_counter()
        m(ids)
        return time.perf_counter() - t
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    m(ids)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="small", help="variant of models/kimi_k3.mtc (default small)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536],
                    help="sequence lengths T, batch 1 (default 8192 65536)")
    ap.add_argument("--quick", action="store_true", help="T = 2048 only (replaces --seq-lens), few repeats")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--no-ref32", action="store_true", help="skip the float32 reference (error column left empty)")
    ap.add_argument("--out", default=None, help="write the table (markdown) here")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check this script's control flow on the CPU: tiny variant, float32, Triton interpreter, "
                         "reference ops in place of fla, no torch.compile (numbers meaningless)")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("e2e benchmark: needs a CUDA GPU and fla-core (--cpu-smoke checks this script's control flow on "
                 "the CPU)")
    given = [f for f, d in (("--variant", "variant"), ("--seq-lens", "seq_lens")) if getattr(args, d) != ap.get_default(d)]
    if args.quick:
        if "--seq-lens" in given:
            print("note: --quick times T = 2048 only; --seq-lens is not used", flush=True)
        args.seq_lens = [2048]
    if args.cpu_smoke:
        import os
        if given:
            print(f"note: --cpu-smoke runs the tiny variant at T = 64; {' and '.join(given)} not used", flush=True)
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.variant, args.seq_lens, args.no_compile = "tiny", [64], True

    import dsl
    from backends import runtime
    runtime.TARGETS["eager_fla"] = runtime._reference_table if args.cpu_smoke else eager_fla_table
    dev = "cpu" if args.cpu_smoke else "cuda"
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", args.variant)
    t0 = time.perf_counter()
    mtc = dsl.compile(g, target="triton", dtype=dtype, device=dev).eval()
    eager = dsl.compile(g, target="eager_fla", dtype=dtype, device=dev,
                        passes=["verify", "infer_shapes", "canonicalize"]).eval()
    eager.load_state_dict(mtc.state_dict())
    from dsl.stats import human
    print(f"{g.name}: {human(sum(p.numel() for p in mtc.parameters()))} parameters; compiled in "
          f"{time.perf_counter() - t0:.1f} s; kernels: {mtc.kernel_source_path}", flush=True)
    ref32 = None
    if not args.no_ref32:
        ref32 = dsl.compile(g, target="reference", dtype=torch.float32, device=dev,
                            passes=["verify", "infer_shapes", "canonicalize"]).eval()
        ref32.load_state_dict({k_: v_.float() if v_.is_floating_point() else v_
                               for k_, v_ in mtc.state_dict().items()})
    # (--cpu-smoke: the eager model runs reference ops, not fla's kernels: named so in the table)
    eager_name = "eager (reference ops, cpu-smoke)" if args.cpu_smoke else "eager + fla"
    models = {"mtc triton": mtc, eager_name: eager}
    if not args.no_compile:
        from torch import _dynamo
        # one graph break per router layer (the QB statistics hook): let every layer compile
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(_dynamo.config, knob):
                setattr(_dynamo.config, knob, 256)
        models["torch.compile(eager + fla)"] = torch.compile(eager, dynamic=False)
    rows = []
    for T in args.seq_lens:
        ids = torch.randint(0, 256, (1, T), device=dev)
        with torch.no_grad():
            ref = eager(ids).float()
            r32 = None
            if ref32 is not None:
                try:
                    r32 = ref32(ids).float()
                except torch.OutOfMemoryError:
                    print(f"T={T}: float32 reference out of memory; column left empty", flush=True)
                if dev == "cuda":
                    torch.cuda.empty_cache()
            for name, m in models.items():
                for _ in range(1 if args.cpu_smoke else 2):
                    out = m(ids)
                times = []
                for _ in range(1 if args.cpu_smoke else 3 if args.quick else 5):
                    times.append(_time(m, ids, dev))
                t = sorted(times)[len(times) // 2]
                err = ((out.float() - ref).norm() / ref.norm()).item()
                e32 = ((out.float() - r32).norm() / r32.norm()).item() if r32 is not None else None
                rows.append((T, name, t, T / t, e32, err))
                print(f"T={T:>6} {name:<28} {t * 1e3:9.1f} ms {T / t:12,.0f} tok/s  err vs f32 {_e(e32)}  "
                      f"vs eager {err:.2e}", flush=True)
            del r32
    lines = ["| T | model | ms | tokens/s | logits rel. err vs float32 reference | vs eager+fla |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {T} | {n} | {t * 1e3:.1f} | {tps:,.0f} | {_e(e32)} | {e:.2e} |" for T, n, t, tps, e32, e in rows]
    for T in args.seq_lens:
        r = {n: t for TT, n, t, _, _, _ in rows if TT == T}
        lines.append(f"\nT={T}: mtc speed-up: " + ", ".join(f"{r[n] / r['mtc triton']:.2f}x vs {n}"
                                                            for n in r if n != "mtc triton"))
    text = "\n".join(lines)
    print(text)
    if args.out:
        where = (torch.cuda.get_device_name() if dev == "cuda" else
                 "CPU smoke run (Triton interpreter: the times and ratios mean nothing)")
        Path(args.out).write_text(f"# e2e forward, {g.name}, {str(dtype).removeprefix('torch.')}, B=1, {where}\n\n"
                                  f"{text}\n")


def _e(x):
    """An error cell: '-' where the float32 reference was not run (--no-ref32, or out of memory)."""
    return "-" if x is None else f"{x:.2e}"


if __name__ == "__main__":
    main()
