"""What a run trains and evaluates on: a `Setup` (tasks + an environment factory), built by the
environment that `env.name` names.

`load_setup(cfg)` resolves `env.name` (a built-in's registration from `tiderl.registry.ENVIRONMENTS`,
or a user's import path; `tiderl.envs.registration`) and calls its `setup`: a function
`setup(cfg) -> Setup`, or a class with such a classmethod. That is the whole required contract
of a new environment (its options, data sources and warm start are optional):

    class CountEnv:                          # implements tiderl.envs.protocol.Env
        @classmethod
        def setup(cls, cfg) -> Setup:
            tasks = [...]
            return Setup(train_tasks=tasks[:-20], eval_tasks=tasks[-20:], make_env=cls)

`tiderl check-env mypkg.myenv:CountEnv` runs the contract checks on it (`tiderl.envs.check`).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiderl.envs.protocol import Env, Task
from tiderl.envs.registration import environment

if TYPE_CHECKING:
    from tiderl.config import RunConfig


@dataclass
class Setup:
    """The tasks to train on, the held-out tasks to evaluate on, and one fresh environment per
    episode (`make_env()`).

    name: the data source (for logs and tables); split: the eval split ("" when there is one).
    oracle: the scripted solution of a task as assistant turns (`tiderl eval --oracle` plays
        them to measure the environment's ceiling); None when the environment has none.
    eval_chunk_size: tasks evaluated at once (0 = all; 1 for a backend that serves one
        session at a time).
    store: the knowledge graph of the in-memory KG setups (its warm start and drift read it).
    backends: resources shared by every environment of the setup (a DB backend, a SPARQL
        client), built on first use by `make_env`; they stay in the process that built them
        (a Setup sent to a Ray worker builds its own).
    on_step: called by the recipe with the policy version once before the first episode and
        after every optimizer step; an environment whose world changes during training
        (the KG's drift, `tiderl/envs/drift.py`) follows the step with it. None for a fixed world.
    """

    train_tasks: list[Task]
    eval_tasks: list[Task]
    make_env: Callable[[], Env]
    name: str = ""
    split: str = ""
    oracle: Callable[[Task], list[str]] | None = None
    eval_chunk_size: int = 0
    store: Any = None
    backends: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    on_step: Callable[[int], None] | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["backends"] = {}  # connections and caches do not travel between processes
        return state

    def backend(self, key: Any, build: Callable[[], Any]) -> Any:
        """The shared resource under `key`, built by `build()` on first use."""
        if key not in self.backends:
            self.backends[key] = build()
        return self.backends[key]


def load_setup(cfg: "RunConfig") -> Setup:
    """The Setup of the environment `env.name` names, for this config."""
    entry = environment(cfg.env.name)
    build = getattr(entry, "setup", entry)
    setup = build(cfg)
    if not isinstance(setup, Setup):
        raise TypeError(f"env.name={cfg.env.name!r}: its setup returned {type(setup).__name__}, not a "
                        "tiderl.envs.setup.Setup. Fix: return Setup(train_tasks, eval_tasks, make_env).")
    return setup


def data_root(data_dir: str = "") -> Path:
    """`data.data_dir`, else $TIDERL_DATA_DIR, else ../shared/data next to the repository."""
    if data_dir:
        return Path(data_dir)
    if os.environ.get("TIDERL_DATA_DIR"):
        return Path(os.environ["TIDERL_DATA_DIR"])
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def sample_tasks(tasks: list[Task], size: int, seed: int) -> list[Task]:
    """At most `size` tasks: a fixed-seed sample kept in the original order."""
    if len(tasks) <= size:
        return tasks
    keep = sorted(random.Random(seed).sample(range(len(tasks)), size))
    return [tasks[i] for i in keep]


def task_files(names: list[str], data_dir: str = "") -> list[Path]:
    """The files `data.train_files` / `data.eval_files` name: each path as given, or, relative and
    not found from the working directory, under the data root (`data_root`)."""
    out = []
    for name in names:
        path = Path(name).expanduser()
        if not path.is_absolute() and not path.exists():
            path = data_root(data_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"task file {name!r} not found (looked in {Path.cwd()} and {data_root(data_dir)}). "
                                    "Fix: pass an existing file, or set data.data_dir / $TIDERL_DATA_DIR to the folder "
                                    "that holds it")
        out.append(path)
    return out


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a task file: JSON Lines (one object a line, blank lines skipped) or, for a
    `.parquet` file, its rows (needs pyarrow: `pip install 'tiderl[data]'`)."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"{path}: reading Parquet needs pyarrow. Fix: pip install 'tiderl[data]', or "
                              "convert the file to JSON Lines") from None
        return pq.read_table(path).to_pylist()
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg}); task files are JSON Lines or "
                             ".parquet") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records
