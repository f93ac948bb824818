"""Model statistics from the graph IR: parameters, active parameters, FLOPs per token and memory.

Everything is read off the graph: parameter counts from ``param`` nodes (routed-expert tensors carry
``active = top_k / E``), FLOPs from each primitive op's FLOP rule on the canonical graph at a given
sequence length, and the decoding state from the layer blocks (MLA latent KV cache, KDA state).
"""
from __future__ import annotations

import math

from dataclasses import asdict, dataclass, field

import sympy

from dsl.ir import DEFAULT_DTYPE, DTYPES, SOURCE_OPS, Graph, as_expr, sym


@dataclass
class ModelStats:
    name: str
    seq_len: int
    batch: int
    gpus: int
    total_params: int
    active_params: int                   # per token, excluding the input embedding table
    active_params_with_embedding: int
    flops_per_token: float               # forward pass, at seq_len (attention grows with T)
    flops_per_token_by_op: dict = field(default_factory=dict)
    weights_bytes: float = 0.0
    kv_cache_bytes: float = 0.0          # MLA latent cache, all sequences of the batch
    kda_state_bytes: float = 0.0         # KDA recurrent state (float32) + short-conv state
    residual_stream_bytes: float = 0.0   # one [B, T, d] activation
    layers: dict = field(default_factory=dict)

    def per_gpu(self, nbytes: float) -> float:
        return nbytes / self.gpus

    def to_dict(self) -> dict:
        """The fields as JSON-ready values: whole-number counts (bytes, FLOPs) as ints, fractions as floats."""
        d = {k: _whole(v) for k, v in asdict(self).items()}
        d["flops_per_token_by_op"] = {k: _whole(v) for k, v in d["flops_per_token_by_op"].items()}
        # (whole bytes per GPU: the even share rounded up, what the GPU with the larger share holds)
        d["per_gpu"] = {k: math.ceil(self.per_gpu(getattr(self, k))) for k in
                        ("weights_bytes", "kv_cache_bytes", "kda_state_bytes")}
        return d


def _whole(v):
    """A float that holds a whole number as an int (JSON prints 1559945231488, not 1559945231488.0)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _numel(t) -> int:
    return int(t.numel())


#: the largest GPU count the per-GPU figures are computed for (a typo guard: 1e26 GPUs print 0 B/GPU)
MAX_GPUS = 1 << 20


def declared_max_seq_len(graph: Graph) -> int | None:
    """The spec's max_seq_len config value (the context the model is declared for), or None when the spec
    sets none (or sets something other than an integer)."""
    v = dict(graph.meta_get("config", ())).get("max_seq_len")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def compute_stats(graph: Graph, canonical: Graph | None = None, *, seq_len: int | None = None, batch: int = 1,
                  gpus: int = 1) -> ModelStats:
    """Statistics of a model graph (the 'graph' stage, with layer blocks).

    Args:
        graph: the graph as parsed (layer blocks present).
        canonical: the same graph after canonicalize (computed if None).
        seq_len: context length T (default: the spec's max_seq_len config value, else 4096).
        batch: number of sequences (for the KV cache and state).
        gpus: devices to spread weights and caches over (an even split).
    """
    from dsl.ops import flops_of
    if canonical is None:
        from .manager import PassManager
        canonical = PassManager().run(graph)
    config = dict(graph.meta_get("config", ()))
    T = int(seq_len or config.get("max_seq_len", 4096))
    if gpus > MAX_GPUS:
        from dsl.errors import MtcError
        raise MtcError(f"gpus = {gpus:,} is more than {MAX_GPUS:,}: per-GPU figures would round to 0 B; check --gpus")
    if T < 1 or batch < 1 or gpus < 1:
        from dsl.errors import MtcError
        raise MtcError(f"sequence length, batch and GPU count must be >= 1 (got T={T}, batch={batch}, gpus={gpus}); "
                       f"check --seq-len or the spec's max_seq_len")
    act_bytes = DTYPES[config.get("dtype", DEFAULT_DTYPE)]      # the dtype the graph builder typed it in
    emb_params = {r.node for n in graph.nodes if n.op == "embedding" for r in n.inputs[1:]}
    from dsl.ir import live_nodes
    live = live_nodes(graph)              # parameters only dead ops use are not part of the model
    total = 0
    active = 0.0
    active_emb = 0.0
    wbytes = 0.0
    for n in graph.params():
        if n.name not in live:
            continue
        k = _numel(n.type)
        total += k
        frac = n.attr("active", 1.0)
        wbytes += k * DTYPES[n.type.dtype]
        if n.name in emb_params:
            active_emb += k
        else:
            active += k * frac
    for n in graph.buffers():
        if n.name in live:
            wbytes += _numel(n.type) * DTYPES[n.type.dtype]
    # FLOPs on the canonical graph at B = 1, T = seq_len, per token of that graph's input (a spec may fix
    # its token input's shape, e.g. i64[2, 16]: then the graph holds 32 tokens whatever seq_len says)
    bind = {sym("B"): 1, sym("T"): T}
    ins = canonical.inputs()
    free = sorted({str(s) for n in ins for d in n.types[0].shape for s in d.free_symbols}
                  - {"B", "T"})
    if free:
        from dsl.errors import MtcError
        raise MtcError(f"{graph.name}: the input shape symbol(s) {', '.join(free)} have no size here: statistics "
                       f"count per token at batch B and context T, so name the token dims B and T "
                       f"(e.g. x: f32[B, T, 64])", ins[0].loc)
    tokens = T
    if len(ins) == 1 and ins[0].types[0].rank == 2 and ins[0].types[0].dtype in ("i64", "i32"):
        tokens = int(sympy.Mul(*ins[0].types[0].shape).subs(bind))      # token ids [B, T] (maybe fixed)
    cnodes = canonical.node_map()
    by_op: dict[str, float] = {}
    for n in canonical.nodes:
        if n.op in SOURCE_OPS:
            continue
        ins = [cnodes[r.node].types[r.index] for r in n.inputs]
        f = flops_of(n.op, ins, n.types, n.attr_dict)
        if f != 0:
            v = float(as_expr(f).subs(bind))
            by_op[n.op] = by_op.get(n.op, 0.0) + v / tokens
    # decoding state from the layer blocks
    kv = 0.0
    kda_state = 0.0
    layers = {"kda": 0, "mla": 0, "dense_ffn": 0, "moe": 0}
    d_model = None
    for n in graph.nodes:
        if n.name not in live:            # a layer the outputs do not depend on (dropped when compiled)
            continue
        a = n.attr_dict
        if n.op == "mla_layer":
            layers["mla"] += 1
            kv += (a["kv_lora_rank"] + a["qk_rope_dim"]) * act_bytes * T * batch
        elif n.op == "kda_layer":
            layers["kda"] += 1
            H, K = a["heads"], a["head_dim"]
            V = a["v_head_dim"] or K
            kda_state += H * K * V * 4 * batch
            kda_state += (a["conv_size"] - 1) * H * (2 * K + V) * act_bytes * batch
        elif n.op == "glu_ffn":
            layers["dense_ffn"] += 1
        elif n.op in ("latent_moe", "moe"):
            layers["moe"] += 1
        if n.op == "embedding":
            d_model = int(n.type.shape[-1])
    return ModelStats(
        name=graph.name, seq_len=T, batch=batch, gpus=gpus, total_params=total, active_params=round(active),
        active_params_with_embedding=round(active + active_emb),
        flops_per_token=sum(by_op.values()), flops_per_token_by_op=dict(sorted(by_op.items(), key=lambda x: -x[1])),
        weights_bytes=wbytes, kv_cache_bytes=kv, kda_state_bytes=kda_state,
        residual_stream_bytes=float(T * batch * (d_model or 0) * act_bytes), layers=layers)


def _sig3(v: float) -> str:
    """About three significant digits without an exponent (1008, 99.5, 1.25; .3g would print 1.01e+03)."""
    return f"{v:.0f}" if abs(v) >= 99.95 else f"{v:.3g}"


def human(n: float, unit: str = "") -> str:
    for div, suf in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{_sig3(n / div)} {suf}{unit}"
    return f"{_sig3(n)} {unit}".strip()


def human_bytes(n: float) -> str:
    for div, suf in ((2 ** 70, "ZiB"), (2 ** 60, "EiB"), (2 ** 50, "PiB"), (2 ** 40, "TiB"), (2 ** 30, "GiB"),
                     (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if n >= div:
            return f"{_sig3(n / div)} {suf}"
    return f"{n:.0f} B"
