"""infer_shapes: compute every node's type from its inputs with the op's shape rule. Unknown types
('?' in printed IR) are filled in; a declared type that disagrees is an error at the node's source."""
from __future__ import annotations

from dsl.builder import ShapeError
from dsl.errors import MtcError
from dsl.ir import SOURCE_OPS, Graph

from .manager import register_pass


@register_pass("infer_shapes", stage="typed")
def infer_shapes(g: Graph) -> Graph:
    """Fill in and check the dtype and symbolic shape of every value."""
    from dsl.ops import OPS
    types: dict[str, tuple] = {}
    out = []
    for n in g.nodes:
        if n.op in SOURCE_OPS:
            out.append(n)
            types[n.name] = n.types
            continue
        od = OPS.get(n.op)
        if od is None:
            raise MtcError(f"%{n.name}: unknown op '{n.op}'", n.loc)
        try:
            in_types = [types[r.node][r.index] for r in n.inputs]
        except (KeyError, IndexError):
            raise MtcError(f"%{n.name} ({n.op}) uses an undefined value", n.loc) from None
        try:
            got = tuple(od.check_and_infer(in_types, {**od.attrs, **n.attr_dict}))
        except ShapeError as e:
            raise MtcError(f"shape error in {n.op}: {e}", n.loc) from None
        if n.types and all(t is not None for t in n.types):
            if len(got) != len(n.types) or not all(a.same(b) for a, b in zip(got, n.types)):
                raise MtcError(f"%{n.name} ({n.op}) is declared {', '.join(map(str, n.types))} but its inputs "
                               f"give {', '.join(map(str, got))}", n.loc)
            got = n.types
        n = n.replace(types=got)
        types[n.name] = got
        out.append(n)
    return g.with_nodes(out)
