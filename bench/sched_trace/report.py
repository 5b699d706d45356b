"""Read the scheduling traces bench/serve_overhead.py --trace wrote (one folder per server):
per client run, how the engine core's steps took new requests (lockstep: all in one step per
wave), where each request's admission time went, API server to engine core to first step,
and how long the worker's forward and the engine core's update took per kind of step.

    python bench/sched_trace/report.py TRACE_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path


def load(folder: Path) -> tuple[list[dict], list[dict]]:
    events = []
    for f in folder.glob("*.jsonl"):
        if f.name == "runs.jsonl":
            continue
        events += [json.loads(line) for line in f.read_text().splitlines() if line]
    events.sort(key=lambda e: e["t"])
    f = folder / "runs.jsonl"
    runs = [json.loads(line) for line in f.read_text().splitlines() if line] if f.exists() else []
    return events, runs


def ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    q = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
    return (
        f"median {statistics.median(xs) * 1e3:.2f} ms (p10 {q[0] * 1e3:.2f}, p90 {q[-1] * 1e3:.2f})"
    )


def report_run(events: list[dict], run: dict) -> str:
    ev = [e for e in events if run["t0"] <= e["t"] <= run["t1"]]
    if any(e["ev"] == "trace_not_installed" for e in events):
        return (
            "trace not installed: "
            + next(e for e in events if e["ev"] == "trace_not_installed")["error"]
        )
    first: dict[str, dict[str, float]] = {}
    for e in ev:
        if e["ev"] in ("api_add", "sent", "core_add"):
            first.setdefault(e["rid"], {}).setdefault(e["ev"], e["t"])
        elif e["ev"] == "step":
            for rid in e["new"]:
                first.setdefault(rid, {}).setdefault("scheduled", e["t"])
    # the engine core sees the frontend's id with a suffix: match by prefix
    core = {rid: t for rid, t in first.items() if "api_add" not in t}
    by_front = {}
    for rid, t in first.items():
        if "api_add" in t:
            by_front[rid] = dict(t)
    for rid, t in core.items():
        for front in by_front:
            if rid.startswith(front):
                by_front[front].update(t)
    steps = [e for e in ev if e["ev"] == "step" and e["new"]]
    sizes = Counter(len(e["new"]) for e in steps)
    out = [
        f"  steps taking new requests: {len(steps)}; new requests per such step: "
        + ", ".join(f"{k}: {v}" for k, v in sorted(sizes.items())),
    ]
    # the run's group structure: with equal output lengths the requests that start in one step
    # finish in one step and are replaced together, so the sizes repeat wave after wave
    out.append("  new requests per step, in order: " + " ".join(str(len(e["new"])) for e in steps))
    gaps = {"api_add -> sent": [], "sent -> core_add": [], "core_add -> scheduled": []}
    for t in by_front.values():
        for (a, b), key in zip(
            (("api_add", "sent"), ("sent", "core_add"), ("core_add", "scheduled")), gaps
        ):
            if a in t and b in t:
                gaps[key].append(t[b] - t[a])
    out += [f"  {k}: {ms(v)}" for k, v in gaps.items()]
    # the frontend's turnaround: a finished request's output reaching the API server, to the
    # next request's arrival there (the client's reaction and the HTTP path)
    fin_t = sorted(e["t"] for e in ev if e["ev"] == "out" for _ in e["finished"])
    arr_t = sorted(t["api_add"] for t in by_front.values())
    turn = []
    for a in arr_t:
        before = [f for f in fin_t if f <= a]
        if before:
            turn.append(a - before[-1])
    out.append(f"  last finish seen -> next arrival: {ms(turn)}")

    # the same turnaround in three legs, each event against the latest one before it of the
    # leg's start (events of one kind carry no request id on the HTTP side)
    def since(start: str, end: str) -> list[float]:
        if start == "out":
            starts = fin_t
        else:
            starts = sorted(e["t"] for e in ev if e["ev"] == start)
        res = []
        for e in ev:
            if e["ev"] == end:
                before = [x for x in starts if x <= e["t"]]
                if before:
                    res.append(e["t"] - before[-1])
        return res

    if any(e["ev"] == "http_in" for e in ev):
        out.append(
            f"  finish seen -> last chunk sent (API server): {ms(since('out', 'http_done'))}"
        )
        out.append(
            f"  last chunk sent -> next request in (client): {ms(since('http_done', 'http_in'))}"
        )
        out.append(f"  request in -> engine client (API server): {ms(since('http_in', 'api_add'))}")
    # the spread of the arrivals that one step took together
    spread = []
    for e in steps:
        ts = [by_front[f]["api_add"] for f in by_front if any(r.startswith(f) for r in e["new"])]
        if len(ts) > 1:
            spread.append(max(ts) - min(ts))
    out.append(f"  arrival spread within one step's new requests: {ms(spread)}")
    # the legs of a step, by the tokens it ran: the worker's forward and the engine core's
    # update (what a slower step is split by)
    # (the forward, inside execute_model: the compiled model alone; the rest of execute_model
    # is the runner's host work, xmix's per-step calls among it). The worker's legs also
    # give the process's CPU time and the thread's run-queue wait: a longer leg for the same
    # tokens is more work or a core taken by the machine's other processes.
    for leg, name in (
        ("exec", "worker execute_model"),
        ("fwd", "worker model forward"),
        ("update", "engine core update"),
    ):
        kinds: dict[str, list[dict]] = {}
        for e in ev:
            if e["ev"] == leg and e.get("tokens") is not None:
                t = e["tokens"]
                kind = (
                    "decode, 8"
                    if t == 8
                    else "decode, < 8"
                    if t < 8
                    else "> 8 (prefill, more decodes)"
                )
                kinds.setdefault(kind, []).append(e)
        for kind in ("decode, 8", "decode, < 8", "> 8 (prefill, more decodes)"):
            if kind in kinds:
                es = kinds[kind]
                line = f"  {name}, {kind} tokens ({len(es)}): {ms([e['dt'] for e in es])}"
                if all("cpu" in e for e in es):
                    cpu = statistics.median(e["cpu"] for e in es) * 1e3
                    wait = statistics.median(e["wait"] for e in es) * 1e3
                    line += f"; CPU {cpu:.2f} ms, run-queue wait {wait:.2f} ms"
                out.append(line)
    return "\n".join(out)


def main() -> None:
    root = Path(sys.argv[1])
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        events, runs = load(folder)
        for run in runs:
            print(f"{folder.name} {run['run']}:")
            print(report_run(events, run))


if __name__ == "__main__":
    main()
