"""The `agent` backend's options (`system.options.*` with `system.backend=agent`): free of the
`serve` extra, so loading a config needs neither FastAPI nor the agent's module
(`tiderl.registry.BACKEND_OPTIONS`; `tiderl.serve.agent.AgentRollout.Options`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tiderl.options import need, opt
from tiderl.registry import is_import_path


@dataclass
class AgentOptions:
    """The external agent that plays the run's tasks (docs/serve.md)."""

    former_keys: ClassVar[dict[str, str]] = {"system.agent": "agent"}
    agent: str = opt("", "Import path 'module:function' of the agent, an `async def solve(base_url, task) -> reward` "
                     "that plays a task through the OpenAI API at base_url (required).")

    def check(self, cfg: Any) -> None:
        problem = f"{self.agent!r} is not a 'module:function' import path" if self.agent else "is empty"
        need(is_import_path(self.agent), "agent", f"{problem}, and system.backend=agent plays an agent function",
             "set system.options.agent=mypkg.agents:solve, an `async def solve(base_url, task) -> reward`")
