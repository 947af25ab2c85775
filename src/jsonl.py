"""Reading JSON-lines files (metrics, spike events, caption tables) with errors that name file and line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator


class JsonlError(ValueError):
    """A line that is not a JSON object; the message names the file and the line number."""


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of `path`."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise JsonlError(f"{path}:{number}: malformed JSON line ({err.msg})") from err
            if not isinstance(record, dict):
                raise JsonlError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            yield number, record
