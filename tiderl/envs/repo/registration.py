"""The repository-editing environment as `env.name` finds it: its options and data sources
(`tiderl.envs.registration`). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.envs.code.registration import FORMER_KEYS as CODE_FORMER_KEYS
from tiderl.envs.code.registration import SOURCES as CODE_SOURCES
from tiderl.envs.code.registration import CodeOptions
from tiderl.envs.registration import BuiltinEnvironment
from tiderl.options import need, opt

# data.source values: tasks generated from the code environment's problems, or a folder of your own.
SOURCES = (*CODE_SOURCES, "folder")


@dataclass
class RepoOptions(CodeOptions):
    """The repo environment's options: the sandbox's limits and, for data.source=folder, the tasks."""

    task_dir: str = opt("", "data.source=folder: a folder of task folders (docs/env_code.md).")
    eval_fraction: float = opt(0.2, "data.source=folder without train/ and eval/ subfolders: fraction of the "
                               "tasks held out for evaluation.")

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        folder = cfg.data.source == "folder"
        need(not folder or bool(self.task_dir), "task_dir", "data.source=folder reads task folders from it",
             "set env.options.task_dir=/path/to/tasks")
        need(folder or not self.task_dir, "task_dir",
             f"set to {self.task_dir!r}, but only data.source=folder reads it (data.source={cfg.data.source}), so it "
             "would be ignored", "remove env.options.task_dir, or set data.source=folder")
        need(0 < self.eval_fraction < 1, "eval_fraction", "must be in (0, 1)", "use 0.2")


ENVIRONMENT = BuiltinEnvironment(
    setup_path="tiderl.envs.repo.setup:setup",
    Options=RepoOptions,
    sources=SOURCES,
    former_keys={**CODE_FORMER_KEYS, "data.task_dir": "task_dir", "data.eval_fraction": "eval_fraction"},
)
