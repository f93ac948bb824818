"""fuse_tiles: group each heavy op with the elementwise, normalisation and view ops around it into one
kernel, and record the tile sizes chosen for it.

The rules are data (:data:`RULES`), built from the ops' declarations (``fusion=Fusion(...)`` in dsl/ops): an
anchor op, the ops its prologue may absorb (walking up its inputs), the ops its epilogue may absorb (walking down
its single-use output), the ops that may feed an epilogue op from the side (e.g. the sigmoid of an output gate),
and a tile-size rule. A producer is absorbed only when every one of its users is already in the group, so no
value is computed twice.

The result annotates nodes (the IR stays executable op by op):
    fusion = "<anchor node>"   on every member of a group
    tiles  = {...}             on the anchor: the compiler's tile choice, overridable per rule
The lowering (passes/lower.py) turns each group into one kernel launch.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

from dsl.errors import MtcWarning
from dsl.ir import Graph, Node
from dsl.ops import op_set, ops_with_role

from .manager import register_pass

from dsl.ir import ANNOTATIONS  # noqa: E402,F401  (the annotations this pass adds)


@dataclass
class FusionRule:
    name: str
    anchor: str
    prologue: frozenset = frozenset()
    epilogue: frozenset = frozenset()
    side: frozenset = frozenset()
    tiles: Callable[[Node, dict], dict] = lambda n, nodes: {}
    when: Callable[[Node, dict], bool] = lambda n, nodes: True
    doc: str = ""


VIEWS = ops_with_role("view")


def rules_from_ops() -> list[FusionRule]:
    """One FusionRule per op that declares the kernel it anchors (``fusion=Fusion(...)`` in dsl/ops), its
    ``role:<role>`` entries resolved to the ops of that role."""
    from dsl.ops import OPS
    return [FusionRule(f.name, od.name, prologue=op_set(f.prologue), epilogue=op_set(f.epilogue),
                       side=op_set(f.side), tiles=f.tiles, when=f.when, doc=f.doc)
            for od in OPS.values() if (f := od.fusion) is not None]


RULES: list[FusionRule] = rules_from_ops()


def _groups(g: Graph, rules=RULES) -> dict[str, tuple[FusionRule, list[str]]]:
    nodes = g.node_map()
    order = {n.name: i for i, n in enumerate(g.nodes)}       # a group's members in graph (topological) order
    users = g.users()
    owner: dict[str, str] = {}
    groups: dict[str, tuple[FusionRule, list[str]]] = {}
    by_anchor = {}
    for r in rules:
        by_anchor.setdefault(r.anchor, []).append(r)
    for n in g.nodes:
        for rule in by_anchor.get(n.op, ()):
            if n.name in owner or not rule.when(n, nodes):
                continue
            members = {n.name}

            def absorb_up(name: str, allowed: frozenset):
                p = nodes[name]
                if p.name in owner or p.name in members or p.op not in allowed:
                    return
                if not all(u in members for u in users[p.name]):
                    return
                members.add(p.name)
                for r in p.inputs:
                    absorb_up(r.node, allowed)

            for r in n.inputs:
                absorb_up(r.node, rule.prologue)
            cur = n
            while len(users[cur.name]) == 1:
                c = nodes[users[cur.name][0]]
                if c.op not in rule.epilogue or c.name in owner:
                    break
                members.add(c.name)
                for r in c.inputs:
                    if r.node not in members:
                        absorb_up(r.node, rule.side)
                cur = c
            for m in members:
                owner[m] = n.name
            groups[n.name] = (rule, sorted(members, key=order.__getitem__))
            break
    return groups


@register_pass("fuse_tiles", stage="fused")
def fuse_tiles(g: Graph) -> Graph:
    """Group heavy ops with their prologue/epilogue ops; annotate members and the anchor's tiles."""
    groups = _groups(g)
    nodes = g.node_map()
    member_of = {m: a for a, (_r, ms) in groups.items() for m in ms}
    out = []
    for n in g.nodes:
        a = member_of.get(n.name)
        if a is None:
            out.append(n)
            continue
        attrs = dict(n.attr_dict)
        attrs["fusion"] = a
        if n.name == a:
            tiles = groups[a][0].tiles(n, nodes)
            given = n.attr("tiles")
            if given is not None and dict(given) != dict(tiles):
                # an IR written by hand or edited (parse_ir) carries tiles: they are this pass's choice, not input
                warnings.warn(MtcWarning(f"%{n.name} ({n.op}): tiles {dict(given)} in the input IR are replaced by "
                                         f"fuse_tiles' choice {dict(tiles)} (tile sizes are chosen by the pass, by "
                                         f"the anchor op's fusion rule in dsl/ops, not read from the IR)", n.loc),
                              stacklevel=2)
            attrs["tiles"] = tiles
        out.append(n.replace(attrs=attrs))
    return g.with_nodes(out)


def describe_groups(g: Graph) -> str:
    """A comment block listing each fusion group and what it absorbed (for `mtc ir --stage fused`)."""
    from collections import Counter, OrderedDict
    groups: "OrderedDict[str, list[Node]]" = OrderedDict()
    for n in g.nodes:
        a = n.attr("fusion")
        if a is not None:
            groups.setdefault(a, []).append(n)
    lines = [f"// {len(groups)} fused kernels (the first two of each anchor op listed, then the count per anchor op)"]
    kinds = Counter()
    for a, ms in groups.items():
        anchor = next(m for m in ms if m.name == a)
        absorbed = Counter(m.op for m in ms if m.name != a)
        kinds[anchor.op] += 1
        if kinds[anchor.op] <= 2:
            what = ", ".join(f"{op} x{c}" if c > 1 else op for op, c in absorbed.items()) or "nothing"
            lines.append(f"//   %{a} {anchor.op} {dict(anchor.attr('tiles') or ())}: absorbs {what}")
    if kinds:
        lines.append("//   per anchor op: " + ", ".join(f"{k} x{v}" for k, v in kinds.items()))
    return "\n".join(lines) + "\n"
