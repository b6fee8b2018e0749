"""A discrete-event model of tiderl's pipeline (rollout engines, trainer, staleness gate, elastic
slots) for predicting throughput, staleness and waste at scales this machine cannot run.

The model uses tiderl's own rules, not copies of them: admission and the drop rule come from
`StalenessGate`/`trajectory_staleness`, slot changes from `elastic.decide` (the scheduler's
policy function). What is
modelled, and how:

- **Episodes** alternate model turns and tool calls: `turns`, `tokens_per_turn` and
  `tool_latency_s` are distributions (`Dist`). An episode is sticky to one engine.
- **Engines** decode with token-level continuous batching: each of the `n` sequences generating
  on an engine gains one token per decode step of `decode_step_s + decode_step_per_seq_s * n`
  seconds (a fluid approximation: progress is continuous between events). At most
  `engine_max_seqs` generate at once per engine; the rest wait for a place.
- **Trainer**: a step over B fresh trajectories takes `train_step_s + train_s_per_token *
  (their action tokens)`, then `sync_s` to hand the weights to every engine. Engines sample with
  the new version from then on; an episode's staleness is the trainer version at training minus
  the version of its first sampled token (partial rollouts continue on new weights, tiderl's
  default `system.partial_rollout=continue`). A trajectory older than the bound (`stale_bound`,
  0 = N; tiderl's is max_staleness + `system.stale.slack`) is judged by tiderl's own rule
  (`too_stale`) under the schedule's `stale_policy` (`system.stale.policy`): `drop` drops it, `mask` trains it with its
  tokens sampled more than the bound ago masked out (each episode records how many tokens it had
  sampled at each weight change, so the tokens per version are known). With `colocated`, the devices do one thing at a
  time, as tiderl's synchronous loop (decoding, preparation and training in one thread): once a
  batch is ready no new turn joins a decode pass, the step starts when the engines have
  finished what they were decoding and preparing, and engines stop while it trains and syncs.
- **Modes**: `async` with `max_staleness` N (N = 0 is tiderl's synchronous on-policy loop);
  `overprovision` with a factor k: admit k·B episodes per version, train the first B finishers,
  cancel and re-queue the rest when the step starts (on-policy, their tokens are wasted).
- **Elastic slots** (`min_slots` < `max_slots`): every `elastic_interval_s` the slot cap changes
  by `elastic.decide` (with its hysteresis and its bounds: at least a batch, at most what the
  gate admits) from the trainer's idle fraction, the finished-trajectory queue and the time the
  gate held slots back.

- **Rollout-side work** (`prefill_s` per turn, `prep_s` per finished episode) stops an
  engine's decoding; **lockstep** decoding models tiderl's synchronous loop (see `Cluster`).

What is not modelled: memory limits of the KV cache, prefill cost growing with the context,
failures and retries, and network time beyond `sync_s`. `benchmarks/simulator.py --validate`
checks the predictions against runs of tiderl on this machine; `tiderl simulate`
(`tiderl/lab/simulate_cli.py`) is its command line.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any

from tiderl.system.elastic import LoadSignals, Memory, capacity_bounds, decide
from tiderl.system.ledger import Lengths
from tiderl.system.staleness import StalenessGate, too_stale


@dataclass(frozen=True)
class Dist:
    """A positive random quantity: `const` (always `mean`), `lognormal` (mean `mean`, log-space
    sigma `spread`), `exponential` (mean `mean`), `uniform` (mean ± `spread`·mean) or
    `empirical` (one of the measured `values`, each equally likely: a run's own samples);
    samples are capped at `cap`."""

    kind: str = "const"
    mean: float = 1.0
    spread: float = 0.0
    cap: float = math.inf
    values: tuple[float, ...] = ()

    KINDS = ("const", "lognormal", "exponential", "uniform", "empirical")

    @classmethod
    def empirical(cls, values: list[float] | tuple[float, ...]) -> Dist:
        """The distribution of measured samples (resampled with replacement)."""
        if not values:
            raise ValueError("an empirical distribution needs at least one measured value")
        return cls("empirical", sum(values) / len(values), values=tuple(float(v) for v in values))

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"distribution kind {self.kind!r}: use one of {', '.join(self.KINDS)}")
        if self.kind == "empirical" and (not self.values or min(self.values) < 0):
            raise ValueError(f"empirical distribution: give one or more values >= 0 (got {len(self.values)})")
        if self.mean < 0 or self.spread < 0 or self.cap <= 0:
            raise ValueError(f"{self}: mean and spread must be >= 0 and cap > 0")
        if self.kind == "uniform" and self.spread > 1:
            raise ValueError(f"{self}: a uniform spread is a fraction of the mean, at most 1")

    @classmethod
    def parse(cls, text: str) -> Dist:
        """'const:1', 'lognormal:1.0:1.5', 'lognormal:1.0:1.5:30' (kind:mean[:spread[:cap]]),
        'empirical:0.5,1.5,4' (measured values, resampled), or a bare number for a constant."""
        parts = text.strip().split(":")
        if parts[0] == "empirical":
            try:
                return cls.empirical([float(v) for v in ":".join(parts[1:]).split(",") if v.strip()])
            except ValueError:
                raise ValueError(f"distribution {text!r}: write empirical:V1,V2,... with values >= 0, "
                                 "e.g. empirical:0.5,1.5,4") from None
        try:
            if len(parts) == 1:
                return cls("const", float(parts[0]))
            values = [float(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"distribution {text!r}: write kind:mean[:spread[:cap]], "
                             "e.g. lognormal:1.0:1.5:30") from None
        if len(values) > 3:
            raise ValueError(f"distribution {text!r}: at most kind:mean:spread:cap, e.g. lognormal:1.0:1.5:30")
        names = ("mean", "spread", "cap")
        return cls(parts[0], **dict(zip(names, values)))

    def sample(self, rng: random.Random) -> float:
        if self.kind == "empirical":
            return min(self.values[rng.randrange(len(self.values))], self.cap)
        if self.kind == "const" or self.mean == 0:
            value = self.mean
        elif self.kind == "lognormal":
            # Mean `mean` in linear space: mu = ln(mean) - sigma^2 / 2.
            value = rng.lognormvariate(math.log(self.mean) - self.spread ** 2 / 2, self.spread)
        elif self.kind == "exponential":
            value = rng.expovariate(1.0 / self.mean)
        else:
            value = rng.uniform(self.mean * (1 - self.spread), self.mean * (1 + self.spread))
        return min(value, self.cap)


@dataclass(frozen=True)
class Workload:
    """What one episode looks like. Turns and tokens are rounded stochastically (2.4 turns is 2
    turns 60 % of the time and 3 turns 40 %), so their means are kept. A tool call follows every
    turn but the last; with `latency_on_last_turn` the last turn waits one too (tiderl's
    simulated-latency wrapper, `env.tool_latency`, delays every environment step, the answer's
    included).

    `episodes`, when given, replaces `turns` and `tokens_per_turn`: each episode is one of these
    measured profiles (the sampled tokens of each of its turns), drawn at random, so the joint
    distribution of turns and turn lengths of a real run (its long tail included) is kept."""

    turns: Dist = Dist("const", 3)
    tokens_per_turn: Dist = Dist("const", 30)
    tool_latency_s: Dist = Dist("const", 0.0)
    latency_on_last_turn: bool = False
    episodes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if any(not profile or min(profile) < 1 for profile in self.episodes):
            raise ValueError("Workload.episodes: every profile needs one or more turns of >= 1 token")


@dataclass(frozen=True)
class Cluster:
    """The resources and their speeds (seconds).

    `prefill_s` and `prep_s` are work that stops an engine's decoding while it runs: the prompt
    of each turn (`prefill_s` per turn start) and each finished episode's preparation
    (`prep_s`: critic values or reference log-probs, which tiderl computes on the rollout
    cores). Both default to 0 (the model's earlier behaviour).

    `lockstep` decodes as tiderl's synchronous loop does (its decoding runs in the event loop's
    own thread): an engine decodes in passes; a pass starts with every turn waiting, once no
    episode has been in its tool call for less than `patience_s` (at most `gather_s` after the
    first turn waited, `BatchingEngine`'s gather); no turn joins a running pass; the turns that
    finish wait for the pass's end before their tool calls start; preparations run only while
    the engine has no turn to decode."""

    engines: int = 1
    engine_max_seqs: int = 64
    decode_step_s: float = 0.002
    decode_step_per_seq_s: float = 0.0001
    train_step_s: float = 0.5
    train_s_per_token: float = 0.0
    sync_s: float = 0.05
    colocated: bool = False
    prefill_s: float = 0.0
    prep_s: float = 0.0
    lockstep: bool = False
    patience_s: float = 0.02
    gather_s: float = 0.1


@dataclass(frozen=True)
class Schedule:
    """How rollout and training are scheduled."""

    mode: str = "async"  # async | overprovision
    max_staleness: int = 0
    overprovision: float = 2.0
    batch_size: int = 32
    slots: int = 0  # 0: (N+1)·B for async, ceil(k·B) for overprovision
    admission: int = 0  # async: tiderl's system.admission (0 = (N+1)·B)
    min_slots: int = 0
    max_slots: int = 0
    elastic_interval_s: float = 2.0
    steps: int = 50
    stale_policy: str = "drop"  # async: tiderl's system.stale.policy (drop | mask)
    stale_bound: int = 0  # async: tiderl's max_staleness + system.stale.slack (0 = max_staleness)
    drain: bool = False  # async: tiderl's system.stale.drain (admission drains the run's end)

    def label(self) -> str:
        if self.mode == "overprovision":
            base = f"overprovision x{self.overprovision:g}"
        else:
            base = "sync" if self.max_staleness == 0 else f"async N={self.max_staleness}"
            if self.admission:
                base += f" admit {self.admission}"
            if self.stale_policy != "drop" or self.stale_bound:
                base += f" {self.stale_policy}" + (f" bound {self.stale_bound}" if self.stale_bound else "")
            if self.drain:
                base += " drain"
        if self.min_slots and self.max_slots and self.min_slots != self.max_slots:
            base += f" elastic {self.min_slots}-{self.max_slots}"
        return f"{base} B={self.batch_size}"


@dataclass
class SimResult:
    """What a simulated run measured. Tokens are sampled (action) tokens."""

    label: str
    wall_s: float
    steps: int
    trained: int
    trained_tokens: int
    generated_tokens: int
    dropped: int
    cancelled: int
    wasted_tokens: int
    trainer_idle_frac: float
    engine_busy_frac: float
    staleness: dict[int, int]
    slot_changes: int = 0
    completed_turn_tokens: int = 0  # tokens of model turns that finished (what tiderl counts as decoded)
    restarted: int = 0
    masked_tokens: int = 0  # too-stale tokens masked out of trained trajectories (mask policy)
    lengths: dict[str, float] = field(default_factory=dict)  # `Lengths.metrics()`: trained vs finished

    @property
    def trained_length(self) -> float:
        """Mean sampled tokens of the episodes trained (all of each, masked tokens included)."""
        return self.lengths.get("length/trained_mean", 0.0)

    @property
    def finished_length(self) -> float:
        return self.lengths.get("length/finished_mean", 0.0)

    @property
    def ks_d(self) -> float:
        return self.lengths.get("length/ks_d", 0.0)

    @property
    def waste_of_completed_turns(self) -> float:
        """1 - trained tokens / tokens of completed turns: the waste as tiderl's benchmarks
        measure it (a turn cut off mid-way is not counted as decoded)."""
        return 1 - self.trained_tokens / self.completed_turn_tokens if self.completed_turn_tokens else 0.0

    @property
    def trained_tokens_per_s(self) -> float:
        return self.trained_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def step_s(self) -> float:
        return self.wall_s / self.steps if self.steps else math.inf

    @property
    def tokens_per_trajectory(self) -> float:
        """Mean sampled tokens of a trained trajectory: below the workload's mean where a mode
        trains the episodes that finish first (short ones) and drops or cancels long ones."""
        return self.trained_tokens / self.trained if self.trained else 0.0

    @property
    def waste_frac(self) -> float:
        return self.wasted_tokens / self.generated_tokens if self.generated_tokens else 0.0

    def row(self) -> dict[str, Any]:
        return {"mode": self.label, "wall_s": round(self.wall_s, 3), "step_s": round(self.step_s, 4),
                "trained_tok_per_s": round(self.trained_tokens_per_s, 1), "trained": self.trained,
                "trained_tokens": self.trained_tokens, "restarted": self.restarted, "masked": self.masked_tokens,
                "waste_frac": round(self.waste_frac, 4), "dropped": self.dropped,
                "cancelled": self.cancelled, "trainer_idle": round(self.trainer_idle_frac, 3),
                "engine_busy": round(self.engine_busy_frac, 3),
                "staleness": dict(sorted(self.staleness.items())),
                **{k: round(v, 4) for k, v in self.lengths.items()}}


@dataclass
class _Episode:
    serial: int
    engine: int
    turns_left: int
    version: int = -1  # version of its first sampled token
    remaining: float = 0.0  # tokens left in the current turn
    turn_tokens: int = 0  # tokens of the current turn
    tokens: int = 0  # tokens of its finished turns
    generating: bool = False
    cancelled: bool = False
    profile: tuple[int, ...] = ()  # measured turn lengths (Workload.episodes), when given
    turn: int = 0  # turns begun
    tool_since: float = -1.0  # when its running tool call began (-1: not in one)
    marks: list = field(default_factory=list)  # (version, tokens sampled before it) from its first token on
    masked: int = 0  # tokens too stale to train (mask policy), as last judged


@dataclass
class _Engine:
    generating: dict[int, _Episode] = field(default_factory=dict)
    waiting: deque = field(default_factory=deque)
    last_t: float = 0.0
    epoch: int = 0
    busy_s: float = 0.0
    blocked_until: float = 0.0  # prefill/preparation work stops decoding until then
    held: list = field(default_factory=list)  # lockstep: turns finished in the running pass
    to_prepare: list = field(default_factory=list)  # lockstep: finished episodes not yet prepared
    waiting_since: float = -1.0  # lockstep: when a turn first waited for the next pass
    pass_due: float = -1.0  # lockstep: the instant a pass was found ready to start


class Simulation:
    """One simulated run. `run()` returns a `SimResult`."""

    def __init__(self, workload: Workload, cluster: Cluster, schedule: Schedule, seed: int = 0):
        if schedule.mode not in ("async", "overprovision"):
            raise ValueError(f"schedule.mode {schedule.mode!r}: use async or overprovision")
        if cluster.engines < 1 or cluster.engine_max_seqs < 1 or schedule.batch_size < 1:
            raise ValueError("engines, engine_max_seqs and batch_size must be >= 1")
        self.w, self.c, self.s = workload, cluster, schedule
        self.rng = random.Random(seed)
        b = schedule.batch_size
        if schedule.mode == "async":
            self.gate = StalenessGate(schedule.max_staleness, b, schedule.admission, schedule.stale_policy,
                                      schedule.stale_bound, schedule.steps if schedule.drain else 0)
            default_slots = self.gate.capacity
        else:
            if schedule.overprovision < 1:
                raise ValueError("overprovision factor must be >= 1")
            self.gate = StalenessGate(0, b)
            default_slots = math.ceil(schedule.overprovision * b)
        self.slots = schedule.slots or default_slots
        self.min_slots = schedule.min_slots or self.slots
        self.max_slots = schedule.max_slots or self.slots
        self.t = 0.0
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.engines = [_Engine() for _ in range(cluster.engines)]
        self.assigned = [0] * cluster.engines  # episodes per engine, as a list for a fast min
        self.version = 0  # trainer version == engine version once synced
        self.engine_version = 0
        self.in_flight: dict[int, _Episode] = {}
        self.ready: deque[_Episode] = deque()
        self.training = False
        self.step_waiting = False  # colocated: a ready batch waits for the engines' pass to end
        self.releasing = False  # lockstep: releasing a finished pass's turns
        self.waking = False  # lockstep: a pass may start only on a "wake" event
        self.paused = False
        self.serial = 0
        self.steps = 0
        self.stats = Counter()
        self.lengths = Lengths()  # as tiderl's pool tallies them
        self.trainer_busy_s = 0.0
        self.gate_blocked_s = 0.0
        self.window = Counter()  # elastic interval accounting
        self.slot_changes = 0
        self.memory = Memory()  # the elastic policy's hysteresis
        if self.min_slots != self.max_slots:
            # An overprovisioned run's slots are not bounded by the gate (it admits k·B per
            # version), only by max_slots: give the bound a staleness that admits max_slots.
            n = schedule.max_staleness if schedule.mode == "async" else math.ceil(self.max_slots / b) - 1
            self.bounds = capacity_bounds(b, n, 1, self.min_slots, self.max_slots)

    # -- event queue ----------------------------------------------------------------------
    def _push(self, t: float, kind: str, data: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def _round(self, x: float) -> int:
        """`x` rounded down or up at random, in proportion, so the mean stays `x`."""
        low = math.floor(x)
        return low + (self.rng.random() < x - low)

    # -- engines --------------------------------------------------------------------------
    def _rate(self, n: int) -> float:
        """Tokens per second each of `n` generating sequences gets."""
        return 1.0 / (self.c.decode_step_s + self.c.decode_step_per_seq_s * n)

    def _advance(self, e: _Engine) -> None:
        # Decoding progresses only after the engine's blocking work (which started no earlier
        # than `last_t`: work is added right after an advance) is done.
        dt = self.t - max(e.last_t, e.blocked_until)
        e.busy_s += max(0.0, min(self.t, e.blocked_until) - e.last_t)
        e.last_t = self.t
        if dt <= 0 or self.paused or not e.generating:
            return
        e.busy_s += dt
        step = dt * self._rate(len(e.generating))
        for ep in e.generating.values():
            ep.remaining -= step

    def _reschedule(self, idx: int) -> None:
        e = self.engines[idx]
        e.epoch += 1
        if self.c.lockstep:
            self._next_pass(idx)
        while e.waiting and len(e.generating) < self.c.engine_max_seqs and not self.step_waiting \
                and not self.c.lockstep:
            ep = e.waiting.popleft()
            if not ep.cancelled:
                e.generating[ep.serial] = ep
        if e.generating and not self.paused:
            least = min(ep.remaining for ep in e.generating.values())
            start = max(self.t, e.blocked_until)
            self._push(start + max(least, 0.0) / self._rate(len(e.generating)), "engine", (idx, e.epoch))

    def _next_pass(self, idx: int) -> None:
        """Lockstep: between passes, release the finished turns, then start the next pass (after
        the gather) or, with no turn to decode, the waiting preparations."""
        e = self.engines[idx]
        if e.generating:
            return
        held, e.held = e.held, []
        self.releasing = True  # the episodes that finish now are prepared after this decision
        for ep in held:
            self._after_turn(ep)
        self.releasing = False
        e.waiting = deque(ep for ep in e.waiting if not ep.cancelled)
        if e.waiting and not self.paused and not self.step_waiting:
            if e.waiting_since < 0:
                e.waiting_since = self.t
            fast = [ep.tool_since + self.c.patience_s for ep in self.in_flight.values()
                    if ep.engine == idx and 0 <= ep.tool_since and self.t - ep.tool_since < self.c.patience_s - 1e-9]
            deadline = e.waiting_since + self.c.gather_s
            if fast and self.t < deadline - 1e-12:
                self._push(min(min(fast), deadline), "wake")
                return
            if e.pass_due != self.t:  # first let every other event of this instant ask (one loop turn)
                e.pass_due = self.t
                self._push(self.t, "wake")
                return
            if not self.waking:
                return
            while e.waiting and len(e.generating) < self.c.engine_max_seqs:
                ep = e.waiting.popleft()
                e.generating[ep.serial] = ep
            e.waiting_since = -1.0
        elif not e.waiting and e.to_prepare:
            for ep in e.to_prepare:
                self._block(idx, self.c.prep_s)
                self._push(e.blocked_until, "ready", ep)
            e.to_prepare = []

    def _block(self, idx: int, seconds: float) -> None:
        """Work that stops engine `idx`'s decoding for `seconds` (queued after its other such work)."""
        if seconds <= 0:
            return
        e = self.engines[idx]
        self._advance(e)
        e.blocked_until = max(e.blocked_until, self.t) + seconds

    def _begin_turn(self, ep: _Episode) -> None:
        if ep.version < 0:
            ep.version = self.engine_version
            ep.marks.append((ep.version, 0))
        if ep.profile:
            ep.turn_tokens = ep.profile[ep.turn]
        else:
            ep.turn_tokens = max(1, self._round(self.w.tokens_per_turn.sample(self.rng)))
        ep.turn += 1
        ep.remaining = float(ep.turn_tokens)
        ep.generating = True
        self._block(ep.engine, self.c.prefill_s)
        e = self.engines[ep.engine]
        self._advance(e)
        e.waiting.append(ep)
        self._reschedule(ep.engine)

    def _on_engine(self, idx: int, epoch: int) -> None:
        e = self.engines[idx]
        if epoch != e.epoch:
            return
        self._advance(e)
        done = [ep for ep in e.generating.values() if ep.remaining <= 1e-9]
        for ep in done:
            del e.generating[ep.serial]
            ep.tokens += ep.turn_tokens
            ep.generating = False
            self.stats["generated"] += ep.turn_tokens
            self.stats["completed_turn_tokens"] += ep.turn_tokens
            ep.turns_left -= 1
            if self.c.lockstep:
                e.held.append(ep)  # its tool call starts when the pass ends
            else:
                self._after_turn(ep)
        self._reschedule(idx)

    def _after_turn(self, ep: _Episode) -> None:
        """A finished turn: the episode's tool call starts, or it finishes."""
        if ep.cancelled:
            return
        if ep.turns_left <= 0 and not self.w.latency_on_last_turn:
            self._finish(ep)
        else:
            ep.tool_since = self.t
            self._push(self.t + self.w.tool_latency_s.sample(self.rng), "tool", ep)

    # -- admission, training --------------------------------------------------------------
    def _may_start(self) -> bool:
        if len(self.in_flight) >= self.slots:
            return False
        if self.s.mode == "overprovision":
            # On-policy: start only on the current weights, while no step is under way.
            return (not self.training and self.engine_version == self.version
                    and self.gate.outstanding < self.slots)
        return self.gate.may_start(self.version, self.engine_version)

    @staticmethod
    def _sampled(ep: _Episode) -> int:
        """Tokens an episode has sampled so far (its finished turns and the current one's part)."""
        return ep.tokens + (int(ep.turn_tokens - max(0.0, ep.remaining)) if ep.generating else 0)

    @staticmethod
    def _counts(ep: _Episode) -> dict[int, int]:
        """A finished episode's sampled tokens per weight version (from its marks)."""
        ends = [c for _, c in ep.marks[1:]] + [ep.tokens]
        return {v: end - c for (v, c), end in zip(ep.marks, ends)}

    def _partial(self, ep: _Episode) -> int:
        """Tokens an episode has sampled so far (its finished turns and the current one's part),
        counted into `generated` when it leaves unfinished."""
        part = ep.turn_tokens - max(0.0, ep.remaining) if ep.generating else 0.0
        self.stats["generated"] += int(part)
        return ep.tokens + int(part)

    def _fill(self) -> None:
        while self.steps < self.s.steps and self._may_start():
            self.serial += 1
            idx = self.assigned.index(min(self.assigned))  # the least-loaded engine (lowest index on ties)
            if self.w.episodes:
                profile = self.w.episodes[self.rng.randrange(len(self.w.episodes))]
                ep = _Episode(self.serial, idx, len(profile), profile=profile)
            else:
                ep = _Episode(self.serial, idx, max(1, self._round(self.w.turns.sample(self.rng))))
            self.assigned[idx] += 1
            self.in_flight[ep.serial] = ep
            self.gate.started()
            self.stats["started"] += 1
            self._begin_turn(ep)

    def _finish(self, ep: _Episode) -> None:
        self.lengths.finished[ep.tokens] += 1
        self.assigned[ep.engine] -= 1
        del self.in_flight[ep.serial]
        if self.c.prep_s <= 0:
            self.ready.append(ep)
            return
        if self.c.lockstep:  # prepared once the engine has no turn to decode
            self.engines[ep.engine].to_prepare.append(ep)
            if not self.releasing:
                self._reschedule(ep.engine)
            return
        # Its preparation runs on the rollout side (modelled as blocking its engine) and must be
        # done before it may train: it is ready when its engine has done that work.
        self._block(ep.engine, self.c.prep_s)
        self._push(self.engines[ep.engine].blocked_until, "ready", ep)

    def _try_train(self) -> None:
        if self.training or self.steps >= self.s.steps or len(self.ready) < self.s.batch_size:
            return
        batch: list[_Episode] = []
        while self.ready and len(batch) < self.s.batch_size:
            ep = self.ready.popleft()
            masked = too_stale(self._counts(ep), self.version, self.gate.bound, self.gate.policy)
            if masked is None:
                self.gate.dropped += 1
                self.gate.histogram[self.version - ep.version] += 1
                self.gate.settled()
                self.stats["wasted"] += ep.tokens
                continue
            ep.masked = masked
            batch.append(ep)
        if len(batch) < self.s.batch_size:
            self.ready.extendleft(reversed(batch))
            return
        if self.c.colocated and any(e.generating or e.blocked_until > self.t for e in self.engines):
            self.ready.extendleft(reversed(batch))
            self.step_waiting = True  # the engines finish their pass first (see _reschedule)
            busy_until = max(e.blocked_until for e in self.engines)
            if busy_until > self.t:
                self._push(busy_until, "wake")  # look again when the blocking work is done
            return
        self.step_waiting = False
        for ep in batch:
            self.gate.histogram[self.version - ep.version] += 1
            self.lengths.trained[ep.tokens] += 1
            self.stats["masked"] += ep.masked
            self.stats["wasted"] += ep.masked
        if self.s.mode == "overprovision":
            self._cancel_in_flight()
        tokens = sum(ep.tokens for ep in batch)
        duration = self.c.train_step_s + self.c.train_s_per_token * tokens + self.c.sync_s
        self.training = True
        self._set_paused(self.c.colocated)
        self.trainer_busy_s += duration
        self._push(self.t + duration, "trained", batch)

    def _cancel_in_flight(self) -> None:
        """Overprovisioned on-policy sync: the episodes still running when B have finished are
        cancelled (their tokens are wasted) and their tasks re-queued for the next version."""
        for ep in list(self.in_flight.values()):
            self._cancel(ep, "cancelled")
        for idx in range(len(self.engines)):
            self._reschedule(idx)
        # Finished beyond the first B: training them later would be off-policy; also cancelled.
        while self.ready:
            ep = self.ready.pop()
            self.stats["wasted"] += ep.tokens
            self.stats["cancelled"] += 1
            self.gate.settled()

    def _cancel(self, ep: _Episode, counter: str) -> None:
        """Stop in-flight `ep`: its engine slot is freed, its sampled tokens count as wasted and
        it is counted under `counter` (`cancelled` or `restarted`)."""
        ep.cancelled = True
        e = self.engines[ep.engine]
        self._advance(e)
        e.generating.pop(ep.serial, None)
        self.assigned[ep.engine] -= 1
        self.stats["wasted"] += self._partial(ep)
        self.stats[counter] += 1
        self.gate.settled()
        del self.in_flight[ep.serial]

    def _on_trained(self, batch: list[_Episode]) -> None:
        self.training = False
        self.version += 1
        if self.gate.policy == "mask":  # what each episode sampled on the old weights
            for e in self.engines:
                self._advance(e)
            for ep in self.in_flight.values():
                ep.marks.append((self.version, self._sampled(ep)))
        self.engine_version = self.version
        self.steps += 1
        self.gate.settled(len(batch))
        self.stats["trained"] += len(batch)
        self.stats["trained_tokens"] += sum(ep.tokens - ep.masked for ep in batch)
        if self.s.mode == "async" and self.gate.max_staleness == 0:
            self._restart_older(self.version)
        self._set_paused(False)

    def _restart_older(self, version: int) -> None:
        """tiderl's rule at max_staleness 0 (`RolloutPool._restart_older_than`): after a step,
        episodes still running on older weights could never train; they are cancelled (their
        tokens wasted) and their tasks start again. Only an admission above B leaves any."""
        for ep in list(self.in_flight.values()):
            if ep.version >= version or ep.version < 0:
                continue
            self._cancel(ep, "restarted")
        for idx in range(len(self.engines)):
            self._reschedule(idx)

    def _set_paused(self, paused: bool) -> None:
        if paused == self.paused:
            return
        for e in self.engines:
            self._advance(e)
        self.paused = paused
        for idx in range(len(self.engines)):
            self._reschedule(idx)

    def _on_elastic(self) -> None:
        interval = self.s.elastic_interval_s
        load = LoadSignals(trainer_idle_frac=max(0.0, 1 - self.window["busy"] / interval),
                           ready=len(self.ready), gate_blocked_frac=self.window["blocked"] / interval,
                           batch_size=self.s.batch_size)
        decision = decide(self.slots, self.bounds, load, self.memory)
        self.memory = decision.memory
        if decision.reason:
            self.slots = decision.units
            self.slot_changes += 1
        self.window.clear()
        self._push(self.t + interval, "elastic")

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> SimResult:
        elastic = self.min_slots != self.max_slots
        if elastic:
            self._push(self.s.elastic_interval_s, "elastic")
        self._fill()
        while self.steps < self.s.steps:
            if not self.events:
                raise RuntimeError(f"simulation stalled at t={self.t:.3f}s after {self.steps} steps "
                                   f"({len(self.in_flight)} in flight, {len(self.ready)} ready, "
                                   f"slots {self.slots})")
            t, _, kind, data = heapq.heappop(self.events)
            dt = t - self.t
            if dt > 0:
                if self.training:
                    self.window["busy"] += dt
                elif len(self.in_flight) < self.slots and not self._may_start():
                    self.gate_blocked_s += dt
                    self.window["blocked"] += dt
            self.t = t
            if kind == "engine":
                self._on_engine(*data)
            elif kind == "tool":
                data.tool_since = -1.0
                if data.cancelled:
                    pass
                elif data.turns_left <= 0:
                    self._finish(data)  # the last turn's own latency (latency_on_last_turn)
                else:
                    self._begin_turn(data)
            elif kind == "ready":
                self.ready.append(data)
            elif kind == "wake":
                self.waking = True
                for idx in range(len(self.engines)):
                    self._reschedule(idx)
                self.waking = False
            elif kind == "trained":
                self._on_trained(data)
            elif kind == "elastic":
                self._on_elastic()
            self._try_train()
            self._fill()
        for e in self.engines:
            self._advance(e)
        unsettled = (sum(self._partial(ep) for ep in self.in_flight.values())
                     + sum(ep.tokens for ep in self.ready))
        wall = self.t
        busy = sum(e.busy_s for e in self.engines) / len(self.engines)
        return SimResult(
            label=self.s.label(), wall_s=wall, steps=self.steps, trained=self.stats["trained"],
            trained_tokens=self.stats["trained_tokens"], generated_tokens=self.stats["generated"],
            dropped=self.gate.dropped, cancelled=self.stats["cancelled"],
            wasted_tokens=self.stats["wasted"] + unsettled,
            trainer_idle_frac=max(0.0, 1 - self.trainer_busy_s / wall) if wall else 0.0,
            engine_busy_frac=busy / wall if wall else 0.0,
            staleness=dict(self.gate.histogram), slot_changes=self.slot_changes,
            completed_turn_tokens=self.stats["completed_turn_tokens"], restarted=self.stats["restarted"],
            masked_tokens=self.stats["masked"],
            lengths=self.lengths.metrics())


def simulate(workload: Workload, cluster: Cluster, schedule: Schedule, seed: int = 0) -> SimResult:
    """One simulated run."""
    return Simulation(workload, cluster, schedule, seed).run()


@dataclass(frozen=True)
class Mode:
    """One schedule a comparison runs, named as `benchmarks/async_vs_sync.py` names its modes.
    `sync_loop`: run it as tiderl's synchronous loop runs (devices shared with the trainer and
    decoding in lockstep passes: `Cluster.colocated` and `Cluster.lockstep`), the way
    `benchmarks/simulator.py --validate` models tiderl's synchronous modes."""

    name: str
    schedule: Schedule
    sync_loop: bool = False

    @property
    def synchronous(self) -> bool:
        """On-policy: every trained trajectory was sampled with the weights it trains."""
        return self.schedule.mode == "overprovision" or self.schedule.max_staleness == 0

    @property
    def label(self) -> str:
        return f"{self.name} ({self.schedule.label()}{', sync loop' if self.sync_loop else ''})"

    def cluster(self, cluster: Cluster) -> Cluster:
        return replace(cluster, colocated=True, lockstep=True) if self.sync_loop else cluster


def standard_modes(schedule: Schedule, staleness: tuple[int, ...] = (1, 2, 4),
                   cancel_factors: tuple[float, ...] = (1.5, 2.0), overprov_admission: int = 0,
                   sync_batch_factor: int = 3, sync_loop: bool = False,
                   elastic: tuple[int, int] | None = None,
                   stale_policies: tuple[tuple[str, int, bool], ...] = (("drop", 0, False),)) -> list[Mode]:
    """The modes every comparison reports, at equal trained trajectories, named as
    `benchmarks/async_vs_sync.py` names them:

    - `sync`: tiderl's synchronous loop (staleness 0, B admitted per version);
    - `sync-overprov`: tiderl's over-provisioned sync (staleness 0, `overprov_admission`
      admitted, default 2B: the first B finishers train, episodes still running on old weights
      restart after the step and those that finish a version late are dropped);
    - `sync-cancel-xK`: the model's harsher over-provisioning (admit K·B, train the first B,
      cancel the rest when the step starts), for each K in `cancel_factors`;
    - `sync-{F}B`: sync at batch F·B and a F-th of the steps (F = 3: the concurrency of async
      at staleness 2);
    - `async-sN`: asynchronous at staleness N (admission `schedule.admission`, 0 = (N+1)·B),
      dropping what is too stale; for each (policy P, slack D, drain) of `stale_policies` but
      ("drop", 0, False), `async-sN-P` (D = 0) or `async-sN-P+D`: policy P with the bound N + D,
      and `-drain` appended where admission drains the run's end;
    - with `elastic` (min, max slots): each async mode again with elastic slots.

    `sync_loop` runs the synchronous modes as tiderl's synchronous loop does (see `Mode`)."""
    b, steps = schedule.batch_size, schedule.steps
    sync = replace(schedule, mode="async", max_staleness=0, admission=0, min_slots=0, max_slots=0)
    modes = [Mode("sync", sync, sync_loop),
             Mode("sync-overprov", replace(sync, admission=overprov_admission or 2 * b), sync_loop)]
    modes += [Mode(f"sync-cancel-x{k:g}", replace(sync, mode="overprovision", overprovision=k), sync_loop)
              for k in cancel_factors]
    if sync_batch_factor > 1:
        modes.append(Mode(f"sync-{sync_batch_factor}B", replace(
            sync, batch_size=sync_batch_factor * b, steps=max(1, steps // sync_batch_factor)), sync_loop))
    asynchronous = [Mode(f"async-s{n}" + policy_suffix(p, d, drain), replace(
        schedule, mode="async", max_staleness=n, min_slots=0, max_slots=0, stale_policy=p, stale_bound=d and n + d,
        drain=drain)) for p, d, drain in stale_policies for n in staleness]
    modes += asynchronous
    if elastic:
        low, high = elastic
        modes += [Mode(f"{m.name}-elastic", replace(m.schedule, min_slots=low, max_slots=high))
                  for m in asynchronous]
    return modes


def policy_suffix(policy: str, slack: int, drain: bool = False) -> str:
    """'' for drop at the bound N, else '-mask', '-drop+1', '-mask+2' (policy, bound N + slack),
    with '-drain' appended when admission drains the run's end."""
    name = "" if (policy, slack) == ("drop", 0) else f"-{policy}" + (f"+{slack}" if slack else "")
    return name + ("-drain" if drain else "")


# Named starting points for `tiderl simulate --scenario`. They are assumptions to explore with,
# not measurements (except where a benchmark calibrates them); every field can be overridden.
SCENARIOS: dict[str, tuple[Workload, Cluster, Schedule]] = {
    # The shape of benchmarks/async_vs_sync.py's workload on this machine: three short turns,
    # heavy-tailed tool latency (mean 1 s, sigma 1.5, cap 30 s), one engine, a sub-second step.
    "tiny-lognormal": (
        Workload(Dist("const", 3), Dist("lognormal", 30, 0.5, 200), Dist("lognormal", 1.0, 1.5, 30)),
        Cluster(engines=1, engine_max_seqs=256, decode_step_s=0.002, decode_step_per_seq_s=0.0001,
                train_step_s=1.0, sync_s=0.05),
        Schedule(batch_size=32, steps=60)),
    # A disaggregated agentic deployment of the seeds' papers' kind: 64 engines, batch 512,
    # long episodes with long-tailed turns and tools, a minute per optimizer step.
    "agentic-cluster": (
        Workload(Dist("lognormal", 8, 0.5, 40), Dist("lognormal", 300, 1.0, 8192),
                 Dist("lognormal", 2.0, 1.0, 120)),
        Cluster(engines=64, engine_max_seqs=64, decode_step_s=0.02, decode_step_per_seq_s=0.0003,
                train_step_s=60.0, sync_s=5.0),
        Schedule(batch_size=512, steps=40)),
    # Long-tailed generation and no tool latency: decoding is the whole episode.
    "long-generation": (
        Workload(Dist("const", 1), Dist("lognormal", 2000, 1.0, 16384), Dist("const", 0.0)),
        Cluster(engines=16, engine_max_seqs=64, decode_step_s=0.02, decode_step_per_seq_s=0.0003,
                train_step_s=30.0, sync_s=3.0),
        Schedule(batch_size=256, steps=40)),
    # Cluster-scale shapes of the kind the seeds' papers train (their exact configurations are not
    # public: these are assumptions, documented with their figures in docs/simulate.md). Trainer
    # time grows with the batch's tokens, so a larger synchronous batch is not free.
    # SAO/TideRL-style agentic episodes (SWE-like): several long-tailed turns, slow long-tailed tools.
    "agentic-256": (
        Workload(Dist("lognormal", 6, 0.6, 40), Dist("lognormal", 400, 1.2, 16384),
                 Dist("lognormal", 4.0, 1.5, 600)),
        Cluster(engines=256, engine_max_seqs=32, decode_step_s=0.02, decode_step_per_seq_s=0.0005,
                prefill_s=0.1, train_step_s=10.0, train_s_per_token=2e-5, sync_s=10.0),
        Schedule(batch_size=1024, steps=20)),
    # KARL-style knowledge agents: many short turns against fast database/graph tools.
    "kg-db-512": (
        Workload(Dist("lognormal", 8, 0.5, 40), Dist("lognormal", 120, 0.8, 2048),
                 Dist("lognormal", 0.3, 1.0, 30)),
        Cluster(engines=512, engine_max_seqs=32, decode_step_s=0.015, decode_step_per_seq_s=0.0003,
                prefill_s=0.03, train_step_s=5.0, train_s_per_token=1.5e-5, sync_s=5.0),
        Schedule(batch_size=2048, steps=15)),
    # SAO-style long reasoning (math answers): one long-tailed generation, no tools.
    "reasoning-128": (
        Workload(Dist("const", 1), Dist("lognormal", 6000, 0.8, 32768), Dist("const", 0.0)),
        Cluster(engines=128, engine_max_seqs=64, decode_step_s=0.02, decode_step_per_seq_s=0.0003,
                prefill_s=0.05, train_step_s=10.0, train_s_per_token=2e-5, sync_s=10.0),
        Schedule(batch_size=512, steps=20)),
}


@dataclass
class ModeSummary:
    """One mode over several seeds: the mean and a 95 % interval (t-distribution) of each figure."""

    label: str
    results: list[SimResult]
    name: str = ""
    synchronous: bool = False

    @staticmethod
    def _interval(values: list[float]) -> tuple[float, float]:
        n = len(values)
        mean = sum(values) / n
        if n < 2:
            return mean, 0.0
        var = sum((v - mean) ** 2 for v in values) / (n - 1)
        # Two-sided 95 % t quantiles for small n (n - 1 degrees of freedom).
        t = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}.get(n - 1, 1.96)
        return mean, t * math.sqrt(var / n)

    def figure(self, name: str) -> tuple[float, float]:
        return self._interval([float(getattr(r, name)) for r in self.results])

    def spread(self, name: str) -> tuple[float, float]:
        """The smallest and largest value of a figure over the seeds."""
        values = [float(getattr(r, name)) for r in self.results]
        return min(values), max(values)

    def staleness_fractions(self) -> dict[int, float]:
        """The staleness histogram (every trajectory judged for training: trained or dropped as
        too stale) as fractions, averaged over the seeds."""
        out: dict[int, float] = {}
        for r in self.results:
            total = sum(r.staleness.values()) or 1
            for k, v in r.staleness.items():
                out[k] = out.get(k, 0.0) + v / total / len(self.results)
        return dict(sorted(out.items()))


def compare(workload: Workload, cluster: Cluster, modes: list[Mode] | list[Schedule], seeds: int = 3) -> list[ModeSummary]:
    """Every mode (a `Mode`, or a bare `Schedule` named by its label) over `seeds` seeds (the
    same seeds for every mode)."""
    out = []
    for m in modes:
        mode = m if isinstance(m, Mode) else Mode(m.label(), m)
        runs = [simulate(workload, mode.cluster(cluster), mode.schedule, seed) for seed in range(seeds)]
        out.append(ModeSummary(mode.label if isinstance(m, Mode) else m.label(), runs, mode.name, mode.synchronous))
    return out


def strongest_sync(summaries: list[ModeSummary]) -> ModeSummary:
    """The synchronous (on-policy) mode with the highest mean trained tokens per second."""
    sync = [m for m in summaries if m.synchronous]
    return max(sync, key=lambda m: m.figure("trained_tokens_per_s")[0])
