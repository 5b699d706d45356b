"""A restart from a state directory without an engine: two API servers' Controllers over two
data-parallel engines (real control blocks on the CPU; test_scale_out_units's fleet), the
state directory's writer on the first worker of the first engine (state_dir.py, ledger.py),
and the restore (restore.py). A "restart" is a new fleet on the same directory.

Oracles: what the engines' control blocks hold (``cb.deploy.describe()``: each app's version, mode
and parameters, the engine's own record), compared before and after; the registries'
answers before the restart; hand-written expectations for the floors."""

from __future__ import annotations

import errno

import pytest
from test_scale_out_units import Engine, app, held, server

from xmix.integrations.vllm.errors import EngineGone, NotSaved
from xmix.integrations.vllm.frontend import restore as R
from xmix.integrations.vllm.state_dir import StateDir, StateError
from xmix.integrations.vllm.worker.ledger import Ledger
from xmix.lang.lowering import DeployError


def fleet(d):
    """Two engines (the first writes ``d``) and two API servers."""
    engines = [Engine(), Engine()]
    st = StateDir.open(d)
    engines[0].worker.model_runner._xmix.ledger = Ledger(st)
    engines[1].worker.model_runner._xmix.ledger = Ledger()
    return engines, st, server(engines), server(engines)


def on_disk(d) -> dict:
    st = StateDir(d)
    st._load()
    return {n: (a.version, a.mode, a.params, a.locked) for n, a in st.apps.items()}


def public(apps: list[dict]) -> list[dict]:
    return [
        {k: a[k] for k in ("name", "mode", "params", "version", "locked", "sites")} for a in apps
    ]


def test_a_restart_restores_every_change_on_every_engine_and_server(tmp_path):
    d = tmp_path / "state"
    engines, st, s1, s2 = fleet(d)
    assert R.restore(s1)["apps"] == []  # an empty directory: nothing to restore
    s1.deploy(app("a"), locked=["scale"])
    s2.patch("a", mode="all", params={"scale": 3.0})
    s1.deploy(app("b", 2.0), mode="off")
    s2.deploy(app("c"))
    s1.undeploy("c")
    s2.patch("b", locked=True)  # only a lock: nothing reaches the engines, still a change
    s1.patch("b", params={"#0.scale": -1.5}, mode="request")
    before, engines_before = public(s1.apps()), [held(e) for e in engines]
    epoch_before = s1.registry.epoch
    assert [a["name"] for a in before] == ["a", "b"]
    st.close()  # the whole server is gone (a crash: nothing more was written)

    engines, st, t1, t2 = fleet(d)
    assert [held(e) for e in engines] == [{}, {}]  # a fresh engine holds nothing
    got1, got2 = R.restore(t1), R.restore(t2)
    assert (got1["by_other"], got2["by_other"]) == (False, True)
    assert got1["apps"] == got2["apps"] == ["a", "b"]
    t2.sync()
    assert public(t1.apps()) == public(t2.apps()) == before
    assert [held(e) for e in engines] == engines_before
    # a restart starts above every epoch and version before it, on every server alike
    assert t1.registry.epoch == t2.registry.epoch > epoch_before
    assert t1.deploy(app("d"))["version"] > max(a["version"] for a in before)
    # the restore's own deploys were not written again; the new deploy was
    assert list(on_disk(d)) == ["a", "b", "d"]
    st.close()


def test_a_change_the_state_directory_cannot_take_is_not_made(tmp_path):
    d = tmp_path / "state"
    engines, st, s1, _ = fleet(d)
    s1.deploy(app("a"))
    apps, on_engines = s1.apps(), [held(e) for e in engines]

    def full(kind, point):
        if point == "journal.before":
            raise OSError(errno.ENOSPC, "No space left on device")

    st._crash = full
    with pytest.raises(NotSaved, match="the change was not made: .*No space left"):
        s1.deploy(app("b"))
    with pytest.raises(NotSaved):
        s1.patch("a", mode="off", params={"scale": 9.0})
    with pytest.raises(NotSaved):
        s1.undeploy("a")
    assert isinstance(NotSaved("x"), EngineGone)  # the server answers it as a 503
    assert s1.apps() == apps
    assert [held(e) for e in engines] == on_engines
    assert all(not e.cb.deploy.staged for e in engines)  # the refused deploy's preparation dropped
    st._crash = None
    s1.patch("a", mode="off")
    assert on_disk(d)["a"][1] == "off"
    st.close()


def test_a_change_that_fails_after_it_was_written_is_undone_on_disk(tmp_path):
    d = tmp_path / "state"
    engines, st, s1, _ = fleet(d)
    s1.deploy(app("a"), locked=["scale"])
    want = on_disk(d)
    engines[1].refuse = {"xmix_deploy_commit"}  # an engine loses its prepared state
    with pytest.raises(DeployError):
        s1.deploy(app("b"))
    engines[1].refuse = {"xmix_patch"}
    with pytest.raises(Exception, match="refused on this engine"):
        s1.patch("a", mode="all", params={"scale": 5.0})
    engines[1].refuse = set()
    got = on_disk(d)
    assert list(got) == ["a"]
    # the patch's undoing is written as the values before it, under the names the ledger
    # keeps ("scale" of the app's one op is "#0.scale")
    assert got["a"][:2] == want["a"][:2] and got["a"][2] == {"#0.scale": 1.0}
    assert got["a"][3] == want["a"][3] == ["#0.scale"]
    st.close()


def test_an_app_the_restarted_server_cannot_deploy_stops_the_restore_naming_it(
    tmp_path, monkeypatch
):
    d = tmp_path / "state"
    _, st, s1, _ = fleet(d)
    s1.deploy(app("a"))
    s1.deploy(app("b"))
    file_b = st.apps["b"].file
    st.close()
    monkeypatch.setenv("XMIX_MAX_APPS", "1")  # started again with a lower limit
    _, st, t1, _ = fleet(d)
    with pytest.raises(StateError, match=rf"holds app 'b' \(.*apps/{file_b}\).*XMIX_MAX_APPS"):
        R.restore(t1)
    st.close()


def test_without_a_state_directory_nothing_is_restored(tmp_path, monkeypatch):
    engines = [Engine(), Engine()]
    s1 = server(engines)
    monkeypatch.delenv("XMIX_STATE_DIR", raising=False)
    assert R.restore(s1) is None
    monkeypatch.setenv("XMIX_STATE_DIR", str(tmp_path))  # set here, but the engines lack it
    with pytest.raises(StateError, match="no worker opened it"):
        R.restore(s1)


def test_an_app_given_at_start_is_matched_with_the_restored_copy_on_every_server(tmp_path):
    """restore.log_app_kept says whether a file given at start (``--app``) is the app the
    state directory restored. The directory keeps the app as given; a server that did not
    restore it holds only its lowered program, which carries the app's content digest: both
    servers tell the same file from a changed one."""
    d = tmp_path / "state"
    _, st, s1, _ = fleet(d)
    s1.deploy(app("a", 2.0).to_bytes(), allow_custom=False)
    st.close()
    _, st, t1, t2 = fleet(d)
    R.restore(t1)
    t2.sync()
    for s in (t1, t2):
        kept = s.registry.get("a").lowered
        assert R.same_app(app("a", 2.0), kept)
        assert not R.same_app(app("a", 3.0), kept)
    st.close()
