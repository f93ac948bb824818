"""The TVM backend: TensorIR kernels (TVMScript) for the memory-bound ops, built with ``tvm.compile``.

Ops (same signatures and results as backends/reference, spec/OPS.md): ``rmsnorm``, ``l2norm``, ``silu``,
``sigmoid``, ``add``, ``mul``, ``situ_glu``, ``attn_residual``, ``short_conv``, ``router_scores`` and
``qb_route`` (TVM scores, then the reference's top-k selection). They take torch tensors of any leading
shape (float32, float16 or bfloat16; float32 math inside) on the CPU (target ``{"kind": "llvm"}``) or on
a CUDA device (target ``{"kind": "cuda", "arch": "sm_90"}``), chosen by the tensors' device, and pass
them to TVM through DLPack without copies (non-contiguous inputs are made contiguous first).

The token count is a symbolic shape variable in every kernel, so one built module serves all token
counts; widths and attributes (d, C, E, L, eps, betas) and dtypes are compile-time constants. Built
modules are cached on disk (backends/tvm/build.py: ``$MTC_CACHE_DIR/tvm/<key>/``) and exportable with
``export_library`` (``build.export``), so a module compiled here loads on a machine with only TVM's runtime.

For the runtime: ``op_table()`` maps graph op names to ``fn(node, *tensors)`` (the calling convention of
backends/runtime.py's reference table); ``tvmscript(op, **attrs)`` prints a kernel for
``mtc ir --stage tvm``.

The kernels are forward only: when autograd needs a gradient through an op (grad mode on and an input
requiring grad) every public op here, and the op_table entries, run the reference op instead (same
values, with its gradient), so a gradient is never dropped silently.
TVM (``pip install -e ".[tvm]"``) is imported lazily, on the first kernel call.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from backends.reference.ops import check_eps, check_finite_cpu
from . import attn_kernels as _A
from . import kernels as _K
from . import build as _B
from .build import cache_dir, cache_key, export, load, library_path  # noqa: F401

__all__ = ["rmsnorm", "l2norm", "silu", "sigmoid", "add", "mul", "situ_glu", "attn_residual", "short_conv",
           "router_scores", "qb_route", "op_table", "tvmscript", "model_tvmscript", "kernel_for", "available", "OPS"]

_DT = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

OPS = ("rmsnorm", "l2norm", "silu", "sigmoid", "add", "mul", "situ_glu", "attn_residual", "short_conv",
       "router_scores")


def available() -> bool:
    """True when the TVM compiler or runtime package can be imported."""
    try:
        import tvm  # noqa: F401
    except ImportError:
        return False
    return True


def model_tvmscript(g, scheduled: str | None = None, dtype: str | None = None) -> str:
    """The TVMScript of every distinct TVM kernel a graph needs (``mtc ir --stage tvm``, ``m.ir("tvm")``).

    Args:
        g: a typed graph (the 'canonical' stage: what compile(target="tvm") runs, the direct AttnRes form).
        scheduled: None (the unscheduled source, pure Python), "llvm" or "cuda" (after that target's
            schedule; needs TVM).
        dtype: None (the graph's own dtypes), or "float32" / "float16" / "bfloat16": the dtype a compiled
            module runs in (compile(..., dtype=...) casts every float tensor to it), used for every kernel.
    Returns:
        One text: a header, then per distinct kernel a comment line with its attributes and users, then its
        TVMScript."""
    dt = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
    nodes = g.node_map()
    seen: dict[str, list[str]] = {}
    order = []
    def in_type(n, i):
        r = n.inputs[i]
        return nodes[r.node].types[r.index]

    for n in g.nodes:
        t = n.types[0] if n.types else None
        op = n.op
        if op == "qb_route":                  # TVM scores the router (router_scores), the reference selects
            op, t = "router_scores", in_type(n, 0)
        elif op not in OPS or op == "router_scores":
            continue
        if t is None or t.dtype not in dt:
            continue
        a = {"dtype": dt[t.dtype]}
        if n.op in ("rmsnorm", "l2norm"):
            a.update(d=int(t.shape[-1]), eps=float(n.attr("eps")))
            if n.op == "rmsnorm":
                a["w_dtype"] = dt[nodes[n.inputs[1].node].types[0].dtype]
        elif n.op == "attn_residual":
            w = dt[nodes[n.inputs[1].node].types[0].dtype]
            a.update(d=int(t.shape[-1]), L=len(n.inputs) - 2, eps=float(n.attr("eps")), q_dtype=w, w_dtype=w)
        elif n.op == "short_conv":
            wt = nodes[n.inputs[1].node].types[0]
            a.update(C=int(wt.shape[0]), W=int(wt.shape[2]), w_dtype=dt[wt.dtype])
        elif n.op == "situ_glu":
            a.update(beta_gate=float(n.attr("beta_gate")), beta_up=float(n.attr("beta_up")))
        elif op == "router_scores":
            wt = in_type(n, 1)
            a.update(d=int(t.shape[-1]), E=int(wt.shape[0]), w_dtype=dt[wt.dtype])
        if dtype is not None:
            a.update({k_: dtype for k_ in ("dtype", "q_dtype", "w_dtype", "b_dtype") if k_ in a})
        key = repr((op, sorted(a.items())))
        if key not in seen:
            seen[key] = []
            order.append((key, op, a))
        seen[key].append(n.name)
    which = ("unscheduled TVMScript of the llvm build (kernels marked 'cuda text differs' are built for cuda "
             "sm_90 from another text; mtc ir --stage tvm --tvm-schedule llvm|cuda shows a target's scheduled "
             "kernel)" if scheduled is None else f"TVMScript after the {scheduled} schedule")
    out = [f"# {len(order)} distinct TVM kernels for {g.name}: {which}"]
    for key, op, a in order:
        users = seen[key]
        k = kernel_for(op, **dict(a))
        differs = ""
        if scheduled is None and k.cuda_source is not None:
            why = ("the pipelined kernel (cp.async ring, impl=pipelined)" if k.info.get("cuda_prescheduled")
                   else "fast-math intrinsics" if "__" in k.cuda_source and "__" not in k.source
                   else "the reductions as let-bound updates")
            differs = f" [cuda text differs: {why}]"
        if op == "attn_residual":
            differs += f" [cuda kernel: {', '.join(f'{k_}={v}' for k_, v in k.sched if v is not None)}]"
        out.append(f"\n# ---- {op} {a}: used by {len(users)} node(s): "
                   f"{', '.join('%' + u for u in users[:6])}{' ...' if len(users) > 6 else ''}{differs}")
        out.append(_text(k, scheduled))
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------
# argument helpers
# ----------------------------------------------------------------------------------------------------

def _dt(t: torch.Tensor, what: str, where: str) -> str:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {what} must be a torch.Tensor, got {type(t).__name__}")
    dt = _DT.get(t.dtype)
    if dt is None:
        raise TypeError(f"{where}: {what} has dtype {t.dtype}; the TVM kernels take float32, float16 or "
                        f"bfloat16")
    return dt


def _kind(*ts: torch.Tensor, where: str) -> str:
    dev = ts[0].device
    for t in ts[1:]:
        if t.device != dev:
            raise ValueError(f"{where}: all tensors must be on one device, got {dev} and {t.device}")
    if dev.type == "cpu":
        return "llvm"
    if dev.type == "cuda":
        return "cuda"
    raise ValueError(f"{where}: tensors on {dev} are not supported (cpu -> llvm, cuda -> cuda)")


def _call(kernel: _K.Kernel, kind: str, *tensors: torch.Tensor) -> None:
    fn = _B.get_function(kernel, kind)
    if kind == "cuda":
        import tvm_ffi
        with tvm_ffi.use_torch_stream():            # launch on torch's current stream
            fn(*tensors)
    else:
        fn(*tensors)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 32-byte aligned start (the cuda kernels read rows with 128-bit loads and
    cp.async, and a float32 query / weight beside 16-bit sources with 256-bit loads; a view into the middle
    of a tensor may start anywhere): a copy only when it is not."""
    t = t.contiguous()
    return t if t.data_ptr() % 32 == 0 else t.clone()


# ----------------------------------------------------------------------------------------------------
# kernel selection (pure Python: also what tvmscript() prints)
# ----------------------------------------------------------------------------------------------------

# lowest allowed value of each integer attribute of kernel_for (threads also <= 1024: a CUDA block)
_INT_ATTRS = {"threads": 1, "rows": 1, "vec": 1, "prefetch": 0, "group": 1, "min_blocks": 1, "stages": 1,
              "unroll": 1, "tile_t": 1, "d": 1, "L": 1, "C": 1, "W": 1, "E": 1}


def _int_attr(op: str, name: str, v) -> int:
    """An integer kernel attribute, checked: a Python / numpy integer (not a bool, float or string) within
    its range (_INT_ATTRS; threads <= 1024, vec one of 1, 2, 4, 8). Raises ValueError naming it."""
    import operator
    if isinstance(v, bool):
        raise ValueError(f"tvm backend: {op} attribute {name} must be an integer, got {v!r}")
    try:
        iv = operator.index(v)
    except TypeError:
        raise ValueError(f"tvm backend: {op} attribute {name} must be an integer, got {v!r}") from None
    lo = _INT_ATTRS[name]
    if iv < lo:
        raise ValueError(f"tvm backend: {op} attribute {name} must be >= {lo}, got {iv}")
    if name == "threads" and iv > 1024:
        raise ValueError(f"tvm backend: {op} attribute threads must be <= 1024 (one CUDA block), got {iv}")
    if name == "vec" and iv not in (1, 2, 4, 8):
        raise ValueError(f"tvm backend: {op} attribute vec must be 1, 2, 4 or 8 (elements per access), got {iv}")
    return iv


def _shape_attr(op: str, a: dict, name: str, default=None) -> int:
    """A required (or defaulted) shape attribute of kernel_for, checked by _int_attr."""
    if name not in a:
        if default is None:
            raise ValueError(f"tvm backend: {op} needs the attribute {name}")
        return default
    return _int_attr(op, name, a.pop(name))


def _eps_attr(op: str, a: dict) -> float:
    """kernel_for's eps (default 1e-6), checked by the reference ops' check_eps (a finite real > 0, not a bool)."""
    eps, where = a.pop("eps", 1e-6), f"tvm backend: {op} attribute"
    check_eps(eps, where)
    return float(eps)

def kernel_for(op: str, **a) -> _K.Kernel:
    """The kernel specialisation for ``op`` with compile-time attributes ``a``.

    rmsnorm: d, eps, dtype, w_dtype; l2norm: d, eps, dtype; silu / sigmoid: dtype; add / mul: dtype,
    b_dtype; situ_glu: dtype, b_dtype, out_dtype, beta_gate, beta_up (the elementwise ops also take the
    layout / schedule attributes vec, threads, unroll: see kernels.elementwise_source); attn_residual: d, L, eps,
    dtype, q_dtype, w_dtype and impl (default: "pipelined" where the row has a whole-warp layout, else "onepass"
    with the schedule of attn_kernels.onepass_defaults; "onepass" with the schedule attributes threads, vec,
    prefetch, group, min_blocks; "pipelined" (cuda: cp.async ring) with threads, stages, group; see
    attn_kernels.attn_residual_source); rmsnorm / l2norm also take the cuda schedule attributes threads,
    vec, rows; short_conv: C, W, dtype, w_dtype (and vec, threads, tile_t); router_scores: d, E, dtype, w_dtype. Dtypes are
    "float32" / "float16" / "bfloat16" (default float32; out_dtype defaults to dtype).
    Integer attributes must be integers in range (threads 1..1024, vec 1 / 2 / 4 / 8, prefetch >= 0, the
    others >= 1) and eps a positive number.
    Raises ValueError for an unknown op, a missing, unknown or out-of-range attribute, TypeError for an
    unsupported dtype."""
    dt = a.pop("dtype", "float32")
    if op in ("silu", "sigmoid", "add", "mul", "situ_glu"):
        ew = {k: _int_attr(op, k, a.pop(k)) for k in ("vec", "threads", "unroll") if k in a}
    if op in ("silu", "sigmoid"):
        k = _K.elementwise_source(op, (dt,), dt, **ew)
    elif op in ("add", "mul"):
        k = _K.elementwise_source(op, (dt, a.pop("b_dtype", dt)), dt, **ew)
    elif op == "situ_glu":
        k = _K.elementwise_source(op, (dt, a.pop("b_dtype", dt)), a.pop("out_dtype", dt),
                                  beta_gate=a.pop("beta_gate", 4.0), beta_up=a.pop("beta_up", 25.0), **ew)
    elif op in ("rmsnorm", "l2norm", "attn_residual"):
        rs = {k_: _int_attr(op, k_, a.pop(k_))
              for k_ in ("threads", "rows", "vec", "prefetch", "group", "min_blocks", "stages") if k_ in a}
        if "impl" in a:
            if op != "attn_residual":
                raise ValueError(f"tvm backend: {op} takes no 'impl' attribute")
            rs["impl"] = str(a.pop("impl"))
        for only in ("prefetch", "group", "min_blocks", "stages"):
            if op != "attn_residual" and only in rs:
                raise ValueError(f"tvm backend: {op} takes no {only!r} attribute")
        if op == "attn_residual" and "rows" in rs:
            raise ValueError("tvm backend: attn_residual takes no 'rows' attribute (one row per block)")
        if op == "rmsnorm":
            k = _K.rownorm_source("rmsnorm", _shape_attr(op, a, "d"), dt, a.pop("w_dtype", "float32"), dt,
                                  _eps_attr(op, a), **rs)
        elif op == "l2norm":
            k = _K.rownorm_source("l2norm", _shape_attr(op, a, "d"), dt, None, dt, _eps_attr(op, a), **rs)
        else:
            k = _A.attn_residual_source(_shape_attr(op, a, "d"), _shape_attr(op, a, "L"), dt,
                                        a.pop("q_dtype", "float32"), a.pop("w_dtype", "float32"), _eps_attr(op, a),
                                        **rs)
    elif op == "short_conv":
        sc = {k_: _int_attr(op, k_, a.pop(k_)) for k_ in ("vec", "threads", "tile_t") if k_ in a}
        k = _K.short_conv_source(_shape_attr(op, a, "C"), _shape_attr(op, a, "W", 4), dt, a.pop("w_dtype", dt), dt,
                                 **sc)
    elif op == "router_scores":
        k = _K.router_source(_shape_attr(op, a, "d"), _shape_attr(op, a, "E"), dt, a.pop("w_dtype", dt))
    else:
        raise ValueError(f"tvm backend: no kernel for op {op!r}; kernels: {', '.join(OPS)}")
    if a:
        raise ValueError(f"tvm backend: unknown attribute(s) for {op}: {', '.join(sorted(a))}")
    return k


def tvmscript(op_name: str, *, scheduled: str | None = None, **shape_attrs) -> str:
    """The TVMScript text of one kernel (for ``mtc ir --stage tvm``).

    ``shape_attrs`` as for :func:`kernel_for` (e.g. ``tvmscript("rmsnorm", d=7168, eps=1e-6)``). With
    ``scheduled="llvm"`` or ``"cuda"`` the text after that target's schedule is returned instead (needs
    TVM); without, the unscheduled source (pure Python)."""
    return _text(kernel_for(op_name, **shape_attrs), scheduled)


def _text(k: _K.Kernel, scheduled: str | None) -> str:
    """A kernel's unscheduled (llvm) TVMScript, or its text after the schedule of target ``scheduled``."""
    return k.source if scheduled is None else _K.schedule(k, scheduled).script()


# ----------------------------------------------------------------------------------------------------
# the ops
# ----------------------------------------------------------------------------------------------------

def _reference_router_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.float() @ weight.float().t())


def _grad_via_reference(name: str):
    """Decorator for the public ops: when autograd needs a gradient through the call (grad mode on and a
    tensor argument, or a tensor in a list argument, requiring grad), run backends.reference's op of the
    same name and signature instead (the TVM kernels have no backward)."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            flat = []
            for a in list(args) + list(kwargs.values()):
                flat.extend(a if isinstance(a, (list, tuple)) else [a])
            if _needs_grad(flat):
                if name == "router_scores":
                    return _reference_router_scores(*args, **kwargs)
                from backends import reference as R
                return getattr(R, name)(*args, **kwargs)
            return fn(*args, **kwargs)
        return wrapper
    return deco


@_grad_via_reference("rmsnorm")
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim: y = x * rsqrt(mean(x^2, -1) + eps) * weight (Zhang & Sennrich 2019,
    eq. 4), float32 math. x [..., d]; weight [d]. Returns [..., d] in x's dtype.
    Raises ValueError on a shape mismatch or eps <= 0, TypeError on an unsupported dtype."""
    where = "tvm rmsnorm"
    dt, wdt = _dt(x, "x", where), _dt(weight, "weight", where)
    check_eps(eps, where)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{where}: x [..., d] and weight [d] disagree: {list(x.shape)} vs {list(weight.shape)}")
    d = x.shape[-1]
    kind = _kind(x, weight, where=where)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        _call(kernel_for("rmsnorm", d=d, eps=float(eps), dtype=dt, w_dtype=wdt), kind,
              x.contiguous().view(-1, d), weight.contiguous(), y.view(-1, d))
    return y


@_grad_via_reference("l2norm")
def l2norm(x: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """y = x * rsqrt(sum(x^2, -1) + eps) over the last dim (KDA's q/k normalisation), float32 math.
    x [..., d] -> [..., d] in x's dtype. Raises ValueError (eps <= 0 / 0-dim x), TypeError (dtype)."""
    where = "tvm l2norm"
    dt = _dt(x, "x", where)
    check_eps(eps, where)
    if x.dim() < 1:
        raise ValueError(f"{where}: x must have at least one dimension")
    d = x.shape[-1]
    kind = _kind(x, where=where)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        _call(kernel_for("l2norm", d=d, eps=float(eps), dtype=dt), kind, x.contiguous().view(-1, d), y.view(-1, d))
    return y


def _vec(kind: str, *ts: torch.Tensor) -> int:
    """Lanes per 128-bit access on cuda (8 for 16-bit data, 4 with any float32 tensor); 1 on the CPU."""
    return 1 if kind == "llvm" else 16 // max(t.element_size() for t in ts)


def _elementwise(op: str, kind: str, ins: list, y: torch.Tensor, **attrs) -> None:
    """Run an elementwise kernel over flat contiguous tensors: the first n - n % vec elements as
    [n / vec, vec] rows (whole-vector accesses), the rest with the vec = 1 kernel."""
    flat = [t.contiguous().view(-1) for t in ins]
    yf = y.view(-1)
    n = yf.numel()
    vec = _vec(kind, *flat, yf)
    body = n - n % vec
    if body:
        _call(kernel_for(op, vec=vec, **attrs), kind, *[t[:body].view(-1, vec) for t in flat], yf[:body].view(-1, vec))
    if body < n:
        _call(kernel_for(op, vec=1, **attrs), kind, *[t[body:].view(-1, 1) for t in flat], yf[body:].view(-1, 1))


def _unary(op: str, x: torch.Tensor) -> torch.Tensor:
    where = f"tvm {op}"
    dt = _dt(x, "x", where)
    kind = _kind(x, where=where)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        _elementwise(op, kind, [x], y, dtype=dt)
    return y


@_grad_via_reference("silu")
def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) (Elfwing et al. 2018), float32 math; any shape, result in x's dtype."""
    return _unary("silu", x)


@_grad_via_reference("sigmoid")
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), float32 math; any shape, result in x's dtype."""
    return _unary("sigmoid", x)


def _binary(op: str, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, **attrs):
    where = f"tvm {op}"
    adt, bdt = _dt(a, "a", where), _dt(b, "b", where)
    kind = _kind(a, b, where=where)
    if a.shape != b.shape:
        try:
            a, b = torch.broadcast_tensors(a, b)
        except RuntimeError as e:
            raise ValueError(f"{where}: shapes {list(a.shape)} and {list(b.shape)} do not broadcast") from e
    out_dtype = out_dtype or a.dtype
    y = torch.empty(a.shape, dtype=out_dtype, device=a.device)
    if y.numel():
        extra = {"out_dtype": _DT[out_dtype]} if op == "situ_glu" else {}
        _elementwise(op, kind, [a, b], y, dtype=adt, b_dtype=bdt, **extra, **attrs)
    return y


@_grad_via_reference("add")
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b (broadcast), float32 math, result in a's dtype."""
    return _binary("add", a, b)


@_grad_via_reference("mul")
def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b (broadcast), float32 math, result in a's dtype."""
    return _binary("mul", a, b)


@_grad_via_reference("situ_glu")
def situ_glu(a: torch.Tensor, b: torch.Tensor, *, beta_gate: float = 4.0, beta_up: float = 25.0) -> torch.Tensor:
    """SiTU-GLU (spec/OPS.md situ_glu): h = (bg * tanh(a / bg) * sigmoid(a)) * (bu * tanh(b / bu)).

    a (gate pre-activation) and b (up pre-activation) of one shape; float32 math; result in the promoted
    dtype of a and b. Raises ValueError on mismatched shapes or non-positive betas."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
        raise ValueError(f"tvm situ_glu: a {tuple(a.shape)} and b {tuple(b.shape)} must have one shape")
    if not (beta_gate > 0 and beta_up > 0):
        raise ValueError(f"tvm situ_glu: beta_gate and beta_up must be > 0, got {beta_gate}, {beta_up}")
    _dt(a, "a", "tvm situ_glu"), _dt(b, "b", "tvm situ_glu")
    return _binary("situ_glu", a, b, torch.promote_types(a.dtype, b.dtype),
                   beta_gate=float(beta_gate), beta_up=float(beta_up))


@_grad_via_reference("attn_residual")
def attn_residual(query: torch.Tensor, sources: Sequence[torch.Tensor], rms_weight: torch.Tensor, *,
                  eps: float = 1e-6, output_rms_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Block Attention Residuals (arXiv 2603.15031; spec/OPS.md attn_residual).

    logit_i = <query, RMSNorm(sources_i; rms_weight, eps)>, p = softmax_i(logit) in float32,
    out = sum_i p_i sources_i; then RMSNorm(out; output_rms_weight, eps) if that weight is given (applied
    by the TVM rmsnorm kernel to the out in the sources' dtype).
    query, rms_weight [d]; sources: L >= 1 tensors [..., d] of one shape and dtype. Returns [..., d] in
    the sources' dtype. One kernel per (d, L, dtypes, eps); the sources are read in place (no stacking).
    Raises TypeError / ValueError (via the reference's argument checks) on bad input."""
    from backends.reference import attn_residual as reference_attn_residual
    from backends.reference.attn_residual import (check_attn_residual_args, check_attn_residual_result,
                                                  needs_safe_path)
    shape, dtype, d = check_attn_residual_args(query, sources, rms_weight, eps, output_rms_weight,
                                               where="tvm attn_residual")
    if needs_safe_path(query, sources, rms_weight):
        # values past 2^40 (CPU inputs): the kernel's float32 sums could overflow; the reference scales them
        return reference_attn_residual(query, sources, rms_weight, eps=eps, output_rms_weight=output_rms_weight)
    sources = list(sources)
    where = "tvm attn_residual"
    sdt, qdt, wdt = _dt(sources[0], "sources", where), _dt(query, "query", where), _dt(rms_weight, "rms_weight", where)
    kind = _kind(query, rms_weight, *sources, where=where)
    y = torch.empty(shape, dtype=dtype, device=query.device)
    if y.numel():
        k = kernel_for("attn_residual", d=d, L=len(sources), eps=float(eps), dtype=sdt, q_dtype=qdt, w_dtype=wdt)
        _call(k, kind, _aligned(query), _aligned(rms_weight), *[_aligned(s).view(-1, d) for s in sources],
              y.view(-1, d))
    if output_rms_weight is not None:
        y = rmsnorm(y, output_rms_weight, eps=eps)
    check_attn_residual_result(y, dtype, where)
    return y


@_grad_via_reference("short_conv")
def short_conv(x: torch.Tensor, weight: torch.Tensor, *, initial_state: torch.Tensor | None = None,
               output_final_state: bool = False):
    """Causal depthwise convolution over time: y[b,t,c] = sum_j w[c, j] * x[b, t - W + 1 + j, c].

    x [B, T, C]; weight [C, 1, W] or [C, W]; initial_state [B, C, W-1] (the W-1 inputs before t = 0,
    zeros if None; prepended with one copy). Returns (y [B, T, C] in x's dtype, final_state
    [B, C, W-1] float32 or None), as backends/reference short_conv. float32 math.
    Raises ValueError on shape mismatches, TypeError on unsupported dtypes."""
    where = "tvm short_conv"
    from backends.reference.ops import check_flag
    output_final_state = check_flag(output_final_state, "output_final_state", where)
    xdt, wdt = _dt(x, "x", where), _dt(weight, "weight", where)
    if weight.dim() not in (2, 3) or (weight.dim() == 3 and weight.shape[1] != 1):
        raise ValueError(f"{where}: weight must be [C, 1, W] or [C, W], got {list(weight.shape)}")
    w = weight.reshape(weight.shape[0], -1).contiguous()
    C, W = w.shape
    if x.dim() != 3 or x.shape[-1] != C:
        raise ValueError(f"{where}: x must be [B, T, {C}], got {list(x.shape)}")
    B = x.shape[0]
    check_finite_cpu(where, x=x, weight=weight, initial_state=initial_state)
    kind = _kind(x, w, where=where)
    xin, skip = x, 0
    if initial_state is not None:
        if initial_state.shape != (B, C, W - 1):
            raise ValueError(f"{where}: initial_state must be [{B}, {C}, {W - 1}], got {list(initial_state.shape)}")
        xin, skip = torch.cat([initial_state.transpose(1, 2).to(x.dtype), x], dim=1), W - 1
    y = torch.empty(xin.shape, dtype=x.dtype, device=x.device)
    if y.numel():
        _call(kernel_for("short_conv", C=C, W=W, dtype=xdt, w_dtype=wdt), kind, xin.contiguous(), w, y)
    y = y[:, skip:] if skip else y
    final = None
    if output_final_state:                 # (width 1: an empty [B, C, 0] state)
        prev = (torch.zeros(B, C, W - 1, dtype=torch.float32, device=x.device) if initial_state is None
                else initial_state.float())
        full = torch.cat([prev, x.float().transpose(1, 2)], dim=-1)
        final = full[..., full.shape[-1] - (W - 1):].contiguous()
    return y, final


@_grad_via_reference("router_scores")
def router_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """scores = sigmoid(x @ weight^T) in float32 (spec/OPS.md qb_route). x [N, d]; weight [E, d];
    returns [N, E] float32. Raises ValueError on a shape mismatch, TypeError on unsupported dtypes."""
    where = "tvm router_scores"
    xdt, wdt = _dt(x, "x", where), _dt(weight, "weight", where)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{where}: x [N, d] and weight [E, d] disagree: {list(x.shape)} vs {list(weight.shape)}")
    kind = _kind(x, weight, where=where)
    s = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    if s.numel():
        _call(kernel_for("router_scores", d=x.shape[1], E=weight.shape[0], dtype=xdt, w_dtype=wdt), kind,
              x.contiguous(), weight.contiguous(), s)
    return s


@_grad_via_reference("qb_route")
def qb_route(x, weight, bias, *, top_k, routed_scaling=1.0):
    """The sigmoid router (spec/OPS.md qb_route) with the scores from the TVM kernel and the selection of
    the reference backend: returns (topk_idx [N, k] int64, topk_weight [N, k] float32, scores [N, E]
    float32). Argument checks (shapes, top_k range, NaN/inf rows) are the reference's."""
    from backends.reference.moe import (biased_topk, check_finite_rows, check_route_inputs, check_routed_scaling,
                                        route_overflow_rows, route_weights)
    check_route_inputs(x, weight, bias, top_k)
    check_routed_scaling(routed_scaling, "qb_route")
    check_finite_rows("x", x, "qb_route")
    scores = router_scores(x, weight)
    topk_idx = biased_topk(scores + bias.float(), top_k)
    chosen = scores.gather(1, topk_idx)
    wt = chosen / chosen.sum(dim=-1, keepdim=True) * float(routed_scaling)
    low = chosen.sum(dim=-1) < 1e-30               # every chosen score (nearly) underflowed: weights in log space
    if bool(low.any()):
        z = x[low].float() @ weight.float().t()
        wt[low] = route_weights(z.gather(1, topk_idx[low]), routed_scaling)
    if x.numel() and weight.numel():
        # rows whose float32 logits may overflow (|x| |w| d past 1e38): where they do, the reference's float64 path
        bound = x.abs().amax(dim=-1).float() * float(weight.abs().max()) * x.shape[1]
        rows = torch.nonzero(bound > 1e38).flatten()
        if rows.numel():
            z = x[rows].float() @ weight.float().t()
            rows = rows[~torch.isfinite(z).all(dim=-1)]
        if rows.numel():
            topk_idx, wt, scores = topk_idx.clone(), wt.clone(), scores.clone()
            topk_idx[rows], wt[rows], scores[rows] = route_overflow_rows(x[rows], weight, bias.float(), top_k,
                                                                         routed_scaling)
    return topk_idx, wt, scores


# ----------------------------------------------------------------------------------------------------
# the runtime's op table
# ----------------------------------------------------------------------------------------------------

def _needs_grad(ts) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


def _supported(ts) -> bool:
    return all(t.dtype in _DT and t.device.type in ("cpu", "cuda") for t in ts if isinstance(t, torch.Tensor))


def op_table() -> dict[str, Callable]:
    """Graph op name -> ``fn(node, *tensors)`` for backends/runtime.py (same convention as its reference
    table: attributes from ``node.attr(...)``; attn_residual's inputs are (query, rms_weight, *sources)).

    Keys: rmsnorm, l2norm, silu, sigmoid, mul, add, situ_glu, attn_residual, short_conv, qb_route. Each
    entry runs the TVM op, or the reference op when a dtype / device has no TVM kernel (float64, say);
    when autograd needs a gradient the TVM ops themselves run the reference (_grad_via_reference). Both
    give the same values."""
    from backends import reference as R

    def guarded(tvm_fn, ref_fn):
        def fn(n, *ts):
            return tvm_fn(n, *ts) if _supported(ts) else ref_fn(n, *ts)
        return fn

    def attn(mod):
        return lambda n, q, w, *s: mod.attn_residual(q, list(s), w, eps=n.attr("eps"))

    import sys
    me = sys.modules[__name__]
    table = {
        "rmsnorm": (lambda n, x, w: rmsnorm(x, w, eps=n.attr("eps")),
                    lambda n, x, w: R.rmsnorm(x, w, eps=n.attr("eps"))),
        "l2norm": (lambda n, x: l2norm(x, eps=n.attr("eps")), lambda n, x: R.l2norm(x, eps=n.attr("eps"))),
        "silu": (lambda n, x: silu(x), lambda n, x: R.silu(x)),
        "sigmoid": (lambda n, x: sigmoid(x), lambda n, x: R.sigmoid(x)),
        "mul": (lambda n, a, b: mul(a, b), lambda n, a, b: R.mul(a, b)),
        "add": (lambda n, a, b: add(a, b), lambda n, a, b: R.add(a, b)),
        "situ_glu": (lambda n, a, b: situ_glu(a, b, beta_gate=n.attr("beta_gate"), beta_up=n.attr("beta_up")),
                     lambda n, a, b: R.situ_glu(a, b, beta_gate=n.attr("beta_gate"), beta_up=n.attr("beta_up"))),
        "attn_residual": (attn(me), attn(R)),
        "short_conv": (lambda n, x, w: short_conv(x, w)[0], lambda n, x, w: R.short_conv(x, w)[0]),
        "qb_route": (lambda n, x, w, b: qb_route(x, w, b, top_k=n.attr("top_k"), routed_scaling=n.attr("routed_scaling")),
                     lambda n, x, w, b: R.qb_route(x, w, b, top_k=n.attr("top_k"),
                                                   routed_scaling=n.attr("routed_scaling"))),
    }
    return {k: guarded(*v) for k, v in table.items()}
