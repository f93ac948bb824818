"""The GLU feed-forward block glu_ffn (dense layers, and the MoE layers' shared experts)."""
from __future__ import annotations

from ..builder import REQUIRED, ParamSpec
from .core import register
from .layers import _lin, _x_only, layer_spec


def _glu_params(a, ts, prefix=""):
    d = ts[0].shape[-1]
    inter = a["inter"]
    return [ParamSpec(f"{prefix}gate_proj.weight", (inter, d)), ParamSpec(f"{prefix}up_proj.weight", (inter, d)),
            ParamSpec(f"{prefix}down_proj.weight", (d, inter))]


def _glu_apply(b, x, wg, wu, wd, a, loc):
    ga, up = _lin(b, x, wg, loc), _lin(b, x, wu, loc)
    if a["act"] == "situ":
        h = b.call("situ_glu", ga, up, beta_gate=a["beta_gate"], beta_up=a["beta_up"], loc=loc)
    else:
        h = b.call("mul", b.call("silu", ga, loc=loc), up, loc=loc)
    return _lin(b, h, wd, loc)


def _glu_expand(b, inputs, a, loc):
    return [_glu_apply(b, inputs[0], *inputs[1:4], a, loc)]


_ACT = {"act": "situ", "beta_gate": 4.0, "beta_up": 25.0}

register("glu_ffn", _x_only("glu_ffn"), role="layer", slot="ffn", params=_glu_params, expand=_glu_expand,
         spec=layer_spec("block dense = glu_ffn(inter=I)", "glu_ffn(inter=128)"), default_name="mlp", inputs=("x",),
         attrs={"inter": REQUIRED, **_ACT},
         doc="gated FFN: down(act(gate x) * up x); act=\"situ\" (SiTU-GLU, K3) or act=\"silu\" (SwiGLU)")


