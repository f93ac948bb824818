"""The source nodes' attributes (input, param, buffer): checked by parse_ir and verify like an op's."""
from __future__ import annotations

import math

from ..builder import ShapeError, check_param_shape
from .core import BOOL, STRING, Kind, _is_num, attr_error, one_of

#: the initialisers a param / buffer node names (backends/runtime.py _init_ implements them)
INITS = ("normal", "expert", "ones", "zeros", "conv", "a_log", "dt_bias", "dt_bias_sigmoid")

# the source nodes' attributes (input, param, buffer): checked by parse_ir and verify like an op's
_NAME = Kind("a string", lambda v: isinstance(v, str), "a non-empty dotted name (model.layers.0.mlp.up_proj.weight)",
             lambda v: bool(v) and all(v.split(".")))
SOURCE_KINDS = {
    "input": {"name": STRING},
    "param": {"name": _NAME, "init": one_of(*INITS),
              "std": Kind("a number", _is_num, "a finite number >= 0", lambda v: 0 <= v < math.inf),
              "active": Kind("a number", _is_num, "a fraction in (0, 1]", lambda v: 0 < v <= 1),
              "pinned": BOOL},
}
SOURCE_KINDS["buffer"] = SOURCE_KINDS["param"]
SOURCE_REQUIRED = {"input": ("name",), "param": ("name", "init"), "buffer": ("name", "init")}


def check_source(op: str, attrs: dict, types: tuple, ignore=()) -> None:
    """Check an input / param / buffer node: its attributes (known, of the right kind, the required ones set), one
    type, and for parameters and buffers a shape of integers >= 1 within the size limits
    (builder.check_param_shape). ``ignore``: annotation keys a pass may add. Raises ShapeError."""
    kinds = SOURCE_KINDS[op]
    for k, v in attrs.items():
        if k in ignore:
            continue
        if k not in kinds:
            from ..errors import did_you_mean
            raise ShapeError(f"{op} has no attribute '{k}'{did_you_mean(k, kinds)}; it takes: {', '.join(kinds)}")
        bad = attr_error(k, kinds[k], v)
        if bad:
            raise ShapeError(bad)
    for k in SOURCE_REQUIRED[op]:
        if k not in attrs:
            what = "its input name" if op == "input" else ("its state-dict name" if k == "name" else "its initialiser")
            raise ShapeError(f"{op} needs the attribute '{k}' ({what})")
    if len(types) != 1 or types[0] is None:
        raise ShapeError(f"{op} needs one type (e.g. ': f32[B, T, 64]')")
    if op != "input":
        check_param_shape(types[0].shape)
    else:
        for d in types[0].shape:
            if d.is_number and not (d.is_integer and int(d) >= 1):
                raise ShapeError(f"input shape {types[0]} has a dimension {d}; dimensions are integers >= 1 "
                                 f"or shape expressions")
