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
from tiderl.envs.registration import WarmStart
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


def answer(colour: str) -> str:
    return f'<tool_call>\n{{"name": "answer", "arguments": {{"colour": "{colour}"}}}}\n</tool_call>'


def demonstrations(setup: Setup, cfg, rng):
    """The embedded model's warm start: each training task answered right (its colour)."""
    tasks = rng.sample(setup.train_tasks, min(cfg.model.warmstart.num_traces, len(setup.train_tasks)))
    return tasks, [[answer(t.answer)] for t in tasks], {}


ColourEnv.warm_start = WarmStart(demonstrations)


def corpus() -> list[str]:
    env = ColourEnv()
    texts = [env.system_prompt(), json.dumps(env.tool_schemas()), "What colour is the square?", "Continue."]
    texts += [answer(colour) for colour in COLOURS]
    return texts * 5


@pytest.mark.slow  # trains through the CLI (about 20 s on 2 shared cores)
def test_tiderl_train_on_a_visual_environment_with_a_vlm_directory(tmp_path):
    from tiderl.cli import main
    from tiderl.embedded.tiny_vlm import build_tiny_vlm
    from tiderl.models.loading import load_model, load_tokenizer
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
    # ... and `tiderl eval` evaluates it.
    results = tmp_path / "eval.json"
    assert main(["eval", "--model", str(actor), "--json", str(results), "env.name=test_vlm_run:ColourEnv",
                 "data.source=colours", "env.max_turns=1", "env.max_total_tokens=300", "rollout.max_new_tokens=24",
                 "log.progress=false"]) == 0
    greedy = json.loads(results.read_text())["greedy"]
    assert greedy["n"] == 6 and greedy["by_stop_reason"].get("error") is None


@pytest.mark.slow  # warm-starts the embedded model and trains through the CLI (about 30 s on 2 shared cores)
def test_the_embedded_model_of_a_visual_environment_is_the_tiny_vlm_warm_started_on_its_images(tmp_path):
    from tiderl.agent.loop import play_episodes
    from tiderl.cli import main
    from tiderl.config import load_config
    from tiderl.embedded.build import ensure_embedded_model
    from tiderl.envs.setup import load_setup
    from tiderl.models.loading import load_model, load_tokenizer
    from tiderl.models.vision import ChatProcessor
    from tiderl.rollout.base import SamplingParams
    from tiderl.rollout.torch_engine import TorchEngine

    small = ["env.name=test_vlm_run:ColourEnv", "data.source=colours", f"model.cache_dir={tmp_path / 'cache'}",
             "model.tiny.vocab_size=400", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
             "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2", "model.tiny.max_positions=300",
             "model.warmstart.num_traces=18", "model.warmstart.steps=80", "model.warmstart.batch_size=6",
             "env.max_turns=1", "env.max_total_tokens=300", "rollout.max_new_tokens=40"]
    cfg = load_config(None, small)
    path = ensure_embedded_model(cfg, load_setup(cfg), log=lambda _: None)
    tokenizer, model = load_tokenizer(path), load_model(path)
    assert isinstance(tokenizer, ChatProcessor) and hasattr(model, "get_image_features")
    report = json.loads((path / "tiderl_build.json").read_text())
    assert report["sft_loss_last"] < 0.2 * report["sft_loss_first"]
    # Warm-started on the images: greedy, it names the colour it is shown (the question is the same).
    tasks = [Task(c, "What colour is the square?", c) for c in COLOURS]
    out = play_episodes(TorchEngine(model, tokenizer), tokenizer, ColourEnv, tasks,
                        SamplingParams(temperature=0.0, max_new_tokens=40), max_turns=1, max_total_tokens=300)
    assert [t.env_info["success"] for t in out] == [1.0, 1.0, 1.0]
    # model.path=tiny trains it (the cached build is reused).
    run_dir = tmp_path / "run"
    code = main(["train", *small, "model.path=tiny", f"run_dir={run_dir}", "algo.name=ppo", "rollout.batch_size=6",
                 "train.steps=1", "train.micro_batch_tokens=2048", "log.progress=false", "log.tensorboard=false"])
    assert code == 0
    assert json.loads((run_dir / "system.json").read_text())["ledger"]["failed"] == 0


# Each tiny architecture's builder (module, function) and the parameter-name part of its vision tower.
ARCHITECTURES = {"idefics3": ("tiderl.embedded.tiny_vlm", "build_tiny_vlm", "vision_model."),
                 "qwen2_vl": ("tiderl.embedded.tiny_qwen2vl", "build_tiny_qwen2vl", "visual."),
                 "qwen2_5_vl": ("tiderl.embedded.tiny_qwen2vl", "build_tiny_qwen2vl", "visual.")}


def _vlm_dir(tmp_path, architecture: str = "idefics3") -> Path:
    """A folder holding `architecture`'s tiny model (built on this file's corpus) and its processor."""
    import importlib

    module, builder, _ = ARCHITECTURES[architecture]
    size = {"architecture": architecture} if architecture.startswith("qwen") else {}
    model, processor = getattr(importlib.import_module(module), builder)(corpus(), seed=0, **size)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    return model_dir


def main_train(args: list[str]) -> int:
    """`tiderl train` with `args`; its exit code."""
    from tiderl.cli import main

    return main(["train", *args])


def _vlm_args(model_dir, run_dir, *more) -> list[str]:
    """SAO (a critic that reads the images too) on ColourEnv, 6 episodes a step."""
    return ["env.name=test_vlm_run:ColourEnv", "data.source=colours", f"model.path={model_dir}", f"run_dir={run_dir}",
            "algo.name=sao", "algo.critic_warmup_steps=1", "rollout.batch_size=6", "env.max_turns=1",
            "env.max_total_tokens=300", "rollout.max_new_tokens=24", "train.micro_batch_tokens=2048",
            "log.progress=false", "log.tensorboard=false", "system.trainer_threads=1", "system.decode_threads=1",
            *more]


def _rows(run_dir) -> list[dict]:
    """metrics.jsonl's rows without the timings (which differ between runs)."""
    from support import TIMED

    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMED)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two short runs and a resumed one (about 20 s on 2 shared cores)
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_a_vlm_run_resumes_exactly_at_staleness_0(tmp_path, architecture):
    """Resumed from step 1's checkpoint, steps 2-3 and the final weights equal the uninterrupted
    run's bit for bit (the episodes' images are redrawn from the tasks, so the resumed run must see
    the same ones)."""
    from support import train_then_resume

    model_dir = _vlm_dir(tmp_path, architecture)
    a, b = train_then_resume(lambda run_dir, *more: _vlm_args(model_dir, run_dir, *more), tmp_path)
    assert [r["step"] for r in _rows(tmp_path / "b")] == [1, 2, 3]
    assert _rows(tmp_path / "a") == _rows(tmp_path / "b")
    assert any(r.get("policy/loss") for r in _rows(tmp_path / "a")[1:])  # the actor trained in the compared steps
    for k, v in a.actor.model.state_dict().items():
        assert torch.equal(v, b.actor.model.state_dict()[k]), k
    for k, v in a.critic.model.state_dict().items():
        assert torch.equal(v, b.critic.model.state_dict()[k]), k


@pytest.mark.slow  # two short runs of the tiny VLM (about 20 s on 2 shared cores)
def test_a_vlm_run_keeps_buffered_images_across_a_checkpoint_at_staleness_1(tmp_path):
    """Staleness 1 with a slow environment: a checkpoint holds finished episodes not yet trained,
    their images pickled with them, and the resumed run trains every task once."""
    model_dir = _vlm_dir(tmp_path)
    # Episodes take 0.3 s (the tool latency), so some finish before the step that trains them.
    slow = ["system.max_staleness=1", "env.tool_latency=fixed", "env.tool_latency_s=0.3", "train.checkpoint_every=1"]
    run_dir = tmp_path / "async"
    assert main_train(_vlm_args(model_dir, run_dir, "train.steps=2", *slow)) == 0
    held = [torch.load(c / "trainer_state.pt", weights_only=False)["scheduler"]["buffered"]
            for c in sorted((run_dir / "checkpoints").glob("step_*"))]
    buffered = [t for state in held for t in state]
    assert buffered, "no checkpoint held a finished, untrained episode: the test shows nothing"
    colour_of = {t.task_id: t.answer for t in ColourEnv.setup(None).train_tasks}
    for trajectory in buffered:
        assert len(trajectory.images) == 1
        assert trajectory.images[0].getpixel((0, 0)) == COLOURS[colour_of[trajectory.task_id]]
    assert main_train(_vlm_args(model_dir, run_dir, "train.steps=4", "train.resume=auto", *slow)) == 0
    ledger = json.loads((run_dir / "system.json").read_text())["ledger"]
    assert ledger["trained"] == 4 * 6 and ledger["failed"] == 0, ledger


@pytest.mark.slow  # a local Ray cluster, 2 trainer ranks and a critic actor (about 60 s on 2 shared cores)
def test_a_vlm_trains_on_ray_with_data_parallel_ranks_and_a_remote_critic(tmp_path):
    """system.backend=ray with train.parallel=fsdp2 on 2 ranks: the rollout workers, the trainer
    ranks and the critic actor each get the processor's image part, so a batch of episodes with
    images trains (without it every step raised in `collate`), the sharded policy embeds its images
    inside its forward (before that FSDP2 was refused with a VLM), and the ranks' weights reach the
    workers. DDP with a VLM is checked against one process in tests/test_parallel_vlm.py."""
    ray = pytest.importorskip("ray")
    from support import local_ray_cluster
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    model_dir = _vlm_dir(tmp_path)
    cluster = local_ray_cluster(__name__)
    next(cluster)
    try:
        run = build_run(load_config(None, _vlm_args(model_dir, tmp_path / "run", "train.steps=2", "system.backend=ray",
                                                    "train.parallel=fsdp2", "train.world_size=2",
                                                    "system.wait_timeout_s=300")))
        before = {k: v.clone() for k, v in run.actor.model.state_dict().items()}
        history, summary = train(run)
        assert [h["policy_version"] for h in history] == [1, 2]
        ledger = summary["ledger"]
        assert ledger["trained"] == 2 * 6 and ledger["failed"] == 0, ledger
        assert history[-1].get("value/loss") is not None  # the critic (values from the critic actor) trained
        stats = summary["backend"]["worker_stats"]
        assert stats and {s["version"] for s in stats} == {2}  # the workers hold the ranks' step-2 weights
        after = run.actor.model.state_dict()
        # The driver's copy got the ranks' weights, its vision tower trained.
        assert any(not torch.equal(after[k], v) for k, v in before.items() if k.startswith("model.vision_model."))
    finally:
        next(cluster, None)
        assert not ray.is_initialized()


@pytest.mark.parametrize("architecture, options", [  # (about 3 s to 10 s each on 2 shared cores)
    pytest.param("idefics3", ["model.lora.r=4", "model.critic_lora=lora"], marks=pytest.mark.slow),
    pytest.param("idefics3", ["train.autocast=bfloat16"], marks=pytest.mark.slow),
    pytest.param("idefics3", ["train.activation_checkpointing=true"], marks=pytest.mark.slow),
    ("qwen2_vl", ["model.lora.r=4", "model.critic_lora=lora", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,qkv]"]),
    ("qwen2_vl", ["train.autocast=bfloat16", "train.activation_checkpointing=true"]),
    ("qwen2_5_vl", ["model.lora.r=4", "model.critic_lora=lora", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,qkv]",
                    "train.autocast=bfloat16", "train.activation_checkpointing=true"])])
def test_a_vlm_trains_with_lora_bf16_autocast_and_activation_checkpointing(tmp_path, architecture, options):
    """Each trainer option with a vision-language model: the run trains every episode; with LoRA
    (policy and critic) the base stays as it was and adapters train, the vision tower's too (on
    Idefics3 the default target modules match its attention projections; Qwen2-VL's vision attention
    is `qkv`, which has to be named); otherwise the vision tower trains."""
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    model_dir = _vlm_dir(tmp_path, architecture)
    run = build_run(load_config(None, _vlm_args(model_dir, tmp_path / "run", "train.steps=2", *options)))
    before = {k: v.clone() for k, v in run.actor.model.state_dict().items()}
    history, summary = train(run)
    assert summary["ledger"]["trained"] == 2 * 6 and summary["ledger"]["failed"] == 0, summary["ledger"]
    assert history[-1]["policy/loss"] != 0  # the actor trained at step 2
    after = run.actor.model.state_dict()
    changed = {k for k, v in before.items() if not torch.equal(v, after[k])}
    assert any(ARCHITECTURES[architecture][2] in k for k in changed), sorted(changed)[:5]  # the vision tower
    if "model.lora.r=4" in options:
        assert changed and all(".lora_" in k for k in changed), sorted(changed)[:5]


@pytest.mark.slow  # collects 60 episodes and fits a critic twice (about 60 s on 2 shared cores)
def test_pretrain_value_on_episodes_with_images_reads_the_images(tmp_path):
    """`tiderl pretrain-value` with a VLM: the episodes it saves keep their images (PNG data URLs,
    read back pixel for pixel), and a critic fitted to rewards that only the image can tell (the
    prompt is the same for every colour: 1 for red, 0 otherwise) explains part of them on held-out
    episodes."""
    from tiderl.cli import main
    from tiderl.train.value_pretrain import load_trajectories, save_trajectories

    model_dir = _vlm_dir(tmp_path)
    args = _vlm_args(model_dir, tmp_path / "run", "algo.critic_lr=3e-3", "algo.freeze_critic_attention=false",
                     "rollout.batch_size=20")  # episodes collected, and fitted, 20 at a time
    out = tmp_path / "critic"
    assert main(["pretrain-value", "--episodes", "60", "--epochs", "1", "--out", str(out), *args]) == 0
    data = load_trajectories(out / "trajectories.jsonl")
    colour_of = {t.task_id: t.answer for t in ColourEnv.setup(None).train_tasks}
    assert len(data) == 60
    for t in data:
        assert len(t.images) == 1 and t.images[0].getpixel((5, 5)) == COLOURS[colour_of[t.task_id]]
        t.reward = float(colour_of[t.task_id] == "red")
    save_trajectories(data, tmp_path / "labelled.jsonl")
    assert main(["pretrain-value", "--trajectories", str(tmp_path / "labelled.jsonl"), "--epochs", "10",
                 "--out", str(out), *args]) == 0
    report = json.loads((out / "pretrain_report.json").read_text())
    assert report["after"]["mse"] < report["before"]["mse"]
    assert report["after"]["explained_variance"] > 0.3, report


@pytest.mark.slow  # (about 10 s locally, 25 s with the Ray cluster's start, on 2 shared cores)
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_vlm_trains_through_a_launched_http_server(tmp_path, backend):
    """rollout.engine=http with a vision-language model: a launched tiderl engine server samples
    the episodes with images (`/inference/v1/generate`; tests/test_http_images.py checks the
    route); on Ray the rollout workers send to the driver's server. Every episode trains, the
    ratios against the server's log-probs are 1, no server was lost."""
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    cluster = None
    if backend == "ray":
        pytest.importorskip("ray")
        from support import local_ray_cluster

        cluster = local_ray_cluster(__name__)
        next(cluster)
    try:
        run = build_run(load_config(None, _vlm_args(_vlm_dir(tmp_path), tmp_path / "run", "train.steps=2",
                                                    "algo.critic_warmup_steps=0", "rollout.engine=http",
                                                    "rollout.options.launch=1", f"system.backend={backend}",
                                                    "system.wait_timeout_s=300")))
        shown = ColourEnv.shown
        history, summary = train(run)
        events = list(run.engine.events)
    finally:
        if cluster is not None:
            next(cluster, None)
    assert summary["ledger"]["trained"] == 2 * 6 and summary["ledger"]["failed"] == 0, summary["ledger"]
    assert backend == "ray" or ColourEnv.shown - shown >= 12  # (on Ray the workers' own processes count theirs)
    assert all(abs(h["dis/ratio_max"] - 1) < 1e-4 and abs(h["dis/ratio_min"] - 1) < 1e-4 for h in history), history
    assert [e["event"] for e in events] == ["launched"], events


@pytest.mark.slow  # (about 15 s on 2 shared cores)
def test_the_vlm_recipe_trains_a_qwen2_5_vl_folder_on_the_visual_grid(tmp_path):
    """configs/qwen2.5-vl_visual_sao.yaml as a user runs it, with a tiny Qwen2.5-VL folder in place of
    the real checkpoint (none is in the registries): two SAO steps with LoRA on policy and critic,
    every episode trained, the first update's ratios 1, the base left as loaded."""
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    model_dir = _vlm_dir(tmp_path, "qwen2_5_vl")
    run = build_run(load_config("configs/qwen2.5-vl_visual_sao.yaml", [
        f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}", "train.steps=3", "algo.critic_warmup_steps=1",
        "rollout.batch_size=4", "rollout.max_new_tokens=16", "env.max_turns=2", "eval.every=0",
        "log.progress=false", "log.tensorboard=false", "train.checkpoint_every=0"]))
    base = {k: v.clone() for k, v in run.actor.model.state_dict().items() if "lora_" not in k}
    history, summary = train(run)
    assert summary["ledger"]["trained"] == 3 * 4 and summary["ledger"]["failed"] == 0, summary["ledger"]
    assert abs(history[1]["dis/ratio_max"] - 1) < 1e-4 and abs(history[1]["dis/ratio_min"] - 1) < 1e-4
    after = run.actor.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # LoRA: the base is frozen
    assert any("visual" in k for k in after if "lora_" in k)  # the vision tower's MLP has adapters
