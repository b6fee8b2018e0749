"""tiderl on a CUDA device (issue 30): the torch engine and the trainer on one GPU, with the
options a GPU user turns on. Skipped without a CUDA device, so CI (CPU only) never runs them;
`make test-gpu` runs them where one is.

Each test prints what it measured (run with `-s` to see it): the largest |behaviour - trainer|
log-prob over sampled tokens, which on CPU is below 1e-5 because the engine and the trainer run
the same fp32 code; on a GPU the decode step and the trainer's forward use different kernels.
"""

from __future__ import annotations

import json

import pytest
import torch

from support import TIMED, parity_model_dir, rollout, train_then_resume, worst_behaviour_gap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason=f"no CUDA device (torch {torch.__version__}): the GPU tests need one")]

# fp32 on a GPU: the engine's cached decode and the trainer's full forward sum in different orders
# (and cuBLAS may pick other kernels for other shapes); far below any ratio band (SAO's is 0.2).
FP32_GAP = 1e-3


@pytest.fixture(scope="module")
def parity_model(tmp_path_factory):
    return parity_model_dir(tmp_path_factory.mktemp("parity"))


def _args(model, run_dir, *more) -> list[str]:
    """A tiny synchronous SAO run on the parity environment, on cuda, 8 trajectories a step."""
    return ["env.name=resume_env:LengthReward", "data.source=parity", f"model.path={model}", f"run_dir={run_dir}",
            "model.device=cuda", "algo.name=sao", "algo.critic_warmup_steps=1", "algo.actor_lr=1e-3",
            "algo.critic_lr=1e-3", "rollout.batch_size=8", "env.max_turns=2", "env.max_total_tokens=200",
            "rollout.max_new_tokens=24", "train.micro_batch_tokens=2048", "log.progress=false",
            "log.tensorboard=false", "system.trainer_threads=1", "system.decode_threads=1", *more]


def _rows(run_dir) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMED)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _behaviour_gap(run, n: int = 8) -> tuple[float, int]:
    """Sample `n` episodes with the run's engine, recompute their log-probs with the run's actor."""
    from tiderl.train.batching import collate
    from tiderl.train.forward import token_logprobs

    trajectories = rollout(run, run.setup.train_tasks[:n])
    images = getattr(run.tokenizer, "image_processor", None)
    batch = collate(trajectories, run.tokenizer.pad_token_id or 0, images).to(run.cfg.model.device)
    with torch.no_grad():
        lp, _ = token_logprobs(run.actor.model, batch.input_ids, batch.attention_mask, pixels=batch.pixels)
    return worst_behaviour_gap(trajectories, lp.float().cpu())


def test_sao_trains_on_cuda_and_the_engine_samples_with_the_trainers_log_probs(parity_model, tmp_path):
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    run = build_run(load_config(None, _args(parity_model, tmp_path / "run", "train.steps=3")))
    assert next(run.actor.model.parameters()).is_cuda and next(run.critic.model.parameters()).is_cuda
    worst, sampled = _behaviour_gap(run)
    print(f"\n[cuda fp32, before training] max |engine - trainer| log-prob = {worst:.2e} over {sampled} tokens")
    assert sampled > 20 and worst < FP32_GAP
    before = {k: v.clone() for k, v in run.actor.model.state_dict().items()}
    history, summary = train(run)
    assert summary["ledger"]["trained"] == 3 * 8 and summary["ledger"]["failed"] == 0, summary["ledger"]
    assert all(torch.isfinite(torch.tensor(h["value/loss"])) for h in history if "value/loss" in h)
    assert history[-1]["policy/loss"] != 0
    assert any(not torch.equal(v, run.actor.model.state_dict()[k]) for k, v in before.items())
    worst, sampled = _behaviour_gap(run)  # the engine holds the trained weights
    print(f"[cuda fp32, after 3 steps] max |engine - trainer| log-prob = {worst:.2e} over {sampled} tokens")
    assert worst < FP32_GAP


def test_a_cuda_run_resumes_from_its_checkpoint(parity_model, tmp_path):
    """Resumed from step 1's checkpoint (weights, optimizers, RNG streams on the GPU too), the
    run's steps 2-3 repeat the uninterrupted run's. CUDA kernels may sum in another order from
    run to run, so this reports how far apart they are and asserts closeness, not bit equality."""
    a, b = train_then_resume(lambda run_dir, *more: _args(parity_model, run_dir, *more), tmp_path)
    assert next(b.actor.model.parameters()).is_cuda
    ra, rb = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["step"] for r in rb] == [1, 2, 3]
    same_metrics = ra == rb
    worst = max(float((v - b.actor.model.state_dict()[k]).abs().max()) for k, v in a.actor.model.state_dict().items())
    print(f"\n[cuda resume] metrics equal: {same_metrics}; max |weight difference| = {worst:.2e}")
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for key, value in x.items():
            if isinstance(value, float):
                assert y[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (x["step"], key)
    assert worst < 1e-4


@pytest.mark.parametrize("options", [
    ["train.autocast=bfloat16"],
    ["model.lora.r=4", "model.critic_lora=lora"],
    ["train.autocast=bfloat16", "train.activation_checkpointing=true", "model.lora.r=4"],
])
def test_trainer_options_on_cuda(parity_model, tmp_path, options):
    """bf16 autocast over fp32 master weights, LoRA (policy and critic) and activation
    checkpointing on a GPU: every episode trains and the engine follows the trainer."""
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    run = build_run(load_config(None, _args(parity_model, tmp_path / "run", "train.steps=2", *options)))
    before = {k: v.clone() for k, v in run.actor.model.state_dict().items()}
    history, summary = train(run)
    assert summary["ledger"]["trained"] == 2 * 8 and summary["ledger"]["failed"] == 0, summary["ledger"]
    assert history[-1]["policy/loss"] != 0
    after = run.actor.model.state_dict()
    assert all(v.dtype == torch.float32 for v in after.values() if v.is_floating_point())  # fp32 master weights
    changed = {k for k, v in before.items() if not torch.equal(v, after[k])}
    assert changed
    if "model.lora.r=4" in options:
        assert all(".lora_" in k for k in changed), sorted(changed)[:5]
    worst, sampled = _behaviour_gap(run)
    print(f"\n[cuda {' '.join(options)}] max |engine - trainer| log-prob after 2 steps = {worst:.2e} "
          f"over {sampled} tokens")
    assert worst < FP32_GAP  # the engine decodes in fp32 whatever the trainer's autocast


def fsdp2_rank(rank: int, world_size: int, out_path: str) -> None:
    """One NCCL rank: one train_step of the parallel cases under DDP and FSDP2 on cuda."""
    from support import CLIP, build, nine_trajectories, parallel_cases, snapshot
    from tiderl.train.parallel import ParallelLearner
    from tiderl.train.step import train_step

    results = {}
    for mode in ("ddp", "fsdp2"):
        for case, (cfg, micro_tokens) in parallel_cases().items():
            actor, critic, ref = build(cfg, lambda m, lr: ParallelLearner(m.cuda(), mode, lr=lr, grad_clip=CLIP,
                                                                          device="cuda"))
            metrics = train_step(nine_trajectories(), actor, critic, ref.cuda() if ref is not None else None, cfg,
                                 pad_id=0, micro_batch_tokens=micro_tokens, train_actor=True, device="cuda")
            results[(mode, case)] = {"metrics": metrics, "actor": {k: v.cpu() for k, v in snapshot(actor).items()}}
    if rank == 0:
        torch.save(results, out_path)


def test_ddp_and_fsdp2_on_an_nccl_rank_equal_one_cpu_process(tmp_path):
    """`tiderl.train.parallel` with the NCCL backend on a GPU: one rank's DDP and FSDP2 step (one
    GPU here; the gradients pass through NCCL's all-reduce / reduce-scatter) equals the
    single-process CPU step up to float rounding."""
    from support import CLIP, build, nine_trajectories, parallel_cases, snapshot
    from tiderl.lab.ranks import spawn_ranks
    from tiderl.train.learner import Learner
    from tiderl.train.step import train_step

    path = tmp_path / "rank0.pt"
    spawn_ranks(fsdp2_rank, 1, str(path), timeout_s=240, device="cuda")
    got = torch.load(path, weights_only=False)
    for case, (cfg, micro_tokens) in parallel_cases().items():
        actor, critic, ref = build(cfg, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
        train_step(nine_trajectories(), actor, critic, ref, cfg, pad_id=0, micro_batch_tokens=micro_tokens,
                   train_actor=True)
        single = snapshot(actor)
        for mode in ("ddp", "fsdp2"):
            gpu = got[(mode, case)]["actor"]
            assert gpu.keys() == single.keys()
            worst = max(float((gpu[k].float().cpu() - v.float()).abs().max()) for k, v in single.items())
            print(f"\n[nccl {mode} {case}] max |gpu rank - cpu process| over params and grads = {worst:.2e}")
            assert worst < 1e-4, (mode, case, worst)


ANSWER_TOOL = {"type": "function", "function": {
    "name": "answer", "description": "Give the colour.",
    "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}}}


class SquareEnv:
    """One turn: a red or blue square; reward 1 when the `answer` tool names its colour, else a
    partial reward that varies with what the model wrote (an untrained model never answers)."""

    @classmethod
    def setup(cls, cfg):
        from tiderl.envs.protocol import Task
        from tiderl.envs.setup import Setup

        tasks = [Task(f"s{i}", "What colour is the square?", ("red", "blue")[i % 2]) for i in range(16)]
        return Setup(train_tasks=tasks[:12], eval_tasks=tasks[12:], make_env=cls, name="squares")

    def system_prompt(self) -> str:
        return "Name the colour of the square with the answer tool."

    def tool_schemas(self) -> list[dict]:
        return [ANSWER_TOOL]

    def reset(self, task):
        from PIL import Image

        from tiderl.envs.protocol import Observation

        self.task = task
        return Observation(task.prompt, [Image.new("RGB", (40, 40), {"red": (255, 0, 0), "blue": (0, 0, 255)}[
            task.answer])])

    def step(self, action):
        from tiderl.envs.protocol import StepResult

        right = any(str(call.arguments.get("colour", "")) == self.task.answer for call in action.tool_calls)
        return StepResult([], reward=1.0 if right else (len(action.text) % 7) / 10, done=True,
                          info={"success": float(right)})

    def finish(self, reason: str):
        from tiderl.envs.protocol import StepResult

        return StepResult([], reward=0.0, done=True, info={"success": 0.0})


def test_a_tiny_vlm_trains_on_cuda_with_images(tmp_path):
    """A vision-language model (tiny Idefics3) on cuda: the engine's prefill with image features
    scores as the trainer does, and SAO trains the vision tower on the GPU."""
    from tiderl.config import load_config
    from tiderl.embedded.tiny_vlm import build_tiny_vlm
    from tiderl.recipe import train
    from tiderl.run import build_run

    texts = ["What colour is the square?", "Name the colour of the square with the answer tool.",
             '<tool_call>\n{"name": "answer", "arguments": {"colour": "red"}}\n</tool_call>'] * 5
    model, processor = build_tiny_vlm(texts, seed=0)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    run = build_run(load_config(None, [
        "env.name=test_gpu:SquareEnv", "data.source=squares", f"model.path={model_dir}",
        f"run_dir={tmp_path / 'run'}", "model.device=cuda", "algo.name=sao", "algo.critic_warmup_steps=0",
        "rollout.batch_size=6", "env.max_turns=1", "env.max_total_tokens=300", "rollout.max_new_tokens=24",
        "train.micro_batch_tokens=2048", "train.steps=2", "log.progress=false", "log.tensorboard=false"]))
    worst, sampled = _behaviour_gap(run, 6)
    print(f"\n[cuda tiny Idefics3] max |engine - trainer| log-prob = {worst:.2e} over {sampled} tokens")
    assert sampled > 20 and worst < FP32_GAP
    before = {k: v.clone() for k, v in run.actor.model.state_dict().items()}
    history, summary = train(run)
    assert summary["ledger"]["trained"] == 2 * 6 and summary["ledger"]["failed"] == 0, summary["ledger"]
    after = run.actor.model.state_dict()
    assert any(not torch.equal(v, after[k]) for k, v in before.items() if "vision_model." in k)


@pytest.mark.parametrize("server_dtype", ["float32", "bfloat16"])
def test_a_launched_engine_server_computes_on_the_gpu(parity_model, tmp_path, server_dtype):
    """rollout.engine=http with a launched tiderl engine server on a cuda run: the server computes
    on the GPU (the run's model.device), in fp32 or bf16 against the fp32 trainer. Step 1's PPO
    ratios (nothing trained yet) are the engine/trainer mismatch: near 1 in fp32, spread in bf16."""
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    run = build_run(load_config(None, _args(
        parity_model, tmp_path / "run", "train.steps=2", "algo.name=ppo", "algo.critic_warmup_steps=0", "rollout.engine=http",
        "rollout.options.launch=1", "rollout.options.server=tiderl", f"rollout.options.server_dtype={server_dtype}",
        "rollout.options.probe_tolerance=0.5")))
    try:
        log = (tmp_path / "run" / "servers" / "server-0.log").read_text()
        assert "--device cuda" in log, log[-2000:]
        history, summary = train(run)
    finally:
        run.engine.close()
    assert summary["ledger"]["trained"] == 2 * 8 and summary["ledger"]["failed"] == 0, summary["ledger"]
    low, high = history[0]["policy/ratio_min"], history[0]["policy/ratio_max"]
    print(f"\n[launched tiderl server on cuda, {server_dtype}] step-1 ratios [{low:.6f}, {high:.6f}]; "
          f"probe after the update {run.engine.last_probe_diff:.2e}")
    if server_dtype == "float32":
        assert abs(low - 1) < FP32_GAP and abs(high - 1) < FP32_GAP
    else:
        assert high - low > 1e-3  # bf16 really differs from the fp32 trainer


def test_a_colocated_engine_hands_its_memory_to_the_trainers_step(parity_model, tmp_path, monkeypatch):
    """rollout.options.release_memory: in a synchronous run on one GPU, the device memory in use
    when each trainer step starts is lower than without the option by at least the engine's weights
    (they wait in host memory), and the run trains the same number of episodes."""
    import gc

    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import Trainer, build_run

    at_step: list[int] = []
    train_batch = Trainer.train

    def spy(self, batch):
        torch.cuda.synchronize()
        at_step.append(torch.cuda.memory_allocated())
        return train_batch(self, batch)

    monkeypatch.setattr(Trainer, "train", spy)
    in_use, trained = {}, {}
    for release in ("false", "true"):  # a leak from the first run could only narrow the gap
        at_step.clear()
        run = build_run(load_config(None, _args(parity_model, tmp_path / release, "train.steps=3",
                                                "system.max_staleness=0", f"rollout.options.release_memory={release}")))
        engine_bytes = sum(p.numel() * p.element_size() for p in run.engine.model.parameters())
        _, summary = train(run)
        in_use[release], trained[release] = list(at_step), summary["ledger"]["trained"]
        del run
        gc.collect()
        torch.cuda.empty_cache()
    gaps = [a - b for a, b in zip(in_use["false"], in_use["true"])]
    print(f"\n[release_memory] device memory at each step's start: without {in_use['false']}, with {in_use['true']} "
          f"bytes; the engine's weights {engine_bytes} bytes")
    assert trained["true"] == trained["false"] == 3 * 8
    assert len(gaps) == 3 and min(gaps) >= 0.9 * engine_bytes, gaps
