"""Turning trajectories into right-padded tensors, and grouping them into micro-batches by tokens."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from tiderl.models.vision import image_inputs
from tiderl.types import Trajectory


@dataclass
class Batch:
    """Right-padded tensors for a list of trajectories (all `[B, T]` unless noted).

    input_ids / attention_mask: model inputs (attention 0 on padding).
    action_mask: 1.0 on sampled tokens (`loss_mask`), 0 on prompt, observations and padding.
    behavior_logprobs: the engine's log-prob of each sampled token (0 elsewhere).
    rewards: `[B]` scalar rewards.
    num_action_tokens: `[B]` sampled tokens per trajectory.
    pixels: per row, the pixel inputs of the trajectory's images (`models.vision.image_inputs`; None
        for a row without); None when no row has images.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    rewards: torch.Tensor
    num_action_tokens: torch.Tensor
    pixels: list[dict[str, torch.Tensor] | None] | None = None

    def to(self, device: torch.device | str) -> "Batch":
        pixels = None if self.pixels is None else [
            None if p is None else {k: v.to(device) for k, v in p.items()} for p in self.pixels]
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self) if f.name != "pixels"), pixels=pixels)


def collate(trajectories: list[Trajectory], pad_id: int, image_processor: Any = None) -> Batch:
    """Pad trajectories on the right to the longest one; the images of those that show some
    become their rows' pixel inputs through `image_processor` (the model processor's)."""
    if not trajectories:
        raise ValueError("collate() got no trajectories")
    pixels = None
    if any(t.images for t in trajectories):
        if image_processor is None:
            raise ValueError("these trajectories carry images (Trajectory.images) but no image processor was given: "
                             "pass the vision-language model's processor.image_processor (docs/multimodal.md)")
        # A placeholder token the policy sampled is text: features go to the forced ones only.
        pixels = [{**image_inputs(image_processor, t.images),
                   "forced": torch.tensor([m == 0 for m in t.loss_mask])} if t.images else None
                  for t in trajectories]
    width = max(len(t.tokens) for t in trajectories)
    b = len(trajectories)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    action = torch.zeros((b, width), dtype=torch.float32)
    behavior = torch.zeros((b, width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        n = len(t.tokens)
        input_ids[i, :n] = torch.tensor(t.tokens, dtype=torch.long)
        attention[i, :n] = 1
        action[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        behavior[i, :n] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
    # A trajectory's first token can never be scored (nothing precedes it).
    action[:, 0] = 0.0
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    return Batch(input_ids, attention, action, behavior, rewards, action.sum(dim=1), pixels)


def micro_batch_indices(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices so that each group's padded size (count x longest) fits the budget.

    Sorting by length keeps padding small; every index appears exactly once. A sequence longer
    than the budget gets a micro-batch of its own (it must still be trained on).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > token_budget:
            groups.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        groups.append(current)
    return groups


def slice_batch(batch: Batch, rows: list[int]) -> Batch:
    """The sub-batch of `rows`, trimmed to its own longest sequence."""
    idx = torch.tensor(rows, dtype=torch.long)
    width = int(batch.attention_mask[idx].sum(dim=1).max().item())
    # The [B, T] tensors trimmed to `width`, the [B] ones (rewards, num_action_tokens) picked.
    tensors = (getattr(batch, f.name) for f in fields(batch) if f.name != "pixels")
    pixels = None if batch.pixels is None else [batch.pixels[r] for r in rows]
    return Batch(*(t[idx, :width] if t.dim() == 2 else t[idx] for t in tensors), pixels=pixels)


@dataclass
class Packing:
    """A right-padded `[B, T]` micro-batch as one row of its real tokens, no padding, and with
    every prefix that several sequences share (a group's prompt) held once.

    input_ids / position_ids: `[1, L]`; positions restart at 0 with every sequence.
    valid: `[B, T]` bool, the positions the packed row holds (`x[valid]` packs a `[B, T]`
        tensor; the packed row is in this order): the real tokens, less those of a prefix an
        earlier row already holds.
    gather: `[B, T]` long, the packed index of each real token (of the earlier row's copy, for a
        shared prefix; 0 on padding), so that `packed[gather]` lays a packed tensor out padded
        again (padding then holds a copy of the row's first token, which causal attention never
        lets a real token see).
    keep: the packed positions whose next token is scored (`action_mask` 1 there), and
        `keep_rows` / `keep_cols`: the `[B, T]` position of that next token.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    valid: torch.Tensor
    gather: torch.Tensor
    keep: torch.Tensor
    keep_rows: torch.Tensor
    keep_cols: torch.Tensor


# Above this many [row, row, column] comparisons, prefixes are not looked for (memory: one byte each).
_SHARE_LIMIT = 2**25


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor,
         share_prefixes: bool = True) -> Packing:
    """The packed layout of a right-padded micro-batch (every row's real tokens at its start).

    With `share_prefixes`, a row's first tokens that equal an earlier row's first tokens are not
    packed again: the row reads them (their keys and values, and the logits at the last of them)
    from the earlier row's copy. In a causal model a position's hidden states depend only on the
    tokens up to it, so the results are those of packing every row whole; the gradient of a
    shared position sums over the rows that read it, as it would over the copies.
    """
    valid = attention_mask > 0
    b, t = valid.shape
    columns = torch.arange(t, device=input_ids.device).expand(b, t)
    if share_prefixes and b > 1 and b * b * t <= _SHARE_LIMIT:
        # owner[r, c]: the first row whose first c + 1 tokens are row r's (r itself when none is).
        ids = torch.where(valid, input_ids, -1)
        differ = (ids[:, None, :] != ids[None, :, :]) | ~valid[None, :, :]  # [a, r, T]
        common = torch.where(differ.any(-1), differ.to(torch.uint8).argmax(-1), t)  # [a, r] prefix length
        reaches = (common[:, :, None] > columns[0][None, None, :]).to(torch.uint8)  # [a, r, T]
        owner = reaches.argmax(0)  # the first maximum: the earliest row
        owned = valid & (owner == torch.arange(b, device=input_ids.device)[:, None])
    else:
        owner, owned = torch.arange(b, device=input_ids.device)[:, None].expand(b, t), valid
    flat = torch.cumsum(owned.reshape(-1).long(), 0).reshape(b, t) - 1
    index = flat[owner, columns]
    gather = torch.where(valid, index, index[:, :1].expand(b, t))
    # Token t is scored from the logits of token t - 1 (same row): keep those packed positions.
    scored = (action_mask > 0) & valid
    scored[:, 0] = False
    rows, cols = scored.nonzero(as_tuple=True)
    return Packing(input_ids=input_ids[owned].unsqueeze(0), position_ids=columns[owned].unsqueeze(0),
                   valid=owned, gather=gather, keep=gather[rows, cols - 1], keep_rows=rows, keep_cols=cols)
