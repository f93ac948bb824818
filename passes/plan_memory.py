"""Per-GPU memory plan and expert-parallel communication volume of a model graph.

    import dsl
    from passes.plan_memory import plan_memory
    mp = plan_memory(dsl.load("models/kimi_k3.mtc"), seq_len=1 << 20, gpus=128)
    print(mp.summary())              # weights / activations / KV cache / KDA state / all-to-all per GPU
    mp.to_dict()

The parallel layout it assumes (simple, and stated so the numbers can be checked by hand):

* **Routed experts** (the ``param`` tensors that carry ``active = top_k / E``, shape [E, ...]) are split by
  expert parallelism over ``ep_size`` GPUs (default: all ``gpus``; ``gpus`` must be a multiple of
  ``ep_size``, the EP groups being replicated ``gpus / ep_size`` times). Each GPU holds
  ``ceil(num_slots / ep_size)`` expert slots per MoE layer (``num_slots`` defaults to E; more slots hold
  replicas, see :mod:`passes.place_experts`), in the stored dtype (MXFP4 for K3's released experts).
* **Every other parameter with two or more dimensions** (projections, conv weights, router, embedding,
  LM head) is split evenly over a tensor-parallel group of ``tp_size`` GPUs (default ``gcd(gpus, 8)``, one
  NVLink node, reduced to divide every attention layer's head count). **1-D parameters and buffers** (norm weights, A_log, dt_bias, router bias) are replicated.
* **Tokens**: the ``batch x seq_len`` tokens are spread evenly over all ``gpus`` (context parallelism
  across tensor-parallel groups, Megatron sequence/tensor parallelism inside a group: every activation is
  split along tokens or along heads/features), so activations per GPU = total / gpus.
* **MLA latent KV cache**: the latent [c_kv, k_rope] is shared by all heads, so a tensor-parallel group
  keeps a full copy of the cache of its tokens: per GPU = total / (gpus / tp_size).
* **KDA state**: every GPU holds, for each sequence, the state of its own segment (the segment-parallel
  scan hands each segment its predecessor's state) for its 1/tp_size of the heads:
  per GPU = batch x per-sequence state / tp_size. The totals come from :func:`passes.stats.compute_stats`.
* **Activations** are the sizes of the values of the canonical graph (primitive ops) at B = batch and
  T = seq_len; views (reshape, slice, broadcast) alias their input and cost nothing. ``checkpointing``:

  - ``"none"``: every op output is kept for the backward pass: the sum of all values.
  - ``"layer"``: only the values that enter a layer from outside it are kept (the residual stream, the
    Block AttnRes bank, each counted once); during the backward pass one layer at a time is recomputed:
    kept + the largest layer's values.
  - ``"block"``: the same with Block AttnRes blocks (``block_size`` layers) as the unit.
  - ``"inference"``: forward only, values freed after their last use: the peak of the live buffers of the program
    a compiled module of ``target`` runs (passes/lower.py; outputs written in place of dead inputs share their
    storage; ``m.last_run.peak_bytes`` measures the same), and
    separately the largest launch's workspace at that point (buffers a kernel allocates inside itself).

  The graph sized is the one the default pipeline runs: the canonical graph with Block AttnRes in its
  two-phase form (each block's phase-1 accumulators live until the block's last merge; at T = 1M on 128 GPUs
  that is 24 x 8192 x 7168 bf16 = 2.6 GiB per GPU), or the direct form with ``two_phase_attn_res=False``.

  The embedding and the final norm/LM head are units of their own; the logits [B, T, vocab] count in
  full. Buffers that live only inside a fused kernel (e.g. the per-(token, expert) hidden states of
  ``moe_experts``) are not graph values and are not counted.
* **All-to-all per MoE layer** (one forward, per GPU): dispatch and combine each move
  ``tokens_per_gpu x top_k x width x bytes x (ep_size - 1) / ep_size`` bytes, where width is the latent
  width l for Stable LatentMoE (the tokens travel after W_down and come back before W_up) and d for a
  plain MoE, and (ep - 1) / ep is the fraction of a token's expert copies whose expert lives on another
  GPU under uniform routing. ``dispatch_dedup_bytes`` is the volume when a token is sent once per
  destination GPU instead of once per expert (DeepEP style): ``tokens x width x bytes x`` the expected
  number of other GPUs among its top_k distinct experts.
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import asdict, dataclass, field

from dsl.errors import MtcWarning
from dsl.ir import DEFAULT_DTYPE, DTYPES, SOURCE_OPS, Graph, TensorType, sym
from dsl.ops import ops_with_role

__all__ = ["MemoryPlan", "MoEComm", "plan_memory", "CHECKPOINTING"]

CHECKPOINTING = ("none", "layer", "block", "inference")
VIEW_OPS = ops_with_role("view")
_LAYER_OPS = ops_with_role("layer")
_FLOAT = ("f32", "f16", "bf16", "f64", "fp8")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _tokens(x: float) -> str:
    """Tokens per GPU as printed: whole numbers as such, an uneven split's average with up to 3 decimals and no
    trailing zeros (409.6, not 409.600, which reads as 409,600 beside the thousands separators)."""
    if float(x).is_integer():
        return f"{int(x):,}"
    short = _frac(x)
    return f"{x:,.3f}" if short == "0" else short     # (a tiny average keeps 0.000, not a bare 0)


def _frac(x: float) -> str:
    """A number as printed with up to 3 decimals, no trailing zeros and thousands separators (0.8, 0.938, 409.6)."""
    return f"{x:,.3f}".rstrip("0").rstrip(".")


@dataclass
class MoEComm:
    """Expert-parallel all-to-all of one MoE layer for one forward pass, bytes sent per GPU."""

    layer: str
    experts: int
    top_k: int
    width: int                     # elements per token copy (latent width l, or d)
    tokens_per_gpu: float
    remote_fraction: float         # (ep - 1) / ep
    dispatch_bytes: float
    combine_bytes: float
    dispatch_dedup_bytes: float    # one copy per destination GPU instead of per expert

    @property
    def total_bytes(self) -> float:
        return self.dispatch_bytes + self.combine_bytes


@dataclass
class MemoryPlan:
    """Per-GPU memory (bytes) and expert-parallel traffic of a model at one sequence length.

    All ``*_bytes`` fields are per GPU unless named ``*_total_bytes`` (the whole model / whole batch).
    """

    model: str
    seq_len: int
    batch: int
    gpus: int
    ep_size: int
    tp_size: int
    checkpointing: str
    tokens_per_gpu: float
    expert_slots_per_gpu: int              # per MoE layer (the largest over layers)
    moe_layers: int
    expert_weight_bytes: float
    sharded_weight_bytes: float            # >= 2-D non-expert parameters, / tp_size
    replicated_weight_bytes: float         # 1-D parameters and buffers
    activation_bytes: float
    activation_kept_bytes: float           # kept across the forward (checkpoints, or everything for "none")
    activation_recompute_bytes: float      # the largest unit recomputed in the backward ("layer"/"block")
    kv_cache_bytes: float
    kda_state_bytes: float
    weights_total_bytes: float
    activation_total_bytes: float
    kv_cache_total_bytes: float
    kda_state_total_bytes: float
    moe_comm: list[MoEComm] = field(default_factory=list)
    two_phase_attn_res: bool = False       # activations of the two-phase Block AttnRes form (phase-1 buffers)
    workspace_bytes: float = 0.0           # ("inference") the largest launch's buffers inside itself, at its peak
    target: str = "reference"              # ("inference") the target whose program is planned

    @property
    def weight_bytes(self) -> float:
        return self.expert_weight_bytes + self.sharded_weight_bytes + self.replicated_weight_bytes

    @property
    def total_bytes(self) -> float:
        """weights + activations + KV cache + KDA state, per GPU."""
        return (self.weight_bytes + self.activation_bytes + self.workspace_bytes + self.kv_cache_bytes
                + self.kda_state_bytes)

    @property
    def a2a_bytes_per_layer(self) -> float:
        """dispatch + combine of the heaviest MoE layer, per GPU per forward."""
        return max((c.total_bytes for c in self.moe_comm), default=0.0)

    @property
    def a2a_bytes_total(self) -> float:
        """dispatch + combine summed over all MoE layers, per GPU per forward."""
        return sum(c.total_bytes for c in self.moe_comm)

    @property
    def mixed_experts(self) -> bool:
        """Whether the MoE layers have different expert counts (expert_slots_per_gpu is then the largest)."""
        return len({c.experts for c in self.moe_comm}) > 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(weight_bytes=self.weight_bytes, total_bytes=self.total_bytes,
                 a2a_bytes_per_layer=self.a2a_bytes_per_layer, a2a_bytes_total=self.a2a_bytes_total)
        for c, dc in zip(self.moe_comm, d["moe_comm"]):
            dc["total_bytes"] = c.total_bytes
        return d

    def summary(self) -> str:
        hb = _human_bytes
        rows = [
            (f"routed experts ({'up to ' if self.mixed_experts else ''}{self.expert_slots_per_gpu} per MoE layer x "
             f"{self.moe_layers} layers, "
             f"EP {self.ep_size})" if self.moe_layers else "routed experts (no MoE layer)", self.expert_weight_bytes),
            (f"other weights, >= 2-D (split over TP {self.tp_size})", self.sharded_weight_bytes),
            ("other weights, 1-D and buffers (replicated)", self.replicated_weight_bytes),
            ((f"activations (forward only, target {self.target}: peak of live buffers)"
              if self.checkpointing == "inference" else f"activations ({self.checkpointing!r} checkpointing)")
             + (", two-phase AttnRes" if self.two_phase_attn_res else ""), self.activation_bytes),
        ] + ([("  + the peak launch's own workspace", self.workspace_bytes)] if self.checkpointing == "inference"
             else []) + [
            ("MLA latent KV cache", self.kv_cache_bytes),
            ("KDA state", self.kda_state_bytes),
        ]
        w = max(len(r[0]) for r in rows) + 2
        out = [f"memory plan: {self.model}, T = {self.seq_len:,} x B = {self.batch} on {self.gpus} GPU(s) "
               f"({_tokens(self.tokens_per_gpu)} tokens per GPU"
               + ("" if float(self.tokens_per_gpu).is_integer() else      # an uneven split: what GPUs hold
                  f" on average, {math.floor(self.tokens_per_gpu):,} or {math.ceil(self.tokens_per_gpu):,} each")
               + ")",
               f"  {'per GPU':<{w}}{'bytes':>12}"]
        out += [f"  {name:<{w}}{hb(v):>12}" for name, v in rows]
        out.append(f"  {'total':<{w}}{hb(self.total_bytes):>12}")
        if self.checkpointing in ("layer", "block"):
            out.append(f"  (activations: {hb(self.activation_kept_bytes)} kept at checkpoints + "
                       f"{hb(self.activation_recompute_bytes)} for the largest recomputed {self.checkpointing})")
        if self.moe_comm:
            c = max(self.moe_comm, key=lambda c: c.total_bytes)
            out.append(f"  expert-parallel all-to-all per MoE layer"
                       f"{f' (the largest, {c.layer})' if len({(x.experts, x.top_k, x.width) for x in self.moe_comm}) > 1 else ''}"
                       f": dispatch {hb(c.dispatch_bytes)} + combine "
                       f"{hb(c.combine_bytes)} per GPU (top-{c.top_k} x width {c.width} x "
                       f"{_tokens(c.tokens_per_gpu)} tokens, {_frac(c.remote_fraction)} remote; dispatch once per GPU: "
                       f"{hb(c.dispatch_dedup_bytes)}); {hb(self.a2a_bytes_total)} over {len(self.moe_comm)} layers")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.summary()


# ---------------------------------------------------------------------------------------------
def _human_bytes(n: float) -> str:
    for div, suf in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {suf}"
    return f"{n:.0f} B"


def _pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"plan_memory: {name} must be a positive int, got {v!r}")
    return v


class _Sizer:
    """Bytes of a value type at B = batch, T = seq_len (cached per type)."""

    def __init__(self, batch: int, seq_len: int, compute_dtype: str, dtype_bytes: float | None):
        self.bind = {sym("B"): batch, sym("T"): seq_len}
        self.compute_dtype = compute_dtype
        self.dtype_bytes = dtype_bytes
        self.cache: dict[TensorType, float] = {}

    def __call__(self, t: TensorType | None) -> float:
        if t is None:
            return 0.0
        hit = self.cache.get(t)
        if hit is None:
            n = t.numel().subs(self.bind)
            if not n.is_number:
                raise ValueError(f"plan_memory: cannot size {t}: symbols {sorted(map(str, n.free_symbols))} are "
                                 f"not bound (only B and T are)")
            eb = DTYPES[t.dtype]
            if self.dtype_bytes is not None and t.dtype == self.compute_dtype:
                eb = self.dtype_bytes
            hit = self.cache[t] = float(n) * eb
        return hit


def _units(canonical: Graph) -> tuple[dict[str, int], int]:
    """Checkpoint unit of every op node: its layer index (from the ``layers.N.`` parameter names it reads,
    else the largest unit among its inputs); -1 for the embedding, n_layers for the final norm / head."""
    player: dict[str, int | None] = {}
    for n in canonical.nodes:
        if n.op in ("param", "buffer"):
            m = _LAYER_RE.search(n.attr("name") or "")
            player[n.name] = int(m.group(1)) if m else None
    n_layers = 1 + max((v for v in player.values() if v is not None), default=-1)
    unit: dict[str, int] = {}
    for n in canonical.nodes:
        if n.op in SOURCE_OPS:
            continue
        ls = [player[r.node] for r in n.inputs if r.node in player]
        named = [x for x in ls if x is not None]
        ins = [unit[r.node] for r in n.inputs if r.node in unit]
        if named:
            u = max(named)
        elif ls:                                   # reads only non-layer parameters: embedding or head
            u = n_layers if ins and max(ins) >= 0 else -1
        else:
            u = max(ins, default=-1)
        unit[n.name] = u
    return unit, n_layers


def _activations(canonical: Graph, size: _Sizer, mode: str, block_size: int | None) -> tuple[float, float, float]:
    """-> (total bytes, kept bytes, recompute bytes) for the whole batch (not yet per GPU)."""
    ops = [n for n in canonical.nodes if n.op not in SOURCE_OPS or n.op == "input"]
    # every value resolves to the (node, index) that owns its storage
    base: dict[tuple[str, int], tuple[str, int]] = {}
    nbytes: dict[tuple[str, int], float] = {}
    for n in ops:
        for i, t in enumerate(n.types):
            if n.op in VIEW_OPS:
                r = n.inputs[0]
                base[(n.name, i)] = base.get((r.node, r.index), (r.node, r.index))
            else:
                base[(n.name, i)] = (n.name, i)
                nbytes[(n.name, i)] = size(t)
    if mode == "inference":
        pos = {n.name: k for k, n in enumerate(ops)}
        last: dict[tuple[str, int], int] = {b: pos[b[0]] for b in nbytes}
        for k, n in enumerate(ops):
            for r in n.inputs:
                b = base.get((r.node, r.index))
                if b is not None:
                    last[b] = max(last[b], k)
        for r in canonical.outputs:
            b = base.get((r.node, r.index))
            if b is not None:
                last[b] = len(ops)
        delta = [0.0] * (len(ops) + 2)
        for b, v in nbytes.items():
            delta[pos[b[0]]] += v
            delta[last[b] + 1] -= v
        peak = cur = 0.0
        for x in delta:
            cur += x
            peak = max(peak, cur)
        return peak, peak, 0.0
    everything = sum(nbytes.values())
    if mode == "none":
        return everything, everything, 0.0
    unit, n_layers = _units(canonical)
    if mode == "block":
        unit = {k: (u // block_size if 0 <= u < n_layers else (-1 if u < 0 else 10 ** 9)) for k, u in unit.items()}
    per_unit: dict[int, float] = {}
    kept: set[tuple[str, int]] = set()
    for n in ops:
        if n.op == "input":
            continue
        u = unit[n.name]
        if n.op not in VIEW_OPS:
            per_unit[u] = per_unit.get(u, 0.0) + sum(nbytes[(n.name, i)] for i in range(len(n.types)))
        for r in n.inputs:
            b = base.get((r.node, r.index))
            if b is None:                           # a parameter or buffer
                continue
            if b[0] not in unit or unit[b[0]] != u:  # produced outside this unit (or a graph input)
                kept.add(b)
    kept_bytes = sum(nbytes[b] for b in kept)
    recompute = max(per_unit.values(), default=0.0)
    return kept_bytes + recompute, kept_bytes, recompute


def _two_phase(canonical: Graph, compute_dtype: str) -> Graph:
    """The canonical graph after batch_attn_residual, with the phase-1 accumulator typed as the runtime stores
    it (backends.runtime._phase1_acc_dtype: the compute dtype if 16-bit, else float32)."""
    from .batch_attn_residual import batch_attn_residual, phase1_acc_dtype
    g = batch_attn_residual(canonical)
    acc_dt = phase1_acc_dtype(compute_dtype)
    if acc_dt == "f32":
        return g
    out = []
    for n in g.nodes:
        if n.op == "attn_residual_phase1":
            acc = n.types[0]
            n = n.replace(types=(TensorType(acc_dt, acc.shape),) + tuple(n.types[1:]))
        out.append(n)
    return g.with_nodes(out)


def _program_peak(canonical: Graph, size: "_Sizer", target: str, two_phase: bool,
                  inplace: bool = True) -> tuple[float, float]:
    """(peak bytes of live buffers, the peak launch's workspace beyond them) of the program a compiled module of
    ``target`` runs without autograd (passes/lower.py), for the whole batch."""
    from backends.memory import workspace
    from .manager import PassManager
    from .lower import lower
    from backends.registry import CHAINS
    if target not in CHAINS:
        raise ValueError(f"plan_memory: target must be one of {', '.join(map(repr, CHAINS))}, got {target!r}")
    names = (["batch_attn_residual"] if two_phase else []) + (["fuse_tiles"] if target != "reference" else [])
    g = PassManager(names, verify_each=False).run(canonical) if names else canonical
    program = lower(g, target, inplace=inplace)

    def elem(t) -> float:
        return size(TensorType(t.dtype, ())) if t.dtype in DTYPES else 4.0
    live, with_ws = program.memory(size.bind, elem, workspace(program, size.bind, elem))
    return live, with_ws - live


def _moe_prefix(graph: Graph, n, nodes) -> str:
    for r in n.inputs:
        name = nodes[r.node].attr("name") or ""
        if name.endswith(".gate.weight"):
            return name[: -len(".gate.weight")]
    return n.name


def plan_memory(graph: Graph, *, seq_len: int, gpus: int, batch: int = 1, checkpointing: str = "layer",
                ep_size: int | None = None, dtype_bytes: float | None = None, tp_size: int | None = None,
                num_slots: int | None = None, block_size: int | None = None,
                canonical: Graph | None = None, two_phase_attn_res: bool = True,
                target: str = "reference", inplace: bool = True) -> MemoryPlan:
    """Per-GPU memory for weights, activations, MLA latent KV cache and KDA state, and the
    expert-parallel all-to-all volume per MoE layer (the layout is described in the module docstring).

    Args:
        graph: the model graph as parsed (``dsl.load``; the layer blocks must be present).
        seq_len: tokens per sequence T (> 0).
        gpus: GPUs the model runs on (> 0).
        batch: sequences per forward B (> 0).
        checkpointing: "none" | "layer" | "block" | "inference" (forward only, see the module docstring).
        ep_size: GPUs in one expert-parallel group (default gpus; must divide gpus).
        dtype_bytes: bytes per element of values in the model's compute dtype (the config ``dtype``):
            activations, the MLA KV cache and the all-to-all payload (e.g. 1 for FP8). Default: the IR
            dtypes. Weights keep their stored dtypes; the KDA state stays as computed by compute_stats.
        tp_size: tensor-parallel group size for the non-expert weights (default gcd(gpus, 8, every attention
            layer's head count); must divide gpus and the head counts).
        num_slots: physical expert slots per MoE layer (default E; replicas when larger; must be a
            multiple of ep_size and >= E).
        block_size: layers per checkpoint block for checkpointing="block" (default: the block_size= of the
            model's Block AttnRes stack, else the config value ``block_size``).
        canonical: the canonicalized graph, if already at hand (computed otherwise).
        two_phase_attn_res: size the activations of the two-phase Block AttnRes form that the default pipeline
            runs (reference and Triton targets; the batch_attn_residual pass): each block's phase-1 output
            (accumulators [n_queries, B, T, d] in the compute dtype when that is 16-bit, as the Triton runtime
            stores them, else float32, plus two float32 [n_queries, B, T] statistics) lives until the block's
            last merge. False: the direct form (one attn_residual per read; the TVM target).
        target: ("inference") the target whose program is planned: "reference" runs the graph op by op;
            "triton" its fused program (the default pipeline with fuse_tiles).
        inplace: ("inference") the program writes outputs in place of dead inputs where it can (passes/lower.py;
            dsl.compile's default); False: every output in its own storage.
    Returns:
        A :class:`MemoryPlan` (bytes per GPU; ``summary()`` for a table, ``to_dict()`` for JSON).
    Raises:
        ValueError: non-positive sizes, an unknown checkpointing mode, ep_size/tp_size not dividing gpus,
            tp_size not dividing an attention layer's heads,
            num_slots not a multiple of ep_size or fewer than the experts, checkpointing="block" without a
            block size, or a graph that was already canonicalized (no layer blocks).

    Sources: MLA latent cache (kv_lora_rank + qk_rope_dim per token per layer) from DeepSeek-V2 (arXiv
    2405.04434, eq. 9-10 and sec. 2.1.4); KDA state H x K x V float32 from Kimi Linear (arXiv 2510.26692,
    the recurrent form); the all-to-all volume of expert parallelism from GShard (arXiv 2006.16668, sec.
    3.2) and DeepSeek-V3 (arXiv 2412.19437, sec. 3.4, node-limited dispatch); the figures of
    ../shared/spec/MODEL.md ("Memory arithmetic at one million tokens") are what the tests check.
    """
    from passes.stats import compute_stats
    if not isinstance(graph, Graph):
        raise TypeError(f"plan_memory: expected a dsl Graph, got {type(graph).__name__}")
    seq_len = _pos_int("seq_len", seq_len)
    gpus = _pos_int("gpus", gpus)
    from passes.stats import MAX_GPUS
    if gpus > MAX_GPUS:
        raise ValueError(f"plan_memory: gpus = {gpus:,} is more than {MAX_GPUS:,} (per-GPU figures would round to 0)")
    batch = _pos_int("batch", batch)
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"plan_memory: checkpointing must be one of {', '.join(map(repr, CHECKPOINTING))}, "
                         f"got {checkpointing!r}")
    ep = gpus if ep_size is None else _pos_int("ep_size", ep_size)
    if gpus % ep:
        raise ValueError(f"plan_memory: ep_size = {ep} does not divide gpus = {gpus}")
    heads = sorted({int(n.attr("heads")) for n in graph.nodes
                    if n.op in ("kda_layer", "mla_layer") and isinstance(n.attr("heads"), int)})
    if tp_size is None:
        tp = math.gcd(gpus, 8)
        for h in heads:                      # a tensor-parallel group splits attention heads: it divides them
            tp = math.gcd(tp, h)
    else:
        tp = _pos_int("tp_size", tp_size)
    if gpus % tp:
        raise ValueError(f"plan_memory: tp_size = {tp} does not divide gpus = {gpus}")
    bad = [h for h in heads if h % tp]
    if bad:
        raise ValueError(f"plan_memory: tp_size = {tp} does not divide the {bad[0]} heads of an attention layer "
                         f"(tensor parallelism splits the heads over the group)")
    if dtype_bytes is not None and (isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, (int, float))
                                    or not dtype_bytes > 0 or not math.isfinite(dtype_bytes)):
        raise ValueError(f"plan_memory: dtype_bytes must be a positive number, got {dtype_bytes!r}")
    ops = {n.op for n in graph.nodes}
    if graph.meta_get("canonicalized"):
        raise ValueError("plan_memory: this graph is already canonicalized (no layer blocks, so no KV cache or "
                         "KDA state to read); pass the graph as parsed (dsl.load) and, optionally, canonical=")
    if not ops & set(_LAYER_OPS) and ops & {"kda_chunk", "mla_attention", "moe_experts"}:
        warnings.warn(MtcWarning(f"plan_memory: {graph.name} writes kda_chunk / mla_attention / moe_experts as "
                                 f"primitive ops: the KV cache, KDA state and expert-parallel figures are read from "
                                 f"the layer blocks (kda_layer, mla_layer, moe, latent_moe) and are not counted here"),
                      stacklevel=2)
    config = dict(graph.meta_get("config", ()))
    compute_dtype = config.get("dtype", DEFAULT_DTYPE)     # the dtype the graph builder typed it in
    act_b = DTYPES[compute_dtype]
    eb = float(dtype_bytes) if dtype_bytes is not None else float(act_b)
    if checkpointing == "block":
        if block_size is None:  # the Block AttnRes stack's block_size= (a spec may write a literal there)
            block_size = graph.meta_get("attn_res_block_size", config.get("block_size"))
        if block_size is None:
            raise ValueError("plan_memory: checkpointing='block' needs a block size (the model has no Block AttnRes "
                             "stack and no 'block_size' config value); use checkpointing='layer' (mtc: "
                             "--checkpointing layer), or pass block_size= from Python")
        block_size = _pos_int("block_size", block_size)

    if canonical is None:
        from passes import PassManager
        canonical = PassManager(["verify", "infer_shapes", "canonicalize"]).run(graph)
    stats = compute_stats(graph, canonical, seq_len=seq_len, batch=batch, gpus=gpus)

    # -- weights ------------------------------------------------------------------------------
    nodes = graph.node_map()
    expert_b = sharded_b = repl_b = 0.0
    slots_per_gpu = 0
    for n in graph.nodes:
        if n.op not in ("param", "buffer"):
            continue
        t = n.type
        numel = float(t.numel())
        b = DTYPES[t.dtype]
        active = n.attr("active")
        if n.op == "param" and active is not None and active < 1 and t.rank >= 1:
            E = int(t.shape[0])
            S = E if num_slots is None else num_slots
            if num_slots is not None and (S < E or S % ep):
                raise ValueError(f"plan_memory: num_slots = {S} must be >= the {E} experts and a multiple of "
                                 f"ep_size = {ep}")
            per_gpu = -(-S // ep)
            slots_per_gpu = max(slots_per_gpu, per_gpu)
            expert_b += numel / E * per_gpu * b
        elif n.op == "param" and t.rank >= 2:
            sharded_b += numel * b / tp
        else:
            repl_b += numel * b

    # -- activations --------------------------------------------------------------------------
    size = _Sizer(batch, seq_len, compute_dtype, dtype_bytes)
    ws_total = 0.0
    if checkpointing == "inference":
        act_total, ws_total = _program_peak(canonical, size, target, two_phase_attn_res, inplace)
        kept, recompute = act_total, 0.0
    else:
        act_total, kept, recompute = _activations(_two_phase(canonical, compute_dtype) if two_phase_attn_res
                                                  else canonical, size, checkpointing, block_size)

    # -- caches and state ---------------------------------------------------------------------
    kv_total = stats.kv_cache_bytes * (eb / act_b)
    kda_total = stats.kda_state_bytes

    # -- expert-parallel all-to-all -----------------------------------------------------------
    tokens_gpu = batch * seq_len / gpus
    if tokens_gpu < 1:
        warnings.warn(MtcWarning(f"plan_memory: {batch * seq_len:,} tokens on {gpus:,} GPUs: "
                                 f"{gpus - batch * seq_len:,} GPUs hold no token; the per-GPU activation, KV-cache "
                                 f"and all-to-all figures are averages over all GPUs (use fewer GPUs or more "
                                 f"tokens)"), stacklevel=2)
    comm = []
    for n in graph.nodes:
        if n.op not in ("latent_moe", "moe"):
            continue
        E, k = int(n.attr("experts")), int(n.attr("top_k"))
        width = int(n.attr("latent")) if n.op == "latent_moe" else int(n.type.shape[-1])
        remote = (ep - 1) / ep
        per = tokens_gpu * k * width * eb * remote
        # expected number of other GPUs hit by k distinct experts drawn uniformly, E / ep experts per GPU:
        # a GPU is missed with probability C(E - eg, k) / C(E, k). With more GPUs than experts (eg < 1) every
        # GPU holds one slot (replicas split an expert's tokens): a GPU is hit with probability k / ep, and
        # the once-per-GPU dispatch equals the per-expert one.
        eg = E / ep
        if eg < 1:
            hit = k / ep
        else:
            hit = 1.0 - (math.exp(math.lgamma(E - eg + 1) - math.lgamma(E - eg - k + 1) - math.lgamma(E + 1)
                                  + math.lgamma(E - k + 1)) if E - eg >= k else 0.0)
        dedup = tokens_gpu * width * eb * (ep - 1) * hit
        comm.append(MoEComm(layer=_moe_prefix(graph, n, nodes), experts=E, top_k=k, width=width,
                            tokens_per_gpu=tokens_gpu, remote_fraction=remote, dispatch_bytes=per, combine_bytes=per,
                            dispatch_dedup_bytes=dedup))

    return MemoryPlan(
        model=graph.name, seq_len=seq_len, batch=batch, gpus=gpus, ep_size=ep, tp_size=tp,
        checkpointing=checkpointing, tokens_per_gpu=tokens_gpu, expert_slots_per_gpu=slots_per_gpu,
        moe_layers=len(comm), expert_weight_bytes=expert_b, sharded_weight_bytes=sharded_b,
        replicated_weight_bytes=repl_b, activation_bytes=act_total / gpus, activation_kept_bytes=kept / gpus,
        activation_recompute_bytes=recompute / gpus, kv_cache_bytes=kv_total / (gpus // tp),
        kda_state_bytes=kda_total / tp, weights_total_bytes=stats.weights_bytes, activation_total_bytes=act_total,
        kv_cache_total_bytes=kv_total, kda_state_total_bytes=kda_total, moe_comm=comm,
        two_phase_attn_res=bool(two_phase_attn_res) and any(n.op == "attn_residual" for n in canonical.nodes),
        workspace_bytes=ws_total / gpus, target=target)
