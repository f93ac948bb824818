"""canonicalize: expand layer-level blocks (kda_layer, mla_layer, glu_ffn, latent_moe, moe) into
primitive ops, then apply simplification rewrites to a fixed point and drop dead nodes.

Rewrites are data: each :class:`Rule` is an op to match, a predicate and a replacement function; the ops declare
theirs (``rewrites=`` in dsl/ops, e.g. reshape's reshape-noop and reshape-reshape).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dsl.builder import GraphBuilder
from dsl.ir import Graph, Node, Ref, live_nodes  # noqa: F401  (live_nodes: re-exported)

from .manager import register_pass


@dataclass
class Rule:
    """Rewrite ``op`` nodes for which ``match(node, nodes)`` holds: ``rewrite`` returns a Ref that
    replaces the node's (single) output."""

    name: str
    op: str
    match: Callable[[Node, dict], bool]
    rewrite: Callable[[Node, dict], Ref]


def rules_from_ops() -> list[Rule]:
    """The rewrites the ops declare (``register(..., rewrites=...)`` in dsl/ops), in registration order."""
    from dsl.ops import OPS
    return [Rule(r.name, od.name, r.match, r.rewrite) for od in OPS.values() for r in od.rewrites]


RULES = rules_from_ops()


def expand_layers(g: Graph) -> Graph:
    from dsl.ops import OPS
    b = GraphBuilder(g.name, g.symbols)
    b.meta = dict(g.meta, canonicalized=True)      # plan_memory tells a canonical graph from a primitive-op spec
    remap: dict[tuple, Ref] = {}

    def m(r: Ref) -> Ref:
        return remap.get((r.node, r.index), r)

    for n in g.nodes:
        od = OPS.get(n.op)
        if od is not None and od.expand is not None:
            b.name_prefix = f"{n.name}."
            b._count = 0
            outs = od.expand(b, [m(r) for r in n.inputs], {**od.attrs, **n.attr_dict}, n.loc)
            for i, r in enumerate(outs):
                remap[(n.name, i)] = r
        else:
            b.add_node(n.replace(inputs=tuple(m(r) for r in n.inputs)))
    return b.build([m(r) for r in g.outputs])


def apply_rules(g: Graph, rules=RULES) -> Graph:
    by_op: dict[str, list[Rule]] = {}
    for r in rules:
        by_op.setdefault(r.op, []).append(r)
    changed = True
    while changed:
        changed = False
        nodes: dict[str, Node] = {}
        remap: dict[tuple, Ref] = {}
        out = []
        for n in g.nodes:
            n = n.replace(inputs=tuple(remap.get((r.node, r.index), r) for r in n.inputs))
            for rule in by_op.get(n.op, ()):
                if rule.match(n, nodes):
                    res = rule.rewrite(n, nodes)
                    if isinstance(res, Ref):
                        remap[(n.name, 0)] = res
                        n = None
                    else:  # (op, new_input): same node, new input
                        n = n.replace(inputs=(res[1],) + n.inputs[1:])
                    changed = True
                    break
            if n is not None:
                nodes[n.name] = n
                out.append(n)
        g = g.with_nodes(out, [remap.get((r.node, r.index), r) for r in g.outputs])
    return g


def dead_code(g: Graph) -> Graph:
    """Drop the nodes the outputs do not depend on, parameters and buffers included (a parameter only a dropped
    op used is not part of the model: not in its state dict, not counted). Graph inputs stay (the signature)."""
    live = live_nodes(g)
    return g.with_nodes(n for n in g.nodes if n.name in live or n.op == "input")


@register_pass("canonicalize", stage="canonical")
def canonicalize(g: Graph) -> Graph:
    """Expand layer blocks into primitive ops, simplify, remove dead nodes."""
    return dead_code(apply_rules(expand_layers(g)))
