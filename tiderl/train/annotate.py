"""Preparations: per-token passes that make a finished trajectory ready to train, computed ahead
of the step by the asynchronous buffer (`tiderl.system.buffer.ReadyBuffer`), overlapped with
training: the pixel inputs of an episode's images (`ImagePixels`), critic values from a snapshot
of the critic, and reference log-probs.

A preparation is a callable that annotates a list of trajectories in place
(`Trajectory.annotations[key]`, one float per token). One that holds a copy of trained weights
also has `refresh(model)`, which the trainer calls after every optimizer step, and may have
`close()`. `train_step` uses the annotations when every trajectory of the batch carries them.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch

from tiderl.models.vision import prepare_image_inputs
from tiderl.train.batching import collate, micro_batch_indices, slice_batch
from tiderl.train.forward import token_logprobs, token_values
from tiderl.types import Trajectory

Preparation = Callable[[list[Trajectory]], None]  # see the module docstring


@torch.no_grad()
def annotate_per_token(trajectories: list[Trajectory], key: str, forward: Callable[[Any], torch.Tensor],
                       pad_id: int, micro_batch_tokens: int, device: str,
                       after: Callable[[list[int]], None] | None = None, image_processor: Any = None) -> None:
    """Run `forward(micro_batch) -> [b, t]` over the trajectories (right-padded, in micro-batches
    of at most `micro_batch_tokens`) and store each row's first len(tokens) entries as
    `annotations[key]`; `after(rows)`, when given, runs after each micro-batch's forward.
    `image_processor`: for trajectories with images (`collate`)."""
    batch = collate(trajectories, pad_id, image_processor)
    lengths = [len(t.tokens) for t in trajectories]
    for rows in micro_batch_indices(lengths, micro_batch_tokens):
        out = forward(slice_batch(batch, rows).to(device)).float().cpu()
        for i, row in enumerate(rows):
            trajectories[row].annotations[key] = out[i, : lengths[row]].tolist()
        if after is not None:
            after(rows)


class ImagePixels:
    """The image stage: the image processor runs once per finished trajectory, ahead of the step;
    the critic and reference preparations and the trainer's forward reuse its pixel inputs
    (`models.vision.prepare_image_inputs`). Not the vision tower's pass: it trains, and the critic
    snapshot and the reference have towers of their own (docs/multimodal.md)."""

    def __init__(self, image_processor: Any):
        self.image_processor = image_processor

    def __call__(self, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            prepare_image_inputs(self.image_processor, t.images)


class CriticSnapshot:
    """A copy of the critic for the preparation thread, refreshed after every trainer step, so
    values are computed while the trainer updates the live critic (ref/critic pipelining). The
    values therefore lag the live critic by the steps between their computation and the
    trajectory's training step. To measure that lag, every trajectory it annotates also gets
    `annotations["values_version"]`: the number of refreshes the snapshot had when it computed the
    values (one entry per token, all equal); the rollout pool turns it into `critic/lag_*`."""

    def __init__(self, critic: torch.nn.Module, pad_id: int, micro_batch_tokens: int, device: str,
                 image_processor: Any = None):
        self.model = copy.deepcopy(critic).eval().requires_grad_(False)
        self.image_processor = image_processor  # for trajectories with images
        self.pad_id = pad_id
        self.micro_batch_tokens = micro_batch_tokens
        self.device = device
        self.lock = threading.Lock()
        self.refreshes = 0  # trainer steps whose critic this copy has taken

    def refresh(self, critic: torch.nn.Module) -> None:
        with self.lock:
            self.model.load_state_dict(critic.state_dict())
            self.refreshes += 1

    def __call__(self, trajectories: list[Trajectory]) -> None:
        """Put `annotations["values"]` (one critic value per token) on each trajectory."""

        used = [0]  # the refresh count of the weights the latest micro-batch ran with

        def values(mb: Any) -> torch.Tensor:
            with self.lock:  # per micro-batch, so a refresh never waits for a whole batch
                used[0] = self.refreshes
                return token_values(self.model, mb.input_ids, mb.attention_mask, mb.pixels)

        def stamp(rows: list[int]) -> None:
            for row in rows:
                trajectories[row].annotations["values_version"] = [float(used[0])] * len(trajectories[row].tokens)

        annotate_per_token(trajectories, "values", values, self.pad_id, self.micro_batch_tokens, self.device,
                           after=stamp, image_processor=self.image_processor)


class RefLogprobs:
    """Reference-model log-probs of every token (`annotations["ref_logprobs"]`, 0 on forced
    tokens): the reference is frozen, so its forward pass can run any time before the step."""

    def __init__(self, ref: torch.nn.Module, pad_id: int, micro_batch_tokens: int, device: str,
                 temperature: float = 1.0, image_processor: Any = None):
        self.ref = ref
        self.image_processor = image_processor  # for trajectories with images
        self.temperature = temperature  # the rollouts' (forward.logprob_temperature), as train_step scores them
        self.pad_id = pad_id
        self.micro_batch_tokens = micro_batch_tokens
        self.device = device

    def __call__(self, trajectories: list[Trajectory]) -> None:
        def logprobs(mb: Any) -> torch.Tensor:
            lp, _ = token_logprobs(self.ref, mb.input_ids, mb.attention_mask, temperature=self.temperature,
                                   pixels=mb.pixels)
            return lp * mb.action_mask

        annotate_per_token(trajectories, "ref_logprobs", logprobs, self.pad_id, self.micro_batch_tokens,
                           self.device, image_processor=self.image_processor)
