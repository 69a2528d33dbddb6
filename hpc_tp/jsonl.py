"""JSON-lines files (one object per line: metrics logs, prompt and input batches), read with
errors that name the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError


def read_json_lines(path, what: str) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; ``what`` names the file in errors, e.g. "--prompts"."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what} {path}:{number}: not a JSON line ({e.msg})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{what} {path}:{number}: expected a JSON object, got {type(value).__name__}")
        rows.append((number, value))
    return rows
