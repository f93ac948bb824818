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
