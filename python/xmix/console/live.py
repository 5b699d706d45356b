"""The console's Live view, read from the xmix counters that vLLM's /metrics exposes
(``integrations/vllm/metrics.py``, counted by ``integrations/vllm/usage.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _samples(metric) -> Iterable[tuple[str, dict, float]]:
    for fam in metric.collect():
        for s in fam.samples:
            yield s.name, s.labels, s.value


def _sum_count(metric, model: str, **match) -> dict[tuple, list[float]]:
    """Histogram sums and counts per label set (without model_name) for one model."""
    out: dict[tuple, list[float]] = {}
    for name, labels, value in _samples(metric):
        if labels.get("model_name") != model or any(labels.get(k) != v for k, v in match.items()):
            continue
        key = tuple(sorted((k, v) for k, v in labels.items() if k not in ("model_name", "le")))
        acc = out.setdefault(key, [0.0, 0.0])
        if name.endswith("_sum"):
            acc[0] += value
        elif name.endswith("_count"):
            acc[1] += value
    return out


def _mean(acc: list[float] | None) -> float | None:
    return acc[0] / acc[1] if acc and acc[1] else None


def snapshot(metrics: dict, model: str, apps: list[dict]) -> dict[str, Any]:
    """Per deployed app: requests admitted that named it, finished requests that used it,
    mean TTFT and TPOT of those and their difference to requests that used no app, and each
    gate's positions, fires and rate, and its monitors: requests its stop ended and requests in
    which a since(...) condition started to hold, by read. ``apps`` is the control plane's
    list."""
    admitted: dict[str, float] = {}
    for name, labels, value in _samples(metrics["app_requests"]):
        if name.endswith("_total") and labels.get("model_name") == model:
            admitted[labels["app"]] = admitted.get(labels["app"], 0) + value
    ttft = _sum_count(metrics["app_ttft"], model)
    tpot = _sum_count(metrics["app_tpot"], model)
    base_ttft = _mean(_sum_count(metrics["plain_ttft"], model).get(()))
    base_tpot = _mean(_sum_count(metrics["plain_tpot"], model).get(()))
    base_n = (_sum_count(metrics["plain_ttft"], model).get(()) or [0, 0])[1]
    gates: dict[str, dict[str, dict[str, float]]] = {}
    for key, field in (("gate_tokens", "tokens"), ("gate_fired", "fired")):
        for name, labels, value in _samples(metrics[key]):
            if name.endswith("_total") and labels.get("model_name") == model:
                g = gates.setdefault(labels["app"], {}).setdefault(
                    labels["gate"], {"tokens": 0, "fired": 0}
                )
                g[field] += value

    monitors: dict[str, dict[str, dict[str, float]]] = {}
    for key in ("stopped", "switched"):
        if key not in metrics:
            continue
        for name, labels, value in _samples(metrics[key]):
            if name.endswith("_total") and labels.get("model_name") == model:
                per = monitors.setdefault(labels["app"], {}).setdefault(key, {})
                per[labels["read"]] = per.get(labels["read"], 0) + value

    def added(mean: float | None, base: float | None) -> float | None:
        return None if mean is None or base is None else mean - base

    rows = []
    for a in apps:
        name = a["name"]
        t1, t2 = ttft.get((("app", name),)), tpot.get((("app", name),))
        m1, m2 = _mean(t1), _mean(t2)
        rows.append(
            {
                "name": name,
                "mode": a["mode"],
                "requests_admitted": admitted.get(name, 0),
                "requests_finished": t1[1] if t1 else 0,
                "ttft_mean_s": m1,
                "tpot_mean_s": m2,
                "ttft_added_s": added(m1, base_ttft),
                "tpot_added_s": added(m2, base_tpot),
                "gates": [
                    {
                        "gate": g,
                        "tokens": v["tokens"],
                        "fired": v["fired"],
                        "rate": v["fired"] / v["tokens"] if v["tokens"] else None,
                    }
                    for g, v in sorted(gates.get(name, {}).items())
                ],
                "monitors": [
                    {"action": action, "read": read, "requests": n}
                    for action in ("stopped", "switched")
                    for read, n in sorted(monitors.get(name, {}).get(action, {}).items())
                ],
            }
        )
    return {
        "model": model,
        "apps": rows,
        "no_app": {"requests_finished": base_n, "ttft_mean_s": base_ttft, "tpot_mean_s": base_tpot},
    }
