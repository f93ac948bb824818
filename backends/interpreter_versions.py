"""Which triton and numpy versions triton's CPU interpreter (TRITON_INTERPRET=1) runs mtc's kernels with.

The kernels run on triton 3.6 (the GPU machine's and CI's) through 3.9 (pyproject.toml allows no other). On
the CPU, triton before 3.7 converts a one-element array to a Python int where a kernel loops to a bound it
loaded from memory (``for j in range(0, nch)``); numpy 2.4 refuses that conversion, so such a kernel stops with
a TypeError deep inside the interpreter (numpy 2.0 to 2.3 still run). This module says so up front instead.
"""
from __future__ import annotations

import re

from dsl.errors import MtcError


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '3.6.0', '2.4.6' or '3.7.0+git1a2b'; (0, 0) if unreadable."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """None when triton's CPU interpreter runs the kernels with these versions of triton and numpy, else one
    line saying why not and what to install."""
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (f"triton {triton_version}'s CPU interpreter (TRITON_INTERPRET=1) cannot run with numpy "
                f"{numpy_version}: it needs numpy < 2.4 (pip install \"numpy<2\", as CI pins with triton 3.6), "
                f"or a newer triton (pip install \"triton>=3.7,<3.10\")")
    return None


def check_interpreter_versions() -> None:
    """MtcError (one line) when the installed triton and numpy cannot run the kernels under the interpreter."""
    import numpy
    import triton
    msg = interpreter_problem(triton.__version__, numpy.__version__)
    if msg is not None:
        raise MtcError(msg)
