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


# What Dataset.save_to_disk writes: state.json (listing the .arrow files of the split, in
# order) beside them; DatasetDict.save_to_disk one such folder per split and dataset_dict.json.
DATASET_STATE, DATASET_DICT = "state.json", "dataset_dict.json"


def task_files(names: list[str], data_dir: str = "") -> list[Path]:
    """The files `data.train_files` / `data.eval_files` name: each path as given, or, relative and
    not found from the working directory, under the data root (`data_root`). A file, or a folder
    that `datasets`' `Dataset.save_to_disk` wrote (it holds `state.json`)."""
    out = []
    for name in names:
        path = Path(name).expanduser()
        if not path.is_absolute() and not path.exists():
            path = data_root(data_dir) / name
        if path.is_dir() and (path / DATASET_DICT).is_file():
            splits = json.loads((path / DATASET_DICT).read_text()).get("splits", [])
            raise ValueError(f"task file {name!r} is a saved DatasetDict (splits {', '.join(splits)}), not one "
                             f"split. Fix: name one split's folder, e.g. {name.rstrip('/')}/{(splits or ['train'])[0]}")
        if path.is_dir() and not (path / DATASET_STATE).is_file():
            raise ValueError(f"task file {name!r} is a folder without {DATASET_STATE}, so not a dataset saved with "
                             "Dataset.save_to_disk. Fix: name a JSON Lines or Parquet file, or a saved dataset's folder")
        if not path.is_file() and not path.is_dir():
            raise FileNotFoundError(f"task file {name!r} not found (looked in {Path.cwd()} and {data_root(data_dir)}). "
                                    "Fix: pass an existing file, or set data.data_dir / $TIDERL_DATA_DIR to the folder "
                                    "that holds it")
        out.append(path)
    return out


def file_split(data: Any) -> tuple[list[Path], list[Path]]:
    """`data.train_files` and `data.eval_files` as paths (`task_files`); a path in both is refused,
    since held-out tasks must never be trained on."""
    train, held_out = task_files(data.train_files, data.data_dir), task_files(data.eval_files, data.data_dir)
    both = set(train) & set(held_out)
    if both:
        raise ValueError(f"{sorted(map(str, both))} are both data.train_files and data.eval_files: held-out tasks "
                         "must not be trained on. Fix: list each file once")
    return train, held_out


def files_name(train_files: list[Path], eval_files: list[Path], source: str) -> str:
    """What a setup with training files trains on and holds out, e.g. "gsm8k/train (held out: gsm8k)"
    for GSM8K's train file with the source's own held-out sample; `source` without training files."""
    def label(paths: list[Path]) -> str:
        return ",".join(f"{p.parent.name}/{p.stem}" for p in paths) or source
    return f"{label(train_files)} (held out: {label(eval_files)})" if train_files else source


def record_field(record: dict[str, Any], names: tuple[str, ...], where: str, example: str) -> Any:
    """The value of the first of `names` that `record` holds (not None, not ""); else a ValueError
    naming the record (`where`), the fields looked for and `data.fields` (`example`: its fix)."""
    for name in names:
        if record.get(name) not in (None, ""):
            return record[name]
    raise ValueError(f"{where}: no {' or '.join(names)} field. Fix: name the record's fields in data.fields, "
                     f"e.g. {example}")


def field_names(defaults: dict[str, tuple[str, ...]], fields: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Per role, the field names to look for: the one `data.fields` gives, else the defaults."""
    return {role: (fields[role],) if role in fields else names for role, names in defaults.items()}


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a task file: JSON Lines (one object a line, blank lines skipped), a
    `.parquet` file's rows, or the rows of a folder saved with `Dataset.save_to_disk` (read
    with pyarrow, without the `datasets` package). Parquet and saved datasets need pyarrow
    (`pip install 'tiderl[data]'`)."""
    if path.is_dir() or path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            kind = "a saved dataset" if path.is_dir() else "Parquet"
            raise ImportError(f"{path}: reading {kind} needs pyarrow. Fix: pip install 'tiderl[data]', or "
                              "convert the file to JSON Lines") from None
        if not path.is_dir():
            return pq.read_table(path).to_pylist()
        return _saved_dataset_rows(pa, path)
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


def _saved_dataset_rows(pa: Any, folder: Path) -> list[dict[str, Any]]:
    """The rows of a `Dataset.save_to_disk` folder: its .arrow files (Arrow IPC streams), in the
    order state.json lists them."""
    state = json.loads((folder / DATASET_STATE).read_text())
    names = [f["filename"] for f in state.get("_data_files", [])]
    if not names:
        raise ValueError(f"{folder / DATASET_STATE} lists no data files (_data_files). Fix: save the dataset again "
                         "with Dataset.save_to_disk")
    rows: list[dict[str, Any]] = []
    for name in names:
        with pa.memory_map(str(folder / name)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:  # the file (random access) layout, not the stream one
                source.seek(0)
                table = pa.ipc.open_file(source).read_all()
        rows += table.to_pylist()
    return rows
