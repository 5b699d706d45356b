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
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

from xmix import _C, settings
from xmix import conditions as C

logger = logging.getLogger("vllm.xmix.graphs")
G = _C.graph

# vLLM modules that construct torch.cuda.CUDAGraph for model graphs: CUDAGraphWrapper
# (model runner V1, piecewise and full), CudaGraphManager (model runner V2), the breakable
# piecewise capture and the micro-batch wrapper.
VLLM_CAPTURE_MODULES = (
    "vllm.compilation.cuda_graph",
    "vllm.v1.worker.gpu.cudagraph_utils",
    "vllm.compilation.breakable_cudagraph",
    "vllm.v1.worker.gpu_ubatch_wrapper",
)

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
_lock = threading.RLock()
_capturing: list[Any] = []  # XmixCUDAGraph instances between capture_begin/_end
_registry: weakref.WeakSet[Any] = weakref.WeakSet()  # graphs with anchors (patched or not)
_planned: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()
_graph_cls: type | None = None
_installed: dict[str, Any] = {}  # module name -> the module's original `torch`
_warned_unhooked = False


def stats() -> dict[str, int]:
    with _lock:
        return dict(_stats)


def reset_stats() -> None:
    with _lock:
        for k in _stats:
            _stats[k] = 0


def _count(key: str, n: int = 1) -> None:
    with _lock:
        _stats[key] += n


def patching_enabled() -> bool:
    return bool(settings.get("XMIX_GRAPH_PATCH"))


def _verify() -> bool:
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


# ---------------------------------------------------------------- the site program
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


def _fingerprint(cb) -> tuple:
    # ops_generation, not id() of the op list: CPython reuses a freed list's address, so an
    # undeploy + deploy between two steps could look like no change.
    return (cb.mem.ops_generation, tuple(sorted((a.index, a.mode) for a in cb.apps.values())))


# ---------------------------------------------------------------- capture-time notes
class _Recorder:
    """``cb.graph_hook``: xmix.ops calls note_anchor for every anchor launched while a
    stream is capturing. The count lets the patcher check that it found every anchor."""

    def note_anchor(self, site, h, r, n, d, sh, sr, dt) -> None:
        global _warned_unhooked
        with _lock:
            cap = list(_capturing)
            for g in cap:  # with several captures under way, every one may hold the site
                g._xmix_sites.add(int(site))
            if len(cap) == 1:
                cap[0]._xmix_anchors += 1
                return
            if len(cap) > 1:
                for g in cap:  # cannot tell which capture this anchor went to
                    g._xmix_counted = False
                return
            _stats["unhooked_anchors"] += 1
            warn = not _warned_unhooked
            _warned_unhooked = True
        if warn:
            logger.warning(
                "xmix: a hook site was captured into a CUDA graph that xmix does not "
                "keep (was install_capture_hook() called before capture?); such "
                "graphs run their self-dispatching anchors: correct, not free"
            )


RECORDER = _Recorder()


def _begin_capture(g) -> None:
    from xmix import ops

    g._xmix_anchors = 0
    g._xmix_counted = True
    g._xmix_sites = set()
    cb = ops.get_control()
    if cb is not None:
        cb.graph_hook = RECORDER
    with _lock:
        _capturing.append(g)


def _end_capture(g) -> None:
    with _lock:
        if g in _capturing:
            _capturing.remove(g)


def _exec_of(g) -> int:
    """The executable graph a graph replays: torch's, or the applier's own (_lost)."""
    own = g.__dict__.get("_xmix_own_exec", 0)
    if own:
        return int(own)
    try:
        return int(g.raw_cuda_graph_exec())
    except RuntimeError:
        return 0


def _after_capture(g) -> None:
    """Patch a freshly captured graph, then instantiate it (keep_graph defers that to us)."""
    from xmix import ops

    _count("captured")
    cb = ops.get_control()
    expected = g._xmix_anchors if g._xmix_counted else -1
    if cb is None or expected == 0:
        _count("plain")
        g._xmix_state = "plain"
        g.instantiate()
        return
    if not patching_enabled():
        _count("disabled")
        g._xmix_state = "disabled"
        g.instantiate()
        return
    with nvtx_range(f"xmix.capture patch ({expected} anchors)"):
        state = _patch_new(g, cb, expected)
    g._xmix_state = state
    if state != "plain":
        with _lock:
            _registry.add(g)
    _instantiate_or_fall_back(g, first=True)


def _patch_new(g, cb, expected: int) -> str:
    g._xmix_check_due = False
    try:
        rec = G.GraphPatch(int(g.raw_cuda_graph()))
    except Exception as e:  # noqa: BLE001 - any failure leaves the captured graph as it is
        _count("errors")
        _count("fallback")
        logger.warning("xmix: cannot keep this CUDA graph (%s); its anchors stay", e)
        return "fallback"
    g._xmix = rec
    g._xmix_expected = expected
    g._xmix_cb = cb.ptr
    try:
        plan, _ = _update(rec, program_for(cb, expected), 0)
    except Exception as e:  # noqa: BLE001 - the applier put the graph back as captured
        if "could not be put back" in str(e):
            raise  # the template is half-edited: instantiating it would be wrong
        _count("errors")
        _count("fallback")
        logger.warning("xmix: patching a CUDA graph failed, its anchors stay: %s", e)
        return "fallback"
    _note_anchor_forms(rec)
    if plan.n_anchors == 0 and not plan.splices:
        g._xmix = None
        _count("plain")
        return "plain"
    if plan.fallback:
        _count("fallback")
        logger.warning(
            "xmix: CUDA graph with %d anchors not patched: %s (anchors stay; correct, not free)",
            plan.n_anchors,
            plan.reason,
        )
        return "fallback"
    _count("patched")
    _arm_check(g, plan)
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
        _count(f"anchors_by_{form}", n)
        if form not in _forms_logged:
            _forms_logged.add(form)
            logger.info(
                "xmix: CUDA graph anchor nodes recognised by their %s%s",
                form,
                " (kernel name lookup: the function handle matched none of ours)"
                if form == "name"
                else "",
            )


def _update(rec, prog, exec_: int):
    """read -> plan -> apply; with XMIX_GRAPH_VERIFY a graph that does not read back as
    planned is put back as captured (returns the fallback plan)."""
    plan, needs, mismatch = rec.update(prog, exec_, _verify())
    if not mismatch:
        return plan, needs
    _count("errors")
    logger.error(
        "xmix: patched graph does not match its plan; putting it back as captured:\n%s", mismatch
    )
    fb = G.fallback_plan(rec.read(), "the graph read back differs from the plan")
    rec.apply(fb, 0)
    return fb, True


def _instantiate_or_fall_back(g, first: bool) -> bool:
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
    why = rec.try_instantiate()
    if not why:
        _instantiate_checked(g, rec)
        return True
    _count("errors")
    logger.error(
        "xmix: the driver refuses the patched CUDA graph %s (%s); its anchors stay",
        "after capture" if first else "after a re-plan",
        why,
    )
    rec.apply(G.fallback_plan(rec.read(), f"instantiation of the patched graph failed: {why}"), 0)
    if first and g._xmix_state == "patched":
        _count("patched", -1)
    _count("fallback")
    g._xmix_state = "fallback"
    g._xmix_check_due = False
    _instantiate_captured(g, rec)
    return False


def _instantiate_captured(g, rec) -> None:
    """Instantiate a graph put back as captured (its anchors), the same careful way."""
    why = rec.try_instantiate()
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
    _count("errors")
    _count("own_exec")
    if g._xmix_state == "patched":
        _count("patched", -1)
        _count("fallback")
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


def _bind(g) -> None:
    rec = getattr(g, "_xmix", None)
    if rec is not None:
        rec.bind(int(g.raw_cuda_graph_exec()))


def _instantiate(g) -> None:
    """Instantiate and push the exec states (XmixCUDAGraph.instantiate binds by itself)."""
    g.instantiate()
    if _graph_cls is None or not isinstance(g, _graph_cls):
        _bind(g)


# ---------------------------------------------------------------- first-replay check
class _Unverifiable(Exception):
    pass


def _arm_check(g, plan) -> None:
    """After a patch or re-plan that leaves spliced nodes: check at the first replay in a
    step where one of the spliced apps runs (a step where none runs would compare nothing)."""
    apps = 0
    for sp in plan.splices:
        for s in sp.segments:
            apps |= 1 << s.app
    g._xmix_check_apps = apps
    g._xmix_check_due = bool(apps) and not getattr(g, "_xmix_refused", None) and check_enabled()


class _TensorRegion:
    """A tensor the check snapshots, restores and compares: ``exact`` bit for bit, else as
    floats (NaN equal to NaN; atomics make latch sums and CAST means vary in rounding)."""

    def __init__(self, name: str, t, exact: bool):
        self.name, self.t, self.exact = name, t, exact
        self.nbytes = t.numel() * t.element_size()

    def save_into(self, buf) -> None:
        """Copy into ``buf`` (uint8, nbytes, preallocated: nothing is allocated here)."""
        buf.view(self.t.dtype).copy_(self.t.detach().reshape(-1))

    def load_from(self, buf) -> None:
        self.t.copy_(buf.view(self.t.dtype).view(self.t.shape))

    def view(self, buf):
        return buf.view(self.t.dtype)


class _RawRegion:
    """Device memory the check knows only by address (a segment of the graph's pool):
    compared bit for bit."""

    exact = True

    def __init__(self, name: str, addr: int, nbytes: int):
        self.name, self.addr, self.nbytes = name, addr, nbytes

    def save_into(self, buf) -> None:
        import torch

        G.copy_device(
            buf.data_ptr(), self.addr, self.nbytes, torch.cuda.current_stream().cuda_stream
        )

    def load_from(self, buf) -> None:
        import torch

        G.copy_device(
            self.addr, buf.data_ptr(), self.nbytes, torch.cuda.current_stream().cuda_stream
        )

    def view(self, buf):
        return buf


_CB_STATE = (
    ("results", False),
    ("result_valid", True),
    ("capture", False),
    ("read_state", False),
    ("vec_state", False),
    ("counters", True),
)


def _check_limit_bytes() -> int:
    return int(settings.get("XMIX_GRAPH_CHECK_MAX_MB") * 2**20)


def _check_graphs() -> int:
    """Graphs checked per control block and deploy (ops_generation): once that many passed,
    the others of the same deploy replay unchecked (``check_skipped``); a failure checks
    every graph of the deploy."""
    return int(settings.get("XMIX_GRAPH_CHECK_GRAPHS"))


def _pool_regions(g) -> list:
    """Every segment of the graph's memory pool: its outputs and intermediates, and the
    outputs of other graphs sharing the pool that it reads (vLLM's piecewise graphs). The
    whole pool, not only the graph's outputs: vLLM's piecewise graphs update their inputs in
    place (the fused add + RMSNorm on the residual), so a second replay from the same state
    needs everything the graph may read restored."""
    import torch

    pool = tuple(g.pool())
    regions = []
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", ())) == pool:
            regions.append(
                _RawRegion(
                    f"graph pool segment {seg['address']:#x} (+{seg['total_size']} B)",
                    int(seg["address"]),
                    int(seg["total_size"]),
                )
            )
    return regions


def _check_regions(g, cb) -> list:
    regions = [_TensorRegion(n, cb.dev[n], exact) for n, exact in _CB_STATE]
    for name, t, exact in (
        ("custom_select", cb.custom.select, True),
        ("custom_out", cb.custom.out, False),
    ):
        if t is not None:
            regions.append(_TensorRegion(name, t, exact))
    pool = _pool_regions(g)
    if not pool:
        # its outputs are somewhere the check cannot see, or restore
        raise _Unverifiable("no segment of its memory pool was found")
    total = sum(r.nbytes for r in regions + pool)
    if 3 * total > _check_limit_bytes():
        raise _Unverifiable(
            f"three snapshots of its memory pool and the control block's state "
            f"({3 * total / 2**20:.0f} MiB) exceed XMIX_GRAPH_CHECK_MAX_MB"
        )
    return regions + pool


class _Snapshots:
    """The check's device memory, allocated at once before any replay (an allocation that
    fails then leaves nothing half done): three sets of the regions (before, patched,
    anchors), one flat uint8 buffer each."""

    def __init__(self, regions: list, device):
        import torch

        self.regions = regions
        self.offsets = []
        off = 0
        for r in regions:  # 16-byte aligned, so every part can be viewed as its dtype
            self.offsets.append(off)
            off += (r.nbytes + 15) // 16 * 16
        self.sets = [torch.empty(off, dtype=torch.uint8, device=device) for _ in range(3)]

    def _parts(self, k: int):
        for r, off in zip(self.regions, self.offsets):
            yield r, self.sets[k][off : off + r.nbytes]

    def save(self, k: int) -> None:
        for r, buf in self._parts(k):
            r.save_into(buf)

    def load(self, k: int) -> None:
        for r, buf in self._parts(k):
            r.load_from(buf)

    def first_difference(self, a: int, b: int) -> str | None:
        """None when set a holds what set b holds (per region's rule), else the first
        difference. Compares the saved copies: nothing is allocated but small temporaries for
        the control block's float regions."""
        import torch

        for (r, x), (_, y) in zip(self._parts(a), self._parts(b)):
            if r.exact:
                if not torch.equal(x, y):
                    n = int((x != y).sum())
                    return f"{r.name}: {n} of {x.numel()} bytes differ"
                continue
            got, want = r.view(x), r.view(y)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-6, equal_nan=True):
                d = (got - want).abs().nan_to_num(nan=float("inf"))
                d[got.isnan() & want.isnan()] = 0
                i = int(d.argmax())
                return (
                    f"{r.name}: element {i} is {float(got[i])!r}, the anchors give "
                    f"{float(want[i])!r}"
                )
        return None


def _check_due(g, cb) -> bool:
    return (
        cb is not None
        and cb.ptr == g._xmix_cb
        and cb.step.any_active
        and bool(cb.step.active & g._xmix_check_apps)
    )


# Per control block: (ops_generation, checks passed, a check failed) of the current deploy.
_check_budget: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()


def _budget(cb) -> list:
    b = _check_budget.get(cb)
    if b is None or b[0] != cb.mem.ops_generation:
        b = _check_budget[cb] = [cb.mem.ops_generation, 0, False]
    return b


def _replay(g, base_replay) -> None:
    """XmixCUDAGraph.replay: the first replay of a patched graph in a step that runs one of
    its spliced apps is the checked one, until enough graphs of the deploy have passed."""
    if g.__dict__.get("_xmix_check_due"):
        from xmix import ops

        cb = ops.get_control()
        if _check_due(g, cb):
            b = _budget(cb)
            if not check_enabled():
                g._xmix_check_due = False
            elif b[1] >= _check_graphs() and not b[2]:
                g._xmix_check_due = False
                _count("check_skipped")
            else:
                _first_replay_check(g, cb, base_replay)
                return
    base_replay()


def _first_replay_check(g, cb, base_replay) -> None:
    """Replays the graph patched and then in its anchor configuration from the same state and
    serves the anchors' result; a difference puts the graph back as captured. All the check's
    device memory is allocated before the first replay, and a failure of the snapshot or of
    the patched replay still serves the anchors' replay: the check never fails a step that
    the graph without xmix would have served."""
    g._xmix_check_due = False
    _count("checks")
    rec = g._xmix
    exec_ = _exec_of(g)
    sync = _sync_fn(cb)
    budget = _budget(cb)

    def serve_anchors(restore: _Snapshots | None) -> None:
        if restore is not None:
            restore.load(0)
        rec.set_anchor_config(exec_, True)
        base_replay()
        sync()  # _refuse replaces the executable graph

    with nvtx_range("xmix.graph first-replay check"):
        try:
            snaps = _Snapshots(_check_regions(g, cb), cb.device)
            snaps.save(0)  # before
        except (_Unverifiable, RuntimeError) as e:  # RuntimeError: out of device memory
            budget[2] = True
            serve_anchors(None)
            _refuse(g, "check_unverifiable", f"the check could not snapshot the graph: {e}")
            return
        try:
            base_replay()  # patched
        except RuntimeError as e:
            budget[2] = True
            serve_anchors(snaps)
            _refuse(g, "check_failed", f"the patched graph's replay failed: {e}")
            return
        try:
            snaps.save(1)
        except RuntimeError as e:
            budget[2] = True
            serve_anchors(snaps)
            _refuse(g, "check_unverifiable", f"the check could not snapshot the replay: {e}")
            return
        serve_anchors(snaps)  # what is served; an error here is the captured graph's own
        snaps.save(2)
        diff = snaps.first_difference(1, 2)
        if diff is None:
            rec.set_anchor_config(exec_, False)
            budget[1] += 1
            _count("check_passed")
            logger.debug("xmix: first-replay check passed (%d regions)", len(snaps.regions))
            return
        budget[2] = True
        snaps.load(0)
        base_replay()  # anchors again: is the graph deterministic?
        sync()
        snaps.save(1)
        noise = snaps.first_difference(1, 2)
        snaps.load(2)  # the served replay's state
        sync()
    if noise is not None:
        _refuse(
            g,
            "check_unverifiable",
            f"two replays with the anchors differ ({noise}): the "
            "graph is not deterministic, so its patched form cannot be checked",
        )
    else:
        _refuse(g, "check_failed", f"the patched graph differs from its anchors: {diff}")


def _sync_fn(cb):
    if not cb.on_gpu:
        return lambda: None
    import torch

    return torch.cuda.synchronize


def _refuse(g, key: str, reason: str) -> None:
    """Put a graph back as captured for good (re-plans leave it alone). The anchors' replay
    has run and been waited for, so the executable graph can be replaced now."""
    _count(key)
    _count("fallback")
    if g._xmix_state == "patched":
        _count("patched", -1)
    g._xmix_refused = reason
    g._xmix_state = "fallback"
    rec = g._xmix
    rec.apply(G.fallback_plan(rec.read(), reason), 0)
    _instantiate_captured(g, rec)
    logger.error("xmix: CUDA graph put back as captured (anchors kept from now on): %s", reason)


# Graph states that replay the self-dispatching anchors: they run every built-in op, never a
# user kernel (those run only from spliced nodes).
_ANCHORS_ONLY = ("fallback", "disabled")


def _replay_own(g) -> None:
    import torch

    g._xmix.launch_own(torch.cuda.current_stream().cuda_stream)


def _custom_not_run(g) -> None:
    """A graph replaying its anchors (patching off, a refused patch) cannot run user kernels:
    the step's requests that use an app with one at a site of this graph fail, saying so,
    rather than get an answer without it."""
    from xmix import ops

    cb = ops.get_control()
    if cb is None or not cb.step.any_active:
        return
    custom = cb.mem.site_custom
    if not custom:
        return
    for site in g._xmix_sites & custom.keys():
        hit = sorted(
            {so.inst.index for _, so in custom[site] if (cb.step.active >> so.inst.index) & 1}
        )
        if not hit:
            continue
        _count("custom_not_run")
        why = (
            "its user kernel cannot run in this CUDA graph, which replays its anchors "
            f"({'XMIX_GRAPH_PATCH=0' if g._xmix_state == 'disabled' else g._xmix_refused or 'its patch was refused, see the log'})"
        )
        cb.sites.site_failed(site, [(index, why) for index in hit])


def _make_graph_class(base: type) -> type:
    class XmixCUDAGraph(base):  # type: ignore[misc, valid-type]
        """A torch.cuda.CUDAGraph that keeps its cudaGraph_t (keep_graph=True, whatever the
        caller asks) and patches it at the end of capture."""

        def __new__(cls, keep_graph: bool = True, *args, **kwargs):
            return super().__new__(cls, True)

        def __init__(self, keep_graph: bool = True, *args, **kwargs):
            super().__init__(True)
            self._xmix = None
            self._xmix_state = "new"
            self._xmix_anchors = 0
            self._xmix_counted = True
            self._xmix_expected = -1
            self._xmix_cb = None
            self._xmix_check_due = False
            self._xmix_check_apps = 0
            self._xmix_refused = None
            self._xmix_own_exec = 0
            self._xmix_sites: set[int] = set()

        def capture_begin(self, *args, **kwargs):
            _begin_capture(self)
            try:
                return super().capture_begin(*args, **kwargs)
            except BaseException:
                _end_capture(self)
                raise

        def capture_end(self):
            try:
                super().capture_end()
            finally:
                _end_capture(self)
            _after_capture(self)

        def instantiate(self):
            super().instantiate()
            _bind(self)

        def replay(self):
            if self._xmix_own_exec:
                _replay_own(self)
            elif self._xmix_check_due:
                _replay(self, super().replay)
            else:
                super().replay()
            if self._xmix_state in _ANCHORS_ONLY and self._xmix_sites:
                _custom_not_run(self)

        def reset(self):
            with _lock:
                _registry.discard(self)
            self._xmix = None  # destroys the applier's own executable graph, if any
            self._xmix_own_exec = 0
            self._xmix_check_due = False
            return super().reset()

        @property
        def xmix_state(self) -> str:
            """new | plain | patched | fallback | disabled"""
            return self._xmix_state

        def xmix_ir(self):
            """The patched graph as IR (None when xmix does not manage it)."""
            return self._xmix.read() if self._xmix is not None else None

    return XmixCUDAGraph


def graph_class() -> type | None:
    """The keep-graph CUDAGraph subclass, or None where graphs cannot be patched."""
    global _graph_cls
    if _graph_cls is None:
        why = cuda_patching_available()
        if why is not None:
            logger.info("xmix: CUDA graph patching unavailable: %s", why)
            return None
        import torch

        # Every xmix kernel loaded now, not lazily in the middle of the first capture.
        n = _C.preload_kernels()
        logger.debug("xmix: %d kernels loaded", n)
        _graph_cls = _make_graph_class(torch.cuda.CUDAGraph)
    return _graph_cls


def patch(graph) -> str:
    """Patch a graph captured outside the hook (a keep_graph=True torch.cuda.CUDAGraph that
    is not yet instantiated, or an XmixCUDAGraph): returns its state."""
    from xmix import ops

    cb = ops.get_control()
    if cb is None:
        return "plain"
    if not patching_enabled():
        _count("disabled")
        return "disabled"
    state = _patch_new(graph, cb, getattr(graph, "_xmix_expected", -1))
    graph._xmix_state = state
    if state != "plain":
        with _lock:
            _registry.add(graph)
    _instantiate_or_fall_back(graph, first=True)
    return graph._xmix_state


def kept_graphs(cb=None) -> list:
    """Graphs xmix manages (patched or fallen back), optionally only those planned against
    one control block."""
    with _lock:
        return [
            g
            for g in _registry
            if getattr(g, "_xmix", None) is not None
            and (cb is None or getattr(g, "_xmix_cb", None) == cb.ptr)
        ]


# ---------------------------------------------------------------- between steps
def on_apps_changed(cb) -> dict[str, int]:
    """After install/remove on the control block: re-plan every kept graph. Graphs whose
    splice shapes did not change are updated in place; the others are re-spliced and
    re-instantiated (no recapture). Waits for the device first: re-instantiation destroys
    executable graphs, and a graph with IF nodes may have only one instance. A graph the
    first-replay check refused keeps its anchors."""
    import torch

    graphs = [g for g in kept_graphs(cb) if not getattr(g, "_xmix_refused", None)]
    out = {"graphs": len(graphs), "reinstantiated": 0, "in_place": 0, "fallback": 0, "errors": 0}
    _planned[cb] = _fingerprint(cb)
    if not graphs:
        return out
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prog = program_for(cb)
    with nvtx_range(f"xmix.replan {len(graphs)} graphs"):
        for g in graphs:
            prog.expected_anchors = getattr(g, "_xmix_expected", -1)
            _count("replans")
            try:
                plan, needs = _update(g._xmix, prog, _exec_of(g))
            except Exception as e:
                if "could not be put back" in str(e):
                    raise  # the template is half-edited: replaying it would be wrong
                logger.warning("xmix: re-planning a CUDA graph failed, its anchors run: %s", e)
                _count("errors")
                out["errors"] += 1
                g._xmix_state = "fallback"
                g._xmix_check_due = False
                _instantiate_captured(g, g._xmix)  # the applier put it back as captured
                continue
            if plan.fallback:
                out["fallback"] += 1
                g._xmix_state = "fallback"
                g._xmix_check_due = False
            else:
                g._xmix_state = "patched"
                if not plan.is_noop():
                    _arm_check(g, plan)
            if needs:
                if _instantiate_or_fall_back(g, first=False):
                    out["reinstantiated"] += 1
                    _count("reinstantiated")
                else:
                    out["fallback"] += 1
                    out["errors"] += 1
            else:
                out["in_place"] += 1
                _count("updated_in_place")
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
            exec_ = _exec_of(g)
            n += g._xmix.set_app_enabled(exec_, app_index, bool(enabled))
    _count("toggled_nodes", n)
    return n


def set_mode(cb, name: str, mode: str) -> int:
    """cb.set_mode plus the matching node switch in every kept graph."""
    cb.set_mode(name, mode)
    inst = cb.apps[name]
    with nvtx_range(f"xmix.mode {name}={mode}"):
        n = set_app_enabled(cb, inst.index, mode != "off")
    prev = _planned.get(cb)
    if prev is not None and prev[0] == cb.mem.ops_generation:
        _planned[cb] = _fingerprint(cb)
    return n


def refresh_params(cb, app_index: int) -> int:
    """Re-send the kernel parameters of an app's top-level spliced nodes to every executable
    graph (cudaGraphExecKernelNodeSetParams). Built-in ops read their parameters and
    artifacts from the control block, so this is only needed when node arguments changed
    outside a re-plan; on_apps_changed already re-points what moved."""
    n = 0
    for g in kept_graphs(cb):
        exec_ = _exec_of(g)
        if exec_:
            n += g._xmix.refresh_app_params(exec_, app_index)
    return n


def ensure_current(cb) -> bool:
    """Call once per step before replaying graphs: re-plans when the control block's op list
    changed since the last plan (stale op nodes would run the wrong ops), and switches nodes
    when app modes changed. O(number of apps) when nothing changed. True if it did work."""
    fp = _fingerprint(cb)
    prev = _planned.get(cb)
    if prev == fp:
        return False
    if prev is None or prev[0] != fp[0]:
        on_apps_changed(cb)
        return True
    old = dict(prev[1])
    for index, mode in fp[1]:
        if old.get(index) != mode:
            set_app_enabled(cb, index, mode != "off")
    _planned[cb] = fp
    return True


# ---------------------------------------------------------------- hooking vLLM
class _ModuleView(types.ModuleType):
    """A stand-in for a module as seen from one importer: a few names replaced, every other
    attribute read through to the real module (and cached)."""

    def __init__(self, real: types.ModuleType, overrides: dict[str, Any]):
        super().__init__(real.__name__, real.__doc__)
        self.__dict__["_xmix_real"] = real
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__dict__["_xmix_real"], name)
        if not name.startswith("__"):
            self.__dict__[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["_xmix_real"], name, value)
        self.__dict__.pop(name, None)


def _torch_view(real_torch, graph_cls: type) -> types.ModuleType:
    cuda = _ModuleView(real_torch.cuda, {"CUDAGraph": graph_cls})
    return _ModuleView(real_torch, {"cuda": cuda})


def _redirect(module_names, graph_cls: type) -> list[str]:
    """Make `torch.cuda.CUDAGraph` mean graph_cls inside the named modules only."""
    done = []
    for name in module_names:
        if name in _installed:
            done.append(name)
            continue
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a module this vLLM does not have
            logger.debug("xmix: %s not importable (%s); not hooked", name, e)
            continue
        real = getattr(mod, "torch", None)
        if real is None or not hasattr(real, "cuda"):
            continue
        _installed[name] = real
        mod.torch = _torch_view(real, graph_cls)
        done.append(name)
    return done


def install_capture_hook() -> bool:
    """Make vLLM's CUDA-graph capture sites build XmixCUDAGraph. Called by the worker's
    ``load_model`` (after vLLM's ``init_device``, before the runner captures graphs), never
    from the plugin's ``register()``: that also runs in the parent process, where touching
    CUDA before vLLM forks its engine core breaks the child; idempotent. A no-op returning False where graphs cannot
    be patched (CPU, torch without keep_graph, xmix._C without CUDA) or vLLM is absent."""
    with _lock:
        cls = graph_class()
        if cls is None:
            return False
        try:
            importlib.import_module("vllm")
        except ImportError:
            return False
        hooked = _redirect(VLLM_CAPTURE_MODULES, cls)
    if hooked:
        logger.info("xmix: CUDA graph capture hooked in %s", ", ".join(hooked))
    return bool(hooked)


def uninstall_capture_hook() -> None:
    with _lock:
        for name, real in list(_installed.items()):
            mod = importlib.import_module(name)
            mod.torch = real
            del _installed[name]
