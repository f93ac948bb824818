"""Graph passes and the pass manager. Importing this package registers the built-in passes."""
from .manager import PASSES, PIPELINES, STAGES, Pass, PassManager, pipeline, register_pass  # noqa: F401
from . import verify, infer_shapes, canonicalize, batch_attn_residual, fuse_tiles  # noqa: F401,E402
