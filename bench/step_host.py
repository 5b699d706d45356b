"""xmix's host work per engine step on the CPU engine, without vLLM: the worker's per-step
path (``WorkerXmix.begin``: slots, step maps, prologue; every hook site's
``torch.ops.xmix.site`` call; ``after_forward`` and ``take_results``: drain, each request's
results packed as they leave the worker, and step end) for one decode step of 8
requests, each using the configuration's app, timed hot (the same step repeated) and cold
(a pass over a buffer larger than the caches and a matmul before every step, as the model's
forward leaves the caches in a real step).

    python bench/step_host.py [--d 512] [--layers 8] [--rows 8] [--steps 300] [--evict-mib 32]
    python bench/step_host.py --instructions [--steps 20]

--instructions counts instructions instead of seconds (issue 29): the same steps, hot, run
under `valgrind --tool=callgrind`, collection switched on (valgrind's client requests, from
xmix/_site_op.so) only around each configuration's --steps steps (not the block, the apps
and the inputs made before them), once with the native site
kernel and once with the Python reference kernel in the dispatcher's CPU slot, each stretch
dumped on its own; instructions per step are exact and repeatable where seconds on a shared
2-core machine are not. One run takes minutes (torch imports under valgrind).

Configurations: ``none`` (no app deployed), ``unused`` (apps deployed, no request uses
them), ``steer`` (one add at one layer), ``ablate`` (3 sites x every layer), ``probe`` (one
read, drained every step), ``monitor`` (the probe's read as a monitor that never fires: a
stop on it and an add under ``since(...)`` on it, thresholds out of reach; its cost beyond the
probe's is a monitor's). The serving runs' counters (``bench/serve_paired.py``: xmix
bookkeeping and site programs per step) are measured inside the engine, where every step is
cold; this shows how much of them is the cold caches rather than the work. Medians over
--steps steps, one torch thread (vLLM's CPU worker runs one). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

CONFIGS = ("none", "unused", "steer", "ablate", "probe", "monitor")
SITES = ("residual.pre", "attention.post", "mlp.post", "residual.post")


def build(config: str, d: int, n_layers: int, rows: int):
    import xmix
    from xmix.integrations.vllm.worker.worker import WorkerXmix
    from xmix.lang.lowering import lower
    from xmix.lang.sites import ModelShape, site_id
    from xmix.runtime.control import Capacity, ControlBlock

    shape = ModelShape(n_layers=n_layers, hidden_size=d, vocab_size=32000)
    cb = ControlBlock(shape, "cpu", Capacity(max_tokens=max(rows, 512), max_slots=rows + 8))
    g = torch.Generator().manual_seed(0)
    apps = {}
    apps["steer"] = xmix.App("steer")
    apps["steer"].write("add", vector=torch.randn(d, generator=g), scale=1.0).layers(
        [n_layers // 2]
    ).at("residual.post")
    apps["ablate"] = xmix.App("ablate")
    r = torch.randn(d, generator=g)
    for s in SITES[:3]:
        apps["ablate"].write("ablate", direction=r).layers("all").at(s)
    apps["probe"] = xmix.App("probe")
    w_probe = torch.randn(d, generator=g) / d**0.5
    at = min(n_layers // 2 + 1, n_layers - 1)
    apps["probe"].read("probe", weight=w_probe).layers([at]).at("residual.post").named("p")
    apps["monitor"] = xmix.App("monitor")  # a sigmoid never reaches 2: nothing fires
    apps["monitor"].read("probe", weight=w_probe).layers([at]).at("residual.post").named("p")
    apps["monitor"].write("add", vector=torch.randn(d, generator=g), scale=1.0).at(
        "final.post"
    ).cond(when="since(p > 2.0)")
    apps["monitor"].stop(when="p > 2.0")
    if config != "none":
        for a in apps.values():
            cb.install(lower(a, shape))
    x = WorkerXmix.for_control_block(cb)
    rids = [f"r{i}" for i in range(rows)]
    for rid in rids:
        cb.admit(rid, [config] if config in apps else [], {}, 128)
    # every site a Llama layer has, and final.post, as the compiled graph calls them each step
    sites = [site_id(s, layer, n_layers) for layer in range(n_layers) for s in SITES]
    sites.append(site_id("final.post", None, n_layers))
    return x, rids, sites


def run(config: str, args, cold: bool, counted: Any = None) -> dict[str, float]:
    """The configuration's steps; ``counted``: (start, stop) called around the steps alone
    (callgrind's collection), after the block, the apps and the inputs are made."""
    d, rows = args.d, args.rows
    x, rids, sites = build(config, d, args.layers, rows)
    h, res = torch.randn(rows, d), torch.randn(rows, d)
    ids = torch.randint(0, 32000, (rows,))
    n_tok, plen = np.ones(rows, dtype=np.int64), np.full(rows, 128, dtype=np.int64)
    evict = torch.randn(args.evict_mib * (1 << 18)) if cold else None
    w = torch.randn(d, 4 * d) if cold else None
    starts = [np.full(rows, 128 + step, dtype=np.int64) for step in range(args.steps)]
    parts: dict[str, list[float]] = {"begin": [], "sites": [], "after": []}
    if counted is not None:
        counted[0]()
    for step in range(args.steps):
        if evict is not None and w is not None:
            evict.mul_(1.0000001)
            (h @ w).sum()
        start = starts[step]
        t0 = time.perf_counter()
        x.begin(rids, n_tok, start, plen, ids, rows)
        t1 = time.perf_counter()
        for s in sites:
            torch.ops.xmix.site(h, res, s)
        t2 = time.perf_counter()
        x.after_forward()
        if x.has_results():
            x.take_results()()
        t3 = time.perf_counter()
        parts["begin"].append(t1 - t0)
        parts["sites"].append(t2 - t1)
        parts["after"].append(t3 - t2)
    if counted is not None:
        counted[1]()
    return {k: statistics.median(v) * 1e6 for k, v in parts.items()}


KERNELS = ("native", "python")


@contextlib.contextmanager
def site_kernel(kernel: str):
    """The dispatcher's CPU kernel for xmix::site while open: the native one, or the Python
    reference put in its slot (the native one comes back when the library object goes)."""
    if kernel == "native":
        yield
        return
    from xmix.runtime import ops

    with ops.reference_site_kernel():
        yield


def instructions_child(configs: list[str], args) -> None:
    """Under callgrind: each (configuration, kernel) runs its steps between xmix_cg_start and
    xmix_cg_stop, which dumps their instructions as a part file labelled config/kernel."""
    import warnings

    from xmix.runtime import ops

    warnings.filterwarnings("ignore", message=".*[Oo]verrid")
    if ops.NATIVE is None or not ops.NATIVE.xmix_cg_available():
        raise SystemExit("xmix/_site_op.so was built without valgrind's callgrind.h")
    ops.NATIVE.xmix_cg_stop.argtypes = [ctypes.c_char_p]
    hot = argparse.Namespace(**{**vars(args), "evict_mib": 0})
    warm = argparse.Namespace(**{**vars(hot), "steps": 3})
    for config in configs:
        for kernel in KERNELS:
            label = f"{config}/{kernel}".encode()
            with site_kernel(kernel):
                run(config, warm, cold=False)  # imports and first-call work, not counted
                run(
                    config,
                    hot,
                    cold=False,
                    counted=(
                        ops.NATIVE.xmix_cg_start,
                        lambda lb=label: ops.NATIVE.xmix_cg_stop(lb),
                    ),
                )


def instructions(configs: list[str], args) -> dict[tuple[str, str], float]:
    """Instructions per step by (configuration, kernel): the child under callgrind, each
    stretch dumped to its own part file (``<out>.N``: "desc: Trigger: Client Request: LABEL"
    and "summary: IR")."""
    if not shutil.which("valgrind"):
        raise SystemExit("--instructions needs valgrind on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.callgrind_out or os.path.join(tmp, "callgrind.out")
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--instructions-child",
            f"--configs={','.join(configs)}",
            f"--steps={args.steps}",
            f"--d={args.d}",
            f"--layers={args.layers}",
            f"--rows={args.rows}",
        ]
        child = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}
        )
        if child.returncode != 0:
            raise SystemExit(f"the child under callgrind failed:\n{child.stderr[-4000:]}")
        parts = [
            open(f).read()
            for f in sorted(glob.glob(out + ".*"), key=lambda f: int(f.rsplit(".", 1)[1]))
        ]
    costs = part_costs(parts)
    want = [(c, k) for c in configs for k in KERNELS]
    if sorted(costs) != sorted(want):
        raise SystemExit(f"callgrind dumped {sorted(costs)}, expected {want}")
    return {key: ir / args.steps for key, ir in costs.items()}


def part_costs(parts: list[str]) -> dict[tuple[str, str], int]:
    """(configuration, kernel) -> instructions, from callgrind's part files' headers."""
    out: dict[tuple[str, str], int] = {}
    for text in parts:
        label = re.search(r"^desc: Trigger: Client Request: (\S+)/(\S+)$", text, re.M)
        total = re.search(r"^summary: (\d+)$", text, re.M)
        if label and total:
            out[(label.group(1), label.group(2))] = int(total.group(1))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--evict-mib", type=int, default=32)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="instructions per step under callgrind, native and Python site kernels",
    )
    ap.add_argument("--instructions-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--callgrind-out", help="keep callgrind's part files here (--instructions)")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {', '.join(CONFIGS)}")
    if args.steps < 1 or args.rows < 1 or args.layers < 1:
        ap.error("--steps, --rows and --layers must be at least 1")
    torch.set_num_threads(1)
    if args.instructions_child:
        instructions_child(configs, args)
        return
    if args.instructions:
        ir = instructions(configs, args)
        print(
            f"# instructions per decode step (callgrind, hot, {args.steps} steps per stretch): "
            f"d={args.d}, {args.layers} layers ({args.layers * len(SITES) + 1} sites), "
            f"{args.rows} requests; torch {torch.__version__}, {platform.machine()}"
        )
        print("| configuration | native site kernel | Python site kernel | native / Python |")
        print("|---|---|---|---|")
        for config in configs:
            n, p = ir[(config, "native")], ir[(config, "python")]
            print(f"| {config} | {n:,.0f} | {p:,.0f} | {n / p:.3f} |")
        return
    print(
        f"# xmix host work per decode step: d={args.d}, {args.layers} layers "
        f"({args.layers * len(SITES) + 1} sites, final.post included), {args.rows} requests; torch {torch.__version__}, "
        f"1 thread, {platform.machine()}; cold: {args.evict_mib} MiB evicted before each step"
    )
    print("| configuration | caches | begin µs | sites µs | after µs | total µs |")
    print("|---|---|---|---|---|---|")
    for config in configs:
        for cold in (False, True):
            p = run(config, args, cold)
            total = p["begin"] + p["sites"] + p["after"]
            print(
                f"| {config} | {'cold' if cold else 'hot'} | {p['begin']:.1f} | "
                f"{p['sites']:.1f} | {p['after']:.1f} | {total:.1f} |"
            )


if __name__ == "__main__":
    main()
