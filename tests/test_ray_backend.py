"""The Ray backend on a local 2-CPU Ray cluster with a tiny model: end-to-end asynchronous SAO,
a rollout worker killed mid-run, the worker pool's fault handling step by step, and the remote
critic's values against the local one's."""

import asyncio
import copy
import json
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from tiderl.config import load_config  # noqa: E402
from tiderl.recipe import train  # noqa: E402
from tiderl.rollout.weights import weights_checksum  # noqa: E402
from tiderl.run import build_run  # noqa: E402
from tiderl.system import ray_backend as rb  # noqa: E402
from tiderl.train.annotate import CriticSnapshot  # noqa: E402
from tiderl.types import NO_VERSION  # noqa: E402

SMALL = [
    "env.options.num_films=40", "env.options.num_people=40", "data.eval_size=16",
    "model.tiny.vocab_size=512", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
    "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.warmstart.num_traces=200", "model.warmstart.steps=20", "model.warmstart.batch_size=16",
    "rollout.batch_size=8", "algo.critic_warmup_steps=1", "log.progress=false", "log.tensorboard=false",
    # Generous: a Ray worker imports torch and transformers when it starts, which takes minutes
    # on a loaded 2-core machine; the bound is there to turn a hang into a clear failure.
    "system.wait_timeout_s=400",
]
TIMEOUT_S = 400  # every blocking Ray call in this file waits at most this long


def small_config(cache, run_dir, *more):
    return load_config("configs/kg_sao_tiny.yaml", SMALL + [f"model.cache_dir={cache}", f"run_dir={run_dir}", *more])


def sampled_versions(trajectory):
    return [v for v, m in zip(trajectory.policy_version, trajectory.loss_mask) if m]


def perturbed(model, seed):
    """The weights of a copy of `model` moved by small noise (a stand-in for a trainer step).
    The noise goes on the parameters, so tied weights (embeddings and LM head) stay tied."""
    g = torch.Generator().manual_seed(seed)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return moved.state_dict()


def assert_ledger_balances(summary):
    """Every attempt started is in exactly one bucket (trained, dropped_stale, failed, retried,
    restarted, unsettled, and any bucket the scheduler adds later)."""
    ledger = summary["ledger"]
    assert ledger["started"] == sum(v for k, v in ledger.items() if k != "started"), ledger


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_ray_backend_trains_asynchronously(ray_cluster, cache, tmp_path):
    cfg = small_config(cache, tmp_path / "run", "train.steps=3", "system.backend=ray",
                       "system.max_staleness=1", "system.options.workers=2")
    run = build_run(cfg)
    batches = []  # (trainer version, sampled token versions of each trajectory) per step

    def observer(version, metrics, batch):  # called after the step that made `version`
        batches.append((version - 1, [sampled_versions(t) for t in batch]))

    history, _ = train(run, observer=observer)  # raises if any worker's checksum differed from the trainer's

    assert len(history) == 3 and run.step == 3
    assert [h["policy_version"] for h in history] == [1, 2, 3]
    assert [version for version, _ in batches] == [0, 1, 2]
    for version, trajectories in batches:
        assert len(trajectories) == cfg.rollout.batch_size
        for versions in trajectories:
            assert versions and NO_VERSION not in versions
            # Within the staleness bound, and never sampled by weights the trainer has not made.
            assert version - min(versions) <= 1 and max(versions) <= version, (version, versions)
    assert all(h["system/staleness_max"] <= 1 for h in history)

    summary = json.loads((tmp_path / "run" / "system.json").read_text())
    assert summary["ledger"]["trained"] == 3 * cfg.rollout.batch_size
    assert summary["ledger"]["failed"] == 0
    assert_ledger_balances(summary)
    assert summary["backend"]["worker_restarts"] == 0
    stats = summary["backend"]["worker_stats"]
    assert sorted(s["serial"] for s in stats) == [0, 1]
    # Least-loaded routing used both workers, and each ended on the last weights.
    assert all(s["episodes"] > 0 and s["version"] == 3 for s in stats), stats
    assert summary["backend"]["critic_refreshes"] is None  # the critic ran in the driver

    # The driver's own engine follows the trained weights (evaluation after training uses it).
    assert run.engine.version == 3
    assert run.engine.state_checksum() == weights_checksum(run.actor.model.state_dict())
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]


@pytest.mark.slow
def test_killed_worker_is_retried_and_replaced(ray_cluster, cache, tmp_path, monkeypatch):
    # Simulated tool latency makes episodes long enough to be killed in flight.
    cfg = small_config(cache, tmp_path / "run", "train.steps=3", "system.backend=ray",
                       "system.max_staleness=1", "system.options.workers=2",
                       "env.tool_latency=fixed", "env.tool_latency_s=0.3",
                       "system.options.remote_critic=true")  # also run the critic in its own actor
    run = build_run(cfg)
    rollouts = []
    from_run = rb.RayRollout.from_run

    def capturing_from_run(run, preparations, executor=None):
        rollouts.append(from_run(run, preparations, executor))
        return rollouts[-1]

    monkeypatch.setattr(rb.RayRollout, "from_run", capturing_from_run)
    killed = []

    def killer():
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and not killed:
            try:
                busy = [w for w in list(rollouts[0]._workers.values()) if w.load > 0] if rollouts else []
            except RuntimeError:  # the pool changed while we looked
                busy = []
            if busy:
                time.sleep(0.3)  # let its episodes get into their first tool calls
                victim = max(busy, key=lambda w: w.load)
                killed.append((victim.serial, victim.load))
                ray.kill(victim.handle)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    history, _ = train(run)
    thread.join(timeout=5)

    assert killed, "the worker pool never had an episode in flight"
    assert len(history) == 3 and run.step == 3
    summary = json.loads((tmp_path / "run" / "system.json").read_text())
    ledger = summary["ledger"]
    assert ledger["retried"] >= 1 and ledger["failed"] == 0, ledger
    assert ledger["trained"] == 3 * cfg.rollout.batch_size
    assert_ledger_balances(summary)
    assert summary["backend"]["worker_restarts"] >= 1
    lost = [e for e in summary["backend"]["events"] if e["event"] == "lost"]
    assert [e["worker"] for e in lost] == [killed[0][0]]
    print("ray summary:", json.dumps(summary["backend"]), "ledger:", ledger)
    assert summary["backend"]["critic_refreshes"] == 3


# ------------------------------------------------------------------ the pool, step by step


@pytest.fixture(scope="module")
def slow_tool_run(ray_cluster, cache, tmp_path_factory):
    """A run whose episodes take at least 1.5 s (one simulated tool call)."""
    cfg = small_config(cache, tmp_path_factory.mktemp("pool"), "system.backend=ray", "system.options.workers=2",
                       "env.tool_latency=fixed", "env.tool_latency_s=1.5")
    return build_run(cfg)


@pytest.mark.slow
def test_worker_pool_routes_syncs_and_replaces(slow_tool_run):
    run = slow_tool_run
    tasks = run.tasks.take(4)

    async def scenario():
        rollout = rb.RayRollout.from_run(run)
        await rollout.start()
        try:
            assert rollout.version == 0 and rollout.live_workers == 2

            state1 = perturbed(run.actor.model, 1)
            assert await rollout.update_weights(state1, 1) == weights_checksum(state1)
            assert rollout.version == 1

            # Two episodes at once go to different workers; kill the first one's worker mid-episode.
            first = rollout._workers[0]
            episodes = [asyncio.ensure_future(rollout.run_episode(t, t.task_id)) for t in tasks[:2]]
            await asyncio.sleep(0.5)
            assert first.load == 1 and rollout._workers[1].load == 1
            ray.kill(first.handle)
            lost, played = await asyncio.wait_for(asyncio.gather(*episodes, return_exceptions=True), TIMEOUT_S)
            assert isinstance(lost, rb.WorkerLost), lost
            assert set(sampled_versions(played)) == {1}
            assert rollout.live_workers == 1 and rollout.version == 1 and rollout.worker_restarts == 1

            # Weights move on while the replacement boots; it must join on the newest ones.
            state2 = perturbed(run.actor.model, 2)
            assert await rollout.update_weights(state2, 2) == weights_checksum(state2)
            while rollout.live_workers < 2:  # a replacement that never came would fail by the test's timeout
                await asyncio.sleep(0.2)
            assert sorted(rollout._workers) == [1, 2] and rollout.version == 2
            fresh = rollout._workers[2].handle
            assert await rb._await_ref(fresh.checksum.remote(), TIMEOUT_S, "checksum") == weights_checksum(state2)
            print("worker pool events:", rollout.events)
            assert [e["event"] for e in rollout.events] == ["lost", "replaced"]
            assert rollout.events[1]["replaces"] == 0 and rollout.events[1]["version"] == 2

            played = await asyncio.wait_for(
                asyncio.gather(*(rollout.run_episode(t, t.task_id) for t in tasks[2:])), TIMEOUT_S)
            assert all(set(sampled_versions(t)) == {2} for t in played)

            # Cancelling an episode (restart mode, shutdown) cancels it on the worker too.
            cancelled = asyncio.ensure_future(rollout.run_episode(tasks[0], "cancelled"))
            await asyncio.sleep(0.5)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert rollout._workers[1].load == 0 and rollout._workers[2].load == 0
            while True:  # a cancellation the worker never saw would fail by the test's timeout
                pings = [await rb._await_ref(w.handle.ping.remote(), TIMEOUT_S, "ping")
                         for w in rollout._workers.values()]
                if sum(p["cancelled"] for p in pings) == 1:
                    break
                await asyncio.sleep(0.2)
        finally:
            await rollout.close()
        assert sorted((s["serial"], s["episodes"]) for s in rollout.worker_stats) == [(1, 2), (2, 1)]
        assert rollout.live_workers == 0

    asyncio.run(scenario())


@pytest.mark.slow
def test_remote_critic_matches_the_local_critic(slow_tool_run):
    run = slow_tool_run
    cfg = run.cfg
    from support import rollout as play

    # Short episodes with the driver's engine (no tool latency there: only training episodes wait).
    trajectories = play(run, run.tasks.take(3))

    def values(preparation):
        copies = [type(t)(**{**t.__dict__, "annotations": {}}) for t in trajectories]
        preparation(copies)
        return [torch.tensor(t.annotations["values"]) for t in copies]

    def same(a, b):
        return all(x.shape == y.shape and torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))

    saved = copy.deepcopy(run.critic.model.state_dict())
    head = run.critic.model.head

    async def scenario():
        with torch.no_grad():  # a non-trivial critic (the fresh head is all zeros)
            head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)))
            head.bias.fill_(0.3)
        critic = rb.RemoteCritic.from_run(run)
        await critic.start()
        local = CriticSnapshot(run.critic.model, run.tokenizer.pad_token_id,
                                             cfg.train.micro_batch_tokens, cfg.model.device)
        try:
            before = values(critic)
            assert min(v[1:].std().item() for v in before) > 1e-3
            assert same(before, values(local))
            with torch.no_grad():  # the trainer moves the critic...
                head.weight.mul_(2.0)
                head.bias.add_(1.0)
            assert same(values(critic), before)  # ...which the actor sees only after a refresh
            await critic.refresh_async()
            local.refresh(run.critic.model)
            after = values(critic)
            assert not same(after, before) and same(after, values(local))
            assert critic.refreshes == 1
        finally:
            critic.close()
            run.critic.model.load_state_dict(saved)

    asyncio.run(scenario())


class DisagreeingWorker:
    """A stand-in for RolloutWorker whose worker 1 reports a wrong checksum after a weight update."""

    def __init__(self, serial, bundle, state=None, version=None, max_concurrency=8):
        self.serial = serial
        self.held = weights_checksum(bundle.model.state_dict())

    async def ping(self):
        return {"serial": self.serial}

    async def stop(self):
        return await self.ping()

    async def checksum(self):
        return self.held

    async def update_weights(self, state, version):
        self.held = weights_checksum(state) + (0.5 if self.serial == 1 else 0.0)
        return self.held


@pytest.mark.slow
def test_disagreeing_workers_fail_the_sync(ray_cluster):
    cfg = load_config("configs/kg_sao_tiny.yaml", ["system.backend=ray", "system.options.workers=2",
                                                   "rollout.batch_size=2", "system.wait_timeout_s=400"])
    model = torch.nn.Linear(3, 2)

    async def scenario():
        rollout = rb.RayRollout(cfg, model, None, None, workers=2, worker_cls=DisagreeingWorker)
        await rollout.start()
        try:
            assert rollout.live_workers == 2 and not rollout.connected_here
            state = {k: v + 1 for k, v in model.state_dict().items()}
            with pytest.raises(RuntimeError, match="hold different weights"):
                await rollout.update_weights(state, 1)
        finally:
            await rollout.close()

    asyncio.run(scenario())


@pytest.mark.slow
def test_ray_backend_counts_the_tokens_of_cancelled_episodes_as_waste(ray_cluster, cache, tmp_path):
    """Over-provisioned on-policy training on Ray (admission 2x the batch, staleness 0) cancels the
    episodes still running on old weights: their workers count the sampled tokens of their completed
    turns (`cut_tokens`), and the run's waste includes them, as with the local backend."""
    cfg = small_config(cache, tmp_path / "run", "train.steps=3", "system.backend=ray", "system.options.workers=2",
                       "system.admission=16", "env.tool_latency=lognormal", "env.tool_latency_s=0.3",
                       "env.tool_latency_spread=1.5")  # a long tail: some episodes still run when the weights change
    history, summary = train(build_run(cfg))
    assert summary["ledger"]["restarted"] > 0, summary["ledger"]  # episodes were cut
    cut = sum(s["cut_tokens"] for s in summary["backend"]["worker_stats"])
    assert cut > 0 and summary["waste"]["cut"] == cut, (cut, summary["waste"])
    assert summary["waste"]["wasted_tokens"] >= cut
    assert history[-1]["system/wasted_tokens"] > 0  # seen during the run, not only at the end
    assert_ledger_balances(summary)


def test_workers_ask_for_a_gpu_only_when_they_hold_an_engine():
    """On GPUs a worker with its own torch engine takes one; with the HTTP engine the workers only
    send requests to the servers, so they take none (the GPUs stay for the servers and ranks)."""
    cfg = load_config("configs/kg_sao_tiny.yaml", ["system.backend=ray", "model.device=cuda"])
    assert rb.RayRollout(cfg, None, None, None).worker_options.get("num_gpus") == 1
    assert "num_gpus" not in rb.RayRollout(cfg, None, None, None, servers=object()).worker_options
