"""CUDA graph interposition: keep the graphs vLLM captures, splice per-op kernel nodes in place
of the self-dispatching site anchors, and switch them between steps.

What runs when (docs/cuda_graphs.md has the full design):

- capture: ``torch.ops.xmix.site`` launches one anchor kernel per site; the graph is an
  ``XmixCUDAGraph`` (a ``torch.cuda.CUDAGraph`` with ``keep_graph=True``) and counts them.
- right after capture (``capture_end``): ``_C.graph`` reads the cudaGraph_t, the planner
  decides the splice against the control block's site program, the applier performs it,
  then the graph is instantiated and the exec states are pushed (anchors off, op nodes on
  for apps whose mode is not "off").
- between steps, never while a graph runs:
  ``set_app_enabled`` / ``set_mode``  -> cudaGraphNodeSetEnabled on the app's nodes;
  ``on_apps_changed`` (after deploy/undeploy) -> re-plan; re-instantiate only where the
  topology changed, else cudaGraphExecKernelNodeSetParams in place;
  ``ensure_current`` -> the same, only when the control block's op list changed (O(1) else).
  Scalar parameters and built-in artifacts live in the control block: changing them needs
  no graph update at all.

A graph the planner cannot handle, or whose patched form the driver refuses to
instantiate (at capture or at a re-plan), keeps its anchors, which are correct on their own:
it is logged and counted (``stats()["fallback"]``), never wrong. ``XMIX_GRAPH_PATCH=0``
turns patching off (every graph keeps its anchors). ``XMIX_GRAPH_VERIFY=1`` reads every
patched graph back and compares it with the plan.

First-replay check (``XMIX_GRAPH_CHECK``, on by default until the GPU check of
docs/cuda_graphs.md has passed on a device): the first replay of a patched graph in a step
where one of its spliced apps runs replays it twice, patched and then in its anchor
configuration (anchors on, built-in ops' nodes off, user kernels' nodes as they were: the
anchor cannot run those), from the same snapshot of the graph's memory pool and of the
control block's stateful buffers. The anchors' replay is the one served. Any difference
puts the graph back as captured for good (``stats()["check_failed"]``, or
``"check_unverifiable"`` when two anchor replays differ themselves or the snapshot does not
fit in ``XMIX_GRAPH_CHECK_MAX_MB``). At most ``XMIX_GRAPH_CHECK_GRAPHS`` graphs are checked
per deploy: once that many passed, the deploy's other graphs replay unchecked
(``"check_skipped"``); after a failure, every graph of the deploy is checked. Assumption:
what the graph writes outside its pool and the control block (the KV cache) is the same on a
second replay of the same inputs.

A graph that replays its anchors (patching off, a refused patch) cannot run user kernels: in
a step where such a graph holds the site of an app's user kernel, the app's requests fail
with that reason (``"custom_not_run"``) instead of being answered without the kernel.

The package's rooms, in import order (each imports only those above it):

- ``state``: counters (``stats()``), the lock and registries, the settings that switch it all;
- ``splice``: the planner's view of the control block (``program_for``), capture-time notes,
  patch (read -> plan -> apply in ``_C.graph``) and instantiation with its fallbacks;
- ``check``: the first-replay check;
- ``replan``: between steps (``on_apps_changed``, ``set_mode``, ``ensure_current``);
- ``hook``: ``XmixCUDAGraph`` and the redirect of vLLM's capture sites.

This module is the package's interface: the names below are what the worker, the GPU check
and the docs call.
"""

from xmix.runtime.graphs.hook import (
    VLLM_CAPTURE_MODULES,
    graph_class,
    install_capture_hook,
    uninstall_capture_hook,
)
from xmix.runtime.graphs.replan import (
    ensure_current,
    on_apps_changed,
    refresh_params,
    set_app_enabled,
    set_mode,
)
from xmix.runtime.graphs.splice import is_gated, kept_graphs, patch, program_for
from xmix.runtime.graphs.state import (
    check_enabled,
    cuda_patching_available,
    nvtx_range,
    patching_enabled,
    reset_stats,
    stats,
)

__all__ = [
    "VLLM_CAPTURE_MODULES",
    "check_enabled",
    "cuda_patching_available",
    "ensure_current",
    "graph_class",
    "install_capture_hook",
    "is_gated",
    "kept_graphs",
    "nvtx_range",
    "on_apps_changed",
    "patch",
    "patching_enabled",
    "program_for",
    "refresh_params",
    "reset_stats",
    "set_app_enabled",
    "set_mode",
    "stats",
    "uninstall_capture_hook",
]
