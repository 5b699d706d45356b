"""Scale-out on vLLM's own engine (docs/serving.md, "Scale-out"): several API servers
(``--api-server-count 2``, one engine) and data parallelism (``--data-parallel-size 2``, one
API server in front). One server start per configuration, in one module fixture that runs
every scenario and stops each server before the next starts (one engine set at a time on a
2-core machine); the tests then check what was recorded.

Oracle: the same requests through the single-engine configuration (the two API servers share
one engine): tokens exact, reads within 1e-4 relative.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import numpy as np
import pytest
import torch

import xmix
from serve_util import xmix_server
from xmix.integrations.vllm.state_dir import StateDir

pytestmark = pytest.mark.engine

D = 256
PROMPTS = ["Once upon a time", "The cat sat on", "In the beginning", "A B C D"]
CONTROL = {"xmix_apps": ["steer", "probe"]}


def apps(tmp):
    g = torch.Generator().manual_seed(14)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(D, generator=g), scale=4.0).layers([1]).at(
        "residual.post"
    )
    probe = xmix.App("probe")
    probe.read("probe", weight=torch.randn(D, generator=g) / 16, bias=0.0).layers([2]).at(
        "residual.post"
    ).named("p2")
    late = xmix.App("late")
    late.write("add", vector=torch.randn(D, generator=g), scale=8.0).layers([2]).at("residual.post")
    late.save(tmp / "late.xmix")
    return [steer.save(tmp / "steer.xmix"), probe.save(tmp / "probe.xmix")], tmp / "late.xmix"


def fresh(s, method, path, **kw):
    """One request on a new connection: vLLM's API servers share the port (SO_REUSEPORT), so
    each new connection may reach another server; the answer names the one it reached."""
    with httpx.Client(
        base_url=s["base"], headers={"Authorization": f"Bearer {s['key']}"}, timeout=120
    ) as c:
        r = c.request(method, path, **kw)
    return r, r.headers.get("x-xmix-server")


def complete(s, prompt, xargs, max_tokens=6):
    return fresh(
        s,
        "POST",
        "/v1/completions",
        json={
            "model": s["name"],
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "vllm_xargs": xargs,
        },
    )


def through(s, server_id, fn, tries=64):
    """fn() until the answer came from ``server_id`` (other answers are kept too)."""
    seen = []
    for _ in range(tries):
        r, sid = fn()
        seen.append((r, sid))
        if sid == server_id:
            return r, seen
    raise AssertionError(f"no answer from server {server_id} in {tries} connections")


def deploy_work(s, server_ids) -> dict:
    """Per API server: its own deploy work and its engine workers' (``/xmix/v1/status``)."""
    out = {}
    for sid in server_ids:
        r, _ = through(s, sid, lambda: fresh(s, "GET", "/xmix/v1/status"))
        body = r.json()
        out[sid] = {
            "server": body["server"]["deploy_work"],
            "workers": [w["stats"]["deploy_work"] for w in body["workers"]],
        }
    return out


def outcome(r):
    body = r.json()
    ch = body["choices"][0]
    return {
        "ids": ch.get("token_ids"),
        "text": ch["text"],
        "p2": (body.get("xmix") or {}).get("probe", {}).get("p2", {}).get("values"),
        "applied": body.get("xmix_applied"),
    }


def stream_while(s, stop: threading.Event, sink: list):
    """Requests streaming through the server until ``stop``: every one must finish."""
    i = 0
    while not stop.is_set():
        try:
            with httpx.Client(
                base_url=s["base"], headers={"Authorization": f"Bearer {s['key']}"}, timeout=120
            ) as c:
                with c.stream(
                    "POST",
                    "/v1/completions",
                    json={
                        "model": s["name"],
                        "prompt": PROMPTS[i % len(PROMPTS)],
                        "max_tokens": 8,
                        "temperature": 0.0,
                        "stream": True,
                        "vllm_xargs": {"xmix_apps": ["steer"]},
                    },
                ) as r:
                    lines = [x for x in r.iter_lines() if x]
                    # a lost request ends without a finish reason, or with an error event
                    done = (
                        r.status_code == 200
                        and any(_finished(x) for x in lines)
                        and lines[-1] == "data: [DONE]"
                        and not any(x.startswith('data: {"error"') for x in lines)
                    )
                    sink.append((r.status_code, done, r.headers.get("x-xmix-server")))
        except httpx.HTTPError as e:
            sink.append((None, False, repr(e)))
        i += 1


def _finished(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    body = json.loads(line[len("data: ") :])
    return any(c.get("finish_reason") in ("length", "stop") for c in body.get("choices") or ())


def changes_while_streaming(s, late):
    """Deploy, patch and undeploy while requests stream; returns what the streams saw."""
    stop, sink = threading.Event(), []
    threads = [threading.Thread(target=stream_while, args=(s, stop, sink)) for _ in range(2)]
    for t in threads:
        t.start()
    codes = []
    time.sleep(1.0)
    for method, path, kw in [
        ("POST", "/xmix/v1/apps", {"content": late.read_bytes()}),
        ("PATCH", "/xmix/v1/apps/steer", {"json": {"params": {"scale": 2.0}}}),
        ("DELETE", "/xmix/v1/apps/late", {}),
        ("PATCH", "/xmix/v1/apps/steer", {"json": {"params": {"scale": 4.0}}}),
    ]:
        r, _ = fresh(s, method, path, **kw)
        codes.append(r.status_code)
        time.sleep(0.5)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return codes, sink


@contextlib.contextmanager
def env(**values):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in values.items():
            mp.setenv(k, v)
        yield


def acknowledged_off(s, app: str, n: int = 24, rounds: int = 6) -> dict:
    """Issue 32 item 4: PATCH mode=off, then at once requests naming the app, each on a new
    connection, four at a time, in rounds of ``n`` until both servers admitted some (at most
    ``rounds``); then the app back on. Before the fix, a server that had not followed the ledger
    yet admitted them with the app (1 of 24 in a held-out check at the default XMIX_SYNC_S).
    The two servers share one listening socket, and which accepts a connection is the
    kernel's choice: one after the other, 24 requests all went to one server in a loaded
    fresh-clone run, so they overlap, and the rounds go on until both were asked."""
    from concurrent.futures import ThreadPoolExecutor

    r, answered_by = fresh(s, "PATCH", f"/xmix/v1/apps/{app}", json={"mode": "off"})
    answered = (r.status_code, answered_by)

    def one(i):
        x, sid = complete(s, PROMPTS[i % len(PROMPTS)], {"xmix_apps": [app]}, max_tokens=2)
        body = x.json()
        return (
            x.status_code,
            sid,
            body["error"]["message"]
            if x.status_code != 200
            else [a["name"] for a in body["xmix_applied"]["apps"]],
        )

    got: list = []
    with ThreadPoolExecutor(4) as pool:
        for _ in range(rounds):
            got += pool.map(one, range(len(got), len(got) + n))
            if len({sid for _, sid, _ in got}) >= 2:
                break
    back = fresh(s, "PATCH", f"/xmix/v1/apps/{app}", json={"mode": "request"})[0].status_code
    return {"answered": answered, "requests": got, "back": back}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale_out")
    files, late = apps(tmp)
    rec: dict = {}
    t0 = time.time()
    # --- two API servers in front of one engine; each follows the ledger every second (the
    # default is 0.25 s): a wider window for a stale admission to show (acknowledged_off)
    with (
        env(XMIX_SYNC_S="1.0"),
        xmix_server(
            tmp,
            files,
            "--host",
            "127.0.0.1",
            "--api-server-count",
            "2",
            "--max-num-seqs",
            "8",
            "--enable-prompt-tokens-details",
            "--xmix-state-dir",
            str(tmp / "state-api"),
        ) as s,
    ):
        ids = set()
        for _ in range(64):
            ids.add(fresh(s, "GET", "/xmix/v1/apps")[1])
            if len(ids) == 2:
                break
        rec["api_ids"] = sorted(ids)
        rec["api_ref"] = [outcome(complete(s, p, CONTROL)[0]) for p in PROMPTS]
        other = {rec["api_ids"][0]: rec["api_ids"][1], rec["api_ids"][1]: rec["api_ids"][0]}
        # a steered prompt through one server, then through the other: the same cache salt
        # (keyed with the engine's secret, fetched by both), so its blocks are reused
        long = "Cache shared across servers: " + " ".join(f"w{i % 17} x{i % 5}" for i in range(90))
        r, x = complete(s, long, {"xmix_apps": ["steer"]}, max_tokens=1)
        r, _ = through(s, other[x], lambda: complete(s, long, {"xmix_apps": ["steer"]}, 1))
        rec["salt_across"] = (
            r.json()["usage"]["prompt_tokens"],
            (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
        )
        # a deploy through one server (whichever the connection reached: a POST is not
        # repeated to pick one), used at once through the other; what each process did for
        # it (app files parsed, apps lowered, programs decoded) from each server's status
        rec["work_before"] = deploy_work(s, rec["api_ids"])
        r, a = fresh(s, "POST", "/xmix/v1/apps?mode=request", content=late.read_bytes())
        rec["deploy_a"] = (r.status_code, r.json())
        rec["work_after"] = deploy_work(s, rec["api_ids"])
        rec["deployed_by"] = a
        r, seen = through(s, other[a], lambda: complete(s, PROMPTS[0], {"xmix_apps": ["late"]}))
        rec["late_via_b"] = [
            (x.status_code, outcome(x) if x.status_code == 200 else x.text, sid) for x, sid in seen
        ]
        # the app list through the other names it, with the deploying server's version
        r, _ = through(s, other[a], lambda: fresh(s, "GET", "/xmix/v1/apps"))
        rec["list_b"] = r.json()["apps"]
        # patched through one, seen through the other (the new default in its provenance)
        r, b = fresh(s, "PATCH", "/xmix/v1/apps/late", json={"params": {"scale": 1.0}})
        rec["patch_b"] = r.status_code
        # the other knows "late" already, so it picks the new default up by following the
        # ledger (every XMIX_SYNC_S = 0.25 s), not at admission: docs/serving.md
        time.sleep(1.0)
        r, _ = through(s, other[b], lambda: complete(s, PROMPTS[0], {"xmix_apps": ["late"]}))
        rec["patched_via_a"] = outcome(r)
        # undeployed through one; at once through the other, a request naming it is refused
        # (it had caught up) or admitted against the gone version: left out and named
        r, u = fresh(s, "DELETE", "/xmix/v1/apps/late")
        rec["undeploy_a"] = r.status_code
        r, seen = through(s, other[u], lambda: complete(s, PROMPTS[0], {"xmix_apps": ["late"]}))
        rec["gone_via_b"] = [(x.status_code, x.json(), sid) for x, sid in seen]
        rec["api_stream"] = changes_while_streaming(s, late)
        rec["api_ack"] = acknowledged_off(s, "steer")
        rec["api_apps"] = fresh(s, "GET", "/xmix/v1/apps")[0].json()["apps"]
        rec["api_log"] = s["log"].read_text()
    rec["api_state"] = StateDir.check(tmp / "state-api")
    rec["t_api"] = time.time() - t0
    t0 = time.time()
    # --- two data-parallel engines behind one API server; on the CPU engine each engine binds
    # its OpenMP threads to a core of its own (NOTES: without it, "Not enough allowed NUMA nodes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        with xmix_server(
            tmp,
            files,
            "--host",
            "127.0.0.1",
            "--data-parallel-size",
            "2",
            "--api-server-count",
            "1",
            "--max-num-seqs",
            "8",
            "--xmix-state-dir",
            str(tmp / "state-dp"),
        ) as s:
            rec["dp_out"] = [outcome(complete(s, p, CONTROL)[0]) for p in PROMPTS * 2]
            r, _ = fresh(s, "GET", "/xmix/v1/status")
            rec["dp_status"] = r.json()
            rec["dp_stream"] = changes_while_streaming(s, late)
            r, _ = fresh(s, "GET", "/xmix/v1/status")
            rec["dp_status_after"] = r.json()
            rec["dp_apps"] = fresh(s, "GET", "/xmix/v1/apps")[0].json()["apps"]
            rec["dp_log"] = s["log"].read_text()
    rec["dp_state"] = StateDir.check(tmp / "state-dp")
    rec["t_dp"] = time.time() - t0
    return rec


def test_two_api_servers_both_answer(runs):
    assert len(runs["api_ids"]) == 2, runs["api_ids"]


def test_both_api_servers_salt_a_configuration_alike(runs):
    """Issue 33 item 1: cache salts are keyed with a per-deployment secret; every API server
    fetches the engine's, so a steered prompt cached through one is reused through the other."""
    prompt, cached = runs["salt_across"]
    assert prompt >= 256 and cached >= 256, runs["salt_across"]


def test_deploy_through_one_server_is_used_through_the_other(runs):
    code, info = runs["deploy_a"]
    assert code == 201, info
    last = runs["late_via_b"][-1]
    assert last[0] == 200, last
    applied = last[1]["applied"]
    assert [(x["name"], x["version"]) for x in applied["apps"]] == [("late", info["version"])]
    assert all(c == 200 for c, _, _ in runs["late_via_b"]), runs["late_via_b"]
    assert [a["name"] for a in runs["list_b"]] == ["steer", "probe", "late"]
    assert runs["list_b"][-1]["version"] == info["version"]


def test_a_deploy_is_parsed_and_lowered_once_across_api_servers_and_engines(runs):
    """Issue 30: the API server the deploy reached parses and lowers the app; the engine's
    worker and the other API server decode its lowered program (lang/program_codec.py) and lower
    nothing. Before: the worker and the other server parsed and lowered it again (3 of each)."""
    before, after = runs["work_before"], runs["work_after"]
    a = runs["deployed_by"]
    (b,) = [sid for sid in runs["api_ids"] if sid != a]

    def delta(sid, who):
        return {k: v - before[sid][who][k] for k, v in after[sid][who].items()}

    assert delta(a, "server") == {"app_parses": 1, "lowerings": 1, "program_decodes": 0}
    assert delta(b, "server") == {"app_parses": 0, "lowerings": 0, "program_decodes": 1}
    workers_before, workers_after = before[a]["workers"], after[a]["workers"]
    assert len(workers_after) == 1  # one engine, one worker
    for w0, w1 in zip(workers_before, workers_after):
        assert {k: v - w0[k] for k, v in w1.items()} == {
            "app_parses": 0,
            "lowerings": 0,
            "program_decodes": 1,
        }


def test_patch_through_one_server_reaches_requests_through_the_other(runs):
    assert runs["patch_b"] == 200
    (late,) = runs["patched_via_a"]["applied"]["apps"]
    assert list(late["params"].values()) == [1.0], late  # the default set through b


def test_undeploy_through_one_server_never_faults_a_request_through_the_other(runs):
    assert runs["undeploy_a"] == 200
    for code, body, _ in runs["gone_via_b"]:
        if code == 400:  # b had caught up: refused before the engine, with the reason
            assert "unknown app 'late'" in body["error"]["message"], body
        else:  # b admitted it against the gone version: left out and named, not a fault
            assert code == 200, body
            assert "late" in body["xmix_applied"]["changed"], body


def _no_request_lost(stream):
    codes, sink = stream
    assert codes == [201, 200, 200, 200], codes
    assert len(sink) >= 2
    bad = [x for x in sink if x[:2] != (200, True)]
    assert not bad, bad


def test_changes_while_streaming_lose_no_request_two_api_servers(runs):
    _no_request_lost(runs["api_stream"])
    assert len({sid for _, _, sid in runs["api_stream"][1]}) == 2  # both servers streamed


def test_data_parallel_matches_one_engine(runs):
    ref = runs["api_ref"] * 2
    for got, want in zip(runs["dp_out"], ref):
        assert got["ids"] == want["ids"] and got["text"] == want["text"]
        np.testing.assert_allclose(
            np.asarray(got["p2"], dtype=np.float64),
            np.asarray(want["p2"], dtype=np.float64),
            rtol=1e-4,
            atol=0,
        )
        assert [a["name"] for a in got["applied"]["apps"]] == ["steer", "probe"]


def test_data_parallel_change_reaches_every_engine(runs):
    # one answer per worker of each engine: two engines, one worker each
    before, after = runs["dp_status"]["workers"], runs["dp_status_after"]["workers"]
    assert len(before) == 2 and len(after) == 2
    for w in before:
        assert sorted(a["name"] for a in w["apps"]) == ["probe", "steer"]
    for w in after:  # late deployed and undeployed, steer patched back: the same on both
        assert sorted(a["name"] for a in w["apps"]) == ["probe", "steer"]
    # both engines served requests (vLLM's load balancer spreads them)
    assert all(w["stats"].get("steps", 1) for w in after)


def test_changes_while_streaming_lose_no_request_data_parallel(runs):
    _no_request_lost(runs["dp_stream"])
    assert "Traceback" not in runs["dp_log"] and "Traceback" not in runs["api_log"]
    print(f"two API servers: {runs['t_api']:.0f}s, data parallel: {runs['t_dp']:.0f}s")


def test_an_acknowledged_change_is_seen_by_every_later_request_two_api_servers(runs):
    """After PATCH mode=off answered 200, no request is admitted with the app, whichever
    server admits it (tests/server/test_multi_node.py checks the same across hosts)."""
    ack = runs["api_ack"]
    assert ack["answered"][0] == 200 and ack["back"] == 200
    got = [(c, m) for c, _, m in ack["requests"]]
    assert all(c == 400 and "switched off" in m for c, m in got), got
    assert len({sid for _, sid, _ in ack["requests"]}) == 2  # both servers admitted some


@pytest.mark.parametrize("which", ["api", "dp"])
def test_one_worker_writes_the_state_directory(runs, which):
    """docs/serving.md, State directory: changes through either API server, with one or two
    engines, are written by one process (the first worker of the first engine) into one
    directory, which holds what the servers answered."""
    log = runs[f"{which}_log"]
    assert log.count("(this worker writes it)") == 1, which  # a second writer could not lock it
    st = runs[f"{which}_state"]
    want = {a["name"]: (a["version"], a["mode"], a["params"]) for a in runs[f"{which}_apps"]}
    got = {
        n: (a.version, a.mode, {**want[n][2], **a.params} if n in want else a.params)
        for n, a in st.apps.items()
    }
    assert got == want
    assert st.apps["steer"].params == {"#0.scale": 4.0}  # the last PATCH, by its canonical name
