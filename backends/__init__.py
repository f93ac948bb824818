"""mtc backends: reference (plain PyTorch), triton, tvm, and the runtime that runs a compiled graph."""
import os
from pathlib import Path


def cache_root() -> Path:
    """Root of mtc's on-disk kernel caches: ``$MTC_CACHE_DIR``, or ``~/.cache/mtc`` when it is unset or empty (an
    empty value used to put the cache in the current directory)."""
    v = os.environ.get("MTC_CACHE_DIR", "")
    return Path(v) if v.strip() else Path.home() / ".cache" / "mtc"
