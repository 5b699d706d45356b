"""Python frame entries per streamed token in the API server, vanilla against xmix (issue 29).

`bench/serve_paired.py` finds an xmix API server spending more CPU per wave than vanilla's
with no app in use (2026-12-05: +10 to +16 ms per wave of 512 streamed chunks), and sampling
profilers lose too many samples under load to say where. This counts instead: each server's
API server process runs with a profile hook (bench/api_calls/sitecustomize.py, loaded
through PYTHONPATH) that counts every Python frame entry (a call, or a generator or
coroutine resuming) by function while `vllm bench serve` sends --num-prompts requests of
--output-len tokens, streamed, after a warm-up. Counts do not move with the machine's load;
the hook makes the API server several times slower while it counts, so no time is read.

    python bench/api_calls.py [--model llama-8x512] [--num-prompts 64] [--configs unused]
        [--results FILE.md]

Prints frame entries per streamed token by package for vanilla and each xmix configuration,
and the functions whose counts differ most. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_overhead as so  # noqa: E402

HOOK = Path(__file__).resolve().with_name("api_calls")


def package_of(filename: str) -> str:
    """The package a frame's file belongs to: xmix, vllm, a site-packages top-level name, the
    standard library's module, or "other"."""
    parts = filename.replace("\\", "/").split("/")
    for root in ("xmix", "vllm"):
        if root in parts[:-1]:
            return root
    if "site-packages" in parts:
        i = parts.index("site-packages")
        return parts[i + 1].removesuffix(".py") if i + 1 < len(parts) else "other"
    if filename.startswith("<"):
        return "frozen"
    if len(parts) >= 2 and parts[-2].startswith("python3"):
        return "stdlib:" + parts[-1].removesuffix(".py")
    if len(parts) >= 3 and parts[-3].startswith("python3"):
        return "stdlib:" + parts[-2]
    return "other"


def counted(server: so.Server, out: Path, run) -> Counter:
    """Frame entries in `server`'s API server by (file, function) while `run()` runs."""
    out.unlink(missing_ok=True)
    os.kill(server.proc.pid, signal.SIGUSR1)
    time.sleep(0.5)
    run()
    os.kill(server.proc.pid, signal.SIGUSR2)
    for _ in range(600):
        if out.exists():
            break
        time.sleep(0.1)
    else:
        raise RuntimeError(f"{server.kind}: the API server wrote no counts to {out}")
    return Counter({(f, n): c for f, n, c in json.loads(out.read_text())})


def by_package(counts: Counter) -> Counter:
    got: Counter = Counter()
    for (f, _), c in counts.items():
        got[package_of(f)] += c
    return got


def short(key: tuple[str, str]) -> str:
    f, name = key
    parts = f.replace("\\", "/").split("/")
    for root in ("xmix", "vllm", "site-packages"):
        if root in parts[:-1]:
            parts = parts[parts.index(root) + (root == "site-packages") :]
            break
    else:
        parts = parts[-2:]
    return "/".join(parts) + ":" + name


def tables(runs: dict[str, Counter], tokens: dict[str, int], top: int = 20) -> str:
    names = list(runs)
    pk = {k: by_package(v) for k, v in runs.items()}
    packages = sorted(
        set().union(*pk.values()), key=lambda p: -max(pk[k][p] / tokens[k] for k in names)
    )
    lines = [
        "| package | " + " | ".join(names) + " |" + "".join(f" {n} - vanilla |" for n in names[1:]),
        "|---" * (2 * len(names)) + "|",
    ]
    rows = [("all", {k: sum(v.values()) for k, v in runs.items()})]
    rows += [(p, {k: pk[k][p] for k in names}) for p in packages]
    for p, c in rows:
        per = {k: c[k] / tokens[k] for k in names}
        if p != "all" and max(per.values()) < 0.05:
            continue
        diffs = [per[n] - per[names[0]] for n in names[1:]]
        lines.append(
            f"| {p} | "
            + " | ".join(f"{per[k]:.1f}" for k in names)
            + " |"
            + "".join(f" {d:+.1f} |" for d in diffs)
        )
    for n in names[1:]:
        base, mine = runs[names[0]], runs[n]
        diff = {
            k: mine.get(k, 0) / tokens[n] - base.get(k, 0) / tokens[names[0]]
            for k in set(base) | set(mine)
        }
        big = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
        lines += [
            "",
            f"functions whose frame entries per token differ most, {n} - {names[0]}:",
            "",
            f"| function | {names[0]} | {n} | difference |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {short(k)} | {base.get(k, 0) / tokens[names[0]]:.2f} "
            f"| {mine.get(k, 0) / tokens[n]:.2f} | {d:+.2f} |"
            for k, d in big
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8x512")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--configs", default="unused", help="xmix configurations (serve_overhead's)")
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--results", type=Path)
    args = ap.parse_args()
    args.output_range, args.request_rate = 0.0, "inf"
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in so.CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {', '.join(so.CONFIGS)}")
    model = so.bench_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="api_calls-"))
    apps = so.write_apps(model, work)
    os.environ["OPENAI_API_KEY"] = so.API_KEY
    env = {
        "PYTHONPATH": os.pathsep.join([str(HOOK), os.environ.get("PYTHONPATH", "")]),
        "BENCH_API_CALLS": str(work / "counts.json"),
    }
    runs: dict[str, Counter] = {}
    tokens: dict[str, int] = {}
    # requests sent in the counted run: vllm bench serve's warm-ups, then the prompts
    sent = min(args.concurrency, args.num_prompts) + args.num_prompts
    for kind, cfgs in (("vanilla", ["vanilla"]), ("xmix", configs)):
        server = so.Server(kind, model, apps, work / f"{kind}.log", args.server_arg, env_extra=env)
        try:
            server.wait_ready()
            for cfg in cfgs:
                c = "unused" if cfg == "vanilla" else cfg
                so.run_client(server, model, c, args.concurrency, args, work, f"warm-{cfg}")
                runs[cfg] = counted(
                    server,
                    work / "counts.json",
                    functools.partial(
                        so.run_client,
                        server,
                        model,
                        c,
                        args.concurrency,
                        args,
                        work,
                        f"count-{cfg}",
                    ),
                )
                tokens[cfg] = sent * args.output_len
                print(f"{cfg}: {sum(runs[cfg].values())} frame entries", flush=True)
        finally:
            server.stop()
    rev = so.code_rev()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"# API server frame entries per streamed token ({args.model}, {when}, "
        f"{platform.node()}, {os.cpu_count()} cores, code {rev})\n\n"
        f"`python bench/api_calls.py {' '.join(sys.argv[1:])}`: {sent} requests of "
        f"{args.output_len} streamed tokens at concurrency {args.concurrency} per "
        "configuration (vllm bench serve's warm-ups included), counted in the API server "
        "process's main thread\n\n" + tables(runs, tokens) + "\n"
    )
    print(text)
    if args.results:
        args.results.write_text(text)


if __name__ == "__main__":
    main()
