"""play_episodes bounds the episodes under way (max_in_flight), starting tasks in order."""

from __future__ import annotations

import threading

import pytest

from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.config import RolloutConfig
from tiderl.embedded.tiny import train_tokenizer
from tiderl.envs.protocol import Action, StepResult, Task
from tiderl.rollout.base import sampling_params

TOKENIZER = train_tokenizer(["Say done.", "task", "not yet", "done", "wait"] * 4, vocab_size=300)


class Counted:
    """An env that answers "not yet" until "done", counting the episodes under way."""

    lock = threading.Lock()
    active = 0
    most = 0
    started: list[str] = []

    def system_prompt(self) -> str:
        return "Say done."

    def tool_schemas(self) -> list:
        return []

    def reset(self, task: Task) -> str:
        with Counted.lock:
            Counted.active += 1
            Counted.most = max(Counted.most, Counted.active)
            Counted.started.append(task.task_id)
        return task.prompt

    def _end(self, success: int) -> StepResult:
        with Counted.lock:
            Counted.active -= 1
        return StepResult([], reward=float(success), done=True, info={"success": success})

    def step(self, action: Action) -> StepResult:
        return self._end(1) if "done" in action.text else StepResult(["not yet"])

    def finish(self, reason: str) -> StepResult:
        return self._end(0)


def play(n: int, **kwargs):
    Counted.active, Counted.most, Counted.started = 0, 0, []
    tasks = [Task(f"t{i}", f"task {i}", "") for i in range(n)]
    engine = ScriptedEngine(TOKENIZER, {t.prompt: ["wait", "wait", "done"] for t in tasks})
    params = sampling_params(RolloutConfig(), TOKENIZER.eos_token_id, greedy=True)
    return play_episodes(engine, TOKENIZER, Counted, tasks, params, 4, 400, **kwargs)


@pytest.mark.parametrize("kwargs, most", [
    ({"max_in_flight": 2}, 2),
    ({"max_batch_size": 3}, 6),  # the default: twice the engine's batch
    ({"max_in_flight": 0}, 9),  # all at once
])
def test_episodes_under_way_are_bounded(kwargs, most):
    trajectories = play(9, **kwargs)
    assert [t.task_id for t in trajectories] == [f"t{i}" for i in range(9)]
    assert all(t.reward == 1.0 and t.num_turns == 3 for t in trajectories)
    assert Counted.most == most and Counted.active == 0
    assert Counted.started == [f"t{i}" for i in range(9)]  # in task order
