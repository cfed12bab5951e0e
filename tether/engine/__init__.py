"""Inference engines: ``LocalEngine`` (in-process torch, continuous batching) and ``ScriptedEngine``
(replays given texts). An OpenAI-compatible remote engine arrives with the LLM-client issue."""

from tether.engine.base import GenerationResult, InferenceEngine, SamplingParams

__all__ = ["GenerationResult", "InferenceEngine", "SamplingParams"]
