"""A user's own environment, written outside tiderl: the test of the one-file extension point
(tests/test_extending.py) trains on it through `tiderl train` with `env.name=user_env:ParityEnv`.

The task: say whether a number is even or odd by calling the `answer` tool. Reward 1 for the
right word, 0 otherwise.
"""

from __future__ import annotations

import json

from tiderl.envs.protocol import Action, StepResult, Task
from tiderl.envs.setup import Setup

ANSWER_TOOL = {"type": "function", "function": {
    "name": "answer", "description": "Give the final answer.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}


class ParityEnv:
    """One episode at a time: reset with a number, step until the agent answers."""

    steps_taken = 0  # across all instances: the test checks that training really stepped here

    @classmethod
    def setup(cls, cfg) -> Setup:
        tasks = [Task(f"n{i}", f"Is {i} even or odd?", "even" if i % 2 == 0 else "odd") for i in range(60)]
        return Setup(train_tasks=tasks[:40], eval_tasks=tasks[40:], make_env=cls, name="parity")

    def system_prompt(self) -> str:
        return "Answer with the answer tool: even or odd."

    def tool_schemas(self) -> list[dict]:
        return [ANSWER_TOOL]

    def reset(self, task: Task) -> str:
        self.task = task
        return task.prompt

    def step(self, action: Action) -> StepResult:
        ParityEnv.steps_taken += 1
        for call in action.tool_calls:
            if call.name == "answer":
                success = float(str(call.arguments.get("word", "")).strip() == self.task.answer)
                return StepResult([], reward=success, done=True, info={"success": success})
            return StepResult([f"Error: unknown tool {json.dumps(call.name)}"])
        if action.parse_errors:
            return StepResult([f"Error: {action.parse_errors[0]}"])
        return StepResult([])

    def finish(self, reason: str) -> StepResult:
        return StepResult([], reward=0.0, done=True, info={"success": 0.0})


def corpus() -> list[str]:
    """Texts to train a tiny tokenizer on (what this environment's episodes contain)."""
    env = ParityEnv()
    texts = [env.system_prompt(), json.dumps(env.tool_schemas()), "Continue."]
    for i in range(60):
        texts.append(f"Is {i} even or odd?")
        for word in ("even", "odd"):
            texts.append(f'<tool_call>\n{{"name": "answer", "arguments": {{"word": "{word}"}}}}\n</tool_call>')
    return texts


from tiderl.rollout.torch_engine import TorchEngine  # noqa: E402


class CountingEngine(TorchEngine):
    """A user's own engine (`rollout.engine: user_env:CountingEngine`): the embedded torch engine
    that counts the prompts it decodes. Any class with the Engine protocol's methods works."""

    prompts = 0

    def generate(self, prompts, params):
        CountingEngine.prompts += len(prompts)
        return super().generate(prompts, params)
