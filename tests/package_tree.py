"""The modules of a package folder by dotted name (tests/unit/test_fence.py's import graph and
tests/unit/test_layers.py's floors walk the same tree)."""

from __future__ import annotations

from pathlib import Path


def modules(root: Path, prefix: str) -> dict[str, Path]:
    """Every ``*.py`` under ``root`` (the folder of package ``prefix``) by its dotted name; a
    package's ``__init__.py`` stands for the package."""
    out = {}
    for p in root.rglob("*.py"):
        parts = [prefix, *p.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out
