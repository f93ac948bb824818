"""One Kimi K3 MoE layer on the GPU: mtc's Triton latent MoE beside torch._grouped_mm and a
per-expert loop, in one process, on random data.

Layer (spec/MODEL.md): d 7168, latent 3584, 896 routed experts, top-16, expert intermediate 3072
(SiTU-GLU), 2 shared experts at full width (stacked: Is = 6144), bf16. Measured at 8192 and 32768
tokens: the routed experts alone (forward) and the whole layer (forward, forward+backward).
All three implementations share the dense parts (torch.matmul / cuBLAS for W_down, W_up and the
shared experts); they differ in routing (ours: Triton router; baselines: torch) and the experts:
  triton  backends.triton.moe (grouped GEMM with fused SiTU-GLU, TMA, fused combine)
  gmm     torch._grouped_mm for the three expert GEMMs, torch SiTU-GLU between, index_add combine
  loop    one torch matmul per expert and GEMM (host-side offsets), torch SiTU-GLU
Timing: triton.testing.do_bench (median, CUDA events). FLOPs: expert GEMMs 6*N*k*l*I forward and
12*N*k*l*I backward; layer adds router 2*N*d*E, W_down/W_up 4*N*d*l and shared 6*N*d*Is (x3 for
forward+backward). Bytes: the weights read once (the floor for a weight-streaming layer) plus the
token activations in and out. Limits: bf16 dense matmul ~720 TFLOP/s, device copy ~4.2 TB/s.

Weight gradients (backends.triton.moe: the held kernel below MoeConfig.wgrad_few_rows rows per expert, the tile
kernel otherwise; per-kernel launch-setting sweeps: benchmarks/moe_tiles.py): --wgrad-compare times the default
("auto") and the tile kernel at every size ("tile": wgrad_few_rows 0) in one run, the weight-gradient launches alone
(dW1|dW3: 4*N*k*l*I FLOPs, dW2: 2*N*k*l*I, on random bf16 operands of the real shapes and the real routing) and
the routed experts forward+backward with each (rows "triton:wgrad-<form>"); it also checks that the two agree.

Usage: python benchmarks/moe.py [--quick] [--tokens 8192 32768] [--out benchmarks/results/moe.md]
       python benchmarks/moe.py --wgrad-compare --no-layer --tokens 32768 8192   (the weight gradients only)
       python benchmarks/moe.py --cpu-smoke      (tiny shapes, checks the code paths, no timing)
"""
import argparse
import gc
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# torch's caching allocator with expandable segments (unless the caller set PYTORCH_CUDA_ALLOC_CONF): the
# forward+backward at 32768 tokens needs ~125 GiB of the H200's 139 (bf16 expert weights 59 GB and their
# gradients as much again, in ~20 GB blocks), and the fourth session's run ran out of memory in the layer's
# forward+backward after the forward cases had run in the same process (block fragmentation is the
# likely cause, not confirmed). Must be set before torch initialises CUDA.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

PEAK_TFLOPS = 720.0
PEAK_TBS = 4.2


def situ_torch(a, b, bg=4.0, bu=25.0):
    return (bg * torch.tanh(a / bg) * torch.sigmoid(a)) * (bu * torch.tanh(b / bu))


def torch_route(x, rw, rb, k, scaling):
    scores = torch.sigmoid((x @ rw.t()).float())
    idx = torch.topk(scores + rb, k, dim=1).indices
    ch = scores.gather(1, idx)
    return idx, ch / ch.sum(1, keepdim=True) * scaling


def _sort_rows(idx, e):
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    return order, order // idx.shape[1], counts


def trial(tm, change):
    """A --variants trial as a backends.triton.moe config block: change maps GPU tile entries to their changed
    settings, or a MoeConfig field (e.g. wgrad_few_rows) to its value."""
    fields = {kk: v for kk, v in change.items() if not isinstance(v, dict)}
    tiles = {kk: v for kk, v in change.items() if isinstance(v, dict)}
    return tm.config(tiles={"cuda": tiles} if tiles else None, **fields)


#: the weight-gradient forms --wgrad-compare times: the default, and the tile kernel at every size
WGRAD_FORMS = {"auto": {}, "tile": {"wgrad_few_rows": 0}}


def alloc_retries():
    """The CUDA caching allocator's retries so far (a retry frees cached blocks and synchronises)."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


class PowerSampler:
    """Samples the GPU's power draw (W) and SM clock (MHz) every 100 ms through nvidia-smi while in a with block;
    .summary() gives their means over the block. The H200 holds 700 W: a step that keeps the tensor cores busy
    runs at that cap with the SM clock lowered (15th session: the K3 layer's forward+backward at 32768 tokens at
    ~690 W, ours at ~1450 MHz, the grouped_mm layer at ~1600), so time follows energy per step there."""

    def __enter__(self):
        import subprocess
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits",
                                          "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        self.vals = []
        if self.proc is not None:
            self.proc.terminate()
            out = self.proc.communicate()[0]
            for line in out.splitlines():
                try:
                    self.vals.append([float(v) for v in line.split(",")])
                except ValueError:
                    continue
        return False

    def summary(self):
        v = self.vals[len(self.vals) // 4:]  # past the first quarter (warm-up)
        if not v:
            return "power: no nvidia-smi samples"
        return (f"{sum(r[0] for r in v) / len(v):.0f} W, SM clock {sum(r[1] for r in v) / len(v):.0f} MHz "
                f"(nvidia-smi, {len(v)} samples)")


def profile_steps(step, label, steps=2, top=20):
    """Print the `top` CUDA kernels of `steps` calls of step() by GPU time (torch.profiler), per step."""
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(ev.device_time_total / steps / 1e3, ev.count // steps, ev.key) for ev in prof.key_averages()
            if ev.device_time_total > 0]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"  profile {label}: {total:.2f} ms of kernels per step", flush=True)
    for ms, cnt, key in rows[:top]:
        print(f"    {ms:8.2f} ms  x{cnt:<4d} {key[:110]}", flush=True)
    # the GPU's idle gaps between consecutive kernels (host launches, synchronisations), largest first
    kern = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                   if ev.device_type.name == "CUDA" and ev.time_range.end > ev.time_range.start), key=lambda t: t[0])
    gaps, end, prev = [], None, None
    for a, b, name in kern:
        if end is not None and a > end:
            gaps.append(((a - end) / 1e3, prev, name))
        if end is None or b > end:
            end, prev = b, name
    gaps.sort(reverse=True)
    print(f"  idle between kernels: {sum(g[0] for g in gaps) / steps:.2f} ms per step; largest:", flush=True)
    for ms, a, b in gaps[:8]:
        print(f"    {ms:7.2f} ms after {a[:60]} before {b[:60]}", flush=True)


def experts_phases(tm, fwd, inputs, grad_out, reps=5):
    """Median time (ms) of each phase of moe_experts' forward and backward (MoeConfig.profile events),
    as 'name a.bc, ...', and the caching allocator's retries over the reps (a retry frees cached blocks and
    synchronises: the 9th session's weight-gradient phases took ~25% longer in the layer than alone)."""
    per = {}
    retries0 = alloc_retries()
    for _ in range(reps):
        ev = []
        with tm.config(profile=ev):
            u = fwd()
            gr = torch.autograd.grad(u, inputs, grad_out)
            torch.cuda.synchronize()
        del gr, u
        for (_, a), (name, b) in zip(ev[:-1], ev[1:]):
            if name != "bwd: start":           # the gap between forward and backward is not a phase
                per.setdefault(name, []).append(a.elapsed_time(b))
    retries = alloc_retries() - retries0
    return (", ".join(f"{n} {sorted(x)[len(x) // 2]:.2f}" for n, x in per.items())
            + f"; allocator retries in {reps} steps: {retries}")


def gmm_experts(x, idx, wt, w1, w3, w2):
    """Routed experts through torch._grouped_mm (weights [E, out, in] -> transposed views)."""
    e = w1.shape[0]
    order, tok, counts = _sort_rows(idx, e)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x.index_select(0, tok)
    a = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
    b = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
    h = situ_torch(a, b)
    y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    y = y * wt.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tok, y.float()).to(x.dtype)


def loop_experts(x, idx, wt, w1, w3, w2):
    """Routed experts with one matmul per expert (host-side offsets: one sync)."""
    e = w1.shape[0]
    order, tok, counts = _sort_rows(idx, e)
    xs = x.index_select(0, tok)
    outs, s = [], 0
    for ex, c in enumerate(counts.tolist()):
        if c:
            xe = xs[s:s + c]
            outs.append(situ_torch(xe @ w1[ex].t(), xe @ w3[ex].t()) @ w2[ex].t())
        s += c
    y = torch.cat(outs) * wt.reshape(-1)[order].unsqueeze(1).to(x.dtype)
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tok, y.float()).to(x.dtype)


def make_layer(impl, tm):
    """The whole Stable LatentMoE layer with the given expert implementation."""
    def layer(x, p, k, scaling):
        if impl == "triton":
            return tm.latent_moe(x, p["rw"], p["rb"], p["wd"], p["w1"], p["w3"], p["w2"], p["nw"],
                                 p["wu"], p["s1"], p["s3"], p["s2"], top_k=k, routed_scaling=scaling)[0]
        idx, wt = torch_route(x, p["rw"], p["rb"], k, scaling)
        xl = x @ p["wd"].t()
        # "mix": the gmm layer with our experts (the rest, router included, in torch as the baseline has it)
        fn = {"gmm": gmm_experts, "loop": loop_experts, "mix": tm.moe_experts}[impl]
        u = fn(xl, idx, wt, p["w1"], p["w3"], p["w2"]).float()
        un = (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6) * p["nw"].float()).to(x.dtype)
        y = un @ p["wu"].t()
        hs = situ_torch(x @ p["s1"].t(), x @ p["s3"].t())
        return y + hs @ p["s2"].t()
    return layer


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="token counts (default 8192 32768)")
    ap.add_argument("--experts", type=int, default=896, help="routed experts (default 896, the K3 layer)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--loop-bwd", action="store_true",
                    help="also time the per-expert loop layer's forward+backward (8192 tokens and fewer only; off by "
                         "default: on an H200 one run had not finished after 490 s, an earlier one ran out of "
                         "memory)")
    ap.add_argument("--no-bwd", action="store_true", help="skip forward+backward")
    ap.add_argument("--variants", action="store_true",
                    help="also time alternative tile configs, and the layer \"mix\" (the gmm layer with our "
                         "experts: router, norm and shared experts in torch)")
    ap.add_argument("--phases", action="store_true",
                    help="time each phase of the Triton experts' forward and backward (CUDA events)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip what remains after this many seconds")
    ap.add_argument("--profile", action="store_true",
                    help="after each layer fwd+bwd timing: torch.profiler over two steps, the 20 kernels with the "
                         "most GPU time (where the layer's time goes; triton against gmm)")
    ap.add_argument("--power", action="store_true",
                    help="sample the GPU's power draw and SM clock (nvidia-smi) while each layer fwd+bwd is timed")
    ap.add_argument("--out", default=None, help="write the table (markdown) here")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, no timing")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the random weights and inputs (default: a fresh one, printed in the header, so "
                         "that a run can be repeated)")
    ap.add_argument("--wgrad-compare", action="store_true",
                    help="time the weight gradients as the default runs them and on the tile kernel at every size, "
                         "side by side (alone and in experts fwd+bwd)")
    ap.add_argument("--no-layer", action="store_true",
                    help="with --wgrad-compare: time only the weight-gradient rows (no other effect)")
    args = ap.parse_args()
    t_start = time.time()
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("moe benchmark: needs a CUDA GPU (--cpu-smoke checks this script's code paths on the CPU)")
    if args.cpu_smoke and (args.tokens != ap.get_default("tokens") or args.experts != ap.get_default("experts")):
        print("note: --cpu-smoke uses its own tiny shapes (37 tokens); --tokens / --experts are not used", flush=True)

    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from backends.triton import moe as tm  # noqa: E402  (after TRITON_INTERPRET)
    import triton  # noqa: E402

    dev = "cpu" if args.cpu_smoke else "cuda"
    dt = torch.float32 if args.cpu_smoke else torch.bfloat16
    if args.cpu_smoke:
        d, lat, e, k, inter, i_s, tokens = 64, 32, 8, 2, 16, 32, [37]
    else:
        d, lat, e, k, inter, i_s, tokens = 7168, 3584, args.experts, 16, 3072, 6144, args.tokens
    scaling = 1.0
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)

    def rnd(*shape, scale):
        t = torch.randn(*shape, device=dev, dtype=dt)
        return t.mul_(scale)

    p = dict(rw=rnd(e, d, scale=d ** -0.5), rb=torch.zeros(e, device=dev),
             wd=rnd(lat, d, scale=d ** -0.5), nw=torch.ones(lat, device=dev, dtype=dt),
             wu=rnd(d, lat, scale=lat ** -0.5),
             w1=rnd(e, inter, lat, scale=lat ** -0.5), w3=rnd(e, inter, lat, scale=lat ** -0.5),
             w2=rnd(e, lat, inter, scale=inter ** -0.5),
             s1=rnd(i_s, d, scale=d ** -0.5), s3=rnd(i_s, d, scale=d ** -0.5), s2=rnd(d, i_s, scale=i_s ** -0.5))
    wbytes_exp = 3 * e * inter * lat * 2
    wbytes_dense = (e * d + 2 * lat * d + 3 * i_s * d) * 2
    rows = []  # (impl, T, what, ms, flops, bytes)
    notes = []

    def bench(fn, reps_ms):
        if args.cpu_smoke:
            fn()
            return float("nan")
        return triton.testing.do_bench(fn, warmup=max(1, reps_ms // 4), rep=reps_ms, return_mode="median")

    def record(impl, T, what, fn, flops, nbytes, reps_ms):
        if time.time() - t_start > args.budget_s:
            notes.append(f"skipped {impl} {what} T={T}: time budget")
            return None
        retries0 = alloc_retries() if dev == "cuda" else 0
        try:
            ms = bench(fn, reps_ms)
            if dev == "cuda" and alloc_retries() > retries0:
                # a retry of the caching allocator frees its cached blocks and synchronises, so that timing is
                # of a slower step than the layer's own: free what is cached and time it once more
                first, n_retry = ms, alloc_retries() - retries0
                gc.collect()
                torch.cuda.empty_cache()
                retries0 = alloc_retries()
                ms = bench(fn, reps_ms)
                notes.append(f"{impl} {what} T={T}: {n_retry} allocator retries in a first timing ({first:.2f} ms); "
                             f"timed again after emptying the cache")
        except torch.cuda.OutOfMemoryError:
            notes.append(f"{impl} {what} T={T}: out of memory")
            print(f"  {impl:7s} {what:22s} OOM", flush=True)
            torch.cuda.empty_cache()
            return None
        except Exception as ex:  # keep going: report what failed
            notes.append(f"{impl} {what} T={T}: {type(ex).__name__}: {str(ex)[:160]}")
            print(f"  {impl:7s} {what:22s} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            return None
        rows.append((impl, T, what, ms, flops, nbytes))
        if dev == "cuda":
            # a retry of the caching allocator frees its cached blocks and synchronises: a slow step
            retries = alloc_retries() - retries0
            if retries:
                notes.append(f"{impl} {what} T={T}: {retries} allocator retries while timed (this time is of "
                             f"slower steps than the layer's own)")
        if not math.isnan(ms):
            print(f"  {impl:7s} {what:22s} {ms:9.2f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  "
                  f"({time.time() - t_start:.0f}s)", flush=True)
        return ms

    printed = [None]

    def emit(final=False):
        """Print the table (and write --out); called after each token count, so a run cut short
        keeps what it measured."""
        lines = ["| impl | tokens | what | ms | TFLOP | TFLOP/s | % of 720 | TB/s (floor bytes) | % of 4.2 |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for impl, T, what, ms, fl, nb in rows:
            if math.isnan(ms):
                continue
            tf = fl / ms / 1e9
            tb = nb / ms / 1e9
            lines.append(f"| {impl} | {T} | {what} | {ms:.2f} | {fl / 1e12:.2f} | {tf:.1f} | "
                         f"{100 * tf / PEAK_TFLOPS:.1f}% | {tb:.2f} | {100 * tb / PEAK_TBS:.1f}% |")
        get = {(i, T, w): ms for i, T, w, ms, _, _ in rows}
        ratios = []
        for T in tokens:
            for what in ("experts fwd", "layer fwd", "experts fwd+bwd", "layer fwd+bwd"):
                a, b = get.get(("triton", T, what)), get.get(("gmm", T, what))
                if a and b and not math.isnan(a):
                    ratios.append(f"{what} T={T}: {b / a:.2f}x")
        for T in tokens:
            for what in ("dW1|dW3", "dW2"):
                a, b = get.get(("wgrad-auto", T, what)), get.get(("wgrad-tile", T, what))
                if a and b and not math.isnan(a):
                    ratios.append(f"[tile/auto time] {what} T={T}: {b / a:.2f}x")
            a, b = get.get(("triton:wgrad-auto", T, "experts fwd+bwd")), get.get(("triton:wgrad-tile", T,
                                                                                    "experts fwd+bwd"))
            if a and b and not math.isnan(a):
                ratios.append(f"[tile/auto time] experts fwd+bwd T={T}: {b / a:.2f}x")
        dev_name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)"
        head = [f"# MoE layer benchmark ({dev_name}, torch {torch.__version__}, triton {triton.__version__})", "",
                f"K3 MoE layer: d {d}, latent {lat}, {e} experts, top-{k}, intermediate {inter}, shared Is {i_s}, "
                f"{str(dt).replace('torch.', '')}; seed {seed}; median of do_bench; "
                f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}.", ""]
        tail = ["", *[f"- {n}" for n in notes]]
        if ratios:
            tail += ["", "ratio vs torch._grouped_mm (time_gmm / time_triton): " + "; ".join(ratios)]
        if len(lines) == 2:            # no timed row (--cpu-smoke): no empty table
            lines = ["(no timings: --cpu-smoke checks the code paths only)"]
        text = "\n".join(head + lines + tail)
        if text == printed[0]:         # the final call after the last token count: said already
            return
        printed[0] = text
        print()
        print(text)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                fh.write(text + "\n")

    reps = 300 if args.quick else 1000

    def wgrad_compare(T, x):
        """The weight gradients (WGRAD_FORMS) on the real routing of x: alone, then in experts fwd+bwd."""
        nk = T * k
        with torch.no_grad():
            idx, wt, _ = tm.qb_route(x, p["rw"], p["rb"], top_k=k, routed_scaling=scaling)
            dsp = tm._Dispatch(idx, e)
            da = rnd(nk, inter, scale=1.0)
            db = rnd(nk, inter, scale=1.0)
            xs = rnd(nk, lat, scale=1.0)
            dw1 = torch.empty(e, inter, lat, device=dev, dtype=dt)
            dw3 = torch.empty_like(dw1)
            f_dual, f_one = 4.0 * nk * lat * inter, 2.0 * nk * lat * inter
            b_dual = 2 * e * inter * lat * 2 + (2 * nk * inter + nk * lat) * 2
            b_one = e * inter * lat * 2 + (nk * inter + nk * lat) * 2
            ref_out = {}
            for form, fields in WGRAD_FORMS.items():
                with tm.config(**fields):
                    # dW1, dW3 = dA^T xs, dB^T xs; dW2-shaped launch: xs^T dB -> [E, l, I]
                    record(f"wgrad-{form}", T, "dW1|dW3",
                           lambda: tm._wgrad_w13(da, db, xs, dsp, inter, lat, dw1, dw3), f_dual, b_dual, reps)
                    tm._wgrad_w13(da, db, xs, dsp, inter, lat, dw1, dw3)
                    ref_out[form] = [dw1[:, :256].float().clone(), dw3[-64:, :, :256].float().clone()]
                    dw2 = dw1.view(e, lat, inter)
                    record(f"wgrad-{form}", T, "dW2",
                           lambda: tm._wgrad(xs, db, dsp, lat, inter, dw2), f_one, b_one, reps)
                    tm._wgrad(xs, db, dsp, lat, inter, dw2)
                    ref_out[form].append(dw2[:, :256].float().clone())
            if len(ref_out) == 2:
                errs = [rel(a_, b_) for a_, b_ in zip(ref_out["tile"], ref_out["auto"])]
                notes.append(f"T={T}: wgrad tile vs auto rel-RMS (dW1 part, dW3 part, dW2 part) = "
                             + ", ".join(f"{x_:.1e}" for x_ in errs))
                print("  " + notes[-1], flush=True)
            da = db = xs = dw1 = dw3 = ref_out = None  # (not del: the lambdas above close over these names)
            xl = (x @ p["wd"].t()).requires_grad_()
        if dev == "cuda":
            torch.cuda.empty_cache()
        if args.no_bwd:
            return
        ws = {kk: p[kk].detach().requires_grad_() for kk in ("w1", "w3", "w2")}
        wtg = wt.clone().requires_grad_()
        gu = torch.randn(T, lat, device=dev, dtype=dt)
        for form, fields in WGRAD_FORMS.items():
            def estep():
                u = tm.moe_experts(xl, idx, wtg, ws["w1"], ws["w3"], ws["w2"])
                gr = torch.autograd.grad(u, (xl, wtg, ws["w1"], ws["w3"], ws["w2"]), gu)
                del gr, u

            with tm.config(**fields):
                if dev == "cuda":
                    torch.cuda.empty_cache()
                record(f"triton:wgrad-{form}", T, "experts fwd+bwd", estep, 3 * 6.0 * nk * lat * inter,
                       3 * wbytes_exp + 4 * T * lat * 2, reps * 2)
        xl = wtg = gu = ws = None  # (not del: estep closes over these names)
        if dev == "cuda":
            torch.cuda.empty_cache()

    for T in tokens:
        print(f"== T = {T}", flush=True)
        x = rnd(T, d, scale=1.0)
        nk = T * k
        f_exp = 6.0 * nk * lat * inter
        f_dense = 2.0 * T * d * e + 4.0 * T * d * lat + 6.0 * T * d * i_s
        act_bytes = 2 * T * lat * 2
        if args.wgrad_compare:
            wgrad_compare(T, x)
        if args.no_layer and args.wgrad_compare:
            emit()
            continue
        with torch.no_grad():
            idx, wt, _ = tm.qb_route(x, p["rw"], p["rb"], top_k=k, routed_scaling=scaling)
            xl = x @ p["wd"].t()
            load = tm.expert_load(idx, e)
            print(f"  expert load max/mean {float(load.max()) / (nk / e):.2f}, empty experts "
                  f"{int((load == 0).sum())}", flush=True)
            # correctness beside the timing: the two fast paths agree, and on a token subset with
            # the float32 reference
            u_t = tm.moe_experts(xl, idx, wt, p["w1"], p["w3"], p["w2"])
            u_g = gmm_experts(xl, idx, wt, p["w1"], p["w3"], p["w2"])
            sub = slice(0, min(T, 256))
            from backends.reference import moe as ref
            u_r = ref.moe_experts(xl[sub].float(), idx[sub], wt[sub], p["w1"], p["w3"], p["w2"])
            err_g, err_r = rel(u_t, u_g), rel(u_t[sub], u_r)
            notes.append(f"T={T}: rel-RMS(triton vs grouped_mm) = {err_g:.2e}; vs float32 reference "
                         f"(first {sub.stop} tokens) = {err_r:.2e}")
            print("  " + notes[-1], flush=True)
            del u_t, u_g, u_r
            ebytes = wbytes_exp + act_bytes
            record("triton", T, "experts fwd", lambda: tm.moe_experts(xl, idx, wt, p["w1"], p["w3"], p["w2"]),
                   f_exp, ebytes, reps)
            record("gmm", T, "experts fwd", lambda: gmm_experts(xl, idx, wt, p["w1"], p["w3"], p["w2"]),
                   f_exp, ebytes, reps)
            record("loop", T, "experts fwd", lambda: loop_experts(xl, idx, wt, p["w1"], p["w3"], p["w2"]),
                   f_exp, ebytes, reps)
            if args.variants and not args.cpu_smoke:
                trials = {
                    "glu-gather": {"glu_fwd": dict(A_TMA=False)},
                    "mm128x128s4": {"mm": dict(BN=128, num_stages=4)},
                    # every m-tile at full height (HALF: see MoeConfig.half_tile_max_rows)
                    "no-half": {"glu_fwd": dict(HALF=False), "mm": dict(HALF=False)},
                }
                for name, ch in trials.items():
                    with trial(tm, ch):
                        record("triton:" + name, T, "experts fwd",
                               lambda: tm.moe_experts(xl, idx, wt, p["w1"], p["w3"], p["w2"]), f_exp, ebytes, reps)
            lbytes = wbytes_exp + wbytes_dense + 2 * T * d * 2
            for impl in ("triton", "gmm", "loop"):
                layer = make_layer(impl, tm)
                record(impl, T, "layer fwd", lambda: layer(x, p, k, scaling), f_exp + f_dense, lbytes, reps)
            xl = None  # (not del: the timed lambdas close over it)
        if args.no_bwd:
            emit()
            continue
        # forward + backward of the layer: gradients for x and every weight (not the bias buffer),
        # returned by autograd.grad and dropped (no .grad accumulation)
        leaves = {kk: v.detach().requires_grad_(kk != "rb") for kk, v in p.items()}
        xg = x.detach().requires_grad_()
        inputs = [xg] + [leaves[kk] for kk in ("rw", "wd", "nw", "wu", "w1", "w3", "w2", "s1", "s3", "s2")]
        gy = torch.randn(T, d, device=dev, dtype=dt)
        bbytes = 3 * (wbytes_exp + wbytes_dense) + 6 * T * d * 2
        # the routed experts alone, forward + backward (x, topk_weight, w1, w3, w2)
        with torch.no_grad():
            idx, wt, _ = tm.qb_route(x, p["rw"], p["rb"], top_k=k, routed_scaling=scaling)
            xl = (x @ p["wd"].t()).requires_grad_()
        wtg = wt.clone().requires_grad_()
        gu = torch.randn(T, lat, device=dev, dtype=dt)
        def estep(fn):
            """One forward+backward of the experts fn (tm.moe_experts or gmm_experts); the gradients dropped."""
            u = fn(xl, idx, wtg, leaves["w1"], leaves["w3"], leaves["w2"])
            torch.autograd.grad(u, (xl, wtg, leaves["w1"], leaves["w3"], leaves["w2"]), gu)

        for impl, fn in (("triton", tm.moe_experts), ("gmm", gmm_experts)):
            if dev == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if record(impl, T, "experts fwd+bwd", lambda fn=fn: estep(fn), 3 * f_exp, 3 * wbytes_exp + 4 * T * lat * 2, reps * 2) and dev == "cuda":
                notes.append(f"{impl} experts fwd+bwd T={T}: peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        if args.phases and dev == "cuda":
            notes.append(f"triton experts fwd+bwd T={T} phases (ms, median of 5): " + experts_phases(
                tm, lambda: tm.moe_experts(xl, idx, wtg, leaves["w1"], leaves["w3"], leaves["w2"]),
                (xl, wtg, leaves["w1"], leaves["w3"], leaves["w2"]), gu))
            print("  " + notes[-1], flush=True)
        if args.variants and dev == "cuda":
            # backward settings beside the default
            trials = {
                # the weight gradients by the tile kernel on 128 x 256 tiles at every size
                "wgrad-wide": {"wgrad_few_rows": 0},
                # every token-side m-tile at full height
                "no-half": {n_: dict(HALF=False) for n_ in ("glu_fwd", "mm", "dx", "glu_bwd_mm")},
            }

            for name, ch in trials.items():
                with trial(tm, ch):
                    torch.cuda.empty_cache()
                    record("triton:" + name, T, "experts fwd+bwd", lambda: estep(tm.moe_experts), 3 * f_exp,
                           3 * wbytes_exp + 4 * T * lat * 2, reps * 2)
        xl = wtg = gu = None  # (not del: the timed closures read these names)
        # the baseline first: its peak is the higher one (~126 of 139 GiB at 32768 tokens), and after our layer had
        # run, the caching allocator retried 6 times in each of its timings (15th session; the same live memory)
        for impl in ("gmm", "triton", "loop", "mix"):
            if impl == "loop" and (T > 8192 or not args.loop_bwd):
                continue
            if impl == "mix" and not args.variants:
                continue
            layer = make_layer(impl, tm)

            def step():
                y = layer(xg, leaves, k, scaling)
                gr = torch.autograd.grad(y, inputs, gy)
                del gr, y

            if dev == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                print(f"  (live before {impl} layer fwd+bwd: {torch.cuda.memory_allocated() / 2**30:.2f} GiB)", flush=True)
            if args.power and dev == "cuda":
                with PowerSampler() as ps:
                    record(impl, T, "layer fwd+bwd", step, 3 * (f_exp + f_dense), bbytes, reps * 2)
                notes.append(f"{impl} layer fwd+bwd T={T} while timed: {ps.summary()}")
            else:
                record(impl, T, "layer fwd+bwd", step, 3 * (f_exp + f_dense), bbytes, reps * 2)
            if args.profile and dev == "cuda":
                profile_steps(step, f"{impl} layer fwd+bwd T={T}")
        leaves = xg = inputs = gy = None  # (not del: the timed closures read these names)
        if dev == "cuda":
            torch.cuda.empty_cache()
        emit()

    emit(final=True)

if __name__ == "__main__":
    main()
