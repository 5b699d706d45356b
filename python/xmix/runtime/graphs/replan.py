"""Between steps, never while a graph runs: re-plan the kept graphs after a deploy or undeploy
(in place where the splice's shape did not change), and switch an app's nodes on a mode change."""

from __future__ import annotations

from xmix.runtime.graphs.splice import (
    arm_check,
    exec_of,
    fingerprint,
    instantiate_captured,
    instantiate_or_fall_back,
    kept_graphs,
    program_for,
    update,
)
from xmix.runtime.graphs.state import count, logger, nvtx_range, planned


def on_apps_changed(cb) -> dict[str, int]:
    """After install/remove on the control block: re-plan every kept graph. Graphs whose
    splice shapes did not change are updated in place; the others are re-spliced and
    re-instantiated (no recapture). Waits for the device first: re-instantiation destroys
    executable graphs, and a graph with IF nodes may have only one instance. A graph the
    first-replay check refused keeps its anchors."""
    import torch

    graphs = [g for g in kept_graphs(cb) if not getattr(g, "_xmix_refused", None)]
    out = {"graphs": len(graphs), "reinstantiated": 0, "in_place": 0, "fallback": 0, "errors": 0}
    planned[cb] = fingerprint(cb)
    if not graphs:
        return out
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prog = program_for(cb)
    with nvtx_range(f"xmix.replan {len(graphs)} graphs"):
        for g in graphs:
            prog.expected_anchors = getattr(g, "_xmix_expected", -1)
            count("replans")
            try:
                plan, needs = update(g._xmix, prog, exec_of(g))
            except Exception as e:
                if "could not be put back" in str(e):
                    raise  # the template is half-edited: replaying it would be wrong
                logger.warning("xmix: re-planning a CUDA graph failed, its anchors run: %s", e)
                count("errors")
                out["errors"] += 1
                g._xmix_state = "fallback"
                g._xmix_check_due = False
                instantiate_captured(g, g._xmix)  # the applier put it back as captured
                continue
            if plan.fallback:
                out["fallback"] += 1
                g._xmix_state = "fallback"
                g._xmix_check_due = False
            else:
                g._xmix_state = "patched"
                if not plan.is_noop():
                    arm_check(g, plan)
            if needs:
                if instantiate_or_fall_back(g, first=False):
                    out["reinstantiated"] += 1
                    count("reinstantiated")
                else:
                    out["fallback"] += 1
                    out["errors"] += 1
            else:
                out["in_place"] += 1
                count("updated_in_place")
    return out


def set_app_enabled(cb, app_index: int, enabled: bool) -> int:
    """Switch one app's spliced nodes in every kept executable graph; returns the number of
    nodes set. Correctness never depends on it (the kernels read the app's mode from the
    control block); it is what makes an app that is off cost nothing."""
    if not 0 <= app_index < cb.cap.max_apps:
        raise ValueError(f"app index {app_index} out of range")
    n = 0
    with nvtx_range(f"xmix.toggle app {app_index} {'on' if enabled else 'off'}"):
        for g in kept_graphs(cb):
            exec_ = exec_of(g)
            n += g._xmix.set_app_enabled(exec_, app_index, bool(enabled))
    count("toggled_nodes", n)
    return n


def set_mode(cb, name: str, mode: str) -> int:
    """cb.set_mode plus the matching node switch in every kept graph."""
    cb.set_mode(name, mode)
    inst = cb.apps[name]
    with nvtx_range(f"xmix.mode {name}={mode}"):
        n = set_app_enabled(cb, inst.index, mode != "off")
    prev = planned.get(cb)
    if prev is not None and prev[0] == cb.mem.ops_generation:
        planned[cb] = fingerprint(cb)
    return n


def refresh_params(cb, app_index: int) -> int:
    """Re-send the kernel parameters of an app's top-level spliced nodes to every executable
    graph (cudaGraphExecKernelNodeSetParams). Built-in ops read their parameters and
    artifacts from the control block, so this is only needed when node arguments changed
    outside a re-plan; on_apps_changed already re-points what moved."""
    n = 0
    for g in kept_graphs(cb):
        exec_ = exec_of(g)
        if exec_:
            n += g._xmix.refresh_app_params(exec_, app_index)
    return n


def ensure_current(cb) -> bool:
    """Call once per step before replaying graphs: re-plans when the control block's op list
    changed since the last plan (stale op nodes would run the wrong ops), and switches nodes
    when app modes changed. O(number of apps) when nothing changed. True if it did work."""
    fp = fingerprint(cb)
    prev = planned.get(cb)
    if prev == fp:
        return False
    if prev is None or prev[0] != fp[0]:
        on_apps_changed(cb)
        return True
    old = dict(prev[1])
    for index, mode in fp[1]:
        if old.get(index) != mode:
            set_app_enabled(cb, index, mode != "off")
    planned[cb] = fp
    return True
