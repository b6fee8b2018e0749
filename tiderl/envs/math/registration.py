"""The math environment as `env.name` finds it: its options, data sources and warm start
(`tiderl.envs.registration`). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.envs.registration import BuiltinEnvironment
from tiderl.options import need, opt

# Questions tiderl generates (training and held out)...
GENERATED_SOURCES = ("arithmetic", "small_arithmetic", "digit_arithmetic", "place_value")
# ... and test sets under the data root (evaluation only; tiderl.envs.math.data.BENCHMARK_FILES).
BENCHMARK_SOURCES = ("gsm8k", "math500", "aime24", "aime25", "amc23")
SOURCES = GENERATED_SOURCES + BENCHMARK_SOURCES
# What an answer without a marker scores by (tiderl.envs.math.extract, rule 4).
FALLBACKS = ("none", "last_number")


@dataclass
class MathOptions:
    """The math environment's options (`env.options.*` with this environment)."""

    calculator: bool = opt(
        False, "Offer the calculator tool (multi-turn; the first turn without a tool call is the answer); "
        "false = single-turn (the first turn is the answer).")
    format_penalty: float = opt(0.0, "Reward lost when the answer is not in \\boxed{} or there is none (0 = off).")
    answer_fallback: str = opt(
        "none", "An answer with no \\boxed{}, 'Final Answer:' or '####': none = scores 0; last_number = its "
        "last number is the answer (models that answer in a sentence), unless the turn was cut at the token "
        "limit: a cut turn's last number is working, not an answer, and scores 0.")
    verify_timeout_s: float = opt(
        5.0, "Longest math-verify check of one answer, in seconds (its worker process is killed after that "
        "and the answer counts as wrong).")
    num_train_tasks: int = opt(4000, "Generated sources: training questions generated.")

    def check(self, cfg: Any) -> None:
        need(self.format_penalty >= 0, "format_penalty", "must be >= 0", "use 0 (off) or e.g. 0.1")
        need(self.answer_fallback in FALLBACKS, "answer_fallback", "must be none or last_number",
             "use none (a marker is required) or last_number")
        need(self.verify_timeout_s > 0, "verify_timeout_s", "must be > 0", "use 5.0")
        need(self.num_train_tasks >= 0, "num_train_tasks", "must be >= 0", "use 4000")


ENVIRONMENT = BuiltinEnvironment(
    setup_path="tiderl.envs.math.setup:setup",
    Options=MathOptions,
    sources=SOURCES,
    warm_start_path="tiderl.envs.math.setup:WARM_START",
    task_files=True,
    former_keys={"env.math_tools": "calculator", "env.math_format_penalty": "format_penalty",
                 "env.math_verify_timeout_s": "verify_timeout_s", "data.num_train_tasks": "num_train_tasks"},
)
