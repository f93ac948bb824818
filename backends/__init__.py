"""mtc backends: reference (plain PyTorch), triton, tvm, and the runtime that runs a compiled graph."""
import os
from pathlib import Path


def cache_root() -> Path:
    """Root of mtc's on-disk kernel caches: ``$MTC_CACHE_DIR``, or ``~/.cache/mtc`` when it is unset or empty (an
    empty value used to put the cache in the current directory)."""
    v = os.environ.get("MTC_CACHE_DIR", "")
    return Path(v) if v.strip() else Path.home() / ".cache" / "mtc"


def interpret_setting() -> str | None:
    """The TRITON_INTERPRET setting (None if unset): the one place mtc reads it. Triton reads it at import; "1"
    runs the kernels under its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET")


def interpreting() -> bool:
    """True when Triton runs its kernels under the CPU interpreter (TRITON_INTERPRET=1)."""
    return interpret_setting() == "1"
