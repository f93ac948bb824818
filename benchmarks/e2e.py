"""End-to-end forward throughput of a K3-family model: mtc target="triton" beside the same model written the way a
competent PyTorch user would write it (eager, bf16, fla-core 0.6.0's kernels where fla has the op, the MoE experts
on torch._grouped_mm) and beside torch.compile of that eager model. One process, the same weights, bf16, B = 1.

The eager baseline is the same graph (passes verify, infer_shapes, canonicalize: no mtc fusion, no two-phase
AttnRes) run op by op on a benchmark target of its own, "eager_fla" (chain eager_fla -> eager -> reference,
backends/registry.py), whose implementations are registered below:
  eager      F.embedding, F.linear (cuBLAS), F.rms_norm, F.silu, torch.sigmoid, plain torch for add / mul / l2norm /
             the SiTU-GLU and the KDA gate, a depthwise F.conv1d for short_conv, F.scaled_dot_product_attention
             (is_causal; v zero-padded to the q/k head dim so one fused flash kernel runs, as HF's DeepSeek-V3 does),
             the router in float32 (sigmoid scores + bias, torch.topk, renormalised unbiased weights x
             routed_scaling), and the routed experts as grouped GEMMs: tokens sorted by expert, torch._grouped_mm
             for w1|w3 (one [E, 2I, l] weight, fused once per weight version: the layout a PyTorch MoE keeps), the
             SiTU-GLU, torch._grouped_mm for w2, then the weighted combine (index_copy back to token order, sum
             over the k picks).
  eager_fla  fla-core 0.6.0: chunk_kda (safe_gate=True, lower_bound = the node's), fused_kda_gate, causal_conv1d
             (short_conv), l2norm, fused_attnres (attn_residual). Their fused variants that would swallow a
             neighbouring graph op (fused_attnres' output_rms_weight, chunk_kda's in-kernel l2norm / gate, the
             conv's SiLU) are not used: each graph op is one call, and torch.compile is the row that fuses.
Views and concat run the ops every target shares; kda_chunk / attn_residual have no plain-torch form here, so
without fla (--cpu-smoke) they run the reference's (the table names that row so). Every eager implementation
equals the reference op in float32 (tests/test_e2e_baseline.py on the CPU; the fla ones with -m gpu).

Columns: tokens/s (median of CUDA-event timings), the achieved TFLOP/s (mtc stats' FLOPs per token at that T:
matmuls, attention with its causal half, KDA) and its fraction of the H200's 720 TFLOP/s bf16 matmul peak, the
relative RMS difference of the logits against a float32 reference (the same graph, target="reference", float32,
same weights) and against the eager model, and the speed-up of mtc over each baseline (last lines).

Tolerance: a routed MoE at random initialisation has near-tied router scores, so bf16 rounding of the hidden
state flips some top-k choices and the logits of ANY bf16 implementation move far from float32 (the small
variant on the CPU, reference ops: 0.85 after 12 layers, the first MoE layer's output alone 0.19).  The bf16
yardstick is therefore the eager model's own error against the float32 reference: mtc's should be of the same
size.

The eager model runs as PlainModel: the eager target's KernelProgram, one implementation call per launch and
nothing around it (no input checks, memory accounting, routing statistics or host syncs: mtc's runtime has those,
a hand-written model does not), which is also what lets torch.compile trace it in few graphs (through a
CompiledModule dynamo breaks the graph at every launch's memory accounting). mtc's row is its CompiledModule, runtime
included. --runtime-eager adds the eager program under mtc's runtime, which measures that runtime's cost.

Usage (a CUDA GPU and fla-core 0.6.0; benchmarks/README.md):
    python benchmarks/e2e.py [--variant small] [--quick] [--seq-lens 8192 65536] [--no-compile] [--no-ref32]
                             [--out benchmarks/results/e2e.md]
    python benchmarks/e2e.py --cpu-smoke      (tiny variant, float32, Triton interpreter: the control flow only)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the H200's dense bf16 matmul peak (TFLOP/s), the yardstick of the TFLOP/s column
PEAK_TFLOPS = 720.0
EAGER, EAGER_FLA = "eager", "eager_fla"


# -- the eager baseline: plain PyTorch, registered as a benchmark target ------------------------------------------
def _glu(a, b, activation, beta_gate, beta_up):
    """SiTU-GLU (spec/OPS.md situ_glu) or SwiGLU, in the operands' dtype."""
    if activation == "silu":
        return F.silu(a) * b
    return (beta_gate * torch.tanh(a / beta_gate) * torch.sigmoid(a)) * (beta_up * torch.tanh(b / beta_up))


def _short_conv(c, x, w):
    """Causal depthwise conv over time, width W: y[t] = sum_j w[c, j] x[t - W + 1 + j] (zeros before t = 0)."""
    C = w.shape[0]
    w = w.reshape(C, 1, -1).to(x.dtype)
    y = F.conv1d(F.pad(x.transpose(1, 2), (w.shape[-1] - 1, 0)), w, groups=C)
    return y.transpose(1, 2)


def _kda_gate(c, x, A_log, dt_bias):
    """g = lower_bound * sigmoid(exp(A_log) (x + dt_bias)) (or -exp(A_log) softplus(x + dt_bias)), float32."""
    H, K = x.shape[-2:]
    z = x.float() + dt_bias.float().view(H, K)
    a = A_log.float().exp().view(H, 1)
    if c.attr("gate") == "sigmoid":
        return float(c.attr("lower_bound")) * torch.sigmoid(a * z)
    return -a * F.softplus(z)


def _mla_attention(c, q, k, v):
    """softmax(q k^T scale + causal mask) v by torch's fused SDPA; the smaller head dim zero-padded to the larger
    (zero columns change no dot product), so that one flash kernel takes Dqk 192 / Dv 128."""
    dv = v.shape[-1]
    d = max(q.shape[-1], dv)
    q, k, v = (F.pad(t, (0, d - t.shape[-1])) if t.shape[-1] < d else t for t in (q, k, v))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=bool(c.attr("causal")), scale=float(c.attr("scale")))
    return o.transpose(1, 2)[..., :dv]


def _qb_route(c, x, weight, bias):
    """Sigmoid router with a selection-only bias: scores in float32, top-k of scores + bias, the chosen unbiased
    scores renormalised to sum 1, times routed_scaling."""
    scores = torch.sigmoid(F.linear(x.float(), weight.float()))
    idx = torch.topk(scores + bias.float(), c.attr("top_k"), dim=-1, sorted=True).indices
    w = scores.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True) * float(c.attr("routed_scaling")), scores


#: the routed experts' [E, 2I, l] w1|w3, fused once per weight (id -> (w1, w3, w13, versions)): the one-tensor
#  layout a PyTorch MoE keeps its gate and up projections in.  Used only where autograd does not record.
_W13: dict[int, tuple] = {}


def _w13(w1, w3):
    if torch.is_grad_enabled() and (w1.requires_grad or w3.requires_grad):
        return torch.cat([w1, w3], dim=1)
    hit = _W13.get(id(w1))
    if torch.compiler.is_compiling():        # (no _version under dynamo: a cached entry, else the concatenation)
        return hit[2] if hit is not None and hit[0] is w1 and hit[1] is w3 else torch.cat([w1, w3], dim=1)
    ver = (w1._version, w3._version)
    if hit is None or hit[0] is not w1 or hit[1] is not w3 or hit[3] != ver:
        hit = (w1, w3, torch.cat([w1, w3], dim=1), ver)
        _W13[id(w1)] = hit
    return hit[2]


def _grouped_mm(a, b, offs):
    """torch._grouped_mm(a [M, K], b [G, K, N], offs int32 [G], cumulative row ends) -> [M, N]; on a CPU torch
    without it, one matmul per group."""
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=offs)
    try:
        return torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError, AttributeError):
        out, start = a.new_empty(a.shape[0], b.shape[-1]), 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ b[g]
            start = end
        return out


def _moe_experts(c, x, idx, wt, w1, w3, w2):
    """u[n] = sum_k wt[n, k] w2[e] glu(w1[e] x[n], w3[e] x[n]), e = idx[n, k], as grouped GEMMs over the
    token-expert pairs sorted by expert."""
    N, l = x.shape
    k = idx.shape[1]
    E, I = w1.shape[:2]
    experts, order = torch.sort(idx.reshape(-1), stable=True)
    offs = torch.searchsorted(experts, torch.arange(E, device=x.device, dtype=experts.dtype), right=True)
    offs = offs.to(torch.int32)
    xs = x.index_select(0, order // k)                                           # [N k, l], by expert
    h = _grouped_mm(xs, _w13(w1, w3).transpose(1, 2), offs)                     # [N k, 2I]
    h = _glu(h[:, :I], h[:, I:], c.attr("activation"), c.attr("beta_gate"), c.attr("beta_up"))
    y = _grouped_mm(h, w2.transpose(1, 2), offs)                                 # [N k, l]
    y = y * wt.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return y.new_empty(N * k, l).index_copy_(0, order, y).view(N, k, l).sum(1)


def _add(c, a, b):
    y = a + b
    return y if y.dtype == a.dtype else y.to(a.dtype)


def _mul(c, a, b):
    y = a * b
    return y if y.dtype == a.dtype else y.to(a.dtype)


def _situ_glu(c, a, b):
    return _glu(a, b, "situ", c.attr("beta_gate"), c.attr("beta_up"))


def _l2norm(c, x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + c.attr("eps"))


_EAGER_IMPLS = {
    "embedding": lambda c, ids, w: F.embedding(ids, w),
    "linear": lambda c, x, w: F.linear(x, w.to(x.dtype)),
    "lm_head": lambda c, x, w: F.linear(x, w.to(x.dtype)),
    "rmsnorm": lambda c, x, w: F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), c.attr("eps")),
    "l2norm": _l2norm,
    "short_conv": _short_conv,
    "silu": lambda c, x: F.silu(x),
    "sigmoid": lambda c, x: torch.sigmoid(x),
    "add": _add,
    "mul": _mul,
    "situ_glu": _situ_glu,
    "kda_gate": _kda_gate,
    "mla_attention": _mla_attention,
    "qb_route": _qb_route,
    "moe_experts": _moe_experts,
}


def _fla_impls():
    """fla-core's kernels for the ops it has (ImportError without fla)."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.l2norm import l2norm
    from fla.ops.attnres import fused_attnres
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.gate import fused_kda_gate

    def kda_chunk(c, q, k, v, g, beta):
        lb = c.attr("lower_bound")
        safe = lb is not None and -5.0 <= float(lb) < 0.0      # fla's safe-gate range (bounded g on the M=16 path)
        return chunk_kda(q, k, v, g, beta, scale=c.attr("scale"), safe_gate=safe,
                         lower_bound=float(lb) if safe else None)[0]

    def kda_gate(c, x, A_log, dt_bias):
        lb = float(c.attr("lower_bound")) if c.attr("gate") == "sigmoid" else None
        return fused_kda_gate(x, A_log, dt_bias, lower_bound=lb, output_dtype=torch.float32)

    return {
        "kda_chunk": kda_chunk,
        "kda_gate": kda_gate,
        "short_conv": lambda c, x, w: causal_conv1d(x, w.reshape(w.shape[0], -1).to(x.dtype), activation=None)[0],
        "l2norm": lambda c, x: l2norm(x, eps=c.attr("eps")),
        "attn_residual": lambda c, q, w, *src: fused_attnres(q, list(src), w, rms_eps=c.attr("eps")),
    }


_REGISTERED: set[str] = set()


def register(fla: bool) -> str:
    """Declare and fill the benchmark targets: "eager" (plain PyTorch; the rest falls back to the reference) and,
    with ``fla``, "eager_fla" (fla-core's kernels first, then "eager"). Returns the target to compile for. Once per
    process (later calls return at once); ImportError without fla-core when ``fla``."""
    from backends.registry import impl, register_target
    if EAGER not in _REGISTERED:
        register_target(EAGER, (EAGER, "reference"))
        for op, fn in _EAGER_IMPLS.items():
            impl(EAGER, op)(fn)
        _REGISTERED.add(EAGER)
    if not fla:
        return EAGER
    if EAGER_FLA not in _REGISTERED:
        impls = _fla_impls()
        register_target(EAGER_FLA, (EAGER_FLA, EAGER, "reference"))
        for op, fn in impls.items():
            impl(EAGER_FLA, op, name=f"fla.{op}")(fn)
        _REGISTERED.add(EAGER_FLA)
    return EAGER_FLA


class _Ctx:
    """What an implementation reads of its launch: the node's attributes and, at the planned input sizes, the
    concrete shape its ``shape`` attribute (reshape, broadcast) names."""

    __slots__ = ("node", "attrs", "shapes", "in_types", "loc")

    def __init__(self, node, in_types, bind):
        from dsl.ir import dim
        self.node, self.in_types, self.loc = node, in_types, node.loc
        self.attrs = dict(node.attr_dict)
        s = self.attrs.get("shape")
        self.shapes = {} if s is None else {tuple(s): [int(dim(d).subs(bind)) for d in s]}

    def attr(self, key, default=None):
        return self.attrs.get(key, default)

    def shape(self, dims):
        return self.shapes[tuple(dims)]


class PlainModel(torch.nn.Module):
    """The eager baseline as a plain PyTorch model: the inference program of a CompiledModule compiled for the
    eager target, one implementation call per launch, in order, each value dropped after its last use, and nothing
    else: no input checks, memory accounting, routing statistics or host syncs of mtc's runtime (a hand-written
    module over the same ops has none of them), so torch.compile traces straight through it. The weights are the
    module's own (``m``'s parameters and buffers). Input: token ids [B, T]; output: the logits."""

    def __init__(self, m):
        super().__init__()
        if len(m.graph.inputs()) != 1 or len(m.graph.outputs) != 1:
            raise ValueError("PlainModel: a graph with one input and one output")
        self.m = m
        self._plans: dict[tuple, tuple] = {}

    def _plan(self, shape: tuple):
        """(steps, input slot, output slot) of the program at input shape ``shape``: each step (fn, ctx, operands,
        output slots, slots freed after it); an operand is a slot number or a weight tensor."""
        from backends.registry import by_name
        m, g = self.m, self.m.graph
        nodes = g.node_map()
        inp = g.inputs()[0]
        bind = {d: s for d, s in zip(inp.type.shape, shape) if hasattr(d, "free_symbols") and d.free_symbols}
        slot: dict[str, int] = {str(inp.out()): 0}
        steps = []
        for L in m.program.launches:
            if L.generated is not None or len(L.ops) != 1:
                raise ValueError(f"PlainModel: launch {L.kernel} is a fused one; compile the eager target's "
                                 f"program (passes verify, infer_shapes, canonicalize)")
            operands = []
            for r, _t in L.inputs:
                if r in slot:
                    operands.append(slot[r])
                else:
                    key = nodes[r.lstrip("%").partition("#")[0]].attr("name")
                    try:
                        operands.append(m.get_parameter(key))
                    except AttributeError:
                        operands.append(m.get_buffer(key))
            outs = []
            for r, _t in L.outputs:
                slot[r] = len(slot)
                outs.append(slot[r])
            ctx = _Ctx(nodes[L.anchor], [t for _r, t in L.inputs], bind)
            steps.append((by_name(L.kernel).fn, ctx, operands, outs, [slot[r] for r in L.frees if r in slot]))
        return steps, len(slot), slot[str(g.outputs[0])]

    def forward(self, ids):
        plan = self._plans.get(tuple(ids.shape))
        if plan is None:
            # (planned outside any dynamo trace; torch.compiler is not touched at import: importing dynamo imports
            # triton, which must come after --cpu-smoke sets TRITON_INTERPRET)
            plan = self._plans[tuple(ids.shape)] = torch.compiler.disable(self._plan)(tuple(ids.shape))
        steps, n, out = plan
        vals = [None] * n
        vals[0] = ids
        for fn, ctx, operands, outs, frees in steps:
            y = fn(ctx, *[vals[a] if isinstance(a, int) else a for a in operands])
            if len(outs) == 1:
                vals[outs[0]] = y
            else:
                for s, v in zip(outs, y):
                    vals[s] = v
            for s in frees:
                vals[s] = None
        return vals[out]


# -- the benchmark ----------------------------------------------------------------------------------------------
def _time(m, ids, dev) -> float:
    """Seconds for one forward: CUDA events on the GPU, a wall clock on the CPU."""
    if dev == "cpu":
        t = time.perf_counter()
        m(ids)
        return time.perf_counter() - t
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    m(ids)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="small", help="variant of models/kimi_k3.mtc (default small)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536],
                    help="sequence lengths T, batch 1 (default 8192 65536)")
    ap.add_argument("--quick", action="store_true", help="T = 2048 only (replaces --seq-lens), few repeats")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--no-ref32", action="store_true", help="skip the float32 reference (error column left empty)")
    ap.add_argument("--out", default=None, help="write the table (markdown) here")
    ap.add_argument("--runtime-eager", action="store_true",
                    help="also time the eager program executed by mtc's runtime (CompiledModule: input checks, memory "
                         "accounting, routing statistics), beside the plain model")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check this script's control flow on the CPU: tiny variant, float32, Triton interpreter, "
                         "no fla (reference kda_chunk / attn_residual), no torch.compile (numbers meaningless)")
    args = ap.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("e2e benchmark: needs a CUDA GPU and fla-core (--cpu-smoke checks this script's control flow on "
                 "the CPU)")
    given = [f for f, d in (("--variant", "variant"), ("--seq-lens", "seq_lens")) if getattr(args, d) != ap.get_default(d)]
    if args.quick:
        if "--seq-lens" in given:
            print("note: --quick times T = 2048 only; --seq-lens is not used", flush=True)
        args.seq_lens = [2048]
    if args.cpu_smoke:
        import os
        if given:
            print(f"note: --cpu-smoke runs the tiny variant at T = 64; {' and '.join(given)} not used", flush=True)
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.variant, args.seq_lens, args.no_compile = "tiny", [64], True

    import dsl
    from passes.stats import compute_stats, human
    try:
        target = register(fla=not args.cpu_smoke)
    except ImportError as e:
        sys.exit(f"e2e benchmark: the eager baseline needs fla-core 0.6.0 (pip install fla-core==0.6.0): {e}")
    fla_version = "" if args.cpu_smoke else __import__("fla").__version__
    dev = "cpu" if args.cpu_smoke else "cuda"
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    g = dsl.load(ROOT / "models" / "kimi_k3.mtc", args.variant)
    t0 = time.perf_counter()
    mtc = dsl.compile(g, target="triton", dtype=dtype, device=dev).eval()
    eager_cm = dsl.compile(g, target=target, dtype=dtype, device=dev,
                           passes=["verify", "infer_shapes", "canonicalize"]).eval()
    eager_cm.load_state_dict(mtc.state_dict())
    eager = PlainModel(eager_cm).eval()
    from collections import Counter
    ran = Counter(L.kernel.partition(".")[0] for L in eager_cm.program.launches if not L.is_view)
    print(f"{g.name}: {human(sum(p.numel() for p in mtc.parameters()))} parameters; compiled in "
          f"{time.perf_counter() - t0:.1f} s; kernels: {mtc.kernel_source_path}\n"
          f"eager baseline ({target}{', fla-core ' + fla_version if fla_version else ''}): launches by backend "
          + ", ".join(f"{k} {v}" for k, v in ran.most_common()), flush=True)
    ref32 = None
    if not args.no_ref32:
        ref32 = dsl.compile(g, target="reference", dtype=torch.float32, device=dev,
                            passes=["verify", "infer_shapes", "canonicalize"]).eval()
        ref32.load_state_dict({k_: v_.float() if v_.is_floating_point() else v_
                               for k_, v_ in mtc.state_dict().items()})
    # (--cpu-smoke: kda_chunk and attn_residual run the reference ops, not fla's kernels: named so in the table)
    eager_name = "eager (cpu-smoke: reference kda_chunk, attn_residual)" if args.cpu_smoke else "eager + fla"
    models = {"mtc triton": mtc, eager_name: eager}
    if args.runtime_eager:
        models[f"{eager_name} in mtc's runtime"] = eager_cm
    if not args.no_compile:
        from torch import _dynamo
        # graph breaks at fla's compiler-disabled entry points (and whatever else dynamo cannot trace): let every
        # piece compile, for each T (dynamic=False)
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(_dynamo.config, knob):
                setattr(_dynamo.config, knob, 256)
        models[f"torch.compile({eager_name})"] = torch.compile(eager, dynamic=False)
    flops = {T: compute_stats(g, seq_len=T).flops_per_token for T in args.seq_lens}
    rows = []
    for T in args.seq_lens:
        print(f"T={T}: {flops[T] / 1e9:.3f} GFLOP per token (forward)", flush=True)
        ids = torch.randint(0, int(dict(g.meta_get("config", ()))["vocab"]), (1, T), device=dev)
        with torch.no_grad():
            ref = eager(ids).float()
            r32 = None
            if ref32 is not None:
                try:
                    r32 = ref32(ids).float()
                except torch.OutOfMemoryError:
                    print(f"T={T}: float32 reference out of memory; column left empty", flush=True)
                if dev == "cuda":
                    torch.cuda.empty_cache()
            for name, m in models.items():
                for _ in range(1 if args.cpu_smoke else 2):
                    out = m(ids)
                times = []
                for _ in range(1 if args.cpu_smoke else 3 if args.quick else 5):
                    times.append(_time(m, ids, dev))
                t = sorted(times)[len(times) // 2]
                err = ((out.float() - ref).norm() / ref.norm()).item()
                e32 = ((out.float() - r32).norm() / r32.norm()).item() if r32 is not None else None
                tflops = flops[T] * T / t / 1e12
                rows.append((T, name, t, T / t, tflops, e32, err))
                print(f"T={T:>6} {name:<30} {t * 1e3:9.1f} ms {T / t:12,.0f} tok/s {tflops:8.1f} TFLOP/s "
                      f"({tflops / PEAK_TFLOPS:6.1%} of {PEAK_TFLOPS:.0f})  err vs f32 {_e(e32)}  vs eager {err:.2e}",
                      flush=True)
            del r32
    lines = [f"| T | model | ms | tokens/s | TFLOP/s | % of {PEAK_TFLOPS:.0f} TFLOP/s | "
             f"logits rel. err vs float32 reference | vs {eager_name} |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {T} | {n} | {t * 1e3:.1f} | {tps:,.0f} | {tf:.1f} | {tf / PEAK_TFLOPS:.1%} | {_e(e32)} | {e:.2e} |"
              for T, n, t, tps, tf, e32, e in rows]
    lines.append("")
    lines += ["FLOPs per token (forward, mtc stats): " + ", ".join(f"T={T}: {flops[T] / 1e9:.3f} G"
                                                                    for T in args.seq_lens)]
    for T in args.seq_lens:
        r = {n: t for TT, n, t, *_ in rows if TT == T}
        lines.append(f"\nT={T}: mtc speed-up: " + ", ".join(f"{r[n] / r['mtc triton']:.2f}x vs {n}"
                                                            for n in r if n != "mtc triton"))
    text = "\n".join(lines)
    print(text)
    if args.out:
        where = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fla-core {fla_version}" if dev == "cuda"
                 else "CPU smoke run (Triton interpreter: the times and ratios mean nothing)")
        Path(args.out).write_text(f"# e2e forward, {g.name}, {str(dtype).removeprefix('torch.')}, B=1, {where}\n\n"
                                  f"{text}\n")


def _e(x):
    """An error cell: '-' where the float32 reference was not run (--no-ref32, or out of memory)."""
    return "-" if x is None else f"{x:.2e}"


if __name__ == "__main__":
    main()
