"""MXFP4 routed experts kept packed (backends/mxfp4.py): the reference moe_experts and the Triton W4A16 grouped GEMMs
against a float64 reference that decodes the weights with this test's own decoder, written from the format's
definition (OCP MX v1.0 E2M1 elements, E8M0 scales 2^(s - 127); compressed-tensors packing: low nibble = even
column); and the module's bytes against the memory plan.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py), in float32 / float16 (the interpreter
computes bf16 tl.dot wrongly), at non-round shapes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dsl
from backends.mxfp4 import MXFP4Experts
from backends.reference import moe as ref
from dsl.ir import DTYPES

ROOT = Path(__file__).resolve().parents[1]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
N, L, I, E, K = 37, 64, 96, 6, 2


def decode(w: MXFP4Experts) -> torch.Tensor:
    """float64 [E, out, in] from the definition: byte b of a row holds column 2b (low nibble) and 2b + 1 (high);
    value = E2M1(code) * 2 ** (scale[row, column // 32] - 127)."""
    return decode_bytes(w.weight_packed, w.weight_scale)


def decode_bytes(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """decode() of the raw uint8 tensors [..., out, in / 2] and [..., out, in / 32], on their device."""
    p, s = packed.long(), scales.long()
    table = torch.tensor(E2M1, dtype=torch.float64, device=p.device)
    codes = torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)            # [E, out, in], column order
    scale = torch.pow(torch.tensor(2.0, dtype=torch.float64, device=p.device), (s - 127).double())
    return table[codes] * scale.repeat_interleave(32, dim=-1)


def random_experts(e, out, n_in, lo=119, hi=128) -> MXFP4Experts:
    w = MXFP4Experts(e, out, n_in)
    w.weight_packed.copy_(torch.randint(0, 256, w.weight_packed.shape, dtype=torch.uint8))
    w.weight_scale.copy_(torch.randint(lo, hi, w.weight_scale.shape, dtype=torch.uint8))
    return w


def moe64(x, idx, wt, w1, w3, w2, bg=4.0, bu=25.0):
    """u = sum_k wt_k w2_e situ_glu(w1_e x, w3_e x) in float64 (spec/OPS.md moe_experts, SiTU-GLU)."""
    a = torch.einsum("nl,nkil->nki", x, w1[idx])
    b = torch.einsum("nl,nkil->nki", x, w3[idx])
    h = (bg * torch.tanh(a / bg) * torch.sigmoid(a)) * (bu * torch.tanh(b / bu))
    return torch.einsum("nk,nki,nkli->nl", wt, h, w2[idx])


def problem():
    w1, w3, w2 = random_experts(E, I, L), random_experts(E, I, L), random_experts(E, L, I)
    x = torch.randn(N, L)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    idx[:5] = torch.tensor([0, 3])                       # (an expert with many rows beside ones with few)
    wt = torch.rand(N, K) + 0.1
    return x, idx, wt, (w1, w3, w2)


def test_test_decoder_reads_the_definition():
    w = MXFP4Experts(1, 1, 32)
    w.weight_packed[0, 0, :2] = torch.tensor([0x21, 0xF9], dtype=torch.uint8)   # codes 1, 2, 9, 15
    w.weight_scale[0, 0, 0] = 128                                               # 2^1
    assert decode(w)[0, 0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]
    assert torch.equal(w.dequantize().double(), decode(w))


def test_reference_packed_experts_against_float64():
    x, idx, wt, ws = problem()
    xr = x.clone().requires_grad_()
    wr = wt.clone().requires_grad_()
    u = ref.moe_experts(xr, idx, wr, *ws)
    x64 = x.double().requires_grad_()
    w64 = wt.double().requires_grad_()
    u64 = moe64(x64, idx, w64, *(decode(w) for w in ws))
    torch.testing.assert_close(u.double(), u64, rtol=1e-5, atol=1e-5 * u64.abs().max().item())
    g = torch.randn(N, L, dtype=torch.float64)
    u.backward(g.float())
    u64.backward(g)
    torch.testing.assert_close(xr.grad.double(), x64.grad, rtol=1e-5, atol=1e-5 * x64.grad.abs().max().item())
    torch.testing.assert_close(wr.grad.double(), w64.grad, rtol=1e-5, atol=1e-5 * w64.grad.abs().max().item())
    assert not any(b.requires_grad for w in ws for b in w.buffers())             # frozen


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
def test_triton_w4a16_against_float64(dtype, tol):
    from backends.triton import moe as tm
    x, idx, wt, ws = problem()
    x = x.to(dtype)
    xr = x.clone().requires_grad_()
    wr = wt.clone().requires_grad_()
    u = tm.moe_experts(xr, idx, wr, *ws)
    assert u.dtype == dtype
    x64 = x.double().requires_grad_()
    w64 = wt.double().requires_grad_()
    u64 = moe64(x64, idx, w64, *(decode(w) for w in ws))
    scale = u64.abs().max().item()
    torch.testing.assert_close(u.double(), u64, rtol=tol, atol=tol * scale)
    g = torch.randn(N, L, dtype=torch.float64)
    u.backward(g.to(dtype))
    u64.backward(g)
    torch.testing.assert_close(xr.grad.double(), x64.grad, rtol=tol, atol=tol * x64.grad.abs().max().item())
    torch.testing.assert_close(wr.grad.double(), w64.grad, rtol=tol, atol=tol * w64.grad.abs().max().item())


def test_triton_w4a16_edge_scales_and_all_rows_on_one_expert():
    """Scales at the ends of the float32-exact range and every token on one expert (one expert, many tiles)."""
    from backends.triton import moe as tm
    ws = [random_experts(E, I, L, 100, 140), random_experts(E, I, L, 100, 140), random_experts(E, L, I, 120, 126)]
    x = torch.randn(N, L) * 1e-3
    idx = torch.full((N, 1), 4)
    wt = torch.ones(N, 1)
    u = tm.moe_experts(x, idx, wt, *ws)
    u64 = moe64(x.double(), idx, wt.double(), *(decode(w) for w in ws))
    torch.testing.assert_close(u.double(), u64, rtol=1e-5, atol=1e-5 * u64.abs().max().item())


def test_packed_module_bytes_are_the_memory_plans():
    from passes.plan_memory import plan_memory
    g = dsl.parse((ROOT / "models" / "kimi_k3.mtc").read_text(), "tiny", expert_dtype="mxfp4")
    m = dsl.compile(g, device="meta")
    held = {k: w for k, w in m.named_modules() if isinstance(w, MXFP4Experts)}
    params = {n.attr("name"): n for n in m.graph.nodes if n.op == "param" and n.type.dtype == "mxfp4"}
    assert set(held) == set(params) and len(held) == 3 * 8                   # w1, w3, w2 of 8 MoE layers
    for key, w in held.items():
        assert w.nbytes == int(params[key].type.numel()) * DTYPES["mxfp4"], key
        assert w.weight_packed.dtype == w.weight_scale.dtype == torch.uint8
    mp = plan_memory(g, seq_len=64, gpus=1)
    assert mp.expert_weight_bytes == sum(w.nbytes for w in held.values())
    keys = m.state_dict().keys()
    assert "model.layers.1.block_sparse_moe.experts.w2.weight_packed" in keys
    assert "model.layers.1.block_sparse_moe.experts.w2.weight_scale" in keys
    assert not any(k.endswith("experts.w2") for k in keys)
    dense = dsl.compile(g, device="meta", packed_experts=False)
    assert "model.layers.1.block_sparse_moe.experts.w2" in dense.state_dict()
    with pytest.raises(dsl.MtcError, match="packed_experts must be True or False"):
        dsl.compile(g, device="meta", packed_experts="yes")


def test_weights_fit_check_counts_the_packed_bytes(monkeypatch):
    """The check before allocating (dsl.compile, dsl.from_hf, mtc run) counts packed MXFP4 experts at their 0.53125
    bytes per element: a machine that holds the packed model but not the decoded one compiles it packed and refuses
    it with packed_experts=False, naming the decoded size."""
    import backends.runtime as rt
    g = dsl.parse((ROOT / "models" / "kimi_k3.mtc").read_text(), "tiny", expert_dtype="mxfp4")
    params = list(g.params())
    n = sum(int(p.type.numel()) for p in params)
    n_mx = sum(int(p.type.numel()) for p in params if p.type.dtype == "mxfp4")
    packed, decoded = 4 * (n - n_mx) + DTYPES["mxfp4"] * n_mx, 4 * n
    have = (packed + decoded) / 2 / 0.8                          # 80% of it lies between the two
    page = 4096
    monkeypatch.setattr(rt.os, "sysconf", lambda key: page if key == "SC_PAGE_SIZE" else int(have // page))
    rt.check_weights_fit(g, 4, torch.device("cpu"), "advice", packed_mxfp4=True)
    m = dsl.compile(g)
    assert sum(w.nbytes for w in m.modules() if isinstance(w, MXFP4Experts)) == DTYPES["mxfp4"] * n_mx
    with pytest.raises(dsl.MtcError, match=rf"has {n:,} parameters: .* of weights in float32, more than this "
                                           r"machine holds"):
        dsl.compile(g, packed_experts=False)


def test_packed_model_equals_its_decoded_twin():
    """A tiny K3 model with packed experts (reference and Triton interpreter) gives the logits of the dense
    model holding the decoded weights; training leaves the packed weights out of the parameters."""
    g = dsl.parse((ROOT / "models" / "kimi_k3.mtc").read_text(), "tiny", expert_dtype="mxfp4")
    m = dsl.compile(g, seed=3).eval()
    dense = dsl.compile(g, packed_experts=False).eval()
    sd = {k: v for k, v in m.state_dict().items() if not k.endswith(("weight_packed", "weight_scale"))}
    sd.update({k: w.dequantize() for k, w in m.named_modules() if isinstance(w, MXFP4Experts)})
    dense.load_state_dict(sd)
    x = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        a, b = m(x), dense(x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    assert not any("experts.w" in k for k, _ in m.named_parameters())


_HOPPER = r"""
import triton
from triton.backends.compiler import GPUTarget
from backends.triton import moe_kernels as K
from backends.triton import moe as M

fn = K._grouped_gemm_kernel
bf = "*bf16"
for name, pair, epi, w_kn in (("glu_fwd", 1, 1, False), ("dx", 3, 0, True)):
    c = M.TILE_CONFIGS["cuda"][name]
    BM, BN, BK = c["BM"], c["BN"], c["BK"]
    types = {n: "i32" for n in fn.arg_names}
    types.update(a_src=f"tensordesc<bf16[{BM},{BK}]>", a2_src=f"tensordesc<bf16[{BM},{BK}]>",
                 w_src="*u8", w2_src="*u8", ws_src="*u8", w2s_src="*u8",
                 tok_ptr="*i64", c_ptr=bf, c2_ptr=bf, c3_ptr=bf, wrow_ptr="*fp32", tile_expert_ptr="*i64",
                 tile_start_ptr="*i64", offs_ptr="*i64", beta_gate="fp32", beta_up="fp32")
    consts = dict(PAIR=pair, EPI=epi, SAVE=False, ROW_SCALE=epi == 1, ACT=0, FAST=True, A_MODE=2, W_DESC=False,
                  W_KN=w_kn, PREC="tf32", EVEN_K=True, BM=BM, BN=BN, BK=BK, HALF=False, TAIL=0, W_MX=True,
                  a_h_src=None, a2_h_src=None, a_t_src=None, a2_t_src=None)
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": c["num_warps"],
                                                                  "num_stages": c["num_stages"]})
    ptx = k.asm["ptx"]
    print(name, int("wgmma.mma_async" in ptx and k.metadata.shared <= 227 * 1024))
"""


def test_w4a16_gemms_compile_to_wgmma_for_hopper():
    """GEMM 1 (w1|w3, SiTU-GLU epilogue) and the backward's dx GEMM (N-packed weights) with MXFP4 weights compile
    for sm_90 with no GPU present: wgmma MMAs on the decoded tiles, within the 227 KB of shared memory. In a
    subprocess without the interpreter."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _HOPPER], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["glu_fwd", "1", "dx", "1"]


def _moe64_by_expert(x, idx, wt, w1, w3, w2, bg=4.0, bu=25.0):
    """moe64 one expert at a time with this test's decoder (float64 on x's device: one expert's rows at a time)."""
    u = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    x64, wt64 = x.double(), wt.double()
    for e in range(w1.shape[0]):
        n, j = torch.nonzero(idx == e, as_tuple=True)
        if n.numel() == 0:
            continue
        a = x64[n] @ decode_bytes(w1.weight_packed[e], w1.weight_scale[e]).T
        b = x64[n] @ decode_bytes(w3.weight_packed[e], w3.weight_scale[e]).T
        h = (bg * torch.tanh(a / bg) * torch.sigmoid(a)) * (bu * torch.tanh(b / bu))
        u.index_add_(0, n, wt64[n, j, None] * (h @ decode_bytes(w2.weight_packed[e], w2.weight_scale[e]).T))
    return u


@pytest.mark.gpu
def test_triton_w4a16_bf16_on_the_gpu():
    """The W4A16 grouped GEMMs in bf16 on the GPU at a real tile count (N = 4097 tokens, top-4 of 61 experts,
    latent 1024, I 768: full and partial tiles, experts with no rows), forward and the activation gradients,
    against the float64 decode of the same packed bytes: bf16 rounding only (relative norm error <= 1e-2)."""
    from backends.triton import moe as tm
    torch.manual_seed(0)
    dev, n, e, k, l_, i_ = "cuda", 4097, 61, 4, 1024, 768

    def experts(out, n_in):
        w = MXFP4Experts(e, out, n_in, device=dev)
        w.weight_packed.copy_(torch.randint(0, 256, w.weight_packed.shape, dtype=torch.uint8, device=dev))
        w.weight_scale.copy_(torch.randint(118, 122, w.weight_scale.shape, dtype=torch.uint8, device=dev))
        return w
    ws = [experts(i_, l_), experts(i_, l_), experts(l_, i_)]
    x = torch.randn(n, l_, device=dev).bfloat16()
    idx = torch.rand(n, e - 3, device=dev).topk(k, dim=1).indices       # experts 58-60 get no rows
    wt = torch.softmax(torch.randn(n, k, device=dev), -1)
    xr, wr = x.clone().requires_grad_(), wt.clone().requires_grad_()
    u = tm.moe_experts(xr, idx, wr, *ws)
    x64, w64 = x.double().requires_grad_(), wt.double().requires_grad_()
    u64 = _moe64_by_expert(x64, idx, w64, *ws)
    g = torch.randn_like(u64)
    u.backward(g.bfloat16())
    u64.backward(g)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    assert u.dtype == torch.bfloat16
    assert rel(u, u64) < 1e-2
    assert rel(xr.grad, x64.grad) < 1e-2
    assert rel(wr.grad, w64.grad) < 1e-2
