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
