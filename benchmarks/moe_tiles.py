"""Launch-setting sweep of the K3 MoE experts' grouped GEMMs, one kernel at a time (H200, bf16).

Times each token-side grouped GEMM (GEMM 1 + SiTU-GLU, GEMM 2, the backward's G = du w2 in its fused and split
forms, the split form's row pass alone, dx) and the weight-gradient kernels (dW1|dW3, dW2) of backends.triton.moe
under several TILE_CONFIGS / WGRAD_IMPL settings, at the K3 layer's shapes (896 experts, top-16, latent 3584,
intermediate 3072) with uniform random routing and random operands.  Each row: median ms
(triton.testing.do_bench), TFLOP/s of the nominal GEMM work, and for the weight gradients the rate at which the
gradient itself is written (its bytes are the floor at few rows per expert; for the row pass its whole traffic);
err = relative difference of the output against the first setting of the same kernel (0 unless a setting changes
the summation order).  The defaults in backends/triton/moe.py cite this script's 9th- and 10th-session numbers.

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

# v1 weight-gradient tiles with two or three programs per SM (so that one program's stores overlap another's
# products), for both weight-gradient sweeps: (label, "wgrad" settings)
_V1_TILES = [("128x128 s2 nreg128", dict(BN=128, num_stages=2, maxnreg=128)),
             ("128x128 nw4 s2", dict(BN=128, num_warps=4, num_stages=2)),
             ("128x128 nw4 s3", dict(BN=128, num_warps=4, num_stages=3)),
             ("128x128 nw4 s2 nreg168", dict(BN=128, num_warps=4, num_stages=2, maxnreg=168)),
             ("128x64 nw4 s3", dict(BN=64, num_warps=4, num_stages=3)),
             ("64x128 nw4 s3", dict(BM=64, BN=128, num_warps=4, num_stages=3)),
             ("128x128 nw4 BK32 s4", dict(BN=128, BK=32, num_warps=4, num_stages=4)),
             # O_TMA: the output tile stored through a TMA descriptor (12th session)
             ("128x128 nw4 s2 nreg168 TMA", dict(BN=128, num_warps=4, num_stages=2, maxnreg=168, O_TMA=True)),
             ("128x128 nw4 s2 TMA", dict(BN=128, num_warps=4, num_stages=2, O_TMA=True)),
             ("128x128 nw4 BK32 s3 TMA", dict(BN=128, BK=32, num_warps=4, num_stages=3, O_TMA=True)),
             ("128x128 nw4 BK32 s3 nreg168 TMA", dict(BN=128, BK=32, num_warps=4, num_stages=3, maxnreg=168, O_TMA=True)),
             ("128x128 nw4 BK32 s2 nreg168 TMA", dict(BN=128, BK=32, num_warps=4, num_stages=2, maxnreg=168, O_TMA=True)),
             ("128x128 nw4 BK32 s4 nreg168 TMA", dict(BN=128, BK=32, num_warps=4, num_stages=4, maxnreg=168, O_TMA=True)),
             ("128x128 nw4 BK16 s4 nreg168 TMA", dict(BN=128, BK=16, num_warps=4, num_stages=4, maxnreg=168, O_TMA=True)),
             ("128x256 nw8 BK32 s3 TMA", dict(BN=256, BK=32, num_warps=8, num_stages=3, O_TMA=True)),
             ("128x64 nw4 s3 TMA", dict(BN=64, num_warps=4, num_stages=3, O_TMA=True)),
             ("64x128 nw4 s3 TMA", dict(BM=64, BN=128, num_warps=4, num_stages=3, O_TMA=True)),
             ("128x128 nw8 s2 TMA", dict(BN=128, num_warps=8, num_stages=2, O_TMA=True))]

# v1 on 128 x 256 tiles with shallower K blocks / deeper rings (14th session; at 585 rows per expert a 64-row block
# leaves 55 rows of padding in the last K step, a 32-row block 23)
_V1_WIDE = [("v1w 128x256 BK32 s4", {"WGRAD_IMPL": "v1", "wgrad": dict(BK=32, num_stages=4)}),
            ("v1w 128x256 BK32 s5", {"WGRAD_IMPL": "v1", "wgrad": dict(BK=32, num_stages=5)}),
            ("v1w 128x256 BK32 s6", {"WGRAD_IMPL": "v1", "wgrad": dict(BK=32, num_stages=6)}),
            ("v1w 128x256 s4", {"WGRAD_IMPL": "v1", "wgrad": dict(num_stages=4)}),
            ("v1w 256x128 BK32 s4", {"WGRAD_IMPL": "v1", "wgrad": dict(BM=256, BN=128, BK=32, num_stages=4)})]

# v2 (persistent) on v1's few-row tiles: 4 warps, 32-row K blocks, 3 programs per SM, TMA stores (12th session)
_V2_FEW = [("v2 p3 128x128 nw4 BK32 s3 nreg168 O_TMA", {"WGRAD_IMPL": "v2", "wgrad2": dict(
               BK=32, num_warps=4, num_stages=3, PROGS_PER_SM=3, maxnreg=168, O_TMA=True)}),
           ("v2 p3 128x128 nw4 BK32 s3 nreg168 O_TMA ptr loads", {"WGRAD_IMPL": "v2", "wgrad2": dict(
               BK=32, num_warps=4, num_stages=3, PROGS_PER_SM=3, maxnreg=168, O_TMA=True, P_TMA=False, Q_TMA=False)}),
           ("v2 p2 128x128 nw4 BK32 s3 O_TMA", {"WGRAD_IMPL": "v2", "wgrad2": dict(
               BK=32, num_warps=4, num_stages=3, PROGS_PER_SM=2, maxnreg=None, O_TMA=True)}),
           # one tile per program (not persistent): v1's schedule with TMA loads of the full K blocks and a peeled
           # masked tail; the ncu profile of v1 at 8192 tokens shows the ALU (address and mask arithmetic of the
           # pointer loads) as its busiest pipe, 43% (prepared in the 12th session, not yet timed)
           ("v2 1-tile 128x128 nw4 BK32 s3 O_TMA", {"WGRAD_IMPL": "v2", "wgrad2": dict(
               BK=32, num_warps=4, num_stages=3, NUM_PROGS=2 ** 31 - 1, maxnreg=None, O_TMA=True)}),
           ("v2 1-tile 128x128 nw4 BK32 s3 nreg168 O_TMA", {"WGRAD_IMPL": "v2", "wgrad2": dict(
               BK=32, num_warps=4, num_stages=3, NUM_PROGS=2 ** 31 - 1, maxnreg=168, O_TMA=True)})]

# v3 with the held P^T depth following each expert's row count in KX steps (experts grouped by depth; 13th session)
_V3X = [("v3x 128x64 KX32", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64, KX=32)}),
        ("v3x 128x64 nw4 KX32", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64, num_warps=4, KX=32)}),
        ("v3x 128x128 KX32", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=128, KX=32)}),
        ("v3x 256x64 KX32", {"WGRAD_IMPL": "v3", "wgrad3": dict(BM=256, BN=64, KX=32)}),
        ("v3x 256x128 KX32", {"WGRAD_IMPL": "v3", "wgrad3": dict(BM=256, BN=128, KX=32)}),
        ("v3x 128x64 KX16", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64, KX=16)}),
        ("v3x 128x64 KX32 s4", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64, KX=32, num_stages=4)}),
        ("v3x 128x128 KX32 s2", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=128, KX=32, num_stages=2)}),
        ("v3x 128x128 nw4 KX32", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=128, num_warps=4, KX=32)}),
        ("v3x 128x32 nw4 KX32", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=32, num_warps=4, KX=32)}),
        # O_TMA: the gradient tile leaves through shared memory and the copy engine
        ("v3x 128x128 KX32 TMA", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=128, KX=32, O_TMA=True)}),
        ("v3x 128x128 KX32 s2 TMA", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=128, KX=32, num_stages=2, O_TMA=True)}),
        ("v3x 256x64 KX32 TMA", {"WGRAD_IMPL": "v3", "wgrad3": dict(BM=256, BN=64, KX=32, O_TMA=True)}),
        ("v3x 128x64 nw4 KX32 TMA", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64, num_warps=4, KX=32, O_TMA=True)}),
        ("v3x 128x64 nw4 KX32 s2 TMA", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64, num_warps=4, KX=32, num_stages=2,
                                                                           O_TMA=True)}),
        ("v3x 128x64 KX32 TMA", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64, KX=32, O_TMA=True)})]


def _all_rows_tails(entry, prefix="", stages64=None):
    """Sweep rows with the swapped tails (TAIL 32 / 64, HALF off / on) at any rows per expert: HALF_TILE_MAX_ROWS
    raised past the 32768-token layer's 585 rows (= 3 x 160 + 105); stages64: TAIL_STAGES at TAIL 64."""
    return [(f"{prefix}all-rows TAIL{t}{' HALF' if h else ''}",
             {"HALF_TILE_MAX_ROWS": 1 << 30,
              entry: dict(TAIL=t, HALF=h, **({"TAIL_STAGES": stages64} if stages64 and t == 64 else {}))})
            for t in (32, 64) for h in (False, True)]


# kernel -> [(label, {TILE_CONFIGS entry or "GLU_BWD_IMPL"/"WGRAD_IMPL": change})]
SWEEPS = {
    # BM64 rows: 64-row tiles (146 rows per expert at 8192 tokens pad to 192 instead of 256); HALF: 128-row tiles, an
    # expert's last tile at 64 rows when it has at most 64 (12th session)
    "glu_fwd": [("default", {}), ("s4", {"glu_fwd": dict(num_stages=4)}), ("BN64 s4", {"glu_fwd": dict(BN=64, num_stages=4)}),
                ("BM64", {"glu_fwd": dict(BM=64)}), ("BM64 s4", {"glu_fwd": dict(BM=64, num_stages=4)}),
                ("BM64 nw4 s4", {"glu_fwd": dict(BM=64, num_warps=4, num_stages=4)}),
                ("HALF", {"glu_fwd": dict(HALF=True)}),
                # two programs per SM (smaller tiles or fewer stages), so that one's SiTU epilogue overlaps the other's
                # K loop (13th session)
                ("BN64 s3", {"glu_fwd": dict(BN=64)}), ("BN64 nw4 s3", {"glu_fwd": dict(BN=64, num_warps=4)}),
                ("BN64 nw4 s2", {"glu_fwd": dict(BN=64, num_warps=4, num_stages=2)}),
                ("BK32 s4", {"glu_fwd": dict(BK=32, num_stages=4)}), ("BK32 s6", {"glu_fwd": dict(BK=32, num_stages=6)}),
                ("BN64 s3 nreg128", {"glu_fwd": dict(BN=64, maxnreg=128)}),
                # TAIL: 128 + TAIL-row tiles, the tail swapped onto the weight tile (14th session)
                ("TAIL32", {"glu_fwd": dict(TAIL=32)}), ("TAIL32 s3", {"glu_fwd": dict(TAIL=32, TAIL_STAGES=3)}),
                ("TAIL16", {"glu_fwd": dict(TAIL=16)}), ("TAIL64 s3", {"glu_fwd": dict(TAIL=64, TAIL_STAGES=3)}),
                *_all_rows_tails("glu_fwd", stages64=3)],
    "mm": [("default", {}), ("s4", {"mm": dict(num_stages=4)}),
           ("128x128 s4 nreg128", {"mm": dict(BN=128, num_stages=4, maxnreg=128)}),
           ("BM64", {"mm": dict(BM=64)}), ("BM64 s4", {"mm": dict(BM=64, num_stages=4)}),
           ("BM64 nw4 s4", {"mm": dict(BM=64, num_warps=4, num_stages=4)}), ("HALF", {"mm": dict(HALF=True)}),
           ("TAIL32", {"mm": dict(TAIL=32)}), ("TAIL16", {"mm": dict(TAIL=16)}),
           ("TAIL32 s4", {"mm": dict(TAIL=32, TAIL_STAGES=4)}), ("TAIL64", {"mm": dict(TAIL=64)}),
           ("TAIL32 128x128 s4", {"mm": dict(BN=128, TAIL=32, num_stages=4)}),
           *_all_rows_tails("mm")],
    "glu_bwd": [("fused 128x64 s3", {"glu_bwd": {}}), ("fused s4", {"glu_bwd": dict(num_stages=4)}),
                ("fused s6", {"glu_bwd": dict(num_stages=6)}), ("fused nreg128", {"glu_bwd": dict(maxnreg=128)}),
                ("fused 128x128 s4", {"glu_bwd": dict(BN=128, num_stages=4)}),
                ("fused 64x128 s4", {"glu_bwd": dict(BM=64, BN=128, num_stages=4)}),
                ("split 128x256 s3", {"glu_bwd_mm": {}}), ("split s4", {"glu_bwd_mm": dict(num_stages=4)}),
                ("split BM64", {"glu_bwd_mm": dict(BM=64)}), ("split BM64 s4", {"glu_bwd_mm": dict(BM=64, num_stages=4)}),
                ("split HALF", {"glu_bwd_mm": dict(HALF=True)}),
                ("split TAIL32", {"glu_bwd_mm": dict(TAIL=32)}), ("split TAIL16", {"glu_bwd_mm": dict(TAIL=16)}),
                ("split TAIL32 s4", {"glu_bwd_mm": dict(TAIL=32, TAIL_STAGES=4)}),
                *_all_rows_tails("glu_bwd_mm", "split ")],
    # the split GLU backward's row pass alone (G given): dA, dB over the saved pre-activations, d topk_weight
    "glu_rows": [("4 x 1024 nw8", {}), ("8 x 1024 nw8", {"glu_bwd_rows": dict(BLOCK_R=8)}),
                 ("2 x 1024 nw4", {"glu_bwd_rows": dict(BLOCK_R=2, num_warps=4)}),
                 ("1 x 4096 nw8", {"glu_bwd_rows": dict(BLOCK_R=1, BLOCK_N=4096)}),
                 ("4 x 512 nw4", {"glu_bwd_rows": dict(BLOCK_N=512, num_warps=4)})],
    "dx": [("pair3 128x256 (default)", {}), ("pair3 128x256 s4", {"dx": dict(num_stages=4)}),
           ("pair2 128x128 (9th-session default)", {"dx": dict(BN=128, PAIR=2)}),
           ("pair2 128x64 s4 nreg128", {"dx": dict(BN=64, PAIR=2, num_stages=4, maxnreg=128)}),
           ("pair3 BM64", {"dx": dict(BM=64)}), ("pair3 BM64 s4", {"dx": dict(BM=64, num_stages=4)}),
           ("pair3 BM64 nw4 s4", {"dx": dict(BM=64, num_warps=4, num_stages=4)}), ("pair3 HALF", {"dx": dict(HALF=True)}),
           ("pair3 TAIL32", {"dx": dict(TAIL=32)}), ("pair3 TAIL16", {"dx": dict(TAIL=16)}),
           ("pair3 TAIL32 s4", {"dx": dict(TAIL=32, TAIL_STAGES=4)}), ("pair3 TAIL64", {"dx": dict(TAIL=64)}),
           *_all_rows_tails("dx", "pair3 ")],
    "wgrad13": [("v1 dual", {"WGRAD_IMPL": "v1", "wgrad_dual": dict(DUAL=True)}), *_V3X, *_V2_FEW, *_V1_WIDE,
                ("v1 2x 128x128", {"WGRAD_IMPL": "v1", "wgrad": dict(BN=128)}),
                ("v1 2x 128x256", {"WGRAD_IMPL": "v1"}),
                ("v2 dual", {"WGRAD_IMPL": "v2", "wgrad_dual": dict(DUAL=True)}),
                ("v2 dual O_TMA", {"WGRAD_IMPL": "v2", "wgrad_dual": dict(DUAL=True), "wgrad2_dual": dict(O_TMA=True)}),
                ("v2 2x", {"WGRAD_IMPL": "v2"}), ("v3", {"WGRAD_IMPL": "v3"}),
                ("v3 128x64", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64)}),
                *[("v1 2x " + lab, {"WGRAD_IMPL": "v1", "wgrad": t}) for lab, t in _V1_TILES],
                ("v3 128x64 nw4", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64, num_warps=4)})],
    "wgrad2": [("v1 128x128", {"WGRAD_IMPL": "v1", "wgrad": dict(BN=128)}), ("v1 128x256", {"WGRAD_IMPL": "v1"}),
               *_V1_WIDE,
               *_V3X, *[(lab, ch) for lab, ch in _V2_FEW],
               ("v1 128x256 s2", {"WGRAD_IMPL": "v1", "wgrad": dict(num_stages=2)}), ("v2", {"WGRAD_IMPL": "v2"}),
               ("v2 O_TMA", {"WGRAD_IMPL": "v2", "wgrad2": dict(O_TMA=True)}), ("v3", {"WGRAD_IMPL": "v3"}),
               ("v3 128x64", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64)}),
               *[("v1 " + lab, {"WGRAD_IMPL": "v1", "wgrad": t}) for lab, t in _V1_TILES],
               ("v3 128x64 nw4", {"WGRAD_IMPL": "v3", "wgrad3": dict(BN=64, num_warps=4)})],
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
                         "are the interpreter's; the implementations, DUAL and PAIR choices differ)")
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
    # the "wgrad" rows below set v1's tiles at every token count (the backward itself picks "wgrad_few" below
    # WGRAD_FEW_ROWS rows per expert: 128 x 128 nw4 s2 nreg168 here)
    tm.WGRAD_FEW_ROWS = 0
    base = {k: dict(v) for k, v in tm.TILE_CONFIGS[cfg_key].items()}
    base_impl = (tm.GLU_BWD_IMPL, tm.WGRAD_IMPL, tm.HALF_TILE_MAX_ROWS)
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
                                                 w_kn=True, pair=tm._cfg("dx", a).get("PAIR", 2), a2=b, w2=w3), y, 0),
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
                if ch.get("WGRAD_IMPL") == "v3" and rows_max > tm.WGRAD_V3_MAX_ROWS:
                    label += f" (= v1: an expert has {rows_max} > {tm.WGRAD_V3_MAX_ROWS} rows)"
                for kk, v in ch.items():
                    if kk in ("GLU_BWD_IMPL", "WGRAD_IMPL", "HALF_TILE_MAX_ROWS"):
                        setattr(tm, kk, v)
                    else:
                        tm.TILE_CONFIGS[cfg_key][kk] = dict(base[kk], **{
                            c: x for c, x in v.items() if cfg_key == "cuda" or c in ("DUAL", "PAIR")})
                if name == "glu_bwd":
                    tm.GLU_BWD_IMPL = "split" if "glu_bwd_mm" in ch else "fused"
                t0 = time.time()
                try:
                    out.fill_(float("nan"))              # a setting that leaves part of its output unwritten shows
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
                    tm.TILE_CONFIGS[cfg_key].update({kk: dict(v) for kk, v in base.items()})
                    tm.GLU_BWD_IMPL, tm.WGRAD_IMPL, tm.HALF_TILE_MAX_ROWS = base_impl
                    print(f"  ({label}: {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        xs = dus = a = b = hw = y = da = db = g = None  # free them (the closures above read these names)
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
