"""xmix counters on vLLM's Prometheus endpoint (/metrics), in the frontend process, named
in vLLM's convention (``vllm:`` prefix, ``_total`` counters, ``model_name`` label)."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_metrics = None


def _make():
    from prometheus_client import Counter, Gauge

    return {
        "requests": Counter("vllm:xmix_requests", "Requests admitted that use at least one xmix app",
                            ["model_name"]),
        "app_requests": Counter("vllm:xmix_app_requests", "Requests admitted per xmix app",
                                ["model_name", "app"]),
        "rejected": Counter("vllm:xmix_rejected_requests",
                            "Requests refused at admission for a bad xmix control", ["model_name"]),
        "changes": Counter("vllm:xmix_control_changes", "Control-plane changes applied",
                           ["model_name", "kind"]),
        "deployed": Gauge("vllm:xmix_apps_deployed", "xmix apps deployed", ["model_name"]),
    }


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
