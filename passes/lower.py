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
from dsl.ops import ops_with_role

from .batch_attn_residual import phase1_acc_dtype

# the op sets of the lowering, from the ops' declared roles (dsl/ops)
VIEWS = ops_with_role("view")
GEMMS = ops_with_role("gemm")
POINTWISE = ops_with_role("pointwise", "row_norm", "memory_bound")   # what chains of single-use producers join
CODEGEN_OPS = ops_with_role("pointwise", "row_norm")                 # backends/triton/codegen.py writes these

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
    """One call the runtime makes: an op's implementation, a fused kernel, or a view.

    ``kernel`` is the implementation that runs (``triton.kda_chunk``, ``library.gemm``, ``reference.rmsnorm``,
    ``generated.<name>``, ``view.reshape``); ``op`` the graph op it runs, or the fused kind (``conv_silu_norm``,
    ``pointwise``, ``<anchor op>+rmsnorm``); ``ops`` the graph nodes whose values it computes, in order.
    ``inputs`` / ``outputs``: (printed ref, type) of the buffers it reads and writes (parameters are read as
    ``%pN``); ``frees``: the buffers whose last use it is (dropped right after it when autograd does not
    record); ``inplace``: {output index: input index} of the outputs it writes into the storage of that input,
    whose last use it is (see :func:`lower`). ``meta``: the meta-parameters the implementation reads; ``refused``:
    implementations earlier in the target's chain that do not take this node, with the reason.
    """

    index: int
    kernel: str
    op: str
    anchor: str                        # the node whose position in the graph triggers the launch
    ops: list[str]
    op_kinds: list[str]
    inputs: list[tuple[str, TensorType]]
    outputs: list[tuple[str, TensorType]]
    group: str | None = None           # the fusion group (fuse_tiles anchor) this launch belongs to
    meta: dict = field(default_factory=dict)
    grid: list = field(default_factory=list)
    frees: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    generated: object = None           # the GeneratedKernel of a generated.* launch (backends/triton/codegen.py)
    aliases: dict = field(default_factory=dict)   # output index -> the input index whose storage it views
    inplace: dict = field(default_factory=dict)   # output index -> the input index whose storage it overwrites

    @property
    def is_view(self) -> bool:
        return self.kernel.startswith("view.")

    def text(self) -> str:
        ins = ", ".join(r for r, _ in self.inputs)
        outs = ", ".join(f"{r}: {t}" + (f" in place of {self.inputs[self.inplace[j]][0]}" if j in self.inplace else "")
                         for j, (r, t) in enumerate(self.outputs))
        s = f"k{self.index} = {self.kernel}"
        if self.grid:
            s += " grid [" + ", ".join(str(x).replace(" ", "") for x in self.grid) + "]"
        if self.meta:
            s += " meta {" + ", ".join(f"{k}={v}" for k, v in self.meta.items()) + "}"
        s += f" ({ins}) -> ({outs})"
        if self.op not in (self.kernel.split(".", 1)[-1], "pointwise") and not self.is_view:
            s += f"  // {self.op}"
        if len(self.ops) > 1:
            s += f"\n      ops: {' -> '.join(self.op_kinds)}"
        for r in self.refused:
            s += f"\n      not {r}"
        if self.frees:
            s += f"\n      free {', '.join(self.frees)}"
        return s


@dataclass
class Buffer:
    """A value of the program: its type, the launch that defines it (-1: a graph input), its last use (the
    number of launches: a graph output, kept), for a view the buffer whose storage it shares (or that it views a
    weight), and for an output written in place the input buffer whose storage it takes (``reuses``)."""

    name: str
    type: TensorType
    first: int
    last: int
    alias: str | None = None
    weight_view: bool = False          # a view of a parameter or buffer of the module: no activation storage
    reuses: str | None = None          # written in place of this buffer (dead after the launch that defines it)


@dataclass
class KernelProgram:
    """The program a compiled module executes: launches in order and the buffer table (see :func:`lower`)."""

    name: str
    target: str
    symbols: tuple
    launches: list[Launch]
    buffers: dict[str, Buffer] = field(default_factory=dict)
    training: bool = False
    groups: dict[str, str] = field(default_factory=dict)     # fusion group anchor -> description
    memo: dict = field(default_factory=dict, repr=False, compare=False)   # memory plans by sizes (backends/memory.py)

    def text(self) -> str:
        mode = "training (autograd records: every op with its backward)" if self.training else "inference"
        lines = [f"// {mode}: the launches the runtime makes, in order. 'ops': the graph ops one fused launch computes;",
                 "// 'free': buffers dead after that launch (dropped at once when autograd does not record); views",
                 "// (view.*) share their input's storage and launch nothing; 'in place of %x': the output is written",
                 "// into the storage of operand %x, whose last use that launch is; 'not': implementations earlier",
                 "// in the target's chain that do not take the op, and why.",
                 f"kernels {self.name}({', '.join(self.symbols)}) target={self.target} {{"]
        seen = set()
        for L in self.launches:
            if L.group is not None and L.group not in seen and L.group in self.groups:
                seen.add(L.group)
                lines.append(f"  // fusion group %{L.group}: {self.groups[L.group]}")
            lines += ["  " + ln for ln in L.text().splitlines()]
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
        """Launches per implementation (views excluded)."""
        out: dict[str, int] = {}
        for L in self.launches:
            if not L.is_view:
                out[L.kernel] = out.get(L.kernel, 0) + 1
        return out

    def memory(self, bind: dict, elem_bytes, workspace=None) -> tuple[float, float]:
        """(peak bytes of live buffers, peak bytes with the largest launch workspace) of one run at the shape
        sizes ``bind`` ({Symbol: int}): the runtime's walk (graph inputs live from the start, each launch's new
        storages added, a storage dropped once no live buffer refers to it; views share their input's).
        ``elem_bytes(type)``: bytes per element as the runtime stores that value; ``workspace(launch)``: bytes a
        launch allocates inside itself (or None)."""
        size: dict = {}

        def nbytes(b: Buffer) -> float:
            if b.weight_view:
                return 0.0
            hit = size.get(b.name)
            if hit is None:
                n = sympy.Mul(*b.type.shape).subs(bind) if b.type.shape else sympy.Integer(1)
                hit = size[b.name] = float(n) * elem_bytes(b.type)
            return hit

        refs: dict[str, int] = {}           # storage owner -> live buffers referring to it
        live = peak = peak_ws = 0.0

        def hold(name):
            nonlocal live
            s = self.storage_of(name)
            if refs.get(s, 0) == 0:
                live += nbytes(self.buffers[s])
            refs[s] = refs.get(s, 0) + 1

        for b in self.buffers.values():
            if b.first == -1:
                hold(b.name)
        peak = live
        for L in self.launches:
            for r, _t in L.outputs:
                hold(r)
            peak = max(peak, live)
            if workspace is not None:
                peak_ws = max(peak_ws, live + workspace(L))
            for r in L.frees:
                s = self.storage_of(r)
                refs[s] -= 1
                if refs[s] == 0:
                    live -= nbytes(self.buffers[s])
        return peak, max(peak, peak_ws)

    def storage_of(self, name: str) -> str:
        """The buffer that owns the storage of buffer ``name`` (itself unless it is a view or written in place)."""
        b = self.buffers[name]
        while b.alias is not None or b.reuses is not None:
            b = self.buffers[b.alias if b.alias is not None else b.reuses]
        return b.name

    def inplace_count(self) -> int:
        """The number of launch outputs written in place of an input."""
        return sum(len(L.inplace) for L in self.launches)


def _cdiv(a, b) -> sympy.Expr:
    return sympy.ceiling(as_expr(a) / b)


def _groups(g: Graph) -> tuple[dict[str, list[Node]], list[str]]:
    """The fusion groups of fuse_tiles (key: the anchor) and the pointwise chains of single-use producers outside
    them (key: the chain's last op), in the order of each group's last member."""
    nodes = g.node_map()
    users = g.users()
    outputs = set(g.outputs)
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
    pos = {n.name: i for i, n in enumerate(g.nodes)}
    return members, sorted(members, key=lambda k: pos[members[k][-1].name])


def _group_outputs(ms: list[Node], g: Graph, users) -> list[tuple[str, TensorType]]:
    """The values of ``ms`` used outside them (or graph outputs)."""
    names = {m.name for m in ms}
    outputs = set(g.outputs)
    outs = []
    for m in ms:
        for i, t in enumerate(m.types):
            r = Ref(m.name, i)
            if r in outputs or any(u not in names for u in users[m.name]):
                outs.append((str(r), t))
    return outs


def _describe(anchor: Node, ms: list[Node]) -> str:
    from collections import Counter
    pos = {m.name: i for i, m in enumerate(ms)}
    a = pos[anchor.name]

    def part(xs):
        c = Counter(m.op for m in xs if m.op not in VIEWS)
        return ", ".join(f"{op} x{k}" if k > 1 else op for op, k in c.items()) or "nothing"
    return f"{anchor.op}; prologue {part(ms[:a])}; epilogue {part(ms[a + 1:])}"


def lower(g: Graph, target: str = "triton", *, training: bool = False, inplace: bool = True) -> KernelProgram:
    """Lower a fused graph (after fuse_tiles) to the program a compiled module executes.

    Each op runs on the first implementation of the target's chain (backends/registry.py) that accepts it; on
    target "triton" without ``training``, these fuse into one launch each: the elementwise / row-norm chains and
    the template epilogues the generator covers (backends/triton/codegen.py: one generated kernel), KDA's
    short_conv -> silu [-> l2norm] prologues (conv_silu_norm), and an AttnRes read with the RMSNorm of its
    output (the kernel's output norm). ``training``: the program autograd records through, every op on its own
    with an implementation that has a backward. Launches run in the graph's order of the node that triggers
    them; the buffer table records each value's definition and last use.

    ``inplace`` (the program without autograd only): a launch writes an output into the storage of an input whose
    last use it is, where its implementation declares it can (``@impl(..., inplace=)``; a generated kernel: any row
    operand, each program reading its rows before it writes them) and :func:`_takes_storage` finds it safe; the
    listing prints ``in place of %x`` and the memory plan counts that storage once.

    Raises MtcError for an op no implementation of the chain takes (at the op's source location)."""
    from backends.registry import resolve
    from dsl.errors import MtcError
    nodes = g.node_map()
    users = g.users()
    types = {Ref(n.name, i): t for n in g.nodes for i, t in enumerate(n.types)}
    if target == "triton":
        # the accumulator as the Triton phase 1 stores it (the memory plan counts it so too, plan_memory._two_phase)
        for n in g.nodes:
            if n.op == "attn_residual_phase1":
                types[Ref(n.name, 0)] = TensorType(phase1_acc_dtype(types[n.inputs[-1]].dtype), n.types[0].shape)
    fuse = target == "triton" and not training
    members, order = _groups(g)
    pos = {n.name: i for i, n in enumerate(g.nodes)}
    groups = {k: _describe(nodes[k], ms) for k, ms in members.items()
              if fuse and k in nodes and nodes[k].attr("fusion") == k and len(ms) > 1}

    # -- the fused launches (target triton, inference) -----------------------------------------------------
    gen_at: dict[str, object] = {}          # last member -> GeneratedKernel
    gen_skip: set[str] = set()              # the other members of a generated kernel
    chains: dict[str, list[str]] = {}
    norm_at: dict[str, Node] = {}
    if fuse:
        from backends.triton.codegen import plan_kernel, same_body
        norm_epis = norm_epilogues(g)
        for key in order:
            ms = members[key]
            anchored = key in nodes and nodes[key].attr("fusion") == key
            if not anchored and nodes[key].op not in GEMMS and all(m.op in CODEGEN_OPS or m.op in VIEWS for m in ms):
                k = plan_kernel(len(gen_at), [m.name for m in ms], _group_outputs(ms, g, users), g)
            elif anchored:
                epi = [m for m in ms if pos[m.name] > pos[key]]
                if not all(m.op in CODEGEN_OPS or m.op == "reshape" for m in epi):
                    continue
                if nodes[key].op in CODEGEN_OPS:    # a pointwise anchor (SiTU-GLU after its GEMMs): it and its epilogue
                    epi = [nodes[key]] + epi
                if not any(m.op not in VIEWS for m in epi):
                    continue
                if key in norm_epis and [m.op for m in epi if m.op not in VIEWS] == ["rmsnorm"]:
                    continue                # the AttnRes kernel's own output norm takes it
                k = plan_kernel(len(gen_at), [m.name for m in epi], _group_outputs(ms, g, users), g, prefix="ep")
                if k is None:
                    raise ValueError(f"lower: the epilogue of %{key} ({' -> '.join(m.op for m in epi)}) fits the "
                                     f"generator's ops but it cannot build a kernel for it")
            else:
                continue
            if k is not None:
                twin = next((o for o in gen_at.values() if same_body(o, k)), None)
                if twin is not None:        # one jit function serves launches of one body
                    k.source = twin.source
                    k.name = twin.name
                gen_at[k.members[-1]] = k
                gen_skip.update(k.members[:-1])
        chains = conv_chains(g)
        norm_at = {a: c for a, c in norm_epilogues(g).items() if c.name not in gen_at and c.name not in gen_skip}

    # -- the launches, in the graph order of the node that triggers each -----------------------------------
    launches: list[Launch] = []
    done: set[str] = set()

    cands: dict[int, tuple] = {}            # launch index -> ((output index, (input indices)), ...) it may overwrite

    def add(kernel, op, anchor, ms, ins, outs, inplace=(), **kw):
        if inplace:
            cands[len(launches)] = inplace
        launches.append(Launch(len(launches), kernel, op, anchor.name, [m.name for m in ms], [m.op for m in ms],
                               ins, outs, group=anchor.attr("fusion"), **kw))

    def ref_types(refs):
        return [(str(r), types[r]) for r in refs]

    for n in g.nodes:
        if n.op in SOURCE_OPS or n.name in gen_skip or n.name in done:
            continue
        if n.name in gen_at:
            k = gen_at[n.name]
            ms = [nodes[x] for x in k.members]
            ins = [(r, types[_parse_ref(r)]) for r in k.inputs]
            outs = [(r, types[_parse_ref(r)]) for r in k.outputs]
            D = int(k.width)
            block_d = 1 << max(0, D - 1).bit_length()
            rows = max(1, TILE_ELEMS // block_d)
            n_rows = sympy.Mul(*types[_parse_ref(k.outputs[0])].shape) / D
            # each program loads its rows of every operand before it stores its outputs' (codegen.plan_kernel), and
            # a row operand and an output share the flat [rows, D] offsets: any row operand may take an output
            rows_in = tuple(i for i, row in enumerate(k.row_inputs) if row)
            add(f"generated.{k.name}", "pointwise", ms[-1], ms, ins, outs, generated=k,
                meta={"BLOCK_D": block_d, "ROWS": rows}, grid=[_cdiv(n_rows, rows)],
                inplace=tuple((j, rows_in) for j in range(len(outs))))
            continue
        if n.name in chains:
            ms = [nodes[x] for x in chains[n.name]]
            done.update(chains[n.name][1:])
            add("triton.conv_silu_norm", "conv_silu_norm", n, ms, ref_types(n.inputs), ref_types([ms[-1].out()]))
            continue
        if n.name in norm_at:
            c = norm_at[n.name]
            done.add(c.name)
            add(f"triton.{n.op}+rmsnorm", f"{n.op}+rmsnorm", n, [n, c], ref_types(list(n.inputs) + [c.inputs[1]]),
                ref_types([c.out()]))
            continue
        in_t = [types[r] for r in n.inputs]
        chosen, refused = resolve(target, n, in_t, training=training)
        if chosen is None:
            from dsl.ops import OPS
            od = OPS.get(n.op)
            hint = (" (a layer block: the pass pipeline lacks 'canonicalize', which expands layer blocks into "
                    "primitive ops; passes='default' has it)" if od is not None and od.is_layer else "")
            raise MtcError(f"target '{target}' has no kernel for op '{n.op}'{hint}"
                           + (f"; none of its implementations takes this node ({'; '.join(refused)})" if refused
                              else ""), n.loc)
        meta = chosen.meta(n, in_t) if chosen.meta is not None else {}
        aliases = {0: 0} if chosen.name.startswith("view.") else (
            chosen.aliases(n, in_t) if chosen.aliases is not None else {})
        add(chosen.name, n.op, n, [n], ref_types(n.inputs), ref_types([n.out(i) for i in range(len(n.types))]),
            meta=meta, refused=refused, aliases=aliases, inplace=chosen.inplace)

    # -- buffers: definition, last use, storage ------------------------------------------------------------
    buffers: dict[str, Buffer] = {}
    for n in g.inputs():
        buffers[str(n.out())] = Buffer(str(n.out()), n.type, -1, -1)
    for L in launches:
        for r, _t in L.inputs:
            if r in buffers:
                buffers[r].last = L.index
        for j, (r, t) in enumerate(L.outputs):
            src = L.inputs[L.aliases[j]][0] if j in L.aliases else None
            buffers[r] = Buffer(r, t, L.index, L.index, alias=src if src in buffers else None,
                                weight_view=src is not None and (src not in buffers or buffers[src].weight_view))
    for r in g.outputs:
        buffers[str(r)].last = len(launches)
    for b in buffers.values():
        if 0 <= b.last < len(launches):
            launches[b.last].frees.append(b.name)
        elif b.last == -1:                  # a graph input no launch reads
            pass
    program = KernelProgram(g.name, target, g.symbols, launches, buffers, training, groups)
    if inplace and not training:
        _plan_inplace(program, cands)
    return program


def _plan_inplace(program: KernelProgram, cands: dict[int, tuple]) -> None:
    """Mark the outputs the launches write in place of an input (Launch.inplace, Buffer.reuses), in launch order;
    ``cands``: the outputs each launch may write so and the inputs it may take for each."""
    buffers = program.buffers
    sharing: dict[str, list[str]] = {}      # storage owner -> the buffers whose storage it is
    for b in buffers.values():
        sharing.setdefault(program.storage_of(b.name), []).append(b.name)
    for L in program.launches:
        taken: set[int] = set()
        for j, ins in cands.get(L.index, ()):
            if j >= len(L.outputs) or j in L.aliases or j in L.inplace:
                continue
            o = buffers[L.outputs[j][0]]
            if o.alias is not None or o.weight_view:
                continue
            for i in ins:
                if i < len(L.inputs) and i not in taken and _takes_storage(program, sharing, L, i, o):
                    L.inplace[j] = i
                    taken.add(i)
                    r = L.inputs[i][0]
                    o.reuses = r
                    s = program.storage_of(r)
                    sharing[s] += sharing.pop(o.name, [])
                    break


def _takes_storage(program: KernelProgram, sharing: dict, L: Launch, i: int, o: Buffer) -> bool:
    """Whether launch ``L`` may write output buffer ``o`` into the storage of its input ``i``: that input is a value
    of the program (no graph input, parameter or buffer of the module, nor a view of one), its last use is ``L``
    and it is no graph output, it has ``o``'s dtype and number of elements (and shape, for a registered
    implementation, which gets it as ``out``), it is its storage itself or reshapes of it (a dense layout: no
    slice or broadcast), no other operand of ``L`` shares that storage, and every other buffer sharing it is dead
    before ``L``."""
    buffers = program.buffers
    r, rt = L.inputs[i]
    b = buffers.get(r)
    if b is None or b.last != L.index or b.first < 0 or b.weight_view:
        return False
    if rt.dtype != o.type.dtype or sympy.expand(sympy.Mul(*rt.shape) - sympy.Mul(*o.type.shape)) != 0:
        return False
    if L.generated is None and tuple(rt.shape) != tuple(o.type.shape):
        return False
    x = b
    while x.alias is not None or x.reuses is not None:
        if x.alias is not None:
            if program.launches[x.first].kernel != "view.reshape":
                return False
            x = buffers[x.alias]
        else:
            x = buffers[x.reuses]
    if x.first < 0 or x.weight_view:
        return False
    s = x.name
    if any(k != i and ref in buffers and program.storage_of(ref) == s for k, (ref, _t) in enumerate(L.inputs)):
        return False
    return all(name == r or buffers[name].last < L.index for name in sharing.get(s, ()))


def _parse_ref(text: str) -> Ref:
    name, _, idx = text.lstrip("%").partition("#")
    return Ref(name, int(idx or 0))


TILE_ELEMS = 4096            # elements of one generated kernel program's [ROWS, BLOCK_D] tile (codegen.launch_config)
