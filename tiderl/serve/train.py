"""Training on recorded sessions, and training a run with an external agent.

A finished session gives `Trajectory` records in the layout `play_episode` produces (prompt and
observations forced, sampled turns with their behaviour log-probs and versions), so the run's
own trainer (`tiderl.run.Trainer`, i.e. `train/step.py:train_step` of the configured
algorithm) trains on them unchanged: `train_on_trajectories`.

`train_with_agent` runs an agent written with any framework, `async def agent(base_url, task)
-> reward`, against an in-process server in front of the run's engine: per step it opens one
session per attempt, lets the agent play it through the OpenAI API at `base_url`, ends the
session with the returned reward and trains one step on the sessions' trajectories, then syncs
the new weights to the engine. This is synchronous on-policy training (every trained token was
sampled by the weights the step trains, like `system.max_staleness=0`); it runs outside the
scheduler, so it has no staleness bound, elastic slots, checkpoints or metrics file.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from tiderl.envs.protocol import Task
from tiderl.metrics.summary import rollout_metrics
from tiderl.run import Run, Trainer, sync_weights
from tiderl.serve.server import BackgroundServer, ChatService, create_app
from tiderl.serve.session import SessionStore
from tiderl.types import Trajectory

logger = logging.getLogger(__name__)

# An external agent: plays `task` through the OpenAI API at `base_url`, returns its reward.
Agent = Callable[[str, Task], Awaitable[float]]


def train_on_trajectories(run: Run, trajectories: list[Trajectory]) -> dict[str, float]:
    """One optimizer step of the run's algorithm on `trajectories` (recorded sessions or any
    others), then the new weights go to the run's engine as version `run.step + 1`; returns the
    step's metrics (with the batch's rollout metrics)."""
    if not trajectories:
        raise ValueError("no trajectories to train on: end sessions with POST /sessions/<id>/reward first")
    metrics = dict(Trainer(run, []).step(trajectories, run.step))
    metrics.update(rollout_metrics(trajectories))
    run.step += 1
    sync_weights(run)
    return metrics


def service_for_run(run: Run, store: SessionStore | None = None) -> ChatService:
    """A `ChatService` in front of the run's engine with the run's sampling (`rollout.*`, always:
    what the agent asks for does not change the behaviour distribution) and budgets."""
    cfg = run.cfg
    return ChatService(run.engine, run.tokenizer, model_name="tiderl-policy",
                       max_new_tokens=cfg.rollout.max_new_tokens, max_total_tokens=cfg.env.max_total_tokens,
                       temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, override_sampling=True,
                       store=store, max_batch_size=cfg.rollout.engine_batch_size)


async def _play(base: str, agent: Agent, store: SessionStore, task: Task, attempt: int) -> None:
    """One attempt: a session for `task`, the agent at its base_url, the reward ends it (0 when
    the agent raises or returns something that is not a finite number, logged)."""
    session = store.create(task_id=task.task_id, group_id=task.task_id, meta={"attempt": attempt})
    info: dict[str, Any] = {}
    try:
        reward = await agent(f"{base}/sessions/{session.session_id}/v1", task)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise TypeError(f"the agent returned {reward!r}; it must return the reward as a finite number")
    except Exception as exc:  # noqa: BLE001 - one failed attempt must not end the step
        logger.warning("task %s: the agent raised %r; the session ends with reward 0", task.task_id, exc)
        reward, info = 0.0, {"error": repr(exc)}
    store.finish(session.session_id, float(reward), info)


def train_with_agent(run: Run, agent: Agent, steps: int, tasks_per_step: int | None = None,
                     on_step: Callable[[int, dict[str, float], list[Trajectory]], None] | None = None,
                     ) -> list[dict[str, float]]:
    """Train `run` for `steps` steps on sessions played by `agent` (see the module docstring).

    Per step: `tasks_per_step` tasks (default rollout.batch_size / algo.group_size) from the
    run's task stream, `algo.group_size` attempts each, all played concurrently; the step trains
    on every segment of every session (attempts that recorded no request add nothing).
    `on_step(step, metrics, batch)` sees each step. Returns each step's metrics.
    """
    cfg = run.cfg
    group = cfg.algo.group_size
    per_step = tasks_per_step or max(1, cfg.rollout.batch_size // group)
    store = SessionStore()
    history = []
    with BackgroundServer(create_app(service_for_run(run, store))) as server:
        for _ in range(steps):
            tasks = run.tasks.take(per_step)

            async def play_all(tasks: list[Task] = tasks) -> None:
                await asyncio.gather(*(_play(server.url, agent, store, t, k) for t in tasks for k in range(group)))

            asyncio.run(play_all())
            batch = [t for s in store.take_finished() for t in s.trajectories()]
            if not batch:
                raise RuntimeError("no attempt of this step sent a request: the agent must call the chat "
                                   "completions API at the base_url it is given")
            metrics = train_on_trajectories(run, batch)
            history.append(metrics)
            if on_step is not None:
                on_step(run.step, metrics, batch)
    return history
