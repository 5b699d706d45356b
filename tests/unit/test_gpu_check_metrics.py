"""The workers' CUDA graph counters (first-replay checks, fallbacks) on the frontend's
Prometheus registry: summed over workers, asked for at most every few seconds and never on
the scrape itself (python/xmix/integrations/vllm/frontend/metrics.py)."""

from __future__ import annotations

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from xmix.integrations.vllm.frontend.metrics import GraphStatsCollector  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _scrape(collector) -> dict[str, float]:
    reg = prometheus_client.CollectorRegistry()
    reg.register(collector)
    out = {}
    for line in prometheus_client.generate_latest(reg).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait(c):
    if c.thread is not None:
        c.thread.join(5)


WORKER0 = {
    "apps": [],
    "stats": {},
    "graphs": {
        "check_passed": 3,
        "check_failed": 1,
        "check_unverifiable": 0,
        "patched": 40,
        "fallback": 2,
        "errors": 1,
    },
}
WORKER1 = {
    "apps": [],
    "stats": {},
    "graphs": {
        "check_passed": 2,
        "check_failed": 0,
        "check_unverifiable": 1,
        "patched": 40,
        "fallback": 1,
        "errors": 0,
    },
}


def test_counters_are_summed_over_workers_and_refreshed_in_the_background():
    calls = []
    clock = Clock()

    def fetch():
        calls.append(clock.t)
        return [WORKER0, WORKER1]

    c = GraphStatsCollector(fetch, "m", refresh_s=5.0, clock=clock)
    _scrape(c)  # answered from what is known; the refresh starts in a thread
    _wait(c)
    got = _scrape(c)
    assert got['vllm:xmix_graph_checks_total{model_name="m",result="passed"}'] == 5
    assert got['vllm:xmix_graph_checks_total{model_name="m",result="failed"}'] == 1
    assert got['vllm:xmix_graph_checks_total{model_name="m",result="unverifiable"}'] == 1
    assert got['vllm:xmix_graphs_patched_total{model_name="m"}'] == 80
    assert got['vllm:xmix_graph_fallbacks_total{model_name="m"}'] == 3
    assert got['vllm:xmix_graph_errors_total{model_name="m"}'] == 1
    assert got['vllm:xmix_graph_stats_workers{model_name="m"}'] == 2
    assert calls == [100.0], "a second scrape within refresh_s must not ask again"
    clock.t += 5.0
    _scrape(c)
    _wait(c)
    assert calls == [100.0, 105.0]


def test_a_failing_or_old_worker_answer_keeps_serving_metrics():
    clock = Clock()
    answers = [[WORKER0, {"apps": [], "stats": {}}]]  # a worker without graph counters

    def fetch():
        a = answers[0]
        if isinstance(a, Exception):
            raise a
        return a

    c = GraphStatsCollector(fetch, "m", refresh_s=1.0, clock=clock)
    _scrape(c)
    _wait(c)
    got = _scrape(c)
    assert got['vllm:xmix_graph_stats_workers{model_name="m"}'] == 1
    assert got['vllm:xmix_graph_checks_total{model_name="m",result="passed"}'] == 3
    answers[0] = RuntimeError("engine core is shutting down")
    clock.t += 1.0
    _scrape(c)
    _wait(c)
    got = _scrape(c)  # the last values stay
    assert got['vllm:xmix_graph_checks_total{model_name="m",result="passed"}'] == 3


def test_worker_host_time_is_the_largest_ranks_not_a_sum():
    """Tensor-parallel ranks run the same steps and site programs side by side: the engine's
    host time is the slowest rank's, so two ranks' 0.5 s and 0.7 s read 0.7 s, not 1.2 s."""
    clock = Clock()
    w0 = {"stats": {"steps": 40, "host_seconds_step": 0.5, "host_seconds_sites": 0.25}}
    w1 = {"stats": {"steps": 40, "host_seconds_step": 0.7, "host_seconds_sites": 0.125}}
    c = GraphStatsCollector(lambda: [w0, w1], "m", refresh_s=5.0, clock=clock)
    _scrape(c)
    _wait(c)
    got = _scrape(c)
    assert got['vllm:xmix_worker_host_seconds_total{model_name="m",part="step"}'] == 0.7
    assert got['vllm:xmix_worker_host_seconds_total{model_name="m",part="sites"}'] == 0.25
    assert got['vllm:xmix_worker_steps_total{model_name="m"}'] == 40
