"""Inference engines: the local in-process torch engine and (later) an OpenAI-compatible remote one."""

from tether.engine.base import GenerationResult, InferenceEngine, SamplingParams

__all__ = ["GenerationResult", "InferenceEngine", "SamplingParams"]
