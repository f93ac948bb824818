"""Inference at a million tokens (issue 35): chunked prefill against its memory plan, and decode ms/token of the
hybrid (KDA + MLA) beside its full-attention twin (MLA on every layer) at growing context, on one GPU.

1. Prefill: `small` (1.5 B parameters; target triton, bf16, B = 1) over --prefill-tokens (default 1,048,576)
   in chunks (--chunk-tokens, default backends.inference.default_chunk_tokens), logits="last": seconds,
   tokens/s, and torch.cuda.max_memory_allocated() over the call beside the plan: the weights and the cache (both
   allocated before) plus backends.inference.prefill_bytes (the inference program's plan at one chunk and the
   largest MLA layer's per-head K / V at max_len). The goal: measured within 10% of the plan.
2. Decode: for each context L (--contexts, default 8K 64K 256K 1M) a cache that holds L tokens (filled with
   synthetic values: a decode step's time does not depend on them, and a real prefill of the twin at 1M takes
   minutes), then --steps decode steps timed with CUDA events (median ms/token), for `small` and `small_full`;
   their ratio (the goal: the hybrid at least 3x faster at 1M; Kimi Linear reports 2.3x at batch 1).
3. The K3-width slice (--k3-slice): kimi_k3 with n_layers=4, experts=64 (3 KDA + 1 MLA layers at d = 7168) and
   its twin (mla_every=1) at the largest context.
4. Per-layer decode launches at the largest context: each launch of one decode step timed alone (synchronised),
   summed per layer kind (the KDA layer's conv / gate / kda_step / norms; the MLA layer's attention over the
   latent cache), beside its byte floor: the KDA state read and written once (H K V 4 bytes, twice) and the MLA
   latent cache read once (L (kv_lora_rank + qk_rope_dim) bytes of the dtype), at the copy bandwidth measured here.

What decode runs today: the inference program's launches one by one (no fused KDA decode kernel, no CUDA graph:
issue 35 item 4), kda_step per KDA layer, and the MLA core in the absorbed form (W_UK folded into the query in
torch, the attention over the latent cache as the split-T Triton kernel backends/triton/mla_decode.py, not tuned
on a GPU yet, W_UV after in torch; backends/inference.py _attend).

Usage (a CUDA GPU):  python benchmarks/generate.py [--variant small] [--prefill-tokens 1048576]
                     [--chunk-tokens N] [--contexts 8192 65536 262144 1048576] [--steps 20] [--k3-slice]
                     [--json FILE]
                     python benchmarks/generate.py --quick       # CPU smoke run: tiny, reference, small sizes
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                                 # run from anywhere, installed or not


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timer(dev):
    """A function returning seconds since its previous call, device-synchronised."""
    last = [None]

    def lap():
        _sync(dev)
        now = time.perf_counter()
        out = None if last[0] is None else now - last[0]
        last[0] = now
        return out
    return lap


def compile_model(spec, variant, target, dtype, device, **sets):
    import dsl
    g = dsl.load(spec, variant=variant, **sets)
    return dsl.compile(g, target=target, dtype=dtype, device=device, seed=0).eval()


def prefill_run(m, tokens: int, chunk_tokens, dev) -> dict:
    from backends.inference import default_chunk_tokens, prefill_bytes
    cache = m.new_cache(1, tokens)
    chunk = chunk_tokens or default_chunk_tokens(m, cache, tokens)
    vocab = int(m.graph.type_of(m.graph.outputs[0]).shape[-1])
    ids = torch.randint(0, vocab, (1, tokens), device=dev)
    warm = m.new_cache(1, min(tokens, 2 * chunk))          # kernels compiled, allocator warm
    m.prefill(ids[:, :warm.max_len], warm, chunk_tokens=chunk, logits="last")
    del warm
    row = {"tokens": tokens, "chunk_tokens": chunk, "cache_bytes": cache.nbytes,
           "plan_bytes": prefill_bytes(m, cache, chunk)}
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        row["base_bytes"] = torch.cuda.memory_allocated(dev)   # weights + cache + ids
    lap = _timer(dev)
    lap()
    m.prefill(ids, cache, chunk_tokens=chunk, logits="last")
    row["seconds"] = lap()
    row["tokens_per_s"] = tokens / row["seconds"]
    if dev.type == "cuda":
        row["peak_over_base"] = torch.cuda.max_memory_allocated(dev) - row["base_bytes"]
        row["peak_vs_plan"] = row["peak_over_base"] / row["plan_bytes"]
    return row


def synthetic_cache(m, L: int, dev):
    """A cache of one row holding L tokens: latent and rope values N(0, 1) (the latent is an RMSNorm output), KDA
    states and conv inputs small random values."""
    cache = m.new_cache(1, L + 1)
    with torch.no_grad():
        for t in (*cache.latent.values(), *cache.rope.values()):
            t[:, :L].normal_()
        for t in (*cache.kda.values(), *cache.conv.values()):
            t.normal_(0, 0.05)
    cache.lengths = [L]
    return cache


def decode_ms(m, L: int, steps: int, dev) -> float:
    vocab = int(m.graph.type_of(m.graph.outputs[0]).shape[-1])
    tok = torch.randint(0, vocab, (1, 1), device=dev)
    times = []
    for i in range(steps + 2):
        cache = synthetic_cache(m, L, dev) if i == 0 else cache
        cache.lengths = [L]                                  # the same context every step
        lap = _timer(dev)
        lap()
        m.decode(tok, cache)
        dt = lap()
        if i >= 2:                                           # two warm-up steps
            times.append(dt)
    del cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return 1e3 * statistics.median(times)


def copy_bandwidth(dev) -> float:
    """Bytes/s of a device copy of 1 GiB (read + write counted)."""
    if dev.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    torch.cuda.synchronize(dev)
    return 2 * x.nbytes * 10 / (a.elapsed_time(b) / 1e3)


def per_layer(m, L: int, dev, bw: float) -> list[dict]:
    """Seconds of each launch of one decode step at context L, summed per layer and kind, with byte floors."""
    import backends.inference as inf
    from backends.inference import cache_layout
    lay = cache_layout(m)
    nodes = m.graph.node_map()
    times: dict = {}

    def timed(fn):
        def run(*a, **k):
            _sync(dev)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            _sync(dev)
            L_ = a[1] if fn is orig_sess else a[0]
            layer = _layer_of(m, nodes, L_)
            times[layer] = times.get(layer, 0.0) + time.perf_counter() - t0
            return out
        return run
    orig_launch, orig_sess = m._launch, inf._Session.launch
    cache = synthetic_cache(m, L, dev)
    vocab = int(m.graph.type_of(m.graph.outputs[0]).shape[-1])
    tok = torch.randint(0, vocab, (1, 1), device=dev)
    m.decode(tok, cache)                                     # warm
    cache.lengths = [L]
    m._launch = timed(orig_launch)
    inf._Session.launch = timed(orig_sess)
    try:
        m.decode(tok, cache)
    finally:
        del m._launch
        inf._Session.launch = orig_sess
    eb = torch.empty((), dtype=m.dtype).element_size()
    rows = []
    for layer, sec in sorted(times.items()):
        kind = "mla" if any(layer.startswith(s.layer) for s in lay.mla.values()) else (
            "kda" if any(layer.startswith(_prefix(m, n)) for n in lay.kda) else "other")
        floor = None
        if kind == "kda":
            s = next(lay.kda[n] for n in lay.kda if layer.startswith(_prefix(m, n)))
            floor = 2 * s.heads * s.k * s.v * 4 / bw
        elif kind == "mla":
            s = next(x for x in lay.mla.values() if layer.startswith(x.layer))
            floor = L * (s.rank + s.rope_dim) * eb / bw
        rows.append({"layer": layer, "kind": kind, "us": 1e6 * sec,
                     "floor_us": None if floor is None else 1e6 * floor,
                     "floor_fraction": None if floor is None else floor / sec})
    return rows


def _prefix(m, node_name: str) -> str:
    """'model.layers.N.self_attn' of a graph node, from the weights it reads (the layer's attention prefix)."""
    n = m.graph.node_map()[node_name]
    stack = [n]
    seen = set()
    while stack:
        x = stack.pop()
        if x.name in seen:
            continue
        seen.add(x.name)
        if x.op == "param" and ".layers." in x.attr("name"):
            return x.attr("name").rsplit(".", 2)[0].rsplit(".self_attn", 1)[0] + ".self_attn"
        stack += [m.graph.node_map()[r.node] for r in x.inputs]
    return "?"


def _layer_of(m, nodes, L) -> str:
    """The layer ('model.layers.N.self_attn', '.mlp', ...) a launch belongs to, from the weights it reads."""
    for r, _t in L.inputs:
        name = m._names.get(r.lstrip("%"))
        if name and ".layers." in name:
            parts = name.split(".")
            i = parts.index("layers")
            return ".".join(parts[:i + 3])
    return "(embedding, lm_head, views)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="small")
    p.add_argument("--prefill-tokens", type=int, default=1 << 20)
    p.add_argument("--chunk-tokens", type=int, default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 65536, 262144, 1 << 20])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--k3-slice", action="store_true", help="also kimi_k3 n_layers=4 experts=64 and its twin")
    p.add_argument("--json", help="write every row as JSON here")
    p.add_argument("--quick", action="store_true", help="CPU smoke run (tiny, reference, small sizes)")
    a = p.parse_args(argv)
    if a.quick:
        dev, target, dtype = torch.device("cpu"), "reference", torch.float32
        a.variant, a.prefill_tokens, a.contexts, a.steps = "tiny", 2048, [256, 1024], 3
    else:
        if not torch.cuda.is_available():
            print("benchmarks/generate.py needs a CUDA GPU (or --quick on the CPU)", file=sys.stderr)
            return 2
        dev, target, dtype = torch.device("cuda"), "triton", torch.bfloat16
    spec = os.path.join(ROOT, "models", "kimi_k3.mtc")
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "variant": a.variant}
    bw = copy_bandwidth(dev)
    out["copy_bandwidth"] = bw
    with torch.no_grad():
        m = compile_model(spec, a.variant, target, dtype, dev)
        out["prefill"] = prefill_run(m, a.prefill_tokens, a.chunk_tokens, dev)
        print(json.dumps(out["prefill"]), flush=True)
        twin = compile_model(spec, f"{a.variant}_full", target, dtype, dev)
        out["decode"] = []
        for L in a.contexts:
            row = {"context": L}
            for name, mod in (("hybrid", m), ("full", twin)):
                try:
                    row[f"{name}_ms"] = decode_ms(mod, L, a.steps, dev)
                except torch.OutOfMemoryError as e:
                    row[f"{name}_ms"] = None
                    row[f"{name}_oom"] = str(e).split("\n")[0][:160]
            if row.get("hybrid_ms") and row.get("full_ms"):
                row["full_over_hybrid"] = row["full_ms"] / row["hybrid_ms"]
            out["decode"].append(row)
            print(json.dumps(row), flush=True)
        out["per_layer"] = per_layer(m, max(a.contexts), dev, bw)
        del twin
        if a.k3_slice:
            sl = compile_model(spec, None, target, dtype, dev, n_layers=4, experts=64)
            sl_twin = compile_model(spec, None, target, dtype, dev, n_layers=4, experts=64, mla_every=1)
            L = max(a.contexts)
            out["k3_slice"] = {"context": L, "hybrid_ms": decode_ms(sl, L, a.steps, dev),
                               "full_ms": decode_ms(sl_twin, L, a.steps, dev),
                               "per_layer": per_layer(sl, L, dev, bw)}
            out["k3_slice"]["full_over_hybrid"] = out["k3_slice"]["full_ms"] / out["k3_slice"]["hybrid_ms"]
    _table(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _table(out: dict) -> None:
    pf = out["prefill"]
    print(f"\n## {out['variant']} on {out['device']}\n")
    peak = (f"{pf['peak_over_base'] / 2**30:.2f} GiB over weights + cache, plan {pf['plan_bytes'] / 2**30:.2f} GiB "
            f"({pf['peak_vs_plan']:.3f}x)" if "peak_over_base" in pf else f"plan {pf['plan_bytes'] / 2**30:.3f} GiB")
    print(f"prefill {pf['tokens']:,} tokens in chunks of {pf['chunk_tokens']:,}: {pf['seconds']:.1f} s, "
          f"{pf['tokens_per_s']:,.0f} tokens/s; cache {pf['cache_bytes'] / 2**30:.2f} GiB; {peak}\n")
    print("| context | hybrid ms/token | full-attention twin ms/token | twin / hybrid |")
    print("|---:|---:|---:|---:|")
    for r in out["decode"]:
        f = lambda v: "OOM" if v is None else f"{v:.2f}"     # noqa: E731
        print(f"| {r['context']:,} | {f(r.get('hybrid_ms'))} | {f(r.get('full_ms'))} | "
              f"{r.get('full_over_hybrid', float('nan')):.2f}x |")
    for title, rows in (("per layer, one decode step", out.get("per_layer", [])),
                        ("K3-width slice, per layer", out.get("k3_slice", {}).get("per_layer", []))):
        if rows:
            print(f"\n{title} (copy bandwidth {out['copy_bandwidth'] / 1e12:.2f} TB/s)\n")
            print("| layer | kind | us | byte floor us | floor / time |")
            print("|---|---|---:|---:|---:|")
            for r in rows:
                if r["kind"] == "other":
                    continue
                fl = "" if r["floor_us"] is None else f"{r['floor_us']:.1f}"
                fr = "" if r["floor_fraction"] is None else f"{r['floor_fraction']:.3f}"
                print(f"| {r['layer']} | {r['kind']} | {r['us']:.1f} | {fl} | {fr} |")
            rest = sum(r["us"] for r in rows if r["kind"] == "other")
            print(f"| everything else (norms, AttnRes, FFN / MoE, embedding, LM head) | | {rest:.1f} | | |")
    if "k3_slice" in out:
        k = out["k3_slice"]
        print(f"\nK3-width slice at {k['context']:,}: hybrid {k['hybrid_ms']:.2f} ms/token, twin {k['full_ms']:.2f} "
              f"ms/token, {k['full_over_hybrid']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
