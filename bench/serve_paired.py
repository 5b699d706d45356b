"""What each app costs a request, paired within one `xmix serve` (issue 17).

`bench/serve_overhead.py` compares `xmix serve` with `vllm serve`: two servers, started in
turn, whose figures drift by 10 % between rounds on a shared 2-core machine, more than the
costs it is after. This script measures the part that needs no second server, the cost of an
app over "apps deployed, unused", without that drift: one xmix server, waves of
--concurrency requests sent at once (128 random prompt tokens, 64 output tokens,
ignore_eos), the configurations taking turns wave by wave (the order rotating), and each
wave's figures divided by those of the unused wave next to it. Each request is sent and
timed by vLLM's own client code (`vllm.benchmarks.lib.endpoint_request_func`, what `vllm bench
serve` runs per request: TTFT, the gaps between stream chunks, latency).

The table gives per configuration the median over waves of the paired ratio and its
interquartile range; multiply by serve_overhead's "unused" row for the ratio to vanilla vLLM.
`mixed` (64 distinct bodies) and `mixed-same` (its four app combinations with one set of
parameters) run at --mixed-concurrency against unused waves of the same size; mixed over
mixed-same is the cost of the 64 distinct configurations alone. A second table gives where
the worker's time went per configuration: xmix's own host time per engine step, its step
bookkeeping and its active site programs (the worker's counters, read through
/xmix/v1/status between waves), against the wave's wall time per step. This is a benchmark,
not a test: nothing here asserts on speed.

    python bench/serve_paired.py [--waves 30] [--concurrency 8] [--mixed-concurrency 64]
        [--model llama-8x512] [--configs steer,ablate,probe,cast,mixed-same,mixed]
        [--results FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import serve_overhead as so

# mixed-same: the four app combinations of `mixed` with the apps' own parameters (4
# configurations in flight instead of 64): mixed over mixed-same is what distinct
# configurations cost, apart from what the apps themselves cost
EXTRA = ("mixed-same",)

METRICS = (("mean TTFT", "ttft"), ("mean ITL", "itl"), ("P99 ITL", "p99_itl"), ("mean E2E", "e2e"))


def wave_figures(outs) -> dict[str, float]:
    """One wave's figures (seconds) from vLLM's RequestFuncOutput of each request."""
    import numpy as np

    bad = [o.error for o in outs if not o.success]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed; first: {bad[0][:500]}")
    itls = [x for o in outs for x in o.itl]
    return {
        "ttft": float(np.mean([o.ttft for o in outs])),
        "itl": float(np.mean(itls)),
        "p99_itl": float(np.percentile(itls, 99)),
        "e2e": float(np.mean([o.latency for o in outs])),
    }


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


async def worker_counters(session, base: str) -> dict[str, float]:
    """Worker 0's step count and xmix host seconds (the status route, admin key)."""
    async with session.get(
        f"{base}/xmix/v1/status", headers={"Authorization": f"Bearer {so.ADMIN_KEY}"}
    ) as r:
        st = (await r.json())["workers"][0]["stats"]
    return {k: float(st[k]) for k in ("steps", "host_seconds_step", "host_seconds_sites")}


def host_figures(before: dict, after: dict, wall: float) -> dict[str, float]:
    """Per engine step of one wave, ms: xmix's bookkeeping, its site programs, the step."""
    n = max(after["steps"] - before["steps"], 1.0)
    return {
        "host_step_ms": 1e3 * (after["host_seconds_step"] - before["host_seconds_step"]) / n,
        "host_sites_ms": 1e3 * (after["host_seconds_sites"] - before["host_seconds_sites"]) / n,
        "step_ms": 1e3 * wall / n,
    }


async def run_waves(base: str, model: Path, vocab: int, plan: list[tuple[str, int]], args):
    """Per (config, concurrency): one dict of figures per wave (the first wave is warm-up)."""
    import time

    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_completions,
    )

    rng = random.Random(0)
    got: dict[tuple[str, int], list[dict]] = {p: [] for p in plan}
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    # Idle connections are dropped by the client before the server's keep-alive timeout
    # (uvicorn: 5 s) closes them: between the long waves at --mixed-concurrency the short
    # waves' connections sit idle, and one the server had just closed failed a request.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for w in range(args.waves + 1):
            k = w % len(plan)
            for cfg, c in plan[k:] + plan[:k]:
                bodies = request_bodies(cfg)
                inputs = [
                    RequestFuncInput(
                        prompt=[rng.randrange(10, vocab - 10) for _ in range(args.input_len)],
                        api_url=f"{base}/v1/completions",
                        prompt_len=args.input_len,
                        output_len=args.output_len,
                        model=str(model),
                        ignore_eos=True,
                        extra_body={"temperature": 0, **bodies[i % len(bodies)]},
                    )
                    for i in range(c)
                ]
                before = await worker_counters(session, base)
                t0 = time.perf_counter()
                outs = await asyncio.gather(
                    *(async_request_openai_completions(x, session) for x in inputs)
                )
                wall = time.perf_counter() - t0
                after = await worker_counters(session, base)
                if w:
                    got[(cfg, c)].append(
                        {**wave_figures(outs), **host_figures(before, after, wall)}
                    )
            if w and args.progress:
                print(f"wave {w}/{args.waves}", flush=True)
    return got


def request_bodies(config: str) -> list[dict]:
    if config == "mixed-same":
        return [{"vllm_xargs": {"xmix_apps": apps}} for apps in so.MIXED_COMBOS]
    return so.request_bodies(config)


def table(got: dict[tuple[str, int], list[dict]], configs: list[tuple[str, int]]) -> str:
    head = "| configuration | " + " | ".join(m for m, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 1)]
    for c in sorted({c for _, c in got}):
        base = got[("unused", c)]
        cells = [f"{1e3 * statistics.median(w[k] for w in base):.1f}" for _, k in METRICS]
        lines.append(f"| unused, concurrency {c} (ms) | " + " | ".join(cells) + " |")
    for cfg, c in configs:
        base, mine = got[("unused", c)], got[(cfg, c)]
        cells = []
        for _, k in METRICS:
            lo, med, hi = quartiles([m[k] / b[k] for m, b in zip(mine, base)])
            cells.append(f"{med:.3f} ({lo:.2f}..{hi:.2f})")
        lines.append(f"| {cfg} (concurrency {c}) | " + " | ".join(cells) + " |")
    for (cfg, c), same in [(k, ("mixed-same", k[1])) for k in configs if k[0] == "mixed"]:
        if same in got:
            cells = []
            for _, k in METRICS:
                lo, med, hi = quartiles([m[k] / b[k] for m, b in zip(got[(cfg, c)], got[same])])
                cells.append(f"{med:.3f} ({lo:.2f}..{hi:.2f})")
            lines.append(
                f"| mixed over mixed-same (concurrency {c}): 64 vs 4 configurations | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


def host_table(got: dict[tuple[str, int], list[dict]], plan: list[tuple[str, int]]) -> str:
    lines = [
        "| configuration | step (ms) | xmix bookkeeping (ms) | xmix site programs (ms) "
        "| xmix share of the step |",
        "|---|---|---|---|---|",
    ]
    for cfg, c in plan:
        waves = got[(cfg, c)]
        med = {k: statistics.median(w[k] for w in waves) for k in waves[0] if "ms" in k}
        share = statistics.median(
            (w["host_step_ms"] + w["host_sites_ms"]) / w["step_ms"] for w in waves
        )
        lines.append(
            f"| {cfg} (concurrency {c}) | {med['step_ms']:.2f} | {med['host_step_ms']:.3f} "
            f"| {med['host_sites_ms']:.3f} | {100 * share:.1f} % |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama-8x512")
    ap.add_argument("--waves", type=int, default=30)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--mixed-concurrency", type=int, default=64)
    ap.add_argument("--configs", default="steer,ablate,probe,cast,mixed-same,mixed")
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--results", type=Path)
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args()
    names = [c for c in args.configs.split(",") if c and c != "unused"]
    known = so.CONFIGS + EXTRA
    bad = [c for c in names if c not in known]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {', '.join(known)}")
    configs = [
        (c, args.mixed_concurrency if c.startswith("mixed") else args.concurrency) for c in names
    ]
    plan = [("unused", c) for c in sorted({c for _, c in configs})] + configs

    from transformers import AutoConfig

    model = so.bench_model(args.model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    work = Path(tempfile.mkdtemp(prefix="serve_paired-"))
    apps = so.write_apps(model, work)
    os.environ["OPENAI_API_KEY"] = so.API_KEY  # vLLM's request function reads it
    server = so.Server("xmix", model, apps, work / "xmix.log", args.server_arg)
    try:
        start = server.wait_ready()
        got = asyncio.run(run_waves(server.base, model, vocab, plan, args))
    finally:
        server.stop()

    import torch
    import vllm

    rev = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    text = (
        f"machine: {platform.machine()}, {os.cpu_count()} cores, no GPU; "
        f"torch {torch.__version__}, vLLM {vllm.__version__}\n"
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
        f"command: python bench/serve_paired.py {' '.join(sys.argv[1:])}\n"
        f"code: {rev or 'unknown'}\n"
        f"model: {args.model}, float32; {args.input_len} random prompt tokens, "
        f"{args.output_len} output tokens (ignore_eos); {args.waves} waves per configuration "
        f"after one warm-up wave; server start {start:.0f} s\n\n"
        "ratio to the unused wave next to it (same server, same concurrency): median over "
        "waves (interquartile range); unused rows: medians in ms\n\n"
        + table(got, configs)
        + "\n\nxmix's host time in the worker per engine step (the worker's counters; "
        "medians over waves; step: the wave's wall time over its engine steps)\n\n"
        + host_table(got, plan)
        + "\n"
    )
    print(text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)
        raw = args.results.with_suffix(".json")
        raw.write_text(json.dumps({f"{k[0]}@{k[1]}": v for k, v in got.items()}, indent=1))


if __name__ == "__main__":
    main()
