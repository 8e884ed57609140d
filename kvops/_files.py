"""Output files the command-line tools write: whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from typing import IO, Callable


def read_json_object(path: str) -> dict:
    """The JSON object in `path` (a model's config.json); ValueError saying why it is not one (absent files raise
    FileNotFoundError)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as e:
        line = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise ValueError(f"{path} is not a readable JSON model config ({line})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def writable_target(path: str) -> str | None:
    """Why `path` cannot be written as a new or replaced file (its directory missing or read-only, or it is a
    directory), or None when it can. Creates nothing."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "it is a directory; name the file to write"
    if not os.path.isdir(directory):
        return f"the directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"cannot write in {directory}"
    return None


def write_whole(path: str, write: Callable[[IO], None], binary: bool = True) -> None:
    """Call `write` on a temporary file beside `path`, then rename it over `path`: a failure or an interrupt leaves
    `path` as it was (absent, or the previous file), never a partial one. The file gets the permissions a plain
    open() would give it (mkstemp makes it private)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
