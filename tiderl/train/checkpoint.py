"""Checkpoints that resume: the actor as a normal Hugging Face model dir, the critic, the optimizers.

Layout of a checkpoint directory:
    actor/                 loadable by `AutoModelForCausalLM.from_pretrained` (and `tiderl eval`)
    critic/                `ValueModel.save` (backbone dir + value head)
    trainer_state.pt       both optimizers' states, the step, the torch RNG state
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tiderl.models.loading import load_model, save_model_dir
from tiderl.train.critic import ValueModel
from tiderl.train.learner import Learner


def save_checkpoint(path: str | Path, step: int, actor: Learner, critic: Learner | None,
                    tokenizer: Any) -> Path:
    """Write a checkpoint of the actor, the critic (when the algorithm has one) and their
    optimizers at `step`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model_dir(actor.model, tokenizer, path / "actor")
    if critic is not None:
        critic.model.save(path / "critic")
    torch.save({
        "step": step,
        "actor_optimizer": actor.optimizer.state_dict(),
        "critic_optimizer": critic.optimizer.state_dict() if critic is not None else None,
        "torch_rng": torch.get_rng_state(),
    }, path / "trainer_state.pt")
    (path / "tiderl_checkpoint.json").write_text(json.dumps({"step": step}))
    return path


def load_checkpoint(path: str | Path, actor: Learner, critic: Learner | None) -> int:
    """Restore models and optimizers in place from `path`; returns the step to continue from."""
    path = Path(path)
    if not (path / "tiderl_checkpoint.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a tiderl checkpoint (no tiderl_checkpoint.json). Fix: point "
            "train.resume at a directory under <run_dir>/checkpoints/."
        )
    saved_actor = load_model(path / "actor", device="cpu")
    actor.model.load_state_dict(saved_actor.state_dict())
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    if critic is not None:
        if state["critic_optimizer"] is None:
            raise ValueError(f"{path} holds no critic (it was saved by a critic-free algorithm); "
                             "resume it with the same algo.name")
        critic.model.load_state_dict(ValueModel.load(path / "critic").state_dict())
        critic.optimizer.load_state_dict(state["critic_optimizer"])
    actor.optimizer.load_state_dict(state["actor_optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])
