"""Benchmark: attn_residual (Block AttnRes) on the GPU, side by side with fla-core 0.6.0's fused_attnres.

Sections (one process, random bf16 data, d = 7168):
  1. the device-copy ceiling (torch copy of 4 GiB: bytes read + written over the median time);
  2. (--sweep) a sweep of our forward's launch settings (the pipelined kernel's warps, rows, sources per step,
     stages, programs per SM; N = --sweep-n) and of phase 1's and the merges' (acc float32 and bf16; --p1-bank);
     the best of each is used below and printed as "SWEEP RESULT" (the AttnResConfig fields to change in
     backends/triton/attn_residual/config.py);
  3. the main table: N in {16384, 65536} tokens x L in {2, 8, 16, 25} sources: median time
     (triton.testing.do_bench), effective TB/s (bytes = every source read once + the output written
     once), fraction of the measured copy and of 4.2 TB/s, TFLOP/s (6 flops per source element), and the
     relative-RMS error of both kernels against a chunked float32 reference (backends.reference);
  4. (N = 65536, L = 16: 7.5e9 source elements, past 2^32) fla's fused kernel vs fla's naive reference vs
     the chunked float32 reference, and which stage of the naive one goes wrong;
  5. one K3 block: 12 layers = 24 AttnRes reads of bank (B completed blocks) + the growing partial, each
     with its fused output norm: 24 separate fla calls vs our two-phase form (one phase 1 for all 24
     queries, then 24 merges), acc in float32 and in bf16, for every bank size in --banks; the floor column
     is the two-phase form's bytes at the copy rate over fla's time, and a last line sums the banks.
The last line is the geometric-mean speed ratio of ours over fla in the main table.
fla tunes over all 24 of its forward configs afresh for every row (--fla-pruned: 8 of them): its autotune key
holds L only as max(8, next power of two), so without the reset the first L <= 8 tuned in the process would
decide its config for every other L <= 8.

Run on a CUDA GPU with fla-core 0.6.0 installed (pip install fla-core==0.6.0; benchmarks/README.md):
  python benchmarks/attn_residual.py [--quick] [--sweep]
The one-run decision of the launch settings (forward sweep at N = 65536, phase 1, merges; ~2 min):
  python benchmarks/attn_residual.py --sweep --quick --out attn_residual_sweep.md
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere, installed or not

import torch
import triton

T = importlib.import_module("backends.triton.attn_residual")
R = importlib.import_module("backends.reference.attn_residual")

D = 7168
COPY_NOMINAL = 4.2e12
LINES: list[str] = []
OUT_PATH: list[str] = []      # where the table goes; rewritten after every line, so a run cut short keeps its part


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    if OUT_PATH:
        with open(OUT_PATH[0], "w") as f:
            f.write("\n".join(LINES) + "\n")


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def bench_graph(fn) -> float:
    """GPU time of one call without the host: fn captured once into a CUDA graph (after 3 warm-up calls on a
    side stream, so autotuning and table building happen outside the capture), then the replay timed like
    bench (L2 flushed before every replay). Small calls (L = 2 at N = 16384 is ~0.17 ms) otherwise also
    count the host's launch work whenever it outlasts the L2 flush queued before them. nan if the call
    cannot be captured (a host synchronisation inside it)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    except Exception as e:  # noqa: BLE001 - reported, the column shows nan
        print(f"(graph capture failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
        torch.cuda.synchronize()
        return float("nan")
    t = bench(g.replay)
    del g
    return t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.float()
    b = b.float()
    return ((a - b).norm() / b.norm()).item()


def chunked_reference(query, sources, w, ow=None, rows=None, chunk=2048) -> torch.Tensor:
    """float32 reference (backends.reference) on row chunks, so that no temporary exceeds a few GB."""
    n = sources[0].shape[0]
    idx = torch.arange(n, device=sources[0].device) if rows is None else rows
    outs = []
    for i in range(0, idx.numel(), chunk):
        r = idx[i:i + chunk]
        outs.append(R.attn_residual(query, [s[r] for s in sources], w, output_rms_weight=ow).float())
    return torch.cat(outs)


def make(L, n, seed_scale=0.05):
    sources = [(torch.randn(n, D, device="cuda") * (0.5 + 2 * torch.rand(1).item())).to(torch.bfloat16)
               for _ in range(L)]
    q = (torch.randn(D, device="cuda") * seed_scale).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(D, device="cuda")).to(torch.bfloat16)
    return q, sources, w


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024 ** 3, dtype=torch.float16, device="cuda").normal_()
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    bw = 2 * x.numel() * 2 / t
    x = y = None  # free (rebinding: the lambda above refers to them)
    torch.cuda.empty_cache()
    return bw


#: fla's forward autotuner (set by main), re-tuned for every shape by fla_retune
FLA_TUNER: list = []


def prune_fla(fla_fused_mod, pruned: bool) -> str:
    """Set up fla's forward autotuner: no on-disk autotune cache (fla_retune clears the in-memory one) and,
    with pruned, only its 8 configs of 8/16 warps and 2 stages (the setting of the sixth-16th sessions)."""
    k = fla_fused_mod.attnres_fwd_kernel
    if not hasattr(k, "configs"):
        return "fla's autotuner not found: fla's own tuning as shipped"
    k.cache_results = False
    FLA_TUNER.append(k)
    if not pruned:
        return (f"fla autotuned over all {len(k.configs)} of its forward configs, afresh for every row (its "
                f"autotune key is L rounded up to a power of two >= 8, so otherwise the first L <= 8 tuned would "
                f"decide the config of every L <= 8)")
    k.configs = [c for c in k.configs if c.num_warps in (8, 16) and c.num_stages == 2]
    return (f"fla autotuned over {len(k.configs)} of its 24 forward configs (num_warps 8/16, num_stages 2), afresh "
            f"for every row")


def fla_retune() -> None:
    """Forget fla's tuned configs, so that its next call tunes for its own shape."""
    for k in FLA_TUNER:
        k.cache.clear()


#: the settings in force for the sections after the sweeps (AttnResConfig fields: the sweeps' winners)
ACTIVE: dict = {}


def fwd(nw, bt, bl, ns, pps, wide=True):
    """A forward candidate as AttnResConfig fields: nw warps, bt rows per tile, bl sources per step (below the wide
    threshold, and from it too when `wide`), ns stages, pps programs per SM."""
    c = dict(fwd_num_warps=nw, fwd_bt=bt, fwd_bl=bl, fwd_ns=ns, fwd_progs_per_sm=pps)
    if wide:
        c["fwd_bl_wide"] = bl
    return c


#: settings for few sources (the flat loop has only L steps per row there, so fewer bytes are in flight per
#: program at the same stages): both sources in one step, two rows per step, deeper rings (measured history:
#: benchmarks/results/attn_residual.md)
SMALL_L_CANDS = [fwd(4, 1, 1, 3, 2, False), fwd(4, 1, 1, 4, 2, False), fwd(4, 1, 1, 5, 2, False),
                 fwd(4, 1, 2, 2, 2, False), fwd(4, 1, 2, 3, 2, False), fwd(8, 1, 2, 3, 1, False),
                 fwd(8, 2, 1, 3, 1, False), fwd(8, 1, 1, 4, 2, False), fwd(4, 1, 1, 2, 2, False)]

#: the forward's settings at any L: the default first, then the settings around it
CANDS = [fwd(4, 1, 1, 3, 2), fwd(4, 1, 1, 4, 2), fwd(4, 1, 1, 5, 2), fwd(4, 1, 2, 3, 2), fwd(2, 1, 1, 3, 4),
         fwd(8, 1, 1, 8, 1), fwd(8, 1, 2, 4, 1), fwd(8, 1, 4, 2, 1), fwd(8, 1, 4, 3, 1), fwd(4, 1, 2, 4, 2),
         fwd(4, 1, 4, 2, 2), fwd(8, 1, 1, 6, 2)]

#: changes to the forward's default launch settings with the fused output norm (--sweep-onorm)
ONORM_CANDS = [{}, {"fwd_num_warps": 8, "fwd_progs_per_sm": 1}, {"fwd_num_warps": 16, "fwd_progs_per_sm": 1},
               {"fwd_ns": 2}, {"fwd_ns": 4}, {"fwd_num_warps": 8, "fwd_progs_per_sm": 1, "fwd_ns": 4},
               {"fwd_bt": 2, "fwd_num_warps": 8, "fwd_progs_per_sm": 1}, {"fwd_bl_onorm": 1},
               {"fwd_bl_onorm": 1, "fwd_ns": 4}]


def _sweep_forward(n, Ls, copy_bw, cands, onorm: bool):
    """Time the forward at N = n for every L in Ls under each candidate (AttnResConfig fields over ACTIVE), GPU
    time from CUDA-graph replays; a table row per candidate (a failing one says so). Returns the best right one
    (geometric mean of TB/s over Ls) and its score: (None, -1) if none was right. The test data are freed."""
    emit("| setting | " + " | ".join(f"L={L} TB/s" for L in Ls) + f" | err (L={Ls[-1]}, 4096 rows) |")
    emit("|---|" + "---|" * (len(Ls) + 1))
    data = {L: make(L, n) for L in Ls}
    ow = (1 + 0.3 * torch.randn(D, device="cuda")).to(torch.bfloat16) if onorm else None
    qc, sc, wc = data[Ls[-1]]
    rows = torch.cat([torch.arange(min(n, 2048), device="cuda"), torch.randint(0, n, (2048,), device="cuda")])
    ref = chunked_reference(qc, sc, wc, ow, rows=rows)
    best, best_score = None, -1.0
    for cfg in cands:
        tbs = []
        try:
            with T.config(**dict(ACTIVE, **cfg)):
                err = rel(T.attn_residual(qc, sc, wc, output_rms_weight=ow)[rows], ref)
                for L in Ls:
                    q, s, w = data[L]
                    t = bench_graph(lambda: T.attn_residual(q, s, w, output_rms_weight=ow))
                    tbs.append((L + 1) * n * D * 2 / t)
        except Exception as e:  # a setting that does not compile/launch is skipped, and said so
            emit(f"| {cfg or 'default'} | failed: {type(e).__name__}: {str(e)[:80]} |")
            continue
        score = math.exp(sum(math.log(x) for x in tbs) / len(tbs))
        emit(f"| {cfg or 'default'} | " + " | ".join(f"{x / 1e12:.2f} ({x / copy_bw:.0%})" for x in tbs)
             + f" | {err:.1e}" + (" WRONG, not eligible" if not err < 1e-2 else "") + " |")
        if err < 1e-2 and score > best_score:
            best, best_score = dict(cfg), score
    data = qc = sc = wc = ref = None  # free
    torch.cuda.empty_cache()
    return best, best_score


def sweep_onorm(n, Ls, copy_bw):
    """The forward with the fused output norm: each of ONORM_CANDS applied over the settings in force; the best
    (geometric mean over Ls) is kept (ACTIVE)."""
    emit(f"\n## Sweep of the forward's launch settings with the output norm (changes to the default; N = {n}, "
         f"d = {D}, bf16, CUDA-graph replays)\n")
    best, best_score = _sweep_forward(n, Ls, copy_bw, ONORM_CANDS, onorm=True)
    best = best or {}
    ACTIVE.update(best)
    emit(f"\nbest change with the output norm: {best or 'none'} (geometric mean {best_score / 1e12:.2f} TB/s)")
    return best


def sweep(n, Ls, copy_bw, small=False):
    emit(f"\n## Sweep of our forward's launch settings (N = {n}, d = {D}, bf16; GPU time from CUDA-graph replays)\n")
    best, best_score = _sweep_forward(n, Ls, copy_bw, SMALL_L_CANDS if small else CANDS, onorm=False)
    if best is None:
        emit("\nno setting gave a right result: the default stays")
        return {}
    ACTIVE.update(best)
    emit(f"\nbest: {best} (geometric mean {best_score / 1e12:.2f} TB/s)")
    return best


def sweep_phase1(n, B, copy_bw):
    Q = 24
    emit(f"\n## Sweep of phase-1 launch settings (N = {n}, bank B = {B}, Q = {Q})\n")
    emit("bytes = bank read once + acc written once (the minimum of phase 1; logits and m/s are < 1% of it)\n")
    emit("| setting | phase-1 ms (acc f32) | TB/s | phase-1 ms (acc bf16) | TB/s | acc f32 vs default |")
    emit("|---|---|---|---|---|---|")
    bank = [torch.randn(n, D, device="cuda").to(torch.bfloat16) for _ in range(B)]
    qs = (torch.randn(Q, D, device="cuda") * 0.05)
    ws = 1 + 0.3 * torch.randn(Q, D, device="cuda")
    groups = {"mix_bank_max_sources": 0}          # the query-group mix (the one for banks over 16 sources)
    cands = [{}, {"mix_bank_bc": 2048, "mix_bank_nw": 8}, {"mix_bank_bc": 512, "mix_bank_nw": 2},
             {"p1_bt": 64, "p1_nw": 4}, {"p1_bk": 128, "p1_ns": 3}, {"p1_ns": 3}, {"p1_nw": 4},
             dict(groups), dict(groups, mix_groups_nw=8), dict(groups, mix_groups_bc=2048, mix_groups_qb=4),
             dict(groups, mix_groups_bc=512, mix_groups_qb=8), dict(groups, mix_groups_ns=2),
             dict(groups, mix_groups_bc=2048, mix_groups_qb=8, mix_groups_nw=8)]
    best, best_t = {}, float("inf")
    with T.config(**ACTIVE):
        want = T.attn_residual_phase1(qs, bank, ws)
    for cfg in cands:
        ts = []
        try:
            with T.config(**dict(ACTIVE, **cfg)):
                got = T.attn_residual_phase1(qs, bank, ws)
                err = max(rel(got[0], want[0]), rel(got[1], want[1]), rel(got[2], want[2]))
                got = None
                for acc_dtype in (torch.float32, torch.bfloat16):
                    ts.append(bench(lambda: T.attn_residual_phase1(qs, bank, ws, acc_dtype=acc_dtype)))
        except Exception as e:
            emit(f"| {cfg or 'default'} | failed: {type(e).__name__}: {str(e)[:80]} | | | | |")
            continue
        cells = []
        for t, es in zip(ts, (4, 2)):
            nbytes = B * n * D * 2 + Q * n * D * es
            cells.append(f"{t * 1e3:.2f} | {nbytes / t / 1e12:.2f} ({nbytes / t / copy_bw:.0%})")
        emit(f"| {cfg or 'default'} | " + " | ".join(cells) + f" | {err:.1e}"
             + (" WRONG, not eligible" if not err < 1e-4 else "") + " |")
        score = math.sqrt(ts[0] * ts[1])
        if err < 1e-4 and score < best_t:
            best, best_t = dict(cfg), score
    ACTIVE.update(best)
    emit(f"\nbest (geometric mean of both acc dtypes): {best or 'default'}")
    xs = [b.view(-1, D) for b in bank]
    with T.config(**ACTIVE):
        t_lg = bench(lambda: T._phase1_launch(qs, xs, ws, 1e-6, torch.float32, logits_only=True))
    emit(f"of which the logits kernel (tensor-core [tokens, d] x [d, Q], one read of the bank): {t_lg * 1e3:.2f} ms "
         f"= {B * n * D * 2 / t_lg / 1e12:.2f} TB/s of bank read")
    out = torch.empty(Q * n * D, dtype=torch.bfloat16, device="cuda")
    t_w = bench(lambda: out.fill_(1.0))
    emit(f"write-only ceiling for the acc bf16 bytes (torch fill_ of {out.numel() * 2 / 1e9:.1f} GB): "
         f"{t_w * 1e3:.2f} ms = {out.numel() * 2 / t_w / 1e12:.2f} TB/s")
    out = None
    # the 24 merges of a block (acc bf16, the partial for reads 1..23, output norm), per merge setting
    with T.config(**ACTIVE):
        acc, m, s = T.attn_residual_phase1(qs, bank, ws, acc_dtype=torch.bfloat16)
    part = torch.randn(n, D, device="cuda").to(torch.bfloat16)
    ows = 1 + 0.3 * torch.randn(Q, D, device="cuda")
    mbytes = (Q * 2 + (Q - 1)) * n * D * 2                       # acc read + output written, partial read

    def merges():
        return [T.attn_residual_merge(acc[r], m[r], s[r], part if r else None, qs[r], ws[r], output_rms_weight=ows[r],
                                      out_dtype=torch.bfloat16) for r in range(Q)]

    with T.config(**ACTIVE):
        ref = merges()
    emit(f"\n## Sweep of the merge kernel's launch settings (24 merges, acc bf16, N = {n})\n")
    emit("| setting | 24 merges ms | TB/s | err vs default |")
    emit("|---|---|---|---|")
    mbest, mbest_t = {}, float("inf")
    for cfg in ({}, {"merge_num_warps": 8}, {"merge_num_warps": 16}, {"merge_ns": 2}, {"merge_ns": 4},
                {"merge_num_warps": 8, "merge_progs_per_sm": 1}, {"merge_progs_per_sm": 3},
                {"merge_persistent": False}):               # (the row kernel of the small tiles, for comparison)
        try:
            with T.config(**dict(ACTIVE, **cfg)):
                err = max(rel(a_, b_) for a_, b_ in zip(merges(), ref))
                t = bench(merges)
        except Exception as e:
            emit(f"| {cfg or 'default'} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
            continue
        emit(f"| {cfg or 'default'} | {t * 1e3:.2f} | {mbytes / t / 1e12:.2f} ({mbytes / t / copy_bw:.0%}) | {err:.1e}"
             + (" WRONG, not eligible" if not err < 1e-3 else "") + " |")
        if err < 1e-3 and t < mbest_t:
            mbest, mbest_t = dict(cfg), t
    mbest.pop("merge_persistent", None)          # the kernel follows the rows, not a setting
    ACTIVE.update(mbest)
    emit(f"\nbest merge setting: {mbest or 'default'}")
    bank = xs = want = acc = m = s = part = ref = None  # free
    torch.cuda.empty_cache()
    return best, mbest


def main_table(Ns, Ls, copy_bw, fla_fused, onorm=False):
    emit(f"\n## Forward, bf16, d = {D}{', with the fused output norm' if onorm else ''}: ours vs fla "
         f"fused_attnres\n")
    emit("ms = median per call (do_bench: L2 flushed, host launch work included when it outlasts the flush); "
         "graph = the same call replayed from a CUDA graph (GPU time only); same-size copy = torch copy_ of as "
         "many bytes (half read, half written), CUDA-graph timed.\n")
    emit("| N | L | GB moved | GFLOP | ours ms | ours TB/s | ours %copy | ours %4.2TB/s | ours TFLOP/s | "
         "ours err | fla ms | fla TB/s | fla %copy | fla err | speed-up | ours graph ms | ours graph %copy | "
         "fla graph ms | fla graph %copy | graph speed-up | same-size copy TB/s | ours graph % of it |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for n in Ns:
        for L in Ls:
            q, s, w = make(L, n)
            ow = (1 + 0.3 * torch.randn(D, device="cuda")).to(torch.bfloat16) if onorm else None
            nbytes = (L + 1) * n * D * 2
            flops = 6 * L * n * D
            out = T.attn_residual(q, s, w, output_rms_weight=ow)
            ref = chunked_reference(q, s, w, ow)
            err = rel(out, ref)
            t = bench(lambda: T.attn_residual(q, s, w, output_rms_weight=ow))
            row = (f"| {n} | {L} | {nbytes / 1e9:.2f} | {flops / 1e9:.1f} | {t * 1e3:.3f} | {nbytes / t / 1e12:.2f} | "
                   f"{nbytes / t / copy_bw:.1%} | {nbytes / t / COPY_NOMINAL:.1%} | {flops / t / 1e12:.2f} | {err:.1e} |")
            if fla_fused is not None:
                fla_retune()
                fo = fla_fused(q, s, w, output_rms_weight=ow)
                ferr = rel(fo, ref)
                tf = bench(lambda: fla_fused(q, s, w, output_rms_weight=ow))
                row += (f" {tf * 1e3:.3f} | {nbytes / tf / 1e12:.2f} | {nbytes / tf / copy_bw:.1%} | {ferr:.1e} | "
                        f"{tf / t:.2f}x |")
                ratios.append(tf / t)
            else:
                row += " - | - | - | - | - |"
            tg = bench_graph(lambda: T.attn_residual(q, s, w, output_rms_weight=ow))
            row += f" {tg * 1e3:.3f} | {nbytes / tg / copy_bw:.1%} |"
            if fla_fused is not None:
                tfg = bench_graph(lambda: fla_fused(q, s, w, output_rms_weight=ow))
                row += f" {tfg * 1e3:.3f} | {nbytes / tfg / copy_bw:.1%} | {tfg / tg:.2f}x |"
            else:
                row += " - | - | - |"
            # the same number of bytes as one device copy (nbytes / 2 read, nbytes / 2 written), CUDA-graph timed:
            # the ceiling a streaming kernel of this size meets (launch and tail included), next to the 4 GiB copy.
            # Only for calls under 1.5 GB, where launch and tail weigh: on the H200 (2026-11-30) graph-replayed
            # copies of 2.0 and 3.05 GB per tensor ran at 2.77 TB/s while 1.05 and 4.23 GB ran at 4.26-4.29
            # (not understood; a ceiling that moves like that says nothing about our kernel)
            if nbytes <= 1.5e9:
                cx = torch.empty(nbytes // 4, dtype=torch.float16, device="cuda").normal_()
                cy = torch.empty_like(cx)
                tc = bench_graph(lambda: cy.copy_(cx))
                cx = cy = None
                row += f" {nbytes / tc / 1e12:.2f} | {tc / tg:.1%} |"
            else:
                row += " - | - |"
            emit(row)
            q = s = w = out = ref = None  # free
            torch.cuda.empty_cache()
    return ratios


def past_2_32(fla_fused, fla_naive):
    n, L = 65536, 16
    emit(f"\n## N = {n}, L = {L}, d = {D}: {n * L * D / 1e9:.2f}e9 source elements (2^32 = 4.29e9)\n")
    q, s, w = make(L, n)
    rows = torch.cat([torch.arange(4096, device="cuda"), torch.arange(n - 4096, n, device="cuda"),
                      torch.randint(0, n, (4096,), device="cuda")])
    ref = chunked_reference(q, s, w, rows=rows)
    ours = T.attn_residual(q, s, w)[rows]
    emit(f"- ours vs chunked float32 reference (12288 rows: first, last, random): rel err {rel(ours, ref):.2e}")
    if fla_fused is None:
        return
    fo = fla_fused(q, s, w)
    emit(f"- fla fused_attnres vs chunked float32 reference: rel err {rel(fo[rows], ref):.2e}")
    torch.cuda.synchronize()
    try:
        no, p = fla_naive(q, s, w, return_weights=True)
        emit(f"- fla naive_attnres vs chunked float32 reference: rel err {rel(no[rows], ref):.2e}; "
             f"naive vs fused: {rel(no, fo):.2e}")
        # which stage of the naive one goes wrong: its softmax weights p [L, N] against ours
        with torch.no_grad():
            xs = torch.stack([x[rows].float() for x in s])                       # [L, R, D]
            lg = (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6) * (q.float() * w.float())).sum(-1)
            p_ref = torch.softmax(lg, 0)
        emit(f"- fla naive's softmax weights p vs a float32 recomputation on those rows: rel err "
             f"{rel(p[:, rows], p_ref):.2e}")
        del no, p
        torch.cuda.empty_cache()
        # stage by stage, as the naive reference computes them, on the full stacked tensor
        v = torch.stack([x.view(-1, D) for x in s]).float()                     # [L, N, D] f32, 30 GB
        k = torch.nn.functional.rms_norm(v, (D,), w.float(), 1e-6)
        last = torch.tensor([n - 1], device="cuda")
        k_small = torch.nn.functional.rms_norm(v[:, last], (D,), w.float(), 1e-6)
        emit(f"- F.rms_norm on the whole [L, N, D] float32 tensor ({v.numel() / 1e9:.2f}e9 elements) vs on "
             f"the last token only: rel err {rel(k[:, last], k_small):.2e}")
        lg_full = torch.einsum("lnd,d->ln", k, q.float())
        emit(f"- einsum('l n d, d -> l n') on it vs per-row: rel err "
             f"{rel(lg_full[:, last], (k_small * q.float()).sum(-1)):.2e}")
        del k, k_small
        pp = lg_full.softmax(0)
        o_full = torch.einsum("ln,lnd->nd", pp, v)
        emit(f"- einsum('l n, l n d -> n d') vs per-row: rel err "
             f"{rel(o_full[last], (pp[:, last, None] * v[:, last]).sum(0)):.2e}")
        del v, lg_full, pp, o_full
    except torch.cuda.OutOfMemoryError as e:
        emit(f"- fla naive_attnres: out of memory ({e})")
    torch.cuda.empty_cache()


def block(n, Bs, fla_fused, copy_bw):
    Q = 24
    emit(f"\n## One K3 block: 24 AttnRes reads (12 layers), N = {n}, d = {D}, bf16, each read with its output "
         f"norm\n")
    emit("reads: r = 0 mixes the bank only; r >= 1 mixes bank + the in-block partial sum.\n")
    emit("floor: the bytes of the two-phase form with acc bf16 (B + 95 U; 72 U at B = 1, where acc is x_0 itself) at "
         "the 4 GiB copy rate, over fla's time: no implementation of that data flow can go below it.\n")
    emit("| bank B | fla 24 calls ms | ours 24 direct ms | ours two-phase (acc f32) ms | phase-1 ms (f32) | "
         "ours two-phase (acc bf16) ms | two-phase f32 / fla | two-phase bf16 / fla | floor / fla | err f32 | "
         "err bf16 |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    tot = [0.0, 0.0, 0.0]
    for B in Bs:
        bank = [(torch.randn(n, D, device="cuda") * (1 + i)).to(torch.bfloat16) for i in range(B)]
        parts = [torch.randn(n, D, device="cuda").to(torch.bfloat16) for _ in range(2)]
        qs = (torch.randn(Q, D, device="cuda") * 0.05).to(torch.bfloat16)
        ws = (1 + 0.3 * torch.randn(Q, D, device="cuda")).to(torch.bfloat16)
        ows = (1 + 0.3 * torch.randn(Q, D, device="cuda")).to(torch.bfloat16)

        def srcs(r):
            return bank + ([parts[r % 2]] if r else [])

        def fla_block():
            for r in range(Q):
                fla_fused(qs[r], srcs(r), ws[r], output_rms_weight=ows[r])

        def direct_block():
            for r in range(Q):
                T.attn_residual(qs[r], srcs(r), ws[r], output_rms_weight=ows[r])

        def two_phase(acc_dtype):
            acc, m, s = T.attn_residual_phase1(qs, bank, ws, acc_dtype=acc_dtype)
            outs = []
            for r in range(Q):
                outs.append(T.attn_residual_merge(acc[r], m[r], s[r], parts[r % 2] if r else None, qs[r], ws[r],
                                                  output_rms_weight=ows[r], out_dtype=torch.bfloat16))
            return outs

        rows = torch.randint(0, n, (2048,), device="cuda")
        errs = []
        for acc_dtype in (torch.float32, torch.bfloat16):
            outs = two_phase(acc_dtype)
            e = max(rel(outs[r][rows], chunked_reference(qs[r], srcs(r), ws[r], ows[r], rows=rows)) for r in (0, 1, 23))
            errs.append(e)
            del outs
        if fla_fused is not None:
            fla_retune()
            fla_block()          # fla tunes on its first call (r = 0, B sources); r >= 1 shares its key below B = 8
        t_fla = bench(fla_block) if fla_fused is not None else float("nan")
        t_dir = bench(direct_block)
        t_f32 = bench(lambda: two_phase(torch.float32))
        t_p1 = bench(lambda: T.attn_residual_phase1(qs, bank, ws))
        t_bf = bench(lambda: two_phase(torch.bfloat16))
        t_p1b = bench(lambda: T.attn_residual_phase1(qs, bank, ws, acc_dtype=torch.bfloat16))
        u_bf = 72 if B == 1 else B + 95
        t_floor = u_bf * n * D * 2 / copy_bw
        tot[0] += t_fla
        tot[1] += t_bf
        tot[2] += t_floor
        emit(f"| {B} | {t_fla * 1e3:.2f} | {t_dir * 1e3:.2f} | {t_f32 * 1e3:.2f} | {t_p1 * 1e3:.2f} | "
             f"{t_bf * 1e3:.2f} | {t_f32 / t_fla:.2f} | {t_bf / t_fla:.2f} | {t_floor / t_fla:.2f} | {errs[0]:.1e} | "
             f"{errs[1]:.1e} |")
        p1_bytes = B * n * D * 2 + Q * n * D * 4
        if B > 1:
            emit(f"|  | phase 1 alone (f32 acc): {p1_bytes / 1e9:.1f} GB in {t_p1 * 1e3:.2f} ms = "
                 f"{p1_bytes / t_p1 / 1e12:.2f} TB/s ({p1_bytes / t_p1 / copy_bw:.0%} of copy); with acc bf16: "
                 f"{(p1_bytes - Q * n * D * 2) / 1e9:.1f} GB in {t_p1b * 1e3:.2f} ms = "
                 f"{(p1_bytes - Q * n * D * 2) / t_p1b / 1e12:.2f} TB/s | | | | | | | | | |")
        else:
            emit(f"|  | phase 1 alone: the logits only ({n * D * 2 / 1e9:.2f} GB read, acc is x_0): f32 acc "
                 f"{t_p1 * 1e3:.2f} ms (one conversion of x_0 to float32), bf16 {t_p1b * 1e3:.2f} ms"
                 " | | | | | | | | | |")
        # bytes moved, in units of one [N, d] bf16 tensor U: 24 direct reads (= fla) read 24B + 23 sources
        # and write 24 outputs; two-phase: bank B + acc written and read back 24 + 24 (x2 in float32) +
        # 23 partials + 24 outputs. Their ratio is the time ratio at equal bandwidth (the floor).
        u_dir, u_f32 = 24 * B + 47, (B + 143 if B > 1 else 3 + 72)
        emit(f"|  | bytes (U = {n * D * 2 / 1e9:.3f} GB): 24 direct / fla {u_dir} U, two-phase f32 {u_f32} U "
             f"({u_f32 / u_dir:.2f} of fla's), bf16 {u_bf} U ({u_bf / u_dir:.2f}); effective TB/s: fla "
             f"{u_dir * n * D * 2 / t_fla / 1e12:.2f}, direct {u_dir * n * D * 2 / t_dir / 1e12:.2f}, two-phase f32 "
             f"{u_f32 * n * D * 2 / t_f32 / 1e12:.2f}, bf16 {u_bf * n * D * 2 / t_bf / 1e12:.2f} | | | | | | | | | |")
        bank = parts = None  # free
        torch.cuda.empty_cache()
    if len(Bs) > 1:
        emit(f"\nall {len(Bs)} banks above together (K3 runs banks 1 to 8; its last block has 9 layers, 18 reads): "
             f"fla {tot[0] * 1e3:.2f} ms, ours (two-phase, acc bf16) {tot[1] * 1e3:.2f} ms = {tot[1] / tot[0]:.2f} of "
             f"fla's time (floor {tot[2] / tot[0]:.2f})")


#: the sections --skip can leave out
SECTIONS = ("table", "onorm", "2e32", "block", "p1sweep", "fsweep")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 16384 only, L in {2, 25}; no 2^32 section")
    ap.add_argument("--sweep", action="store_true", help="sweep our forward's launch settings first, use the best")
    ap.add_argument("--sweep-n", type=int, default=65536, help="token count of the forward sweep (default 65536)")
    ap.add_argument("--sweep-l", default="2,8,25",
                    help="comma list of source counts of the forward sweep (default 2,8,25); with only counts "
                         "below the wide threshold (AttnResConfig.fwd_wide_l) the small-L settings are swept")
    ap.add_argument("--sweep-onorm", action="store_true",
                    help="sweep the forward's launch settings with the fused output norm first (N = 16384, L in "
                         "--sweep-l), use the best")
    ap.add_argument("--no-fla", action="store_true", help="skip the fla baseline")
    ap.add_argument("--fla-pruned", action="store_true", help="let fla autotune over 8 of its 24 configs (8/16 warps, "
                                                             "2 stages) instead of all")
    ap.add_argument("--skip", default="", help=f"comma list of sections to skip: {','.join(SECTIONS)} (p1sweep: the "
                                               f"phase-1 / merge part of --sweep; fsweep: its forward part)")
    ap.add_argument("--banks", default="2,4,8", help="comma list of bank sizes B of the K3-block section (default "
                                                      "2,4,8; K3's blocks run 1 to 8)")
    ap.add_argument("--p1-bank", type=int, default=8, help="bank size B of the phase-1 sweep (default 8)")
    ap.add_argument("--out", default="benchmarks/results/attn_residual.md", help="where to write the table")
    a = ap.parse_args(argv)

    def counts(flag, text, what):
        """A comma list of integers >= 1 from the command line, or a clear argparse error."""
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            ap.error(f"{flag}: expected a comma list of integers, got {text!r}")
        if not vals or min(vals) < 1:
            ap.error(f"{flag}: expected {what} >= 1, got {text!r}")
        return vals

    sLs = counts("--sweep-l", a.sweep_l, "source counts")
    if a.sweep_n < 1:
        ap.error(f"--sweep-n: expected a positive token count, got {a.sweep_n}")
    skip = set(a.skip.split(",")) if a.skip else set()
    unknown = skip - set(SECTIONS)
    if unknown:
        ap.error(f"--skip: unknown section(s) {', '.join(sorted(unknown))}; sections: {','.join(SECTIONS)}")
    banks = counts("--banks", a.banks, "bank sizes")
    if a.p1_bank < 2:
        ap.error(f"--p1-bank: expected a bank of >= 2 sources (one source needs no mix), got {a.p1_bank}")
    if not torch.cuda.is_available():
        sys.exit("attn_residual benchmark: needs a CUDA GPU")
    if a.out:
        OUT_PATH.append(a.out)
    fla_fused = fla_naive = None
    note = "fla not run"
    if not a.no_fla:
        import fla.ops.attnres.fused as fla_fused_mod
        from fla.ops.attnres import fused_attnres as fla_fused, naive_attnres as fla_naive
        note = prune_fla(fla_fused_mod, a.fla_pruned)
    t0 = time.time()
    copy_bw = copy_bandwidth()
    emit(f"# attn_residual benchmark ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
         f"triton {triton.__version__})\n")
    emit(f"device copy (torch, 4 GiB, read + write): {copy_bw / 1e12:.2f} TB/s; nominal ceiling used: 4.2 TB/s. "
         f"{note}.")
    Ns = [16384] if a.quick else [16384, 65536]
    Ls = [2, 25] if a.quick else [2, 8, 16, 25]
    if a.sweep_onorm:
        obest = sweep_onorm(16384, sLs, copy_bw)
        emit(f"\nSWEEP RESULT: with the output norm {obest or '{} (default)'}")
    if a.sweep:
        small = max(sLs) < T.current().fwd_wide_l
        fbest = sweep(a.sweep_n, sLs, copy_bw, small=small) if "fsweep" not in skip else {}
        pbest, mbest = sweep_phase1(16384, a.p1_bank, copy_bw) if "p1sweep" not in skip else ({}, {})
        emit(f"\nSWEEP RESULT (AttnResConfig fields): forward {fbest or '{} (default)'}; phase 1 "
             f"{pbest or '{} (default)'}; merge {mbest or '{} (default)'}")
    emit(f"\nour launch settings: {T.current()}, changed by {ACTIVE or 'nothing'}")
    ratios = []
    with T.config(**ACTIVE):
        if "table" not in skip:
            ratios = main_table(Ns, Ls, copy_bw, fla_fused)
        if "onorm" not in skip:
            main_table([16384], [8], copy_bw, fla_fused, onorm=True)
        if "2e32" not in skip and not a.quick:
            past_2_32(fla_fused, fla_naive)
        if "block" not in skip:
            block(16384, banks if not a.quick else [8], fla_fused, copy_bw)
    emit(f"\n(total benchmark wall time {time.time() - t0:.0f} s)")
    if ratios:
        g = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        emit(f"\nratio vs fla fused_attnres (time fla / time ours, geometric mean over the main table): {g:.2f}x")


if __name__ == "__main__":
    main()
