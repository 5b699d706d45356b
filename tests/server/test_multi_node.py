"""xmix on vLLM's multi-node modes, on hosts of our own (issue 32; docs/serving.md, Scale-out).

Two hosts are two Linux network namespaces joined by veth pairs (tests/netns_hosts.py): each
has its own address, loopback, hostname and /dev/shm, and reaches the other host's address and
nothing else; this process reaches both over a third veth. The module makes them and removes
them (and every process started on them) whatever happens; without root or iproute2 it skips,
saying why. Nothing but the two hosts' addresses is ever contacted.

One deployment at a time (a 2-core machine), each started once:

1. **Pipeline parallel across hosts**: ``xmix serve --pipeline-parallel-size 2 --nnodes 2``,
   stage 0 and the API server on host 0, stage 1 on host 1 (``--node-rank 1 --headless``).
   Compiled: under ``--enforce-eager`` vLLM 0.32's CPU runner never allocates a later
   stage's intermediate tensors (``warming_up_model`` returns early without compilation) and
   stage 1 fails an assertion at its first step (seen here; tests/engine/test_pipeline_parallel.py
   runs compiled for the same reason).
2. **Data parallel across hosts**: the head (``--data-parallel-size 2
   --data-parallel-size-local 1``, two API servers) with engine 0 on host 0, and
   ``--headless --data-parallel-start-rank 1`` with engine 1 on host 1, eager. Host 1 places
   hook sites on layers 0-2 only (``--additional-config``), so an app on layer 3 is refused by
   the remote rank alone. Requests pick their rank with vLLM's ``X-data-parallel-rank``
   header; every request opens a new connection, so either API server may admit it. The faults
   come last: a link cut shorter than the control plane's RPC timeout, one longer, then the
   remote engine killed in the middle of a deploy.

Oracle: one engine (offline ``xmix.LLM``, eager, this process, before the hosts are used)
running the same apps through the same states on the same token ids: tokens exact, reads within
1e-4 relative. Eager and compiled give the same tokens and reads to 2.5e-6 on this model
(measured), so the compiled pipeline is compared with it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import netns_hosts
import xmix
from engine_util import PROMPTS, greedy, make_llm, shutdown, tokenize
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

KEY = "multi-node-key"
NAME = "tiny-llama"
D = 256
G = 12  # tokens generated per request
PORT = 8000  # each host has its own ports: nothing else listens there
# XMIX_RPC_TIMEOUT_S on the DP head: the long cut lasts longer. 15 s, not 10: TCP's backoff
# after the short cut (3.5 s) can hold the first answer until ~6 s after the cut, and a
# loaded 2-core CI machine once pushed it past 10 s from the PATCH (503).
RPC_TIMEOUT_S = 15
SYNC_S = 1.0  # XMIX_SYNC_S on the DP head: widens the window item 4 closes


# ---------------------------------------------------------------------------- apps
def pp_apps() -> list[xmix.App]:
    """The pipeline's mixed batch: a steer on stage 1, an ablation on every layer (both
    stages), probes on the first and the last stage, a write on stage 1 gated per token by a
    stage-0 read and one latched on a stage-0 read's prompt mean."""
    g = torch.Generator().manual_seed(32)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(D, generator=g) * 4, scale=1.0).layers([3]).at(
        "residual.post"
    )
    ablate = xmix.App("ablate")
    ablate.write("ablate", direction=torch.randn(D, generator=g)).layers("all").at("residual.post")
    probe = xmix.App("probe")
    probe.read("probe", weight=torch.randn(D, generator=g) / 8).layers([0]).at("mlp.post").named(
        "p"
    )
    final = xmix.App("final")
    final.read("probe", weight=torch.randn(D, generator=g) / 8).at("final.post").named("f")
    gated = xmix.App("gated")
    gated.read("probe", weight=torch.randn(D, generator=g) / 8).layers([1]).at(
        "residual.post"
    ).named("g")
    gated.write("add", vector=torch.randn(D, generator=g) * 6, scale=1.0).layers([2]).at(
        "attention.post"
    ).cond("g >= 0.5")
    latched = xmix.App("latched")
    latched.read("probe", weight=torch.randn(D, generator=g) / 8).layers([0]).at(
        "residual.post"
    ).named("m")
    latched.write("add", vector=torch.randn(D, generator=g) * 6, scale=1.0).layers([3]).at(
        "mlp.post"
    ).cond("prompt_mean(m) >= 0.5")
    return [steer, ablate, probe, final, gated, latched]


PP_CONTROLS = [
    None,
    {"apps": ["steer"]},
    {"apps": ["ablate"]},
    {"apps": ["probe", "final"]},
    {"apps": ["gated"]},
    {"apps": ["latched"]},
    {"apps": ["steer", "ablate", "probe", "final", "gated", "latched"]},
]


def dp_apps() -> dict[str, xmix.App]:
    g = torch.Generator().manual_seed(33)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(D, generator=g), scale=4.0).layers([1]).at(
        "residual.post"
    )
    probe = xmix.App("probe")
    probe.read("probe", weight=torch.randn(D, generator=g) / 16).layers([2]).at(
        "residual.post"
    ).named("p2")
    extra = xmix.App("extra")
    extra.write("add", vector=torch.randn(D, generator=g), scale=6.0).layers([0]).at(
        "residual.post"
    )
    late = xmix.App("late")  # layer 3: host 1 places no site there
    late.write("add", vector=torch.randn(D, generator=g), scale=6.0).layers([3]).at("residual.post")
    return {"steer": steer, "probe": probe, "extra": extra, "late": late}


BASE = {"apps": ["steer", "probe"]}
WITH_EXTRA = {"apps": ["steer", "probe", "extra"]}
# (state, control) in the order the DP deployment goes through them; "gone" is "base" again
DP_STATES = [
    ("base", BASE),
    ("extra", WITH_EXTRA),
    ("patched", WITH_EXTRA),
    ("all", BASE),
    ("gone", BASE),
]
EXTRA_SCALE = -3.0


# ---------------------------------------------------------------------------- the oracle
def reference(ids_pp: list, ids_dp: list) -> dict:
    """One engine, this process: the PP batch, then the DP states in order."""
    llm = make_llm(str(tiny_model_path(NAME)))
    try:
        for a in pp_apps():
            llm.xmix.deploy(a)
        out: dict = {"pp": _offline(llm, ids_pp, PP_CONTROLS)}
        for a in pp_apps():
            llm.xmix.undeploy(a.name)
        apps = dp_apps()
        llm.xmix.deploy(apps["steer"])
        llm.xmix.deploy(apps["probe"])
        out["plain"] = _offline(llm, ids_dp, [None] * len(ids_dp))
        for state, control in DP_STATES:
            if state == "extra":
                llm.xmix.deploy(apps["extra"])
            elif state == "patched":
                llm.xmix.set_params("extra", {"scale": EXTRA_SCALE})
            elif state == "all":
                llm.xmix.set_mode("extra", "all")
            elif state == "gone":
                llm.xmix.undeploy("extra")
            out[state] = _offline(llm, ids_dp, [control] * len(ids_dp))
    finally:
        shutdown(llm)
    return out


def _offline(llm, ids, controls) -> list[tuple[list[int], dict]]:
    outs = greedy(llm, ids, G, controls)
    return [(list(o.outputs[0].token_ids), _norm(xmix.results(o))) for o in outs]


def _norm(res: dict) -> dict:
    out: dict = {}
    for app, reads in (res or {}).items():
        for key, v in reads.items():
            if isinstance(v, dict) and "values" in v:
                out.setdefault(app, {})[key] = (
                    [int(p) for p in np.asarray(v["positions"]).reshape(-1)],
                    np.asarray(v["values"], dtype=np.float64),
                )
    return out


def assert_same(got: tuple, want: tuple, what: str) -> None:
    (t1, r1), (t2, r2) = got, want
    assert t1 == t2, f"{what}: tokens {t1} != one engine's {t2}"
    assert set(r1) == set(r2), f"{what}: apps with reads {sorted(r1)} != {sorted(r2)}"
    for app, reads in r2.items():
        assert set(r1[app]) == set(reads), f"{what}: reads of {app}"
        for key, (pos, val) in reads.items():
            assert r1[app][key][0] == pos, f"{what}: {app}.{key} positions"
            np.testing.assert_allclose(
                r1[app][key][1], val, rtol=1e-4, atol=1e-6, err_msg=f"{what}: {app}.{key}"
            )


# ---------------------------------------------------------------------------- servers
def xmix_serve(model: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "xmix.cli",
        "serve",
        model,
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "64",  # the oracle's (engine_util.ENGINE_KW): the same prompt chunks
        "--served-model-name",
        NAME,
        *args,
    ]


def wait_healthy(base: str, procs: list, logs: list[Path], timeout: float = 900) -> float:
    t0 = time.time()
    while True:
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise RuntimeError(f"a host's xmix serve exited ({p.returncode}):\n" + tail(log))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2, trust_env=False).status_code == 200:
                return time.time() - t0
        if time.time() - t0 > timeout:
            raise TimeoutError("the deployment did not start:\n" + "\n".join(map(tail, logs)))
        time.sleep(1)


def tail(log: Path, n: int = 3000) -> str:
    try:
        return f"--- {log.name}:\n" + log.read_text(errors="replace")[-n:]
    except OSError:
        return f"--- {log.name}: unreadable"


class Api:
    """The head's HTTP API, one new connection per call (so either API server may answer)."""

    def __init__(self, base: str):
        self.base = base

    def call(self, method: str, path: str, rank: int | None = None, timeout=120, **kw):
        headers = {"Authorization": f"Bearer {KEY}"}
        if rank is not None:
            headers["X-data-parallel-rank"] = str(rank)
        with httpx.Client(base_url=self.base, trust_env=False, timeout=timeout) as c:
            return c.request(method, path, headers=headers, **kw)

    def complete(self, ids, control, rank=None, max_tokens=G, timeout=120):
        body = {
            "model": NAME,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if control is not None:
            body["vllm_xargs"] = {"xmix": json.dumps(control)}
        return self.call("POST", "/v1/completions", rank=rank, timeout=timeout, json=body)

    def status(self) -> list[dict]:
        r = self.call("GET", "/xmix/v1/status")
        assert r.status_code == 200, r.text
        return r.json()["workers"]

    def apps(self) -> list[dict]:
        r = self.call("GET", "/xmix/v1/apps")
        assert r.status_code == 200, r.text
        return r.json()["apps"]


def outcome(r) -> dict:
    body = r.json()
    ch = body["choices"][0]
    return {
        "ids": ch["token_ids"],
        "reads": _norm(xmix.decode_results(body["xmix"])) if body.get("xmix") else {},
        "applied": body.get("xmix_applied"),
        "server": r.headers.get("x-xmix-server"),
    }


def snapshot(api: Api) -> dict:
    """What every worker holds and its copy of the ledger, next to the registry's apps."""
    workers = api.status()
    return {
        "workers": [
            {
                "where": w.get("where"),
                "ledger": w.get("ledger"),
                "error": w.get("error"),
                "steps": (w.get("stats") or {}).get("steps"),
                "apps": sorted(
                    (a["name"], a["version"], a["mode"], tuple(sorted(a["params"].items())))
                    for a in w.get("apps", ())
                ),
            }
            for w in workers
        ],
        "registry": sorted(
            (a["name"], a["version"], a["mode"], tuple(sorted(a["params"].items())))
            for a in api.apps()
        ),
    }


def engine_core_pid(hosts, i: int) -> int:
    for pid in hosts.pids(hosts.names[i]):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
                return pid
    raise AssertionError(f"no vLLM engine core on host {i}")


# ---------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def hosts():
    why = netns_hosts.reason()
    if why is not None:
        pytest.skip(f"cannot make hosts of our own on this machine: {why}")
    h = netns_hosts.Hosts(2)
    h.up()
    try:
        yield h
    finally:
        h.down()


@pytest.fixture(scope="module")
def runs(hosts, tmp_path_factory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("multi_node")
    model = str(tiny_model_path(NAME))
    tok = AutoTokenizer.from_pretrained(model)
    ids_pp = [tokenize(tok, p) for p in PROMPTS[: len(PP_CONTROLS)]]
    ids_dp = [tokenize(tok, p) for p in PROMPTS[7:9]]
    rec: dict = {"t": {}}
    t0 = time.time()
    rec["ref"] = reference(ids_pp, ids_dp)
    rec["addrs"] = list(hosts.addrs)
    rec["t"]["reference"] = time.time() - t0
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    a0 = hosts.addrs[0]
    base = f"http://{a0}:{PORT}"

    # --- 1. pipeline parallel across the two hosts
    t0 = time.time()
    files = []
    for a in pp_apps():
        files += ["--app", str(a.save(tmp / f"pp_{a.name}.xmix"))]
    pp = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", a0]
    logs = [tmp / "pp_h0.log", tmp / "pp_h1.log"]
    keys = ["--api-key", KEY, "--xmix-admin-key", KEY]
    procs = [
        hosts.popen(
            0,
            xmix_serve(model, *pp, "--node-rank", "0", "--host", a0, "--port", str(PORT), *keys)
            + files,
            logs[0],
            VLLM_CPU_OMP_THREADS_BIND="0",
            **env,
        ),
        hosts.popen(
            1,
            xmix_serve(model, *pp, "--node-rank", "1", "--headless"),
            logs[1],
            VLLM_CPU_OMP_THREADS_BIND="1",
            **env,
        ),
    ]
    try:
        rec["t"]["pp_start"] = wait_healthy(base, procs, logs)
        api = Api(base)
        got: dict = {}

        def one(i):
            got[i] = api.complete(ids_pp[i], PP_CONTROLS[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ids_pp))]
        for t in threads:  # at once: they share steps, as the oracle's batch does
            t.start()
        for t in threads:
            t.join(timeout=300)
        rec["pp"] = [(got[i].status_code, got[i].text) for i in range(len(ids_pp))]
        rec["pp_snap"] = snapshot(api)
        # what was logged while serving: when the stop's SIGTERM reaches the engine core
        # before the API server, vLLM's output handler logs an EngineDeadError traceback
        # during its own shutdown (seen once in a fresh-clone run), which is not ours
        rec["pp_log"] = "\n".join(tail(x, 100_000) for x in logs)
    finally:
        for p in procs:
            hosts.stop(p)
        rec.setdefault("pp_log", "\n".join(tail(x, 100_000) for x in logs))
    rec["t"]["pp"] = time.time() - t0

    # --- 2. data parallel across the two hosts
    t0 = time.time()
    apps = dp_apps()
    for a in apps.values():
        a.save(tmp / f"dp_{a.name}.xmix")
    dp = [
        "--enforce-eager",
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        a0,
        "--data-parallel-rpc-port",
        "13345",
    ]
    logs = [tmp / "dp_h0.log", tmp / "dp_h1.log"]
    head_env = {**env, "XMIX_RPC_TIMEOUT_S": str(RPC_TIMEOUT_S), "XMIX_SYNC_S": str(SYNC_S)}
    procs = [
        hosts.popen(
            0,
            xmix_serve(model, *dp, "--api-server-count", "2", "--host", a0, "--port", str(PORT))
            + keys
            + ["--app", str(tmp / "dp_steer.xmix"), "--app", str(tmp / "dp_probe.xmix")],
            logs[0],
            VLLM_CPU_OMP_THREADS_BIND="0",
            **head_env,
        ),
        hosts.popen(
            1,
            xmix_serve(
                model,
                *dp,
                "--data-parallel-start-rank",
                "1",
                "--headless",
                "--additional-config",
                json.dumps({"xmix": {"layers": [0, 1, 2]}}),
            ),
            logs[1],
            VLLM_CPU_OMP_THREADS_BIND="1",
            **env,
        ),
    ]
    try:
        rec["t"]["dp_start"] = wait_healthy(base, procs, logs)
        api = Api(base)
        data_parallel(api, ids_dp, tmp, rec)
        rec["t"]["dp_changes"] = time.time() - t0 - rec["t"]["dp_start"]
        faults(api, hosts, procs, ids_dp, tmp, rec)
    finally:
        for p in procs:
            hosts.stop(p, timeout=30)
        rec["dp_log"] = "\n".join(tail(x, 200_000) for x in logs)
    rec["t"]["dp"] = time.time() - t0
    return rec


def data_parallel(api: Api, ids: list, tmp: Path, rec: dict) -> None:
    """Items 3 and 4: the states through the head's control plane, each followed at once by
    the same requests on both ranks; the refused deploy; the acknowledged mode switch."""
    rec["dp_snap0"] = snapshot(api)
    rec["dp_plain"] = [outcome(api.complete(x, None, rank=1)) for x in ids]
    changes = {
        "extra": ("POST", "/xmix/v1/apps?mode=request", {"content": (tmp / "dp_extra.xmix")}),
        "patched": ("PATCH", "/xmix/v1/apps/extra", {"json": {"params": {"scale": EXTRA_SCALE}}}),
        "all": ("PATCH", "/xmix/v1/apps/extra", {"json": {"mode": "all"}}),
        "gone": ("DELETE", "/xmix/v1/apps/extra", {}),
    }
    rec["dp"] = {}
    for state, control in DP_STATES:
        if state in changes:
            method, path, kw = changes[state]
            if "content" in kw:
                kw = {"content": kw["content"].read_bytes()}
            r = api.call(method, path, **kw)
            rec["dp"][f"{state}_answer"] = (r.status_code, r.text)
        # right after the answer: both ranks, each request on a new connection
        rec["dp"][state] = [
            [outcome(api.complete(x, control, rank=rank)) for x in ids] for rank in (0, 1)
        ]
        rec["dp"][f"{state}_snap"] = snapshot(api)
    # undeployed: a request naming it is refused on both ranks, by either server
    rec["dp"]["gone_named"] = [
        api.complete(ids[0], WITH_EXTRA, rank=rank).status_code for rank in (0, 1)
    ]
    # refused on the remote rank only (host 1 places no site on layer 3)
    before = snapshot(api)
    r = api.call("POST", "/xmix/v1/apps", content=(tmp / "dp_late.xmix").read_bytes())
    rec["refused"] = (r.status_code, r.text, before, snapshot(api))
    fixed = xmix.App("late")  # the same name, on a layer both hosts place: nothing blocks it
    fixed.write("add", vector=torch.ones(D), scale=1.0).layers([2]).at("residual.post")
    fixed.save(tmp / "dp_late2.xmix")
    r = api.call("POST", "/xmix/v1/apps", content=(tmp / "dp_late2.xmix").read_bytes())
    rec["refused_then"] = (r.status_code, r.text, snapshot(api))
    api.call("DELETE", "/xmix/v1/apps/late")
    # item 4 across hosts: after PATCH mode=off answered, no request is admitted with the app
    rec["ack"] = acknowledged_off(api, ids[0], "steer")


def acknowledged_off(api: Api, ids: list, app: str, n: int = 24) -> dict:
    """PATCH mode=off, then ``n`` requests naming the app at once, each on a new connection,
    alternating ranks; then the app back on."""
    r = api.call("PATCH", f"/xmix/v1/apps/{app}", json={"mode": "off"})
    answered = (r.status_code, r.headers.get("x-xmix-server"))
    got: list = [None] * n

    def one(i):
        x = api.complete(ids, {"apps": [app]}, rank=i % 2, max_tokens=2)
        body = x.json()
        got[i] = (
            x.status_code,
            x.headers.get("x-xmix-server"),
            body.get("error", {}).get("message")
            if x.status_code != 200
            else [a["name"] for a in body["xmix_applied"]["apps"]],
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    back = api.call("PATCH", f"/xmix/v1/apps/{app}", json={"mode": "request"}).status_code
    return {"answered": answered, "requests": got, "back": back}


def traffic(api: Api, ids: list, stop: threading.Event, sink: list, rank: int) -> None:
    while not stop.is_set():
        t = time.monotonic()
        try:
            r = api.complete(ids, BASE, rank=rank, max_tokens=6)
            ok = r.status_code == 200 and bool(outcome(r)["reads"].get("probe"))
            sink.append((rank, r.status_code, ok, time.monotonic() - t))
        except httpx.HTTPError as e:
            sink.append((rank, repr(e), False, time.monotonic() - t))


def answering(api: Api, timeout: float = 120) -> float:
    """Seconds until every engine answers the status again through both API servers (after
    a link came back): each server has its own connection to host 1, whose TCP retransmits
    back off on their own, and waits at most SLOW_RPC_S for an engine it saw miss a deadline."""
    t0 = time.monotonic()
    fine: set[str] = set()
    while len(fine) < 2:
        assert time.monotonic() - t0 < timeout, "host 1 did not answer again"
        r = api.call("GET", "/xmix/v1/status")
        if r.status_code == 200 and not any(w.get("error") for w in r.json()["workers"]):
            fine.add(r.headers.get("x-xmix-server"))
        else:
            time.sleep(0.5)
    return time.monotonic() - t0


def faults(api: Api, hosts, procs, ids: list, tmp: Path, rec: dict) -> None:
    """Item 5, from runs: what a cut link and a killed remote engine do."""
    # -- a cut shorter than the RPC timeout, while requests run on both ranks: a PATCH
    # sent during the cut answers once the link is back
    stop, sink = threading.Event(), []
    threads = [threading.Thread(target=traffic, args=(api, ids[0], stop, sink, k)) for k in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    hosts.cut(1)
    t_cut = time.monotonic()
    res: dict = {}

    def patch():
        t = time.monotonic()
        r = api.call("PATCH", "/xmix/v1/apps/steer", json={"params": {"scale": 2.0}})
        res["patch"] = (r.status_code, r.text, time.monotonic() - t_cut, time.monotonic() - t)

    pt = threading.Thread(target=patch)
    time.sleep(0.5)
    pt.start()
    # TCP backs its retransmits off while the link is down: the first answer can come as late
    # again as the cut lasted, so a cut of 3.5 s stays well inside the 10 s RPC timeout
    time.sleep(3.0)
    hosts.restore(1)
    res["cut_s"] = time.monotonic() - t_cut
    pt.join(timeout=120)
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    res["traffic"] = list(sink)
    res["answers_again_s"] = answering(api)
    res["snap"] = snapshot(api)
    rec["short_cut"] = res

    # -- a cut longer than the RPC timeout: a deploy sent during it fails with the reason
    # and leaves nothing deployed anywhere once the link is back; the head keeps serving
    res = {}
    hosts.cut(1)
    t_cut = time.monotonic()
    t = time.monotonic()
    r = api.call("POST", "/xmix/v1/apps", content=(tmp / "dp_extra.xmix").read_bytes())
    res["deploy"] = (r.status_code, r.text, time.monotonic() - t)
    t = time.monotonic()
    r = api.complete(ids[0], BASE, rank=0, max_tokens=4)
    res["rank0_during"] = (r.status_code, time.monotonic() - t)
    t = time.monotonic()
    r = api.call("GET", "/xmix/v1/apps")
    res["list_during"] = (r.status_code, [a["name"] for a in r.json().get("apps", [])])
    res["list_s"] = time.monotonic() - t
    time.sleep(max(0.0, RPC_TIMEOUT_S + 4.0 - (time.monotonic() - t_cut)))
    hosts.restore(1)
    res["cut_s"] = time.monotonic() - t_cut
    res["answers_again_s"] = answering(api)  # what was queued for host 1 arrives, in order
    res["after"] = snapshot(api)
    r = api.call("POST", "/xmix/v1/apps", content=(tmp / "dp_extra.xmix").read_bytes())
    res["redeploy"] = (r.status_code, r.text)
    res["redeployed"] = snapshot(api)
    res["undeploy"] = api.call("DELETE", "/xmix/v1/apps/extra").status_code
    rec["long_cut"] = res

    # -- the remote engine killed in the middle of a deploy: frozen first (a hung host),
    # the deploy sent, then killed
    res = {}
    pid = engine_core_pid(hosts, 1)
    os.kill(pid, signal.SIGSTOP)
    done: dict = {}

    def deploy():
        t = time.monotonic()
        r = api.call("POST", "/xmix/v1/apps", content=(tmp / "dp_extra.xmix").read_bytes())
        done["deploy"] = (r.status_code, r.text, time.monotonic() - t)

    dt = threading.Thread(target=deploy)
    dt.start()
    time.sleep(1.5)
    os.kill(pid, signal.SIGKILL)
    dt.join(timeout=120)
    res["deploy"] = done.get("deploy")
    t = time.monotonic()
    r = api.call("GET", "/xmix/v1/apps", timeout=60)
    res["list"] = (r.status_code, [a["name"] for a in r.json().get("apps", [])])
    res["list_s"] = time.monotonic() - t
    r = api.call("GET", "/xmix/v1/status", timeout=60)
    res["status"] = (r.status_code, r.json().get("workers"))
    res["health"] = api.call("GET", "/health", timeout=30).status_code
    r = api.complete(ids[0], BASE, rank=0, max_tokens=4, timeout=60)
    res["rank0"] = r.status_code
    r = api.complete(ids[0], {"apps": ["extra"]}, rank=0, max_tokens=4, timeout=60)
    res["named"] = (r.status_code, r.text[:300])
    t = time.monotonic()
    r = api.call("PATCH", "/xmix/v1/apps/steer", json={"params": {"scale": 4.0}}, timeout=120)
    res["patch_after"] = (r.status_code, r.text[:400], time.monotonic() - t)
    t = time.monotonic()
    try:  # vLLM's headless node ends once its engine died
        res["remote_exit"] = (procs[1].wait(timeout=60), time.monotonic() - t)
    except Exception as e:
        res["remote_exit"] = (repr(e), time.monotonic() - t)
    rec["killed"] = res


# ---------------------------------------------------------------------------- PP
def test_pipeline_parallel_across_hosts_matches_one_engine(runs):
    ref = runs["ref"]["pp"]
    assert "Traceback" not in runs["pp_log"], runs["pp_log"][-4000:]
    for (code, text), want, ctl in zip(runs["pp"], ref, PP_CONTROLS):
        assert code == 200, text
        o = outcome_of_text(text)
        assert_same((o["ids"], o["reads"]), want, f"PP across hosts, control {ctl}")
    # the reads of both stages came back, and every writing app changes the answer
    assert set(ref[6][1]) == {"probe", "final", "gated", "latched"}
    for i in (1, 2, 4, 5):
        assert ref[i][0] != ref[0][0], PP_CONTROLS[i]
    g = ref[4][1]["gated"]["g"][1]
    assert (g >= 0.5).any() and (g < 0.5).any()  # the gate both fired and did not


def outcome_of_text(text: str) -> dict:
    body = json.loads(text)
    return {
        "ids": body["choices"][0]["token_ids"],
        "reads": _norm(xmix.decode_results(body["xmix"])) if body.get("xmix") else {},
    }


def test_pipeline_stages_ran_on_two_hosts_and_agree(runs):
    snap = runs["pp_snap"]
    ws = snap["workers"]
    assert [w["where"]["pp_rank"] for w in ws] == [0, 1]
    assert len({w["where"]["host"] for w in ws}) == 2
    assert [w["where"]["address"] for w in ws] == runs["addrs"]
    for w in ws:  # every stage holds every app; the ledger copies are one
        assert w["apps"] == snap["registry"]
        assert w["ledger"] == ws[0]["ledger"] and w["ledger"]["rev"] == len(pp_apps())
        assert w["steps"] > 0


# ---------------------------------------------------------------------------- DP
def test_data_parallel_across_hosts_matches_one_engine_on_both_ranks(runs):
    ref = runs["ref"]
    for got, want in zip(runs["dp_plain"], ref["plain"]):
        assert_same((got["ids"], got["reads"]), want, "plain request on the remote rank")
    for rank in (0, 1):
        for got, want in zip(runs["dp"]["base"][rank], ref["base"]):
            assert_same((got["ids"], got["reads"]), want, f"steer+probe on rank {rank}")
            assert got["reads"]["probe"]["p2"][1].size > 0  # reads came back from that host
    assert ref["base"][0][0] != ref["plain"][0][0]  # the steer changes the answer


def test_requests_ran_where_their_rank_is(runs):
    before, after = runs["dp_snap0"]["workers"], runs["dp"]["base_snap"]["workers"]
    assert [w["where"]["dp_rank"] for w in after] == [0, 1]
    assert len({w["where"]["host"] for w in after}) == 2
    # rank 1's worker (host 1) ran the plain requests and its share of the base ones
    assert after[1]["steps"] - before[1]["steps"] >= 2 * G
    assert after[0]["steps"] - before[0]["steps"] >= G


def test_changes_through_the_head_are_seen_on_every_rank_at_once(runs):
    ref, dp = runs["ref"], runs["dp"]
    assert dp["extra_answer"][0] == 201, dp["extra_answer"]
    assert dp["patched_answer"][0] == 200 and dp["all_answer"][0] == 200, dp
    assert dp["gone_answer"][0] == 200, dp["gone_answer"]
    servers = set()
    for state, _ in DP_STATES:
        for rank in (0, 1):
            for got, want in zip(dp[state][rank], ref[state]):
                assert_same((got["ids"], got["reads"]), want, f"state {state}, rank {rank}")
                servers.add(got["server"])
                names = [a["name"] for a in got["applied"]["apps"]]
                assert ("extra" in names) == (state in ("extra", "patched", "all")), names
                assert got["applied"]["changed"] == [], got["applied"]
    assert len(servers) == 2  # both API servers admitted requests
    # each change made a difference, so a rank holding the old state would have failed above
    assert ref["extra"][0][0] != ref["base"][0][0]
    assert ref["patched"][0][0] != ref["extra"][0][0]
    assert [t for t, _ in ref["gone"]] == [t for t, _ in ref["base"]]
    assert dp["gone_named"] == [400, 400]


def test_status_and_ledger_agree_on_both_hosts(runs):
    snaps = [runs["dp_snap0"]] + [runs["dp"][f"{s}_snap"] for s, _ in DP_STATES]
    revs = []
    for snap in snaps:
        ws = snap["workers"]
        assert len(ws) == 2 and len({w["where"]["host"] for w in ws}) == 2
        for w in ws:
            assert w["apps"] == snap["registry"], (w["where"], w["apps"], snap["registry"])
            assert w["ledger"] == ws[0]["ledger"], [x["ledger"] for x in ws]
        revs.append(ws[0]["ledger"]["rev"])
    assert revs == sorted(revs) and revs[-1] == revs[0] + 4  # one entry per change


def test_a_deploy_refused_on_the_remote_rank_is_rolled_back_everywhere(runs):
    code, text, before, after = runs["refused"]
    assert code == 422, text
    msg = json.loads(text)["error"]["message"]
    assert "'late'" in msg and "layers.3.residual.post" in msg and "did not place" in msg
    assert after == before  # nothing on either host, no ledger entry, the same registry
    code, text, snap = runs["refused_then"]
    assert code == 201, text  # nothing left prepared under that name anywhere
    assert all(("late" in {a[0] for a in w["apps"]}) for w in snap["workers"])


def test_an_acknowledged_change_is_seen_by_every_later_request_across_hosts(runs):
    ack = runs["ack"]
    assert ack["answered"][0] == 200 and ack["back"] == 200
    codes = [(c, m) for c, _, m in ack["requests"]]
    assert all(c == 400 and "switched off" in m for c, m in codes), codes
    assert len({sid for _, sid, _ in ack["requests"]}) == 2  # through both API servers


# ---------------------------------------------------------------------------- faults
def test_a_link_cut_for_seconds_delays_and_loses_nothing(runs):
    res = runs["short_cut"]
    code, text, since_cut, _ = res["patch"]
    assert code == 200, text
    assert since_cut >= res["cut_s"] - 0.5  # it answered once host 1 was back
    bad = [x for x in res["traffic"] if not x[2]]
    assert not bad, bad
    assert {x[0] for x in res["traffic"]} == {0, 1}
    assert max(x[3] for x in res["traffic"] if x[0] == 1) > 2.0  # rank 1 waited for the link
    ws = res["snap"]["workers"]
    for w in ws:
        assert w["apps"] == res["snap"]["registry"] and w["ledger"] == ws[0]["ledger"]
    assert dict(dict((a[0], a[3]) for a in ws[1]["apps"])["steer"])["#0.scale"] == 2.0


def test_a_link_cut_longer_than_the_timeout_fails_the_change_and_leaves_nothing_half_done(runs):
    res = runs["long_cut"]
    code, text, took = res["deploy"]
    assert code == 503, text
    msg = json.loads(text)["error"]["message"]
    assert "data-parallel rank 1 did not answer" in msg and "nothing was deployed" in msg, msg
    assert took < RPC_TIMEOUT_S + 15, took
    assert res["rank0_during"][0] == 200
    assert res["list_during"][0] == 200 and "extra" not in res["list_during"][1]
    # The 200 is what shows the list does not wait for engine 1: a read that asked it would
    # have ended 503 (EngineUnreachable, SLOW_RPC_S once engine 1 missed the deploy's
    # deadline). The time only bounds the wait below a deadline: under 0.1 s on a quiet
    # machine, 5.1 s once in CI beside another engine test (2026-12-05).
    assert res["list_s"] < RPC_TIMEOUT_S
    assert res["cut_s"] > RPC_TIMEOUT_S
    ws = res["after"]["workers"]
    for w in ws:  # the deploy reached host 1 after the link came back, then its rollback
        assert "extra" not in {a[0] for a in w["apps"]}, w
        assert w["apps"] == res["after"]["registry"] and w["ledger"] == ws[0]["ledger"]
    assert res["redeploy"][0] == 201, res["redeploy"]
    assert all("extra" in {a[0] for a in w["apps"]} for w in res["redeployed"]["workers"])
    assert res["undeploy"] == 200


def test_the_remote_engine_killed_in_the_middle_of_a_deploy(runs):
    res = runs["killed"]
    assert res["deploy"] is not None, "the deploy never answered"
    code, text, took = res["deploy"]
    assert code == 503, text
    assert "data-parallel rank 1 did not answer" in json.loads(text)["error"]["message"]
    assert took < RPC_TIMEOUT_S + 15, took
    assert res["list"][0] == 200 and "extra" not in res["list"][1]
    assert res["list_s"] < 10
    code, workers = res["status"]
    assert code == 200 and len(workers) == 2
    assert "extra" not in {a["name"] for a in workers[0]["apps"]}  # nothing half-deployed
    assert workers[1]["engine"] == 1 and "did not answer" in workers[1]["error"]
    # what vLLM does: the head stays healthy and keeps serving on its own rank
    assert res["health"] == 200 and res["rank0"] == 200
    assert res["named"][0] == 400 and "extra" in res["named"][1]
    assert res["patch_after"][0] == 503 and "rank 1" in res["patch_after"][1]
    assert res["remote_exit"][0] is not None


def test_timings(runs):
    """What the runs measured (docs/serving.md, Scale-out, "Faults across hosts")."""
    print("multi-node timings (s):", {k: round(v) for k, v in runs["t"].items()})
    s, lc, k = runs["short_cut"], runs["long_cut"], runs["killed"]
    lat = {r: max((x[3] for x in s["traffic"] if x[0] == r), default=0) for r in (0, 1)}
    print(
        f"short cut {s['cut_s']:.1f}s: PATCH answered {s['patch'][0]} {s['patch'][2]:.1f}s "
        f"after the cut began; slowest request rank 0 {lat[0]:.1f}s, rank 1 {lat[1]:.1f}s; "
        f"{len(s['traffic'])} requests; host 1 answering again {s['answers_again_s']:.1f}s "
        "after the traffic stopped"
    )
    print(
        f"long cut {lc['cut_s']:.1f}s: deploy {lc['deploy'][0]} after {lc['deploy'][2]:.1f}s; "
        f"rank-0 request {lc['rank0_during'][0]} in {lc['rank0_during'][1]:.1f}s; app list "
        f"{lc['list_during'][0]} in {lc['list_s']:.1f}s; host 1 answering "
        f"{lc['answers_again_s']:.1f}s after the link came back"
    )
    print(
        f"killed: deploy {k['deploy'][0]} after {k['deploy'][2]:.1f}s; list {k['list'][0]} in "
        f"{k['list_s']:.1f}s; health {k['health']}; rank 0 {k['rank0']}; PATCH after "
        f"{k['patch_after'][0]} in {k['patch_after'][2]:.1f}s; headless node exit "
        f"{k['remote_exit'][0]} after {k['remote_exit'][1]:.1f}s"
    )
    print("deploy during the long cut:", json.loads(lc["deploy"][1])["error"]["message"])
