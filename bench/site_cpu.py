"""The CPU site kernel (`xmix::site` on the CPU engine) against its Python reference and
torch doing the same math, side by side: time of one site call per op, decode-sized (8 rows)
and prefill-sized (1 024 rows) batches.

    python bench/site_cpu.py [--d 512] [--rows 8 1024] [--dtype float32 bfloat16] [--repeats 200]

Ops: `add` (steering), `ablate` (directional ablation: the projection on a unit vector
removed), `probe` (sigmoid(w . x + b), a read). xmix: `torch.ops.xmix.site(h, r, site)` with
the app deployed in a control block and every row's request using it, what the compiled
graph calls at each hook site (the call from Python, the argument checks, the C++ site
program): the native kernel the dispatcher calls (xmix/_site_op.so), and "python", the same
call with the Python reference kernel (`xmix.runtime.ops._site_cpu`, what served every site before
issue 29) put in the dispatcher's CPU slot for the measurement. torch: the eager ops a PyTorch forward hook would run for the same result on the
same tensors (`h += s * v`; `h -= ((h + r) @ u)[:, None] * u`; `sigmoid((h + r) @ w + b)`).
Also: "none", a site no request's app uses (what every other site costs a step). Medians of
--repeats calls, one torch thread (vLLM's CPU worker runs one). The max abs difference from
torch's result is printed as a check of the comparison, not asserted. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

OPS = ("none", "add", "ablate", "probe")


def setup(op: str, d: int, n: int, dtype: torch.dtype, device: str = "cpu"):
    """A control block on `device` with one app doing `op` at one site, one request of n rows
    using it (none for "none"), and rows h, r and the op's vector u in dtype there
    (bench/site_cuda.py takes it too)."""
    from xmix.lang.api import App
    from xmix.lang.lowering import lower
    from xmix.lang.sites import ModelShape, site_id
    from xmix.runtime import ops
    from xmix.runtime.control import Capacity, ControlBlock

    g = torch.Generator().manual_seed(0)
    u = torch.randn(d, generator=g)
    u /= u.norm()
    app = App("bench")
    if op == "add":
        app.write("add", vector=u, scale=2.0).layers([0]).at("residual.pre")
    elif op == "ablate":
        app.write("ablate", direction=u).layers([0]).at("residual.pre")
    else:  # probe, and "none" (deployed, not used by the step's request)
        app.read("probe", weight=u, bias=0.5).layers([0]).at("residual.pre").named("p")
    shape = ModelShape(n_layers=1, hidden_size=d, vocab_size=32)
    cap = Capacity(
        max_tokens=max(n, 8),
        max_slots=2,
        max_apps=2,
        max_params=16,
        max_channels=4,
        max_ops=4,
        max_cond=4,
        capture_floats=4,
    )
    cb = ControlBlock(shape, torch.device(device), cap)
    cb.install(lower(app, shape))
    slot = cb.admit("req", [] if op == "none" else ["bench"], None, n)
    cb.begin_step(np.array([slot], np.int32), np.array([n]), np.zeros(1, np.int64), np.array([n]))
    cb.prologue(torch.zeros(n, dtype=torch.int32, device=device))
    ops.set_control(cb)
    h = torch.randn(n, d, generator=g).to(dtype).to(device)
    r = torch.randn(n, d, generator=g).to(dtype).to(device)
    return cb, h, r, u.to(dtype).to(device), site_id("residual.pre", 0, 1)


def torch_op(op: str, h: torch.Tensor, r: torch.Tensor, u: torch.Tensor):
    if op == "add":
        return h.add_(u, alpha=2.0)
    if op == "ablate":
        proj = (h + r) @ u
        return h.sub_(proj[:, None] * u)
    if op == "probe":
        return torch.sigmoid((h + r) @ u + 0.5)
    return None


def timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 1024])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"# CPU site kernel vs torch eager, d={args.d}; torch {torch.__version__}, 1 thread, "
        f"{platform.machine()}"
    )
    import warnings

    from xmix.runtime import ops

    warnings.filterwarnings("ignore", message=".*[Oo]verrid")  # the Python kernel put in
    if ops.NATIVE is None:
        raise SystemExit("xmix/_site_op.so is not built: there is no native kernel to measure")
    print(
        f"{'op':>7} {'dtype':>9} {'rows':>5} {'xmix us':>9} {'python us':>9} {'torch us':>9} "
        f"{'ratio':>6} {'max diff':>9}"
    )
    for dt_name in args.dtype:
        dtype = getattr(torch, dt_name)
        for n in args.rows:
            for op in OPS:
                cb, h, r, u, sid = setup(op, args.d, n, dtype)
                # one call on copies, to compare the results (writes are in place)
                hx, ht = h.clone(), h.clone()
                torch.ops.xmix.site(hx, r, sid)
                want = torch_op(op, ht, r, u)
                if op == "probe":
                    got = torch.from_numpy(cb.host["results"][: n * cb.cap.max_channels])
                    got = got.reshape(n, -1)[:, 0]
                    diff = (got - want.float()).abs().max().item()
                elif op == "none":
                    diff = (hx.float() - h.float()).abs().max().item()
                else:
                    diff = (hx.float() - want.float()).abs().max().item()
                t_x = timed(lambda h=h, r=r, sid=sid: torch.ops.xmix.site(h, r, sid), args.repeats)
                with ops.reference_site_kernel():
                    t_p = timed(
                        lambda h=h, r=r, sid=sid: torch.ops.xmix.site(h, r, sid), args.repeats
                    )
                t_t = (
                    timed(lambda h=h, r=r, u=u, op=op: torch_op(op, h, r, u), args.repeats)
                    if op != "none"
                    else float("nan")
                )
                print(
                    f"{op:>7} {dt_name:>9} {n:>5} {1e6 * t_x:9.1f} {1e6 * t_p:9.1f} {1e6 * t_t:9.1f} "
                    f"{t_x / t_t:6.2f} {diff:9.2e}"
                )


if __name__ == "__main__":
    main()
