"""What the parts of the CUDA graph splice share: the counters (``stats()``), the lock and the
registries of graphs, the settings that switch patching, verifying and the first-replay check,
whether patching is possible here, and NVTX ranges. Nothing here edits a graph."""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import xmix._C as _C
from xmix import settings

logger = logging.getLogger("vllm.xmix.graphs")
G = _C.graph

_STATS_KEYS = (
    "captured",  # graphs captured through XmixCUDAGraph
    "plain",  # ... with no anchor in them (nothing to do)
    "patched",  # ... spliced (anchors off, per-op nodes)
    "fallback",  # ... the planner could not handle: anchors kept
    "disabled",  # ... left alone because XMIX_GRAPH_PATCH=0
    "errors",  # patch attempts that raised (graph put back as captured)
    "replans",  # graphs re-planned by on_apps_changed
    "reinstantiated",  # ... that needed a new executable graph
    "updated_in_place",  # ... updated with node params / enabled states only
    "toggled_nodes",  # cudaGraphNodeSetEnabled calls from set_app_enabled
    "unhooked_anchors",  # anchors captured into a graph xmix does not keep
    "checks",  # first-replay checks run (XMIX_GRAPH_CHECK)
    "check_passed",  # ... patched graph equal to its anchors
    "check_failed",  # ... different: the graph fell back to its anchors for good
    "check_unverifiable",  # ... could not be compared (nondeterministic, too large): fell back
    "anchors_by_stub",  # anchor nodes recognised by the kernel's host stub ...
    "anchors_by_function",  # ... by its cudaFunction_t
    "anchors_by_kernel",  # ... by its cudaKernel_t
    "anchors_by_name",  # ... by the kernel's (mangled) name only
    "own_exec",  # graphs replaying the applier's own executable graph (torch's was lost)
    "check_skipped",  # first-replay checks not run: enough graphs of this deploy passed
    "custom_not_run",  # replays of a graph without its splice in a step using a user kernel
)


_stats = dict.fromkeys(_STATS_KEYS, 0)


lock = threading.RLock()


capturing: list[Any] = []  # XmixCUDAGraph instances between capture_begin/_end


registry: weakref.WeakSet[Any] = weakref.WeakSet()  # graphs with anchors (patched or not)


planned: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


# The keep-graph CUDAGraph subclass once made (hook.graph_class): graphs of that class bind
# their exec states themselves on instantiate().
graph_cls: type | None = None


def stats() -> dict[str, int]:
    with lock:
        return dict(_stats)


def reset_stats() -> None:
    with lock:
        for k in _stats:
            _stats[k] = 0


def count(key: str, n: int = 1) -> None:
    with lock:
        _stats[key] += n


def patching_enabled() -> bool:
    return bool(settings.get("XMIX_GRAPH_PATCH"))


def verify() -> bool:
    return bool(settings.get("XMIX_GRAPH_VERIFY"))


def check_enabled() -> bool:
    """The first-replay check (module docstring); on unless XMIX_GRAPH_CHECK is 0/off."""
    return bool(settings.get("XMIX_GRAPH_CHECK"))


def cuda_patching_available() -> str | None:
    """None when graphs can be patched here, else why not."""
    if not _C.built_with_cuda():
        return "xmix._C was built without CUDA"
    if not hasattr(G, "GraphPatch"):
        return "xmix._C has no graph applier"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    if not _C.cuda_available():
        return f"xmix._C cannot use the GPU: {_C.cuda_status()}"
    for attr in ("raw_cuda_graph", "raw_cuda_graph_exec", "instantiate"):
        if not hasattr(torch.cuda.CUDAGraph, attr):
            return f"torch {torch.__version__} has no CUDAGraph.{attr} (needs keep_graph support)"
    return None


@contextlib.contextmanager
def nvtx_range(message: str) -> Iterator[None]:
    """An NVTX range in the "xmix" domain (Nsight); free when no tool is attached."""
    push = getattr(G, "nvtx_push", None)
    if push is None:
        yield
        return
    push(message)
    try:
        yield
    finally:
        G.nvtx_pop()
