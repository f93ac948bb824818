"""verify: structural and type checks of a graph (SSA order, known ops and attributes, input counts,
types equal to what each op's shape rule infers, unique parameter names)."""
from __future__ import annotations

from dsl.builder import ShapeError
from dsl.errors import MtcError
from dsl.ir import SOURCE_OPS, Graph

from .fuse_tiles import ANNOTATIONS
from .manager import register_pass


@register_pass("verify")
def verify(g: Graph) -> Graph:
    """Check the graph is well formed; raise MtcError at the offending node's source location."""
    from dsl.ops import OPS
    seen: dict[str, object] = {}
    names: set[str] = set()
    for n in g.nodes:
        if n.name in seen:
            raise MtcError(f"node %{n.name} is defined twice", n.loc)
        for r in n.inputs:
            src = seen.get(r.node)
            if src is None:
                raise MtcError(f"%{n.name} ({n.op}) uses %{r.node} before it is defined", n.loc)
            if r.index >= len(src.types):
                raise MtcError(f"%{n.name} uses output {r.index} of %{r.node}, which has {len(src.types)}", n.loc)
        if n.op in SOURCE_OPS:
            key = n.attr("name")
            if n.op != "input":
                if key in names:
                    raise MtcError(f"parameter name '{key}' is used twice", n.loc)
                names.add(key)
            if len(n.types) != 1 or n.types[0] is None:
                raise MtcError(f"{n.op} %{n.name} needs a type", n.loc)
        else:
            od = OPS.get(n.op)
            if od is None:
                raise MtcError(f"%{n.name}: unknown op '{n.op}'", n.loc)
            extra = set(n.attr_dict) - set(od.attrs) - set(ANNOTATIONS)
            if extra:
                raise MtcError(f"%{n.name}: op '{n.op}' has no attribute '{sorted(extra)[0]}'", n.loc)
            if any(t is None for t in n.types) or not n.types:
                raise MtcError(f"%{n.name} ({n.op}) has no type; run infer_shapes", n.loc)
            in_types = [seen[r.node].types[r.index] for r in n.inputs]
            try:
                want = od.check_and_infer(in_types, {**{k: v for k, v in od.attrs.items()}, **n.attr_dict})
            except ShapeError as e:
                raise MtcError(f"%{n.name} ({n.op}): {e}", n.loc) from None
            if len(want) != len(n.types) or not all(a.same(b) for a, b in zip(want, n.types)):
                raise MtcError(f"%{n.name} ({n.op}) is typed {', '.join(map(str, n.types))} but its inputs give "
                               f"{', '.join(map(str, want))}", n.loc)
        seen[n.name] = n
    for r in g.outputs:
        if r.node not in seen:
            raise MtcError(f"graph output %{r.node} is not defined")
    return g
