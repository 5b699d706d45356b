"""One request on the transformers path (``xmix.integrations.hf``): its per-request state
(apps, parameters, spans, latches, CAST sums, results), each forward pass of it (token flags,
conditions, every op through ``xmix.lang.reference``, reads), user kernels called through their C
ABI, and a request's rows in a batch's site tensors. The module docstring of
``xmix.integrations.hf`` gives the semantics implemented here."""

from __future__ import annotations

import copy
import ctypes
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from xmix.lang import conditions as C
from xmix.lang import reference as R
from xmix.lang.catalog import FLT_MAX, KERNELS
from xmix.lang.lowering import (
    DeployError,
    LoweredApp,
    LoweredOp,
    RequestError,
    latch_from_generated,
)

NAN = float("nan")


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _f32(x: float) -> float:
    # The engine keeps thresholds and parameters as fp32; comparing against the fp32-rounded
    # value keeps a read that lands exactly on a threshold on the same side in both.
    return struct.unpack("f", struct.pack("f", x))[0]


class _CustomArgs(ctypes.Structure):
    """``xmix_custom_args`` of csrc/include/xmix/custom.h (the public ABI of user kernels)."""

    _fields_ = [
        ("h", ctypes.c_void_p),
        ("r", ctypes.c_void_p),
        ("stride_h", ctypes.c_int64),
        ("stride_r", ctypes.c_int64),
        ("n_rows", ctypes.c_int32),
        ("d", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("n_params", ctypes.c_int32),
        ("select", ctypes.c_void_p),
        ("tok_slot", ctypes.c_void_p),
        ("tok_pos", ctypes.c_void_p),
        ("slot_params", ctypes.c_void_p),
        ("param_base", ctypes.c_int32),
        ("artifact_numel", ctypes.c_int32),
        ("artifact", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
    ]


def load_custom(app: str, op: LoweredOp):
    ck = op.custom
    if not ck or not ck.cpu_library or not ck.cpu_symbol:
        raise DeployError(
            f"app {app!r}, op {op.label}: the transformers path runs user kernels on "
            f"the CPU and needs cpu_library and cpu_symbol"
        )
    try:
        lib = ctypes.CDLL(str(ck.cpu_library))
        fn = getattr(lib, ck.cpu_symbol)
    except (OSError, AttributeError) as e:
        raise DeployError(
            f"app {app!r}, op {op.label}: cannot load {ck.cpu_symbol!r} from "
            f"{ck.cpu_library!r}: {e}"
        ) from None
    fn.argtypes = [ctypes.POINTER(_CustomArgs)]
    fn.restype = None
    return fn


@dataclass
class AttachedApp:
    lowered: LoweredApp
    mode: str
    custom_fns: dict[int, Any] = field(default_factory=dict)  # id(LoweredOp) -> ctypes fn

    @property
    def name(self) -> str:
        return self.lowered.name


def _op_key(op: LoweredOp) -> str:
    # How "op.param" names an op in request parameters: its .named() name, else "#index".
    return op.name or f"#{op.op_index}"


def _param_range(op: LoweredOp, pname: str) -> tuple[float, float]:
    spec = KERNELS[op.kernel].params.get(pname)
    return (spec.lo, spec.hi) if spec else (-FLT_MAX, FLT_MAX)


def resolve_params(
    att: AttachedApp, given: Any
) -> tuple[dict[str, float], dict[tuple[int, str], float]]:
    """Request parameters of one app -> (app-level values, {(op_index, param): value}).

    A bare name is the app-level parameter of that name if there is one, else every op
    parameter of that name; "op.param" names one op (by its name, or "#index")."""
    lw = att.lowered
    who = f"app {lw.name!r}"
    if not isinstance(given, dict):
        raise RequestError(f"{who}: params must be a dict of name: number")
    app_vals: dict[str, float] = {}
    op_vals: dict[tuple[int, str], float] = {}
    for key, v in given.items():
        if not isinstance(key, str):
            raise RequestError(f"{who}: parameter names must be strings, got {key!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise RequestError(f"{who}: parameter {key!r} must be a finite number, got {v!r}")
        v = float(v)
        targets: list[LoweredOp] = []
        if "." in key:
            opname, pname = key.rsplit(".", 1)
            targets = [o for o in lw.ops if _op_key(o) == opname and pname in dict(o.params)]
        elif key in lw.app_params:
            app_vals[key] = v
            continue
        else:
            pname = key
            targets = [o for o in lw.ops if pname in dict(o.params)]
        if not targets:
            raise RequestError(f"{who}: unknown parameter {key!r}")
        for o in targets:
            lo, hi = _param_range(o, pname)
            if not lo <= v <= hi:
                raise RequestError(f"{who}: parameter {key!r}={v} out of range [{lo}, {hi}]")
            op_vals[(o.op_index, pname)] = v
    return app_vals, op_vals


class Request:
    """One request through an attachment: the prompt, its KV cache and its per-request state
    (apps used, parameters, span state, latched read statistics, CAST sums, read results).

    Drive it with ``prefill()`` then ``decode(token)`` per generated token, or use
    ``Attachment.generate``."""

    def __init__(
        self,
        attachment: Any,  # the xmix.integrations.hf.Attachment (not imported: no cycle)
        prompt_ids: list[int],
        apps: list[str],
        params: dict[str, dict[str, float]],
    ):
        self.attachment = attachment
        self.prompt = [int(t) for t in prompt_ids]
        if not self.prompt:
            raise RequestError("the prompt is empty")
        self.apps = list(apps)
        self.n_done = 0  # positions processed so far
        self.cache: Any = None  # its own KV cache (a DynamicCache, made on the first pass)
        self.app_params: dict[str, dict[str, float]] = {}
        self.op_params: dict[str, dict[tuple[int, str], float]] = {}
        for att in attachment.attached:
            self.app_params[att.name] = dict(att.lowered.app_params)
            self.op_params[att.name] = {}
        for name, p in params.items():
            av, ov = resolve_params(attachment.by_name[name], p)
            self.app_params[name].update(av)
            self.op_params[name].update(ov)
        self.spans: dict[tuple[str, str, str], bool] = {}  # (app, open, close) -> inside
        # (app, read key) -> [sum, count, value at the last prompt token] over prompt tokens
        self.read_stats: dict[tuple[str, str], list[float]] = {}
        self.cast_sums: dict[tuple[str, str], list] = {}  # (app, key) -> [sum (fp64), count]
        self.results: dict[str, dict[str, dict[str, list]]] = {}
        # (app, since(...) text) -> the first position where its condition held
        self.sticky: dict[tuple[str, str | None], int] = {}
        self.stopped: dict[str, Any] | None = None  # {app, read, position, value}
        self.switched: list[dict[str, Any]] = []  # {app, read, position, condition}

    def report(self) -> dict:
        """The results so far, with the stop and the switches under "!stopped"/"!switched"."""
        out: dict[str, Any] = copy.deepcopy(self.results)
        if self.stopped is not None:
            out["!stopped"] = dict(self.stopped)
        if self.switched:
            out["!switched"] = [dict(x) for x in self.switched]
        return out

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def uses(self, att: AttachedApp) -> bool:
        return att.mode == "all" or (att.mode == "request" and att.name in self.apps)

    def param(self, att: AttachedApp, op: LoweredOp, pname: str) -> float:
        default = dict(op.params)[pname]
        return self.op_params[att.name].get((op.op_index, pname), default)

    def prefill(self, chunk: int | None = None) -> torch.Tensor:
        """Run the rest of the prompt, in forward passes of ``chunk`` tokens (all at once by
        default); returns the logits of the last prompt token."""
        if self.n_done >= self.prompt_len:
            raise RequestError("the prompt has been processed already")
        if chunk is not None and chunk < 1:
            raise RequestError("chunk must be at least 1")
        if self.n_done >= self.prompt_len:
            raise RequestError("the prompt is already prefilled: decode the next token")
        logits = torch.empty(0)
        while self.n_done < self.prompt_len:
            end = self.prompt_len if chunk is None else min(self.prompt_len, self.n_done + chunk)
            logits = self._forward(self.prompt[self.n_done : end])
            if self.stopped is not None:
                break  # the request ends in this chunk: nothing more is computed
        return logits[-1]

    def decode(self, token: int) -> torch.Tensor:
        """Feed back one sampled token; returns its logits."""
        if self.n_done < self.prompt_len:
            raise RequestError("prefill the prompt first")
        return self._forward([int(token)])[-1]

    def _forward(self, ids: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        att = self.attachment
        if self.cache is None:
            self.cache = DynamicCache(config=att.model.config)
        step = Pass(self, ids, start=self.n_done)
        model = att.model
        input_ids = torch.tensor([ids], dtype=torch.long, device=att.device)
        att._own = [(step, Rows(0, list(range(len(ids))), 1, len(ids)))]
        try:
            with torch.no_grad():
                out = model(input_ids=input_ids, past_key_values=self.cache, use_cache=True)
        finally:
            att._own = None
        self.n_done += len(ids)
        return out.logits[0].float()

    def record(self, app: str, key: str, pos: int, value: Any) -> None:
        entry = self.results.setdefault(app, {}).setdefault(key, {"positions": [], "values": []})
        entry["positions"].append(pos)
        entry["values"].append(value)


class Pass:
    """One forward pass of a request: its tokens, their flags, and the values of every read
    that ran in this pass (for per-token gates)."""

    def __init__(self, req: Request, ids: list[int], start: int):
        self.req = req
        self.ids = ids
        self.n = len(ids)
        self.pos = [start + t for t in range(self.n)]
        P = req.prompt_len
        self.prompt = [p < P for p in self.pos]
        self.generated = [p >= P for p in self.pos]
        # Logits are sampled for the last token of a pass that reaches the end of the prompt.
        sampled = start + self.n >= P
        self.last = [sampled and t == self.n - 1 for t in range(self.n)]
        self.values: dict[tuple[str, str], list[float]] = {}
        self.span_flags: dict[tuple[str, str, str], list[bool]] = {}
        # Spans are followed for every attached app, used or not, as the engine's prologue
        # does: an app switched on in the middle of a request sees the right span state.
        for att in req.attachment.attached:
            lw = att.lowered
            for open_, close in lw.spans:
                k = (att.name, open_, close)
                flags, state = R.span_flags(
                    ids,
                    set(lw.token_sets[open_]),
                    set(lw.token_sets[close]),
                    req.spans.get(k, False),
                )
                self.span_flags[k] = flags
                req.spans[k] = state

    # -- conditions ---------------------------------------------------------------------
    def threshold(self, att: AttachedApp, value: float | str) -> float:
        v = self.req.app_params[att.name][value] if isinstance(value, str) else value
        return _f32(float(v))

    def holds(self, att: AttachedApp, op: LoweredOp, node, t: int) -> bool:
        if node is None:
            return True
        if isinstance(node, C.Flag):
            return {
                "all": True,
                "prompt": self.prompt[t],
                "generated": self.generated[t],
                "last_token": self.last[t],
            }[node.name]
        if isinstance(node, C.TokenIn):
            return self.ids[t] in att.lowered.token_sets[node.set]
        if isinstance(node, C.InSpan):
            return self.span_flags[(att.name, node.open, node.close)][t]
        if isinstance(node, C.Gate):
            v = self.values.get((att.name, node.read), [NAN] * self.n)[t]
            return R.compare(v, node.cmp, self.threshold(att, node.value))
        if isinstance(node, C.Latch):
            if latch_from_generated(att.lowered, op, node):
                decided = self.generated[t]
            else:
                decided = self.generated[t] or (self.prompt[t] and self.last[t])
            if not decided:
                return False
            s = self.req.read_stats.get((att.name, node.read))
            if s is None:
                return False
            if node.reduce == "prompt_last":
                v = s[2]
            elif s[1] > 0:
                v = s[0] / s[1]
            else:
                return False
            return R.compare(v, node.cmp, self.threshold(att, node.value))
        if isinstance(node, C.Since):
            start = self.req.sticky.get((att.name, C.to_text(node)))
            return R.since_holds(self.pos[t], start)
        if isinstance(node, C.And):
            return self.holds(att, op, node.a, t) and self.holds(att, op, node.b, t)
        if isinstance(node, C.Or):
            return self.holds(att, op, node.a, t) or self.holds(att, op, node.b, t)
        if isinstance(node, C.Not):
            return not self.holds(att, op, node.a, t)
        raise TypeError(f"unknown condition node {node!r}")

    # -- ops ----------------------------------------------------------------------------
    def run_op(self, att: AttachedApp, op: LoweredOp, rows: torch.Tensor) -> None:
        """Run one op on this request's rows ([n tokens, d], changed in place by writes)."""
        if rows.shape[0] != self.n:
            raise RuntimeError(
                f"xmix: site {op.site} has {rows.shape[0]} rows for a pass of {self.n} tokens"
            )
        if not self.req.uses(att):
            return
        mask_list = [self.holds(att, op, op.cond, t) for t in range(self.n)]
        mask = torch.tensor(mask_list, dtype=torch.bool, device=rows.device)
        arts = {k: v.to(rows.device) for k, v in op.artifacts.items()}
        p = lambda name: self.req.param(att, op, name)  # noqa: E731
        if op.kernel == "custom":
            self._run_custom(att, op, rows, mask_list)
            return
        if op.is_control:
            self._monitor(att, op, mask_list)
            return
        if op.is_read:
            self._read(att, op, rows, mask, mask_list, arts, p)
            return
        if op.kernel == "add":
            new = R.add(rows, None, mask, arts["a0"], p("scale"))
        elif op.kernel == "ablate":
            new = R.ablate(rows, None, mask, arts["a0"])
        elif op.kernel == "clamp":
            new = R.clamp(rows, None, mask, arts["a0"], p("min"), p("max"))
        elif op.kernel == "affine":
            new = R.affine(rows, None, mask, arts["a0"], arts["a1"], arts["a2"])
        elif op.kernel == "router":
            new = R.router(rows, mask, arts["a0"], p("delta"))
        elif op.kernel == "sae_steer":
            new = R.add(
                rows, None, mask, op.sae.W_dec[op.features].sum(0).to(rows.device), p("scale")
            )
        elif op.kernel == "sae_clamp":
            new = R.sae_clamp(rows, None, mask, op.sae, op.features, p("value"))
        else:
            raise DeployError(
                f"app {att.name!r}, op {op.label}: no oracle for kernel {op.kernel!r}"
            )
        rows.copy_(new.reshape(rows.shape))

    def _read(self, att, op, rows, mask, mask_list, arts, p) -> None:
        n = self.n
        values = [NAN] * n  # the scalar a gate or latch sees
        reported: dict[int, Any] = {}
        if op.kernel == "probe":
            v = R.probe(rows, arts["a0"], p("bias"))
            for t in range(n):
                if mask_list[t]:
                    values[t] = reported[t] = float(v[t])
        elif op.kernel == "distance":
            v = R.distance(rows, arts["a0"].reshape(op.n, -1))
            for t in range(n):
                if mask_list[t]:
                    values[t] = reported[t] = float(v[t])
        elif op.kernel == "capture":
            for t in range(n):
                if mask_list[t]:
                    # The engine's result channel holds 1.0 for a captured token; a gate
                    # on a capture read therefore means "it was captured".
                    values[t] = 1.0
                    reported[t] = rows[t, op.m : op.m + op.n].float().cpu().tolist()
        elif op.kernel == "cosine":
            # CAST: mean of the stream over the prompt tokens where the condition holds;
            # one value, at the last prompt token, once at least one token was summed.
            acc = self.req.cast_sums.setdefault(
                (att.name, op.result_key), [torch.zeros(rows.shape[-1], dtype=torch.float64), 0]
            )
            for t in range(n):
                if mask_list[t] and self.prompt[t]:
                    acc[0] += rows[t].double().cpu()
                    acc[1] += 1
                if self.prompt[t] and self.last[t] and acc[1] > 0:
                    mean = (acc[0] / acc[1]).float()
                    values[t] = reported[t] = float(R.cast_cosine(mean, arts["a0"].cpu()))
        elif op.kernel == "sae":
            acts = R.sae_encode(rows, op.sae)
            if op.features:
                sub = acts[:, op.features].cpu()
                for i, f in enumerate(op.features):  # each feature is a read of its own for gates
                    self._note_values(
                        att,
                        f"{op.result_key}.f{f}",
                        [float(sub[t, i]) if mask_list[t] else NAN for t in range(n)],
                    )
                for t in range(n):
                    if mask_list[t]:
                        values[t] = float(sub[t, 0])
                        reported[t] = {"ids": list(op.features), "acts": sub[t].tolist()}
            else:
                top = R.sae_top(acts, op.top_k)
                for t in range(n):
                    if mask_list[t]:
                        ids, a = top[t]
                        values[t] = a[0] if a else 0.0  # the largest activation
                        reported[t] = {"ids": ids, "acts": a}
        else:
            raise DeployError(f"app {att.name!r}, op {op.label}: no oracle for read {op.kernel!r}")
        self._note_read(att, op, values, reported)

    def _monitor(self, att: AttachedApp, op: LoweredOp, mask_list: list[bool]) -> None:
        """A stop or a since(...) term: the first position of this pass where its condition
        held, if none before it did."""
        req = self.req
        first = R.first_held(mask_list, self.pos)
        if first is None:
            return
        if op.kernel == "since":
            key = (att.name, op.sticky)
            if key not in req.sticky:
                req.sticky[key] = first
                req.switched.append(
                    {
                        "app": att.name,
                        "read": op.monitor_read,
                        "position": first,
                        "condition": op.sticky,
                    }
                )
            return
        if req.stopped is None:
            value = None
            if op.monitor_read is not None:
                v = self.values.get((att.name, op.monitor_read), [NAN] * self.n)[
                    self.pos.index(first)
                ]
                value = v if v == v else None
            req.stopped = {
                "app": att.name,
                "read": op.monitor_read,
                "position": first,
                "value": value,
            }

    def _note_values(self, att, key: str, values: list[float]) -> None:
        self.values[(att.name, key)] = values
        stats = self.req.read_stats.setdefault((att.name, key), [0.0, 0, NAN])
        for t, v in enumerate(values):
            if v == v and self.prompt[t]:
                stats[0] += v
                stats[1] += 1
                if self.last[t]:
                    stats[2] = v

    def _note_read(self, att, op, values: list[float], reported: dict[int, Any]) -> None:
        self.values[(att.name, op.result_key)] = values
        stats = self.req.read_stats.setdefault((att.name, op.result_key), [0.0, 0, NAN])
        for t, v in enumerate(values):
            if v != v or not self.prompt[t]:
                continue
            stats[0] += v
            stats[1] += 1
            if self.last[t]:
                stats[2] = v
        for t in sorted(reported):
            self.req.record(att.name, op.result_key, self.pos[t], reported[t])

    def _run_custom(self, att, op, rows, mask_list) -> None:
        if rows.dtype not in _DTYPE_CODES:
            raise RuntimeError(f"xmix: user kernel on a {rows.dtype} stream")
        n, d = rows.shape
        h = rows.detach().cpu().contiguous().clone()
        select = torch.tensor(mask_list, dtype=torch.uint8)
        slot = torch.zeros(n, dtype=torch.int32)
        pos = torch.tensor(self.pos, dtype=torch.int32)
        pnames = [k for k, _ in op.params]
        prm = torch.tensor(
            [self.req.param(att, op, k) for k in pnames] or [0.0], dtype=torch.float32
        )
        art = op.artifacts.get("a0")
        art = art.float().contiguous() if art is not None else None
        out = torch.full((n,), NAN, dtype=torch.float32) if op.is_read else None
        args = _CustomArgs(
            h=h.data_ptr(),
            r=None,
            stride_h=d,
            stride_r=0,
            n_rows=n,
            d=d,
            dtype=_DTYPE_CODES[rows.dtype],
            n_params=len(pnames),
            select=select.data_ptr(),
            tok_slot=slot.data_ptr(),
            tok_pos=pos.data_ptr(),
            slot_params=prm.data_ptr(),
            param_base=0,
            artifact_numel=int(art.numel()) if art is not None else 0,
            artifact=art.data_ptr() if art is not None else None,
            out=out.data_ptr() if out is not None else None,
        )
        att.custom_fns[id(op)](ctypes.byref(args))
        if out is not None:  # a read
            values = [float(out[t]) if mask_list[t] else NAN for t in range(n)]
            reported = {t: v for t, v in enumerate(values) if v == v}
            self._note_read(att, op, values, reported)
        else:
            rows.copy_(h.to(rows.device).reshape(rows.shape))


class Rows:
    """One request's rows in a site tensor of a batch: row ``b`` of B, token columns ``cols``
    of T (the positions its attention mask keeps). Site tensors are [B, T, ...] or, for
    routers, [B*T, ...]."""

    def __init__(self, b: int, cols: list[int], B: int, T: int):
        self.b, self.cols, self.B, self.T = b, cols, B, T
        lo = cols[0] if cols else 0
        self.span = (lo, lo + len(cols)) if cols == list(range(lo, lo + len(cols))) else None
        self._idx = None if self.span else torch.tensor(cols, dtype=torch.long)

    def _grid(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() != self.B * self.T * tensor.shape[-1]:
            raise RuntimeError(
                f"xmix: a site tensor of shape {list(tensor.shape)} in a pass of "
                f"{self.B} x {self.T} tokens"
            )
        return tensor.view(self.B, self.T, tensor.shape[-1])

    def _index(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self._idx is not None  # made whenever the columns are not one span
        return self._idx.to(tensor.device)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        g = self._grid(tensor)
        if self.span is not None:
            return g[self.b, self.span[0] : self.span[1]]  # a view: writes land in place
        return g[self.b, self._index(tensor)]

    def put(self, tensor: torch.Tensor, rows: torch.Tensor) -> None:
        if self.span is None:
            self._grid(tensor)[self.b, self._index(tensor)] = rows
