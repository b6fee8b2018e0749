"""Per-step metrics to JSONL, TensorBoard and the trackers of `log.trackers` (W&B, MLflow:
`tiderl.metrics.trackers`), plus a progress bar with the key numbers.

Every key written here is defined in docs/metrics.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tiderl.metrics.trackers import open_trackers

# Shown on the progress bar, in this order, when present.
PROGRESS_KEYS = ("reward", "success", "value/explained_variance", "dis/masked_frac", "step_s")


class MetricsLogger:
    """Writes one JSON line per step to `run_dir/metrics.jsonl`, and its finite scalars to
    TensorBoard and to the trackers `trackers` (started with the resolved config `config`)."""

    def __init__(self, run_dir: str | Path, total_steps: int, tensorboard: bool = True,
                 progress: bool = True, trackers: list[str] = (), config: Any = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True)
        self._trackers = open_trackers(list(trackers), self.run_dir, config) if trackers else []

    def log(self, step: int, metrics: dict[str, Any], advance: bool = True) -> None:  # advance: the bar moves
        # JSON-safe scalars: tensors and numpy numbers become Python numbers.
        record = {"step": step, **{k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        for k, v in scalars.items() if self._tb is not None else ():
            self._tb.add_scalar(k, v, step)
        for tracker in self._trackers:
            tracker.log(step, scalars)
        if self._bar is not None:
            shown = {k.split("/")[-1]: f"{record[k]:.3g}" for k in PROGRESS_KEYS
                     if isinstance(record.get(k), (int, float))}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(int(advance))

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def cut_metrics(path: str | Path, step: int) -> None:
    """Keep only the rows of `path` (a metrics.jsonl) up to `step`: a run resumed from step
    `step` logs the later steps again, so each step keeps one row. A torn last line is dropped."""
    p = Path(path)
    if not p.is_file():
        return
    kept = []
    for line in p.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step")
        except json.JSONDecodeError:
            continue
        if not (isinstance(row_step, int) and row_step > step):
            kept.append(line + "\n")
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(p)
