"""Compile one spec for every target and check that they agree: logits, the QB router's picks, gradients.

    python examples/compare_targets.py                          # examples/hybrid_tiny.mtc, T = 77
    python examples/compare_targets.py models/kimi_k3.mtc --variant tiny --tokens 130

On a CPU the Triton kernels run under Triton's interpreter (float32; set here before triton is imported)
and target "tvm" needs Apache TVM (`pip install -e ".[tvm]"`); on a GPU pass --device cuda --dtype bf16.
Prints one row per target: relative RMS error of the logits against the float32 reference, whether the
top-k expert choices agree, and (with --grad) the gradient error over all parameters.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", nargs="?", default=str(HERE / "hybrid_tiny.mtc"), help="a .mtc spec")
    ap.add_argument("--variant", default=None, help="a variant of the spec (e.g. tiny)")
    ap.add_argument("--tokens", "-T", type=int, default=77, help="tokens per sequence (default 77)")
    ap.add_argument("--batch", "-B", type=int, default=2, help="sequences (default 2)")
    ap.add_argument("--targets", default="triton,tvm", help="comma-separated targets beside the reference")
    ap.add_argument("--device", default="cpu", help="cpu (Triton interpreter) or cuda")
    ap.add_argument("--dtype", default="f32", help="f32 (CPU) or bf16 (GPU)")
    ap.add_argument("--grad", action="store_true", help="also compare the gradients of every parameter")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is first imported
    import torch
    import dsl
    from dsl.errors import MtcError

    try:
        g = dsl.load(args.spec, args.variant)
        ref = dsl.compile(g, target="reference", device=args.device)        # float32 ground truth
    except MtcError as e:
        print(e, file=sys.stderr)
        return 2
    vocab = dict(g.meta_get("config", ())).get("vocab", 256)
    # a top-k near-tie (k-th and (k+1)-th router scores closer than the targets' rounding) can switch an
    # expert: a discrete change, not an error. Draw token ids whose routing margins are clear of it.
    # (float32 only: bf16 scores carry ~1e-2 rounding, so some switches are expected at any size; the
    # "same expert load" column shows them)
    clear = 1e-5 if args.dtype in ("f32", "float32") else 0.0
    for _ in range(20):
        ids = torch.randint(0, vocab, (args.batch, args.tokens), device=args.device)
        margins = ref.route_margins(ids)
        if not margins or min(margins.values()) >= clear:
            break
        print(f"redrawing the token ids: a top-k near-tie ({min(margins.values()):.1e} < {clear:.0e})")
    ref.eval()
    with torch.no_grad():
        want = ref(ids).float()
    picks = {k: v.clone() for k, v in ref.routing_stats.items()}
    weights = {k: v.clone() for k, v in ref.state_dict().items()}    # train mode moves the QB biases: restore
    print(f"{g.name}: B={args.batch} T={args.tokens}, reference float32 logits RMS {want.pow(2).mean().sqrt():.4f}")
    print(f"{'target':<10} {'dtype':<6} {'logits rel err':>15} {'same expert load':>17} {'grad rel err':>13} {'s':>6}")
    rc = 0
    for target in [t for t in args.targets.split(",") if t]:
        t0 = time.time()
        try:
            m = dsl.compile(g, target=target, dtype=args.dtype, device=args.device)
        except MtcError as e:
            print(f"{target:<10} skipped: {str(e).removeprefix('error: ')}")
            continue
        m.load_state_dict(weights)
        m.eval()
        with torch.no_grad():
            got = m(ids).float()
        err = float((got - want).norm() / want.norm())
        same = all(torch.equal(picks[k].cpu(), v.cpu()) for k, v in m.routing_stats.items())
        gerr = float("nan")
        if args.grad:
            m.train(), ref.train()
            tgt = torch.randn_like(want)
            for mod in (ref, m):
                mod.zero_grad()
                (mod(ids).float() * tgt).mean().backward()
            a = torch.cat([p.grad.flatten().float() for p in m.parameters() if p.grad is not None])
            b = torch.cat([p.grad.flatten().float() for p in ref.parameters() if p.grad is not None])
            gerr = float((a - b).norm() / b.norm())
            ref.load_state_dict(weights)
            ref.eval()
        gtxt = f"{gerr:.2e}" if args.grad else "-"
        print(f"{target:<10} {args.dtype:<6} {err:>15.2e} {str(same):>17} {gtxt:>13} {time.time() - t0:>6.1f}")
        if not (err < (1e-4 if args.dtype in ("f32", "float32") else 3e-2)):
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
