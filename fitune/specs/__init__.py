"""Model and GPU specs and their built-in catalogs."""

from .gpu import GpuSpec, resolve_gpu
from .model import ModelSpec, load_model_spec, model_spec_from_hf_config

__all__ = ["GpuSpec", "ModelSpec", "load_model_spec", "model_spec_from_hf_config", "resolve_gpu"]
