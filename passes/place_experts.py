"""Expert-parallel placement: which GPU holds which routed expert, with replicas of the hottest ones.

The contract is that of DeepSeek's EPLB (Expert-Parallelism Load Balancer, github.com/deepseek-ai/EPLB,
released with DeepSeek-V3, arXiv 2412.19437 section 3.4): from a per-expert load estimate (tokens routed
to each expert, e.g. the statistics of ``mtc run``), choose

1. how many replicas each logical expert gets when there are more physical expert slots than experts
   (greedy: each extra slot goes to the expert with the largest load per replica), and
2. which GPU holds each replica (balanced packing with the same number of slots on every GPU: items in
   decreasing load, each onto the least-loaded GPU that still has room and does not already hold a
   replica of the same expert), followed by a pairwise-exchange refinement that moves load off the most
   loaded GPU while it can (not in EPLB; it only ever lowers the maximum).
3. (not in EPLB) while the most loaded GPU is more than 0.1% above the mean, a bounded search moves one
   replica from one expert to another and packs again, keeping a move only if it lowers the maximum
   (at most 32 packings per node): greedy replication cannot see packings such as 16 equal experts in 18
   slots on 3 GPUs, balanced only by 3 replicas of one expert (max/mean 1.031 -> 1.000; Zipf(1.1) loads of
   896 experts in 1024 slots on 128 GPUs: 1.025 -> 1.013, 0.3 s).

With ``num_nodes > 1`` the placement is hierarchical as in EPLB: expert groups are first packed onto
nodes (equal group count per node, balanced node load), then replication and packing happen inside each
node, so no expert's tokens have to cross nodes for a replica.

    from passes.place_experts import plan, load_from_routing_stats
    p = plan(load, num_gpus=128, num_slots=1024)      # load: [896] tokens per expert
    p.physical_to_logical                              # int64 [1024]; slot s is on GPU s // 8
    print(p)                                           # the summary table
    plans = plan(load_from_routing_stats(m.routing_stats), num_gpus=8)   # one Placement per MoE layer

A replica's load is its expert's load divided by the replica count: the runtime is expected to split an
expert's tokens evenly over its replicas (e.g. token index modulo the replica count).
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

__all__ = ["Placement", "plan", "load_from_routing_stats", "routing_layers"]


@dataclass
class Placement:
    """Where every physical expert slot lives and which logical expert it runs.

    Attributes:
        physical_to_logical: int64 [num_slots]; slot ``s`` lives on GPU ``s // slots_per_gpu`` and runs
            logical expert ``physical_to_logical[s]``. Inside one GPU the slots are sorted by expert id.
        logical_to_physical: int64 [E, max_replicas]; the slots of each expert in increasing order,
            padded with -1.
        replica_count: int64 [E]; number of slots of each expert (>= 1, sums to num_slots).
        gpu_load: float64 [num_gpus]; sum over a GPU's slots of load / replica_count, in the units of
            the load given to :func:`plan` (tokens when fed routing statistics; 1 per expert if uniform).
        expert_load: float64 [E]; the load the placement was planned for.
        num_gpus, num_nodes: the machine shape.
        num_groups: expert groups used for the node level (E when each expert is its own group).
        uniform: True when no load statistics were given, or they were all zero (planned as if uniform).
    """

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    replica_count: torch.Tensor
    gpu_load: torch.Tensor
    expert_load: torch.Tensor
    num_gpus: int
    num_nodes: int = 1
    num_groups: int = 0
    uniform: bool = False
    layer: str | None = field(default=None)

    # -- derived quantities ---------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return int(self.physical_to_logical.numel())

    @property
    def num_experts(self) -> int:
        return int(self.replica_count.numel())

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    def gpu_of_slot(self) -> torch.Tensor:
        """int64 [num_slots]: the GPU of every slot (``s // slots_per_gpu``)."""
        return torch.arange(self.num_slots, dtype=torch.int64) // self.slots_per_gpu

    def experts_on_gpu(self, gpu: int) -> list[int]:
        """The logical experts held by one GPU (with repeats only when a duplicate was unavoidable)."""
        if not 0 <= gpu < self.num_gpus:
            raise ValueError(f"gpu {gpu} out of range [0, {self.num_gpus})")
        s = self.slots_per_gpu
        return self.physical_to_logical[gpu * s:(gpu + 1) * s].tolist()

    def node_load(self) -> torch.Tensor:
        """float64 [num_nodes]: the summed GPU load of every node."""
        return self.gpu_load.reshape(self.num_nodes, -1).sum(1)

    @property
    def imbalance(self) -> float:
        """max GPU load / mean GPU load (1.0 is perfect; 1.0 when the load is all zero)."""
        mean = float(self.gpu_load.mean())
        return float(self.gpu_load.max()) / mean if mean > 0 else 1.0

    def summary(self, top: int = 5) -> str:
        """A short table: machine shape, GPU load (min / mean / max, max/mean) and the `top` experts with the most
        load (largest share first; the header says when that is fewer than all of them)."""
        gl = self.gpu_load
        head = (f"expert placement{' for ' + self.layer if self.layer else ''}: {self.num_experts} experts "
                f"-> {self.num_slots} slots on {self.num_gpus} GPUs ({self.slots_per_gpu} per GPU)"
                + (f", {self.num_nodes} nodes" if self.num_nodes > 1 else "")
                + (", uniform load (no statistics, or all of them zero)" if self.uniform else ""))
        lines = [head,
                 f"  GPU load   min {float(gl.min()):.4g}   mean {float(gl.mean()):.4g}   max {float(gl.max()):.4g}"
                 f"   max/mean {self.imbalance:.4f}"]
        if self.num_nodes > 1:
            nl = self.node_load()
            lines.append(f"  node load  min {float(nl.min()):.4g}   max {float(nl.max()):.4g}   "
                         f"max/mean {float(nl.max() / nl.mean()) if float(nl.mean()) > 0 else 1.0:.4f}")
        extra = self.num_slots - self.num_experts
        total = float(self.expert_load.sum())
        order = torch.argsort(self.expert_load, descending=True, stable=True)[:top]
        lines.append(f"  replicas   {extra} extra slot(s); {int((self.replica_count > 1).sum())} expert(s) replicated, "
                     f"max {int(self.replica_count.max())} replicas")
        note = ""
        if top < self.num_experts:
            which = "the first" if self.uniform else "the most loaded"
            note = f"   ({which} {top} of {self.num_experts}; all of them: summary(top={self.num_experts}))"
        lines.append(f"  {'expert':>6}  {'load share':>10}  {'replicas':>8}  GPUs{note}")
        g = self.gpu_of_slot()
        for e in order.tolist():
            slots = self.logical_to_physical[e]
            gpus = sorted({int(g[s]) for s in slots.tolist() if s >= 0})
            gtxt = ",".join(str(x) for x in gpus[:8]) + (",..." if len(gpus) > 8 else "")
            share = float(self.expert_load[e]) / total if total > 0 else 1.0 / self.num_experts
            lines.append(f"  {e:>6}  {share:>10.2%}  {int(self.replica_count[e]):>8}  {gtxt}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# ---------------------------------------------------------------------------------------------
# argument checking
def _as_load(load, num_experts: int | None) -> tuple[np.ndarray, bool]:
    """-> (float64 [E] or [L, E] array, uniform?)."""
    if load is None or (hasattr(load, "__len__") and not isinstance(load, torch.Tensor) and len(load) == 0) \
            or (isinstance(load, torch.Tensor) and load.numel() == 0):
        if num_experts is None:
            raise ValueError("plan: no load statistics given (load is None or empty): pass num_experts= so the "
                             "uniform placement knows how many experts there are")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"plan: num_experts must be a positive int, got {num_experts!r}")
        return np.ones(num_experts, dtype=np.float64), True
    if isinstance(load, torch.Tensor):
        if load.is_complex():
            raise TypeError("plan: load must be real, got a complex tensor")
        arr = load.detach().to("cpu", torch.float64).numpy()
    else:
        try:
            arr = np.asarray(load, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"plan: load must be a 1-D or 2-D tensor/sequence of numbers ({e})") from None
    if arr.ndim not in (1, 2):
        raise ValueError(f"plan: load must be 1-D [experts] or 2-D [layers, experts], got shape {tuple(arr.shape)}")
    if arr.shape[-1] == 0 or (arr.ndim == 2 and arr.shape[0] == 0):
        raise ValueError(f"plan: load has an empty dimension: shape {tuple(arr.shape)}")
    if not np.isfinite(arr).all():
        bad = np.argwhere(~np.isfinite(arr))[0].tolist()
        raise ValueError(f"plan: load must be finite; found {arr[tuple(bad)]} at index {bad}")
    if (arr < 0).any():
        bad = np.argwhere(arr < 0)[0].tolist()
        raise ValueError(f"plan: load must be non-negative; found {arr[tuple(bad)]} at index {bad}")
    with np.errstate(over="ignore"):
        total = arr.sum(axis=-1)
    if not np.isfinite(total).all():
        raise ValueError(f"plan: the loads of a layer sum past float64's range (~1.8e308; largest load "
                         f"{arr.max():.3g}): scale them down, the placement depends only on their ratios")
    if num_experts is not None and num_experts != arr.shape[-1]:
        raise ValueError(f"plan: num_experts = {num_experts} but the load has {arr.shape[-1]} experts")
    return arr, False


def _pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"plan: {name} must be a positive int, got {v!r}")
    return int(v)


# ---------------------------------------------------------------------------------------------
# the two steps of EPLB
def _replicate(w: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """Replica counts [n] summing to num_slots: each extra slot goes to the expert with the largest
    load per replica (ties: lowest id). An expert gets more than ``cap`` replicas (the GPUs available
    to it) only when every expert is at the cap, since extra replicas on one GPU do not spread load."""
    n = w.shape[0]
    counts = np.ones(n, dtype=np.int64)
    extra = num_slots - n
    if extra == 0:
        return counts
    heap = [(-w[e], e) for e in range(n)]
    heapq.heapify(heap)
    capped: list[int] = []
    while extra > 0:
        if not heap:                      # every expert is at the cap: lift it
            heap = [(-w[e] / counts[e], e) for e in capped]
            heapq.heapify(heap)
            capped, cap = [], cap + n
        _, e = heapq.heappop(heap)
        if counts[e] >= cap:
            capped.append(e)
            continue
        counts[e] += 1
        extra -= 1
        heapq.heappush(heap, (-w[e] / counts[e], e))
    return counts


def _pack(w: np.ndarray, owner: np.ndarray, num_packs: int, per_pack: int, refine: bool = True) -> np.ndarray:
    """Balanced packing: assign len(w) == num_packs * per_pack items to packs, exactly per_pack each.

    Items in decreasing weight (ties: lower index first) go onto the least-loaded pack that has room and
    does not already hold an item of the same owner (the same logical expert); only when no such pack
    exists is a duplicate allowed. Then :func:`_refine`. Returns the pack of every item, int64 [n].
    """
    n = w.shape[0]
    assert n == num_packs * per_pack
    order = np.argsort(-w, kind="stable")
    load = np.zeros(num_packs)
    count = np.zeros(num_packs, dtype=np.int64)
    held: dict[int, list[int]] = {}
    pack = np.empty(n, dtype=np.int64)
    big = np.inf
    for i in order:
        cand = np.where(count < per_pack, load, big)
        hs = held.get(int(owner[i]))
        if hs:
            c2 = cand.copy()
            c2[hs] = big
            if np.isfinite(c2).any():
                cand = c2
        p = int(np.argmin(cand))
        pack[i] = p
        load[p] += w[i]
        count[p] += 1
        held.setdefault(int(owner[i]), []).append(p)
    if refine and num_packs > 1:
        if per_pack * (n - per_pack) > _REFINE_MAX_PAIRS:
            import warnings
            warnings.warn(f"place_experts: {per_pack} slots per GPU x {n - per_pack} elsewhere is past the "
                          f"pairwise-exchange refinement's limit ({_REFINE_MAX_PAIRS:.0e} pairs per step): greedy "
                          f"packing only", stacklevel=4)
        else:
            pack = _refine(w, owner, pack, num_packs)
    return pack


# the exchange step scores every (item on the hottest pack, item elsewhere) pair: keep that matrix ~32 MB
_REFINE_MAX_PAIRS = 4_000_000
# the largest expert-parallel group / slot count planned (greedy packing is O(slots x GPUs))
MAX_GPUS = 16384
MAX_SLOTS = 262144


def _refine(w: np.ndarray, owner: np.ndarray, pack: np.ndarray, num_packs: int, max_iter: int | None = None
            ) -> np.ndarray:
    """Pairwise exchange: while some swap of an item on the most-loaded pack with an item elsewhere
    lowers the larger of the two packs' loads, do the best such swap (never creating a new duplicate
    of an expert on a pack). Every step strictly decreases the sorted load vector, so it terminates."""
    pack = pack.copy()
    n = w.shape[0]
    owners, oid = np.unique(owner, return_inverse=True)
    present = np.zeros((owners.shape[0], num_packs), dtype=np.int64)
    np.add.at(present, (oid, pack), 1)
    load = np.bincount(pack, weights=w, minlength=num_packs).astype(np.float64)
    max_iter = max_iter if max_iter is not None else 20 * n
    for _ in range(max_iter):
        h = int(np.argmax(load))
        Lh = load[h]
        if Lh <= 0:
            break
        A = np.flatnonzero(pack == h)
        B = np.flatnonzero(pack != h)
        d = w[A][:, None] - w[B][None, :]                       # load moved from h to the other pack
        Lg = load[pack[B]][None, :]
        new_max = np.maximum(Lh - d, Lg + d)
        ok = (d > 0) & (new_max < Lh * (1 - 1e-12))
        ok &= present[oid[A]][:, pack[B]] == 0                  # a's expert not yet on b's pack
        ok &= (present[oid[B], h] == 0)[None, :]                # b's expert not yet on h
        if not ok.any():
            break
        score = np.where(ok, new_max, np.inf)
        ia, ib = np.unravel_index(int(np.argmin(score)), score.shape)
        a, b = int(A[ia]), int(B[ib])
        g = int(pack[b])
        load[h] -= d[ia, ib]
        load[g] += d[ia, ib]
        present[oid[a], h] -= 1
        present[oid[a], g] += 1
        present[oid[b], g] -= 1
        present[oid[b], h] += 1
        pack[a], pack[b] = g, h
    return pack


# moving one replica between experts and packing again: at most this many packings per node, and only while the
# hottest GPU is more than this fraction above the mean (the lower bound of any placement)
_MOVE_EVALS = 32
_MOVE_SLACK = 1e-3


def _place_replicas(wx: np.ndarray, c: np.ndarray, gpn: int, spg: int, refine: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Pack the replicas (counts c [n] of experts with loads wx [n]) onto gpn GPUs of spg slots; then, while the
    hottest GPU is above the mean by more than _MOVE_SLACK, try moving one replica from an expert with two or
    more to another expert (a few cheapest donors x the hottest per-replica loads and the other donors) and keep
    the best move that lowers the hottest GPU's load, up to _MOVE_EVALS packings. _replicate alone spreads the
    extra replicas greedily by load per replica, which misses placements that only a packing shows: 16 equal
    experts in 18 slots on 3 GPUs are balanced by 3 replicas of one expert (5 1/3 per GPU), not 2 + 2 (5.5).
    Returns (counts, GPU of every replica in np.repeat(arange(n), counts) order)."""
    n = wx.shape[0]

    def packed(cc):
        iw = np.repeat(wx / cc, cc)
        gp = _pack(iw, np.repeat(np.arange(n), cc), gpn, spg, refine)
        return gp, float(np.bincount(gp, weights=iw, minlength=gpn).max())

    gp, best = packed(c)
    mean = float(wx.sum()) / gpn
    evals = 0
    while gpn > 1 and best > mean * (1 + _MOVE_SLACK) and evals < _MOVE_EVALS:
        donors = [int(e) for e in np.argsort(wx / c, kind="stable") if c[e] >= 2][:4]
        if not donors:
            break
        takers = [int(e) for e in np.argsort(-wx / c, kind="stable") if c[e] < gpn][:4]
        found = None
        for a in donors:
            for b in dict.fromkeys(takers + donors):
                if b == a or c[b] >= gpn or evals >= _MOVE_EVALS:
                    continue
                cc = c.copy()
                cc[a] -= 1
                cc[b] += 1
                evals += 1
                g2, m2 = packed(cc)
                if m2 < best * (1 - 1e-12) and (found is None or m2 < found[2]):
                    found = (cc, g2, m2)
        if found is None:
            break
        c, gp, best = found
    return c, gp


# ---------------------------------------------------------------------------------------------
def _plan_one(w: np.ndarray, num_gpus: int, num_slots: int, num_nodes: int, num_groups: int, uniform: bool,
              refine: bool) -> Placement:
    E = w.shape[0]
    gpn = num_gpus // num_nodes                 # GPUs per node
    spn = num_slots // num_nodes                # slots per node
    spg = num_slots // num_gpus                 # slots per GPU
    # 1. expert groups -> nodes
    if num_nodes > 1:
        gsize = E // num_groups
        gload = w.reshape(num_groups, gsize).sum(1)
        gnode = _pack(gload, np.arange(num_groups), num_nodes, num_groups // num_nodes, refine)
        node_experts = [np.concatenate([np.arange(g * gsize, (g + 1) * gsize) for g in np.flatnonzero(gnode == n)])
                        for n in range(num_nodes)]
    else:
        node_experts = [np.arange(E)]
    slot_expert = np.empty(num_slots, dtype=np.int64)
    counts = np.zeros(E, dtype=np.int64)
    for n, ex in enumerate(node_experts):
        ex = np.sort(ex)
        # 2. replicas inside the node (at most one per GPU of the node while possible)
        c = _replicate(w[ex], spn, gpn)
        # 3. replicas -> GPUs of the node (with a bounded search over where the extra replicas go)
        c, gp = _place_replicas(w[ex], c, gpn, spg, refine)
        counts[ex] = c
        items = np.repeat(ex, c)                                # logical expert of each replica
        for lg in range(gpn):
            mine = np.sort(items[gp == lg])
            base = (n * gpn + lg) * spg
            slot_expert[base:base + spg] = mine
    return _finish(w, slot_expert, counts, num_gpus, num_nodes, num_groups, uniform)


def _finish(w, slot_expert, counts, num_gpus, num_nodes, num_groups, uniform) -> Placement:
    E = w.shape[0]
    R = int(counts.max())
    l2p = np.full((E, R), -1, dtype=np.int64)
    fill = np.zeros(E, dtype=np.int64)
    for s, e in enumerate(slot_expert.tolist()):
        l2p[e, fill[e]] = s
        fill[e] += 1
    assert (fill == counts).all()
    spg = slot_expert.shape[0] // num_gpus
    per_slot = w[slot_expert] / counts[slot_expert]
    gl = per_slot.reshape(num_gpus, spg).sum(1)
    return Placement(physical_to_logical=torch.from_numpy(slot_expert.copy()),
                     logical_to_physical=torch.from_numpy(l2p), replica_count=torch.from_numpy(counts.copy()),
                     gpu_load=torch.from_numpy(gl), expert_load=torch.from_numpy(w.copy()), num_gpus=num_gpus,
                     num_nodes=num_nodes, num_groups=num_groups, uniform=uniform)


def plan(load, num_gpus: int, num_slots: int | None = None, num_nodes: int = 1, *, num_experts: int | None = None,
         num_groups: int | None = None, refine: bool = True) -> Placement | list[Placement]:
    """Place routed experts (and replicas of the hottest ones) on GPUs for expert parallelism.

    Args:
        load: per-expert load estimate (e.g. tokens routed to each expert), float or int, >= 0:
            1-D [E] -> one :class:`Placement`; 2-D [layers, E] -> a list with one Placement per row
            (every MoE layer has its own routing statistics, so each gets its own placement).
            None or empty -> uniform load (then ``num_experts`` is required). A load summing to zero is
            planned as if uniform.
        num_gpus: GPUs in the expert-parallel group; must be a multiple of num_nodes.
        num_slots: physical expert slots in total (default: the fewest multiple of num_gpus >= E, i.e. E
            when num_gpus divides E, as ``mtc ir --stage lowered`` picks); a multiple of num_gpus and >= E.
            The num_slots - E extra slots hold replicas of the hottest experts.
        num_nodes: nodes; with > 1, hierarchical balancing: expert groups are packed onto nodes first
            (every node gets num_groups / num_nodes groups), then replicated and packed inside each node.
        num_experts: E when load is None/empty; must agree with the load otherwise.
        num_groups: expert groups for the node level (contiguous runs of E / num_groups experts, as in
            group-limited routing); default E (every expert its own group). Must divide E and be a
            multiple of num_nodes.
        refine: run the pairwise-exchange refinement after the greedy packing (default True).

    Returns:
        A :class:`Placement` (or a list of them for a 2-D load). Slot s lives on GPU
        ``s // (num_slots // num_gpus)``; no GPU holds two replicas of one expert unless that is
        unavoidable (more replicas of an expert than GPUs available to it).

    Raises:
        ValueError: negative, NaN or infinite loads, or loads of a layer whose sum overflows float64; a load
            that is not 1-D/2-D; num_slots not a multiple
            of num_gpus or < E; num_gpus > MAX_GPUS or num_slots > MAX_SLOTS; num_gpus not a
            multiple of num_nodes; E not divisible into num_groups groups or num_groups not a multiple of
            num_nodes; non-positive counts.
        Warns (UserWarning) when the slot count is past the refinement's limit (greedy packing only).
        TypeError: a load that is not numeric.

    Algorithm: DeepSeek EPLB (github.com/deepseek-ai/EPLB; DeepSeek-V3, arXiv 2412.19437 sec. 3.4):
    greedy replication by load per replica, then balanced packing (longest-processing-time order, equal
    slot count per GPU), plus a pairwise-exchange refinement and a bounded replica-move search (module
    docstring, step 3) that only lower the maximum GPU load.
    """
    arr, uniform = _as_load(load, num_experts)
    num_gpus = _pos_int("num_gpus", num_gpus)
    num_nodes = _pos_int("num_nodes", num_nodes)
    E = int(arr.shape[-1])
    num_slots = -(-E // num_gpus) * num_gpus if num_slots is None else _pos_int("num_slots", num_slots)
    if num_gpus > MAX_GPUS or num_slots > MAX_SLOTS:
        raise ValueError(f"plan: num_gpus = {num_gpus}, num_slots = {num_slots}: this planner handles expert-parallel "
                         f"groups of at most {MAX_GPUS} GPUs and {MAX_SLOTS} slots (its greedy packing is "
                         f"O(slots x GPUs)); plan one EP group, not the whole cluster")
    if num_gpus % num_nodes:
        raise ValueError(f"plan: num_gpus = {num_gpus} is not a multiple of num_nodes = {num_nodes}")
    if num_slots % num_gpus:
        raise ValueError(f"plan: num_slots = {num_slots} is not a multiple of num_gpus = {num_gpus} "
                         f"(every GPU holds the same number of expert slots)")
    if num_slots < E:
        raise ValueError(f"plan: num_slots = {num_slots} is fewer than the {E} experts (every expert needs a slot)")
    num_groups = E if num_groups is None else _pos_int("num_groups", num_groups)
    if E % num_groups:
        raise ValueError(f"plan: {E} experts do not split into num_groups = {num_groups} equal groups")
    if num_nodes > 1 and num_groups % num_nodes:
        raise ValueError(f"plan: num_groups = {num_groups} (default: one group per expert) is not a multiple of "
                         f"num_nodes = {num_nodes}; every node must get the same number of expert groups")

    def one(w, u):
        if w.sum() == 0:
            w, u = np.ones_like(w), True
        return _plan_one(w, num_gpus, num_slots, num_nodes, num_groups, u, refine)

    if arr.ndim == 1:
        return one(arr, uniform)
    return [one(row, uniform) for row in arr]


# ---------------------------------------------------------------------------------------------
def _layer_key(name: str):
    m = re.search(r"layers\.(\d+)", name)
    if m:
        return (0, int(m.group(1)), name)
    nums = [int(x) for x in re.findall(r"\d+", name)]
    return (1, nums, name)


def routing_layers(stats: Mapping[str, object]) -> list[str]:
    """The layer names of a routing-statistics dict in the row order of :func:`load_from_routing_stats`
    (by the number after ``layers.``, e.g. ``model.layers.12.block_sparse_moe``; other names after)."""
    return sorted(stats, key=_layer_key)


def load_from_routing_stats(stats: Mapping[str, torch.Tensor | Sequence[float]]) -> torch.Tensor:
    """Stack ``mtc run`` routing statistics into a load matrix for :func:`plan`.

    Args:
        stats: {MoE layer prefix: [E] tokens routed to each expert}, e.g. ``CompiledModule.routing_stats``
            (int64 tensors) or the ``expert_load`` lists of ``mtc run --json``.
    Returns:
        float64 [layers, E], rows in the order of :func:`routing_layers` (layer index ascending).
    Raises:
        ValueError: empty dict, a row that is not 1-D, rows of different lengths, negative or non-finite
            counts.
        TypeError: not a dict, or a row that is not numbers.
    """
    if not isinstance(stats, Mapping):
        raise TypeError(f"load_from_routing_stats: expected a dict {{layer: [E] loads}}, got {type(stats).__name__}")
    if not stats:
        raise ValueError("load_from_routing_stats: no routing statistics (empty dict); run a forward pass first")
    rows = []
    names = routing_layers(stats)
    for k in names:
        v = stats[k]
        try:
            t = (v.detach().to("cpu", torch.float64) if isinstance(v, torch.Tensor)
                 else torch.tensor(v, dtype=torch.float64))
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"load_from_routing_stats: layer '{k}' is {type(v).__name__} {v!r:.60}, not [E] "
                            f"token counts (a tensor or a list of numbers)") from None
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"load_from_routing_stats: layer '{k}' has shape {tuple(t.shape)}, expected [E]")
        if rows and t.numel() != rows[0].numel():
            raise ValueError(f"load_from_routing_stats: layer '{k}' has {t.numel()} experts but "
                             f"'{names[0]}' has {rows[0].numel()}: one placement plans layers of one expert count; "
                             f"pass the layers of each count separately, e.g. "
                             f"{{k: v for k, v in stats.items() if len(v) == {t.numel()}}}")
        if not torch.isfinite(t).all() or (t < 0).any():
            raise ValueError(f"load_from_routing_stats: layer '{k}' has negative or non-finite counts")
        rows.append(t)
    return torch.stack(rows)
