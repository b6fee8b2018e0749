"""The agent: multi-turn episodes of model turns, tool calls and environment answers.

- `tool_parser`: Hermes/Qwen `<tool_call>` blocks in a turn's text -> `Action`.
- `chat`: prompt and observation tokens from a tokenizer's own chat template.
- `loop`: `play_episode` (the one episode runner), `play_episodes` and `ScriptedEngine`.

Import from the modules themselves; the package imports nothing, so importing one part
does not load the others.
"""
