"""Documents to measure on: the evaluation split's long files by default, or any text
files a user names, tokenized once and checked to be long enough."""

from __future__ import annotations

from pathlib import Path

from runtime import corpus
from runtime.cli import UsageError


def default_documents(split: str, count: int, min_chars: int = 30_000) -> list[Path]:
    docs = corpus.long_documents(split, min_chars)[:count]
    if not docs:
        raise UsageError(f"no {split}-split document of {min_chars}+ characters found under "
                         f"{corpus.STDLIB} — pass --docs FILE ...")
    return docs


def tokenized(encode, paths: list[Path], need: int) -> list[tuple[str, list[int]]]:
    """(name, token ids) per file; a file shorter than `need` tokens is refused by name."""
    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise UsageError(f"document {path} does not exist")
        try:
            ids = encode(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UsageError(f"document {path} is not UTF-8 text") from None
        if len(ids) < need:
            raise UsageError(f"document {path} has {len(ids)} tokens; the longest context asked "
                             f"for needs {need}")
        out.append((path.name, ids))
    return out
