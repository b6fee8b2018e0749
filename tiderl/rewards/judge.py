"""Rewards from a generative judge: a chat model behind an OpenAI-compatible URL reads the
episode's conversation through a prompt template and answers with a score (docs/rewards.md).

The judge's answer is parsed to its first number, divided by `reward.judge.max_score` (so the
default 0..10 scale gives 0..1). One request per conversation, `batch_size` in flight at once,
each with `timeout_s`; a failure (unreachable, timeout, HTTP error, no number in the answer)
names the task. Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tiderl.options import need, opt

__all__ = ["PART", "Judge", "JudgeOptions", "render"]

PART = "judge"
DEFAULT_PROMPT = ("Rate how well the assistant solved the user's task in this conversation, from 0 (not at all) "
                  "to 10 (fully and correctly). Answer with the number only.\n\n{conversation}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class JudgeOptions:
    """The `reward.judge:` options."""

    url: str = opt("", "Base URL of an OpenAI-compatible server (e.g. http://localhost:8000/v1) whose chat model "
                       "judges each training episode; '' = off.")
    model: str = opt("", "The model name sent to the judge's server.")
    weight: float = opt(1.0, "Weight of the judge's score (its number / max_score) in the training reward.")
    prompt: str = opt(DEFAULT_PROMPT, "The judge's prompt; {conversation} becomes the episode as 'role: text' lines.")
    max_score: float = opt(10.0, "The top of the judge's scale: its number is divided by it.")
    timeout_s: float = opt(60.0, "Seconds one judge request may take.")
    batch_size: int = opt(8, "Judge requests in flight at once.")
    api_key_env: str = opt("", "The environment variable holding the judge server's API key, sent as "
                               "'Authorization: Bearer <key>' ('' = no key). The key itself is never in the config "
                               "or the logs.")

    def check(self, cfg: object) -> None:
        need("{conversation}" in self.prompt, "prompt", "has no {conversation} placeholder",
             "put {conversation} where the episode goes")
        need(self.max_score > 0, "max_score", "must be > 0", "use e.g. 10")
        need(self.timeout_s > 0, "timeout_s", "must be > 0", "use e.g. 60")
        need(self.batch_size >= 1, "batch_size", "must be >= 1", "use e.g. 8")
        need(not self.url or not self.api_key_env or bool(os.environ.get(self.api_key_env)), "api_key_env",
             f"names ${self.api_key_env}, which is not set (or empty)",
             f"export {self.api_key_env}=<the judge server's key>, or set reward.judge.api_key_env ''")


def render(template: str, messages: Sequence[dict[str, str]]) -> str:
    """The judge's prompt for a conversation."""
    return template.replace("{conversation}", "\n\n".join(f"{m['role']}: {m['content']}" for m in messages))


class Judge:
    """Scores conversations by asking a chat model behind an OpenAI-compatible URL."""

    def __init__(self, options: JudgeOptions) -> None:
        self.options = options
        self._headers = {"Content-Type": "application/json"}
        if options.api_key_env:
            key = os.environ.get(options.api_key_env)
            if not key:
                raise ValueError(f"reward.judge.api_key_env names ${options.api_key_env}, which is not set. Fix: "
                                 f"export {options.api_key_env}=<the judge server's key>, or set it ''")
            self._headers["Authorization"] = f"Bearer {key}"

    def __repr__(self) -> str:  # never the key
        return f"Judge(url={self.options.url!r}, model={self.options.model!r})"

    def scores(self, conversations: Sequence[list[dict[str, str]]], task_ids: Sequence[str] = ()) -> list[float]:
        """One score per conversation, in order; RuntimeError naming the task on any failure."""
        ids = list(task_ids) or [f"#{i}" for i in range(len(conversations))]
        with ThreadPoolExecutor(max_workers=self.options.batch_size) as pool:
            return list(pool.map(self._score, conversations, ids))

    def _score(self, messages: list[dict[str, str]], task_id: str) -> float:
        o = self.options
        body = {"model": o.model, "temperature": 0.0,
                "messages": [{"role": "user", "content": render(o.prompt, messages)}]}
        request = urllib.request.Request(o.url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                         headers=self._headers)
        where = f"judge at {o.url} on task {task_id}"
        try:
            with urllib.request.urlopen(request, timeout=o.timeout_s) as response:
                answer = json.loads(response.read())["choices"][0]["message"]["content"] or ""
        except TimeoutError:
            raise RuntimeError(f"{where}: no answer within reward.judge.timeout_s={o.timeout_s}") from None
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"{where}: {exc!r}") from exc
        found = _NUMBER.search(answer)
        if found is None:
            raise RuntimeError(f"{where}: the answer has no score: {answer[:200]!r}. Fix: make reward.judge.prompt "
                               "ask for a number")
        return float(found.group()) / o.max_score
