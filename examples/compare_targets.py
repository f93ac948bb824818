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

#: --dtype: the name dsl.compile takes -> the spellings accepted (any case)
DTYPES = {"f32": ("f32", "float32", "fp32"), "f16": ("f16", "float16", "fp16"),
          "bf16": ("bf16", "bfloat16")}

EPILOG = """\
exit status: 0 every target agrees; 1 a target's logits are off (relative error >= 1e-4 in f32,
  >= 3e-2 in f16/bf16), or a target named in --targets could not be compiled (a "skipped: why" row);
  with the default --targets, a target that is not installed (e.g. tvm without Apache TVM) is
  skipped and its row says why, without changing the exit status; 2 bad usage or a spec this script
  cannot feed (it needs one input: integer token ids [B, T]).

"same expert load": whether every MoE layer routed each expert the same number of tokens as the
  float32 reference ("-" for a model without MoE layers). In f32 the token ids are drawn so that no
  top-k pick is a near-tie, and False means a real difference. In f16/bf16 the router scores carry
  ~1e-3/1e-2 rounding, so a near-tied k-th/(k+1)-th expert can flip: False there is expected at
  times and is not an error by itself (the logits error decides the exit status).
"""


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _dtype(text: str) -> str:
    t = text.strip().lower()
    for name, spellings in DTYPES.items():
        if t in spellings:
            return name
    raise argparse.ArgumentTypeError(
        f"'{text}' is not one of " + ", ".join("/".join(a) for a in DTYPES.values()))


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if not 0 <= v < 2 ** 63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2^63), got {v}")
    return v


def token_input(g, batch: int | None, tokens: int | None) -> tuple[int, int, int]:
    """(B, T, vocab) to feed graph g: its one input must be integer token ids [B, T] (a fixed dim in the
    spec wins over the default and must match an explicit -B/-T); the vocab is the embedding table's
    first dim (the table the ids index), else the lm_head's output size. ValueError saying why not."""
    ins = g.inputs()
    decl = ", ".join(f"{n.name}: {n.types[0]}" for n in ins)
    if len(ins) != 1 or ins[0].types[0].rank != 2 or ins[0].types[0].dtype not in ("i64", "i32"):
        raise ValueError(f"model '{g.name}' takes ({decl}); this script feeds one input, integer token ids "
                         f"[B, T] (e.g. input_ids: i64[B, T]): compare such a spec from Python instead")
    dims = []
    for d, given, flag, default in zip(ins[0].types[0].shape, (batch, tokens), ("-B", "-T"), (2, 77)):
        if d.is_number:
            if given is not None and given != int(d):
                raise ValueError(f"{flag} {given}: model '{g.name}' fixes its input to {decl}")
            dims.append(int(d))
        else:
            dims.append(given if given is not None else default)
    vocab = None
    for n in g.nodes:
        if n.op == "embedding" and n.inputs[0].node == ins[0].name:
            vocab = int(g.type_of(n.inputs[1]).shape[0])
            break
    if vocab is None:
        heads = [n for n in g.nodes if n.op == "lm_head"]
        if heads:
            vocab = int(heads[0].types[0].shape[-1])
    if vocab is None:
        raise ValueError(f"model '{g.name}' has neither an embedding of {ins[0].name} nor an lm_head: "
                         f"cannot tell the vocabulary to draw token ids from")
    return dims[0], dims[1], vocab


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", nargs="?", default=str(HERE / "hybrid_tiny.mtc"), help="a .mtc spec")
    ap.add_argument("--variant", "-v", default=None, help="a variant of the spec (e.g. tiny), as in mtc")
    ap.add_argument("--tokens", "-T", type=_positive, default=None,
                    help="tokens per sequence (default 77, or the spec's fixed T)")
    ap.add_argument("--batch", "-B", type=_positive, default=None,
                    help="sequences (default 2, or the spec's fixed B)")
    ap.add_argument("--targets", default=None,
                    help="comma-separated targets beside the reference (default triton,tvm; see exit status)")
    ap.add_argument("--device", default="cpu", help="cpu (Triton interpreter) or cuda")
    ap.add_argument("--dtype", type=_dtype, default="f32",
                    help="f32/float32/fp32 (default; CPU), f16/float16/fp16 or bf16/bfloat16 (GPU); "
                         "see 'same expert load' below")
    ap.add_argument("--seed", type=_seed, default=0,
                    help="seed of the weights, the token ids and the gradient probe (default 0): the same "
                         "seed gives the same run")
    ap.add_argument("--grad", action="store_true", help="also compare the gradients of every parameter")
    args = ap.parse_args(argv)
    explicit = args.targets is not None
    targets = [t.strip() for t in (args.targets if explicit else "triton,tvm").split(",") if t.strip()]
    targets = list(dict.fromkeys(targets))                   # each target once, in the order given
    if not targets:
        print(f"note: --targets {args.targets!r} names no target beside the reference: nothing to compare",
              file=sys.stderr)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is first imported
    import torch
    import dsl
    from dsl.errors import MtcError

    try:
        g = dsl.load(args.spec, args.variant)
        B, T, vocab = token_input(g, args.batch, args.tokens)
        from dsl.cli import _check_fits                      # a model too big for this machine: say so first
        _check_fits(g, 4, args.device, args.spec)
        ref = dsl.compile(g, target="reference", device=args.device, seed=args.seed)   # float32 ground truth
    except (MtcError, ValueError) as e:
        print(f"compare_targets: {str(e).removeprefix('error: ')}", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)        # token ids and the gradient probe: --seed
    # a top-k near-tie (k-th and (k+1)-th router scores closer than the targets' rounding) can switch an
    # expert: a discrete change, not an error. Draw token ids whose routing margins are clear of it.
    # (float32 only: bf16 scores carry ~1e-2 rounding, so some switches are expected at any size; the
    # "same expert load" column shows them)
    clear = 1e-5 if args.dtype == "f32" else 0.0
    tries = 200                                           # (a draw costs one reference forward, no autograd)
    for attempt in range(tries):
        ids = torch.randint(0, vocab, (B, T), generator=gen).to(args.device)
        margins = ref.route_margins(ids)
        if not margins or min(margins.values()) >= clear:
            if attempt:
                print(f"drew the token ids {attempt + 1} times: the first {attempt} had a top-k near-tie (a "
                      f"routing margin < {clear:.0e})")
            break
        if attempt == tries - 1:
            print(f"note: every one of {tries} draws had a top-k near-tie (smallest margin "
                  f"{min(margins.values()):.1e} < {clear:.0e}): a target may pick another expert for some token, "
                  f"so a differing expert load or a logits mismatch below can be that switch, not an error "
                  f"(fewer tokens, -T / -B, make ties rarer)")
    ref.eval()
    with torch.no_grad():
        want = ref(ids).float()
    picks = {k: v.clone() for k, v in ref.routing_stats.items()}
    weights = {k: v.clone() for k, v in ref.state_dict().items()}    # train mode moves the QB biases: restore
    print(f"{g.name}: B={B} T={T}, seed {args.seed}, reference float32 logits RMS {want.pow(2).mean().sqrt():.4f}")
    print(f"{'target':<10} {'dtype':<6} {'logits rel err':>15} {'same expert load':>17} {'grad rel err':>13} {'s':>6}")
    rc = 0
    for target in targets:
        t0 = time.time()
        try:
            m = dsl.compile(g, target=target, dtype=args.dtype, device=args.device, seed=args.seed)
        except MtcError as e:
            why = str(e).removeprefix('error: ')
            if explicit:
                print(f"{target:<10} skipped: {why}  (asked for in --targets: exit status 1)")
                rc = 1
            else:
                print(f"{target:<10} skipped: {why}")
            continue
        m.load_state_dict(weights)
        m.eval()
        with torch.no_grad():
            got = m(ids).float()
        err = float((got - want).norm() / want.norm())
        same = "-" if not picks else all(torch.equal(picks[k].cpu(), v.cpu()) for k, v in m.routing_stats.items())
        gerr = float("nan")
        if args.grad:
            m.train(), ref.train()
            tgt = torch.randn(want.shape, generator=gen).to(want.device)
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
        if not (err < (1e-4 if args.dtype == "f32" else 3e-2)):
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
