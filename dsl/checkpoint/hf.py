"""Load and save Hugging Face checkpoints: ``dsl.from_hf``, ``CompiledModule.save_hf``, ``mtc import-hf``.

A checkpoint is a directory with ``config.json`` and either ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (its ``weight_map``: tensor name -> file). The config picks the family
(:mod:`dsl.checkpoint.families`), which gives the spec (the graph mtc builds) and the name/layout table; the
tensors are read lazily, one at a time, with ``safetensors.safe_open`` (memory-mapped), each copied into its
parameter on the target device and dropped, so the host holds one tensor at a time beyond the model itself.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MtcError, MtcWarning
from . import families as fam
from . import mxfp4

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: the largest config.json / index read (a real index of a 2.8T model is a few MB)
MAX_JSON_BYTES = 64 << 20
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _read_json(path: Path, what: str):
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise MtcError(f"{path}: {what} larger than {MAX_JSON_BYTES >> 20} MiB")
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MtcError(f"{path}: no {what} (a Hugging Face checkpoint directory holds config.json and "
                       f"model.safetensors or model.safetensors.index.json with its shards)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MtcError(f"{path}: cannot read the {what}: {getattr(e, 'strerror', None) or e}") from None
    except json.JSONDecodeError as e:
        raise MtcError(f"{path}:{e.lineno}:{e.colno}: the {what} is not valid JSON: {e.msg}") from None


class Checkpoint:
    """The tensors of a checkpoint directory, read lazily (``safetensors.safe_open``).

    Raises MtcError (at construction) for: no safetensors file, an index that is not a ``weight_map`` of names to
    file names inside the directory, an index naming a file that does not exist or a tensor its file does not
    hold, a file that is not a complete safetensors file (e.g. truncated)."""

    def __init__(self, directory: str | os.PathLike):
        from safetensors import safe_open
        d = Path(directory)
        self.directory = d
        self.index = None
        self._file: dict[str, Path] = {}
        idx = d / INDEX
        if idx.exists():
            self.index = idx
            data = _read_json(idx, "safetensors index")
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
                raise MtcError(f"{idx}: expected {{\"weight_map\": {{tensor name: file name}}}}")
            for name, f in wm.items():
                if Path(f).name != f or f in ("", ".", ".."):
                    raise MtcError(f"{idx}: tensor '{name}' is in '{f}', which is not a file name in {d} (an index "
                                   f"names files beside it)")
                p = d / f
                if not p.is_file():
                    raise MtcError(f"{idx}: tensor '{name}' is in '{f}', which does not exist in {d}")
                self._file[name] = p
            files = sorted(set(self._file.values()))
        else:
            single = d / SINGLE
            if single.is_file():
                files = [single]
            else:
                found = sorted(d.glob("*.safetensors")) if d.is_dir() else []
                if len(found) != 1:
                    raise MtcError(f"{d}: no {SINGLE} and no {INDEX}" + (
                        f" ({len(found)} other .safetensors files: an index must say which tensor is where)"
                        if found else ""))
                files = found
        self._open: dict[Path, object] = {}
        for p in files:
            try:
                self._open[p] = safe_open(str(p), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
                raise MtcError(f"{p}: not a complete safetensors file ({e})") from None
        if self.index is None:
            for p, h in self._open.items():
                for name in h.keys():
                    self._file[name] = p
        else:
            for p, h in self._open.items():
                have = set(h.keys())
                for name, q in self._file.items():
                    if q == p and name not in have:
                        raise MtcError(f"{self.index}: tensor '{name}' is listed in '{p.name}', which does not hold "
                                       f"it")

    def names(self) -> list[str]:
        return list(self._file)

    def __contains__(self, name: str) -> bool:
        return name in self._file

    def file(self, name: str) -> Path:
        return self._file[name]

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string such as "BF16") from the file's header, no data read."""
        s = self._open[self._file[name]].get_slice(name)
        return tuple(s.get_shape()), s.get_dtype()

    def get(self, name: str) -> torch.Tensor:
        p = self._file[name]
        try:
            return self._open[p].get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise MtcError(f"{p}: cannot read tensor '{name}' ({e})") from None


# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Item:
    key: str                      # mtc state-dict name
    layout: str
    names: list[str]              # checkpoint names (per expert for "experts"; the X.weight base when packed)
    packed: list[bool]


@dataclass
class LoadReport:
    """What :func:`from_hf` did beyond loading every tensor: ``missing`` mtc weights the checkpoint lacks
    (initialised as dsl.compile would; strict=False only), ``unexpected`` checkpoint tensors mtc has no place for
    (strict=False only), ``skipped`` checkpoint tensors the family declares outside mtc's model (name, why),
    ``ignored_fields`` config fields mtc did not read (strict=False only)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    ignored_fields: list[str] = field(default_factory=list)


def _alias_names(family: fam.Family, name: str, prefix: str) -> list[str]:
    out = []
    base = name[len(prefix):]
    for a, b in family.aliases:
        m = re.match(fam._template_re(a).pattern, base)
        if m:
            out.append(prefix + b.format(**m.groupdict()) + base[m.end():])
    return out


def _hf_shape(layout: str, shape: tuple, head_dim: int) -> tuple:
    if layout == "row":
        return (1, *shape)
    if layout == "a_log":
        return (1, 1, shape[0], 1)
    if layout == "a_log_padded":
        return (max(shape[0], head_dim),)
    if layout == "experts":
        return tuple(shape[1:])
    return tuple(shape)


def _plan(family, desc, shapes: dict[str, tuple], ckpt: Checkpoint, strict: bool):
    """Map every mtc tensor to its checkpoint tensors and check names, shapes and dtypes from the headers, before
    anything is allocated. Returns (items, missing, unexpected, skipped)."""
    prefix = desc.prefix
    head_dim = desc.values["head_dim"]
    items, missing, used = [], [], set()
    for key, (shape, is_float) in shapes.items():
        rule, g = family.rule(key)
        layout = rule.layout if rule else "same"
        if layout == "experts":
            names = [prefix + rule.hf.format(i=g["i"], j=j) for j in range(shape[0])]
        else:
            names = [prefix + (rule.hf.format(**g) if rule else key)]
        want = _hf_shape(layout, shape, head_dim)
        got_names, packed = [], []
        for name in names:
            cands = [name] + _alias_names(family, name, prefix)
            hit = next((c for c in cands if c in ckpt), None)
            pk = False
            if hit is None and name.endswith(".weight"):
                hit = next((c for c in cands if c.removesuffix(".weight") + ".weight_packed" in ckpt), None)
                pk = hit is not None
            if hit is None:
                missing.append(name if layout != "experts" else f"{name} (expert of {key})")
                break
            if pk:
                _check_packed(ckpt, hit, want, key, desc)
                used.update({hit.removesuffix(".weight") + ".weight_packed", hit.removesuffix(".weight") +
                             ".weight_scale"})
            else:
                _check_dense(ckpt, hit, layout, want, shape, key, is_float)
                used.add(hit)
            got_names.append(hit)
            packed.append(pk)
        else:
            items.append(_Item(key, layout, got_names, packed))
    skipped, unexpected = [], []
    for name in ckpt.names():
        if name in used:
            continue
        base = name[len(prefix):] if name.startswith(prefix) else name
        why = next((w for pat, w in family.skip if re.fullmatch(pat, base) or re.fullmatch(pat, name)), None)
        if why is not None:
            skipped.append((name, why))
        else:
            unexpected.append(name)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing tensor{'s' if len(missing) > 1 else ''} " + ", ".join(
                f"'{n}'" for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected tensor{'s' if len(unexpected) > 1 else ''} " + ", ".join(
                f"'{n}' (in {ckpt.file(n).name})" for n in unexpected[:5])
                + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
        raise MtcError(f"{ckpt.directory}: the checkpoint does not match the {family.name} model its config.json "
                       f"describes: {'; '.join(parts)} (strict=False loads the rest and lists these)")
    return items, missing, unexpected, skipped


def _check_dense(ckpt, name, layout, want, shape, key, is_float):
    got, dt = ckpt.info(name)
    where = f"{ckpt.file(name)}: tensor '{name}'"
    if is_float and dt not in _FLOAT_DTYPES:
        raise MtcError(f"{where} has dtype {dt}; mtc's '{key}' is a floating-point weight")
    if not is_float and dt in _FLOAT_DTYPES:
        raise MtcError(f"{where} has dtype {dt}; mtc's '{key}' is an integer tensor")
    ok = {tuple(want)}
    if layout in ("row", "a_log", "a_log_padded"):
        ok |= {tuple(shape), (1, 1, shape[0], 1) if layout != "row" else tuple(shape)}
    if layout == "a_log_padded" and len(got) == 1 and got[0] >= shape[0]:
        ok.add(got)
    if got not in ok:
        raise MtcError(f"{where} has shape {list(got)}; mtc's '{key}' needs {list(want)}"
                       + (f" (its layout '{layout}' of mtc's {list(shape)})" if layout != "same" else ""))


def _check_packed(ckpt, name, want, key, desc):
    base = name.removesuffix(".weight")
    p, s = base + ".weight_packed", base + ".weight_scale"
    if s not in ckpt:
        raise MtcError(f"{ckpt.file(p)}: MXFP4 tensor '{p}' has no '{s}' beside it in the checkpoint")
    if desc.values.get("expert_dtype") != "mxfp4":
        raise MtcError(f"{ckpt.file(p)}: tensor '{p}' is MXFP4-packed but config.json declares no MXFP4 "
                       f"quantization_config (compressed-tensors mxfp4-pack-quantized)")
    (ps, pd), (ss, sd) = ckpt.info(p), ckpt.info(s)
    out, n_in = mxfp4.check_pair(ps, ss, pd, sd, f"{ckpt.file(p)}: '{base}'")
    if (out, n_in) != tuple(want):
        raise MtcError(f"{ckpt.file(p)}: MXFP4 weight '{base}' is [{out}, {n_in}]; mtc's '{key}' needs {list(want)}")


def _read(ckpt: Checkpoint, name: str, packed: bool, layout: str, n_heads: int | None) -> torch.Tensor:
    if packed:
        base = name.removesuffix(".weight")
        return mxfp4.dequantize(ckpt.get(base + ".weight_packed"), ckpt.get(base + ".weight_scale"),
                                where=f"{ckpt.file(base + '.weight_packed')}: '{base}'")
    t = ckpt.get(name)
    if layout in ("a_log", "a_log_padded", "row"):
        flat = t.reshape(-1)
        if layout == "a_log_padded" and flat.numel() > n_heads:
            if bool((flat[n_heads:] != 0).any()):
                raise MtcError(f"{ckpt.file(name)}: tensor '{name}' [{flat.numel()}] holds nonzero values past its "
                               f"{n_heads} heads (K3 pads A_log with zeros): not this model's layout")
            flat = flat[:n_heads]
        return flat
    return t


def from_hf(path: str | os.PathLike, target: str = "reference", *, dtype=None, device="cpu", strict: bool = True,
            seed: int | None = 0, dequantize: bool = True, **options):
    """Build the mtc model of a Hugging Face checkpoint and load its weights.

    Args:
        path: the checkpoint directory (config.json + model.safetensors, or the shards of
            model.safetensors.index.json).
        target, dtype, device, seed, **options: as for :func:`dsl.compile` (dtype default float32: every weight,
            bf16 or MXFP4 in the file, is converted to it; A_log, dt_bias and the router bias stay float32).
            device "meta" checks the checkpoint against the model (names, shapes, dtypes, from the headers)
            without reading a tensor.
        strict: refuse (MtcError) a checkpoint with a missing or unexpected tensor, or a config field mtc does
            not know; False loads what matches, initialises the rest as dsl.compile would and lists both in
            ``m.hf_report`` (a :class:`LoadReport`) and in one warning.
        dequantize: for a checkpoint with MXFP4 routed experts (K3's compressed-tensors mxfp4-pack-quantized):
            True (default) decodes them on load to ``dtype`` (exact in float32): dense, trainable experts that every
            target runs. False keeps them packed, byte for byte as in the file (dsl.compile's
            ``packed_experts=True``: :class:`backends.mxfp4.MXFP4Experts`, the memory plan's 0.53125 bytes per
            element; frozen; the moe_experts kernels decode the tiles they use), as transformers'
            ``Mxfp4Config(dequantize=False)`` / compressed-tensors' ``run_compressed`` keep theirs; the logits
            equal the decoded load's.
    Returns:
        the CompiledModule, with ``m.hf_config`` (the config.json read), ``m.hf_family`` and ``m.hf_report``.
    Raises:
        MtcError: no or unreadable config.json, a family or config value mtc does not model (naming the field),
            a missing / unexpected / wrong-shape / wrong-dtype tensor (naming it and its file), a truncated or
            unreadable shard, an index naming a missing file.
    """
    import dsl
    from backends.runtime import _check_interpreter_dtype, check_weights_fit
    d = Path(path)
    if not d.is_dir():
        raise MtcError(f"{d}: not a directory (a Hugging Face checkpoint is a directory with config.json)")
    cfg_path = d / CONFIG
    cfg = _read_json(cfg_path, "config.json")
    desc, ignored = fam.parse_config(cfg, str(cfg_path), strict)
    family = fam.FAMILIES[desc.family]
    graph = dsl.parse(fam.spec_text(desc, str(cfg_path)), file=f"{cfg_path} (its spec: mtc import-hf)")
    if not isinstance(dequantize, bool):
        raise MtcError(f"dsl.from_hf: dequantize must be True or False, got {dequantize!r}")
    if "packed_experts" in options:
        raise MtcError("dsl.from_hf: say dequantize=False (keep MXFP4 experts packed) or True, not packed_experts")
    ckpt = Checkpoint(d)
    m = dsl.compile(graph, target, dtype=dtype, device="meta", seed=seed, packed_experts=not dequantize, **options)
    packed = _packed_modules(m)
    shapes = {}
    for k, t in m.state_dict(keep_vars=True).items():
        if k in fam.MTC_STATE or k.rpartition(".")[0] in packed:
            continue
        shapes[k] = (tuple(t.shape), t.dtype.is_floating_point)
    for k, w in packed.items():
        shapes[k] = (tuple(w.shape), True)
    items, missing, unexpected, skipped = _plan(family, desc, shapes, ckpt, strict)
    report = LoadReport(missing, unexpected, skipped, list(ignored))
    dev = torch.device(device)
    if dev.type != "meta":
        _check_interpreter_dtype(target, m.dtype)
        check_weights_fit(graph, torch.empty((), dtype=m.dtype).element_size(), dev,
                          "device='meta' checks the checkpoint without loading it", where="dsl.from_hf: ",
                          packed_mxfp4=bool(packed))
        m.to_empty(device=dev)
        tensors = dict(m.state_dict(keep_vars=True))
        H = desc.values["kda_heads"]
        with torch.no_grad():
            for it in items:
                if it.key in packed:
                    _read_packed(ckpt, it, packed[it.key], H)
                    continue
                dst = tensors[it.key]
                if it.layout == "experts":
                    for j, (name, pk) in enumerate(zip(it.names, it.packed)):
                        dst[j].copy_(_read(ckpt, name, pk, it.layout, H))
                else:
                    src = _read(ckpt, it.names[0], it.packed[0], it.layout, H)
                    dst.copy_(src.reshape(dst.shape))
            if "balance_updates" in tensors:
                tensors["balance_updates"].zero_()
            if missing:
                _init_missing(m, {it.key for it in items}, seed)
        if any(L.generated is not None for L in m.program.launches):
            m.load_generated(options.get("emit_dir"))
        else:
            m.prepare_tracing()
    m.hf_config = cfg
    m.hf_family = desc.family
    m.hf_report = report
    m.hf_passthrough = desc.passthrough
    if missing or unexpected or ignored:
        warnings.warn(MtcWarning(f"dsl.from_hf({str(d)!r}, strict=False): "
                                 + "; ".join(p for p in (
                                     f"{len(missing)} mtc weights not in the checkpoint, initialised: "
                                     + ", ".join(missing[:3]) if missing else "",
                                     f"{len(unexpected)} checkpoint tensors not loaded: " + ", ".join(unexpected[:3])
                                     if unexpected else "",
                                     f"config fields ignored: {', '.join(ignored)}" if ignored else "") if p)
                                 + " (m.hf_report lists them all)"), stacklevel=2)
    return m


def _packed_modules(m) -> dict:
    """{mtc key: MXFP4Experts} of a module's packed routed experts."""
    from backends.mxfp4 import MXFP4Experts
    return {k: w for k, w in m.named_modules() if isinstance(w, MXFP4Experts)}


def _read_packed(ckpt: Checkpoint, it: _Item, w, H: int) -> None:
    """Expert by expert into the packed experts w: MXFP4 pairs copied byte for byte (an E8M0 NaN scale refused:
    MtcError naming the tensor and file), dense experts rounded to MXFP4."""
    for j, (name, pk) in enumerate(zip(it.names, it.packed)):
        if pk:
            base = name.removesuffix(".weight")
            scale = ckpt.get(base + ".weight_scale")
            if bool((scale == 255).any()):
                raise MtcError(f"{ckpt.file(base + '.weight_scale')}: MXFP4 '{base}.weight_scale' holds 255 (E8M0 NaN)")
            w.weight_packed[j].copy_(ckpt.get(base + ".weight_packed"))
            w.weight_scale[j].copy_(scale)
        else:
            w.quantize_(_read(ckpt, name, False, it.layout, H), j)


def _init_missing(m, loaded: set, seed):
    """Initialise the weights the checkpoint did not give, with their IR initialiser (as dsl.compile does; packed
    experts drawn in float32 and rounded to MXFP4)."""
    from backends.runtime import _init_
    gen = torch.Generator(device=next(m.parameters()).device)
    gen.manual_seed(int(seed or 0))
    tensors = dict(m.state_dict(keep_vars=True))
    packed = _packed_modules(m)
    for n in m.graph.nodes:
        if n.op in ("param", "buffer"):
            key = n.attr("name")
            if key not in loaded and key in packed:
                w32 = torch.empty(packed[key].shape, dtype=torch.float32, device=packed[key].device)
                _init_(w32, n.attr("init"), n.attr("std"), gen)
                packed[key].quantize_(w32)
            elif key not in loaded and key in tensors:
                _init_(tensors[key].data, n.attr("init"), n.attr("std"), gen)


# ---------------------------------------------------------------------------------------------------------------
def _parse_size(s) -> int:
    if isinstance(s, int) and not isinstance(s, bool) and s > 0:
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*", str(s), re.I)
    if not m:
        raise MtcError(f"max_shard_size {s!r}: a positive number of bytes or a size such as '5GB' or '500MiB'")
    unit = m.group(2).upper()
    mult = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
            "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}[unit]
    return max(1, int(float(m.group(1)) * mult))


def _graph_dtype(graph) -> str:
    meta = dict(graph.meta_get("config", ()) or ())
    if isinstance(meta.get("dtype"), str):
        return meta["dtype"]
    emb = next((n for n in graph.nodes if n.op == "param"), None)
    return emb.type.dtype if emb is not None else "f32"


def describe_module(m) -> fam.Desc:
    """The family description of a compiled module, checked: MtcError unless the family's spec for it builds the
    very graph the module runs (what save_hf writes must load back as the same model)."""
    import dsl
    graph = m.stages["graph"]
    desc = fam.describe(graph, _graph_dtype(graph))
    text = fam.spec_text(desc, f"the graph of {graph.name}")
    try:
        again = dsl.parse(text, file=f"<{desc.family} spec of {graph.name}>")
    except MtcError as e:
        raise MtcError(f"{graph.name}: cannot be written as a {desc.family} checkpoint: its {desc.family} spec "
                       f"does not build ({e})") from None
    a, b = graph.nodes, again.nodes
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    # the first differing op says more than the parameter it initialises differently
    for x, y in sorted(diff, key=lambda p: p[0].op in ("param", "buffer"))[:1]:
        if x != y:
            raise MtcError(f"{graph.name}: cannot be written as a {desc.family} checkpoint: the family's spec builds "
                           f"'{y.op}' ({_short(y)}) where this model has '{x.op}' ({_short(x)})"
                           + (f" at {x.loc}" if x.loc else ""))
    if len(a) != len(b):
        raise MtcError(f"{graph.name}: cannot be written as a {desc.family} checkpoint: the family's spec builds "
                       f"{len(b)} nodes, this model {len(a)}")
    return desc


def _short(n) -> str:
    name = n.attr("name")
    attrs = ", ".join(f"{k}={v!r}" for k, v in n.attrs if k != "name")
    return (f"{name}: " if name else "") + (attrs[:200] or str(n.type))


def _hf_entries(m, desc: fam.Desc, expert_format: str):
    """[(checkpoint names, bytes, make)] of a module in state-dict order, ``make()`` giving those tensors (CPU,
    contiguous, no shared storage) only when their shard is written: the whole checkpoint is never held twice.
    MtcError up front for experts that MXFP4 cannot take (shape, NaN / inf)."""
    family = fam.FAMILIES[desc.family]
    prefix = desc.prefix
    head_dim = desc.values["head_dim"]
    out = []
    packed = _packed_modules(m)
    for key, t in m.state_dict().items():
        if key in fam.MTC_STATE:
            continue
        pkey, _, leaf = key.rpartition(".")
        if pkey in packed:
            if leaf == "weight_packed":          # (once per packed weight: its two buffers are one entry each)
                out += _packed_entries(packed[pkey], pkey, family, prefix, expert_format, m.dtype)
            continue
        t = t.detach()
        rule, g = family.rule(key)
        layout = rule.layout if rule else "same"
        if layout == "experts":
            if expert_format == "mxfp4":
                if t.dim() != 3 or t.shape[2] % mxfp4.GROUP:
                    raise MtcError(f"save_hf: '{key}' {list(t.shape)}: MXFP4 needs each expert's input width a "
                                   f"multiple of {mxfp4.GROUP}")
                if not bool(torch.isfinite(t).all()):
                    raise MtcError(f"save_hf: '{key}' holds NaN or inf, which MXFP4 cannot encode")
            for j in range(t.shape[0]):
                name = prefix + rule.hf.format(i=g["i"], j=j)
                if expert_format == "mxfp4":
                    base = name.removesuffix(".weight")
                    a, b = t.shape[1], t.shape[2]
                    out.append(([base + ".weight_packed", base + ".weight_scale"], a * b // 2 + a * b // mxfp4.GROUP,
                                lambda t=t, j=j, key=key: mxfp4.quantize(t[j].cpu(),
                                                                         where=f"save_hf: '{key}' expert {j}")))
                else:
                    out.append(([name], t[j].numel() * t.element_size(), lambda t=t, j=j: [t[j].cpu().clone()]))
            continue
        name = prefix + (rule.hf.format(**g) if rule else key)

        def make(t=t, layout=layout):
            t = t.cpu()
            if layout == "row":
                t = t.reshape(1, -1)
            elif layout == "a_log":
                t = t.reshape(1, 1, -1, 1)
            elif layout == "a_log_padded":
                t = torch.cat([t, t.new_zeros(max(0, head_dim - t.numel()))])
            return [t.contiguous().clone()]
        n = max(t.numel(), head_dim) if layout == "a_log_padded" else t.numel()
        out.append(([name], n * t.element_size(), make))
    return out


def _packed_entries(w, key: str, family, prefix: str, expert_format: str, dtype) -> list:
    """_hf_entries' rows of packed experts w (mtc key ``key``): per expert its weight_packed / weight_scale bytes as
    held (expert_format "mxfp4": bit for bit), or its weight decoded to ``dtype`` ("dense")."""
    rule, g = family.rule(key)
    e, a, b = w.shape
    out = []
    for j in range(e):
        name = prefix + rule.hf.format(i=g["i"], j=j)
        if expert_format == "mxfp4":
            base = name.removesuffix(".weight")
            out.append(([base + ".weight_packed", base + ".weight_scale"], a * b // 2 + a * b // mxfp4.GROUP,
                        lambda j=j: [w.weight_packed[j].cpu().clone(), w.weight_scale[j].cpu().clone()]))
        else:
            out.append(([name], a * b * torch.empty((), dtype=dtype).element_size(),
                        lambda j=j: [w.expert(j, dtype).cpu()]))
    return out


def save_hf(m, directory: str | os.PathLike, *, max_shard_size="5GB", expert_format: str | None = None) -> Path:
    """Write a compiled module as a Hugging Face checkpoint: config.json and model.safetensors, or shards
    model-0000k-of-0000n.safetensors with model.safetensors.index.json when the tensors pass ``max_shard_size``
    (bytes, or e.g. "5GB"). Kimi Linear models load with transformers' ``KimiLinearForCausalLM.from_pretrained``;
    both families load back with :func:`from_hf` bit for bit.

    Tensors are written in the module's dtype (A_log, dt_bias and router weights as they are held); routed
    experts as MXFP4 (``weight_packed`` / ``weight_scale``) when ``expert_format="mxfp4"`` or, by default, when the
    spec types them so (``expert_dtype="mxfp4"``, K3 only): exact for weights decoded from MXFP4, else rounded to
    the nearest MXFP4 value (:func:`dsl.checkpoint.mxfp4.quantize`).
    Files are written atomically into ``directory`` (created if missing); a file there that mtc did not write (or
    that changed since) is never replaced: MtcError before anything is written (dsl.fileio.OutputDir).

    Returns the directory. Raises MtcError for a parallel module (save its full_state_dict() through a
    single-process module), a model no family's spec builds (naming the first difference), an output file mtc may
    not replace, or a failed write."""
    from safetensors.torch import save as st_save
    from ..fileio import OutputDir
    if callable(getattr(m, "full_state_dict", None)):       # a parallel module (backends.parallel.ParallelModule)
        raise MtcError("save_hf: a parallel module holds only its rank's shards; gather them on every rank with "
                       "sd = m.full_state_dict() (a collective call), then on one rank load sd into a "
                       "single-process module of the same graph (dsl.compile(m.graph, ...).load_state_dict(sd)) "
                       "and save_hf that")
    desc = describe_module(m)
    if expert_format is None:
        expert_format = "mxfp4" if desc.values.get("expert_dtype") == "mxfp4" else "dense"
    if expert_format not in ("mxfp4", "dense"):
        raise MtcError(f"expert_format {expert_format!r}: 'mxfp4', 'dense' or None (the spec's expert_dtype)")
    if expert_format == "mxfp4" and desc.family != "kimi_k3":
        raise MtcError(f"expert_format 'mxfp4': MXFP4 experts are written for the kimi_k3 family only (this model is "
                       f"{desc.family})")
    if desc.family == "kimi_k3":
        desc.values["expert_dtype"] = "mxfp4" if expert_format == "mxfp4" else ""
    limit = _parse_size(max_shard_size)
    # config.json's dtype says what the tensors are: the module's dtype (the spec's declared one may differ)
    desc.values["dtype"] = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}.get(m.dtype, "f32")
    cfg = fam.merge_passthrough(fam.hf_config(desc), getattr(m, "hf_passthrough", None) or {})
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):     # (transformers' defaults are the release's ids,
        cfg.get("text_config", cfg).setdefault(k, None)            # outside a smaller vocabulary)
    entries = _hf_entries(m, desc, expert_format)
    shards, cur, size = [], [], 0
    for e in entries:
        if cur and size + e[1] > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e[1]
    if cur or not shards:
        shards.append(cur)
    n = len(shards)
    files = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    d = Path(directory)
    out = OutputDir(d, "save_hf")
    names = [CONFIG, *files] + ([INDEX] if n > 1 else [])
    out.check(names)
    # files of an earlier save here that this one does not write (a stale index would name old shards): removed,
    # once the new files are written, when mtc wrote them and nobody changed them; else refused before any write
    stale = [p.name for p in (d.iterdir() if d.is_dir() else ()) if p.name not in names and
             (p.name in (SINGLE, INDEX) or _SHARD_RE.fullmatch(p.name))]
    out.check(stale)
    weight_map, total = {}, 0
    for fname, shard in zip(files, shards):
        tensors = {}
        for tnames, _, make in shard:
            tensors.update(zip(tnames, make()))
        data = st_save(tensors, metadata={"format": "pt"})
        out.write(fname, data)
        for k, t in tensors.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
        del data, tensors
    if n > 1:
        out.write(INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    out.write(CONFIG, json.dumps(cfg, indent=2) + "\n")
    for name in stale:
        (d / name).unlink()
    return d


def import_hf(path: str | os.PathLike, strict: bool = True) -> str:
    """The .mtc spec text of a checkpoint's config.json (the graph dsl.from_hf builds). MtcError as from_hf's
    config errors."""
    cfg_path = Path(path) / CONFIG if Path(path).is_dir() else Path(path)
    cfg = _read_json(cfg_path, "config.json")
    desc, ignored = fam.parse_config(cfg, str(cfg_path), strict)
    return fam.spec_text(desc, str(cfg_path))
