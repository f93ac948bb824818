"""Hugging Face checkpoints: ``dsl.from_hf`` (load), ``m.save_hf`` (save), ``mtc import-hf`` (config -> spec).

Families and their name/layout tables: :mod:`dsl.checkpoint.families`; MXFP4: :mod:`dsl.checkpoint.mxfp4`;
reading and writing safetensors: :mod:`dsl.checkpoint.hf`. Needs the ``safetensors`` package.
"""
from .hf import Checkpoint, LoadReport, from_hf, import_hf, save_hf

__all__ = ["Checkpoint", "LoadReport", "from_hf", "import_hf", "save_hf"]
