"""Checkpoints that resume: the actor as a normal Hugging Face model dir, the critic, the
optimizers, and whatever else the caller hands over (RNG states, the schedule, curiosity counts).

Layout of a checkpoint directory:
    actor/                 loadable by `AutoModelForCausalLM.from_pretrained` (and `tiderl eval`)
    critic/                `ValueModel.save` (backbone dir + value head), when the algorithm has one
    trainer_state.pt       both optimizers' states, the step, and the caller's `state` (RNGs,
                           task stream, scheduler, ...)
    curiosity.json         the curiosity counts (when given)
    tiderl_checkpoint.json the completion marker, written last

Writes are atomic: everything goes into a hidden temporary directory beside the target, the
marker last, then one rename makes it the checkpoint. A directory without the marker is a
half-written checkpoint (the process died while saving): `latest_checkpoint` skips it with a log
line and `load_checkpoint` refuses it, naming `train.resume=auto`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from tiderl.models.loading import load_model, save_model_dir
from tiderl.train.critic import ValueModel
from tiderl.train.learner import Learner

logger = logging.getLogger(__name__)

MARKER = "tiderl_checkpoint.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(path: str | Path, step: int, actor: Learner, critic: Learner | None,
                    tokenizer: Any, state: dict[str, Any] | None = None,
                    curiosity: dict[str, Any] | None = None, meta: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint of the actor, the critic (when the algorithm has one), their
    optimizers and `state` at `step`, atomically (see the module docstring). `meta` goes into the
    marker (e.g. the algorithm's name, for error messages on resume). Returns the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model_dir(actor.model, tokenizer, tmp / "actor")
    if critic is not None:
        critic.model.save(tmp / "critic")
    torch.save({
        "step": step,
        "actor_optimizer": actor.optimizer.state_dict(),
        "critic_optimizer": critic.optimizer.state_dict() if critic is not None else None,
        "torch_rng": torch.get_rng_state(),
        **(state or {}),
    }, tmp / "trainer_state.pt")
    if curiosity is not None:
        (tmp / "curiosity.json").write_text(json.dumps(curiosity))
    (tmp / MARKER).write_text(json.dumps({"step": step, "time": time.time(), "has_critic": critic is not None,
                                          **(meta or {})}))
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    if path.exists():  # e.g. `final` saved again: swap, then delete the old one
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)
    return path


def is_complete(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def latest_checkpoint(checkpoints: str | Path) -> Path | None:
    """The complete `step_N` checkpoint with the largest N under `checkpoints` (None when there
    is none). Half-written ones are skipped with a log line."""
    root = Path(checkpoints)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in sorted(root.iterdir()):
        if not p.is_dir():
            continue
        m = _STEP_DIR.match(p.name)
        if m is None or not is_complete(p):
            if m is not None or ".tmp-" in p.name:
                logger.warning("ignoring %s: a half-written checkpoint (no %s completion marker; the run "
                               "stopped while saving it)", p, MARKER)
            continue
        if best is None or int(m.group(1)) > best[0]:
            best = (int(m.group(1)), p)
    return None if best is None else best[1]


def prune_checkpoints(checkpoints: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest complete `step_N` checkpoints (0 = keep all), and
    the temporary directories of saves that never finished (left by a process that died while
    saving; this process's own are in use); returns what it deleted."""
    root = Path(checkpoints)
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(".") and ".tmp-" in p.name
            and not p.name.endswith(f".tmp-{os.getpid()}")]
    if keep_last > 0:
        steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                       if (m := _STEP_DIR.match(p.name)) and is_complete(p))
        gone += [p for _, p in steps[:-keep_last]]
    for p in gone:
        shutil.rmtree(p)
    return gone


def load_checkpoint(path: str | Path, actor: Learner, critic: Learner | None) -> dict[str, Any]:
    """Restore models and optimizers in place from `path`; returns the saved trainer state (its
    "step" is the step to continue from; the caller restores the rest)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"train.resume={path}: no such checkpoint directory. Fix: train.resume=auto "
                                "(the latest complete checkpoint of run_dir) or a <run_dir>/checkpoints/step_N dir.")
    if not is_complete(path):
        if (path / "actor").exists() or (path / "trainer_state.pt").exists() or ".tmp-" in path.name:
            raise FileNotFoundError(
                f"{path} is a half-written checkpoint: it has no {MARKER} completion marker (the run stopped "
                "while saving it). Fix: train.resume=auto picks the latest complete checkpoint, or name an "
                "earlier <run_dir>/checkpoints/step_N.")
        raise FileNotFoundError(
            f"{path} is not a tiderl checkpoint (no {MARKER}). Fix: train.resume=auto, or point "
            "train.resume at a <run_dir>/checkpoints/step_N directory.")
    marker = json.loads((path / MARKER).read_text())
    saved_actor = load_model(path / "actor", device="cpu")
    actor.model.load_state_dict(saved_actor.state_dict())
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    if critic is not None:
        if state["critic_optimizer"] is None or not (path / "critic").is_dir():
            saved_by = f" (algo.name={marker['algo']})" if marker.get("algo") else ""
            raise ValueError(
                f"{path} holds no critic/: it was saved by an algorithm without a critic{saved_by}, and this "
                "run's algorithm needs one. Fix: resume it with the algo.name it was trained with (see "
                "config.yaml beside its checkpoints/).")
        critic.model.load_state_dict(ValueModel.load(path / "critic").state_dict())
        critic.optimizer.load_state_dict(state["critic_optimizer"])
    actor.optimizer.load_state_dict(state["actor_optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return state
