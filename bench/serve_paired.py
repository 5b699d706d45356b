"""What each app costs a request, paired within one `xmix serve` (issue 17).

`bench/serve_overhead.py` compares `xmix serve` with `vllm serve`: two servers, started in
turn, whose figures drift by 10 % between rounds on a shared 2-core machine, more than the
costs it is after. This script measures the part that needs no second server, the cost of an
app over "apps deployed, unused", without that drift: one xmix server, waves of
--concurrency requests sent at once (128 random prompt tokens, 64 output tokens,
ignore_eos), the configurations taking turns wave by wave (a new order every turn), and each
wave's figures divided by those of the unused wave next to it. Each request is sent and
timed by vLLM's own client code (`vllm.benchmarks.lib.endpoint_request_func`, what `vllm bench
serve` runs per request: TTFT, the gaps between stream chunks, latency).

The table gives per configuration the median over waves of the paired ratio and its
interquartile range; multiply by serve_overhead's "unused" row for the ratio to vanilla vLLM.
`mixed` (64 distinct bodies) and `mixed-same` (its four app combinations with one set of
parameters) run at --mixed-concurrency against unused waves of the same size; mixed over
mixed-same is the cost of the 64 distinct configurations alone; monitor over probe (the
probe's read as a monitor whose stop and since(...) never fire, issue 31) is what a monitor
costs beyond its read. A second table gives where
the worker's time went per configuration: xmix's own host time per engine step, its step
bookkeeping and its active site programs (the worker's counters, read through
/xmix/v1/status between waves), against the wave's wall time per step. This is a benchmark,
not a test: nothing here asserts on speed.

--vanilla keeps a `vllm serve` (plugins off, same model and flags) up beside the xmix server
and adds its waves to the rotation: "unused over vanilla" is then the cost of deploying xmix,
paired wave by wave, with none of serve_overhead's server-to-server drift (servers started in
turn, each run's regime, lockstep or staggered, set by chance; two such vanilla servers differ
by 10 %). An idle server takes almost nothing (its worker polls: ~1 % of a core). --control
adds a second, identical vanilla server ("vanilla-again"): "vanilla-again over vanilla" is the
method's own floor, what two servers that differ in nothing show. --nosites adds an xmix
server with no hook site placed and no app (`{"xmix": {"sites": []}}`), sent the unused
requests: unused over it is what the hook sites (41 on the 8-layer Llama) cost a server where
no app runs (their calls and what they change in the compiled graph), it over vanilla what the
rest of xmix costs. A wave on one server waits --switch-gap seconds after a wave on another:
the worker that just stepped keeps polling vLLM's shared-memory queue with sched_yield for 1 s after its last read
(`shm_broadcast.SpinCondition`, busy_loop_s), on the core the next server's worker is bound
to as well (vLLM's CPU worker binds core 0 on a 2-core machine). Without the gap the next
wave's first second ran beside that spin: mean TTFT came in steps of ~0.5 s (0.39 to
1.46 s; one server alone: 0.39-0.47 s); with 1.5 s it is 0.37-0.56 s on every server.
--instances repeats the whole run with fresh servers (started in alternating order), since a
server process can be faster or slower than another for its whole life; the table then also
gives each instance's median. With a vanilla server, a last table gives each median over
vanilla with a 95 % bootstrap interval of the median (fixed seed): the interquartile range
says how much single waves differ, the interval how finely the run's waves resolve the median.

    python bench/serve_paired.py [--waves 30] [--concurrency 8] [--mixed-concurrency 64]
        [--model llama-8x512] [--configs steer,ablate,probe,cast,monitor,mixed-same,mixed]
        [--vanilla] [--control] [--instances 1] [--switch-gap 1.5] [--results FILE.md]
    python bench/serve_paired.py --from-json FILE.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

import serve_overhead as so

# mixed-same: the four app combinations of `mixed` with the apps' own parameters (4
# configurations in flight instead of 64): mixed over mixed-same is what distinct
# configurations cost, apart from what the apps themselves cost
EXTRA = ("mixed-same",)
# configurations that run on a vanilla server of their own (--vanilla, --control)
VANILLA = ("vanilla", "vanilla-again")
# --nosites: an xmix server with no hook site placed (additional_config {"xmix": {"sites": []}})
# and no app, sent the unused requests: what xmix costs besides its sites
NOSITES = "xmix-nosites"
NOSITES_CONFIG = '{"xmix": {"sites": []}}'

METRICS = (("mean TTFT", "ttft"), ("mean ITL", "itl"), ("P99 ITL", "p99_itl"), ("mean E2E", "e2e"))


def wave_figures(outs) -> dict[str, float]:
    """One wave's figures (seconds) from vLLM's RequestFuncOutput of each request."""
    import numpy as np

    bad = [o.error for o in outs if not o.success]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed; first: {bad[0][:500]}")
    itls = [x for o in outs for x in o.itl]
    # A loaded server can stream a short output as one chunk per request: the wave then has no
    # gap between chunks and no ITL (NaN, left out of every median; the tables say "n/a").
    return {
        "ttft": float(np.mean([o.ttft for o in outs])),
        "itl": float(np.mean(itls)) if itls else math.nan,
        "p99_itl": float(np.percentile(itls, 99)) if itls else math.nan,
        "e2e": float(np.mean([o.latency for o in outs])),
    }


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def ratios(mine: list[dict], base: list[dict], k: str) -> list[float]:
    """Wave-by-wave ratios of metric k, leaving out the pairs where either wave had none."""
    return [m[k] / b[k] for m, b in zip(mine, base) if not (math.isnan(m[k]) or math.isnan(b[k]))]


def median_ms(waves: list[dict], k: str) -> str:
    xs = [w[k] for w in waves if not math.isnan(w[k])]
    return f"{1e3 * statistics.median(xs):.1f}" if xs else "n/a"


async def worker_counters(session, base: str) -> dict[str, float]:
    """Worker 0's step count and xmix host seconds (the status route, admin key)."""
    async with session.get(
        f"{base}{so.XMIX_STATUS}", headers={"Authorization": f"Bearer {so.ADMIN_KEY}"}
    ) as r:
        return so.worker_stats(await r.json())


ROLES = (("api_server", "cpu_api"), ("engine_core", "cpu_core"), ("worker", "cpu_worker"))


def cpu_seconds(procs: dict) -> dict[str, float]:
    """User + system CPU seconds so far of each of a server's processes (psutil.Process)."""
    out = {}
    for role, proc in procs.items():
        t = proc.cpu_times()
        out[role] = t.user + t.system
    return out


def cpu_figures(before: dict, after: dict) -> dict[str, float]:
    """CPU ms of one wave per process role, vLLM's spinning waits included (the engine core's
    and the worker's: they track the wave's wall time; the API server's asyncio loop sleeps
    in epoll, so its figure is its work)."""
    return {key: 1e3 * (after[role] - before[role]) for role, key in ROLES if role in after}


def host_figures(before: dict, after: dict, wall: float) -> dict[str, float]:
    """Per engine step of one wave, ms: xmix's bookkeeping, its site programs, the step."""
    n = max(after["steps"] - before["steps"], 1.0)
    return {**so.host_per_step(before, after), "step_ms": 1e3 * wall / n}


async def run_waves(
    bases: dict[str, str],
    model: Path,
    vocab: int,
    plan: list[tuple[str, int]],
    args,
    procs: dict[str, dict] | None = None,
):
    """Per (config, concurrency): one dict of figures per wave (the first wave is warm-up).
    `bases`: the xmix server's URL under "xmix", each vanilla configuration's under its name;
    `procs`: per URL, the server's processes by role (psutil), for each wave's CPU time."""
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
    # A new order every turn (a fixed seed): rotating one order kept each configuration's
    # neighbours, so the same one always came first after a switch of server (and its pause)
    # and the same one last before it (2026-12-05, 3 x 64 waves: steer first, unused last).
    order_rng = random.Random(1)
    last = None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for w in range(args.waves + 1):
            order = list(plan)
            order_rng.shuffle(order)
            for cfg, c in order:
                bodies = request_bodies(cfg)
                base = bases.get(cfg, bases["xmix"])
                switched = last not in (None, base)
                if switched:
                    # the server that just ran a wave is still spinning (see the top)
                    await asyncio.sleep(args.switch_gap)
                last = base
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
                counted = cfg not in VANILLA  # a vanilla server has no xmix counters
                before = await worker_counters(session, base) if counted else None
                mine = (procs or {}).get(base, {})
                cpu0 = cpu_seconds(mine)
                t0 = time.perf_counter()
                outs = await asyncio.gather(
                    *(async_request_openai_completions(x, session) for x in inputs)
                )
                wall = time.perf_counter() - t0
                cpu1 = cpu_seconds(mine)
                after = await worker_counters(session, base) if counted else None
                if w:
                    figs = wave_figures(outs)
                    figs["after_switch"] = float(switched)
                    figs.update(cpu_figures(cpu0, cpu1))
                    if counted:
                        figs.update(host_figures(before, after, wall))
                    got[(cfg, c)].append(figs)
            if w and args.progress:
                print(f"wave {w}/{args.waves}", flush=True)
    return got


def request_bodies(config: str) -> list[dict]:
    if config in (*VANILLA, NOSITES):
        return [{}]
    if config == "mixed-same":
        return [{"vllm_xargs": {"xmix_apps": apps}} for apps in so.MIXED_COMBOS]
    return so.request_bodies(config)


def paired_cells(mine: list[dict], base: list[dict]) -> list[str]:
    cells = []
    for _, k in METRICS:
        xs = ratios(mine, base, k)
        if not xs:
            cells.append("n/a")
            continue
        lo, med, hi = quartiles(xs)
        cells.append(f"{med:.3f} ({lo:.2f}..{hi:.2f})")
    return cells


def vanilla_rows(got: dict[tuple[str, int], list[dict]]) -> list[str]:
    """unused over vanilla (xmix deployed against vanilla vLLM, wave by wave), the control,
    and each app over vanilla (its wave against the vanilla wave of the same turn)."""
    rows = []
    for c in sorted({c for cfg, c in got if cfg == "vanilla"}):
        van = got[("vanilla", c)]
        labels = [
            ("unused", f"unused over vanilla: xmix deployed, no app used (concurrency {c})"),
            ("vanilla-again", f"control: vanilla-again over vanilla (concurrency {c})"),
            (NOSITES, f"xmix without hook sites, no app over vanilla (concurrency {c})"),
        ] + [
            (cfg, f"{cfg} over vanilla (concurrency {c})")
            for cfg, cc in got
            if cc == c and cfg not in ("unused", NOSITES, *VANILLA)
        ]
        for cfg, label in labels:
            if (cfg, c) in got:
                rows.append(f"| {label} | " + " | ".join(paired_cells(got[(cfg, c)], van)) + " |")
    return rows


def load_waves(path: Path) -> dict[tuple[str, int], list[dict]]:
    """A run's per-wave figures as written next to its results (FILE.json)."""
    raw = json.loads(path.read_text())
    return {(k.rsplit("@", 1)[0], int(k.rsplit("@", 1)[1])): v for k, v in raw.items()}


def table(got: dict[tuple[str, int], list[dict]], configs: list[tuple[str, int]]) -> str:
    head = "| configuration | " + " | ".join(m for m, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 1)]
    for name in ("vanilla", "unused"):
        for c in sorted({c for cfg, c in got if cfg == name}):
            base = got[(name, c)]
            cells = [median_ms(base, k) for _, k in METRICS]
            lines.append(f"| {name}, concurrency {c} (ms) | " + " | ".join(cells) + " |")
    lines += vanilla_rows(got)
    for cfg, c in configs:
        cells = paired_cells(got[(cfg, c)], got[("unused", c)])
        lines.append(f"| {cfg} (concurrency {c}) | " + " | ".join(cells) + " |")
    for (cfg, c), same in [(k, ("mixed-same", k[1])) for k in configs if k[0] == "mixed"]:
        if same in got:
            lines.append(
                f"| mixed over mixed-same (concurrency {c}): 64 vs 4 configurations | "
                + " | ".join(paired_cells(got[(cfg, c)], got[same]))
                + " |"
            )
    for c in [c for cfg, c in configs if cfg == "monitor" and ("probe", c) in got]:
        lines.append(
            f"| monitor over probe (concurrency {c}): a stop and a since(...) that never fire | "
            + " | ".join(paired_cells(got[("monitor", c)], got[("probe", c)]))
            + " |"
        )
    return "\n".join(lines)


def median_interval(xs: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median of xs (percentile method, fixed seed, so a run's
    file gives the same interval every time it is read)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def interval_table(got: dict[tuple[str, int], list[dict]]) -> str:
    """Over vanilla, each median with the 95 % bootstrap interval of the median: how finely the
    run's waves resolve it (the interquartile range says how much single waves differ)."""
    keys = (("mean TTFT", "ttft"), ("mean ITL", "itl"), ("mean E2E", "e2e"))
    lines = [
        "over vanilla: median over waves [95 % bootstrap interval of the median]",
        "",
        "| configuration | " + " | ".join(m for m, _ in keys) + " |",
        "|" + "---|" * (len(keys) + 1),
    ]
    for c in sorted({c for cfg, c in got if cfg == "vanilla"}):
        van = got[("vanilla", c)]
        for cfg, cc in got:
            if cc != c or cfg == "vanilla":
                continue
            cells = []
            for _, k in keys:
                xs = ratios(got[(cfg, cc)], van, k)
                if not xs:
                    cells.append("n/a")
                    continue
                lo, hi = median_interval(xs)
                cells.append(f"{statistics.median(xs):.3f} [{lo:.3f}, {hi:.3f}]")
            lines.append(f"| {cfg} (concurrency {c}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def position_table(got: dict[tuple[str, int], list[dict]]) -> str:
    """Over vanilla, each xmix configuration's waves split by whether the wave came first after
    a switch from another server (as almost every vanilla wave does): the like-for-like
    comparison is the "after a switch" column."""
    lines = [
        "over vanilla, by the xmix wave's place: median (waves) after a switch of server / "
        "without one (mean ITL, mean E2E)",
        "",
        "| configuration | after a switch: ITL | E2E | without: ITL | E2E |",
        "|---|---|---|---|---|",
    ]
    for c in sorted({c for cfg, c in got if cfg == "vanilla"}):
        van = got[("vanilla", c)]
        for cfg, cc in got:
            if cc != c or cfg in VANILLA or "after_switch" not in got[(cfg, cc)][0]:
                continue
            cells = []
            for flag in (1.0, 0.0):
                pairs = [(m, b) for m, b in zip(got[(cfg, cc)], van) if m["after_switch"] == flag]
                for k in ("itl", "e2e"):
                    xs = ratios([m for m, _ in pairs], [b for _, b in pairs], k)
                    cells.append(f"{statistics.median(xs):.3f} ({len(xs)})" if xs else "n/a")
            lines.append(f"| {cfg} (concurrency {c}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def instance_table(got: dict[tuple[str, int], list[dict]]) -> str:
    """Per server instance, the median paired ratio to vanilla (a server process can be faster
    or slower than another for its whole life; the instances show how much)."""
    first = ("unused", "vanilla-again", NOSITES)  # the servers' own rows, then the apps
    pairs = sorted(
        ((cfg, c) for cfg, c in got if cfg != "vanilla" and ("vanilla", c) in got),
        key=lambda p: (p[1], first.index(p[0]) if p[0] in first else len(first)),
    )
    n = max(w["instance"] for w in got[pairs[0]]) + 1
    head = "| over vanilla | " + " | ".join(f"instance {i + 1}" for i in range(n)) + " |"
    lines = [
        "per instance, median over its waves (mean ITL / mean E2E)",
        "",
        head,
        "|" + "---|" * (n + 1),
    ]
    for cfg, c in pairs:
        cells = []
        for i in range(n):
            mine = [w for w in got[(cfg, c)] if w["instance"] == i]
            van = [w for w in got[("vanilla", c)] if w["instance"] == i]
            itl, e2e = (
                f"{statistics.median(xs):.3f}" if (xs := ratios(mine, van, k)) else "n/a"
                for k in ("itl", "e2e")
            )
            cells.append(f"{itl} / {e2e}")
        lines.append(f"| {cfg} (concurrency {c}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def server_processes(srv) -> dict:
    """A started server's API server, engine core and worker processes (psutil)."""
    import psutil

    return {role: psutil.Process(pid) for role, pid in srv.engine_pids().items()}


def cpu_table(got: dict[tuple[str, int], list[dict]]) -> str:
    """Each server process's CPU per wave: medians (ms), and over vanilla the median of the
    wave-by-wave ratios (the vanilla wave of the same turn and concurrency)."""
    keys = [k for _, k in ROLES]
    lines = [
        "| configuration | API server ms | engine core ms | worker ms "
        "| API server over vanilla | engine core over vanilla | worker over vanilla |",
        "|---|---|---|---|---|---|---|",
    ]
    for (cfg, c), waves in got.items():
        if not waves or not all(k in w for w in waves for k in keys):
            continue
        meds = [f"{statistics.median(w[k] for w in waves):.0f}" for k in keys]
        van = got.get(("vanilla", c), [])
        if cfg == "vanilla" or not van or not all(k in w for w in van for k in keys):
            over = ["-"] * len(keys)
        else:
            # psutil counts in clock ticks (10 ms): a short wave can read 0
            over = []
            for k in keys:
                xs = [m[k] / b[k] for m, b in zip(waves, van) if b[k] > 0]
                over.append(f"{statistics.median(xs):.3f}" if xs else "n/a")
        lines.append(f"| {cfg} (concurrency {c}) | " + " | ".join(meds + over) + " |")
    return "\n".join(lines)


def host_table(got: dict[tuple[str, int], list[dict]], plan: list[tuple[str, int]]) -> str:
    lines = [
        "| configuration | step (ms) | xmix bookkeeping (ms) | xmix site programs (ms) "
        "| xmix share of the step |",
        "|---|---|---|---|---|",
    ]
    for cfg, c in plan:
        if cfg in VANILLA:
            continue
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
    ap.add_argument("--configs", default="steer,ablate,probe,cast,monitor,mixed-same,mixed")
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument(
        "--vanilla", action="store_true", help="a vanilla server beside, its waves in turn"
    )
    ap.add_argument(
        "--control", action="store_true", help="and a second vanilla server (implies --vanilla)"
    )
    ap.add_argument(
        "--nosites",
        action="store_true",
        help="and an xmix server with no hook site and no app (implies --vanilla)",
    )
    ap.add_argument("--instances", type=int, default=1, help="fresh servers this many times")
    ap.add_argument(
        "--switch-gap",
        type=float,
        default=1.5,
        help="seconds between two waves on different servers (vLLM's shm readers spin 1 s)",
    )
    ap.add_argument("--results", type=Path)
    ap.add_argument(
        "--from-json",
        type=Path,
        help="no servers: print the tables again from a run's per-wave figures (FILE.json)",
    )
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args()
    if args.from_json:
        got = load_waves(args.from_json)
        configs = [k for k in got if k[0] not in ("unused", NOSITES, *VANILLA)]
        print(table(got, configs))
        if any(cfg == "vanilla" for cfg, _ in got):
            print("\n" + instance_table(got))
            print("\n" + interval_table(got))
            if any("after_switch" in w for ws in got.values() for w in ws[:1]):
                print("\n" + position_table(got))
        print("\n" + host_table(got, list(got)))
        if any("cpu_api" in ws[0] for ws in got.values() if ws):
            print("\n" + cpu_table(got))
        return
    if args.waves < 1 or args.instances < 1:
        ap.error(f"--waves and --instances must be at least 1 (got {args.waves}, {args.instances})")
    names = [c for c in args.configs.split(",") if c and c != "unused"]
    known = so.CONFIGS + EXTRA
    bad = [c for c in names if c not in known]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {', '.join(known)}")
    configs = [
        (c, args.mixed_concurrency if c.startswith("mixed") else args.concurrency) for c in names
    ]
    args.vanilla |= args.control or args.nosites
    vanillas = ["vanilla", "vanilla-again"][: int(args.vanilla) + int(args.control)]
    vanillas += [NOSITES] if args.nosites else []
    sizes = sorted({c for _, c in configs} | ({args.concurrency} if vanillas else set()))
    plan = [("unused", c) for c in sizes] + [(v, args.concurrency) for v in vanillas] + configs

    from transformers import AutoConfig

    model = so.bench_model(args.model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    work = Path(tempfile.mkdtemp(prefix="serve_paired-"))
    apps = so.write_apps(model, work)
    os.environ["OPENAI_API_KEY"] = so.API_KEY  # vLLM's request function reads it
    got: dict[tuple[str, int], list[dict]] = {p: [] for p in plan}
    starts: list[str] = []
    for i in range(args.instances):
        # started one after another (two starting at once on a small machine slow each
        # other's compile), in alternating order so neither kind always starts first
        kinds = ["xmix", *vanillas] if i % 2 == 0 else [*vanillas, "xmix"]
        servers: dict[str, so.Server] = {}
        try:
            for name in kinds:
                kind = "vanilla" if name in VANILLA else "xmix"
                log = work / f"{name}-{i}.log"
                if name == NOSITES:
                    extra = [*args.server_arg, "--additional-config", NOSITES_CONFIG]
                    servers[name] = so.Server(kind, model, [], log, extra)
                else:
                    servers[name] = so.Server(kind, model, apps, log, args.server_arg)
                starts.append(f"{name} {servers[name].wait_ready():.0f}")
            bases = {name: srv.base for name, srv in servers.items()}
            procs = {srv.base: server_processes(srv) for srv in servers.values()}
            waves_of = asyncio.run(run_waves(bases, model, vocab, plan, args, procs))
            for key, waves in waves_of.items():
                got[key] += [{**w, "instance": i} for w in waves]
        finally:
            for srv in servers.values():
                srv.stop()

    import torch
    import vllm

    rev = so.code_rev()
    text = (
        f"machine: {platform.machine()}, {os.cpu_count()} cores, no GPU; "
        f"torch {torch.__version__}, vLLM {vllm.__version__}\n"
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
        f"command: python bench/serve_paired.py {' '.join(sys.argv[1:])}\n"
        f"code: {rev}\n"
        f"model: {args.model}, float32; {args.input_len} random prompt tokens, "
        f"{args.output_len} output tokens (ignore_eos); {args.waves} waves per configuration "
        f"and instance after one warm-up wave, {args.instances} server instance(s); "
        "server start (s): "
        f"{', '.join(starts)}\n\n"
        "ratio to the unused wave next to it (same server, same concurrency), or to the "
        'vanilla wave next to it ("over vanilla"): median over waves (interquartile range); '
        "vanilla and unused rows: medians in ms\n\n"
        + table(got, configs)
        + (
            f"\n\n{instance_table(got)}\n\n{interval_table(got)}\n\n{position_table(got)}"
            if vanillas
            else ""
        )
        + "\n\nxmix's host time in the worker per engine step (the worker's counters; "
        "medians over waves; step: the wave's wall time over its engine steps)\n\n"
        + host_table(got, plan)
        + "\n\nCPU time of each server process per wave (user + system, psutil; the engine "
        "core and the worker spin while they wait, so theirs follow the wave's wall time; the "
        "API server's is its work)\n\n" + cpu_table(got) + "\n"
    )
    print(text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)
        raw = args.results.with_suffix(".json")
        raw.write_text(json.dumps({f"{k[0]}@{k[1]}": v for k, v in got.items()}, indent=1))


if __name__ == "__main__":
    main()
