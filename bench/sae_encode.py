"""SAE encoder cost: xmix's `sae` top-K read (the site kernel, through the control block) vs a
plain torch matmul + relu + top-k on the same shapes, time per token, side by side.

    python bench/sae_encode.py                       # CPU: d=512, F=4096/16384, 1/16/64 tokens
    python bench/sae_encode.py --device cuda         # GPU: d=4096, F=16k/65k/131k (defaults)

Per configuration: median over --repeats of the time of one site call (xmix) and of one
`torch.topk(torch.relu(x @ W_enc + b_enc), K)` (torch), divided by the tokens; the ratio is
xmix / torch (below 1: xmix faster). "selected" rows: the tokens of requests that use the
read; the other rows of the batch belong to a request without the app and are skipped by the
kernel (the "1 of N" lines show that they cost nothing but the check). Also reported: the
fraction of xmix's top-K ids equal to torch's (ties aside, 1.0). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch


def setup(d: int, F: int, K: int, n_sel: int, n_other: int, device: str):
    from xmix.lang.api import App
    from xmix.lang.lowering import lower
    from xmix.lang.sae import SAE
    from xmix.lang.sites import ModelShape, site_id
    from xmix.runtime import ops
    from xmix.runtime.control import Capacity, ControlBlock

    g = torch.Generator().manual_seed(0)
    W_enc = torch.randn(d, F, generator=g) / d**0.5
    sae = SAE(
        W_enc,
        torch.randn(F, generator=g) * 0.1 - 0.5,
        torch.randn(F, d, generator=g),
        torch.zeros(d),
        architecture="relu",
    )
    app = App("bench")
    app.read("sae", sae=sae, top_k=K).layers([0]).at("residual.post").named("s")
    shape = ModelShape(n_layers=1, hidden_size=d, vocab_size=32)
    n = n_sel + n_other
    cap = Capacity(
        max_tokens=max(n, 1),
        max_slots=4,
        max_apps=2,
        max_params=16,
        max_channels=4,
        max_ops=4,
        max_cond=4,
        capture_floats=max(n, 1) * 2 * K,
    )
    cb = ControlBlock(shape, device, cap)
    cb.install(lower(app, shape))
    reqs = [("use", n_sel, ["bench"]), ("other", n_other, [])]
    slots = [cb.admit(r, a, None, k) for r, k, a in reqs if k]
    cb.begin_step(
        np.array(slots, np.int32),
        np.array([k for _, k, _ in reqs if k]),
        np.zeros(len(slots), np.int64),
        np.array([k for _, k, _ in reqs if k]),
    )
    cb.prologue(torch.zeros(n, dtype=torch.int32, device=device))
    ops.set_control(cb)
    x = torch.randn(n, d, generator=g).to(device)
    sid = site_id("residual.post", 0, 1)
    return cb, x, sid, sae


def timed(fn, repeats: int, device: str) -> float:
    fn()
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--d", type=int)
    ap.add_argument("--features", type=int, nargs="+")
    ap.add_argument("--tokens", type=int, nargs="+")
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the CPU site kernel runs on one thread)",
    )
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    gpu = args.device == "cuda"
    d = args.d or (4096 if gpu else 512)
    feats = args.features or ([16384, 65536, 131072] if gpu else [4096, 16384])
    tokens = args.tokens or ([1, 16, 64] if not gpu else [1, 8, 64])
    K = args.top_k
    print(
        f"# SAE encode, {args.device}: d={d}, top-K={K}, relu SAE, fp32; torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, {platform.machine()}"
    )
    print(
        f"{'F':>7} {'selected':>12} {'xmix us/tok':>12} {'torch us/tok':>13} {'ratio':>7} {'ids equal':>10}"
    )
    for F in feats:
        for n in tokens:
            for n_sel, n_other in ((n, 0), (1, n - 1)) if n > 1 else ((1, 0),):
                cb, x, sid, sae = setup(d, F, K, n_sel, n_other, args.device)
                W, b = sae.W_enc.to(x.device), sae.b_enc.to(x.device)
                xs = x[:n_sel]
                t_x = timed(
                    lambda x=x, sid=sid: torch.ops.xmix.site(x, None, sid),
                    args.repeats,
                    args.device,
                )
                t_t = timed(
                    lambda xs=xs, W=W, b=b: torch.topk(torch.relu(xs @ W + b), K),
                    args.repeats,
                    args.device,
                )
                got = cb.drain().get("use", {}).get("bench", {}).get("s", {}).get("values", [])
                ref = torch.topk(torch.relu(xs @ W + b), K).indices.cpu()
                eq = (
                    np.mean(
                        [
                            set(v["ids"]) == set(ref[i].tolist()[: len(v["ids"])])
                            for i, v in enumerate(got)
                        ]
                    )
                    if got
                    else float("nan")
                )
                label = f"{n_sel} of {n}" if n_other else f"{n}"
                per = max(n_sel, 1)
                print(
                    f"{F:>7} {label:>12} {t_x / per * 1e6:>12.1f} {t_t / per * 1e6:>13.1f} "
                    f"{t_x / t_t:>7.2f} {eq:>10.2f}"
                )


if __name__ == "__main__":
    main()
