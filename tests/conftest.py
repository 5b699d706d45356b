"""Tests, grouped by what they need (a module sits in the group of its most demanding test):

- unit/: no vLLM engine (kernels on CPU, the planner, app files, transformers models);
  tests parametrized over "cuda" are marked ``gpu`` and skip without one
- engine/: start an offline vLLM engine (``vllm.LLM`` / ``xmix.LLM``) on the tiny models
- server/: start an HTTP server (``xmix serve`` / ``vllm serve``)
- gpu/: every test needs a CUDA GPU
- cpp/: GoogleTest (ctest)

The shared helpers (harness, engine_util, serve_util, xmix_faults, fake_device,
apps_oracle) stay here, imported as top-level modules: tests/ goes on sys.path below, and engine
worker processes (spawned) inherit that path, so ``worker_extension_cls="xmix_faults..."``
resolves there too. The group folders go on it as well: some modules reuse another's building
blocks across groups (test_results_server takes test_results_engine's kernel, test_fuzz_http
test_app_files_hostile's cases), whichever subset of files a run collects.
"""

import functools
import os
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, *(_HERE / g for g in ("unit", "engine", "server", "gpu"))):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM's CPU worker pins itself to one core by default (VLLM_CPU_OMP_THREADS_BIND=auto keeps
# the last core for the frontend, so on a 2-core machine every engine's worker, its compiles
# included, runs on core 0): the two pytest-xdist workers' engines took turns on one core
# while the other waited on the API servers. Unpinned and one thread each, the OS spreads
# them: two engine modules side by side took 61 and 64 s instead of 91 and 99 s here
# (2026-12-03). Tests of several ranks set their own lists ("0|1"); an operator's setting wins.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    import xmix._C as C

    if not C.built_with_cuda():
        return "xmix._C was built without CUDA"
    if not C.cuda_available():
        return f"xmix._C cannot use the GPU: {C.cuda_status()}"
    return None


@functools.cache
def _uses_apps_oracle(path: str) -> bool:
    try:
        return "apps_oracle" in (_HERE.parent / path).read_text(encoding="utf-8")
    except OSError:
        return False


def _scope(path: str) -> str:
    return "apps_oracle" if _uses_apps_oracle(path) else path


# Seconds each scope took (setup + calls + teardown, `scripts/test.sh --durations=0` in a fresh
# clone, 2026-12-03, this project's 2-core machine, engines still pinned), for the scopes over
# ~40 s; test_models_moe, the paper apps and test_do_no_harm at their size after that day's
# cuts (measured or estimated); test_engine_graph_tp's figure predates its cut. The next run,
# with the cuts and unpinned engines, took 3 806 s over all scopes against 5 801 (41.2 min for
# the whole command; test_engine 385 s, test_bench_serve 181). The run hands them out
# longest first, so the last minutes are short unit modules on both workers; xdist's own
# order (most tests first) left the few-test, minutes-long server benchmarks for last, one
# worker running them for ~6 min while the other idled. Only the order uses these figures:
# a module missing here or grown since still runs, after the listed ones. test_engine and
# test_do_no_harm: estimated after the cuts of 2026-12-03 (third session).
SCOPE_SECONDS = {
    "tests/engine/test_engine.py": 420,
    "tests/engine/test_models_engine.py": 420,
    "tests/server/test_multi_node.py": 400,
    "tests/engine/test_do_no_harm.py": 200,
    "tests/server/test_bench_serve.py": 370,
    "tests/engine/test_engine_graph_tp.py": 360,
    "tests/engine/test_models_moe.py": 340,
    "apps_oracle": 280,
    "tests/server/test_scale_out.py": 250,
    "tests/server/test_fuzz_http.py": 170,
    "tests/server/test_server.py": 160,
    "tests/engine/test_pipeline_parallel.py": 160,
    "tests/engine/test_results_engine.py": 150,
    "tests/server/test_state_restart.py": 150,
    "tests/server/test_soak.py": 120,
    "tests/server/test_console.py": 110,
    "tests/engine/test_kv_connector.py": 100,
    "tests/server/test_openai_client.py": 80,
    "tests/server/test_tenants.py": 80,
    "tests/server/test_faults_http.py": 80,
    "tests/engine/test_support.py": 80,
    "tests/engine/test_sae_engine.py": 70,
    "tests/server/test_results_server.py": 70,
    "tests/engine/test_import_vectors.py": 60,
    "tests/engine/test_request_controls.py": 50,
    "tests/engine/test_live_changes.py": 50,
    "tests/engine/test_engine_preempt.py": 50,
    "tests/unit/test_hf.py": 50,
    "tests/engine/test_faults.py": 50,
    "tests/engine/test_state_offline.py": 50,
}


def _make_scheduler(config, log):
    """scripts/test.sh runs two pytest-xdist workers. Each takes a test module whole, so its
    module-scoped engine starts once; the modules on the paper-app engines that
    tests/apps_oracle.py keeps for the session go to one worker together. (xdist's own
    ``--dist loadgroup`` cannot do this under pytest 9.2: it renames ``item._nodeid``, which
    pytest no longer reads.) Scopes are handed out in collection order, which
    ``pytest_collection_modifyitems`` sorts longest first (``SCOPE_SECONDS``)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the collection's (longest-first) order

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid.split("::", 1)[0])

    return ByModule(config, log)


try:  # the hook exists only with pytest-xdist (the test extra); plain pytest runs without it
    import xdist  # noqa: F401

    pytest_xdist_make_scheduler = _make_scheduler
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    # longest scopes first (a stable sort: the order within and among the rest stays)
    items.sort(key=lambda it: -SCOPE_SECONDS.get(_scope(it.nodeid.split("::", 1)[0]), 0))
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test skipped: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
