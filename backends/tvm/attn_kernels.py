"""The TensorIR kernels of attn_residual (Block AttnRes, arXiv 2603.15031; spec/OPS.md attn_residual), as
TVMScript text: softmax over L sources of <query, RMSNorm(source)>, then the weighted sum of the sources.

Two kernels, one default per input class (attn_residual_source picks): on cuda the pipelined kernel (a cp.async
ring of source rows in shared memory, written thread-bound) where the row splits into whole warps of 128-bit
vectors, else the one-pass online-softmax kernel scheduled by kernels.schedule (grouped all-reduces:
onepass_defaults); the llvm build always runs the one-pass kernel. The measurements behind the defaults, and the
retired two-pass kernel and ungrouped one-pass form: benchmarks/results/tvm.md. Pure Python (no tvm import at module
import), as kernels.py.
"""
from __future__ import annotations

from .kernels import CUDA_THREADS, Kernel, _c, _check_dtype, _f32, _header, _lanes, _norm_threads, _row_threads, _store


ATTN_RESIDUAL_IMPLS = ("onepass", "pipelined")   # default: attn_residual_source (impl=None) picks by the row

# The cuda race of the one-pass kernel (found in its generated CUDA source; nan / inf on the H200): a row
# scalar computed from an all-reduce result, e.g. LG = DT * rsqrt(SS / d + eps), is a one-element
# "local" buffer like DT itself, so tirx.StorageRewrite (which runs before LowerThreadAllreduce) computes
# it IN PLACE in DT's buffer. When the reduction spans several warps, LowerThreadAllreduce then makes
# that buffer the __shared__ word the block's result is broadcast through, so every thread of the block
# does `red_result = f(red_result)` on one shared word with no barrier: threads that come later apply f
# again (the logit multiplied by rsqrt(...) up to #threads times, exp of exp ...), hence inf, and nan
# from inf - inf. Single-warp reductions keep the result in a register, and the llvm build has no
# all-reduce, which is why the CPU tests passed. Fix: build these kernels for cuda with StorageRewrite off
# (each row scalar then gets its own register and the all-reduce result is copied out of shared memory after the
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
    2 sources prefetched, d / vec threads, and onepass_defaults' sources per all-reduce). Its first cuda builds
    gave nan / inf on the H200 (a shared-memory race of the build, fixed by building with StorageRewrite off:
    NO_STORAGE_REWRITE, where the race is explained); measured correct on the H200 since.
    impl = "pipelined": on cuda a hand-written TensorIR kernel that streams the sources through a ring of
    ``stages`` shared-memory row buffers with cp.async (see _attn_residual_pipelined_source; attributes
    threads, stages, group); on llvm the default one-pass kernel.
    Raises ValueError for an unknown impl, or attributes of the other implementation."""
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
    if impl == "onepass":
        return _attn_residual_onepass_source(d, L, src_dtype, q_dtype, w_dtype, eps, threads=threads, vec=vec,
                                             prefetch=2 if prefetch is None else prefetch,
                                             group=onepass_defaults(d, L, src_dtype)["group"] if group is None
                                             else group, min_blocks=min_blocks)
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
    groups) 2 up to L = 8 and 1 above: the measured best (benchmarks/results/tvm.md); larger G or P spill
    registers."""
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


def _attn_residual_onepass_source(d: int, L: int, src_dtype: str, q_dtype: str, w_dtype: str, eps: float, *,
                                  group: int, threads: int | None = None, vec: int | None = None,
                                  prefetch: int = 2, min_blocks: int | None = None) -> Kernel:
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
    (benchmarks/results/tvm.md).
    group G >= 1: the 2G sums (sums of squares, dot products) of G consecutive sources in ONE block-wide
    all-reduce (one multi-value reduction block per group, reduced with a registered 2G-value sum reducer:
    ensure_sum_reducer), i.e. ceil(L / G) barrier pairs per row; prefetch counts groups.
    min_blocks: None, or the minimum resident blocks per multiprocessor promised to the CUDA compiler
    (``__launch_bounds__(threads, min_blocks)``, through TVM's tirx.launch_bounds_min_blocks_per_sm
    attribute; cuda text only, L >= 2; with 1 nvcc leaves no spills where it would spill without).
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

    if group < 1:
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
            cons = [f"sd{l // group}"]
            cons.append(f"a{l}" if 0 < l < L - 1 else "out" if l == L - 1 else ("a1" if L > 2 else "out"))
            sources[f"S{l}"] = cons
        vectors = ["Q", "W"]
    sched = (("impl", "onepass"), ("threads", threads), ("vec", vec), ("prefetch", prefetch), ("group", group))
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


# defaults of the pipelined attn_residual kernel: a ring of 8 rows, 4 sources per barrier (the measured best,
# benchmarks/results/tvm.md)
PIPELINED_STAGES, PIPELINED_GROUP = 8, 4
PIPELINED_SMEM_LIMIT = 200 * 1024        # bytes of ring per block (sm_90 allows 227 KiB of shared memory)


def pipelined_threads(d: int, src_dtype: str) -> int:
    """Default threads per row of the pipelined attn_residual kernel: four 128-bit vectors per thread (224
    at d = 7168 in bf16: the measured best, benchmarks/results/tvm.md), else two,
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
    (dynamic shared memory above 48 KiB). Measured correct on the H200 in every setting tried.
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
