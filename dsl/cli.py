"""The ``mtc`` command line.

    mtc stats models/kimi_k3.mtc --json                 parameters, FLOPs/token, memory at 1M tokens
    mtc ir models/kimi_k3.mtc --variant tiny --stage canonical
    mtc run                                             tiny K3 on the shipped text (the main job)
    mtc run models/kimi_k3.mtc --variant tiny --input book.txt
    mtc generate models/kimi_k3.mtc --variant tiny --prompt "..." --max-new-tokens 32   streams text, tokens/s
    mtc ops [OP]                                        every op: how a spec writes it, its signature, semantics
    mtc --version

Exit status: 0 done, 2 a usage or input error (one `error:` line; bare `mtc` prints the help), 1 when the
reader of stdout went away (`mtc ops | head -1`), 130 interrupted. Warnings start with `mtc: warning:`
or, for the spec, `file:line:col: warning:`.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import textwrap
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
  mtc generate models/kimi_k3.mtc --variant tiny --prompt "Once upon" --max-new-tokens 32
  mtc import-hf path/to/Kimi-Linear-48B-A3B-Instruct -o kimi_linear.mtc
"""


#: the steps --print-after names: the graph passes, then the lowering to the kernel IR
PRINT_AFTER = ["verify", "infer_shapes", "canonicalize", "batch_attn_residual", "fuse_tiles", "lower"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("mtc")
    except PackageNotFoundError:
        return "(not installed: run `pip install -e .`)"


def _warn(msg: str) -> None:
    print(f"mtc: warning: {msg}", file=sys.stderr)


def seed(text: str) -> int:
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


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_output_file(flag: str, path: str, inputs: dict) -> None:
    """Before any work: refuse an output FILE that cannot be written (a folder, a missing folder, no write
    permission on the file or on its folder, where the atomic write puts its temporary file) or that is one of
    the inputs (``inputs``: what -> path, e.g. {"input spec": spec}). Opens the file for appending (nothing is
    truncated) and removes it again if this check created it."""
    import stat
    import tempfile
    for what, src in inputs.items():
        if src is not None and _same_file(path, src):
            raise MtcError(f"{flag} '{path}' would overwrite the {what}; write to another file")
    p = Path(path)
    if p.is_dir():
        raise MtcError(f"{flag} '{path}' is a directory; give a file name, e.g. {p / 'out'}")
    if not p.resolve().parent.is_dir():
        raise MtcError(f"cannot write {flag} '{path}': its folder does not exist")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise MtcError(f"cannot write {flag} '{path}': {e.strerror}") from None
    if not existed:
        try:
            p.unlink()
        except OSError:
            pass
    if not existed or stat.S_ISREG(os.stat(p).st_mode):     # (a device such as /dev/null is written in place)
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.resolve().parent)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise MtcError(f"cannot write {flag} '{path}': its folder is not writable ({e.strerror}; mtc writes "
                           f"a new file beside the old one and renames it, so that a failed write loses nothing)") \
                from None


def _check_output_dir(flag: str, path: str, names, protect=()):
    """Before any work: the dsl.fileio.OutputDir that the files ``names`` will be written to; MtcError when DIR
    exists and is not a directory, or holds a file of those names that mtc did not write there (a user's
    ``kernels.py``) or that was changed since, or when one of them is an input (``protect``)."""
    from .fileio import OutputDir
    out = OutputDir(path, flag, protect)
    out.check(names)
    return out


def _write_output(flag: str, path: str, text: str) -> None:
    """Write an output FILE atomically: a failed write (a full disk) leaves the old file whole."""
    from .fileio import write_atomic
    try:
        write_atomic(path, text)
    except OSError as e:
        raise MtcError(f"cannot write {flag} '{path}': {e.strerror}") from None


def _load(args):
    return _load_spec(args.spec, args.variant, args.set)


def _load_spec(spec, variant, sets):
    """dsl.load (which says so when the file is printed IR text rather than a .mtc spec)."""
    from . import load
    return load(spec, variant, **_overrides(sets))


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
def _fixed_token_shape(g):
    """(batch, seq_len) fixed by the spec's token input ([2, 16] -> (2, 16); [B, 16] -> (None, 16)),
    None for a symbolic dim; (None, None) unless the graph has one rank-2 input."""
    ins = g.inputs()
    if len(ins) != 1 or ins[0].types[0].rank != 2:
        return None, None
    return tuple(int(d) if d.is_number else None for d in ins[0].types[0].shape)


def cmd_stats(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from passes.stats import compute_stats, human, human_bytes
    g = _load(args)
    fixed_b, fixed_t = _fixed_token_shape(g)
    shape_note = ""
    if fixed_b is not None or fixed_t is not None:
        shape_note = f" (the spec's input shape {g.inputs()[0].types[0]})"
        for flag, v, f in (("--seq-len", args.seq_len, fixed_t), ("--batch", args.batch, fixed_b)):
            if v is not None and f is not None and v != f:
                _warn(f"{flag} {v} ignored: the spec fixes it to {f}{shape_note}")
    T = fixed_t or args.seq_len
    batch = fixed_b or args.batch or 1
    if fixed_t is None and args.seq_len is not None:
        _warn_past_max_seq_len(g, args.seq_len, "--seq-len", "these counts are for a context longer than the "
                               "spec declares")
    s = compute_stats(g, seq_len=T, batch=batch, gpus=args.gpus)
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
    t.add_row(f"forward FLOPs / token at T={s.seq_len:,}{shape_note}", human(s.flops_per_token, "FLOP"))
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
        from .errors import did_you_mean
        raise MtcError(f"unknown stage '{stage}'{did_you_mean(stage, stages)}; stages: {', '.join(stages)}")
    print_after = _print_after(args.print_after)
    _warn_stage_flags(args, print_after)
    if args.output:
        _check_output_file("--output", args.output, {"input spec": args.spec})
    if args.dump_ir is not None and not args.dump_ir.strip():
        raise MtcError("--dump-ir needs a directory name")
    pm = PassManager(print_after=print_after - {"lower"}, keep_stages=True)
    if args.dump_ir:                      # (it runs the whole pipeline) every file it will write, checked first
        pm.dump_dir = _check_output_dir("--dump-ir", args.dump_ir, pm.dump_names() + (
            [_lowered_dump_name(pm)] if stage == "lowered" else []), [args.spec])
    dump = pm.dump_dir
    g = _load(args)
    if stage == "lowered" and args.seq_len is not None:
        _warn_past_max_seq_len(g, args.seq_len, "--seq-len", "the memory plan is for a context longer than "
                               "the spec declares")
    upto = stages.index(stage)
    if stage == "tvm":
        upto = stages.index("canonical")
    if args.dump_ir or args.print_after or args.timing:
        upto = len(STAGES) - 1            # these describe the passes: run the whole pipeline
    # --print-after listings go where the IR goes: stdout, or the -o file ahead of the stage's IR
    listings = io.StringIO()
    with contextlib.redirect_stdout(listings) if args.output else contextlib.nullcontext():
        if upto > 0:
            pm.passes = [p for p in pm.passes if p.stage is None or stages.index(p.stage) <= upto]
            pm.run(g)
        else:
            pm.stages["graph"] = g
        prog = None
        if stage == "lowered" or print_after & {"lower", "all"}:
            t0 = time.perf_counter()
            prog = _lower(args, pm)
            dt = time.perf_counter() - t0
            pm.timings.append(("lower", dt))
            if print_after & {"lower", "all"}:
                print(f"// ----- IR after lower ({dt * 1e3:.1f} ms, target {args.target}) -----\n{prog.text()}")
    if stage == "tvm":
        text = _tvm_report(args, pm.stages["canonical"])
    elif stage == "lowered":
        text = _lowered_report(args, g, pm, prog)
        if dump:                          # the pass dumps are NN-<pass>.ir; the kernel IR comes last
            dump.write(_lowered_dump_name(pm), text)
    else:
        text = print_graph(pm.stages[stage], with_loc=not args.no_loc)
        if stage == "fused":
            from passes.fuse_tiles import describe_groups
            text = describe_groups(pm.stages[stage]) + text
    if print_after:
        # (after the passes' listings, the requested stage gets a header of its own too)
        text = f"// ----- IR at stage {stage} (--stage) -----\n" + text
    if args.output:
        text = listings.getvalue() + text
        _write_output("--output", args.output, text)
        print(f"wrote {args.output} ({text.count(chr(10))} lines)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.timing:
        print(pm.timing_report(), file=sys.stderr)
    return 0


def _lowered_dump_name(pm) -> str:
    """--dump-ir's file for the kernel IR listing: numbered after the pass dumps (NN-lowered.txt)."""
    return f"{len(pm.dump_names()):02d}-lowered.txt"


def _print_after(values) -> set[str]:
    """--print-after values (repeated and/or comma-separated) -> a set of step names; MtcError naming
    the valid ones."""
    from passes import PIPELINES
    from .errors import did_you_mean
    valid = PIPELINES["default"] + ["lower"]          # == PRINT_AFTER (the --help text); a test checks
    names = {v.strip() for text in values or () for v in text.split(",") if v.strip()}
    if values and not names:             # `--print-after ""` (or ","): it would print nothing, silently
        raise MtcError(f"--print-after needs a pass name: one of {', '.join(valid)}, or all")
    for n in sorted(names):
        if n not in valid and n != "all":
            raise MtcError(f"--print-after: unknown pass '{n}'{did_you_mean(n, valid + ['all'])}; the passes are "
                           f"{', '.join(valid)}, or all (several: comma-separated or repeat the flag)")
    return names


def _warn_stage_flags(args, print_after: set) -> None:
    """Warn about flags that the chosen --stage ignores; then fill in their defaults."""
    lowered = [f for f, v in (("--seq-len", args.seq_len), ("--gpus", args.gpus), ("--slots", args.slots),
                              ("--checkpointing", args.checkpointing)) if v is not None]
    if args.target is not None and not print_after & {"lower", "all"}:
        lowered.append("--target")
    if lowered and args.stage != "lowered":
        _warn(f"{', '.join(lowered)} only affect{'s' if len(lowered) == 1 else ''} --stage lowered; ignored "
              f"at --stage {args.stage}")
    if args.tvm_schedule is not None and args.stage != "tvm":
        _warn(f"--tvm-schedule only affects --stage tvm; ignored at --stage {args.stage}")
    args.gpus = args.gpus or 1
    args.checkpointing = args.checkpointing or "layer"
    args.target = args.target or ("tvm" if args.stage == "tvm" else "triton")   # --stage tvm is target tvm


def _tvm_report(args, g) -> str:
    """The TVMScript of every distinct TVM kernel the model needs (target="tvm")."""
    from backends.tvm import model_tvmscript
    return model_tvmscript(g, scheduled=args.tvm_schedule)


def _lower(args, pm):
    """The kernel IR program of `mtc ir` (what compile(target=args.target) runs)."""
    from passes.lower import lower
    from passes import PassManager, pipeline
    fused = pm.stages["fused"]
    names = pipeline(args.target)
    if names != [p.name for p in pm.passes]:     # what compile(target=...) runs after canonicalize
        fused = PassManager(names[names.index("canonicalize") + 1:]).run(pm.stages["canonical"])
    # shapes the kernel templates cannot take: compile(target=...) refuses them, so the listing says so first
    from backends.runtime import _check_kernel_constraints
    try:
        _check_kernel_constraints(fused, args.target)
    except MtcError as e:
        where = f"{e.loc}: " if e.loc is not None else ""
        _warn(f"{where}dsl.compile(target='{args.target}') refuses this model, so the listing below cannot run as "
              f"is: {e.msg}")
    return lower(fused, target=args.target)


def _lowered_report(args, g, pm, prog) -> str:
    """Kernel list, per-GPU memory plan and expert placement for `mtc ir --stage lowered`."""
    from passes.place_experts import plan as place
    from passes.plan_memory import plan_memory
    t0 = time.perf_counter()
    out = [prog.text()]
    counts = prog.counts()
    out.append(f"// {len(prog.launches)} launches" + (": " + ", ".join(f"{k} x{v}" for k, v in counts.items())
                                                      if counts else ""))
    out.append(f"// code cache key: {prog.cache_key()}\n")
    T = args.seq_len or dict(g.meta_get("config", ())).get("max_seq_len", 4096)
    moe = [n for n in g.nodes if n.op in ("latent_moe", "moe")]
    # layers of different expert counts share one slot count per layer (>= the largest; the smaller layers fill
    # the extra slots with replicas) and get one placement per expert count
    counts = sorted({int(n.attr("experts")) for n in moe})
    E = counts[-1] if moe else None
    fit = None if E is None else -(-E // args.gpus) * args.gpus      # the fewest slots >= E on --gpus GPUs
    if args.slots is not None:
        if E is None:
            _warn(f"--slots {args.slots} ignored: model '{g.name}' has no MoE layer")
        elif args.slots < E or args.slots % args.gpus:
            which = "a MoE layer" if len(counts) == 1 else "the largest MoE layer"
            raise MtcError(f"--slots {args.slots}: needs at least the {E} experts of {which} and a multiple of "
                           f"--gpus {args.gpus} (the slots are spread evenly over the GPUs); e.g. --slots {fit}")
    slots = args.slots or fit
    try:
        mp = plan_memory(g, seq_len=T, gpus=args.gpus, checkpointing=args.checkpointing,
                         num_slots=slots, canonical=pm.stages["canonical"],
                         two_phase_attn_res=args.target != "tvm")    # what compile(target=...) runs
        out.append(mp.summary())
        if args.checkpointing != "inference":    # and the forward without autograd, as the program runs it
            out.append("\n" + plan_memory(g, seq_len=T, gpus=args.gpus, checkpointing="inference",
                                          num_slots=slots, canonical=pm.stages["canonical"],
                                          two_phase_attn_res=args.target != "tvm", target=args.target).summary())
        from passes.place_experts import MAX_GPUS, MAX_SLOTS
        if moe and (args.gpus > MAX_GPUS or slots > MAX_SLOTS):
            out.append(f"\nexpert placement: not planned for {args.gpus:,} GPUs / {slots:,} slots (the planner takes one "
                       f"expert-parallel group of at most {MAX_GPUS:,} GPUs and {MAX_SLOTS:,} slots; "
                       f"passes.place_experts.plan(load, num_gpus=...) plans one group from Python)")
        elif moe:
            for Ei in counts:
                if len(counts) > 1:
                    k = sorted({int(n.attr("top_k")) for n in moe if int(n.attr("experts")) == Ei})
                    nl = sum(int(n.attr("experts")) == Ei for n in moe)
                    out.append(f"\n// MoE layers with {Ei} experts (top-{'/'.join(map(str, k))}): {nl} of {len(moe)}")
                out.append("\n" + place(None, args.gpus, num_slots=slots, num_experts=Ei).summary())
    except ValueError as e:
        raise MtcError(str(e)) from None
    out.append(f"\n// memory plan and placement took {time.perf_counter() - t0:.2f} s")
    return "\n".join(out) + "\n"


#: --dtype of `mtc run`: canonical name -> (the graph dtype, aliases)
RUN_DTYPE_NAMES = {"float32": ("f32", ("fp32", "f32")), "bfloat16": ("bf16", ("bf16",)),
                   "float16": ("f16", ("fp16", "f16"))}
_DTYPE_HELP = " | ".join(f"{n} ({', '.join(a)})" for n, (_ir, a) in RUN_DTYPE_NAMES.items())


def _canonical_dtype(text: str | None) -> str:
    """--dtype as given (any alias, any case) -> its canonical name; MtcError naming the choices."""
    if text is None:
        return "float32"
    t = text.strip().lower()
    for name, (_ir, aliases) in RUN_DTYPE_NAMES.items():
        if t == name or t in aliases:
            return name
    raise MtcError(f"--dtype must be one of {_DTYPE_HELP}; got '{text}'")


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


def _check_fits(g, dtype_bytes: int, device: str, spec=None, variant=None) -> None:
    """Refuse, before allocating, a model whose weights cannot fit in this machine's memory (``spec``: its file,
    whose other variants than ``variant`` the message names)."""
    import torch
    from backends.runtime import check_weights_fit
    if device.startswith("cuda"):
        _check_device(device)

    def advice() -> str:
        variants = [v for v in (_spec_variants(spec) if spec is not None else []) if v != variant]
        return ((f"try another variant (--variant {' or '.join(variants)}), or " if variants else "")
                + "count it with `mtc stats` / `mtc ir --stage lowered`")
    check_weights_fit(g, dtype_bytes, torch.device(device), advice, packed_mxfp4=True)   # as dsl.compile holds them


def _check_run_input(g) -> None:
    """`mtc run` feeds one input, byte token ids [batch, seq-len] of any size: say so before compiling."""
    ins = g.inputs()
    decl = ", ".join(f"{n.attr('name')}: {n.types[0]}" for n in ins)
    if len(ins) != 1:
        raise MtcError(f"`mtc run` feeds one input, byte token ids [batch, seq-len]; model '{g.name}' takes "
                       f"{len(ins)} ({decl}): run it from Python, "
                       f"dsl.compile(g).run({', '.join(n.attr('name') + '=...' for n in ins)})")
    t = ins[0].types[0]
    if t.dtype not in ("i64", "i32") or t.rank != 2:
        raise MtcError(f"`mtc run` feeds byte token ids, an integer [batch, seq-len] tensor; model '{g.name}' "
                       f"takes {decl}: run it from Python, dsl.compile(g)(x)")
    if any(d.is_number for d in t.shape):
        raise MtcError(f"`mtc run` feeds windows of --batch-size x --seq-len tokens (the last one shorter); "
                       f"model '{g.name}' takes {decl}, a fixed shape: declare it "
                       f"{ins[0].attr('name')}: {t.dtype}[B, T] with B and T not config fields (a config field "
                       f"used as a dimension is its value), or run it from Python")
    # ... and scores next-token prediction: one output, the logits [batch, seq-len, vocab] of an lm_head
    nodes = g.node_map()
    outs = ", ".join(f"{g.type_of(o, nodes)} ({nodes[o.node].op})" for o in g.outputs)
    if len(g.outputs) != 1:
        raise MtcError(f"`mtc run` scores next-token prediction from one output, the logits [batch, seq-len, vocab]; "
                       f"model '{g.name}' returns {len(g.outputs)}: {outs}; run it from Python, dsl.compile(g)(ids)")
    o = g.outputs[0]
    ot, producer = g.type_of(o, nodes), nodes[o.node]
    if (producer.op != "lm_head" or ot.rank != 3 or ot.dtype not in ("f32", "f16", "bf16")
            or not ot.shape[2].is_number or list(ot.shape[:2]) != list(t.shape)):
        raise MtcError(f"`mtc run` scores next-token prediction: the model must return the logits of an lm_head, "
                       f"[{t.shape[0]}, {t.shape[1]}, vocab]; model '{g.name}' returns {outs}",
                       producer.loc if producer.op != "input" else None)


def _warn_past_max_seq_len(g, T: int, flag: str, what: str) -> None:
    """A warning when the context length T is past the spec's max_seq_len (the model still runs: its
    attention has no position embeddings; KDA is recurrent and MLA is NoPE)."""
    from passes.stats import declared_max_seq_len
    m = declared_max_seq_len(g)
    if m is not None and T > m:
        _warn(f"{flag} {T:,} is beyond the spec's max_seq_len = {m:,} of model '{g.name}'; {what}")


def _run_setup(args):
    """The dtype (name, torch dtype) of --dtype, after checking --device and --target; Triton / TVM kernels on
    the CPU run under the interpreter (TRITON_INTERPRET=1, set here unless triton was imported without it)."""
    import warnings
    dtype_name = _canonical_dtype(args.dtype)
    _check_device(args.device)
    if args.target not in ("reference", "triton", "tvm"):
        raise MtcError(f"--target must be reference, triton or tvm; got '{args.target}'")
    if args.target in ("triton", "tvm") and args.device == "cpu":
        from backends import interpreting
        if "triton" in sys.modules and not interpreting():
            raise MtcError("--target triton on the CPU needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # the interpreter evaluates masked-off lanes too (exp of padding); those results are discarded
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    return dtype_name, RUN_DTYPE_NAMES[dtype_name][0]


def cmd_run(args) -> int:
    import warnings
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from . import compile as mtc_compile

    dtype_name, dtype = _run_setup(args)
    # piped output: whole lines, not wrapped at 80 columns; with --json - the report goes to stderr, so that
    # standard output is the JSON alone
    c = Console(stderr=args.json == "-", soft_wrap=True)
    spec = args.spec or str(DEFAULT_SPEC)
    variant = args.variant if (args.variant is not None or args.spec) else "tiny"
    if args.input == "":
        raise MtcError("--input is empty: give a text file, or - for standard input")
    stdin = args.input == "-"
    text_path = Path(args.input) if args.input and not stdin else DEFAULT_TEXT
    if args.json is not None and args.json != "-":
        if not args.json:
            raise MtcError("--json needs a file name (or - for standard output)")
        _check_output_file("--json", args.json, {"input spec": spec, "--input text": None if stdin else text_path})
    if "dtype" in _overrides(args.set):
        raise MtcError("--set dtype=... changes the spec's declared dtype (what `mtc stats` / `mtc ir` count); "
                       "mtc run computes in --dtype (default float32): use --dtype instead")
    try:
        if stdin:
            data = sys.stdin.buffer.read(args.max_tokens)
        else:
            with open(text_path, "rb") as fh:         # only what is used: --max-tokens bytes
                data = fh.read(args.max_tokens)
    except OSError as e:
        raise MtcError(f"cannot read --input '{args.input if stdin else text_path}': {e.strerror}") from None
    src = "standard input" if stdin else text_path.name
    if len(data) < 2:
        raise MtcError(f"--input '{args.input if stdin else text_path}' gives {len(data)} byte token(s) (with "
                       f"--max-tokens {args.max_tokens}); need at least 2 to predict a next token")
    g = _load_spec(spec, variant, args.set)
    _check_run_input(g)
    vocab = int(g.type_of(g.outputs[0]).shape[-1])
    if vocab < 256:
        raise MtcError(f"model '{g.name}' has a vocabulary of {vocab}; the byte-level tokenizer needs >= 256")
    _check_fits(g, 4 if dtype == "f32" else 2, args.device, spec, variant)
    t0 = time.perf_counter()
    m = mtc_compile(g, target=args.target, dtype=dtype, device=args.device, seed=args.seed)
    m.eval()
    ids = torch.tensor(list(data), dtype=torch.long)
    T = args.seq_len
    _warn_past_max_seq_len(g, min(T, len(ids) - 1), "--seq-len",
                           "it runs (nothing in the model has a length limit: no position embeddings), but "
                           "the spec declares contexts up to max_seq_len")
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
            f"{dtype_name}) on {src}: {len(ids):,} byte tokens in {n} window"
            f"{'s' if n != 1 else ''} of up to {T}; compiled in {time.perf_counter() - t0:.2f} s")
    if args.target in ("triton", "tvm") and str(args.device) == "cpu" and len(ids) > 512:
        c.print("note: on the CPU the Triton kernels run under the interpreter (a few tokens/s for the tiny model); "
                "--max-tokens 256 --seq-len 64 gives a quick check")
    total_loss, total_tok = 0.0, 0
    loads: dict[str, torch.Tensor] = {}
    t1 = time.perf_counter()
    # on a terminal: live bars (windows, and the ops of the current window); otherwise (piped, CI logs)
    # a plain line on stderr at most every 10 s, so a long run is never silent
    plain = not c.is_terminal
    last_note = [time.perf_counter()]

    def note(what, force=False):
        now = time.perf_counter()
        if plain and (force or now - last_note[0] >= 10):
            last_note[0] = now
            print(f"mtc run: {what}, {now - t1:.0f} s", file=sys.stderr, flush=True)

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} {task.fields[unit]}"), TimeElapsedColumn(),
                  console=c, transient=True, disable=plain) as prog:
        task = prog.add_task("forward", total=n, unit="windows")
        ops_task = prog.add_task("  ops of this window", total=1, unit="ops")
        done_windows = [0]

        def op_progress(i, total):
            prog.update(ops_task, completed=i + 1, total=total)
            note(f"window {done_windows[0] + 1}/{n}, op {i + 1}/{total}")

        with torch.no_grad(), warnings.catch_warnings():
            from .errors import MtcWarning          # the runtime's own past-max_seq_len warning: said above
            warnings.filterwarnings("ignore", message=r".*past the spec's max_seq_len", category=MtcWarning)
            chunked = args.chunk_tokens is not None
            if chunked:                                    # every chunk's router loads (routing_stats: the last's)
                prog.update(ops_task, description="  chunks of this window (prefill)")

                def add_load(layer, load):
                    loads[layer] = loads.get(layer, 0) + load.cpu()
                m.stats_hooks.append(add_load)

                def chunk_progress(i, total):
                    prog.update(ops_task, completed=i, total=total, unit="chunks")
                    note(f"window {done_windows[0] + 1}/{n}, chunk {i}/{total}")
            for rows in batches:
                batch = torch.stack(rows).to(args.device)
                if chunked:
                    # the window through chunked prefill (KDA / conv states and the MLA latent cache carried across
                    # chunks): the same logits in the memory of one chunk's activations
                    cache = m.new_cache(batch.shape[0], batch.shape[1] - 1)
                    logits = m.prefill(batch[:, :-1], cache, chunk_tokens=args.chunk_tokens, progress=chunk_progress)
                    del cache
                else:
                    logits = m(batch[:, :-1], progress=op_progress)
                if not torch.isfinite(logits).all():
                    raise MtcError("the forward pass produced non-finite logits")
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                         batch[:, 1:].reshape(-1), reduction="sum")
                total_loss += float(loss)
                total_tok += batch[:, 1:].numel()
                for k, v in (m.routing_stats.items() if not chunked else ()):
                    loads[k] = loads.get(k, 0) + v.cpu()
                prog.update(task, advance=len(rows))
                done_windows[0] += len(rows)
                note(f"{done_windows[0]}/{n} windows", force=done_windows[0] == n)
    dt = time.perf_counter() - t1
    nll = total_loss / total_tok
    c.print(f"loss {nll:.4f} nats/token ({nll / 0.6931471805599453:.3f} bits/byte), perplexity "
            f"{torch.tensor(nll).exp():.2f}, over {total_tok:,} predicted token{'s' if total_tok != 1 else ''} in "
            f"{dt:.2f} s "
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
    if args.json is not None:
        out = {"model": g.name, "spec": spec, "variant": variant, "set": args.set or [], "target": args.target,
               "device": args.device, "dtype": dtype_name, "seed": args.seed, "input": "-" if stdin else str(text_path),
               "max_tokens": args.max_tokens, "seq_len": T, "batch_size": args.batch_size,
               "chunk_tokens": args.chunk_tokens,
               "loss": nll, "bits_per_byte": nll / math.log(2), "perplexity": math.exp(nll), "tokens": total_tok,
               "seconds": dt, "expert_load": {k: v.tolist() for k, v in loads.items()}}
        if args.json == "-":
            print(json.dumps(out, indent=2))
        else:
            _write_output("--json", args.json, json.dumps(out, indent=2))
            c.print(f"wrote {args.json}")
    return 0


class _ByteStream:
    """Prints byte tokens as text as they come: UTF-8 decoded incrementally (a character split over tokens waits
    for its last byte; invalid bytes show as U+FFFD), control characters other than newline and tab escaped
    (\\x1b), so that a model's output cannot drive the terminal."""

    def __init__(self, out):
        import codecs
        self.out, self.dec = out, codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, data: bytes, final: bool = False) -> None:
        text = self.dec.decode(data, final)
        self.out.write("".join(ch if ch.isprintable() or ch in "\n\t" else repr(ch)[1:-1] for ch in text))
        self.out.flush()


def cmd_generate(args) -> int:
    import warnings
    import torch
    from . import compile as mtc_compile

    dtype_name, dtype = _run_setup(args)
    if (args.prompt is None) == (args.input is None):
        raise MtcError("give the prompt as --prompt TEXT or --input FILE (- for standard input), one of them")
    if args.max_new_tokens < 0:
        raise MtcError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.prompt is not None:
        data = args.prompt.encode("utf-8")
        src = "--prompt"
    else:
        try:
            if args.input == "-":
                data = sys.stdin.buffer.read(args.max_prompt_tokens)
            else:
                with open(args.input, "rb") as fh:
                    data = fh.read(args.max_prompt_tokens)
        except OSError as e:
            raise MtcError(f"cannot read --input '{args.input}': {e.strerror}") from None
        src = f"--input '{args.input}'"
    if not data:
        raise MtcError(f"{src} is empty: generate needs at least one prompt token")
    if "dtype" in _overrides(args.set):
        raise MtcError("--set dtype=... changes the spec's declared dtype; mtc generate computes in --dtype")
    spec = args.spec or str(DEFAULT_SPEC)
    variant = args.variant if (args.variant is not None or args.spec) else "tiny"
    g = _load_spec(spec, variant, args.set)
    _check_run_input(g)
    vocab = int(g.type_of(g.outputs[0]).shape[-1])
    if vocab < 256:
        raise MtcError(f"model '{g.name}' has a vocabulary of {vocab}; the byte-level tokenizer needs >= 256")
    _check_fits(g, 4 if dtype == "f32" else 2, args.device, spec, variant)
    m = mtc_compile(g, target=args.target, dtype=dtype, device=args.device, seed=args.seed)
    m.eval()
    ids = torch.tensor([list(data)], dtype=torch.long, device=args.device)
    eos = None
    if args.eos_byte is not None:
        if not 0 <= args.eos_byte < 256:
            raise MtcError(f"--eos-byte must be a byte value in [0, 256), got {args.eos_byte}")
        eos = args.eos_byte
    gen = torch.Generator(device=args.device).manual_seed(args.sample_seed) if args.do_sample else None
    out = _ByteStream(sys.stdout)
    out.write(data)

    def stream(tok):
        out.write(bytes([int(tok[0])]))
    timings: dict = {}
    with warnings.catch_warnings():
        from .errors import MtcWarning
        warnings.filterwarnings("ignore", message=r".*past the spec's max_seq_len", category=MtcWarning)
        m.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, eos_token_id=eos, streamer=stream, generator=gen,
                   chunk_tokens=args.chunk_tokens, timings=timings)
    out.write(b"", final=True)
    sys.stdout.write("\n")
    sys.stdout.flush()
    pf, dc = timings["prefill_s"], timings["decode_s"]
    steps = timings["decode_steps"]
    print(f"{g.name} ({args.target}, {dtype_name}): prefill {timings['prefill_tokens']:,} tokens in {pf:.2f} s "
          f"({timings['prefill_tokens'] / max(pf, 1e-9):,.1f} tokens/s); decode {steps} tokens in {dc:.2f} s "
          f"({steps / max(dc, 1e-9):,.1f} tokens/s)", file=sys.stderr)
    return 0


def _spec_variants(spec) -> list:
    """The variant names of a spec file (for messages); [] when it cannot be read."""
    from .spec import parse_spec, read_spec_file
    try:
        return list(parse_spec(read_spec_file(spec), str(spec)).variants)
    except (OSError, UnicodeDecodeError, MtcError):
        return []


def cmd_import_hf(args) -> int:
    """Write the .mtc spec of a Hugging Face checkpoint's config.json (the graph dsl.from_hf builds)."""
    from .checkpoint import import_hf
    text = import_hf(args.dir, strict=not args.lenient)
    if args.output is None:
        print(text, end="")
        return 0
    if os.path.lexists(args.output) and not args.force:
        raise MtcError(f"-o '{args.output}' exists; mtc does not overwrite it (--force replaces it)")
    _check_output_file("-o", args.output, {"config.json": str(Path(args.dir) / "config.json")})
    _write_output("-o", args.output, text)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_compile(args) -> int:
    from backends.triton.codegen import write_and_load
    from . import compile as mtc_compile
    os.environ.setdefault("TRITON_INTERPRET", "0" if _has_cuda() else "1")
    if args.emit is not None:
        if not args.emit.strip():
            raise MtcError("--emit needs a directory name (without --emit the kernels go to the cache)")
    from backends.triton.codegen import EMIT_FILES
    emit = _check_output_dir("--emit", args.emit, EMIT_FILES, [args.spec]) if args.emit is not None else None
    g = _load(args)
    m = mtc_compile(g, target="triton", device="meta")     # no weights are allocated: the full model compiles too
    prog = m.program
    path, _mod, kernels = write_and_load(prog, emit)
    n_gen = len({k.name for k in kernels})
    print(f"{g.name}: {len(prog.launches)} kernel launches, {len(kernels)} of them generated pointwise "
          f"kernels ({n_gen} distinct)")
    print(f"kernel source: {path}")
    print(f"kernel IR:     {path.parent / 'kernel_ir.txt'}")
    return 0


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _keywords(od) -> str:
    """An op's spec keywords: required ones first as 'k (required)', then 'k=default', then name=."""
    from .builder import REQUIRED
    from .spec import describe as _lit            # a default value as a spec writes it
    kw = {**od.param_attrs, **od.attrs}
    req = [f"{k} (required)" for k, v in kw.items() if v is REQUIRED]
    opt = [f"{k} (optional)" if v is None else f"{k}={_lit(v)}" for k, v in kw.items() if v is not REQUIRED]
    if od.params is not None:
        opt.append(f"name={_lit(od.default_name)}" if od.default_name else "name (required)")
    return ", ".join(req + opt)


def _wrap(text: str, indent: str = "    ") -> str:
    import textwrap
    return textwrap.fill(text, width=100, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False)


def cmd_ops(args) -> int:
    from .errors import did_you_mean
    from .ops import OPS, STACK
    names = sorted(list(OPS) + ["stack"])
    if args.op is not None and args.op not in names:
        related = [n for n in names if args.op and (n.startswith(args.op) or args.op in n.split("_"))]
        hint = (f" (ops named {args.op}...: {', '.join(related)})" if related and not did_you_mean(args.op, names)
                else did_you_mean(args.op, names))
        raise MtcError(f"unknown op '{args.op}'{hint}; `mtc ops` lists them all")
    out = []
    for name in names:
        if args.op is not None and name != args.op:
            continue
        if name == "stack":
            out.append(f"stack  [spec statement: a stack of layers]\n    in a spec:  {STACK.form}\n"
                       + _wrap(STACK.notes))
            form = STACK
        else:
            od = OPS[name]
            form = od.spec
            kind = "layer" if od.is_layer else "op"
            if od.params is not None:
                kind += ", owns parameters"
            lines = [f"{name}  [{kind}]"]
            if form is not None and form.form:
                lines.append(f"    in a spec:  {form.form}")
            elif form is not None:
                lines.append("    in a spec:  (not written in a spec)")
            kw = _keywords(od)
            if kw:
                lines.append(_wrap(f"keywords:   {kw}"))
            lines.append(f"    graph op:   {name}({', '.join(od.inputs)})")
            if form is not None and form.notes:
                lines.append(_wrap(form.notes))
            lines.append(_wrap(od.doc))
            out.append("\n".join(lines))
        if args.op and form is not None and form.example:
            out.append("example (a whole spec: `mtc stats`, `mtc ir` at every --stage and dsl.compile(target="
                       "\"reference\" or \"triton\") accept it):\n"
                       + "".join(f"    {ln}\n" for ln in form.example.splitlines()))
    print("\n".join(out))
    return 0


# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtc", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="mtc: a compiler-style graph DSL for trillion-parameter sparse MoE models with "
                    "million-token contexts (the Kimi K3 family). Write the architecture as a .mtc spec, "
                    "inspect every IR stage, count parameters/FLOPs/memory, and run it.")
    p.add_argument("--version", "-V", action="version", version=f"mtc {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    p._mtc_commands = sub.choices          # name -> sub-parser (for _parse's per-command usage)

    s = sub.add_parser("stats", help="parameters, active parameters, FLOPs/token, memory at a context length",
                       description="Counts everything from the graph IR: total and active (per-token) "
                                   "parameters, forward FLOPs per token at --seq-len (MLA attention grows "
                                   "with T, KDA does not), weights, MLA latent KV cache and KDA state.")
    _add_spec_args(s)
    s.add_argument("--seq-len", "-T", type=int, default=None,
                   help="context length (default: the spec's max_seq_len, else 4096)")
    s.add_argument("--batch", type=int, default=None,
                   help="sequences held at once (KV cache and state scale with it; default 1)")
    s.add_argument("--gpus", type=int, default=1,
                   help="GPUs to spread weights and caches over (even split; default 1)")
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
    s.add_argument("--stage", default="graph", help="graph | typed | canonical | fused | lowered | tvm (default graph)")
    s.add_argument("--seq-len", "-T", type=int, default=None,
                   help="(lowered) context length for the memory plan (default: the spec's max_seq_len, else 4096)")
    s.add_argument("--gpus", type=int, default=None,
                   help="(lowered) GPUs for the memory plan and expert placement (default 1)")
    s.add_argument("--slots", type=int, default=None,
                   help="(lowered) physical expert slots per MoE layer: >= the experts and a multiple of --gpus "
                        "(more than the experts: replicas of the hottest; default: the fewest such)")
    s.add_argument("--checkpointing", default=None, choices=["none", "layer", "block", "inference"],
                   help="(lowered) activation checkpointing for the memory plan (default layer)")
    s.add_argument("--target", default=None, choices=["triton", "tvm"], type=str.lower,
                   help="(lowered, --print-after lower) the target to lower for (default triton)")
    s.add_argument("--tvm-schedule", default=None, choices=["llvm", "cuda"],
                   help="(tvm) print the TVMScript after the llvm or cuda schedule")
    s.add_argument("--print-after", action="append", metavar="PASS[,PASS...]",
                   help=f"also print the IR after these passes (comma-separated or repeated): "
                        f"{', '.join(PRINT_AFTER)}, or all")
    s.add_argument("--dump-ir", metavar="DIR",
                   help="write the graph IR after every graph pass to DIR, one file per pass (NN-<pass>.ir, NN in "
                        "pipeline order); the whole graph pipeline runs for it whatever --stage (which only picks "
                        "what is printed); --stage lowered adds the lowered kernel listing as NN-lowered.txt (the "
                        "lower pass's output is not graph IR). DIR may hold other files, but a file of one of those "
                        "names is replaced only if mtc wrote it there and it is unchanged (listed in DIR/"
                        ".mtc-outputs.json); else nothing is written")
    s.add_argument("--timing", action="store_true",
                   help="print per-pass timing to stderr (of the whole graph pipeline, whatever --stage)")
    s.add_argument("--no-loc", action="store_true", help="omit source locations")
    s.add_argument("--output", "-o", help="write to a file instead of stdout (atomically: a failed write leaves an "
                                          "existing file as it was)")
    s.set_defaults(fn=cmd_ir)

    s = sub.add_parser("run", help="run the forward pass on a text file; print loss and expert load",
                       description="Byte-level tokenizer (vocab >= 256), next-token cross-entropy, and per-layer "
                                   "expert load. With no SPEC: the tiny K3 variant on a text shipped with mtc.")
    _add_spec_args(s, spec_optional=True)
    s.add_argument("--input", "-i", help=f"a text file, or - for standard input (default: "
                                         f"{DEFAULT_TEXT.relative_to(ROOT)}); only --max-tokens bytes are read")
    s.add_argument("--target", default="reference", type=str.lower,
                   help="reference | triton | tvm (on CPU: Triton interpreter; default reference)")
    s.add_argument("--seq-len", "-T", type=int, default=256,
                   help="tokens per sequence (default 256; beyond the spec's max_seq_len: a warning)")
    s.add_argument("--batch-size", type=int, default=4, help="sequences per forward (default 4)")
    s.add_argument("--chunk-tokens", type=int, default=None,
                   help="run each batch of windows through chunked prefill, this many tokens per chunk (all rows): "
                        "the same loss in the memory of one chunk, for a --seq-len whose forward would not fit "
                        "(a progress bar per chunk)")
    s.add_argument("--max-tokens", type=int, default=8192, help="read at most this many bytes (default 8192)")
    s.add_argument("--dtype", default=None, help=f"{_DTYPE_HELP} (default float32)")
    s.add_argument("--device", default="cpu", type=str.lower, help="cpu | cuda (default cpu)")
    s.add_argument("--seed", type=seed, default=0, help="parameter initialisation seed (0 .. 2^63-1; default 0)")
    s.add_argument("--json", metavar="FILE", help="also write the results as JSON (- for standard output): the "
                                                 "settings of the run, loss, bits/byte, perplexity, expert load")
    s.set_defaults(fn=cmd_run)

    s = sub.add_parser("generate", help="generate text from a prompt (byte tokens), streaming; prefill and decode "
                                        "tokens/s",
                       description=textwrap.fill(
                           "Byte-level tokenizer as in `mtc run` (vocab >= 256). The prompt runs through chunked "
                           "prefill into the model's cache (KDA and short-conv states, MLA latent cache), then one "
                           "decode step per new token; the text (prompt, then each new byte as it comes) goes to "
                           "standard output, a last line with the prefill and decode tokens/s to standard error. "
                           "Greedy unless --do-sample (then --temperature, --top-k, --top-p as in Hugging Face's "
                           "generate). The weights are the seed's random initialisation: the text is noise until a "
                           "trained state dict is loaded from Python (m.load_state_dict, then m.generate).", 78),
                       epilog="examples:\n  mtc generate models/kimi_k3.mtc --variant tiny --prompt \"Once upon\" "
                              "--max-new-tokens 32\n  mtc generate --input notes.txt --max-new-tokens 64 --do-sample "
                              "--top-p 0.9 --chunk-tokens 512\n  mtc generate --target triton --prompt hi "
                              "--max-new-tokens 4     # Triton kernels (the CPU interpreter: slow)",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_spec_args(s, spec_optional=True)
    s.add_argument("--prompt", "-p", help="the prompt text (UTF-8 bytes are its tokens)")
    s.add_argument("--input", "-i", help="read the prompt from a file (- for standard input); at most "
                                         "--max-prompt-tokens bytes")
    s.add_argument("--max-new-tokens", "-n", type=int, default=32, help="tokens to generate (default 32)")
    s.add_argument("--max-prompt-tokens", type=int, default=1 << 20,
                   help="read at most this many bytes of --input (default 1048576)")
    s.add_argument("--chunk-tokens", type=int, default=None,
                   help="prefill chunk in tokens (default: from the memory plan and the free memory)")
    s.add_argument("--do-sample", action="store_true", help="sample instead of greedy argmax")
    s.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0; default 1.0)")
    s.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set reaching this "
                                                            "probability (0 < p <= 1)")
    s.add_argument("--sample-seed", type=seed, default=0, help="the sampling generator's seed (default 0)")
    s.add_argument("--eos-byte", type=int, default=None, help="stop when this byte value is generated (e.g. 10 "
                                                             "for a newline)")
    s.add_argument("--target", default="reference", type=str.lower,
                   help="reference | triton | tvm (on CPU: Triton interpreter; default reference)")
    s.add_argument("--dtype", default=None, help=f"{_DTYPE_HELP} (default float32)")
    s.add_argument("--device", default="cpu", type=str.lower, help="cpu | cuda (default cpu)")
    s.add_argument("--seed", type=seed, default=0, help="parameter initialisation seed (0 .. 2^63-1; default 0)")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("compile", help="compile to kernels and write the generated Triton source",
                       description="Lowers the model to the kernel IR and generates the Triton source of its "
                                   "pointwise kernels into the cache (keyed by the printed kernel IR, target "
                                   "and versions) or into --emit DIR; prints the paths.")
    _add_spec_args(s)
    s.add_argument("--emit", metavar="DIR", help="write kernels.py and kernel_ir.txt to DIR (created if missing); "
                                                 "an existing file of those names is replaced only if mtc wrote it "
                                                 "there and it is unchanged (DIR/.mtc-outputs.json lists them)")
    s.set_defaults(fn=cmd_compile)

    s = sub.add_parser("import-hf", help="write the .mtc spec of a Hugging Face checkpoint's config.json",
                       description="Reads DIR/config.json (Kimi Linear, or Kimi K3's text model) and writes the spec "
                                   "dsl.from_hf builds for it: the config's values as the spec's config block, the "
                                   "layer blocks of models/kimi_linear_48b.mtc or models/kimi_k3.mtc.")
    s.add_argument("dir", help="the checkpoint directory (or its config.json)")
    s.add_argument("-o", "--output", metavar="FILE", help="write the spec there (default: print it); an existing "
                                                           "file is not replaced without --force")
    s.add_argument("--force", action="store_true", help="replace an existing -o file")
    s.add_argument("--lenient", action="store_true", help="ignore config fields mtc does not know (default: an "
                                                           "error naming them)")
    s.set_defaults(fn=cmd_import_hf)

    s = sub.add_parser("ops", help="list the ops: how a spec writes them, their signatures and semantics",
                       description="Every op and the stack statement: the form a .mtc spec writes (keywords "
                                   "that size and name the parameters an op owns: out=, vocab=, dim=, name=), "
                                   "its keywords with defaults, the graph-op signature (as printed by `mtc ir`, "
                                   "parameters as inputs) and its semantics. With OP: that one, and a whole "
                                   "example spec using it.")
    s.add_argument("op", nargs="?", help="just this op (or stack), with an example spec")
    s.set_defaults(fn=cmd_ops)
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, except that an unknown flag after a command is reported with that command's usage
    (and a did-you-mean), not the top-level one."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        from .errors import did_you_mean
        sub = parser._mtc_commands.get(getattr(args, "cmd", None), parser)
        flags = [o for a in sub._actions for o in a.option_strings]
        first = extra[0].split("=", 1)[0]
        hint = did_you_mean(first, flags) if first.startswith("-") else ""
        sub.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


class _StdoutError(OSError):
    """Writing to stdout failed (other than a closed pipe): e.g. a full disk or /dev/full."""


class _GuardedStdout:
    """sys.stdout, except that a failed write or flush (not a closed pipe) raises _StdoutError, so that
    main() can tell it from the OSErrors of files it reads or writes."""

    def __init__(self, f):
        self._f = f

    def write(self, s):
        try:
            return self._f.write(s)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _StdoutError(e.errno, e.strerror) from None

    def flush(self):
        try:
            return self._f.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _StdoutError(e.errno, e.strerror) from None

    def __getattr__(self, name):
        return getattr(self._f, name)


#: the largest --seq-len / --batch the CLI takes (a trillion tokens: past any context, and exact in float64 sums)
MAX_TOKENS_ARG = 1 << 40


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:                                   # bare `mtc`: the help, as a usage error (exit 2)
        parser.print_help(sys.stderr)
        return 2
    args = _parse(parser, argv)
    for k in ("seq_len", "batch", "gpus", "batch_size", "max_tokens", "max_prompt_tokens", "chunk_tokens"):
        v = getattr(args, k, None)
        if v is not None and v < 1:
            print(f"mtc: error: --{k.replace('_', '-')} must be >= 1, got {v}", file=sys.stderr)
            return 2
        if k in ("seq_len", "batch") and v is not None and v > MAX_TOKENS_ARG:
            # past this the plans' float arithmetic no longer holds the integer (1e20 printed as 100,000,...,000)
            print(f"mtc: error: --{k.replace('_', '-')} must be at most 2**40 ({MAX_TOKENS_ARG:,}), got {v:,}",
                  file=sys.stderr)
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
    real_stdout = sys.stdout
    sys.stdout = _GuardedStdout(real_stdout)
    try:
        rc = args.fn(args)
        sys.stdout.flush()                         # a closed pipe shows here, inside the handler below
        return rc
    except _StdoutError as e:
        # stdout cannot take more (`mtc ops > /dev/full`): one line, exit 1, as for a closed pipe
        print(f"mtc: error: cannot write to stdout: {e.strerror}", file=sys.stderr)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except BrokenPipeError:
        # the reader went away (`mtc ops | head -1`): stop quietly, as the Python docs advise (signal
        # module notes): point stdout at devnull so the interpreter's final flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except MtcError as e:
        # located errors keep the compiler form "file:line:col: error: ..."; the others read like the argument
        # errors of argparse and the range checks above ("mtc: error: ...")
        print(e.render() if e.loc else f"mtc: {e.render()}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        # torch's out-of-memory errors (torch.OutOfMemoryError is a RuntimeError; on the CPU a RuntimeError from
        # its allocator): one line instead of a traceback (user trial: `mtc run --seq-len 65536` on the CPU, where
        # the reference MLA forms [T, T] scores)
        msg = str(e).strip()
        low = msg.lower()
        if not (isinstance(e, MemoryError) or any(k in low for k in (
                "out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory"))):
            raise
        first = msg.splitlines()[0] if msg else type(e).__name__
        print(f"mtc: error: out of memory while running: {first[:300]}; try a shorter --seq-len, a smaller "
              f"--batch-size or --variant", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown
        sys.stdout = real_stdout


if __name__ == "__main__":
    sys.exit(main())
