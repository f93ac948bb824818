"""Test set-up shared by every test.

Triton kernels run under the interpreter when no CUDA GPU is present. TRITON_INTERPRET must be set
before triton is first imported, so it is decided here from the presence of an NVIDIA device node,
without importing torch or triton.
"""
import os
import glob

HAS_GPU = bool(glob.glob("/dev/nvidia[0-9]*")) and os.environ.get("MTC_FORCE_CPU") != "1"
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs every run, reproducible from the seed a failure prints: its report has a
    'seed' section; re-run that test with MTC_SEED=<seed> in the environment to get the same inputs."""
    seed = int(os.environ.get("MTC_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    request.node.add_report_section("call", "seed", f"torch.manual_seed({seed}); reproduce with MTC_SEED={seed}")
    yield seed


@pytest.fixture
def wide_moe_tiles():
    """MoE grouped-GEMM tiles 64 wide and 64 deep under the interpreter (the default CPU tiles are 16 x 16 x 16).

    For the tests of whole models on the triton target, whose point is the program (launch order, fusion, caches,
    gradients reaching every parameter), not the tiling: `tiny`'s layers (d = 64, expert width 32) then take one
    tile per expert and one step of the K loop.
    The kernel tests (tests/test_moe_triton.py, tests/test_moe_mxfp4.py) keep the 16-wide tiles, so that every
    kernel there runs several tiles, partial tiles and K loops of several steps. On the GPU this changes nothing
    (the "cpu" entries apply to the interpreter only)."""
    from backends.triton import moe
    entries = {name: dict(BN=64, BK=64) for name, e in moe.TILE_CONFIGS["cpu"].items() if "BK" in e}
    with moe.config(tiles={"cpu": entries}):
        yield
