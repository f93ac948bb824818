"""Writing the files mtc produces without ever losing or overwriting a user's data.

* :func:`write_atomic` / :func:`atomic_path`: every file mtc writes (``mtc ir -o``, ``mtc run --json``,
  ``--emit``, ``--dump-ir``, the kernel caches) goes to a temporary file beside its destination and is renamed
  over it only once complete, so a failed write (a full disk, an interrupt) leaves the old file as it was
  and no temporary file behind.
* :class:`OutputDir`: a directory that mtc writes generated files into (``--emit DIR``, ``--dump-ir DIR``). It
  keeps a small manifest (:data:`MANIFEST`) of the files it wrote and their SHA-256; a file mtc is about to
  write may replace only a file it wrote there itself and that nobody changed since. Anything else under
  that name (a user's own ``kernels.py``, the input spec) is refused with an :class:`MtcError` before any
  file is written.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from .errors import MtcError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """A temporary file name beside ``path`` to write; on a normal exit its contents (flushed to disk) replace
    ``path`` in one rename, on an exception it is removed and ``path`` is untouched.

    For writers that take a file name (``export_library``). ``suffix`` ends the temporary name (some writers
    pick the format by it). A destination that is a symlink is followed (the file it names is replaced); an
    existing destination keeps its permission bits, a new one gets the usual ``0o666 & ~umask``.
    Raises OSError (e.g. ENOSPC, EACCES); the destination's folder must exist."""
    dst = Path(os.path.realpath(path))
    try:
        mode = stat.S_IMODE(os.stat(dst).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=suffix, dir=dst.parent)
    try:
        os.close(fd)
        yield tmp
        with open(tmp, "rb+") as f:        # the writer may have closed it: make its data durable before the rename
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (str: as UTF-8) to ``path`` atomically (see :func:`atomic_path`).

    A destination that exists and is not a regular file (``/dev/null``, ``/dev/stdout``, a FIFO) cannot be
    replaced and holds no file to lose: it is written in place. Raises OSError; nothing is left behind."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        with open(path, "wb") as f:
            f.write(raw)
        return
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(raw)


def sha256_file(path: str | os.PathLike, limit: int | None = None) -> str | None:
    """SHA-256 (hex) of a regular file's bytes, or None when it is not a regular file, cannot be read or is
    larger than ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (limit is not None and st.st_size > limit):
            return None
        h = hashlib.sha256()
        with os.fdopen(fd, "rb", closefd=False) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None
    finally:
        os.close(fd)


#: the manifest an :class:`OutputDir` keeps of the files mtc wrote into it
MANIFEST = ".mtc-outputs.json"
_MANIFEST_MAX_BYTES = 1 << 20


class OutputDir:
    """A directory mtc writes generated files into (``--emit DIR``, ``--dump-ir DIR``), created if missing.

    A name may be written when no file of that name exists, or when the file there is one mtc wrote into this
    directory earlier (listed in its :data:`MANIFEST` with the SHA-256 it had) and unchanged since; never
    over one of ``protect`` (e.g. the input spec). Other files in the directory are left alone.

    Args:
        path: the directory.
        flag: how the user named it, for messages (``"--emit"``, ``"--dump-ir"``, ``"dump_dir"``).
        protect: files that must never be written (compared by identity, so any spelling of the path).
    Raises (from :meth:`check` / :meth:`write`): MtcError naming the first conflicting file and what to do,
    or the write error.
    """

    def __init__(self, path: str | os.PathLike, flag: str, protect: Iterable[str | os.PathLike | None] = ()):
        self.path = Path(path)
        self.flag = flag
        self.protect = [p for p in protect if p is not None]
        self.written: list[Path] = []

    def _manifest(self) -> dict[str, list[str]] | None:
        """name -> the SHA-256s the file mtc wrote there may have (one; two while a write is under way, so that
        an interrupted write leaves a file mtc still recognises); {} when there is no manifest, None when a file
        of its name is there but is not an mtc manifest."""
        m = self.path / MANIFEST
        if not os.path.lexists(m):
            return {}
        try:
            fd = os.open(m, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(_MANIFEST_MAX_BYTES + 1)
            data = json.loads(raw.decode("utf-8")) if len(raw) <= _MANIFEST_MAX_BYTES else None
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        files = data.get("files") if isinstance(data, dict) and data.get("written_by") == "mtc" else None
        if not isinstance(files, dict):
            return None
        out = {}
        for k, v in files.items():
            v = [v] if isinstance(v, str) else v
            if isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v):
                out[k] = v
        return out

    def _save(self, manifest: dict[str, list[str]]) -> None:
        files = {k: v[0] if len(v) == 1 else v for k, v in sorted(manifest.items())}
        write_atomic(self.path / MANIFEST, json.dumps({"written_by": "mtc", "files": files}, indent=1) + "\n")

    def check(self, names: Iterable[str]) -> None:
        """Before any work: MtcError unless every file of ``names`` may be written (see the class)."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise MtcError(f"{self.flag} '{p}' exists and is not a directory; give a directory (created if "
                           f"missing)")
        if not p.is_dir():
            return
        manifest = self._manifest()
        if manifest is None:
            raise MtcError(f"{self.flag} '{p}': '{p / MANIFEST}' exists and is not mtc's list of the files it wrote "
                           f"there; mtc does not overwrite it: pick an empty or new directory")
        for name in names:
            f = p / name
            for q in self.protect:
                if _same_file(f, q):
                    raise MtcError(f"{self.flag} '{p}': writing {name} would overwrite the input '{q}'; pick an "
                                   f"empty or new directory")
            if not os.path.lexists(f):
                continue
            if name not in manifest:
                raise MtcError(f"{self.flag} '{p}': '{f}' exists and was not written there by mtc; mtc does not "
                               f"overwrite it: pick an empty or new directory (or move the file away)")
            if os.path.islink(f) or sha256_file(f) not in manifest[name]:
                raise MtcError(f"{self.flag} '{p}': '{f}' was changed since mtc wrote it; mtc does not overwrite "
                               f"it: pick an empty or new directory (or move the file away)")

    def write(self, name: str, data: str | bytes) -> Path:
        """Write ``name`` atomically (after :meth:`check` of it) and record it in the manifest; returns its
        path. MtcError for a refused name or a failed write (nothing lost, nothing left behind)."""
        self.check([name])
        f = self.path / name
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            manifest = self._manifest() or {}
            new = hashlib.sha256(raw).hexdigest()
            old = sha256_file(f) if os.path.lexists(f) else None      # (checked above: mtc's own, unchanged)
            # recorded before the write, so that a run cut short leaves a file the manifest still names
            if manifest.get(name) != [new]:
                manifest[name] = [new] if old in (None, new) else [old, new]
                self._save(manifest)
            write_atomic(f, raw)
            if manifest[name] != [new]:
                manifest[name] = [new]
                self._save(manifest)
        except OSError as e:
            raise MtcError(f"cannot write {self.flag} '{f}': {e.strerror or e}") from None
        self.written.append(f)
        return f


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
