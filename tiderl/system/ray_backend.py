"""The Ray backend (docs/ray.md): `RayRollout`, the `RolloutBackend` over a pool of `RolloutWorker`
actors (replaced when they die, resized by the elastic loop: docs/elastic.md), and `RemoteCritic`,
critic values in an actor. Its options are `RayOptions` (`tiderl.system.ray_options`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

try:
    import ray
    from ray.exceptions import OutOfMemoryError, RayActorError

    # How a call reports that its actor is gone: died, killed, or killed by Ray's memory monitor
    # (which raises OutOfMemoryError, not a RayActorError, for the calls in flight on it).
    ACTOR_GONE = (RayActorError, OutOfMemoryError)
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "system.backend=ray needs Ray, which is not installed. Fix: pip install 'ray>=2,<3' "
        "(or use system.backend=local)."
    ) from err

from tiderl.agent.loop import play_episode
from tiderl.config import RunConfig
from tiderl.envs.protocol import Task
from tiderl.envs.setup import Setup
from tiderl.rollout import make_engine
from tiderl.rollout.base import sampling_params
from tiderl.rollout.client import BatchingEngine
from tiderl.rollout.http_engine import HttpEngine
from tiderl.rollout.weights import weights_checksum
from tiderl.system.elastic import CapacityRemoved
from tiderl.system.latency import training_env_factory
from tiderl.system.local import TurnCounting
from tiderl.system.pool import PoolSettings
from tiderl.system.ray_options import RayOptions
from tiderl.system.timing import TimeWeighted
from tiderl.train.annotate import CriticSnapshot
from tiderl.train.lora import policy_state  # what engines hold: the adapters alone for a LoRA policy
from tiderl.types import Trajectory

if TYPE_CHECKING:
    from tiderl.run import Run

logger = logging.getLogger(__name__)

# A replacement worker that fails to start (or to load the weights) is tried again this many
# times in all; after that the pool stays smaller and the failure is in `RayRollout.events`.
MAX_REPLACEMENT_ATTEMPTS = 3


class WorkerLost(RuntimeError):
    """A rollout worker died while serving a call (the call's task can be retried elsewhere)."""


def _cpu_state(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`state_dict` with every tensor on the CPU (no copy for tensors already there)."""
    return {k: v.detach().to("cpu") for k, v in state_dict.items()}


def cpu_module(module: torch.nn.Module) -> torch.nn.Module:
    """`module` itself when it lives on the CPU, else a CPU copy (what is shipped to actors, so a
    worker on a machine without the driver's device can still unpickle it)."""
    if all(p.device.type == "cpu" for p in itertools.chain(module.parameters(), module.buffers())):
        return module
    return copy.deepcopy(module).to("cpu")


def _cancel(ref: Any) -> None:
    """Ask Ray to cancel the task behind `ref` (best effort: it may have finished or died)."""
    with contextlib.suppress(Exception):
        ray.cancel(ref)


def kill_actor(handle: Any) -> None:
    with contextlib.suppress(Exception):  # the actor may already be gone
        ray.kill(handle, no_restart=True)


async def _await_ref(ref: Any, timeout_s: float, what: str) -> Any:
    """The value of `ref`, or TimeoutError naming `what` after `timeout_s` (the Ray task is then
    cancelled). Cancelling the awaiting coroutine cancels the Ray task too."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
    except TimeoutError:
        _cancel(ref)
        raise TimeoutError(f"{what} took longer than system.wait_timeout_s={timeout_s:g}s") from None
    except asyncio.CancelledError:
        _cancel(ref)
        raise


def connect(address: str) -> bool:
    """Make sure this process is connected to Ray. An already initialised Ray is used as it is;
    `address` '' starts a local cluster on all cores; anything else
    ('auto', 'ray://host:10001', 'host:6379') joins that cluster. Returns True when this call
    did the connecting, so the caller knows to `ray.shutdown()` at the end."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address)
    else:
        # "local" rather than None: None would join a cluster named by $RAY_ADDRESS.
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False)
    return True


# ---------------------------------------------------------------------------------- the worker


@dataclass
class WorkerBundle:
    """Everything a rollout worker is built from; put in the object store once per run."""

    cfg: RunConfig
    model: torch.nn.Module  # the policy with the weights of `version`, on the CPU
    version: int
    tokenizer: Any
    setup: Setup  # its make_env builds environments in the worker (backends are not shipped)
    server_urls: list[str] | None = None  # rollout.engine=http: the servers the driver's engine owns
    server_model: str = ""  # and the name requests give them (weight_sync=adapters: the first adapters')


class RolloutWorker:
    """One rollout process: a TorchEngine behind a BatchingEngine, the run's environment
    factory (with simulated tool latency, seeded per worker) and the rollout sampling settings.

    Meant to run as a Ray async actor (`ray.remote(RolloutWorker)`): its methods are coroutines
    on the actor's event loop, so all the episodes routed to it share one engine and their model
    turns are decoded in one batch. `state`/`version`, when given, are loaded over the bundle's
    weights at construction (a replacement worker starts on the latest weights).
    """

    def __init__(self, serial: int, bundle: WorkerBundle, state: dict[str, Any] | None = None,
                 version: int | None = None, max_concurrency: int = 64):
        cfg = bundle.cfg
        self.serial = serial
        # Distinct per worker: no two draw the same token stream, nor a replacement its predecessor's.
        seed = cfg.seed + 1000 * (serial + 1)
        torch.manual_seed(seed)
        if cfg.rollout.engine == "http":  # the driver's engine owns the servers: this one only sends requests
            self.engine: Any = HttpEngine.from_config(cfg, bundle.model, bundle.tokenizer, seed=seed, owner=False,
                                                      urls=bundle.server_urls, served_model=bundle.server_model)
        else:
            self.engine = make_engine(cfg, bundle.model, bundle.tokenizer, seed=seed)
        # The bundle's model already holds the weights of `bundle.version`.
        self.engine.version = bundle.version
        if state is not None:
            self.engine.update_weights(state, bundle.version if version is None else version)
        # A world that changes with the step (the KG's drift) follows the weight version this
        # worker samples with: its copy of the setup is moved here, as the driver's is by the recipe.
        self.on_step = bundle.setup.on_step
        if self.on_step is not None:
            self.on_step(self.engine.version)
        self.tokenizer = bundle.tokenizer
        self.make_env = training_env_factory(cfg, bundle.setup.make_env, seed=seed)
        self.params = sampling_params(cfg.rollout, bundle.tokenizer.eos_token_id, greedy=False)
        self.max_turns = cfg.env.max_turns
        self.max_total_tokens = cfg.env.max_total_tokens
        self.max_concurrency = max_concurrency
        self.max_batch_size = cfg.rollout.engine_batch_size
        self._client: BatchingEngine | None = None
        self.episodes = 0
        self.cancelled = 0
        self.generated_tokens = 0
        self.cut_tokens = 0  # sampled tokens of the completed turns of cancelled episodes (waste)

    def _ensure_client(self) -> BatchingEngine:
        # The BatchingEngine binds to the running event loop, which an actor has only inside its
        # methods, not in __init__.
        if self._client is None:
            loop = asyncio.get_running_loop()
            # Environments without `astep` step on the default executor: a thread per episode.
            loop.set_default_executor(ThreadPoolExecutor(self.max_concurrency + 4, thread_name_prefix="tiderl-env"))
            self._client = BatchingEngine(self.engine, self.max_batch_size)
            self._client.start()
        return self._client

    async def run_episode(self, task: Task, group_id: str) -> Trajectory:
        """Play one episode (`play_episode`) with this worker's engine and environments."""
        client = TurnCounting(self._ensure_client())
        try:
            trajectory = await play_episode(client, self.tokenizer, self.make_env, task, self.params,
                                            self.max_turns, self.max_total_tokens, group_id=group_id)
        except asyncio.CancelledError:  # the driver cancelled it (restart mode, shutdown, timeout)
            self.cancelled += 1
            self.cut_tokens += client.tokens
            raise
        self.episodes += 1
        self.generated_tokens += trajectory.num_action_tokens
        return trajectory

    async def update_weights(self, state: dict[str, Any], version: int) -> tuple[float, int]:
        """Load `state` as `version` (between two decode steps; episodes in flight go on with
        the new weights), move a drifting world to `version`, and return the checksum of the
        weights now held and `cut_tokens` (so the driver's waste figure follows every step)."""
        client = self._ensure_client()
        await client.update_weights(state, version)
        if self.on_step is not None:  # episodes that start from now on play in this version's world
            self.on_step(self.engine.version)
        return await client.call(self.engine.state_checksum), self.cut_tokens

    async def pause_requests(self) -> None:
        """The HTTP engine: send no more requests and wait for those in flight (the driver's
        engine reloads the servers next; `update_weights` with its ServerView resumes)."""
        await self._ensure_client().call(self.engine.pause)

    async def checksum(self) -> float:
        """`weights_checksum` of the weights this worker samples with."""
        return await self._ensure_client().call(self.engine.state_checksum)

    async def stop(self) -> dict[str, Any]:
        """Stop the decode loop (before the actor is killed) and return the final `ping`."""
        stats = await self.ping()
        if self._client is not None:
            await self._client.close()
            self._client = None
        return stats

    async def ping(self) -> dict[str, Any]:
        """Who and where this worker is, and what it has done (for the run's summary)."""
        client = self._client
        return {
            "serial": self.serial,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "version": self.engine.version,
            "episodes": self.episodes,
            "cancelled": self.cancelled,
            "generated_tokens": self.generated_tokens,
            "cut_tokens": self.cut_tokens,
            "requests_retried": getattr(self.engine, "retried", 0),  # the HTTP engine's, on another server
            "decode_batches": client.batches if client else 0,
            "decode_busy_s": round(client.busy_s, 3) if client else 0.0,
        }


# ---------------------------------------------------------------------------------- the backend


@dataclass
class _Weights:
    """One published weight version: its object-store reference (None = the bundle's weights)
    and the checksum the trainer computes for it (a future, computed off the event loop)."""

    version: int
    ref: Any
    checksum: asyncio.Future[float]


@dataclass
class PublishedWeights:
    """Policy weights a trainer rank already put in the object store (`ref`), with the checksum
    it computed over them: `RayRollout.update_weights` hands the reference to the workers as it
    is, so the weights never pass through the driver (tiderl/system/ray_trainer.py)."""

    ref: Any
    checksum: float
    version: int


@dataclass
class _Worker:
    serial: int
    handle: Any
    version: int
    started: float
    load: int = 0  # calls to run_episode in flight
    retiring: bool = False  # removed by an elastic shrink: draining, then killed
    released: bool = False  # its actor was killed (it no longer counts as held)


class RayRollout:
    """The RolloutBackend over a pool of `RolloutWorker` Ray actors. A dead worker is replaced in
    the background (`worker_restarts` counts the replacements started; `events` records each loss
    and replacement). `critic`, when given, is a `RemoteCritic` started with the pool and refreshed
    with the trainer's critic at every weight update (the trainer is idle then)."""

    Options = RayOptions  # system.options with system.backend=ray

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, tokenizer: Any, setup: Setup,
                 start_version: int = 0, *, workers: int | None = None,
                 worker_options: dict[str, Any] | None = None, critic: "RemoteCritic | None" = None,
                 worker_cls: type = RolloutWorker, servers: HttpEngine | None = None):
        self.cfg = cfg
        s: RayOptions = cfg.system.options
        self.num_workers = s.workers if workers is None else workers
        if self.num_workers < 1:
            raise ValueError(f"system.options.workers={self.num_workers}: the Ray backend needs at least one worker")
        self.timeout_s = cfg.system.wait_timeout_s
        # The elastic range (a single point unless min_workers < max_workers).
        self.worker_range = (min(s.min_workers or self.num_workers, self.num_workers),
                             max(s.max_workers or self.num_workers, self.num_workers))
        settings = PoolSettings.from_config(cfg)
        self.slots_per_worker = s.slots_per_worker or math.ceil(settings.initial_slots() / self.num_workers)
        self.drain_s = s.worker_drain_s
        self.on_live_change: Any = None  # called with the live worker count when it changes
        # Every slot may land on one worker when the others are down; the extra calls are the
        # weight updates, checksums and pings that run beside the episodes.
        self.max_concurrency = max(settings.most_slots(), self.worker_range[1] * self.slots_per_worker) + 8
        self.worker_options: dict[str, Any] = {"max_concurrency": self.max_concurrency}
        if cfg.model.device.startswith("cuda") and servers is None:  # HTTP workers only send requests
            self.worker_options["num_gpus"] = 1
        self.worker_options.update(worker_options or {})
        self.critic = critic
        # rollout.engine=http: the driver's engine, the one owner of the servers' weights (the
        # workers pause while it reloads them once per version: `_sync_servers`).
        self.servers = servers
        self._syncing = asyncio.Lock()
        self._actor_cls = ray.remote(worker_cls)
        self._model, self._tokenizer, self._setup = model, tokenizer, setup
        self._start_version = start_version
        self._serials = itertools.count()
        self._workers: dict[int, _Worker] = {}  # live workers by serial
        self._latest: _Weights | None = None
        self._bundle_ref: Any = None
        self._replacing: set[asyncio.Task[None]] = set()
        self._growing: set[asyncio.Task[None]] = set()  # elastic additions booting
        self._draining: dict[int, _Worker] = {}  # removed from routing, finishing their episodes
        self._drains: set[asyncio.Task[None]] = set()  # drains, and cancelled additions winding down
        self._held = TimeWeighted(0.0)  # actors started and not yet killed
        self._live_changed = asyncio.Event()
        self._closing = False
        self._t0 = time.monotonic()
        self.connected_here = False
        self.worker_restarts = 0
        self.events: list[dict[str, Any]] = []
        self.worker_stats: list[dict[str, Any]] = []
        self._cut_by_worker: dict[int, int] = {}  # worker serial -> its cut_tokens (see `cut_tokens`)

    @classmethod
    def from_run(cls, run: "Run", preparations: list[Any] | None = None, executor: Any = None,
                 **options: Any) -> "RayRollout":
        """A RayRollout for `run`: its config, current policy, tokenizer and tasks. With
        `system.options.remote_critic`, the `CriticSnapshot` in `preparations` is replaced (in place)
        by a `RemoteCritic`, so critic values are computed in an actor, not in the driver.
        (`executor`, the driver's shared compute thread, is not needed: decoding runs in actors.)"""
        critic = None
        if run.cfg.system.options.remote_critic and run.critic is not None and preparations is not None:
            for i, p in enumerate(preparations):
                if isinstance(p, CriticSnapshot):
                    critic = preparations[i] = RemoteCritic.from_run(run)
        if run.cfg.rollout.engine == "http":
            options.setdefault("servers", run.engine)
        return cls(run.cfg, run.actor.model, run.tokenizer, run.setup, run.step, critic=critic, **options)

    # ------------------------------------------------------------------ RolloutBackend

    @property
    def version(self) -> int:
        """The lowest weight version over the live workers."""
        if self._workers:
            return min(w.version for w in self._workers.values())
        # No live worker: the replacements on their way will hold the latest weights.
        return self._latest.version if self._latest else self._start_version

    @property
    def live_workers(self) -> int:
        return len(self._workers)

    @property
    def units(self) -> int:
        """The workers the pool is heading for: live ones and those booting (added or
        replacing), not those draining."""
        return len(self._workers) + len(self._growing) + len(self._replacing)

    @property
    def booting(self) -> int:
        """Workers added by `resize` that are still starting."""
        return len(self._growing)

    def worker_seconds(self) -> float:
        """Seconds of worker actors held so far (booting, live or draining), summed over actors."""
        return self._held.integral()

    async def start(self) -> None:
        """Connect to Ray (`connect`), put the `WorkerBundle` in the object store, start `workers`
        actors and check that each holds the trainer's weights."""
        self.connected_here = connect(self.cfg.system.options.address)
        self._check_resources()
        model = cpu_module(self._model)
        if self.servers is not None:
            self._latest = self._server_weights(self._start_version)
        else:
            self._latest = _Weights(self._start_version, None,
                                    asyncio.ensure_future(asyncio.to_thread(weights_checksum, policy_state(model))))
        self._bundle_ref = ray.put(WorkerBundle(self.cfg, model, self._start_version, self._tokenizer, self._setup,
                                                self.servers.urls if self.servers is not None else None,
                                                self.servers.served_model if self.servers is not None else ""))
        self._model = None  # the object store has it now; the trainer keeps its own
        pool = [self._spawn() for _ in range(self.num_workers)]
        try:
            # Every boot runs to its end (no orphaned waits), then the first failure is raised.
            booted = await asyncio.gather(*(self._boot(w) for w in pool), return_exceptions=True)
            failure = next((r for r in booted if isinstance(r, BaseException)), None)
            if failure is not None:
                raise RuntimeError(f"starting {self.num_workers} Ray rollout workers failed: {failure}") from failure
            if self.critic is not None:
                await self.critic.start()
        except BaseException:
            for w in pool:
                self._release(w)
            if self.critic is not None:
                self.critic.close()
            raise
        for w in pool:
            self._admit(w)
        logger.info("%d Ray rollout workers ready (weights version %d)", len(pool), self._start_version)

    def resize(self, units: int, reason: str = "") -> None:
        """Head for `units` workers (kept within `worker_range`): start new ones in the
        background (each joins when booted on the latest weights), or stop booting additions
        and then retire the least-loaded live workers (they drain: `_drain`).
        Returns at once."""
        low, high = self.worker_range
        target = min(high, max(low, units))
        if self._closing:
            return
        while self.units < target:
            task = asyncio.get_running_loop().create_task(self._grow(reason), name="add a rollout worker")
            self._growing.add(task)
            task.add_done_callback(self._growing.discard)
        for task in list(self._growing):
            if self.units <= target:
                break
            self._growing.discard(task)  # counted out now; its boot is cancelled
            self._drains.add(task)  # awaited by close() like a drain
            task.add_done_callback(self._drains.discard)
            task.cancel()
        while self.units > target and len(self._workers) > 1:
            victim = min(self._workers.values(), key=lambda w: (w.load, -w.serial))
            self._retire(victim, reason)

    async def _grow(self, reason: str) -> None:
        w = await self._boot_new("add")
        if w is not None:
            self._event("added", w.serial, version=w.version, boot_s=round(time.monotonic() - w.started, 3),
                        reason=reason)

    def _retire(self, w: _Worker, reason: str) -> None:
        """Take `w` out of routing now and drain it in the background."""
        del self._workers[w.serial]
        w.retiring = True
        self._draining[w.serial] = w
        self._event("draining", w.serial, in_flight=w.load, reason=reason)
        self._notify_live()
        task = asyncio.get_running_loop().create_task(self._drain(w), name=f"drain worker {w.serial}")
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain(self, w: _Worker) -> None:
        """Let `w` finish its episodes for up to `drain_s`, then collect its counters and kill it
        (episodes still running raise CapacityRemoved in `run_episode`)."""
        deadline = time.monotonic() + self.drain_s
        try:
            while w.load > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            cut = w.load
            if cut == 0:
                try:
                    self.worker_stats.append(await _await_ref(w.handle.stop.remote(), min(self.timeout_s, 30.0),
                                                              "stopping"))
                except Exception as exc:  # noqa: BLE001 - its counters are a report, not a reason to keep it
                    logger.debug("stopping drained worker %d: %s", w.serial, exc)
        finally:
            self._draining.pop(w.serial, None)
            self._release(w)
        self._event("removed", w.serial, cut_episodes=cut)

    async def close(self) -> None:
        """Stop replacing, stop each worker and collect its counters (`worker_stats`), kill the
        actors, and disconnect from Ray if `start()` connected."""
        self._closing = True
        for task in list(self._replacing) + list(self._growing):
            task.cancel()
        await asyncio.gather(*self._replacing, *self._growing, return_exceptions=True)
        live = list(self._workers.values())
        stats = await asyncio.gather(*(_await_ref(w.handle.stop.remote(), min(self.timeout_s, 30.0), "stopping")
                                       for w in live), return_exceptions=True)
        self.worker_stats += [s for s in stats if isinstance(s, dict)]  # after the drained workers'
        self._cut_by_worker.update({s["serial"]: s.get("cut_tokens", 0) for s in self.worker_stats})
        for w in live:
            self._release(w)
        self._workers.clear()
        for task in list(self._growing) + list(self._drains):
            task.cancel()
        await asyncio.gather(*self._growing, *self._drains, return_exceptions=True)
        for w in list(self._draining.values()):
            self._release(w)
        self._draining.clear()
        if self.critic is not None:
            self.critic.close()
        self.shutdown()

    async def run_episode(self, task: Task, group_id: str) -> Trajectory:
        """Play `task` on the least-loaded live worker. Raises WorkerLost when that worker dies,
        TimeoutError after `system.wait_timeout_s` (both: the pool retries the task)."""
        w = await self._pick()
        w.load += 1
        try:
            return await self._call(w, w.handle.run_episode.remote(task, group_id),
                                    f"the episode of task {task.task_id}")
        finally:
            w.load -= 1

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> float:
        """Load `state_dict` as `version` on every live worker; returns their common checksum.

        The weights are serialised into the object store once, now (the trainer is idle while
        the pool awaits this call). A worker that dies meanwhile is replaced with these
        weights; one that disagrees fails the sync (RuntimeError naming every worker's checksum).
        """
        if self.servers is not None:
            return await self._sync_servers(state_dict, version)
        if isinstance(state_dict, PublishedWeights):  # already in the object store, checksummed
            known: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            known.set_result(state_dict.checksum)
            latest = _Weights(version, state_dict.ref, known)
        else:
            state = _cpu_state(state_dict)
            latest = _Weights(version, ray.put(state), asyncio.ensure_future(asyncio.to_thread(weights_checksum, state)))
        self._latest = latest  # booting replacements catch up with this from now on
        # Draining workers too: their episodes continue on the new weights.
        targets = list(self._workers.values()) + list(self._draining.values())
        return await self._hand_out(targets, latest, version)

    async def _hand_out(self, targets: list[_Worker], latest: _Weights, version: int) -> float:
        """Load `latest` on `targets` (and refresh the critic); their common checksum."""
        jobs = [self._load(w, latest) for w in targets]
        if self.critic is not None:
            jobs.append(self.critic.refresh_async())
        results = await asyncio.gather(*jobs, return_exceptions=True)
        # Await the trainer-side checksum before returning: its thread reads `state`, which
        # shares storage with the trainer's parameters.
        await latest.checksum
        held: dict[int, float] = {}
        for w, result in zip(targets, results):
            if isinstance(result, (WorkerLost, CapacityRemoved)):
                continue  # its replacement boots with these weights, or it was retired
            if isinstance(result, BaseException):
                raise result
            held[w.serial] = result
        if self.critic is not None and isinstance(results[-1], BaseException):
            raise results[-1]
        if not held:
            # Every worker died during the update: answer for the first replacement (which
            # `_boot` checked against the trainer's checksum before admitting it).
            w = await self._pick()
            return await self._call(w, w.handle.checksum.remote(), "checksum")
        if len(set(held.values())) > 1:
            raise RuntimeError(f"weight sync to version {version} failed: the rollout workers hold different "
                               f"weights (checksum by worker: {held})")
        return next(iter(held.values()))

    def _server_weights(self, version: int) -> _Weights:
        """The servers' state (`ServerView`) as what the workers load for `version`."""
        assert self.servers is not None
        view = self.servers.view()
        known: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        known.set_result(view.checksum)
        return _Weights(version, ray.put(view), known)

    async def _sync_servers(self, state_dict: Any, version: int) -> float:
        """rollout.engine=http: every worker stops sending requests and drains, the driver's engine
        reloads and probes each server once, then the workers go on at `version` (with the
        servers that are up). A failed reload resumes the workers on the old weights, then raises."""
        if isinstance(state_dict, PublishedWeights):  # a trainer rank's: the engine writes files here
            state_dict = await asyncio.wrap_future(state_dict.ref.future())
        async with self._syncing:  # a replacement booting meanwhile joins after this
            targets = list(self._workers.values()) + list(self._draining.values())
            paused = await asyncio.gather(*(self._call(w, w.handle.pause_requests.remote(), "pausing its requests")
                                            for w in targets), return_exceptions=True)
            failure = next((r for r in paused if isinstance(r, BaseException)
                            and not isinstance(r, (WorkerLost, CapacityRemoved))), None)
            try:
                if failure is None:
                    await asyncio.to_thread(self.servers.update_weights, _cpu_state(state_dict), version)  # type: ignore[union-attr]
                    self._latest = self._server_weights(version)
            finally:
                latest = self._latest
                assert latest is not None
                held = await self._hand_out(targets, latest, latest.version)
            if failure is not None:
                raise failure
            return held

    # ------------------------------------------------------------------ the pool

    def _check_resources(self) -> None:
        most = self.worker_range[1]  # an elastic pool may grow to this many
        gpus = float(self.worker_options.get("num_gpus", 0) or 0) * most
        available = ray.cluster_resources().get("GPU", 0.0)
        if gpus > available:
            raise RuntimeError(
                f"{most} Ray rollout workers need {gpus:g} GPUs and the cluster has {available:g}. "
                "Fix: lower system.options.workers (or max_workers), or pass "
                "worker_options={'num_gpus': <fraction>} to RayRollout.")

    def _spawn(self) -> _Worker:
        """Start a worker actor on the latest published weights (not yet in the pool)."""
        serial = next(self._serials)
        latest = self._latest
        assert latest is not None and self._bundle_ref is not None, "RayRollout.start() was not called"
        handle = self._actor_cls.options(**self.worker_options).remote(
            serial, self._bundle_ref, latest.ref, latest.version if latest.ref is not None else None,
            self.max_concurrency)
        self._held.set(self._held.value + 1)
        return _Worker(serial, handle, latest.version, time.monotonic())

    def _release(self, w: _Worker) -> None:
        """Kill `w`'s actor (once; it stops counting as held)."""
        if not w.released:
            w.released = True
            self._held.set(self._held.value - 1)
        kill_actor(w.handle)

    async def _boot(self, w: _Worker) -> None:
        """Wait until `w` has started and holds the latest weights, verified by checksum. Loops
        when a newer version is published while it loads, so it joins the pool up to date."""
        await self._call(w, w.handle.ping.remote(), "starting")
        while True:
            if self._syncing.locked():  # the servers are reloading: join at the new version
                async with self._syncing:
                    pass
            latest = self._latest
            assert latest is not None
            if w.version != latest.version:
                held = await self._load(w, latest)
            else:
                held = await self._call(w, w.handle.checksum.remote(), "checksum")
            expected = await latest.checksum
            if held != expected:
                raise RuntimeError(f"rollout worker {w.serial} holds weights with checksum {held!r} for version "
                                   f"{latest.version}; the trainer's are {expected!r}")
            if self._latest is latest and not self._syncing.locked():  # nothing newer arrived: it is current
                return

    def _admit(self, w: _Worker) -> None:
        self._workers[w.serial] = w
        self._live_changed.set()
        self._notify_live()

    def _notify_live(self) -> None:
        if self.on_live_change is not None:
            self.on_live_change(len(self._workers))

    async def _pick(self) -> _Worker:
        """The live worker with the fewest episodes in flight (waiting for a replacement when
        none is live)."""
        deadline = time.monotonic() + self.timeout_s
        while not self._workers:
            if not self._replacing and not self._growing:
                raise RuntimeError("no live Ray rollout worker, and none is being replaced: see the "
                                   f"worker events {self.events[-3:]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no live Ray rollout worker for system.wait_timeout_s={self.timeout_s:g}s "
                                   f"({len(self._replacing)} replacements starting)")
            self._live_changed.clear()
            try:
                await asyncio.wait_for(self._live_changed.wait(), left)
            except TimeoutError:
                pass
        return min(self._workers.values(), key=lambda w: (w.load, w.serial))

    async def _call(self, w: _Worker, ref: Any, what: str) -> Any:
        """Await a call on worker `w`; its death becomes WorkerLost (and starts a replacement)."""
        try:
            return await _await_ref(ref, self.timeout_s, f"rollout worker {w.serial}: {what}")
        except ACTOR_GONE as exc:
            if w.retiring:
                raise CapacityRemoved(f"rollout worker {w.serial} was removed by an elastic shrink "
                                      f"(system.options.worker_drain_s={self.drain_s:g}s passed) during {what}") from exc
            self._lose(w, exc)
            # Ray's message starts with where it happened and ends with the exception that killed
            # the actor (e.g. its constructor's): keep both ends.
            cause = " ".join(str(exc).split())
            if len(cause) > 700:
                cause = f"{cause[:200]} ... {cause[-500:]}"
            raise WorkerLost(f"rollout worker {w.serial} died during {what}: {type(exc).__name__}: {cause}") from exc

    async def _load(self, w: _Worker, weights: _Weights) -> float:
        held = await self._call(w, w.handle.update_weights.remote(weights.ref, weights.version),
                                f"loading weights version {weights.version}")
        if isinstance(held, tuple):  # (checksum, cut_tokens): RolloutWorker's; a stand-in may send the checksum alone
            held, self._cut_by_worker[w.serial] = held
        w.version = max(w.version, weights.version)
        return held

    @property
    def cut_tokens(self) -> int:
        """Sampled tokens of the completed turns of cancelled episodes, over every worker, as of
        each worker's latest weight load or stop (a worker that died takes its count since then)."""
        return sum(self._cut_by_worker.values())

    def _lose(self, w: _Worker, exc: BaseException) -> None:
        """Take a dead worker out of the pool and start its replacement (once per worker, however
        many of its calls fail; a worker still booting is retried by `_replace` instead)."""
        if self._workers.get(w.serial) is not w:
            return
        del self._workers[w.serial]
        self._release(w)
        self._notify_live()
        self._event("lost", w.serial, reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        logger.warning("Ray rollout worker %d died (%s); %d live", w.serial, type(exc).__name__, len(self._workers))
        if self._closing:
            return
        self.worker_restarts += 1
        task = asyncio.get_running_loop().create_task(self._replace(w.serial), name=f"replace worker {w.serial}")
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _boot_new(self, what: str, **details: Any) -> _Worker | None:
        """A new worker on the latest weights, admitted once booted; None when its boot failed (the
        actor killed, event `<what>_failed`). A cancelled boot kills it too (`<what>_cancelled`)."""
        w = self._spawn()
        try:
            await self._boot(w)
        except asyncio.CancelledError:  # the backend is closing, or an elastic shrink
            self._release(w)
            self._event(f"{what}_cancelled", w.serial, **details)
            raise
        except Exception as exc:  # noqa: BLE001 - a failed boot leaves the pool as it was, recorded
            self._release(w)
            self._event(f"{what}_failed", w.serial, **details, reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            logger.warning("starting Ray rollout worker %d (%s) failed: %s", w.serial, what, exc)
            return None
        self._admit(w)
        return w

    async def _replace(self, lost: int) -> None:
        for attempt in range(1, MAX_REPLACEMENT_ATTEMPTS + 1):
            w = await self._boot_new("replacement", replaces=lost, attempt=attempt)
            if w is not None:
                self._event("replaced", w.serial, replaces=lost, version=w.version,
                            boot_s=round(time.monotonic() - w.started, 3))
                logger.info("Ray rollout worker %d replaces %d (weights version %d)", w.serial, lost, w.version)
                return
        logger.error("could not replace Ray rollout worker %d after %d attempts", lost, MAX_REPLACEMENT_ATTEMPTS)

    def _event(self, kind: str, serial: int, **details: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self._t0, 3), "event": kind, "worker": serial, **details})

    def report(self) -> dict[str, Any]:
        """The backend's part of the run summary."""
        return {
            "ray_version": ray.__version__,
            "address": self.cfg.system.options.address or "local",
            "workers": self.num_workers,
            "worker_range": list(self.worker_range),
            "slots_per_worker": self.slots_per_worker,
            "worker_seconds": round(self.worker_seconds(), 3),
            "worker_restarts": self.worker_restarts,
            "events": self.events,
            "worker_stats": self.worker_stats,
            "critic_refreshes": self.critic.refreshes if self.critic is not None else None,
            **({"servers": {"urls": self.servers.urls, "events": self.servers.events, "retried": self.servers.retried}}
               if self.servers is not None else {}),
        }

    def shutdown(self) -> None:
        """Disconnect from Ray if `start()` connected (a Ray initialised by the caller stays)."""
        if self.connected_here and ray.is_initialized():
            ray.shutdown()
        self.connected_here = False


# ---------------------------------------------------------------------------------- the critic


class CriticWorker:
    """A copy of the critic in its own process (a Ray actor): computes per-token values exactly
    as `CriticSnapshot` does in the local backend. Calls run one at a time, so a weight load
    never overlaps a forward pass."""

    def __init__(self, critic: torch.nn.Module, pad_id: int, micro_batch_tokens: int, device: str,
                 image_processor: Any = None):
        self.snapshot = CriticSnapshot(critic, pad_id, micro_batch_tokens, device, image_processor)
        self.batches = 0

    def values(self, trajectories: list[Trajectory]) -> list[list[float]]:
        """One critic value per token of each trajectory."""
        self.snapshot(trajectories)
        self.batches += 1
        return [t.annotations["values"] for t in trajectories]

    def load(self, state: dict[str, Any]) -> float:
        """Load the trainer's critic weights; returns the checksum of what is now held."""
        self.snapshot.model.load_state_dict(state)
        return weights_checksum(self.snapshot.model.state_dict())

    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "batches": self.batches}


class RemoteCritic:
    """A Preparation (puts `annotations["values"]` on trajectories) whose critic forward runs in
    a `CriticWorker` actor, so it takes no compute from the driver's trainer. It has no blocking
    `refresh`: the Ray backend refreshes it (`refresh_async`) while the trainer is idle."""

    def __init__(self, critic: torch.nn.Module, pad_id: int, micro_batch_tokens: int, device: str, timeout_s: float,
                 image_processor: Any = None):
        self.source = critic
        self.image_processor = image_processor  # a vision-language model's, for trajectories with images
        self.pad_id = pad_id
        self.micro_batch_tokens = micro_batch_tokens
        self.device = device
        self.timeout_s = timeout_s
        self.actor_options = {"num_gpus": 1} if device.startswith("cuda") else {}
        self._handle: Any = None
        self.refreshes = 0

    @classmethod
    def from_run(cls, run: "Run") -> "RemoteCritic":
        cfg = run.cfg
        return cls(run.critic.model, run.tokenizer.pad_token_id, cfg.train.micro_batch_tokens,
                   cfg.model.device, cfg.system.wait_timeout_s, getattr(run.tokenizer, "image_processor", None))

    async def start(self) -> None:
        """Create the critic actor (Ray must be connected) and wait until it is up."""
        critic = cpu_module(self.source)
        self._handle = ray.remote(CriticWorker).options(**self.actor_options).remote(
            critic, self.pad_id, self.micro_batch_tokens, self.device, self.image_processor)
        await _await_ref(self._handle.ping.remote(), self.timeout_s, "starting the critic actor")

    def __call__(self, trajectories: list[Trajectory]) -> None:
        """Put `annotations["values"]` on each trajectory (blocking; runs on the prep thread)."""
        if self._handle is None:
            raise RuntimeError("RemoteCritic.start() was not called")
        values = ray.get(self._handle.values.remote(trajectories), timeout=self.timeout_s)
        for trajectory, v in zip(trajectories, values):
            trajectory.annotations["values"] = v

    async def refresh_async(self) -> None:
        """Ship the trainer critic's new weights and check them by checksum (awaited by
        `RayRollout.update_weights`, right after each trainer step)."""
        state = _cpu_state(self.source.state_dict())
        # Serialised now: the caller guarantees the trainer is not stepping at this moment.
        ref, sent = ray.put(state), weights_checksum(state)
        held = await _await_ref(self._handle.load.remote(ref), self.timeout_s, "critic weight refresh")
        if held != sent:
            raise RuntimeError(f"critic weight refresh failed: the critic actor holds checksum {held!r}, "
                               f"the trainer sent {sent!r}")
        self.refreshes += 1

    def close(self) -> None:
        if self._handle is not None:
            kill_actor(self._handle)
            self._handle = None
