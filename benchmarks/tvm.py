"""Benchmark: the TVM backend's kernels (backends/tvm) on the H200, built here, run there with TVM's runtime only.

Two phases, on two machines (issue 7: compile once, deploy without the compiler):

1. ``python benchmarks/tvm.py --export [DIR]`` on the build machine (the full TVM, no GPU needed):
   builds the TVM kernels of the K3 memory-bound groups for ``{"kind": "cuda", "arch": "sm_90"}``
   (backends/tvm/build.py: schedule + tvm.compile + export_library, through the on-disk cache) and copies
   each exported library into DIR (default ``.device/tvm_kernels``; ``.device/`` is git-ignored and
   carried to the GPU machine with carry=[".device"]), with ``manifest.json`` (op, attributes, dtypes,
   exported symbol, target, TVM version, size). Fails if the libraries exceed 30 MB in all.
   Groups (bf16, K3 widths, spec/MODEL.md): rmsnorm d=7168; situ_glu at the dense FFN width 33792;
   attn_residual d=7168 with L in {2, 8, 16, 25}; short_conv C=12288 (KDA q/k/v, 96 x 128) W=4;
   l2norm d=128 (one KDA head). Each group is exported in the schedule variants of VARIANTS below (the
   first is backends/tvm's default; the others' keys carry a __<attributes> suffix): what is fastest
   can only be measured, so one --run times them all. attn_residual's default is the pipelined kernel
   (hand-written TensorIR: a cp.async ring of source rows in shared memory; backends/tvm/attn_kernels
   PIPELINED_STAGES / PIPELINED_GROUP); the one-pass kernel (the fallback for rows without a whole-warp layout)
   and other pipelined settings are variants, checked against the reference in the same run like every module.
   The export fails if a generated CUDA source writes shared memory from every thread without a guard
   (backends.tvm.build.shared_write_hazards: the race of the first one-pass build).

2. ``python benchmarks/tvm.py --run [DIR]`` on the GPU machine, after ``source .device/prelude.sh``
   (runtime-only TVM: TVM_USE_RUNTIME_LIB=1, no tvm.compile; the CUDA source inside each module is
   compiled by NVRTC for sm_90 when it is loaded). For every module of the manifest: load it
   (``backends.tvm.build.load``), call it on CUDA torch tensors through DLPack on torch's stream, check it
   against backends.reference at real sizes (N = 16384 tokens; relative RMS error), and time it
   (triton.testing.do_bench, median) in the same process next to the Triton kernel of the same group:
     rmsnorm, l2norm  the kernel backends/triton/codegen.py generates for a lone rmsnorm / l2norm
                      launch (compiled here from a one-op graph with dsl.compile), launched with
                      codegen.launch (a [ROWS, BLOCK_D] tile per program, ROWS = 4096 // BLOCK_D);
     situ_glu         backends.triton.moe.situ_glu (the project's Triton kernel);
     attn_residual    backends.triton.attn_residual.attn_residual (one-pass online-softmax kernel);
     short_conv       a tiled causal depthwise-conv Triton kernel defined below (the project has none).
   The floor is the memory-traffic floor: bytes read + written once / 4.2 TB/s (device copy). The table
   (op, variant, shape, MB moved, TVM ms, Triton ms, floor ms, TVM/Triton, TVM TB/s, %copy BW of both,
   errors; the Triton kernel is timed once per group) is followed by the best variant of each group
   (among those within tolerance), their geometric mean and worst ratio (target: every group within
   1.25x), and the geometric mean of the default variants.
   The process exits with status 1 if any error is over its tolerance (bf16: 1e-2).

``--cpu-smoke`` (with either phase) exercises the same path without a GPU: --export builds
``{"kind": "llvm"}`` float32 modules at the same widths into DIR (default ``.device/tvm_kernels_cpu``),
and --run loads them, calls them on CPU tensors at a tiny token count, compares them with the reference,
and runs the Triton kernels under TRITON_INTERPRET=1 (timings then mean nothing).

GPU run (one command; results come back under $OUT):
  source .device/prelude.sh; PYTHONUNBUFFERED=1 python benchmarks/tvm.py --run .device/tvm_kernels \
      --out $OUT/tvm.md
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# this file is named tvm.py: drop its own folder from the import path, or `import tvm` would import it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

COPY_NOMINAL = 4.2e12              # H200 device copy, bytes / s (read + written)
SIZE_LIMIT = 30 * 1024 * 1024      # exported libraries, all together
EPS = 1e-6
BETA_GATE, BETA_UP = 4.0, 25.0
D_MODEL = 7168
FFN_DENSE = 33792                  # dense-layer SiTU-GLU intermediate (spec/MODEL.md)
CONV_C, CONV_W = 12288, 4          # KDA q/k/v short conv: 96 heads x 128, width 4
HEAD_DIM = 128
HEADS = 96
ATTN_LS = (2, 8, 16, 25)
TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}
LINES: list[str] = []


OUT_MD: list = []                 # the --out file, rewritten after every line (a run cut short keeps its part)


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    if OUT_MD:
        OUT_MD[0].write_text("\n".join(LINES) + "\n")


# ----------------------------------------------------------------------------------------------------
# the groups (pure Python: the same list drives both phases)
# ----------------------------------------------------------------------------------------------------

# schedule variants per group (the first is the default of backends/tvm; --run times all of them and
# prints the best per group): attribute overrides for kernel_for
VARIANTS = {
    # defaults = the best variants of the H200 run of 2026-11-29 (benchmarks/results/tvm.md): rmsnorm
    # threads 448 (two vectors per thread), short_conv vec 2 / 256 threads / 8 steps; the old defaults
    # stay as variants so that a run shows the difference
    "rmsnorm": [{}, {"threads": 896}, {"vec": 1, "threads": 256}],
    "situ_glu": [{}, {"unroll": 2}, {"threads": 128, "unroll": 4}],
    # the one-pass kernel with its default schedule (attn_kernels.onepass_defaults, the fallback), then pipelined
    # settings around the default (the history of every variant: benchmarks/results/tvm.md)
    "attn_residual": [{}, {"impl": "onepass", "threads": 448, "group": 3, "prefetch": 1},
                      {"impl": "pipelined", "threads": 224, "stages": 4, "group": 1},
                      {"impl": "pipelined", "threads": 448, "stages": 8, "group": 4},
                      {"impl": "pipelined", "threads": 224, "stages": 6, "group": 3},
                      {"impl": "pipelined", "threads": 224, "stages": 8, "group": 2},
                      {"impl": "pipelined", "threads": 224, "stages": 12, "group": 4},
                      {"impl": "pipelined", "threads": 224, "stages": 8, "group": 8},
                      {"impl": "pipelined", "threads": 128}],
    "short_conv": [{}, {"vec": 1, "threads": 256, "tile_t": 8}, {"vec": 2, "threads": 128, "tile_t": 16}],
    "l2norm": [{}, {"rows": 32}, {"vec": 1, "threads": 32, "rows": 8}],
}


def groups(dtype: str, variants: bool = True) -> list[dict]:
    """The kernel specialisations to export: key (file stem), group (the key of the default variant),
    variant (text), op, and the attributes of ``backends.tvm.kernel_for`` (all dtypes = ``dtype``)."""
    vec = 16 // {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    base = [
        {"key": "rmsnorm_d7168", "op": "rmsnorm",
         "attrs": {"d": D_MODEL, "eps": EPS, "dtype": dtype, "w_dtype": dtype}},
        {"key": "situ_glu", "op": "situ_glu",
         "attrs": {"dtype": dtype, "b_dtype": dtype, "out_dtype": dtype, "beta_gate": BETA_GATE, "beta_up": BETA_UP,
                   "vec": vec}},
    ]
    for L in ATTN_LS:
        base.append({"key": f"attn_residual_d7168_L{L}", "op": "attn_residual",
                     "attrs": {"d": D_MODEL, "L": L, "eps": EPS, "dtype": dtype, "q_dtype": dtype, "w_dtype": dtype}})
    base.append({"key": f"short_conv_C{CONV_C}_W{CONV_W}", "op": "short_conv",
                 "attrs": {"C": CONV_C, "W": CONV_W, "dtype": dtype, "w_dtype": dtype}})
    base.append({"key": "l2norm_d128", "op": "l2norm", "attrs": {"d": HEAD_DIM, "eps": EPS, "dtype": dtype}})
    out = []
    for g in base:
        for i, v in enumerate(VARIANTS[g["op"]] if variants else [{}]):
            v = dict(v)
            note = v.pop("_note", None)
            tag = ",".join(f"{k}={x}" for k, x in v.items()) or "default"
            key = g["key"] if not v else g["key"] + "__" + "_".join(f"{k}{x}" for k, x in v.items())
            if note:
                tag += f" ({note.upper()} on the GPU)"
                key += f"__{note}"
            out.append({**g, "key": key, "group": g["key"], "variant": tag, "attrs": {**g["attrs"], **v}})
    return out


# ----------------------------------------------------------------------------------------------------
# phase 1: export
# ----------------------------------------------------------------------------------------------------

def do_export(out_dir: Path, kind: str, dtype: str, only: set[str] | None = None) -> None:
    import tvm
    from backends.tvm import kernel_for
    from backends.tvm.build import export, library_path, shared_write_hazards, target_spec

    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"--export {out_dir}: a file of that name exists; --export takes a folder (it writes "
                         f"manifest.json and the modules into it)")
    out_dir.mkdir(parents=True, exist_ok=True)
    entries, total = [], 0
    for g in groups(dtype, variants=kind == "cuda"):
        if only and g["op"] not in only:
            continue
        k = kernel_for(g["op"], **dict(g["attrs"]))
        t0 = time.perf_counter()
        path = export(k, kind, out_dir / f"{g['key']}.so")
        size = path.stat().st_size
        total += size
        cu = library_path(k, kind).with_suffix(".cu")
        if kind == "cuda" and cu.exists():
            hz = shared_write_hazards(cu.read_text())
            if hz:
                raise SystemExit(f"{g['key']}: the generated CUDA ({cu}) writes shared memory from every thread "
                                 f"without a guard (a race): {hz[0][:160]}")
        entries.append({**g, "file": path.name, "symbol": k.name, "bytes": size})
        print(f"  {g['key']:<28} -> {path}  {size / 1024:.0f} KiB  ({time.perf_counter() - t0:.1f} s)", flush=True)
    keep = {e["file"] for e in entries}
    for stale in out_dir.glob("*.so"):            # modules of an earlier export that are no longer listed
        if stale.name not in keep:
            stale.unlink()
    manifest = {"kind": kind, "target": target_spec(kind), "tvm_version": tvm.__version__, "dtype": dtype,
                "total_bytes": total, "modules": entries}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(entries)} modules, {total / 2**20:.2f} MiB in all, manifest {out_dir / 'manifest.json'}")
    if total > SIZE_LIMIT:
        raise SystemExit(f"exported libraries take {total / 2**20:.1f} MiB, over the {SIZE_LIMIT / 2**20:.0f} MiB "
                         f"limit for a carried .device folder")


# ----------------------------------------------------------------------------------------------------
# phase 2: Triton counterparts defined here (see the module docstring for why)
# ----------------------------------------------------------------------------------------------------

def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def short_conv_kernel(x, w, y, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # y[b, t, c] = sum_j w[c, j] x[b, t - W + 1 + j, c]; a [BT, BC] tile per program, float32 sums
        b = tl.program_id(2).to(tl.int64)
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        base = b * T * C
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            tt = t - (W - 1 - j)
            m = ((tt >= 0) & (tt < T))[:, None] & cm[None, :]
            xv = tl.load(x + base + tt[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
            wv = tl.load(w + c * W + j, mask=cm, other=0.0).to(tl.float32)
            acc += xv * wv[None, :]
        m = (t < T)[:, None] & cm[None, :]
        tl.store(y + base + t[:, None] * C + c[None, :], acc.to(y.dtype.element_ty), mask=m)

    return None, short_conv_kernel


_GEN: dict = {}


def generated_rownorm(op: str, d: int, dtype: str, dev):
    """The Triton kernel backends/triton/codegen.py generates for a lone rmsnorm / l2norm launch of
    width d (compiled from a one-op graph through dsl.compile, exactly as the model runtime does), with
    its GeneratedKernel record: (k, fn)."""
    key = (op, d, dtype)
    if key not in _GEN:
        import tempfile
        import dsl
        from dsl.builder import GraphBuilder
        from passes import PassManager
        short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype]
        b = GraphBuilder(f"bench_{op}")
        x = b.input("x", short, ["N", d])
        out = b.rmsnorm(x, eps=EPS, name="norm") if op == "rmsnorm" else b.l2norm(x, eps=EPS)
        g = PassManager().run(b.build([out]))
        m = dsl.compile(g, target="triton", device=dev, emit_dir=tempfile.mkdtemp(prefix="mtc_bench_gen_"))
        k, = [L.generated for L in m.program.launches if L.generated is not None]
        _GEN[key] = (k, getattr(m._generated, k.name))
    return _GEN[key]


def triton_rownorm(gen, x, w):
    """Launch the generated row-norm kernel as the runtime does (backends/triton/codegen.launch: tiled,
    several rows per program for short rows)."""
    import torch
    from backends.triton import codegen
    k, fn = gen
    args = [x if row else w for row in k.row_inputs]
    y = torch.empty_like(x)
    codegen.launch(k, fn, args, [y])
    return y


def triton_short_conv(kern, x, w):
    import torch
    import triton
    B, T, C = x.shape
    W = w.shape[-1]
    y = torch.empty_like(x)
    BT, BC = 16, 256
    kern[(triton.cdiv(T, BT), triton.cdiv(C, BC), B)](x, w, y, T, C, W=W, BT=BT, BC=BC, num_warps=4)
    return y


# ----------------------------------------------------------------------------------------------------
# phase 2: run
# ----------------------------------------------------------------------------------------------------

def rel_rms(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_case(entry: dict, n: int, dev, tdt):
    """Inputs, the TVM call (fn -> output), the Triton call, the reference, bytes moved, shape text."""
    import torch
    from backends import reference as R
    import importlib
    TA = importlib.import_module("backends.triton.attn_residual")   # the package re-exports a same-named function
    TM = importlib.import_module("backends.triton.moe")
    _, conv_k = TRITON
    op, a = entry["op"], entry["attrs"]
    el = torch.empty((), dtype=tdt).element_size()

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(tdt)

    if op in ("rmsnorm", "l2norm"):
        d = a["d"]
        rows = n if op == "rmsnorm" else n * HEADS
        x = rnd(rows, d, scale=2.0)
        w = (1 + 0.3 * torch.randn(d, device=dev)).to(tdt) if op == "rmsnorm" else None
        ins = (x, w) if w is not None else (x,)
        out = torch.empty_like(x)
        tvm_args = (*ins, out)
        gen = generated_rownorm(op, d, entry["attrs"]["dtype"], dev)
        trit = lambda: triton_rownorm(gen, x, w)  # noqa: E731
        ref = lambda: torch.cat([(R.rmsnorm(x[i:i + 4096], w, eps=EPS) if w is not None else  # noqa: E731
                                  R.l2norm(x[i:i + 4096], eps=EPS)).float() for i in range(0, rows, 4096)])
        nbytes = 2 * x.numel() * el + (d * el if w is not None else 0)
        shape = f"[{rows}, {d}]"
    elif op == "situ_glu":
        m = FFN_DENSE if dev.type == "cuda" else 68    # a multiple of vec (8 for 16-bit, 4 for float32)
        ga, ub = rnd(n, m, scale=3.0), rnd(n, m, scale=3.0)
        out = torch.empty_like(ga)
        vec = a.get("vec", 1)              # the kernel's [m, vec] row layout (backends/tvm._elementwise)
        tvm_args = (ga.view(-1, vec), ub.view(-1, vec), out.view(-1, vec))
        trit = lambda: TM.situ_glu(ga, ub, beta_gate=BETA_GATE, beta_up=BETA_UP)  # noqa: E731
        ref = lambda: torch.cat([R.situ_glu(ga[i:i + 2048], ub[i:i + 2048], beta_gate=BETA_GATE,  # noqa: E731
                                            beta_up=BETA_UP).float() for i in range(0, n, 2048)])
        nbytes = 3 * ga.numel() * el
        shape = f"[{n}, {m}]"
    elif op == "attn_residual":
        d, L = a["d"], a["L"]
        srcs = [rnd(n, d, scale=0.5 + 2 * torch.rand(1).item()) for _ in range(L)]
        q = rnd(d, scale=0.05)
        w = (1 + 0.3 * torch.randn(d, device=dev)).to(tdt)
        out = torch.empty_like(srcs[0])
        tvm_args = (q, w, *srcs, out)
        trit = lambda: TA.attn_residual(q, srcs, w, eps=EPS)  # noqa: E731
        ref = lambda: torch.cat([R.attn_residual(q, [s[i:i + 2048] for s in srcs], w, eps=EPS).float()  # noqa: E731
                                 for i in range(0, n, 2048)])
        nbytes = (L + 1) * n * d * el + 2 * d * el
        shape = f"L={L} x [{n}, {d}]"
    elif op == "short_conv":
        C, W = a["C"], a["W"]
        x = rnd(1, n, C, scale=2.0)
        w = rnd(C, W, scale=0.5)
        out = torch.empty_like(x)
        tvm_args = (x, w, out)
        trit = lambda: triton_short_conv(conv_k, x, w)  # noqa: E731
        ref = lambda: R.short_conv(x, w)[0].float()  # noqa: E731
        nbytes = 2 * x.numel() * el + w.numel() * el
        shape = f"[1, {n}, {C}] W={W}"
    else:
        raise ValueError(f"manifest entry {entry.get('key')!r}: unknown op {op!r}")
    return tvm_args, out, trit, ref, nbytes, shape


def timer(dev):
    if dev.type == "cuda":
        import triton
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3

    def cpu_time(fn, reps=3):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    return cpu_time


def copy_bandwidth() -> float:
    import torch
    import triton
    x = torch.empty(2 * 1024 ** 3, dtype=torch.float16, device="cuda").normal_()
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=100, return_mode="median") * 1e-3
    x = y = None                      # free the 8 GiB before the kernels run
    torch.cuda.empty_cache()
    return 2 * 2 * 1024 ** 3 * 2 / t


def do_run(in_dir: Path, cpu: bool, n: int, quick: bool, out_md: Path | None,
           only: set[str] | None = None) -> int:
    import torch
    from backends.tvm.build import load

    global TRITON
    if not (in_dir / "manifest.json").is_file():
        raise SystemExit(f"{in_dir}: no manifest.json here; export the modules first (python benchmarks/tvm.py "
                         f"--export {in_dir}{' --cpu-smoke' if cpu else ''})")
    try:
        manifest = json.loads((in_dir / "manifest.json").read_text())
        if not isinstance(manifest, dict) or not {"kind", "dtype", "modules"} <= manifest.keys():
            raise ValueError("not an export manifest (kind, dtype, modules)")
    except (ValueError, OSError) as exc:
        raise SystemExit(f"{in_dir}/manifest.json cannot be read: {exc}; export the modules again "
                         f"(python benchmarks/tvm.py --export {in_dir} ...)") from None
    want = "llvm" if cpu else "cuda"
    if manifest["kind"] != want:
        raise SystemExit(f"{in_dir}: modules were built for {manifest['kind']!r}, this run needs {want!r} "
                         f"(export with{'' if cpu else 'out'} --cpu-smoke)")
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("--run needs a CUDA device (use --cpu-smoke to exercise the path on the CPU)")
    dev = torch.device("cpu" if cpu else "cuda")
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[manifest["dtype"]]
    tol = TOL[manifest["dtype"]]
    TRITON = _triton_kernels()
    bench = timer(dev)
    import tvm
    emit(f"# TVM kernels (runtime-only load) vs Triton, {manifest['dtype']}, N = {n} tokens")
    emit()
    emit(f"TVM {tvm.__version__} (modules built with {manifest['tvm_version']} for {manifest['target']}); "
         f"TVM_USE_RUNTIME_LIB={os.environ.get('TVM_USE_RUNTIME_LIB', '')}; torch {torch.__version__}; "
         f"device {torch.cuda.get_device_name() if not cpu else 'cpu (smoke: timings mean nothing)'}")
    if not cpu and not quick:
        emit(f"measured device copy (2 GiB fp16, read + written): {copy_bandwidth() / 1e12:.2f} TB/s; "
             f"the floor below uses {COPY_NOMINAL / 1e12:.1f} TB/s")
    emit()
    emit("| op | variant | shape | MB moved | TVM ms | Triton ms | floor ms | TVM/Triton | TVM TB/s | TVM %copy BW "
         "| Triton %copy BW | TVM err | Triton err | load s |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios, bad = [], []
    tri_cache: dict = {}                  # group -> (Triton seconds, Triton error): timed once per group
    best: dict = {}                       # group -> (ratio, variant, t_tvm, t_tr, floor, op, shape)
    default_ratio: dict = {}
    entries = manifest["modules"]
    if quick:
        entries = [e for e in entries if e["op"] != "attn_residual" or e["attrs"]["L"] in (2, 16)]
    if only:
        entries = [e for e in entries if e["op"] in only]
        if not entries:
            raise SystemExit(f"{in_dir}/manifest.json holds no module of --only {','.join(sorted(only))}")
    if out_md is not None:
        out_md.parent.mkdir(parents=True, exist_ok=True)
        OUT_MD[:] = [out_md]
    for e in entries:
        t0 = time.perf_counter()
        try:
            fn = load(in_dir / e["file"], e["symbol"])
        except Exception as exc:          # a module that does not load (e.g. NVRTC) must not end the run
            msg = " ".join(str(exc).split())[-300:]
            emit(f"| {e['op']} | {e.get('variant', 'default')} | LOAD FAILED: {msg} |")
            bad.append(f"{e['key']}: load failed ({msg})")
            continue
        tvm_args, out, trit, ref, nbytes, shape = make_case(e, n, dev, tdt)

        if cpu:
            call = lambda: fn(*tvm_args)  # noqa: E731
        else:
            import tvm_ffi

            def call():
                with tvm_ffi.use_torch_stream():        # launch on torch's current stream
                    fn(*tvm_args)
        try:
            with torch.no_grad():
                call()                                   # first call: on CUDA, NVRTC compiles the module
                if not cpu:
                    torch.cuda.synchronize()
        except Exception as exc:
            msg = " ".join(str(exc).split())[-300:]
            emit(f"| {e['op']} | {e.get('variant', 'default')} | {shape} | FIRST CALL FAILED: {msg} |")
            bad.append(f"{e['key']}: first call failed")
            continue
        with torch.no_grad():
            load_s = time.perf_counter() - t0
            r = ref()
            err_tvm = rel_rms(out, r)
            grp = e.get("group", e["key"])
            if grp not in tri_cache:
                y_tr = trit()
                tri_cache[grp] = (None, rel_rms(y_tr, r))
                del y_tr
            del r
            t_tvm = bench(call)
            if tri_cache[grp][0] is None:
                tri_cache[grp] = (bench(trit), tri_cache[grp][1])
            t_tr, err_tr = tri_cache[grp]
        floor = nbytes / COPY_NOMINAL
        ratio = t_tvm / t_tr
        variant = e.get("variant", "default")
        if variant == "default":
            default_ratio[grp] = ratio
            ratios.append(ratio)
        if not err_tvm <= tol:
            pass                              # a wrong variant never counts as the best
        elif grp not in best or ratio < best[grp][0]:
            best[grp] = (ratio, variant, t_tvm, t_tr, nbytes / COPY_NOMINAL, e["op"], shape)
        for who, err in (("TVM", err_tvm), ("Triton", err_tr)):
            if not err <= tol:
                bad.append(f"{e['key']}: {who} error {err:.2e} over {tol:.0e}")
        emit(f"| {e['op']} | {variant} | {shape} | {nbytes / 1e6:.1f} | {t_tvm * 1e3:.3f} | {t_tr * 1e3:.3f} | "
             f"{floor * 1e3:.3f} | {ratio:.2f} | {nbytes / t_tvm / 1e12:.2f} | {100 * floor / t_tvm:.0f}% | "
             f"{100 * floor / t_tr:.0f}% | {err_tvm:.1e} | {err_tr:.1e} | {load_s:.2f} |")
        tvm_args = out = None             # free this case before the next one
        if not cpu:
            torch.cuda.empty_cache()
    emit()
    for b in bad:
        emit(f"ERROR: {b}")               # a load failure or an error over the tolerance
    if best:
        emit("best variant per group (errors within tolerance):")
        emit()
        emit("| group | op | shape | best variant | TVM ms | Triton ms | floor ms | TVM/Triton | TVM %copy BW |")
        emit("|---|---|---|---|---|---|---|---|---|")
        for grp, (rt, var, tv, tt, fl, op, shp) in best.items():
            emit(f"| {grp} | {op} | {shp} | {var} | {tv * 1e3:.3f} | {tt * 1e3:.3f} | {fl * 1e3:.3f} | {rt:.2f} | "
                 f"{100 * fl / tv:.0f}% |")
        emit()
        gb = math.exp(sum(math.log(b[0]) for b in best.values()) / len(best))
        worst = max(best.values(), key=lambda b: b[0])
        emit(f"best variants: geometric-mean TVM/Triton {gb:.2f}x, worst {worst[0]:.2f}x ({worst[5]} {worst[6]}); "
             + (f"every group within 1.25x: {'yes' if worst[0] <= 1.25 else 'NO'}" if not cpu
                else "(CPU smoke run: no verdict, the timings mean nothing)"))
    if not ratios:
        ratios = [1.0]
    gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    emit(f"default variants: geometric-mean TVM/Triton time ratio over {len(ratios)} kernels: {gm:.2f}x "
         + (f"(target <= 1.25x: {'met' if gm <= 1.25 else 'NOT met'})" if not cpu else "(CPU smoke run: no verdict)"))
    if out_md is not None:
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.write_text("\n".join(LINES) + "\n")
        print(f"table written to {out_md}")
    return 1 if bad else 0


TRITON = None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="TVM kernels built here (phase 1, --export, full TVM, no GPU) and run on the H200 with "
                    "TVM's runtime only (phase 2, --run, after `source .device/prelude.sh`), timed against "
                    "the Triton kernel of the same group and the memory-traffic floor (bytes / 4.2 TB/s). "
                    "GPU: source .device/prelude.sh; python benchmarks/tvm.py --run .device/tvm_kernels "
                    "--out $OUT/tvm.md",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ph = p.add_mutually_exclusive_group(required=True)
    ph.add_argument("--export", nargs="?", const="", metavar="DIR",
                    help="phase 1: build the cuda sm_90 modules and export_library them into DIR "
                         "(default .device/tvm_kernels; .device/tvm_kernels_cpu with --cpu-smoke) + manifest.json")
    ph.add_argument("--run", nargs="?", const="", metavar="DIR",
                    help="phase 2: load the exported modules of DIR (runtime only), check them against the "
                         "reference and time them next to Triton")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: export llvm float32 modules / run them on the CPU at a tiny token count, "
                        "Triton under TRITON_INTERPRET=1")
    p.add_argument("--tokens", type=int, default=None,
                   help="token count N for --run (default 16384; 8192 with --quick; 37 with --cpu-smoke)")
    p.add_argument("--quick", action="store_true",
                   help="--run: N = 8192, attn_residual only at L in {2, 16}, no copy-bandwidth measurement")
    p.add_argument("--only", default=None, metavar="OPS",
                   help="comma-separated ops (rmsnorm, situ_glu, attn_residual, short_conv, l2norm): export or "
                        "run only their modules (e.g. --only attn_residual to time its schedule variants)")
    p.add_argument("--out", type=Path, default=None,
                   help="--run: also write the table to this markdown file (on the GPU machine: $OUT/tvm.md; "
                        "commit it as benchmarks/results/tvm.md)")
    args = p.parse_args(argv)
    only = None
    if args.only is not None:
        only = {o.strip() for o in args.only.split(",") if o.strip()}
        if not only:
            p.error("--only: give at least one op, e.g. --only attn_residual")
        unknown = only - set(VARIANTS)
        if unknown:
            p.error(f"--only: unknown op(s) {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"             # before triton is imported
    if args.export is not None and (args.tokens is not None or args.out is not None or args.quick):
        p.error("--tokens, --quick and --out apply to --run, not to --export")
    if args.export is not None:
        d = Path(args.export or (".device/tvm_kernels_cpu" if args.cpu_smoke else ".device/tvm_kernels"))
        do_export(d, "llvm" if args.cpu_smoke else "cuda", "float32" if args.cpu_smoke else "bfloat16", only)
        return 0
    d = Path(args.run or (".device/tvm_kernels_cpu" if args.cpu_smoke else ".device/tvm_kernels"))
    n = args.tokens if args.tokens is not None else (37 if args.cpu_smoke else 8192 if args.quick else 16384)
    if n < 1:
        raise SystemExit(f"--tokens must be >= 1, got {n}")
    return do_run(d, args.cpu_smoke, n, args.quick, args.out, only)


if __name__ == "__main__":
    sys.exit(main())
