"""Errors that point at the user's source.

Every error the DSL raises for bad input is an :class:`MtcError`. When it knows where in a spec file the
problem is, it carries a :class:`Loc` and renders like a compiler diagnostic::

    models/bad.mtc:12:9: error: unknown op 'kda_layr' (did you mean 'kda_layer'?)
       12 |     attn = kda_layr(heads=heads)
          |            ^
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Loc:
    """A position in a source file: 1-based line and column."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


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
        text = self.source
        if text is None and self.loc is not None:
            try:
                text = Path(self.loc.file).read_text()
            except OSError:
                text = None
        if text is not None and self.loc is not None:
            src_lines = text.splitlines()
            if 1 <= self.loc.line <= len(src_lines):
                num = str(self.loc.line)
                line = src_lines[self.loc.line - 1]
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
