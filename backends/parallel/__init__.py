"""Running a compiled model past one process on torch.distributed: a DeviceMesh with named dims ``dp`` (data
parallel), ``ep`` (expert parallel) and ``cp`` (context parallel).

* :mod:`backends.parallel.context`: the context-parallel ops (KDA by state passing, the short conv, MLA).
* :mod:`backends.parallel.module`: :func:`parallelize` (``m.parallelize(mesh)`` / ``dsl.compile(..., mesh=)``).
"""
from .context import gather_lengths, kda_chunk_cp, mla_attention_cp, short_conv_cp, split_sizes

__all__ = ["gather_lengths", "kda_chunk_cp", "mla_attention_cp", "short_conv_cp", "split_sizes"]
