"""Per-app use of a serving frontend, counted on vLLM's /metrics: how often each app's gates
fire, and the latency of requests that use an app next to requests that use none.

Counted in the API server's output processor, from what every engine step already sends to
the frontend (new tokens, read results), so nothing is added to the engine's step:

- ``vllm:xmix_gate_tokens_total{app, gate}`` / ``vllm:xmix_gate_fired_tokens_total{app, gate}``:
  for each per-token gate (``READ CMP value``) of an app a request uses, the positions where
  READ ran (reported a value) and those where the comparison held. The threshold is the
  request's parameter value or the app's default at admission. Only the gate's own comparison
  is counted, not the rest of the op's condition.
- ``vllm:xmix_requests_stopped_total{app, read}`` / ``vllm:xmix_requests_switched_total{app,
  read}``: requests an app's stop ended, and requests in which one of its ``since(...)``
  conditions started to hold (once per term and request), by the read the condition reports
  (the first it names; "" for a condition on tokens alone).
- ``vllm:xmix_app_time_to_first_token_seconds{app}`` and
  ``vllm:xmix_app_time_per_output_token_seconds{app}``: per finished request, for every app it
  used (named, or deployed in mode ``all``); ``vllm:xmix_no_app_time_*`` for requests that
  used none. "Latency added" on the console is the difference of their means: requests of
  other lengths or under other load are compared, so it is an operator's estimate, not a
  benchmark (bench/ measures that).
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xmix.integrations.vllm.frontend.metrics import shown
from xmix.integrations.vllm.request_controls import CONTROL_KEY
from xmix.integrations.vllm.result_keys import CARRIER
from xmix.lang import conditions as C
from xmix.lang import reference as R
from xmix.lang.conditions import read_scalar
from xmix.lang.results_codec import STOPPED_KEY, SWITCHED_KEY, ReadResult

logger = logging.getLogger("vllm.xmix")


@dataclass
class _Gate:
    read: str  # the result key
    cmp: str
    threshold: float
    label: str
    channel: int | None = None  # one feature of an SAE features read (``name.f<id>``)


@dataclass
class _Record:
    apps: list[str]
    gates: dict[str, list[_Gate]]
    t0: float
    t_first: float | None = None
    t_last: float | None = None
    tokens: int = 0


def _f32(x: float) -> float:
    """A threshold as the kernels compare against it."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def gates_of(lowered, defaults: dict[str, float], overrides: dict[str, Any]) -> list[_Gate]:
    """The distinct per-token gates in an app's conditions, with their thresholds for one
    request (a parameter name takes the request's value, else the app's default)."""
    out: dict[str, _Gate] = {}
    for op in lowered.ops:
        for node in C.walk(op.cond) if op.cond is not None else ():
            if not isinstance(node, C.Gate):
                continue
            if isinstance(node.value, str):
                th = overrides.get(
                    node.value, defaults.get(node.value, lowered.app_params.get(node.value))
                )
                if th is None:
                    continue
            else:
                th = node.value
            label = C.to_text(node)
            key, channel = getattr(lowered, "aliases", {}).get(node.read, (node.read, None))
            out.setdefault(label, _Gate(key, node.cmp, _f32(float(th)), label, channel))
    return list(out.values())


def count_gate(values: list, gate: _Gate) -> tuple[int, int]:
    """(positions the read ran on, positions the gate held on) among one result's values."""
    ran = fired = 0
    for v in values:
        x = read_scalar(v, gate.channel)
        if x is None:  # not a scalar (a capture vector)
            continue
        ran += 1
        fired += R.compare(x, gate.cmp, gate.threshold)  # non-finite (null) compares false
    return ran, fired


def _values_of(entry: Any) -> list | None:
    """A gate read's values in the default JSON shape. The engine core sends results packed
    as raw arrays (``results_codec.ReadResult.pack``); only gate reads are unpacked here."""
    if isinstance(entry, dict) and "k" in entry and "v" in entry:
        return ReadResult.unpack(entry).json_values()
    if isinstance(entry, Mapping) and isinstance(entry.get("values"), list):
        return entry["values"]
    return None


class Usage:
    def __init__(self, registry, metrics: dict, clock=time.monotonic):
        self.registry = registry
        self.metrics = metrics
        self.model = registry.shape.model_name
        self.clock = clock
        self.records: dict[str, _Record] = {}
        self.lock = threading.Lock()

    def admitted(self, req_id: str, control: Any) -> None:
        control = control if isinstance(control, dict) else {}
        named = [a for a in control.get("apps") or [] if isinstance(a, str)]
        params = control.get("params") or {}
        applied = control.get("applied")  # what admission decided (a key's policy included)
        with self.registry.lock:
            deployed = self.registry.apps
            if isinstance(applied, dict):
                apps = [a["name"] for a in applied.get("apps") or [] if a.get("name") in deployed]
            else:
                apps = [a for a in named if a in deployed] + sorted(
                    a for a, d in deployed.items() if d.mode == "all" and a not in named
                )
            gates = {}
            for a in apps:
                d = deployed[a]
                g = gates_of(d.lowered, d.defaults, params.get(a) or {})
                if g:
                    gates[a] = g
        with self.lock:
            self.records[req_id] = _Record(apps, gates, self.clock())

    def outputs(self, engine_core_outputs) -> None:
        """One engine step's outputs, as the output processor receives them. One call a step,
        not one per output: most outputs carry no results and do not finish, and for those
        only the request's token times move (a Python call per output per token was a
        measurable part of the API server's work, bench/api_calls.py)."""
        records = self.records
        now = None
        for eco in engine_core_outputs:
            try:
                # no lock: a single dict lookup is atomic, and the record is only updated
                # here (the lock orders admission's insert against the finishing pop)
                rec = records.get(eco.request_id)
                if rec is None:
                    continue
                if eco.new_token_ids:
                    if now is None:
                        now = self.clock()
                    if rec.t_first is None:
                        rec.t_first = now
                    rec.t_last = now
                    rec.tokens += len(eco.new_token_ids)
                kvp = eco.kv_transfer_params
                res = kvp.get(CARRIER) if isinstance(kvp, dict) else None
                if res is not None or eco.finish_reason is not None:
                    self._output(eco.request_id, rec, res, eco.finish_reason is not None)
            except Exception:  # counting must never fail a request
                logger.debug("xmix: usage not counted", exc_info=True)

    def _output(self, req_id: str, rec: _Record, results: Any, finished: bool) -> None:
        """An output with results, or the one that finishes the request."""
        if finished:
            with self.lock:
                if self.records.pop(req_id, None) is None:
                    return  # dropped meanwhile
        if isinstance(results, dict):
            stop = results.get(STOPPED_KEY)
            if isinstance(stop, dict):
                self._inc("stopped", 1, app=str(stop.get("app")), read=str(stop.get("read") or ""))
            for sw in results.get(SWITCHED_KEY) or ():
                if isinstance(sw, dict):
                    self._inc("switched", 1, app=str(sw.get("app")), read=str(sw.get("read") or ""))
            for app, gates in rec.gates.items():
                reads = results.get(app)
                if not isinstance(reads, dict):
                    continue
                for g in gates:
                    values = _values_of(reads.get(g.read))
                    if values is None:
                        continue
                    ran, fired = count_gate(values, g)
                    if ran:
                        self._inc("gate_tokens", ran, app=app, gate=g.label)
                        self._inc("gate_fired", fired, app=app, gate=g.label)
        if finished:
            self._finished(rec)

    def dropped(self, req_ids) -> None:
        with self.lock:
            for r in req_ids:
                self.records.pop(r, None)

    def _finished(self, rec: _Record) -> None:
        if rec.t_first is None:
            return
        ttft = rec.t_first - rec.t0
        tpot = (
            (rec.t_last - rec.t_first) / (rec.tokens - 1)
            if rec.tokens > 1 and rec.t_last is not None
            else None
        )
        if not rec.apps:
            self._observe("plain_ttft", ttft)
            if tpot is not None:
                self._observe("plain_tpot", tpot)
            return
        for a in rec.apps:
            self._observe("app_ttft", ttft, app=a)
            if tpot is not None:
                self._observe("app_tpot", tpot, app=a)

    def _inc(self, name: str, n: float, **labels) -> None:
        self.metrics[name].labels(model_name=self.model, **shown(labels)).inc(n)

    def _observe(self, name: str, v: float, **labels) -> None:
        self.metrics[name].labels(model_name=self.model, **shown(labels)).observe(v)


_usage: Usage | None = None


def install(registry, output_processor_cls=None) -> Usage | None:
    """Count per-app use in this process's output processor (the API server's); once per
    process, after xmix's own output-processor patch, so its results are still in the engine
    outputs when this sees them. None where prometheus_client is unavailable."""
    global _usage
    from xmix.integrations.vllm.frontend import metrics

    m = metrics.get()
    if m is None or "gate_tokens" not in m or "stopped" not in m:
        return None
    if _usage is not None:
        _usage.registry = registry
        return _usage
    if output_processor_cls is None:
        from vllm.v1.engine.output_processor import OutputProcessor as output_processor_cls
    _usage = Usage(registry, m)
    from xmix.integrations.vllm import fence

    orig_add = fence.current(output_processor_cls, "add_request")
    orig_process = fence.current(output_processor_cls, "process_outputs")
    orig_abort = fence.current(output_processor_cls, "abort_requests")

    def add_request(self, request, *args, **kwargs):
        orig_add(self, request, *args, **kwargs)
        try:
            sp = getattr(request, "sampling_params", None)
            control = (sp.extra_args or {}).get(CONTROL_KEY) if sp is not None else None
            _usage.admitted(request.request_id, control)
        except Exception:  # counting must never fail a request
            logger.debug("xmix: usage not recorded", exc_info=True)

    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        _usage.outputs(engine_core_outputs)
        return orig_process(self, engine_core_outputs, *args, **kwargs)

    def abort_requests(self, request_ids, *args, **kwargs):
        aborted = orig_abort(self, request_ids, *args, **kwargs)
        _usage.dropped(aborted or ())
        return aborted

    fence.replace(output_processor_cls, "add_request", add_request, by="usage")
    fence.replace(output_processor_cls, "process_outputs", process_outputs, by="usage")
    fence.replace(output_processor_cls, "abort_requests", abort_requests, by="usage")
    return _usage
