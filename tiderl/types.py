"""The wire format: the records that cross from rollout to training.

A `Trajectory` is the only thing the trainer ever sees of a rollout. Every per-token list has
the same length as `tokens`. Tokens are never re-tokenized after sampling: the agent loop
appends observation tokens to the sampled tokens as they are.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

# Forced tokens (prompt, tool observations) were not sampled by any policy.
NO_VERSION = -1


@dataclass
class Trajectory:
    """One finished episode, token by token.

    tokens: the whole sequence: prompt, every model turn, every tool/env observation.
    loss_mask: 1 where the policy sampled the token, 0 where it was forced.
    behavior_logprobs: log-prob of each sampled token under the engine that sampled it (0.0 where
        `loss_mask` is 0).
    policy_version: the weight version that sampled each token (`NO_VERSION` where forced).
    reward / reward_parts: the scalar reward and its named parts (outcome, format, ...).
    task_id / group_id: where it came from (`group_id` groups rollouts of one prompt).
    env_info: metrics the environment reports (success, f1, tool errors, ...).
    num_turns: model turns taken; stop_reason: why the episode ended
        ("answer", "max_turns", "max_tokens", "length", "error").
    annotations: per-token lists computed after the episode, before training (e.g. "values":
        critic values, "ref_logprobs": reference log-probs), each one entry per token.
    images: the episode's images (PIL images) in the order their placeholder tokens appear in
        `tokens` (forced, loss_mask 0); the model's image inputs (pixel values, grid sizes) are
        computed from them by its processor. Empty for a text-only episode.
    """

    tokens: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    policy_version: list[int]
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    task_id: str = ""
    group_id: str = ""
    env_info: dict[str, Any] = field(default_factory=dict)
    num_turns: int = 0
    stop_reason: str = ""
    annotations: dict[str, list[float]] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "behavior_logprobs", "policy_version"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory.{name} has length {len(getattr(self, name))}, tokens has {n}: "
                    "every per-token field must have one entry per token"
                )

    @property
    def num_action_tokens(self) -> int:
        """Tokens the policy sampled (the ones that carry loss)."""
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict: images as PNG data URLs (`from_dict` reads them back
        pixel for pixel)."""
        d = dict(self.__dict__)
        if self.images:
            d["images"] = [i if isinstance(i, str) else image_to_data_url(i) for i in self.images]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        if d.get("images"):
            d = {**d, "images": [image_from_data_url(i) if isinstance(i, str) else i for i in d["images"]]}
        return cls(**d)


def image_to_data_url(image: Any) -> str:
    """A PIL image as a PNG data URL."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_from_data_url(url: str) -> Any:
    """The RGB PIL image of a data URL `image_to_data_url` wrote (a trusted file's: for a client's
    image, `tiderl.serve.images.decode_data_url` checks its size and format)."""
    from PIL import Image

    if not url.startswith("data:image/") or ";base64," not in url:
        raise ValueError(f"an image must be a base64 data:image/... URL, got {url[:40]!r}")
    return Image.open(io.BytesIO(base64.b64decode(url.split(";base64,", 1)[1]))).convert("RGB")


@dataclass(kw_only=True)
class TokenRecord:
    """A token sequence growing in the layout of a `Trajectory` (the agent loop's episodes, the
    server's recorded sessions): each token with its loss mask, behaviour log-prob and version."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    policy_version: list[int] = field(default_factory=list)

    def append_forced(self, ids: list[int]) -> None:
        """Append tokens no policy sampled (prompt, observations, forced end-of-turn)."""
        self.tokens.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.behavior_logprobs.extend([0.0] * len(ids))
        self.policy_version.extend([NO_VERSION] * len(ids))

    def append_sampled(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append the engine's sampled tokens with their log-probs and weight versions."""
        self.tokens.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.behavior_logprobs.extend(logprobs)
        self.policy_version.extend(versions)
