"""verify: structural and type checks of a graph (SSA order, known ops, attributes of the right kind and value,
input counts, parameter shapes equal to what a layer op's attributes imply, types equal to what each op's shape
rule infers, shape symbols declared in the signature, unique parameter names)."""
from __future__ import annotations

from dsl.builder import ShapeError
from dsl.errors import MtcError
from dsl.ir import SOURCE_OPS, Graph, undeclared_symbols

from .fuse_tiles import ANNOTATIONS
from .manager import register_pass


def verify(g: Graph, *, untyped_ok: bool = False) -> Graph:
    """Check the graph is well formed; raise MtcError at the offending node's source location.

    ``untyped_ok``: an op node without a type ('?' in IR text) is checked against the type its inputs give, which
    its users are checked with; infer_shapes fills it in (the pipeline's first pass, before infer_shapes, runs
    this way). Otherwise every node needs its type."""
    from dsl.ops import OPS, check_source
    seen: dict[str, tuple] = {}            # node name -> its types (inferred for an untyped node)
    names: set[str] = set()
    dup = next((x for i, x in enumerate(g.symbols) if x in g.symbols[:i]), None)
    if dup:
        raise MtcError(f"graph '{g.name}' declares the shape symbol '{dup}' twice")
    for n in g.nodes:
        if n.name in seen:
            raise MtcError(f"node %{n.name} is defined twice", n.loc)
        for r in n.inputs:
            src = seen.get(r.node)
            if src is None:
                raise MtcError(f"%{n.name} ({n.op}) uses %{r.node} before it is defined", n.loc)
            if r.index >= len(src):
                raise MtcError(f"%{n.name} uses output {r.index} of %{r.node}, which has {len(src)}", n.loc)
        undeclared = undeclared_symbols(g, n)
        if undeclared:
            raise MtcError(f"%{n.name} ({n.op}): the type {undeclared[1]} uses the shape symbol '{undeclared[0]}', "
                           f"which graph '{g.name}' does not declare (its symbols: {', '.join(g.symbols) or 'none'})",
                           n.loc)
        if n.op in SOURCE_OPS:
            key = n.attr("name")
            try:
                check_source(n.op, n.attr_dict, n.types, ANNOTATIONS)
            except ShapeError as e:
                raise MtcError(f"%{n.name} ({n.op}): {e}", n.loc) from None
            if n.op != "input":
                if key in names:
                    raise MtcError(f"parameter name '{key}' is used twice", n.loc)
                names.add(key)
            seen[n.name] = n.types
            continue
        od = OPS.get(n.op)
        if od is None:
            raise MtcError(f"%{n.name}: unknown op '{n.op}'", n.loc)
        extra = set(n.attr_dict) - set(od.attrs) - set(ANNOTATIONS)
        if extra:
            raise MtcError(f"%{n.name}: op '{n.op}' has no attribute '{sorted(extra)[0]}'", n.loc)
        untyped = not n.types or any(t is None for t in n.types)
        if untyped and not untyped_ok:
            raise MtcError(f"%{n.name} ({n.op}) has no type: run passes.infer_shapes.infer_shapes(g) on the graph "
                           f"first (dsl.compile runs it)", n.loc)
        in_types = [seen[r.node][r.index] for r in n.inputs]
        try:
            want = tuple(od.check_and_infer(in_types, {**od.attrs, **n.attr_dict}))
        except ShapeError as e:
            raise MtcError(f"%{n.name} ({n.op}): {e}", n.loc) from None
        if not untyped and (len(want) != len(n.types) or not all(a.same(b) for a, b in zip(want, n.types))):
            raise MtcError(f"%{n.name} ({n.op}) is typed {', '.join(map(str, n.types))} but its inputs give "
                           f"{', '.join(map(str, want))}", n.loc)
        seen[n.name] = want if untyped else n.types
    for r in g.outputs:
        if r.node not in seen:
            raise MtcError(f"graph output %{r.node} is not defined")
    return g


@register_pass("verify")
def verify_pass(g: Graph) -> Graph:
    """Check the graph is well formed (nodes still untyped, '?' in IR text, are left for infer_shapes)."""
    return verify(g, untyped_ok=True)
