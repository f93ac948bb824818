"""The registered implementations as ``torch.library`` custom ops (namespace ``mtc``), so that ``torch.compile`` and
``torch.export`` see a compiled module's launches as opaque ops of known output shapes instead of tracing (and
breaking on) the kernels' host code: Triton launches, value checks that read a tensor on the host, autograd
Functions.

An implementation registered with ``@impl(..., args="float eps", fake=...)`` (backends/registry.py) becomes the op
``torch.ops.mtc.<op>_<target>`` (``+`` in a fused op's name becomes ``_``: ``attn_residual_rmsnorm_triton``) with
the schema ``(Tensor[] args, <args>) -> Tensor[]``: the launch's input tensors in graph order, then the node
attributes the implementation reads, typed as the torch.library schema language spells them (``float``, ``int?``,
``str``, ``bool``, ``SymInt[]?`` for a shape, which the runtime evaluates at the running sizes). The op's body
calls the one registered ``fn(call, *tensors)`` with a call object that answers ``attr`` from those arguments; its
fake (``register_fake``) is the implementation's ``fake(call, *tensors)``, which allocates outputs of the real
ones' shapes, dtypes and strides and computes nothing. An implementation with a backward (``grad=True``) gets
``register_autograd``: the backward is a second op, ``<name>_backward(args, grads, <args>)``, that re-runs the
forward with autograd recording and takes the gradients of the float inputs through the implementation's own
autograd path (its ``torch.autograd.Function``): the same backward math, no second kernel, at the cost of a
recomputed forward.

Outputs never alias the inputs (a custom op may not return a view of its input): an output that shares an input's
storage (attn_residual_phase1's broadcast accumulator of a one-source bank) is copied; and they have the layout
(strides) of the fake's, which the tracer planned with (the fake runs on meta copies of the operands to tell): an
output laid out otherwise is copied into that layout.
"""
from __future__ import annotations

import re

import torch

NAMESPACE = "mtc"

_OPS: dict[str, object] = {}           # Impl.op_name -> the custom op (defined on first use)


class OpCall:
    """What an implementation sees inside its custom op: the attributes it declared (``attr``), shapes already
    evaluated (``shape`` returns them as given). ``members`` / ``in_types`` are not available there."""

    __slots__ = ("attrs",)

    def __init__(self, attrs: dict):
        self.attrs = attrs

    def attr(self, key: str, default=None):
        return self.attrs.get(key, default)

    def shape(self, dims) -> list:
        return list(dims)

    loc = None


def arg_names(schema: str) -> list[str]:
    """The parameter names of an ``args`` schema fragment (``"float eps, int? top_k"`` -> ``["eps", "top_k"]``)."""
    return [p.strip().split()[-1].split("=")[0] for p in schema.split(",") if p.strip()] if schema else []


def arg_types(schema: str) -> list[str]:
    return [p.strip().split()[0] for p in schema.split(",") if p.strip()] if schema else []


def op_name(target: str, op: str, taken) -> str:
    """``<op>_<target>`` with characters a schema name cannot hold as ``_``; ``_2``, ``_3``, ... for a further
    implementation of one op on one target."""
    base = re.sub(r"[^0-9A-Za-z_]", "_", f"{op}_{target}")
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


def _outs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _same_layout(a, b) -> bool:
    return all(st_a == st_b for n, st_a, st_b in zip(a.shape, a.stride(), b.stride()) if n > 1)


def _conform(name: str, outs: list, fakes: list) -> list:
    """The outputs in the layout the fake promises (the tracer planned with it): an output laid out otherwise is
    copied into the fake's allocation (an einsum's result, whose layout is torch's choice). RuntimeError for a
    fake of another count, shape or dtype (a wrong fake)."""
    if len(outs) != len(fakes):
        raise RuntimeError(f"mtc::{name}: {len(outs)} outputs, its fake gives {len(fakes)}")
    res = []
    for i, (o, f) in enumerate(zip(outs, fakes)):
        if o.shape != f.shape or o.dtype != f.dtype:
            raise RuntimeError(f"mtc::{name}: output {i} is {o.dtype} {list(o.shape)}, its fake gives {f.dtype} "
                               f"{list(f.shape)}")
        res.append(o if _same_layout(o, f) else
                   torch.empty_strided(f.shape, f.stride(), dtype=o.dtype, device=o.device).copy_(o))
    return res


def _meta(args) -> list:
    """Meta copies (shape, dtype, strides; no data) of the operands, for the fake's layout."""
    return [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") for a in args]


def _fresh(outs: list, args) -> list:
    """Outputs with no storage shared with an input or an earlier output (copies where they do)."""
    seen = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
    res = []
    for o in outs:
        if o.numel():
            p = o.untyped_storage().data_ptr()
            if p in seen:
                o = o.clone()
                p = o.untyped_storage().data_ptr()
            seen.add(p)
        res.append(o)
    return res


def get(impl):
    """The custom op of ``impl`` (a backends.registry.Impl with ``fake``), defined on first use; None for an
    implementation without a fake (it runs as plain Python under torch.compile)."""
    if impl.fake is None:
        return None
    hit = _OPS.get(impl.op_name)
    if hit is not None:
        return hit
    names = arg_names(impl.args)
    params = f", {impl.args}" if impl.args else ""
    fn, fake = impl.fn, impl.fake

    def body(args, *vals):
        call = OpCall(dict(zip(names, vals)))
        with torch.no_grad():
            outs = _outs(fn(call, *args))
        return _fresh(_conform(impl.op_name, outs, _outs(fake(call, *_meta(args)))), args)

    def fake_body(args, *vals):
        return _outs(fake(OpCall(dict(zip(names, vals))), *args))

    qual = f"{NAMESPACE}::{impl.op_name}"
    op = torch.library.custom_op(qual, body, mutates_args=(), schema=f"(Tensor[] args{params}) -> Tensor[]")
    op.register_fake(fake_body)
    if impl.grad:
        _register_backward(impl, op, names, params)
    _OPS[impl.op_name] = op
    return op


def _laid_out_like(x, g):
    """The gradient ``g`` of ``x`` (zeros for None) in the layout of ``torch.empty_like(x)``, the fake's."""
    out = torch.empty_like(x)
    if g is None:
        return out.zero_()
    return g if g.stride() == out.stride() else out.copy_(g)


def _autograd_on():
    """Autograd recording inside a custom op's body (the dispatcher runs a body with the autograd keys excluded):
    the backward op re-runs the forward through the implementation's autograd path there."""
    import contextlib
    K = torch._C.DispatchKey
    exc = torch._C._dispatch_tls_local_exclude_set()
    for k in (K.AutogradFunctionality, K.AutogradOther, K.AutogradNestedTensor, K.ADInplaceOrView):
        exc = exc.remove(k)
    stack = contextlib.ExitStack()
    stack.enter_context(torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exc))
    stack.enter_context(torch.enable_grad())
    return stack


def _register_backward(impl, op, names: list[str], params: str) -> None:
    """register_autograd for ``op``: the gradients of its float inputs by the implementation's own backward (see
    the module docstring)."""
    fn = impl.fn

    def bwd_body(args, grads, *vals):
        with _autograd_on():
            xs = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
            outs = _outs(fn(OpCall(dict(zip(names, vals))), *xs))
            pairs = [(o, g) for o, g in zip(outs, grads)
                     if g is not None and o.is_floating_point() and o.requires_grad]
            wrt = [x for x in xs if x.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
                if pairs else [None] * len(wrt)
        grads_in = [g for g in grads if g is not None]
        return _fresh([_laid_out_like(x, g) for x, g in zip(wrt, got)], list(args) + grads_in)

    def bwd_fake(args, grads, *vals):
        return [torch.empty_like(a) for a in args if a.is_floating_point()]

    bop = torch.library.custom_op(f"{NAMESPACE}::{impl.op_name}_backward", bwd_body, mutates_args=(),
                                  schema=f"(Tensor[] args, Tensor?[] grads{params}) -> Tensor[]")
    bop.register_fake(bwd_fake)

    def setup_context(ctx, inputs, output):
        args, *vals = inputs
        ctx.save_for_backward(*args)
        ctx.vals = vals

    def backward(ctx, grads):
        args = ctx.saved_tensors
        got = iter(bop(list(args), list(grads), *ctx.vals))
        return ([next(got) if a.is_floating_point() else None for a in args], *([None] * len(ctx.vals)))

    op.register_autograd(backward, setup_context=setup_context)


# -- generated Triton kernels (target triton: backends/triton/codegen.py) ------------------------------------------
_GENERATED: dict[str, dict] = {}       # the loaded kernel module's key -> {kernel name: (GeneratedKernel, jit fn)}


def register_generated(key: str, module, kernels) -> None:
    """Make the generated kernels of one loaded module (``write_and_load``) callable through ``mtc::generated``."""
    _GENERATED[key] = {k.name: (k, getattr(module, k.name)) for k in kernels}


def generated_launch(k, fn, args: list, shapes: list, into: dict | None = None):
    """Run generated kernel ``fn`` (of GeneratedKernel ``k``) on ``args`` made contiguous; returns its outputs, each
    in the row operands' dtype and viewed as ``shapes[i]`` (an epilogue may end in a reshape of the flat
    [rows, D] tiling): one output, or a tuple of several. ``into``: {output index: a row operand the output is
    written into} (in place; one that is not contiguous, or not in the row operands' dtype, is not taken: that
    output gets its own storage)."""
    from backends.triton.codegen import launch
    args = [a.contiguous() for a in args]
    row = next(a for a, r in zip(args, k.row_inputs) if r)
    into = into or {}

    def target(j):
        t = into.get(j)
        ok = t is not None and t.is_contiguous() and t.dtype == row.dtype and t.numel() == row.numel()
        return t if ok else torch.empty_like(row)
    outs = [target(j) for j in range(len(k.outputs))]
    launch(k, fn, args, outs)          # several rows per program when rows are short
    outs = [o.view(s) for o, s in zip(outs, shapes)]
    return outs[0] if len(outs) == 1 else tuple(outs)


def _split(sizes, ranks) -> list:
    out, i = [], 0
    for r in ranks:
        out.append(list(sizes[i:i + r]))
        i += r
    return out


def generated_op():
    """``mtc::generated(Tensor[] args, str key, str kernel, SymInt[] sizes, int[] ranks) -> Tensor[]``: the generated
    kernel ``kernel`` of the loaded module ``key`` (register_generated), its outputs shaped by ``sizes`` (the
    output shapes concatenated, ``ranks`` their lengths)."""
    hit = _OPS.get("generated")
    if hit is not None:
        return hit

    def body(args, key, kernel, sizes, ranks):
        k, fn = _GENERATED[key][kernel]
        return _outs(generated_launch(k, fn, list(args), _split(sizes, ranks)))

    def fake(args, key, kernel, sizes, ranks):
        k, _fn = _GENERATED[key][kernel]
        row = next(a for a, r in zip(args, k.row_inputs) if r)
        return [row.new_empty(s) for s in _split(sizes, ranks)]

    op = torch.library.custom_op(f"{NAMESPACE}::generated", body, mutates_args=(),
                                 schema="(Tensor[] args, str key, str kernel, SymInt[] sizes, int[] ranks) -> Tensor[]")
    op.register_fake(fake)
    _OPS["generated"] = op
    return op


def expert_load_op():
    """``mtc::expert_load(Tensor topk_idx, int num_experts) -> Tensor``: tokens per expert, int64 [E]
    (backends.reference.expert_load, the router statistics of ``m.routing_stats``)."""
    hit = _OPS.get("expert_load")
    if hit is not None:
        return hit

    def body(topk_idx, num_experts):
        from backends.reference import expert_load
        return expert_load(topk_idx, num_experts)

    op = torch.library.custom_op(f"{NAMESPACE}::expert_load", body, mutates_args=(),
                                 schema="(Tensor topk_idx, int num_experts) -> Tensor")
    op.register_fake(lambda topk_idx, num_experts: topk_idx.new_empty((num_experts,), dtype=torch.int64))
    _OPS["expert_load"] = op
    return op
