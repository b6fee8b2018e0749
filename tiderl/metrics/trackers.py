"""Experiment trackers beside `metrics.jsonl` (`log.trackers`): each gets the resolved config once
and every step's scalars, and is configured by its own variables: W&B by WANDB_MODE (`offline`
writes the run under WANDB_DIR, default the run dir), WANDB_PROJECT (default tiderl); MLflow by
MLFLOW_TRACKING_URI (a local store works) and MLFLOW_EXPERIMENT_NAME (default tiderl). MLflow's
metric names write `/` as `.` (`eval.success`): its file store keeps a metric as a file under
its name, and `reward` beside `reward/shaped_mean` would be a file and a folder at once."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

from tiderl.options import need


class WandbTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "tiderl"), name=run_dir.name, config=config,
                              dir=None if os.environ.get("WANDB_DIR") else str(run_dir))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "tiderl"))
        self.run = mlflow.start_run(run_name=run_dir.name)
        mlflow.log_dict(config, "config.yaml")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


# log.trackers name (also the module it imports; the `trackers` extra installs both) -> its class.
TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(names: list[str], run_dir: Path, cfg: Any) -> list[Any]:
    """The trackers `names` (`TRACKERS`), started with the resolved config `cfg` (a dataclass)."""
    config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg or {})
    return [TRACKERS[name](run_dir, config) for name in names]


def check_trackers(names: list[str]) -> None:
    """`log.trackers`: each a tracker of `TRACKERS` whose package is installed (at config load,
    before any work)."""
    for name in names:
        need(name in TRACKERS, "trackers", f"{name!r} is not a tracker", f"use {' or '.join(TRACKERS)}")
        need(importlib.util.find_spec(name) is not None, "trackers", f"{name} is not installed",
             "pip install 'tiderl[trackers]'")
