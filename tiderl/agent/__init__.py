"""The agent: multi-turn episodes of model turns, tool calls and environment answers.

- `tool_parser`: Hermes/Qwen `<tool_call>` blocks in a turn's text -> `Action`.
- `chat`: prompt and observation tokens from a tokenizer's own chat template.
- `loop`: `play_episode` (the one episode runner), `play_episodes` and `ScriptedEngine`.
"""

from tiderl.agent.chat import (
    ChatFormat,
    TemplateError,
    chat_format,
    observation_ids,
    render_prompt_ids,
    user_message_ids,
)
from tiderl.agent.loop import CONTINUE_MESSAGE, ScriptedEngine, play_episode, play_episodes
from tiderl.agent.tool_parser import parse_hermes_tool_calls

__all__ = [
    "CONTINUE_MESSAGE",
    "ChatFormat",
    "ScriptedEngine",
    "TemplateError",
    "chat_format",
    "observation_ids",
    "parse_hermes_tool_calls",
    "render_prompt_ids",
    "play_episode",
    "play_episodes",
    "user_message_ids",
]
