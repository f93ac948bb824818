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

SCHEDULE_VERSION = "1"          # bump when a schedule below changes (part of every cache key)

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


def _header(name: str, params: list[str]) -> str:
    args = ", ".join(f"{p}: T.handle" for p in params)
    return (f"@T.prim_func(s_tir=True)\n"
            f"def {name}({args}):\n"
            f'    T.func_attr({{"global_symbol": "{name}", "tirx.noalias": True}})\n')


# ----------------------------------------------------------------------------------------------------
# elementwise: silu, sigmoid, add, mul, situ_glu over a flat buffer of n elements
# ----------------------------------------------------------------------------------------------------

_UNARY = {
    "silu": lambda a: f"{a} * T.sigmoid({a})",
    "sigmoid": lambda a: f"T.sigmoid({a})",
}
_BINARY = {
    "add": lambda a, b: f"{a} + {b}",
    "mul": lambda a, b: f"{a} * {b}",
}


def elementwise_source(op: str, in_dtypes: tuple[str, ...], out_dtype: str, *, beta_gate: float = 4.0,
                       beta_up: float = 25.0) -> Kernel:
    """y[i] = f(a[i] (, b[i])) over n (symbolic) elements, float32 math.

    op: "silu" (x * sigmoid(x), Elfwing et al. 2018), "sigmoid", "add", "mul", or "situ_glu"
    (h = (beta_gate * tanh(a / beta_gate) * sigmoid(a)) * (beta_up * tanh(b / beta_up)), spec/OPS.md).
    """
    arity = 1 if op in _UNARY else 2
    if op not in _UNARY and op not in _BINARY and op != "situ_glu":
        raise ValueError(f"tvm elementwise: unknown op {op!r}")
    if len(in_dtypes) != arity:
        raise ValueError(f"tvm elementwise: {op} takes {arity} inputs, got {len(in_dtypes)} dtypes")
    for i, dt in enumerate(in_dtypes):
        _check_dtype(dt, f"{op} input {i}")
    _check_dtype(out_dtype, f"{op} output")
    names = ["A", "B"][:arity]
    loads = [_f32(f"{n}[vi]", dt) for n, dt in zip(names, in_dtypes)]
    if op in _UNARY:
        expr = _UNARY[op](loads[0])
    elif op in _BINARY:
        expr = _BINARY[op](*loads)
    else:
        if not (beta_gate > 0 and beta_up > 0):
            raise ValueError(f"situ_glu: beta_gate and beta_up must be > 0, got {beta_gate}, {beta_up}")
        a, b = loads
        expr = (f"({_c(beta_gate)} * T.tanh({a} / {_c(beta_gate)}) * T.sigmoid({a})) * "
                f"({_c(beta_up)} * T.tanh({b} / {_c(beta_up)}))")
    name = op
    src = _header(name, [f"{n.lower()}_h" for n in names] + ["y_h"])
    src += "    n = T.int64()\n"
    for n, dt in zip(names, in_dtypes):
        src += f'    {n} = T.match_buffer({n.lower()}_h, (n,), "{dt}")\n'
    src += f'    Y = T.match_buffer(y_h, (n,), "{out_dtype}")\n'
    src += ("    for i in range(n):\n"
            '        with T.sblock("y"):\n'
            "            vi = T.axis.spatial(n, i)\n"
            f"            Y[vi] = {_store(expr, out_dtype)}\n")
    return Kernel(name, "elementwise", src, {})


# ----------------------------------------------------------------------------------------------------
# row norms: rmsnorm (mean, weight) and l2norm (sum, no weight) over rows of width d
# ----------------------------------------------------------------------------------------------------

def rownorm_source(kind: str, d: int, x_dtype: str, w_dtype: str | None, out_dtype: str, eps: float) -> Kernel:
    """rmsnorm: y = x * rsqrt(mean_d(x^2) + eps) * w (Zhang & Sennrich 2019, eq. 4);
    l2norm: y = x * rsqrt(sum_d(x^2) + eps). x, y [n, d] (n symbolic), w [d]; float32 math."""
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
    return Kernel(kind, "rownorm", src, {"d": d, "reductions": ["sumsq"], "row_blocks": [], "out": "norm"})


# ----------------------------------------------------------------------------------------------------
# attn_residual: softmax over L sources of <query, RMSNorm(source)>, then the weighted sum of sources
# ----------------------------------------------------------------------------------------------------

def attn_residual_source(d: int, L: int, src_dtype: str, q_dtype: str, w_dtype: str, eps: float) -> Kernel:
    """Block AttnRes (arXiv 2603.15031; spec/OPS.md attn_residual), per token row i:

        ss_l = sum_d s_l[i]^2,  dot_l = sum_d query * rms_weight * s_l[i]
        logit_l = dot_l * rsqrt(ss_l / d + eps)          (= <query, RMSNorm(s_l[i]; rms_weight, eps)>)
        p = softmax_l(logit) in float32,  y[i] = sum_l p_l s_l[i]   (sources' dtype)

    The L sources are L separate buffers (no stacking copy); L, d are compile-time constants."""
    if L < 1:
        raise ValueError(f"attn_residual: needs at least one source, got L = {L}")
    if d < 1:
        raise ValueError(f"attn_residual: the hidden size d must be >= 1, got {d}")
    for dt, what in ((src_dtype, "sources"), (q_dtype, "query"), (w_dtype, "rms_weight")):
        _check_dtype(dt, f"attn_residual {what}")
    params = ["q_h", "w_h"] + [f"s{l}_h" for l in range(L)] + ["y_h"]
    src = _header("attn_residual", params)
    src += "    n = T.int64()\n"
    src += f'    Q = T.match_buffer(q_h, ({d},), "{q_dtype}")\n'
    src += f'    W = T.match_buffer(w_h, ({d},), "{w_dtype}")\n'
    for l in range(L):
        src += f'    S{l} = T.match_buffer(s{l}_h, (n, {d}), "{src_dtype}")\n'
    src += f'    Y = T.match_buffer(y_h, (n, {d}), "{src_dtype}")\n'
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
                  {"d": d, "L": L, "reductions": reductions, "row_blocks": ["logits", "max", "sum"], "out": "out"})


# ----------------------------------------------------------------------------------------------------
# short_conv: causal depthwise convolution over time
# ----------------------------------------------------------------------------------------------------

def short_conv_source(C: int, W: int, x_dtype: str, w_dtype: str, out_dtype: str) -> Kernel:
    """y[b, t, c] = sum_{j<W} w[c, j] * x[b, t - W + 1 + j, c], x taken as 0 before t = 0 (causal
    depthwise conv, as backends/reference short_conv with no initial state). x, y [B, T, C] with B, T
    symbolic; w [C, W]; float32 math."""
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
            f"            Y[vb, vt, vc] = {_store(' + '.join(terms), out_dtype)}\n")
    return Kernel("short_conv", "short_conv", src, {"C": C, "W": W})


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

def parse(kernel: Kernel):
    """The PrimFunc of a kernel's TVMScript text (needs TVM's compiler library)."""
    from tvm.script import from_source
    return from_source(kernel.source)


def schedule(kernel: Kernel, kind: str):
    """Apply the CPU ("llvm") or GPU ("cuda") schedule; returns the scheduled IRModule."""
    import tvm.s_tir
    if kind not in ("llvm", "cuda"):
        raise ValueError(f"tvm schedule: kind must be 'llvm' or 'cuda', got {kind!r}")
    sch = tvm.s_tir.Schedule(parse(kernel))
    fn = {"elementwise": _sched_elementwise, "rownorm": _sched_rows, "attn_residual": _sched_rows,
          "short_conv": _sched_short_conv, "router": _sched_router}[kernel.family]
    fn(sch, kernel.info, kind)
    return sch.mod


def _sched_elementwise(sch, info, kind):
    (i,) = sch.get_loops(sch.get_sblock("y"))
    if kind == "llvm":
        io, ii, iv = sch.split(i, [None, CPU_ELEMS_PER_TASK // CPU_VECTOR, CPU_VECTOR])
        sch.parallel(io)
        sch.vectorize(iv)
    else:
        io, ii = sch.split(i, [None, CUDA_THREADS])
        sch.bind(io, "blockIdx.x")
        sch.bind(ii, "threadIdx.x")


def _sched_rows(sch, info, kind):
    """Row-wise kernels: the output block's row loop carries every per-row producer (compute_at)."""
    out = sch.get_sblock(info["out"])
    i, k = sch.get_loops(out)
    producers = list(info["reductions"]) + list(info["row_blocks"])
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
            sch.set_scope(b, 0, "local")       # all-reduce result lands in every thread's registers
        for name in info["row_blocks"]:        # a few float32 per row: every thread computes them
            sch.set_scope(sch.get_sblock(name), 0, "local")


def _sched_short_conv(sch, info, kind):
    ib, it, ic = sch.get_loops(sch.get_sblock("conv"))
    bt = sch.fuse(ib, it)
    if kind == "llvm":
        o, inner = sch.split(bt, [None, 16])
        sch.parallel(o)
        _, cv = sch.split(ic, [None, CPU_VECTOR])
        sch.vectorize(cv)
    else:
        f = sch.fuse(bt, ic)
        o, inner = sch.split(f, [None, CUDA_THREADS])
        sch.bind(o, "blockIdx.x")
        sch.bind(inner, "threadIdx.x")


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
