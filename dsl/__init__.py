"""mtc's DSL: parse .mtc architecture specs into the graph IR, and compile graphs to torch modules.

    import dsl
    g = dsl.load("models/kimi_k3.mtc", variant="tiny")
    m = dsl.compile(g, target="reference")
    logits = m(input_ids)            # [B, T] int64 -> [B, T, vocab]
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import Loc, MtcError
from .ir import Graph, Node, Ref, TensorType
from .builder import GraphBuilder
from .printer import print_graph
from .ir_parser import parse_ir

__all__ = ["parse", "load", "compile", "from_hf", "Graph", "Node", "Ref", "TensorType", "GraphBuilder", "MtcError",
           "Loc", "print_graph", "parse_ir"]


def parse(text: str, variant: str | None = None, *, file: str = "<spec>", **overrides) -> Graph:
    """Parse .mtc spec text into a graph (the 'graph' stage: layer-level ops, typed).

    Args:
        text: the spec source.
        variant: a named variant of the model (e.g. "tiny"), or None for the base config.
        file: the name used in error locations.
        **overrides: config values to set after the variant (e.g. n_layers=4).
    Raises:
        MtcError: syntax, name, type or shape errors, located at file:line:col.
        TypeError: text is not a str (bytes: decode them first; a path: dsl.load).
    """
    if not isinstance(text, str):
        hint = (" (bytes: text.decode('utf-8'))" if isinstance(text, (bytes, bytearray)) else
                " (a file's path: dsl.load(path))" if isinstance(text, os.PathLike) else "")
        raise TypeError(f"dsl.parse takes a spec's text (str), got {type(text).__name__}{hint}")
    from .spec import build_graph, parse_spec
    return build_graph(parse_spec(text, file), variant, **overrides)


def load(path: str | Path, variant: str | None = None, **overrides) -> Graph:
    """Read and parse a .mtc file (see :func:`parse`).

    Raises:
        TypeError: path is not a str or os.PathLike.
        MtcError: the file cannot be read, is not a regular file (a directory, /dev/zero), is over
            ``dsl.spec.MAX_SPEC_BYTES`` (16 MiB) or is not UTF-8 text; or see :func:`parse`.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"dsl.load takes the path of a .mtc file (str or os.PathLike), got {type(path).__name__}"
                        + (" (a spec's text: dsl.parse(text))" if isinstance(path, bytes) else ""))
    if not os.fspath(path):
        raise MtcError("cannot read spec '': the path is empty")
    from .spec import read_spec_file
    return parse(read_spec_file(path), variant, file=str(path), **overrides)


def compile(graph: Graph, target: str = "reference", **options):
    """Compile a graph into a runnable ``torch.nn.Module`` (see :func:`backends.runtime.compile_graph`)."""
    from backends.runtime import compile_graph
    if not isinstance(graph, Graph):
        hint = (f" (a path: dsl.compile(dsl.load({str(graph)!r}), ...))"
                if isinstance(graph, (str, os.PathLike)) else "")
        raise TypeError(f"dsl.compile takes a Graph (from dsl.load, dsl.parse or dsl.parse_ir), got "
                        f"{type(graph).__name__}{hint}")
    import inspect
    known = [n for n, prm in inspect.signature(compile_graph).parameters.items() if prm.kind == prm.KEYWORD_ONLY]
    bad = sorted(set(options) - set(known))
    if bad:
        from dsl.errors import did_you_mean
        raise MtcError(f"dsl.compile: unknown option{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}"
                       f"{did_you_mean(bad[0], known)}; options: target, {', '.join(known)}")
    return compile_graph(graph, target=target, **options)


def from_hf(path, target: str = "reference", **options):
    """Build the model of a Hugging Face checkpoint directory (Kimi Linear or Kimi K3: config.json + safetensors,
    sharded or not, MXFP4 experts decoded, or kept packed with dequantize=False) and load its weights; see
    :func:`dsl.checkpoint.from_hf`."""
    from .checkpoint import from_hf as _from_hf
    return _from_hf(path, target, **options)
