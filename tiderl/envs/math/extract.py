"""Final-answer extraction from a model's text: boxed first, then plain markers.

Rules, in order (the first that finds something wins):

1. `boxed`: the content of the last complete `\\boxed{...}` (or `\\fbox{...}`), braces balanced;
   escaped braces `\\{` `\\}` are literal and do not open or close a group. An unbalanced
   `\\boxed{` is ignored.
2. `final_answer`: the rest of the line after the last `Final Answer:` (any case).
3. `hash`: the rest of the line after the last `####` (GSM8K's marker).
4. `last_number`, only when asked for (`fallback="last_number"`): the last number in the text
   (thousands separators dropped), for models that answer in a sentence without a marker
   ("One times 419 is 419.").

A cut answer (`cut=True`: the turn reached its token limit, `Action.cut`) may stop mid-line:
rules 2 and 3 then count only a line the model finished (a newline follows it), and rule 4 is not
used, since the last number of an unfinished text is usually a step of working ("775 / 100 = 7"
at the cut), not an answer. A complete `\boxed{}` counts either way.

Surrounding `$`, spaces and a trailing full stop are stripped. The scan is one linear pass,
so enormous or deeply nested text costs time proportional to its length only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tiderl.envs.math.registration import FALLBACKS

_FINAL_ANSWER = re.compile(r"final\s*answer\s*[:：]\s*([^\n]*)", re.IGNORECASE)
_HASH_ANSWER = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Extracted:
    """The answer text (None when there is none) and which rule found it
    ("boxed", "final_answer", "hash", "last_number" or "none")."""

    answer: str | None
    source: str

    @property
    def boxed(self) -> bool:
        return self.source == "boxed"


_TOKENS = re.compile(r"\\(?:boxed\{|fbox\{|.)|[{}]", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}`/`\\fbox{...}` in `text` (the one closed
    last, so an outer box wins over a box nested in it), or None."""
    stack: list[tuple[int, bool]] = []  # (content start, is a box)
    best: tuple[int, int] | None = None
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token == "{" or (token.endswith("{") and token[1:-1] in ("boxed", "fbox")):
            stack.append((match.end(), token != "{"))
        elif token == "}" and stack:
            start, is_box = stack.pop()
            if is_box:
                best = (start, match.start())
        # any other token is an escaped character (\{, \}, \\): it never opens or closes a group
    return None if best is None else text[best[0]:best[1]]


def _tidy(answer: str) -> str:
    answer = answer.strip().rstrip(".").strip().strip("$").strip()
    return answer[:-1].rstrip() if answer.endswith(".") else answer


def extract_answer(text: str, fallback: str = "none", cut: bool = False) -> Extracted:
    """The final answer in `text` by the module's rules; `fallback` is "none" or "last_number"
    (rule 4); `cut`: the text was cut at a token limit (only finished lines count, no rule 4)."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    boxed = last_boxed(text)
    if boxed is not None:
        return Extracted(_tidy(boxed), "boxed")
    for source, pattern in (("final_answer", _FINAL_ANSWER), ("hash", _HASH_ANSWER)):
        last = None
        for match in pattern.finditer(text):
            if not cut or match.end() < len(text):  # a cut text's last line may be unfinished
                last = match
        if last is not None and _tidy(last.group(1)):
            return Extracted(_tidy(last.group(1)), source)
    if fallback == "last_number" and not cut:
        number = None
        for number in _NUMBER.finditer(text):
            pass
        if number is not None:
            return Extracted(number.group().replace(",", ""), "last_number")
    return Extracted(None, "none")
