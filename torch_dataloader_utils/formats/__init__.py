"""File formats, one module each. Adding a format is one module plus one line in ``_FORMATS``."""

from __future__ import annotations

from .arrow import ArrowFormat
from .base import FileFormat, FileMetadata
from .parquet import ParquetFormat

__all__ = ["FileFormat", "FileMetadata", "get_format"]

_FORMATS: dict[str, type[FileFormat]] = {f.name: f for f in (ParquetFormat, ArrowFormat)}


def get_format(name: str) -> FileFormat:
    """The format called ``name``; ``ValueError`` listing the supported ones otherwise."""
    try:
        return _FORMATS[name]()
    except KeyError:
        supported = ", ".join(repr(n) for n in sorted(_FORMATS))
        raise ValueError(f"unknown format {name!r}; supported formats: {supported}") from None
