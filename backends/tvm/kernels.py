"""TensorIR kernels for the memory-bound ops, written as TVMScript text, and their schedules.

Each ``*_source`` function returns the *unscheduled* TVMScript of one kernel as a string (a
``@T.prim_func(s_tir=True)`` whose loops carry ``T.sblock`` bodies). The token count (or B and T for
short_conv) is a symbolic ``T.int64()`` shape variable, so one built module serves every token count;
widths (d, C, E, L, W), dtypes and float attributes (eps, betas) are compile-time constants written into
the text. All arithmetic is float32: inputs are cast up on load and the result is cast to the output
dtype on store, as the reference backend does (backends/reference, spec/OPS.md).

``schedule(kernel, kind)`` applies the loop transformations with ``tvm.s_tir.Schedule``:
  * ``"llvm"`` (CPU): the row / element loop is split, its outer part runs ``T.parallel``, the innermost
    contiguous loop is ``T.vectorized``; per-row reductions are moved under the row loop
    (``compute_at``) into thread-local buffers.
  * ``"cuda"``: rows (or flat element chunks) go to ``blockIdx.x``; the hidden dimension goes to
    ``threadIdx.x``, per-row reductions becoming cross-thread (warp shuffle + shared) all-reduces.

Nothing here imports tvm at module import time; the text generators are pure Python, so a cache key
can be formed on a machine that only has TVM's runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULE_VERSION = "5"          # bump when a schedule below changes (part of every cache key)

DTYPES = ("float32", "float16", "bfloat16")
CUDA_THREADS = 256              # threads per block for the hidden / element dimension on cuda
CPU_VECTOR = 8                  # float32 lanes of one AVX2 register
CPU_ELEMS_PER_TASK = 4096       # elementwise: elements per parallel task on CPU


@dataclass(frozen=True)
class Kernel:
    """One kernel specialisation: its name (the exported symbol), TVMScript source and schedule kind.

    ``family`` picks the schedule ("elementwise", "rownorm", "attn_residual", "short_conv", "router");
    ``info`` holds the compile-time constants the schedule needs (e.g. the row width).
    """
    name: str
    family: str
    source: str
    info: dict = field(default_factory=dict, compare=False, hash=False)
    cuda_source: str | None = None      # the text built for cuda when it differs (fast-math intrinsics)
    sched: tuple = ()                   # schedule parameters ((name, value), ...): part of the cache key
    cuda_pass_config: tuple = ()        # PassContext config ((key, value), ...) of the cuda build: cache key

    def text(self, kind: str) -> str:
        """The TVMScript built for target ``kind`` ("llvm" or "cuda")."""
        return self.cuda_source if (kind == "cuda" and self.cuda_source is not None) else self.source

    def param(self, name: str, default):
        """One schedule parameter (``sched``), or ``default``."""
        return dict(self.sched).get(name, default)


# ----------------------------------------------------------------------------------------------------
# helpers for writing TVMScript text
# ----------------------------------------------------------------------------------------------------

def _check_dtype(dt: str, what: str) -> str:
    if dt not in DTYPES:
        raise TypeError(f"tvm backend: {what} dtype {dt!r} is not supported; use one of {DTYPES}")
    return dt


def _f32(load: str, dt: str) -> str:
    return load if dt == "float32" else f'T.Cast("float32", {load})'


def _store(expr: str, dt: str) -> str:
    return expr if dt == "float32" else f'T.Cast("{dt}", {expr})'


def _c(v: float) -> str:
    """A float32 literal in TVMScript (repr keeps every digit of the Python float)."""
    return f"T.float32({float(v)!r})"


def _header(name: str, params: list[str], s_tir: bool = True) -> str:
    """The prim_func decorator, signature and attributes; s_tir=False for a kernel written thread-bound
    (T.launch_thread) instead of as schedulable blocks."""
    args = ", ".join(f"{p}: T.handle" for p in params)
    return (f"@T.prim_func{'(s_tir=True)' if s_tir else ''}\n"
            f"def {name}({args}):\n"
            f'    T.func_attr({{"global_symbol": "{name}", "tirx.noalias": True}})\n')


# ----------------------------------------------------------------------------------------------------
# elementwise: silu, sigmoid, add, mul, situ_glu over a flat buffer of n elements
# ----------------------------------------------------------------------------------------------------

def _exp(x: str, fast: bool) -> str:
    """exp(x) in float32: ``T.exp`` (portable), or CUDA's ``__expf`` (MUFU.EX2 based, ~2 ulp) when fast."""
    return f'T.call_pure_extern("float32", "__expf", {x})' if fast else f"T.exp({x})"


def _div(a: str, b: str, fast: bool) -> str:
    """a / b in float32: IEEE division (portable), or CUDA's ``__fdividef`` (a * rcp(b), ~2 ulp) when fast."""
    return f'T.call_pure_extern("float32", "__fdividef", {a}, {b})' if fast else f"(({a}) / ({b}))"


def _sigmoid(x: str, fast: bool) -> str:
    # 1 / (1 + exp(-x)): exp overflows to inf for x < -88, giving exactly 0
    return _div("T.float32(1)", f"(T.float32(1) + {_exp(f'(T.float32(0) - {x})', fast)})", fast)


def _situ_glu_expr(a: str, b: str, bg: float, bu: float, fast: bool) -> str:
    """SiTU-GLU h = (bg tanh(a / bg) sigmoid(a)) (bu tanh(b / bu)) with three exponentials and ONE
    division: with p = exp(2a / bg), s = exp(a), v = exp(2b / bu),

        tanh(a / bg) = (p - 1) / (p + 1),  sigmoid(a) = s / (1 + s),  tanh(b / bu) = (v - 1) / (v + 1)
        h = bg bu (p - 1) s (v - 1) / ((p + 1) (1 + s) (v + 1)).

    The exponents are clamped to [-20, 20] (2a / bg, 2b / bu) and [-30, 30] (a), where tanh is +-1 and
    sigmoid 0 / 1 to float32 precision (absolute error < 1e-8 relative to bg bu), so that numerator and
    denominator stay below 3e32 (no overflow). On cuda the exponentials are __expf and the division
    __fdividef (4 MUFU operations per element, like Triton's tanh.approx kernel).
    p - 1 and v - 1 cancel near 0 (tanh of a small argument would keep only ~1e-7 / |x| of relative accuracy):
    for |x| < 0.1 they are e^x - 1's Taylor series to x^5 (relative error < 2e-8) instead.  NaN in a or b gives
    NaN (the clamps alone would turn it into a finite number)."""
    def clamp(x, lim):
        return f"T.max(T.min({x}, {_c(lim)}), {_c(-lim)})"

    def em1(x, lim):
        """e^x - 1 of the clamped x: the series near 0, else the exponential minus 1."""
        y = clamp(x, lim)
        series = (f"{y} * ({_c(1)} + {y} * ({_c(1 / 2)} + {y} * ({_c(1 / 6)} + {y} * ({_c(1 / 24)} + {y} * "
                  f"{_c(1 / 120)}))))")
        return f"T.if_then_else(T.abs({y}) < {_c(0.1)}, {series}, {_exp(y, fast)} - T.float32(1))"
    pm1 = em1(f"{a} * {_c(2.0 / bg)}", 20.0)
    sa = _exp(clamp(a, 30.0), fast)
    vm1 = em1(f"{b} * {_c(2.0 / bu)}", 20.0)
    num = f"{_c(bg * bu)} * ({pm1}) * {sa} * ({vm1})"
    den = f"({pm1} + T.float32(2)) * (T.float32(1) + {sa}) * ({vm1} + T.float32(2))"
    h = _div(num, den, fast)
    return f"T.if_then_else(T.isnan({a}), {a}, T.if_then_else(T.isnan({b}), {b}, {h}))"


_UNARY = {
    "silu": lambda a, f: f"{a} * {_sigmoid(a, f)}",
    "sigmoid": lambda a, f: _sigmoid(a, f),
}
_BINARY = {
    "add": lambda a, b, f: f"{a} + {b}",
    "mul": lambda a, b, f: f"{a} * {b}",
}


def elementwise_source(op: str, in_dtypes: tuple[str, ...], out_dtype: str, *, beta_gate: float = 4.0,
                       beta_up: float = 25.0, vec: int = 1, threads: int = 256, unroll: int = 1) -> Kernel:
    """y[i, j] = f(a[i, j] (, b[i, j])) over buffers [m, vec] (m symbolic; the caller views a flat tensor
    of m * vec elements as [m, vec]), float32 math.

    op: "silu" (x * sigmoid(x), Elfwing et al. 2018), "sigmoid", "add", "mul", or "situ_glu"
    (h = (beta_gate * tanh(a / beta_gate) * sigmoid(a)) * (beta_up * tanh(b / beta_up)), spec/OPS.md).
    sigmoid(x) is computed as 1 / (1 + exp(-x)), situ_glu as in _situ_glu_expr (three exponentials, one
    division); the cuda text uses CUDA's __expf / __fdividef for them (fast-math, relative error ~1e-6,
    like Triton's kernels), the portable (llvm) text T.exp and IEEE division.
    vec: lanes per row, the width of one 128-bit access on cuda (8 for 16-bit, 4 for float32 data);
    threads, unroll: the cuda schedule (threads per block, rows per thread)."""
    arity = 1 if op in _UNARY else 2
    if op not in _UNARY and op not in _BINARY and op != "situ_glu":
        raise ValueError(f"tvm elementwise: unknown op {op!r}")
    if len(in_dtypes) != arity:
        raise ValueError(f"tvm elementwise: {op} takes {arity} inputs, got {len(in_dtypes)} dtypes")
    if vec not in (1, 2, 4, 8):
        raise ValueError(f"tvm elementwise: vec must be 1, 2, 4 or 8, got {vec}")
    for i, dt in enumerate(in_dtypes):
        _check_dtype(dt, f"{op} input {i}")
    _check_dtype(out_dtype, f"{op} output")
    if op == "situ_glu" and not (beta_gate > 0 and beta_up > 0):
        raise ValueError(f"situ_glu: beta_gate and beta_up must be > 0, got {beta_gate}, {beta_up}")
    names = ["A", "B"][:arity]
    loads = [_f32(f"{n}[vi, vj]", dt) for n, dt in zip(names, in_dtypes)]

    def text(fast: bool) -> str:
        if op in _UNARY:
            expr = _UNARY[op](loads[0], fast)
        elif op in _BINARY:
            expr = _BINARY[op](*loads, fast)
        else:
            expr = _situ_glu_expr(*loads, beta_gate, beta_up, fast)
        src = _header(op, [f"{n.lower()}_h" for n in names] + ["y_h"])
        src += "    m = T.int64()\n"
        for n, dt in zip(names, in_dtypes):
            src += f'    {n} = T.match_buffer({n.lower()}_h, (m, {vec}), "{dt}")\n'
        src += f'    Y = T.match_buffer(y_h, (m, {vec}), "{out_dtype}")\n'
        src += (f"    for i, j in T.grid(m, {vec}):\n"
                '        with T.sblock("y"):\n'
                '            vi, vj = T.axis.remap("SS", [i, j])\n'
                f"            Y[vi, vj] = {_store(expr, out_dtype)}\n")
        return src

    portable, cuda = text(False), text(True)
    return Kernel(op, "elementwise", portable, {"arity": arity, "vec": vec},
                  cuda_source=cuda if cuda != portable else None,
                  sched=(("threads", threads), ("unroll", unroll)))


# ----------------------------------------------------------------------------------------------------
# row norms: rmsnorm (mean, weight) and l2norm (sum, no weight) over rows of width d
# ----------------------------------------------------------------------------------------------------

def _row_threads(d: int, vec: int) -> int:
    """Default threads along a row for the vectorised row schedule: all d / vec vectors of the row at
    once when that is <= 1024 threads (a multiple of 32, or a single sub-warp for short rows), else the
    largest multiple of 32 <= 1024 dividing d / vec; 0 when none fits (then the scalar schedule runs)."""
    if d % vec:
        return 0
    nv = d // vec
    if nv <= 32 and nv & (nv - 1) == 0:
        return nv
    best = 0
    for t in range(32, 1025, 32):
        if nv % t == 0:
            best = t
    return best


def _norm_threads(d: int, vec: int) -> int:
    """Default threads along a row for rmsnorm / l2norm: TWO vectors per thread (threads = d / (2 vec),
    i.e. d / 16 for 16-bit data: 448 at d = 7168) when that is a multiple of 32 and <= 1024, else
    _row_threads (one vector per thread). Measured on the H200 (bf16 rmsnorm, d = 7168, 16384 rows):
    448 threads x 2 vectors 0.116 ms (1.00x Triton, 96% of copy bandwidth) vs 896 x 1 0.158 ms
    (benchmarks/results/tvm.md)."""
    if d % (2 * vec) == 0:
        t = d // (2 * vec)
        if t % 32 == 0 and t <= 1024:
            return t
    return _row_threads(d, vec)


def _lanes(*dtypes: str) -> int:
    """Elements of one 128-bit access for the widest of these dtypes."""
    return 16 // max(4 if dt == "float32" else 2 for dt in dtypes if dt)


def rownorm_source(kind: str, d: int, x_dtype: str, w_dtype: str | None, out_dtype: str, eps: float, *,
                   threads: int | None = None, rows: int | None = None, vec: int | None = None) -> Kernel:
    """rmsnorm: y = x * rsqrt(mean_d(x^2) + eps) * w (Zhang & Sennrich 2019, eq. 4);
    l2norm: y = x * rsqrt(sum_d(x^2) + eps). x, y [n, d] (n symbolic), w [d]; float32 math.

    cuda schedule: ``rows`` rows per block (threadIdx.y), ``threads`` threads along a row (threadIdx.x),
    ``vec`` elements per 128-bit access (vec > 1 and threads * vec dividing d: the vectorised schedule,
    see _sched_rows_vec; vec = 1: scalar accesses). Defaults: vec = 8 for 16-bit data (4 for float32),
    threads = d / (2 vec) (two vectors per thread: 448 at d = 7168 in bf16, the measured best) when that
    is a multiple of 32 and <= 1024, else d / vec when that fits in a block (_norm_threads, _row_threads),
    rows so that a block has ~256 threads;
    without a vectorised fit: d >= 1024 one row of 256 threads, else one warp per row, 8 rows."""
    if kind not in ("rmsnorm", "l2norm"):
        raise ValueError(f"tvm rownorm: unknown kind {kind!r}")
    if d < 1:
        raise ValueError(f"{kind}: the row width d must be >= 1, got {d}")
    _check_dtype(x_dtype, f"{kind} x")
    _check_dtype(out_dtype, f"{kind} output")
    params = ["x_h", "w_h", "y_h"] if kind == "rmsnorm" else ["x_h", "y_h"]
    src = _header(kind, params)
    src += "    n = T.int64()\n"
    src += f'    X = T.match_buffer(x_h, (n, {d}), "{x_dtype}")\n'
    if kind == "rmsnorm":
        _check_dtype(w_dtype, "rmsnorm weight")
        src += f'    W = T.match_buffer(w_h, ({d},), "{w_dtype}")\n'
    src += f'    Y = T.match_buffer(y_h, (n, {d}), "{out_dtype}")\n'
    src += '    SS = T.sblock_alloc_buffer((n,), "float32")\n'
    x = _f32("X[vi, vk]", x_dtype)
    src += (f"    for i, k in T.grid(n, {d}):\n"
            '        with T.sblock("sumsq"):\n'
            '            vi, vk = T.axis.remap("SR", [i, k])\n'
            "            with T.init():\n"
            "                SS[vi] = T.float32(0)\n"
            f"            SS[vi] = SS[vi] + {x} * {x}\n")
    ms = f"SS[vi] / {_c(d)}" if kind == "rmsnorm" else "SS[vi]"
    expr = f"{x} * T.rsqrt({ms} + {_c(eps)})"
    if kind == "rmsnorm":
        expr += f" * {_f32('W[vk]', w_dtype)}"
    src += (f"    for i, k in T.grid(n, {d}):\n"
            '        with T.sblock("norm"):\n'
            '            vi, vk = T.axis.remap("SS", [i, k])\n'
            f"            Y[vi, vk] = {_store(expr, out_dtype)}\n")
    if vec is None:
        vec = _lanes(x_dtype, out_dtype)
    if threads is None:
        threads = _norm_threads(d, vec) if vec > 1 else 0
        if not threads:
            vec = 1
            threads = CUDA_THREADS if d >= 1024 else min(32, 1 << max(0, d - 1).bit_length())
    if rows is None:
        rows = max(1, CUDA_THREADS // threads)
    if threads < 1 or rows < 1 or threads * rows > 1024:
        raise ValueError(f"{kind}: cuda schedule threads = {threads} x rows = {rows} must be >= 1 and <= 1024")
    sources = {"X": ["sumsq", "norm"]} | ({"W": ["norm"]} if kind == "rmsnorm" else {})
    return Kernel(kind, "rownorm", src, {"d": d, "reductions": ["sumsq"], "row_blocks": [], "out": "norm",
                                         "sources": sources, "first_use": {"X": "sumsq"},
                                         "vectors": ["W"] if kind == "rmsnorm" else [], "order": ["sumsq"]},
                  sched=(("threads", threads), ("rows", rows), ("vec", vec)))


# ----------------------------------------------------------------------------------------------------
# attn_residual: softmax over L sources of <query, RMSNorm(source)>, then the weighted sum of sources
# ----------------------------------------------------------------------------------------------------

ATTN_RESIDUAL_IMPLS = ("onepass", "twopass", "pipelined")   # default: attn_residual_source (impl=None)

# The cuda race of the one-pass kernel (found in its generated CUDA source; nan / inf on the H200): a row
# scalar computed from an all-reduce result, e.g. LG = DT * rsqrt(SS / d + eps), is a one-element
# "local" buffer like DT itself, so tirx.StorageRewrite (which runs before LowerThreadAllreduce) computes
# it IN PLACE in DT's buffer. When the reduction spans several warps, LowerThreadAllreduce then makes
# that buffer the __shared__ word the block's result is broadcast through, so every thread of the block
# does `red_result = f(red_result)` on one shared word with no barrier: threads that come later apply f
# again (the logit multiplied by rsqrt(...) up to #threads times, exp of exp ...), hence inf, and nan
# from inf - inf. Single-warp reductions keep the result in a register, and the llvm build has no
# all-reduce, which is why the CPU tests passed. The two-pass kernel has the same pattern only at L = 1
# (LG[1] in place of DT0). Fix: build these kernels for cuda with StorageRewrite off (each row scalar
# then gets its own register and the all-reduce result is copied out of shared memory after the
# barrier); tests/test_tvm.py checks the generated source for unguarded writes to shared memory.
NO_STORAGE_REWRITE = (("tirx.disable_storage_rewrite", True),)


def attn_residual_source(d: int, L: int, src_dtype: str, q_dtype: str, w_dtype: str, eps: float, *,
                         impl: str | None = None, threads: int | None = None, vec: int | None = None,
                         prefetch: int | None = None, group: int | None = None,
                         min_blocks: int | None = None, stages: int | None = None) -> Kernel:
    """Block AttnRes (arXiv 2603.15031; spec/OPS.md attn_residual): the kernel of implementation ``impl``.

    impl = None (default): "pipelined" where it fits (d / vec a multiple of 32, e.g. d = 7168: the fastest
    kernel of the H200 runs, benchmarks/results/tvm.md) and no one-pass-only attribute (vec, prefetch,
    min_blocks) is given; else "onepass" with the schedule of onepass_defaults(d, L, src_dtype) for every
    attribute not given (grouped all-reduces).
    impl = "onepass": the one-pass online-softmax kernel (_attn_residual_onepass_source; schedule
    attributes threads, vec, prefetch, group, min_blocks; unset ones keep that function's own defaults:
    2 sources prefetched, one all-reduce per sum, d / vec threads). Its first cuda builds gave nan / inf on the
    H200 (a shared-memory race of the build, fixed by building with StorageRewrite off:
    NO_STORAGE_REWRITE, where the race is explained); measured correct on the H200 since.
    impl = "twopass": the kernel of commit b963733 (all 2L row sums first, then the softmax over the L
    logits, then the weighted sum re-reading the sources; cuda: one row per block of 256 threads). Takes
    no schedule attributes. Both measured correct on the H200: relative RMS error 2.0e-05..3.8e-05 in
    bf16 at d = 7168, L = 2..25.
    impl = "pipelined": on cuda a hand-written TensorIR kernel that streams the sources through a ring of
    ``stages`` shared-memory row buffers with cp.async (see _attn_residual_pipelined_source; attributes
    threads, stages, group); on llvm the default one-pass kernel.
    Raises ValueError for an unknown impl, or schedule attributes given to "twopass"."""
    if impl is None and vec is None and prefetch is None and min_blocks is None \
            and _pipelined_problem(d, src_dtype, threads) is None:
        impl = "pipelined"
    if stages is not None and impl != "pipelined":
        raise ValueError("attn_residual: 'stages' belongs to impl='pipelined'")
    if impl is None:
        dflt = onepass_defaults(d, L, src_dtype)
        threads = dflt["threads"] if threads is None else threads
        group = dflt["group"] if group is None else group
        prefetch = dflt["prefetch"] if prefetch is None else prefetch
        impl = "onepass"
    if impl == "twopass":
        given = [n for n, v in (("threads", threads), ("vec", vec), ("prefetch", prefetch), ("group", group),
                                ("min_blocks", min_blocks)) if v is not None]
        if given:
            raise ValueError(f"attn_residual: impl 'twopass' takes no schedule attribute(s) {', '.join(given)} "
                             f"(they belong to impl='onepass')")
        return _attn_residual_twopass_source(d, L, src_dtype, q_dtype, w_dtype, eps)
    if impl == "onepass":
        return _attn_residual_onepass_source(d, L, src_dtype, q_dtype, w_dtype, eps, threads=threads, vec=vec,
                                             prefetch=2 if prefetch is None else prefetch, group=group,
                                             min_blocks=min_blocks)
    if impl == "pipelined":
        given = [n for n, v in (("vec", vec), ("prefetch", prefetch), ("min_blocks", min_blocks)) if v is not None]
        if given:
            raise ValueError(f"attn_residual: impl 'pipelined' takes no schedule attribute(s) {', '.join(given)} "
                             f"(its attributes are threads, stages, group)")
        return _attn_residual_pipelined_source(d, L, src_dtype, q_dtype, w_dtype, eps, threads=threads,
                                               stages=stages, group=group)
    raise ValueError(f"attn_residual: unknown impl {impl!r}; one of {ATTN_RESIDUAL_IMPLS}")


def onepass_defaults(d: int, L: int, src_dtype: str) -> dict:
    """The default cuda schedule of the one-pass attn_residual kernel: threads = d / (2 vec) (two 128-bit
    vectors of each source row per thread: 448 at d = 7168 in bf16) when that is a multiple of 32 and
    <= 1024, else None (the kernel's own choice); group G = 3 sources per all-reduce, prefetch P (in
    groups) 2 up to L = 8 and 1 above. The best of the H200 runs of 2026-11-29 (benchmarks/results/tvm.md,
    N = 16384, d = 7168, bf16; Triton 0.36 / 0.67 / 1.17 / 1.73 ms): L = 2 0.187 ms (90% of copy
    bandwidth), L = 8 G 3 / P 2 0.690 ms (G 2 / P 2 0.741), L = 16 G 3 / P 1 1.441 ms (G 2 / P 2 1.56,
    G 4 / P 1 1.74), L = 25 G 3 / P 1 2.226 ms (G 4 / P 1 2.26, no groups 3.08). Larger G or P spill
    registers (G 8: 15.5 ms at L = 25)."""
    group, prefetch = (3, 2) if L <= 8 else (3, 1)
    return {"threads": _norm_threads(d, _lanes(src_dtype)) or None, "group": group, "prefetch": prefetch}


def _attn_residual_head(d: int, L: int, src_dtype: str, q_dtype: str, w_dtype: str, s_tir: bool = True) -> str:
    """The checked arguments and the TVMScript head shared by the attn_residual kernels: the prim_func
    header (_header's s_tir) and the buffers Q [d], W [d], S0..S{L-1} [n, d] (L separate sources) and
    Y [n, d]. Raises ValueError for L < 1, d < 1 or an unsupported dtype."""
    if L < 1:
        raise ValueError(f"attn_residual: needs at least one source, got L = {L}")
    if d < 1:
        raise ValueError(f"attn_residual: the hidden size d must be >= 1, got {d}")
    for dt, what in ((src_dtype, "sources"), (q_dtype, "query"), (w_dtype, "rms_weight")):
        _check_dtype(dt, f"attn_residual {what}")
    params = ["q_h", "w_h"] + [f"s{l}_h" for l in range(L)] + ["y_h"]
    src = _header("attn_residual", params, s_tir)
    src += "    n = T.int64()\n"
    src += f'    Q = T.match_buffer(q_h, ({d},), "{q_dtype}")\n'
    src += f'    W = T.match_buffer(w_h, ({d},), "{w_dtype}")\n'
    for l in range(L):
        src += f'    S{l} = T.match_buffer(s{l}_h, (n, {d}), "{src_dtype}")\n'
    src += f'    Y = T.match_buffer(y_h, (n, {d}), "{src_dtype}")\n'
    return src


def _attn_residual_twopass_source(d: int, L: int, src_dtype: str, q_dtype: str, w_dtype: str,
                                  eps: float) -> Kernel:
    """Block AttnRes (arXiv 2603.15031; spec/OPS.md attn_residual), per token row i:

        ss_l = sum_d s_l[i]^2,  dot_l = sum_d query * rms_weight * s_l[i]
        logit_l = dot_l * rsqrt(ss_l / d + eps)          (= <query, RMSNorm(s_l[i]; rms_weight, eps)>)
        p = softmax_l(logit) in float32,  y[i] = sum_l p_l s_l[i]   (sources' dtype)

    The TVMScript of commit b963733 (restored unchanged: the kernel measured correct on the H200). The L
    sources are L separate buffers (no stacking copy); L, d are compile-time constants. Scheduled by
    _sched_attn_residual_twopass."""
    src = _attn_residual_head(d, L, src_dtype, q_dtype, w_dtype)
    for l in range(L):
        src += f'    SS{l} = T.sblock_alloc_buffer((n,), "float32")\n'
        src += f'    DT{l} = T.sblock_alloc_buffer((n,), "float32")\n'
    src += f'    LG = T.sblock_alloc_buffer((n, {L}), "float32")\n'
    src += '    MX = T.sblock_alloc_buffer((n,), "float32")\n'
    src += '    Z = T.sblock_alloc_buffer((n,), "float32")\n'
    qw = f"{_f32('Q[vk]', q_dtype)} * {_f32('W[vk]', w_dtype)}"
    for l in range(L):
        s = _f32(f"S{l}[vi, vk]", src_dtype)
        src += (f"    for i, k in T.grid(n, {d}):\n"
                f'        with T.sblock("ss{l}"):\n'
                '            vi, vk = T.axis.remap("SR", [i, k])\n'
                "            with T.init():\n"
                f"                SS{l}[vi] = T.float32(0)\n"
                f"            SS{l}[vi] = SS{l}[vi] + {s} * {s}\n")
        src += (f"    for i, k in T.grid(n, {d}):\n"
                f'        with T.sblock("dot{l}"):\n'
                '            vi, vk = T.axis.remap("SR", [i, k])\n'
                "            with T.init():\n"
                f"                DT{l}[vi] = T.float32(0)\n"
                f"            DT{l}[vi] = DT{l}[vi] + {qw} * {s}\n")
    # logit of source vl: a select over the L per-row scalars (lazy if_then_else; O(L) per logit)
    sel = f"DT{L - 1}[vi] * T.rsqrt(SS{L - 1}[vi] / {_c(d)} + {_c(eps)})"
    for l in reversed(range(L - 1)):
        sel = f"T.if_then_else(vl == {l}, DT{l}[vi] * T.rsqrt(SS{l}[vi] / {_c(d)} + {_c(eps)}), {sel})"
    src += (f"    for i, l in T.grid(n, {L}):\n"
            '        with T.sblock("logits"):\n'
            '            vi, vl = T.axis.remap("SS", [i, l])\n'
            f"            LG[vi, vl] = {sel}\n")
    src += (f"    for i, l in T.grid(n, {L}):\n"
            '        with T.sblock("max"):\n'
            '            vi, vl = T.axis.remap("SR", [i, l])\n'
            "            with T.init():\n"
            '                MX[vi] = T.min_value("float32")\n'
            "            MX[vi] = T.max(MX[vi], LG[vi, vl])\n")
    src += (f"    for i, l in T.grid(n, {L}):\n"
            '        with T.sblock("sum"):\n'
            '            vi, vl = T.axis.remap("SR", [i, l])\n'
            "            with T.init():\n"
            "                Z[vi] = T.float32(0)\n"
            "            Z[vi] = Z[vi] + T.exp(LG[vi, vl] - MX[vi])\n")
    mix = " + ".join(f"T.exp(LG[vi, {l}] - MX[vi]) * {_f32(f'S{l}[vi, vk]', src_dtype)}" for l in range(L))
    src += (f"    for i, k in T.grid(n, {d}):\n"
            '        with T.sblock("out"):\n'
            '            vi, vk = T.axis.remap("SS", [i, k])\n'
            f"            Y[vi, vk] = {_store(f'({mix}) / Z[vi]', src_dtype)}\n")
    reductions = [b for l in range(L) for b in (f"ss{l}", f"dot{l}")]
    return Kernel("attn_residual", "attn_residual", src,
                  {"d": d, "L": L, "reductions": reductions, "row_blocks": ["logits", "max", "sum"], "out": "out",
                   "impl": "twopass"}, sched=(("impl", "twopass"),),
                  # L >= 2: the b963733 build unchanged (measured correct); L = 1: the race fix (see above)
                  cuda_pass_config=NO_STORAGE_REWRITE if L == 1 else ())


def _ss_dot_blocks(l: int, d: int, s: str, qw: str) -> str:
    """The two reduction blocks of source l in the ungrouped one-pass kernel: SS{l} = sum s^2, DT{l} =
    sum q w s (s, qw: float32 TVMScript expressions of one element)."""
    return (f"    for i, k in T.grid(n, {d}):\n"
            f'        with T.sblock("ss{l}"):\n'
            '            vi, vk = T.axis.remap("SR", [i, k])\n'
            "            with T.init():\n"
            f"                SS{l}[vi] = T.float32(0)\n"
            f"            SS{l}[vi] = SS{l}[vi] + {s} * {s}\n"
            f"    for i, k in T.grid(n, {d}):\n"
            f'        with T.sblock("dot{l}"):\n'
            '            vi, vk = T.axis.remap("SR", [i, k])\n'
            "            with T.init():\n"
            f"                DT{l}[vi] = T.float32(0)\n"
            f"            DT{l}[vi] = DT{l}[vi] + {qw} * {s}\n")


def _attn_residual_onepass_source(d: int, L: int, src_dtype: str, q_dtype: str, w_dtype: str, eps: float, *,
                                  threads: int | None = None, vec: int | None = None, prefetch: int = 2,
                                  group: int | None = None, min_blocks: int | None = None) -> Kernel:
    """Block AttnRes (arXiv 2603.15031; spec/OPS.md attn_residual), per token row i:

        ss_l = sum_d s_l[i]^2,  dot_l = sum_d query * rms_weight * s_l[i]
        logit_l = dot_l * rsqrt(ss_l / d + eps)          (= <query, RMSNorm(s_l[i]; rms_weight, eps)>)
        p = softmax_l(logit) in float32,  y[i] = sum_l p_l s_l[i]   (sources' dtype)

    computed in ONE pass over the sources with the online softmax (Milakov & Gimelshein 2018, alg. 3):
    with m_0 = logit_0, z_0 = 1, a_0 = s_0 and for l >= 1

        m_l = max(m_{l-1}, logit_l),  alpha_l = exp(m_{l-1} - m_l),  beta_l = exp(logit_l - m_l)
        z_l = z_{l-1} alpha_l + beta_l,  a_l = a_{l-1} alpha_l + beta_l s_l,   y = a_{L-1} / z_{L-1}

    so each source row is consumed (sums, then the accumulator update) right after it is read, and the
    accumulator a_l lives in registers on cuda. L = 1 gives y = s_0 (a softmax over one logit is 1).
    The L sources are L separate buffers (no stacking copy); L, d are compile-time constants.
    cuda schedule (one row per block): threads per row, vec elements per 128-bit access (defaults: vec =
    8 for 16-bit sources, threads = d / vec when <= 1024 (896 at d = 7168): each source row is then read
    once, with 128-bit loads, into registers); prefetch: the load of source l is issued with source
    l - prefetch (more bytes in flight; costs registers). Built for cuda with StorageRewrite off
    (NO_STORAGE_REWRITE: the race that gave nan / inf on the H200); measured correct on the H200 since
    (relative RMS error 2.0e-05..3.7e-05 in bf16 at d = 7168, L = 2..25; benchmarks/results/tvm.md).
    group: None = two block-wide all-reduces per source (its sum of squares, then its dot product), i.e.
    2L barrier pairs per row; G >= 1 = the 2G sums of G consecutive sources in ONE all-reduce (one
    multi-value reduction block per group, reduced with a registered 2G-value sum reducer:
    ensure_sum_reducer), i.e. ceil(L / G) barrier pairs per row; prefetch then counts groups.
    min_blocks: None, or the minimum resident blocks per multiprocessor promised to the CUDA compiler
    (``__launch_bounds__(threads, min_blocks)``, through TVM's tirx.launch_bounds_min_blocks_per_sm
    attribute; cuda text only, L >= 2). nvcc 13 for sm_90 at d = 7168, L = 25, 448 threads, G 3 / P 1:
    128 registers and 46 bytes of spill stores without it, 128 registers and no spills with 1.
    Raises ValueError for group < 1 or min_blocks < 1."""
    src = _attn_residual_head(d, L, src_dtype, q_dtype, w_dtype)
    if L > 1:
        for l in range(L):
            for nm in ("SS", "DT", "LG", "M"):
                src += f'    {nm}{l} = T.sblock_alloc_buffer((n,), "float32")\n'
            if l:
                for nm in ("AL", "BE", "Z"):
                    src += f'    {nm}{l} = T.sblock_alloc_buffer((n,), "float32")\n'
                if l < L - 1:
                    src += f'    A{l} = T.sblock_alloc_buffer((n, {d}), "float32")\n'

    def row(name, expr):
        return (f"    for i in range(n):\n"
                f'        with T.sblock("{name}"):\n'
                "            vi = T.axis.spatial(n, i)\n"
                f"            {expr}\n")

    if group is not None and group < 1:
        raise ValueError(f"attn_residual: group must be >= 1 (sources per all-reduce), got {group}")
    if min_blocks is not None and min_blocks < 1:
        raise ValueError(f"attn_residual: min_blocks must be >= 1 (blocks per multiprocessor), got {min_blocks}")
    if min_blocks is not None and L == 1:
        raise ValueError("attn_residual: min_blocks applies to L >= 2 (with one source the kernel is a copy)")
    qw = f"{_f32('Q[vk]', q_dtype)} * {_f32('W[vk]', w_dtype)}"
    reductions, row_blocks, accs, order = [], [], [], []
    red_writes, first_use, n_values, bodies = {}, {}, set(), {}
    out = _f32("S0[vi, vk]", src_dtype)
    for l in range(L if L > 1 else 0):
        s = _f32(f"S{l}[vi, vk]", src_dtype)
        if group is not None:
            if l % group == 0:                       # one reduction block for the group's 2G sums
                members = range(l, min(L, l + group))
                name = f"sd{l // group}"
                src += (f"    for i, k in T.grid(n, {d}):\n"
                        f'        with T.sblock("{name}"):\n'
                        '            vi, vk = T.axis.remap("SR", [i, k])\n'
                        "            with T.init():\n")
                for j in members:
                    src += f"                SS{j}[vi] = T.float32(0)\n                DT{j}[vi] = T.float32(0)\n"
                # cuda: the update as let bindings, then the stores (the form TVM's reducer matching needs
                # for a multi-value cross-thread reduction); llvm: plain stores (TVM 0.27's llvm build of
                # the let form gives wrong results for bf16 sources; no cross-thread reduction there)
                let, direct = "", ""
                for j in members:
                    sj = _f32(f"S{j}[vi, vk]", src_dtype)
                    let += (f"            ss{j}: T.let = SS{j}[vi] + {sj} * {sj}\n"
                            f"            dt{j}: T.let = DT{j}[vi] + {qw} * {sj}\n")
                    direct += (f"            SS{j}[vi] = SS{j}[vi] + {sj} * {sj}\n"
                               f"            DT{j}[vi] = DT{j}[vi] + {qw} * {sj}\n")
                for j in members:
                    let += f"            SS{j}[vi] = ss{j}\n            DT{j}[vi] = dt{j}\n"
                bodies[f"#@{name}@\n"] = (direct, let)
                src += f"#@{name}@\n"
                reductions.append(name)
                red_writes[name] = 2 * len(members)
                n_values.add(2 * len(members))
                order.append(name)
            first_use[f"S{l}"] = f"sd{l // group}"
            src += row(f"lg{l}", f"LG{l}[vi] = DT{l}[vi] * T.rsqrt(SS{l}[vi] / {_c(d)} + {_c(eps)})")
            order.append(f"lg{l}")
        else:
            src += _ss_dot_blocks(l, d, s, qw)
            reductions += [f"ss{l}", f"dot{l}"]
            first_use[f"S{l}"] = f"ss{l}"
            src += row(f"lg{l}", f"LG{l}[vi] = DT{l}[vi] * T.rsqrt(SS{l}[vi] / {_c(d)} + {_c(eps)})")
            order += [f"ss{l}", f"dot{l}", f"lg{l}"]
        if l == 0:
            src += row("m0", "#@m0@")
            row_blocks += ["lg0", "m0"]
            order.append("m0")
            continue
        src += row(f"m{l}", f"M{l}[vi] = T.max(M{l - 1}[vi], LG{l}[vi])")
        src += row(f"al{l}", f"AL{l}[vi] = T.exp(M{l - 1}[vi] - M{l}[vi])")
        src += row(f"be{l}", f"BE{l}[vi] = T.exp(LG{l}[vi] - M{l}[vi])")
        zprev = "T.float32(1)" if l == 1 else f"Z{l - 1}[vi]"
        src += row(f"z{l}", f"Z{l}[vi] = {zprev} * AL{l}[vi] + BE{l}[vi]")
        row_blocks += [f"lg{l}", f"m{l}", f"al{l}", f"be{l}", f"z{l}"]
        order += [f"m{l}", f"al{l}", f"be{l}", f"z{l}"]
        aprev = _f32("S0[vi, vk]", src_dtype) if l == 1 else f"A{l - 1}[vi, vk]"
        upd = f"{aprev} * AL{l}[vi] + BE{l}[vi] * {s}"
        if l < L - 1:
            src += (f"    for i, k in T.grid(n, {d}):\n"
                    f'        with T.sblock("a{l}"):\n'
                    '            vi, vk = T.axis.remap("SS", [i, k])\n'
                    f"            A{l}[vi, vk] = {upd}\n")
            accs.append(f"a{l}")
            order.append(f"a{l}")
        else:
            out = f"({upd}) / Z{l}[vi]"
    src += (f"    for i, k in T.grid(n, {d}):\n"
            '        with T.sblock("out"):\n'
            '            vi, vk = T.axis.remap("SS", [i, k])\n'
            f"            Y[vi, vk] = {_store(out, src_dtype)}\n")
    if vec is None:
        vec = _lanes(src_dtype)
    if threads is None:
        threads = _row_threads(d, vec) if vec > 1 else 0
        if not threads:
            vec, threads = 1, CUDA_THREADS
    if L == 1:
        sources, first_use, vectors = {"S0": ["out"]}, {}, ["S0"]
    else:
        qw_users = sorted({b for b in reductions if not b.startswith("ss")}, key=reductions.index)
        sources = {"Q": qw_users, "W": list(qw_users)}
        for l in range(L):
            cons = [f"sd{l // group}"] if group is not None else [f"ss{l}", f"dot{l}"]
            cons.append(f"a{l}" if 0 < l < L - 1 else "out" if l == L - 1 else ("a1" if L > 2 else "out"))
            sources[f"S{l}"] = cons
        vectors = ["Q", "W"]
    sched = (("impl", "onepass"), ("threads", threads), ("vec", vec), ("prefetch", prefetch))
    if group is not None:
        sched += (("group", group),)
    if min_blocks is not None:
        sched += (("min_blocks", min_blocks),)
    m0 = "M0[vi] = LG0[vi]"
    # the launch-bounds attribute: an AttrStmt inside the kernel (any block under the row loop; here the
    # one-line block m0), which TVM's LaunchBoundsAttrExtractor turns into __launch_bounds__(t, min_blocks)
    bodies["#@m0@"] = (m0, m0 if min_blocks is None else
                       f'with T.attr(T.int32(0), "tirx.launch_bounds_min_blocks_per_sm", {int(min_blocks)}):\n'
                       f"                {m0}")
    cuda_src = src
    for mark, (direct, let) in bodies.items():
        src, cuda_src = src.replace(mark, direct), cuda_src.replace(mark, let)
    if cuda_src == src:
        cuda_src = None
    return Kernel("attn_residual", "attn_residual", src, cuda_source=cuda_src,
                  info={"d": d, "L": L, "reductions": reductions, "row_blocks": row_blocks, "accs": accs,
                   "order": order, "out": "out", "sources": sources, "first_use": first_use,
                   "vectors": vectors, "impl": "onepass", "reduction_writes": red_writes,
                   "sum_reducers": sorted(v for v in n_values if v > 1)},
                  sched=sched, cuda_pass_config=NO_STORAGE_REWRITE)


# defaults of the pipelined attn_residual kernel: the best of the H200 run of the 5th session (N = 16384,
# d = 7168, bf16, benchmarks/results/tvm.md): 224 threads, a ring of 8 rows, 4 sources per barrier; TVM /
# Triton time 0.76 / 0.88 / 0.97 / 0.90 at L = 2 / 8 / 16 / 25 (100% of copy bandwidth at L = 25) against
# 0.74 / 0.89 / 1.10 / 1.06 with 4 rows and 1 source per barrier
PIPELINED_STAGES, PIPELINED_GROUP = 8, 4
PIPELINED_SMEM_LIMIT = 200 * 1024        # bytes of ring per block (sm_90 allows 227 KiB of shared memory)


def pipelined_threads(d: int, src_dtype: str) -> int:
    """Default threads per row of the pipelined attn_residual kernel: four 128-bit vectors per thread (224
    at d = 7168 in bf16: 0.76-0.97x the Triton kernel's time on the H200 at L = 2..25 with 8 stages and
    groups of 4, against 0.78-1.12x with 448 threads x 2 vectors; benchmarks/results/tvm.md), else two,
    else one (8 or 16 for rows longer than 4096 vectors); 0 when none of these splits the row's d / vec
    vectors into whole warps of at most 1024 threads (its sums go through warp shuffles)."""
    vec = _lanes(src_dtype)
    if d % vec:
        return 0
    nv = d // vec
    for per in (4, 2, 1, 8, 16):          # 8 / 16 vectors per thread only for rows too long for 1024 x 4
        if nv % per == 0 and (nv // per) % 32 == 0 and nv // per <= 1024:
            return nv // per
    return 0


def _pipelined_problem(d: int, src_dtype: str, threads: int | None) -> str | None:
    """None when the pipelined kernel fits this row (a ring row in shared memory, a whole-warp layout with
    these threads or pipelined_threads' default), else what does not fit, as an error message."""
    vec = _lanes(src_dtype)
    row_bytes = d * (16 // vec)
    if row_bytes > PIPELINED_SMEM_LIMIT:
        return (f"attn_residual: impl 'pipelined' keeps whole rows in shared memory; a row of d = {d} is "
                f"{row_bytes} bytes, over the {PIPELINED_SMEM_LIMIT} allowed: use impl='onepass'")
    if threads is None:
        if not pipelined_threads(d, src_dtype):
            return (f"attn_residual: impl 'pipelined' needs the row's d / {vec} 128-bit vectors to split into "
                    f"whole warps (a multiple of 32 threads, at most 1024, with 1, 2, 4, 8 or 16 vectors each), "
                    f"got d = {d}; use impl='onepass'")
    elif d % vec or threads % 32 or not 0 < threads <= 1024 or (d // vec) % threads:
        return (f"attn_residual: impl 'pipelined' with {threads} threads needs d / {vec} = {d / vec:g} to be a "
                f"multiple of the threads, and the threads a multiple of 32 and <= 1024")
    return None


def _attn_residual_pipelined_source(d: int, L: int, src_dtype: str, q_dtype: str, w_dtype: str, eps: float, *,
                                    threads: int | None = None, stages: int | None = None,
                                    group: int | None = None) -> Kernel:
    """Block AttnRes (arXiv 2603.15031; spec/OPS.md attn_residual), the math of the one-pass kernel (online
    softmax over the L sources, Milakov & Gimelshein 2018 alg. 3; float32 sums and accumulator), written
    for cuda directly as thread-bound TensorIR instead of being scheduled:

    * one token row per block of ``threads`` threads; thread t owns the 128-bit vectors t, t + threads, ...
      of the row (vec = 8 bf16 / fp16, 4 float32 elements each);
    * the sources stream through a ring of ``stages`` row buffers in shared memory with cp.async
      (``cp.async.cg.shared.global`` 16 bytes, one commit group per source, ``cp.async.wait_group``): a
      thread only ever reads the vectors it copied itself, so the ring needs no barrier, and the bytes in
      flight cost no registers (the register-prefetching one-pass kernel needs 128 registers at L >= 8,
      i.e. one block of 14 warps per SM; this one about 64, two blocks);
    * ``group`` G sources per block-wide reduction: their 2G partial sums (sum of squares, dot with
      query * rms_weight) are reduced in each warp with shuffles, written by lane 0 to one of two
      alternating shared arrays, and summed by every thread after ONE barrier (ceil(L / G) barriers per
      row); the accumulator update re-reads the G rows from the ring;
    * after a group is consumed its ring slots are refilled with the sources ``stages`` ahead.

    llvm text: the default one-pass kernel (the CPU build has no cp.async); the cuda text is built with no
    schedule (``info["cuda_prescheduled"]``). Defaults: threads = pipelined_threads(d, src_dtype), stages
    = PIPELINED_STAGES, group = PIPELINED_GROUP, each capped by L and by the rows that fit in
    PIPELINED_SMEM_LIMIT bytes (group also by stages). Shared memory: stages * d * element size bytes
    (dynamic shared memory above 48 KiB). Measured on the H200 (d = 7168, bf16, L = 2..25): correct
    (relative RMS error 2.1e-05..3.8e-05, Triton's 2.2e-05..3.8e-05) in every setting tried.
    Raises ValueError when the row has no whole-warp layout (pipelined_threads; use "onepass"), for
    threads that do not divide the row's vectors into whole warps, stages beyond the shared-memory limit,
    stages < group or group < 1."""
    portable = _attn_residual_onepass_source(d, L, src_dtype, q_dtype, w_dtype, eps,
                                             **onepass_defaults(d, L, src_dtype))
    problem = _pipelined_problem(d, src_dtype, threads)
    if problem:
        raise ValueError(problem)
    vec = _lanes(src_dtype)
    esz = 16 // vec
    row_bytes, nv = d * esz, d // vec
    threads = pipelined_threads(d, src_dtype) if threads is None else threads
    fit = max(1, PIPELINED_SMEM_LIMIT // row_bytes)         # ring rows that fit the shared memory of a block
    if group is not None and group < 1:
        raise ValueError(f"attn_residual: group must be >= 1 (sources per block-wide reduction), got {group}")
    if stages is not None and stages > fit:
        raise ValueError(f"attn_residual: impl 'pipelined' with stages = {stages} needs {stages * row_bytes} bytes of "
                         f"shared memory, over the {PIPELINED_SMEM_LIMIT} allowed (at most {fit} rows of {row_bytes} "
                         f"bytes)")
    stages = min(PIPELINED_STAGES if stages is None else stages, L, fit)
    group = min(PIPELINED_GROUP, stages) if group is None else min(group, L)
    if stages < group:
        raise ValueError(f"attn_residual: impl 'pipelined' needs stages >= group (the ring holds a whole group), "
                         f"got stages {stages}, group {group}")
    vpt, W, G, R = nv // threads, threads // 32, group, stages
    E = vpt * vec
    smem = R * d * esz
    scope = "shared" if smem <= 48 * 1024 else "shared.dyn"
    f32 = lambda e: _f32(e, src_dtype)                                    # noqa: E731
    col = lambda u: f"(tx + {threads * u}) * {vec}"                       # noqa: E731  (first element of vector u)
    o: list[str] = [_attn_residual_head(d, L, src_dtype, q_dtype, w_dtype, s_tir=False).rstrip("\n")]
    a = o.append
    a('    bx = T.launch_thread("blockIdx.x", n)')
    a(f'    tx = T.launch_thread("threadIdx.x", {threads})')
    a(f'    ring = T.alloc_shared([{R}, {d}], "{src_dtype}", scope="{scope}")')
    # two reduction arrays used by alternate groups: a write to one is separated from the previous reads
    # of the same array by the other group's barrier (separate buffers, so TVM's barrier insertion sees it)
    a(f'    red0 = T.alloc_shared([{W}, {2 * G}], "float32")')
    a(f'    red1 = T.alloc_shared([{W}, {2 * G}], "float32")')
    a(f'    qw = T.alloc_local([{E}], "float32")')
    a(f'    acc = T.alloc_local([{E}], "float32")')
    a(f'    ps = T.alloc_local([{2 * G}], "float32")')
    a('    st = T.alloc_local([4], "float32")')             # running max m, running sum z, alpha, new max
    a(f'    xb = T.alloc_local([{vec}], "{src_dtype}")')
    a(f'    qb = T.alloc_local([{vec}], "{q_dtype}")')
    a(f'    wb = T.alloc_local([{vec}], "{w_dtype}")')
    for u in range(vpt):                                   # query * rms_weight, once per thread, in float32
        a(f"    for v in T.vectorized({vec}):")
        a(f"        qb[v] = Q[{col(u)} + v]")
        a(f"    for v in T.vectorized({vec}):")
        a(f"        wb[v] = W[{col(u)} + v]")
        a(f"    for v in T.unroll({vec}):")
        a(f"        qw[{u * vec} + v] = {_f32('qb[v]', q_dtype)} * {_f32('wb[v]', w_dtype)}")

    def issue(l):              # source l -> ring slot l % R (an empty commit group past the last source)
        if l < L:
            for u in range(vpt):
                a(f"    T.ptx.cp.async_.cg.shared.global_(T.address_of(ring[{l % R}, {col(u)}]), "
                  f"T.address_of(S{l}[bx, {col(u)}]), 16)")
        a("    T.ptx.cp.async_.commit_group()")

    def load(slot, u):
        a(f"    for v in T.vectorized({vec}):")
        a(f"        xb[v] = ring[{slot}, {col(u)} + v]")

    for l in range(R):
        issue(l)
    for g in range((L + G - 1) // G):
        mem = list(range(g * G, min(L, g * G + G)))
        # committed so far: sources 0 .. g G + R - 1 (one group each); the last of this group done
        a(f"    T.ptx.cp.async_.wait_group({R - len(mem)})")
        for j, l in enumerate(mem):
            a(f"    ps[{2 * j}] = T.float32(0)")
            a(f"    ps[{2 * j + 1}] = T.float32(0)")
            for u in range(vpt):
                load(l % R, u)
                a(f"    for v in T.unroll({vec}):")
                a(f"        ps[{2 * j}] = ps[{2 * j}] + {f32('xb[v]')} * {f32('xb[v]')}")
                a(f"        ps[{2 * j + 1}] = ps[{2 * j + 1}] + qw[{u * vec} + v] * {f32('xb[v]')}")
        nvals = 2 * len(mem)
        for off in (16, 8, 4, 2, 1):
            for i in range(nvals):
                a(f"    ps[{i}] = ps[{i}] + T.tvm_warp_shuffle_xor(T.uint32(4294967295), ps[{i}], {off}, 32, 32)")
        red = f"red{g % 2}"
        a("    if tx % 32 == 0:")
        for i in range(nvals):
            a(f"        {red}[tx // 32, {i}] = ps[{i}]")
        a('    T.tvm_storage_sync("shared")')
        for j, l in enumerate(mem):
            a("    ps[0] = T.float32(0)")
            a("    ps[1] = T.float32(0)")
            for w in range(W):             # every thread sums the warps' partials in the same order
                a(f"    ps[0] = ps[0] + {red}[{w}, {2 * j}]")
                a(f"    ps[1] = ps[1] + {red}[{w}, {2 * j + 1}]")
            a(f"    ps[1] = ps[1] * T.rsqrt(ps[0] / {_c(d)} + {_c(eps)})")        # the logit
            if l == 0:
                a("    st[0] = ps[1]")
                a("    st[1] = T.float32(1)")
                upd = lambda u: f32("xb[v]")                               # noqa: E731  (a_0 = s_0)
            else:
                a("    st[3] = T.max(st[0], ps[1])")
                a("    st[2] = T.exp(st[0] - st[3])")                 # alpha = exp(m_old - m_new)
                a("    ps[1] = T.exp(ps[1] - st[3])")                 # beta = exp(logit - m_new)
                a("    st[1] = st[1] * st[2] + ps[1]")
                a("    st[0] = st[3]")
                upd = lambda u: f"acc[{u * vec} + v] * st[2] + ps[1] * {f32('xb[v]')}"   # noqa: E731
            for u in range(vpt):
                load(l % R, u)
                a(f"    for v in T.unroll({vec}):")
                a(f"        acc[{u * vec} + v] = {upd(u)}")
        for l in mem:                      # the group's slots are free (this thread read its own vectors)
            issue(l + R)
    for u in range(vpt):
        a(f"    for v in T.unroll({vec}):")
        a(f"        xb[v] = {_store(f'acc[{u * vec} + v] / st[1]', src_dtype)}")
        a(f"    for v in T.vectorized({vec}):")
        a(f"        Y[bx, {col(u)} + v] = xb[v]")
    sched = (("impl", "pipelined"), ("threads", threads), ("stages", R), ("group", G))
    return Kernel("attn_residual", "attn_residual", portable.source, cuda_source="\n".join(o) + "\n",
                  info={**portable.info, "impl": "pipelined", "cuda_prescheduled": True, "smem_bytes": smem},
                  sched=sched, cuda_pass_config=NO_STORAGE_REWRITE)


# sizes n of the n-value float32 sum reducers registered with TVM's schedule in this process
_SUM_REDUCERS: set[int] = set()


def ensure_sum_reducer(n: int) -> None:
    """Register with TVM (s_tir.schedule.RegisterReducer) the reducer that sums n float32 values
    elementwise, ((x_1 + y_1, ..., x_n + y_n), identity 0), once per process, so that a reduction block
    writing n buffers (the grouped one-pass attn_residual) becomes ONE cross-thread all-reduce of n values
    on cuda (TVM registers only one-value sums and two-value argmax / argmin). The two getter functions
    are converted to TVM FFI functions and given one extra reference that is never released: TVM's
    registry is a static object destroyed after the Python interpreter, and freeing a Python callback
    then crashes the process at exit (TVM 0.27, seen here: SIGSEGV in PyGILState_Ensure)."""
    if n < 2 or n in _SUM_REDUCERS:
        return
    import ctypes
    import tvm
    import tvm_ffi
    import tvm_ffi.libinfo
    from tvm import tirx

    def combiner(x, y):
        return [a + b for a, b in zip(x, y)]

    def identity(values):
        return [tirx.const(0.0, "float32") for _ in values]

    fns = [tvm_ffi.convert(combiner), tvm_ffi.convert(identity)]
    lib = ctypes.CDLL(tvm_ffi.libinfo.find_libtvm_ffi())
    for f in fns:
        lib.TVMFFIObjectIncRef(ctypes.c_void_p(f.__chandle__()))
    tvm.get_global_func("s_tir.schedule.RegisterReducer")(n, *fns)
    _SUM_REDUCERS.add(n)


# ----------------------------------------------------------------------------------------------------
# short_conv: causal depthwise convolution over time
# ----------------------------------------------------------------------------------------------------

def _tree_sum(terms: list) -> str:
    """The sum of the expressions `terms` as a balanced tree of additions: its depth grows as log2(len(terms)),
    where a chain a + b + c + ... nests len(terms) deep, past what TVMScript's recursive parser and printer take
    (a short_conv of width 400 hit Python's recursion limit; user trial, 14th session)."""
    if len(terms) == 1:
        return terms[0]
    h = len(terms) // 2
    return f"({_tree_sum(terms[:h])} + {_tree_sum(terms[h:])})"


def short_conv_source(C: int, W: int, x_dtype: str, w_dtype: str, out_dtype: str, *, vec: int = 2,
                      threads: int = 256, tile_t: int = 8) -> Kernel:
    """y[b, t, c] = sum_{j<W} w[c, j] * x[b, t - W + 1 + j, c], x taken as 0 before t = 0 (causal
    depthwise conv, as backends/reference short_conv with no initial state). x, y [B, T, C] with B, T
    symbolic; w [C, W]; float32 math. vec, threads, tile_t: the cuda schedule (contiguous channels per
    thread, threads per block, time steps per thread). The x loads carry a per-tap guard, so they stay
    scalar; vec > 1 stores whole vectors. Defaults vec = 2, threads = 256, tile_t = 8: the measured best
    on the H200 (bf16, C = 12288, W = 4, T = 16384: 0.297 ms, 1.16x Triton; vec = 1 0.539 ms, vec = 8
    1.984 ms; benchmarks/results/tvm.md). A C not divisible by vec runs with vec = 1."""
    if C < 1 or W < 1:
        raise ValueError(f"short_conv: channels and width must be >= 1, got C = {C}, W = {W}")
    _check_dtype(x_dtype, "short_conv x")
    _check_dtype(w_dtype, "short_conv weight")
    _check_dtype(out_dtype, "short_conv output")
    src = _header("short_conv", ["x_h", "w_h", "y_h"])
    src += "    b = T.int64()\n    t = T.int64()\n"
    src += f'    X = T.match_buffer(x_h, (b, t, {C}), "{x_dtype}")\n'
    src += f'    Wt = T.match_buffer(w_h, ({C}, {W}), "{w_dtype}")\n'
    src += f'    Y = T.match_buffer(y_h, (b, t, {C}), "{out_dtype}")\n'
    terms = []
    for j in range(W):
        lag = W - 1 - j
        xj = _f32(f"X[vb, vt - T.int64({lag}), vc]" if lag else "X[vb, vt, vc]", x_dtype)
        wj = _f32(f"Wt[vc, {j}]", w_dtype)
        terms.append(f"T.if_then_else(vt >= T.int64({lag}), {xj}, T.float32(0)) * {wj}" if lag else f"{xj} * {wj}")
    src += (f"    for ib, it, ic in T.grid(b, t, {C}):\n"
            '        with T.sblock("conv"):\n'
            '            vb, vt, vc = T.axis.remap("SSS", [ib, it, ic])\n'
            f"            Y[vb, vt, vc] = {_store(_tree_sum(terms), out_dtype)}\n")
    return Kernel("short_conv", "short_conv", src, {"C": C, "W": W},
                  sched=(("vec", vec), ("threads", threads), ("tile_t", tile_t)))


# ----------------------------------------------------------------------------------------------------
# router scoring: scores = sigmoid(x @ weight^T) in float32
# ----------------------------------------------------------------------------------------------------

def router_source(d: int, E: int, x_dtype: str, w_dtype: str) -> Kernel:
    """scores[i, e] = sigmoid(sum_d x[i, d] * weight[e, d]) (float32; spec/OPS.md qb_route). x [n, d] with
    n symbolic, weight [E, d], scores [n, E] float32."""
    if d < 1 or E < 1:
        raise ValueError(f"router_scores: d and E must be >= 1, got d = {d}, E = {E}")
    _check_dtype(x_dtype, "router x")
    _check_dtype(w_dtype, "router weight")
    src = _header("router_scores", ["x_h", "w_h", "s_h"])
    src += "    n = T.int64()\n"
    src += f'    X = T.match_buffer(x_h, (n, {d}), "{x_dtype}")\n'
    src += f'    Wr = T.match_buffer(w_h, ({E}, {d}), "{w_dtype}")\n'
    src += f'    S = T.match_buffer(s_h, (n, {E}), "float32")\n'
    src += f'    ACC = T.sblock_alloc_buffer((n, {E}), "float32")\n'
    src += (f"    for i, e, k in T.grid(n, {E}, {d}):\n"
            '        with T.sblock("dot"):\n'
            '            vi, ve, vk = T.axis.remap("SSR", [i, e, k])\n'
            "            with T.init():\n"
            "                ACC[vi, ve] = T.float32(0)\n"
            f"            ACC[vi, ve] = ACC[vi, ve] + {_f32('X[vi, vk]', x_dtype)} * {_f32('Wr[ve, vk]', w_dtype)}\n")
    src += (f"    for i, e in T.grid(n, {E}):\n"
            '        with T.sblock("sig"):\n'
            '            vi, ve = T.axis.remap("SS", [i, e])\n'
            "            S[vi, ve] = T.sigmoid(ACC[vi, ve])\n")
    return Kernel("router_scores", "router", src, {"d": d, "E": E})


# ----------------------------------------------------------------------------------------------------
# schedules
# ----------------------------------------------------------------------------------------------------

def parse(kernel: Kernel, kind: str = "llvm"):
    """The PrimFunc of a kernel's TVMScript text for ``kind`` (needs TVM's compiler library)."""
    from tvm.script import from_source
    return from_source(kernel.text(kind))


def schedule(kernel: Kernel, kind: str):
    """Apply the CPU ("llvm") or GPU ("cuda") schedule; returns the scheduled IRModule."""
    import tvm.s_tir
    if kind not in ("llvm", "cuda"):
        raise ValueError(f"tvm schedule: kind must be 'llvm' or 'cuda', got {kind!r}")
    if kind == "cuda" and kernel.info.get("cuda_prescheduled"):
        import tvm
        return tvm.IRModule({"main": parse(kernel, kind)})     # thread-bound already: nothing to schedule
    for nv in kernel.info.get("sum_reducers", ()):
        ensure_sum_reducer(nv)
    sch = tvm.s_tir.Schedule(parse(kernel, kind))
    fn = {"elementwise": _sched_elementwise, "rownorm": _sched_rows, "attn_residual": _sched_attn_residual,
          "short_conv": _sched_short_conv, "router": _sched_router}[kernel.family]
    fn(sch, {**kernel.info, **dict(kernel.sched)}, kind)
    return sch.mod


def _sched_attn_residual(sch, info, kind):
    """attn_residual: the restored b963733 schedule for impl "twopass", the row schedule for "onepass"."""
    if info.get("impl") == "twopass":
        return _sched_attn_residual_twopass(sch, info, kind)
    return _sched_rows(sch, info, kind)


def _sched_attn_residual_twopass(sch, info, kind):
    """The schedule of commit b963733 for the two-pass attn_residual kernel, unchanged (measured correct
    on the H200). llvm: 4 rows per parallel task, the row's sums and scalars computed under the row loop
    into thread-local buffers, the output vectorised by 8. cuda: one row per block (blockIdx.x), 256
    threads along d (threadIdx.x); the 2L row sums become cross-thread all-reduces whose results land in
    every thread's registers; the logits / max / sum over L are computed redundantly by every thread."""
    out = sch.get_sblock(info["out"])
    i, k = sch.get_loops(out)
    producers = list(info["reductions"]) + list(info["row_blocks"])
    if kind == "llvm":
        io, ii = sch.split(i, [None, 4])
        sch.parallel(io)
        row = ii
        _, _, k = sch.get_loops(out)
        ko, kv = sch.split(k, [None, CPU_VECTOR])
        sch.vectorize(kv)
        for name in reversed(producers):
            sch.compute_at(sch.get_sblock(name), row, preserve_unit_loops=True)
        for name in producers:
            sch.set_scope(sch.get_sblock(name), 0, "local")
    else:
        sch.bind(i, "blockIdx.x")
        ko, kt = sch.split(k, [None, CUDA_THREADS])
        sch.bind(kt, "threadIdx.x")
        for name in reversed(producers):
            sch.compute_at(sch.get_sblock(name), i, preserve_unit_loops=True)
        for name in info["reductions"]:
            b = sch.get_sblock(name)
            loops = sch.get_loops(b)
            _, rt = sch.split(loops[-1], [None, CUDA_THREADS])
            sch.bind(rt, "threadIdx.x")
            sch.set_scope(b, 0, "local")
        for name in info["row_blocks"]:
            sch.set_scope(sch.get_sblock(name), 0, "local")


def _sched_elementwise(sch, info, kind):
    blk = sch.get_sblock("y")
    i, j = sch.get_loops(blk)
    if kind == "llvm":
        f = sch.fuse(i, j)
        io, ii, iv = sch.split(f, [None, CPU_ELEMS_PER_TASK // CPU_VECTOR, CPU_VECTOR])
        sch.parallel(io)
        sch.vectorize(iv)
        return
    # cuda: one [vec] row = one 128-bit access per thread; `unroll` rows per thread, strided by the block
    # so that each access instruction of a warp stays contiguous (coalesced)
    threads, unroll = info["threads"], info["unroll"]
    io, iu, it = sch.split(i, [None, unroll, threads])
    sch.bind(io, "blockIdx.x")
    sch.bind(it, "threadIdx.x")
    if info["vec"] > 1:
        # stage through registers so that loads and stores are whole vectors; the math stays scalar
        # float32 (TVM's float32x8 vector code is not valid CUDA)
        for k in range(info["arity"]):
            c = sch.cache_read(blk, k, "local")
            sch.compute_at(c, it)
            sch.vectorize(sch.get_loops(c)[-1])
        w = sch.cache_write(blk, 0, "local")
        sch.reverse_compute_at(w, it)
        sch.vectorize(sch.get_loops(w)[-1])
        sch.unroll(sch.get_loops(blk)[-1])
    if unroll > 1:
        sch.unroll(iu)


def _local_writes(sch, block, info, name):
    """Every buffer a reduction block writes (2G sums for a grouped attn_residual block, else one) in
    thread-local scope."""
    for j in range(info.get("reduction_writes", {}).get(name, 1)):
        sch.set_scope(block, j, "local")


def _sched_rows(sch, info, kind):
    """Row-wise kernels: the output block's row loop carries every per-row producer (compute_at)."""
    out = sch.get_sblock(info["out"])
    i, k = sch.get_loops(out)
    producers = list(info.get("order") or (list(info["reductions"]) + list(info["row_blocks"])))
    accs = set(info.get("accs", ()))
    if kind == "llvm":
        io, ii = sch.split(i, [None, 4])        # 4 rows per task: fewer, larger parallel tasks
        sch.parallel(io)
        row = ii
        _, _, k = sch.get_loops(out)
        ko, kv = sch.split(k, [None, CPU_VECTOR])
        sch.vectorize(kv)
        for name in reversed(producers):
            sch.compute_at(sch.get_sblock(name), row, preserve_unit_loops=True)
        for name in producers:
            _local_writes(sch, sch.get_sblock(name), info, name)
        return
    d = info["d"]
    if info.get("vec", 1) > 1 and d % (info.get("threads", CUDA_THREADS) * info["vec"]) == 0:
        return _sched_rows_vec(sch, info)
    threads = info.get("threads", CUDA_THREADS)
    rows = info.get("rows", 1)
    tx = min(threads, d)
    if rows > 1:
        # several rows per block (small d): threadIdx.y picks the row, threadIdx.x walks it; the per-row
        # sums are then warp all-reduces (no shared memory when tx <= 32)
        io, iy = sch.split(i, [None, rows])
        sch.bind(io, "blockIdx.x")
        sch.bind(iy, "threadIdx.y")
        row = iy
    else:
        sch.bind(i, "blockIdx.x")
        row = i
    ko, kt = sch.split(sch.get_loops(out)[-1], [None, tx])
    sch.bind(kt, "threadIdx.x")
    # each producer at the FIRST legal point of the row body, last producer first: the row body then runs
    # the blocks in program order (for attn_residual: source l's sums, its row scalars and the
    # accumulator update before source l + 1 is read), not all sums first
    for name in reversed(producers):
        sch.compute_at(sch.get_sblock(name), row, preserve_unit_loops=True, index=-2 if accs else -1)
    for name in info["reductions"]:
        b = sch.get_sblock(name)
        _, rt = sch.split(sch.get_loops(b)[-1], [None, tx])
        sch.bind(rt, "threadIdx.x")
        _local_writes(sch, b, info, name)      # all-reduce result lands in every thread's registers
    for name in info["row_blocks"]:            # a few float32 per row: every thread computes them
        sch.set_scope(sch.get_sblock(name), 0, "local")
    for name in accs:                          # the row accumulator: d / tx float32 per thread, same
        b = sch.get_sblock(name)               # thread -> element map as the output, unrolled (registers)
        ao, at = sch.split(sch.get_loops(b)[-1], [None, tx])
        sch.bind(at, "threadIdx.x")
        sch.set_scope(b, 0, "local")
        sch.unroll(ao)
    if accs:
        sch.unroll(ko)


def _sched_rows_vec(sch, info):
    """cuda row kernels with whole-vector accesses: every source row (and the [d] vectors) is loaded once
    into registers with 128-bit loads (``cache_read`` to "local", ``vec`` lanes per load), every reader
    of it (the sums, the accumulator, the output) takes it from there, and the output row is staged in
    registers and stored with 128-bit stores. Thread kt of a row owns elements ko * tx * vec + kt * vec +
    [0, vec) for ko < d / (tx * vec): the same map for every block of the row, so the per-thread
    pieces stay in registers (all their loops unrolled: constant indices). Keep d / (tx * vec) <= 2: TVM
    compacts a thread's strided piece to its bounding box ((d / (tx vec) - 1) tx vec + vec elements) and
    at 4 vectors per thread (d = 7168, tx = 224) nvcc leaves that array in local memory (10.9 KB stack,
    ptxas), while 1 or 2 vectors per thread stay in registers."""
    vec = info["vec"]
    tx, rows = info.get("threads", CUDA_THREADS), info.get("rows", 1)
    accs = list(info.get("accs", ()))
    out = sch.get_sblock(info["out"])
    wb = sch.cache_write(out, 0, "local")            # out computes into registers, wb stores them
    i, k = sch.get_loops(wb)
    if rows > 1:
        io, iy = sch.split(i, [None, rows])
        sch.bind(io, "blockIdx.x")
        sch.bind(iy, "threadIdx.y")
        row = iy
    else:
        sch.bind(i, "blockIdx.x")
        row = i

    def tile(block, reduce=False, vectorize=False):
        ko, kt, kv = sch.split(sch.get_loops(block)[-1], [None, tx, vec])
        if reduce:
            sch.reorder(ko, kv, kt)                  # thread loop innermost: in-thread sums, then all-reduce
        sch.bind(kt, "threadIdx.x")
        if vectorize:
            sch.vectorize(kv)
        else:
            sch.unroll(kv)
        sch.unroll(ko)

    tile(wb, vectorize=True)
    caches = {}
    for buf, consumers in info["sources"].items():
        caches[buf] = sch.cache_read(consumers[0], buf, "local", consumer_blocks=list(consumers))
    # program order: [caches of the [d] vectors] + per step [cache of its source, its blocks] + [out]
    # with prefetch P the load of a source is issued P sources ahead of its first use (software
    # pipelining: P + 1 source rows in flight per block, as the all-reduces between sources are
    # barriers that loads do not cross)
    pf = info.get("prefetch", 0)
    anchors = [n for n in info["order"] if n in info["first_use"].values()]
    ahead = {}
    for buf, first in info["first_use"].items():
        j = anchors.index(first)
        ahead.setdefault(anchors[max(0, j - pf)], []).append(buf)
    order = [caches[b] for b in info.get("vectors", ())]
    for name in info["order"]:
        order += [caches[b] for b in ahead.get(name, ())]
        order.append(sch.get_sblock(name))
    order.append(out)
    for b in reversed(order):                        # first legal point, last block first: program order
        sch.compute_at(b, row, preserve_unit_loops=True, index=-2)
    for c in caches.values():
        tile(c, vectorize=True)
    for name in info["reductions"]:
        b = sch.get_sblock(name)
        tile(b, reduce=True)
        _local_writes(sch, b, info, name)
    for name in info["row_blocks"]:
        sch.set_scope(sch.get_sblock(name), 0, "local")
    for name in accs:
        b = sch.get_sblock(name)
        tile(b)
        sch.set_scope(b, 0, "local")
    tile(out)


def _sched_short_conv(sch, info, kind):
    blk = sch.get_sblock("conv")
    ib, it, ic = sch.get_loops(blk)
    if kind == "llvm":
        bt = sch.fuse(ib, it)
        o, inner = sch.split(bt, [None, 16])
        sch.parallel(o)
        _, cv = sch.split(ic, [None, CPU_VECTOR])
        sch.vectorize(cv)
        return
    # cuda: a block covers `tile_t` time steps x (threads * vec) channels; each thread walks its time
    # steps serially (unrolled: the W-1 inputs it shares with the previous step stay in L1 / registers)
    # over `vec` contiguous channels (one 128-bit access when vec * element size = 16 bytes)
    C, vec, threads, tt = info["C"], info["vec"], info["threads"], info["tile_t"]
    if C % vec:
        vec = 1
    cvecs = C // vec
    threads = min(threads, cvecs)
    to, ti = sch.split(it, [None, tt])
    co, cv = sch.split(ic, [None, vec])
    cb, ct = sch.split(co, [None, threads])
    sch.reorder(ib, to, cb, ct, ti, cv)
    sch.bind(to, "blockIdx.x")      # a grid axis each: no division by the symbolic T in the index math
    sch.bind(cb, "blockIdx.y")
    sch.bind(ib, "blockIdx.z")      # B <= 65535
    sch.bind(ct, "threadIdx.x")
    if vec > 1:
        x_local = sch.cache_write(blk, 0, "local")
        sch.reverse_compute_at(x_local, ti)
        sch.vectorize(sch.get_loops(x_local)[-1])
        sch.unroll(cv)
    sch.unroll(ti)
    # the thread's vec x W weights: loaded once (contiguous: one vector load when they fill 8 or 16 bytes)
    wl = sch.cache_read(blk, "Wt", "local")
    sch.compute_at(wl, ct, preserve_unit_loops=True)
    lw = sch.get_loops(wl)
    f = sch.fuse(lw[-2], lw[-1])
    nw = vec * info["W"]
    lanes = 8 if nw % 8 == 0 else 4 if nw % 4 == 0 else 1
    if lanes > 1:
        fo, fv = sch.split(f, [None, lanes])
        sch.vectorize(fv)
        sch.unroll(fo)
    else:
        sch.unroll(f)


def _sched_router(sch, info, kind):
    sig = sch.get_sblock("sig")
    dot = sch.get_sblock("dot")
    i, e = sch.get_loops(sig)
    if kind == "llvm":
        sch.parallel(i)
        sch.compute_at(dot, e, preserve_unit_loops=True)
        sch.set_scope(dot, 0, "local")
    else:
        sch.bind(i, "blockIdx.x")              # one token row per block, experts over the threads
        _, et = sch.split(e, [None, min(info["E"], CUDA_THREADS)])
        sch.bind(et, "threadIdx.x")
        sch.compute_at(dot, et, preserve_unit_loops=True)
        sch.set_scope(dot, 0, "local")
