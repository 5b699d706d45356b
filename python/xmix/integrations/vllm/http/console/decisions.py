"""Which tokens an app's conditions held on, worked out after the fact from what a request
returned: its token ids, its prompt length and its read results.

The engine does not report condition decisions; the console marks them where the results
determine them, with the semantics of ``xmix.lang.conditions`` (the transformers path,
``xmix.integrations.hf``, evaluates the same rules while it runs):

- ``all``, ``prompt``, ``generated``, ``last_token``, ``token_in``, ``in_span``: from the
  token ids and the prompt length.
- a gate ``READ CMP value``: from READ's value at that position (an SAE read's first channel,
  ``name.f<id>`` one feature's); a position where READ did not run (no value reported) compares
  false, as NaN does in the kernels. Capture reads (vectors) are not comparable: unknown.
- a latch ``prompt_mean(READ)`` / ``prompt_last(READ)``: from READ's values over the prompt,
  decided at the last prompt token (or from the first generated token for an op at or before
  the read's site, ``lowering.latch_from_generated``).
- ``and`` / ``or`` / ``not`` in three-valued logic: a part that the results do not determine
  makes the whole unknown unless the other part decides it.

A parameter named in a condition takes the request's value where the request set one, else
the app's current default.
"""

from __future__ import annotations

import math
import struct

from xmix.lang import conditions as C
from xmix.lang import reference as R
from xmix.lang.lowering import LoweredApp, LoweredOp, latch_from_generated
from xmix.lang.sites import site_name

Unknown = None


class _Eval:
    def __init__(
        self,
        lowered: LoweredApp,
        ids: list[int],
        prompt_len: int,
        results: dict,
        params: dict[str, float],
    ):
        self.lw = lowered
        self.ids = ids
        self.P = prompt_len
        self.n = max(len(ids) - 1, 0)  # the last sampled token is never fed back
        self.params = params
        self.results = results if isinstance(results, dict) else {}
        self.reads: dict[str, dict[int, float | None] | None] = {}
        self.spans: dict[tuple[str, str], list[bool]] = {}

    def threshold(self, value: float | str) -> float | None:
        if isinstance(value, str):
            v = self.params.get(value, self.lw.app_params.get(value))
            if v is None:
                return None
            value = v
        # The kernels compare in fp32: the threshold is rounded as they see it.
        try:
            return float(struct.unpack("f", struct.pack("f", float(value)))[0])
        except OverflowError:
            return math.copysign(math.inf, float(value))

    def values(self, read: str) -> dict[int, float | None] | None:
        """Position -> scalar of the read a condition names (a result key, or ``name.f<id>``);
        None when the results do not hold it."""
        if read not in self.reads:
            key, channel = getattr(self.lw, "aliases", {}).get(read, (read, None))
            entry = self.results.get(key)
            if isinstance(entry, dict) and isinstance(entry.get("positions"), list):
                self.reads[read] = {
                    p: C.read_scalar(v, channel)
                    for p, v in zip(entry["positions"], entry.get("values") or [])
                }
            else:
                self.reads[read] = None
        return self.reads[read]

    def read_at(self, read: str, t: int) -> float | None:
        vals = self.values(read)
        if vals is None:
            return None  # no results for this read: undetermined
        if t not in vals:
            return math.nan  # the read did not run on this token
        return vals[t]

    def span(self, open_: str, close: str) -> list[bool]:
        k = (open_, close)
        if k not in self.spans:
            flags, _ = R.span_flags(
                self.ids[: self.n],
                set(self.lw.token_sets.get(open_, [])),
                set(self.lw.token_sets.get(close, [])),
            )
            self.spans[k] = flags
        return self.spans[k]

    def latch_value(self, node: C.Latch) -> float | None:
        vals = self.values(node.read)
        if vals is None:
            return None
        if node.reduce == "prompt_last":
            return vals.get(self.P - 1, math.nan)
        prompt = [v for p, v in vals.items() if p < self.P]
        if any(x is None for x in prompt):
            return None
        finite = [x for x in prompt if x is not None and x == x]
        return sum(finite) / len(finite) if finite else math.nan

    def holds(self, op: LoweredOp, node, t: int) -> bool | None:
        if isinstance(node, C.Flag):
            return {
                "all": True,
                "prompt": t < self.P,
                "generated": t >= self.P,
                "last_token": t >= self.P - 1,
            }[node.name]
        if isinstance(node, C.TokenIn):
            return self.ids[t] in set(self.lw.token_sets.get(node.set, []))
        if isinstance(node, C.InSpan):
            return self.span(node.open, node.close)[t]
        if isinstance(node, C.Gate):
            v, th = self.read_at(node.read, t), self.threshold(node.value)
            if v is None or th is None:
                return Unknown
            return R.compare(v, node.cmp, th)
        if isinstance(node, C.Latch):
            start = self.P if latch_from_generated(self.lw, op, node) else self.P - 1
            if t < start:
                return False
            v, th = self.latch_value(node), self.threshold(node.value)
            if v is None or th is None:
                return Unknown
            return R.compare(v, node.cmp, th)
        if isinstance(node, C.Not):
            a = self.holds(op, node.a, t)
            return None if a is None else not a
        if isinstance(node, (C.And, C.Or)):
            a, b = self.holds(op, node.a, t), self.holds(op, node.b, t)
            if isinstance(node, C.And):
                if a is False or b is False:
                    return False
                return None if a is None or b is None else True
            if a is True or b is True:
                return True
            return None if a is None or b is None else False
        raise TypeError(f"unknown condition node {node!r}")


def decisions(
    lowered: LoweredApp,
    ids: list[int],
    prompt_len: int,
    results: dict,
    params: dict[str, float] | None = None,
) -> list[dict]:
    """Per op of ``lowered`` that has a condition: its label, kernel, site, condition text and
    ``fired``, one entry per computed position (0 .. len(ids) - 2): True, False, or None where
    the results do not determine it. ``results`` is this app's part of the request's results
    ({read: {positions, values}}); ``params`` the request's parameter values for this app."""
    if not 0 < prompt_len <= len(ids):
        raise ValueError(
            f"prompt_len must be in 1..{len(ids)} (the request's tokens), got {prompt_len}"
        )
    ev = _Eval(lowered, list(ids), prompt_len, results or {}, dict(params or {}))
    out = []
    for op in lowered.ops:
        if op.cond is None:
            continue
        out.append(
            {
                "op": op.label,
                "name": op.name or f"#{op.op_index}",
                "kernel": op.kernel,
                "primitive": op.primitive,
                "site": site_name(op.site_id, lowered.shape.n_layers),
                "cond": C.to_text(op.cond),
                "fired": [ev.holds(op, op.cond, t) for t in range(ev.n)],
            }
        )
    return out
