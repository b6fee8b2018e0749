"""The repository-editing environment's setup (`env.name: repo`).

data.source=humaneval | mbpp: tasks generated from the problems (`tasks.generate_tasks`;
cached under `model.cache_dir`, else $TIDERL_CACHE or ~/.cache/tiderl), split as the code
environment splits them (HumanEval is held out and MBPP's training problems are trained on;
MBPP's evaluation split is held out). data.source=folder: the task folders in
`env.options.task_dir`; with `train/` and `eval/` subfolders those are the splits, else a fixed-seed
`env.options.eval_fraction` of the tasks is held out. At most `data.eval_size` held-out tasks are kept.
The oracle plays each task's fix with edit_file, then submits.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

from tiderl.envs.code.env import tool_call_text
from tiderl.envs.code.setup import code_tasks, shared_sandbox
from tiderl.envs.protocol import Task
from tiderl.envs.repo.env import RepoEnv
from tiderl.envs.repo.tasks import cached_tasks, load_task_folders
from tiderl.envs.setup import Setup, sample_tasks

if TYPE_CHECKING:
    from tiderl.config import RunConfig


def cache_dir(cfg: "RunConfig") -> Path:
    """Where generated repo tasks are cached."""
    if cfg.model.cache_dir:
        return Path(cfg.model.cache_dir)
    return Path(os.environ.get("TIDERL_CACHE") or Path.home() / ".cache" / "tiderl")


def oracle_turns(task: Task) -> list[str]:
    """The oracle: one turn per edit of the task's fix, then submit."""
    return [tool_call_text("edit_file", dict(edit)) for edit in task.meta.get("fix", [])] + [tool_call_text("submit", {})]


def folder_split(tasks: list[Task], fraction: float, seed: int) -> tuple[list[Task], list[Task]]:
    """(train, held out): a fixed-seed `fraction` held out, at least one of each when possible."""
    order = list(range(len(tasks)))
    random.Random(seed).shuffle(order)
    held = max(1, round(fraction * len(tasks))) if len(tasks) > 1 else len(tasks)
    keep = set(order[:held])
    return [t for i, t in enumerate(tasks) if i not in keep], [t for i, t in enumerate(tasks) if i in keep]


def repo_tasks(cfg: "RunConfig", setup: Setup) -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out tasks) of `data.source`."""
    data = cfg.data
    if data.source == "folder":
        root = Path(cfg.env.options.task_dir)
        if (root / "train").is_dir() and (root / "eval").is_dir():
            return load_task_folders(root / "train"), load_task_folders(root / "eval")
        return folder_split(load_task_folders(root), cfg.env.options.eval_fraction, data.seed)
    train_code, held_code = code_tasks(cfg)
    sandbox = shared_sandbox(setup, cfg)
    return cached_tasks(sandbox, train_code, cache_dir(cfg)), cached_tasks(sandbox, held_code, cache_dir(cfg))


def setup(cfg: "RunConfig") -> Setup:
    """Repo tasks of `data.source` and a factory of `RepoEnv`s sharing one sandbox."""
    out = Setup([], [], RepoEnv, cfg.data.source, oracle=oracle_turns)
    train, held_out = repo_tasks(cfg, out)
    out.train_tasks, out.eval_tasks = train, sample_tasks(held_out, cfg.data.eval_size, cfg.data.seed)
    out.make_env = _RepoFactory(out, cfg)
    return out


class _RepoFactory:
    """`make_env` of a repo setup: a `RepoEnv` on the setup's sandbox."""

    def __init__(self, setup: Setup, cfg: "RunConfig") -> None:
        self.setup, self.cfg = setup, cfg

    def __call__(self) -> RepoEnv:
        return RepoEnv(shared_sandbox(self.setup, self.cfg), self.cfg.env.max_observation_chars,
                       self.cfg.env.system_prompt or None)
