"""Online learning in a changing world: a drift schedule and the knowledge graph it changes.

`env.options.drift: {every_steps: K, fraction: f, kind: ...}` (an option of the KG environment)
makes the world change every K optimizer steps. The world at step s is phase `s // K`; phase p
is phase p - 1 changed once more, with a random stream seeded by (data.seed, p), so every run
with the same data seed (any algorithm, any training seed) sees the same sequence of worlds at
the same steps.

Kinds (each change applies to the previous phase's world):

* `facts`: a fraction `f` of the forward triples of non-attribute relations get a new object,
  drawn from the objects that relation has elsewhere (a film gets another director). Gold
  answers change; the relation names, and so the policy's tool calls, stay right.
* `relations`: relations are renamed: max(2, round(f * R)) of the R forward relations pass
  their names on in a cycle (a derangement), `r_inv` following `r`. The edges stay, the names
  the tools accept change: "who directed [film_1]?" may now need `get_neighbors(..., written_by)`.
  New names are drawn from the old ones on purpose: a renaming to a string the tokenizer never
  saw could not be produced by a small policy at all, while a swap of known names is what a
  policy can recover from by exploring.

Held-out evaluation tracks the current world: a `DriftingKGEnv` answers every task (training
or held out) at `reset` against the world of the current phase, along its relation path under
the current names. Tasks keep their ids and wording, so success before and after a change is
measured on the same questions.

How the environment learns the step: the recipe calls `Setup.on_step(version)` once before the
first episode and after every optimizer step (`DriftingWorld.at_step`). Episodes that start
after that call play in the new world; episodes already running finish in the world they
started in (each env binds its world at `reset`). On the Ray backend each rollout worker holds
its own copy of the setup (the world comes with it, phase 0 built from the same graph and seed)
and moves it to the version of every weight update it loads
(`tiderl.system.ray_backend.RolloutWorker`): the changes are pure functions of (data.seed,
phase), so every worker builds the very worlds the driver does, and nothing but the version
travels. The world then follows the weights a worker samples with, which is the local order too
(the recipe moves it right after the step that publishes the weights).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.store import INVERSE_SUFFIX, TripleStore, inverse
from tiderl.envs.kg.tasks import path_answer
from tiderl.envs.protocol import Action, StepResult, Task

if TYPE_CHECKING:
    from tiderl.envs.kg.registration import DriftOptions

DRIFT_KINDS = ("facts", "relations")


@dataclass(frozen=True)
class DriftSchedule:
    """When the world changes and how much.

    every_steps: optimizer steps between changes (0 = the world never changes).
    fraction: the share of facts (kind `facts`) or of relations (kind `relations`) one change touches.
    kind: one of `DRIFT_KINDS`.
    seed: seeds every change (phase p draws from Random(f"{seed}|{p}")).
    """

    every_steps: int
    fraction: float
    kind: str
    seed: int = 0

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"env.options.drift.every_steps must be >= 0 (0 = off), got {self.every_steps}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"env.options.drift.fraction must be in (0, 1], got {self.fraction}")
        if self.kind not in DRIFT_KINDS:
            raise ValueError(f"env.options.drift.kind must be one of {DRIFT_KINDS}, got {self.kind!r}")

    @classmethod
    def from_config(cls, drift: DriftOptions, seed: int) -> DriftSchedule:
        return cls(drift.every_steps, drift.fraction, drift.kind, seed)

    @property
    def active(self) -> bool:
        return self.every_steps > 0

    def phase(self, step: int) -> int:
        """The world index at optimizer step `step` (0 until the first change)."""
        return step // self.every_steps if self.active else 0

    def change_steps(self, until: int) -> list[int]:
        """The steps in (0, until] at which the world changes."""
        return list(range(self.every_steps, until + 1, self.every_steps)) if self.active else []


# -- the changes, as pure functions of (world, rng) ------------------------------------------


def copy_store(store: TripleStore, rename: dict[str, str] | None = None,
               replaced: dict[tuple[str, str, str], str] | None = None) -> TripleStore:
    """A new store with the forward triples of `store`: relation r written as `rename[r]` (when
    given) and the object of a triple in `replaced` swapped for its replacement. Labels and
    attribute relations (renamed alike) carry over."""
    rename = rename or {}
    replaced = replaced or {}
    out = TripleStore(attribute_relations={rename.get(r, r) for r in store.attribute_relations},
                      add_inverse=store.add_inverse)
    for s, r, o in store.triples():
        out.add(s, rename.get(r, r), replaced.get((s, r, o), o))
    for entity, name in store.labels(store.entities()).items():
        out.add_label(entity, name)
    return out


def forward_relations(store: TripleStore) -> list[str]:
    return [r for r in store.relation_names() if not r.endswith(INVERSE_SUFFIX)]


def rewire_facts(store: TripleStore, fraction: float, rng: random.Random) -> TripleStore:
    """A copy of `store` in which `fraction` of the forward triples of non-attribute relations
    point to another object of the same relation (one the subject is not already linked to)."""
    triples = sorted((s, r, o) for s, r, o in store.triples() if r not in store.attribute_relations)
    objects: dict[str, list[str]] = {}
    for _, r, o in triples:
        objects.setdefault(r, []).append(o)
    pools = {r: sorted(set(os_)) for r, os_ in objects.items()}
    replaced: dict[tuple[str, str, str], str] = {}
    taken: dict[tuple[str, str], set[str]] = {}
    for s, r, o in triples:
        taken.setdefault((s, r), set()).add(o)
    for s, r, o in rng.sample(triples, round(fraction * len(triples))):
        free = [x for x in pools[r] if x not in taken[(s, r)]]
        if free:
            new = rng.choice(free)
            replaced[(s, r, o)] = new
            taken[(s, r)].add(new)
    return copy_store(store, replaced=replaced)


def rename_relations(names: dict[str, str], fraction: float, rng: random.Random) -> dict[str, str]:
    """`names` (original relation -> its current name) after one renaming: max(2, round(f * R))
    relations, drawn at random, pass their current names on in a cycle, so none keeps its own."""
    originals = sorted(names)
    if len(originals) < 2:
        raise ValueError("env.options.drift.kind=relations needs a graph with at least 2 forward relations")
    chosen = rng.sample(originals, min(len(originals), max(2, round(fraction * len(originals)))))
    out = dict(names)
    for a, b in zip(chosen, chosen[1:] + chosen[:1]):
        out[a] = names[b]
    return out


def current_name(relation: str, names: dict[str, str]) -> str:
    """The current name of a relation of a task's path, `r_inv` included."""
    if relation.endswith(INVERSE_SUFFIX):
        return inverse(names.get(inverse(relation), inverse(relation)))
    return names.get(relation, relation)


# -- the world over time ---------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """One phase of a drifting world: its graph and the current name of every original relation."""

    phase: int
    store: TripleStore
    names: dict[str, str] = field(default_factory=dict)

    def answer(self, task: Task) -> Task:
        """`task` as this world asks it: its relation path under the current names and its gold
        answer recomputed along that path (the topic excluded at every hop of a multi-hop path,
        as the task source does)."""
        if "path" not in task.meta or "topic" not in task.meta:
            raise ValueError(f"task {task.task_id}: a drifting world needs meta['topic'] and meta['path'] to "
                             "answer it again; drift supports data.source=embedded and metaqa")
        path = [current_name(r, self.names) for r in task.meta["path"]]
        answer = sorted(path_answer(self.store, task.meta["topic"], path))
        return Task(task.task_id, task.prompt, answer,
                    {**task.meta, "path": path, "drift_phase": self.phase})


class DriftingWorld:
    """The world of every phase (built on first use, kept), and the phase now in force.

    `at_step(step)` moves the current phase; `current()` is what a new episode plays in.
    Thread-safe: episodes start on several threads while the trainer moves the step.
    """

    def __init__(self, base: TripleStore, schedule: DriftSchedule) -> None:
        self.schedule = schedule
        self.step = 0
        self._worlds = [World(0, base, {r: r for r in forward_relations(base)})]
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """What a copy for another process (a Ray rollout worker) needs: the base world, the
        schedule and the step. Later phases are rebuilt there on first use (the same worlds:
        each change is seeded by the phase); a lock does not travel."""
        return {"schedule": self.schedule, "step": self.step, "base": self._worlds[0]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.schedule, self.step = state["schedule"], state["step"]
        self._worlds = [state["base"]]
        self._lock = threading.Lock()

    def at_step(self, step: int) -> None:
        """The policy version is now `step` (the recipe's `Setup.on_step` hook)."""
        self.step = step

    def world(self, phase: int) -> World:
        """Phase `phase` of the world: phase - 1 changed once more (deterministic per seed)."""
        with self._lock:
            while len(self._worlds) <= phase:
                self._worlds.append(self._change(self._worlds[-1]))
            return self._worlds[phase]

    def current(self) -> World:
        return self.world(self.schedule.phase(self.step))

    def _change(self, prev: World) -> World:
        phase = prev.phase + 1
        rng = random.Random(f"{self.schedule.seed}|{phase}")
        if self.schedule.kind == "facts":
            return World(phase, rewire_facts(prev.store, self.schedule.fraction, rng), prev.names)
        names = rename_relations(prev.names, self.schedule.fraction, rng)
        # Rename the previous world's edges: its name for r becomes the new name for r.
        step_rename = {prev.names[r]: names[r] for r in names}
        return World(phase, copy_store(prev.store, rename=step_rename), names)

    def describe(self, phase: int) -> str:
        """What changed from phase - 1 to `phase`, in one line (for benchmark logs)."""
        if phase == 0:
            return "phase 0: the original world"
        prev, now = self.world(phase - 1), self.world(phase)
        if self.schedule.kind == "relations":
            moved = [f"{r}: {prev.names[r]} -> {now.names[r]}" for r in sorted(now.names)
                     if now.names[r] != prev.names[r]]
            return f"phase {phase}: " + ", ".join(moved)
        changed = len(set(prev.store.triples()) - set(now.store.triples()))
        return f"phase {phase}: {changed} of {prev.store.num_triples} facts changed"


class DriftingKGEnv(KGEnv):
    """A `KGEnv` that plays each episode in the world current at its `reset` (or in phase
    `phase`, when pinned), and scores it against the task as that world answers it
    (`World.answer`)."""

    def __init__(self, world: DriftingWorld, phase: int | None = None, **kwargs: Any) -> None:
        self.world, self.phase = world, phase
        self.episode_phase = -1
        super().__init__(self._world().store, **kwargs)

    def _world(self) -> World:
        return self.world.current() if self.phase is None else self.world.world(self.phase)

    def reset(self, task: Task) -> str:
        now = self._world()
        self.store, self.episode_phase = now.store, now.phase
        return super().reset(now.answer(task))

    def step(self, action: Action) -> StepResult:
        """`KGEnv.step`; the final info also holds `drift_phase`, the world the episode played in."""
        return self._tagged(super().step(action))

    def finish(self, reason: str) -> StepResult:
        return self._tagged(super().finish(reason))

    def _tagged(self, result: StepResult) -> StepResult:
        if result.done:
            result.info["drift_phase"] = self.episode_phase
        return result


class DriftingKGFactory:
    """`make_env` of a drifting KG setup; `at_phase(p)` gives one pinned to phase p (a benchmark
    measures the policy in the world it trained in and in the changed one at the same step)."""

    def __init__(self, world: DriftingWorld, phase: int | None = None, **env_kwargs: Any) -> None:
        self.world, self.phase, self.env_kwargs = world, phase, env_kwargs

    def __call__(self) -> DriftingKGEnv:
        return DriftingKGEnv(self.world, self.phase, **self.env_kwargs)

    def at_phase(self, phase: int) -> DriftingKGFactory:
        return DriftingKGFactory(self.world, phase, **self.env_kwargs)
