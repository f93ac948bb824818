"""batch_attn_residual: the two-phase form of Block AttnRes (../shared/spec/OPS.md, attn_residual).

Within one block every AttnRes read scores the same completed bank (plus, after the first sublayer, the
block's growing partial sum). The pass groups those reads, emits ONE ``attn_residual_phase1`` per block
(all of the block's pseudo-queries against the bank: one read of the bank instead of one per sublayer)
and turns every read into a cheap ``attn_residual_merge`` with its partial (online-softmax rule).

Grouping: a read's last source is its partial unless a later read uses that value inside its bank (then
the value is a completed block and the read's sources are all bank). Reads sharing a bank form a group;
groups of one read are left as they are.
"""
from __future__ import annotations

from dsl.ir import SOURCE_OPS, Graph, Node, Ref, TensorType, make_attrs

from .manager import register_pass


def phase1_acc_dtype(dtype: str) -> str:
    """The dtype the Triton phase 1 stores its accumulator in for a bank (or compute) dtype: the 16-bit ones
    themselves, float32 otherwise (backends.runtime._phase1_acc_dtype, the same rule on torch dtypes). The graph
    types the accumulator f32, the op's contract; the memory plan and the Triton lowering retype it."""
    return dtype if dtype in ("bf16", "f16") else "f32"


def _groups(g: Graph):
    reads = [n for n in g.nodes if n.op == "attn_residual"]
    in_bank: set[Ref] = set()
    for n in reads:
        in_bank.update(n.inputs[2:-1])
    groups: list[tuple[tuple[Ref, ...], list[tuple[Node, Ref | None]]]] = []
    for n in reads:
        srcs = n.inputs[2:]
        if srcs[-1] in in_bank or len(srcs) == 1:
            bank, partial = tuple(srcs), None
        else:
            bank, partial = tuple(srcs[:-1]), srcs[-1]
        if not bank:
            continue
        if groups and groups[-1][0] == bank:
            groups[-1][1].append((n, partial))
        else:
            groups.append((bank, [(n, partial)]))
    return [gr for gr in groups if len(gr[1]) > 1]


@register_pass("batch_attn_residual")
def batch_attn_residual(g: Graph) -> Graph:
    """Rewrite each block's AttnRes reads into one phase-1 kernel over the bank plus per-read merges."""
    groups = _groups(g)
    if not groups:
        return g
    first: dict[str, Node] = {}
    merge: dict[str, Node] = {}
    for bank, reads in groups:
        lead = reads[0][0]
        qs = tuple(n.inputs[0] for n, _ in reads)
        ws = tuple(n.inputs[1] for n, _ in reads)
        eps = lead.attr("eps")
        pname = f"{lead.name}.phase1"
        sh = lead.types[0].shape
        Q = len(reads)
        p1 = Node(pname, "attn_residual_phase1", qs + ws + bank, make_attrs({"n_queries": Q, "eps": eps}),
                  (TensorType("f32", (Q,) + sh), TensorType("f32", (Q,) + sh[:-1]), TensorType("f32", (Q,) + sh[:-1])),
                  lead.loc)
        first[lead.name] = p1
        for i, (n, partial) in enumerate(reads):
            ins = (Ref(pname, 0), Ref(pname, 1), Ref(pname, 2), n.inputs[0], n.inputs[1])
            ins += (partial,) if partial is not None else ()
            merge[n.name] = Node(n.name, "attn_residual_merge", ins,
                                 make_attrs({"index": i, "eps": eps, "dtype": n.types[0].dtype}), n.types, n.loc)
    # the phase-1 node needs every query of its block: hoist parameters and inputs to the front
    out = [n for n in g.nodes if n.op in SOURCE_OPS]
    for n in g.nodes:
        if n.op in SOURCE_OPS:
            continue
        if n.name in first:
            out.append(first[n.name])
        out.append(merge.get(n.name, n))
    return g.with_nodes(out)
