"""Measured peak memory of a forward without autograd against the inference memory plan, and its tokens/s.

One forward of a K3-family model (default: the `small` variant, 1.5 B parameters), target triton, bf16, B = 1,
under torch.no_grad, at each T: torch.cuda.max_memory_allocated() over the forward beside the plan (the weights
plus the program's peak of live buffers plus the peak launch's workspace: ``m.plan_memory``), the runtime's
reported peak of live buffers (``m.last_run.peak_bytes``), and tokens/s (median of CUDA-event timings). A T that
runs out of memory is reported as such. Runs with the code of the tree it is started from, so that an older
checkout (``PYTHONPATH=<old tree>``) measures the same way; without the plan API the plan columns stay empty.

Usage (a CUDA GPU):  python benchmarks/memory.py [--variant small] [--seq-lens 8192 65536 262144]
                     [--repeats 3] [--json FILE] [--no-inplace]

``--no-inplace`` compiles with ``inplace=False`` (every output in its own storage; passes/lower.py), for the
before / after of in-place reuse.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def measure(variant: str, seq_lens: list[int], repeats: int, per_launch: bool = True,
            inplace: bool = True) -> list[dict]:
    import dsl
    g = dsl.load("models/kimi_k3.mtc", variant=variant)
    m = dsl.compile(g, target="triton", dtype=torch.bfloat16, device="cuda", seed=0,
                    **({} if inplace else {"inplace": False})).eval()
    weights = sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
    rows = []
    for T in seq_lens:
        row = {"T": T, "weights": weights}
        ids = torch.randint(0, 256, (1, T), device="cuda")
        try:
            with torch.no_grad():
                m(ids)                                   # warm-up: kernels compiled, caches filled
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                times = []
                for _ in range(repeats):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    m(ids)
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b) / 1e3)
            row["max_allocated"] = torch.cuda.max_memory_allocated()
            row["base"] = base
            row["seconds"] = sorted(times)[len(times) // 2]
            row["tokens_per_s"] = T / row["seconds"]
            if hasattr(m, "plan_memory"):
                live, with_ws = m.plan_memory(B=1, T=T)
                row["plan_live"], row["plan_workspace"] = live, with_ws - live
                row["reported_peak"] = m.last_run.peak_bytes
                if per_launch:
                    row["workspace_by_kernel"] = _workspace_by_kernel(m, ids)
        except torch.OutOfMemoryError as e:
            row["oom"] = str(e).split("\n")[0][:200]
        rows.append(row)
        del ids
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
    return rows


def _workspace_by_kernel(m, ids) -> dict:
    """{implementation: the most bytes one of its launches allocated inside itself} (backends.memory.measured_workspace)."""
    from backends.memory import measured_workspace
    out: dict = {}
    for i, ws in measured_workspace(m, input_ids=ids).items():
        k = m.program.launches[i].kernel
        out[k] = max(out.get(k, 0), ws)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def table(rows: list[dict]) -> str:
    gib = 2 ** 30
    out = ["| T | tokens/s | max allocated GiB | plan GiB (weights + live + workspace) | measured / plan | "
           "reported live GiB | plan live GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "oom" in r:
            out.append(f"| {r['T']:,} | out of memory | | | | | |")
            continue
        plan = r["weights"] + r.get("plan_live", 0) + r.get("plan_workspace", 0) if "plan_live" in r else None
        out.append(f"| {r['T']:,} | {r['tokens_per_s']:,.0f} | {r['max_allocated'] / gib:.2f} | "
                   + (f"{plan / gib:.2f} ({r['weights'] / gib:.2f} + {r['plan_live'] / gib:.2f} + "
                      f"{r['plan_workspace'] / gib:.2f}) | {r['max_allocated'] / plan:.3f} | "
                      f"{r['reported_peak'] / gib:.2f} | {r['plan_live'] / gib:.2f} |" if plan else "| | | |"))
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="small")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536, 262144])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    ap.add_argument("--no-per-launch", action="store_true", help="skip the per-launch workspace measurement")
    ap.add_argument("--no-inplace", action="store_true", help="compile with inplace=False (no in-place reuse)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/memory.py needs a CUDA GPU")
    t0 = time.time()
    rows = measure(args.variant, args.seq_lens, args.repeats, not args.no_per_launch, not args.no_inplace)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
