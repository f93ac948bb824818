"""A small pass manager: named passes, pipelines, --print-after, --dump-ir, per-pass timing, and the
verifier between passes.

    from passes import PassManager
    pm = PassManager(["verify", "infer_shapes", "canonicalize"], print_after={"canonicalize"})
    g2 = pm.run(g)
    pm.stages["canonical"]      # the Graph after the pass that produces that stage (str() prints it)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from dsl.errors import MtcError
from dsl.ir import Graph


@dataclass
class Pass:
    name: str
    fn: Callable[[Graph], Graph]
    stage: str | None = None      # the IR stage name this pass produces ("typed", "canonical", ...)
    doc: str = ""


PASSES: dict[str, Pass] = {}


def register_pass(name: str, stage: str | None = None):
    def deco(fn):
        PASSES[name] = Pass(name, fn, stage, (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "")
        return fn
    return deco


PIPELINES = {
    # graph (as parsed) -> typed -> canonical (layer blocks expanded into primitive ops) -> fused
    "default": ["verify", "infer_shapes", "canonicalize", "batch_attn_residual", "fuse_tiles"],
}

STAGES = ["graph", "typed", "canonical", "fused"]


def pipeline(target: str = "triton") -> list[str]:
    """The default passes a compiled module of ``target`` runs: the TVM target keeps Block AttnRes in its direct
    form (its kernels cover attn_residual, not the two-phase phase-1 / merge pair)."""
    names = PIPELINES["default"]
    return [p for p in names if p != "batch_attn_residual"] if target == "tvm" else list(names)


class PassManager:
    """Runs passes in order. ``stages`` maps stage name -> the Graph after the pass producing it ("graph": the
    input), filled on every run; ``keep_stages`` is accepted for compatibility and has no effect."""

    def __init__(self, passes: Iterable[str] | str = "default", *, print_after: Iterable[str] = (),
                 dump_dir: str | Path | None = None, verify_each: bool = True, keep_stages: bool = False,
                 printer: Callable[[str], None] = print):
        import passes as _p  # noqa: F401  (registers the built-in passes)
        names = PIPELINES[passes] if isinstance(passes, str) else list(passes)
        for n in names:
            if n not in PASSES:
                from dsl.errors import did_you_mean
                raise MtcError(f"unknown pass '{n}'{did_you_mean(n, PASSES)}; passes: {', '.join(PASSES)}")
        self.passes = [PASSES[n] for n in names]
        self.print_after = set(print_after)
        unknown = self.print_after - set(names) - {"all"}
        if unknown:
            raise MtcError(f"--print-after names passes not in the pipeline: {', '.join(sorted(unknown))}")
        from dsl.fileio import OutputDir
        # dumps go only where they replace no file but mtc's own earlier dumps (see dsl.fileio.OutputDir)
        self.dump_dir = (dump_dir if isinstance(dump_dir, OutputDir) or not dump_dir
                         else OutputDir(dump_dir, "dump_dir"))
        self.verify_each = verify_each
        self.keep_stages = keep_stages
        self.printer = printer
        self.timings: list[tuple[str, float]] = []
        self.stages: dict[str, Graph] = {}

    def dump_names(self) -> list[str]:
        """The files a run writes to ``dump_dir``: 00-graph.ir, then NN-<pass>.ir for each pass in order."""
        return ["00-graph.ir"] + [f"{i:02d}-{p.name}.ir" for i, p in enumerate(self.passes, 1)]

    def run(self, g: Graph) -> Graph:
        """Run the passes on ``g``; returns the last pass's graph. With ``dump_dir``: every dump name is checked
        first (MtcError naming a file there that mtc did not write, or that was changed since), then each dump
        is written atomically."""
        from .verify import verify
        self.stages["graph"] = g
        if self.dump_dir:
            self.dump_dir.check(self.dump_names())
            self.dump_dir.write("00-graph.ir", str(g))
        for i, p in enumerate(self.passes, 1):
            t0 = time.perf_counter()
            g = p.fn(g)
            dt = time.perf_counter() - t0
            self.timings.append((p.name, dt))
            if self.verify_each and p.name != "verify":
                verify(g)
            if p.stage:
                self.stages[p.stage] = g
            if p.name in self.print_after or "all" in self.print_after:
                self.printer(f"// ----- IR after {p.name} ({dt * 1e3:.1f} ms) -----\n{g}")
            if self.dump_dir:
                self.dump_dir.write(f"{i:02d}-{p.name}.ir", str(g))
        return g

    def timing_report(self) -> str:
        w = max((len(n) for n, _ in self.timings), default=4)
        lines = [f"{'pass':<{w}}  time (ms)"]
        lines += [f"{n:<{w}}  {t * 1e3:9.2f}" for n, t in self.timings]
        lines.append(f"{'total':<{w}}  {sum(t for _, t in self.timings) * 1e3:9.2f}")
        return "\n".join(lines)
