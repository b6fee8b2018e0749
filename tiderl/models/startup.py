"""Start-up checks that a model and its chat template can play the configured environment.

Run once by `build_run` (train, demo, pretrain-value) and `tiderl eval`, before any episode:

- `model.chat_template` replaces the tokenizer's template (a built-in name or a Jinja file);
- `model.tool_call_format` is attached to the tokenizer, so every episode runner parses the
  model's turns in that format;
- one prompt per sampled task is rendered with the environment's tools: a template that does
  not show every tool name to the model (SmolLM2's ignores `tools=`) is an error naming the fix,
  never a run in which the model cannot know the tools;
- the longest rendered prompt plus one model turn must fit `env.max_total_tokens`, and that
  budget must fit the model's position limit; otherwise every episode would end with no
  generated token and a success of 0 that looks like a result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiderl.agent.chat import chat_format, message_parts
from tiderl.agent.tool_parser import set_tool_call_format

# The turns after the system turn, shared by every ChatML template of tiderl (the fallback below
# with full tool schemas and the embedded tiny model's, tiderl.embedded.chat_template): tool
# responses grouped in one user turn, assistant tool calls in Hermes tags, then the generation prompt.
CHATML_TURNS = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{ '<|im_start|>user' + nl }}"
    "{%- else -%}"
    "{{ nl }}"
    "{%- endif -%}"
    "{{ '<tool_response>' + nl + m['content'] + nl + '</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{ '<|im_end|>' + nl }}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m['role'] + nl + (m['content'] if m['content'] else '') }}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') -%}"
    "{%- for call in m['tool_calls'] -%}"
    "{%- if m['content'] or not loop.first -%}{{ nl }}{%- endif -%}"
    "{{ '<tool_call>' + nl }}"
    "{{- {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson -}}"
    "{{ nl + '</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>' + nl }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant' + nl }}"
    "{%- endif -%}"
)

# A ChatML template (Qwen, SmolLM2, Hermes and many others use ChatML turns) that lists the
# tools in the system turn as JSON schemas and asks for Hermes-style calls. Tool responses are
# grouped in one user turn of <tool_response> blocks. Every newline is written as {{ nl }} and
# every tag trims its own whitespace, so the rendering is the same under any Jinja settings.
CHATML_TOOLS_TEMPLATE = (
    "{%- set nl = '\\n' -%}"
    "{%- set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- if sys or tools -%}"
    "{{ '<|im_start|>system' + nl + (sys or '') }}"
    "{%- if tools -%}"
    "{%- if sys -%}{{ nl + nl }}{%- endif -%}"
    "{{ '## Tools' + nl + 'You can call these tools (JSON schemas, one per line):' + nl }}"
    "{%- for tool in tools -%}{{ tool | tojson + nl }}{%- endfor -%}"
    "{{ nl + 'To call a tool, write a JSON object with its name and arguments between tags:' + nl }}"
    "{{ '<tool_call>' + nl + '{\"name\": \"<tool name>\", \"arguments\": {\"<argument>\": <value>}}' + nl }}"
    "{{ '</tool_call>' }}"
    "{%- endif -%}"
    "{{ '<|im_end|>' + nl }}"
    "{%- endif -%}"
    + CHATML_TURNS
)

# Built-in templates by name (model.chat_template=<name>), with the special tokens each needs.
BUILTIN_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "chatml": (CHATML_TOOLS_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
}

# Tasks whose prompts are rendered at start-up (the longest sets the budget check).
PROMPTS_CHECKED = 16


class StartupError(ValueError):
    """The model, its template or the budgets cannot play the configured environment."""


@dataclass
class StartupReport:
    """What the start-up checks found."""

    template: str  # where the chat template came from
    tool_call_format: str
    prompt_tokens: int  # the longest rendered prompt among the checked tasks
    prompts_checked: int
    max_total_tokens: int


def apply_chat_template(tokenizer: Any, option: str) -> str:
    """Replace the tokenizer's chat template as `model.chat_template` says; returns its source."""
    if not option:
        return "the tokenizer's own"
    if option in BUILTIN_TEMPLATES:
        template, tokens = BUILTIN_TEMPLATES[option]
        for token in tokens:
            if len(tokenizer.encode(token, add_special_tokens=False)) != 1:
                raise StartupError(
                    f"model.chat_template={option}: the tokenizer has no single token {token!r}, which the "
                    f"{option} template needs. Fix: give a template written for this model, "
                    "model.chat_template=/path/to/template.jinja")
        tokenizer.chat_template = template
        return f"tiderl's built-in {option!r}"
    path = Path(option).expanduser()
    if not path.is_file():
        raise StartupError(
            f"model.chat_template={option!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
            "nor a Jinja template file. Fix: model.chat_template=chatml, or the path of a .jinja file")
    tokenizer.chat_template = path.read_text()
    return str(path)


def check_model_and_budgets(cfg: Any, tokenizer: Any, setup: Any, max_positions: int | None,
                            model_name: str = "the model") -> StartupReport:
    """Apply `model.chat_template` and `model.tool_call_format` to `tokenizer`, then check that
    the template shows every tool to the model and that the prompts fit the budgets (see the
    module docstring). Raises `StartupError` with the fix; returns what it found.

    `setup`: the run's `Setup` (its tasks and `make_env`); `max_positions`: the model's
    position limit (`config.max_position_embeddings`), None when unknown.
    """
    source = apply_chat_template(tokenizer, cfg.model.chat_template)
    set_tool_call_format(tokenizer, cfg.model.tool_call_format)
    env_cfg, rollout = cfg.env, cfg.rollout
    if max_positions is not None and env_cfg.max_total_tokens > max_positions:
        raise StartupError(
            f"env.max_total_tokens={env_cfg.max_total_tokens} exceeds what {model_name} can attend to "
            f"(max_position_embeddings={max_positions}). Fix: env.max_total_tokens={max_positions} or less")
    tasks = list(setup.eval_tasks[:PROMPTS_CHECKED // 2]) + list(setup.train_tasks[:PROMPTS_CHECKED // 2])
    longest = 0
    failures: list[str] = []
    for task in tasks:
        env = setup.make_env()
        try:
            first = env.reset(task)
        except Exception as exc:  # noqa: BLE001 - an environment failure is retried at run time
            failures.append(f"task {task.task_id}: {type(exc).__name__}: {exc}")
            continue
        tools = env.tool_schemas()
        messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": first}]
        text = tokenizer.apply_chat_template(message_parts(messages)[0], tools=tools or None,  # images as parts
                                             add_generation_prompt=True, tokenize=False)
        names = [t.get("function", t).get("name", "") for t in tools or []]
        missing = [n for n in names if n and n not in text]
        if missing:
            raise StartupError(
                f"the chat template ({source}) of {model_name} does not show the tools to the model: "
                f"{', '.join(missing)} never appear in the rendered prompt, so the model could not call "
                "them (its template ignores tools=). Fix: model.chat_template=chatml (tiderl's ChatML "
                "template with tools; for ChatML models such as SmolLM2 and Qwen), or "
                "model.chat_template=/path/to/template.jinja")
        # The ChatFormat checks that the template can be assembled turn by turn.
        longest = max(longest, len(chat_format(tokenizer, tools).prompt_with_images(messages)[0]))
        getattr(env, "close", lambda: None)()  # release what reset opened (a database server's session)
    if tasks and len(failures) == len(tasks):
        # Not a StartupError (a config problem): the environment itself is broken.
        raise RuntimeError(
            f"env.name={env_cfg.name} keeps failing at reset: all {len(tasks)} tasks checked at start-up "
            f"failed (first: {failures[0]}). Fix the environment (its data, service or credentials) "
            "before training; tiderl checks this before loading any more.")
    if tasks and longest + rollout.max_new_tokens + 1 > env_cfg.max_total_tokens:
        # Room for the prompt and every turn plus an observation of similar size, rounded up to 256.
        suggestion = -(-(longest + env_cfg.max_turns * 2 * rollout.max_new_tokens) // 256) * 256
        raise StartupError(
            f"env.max_total_tokens={env_cfg.max_total_tokens} leaves no room for a model turn: the longest "
            f"prompt of {len(tasks)} {setup.name} tasks renders to {longest} tokens with {model_name}'s "
            f"template, and one turn needs rollout.max_new_tokens={rollout.max_new_tokens} more. Every "
            f"episode would end before the model writes anything. Fix: env.max_total_tokens={suggestion} "
            f"(and train.micro_batch_tokens at least as large)")
    return StartupReport(source, cfg.model.tool_call_format, longest, len(tasks), env_cfg.max_total_tokens)
