"""Text that is safe to render and tokenize, whatever a model or an environment produced.

A tokenizer encodes UTF-8; a Python `str` can hold code points UTF-8 cannot encode: lone
surrogates (U+D800..U+DFFF), which a model produces by writing the JSON escape `"\\ud83d"` in a
tool argument. An environment that echoes such an argument in an error observation would make
the tokenizer raise and end the episode for no fault of the agent. `valid_text` is applied where
environment text enters the conversation (the agent loop) and where an environment echoes what
the model wrote (`shown`), so every observation is text any tokenizer can encode.
"""

from __future__ import annotations

from typing import Any

__all__ = ["valid_text", "shown"]


def valid_text(text: str) -> str:
    """`text` with every code point UTF-8 cannot encode replaced by U+FFFD.

    Lone surrogates become U+FFFD; a high surrogate followed by a low one becomes the character
    the pair stands for. Text that is already valid is returned as it is (the same object).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # UTF-16 can carry surrogate code points ("surrogatepass"); decoding it back joins valid
        # pairs and replaces the lone ones.
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def shown(value: Any, limit: int = 120) -> str:
    """How a message echoes a value the model wrote: its text (a `str` as is, anything else as
    `repr`), made valid (`valid_text`) and cut to at most `limit` characters, the cut marked
    with how long it was. An enormous argument must not make an enormous observation."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001 - e.g. an int past Python's digit limit has no repr
            text = f"<a {type(value).__name__}>"
    if len(text) > limit:
        # `repr` of an arbitrary object could be huge too; only its head is kept either way.
        text = f"{text[: max(limit - 30, 1)]}... ({len(text)} characters)"
    return valid_text(text)
