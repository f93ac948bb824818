"""The Hugging Face checkpoint families mtc reads and writes, each declared once: how its ``config.json`` maps to
an mtc spec (the same graph ``models/<family>.mtc`` gives for those values), and how its tensor names and layouts
map to mtc's state dict.

* ``kimi_linear``: Kimi Linear (arXiv 2510.26692; ``moonshotai/Kimi-Linear-48B-A3B-Instruct``), as transformers'
  ``KimiLinearForCausalLM`` reads and writes it (``transformers/models/kimi_linear``, whose
  ``save_pretrained`` writes the release's layout: per-expert ``experts.{j}.w1/w2/w3``, ``q/k/v_conv1d``,
  ``A_log`` [1, 1, H, 1]). Spec: ``models/kimi_linear_48b.mtc``.
* ``kimi_k3``: Kimi K3 (arXiv 2607.24653), the text model of the release as independent ports read it (no public
  modeling code runs here): the config nested as ``text_config``, tensors under ``language_model.``, Block
  AttnRes weights ``self_attention_res_{proj,norm}`` / ``mlp_res_{proj,norm}`` per layer and
  ``output_attn_res_{proj,norm}`` at the end (the proj as [1, d]), ``A_log`` zero-padded to the head dim,
  Stable LatentMoE ``routed_expert_{down_proj,norm,up_proj}``, routed experts in MXFP4 (compressed-tensors
  ``mxfp4-pack-quantized``). Spec: ``models/kimi_k3.mtc``.

Both: MLA without q-LoRA is ``q_proj``; the router's ``gate.e_score_correction_bias`` is mtc's Quantile Balancing
bias (the same buffer name); MLA's latent RMSNorms use eps 1e-6 (the modeling code's RMSNorm default), every other
norm the config's ``rms_norm_eps``.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import MtcError

# ---------------------------------------------------------------------------------------------------------------
# names and layouts


@dataclass(frozen=True)
class Rule:
    """One mtc state-dict name (a template: ``{i}`` a layer index) and its checkpoint name (``{i}``; ``{j}`` the
    expert for layout "experts"), before the family's prefix.

    layout (mtc shape <-> checkpoint shape):
      "same": identical; "row": [d] <-> [1, d]; "a_log": [H] <-> [1, 1, H, 1];
      "a_log_padded": [H] <-> [max(H, head_dim)], zeros after H; "experts": [E, a, b] <-> E tensors [a, b].
    """

    mtc: str
    hf: str
    layout: str = "same"

    def match(self, key: str) -> dict | None:
        m = _template_re(self.mtc).fullmatch(key)
        return m.groupdict() if m else None


def _template_re(t: str) -> re.Pattern:
    return re.compile(re.escape(t).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)"))


_EXPERTS = tuple(Rule(f"model.layers.{{i}}.block_sparse_moe.experts.{w}",
                      f"model.layers.{{i}}.block_sparse_moe.experts.{{j}}.{w}.weight", "experts")
                 for w in ("w1", "w2", "w3"))


@dataclass(frozen=True)
class Family:
    """A checkpoint family: its name/layout rules (names no rule matches are the same in both), the checkpoint
    names to also accept on load (``aliases``: (template, alternative), tried when the first is absent), the
    checkpoint tensors mtc does not model and skips (``skip``: (regex, why))."""

    name: str
    rules: tuple[Rule, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    skip: tuple[tuple[str, str], ...] = ()
    spec_file: str = ""

    def rule(self, key: str) -> tuple[Rule | None, dict]:
        for r in self.rules:
            g = r.match(key)
            if g is not None:
                return r, g
        return None, {}


KIMI_LINEAR = Family(
    "kimi_linear",
    rules=(Rule("model.layers.{i}.self_attn.A_log", "model.layers.{i}.self_attn.A_log", "a_log"), *_EXPERTS),
    # transformers 5's save_pretrained renames every `.mlp.` back to `.block_sparse_moe.` (its conversion of the
    # MoE names reversed), the dense layer's too; the release names it `.mlp.`
    aliases=(("model.layers.{i}.mlp.", "model.layers.{i}.block_sparse_moe."),),
    skip=((r".*\.rotary_emb\.inv_freq", "a rotary table (Kimi Linear uses no position embedding)"),),
    spec_file="models/kimi_linear_48b.mtc")

KIMI_K3 = Family(
    "kimi_k3",
    rules=(Rule("model.layers.{i}.self_attn.A_log", "model.layers.{i}.self_attn.A_log", "a_log_padded"),
           Rule("model.layers.{i}.self_attention_res.proj_weight", "model.layers.{i}.self_attention_res_proj.weight",
                "row"),
           Rule("model.layers.{i}.self_attention_res.norm_weight", "model.layers.{i}.self_attention_res_norm.weight"),
           Rule("model.layers.{i}.mlp_res.proj_weight", "model.layers.{i}.mlp_res_proj.weight", "row"),
           Rule("model.layers.{i}.mlp_res.norm_weight", "model.layers.{i}.mlp_res_norm.weight"),
           Rule("model.final_attn_res.proj_weight", "model.output_attn_res_proj.weight", "row"),
           Rule("model.final_attn_res.norm_weight", "model.output_attn_res_norm.weight"),
           *_EXPERTS),
    skip=((r"vision_tower\..*", "the vision encoder (mtc builds the text model)"),
          (r"mm_projector\..*", "the vision projector (mtc builds the text model)"),
          (r".*\.rotary_emb\.inv_freq", "a rotary table (K3 uses no position embedding)")),
    spec_file="models/kimi_k3.mtc")

FAMILIES = {f.name: f for f in (KIMI_LINEAR, KIMI_K3)}

#: state-dict entries of a compiled module that are mtc's own state, not checkpoint tensors
MTC_STATE = ("balance_updates",)

# ---------------------------------------------------------------------------------------------------------------
# the model description both directions go through: config.json <-> Desc <-> spec text; graph -> Desc


@dataclass
class Desc:
    """A model of one family in the spec's terms (the config block's names)."""

    family: str
    values: dict[str, Any]                 # the config block, in order
    mla_layers: tuple[int, ...]            # 1-based
    first_dense: int
    gate: str = "softplus"                 # KDA decay gate
    full_rank_gate: bool = False           # KDA output gate g_proj (else g_a_proj / g_b_proj)
    mla_gated: bool = False
    prefix: str = ""                       # checkpoint name prefix
    passthrough: dict = field(default_factory=dict)   # config fields with no effect on the forward, kept on save


_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "bf16": "bf16", "f32": "f32", "f16": "f16",
           "float": "f32", "half": "f16"}
_HF_DTYPES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16"}

#: fields that do not change the logits: read and ignored (the others are read, or refused when unknown)
_PASSTHROUGH = ("architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                "use_cache", "transformers_version", "_name_or_path", "rope_theta", "output_router_logits",
                "pretraining_tp", "head_dim", "qk_head_dim", "use_grouped_topk", "generation_config",
                "tokenizer_class", "dtype", "torch_dtype", "model_type", "ignore_index",
                "media_placeholder_token_id", "vision_config", "text_config", "quantization_config")
#: of those, the ones save_hf writes back when the model came from a checkpoint (token ids, remote-code map, ...)
_KEEP = ("auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
         "rope_theta", "tokenizer_class", "generation_config", "use_grouped_topk")

_MISSING = object()


class _Fields:
    """Reads a config dict, recording which fields were read (to refuse the ones mtc does not know)."""

    def __init__(self, cfg: dict, where: str):
        if not isinstance(cfg, dict):
            raise MtcError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
        self.cfg, self.where, self.used = cfg, where, set()

    def get(self, *names, default=_MISSING, kind: str = "int", lo: float | None = None):
        """The value of the first of ``names`` present (aliases; they must agree), checked against ``kind``
        ("int", "float", "bool", "str", "ints", "any"); ``default`` when none is present (absent: an error)."""
        self.used.update(names)
        found = [(n, self.cfg[n]) for n in names if n in self.cfg]
        if not found:
            if default is _MISSING:
                raise MtcError(f"{self.where}: field '{names[0]}' is missing")
            return default
        if len({json.dumps(v, sort_keys=True) for _, v in found}) > 1:
            raise MtcError(f"{self.where}: fields {' and '.join(repr(n) for n, _ in found)} name the same setting "
                           f"and disagree: " + ", ".join(f"{n} = {v!r}" for n, v in found))
        n, v = found[0]
        ok = {"int": lambda x: isinstance(x, int) and not isinstance(x, bool),
              "float": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x),
              "bool": lambda x: isinstance(x, bool), "str": lambda x: isinstance(x, str),
              "ints": lambda x: isinstance(x, list) and all(isinstance(e, int) and not isinstance(e, bool)
                                                            for e in x),
              "any": lambda x: True}[kind](v)
        if not ok and not (v is None and default is None):
            raise MtcError(f"{self.where}: field '{n}' = {v!r} must be {_KIND_WORDS[kind]}")
        if lo is not None and v is not None and v < lo:
            raise MtcError(f"{self.where}: field '{n}' = {v!r} must be >= {lo}")
        return v

    def expect(self, name: str, allowed: tuple, why: str, default=_MISSING):
        """A field whose value mtc does not model beyond ``allowed`` (absent: fine when ``default`` is allowed)."""
        self.used.add(name)
        v = self.cfg.get(name, default)
        if v is _MISSING:
            return None
        if v not in allowed:
            raise MtcError(f"{self.where}: field '{name}' = {v!r} is not supported: {why}")
        return v

    def unknown(self) -> list[str]:
        return [k for k in self.cfg if k not in self.used and k not in _PASSTHROUGH]


_KIND_WORDS = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string",
               "ints": "a list of integers", "any": "set"}


def detect(cfg: dict, where: str) -> str:
    """The family of a config.json: "kimi_k3" (a ``text_config`` of model_type kimi_linear with K3's AttnRes or
    latent MoE fields, or model_type kimi_k3) or "kimi_linear"; MtcError otherwise."""
    if not isinstance(cfg, dict):
        raise MtcError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    mt = cfg.get("model_type")
    if str(mt).startswith("kimi_k3") or "attn_res_block_size" in text or "routed_expert_hidden_size" in text:
        return "kimi_k3"
    if mt == "kimi_linear" and "text_config" not in cfg:
        return "kimi_linear"
    raise MtcError(f"{where}: model_type {mt!r} is not a checkpoint family mtc reads (kimi_linear: Kimi Linear, "
                   f"KimiLinearForCausalLM; kimi_k3: Kimi K3's text model)")


def _layer_pattern(f: _Fields, lac: _Fields | None, n: int, where: str) -> tuple[int, ...]:
    """1-based MLA layers from ``layer_types`` (0-based list) or linear_attn_config's kda_layers /
    full_attn_layers (1-based); both present: they must agree."""
    got = []
    lt = f.get("layer_types", default=None, kind="any")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != n or any(t not in ("linear_attention", "full_attention")
                                                             for t in lt):
            raise MtcError(f"{where}: field 'layer_types' must list {n} entries, each 'linear_attention' (KDA) or "
                           f"'full_attention' (MLA), got {lt!r}")
        got.append(("layer_types", tuple(i + 1 for i, t in enumerate(lt) if t == "full_attention")))
    if lac is not None and ("full_attn_layers" in lac.cfg or "kda_layers" in lac.cfg):
        full = lac.get("full_attn_layers", kind="ints")
        kda = lac.get("kda_layers", kind="ints")
        if sorted(full + kda) != list(range(1, n + 1)):
            raise MtcError(f"{where}: linear_attn_config's full_attn_layers {full} and kda_layers {kda} must each "
                           f"name 1-based layers and together cover 1..{n} once")
        got.append(("linear_attn_config", tuple(sorted(full))))
    if not got:
        raise MtcError(f"{where}: no layer pattern: give 'layer_types' or linear_attn_config's full_attn_layers "
                       f"and kda_layers")
    if len({g for _, g in got}) > 1:
        raise MtcError(f"{where}: layer_types and linear_attn_config disagree on the MLA layers: "
                       + ", ".join(f"{k}: {list(v)}" for k, v in got))
    return got[0][1]


def _dense_prefix(f: _Fields, n: int, where: str) -> int:
    """How many leading layers are dense (the rest MoE): from mlp_layer_types or first_k_dense_replace."""
    got = []
    mt = f.get("mlp_layer_types", default=None, kind="any")
    if mt is not None:
        if not isinstance(mt, list) or len(mt) != n or any(t not in ("dense", "sparse") for t in mt):
            raise MtcError(f"{where}: field 'mlp_layer_types' must list {n} entries, each 'dense' or 'sparse', "
                           f"got {mt!r}")
        k = mt.count("dense")
        if mt != ["dense"] * k + ["sparse"] * (n - k):
            raise MtcError(f"{where}: mlp_layer_types {mt} is not supported: mtc's specs make the first layers "
                           f"dense and the rest MoE")
        got.append(("mlp_layer_types", k))
    fk = f.get("first_k_dense_replace", default=None, lo=0)
    if fk is not None:
        got.append(("first_k_dense_replace", min(fk, n)))
    f.expect("moe_layer_freq", (1, None), "every layer after the dense ones is MoE in mtc's specs", default=None)
    if not got:
        raise MtcError(f"{where}: no dense/MoE pattern: give 'mlp_layer_types' or 'first_k_dense_replace'")
    if len({k for _, k in got}) > 1:
        raise MtcError(f"{where}: mlp_layer_types and first_k_dense_replace disagree: "
                       + ", ".join(f"{k}: {v}" for k, v in got))
    return got[0][1]


def parse_config(cfg: dict, where: str, strict: bool = True) -> tuple[Desc, list[str]]:
    """(Desc, the fields mtc ignored) of a config.json. MtcError naming the field for a missing one, a wrong type, a
    value mtc does not model, or (strict) a field it does not know."""
    family = detect(cfg, where)
    k3 = family == "kimi_k3"
    top = _Fields(cfg, where)
    if k3 and "text_config" in cfg:
        text_where = f"{where} (text_config)"
        t = _Fields(cfg["text_config"], text_where)
        if not isinstance(cfg["text_config"], dict):
            raise MtcError(f"{text_where}: must be a JSON object")
        prefix = "language_model."
    else:
        t, text_where, prefix = top, where, ""
    quant = cfg.get("quantization_config", t.cfg.get("quantization_config"))
    expert_dtype = _quantization(quant, where) if quant is not None else ""
    lac_raw = t.get("linear_attn_config", default=None, kind="any")
    lac = _Fields(lac_raw, f"{text_where} (linear_attn_config)") if lac_raw is not None else None
    n = t.get("num_hidden_layers", lo=1)

    def lin(key, alias, default=_MISSING, kind="int"):
        if lac is not None and key in lac.cfg:
            v = lac.get(key, kind=kind)
            if alias and alias in t.cfg and t.cfg[alias] != v:
                raise MtcError(f"{text_where}: linear_attn_config.{key} = {v!r} and {alias} = {t.cfg[alias]!r} "
                               f"disagree")
            t.used.add(alias)
            return v
        return t.get(alias, default=default, kind=kind) if alias else default

    mla = _layer_pattern(t, lac, n, text_where)
    first_dense = _dense_prefix(t, n, text_where)
    head_dim = lin("head_dim", "linear_head_dim")
    v: dict[str, Any] = {}
    v["dtype"] = _DTYPES.get(str(t.cfg.get("dtype", t.cfg.get("torch_dtype", cfg.get("torch_dtype", "bfloat16")))),
                             "bf16")
    if k3:
        v["expert_dtype"] = expert_dtype
    elif expert_dtype:
        raise MtcError(f"{where}: quantization_config: MXFP4 experts are read for the kimi_k3 family only")
    v["vocab"] = t.get("vocab_size", lo=1)
    v["d"] = t.get("hidden_size", lo=1)
    v["n_layers"] = n
    v["first_dense"] = first_dense
    every = _every(mla, n)
    if every:
        v["mla_every"] = every
    if k3:
        v["block_size"] = t.get("attn_res_block_size", lo=1)
    v["max_seq_len"] = t.get("model_max_length", "max_position_embeddings", default=1048576, lo=1)
    v["norm_eps"] = float(t.get("rms_norm_eps", kind="float"))
    if not v["norm_eps"] > 0:
        raise MtcError(f"{text_where}: field 'rms_norm_eps' = {v['norm_eps']!r} must be > 0")
    v["latent_norm_eps"] = 1e-6
    v["kda_heads"] = lin("num_heads", "linear_num_heads")
    v["head_dim"] = head_dim
    v["conv_size"] = lin("short_conv_kernel_size", "linear_conv_kernel_dim", default=4)
    if not k3:
        # K3's settings; transformers' Kimi Linear has none of them (it would ignore them and compute another model)
        for key, sub in (("gate_lower_bound", lac), ("use_full_rank_gate", lac), ("mla_use_output_gate", t)):
            if sub is not None and key in sub.cfg:
                raise MtcError(f"{sub.where}: field '{key}' is not supported for Kimi Linear (KimiLinearForCausalLM "
                               f"has no such setting; K3's checkpoints nest their config as text_config)")
    bound = lin("gate_lower_bound", None, default=None, kind="float")
    gate = "softplus" if bound is None else "sigmoid"
    if bound is not None:
        if not bound < 0:
            raise MtcError(f"{text_where}: linear_attn_config.gate_lower_bound = {bound!r} must be negative")
        v["lower_bound"] = float(bound)
    full_rank = bool(lin("use_full_rank_gate", None, default=False, kind="bool"))
    if k3:
        v["forget_rank"] = head_dim
    v["mla_heads"] = t.get("num_attention_heads", lo=1)
    kvh = t.get("num_key_value_heads", default=None)
    if kvh not in (None, v["mla_heads"]):
        raise MtcError(f"{text_where}: field 'num_key_value_heads' = {kvh} is not supported: MLA has one latent KV "
                       f"expanded to every head (num_key_value_heads = num_attention_heads = {v['mla_heads']})")
    q_lora = t.get("q_lora_rank", default=None, lo=1)
    v["q_lora_rank"] = q_lora or 0
    v["kv_lora_rank"] = t.get("kv_lora_rank", lo=1)
    v["qk_nope_dim"] = t.get("qk_nope_head_dim", lo=0)
    v["qk_rope_dim"] = t.get("qk_rope_head_dim", lo=0)
    v["v_dim"] = t.get("v_head_dim", lo=1)
    mla_gated = bool(t.get("mla_use_output_gate", default=False, kind="bool"))
    v["dense_inter"] = t.get("intermediate_size", lo=1)
    v["experts"] = t.get("num_experts", "num_local_experts", lo=1)
    v["top_k"] = t.get("num_experts_per_token", "num_experts_per_tok", lo=1)
    v["shared"] = t.get("num_shared_experts", "n_shared_experts", default=0, lo=0)
    v["moe_inter"] = t.get("moe_intermediate_size", lo=1)
    if k3:
        v["latent"] = t.get("routed_expert_hidden_size", lo=1)
    v["routed_scaling"] = float(t.get("routed_scaling_factor", default=1.0, kind="float"))
    if k3:
        v["beta_gate"] = float(t.get("activation_situ_beta", kind="float"))
        v["beta_up"] = float(t.get("activation_situ_linear_beta", kind="float"))
    # settings mtc computes one way only
    t.expect("hidden_act", ("situ",) if k3 else ("silu",), "the FFN activation of this family's spec is "
             + ("SiTU-GLU (situ)" if k3 else "SwiGLU (silu)"), default=None if not k3 else "situ")
    if k3:
        t.expect("latent_moe_use_norm", (True,), "Stable LatentMoE norms the routed sum (routed_expert_norm)",
                 default=True)
    t.expect("moe_router_activation_func", ("sigmoid",), "the router is a sigmoid router", default="sigmoid")
    for name in ("moe_renormalize", "norm_topk_prob"):
        t.expect(name, (True,), "the selected scores are renormalised (spec/OPS.md qb_route)", default=True)
    for name in ("num_expert_group", "n_group", "topk_group"):
        t.expect(name, (1, None), "no grouped top-k (one expert group)", default=None)
    t.expect("tie_word_embeddings", (False,), "the embedding and the LM head are separate weights", default=False)
    t.expect("attention_bias", (False,), "the projections have no bias", default=False)
    t.expect("mla_use_nope", (True,), "MLA applies no rotary embedding (NoPE)", default=True)
    t.expect("rope_scaling", (None,), "MLA applies no rotary embedding (NoPE)", default=None)
    t.expect("num_nextn_predict_layers", (0, None), "mtc builds no multi-token-prediction layers", default=None)
    t.expect("attention_dropout", (0, 0.0, None), "no attention dropout", default=None)
    unknown = t.unknown() + (lac.unknown() if lac is not None else [])
    if t is not top:
        unknown += [k for k in top.unknown() if k not in ("text_config",)]
    if unknown and strict:
        raise MtcError(f"{where}: config field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                       f"{'are' if len(unknown) > 1 else 'is'} not supported by mtc's {family} reader (strict=False "
                       f"ignores unknown fields and lists them)")
    passthrough = {k: cfg[k] for k in cfg if k not in ("text_config", "quantization_config")}
    if t is not top:
        passthrough = {"top": passthrough, "text": dict(t.cfg)}
    return Desc(family, v, mla, first_dense, gate, full_rank, mla_gated, prefix, passthrough), unknown


def _every(mla: tuple[int, ...], n: int) -> int:
    """m such that the MLA layers are those with i % m == 0 or i == n (the specs' pattern), else 0."""
    for m in range(1, n + 1):
        if tuple(i for i in range(1, n + 1) if i % m == 0 or i == n) == tuple(mla):
            return m
    return 0


def _quantization(q, where: str) -> str:
    """"mxfp4" for compressed-tensors' mxfp4-pack-quantized (4-bit float weights, groups of 32); MtcError for
    another quantization."""
    w = f"{where} (quantization_config)"
    if not isinstance(q, dict):
        raise MtcError(f"{w}: must be a JSON object")
    if q.get("quant_method") != "compressed-tensors":
        raise MtcError(f"{w}: quant_method {q.get('quant_method')!r} is not supported (compressed-tensors "
                       f"mxfp4-pack-quantized is)")
    groups = q.get("config_groups") or {}
    formats = {q.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    formats.discard(None)
    if formats != {"mxfp4-pack-quantized"}:
        raise MtcError(f"{w}: format {sorted(formats)} is not supported (mxfp4-pack-quantized is)")
    for name, g in groups.items():
        wt = (g or {}).get("weights") or {}
        if wt.get("num_bits", 4) != 4 or wt.get("group_size", 32) != 32 or wt.get("type", "float") != "float":
            raise MtcError(f"{w}: config group {name!r}: MXFP4 is 4-bit float weights in groups of 32, got "
                           f"num_bits={wt.get('num_bits')}, type={wt.get('type')!r}, "
                           f"group_size={wt.get('group_size')}")
    return "mxfp4"


def quantization_config() -> dict:
    """The quantization_config save_hf writes for MXFP4 routed experts (compressed-tensors)."""
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized",
                                          "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                                          "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                      "strategy": "group", "symmetric": True, "dynamic": False}}},
            "ignore": ["lm_head"]}


# ---------------------------------------------------------------------------------------------------------------
# Desc -> spec text (the same blocks and forward as models/<family>.mtc)

_COMMENTS = {"norm_eps": "rms_norm_eps", "latent_norm_eps": "MLA's q_a / kv_a norms: the RMSNorm default",
             "mla_every": "MLA on layers i % mla_every == 0 and the last", "q_lora_rank": "0: no q-LoRA (q_proj)",
             "first_dense": "1-based layers 1..first_dense are dense"}


def spec_text(desc: Desc, source: str = "config.json") -> str:
    """The .mtc spec of a Desc: a ``config`` block with the config's values, then the blocks and forward of
    models/<family>.mtc (or, for a layer pattern those cannot say, the same with the MLA layers listed)."""
    v = desc.values
    k3 = desc.family == "kimi_k3"
    lines = [f"# {'Kimi K3' if k3 else 'Kimi Linear'} from {source}: written by mtc import-hf (dsl.from_hf builds "
             f"this graph).", f"model {desc.family} {{", "  config {"]
    for k, x in v.items():
        kind = "dtype" if k == "dtype" else "str" if isinstance(x, str) else "float" if isinstance(x, float) else "int"
        lit = json.dumps(x) if isinstance(x, str) else repr(x)
        line = f"    {k}: {kind} = {lit}"
        if k in _COMMENTS:
            line = f"{line:<40}# {_COMMENTS[k]}"
        lines.append(line)
    lines.append("  }")
    lines.append("")
    if k3:
        gate = "lower_bound=lower_bound" if desc.gate == "sigmoid" else 'gate="softplus"'
        rank = "" if desc.full_rank_gate else ", gate_rank=head_dim"
        lines += [f"  block kda = kda_layer(heads=kda_heads, head_dim=head_dim, conv_size=conv_size, {gate},",
                  f"                        forget_rank=forget_rank{rank}, norm_eps=norm_eps)"]
    else:
        # transformers' Kimi Linear: the softplus gate, the low-rank output gate (g_a_proj / g_b_proj), no MLA gate
        lines += ['  block kda = kda_layer(heads=kda_heads, head_dim=head_dim, conv_size=conv_size, gate="softplus",',
                  "                        forget_rank=head_dim, gate_rank=head_dim, norm_eps=norm_eps)"]
    gated = "true" if k3 and desc.mla_gated else "false"
    lines += ["  block mla = mla_layer(heads=mla_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,",
              f"                        qk_nope_dim=qk_nope_dim, qk_rope_dim=qk_rope_dim, v_dim=v_dim, gated={gated},",
              "                        norm_eps=latent_norm_eps)"]
    if k3:
        lines += ['  block dense = glu_ffn(inter=dense_inter, act="situ", beta_gate=beta_gate, beta_up=beta_up)',
                  "  block moe = latent_moe(experts=experts, top_k=top_k, shared=shared, inter=moe_inter, "
                  "latent=latent,",
                  "                         routed_scaling=routed_scaling, expert_dtype=expert_dtype, act=\"situ\",",
                  "                         beta_gate=beta_gate, beta_up=beta_up, norm_eps=norm_eps)"]
    else:
        lines += ['  block dense = glu_ffn(inter=dense_inter, act="silu")',
                  "  block moe = moe(experts=experts, top_k=top_k, shared=shared, inter=moe_inter,",
                  '                  routed_scaling=routed_scaling, act="silu", norm_eps=norm_eps)']
    n = v["n_layers"]
    if "mla_every" in v:
        attn = "mla if i % mla_every == 0 or i == n_layers else kda"
    elif not desc.mla_layers:
        attn = "kda"
    elif len(desc.mla_layers) == n:
        attn = "mla"
    else:
        attn = "mla if " + " or ".join(f"i == {i}" for i in desc.mla_layers) + " else kda"
    res = 'residual="attn_res", block_size=block_size' if k3 else 'residual="add"'
    lines += ["", "  forward(input_ids: i64[B, T]) {", "    x = embedding(input_ids, vocab=vocab, dim=d)",
              f"    x = stack(x, layers=n_layers, {res}, norm_eps=norm_eps) {{", f"      attn = {attn}",
              "      ffn = dense if i <= first_dense else moe", "    }", "    x = rmsnorm(x, eps=norm_eps)",
              "    return lm_head(x, vocab=vocab)", "  }", "}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# graph -> Desc (save_hf), and Desc -> config.json

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def describe(graph, dtype_name: str) -> Desc:
    """The Desc of a graph (its 'graph' stage: layer-level ops), read from its layer ops' attributes. The caller
    checks that the Desc's spec gives this very graph (what decides whether the model is expressible)."""
    nodes = graph.node_map()

    def pname(ref):
        n = nodes[ref.node]
        return n.attr("name") if n.op in ("param", "buffer") else None

    def layer_of(n):
        for r in n.inputs[1:]:
            nm = pname(r)
            m = _LAYER.match(nm or "")
            if m:
                return int(m.group(1)) + 1
        return None

    v: dict[str, Any] = {}
    kda = mla = dense = moe = None
    mla_layers, moe_layers, n_layers = [], [], 0
    attn_res = any(n.op == "attn_residual" for n in graph.nodes)
    norm_eps = None
    for n in graph.nodes:
        if n.op == "embedding":
            v["vocab"], v["d"] = (int(s) for s in nodes[n.inputs[1].node].type.shape)
        if n.op == "rmsnorm" and pname(n.inputs[1]) == "model.norm.weight":
            norm_eps = float(n.attr("eps"))
        if n.op in ("kda_layer", "mla_layer", "glu_ffn", "moe", "latent_moe"):
            i = layer_of(n)
            if i is None:
                continue
            n_layers = max(n_layers, i)
            a = n.attr_dict
            if n.op == "kda_layer":
                kda = kda or a
            elif n.op == "mla_layer":
                mla = mla or a
                mla_layers.append(i)
            elif n.op == "glu_ffn":
                dense = dense or a
            else:
                moe = moe or dict(a, op=n.op)
                moe_layers.append(i)
    family = "kimi_k3" if attn_res or (moe and moe["op"] == "latent_moe") else "kimi_linear"
    k3 = family == "kimi_k3"
    meta = dict(graph.meta_get("config", ()) or ())
    v = {"dtype": dtype_name, **({"expert_dtype": (moe or {}).get("expert_dtype", "")} if k3 else {}),
         "vocab": v.get("vocab", 1), "d": v.get("d", 1), "n_layers": n_layers}
    v["first_dense"] = min(moe_layers) - 1 if moe_layers else n_layers
    every = _every(tuple(mla_layers), n_layers)
    if every:
        v["mla_every"] = every
    if k3:
        v["block_size"] = int(graph.meta_get("attn_res_block_size", 1) or 1)
    v["max_seq_len"] = int(meta.get("max_seq_len", 1048576))
    v["norm_eps"] = float(norm_eps if norm_eps is not None else 1e-5)
    v["latent_norm_eps"] = float((mla or {}).get("norm_eps", 1e-6))
    kda = kda or {"heads": 1, "head_dim": 1, "conv_size": 4, "gate": "softplus", "forget_rank": 0, "gate_rank": 0}
    v["kda_heads"], v["head_dim"], v["conv_size"] = kda["heads"], kda["head_dim"], kda["conv_size"]
    if kda["gate"] == "sigmoid":
        v["lower_bound"] = float(kda["lower_bound"])
    if k3:
        v["forget_rank"] = kda["forget_rank"] or kda["head_dim"]
    mla = mla or {"heads": 1, "q_lora_rank": 0, "kv_lora_rank": 1, "qk_nope_dim": 1, "qk_rope_dim": 0, "v_dim": 1,
                  "gated": k3}
    v.update(mla_heads=mla["heads"], q_lora_rank=mla["q_lora_rank"], kv_lora_rank=mla["kv_lora_rank"],
             qk_nope_dim=mla["qk_nope_dim"], qk_rope_dim=mla["qk_rope_dim"], v_dim=mla["v_dim"])
    dense = dense or {"inter": 1, "beta_gate": 4.0, "beta_up": 25.0}
    v["dense_inter"] = dense["inter"]
    moe = moe or {"experts": 1, "top_k": 1, "shared": 0, "inter": 1, "latent": 1, "routed_scaling": 1.0,
                  "beta_gate": 4.0, "beta_up": 25.0, "shared_inter": 0}
    v.update(experts=moe["experts"], top_k=moe["top_k"], shared=moe["shared"], moe_inter=moe["inter"])
    if k3:
        v["latent"] = moe["latent"]
    v["routed_scaling"] = float(moe["routed_scaling"])
    if k3:
        v["beta_gate"], v["beta_up"] = float(moe["beta_gate"]), float(moe["beta_up"])
    return Desc(family, v, tuple(sorted(mla_layers)), v["first_dense"], kda["gate"], not kda.get("gate_rank"),
                bool(mla["gated"]), "language_model." if k3 else "")


def hf_config(desc: Desc) -> dict:
    """The config.json of a Desc: the fields transformers' KimiLinearConfig writes and the release's
    ``linear_attn_config`` / ``first_k_dense_replace`` (Kimi Linear), nested as ``text_config`` for K3."""
    v = desc.values
    n = v["n_layers"]
    mla = set(desc.mla_layers)
    lac = {"num_heads": v["kda_heads"], "head_dim": v["head_dim"], "short_conv_kernel_size": v["conv_size"],
           "kda_layers": [i for i in range(1, n + 1) if i not in mla], "full_attn_layers": sorted(mla)}
    if desc.gate == "sigmoid":
        lac["gate_lower_bound"] = v["lower_bound"]
    if desc.full_rank_gate:
        lac["use_full_rank_gate"] = True
    t = {"model_type": "kimi_linear", "vocab_size": v["vocab"], "hidden_size": v["d"], "num_hidden_layers": n,
         "intermediate_size": v["dense_inter"], "moe_intermediate_size": v["moe_inter"],
         "num_attention_heads": v["mla_heads"], "num_key_value_heads": v["mla_heads"],
         "q_lora_rank": v["q_lora_rank"] or None, "kv_lora_rank": v["kv_lora_rank"],
         "qk_nope_head_dim": v["qk_nope_dim"], "qk_rope_head_dim": v["qk_rope_dim"], "v_head_dim": v["v_dim"],
         "num_experts": v["experts"], "num_experts_per_token": v["top_k"], "num_shared_experts": v["shared"],
         "routed_scaling_factor": v["routed_scaling"], "moe_renormalize": True, "num_expert_group": 1,
         "topk_group": 1, "rms_norm_eps": v["norm_eps"], "model_max_length": v["max_seq_len"],
         "hidden_act": "situ" if desc.family == "kimi_k3" else "silu", "tie_word_embeddings": False,
         "layer_types": ["full_attention" if i in mla else "linear_attention" for i in range(1, n + 1)],
         "mlp_layer_types": ["dense" if i <= desc.first_dense else "sparse" for i in range(1, n + 1)],
         "first_k_dense_replace": desc.first_dense, "linear_attn_config": lac,
         "linear_num_heads": v["kda_heads"], "linear_head_dim": v["head_dim"],
         "linear_conv_kernel_dim": v["conv_size"], "dtype": _HF_DTYPES.get(v["dtype"], "float32")}
    if desc.family == "kimi_linear":
        t["architectures"] = ["KimiLinearForCausalLM"]
        return t
    t.update(attn_res_block_size=v["block_size"], routed_expert_hidden_size=v["latent"], latent_moe_use_norm=True,
             mla_use_output_gate=desc.mla_gated, activation_situ_beta=v["beta_gate"],
             activation_situ_linear_beta=v["beta_up"])
    out = {"model_type": "kimi_k3", "text_config": t, "dtype": t["dtype"]}
    if v.get("expert_dtype") == "mxfp4":
        out["quantization_config"] = quantization_config()
    return out


def merge_passthrough(cfg: dict, passthrough: dict) -> dict:
    """``cfg`` with the fields of the config it was loaded from that do not change the model (token ids, auto_map,
    ...) added back where ``cfg`` does not set them."""
    if not passthrough:
        return cfg
    if "top" in passthrough:
        out = {**{k: x for k, x in passthrough["top"].items() if k in _KEEP}, **cfg}
        if "text_config" in out:
            out["text_config"] = {**{k: x for k, x in passthrough["text"].items() if k in _KEEP},
                                  **out["text_config"]}
        return out
    return {**{k: x for k, x in passthrough.items() if k in _KEEP}, **cfg}
