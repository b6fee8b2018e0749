"""Online learning over a database that changes (`env.options.drift` of the DB environment with
`data.source=db_file`; docs/online.md).

Every `every_steps` optimizer steps the database's rows change: phase p is phase p - 1 with a
`fraction` of each table's rows given a new value in one column that is not part of the primary
key, taken from another row of the same column (so values stay plausible: a singer moves to a
country another singer is from). The user's file is never written: each phase is a copy in a
temporary folder, removed when the run ends. Every change is seeded by (data.seed, phase) and
rows are picked in rowid order, so every process (a Ray rollout worker included) builds the same
phases from the same file, and only the step travels.

Questions keep their ids and wording; their gold answers follow the world: a question's gold SQL
is run again on the phase an episode plays in (a question given with an answer and no SQL cannot
follow, so drift refuses it), and a write task's gold table hash is computed on that phase's
copy. As for the knowledge graph (tiderl/envs/drift.py), the recipe moves the world with
`Setup.on_step` after every step, an episode plays in the phase current at its `reset`, and
held-out evaluation measures the current world.
"""

from __future__ import annotations

import random
import shutil
import sqlite3
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

from tiderl.envs.db.backend import Backend
from tiderl.envs.db.duckdb_backend import is_duckdb_file
from tiderl.envs.db.env import DBEnv, is_write_task, open_database_file
from tiderl.envs.db.questions import gold_answer
from tiderl.envs.protocol import StepResult, Task


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def change_rows(conn: Any, tables: list[str], fraction: float, rng: random.Random) -> int:
    """Give `fraction` of each table's rows (at least one, for a table of two rows or more) a new
    value in one column outside its primary key, copied from another row of that column; `conn` is
    a writable SQLite or DuckDB connection. A change a constraint refuses (UNIQUE, CHECK) is
    skipped. Returns the number of rows changed."""
    changed = 0
    for name in sorted(tables):
        table = _quote(name)
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})").fetchall() if not row[5]]
        rowids = [row[0] for row in conn.execute(f"SELECT rowid FROM {table} ORDER BY rowid").fetchall()]
        if not columns or len(rowids) < 2:
            continue
        for rowid in rng.sample(rowids, max(1, round(fraction * len(rowids)))):
            column = _quote(rng.choice(columns))
            donor = rng.choice([r for r in rowids if r != rowid])
            value = conn.execute(f"SELECT {column} FROM {table} WHERE rowid = ?", [donor]).fetchone()[0]
            try:
                conn.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", [value, rowid])
                changed += 1
            except Exception:  # noqa: BLE001 - sqlite3 and duckdb raise their own constraint errors
                continue
    return changed


class DriftingDatabase:
    """The database of every phase (built on first use, kept while the run lasts) and the phase now
    in force. `at_step(step)` moves it; `current()` is (phase, backend) for a new episode.
    Thread-safe: episodes start on several threads while the trainer moves the step."""

    def __init__(self, path: str | Path, every_steps: int, fraction: float, seed: int,
                 base: Backend | None = None) -> None:
        self.path, self.every_steps, self.fraction, self.seed = Path(path), every_steps, fraction, seed
        self.step = 0
        self._start(base)

    def _start(self, base: Backend | None) -> None:
        self._files = [self.path]
        self._backends: dict[int, Backend] = {0: base or open_database_file(self.path)}
        self._answers: dict[tuple[int, str], dict[str, Any]] = {}
        self._folder: Path | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """What a copy for another process needs; it rebuilds the phases from the file there."""
        return {k: getattr(self, k) for k in ("path", "every_steps", "fraction", "seed", "step")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start(None)

    def phase(self, step: int) -> int:
        return step // self.every_steps if self.every_steps > 0 else 0

    def at_step(self, step: int) -> None:
        """The policy version is now `step` (the recipe's `Setup.on_step` hook)."""
        self.step = step

    def current(self) -> tuple[int, Backend]:
        phase = self.phase(self.step)
        return phase, self.backend(phase)

    def backend(self, phase: int) -> Backend:
        """A read-only backend on phase `phase`'s database (phase - 1 changed once more)."""
        with self._lock:
            while len(self._files) <= phase:
                self._files.append(self._change(len(self._files)))
            if phase not in self._backends:
                self._backends[phase] = open_database_file(self._files[phase])
            return self._backends[phase]

    def _change(self, phase: int) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="tiderl-db-drift-"))
            weakref.finalize(self, shutil.rmtree, str(self._folder), True)
        source, target = self._files[phase - 1], self._folder / f"phase_{phase}{self.path.suffix}"
        tables = [t.name for t in self._backends[0].tables]
        rng = random.Random(f"db-drift|{self.seed}|{phase}")
        if is_duckdb_file(self.path):
            import duckdb

            shutil.copyfile(source, target)
            conn = duckdb.connect(str(target))
        else:  # a consistent copy of a SQLite file, whatever its journal holds
            with sqlite3.connect(f"file:{source}?mode=ro", uri=True) as src, sqlite3.connect(target) as dst:
                src.backup(dst)
            conn = sqlite3.connect(target, isolation_level=None)
        try:
            change_rows(conn, tables, self.fraction, rng)
        finally:
            conn.close()
        return target

    def describe(self, phase: int) -> str:
        """What changed from phase - 1 to `phase`, in one line (for benchmark logs)."""
        if phase == 0:
            return "phase 0: the original database"
        before, after = self._table_rows(phase - 1), self._table_rows(phase)
        changed = {name: sum(a != b for a, b in zip(before[name], after[name])) for name in sorted(before)}
        total = {name: len(rows) for name, rows in before.items()}
        return f"phase {phase}: " + ", ".join(f"{changed[n]} of {total[n]} {n} rows changed" for n in changed)

    def _table_rows(self, phase: int) -> dict[str, list[tuple]]:
        backend = self.backend(phase)
        session = backend.open([], False)
        try:
            return {t.name: [tuple(r) for r in session.execute(f"SELECT * FROM {_quote(t.name)} ORDER BY rowid",
                                                               max_rows=10**7, timeout_s=60.0).rows]
                    for t in self._backends[0].tables}
        finally:
            session.close()

    def task_in(self, task: Task, phase: int) -> Task:
        """`task` as phase `phase` answers it: a question's gold rows from its gold SQL run on that
        phase's database (cached); a write task as it is (its gold hash is the backend's)."""
        if phase == 0 or is_write_task(task):
            return task
        key = (phase, task.task_id)
        if key not in self._answers:
            sql = str(task.meta.get("gold_sql") or "")
            if not sql:
                raise ValueError(f"task {task.task_id}: a drifting database answers a question again from its "
                                 "gold SQL, and this one has only a given answer. Fix: give it 'sql', or set "
                                 "env.options.drift.every_steps=0")
            self._answers[key] = gold_answer(self.backend(phase), sql)
        return Task(task.task_id, task.prompt, self._answers[key], {**task.meta, "drift_phase": phase})


class DriftingDBEnv(DBEnv):
    """A `DBEnv` that plays each episode on the database of the phase current at its `reset` (or
    of phase `phase` when given), and scores it against the task as that phase answers it; its
    final info holds `drift_phase`."""

    def __init__(self, world: DriftingDatabase, phase: int | None = None, **kwargs: Any) -> None:
        self.world, self.phase, self.episode_phase = world, phase, 0
        super().__init__(self._now()[1], **kwargs)

    def _now(self) -> tuple[int, Backend]:
        return self.world.current() if self.phase is None else (self.phase, self.world.backend(self.phase))

    def reset(self, task: Task) -> str:
        self.episode_phase, self.backend = self._now()
        return super().reset(self.world.task_in(task, self.episode_phase))

    def _final(self, reward: float, extra: dict[str, Any]) -> StepResult:
        return super()._final(reward, {**extra, "drift_phase": self.episode_phase})


class DriftingDBFactory:
    """`make_env` of a drifting database setup; `at_phase(p)` gives one pinned to phase p (a
    benchmark measures the policy in the database it trained on and in the changed one)."""

    def __init__(self, world: DriftingDatabase, phase: int | None = None, **env_kwargs: Any) -> None:
        self.world, self.phase, self.env_kwargs = world, phase, env_kwargs

    def __call__(self) -> DriftingDBEnv:
        return DriftingDBEnv(self.world, self.phase, **self.env_kwargs)

    def at_phase(self, phase: int) -> "DriftingDBFactory":
        return DriftingDBFactory(self.world, phase, **self.env_kwargs)
