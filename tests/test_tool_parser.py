"""Hermes/Qwen tool-call parsing: good calls come out in order, every bad block is one message."""

from __future__ import annotations

import pytest

from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.envs.protocol import ToolCall


def test_single_call_and_text_kept():
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "Alien"}}\n</tool_call><|im_end|>'
    action = parse_hermes_tool_calls(text, strip=("<|im_end|>",))
    assert action.tool_calls == [ToolCall(name="search", arguments={"q": "Alien"})]
    assert action.parse_errors == []
    assert action.text == 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "Alien"}}\n</tool_call>'


def test_multiple_calls_in_order():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> then '
        '<tool_call>{"name": "b", "arguments": {"y": [1, 2]}}</tool_call>'
    )
    action = parse_hermes_tool_calls(text)
    assert [c.name for c in action.tool_calls] == ["a", "b"]
    assert action.tool_calls[1].arguments == {"y": [1, 2]}
    assert action.parse_errors == []


def test_arguments_as_json_string_are_decoded():
    text = '<tool_call>{"name": "f", "arguments": "{\\"k\\": \\"v\\"}"}</tool_call>'
    action = parse_hermes_tool_calls(text)
    assert action.tool_calls == [ToolCall(name="f", arguments={"k": "v"})]


@pytest.mark.parametrize("arguments", ['"arguments": null, ', ""])
def test_missing_or_null_arguments_mean_no_arguments(arguments):
    action = parse_hermes_tool_calls('<tool_call>{' + arguments + '"name": "list_tools"}</tool_call>')
    assert action.tool_calls == [ToolCall(name="list_tools", arguments={})]


def test_invalid_json_reports_position_and_keeps_good_calls():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {"x": }</tool_call>'
        '<tool_call>{"name": "c", "arguments": {}}</tool_call>'
    )
    action = parse_hermes_tool_calls(text)
    assert [c.name for c in action.tool_calls] == ["a", "c"]
    assert len(action.parse_errors) == 1
    error = action.parse_errors[0]
    # In the block's JSON text the value of "x" is missing: column 34 holds the "}" found instead.
    assert error.startswith("tool call 2: invalid JSON")
    assert "line 1 column 34" in error


@pytest.mark.parametrize(
    "body, fragment",
    [
        ('{"arguments": {}}', "no 'name'"),
        ('{"name": 3, "arguments": {}}', "'name' = 3"),
        ('{"name": "  ", "arguments": {}}', "non-empty string 'name'"),
        ('["search", {}]', "must be a JSON object, got an array"),
        ('{"name": "f", "arguments": [1]}', "'arguments' of 'f' must be a JSON object, got an array"),
        ('{"name": "f", "arguments": "not json"}', "is a string that is not valid JSON"),
        ('{"name": "f", "arguments": "[1]"}', "must be a JSON object, got an array"),
    ],
)
def test_malformed_call_is_one_message(body, fragment):
    action = parse_hermes_tool_calls(f"<tool_call>{body}</tool_call>")
    assert action.tool_calls == []
    assert len(action.parse_errors) == 1
    assert action.parse_errors[0].startswith("tool call 1: ")
    assert fragment in action.parse_errors[0]


def test_unclosed_tag_at_end():
    action = parse_hermes_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"')
    assert [c.name for c in action.tool_calls] == ["a"]
    assert action.parse_errors == [action.parse_errors[0]]
    assert action.parse_errors[0].startswith("tool call 2: <tool_call> is never closed")


def test_reopened_block_is_reported_and_next_block_still_parsed():
    action = parse_hermes_tool_calls('<tool_call>{"name": "a"<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [c.name for c in action.tool_calls] == ["b"]
    assert len(action.parse_errors) == 1
    assert "opened again" in action.parse_errors[0]


def test_no_call():
    action = parse_hermes_tool_calls("The answer is Ridley Scott.<|im_end|>", strip=("<|im_end|>",))
    assert action.tool_calls == [] and action.parse_errors == []
    assert action.text == "The answer is Ridley Scott."


@pytest.mark.parametrize(
    "text",
    ["", "</tool_call>", "<tool_call>", "<tool_call></tool_call>", "<tool_call>" + "[" * 100000 + "</tool_call>", "\x00<tool_call>\ud800"],
)
def test_never_raises(text):
    action = parse_hermes_tool_calls(text)
    assert action.tool_calls == []
    assert len(action.parse_errors) == text.count("<tool_call>")
