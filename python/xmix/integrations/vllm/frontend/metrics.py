"""xmix counters on vLLM's Prometheus endpoint (/metrics), in the frontend process, named
in vLLM's convention (``vllm:`` prefix, ``_total`` counters, ``model_name`` label)."""

from __future__ import annotations

import threading

from xmix import settings

_lock = threading.Lock()
_metrics = None
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


def _make(registry=None):
    """The counters, registered on ``registry`` (vLLM's default one when None)."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    kw = {"registry": REGISTRY if registry is None else registry}
    return {
        "requests": Counter(
            "vllm:xmix_requests",
            "Requests admitted that use at least one xmix app",
            ["model_name"],
            **kw,
        ),
        "app_requests": Counter(
            "vllm:xmix_app_requests", "Requests admitted per xmix app", ["model_name", "app"], **kw
        ),
        "rejected": Counter(
            "vllm:xmix_rejected_requests",
            "Requests refused at admission for a bad xmix control",
            ["model_name"],
            **kw,
        ),
        "changes": Counter(
            "vllm:xmix_control_changes",
            "Control-plane changes applied",
            ["model_name", "kind"],
            **kw,
        ),
        "deployed": Gauge("vllm:xmix_apps_deployed", "xmix apps deployed", ["model_name"], **kw),
        # Per-app use, counted by usage.py from what the engine returns.
        "gate_tokens": Counter(
            "vllm:xmix_gate_tokens",
            "Positions where the read of an xmix gate ran",
            ["model_name", "app", "gate"],
            **kw,
        ),
        "gate_fired": Counter(
            "vllm:xmix_gate_fired_tokens",
            "Positions where an xmix gate held",
            ["model_name", "app", "gate"],
            **kw,
        ),
        "app_ttft": Histogram(
            "vllm:xmix_app_time_to_first_token_seconds",
            "Time to first token of finished requests that used the app",
            ["model_name", "app"],
            buckets=LATENCY_BUCKETS,
            **kw,
        ),
        "app_tpot": Histogram(
            "vllm:xmix_app_time_per_output_token_seconds",
            "Mean time per output token of finished requests that used the app",
            ["model_name", "app"],
            buckets=LATENCY_BUCKETS,
            **kw,
        ),
        "plain_ttft": Histogram(
            "vllm:xmix_no_app_time_to_first_token_seconds",
            "Time to first token of finished requests that used no xmix app",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            **kw,
        ),
        "plain_tpot": Histogram(
            "vllm:xmix_no_app_time_per_output_token_seconds",
            "Mean time per output token of finished requests that used no xmix app",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            **kw,
        ),
        "result_cap_refusals": Counter(
            "vllm:xmix_result_cap_refusals",
            "Requests refused at admission: their reads over the prompt "
            "exceed their result byte cap",
            ["model_name"],
            **kw,
        ),
        # Monitors (App.stop, since(...)), counted by usage.py per request.
        "stopped": Counter(
            "vllm:xmix_requests_stopped",
            "Requests an app's stop ended, by the read its condition reports",
            ["model_name", "app", "read"],
            **kw,
        ),
        "switched": Counter(
            "vllm:xmix_requests_switched",
            "Requests in which an app's since(...) condition started to hold, by the read it "
            "reports",
            ["model_name", "app", "read"],
            **kw,
        ),
        "results_truncated": Counter(
            "vllm:xmix_results_truncated",
            "Sequences whose read results were cut at their byte cap",
            ["model_name"],
            **kw,
        ),
    }


# /metrics is not authenticated (vLLM serves it to anyone who reaches the port), and app
# names, and the names of their gates, can say what an operator steers or watches for. With
# XMIX_METRICS_APP_LABELS=hashed (``xmix serve --xmix-metrics-app-labels hashed``) they are
# shown as keyed hashes (keyed.Keys.label: "h" + 12 hex digits, the same on every API server
# of the deployment); the admin's GET /xmix/v1/apps gives each app's label.
_label_keys = None  # keyed.Keys while names are hidden


def app_labels_mode() -> str:
    return str(settings.get("XMIX_METRICS_APP_LABELS"))


def set_app_labels(keys) -> None:
    """Called by the server once it has the deployment's keys: hide names if asked to."""
    global _label_keys
    _label_keys = keys if app_labels_mode() == "hashed" else None


def app_label(app: str) -> str:
    """The value of the ``app`` label for an app."""
    return app if _label_keys is None else _label_keys.label(app)


def shown(labels: dict) -> dict:
    """Labels with ``app`` (and ``gate`` or ``read``, which name an op of that app) as
    /metrics shows them."""
    keys = _label_keys
    if keys is None or "app" not in labels:
        return labels
    out = dict(labels)
    out["app"] = keys.label(labels["app"])
    if "gate" in out:
        out["gate"] = keys.label(labels["app"] + "/" + out["gate"])
    if out.get("read"):  # a monitor's read ("" for a condition on tokens alone)
        out["read"] = keys.label(labels["app"] + "/" + out["read"])
    return out


def get():
    """The counters, or None where prometheus_client is unavailable."""
    global _metrics
    with _lock:
        if _metrics is None:
            try:
                _metrics = _make()
            except Exception:  # no prometheus_client, or a foreign registry conflict
                _metrics = {}
        return _metrics or None


# ---------------------------------------------------------------------- CUDA graph counters
# The graph counters (xmix.runtime.graphs.stats()) live in the worker processes, which have no
# /metrics of their own. The frontend asks the workers for them through the xmix_describe
# RPC, at most every REFRESH_S seconds and only when /metrics is read; a scrape is answered
# from the last answer (prometheus_client collects on the server's event loop, where waiting
# for an RPC would block the loop). Values are summed over the workers (tensor-parallel ranks
# each hold their own graphs).
GRAPH_COUNTERS = {
    "check_passed": ("xmix_graph_checks", "First-replay checks of patched CUDA graphs", "passed"),
    "check_failed": ("xmix_graph_checks", "First-replay checks of patched CUDA graphs", "failed"),
    "check_unverifiable": (
        "xmix_graph_checks",
        "First-replay checks of patched CUDA graphs",
        "unverifiable",
    ),
}
GRAPH_TOTALS = {
    "patched": ("xmix_graphs_patched", "CUDA graphs patched at capture"),
    "fallback": ("xmix_graph_fallbacks", "CUDA graphs left with (or put back to) their anchors"),
    "errors": ("xmix_graph_errors", "CUDA graph patch, instantiation or read-back errors"),
}
REFRESH_S = 5.0
# Per deployed app, from the same answers (counted since the app's deploy).
APP_COUNTERS = {
    "nonfinite_writes": "Stream elements an app's writes would have made Inf/NaN, refused (kept, "
    "or 0 for user kernels)",
    "site_errors": "Site-program failures of an app (each fails the requests that used it in that step)",
}


# xmix's own host time in the workers (worker.py, runtime/ops.py), from the same answers: every rank
# runs the same steps and site programs, so the largest value is the engine's.
HOST_PARTS = {"step": "host_seconds_step", "sites": "host_seconds_sites"}


class GraphStatsCollector:
    """A prometheus_client collector of the workers' CUDA graph counters."""

    def __init__(self, fetch, model_name: str, refresh_s: float = REFRESH_S, clock=None):
        import time

        self._fetch = fetch  # () -> list of xmix_describe answers, one per worker
        self.model_name = model_name
        self.refresh_s = refresh_s
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._totals: dict[str, int] = {}
        self._per_app: dict[str, dict[str, int]] = {}  # nonfinite_writes, site_errors per app
        self._host: dict[str, float] = {}  # HOST_PARTS, and "steps"
        self._asked_at: float | None = None
        self.workers = 0  # workers in the last answer that sent counters
        self.thread: threading.Thread | None = None

    def _refresh(self) -> None:
        try:
            answers = self._fetch()
            totals: dict[str, int] = {}
            per_app: dict[str, dict[str, int]] = {k: {} for k in APP_COUNTERS}
            workers = 0
            host: dict[str, float] = {}
            for a in answers or ():
                st = (a or {}).get("stats") or {}
                for k in (*HOST_PARTS.values(), "steps"):
                    if k in st:
                        host[k] = max(host.get(k, 0.0), float(st[k]))
                # every rank runs the same site programs: the largest count is the app's
                for k in APP_COUNTERS:
                    for app, v in ((a or {}).get(k) or {}).items():
                        per_app[k][app] = max(per_app[k].get(app, 0), int(v))
                g = (a or {}).get("graphs")
                if g is None:
                    continue
                workers += 1
                for k, v in g.items():
                    totals[k] = totals.get(k, 0) + int(v)
            with self._lock:
                self._totals = totals
                self._per_app = per_app
                self._host = host
                self.workers = workers
        except Exception as e:  # an engine shutting down: keep the last values
            import logging

            logging.getLogger("vllm.xmix").debug("xmix: graph counters not refreshed: %s", e)

    def maybe_refresh(self) -> None:
        now = self._clock()
        with self._lock:
            due = self._asked_at is None or now - self._asked_at >= self.refresh_s
            busy = self.thread is not None and self.thread.is_alive()
            if not due or busy:
                return
            self._asked_at = now
            self.thread = threading.Thread(
                target=self._refresh, name="xmix-graph-stats", daemon=True
            )
        self.thread.start()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.maybe_refresh()
        with self._lock:
            totals, workers, per_app = dict(self._totals), self.workers, dict(self._per_app)
            host = dict(self._host)
        labels = ["model_name"]
        hs = CounterMetricFamily(
            "vllm:xmix_worker_host_seconds",
            "xmix's own host time in the worker: per-step bookkeeping around the forward "
            "(admission, step maps, prologue, read drain) and active site programs on the CPU",
            labels=labels + ["part"],
        )
        for part, key in HOST_PARTS.items():
            hs.add_metric([self.model_name, part], host.get(key, 0.0))
        yield hs
        steps = CounterMetricFamily(
            "vllm:xmix_worker_steps", "Engine steps the xmix worker saw", labels=labels
        )
        steps.add_metric([self.model_name], host.get("steps", 0.0))
        yield steps
        for key, doc in APP_COUNTERS.items():
            c = CounterMetricFamily(f"vllm:xmix_{key}", doc, labels=labels + ["app"])
            for app, v in sorted(per_app.get(key, {}).items()):
                c.add_metric([self.model_name, app_label(app)], v)
            yield c
        w = GaugeMetricFamily(
            "vllm:xmix_graph_stats_workers",
            "Workers whose CUDA graph counters the xmix_graph_* metrics include",
            labels=labels,
        )
        w.add_metric([self.model_name], workers)
        yield w
        checks = CounterMetricFamily(
            "vllm:xmix_graph_checks",
            "First-replay checks of patched CUDA graphs (XMIX_GRAPH_CHECK)",
            labels=labels + ["result"],
        )
        for key, (_, _, result) in GRAPH_COUNTERS.items():
            checks.add_metric([self.model_name, result], totals.get(key, 0))
        yield checks
        for key, (name, doc) in GRAPH_TOTALS.items():
            c = CounterMetricFamily(f"vllm:{name}", doc, labels=labels)
            c.add_metric([self.model_name], totals.get(key, 0))
            yield c


_graph_collector: GraphStatsCollector | None = None


def watch_graph_stats(fetch, model_name: str, registry=None) -> GraphStatsCollector | None:
    """Register (once per process) the collector of the workers' CUDA graph counters on
    vLLM's Prometheus registry; None where prometheus_client is unavailable."""
    global _graph_collector
    with _lock:
        if _graph_collector is not None:
            return _graph_collector
        try:
            from prometheus_client import REGISTRY
        except ImportError:
            return None
        c = GraphStatsCollector(fetch, model_name)
        (registry or REGISTRY).register(c)
        _graph_collector = c
        return c
