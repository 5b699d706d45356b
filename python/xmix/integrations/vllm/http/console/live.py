"""The console's Live view, read from the xmix counters that vLLM's /metrics exposes
(``integrations/vllm/frontend/metrics.py``, counted by ``integrations/vllm/frontend/usage.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def snapshot(
    metrics: dict,
    model: str,
    apps: list[dict],
    shown: Callable[[dict], dict] | None = None,
    gate_names: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Per deployed app: requests admitted that named it, finished requests that used it,
    mean TTFT and TPOT of those and their difference to requests that used no app, and each
    gate's positions, fires and rate, and its monitors: requests its stop ended and requests in
    which a since(...) condition started to hold, by read. ``apps`` is the control plane's
    list, as far as the caller may see it: nothing of another app is returned. ``shown`` maps labels to what
    /metrics shows (app names hidden: keyed hashes; metrics.shown), ``gate_names`` each app's
    gates, so that hidden labels are named again here."""
    shown = shown or (lambda labels: labels)
    names = {shown({"app": a["name"]})["app"]: a["name"] for a in apps}
    gate_of = {
        (app, shown({"app": app, "gate": g})["gate"]): g
        for app, gs in (gate_names or {}).items()
        for g in gs
    }

    read_of = {
        (a["name"], shown({"app": a["name"], "read": r})["read"]): r
        for a in apps
        for r in a.get("reads") or ()
    }

    def app_of(labels: dict) -> str | None:
        return names.get(labels.get("app"))

    admitted: dict[str, float] = {}
    for name, labels, value in _samples(metrics["app_requests"]):
        app = app_of(labels)
        if name.endswith("_total") and labels.get("model_name") == model and app is not None:
            admitted[app] = admitted.get(app, 0) + value
    ttft = {
        (("app", names[dict(k)["app"]]),): v
        for k, v in _sum_count(metrics["app_ttft"], model).items()
        if dict(k).get("app") in names
    }
    tpot = {
        (("app", names[dict(k)["app"]]),): v
        for k, v in _sum_count(metrics["app_tpot"], model).items()
        if dict(k).get("app") in names
    }
    base_ttft = _mean(_sum_count(metrics["plain_ttft"], model).get(()))
    base_tpot = _mean(_sum_count(metrics["plain_tpot"], model).get(()))
    base_n = (_sum_count(metrics["plain_ttft"], model).get(()) or [0, 0])[1]
    gates: dict[str, dict[str, dict[str, float]]] = {}
    for key, field in (("gate_tokens", "tokens"), ("gate_fired", "fired")):
        for name, labels, value in _samples(metrics[key]):
            app = app_of(labels)
            if name.endswith("_total") and labels.get("model_name") == model and app is not None:
                gate = gate_of.get((app, labels["gate"]), labels["gate"])
                g = gates.setdefault(app, {}).setdefault(gate, {"tokens": 0, "fired": 0})
                g[field] += value

    monitors: dict[str, dict[str, dict[str, float]]] = {}
    for key in ("stopped", "switched"):
        if key not in metrics:
            continue
        for name, labels, value in _samples(metrics[key]):
            app = app_of(labels)
            if name.endswith("_total") and labels.get("model_name") == model and app is not None:
                read = read_of.get((app, labels["read"]), labels["read"])
                per = monitors.setdefault(app, {}).setdefault(key, {})
                per[read] = per.get(read, 0) + value

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
