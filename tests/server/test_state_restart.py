"""Deployments survive ``kill -9`` of the whole server (docs/serving.md, "State directory"):
``xmix serve --xmix-state-dir`` under load, killed twice and restarted from its state
directory each time: the restart phase of bench/soak.py (``restart_soak``) at a bounded size,
three server starts in all.

The kills are placed with the test-only crash points (``XMIX_TEST_STATE_CRASH``, state_dir.py:
SIGKILL to the server's process group from inside the writer, at a named step):

- a deploy of an app never deployed before, at ``app.renamed`` (its app file is in place,
  its journal line is not): after the restart the app is absent, its file collected;
- a PATCH of mode, parameters and locks together, at ``applied`` (every engine applied it,
  the HTTP answer is not sent): after the restart all three are there.

Around them requests stream and the control driver deploys, patches and undeploys; every
acknowledged change must be found after each restart. Every other point of a deploy, a PATCH
and an undeploy (and of folding the journal) is killed in tests/unit/test_state_dir.py, in a
forked writer, without a server; the restore over several API servers and data-parallel
engines is tests/unit/test_state_restore.py. Oracles: what the server acknowledged (its 2xx
answers), the same requests before the first kill and after each restart, and each completed
request against the same request alone (soak.run_oracle)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest

from xmix.integrations.vllm.state_dir import StateDir

pytestmark = pytest.mark.engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

POINTS = ["deploy:app.renamed", "patch:applied"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import soak

    tmp = tmp_path_factory.mktemp("restart")
    args = argparse.Namespace(
        restart_requests=32,  # per kill
        restart_changes=6,
        concurrency=8,
        deadline=300.0,
        seed=5,
        key="soak-key",
        admin_key="soak-admin-key",
        progress=0,
        kill_points=POINTS,
        restarts=len(POINTS),
    )
    t0 = time.time()
    fig = soak.run_restarts(args, soak.build_apps(0), tmp, eager=True)
    fig["wall"] = time.time() - t0
    fig["dir"] = tmp / "state"
    return fig


def test_nothing_acknowledged_is_lost_and_no_change_is_half(run):
    ex = run["examples"]
    assert run["kills"] == len(POINTS)
    assert run["kill_points_missed"] == 0, ex  # each kill was at its point, mid-change
    assert run["acked_lost"] == 0, ex
    assert run["in_doubt"] == len(POINTS)
    # the deploy killed before its journal line is absent; the PATCH killed after the
    # engines applied it is there whole (mode, parameters and locks); nothing half
    assert (run["in_doubt_absent"], run["in_doubt_present"], run["in_doubt_half"]) == (1, 1, 0), ex
    assert run["acked_changes"] >= 2 * len(POINTS) and run["changes_unexpected"] == 0, ex


def test_no_wrong_answer_across_the_restarts(run):
    ex = run["examples"]
    assert run["pinned_wrong"] == 0 and run["pinned_equal"] == 3 * len(POINTS), ex
    assert run["oracle_wrong"] == 0 and run["leaked"] == 0, ex
    assert run["oracle_equal"] >= run["completed"] // 2, run


def test_the_kills_were_under_load_and_lost_no_other_request(run):
    ex = run["examples"]
    assert run["cut_by_kill"] > 0, run  # requests were in flight when the server died
    assert (run["failed"], run["hung"]) == (0, 0), ex
    assert (
        run["completed"] + run["cut_by_kill"] + run["refused_by_race"] + run["disconnected"]
        == run["requests"]
    )
    assert run["server_log"]["starts"] == len(POINTS) + 1
    assert run["server_log"]["tracebacks"] == 0, run["server_log"]
    print(f"state restart module: {run['wall']:.0f} s (starts {run['server_log']['start_s']} s)")


def test_the_directory_is_whole_after_the_last_stop(run):
    st = StateDir.check(run["dir"])  # verifies every record and app file
    assert [p.name for p in run["dir"].rglob(".tmp-*")] == []
    # the churn apps were undeployed for the oracle, the killed deploy never happened: the
    # --app files' apps are what is left, restored at every start
    assert list(st.apps) == ["steer", "probe"]
