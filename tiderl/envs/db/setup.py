"""The SQL database environment's setup (`data.source: agentbench_db`; `db_file`: questions over
the user's own database file, see `file_setup`; `shop`: a generated database, see `shop_setup`).

AgentBench's DB task has no training split: the setup trains on the split it does not evaluate
on (`standard` when evaluating on `dev` and the reverse), so train and eval tasks never
overlap. At most `data.eval_size` eval tasks are kept (a fixed-seed sample). The options
(`env.options.*`) are `tiderl.envs.db.registration.DBOptions`.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tiderl.envs.db.env import DBEnv, is_write_task, make_backend, open_database
from tiderl.envs.db.oracle import oracle_turns
from tiderl.envs.db.questions import load_questions
from tiderl.envs.db.server_backend import redact_url, server_dialect
from tiderl.envs.db.shop import shop_files
from tiderl.envs.db.tasks import DBBENCH_DIR, dbbench_dir, load_dbbench_tasks
from tiderl.envs.db.tools import Limits
from tiderl.envs.protocol import Task
from tiderl.envs.setup import Setup, data_root, sample_tasks, task_files

if TYPE_CHECKING:
    from tiderl.config import RunConfig

DB_SPLITS = ("dev", "standard")


def setup(cfg: "RunConfig") -> Setup:
    """AgentBench DB tasks and a factory of `DBEnv`s on the `env.options.backend` backend (sqlite,
    duckdb or a SQLAlchemy URL) with `Limits(max_rows=max_items, timeout_s=options.timeout_s,
    max_observation_chars)`; the backend holds every episode's database and gold hashes."""
    data = cfg.data
    if data.source == "db_file":
        return file_setup(cfg)
    if data.source == "shop":
        return shop_setup(cfg)
    if data.source != "agentbench_db":
        raise ValueError(f"data.source={data.source!r} is not a database source. Fix: use "
                         "data.source=agentbench_db, db_file or shop with env.name=db.")
    split = data.split or "dev"
    if split not in DB_SPLITS:
        raise ValueError(f"data.split {split!r} is not an AgentBench DB split. Fix: use one of "
                         f"{', '.join(DB_SPLITS)} (or '' for dev).")
    folder = dbbench_dir(data_root(data.data_dir))
    if not (folder / f"{split}.jsonl").is_file():
        raise FileNotFoundError(
            f"AgentBench DB data not found at {folder} (no {split}.jsonl). Fix: set data.data_dir "
            f"to the folder that holds {DBBENCH_DIR}/, or the TIDERL_DATA_DIR environment variable.")
    held_out = sample_tasks(load_dbbench_tasks(folder, split), data.eval_size, data.seed)
    other = next(s for s in DB_SPLITS if s != split)
    train = load_dbbench_tasks(folder, other) if (folder / f"{other}.jsonl").is_file() else []
    out = Setup(train, held_out, DBEnv, "agentbench_db", split=split)
    env, backend = cfg.env, cfg.env.options.backend
    limits = Limits(max_rows=env.max_items, timeout_s=env.options.timeout_s,
                    max_observation_chars=env.max_observation_chars)
    out.make_env = _DBFactory(out, backend, limits, env.system_prompt or None)
    out.oracle = lambda task: oracle_turns(task, db_backend(out, backend))
    # A SQLAlchemy server backend serves one session at a time: evaluate task by task.
    out.eval_chunk_size = 1 if "://" in backend else 0
    return out


def file_setup(cfg: "RunConfig") -> Setup:
    """Questions over an existing database (`env.options.db_path`: a SQLite/DuckDB file, opened
    read-only, or a server URL). The questions come from `env.options.questions`: at most
    `data.eval_size` are held out (a fixed-seed sample), the rest train. `data.train_files` /
    `data.eval_files` (question files of the same form) replace the training / held-out
    questions: with train files every question of `env.options.questions` may be held out; with
    eval files it all trains (at most `data.eval_size` of the eval files' questions are held out).
    Ids of questions from those files carry the file's stem (`train/q00003`)."""
    data, env, options = cfg.data, cfg.env, cfg.env.options
    train_paths, eval_paths = task_files(data.train_files, data.data_dir), task_files(data.eval_files, data.data_dir)
    if set(train_paths) & set(eval_paths):
        raise ValueError(f"{sorted(map(str, set(train_paths) & set(eval_paths)))} are both data.train_files and "
                         "data.eval_files: held-out questions must not be trained on. Fix: list each file once.")
    if not options.db_path:
        raise ValueError("data.source=db_file needs env.options.db_path. Fix: pass --db path/to.sqlite (or a "
                         "postgresql:// / mysql:// URL) --questions q.jsonl, or env.options.db_path=...")
    if not options.questions and not (train_paths and eval_paths):
        missing = "data.eval_files" if train_paths else "data.train_files" if eval_paths else "env.options.questions"
        raise ValueError(f"data.source=db_file needs {missing}. Fix: pass --questions q.jsonl (env.options.questions"
                         "=...), or both data.train_files=[...] and data.eval_files=[...].")
    path = options.db_path if server_dialect(options.db_path) else str(Path(options.db_path).expanduser().resolve())
    build = partial(open_database, max_sessions=options.max_sessions,
                    pool_size=None if options.pool_size < 0 else options.pool_size)
    source = build(path)
    database = redact_url(path)
    own = load_questions(options.questions, source, database=database) if options.questions else []
    train_files = [t for p in train_paths for t in _file_questions(p, source, database)]
    eval_files = [t for p in eval_paths for t in _file_questions(p, source, database)]
    if eval_files:
        held_out, train = sample_tasks(eval_files, data.eval_size, data.seed), train_files or own
    else:
        held_out = sample_tasks(own, data.eval_size, data.seed)
        kept = {t.task_id for t in held_out}
        train = train_files or [t for t in own if t.task_id not in kept]
    split = eval_paths[0].stem if eval_paths else Path(options.questions).stem
    out = Setup(train, held_out, DBEnv, "db_file", split=split)
    limits = Limits(max_rows=env.max_items, timeout_s=options.timeout_s,
                    max_observation_chars=env.max_observation_chars)
    out.backend(("db", path), lambda: source)  # the backend the questions were loaded with
    if server_dialect(path):
        # A server backend holds at most max_sessions sessions; more episodes at once would leave
        # the rest waiting for a session in the threads the running ones step in.
        out.eval_chunk_size = source.max_sessions
        in_flight = max(cfg.system.slots or (cfg.system.max_staleness + 1) * cfg.rollout.batch_size,
                        cfg.system.max_slots)
        if in_flight > source.max_sessions:
            raise ValueError(f"training would run up to {in_flight} episodes at once (system.slots, or (system."
                             f"max_staleness + 1) x rollout.batch_size, and system.max_slots) on a server database "
                             f"that serves env.options.max_sessions={source.max_sessions}. Fix: raise env.options."
                             f"max_sessions to {in_flight} (the server must accept that many connections), or set "
                             f"system.slots={source.max_sessions}.")
    out.make_env = _DBFactory(out, path, limits, env.system_prompt or None, build=build)
    out.oracle = lambda task: oracle_turns(task, db_backend(out, path, build))
    if options.drift.every_steps > 0:
        _add_drift(cfg, out, path, source, limits)
    return out


def shop_setup(cfg: "RunConfig") -> Setup:
    """The generated shop database's questions (tiderl/envs/db/shop.py; `data.eval_size` of the
    held-out ones), read as `file_setup` reads a user's database and question files, drift included."""
    database, train, held_out = shop_files(cfg.data.seed)
    as_file = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, source="db_file", train_files=[str(train)], eval_files=[str(held_out)]),
        env=dataclasses.replace(cfg.env, options=dataclasses.replace(cfg.env.options, db_path=str(database),
                                                                     questions="")))
    out = file_setup(as_file)
    out.name, out.split = "shop", "eval"
    return out


def _add_drift(cfg: "RunConfig", out: Setup, path: str, source: Any, limits: Limits) -> None:
    """Make the database's rows change every `env.options.drift.every_steps` steps
    (tiderl/envs/db/drift.py): its environments play on, and its oracle solves, the current phase."""
    from tiderl.envs.db.drift import DriftingDatabase, DriftingDBFactory

    given = [t.task_id for t in out.train_tasks + out.eval_tasks
             if not is_write_task(t) and not t.meta.get("gold_sql")]
    if given:
        raise ValueError(f"env.options.drift: {len(given)} question(s) (e.g. {given[0]!r}) have an answer but no gold "
                         "SQL, so a changed database cannot answer them again. Fix: give each question its 'sql', "
                         "or set env.options.drift.every_steps=0.")
    drift = cfg.env.options.drift
    world = DriftingDatabase(path, drift.every_steps, drift.fraction, cfg.data.seed, base=source)
    out.make_env = DriftingDBFactory(world, limits=limits, system_prompt=cfg.env.system_prompt or None)

    def oracle(task: Task) -> list[str]:
        phase, backend = world.current()
        return oracle_turns(world.task_in(task, phase), backend)

    out.oracle = oracle
    out.on_step = world.at_step


def _file_questions(path: Path, backend: Any, database: str) -> list[Task]:
    """The questions of one `data.train_files` / `data.eval_files` file, ids prefixed with its stem."""
    return [dataclasses.replace(t, task_id=f"{path.stem}/{t.task_id}")
            for t in load_questions(path, backend, database=database)]


def db_backend(setup: Setup, name: str, build: Callable[[str], Any] = make_backend) -> Any:
    """The setup's database backend `name`, made by `build(name)` once per setup and process
    (`make_backend` for task databases, `open_database` for the user's file or server)."""
    return setup.backend(("db", name), lambda: build(name))


class _DBFactory:
    """`make_env` of a DB setup: a `DBEnv` on the setup's backend (built on first use)."""

    def __init__(self, setup: Setup, backend: str, limits: Limits, system_prompt: str | None,
                 build: Callable[[str], Any] = make_backend):
        self.setup, self.backend, self.limits, self.system_prompt = setup, backend, limits, system_prompt
        self.build = build

    def __call__(self) -> DBEnv:
        return DBEnv(db_backend(self.setup, self.backend, self.build), limits=self.limits,
                     system_prompt=self.system_prompt)
