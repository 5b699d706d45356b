"""The state directory's writer without an engine (state_dir.py; docs/serving.md, "State
directory"): every change survives a reopen; a crash (SIGKILL of the writing process, in a
forked child) at every named point of a deploy, a patch, an undeploy and a compaction leaves
the change whole or absent, never half; a cut journal tail is dropped; anything else that does
not verify refuses the start naming the file.

Oracle: a model of the state kept by hand in the test (a dict per app: file digest, mode,
version, locks, changed parameters), never the writer's own reading of it."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal

import pytest
import torch

import xmix
from xmix.integrations.vllm import state_dir as S
from xmix.integrations.vllm.state_dir import POINTS, StateDir, StateError
from xmix.integrations.vllm.worker.ledger import Ledger

D = 64


def app_bytes(name: str, scale: float = 1.0) -> bytes:
    a = xmix.App(name)
    a.write("add", vector=torch.full((D,), scale), scale=scale).layers([1]).at("residual.post")
    return a.to_bytes()


A, B, C = app_bytes("a"), app_bytes("b", 2.0), app_bytes("c", 3.0)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() + ".xmix"


def deploy(name, data, version, mode="request", locked=False):
    return {
        "kind": "deploy",
        "name": name,
        "data": data,
        "mode": mode,
        "version": version,
        "locked": locked,
    }


def patch(name, mode=None, params=None, locked=None):
    return {"kind": "patch", "name": name, "mode": mode, "params": params, "locked": locked}


def undeploy(name):
    return {"kind": "undeploy", "name": name}


def model_after(model: dict, e: dict) -> dict:
    """The oracle: the state a change leads to, by hand."""
    m = {k: {**v, "params": dict(v["params"])} for k, v in model.items()}
    if e["kind"] == "deploy":
        m[e["name"]] = {
            "file": digest(e["data"]),
            "mode": e["mode"],
            "version": e["version"],
            "locked": e["locked"] or False,
            "params": {},
        }
    elif e["kind"] == "patch":
        a = m[e["name"]]
        if e["mode"] is not None:
            a["mode"] = e["mode"]
        a["params"].update(e["params"] or {})
        if e["locked"] is not None:
            a["locked"] = e["locked"]
    else:
        del m[e["name"]]
    return m


def on_disk(d) -> dict:
    """What a start would read now, while the writer still holds the lock."""
    st = StateDir(d)
    st._load()
    return seen(st)


def seen(st: StateDir) -> dict:
    return {
        n: {
            "file": a.file,
            "mode": a.mode,
            "version": a.version,
            "locked": a.locked,
            "params": a.params,
        }
        for n, a in st.apps.items()
    }


BASE = [
    deploy("a", A, 1),
    deploy("b", B, 2, "all", ["#0.scale"]),
    patch("a", params={"#0.scale": 0.5}),
]
# one change of each kind, on top of BASE
CHANGES = {
    "deploy": deploy("c", C, 3, "request", True),
    "patch": patch("b", mode="off", params={"#0.scale": -1.0}, locked=False),
    "undeploy": undeploy("a"),
}


def base_dir(tmp_path):
    d = tmp_path / "state"
    st = StateDir.open(d)
    model: dict = {}
    for e in BASE:
        assert st.save(e) is True
        model = model_after(model, e)
    st.close()
    return d, model


def test_changes_survive_a_reopen_in_order(tmp_path):
    d, model = base_dir(tmp_path)
    st = StateDir.open(d)
    assert seen(st) == model
    assert list(st.apps) == ["a", "b"]  # deployment order
    for e in CHANGES.values():
        assert st.save(e) is True
        model = model_after(model, e)
    # what the state holds already is not written again (a restore deploying it again)
    assert st.save(deploy("c", C, 3, "request", True)) is False
    assert st.save(patch("b", mode="off", params={"#0.scale": -1.0})) is False
    assert st.save(undeploy("a")) is False
    lines = (d / "journal.jsonl").read_bytes().count(b"\n")
    st.close()
    assert lines == 3
    again = StateDir.open(d)
    assert seen(again) == model
    assert list(again.apps) == ["b", "c"]
    # only the app files the state names are kept (a's went with its undeploy)
    assert sorted(p.name for p in (d / "apps").iterdir()) == sorted([digest(B), digest(C)])
    # the files are the bytes that were deployed
    assert (d / "apps" / digest(C)).read_bytes() == C
    again.close()


def test_floors_start_a_restart_above_every_epoch_and_version_before(tmp_path):
    # By hand: the first start (an empty directory) puts the bound at 0 + 1; BASE's 3 changes
    # can move a frontend's epoch by one each: 4. Versions: the highest deployed, 2.
    d, _ = base_dir(tmp_path)
    st = StateDir.open(d)
    assert (st.epoch_floor, st.version_floor) == (4 + 1, 2)
    st.close()
    st = StateDir.open(d)
    # the second start's restore deploys and patches 2 apps (up to 4 more): 5 + 4, then + 1
    assert (st.epoch_floor, st.version_floor) == (5 + 4 + 1, 2)
    plan = st.plan()
    assert [a["name"] for a in plan["apps"]] == ["a", "b"]
    assert plan["apps"][0]["data"] == A and plan["apps"][1]["locked"] == ["#0.scale"]
    st.close()


def test_one_writer_per_directory(tmp_path):
    d = tmp_path / "state"
    st = StateDir.open(d)
    with pytest.raises(StateError, match=r"in use by another process \(pid \d+"):
        StateDir.open(d)
    with pytest.raises(StateError, match="in use"):
        StateDir.check(d)
    st.close()
    StateDir.open(d).close()


def test_a_directory_others_can_write_is_refused(tmp_path):
    d = tmp_path / "state"
    StateDir.open(d).close()
    os.chmod(d, 0o770)
    with pytest.raises(StateError, match=r"writable by group or others.*chmod 700"):
        StateDir.check(d)
    os.chmod(d, 0o700)
    os.chmod(d / "apps", 0o777)
    with pytest.raises(StateError, match="apps: writable by group"):
        StateDir.open(d)


def test_new_files_are_private(tmp_path):
    d, _ = base_dir(tmp_path)
    assert os.stat(d).st_mode & 0o777 == 0o700
    for p in [d / "state.json", d / "journal.jsonl", *(d / "apps").iterdir()]:
        assert os.stat(p).st_mode & 0o777 == 0o600, p


# ---------------------------------------------------------------------- crashes
def test_the_deployment_secret_is_kept_across_starts(tmp_path):
    """Without XMIX_DEPLOYMENT_SECRET the state directory keeps the secret keyed.py derives cache
    salts, audit fingerprints and hidden metric labels from: drawn once, 0600, the same after a
    restart; a file others can read or a damaged one is refused, naming it."""
    st = StateDir.open(tmp_path / "s")
    first = st.secret()
    assert len(first) == 32 and st.secret() == first
    p = tmp_path / "s" / S.SECRET
    assert p.stat().st_mode & 0o777 == 0o600
    st.close()
    st = StateDir.open(tmp_path / "s")
    assert st.secret() == first
    p.chmod(0o644)
    with pytest.raises(StateError, match="read by others"):
        st.secret()
    p.chmod(0o600)
    p.write_text("not hex\n")
    with pytest.raises(StateError, match=str(p)):
        st.secret()
    st.close()


def _killed_child(fn) -> int:
    """Run fn() in a forked child; returns the signal that ended it (0: it exited)."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)


def _die_at(kind, point):
    def crash(k, p):
        if (k, p) == (kind, point):
            os.kill(os.getpid(), signal.SIGKILL)

    return crash


# where a SIGKILL leaves the change: absent before its journal line reaches the file, whole
# from then on (a process's writes outlive it; a power cut is another matter: the fsyncs)
BEFORE = {"app.tmp", "app.renamed", "journal.before"}
CHANGE_POINTS = [
    (kind, point)
    for kind in CHANGES
    for point in POINTS
    if not point.startswith(("snapshot", "reset", "gc"))
    and (kind == "deploy" or not point.startswith("app"))
]


@pytest.mark.parametrize("kind,point", CHANGE_POINTS, ids=[f"{k}:{p}" for k, p in CHANGE_POINTS])
def test_a_crash_in_a_change_leaves_it_whole_or_absent(tmp_path, kind, point):
    d, model = base_dir(tmp_path)
    change = CHANGES[kind]

    def child():
        st = StateDir.open(d)
        st._crash = _die_at(kind, point)
        led = Ledger(st)  # the ledger's order: save, the engines apply, append
        assert led.call("acquire", "s1")
        led.call("save", "s1", 0, change)
        led.call("append", "s1", 0, {k: v for k, v in change.items() if k != "data"})

    assert _killed_child(child) == signal.SIGKILL  # the point was reached
    want = model if point in BEFORE else model_after(model, change)
    # a restart: verified as the launcher does, then opened by the writer
    assert seen(StateDir.check(d)) == want
    st = StateDir.open(d)
    assert seen(st) == want
    # nothing half-written is left, and the directory takes the next change
    leftovers = [p.name for p in d.rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == []
    assert sorted(p.name for p in (d / "apps").iterdir()) == sorted(
        {a["file"] for a in want.values()}
    )
    more = deploy("z", app_bytes("z"), 9)
    assert st.save(more) is True
    st.close()
    assert seen(StateDir.check(d)) == model_after(want, more)


FOLD_POINTS = [p for p in POINTS if p.startswith(("snapshot", "reset", "gc"))]


@pytest.mark.parametrize("point", FOLD_POINTS)
def test_a_crash_while_the_journal_is_folded_loses_nothing(tmp_path, point):
    d, model = base_dir(tmp_path)
    change = CHANGES["undeploy"]  # leaves an app file for the fold to collect

    def child():
        st = StateDir.open(d)
        st.save(change)
        st._crash = _die_at("compact", point)
        st.compact()

    assert _killed_child(child) == signal.SIGKILL
    want = model_after(model, change)
    assert seen(StateDir.check(d)) == want
    st = StateDir.open(d)
    assert seen(st) == want and st.rev == len(BASE) + 1
    st.close()


def test_a_crash_at_start_while_folding_loses_nothing(tmp_path):
    d, model = base_dir(tmp_path)
    for point in FOLD_POINTS:
        crash = _die_at("compact", point)
        assert _killed_child(lambda c=crash: StateDir.open(d, crash=c)) == signal.SIGKILL, point
        assert seen(StateDir.check(d)) == model, point


def test_the_fold_runs_every_so_many_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "COMPACT_EVERY", 4)
    d, model = base_dir(tmp_path)
    st = StateDir.open(d)
    for i in range(9):
        e = patch("a", params={"#0.scale": float(i)})
        st.save(e)
        model = model_after(model, e)
    assert st.journal_lines == 1  # folded at 4 and 8
    assert (d / "journal.jsonl").read_bytes().count(b"\n") == 1
    st.close()
    assert seen(StateDir.check(d)) == model


def test_a_write_that_fails_changes_nothing_and_the_next_one_works(tmp_path):
    d, model = base_dir(tmp_path)
    st = StateDir.open(d)

    def full(kind, point):
        if point == "journal.written":  # the line is in the file; its fsync fails
            raise OSError(errno.ENOSPC, "No space left on device")

    st._crash = full
    with pytest.raises(StateError, match=r"journal.jsonl: cannot write .*No space left"):
        st.save(CHANGES["patch"])
    assert seen(st) == model  # nothing applied in memory
    assert on_disk(d) == model  # and the cut line was taken back
    st._crash = None
    assert st.save(CHANGES["patch"]) is True
    st.close()
    assert seen(StateDir.check(d)) == model_after(model, CHANGES["patch"])


def test_a_change_the_load_would_refuse_is_never_written(tmp_path):
    d, model = base_dir(tmp_path)
    st = StateDir.open(d)
    with pytest.raises(StateError, match="patch of 'nope'"):
        st.save(patch("nope", mode="off"))
    with pytest.raises(StateError, match="bad mode"):
        st.save(patch("a", mode="sometimes"))
    with pytest.raises(StateError, match="deploy of 'a', which the state holds"):
        st.save(deploy("a", A, 7))
    with pytest.raises(StateError, match="refused to write"):
        st.save(patch("a", params={"#0.scale": float("nan")}))
    st.close()
    assert seen(StateDir.check(d)) == model


# ---------------------------------------------------------------------- damage
def test_a_cut_last_line_is_dropped_at_every_length(tmp_path, caplog):
    d, model = base_dir(tmp_path)
    st = StateDir.open(d)
    st.save(CHANGES["patch"])
    st.close()
    journal = (d / "journal.jsonl").read_bytes()
    assert journal.count(b"\n") == 1
    for cut in range(1, len(journal) - 1):
        (d / "journal.jsonl").write_bytes(journal[:cut])
        with caplog.at_level(logging.WARNING, logger="vllm.xmix"):
            got = StateDir.check(d)
        assert seen(got) == model, cut
        assert got.dropped_tail == cut
    assert "ends in a cut line" in caplog.text
    # the writer's start folds the state and drops the cut line for good
    st = StateDir.open(d)
    st.close()
    assert (d / "journal.jsonl").read_bytes() == b""
    assert seen(StateDir.check(d)) == model


def _two_lines(tmp_path):
    d, _ = base_dir(tmp_path)
    st = StateDir.open(d)
    st.save(CHANGES["patch"])
    st.save(CHANGES["deploy"])
    st.close()
    return d


def test_a_damaged_line_before_the_last_refuses_the_start_naming_it(tmp_path):
    d = _two_lines(tmp_path)
    j = d / "journal.jsonl"
    lines = j.read_bytes().split(b"\n")
    lines[0] = lines[0].replace(b'"off"', b'"all"')
    j.write_bytes(b"\n".join(lines))
    with pytest.raises(StateError, match=rf"{j} line 1: checksum mismatch"):
        StateDir.check(d)
    with pytest.raises(StateError, match=rf"{j} line 1"):
        StateDir.open(d)


def test_a_line_out_of_order_refuses_the_start(tmp_path):
    d = _two_lines(tmp_path)
    j = d / "journal.jsonl"
    lines = j.read_bytes().split(b"\n")
    j.write_bytes(lines[1] + b"\n")  # the first line lost
    with pytest.raises(StateError, match=rf"{j} line 1: revision 5, expected 4"):
        StateDir.check(d)


def test_a_damaged_state_file_refuses_the_start_naming_it(tmp_path):
    d, _ = base_dir(tmp_path)
    StateDir.open(d).close()  # the apps folded into state.json
    s = d / "state.json"
    assert b'"request"' in s.read_bytes()
    s.write_bytes(s.read_bytes().replace(b'"request"', b'"all"'))
    with pytest.raises(StateError, match=rf"{s}: checksum mismatch"):
        StateDir.check(d)
    s.write_bytes(b"{not json")
    with pytest.raises(StateError, match=rf"{s}: not JSON"):
        StateDir.check(d)


def test_a_state_file_of_another_format_refuses_the_start(tmp_path):
    d, _ = base_dir(tmp_path)
    s = d / "state.json"
    doc = json.loads(s.read_bytes())
    doc["format"] = 99
    s.write_bytes(S._sealed(doc))
    with pytest.raises(StateError, match=rf"{s}: format 99, this xmix reads format 1"):
        StateDir.check(d)


def test_a_damaged_or_missing_app_file_refuses_the_start_naming_it(tmp_path):
    d, _ = base_dir(tmp_path)
    p = d / "apps" / digest(B)
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(StateError, match=rf"{p} \(app 'b'\): its SHA-256 does not match"):
        StateDir.check(d)
    p.unlink()
    with pytest.raises(StateError, match=rf"{p} \(app 'b'\): cannot be read"):
        StateDir.open(d)


def test_an_app_file_that_is_not_an_app_refuses_the_start(tmp_path):
    d = tmp_path / "state"
    st = StateDir.open(d)
    junk = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    st.save(deploy("j", junk, 1))
    st.close()
    with pytest.raises(StateError, match=rf"{d / 'apps' / digest(junk)} \(app 'j'\): not an app"):
        StateDir.check(d)


def test_the_crash_trigger_file_fires_once(tmp_path):
    """XMIX_TEST_STATE_CRASH (test-only): the point named in the file kills the process group
    once; the file is gone afterwards so a restarted server runs on."""
    d, _ = base_dir(tmp_path)
    trigger = tmp_path / "crash"
    trigger.write_text("patch:journal.synced")

    def child():
        os.setpgid(0, 0)  # a group of its own: the trigger kills the group
        os.environ["XMIX_TEST_STATE_CRASH"] = str(trigger)
        st = StateDir.open(d)
        st.save(CHANGES["undeploy"])  # another kind: no crash
        st.save(CHANGES["patch"])

    assert _killed_child(child) == signal.SIGKILL
    assert not trigger.exists()
    got = StateDir.check(d)
    assert "a" not in got.apps and got.apps["b"].mode == "off"


def test_xmix_serve_refuses_a_damaged_state_before_any_engine_starts(tmp_path):
    import subprocess
    import sys

    d, _ = base_dir(tmp_path)
    j = d / "journal.jsonl"
    j.write_bytes(j.read_bytes().replace(b'"a"', b'"x"', 1))
    r = subprocess.run(
        [sys.executable, "-m", "xmix.cli", "serve", "some-model", "--xmix-state-dir", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{j} line 1: checksum mismatch" in r.stderr
    assert "Nothing was started. To start clean, move the directory away" in r.stderr
