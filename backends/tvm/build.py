"""Building, caching, exporting and loading the TVM kernels.

    fn = get_function(kernel, "llvm")      # a callable taking torch tensors (DLPack), cached
    path = build(kernel, "cuda")           # the exported shared library on disk (no GPU needed)

Cache layout: ``$MTC_CACHE_DIR`` (default ``~/.cache/mtc``) ``/tvm/<key>/`` holds ``<name>.so`` (what
``export_library`` wrote), ``<name>.tvmscript.py`` (the kernel's TVMScript before scheduling) and
``<name>.scheduled.py`` (after) and, for cuda, ``<name>.cu`` (the generated CUDA source). The key is a SHA-256 of the TVMScript text + the schedule version + the
target (as JSON) + the TVM version: it never depends on the token count (a symbolic shape), and it can be
formed without TVM's compiler, so a machine with only TVM's runtime (TVM_USE_RUNTIME_LIB=1) loads modules
built elsewhere from the same cache directory. CUDA modules keep their CUDA source; TVM compiles it when
the module is loaded (the ``tvm_callback_cuda_compile`` hook, NVRTC).

Beside each library, ``<name>.so.sha256`` holds the SHA-256 of the bytes ``export_library`` wrote. A library
that is not a regular file or does not match it (truncated, overwritten) is a miss: it is rebuilt before
anything loads it, with one line on stderr; one that fails to load is rebuilt once (``get_function``).
Every file is written to a temporary name and renamed.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

from .kernels import SCHEDULE_VERSION, Kernel, schedule

CUDA_ARCH = "sm_90"
_LOCK = threading.Lock()
_LOADED: dict[str, object] = {}          # cache key -> loaded runtime function (per process)


def cache_dir() -> Path:
    """Root of the TVM kernel cache: ``$MTC_CACHE_DIR/tvm`` (unset or empty: ``~/.cache/mtc/tvm``)."""
    from backends import cache_root
    return cache_root() / "tvm"


def target_spec(kind: str) -> dict:
    """The dict-form TVM target for a kind: ``{"kind": "llvm"}`` or
    ``{"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}}``. Raises ValueError otherwise."""
    if kind == "llvm":
        return {"kind": "llvm"}
    if kind == "cuda":
        return {"kind": "cuda", "arch": CUDA_ARCH, "host": {"kind": "llvm"}}
    raise ValueError(f"tvm backend: target kind must be 'llvm' or 'cuda', got {kind!r}")


def _tvm_version() -> str:
    import tvm
    return tvm.__version__


def cache_key(kernel: Kernel, kind: str) -> str:
    """SHA-256 (first 24 hex digits) of the TVMScript text for ``kind`` + schedule version + schedule
    parameters + build pass config + target + TVM version."""
    h = hashlib.sha256()
    for part in (kernel.text(kind), SCHEDULE_VERSION, repr(tuple(kernel.sched)), repr(pass_config(kernel, kind)),
                 json.dumps(target_spec(kind), sort_keys=True), _tvm_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def pass_config(kernel: Kernel, kind: str) -> dict:
    """The tvm.transform.PassContext config of this kernel's build for ``kind`` (``kernel.cuda_pass_config``
    on cuda, e.g. StorageRewrite off for the attn_residual kernels: see attn_kernels.NO_STORAGE_REWRITE)."""
    return dict(kernel.cuda_pass_config) if kind == "cuda" else {}


def library_path(kernel: Kernel, kind: str) -> Path:
    """Where the exported library of this kernel and target lives in the cache."""
    return cache_dir() / cache_key(kernel, kind) / f"{kernel.name}.so"


def compile_kernel(kernel: Kernel, kind: str):
    """Schedule and ``tvm.compile`` one kernel; returns the ``tvm.runtime.Executable``."""
    import tvm
    mod = schedule(kernel, kind)
    spec = target_spec(kind)
    host = spec.pop("host", None)
    target = tvm.target.Target(spec, host=host) if host else tvm.target.Target(spec)
    with tvm.transform.PassContext(config=pass_config(kernel, kind)):
        return tvm.compile(mod, target=target), mod


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def cached_library_damage(path: Path) -> str | None:
    """Why the cached library ``path`` cannot be used as it is: "missing", or the damage (not a regular file;
    its bytes differ from the SHA-256 recorded when it was built); None when it is fine. A library without
    a recorded checksum (an older cache) counts as fine here: loading it is the check."""
    from dsl.fileio import sha256_file
    if os.path.lexists(path.parent) and (os.path.islink(path.parent) or not path.parent.is_dir()):
        return "a file where the entry's directory belongs"
    if not os.path.lexists(path):
        return "missing"
    if os.path.islink(path) or not path.is_file():
        return "not a regular file"
    try:
        want = _checksum_path(path).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return "its checksum file is unreadable"
    got = sha256_file(path)
    if got is None:
        return "unreadable"
    return None if got == want else "its bytes differ from the ones built (truncated or overwritten)"


def _note_rebuilt(path: Path, why: str) -> None:
    print(f"mtc: the TVM kernel cache entry {path} was damaged ({why}); rebuilding it", file=sys.stderr, flush=True)


def _clear(path: Path) -> None:
    """Remove whatever is at ``path`` (a damaged cache file or a directory in its place)."""
    import shutil
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def build(kernel: Kernel, kind: str, *, force: bool = False) -> Path:
    """Make sure the exported library of ``kernel`` for ``kind`` is in the cache; return its path.

    Compiles (schedule + tvm.compile + export_library) only on a cache miss (a missing or damaged library:
    see the module docstring) or with ``force``. CUDA builds need no GPU. Every file is written to a
    temporary name and renamed, so concurrent builders never see a half-written file."""
    from dsl.fileio import atomic_path, sha256_file, write_atomic
    path = library_path(kernel, kind)
    why = cached_library_damage(path)
    if why is None and not force:
        return path
    if why not in (None, "missing"):
        _note_rebuilt(path, why)
    t0 = time.perf_counter()
    ex, mod = compile_kernel(kernel, kind)
    if os.path.lexists(path.parent) and (os.path.islink(path.parent) or not path.parent.is_dir()):
        _clear(path.parent)                         # a file where the entry's directory belongs
    path.parent.mkdir(parents=True, exist_ok=True)
    for name, text in ((f"{kernel.name}.tvmscript.py", kernel.text(kind)),
                       (f"{kernel.name}.scheduled.py", mod.script()),
                       *(((f"{kernel.name}.cu", cuda_source(ex)),) if kind == "cuda" else ())):
        if os.path.isdir(path.parent / name):
            _clear(path.parent / name)
        write_atomic(path.parent / name, text)
    for p in (path, _checksum_path(path)):
        if os.path.islink(p) or os.path.isdir(p):
            _clear(p)                               # (the rename below cannot replace a directory)
    with atomic_path(path, suffix=".so") as tmp:
        ex.export_library(tmp)
        digest = sha256_file(tmp)
    write_atomic(_checksum_path(path), f"{digest}\n")
    if not os.environ.get("MTC_QUIET"):
        shape = [(k, kernel.info[k]) for k in ("d", "L", "C", "W", "E") if isinstance(kernel.info.get(k), int)]
        sched = [kv for kv in kernel.sched if kv[1] is not None]
        if kind != "cuda" and kernel.info.get("cuda_prescheduled"):     # its cuda schedule does not apply here
            sched = [("impl", f"{dict(sched).get('impl')} (cuda only; this build: the one-pass kernel)")]
        attrs = ", ".join(f"{k}={v}" for k, v in shape + sched)
        print(f"mtc: built TVM kernel {kernel.name} for {kind}{f' ({attrs})' if attrs else ''} in "
              f"{time.perf_counter() - t0:.1f} s -> {path.parent} (cached; MTC_QUIET=1 hides this)",
              file=sys.stderr, flush=True)
    return path


def cuda_source(ex) -> str:
    """The generated CUDA C source inside a cuda ``tvm.runtime.Executable`` (what NVRTC compiles at load)."""
    return ex.mod.imports[0].inspect_source()


def shared_write_hazards(src: str) -> list[str]:
    """Lines of generated CUDA that assign to a ``__shared__`` buffer outside an ``if (...)`` guard.

    TVM's all-reduce writes its shared words only under ``if (threadIdx.x == 0)`` (or a per-warp
    guard), or each thread its own word (``red_buf[threadIdx.x] = ...``); an unguarded write is every
    thread of the block storing to one shared word with no barrier, the race that made the one-pass attn_residual kernel return nan / inf on the H200 (see
    attn_kernels.NO_STORAGE_REWRITE). A lint on the text, not a proof: an empty list means this pattern is
    absent."""
    import re
    shared = set(re.findall(r"__shared__ alignas\(\d+\) \w+ (\w+)\[", src))
    out, braces, prev = [], [], ""          # braces: one flag per open "{": opened by an if (...)?
    for ln in src.splitlines():
        st = ln.strip()
        m = re.match(r"\s*(?:\(\(volatile \w+\*\))?(\w+)\)?\[[^\]]*\]\s*=[^=]", ln)
        per_thread = "threadIdx" in ln.split("=")[0]      # red_buf[threadIdx.x] = ...: a slot per thread
        if m and m.group(1) in shared and not (any(braces) or prev.startswith("if (") or per_thread):
            out.append(st)
        for ch in st:                       # a multi-value all-reduce writes several words in one if block
            if ch == "{":
                braces.append(st.startswith("if (") or st.startswith("} else"))
            elif ch == "}" and braces:
                braces.pop()
        prev = st
    return out


def export(kernel: Kernel, kind: str, file_name: str | os.PathLike) -> Path:
    """Build (or take from the cache) and copy the library to ``file_name`` for deployment; load it with
    ``load(file_name, kernel.name)`` on a machine that has only TVM's runtime."""
    import shutil
    from dsl.fileio import atomic_path
    src = build(kernel, kind)
    dst = Path(file_name)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst, suffix=".so") as tmp:       # a failed copy leaves an older export whole
        shutil.copyfile(src, tmp)
    return dst


def load(file_name: str | os.PathLike, name: str):
    """Load an exported library and return its function ``name`` (runtime only; no compiler needed)."""
    import tvm
    mod = tvm.runtime.load_module(str(file_name))
    return mod[name]


def get_function(kernel: Kernel, kind: str):
    """The callable for ``kernel`` on ``kind`` (in-process memo -> disk cache -> compile).

    Call it with torch tensors (passed through DLPack, no copy): inputs then outputs, in the order of the
    kernel's parameters. A cached library that does not load (damaged on disk) is rebuilt once.
    Raises ValueError for an unknown kind, RuntimeError when even the rebuilt library does not load;
    TVM build errors propagate."""
    key = cache_key(kernel, kind) + kind
    fn = _LOADED.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _LOADED.get(key)
        if fn is None:
            path = build(kernel, kind)
            try:
                fn = load(path, kernel.name)
            except Exception as first:        # a damaged cache file (truncated, foreign): rebuild it once
                _note_rebuilt(path, f"it does not load: {' '.join(str(first).split())[-200:]}")
                path = build(kernel, kind, force=True)
                try:
                    fn = load(path, kernel.name)
                except Exception as again:
                    raise RuntimeError(f"tvm backend: the built library {path} does not load even after a "
                                       f"rebuild ({' '.join(str(again).split())[-300:]}); delete "
                                       f"{path.parent} and retry (first error: "
                                       f"{' '.join(str(first).split())[-200:]})") from None
            _LOADED[key] = fn
    return fn


def clear_memo() -> None:
    """Forget the loaded functions of this process (the disk cache stays); used by tests."""
    _LOADED.clear()
