"""The split-T MLA decode kernel (backends/triton/mla_decode.py) against float64 attention over the latent cache:
rows of different lengths (1, a split boundary, past it), several splits, no rope part, float32 and float16."""
import pytest
import torch

from backends.triton.mla_decode import mla_decode


def _truth(ql, qr, C, R, lens, scale):
    out = []
    for b, n in enumerate(lens):
        s = ql[b].double() @ C[b, :n].double().T
        if qr is not None:
            s = s + qr[b].double() @ R[b, :n].double().T
        out.append(torch.softmax(s * scale, -1) @ C[b, :n].double())
    return torch.stack(out)


@pytest.mark.parametrize("B,H,KL,DR,lens,split,dtype,tol", [
    (3, 2, 16, 8, [1, 64, 97], 64, torch.float32, 1e-5),
    (1, 12, 96, 24, [333], 64, torch.float32, 1e-5),
    (2, 5, 32, 0, [40, 7], None, torch.float32, 1e-5),
    (2, 20, 64, 16, [150, 129], 32, torch.float16, 2e-3),
])
def test_mla_decode_equals_attention_over_the_latent(B, H, KL, DR, lens, split, dtype, tol):
    ql = torch.randn(B, H, KL)
    qr = torch.randn(B, H, DR) if DR else None
    C = torch.randn(B, max(lens) + 3, KL).to(dtype)
    R = torch.randn(B, max(lens) + 3, DR).to(dtype) if DR else None
    C[:, max(lens):] = float("nan")                    # past every row's length: never read
    scale = 0.7 / (KL + DR) ** 0.5 * 4
    got = mla_decode(ql, qr, C, R, torch.tensor(lens), scale, split=split)
    want = _truth(ql.to(dtype), None if qr is None else qr.to(dtype), C, R, lens, scale)
    assert got.dtype == torch.float32 and got.shape == (B, H, KL)
    assert float((got.double() - want).norm() / want.norm()) < tol


@pytest.mark.gpu
def test_mla_decode_k3_width_on_the_gpu():
    """K3's MLA width (96 heads, kv_lora_rank 512, rope 64) over 100,003 cached tokens in bf16, two rows of different
    lengths: against float64 attention over the same bf16 cache (the query rounded to bf16 as the kernel does)."""
    torch.manual_seed(0)
    B, H, KL, DR, lens = 2, 96, 512, 64, [100_003, 4_097]
    ql, qr = torch.randn(B, H, KL, device="cuda") * 0.05, torch.randn(B, H, DR, device="cuda") * 0.05
    C = torch.randn(B, max(lens), KL, device="cuda").bfloat16()
    R = torch.randn(B, max(lens), DR, device="cuda").bfloat16()
    scale = 192 ** -0.5
    got = mla_decode(ql, qr, C, R, torch.tensor(lens, device="cuda"), scale)
    want = _truth(ql.bfloat16(), qr.bfloat16(), C, R, lens, scale)
    assert float((got.double() - want).norm() / want.norm()) < 1e-2
