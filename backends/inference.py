"""Inference with caches: the decoding state of a compiled model, chunked prefill, one-token decode, generate.

    cache = m.new_cache(batch_size=2, max_len=4096)
    logits = m.prefill(ids, cache, chunk_tokens=512)           # [B, T, vocab]; the prompt in chunks
    logits = m.decode(next_ids, cache)                         # next_ids [B, 1] -> [B, 1, vocab]
    out = m.generate(ids, max_new_tokens=32)                   # [B, T + new] (Hugging Face's arguments)

What a model keeps between tokens (spec/OPS.md, DESIGN.md "Inference"):

* per KDA layer, the recurrent state S [B, H, K, V] float32 (kda_chunk's ``initial_state`` / ``final_state``) and
  the short-conv states of q, k and v: the last ``conv_size - 1`` inputs of each convolution, [B, W-1, C] in the
  model's dtype;
* per MLA layer, the **latent** cache: the kv_lora_rank values after ``kv_a_layernorm`` and the qk_rope part of
  ``kv_a_proj_with_mqa``, [B, max_len, kv_lora_rank] and [B, max_len, qk_rope_dim] in the model's dtype (DeepSeek-V2,
  arXiv 2405.04434, Sec. 2.1); per-head K and V are never stored, only formed for the attention of one call;
* nothing for Block AttnRes: it mixes the outputs of earlier *layers at the same position* (a depth-wise softmax),
  so a token's mix reads only its own position's values, which the program computes anew for every token. The
  MoE routers, norms, projections and the LM head are per-token as well.

These are exactly the figures ``mtc stats`` prints per sequence (passes/stats.py: "MLA latent KV cache" at T =
max_len, "KDA + conv state"): ``cache.nbytes`` equals their sum for a module compiled in the spec's dtype.

Execution: prefill and decode run the module's own inference program (passes/lower.py KernelProgram, the one
``m.ir("lowered")`` prints) once per chunk, with the chunk's token ids as its input. The runtime hands the launches
of the three sequence-mixing ops to this module's :class:`_Session`, which runs the same implementation the program
resolved with the state of the cache: the short convolution (``short_conv``, or the fused ``conv_silu_norm``) on
its input with the cached last inputs put in front; ``kda_chunk`` with ``initial_state`` and
``output_final_state`` (one token per row: ``kda_step``); the MLA core against the latent cache, causal with the
chunk's offset (the queries are the last rows of the keys). The latent values are copied into the cache when the
program produces them. Rows of a batch may hold prompts of different lengths: a chunk whose rows have equal
pieces runs as [rows, piece]; otherwise the pieces are packed into one sequence [1, sum] with ``cu_seqlens``
(spec/OPS.md), so no state mixes between rows.

The MLA attention of a call picks, by FLOP count, between the expanded form (per-head K, V formed from the
latent cache for this call, then torch's SDPA or, on the reference target, float32 math: long chunks) and the
absorbed form (W_UK folded into the query, the attention over the latent itself, W_UV after: decode); off the
reference target a decode step's absorbed attention is the split-T Triton kernel backends/triton/mla_decode.py.
A decode step on the triton target runs each standard KDA layer (:func:`kda_decode_plans`) as one kernel,
backends/triton/kda/decode.py: the three short convolutions with their cache states, SiLU, the L2 norms, the gate,
beta's sigmoid, the recurrence on the cache's state rows in place and the gated output norm; the projections stay
the program's GEMMs, which run in between (the layer's launches before the last keep their operands and hand the
projection's value on; the kernel runs at the last, the epilogue). What fuses is decided from the lowered
program: any other implementation, an intermediate value that a second launch reads, or another epilogue leaves
the layer launch by launch (then the Triton kda_step updates the cache rows in place, ``kda_step_rows``). The
CUDA-graph decode step of issue 35 item 4 is not written yet.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dsl.errors import MtcError


def _kda_backend(m, L, call, missing: str):
    """(backend module, extra kda_chunk keywords) of kda_chunk launch L: the reference, or Triton with the bound the
    kernel may use; MtcError '<model>: <missing> of <kernel>' for any other implementation."""
    if L.kernel == "reference.kda_chunk":
        import backends.reference as B
        return B, {}
    if L.kernel == "triton.kda_chunk":
        import backends.triton as B
        from backends.triton.impls import fast_bound
        return B, {"lower_bound": fast_bound(call.attr("lower_bound"))}
    raise MtcError(f"{m.graph.name}: {missing} of {L.kernel} (k{L.index})")


# ---------------------------------------------------------------------------------------------------------------
# what the cache holds, read from the executed graph


@dataclass(frozen=True)
class ConvState:
    """A short convolution's state: its last ``width - 1`` inputs per row, [B, width - 1, channels]."""
    node: str
    channels: int
    width: int


@dataclass(frozen=True)
class KDAState:
    """A kda_chunk's recurrent state, [B, heads, k, v] float32."""
    node: str
    heads: int
    k: int
    v: int


@dataclass(frozen=True)
class LatentCache:
    """An MLA core's latent cache: [B, max_len, kv_lora_rank] (after kv_a_layernorm) and [B, max_len, qk_rope_dim]
    (the shared rope key, sliced from kv_a_proj_with_mqa's output). ``latent_ref`` / ``kv_ref``: the program's
    buffers they are copied from; ``kv_b``: the graph node of the kv_b_proj weight [heads * (nope + v_dim),
    kv_lora_rank]; ``rope``: the (start, end) columns of kv_ref that hold the rope key (None: qk_rope_dim 0)."""
    node: str
    layer: str
    latent_ref: str
    kv_ref: str
    rope: tuple | None
    kv_b: str
    heads: int
    nope: int
    rope_dim: int
    v_dim: int
    rank: int
    scale: float


@dataclass
class CacheLayout:
    """The states a model's cache holds, by the graph node they belong to (see the module docstring)."""
    conv: dict = field(default_factory=dict)
    kda: dict = field(default_factory=dict)
    mla: dict = field(default_factory=dict)

    @property
    def anchors(self) -> set:
        return set(self.conv) | set(self.kda) | set(self.mla)


def _fail(m, what: str, node=None):
    raise MtcError(f"{m.graph.name}: inference cache: {what}", getattr(node, "loc", None))


def cache_layout(m) -> CacheLayout:
    """The cache layout of compiled module ``m`` (kept on it): every short_conv, kda_chunk and mla_attention node of
    its executed graph. An mla_attention must be the core of an ``mla_layer`` (its k and v formed from the latent
    by the kv_b projection, :func:`_match_mla`), else MtcError: its per-head K / V would have to be cached."""
    hit = m.__dict__.get("_cache_layout")
    if hit is not None:
        return hit
    g = m.graph
    nodes = g.node_map()
    lay = CacheLayout()
    for n in g.nodes:
        if n.op == "short_conv":
            w = nodes[n.inputs[1].node].types[0]
            lay.conv[n.name] = ConvState(n.name, int(w.shape[0]), int(w.shape[2]))
        elif n.op == "kda_chunk":
            q, v = g.type_of(n.inputs[0]), g.type_of(n.inputs[2])
            lay.kda[n.name] = KDAState(n.name, int(q.shape[2]), int(q.shape[3]), int(v.shape[3]))
        elif n.op == "mla_attention":
            if not n.attr("causal"):
                _fail(m, f"%{n.name} = mla_attention(causal=false): a non-causal attention reads later tokens, "
                         f"which a decode step does not have", n)
            lay.mla[n.name] = _match_mla(m, n, nodes)
        elif n.op == "kda_step":
            _fail(m, f"%{n.name} = kda_step: a graph that runs the decode step itself has no cache form here", n)
    if g.inputs() and (len(g.inputs()) != 1 or g.inputs()[0].type.rank != 2
                       or g.inputs()[0].type.dtype not in ("i64", "i32")):
        _fail(m, "prefill / decode feed one input, token ids [B, T]; this graph takes "
                 + ", ".join(f"{x.attr('name')}: {x.type}" for x in g.inputs()))
    if len(g.outputs) != 1 or g.type_of(g.outputs[0]).rank != 3:
        _fail(m, "prefill / decode return one output, the logits [B, T, vocab]; this graph returns "
                 + ", ".join(str(g.type_of(o)) for o in g.outputs))
    buffers = m.program.buffers
    for c in lay.mla.values():
        for r in (c.latent_ref, c.kv_ref):
            if r not in buffers:
                _fail(m, f"the MLA value {r} is not a buffer of the lowered program (fused away), so the latent "
                         f"cache cannot be filled from it")
    m.__dict__["_cache_layout"] = lay
    return lay


def _match_mla(m, n, nodes) -> LatentCache:
    """The latent structure around ``n`` = mla_attention(q, k, v) as dsl/ops/mla.py's mla_layer builds it::

        kv = linear(x, kv_a_proj_with_mqa); c = rmsnorm(slice(kv, 0:R)); kvb = reshape(linear(c, kv_b_proj), H, n+dv)
        k = concat(slice(kvb, 0:n), broadcast(reshape(slice(kv, R:R+r))))   (or one of the two parts)
        v = slice(kvb, n:n+dv)                                              (or kvb itself when n = 0)
    """
    def node_of(ref):
        return nodes[ref.node]

    def bad(why):
        _fail(m, f"%{n.name} = mla_attention: {why}; the latent cache needs the core of an mla_layer (k and v "
                 f"formed from the kv_a_layernorm latent by kv_b_proj)", n)

    scale = float(n.attr("scale"))
    kref, vref = n.inputs[1], n.inputs[2]
    vn = node_of(vref)
    if vn.op == "slice":
        kvb4 = node_of(vn.inputs[0])
        v_start, v_end = vn.attr("start"), vn.attr("end")
    else:
        kvb4, v_start, v_end = vn, 0, None
    if kvb4.op != "reshape":
        bad("v is not a slice of the reshaped kv_b projection")
    kvb = node_of(kvb4.inputs[0])
    if kvb.op != "linear":
        bad("v does not come from a linear projection")
    H, width = int(kvb4.types[0].shape[2]), int(kvb4.types[0].shape[3])
    v_end = width if v_end is None else v_end
    dv, nope = v_end - v_start, v_start
    lat = node_of(kvb.inputs[0])
    if lat.op != "rmsnorm":
        bad("the kv_b projection's input is not the kv_a_layernorm")
    kv_b = kvb.inputs[1].node
    rank = int(nodes[kv_b].types[0].shape[1])
    src = node_of(lat.inputs[0])
    kv = node_of(src.inputs[0]) if src.op == "slice" else src
    if kv.op != "linear":
        bad("the latent is not a slice of the kv_a projection")
    # the key: [nope part of kvb, broadcast rope part of kv]
    kn = node_of(kref)
    parts = [node_of(r) for r in kn.inputs] if kn.op == "concat" else [kn]
    rope, rope_dim, got_nope = None, 0, 0
    for p in parts:
        if p.op == "slice" and node_of(p.inputs[0]).name == kvb4.name:
            got_nope = p.attr("end") - p.attr("start")
            if p.attr("start") != 0:
                bad("the key's per-head part does not start at column 0 of kv_b")
        elif p.op == "broadcast":
            r = node_of(node_of(p.inputs[0]).inputs[0]) if node_of(p.inputs[0]).op == "reshape" else None
            if r is None or r.op != "slice" or node_of(r.inputs[0]).name != kv.name:
                bad("the key's shared part is not a slice of the kv_a projection")
            rope, rope_dim = (r.attr("start"), r.attr("end")), r.attr("end") - r.attr("start")
        else:
            bad(f"the key has a part made by {p.op}")
    if got_nope != nope or (kn.op == "concat" and parts[0].op != "slice"):
        bad("the key's per-head part and the value do not split kv_b as [nope, v]")
    layer = m._names.get(kv_b, kv_b).removesuffix(".kv_b_proj.weight")
    return LatentCache(n.name, layer, str(lat.out()), str(kv.out()), rope, kv_b, H, nope, rope_dim, dv, rank, scale)


# ---------------------------------------------------------------------------------------------------------------
class Cache:
    """The decoding state of one compiled model for ``batch_size`` rows of up to ``max_len`` tokens each
    (``m.new_cache``). Attributes: ``lengths`` (tokens held per row, a list of ints), ``conv`` / ``kda`` /
    ``latent`` / ``rope`` ({graph node: tensor}, see the module docstring for shapes and dtypes), ``nbytes``.

    A cache belongs to the module that made it (another module's cache is refused, also one of the same
    architecture: its states came from other weights). An error inside a prefill or decode call leaves the cache
    marked incomplete (any later use is an MtcError until ``reset()``); input errors are found before anything
    is written."""

    def __init__(self, module, layout: CacheLayout, batch_size: int, max_len: int, device, dtype):
        self.batch_size, self.max_len = batch_size, max_len
        self.device, self.dtype = device, dtype
        self.lengths = [0] * batch_size
        self._owner = weakref.ref(module)
        self._model = module.graph.name
        self._broken: str | None = None
        z = dict(device=device)
        self.conv = {k: torch.zeros(batch_size, s.width - 1, s.channels, dtype=dtype, **z)
                     for k, s in layout.conv.items()}
        self.kda = {k: torch.zeros(batch_size, s.heads, s.k, s.v, dtype=torch.float32, **z)
                    for k, s in layout.kda.items()}
        self.latent = {k: torch.zeros(batch_size, max_len, s.rank, dtype=dtype, **z) for k, s in layout.mla.items()}
        self.rope = {k: torch.zeros(batch_size, max_len, s.rope_dim, dtype=dtype, **z)
                     for k, s in layout.mla.items()}

    def tensors(self):
        for d in (self.conv, self.kda, self.latent, self.rope):
            yield from d.values()

    @property
    def nbytes(self) -> int:
        """Bytes of all cache tensors (allocated at max_len)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def state_bytes(self) -> int:
        """Bytes of the KDA recurrent and short-conv states (independent of max_len)."""
        return sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.kda.values()))

    @property
    def latent_bytes(self) -> int:
        """Bytes of the MLA latent cache (latent and rope parts, at max_len)."""
        return sum(t.numel() * t.element_size() for t in (*self.latent.values(), *self.rope.values()))

    def reset(self) -> None:
        """Empty every row (lengths 0, states zero); clears an incomplete mark."""
        for t in self.tensors():
            t.zero_()
        self.lengths = [0] * self.batch_size
        self._broken = None

    def __repr__(self) -> str:
        from passes.stats import human_bytes
        return (f"Cache({self._model}: batch_size={self.batch_size}, max_len={self.max_len:,}, lengths="
                f"{self.lengths if self.batch_size <= 8 else str(self.lengths[:8])[:-1] + ', ...]'}, "
                f"{len(self.kda)} KDA + {len(self.conv)} conv states {human_bytes(self.state_bytes)}, "
                f"{len(self.latent)} MLA latent caches {human_bytes(self.latent_bytes)})")


def _pos_int(name: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise MtcError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def new_cache(m, batch_size: int, max_len: int) -> Cache:
    """See CompiledModule.new_cache."""
    batch_size, max_len = _pos_int("new_cache: batch_size", batch_size), _pos_int("new_cache: max_len", max_len)
    lay = cache_layout(m)
    p0 = next(m.parameters(), None)
    device = p0.device if p0 is not None else torch.device("cpu")
    if device.type == "meta":
        raise MtcError(f"{m.graph.name}: new_cache on a module compiled on device='meta' (no weights); its cache "
                       f"size: passes.stats.compute_stats(...).kv_cache_bytes + kda_state_bytes")
    need = sum(b * s for b, s in _layout_bytes(lay, batch_size, max_len, torch.empty((), dtype=m.dtype).element_size()))
    from backends.memory import available_bytes
    have = available_bytes(device)
    if have is not None and need > have:
        from passes.stats import human_bytes
        raise MtcError(f"{m.graph.name}: a cache of batch_size {batch_size} x max_len {max_len:,} needs "
                       f"{human_bytes(need)}, but {device} has {human_bytes(have)} free")
    return Cache(m, lay, batch_size, max_len, device, m.dtype)


def _layout_bytes(lay: CacheLayout, B: int, L: int, eb: int):
    for s in lay.conv.values():
        yield eb, B * (s.width - 1) * s.channels
    for s in lay.kda.values():
        yield 4, B * s.heads * s.k * s.v
    for s in lay.mla.values():
        yield eb, B * L * (s.rank + s.rope_dim)


def _check_cache(m, cache, rows: int, where: str) -> None:
    if not isinstance(cache, Cache):
        raise MtcError(f"{where}: cache must come from m.new_cache(batch_size, max_len), got {type(cache).__name__}")
    if cache._owner() is not m:
        raise MtcError(f"{where}: this cache belongs to another model ({cache._model}); make one with this "
                       f"module's new_cache (a cache holds the states of the weights that filled it)")
    if cache._broken is not None:
        raise MtcError(f"{where}: the cache was left incomplete by an error in an earlier call ({cache._broken}); "
                       f"cache.reset() empties it")
    if rows != cache.batch_size:
        raise MtcError(f"{where}: the input has {rows} rows but the cache holds batch_size {cache.batch_size}; "
                       f"make a cache for this batch (m.new_cache({rows}, max_len))")
    p0 = next(m.parameters(), None)
    if p0 is not None and next(cache.tensors(), p0).device != p0.device:
        raise MtcError(f"{where}: the cache is on {next(cache.tensors()).device} but the model on {p0.device}")


# ---------------------------------------------------------------------------------------------------------------
# the fused KDA decode step: which launches of the inference program one kernel replaces


@dataclass(frozen=True)
class FusedKDA:
    """A standard KDA layer's per-token launches in the inference program (passes/lower.py), which a decode step
    runs as one backends/triton/kda/decode.py kernel: the three ``triton.conv_silu_norm`` launches (q and k with
    the L2 norm, v without), the kda_gate, beta's sigmoid, the ``triton.kda_chunk`` and, when the layer has it, the
    ``generated`` epilogue rmsnorm(o) * sigmoid(gl). ``roles``: launch index -> "q" / "k" / "v" / "gate" / "beta" /
    "kda" / "out"; ``fire``: the last of them, where the kernel runs (the epilogue, else the kda_chunk); ``conv``:
    role -> the short_conv node whose cache state it updates."""
    kda: str
    roles: dict
    fire: int
    conv: dict
    eps: dict
    gate: str
    lower_bound: float | None
    out_eps: float | None
    out_inputs: tuple | None           # (the epilogue operand index of the norm weight, of the gate's input)


#: run each standard KDA layer's decode step as one kernel (False: launch by launch, the path prefill takes with one
#: token per row; for comparison in tests and benchmarks/kda_decode.py)
FUSE_KDA_DECODE = True


def kda_decode_plans(m, lay: CacheLayout) -> dict:
    """{kda_chunk node: FusedKDA} for every KDA layer of ``m``'s inference program whose launches are the standard
    pattern (the triton target: see FusedKDA); a layer that differs in any way (another implementation, an
    intermediate value read by a second launch, another epilogue) is left out and runs launch by launch."""
    prog = m.program
    nodes = m.graph.node_map()
    by_index = {L.index: (L, call) for L, _fn, call in m._bound_program(prog)}
    producer, readers = {}, {}
    for L in prog.launches:
        for r, _t in L.inputs:
            readers.setdefault(r, []).append(L.index)
        for r, _t in L.outputs:
            producer[r] = L

    def source(ref, reader):
        """The non-view launch that makes ``ref`` (through views), when each value on the way is read only by the
        next launch; else None."""
        while True:
            if readers.get(ref) != [reader] or ref not in producer:
                return None
            P = producer[ref]
            if not P.is_view:
                return P
            ref, reader = P.inputs[0][0], P.index

    plans = {}
    for Lk in prog.launches:
        if Lk.anchor not in lay.kda or Lk.kernel != "triton.kda_chunk" or len(Lk.inputs) != 5:
            continue
        roles, conv, eps = {Lk.index: "kda"}, {}, {}
        ok = True
        for role, (ref, _t) in zip(("q", "k", "v", "gate", "beta"), Lk.inputs):
            P = source(ref, Lk.index)
            if P is None:
                ok = False
                break
            call = by_index[P.index][1]
            if role in "qkv":
                normed = call.attr("head_dim") is not None
                if P.kernel != "triton.conv_silu_norm" or P.anchor not in lay.conv or normed != (role != "v"):
                    ok = False
                    break
                conv[role], eps[role] = P.anchor, call.attr("eps")
            elif role == "gate":
                if P.kernel not in ("triton.kda_gate", "reference.kda_gate"):
                    ok = False
                    break
                gate, lb = call.attr("gate"), call.attr("lower_bound")
            elif [nodes[n].op for n in P.ops] != ["sigmoid"] or P.generated is not None:
                ok = False
                break
            roles[P.index] = role
        if not ok or len(set(conv.values())) != 3:
            continue
        fire, out_eps, out_inputs = Lk.index, None, None
        o_ref = Lk.outputs[0][0]
        E = prog.launches[readers[o_ref][0]] if len(readers.get(o_ref, [])) == 1 else None
        if E is not None and E.generated is not None and E.inputs[0][0] == o_ref:
            ops = [nodes[n] for n in E.ops]
            if [n.op for n in ops] == ["rmsnorm", "sigmoid", "reshape", "mul", "reshape"]:
                rms, sig, _r1, mul, _r2 = ops
                refs = [r for r, _t in E.inputs]
                if (str(rms.inputs[0]) == o_ref and [str(x) for x in mul.inputs] == [f"%{rms.name}", f"%{_r1.name}"]
                        and str(_r1.inputs[0]) == f"%{sig.name}" and str(rms.inputs[1]) in refs
                        and str(sig.inputs[0]) in refs and len(refs) == 3):
                    fire, out_eps = E.index, float(rms.attr("eps"))
                    out_inputs = (refs.index(str(rms.inputs[1])), refs.index(str(sig.inputs[0])))
                    roles[E.index] = "out"
        plans[Lk.anchor] = FusedKDA(Lk.anchor, roles, fire, conv, eps, gate, lb, out_eps, out_inputs)
    return plans


# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Step:
    """One run of the program: segment s is ``lens[s]`` tokens of cache row ``rows[s]`` from its position
    ``starts[s]``; ``packed``: the segments are one sequence [1, sum(lens)] with ``cu`` (cu_seqlens), else the input
    is [len(rows), lens[0]] (all lens equal)."""
    rows: list
    starts: list
    lens: list
    packed: bool
    device: torch.device
    cu: torch.Tensor | None = None
    rows_t: torch.Tensor | None = None

    def __post_init__(self):
        self.rows_t = torch.tensor(self.rows, dtype=torch.long, device=self.device)
        if self.packed:
            cu = [0]
            for n in self.lens:
                cu.append(cu[-1] + n)
            self.cu = torch.tensor(cu, dtype=torch.int32, device=self.device)


class _Session:
    """The cache-aware launches of one prefill / decode call (CompiledModule._seq during its program runs)."""

    def __init__(self, m, cache: Cache):
        self.m, self.cache = m, cache
        self.layout = cache_layout(m)
        self.anchors = self.layout.anchors
        self.captures = {}
        for s in self.layout.mla.values():
            self.captures.setdefault(s.latent_ref, []).append((s, "latent"))
            self.captures.setdefault(s.kv_ref, []).append((s, "kv"))
        self.step: _Step | None = None
        # the fused KDA decode step (issue 35 item 4): launch index -> (plan, role); its launches' anchors
        self.fused = {}
        if FUSE_KDA_DECODE and m.target == "triton" and self.layout.kda:
            for p in kda_decode_plans(m, self.layout).values():
                for i, role in p.roles.items():
                    self.fused[i] = (p, role)
        self._fused_anchors = self.anchors | {m.program.launches[i].anchor for i in self.fused}
        self._pending = {}

    @property
    def decoding(self) -> bool:
        """Whether the current step is a decode step (one token per row, unpacked)."""
        st = self.step
        return st is not None and not st.packed and st.lens[0] == 1

    @property
    def anchors(self) -> set:
        """The anchors of the launches this session runs: the cache's, and in a decode step also the other
        launches of each fused KDA layer."""
        return self._fused_anchors if self.fused and self.decoding else self._anchors

    @anchors.setter
    def anchors(self, value) -> None:
        self._anchors = value

    # -- the runtime's hooks -------------------------------------------------------------------------------------
    def launch(self, L, fn, call, args):
        """Launch ``L`` with the cache's state; an op's ValueError (NaN / inf operands, ...) becomes an MtcError at
        the op's spec line, as CompiledModule._launch makes it."""
        node = L.anchor
        try:
            hit = self.fused.get(L.index) if self.decoding else None
            if hit is not None:
                return self._fused(L, call, args, *hit)
            if node in self.layout.conv:
                return self._conv(L, fn, call, args, self.layout.conv[node])
            if node in self.layout.kda:
                return self._kda(L, fn, call, args)
            return self._mla(L, call, args, self.layout.mla[node])
        except ValueError as e:
            n = call.node
            raise MtcError(f"%{n.name} = {n.op}(...) with the inference cache: {e} (raised inside the model; for NaN "
                           f"/ inf: check the weights and the ops before it)", n.loc) from e

    def capture(self, ref: str, value: torch.Tensor) -> None:
        """Copy the chunk's latent values into the cache at each segment's positions."""
        for s, kind in self.captures[ref]:
            if kind == "latent":
                self._write(self.cache.latent[s.node], value)
            elif s.rope is not None:
                self._write(self.cache.rope[s.node], value[..., s.rope[0]:s.rope[1]])

    def _write(self, dst: torch.Tensor, value: torch.Tensor) -> None:
        st = self.step
        if not st.packed:
            c = st.lens[0]
            pos = torch.tensor(st.starts, device=dst.device)[:, None] + torch.arange(c, device=dst.device)
            dst[st.rows_t[:, None], pos] = value.to(dst.dtype)
            return
        a = 0
        for r, s0, n in zip(st.rows, st.starts, st.lens):
            dst[r, s0:s0 + n] = value[0, a:a + n].to(dst.dtype)
            a += n

    # -- a KDA layer's decode step as one kernel (kda_decode_plans) -----------------------------------------------
    def _fused(self, L, call, args, p: FusedKDA, role: str):
        """Launch ``L`` of fused layer ``p`` in a decode step: before the last one (p.fire), keep its operands and
        hand its first operand on as its output (a view of the projection's value: the conv, gate, sigmoid and the
        kda_chunk with an epilogue to come are computed by the kernel at p.fire, and nothing else reads those
        values, see kda_decode_plans); at p.fire, run backends/triton/kda/decode.py on the kept operands."""
        got = self._pending.setdefault(p.kda, {})
        got[role] = (args, call)
        shape = call.shape(L.outputs[0][1].shape)
        if L.index != p.fire:
            return (args[2] if role == "kda" else args[0]).reshape(shape)
        del self._pending[p.kda]
        from backends.triton.kda.decode import kda_decode_step
        st, c = self.step, self.cache
        n = len(st.rows)
        x = {r: got[r][0][0].reshape(n, -1) for r in ("q", "k", "v", "gate", "beta")}
        (_f, A_log, dt_bias), kcall = got["gate"][0], got["kda"][1]
        norm = None
        if "out" in got:
            a = got["out"][0]
            norm = (a[p.out_inputs[0]], a[p.out_inputs[1]].reshape(n, -1), p.out_eps)
        y = kda_decode_step(x["q"], x["k"], x["v"], c.conv[p.conv["q"]], c.conv[p.conv["k"]], c.conv[p.conv["v"]],
                            got["q"][0][1], got["k"][0][1], got["v"][0][1], x["gate"], A_log, dt_bias, x["beta"],
                            c.kda[p.kda], st.rows_t, scale=kcall.attr("scale") or self.layout.kda[p.kda].k ** -0.5,
                            gate=p.gate, lower_bound=p.lower_bound, eps_q=p.eps["q"], eps_k=p.eps["k"], norm=norm)
        return y.reshape(shape)

    # -- short convolution: the cached last inputs in front of the chunk's --------------------------------------
    def _conv(self, L, fn, call, args, spec: ConvState):
        x, w = args
        st, state = self.step, self.cache.conv[L.anchor]
        Wd = spec.width - 1

        def run(xe):
            if L.kernel == "triton.conv_silu_norm":
                from backends.triton import conv_silu_norm
                return conv_silu_norm(xe, w, head_dim=call.attr("head_dim"), eps=call.attr("eps"))
            if L.op != "short_conv":
                raise MtcError(f"{self.m.graph.name}: inference cache: no stateful form of the launch {L.kernel} "
                               f"(k{L.index})")
            return fn.fn(call, xe, w)

        if Wd == 0:
            y = run(x)
        elif not st.packed:
            xe = torch.cat([state[st.rows_t].to(x.dtype), x], dim=1)
            y = run(xe)[:, Wd:]
            state[st.rows_t] = xe[:, xe.shape[1] - Wd:].to(state.dtype)
        else:
            pieces, a = [], 0
            for r, n in zip(st.rows, st.lens):
                pieces += [state[r].to(x.dtype), x[0, a:a + n]]
                a += n
            xe = torch.cat(pieces, dim=0)[None]
            ye = run(xe)[0]
            outs, o = [], 0
            for r, n in zip(st.rows, st.lens):
                outs.append(ye[o + Wd:o + Wd + n])
                state[r] = xe[0, o + n:o + Wd + n].to(state.dtype)
                o += Wd + n
            y = torch.cat(outs, dim=0)[None]
        return y.reshape(call.shape(L.outputs[0][1].shape))

    # -- KDA: the recurrent state in and out --------------------------------------------------------------------
    def _kda(self, L, fn, call, args):
        q, k, v, g, beta = args
        st, S = self.step, self.cache.kda[L.anchor]
        scale = call.attr("scale")
        B, kw = _kda_backend(self.m, L, call, "inference cache: no stateful form")
        decode = self.decoding                         # one token per row: the decode step
        if decode and L.kernel == "triton.kda_chunk":
            # the cache rows updated where they lie (no gathered copy, no new state, no scatter back)
            from backends.triton.kda.step import kda_step_rows
            return kda_step_rows(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S, st.rows_t, scale=scale)[:, None]
        S0 = S[st.rows_t]
        if decode:
            o, S1 = B.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0, scale=scale)
            o = o[:, None]
        else:
            o, S1 = B.kda_chunk(q, k, v, g, beta, scale=scale, initial_state=S0, output_final_state=True,
                                cu_seqlens=st.cu, **kw)
        S[st.rows_t] = S1
        return o

    # -- MLA: attention over the latent cache, causal with each segment's offset --------------------------------
    def _mla(self, L, call, args, s: LatentCache):
        q, _k, v = args
        st = self.step
        W = self.m._tensor(self.m._names[s.kv_b])
        exact = L.kernel.startswith("reference.")
        lat, rope = self.cache.latent[s.node], self.cache.rope[s.node]
        if not st.packed:
            lk = max(st.starts) + st.lens[0]
            # (every row in order, the common case: views of the cache, not a gathered copy of it)
            rows = slice(None) if st.rows == list(range(self.cache.batch_size)) else st.rows_t
            return _attend(q, lat[rows, :lk], rope[rows, :lk], W, s, st.starts, exact).to(v.dtype)
        outs, a = [], 0
        for r, s0, n in zip(st.rows, st.starts, st.lens):
            outs.append(_attend(q[:, a:a + n], lat[r:r + 1, :s0 + n], rope[r:r + 1, :s0 + n], W, s, [s0], exact))
            a += n
        return torch.cat(outs, dim=1).to(v.dtype)


def _attend(q, C, R, W, s: LatentCache, starts, exact: bool) -> torch.Tensor:
    """softmax(q K^T * scale + mask) V for queries q [n, t, H, nope + rope] at positions starts[i] .. starts[i] +
    t - 1 of row i, over the keys of the latent cache C [n, Lk, rank], R [n, Lk, rope] (K, V = the kv_b projection of
    C split [nope, v], with R shared by all heads as the key's last part): query j of row i sees keys 0 ..
    starts[i] + j. The expanded or the absorbed form, whichever takes fewer FLOPs. Returns [n, t, H, v_dim]."""
    n, t, H, _ = q.shape
    Lk = C.shape[1]
    dqk = s.nope + s.rope_dim
    expanded = Lk * s.rank * H * (s.nope + s.v_dim) + t * Lk * H * (dqk + s.v_dim)
    absorbed = t * H * s.rank * (s.nope + s.v_dim) + t * Lk * H * (2 * s.rank + s.rope_dim)
    if expanded <= absorbed:
        d = max(dqk, s.v_dim)
        K, V = _expand_kv(C, R, W, s, dqk, s.v_dim) if exact else _expand_kv(C, R, W, s, d, d)
        return _attention(q, K, V, s.scale, starts, exact, s.v_dim)
    # absorbed: q_lat = q_nope W_UK (per head), scores over [C, R], o = (p C) W_UV^T
    Wf = W.float().view(H, s.nope + s.v_dim, s.rank)
    qf = q.float()
    if t == 1 and not exact:
        # one token per row: the split-T Triton kernel over the latent cache (backends/triton/mla_decode.py)
        from backends.triton.mla_decode import mla_decode
        q_lat = torch.einsum("bhd,hdk->bhk", qf[:, 0, :, :s.nope], Wf[:, :s.nope])
        lengths = torch.tensor(starts, device=q.device) + 1
        o_lat = mla_decode(q_lat, qf[:, 0, :, s.nope:] if s.rope_dim else None, C, R if s.rope_dim else None,
                           lengths, s.scale, max_length=max(starts) + 1)
        return torch.einsum("bhk,hvk->bhv", o_lat, Wf[:, s.nope:])[:, None]
    Cf = C.float()
    q_lat = torch.einsum("bthd,hdk->bhtk", qf[..., :s.nope], Wf[:, :s.nope])
    sc = torch.einsum("bhtk,bjk->bhtj", q_lat, Cf)
    if s.rope_dim:
        sc = sc + torch.einsum("bthr,bjr->bhtj", qf[..., s.nope:], R.float())
    p = torch.softmax((sc * s.scale).masked_fill(~_allowed(starts, t, Lk, q.device)[:, None], float("-inf")), -1)
    return torch.einsum("bhtk,hvk->bthv", torch.einsum("bhtj,bjk->bhtk", p, Cf), Wf[:, s.nope:])


#: keys per block of the kv_b projection in _expand_kv (bounds its transient [block, H, nope + v] product)
EXPAND_BLOCK = 1 << 14


def _expand_kv(C, R, W, s: LatentCache, d_k: int, d_v: int):
    """Per-head K [n, Lk, H, d_k] = [kv_b(C)[nope part], R, zeros] and V [n, Lk, H, d_v] = [kv_b(C)[v part], zeros]
    from the latent cache (zero columns change no dot product: one head dim for torch's fused attention kernels),
    filled in blocks of EXPAND_BLOCK keys: what one call holds is K, V and one block's product
    (:func:`expand_bytes`)."""
    n, Lk, _ = C.shape
    H, dqk = s.heads, s.nope + s.rope_dim
    K, V = C.new_empty(n, Lk, H, d_k), C.new_empty(n, Lk, H, d_v)
    if d_k > dqk:
        K[..., dqk:] = 0
    if d_v > s.v_dim:
        V[..., s.v_dim:] = 0
    w = W.to(C.dtype)
    for a in range(0, Lk, EXPAND_BLOCK):
        b = min(Lk, a + EXPAND_BLOCK)
        kvb = F.linear(C[:, a:b], w).view(n, b - a, H, s.nope + s.v_dim)
        K[:, a:b, :, :s.nope] = kvb[..., :s.nope]
        V[:, a:b, :, :s.v_dim] = kvb[..., s.nope:]
    if s.rope_dim:
        K[..., s.nope:dqk] = R[:, :, None, :]
    return K, V


def expand_bytes(s: LatentCache, rows: int, Lk: int, elem: int, exact: bool) -> int:
    """Bytes one MLA call of the expanded form holds beyond its output at Lk keys: K and V (padded to one head dim
    off the reference target) and one EXPAND_BLOCK product; on the reference target also the float32 copies of K and
    V and a block of scores, probabilities and mask (SCORE_ELEMENTS each)."""
    dqk = s.nope + s.rope_dim
    d = dqk if exact else max(dqk, s.v_dim)
    kv = rows * Lk * s.heads * (d + (s.v_dim if exact else d)) * elem
    blk = rows * min(Lk, EXPAND_BLOCK) * s.heads * (s.nope + s.v_dim) * elem
    extra = rows * Lk * s.heads * (dqk + s.v_dim) * 4 + 3 * SCORE_ELEMENTS * 4 if exact else 0
    return kv + blk + extra


def prefill_bytes(m, cache: Cache, chunk_tokens: int) -> float:
    """Bytes a prefill in chunks of ``chunk_tokens`` (one row per run, at most the cache's max_len keys) allocates
    beyond the weights and the cache: the inference program's plan at B = 1, T = chunk (live activations and the
    largest launch workspace, m.plan_memory) plus the largest MLA layer's expanded K, V at max_len keys
    (:func:`expand_bytes`). What benchmarks/generate.py checks torch.cuda.max_memory_allocated against."""
    exact = m.target == "reference"
    eb = torch.empty((), dtype=m.dtype).element_size()
    kv = max((expand_bytes(s, 1, cache.max_len, eb, exact) for s in cache_layout(m).mla.values()), default=0)
    return m.plan_memory(B=1, T=int(chunk_tokens))[1] + kv


def _allowed(starts, t: int, Lk: int, device) -> torch.Tensor:
    """[n, t, Lk] bool: query j of row i sees keys 0 .. starts[i] + j."""
    st = torch.tensor(starts, device=device)
    return torch.arange(Lk, device=device)[None, None, :] <= (st[:, None] + torch.arange(t, device=device))[:, :, None]


#: the most float32 scores the reference path of _attention holds at once
SCORE_ELEMENTS = 1 << 22


def _attention(q, K, V, scale: float, starts, exact: bool, dv: int) -> torch.Tensor:
    """Attention of q [n, t, H, D] over K [n, Lk, H, >= D] (columns past D zero), V [n, Lk, H, >= dv] with the
    causal-offset mask of :func:`_allowed`; returns [n, t, H, dv]. ``exact`` (the reference target): float32 math in
    blocks of query rows; else torch's SDPA (FlashAttention on the GPU), with a lower-right causal bias when every
    row has the same offset."""
    n, t, H, D = q.shape
    Lk = K.shape[1]
    if exact:
        qf, kf, vf = (x.float().transpose(1, 2) for x in (q, K[..., :D], V[..., :dv]))   # [n, H, *, D]
        out = torch.empty(n, H, t, dv, dtype=torch.float32, device=q.device)
        rows = max(1, min(t, SCORE_ELEMENTS // max(1, n * H * Lk)))
        for r0 in range(0, t, rows):
            r1 = min(t, r0 + rows)
            sc = (qf[:, :, r0:r1] @ kf.transpose(-1, -2)) * scale
            ok = _allowed([s0 + r0 for s0 in starts], r1 - r0, Lk, q.device)[:, None]
            out[:, :, r0:r1] = torch.softmax(sc.masked_fill(~ok, float("-inf")), dim=-1) @ vf
        return out.transpose(1, 2)
    dt = torch.promote_types(q.dtype, V.dtype)
    d = max(D, K.shape[-1], V.shape[-1])
    qp, kp, vp = (F.pad(x.to(dt), (0, d - x.shape[-1])) if x.shape[-1] < d else x.to(dt) for x in (q, K, V))
    if len(set(starts)) == 1 and starts[0] + t == Lk:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(t, Lk)
    else:
        mask = _allowed(starts, t, Lk, q.device)[:, None]
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=mask,
                                       scale=scale)
    return o.transpose(1, 2)[..., :dv]


class _PackedSession:
    """The sequence-mixing launches of a forward over packed sequences (``m(ids [1, T], cu_seqlens=...)``): each
    sequence starts from zero states and attends only to itself (spec/OPS.md cu_seqlens), with autograd as the
    program records it (the training program, when it records)."""

    def __init__(self, m, cu_seqlens: torch.Tensor):
        self.m, self.cu = m, cu_seqlens
        self.layout = cache_layout(m)
        self.anchors = self.layout.anchors
        self.captures = {}
        self.bounds = [(int(a), int(b)) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]

    def launch(self, L, fn, call, args):
        node = L.anchor
        if node in self.layout.conv:
            x, w = args
            Wd = self.layout.conv[node].width - 1
            if Wd:                              # W-1 zero inputs before every sequence, dropped after the conv
                z = x.new_zeros(Wd, x.shape[-1])
                xe = torch.cat([t for a, b in self.bounds for t in (z, x[0, a:b])])[None]
            else:
                xe = x
            if L.kernel == "triton.conv_silu_norm":
                from backends.triton import conv_silu_norm
                ye = conv_silu_norm(xe, w, head_dim=call.attr("head_dim"), eps=call.attr("eps"))
            else:
                ye = fn.fn(call, xe, w)
            if Wd:
                starts, o = [], 0
                for a, b in self.bounds:
                    starts.append((o + Wd, o + Wd + b - a))
                    o += Wd + b - a
                ye = torch.cat([ye[:, a:b] for a, b in starts], dim=1)
            return ye.reshape(call.shape(L.outputs[0][1].shape))
        q, k, v = args[:3]
        if node in self.layout.kda:
            B, kw = _kda_backend(self.m, L, call, "cu_seqlens: no packed form")
            return B.kda_chunk(*args, scale=call.attr("scale"), cu_seqlens=self.cu, **kw)[0]
        if L.kernel == "reference.mla_attention":
            import backends.reference as B
        elif L.kernel == "library.sdpa":
            import backends.triton as B
        else:
            raise MtcError(f"{self.m.graph.name}: cu_seqlens: no packed form of {L.kernel} (k{L.index})")
        return B.mla_attention(q, k, v, scale=call.attr("scale"), causal=call.attr("causal"), cu_seqlens=self.cu)


def packed_forward(m, input_ids, cu_seqlens, progress=None):
    """See CompiledModule.forward (cu_seqlens)."""
    where = f"{m.graph.name}: forward with cu_seqlens"
    ids = _ids(m, input_ids, where)
    if ids.shape[0] != 1:
        raise MtcError(f"{where}: packed sequences are one row, input_ids [1, T]; got {list(ids.shape)}")
    T = ids.shape[1]
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
            or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise MtcError(f"{where}: cu_seqlens must be an int32 / int64 tensor [N + 1] of offsets 0 = c_0 <= ... <= "
                       f"c_N = T")
    cs = cu_seqlens.tolist()
    if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
        raise MtcError(f"{where}: cu_seqlens must start at 0, not decrease and end at T = {T}; got {cs}")
    if torch.compiler.is_compiling():
        raise MtcError(f"{where}: not under torch.compile (the packed launches run eagerly)")
    sess = _PackedSession(m, cu_seqlens.to(ids.device))
    prev, m._seq = m._seq, sess
    try:
        return m.run(**{m.graph.inputs()[0].attr("name"): ids}, progress=progress)[0]
    finally:
        m._seq = prev


# ---------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _session(m, cache: Cache):
    """Eval mode (router biases frozen), no autograd, and the cache-aware launches for the duration."""
    sess = _Session(m, cache)
    training, m._seq = m.training, sess
    m.train(False)
    try:
        with torch.no_grad():
            yield sess
    finally:
        m._seq = None
        m.train(training)


def _ids(m, x, where: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
        raise MtcError(f"{where}: token ids must be an int64 [B, T] tensor, got "
                       + (f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__))
    return x


def _lengths(lengths, B: int, T: int, where: str) -> list:
    if lengths is None:
        return [T] * B
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise MtcError(f"{where}: lengths must be B integers, got a {lengths.dtype} tensor {list(lengths.shape)}")
        lengths = lengths.tolist()
    lengths = list(lengths)
    if len(lengths) != B or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 <= n <= T
                                for n in lengths):
        raise MtcError(f"{where}: lengths must be {B} integers in [0, {T}] (the tokens of each row of input_ids, "
                       f"right-padded), got {lengths}")
    return [int(n) for n in lengths]


def default_chunk_tokens(m, cache: Cache, total: int) -> int:
    """Tokens per prefill chunk: the most (a power of two from 256, at most PREFILL_CHUNK_MAX, at most ``total``)
    whose :func:`prefill_bytes` take at most half of the device's free memory (the free memory read once, with the
    weights and the cache already allocated)."""
    from backends.memory import available_bytes
    have = available_bytes(next(m.parameters()).device)
    c = 256
    while c * 2 <= min(total, PREFILL_CHUNK_MAX):
        if have is not None and prefill_bytes(m, cache, c * 2) > have / 2:
            break
        c *= 2
    return max(1, min(c, total))


#: the largest default prefill chunk (longer chunks cost memory and save little launch overhead)
PREFILL_CHUNK_MAX = 16384


def _run_step(m, cache: Cache, sess: _Session, step: _Step, ids: torch.Tensor) -> torch.Tensor:
    sess.step = step
    name = m.graph.inputs()[0].attr("name")
    try:
        out = m.run(**{name: ids})[0]
    except BaseException as e:
        cache._broken = f"{type(e).__name__} in a step over rows {step.rows[:8]}"
        raise
    for r, n in zip(step.rows, step.lens):
        cache.lengths[r] += n
    return out


def prefill(m, input_ids, cache: Cache, *, lengths=None, chunk_tokens=None, logits: str = "all", progress=None):
    """See CompiledModule.prefill."""
    where = f"{m.graph.name}: prefill"
    ids = _ids(m, input_ids, where)
    B, T = ids.shape
    _check_cache(m, cache, B, where)
    lens = _lengths(lengths, B, T, where)
    if logits not in ("all", "last"):
        raise MtcError(f"{where}: logits must be 'all' ([B, T, vocab]) or 'last' ([B, 1, vocab]), got {logits!r}")
    if T == 0 or sum(lens) == 0:
        raise MtcError(f"{where}: empty prompt (input_ids {list(ids.shape)}, lengths {lens}): nothing to prefill")
    empty = [b for b in range(B) if lens[b] == 0 and cache.lengths[b] == 0]
    if empty:
        raise MtcError(f"{where}: row {empty[0]} has an empty prompt and an empty cache: nothing to condition on")
    over = [b for b in range(B) if cache.lengths[b] + lens[b] > cache.max_len]
    if over:
        b = over[0]
        raise MtcError(f"{where}: row {b} would hold {cache.lengths[b] + lens[b]:,} tokens ({cache.lengths[b]:,} "
                       f"cached + {lens[b]:,}), past the cache's max_len {cache.max_len:,}; make a longer cache")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(m, cache, sum(lens))
    chunk_tokens = _pos_int(f"{where}: chunk_tokens", chunk_tokens)
    p0 = next(m.parameters())
    vocab = int(m.graph.type_of(m.graph.outputs[0]).shape[-1])
    out = torch.zeros(B, T if logits == "all" else 1, vocab, dtype=m.dtype, device=p0.device)
    m._check_token_ids({str(m.graph.inputs()[0].out()): ids})
    # chunk schedule: step i takes positions [i c, (i + 1) c) of every row that still has tokens there
    per_row = max(1, chunk_tokens // max(1, sum(1 for n in lens if n)))
    steps = [i for i in range(0, max(lens), per_row)]
    with _session(m, cache) as sess:
        for k, p in enumerate(steps):
            rows = [b for b in range(B) if lens[b] > p]
            pieces = [min(per_row, lens[b] - p) for b in rows]
            starts = [cache.lengths[b] for b in rows]
            packed = len(set(pieces)) > 1
            step = _Step(rows, starts, pieces, packed, p0.device)
            if packed:
                chunk = torch.cat([ids[b, p:p + n] for b, n in zip(rows, pieces)])[None]
            else:
                chunk = ids[rows, p:p + pieces[0]]
            y = _run_step(m, cache, sess, step, chunk)
            a = 0
            for i, (b, n) in enumerate(zip(rows, pieces)):
                yb = y[0, a:a + n] if packed else y[i]
                a += n
                if logits == "all":
                    out[b, p:p + n] = yb
                elif p + n == lens[b]:
                    out[b, 0] = yb[-1]
            if progress is not None:
                progress(k + 1, len(steps))
    return out


def decode(m, next_ids, cache: Cache) -> torch.Tensor:
    """See CompiledModule.decode."""
    where = f"{m.graph.name}: decode"
    ids = _ids(m, next_ids, where)
    B, T = ids.shape
    _check_cache(m, cache, B, where)
    if T != 1:
        raise MtcError(f"{where}: next_ids must be [B, 1] (one token per row), got {list(ids.shape)}; a longer "
                       f"piece goes through prefill")
    empty = [b for b in range(B) if cache.lengths[b] == 0]
    if empty:
        raise MtcError(f"{where}: row {empty[0]} of the cache is empty: prefill the prompt first")
    full = [b for b in range(B) if cache.lengths[b] >= cache.max_len]
    if full:
        raise MtcError(f"{where}: row {full[0]} holds {cache.lengths[full[0]]:,} tokens, the cache's max_len: "
                       f"decoding past it would overwrite nothing but cannot be stored; make a longer cache")
    m._check_token_ids({str(m.graph.inputs()[0].out()): ids})
    p0 = next(m.parameters())
    with _session(m, cache) as sess:
        step = _Step(list(range(B)), list(cache.lengths), [1] * B, False, p0.device)
        return _run_step(m, cache, sess, step, ids)


# ---------------------------------------------------------------------------------------------------------------
def _check_sampling(do_sample, temperature, top_k, top_p, where):
    if not isinstance(do_sample, bool):
        raise MtcError(f"{where}: do_sample must be True or False, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            0 < temperature < math.inf):
        raise MtcError(f"{where}: temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0):
        raise MtcError(f"{where}: top_k must be an integer >= 0 (0 or None: no top-k filter), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0 < top_p <= 1):
        raise MtcError(f"{where}: top_p must be a number in (0, 1], got {top_p!r}")


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k=None, top_p=None) -> torch.Tensor:
    """Sampling logits [B, vocab] as Hugging Face's generate shapes them, in its order (transformers'
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper): float32 logits / temperature; then top_k (> 0)
    keeps the k largest; then top_p (< 1) keeps the smallest set of the largest probabilities whose sum reaches
    top_p (at least the most likely token). Dropped entries are -inf."""
    x = logits.float() / temperature
    if top_k:
        k = min(int(top_k), x.shape[-1])
        kth = torch.topk(x, k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        srt, idx = torch.sort(x, descending=False, dim=-1)
        drop = srt.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[..., -1:] = False                          # the most likely token stays
        x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return x


def next_token(logits: torch.Tensor, do_sample: bool, temperature: float = 1.0, top_k=None, top_p=None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row from its logits [B, vocab]: the argmax (greedy; the lowest index among equal
    maxima), or with ``do_sample`` a draw from softmax(:func:`warp_logits`). Returns int64 [B]."""
    if not do_sample:
        return logits.float().argmax(dim=-1)
    p = warp_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(p, 1, generator=generator)[:, 0]


def generate(m, input_ids, *, max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
             top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, attention_mask=None, streamer=None,
             generator=None, chunk_tokens=None, timings: dict | None = None):
    """See CompiledModule.generate."""
    import time
    where = f"{m.graph.name}: generate"
    ids = _ids(m, input_ids, where)
    B, T = ids.shape
    max_new_tokens = _pos_int(f"{where}: max_new_tokens", max_new_tokens, lo=0)
    _check_sampling(do_sample, temperature, top_k, top_p, where)
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, numbers.Integral)
                                           else list(eos_token_id))
    vocab = int(m.graph.type_of(m.graph.outputs[0]).shape[-1])
    if any(isinstance(e, bool) or not isinstance(e, numbers.Integral) or not 0 <= e < vocab for e in eos):
        raise MtcError(f"{where}: eos_token_id must be a token id (or a list of them) in [0, {vocab}), got "
                       f"{eos_token_id!r}")
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    # the prompt of each row: where attention_mask is 1 (one run of ones, padding on either side), else all of it
    if attention_mask is not None:
        am = attention_mask
        if not isinstance(am, torch.Tensor) or tuple(am.shape) != (B, T):
            raise MtcError(f"{where}: attention_mask must be a [B, T] = {[B, T]} tensor of 0 / 1")
        am = am.to(torch.bool)
        prompts = []
        for b in range(B):
            pos = torch.nonzero(am[b]).flatten().tolist()
            if pos and pos[-1] - pos[0] + 1 != len(pos):
                raise MtcError(f"{where}: attention_mask row {b} has holes: its ones must be one run (padding on the "
                               f"left or the right)")
            prompts.append(ids[b, pos[0]:pos[-1] + 1] if pos else ids[b, :0])
    else:
        prompts = [ids[b] for b in range(B)]
    if any(p.numel() == 0 for p in prompts):
        raise MtcError(f"{where}: empty prompt (row {next(b for b, p in enumerate(prompts) if p.numel() == 0)}): "
                       f"generate needs at least one token per row to condition on")
    if max_new_tokens == 0:
        return ids.clone()
    lens = [p.numel() for p in prompts]
    packed = torch.zeros(B, max(lens), dtype=ids.dtype, device=ids.device)
    for b, p in enumerate(prompts):
        packed[b, :lens[b]] = p
    cache = new_cache(m, B, max(lens) + max_new_tokens)
    if streamer is not None and hasattr(streamer, "put"):
        streamer.put(ids.cpu())
    t0 = time.perf_counter()
    logits = prefill(m, packed, cache, lengths=lens, chunk_tokens=chunk_tokens, logits="last")
    t1 = time.perf_counter()
    new = []
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=ids.device)
    for i in range(max_new_tokens):
        tok = next_token(logits[:, -1], do_sample, float(temperature), top_k, top_p, generator)
        tok = torch.where(done, torch.full_like(tok, pad), tok)
        new.append(tok)
        if streamer is not None:
            streamer.put(tok.cpu()) if hasattr(streamer, "put") else streamer(tok)
        if eos:
            done = done | torch.isin(tok, eos_t)
            if bool(done.all()):
                break
        if i + 1 < max_new_tokens:
            logits = decode(m, tok[:, None], cache)
    t2 = time.perf_counter()
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    if timings is not None:
        timings.update(prefill_s=t1 - t0, decode_s=t2 - t1, prefill_tokens=sum(lens),
                       decode_steps=max(0, len(new) - 1))
    return torch.cat([ids, torch.stack(new, dim=1)], dim=1) if new else ids.clone()
