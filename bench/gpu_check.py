#!/usr/bin/env python
"""GPU check of CUDA graph interposition on a Llama-shaped decoder (plain PyTorch, random
weights, no vLLM): capture it in CUDA graphs at several batch sizes, patch them, check the
patched graphs against eager execution for every primitive and condition (enabled and
disabled), then time a decode step per batch for the configurations of docs/cuda_graphs.md.

Run through bench/gpu_check.sh (it builds xmix._C first). Without a GPU it does the parts
that need none (lowering the check apps for the full model shape, planning the decoder's
anchor layout) and stops with "no GPU: stopped before ...".
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

os.environ.setdefault("XMIX_GRAPH_VERIFY", "1")  # every patch is read back and compared

from xmix import _C, graphs, ops  # noqa: E402
from xmix.api import App  # noqa: E402
from xmix.control import Capacity, ControlBlock  # noqa: E402
from xmix.hooks import ModelShape, site_id  # noqa: E402
from xmix.lowering import lower  # noqa: E402

G = _C.graph
SITES = ("residual.pre", "attention.post", "mlp.post")
FAILURES: list[str] = []


def say(msg: str = "") -> None:
    print(msg, flush=True)


def check(ok: bool, what: str) -> bool:
    say(f"  {'PASS' if ok else 'FAIL'}  {what}")
    if not ok:
        FAILURES.append(what)
    return ok


# ---------------------------------------------------------------- apps
def vec(d: int, seed: int) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


@dataclass
class Case:
    name: str
    app: App
    mode: str = "all"              # "request": only rows a, b, c use the app
    reads: bool = False            # compare result channels / capture buffer too
    gate_param: str | None = None  # gated cases: run with the gate false, then true for some


def check_cases(d: int, n_layers: int) -> list[Case]:
    mid = n_layers // 2
    cases = []

    def add_case(name, cond, mode="all", layer=mid, site="residual.pre", scale=4.0):
        a = App(name)
        a.token_set("t", ids=[7, 14, 21])
        a.token_set("o", ids=[7])
        a.token_set("c", ids=[21])
        a.write("add", vector=vec(d, 1), scale=scale).layers([layer]).submodule(site).cond(cond)
        cases.append(Case(name, a, mode))

    add_case("add_all", None)
    add_case("add_last_token", "last_token", mode="request")
    add_case("add_prompt", "prompt")
    add_case("add_generated", "generated", site="attention.post")
    add_case("add_token_in", "token_in(t)", site="mlp.post")
    add_case("add_in_span", "in_span(o, c)")

    a = App("ablate_all_layers")
    a.write("ablate", direction=vec(d, 2)).layers("all").submodule("residual.pre")
    cases.append(Case(a.name, a))
    a = App("clamp_not_last")
    a.write("clamp", direction=vec(d, 3), min=-0.5, max=0.5).layers([mid]).submodule("mlp.post") \
     .cond("not last_token")
    cases.append(Case(a.name, a))
    a = App("affine_last")
    g = torch.Generator().manual_seed(4)
    A = torch.eye(d) + torch.randn(d, d, generator=g) / (4 * math.sqrt(d))
    a.write("affine", matrix=A, mu_s=vec(d, 5) * 0.1, mu_t=vec(d, 6) * 0.1).layers([mid]) \
     .submodule("residual.pre").cond("last_token")
    cases.append(Case(a.name, a))

    a = App("probe_reads")
    a.read("probe", weight=vec(d, 7) / math.sqrt(d), bias=0.1).layers([1, mid]) \
     .submodule("residual.pre").named("p")
    cases.append(Case(a.name, a, reads=True))
    a = App("capture_last")
    a.read("capture", dims=(0, 16)).layers([mid]).submodule("mlp.post").named("cap").cond("last_token")
    cases.append(Case(a.name, a, reads=True))
    a = App("distance_read")
    a.read("distance", centroids=torch.randn(4, d, generator=torch.Generator().manual_seed(8)) * 8) \
     .layers([mid]).submodule("attention.post").named("dist")
    cases.append(Case(a.name, a, reads=True))
    a = App("cosine_prompt")
    a.read("cosine", vector=vec(d, 9)).layers([2]).submodule("residual.pre").named("cast")
    cases.append(Case(a.name, a, reads=True))

    a = App("gated_write")
    a.param("theta", 0.5)
    a.read("probe", weight=vec(d, 10) / math.sqrt(d), bias=0.0).layers([1]).submodule("residual.pre").named("p")
    a.write("add", vector=vec(d, 11), scale=4.0).layers([mid]).submodule("mlp.post").cond("p >= theta")
    cases.append(Case(a.name, a, reads=True, gate_param="theta"))
    a = App("latched_ablate")
    a.param("theta", 0.5)
    a.read("probe", weight=vec(d, 12) / math.sqrt(d), bias=0.0).layers([1]).submodule("residual.pre").named("p")
    a.write("ablate", direction=vec(d, 13)).layers([mid]).submodule("residual.pre") \
     .cond("prompt_last(p) >= theta or p >= theta")
    cases.append(Case(a.name, a, reads=True, gate_param="theta"))

    a = App("three_ops_one_site")
    a.read("probe", weight=vec(d, 14) / math.sqrt(d), bias=0.0).layers([mid]).submodule("attention.post").named("q")
    a.write("add", vector=vec(d, 15), scale=2.0).layers([mid]).submodule("attention.post")
    a.write("ablate", direction=vec(d, 16)).layers([mid]).submodule("attention.post").cond("q >= 0.5")
    cases.append(Case(a.name, a, reads=True))
    return cases


def bench_apps(d: int, n_layers: int) -> dict[str, App]:
    add = App("bench_add")
    add.write("add", vector=vec(d, 20), scale=2.0).layers([n_layers // 2]).submodule("residual.pre")
    abl = App("bench_ablate")
    for s in SITES:
        abl.write("ablate", direction=vec(d, 21)).layers("all").submodule(s)
    gate = App("bench_gated")
    gate.param("theta", 2.0)
    gate.read("probe", weight=vec(d, 22) / math.sqrt(d), bias=0.0).layers([1]).submodule("residual.pre").named("p")
    gate.write("add", vector=vec(d, 23), scale=2.0).layers([n_layers // 2]).submodule("mlp.post").cond("p >= theta")
    return {"add": add, "ablate": abl, "gated": gate}


def capacity() -> Capacity:
    return Capacity(max_tokens=512, max_slots=256, max_apps=32, max_params=1024, max_channels=64,
                    max_ops=1024, max_cond=1024, capture_floats=1 << 20)


# ---------------------------------------------------------------- the part that needs no GPU
def cpu_part(shape: ModelShape) -> None:
    say("== without a GPU: apps lowered for the full shape, planner on the decoder's anchor layout")
    cb = ControlBlock(shape, "cpu", capacity())
    n = 0
    for c in check_cases(shape.hidden_size, shape.n_layers) + [Case(k, a) for k, a in bench_apps(shape.hidden_size, shape.n_layers).items()]:
        lower(c.app, shape)
        n += 1
    for a in bench_apps(shape.hidden_size, shape.n_layers).values():
        cb.install(lower(a, shape), mode="all")
    check(n > 0, f"{n} apps lowered for {shape.n_layers} layers x d={shape.hidden_size}")
    nodes, edges, nid = [G.Node(0)], [], 1
    for layer in range(shape.n_layers):
        for s in SITES:
            a = G.AnchorArgs(cb.ptr, site_id(s, layer, shape.n_layers), 8, shape.hidden_size)
            nodes += [G.Node(nid, G.NodeType.Kernel, G.Role.Anchor, anchor=a), G.Node(nid + 1)]
            edges += [G.Edge(nid - 1, nid), G.Edge(nid, nid + 1)]
            nid += 2
    g = G.Graph(nodes, edges)
    plan = G.plan(g, graphs.program_for(cb, expected_anchors=3 * shape.n_layers, use_conditionals=True))
    roles = {}
    for nn in plan.add:
        roles[str(nn.role).split(".")[-1]] = roles.get(str(nn.role).split(".")[-1], 0) + 1
    check(not plan.fallback and plan.n_anchors == 3 * shape.n_layers,
          f"plan: {plan.n_anchors} anchors, added {roles}, {len(plan.edges)} edges")
    after = G.apply(g, plan)
    check(G.plan(after, graphs.program_for(cb, expected_anchors=3 * shape.n_layers, use_conditionals=True)).is_noop(),
          "re-plan of the patched layout is a no-op")


# ---------------------------------------------------------------- the model
def rmsnorm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w


class Decoder:
    """Llama-shaped decoder step in vLLM's hidden + residual form; attention reads a static
    KV cache (timing realism, not language modelling)."""

    def __init__(self, n_layers, d, ffn, heads, ctx, max_batch, dtype=torch.bfloat16):
        self.L, self.d, self.H, self.hd = n_layers, d, heads, d // heads
        dev = "cuda"
        torch.manual_seed(0)

        def w(*shape, fan_in):
            return torch.randn(*shape, device=dev, dtype=dtype) / math.sqrt(fan_in)

        self.layers = []
        for _ in range(n_layers):
            self.layers.append(dict(
                ln1=torch.ones(d, device=dev, dtype=dtype), ln2=torch.ones(d, device=dev, dtype=dtype),
                wqkv=w(d, 3 * d, fan_in=d), wo=w(d, d, fan_in=d),
                wgu=w(d, 2 * ffn, fan_in=d), wd=w(ffn, d, fan_in=ffn),
                k=torch.randn(max_batch, heads, ctx, self.hd, device=dev, dtype=dtype),
                v=torch.randn(max_batch, heads, ctx, self.hd, device=dev, dtype=dtype)))
        self.lnf = torch.ones(d, device=dev, dtype=dtype)

    def __call__(self, x, sites=True):
        site = torch.ops.xmix.site
        B, L = x.shape[0], self.L
        h, r = x.clone(), torch.zeros_like(x)
        for i, p in enumerate(self.layers):
            if sites:
                site(h, r, site_id("residual.pre", i, L))
            r = h + r
            q = (rmsnorm(r, p["ln1"]) @ p["wqkv"])[:, : self.d].reshape(B, self.H, 1, self.hd)
            a = torch.nn.functional.scaled_dot_product_attention(q, p["k"][:B], p["v"][:B])
            o = a.reshape(B, self.d) @ p["wo"]
            if sites:
                site(o, None, site_id("attention.post", i, L))
            r = o + r
            gu = rmsnorm(r, p["ln2"]) @ p["wgu"]
            g, u = gu.chunk(2, dim=-1)
            h = (torch.nn.functional.silu(g) * u) @ p["wd"]
            if sites:
                site(h, None, site_id("mlp.post", i, L))
        return rmsnorm(h + r, self.lnf)


# ---------------------------------------------------------------- steps and runs
STATE = ("read_state", "vec_state", "slot_span", "results", "capture", "counters")


class Runner:
    def __init__(self, cb: ControlBlock, model: Decoder, d: int):
        self.cb, self.model, self.d = cb, model, d
        self.live: list[str] = []
        self.n = 0

    def step(self, rows, ids):
        """rows: (n_tokens, start_pos, prompt_len, apps) per request, tokens contiguous."""
        cb = self.cb
        # Released in reverse so the next admissions get the same slots in the same order:
        # per-slot state must line up between the runs that are compared.
        for r in reversed(self.live):
            cb.release(r)
        self.live = []
        slots = []
        for n_tok, start, plen, apps in rows:
            self.n += 1
            rid = f"r{self.n}"
            slots.append(cb.admit(rid, list(apps), None, plen))
            self.live.append(rid)
        import numpy as np

        cb.begin_step(np.array(slots, dtype=np.int32), np.array([r[0] for r in rows]),
                      np.array([r[1] for r in rows]), np.array([r[2] for r in rows]), len(ids))
        cb.prologue(ids)
        ops.set_control(cb)

    def snapshot(self):
        return {k: self.cb.dev[k].clone() for k in STATE}

    def restore(self, snap):
        for k, v in snap.items():
            self.cb.dev[k].copy_(v)

    def outputs(self, y, B):
        R = self.cb.cap.max_channels
        return (y.float().clone(), self.cb.dev["results"][: B * R].view(B, R).clone(),
                self.cb.dev["capture"].clone())


def mixed_rows(B: int, apps: tuple[str, ...]):
    """B tokens: a prompt chunk with its last token, a partial prefill, decode tokens; the
    first three requests use `apps`, the rest do not."""
    if B == 8:
        return [(3, 0, 3, apps), (2, 0, 5, apps), (1, 9, 4, apps), (1, 5, 2, ()), (1, 3, 3, ())]
    rows = [(1, 10 + i, 4, apps if i % 2 == 0 else ()) for i in range(B)]
    return rows


def rel(a, b) -> float:
    return float((a - b).norm() / max(b.norm(), 1e-6))


# ---------------------------------------------------------------- GPU part
def capture(cls, model, x, sites=True, patch_env: str | None = None):
    old = os.environ.get("XMIX_GRAPH_PATCH")
    if patch_env is not None:
        os.environ["XMIX_GRAPH_PATCH"] = patch_env
    try:
        model(x, sites)  # warm-up (cuBLAS handles, allocator) outside capture
        torch.cuda.synchronize()
        g = cls()
        with torch.cuda.graph(g):
            out = model(x, sites)
        torch.cuda.synchronize()
        return g, out
    finally:
        if patch_env is not None:
            if old is None:
                os.environ.pop("XMIX_GRAPH_PATCH", None)
            else:
                os.environ["XMIX_GRAPH_PATCH"] = old


def time_replay(g, reps: int) -> float:
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1000.0 / reps  # us


def kernel_name(cu, ok, params) -> str:
    # Lazily loaded modules may leave only the CUkernel (kern) in the node's parameters.
    try:
        name = ok(cu.cuFuncGetName(params.func))
    except Exception:  # noqa: BLE001
        name = ok(cu.cuKernelGetName(params.kern))
    return name.decode() if isinstance(name, bytes) else str(name)


def structural_check(g, expect_ops: int, expect_ifs: int, n_anchors: int) -> None:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        say("  SKIP  structural check with cuda-python: cuda-bindings is not installed")
        return
    try:
        def ok(res):
            err = res[0]
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(str(err))
            return res[1:] if len(res) > 2 else res[1]

        graph = cu.CUgraph(int(g.raw_cuda_graph()))
        exe = cu.CUgraphExec(int(g.raw_cuda_graph_exec()))
        _, n = ok(cu.cuGraphGetNodes(graph, 0))
        nodes, _ = ok(cu.cuGraphGetNodes(graph, n))
        names = {"xmix_site_anchor": [], "xmix_op_kernel": [], "xmix_gate_kernel": []}
        n_if = 0
        for node in nodes:
            t = ok(cu.cuGraphNodeGetType(node))
            if t == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL:
                n_if += 1
            if t != cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                continue
            name = kernel_name(cu, ok, ok(cu.cuGraphKernelNodeGetParams(node)))
            for k in names:
                if k in name:
                    names[k].append(node)
        anchors_on = sum(ok(cu.cuGraphNodeGetEnabled(exe, a)) for a in names["xmix_site_anchor"])
        check(len(names["xmix_site_anchor"]) == n_anchors and anchors_on == 0,
              f"cuda-python: {len(names['xmix_site_anchor'])} anchor nodes, {anchors_on} enabled")
        # op nodes inside IF bodies are not top-level nodes: top level = all ops - gated ones
        check(len(names["xmix_op_kernel"]) == expect_ops - expect_ifs,
              f"cuda-python: {len(names['xmix_op_kernel'])} top-level op nodes (expected {expect_ops - expect_ifs})")
        check(len(names["xmix_gate_kernel"]) == expect_ifs and n_if >= expect_ifs,
              f"cuda-python: {len(names['xmix_gate_kernel'])} gate nodes, {n_if} conditional nodes")
        for op in names["xmix_op_kernel"]:
            _, nd = ok(cu.cuGraphNodeGetDependencies(op, 0))
            if nd == 0:
                check(False, "cuda-python: a spliced op node has no dependency")
                break
    except Exception as e:  # noqa: BLE001 - a binding that differs from the one written for
        check(False, f"structural check with cuda-python raised {type(e).__name__}: {e}")


def gpu_part(args, shape: ModelShape) -> None:
    cls = graphs.graph_class()
    if cls is None:
        check(False, f"graph patching unavailable: {graphs.cuda_patching_available()}")
        return
    say(f"== device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {_C.cuda_status()}, "
        f"conditional nodes: {G.conditionals_supported()}")
    t = time.time()
    model = Decoder(shape.n_layers, shape.hidden_size, args.ffn, args.heads, args.ctx, max(args.batches))
    cb = ControlBlock(shape, "cuda", capacity())
    run = Runner(cb, model, shape.hidden_size)
    say(f"   model and control block ready in {time.time() - t:.1f}s "
        f"({torch.cuda.memory_allocated() / 2**30:.1f} GiB)")

    d = shape.hidden_size
    xs, ids, g_base, g_anchor, g_patch = {}, {}, {}, {}, {}
    t = time.time()
    for B in args.batches:
        xs[B] = torch.randn(B, d, device="cuda", dtype=torch.bfloat16)
        ids[B] = ((torch.arange(B) * 7) % 50).to(torch.int32).cuda()
        run.step(mixed_rows(B, ()), ids[B])
        g_base[B] = capture(torch.cuda.CUDAGraph, model, xs[B], sites=False)
        g_anchor[B] = capture(cls, model, xs[B], patch_env="0")
        g_patch[B] = capture(cls, model, xs[B])
    n_anchors = 3 * shape.n_layers
    say(f"   captured {3 * len(args.batches)} graphs in {time.time() - t:.1f}s; stats {graphs.stats()}")
    check(all(g_patch[B][0].xmix_state == "patched" for B in args.batches), "every xmix graph patched")
    check(all(g_anchor[B][0].xmix_state == "disabled" for B in args.batches),
          "XMIX_GRAPH_PATCH=0 keeps the anchors")

    # ---- correctness: patched graph vs eager (and vs the anchor graph) per case
    say("== correctness: patched graph vs eager, enabled and disabled")
    check_batches = [b for b in (8, 256) if b in args.batches] or args.batches[:1]
    base_snap = run.snapshot()
    for case in check_cases(d, shape.n_layers):
        cb.install(lower(case.app, shape), mode="request" if case.mode == "request" else "all")
        summary = graphs.on_apps_changed(cb)
        if summary["errors"] or summary["fallback"]:
            check(False, f"{case.name}: re-plan {summary}")
        for B in check_batches:
            x = xs[B]
            apps = (case.name,) if case.mode == "request" else ()
            thetas = [None]
            if case.gate_param:
                thetas = [2.0, "median"]
            for mode in ("on", "off"):
                graphs.set_mode(cb, case.name, ("request" if case.mode == "request" else "all") if mode == "on" else "off")
                for theta in thetas if mode == "on" else [None]:
                    if theta == 2.0:
                        cb.set_params(case.name, {case.gate_param: 2.0})
                    elif theta == "median":
                        ch = cb.apps[case.name].channels["p"]
                        p = cb.dev["results"][: B * cb.cap.max_channels].view(B, -1)[:, ch].float()
                        p = p[~torch.isnan(p)]
                        if p.numel() < 2:
                            check(False, f"{case.name}: no probe values to set the gate from")
                            continue
                        cb.set_params(case.name, {case.gate_param: float(p.median())})
                    rows = mixed_rows(B, apps)
                    results = []
                    # eager: the reference path (its kernels are checked against xmix.reference
                    # by tests/test_kernels.py); anchors: the same graph unpatched, whose torch
                    # kernels match the patched graph's exactly; base: the graph without sites.
                    for kind in ("eager", "patched", "anchors", "base"):
                        run.restore(base_snap)
                        run.step(rows, ids[B])
                        if kind == "eager":
                            y = model(x)
                        else:
                            gg, out = {"patched": g_patch, "anchors": g_anchor, "base": g_base}[kind][B]
                            gg.replay()
                            y = out
                        torch.cuda.synchronize()
                        results.append(run.outputs(y, B))
                    (ye, re_, ce), (yp, rp, cp), (ya, ra, ca), (yb, _, _) = results
                    tag = f"{case.name} B={B} {mode}" + (f" theta={theta}" if theta is not None else "")
                    vs_anchor, vs_eager = rel(yp, ya), rel(yp, ye)
                    ok = vs_anchor < 1e-3 and vs_eager < 5e-2
                    if case.reads and mode == "on":
                        try:
                            torch.testing.assert_close(rp, ra, rtol=1e-3, atol=1e-3, equal_nan=True)
                            torch.testing.assert_close(cp, ca, rtol=1e-3, atol=1e-3, equal_nan=True)
                            torch.testing.assert_close(rp, re_, rtol=5e-2, atol=5e-2, equal_nan=True)
                            torch.testing.assert_close(cp, ce, rtol=5e-2, atol=5e-2, equal_nan=True)
                        except AssertionError as e:
                            ok = False
                            say(f"        reads differ: {str(e).splitlines()[0]}")
                    effect = rel(yp, yb)
                    if mode == "off" or theta == 2.0:
                        # nothing may change: the same as the graph without any site
                        ok = ok and effect < 1e-3
                        extra = f", vs no sites {effect:.1e}"
                    else:
                        extra = f", effect {effect:.1e}"
                    check(ok, f"{tag}: rel err vs anchors {vs_anchor:.1e} (bitwise {torch.equal(yp, ya)}), "
                              f"vs eager {vs_eager:.1e}{extra}")
        cb.remove(case.name)
    graphs.on_apps_changed(cb)

    # ---- structure of a patched graph with a plain op and a gated write
    say("== structure")
    apps = bench_apps(d, shape.n_layers)
    for a in apps.values():
        cb.install(lower(a, shape), mode="off")
    graphs.on_apps_changed(cb)
    Bs = check_batches[0]
    n_ops = 1 + 3 * shape.n_layers + 2
    structural_check(g_patch[Bs][0], n_ops, 1, n_anchors)
    ir = g_patch[Bs][0].xmix_ir()
    on = [n for n in ir.nodes if n.enabled and n.role != G.Role.Foreign and n.parent == -1]
    check(not on, f"all apps off: {len(on)} enabled xmix nodes at the top level (IF nodes excluded)"
          if not on else f"all apps off but {len(on)} xmix nodes enabled")

    # ---- timing
    say("== decode-step time per batch (us per graph replay, mean of %d)" % args.reps)
    rows = {}

    def decode_step(B):
        run.step([(1, 100, 4, ())] * B, ids[B])

    def measure(label, which):
        rows.setdefault(label, {})
        for B in args.batches:
            decode_step(B)
            rows[label][B] = time_replay(which[B][0], args.reps)

    # no xmix at all / anchors only (unpatched) with nothing running / patched, everything off
    for n in list(cb.apps):
        cb.remove(n)
    graphs.on_apps_changed(cb)
    measure("no xmix (graph without sites)", g_base)
    measure("anchors, no app (XMIX_GRAPH_PATCH=0)", g_anchor)
    measure("patched, no app", g_patch)
    for a in apps.values():
        cb.install(lower(a, shape), mode="off")
    graphs.on_apps_changed(cb)
    measure("apps deployed, all off", g_patch)
    measure("  all off, unpatched anchors", g_anchor)
    graphs.set_mode(cb, "bench_add", "all")
    measure("one single-layer add on", g_patch)
    graphs.set_mode(cb, "bench_add", "off")
    graphs.set_mode(cb, "bench_ablate", "all")
    measure(f"ablation on all layers (3 sites x {shape.n_layers})", g_patch)
    measure("  ablation, unpatched anchors", g_anchor)
    graphs.set_mode(cb, "bench_ablate", "off")
    graphs.set_mode(cb, "bench_gated", "all")
    cb.set_params("bench_gated", {"theta": 2.0})
    measure("gated write, gate false for all", g_patch)
    cb.set_params("bench_gated", {"theta": 0.0})
    measure("gated write, gate true", g_patch)
    graphs.set_mode(cb, "bench_gated", "off")

    width = max(len(k) for k in rows) + 2
    say("".join([f"{'configuration':<{width}}"] + [f"{'B=' + str(B):>12}" for B in args.batches]))
    base = rows["no xmix (graph without sites)"]
    for label, vals in rows.items():
        cells = [f"{vals[B]:>8.1f}" + (f"{100 * (vals[B] / base[B] - 1):+4.0f}%" if label != "no xmix (graph without sites)" else "     ")
                 for B in args.batches]
        say(f"{label:<{width}}" + "".join(f"{c:>12}" for c in cells))

    # ---- control costs (host side, between steps)
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        graphs.set_mode(cb, "bench_add", "all")
        graphs.set_mode(cb, "bench_add", "off")
    toggle = (time.perf_counter() - t0) / (2 * n) * 1e6
    idx = cb.apps["bench_ablate"].index
    t0 = time.perf_counter()
    for _ in range(n):
        nodes = graphs.set_app_enabled(cb, idx, False)
    switch = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for i in range(n):
        cb.set_params("bench_add", {"scale": 1.0 + i / n})
    param = (time.perf_counter() - t0) / n * 1e6
    aidx = cb.apps["bench_add"].index
    t0 = time.perf_counter()
    for _ in range(n):
        upd = graphs.refresh_params(cb, aidx)
    node_param = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    ng = len(graphs.kept_graphs())
    say(f"toggle (mode change: control block write + node switch in {ng} graphs): {toggle:.1f} us")
    say(f"  node switch only, ablation app ({nodes} nodes over {ng} graphs): {switch:.1f} us")
    say(f"parameter update (control block write, no graph update needed): {param:.1f} us")
    say(f"  cudaGraphExecKernelNodeSetParams on one app's nodes ({upd} nodes over {ng} graphs): {node_param:.1f} us")
    check(graphs.stats()["errors"] == 0, f"no patch error or plan mismatch ({graphs.stats()})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    args.batches = sorted(int(b) for b in args.batches.split(","))
    shape = ModelShape(n_layers=args.layers, hidden_size=args.d, vocab_size=32000)
    say(f"== xmix gpu_check: {args.layers} layers, d={args.d}, batches {args.batches}; "
        f"_C: {_C.cuda_status()}")
    t = time.time()
    cpu_part(shape)
    if not torch.cuda.is_available():
        say(f"no GPU: stopped before allocating the model and capturing CUDA graphs "
            f"(the part above ran in {time.time() - t:.1f}s)")
        return 1 if FAILURES else 0
    gpu_part(args, shape)
    say(f"== done in {time.time() - t:.0f}s: {len(FAILURES)} failure(s)")
    for f in FAILURES:
        say(f"   FAIL {f}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
