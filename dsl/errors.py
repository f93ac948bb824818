"""Errors that point at the user's source.

Every error the DSL raises for bad input is an :class:`MtcError`. When it knows where in a spec file the
problem is, it carries a :class:`Loc` and renders like a compiler diagnostic::

    models/bad.mtc:12:9: error: unknown op 'kda_layr' (did you mean 'kda_layer'?)
       12 |     attn = kda_layr(heads=heads)
          |            ^
"""
from __future__ import annotations

import difflib
import os
import stat
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Loc:
    """A position in a source file: 1-based line and column.

    ``claimed``: the location was read from a text (the ``@"file":line:col`` of printed IR), not seen by mtc's
    own parser; an error shows it, but its source line only from a spec file (a regular ``.mtc`` file), never
    from whatever file the text names (see :func:`source_line`)."""

    file: str
    line: int
    col: int
    claimed: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        # (control characters a claimed file name may hold are shown escaped, so it cannot rewrite the terminal)
        name = self.file if self.file.isprintable() else "".join(
            c if c.isprintable() else repr(c)[1:-1] for c in self.file)
        return f"{name}:{self.line}:{self.col}"


#: the most bytes read from a file to find the line an error shows, and the longest such line
SOURCE_SCAN_BYTES = 16 << 20
SOURCE_LINE_BYTES = 1 << 20


def source_line(loc: Loc) -> str | None:
    """Line ``loc.line`` of the file ``loc.file`` (without its line break), for an error's excerpt; None when
    it cannot be shown: the file is not a regular file (a FIFO, ``/dev/zero``: never opened for reading
    beyond a non-blocking open), cannot be read, the line lies past :data:`SOURCE_SCAN_BYTES` or is longer than
    :data:`SOURCE_LINE_BYTES`, or ``loc`` is claimed by an IR text and the file is not a ``.mtc`` spec. Bytes
    that are not UTF-8 show as U+FFFD."""
    if not isinstance(loc.line, int) or loc.line < 1 or not loc.file:
        return None
    if loc.claimed and not loc.file.endswith(".mtc"):
        return None
    try:
        fd = os.open(loc.file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            n, seen = 1, 0                       # n: the number of the line the next read starts in
            while seen <= SOURCE_SCAN_BYTES:
                raw = f.readline(SOURCE_LINE_BYTES + 1)
                if not raw:
                    return None                  # the file has fewer lines
                seen += len(raw)
                # the line ends here: at a newline, or at the end of the file (a read shorter than asked)
                ends = raw.endswith(b"\n") or len(raw) <= SOURCE_LINE_BYTES
                if n == loc.line:
                    return raw.rstrip(b"\r\n").decode("utf-8", errors="replace") if ends else None
                n += ends
            return None
    except OSError:
        return None
    finally:
        os.close(fd)


class MtcError(Exception):
    """A user-facing error, optionally located in a spec file.

    Attributes:
        msg: the message, one paragraph.
        loc: where in the user's source, or None.
        source: the full text of that source if known (for the caret excerpt).
    """

    def __init__(self, msg: str, loc: Loc | None = None, source: str | None = None, hint: str | None = None):
        super().__init__(msg)
        self.msg = msg
        self.loc = loc
        self.source = source
        self.hint = hint

    def render(self) -> str:
        head = f"{self.loc}: error: {self.msg}" if self.loc else f"error: {self.msg}"
        lines = [head]
        line = None
        if self.loc is not None and self.source is not None:
            src_lines = self.source.splitlines()
            if 1 <= self.loc.line <= len(src_lines):
                line = src_lines[self.loc.line - 1]
        elif self.loc is not None:
            line = source_line(self.loc)     # at most that one line, from a regular file
        if line is not None:
            num = str(self.loc.line)
            # tabs expanded (to 4) in the excerpt, and the caret moved with them
            before = line[: max(self.loc.col - 1, 0)].expandtabs(4)
            shown = line.expandtabs(4)
            if len(shown) > EXCERPT_WIDTH:
                # a very long line (user trial: 40,000 characters echoed whole): a window around the column
                lo = max(0, min(len(before) - EXCERPT_WIDTH // 2, len(shown) - EXCERPT_WIDTH))
                hi = lo + EXCERPT_WIDTH
                shown = ("..." if lo else "") + shown[lo:hi] + ("..." if hi < len(shown) else "")
                before = ("..." if lo else "") + before[lo:]
            lines.append(f"  {num} | {shown}")
            lines.append(f"  {' ' * len(num)} | {' ' * len(before)}^")
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


#: the widest source excerpt an error shows (characters; a longer line is cut to a window around the column)
EXCERPT_WIDTH = 160


def did_you_mean(name: str, choices) -> str:
    """' (did you mean 'x'?)' for the closest of ``choices`` (an exact match ignoring case and surrounding
    blanks first: 'TVM' -> 'tvm'), or ''."""
    choices = list(choices)
    folded = {str(c).strip().lower(): c for c in choices}
    key = str(name).strip().lower()
    if key in folded and folded[key] != name:
        return f" (did you mean '{folded[key]}'?)"
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class MtcWarning(UserWarning):
    """Something in a spec that is legal but probably not meant (an unused block or value); ``loc`` says where."""

    def __init__(self, msg: str, loc: "Loc | None" = None):
        super().__init__(f"{loc}: warning: {msg}" if loc else f"warning: {msg}")
        self.loc = loc
