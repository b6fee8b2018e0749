"""Value pretraining (`tiderl pretrain-value`, docs/algorithms.md): fit a critic to the
Monte-Carlo returns of a dataset of trajectories, the targets SAO's critic learns online, so that
its first steps do not learn against a critic that knows nothing. The result is a normal
`ValueModel` directory that `algo.value_init` loads. Trajectories are stored as JSON lines
(`Trajectory.to_dict()`), one per line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tiderl.algos.advantages import discounted_returns, explained_variance, outcome_token_rewards
from tiderl.algos.losses import value_loss
from tiderl.train.batching import collate, micro_batch_indices, slice_batch
from tiderl.train.forward import token_values
from tiderl.train.learner import Learner
from tiderl.types import Trajectory


def save_trajectories(trajectories: Iterable[Trajectory], path: str | Path, mode: str = "w") -> int:
    """Write trajectories as JSON lines (`mode` "a": append them); returns how many."""
    n = 0
    with open(path, mode) as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict()) + "\n")
            n += 1
    return n


def load_trajectories(path: str | Path) -> list[Trajectory]:
    """Read JSON-lines trajectories; a malformed line raises ValueError naming its number."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{i} is not a tiderl trajectory ({exc}); write one "
                                 "Trajectory.to_dict() JSON object per line") from None
    if not out:
        raise ValueError(f"{path} holds no trajectories")
    return out


def monte_carlo_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Per-token returns over model tokens: the outcome reward on each trajectory's last action
    token, discounted back over action tokens only (observation tokens are skipped)."""
    return discounted_returns(outcome_token_rewards(rewards, action_mask), action_mask, gamma)


@torch.no_grad()
def value_fit(critic: torch.nn.Module, trajectories: list[Trajectory], pad_id: int,
              micro_batch_tokens: int, gamma: float = 1.0, device: str = "cpu",
              image_processor: Any = None) -> dict[str, float]:
    """Explained variance and mean squared error of `critic` against the Monte-Carlo returns
    (`image_processor`: a vision-language model's, for trajectories with images)."""
    critic.eval()
    full = collate(trajectories, pad_id, image_processor)
    values, returns = [], []
    for rows in micro_batch_indices(full.attention_mask.sum(1).tolist(), micro_batch_tokens):
        mb = slice_batch(full, rows).to(device)
        v = token_values(critic, mb.input_ids, mb.attention_mask, mb.pixels).float()
        r = monte_carlo_returns(mb.rewards, mb.action_mask, gamma)
        values.append(v[mb.action_mask > 0].cpu())
        returns.append(r[mb.action_mask > 0].cpu())
    v, r = torch.cat(values), torch.cat(returns)
    return {"explained_variance": explained_variance(v, r, torch.ones_like(v)),
            "mse": float(((v - r) ** 2).mean())}


def pretrain_value(critic: Learner, trajectories: list[Trajectory], pad_id: int, micro_batch_tokens: int,
                   epochs: int = 3, batch_size: int = 32, gamma: float = 1.0, device: str = "cpu",
                   seed: int = 0, holdout: float = 0.1, image_processor: Any = None) -> dict[str, Any]:
    """Fit `critic` to the trajectories' Monte-Carlo returns for `epochs` passes in shuffled
    batches of `batch_size`; a `holdout` fraction is kept out to measure the fit before and after.

    Returns {"train": n, "holdout": n, "steps": optimizer steps, "before": fit, "after": fit,
    "loss": last batch loss}, fits from `value_fit` on the held-out trajectories.
    """
    if not trajectories:
        raise ValueError("pretrain_value got no trajectories")
    rng = random.Random(seed)
    order = list(range(len(trajectories)))
    rng.shuffle(order)
    n_hold = int(len(order) * holdout) if len(order) >= 10 else 0
    held = [trajectories[i] for i in order[:n_hold]]
    train = [trajectories[i] for i in order[n_hold:]]
    fit = dict(gamma=gamma, device=device, image_processor=image_processor)
    before = value_fit(critic.model, held, pad_id, micro_batch_tokens, **fit) if held else {}
    steps, loss = 0, float("nan")
    for _ in range(epochs):
        rng.shuffle(train)
        for start in range(0, len(train), batch_size):
            batch = collate(train[start:start + batch_size], pad_id, image_processor)
            normalizer = float(batch.action_mask.sum())
            if normalizer == 0:
                continue
            parts = [slice_batch(batch, rows).to(device) for rows in
                     micro_batch_indices(batch.attention_mask.sum(1).tolist(), micro_batch_tokens)]

            def loss_fn(mb: Any, normalizer: float = normalizer) -> tuple[torch.Tensor, dict[str, float]]:
                v = token_values(critic.model, mb.input_ids, mb.attention_mask, mb.pixels)
                returns = monte_carlo_returns(mb.rewards, mb.action_mask, gamma)
                return value_loss(v, returns, mb.action_mask, normalizer)

            loss = critic.step(parts, loss_fn)["loss"]
            steps += 1
    after = value_fit(critic.model, held, pad_id, micro_batch_tokens, **fit) if held else {}
    return {"train": len(train), "holdout": len(held), "steps": steps, "before": before,
            "after": after, "loss": loss}
