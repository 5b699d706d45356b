#!/usr/bin/env python
"""GPU check of CUDA graph interposition on a Llama-shaped decoder (plain PyTorch, random
weights, no vLLM): capture it in CUDA graphs at several batch sizes, both as one full graph
and piecewise (one graph per segment between attention calls, attention eager in between,
all graphs in one memory pool: vLLM's PIECEWISE mode), patch them, check the patched graphs
against eager execution and against their own anchors for every primitive and condition
(enabled and disabled), check the first-replay check (XMIX_GRAPH_CHECK) on a correct and on
a deliberately broken graph, then time a decode step per batch for the configurations of
docs/cuda_graphs.md.

Run through bench/gpu_check.sh (it builds xmix._C first). Without a GPU it does the parts
that need none: lowering the check apps for the full model shape, planning the decoder's
anchor layout, and the whole correctness orchestration on a tiny decoder on the CPU (every
"graph" is then the eager model) so a change that breaks this script fails CI.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpu_check_reference as gref  # noqa: E402 - bench/, beside this script
import numpy as np
import torch

from xmix import _C
from xmix.lang.api import App
from xmix.lang.lowering import lower
from xmix.lang.sites import ModelShape, site_id
from xmix.runtime import graphs, ops
from xmix.runtime.control import Capacity, ControlBlock

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


# ---------------------------------------------------------------- pure helpers (tests/unit/test_gpu_check.py)
def gate_threshold(results: torch.Tensor, channel: int) -> float | None:
    """A gate threshold true for about half of the tokens: the midpoint between the two middle
    distinct values of one read channel over the rows that hold a value (B x R result rows).
    A midpoint, not a value that was read, so that no read lies on the threshold: the
    reference's values differ from the kernel's in the last bits, and a row whose value equals
    the threshold would be gated on one side and not the other. None when fewer than two
    distinct values were read (results restored from a snapshot are all NaN)."""
    p = results[:, channel].float()
    p = torch.unique(p[~torch.isnan(p)])  # sorted
    if p.numel() < 2:
        return None
    m = p.numel() // 2
    return float((p[m - 1] + p[m]) / 2)


def changed_rows(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Which rows of y differ from ref (bool per row)."""
    return (y != ref).reshape(y.shape[0], -1).any(dim=1)


def enabled_xmix_nodes(ir) -> list:
    """Top-level xmix nodes that run in the executable graph. IF nodes are not switchable
    (their gate is: a disabled gate leaves the condition at its default 0, the body
    skipped), and body nodes run only when their IF's condition is set."""
    return [
        n
        for n in ir.nodes
        if n.enabled and n.parent == -1 and n.role not in (G.Role.Foreign, G.Role.If)
    ]


def cu_values(res, cu=None) -> tuple:
    """The values of a cuda-bindings call after its CUresult (raises on an error)."""
    err = res[0]
    ok = int(err) == 0 if cu is None else err == cu.CUresult.CUDA_SUCCESS
    if not ok:
        raise RuntimeError(str(err))
    return tuple(res[1:])


def n_dependencies(res, cu=None) -> int:
    """The count from cuGraphNodeGetDependencies(node, 0): (err, deps, n) with cuda-bindings
    for CUDA 12, (err, deps, edge_data, n) for CUDA 13 (the edge-data variant is the plain
    name there). The count is the last value either way."""
    return int(cu_values(res, cu)[-1])


def write_section(path: Path | None, tag: str, text: str) -> None:
    """Rewrite one tagged section of a markdown file, leaving the others (the quick and the
    full run share table.md; each rewrite keeps what a killed run had measured)."""
    if path is None:
        return
    begin, end = f"<!-- {tag} -->", f"<!-- /{tag} -->"
    old = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    if begin in old and end in old:
        new = re.sub(
            re.escape(begin) + r".*?" + re.escape(end) + r"\n?", lambda _: block, old, flags=re.S
        )
    else:
        new = old + ("\n" if old and not old.endswith("\n") else "") + block
    path.write_text(new)


# ---------------------------------------------------------------- apps
def vec(d: int, seed: int) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


@dataclass
class Case:
    name: str
    app: App
    mode: str = "all"  # "request": only the first requests of a step use the app
    reads: bool = False  # compare result channels / capture buffer too
    gate_param: str | None = None  # gated cases: run with the gate false, then true for some
    some_not_all: bool = False  # gate true for some rows: not all of them may change
    # False for user kernels: a graph that keeps its anchors (XMIX_GRAPH_PATCH=0, a refused
    # patch) cannot run them, so there the case's requests must be failed, not compared
    anchors_run_it: bool = True


def check_cases(d: int, n_layers: int) -> list[Case]:
    mid = n_layers // 2
    l1, l2 = min(1, n_layers - 1), min(2, n_layers - 1)
    cases = []

    def add_case(name, cond, mode="all", layer=mid, site="residual.pre", scale=4.0):
        a = App(name)
        a.token_set("t", ids=[7, 14, 21])
        a.token_set("o", ids=[7])
        a.token_set("c", ids=[21])
        a.write("add", vector=vec(d, 1), scale=scale).layers([layer]).at(site).cond(cond)
        cases.append(Case(name, a, mode))

    add_case("add_all", None)
    add_case("add_last_token", "last_token", mode="request")
    add_case("add_prompt", "prompt")
    add_case("add_generated", "generated", site="attention.post")
    add_case("add_token_in", "token_in(t)", site="mlp.post")
    add_case("add_in_span", "in_span(o, c)")

    a = App("ablate_all_layers")
    a.write("ablate", direction=vec(d, 2)).layers("all").at("residual.pre")
    cases.append(Case(a.name, a))
    a = App("clamp_not_last")
    a.write("clamp", direction=vec(d, 3), min=-0.01, max=0.01).layers([mid]).at("mlp.post").cond(
        "not last_token"
    )
    cases.append(Case(a.name, a))
    a = App("affine_last")
    g = torch.Generator().manual_seed(4)
    A = torch.eye(d) + torch.randn(d, d, generator=g) / (4 * math.sqrt(d))
    a.write("affine", matrix=A, mu_s=vec(d, 5) * 0.1, mu_t=vec(d, 6) * 0.1).layers([mid]).at(
        "residual.pre"
    ).cond("last_token")
    cases.append(Case(a.name, a))

    a = App("probe_reads")
    a.read("probe", weight=vec(d, 7) / math.sqrt(d), bias=0.1).layers(sorted({l1, mid})).at(
        "residual.pre"
    ).named("p")
    cases.append(Case(a.name, a, reads=True))
    a = App("capture_last")
    a.read("capture", dims=(0, 16)).layers([mid]).at("mlp.post").named("cap").cond("last_token")
    cases.append(Case(a.name, a, reads=True))
    a = App("distance_read")
    a.read(
        "distance", centroids=torch.randn(4, d, generator=torch.Generator().manual_seed(8)) * 8
    ).layers([mid]).at("attention.post").named("dist")
    cases.append(Case(a.name, a, reads=True))
    a = App("cosine_prompt")
    a.read("cosine", vector=vec(d, 9)).layers([l2]).at("residual.pre").named("cast")
    cases.append(Case(a.name, a, reads=True))

    # Gates read a probe at layer l1's residual.pre, upstream of the gated write: the probe
    # values of the gate-false pass are those of the gate-true pass.
    a = App("gated_write")
    a.param("theta", 0.5)
    a.read("probe", weight=vec(d, 10) / math.sqrt(d), bias=0.0).layers([l1]).at(
        "residual.pre"
    ).named("p")
    a.write("add", vector=vec(d, 11), scale=4.0).layers([mid]).at("mlp.post").cond("p >= theta")
    cases.append(Case(a.name, a, reads=True, gate_param="theta", some_not_all=True))
    a = App("latched_ablate")
    a.param("theta", 0.5)
    a.read("probe", weight=vec(d, 12) / math.sqrt(d), bias=0.0).layers([l1]).at(
        "residual.pre"
    ).named("p")
    a.write("ablate", direction=vec(d, 13)).layers([mid]).at("mlp.post").cond(
        "prompt_last(p) >= theta or p >= theta"
    )
    cases.append(Case(a.name, a, reads=True, gate_param="theta"))

    a = App("three_ops_one_site")
    a.read("probe", weight=vec(d, 14) / math.sqrt(d), bias=0.0).layers([mid]).at(
        "attention.post"
    ).named("q")
    a.write("add", vector=vec(d, 15), scale=2.0).layers([mid]).at("attention.post")
    a.write("ablate", direction=vec(d, 16)).layers([mid]).at("attention.post").cond("q >= 0.5")
    cases.append(Case(a.name, a, reads=True))

    lib = custom_library()
    if lib is not None:
        a = App("custom_write")
        a.write(
            "custom",
            cpu_library=lib,
            cpu_symbol="gc_custom_add",
            cuda_source=CUSTOM_CUDA,
            cuda_symbol="gc_custom_add",
            artifact=vec(5, 17),
            params={"k": 0.5},
        ).layers([mid]).at("mlp.post").cond("generated")
        cases.append(Case(a.name, a, anchors_run_it=False))
    return cases


# A user kernel (csrc/include/xmix/custom.h) for the check's custom-kernel case: on the rows it
# is given, h[t][i] += k * artifact[i % n], k the op's parameter for the row's request. Products
# and sums rounded separately (no FMA), as gpu_check_reference computes them.
CUSTOM_CPU = r"""
#include "xmix/custom.h"

// The CPU check's decoder is fp32: rows of other dtypes are not this kernel's to change.
extern "C" void gc_custom_add(const xmix_custom_args* a) {
  if (a->dtype != 0) return;
  float* h = (float*)a->h;
  for (int t = 0; t < a->n_rows; ++t) {
    if (!a->select[t]) continue;
    const float k = a->slot_params[a->tok_slot[t] * a->n_params + a->param_base];
    for (int i = 0; i < a->d; ++i) {
      const float add = k * a->artifact[i % a->artifact_numel];
      h[t * a->stride_h + i] = h[t * a->stride_h + i] + add;
    }
  }
}
"""

CUSTOM_CUDA = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "xmix/custom.h"

extern "C" __global__ void gc_custom_add(xmix_custom_args a) {
  const int t = blockIdx.x;
  if (t >= a.n_rows || !a.select[t]) return;
  const float k = a.slot_params[a.tok_slot[t] * a.n_params + a.param_base];
  for (int i = threadIdx.x; i < a.d; i += blockDim.x) {
    const float add = __fmul_rn(k, a.artifact[i % a.artifact_numel]);
    if (a.dtype == 1) {
      __nv_bfloat16* h = (__nv_bfloat16*)a.h + t * a.stride_h;
      h[i] = __float2bfloat16(__fadd_rn(__bfloat162float(h[i]), add));
    } else if (a.dtype == 2) {
      __half* h = (__half*)a.h + t * a.stride_h;
      h[i] = __float2half(__fadd_rn(__half2float(h[i]), add));
    } else {
      float* h = (float*)a.h + t * a.stride_h;
      h[i] = __fadd_rn(h[i], add);
    }
  }
}
"""

_CUSTOM_LIB: dict[str, str | None] = {}


def custom_library() -> str | None:
    """The shared library of CUSTOM_CPU, built once with the system's C++ compiler; None (and
    the custom-kernel case left out, said) where there is none."""
    if "lib" in _CUSTOM_LIB:
        return _CUSTOM_LIB["lib"]
    from xmix import custom_include_dir

    cxx = shutil.which("c++") or shutil.which("g++")
    lib = None
    if cxx is None:
        say("  SKIP  custom_write: no C++ compiler here to build its CPU kernel")
    else:
        d = Path(tempfile.mkdtemp(prefix="xmix-gpu-check-"))
        (d / "custom.cpp").write_text(CUSTOM_CPU)
        out = d / "libgc_custom.so"
        r = subprocess.run(
            [
                cxx,
                "-O2",
                "-ffp-contract=off",
                "-shared",
                "-fPIC",
                "-I",
                str(custom_include_dir()),
                "-o",
                str(out),
                str(d / "custom.cpp"),
            ],
            capture_output=True,
            text=True,
        )
        if check(r.returncode == 0, "custom_write: its CPU kernel builds"):
            lib = str(out)
        else:
            say(r.stderr[-1000:])
    _CUSTOM_LIB["lib"] = lib
    return lib


def bench_apps(d: int, n_layers: int) -> dict[str, App]:
    add = App("bench_add")
    add.write("add", vector=vec(d, 20), scale=2.0).layers([n_layers // 2]).at("residual.pre")
    abl = App("bench_ablate")
    for s in SITES:
        abl.write("ablate", direction=vec(d, 21)).layers("all").at(s)
    gate = App("bench_gated")
    gate.param("theta", 2.0)
    gate.read("probe", weight=vec(d, 22) / math.sqrt(d), bias=0.0).layers(
        [min(1, n_layers - 1)]
    ).at("residual.pre").named("p")
    gate.write("add", vector=vec(d, 23), scale=2.0).layers([n_layers // 2]).at("mlp.post").cond(
        "p >= theta"
    )
    return {"add": add, "ablate": abl, "gated": gate}


def capacity() -> Capacity:
    return Capacity(
        max_tokens=512,
        max_slots=256,
        max_apps=32,
        max_params=1024,
        max_channels=64,
        max_ops=1024,
        max_cond=1024,
        capture_floats=1 << 20,
    )


# ---------------------------------------------------------------- the part that needs no GPU
def cpu_part(shape: ModelShape) -> None:
    say("== without a GPU: apps lowered for the full shape, planner on the decoder's anchor layout")
    cb = ControlBlock(shape, "cpu", capacity())
    n = 0
    for c in check_cases(shape.hidden_size, shape.n_layers) + [
        Case(k, a) for k, a in bench_apps(shape.hidden_size, shape.n_layers).items()
    ]:
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
    plan = G.plan(
        g, graphs.program_for(cb, expected_anchors=3 * shape.n_layers, use_conditionals=True)
    )
    roles: dict[str, int] = {}
    for nn in plan.add:
        k = str(nn.role).split(".")[-1]
        roles[k] = roles.get(k, 0) + 1
    check(
        not plan.fallback and plan.n_anchors == 3 * shape.n_layers,
        f"plan: {plan.n_anchors} anchors, added {roles}, {len(plan.edges)} edges",
    )
    after = G.apply(g, plan)
    check(
        G.plan(
            after,
            graphs.program_for(cb, expected_anchors=3 * shape.n_layers, use_conditionals=True),
        ).is_noop(),
        "re-plan of the patched layout is a no-op",
    )
    for a in list(cb.apps):
        cb.set_mode(a, "off")
    off = G.apply(
        after,
        G.plan(
            after,
            graphs.program_for(cb, expected_anchors=3 * shape.n_layers, use_conditionals=True),
        ),
    )
    on = enabled_xmix_nodes(off)
    check(
        not on and any(n.role == G.Role.If for n in off.nodes),
        f"all apps off: {len(on)} enabled top-level xmix nodes (IF nodes are not switchable)",
    )


# ---------------------------------------------------------------- the model
def rmsnorm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w


class Decoder:
    """Llama-shaped decoder step in vLLM's hidden + residual form; attention reads a static
    KV cache (timing realism, not language modelling). Split at attention for the piecewise
    graphs."""

    def __init__(
        self, n_layers, d, ffn, heads, ctx, max_batch, device="cuda", dtype=torch.bfloat16
    ):
        self.L, self.d, self.H, self.hd = n_layers, d, heads, d // heads
        torch.manual_seed(0)

        def w(*shape, fan_in):
            return torch.randn(*shape, device=device, dtype=dtype) / math.sqrt(fan_in)

        self.layers = []
        for _ in range(n_layers):
            self.layers.append(
                dict(
                    ln1=torch.ones(d, device=device, dtype=dtype),
                    ln2=torch.ones(d, device=device, dtype=dtype),
                    wqkv=w(d, 3 * d, fan_in=d),
                    wo=w(d, d, fan_in=d),
                    wgu=w(d, 2 * ffn, fan_in=d),
                    wd=w(ffn, d, fan_in=ffn),
                    k=torch.randn(max_batch, heads, ctx, self.hd, device=device, dtype=dtype),
                    v=torch.randn(max_batch, heads, ctx, self.hd, device=device, dtype=dtype),
                )
            )
        self.lnf = torch.ones(d, device=device, dtype=dtype)
        # What runs at a hook site: xmix's op (None), or a function (h, r, site, layer) that
        # changes h in place: the PyTorch reference of gpu_check_reference, or a test's
        # deliberately broken kernel.
        self.site_impl: Callable | None = None

    def sid(self, name, i):
        return site_id(name, i, self.L)

    def site(self, h, r, name, i):
        if self.site_impl is None:
            torch.ops.xmix.site(h, r, self.sid(name, i))
        else:
            self.site_impl(h, r, name, i)

    @contextlib.contextmanager
    def using(self, impl: Callable | None):
        old, self.site_impl = self.site_impl, impl
        try:
            yield self
        finally:
            self.site_impl = old

    def pre(self, i, h, r, sites):
        if sites:
            self.site(h, r, "residual.pre", i)
        r = h + r
        q = (rmsnorm(r, self.layers[i]["ln1"]) @ self.layers[i]["wqkv"])[:, : self.d]
        return r, q

    def attn(self, i, q):
        B, p = q.shape[0], self.layers[i]
        a = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(B, self.H, 1, self.hd), p["k"][:B], p["v"][:B]
        )
        return a.reshape(B, self.d)

    def post(self, i, a, r, sites):
        p = self.layers[i]
        o = a @ p["wo"]
        if sites:
            self.site(o, None, "attention.post", i)
        r = o + r
        g, u = (rmsnorm(r, p["ln2"]) @ p["wgu"]).chunk(2, dim=-1)
        h = (torch.nn.functional.silu(g) * u) @ p["wd"]
        if sites:
            self.site(h, None, "mlp.post", i)
        return h, r

    def __call__(self, x, sites=True):
        h, r = x.clone(), torch.zeros_like(x)
        for i in range(self.L):
            r, q = self.pre(i, h, r, sites)
            h, r = self.post(i, self.attn(i, q), r, sites)
        return rmsnorm(h + r, self.lnf)

    # piecewise segments: 0 = x -> pre(0); k = post(k-1) -> pre(k); L = post(L-1) -> final
    def segment(self, k, inputs, sites):
        if k == 0:
            (x,) = inputs
            return self.pre(0, x.clone(), torch.zeros_like(x), sites)
        a, r = inputs
        h, r = self.post(k - 1, a, r, sites)
        if k == self.L:
            return (rmsnorm(h + r, self.lnf),)
        return self.pre(k, h, r, sites)


# ---------------------------------------------------------------- steps and runs
STATE = ("read_state", "vec_state", "slot_span", "results", "capture", "counters")


class Runner:
    def __init__(self, cb: ControlBlock):
        self.cb = cb
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
        for _n_tok, _start, plen, apps in rows:
            self.n += 1
            rid = f"r{self.n}"
            slots.append(cb.admit(rid, list(apps), None, plen))
            self.live.append(rid)
        cb.begin_step(
            np.array(slots, dtype=np.int32),
            np.array([r[0] for r in rows]),
            np.array([r[1] for r in rows]),
            np.array([r[2] for r in rows]),
            len(ids),
        )
        cb.prologue(ids)
        ops.set_control(cb)

    def snapshot(self):
        return {k: self.cb.dev[k].clone() for k in STATE}

    def restore(self, snap):
        for k, v in snap.items():
            self.cb.dev[k].copy_(v)

    def reads(self, app: str) -> dict[int, dict[str, tuple[list[int], np.ndarray]]]:
        """The step's reads of one app as the drain reports them: {request index: {read:
        (positions, values)}}."""
        out: dict[int, dict[str, tuple[list[int], np.ndarray]]] = {}
        index = {rid: i for i, rid in enumerate(self.live)}
        for rid, by_app in self.cb.drain().items():
            if rid not in index or app not in by_app:
                continue
            out[index[rid]] = {
                k: ([int(p) for p in rr["positions"]], np.asarray(rr["values"], dtype=np.float32))
                for k, rr in by_app[app].items()
            }
        return out

    def outputs(self, y, B):
        R = self.cb.cap.max_channels
        return (
            y.float().clone(),
            self.cb.dev["results"][: B * R].view(B, R).clone(),
            self.cb.dev["capture"].clone(),
        )


# One group of 8 tokens: a whole prompt in one chunk (its last prompt token is sampled), the
# first chunk of a longer prompt (a partial prefill: no token of it is sampled), and decode
# rows (one generated token each): (n_tokens, start_pos, prompt_len).
_GROUP = ((3, 0, 3), (2, 0, 5), (1, 9, 4), (1, 5, 2), (1, 3, 3))


def mixed_rows(B: int, apps: tuple[str, ...]):
    """B tokens as vLLM batches them, for every B the check runs (B >= 8): groups of 8 tokens
    holding a prompt chunk with its last token, a partial prefill and decode rows; in even
    groups the first three requests use ``apps``, in odd ones the partial prefill and the last
    two do; tokens past the last whole group are decode rows without apps. Every batch size
    therefore exercises the prompt, generated, last-token and partial-prefill conditions, with
    requests that use the apps beside requests that do not."""
    if B < 8:
        raise ValueError(f"mixed_rows needs B >= 8 (got {B}): one group of 8 tokens")
    rows = []
    for g in range(B // 8):
        users = (0, 1, 2) if g % 2 == 0 else (1, 3, 4)
        for i, (n, start, plen) in enumerate(_GROUP):
            shift = 0 if n > 1 else g  # decode rows at varied positions
            rows.append((n, start + shift, plen + shift, apps if i in users else ()))
    rows += [(1, 10 + k, 4, ()) for k in range(B % 8)]
    return rows


def rel(a, b) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-6))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- correctness orchestration
def compare_reads(got, want, tol: float) -> str | None:
    """None when the drained reads ``got`` ({request: {read: (positions, values)}}) are the
    reference's ``want`` ({read: {request: {position: value or vector}}}), else the first
    difference."""
    want_by_req: dict[int, dict[str, dict[int, object]]] = {}
    for key, by_req in want.items():
        for q, vals in by_req.items():
            want_by_req.setdefault(q, {})[key] = vals
    for q in sorted(set(got) | set(want_by_req)):
        g, w = got.get(q, {}), want_by_req.get(q, {})
        if set(g) != set(w):
            return f"request {q}: reads {sorted(g)} reported, the reference has {sorted(w)}"
        for key, vals in w.items():
            pos, values = g[key]
            if pos != sorted(vals):
                return f"request {q} {key}: positions {pos}, the reference has {sorted(vals)}"
            ref = torch.stack([torch.as_tensor(vals[p], dtype=torch.float32) for p in pos])
            try:
                torch.testing.assert_close(
                    torch.from_numpy(values).reshape(ref.shape), ref, rtol=tol, atol=tol
                )
            except AssertionError as e:
                return f"request {q} {key}: {str(e).splitlines()[0]}"
    return None


def check_correctness(
    cb,
    run: Runner,
    kinds: dict[str, Callable[[int], torch.Tensor]],
    xs,
    ids,
    cases: list[Case],
    batches,
    shape: ModelShape,
    device,
    replan=graphs.on_apps_changed,
    set_mode=graphs.set_mode,
    tol_eager: float = 5e-2,
    reference: Callable[[int, Callable], torch.Tensor] | None = None,
    tol_ref: float | None = None,
) -> None:
    """Every case, enabled and disabled, per batch: each kind of run from the same control
    state. kinds: "eager", "base" (the model without sites), and the graph runs to compare
    (each must equal "anchors" when present, else eager, and eager within tol_eager).
    ``reference(B, site_impl)`` runs the eager model with a function at its hook sites: with
    it, eager execution itself is checked against gpu_check_reference's PyTorch oracle of the
    case (output within tol_ref, default tol_eager, and every read of every request). The
    gated cases run with the gate false for every token (theta 2 > any sigmoid), then true for
    some: theta between the two middle probe values that the gate-false pass read."""
    base_snap = run.snapshot()
    graph_kinds = [k for k in kinds if k not in ("eager", "base")]
    tol_ref = tol_eager if tol_ref is None else tol_ref
    for case in cases:
        cb.install(lower(case.app, shape), mode="request" if case.mode == "request" else "all")
        summary = replan(cb)
        if summary and (summary.get("errors") or summary.get("fallback")):
            check(False, f"{case.name}: re-plan {summary}")
        oracle = gref.build(case.name, case.app, shape.n_layers) if reference else None
        ref_kind = "anchors" if "anchors" in kinds and case.anchors_run_it else "eager"
        for B in batches:
            apps = (case.name,) if case.mode == "request" else ()
            rows = mixed_rows(B, apps)
            n_real = sum(r[0] for r in rows)
            probe_rows = None
            gate_off_y = None
            current = dict(case.app.app_params)  # the app's parameters as the block has them
            for mode in ("on", "off"):
                set_mode(
                    cb,
                    case.name,
                    ("request" if case.mode == "request" else "all") if mode == "on" else "off",
                )
                thetas = [2.0, "threshold"] if case.gate_param and mode == "on" else [None]
                for theta in thetas:
                    params: dict[str, float] = {}
                    if theta == 2.0:
                        params[case.gate_param] = 2.0
                    elif theta == "threshold":
                        ch = cb.apps[case.name].channels["p"]
                        t = gate_threshold(probe_rows, ch) if probe_rows is not None else None
                        if not check(
                            t is not None, f"{case.name} B={B}: probe values to set the gate from"
                        ):
                            continue
                        params[case.gate_param] = t
                    if params:
                        cb.set_params(case.name, params)
                        current.update(params)
                    out, failed, drained = {}, {}, {}
                    for kind, fn in kinds.items():
                        run.restore(base_snap)
                        run.step(rows, ids[B])
                        cb.take_failed()
                        y = fn(B)
                        sync(device)
                        out[kind] = run.outputs(y, B)
                        failed[kind] = cb.take_failed()
                        if kind == "eager" and reference is not None:
                            drained = run.reads(case.name)
                    ye, re_, ce = out["eager"]
                    yb = out["base"][0]
                    tag = f"{case.name} B={B} {mode}" + (
                        f" theta={theta}" if theta is not None else ""
                    )
                    if theta == 2.0:
                        probe_rows, gate_off_y = re_, ye
                    if oracle is not None:
                        st = gref.Step(
                            gref.tokens(
                                rows, ids[B].cpu(), case.mode if mode == "on" else "off", case.name
                            ),
                            dict(current),
                        )
                        y_ref = reference(
                            B,
                            lambda h, r, site, layer, o=oracle, st=st: o.run(st, site, layer, h, r),
                        ).float()
                        sync(device)
                        vs_ref = rel(ye, y_ref)
                        why = compare_reads(drained, st.reads, tol_ref)
                        n_vals = sum(len(v) for by_q in st.reads.values() for v in by_q.values())
                        check(
                            vs_ref < tol_ref and why is None and not failed["eager"],
                            f"{tag} [eager vs reference]: rel err {vs_ref:.1e}, "
                            f"{n_vals} read values"
                            + (f"; {why}" if why else "")
                            + (f"; failed requests {failed['eager']}" if failed["eager"] else ""),
                        )
                    for kind in graph_kinds:
                        yk, rk, ck = out[kind]
                        if kind == "anchors" and not case.anchors_run_it:
                            # a user kernel cannot run in a graph without its splice: the
                            # requests that use it must be failed, saying so, in mode "on"
                            uses = any(apps or case.mode == "all" for *_, apps in rows)
                            named = bool(failed[kind]) and all(
                                case.name in m for m in failed[kind].values()
                            )
                            check(
                                named if mode == "on" and uses else not failed[kind],
                                f"{tag} [{kind}]: {len(failed[kind])} request(s) failed "
                                f"(a graph without the splice cannot run the user kernel)",
                            )
                            continue
                        yr, rr, cr = out[ref_kind]
                        vs_ref, vs_eager = rel(yk, yr), rel(yk, ye)
                        ok = vs_ref < 1e-3 and vs_eager < tol_eager and not failed[kind]
                        if case.reads and mode == "on":
                            try:
                                torch.testing.assert_close(
                                    rk, rr, rtol=1e-3, atol=1e-3, equal_nan=True
                                )
                                torch.testing.assert_close(
                                    ck, cr, rtol=1e-3, atol=1e-3, equal_nan=True
                                )
                                torch.testing.assert_close(
                                    rk, re_, rtol=tol_eager, atol=tol_eager, equal_nan=True
                                )
                                torch.testing.assert_close(
                                    ck, ce, rtol=tol_eager, atol=tol_eager, equal_nan=True
                                )
                            except AssertionError as e:
                                ok = False
                                say(f"        {kind}: reads differ: {str(e).splitlines()[0]}")
                        effect = rel(yk, yb)
                        if mode == "off" or theta == 2.0:
                            # nothing may change: the same as the model without any site
                            ok = ok and effect < 1e-3
                            extra = f", vs no sites {effect:.1e}"
                        elif case.reads:
                            # a read that reads nothing would compare NaN with NaN
                            n_vals = int((~torch.isnan(rk)).sum())
                            ok = ok and n_vals > 0
                            extra = f", effect {effect:.1e}, {n_vals} values read"
                        else:
                            # a write that changes nothing would prove nothing
                            ok = ok and effect > 0
                            extra = f", effect {effect:.1e}"
                        if theta == "threshold" and gate_off_y is not None:
                            n = int(changed_rows(yk[:n_real], gate_off_y[:n_real]).sum())
                            some = n > 0 and (n < n_real or not case.some_not_all)
                            ok = ok and some
                            extra += f", gate true for {n}/{n_real} rows"
                        check(
                            ok,
                            f"{tag} [{kind}]: rel err vs {ref_kind} {vs_ref:.1e} "
                            f"(bitwise {torch.equal(yk, yr)}), vs eager {vs_eager:.1e}{extra}"
                            + (f"; failed requests {failed[kind]}" if failed[kind] else ""),
                        )
        cb.remove(case.name)
    replan(cb)


# The batch sizes whose correctness the GPU stages check (bench/gpu_check.sh: quick 8 and 256,
# full 8, 64 and 256; B = 1 is timed, not checked): the CPU part runs the orchestration at
# every one of them (tests/unit/test_gpu_check.py holds the script to this list).
CHECKED_BATCHES = (8, 64, 256)
# (layers, hidden size) of the GPU stages: full, and quick at the hidden size whose shared
# memory needs the opt-in; the CPU part lowers and plans the check's apps for each.
GPU_STAGE_SHAPES = ((32, 4096), (2, 5120))


def checked_batches(batches) -> list[int]:
    """The batches of a run whose correctness is checked: those mixed_rows can fill."""
    return [b for b in batches if b >= 8]


def with_sites(model: Decoder, x: dict) -> Callable[[int, Callable], torch.Tensor]:
    """check_correctness' ``reference``: the eager model at batch B with ``impl`` at its sites."""

    def go(B: int, impl: Callable) -> torch.Tensor:
        with model.using(impl):
            return model(x[B])

    return go


def cpu_orchestration(
    args,
    batches=CHECKED_BATCHES,
    cases: list[Case] | None = None,
    kernel: Callable | None = None,
) -> None:
    """The correctness orchestration above on a tiny CPU decoder, every graph kind being the
    eager model, at every batch size the GPU stages check and for every case they run: what a
    CPU can check of this script's GPU path, with eager execution held to the PyTorch
    reference (gpu_check_reference). ``kernel``: what runs at the sites instead of xmix's op
    (tests/unit/test_gpu_check.py: deliberately broken kernels the check must catch)."""
    say(
        "== without a GPU: correctness orchestration on a tiny CPU decoder (graphs = eager), "
        f"batches {list(batches)}"
    )
    shape = ModelShape(n_layers=3, hidden_size=64, vocab_size=64)
    top = max(batches)
    model = Decoder(3, 64, 128, 4, 8, top, device="cpu", dtype=torch.float32)
    model.site_impl = kernel
    cap = Capacity(
        max_tokens=top,
        max_slots=top,
        max_apps=8,
        max_params=64,
        max_channels=16,
        max_ops=64,
        max_cond=128,
        capture_floats=1 << 14,
    )
    cb = ControlBlock(shape, "cpu", cap)
    run = Runner(cb)
    g = torch.Generator().manual_seed(1)
    x = {B: torch.randn(B, 64, generator=g) for B in batches}
    ids = {B: ((torch.arange(B) * 7) % 50).to(torch.int32) for B in batches}
    kinds = {
        "eager": lambda B: model(x[B]),
        "patched": lambda B: model(x[B]),
        "base": lambda B: model(x[B], sites=False),
    }
    run.step(mixed_rows(min(batches), ()), ids[min(batches)])
    n0 = len(FAILURES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend (CI machines are shared)
    try:
        check_correctness(
            cb,
            run,
            kinds,
            x,
            ids,
            check_cases(64, 3) if cases is None else cases,
            list(batches),
            shape,
            "cpu",
            replan=lambda c: None,
            set_mode=lambda c, n, m: c.set_mode(n, m),
            tol_eager=1e-5,
            reference=with_sites(model, x),
            tol_ref=1e-4,
        )
    finally:
        torch.set_num_threads(threads)
    say(f"   orchestration: {len(FAILURES) - n0} failure(s)")


# ---------------------------------------------------------------- GPU: capture
@contextlib.contextmanager
def setting_env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def patch_env(value: str | None):
    return setting_env("XMIX_GRAPH_PATCH", value)


def capture(cls, model, x, sites=True, patch: str | None = None):
    with patch_env(patch):
        model(x, sites)  # warm-up (cuBLAS handles, allocator) outside capture
        torch.cuda.synchronize()
        g = cls()
        with torch.cuda.graph(g):
            out = model(x, sites)
        torch.cuda.synchronize()
        return g, out


class Piecewise:
    """vLLM's PIECEWISE mode on the decoder: one graph per segment between attention calls
    (L + 1 of them), attention eager in between, every graph in one memory pool."""

    def __init__(self, cls, model: Decoder, x, sites=True, patch: str | None = None):
        self.model, self.B = model, x.shape[0]
        self.a = [
            torch.zeros(self.B, model.d, device=x.device, dtype=x.dtype) for _ in range(model.L)
        ]
        pool = torch.cuda.graph_pool_handle()
        self.graphs, self.outs = [], []
        with patch_env(patch):
            model(x, sites)
            torch.cuda.synchronize()
            inputs = (x,)
            for k in range(model.L + 1):
                g = cls()
                with torch.cuda.graph(g, pool=pool):
                    out = model.segment(k, inputs, sites)
                self.graphs.append(g)
                self.outs.append(out)
                if k < model.L:
                    inputs = (self.a[k], out[0])
            torch.cuda.synchronize()
        self.out = self.outs[-1][0]

    def replay(self):
        for k, g in enumerate(self.graphs):
            g.replay()
            if k < self.model.L:
                self.a[k].copy_(self.model.attn(k, self.outs[k][1]))
        return self.out


def time_us(fn, reps: int, rounds: int) -> float:
    """Median over rounds of the mean time per call (us), device events around each round."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps):
            fn()
        t1.record()
        torch.cuda.synchronize()
        per.append(t0.elapsed_time(t1) * 1000.0 / reps)
    return float(np.median(per))


def kernel_name(cu, params) -> str:
    # Lazily loaded modules may leave only the CUkernel (kern) in the node's parameters.
    try:
        (name,) = cu_values(cu.cuFuncGetName(params.func), cu)
    except Exception:  # noqa: BLE001
        (name,) = cu_values(cu.cuKernelGetName(params.kern), cu)
    return name.decode() if isinstance(name, bytes) else str(name)


def structural_check(g, expect_ops: int, expect_ifs: int, n_anchors: int) -> None:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        say("  SKIP  structural check with cuda-python: cuda-bindings is not installed")
        return
    try:
        graph = cu.CUgraph(int(g.raw_cuda_graph()))
        exe = cu.CUgraphExec(int(g.raw_cuda_graph_exec()))
        _, n = cu_values(cu.cuGraphGetNodes(graph, 0), cu)
        nodes, _ = cu_values(cu.cuGraphGetNodes(graph, n), cu)
        names: dict[str, list] = {
            "xmix_site_anchor": [],
            "xmix_op_kernel": [],
            "xmix_gate_kernel": [],
        }
        n_if = 0
        for node in nodes:
            (t,) = cu_values(cu.cuGraphNodeGetType(node), cu)
            if t == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL:
                n_if += 1
            if t != cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                continue
            (params,) = cu_values(cu.cuGraphKernelNodeGetParams(node), cu)
            name = kernel_name(cu, params)
            for k in names:
                if k in name:
                    names[k].append(node)
        anchors_on = sum(
            int(cu_values(cu.cuGraphNodeGetEnabled(exe, a), cu)[0])
            for a in names["xmix_site_anchor"]
        )
        check(
            len(names["xmix_site_anchor"]) == n_anchors and anchors_on == 0,
            f"cuda-python: {len(names['xmix_site_anchor'])} anchor nodes, {anchors_on} enabled",
        )
        # op nodes inside IF bodies are not top-level nodes: top level = all ops - gated ones
        check(
            len(names["xmix_op_kernel"]) == expect_ops - expect_ifs,
            f"cuda-python: {len(names['xmix_op_kernel'])} top-level op nodes (expected {expect_ops - expect_ifs})",
        )
        check(
            len(names["xmix_gate_kernel"]) == expect_ifs and n_if >= expect_ifs,
            f"cuda-python: {len(names['xmix_gate_kernel'])} gate nodes, {n_if} conditional nodes",
        )
        lonely = sum(
            1
            for op in names["xmix_op_kernel"]
            if n_dependencies(cu.cuGraphNodeGetDependencies(op, 0), cu) == 0
        )
        check(
            lonely == 0, f"cuda-python: every top-level op node has a dependency ({lonely} without)"
        )
    except Exception as e:  # noqa: BLE001 - a binding that differs from the one written for
        check(False, f"structural check with cuda-python raised {type(e).__name__}: {e}")


# ---------------------------------------------------------------- GPU part
class Table:
    def __init__(self, path: Path | None, tag: str, batches, title: str):
        self.path, self.tag, self.batches, self.title = path, tag, batches, title
        self.rows: list[tuple[str, dict[int, float]]] = []
        self.notes: list[str] = []
        self.base_label: str | None = None

    def add(self, label: str, vals: dict[int, float], base: bool = False) -> None:
        if base:
            self.base_label = label
        self.rows.append((label, vals))
        self.flush()

    def note(self, line: str) -> None:
        self.notes.append(line)
        self.flush()

    def text(self) -> str:
        base = dict(self.rows).get(self.base_label) if self.base_label else None
        lines = [
            f"### {self.title}",
            "",
            "| configuration | " + " | ".join(f"B={b}" for b in self.batches) + " |",
            "|---|" + "---:|" * len(self.batches),
        ]
        for label, vals in self.rows:
            cells = []
            for b in self.batches:
                v = vals.get(b)
                if v is None:
                    cells.append("")
                elif base and label != self.base_label and b in base:
                    cells.append(f"{v:.1f} µs ({100 * (v / base[b] - 1):+.2f} %)")
                else:
                    cells.append(f"{v:.1f} µs")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def flush(self) -> None:
        write_section(self.path, self.tag, self.text())


def gpu_part(args, shape: ModelShape, table: Table) -> None:
    cls = graphs.graph_class()
    if cls is None:
        check(False, f"graph patching unavailable: {graphs.cuda_patching_available()}")
        return
    say(
        f"== device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {_C.cuda_status()}, "
        f"conditional nodes: {G.conditionals_supported()}"
    )
    # The correctness section compares the patched graphs themselves; the first-replay check
    # (which would serve the anchors' result) has its own section.
    os.environ["XMIX_GRAPH_CHECK"] = "0"
    t = time.time()
    model = Decoder(
        shape.n_layers, shape.hidden_size, args.ffn, args.heads, args.ctx, max(args.batches)
    )
    cb = ControlBlock(shape, "cuda", capacity())
    run = Runner(cb)
    say(
        f"   model and control block ready in {time.time() - t:.1f}s "
        f"({torch.cuda.memory_allocated() / 2**30:.1f} GiB)"
    )

    d = shape.hidden_size
    xs, ids, g_base, g_anchor, g_patch, pw_base, pw_patch = {}, {}, {}, {}, {}, {}, {}
    g_plain, g_torch_anchor = {}, {}
    t = time.time()
    for B in args.batches:
        xs[B] = torch.randn(B, d, device="cuda", dtype=torch.bfloat16)
        ids[B] = ((torch.arange(B) * 7) % 50).to(torch.int32).cuda()
        run.step(mixed_rows(B, ()) if B >= 8 else [(1, 10 + k, 4, ()) for k in range(B)], ids[B])
        g_base[B] = capture(torch.cuda.CUDAGraph, model, xs[B], sites=False)
        g_anchor[B] = capture(cls, model, xs[B], patch="0")
        g_patch[B] = capture(cls, model, xs[B])
        g_plain[B] = capture(cls, model, xs[B], sites=False)
        g_torch_anchor[B] = capture(torch.cuda.CUDAGraph, model, xs[B])
        if args.piecewise:
            pw_base[B] = Piecewise(torch.cuda.CUDAGraph, model, xs[B], sites=False)
            pw_patch[B] = Piecewise(cls, model, xs[B])
    n_anchors = 3 * shape.n_layers
    say(
        f"   captured {len(graphs.kept_graphs()) + 4 * len(args.batches)} graphs in {time.time() - t:.1f}s; "
        f"stats {graphs.stats()}"
    )
    st = graphs.stats()
    forms = {f: st[f"anchors_by_{f}"] for f in ("stub", "function", "kernel", "name")}
    check(sum(forms.values()) > 0, f"anchor nodes recognised, by form: {forms}")
    check(
        all(g_patch[B][0].xmix_state == "patched" for B in args.batches),
        "every full xmix graph patched",
    )
    if args.piecewise:
        states = {g.xmix_state for B in args.batches for g in pw_patch[B].graphs}
        check(states == {"patched"}, f"every piecewise graph patched ({states})")
    check(
        all(g_anchor[B][0].xmix_state == "disabled" for B in args.batches),
        "XMIX_GRAPH_PATCH=0 keeps the anchors",
    )

    # ---- correctness: patched graphs vs their anchors and vs eager, per case
    say(
        "== correctness: patched full and piecewise graphs vs anchors and eager, enabled and disabled"
    )
    check_batches = checked_batches(args.batches)
    kinds = {
        "eager": lambda B: model(xs[B]),
        "anchors": lambda B: (g_anchor[B][0].replay(), g_anchor[B][1])[1],
        "patched": lambda B: (g_patch[B][0].replay(), g_patch[B][1])[1],
    }
    if args.piecewise:
        kinds["piecewise"] = lambda B: pw_patch[B].replay()
    kinds["base"] = lambda B: (g_base[B][0].replay(), g_base[B][1])[1]
    check_correctness(
        cb,
        run,
        kinds,
        xs,
        ids,
        check_cases(d, shape.n_layers),
        check_batches,
        shape,
        "cuda",
        reference=with_sites(model, xs),
    )

    apps = bench_apps(d, shape.n_layers)
    Bs = check_batches[0]
    first_replay_check_section(cls, model, cb, run, xs, ids, Bs, apps, shape, args)

    # ---- structure of a patched graph with a plain op and a gated write
    say("== structure")
    for a in apps.values():
        cb.install(lower(a, shape), mode="off")
    graphs.on_apps_changed(cb)
    n_ops = 1 + 3 * shape.n_layers + 2
    structural_check(g_patch[Bs][0], n_ops, 1, n_anchors)
    on = enabled_xmix_nodes(g_patch[Bs][0].xmix_ir())
    check(not on, f"all apps off: {len(on)} enabled top-level xmix nodes")

    # ---- timing
    say(
        f"== decode-step time per batch (us per step, median of {args.rounds} rounds of {args.reps})"
    )
    for n in list(cb.apps):
        cb.remove(n)
    graphs.on_apps_changed(cb)

    def decode_step(B):
        run.step([(1, 100, 4, ())] * B, ids[B])

    def measure(label, which, base=False, piecewise=False):
        vals = {}
        for B in args.batches:
            decode_step(B)
            fn = which[B].replay if piecewise else which[B][0].replay
            vals[B] = time_us(fn, args.reps, args.rounds)
        table.add(label, vals, base=base)
        say(f"   {label}: " + ", ".join(f"B={b} {v:.1f}" for b, v in vals.items()))

    measure("no xmix (graph without sites)", g_base, base=True)
    # Where the sites' cost lies: the graph class alone (no sites), the anchors alone (torch's
    # own class, no xmix graph class).
    measure("  no sites, captured by xmix's graph class", g_plain)
    measure("  anchors, captured by torch's class", g_torch_anchor)
    measure("anchors only, no app (XMIX_GRAPH_PATCH=0)", g_anchor)
    measure("patched, no app deployed", g_patch)
    for a in apps.values():
        cb.install(lower(a, shape), mode="off")
    graphs.on_apps_changed(cb)
    measure("apps deployed, all off", g_patch)
    graphs.set_mode(cb, "bench_add", "all")
    measure("one single-layer add on every token", g_patch)
    graphs.set_mode(cb, "bench_add", "off")
    graphs.set_mode(cb, "bench_ablate", "all")
    measure(f"ablation on all layers (3 sites x {shape.n_layers})", g_patch)
    measure("  the same, anchors only (XMIX_GRAPH_PATCH=0)", g_anchor)
    graphs.set_mode(cb, "bench_ablate", "off")
    graphs.set_mode(cb, "bench_gated", "all")
    cb.set_params("bench_gated", {"theta": 2.0})
    measure("gated write, gate false for every token", g_patch)
    cb.set_params("bench_gated", {"theta": 0.0})
    measure("gated write, gate true for every token", g_patch)
    graphs.set_mode(cb, "bench_gated", "off")
    if args.piecewise:
        measure("piecewise: no xmix", pw_base, piecewise=True)
        measure("piecewise: apps deployed, all off", pw_patch, piecewise=True)
        graphs.set_mode(cb, "bench_add", "all")
        measure("piecewise: one single-layer add", pw_patch, piecewise=True)
        graphs.set_mode(cb, "bench_add", "off")
        graphs.set_mode(cb, "bench_ablate", "all")
        measure("piecewise: ablation on all layers", pw_patch, piecewise=True)
        graphs.set_mode(cb, "bench_ablate", "off")

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
    for line in (
        f"one toggle (mode change: control block write + node switch in {ng} graphs): {toggle:.1f} µs",
        f"node switch only, ablation app ({nodes} nodes over {ng} graphs): {switch:.1f} µs",
        f"one parameter update (control block write; no graph update needed): {param:.1f} µs",
        f"cudaGraphExecKernelNodeSetParams on one app's nodes ({upd} nodes over {ng} graphs): "
        f"{node_param:.1f} µs",
    ):
        say("   " + line)
        table.note(line)
    base = dict(table.rows)["no xmix (graph without sites)"]
    for label, goal in (
        ("apps deployed, all off", 0.5),
        ("one single-layer add on every token", 1.0),
        (f"ablation on all layers (3 sites x {shape.n_layers})", 3.0),
    ):
        worst = max(100 * (dict(table.rows)[label][b] / base[b] - 1) for b in args.batches)
        table.note(
            f"goal {label}: ≤ {goal} % of the step; worst batch {worst:+.2f} % "
            f"({'met' if worst <= goal else 'missed'})"
        )
    check(graphs.stats()["errors"] == 0, f"no patch error or plan mismatch ({graphs.stats()})")


def first_replay_check_section(cls, model, cb, run, xs, ids, B, apps, shape, args) -> None:
    """XMIX_GRAPH_CHECK on real graphs: a correct patched graph passes and serves the anchors'
    (equal) result; one whose executable graph is deliberately broken (the app's op node
    switched off behind the control block's back) fails, serves the anchors' result and is
    put back as captured; piecewise graphs sharing one pool pass."""
    say("== first-replay check (XMIX_GRAPH_CHECK=1)")
    os.environ["XMIX_GRAPH_CHECK"] = "1"
    try:
        cb.install(lower(apps["add"], shape), mode="all")
        graphs.on_apps_changed(cb)
        rows = mixed_rows(B, ())
        snap = run.snapshot()
        run.step(rows, ids[B])
        ga, out_a = capture(cls, model, xs[B], patch="0")
        run.restore(snap)
        run.step(rows, ids[B])
        ga.replay()
        torch.cuda.synchronize()
        want = out_a.clone()

        before = graphs.stats()
        run.restore(snap)
        run.step(rows, ids[B])
        g_ok, out_ok = capture(cls, model, xs[B])
        run.restore(snap)
        run.step(rows, ids[B])
        g_ok.replay()
        torch.cuda.synchronize()
        st = graphs.stats()
        check(
            st["check_passed"] == before["check_passed"] + 1 and g_ok.xmix_state == "patched",
            f"a correct patched graph passes ({st['checks'] - before['checks']} check run)",
        )
        check(
            rel(out_ok.float(), want.float()) < 1e-3,
            f"... and serves the anchors' result (rel {rel(out_ok.float(), want.float()):.1e})",
        )

        run.restore(snap)
        run.step(rows, ids[B])
        g_bad, out_bad = capture(cls, model, xs[B])
        g_bad._xmix.set_app_enabled(
            int(g_bad.raw_cuda_graph_exec()), cb.apps["bench_add"].index, False
        )
        before = graphs.stats()
        run.restore(snap)
        run.step(rows, ids[B])
        g_bad.replay()
        torch.cuda.synchronize()
        st = graphs.stats()
        check(
            st["check_failed"] == before["check_failed"] + 1 and g_bad.xmix_state == "fallback",
            f"a broken patched graph fails the check and falls back (state {g_bad.xmix_state}, "
            f"{g_bad._xmix_refused})",
        )
        check(
            rel(out_bad.float(), want.float()) < 1e-3,
            f"... and serves the anchors' result (rel {rel(out_bad.float(), want.float()):.1e})",
        )
        run.restore(snap)
        run.step(rows, ids[B])
        g_bad.replay()
        torch.cuda.synchronize()
        check(rel(out_bad.float(), want.float()) < 1e-3, "... and so on at the next replays")

        if args.piecewise:
            run.restore(snap)
            run.step(rows, ids[B])
            pw = Piecewise(cls, model, xs[B])
            before = graphs.stats()
            run.restore(snap)
            run.step(rows, ids[B])
            y = pw.replay()
            torch.cuda.synchronize()
            st = graphs.stats()
            n_checked = st["checks"] - before["checks"]
            check(
                n_checked >= 1 and st["check_passed"] - before["check_passed"] == n_checked,
                f"piecewise graphs in one pool: {n_checked} checked, all passed",
            )
            check(
                rel(y.float(), want.float()) < 1e-3,
                f"... and the piecewise step gives the anchors' "
                f"result (rel {rel(y.float(), want.float()):.1e})",
            )
            for g in pw.graphs:
                g.reset()
        for g in (ga, g_ok, g_bad):
            g.reset()
    finally:
        os.environ["XMIX_GRAPH_CHECK"] = "0"
        for n in list(cb.apps):
            cb.remove(n)
        graphs.on_apps_changed(cb)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--reps", type=int, default=30, help="replays per timing round")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (the median is reported)")
    ap.add_argument(
        "--no-piecewise", dest="piecewise", action="store_false", help="capture full graphs only"
    )
    ap.add_argument("--table", type=Path, default=None, help="markdown file for the timing table")
    ap.add_argument("--tag", default="full", help="the table's section in --table")
    ap.add_argument("--cpu-only", action="store_true", help="only the part that needs no GPU")
    return ap


def main() -> int:
    args = parser().parse_args()
    args.batches = sorted(int(b) for b in args.batches.split(","))
    # every patch is read back and compared with its plan
    os.environ.setdefault("XMIX_GRAPH_VERIFY", "1")
    shape = ModelShape(n_layers=args.layers, hidden_size=args.d, vocab_size=32000)
    say(
        f"== xmix gpu_check ({args.tag}): {args.layers} layers, d={args.d}, batches {args.batches}; "
        f"_C: {_C.cuda_status()}"
    )
    t = time.time()
    if args.cpu_only or not torch.cuda.is_available():
        # every shape the GPU stages run, this run's own included
        for n_layers, d in sorted({*GPU_STAGE_SHAPES, (args.layers, args.d)}):
            cpu_part(ModelShape(n_layers=n_layers, hidden_size=d, vocab_size=32000))
    else:
        cpu_part(shape)
    cpu_orchestration(args)
    if args.cpu_only or not torch.cuda.is_available():
        why = "--cpu-only" if args.cpu_only else "no GPU"
        say(
            f"{why}: stopped before allocating the model and capturing CUDA graphs "
            f"(the part above ran in {time.time() - t:.1f}s, {len(FAILURES)} failure(s))"
        )
        for f in FAILURES:
            say(f"   FAIL {f}")
        return 1 if FAILURES else 0
    table = Table(
        args.table,
        args.tag,
        args.batches,
        f"{args.tag}: {torch.cuda.get_device_name()}, {args.layers} layers, d={args.d}, "
        f"bf16, {time.strftime('%Y-%m-%d')}",
    )
    gpu_part(args, shape, table)
    say(f"== done in {time.time() - t:.0f}s: {len(FAILURES)} failure(s)")
    for f in FAILURES:
        say(f"   FAIL {f}")
    if args.table is not None:
        say(f"table written to {args.table} (section {args.tag})")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
