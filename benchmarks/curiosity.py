"""Curiosity-shaped reward on versus off, on 2- and 3-hop knowledge-graph questions.

Both conditions start from the same warm-started policy, train with SAO asynchronously
(staleness 1) on the embedded world's 1-, 2- and 3-hop questions and stop at the same
generated-token budget; only `curiosity.enabled` differs (the units are counted either way).
1-hop questions stay in the mix because a policy warm-started on 2- and 3-hop questions alone
solves none of them at this size (measured: 0/40 greedy), so there would be nothing to compare.
Three seeds each. Reports held-out greedy success (topics never trained on) overall and on 2-
and 3-hop questions, knowledge units reached per held-out episode, novel units per training
episode, and tool calls per held-out episode; last line: held-out success ratio on/off.

    .venv/bin/python benchmarks/curiosity.py            # 2 x 3 runs, about 25 minutes here
    .venv/bin/python benchmarks/curiosity.py --quick    # 1 seed, small budget, about 5 minutes

The 1/2/3-hop model is built once (about 5 minutes) and cached; run times exclude that.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import train_to_budget  # sets up the import path and torch threads

from tiderl.config import load_config
from tiderl.envs.setup import load_setup
from tiderl.run import resolve_model_path

TASK = [
    "env.options.hops=[1,2,3]", "env.max_turns=5", "env.max_total_tokens=448",
    "system.backend=local", "system.max_staleness=1", "log.progress=false", "log.tensorboard=false",
    "system.trainer_threads=1", "system.decode_threads=1", "curiosity.weight=0.05", "curiosity.scope=global",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="runs/bench_curiosity")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    budget, eval_n, eval_every, batch = 60_000, 300, 10, 64
    if args.quick:
        seeds, budget, eval_n, eval_every, batch = seeds[:1], 8_000, 100, 5, 32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = load_config("configs/sao.yaml", TASK)
    model_path = resolve_model_path(base, load_setup(base))
    print(f"model {model_path}; budget {budget} generated tokens; {batch} trajectories per step")

    rows = []
    for enabled in (False, True):
        for seed in seeds:
            cfg = load_config("configs/sao.yaml", TASK + [
                f"model.path={model_path}", f"seed={seed}", f"curiosity.enabled={str(enabled).lower()}",
                f"rollout.batch_size={batch}", "train.steps=1000", f"data.eval_size={eval_n}",
                f"run_dir={out / ('on' if enabled else 'off') / f'seed{seed}'}",
            ])
            row = train_to_budget(cfg, budget, eval_every, eval_n,
                                  {"curiosity": "on" if enabled else "off", "seed": seed})
            history, episodes = row.pop("history"), row.pop("held_out_episodes")
            row.pop("run"), row.pop("held_out")
            row["novel_units_train"] = statistics.mean(h.get("curiosity/novel_units", 0.0) for h in history)
            row["bonus_train"] = statistics.mean(h.get("curiosity/bonus", 0.0) for h in history)
            infos = [t.env_info for _, t in episodes]
            row["units_held_out"] = statistics.mean(len(i.get("knowledge_units", [])) for i in infos)
            row["tool_calls_held_out"] = statistics.mean(float(i.get("tool_calls", 0)) for i in infos)
            multi = [float(t.env_info.get("success", 0)) for task, t in episodes if task.meta.get("hops") in (2, 3)]
            row["multi_hop"] = statistics.mean(multi) if multi else float("nan")
            row["by_hops"] = {
                str(h): statistics.mean(float(t.env_info.get("success", 0)) for task, t in episodes
                                        if task.meta.get("hops") == h)
                for h in (2, 3)}
            rows.append(row)
    (out / "runs.json").write_text(json.dumps(rows, indent=2))

    print(f"\n{'curiosity':<10}{'runs':>5}{'held-out success':>20}{'2-hop':>7}{'3-hop':>7}"
          f"{'units/ep':>10}{'novel/ep (train)':>18}{'tool calls/ep':>15}")
    means = {}
    for cond in ("off", "on"):
        mine = [r for r in rows if r["curiosity"] == cond]
        finals = [r["final"] for r in mine]
        means[cond] = statistics.mean(finals)
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0

        def avg(key: str, rs: list[dict] = mine) -> float:
            return statistics.mean(r[key] for r in rs)

        hop = {h: statistics.mean(r["by_hops"].get(h, float("nan")) for r in mine) for h in ("2", "3")}
        print(f"{cond:<10}{len(mine):>5}{means[cond]:>13.3f} ± {sd:.3f}{hop['2']:>7.3f}{hop['3']:>7.3f}"
              f"{avg('units_held_out'):>10.2f}{avg('novel_units_train'):>18.2f}{avg('tool_calls_held_out'):>15.2f}")
    multi = {c: statistics.mean(r["multi_hop"] for r in rows if r["curiosity"] == c) for c in ("off", "on")}

    def ratio(d: dict) -> float:
        return d["on"] / d["off"] if d["off"] > 0 else float("inf")

    print(f"held-out success with / without curiosity: 2-/3-hop {multi['on']:.3f} / {multi['off']:.3f} = "
          f"{ratio(multi):.2f}; all hops {means['on']:.3f} / {means['off']:.3f} = {ratio(means):.2f}")


if __name__ == "__main__":
    main()
