"""CUDA graph interposition (xmix.runtime.graphs, xmix._C.graph).

CPU: the planner through the bindings on hand-built graph IR, the site program derived from
a real control block, the capture-time anchor count, the vLLM capture-site redirection and
the switches. GPU (marked ``gpu``): capture a small decoder in an XmixCUDAGraph, patch it and
check every state against eager execution.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from harness import Harness, Req
from xmix import _C
from xmix.lang import conditions as C
from xmix.lang.api import App
from xmix.lang.sites import ModelShape, site_id
from xmix.runtime import graphs, ops
from xmix.runtime.graphs import check, hook, replan, splice, state

G = _C.graph
CB = 0x7F0000001000


def anchor(nid, site, rows=8, cb=CB):
    return G.Node(nid, G.NodeType.Kernel, G.Role.Anchor, anchor=G.AnchorArgs(cb, site, rows))


def line(*sites, cb=CB):
    """n0 -> A(site0) -> n2 -> A(site1) -> ... -> last"""
    nodes, edges, nid = [G.Node(0)], [], 1
    for s in sites:
        nodes.append(anchor(nid, s, cb=cb))
        nodes.append(G.Node(nid + 1))
        edges += [G.Edge(nid - 1, nid), G.Edge(nid, nid + 1)]
        nid += 2
    return G.Graph(nodes, edges)


# ---------------------------------------------------------------- planner via bindings
def test_planner_splices_one_op_per_anchor_and_disables_anchors():
    g = line(3, 4)
    prog = G.Program(CB, 16, [G.OpSpec(3, 0, 0), G.OpSpec(4, 0, 1), G.OpSpec(4, 1, 2)])
    plan = G.plan(g, prog)
    assert not plan.fallback and plan.needs_instantiate and plan.n_anchors == 2
    after = G.apply(g, plan)
    assert set(G.edge_list(after)) == {
        "n0->n1",
        "n1->n2",
        "n2->n3",
        "n3->n4",
        "n0->op@1.0",
        "op@1.0->n2",
        "n2->op@3.0",
        "op@3.0->op@3.1",
        "op@3.1->n4",
    }
    states = {n.id: n.enabled for n in after.nodes}
    assert states[1] is False and states[3] is False
    assert [s.app for s in after.splices[1].segments] == [1, 2]
    # planning again against the same program is a no-op; an empty program undoes it
    assert G.plan(after, prog).is_noop()
    undone = G.apply(after, G.plan(after, G.Program(CB, 16)))
    assert G.edge_list(undone) == G.edge_list(g)


def test_planner_gated_custom_op_goes_inside_an_if_body():
    g = line(2)
    args = G.CustomArgs()
    args.kernel, args.select, args.out = 0xBEEF, 0x10, 0x20
    prog = G.Program(CB, 16, [G.OpSpec(2, 0, 5, gated=True, custom=True, custom_args=args)])
    after = G.apply(g, G.plan(g, prog))
    seg = after.splices[0].segments[0]
    assert after.find(seg.cond).type == G.NodeType.Conditional
    for nid in (seg.sel, seg.user, seg.fin):
        assert after.find(nid).parent == seg.cond
    assert set(G.edge_list(after)) == {
        "n0->n1",
        "n1->n2",
        "n0->gate@1.0",
        "n1->gate@1.0",  # a user kernel also waits for the anchor (anchor_config)
        "gate@1.0->if@1.0",
        "if@1.0->n2",
        "sel@1.0->user@1.0",
        "user@1.0->fin@1.0",
    }


def test_planner_keeps_pdl_data_out_of_the_chain_only():
    g = line(1)
    g.edges = [G.Edge(0, 1, G.EdgeData(1, 0, 1)), G.Edge(1, 2, G.EdgeData(1, 0, 1))]
    after = G.apply(g, G.plan(g, G.Program(CB, 16, [G.OpSpec(1, 0, 0)])))
    assert set(G.edge_list(after)) == {
        "n0->n1[1,0,1]",
        "n1->n2[1,0,1]",
        "n0->op@1.0",
        "op@1.0->n2[1,0,1]",
    }


def test_planner_falls_back_on_a_foreign_control_block_and_bad_programs_raise():
    g = line(1)
    plan = G.plan(g, G.Program(CB + 8, 16, [G.OpSpec(1, 0, 0)]))
    assert plan.fallback and "control block" in plan.reason
    assert [(t.node, t.enabled) for t in plan.enable] == [(1, True)]
    with pytest.raises(ValueError):
        G.plan(g, G.Program(CB, 16, [G.OpSpec(1, 0, 0), G.OpSpec(1, 0, 1)]))


# ---------------------------------------------------------------- the site program
SHAPE = ModelShape(n_layers=2, hidden_size=16, vocab_size=64)


def _apps():
    g = torch.Generator().manual_seed(0)
    steer = App("steer")
    steer.write("add", vector=torch.randn(16, generator=g), scale=2.0).layers([0, 1]).at(
        "residual.pre"
    ).cond("last_token")
    gated = App("gated")
    gated.param("theta", 0.5)
    gated.read("probe", weight=torch.randn(16, generator=g), bias=0.0).layers([0]).at(
        "residual.pre"
    ).named("p")
    gated.read("probe", weight=torch.randn(16, generator=g), bias=0.0).layers([0]).at(
        "mlp.post"
    ).named("q").cond("p >= theta")  # a gated read: no IF
    gated.write("add", vector=torch.randn(16, generator=g), scale=1.0).layers([1]).at(
        "mlp.post"
    ).cond("p >= theta")  # gated write: IF
    gated.write("ablate", direction=torch.randn(16, generator=g)).layers([1]).at(
        "residual.pre"
    ).cond("prompt_mean(p) >= 0.1 and generated")  # latch: IF
    return steer, gated


def test_program_follows_the_control_block_site_lists():
    hs = Harness(SHAPE, list(_apps()), "cpu")
    cb = hs.cb
    prog = graphs.program_for(cb, use_conditionals=True)
    got = [(o.site, o.op_index, o.app, o.enabled, o.gated, o.custom) for o in prog.ops]
    steer, gated = cb.apps["steer"].index, cb.apps["gated"].index
    pre0, pre1 = site_id("residual.pre", 0, 2), site_id("residual.pre", 1, 2)
    mlp0, mlp1 = site_id("mlp.post", 0, 2), site_id("mlp.post", 1, 2)
    assert got == [
        (pre0, 0, steer, True, False, False),
        (pre0, 1, gated, True, False, False),  # probe p
        (mlp0, 0, gated, True, False, False),  # probe q, gated read: never wrapped
        (pre1, 0, steer, True, False, False),
        (pre1, 1, gated, True, True, False),  # latched ablate
        (mlp1, 0, gated, True, True, False),  # gated add
    ]
    assert prog.cb == cb.ptr and prog.n_sites == cb.n_sites
    cb.set_mode("gated", "off")
    assert [o.enabled for o in graphs.program_for(cb).ops] == [
        True,
        False,
        False,
        True,
        False,
        False,
    ]

    # the planner on a graph holding one anchor per used site, in forward order
    sites = [pre0, mlp0, pre1, mlp1]
    g = line(*sites, cb=cb.ptr)
    prog = graphs.program_for(cb, expected_anchors=4, use_conditionals=True)
    plan = G.plan(g, prog)
    assert not plan.fallback, plan.reason
    after = G.apply(g, plan)
    shapes = {sp.anchor: [(s.op_index, s.gated) for s in sp.segments] for sp in after.splices}
    assert shapes == {
        1: [(0, False), (1, False)],
        3: [(0, False)],
        5: [(0, False), (1, True)],
        7: [(0, True)],
    }
    # without conditional nodes the gated writes become plain op nodes
    plain = G.apply(g, G.plan(g, graphs.program_for(cb, use_conditionals=False)))
    assert not any(n.type == G.NodeType.Conditional for n in plain.nodes)


@pytest.mark.parametrize(
    "cond,primitive,gated",
    [
        (None, "write", False),
        ("last_token", "write", False),
        ("token_in(s) or prompt", "write", False),
        ("p >= 0.5", "write", True),
        ("not (p < 0.5) and last_token", "write", True),
        ("prompt_last(p) > 1", "write", True),
        ("p >= 0.5", "read", False),
    ],
)
def test_is_gated(cond, primitive, gated):
    op = types.SimpleNamespace(primitive=primitive, cond=C.parse(cond) if cond else None)
    assert graphs.is_gated(op) is gated


# ---------------------------------------------------------------- capture-time notes and switches
def test_recorder_counts_anchors_of_the_capture_under_way():
    hs = Harness(SHAPE, [], "cpu")
    prev = ops.get_control()
    ops.set_control(hs.cb)
    graphs.reset_stats()
    a, b = types.SimpleNamespace(), types.SimpleNamespace()
    try:
        splice.begin_capture(a)
        assert hs.cb.graph_hook is splice.RECORDER
        for _ in range(3):
            hs.cb.graph_hook.note_anchor(0, None, None, 1, 16, 16, 0, 0)
        assert a._xmix_anchors == 3 and a._xmix_counted
        splice.begin_capture(b)  # two captures at once: the count is not trusted
        splice.RECORDER.note_anchor(1, None, None, 1, 16, 16, 0, 0)
        assert not a._xmix_counted and not b._xmix_counted
        splice.end_capture(b)
        splice.end_capture(a)
        splice.RECORDER.note_anchor(2, None, None, 1, 16, 16, 0, 0)
        assert graphs.stats()["unhooked_anchors"] == 1
    finally:
        splice.end_capture(a)
        splice.end_capture(b)
        ops.set_control(prev)


def test_patch_switch_env(monkeypatch):
    monkeypatch.delenv("XMIX_GRAPH_PATCH", raising=False)
    assert graphs.patching_enabled()
    for v in ("0", "off", "False"):
        monkeypatch.setenv("XMIX_GRAPH_PATCH", v)
        assert not graphs.patching_enabled()
    monkeypatch.setenv("XMIX_GRAPH_PATCH", "1")
    assert graphs.patching_enabled()


def test_ensure_current_replans_on_deploys_and_switches_on_modes(monkeypatch):
    steer, gated = _apps()
    hs = Harness(SHAPE, [steer], "cpu")
    cb = hs.cb
    calls = []
    monkeypatch.setattr(
        replan,
        "on_apps_changed",
        lambda c: (calls.append("replan"), state.planned.__setitem__(c, splice.fingerprint(c))),
    )
    monkeypatch.setattr(
        replan, "set_app_enabled", lambda c, i, on: calls.append(("toggle", i, on)) or 0
    )
    assert graphs.ensure_current(cb) and calls == ["replan"]
    assert not graphs.ensure_current(cb)
    from xmix.lang.lowering import lower

    cb.install(lower(gated, SHAPE))
    assert graphs.ensure_current(cb) and calls[-1] == "replan"
    cb.set_mode("steer", "off")
    assert graphs.ensure_current(cb)
    assert calls[-1] == ("toggle", cb.apps["steer"].index, False)
    assert not graphs.ensure_current(cb)


def test_install_capture_hook_is_a_noop_without_a_gpu():
    if graphs.cuda_patching_available() is None:
        pytest.skip("this machine can patch graphs: the no-op path is for CPU machines")
    assert graphs.install_capture_hook() is False
    assert hook._installed == {}


def test_redirect_swaps_cudagraph_in_vllm_capture_modules_only():
    pytest.importorskip("vllm")
    cuda_graph = importlib.import_module("vllm.compilation.cuda_graph")

    class Fake:
        pass

    real_torch = cuda_graph.torch
    assert real_torch is torch
    try:
        hooked = hook._redirect(graphs.VLLM_CAPTURE_MODULES, Fake)
        assert "vllm.compilation.cuda_graph" in hooked
        for name in hooked:
            mod = importlib.import_module(name)
            assert mod.torch.cuda.CUDAGraph is Fake
            assert mod.torch.cuda.graph is torch.cuda.graph
            assert mod.torch.Tensor is torch.Tensor
            assert mod.torch.cuda.is_available is torch.cuda.is_available
        assert torch.cuda.CUDAGraph is not Fake  # nobody else sees it
        assert hook._redirect(graphs.VLLM_CAPTURE_MODULES, Fake) == hooked  # idempotent
    finally:
        graphs.uninstall_capture_hook()
    assert cuda_graph.torch is torch and hook._installed == {}


# ---------------------------------------------------------------- orchestration, simulated
class SimDriver:
    """What the CUDA driver accepts: ``refuses(ir)`` decides whether a template instantiates
    (the same answer for the applier's trial and for torch, as a real driver gives);
    ``torch_fail_at`` numbers torch instantiate() calls that fail anyway (out of memory
    between the trial and torch)."""

    refuses = staticmethod(lambda ir: False)
    torch_fail_at: set[int] = set()


def patched_template(ir) -> bool:
    """A template with its anchors switched off: what a patch leaves."""
    return any(n.role == G.Role.Anchor and not n.enabled for n in ir.nodes)


class SimPatch:
    """Stands in for _C.graph.GraphPatch: the graph is IR and edits are the planner's own
    apply(), so xmix.runtime.graphs' capture/re-plan/toggle logic runs without a GPU."""

    graphs: dict[int, object] = {}
    live: dict[int, SimPatch] = {}
    mismatch = ""
    forms: dict[str, int] = {}  # what GraphPatch.anchor_forms reports

    def __init__(self, graph_ptr):
        self.ir = SimPatch.graphs[graph_ptr]
        self.ptr = graph_ptr
        self.had_if = False  # the real applier parks an IF it removes: conditional for good
        SimPatch.live[graph_ptr] = self
        self.bound = []
        self.anchors_on = False
        self.config = None
        self.own = 0
        self.own_launches = 0

    def read(self):
        return self.ir

    def _edit(self, plan):
        self.ir = G.apply(self.ir, plan)
        self.had_if |= any(n.role == G.Role.If for n in self.ir.nodes)

    def update(self, prog, exec_, verify):
        plan = G.plan(self.ir, prog)
        self._edit(plan)
        return plan, plan.needs_instantiate, SimPatch.mismatch if verify else ""

    def apply(self, plan, exec_):
        self._edit(plan)
        return plan.needs_instantiate

    @property
    def one_instance_at_a_time(self):
        return self.had_if

    def bind(self, exec_):
        self.bound.append(exec_)
        self.anchors_on = False
        self.config = None

    def set_app_enabled(self, exec_, app, on):
        return sum(1 for sp in self.ir.splices for s in sp.segments if s.app == app)

    def set_anchor_config(self, exec_, anchors):
        # the applier switches exec states by the planner's anchor_config
        self.anchors_on = anchors
        self.config = {t.node: t.enabled for t in G.anchor_config(self.ir)} if anchors else None

    def try_instantiate(self):
        # the runtime's rule for templates with conditional nodes: one executable graph at a
        # time, refused with cudaErrorNotSupported whatever the template (seen on an H200)
        torch_g = SimGraph.by_ptr.get(self.ptr)
        if self.had_if and (self.own or (torch_g and torch_g.has_exec and not torch_g.stale)):
            return "cudaErrorNotSupported (simulated: a second instance)"
        return "cudaErrorInvalidValue (simulated)" if SimDriver.refuses(self.ir) else ""

    def instantiate_own(self, stale):
        assert not SimDriver.refuses(self.ir)
        self.own = 777000 + len(self.bound)
        self.bind(self.own)
        return self.own

    def launch_own(self, stream):
        self.own_launches += 1

    @property
    def own_exec(self):
        return self.own

    @property
    def anchor_forms(self):
        return dict(SimPatch.forms)


class SimGraph:
    """The parts of torch.cuda.CUDAGraph(keep_graph=True) that xmix.runtime.graphs uses, with torch's
    instantiate() as it is (aten/src/ATen/cuda/CUDAGraph.cpp): it destroys the executable
    graph it has, then instantiates; when that fails, has_graph_exec_ stays true with the
    destroyed handle, which the next instantiate() destroys again (the driver's error)."""

    by_ptr: dict[int, SimGraph] = {}

    def __init__(self, ptr):
        SimGraph.by_ptr[ptr] = self
        self.ptr, self.execs = ptr, 0
        self.calls = 0
        self.has_exec = False
        self.stale = False
        self.replays = 0

    def raw_cuda_graph(self):
        return self.ptr

    def raw_cuda_graph_exec(self):
        if not self.has_exec:
            raise RuntimeError("You cannot access the raw cudaGraphExec_t instance until ...")
        return 1000 * self.ptr + self.execs

    def instantiate(self):
        self.calls += 1
        if self.has_exec and self.stale:
            raise RuntimeError("cudaGraphExecDestroy: invalid resource handle (destroyed twice)")
        # the old executable graph is destroyed here; has_exec stays as it was
        patch = SimPatch.live.get(self.ptr)
        template = patch.ir if patch is not None else SimPatch.graphs[self.ptr]
        if SimDriver.refuses(template) or self.calls in SimDriver.torch_fail_at:
            self.stale = self.has_exec
            raise RuntimeError("cudaGraphInstantiateWithFlags: invalid value")
        self.execs += 1
        self.has_exec, self.stale = True, False

    def replay(self):
        if self.stale:
            raise RuntimeError("cudaGraphLaunch: invalid resource handle")
        self.replays += 1


@pytest.fixture
def sim(monkeypatch):
    hs = Harness(SHAPE, [], "cpu")
    fake = {k: getattr(G, k) for k in dir(G) if not k.startswith("_")}
    fake["GraphPatch"] = SimPatch
    sim_g = types.SimpleNamespace(**fake)
    for part in (state, splice, check):  # each part binds _C.graph as G
        monkeypatch.setattr(part, "G", sim_g)
    prev = ops.get_control()
    ops.set_control(hs.cb)
    graphs.reset_stats()
    SimPatch.mismatch = ""
    SimPatch.forms = {}
    SimGraph.by_ptr.clear()  # a graph of an earlier test must not stand in for this one's
    SimDriver.refuses = staticmethod(lambda ir: False)
    SimDriver.torch_fail_at = set()
    yield hs
    ops.set_control(prev)
    with state.lock:
        state.registry.clear()
    check._check_budget.clear()


def _sim_capture(hs, ptr, sites):
    SimPatch.graphs[ptr] = line(*sites, cb=hs.cb.ptr)
    g = SimGraph(ptr)
    splice.begin_capture(g)
    for s in sites:
        hs.cb.graph_hook.note_anchor(s, None, None, 8, 16, 16, 0, 0)
    splice.end_capture(g)
    splice.after_capture(g)
    return g


def test_orchestration_capture_replan_toggle(sim):
    hs = sim
    steer, gated = _apps()
    from xmix.lang.lowering import lower

    pre0, pre1 = site_id("residual.pre", 0, 2), site_id("residual.pre", 1, 2)
    g = _sim_capture(hs, 1, [pre0, pre1])
    plain = _sim_capture(hs, 2, [])
    assert g._xmix_state == "patched" and g.execs == 1 and g._xmix.bound == [1001]
    assert plain._xmix_state == "plain" and plain not in graphs.kept_graphs()
    assert graphs.kept_graphs(hs.cb) == [g]
    assert not g._xmix.ir.splices  # nothing deployed: anchors off, nothing added

    hs.cb.install(lower(steer, SHAPE))
    out = graphs.on_apps_changed(hs.cb)
    assert out == {"graphs": 1, "reinstantiated": 1, "in_place": 0, "fallback": 0, "errors": 0}
    assert g.execs == 2 and g._xmix.bound[-1] == 1002
    assert [len(sp.segments) for sp in g._xmix.ir.splices] == [1, 1]
    assert not graphs.ensure_current(hs.cb)  # planned for this op list already

    # a mode change is a switch, not a re-plan
    assert graphs.set_mode(hs.cb, "steer", "off") == 2
    assert not graphs.ensure_current(hs.cb)
    assert graphs.stats()["toggled_nodes"] == 2

    # a deploy through ensure_current: re-planned once, then nothing to do
    hs.cb.install(lower(gated, SHAPE))
    assert graphs.ensure_current(hs.cb)
    assert g.execs == 3
    assert not graphs.ensure_current(hs.cb)
    # same program again: updated in place, no new exec
    assert graphs.on_apps_changed(hs.cb)["in_place"] == 1 and g.execs == 3


def test_orchestration_fallbacks(sim, monkeypatch):
    hs = sim
    pre0 = site_id("residual.pre", 0, 2)
    # the anchors noted while capturing do not match the graph: anchors stay
    SimPatch.graphs[3] = line(pre0, pre0, cb=hs.cb.ptr)
    g = SimGraph(3)
    splice.begin_capture(g)
    hs.cb.graph_hook.note_anchor(pre0, None, None, 8, 16, 16, 0, 0)
    splice.end_capture(g)
    splice.after_capture(g)
    assert g._xmix_state == "fallback" and graphs.stats()["fallback"] == 1
    assert all(t.enabled for t in G.plan(g._xmix.ir, graphs.program_for(hs.cb, 1)).enable)

    # the driver refuses the patched graph: put back as captured, instantiated again
    SimDriver.refuses = staticmethod(patched_template)
    g2 = _sim_capture(hs, 4, [pre0])
    assert g2._xmix_state == "fallback" and g2.execs == 1 and g2.calls == 1
    assert graphs.stats()["errors"] == 1
    SimDriver.refuses = staticmethod(lambda ir: False)

    # read-back mismatch under XMIX_GRAPH_VERIFY: put back as captured
    monkeypatch.setenv("XMIX_GRAPH_VERIFY", "1")
    SimPatch.mismatch = "expected: ... read back: ..."
    from xmix.lang.lowering import lower

    hs.cb.install(lower(_apps()[0], SHAPE))
    g3 = _sim_capture(hs, 5, [pre0])
    assert g3._xmix_state == "fallback" and not g3._xmix.ir.splices
    assert graphs.stats()["errors"] == 2

    # XMIX_GRAPH_PATCH=0: nothing is kept
    monkeypatch.setenv("XMIX_GRAPH_PATCH", "0")
    g4 = _sim_capture(hs, 6, [pre0])
    assert g4._xmix_state == "disabled" and g4 not in graphs.kept_graphs()


def test_ensure_current_replans_when_the_op_list_changes_at_a_reused_address(monkeypatch):
    """An undeploy + deploy between two steps must re-plan even when the new site op list
    lands at the address of the old one (CPython reuses freed memory): the fingerprint is
    the control block's ops_generation, not the list's id()."""
    from xmix.lang.lowering import lower

    steer, gated = _apps()
    hs = Harness(SHAPE, [steer], "cpu")
    cb = hs.cb
    calls = []
    monkeypatch.setattr(
        replan,
        "on_apps_changed",
        lambda c: (calls.append("replan"), state.planned.__setitem__(c, splice.fingerprint(c))),
    )
    assert graphs.ensure_current(cb) and calls == ["replan"]
    old_list, gen = cb.mem.site_ops, cb.mem.ops_generation
    cb.remove("steer")
    cb.install(lower(gated, SHAPE))
    assert cb.mem.ops_generation == gen + 2
    # what address reuse looks like: the new op list in the old list object
    old_list[:] = cb.mem.site_ops
    cb.mem.site_ops = old_list
    assert graphs.ensure_current(cb), "stale op nodes: the deploy was not re-planned"
    assert calls == ["replan", "replan"]


def test_reinstantiation_refused_after_a_replan_falls_back_to_anchors(sim):
    """The driver may refuse a graph first at a re-plan (its IF nodes appear only then).
    torch's instantiate() would destroy the graph's executable graph before trying and keep
    the destroyed handle: a second instantiate() of the graph as captured then raised out of
    on_apps_changed into the step. The applier's trial instantiation refuses it first: torch
    never sees the refused template, the graph is put back as captured and instantiated,
    logged and counted, and the re-plan reports it."""
    from xmix.lang.lowering import lower

    hs = sim
    pre0, pre1 = site_id("residual.pre", 0, 2), site_id("residual.pre", 1, 2)
    g = _sim_capture(hs, 11, [pre0, pre1])
    assert g._xmix_state == "patched" and g.execs == 1
    SimDriver.refuses = staticmethod(lambda ir: bool(ir.splices))  # spliced nodes: refused
    hs.cb.install(lower(_apps()[0], SHAPE))
    out = graphs.on_apps_changed(hs.cb)
    assert out["fallback"] == 1 and out["reinstantiated"] == 0 and out["errors"] == 1
    assert g.has_exec and not g.stale and g.execs == 2, "the fallback graph must have an exec"
    assert g.calls == 2, "torch instantiates the captured form only"
    assert g._xmix_state == "fallback" and not g._xmix.ir.splices
    assert all(n.enabled for n in g._xmix.ir.nodes if n.role == G.Role.Anchor)
    g.replay()
    st = graphs.stats()
    assert st["fallback"] == 1 and st["errors"] == 1
    # the next deploy tries again and, accepted this time, patches
    SimDriver.refuses = staticmethod(lambda ir: False)
    hs.cb.install(lower(_apps()[1], SHAPE))
    out = graphs.on_apps_changed(hs.cb)
    assert out["reinstantiated"] == 1 and g._xmix_state == "patched" and g.execs == 3


def test_torch_failing_after_the_trial_leaves_a_graph_on_the_appliers_own_exec(sim):
    """torch's instantiate() failing on a template the driver accepted a moment before (out of
    memory in between) leaves torch with a destroyed handle: the graph is put back as
    captured and replays an executable graph the applier owns, logged and counted; later
    re-plans leave it alone, and the step goes on."""
    from xmix.lang.lowering import lower

    hs = sim
    pre0, pre1 = site_id("residual.pre", 0, 2), site_id("residual.pre", 1, 2)
    g = _sim_capture(hs, 12, [pre0, pre1])
    SimDriver.torch_fail_at = {g.calls + 1}
    hs.cb.install(lower(_apps()[0], SHAPE))
    out = graphs.on_apps_changed(hs.cb)
    assert out["graphs"] == 1 and g.stale, "torch's handle is the destroyed one"
    rec = g._xmix
    assert rec.own and splice.exec_of(g) == rec.own and rec.bound[-1] == rec.own
    assert g._xmix_state == "fallback" and not rec.ir.splices
    assert all(n.enabled for n in rec.ir.nodes if n.role == G.Role.Anchor)
    assert graphs.stats()["own_exec"] == 1
    hs.cb.install(lower(_apps()[1], SHAPE))
    assert graphs.on_apps_changed(hs.cb)["graphs"] == 0, "a lost graph is not re-planned"


def test_a_gated_graph_is_instantiated_again_while_torchs_executable_graph_lives(sim, monkeypatch):
    """A template with conditional nodes (a gated op's IF; the applier parks, never destroys
    one) may have one executable graph at a time: the applier's trial instantiation, made
    while torch's exists, was refused whatever the template, and every re-plan of a gated graph
    fell back to its anchors (the first H200 run, 2026-12-04). Then torch's instantiate(),
    which destroys its old one first, is the trial; a refusal there leaves the graph on its
    anchors, replayed from an executable graph of the applier's own."""
    from xmix.lang.lowering import lower

    hs = sim
    monkeypatch.setattr(splice.G, "conditionals_supported", lambda: True)  # as on a GPU
    steer, gated = _apps()
    pre0, pre1 = site_id("residual.pre", 0, 2), site_id("residual.pre", 1, 2)
    g = _sim_capture(hs, 13, [pre0, pre1])
    hs.cb.install(lower(gated, SHAPE))
    assert graphs.on_apps_changed(hs.cb)["reinstantiated"] == 1
    assert g._xmix.one_instance_at_a_time and g.has_exec
    assert g._xmix.try_instantiate().startswith("cudaErrorNotSupported")
    hs.cb.install(lower(steer, SHAPE))
    out = graphs.on_apps_changed(hs.cb)
    assert out == {"graphs": 1, "reinstantiated": 1, "in_place": 0, "fallback": 0, "errors": 0}
    assert g._xmix_state == "patched" and g.execs == 3 and not g.__dict__.get("_xmix_own_exec")
    # the driver refusing the spliced template now: torch's instantiate() fails, the graph
    # runs its anchors from the applier's own executable graph, and the step goes on
    SimDriver.refuses = staticmethod(lambda ir: bool(ir.splices))
    hs.cb.remove("steer")
    out = graphs.on_apps_changed(hs.cb)
    rec = g._xmix
    assert g.stale and rec.own and splice.exec_of(g) == rec.own
    assert g._xmix_state == "fallback" and not rec.ir.splices
    assert graphs.stats()["own_exec"] == 1


def test_anchor_recognition_forms_are_counted_and_logged_once(sim, monkeypatch, caplog):
    """How the applier recognised anchor nodes (handle form or kernel name) is counted per
    graph and said once per form: a driver reporting an unexpected form shows in the log."""
    import logging

    hs = sim
    pre0 = site_id("residual.pre", 0, 2)
    monkeypatch.setattr(splice, "_forms_logged", set())
    SimPatch.forms = {"stub": 1, "name": 1}
    with caplog.at_level(logging.INFO, logger="vllm.xmix.graphs"):
        _sim_capture(hs, 31, [pre0, pre0 + 1])
        _sim_capture(hs, 32, [pre0, pre0 + 1])
    st = graphs.stats()
    assert (
        st["anchors_by_stub"] == 2 and st["anchors_by_name"] == 2 and st["anchors_by_kernel"] == 0
    )
    said = [r.getMessage() for r in caplog.records if "recognised by their" in r.getMessage()]
    assert len(said) == 2 and any("by their name" in m for m in said), said


# ---------------------------------------------------------------- first-replay check, simulated
class SimReplay:
    """A replay of a simulated graph: its pool holds out = x + effect, where the effect is
    the anchors' (1.0 per spliced op) or the patched exec's (`patched_error` added), and it
    accumulates into a stateful xmix buffer and writes a result channel, as latch sums and
    reads do. `noise` makes every replay differ (a nondeterministic graph)."""

    def __init__(self, g, cb, patched_error=0.0, noise=False):
        self.g, self.cb = g, cb
        self.x = torch.arange(8, dtype=torch.float32)
        self.pool = torch.zeros(8)
        self.patched_error, self.noise = patched_error, noise
        self.n = 0

    def __call__(self):
        self.n += 1
        rec = self.g._xmix
        effect = 0.0
        for sp in rec.ir.splices:
            for seg in sp.segments:
                if rec.config is None or not seg.custom:
                    effect += 1.0  # its op node runs, or the anchor runs the built-in op
                else:  # a user kernel runs only from its own nodes
                    effect += 1.0 if rec.config.get(seg.gate if seg.gated else seg.sel) else 0.0
        effect += 0.0 if rec.anchors_on else self.patched_error
        if self.noise:
            effect += 1e-3 * self.n
        self.pool.copy_(self.x + effect)
        self.cb.dev["vec_state"][0] += 1.0
        self.cb.dev["results"][0] = float(self.pool.sum())

    def regions(self, g):
        return [check._TensorRegion("pool", self.pool, exact=True)]


def _checked_graph(hs, monkeypatch, ptr, **kw):
    from xmix.lang.lowering import lower

    pre0, pre1 = site_id("residual.pre", 0, 2), site_id("residual.pre", 1, 2)
    if "steer" not in hs.cb.apps:
        hs.cb.install(lower(_apps()[0], SHAPE), mode="all")
    g = _sim_capture(hs, ptr, [pre0, pre1])
    rp = SimReplay(g, hs.cb, **kw)
    monkeypatch.setattr(check, "_pool_regions", rp.regions)
    return g, rp


ONE = {"a": Req(2, 0, 2, ())}


def test_first_replay_check_passes_and_changes_nothing(sim, monkeypatch):
    monkeypatch.delenv("XMIX_GRAPH_CHECK", raising=False)
    hs = sim
    g, rp = _checked_graph(hs, monkeypatch, 21)
    assert g._xmix_state == "patched" and g._xmix_check_due
    # a step that runs no app of the graph compares nothing: the check waits
    hs.cb.set_mode("steer", "off")
    hs.step(ONE)
    check.replay(g, rp)
    assert rp.n == 1 and g._xmix_check_due and graphs.stats()["checks"] == 0
    hs.cb.set_mode("steer", "all")
    hs.step(ONE)
    state0 = hs.cb.dev["vec_state"][0].item()
    check.replay(g, rp)
    assert rp.n == 3, "patched, then anchors"
    assert hs.cb.dev["vec_state"][0].item() == state0 + 1, "the check must leave one replay's state"
    assert torch.equal(rp.pool, rp.x + 2.0)
    st = graphs.stats()
    assert st["checks"] == 1 and st["check_passed"] == 1 and st["check_failed"] == 0
    assert g._xmix_state == "patched" and not g._xmix.anchors_on and not g._xmix_check_due
    check.replay(g, rp)  # later replays are plain
    assert rp.n == 4 and graphs.stats()["checks"] == 1


def test_first_replay_check_refuses_a_wrong_patched_graph(sim, monkeypatch):
    """A patched graph whose result differs from its anchors': the anchors' result is the
    one served, the graph is put back as captured for good, and it is counted."""
    from xmix.lang.lowering import lower

    monkeypatch.delenv("XMIX_GRAPH_CHECK", raising=False)
    hs = sim
    g, rp = _checked_graph(hs, monkeypatch, 22, patched_error=0.5)
    hs.step(ONE)
    state0 = hs.cb.dev["vec_state"][0].item()
    execs = g.execs
    check.replay(g, rp)
    assert torch.equal(rp.pool, rp.x + 2.0), "the served result must be the anchors'"
    assert hs.cb.dev["vec_state"][0].item() == state0 + 1
    assert hs.cb.dev["results"][0].item() == float((rp.x + 2.0).sum())
    st = graphs.stats()
    assert st["check_failed"] == 1 and st["check_passed"] == 0 and st["fallback"] == 1
    assert g._xmix_state == "fallback" and "differs from its anchors" in g._xmix_refused
    assert not g._xmix.ir.splices and g.execs == execs + 1
    assert all(n.enabled for n in g._xmix.ir.nodes if n.role == G.Role.Anchor)
    # deploys after that leave it as captured
    hs.cb.install(lower(_apps()[1], SHAPE))
    assert graphs.on_apps_changed(hs.cb)["graphs"] == 0
    assert not g._xmix.ir.splices and g._xmix_state == "fallback"


def test_first_replay_check_cannot_verify_a_nondeterministic_graph(sim, monkeypatch):
    monkeypatch.delenv("XMIX_GRAPH_CHECK", raising=False)
    hs = sim
    g, rp = _checked_graph(hs, monkeypatch, 23, noise=True)
    hs.step(ONE)
    check.replay(g, rp)
    assert rp.n == 3, "patched, anchors, anchors again"
    st = graphs.stats()
    assert st["check_unverifiable"] == 1 and st["check_failed"] == 0
    assert g._xmix_state == "fallback" and "not deterministic" in g._xmix_refused


def test_first_replay_check_switches(sim, monkeypatch):
    hs = sim
    monkeypatch.setenv("XMIX_GRAPH_CHECK", "0")
    g, rp = _checked_graph(hs, monkeypatch, 24, patched_error=0.5)
    assert not g._xmix_check_due
    hs.step(ONE)
    check.replay(g, rp)
    assert rp.n == 1 and graphs.stats()["checks"] == 0
    # a pool larger than XMIX_GRAPH_CHECK_MAX_MB is not snapshotted: anchors, unverified
    monkeypatch.setenv("XMIX_GRAPH_CHECK", "1")
    monkeypatch.setenv("XMIX_GRAPH_CHECK_MAX_MB", "0")
    g2, rp2 = _checked_graph(hs, monkeypatch, 25, patched_error=0.5)
    monkeypatch.setattr(
        check, "_pool_regions", lambda g: [check._RawRegion("pool", 0x1000, 1 << 20)]
    )
    hs.step(ONE)
    check.replay(g2, rp2)
    assert rp2.n == 1 and torch.equal(rp2.pool, rp2.x + 2.0), "one replay, with the anchors"
    assert graphs.stats()["check_unverifiable"] == 1 and g2._xmix_state == "fallback"
    # a graph whose pool the allocator does not know: its outputs cannot be compared
    monkeypatch.setenv("XMIX_GRAPH_CHECK_MAX_MB", "4096")
    g3, rp3 = _checked_graph(hs, monkeypatch, 27, patched_error=0.5)
    monkeypatch.setattr(check, "_pool_regions", lambda g: [])
    hs.step(ONE)
    check.replay(g3, rp3)
    assert rp3.n == 1 and torch.equal(rp3.pool, rp3.x + 2.0)
    assert graphs.stats()["check_unverifiable"] == 2 and "no segment" in g3._xmix_refused


USER_KERNEL = r"""
#include "xmix/custom.h"
extern "C" void leave_alone(const xmix_custom_args* a) { (void)a; }
"""


def _user_app(lib, name="user", layer=0):
    app = App(name)
    app.write("custom", cpu_library=lib, cpu_symbol="leave_alone").layers([layer]).at(
        "residual.pre"
    )
    return app


def test_first_replay_check_compares_user_kernels_like_with_like(sim, monkeypatch, tmp_path):
    """The anchor kernel runs a site's built-in ops, not user kernels: the anchor configuration
    keeps the user kernels' nodes (planner anchor_config), so a correct graph with a user
    kernel passes the check instead of falling back for good."""
    from harness import build_user_kernels
    from xmix.lang.lowering import lower

    monkeypatch.delenv("XMIX_GRAPH_CHECK", raising=False)
    hs = sim
    hs.cb.install(lower(_user_app(build_user_kernels(tmp_path, USER_KERNEL)), SHAPE), mode="all")
    g, rp = _checked_graph(hs, monkeypatch, 41)
    assert any(seg.custom for sp in g._xmix.ir.splices for seg in sp.segments)
    hs.step(ONE)
    check.replay(g, rp)
    st = graphs.stats()
    assert st["check_passed"] == 1 and st["check_failed"] == 0, st
    assert g._xmix_state == "patched" and torch.equal(rp.pool, rp.x + 3.0)


def test_a_graph_on_its_anchors_fails_the_requests_of_a_user_kernel(sim, monkeypatch, tmp_path):
    """A graph that replays its anchors cannot run user kernels: the step's requests that use
    an app with one at a site of the graph fail, saying why; others are untouched."""
    from harness import build_user_kernels
    from xmix.lang.lowering import lower

    hs = sim
    lib = build_user_kernels(tmp_path, USER_KERNEL)
    hs.cb.install(lower(_user_app(lib), SHAPE))
    hs.cb.install(lower(_apps()[0], SHAPE))
    hs.cb.install(lower(_user_app(lib, "user1", layer=1), SHAPE))
    pre0 = site_id("residual.pre", 0, 2)
    SimDriver.refuses = staticmethod(patched_template)
    g = _sim_capture(hs, 42, [pre0])  # holds layer 0's site only
    assert g._xmix_state == "fallback" and g._xmix_sites == {pre0}
    reqs = {
        "a": Req(2, 0, 2, ("user",)),
        "b": Req(1, 0, 1, ("steer",)),
        "c": Req(1, 0, 1, ("user1",)),
        "d": Req(1, 0, 1, ()),
    }
    hs.step(reqs)
    cls = hook._make_graph_class(_BaseGraph)
    xg = cls(False)
    xg._xmix_state, xg._xmix_sites, xg._xmix_refused = "fallback", {pre0}, "a reason"
    xg.replay()
    failed = hs.cb.take_failed()
    assert list(failed) == ["a"] and "user kernel cannot run" in failed["a"], failed
    assert graphs.stats()["custom_not_run"] == 1
    xg._xmix_state = "patched"  # spliced: the user kernel runs from its nodes
    hs.step(reqs)
    xg.replay()
    assert hs.cb.take_failed() == {}


class _BaseGraph:
    """A stand-in for torch.cuda.CUDAGraph under XmixCUDAGraph."""

    def __new__(cls, keep_graph=False):
        return object.__new__(cls)

    def __init__(self, keep_graph=False):
        self.keep = keep_graph
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_the_check_runs_on_a_bounded_number_of_graphs_per_deploy(sim, monkeypatch):
    """vLLM captures hundreds to thousands of piecewise graphs: once XMIX_GRAPH_CHECK_GRAPHS
    of a deploy passed, the deploy's other graphs replay unchecked; after a failure every
    graph of the deploy is checked; a new deploy starts over."""
    from xmix.lang.lowering import lower

    monkeypatch.delenv("XMIX_GRAPH_CHECK", raising=False)
    monkeypatch.setenv("XMIX_GRAPH_CHECK_GRAPHS", "2")
    hs = sim
    made = [_checked_graph(hs, monkeypatch, 50 + i) for i in range(4)]
    hs.step(ONE)
    for g, rp in made:
        monkeypatch.setattr(check, "_pool_regions", rp.regions)
        check.replay(g, rp)
    st = graphs.stats()
    assert st["checks"] == 2 and st["check_passed"] == 2 and st["check_skipped"] == 2, st
    assert [rp.n for _, rp in made] == [2, 2, 1, 1]
    # a new deploy: every graph re-planned and due again; the first check fails, so the rest
    # of this deploy's graphs are checked too
    hs.cb.install(lower(_apps()[1], SHAPE), mode="all")
    graphs.on_apps_changed(hs.cb)
    made[0][1].patched_error = 0.5
    hs.step(ONE)
    for g, rp in made:
        monkeypatch.setattr(check, "_pool_regions", rp.regions)
        check.replay(g, rp)
    st = graphs.stats()
    assert st["checks"] == 6 and st["check_failed"] == 1 and st["check_skipped"] == 2, st


class _FlakyRegion(check._TensorRegion):
    """A region whose k-th copy out fails as an allocation out of device memory would."""

    def __init__(self, t, fail_at: int):
        super().__init__("pool", t, exact=True)
        self.copies, self.fail_at = 0, fail_at

    def _copy(self):
        self.copies += 1
        if self.copies == self.fail_at:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def save(self):  # the API before the check allocated its memory up front
        self._copy()
        return self.t.detach().clone()

    def save_into(self, buf):
        self._copy()
        super().save_into(buf)


@pytest.mark.parametrize("fail_at", [1, 2])
def test_the_check_never_fails_the_step_for_want_of_memory(sim, monkeypatch, fail_at):
    """The snapshot before the replays (1) or after the patched replay (2) running out of
    device memory: the anchors' replay is served, the graph falls back unverified, and the
    step goes on (the patched snapshot was outside the check's guard and killed the step)."""
    monkeypatch.delenv("XMIX_GRAPH_CHECK", raising=False)
    hs = sim
    g, rp = _checked_graph(hs, monkeypatch, 60, patched_error=0.5)
    monkeypatch.setattr(check, "_pool_regions", lambda g_: [_FlakyRegion(rp.pool, fail_at)])
    hs.step(ONE)
    check.replay(g, rp)
    assert torch.equal(rp.pool, rp.x + 2.0), "the anchors' result is served"
    assert rp.n == fail_at
    st = graphs.stats()
    assert st["check_unverifiable"] == 1 and g._xmix_state == "fallback", st


def test_replan_that_changes_the_splices_arms_the_check_again(sim, monkeypatch):
    from xmix.lang.lowering import lower

    monkeypatch.delenv("XMIX_GRAPH_CHECK", raising=False)
    hs = sim
    g, rp = _checked_graph(hs, monkeypatch, 26)
    hs.step(ONE)
    check.replay(g, rp)
    assert not g._xmix_check_due and graphs.stats()["check_passed"] == 1
    graphs.on_apps_changed(hs.cb)  # same program: nothing new to check
    assert not g._xmix_check_due
    hs.cb.install(lower(_apps()[1], SHAPE), mode="all")
    graphs.on_apps_changed(hs.cb)
    assert g._xmix_check_due
    hs.step(ONE)
    check.replay(g, rp)
    assert graphs.stats()["check_passed"] == 2


def test_xmix_graph_class_routes_the_due_replay_through_the_check(sim, monkeypatch):
    """XmixCUDAGraph.replay itself (made over a stand-in for torch.cuda.CUDAGraph)."""
    monkeypatch.delenv("XMIX_GRAPH_CHECK", raising=False)
    hs = sim
    calls = []

    class Base:
        def __new__(cls, keep_graph=False):
            return object.__new__(cls)

        def __init__(self, keep_graph=False):
            self.keep = keep_graph

        def replay(self):
            calls.append("replay")

    cls = hook._make_graph_class(Base)
    g = cls(False)
    assert g.keep is True, "the subclass always keeps its graph"
    g.replay()
    assert calls == ["replay"]
    seen = []
    monkeypatch.setattr(
        check, "_first_replay_check", lambda gg, cb, base: seen.append(gg) or base()
    )
    from xmix.lang.lowering import lower

    hs.cb.install(lower(_apps()[0], SHAPE), mode="all")
    g._xmix_check_due, g._xmix_cb = True, hs.cb.ptr
    g._xmix_check_apps = 1 << hs.cb.apps["steer"].index
    hs.step(ONE)
    g.replay()
    assert seen == [g] and calls == ["replay", "replay"]


# ---------------------------------------------------------------- GPU: capture, patch, compare
GD, GL = 64, 2
GSHAPE = ModelShape(n_layers=GL, hidden_size=GD, vocab_size=128)


class TinyDecoder:
    """Two layers in vLLM's hidden + residual form with xmix sites; plain torch."""

    def __init__(self, dtype=torch.float32):
        g = torch.Generator().manual_seed(0)
        self.w = [
            (torch.randn(GD, GD, generator=g) / GD**0.5).to("cuda", dtype) for _ in range(2 * GL)
        ]

    def __call__(self, x):
        h, r = x.clone(), torch.zeros_like(x)
        for layer in range(GL):
            torch.ops.xmix.site(h, r, site_id("residual.pre", layer, GL))
            r = h + r
            h = torch.tanh(r @ self.w[2 * layer])
            torch.ops.xmix.site(h, None, site_id("attention.post", layer, GL))
            r = h + r
            h = torch.tanh(r @ self.w[2 * layer + 1])
            torch.ops.xmix.site(h, None, site_id("mlp.post", layer, GL))
        return h + r


def _gpu_apps():
    g = torch.Generator().manual_seed(1)
    steer = App("steer")
    steer.write("add", vector=torch.randn(GD, generator=g), scale=0.5).layers([0]).at(
        "residual.pre"
    ).cond("last_token")
    abl = App("abl")
    abl.write("ablate", direction=torch.randn(GD, generator=g)).layers("all").at("mlp.post")
    gate = App("gate")
    gate.param("theta", 0.5)
    gate.read("probe", weight=torch.randn(GD, generator=g), bias=0.0).layers([0]).at(
        "residual.pre"
    ).named("p")
    gate.write("add", vector=torch.randn(GD, generator=g), scale=1.0).layers([1]).at(
        "attention.post"
    ).cond("p >= theta")
    return steer, abl, gate


STEP = {
    "a": Req(3, 0, 3, ("steer", "abl")),
    "b": Req(1, 7, 4, ("steer", "abl")),
    "c": Req(2, 0, 2, ()),
}
N = 8  # rows in the graph: 6 tokens + 2 padding


@pytest.fixture
def gpu_env(monkeypatch):
    # These tests compare the patched graphs themselves with eager; the first-replay check
    # (which serves the anchors' result) has its own test.
    monkeypatch.setenv("XMIX_GRAPH_CHECK", "0")
    prev = ops.get_control()
    graphs.reset_stats()
    yield
    ops.set_control(prev)


def _capture(model, x):
    cls = graphs.graph_class()
    assert cls is not None, graphs.cuda_patching_available()
    model(x)  # warm-up outside capture
    torch.cuda.synchronize()
    g = cls()
    with torch.cuda.graph(g):
        out = model(x)
    return g, out


def _eager(hs, model, x):
    hs.step(STEP, pad_to=N)
    y = model(x)
    torch.cuda.synchronize()
    return y.clone(), hs.cb.dev["results"].clone()


def _replay(hs, g, out):
    hs.step(STEP, pad_to=N)
    g.replay()
    torch.cuda.synchronize()
    return out.clone(), hs.cb.dev["results"].clone()


def _roles(g):
    ir = g.xmix_ir()
    count = {}
    for n in ir.nodes:
        count[n.role] = count.get(n.role, 0) + (1 if n.enabled else 0)
    return ir, count


@pytest.mark.gpu
def test_gpu_patched_graph_matches_eager_in_every_state(gpu_env, monkeypatch):
    monkeypatch.setenv("XMIX_GRAPH_VERIFY", "1")
    steer, abl, gate = _gpu_apps()
    hs = Harness(GSHAPE, [steer, abl], "cuda")
    model = TinyDecoder()
    x = torch.randn(N, GD, generator=torch.Generator().manual_seed(2)).cuda()
    hs.step(STEP, pad_to=N)
    g, out = _capture(model, x)
    assert g.xmix_state == "patched", graphs.stats()
    ir, count = _roles(g)
    assert count.get(G.Role.Anchor, 0) == 0, "every anchor is disabled"
    assert count[G.Role.Op] == 1 + GL  # steer at L0, ablate at each layer
    assert graphs.stats()["errors"] == 0

    def check():
        y_e, r_e = _eager(hs, model, x)
        y_g, r_g = _replay(hs, g, out)
        torch.testing.assert_close(y_g, y_e, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r_g, r_e, rtol=1e-4, atol=1e-5, equal_nan=True)
        return y_g

    with_apps = check()
    # switching an app off disables its nodes; the result is the app-less one
    assert graphs.set_mode(hs.cb, "steer", "off") == 1
    off = check()
    assert not torch.equal(off, with_apps)
    assert graphs.set_mode(hs.cb, "steer", "request") == 1
    torch.testing.assert_close(check(), with_apps)

    # deploy after capture: re-splice and re-instantiate, no recapture
    from xmix.lang.lowering import lower

    hs.cb.install(lower(gate, GSHAPE), mode="all")
    summary = graphs.on_apps_changed(hs.cb)
    assert summary["reinstantiated"] == 1 and summary["errors"] == 0
    ir, count = _roles(g)
    # + the probe, + the gated add (its op node sits in the IF body)
    assert count[G.Role.Gate] == 1 and count[G.Role.Op] == 1 + GL + 2
    ifs = [n.id for n in ir.nodes if n.type == G.NodeType.Conditional]
    assert len(ifs) == 1
    assert [n.role for n in ir.nodes if n.parent == ifs[0]] == [G.Role.Op]
    # the IF gate false for every token (sigmoid < 2), then true for some: theta = the
    # median of this step's probe values over the real tokens
    hs.cb.set_params("gate", {"theta": 2.0})
    off_gate = check()
    ch = hs.cb.apps["gate"].channels["p"]
    R = hs.cb.cap.max_channels
    p = hs.cb.dev["results"].view(-1, R)[:6, ch].cpu()
    assert not torch.isnan(p).any()
    theta = float(p.median())
    hs.cb.set_params("gate", {"theta": theta})
    some_selected = check()
    sel = p >= theta
    assert sel.any() and not sel.all()
    # rows are independent in this model: exactly the selected tokens' outputs move
    changed = (some_selected[:6] != off_gate[:6]).any(dim=1).cpu()
    assert torch.equal(changed, sel), (changed, sel)

    # undeploy everything: the template is the captured graph again
    for name in ("steer", "abl", "gate"):
        hs.cb.remove(name)
    graphs.on_apps_changed(hs.cb)
    ir = g.xmix_ir()
    assert not ir.splices
    assert all(n.role in (G.Role.Foreign, G.Role.Anchor) for n in ir.nodes)
    check()


@pytest.mark.gpu
def test_gpu_patching_off_keeps_anchors_and_stays_correct(gpu_env, monkeypatch):
    monkeypatch.setenv("XMIX_GRAPH_PATCH", "0")
    steer, abl, _ = _gpu_apps()
    hs = Harness(GSHAPE, [steer, abl], "cuda")
    model = TinyDecoder()
    x = torch.randn(N, GD, generator=torch.Generator().manual_seed(3)).cuda()
    hs.step(STEP, pad_to=N)
    g, out = _capture(model, x)
    assert g.xmix_state == "disabled" and graphs.stats()["disabled"] == 1
    y_e, _ = _eager(hs, model, x)
    y_g, _ = _replay(hs, g, out)
    torch.testing.assert_close(y_g, y_e, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_graph_without_sites_is_plain(gpu_env):
    hs = Harness(GSHAPE, [], "cuda")
    hs.step({"a": Req(3, 0, 3, ()), "c": Req(2, 0, 2, ())}, pad_to=N)  # nothing deployed
    w = torch.randn(GD, GD, device="cuda")
    g, out = _capture(lambda x: torch.tanh(x @ w), torch.randn(N, GD, device="cuda"))
    assert g.xmix_state == "plain" and g not in graphs.kept_graphs()


@pytest.mark.gpu
def test_gpu_first_replay_check_passes_a_correct_graph_and_refuses_a_broken_one(
    gpu_env, monkeypatch
):
    monkeypatch.setenv("XMIX_GRAPH_CHECK", "1")
    steer, abl, _ = _gpu_apps()
    hs = Harness(GSHAPE, [steer, abl], "cuda")
    model = TinyDecoder()
    x = torch.randn(N, GD, generator=torch.Generator().manual_seed(4)).cuda()
    hs.step(STEP, pad_to=N)
    y_e, r_e = _eager(hs, model, x)
    g, out = _capture(model, x)
    assert g.xmix_state == "patched" and g._xmix_check_due
    y_g, r_g = _replay(hs, g, out)
    st = graphs.stats()
    assert st["checks"] == 1 and st["check_passed"] == 1, st
    assert g.xmix_state == "patched" and not g._xmix_check_due
    torch.testing.assert_close(y_g, y_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r_g, r_e, rtol=1e-4, atol=1e-5, equal_nan=True)
    # the same graph, its ablation nodes switched off behind the control block's back: the
    # patched result is wrong, the check serves the anchors' and puts the graph back
    g2, out2 = _capture(model, x)
    assert (
        g2._xmix.set_app_enabled(int(g2.raw_cuda_graph_exec()), hs.cb.apps["abl"].index, False)
        == GL
    )
    y2, _ = _replay(hs, g2, out2)
    st = graphs.stats()
    assert st["check_failed"] == 1 and g2.xmix_state == "fallback", (st, g2._xmix_refused)
    torch.testing.assert_close(y2, y_e, rtol=1e-4, atol=1e-5)
    y3, _ = _replay(hs, g2, out2)
    torch.testing.assert_close(y3, y_e, rtol=1e-4, atol=1e-5)
