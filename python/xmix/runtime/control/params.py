"""An app's parameter row: which column holds which parameter, and a request's named values
resolved to columns (shared by the engine's control block and the frontend's checks)."""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass
from typing import Any

from xmix.lang import conditions as C
from xmix.lang.catalog import FLT_MAX, KERNELS
from xmix.lang.lowering import LoweredApp, RequestError, param_bounds


@dataclass
class ParamCol:
    name: str
    op: str | None  # None: app-level parameter
    default: float
    public: bool = True  # False: a constant of a condition
    lo: float = -FLT_MAX
    hi: float = FLT_MAX

    @property
    def key(self) -> str:
        return self.name if self.op is None else f"{self.op}.{self.name}"


def param_columns(lw: LoweredApp) -> list[ParamCol]:
    """An app's columns in each request's parameter row: app params, each op's params in
    lowered order, then the constants its conditions compare against."""
    cols: list[ParamCol] = [ParamCol(p, None, v) for p, v in lw.app_params.items()]
    for o in lw.ops:
        bounds = param_bounds(o)
        for p, v in o.params:
            spec = KERNELS[o.kernel].params.get(p)
            lo, hi = (spec.lo, spec.hi) if spec else (-FLT_MAX, FLT_MAX)
            b_lo, b_hi = bounds.get(p, (lo, hi))
            cols.append(
                ParamCol(p, o.name or f"#{o.op_index}", v, True, max(lo, b_lo), min(hi, b_hi))
            )
    seen: set[float] = set()
    for o in lw.ops:
        for node in C.walk(o.cond) if o.cond is not None else ():
            if (
                isinstance(node, (C.Gate, C.Latch))
                and isinstance(node.value, float)
                and node.value not in seen
            ):
                seen.add(node.value)
                cols.append(ParamCol(f"__const{len(seen)}", None, node.value, False))
    return cols


def op_param_offsets(lw: LoweredApp) -> list[int]:
    """Per op of ``lw.ops`` (by position), its first column in the app's row (param_columns'
    order: app params, then each op's in turn)."""
    out, i = [], len(lw.app_params)
    for o in lw.ops:
        out.append(i)
        i += len(o.params)
    return out


def resolve_params(cols: list[ParamCol], params: Any, who: str) -> dict[int, float]:
    """Map {"scale": 2.0, "op.scale": 1.0, "theta": 0.5} to column indices.

    A bare name is an app-level parameter if one has that name, else every op parameter of
    that name; "op.param" names one op."""
    if not isinstance(params, dict):
        raise RequestError(f"{who}: params must be an object of name: number")
    out: dict[int, float] = {}
    for key, v in params.items():
        if not isinstance(key, str):
            raise RequestError(f"{who}: parameter names must be strings, got {key!r}")
        try:
            finite = (
                not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v))
            )
        except OverflowError:  # an int beyond any float
            finite = False
        if not finite:
            shown = (
                "an integer too large for a float"
                if isinstance(v, int) and not isinstance(v, bool)
                else short_repr(v)
            )
            raise RequestError(f"{who}: parameter {key!r} must be a finite number, got {shown}")
        if "." in key:
            op, p = key.rsplit(".", 1)
            hits = [i for i, c in enumerate(cols) if c.public and c.op == op and c.name == p]
        else:
            hits = [i for i, c in enumerate(cols) if c.public and c.op is None and c.name == key]
            if not hits:
                hits = [i for i, c in enumerate(cols) if c.public and c.name == key]
        if not hits:
            known = sorted(c.key for c in cols if c.public)
            raise RequestError(f"{who}: unknown parameter {key!r}; known: {known}")
        for i in hits:
            c = cols[i]
            if not (c.lo <= float(v) <= c.hi):
                raise RequestError(
                    f"{who}: parameter {key!r}={v} out of range [{c.lo:g}, {c.hi:g}]"
                )
            out[i] = float(v)
    return out


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 60, 60


def short_repr(v: Any) -> str:
    """A bounded repr of a value a client sent (deep nesting is not recursed into)."""
    return _REPR.repr(v)
