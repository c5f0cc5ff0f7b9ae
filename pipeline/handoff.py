"""Versioned JSON hand-off files between stages: each typed file's ``save``/``load`` go here."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pipeline.errors import LowbitError
from pipeline.io import write_json

T = TypeVar("T")


def resolve(path_or_dir: str | Path, filename: str) -> Path:
    """``path_or_dir`` itself, or ``filename`` inside it when it is a directory."""
    path = Path(path_or_dir)
    return path / filename if path.is_dir() else path


def save(path: Path, schema: str, version: int, data: dict[str, Any]) -> None:
    """Write ``data`` atomically, headed by its schema name and version."""
    write_json(path, {"schema": schema, "schema_version": version, **data}, indent=1)


def load(path: Path, schema: str, version: int, writer: str, build: Callable[[dict], T]) -> T:
    """``build`` of the file's fields; no version means 1 (older files), newer ones are refused."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise LowbitError(f"cannot read {path} ({err}); rerun the {writer} stage") from None
    if not isinstance(data, dict):
        raise LowbitError(f"{path} is malformed (not a JSON object); rerun the {writer} stage")
    found, v = data.pop("schema", schema), data.pop("schema_version", 1)
    if found != schema:
        raise LowbitError(f"{path} is a {found} file, not {schema}; rerun the {writer} stage")
    if not isinstance(v, int) or v < 1:
        raise LowbitError(
            f"{path} has schema version {v!r}, which no lowbit writes; rerun the {writer} stage"
        )
    if v > version:
        raise LowbitError(
            f"{path} is {schema} version {v}, newer than this lowbit reads ({version}): "
            f"upgrade lowbit, or rerun the {writer} stage with this one"
        )
    try:
        return build(data)
    except (KeyError, TypeError, ValueError) as err:
        raise LowbitError(f"{path} is malformed ({err!r}); rerun the {writer} stage") from None


class HandOff:
    """Base of a typed hand-off file: ``save``/``load`` through its ``to_dict``/``from_dict``."""

    FILENAME: ClassVar[str]
    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    WRITER: ClassVar[str]  # the stage that writes it: the one a bad file asks to rerun

    @classmethod
    def path(cls, path_or_dir: str | Path) -> Path:
        return resolve(path_or_dir, cls.FILENAME)

    def save(self, path_or_dir: str | Path) -> Path:
        path = self.path(path_or_dir)
        save(path, self.SCHEMA, self.VERSION, self.to_dict())
        return path

    @classmethod
    def load(cls: type[T], path_or_dir: str | Path) -> T:
        return load(cls.path(path_or_dir), cls.SCHEMA, cls.VERSION, cls.WRITER, cls.from_dict)
