"""The `agent` rollout backend: an agent written with any framework, `async def agent(base_url,
task) -> reward`, plays the run's tasks through the OpenAI API, and its recorded sessions train
through the rollout pool like built-in episodes (docs/serve.md, "Training an external agent").

Each attempt opens one session on an in-process server in front of the run's engine (sampling at
the run's `rollout.temperature`/`top_p`); its segments are the attempt's trajectories. An agent
that raises, returns no finite number, or sends no request has failed the attempt: the pool
retries the task, never trains a made-up reward.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tiderl.envs.protocol import Task
from tiderl.registry import load_object
from tiderl.serve.agent_options import AgentOptions
from tiderl.serve.server import BackgroundServer, ChatService, create_app
from tiderl.serve.session import SessionStore
from tiderl.types import Trajectory

if TYPE_CHECKING:
    from tiderl.run import Run

# An external agent: plays `task` through the OpenAI API at `base_url`, returns its reward.
Agent = Callable[[str, Task], Awaitable[float]]


def service_for_run(run: "Run", store: SessionStore | None = None) -> ChatService:
    """A `ChatService` in front of the run's engine with the run's sampling (`rollout.*`, always:
    what the agent asks for does not change the behaviour distribution) and budgets."""
    cfg = run.cfg
    return ChatService(run.engine, run.tokenizer, model_name="tiderl-policy",
                       max_new_tokens=cfg.rollout.max_new_tokens, max_total_tokens=cfg.env.max_total_tokens,
                       temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, override_sampling=True,
                       store=store, max_batch_size=cfg.rollout.engine_batch_size)


class AgentRollout:
    """The RolloutBackend whose episodes are an external agent's sessions (module docstring)."""

    def __init__(self, run: "Run", agent: Agent):
        self.run = run
        self.agent = agent
        self.store = SessionStore()
        self.service = service_for_run(run, self.store)
        self.server: BackgroundServer | None = None
        self.sessions = 0
        self.requests = 0
        self.cut_tokens = 0  # tokens sampled in sessions cancelled before the agent returned (waste)

    Options = AgentOptions  # system.options with system.backend=agent

    @classmethod
    def from_run(cls, run: "Run", preparations: list[Any], executor: Any = None) -> "AgentRollout":
        """The agent `system.options.agent` names (the engine decodes on the server's own thread, so
        the shared compute `executor` is not used)."""
        return cls(run, load_object(run.cfg.system.options.agent, "system.options.agent"))

    @property
    def version(self) -> int:
        return self.run.engine.version

    async def start(self) -> None:
        self.server = await asyncio.to_thread(BackgroundServer(create_app(self.service)).start)

    async def close(self) -> None:
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
            self.server = None

    async def run_episode(self, task: Task, group_id: str) -> list[Trajectory]:
        if self.server is None:
            raise RuntimeError("AgentRollout.start() was not called")
        session = self.store.create(task_id=task.task_id, group_id=group_id)
        self.sessions += 1
        try:
            reward = await self.agent(f"{self.server.url}/sessions/{session.session_id}/v1", task)
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise TypeError(f"the agent returned {reward!r}; it must return the reward as a finite number")
            self.store.finish(session.session_id, float(reward))
            self.requests += len(session.requests)
            return session.trajectories()
        except asyncio.CancelledError:  # the pool restarts it (new weights at staleness 0) or shuts down
            self.cut_tokens += sum(sum(segment.loss_mask) for segment in session.segments)
            raise
        finally:
            self.store.delete(session.session_id)  # its trajectories are the pool's now

    async def update_weights(self, weights: dict[str, Any], version: int) -> Any:
        return await self.service.update_weights(weights, version)

    def report(self) -> dict[str, Any]:
        """The backend's part of the run summary."""
        return {"sessions": self.sessions, "requests": self.requests}
