"""The splice of one graph: the planner's view of the control block (``program_for``), the
notes taken while a graph is captured, and right after capture read -> plan -> apply
(``_C.graph``'s ``GraphPatch``) and the careful instantiation of the result, falling back to the
graph as captured (its anchors) wherever the planner or the driver refuses."""

from __future__ import annotations

from typing import Any

from xmix.lang import conditions as C
from xmix.runtime.graphs import state
from xmix.runtime.graphs.state import (
    G,
    capturing,
    check_enabled,
    count,
    lock,
    logger,
    nvtx_range,
    patching_enabled,
    registry,
    verify,
)

_warned_unhooked = False


def is_gated(op) -> bool:
    """Whether a lowered op gets an IF conditional node: a write whose condition reads an
    activation (a gate on an earlier read, or a request latch). Those are often false for a
    whole batch, so skipping the op's launch pays. Token conditions (prompt, last_token,
    token sets, spans) hold for some token of almost every batch: a gate kernel there would
    cost a launch and save none. Reads are never wrapped: an unselected read must still write
    NaN to its result rows, or a later gate and the drain would see stale values."""
    if op.primitive != "write" or op.cond is None:
        return False
    return any(isinstance(n, (C.Gate, C.Latch)) for n in C.walk(op.cond))


def _custom_args(cb, lo) -> Any:
    a = G.CustomArgs()
    a.kernel = int(lo.fn)
    a.tok_slot = cb.dev["tok_slot"].data_ptr()
    a.tok_pos = cb.dev["tok_pos"].data_ptr()
    a.slot_params = cb.dev["slot_params"].data_ptr()
    a.n_params = cb.cap.max_params
    a.param_base = lo.param_col
    art = lo.artifacts.get("a0")
    a.artifact = art.data_ptr() if art is not None else 0
    a.artifact_numel = int(art.numel()) if art is not None else 0
    sel, out = cb.custom.select, cb.custom.out
    a.select = sel.data_ptr() if sel is not None else 0
    a.out = out.data_ptr() if out is not None else 0
    return a


def program_for(cb, expected_anchors: int = -1, use_conditionals: bool | None = None):
    """The planner's view of the control block: per site, its ops in order with (app,
    enabled = mode is not "off", gated, custom)."""
    if use_conditionals is None:
        use_conditionals = bool(getattr(G, "conditionals_supported", lambda: False)())
    ops = []
    for site, lst in enumerate(cb.mem.site_ops):
        for k, so in enumerate(lst):
            inst, o = so.inst, so.op
            custom = o.kernel == "custom"
            spec = G.OpSpec(
                site, k, inst.index, enabled=inst.mode != "off", gated=is_gated(o), custom=custom
            )
            if custom:
                spec.custom_args = _custom_args(cb, so.linked)
            ops.append(spec)
    return G.Program(cb.ptr, cb.n_sites, ops, expected_anchors, use_conditionals)


def fingerprint(cb) -> tuple:
    # ops_generation, not id() of the op list: CPython reuses a freed list's address, so an
    # undeploy + deploy between two steps could look like no change.
    return (cb.mem.ops_generation, tuple(sorted((a.index, a.mode) for a in cb.apps.values())))


class _Recorder:
    """``cb.graph_hook``: xmix.runtime.ops calls note_anchor for every anchor launched while a
    stream is capturing. The count lets the patcher check that it found every anchor."""

    def note_anchor(self, site, h, r, n, d, sh, sr, dt) -> None:
        global _warned_unhooked
        with lock:
            cap = list(capturing)
            for g in cap:  # with several captures under way, every one may hold the site
                g._xmix_sites.add(int(site))
            if len(cap) == 1:
                cap[0]._xmix_anchors += 1
                return
            if len(cap) > 1:
                for g in cap:  # cannot tell which capture this anchor went to
                    g._xmix_counted = False
                return
            count("unhooked_anchors")
            warn = not _warned_unhooked
            _warned_unhooked = True
        if warn:
            logger.warning(
                "xmix: a hook site was captured into a CUDA graph that xmix does not "
                "keep (was install_capture_hook() called before capture?); such "
                "graphs run their self-dispatching anchors: correct, not free"
            )


RECORDER = _Recorder()


def begin_capture(g) -> None:
    from xmix.runtime import ops

    g._xmix_anchors = 0
    g._xmix_counted = True
    g._xmix_sites = set()
    cb = ops.get_control()
    if cb is not None:
        cb.graph_hook = RECORDER
    with lock:
        capturing.append(g)


def end_capture(g) -> None:
    with lock:
        if g in capturing:
            capturing.remove(g)


def exec_of(g) -> int:
    """The executable graph a graph replays: torch's, or the applier's own (_lost)."""
    own = g.__dict__.get("_xmix_own_exec", 0)
    if own:
        return int(own)
    try:
        return int(g.raw_cuda_graph_exec())
    except RuntimeError:
        return 0


def after_capture(g) -> None:
    """Patch a freshly captured graph, then instantiate it (keep_graph defers that to us)."""
    from xmix.runtime import ops

    count("captured")
    cb = ops.get_control()
    expected = g._xmix_anchors if g._xmix_counted else -1
    if cb is None or expected == 0:
        count("plain")
        g._xmix_state = "plain"
        g.instantiate()
        return
    if not patching_enabled():
        count("disabled")
        g._xmix_state = "disabled"
        g.instantiate()
        return
    with nvtx_range(f"xmix.capture patch ({expected} anchors)"):
        state = _patch_new(g, cb, expected)
    g._xmix_state = state
    if state != "plain":
        with lock:
            registry.add(g)
    instantiate_or_fall_back(g, first=True)


def _patch_new(g, cb, expected: int) -> str:
    g._xmix_check_due = False
    try:
        rec = G.GraphPatch(int(g.raw_cuda_graph()))
    except Exception as e:  # noqa: BLE001 - any failure leaves the captured graph as it is
        count("errors")
        count("fallback")
        logger.warning("xmix: cannot keep this CUDA graph (%s); its anchors stay", e)
        return "fallback"
    g._xmix = rec
    g._xmix_expected = expected
    g._xmix_cb = cb.ptr
    try:
        plan, _ = update(rec, program_for(cb, expected), 0)
    except Exception as e:  # noqa: BLE001 - the applier put the graph back as captured
        if "could not be put back" in str(e):
            raise  # the template is half-edited: instantiating it would be wrong
        count("errors")
        count("fallback")
        logger.warning("xmix: patching a CUDA graph failed, its anchors stay: %s", e)
        return "fallback"
    _note_anchor_forms(rec)
    if plan.n_anchors == 0 and not plan.splices:
        g._xmix = None
        count("plain")
        return "plain"
    if plan.fallback:
        count("fallback")
        logger.warning(
            "xmix: CUDA graph with %d anchors not patched: %s (anchors stay; correct, not free)",
            plan.n_anchors,
            plan.reason,
        )
        return "fallback"
    count("patched")
    arm_check(g, plan)
    logger.debug("xmix: patched CUDA graph: %d anchors, %d op nodes", plan.n_anchors, len(plan.add))
    return "patched"


_ANCHOR_FORMS = ("stub", "function", "kernel", "name")


_forms_logged: set[str] = set()


def _note_anchor_forms(rec) -> None:
    """Count how the applier recognised this graph's anchor nodes, and say it once per form:
    a driver that reports kernel nodes in an unexpected form shows up in the log."""
    forms = getattr(rec, "anchor_forms", None)
    if not forms:
        return
    for form in _ANCHOR_FORMS:
        n = int(forms.get(form, 0))
        if not n:
            continue
        count(f"anchors_by_{form}", n)
        if form not in _forms_logged:
            _forms_logged.add(form)
            logger.info(
                "xmix: CUDA graph anchor nodes recognised by their %s%s",
                form,
                " (kernel name lookup: the function handle matched none of ours)"
                if form == "name"
                else "",
            )


def update(rec, prog, exec_: int):
    """read -> plan -> apply; with XMIX_GRAPH_VERIFY a graph that does not read back as
    planned is put back as captured (returns the fallback plan)."""
    plan, needs, mismatch = rec.update(prog, exec_, verify())
    if not mismatch:
        return plan, needs
    count("errors")
    logger.error(
        "xmix: patched graph does not match its plan; putting it back as captured:\n%s", mismatch
    )
    fb = G.fallback_plan(rec.read(), "the graph read back differs from the plan")
    rec.apply(fb, 0)
    return fb, True


def instantiate_or_fall_back(g, first: bool) -> bool:
    """Instantiate a patched graph (after capture, or after a re-plan changed its topology);
    if the driver refuses the spliced graph, put it back as captured and instantiate that.
    Returns False when it fell back.

    torch's instantiate() destroys the graph's executable graph before it makes the new one
    and, when the driver refuses the new one, keeps the destroyed handle as its own
    (has_graph_exec_ stays true: aten/src/ATen/cuda/CUDAGraph.cpp), so a second instantiate()
    would destroy it again and raise into the step. The applier therefore instantiates every
    template on trial first (same flags, result destroyed); only a template the driver accepts
    reaches torch."""
    rec = getattr(g, "_xmix", None)
    if rec is None:
        _instantiate(g)
        return True
    why = _trial(g, rec)
    if not why:
        _instantiate_checked(g, rec)
        return True
    count("errors")
    logger.error(
        "xmix: the driver refuses the patched CUDA graph %s (%s); its anchors stay",
        "after capture" if first else "after a re-plan",
        why,
    )
    rec.apply(G.fallback_plan(rec.read(), f"instantiation of the patched graph failed: {why}"), 0)
    if first and g._xmix_state == "patched":
        count("patched", -1)
    count("fallback")
    g._xmix_state = "fallback"
    g._xmix_check_due = False
    instantiate_captured(g, rec)
    return False


def _trial(g, rec) -> str:
    """The driver's answer to the template on trial (empty: accepted). A template with
    conditional nodes (a gated op's IF, parked or live, stays for the graph's life) may have
    one executable graph at a time, so while torch's exists the trial is refused whatever the
    template (cudaErrorNotSupported: the first H200 run, 2026-12-04, failed every re-plan of a
    gated graph so). Then torch's instantiate(), which destroys its old one first, is the
    trial, and _instantiate_checked's fallback covers a refusal: the anchors, replayed from an
    executable graph of the applier's own."""
    if rec.one_instance_at_a_time and exec_of(g):
        return ""
    return rec.try_instantiate()


def instantiate_captured(g, rec) -> None:
    """Instantiate a graph put back as captured (its anchors), the same careful way."""
    why = _trial(g, rec)
    if why:
        # the graph as captured: what vLLM would have instantiated without xmix
        raise RuntimeError(f"xmix: the driver refuses the CUDA graph as it was captured: {why}")
    _instantiate_checked(g, rec)


def _instantiate_checked(g, rec) -> None:
    """torch's instantiate() of a template the driver has just accepted; if it fails anyway
    (out of memory in between), torch's handle is stale: the graph is put back as captured and
    replays an executable graph the applier owns from then on (``stats()["own_exec"]``)."""
    try:
        _instantiate(g)
    except RuntimeError as e:
        _lost(g, rec, e)


def _lost(g, rec, err: Exception) -> None:
    try:
        stale = int(g.raw_cuda_graph_exec())
    except RuntimeError:
        stale = 0
    count("errors")
    count("own_exec")
    if g._xmix_state == "patched":
        count("patched", -1)
        count("fallback")
    g._xmix_state = "fallback"
    g._xmix_check_due = False
    g._xmix_refused = f"torch could not instantiate it ({err})"
    rec.apply(G.fallback_plan(rec.read(), g._xmix_refused), 0)
    g._xmix_own_exec = rec.instantiate_own(stale)
    logger.error(
        "xmix: torch's instantiate() failed on a CUDA graph the driver had accepted (%s); "
        "torch's executable graph is gone, so this graph now replays one of xmix's own, as "
        "captured (anchors)",
        err,
    )


def bind(g) -> None:
    rec = getattr(g, "_xmix", None)
    if rec is not None:
        rec.bind(int(g.raw_cuda_graph_exec()))


def _instantiate(g) -> None:
    """Instantiate and push the exec states (XmixCUDAGraph.instantiate binds by itself)."""
    g.instantiate()
    if state.graph_cls is None or not isinstance(g, state.graph_cls):
        bind(g)


def arm_check(g, plan) -> None:
    """After a patch or re-plan that leaves spliced nodes: check at the first replay in a
    step where one of the spliced apps runs (a step where none runs would compare nothing)."""
    apps = 0
    for sp in plan.splices:
        for s in sp.segments:
            apps |= 1 << s.app
    g._xmix_check_apps = apps
    g._xmix_check_due = bool(apps) and not getattr(g, "_xmix_refused", None) and check_enabled()


def patch(graph) -> str:
    """Patch a graph captured outside the hook (a keep_graph=True torch.cuda.CUDAGraph that
    is not yet instantiated, or an XmixCUDAGraph): returns its state."""
    from xmix.runtime import ops

    cb = ops.get_control()
    if cb is None:
        return "plain"
    if not patching_enabled():
        count("disabled")
        return "disabled"
    state = _patch_new(graph, cb, getattr(graph, "_xmix_expected", -1))
    graph._xmix_state = state
    if state != "plain":
        with lock:
            registry.add(graph)
    instantiate_or_fall_back(graph, first=True)
    return graph._xmix_state


def kept_graphs(cb=None) -> list:
    """Graphs xmix manages (patched or fallen back), optionally only those planned against
    one control block."""
    with lock:
        return [
            g
            for g in registry
            if getattr(g, "_xmix", None) is not None
            and (cb is None or getattr(g, "_xmix_cb", None) == cb.ptr)
        ]
