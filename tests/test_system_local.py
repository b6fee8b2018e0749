"""The local asynchronous backend with real parts: latency wrapper, batching engine client,
pipelined critic values, and a few asynchronous SAO steps on a tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics

import pytest
import torch

from support import SMALL, rollout, small_config, versions
from tiderl.envs.protocol import Action, StepResult, Task
from tiderl.rollout.base import Completion, SamplingParams
from tiderl.rollout.client import BatchingEngine
from tiderl.system.latency import LatencyEnv, draw_latency, with_latency
from tiderl.train.step import train_step

# --- simulated latency ----------------------------------------------------------------------------


def test_latency_distributions_have_the_configured_mean_and_shape():
    rng = random.Random(0)
    assert draw_latency("fixed", 0.3, 1.0, 0.0, rng) == 0.3
    assert draw_latency("none", 0.3, 1.0, 0.0, rng) == 0.0
    uniform = [draw_latency("uniform", 1.0, 0.5, 0.0, rng) for _ in range(5000)]
    assert 0.5 <= min(uniform) and max(uniform) <= 1.5
    assert statistics.mean(uniform) == pytest.approx(1.0, abs=0.02)
    heavy = [draw_latency("lognormal", 1.0, 1.0, 0.0, rng) for _ in range(40000)]
    # mu = ln(1) - 1/2, so the mean is 1 and the median exp(-1/2) = 0.607.
    assert statistics.mean(heavy) == pytest.approx(1.0, rel=0.05)
    assert statistics.median(heavy) == pytest.approx(math.exp(-0.5), rel=0.05)
    assert max(heavy) > 10  # a heavy tail
    capped = [draw_latency("lognormal", 1.0, 1.0, 2.0, rng) for _ in range(2000)]
    assert max(capped) == 2.0
    with pytest.raises(ValueError, match="unknown latency kind"):
        draw_latency("gamma", 1.0, 1.0, 0.0, rng)


class EchoEnv:
    def system_prompt(self) -> str:
        return "sys"

    def tool_schemas(self) -> list:
        return []

    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, action: Action) -> StepResult:
        return StepResult([action.text], done=action.text == "stop", info={"success": 1})

    def finish(self, reason: str) -> StepResult:
        return StepResult([], done=True, info={"success": 0})


def test_latency_env_delays_steps_and_reports_the_total():
    make = with_latency(EchoEnv, "fixed", 0.05, 0.0, seed=1)
    env = make()
    assert isinstance(env, LatencyEnv) and env.system_prompt() == "sys"

    async def two_steps():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = await env.astep(Action("hi"))
        last = await env.astep(Action("stop"))
        return first, last, loop.time() - t0

    first, last, took = asyncio.run(two_steps())
    assert first.observations == ["hi"] and last.done
    assert took >= 0.1
    assert last.info["tool_latency_s"] == pytest.approx(0.1)
    assert with_latency(EchoEnv, "none", 0.0, 0.0) is EchoEnv  # nothing wrapped


def test_latency_of_an_environment_does_not_depend_on_creation_order_of_others():
    make_a = with_latency(EchoEnv, "lognormal", 0.2, 1.0, seed=7)
    make_b = with_latency(EchoEnv, "lognormal", 0.2, 1.0, seed=7)
    a = [make_a().draw() for _ in range(3)]
    b = [make_b().draw() for _ in range(3)]
    assert a == b and len(set(a)) == 3


# --- the batching engine client ---------------------------------------------------------------------


class CountingEngine:
    """Echoes each prompt's last token `max_new_tokens` times; records each call's batch size."""

    version = 3

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.max_new_tokens))
        n = params.max_new_tokens
        return [Completion([p[-1]] * n, [-0.5] * n, "x" * n, "length", [self.version] * n) for p in prompts]

    def update_weights(self, state_dict, version):
        self.version = version


def test_concurrent_requests_are_decoded_together_and_cut_to_their_own_budget():
    engine = CountingEngine()

    async def main():
        client = BatchingEngine(engine, max_batch_size=8)
        client.start()
        budgets = [2, 5, 3, 5, 1]
        outs = await asyncio.gather(*(client.generate([i, 10 + i], SamplingParams(max_new_tokens=b))
                                      for i, b in enumerate(budgets)))
        greedy = await client.generate([1], SamplingParams(temperature=0.0, max_new_tokens=2))
        await client.close()
        return budgets, outs, greedy

    budgets, outs, greedy = asyncio.run(main())
    assert engine.calls[0] == (5, 5)  # one batch, the largest budget
    for i, (b, out) in enumerate(zip(budgets, outs)):
        assert out.token_ids == [10 + i] * b and len(out.logprobs) == b == len(out.policy_version)
        assert out.finish_reason == "length"
    assert engine.calls[-1] == (1, 2) and greedy.token_ids == [1, 1]  # other settings: own batch


def test_a_request_level_engine_never_batches_requests_with_different_seeds():
    """One SamplingParams goes with each generate call: a seeded request's own stream must not
    be replaced by its batch neighbour's."""
    seen = []

    class SeedRecorder(CountingEngine):
        def generate(self, prompts, params):
            seen.append((len(prompts), params.seed))
            return super().generate(prompts, params)

    async def main():
        client = BatchingEngine(SeedRecorder(), max_batch_size=8)
        client.start()
        await asyncio.gather(*(client.generate([i], SamplingParams(max_new_tokens=2, seed=s))
                               for i, s in enumerate([7, 7, 8])))
        await client.close()

    asyncio.run(main())
    assert sorted(seen) == [(1, 8), (2, 7)]


def test_engine_failure_reaches_every_waiting_episode():
    class Broken(CountingEngine):
        def generate(self, prompts, params):
            raise RuntimeError("CUDA error: out of memory")

    async def main():
        client = BatchingEngine(Broken())
        client.start()
        results = await asyncio.gather(*(client.generate([1], SamplingParams()) for _ in range(3)),
                                       return_exceptions=True)
        await client.close()
        return results

    assert all(isinstance(r, RuntimeError) and "out of memory" in str(r) for r in asyncio.run(main()))


# --- a tiny model, end to end ---------------------------------------------------------------------


@pytest.mark.slow
def test_precomputed_critic_values_give_the_same_step(cache, tmp_path):
    from tiderl.run import build_run
    from tiderl.train.annotate import CriticSnapshot

    cfg = small_config(cache, tmp_path / "run")
    run = build_run(cfg)
    trajectories = rollout(run, run.tasks.take(6))
    snapshot = CriticSnapshot(run.critic.model, run.tokenizer.pad_token_id, 512, "cpu")
    annotated = [type(t).from_dict({**t.to_dict(), "annotations": {}}) for t in trajectories]
    snapshot(annotated)
    assert all(len(t.annotations["values"]) == len(t.tokens) for t in annotated)

    def grads_after(batch):
        run2 = build_run(cfg)
        m = train_step(batch, run2.actor, run2.critic, None, cfg.algo, run2.tokenizer.pad_token_id,
                       512, train_actor=True)
        return m, {k: v.detach().clone() for k, v in run2.actor.model.state_dict().items()}

    m_plain, w_plain = grads_after(trajectories)
    m_pre, w_pre = grads_after(annotated)
    assert m_plain["value/precomputed"] == 0.0 and m_pre["value/precomputed"] == 1.0
    assert m_pre["value/loss_first"] == pytest.approx(m_plain["value/loss_first"], abs=1e-6)
    assert m_pre["policy/loss"] == pytest.approx(m_plain["policy/loss"], abs=1e-6)
    for k in w_plain:
        assert torch.allclose(w_plain[k], w_pre[k], atol=1e-6), k


@pytest.mark.slow
def test_asynchronous_sao_on_a_tiny_model_trains_on_mixed_versions(cache, tmp_path):
    from tiderl.recipe import train
    from tiderl.run import build_run

    cfg = small_config(cache, tmp_path / "run", "system.backend=local", "system.max_staleness=2",
                       "rollout.batch_size=4", "train.steps=8", "env.tool_latency=fixed",
                       "env.tool_latency_s=0.1", "log.tensorboard=false")
    run = build_run(cfg)
    seen = []
    history, summary = train(run, observer=lambda v, m, b: seen.append((v, m, b)))
    # Eight steps and 0.1 s tool calls: enough multi-turn episodes stay in flight across an update
    # that the check below does not hang on one lucky schedule (it failed once with 5 and 0.05 s).
    assert [v for v, _, _ in seen] == list(range(1, 9)) and run.step == 8
    assert run.engine.version == 8
    for version, metrics, batch in seen:
        assert len(batch) == 4
        assert metrics["value/precomputed"] == 1.0  # the critic forward ran ahead, in the buffer
        assert math.isfinite(metrics["value/loss"])
        for t in batch:
            sampled = [v for v, m in zip(t.policy_version, t.loss_mask) if m]
            # Within the per-token bound: max_staleness bounds admission, and under the default stale
            # policy (mask) a trained token may lag `slack` versions more; older ones are masked.
            assert version - 1 - min(sampled) <= 2 + cfg.system.stale.slack
    mixed = [t for _, _, b in seen for t in b if len(versions(t)) > 1]
    assert mixed, "no trained trajectory continued across a weight update"
    ledger = summary["ledger"]
    assert ledger["trained"] == 8 * 4 and ledger["failed"] == 0
    assert ledger["started"] == sum(v for k, v in ledger.items() if k != "started")
    assert 0 <= summary["trainer_idle_frac"] <= 1 and summary["goodput_trajectories_per_s"] > 0
    assert summary["staleness_histogram"]

    # system.json holds the run's totals, and the decode batches of the local backend.
    saved = json.loads((tmp_path / "run" / "system.json").read_text())
    assert saved["ledger"]["trained"] == 8 * 4 and saved["backend"]["decode_batches"] > 0


@pytest.mark.slow
def test_group_sampling_and_curiosity_on_the_one_path(cache, tmp_path):
    from collections import Counter

    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    # The GRPO preset file: the SAO file's critic settings would be rejected (GRPO has no critic).
    small = [o for o in SMALL if not o.startswith(("algo.critic", "algo.normalize"))]
    cfg = load_config("configs/grpo.yaml", small + [
        f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}", "algo.group_size=4", "rollout.batch_size=8",
        "train.steps=1", "curiosity.enabled=true", "curiosity.scope=episode", "log.tensorboard=false"])
    run = build_run(cfg)
    assert run.critic is None and run.ref is not None  # GRPO: no critic, a KL reference
    batches = []
    history, _ = train(run, observer=lambda v, m, b: batches.append(b))
    [batch] = batches
    groups = Counter(t.group_id for t in batch)
    assert len(batch) == 8 and sorted(groups.values()) == [4, 4]
    for ids in groups:
        assert len({t.task_id for t in batch if t.group_id == ids}) == 1  # one prompt per group
    for t in batch:
        units = t.env_info.get("knowledge_units", [])
        assert t.reward_parts["curiosity"] == pytest.approx(t.env_info["curiosity/bonus"])
        assert t.reward == pytest.approx(t.reward_parts["outcome"] + t.reward_parts["curiosity"])
        assert (t.reward_parts["curiosity"] > 0) == bool(units)
    assert len(history) == 1 and "curiosity/novel_units" in history[0]
    # The reference log-probs were computed ahead of the step, in the buffer.
    assert history[0]["kl/ref_precomputed"] == 1.0
    assert math.isfinite(history[0]["kl/ref_kl_mean"])


@pytest.mark.slow
def test_a_synchronous_run_releases_the_engines_memory_while_the_trainer_steps(cache, tmp_path, monkeypatch):
    """rollout.options.release_memory (trainer and engine colocated): at staleness 0 the engine's
    weights are in host memory whenever the trainer steps, every sync is still verified, and the
    engine decodes again afterwards; asynchronous runs are refused, naming the option."""
    from tiderl.config import ConfigError
    from tiderl.recipe import train
    from tiderl.run import Trainer, build_run

    released_at_step = []
    train_batch = Trainer.train

    def spy(self, batch):
        released_at_step.append(self.run.engine._released)
        return train_batch(self, batch)

    monkeypatch.setattr(Trainer, "train", spy)
    release = ("system.max_staleness=0", "rollout.options.release_memory=true")
    run = build_run(small_config(cache, tmp_path / "run", *release))
    history, summary = train(run)
    assert released_at_step == [True] * run.cfg.train.steps
    assert summary["ledger"]["trained"] == run.cfg.train.steps * run.cfg.rollout.batch_size
    assert rollout(run, run.setup.eval_tasks[:2]) and not run.engine._released  # it decodes, back on its device
    with pytest.raises(ConfigError, match="rollout.options.release_memory.*synchronous training"):
        small_config(cache, tmp_path / "async", "system.max_staleness=2", "rollout.options.release_memory=true")
