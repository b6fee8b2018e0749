"""Tool calls in every form model families write them (`parse_tool_calls`), and how the agent
loop uses the configured form: good calls in reading order, every bad attempt one message."""

from __future__ import annotations

import json
import pickle
import random

import pytest

from tiderl.agent.tool_parser import (
    TOOL_CALL_FORMATS,
    parse_hermes_tool_calls,
    parse_tool_calls,
    set_tool_call_format,
    tool_call_format_of,
)
from tiderl.envs.protocol import ToolCall

REL = ToolCall(name="get_relations", arguments={"variable": "Alien"})
NEI = ToolCall(name="get_neighbors", arguments={"variable": "#0", "relation": "directed_by"})
REL_JSON = json.dumps({"name": REL.name, "arguments": REL.arguments})
NEI_JSON = json.dumps({"name": NEI.name, "arguments": NEI.arguments})


@pytest.mark.parametrize("fmt", ["auto", "json"])
@pytest.mark.parametrize(
    "text, calls",
    [
        # What Qwen2.5-Coder-Instruct writes: a fenced json block.
        (f"I'll list the relations.\n```json\n{REL_JSON}\n```", [REL]),
        (f"```\n{REL_JSON}\n```", [REL]),  # untagged fence
        (f"```JSON {REL_JSON}```", [REL]),  # tag case, body on the fence line
        (f"```tool_call\n{REL_JSON}\n```", [REL]),
        (REL_JSON, [REL]),  # bare object
        (f"Calling {REL_JSON} now, then {NEI_JSON}.", [REL, NEI]),  # two bare objects in prose
        (f"[{REL_JSON}, {NEI_JSON}]", [REL, NEI]),  # bare list of calls
        (f"```json\n[{REL_JSON}, {NEI_JSON}]\n```", [REL, NEI]),  # fenced list
        (f"```json\n{REL_JSON}\n```\n```json\n{NEI_JSON}\n```", [REL, NEI]),  # two fences
        ('{"name": "count", "parameters": {"variable": "#1"}}', [ToolCall("count", {"variable": "#1"})]),  # Llama
        ('{"name": "count", "arguments": "{\\"variable\\": \\"#1\\"}"}', [ToolCall("count", {"variable": "#1"})]),
        ('{"name": "list_tables"}', [ToolCall("list_tables", {})]),
        # A call's arguments may hold an object with a "name": it is not a second call.
        ('{"name": "insert", "arguments": {"row": {"name": "Ann"}}}', [ToolCall("insert", {"row": {"name": "Ann"}})]),
    ],
)
def test_json_forms(fmt, text, calls):
    action = parse_tool_calls(text + "<|im_end|>", fmt, strip=("<|im_end|>",))
    assert action.tool_calls == calls
    assert action.parse_errors == []
    assert action.text == text


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('```json\n{"name": "count", "arguments": {"variable": }\n```', "invalid JSON (Expecting value at line 1 column 45)"),
        ('```json\n{"name": "count", "arguments": {"variable": "#0"}}', "block is never closed"),
        ('```json\n{"variable": "#0"}\n```', "no 'name'"),
        ('```json\n{"name": "", "arguments": {}}\n```', "non-empty string 'name'"),
        ('```json\n{"name": "count", "arguments": ["#0"]}\n```', "'arguments' of 'count' must be a JSON object, got an array"),
        ('```json\n{"name": "count", "arguments": "#0"}\n```', "is a string that is not valid JSON"),
        ('```json\n[]\n```', "an empty list of calls"),
        ('```json\n["count", "#0"]\n```', "must hold only JSON objects, got a string, a string"),
        ('{"name": "count", "arguments": {"variable": "#0"}', "invalid JSON"),  # bare, missing a brace
        ('{"name": "count" "arguments": {}}', "Expecting ',' delimiter"),
        ('{"name": 7, "arguments": {}}', "'name' = 7"),
    ],
)
def test_malformed_json_calls_are_one_error_each(text, fragment):
    for fmt in ("auto", "json"):
        action = parse_tool_calls(text, fmt)
        assert action.tool_calls == []
        assert len(action.parse_errors) == 1, action.parse_errors
        assert action.parse_errors[0].startswith("tool call 1: ")
        assert fragment in action.parse_errors[0]
        assert "```json" in action.parse_errors[0]  # the error shows the expected form


def test_errors_are_numbered_in_reading_order_and_good_calls_kept():
    text = f'{REL_JSON}\n```json\n{{"name": "x", "arguments": }}\n```\n{NEI_JSON}\n{{"name": "y" oops'
    action = parse_tool_calls(text, "json")
    assert action.tool_calls == [REL, NEI]
    assert [e.split(":")[0] for e in action.parse_errors] == ["tool call 2", "tool call 4"]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is Ridley Scott.",
        "Final Answer: #2",
        '```sql\nSELECT name FROM t WHERE x = \'{"name": 1}\';\n```',  # code, not a call
        '```python\nprint({"name": "a"})\n```',
        '{"answer": 3} is not a call',  # bare JSON without a name
        "a { brace and a [ bracket",
        "```\nplain text in a fence\n```",
    ],
)
def test_text_that_is_not_a_call_is_left_alone(text):
    for fmt in TOOL_CALL_FORMATS:
        action = parse_tool_calls(text, fmt)
        assert action.tool_calls == [] and action.parse_errors == [], (fmt, action)
        assert action.text == text


def test_hermes_format_reads_only_tags():
    text = f"<tool_call>{REL_JSON}</tool_call> and ```json\n{NEI_JSON}\n```"
    assert parse_tool_calls(text, "hermes") == parse_hermes_tool_calls(text)
    assert parse_tool_calls(text, "hermes").tool_calls == [REL]
    assert parse_tool_calls(text, "json").tool_calls == [REL, NEI]  # the bare object in the tags too
    assert parse_tool_calls(text, "auto").tool_calls == [REL, NEI]


def test_auto_reads_tags_as_hermes_and_the_rest_as_json():
    text = (f"<tool_call>\n{REL_JSON}\n</tool_call>\n<tool_call>\n```json\n{NEI_JSON}\n```\n</tool_call>"
            f'<tool_call>{{"name": "a", "arguments": {{}}</tool_call> {{"name": "count"}}')
    action = parse_tool_calls(text, "auto")
    # The tag holding a fence is unwrapped; the calls inside tags are not counted twice.
    assert action.tool_calls == [REL, NEI, ToolCall("count", {})]
    assert len(action.parse_errors) == 1 and action.parse_errors[0].startswith("tool call 3: invalid JSON")
    assert "<tool_call>" in action.parse_errors[0]  # a tag error shows the tag form


def test_auto_reports_tag_errors_like_hermes():
    action = parse_tool_calls(f'<tool_call>{REL_JSON}</tool_call><tool_call>{{"name": "b"', "auto")
    assert action.tool_calls == [REL]
    assert action.parse_errors[0].startswith("tool call 2: <tool_call> is never closed")


def test_unknown_format_is_a_parse_error_not_an_exception():
    action = parse_tool_calls(REL_JSON, "xml")
    assert action.tool_calls == []
    assert "format 'xml'" in action.parse_errors[0] and "auto, hermes, json" in action.parse_errors[0]


@pytest.mark.slow
def test_never_raises_on_random_text():
    pieces = ["```", "```json", "\n", "{", "}", "[", "]", '"name"', ":", '"a"', ",", '"arguments"', "<tool_call>",
              "</tool_call>", "\\", '"', "x", " ", "\ud800", "\x00", '"parameters"']
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        for fmt in TOOL_CALL_FORMATS:
            action = parse_tool_calls(text, fmt)
            assert all(isinstance(e, str) and e.startswith("tool call ") for e in action.parse_errors)
    for text in ["[" * 100000, "{" * 50000 + '"name"', '{"name": ' * 20000, "```json\n" + "[" * 100000 + "```"]:
        for fmt in TOOL_CALL_FORMATS:
            parse_tool_calls(text, fmt)


def test_format_travels_with_the_tokenizer():
    from tiderl.embedded.tiny import train_tokenizer

    tok = train_tokenizer(["some text to train on"] * 4, vocab_size=300)
    assert tool_call_format_of(tok) == "auto"
    set_tool_call_format(tok, "json")
    # The attribute survives pickling, so it reaches Ray workers with the tokenizer.
    assert tool_call_format_of(pickle.loads(pickle.dumps(tok))) == "json"
    with pytest.raises(ValueError, match="model.tool_call_format: 'yaml'"):
        set_tool_call_format(tok, "yaml")
