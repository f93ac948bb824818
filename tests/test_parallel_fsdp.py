"""FSDP2 for the dense weights (parallelize(..., fsdp=True): fully_shard of the module over the whole mesh, the
routed experts left to expert parallelism), composed with cp and with ep: logits, loss, every gradient (the dense
ones gathered from their shards), QB biases and the full state dict as in tests/test_parallel_module.py against a
single-process run. 2 gloo ranks, tiny, T = 45."""
from dist_util import run_ranks
from test_parallel_module import _case


def test_fsdp_with_context_parallel(_fresh_seed):
    run_ranks(_case, 2, _fresh_seed, ("cp",), (2,), None, True)


def test_fsdp_with_expert_parallel(_fresh_seed):
    run_ranks(_case, 2, _fresh_seed, ("ep",), (2,), 18, True)
