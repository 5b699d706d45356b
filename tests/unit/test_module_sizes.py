"""The package keeps one job per module (issue 30, item 2): no module in ``python/xmix`` over
900 lines and no class over 400, counted from the source with ``ast`` (no import, no engine),
so a room that grows past them fails here, naming the file and the class."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "python" / "xmix"
MAX_MODULE_LINES = 900
MAX_CLASS_LINES = 400


def oversized(root: Path) -> list[str]:
    """Every module over MAX_MODULE_LINES lines (as ``wc -l`` counts) and every class, nested
    ones included, over MAX_CLASS_LINES, as "path: what"."""
    big = []
    for f in sorted(root.rglob("*.py")):
        text = f.read_text(encoding="utf-8")
        name = f.relative_to(root.parent)
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text, filename=str(f))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    big.append(f"{name}: class {node.name} {n} lines")
    return big


def test_the_walk_sees_the_package():
    # An empty walk would pass vacuously: the package's own modules must be in it.
    files = {str(f.relative_to(PKG)) for f in PKG.rglob("*.py")}
    assert {
        "lang/api.py",
        "lang/lowering/__init__.py",
        "runtime/control/block.py",
        "runtime/graphs/__init__.py",
    } <= files


def test_no_module_over_900_lines_no_class_over_400():
    big = oversized(PKG)
    assert not big, "split along the module's seams (docs/architecture.md): " + "; ".join(big)


def test_the_limits_are_counted_as_wc_and_nested_classes_count(tmp_path):
    pkg = tmp_path / "xmix"
    pkg.mkdir()
    (pkg / "ok.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (pkg / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    body = "".join(f"        a{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    (pkg / "nested.py").write_text("class Outer:\n    class Inner:\n" + body)
    assert oversized(pkg) == [
        f"xmix/long.py: {MAX_MODULE_LINES + 1} lines",
        f"xmix/nested.py: class Outer {MAX_CLASS_LINES + 2} lines",
        f"xmix/nested.py: class Inner {MAX_CLASS_LINES + 1} lines",
    ]
