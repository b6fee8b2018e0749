"""The code environment as `env.name` finds it: its options (the sandbox's limits) and data
sources (`tiderl.envs.registration`). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.envs.registration import BuiltinEnvironment
from tiderl.options import need, opt

# data.source values: evaluate on HumanEval (the default) or MBPP, train on MBPP's training split; or
# the generated one-line functions of the embedded tiny model (tiderl/envs/code/funcs.py).
SOURCES = ("humaneval", "mbpp", "funcs")


@dataclass
class CodeOptions:
    """The sandbox's limits (`env.options.*` with this environment, and with the repo one)."""

    sandbox_cpu_s: float = opt(5.0, "CPU seconds per sandboxed execution.")
    sandbox_wall_s: float = opt(10.0, "Wall-clock seconds per sandboxed execution.")
    sandbox_memory_mb: int = opt(1024, "Address-space limit of a sandboxed execution, in MiB.")
    sandbox_concurrency: int = opt(0, "Sandboxed executions running at once per event loop (0 = one per core).")

    def check(self, cfg: Any) -> None:
        for key in ("sandbox_cpu_s", "sandbox_wall_s", "sandbox_memory_mb"):
            need(getattr(self, key) > 0, key, "must be > 0", "use the default")
        need(self.sandbox_concurrency >= 0, "sandbox_concurrency", "must be >= 0", "use 0 (one per core)")


# The former run-level keys of the sandbox's limits (env.sandbox_cpu_s, ...).
FORMER_KEYS = {f"env.{f}": f for f in ("sandbox_cpu_s", "sandbox_wall_s", "sandbox_memory_mb", "sandbox_concurrency")}

ENVIRONMENT = BuiltinEnvironment(setup_path="tiderl.envs.code.setup:setup", Options=CodeOptions, sources=SOURCES,
                                 warm_start_path="tiderl.envs.code.funcs:WARM_START", former_keys=FORMER_KEYS,
                                 task_files=True,
                                 task_fields=("question", "tests", "entry_point", "reference", "id"))
