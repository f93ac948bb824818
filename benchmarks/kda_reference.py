"""CPU benchmark: the reference kda_chunk (backends/reference/kda.py), all chunks at once, against the loop over
chunks it replaced (issue 34 item 6; the old function is kept in this script only, as ``old_kda_chunk``).

kda_chunk alone: q, k L2-normalised, g = -5 sigmoid(randn) float32, beta uniform (0, 1), float32 throughout, at
B = 8, T = 128, H = 3, K = V = 32 (the KDA layer of examples/hybrid_tiny.mtc at its training shape) and B = 8,
T = 4096, H = 4, K = V = 32. Rows: forward with autograd recording (as in training), forward + backward of the sum
of o * w (w fixed random), forward under torch.no_grad. Median wall seconds of --repeats runs after one warm-up,
torch on --threads threads (default 2, a laptop's). "diff": the relative RMS difference between the two of o (and
of the gradients of q, k, v, g, beta, the largest).

End to end: --steps training steps (AdamW, lr 1e-3, next-token cross-entropy on random tokens, the same data for
every run) of examples/hybrid_tiny.mtc (4 KDA + 2 MLA layers, target reference, float32, B = 8, T = 128) with the
new and with the old kda_chunk (--old-steps of them), and of the same model with MLA on every layer (the all-MLA
model of the same size); seconds per step (median over the steps after the first) and the whole run, and the loss
of the first and of the last step (old and new: the first equal up to float rounding; later steps drift apart, the
rounding differences amplified by AdamW's normalised steps and the routers' discrete top-k choices).

Usage: python benchmarks/kda_reference.py [--threads 2] [--clock wall|cpu] [--repeats 3] [--steps 50]
                                          [--old-steps 50] [--quick] [--out benchmarks/results/kda_reference.md]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import backends.reference as R  # noqa: E402
from backends.reference import kda as K  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_CHUNK = 64
#: the clock (--clock): time.perf_counter (wall) or time.process_time (CPU seconds of this process, all threads)
clock = time.perf_counter


def _old_chunk_one(q, k, v, g, beta, S, scale):
    """The replaced reference (main before issue 34 item 6): one sequence, all heads, a Python loop over chunks of
    64. q, k, g [H, L, K]; v [H, L, V]; beta [H, L]; S [H, K, V] float32. Returns (o [H, L, V], S_final)."""
    H, L, _ = q.shape
    outs = []
    for s in range(0, L, OLD_CHUNK):
        e = min(s + OLD_CHUNK, L)
        c = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        dt = q.dtype
        G = torch.cumsum(g[:, s:e].double(), dim=1)
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        diff = G[:, :, None, :] - G[:, None, :, :]
        decay = torch.exp(torch.where(causal[None, :, :, None], diff, torch.full_like(diff, float("-inf")))).to(dt)
        Akk = torch.einsum("hik,hjk,hijk->hij", kc, kc, decay) * bc[:, :, None]
        Akk = Akk.tril(-1)
        P = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay) * scale
        eG = G.exp().to(dt)
        rhs = bc[:, :, None] * (vc - (kc * eG) @ S)
        eye = torch.eye(c, dtype=dt, device=q.device)
        W = torch.linalg.solve_triangular(eye + Akk, rhs, upper=False, unitriangular=True)
        outs.append(scale * (qc * eG) @ S + P @ W)
        Glast = G[:, -1:, :]
        S = Glast.transpose(1, 2).exp().to(dt) * S + (kc * (Glast - G).exp().to(dt)).transpose(1, 2) @ W
    o = torch.cat(outs, dim=1) if outs else q.new_zeros(H, 0, v.shape[-1])
    return o, S


def old_kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, lower_bound=None, segment_chunks=None, check_finite=None):
    """The replaced reference kda_chunk, the same checks (shared with the new one) around _old_chunk_one."""
    where = "kda_chunk"
    B, T, H, Kd, V, bounds, n_seq = K._validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, where)
    K.check_inputs_finite_and_decay(q, k, v, g, beta, where)
    K.check_lower_bound_kept(g, lower_bound, where)
    scale = Kd ** -0.5 if scale is None else float(scale)
    f32 = torch.float32
    qf, kf, vf, gf = (t.to(f32).transpose(1, 2) for t in (q, k, v, g))
    bf = beta.to(f32).transpose(1, 2)
    bounds_b = [(b, 0, T) for b in range(B)] if bounds is None else [(0, s, e) for (s, e) in bounds]
    o_parts, states = [], []
    for n, (b, s, e) in enumerate(bounds_b):
        S0 = (initial_state[n].to(f32) if initial_state is not None
              else torch.zeros(H, Kd, V, dtype=f32, device=q.device))
        o_n, S_n = _old_chunk_one(qf[b, :, s:e], kf[b, :, s:e], vf[b, :, s:e], gf[b, :, s:e], bf[b, :, s:e],
                                  S0, scale)
        o_parts.append(o_n)
        states.append(S_n)
    o = torch.stack(o_parts, 0) if bounds is None else torch.cat(o_parts, dim=1)[None]
    o = o.transpose(1, 2).to(v.dtype).contiguous()
    final = torch.stack(states, 0) if output_final_state else None
    K.check_result_finite(o, final, k, beta, where)
    return o, final


def rel_rms(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _median_time(fn, repeats: int) -> float:
    fn()                                                          # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def op_rows(shapes, repeats: int, old_max_tokens: int) -> list[dict]:
    rows = []
    for B, T, H, Kd, V in shapes:
        gen = torch.Generator().manual_seed(0)
        q = F.normalize(torch.randn(B, T, H, Kd, generator=gen), dim=-1)
        k = F.normalize(torch.randn(B, T, H, Kd, generator=gen), dim=-1)
        v = torch.randn(B, T, H, V, generator=gen)
        g = -5 * torch.sigmoid(torch.randn(B, T, H, Kd, generator=gen))
        beta = torch.rand(B, T, H, generator=gen)
        w = torch.randn(B, T, H, V, generator=gen)
        ins = [t.requires_grad_() for t in (q, k, v, g, beta)]
        res = {}
        for name, fn in (("new", R.kda_chunk), ("old", old_kda_chunk)):
            if name == "old" and B * T > old_max_tokens:
                continue

            def fwd():
                return fn(*ins)[0]

            def fwd_bwd():
                for t in ins:
                    t.grad = None
                (fwd() * w).sum().backward()

            def nograd():
                with torch.no_grad():
                    fwd()
            r = {"fwd": _median_time(fwd, repeats), "fwd_bwd": _median_time(fwd_bwd, repeats),
                 "nograd": _median_time(nograd, repeats)}
            fwd_bwd()
            r["o"] = fwd().detach()
            r["grads"] = [t.grad.clone() for t in ins]
            res[name] = r
            print(f"B={B} T={T} H={H} {name}: fwd {r['fwd']:.4f} s, fwd+bwd {r['fwd_bwd']:.4f} s, "
                  f"no_grad {r['nograd']:.4f} s", flush=True)
        row = {"shape": (B, T, H, Kd, V), **{f"{n}_{m}": res[n][m] for n in res for m in ("fwd", "fwd_bwd", "nograd")}}
        if "old" in res:
            row["diff_o"] = rel_rms(res["new"]["o"], res["old"]["o"])
            row["diff_grad"] = max(rel_rms(a, b) for a, b in zip(res["new"]["grads"], res["old"]["grads"]))
        rows.append(row)
    return rows


def _all_mla_spec() -> str:
    text = open(os.path.join(ROOT, "examples", "hybrid_tiny.mtc")).read()
    new, n = re.subn(r"attn = mla if i % 3 == 0 else kda", "attn = mla", text)
    if n != 1:
        raise SystemExit("examples/hybrid_tiny.mtc: its 'attn = mla if i % 3 == 0 else kda' line changed")
    fd, path = tempfile.mkstemp(suffix=".mtc")
    with os.fdopen(fd, "w") as f:
        f.write(new.replace("model hybrid_tiny", "model hybrid_tiny_all_mla"))
    return path


def train(spec: str, steps: int, B: int = 8, T: int = 128) -> dict:
    import dsl
    m = dsl.compile(dsl.load(spec), target="reference", seed=0).train()
    vocab = int(dict(m.graph.meta_get("config", ())).get("vocab", 512))
    params = sum(p.numel() for p in m.parameters())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    t_all = clock()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (B, T + 1), generator=gen)
        t0 = clock()
        logits = m(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(clock() - t0)
    total = clock() - t_all
    return {"steps": steps, "params": params, "step_s": statistics.median(times[1:] or times), "total_s": total,
            "loss_first": losses[0], "loss": losses[-1]}


def e2e_rows(steps: int, old_steps: int) -> list[dict]:
    spec = os.path.join(ROOT, "examples", "hybrid_tiny.mtc")
    rows = []
    rows.append({"model": "hybrid_tiny, new reference kda_chunk", **train(spec, steps)})
    print(rows[-1], flush=True)
    if old_steps:
        new_fn = R.kda_chunk
        R.kda_chunk = old_kda_chunk                 # (the reference target's impl calls R.kda_chunk)
        try:
            rows.append({"model": "hybrid_tiny, old reference kda_chunk", **train(spec, old_steps)})
        finally:
            R.kda_chunk = new_fn
        print(rows[-1], flush=True)
    mla = _all_mla_spec()
    try:
        rows.append({"model": "all-MLA hybrid_tiny (MLA on every layer)", **train(mla, steps)})
    finally:
        os.unlink(mla)
    print(rows[-1], flush=True)
    return rows


def table(ops: list[dict], e2e: list[dict], threads: int, repeats: int, clock_name: str) -> str:
    what = "wall seconds" if clock_name == "wall" else "CPU seconds of the process"
    out = [f"CPU, torch {torch.__version__}, {threads} thread(s), float32, {what}; kda_chunk alone: median of "
           f"{repeats} after a warm-up.", "",
           "| B, T, H, K, V | pass | old (loop over chunks of 64) | new (all chunks at once) | speed-up | "
           "diff o / grads |", "|---|---|---|---|---|---|"]
    for r in ops:
        sh = ", ".join(str(x) for x in r["shape"])
        for m, label in (("fwd", "forward (autograd on)"), ("fwd_bwd", "forward + backward"),
                         ("nograd", "forward, no_grad")):
            old, new = r.get(f"old_{m}"), r[f"new_{m}"]
            diff = (f"{r['diff_o']:.1e} / {r['diff_grad']:.1e}" if "diff_o" in r and m == "fwd_bwd" else "")
            old_s = f"{old:.4f}" if old is not None else "not run"
            speed = f"{old / new:.1f}x" if old is not None else ""
            out.append(f"| {sh} | {label} | {old_s} | {new:.4f} | {speed} | {diff} |")
    out += ["", "End to end: training steps of B = 8, T = 128 (AdamW, random tokens, the same data every run).", "",
            "| model | parameters | steps | s / step (median) | whole run, s | loss at step 1 | at the last step |",
            "|---|---|---|---|---|---|---|"]
    for r in e2e:
        out.append(f"| {r['model']} | {r['params']:,} | {r['steps']} | {r['step_s']:.3f} | {r['total_s']:.1f} | "
                   f"{r['loss_first']:.7f} | {r['loss']:.7f} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: time.perf_counter; cpu: time.process_time (steadier on a shared machine, 1 thread)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--old-steps", type=int, default=50)
    ap.add_argument("--old-max-tokens", type=int, default=1 << 16, help="skip the old kda_chunk above B*T tokens")
    ap.add_argument("--quick", action="store_true", help="T = 128 only, 1 repeat, 3 training steps")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    global clock
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    shapes = [(8, 128, 3, 32, 32), (8, 4096, 4, 32, 32)]
    if a.quick:
        shapes, a.repeats, a.steps, a.old_steps = shapes[:1], 1, 3, min(a.old_steps, 3)
    ops = op_rows(shapes, a.repeats, a.old_max_tokens)
    e2e = e2e_rows(a.steps, a.old_steps)
    text = table(ops, e2e, a.threads, a.repeats, a.clock)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
