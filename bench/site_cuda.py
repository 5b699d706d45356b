"""The CUDA op kernel (`xmix_op_kernel`, the node a patched graph runs per op and site) against
PyTorch doing the same math, side by side, in CUDA graphs as vLLM replays them: a graph of
--nodes launches of one op at one batch size, replayed, per launch.

    python bench/site_cuda.py [--d 4096] [--rows 1 8 64 256] [--nodes 96] [--dtype bfloat16]

Ops as in bench/site_cpu.py: `add` (steering), `ablate` (the projection on a unit vector
removed), `probe` (sigmoid(w . x + b), a read), and "none" (the app deployed, the step's
request not using it: what an op node costs a step where nothing selects it). xmix: the op
node exactly as the applier splices it (`_C.launch_op` while capturing), every row's request
using the app. torch: the eager ops a forward hook would run for the same result
(`h += s * v`; `h -= ((h + r) @ u)[:, None] * u`; `sigmoid((h + r) @ w + b)`), captured the
same way. "empty": a graph of --nodes launches of a kernel that returns at once (what any
node costs). Median of --rounds rounds of --replays replays, CUDA events. Needs a GPU and
xmix._C built with CUDA; prints, asserts nothing. The max abs difference from torch's result
of one launch is printed as a check of the comparison.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from site_cpu import OPS, setup, torch_op  # bench/, beside this script


def graph_of(fn, nodes: int):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            fn()
    return g


def per_launch_us(g, nodes: int, rounds: int, replays: int) -> float:
    for _ in range(3):
        g.replay()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        out.append(1000.0 * a.elapsed_time(b) / (replays * nodes))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--nodes", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("site_cuda: needs a CUDA GPU (torch.cuda.is_available() is False)")
    from xmix import _C
    from xmix.runtime.ops import _args

    if not _C.built_with_cuda():
        raise SystemExit("site_cuda: xmix._C was built without CUDA")
    dtype = getattr(torch, args.dtype)
    print(
        f"# CUDA op node vs torch, d={args.d} {args.dtype}, {args.nodes} launches per graph; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    x = torch.zeros(1, device="cuda")
    t_empty = per_launch_us(
        graph_of(lambda: x.add_(0), args.nodes), args.nodes, args.rounds, args.replays
    )
    print(f"empty (a one-element torch kernel): {t_empty:.2f} us per launch")
    print(f"{'op':>7} {'rows':>5} {'xmix us':>8} {'torch us':>9} {'ratio':>6} {'max diff':>9}")
    for n in args.rows:
        for op in OPS:
            cb, h, r, u, sid = setup(op, args.d, n, dtype, "cuda")
            nn, d, sh, sr, rp, dt = _args(h, r)

            def xmix_op(cb=cb, h=h, sid=sid, rp=rp, nn=nn, d=d, sh=sh, sr=sr, dt=dt):
                stream = torch.cuda.current_stream().cuda_stream
                _C.launch_op(cb.ptr, sid, 0, h.data_ptr(), rp, nn, d, sh, sr, dt, stream)

            hx, ht = h.clone(), h.clone()
            nn2, _, sh2, _, rp2, _ = _args(hx, r)
            _C.launch_op(
                cb.ptr,
                sid,
                0,
                hx.data_ptr(),
                rp2,
                nn2,
                d,
                sh2,
                sr,
                dt,
                torch.cuda.current_stream().cuda_stream,
            )
            want = torch_op(op, ht, r, u)
            torch.cuda.synchronize()
            if op == "probe":
                R = cb.cap.max_channels
                got = cb.dev["results"].reshape(-1)[: n * R].reshape(n, R)[:, 0].float()
                diff = (got - want.float()).abs().max().item()
            elif op == "none":
                diff = (hx.float() - h.float()).abs().max().item()
            else:
                diff = (hx.float() - want.float()).abs().max().item()
            t_x = per_launch_us(
                graph_of(xmix_op, args.nodes), args.nodes, args.rounds, args.replays
            )
            t_t = float("nan")
            if op != "none":
                g_t = graph_of(lambda op=op, h=h, r=r, u=u: torch_op(op, h, r, u), args.nodes)
                t_t = per_launch_us(g_t, args.nodes, args.rounds, args.replays)
            print(f"{op:>7} {n:>5} {t_x:8.2f} {t_t:9.2f} {t_x / t_t:6.2f} {diff:9.2e}")


if __name__ == "__main__":
    main()
