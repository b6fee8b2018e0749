"""The code environment's setup (`env.name: code`, `data.source: humaneval | mbpp | funcs`).

funcs: the generated one-line functions (tiderl/envs/code/funcs.py), the embedded tiny model's task.
humaneval: evaluate on HumanEval's 164 problems; train on MBPP's training problems (HumanEval
has no training split). mbpp: evaluate on MBPP's evaluation split (task ids 11-510), train on
the rest (but the few-shot prompts 1-10). At most `data.eval_size` eval tasks are kept (a
fixed-seed sample; `data.eval_size=257` keeps all of MBPP's). The oracle submits the reference
solution. Sandbox limits come from `env.options.sandbox_*` (`registration.CodeOptions`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiderl.envs.code.data import HUMANEVAL_FILE, MBPP_FILE, file_tasks, load_humaneval, load_mbpp
from tiderl.envs.code.env import CodeEnv, tool_call_text
from tiderl.envs.code.funcs import funcs_tasks
from tiderl.envs.code.registration import SOURCES
from tiderl.envs.code.sandbox import Limits, Sandbox
from tiderl.envs.protocol import Task
from tiderl.envs.setup import Setup, data_root, file_split, files_name, sample_tasks

if TYPE_CHECKING:
    from tiderl.config import RunConfig

def sandbox_limits(cfg: "RunConfig") -> Limits:
    """The per-execution limits `env.options.sandbox_*` set."""
    options = cfg.env.options
    return Limits(cpu_s=options.sandbox_cpu_s, wall_s=options.sandbox_wall_s, memory_mb=options.sandbox_memory_mb)


def shared_sandbox(setup: Setup, cfg: "RunConfig") -> Sandbox:
    """The setup's sandbox (built once per setup and process)."""
    return setup.backend("sandbox", lambda: Sandbox(sandbox_limits(cfg), concurrency=cfg.env.options.sandbox_concurrency))


def code_tasks(cfg: "RunConfig") -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out tasks) of `data.source`, or of `data.train_files` /
    `data.eval_files` in place of the source's (`file_tasks`)."""
    data = cfg.data
    if data.source not in SOURCES:
        raise ValueError(f"data.source={data.source!r} is not a code source. Fix: use one of {', '.join(SOURCES)}.")
    train_files, eval_files = file_split(data)
    train, held_out = source_tasks(cfg) if not (train_files and eval_files) else ([], [])
    if train_files:
        train = file_tasks(train_files, data.fields)
    if eval_files:
        held_out = sample_tasks(file_tasks(eval_files, data.fields), data.eval_size, data.seed)
    return train, held_out


def source_tasks(cfg: "RunConfig") -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out tasks) of `data.source` (module docstring)."""
    data = cfg.data
    if data.source == "funcs":
        train, held_out = funcs_tasks(data.seed)
        return train, sample_tasks(held_out, data.eval_size, data.seed)
    root = data_root(data.data_dir)
    needed = root / (HUMANEVAL_FILE if data.source == "humaneval" else MBPP_FILE)
    if not needed.is_file():
        raise FileNotFoundError(f"{data.source} data not found at {needed}. Fix: set data.data_dir to the folder "
                                "that holds humaneval/ and mbpp/, or the TIDERL_DATA_DIR environment variable.")
    if data.source == "humaneval":
        held_out = load_humaneval(root)
    else:
        held_out = load_mbpp(root, "eval")
    train = load_mbpp(root, "train") if (root / MBPP_FILE).is_file() else []
    return train, sample_tasks(held_out, data.eval_size, data.seed)


def oracle_turns(task: Task) -> list[str]:
    """The oracle's one turn: submit the reference solution."""
    return [tool_call_text("submit", {"code": task.meta["reference"]})]


def setup(cfg: "RunConfig") -> Setup:
    """Code tasks of `data.source` and a factory of `CodeEnv`s sharing one sandbox."""
    train, held_out = code_tasks(cfg)
    train_files, eval_files = file_split(cfg.data)
    name = files_name(train_files, eval_files, cfg.data.source)
    out = Setup(train, held_out, CodeEnv, name, oracle=oracle_turns)
    out.make_env = _CodeFactory(out, cfg)
    return out


class _CodeFactory:
    """`make_env` of a code setup: a `CodeEnv` on the setup's sandbox."""

    def __init__(self, setup: Setup, cfg: "RunConfig") -> None:
        self.setup, self.cfg = setup, cfg

    def __call__(self) -> CodeEnv:
        return CodeEnv(shared_sandbox(self.setup, self.cfg), self.cfg.env.max_observation_chars,
                       self.cfg.env.system_prompt or None)
