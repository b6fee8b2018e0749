"""Rollout engines: token-in/token-out generation with log-probs and versioned weights."""

from tiderl.rollout.base import Completion, Engine, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
