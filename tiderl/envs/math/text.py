"""Text hygiene shared by the math environment's observations and logs."""

from __future__ import annotations


def clean_text(text: str, limit: int = 0) -> str:
    """`text` as valid UTF-8 text (lone surrogates become '?'), cut to `limit` characters with
    a note when `limit` > 0 and it is longer."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    if limit > 0 and len(text) > limit:
        return text[:limit] + f"... [cut: {len(text) - limit} more characters]"
    return text
