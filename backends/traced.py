"""The runtime's path under ``torch.compile`` and ``torch.export`` (``CompiledModule.run`` takes it while
``torch.compiler.is_compiling()``): the same program's launches, each as something the tracer sees through.

* an implementation with a fake runs as its custom op, ``torch.ops.mtc.<op>_<target>`` (backends/custom_ops.py);
* a view, ``concat``, a GEMM on the vendor library (plain torch calls) runs its implementation as Python, which
  the tracer records op by op;
* a generated Triton kernel (target triton) runs as the custom op ``mtc::generated``.

Everything the tracer cannot follow is prepared before (:func:`build`, at ``dsl.compile``): the launches' operands
(activation buffers by name, weights by submodule and attribute), the attribute values each custom op takes, and the
symbolic shapes (reshape / broadcast targets) as plain-Python functions of the shape symbols, so that they hold for
dynamic sizes too. What the eager runtime does besides the launches is left out here: the input value checks (NaN /
inf, token ids in the vocabulary), the memory check, buffer freeing at last use (the compiler plans buffers),
``m.last_run``, ``m.tracing()`` and ``progress``. The router statistics stay (``m.routing_stats``, the stats hooks);
a train-mode forward's router-bias update runs outside the graph (a graph break), and an activation-checkpoint
recomputation is not told apart from a forward there.
"""
from __future__ import annotations

import sympy
import torch

from dsl.errors import MtcError


class Dims:
    """A list of symbolic dimensions as a function of the shape symbols' sizes ({name: int or SymInt})."""

    __slots__ = ("fns", "text")

    def __init__(self, dims):
        from dsl.ir import dim
        self.text = str(list(dims))
        self.fns = [_expr_fn(dim(d)) for d in dims]

    def __call__(self, bind) -> list:
        return [f(bind) for f in self.fns]


def _expr_fn(e):
    """A Python function of the sizes for the sympy expression ``e`` (integer arithmetic: +, *, integer powers,
    floor / ceiling of a quotient, mod). MtcError for another form."""
    if isinstance(e, int):
        e = sympy.Integer(e)          # (dims are sympy expressions built by the DSL, or ints: never text)
    if e.is_Integer:
        v = int(e)
        return lambda b: v
    if e.is_Symbol:
        name = str(e)
        return lambda b: b[name]
    if e.is_Add:
        fs = [_expr_fn(a) for a in e.args]

        def add(b):
            out = 0
            for f in fs:
                out = out + f(b)
            return out
        return add
    if e.is_Mul:
        coeff, rest = e.as_coeff_Mul()
        if coeff.is_Rational and coeff.q != 1:
            p, q, f = int(coeff.p), int(coeff.q), _expr_fn(rest)
            return lambda b: (p * f(b)) // q
        fs = [_expr_fn(a) for a in e.args]

        def mul(b):
            out = 1
            for f in fs:
                out = out * f(b)
            return out
        return mul
    if e.is_Pow and e.exp.is_Integer and int(e.exp) >= 0:
        f, k = _expr_fn(e.base), int(e.exp)
        return lambda b: f(b) ** k
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        num, den = e.args[0].as_numer_denom()
        fn, fd = _expr_fn(num), _expr_fn(den)
        if isinstance(e, sympy.floor):
            return lambda b: fn(b) // fd(b)
        return lambda b: -((-fn(b)) // fd(b))
    if isinstance(e, sympy.Mod):
        fa, fm = _expr_fn(e.args[0]), _expr_fn(e.args[1])
        return lambda b: fa(b) % fm(b)
    raise MtcError(f"torch.compile: the shape expression {e} has no integer form the tracer can follow")


class TracedCall:
    """What an implementation run as Python (a view, concat, a library GEMM) sees under the tracer: the launch's
    attributes, its shapes evaluated at the traced sizes."""

    __slots__ = ("attrs", "bind", "in_types", "loc")

    def __init__(self, attrs, bind, in_types, loc):
        self.attrs, self.bind, self.in_types, self.loc = attrs, bind, in_types, loc

    def attr(self, key: str, default=None):
        return self.attrs.get(key, default)

    def shape(self, dims) -> list:
        return dims(self.bind) if isinstance(dims, Dims) else [int(d) for d in dims]


def _plain(v):
    """An attribute value the tracer can hold as a constant: numbers as Python numbers, shapes as Dims; None for a
    value of another kind (it stays out of the traced attributes)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v, True
    if isinstance(v, sympy.Basic):
        if v.is_Integer:
            return int(v), True
        if v.is_Number:
            return float(v), True
        return None, False
    if isinstance(v, (list, tuple)):
        if any(isinstance(d, sympy.Basic) and not d.is_Number for d in v):
            return Dims(v), True
        vals = [_plain(d) for d in v]
        if all(ok for _v, ok in vals):
            return [x for x, _ok in vals], True
    return None, False


def _coerce(kind: str, v):
    if v is None:
        return None
    base = kind.rstrip("?")
    if base == "float":
        return float(v)
    if base in ("int", "SymInt"):
        return int(v)
    if base == "bool":
        return bool(v)
    if base == "str":
        return str(v)
    if base.startswith("SymInt[]"):
        return Dims(v)
    return v


def build(module, program) -> tuple:
    """The steps of ``program`` for :func:`run`: one per launch, (kind, what runs, its attribute values or call
    attributes, operands, output buffer names, the router node or None)."""
    from backends.custom_ops import arg_names, arg_types, generated_op
    bound = module._bound_program(program)
    defined = {str(n.out()) for n in module.graph.inputs()} | {r for L in program.launches for r, _t in L.outputs}
    steps = []
    for L, fn, call in bound:
        # an activation buffer by name; a weight by (submodule, attribute), read at each call
        ins = [(r, None, None) if r in defined else (r,) + module._slot(r[1:]) for r, _t in L.inputs]
        outs = tuple(r for r, _t in L.outputs)
        route = call.node if L.op == "qb_route" else None
        if L.generated is not None:
            k = L.generated
            shapes = tuple(Dims(t.shape) for _r, t in L.outputs)
            steps.append(("generated", generated_op(), (module._generated_key, k.name, shapes), ins, outs, route))
            continue
        op = fn.custom_op
        if op is not None:
            vals = tuple(_coerce(t, call.attr(n)) for n, t in zip(arg_names(fn.args), arg_types(fn.args)))
            steps.append(("op", op, vals, ins, outs, route))
            continue
        attrs = {}
        for key, v in call.attrs.items():
            pv, ok = (Dims(v), True) if key == "shape" and isinstance(v, (list, tuple)) else _plain(v)
            if ok:
                attrs[key] = pv
        steps.append(("python", fn.fn, (attrs, tuple(call.in_types), call.node.loc), ins, outs, route))
    return tuple(steps)


def input_table(graph) -> tuple:
    """(name, buffer name, rank, ((axis, symbol name or None, fixed size or None), ...)) of each graph input."""
    out = []
    for n in graph.inputs():
        axes = []
        for i, d in enumerate(n.type.shape):
            if isinstance(d, sympy.Symbol):
                axes.append((i, str(d), None))
            elif getattr(d, "is_number", False) or isinstance(d, int):
                axes.append((i, None, int(d)))
            else:
                axes.append((i, None, None))
        out.append((n.attr("name"), str(n.out()), n.type.rank, tuple(axes)))
    return tuple(out)


def run(module, inputs: dict, training: bool) -> list:
    """One forward of ``module`` under the tracer (see the module docstring); returns the list of outputs.
    MtcError for a missing input or one of the wrong rank or fixed size."""
    steps = module._traced.get(training)
    if steps is None:
        raise MtcError(f"{module.graph.name}: torch.compile / torch.export needs the module's launches prepared by "
                       f"dsl.compile (a module compiled on device='meta' has none)")
    env, bind = {}, {}
    for name, ref, rank, axes in module._input_table:
        if name not in inputs:
            raise MtcError(f"missing graph input '{name}'")
        x = inputs[name]
        if x.dim() != rank:
            raise MtcError(f"input '{name}' must be a tensor of rank {rank}, got shape {tuple(x.shape)}")
        for i, sym, fixed in axes:
            s = x.shape[i]
            if sym is not None:
                if sym in bind:
                    torch._check(bind[sym] == s, lambda: f"input '{name}': dimension {sym} differs across inputs")
                else:
                    bind[sym] = s
            elif fixed is not None and s != fixed:
                raise MtcError(f"input '{name}' has size {s} at dimension {i} where the graph needs {fixed}")
        env[ref] = x
    for kind, what, vals, ins, outs, route in steps:
        args = [env[r] if sub is None else getattr(sub, leaf) for r, sub, leaf in ins]
        if any(not isinstance(a, torch.Tensor) for a in args):
            raise MtcError(f"{module.graph.name}: torch.compile / torch.export do not take packed MXFP4 experts "
                           f"(MXFP4Experts weights, not tensors): compile with packed_experts=False (dsl.from_hf: "
                           f"dequantize=True), or run the module eagerly")
        if kind == "op":
            res = what(args, *[v(bind) if isinstance(v, Dims) else v for v in vals])
            out = res[0] if len(outs) == 1 else tuple(res)
        elif kind == "generated":
            key, name, shapes = vals
            res = what(args, key, name, [s for d in shapes for s in d(bind)], [len(d.fns) for d in shapes])
            out = res[0] if len(outs) == 1 else tuple(res)
        else:
            attrs, in_types, loc = vals
            out = what(TracedCall(attrs, bind, in_types, loc), *args)
        if route is not None:
            module._traced_route(route, out, args, inputs)
        if len(outs) == 1:
            env[outs[0]] = out
        else:
            for r, v in zip(outs, out):
                env[r] = v
    return [env[str(r)] for r in module.graph.outputs]
