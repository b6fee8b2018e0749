"""`tiderl train` on a visual environment with a vision-language model directory (issue 31): the
run loads the model and its processor, episodes show images, the trainer (critic and reference
included) reads them, and the checkpoint reloads as a vision-language model.

The environment (`env.name=test_vlm_run:ColourEnv`) is this file's: the first message shows a
coloured square and asks for its colour, answered with the `answer` tool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tiderl.envs.protocol import Action, Observation, StepResult, Task
from tiderl.envs.setup import Setup

COLOURS = {"red": (255, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 255)}
ANSWER_TOOL = {"type": "function", "function": {
    "name": "answer", "description": "Give the colour.",
    "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}}}


class ColourEnv:
    """Shows a square of the task's colour; reward 1 when the `answer` tool names it; one turn."""

    shown = 0  # images shown, across instances

    @classmethod
    def setup(cls, cfg) -> Setup:
        tasks = [Task(f"c{i}", "What colour is the square?", colour) for i, colour in enumerate(list(COLOURS) * 8)]
        return Setup(train_tasks=tasks[:18], eval_tasks=tasks[18:], make_env=cls, name="colours")

    def system_prompt(self) -> str:
        return "Name the colour of the square with the answer tool."

    def tool_schemas(self) -> list[dict]:
        return [ANSWER_TOOL]

    def reset(self, task: Task) -> Observation:
        self.task = task
        ColourEnv.shown += 1
        return Observation(task.prompt, [Image.new("RGB", (40, 40), COLOURS[task.answer])])

    def step(self, action: Action) -> StepResult:
        right = any(str(call.arguments.get("colour", "")) == self.task.answer for call in action.tool_calls)
        # An untrained model never answers: a partial reward that varies with what it writes gives
        # the first steps a gradient.
        reward = 1.0 if right else (len(action.text) % 7) / 10
        return StepResult([], reward=reward, done=True, info={"success": float(right)})

    def finish(self, reason: str) -> StepResult:
        return StepResult([], reward=0.0, done=True, info={"success": 0.0})


def corpus() -> list[str]:
    env = ColourEnv()
    texts = [env.system_prompt(), json.dumps(env.tool_schemas()), "What colour is the square?", "Continue."]
    for colour in COLOURS:
        texts.append(f'<tool_call>\n{{"name": "answer", "arguments": {{"colour": "{colour}"}}}}\n</tool_call>')
    return texts * 5


@pytest.mark.slow  # trains through the CLI (about 20 s on 2 shared cores)
def test_tiderl_train_on_a_visual_environment_with_a_vlm_directory(tmp_path):
    from tiderl.cli import main
    from tiderl.models.loading import load_model, load_tokenizer
    from tiderl.models.tiny_vlm import build_tiny_vlm
    from tiderl.models.vision import ChatProcessor

    model, processor = build_tiny_vlm(corpus(), seed=0)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    assert isinstance(tokenizer, ChatProcessor) and tokenizer.pad_token_id == 0 and len(tokenizer) == len(
        processor.tokenizer)
    shown = ColourEnv.shown
    run_dir = tmp_path / "run"
    code = main(["train", "env.name=test_vlm_run:ColourEnv", "data.source=colours", f"model.path={model_dir}",
                 f"run_dir={run_dir}", "algo.name=ppo", "rollout.batch_size=6", "train.steps=2",
                 "env.max_turns=1", "env.max_total_tokens=300", "rollout.max_new_tokens=24",
                 "train.micro_batch_tokens=2048", "log.progress=false", "log.tensorboard=false"])
    assert code == 0
    assert ColourEnv.shown >= shown + 12  # the episodes showed their images
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    # The engine's behaviour log-probs (prefill with image features) are the trainer's: on step 1
    # nothing has trained yet, so every PPO ratio is 1.
    assert abs(steps[0]["policy/ratio_max"] - 1) < 1e-4 and abs(steps[0]["policy/ratio_min"] - 1) < 1e-4
    ledger = json.loads((run_dir / "system.json").read_text())["ledger"]
    assert ledger["failed"] == 0, ledger  # no episode failed (an image without a processor would)
    # The checkpoint is a vision-language model with its processor, and its vision tower trained.
    actor = Path(run_dir) / "checkpoints" / "final" / "actor"
    assert isinstance(load_tokenizer(actor), ChatProcessor)
    trained = load_model(actor)
    changed = [k for k, v in trained.state_dict().items()
               if k.startswith("model.vision_model.") and not torch.equal(v, model.state_dict()[k])]
    assert changed, "the vision tower did not train"
