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

attn_residual's kernel texts are in attn_kernels.py (scheduled here: the one-pass kernel by the row schedule).

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
    if kernel.info.get("sum_reducers"):
        from .attn_kernels import ensure_sum_reducer
        for nv in kernel.info["sum_reducers"]:
            ensure_sum_reducer(nv)
    sch = tvm.s_tir.Schedule(parse(kernel, kind))
    fn = {"elementwise": _sched_elementwise, "rownorm": _sched_rows, "attn_residual": _sched_rows,
          "short_conv": _sched_short_conv, "router": _sched_router}[kernel.family]
    fn(sch, {**kernel.info, **dict(kernel.sched)}, kind)
    return sch.mod


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
