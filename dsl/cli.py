"""The ``mtc`` command line.

    mtc stats models/kimi_k3.mtc --json                 parameters, FLOPs/token, memory at 1M tokens
    mtc ir models/kimi_k3.mtc --variant tiny --stage canonical
    mtc run                                             tiny K3 on the shipped text (the main job)
    mtc run models/kimi_k3.mtc --variant tiny --input book.txt
    mtc ops                                             every op with its signature and semantics
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .errors import MtcError

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = ROOT / "models" / "kimi_k3.mtc"
DEFAULT_TEXT = ROOT / "examples" / "data" / "python_reference_excerpt.txt"

EPILOG = """\
examples:
  mtc stats models/kimi_k3.mtc --seq-len 1048576 --gpus 128
  mtc stats models/kimi_k3.mtc --variant small --set n_layers=24 --json
  mtc ir models/kimi_k3.mtc --variant tiny --stage canonical --print-after canonicalize
  mtc ir models/kimi_k3.mtc --stage lowered --seq-len 1048576 --gpus 128 --slots 1024
  mtc run models/kimi_k3.mtc --variant tiny --input README.md --seq-len 256
"""


def _seed(text: str) -> int:
    v = int(text)
    if not 0 <= v < 2 ** 63:
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2^63), got {text}")
    return v


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise MtcError(f"--set expects key=value, got '{p}'")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _load(args):
    from . import load
    return load(args.spec, args.variant, **_overrides(args.set))


def _add_spec_args(p: argparse.ArgumentParser, spec_optional: bool = False):
    if spec_optional:
        p.add_argument("spec", nargs="?", default=None,
                       help=f"a .mtc architecture spec (default: {DEFAULT_SPEC.relative_to(ROOT)} with --variant tiny)")
    else:
        p.add_argument("spec", help="a .mtc architecture spec, e.g. models/kimi_k3.mtc")
    p.add_argument("--variant", "-v", default=None, help="a named variant of the model (e.g. tiny, small)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value after the variant (repeatable), e.g. --set n_layers=4")


# ---------------------------------------------------------------------------------------------
def cmd_stats(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from .stats import compute_stats, human, human_bytes
    g = _load(args)
    s = compute_stats(g, seq_len=args.seq_len, batch=args.batch, gpus=args.gpus)
    if args.json:
        print(json.dumps(s.to_dict(), indent=2))
        return 0
    c = Console()
    t = Table(title=f"{s.name}: {s.layers['kda']} KDA + {s.layers['mla']} MLA layers, "
                    f"{s.layers['dense_ffn']} dense + {s.layers['moe']} MoE FFNs", show_header=True)
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("total parameters", f"{human(s.total_params)} ({s.total_params:,})")
    t.add_row("active parameters / token", f"{human(s.active_params)} (with embedding {human(s.active_params_with_embedding)})")
    t.add_row(f"forward FLOPs / token at T={s.seq_len:,}", human(s.flops_per_token, "FLOP"))
    for op, f in list(s.flops_per_token_by_op.items())[:5]:
        t.add_row(f"  of which {op}", f"{human(f, 'FLOP')} ({100 * f / s.flops_per_token:.1f}%)")
    t.add_row("weights", f"{human_bytes(s.weights_bytes)}  ({human_bytes(s.per_gpu(s.weights_bytes))}/GPU on {s.gpus})")
    t.add_row(f"MLA latent KV cache (B={s.batch}, T={s.seq_len:,})",
              f"{human_bytes(s.kv_cache_bytes)}  ({human_bytes(s.per_gpu(s.kv_cache_bytes))}/GPU)")
    t.add_row(f"KDA + conv state (B={s.batch}, any T)", human_bytes(s.kda_state_bytes))
    t.add_row("one residual-stream tensor [B, T, d]", human_bytes(s.residual_stream_bytes))
    c.print(t)
    return 0


def cmd_ir(args) -> int:
    from passes import STAGES, PassManager
    from .printer import print_graph
    stages = STAGES + ["lowered", "tvm"]
    stage = args.stage
    if stage not in stages:
        raise MtcError(f"unknown stage '{stage}'; stages: {', '.join(stages)}")
    g = _load(args)
    pm = PassManager(print_after=args.print_after or (), dump_dir=args.dump_ir, keep_stages=True)
    upto = stages.index(stage)
    if stage == "tvm":
        upto = stages.index("canonical")
    if args.dump_ir or args.print_after or args.timing:
        upto = len(STAGES) - 1            # these describe the passes: run the whole pipeline
    if upto > 0:
        pm.passes = [p for p in pm.passes if p.stage is None or stages.index(p.stage) <= upto]
        pm.run(g)
    else:
        pm.stages["graph"] = g
    if stage == "tvm":
        text = _tvm_report(args, pm.stages["canonical"])
    elif stage == "lowered":
        text = _lowered_report(args, g, pm)
        if args.dump_ir:                  # the pass dumps are NN-<pass>.ir; the kernel IR comes last
            n = len(list(Path(args.dump_ir).glob("*.ir")))
            try:
                (Path(args.dump_ir) / f"{n:02d}-lowered.txt").write_text(text)
            except OSError as e:
                raise MtcError(f"cannot write --dump-ir '{args.dump_ir}': {e.strerror}") from None
    else:
        text = print_graph(pm.stages[stage], with_loc=not args.no_loc)
        if stage == "fused":
            from passes.fuse_tiles import describe_groups
            text = describe_groups(pm.stages[stage]) + text
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as e:
            raise MtcError(f"cannot write --output '{args.output}': {e.strerror}") from None
        print(f"wrote {args.output} ({text.count(chr(10))} lines)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.timing:
        print(pm.timing_report(), file=sys.stderr)
    return 0


def _tvm_report(args, g) -> str:
    """The TVMScript of every distinct TVM kernel the model needs (target="tvm")."""
    from backends.tvm import tvmscript
    dt = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
    nodes = g.node_map()
    seen: dict[str, list[str]] = {}
    order = []
    for n in g.nodes:
        t = n.types[0] if n.types else None
        if n.op not in ("rmsnorm", "l2norm", "silu", "sigmoid", "add", "mul", "situ_glu", "attn_residual",
                        "short_conv") or t is None or t.dtype not in dt:
            continue
        a = {"dtype": dt[t.dtype]}
        if n.op in ("rmsnorm", "l2norm"):
            a.update(d=int(t.shape[-1]), eps=float(n.attr("eps")))
            if n.op == "rmsnorm":
                a["w_dtype"] = dt[nodes[n.inputs[1].node].types[0].dtype]
        elif n.op == "attn_residual":
            w = dt[nodes[n.inputs[1].node].types[0].dtype]
            a.update(d=int(t.shape[-1]), L=len(n.inputs) - 2, eps=float(n.attr("eps")), q_dtype=w, w_dtype=w)
        elif n.op == "short_conv":
            wt = nodes[n.inputs[1].node].types[0]
            a.update(C=int(wt.shape[0]), W=int(wt.shape[2]), w_dtype=dt[wt.dtype])
        elif n.op == "situ_glu":
            a.update(beta_gate=float(n.attr("beta_gate")), beta_up=float(n.attr("beta_up")))
        key = repr((n.op, sorted(a.items())))
        if key not in seen:
            seen[key] = []
            order.append((key, n.op, a))
        seen[key].append(n.name)
    out = [f"# {len(order)} distinct TVM kernels for {g.name} (target llvm / cuda sm_90)"]
    for key, op, a in order:
        users = seen[key]
        out.append(f"\n# ---- {op} {a}: used by {len(users)} node(s): "
                   f"{', '.join('%' + u for u in users[:6])}{' ...' if len(users) > 6 else ''}")
        out.append(tvmscript(op, scheduled=args.tvm_schedule, **a))
    return "\n".join(out) + "\n"


def _lowered_report(args, g, pm) -> str:
    """Kernel list, per-GPU memory plan and expert placement for `mtc ir --stage lowered`."""
    from passes.lower import lower
    from passes.place_experts import plan as place
    from passes.plan_memory import plan_memory
    t0 = time.perf_counter()
    fused = pm.stages["fused"]
    if args.target == "tvm":             # what compile(target="tvm") runs: the direct AttnRes form
        from passes import PassManager
        fused = PassManager(["fuse_tiles"]).run(pm.stages["canonical"])
    prog = lower(fused, target=args.target)
    out = [prog.text()]
    counts = prog.counts()
    out.append(f"// {len(prog.launches)} launches: " + ", ".join(f"{k} x{v}" for k, v in counts.items()))
    out.append(f"// code cache key: {prog.cache_key()}\n")
    T = args.seq_len or dict(g.meta_get("config", ())).get("max_seq_len", 4096)
    moe = [n for n in g.nodes if n.op in ("latent_moe", "moe")]
    E = moe[0].attr("experts") if moe else None
    slots = args.slots or (None if E is None else (E if E % args.gpus == 0 else -(-E // args.gpus) * args.gpus))
    try:
        mp = plan_memory(g, seq_len=T, gpus=args.gpus, checkpointing=args.checkpointing,
                         num_slots=slots, canonical=pm.stages["canonical"])
        out.append(mp.summary())
        if moe:
            out.append("\n" + place(None, args.gpus, num_slots=slots, num_experts=E).summary())
    except ValueError as e:
        raise MtcError(str(e)) from None
    out.append(f"\n// lowering, memory plan and placement took {time.perf_counter() - t0:.2f} s")
    return "\n".join(out) + "\n"


RUN_DTYPES = {"float32": "f32", "fp32": "f32", "f32": "f32", "bfloat16": "bf16", "bf16": "bf16",
              "float16": "f16", "fp16": "f16", "f16": "f16"}


def _check_device(device: str) -> None:
    import torch
    if device == "cpu":
        return
    if device.split(":")[0] != "cuda":
        raise MtcError(f"--device must be cpu or cuda[:N], got '{device}'")
    if not torch.cuda.is_available():
        raise MtcError(f"--device {device}: this torch build or machine has no CUDA GPU; use --device cpu")


def _segments(ids, T: int):
    """Non-overlapping windows of T predicted tokens (T + 1 ids each, consecutive windows share one id);
    the last window keeps the remainder, so every byte after the first is predicted exactly once."""
    return [ids[s: s + T + 1] for s in range(0, len(ids) - 1, T)]


def _check_fits(g, dtype_bytes: int, device: str) -> None:
    """Refuse, before allocating, a model whose weights cannot fit in this machine's memory."""
    import torch
    n = sum(int(p.type.numel()) for p in g.params())
    need = n * dtype_bytes
    if device.startswith("cuda"):
        have = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
    if need > 0.8 * have:
        from .stats import human_bytes
        raise MtcError(f"model '{g.name}' has {n:,} parameters: {human_bytes(need)} of weights, more than this "
                       f"{'GPU' if device != 'cpu' else 'machine'} holds ({human_bytes(have)} free); run a smaller "
                       f"variant (--variant tiny or small), or count it with `mtc stats` / `mtc ir --stage lowered`")


def cmd_run(args) -> int:
    import warnings
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from . import compile as mtc_compile, load

    if args.dtype is not None and args.dtype not in RUN_DTYPES:
        raise MtcError(f"--dtype must be one of float32, bfloat16, float16; got '{args.dtype}'")
    dtype = RUN_DTYPES[args.dtype or "float32"]
    _check_device(args.device)
    if args.target not in ("reference", "triton", "tvm"):
        raise MtcError(f"--target must be reference, triton or tvm; got '{args.target}'")
    if args.target in ("triton", "tvm") and args.device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise MtcError("--target triton on the CPU needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ.setdefault("TRITON_INTERPRET", "1")     # Triton kernels on the CPU: the interpreter
        # the interpreter evaluates masked-off lanes too (exp of padding); those results are discarded
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise MtcError(f"--json: the folder of '{args.json}' does not exist")
    c = Console(stderr=False)
    spec = args.spec or str(DEFAULT_SPEC)
    variant = args.variant if (args.variant or args.spec) else "tiny"
    text_path = Path(args.input) if args.input else DEFAULT_TEXT
    try:
        data = text_path.read_bytes()
    except OSError as e:
        raise MtcError(f"cannot read --input '{text_path}': {e.strerror}") from None
    data = data[: args.max_tokens]
    if len(data) < 2:
        raise MtcError(f"--input '{text_path}' gives {len(data)} byte token(s) (with --max-tokens "
                       f"{args.max_tokens}); need at least 2 to predict a next token")
    g = load(spec, variant, **_overrides(args.set))
    vocab = int(g.type_of(g.outputs[0]).shape[-1])
    if vocab < 256:
        raise MtcError(f"model '{g.name}' has a vocabulary of {vocab}; the byte-level tokenizer needs >= 256")
    _check_fits(g, 4 if dtype == "f32" else 2, args.device)
    t0 = time.perf_counter()
    m = mtc_compile(g, target=args.target, dtype=dtype, device=args.device, seed=args.seed)
    m.eval()
    ids = torch.tensor(list(data), dtype=torch.long)
    T = args.seq_len
    segs = _segments(ids, T)
    # batch windows of equal length (only the last one can be shorter)
    batches, cur = [], []
    for sg in segs:
        if cur and (len(cur) == args.batch_size or len(sg) != len(cur[0])):
            batches.append(cur)
            cur = []
        cur.append(sg)
    batches.append(cur)
    n = len(segs)
    c.print(f"[bold]{g.name}[/] ({sum(p.numel() for p in m.parameters()):,} parameters, target {args.target}, "
            f"{args.dtype or 'float32'}) on {text_path.name}: {len(ids):,} byte tokens in {n} window"
            f"{'s' if n != 1 else ''} of up to {T}; compiled in {time.perf_counter() - t0:.2f} s")
    if args.target in ("triton", "tvm") and str(args.device) == "cpu" and len(ids) > 512:
        c.print("note: on the CPU the Triton kernels run under the interpreter (a few tokens/s for the tiny model); "
                "--max-tokens 256 --seq-len 64 gives a quick check")
    total_loss, total_tok = 0.0, 0
    loads: dict[str, torch.Tensor] = {}
    t1 = time.perf_counter()
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} windows"), TimeElapsedColumn(), console=c,
                  transient=True) as prog:
        task = prog.add_task("forward", total=n)
        ops_task = prog.add_task("  ops of this window", total=1)

        def op_progress(i, total):
            prog.update(ops_task, completed=i + 1, total=total)

        with torch.no_grad():
            for rows in batches:
                batch = torch.stack(rows).to(args.device)
                logits = m(batch[:, :-1], progress=op_progress)
                if not torch.isfinite(logits).all():
                    raise MtcError("the forward pass produced non-finite logits")
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                         batch[:, 1:].reshape(-1), reduction="sum")
                total_loss += float(loss)
                total_tok += batch[:, 1:].numel()
                for k, v in m.routing_stats.items():
                    loads[k] = loads.get(k, 0) + v.cpu()
                prog.update(task, advance=len(rows))
    dt = time.perf_counter() - t1
    nll = total_loss / total_tok
    c.print(f"loss {nll:.4f} nats/token ({nll / 0.6931471805599453:.3f} bits/byte), perplexity "
            f"{torch.tensor(nll).exp():.2f}, over {total_tok:,} predicted tokens in {dt:.2f} s "
            f"({total_tok / dt:,.0f} tokens/s)")
    if loads:
        t = Table(title="expert load per MoE layer (tokens routed per expert; layers numbered from 0 as in "
                        "the state dict)")
        t.add_column("layer", justify="right", no_wrap=True)
        for col in ("min", "mean", "max", "max/mean", "idle experts"):
            t.add_column(col, justify="right")
        for k, v in loads.items():
            v = v.float()
            t.add_row(k.removeprefix("model.layers.").removesuffix(".block_sparse_moe"), f"{v.min():.0f}",
                      f"{v.mean():.1f}", f"{v.max():.0f}", f"{v.max() / v.mean():.3f}", str(int((v == 0).sum())))
        c.print(t)
    if args.json:
        out = {"model": g.name, "target": args.target, "dtype": args.dtype or "float32", "seq_len": T,
               "loss": nll, "tokens": total_tok, "seconds": dt,
               "expert_load": {k: v.tolist() for k, v in loads.items()}}
        Path(args.json).write_text(json.dumps(out, indent=2))
        c.print(f"wrote {args.json}")
    return 0


def cmd_compile(args) -> int:
    from backends.triton.codegen import write_and_load
    from passes import PassManager
    from passes.lower import lower
    os.environ.setdefault("TRITON_INTERPRET", "0" if _has_cuda() else "1")
    g = _load(args)
    fused = PassManager().run(g)          # no weights are allocated: the full model compiles too
    prog = lower(fused, target="triton")
    path, _mod, kernels = write_and_load(prog, fused, args.emit)
    n_gen = len({k.name for k in kernels})
    print(f"{g.name}: {len(prog.launches)} kernel launches, {len(kernels)} of them generated pointwise "
          f"kernels ({n_gen} distinct)")
    print(f"kernel source: {path}")
    print(f"kernel IR:     {path.parent / 'kernel_ir.txt'}")
    return 0


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def cmd_ops(args) -> int:
    from .errors import did_you_mean
    from .ops import OPS
    if args.op and args.op not in OPS:
        raise MtcError(f"unknown op '{args.op}'{did_you_mean(args.op, OPS)}; `mtc ops` lists them all")
    for name, od in sorted(OPS.items()):
        if args.op and name != args.op:
            continue
        attrs = ", ".join(f"{k}={v!r}" for k, v in od.attrs.items())
        kind = "layer" if od.is_layer else "op"
        print(f"{name}({', '.join(od.inputs)}{'; ' + attrs if attrs else ''})  [{kind}]\n    {od.doc}")
    return 0


# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtc", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="mtc: a compiler-style graph DSL for trillion-parameter sparse MoE models with "
                    "million-token contexts (the Kimi K3 family). Write the architecture as a .mtc spec, "
                    "inspect every IR stage, count parameters/FLOPs/memory, and run it.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("stats", help="parameters, active parameters, FLOPs/token, memory at a context length",
                       description="Counts everything from the graph IR: total and active (per-token) "
                                   "parameters, forward FLOPs per token at --seq-len (MLA attention grows "
                                   "with T, KDA does not), weights, MLA latent KV cache and KDA state.")
    _add_spec_args(s)
    s.add_argument("--seq-len", "-T", type=int, default=None, help="context length (default: the spec's max_seq_len)")
    s.add_argument("--batch", type=int, default=1, help="sequences held at once (KV cache and state scale with it)")
    s.add_argument("--gpus", type=int, default=1, help="GPUs to spread weights and caches over (even split)")
    s.add_argument("--json", action="store_true", help="print machine-readable JSON")
    s.set_defaults(fn=cmd_stats)

    s = sub.add_parser("ir", help="print the IR at a stage of the pipeline",
                       description="Stages: graph (as parsed: layer blocks, typed), typed (after "
                                   "infer_shapes), canonical (layer blocks expanded into primitive ops), fused "
                                   "(two-phase AttnRes + fusion groups with tile sizes), lowered (the kernel "
                                   "launches, the per-GPU memory plan and the expert placement; its memory "
                                   "layout is plan_memory's: experts split by expert parallelism, other weights "
                                   "and the KV cache by tensor-parallel groups of up to 8, unlike `mtc stats`' "
                                   "even split), tvm (the TVMScript of the TVM kernels).")
    _add_spec_args(s)
    s.add_argument("--stage", default="graph", help="graph | typed | canonical | fused | lowered | tvm")
    s.add_argument("--seq-len", "-T", type=int, default=None,
                   help="(lowered) context length for the memory plan (default: the spec's max_seq_len)")
    s.add_argument("--gpus", type=int, default=1, help="(lowered) GPUs for the memory plan and expert placement")
    s.add_argument("--slots", type=int, default=None,
                   help="(lowered) physical expert slots (> experts: replicas of the hottest)")
    s.add_argument("--checkpointing", default="layer", choices=["none", "layer", "block", "inference"],
                   help="(lowered) activation checkpointing for the memory plan")
    s.add_argument("--target", default="triton", choices=["triton", "tvm"], help="(lowered) the target to lower for")
    s.add_argument("--tvm-schedule", default=None, choices=["llvm", "cuda"],
                   help="(tvm) print the TVMScript after the llvm or cuda schedule")
    s.add_argument("--print-after", action="append", metavar="PASS", help="also print the IR after PASS ('all')")
    s.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass to DIR, one file per pass")
    s.add_argument("--timing", action="store_true", help="print per-pass timing to stderr")
    s.add_argument("--no-loc", action="store_true", help="omit source locations")
    s.add_argument("--output", "-o", help="write to a file instead of stdout")
    s.set_defaults(fn=cmd_ir)

    s = sub.add_parser("run", help="run the forward pass on a text file; print loss and expert load",
                       description="Byte-level tokenizer (vocab >= 256), next-token cross-entropy, and per-layer "
                                   "expert load. With no SPEC: the tiny K3 variant on a text shipped with mtc.")
    _add_spec_args(s, spec_optional=True)
    s.add_argument("--input", "-i", help=f"a text file (default: {DEFAULT_TEXT.relative_to(ROOT)})")
    s.add_argument("--target", default="reference", help="reference | triton | tvm (on CPU: Triton interpreter)")
    s.add_argument("--seq-len", "-T", type=int, default=256, help="tokens per sequence (default 256)")
    s.add_argument("--batch-size", type=int, default=4, help="sequences per forward (default 4)")
    s.add_argument("--max-tokens", type=int, default=8192, help="read at most this many bytes (default 8192)")
    s.add_argument("--dtype", default=None, help="float32 (default) | bfloat16")
    s.add_argument("--device", default="cpu", help="cpu | cuda")
    s.add_argument("--seed", type=_seed, default=0, help="parameter initialisation seed (0 .. 2^63-1)")
    s.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("compile", help="compile to kernels and write the generated Triton source",
                       description="Lowers the model to the kernel IR and generates the Triton source of its "
                                   "pointwise kernels into the cache (keyed by the printed kernel IR, target "
                                   "and versions) or into --emit DIR; prints the paths.")
    _add_spec_args(s)
    s.add_argument("--emit", metavar="DIR", help="write kernels.py and kernel_ir.txt to DIR")
    s.set_defaults(fn=cmd_compile)

    s = sub.add_parser("ops", help="list the ops with their signatures and semantics")
    s.add_argument("op", nargs="?", help="just this op")
    s.set_defaults(fn=cmd_ops)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for k in ("seq_len", "batch", "gpus", "batch_size", "max_tokens"):
        v = getattr(args, k, None)
        if v is not None and v < 1:
            print(f"mtc: error: --{k.replace('_', '-')} must be >= 1, got {v}", file=sys.stderr)
            return 2
    import warnings
    from .errors import MtcWarning
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, MtcWarning):        # spec warnings: 'file:line:col: warning: ...', once each
            print(str(message), file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)
    warnings.showwarning = show
    try:
        return args.fn(args)
    except MtcError as e:
        print(e.render(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
