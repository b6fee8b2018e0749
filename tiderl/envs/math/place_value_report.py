"""Per kind, what a `place_value` run's models answer on its held-out questions.

    python -m tiderl.envs.math.place_value_report runs/math_place_p3_s0 [more run dirs]
    python -m tiderl.envs.math.place_value_report RUN_DIR --before MODEL_DIR

For each run dir written by `tiderl demo` (its `config.yaml`, `checkpoints/final/actor`), the
warm-started model (the embedded model the config names, from its cache, or `--before`: a run
made with other tiderl source has its model under another cache key) and the trained one
answer the run's held-out questions greedily, and each answer is sorted: *right*, *confused*
(the kind's confused variant, as the warm start's demonstrations give it at the kind's rate), or
*neither* (a digit copied wrong, left out or added, or no answer). It prints, per kind, the
demonstrations' confusion rate and the three shares before and after, so a rise can be traced to
kinds moved from the confused variant to the right one, and copying slips can be told apart from
the systematic error. The prompts are the agent loop's (scripted episodes), the decoding is greedy
with Hugging Face `generate`, so the overall right share matches the demo's greedy evaluation
up to ties.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from tiderl.config import RunConfig, load_config
from tiderl.envs.math.calculator import calculate
from tiderl.envs.math.extract import extract_answer
from tiderl.envs.protocol import Task
from tiderl.envs.setup import Setup, load_setup

OUTCOMES = ("right", "confused", "neither")


def outcome(task: Task, text: str) -> str:
    """Whether a model turn answers `task` right, with its confused variant, or neither."""
    answer = extract_answer(text).answer
    if answer == task.answer:
        return "right"
    return "confused" if answer == calculate(task.meta["confusion"]) else "neither"


def outcomes_by_kind(model_dir: str | Path, cfg: RunConfig, setup: Setup) -> dict[str, Counter]:
    """Greedy answers of the model in `model_dir` to the held-out questions, counted per kind."""
    from tiderl.embedded.build import greedy_turns
    from tiderl.models.loading import load_model, load_tokenizer
    from tiderl.models.warmstart import scripted_traces

    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    tasks = setup.eval_tasks
    scripts = [[f"Final Answer: {t.answer}"] for t in tasks]  # only their prompts are used
    prompts = [t.tokens[:t.loss_mask.index(1)] for t in scripted_traces(tokenizer, setup, tasks, scripts, cfg)]
    turns = greedy_turns(model, prompts, tokenizer.pad_token_id, tokenizer.eos_token_id, cfg.rollout.max_new_tokens)
    counts: dict[str, Counter] = {}
    for task, turn in zip(tasks, turns):
        counts.setdefault(task.meta["kind"], Counter())[outcome(task, tokenizer.decode(turn, skip_special_tokens=True))] += 1
    return counts


def report(run_dir: Path, before_dir: Path | None = None) -> str:
    """The per-kind table of one run dir (module docstring)."""
    from tiderl.embedded.build import embedded_model_dir

    cfg = load_config(str(run_dir / "config.yaml"))
    if cfg.data.source != "place_value":
        raise ValueError(f"{run_dir} is a data.source={cfg.data.source} run; this report is for place_value")
    setup = load_setup(cfg)
    if before_dir is None:
        before_dir = embedded_model_dir(cfg) if cfg.model.path == "tiny" else Path(cfg.model.path).expanduser()
    after_dir = run_dir / "checkpoints" / "final" / "actor"
    for path in (before_dir, after_dir):
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is missing: run `tiderl demo --config {run_dir / 'config.yaml'}` first "
                                    "(with the same tiderl source: the embedded model's cache key follows it)")
    rates = json.loads((before_dir / "tiderl_build.json").read_text()).get("confusion_rates", {}) \
        if (before_dir / "tiderl_build.json").is_file() else {}
    before, after = outcomes_by_kind(before_dir, cfg, setup), outcomes_by_kind(after_dir, cfg, setup)
    lines = [f"{run_dir} (n = {len(setup.eval_tasks)} held-out questions; right / confused / neither)",
             "| kind (confusion rate) | n | before | after |", "| --- | ---: | --- | --- |"]
    for kind in sorted(before, key=lambda k: rates.get(k, 0.0)):
        n = sum(before[kind].values())
        cells = [" / ".join(f"{counts[kind][o] / n:.2f}" for o in OUTCOMES) for counts in (before, after)]
        lines.append(f"| `{kind}` ({rates.get(kind, float('nan')):.2f}) | {n} | {cells[0]} | {cells[1]} |")
    total = len(setup.eval_tasks)
    cells = [" / ".join(f"{sum(c[o] for c in counts.values()) / total:.3f}" for o in OUTCOMES) for counts in (before, after)]
    lines.append(f"| all | {total} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tiderl.envs.math.place_value_report",
                                     description="Per kind, a place_value run's held-out answers before and after.")
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--before", type=Path, default=None,
                        help="the warm-started model dir (one run dir only; default: the config's cached model)")
    args = parser.parse_args(argv)
    if args.before is not None and len(args.run_dirs) != 1:
        parser.error("--before goes with exactly one run dir")
    for run_dir in args.run_dirs:
        print(report(run_dir, args.before), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
