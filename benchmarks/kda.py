"""Benchmark: mtc's Triton kda_chunk vs fla-core 0.6.0 chunk_kda, one process (by default both promised the bound -5).

B=1, K=V=128, bf16 q/k/v/beta, float32 g from the lower-bounded sigmoid gate (g in [-5, 0)), random data.
Times are medians of triton.testing.do_bench (CUDA events).  Columns:
  FLOPs  nominal dense work of the chunked algorithm (C=64): forward 6CK + 4CV + 6KV per token and head
         (intra Akk/P/Wk/U, state W/O/update); forward+backward counted as 3.5x the forward.
  bytes  the fewest bytes a forward must move: q, k, v, beta, o in bf16 and g in float32, once each
         (1538 B per token and head); forward+backward adds re-reading the inputs, dO and writing
         dq, dk, dv, dbeta (bf16) and dg (float32): 4358 B per token and head.
  TF/s, TB/s, %mm, %bw  achieved rates and their fraction of the H200 limits (bf16 matmul 720 TFLOP/s,
         device copy 4.2 TB/s).
  err    relative RMS difference of o between the two implementations (every 16th token at T >= 256K).
Diagnostics: --phases prints the time of each phase of mtc's forward (and backward, in the fwd+bwd rows; CUDA events
at the phase boundaries, backends.triton.kda.KdaConfig.profile: intra (cumsum, strip, solve), w/u, segment maps +
combine, serial state pass, o; a forward that runs as the pipeline (one sequence from 64K tokens, KdaConfig.pipeline)
overlaps them and reports one "pipelined forward" phase: --timeline shows its kernels per stream); --sweep times the
mtc forward at the largest case for several segment counts and state-pass launch settings.  --set changes launch
settings (KdaConfig fields) for the whole run, --alt adds rows with other settings beside the default's.
Usage (a CUDA GPU, fla-core 0.6.0 installed: pip install fla-core==0.6.0; benchmarks/README.md):
  python benchmarks/kda.py [--quick] [--out benchmarks/results/kda.md]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

# expandable segments in torch's caching allocator (unless PYTORCH_CUDA_ALLOC_CONF is set): our forward+backward
# alone peaks at 132.7 GiB of the H200's 139 at T = 1M, H = 16 (sixth session), after fla's cases have run in the
# same process; set before torch initialises CUDA
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

MM_PEAK = 720e12
BW_PEAK = 4.2e12


def flops_fwd(T, H, K=128, V=128, C=64):
    return T * H * (6 * C * K + 4 * C * V + 6 * K * V)


def bytes_fwd(T, H, K=128, V=128):
    return T * H * (2 * K + 2 * K + 2 * V + 4 * K + 2 + 2 * V)


def bytes_fwdbwd(T, H, K=128, V=128):
    return bytes_fwd(T, H, K, V) + T * H * ((2 * K + 2 * K + 2 * V + 4 * K + 2) + 2 * V
                                            + (2 * K + 2 * K + 2 * V + 4 * K + 2))


#: --gate: which gate the inputs come from and what both implementations are told (set by main)
GATES = {
    "bounded": "g = -5 sigmoid(2 randn) in [-5, 0); both promised the bound -5 (fla: safe_gate=True, lower_bound=-5)",
    "none": "the same g; no bound promised to either (mtc: lower_bound=None; fla: plain chunk_kda)",
    "softplus": "Kimi Linear's gate at its initialisation, g = -exp(A_log) softplus(randn + dt_bias), A_log = "
                "log U(1, 16) per head, dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1] per channel "
                "(g down to about -33 at H 16, 8K tokens); no bound promised",
}
GATE = "bounded"


def gate_kwargs():
    """(fla chunk_kda keywords, mtc kda_chunk keywords) for the --gate in force."""
    if GATE == "bounded":
        return dict(safe_gate=True, lower_bound=-5.0), dict(lower_bound=-5.0)
    return {}, dict(lower_bound=None)


def make(T, H, K=128, V=128, device="cuda"):
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=device), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=device), dim=-1).bfloat16()
    v = torch.randn(1, T, H, V, device=device).bfloat16()
    if GATE == "softplus":
        a_log = torch.log(torch.empty(H, device=device).uniform_(1, 16))
        dt = torch.exp(torch.empty(H * K, device=device).uniform_(math.log(1e-3), math.log(0.1)))
        dt_bias = dt + torch.log(-torch.expm1(-dt))          # softplus^-1(dt)
        x = torch.randn(1, T, H, K, device=device) + dt_bias.view(H, K)
        g = -torch.exp(a_log)[:, None] * torch.nn.functional.softplus(x)
    else:
        g = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, device=device) * 2)
    beta = torch.rand(1, T, H, device=device).bfloat16()
    return q, k, v, g, beta


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="H=16 and T in {8192, 65536} only")
    ap.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    ap.add_argument("--rep", type=int, default=300, help="do_bench repetition budget in ms")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--phases", action="store_true",
                    help="per-phase times of the mtc forward (and backward, in the fwd+bwd rows)")
    ap.add_argument("--sweep", action="store_true",
                    help="mtc forward at the largest case over segment counts / state-kernel settings")
    ap.add_argument("--set", action="append", default=[], metavar="key=value,...",
                    help="launch settings for the whole run: fields of backends.triton.kda.KdaConfig, e.g. "
                         "--set bk_strip32=64,nw_strip32=8 (repeatable; values are Python literals)")
    ap.add_argument("--alt", action="append", default=[], metavar="key=value,...",
                    help="also time the default with these settings (same syntax as --set), one extra row per case "
                         "and pass tagged [alt N], e.g. --alt bv=64 (repeatable)")
    ap.add_argument("--timeline", action="store_true",
                    help="per-kernel timeline of one mtc forward at the largest case: CUDA events around every "
                         "launch on the stream it is queued on (the pipelined forward runs two streams); per "
                         "kernel the summed time, first start and last end, and each state pass's interval")
    ap.add_argument("--no-fwd", action="store_true", help="forward+backward rows only")
    ap.add_argument("--only", choices=("fla", "mtc"), default=None,
                    help="time one implementation only (the other's columns print '-'): for rows where both do "
                         "not fit in one process's memory (forward+backward at H=16, T=1M), run one process each "
                         "on the same machine")
    ap.add_argument("--gate", choices=tuple(GATES), default="bounded",
                    help="the gate of the inputs and the bound promised: "
                         + "; ".join(f"{k}: {v}" for k, v in GATES.items()))
    ap.add_argument("--cases", default=None,
                    help="comma-separated H:T pairs, e.g. 16:8192,96:65536 (default: the full list)")
    args = ap.parse_args()
    global GATE
    GATE = args.gate
    try:
        settings = {}
        for item in args.set:
            settings.update(parse_settings(item))
        alts = [parse_settings(item) for item in args.alt]
    except ValueError as e:
        ap.error(f"--set / --alt: {e}")
    if args.rep <= 0:
        ap.error(f"--rep: expected a positive number of milliseconds, got {args.rep}")
    if args.cases:
        try:
            cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
        except ValueError:
            cases = []
        if not cases or any(len(c) != 2 or c[0] < 1 or c[1] < 1 for c in cases):
            ap.error(f"--cases: expected comma-separated H:T pairs of positive integers (e.g. 16:8192,96:65536), "
                     f"got {args.cases!r}")
    elif args.quick:
        cases = [(16, 8192), (16, 65536)]
    else:
        cases = [(16, 8192), (16, 65536), (16, 262144), (16, 1048576),
                 (96, 8192), (96, 65536), (96, 262144)]
    if not torch.cuda.is_available():
        sys.exit("kda benchmark: needs a CUDA GPU (and fla-core 0.6.0 for the baseline: pip install "
                 "fla-core==0.6.0); see benchmarks/README.md")
    import triton
    from fla.ops.kda import chunk_kda
    import backends.triton.kda as tk
    from backends.triton.kda import kda_chunk
    with tk.config(**settings):
        return run(args, cases, settings, alts, triton, chunk_kda, tk, kda_chunk)


def run(args, cases, settings, alts, triton, chunk_kda, tk, kda_chunk):
    """The table of main(), with the --set settings in force."""

    def write():
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    dev = torch.cuda.get_device_name()
    lines = [f"# kda_chunk vs fla-core 0.6.0 chunk_kda on {dev} (B=1, K=V=128, bf16; gate {GATE}: {GATES[GATE]})",
             "",
             "| H | T | pass | fla ms | mtc ms | speed-up | GFLOP | GB | mtc TF/s | %mm | mtc TB/s | %bw | err o |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    if settings:
        lines[1:1] = [f"launch settings changed (--set): {settings}", ""]
    for n, alt in enumerate(alts, 1):
        lines[1:1] = [f"[alt {n}]: the default with {alt}", ""]
    print("\n".join(lines), flush=True)
    ratios = {}
    warm_up(None if args.only == "mtc" else chunk_kda, None if args.only == "fla" else kda_chunk, cases[0][1],
            cases[0][0], grad=wants_bwd(*cases[0], args.no_bwd))
    for H, T in cases:
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd+bwd" and not wants_bwd(H, T, args.no_bwd):
                continue
            if mode == "fwd" and args.no_fwd:
                continue
            try:
                q, k, v, g, beta = make(T, H)
                grad = mode == "fwd+bwd"
                do = None
                if grad:
                    for t in (q, k, v, g, beta):
                        t.requires_grad_()
                    do = torch.randn(1, T, H, 128, device="cuda").bfloat16()

                def run_fla():
                    o, _ = chunk_kda(q, k, v, g, beta, **gate_kwargs()[0])
                    if grad:
                        o.backward(do)
                    return o

                def run_mtc():
                    o, _ = kda_chunk(q, k, v, g, beta, **gate_kwargs()[1])
                    if grad:
                        o.backward(do)
                    return o

                res = {}
                with torch.no_grad() if not grad else torch.enable_grad():
                    gn = [q, k, v, g, beta] if grad else None
                    # the error column compares every STRIDE-th token (all of them below 256K): at 1M a full
                    # copy of fla's output (4.3 GB) and its gradients left our forward+backward (~130 GB alone)
                    # short of memory in the same process (9th session)
                    stride = 1 if T < 262144 else 16
                    o1, t_fla = None, float("nan")
                    if args.only != "mtc":
                        o1 = run_fla().detach()[:, ::stride].clone()
                        t_fla = triton.testing.do_bench(run_fla, warmup=50, rep=args.rep, grad_to_none=gn,
                                                        return_mode="median")
                    if grad:
                        for t in gn:
                            t.grad = None
                        torch.cuda.empty_cache()
                    # one row with the settings in force, one per --alt
                    variants = list(enumerate([{}] + alts))
                    if args.only == "fla":
                        variants = []
                        res["fla only"] = (float("nan"), float("nan"))
                    for alt, changes in variants:
                        with tk.config(**changes):
                            o2 = run_mtc().detach()
                            err = rel(o2[:, ::stride], o1) if o1 is not None else float("nan")
                            del o2
                            if grad:
                                for t in gn:
                                    t.grad = None
                            t_mtc = triton.testing.do_bench(run_mtc, warmup=50, rep=args.rep, grad_to_none=gn,
                                                            return_mode="median")
                            # phases under the row's own settings
                            ph = phases(tk, kda_chunk, T, H, bwd=grad) if args.phases else None
                        key = f"alt {alt}" if alt else "default"
                        res[key] = (t_mtc, err) + ((ph,) if ph else ())
                    del o1
            except torch.OutOfMemoryError as e:  # noqa: PERF203
                who = f" ({args.only} only)" if args.only else ""
                lines.append(f"| {H} | {T} | {mode}{who} | out of memory: {' '.join(str(e).split())[:300]} |")
                print(lines[-1], flush=True)
                write()
                continue
            finally:
                q = k = v = g = beta = do = None
                torch.cuda.empty_cache()
            fl = flops_fwd(T, H) * (3.5 if grad else 1.0)
            by = bytes_fwdbwd(T, H) if grad else bytes_fwd(T, H)
            for impl, (t_mtc, err, *ph) in res.items():
                tf, tb = fl / (t_mtc * 1e-3), by / (t_mtc * 1e-3)
                tag = f" [{impl}]" if alts else ""
                if args.only:
                    tag += f" ({args.only} only: the other in its own process)"
                f3 = lambda x, fmt, unit="": "-" if math.isnan(x) else format(x, fmt) + unit  # noqa: E731
                line = (f"| {H} | {T} | {mode}{tag} | {f3(t_fla, '.3f')} | {f3(t_mtc, '.3f')} | "
                        f"{f3(t_fla / t_mtc, '.2f', 'x')} | {fl / 1e9:.0f} | {by / 1e9:.2f} | {f3(tf / 1e12, '.1f')} | "
                        f"{f3(100 * tf / MM_PEAK, '.1f', '%')} | {f3(tb / 1e12, '.2f')} | "
                        f"{f3(100 * tb / BW_PEAK, '.1f', '%')} | {f3(err, '.1e')} |")
                print(line, flush=True)
                lines.append(line)
                if not args.only:
                    ratios[(H, T, mode, impl)] = t_fla / t_mtc
                if ph:
                    lines.append(f"|   | phases ({'bwd ' if grad else ''}{impl}) H={H} T={T} | {ph[0]} |")
                    print(lines[-1], flush=True)
                write()
    if args.timeline and cases:
        H, T = max(cases, key=lambda c: c[0] * c[1])
        lines += ["", f"timeline of one mtc forward at H={H} T={T} (ms from the call's start):"]
        for item in timeline(tk, kda_chunk, T, H):
            lines.append("- " + item)
            print(lines[-1], flush=True)
        write()
    if args.sweep and cases:
        H, T = max(cases, key=lambda c: c[0] * c[1])
        lines += ["", f"sweep of the mtc forward at H={H} T={T} (ms; seg = chunks per segment, None = model):"]
        for item in sweep(tk, kda_chunk, T, H, triton):
            lines.append("- " + item)
            print(lines[-1], flush=True)
            write()
    parts = []
    groups = ([("forward rows", ("fwd",), "default"), ("fwd+bwd rows", ("fwd+bwd",), "default")]
              + [(f"alt {n}", ("fwd", "fwd+bwd"), f"alt {n}") for n in range(1, len(alts) + 1)])
    for what, modes, impl in groups:
        rs = [r for key, r in ratios.items() if key[3] == impl and key[2] in modes]
        if not rs:
            continue
        gm = math.exp(sum(math.log(r) for r in rs) / len(rs))
        big = ratios.get((16, 1048576, "fwd", impl)) if "fwd" in modes else None
        parts.append(f"{what}: geometric mean {gm:.2f}x over {len(rs)} rows, min {min(rs):.2f}x"
                     + (f", at H=16 T=1M fwd {big:.2f}x" if big else ""))
    last = "ratio fla/mtc (speed-up, >1 = mtc faster): " + ("; ".join(parts) or "no side-by-side rows")
    lines += ["", last]
    print("\n" + last, flush=True)
    write()


def wants_bwd(H, T, no_bwd):
    """Whether the case gets a forward+backward row (memory: not past 8M token-heads at H=96 or 16M at all)."""
    return not (no_bwd or H * T > 16 * 1048576 // 2 and H == 96 or H * T > 16 * 1048576)


def warm_up(chunk_kda, kda_chunk, T, H, grad, seconds=3.0):
    """Bring the GPU to its steady clocks and both implementations (one when the other is None: --only) past
    compilation and autotuning before the first timed row (H200, 2026-11-30: on a freshly started machine the
    first row's fla time came out 2x its steady value, 1.14-1.18 ms instead of 0.57 at H=16, T=8192, and fla's
    first forward+backward, autotuned in the same process, 3.19 ms instead of 2.27). Runs at T capped to 65536:
    compilation and autotuning do not depend on T, and at 1M a forward+backward of each implementation here left
    too little memory for the rows (9th session: fla's backward ran out of memory with 132 GiB in use)."""
    T = min(T, 65536)
    q, k, v, g, beta = make(T, H)
    if grad:
        for t in (q, k, v, g, beta):
            t.requires_grad_()
    do = torch.randn(1, T, H, 128, device="cuda").bfloat16()
    # clocks first, then the first calls: fla autotunes in its first call, and the 9th session's runs (warm-up in
    # the other order) still gave fla's first row 2x its steady time (1.24-1.26 ms at H=16, T=8192): a choice timed
    # on a cold GPU is kept for the whole process
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    fk, mk = gate_kwargs()
    fns = [fn for impl, fn in ((chunk_kda, lambda: chunk_kda(q, k, v, g, beta, **fk)),
                               (kda_chunk, lambda: kda_chunk(q, k, v, g, beta, **mk))) if impl is not None]
    for reps in (1, 3):
        for fn in fns:
            for _ in range(reps):
                o, _ = fn()
                if grad:
                    o.backward(do)
                del o
    torch.cuda.synchronize()
    q = k = v = g = beta = do = a = None  # (not del: the calls above close over these names)
    torch.cuda.empty_cache()


def parse_settings(item):
    """One --set / --alt item 'key=value,...' -> {KdaConfig field: value} (ValueError naming the problem)."""
    import ast
    import dataclasses
    from backends.triton.kda.settings import KdaConfig
    fields = [f.name for f in dataclasses.fields(KdaConfig) if f.name != "profile"]
    out = {}
    for kv in filter(None, (x.strip() for x in item.split(","))):
        key, eq, val = kv.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            raise ValueError(f"expected key=value,... with keys of backends.triton.kda.KdaConfig "
                             f"({', '.join(fields)}), got {kv!r} in {item!r}")
        try:
            out[key] = ast.literal_eval(val.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"{key}: {val!r} is not a Python literal") from None
    try:
        KdaConfig(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{item!r}: {e}") from None
    return out


def phases(tk, kda_chunk, T, H, reps=5, bwd=False):
    """Median time of each mtc forward phase (ms) over a few calls, as 'name a.bc, ...'; with bwd, of the
    forward and the backward (the backward's phases start at 'bwd: ...')."""
    q, k, v, g, beta = make(T, H)
    per = {}
    if bwd:
        for t in (q, k, v, g, beta):
            t.requires_grad_()
        do = torch.randn(1, T, H, 128, device="cuda").bfloat16()
    with torch.enable_grad() if bwd else torch.no_grad():
        for _ in range(reps):
            ev = []
            with tk.config(profile=ev):
                o, _ = kda_chunk(q, k, v, g, beta, **gate_kwargs()[1])
                if bwd:
                    o.backward(do)
            torch.cuda.synchronize()
            for (_, a), (name, b) in zip(ev[:-1], ev[1:]):
                per.setdefault(name, []).append(a.elapsed_time(b))
    return ", ".join(f"{n} {sorted(x)[len(x) // 2]:.2f}" for n, x in per.items())


class _TimedKernel:
    """Stands in for a Triton kernel of backends.triton.kda's modules: kernel[grid](...) launches it between two
    CUDA events recorded on the current stream, logged as (name, start, end)."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*a, **kw):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            self.kernel[grid](*a, **kw)
            e1.record()
            self.log.append((self.name, e0, e1))
        return launch


def timeline(tk, kda_chunk, T, H):
    """One mtc forward (after a warm-up call) with every forward kernel launch timed by events on its own
    stream: lines of per-kernel sums (ms), first start and last end relative to the call's start, and the
    state passes' intervals (one per piece of the pipelined forward)."""
    q, k, v, g, beta = make(T, H)
    names = ("_chunk_cumsum_kernel", "_intra_strip16_kernel", "_intra_strip32_kernel", "_wy_solve_kernel",
             "_wy_apply_kernel", "_state_pass_kernel", "_combine_kernel", "_output_kernel")
    # every module of the package that launches one (each looks the kernel up in its own namespace)
    mods = [m for name, m in sorted(sys.modules.items()) if name.startswith(tk.__name__ + ".")]
    log = []
    orig = [(m, n, getattr(m, n)) for m in mods for n in names if hasattr(m, n)]
    try:
        for m, n, fn in orig:
            setattr(m, n, _TimedKernel(fn, n, log))
        with torch.no_grad():
            kda_chunk(q, k, v, g, beta, **gate_kwargs()[1])
            torch.cuda.synchronize()
            log.clear()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            kda_chunk(q, k, v, g, beta, **gate_kwargs()[1])
            e.record()
            torch.cuda.synchronize()
    finally:
        for m, n, fn in orig:
            setattr(m, n, fn)
    out = [f"whole forward {s.elapsed_time(e):.2f} ms (with the events)"]
    spans = {}
    for n, a, b in log:
        spans.setdefault(n, []).append((s.elapsed_time(a), s.elapsed_time(b)))
    for n, iv in spans.items():
        out.append(f"{n}: {len(iv)} launches, {sum(b - a for a, b in iv):.2f} ms in all, first start {iv[0][0]:.2f}, "
                   f"last end {iv[-1][1]:.2f}")
    if "_state_pass_kernel" in spans:
        out.append("state passes: " + ", ".join(f"{a:.1f}-{b:.1f}" for a, b in spans["_state_pass_kernel"]))
    return out


def sweep(tk, kda_chunk, T, H, triton):
    """Forward times over segment lengths and state-pass launch settings (KdaConfig fields)."""
    q, k, v, g, beta = make(T, H)
    n = (T + 63) // 64
    out = []
    # (settings, segment lengths): the settings in force over several splits, then variants unsplit and at the
    # model's choice (stages_one_wave: stages of a pass with at most one program per SM)
    base = {}
    splits = [math.ceil(n / ns) for ns in (2, 8, 33) if ns < n]
    cfgs = [(base, [None, 1 << 30] + splits),
            (dict(stages_one_wave=2), [1 << 30]),
            (dict(stages_one_wave=4), [1 << 30]),
            (dict(state_warps=2), [1 << 30]),
            (dict(state_warps=8), [1 << 30]),
            (dict(bv=32), [1 << 30])]
    for cfg, segs in cfgs:
        with tk.config(**cfg):
            for seg in segs:
                with torch.no_grad():
                    def f():
                        return kda_chunk(q, k, v, g, beta, **gate_kwargs()[1], segment_chunks=seg)
                    f()
                    t = triton.testing.do_bench(f, warmup=20, rep=60, return_mode="median")
                out.append(f"{cfg or 'default'}: seg={seg if seg != 1 << 30 else 'off'}: {t:.2f} ms")
    return out


if __name__ == "__main__":
    sys.exit(main())
