"""Lowering: the fused graph IR -> the kernel IR, an ordered list of kernel launches.

Each fusion group (fuse_tiles) becomes one launch of its anchor's kernel template, with the absorbed ops
as the launch's prologue and epilogue; GEMMs go to the vendor library; the remaining elementwise and
normalisation ops are grouped into generated pointwise kernels (chains of single-use producers). Views
(reshape, slice, broadcast) are free and produce no launch.

Every launch records: kernel, backend, grid (symbolic in B and T), tile sizes, input and output buffers
with their types, and the ops of its prologue/epilogue. The printed kernel IR is what the code cache is
keyed by (together with the target and the versions), so sizes of symbolic dims never enter the key.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import sympy

from dsl.ir import SOURCE_OPS, Graph, Node, Ref, TensorType, as_expr

from .batch_attn_residual import phase1_acc_dtype

VIEWS = ("reshape", "slice", "broadcast")
GEMMS = ("linear", "lm_head")
POINTWISE = ("silu", "sigmoid", "mul", "add", "situ_glu", "rmsnorm", "l2norm", "short_conv", "kda_gate",
             "embedding", "concat")

CODEGEN_OPS = ("add", "mul", "silu", "sigmoid", "situ_glu", "rmsnorm", "l2norm")   # backends/triton/codegen.py

TEMPLATES = {
    "kda_chunk": "triton.kda_chunk",
    "mla_attention": "library:sdpa",
    "qb_route": "triton.qb_route",
    "moe_experts": "triton.moe_experts",
    "situ_glu": "library:gemm+triton.situ_glu",
    "attn_residual": "triton.attn_residual",
    "attn_residual_phase1": "triton.attn_residual_phase1",
    "attn_residual_merge": "triton.attn_residual_merge",
}


def _fusion_users(g: Graph):
    """only_user(n, op): n's single consumer when it is an ``op`` of n's fusion group taking n as its first
    input and n is no graph output; else None (the intermediate value then has no other use)."""
    users = g.users()
    outs = {r.node for r in g.outputs}
    by = {n.name: n for n in g.nodes}

    def only_user(n, op):
        us = users[n.name]
        if len(us) != 1 or n.name in outs:
            return None
        u = by[us[0]]
        ok = u.op == op and u.attr("fusion") is not None and u.attr("fusion") == n.attr("fusion")
        return u if ok and u.inputs[0].node == n.name else None
    return only_user


def conv_chains(g: Graph) -> dict[str, list[str]]:
    """The ``short_conv -> silu [-> reshape -> l2norm]`` chains inside one fusion group (the KDA prologue of
    q, k and v) whose intermediate values have no other use: target "triton" runs each as ONE kernel
    (backends/triton/conv.py, conv_silu_norm). Returns {short_conv node: [member node names in order]}."""
    only_user = _fusion_users(g)
    chains = {}
    for n in g.nodes:
        if n.op != "short_conv" or n.attr("fusion") is None:
            continue
        s = only_user(n, "silu")
        if s is None:
            continue
        chain = [n.name, s.name]
        r = only_user(s, "reshape")
        nrm = only_user(r, "l2norm") if r is not None else None
        if nrm is not None:
            chain += [r.name, nrm.name]
        chains[n.name] = chain
    return chains


def norm_epilogues(g: Graph) -> dict[str, Node]:
    """attn_residual / attn_residual_merge anchors whose fusion group absorbed the RMSNorm (same eps) of their
    single-use output: target "triton" runs that norm inside the AttnRes kernel (its fused output RMSNorm).
    Returns {anchor node: the rmsnorm node}."""
    only_user = _fusion_users(g)
    epi = {}
    for n in g.nodes:
        if n.op not in ("attn_residual", "attn_residual_merge") or n.attr("fusion") is None:
            continue
        c = only_user(n, "rmsnorm")
        if c is not None and c.attr("eps") == n.attr("eps"):
            epi[n.name] = c
    return epi


@dataclass
class Launch:
    index: int
    kernel: str
    backend: str                       # "triton" | "library" | "reference"
    anchor: str                        # node name of the anchor (or the last op of a pointwise chain)
    ops: list[str]                     # member node names in order
    op_kinds: list[str]
    inputs: list[tuple[str, TensorType]]
    outputs: list[tuple[str, TensorType]]
    grid: list = field(default_factory=list)
    tiles: dict = field(default_factory=dict)
    prologue: list[str] = field(default_factory=list)
    epilogue: list[str] = field(default_factory=list)
    epilogue_in_kernel: bool = False   # the epilogue runs inside the template kernel (not as separate ops)
    epilogue_generated: bool = False   # the epilogue runs as one generated kernel after the template kernel

    def text(self) -> str:
        ins = ", ".join(f"{r}" for r, _ in self.inputs)
        outs = ", ".join(f"{r}: {t}" for r, t in self.outputs)
        g = "[" + ", ".join(str(x).replace(" ", "") for x in self.grid) + "]" if self.grid else self.backend
        s = f"k{self.index} = {self.kernel} grid {g}"
        if self.tiles:
            s += " tiles {" + ", ".join(f"{k}={v}" for k, v in self.tiles.items()) + "}"
        s += f" ({ins}) -> ({outs})"
        if self.prologue:
            s += f"\n      prologue: {' -> '.join(self.prologue)}"
        if self.epilogue:
            where = " (in kernel)" if self.epilogue_in_kernel else " (generated kernel)" if self.epilogue_generated \
                else ""
            s += f"\n      epilogue{where}: {' -> '.join(self.epilogue)}"
        return s


@dataclass
class KernelProgram:
    name: str
    target: str
    symbols: tuple
    launches: list[Launch]

    def text(self) -> str:
        lines = ["// prologue/epilogue: the ops each template launch absorbs (fuse_tiles). '(in kernel)': they run",
                 "// inside the template kernel (AttnRes + the next RMSNorm); '(generated kernel)': one generated",
                 "// Triton kernel right after it; [a+b+c]: one fused kernel of its own",
                 "// (KDA's short_conv+silu+l2norm); the others still run as separate ops beside it (through the",
                 "// target's op table: TVM kernels for target=tvm); pointwise chains run as generated kernels;",
                 "// views (reshape, slice) are free.",
                 f"kernels {self.name}({', '.join(self.symbols)}) target={self.target} {{"]
        lines += ["  " + ln for L in self.launches for ln in L.text().splitlines()]
        lines.append("}")
        return "\n".join(lines) + "\n"

    def cache_key(self, versions: dict | None = None) -> str:
        """sha256 of the printed kernel IR + target + tool versions (never concrete sizes)."""
        import torch
        import triton
        v = versions or {"torch": torch.__version__, "triton": triton.__version__, "mtc": "0.1.0"}
        h = hashlib.sha256(self.text().encode())
        h.update(repr(sorted(v.items())).encode())
        return h.hexdigest()[:24]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for L in self.launches:
            out[L.kernel] = out.get(L.kernel, 0) + 1
        return out


# the ops backends/tvm runs (backends.tvm.op_table; qb_route: TVM router scores, then the reference's top-k)
TVM_OPS = ("rmsnorm", "l2norm", "silu", "sigmoid", "add", "mul", "situ_glu", "attn_residual", "short_conv",
           "qb_route")


def _cdiv(a, b) -> sympy.Expr:
    return sympy.ceiling(as_expr(a) / b)


def _grid(kind: str, anchor: Node, types: dict, tiles: dict) -> list:
    t0 = anchor.types[0]
    if kind == "kda_chunk":
        B, T, H, V = t0.shape
        return [_cdiv(V, tiles.get("BLOCK_V", 64)), B * H]
    if kind == "mla_attention":
        B, T, H, _ = t0.shape
        return [_cdiv(T, tiles.get("BLOCK_M", 128)), B * H]
    if kind == "qb_route":
        N = t0.shape[0]
        return [_cdiv(N, tiles.get("BLOCK_N", 64))]
    if kind == "moe_experts":
        idx = types[anchor.inputs[1]]
        w1 = types[anchor.inputs[3]]
        N, k = idx.shape
        E, I, _ = w1.shape
        return [_cdiv(N * k, tiles.get("BLOCK_M", 128)) + E, _cdiv(2 * I, tiles.get("BLOCK_N", 128))]
    if kind.startswith("attn_residual"):
        rows = sympy.Mul(*t0.shape[:-1])
        if kind == "attn_residual_phase1":
            rows = sympy.Mul(*t0.shape[1:-1])
        return [_cdiv(rows, tiles.get("ROWS", 2))]
    if kind == "situ_glu":
        M = sympy.Mul(*t0.shape[:-1])
        return [_cdiv(M, tiles.get("BLOCK_M", 128)), _cdiv(t0.shape[-1], tiles.get("BLOCK_N", 128))]
    rows = sympy.Mul(*t0.shape[:-1]) if t0.rank > 1 else 1
    return [rows]


def lower(g: Graph, target: str = "triton") -> KernelProgram:
    """Lower a fused graph (after fuse_tiles) to a kernel program."""
    nodes = g.node_map()
    users = g.users()
    types = {Ref(n.name, i): t for n in g.nodes for i, t in enumerate(n.types)}
    if target == "triton":
        # the accumulator as the Triton phase 1 stores it (the memory plan counts it so too, plan_memory._two_phase)
        for n in g.nodes:
            if n.op == "attn_residual_phase1":
                types[Ref(n.name, 0)] = TensorType(phase1_acc_dtype(types[n.inputs[-1]].dtype), n.types[0].shape)
    outputs = set(g.outputs)
    # 1. groups: fusion annotations, then pointwise chains of the rest
    group_of: dict[str, str] = {}
    for n in g.nodes:
        a = n.attr("fusion")
        if a is not None:
            group_of[n.name] = a
    for n in g.nodes:                       # single-use pointwise producers join their consumer's chain
        if n.op in SOURCE_OPS or n.name in group_of or n.op not in POINTWISE:
            continue
        group_of[n.name] = n.name
    def root(x):                            # resolve chains (a -> b -> c)
        while group_of.get(x, x) != x:
            x = group_of[x]
        return x

    fused = {n.name for n in g.nodes if n.attr("fusion") is not None}
    for n in reversed(g.nodes):
        if n.op not in POINTWISE or n.name in fused:
            continue
        for r in n.inputs:
            p = nodes[r.node]
            if p.op in POINTWISE and group_of.get(p.name) == p.name and len(users[p.name]) == 1 \
                    and r not in outputs:
                group_of[p.name] = root(n.name)
    members: dict[str, list[Node]] = {}
    for n in g.nodes:
        if n.op in SOURCE_OPS or n.op in VIEWS and n.name not in group_of:
            continue
        key = root(n.name) if n.name in group_of else n.name
        members.setdefault(key, []).append(n)
    chains = conv_chains(g) if target == "triton" else {}
    norm_epis = norm_epilogues(g) if target == "triton" else {}
    chain_of = {x: start for start, ms_ in chains.items() for x in ms_}
    # 2. launches in the order of each group's last member
    pos = {n.name: i for i, n in enumerate(g.nodes)}
    order = sorted(members, key=lambda k: pos[members[k][-1].name])
    launches = []
    for key in order:
        ms = members[key]
        names = {m.name for m in ms}
        ins, outs = [], []
        for m in ms:
            for r in m.inputs:
                if r.node not in names and (str(r), types[r]) not in ins:
                    ins.append((str(r), types[r]))
        for m in ms:
            for i in range(len(m.types)):
                r = Ref(m.name, i)
                if r in outputs or any(u not in names for u in users[m.name]):
                    outs.append((str(r), types[r]))
        anchor = nodes[key] if key in nodes and nodes[key].attr("fusion") == key else ms[-1]
        kind = anchor.op
        tiles = dict(anchor.attr("tiles") or ())
        if anchor.attr("fusion") == key:
            kernel = TEMPLATES.get(kind, kind)
            backend = kernel.split(":")[0] if kernel.startswith(("library", "reference")) else "triton"
            a_pos = pos[anchor.name]
            prologue = []
            for m in ms:
                if pos[m.name] >= a_pos or m.op in VIEWS:
                    continue
                if m.name in chain_of:           # one fused conv kernel (target triton): printed in brackets
                    if chain_of[m.name] == m.name:
                        prologue.append("[" + "+".join(nodes[x].op for x in chains[m.name]
                                                       if nodes[x].op not in VIEWS) + "]")
                    continue
                prologue.append(m.op)
            epilogue = [m.op for m in ms if pos[m.name] > a_pos and m.op not in VIEWS]
        elif kind in GEMMS:
            kernel, backend, prologue, epilogue = "library:gemm", "library", [], []
        elif all(m.op in CODEGEN_OPS for m in ms):
            kernel = "triton.pointwise[" + "+".join(m.op for m in ms if m.op not in VIEWS) + "]"
            backend, prologue, epilogue = "triton", [], []
        else:                                # no generated kernel for it yet: the PyTorch op runs
            kernel = "torch[" + "+".join(m.op for m in ms if m.op not in VIEWS) + "]"
            backend, prologue, epilogue, tiles = "reference", [], [], {}
            tiles = {"BLOCK": 1024} if all(m.op in ("silu", "sigmoid", "mul", "add", "situ_glu") for m in ms) \
                else {"BLOCK_D": 1 << max(0, int(anchor.types[0].shape[-1]) - 1).bit_length()}
        if target == "tvm" and all(m.op in TVM_OPS + VIEWS for m in ms) and backend != "library":
            # TensorIR kernels (backends/tvm), one per op for now; the rest falls back to Triton
            kernel, backend = "tvm[" + "+".join(m.op for m in ms if m.op not in VIEWS) + "]", "tvm"
            prologue, epilogue, tiles = [], [], {}      # TVM kernels have their own schedules (mtc ir --stage tvm)
        elif target == "tvm":
            # a library GEMM with a fused elementwise epilogue: the runtime runs that op with its TVM kernel
            for op in TVM_OPS:
                kernel = kernel.replace(f"triton.{op}", f"tvm.{op}")
        grid = [] if backend in ("library", "tvm", "reference") else _grid(kind, anchor, types, tiles)
        # AttnRes kernels carry an output RMSNorm: the runtime (target triton) runs an absorbed RMSNorm of the
        # same eps there (backends/runtime.py, CompiledModule._fused_norm_epilogues)
        in_kernel = (target == "triton" and backend == "triton" and anchor.name in norm_epis
                     and epilogue == ["rmsnorm"])
        # any other epilogue of elementwise / row-norm ops (and reshapes) becomes one generated kernel
        # (backends/triton/codegen.py), run right after the template kernel
        epi_nodes = [m for m in ms if pos[m.name] > pos[anchor.name]] if anchor.attr("fusion") == key else []
        generated = (target == "triton" and backend in ("triton", "library") and not in_kernel and bool(epilogue)
                     and all(m.op in CODEGEN_OPS or m.op == "reshape" for m in epi_nodes))
        launches.append(Launch(len(launches), kernel, backend, anchor.name, [m.name for m in ms],
                               [m.op for m in ms], ins, outs, grid, tiles, prologue, epilogue, in_kernel,
                               generated))
    return KernelProgram(g.name, target, g.symbols, launches)
