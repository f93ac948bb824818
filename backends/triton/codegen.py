"""Code generation for the pointwise launches of the kernel IR: each chain of elementwise and row-norm
ops (add, mul, silu, sigmoid, situ_glu, rmsnorm, l2norm) becomes one generated Triton kernel that reads
each input once, keeps the intermediates in registers (float32) and writes only the values used outside
the chain. One program handles a [ROWS, BLOCK_D] tile: ROWS whole rows of the last dimension (ROWS = 1
for wide rows; several rows when the row is short, e.g. the d = 128 l2norm of KDA, so that one program
still moves a useful amount of data: see ``launch_config`` / ``launch``).

Generated signature: ``(in..., out..., D, scalars..., BLOCK_D: constexpr, N=2**62, ROWS: constexpr = 1)``
with N the number of rows; the defaults keep the one-row-per-program launch ``fn[(rows,)](..., BLOCK_D=)``
valid, ``launch(k, fn, args, outs)`` uses the tiled one.

The generated file is written to a cache directory keyed by the kernel program's cache key (a hash of
the printed kernel IR, the target and the tool versions), so sizes of symbolic dims never enter it:

    $MTC_CACHE_DIR (default ~/.cache/mtc) / triton / <key> / kernels.py (and kernel_ir.txt)

A cache entry is checked against the source generated now on every load, so an entry that is damaged
(truncated, garbage bytes, a directory or an unreadable file in its place) is a miss: it is rewritten
(atomically, as every write) with one line on stderr.
"""
from __future__ import annotations

import importlib.util
import linecache
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from dsl.ir import Graph, Ref

from passes.lower import CODEGEN_OPS as ROW_OPS  # noqa: E402  (the lowering labels exactly these)
from passes.lower import TILE_ELEMS  # noqa: E402,F401  (elements of one program's [ROWS, BLOCK_D] tile)


@dataclass
class GeneratedKernel:
    name: str
    members: list[str]          # node names computed by this kernel
    inputs: list[str]           # printed refs, in argument order
    row_inputs: list[bool]      # True: [rows, D] operand; False: [D] vector (a norm weight)
    outputs: list[str]          # printed refs written by the kernel
    scalars: dict               # name -> value (eps)
    source: str
    width: int = 0              # D: the row width of the [rows, D] tiling


def cache_dir() -> Path:
    """Root of the generated-kernel cache: ``$MTC_CACHE_DIR`` (unset or empty: ``~/.cache/mtc``)."""
    from backends import cache_root
    return cache_root()


def _numel(t):
    n = 1
    for d in t.shape:
        n = n * d
    return n


def plan_kernel(idx: int, ops: list[str], outputs: list, g: Graph, prefix: str = "pw") -> GeneratedKernel | None:
    """The generated kernel computing the graph nodes ``ops`` (elementwise / row-norm ops and reshapes, which are
    identities on contiguous memory) and writing those of ``outputs`` ((printed ref, type) of the values used
    outside) that they define; None where the generator cannot build it. Every operand has the row width D of
    the row-norm ops (or of the last op) or the same number of elements as the result, so one flat [rows, D]
    tiling serves all."""
    nodes = g.node_map()
    ms = [nodes[m] for m in ops]
    if not ms or any(m.op not in ROW_OPS and m.op != "reshape" for m in ms):
        return None
    comp = [m for m in ms if m.op != "reshape"]
    if not comp:
        return None
    out_t = comp[-1].types[0]
    if out_t.dtype not in ("f32", "f16", "bf16") or out_t.rank < 1:
        return None
    norms = {m.types[0].shape[-1] for m in comp if m.op in ("rmsnorm", "l2norm")}
    if len(norms) > 1:
        return None
    D = norms.pop() if norms else out_t.shape[-1]
    if not D.is_number:
        return None
    total = _numel(out_t)
    names = {m.name for m in ms}
    in_refs: list[str] = []
    row_in: list[bool] = []
    var: dict[str, str] = {}
    body: list[str] = []
    scalars: dict[str, float] = {}

    def operand(r: Ref) -> str:
        key = str(r)
        if r.node in names:
            return var[key]
        t = nodes[r.node].types[r.index]
        if key not in in_refs:
            if t.shape == out_t.shape or (_numel(t) - total).expand() == 0 and (t.shape[-1] % D) == 0:
                row = True
            elif t.rank == 1 and t.shape[0] == D:
                row = False
            else:
                raise _Unsupported(key)
            in_refs.append(key)
            row_in.append(row)
            i = len(in_refs) - 1
            if row:
                body.append(f"    a{i} = tl.load(in{i} + offs, mask=mask, other=0.0).to(tl.float32)")
            else:   # a [D] vector (norm weight): one [1, BLOCK_D] row, broadcast over the tile's rows
                body.append(f"    a{i} = tl.load(in{i} + cols[None, :], mask=cmask, other=0.0).to(tl.float32)")
            var[key] = f"a{i}"
        return var[key]

    try:
        for j, m in enumerate(ms):
            x = [operand(r) for r in m.inputs]
            t = f"t{j}"
            if m.op == "reshape":               # same elements, same order: the value itself
                var[str(m.out())] = x[0]
                continue
            if m.op == "add":
                e = f"{x[0]} + {x[1]}"
            elif m.op == "mul":
                e = f"{x[0]} * {x[1]}"
            elif m.op == "silu":
                e = f"{x[0]} * tl.sigmoid({x[0]})"
            elif m.op == "sigmoid":
                e = f"tl.sigmoid({x[0]})"
            elif m.op == "situ_glu":
                bg, bu = float(m.attr("beta_gate")), float(m.attr("beta_up"))
                body.append(f"    g{j} = {bg!r} * _tanh({x[0]} / {bg!r}, False) * tl.sigmoid({x[0]})")
                e = f"g{j} * ({bu!r} * _tanh({x[1]} / {bu!r}, False))"
            elif m.op == "rmsnorm":
                scalars[f"eps{j}"] = float(m.attr("eps"))
                e = f"{x[0]} * (1.0 / tl.sqrt(tl.sum({x[0]} * {x[0]}, axis=1)[:, None] / D + eps{j})) * {x[1]}"
            elif m.op == "l2norm":
                scalars[f"eps{j}"] = float(m.attr("eps"))
                e = f"{x[0]} * (1.0 / tl.sqrt(tl.sum({x[0]} * {x[0]}, axis=1)[:, None] + eps{j}))"
            else:  # pragma: no cover - filtered above
                return None
            # keep padding lanes at zero so later row reductions stay exact
            body.append(f"    {t} = tl.where(mask, {e}, 0.0)")
            var[str(m.out())] = t
    except _Unsupported:
        return None
    outs = [r for r, _t in outputs if r.split("#")[0].lstrip("%") in names]
    if not outs:
        return None
    name = f"{prefix}{idx}_" + "_".join(m.op for m in comp)[:60]
    args = [f"in{i}" for i in range(len(in_refs))] + [f"out{i}" for i in range(len(outs))] + ["D"] + list(scalars)
    lines = ["@triton.jit",
             f"def {name}({', '.join(args)}, BLOCK_D: tl.constexpr, N={N_DEFAULT}, ROWS: tl.constexpr = 1):",
             f"    # {' -> '.join(m.op for m in ms)}",
             "    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)",
             "    cols = tl.arange(0, BLOCK_D)",
             "    cmask = (cols < D)[None, :]",
             "    mask = (rows < N)[:, None] & cmask",
             "    offs = rows[:, None] * D + cols[None, :]"]
    lines += body
    for i, r in enumerate(outs):
        lines.append(f"    tl.store(out{i} + offs, {var[r]}.to(out{i}.dtype.element_ty), mask=mask)")
    return GeneratedKernel(name, [m.name for m in ms], in_refs, row_in, outs, scalars, "\n".join(lines) + "\n",
                           int(D))


class _Unsupported(Exception):
    pass


N_DEFAULT = 1 << 62          # the row count assumed by a launch that does not pass N (one row per program)


def launch_config(n_rows: int, D: int) -> dict:
    """Grid and meta-parameters for a generated kernel over ``n_rows`` rows of width ``D``.

    BLOCK_D = next power of two >= D; ROWS = TILE_ELEMS // BLOCK_D rows per program (at least 1, at
    most the next power of two >= n_rows), so wide rows keep one row per program and short rows are
    tiled. Returns {"grid": (programs,), "BLOCK_D": ..., "ROWS": ..., "N": n_rows}.
    Raises ValueError for n_rows < 0 or D < 1."""
    if n_rows < 0 or D < 1:
        raise ValueError(f"generated kernel launch: need n_rows >= 0 and D >= 1, got {n_rows}, {D}")
    block_d = 1 << max(0, D - 1).bit_length()
    rows = max(1, min(TILE_ELEMS // block_d, 1 << max(0, n_rows - 1).bit_length()))
    return {"grid": (max(1, -(-n_rows // rows)),), "BLOCK_D": block_d, "ROWS": rows, "N": n_rows}


def launch(k: GeneratedKernel, fn, args: list, outs: list) -> None:
    """Launch generated kernel ``fn`` (of ``k``) on contiguous ``args`` (in ``k.inputs`` order) writing
    ``outs`` (allocated by the caller, shaped like the row operands): the tiled launch of
    ``launch_config``. The runtime's one-row-per-program launch gives the same values."""
    row = next(a for a, r in zip(args, k.row_inputs) if r)
    D = row.shape[-1]
    n_rows = row.numel() // D
    if n_rows == 0:
        return
    c = launch_config(n_rows, D)
    fn[c["grid"]](*args, *outs, D, *k.scalars.values(), BLOCK_D=c["BLOCK_D"], N=c["N"], ROWS=c["ROWS"])


HEADER = '''"""Generated by mtc from the kernel IR of {name} (cache key {key}). Do not edit."""
import triton
import triton.language as tl

from backends.triton.moe_kernels import _tanh   # _tanh(x, False): float32-accurate, a series near 0, NaN kept


'''


def generate(program) -> tuple[str, list[GeneratedKernel]]:
    """Triton source for every generated.* launch of ``program`` (launches of one body share one jit function:
    the lowering gives them one name) and their kernels in launch order."""
    kernels, sources = [], {}
    for L in program.launches:
        k = L.generated
        if k is None:
            continue
        sources.setdefault(k.name, k.source)
        kernels.append(k)
    key = program.cache_key()
    src = HEADER.format(name=program.name, key=key) + "\n\n".join(sources.values())
    return src, kernels


def same_body(a: GeneratedKernel, b: GeneratedKernel) -> bool:
    """The two kernels have one argument list and one body (their sources differ at most in the function's name
    and its comment line): one jit function serves both."""
    def sig(k):
        return k.source.split("(", 1)[1].split(")", 1)[0], k.source.split("\n", 3)[3]
    return sig(a) == sig(b)


#: the files of a cache entry or an --emit directory
EMIT_FILES = ("kernels.py", "kernel_ir.txt")


def write_and_load(program, directory=None):
    """Write the generated source (to the cache, or ``directory``) and import it.

    ``directory``: a path or a ``dsl.fileio.OutputDir`` (``mtc compile --emit``, ``dsl.compile(emit_dir=)``):
    it takes the files only where they replace nothing but mtc's own earlier output (MtcError naming the file
    otherwise). The cache entry is repaired when damaged (see the module docstring). The module is executed
    from the source generated now, never from bytecode or a file's other contents.

    Returns (path, module, kernels). Raises MtcError when the files cannot be written."""
    from dsl.errors import MtcError
    from dsl.fileio import OutputDir
    src, kernels = generate(program)
    files = {"kernels.py": src, "kernel_ir.txt": program.text()}
    if directory is not None:
        out = directory if isinstance(directory, OutputDir) else OutputDir(directory, "emit_dir")
        out.check(EMIT_FILES)
        for name, text in files.items():
            out.write(name, text)
        path = out.path / "kernels.py"
    else:
        d = cache_dir() / "triton" / program.cache_key()
        path = d / "kernels.py"
        try:
            _ensure_cache_entry(d, files)
        except OSError as e:
            raise MtcError(f"cannot write the generated kernels to {d} (kernel cache (set MTC_CACHE_DIR to a "
                           f"writable directory)): {e.strerror or e}") from None
    # inspect.getsource (which triton.jit reads) gets exactly the source executed here
    linecache.cache[str(path)] = (len(src), None, src.splitlines(True), str(path))
    spec = importlib.util.spec_from_file_location(f"mtc_gen_{program.cache_key()}", path)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return path, mod, kernels


def _ensure_cache_entry(d: Path, files: dict[str, str]) -> None:
    """Make the cache entry directory ``d`` hold exactly ``files`` (name -> text): a missing file is written,
    a damaged one (other bytes, not a regular file, unreadable) replaced, each atomically; one line on stderr
    names what was repaired. Raises OSError when the cache cannot be written."""
    from dsl.fileio import write_atomic
    damaged = []
    if os.path.lexists(d) and (os.path.islink(d) or not d.is_dir()):
        damaged.append("the entry is not a directory")
        os.unlink(d)
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        f = d / name
        want = text.encode("utf-8")
        why = _entry_damage(f, want)
        if why is None:
            continue
        if why != "missing":
            damaged.append(f"{name}: {why}")
            if os.path.isdir(f) and not os.path.islink(f):
                shutil.rmtree(f)
            elif os.path.islink(f):
                os.unlink(f)                   # (the atomic write would replace the file it points to)
        write_atomic(f, want)
    if damaged:
        print(f"mtc: the kernel cache entry {d} was damaged ({'; '.join(damaged)}); rebuilt it", file=sys.stderr,
              flush=True)


def _entry_damage(f: Path, want: bytes) -> str | None:
    """None when the cache file ``f`` holds exactly ``want``; else why not ("missing", or the damage)."""
    if not os.path.lexists(f):
        return "missing"
    if os.path.islink(f):
        return "a symbolic link"
    try:
        fd = os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        return f"unreadable ({e.strerror})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
        with os.fdopen(fd, "rb", closefd=False) as fh:
            got = fh.read(len(want) + 1)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    finally:
        os.close(fd)
    if got == want:
        return None
    if len(got) < len(want) and want.startswith(got):
        return f"truncated to {len(got)} of {len(want)} bytes"
    return "other contents than the generated kernels"
