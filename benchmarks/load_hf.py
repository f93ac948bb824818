"""Loading speed of dsl.from_hf against plain safetensors.torch.load_file, on a generated Kimi Linear checkpoint.

The checkpoint: models/kimi_linear_48b.mtc at d 1024, 8 KDA / MLA heads of 128, 64 experts of 512, vocab 32768,
as many layers as reach --gb (bf16 tensors; each MoE layer about 0.2 GB), written by m.save_hf in shards of
--shard-gb. Both loaders then read the same files (warm in the page cache: they were just written; the first
repetition of each is also reported, which on a machine with less free memory than the checkpoint is the cold
one).

Rows:
  load_file   safetensors.torch.load_file of every shard, as returned (safetensors 0.8 maps the file: the data is
              not read until a tensor is used, so this row is the header parse and mapping only)
  load_file + copy   the same, each tensor then copied into a tensor of its own (what loading it into a model's
              parameters costs: the data is read)
  from_hf     dsl.from_hf(dir, dtype=bf16): config -> spec -> compile (on meta) -> allocate -> read every tensor
              lazily and copy it into its parameter (experts: one tensor per expert into the stacked weight)
  (weights)   from_hf minus its compile on meta (measured alone): the reading and copying
GB/s = checkpoint bytes / seconds. The last line is the ratio (load_file + copy) time / from_hf time (> 1: from_hf
is faster).

Usage: python benchmarks/load_hf.py [--gb 0.25] [--shard-gb 1] [--repeat 3] [--dir DIR] [--device cpu]
       (the issue's size: --gb 3; needs about twice that in free memory)
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import dsl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab=32768, d=1024, kda_heads=8, head_dim=128, mla_heads=8, kv_lora_rank=256, qk_nope_dim=128,
             qk_rope_dim=64, v_dim=128, dense_inter=2816, experts=64, top_k=4, shared=1, moe_inter=512, dtype="bf16")
LAYER_GB = 0.21           # about: 64 experts x 3 x 1024 x 512 x 2 bytes + attention


def generate(directory: Path, gb: float, shard_gb: float) -> int:
    n_layers = max(2, round(gb / LAYER_GB))
    g = dsl.load(ROOT / "models" / "kimi_linear_48b.mtc", n_layers=n_layers, **SHAPE)
    m = dsl.compile(g, dtype=torch.bfloat16, seed=0)
    m.save_hf(directory, max_shard_size=int(shard_gb * 1e9))
    del m
    return n_layers


def files(directory: Path):
    return sorted(directory.glob("*.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=0.25, help="checkpoint size to generate (GB, default 0.25)")
    ap.add_argument("--shard-gb", type=float, default=1.0, help="shard size (GB, default 1)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="write the checkpoint here (default: a temporary folder, removed after)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from safetensors.torch import load_file
    tmp = None
    if args.dir:
        d = Path(args.dir)
    else:
        tmp = tempfile.mkdtemp(prefix="mtc_load_hf_")
        d = Path(tmp) / "ckpt"
    try:
        t0 = time.perf_counter()
        n_layers = generate(d, args.gb, args.shard_gb)
        nbytes = sum(p.stat().st_size for p in files(d))
        print(f"generated {nbytes / 1e9:.2f} GB, {n_layers} layers, {len(files(d))} shard(s) in "
              f"{time.perf_counter() - t0:.1f} s: {d}")
        graph = dsl.parse(dsl.checkpoint.import_hf(d))
        times = {"load_file": [], "load_copy": [], "from_hf": [], "compile": []}
        for _ in range(args.repeat):
            t = time.perf_counter()
            for p in files(d):
                sd = load_file(str(p), device=args.device)
                del sd
            times["load_file"].append(time.perf_counter() - t)
            t = time.perf_counter()
            kept = []
            for p in files(d):
                sd = load_file(str(p), device=args.device)
                kept += [torch.empty_like(x).copy_(x) for x in sd.values()]
                del sd
            times["load_copy"].append(time.perf_counter() - t)
            del kept
            t = time.perf_counter()
            m = dsl.from_hf(d, dtype=torch.bfloat16, device=args.device)
            times["from_hf"].append(time.perf_counter() - t)
            del m
            t = time.perf_counter()
            dsl.compile(graph, dtype=torch.bfloat16, device="meta")
            times["compile"].append(time.perf_counter() - t)
        best = {k: min(v) for k, v in times.items()}
        first = {k: v[0] for k, v in times.items()}
        weights = best["from_hf"] - best["compile"]
        print(f"\n| loader | best s | GB/s | first s | (of {args.repeat}, {nbytes / 1e9:.2f} GB, "
              f"{torch.get_num_threads()} threads, device {args.device}) |")
        print("|---|---|---|---|---|")
        print(f"| load_file | {best['load_file']:.3f} | {nbytes / 1e9 / best['load_file']:.2f} | "
              f"{first['load_file']:.3f} | |")
        print(f"| load_file + copy | {best['load_copy']:.3f} | {nbytes / 1e9 / best['load_copy']:.2f} | "
              f"{first['load_copy']:.3f} | |")
        print(f"| from_hf | {best['from_hf']:.3f} | {nbytes / 1e9 / best['from_hf']:.2f} | {first['from_hf']:.3f} | "
              f"compile on meta {best['compile']:.3f} s |")
        print(f"| (weights) | {weights:.3f} | {nbytes / 1e9 / weights:.2f} | | from_hf minus compile |")
        print(f"\nratio (load_file + copy) / from_hf: {best['load_copy'] / best['from_hf']:.2f} "
              f"(weights only: {best['load_copy'] / weights:.2f})")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
