"""sm_90 PTX of every kernel that kda_chunk / kda_gate / kda_step launch by default, compiled without a GPU.

Compiles each kernel of backends/triton/kda at the signatures and launch options its default launch paths use
(bfloat16, float16 and float32 inputs, K = V = 128 and 64, the dense and the safe gate, with and without autograd,
head-major and chunk-major grids, the state pass at 16 / 32 / 64 columns, the pipelined forward's fused pass, the
backward's kernels), writes one .ptx file per launch into OUT_DIR, and compares two such directories with
debug labels, the kernel name and parameter names normalised away (parameters are named by their argument
names, so a removed unused argument shows as a missing declaration, not as a renumbered body).

Usage (TRITON_INTERPRET must be 0 in this process; no GPU is needed):
  python benchmarks/ptx_snapshot.py dump OUT_DIR [--only SUBSTRING]
  python benchmarks/ptx_snapshot.py compare DIR_BEFORE DIR_AFTER

The kernel names before the package split (commit 910e91b, backends/triton/kda.py) are looked up as well, so
the same script dumps the old tree for a before/after comparison.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pkgutil
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# role -> kernel names (the name since the split first, then the name in backends/triton/kda.py before it)
KERNELS = {
    "cumsum": ("_chunk_cumsum_kernel",),
    "strip16": ("_intra_strip16_kernel", "_fwd_strip5_kernel"),
    "strip32": ("_intra_strip32_kernel", "_fwd_strip32_kernel"),
    "solve": ("_wy_solve_kernel", "_fwd_solve4_kernel"),
    "wu": ("_wy_apply_kernel", "_fwd_wu_kernel"),
    "state": ("_state_pass_kernel", "_fwd_h_kernel"),
    "output": ("_output_kernel", "_fwd_o_kernel"),
    "combine": ("_combine_kernel",),
    "bwd_segmap": ("_bwd_segment_map_kernel", "_bwd_state_kernel"),
    "bwd_chain": ("_bwd_state_chain_kernel", "_bwd_dh_kernel"),
    "bwd_chunk": ("_bwd_chunk_kernel",),
    "bwd_ut": ("_bwd_ut_kernel",),
    "bwd_pair": ("_bwd_pair_kernel",),
    "gate": ("_gate_kernel",),
    "step": ("_step_kernel",),
}

PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
I32P, F32P = "*i32", "*fp32"


def _kernel(role):
    mods = [importlib.import_module("backends.triton.kda")]
    pkg = mods[0]
    if hasattr(pkg, "__path__"):
        mods += [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]
    for name in KERNELS[role]:
        for m in mods:
            if hasattr(m, name):
                return getattr(m, name)
    raise LookupError(f"no kernel for role {role!r} (tried {KERNELS[role]})")


def _tl_dtype(dt):
    import triton.language as tl
    return {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dt]


# the KdaConfig defaults the launches below are written for (dump warns when the tree's defaults differ)
DEFAULTS = dict(bk=64, nw_strip=8, bk_strip32=32, nw_strip32=4, maxnreg_strip32=128, nw_cumsum=4, cumsum_slices=2,
                nw_solve=1, solve_prec="tf32x3", solve_prec_fwd="tf32", nw_wu=4, state_warps=4, state_stages=2,
                stages_one_wave=3, pipe_bv=32, bwd_chain_warps=4, bwd_chain_stages=1, bwd_ut_warps=8,
                bwd_pair_bk=32, bwd_pair_warps=4, bwd_chunk_kv=128 * 128)


def _check_defaults():
    kda = importlib.import_module("backends.triton.kda")
    if not hasattr(kda, "KdaConfig"):
        return                                               # (the tree before the split: module dicts)
    cfg = kda.KdaConfig()
    moved = {k: (v, getattr(cfg, k, None)) for k, v in DEFAULTS.items() if getattr(cfg, k, None) != v}
    if moved:
        print(f"ptx_snapshot: warning: KdaConfig's defaults differ from the ones these launches are written for "
              f"(field: (here, KdaConfig)): {moved}", file=sys.stderr)


def launches():
    """(label, role, {arg: type or ("c", constexpr value)}, {num_warps, num_stages, maxnreg}) of the default
    launch paths (the launch settings of KdaConfig() as of the split; the arguments every path passes)."""
    out = []

    def add(label, role, args, nw, ns, maxnreg=None):
        opts = dict(num_warps=nw, num_stages=ns)
        if maxnreg is not None:
            opts["maxnreg"] = maxnreg
        out.append((label, role, args, opts))

    seg = dict(seg_t0=I32P, seg_t1=I32P, seg_c0=I32P, seg_c1=I32P)
    combos = [(dt, KV, fast, grad) for dt in ("bf16", "fp32") for KV in (128, 64) for fast in (True, False)
              for grad in (False, True)]
    combos += [("fp16", 128, fast, grad) for fast in (True, False) for grad in (False, True)]
    for dt, KV, fast, grad in combos:
        K = V = KV
        P = PTR[dt]
        DT = ("c", _tl_dtype(dt))
        rows32 = fast and dt != "fp16"
        ns = 2 if K >= 32 else 1                                     # cumsum channel slices (_cumsum_slices)
        nb = F32P if grad or dt == "fp32" else "*bf16"               # N between strip and solve
        tb = F32P if grad else P                                     # T between solve and w/u
        bm = F32P if grad else nb                                    # BM (= NBUF unless autograd keeps it)
        tag = f"{dt}_K{K}_{'fast' if fast else 'safe'}_{'grad' if grad else 'nograd'}"
        for hm in ((True, False) if (dt, K, fast) == ("bf16", 128, True) else (True,)):
            t = tag + ("" if hm else "_chunkmajor")
            add(f"cumsum_{t}", "cumsum", dict(g=F32P, cstart=I32P, clen=I32P, GCS=F32P, FB=I32P, lb="fp32", H="i32",
                                              K=("c", K), FAST=("c", fast), ROWS32=("c", rows32), NS=("c", ns),
                                              HM=("c", hm)), 4, 1)
            strip = dict(q=P, k=P, GCS=F32P, FB=I32P, beta=P, cstart=I32P, clen=I32P, NB=nb, QG=P, KD=P, AQK=P,
                         GAM=F32P, scale="fp32", H="i32", K=("c", K), DT=DT, NS=("c", ns), BM=bm,
                         SAVE_B=("c", grad), KGB=P, WRITE_KGB=("c", True), LIM_ROWS=("c", True), FTZ=("c", True))
            if rows32:
                add(f"strip32_{t}", "strip32", dict(strip, HM=("c", hm), BK=("c", min(K, 32))), 4, 1, maxnreg=128)
            elif hm:                                                 # (no head-major form)
                add(f"strip16_{t}", "strip16", dict(strip, BK=("c", min(K, 64)), R_FAST=("c", True)), 8, 1)
            add(f"solve_{t}", "solve", dict(NB=nb, cstart=I32P, clen=I32P, TB=tb, H="i32",
                                            PREC=("c", "tf32x3" if grad else "tf32"), HM=("c", hm)), 1, 1)
            add(f"wu_{t}", "wu", dict(k=P, KGB=P, v=P, g=F32P, beta=P, cstart=I32P, clen=I32P, TB=tb, WK=P, U=P,
                                      H="i32", K=("c", K), V=("c", V), DT=DT, CUMSUM=("c", True),
                                      KGB_IN=("c", True), HM=("c", hm)), 4, 1)
            if not grad:
                add(f"output_{t}", "output", dict(QG=P, AQK=P, VN=P, HB=P, O=P, cstart=I32P, clen=I32P, H="i32",
                                                  K=("c", K), V=("c", V), BV=("c", min(V, 128)), HM=("c", hm)), 4, 1)
            if grad:
                add(f"bwd_chunk_{t}", "bwd_chunk", dict(
                    WK=P, U=P, QG=P, AQK=P, DO=P, HB=P, DHB=P, DU=P, DWK=P, DQG=P, DKD=P, DAQK=F32P, cstart=I32P,
                    clen=I32P, H="i32", K=("c", K), V=("c", V), BVC=("c", min(V, max(16, 16384 // K))),
                    HM=("c", hm)), 8, 1)
                add(f"bwd_ut_{t}", "bwd_ut", dict(
                    k=P, v=P, g=F32P, beta=P, cstart=I32P, clen=I32P, TB=F32P, BM=F32P, DU=P, DWK=P, DB=F32P,
                    DKG=F32P, dv_=P, dbeta=P, H="i32", K=("c", K), V=("c", V), DT=DT, HM=("c", hm)), 8, 1)
                for safe in ((False, True) if fast else (True,)):
                    add(f"bwd_pair_{t}_{'safe' if safe else 'dense'}", "bwd_pair", dict(
                        q=P, k=P, g=F32P, beta=P, cstart=I32P, clen=I32P, DKG=F32P, DB=F32P, DAQK=F32P, DQG=P, DKD=P,
                        DGAM=F32P, dq=P, dk_=P, dg=F32P, scale="fp32", lb="fp32", H="i32", K=("c", K),
                        BK=("c", min(K, 32)), FAST=("c", fast), DT=DT, SAFE=("c", safe), HM=("c", hm)), 4, 1)
        if not fast:
            continue                                # the passes below do not depend on the gate
        state = dict(WK=P, U=P, KD=P, GAM=F32P, H="i32", K=("c", K), V=("c", V), **seg)
        bvs = (16, 32, 64) if (dt, K) == ("bf16", 128) else (min(V, 32),)
        for bv in bvs:
            for st in (2, 3):
                t = f"{dt}_K{K}_bv{bv}_st{st}"
                if not grad:
                    add(f"state_fwd_{t}", "state", dict(state, VN=P, HB=P, S_IN=F32P, S_OUT=F32P, BV=("c", bv),
                                                        SW=("c", V), MODE=("c", 0), STORE=("c", True),
                                                        STORE_VN=("c", True)), 4, st)
                    b1 = min(bv, K)
                    add(f"state_segmap_{dt}_K{K}_bv{b1}_st{st}", "state", dict(
                        state, VN=F32P, HB=F32P, S_IN=F32P, S_OUT=F32P, BV=("c", b1), SW=("c", K + V),
                        MODE=("c", 1), STORE=("c", False), STORE_VN=("c", False)), 4, st)
                else:
                    add(f"state_bwd_{t}", "state", dict(state, VN=P, HB=P, S_IN=F32P, S_OUT=F32P, BV=("c", bv),
                                                        SW=("c", V), MODE=("c", 0), STORE=("c", True),
                                                        STORE_VN=("c", False)), 4, st)
            if grad:
                add(f"bwd_chain_{dt}_K{K}_bv{bv}", "bwd_chain", dict(
                    QG=P, WK=P, KD=P, AQK=P, GAM=F32P, DO=P, HB=P, DS_END=F32P, DHB=P, DU=P, DGP=F32P, DS_OUT=F32P,
                    H="i32", K=("c", K), V=("c", V), BV=("c", bv), **seg), 4, 1)
            for init in (True, False):
                add(f"combine_{dt}_K{K}_bv{bv}_{'init' if init else 'noinit'}_{'rev' if grad else 'fwd'}", "combine",
                    dict(MD=F32P, S_INIT=F32P, S_ENTRY=F32P, S_FIN=F32P, seq_s0=I32P, seq_s1=I32P, H="i32",
                         K=("c", K), V=("c", V), BV=("c", bv), HAS_INIT=("c", init), REVERSE=("c", grad),
                         PREC=("c", "tf32x3")), 8, 3)
        if not grad:
            bv = min(V, 32)
            add(f"state_pipelined_{dt}_K{K}", "state", dict(
                state, VN=P, HB=P, S_IN=F32P, S_OUT=F32P, BV=("c", bv), SW=("c", V), MODE=("c", 0),
                STORE=("c", False), STORE_VN=("c", False), QG=P, AQK=P, O=P, FUSE_O=("c", True),
                MERGE_WQ=("c", True)), 4, 3)
        else:
            ba = 64 if (K + V) % 64 == 0 else None
            mds = {n: F32P for n in ("HBUF", "DS_END", "DS_OUT", "DU", "DWK", "DQG", "DKD", "DAQK", "DGAM")}
            add(f"bwd_segmap_{dt}_K{K}", "bwd_segmap", dict(
                WK=P, U=P, QG=P, KD=P, AQK=P, GAM=F32P, DO=P, MD=F32P, **mds, cstart=I32P, clen=I32P, seg_c0=I32P,
                seg_c1=I32P, H="i32", K=("c", K), V=("c", V), BV=("c", ba), SW=("c", K + V), MODE=("c", 1)), 4, 2)
    for xdt in ("bf16", "fp32"):
        for K in (128, 64, 24):
            kp = 1 << (K - 1).bit_length()
            for sp in (False, True):
                add(f"gate_{xdt}_K{K}_{'softplus' if sp else 'sigmoid'}", "gate", dict(
                    x=PTR[xdt], A_log=F32P, dt_bias=F32P, g=F32P, n_rows="i32", H="i32", lb="fp32", K=("c", K),
                    BR=("c", 32), SOFTPLUS=("c", sp), KP=("c", kp)), 4, 3)
    for dt in ("bf16", "fp32"):
        for K, V in ((128, 128), (64, 64), (24, 40)):
            P = PTR[dt]
            add(f"step_{dt}_K{K}_V{V}", "step", dict(
                q=P, k=P, v=P, g=F32P, beta=P, S_in=F32P, S_out=F32P, o=P, scale="fp32", K=("c", K), V=("c", V),
                BV=("c", min(64, 1 << (V - 1).bit_length())), KP=("c", 1 << (K - 1).bit_length())), 4, 3)
    return out


def _source(fn, args):
    """ASTSource of fn for the argument types / constexprs args (unknown names are dropped: an argument one tree
    has and the other has not), every other parameter at its default, as the launcher binds it."""
    from triton.compiler import ASTSource
    params = inspect.signature(fn.fn).parameters
    sig, consts, attrs = {}, {}, {}
    for i, (name, p) in enumerate(params.items()):
        if name in args:
            a = args[name]
        elif p.default is not inspect.Parameter.empty:
            d = p.default
            a = ("c", d.value if hasattr(d, "value") else d)
        else:
            raise TypeError(f"{fn.__name__}: no type for argument {name!r}")
        if isinstance(a, tuple):
            sig[name] = "constexpr"
            consts[name] = a[1]
        else:
            sig[name] = a
            if a.startswith("*") or name == "H":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, sig, consts, attrs)


def dump(out_dir, only=None):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("ptx_snapshot: run with TRITON_INTERPRET=0 (the interpreter compiles nothing)")
    import triton
    from triton.backends.compiler import GPUTarget
    os.makedirs(out_dir, exist_ok=True)
    _check_defaults()
    todo = [x for x in launches() if only is None or only in x[0]]
    t00 = time.time()
    for n, (label, role, args, opts) in enumerate(todo, 1):
        path = os.path.join(out_dir, label + ".ptx")
        if os.path.exists(path):
            continue
        fn = _kernel(role)
        t0 = time.time()
        ck = triton.compile(_source(fn, args), target=GPUTarget("cuda", 90, 32), options=opts)
        names = [a for a in inspect.signature(fn.fn).parameters
                 if a in args and not isinstance(args[a], tuple)]
        with open(path + ".tmp", "w") as f:
            f.write(f"// role {role} kernel {fn.__name__} options {opts}\n// params {' '.join(names)}\n")
            f.write(ck.asm["ptx"])
        os.replace(path + ".tmp", path)
        print(f"[{n}/{len(todo)}] {label}: {time.time() - t0:.1f} s (total {time.time() - t00:.0f} s)", flush=True)


# arguments renamed at the split (role -> {name before: name after}), so that their loads compare equal
PARAM_RENAMES = {"wu": {"k": "KGB"}}


def normalise(text):
    """(parameter declarations, instruction lines) of a dumped .ptx with the kernel name, parameter numbers and
    debug information taken out."""
    lines = text.splitlines()
    role = lines[0].split()[2]
    params = [PARAM_RENAMES.get(role, {}).get(p, p) for p in lines[1].split()[2:]]
    body = "\n".join(lines[2:])
    body = body.split("\t.section\t.debug", 1)[0]
    m = re.search(r"\.entry (\w+)\(", body)
    kname = m.group(1)
    body = re.sub(rf"{kname}_param_(\d+)",
                  lambda g: "P:" + (params[int(g.group(1))] if int(g.group(1)) < len(params)
                                    else f"scratch{int(g.group(1)) - len(params)}"), body)
    body = body.replace(kname, "KERNEL")
    decl, inst = [], []
    for ln in body.splitlines():
        s = ln.strip()
        if not s or s.startswith(("//", ".loc", ".file")):
            continue
        if s.startswith(".param") and "P:" in s:
            decl.append(s.rstrip(","))
        else:
            inst.append(s)
    return decl, inst


def canonical(inst):
    """The instruction lines with every parameter load (ld.param: a side-effect-free read of an argument) replaced
    by the argument itself at its uses and the virtual registers renumbered by first use: equal for two kernels
    that differ only in where the compiler placed the parameter loads (as removing an unused argument moves them)
    and in register numbering."""
    alias = {}
    rest = []
    for ln in inst:
        m = re.match(r"ld\.param\.\S+\s+(%\w+), \[P:(\w+)\];$", ln)
        if m:
            alias[m.group(1)] = f"@{m.group(2)}"
        else:
            rest.append(ln)
    names, counts = {}, {}

    def ren(m):
        r = m.group(0)
        if r in alias:
            return alias[r]
        if r not in names:
            cls = m.group(1)
            counts[cls] = counts.get(cls, 0) + 1
            names[r] = f"%{cls}#{counts[cls]}"
        return names[r]
    return [re.sub(r"%([a-z]+)\d+\b", ren, ln) for ln in rest]


def sass(ptx_path):
    """The SASS instruction lines of a dumped .ptx (triton's bundled ptxas and cuobjdump, the .ptx's own target
    architecture) with the kernel parameters' constant-bank offsets (c[0x0][...], which move when an argument is
    removed) taken out, and ptxas's register count; None where the tools are missing."""
    import shutil
    import subprocess
    import tempfile
    import triton
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas, objdump = os.path.join(bin_dir, "ptxas"), os.path.join(bin_dir, "cuobjdump")
    if not (os.path.exists(ptxas) and os.path.exists(objdump)):
        return None
    text = open(ptx_path).read().split("\n", 2)[2]
    arch = re.search(r"^\.target (sm_\w+)", text, re.M).group(1)
    tmp = tempfile.mkdtemp()
    try:
        src, cub = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(text)
        r = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", cub], capture_output=True, text=True, check=True)
        regs = re.search(r"Used (\d+) registers", r.stdout + r.stderr).group(1)
        out = subprocess.run([objdump, "-sass", cub], capture_output=True, text=True, check=True).stdout
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ins = [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][PARAM]", re.sub(r"/\*[0-9a-f]+\*/", "", ln).split(";")[0].strip())
           for ln in out.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    return regs, ins


def compare(a, b):
    names = sorted(set(os.listdir(a)) | set(os.listdir(b)))
    same = moved = differ = 0
    for n in names:
        if not n.endswith(".ptx"):
            continue
        if not (os.path.exists(os.path.join(a, n)) and os.path.exists(os.path.join(b, n))):
            print(f"{n}: only in {'the first' if os.path.exists(os.path.join(a, n)) else 'the second'}")
            differ += 1
            continue
        da, ia = normalise(open(os.path.join(a, n)).read())
        db, ib = normalise(open(os.path.join(b, n)).read())
        extra = sorted(("-" if d in da else "+") + d.split("P:")[1] for d in set(da) ^ set(db))
        if ia == ib:
            same += 1
            if extra:
                print(f"{n}: instructions identical; parameter declarations differ: {extra}")
        elif canonical(ia) == canonical(ib):
            moved += 1
            sa, sb = sass(os.path.join(a, n)), sass(os.path.join(b, n))
            how = ("" if sa is None or sb is None else
                   f"; sm_90a SASS {'identical' if sa == sb else 'DIFFERENT'} up to parameter offsets "
                   f"({sa[0]} / {sb[0]} registers, {len(sa[1])} / {len(sb[1])} instructions)")
            print(f"{n}: PTX identical up to the placement of the parameter loads and register numbering{how}"
                  + (f"; parameters removed / added: {' '.join(extra)}" if extra else ""))
            differ += sa is not None and sb is not None and sa != sb
        else:
            differ += 1
            import difflib
            d = list(difflib.unified_diff(ia, ib, lineterm="", n=1))
            print(f"{n}: DIFFERENT ({len(d)} diff lines)\n  " + "\n  ".join(d[:40]))
    print(f"{same} identical, {moved} identical up to parameter-load placement and register numbering, {differ} "
          f"different or missing")
    return 1 if differ else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out_dir")
    d.add_argument("--only", default=None, help="only the launches whose label contains this")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args()
    if args.cmd == "dump":
        dump(args.out_dir, args.only)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
