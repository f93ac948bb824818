"""PTX snapshot of the default attn_residual and MoE Triton kernels (sm_90), and the TVMScript of the default TVM
kernels, to check that a cleanup of those modules leaves the code that runs unchanged (CPU only: no GPU needed).

    python benchmarks/ptx_snapshot_rest.py --out /tmp/g-ptx-before        # before the change
    python benchmarks/ptx_snapshot_rest.py --out /tmp/g-ptx-after         # after it
    python benchmarks/ptx_snapshot_rest.py --compare /tmp/g-ptx-before /tmp/g-ptx-after

Each case compiles one kernel for GPUTarget("cuda", 90, 32) at the constexpr settings and argument types its
launcher uses by default (bf16 and float32 where the kernel takes both; d = 7168 and a small d), with pointers and
16-divisible integers specialised as the JIT does on the GPU. A kernel is found by its current name or its former
one (kernels were renamed by role); constexprs and arguments the kernel no longer has are dropped (a deleted
setting is pinned to its default value, the one the case passes). The written PTX is normalised: no debug lines
(.loc, .file, debug sections), the kernel's name replaced by KERNEL, each parameter reference `<name>_param_<i>` by
the argument's name, so that a renamed kernel or a removed unused argument shows only in the parameter list.
TVM cases: the unscheduled TVMScript (llvm and cuda texts), the schedule parameters and pass config, and the text
after the llvm and the cuda schedule. TRITON_INTERPRET must be unset (it is removed for this process)."""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BF, F32 = "*bf16", "*fp32"


def _case(name, module, names, sig, consts, nw, ns=None, div=()):
    return dict(name=name, module=module, names=names, sig=sig, consts=consts, nw=nw, ns=ns, div=div)


# ------------------------------------------------------------------------------------------------ attn_residual
def _attn_cases():
    AR = "backends.triton.attn_residual"
    out = []
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        fsig = dict(base=p, offs="*i64", q_buf=F32, w_buf=F32, ow=F32, out=p, logit_buf=F32, lse_buf=F32,
                    N="i32", L="i32", eps="fp32", TPP="i32")
        # the row kernel: tiles under 2048 elements (d = 48: 16 rows of 64; d = 1000 at one row) and the interpreter
        for d, bt, bd in ((48, 16, 64), (1000, 1, 1024)):
            for on in (False, True):
                for save in (False, True):
                    out.append(_case(f"ar_fwd_rows_{dt}_d{d}_on{int(on)}_save{int(save)}", AR,
                                     ["_fwd_rows_kernel", "_fwd_kernel"], fsig,
                                     dict(D=d, BT=bt, BD=bd, VEC=16 // (2 if dt == "bf16" else 4), HAS_ONORM=on,
                                          SAVE=save, PF=1, NS=1, QW_REG=True), 4))
        f2sig = dict(fsig, NB="i32", TSTEP="i32")
        f2sig = {k: f2sig[k] for k in ("base", "offs", "q_buf", "w_buf", "ow", "out", "logit_buf", "lse_buf", "N",
                                       "L", "NB", "eps", "TPP", "TSTEP")}
        vec = 16 // (2 if dt == "bf16" else 4)
        # the exact-width pipelined kernel (d with power-of-two pieces): bl 1 below 6 sources, 2 from there and with
        # the output norm (whose weight is re-read: OW_REG False)
        for d, parts in ((7168, (4096, 2048, 1024)), (1024, (1024, 0, 0))):
            for bl, on in ((1, False), (2, False), (2, True)):
                for save in (False, True):
                    out.append(_case(f"ar_fwd_pieces_{dt}_d{d}_bl{bl}_on{int(on)}_save{int(save)}", AR,
                                     ["_fwd_pieces_kernel", "_fwd3_kernel"], f2sig,
                                     dict(D=d, BT=1, BL=bl, P1=parts[0], P2=parts[1], P3=parts[2], VEC=vec,
                                          HAS_ONORM=on, SAVE=save, NS=3, QW_REG=True, OW_REG=not on), 4,
                                     div=("N",)))
        # ... and the padded-row one where d has no such pieces (d = 5000, d = 128)
        for d, bd in ((5000, 8192), (128, 128)):
            for bl, on in ((1, False), (2, False), (1, True)):
                out.append(_case(f"ar_fwd_padded_{dt}_d{d}_bl{bl}_on{int(on)}", AR,
                                 ["_fwd_padded_kernel", "_fwd2_kernel"], f2sig,
                                 dict(D=d, BT=1, BD=bd, BL=bl, VEC=vec if d % vec == 0 else 1, HAS_ONORM=on,
                                      SAVE=True, NS=3, QW_REG=True, OW_REG=not on), 4))
        bsig = dict(base=p, offs="*i64", dx=p, q=F32, w=F32, ow=F32, dy=p, logit_buf=F32, lse_buf=F32,
                    dqw_part=F32, dow_part=F32, N="i32", ND="i64", L="i32", eps="fp32", tiles_per_prog="i32")
        for d, bt, bd, nw in ((7168, 1, 8192, 16), (48, 16, 64, 4)):
            for on in (False, True):
                out.append(_case(f"ar_bwd_{dt}_d{d}_on{int(on)}", AR, ["_bwd_kernel"], bsig,
                                 dict(D=d, BT=bt, BD=bd, VEC=vec, HAS_ONORM=on), nw))
        # phase 1: logits (bf16 banks: the three-part bf16 split; float32: 3xTF32), stats, mix (bank <= 16 sources,
        # <= 64 queries; else the query-group mix)
        for d in (7168, 48):
            bk = min(64, 1 << (d - 1).bit_length())
            split = dt == "bf16"
            out.append(_case(f"ar_p1_logits_{dt}_d{d}", AR, ["_phase1_logits_kernel"],
                             dict(base=p, offs="*i64", qwT="*bf16" if split else F32, logit_buf=F32, N="i32"),
                             dict(D=d, BT=128, BK=bk, QP=32, VEC=vec, eps=1e-6, NS=4, SPLIT=split), 8))
            for acc in (p, F32):
                bc = min(1024, 1 << (d - 1).bit_length())
                out.append(_case(f"ar_p1_mix_bank_{dt}_d{d}_acc{acc[1:]}", AR, ["_phase1_mix_bank_kernel",
                                                                                 "_phase1_mix3_kernel"],
                                 dict(base=p, offs="*i64", wts=F32, acc=acc, N="i32", NQP="i32", L="i32"),
                                 dict(D=d, BC=bc, QP=32, LB=8, Q=24, VEC=vec), max(1, min(4, bc // 256))))
                out.append(_case(f"ar_p1_mix_groups_{dt}_d{d}_acc{acc[1:]}", AR,
                                 ["_phase1_mix_groups_kernel", "_phase1_mix2_kernel"],
                                 dict(base=p, offs="*i64", wts=F32, acc=acc, N="i32", NQP="i32", L="i32", Q="i32"),
                                 dict(D=d, BC=bc, QP=32, QB=8, NG=3, VEC=vec, NS=3), 4))
        gsig = dict(acc=p, m_in=F32, s_in=F32, part=p, q=F32, w=F32, ow=F32, out=p, N="i32", eps="fp32")
        for part in (False, True):
            for on in (False, True):
                out.append(_case(f"ar_merge_rows_{dt}_part{int(part)}_on{int(on)}", AR,
                                 ["_merge_rows_kernel", "_merge_kernel"], gsig,
                                 dict(D=48, BT=16, BD=64, HAS_PART=part, HAS_ONORM=on), 4))
                out.append(_case(f"ar_merge_persistent_{dt}_part{int(part)}_on{int(on)}", AR,
                                 ["_merge_persistent_kernel", "_merge2_kernel"], dict(gsig, TPP="i32", TSTEP="i32"),
                                 dict(D=7168, BD=8192, HAS_PART=part, HAS_ONORM=on, NS=3), 4))
    out.append(_case("ar_p1_stats", AR, ["_phase1_stats_kernel"],
                     dict(logit_buf=F32, m_out=F32, s_out=F32, N="i32", NQP="i32", L="i32", Q="i32"),
                     dict(QP=32, BN=64, NS=2), 4))
    return out


# ------------------------------------------------------------------------------------------------ moe
def _gg_types(bm, bk, bn, tail, w_kn, dt="bf16", half=True):
    p = "*" + dt
    wb = f"[1,{bk},{bn}]" if w_kn else f"[1,{bn},{bk}]"
    tb = tail or bm
    hb = bm // 2 if half else bm
    return dict(a_src=f"tensordesc<{dt}[{bm},{bk}]>", tok_ptr="*i64", w_src=f"tensordesc<{dt}{wb}>",
                a2_src=f"tensordesc<{dt}[{bm},{bk}]>", w2_src=f"tensordesc<{dt}{wb}>", c_ptr=p, c2_ptr=p, c3_ptr=p,
                pa_ptr=p, pb_ptr=p, wrow_ptr=F32, dwrow_ptr=F32, tile_expert_ptr="*i64", tile_start_ptr="*i64",
                offs_ptr="*i64", K="i32", NN="i32", E="i32", n_tiles="i32", stride_am="i32", stride_we="i32",
                stride_wn="i32", stride_wk="i32", stride_cm="i32", beta_gate="fp32", beta_up="fp32",
                a_h_src=f"tensordesc<{dt}[{hb},{bk}]>", a2_h_src=f"tensordesc<{dt}[{hb},{bk}]>",
                a_t_src=f"tensordesc<{dt}[{tb},{bk}]>", a2_t_src=f"tensordesc<{dt}[{tb},{bk}]>")


_GG_DIV = ("K", "NN", "stride_am", "stride_we", "stride_wn", "stride_wk", "stride_cm")


def _moe_cases():
    MK = "backends.triton.moe_kernels"
    SITU = (MK, "backends.triton.moe")          # the SiTU-GLU elementwise kernels moved from moe.py
    out = []
    # the grouped GEMMs at the GPU tile settings (bf16: BM x BN x BK, stages; tail 0 and 32 where the entry has one)
    gemms = {
        # name: (BM, BN, BK, nw, stages, tail stages, TAIL, HALF, PAIR, EPI, W_KN)
        "router": (128, 128, 64, 8, 3, 3, 0, False, 0, 0, False),
        "glu_fwd": (128, 128, 64, 8, 4, 4, 32, True, 1, 1, False),
        "mm": (128, 256, 64, 8, 3, 4, 32, True, 0, 0, False),
        "glu_bwd_mm": (128, 256, 64, 8, 3, 4, 32, True, 0, 0, True),
        "dx": (128, 256, 64, 8, 3, 4, 32, True, 3, 0, True),
    }
    for name, (bm, bn, bk, nw, st, tst, tail, half, pair, epi, w_kn) in gemms.items():
        for t in sorted({0, tail}):
            for save in ((False, True) if epi == 1 else (False,)):
                for amode in ((2, 0) if name == "glu_fwd" else (2,)):
                    types = _gg_types(bm, bk, bn, t, w_kn, half=half)
                    if amode == 0:          # gathered rows: every A operand is the plain pointer
                        types.update({a: BF for a in ("a_src", "a2_src", "a_h_src", "a2_h_src", "a_t_src",
                                                      "a2_t_src")})
                    if name == "router":
                        types["c_ptr"] = F32
                    out.append(_case(f"moe_gg_{name}_tail{t}_save{int(save)}_amode{amode}", MK,
                                     ["_grouped_gemm_kernel"], types,
                                     dict(PAIR=pair, EPI=epi, SAVE=save, ROW_SCALE=epi == 1, ACT=0, FAST=True,
                                          A_MODE=amode, W_DESC=True, W_KN=w_kn, PREC="tf32", EVEN_K=True, BM=bm,
                                          BN=bn, BK=bk, HALF=half, TAIL=t, W_MX=False),
                                     nw, tst if t else st, div=_GG_DIV))
    # float32 operands (the cuda_f32 tiles: at most 64 x 64 x 32, 4 warps, 2 stages; IEEE products)
    for name, (bm, bn, bk, nw, st, tst, tail, half, pair, epi, w_kn) in gemms.items():
        bm, bn, bk = min(bm, 64), min(bn, 64), min(bk, 32)
        for t in sorted({0, tail}):
            types = _gg_types(bm, bk, bn, t, w_kn, dt="fp32", half=half)
            out.append(_case(f"moe_gg_{name}_f32_tail{t}", MK, ["_grouped_gemm_kernel"], types,
                             dict(PAIR=pair, EPI=epi, SAVE=epi == 1, ROW_SCALE=epi == 1, ACT=0, FAST=True, A_MODE=2,
                                  W_DESC=True, W_KN=w_kn, PREC="ieee", EVEN_K=True, BM=bm, BN=bn, BK=bk, HALF=half,
                                  TAIL=t, W_MX=False),
                             4, 2, div=_GG_DIV))
    # the split GLU backward's row pass
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        out.append(_case(f"moe_glu_bwd_rows_{dt}", MK, ["_glu_bwd_rows_kernel"],
                         dict(g_ptr=p, a_ptr=p, b_ptr=p, wrow_ptr=F32, da_ptr=p, db_ptr=p, dwrow_ptr=F32, M="i32",
                              N="i32", stride_m="i32", beta_gate="fp32", beta_up="fp32"),
                         dict(ACT=0, FAST=True, BLOCK_R=4, BLOCK_N=1024), 8, 1))
    # weight gradients: v1 (single output: "wgrad" 128 x 256 pointer stores; "wgrad_few" 128 x 128 x 32 TMA stores;
    # over every expert or the experts v3 leaves over) and v3 (depth classes)
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        f32 = dt == "fp32"
        for label, bm, bn, bk, nw, st, odesc in (("wide", 128, 256, 64, 8, 3, False),
                                                 ("few", 128, 128, 32, 4, 3, True)):
            if f32:
                bm, bn, bk, nw, st = 64, 64, 32, 4, 2
            for explist in (False, True):
                for pg, qg in ((False, False), (True, False), (False, True)):
                    sig = dict(p_ptr=p, p2_ptr=p, ptok_ptr="*i64", pscale_ptr=p, q_ptr=p, qtok_ptr="*i64",
                               out_ptr=f"tensordesc<{dt}[1,{bm},{bn}]>" if odesc else p,
                               out2_ptr=f"tensordesc<{dt}[1,{bm},{bn}]>" if odesc else p, offs_ptr="*i64",
                               exp_ptr="*i32" if explist else "*i64", MM="i32", NN="i32", m_tiles="i32",
                               n_tiles="i32", stride_pm="i32", stride_qm="i32", stride_oe="i32", stride_om="i32")
                    out.append(_case(f"moe_wgrad_tile_{dt}_{label}_list{int(explist)}_g{int(pg)}{int(qg)}", MK,
                                     ["_wgrad_tile_kernel", "_wgrad_kernel"], sig,
                                     dict(P_GATHER=pg, P_SCALE=False, Q_GATHER=qg, DUAL=False,
                                          PREC="ieee" if f32 else "tf32", BM=bm, BN=bn, BK=bk, O_DESC=odesc,
                                          EXP_LIST=explist),
                                     nw, st, div=("MM", "NN", "stride_pm", "stride_qm", "stride_oe", "stride_om")))
        bm, bn, nw = (64, 64, 4) if f32 else (128, 128, 8)
        for kp, nx in ((128, 1), (128, 4), (64, 0)):
            for pg, qg in ((False, False), (True, False), (False, True)):
                sig = dict(p_ptr=p, ptok_ptr="*i64", q_ptr=p, qtok_ptr="*i64", out_ptr=p, offs_ptr="*i64",
                           exp_ptr="*i32", MM="i32", NN="i32", m_tiles="i32", stride_pm="i32", stride_qm="i32",
                           stride_oe="i32", stride_om="i32")
                out.append(_case(f"moe_wgrad_held_{dt}_kp{kp}_nx{nx}_g{int(pg)}{int(qg)}", MK,
                                 ["_wgrad_held_kernel", "_wgrad_v3_kernel"], sig,
                                 dict(P_GATHER=pg, Q_GATHER=qg, PREC="ieee" if f32 else "tf32", BM=bm, BN=bn,
                                      KP=kp, KX=32, NX=nx, EXP_LIST=True, O_DESC=False),
                                 nw, 2 if (f32 or nx == 4) else 3,
                                 div=("MM", "NN", "stride_pm", "stride_qm", "stride_oe", "stride_om")))
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        out.append(_case(f"moe_combine_{dt}", MK, ["_combine_kernel"],
                         dict(y_ptr=p, pos_ptr="*i64", wt_ptr=p, out_ptr=p, L="i32", stride_ym="i32",
                              stride_om="i32"), dict(TOPK=16, WEIGHTED=False, BLOCK=1024), 4))
    out.append(_case("moe_route_topk", MK, ["_route_topk_kernel"],
                     dict(logit_ptr=F32, bias_ptr=F32, score_ptr=F32, idx_ptr="*i64", wt_ptr=F32, alpha_ptr=F32,
                          bad_ptr="*i32", N="i32", E="i32", routed_scaling="fp32"),
                     dict(K_SEL=16, K_PAD=16, FROM_LOGITS=True, WRITE_TOPK=True, WRITE_ALPHA=False, BLOCK_R=4,
                          BLOCK_E=1024), 4))
    out.append(_case("moe_qb_count", MK, ["_qb_count_kernel"],
                     dict(score_ptr=F32, alpha_ptr=F32, cnt_ptr="*i32", N="i32", E="i32", q="i32"),
                     dict(PASS=3, BLOCK_N=64, BLOCK_E=64), 4))
    out.append(_case("moe_qb_finish", MK, ["_qb_finish_kernel"], dict(cnt_ptr="*i32", bhat_ptr=F32, E="i32", q="i32"),
                     dict(BLOCK_E=128), 4))
    out.append(_case("moe_expert_load", MK, ["_expert_load_kernel"],
                     dict(idx_ptr="*i64", load_ptr="*i64", M="i32", E="i32", bad_ptr="*i32"), dict(BLOCK=1024), 4))
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        out.append(_case(f"moe_situ_fwd_{dt}", SITU, ["_situ_fwd_ew"],
                         dict(a_ptr=p, b_ptr=p, h_ptr=p, M="i32", beta_gate="fp32", beta_up="fp32"),
                         dict(ACT=0, FAST=True, BLOCK=1024), 4))
        out.append(_case(f"moe_situ_bwd_{dt}", SITU, ["_situ_bwd_ew"],
                         dict(a_ptr=p, b_ptr=p, dh_ptr=p, da_ptr=p, db_ptr=p, M="i32", beta_gate="fp32",
                              beta_up="fp32"),
                         dict(ACT=0, FAST=True, BLOCK=1024), 4))
    return out


# ------------------------------------------------------------------------------------------------ compile
def _find(module, names):
    if isinstance(module, tuple):                 # modules to try in order (a kernel that moved)
        for m in module:
            try:
                return _find(m, names)
            except LookupError:
                pass
        raise LookupError(f"{module}: none of {names}")
    mod = importlib.import_module(module)
    for n in names:
        fn = getattr(mod, n, None)
        if fn is not None:
            return n, fn
    # a kernel may have moved into a submodule of a package: search them
    path = getattr(mod, "__path__", None)
    if path:
        import pkgutil
        for info in pkgutil.iter_modules(path):
            sub = importlib.import_module(f"{module}.{info.name}")
            for n in names:
                if getattr(sub, n, None) is not None:
                    return n, getattr(sub, n)
    raise LookupError(f"{module}: none of {names}")


def _normalise(ptx, kname, params):
    lines = []
    skip = 0
    for ln in ptx.splitlines():
        s = ln.strip()
        if s.startswith(".section") and ".debug" in s:
            skip = 1
            continue
        if skip:
            if s.startswith("}"):
                skip = 0
            continue
        if s.startswith((".loc", ".file", "//")) or re.fullmatch(r"\$L__tmp\d+:", s):
            continue
        lines.append(ln.rstrip())
    text = "\n".join(lines) + "\n"

    def par(m):
        i = int(m.group(1))
        return params[i] if i < len(params) else f"extra{i - len(params)}"
    text = re.sub(re.escape(kname) + r"_param_(\d+)", lambda m: "P:" + par(m), text)
    return text.replace(kname, "KERNEL")


def _compile(case):
    import triton
    from triton.backends.compiler import GPUTarget
    kname, fn = _find(case["module"], case["names"])
    args = fn.arg_names
    consts = {k: v for k, v in case["consts"].items() if k in args}
    sig = {}
    for a in args:
        if a in consts:
            sig[a] = "constexpr"
        elif a in case["sig"]:
            sig[a] = case["sig"][a]
        else:
            raise KeyError(f"{case['name']}: no type for argument {a} of {kname}")
    div = [a for a in args if a not in consts and (sig[a].startswith("*") or a in case["div"])]
    attrs = {(args.index(a),): [["tt.divisibility", 16]] for a in div}
    opts = {"num_warps": case["nw"]}
    if case["ns"] is not None:
        opts["num_stages"] = case["ns"]
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    params = []
    for a in args:
        if a in consts:
            continue
        m = re.fullmatch(r"tensordesc<\w+\[([\d,\s]+)\]>", sig[a])
        if m:       # a TMA descriptor argument: the 128-byte descriptor, then the tensor's shape and strides
            nd = len(m.group(1).split(","))
            params += [a] + [f"{a}.shape{i}" for i in range(nd)] + [f"{a}.stride{i}" for i in range(nd)]
        else:
            params.append(a)
    return kname, _normalise(k.asm["ptx"], k.metadata.name, params), k.metadata.shared, k.asm["ptx"]


# ------------------------------------------------------------------------------------------------ TVM
def _tvm_cases():
    cases = []
    for d, L in ((7168, 2), (7168, 8), (7168, 25), (1000, 3), (100, 1), (448, 5), (131072, 3)):
        for dt in ("bfloat16", "float32"):
            cases.append((f"tvm_attn_residual_{dt}_d{d}_L{L}",
                          ("attn_residual", dict(d=d, L=L, eps=1e-6, dtype=dt, q_dtype="float32",
                                                 w_dtype="float32"))))
    for d in (7168, 100):
        cases.append((f"tvm_rmsnorm_d{d}", ("rmsnorm", dict(d=d, eps=1e-6, dtype="bfloat16", w_dtype="float32"))))
    cases.append(("tvm_situ_glu", ("situ_glu", dict(dtype="bfloat16", vec=8))))
    cases.append(("tvm_short_conv", ("short_conv", dict(C=448, W=4, dtype="bfloat16"))))
    return cases


def _tvm_text(op, attrs, scheduled):
    import backends.tvm as V
    from backends.tvm import kernels as K
    k = V.kernel_for(op, **attrs)
    parts = [f"sched {k.sched!r}\npass_config {k.cuda_pass_config!r}\ninfo {sorted(k.info.items())!r}\n",
             "---- llvm text\n" + k.text("llvm"), "---- cuda text\n" + k.text("cuda")]
    if scheduled:
        for kind in ("llvm", "cuda"):
            try:
                parts.append(f"---- scheduled {kind}\n" + K.schedule(k, kind).script())
            except Exception as e:          # noqa: BLE001  (recorded: a schedule that fails must keep failing)
                parts.append(f"---- scheduled {kind}: {type(e).__name__}: {e}\n")
    return "\n".join(parts)


def snapshot(out_dir, only=None, tvm_scheduled=True):
    os.makedirs(out_dir, exist_ok=True)
    meta = {}
    for case in _attn_cases() + _moe_cases():
        if only and not re.search(only, case["name"]):
            continue
        kname, text, shared, raw = _compile(case)
        with open(os.path.join(out_dir, case["name"] + ".ptx"), "w") as f:
            f.write(text)
        with open(os.path.join(out_dir, case["name"] + ".raw"), "w") as f:        # the PTX as compiled (--sass)
            f.write(raw)
        meta[case["name"]] = dict(kernel=kname, shared=shared)
        print(case["name"], kname, shared, flush=True)
    try:
        import tvm  # noqa: F401
        have_tvm = True
    except ImportError:
        have_tvm = False
    for name, (op, attrs) in _tvm_cases():
        if only and not re.search(only, name):
            continue
        text = _tvm_text(op, attrs, tvm_scheduled and have_tvm)
        with open(os.path.join(out_dir, name + ".tvm"), "w") as f:
            f.write(text)
        print(name, flush=True)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def _split_params(text):
    params, body = [], []
    for ln in text.splitlines():
        (params if ln.strip().startswith(".param") else body).append(ln.strip().rstrip(","))
    return params, body


def compare(a, b):
    names = sorted(f for f in os.listdir(a) if f.endswith((".ptx", ".tvm")))
    missing = [f for f in names if not os.path.exists(os.path.join(b, f))]
    same = params_only = differ = 0
    ma = json.load(open(os.path.join(a, "meta.json")))
    mb = json.load(open(os.path.join(b, "meta.json"))) if os.path.exists(os.path.join(b, "meta.json")) else {}
    for f in names:
        if f in missing:
            continue
        ta, tb = open(os.path.join(a, f)).read(), open(os.path.join(b, f)).read()
        case = f.rsplit(".", 1)[0]
        ren = ""
        if case in ma and case in mb and ma[case]["kernel"] != mb[case]["kernel"]:
            ren = f" (kernel {ma[case]['kernel']} -> {mb[case]['kernel']})"
        if case in ma and case in mb and ma[case]["shared"] != mb[case]["shared"]:
            print(f"SHARED {f}: {ma[case]['shared']} -> {mb[case]['shared']}")
        if ta == tb:
            same += 1
            if ren:
                print(f"same  {f}{ren}")
            continue
        pa, ba = _split_params(ta)
        pb, bb = _split_params(tb)
        if ba == bb:
            params_only += 1
            gone = [p.split()[-1] for p in pa if p not in pb]
            new = [p.split()[-1] for p in pb if p not in pa]
            print(f"PARAMS {f}{ren}: instructions identical; parameters removed {gone} added {new}")
            continue
        differ += 1
        diff = list(difflib.unified_diff(ta.splitlines(), tb.splitlines(), lineterm="", n=1))
        print(f"DIFF  {f}{ren}: {len(diff)} diff lines")
        print("\n".join(diff[:40]))
    print(f"\n{len(names)} cases: {same} identical, {params_only} identical but for unused parameters, "
          f"{differ} differ, {len(missing)} missing after ({', '.join(missing)})")
    return differ == 0 and not missing


_PARAM_BASE = 0x210     # where an sm_90 kernel's parameters start in constant bank 0


def _param_layout(norm_ptx):
    """[(offset in constant bank 0, size, argument name)] of a kernel's parameters, from its normalised PTX (each
    .param line: pointers and 64-bit values 8 bytes, 32-bit ones 4, `.align A .b8 name[N]` N bytes aligned to A)."""
    out, off = [], _PARAM_BASE
    for ln in norm_ptx.splitlines():
        st = ln.strip().rstrip(",")
        if not st.startswith(".param"):
            continue
        name = re.search(r"P:([\w.]+)", st).group(1)
        m = re.search(r"\.align (\d+) \.b8 \S+\[(\d+)\]", st)
        if m:
            align, size = int(m.group(1)), int(m.group(2))
        else:
            size = 8 if re.search(r"\.(u64|s64|b64|f64)", st) else 4
            align = size
        off = (off + align - 1) // align * align
        out.append((off, size, name))
        off += size
    return out


def _sass(raw_ptx, tmp, layout):
    """The sm_90a SASS of a PTX text (triton's bundled ptxas, then cuobjdump), normalised: no addresses, encodings,
    comments or the kernel's name, and each parameter read c[0x0][offset] written as the argument's name (so that a
    removed unused parameter, which moves the later ones, shows nowhere else)."""
    import subprocess
    import triton
    nv = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    name = re.search(r"\.entry\s+(\w+)", raw_ptx).group(1)
    src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
    open(src, "w").write(raw_ptx)
    subprocess.run([os.path.join(nv, "ptxas"), "-arch=sm_90a", src, "-o", cubin], check=True, capture_output=True)
    out = subprocess.run([os.path.join(nv, "cuobjdump"), "-sass", cubin], check=True, capture_output=True,
                         text=True).stdout

    def par(m):
        a = int(m.group(1), 16)
        for off, size, pname in layout:
            if off <= a < off + size:
                return f"c[0x0][{pname}+{a - off}]"
        return m.group(0)
    lines = []
    for ln in out.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", ln)
        if m:
            lines.append(re.sub(r"c\[0x0\]\[(0x[0-9a-f]+)\]", par, m.group(1).replace(name, "KERNEL")))
    return lines


def compare_sass(a, b, only=None):
    """For the cases whose normalised PTX differs: compare the SASS that ptxas makes of the two PTX texts."""
    import tempfile
    same = differ = 0
    for f in sorted(os.listdir(a)):
        if not f.endswith(".raw") or (only and not re.search(only, f)):
            continue
        case = f[:-4]
        if not os.path.exists(os.path.join(b, f)):
            continue
        if open(os.path.join(a, case + ".ptx")).read() == open(os.path.join(b, case + ".ptx")).read():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            sa = _sass(open(os.path.join(a, f)).read(), tmp, _param_layout(open(os.path.join(a, case + ".ptx")).read()))
            sb = _sass(open(os.path.join(b, f)).read(), tmp, _param_layout(open(os.path.join(b, case + ".ptx")).read()))
        if sa == sb:
            same += 1
            print(f"SASS identical  {case} ({len(sa)} instructions)")
        else:
            differ += 1
            diff = list(difflib.unified_diff(sa, sb, lineterm="", n=0))
            print(f"SASS DIFF       {case}: {len(sa)} -> {len(sb)} instructions, {len(diff)} diff lines")
            print("\n".join(diff[:20]))
    print(f"\nPTX-different cases: SASS identical {same}, SASS different {differ}")
    return differ == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the snapshot to this directory")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two snapshot directories")
    ap.add_argument("--sass", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="for the cases whose normalised PTX differs, compare the sm_90a SASS of the two (ptxas)")
    ap.add_argument("--only", help="regular expression: the cases whose names match it")
    ap.add_argument("--no-tvm-schedule", action="store_true", help="TVM: the texts only, no scheduled script")
    a = ap.parse_args()
    if a.compare:
        sys.exit(0 if compare(*a.compare) else 1)
    if a.sass:
        sys.exit(0 if compare_sass(*a.sass, only=a.only) else 1)
    if not a.out:
        ap.error("--out or --compare")
    snapshot(a.out, a.only, not a.no_tvm_schedule)


if __name__ == "__main__":
    main()
