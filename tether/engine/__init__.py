"""Inference engines: ``LocalEngine`` (in-process torch, continuous batching), ``RemoteEngine`` (an
OpenAI-compatible server: token ids in, token ids and logprobs out, weights pushed to its update endpoint) and
``ScriptedEngine`` (replays given texts)."""

from tether.engine.base import GenerationResult, InferenceEngine, SamplingParams

__all__ = ["GenerationResult", "InferenceEngine", "SamplingParams"]
