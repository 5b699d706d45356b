"""Soak: ``xmix serve`` over HTTP under concurrent requests and continuous control changes,
then the same under ``kill -9`` of the whole server and restarts from its state directory.

    python bench/soak.py --requests 2000 --changes 1000 [--concurrency 16] [--url URL
        --key KEY --admin-key KEY] [--seed 0] [--json out.json]
        [--restarts 3 --restart-requests 300 --restart-changes 100 | --kill-points P,P,...]

Without --url it starts ``xmix serve`` on the embedded tiny Llama itself (its log is read
for server errors afterwards). Requests: chat and completions, streamed and not, with and
without apps (a steering write, a probe read, apps that the control driver churns), some
with n = 2, one stream in 8 disconnecting mid-stream. Meanwhile the control driver deploys,
undeploys, switches modes (off / request / all), changes parameters and has bad changes
refused, until both the requests and the changes are done.

Checked per request:
  completes      no hang past --deadline, no 5xx, no truncated stream (every choice has
                 a finish reason and max_tokens tokens; [DONE] seen)
  oracle         a request whose provenance (``xmix_applied.changed``) says none of its apps
                 changed while it ran equals the same request run alone afterwards, with the
                 same apps and parameter values (tokens exactly, reads to 1e-5)
  switched off   a request whose app changed mid-flight still completes with every token,
                 and its reads are a sub-list of its own positions, in order (docs/serving.md:
                 "What a change does to requests in flight")
  leaks          no request's reads name an app it did not run, or a position it does not
                 have; no request slot stays taken once everything finished
A refusal documented for a race (an app named just as it went away: 400 "unknown app" /
"switched off") is counted apart, not as a failure.

Restart phase (``--restarts N``, on a server of its own with ``--xmix-state-dir``; not with
--url): requests and changes (deploys, PATCHes of mode, parameters and locks, alone and
together, undeploys) run on while the whole server is killed with SIGKILL N times, each time
at a random moment with a change on its way, and restarted from its state directory; requests
not yet sent wait for it. After each restart: every acknowledged change (HTTP 2xx) must be
there (lost: must be 0), the change that was in flight must be there whole or absent (half:
must be 0), and requests of apps no change touches must answer as before the first kill
(pinned). Requests in flight at a kill are counted as cut, apart from failures. At the end
every completed request is checked against the same request alone (oracle), as above.
``--kill-points`` kills at the test-only crash points instead (state_dir.py, e.g.
``deploy:app.renamed,patch:applied``; an empty entry: from outside).

Prints: requests sent / completed / refused / disconnected / failed / hung, oracle checks
(equal / wrong), changes applied (and refused as intended), p50 / p99 latency of a
control-plane change, server errors in the log. Exit status 1 when anything was lost, wrong
or leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

D_MODEL = 256  # the embedded tiny Llama
PROMPTS = [
    "The old lighthouse keeper climbed the stairs every evening",
    "In the morning the market was full of",
    "She opened the letter and read",
    "Rivers carry water from the mountains to",
    "The recipe asks for two cups of",
    "Once upon a time there was a small village",
    "The scientist looked at the results and",
    "A quiet road led through the forest to",
    "Tomorrow we will travel by train to",
    "The children played in the garden until",
    "Numbers like seven and eleven are",
    "He wrote a long story about a dragon who",
]
CHURN = ["c0", "c1", "c2", "c3"]


# ---------------------------------------------------------------------- apps
def build_apps(seed: int) -> dict[str, bytes]:
    """The fixed apps (never changed) and the churn templates; app bytes by name."""
    import torch

    import xmix

    g = torch.Generator().manual_seed(seed)

    def unit():
        v = torch.randn(D_MODEL, generator=g)
        return v / v.norm()

    out = {}
    steer = xmix.App("steer")
    steer.write("add", vector=unit() * 6.0, scale=1.0).layers([1]).at("residual.post").named("push")
    probe = xmix.App("probe")
    probe.read("probe", weight=unit() * 0.5, bias=0.0).layers([2]).at("residual.post").named("p")
    out["steer"], out["probe"] = steer.to_bytes(), probe.to_bytes()
    # No two apps share a hook site: ops of different apps at one site run in deployment
    # order, so a read placed after another app's write at the same site would depend on
    # which was deployed first, and the oracle (copies deployed afresh) could not repeat it.
    for i, name in enumerate(CHURN):
        a = xmix.App(name)
        a.write("add", vector=unit() * 4.0, scale=1.0).layers([i]).at("mlp.post").named("w")
        a.read("probe", weight=unit() * 0.5, bias=0.0).layers([i]).at("attention.post").named("r")
        out[name] = a.to_bytes()
    return out


def renamed(data: bytes, name: str) -> bytes:
    """The same app under another name (for the oracle: same math, an app of its own)."""
    import xmix

    app = xmix.App.from_bytes(data)
    spec = app.spec()
    spec["name"] = name
    return xmix.App.from_spec(spec, app.tensors(), allow_custom=False).to_bytes()


# ---------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    tmp: Path,
    apps: dict[str, bytes],
    key: str,
    admin: str,
    timeout: float = 900,
    eager: bool = False,
    port: int | None = None,
    env: dict | None = None,
    log_name: str = "serve.log",
    extra: list[str] | None = None,
):
    from xmix.models.tiny import tiny_model_path

    paths = []
    for name in ("steer", "probe"):
        p = tmp / f"{name}.xmix"
        p.write_bytes(apps[name])
        paths += ["--app", str(p)]
    port = port or _free_port()
    cmd = [
        sys.executable,
        "-m",
        "xmix.cli",
        "serve",
        str(tiny_model_path("tiny-llama")),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--api-key",
        key,
        "--xmix-admin-key",
        admin,
        "--max-num-seqs",
        "32",
        *(["--enforce-eager"] if eager else []),
        *paths,
        *(extra or []),
    ]
    log = tmp / log_name
    proc = subprocess.Popen(
        cmd,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            **(env or {}),
        },
    )
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError("xmix serve died:\n" + log.read_text()[-3000:])
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base, log
        except httpx.HTTPError:
            pass
        if time.time() - t0 > timeout:
            proc.kill()
            raise TimeoutError("xmix serve did not start")
        time.sleep(1)


def stop_server(proc) -> None:
    # SIGTERM to the API server alone: it shuts its engine down in order. A SIGTERM to the
    # whole group can kill the engine core first, and the server then logs EngineDeadError
    # (a traceback the soak counts as a server error).
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=90)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever outlived it
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------- requests
@dataclass
class Spec:
    i: int
    kind: str  # "cmpl" | "chat"
    stream: bool
    apps: list[str]
    params: dict
    n: int
    max_tokens: int
    prompt: str
    seed: int | None
    disconnect_after: int | None = None  # data chunks, then the client goes away


@dataclass
class Result:
    spec: Spec
    status: int | None = None
    outcome: str = "pending"  # ok | refused | disconnected | failed | hung
    why: str = ""
    tokens: dict[int, list[int]] = field(default_factory=dict)  # choice -> token ids
    reads: dict[int, dict] = field(default_factory=dict)  # choice -> {app: {read: (pos, vals)}}
    finish: dict[int, str] = field(default_factory=dict)
    applied: dict | None = None
    prompt_tokens: int = 0
    t0: float = 0.0
    t1: float = 0.0


def make_specs(n: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    choices = [[], [], ["steer"], ["probe"], ["steer", "probe"], ["churn"], ["churn", "probe"]]
    out = []
    stream_i = 0
    for i in range(n):
        kind = "chat" if rng.random() < 0.4 else "cmpl"
        stream = rng.random() < 0.6
        apps = list(rng.choice(choices))
        params = {}
        if "steer" in apps and rng.random() < 0.5:
            params["steer"] = {"scale": rng.choice([0.5, 2.0, -1.0])}
        sampled = rng.random() < 0.15
        disconnect = None
        if stream:
            stream_i += 1
            if stream_i % 8 == 0:
                disconnect = rng.randint(1, 6)
        out.append(
            Spec(
                i,
                kind,
                stream,
                apps,
                params,
                2 if sampled else 1,
                rng.choice([12, 16, 24]),
                rng.choice(PROMPTS),
                rng.randint(0, 10**6) if sampled else None,
                disconnect,
            )
        )
    return out


def _body(spec: Spec, apps: list[str], params: dict, salt: str | None = None) -> tuple[str, dict]:
    body = {
        "model": "tiny",
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,
        "n": spec.n,
        "temperature": 1.0 if spec.seed is not None else 0.0,
        "return_token_ids": True,
    }
    if spec.seed is not None:
        body["seed"] = spec.seed
    if salt:
        body["cache_salt"] = salt
    if apps or params:
        ctl = {"apps": apps}
        if params:
            ctl["params"] = params
        body["vllm_xargs"] = {"xmix": json.dumps(ctl)}
    if spec.kind == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = spec.prompt
        path = "/v1/completions"
    if spec.stream:
        body["stream"] = True
    return path, body


def _merge_reads(into: dict, x: dict) -> None:
    for app, reads in (x or {}).items():
        for key, e in reads.items():
            pos, vals = into.setdefault(app, {}).setdefault(key, ([], []))
            pos.extend(e["positions"])
            vals.extend(e["values"])


def _choice_tokens(choice: dict, kind: str) -> list[int]:
    return list(choice.get("token_ids") or [])


async def run_one(
    client: httpx.AsyncClient,
    spec: Spec,
    apps: list[str],
    params: dict,
    deadline: float,
    salt: str | None = None,
) -> Result:
    res = Result(spec)
    path, body = _body(spec, apps, params, salt)
    res.t0 = time.monotonic()
    try:
        async with asyncio.timeout(deadline):
            if not spec.stream:
                r = await client.post(path, json=body)
                res.status = r.status_code
                if r.status_code != 200:
                    res.why = r.text[:300]
                else:
                    doc = json.loads(r.text, parse_constant=_no_constant)
                    res.prompt_tokens = doc["usage"]["prompt_tokens"]
                    top = doc.get("xmix")
                    for c in doc["choices"]:
                        i = c["index"]
                        res.tokens[i] = _choice_tokens(c, spec.kind)
                        res.finish[i] = c.get("finish_reason")
                        res.reads[i] = {}
                        _merge_reads(
                            res.reads[i],
                            c.get("xmix") or (top if len(doc["choices"]) == 1 else None),
                        )
                    res.applied = doc.get("xmix_applied")
            else:
                done = False
                chunks = 0
                async with client.stream(
                    "POST", path, json={**body, "stream_options": {"include_usage": True}}
                ) as r:
                    res.status = r.status_code
                    if r.status_code != 200:
                        res.why = (await r.aread()).decode(errors="replace")[:300]
                    else:
                        async for line in r.aiter_lines():
                            if line == "data: [DONE]":
                                done = True
                                continue
                            if not line.startswith("data: {"):
                                continue
                            ch = json.loads(line[6:], parse_constant=_no_constant)
                            if "error" in ch:
                                res.why = f"error event: {ch['error']}"
                                break
                            chunks += 1
                            if ch.get("usage"):
                                res.prompt_tokens = ch["usage"]["prompt_tokens"]
                            if "xmix_applied" in ch:
                                res.applied = ch["xmix_applied"]
                            idx = [c["index"] for c in ch.get("choices") or []]
                            for c in ch.get("choices") or []:
                                i = c["index"]
                                res.tokens.setdefault(i, []).extend(_choice_tokens(c, spec.kind))
                                if c.get("finish_reason"):
                                    res.finish[i] = c["finish_reason"]
                            if ch.get("xmix"):
                                i = idx[0] if idx else 0
                                _merge_reads(res.reads.setdefault(i, {}), ch["xmix"])
                            if (
                                spec.disconnect_after is not None
                                and chunks >= spec.disconnect_after
                            ):
                                res.outcome = "disconnected"
                                break  # leaving the block closes the connection
                if res.status == 200 and res.outcome != "disconnected" and not done and not res.why:
                    res.why = "stream ended without [DONE]"
    except TimeoutError:
        res.outcome = "hung"
        res.why = f"no answer within {deadline:.0f} s"
    except httpx.HTTPError as e:
        res.outcome = "failed"
        res.why = f"{type(e).__name__}: {e}"
    res.t1 = time.monotonic()
    if res.outcome == "pending":
        res.outcome = classify(res)
    return res


def _no_constant(name):
    raise ValueError(f"non-JSON constant {name} in a response")


def classify(res: Result) -> str:
    s = res.spec
    if res.status is None:
        return "failed"
    if res.status >= 500:
        res.why = f"HTTP {res.status}: {res.why}"
        return "failed"
    if (
        res.status == 400
        and ("unknown app" in res.why or "switched off" in res.why)
        and any(a in CHURN for a in _named(s))
    ):
        return "refused"  # raced with an undeploy / mode off of a churn app: documented
    if res.status != 200:
        res.why = f"HTTP {res.status}: {res.why}"
        return "failed"
    if res.why:
        return "failed"
    for i in range(s.n):
        if len(res.tokens.get(i, [])) != s.max_tokens or not res.finish.get(i):
            res.why = (
                f"choice {i}: {len(res.tokens.get(i, []))} of {s.max_tokens} tokens, "
                f"finish {res.finish.get(i)!r} (truncated)"
            )
            return "failed"
    if res.applied is None:
        res.why = "no xmix_applied in the response"
        return "failed"
    return "ok"


def _named(spec: Spec) -> list[str]:
    return spec.apps


# ---------------------------------------------------------------------- control driver
@dataclass
class Changes:
    applied: int = 0
    refused_ok: int = 0  # bad changes refused as they should be
    unexpected: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    deployed: dict[str, str] = field(default_factory=dict)  # churn name -> mode
    versions: dict[tuple[str, int], str] = field(
        default_factory=dict
    )  # (name, version) -> template


async def drive_changes(
    client: httpx.AsyncClient,
    apps: dict[str, bytes],
    ch: Changes,
    target: int,
    stop: asyncio.Event,
    seed: int,
    progress,
) -> None:
    """Changes spread over the run: the share of ``target`` applied follows the share of
    requests finished (``progress()``), then the rest once the requests are done."""
    rng = random.Random(seed + 1)
    while not (stop.is_set() and ch.applied >= target):
        if not stop.is_set() and ch.applied >= target * progress() + 2:
            await asyncio.sleep(0.01)
            continue
        name = rng.choice(CHURN)
        mode = ch.deployed.get(name)
        t0 = time.monotonic()
        if mode is None:
            # mode "all" reaches every request in flight (all of them count as changed), so
            # it is one change in ten; the rest touch only the requests naming the app
            want = "all" if rng.random() < 0.1 else "request"
            r = await client.post(f"/xmix/v1/apps?mode={want}", content=apps[name])
            if r.status_code == 201:
                ch.deployed[name] = want
                ch.versions[(name, r.json()["version"])] = name
        else:
            op = rng.random()
            if op < 0.2:
                r = await client.delete(f"/xmix/v1/apps/{name}")
                if r.status_code == 200:
                    ch.deployed.pop(name)
            elif op < 0.5:
                want = (
                    "all"
                    if mode != "all" and rng.random() < 0.1
                    else ("off" if mode == "request" else "request")
                )
                r = await client.patch(f"/xmix/v1/apps/{name}", json={"mode": want})
                if r.status_code == 200:
                    ch.deployed[name] = want
            elif op < 0.9:
                r = await client.patch(
                    f"/xmix/v1/apps/{name}",
                    json={"params": {"w.scale": rng.choice([0.5, 1.0, -2.0])}},
                )
            else:  # refused on purpose: nothing may change
                r = await client.patch(
                    f"/xmix/v1/apps/{name}", json={"params": {"w.scale": 1.0}, "mode": "x"}
                )
                ch.latencies.append(time.monotonic() - t0)
                if r.status_code == 422:
                    ch.refused_ok += 1
                else:
                    ch.unexpected.append(f"bad PATCH answered {r.status_code}: {r.text[:200]}")
                continue
        ch.latencies.append(time.monotonic() - t0)
        if r.status_code in (200, 201):
            ch.applied += 1
        else:
            ch.unexpected.append(
                f"{r.request.method} {r.request.url.path} answered {r.status_code}: {r.text[:200]}"
            )
        await asyncio.sleep(rng.random() * 0.01)


# ---------------------------------------------------------------------- checks
def reads_ok(res: Result) -> str | None:
    """Leak checks: reads only of apps it ran, only at its own positions, in order."""
    # apps applied at admission, and those that came to apply while it ran (a mode-"all"
    # deploy or switch reaches requests in flight from the next step)
    ran = {a["name"] for a in (res.applied or {}).get("apps", [])} | set(
        (res.applied or {}).get("changed", [])
    )
    for i, apps in res.reads.items():
        total = res.prompt_tokens + res.spec.max_tokens - 1
        for app, reads in apps.items():
            if app not in ran:
                return f"choice {i}: reads of app {app!r}, which it did not run"
            for key, (pos, vals) in reads.items():
                if len(pos) != len(vals):
                    return (
                        f"choice {i}: {app}.{key} has {len(pos)} positions and {len(vals)} values"
                    )
                if any(p < 0 or p >= total for p in pos) or any(
                    b <= a for a, b in zip(pos, pos[1:])
                ):
                    return f"choice {i}: {app}.{key} positions outside 0..{total - 1} or not increasing"
    return None


def oracle_key(res: Result) -> str:
    return json.dumps(
        [
            res.spec.kind,
            res.spec.prompt,
            res.spec.max_tokens,
            res.spec.n,
            res.spec.seed,
            [(a["name"], a["version"], sorted(a["params"].items())) for a in res.applied["apps"]],
        ]
    )


def _close(a: list, b: list, tol: float = 1e-5) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is None or y is None:
            if x is not y:
                return False
        elif isinstance(x, (int, float)) and isinstance(y, (int, float)):
            if not math.isclose(x, y, rel_tol=tol, abs_tol=tol):
                return False
        elif isinstance(x, list) and isinstance(y, list):
            if not _close(x, y, tol):
                return False
        elif x != y:
            return False
    return True


async def run_oracle(
    client: httpx.AsyncClient,
    admin: httpx.AsyncClient,
    apps: dict[str, bytes],
    results: list[Result],
    ch: Changes,
    deadline: float,
) -> tuple[int, list[str], int]:
    """Each unchanged request again, alone, with the same apps and parameter values. Churn
    apps come back as copies of their templates under new names (same math)."""
    for name in list(ch.deployed):
        await admin.delete(f"/xmix/v1/apps/{name}")
    copies: dict[str, str] = {}
    for name in CHURN:
        copy = f"oracle_{name}"
        r = await admin.post("/xmix/v1/apps?mode=request", content=renamed(apps[name], copy))
        if r.status_code != 201:
            raise RuntimeError(f"oracle copy of {name}: {r.status_code} {r.text[:200]}")
        copies[name] = copy
    todo: dict[str, list[Result]] = {}
    for res in results:
        if res.outcome == "ok" and not res.applied.get("changed"):
            todo.setdefault(oracle_key(res), []).append(res)
    equal, wrong = 0, []
    for group in todo.values():
        res = group[0]
        names, params = [], {}
        for a in res.applied["apps"]:
            n = copies.get(a["name"], a["name"])
            names.append(n)
            params[n] = a["params"]
        single = await run_one(
            client,
            Spec(**{**res.spec.__dict__, "stream": False, "disconnect_after": None}),
            names,
            params,
            deadline,
            salt=f"oracle-{res.spec.i}",
        )
        if single.outcome != "ok":
            wrong.append(f"#{res.spec.i}: the oracle run failed: {single.why}")
            continue
        back = {v: k2 for k2, v in copies.items()}
        want_reads = {
            i: {back.get(a, a): r for a, r in rd.items()} for i, rd in single.reads.items()
        }
        for got in group:
            bad = None
            if got.tokens != single.tokens:
                bad = f"tokens {got.tokens} != alone {single.tokens}"
            else:
                for i in range(got.spec.n):
                    g, w = got.reads.get(i, {}), want_reads.get(i, {})
                    if sorted(g) != sorted(w):
                        bad = f"choice {i}: reads of {sorted(g)} != alone {sorted(w)}"
                        break
                    for app in g:
                        for key in set(g[app]) | set(w[app]):
                            gp, gv = g[app].get(key, ([], []))
                            wp, wv = w[app].get(key, ([], []))
                            if gp != wp or not _close(gv, wv):
                                bad = (
                                    f"choice {i}: {app}.{key} differs from the request alone "
                                    f"(positions {'equal' if gp == wp else f'{gp} != {wp}'}, "
                                    f"values {gv[:6]} vs {wv[:6]})"
                                )
            if bad:
                wrong.append(
                    f"#{got.spec.i} ({got.spec.kind}, stream={got.spec.stream}, apps={got.spec.apps}): {bad}"
                )
            else:
                equal += 1
    for copy in copies.values():
        await admin.delete(f"/xmix/v1/apps/{copy}")
    return equal, wrong, len(todo)


# ---------------------------------------------------------------------- main
def _limits(concurrency: int) -> httpx.Limits:
    """Pooled connections are dropped after 2 s idle. The server (uvicorn under vLLM) closes
    an idle keep-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE = 5 s, httpx's own
    default expiry: a POST sent on a connection at that moment meets the close and fails with
    an empty ReadError that no server log shows (one request of a loaded CI run), and a POST
    is never retried. Keeping our expiry under the server's takes that race away."""
    return httpx.Limits(
        max_connections=concurrency + 8,
        max_keepalive_connections=concurrency + 8,
        keepalive_expiry=2.0,
    )


async def soak(args, base: str, apps: dict[str, bytes]) -> dict:
    specs = make_specs(args.requests, args.seed)
    limits = _limits(args.concurrency)
    async with (
        httpx.AsyncClient(
            base_url=base,
            headers={"Authorization": f"Bearer {args.key}"},
            timeout=httpx.Timeout(args.deadline),
            limits=limits,
        ) as client,
        httpx.AsyncClient(
            base_url=base,
            headers={"Authorization": f"Bearer {args.admin_key}"},
            timeout=httpx.Timeout(args.deadline),
            limits=_limits(4),
        ) as admin,
    ):
        ch = Changes()
        stop = asyncio.Event()
        sem = asyncio.Semaphore(args.concurrency)
        rng = random.Random(args.seed + 2)
        done_n = 0
        t_start = time.monotonic()

        async def one(spec: Spec) -> Result:
            nonlocal done_n
            # The requests keep pace with the changes as the changes keep pace with them: on
            # a loaded machine a change can take seconds, and requests that all finished
            # before the changes came would leave none that lived through one.
            while not driver.done() and ch.applied < args.changes * spec.i / len(specs) - 2:
                await asyncio.sleep(0.01)
            async with sem:
                names = []
                for a in spec.apps:
                    if a == "churn":  # a churn app, as the client last saw it
                        live = [n for n, m in ch.deployed.items() if m != "off"] or CHURN
                        a = rng.choice(live)
                    names.append(a)
                spec.apps = names
                res = await run_one(client, spec, names, spec.params, args.deadline)
                done_n += 1
                if args.progress and done_n % args.progress == 0:
                    print(
                        f"[soak] {done_n}/{len(specs)} requests, {ch.applied} changes, "
                        f"{time.monotonic() - t_start:.0f} s",
                        flush=True,
                    )
                return res

        driver = asyncio.create_task(
            drive_changes(
                admin, apps, ch, args.changes, stop, args.seed, lambda: done_n / len(specs)
            )
        )
        results = await asyncio.gather(*(one(s) for s in specs))
        stop.set()
        await driver
        soak_s = time.monotonic() - t_start
        # every request finished: no slot may stay taken (disconnected ones included)
        slots = None
        for _ in range(30):
            st = await admin.get("/xmix/v1/status")
            if st.status_code == 200:
                slots = max(w.get("slots_in_use", 0) for w in st.json()["workers"])
                if slots == 0:
                    break
            await asyncio.sleep(1)
        leaks = [
            f"#{r.spec.i}: {why}" for r in results if r.outcome == "ok" and (why := reads_ok(r))
        ]
        if slots:
            leaks.append(f"{slots} request slot(s) still taken after every request finished")
        changed = [r for r in results if r.outcome == "ok" and r.applied.get("changed")]
        t_oracle = time.monotonic()
        equal, wrong, distinct = await run_oracle(client, admin, apps, results, ch, args.deadline)
        oracle_s = time.monotonic() - t_oracle
    lat = sorted(ch.latencies)

    def pct(p):
        return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] * 1000 if lat else float("nan")

    by = {
        k: [r for r in results if r.outcome == k]
        for k in ("ok", "refused", "disconnected", "failed", "hung")
    }
    return {
        "requests": len(specs),
        "completed": len(by["ok"]),
        "refused_by_race": len(by["refused"]),
        "disconnected": len(by["disconnected"]),
        "failed": len(by["failed"]),
        "hung": len(by["hung"]),
        "changed_in_flight": len(changed),
        "oracle_equal": equal,
        "oracle_wrong": len(wrong),
        "oracle_distinct_runs": distinct,
        "leaked": len(leaks),
        "changes_applied": ch.applied,
        "changes_refused_as_intended": ch.refused_ok,
        "changes_unexpected": len(ch.unexpected),
        "change_latency_ms": {
            "p50": round(pct(50), 1),
            "p99": round(pct(99), 1),
            "max": round(pct(100), 1),
        },
        "soak_s": round(soak_s, 1),
        "oracle_s": round(oracle_s, 1),
        "examples": {
            "failed": [f"#{r.spec.i}: {r.why}" for r in by["failed"][:5]],
            "hung": [f"#{r.spec.i}: {r.why}" for r in by["hung"][:5]],
            "wrong": wrong[:5],
            "leaked": leaks[:5],
            "changes": ch.unexpected[:5],
        },
    }


# ---------------------------------------------------------------------- restarts
class Restartable:
    """One ``xmix serve`` on a state directory (``--xmix-state-dir``): killed with SIGKILL to
    its process group (API server, engine core, workers: ``kill -9`` of the whole server)
    and started again from that directory. ``trigger``: the file that arms the test-only
    crash points (``XMIX_TEST_STATE_CRASH``, state_dir.py); each start has a log of its own."""

    def __init__(self, tmp: Path, apps, key: str, admin: str, eager: bool, trigger: Path | None):
        self.tmp, self.apps, self.key, self.admin, self.eager = tmp, apps, key, admin, eager
        self.state_dir = tmp / "state"
        self.trigger = trigger
        self.proc = None
        self.base = ""
        self.logs: list[Path] = []
        self.start_s: list[float] = []

    def start(self) -> str:
        t0 = time.time()
        env = {"XMIX_TEST_STATE_CRASH": str(self.trigger)} if self.trigger else {}
        self.proc, self.base, log = start_server(
            self.tmp,
            self.apps,
            self.key,
            self.admin,
            eager=self.eager,
            env=env,
            log_name=f"serve-{len(self.logs)}.log",
            extra=["--xmix-state-dir", str(self.state_dir)],
        )
        self.logs.append(log)
        self.start_s.append(round(time.time() - t0, 1))
        return self.base

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def dead(self, timeout: float = 60) -> bool:
        """Whether the server died (an armed crash point kills it from inside); whatever is
        left of its group is killed too."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return True

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)


def _state_of(doc: dict) -> dict:
    return {
        a["name"]: {k: a[k] for k in ("version", "mode", "params", "locked")}
        for a in doc.get("apps", [])
    }


_CONNECTION_LOST = ("ConnectError", "ReadError", "WriteError", "RemoteProtocolError", "CloseError")


def _cut(res: Result, windows: list[tuple[float, float]]) -> bool:
    """A request the kill cut off: no answer, or a stream that stopped, while the server was
    down (from the kill, or the arming of a crash point, until it answered again)."""
    if res.outcome not in ("failed", "hung"):
        return False
    conn = res.why.startswith(_CONNECTION_LOST) or res.why == "stream ended without [DONE]"
    return conn and any(a - 1 <= res.t1 and res.t0 <= b for a, b in windows)


async def restart_soak(args, srv: Restartable, apps: dict[str, bytes], points: list) -> dict:
    """Requests and control changes before, during and after each ``kill -9`` of the whole
    server and its restart from the state directory; one kill per entry of ``points``
    (None: a SIGKILL from outside at a random moment while a change is in flight;
    "kind:point": the next change of that kind dies at that crash point, from inside).

    Counted: changes acknowledged (HTTP 2xx) and lost after a restart (must be 0); the change
    in flight at each kill (in doubt), found whole or absent after the restart, or half
    (must be 0); requests cut by a kill (apart), failed otherwise (must be 0); wrong answers
    (must be 0): the same requests before the first kill and after every restart (pinned,
    tokens exact and reads to 1e-5), and every completed request against the same request
    alone (``run_oracle``); server errors in each start's log."""
    n_req = args.restart_requests * len(points)
    specs = make_specs(n_req, args.seed + 100)
    rng = random.Random(args.seed + 101)
    limits = _limits(args.concurrency)

    class Conn:  # the clients of the server that runs now (new ones after each restart)
        client: httpx.AsyncClient
        admin: httpx.AsyncClient

    conn = Conn()

    async def connect() -> None:
        for c in (getattr(conn, "client", None), getattr(conn, "admin", None)):
            if c is not None:
                await c.aclose()
        conn.client = httpx.AsyncClient(
            base_url=srv.base,
            headers={"Authorization": f"Bearer {args.key}"},
            timeout=httpx.Timeout(args.deadline),
            limits=limits,
        )
        conn.admin = httpx.AsyncClient(
            base_url=srv.base,
            headers={"Authorization": f"Bearer {args.admin_key}"},
            timeout=httpx.Timeout(args.deadline),
            limits=_limits(4),
        )

    await asyncio.to_thread(srv.start)
    await connect()
    acked = _state_of((await conn.admin.get("/xmix/v1/apps")).json())  # what was acknowledged
    ch = Changes()  # the live churn apps the requests name (as in soak)
    fig = {
        "kills": 0,
        "acked_changes": 0,
        "acked_lost": 0,
        "in_doubt": 0,
        "in_doubt_present": 0,
        "in_doubt_absent": 0,
        "in_doubt_half": 0,
        "kill_points_missed": 0,
        "changes_unexpected": 0,
        "pinned_equal": 0,
        "pinned_wrong": 0,
    }
    examples: dict[str, list[str]] = {"lost": [], "half": [], "pinned": [], "changes": []}
    windows: list[tuple[float, float]] = []
    up = asyncio.Event()
    up.set()
    # While a kill is on its way no change is applied, so requests that keep pace with the
    # changes would all wait and the ones in flight finish before the server dies (a kill that
    # cut none, seen twice on a loaded machine): during a kill they go on regardless, up to the
    # index it holds (0: no kill on its way).
    killing = [0]
    defaults: dict[str, dict] = {}  # template -> its parameters at deploy

    def sync_live() -> None:
        ch.deployed = {n: a["mode"] for n, a in acked.items() if n in CHURN}

    async def answer(method: str, path: str, **kw) -> httpx.Response | None:
        """A change; None when the server died under it (no answer: in doubt)."""
        try:
            return await conn.admin.request(method, path, **kw)
        except httpx.HTTPError:
            return None

    def ack(r: httpx.Response, name: str) -> None:
        fig["acked_changes"] += 1
        if r.request.method == "DELETE":
            acked.pop(name, None)
        else:
            info = r.json()
            acked[name] = {k: info[k] for k in ("version", "mode", "params", "locked")}
            if r.status_code == 201:
                defaults.setdefault(name, info["params"])
        sync_live()

    def make_change(kind: str | None = None) -> tuple[str, str, dict, str]:
        """(method, path, request kwargs, app) of a change of ``kind`` (any when None)."""
        live = [n for n in CHURN if n in acked]
        gone = [n for n in CHURN if n not in acked]
        if kind is None:
            kind = "deploy" if gone and (not live or rng.random() < 0.3) else None
            kind = kind or rng.choice(["patch", "patch", "patch", "undeploy"])
        if kind == "deploy":
            # no mode "all" here: it would reach the pinned requests (soak() runs it)
            name = rng.choice(gone)
            return "POST", "/xmix/v1/apps?mode=request", {"content": apps[name]}, name
        name = rng.choice(live)
        if kind == "undeploy":
            return "DELETE", f"/xmix/v1/apps/{name}", {}, name
        cur = acked[name]
        body: dict = {}
        roll = rng.random()
        if roll < 0.3 or kind == "patch!":  # mode and parameters in one change: never half
            body["mode"] = "off" if cur["mode"] != "off" else "request"
        if roll >= 0.15 or kind == "patch!":
            scale = rng.choice([v for v in (0.5, 1.0, -2.0, 3.0) if v != cur["params"]["w.scale"]])
            body["params"] = {"w.scale": scale}
        if kind == "patch!" or rng.random() < 0.1:
            body["locked"] = [] if cur["locked"] else ["w.scale"]
        return "PATCH", f"/xmix/v1/apps/{name}", {"json": body}, name

    def after(method: str, kw: dict, name: str) -> dict | None:
        """The acknowledged state with a change applied whole (versions of a deploy aside)."""
        if method == "DELETE":
            return None
        if method == "POST":
            return {"version": None, "mode": "request", "params": defaults.get(name), "locked": []}
        body = kw["json"]
        a = json.loads(json.dumps(acked[name]))
        if "mode" in body:
            a["mode"] = body["mode"]
        a["params"].update(body.get("params", {}))
        if "locked" in body:
            a["locked"] = sorted(body["locked"])
        return a

    async def pinned() -> dict:
        """Requests of the apps no change touches, run alone: their answers must not move."""
        out = {}
        for i, (app_names, params) in enumerate(
            [(["steer"], {"steer": {"scale": 2.0}}), (["probe"], {}), (["steer", "probe"], {})]
        ):
            spec = Spec(
                -1 - i,
                "cmpl" if i != 2 else "chat",
                False,
                app_names,
                params,
                1,
                12,
                PROMPTS[i],
                None,
            )
            res = await run_one(
                conn.client, spec, app_names, params, args.deadline, salt=f"pinned-{i}"
            )
            out[i] = (res.outcome, res.tokens, res.reads)
        return out

    pinned_ref = await pinned()
    # every churn template deployed once: each one's parameters at deploy are known
    for name in CHURN:
        r = await answer("POST", "/xmix/v1/apps?mode=request", content=apps[name])
        if r is None or r.status_code != 201:
            raise RuntimeError(f"deploying {name}: {r and r.status_code} {r and r.text[:200]}")
        ack(r, name)

    async def kill_and_restart(point: str | None) -> None:
        fig["kills"] += 1
        # requests stop keeping pace with the changes until it is back up, up to a share that
        # leaves the later kills their own load
        killing[0] = int(n_req * (fig["kills"] + 0.25) / len(points))
        t_wait = time.monotonic()  # under load: requests in flight when the server dies
        while inflight < max(1, args.concurrency // 2) and time.monotonic() - t_wait < 20:
            await asyncio.sleep(0.05)
        t_kill = time.monotonic()
        in_doubt = None
        if point is None:  # from outside, while a change is on its way
            up.clear()  # requests not yet sent wait for the restarted server
            method, path, kw, name = make_change()
            task = asyncio.create_task(answer(method, path, **kw))
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            t_kill = time.monotonic()
            await asyncio.to_thread(srv.kill)
            r = await task
        else:  # from inside: the next change of that kind dies at the point
            kind = point.split(":")[0]
            if kind != "deploy" and not any(n in acked for n in CHURN):
                r = await answer("POST", "/xmix/v1/apps?mode=request", content=apps[CHURN[0]])
                ack(r, CHURN[0])
            srv.trigger.write_text(point)
            if kind == "deploy":
                # an app never deployed: its file is new (the points of writing one are on
                # its way; a churn template's file may still be there from an earlier deploy)
                name = f"fresh{fig['kills']}"
                defaults[name] = defaults[CHURN[0]]
                method, path = "POST", "/xmix/v1/apps?mode=request"
                kw = {"content": renamed(apps[CHURN[0]], name)}
            else:
                method, path, kw, name = make_change("patch!" if kind == "patch" else kind)
            # Requests go on while the change runs to its point: it takes seconds (files, every
            # engine), long enough for the requests in flight at its start to finish, and a
            # kill that cut none was seen on a loaded machine. Those sent once the server
            # died fail to connect inside the window: cut, as the ones in flight.
            r = await answer(method, path, **kw)
            up.clear()  # requests not yet sent wait for the restarted server
            if r is not None:  # answered: the point was not on its way
                fig["kill_points_missed"] += 1
                examples["changes"].append(f"{point}: {method} {path} answered {r.status_code}")
            if not await asyncio.to_thread(srv.dead, 30):
                await asyncio.to_thread(srv.kill)
            srv.trigger.unlink(missing_ok=True)
        if r is not None and r.status_code < 300:
            ack(r, name)
        elif r is None:
            in_doubt = (method, {**kw, "_path": path}, name)
        await asyncio.to_thread(srv.start)
        await connect()
        got = _state_of((await conn.admin.get("/xmix/v1/apps")).json())
        doubt_name = in_doubt[2] if in_doubt else None
        for n in set(got) | set(acked):
            if n == doubt_name:
                continue
            if got.get(n) != acked.get(n):
                fig["acked_lost"] += 1
                examples["lost"].append(f"kill {fig['kills']}: {n} {acked.get(n)} -> {got.get(n)}")
        if in_doubt is not None:
            fig["in_doubt"] += 1
            method, kw, n = in_doubt
            whole = after(method, kw, n)
            now = got.get(n)
            if method == "POST" and now is not None:
                top = max((a["version"] for a in acked.values()), default=0)
                ok = now["version"] > top and {**now, "version": None} == whole
            else:
                ok = now == whole
            if ok:
                fig["in_doubt_present"] += 1
            elif now == acked.get(n):
                fig["in_doubt_absent"] += 1
            else:
                fig["in_doubt_half"] += 1
                examples["half"].append(
                    f"kill {fig['kills']}: {method} {kw.get('_path')} {kw.get('json', '')}: "
                    f"before {acked.get(n)}, whole {whole}, after the restart {now}"
                )
            if now is None:
                acked.pop(n, None)
            else:
                acked[n] = now
        sync_live()
        again = await pinned()
        for i, ref in pinned_ref.items():
            g = again[i]
            same = g[0] == ref[0] == "ok" and g[1] == ref[1]
            same = same and all(
                sorted(g[2].get(c, {})) == sorted(ref[2].get(c, {}))
                and all(
                    g[2][c][a][k][0] == ref[2][c][a][k][0]
                    and _close(g[2][c][a][k][1], ref[2][c][a][k][1])
                    for a in ref[2].get(c, {})
                    for k in ref[2][c][a]
                )
                for c in ref[2]
            )
            fig["pinned_equal" if same else "pinned_wrong"] += 1
            if not same:
                examples["pinned"].append(f"kill {fig['kills']}: pinned #{i}: {g} != {ref}")
        windows.append((t_kill, time.monotonic()))
        killing[0] = 0
        up.set()

    done_n = inflight = 0
    target = args.restart_changes * len(points)
    applied = 0

    async def driver() -> None:
        nonlocal applied
        kills = 0
        while True:
            progress = done_n / max(1, n_req)
            if kills < len(points) and progress >= (kills + 0.5) / len(points):
                await kill_and_restart(points[kills])
                kills += 1
                continue
            if kills == len(points) and applied >= target and done_n >= n_req:
                return
            if applied >= target * progress + 2 and done_n < n_req:
                await asyncio.sleep(0.01)
                continue
            method, path, kw, name = make_change()
            r = await answer(method, path, **kw)
            if r is None or r.status_code >= 300:
                fig["changes_unexpected"] += 1
                examples["changes"].append(
                    f"{method} {path} answered {r.status_code if r else 'nothing'}: "
                    f"{r.text[:200] if r else ''}"
                )
            else:
                ack(r, name)
            applied += 1
            await asyncio.sleep(rng.random() * 0.01)

    sem = asyncio.Semaphore(args.concurrency)

    async def one(spec: Spec) -> Result:
        nonlocal done_n, inflight
        # Requests keep pace with the changes (as in soak), a window of ``concurrency``
        # requests ahead, so that changes run among requests and requests are in flight
        # when a kill comes.
        while (
            not drive.done()
            and spec.i >= killing[0]
            and applied < target * (spec.i - args.concurrency) / n_req - 2
        ):
            await asyncio.sleep(0.01)
        async with sem:
            await up.wait()
            names = []
            for a in spec.apps:
                if a == "churn":
                    a = rng.choice([n for n, m in ch.deployed.items() if m != "off"] or CHURN)
                names.append(a)
            spec.apps = names
            inflight += 1
            try:
                res = await run_one(conn.client, spec, names, spec.params, args.deadline)
            finally:
                inflight -= 1
            done_n += 1
            if args.progress and done_n % args.progress == 0:
                print(f"[restart] {done_n}/{n_req} requests, {applied} changes", flush=True)
            return res

    t0 = time.monotonic()
    drive = asyncio.create_task(driver())
    results = await asyncio.gather(*(one(sp) for sp in specs))
    await drive
    cut = [r for r in results if _cut(r, windows)]
    for r in cut:
        r.outcome = "cut"
    run_s = time.monotonic() - t0
    leaks = [f"#{r.spec.i}: {why}" for r in results if r.outcome == "ok" and (why := reads_ok(r))]
    equal, wrong, distinct = await run_oracle(
        conn.client, conn.admin, apps, results, ch, args.deadline
    )
    for c in (conn.client, conn.admin):
        await c.aclose()
    by = {
        k: [r for r in results if r.outcome == k]
        for k in ("ok", "refused", "disconnected", "cut", "failed", "hung")
    }
    fig.update(
        {
            "requests": n_req,
            "completed": len(by["ok"]),
            "refused_by_race": len(by["refused"]),
            "disconnected": len(by["disconnected"]),
            "cut_by_kill": len(by["cut"]),
            "failed": len(by["failed"]),
            "hung": len(by["hung"]),
            "changed_in_flight": len([r for r in by["ok"] if r.applied.get("changed")]),
            "oracle_equal": equal,
            "oracle_wrong": len(wrong),
            "oracle_distinct_runs": distinct,
            "leaked": len(leaks),
            "restart_s": srv.start_s[1:],
            "run_s": round(run_s, 1),
        }
    )
    examples.update(
        failed=[f"#{r.spec.i}: {r.why}" for r in by["failed"][:5]],
        wrong=wrong[:5],
        leaked=leaks[:5],
    )
    fig["examples"] = {k: v[:5] for k, v in examples.items()}
    return fig


def restart_bad(fig: dict) -> int:
    """What must be 0 after the restart phase."""
    return sum(
        fig[k]
        for k in (
            "acked_lost",
            "in_doubt_half",
            "failed",
            "hung",
            "oracle_wrong",
            "pinned_wrong",
            "leaked",
            "changes_unexpected",
            "kill_points_missed",
        )
    )


def server_errors(log: Path | None) -> dict | None:
    if log is None:
        return None
    text = log.read_text(errors="replace")
    # Only what the server logged while serving: once vLLM's shutdown starts (its "[shutdown]"
    # lines), its output handler may log EngineDeadError for the engine it is stopping.
    cut = text.find("[shutdown]")
    if cut >= 0:
        text = text[: text.rfind("\n", 0, cut) + 1]
    errs = [l for l in text.splitlines() if " ERROR " in l]
    return {
        "error_lines": len(errs),
        "tracebacks": text.count("Traceback (most recent call last)"),
        "examples": errs[:5],
    }


def run_restarts(args, apps: dict[str, bytes], tmp: Path, eager: bool = False) -> dict:
    """The restart phase on a server of its own (``restart_soak``); the kill points of
    ``args.kill_points`` (None entries: from outside), the figures and each start's log."""
    points = [p or None for p in args.kill_points] if args.kill_points else [None] * args.restarts
    trigger = tmp / "crash-point" if any(points) else None
    srv = Restartable(tmp, apps, args.key, args.admin_key, eager, trigger)
    try:
        fig = asyncio.run(restart_soak(args, srv, apps, points))
    finally:
        srv.stop()
    logs = [server_errors(p) for p in srv.logs]
    fig["server_log"] = {
        "starts": len(logs),
        "start_s": srv.start_s,
        "error_lines": sum(x["error_lines"] for x in logs),
        "tracebacks": sum(x["tracebacks"] for x in logs),
        "examples": [e for x in logs for e in x["examples"]][:5],
    }
    return fig


def print_restarts(fig: dict) -> None:
    print(
        f"[restart] {fig['kills']} kill -9 of the whole server, each restarted from its state "
        f"directory (starts {fig['server_log']['start_s']} s); run {fig['run_s']} s"
    )
    print(
        f"[restart] changes acknowledged {fig['acked_changes']}, lost after a restart "
        f"{fig['acked_lost']}; in flight at a kill {fig['in_doubt']}: whole after the restart "
        f"{fig['in_doubt_present']}, absent {fig['in_doubt_absent']}, half {fig['in_doubt_half']}"
        f"; crash points missed {fig['kill_points_missed']}; unexpected answers "
        f"{fig['changes_unexpected']}"
    )
    print(
        f"[restart] requests {fig['requests']}: completed {fig['completed']}, cut by a kill "
        f"{fig['cut_by_kill']}, refused by a race {fig['refused_by_race']}, disconnected by the "
        f"client {fig['disconnected']}, failed "
        f"{fig['failed']}, hung {fig['hung']}; wrong answers: oracle {fig['oracle_wrong']} "
        f"(of {fig['oracle_equal'] + fig['oracle_wrong']}), pinned across restarts "
        f"{fig['pinned_wrong']} (of {fig['pinned_equal'] + fig['pinned_wrong']}); leaked "
        f"{fig['leaked']}"
    )
    sl = fig["server_log"]
    print(f"[restart] server logs: {sl['error_lines']} ERROR lines, {sl['tracebacks']} tracebacks")
    for k, v in fig["examples"].items():
        for line in v:
            print(f"[restart]   {k}: {line}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=2000, help="0: no live-change phase")
    ap.add_argument("--changes", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--url", help="a running xmix serve (its apps must include this script's steer/probe)"
    )
    ap.add_argument("--key", default="soak-key")
    ap.add_argument("--admin-key", default="soak-admin-key")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--progress", type=int, default=0, help="print progress every N requests")
    ap.add_argument(
        "--restarts",
        type=int,
        default=3,
        help="kill -9 and restart cycles on a server of their own (0: none; not with --url)",
    )
    ap.add_argument("--restart-requests", type=int, default=300, help="requests per restart")
    ap.add_argument("--restart-changes", type=int, default=100, help="changes per restart")
    ap.add_argument(
        "--kill-points",
        type=lambda v: v.split(","),
        help="kill at these crash points instead (test-only XMIX_TEST_STATE_CRASH, e.g. "
        "deploy:app.renamed,patch:applied; an empty entry: from outside)",
    )
    args = ap.parse_args(argv)
    apps = build_apps(args.seed)
    proc = log = None
    t0 = time.time()
    fig: dict = {}
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.requests:
            if args.url:
                base = args.url
            else:
                proc, base, log = start_server(Path(tmp), apps, args.key, args.admin_key)
                print(f"[soak] xmix serve up in {time.time() - t0:.0f} s at {base}", flush=True)
            try:
                fig = asyncio.run(soak(args, base, apps))
            finally:
                if proc is not None:
                    stop_server(proc)
            fig["server_log"] = server_errors(log)
            fig["wall_s"] = round(time.time() - t0, 1)
            bad += report(fig)
        if (args.restarts or args.kill_points) and not args.url:
            t1 = time.time()
            rdir = Path(tmp) / "restarts"
            rdir.mkdir()
            fig["restarts"] = run_restarts(args, apps, rdir)
            fig["restarts"]["wall_s"] = round(time.time() - t1, 1)
            print_restarts(fig["restarts"])
            bad += restart_bad(fig["restarts"]) + fig["restarts"]["server_log"]["tracebacks"]
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2))
    return 1 if bad else 0


def report(fig: dict) -> int:
    """Print the live-change phase's figures; what must be 0, summed."""
    lat = fig["change_latency_ms"]
    print(
        f"[soak] requests sent {fig['requests']}: completed {fig['completed']}, refused by a race "
        f"{fig['refused_by_race']}, disconnected by the client {fig['disconnected']}, failed "
        f"{fig['failed']}, hung {fig['hung']}"
    )
    print(
        f"[soak] oracle: {fig['oracle_equal']} equal, {fig['oracle_wrong']} wrong "
        f"({fig['oracle_distinct_runs']} runs alone); {fig['changed_in_flight']} requests lived "
        f"through a change of their apps (checked for completion and leaks only); leaked {fig['leaked']}"
    )
    print(
        f"[soak] changes applied {fig['changes_applied']} (+{fig['changes_refused_as_intended']} refused "
        f"as intended, {fig['changes_unexpected']} unexpected answers); change latency p50 "
        f"{lat['p50']} ms, p99 {lat['p99']} ms, max {lat['max']} ms"
    )
    sl = fig["server_log"]
    print(
        f"[soak] server log: {sl['error_lines']} ERROR lines, {sl['tracebacks']} tracebacks"
        if sl
        else "[soak] server log: not ours (--url)"
    )
    print(f"[soak] wall {fig['wall_s']} s (soak {fig['soak_s']} s, oracle {fig['oracle_s']} s)")
    for k, v in fig["examples"].items():
        for line in v:
            print(f"[soak]   {k}: {line}")
    bad = (
        fig["failed"]
        + fig["hung"]
        + fig["oracle_wrong"]
        + fig["leaked"]
        + fig["changes_unexpected"]
    )
    bad += sl["tracebacks"] if sl else 0
    return bad


if __name__ == "__main__":
    sys.exit(main())
