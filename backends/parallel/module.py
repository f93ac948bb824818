"""A compiled model on a torch.distributed DeviceMesh: ``parallelize(m, mesh)`` (also ``m.parallelize(mesh)`` and
``dsl.compile(graph, mesh=mesh)``).

The mesh's dimensions are named from ``dp`` (data parallel), ``ep`` (expert parallel) and ``cp`` (context
parallel); a dimension may be missing or of size 1. Each rank runs the same kernel program (passes/lower.py) on
its own tokens:

* ``dp`` and ``ep`` ranks take different sequences (rows of the batch); ``cp`` ranks take contiguous runs of
  the same sequences, in rank order (any lengths >= 1; ``backends.parallel.split_sizes`` gives the even split).
* ``cp``: the sequence-mixing launches run their context-parallel forms (backends/parallel/context.py):
  kda_chunk by state passing, short_conv with the previous ranks' last inputs, mla_attention over the whole
  sequence's K / V, computed from MLA's all-gathered latent (576 values per token for K3: the launches between the
  latent and K / V run on the whole sequence; ``m.cp_gathered_width``); everything else is per token.
* ``ep``: each rank holds the expert slots that ``passes.place_experts.plan`` gives its ``ep`` coordinate
  (replicas included; uniform load unless ``placements`` are given) under the full model's parameter names, with
  the slot count as the first dimension; moe_experts dispatches and combines with all_to_all_single
  (backends/parallel/expert.py).
* QB (spec/OPS.md qb_update): each router's step uses the scores of all the ``cp`` ranks' tokens (exact: one
  sequence's statistics are not split; the ranks exchange their q + 1 largest margins per expert, not the scores), and its b_hat is averaged over the ``dp`` x ``ep`` ranks (the data-parallel
  rule), so every rank keeps the same router biases.
* Gradients: after ``loss.backward()``, :meth:`ParallelModule.sync_gradients` sums the dense weights' gradients
  over the whole mesh and the experts' over ``dp`` x ``cp`` (and over the replicas of an expert), so that with each
  rank's loss a sum over its tokens divided by the global token count, every rank holds the gradient of the
  single-process mean loss. With ``fsdp=True`` the dense weights are sharded over the mesh by FSDP2
  (``fully_shard`` per layer block, then the module: the torchtitan pattern), which reduce-scatters their
  gradients in the backward; sync_gradients then only rescales them (FSDP2 averages) and handles the experts.
* FSDP2 units: the kernel program reads the weights itself, not through the layer modules' forward; the runtime
  runs each unit's launches inside a call of its block modules (CompiledModule._launch_units), so that FSDP2's
  hooks all-gather one unit's weights for its launches, free them after, and gather them again for its backward.
  A unit is the layer blocks (``model.layers.<i>``) whose weights one launch reads together: one Block AttnRes
  group of layers for K3 (phase 1 reads the group's pseudo-queries); ``m.fsdp_units`` lists them.
* State dict: ``m.state_dict()`` has the full model's names and shapes on every rank, as DTensors where a rank
  holds a part: FSDP2's Shard(0) of the dense weights over the mesh, and each expert weight as a DTensor of the
  whole [E, ...] weight (Shard(0) on ep in torch.chunk's split, Replicate on dp / cp), its rows exchanged from the
  slots that hold each expert's first replica: with ep > 1, ``state_dict()`` is a collective call. Buffers (router
  biases, counts) are whole on every rank. ``torch.distributed.checkpoint`` saves and loads it, and
  ``load_state_dict`` takes whole tensors or DTensors of any other layout (a load_state_dict pre-hook cuts each to
  this rank's), so a checkpoint moves between meshes and to and from a single process.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from backends.runtime import CompiledModule
from dsl.errors import MtcError

__all__ = ["DIMS", "Layout", "ParallelModule", "parallelize", "mesh_layout"]

#: the mesh dimension names mtc knows
DIMS = ("dp", "ep", "cp")
#: launches that mix tokens along the sequence: their context-parallel forms
CP_OPS = ("kda_chunk", "short_conv", "mla_attention")
#: per-token ops that may sit between MLA's latent and its K / V (the up-projection cone, run on the gathered latent)
_TOKEN_OPS = ("linear", "rmsnorm", "slice", "reshape", "broadcast", "concat", "l2norm", "silu", "sigmoid", "mul",
              "add")


def _width(t) -> int:
    """Values per token of a [B, T, ...] type."""
    n = 1
    for d in t.shape[2:]:
        n *= int(d)
    return n


def _kv_cones(program, graph) -> dict:
    """{mla_attention launch anchor: (the names of the launches' outputs in its K / V cone, the cone's frontier
    buffers)}: the per-token launches that feed only K and V of one mla_attention, back to the buffers they start
    from (MLA's latent [c_kv | k_rope], 576 values per token for K3). Context parallel gathers the frontier and
    runs the cone on the whole sequence instead of gathering K and V (DeepSeek-V2's latent, arXiv 2405.04434,
    sec. 2.1). A cone is kept only when its frontier is narrower than K and V together."""
    nodes = graph.node_map()
    producer = {r: L for L in program.launches for r, _t in L.outputs}
    consumers: dict = {}
    for L in program.launches:
        for r, _t in L.inputs:
            consumers.setdefault(r, []).append(L)
    out = {}
    for M in program.launches:
        if M.op != "mla_attention":
            continue
        sym = M.inputs[0][1].shape[1]
        cone: dict = {}                 # launch index -> launch

        def token_wise(L) -> bool:
            if L.op not in _TOKEN_OPS or len(L.ops) != 1:
                return False
            types = [t for r, t in L.inputs if r in producer] + [t for _r, t in L.outputs]
            if any(t.rank < 3 or t.shape[1] != sym for t in types):
                return False
            if L.op == "linear" and _width(L.outputs[0][1]) < _width(L.inputs[0][1]):
                return False            # a down-projection: its output is the latent, the cone starts there
            d = nodes[L.anchor].attr("dim")
            return d is None or d % L.outputs[0][1].rank >= 2
        grew = True
        while grew:
            grew = False
            for r, _t in list(M.inputs[1:]) + [x for L in cone.values() for x in L.inputs]:
                P = producer.get(r)
                if P is None or P.index in cone or not token_wise(P):
                    continue
                if all(C is M and C.inputs[0][0] != o or C.index in cone
                       for o, _t in P.outputs for C in consumers.get(o, [])):
                    cone[P.index] = P
                    grew = True
        outs = {o for L in cone.values() for o, _t in L.outputs}
        frontier = {r: t for L in cone.values() for r, t in L.inputs if r in producer and r not in outs}
        width = sum(_width(t) for t in frontier.values()) if frontier else None
        kv = sum(_width(t) for _r, t in M.inputs[1:])
        if cone and width is not None and width < kv and M.inputs[1][0] in outs and M.inputs[2][0] in outs:
            out[M.anchor] = (outs, set(frontier), width)
    return out


@dataclass
class Layout:
    """The mesh as a parallel module uses it: sizes and coordinates per dimension (1 and 0 for one that is absent),
    and the process groups (None where the group would be this rank alone)."""

    mesh: object
    sizes: dict
    coords: dict
    cp_group: object = None
    ep_group: object = None
    balance_group: object = None       # dp x ep: QB averages b_hat over it
    dense_group: object = None         # the whole mesh: dense gradients are summed over it
    expert_group: object = None        # dp x cp: expert gradients are summed over it
    dense_mesh: object = None          # the 1-D mesh of dense_group (FSDP2 shards over it)


@dataclass
class _EPLayer:
    layer: str
    keys: tuple                         # state-dict keys of w1, w3, w2
    num_experts: int
    placement: object
    slots: torch.Tensor                 # logical expert of each local slot
    replicated: list = field(default_factory=list)   # logical experts with several replicas


def _submesh(mesh, names, dims):
    """The 1-D mesh over the dims ``dims`` of ``mesh`` that are present with size > 1 (flattened when several);
    None when there is none."""
    present = [d for d in names if d in dims and mesh.size(names.index(d)) > 1]
    if not present:
        return None
    if len(present) == 1:
        return mesh[present[0]]
    return mesh[tuple(present)]._flatten("_".join(present))


def _group(mesh, names, dims):
    sub = _submesh(mesh, names, dims)
    return None if sub is None else sub.get_group()


def mesh_layout(mesh, device_type: str | None = None) -> Layout:
    """Check a DeviceMesh for mtc and build its process groups (a collective call: every rank of the mesh makes it).

    Raises MtcError for something that is not a DeviceMesh, a mesh without dimension names, names outside
    dp / ep / cp (or repeated), or a mesh on another device type than the model's weights."""
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise MtcError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh (init_device_mesh(\"cpu\", (2,), "
                       f"mesh_dim_names=(\"cp\",))), got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if not names:
        raise MtcError(f"mesh: name its dimensions (init_device_mesh(..., mesh_dim_names=...)) from {', '.join(DIMS)}; "
                       f"this mesh of shape {tuple(mesh.shape)} has none")
    bad = [n for n in names if n not in DIMS]
    if bad:
        from dsl.errors import did_you_mean
        raise MtcError(f"mesh: unknown dimension name {bad[0]!r}{did_you_mean(bad[0], DIMS)}; mtc's are "
                       f"{', '.join(DIMS)} (data, expert and context parallel)")
    if len(set(names)) != len(names):
        raise MtcError(f"mesh: dimension names repeat: {names}")
    if device_type is not None and mesh.device_type != device_type:
        raise MtcError(f"mesh: it is a {mesh.device_type!r} mesh but the model's weights are on {device_type!r}")
    sizes = {d: (mesh.size(names.index(d)) if d in names else 1) for d in DIMS}
    coords = {d: (mesh.get_local_rank(d) if d in names else 0) for d in DIMS}
    return Layout(mesh, sizes, coords,
                  cp_group=_group(mesh, names, ("cp",)), ep_group=_group(mesh, names, ("ep",)),
                  balance_group=_group(mesh, names, ("dp", "ep")), dense_group=_group(mesh, names, DIMS),
                  expert_group=_group(mesh, names, ("dp", "cp")), dense_mesh=_submesh(mesh, names, DIMS))


def parallelize(m: CompiledModule, mesh, *, num_slots: int | dict | None = None, placements: dict | None = None,
                fsdp: bool = False):
    """Make ``m`` (a CompiledModule of this rank; every rank compiles the same graph with the same seed) run on
    ``mesh``; returns it, now a :class:`ParallelModule` (in place: its class changes and, with ``ep`` > 1, its
    expert weights are cut to this rank's slots). A collective call: every rank of the mesh makes it.

    Args:
        mesh: a DeviceMesh whose dimension names are from dp, ep, cp.
        num_slots: expert slots per MoE layer over the ep group (an int for every layer or {layer prefix: int};
            default the fewest multiple of ep >= E, as passes.place_experts.plan picks); slots beyond E hold
            replicas of experts.
        placements: {layer prefix (e.g. "model.layers.1.block_sparse_moe"): Placement} planned for ep GPUs
            (passes.place_experts.plan from routing statistics); default a uniform plan.
        fsdp: shard the dense weights (every parameter but the routed experts of ep > 1) over the whole mesh
            with FSDP2: ``torch.distributed.fsdp.fully_shard`` of each unit of layer blocks (``m.fsdp_units``: the
            blocks one launch reads together; a list of modules in one fully_shard when several), then of the
            module for the weights outside the blocks (embedding, final norm, head). A unit's weights are
            all-gathered before its first launch and freed after its last (one unit's at a time), gathered again
            in the backward and their gradients reduce-scattered; the parameters (and gradients) are DTensors
            sharded on dim 0 over the mesh (Shard(0)). The forward must go through ``m(...)`` (module hooks).
    Raises:
        MtcError: see mesh_layout; a module already parallel, or on device 'meta'; num_slots not a multiple of ep
            or fewer than the experts; a placement for another GPU or expert count; a fused launch in the training
            program that contains a sequence-mixing op (cp > 1) or moe_experts (ep > 1): it cannot take its
            parallel form (in the inference program such a launch makes it run the training program's launches).
    """
    from passes.place_experts import plan
    if isinstance(m, ParallelModule):
        raise MtcError(f"{m.graph.name}: this module is already parallel (on a mesh of {m.layout.sizes}); compile "
                       f"it again for another mesh")
    if not isinstance(m, CompiledModule):
        raise MtcError(f"parallelize takes a CompiledModule (dsl.compile), got {type(m).__name__}")
    p0 = next(m.parameters(), None)
    if p0 is not None and p0.is_meta:
        raise MtcError(f"{m.graph.name}: a module on device 'meta' has no weights to place on a mesh")
    lay = mesh_layout(mesh, None if p0 is None else p0.device.type)
    ep = lay.sizes["ep"]
    nodes = m.graph.node_map()
    # launches that take their parallel forms: a fused kernel holding one of them cannot
    special = (CP_OPS if lay.sizes["cp"] > 1 else ()) + (("moe_experts",) if ep > 1 else ())
    fused = {k: [L for L in p.launches if L.op not in special and any(nodes[o].op in special for o in L.ops)]
             for k, p in (("program", m.program), ("train_program", m.train_program))}
    if fused["train_program"]:
        L = fused["train_program"][0]
        raise MtcError(f"{m.graph.name}: launch {L.kernel} fuses "
                       f"{', '.join(nodes[o].op for o in L.ops if nodes[o].op in special)}, which has no "
                       f"{'context' if lay.sizes['cp'] > 1 else 'expert'}-parallel form inside a fused kernel")
    ep_layers = {}
    for L in m.train_program.launches:
        if L.op != "moe_experts" or ep == 1:
            continue
        keys = tuple(m._names[r[1:]] for r, _t in L.inputs[3:6])
        layer = keys[0].rsplit(".experts.", 1)[0] if ".experts." in keys[0] else keys[0].rsplit(".", 1)[0]
        E = int(L.inputs[3][1].shape[0])
        S = num_slots.get(layer) if isinstance(num_slots, dict) else num_slots
        S = -(-E // ep) * ep if S is None else S
        if isinstance(S, bool) or not isinstance(S, int) or S < E or S % ep:
            raise MtcError(f"{m.graph.name}: expert parallel: num_slots = {S!r} for {layer} must be an integer >= its "
                           f"{E} experts and a multiple of ep = {ep} (the slots split evenly over the ep ranks)")
        pl = (placements or {}).get(layer)
        if pl is None:
            pl = plan(None, num_gpus=ep, num_slots=S, num_experts=E)
        elif pl.num_gpus != ep or pl.num_experts != E:
            raise MtcError(f"{m.graph.name}: expert parallel: the placement of {layer} is for {pl.num_gpus} GPUs and "
                           f"{pl.num_experts} experts; this mesh has ep = {ep} and the layer {E} experts")
        from backends.parallel.expert import local_slots
        slots = local_slots(pl, lay.coords["ep"])
        ep_layers[L.anchor] = _EPLayer(layer, keys, E, pl, slots,
                                       [int(e) for e in torch.nonzero(pl.replica_count > 1).flatten()])
    if fused["program"]:              # the inference program's fused kernels: run the unfused program instead
        m.program = m.train_program
    m.__class__ = ParallelModule
    m.layout = lay
    m._ep_layers = ep_layers
    m._cp_lengths = None
    m.last_exchange = {}
    m.dp_group = lay.balance_group
    m._bound = {}
    with torch.no_grad():
        for lay_ep in ep_layers.values():
            for key in lay_ep.keys:
                *path, leaf = key.split(".")
                owner = m
                for p in path:
                    owner = owner._modules[p]
                full = owner._parameters[leaf]
                owner.register_parameter(leaf, nn.Parameter(full.detach()[lay_ep.slots.to(full.device)].clone(),
                                                            requires_grad=full.requires_grad))
    m._slots = {}
    # cp: MLA's K / V from the gathered latent (each program's up-projection cone; _kv_cones)
    m._cp_cone, m._cp_frontier, m._cp_mla_full, m.cp_gathered_width = set(), set(), set(), {}
    m._cp_full = {}
    if lay.sizes["cp"] > 1:
        for prog in {id(p): p for p in (m.program, m.train_program)}.values():
            by_anchor = {L.anchor: L for L in prog.launches}
            for anchor, (outs, frontier, width) in _kv_cones(prog, m.graph).items():
                m._cp_cone |= {id(L) for L in prog.launches if any(o in outs for o, _t in L.outputs)}
                m._cp_frontier |= frontier
                m._cp_mla_full.add(id(by_anchor[anchor]))
                m.cp_gathered_width[anchor] = width
    m._fsdp = False
    m._units, m.fsdp_units = {}, []
    if fsdp and lay.dense_mesh is not None:
        from torch.distributed.fsdp import fully_shard
        experts = {m._tensor(k) for e in ep_layers.values() for k in e.keys}
        m.fsdp_units, m._units = _fsdp_units(m)
        for paths in m.fsdp_units:
            blocks = [m.get_submodule(b) for b in paths]
            for b in blocks:
                b.__class__ = _Block
            fully_shard(blocks if len(blocks) > 1 else blocks[0], mesh=lay.dense_mesh, ignored_params=experts or None)
        fully_shard(m, mesh=lay.dense_mesh, ignored_params=experts or None)
        m._fsdp = True
    if ep_layers:
        m.register_state_dict_post_hook(_experts_to_dtensors)
    m.register_load_state_dict_pre_hook(_to_own_layout)
    return m


def _expert_placements(lay) -> tuple:
    """The DTensor placements of an expert weight over the whole mesh: Shard(0) on ep, Replicate elsewhere."""
    from torch.distributed.tensor import Replicate, Shard
    return tuple(Shard(0) if d == "ep" else Replicate() for d in lay.mesh.mesh_dim_names)


def _experts_to_dtensors(m, state_dict, prefix, _meta) -> None:
    """state_dict post-hook: each expert weight as a DTensor of the whole [E, ...] weight over the mesh
    (Shard(0) on ep in torch.chunk's split, Replicate on dp / cp), its rows exchanged from the ranks holding each
    expert's first replica (backends.parallel.expert.slots_to_shard: a collective over ep)."""
    from torch.distributed.tensor import DTensor
    from backends.parallel.expert import slots_to_shard
    lay = m.layout
    for e in m._ep_layers.values():
        for key in e.keys:
            local = state_dict.get(prefix + key)
            if local is None or isinstance(local, DTensor):
                continue
            rows = slots_to_shard(local.detach(), e.placement, lay.ep_group)
            shape = torch.Size((e.num_experts, *local.shape[1:]))
            stride = [1] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                stride[i] = stride[i + 1] * shape[i + 1]
            state_dict[prefix + key] = DTensor.from_local(rows, lay.mesh, _expert_placements(lay), run_check=False,
                                                          shape=shape, stride=tuple(stride))


def _to_own_layout(m, state_dict, prefix, _meta, _strict, _missing, _unexpected, _errors) -> None:
    """load_state_dict pre-hook: values in another layout become this rank's: an expert weight given whole
    ([E, ...]) or as a DTensor becomes this rank's slots' rows (the DTensor's shards exchanged over ep, or
    gathered when its layout is not this mesh's); a dense weight that this module holds as an FSDP2 DTensor, given
    whole, becomes this rank's shard; one it holds whole, given as a DTensor, is gathered. A collective call when
    any value is a DTensor in another layout or experts are exchanged. An expert weight of this rank's slot count
    of rows (not E) is taken as this rank's slots. An expert weight with neither E rows nor this rank's slot count:
    MtcError."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from backends.parallel.expert import shard_to_slots
    lay = m.layout
    experts = {}
    for e in m._ep_layers.values():
        for key in e.keys:
            experts[prefix + key] = e
    own = dict(m.named_parameters(prefix=prefix.rstrip(".")))
    for k in list(state_dict):
        v = state_dict[k]
        e = experts.get(k)
        if e is not None:
            if isinstance(v, DTensor):
                if (v.device_mesh == lay.mesh and tuple(v.placements) == _expert_placements(lay)
                        and v.shape[0] == e.num_experts):
                    state_dict[k] = shard_to_slots(v.to_local(), e.placement, lay.ep_group)
                    continue
                v = v.full_tensor()
            if v.shape[0] == e.num_experts:
                state_dict[k] = v[e.slots.to(v.device)]
            elif v.shape[0] != e.placement.slots_per_gpu:
                raise MtcError(f"{m.graph.name}: load_state_dict: {k} has {v.shape[0]} rows, neither the "
                               f"{e.num_experts} experts of the full model nor this rank's "
                               f"{e.placement.slots_per_gpu} slots")
            continue
        p = own.get(k)
        if p is None or v.shape != p.shape:          # (load_state_dict reports the unexpected key or the size)
            continue
        if isinstance(p, DTensor):
            if not isinstance(v, DTensor):
                state_dict[k] = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            elif v.device_mesh != p.device_mesh or tuple(v.placements) != tuple(p.placements):
                state_dict[k] = distribute_tensor(v.full_tensor(), p.device_mesh, p.placements, src_data_rank=None)
        elif isinstance(v, DTensor):
            state_dict[k] = v.full_tensor()


class _Block(nn.Module):
    """A layer block (a weight container of the compiled module) that FSDP2 shards as a unit: the parallel module
    runs the block's launches inside a call of it, so that FSDP2's module hooks gather its weights before them,
    free them after, and gather them again for (and reduce-scatter their gradients after) their backward."""

    def forward(self, run, *xs):
        return run(*xs)


def _block_of(key: str) -> str | None:
    """The layer block holding weight ``key``: its path up to the first numeric component (``model.layers.3`` of
    ``model.layers.3.mlp.up_proj.weight``, the torchtitan unit); None for a weight outside the repeated blocks."""
    parts = key.split(".")
    for j, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[:j + 1])
    return None


def _fsdp_units(m) -> tuple[list, dict]:
    """(the FSDP2 units: lists of layer-block paths, in forward order; {id(program): [(start, stop, unit index or
    None, ins, outs)]}). A unit is the blocks whose weights one launch reads together (Block AttnRes' phase 1 reads
    the pseudo-queries of a whole group of layers), merged further while the launch runs of two units interleave
    in a program; its run spans its first to its last launch that reads its weights, with ``ins`` the buffers the
    run reads from before it and ``outs`` those it makes that later launches (or the graph's outputs) read."""
    progs = list({id(p): p for p in (m.program, m.train_program)}.values())
    parent: dict = {}

    def find(b):
        while parent[b] != b:
            b = parent[b]
        return b

    def blocks_of(L):
        return {b for r, _t in L.inputs if r[1:] in m._names and (b := _block_of(m._names[r[1:]])) is not None}
    for p in progs:
        for L in p.launches:
            bs = sorted(blocks_of(L))
            for b in bs:
                parent.setdefault(b, b)
            for b in bs[1:]:
                parent[find(b)] = find(bs[0])
    while True:                         # merge units whose runs interleave
        spans = {}
        for p in progs:
            for i, L in enumerate(p.launches):
                for b in blocks_of(L):
                    lo, hi = spans.get((id(p), find(b)), (i, i))
                    spans[(id(p), find(b))] = (min(lo, i), max(hi, i))
        merged = False
        for p in progs:
            mine = sorted((lo, hi, u) for (k, u), (lo, hi) in spans.items() if k == id(p))
            for (lo0, hi0, u0), (lo1, _hi1, u1) in zip(mine, mine[1:]):
                if lo1 <= hi0:
                    parent[find(u1)] = find(u0)
                    merged = True
        if not merged:
            break
    first = progs[-1] if len(progs) > 1 else progs[0]      # forward order: the training program's
    order = sorted({find(b) for b in parent}, key=lambda u: spans[(id(first), u)][0] if (id(first), u) in spans
                   else len(first.launches))
    units = [sorted((b for b in parent if find(b) == u), key=lambda b: [int(x) if x.isdigit() else x
                                                                         for x in b.split(".")]) for u in order]
    index = {u: i for i, u in enumerate(order)}
    runs = {}
    for p in progs:
        graph_out = {str(r) for r in m.graph.outputs}
        made_at = {r: i for i, L in enumerate(p.launches) for r, _t in L.outputs}
        last_read = {}
        for i, L in enumerate(p.launches):
            for r, _t in L.inputs:
                last_read[r] = i
        mine = sorted((lo, hi + 1, index[u]) for (k, u), (lo, hi) in spans.items() if k == id(p))
        out, at = [], 0
        for lo, hi, u in mine:
            if at < lo:
                out.append((at, lo, None, (), ()))
            ins = list(dict.fromkeys(r for L in p.launches[lo:hi] for r, _t in L.inputs
                                     if r[1:] not in m._names and made_at.get(r, -1) < lo))
            outs = [r for L in p.launches[lo:hi] for r, _t in L.outputs
                    if last_read.get(r, -1) >= hi or r in graph_out]
            out.append((lo, hi, u, tuple(ins), tuple(outs)))
            at = hi
        if at < len(p.launches):
            out.append((at, len(p.launches), None, (), ()))
        runs[id(p)] = out
    return units, runs


_COMM_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "broken pipe")


class _collective_errors:
    """Turn a failed collective (a rank that died, one that did not arrive within the process group's timeout) into
    an MtcError that names this rank and the mesh, instead of the transport's message alone."""

    def __init__(self, module, what: str):
        self.module, self.what = module, what

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None or isinstance(exc, MtcError) or not isinstance(exc, RuntimeError):
            return False
        text = str(exc)
        if not (isinstance(exc, dist.DistError) or any(w in text.lower() for w in _COMM_WORDS)):
            return False
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        raise MtcError(f"{self.module.graph.name}: rank {dist.get_rank()} of the mesh {self.module.layout.sizes}: a "
                       f"collective in {self.what} failed: another rank died or did not reach it within the process "
                       f"group's timeout (init_process_group(timeout=...)). {type(exc).__name__}: {first}") from exc


class _Guard(torch.autograd.Function):
    """``fn(*xs)`` whose backward runs inside :class:`_collective_errors`: the forward builds ``fn``'s graph on
    detached copies of the inputs, the backward differentiates that graph (torch.autograd.grad), so that a
    collective of ``fn``'s backward that fails (a rank gone, the process group's timeout) is an MtcError naming this
    rank, as in the forward. The gradients are those of ``fn``'s own backward."""

    @staticmethod
    def forward(ctx, module, fn, *xs):
        inner = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in xs]
        with torch.enable_grad():
            out = fn(*inner)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.module, ctx.single = module, not isinstance(out, tuple)
        ctx.inner = [x for x in inner if isinstance(x, torch.Tensor) and x.requires_grad]
        ctx.where = [i for i, x in enumerate(inner) if isinstance(x, torch.Tensor) and x.requires_grad]
        ctx.outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        ctx.out_at = [j for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor) and not o.requires_grad])
        res = tuple(o.detach() if isinstance(o, torch.Tensor) and o.requires_grad else o for o in outs)
        return res[0] if ctx.single else res

    @staticmethod
    def backward(ctx, *grads):
        gs = [grads[j] for j in ctx.out_at]
        pairs = [(o, g) for o, g in zip(ctx.outs, gs) if g is not None]
        got = [None] * len(ctx.inner)
        if pairs and ctx.inner:
            with _collective_errors(ctx.module, "the backward"):
                got = torch.autograd.grad([o for o, _g in pairs], ctx.inner, [g for _o, g in pairs],
                                          allow_unused=True)
        out = [None] * (2 + max(ctx.where, default=-1) + 1)
        for i, g in zip(ctx.where, got):
            out[2 + i] = g
        return tuple(out)


def _guarded(module, fn, *xs):
    """``fn(*xs)``, through :class:`_Guard` when a tensor input requires a gradient and grad mode is on."""
    if not torch.is_grad_enabled() or not any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs):
        return fn(*xs)
    return _Guard.apply(module, fn, *xs)


def _ops_module(fn):
    """The backend module (backends.reference / backends.triton) of a launch's implementation."""
    target = getattr(fn, "target", "reference")
    return importlib.import_module(f"backends.{target}" if target in ("reference", "triton") else "backends.reference")


class ParallelModule(CompiledModule):
    """A CompiledModule on a DeviceMesh (see the module docstring); made by :func:`parallelize`.

    Attributes (besides CompiledModule's):
        layout: the :class:`Layout` (sizes, coordinates, groups).
        last_exchange: {MoE layer prefix: backends.parallel.expert.ExchangeStats} of the last forward.
        fsdp_units: with fsdp=True, the layer-block paths of each FSDP2 unit, in forward order (else []).
    """

    def __getstate__(self):
        raise MtcError(f"{self.graph.name}: a parallel module cannot be pickled (its process groups do not travel); "
                       f"save full_state_dict(), or state_dict() (DTensors) with torch.distributed.checkpoint")

    def _check_balance_settings(self) -> None:
        super()._check_balance_settings()
        if self.balance == "fixed" and self.layout.dense_group is not None:
            raise MtcError(f"{self.graph.name}: balance = 'fixed' is not offered on a mesh (each rank would step its "
                           f"router biases from its own loads, and the ranks' biases would drift apart); use "
                           f"balance = 'qb' (its step is global over the mesh) or None")

    # -- execution -------------------------------------------------------------------------------
    def run(self, progress=None, **inputs):
        """As CompiledModule.run, on this rank's tokens (see the module docstring); with cp > 1 the ranks first
        exchange their sequence lengths."""
        with _collective_errors(self, "the forward"):
            if self.layout.cp_group is not None:
                from backends.parallel.context import gather_lengths
                self._cp_lengths = gather_lengths(self._local_len(inputs), self.layout.cp_group,
                                                  next(iter(inputs.values())).device)
            try:
                return super().run(progress=progress, **inputs)
            finally:
                self._cp_lengths = None
                self._cp_full = {}

    def _launch_units(self, program):
        """With FSDP2 per block: the runs of each unit's launches, entered through its blocks' calls (nested, so
        that the unit's hooks see the run's inputs and outputs; see _fsdp_units)."""
        runs = self._units.get(id(program)) if self._seq is None else None
        if not runs:
            return None
        out = []
        for start, stop, u, ins, outs in runs:
            enter = None
            if u is not None:
                blocks = [self.get_submodule(b) for b in self.fsdp_units[u]]

                def enter(segment, *xs, blocks=blocks):
                    f = segment
                    for b in reversed(blocks):
                        f = functools.partial(b, f)
                    return f(*xs)
            out.append((start, stop, enter, ins, outs))
        return out

    def _local_len(self, inputs) -> int:
        sym = None
        for L in self.train_program.launches:
            if L.op in CP_OPS:
                sym = L.inputs[0][1].shape[1]
                break
        for n in self.graph.inputs():
            if sym is not None and sym in n.type.shape and n.attr("name") in inputs:
                return int(inputs[n.attr("name")].shape[list(n.type.shape).index(sym)])
        raise MtcError(f"{self.graph.name}: context parallel: no input carries the sequence dimension {sym}")

    def _launch(self, L, fn, call, args, into=None):
        if self._cp_lengths is not None and id(L) in self._cp_cone:
            return self._cone_launch(L, fn, call, args)
        if self._cp_lengths is not None and L.op in CP_OPS:
            return self._cp_launch(L, fn, call, args)
        if L.op == "moe_experts" and L.anchor in self._ep_layers:
            return self._ep_launch(L, fn, call, args)
        return super()._launch(L, fn, call, args, into)

    def _cone_launch(self, L, fn, call, args):
        """A launch of an MLA up-projection cone on the whole sequence: its latent operands all-gathered over cp
        (once per forward), the sequence dimension bound to the total length while it runs."""
        from backends.parallel.context import _gather_time
        args = list(args)
        for i, (r, _t) in enumerate(L.inputs):
            if r in self._cp_frontier:
                full = self._cp_full.get(r)
                if full is None:
                    full = self._cp_full[r] = _guarded(
                        self, functools.partial(_gather_time, lengths=self._cp_lengths, group=self.layout.cp_group),
                        args[i])
                args[i] = full
        sym = L.outputs[0][1].shape[1]
        saved = self._bind, self._bind_key
        self._bind = {**self._bind, sym: sum(self._cp_lengths)}
        self._bind_key = tuple(self._bind.items())
        try:
            return super()._launch(L, fn, call, args, None)
        finally:
            self._bind, self._bind_key = saved

    def _cp_launch(self, L, fn, call, args):
        from backends.parallel import context as C
        ops = _ops_module(fn)
        group, lengths = self.layout.cp_group, self._cp_lengths
        if L.op == "kda_chunk":
            return _guarded(self, lambda *a: C.kda_chunk_cp(*a, group=group, scale=call.attr("scale"),
                                                            lengths=lengths, kda=ops.kda_chunk)[0], *args)
        if L.op == "short_conv":
            from backends import reference as R
            conv = getattr(ops, "short_conv", R.short_conv)
            return _guarded(self, lambda *a: C.short_conv_cp(*a, group=group, lengths=lengths, conv=conv)[0], *args)
        if not call.attr("causal", True):
            raise MtcError(f"%{call.node.name} = mla_attention(causal=False): context parallel runs causal "
                           f"attention only", call.node.loc)
        kv_full = id(L) in self._cp_mla_full
        return _guarded(self, lambda *a: C.mla_attention_cp(*a, scale=call.attr("scale"), group=group,
                                                            lengths=lengths, kv_full=kv_full), *args)

    def _ep_launch(self, L, fn, call, args):
        from backends.parallel.expert import moe_experts_ep
        lay_ep = self._ep_layers[L.anchor]
        stats = []

        def run(*a):
            u, st = moe_experts_ep(*a, placement=lay_ep.placement, group=self.layout.ep_group,
                                   experts_fn=lambda *e: fn.fn(call, *e))
            stats.append(st)
            return u
        u = _guarded(self, run, *args)
        self.last_exchange[lay_ep.layer] = stats[0]
        return u

    def _qb_step(self, layer: str, bias: torch.Tensor, scores: torch.Tensor, top_k: int) -> None:
        """One QB step (spec/OPS.md qb_update) over the tokens of every cp rank, b_hat averaged over dp x ep.

        Exact without gathering the scores: a token's cut-off alpha_i is its own, so each rank forms its margins;
        the global (q + 1)-th largest margin of an expert (q = floor(N k / E), N over the cp ranks) is among the
        union of the ranks' local q + 1 largest, so the ranks all-gather only those ([q + 1, E] each, E / k times
        less than the scores)."""
        group = self.layout.cp_group
        if group is None:
            return super()._qb_step(layer, bias, scores, top_k)
        from backends.reference.moe import qb_finish
        world = dist.get_world_size(group)
        s = scores.detach().float()
        b = bias.detach().float()
        n, e = s.shape
        counts = torch.tensor([n], dtype=torch.int64, device=s.device)
        got = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(got, counts, group=group)
        n_all = sum(int(c) for c in got)
        if top_k == e:
            b_hat = torch.zeros_like(b)            # every expert takes every token (qb_update's rule)
        else:
            alpha = torch.topk(s + b, top_k + 1, dim=1).values[:, top_k]
            margin = s - alpha[:, None]
            q = (n_all * top_k) // e
            top = torch.full((q + 1, e), float("-inf"), dtype=torch.float32, device=s.device)
            r = min(q + 1, n)
            top[:r] = torch.topk(margin, r, dim=0).values
            every = torch.empty((world * (q + 1), e), dtype=torch.float32, device=s.device)
            from backends.parallel.context import _all_gather_single
            _all_gather_single(every, top, group=group)
            b_hat = -torch.topk(every, q + 1, dim=0).values[q]
        step = self._updates.get(layer, 0)
        ema = 0.0 if step < self.balance_warmup else self.balance_ema
        bias.copy_(qb_finish(b_hat, b, ema, self.dp_group))
        self._updates[layer] = step + 1
        self.balance_updates[self._router_order.index(layer)] += 1

    # -- gradients and state ----------------------------------------------------------------------
    def _expert_keys(self) -> set:
        return {k for e in self._ep_layers.values() for k in e.keys}

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Sum the gradients over the ranks that share each weight (see the module docstring): dense weights over
        the whole mesh (one all-reduce of their flattened gradients), expert slots over dp x cp, and the slots of a
        replicated expert over the ep ranks that hold it. A parameter without a gradient takes zeros. A
        collective call: every rank makes it, after its backward."""
        with _collective_errors(self, "sync_gradients"):
            self._sync_gradients()

    def _sync_gradients(self) -> None:
        lay = self.layout
        experts = self._expert_keys()
        params = dict(self.named_parameters())
        for p in params.values():
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        from torch.distributed.tensor import DTensor
        dense = [p.grad for k, p in params.items() if k not in experts and p.grad is not None]
        if getattr(self, "_fsdp", False):
            # FSDP2 reduce-scattered its shards' gradients in the backward as a mean over the mesh (gloo offers no
            # pre-scaled sum): back to the sum
            n = dist.get_world_size(lay.dense_group)
            for g in dense:
                if isinstance(g, DTensor):
                    g.mul_(n)
            dense = [g for g in dense if not isinstance(g, DTensor)]
        if lay.dense_group is not None and dense:
            flat = torch.cat([g.reshape(-1) for g in dense])
            dist.all_reduce(flat, group=lay.dense_group)
            for g, part in zip(dense, torch.split(flat, [g.numel() for g in dense])):
                g.copy_(part.view_as(g))
        for e in self._ep_layers.values():
            for key in e.keys:
                g = params[key].grad
                if lay.expert_group is not None:
                    dist.all_reduce(g, group=lay.expert_group)
                if e.replicated and lay.ep_group is not None:
                    buf = g.new_zeros((e.num_experts, *g.shape[1:]))
                    mask = torch.isin(e.slots, torch.tensor(e.replicated))
                    buf.index_add_(0, e.slots[mask].to(g.device), g[mask.to(g.device)])
                    dist.all_reduce(buf, group=lay.ep_group)
                    g[mask.to(g.device)] = buf[e.slots[mask].to(g.device)]

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a whole-model state dict (a single-process module's, :meth:`full_state_dict` of any mesh, or the
        DTensor ``state_dict()`` of this mesh): ``load_state_dict``, whose pre-hook cuts each value to this rank's
        layout (its expert slots' rows, its FSDP2 shards). Returns load_state_dict's result. MtcError for an expert
        weight whose rows are neither the full model's experts nor this rank's slots. A collective call."""
        return self.load_state_dict(state_dict, strict=strict)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The state dict of the whole model, as a single-process module of the same graph has it: the DTensors
        of :meth:`state_dict` gathered (``full_tensor``; the experts from each one's first replica). What
        ``torch.distributed.checkpoint.state_dict.get_model_state_dict(m, options=StateDictOptions(
        full_state_dict=True))`` gives. A collective call."""
        from torch.distributed.tensor import DTensor
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in self.state_dict().items()}
