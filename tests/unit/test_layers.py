"""The package's floors (docs/architecture.md, "Layout: rooms on floors"): every import, function-
level ones included, goes to the importer's own floor or one below it. The floors are written
here as the document gives them, not read from the code."""

from __future__ import annotations

import ast
from pathlib import Path

from package_tree import modules

PKG = Path(__file__).resolve().parents[2] / "python" / "xmix"

# ground first; a module belongs to the floor of the longest prefix that names it
FLOORS = [
    ["xmix.settings", "xmix.version", "xmix._C"],
    ["xmix.lang", "xmix.models"],
    ["xmix.runtime", "xmix.interop"],
    ["xmix.integrations"],
    ["xmix.capture_run"],
    ["xmix"],  # the package's face
    ["xmix.apps", "xmix.demo"],
    ["xmix.cli"],
]
V = "xmix.integrations.vllm"
VLLM_FLOORS = [
    [f"{V}.{m}" for m in ("fence", "errors", "enable", "support", "request_controls")]
    + [f"{V}.{m}" for m in ("result_keys", "keyed", "tenants", "state_dir", "")],
    [f"{V}.worker"],
    [f"{V}.frontend"],
    [f"{V}.http"],
    [f"{V}.plugin", f"{V}.llm"],
]


def floor_of(module: str, floors: list[list[str]]) -> int | None:
    best, best_len = None, -1
    for i, names in enumerate(floors):
        for n in names:
            n = n.rstrip(".")
            if (module == n or module.startswith(n + ".")) and len(n) > best_len:
                best, best_len = i, len(n)
    return best


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the package that ``name`` imports (``from xmix import App`` is the face,
    ``from xmix.lang import api`` the module ``xmix.lang.api``)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "xmix"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_pkg else name.rsplit(".", 1)[0]
                pkg = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1])
                base = f"{pkg}.{base}" if base else pkg
            if base.split(".")[0] != "xmix":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known or sub == "xmix._C" else base)
    return out


def upward(root: Path, prefix: str = "xmix") -> list[str]:
    mods = modules(root, prefix)
    bad = []
    for name, path in sorted(mods.items()):
        for target in sorted(imports(name, path, set(mods))):
            for floors in (FLOORS, VLLM_FLOORS):
                a, b = floor_of(name, floors), floor_of(target, floors)
                if a is not None and b is not None and b > a:
                    bad.append(f"{name} -> {target}")
                    break
    return bad


def test_no_import_runs_back_up():
    assert upward(PKG) == []


def test_every_module_has_a_floor():
    # a new top-level module or vLLM-side package must be placed in the table above
    mods = modules(PKG, "xmix")
    assert [m for m in mods if floor_of(m, FLOORS) is None] == []
    assert [m for m in mods if m.startswith(V + ".") and floor_of(m, VLLM_FLOORS) is None] == []


def test_the_check_sees_an_import_that_runs_back_up(tmp_path):
    pkg = tmp_path / "xmix"
    for d in ("lang", "runtime", "integrations/vllm/worker", "integrations/vllm/http"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from xmix.lang.api import App\n")
    (pkg / "lang" / "api.py").write_text("def f():\n    from xmix.runtime import ops\n")
    (pkg / "runtime" / "ops.py").write_text("import xmix._C as _C\nfrom xmix.lang import api\n")
    (pkg / "integrations/vllm/worker/worker.py").write_text(
        "from xmix.integrations.vllm.http import server\n"
    )
    (pkg / "integrations/vllm/http/server.py").write_text("from xmix import App\n")
    assert upward(pkg) == [
        "xmix.integrations.vllm.http.server -> xmix",
        "xmix.integrations.vllm.worker.worker -> xmix.integrations.vllm.http.server",
        "xmix.lang.api -> xmix.runtime.ops",
    ]
