"""Turning trajectories into padded tensors, and packing them into micro-batches by tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiderl.types import Trajectory


@dataclass
class Batch:
    """Right-padded tensors for a list of trajectories (all `[B, T]` unless noted).

    input_ids / attention_mask: model inputs (attention 0 on padding).
    action_mask: 1.0 on sampled tokens (`loss_mask`), 0 on prompt, observations and padding.
    behavior_logprobs: the engine's log-prob of each sampled token (0 elsewhere).
    rewards: `[B]` scalar rewards.
    num_action_tokens: `[B]` sampled tokens per trajectory.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    rewards: torch.Tensor
    num_action_tokens: torch.Tensor

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(t.to(device) for t in self.__dict__.values()))


def collate(trajectories: list[Trajectory], pad_id: int) -> Batch:
    """Pad trajectories on the right to the longest one."""
    if not trajectories:
        raise ValueError("collate() got no trajectories")
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
    return Batch(input_ids, attention, action, behavior, rewards, action.sum(dim=1))


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
    return Batch(
        input_ids=batch.input_ids[idx, :width],
        attention_mask=batch.attention_mask[idx, :width],
        action_mask=batch.action_mask[idx, :width],
        behavior_logprobs=batch.behavior_logprobs[idx, :width],
        rewards=batch.rewards[idx],
        num_action_tokens=batch.num_action_tokens[idx],
    )


# --------------------------------------------------------------------------------------------
# Packed layout: several trajectories share one row.


@dataclass
class PackedBatch:
    """Trajectories concatenated into rows (all `[R, L]` unless noted), no padding between them.

    input_ids: tokens, `pad_id` after the last trajectory of a row.
    position_ids: 0, 1, 2, ... restarting at every trajectory (0 on padding).
    seq_ids: index of the token's trajectory in the list given to `pack_trajectories`
        (-1 on padding): the sequence structure that `algos.aggregation` reads.
    token_index: position of the token inside its own trajectory (-1 on padding), so that
        (seq_ids, token_index) addresses the same token in the padded layout of `collate`.
    action_mask / behavior_logprobs: as in `Batch`; the first token of every trajectory has
        action 0 (nothing of its own trajectory precedes it).
    rewards / num_action_tokens: `[N]`, per trajectory, in the order given.

    The model must not let a trajectory attend to another one in the same row:
    `attention_mask()` is the block-diagonal causal mask that guarantees it.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    token_index: torch.Tensor
    action_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    rewards: torch.Tensor
    num_action_tokens: torch.Tensor

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> "PackedBatch":
        return PackedBatch(*(t.to(device) for t in self.__dict__.values()))

    def attention_mask(self) -> torch.Tensor:
        """Boolean `[R, 1, L, L]`: query i may attend to key j iff j <= i and both tokens belong
        to the same trajectory (padding counts as one more sequence, so no row is all-masked)."""
        length = self.input_ids.shape[1]
        pos = torch.arange(length, device=self.input_ids.device)
        causal = pos.unsqueeze(1) >= pos.unsqueeze(0)
        same = self.seq_ids.unsqueeze(2) == self.seq_ids.unsqueeze(1)
        return (same & causal).unsqueeze(1)

    def row(self, r: int) -> "PackedBatch":
        """Row r alone, trimmed to its used length (per-trajectory fields stay whole)."""
        used = int((self.seq_ids[r] >= 0).sum().item())
        width = max(used, 1)
        return PackedBatch(
            self.input_ids[r:r + 1, :width], self.position_ids[r:r + 1, :width],
            self.seq_ids[r:r + 1, :width], self.token_index[r:r + 1, :width],
            self.action_mask[r:r + 1, :width], self.behavior_logprobs[r:r + 1, :width],
            self.rewards, self.num_action_tokens)


def plan_packed_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """First-fit decreasing: put each sequence (longest first) into the first row with room.

    Every row's total length is <= row_tokens, except a row holding a single sequence that is
    longer than row_tokens on its own (it must still be trained on). Deterministic: ties keep the
    input order.
    """
    if row_tokens < 1:
        raise ValueError(f"row_tokens must be >= 1; got {row_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for r, u in enumerate(used):
            if u + lengths[i] <= row_tokens:
                rows[r].append(i)
                used[r] += lengths[i]
                break
        else:
            rows.append([i])
            used.append(lengths[i])
    return rows


def pack_trajectories(trajectories: list[Trajectory], pad_id: int, row_tokens: int
                      ) -> PackedBatch:
    """Concatenate trajectories into rows of at most `row_tokens` tokens (`plan_packed_rows`)."""
    if not trajectories:
        raise ValueError("pack_trajectories() got no trajectories")
    plan = plan_packed_rows([len(t.tokens) for t in trajectories], row_tokens)
    width = max(sum(len(trajectories[i].tokens) for i in row) for row in plan)
    shape = (len(plan), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    seq_ids = torch.full(shape, -1, dtype=torch.long)
    token_index = torch.full(shape, -1, dtype=torch.long)
    action = torch.zeros(shape, dtype=torch.float32)
    behavior = torch.zeros(shape, dtype=torch.float32)
    for r, row in enumerate(plan):
        start = 0
        for i in row:
            t = trajectories[i]
            n = len(t.tokens)
            span = slice(start, start + n)
            input_ids[r, span] = torch.tensor(t.tokens, dtype=torch.long)
            position_ids[r, span] = torch.arange(n)
            seq_ids[r, span] = i
            token_index[r, span] = torch.arange(n)
            action[r, span] = torch.tensor(t.loss_mask, dtype=torch.float32)
            action[r, start] = 0.0  # as in collate: a trajectory's first token is never scored
            behavior[r, span] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
            start += n
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    num_action = torch.zeros(len(trajectories), dtype=torch.float32).index_add_(
        0, seq_ids[action > 0], torch.ones(int((action > 0).sum().item())))
    return PackedBatch(input_ids, position_ids, seq_ids, token_index, action, behavior, rewards,
                       num_action)


def padded_to_packed(x: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Lay a padded `[N, T]` per-token tensor (rows in trajectory order, as from `collate`) out
    like `packed`: out[r, c] = x[seq_ids[r, c], token_index[r, c]], 0 on padding."""
    valid = packed.seq_ids >= 0
    out = x[packed.seq_ids.clamp(min=0), packed.token_index.clamp(min=0)]
    return torch.where(valid, out, torch.zeros_like(out))


def packed_to_padded(x: torch.Tensor, packed: PackedBatch, width: int) -> torch.Tensor:
    """The inverse of `padded_to_packed`: a `[N, width]` tensor, 0 where no packed token lands."""
    valid = packed.seq_ids >= 0
    out = torch.zeros(packed.rewards.shape[0], width, dtype=x.dtype, device=x.device)
    out[packed.seq_ids[valid], packed.token_index[valid]] = x[valid]
    return out
