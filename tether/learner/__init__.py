"""Models for training and rollout: load any HF causal LM, or build the embedded tiny preset."""

from tether.learner.model import build_tiny, ensure_tiny, load_model_and_tokenizer

__all__ = ["build_tiny", "ensure_tiny", "load_model_and_tokenizer"]
