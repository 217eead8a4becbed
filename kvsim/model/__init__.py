"""A real LLM in kvsim: loading (SmolLM2 or a local HF directory), the attention hook, runs."""

from kvsim.model.loading import Codec, LoadedModel, load_model, model_info

__all__ = ["Codec", "LoadedModel", "load_model", "model_info"]
