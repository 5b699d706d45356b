"""Throughput of vanilla vLLM vs xmix on the CPU engine, measured side by side in one run.

Configurations (same engine settings, greedy, fixed output length; by default the 8-layer
d = 512 Llama that bench/serve_overhead.py and bench/serve_paired.py serve):
  vanilla        vLLM with the xmix plugin off
  unused         xmix with apps deployed (a steering app, a probe, an all-layer ablation),
                 no request uses them
  steer-1layer   xmix, every request uses one single-layer steering app
  probe-1layer   xmix, every request uses one single-layer probe (results returned)
  ablate-all     xmix, every request uses directional ablation at residual.pre,
                 attention.post and mlp.post of every layer
  cast           xmix, every request uses CAST (cosine read over the prompt at one layer, a
                 latch, an add at the second half of the layers; xmix.apps.cast)
  monitor-idle   xmix, every request uses probe-1layer's probe as a monitor that never fires:
                 a stop on it and an add under since(...) on it, thresholds out of reach
                 (what a monitor costs beyond its read: compare with probe-1layer)

Rounds are interleaved (vanilla, unused, steer, probe, vanilla, ...) so that machine noise
hits every configuration alike; the table gives the median tokens/s per configuration and the
ratio of medians to vanilla, and the median (and quartiles) of each round's ratio to the same
round's vanilla. This is a benchmark, not a test: nothing here asserts.

    python bench/cpu_overhead.py [--prompts 64] [--tokens 64] [--rounds 5] [--model llama-8x512]
    python bench/cpu_overhead.py --profile DIR   # py-spy on xmix's processes, per configuration
    python bench/cpu_overhead.py --only probe-1layer,monitor-idle   # some (vanilla always)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="llama-8x512",
        help="llama-LxD (bench/serve_overhead.py's random-weight Llama), a tiny kind, or a folder",
    )
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", help="comma-separated configurations to run (vanilla always runs)")
    ap.add_argument(
        "--profile",
        type=Path,
        help="instead of the rounds: py-spy on xmix's processes (frontend, engine core, worker) "
        "during three generates per xmix configuration; collapsed stacks and summary.txt here",
    )
    args = ap.parse_args()

    import torch
    from serve_overhead import bench_model  # this folder is sys.path[0]
    from vllm import SamplingParams

    import xmix
    from xmix.apps import cast

    path = str(bench_model(args.model))
    kw = dict(dtype="float32", max_model_len=512, seed=0, gpu_memory_utilization=0.3)

    os.environ["XMIX_DISABLE"] = "1"
    import vllm

    vanilla = vllm.LLM(model=path, **kw)
    del os.environ["XMIX_DISABLE"]
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = xmix.LLM(model=path, **kw)
    # xmix's engine core and worker: the processes its engine started
    xmix_procs = {
        p.pid: p.name() for p in psutil.Process().children(recursive=True) if p.pid not in before
    }
    d = llm.llm_engine.model_config.hf_config.hidden_size
    g = torch.Generator().manual_seed(0)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(d, generator=g), scale=1.0).layers([1]).at(
        "residual.post"
    )
    probe = xmix.App("probe")
    w_probe = torch.randn(d, generator=g) / 16
    probe.read("probe", weight=w_probe).layers([2]).at("residual.post")
    monitor = xmix.App("monitor")  # the same probe, acting on nothing (a sigmoid never hits 2)
    monitor.read("probe", weight=w_probe).layers([2]).at("residual.post").named("p")
    monitor.write("add", vector=torch.randn(d, generator=g), scale=1.0).layers([3]).at(
        "residual.post"
    ).cond(when="since(p > 2.0)")
    monitor.stop(when="p > 2.0")
    ablate = xmix.App("ablate")
    r = torch.randn(d, generator=g)
    for site in ("residual.pre", "attention.post", "mlp.post"):
        ablate.write("ablate", direction=r).layers("all").at(site)
    n = llm.llm_engine.model_config.hf_config.num_hidden_layers
    cast_app = cast(
        torch.randn(d, generator=g),
        torch.randn(d, generator=g) / d**0.5,
        condition_layer=max(1, n // 4),
        behavior_layers=list(range(n // 2, n)),
        threshold=-1.0,
        name="cast",
    )
    for a in (steer, probe, ablate, cast_app, monitor):
        llm.xmix.deploy(a)

    prompts = [
        {"prompt_token_ids": [1] + [(7 * i + 13 * j) % 400 + 3 for j in range(24)]}
        for i in range(args.prompts)
    ]

    def sp(apps):
        return SamplingParams(
            temperature=0.0,
            max_tokens=args.tokens,
            ignore_eos=True,
            extra_args={"xmix": {"apps": apps}} if apps else None,
        )

    configs = {
        "vanilla": (vanilla, sp(None)),
        "unused": (llm, sp(None)),
        "steer-1layer": (llm, sp(["steer"])),
        "probe-1layer": (llm, sp(["probe"])),
        "ablate-all": (llm, sp(["ablate"])),
        "cast": (llm, sp(["cast"])),
        "monitor-idle": (llm, sp(["monitor"])),
    }
    if args.only:
        keep = {"vanilla", *args.only.split(",")}
        configs = {k: v for k, v in configs.items() if k in keep}
    # warm-up (compilation, allocator) once per configuration
    for eng, p in configs.values():
        eng.generate(prompts[:8], p, use_tqdm=False)
    if args.profile:
        roles = {"frontend": os.getpid()}
        for pid, name in xmix_procs.items():
            if "EngineCore" in name:
                roles["engine"] = pid
            elif "Worker" in name:
                roles["worker"] = pid
        profile(args.profile, roles, {k: v for k, v in configs.items() if k != "vanilla"}, prompts)
        return
    tps: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(args.rounds):
        for name, (eng, p) in configs.items():
            t0 = time.perf_counter()
            outs = eng.generate(prompts, p, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            tps[name].append(n / dt)

    base = statistics.median(tps["vanilla"])
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, vLLM {vllm.__version__}"
    )
    print(
        f"workload: {args.model}, {args.prompts} prompts x {args.tokens} tokens, greedy, "
        f"{args.rounds} interleaved rounds\n"
    )
    # paired: each round's figure over the same round's vanilla (the machine drifts by more
    # than the costs between the first and the last round of a run), median and quartiles
    print(
        f"{'configuration':16s} {'median tok/s':>13s} {'ratio':>7s} {'paired (IQR)':>20s}"
        "   rounds (tok/s)"
    )
    for name, vals in tps.items():
        med = statistics.median(vals)
        per = [v / b for v, b in zip(vals, tps["vanilla"])]
        q = statistics.quantiles(per, n=4, method="inclusive") if len(per) > 1 else per * 3
        paired = f"{statistics.median(per):.3f} ({q[0]:.2f}..{q[2]:.2f})"
        print(
            f"{name:16s} {med:13.1f} {med / base:7.3f} {paired:>20s}   "
            + ", ".join(f"{v:.0f}" for v in vals)
        )


def profile(out: Path, roles: dict[str, int], configs: dict, prompts: list) -> None:
    """py-spy (200 Hz, active samples) on each of xmix's processes while one configuration
    generates three times; the summary is serve_overhead's (xmix's own share per process)."""
    import shutil
    import signal
    import subprocess
    import sys

    from serve_overhead import profile_report

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out.mkdir(parents=True, exist_ok=True)
    for name, (eng, p) in configs.items():
        spies = [
            subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw"]
                + ["--nonblocking", "--output", str(out / f"{name}-{role}.txt")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for role, pid in roles.items()
        ]
        time.sleep(1)  # py-spy attached
        t0 = time.perf_counter()
        for _ in range(3):
            eng.generate(prompts, p, use_tqdm=False)
        print(f"{name}: {time.perf_counter() - t0:.2f} s for three generates (under py-spy)")
        for s in spies:
            s.send_signal(signal.SIGINT)
            s.wait(timeout=120)
    report = profile_report(out)
    (out / "summary.txt").write_text(report)
    print(report + f"\nprofiles (py-spy collapsed stacks) and summary.txt in {out}")


if __name__ == "__main__":
    main()
