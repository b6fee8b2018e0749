"""Elastic rollout workers versus every fixed allocation, on a workload whose phases shift.

What runs for real: Ray (a local 2-CPU cluster), `RayRollout`'s actor pool (each worker a Ray
actor process, started, weight-synced by checksum through the object store, drained and
killed), tiderl's rollout pool and loop (staleness gate, ready buffer, ledger) and, for the elastic mode,
`tiderl.system.elastic.decide` resizing the pool from readiness. What is simulated: the work
inside a worker and the trainer. This machine has 2 cores shared with other jobs, so real
decoding could not show more workers giving more capacity; instead each worker is a
`SimulatedEngineWorker`: an engine that decodes the sequences routed to it together, a decode
step costing `STEP_S + PER_SEQ_S * (sequences decoding)` seconds (asyncio sleeps, so a worker
has a fixed capacity of its own whatever the host's load), with tool calls between turns. The
trainer step is a sleep of `--train-s` seconds.

The workload alternates two phases by trainer step (the phase of a task is the one of the step
the trainer is on when it is drawn, so every mode sees the same phase schedule):

- tools: 2 short turns (about 20 tokens each) around one tool call (~0.075 s): an episode takes
  about 0.2 s on a full worker, rollout is cheap and the trainer (0.3 s a step) is the
  bottleneck even with one worker;
- long: 2 long turns (about 200 tokens each, `--long-tokens`) around one tool call (~0.1 s): an
  episode takes about 1.3 s on a full worker, one worker delivers a batch every ~1.3 s, so the
  trainer waits three quarters of the time with one worker and is about busy with four.

A phase lasts 24 steps (7-30 s); the elastic loop measures every 0.5 s (about 2 trainer steps:
a shorter interval measures one step, not the load) and a worker boots in about 1.5 s on an
idle machine, 5 s or more on a loaded one. Elasticity can only pay off when a phase lasts much
longer than detection plus boot; `--phase-steps` sets it.

Capacity: batch 8, max_staleness 3, 8 episodes per worker, so every mode lies in [1, 4]
workers (1 = one batch, 4 = the 32 trajectories the staleness gate admits,
`elastic.capacity_bounds`). The fixed modes are all of them (1, 2, 3, 4 workers); the elastic
mode starts at 1 with the configured range 1-8 and lets the bounds narrow it.

Resources: worker-seconds = the time integral of worker actors held (booting, live or draining),
from the first step's start to the last step's end; an added worker is charged from its spawn
(its boot included), a removed one until it is killed. "tok/worker-s" is trained action tokens
per worker-second; "tok/res-s" also charges the trainer (`--trainer-units` workers for the whole
wall time), since a trainer that waits on rollout is a resource held idle.

Prints a row per mode (mean ± 95 % t-interval over seeds), and on the last line elastic / best
fixed allocation for each figure (the best fixed mode chosen per figure), paired by seed.

    python benchmarks/elastic.py            # 3 seeds, 4 phases of 24 steps: 16 minutes at load 28
    python benchmarks/elastic.py --quick    # 2 seeds, 2 phases of 6 steps: a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
import torch

from tiderl.config import load_config
from tiderl.envs.protocol import Task
from tiderl.recipe import loop
from tiderl.rollout.weights import weights_checksum
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.pool import PoolSettings, RolloutPool
from tiderl.system.ray_backend import RayRollout
from tiderl.types import NO_VERSION, Trajectory

# The simulated engine: a decode step of `n` sequences takes STEP_S + PER_SEQ_S * n seconds and
# gives each one token; sequences advance CHUNK tokens per sleep (fewer wake-ups).
STEP_S = 0.001
PER_SEQ_S = 0.00025
CHUNK = 8
BATCH = 8
STALENESS = 3
SLOTS_PER_WORKER = 8
PHASES = {  # turns: mean tokens per turn; tool_s: mean tool latency between turns
    "tools": {"turns": 2, "tokens": 20, "tool_s": 0.075},
    "long": {"turns": 2, "tokens": 200, "tool_s": 0.1},  # tokens: --long-tokens
}


class SimulatedEngineWorker:
    """A rollout worker actor (the `RolloutWorker` interface) whose engine is simulated: the
    episodes routed to it decode together, each decode step costing more the more sequences
    share it; tool calls are sleeps. `task.meta` holds the episode's turn lengths and tool
    latencies. Tokens carry the weight version current when they were sampled."""

    def __init__(self, serial: int, bundle: Any, state: dict | None = None, version: int | None = None,
                 max_concurrency: int = 64):
        self.serial = serial
        self.version = bundle.version if version is None else version
        self.held = weights_checksum(state if state is not None else bundle.model.state_dict())
        self.decoding = 0
        self.episodes = self.cancelled = self.generated_tokens = 0

    async def run_episode(self, task: Task, group_id: str) -> Trajectory:
        versions: list[int] = []
        turns, tools = task.meta["turn_tokens"], task.meta["tool_s"]
        try:
            for i, n in enumerate(turns):
                done = 0
                while done < n:
                    chunk = min(CHUNK, n - done)
                    self.decoding += 1
                    try:
                        await asyncio.sleep(chunk * (STEP_S + PER_SEQ_S * self.decoding))
                    finally:
                        self.decoding -= 1
                    versions += [self.version] * chunk
                    done += chunk
                if i < len(tools):
                    await asyncio.sleep(tools[i])
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.episodes += 1
        self.generated_tokens += len(versions)
        n = len(versions) + 1
        return Trajectory(tokens=[1] * n, loss_mask=[0] + [1] * len(versions), behavior_logprobs=[0.0] * n,
                          policy_version=[NO_VERSION] + versions, reward=0.0, task_id=task.task_id,
                          group_id=group_id, num_turns=len(turns), stop_reason="answer")

    async def update_weights(self, state: dict, version: int) -> float:
        self.version = version
        self.held = weights_checksum(state)
        return self.held

    async def checksum(self) -> float:
        return self.held

    async def stop(self) -> dict:
        return await self.ping()

    async def ping(self) -> dict:
        return {"serial": self.serial, "pid": os.getpid(), "version": self.version, "episodes": self.episodes,
                "cancelled": self.cancelled, "generated_tokens": self.generated_tokens}


class SleepTrainer:
    """The trainer side: each step sleeps `train_s` on a thread; the weights are one tensor holding
    the version."""

    def __init__(self, train_s: float):
        self.train_s = train_s
        self.version = 0
        self._weights = {"w": torch.zeros(4)}

    async def step(self, batch: list[Trajectory]) -> dict[str, float]:
        await asyncio.to_thread(time.sleep, self.train_s)
        self.version += 1
        self._weights = {"w": torch.full((4,), float(self.version))}
        return {}

    def weights(self) -> dict[str, Any]:
        return self._weights

    def close(self) -> None: ...


def phase_of(version: int, phase_steps: int) -> str:
    """tools, long, tools, long, ... every `phase_steps` trainer steps."""
    return "tools" if (version // phase_steps) % 2 == 0 else "long"


def make_task(serial: int, phase: str, seed: int) -> Task:
    """Task `serial` of `phase`: turn lengths (uniform ±50 % around the mean) and tool latencies
    (exponential) drawn from a generator seeded by (seed, serial, phase), so every mode draws the
    same episodes in the same order."""
    rng = random.Random(f"{seed}/{serial}/{phase}")
    shape = PHASES[phase]
    turns = [max(1, round(rng.uniform(0.5, 1.5) * shape["tokens"])) for _ in range(shape["turns"])]
    tools = [rng.expovariate(1.0 / shape["tool_s"]) for _ in range(shape["turns"] - 1)]
    return Task(f"{phase}-{serial}", "", None, {"turn_tokens": turns, "tool_s": tools})


@dataclass
class RunResult:
    mode: str
    seed: int
    wall_s: float
    worker_s: float
    trained_tokens: int
    ledger: dict[str, int]
    events: list[dict[str, Any]] = field(default_factory=list)

    def tok_per_worker_s(self) -> float:
        return self.trained_tokens / self.worker_s

    def tok_per_res_s(self, trainer_units: float) -> float:
        return self.trained_tokens / (self.worker_s + trainer_units * self.wall_s)


def config(workers: int, elastic: bool, interval_s: float, drain_s: float):
    """The run's config: batch 8, staleness 3, 8 slots per worker; elastic: range 1-8 (the
    bounds narrow it to 1-4)."""
    common = ["system.backend=ray", f"rollout.batch_size={BATCH}", f"system.max_staleness={STALENESS}",
              f"system.options.workers={workers}", "system.wait_timeout_s=120", "algo.name=sao"]
    if elastic:
        return load_config(None, common + ["system.options.min_workers=1", "system.options.max_workers=8",
                                           f"system.options.slots_per_worker={SLOTS_PER_WORKER}",
                                           f"system.elastic_interval_s={interval_s}",
                                           f"system.options.worker_drain_s={drain_s}"])
    return load_config(None, common + [f"system.slots={workers * SLOTS_PER_WORKER}"])


async def run_mode(mode: str, workers: int, seed: int, steps: int, phase_steps: int, train_s: float,
                   interval_s: float = 0.5, drain_s: float = 2.0,
                   worker_cls: type = SimulatedEngineWorker) -> RunResult:
    """One run: `workers` workers (the starting count when `mode` is 'elastic'), `steps`
    optimizer steps. Returns wall time, worker-seconds and trained action tokens from the first
    step to the last, the ledger and the pool's events."""
    cfg = config(workers, mode == "elastic", interval_s, drain_s)
    assert cfg.algo.group_size == 1, cfg.algo.group_size
    rollout = RayRollout(cfg, torch.nn.Linear(2, 2), None, None, worker_cls=worker_cls,
                         worker_options={"num_cpus": 0.25})
    trained = [0]
    serial = [0]
    trainer = SleepTrainer(train_s)
    clock: dict[str, float] = {}  # wall time and worker-seconds when the pool starts and at the last step

    def next_task() -> Task:
        if not serial[0]:  # the fill loop's first call: the pool and its workers have just started
            clock.update(t0=time.monotonic(), ws0=rollout.worker_seconds())
        serial[0] += 1
        return make_task(serial[0], phase_of(trainer.version, phase_steps), seed)

    def after_step(version: int, metrics: dict, batch: list[Trajectory]) -> bool:
        trained[0] += sum(t.num_action_tokens for t in batch)
        clock.update(t1=time.monotonic(), ws1=rollout.worker_seconds())
        return False

    pool = RolloutPool(PoolSettings.from_config(cfg), next_task, rollout, ReadyBuffer([], 1))
    await loop(pool, trainer, steps, after_step)  # starts the pool (the workers) and closes it
    wall, worker_s = clock["t1"] - clock["t0"], clock["ws1"] - clock["ws0"]
    summary = pool.summary()
    ledger = summary["ledger"]
    settled = sum(v for k, v in ledger.items() if k != "started")
    assert ledger["started"] == settled, f"{mode}: the ledger does not balance: {ledger}"
    return RunResult(mode, seed, wall, worker_s, trained[0], ledger, rollout.events)


def loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and 95 % t half-width."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}.get(n - 1, 1.96)
    return mean, t * sd / math.sqrt(n)


def fmt(values: list[float], digits: int = 1) -> str:
    m, h = interval(values)
    return f"{m:.{digits}f} ± {h:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds, 2 phases of 6 steps (a smoke run)")
    ap.add_argument("--seeds", type=int, default=0, help="default 3, 2 with --quick")
    ap.add_argument("--phase-steps", type=int, default=0, help="steps per phase (default 24, 6 with --quick)")
    ap.add_argument("--phases", type=int, default=0, help="phases per run: tools, long, tools, ... (default 4, "
                    "2 with --quick)")
    ap.add_argument("--train-s", type=float, default=0.3, help="seconds per trainer step")
    ap.add_argument("--long-tokens", type=int, default=200, help="mean tokens per turn in the long phase")
    ap.add_argument("--interval-s", type=float, default=0.5, help="seconds between elastic decisions")
    ap.add_argument("--trainer-units", type=float, default=1.0,
                    help="the trainer's cost in workers, for tok/res-s (default 1)")
    args = ap.parse_args()
    phase_steps = args.phase_steps or (6 if args.quick else 24)
    PHASES["long"]["tokens"] = args.long_tokens
    phases = args.phases or (2 if args.quick else 4)
    args.seeds = args.seeds or (2 if args.quick else 3)
    steps = phase_steps * phases
    logging.basicConfig(level=logging.WARNING)
    # "local": a cluster of our own, never one another process on this machine started.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    modes = [("elastic", 1)] + [(f"fixed {k}", k) for k in (1, 2, 3, 4)]
    print(f"batch {BATCH}, max_staleness {STALENESS}, {SLOTS_PER_WORKER} slots per worker, trainer step "
          f"{args.train_s:g} s, long turns {args.long_tokens} tokens; {phases} phases x {phase_steps} steps ({', '.join(PHASES)}, ...); "
          f"{args.seeds} seeds; load before: {loadavg()}", flush=True)
    results: dict[str, list[RunResult]] = {m: [] for m, _ in modes}
    t_start = time.monotonic()
    for seed in range(args.seeds):
        order = modes[seed % len(modes):] + modes[:seed % len(modes)]  # rotate: each mode meets the drift
        for mode, workers in order:
            r = asyncio.run(run_mode(mode, workers, seed, steps, phase_steps, args.train_s, args.interval_s))
            results[mode].append(r)
            resizes = [e for e in r.events if e["event"] in ("added", "removed")]
            print(f"  seed {seed} {mode:<8} wall {r.wall_s:6.2f} s, {r.worker_s:6.2f} worker-s, "
                  f"{r.trained_tokens} tokens, {len(resizes)} workers added/removed, "
                  f"requeued {r.ledger['requeued']}", flush=True)
    load = loadavg()
    print(f"\n{'mode':<9} {'wall s':>13} {'worker-s':>13} {'tok/worker-s':>15} {'tok/res-s':>13} "
          f"{'dropped':>8} {'requeued':>8} {'retried':>8} {'added/removed':>13}")
    for mode, _ in modes:
        rs = results[mode]
        resizes = sum(1 for r in rs for e in r.events if e["event"] in ("added", "removed")) / len(rs)
        print(f"{mode:<9} {fmt([r.wall_s for r in rs], 2):>13} {fmt([r.worker_s for r in rs]):>13} "
              f"{fmt([r.tok_per_worker_s() for r in rs]):>15} "
              f"{fmt([r.tok_per_res_s(args.trainer_units) for r in rs]):>13} "
              f"{sum(r.ledger['dropped_stale'] for r in rs) / len(rs):>8.1f} "
              f"{sum(r.ledger['requeued'] for r in rs) / len(rs):>8.1f} "
              f"{sum(r.ledger['retried'] for r in rs) / len(rs):>8.1f} {resizes:>13.1f}")
    print(f"(mean ± 95 % t-interval over {args.seeds} seeds; load after {load}; "
          f"{time.monotonic() - t_start:.0f} s in all; tok/res-s charges the trainer as "
          f"{args.trainer_units:g} worker(s))")
    ray.shutdown()

    def ratio(figure, higher_is_better: bool) -> str:
        fixed = [m for m, _ in modes if m != "elastic"]
        mean = {m: interval([figure(r) for r in results[m]])[0] for m in fixed}
        best = (max if higher_is_better else min)(fixed, key=mean.get)
        per_seed = [figure(e) / figure(b) for e, b in zip(results["elastic"], results[best])]
        m, h = interval(per_seed)
        return f"{m:.2f}x ± {h:.2f} (vs {best})"

    print(f"elastic / best fixed: tok/worker-s {ratio(RunResult.tok_per_worker_s, True)}; "
          f"tok/res-s {ratio(lambda r: r.tok_per_res_s(args.trainer_units), True)}; "
          f"wall {ratio(lambda r: r.wall_s, False)}")


if __name__ == "__main__":
    main()
