"""Launch-setting sweep of the K3 MoE experts' grouped GEMMs, one kernel at a time (H200, bf16).

Times each token-side grouped GEMM (GEMM 1 + SiTU-GLU, GEMM 2, the backward's G = du w2, the GLU backward's row
pass alone, dx) and the weight gradients (dW1|dW3, dW2) of backends.triton.moe under several launch settings
(MoeConfig: tile entries, row-count thresholds), at the K3 layer's shapes (896 experts, top-16, latent 3584,
intermediate 3072) with uniform random routing and random operands.  Each row: median ms
(triton.testing.do_bench), TFLOP/s of the nominal GEMM work, and for the weight gradients the rate at which the
gradient itself is written (its bytes are the floor at few rows per expert; for the row pass its whole traffic);
err = relative difference of the output against the first setting of the same kernel (0 unless a setting changes
the summation order).  The measured history of the defaults: benchmarks/results/moe.md.

Usage (GPU):  python benchmarks/moe_tiles.py --tokens 8192 32768 [--kernels glu_bwd,wgrad13]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

E, L, I, K = 896, 3584, 3072, 16

# Each setting: {tile entry: its changed settings, or a MoeConfig field: value}, over BASE. The weight-gradient rows
# run the tile kernel for every expert (BASE: wgrad_few_rows 0) unless a row asks for the held kernel (HELD).
BASE = {"wgrad_few_rows": 0}
HELD = {"wgrad_few_rows": 1 << 30}

# tile-kernel weight-gradient tiles with two or three programs per SM (so that one program's stores overlap another's
# products), for both weight-gradient sweeps: (label, "wgrad" settings)
_TILE_TILES = [("128x128 nw4 s2", dict(BN=128, num_warps=4, num_stages=2)),
               ("128x128 nw4 s3", dict(BN=128, num_warps=4, num_stages=3)),
               ("128x64 nw4 s3", dict(BN=64, num_warps=4, num_stages=3)),
               ("64x128 nw4 s3", dict(BM=64, BN=128, num_warps=4, num_stages=3)),
               ("128x128 nw4 BK32 s4", dict(BN=128, BK=32, num_warps=4, num_stages=4)),
               # O_TMA: the output tile stored through a TMA descriptor
               ("128x128 nw4 s2 TMA", dict(BN=128, num_warps=4, num_stages=2, O_TMA=True)),
               ("128x128 nw4 BK32 s3 TMA", dict(BN=128, BK=32, num_warps=4, num_stages=3, O_TMA=True)),
               ("128x256 nw8 BK32 s3 TMA", dict(BN=256, BK=32, num_warps=8, num_stages=3, O_TMA=True)),
               ("128x64 nw4 s3 TMA", dict(BN=64, num_warps=4, num_stages=3, O_TMA=True)),
               ("64x128 nw4 s3 TMA", dict(BM=64, BN=128, num_warps=4, num_stages=3, O_TMA=True)),
               ("128x128 nw8 s2 TMA", dict(BN=128, num_warps=8, num_stages=2, O_TMA=True))]

# the tile kernel on 128 x 256 tiles with shallower K blocks / deeper rings (at 585 rows per expert a 64-row block
# leaves 55 rows of padding in the last K step, a 32-row block 23)
_TILE_WIDE = [("tile 128x256 BK32 s4", {"wgrad": dict(BK=32, num_stages=4)}),
              ("tile 128x256 BK32 s5", {"wgrad": dict(BK=32, num_stages=5)}),
              ("tile 128x256 BK32 s6", {"wgrad": dict(BK=32, num_stages=6)}),
              ("tile 128x256 s4", {"wgrad": dict(num_stages=4)}),
              ("tile 256x128 BK32 s4", {"wgrad": dict(BM=256, BN=128, BK=32, num_stages=4)})]

# the held kernel, its depth following each expert's row count in KX steps (experts grouped by depth)
_HELD = [("held 128x64 KX32", dict(HELD, wgrad_held=dict(BN=64, KX=32))),
         ("held 128x64 nw4 KX32", dict(HELD, wgrad_held=dict(BN=64, num_warps=4, KX=32))),
         ("held 256x64 KX32", dict(HELD, wgrad_held=dict(BM=256, BN=64, KX=32))),
         ("held 256x128 KX32", dict(HELD, wgrad_held=dict(BM=256, BN=128, KX=32))),
         ("held 128x64 KX16", dict(HELD, wgrad_held=dict(BN=64, KX=16))),
         ("held 128x64 KX32 s4", dict(HELD, wgrad_held=dict(BN=64, KX=32, num_stages=4))),
         ("held 128x128 KX32 s2", dict(HELD, wgrad_held=dict(BN=128, KX=32, num_stages=2))),
         ("held 128x128 nw4 KX32", dict(HELD, wgrad_held=dict(BN=128, num_warps=4, KX=32))),
         ("held 128x32 nw4 KX32", dict(HELD, wgrad_held=dict(BN=32, num_warps=4, KX=32))),
         # O_TMA: the gradient tile leaves through shared memory and the copy engine
         ("held 128x128 KX32 TMA", dict(HELD, wgrad_held=dict(BN=128, KX=32, O_TMA=True))),
         ("held 256x64 KX32 TMA", dict(HELD, wgrad_held=dict(BM=256, BN=64, KX=32, O_TMA=True))),
         ("held 128x64 nw4 KX32 TMA", dict(HELD, wgrad_held=dict(BN=64, num_warps=4, KX=32, O_TMA=True)))]


def _all_rows_tails(entry, prefix="", stages64=None):
    """Sweep rows with the swapped tails (TAIL 32 / 64, HALF off / on) at any rows per expert: half_tile_max_rows
    raised past the 32768-token layer's 585 rows (= 3 x 160 + 105); stages64: TAIL_STAGES at TAIL 64."""
    return [(f"{prefix}all-rows TAIL{t}{' HALF' if h else ''}",
             {"half_tile_max_rows": 1 << 30,
              entry: dict(TAIL=t, HALF=h, **({"TAIL_STAGES": stages64} if stages64 and t == 64 else {}))})
            for t in (32, 64) for h in (False, True)]


# kernel -> [(label, change)]
SWEEPS = {
    # BM64 rows: 64-row tiles (146 rows per expert at 8192 tokens pad to 192 instead of 256); HALF: 128-row tiles, an
    # expert's last tile at 64 rows when it has at most 64
    "glu_fwd": [("default", {}), ("s3", {"glu_fwd": dict(num_stages=3)}),
                ("BN64 s4", {"glu_fwd": dict(BN=64, num_stages=4)}),
                ("BM64", {"glu_fwd": dict(BM=64)}), ("BM64 s4", {"glu_fwd": dict(BM=64, num_stages=4)}),
                ("BM64 nw4 s4", {"glu_fwd": dict(BM=64, num_warps=4, num_stages=4)}),
                ("no HALF", {"glu_fwd": dict(HALF=False)}),
                # two programs per SM (smaller tiles or fewer stages), so that one's SiTU epilogue overlaps the other's
                # K loop
                ("BN64 s3", {"glu_fwd": dict(BN=64, num_stages=3)}),
                ("BN64 nw4 s3", {"glu_fwd": dict(BN=64, num_warps=4, num_stages=3)}),
                ("BN64 nw4 s2", {"glu_fwd": dict(BN=64, num_warps=4, num_stages=2)}),
                ("BK32 s4", {"glu_fwd": dict(BK=32, num_stages=4)}), ("BK32 s6", {"glu_fwd": dict(BK=32, num_stages=6)}),
                # TAIL: 128 + TAIL-row tiles, the tail swapped onto the weight tile
                ("no TAIL", {"glu_fwd": dict(TAIL=None)}), ("TAIL32 s3", {"glu_fwd": dict(TAIL_STAGES=3)}),
                ("TAIL16", {"glu_fwd": dict(TAIL=16)}), ("TAIL64 s3", {"glu_fwd": dict(TAIL=64, TAIL_STAGES=3)}),
                *_all_rows_tails("glu_fwd", stages64=3)],
    "mm": [("default", {}), ("s4", {"mm": dict(num_stages=4)}),
           ("BM64", {"mm": dict(BM=64)}), ("BM64 s4", {"mm": dict(BM=64, num_stages=4)}),
           ("BM64 nw4 s4", {"mm": dict(BM=64, num_warps=4, num_stages=4)}), ("no HALF", {"mm": dict(HALF=False)}),
           ("no TAIL", {"mm": dict(TAIL=None)}), ("TAIL16", {"mm": dict(TAIL=16)}),
           ("TAIL32 s3", {"mm": dict(TAIL_STAGES=3)}), ("TAIL64", {"mm": dict(TAIL=64)}),
           ("TAIL32 128x128 s4", {"mm": dict(BN=128, num_stages=4)}),
           *_all_rows_tails("mm")],
    # the backward's G = du w2 GEMM (then the row pass, as the backward runs them)
    "glu_bwd": [("128x256 s3", {}), ("s4", {"glu_bwd_mm": dict(num_stages=4)}),
                ("BM64", {"glu_bwd_mm": dict(BM=64)}), ("BM64 s4", {"glu_bwd_mm": dict(BM=64, num_stages=4)}),
                ("no HALF", {"glu_bwd_mm": dict(HALF=False)}),
                ("no TAIL", {"glu_bwd_mm": dict(TAIL=None)}), ("TAIL16", {"glu_bwd_mm": dict(TAIL=16)}),
                ("TAIL32 s3", {"glu_bwd_mm": dict(TAIL_STAGES=3)}),
                *_all_rows_tails("glu_bwd_mm")],
    # the GLU backward's row pass alone (G given): dA, dB over the saved pre-activations, d topk_weight
    "glu_rows": [("4 x 1024 nw8", {}), ("8 x 1024 nw8", {"glu_bwd_rows": dict(BLOCK_R=8)}),
                 ("2 x 1024 nw4", {"glu_bwd_rows": dict(BLOCK_R=2, num_warps=4)}),
                 ("1 x 4096 nw8", {"glu_bwd_rows": dict(BLOCK_R=1, BLOCK_N=4096)}),
                 ("4 x 512 nw4", {"glu_bwd_rows": dict(BLOCK_N=512, num_warps=4)})],
    "dx": [("128x256 (default)", {}), ("s4", {"dx": dict(num_stages=4)}),
           ("BM64", {"dx": dict(BM=64)}), ("BM64 s4", {"dx": dict(BM=64, num_stages=4)}),
           ("BM64 nw4 s4", {"dx": dict(BM=64, num_warps=4, num_stages=4)}), ("no HALF", {"dx": dict(HALF=False)}),
           ("no TAIL", {"dx": dict(TAIL=None)}), ("TAIL16", {"dx": dict(TAIL=16)}),
           ("TAIL32 s3", {"dx": dict(TAIL_STAGES=3)}), ("TAIL64", {"dx": dict(TAIL=64)}),
           *_all_rows_tails("dx")],
    "wgrad13": [("tile 128x256", {}), ("held (default below wgrad_few_rows)", dict(HELD)), *_HELD, *_TILE_WIDE,
                ("tile 128x128", {"wgrad": dict(BN=128)}),
                *[("tile " + lab, {"wgrad": t}) for lab, t in _TILE_TILES]],
    "wgrad2": [("tile 128x256", {}), ("held (default below wgrad_few_rows)", dict(HELD)), *_HELD, *_TILE_WIDE,
               ("tile 128x128", {"wgrad": dict(BN=128)}), ("tile 128x256 s2", {"wgrad": dict(num_stages=2)}),
               *[("tile " + lab, {"wgrad": t}) for lab, t in _TILE_TILES]],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="token counts (default 8192 32768; with --cpu-smoke 37)")
    ap.add_argument("--kernels", default=",".join(SWEEPS), help="comma list of " + ", ".join(SWEEPS))
    ap.add_argument("--rep", type=int, default=300, help="do_bench repetition budget in ms")
    ap.add_argument("--match", action="append", default=None, metavar="TEXT",
                    help="time only the settings whose label contains TEXT (repeatable; the first setting of each "
                         "kernel always runs: the others' err column is against it)")
    ap.add_argument("--routing", choices=("random", "balanced"), default="random",
                    help="random: each token's top-k of random scores (rows per expert ~ binomial: 146 +- 12 at 8192 "
                         "tokens); balanced: token t goes to experts (t*k + j) mod E, j < k, so every expert gets "
                         "tokens*k/E rows, +-1 (7168 tokens: exactly 128, no tail tile)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes (E 6, top-2, 48 x 40) under Triton's interpreter on the CPU, float32, no timing: "
                         "checks the script and that every setting writes the same result (on the CPU the tile sizes "
                         "are the interpreter's: only the MoeConfig fields of a setting apply)")
    args = ap.parse_args(argv)
    if args.tokens is None:
        args.tokens = [37] if args.cpu_smoke else [8192, 32768]
    if any(t < 1 for t in args.tokens):
        ap.error(f"--tokens must be >= 1, got {args.tokens}")
    kernels = args.kernels.split(",")
    bad = [k for k in kernels if k not in SWEEPS]
    if bad:
        ap.error(f"unknown kernel(s) {bad}; choose from {list(SWEEPS)}")
    global E, L, I, K
    if args.cpu_smoke:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--cpu-smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 before triton "
                     "is imported")
        os.environ["TRITON_INTERPRET"] = "1"   # before the first import of triton (below)
        E, L, I, K = 6, 48, 40, 2
        dev, bf, cfg_key = "cpu", torch.float32, "cpu"
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the sweep times Hopper launch settings); --cpu-smoke checks the script on the CPU")
    else:
        dev, bf, cfg_key = "cuda", torch.bfloat16, "cuda"
    import triton
    from backends.triton import moe as tm

    torch.manual_seed(0)
    need_w = any(k in ("glu_fwd", "mm", "glu_bwd", "dx") for k in kernels)
    need_g = any(k.startswith("wgrad") for k in kernels)
    w1 = torch.randn(E, I, L, device=dev, dtype=bf) * 0.02 if need_w else None
    w3 = torch.randn(E, I, L, device=dev, dtype=bf) * 0.02 if need_w else None
    w2 = torch.randn(E, L, I, device=dev, dtype=bf) * 0.02 if need_w else None
    dw1 = torch.empty(E, I, L, device=dev, dtype=bf) if need_g else None
    dw3 = torch.empty_like(dw1) if need_g else None
    dw2 = torch.empty(E, L, I, device=dev, dtype=bf) if need_g else None
    print(f"# grouped-GEMM launch settings, K3 experts (E {E}, top-{K}, latent {L}, intermediate {I}), {str(bf).replace('torch.', '')}, "
          f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU smoke run'}\n\n| tokens | kernel | setting | ms | TFLOP/s | write TB/s | err |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    for T in args.tokens:
        if args.routing == "balanced":
            idx = (torch.arange(T, device=dev)[:, None] * K + torch.arange(K, device=dev)[None, :]) % E
        else:
            idx = torch.randn(T, E, device=dev).topk(K, dim=1).indices
        d = tm._Dispatch(idx, E)
        nk = T * K
        xs = torch.randn(nk, L, device=dev, dtype=bf)   # x[tok] in dispatch order
        dus = torch.randn(nk, L, device=dev, dtype=bf)  # du[tok]
        a, b = torch.randn(nk, I, device=dev, dtype=bf), torch.randn(nk, I, device=dev, dtype=bf)
        # random operands, also for the buffers that a GEMM overwrites: the weight-gradient kernels read hw, da, db,
        # and on zeros (fresh, never written memory) the tensor cores draw less power and clock higher (10th
        # session: dW1|dW3 at 32768 tokens 41.5 ms on never-written da, db against 52.0 on random ones)
        hw, y = torch.randn(nk, I, device=dev, dtype=bf), torch.randn(nk, L, device=dev, dtype=bf)
        wr = torch.rand(nk, device=dev)
        da, db = torch.randn_like(a), torch.randn_like(b)
        sch = lambda name: tm._sched(d, name, xs)  # noqa: E731

        def glu_bwd():  # the backward's own helper, on separate dA / dB buffers so that a and b stay inputs
            tm._glu_backward(d, None, dus, w2, a, b, wr, L, I, 0, 4.0, 25.0, da=da, db=db)

        g = torch.randn_like(a)

        def glu_rows():  # the row pass of the split GLU backward on its own
            tm._glu_bwd_rows(g, a, b, wr, da, db, dwr, 0, 4.0, 25.0)

        dwr = torch.empty(nk, device=dev)

        def wgrad13():
            tm._wgrad_w13(da, db, xs, d, I, L, dw1, dw3)

        calls = {  # kernel -> (flops, fn, output to compare, bytes of the weight gradient written)
            "glu_fwd": (4 * nk * L * I, lambda: tm._gg("glu_fwd", xs, w1, sch("glu_fwd"), d.offs, E, L, I, hw,
                                                      gather=False, tok=d.tok, w_kn=False, pair=1, w2=w3, epi=1,
                                                      save=True, c2=da, c3=db, wrow=wr, row_scale=True, act=0,
                                                      bg=4.0, bu=25.0), hw, 0),
            "mm": (2 * nk * L * I, lambda: tm._gg("mm", hw, w2, sch("mm"), d.offs, E, I, L, y, gather=False,
                                                 w_kn=False), y, 0),
            "glu_bwd": (2 * nk * L * I, glu_bwd, da, 0),
            # (bytes: G, a, b read, dA, dB written, bf16; the "write TB/s" column is the pass's whole traffic)
            "glu_rows": (0, glu_rows, da, 5 * nk * I * 2),
            "dx": (4 * nk * L * I, lambda: tm._gg("dx", a, w1, sch("dx"), d.offs, E, I, L, y, gather=False,
                                                 w_kn=True, pair=3, a2=b, w2=w3), y, 0),
            "wgrad13": (4 * nk * L * I, wgrad13, dw3, 2 * E * L * I * 2),
            "wgrad2": (2 * nk * L * I, lambda: tm._wgrad(dus, hw, d, L, I, dw2), dw2, E * L * I * 2),
        }
        counts = d.offs[1:] - d.offs[:-1]
        rows_max = int(counts.max())
        print(f"  (T={T}, {args.routing} routing: rows per expert min {int(counts.min())}, mean "
              f"{T * K / E:.1f}, max {rows_max})", file=sys.stderr, flush=True)
        for name in kernels:
            flops, fn, out, wbytes = calls[name]
            ref = None
            for si, (label, ch) in enumerate(SWEEPS[name]):
                if si and args.match and not any(m in label for m in args.match):
                    continue
                fields = dict(BASE, **{kk: v for kk, v in ch.items() if not isinstance(v, dict)})
                tiles = {kk: v for kk, v in ch.items() if isinstance(v, dict)} if cfg_key == "cuda" else {}
                held_max = tm.current().wgrad_held_max_rows
                if fields["wgrad_few_rows"] and rows_max > held_max:
                    label += f" (the tile kernel for the experts over {held_max} rows: {rows_max} here)"
                t0 = time.time()
                try:
                    with tm.config(tiles={cfg_key: tiles} if tiles else None, **fields):
                        out.fill_(float("nan"))          # a setting that leaves part of its output unwritten shows
                        fn()
                        if dev == "cuda":
                            torch.cuda.synchronize()
                        got = out[::37].float()
                        ref = got.clone() if ref is None else ref
                        err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
                        ms = triton.testing.do_bench(fn, warmup=2, rep=args.rep) if dev == "cuda" else float("nan")
                    wtb = f"{wbytes / ms / 1e9:.2f}" if wbytes else "-"
                    print(f"| {T} | {name} | {label} | {ms:.3f} | {flops / ms / 1e9:.1f} | {wtb} | {err:.1e} |",
                          flush=True)
                except Exception as ex:  # a setting that does not fit (shared memory, registers) is reported
                    print(f"| {T} | {name} | {label} | failed: {type(ex).__name__}: {str(ex)[:120]} | | | |",
                          flush=True)
                finally:
                    print(f"  ({label}: {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        xs = dus = a = b = hw = y = da = db = g = None  # free them (the closures above read these names)
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
