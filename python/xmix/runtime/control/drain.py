"""Draining a step's reads: which result channels and capture rows hold what, and turning
them into per-request ``ReadResult`` arrays within each request's window and byte budget
(``Drain``, the block's part the worker calls after each forward).

On a CPU engine the drain reads the buffers themselves. Staged (GPU), ``ReadBack`` queues the
step's results (and only the capture rows some request can report) to a pinned read-back set
on a side stream; the host waits only when the step's ``PendingReads`` is asked for them.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

import xmix._C as _C
from xmix.lang.lowering import LoweredOp
from xmix.lang.results_codec import (
    STOPPED_KEY,
    SWITCHED_KEY,
    ReadResult,
    ReadShape,
    max_result_bytes,
    pack_results,
    position_bytes,
    read_shape,
    to_dtype,
)
from xmix.runtime.control.layout import GATHER_ROWS, Capacity, K
from xmix.runtime.device_queue import DeviceQueue, PinnedRing, PinnedSet

if TYPE_CHECKING:
    from xmix.runtime.control.link import InstalledApp
    from xmix.runtime.control.memory import BlockMemory
    from xmix.runtime.control.site_state import SiteReports
    from xmix.runtime.control.slots import Slots, SlotState
    from xmix.runtime.control.step import Step

logger = logging.getLogger("xmix")

Arr = np.ndarray[Any, Any]
Results = dict[str, dict[str, Any]]  # req id -> {app: {read: ReadResult}, TRUNCATED_KEY: str}


class PlannedRead(NamedTuple):
    """One active read of a step. ``capture``: where its rows are (capture or top-K SAE
    reads): (offset, row width) in the capture buffer, or, staged, (offset, width, row map)
    in the read-back set (row map: token -> copied row, None when every row was copied)."""

    app: str
    key: str
    channel: int
    capture: tuple[Any, ...] | None
    op: LoweredOp
    shape: ReadShape  # read_shape(op), made once with the plan


def read_plan(apps: Iterable[InstalledApp], step_active: int) -> list[PlannedRead]:
    """This step's active reads; rows in the capture buffer are a capture read's vectors or a
    top-K SAE read's ids and activations."""
    plan = []
    for inst in apps:
        if not (step_active >> inst.index) & 1 or not inst.channels:
            continue
        for key, ch in inst.channels.items():
            if key not in inst.lowered.reads:
                continue  # one feature of an SAE read, reported with the read
            lo = inst.read(key)
            op = lo.op
            cap: tuple[int, int] | None
            if op.kernel == "capture":
                cap = (lo.capture_offset, op.capture_width)
            elif op.kernel == "sae" and not op.features:
                cap = (lo.capture_offset, 2 * op.top_k)
            else:
                cap = None
            plan.append(PlannedRead(inst.name, key, ch, cap, op, read_shape(op)))
    return plan


class MonitorPlan(NamedTuple):
    """What a step's monitor records mean: app index -> (app, the read its stop reports), and
    since index -> (app, the read its term reports, the term's text)."""

    stops: dict[int, tuple[str, str | None]]
    sinces: dict[int, tuple[str, str | None, str]]


def monitor_plan(apps: Iterable[InstalledApp], step_active: int) -> MonitorPlan:
    stops: dict[int, tuple[str, str | None]] = {}
    sinces: dict[int, tuple[str, str | None, str]] = {}
    for inst in apps:
        if not (step_active >> inst.index) & 1:
            continue
        stop = inst.lowered.stop
        if stop is not None:
            stops[inst.index] = (inst.name, stop.monitor_read)
        for text, k in inst.sinces.items():
            sinces[k] = (inst.name, inst.lowered.sinces[text].monitor_read, text)
    return MonitorPlan(stops, sinces)


_NO_STOP = np.uint64(0xFFFFFFFFFFFFFFFF)


def collect_monitors(
    plan: MonitorPlan,
    row_stop: Arr,
    row_switched: Arr,
    sticky: Arr,
    slots: Arr,
    states: list[SlotState | None],
) -> Results:
    """Per request of the step: the stop its monitors recorded (``STOPPED_KEY``: the earliest
    trigger, control.h: stop_key) and the since terms that started to hold (``SWITCHED_KEY``,
    at the first position their condition held: the slot's since column)."""
    out: Results = {}
    keys = np.asarray(row_stop).view(np.uint64)
    bits = np.asarray(row_switched).view(np.uint32)
    shift = np.uint64(64 - K["STOP_POSITION_BITS"])
    M = K["MAX_STICKY"]
    for j in np.flatnonzero((keys != _NO_STOP) | (bits != 0)).tolist():
        st = states[j]
        if st is None:
            continue
        key = keys[j]
        if key != _NO_STOP:
            app = int((key >> np.uint64(32)) & np.uint64(63))
            name, read = plan.stops.get(app, (None, None))
            if name is not None:
                v = float(np.uint32(key & np.uint64(0xFFFFFFFF)).view(np.float32))
                out.setdefault(st.req_id, {})[STOPPED_KEY] = {
                    "app": name,
                    "read": read,
                    "position": int(key >> shift),
                    "value": v if v == v else None,
                }
        b = int(bits[j])
        while b:
            k = (b & -b).bit_length() - 1
            b &= b - 1
            hit = plan.sinces.get(k)
            if hit is None:
                continue
            out.setdefault(st.req_id, {}).setdefault(SWITCHED_KEY, []).append(
                {
                    "app": hit[0],
                    "read": hit[1],
                    "position": int(sticky[int(slots[j]) * M + k]),
                    "condition": hit[2],
                }
            )
    return out


# A read's hits in a step: (token indices, the channel's values at them or None, positions,
# positions as a list, the row of each request's first hit, bounds: offsets into the indices
# where each request's hits start, and their end; None when each request has one hit)
Hits = tuple[Arr, Arr | None, Arr, list[int], list[int], list[int] | None]


def numpy_hits(valid: Arr, rows: Arr, pos: Arr, ch: int) -> Hits:
    """A read's hits from the step's arrays (the staged engines' read-back sets; the twin of
    ``xmix._C.read_hits``, which reads an unstaged engine's buffers in one pass)."""
    idx = np.flatnonzero(valid[:, ch])
    n = len(idx)
    r = rows[idx]
    p = pos[idx]
    breaks = np.flatnonzero(r[1:] != r[:-1])
    if len(breaks) == n - 1 or not n:
        return idx, None, p, p.tolist(), r.tolist(), None
    bounds = [0, *(breaks + 1).tolist(), n]
    return idx, None, p, p.tolist(), r[bounds[:-1]].tolist(), bounds


def collect(
    res: Arr,
    valid: Arr,
    pos: Arr,
    rows: Arr,
    states: Sequence[SlotState | None],
    plan: list[PlannedRead],
    captured: Callable[[tuple[Any, ...], Arr], Arr],
    hits: Callable[[int], Hits] | None = None,
    packed: bool = False,
) -> Results:
    """Per request, the hits of each planned read as arrays: ``res`` and ``valid`` the
    step's result channels and their flags, ``states`` each row's request (None: none),
    ``captured(cap, idx)`` the capture-buffer rows of the tokens idx (only those are copied).
    Each request's window and byte budget apply here, so nothing it does not report leaves
    the worker. ``hits(channel)``: a read's hits (numpy_hits over valid, rows and pos when
    None). ``packed``: each request's results in ``ReadResult.pack``'s form (bytes cut from
    the step's, for the engine's worker, which sends them on as bytes) instead of views.

    Each read keeps one array of positions and one of values for the step (every request's
    reported tokens, in batch order); each request's ReadResult holds views of them. Numpy
    runs per read, not per request (except for a request with a window of positions); the
    work per request is a few integer comparisons on lists, because this loop runs on every
    step of every request with a read, where the engine's step waits for it (a request's
    tokens are contiguous and in position order)."""
    out: Results = {}
    server_cap: list[int] = []  # XMIX_MAX_RESULT_BYTES, read once per drain when a request needs it
    per_of: dict[tuple[int, int], int] = {}  # (read shape, request options) -> bytes a position
    for app, key, ch, cap, op, shape in plan:
        idx, chvals, p_all, pl, firsts, some = (
            numpy_hits(valid, rows, pos, ch) if hits is None else hits(ch)
        )
        n = len(idx)
        if not n:
            continue
        # one token per request (decode steps): request j is [j, j + 1)
        bounds: Sequence[int] = range(n + 1) if some is None else some
        rk = (app, key)
        # per request: (state, a, b) a range of idx, or (state, -1, sel) the window's tokens
        picks: list[tuple[SlotState, int, Any]] = []
        whole = True  # every hit reported, in order: idx itself is the step's selection
        for j, row in enumerate(firsts):
            st = states[row]
            if st is None:
                whole = False
                continue
            a, b = bounds[j], bounds[j + 1]
            # A preempted request recomputes positions it already reported (with the
            # same values): report each position once.
            reported = st.reported
            done = reported.get(rk, -1)
            if pl[a] <= done:
                a = bisect_right(pl, done, a, b)
                whole = False
                if a == b:
                    continue
            reported[rk] = pl[b - 1]
            opts = st.options
            if st.truncated:
                whole = False
                continue
            if opts.window is not None:
                sel = st.admit(idx[a:b], p_all[a:b], shape, app, out, server_cap)
                whole = False
                if len(sel):
                    picks.append((st, -1, sel))
                continue
            # st.fit, without the call while the budget holds (it does the truncation)
            pk = (id(shape), id(opts))
            per = per_of.get(pk)
            if per is None:
                per = per_of[pk] = position_bytes(shape, opts)
            budget = opts.max_bytes
            if budget is None:
                if not server_cap:
                    server_cap.append(max_result_bytes())
                budget = server_cap[0]
            k = b - a
            if k * per <= budget - st.spent:
                st.spent += k * per
            else:
                k = st.fit(k, shape, out, server_cap)
                whole = False
            if k:
                picks.append((st, a, a + k))
        if not picks:
            continue
        if cap is not None and len(cap) == 3 and cap[2] is not None:
            kept = copied_only(
                [(st, idx[a:b] if a >= 0 else b) for st, a, b in picks], cap[2], app, key
            )
            picks = [(st, -1, sel) for st, sel in kept]
            whole = False
            if not picks:
                continue
        if whole:
            every, positions = idx, p_all
        else:
            parts = [idx[a:b] if a >= 0 else b for _, a, b in picks]
            every = parts[0] if len(parts) == 1 else np.concatenate(parts)
            positions = pos[every]
        if whole and chvals is not None and shape.kind == "scalar":
            values, ids = chvals, None
        else:
            values, ids = gather(
                op, shape, res, ch, every, captured(cap, every) if cap is not None else None
            )
        stored: dict[str, Arr] = {}  # values in each storage dtype the step's requests ask for
        kind, features = shape.kind, op.features
        if packed:
            # ReadResult.pack's form, each request's part cut from the step's bytes
            pb = np.ascontiguousarray(positions, dtype=np.int32).tobytes()
            ib = b"" if ids is None else np.ascontiguousarray(ids, dtype=np.int32).tobytes()
            iw = 0 if ids is None else 4 * int(np.prod(ids.shape[1:]))
            tail = list(values.shape[1:])
            vbytes: dict[str, tuple[bytes, int]] = {}
        at = 0
        for st, a, b in picks:
            k = b - a if a >= 0 else len(b)
            dtype = st.options.dtype
            rr: Any
            if packed:
                vb = vbytes.get(dtype)
                if vb is None:
                    sv = to_dtype(values, dtype)
                    vb = vbytes[dtype] = (sv.tobytes(), sv.nbytes // len(sv))
                data, w = vb
                rr = {
                    "k": kind,
                    "dt": dtype,
                    "p": pb[4 * at : 4 * (at + k)],
                    "v": data[w * at : w * (at + k)],
                    "s": list(tail),
                }
                if ids is not None:
                    rr["i"] = ib[iw * at : iw * (at + k)]
                if features:
                    rr["f"] = list(features)
            else:
                v = stored.get(dtype)
                if v is None:
                    v = stored[dtype] = to_dtype(values, dtype)
                rr = ReadResult.views(
                    kind,
                    positions[at : at + k],
                    v[at : at + k],
                    None if ids is None else ids[at : at + k],
                    dtype,
                    features,
                )
            at += k
            mine = out.get(st.req_id)
            if mine is None:
                out[st.req_id] = {app: {key: rr}}
            else:
                got = mine.get(app)
                if got is None:
                    mine[app] = {key: rr}
                else:
                    got[key] = rr
    return out


def copied_only(
    picks: list[tuple[SlotState, Arr]], rowmap: Arr, app: str, key: str
) -> list[tuple[SlotState, Arr]]:
    out = []
    for st, sel in picks:
        ok = rowmap[sel] >= 0
        if not ok.all():  # a read ran where no request's window asked for it: a bug, said aloud
            logger.error(
                "xmix: %d rows of read %s.%s for request %s were not copied to the host; "
                "they are left out",
                int((~ok).sum()),
                app,
                key,
                st.req_id,
            )
            sel = sel[ok]
        if len(sel):
            out.append((st, sel))
    return out


def gather(
    op: LoweredOp, shape: Any, res: Arr, ch: int, idx: Arr, rows: Arr | None
) -> tuple[Arr, Arr | None]:
    """(values, ids) of the tokens idx: a scalar read's channel, a capture read's rows, an SAE
    read's listed features (consecutive channels) or its top-K rows (ids, activations;
    unused places hold id -1)."""
    if shape.kind == "features":
        return res[idx, ch : ch + op.n_channels], None
    if shape.kind == "topk":
        assert rows is not None
        k = op.top_k
        return rows[:, k:], rows[:, :k].astype(np.int32)
    if shape.kind == "vector":
        assert rows is not None
        return rows, None
    return res[idx, ch], None


class PendingReads:
    """One step's reads on their way to the host (staged engines). Also what keeps its pinned
    read-back set busy: query() is whether it was resolved, synchronize() resolves it."""

    def __init__(
        self,
        rb: ReadBack,
        event: Any,
        pinned: PinnedSet,
        n_tok: int,
        pos: Arr,
        rows: Arr,
        states: list[SlotState | None],
        plan: list[PlannedRead],
        monitors: tuple[MonitorPlan, Arr] | None = None,
    ):
        self.rb, self.event, self.n_tok = rb, event, n_tok
        self.set: PinnedSet | None = pinned  # None once resolved (the set is free again)
        self.pos, self.rows, self.states, self.plan = pos, rows, states, plan
        self.monitors = monitors  # (plan, the step's row slots) when monitors ran
        self.out: Results | None = None

    def result(self) -> Results:
        return self.out if self.out is not None else self.rb.resolve(self)

    def query(self) -> bool:
        return self.out is not None

    def synchronize(self) -> None:
        self.result()


class ReadBack:
    """Staged read-back: results and capture rows to pinned host sets on a side stream."""

    def __init__(self, xfer: DeviceQueue, cap: Capacity, device: torch.device):
        T, R, S = cap.max_tokens, cap.max_channels, cap.max_slots
        self.xfer, self.cap, self.device = xfer, cap, device
        self.ring = PinnedRing(
            xfer,
            cap.staging_depth,
            {
                "results": (T * R, torch.float32),
                "valid": (T * R, torch.uint8),
                "capture": (cap.capture_floats, torch.float32),
                "gather_idx": (GATHER_ROWS * T, torch.int64),
                "row_stop": (S, torch.int64),
                "row_switched": (S, torch.int32),
                "sticky": (S * K["MAX_STICKY"], torch.int32),
            },
            eager=False,
        )
        self.gather_dev: dict[str, torch.Tensor] = {}  # made when a window first narrows a copy
        # The last step's copy: the next forward rewrites the results buffer only after it.
        self.event: Any = None
        self.pending: deque[PendingReads] = deque()
        self.lock = threading.Lock()

    def queue(
        self,
        dev: dict[str, torch.Tensor],
        plan: list[PlannedRead],
        n_tok: int,
        st: PinnedSet,
        slots: Arr,
        states: list[SlotState | None],
        wanted_rows: Callable[[str, Arr], Arr | None],
        monitors: MonitorPlan | None = None,
    ) -> PendingReads:
        """Queue this step's results and capture rows; ``wanted_rows(app, pos)`` is the
        tokens whose capture rows a read of the app can report (None: every one).

        A capture read's rows are copied whole unless the requests' windows (or requests
        without the app) leave some out: then only the rows that can be reported are gathered
        on the device first, and only those cross to the host."""
        R = self.cap.max_channels
        s = self.ring.next()
        pos, rows = st.np["tok_pos"][:n_tok].copy(), st.np["tok_row"][:n_tok].copy()
        pairs = [
            (s.buf("results")[: n_tok * R], dev["results"][: n_tok * R]),
            (s.buf("valid")[: n_tok * R], dev["result_valid"][: n_tok * R]),
        ]
        if monitors is not None:
            n_rows = len(slots)
            pairs += [
                (s.buf("row_stop")[:n_rows], dev["row_stop"][:n_rows]),
                (s.buf("row_switched")[:n_rows], dev["row_switched"][:n_rows]),
            ]
            if monitors.sinces:
                pairs.append((s.buf("sticky"), dev["slot_sticky"]))
        placed: list[PlannedRead] = []
        off, used = 0, 0
        for pr in plan:
            cap: tuple[Any, ...] | None = pr.capture
            if cap is not None:
                base, w = cap
                src = dev["capture"][base : base + n_tok * w]
                take = wanted_rows(pr.app, pos)
                if take is None or used + len(take) > GATHER_ROWS * self.cap.max_tokens:
                    pairs.append((s.buf("capture")[off : off + n_tok * w], src))
                    cap = (off, w, None)
                    off += n_tok * w
                else:
                    k = len(take)
                    if k:
                        self._queue_gather(s, src.view(n_tok, w), take, used, off, w)
                        pairs.append(
                            (
                                s.buf("capture")[off : off + k * w],
                                self.gather_dev["rows"][off : off + k * w],
                            )
                        )
                    rowmap = np.full(n_tok, -1, dtype=np.int64)
                    rowmap[take] = np.arange(k)
                    cap = (off, w, rowmap)
                    off += k * w
                    used += k
            placed.append(pr._replace(capture=cap))
        ev = self.event = self.xfer.side_copy(pairs)
        p = PendingReads(
            self,
            ev,
            s,
            n_tok,
            pos,
            rows,
            states,
            placed,
            (monitors, np.asarray(slots).copy()) if monitors is not None else None,
        )
        PinnedRing.hold(s, p)
        self.pending.append(p)
        return p

    def _queue_gather(
        self, s: PinnedSet, src: torch.Tensor, take: Arr, used: int, off: int, w: int
    ) -> None:
        """Rows ``take`` of ``src`` into the device gather buffer at ``off``, in stream order
        (the indices go through the read-back set, which nothing rewrites before it resolves)."""
        if not self.gather_dev:
            self.gather_dev = {
                "rows": torch.empty(
                    max(self.cap.capture_floats, 1), dtype=torch.float32, device=self.device
                ),
                "idx": torch.empty(
                    GATHER_ROWS * self.cap.max_tokens, dtype=torch.int64, device=self.device
                ),
            }
        k = len(take)
        s.buf("gather_idx")
        s.np["gather_idx"][used : used + k] = take
        idx = self.gather_dev["idx"][used : used + k]
        dst = self.gather_dev["rows"][off : off + k * w].view(k, w)
        self.xfer.copy(idx, s.t["gather_idx"][used : used + k])
        self.xfer.launch(lambda: torch.index_select(src, 0, idx, out=dst))

    def resolve(self, p: PendingReads) -> Results:
        """Steps resolve in order (a position a preempted request already reported is
        skipped by comparing with the last one reported), whichever thread asks."""
        with self.lock:
            while p.out is None:
                head = self.pending.popleft()
                head.event.synchronize()
                n, R = head.n_tok, self.cap.max_channels
                hs = head.set
                assert hs is not None
                res = hs.np["results"][: n * R].reshape(n, R)
                valid = hs.np["valid"][: n * R].reshape(n, R)

                def captured(cap: tuple[Any, ...], idx: Arr, hs: PinnedSet = hs, n: int = n) -> Arr:
                    off, w, rowmap = cap
                    buf = hs.np["capture"]
                    rows_out: Arr
                    if rowmap is None:
                        rows_out = buf[off : off + n * w].reshape(n, w)[idx]
                    else:
                        k = int(rowmap.max()) + 1
                        rows_out = buf[off : off + k * w].reshape(k, w)[rowmap[idx]]
                    return rows_out

                head.out = collect(
                    res, valid, head.pos, head.rows, head.states, head.plan, captured
                )
                if head.monitors is not None:
                    mplan, slots = head.monitors
                    k = len(slots)
                    mon = collect_monitors(
                        mplan,
                        hs.np["row_stop"][:k],
                        hs.np["row_switched"][:k],
                        hs.np["sticky"] if mplan.sinces else np.zeros(0, np.int32),
                        slots,
                        head.states,
                    )
                    for rid, got in mon.items():
                        head.out.setdefault(rid, {}).update(got)
                head.set = None
            return p.out


class Drain:
    """A step's results and monitor records to per-request results, after its forward."""

    def __init__(self, mem: BlockMemory, slots: Slots, step: Step, reports: SiteReports):
        self.mem, self.slots, self.step, self.reports = mem, slots, step, reports
        self._mplan: tuple[tuple[int, int], MonitorPlan] | None = None
        self._rplan: tuple[tuple[int, int], list[PlannedRead]] | None = None
        self._views: tuple[Any, ...] | None = None  # _host_views, made on the first drain

    def drain(self, packed: bool = False) -> Results:
        """Read results of this step: {req_id: {app: {read: ReadResult}}} (arrays; each
        ReadResult reads as {positions, values} in the default shape; ``packed``: in
        ``ReadResult.pack``'s form, on an unstaged engine), and a request's
        ``TRUNCATED_KEY`` marker in the step its byte cap was reached.

        Only rank 0 drains (hidden states are replicated across tensor-parallel ranks). Staged
        (GPU), this waits for the device; the engine path uses drain_async instead.
        Monitors report under ``STOPPED_KEY`` / ``SWITCHED_KEY`` (collect_monitors)."""
        self.reports.collect()
        step = self.step
        if not (step.reads or step.monitors):
            return {}
        m = self.mem
        if m.staged:
            p = self.drain_async()
            got = p.result() if p is not None else {}
            return {rid: pack_results(r) for rid, r in got.items()} if packed else got
        assert step.rows is not None
        slots, n_req = step.rows
        get = self.slots.slot_req.get
        states = [get(x) for x in slots[:n_req].tolist()]  # each row's request
        out: Results = self._drain_reads(states, packed) if step.reads else {}
        if step.monitors:
            keys, bits = m.host["row_stop"][:n_req], m.host["row_switched"][:n_req]
            if (keys != -1).any() or bits.any():  # most steps: nothing fired
                mon = collect_monitors(
                    self._monitor_plan(),
                    keys,
                    bits,
                    m.host["slot_sticky"],
                    slots[:n_req],
                    states,
                )
                for rid, got in mon.items():
                    out.setdefault(rid, {}).update(got)
        return out

    def _read_plan(self) -> list[PlannedRead]:
        """This step's reads: made again only when the op list or the step's apps change
        (the plan is a function of the deployed apps and which of them run)."""
        key = (self.mem.ops_generation, self.step.active)
        if self._rplan is None or self._rplan[0] != key:
            self._rplan = (key, read_plan(self.mem.apps.values(), self.step.active))
        return self._rplan[1]

    def _monitor_plan(self) -> MonitorPlan:
        key = (self.mem.ops_generation, self.step.active)
        if self._mplan is None or self._mplan[0] != key:
            self._mplan = (key, monitor_plan(self.mem.apps.values(), self.step.active))
        return self._mplan[1]

    def _drain_reads(self, states: list[SlotState | None], packed: bool) -> Results:
        v = self._views
        if v is None:
            v = self._views = self._host_views()
        res, valid, pos, rows, capture, addrs = v
        n_tok, R = self.step.tokens, self.mem.cap.max_channels

        def captured(cap: tuple[Any, ...], idx: Arr) -> Arr:
            base, w = cap
            got: Arr = capture[base : base + len(pos) * w].reshape(-1, w)[idx]
            return got

        def hits(ch: int) -> Hits:
            return _C.read_hits(*addrs, n_tok, R, ch)  # type: ignore[no-any-return]

        # The buffers at their capacity, not cut to the step's tokens: every index the
        # drain uses comes from read_hits, below n_tok.
        return collect(res, valid, pos, rows, states, self._read_plan(), captured, hits, packed)

    def _host_views(self) -> tuple[Any, ...]:
        """The unstaged engine's result buffers as the drain reads them (allocated once with
        the block): results and flags (tokens x channels), positions, rows, capture rows,
        and the addresses read_hits reads."""
        h, T, R = self.mem.host, self.mem.cap.max_tokens, self.mem.cap.max_channels
        names = ("results", "result_valid", "tok_pos", "tok_row")
        return (
            h["results"].reshape(T, R),
            h["result_valid"].reshape(T, R),
            h["tok_pos"],
            h["tok_row"],
            h["capture"],
            tuple(h[k].ctypes.data for k in names),
        )

    def drain_async(self) -> PendingReads | None:
        """Staged: queue this step's results (and captured rows) to pinned host memory on a
        side stream; the host waits only when the returned handle's result() is asked for,
        which the worker does where vLLM resolves its own async output (get_output)."""
        m, step = self.mem, self.step
        if not (step.reads or step.monitors) or m.readback is None or m.stage is None:
            return None
        st = m.stage.step_set
        assert st is not None and step.rows is not None
        slots, n_req = step.rows
        states = [self.slots.slot_req.get(int(x)) for x in slots[:n_req]]
        return m.readback.queue(
            m.dev,
            self._read_plan() if step.reads else [],
            step.tokens,
            st,
            slots[:n_req],
            states,
            lambda app, pos: self._rows_to_copy(
                app, pos, st.np["row_tok_start"], st.np["row_n_tok"], slots[:n_req], states
            ),
            self._monitor_plan() if step.monitors else None,
        )

    def _rows_to_copy(
        self,
        app: str,
        pos: Arr,
        starts: Arr,
        counts: Arr,
        slots: Arr,
        states: list[SlotState | None],
    ) -> Arr | None:
        """The tokens of this step whose capture rows a read of ``app`` can report (in the
        window of a request that uses the app), or None when that is every token."""
        inst = self.mem.apps[app]
        rows = self.mem.host["slot_apps"]
        mask = np.zeros(len(pos), dtype=bool)
        bit = np.int64(1) << np.int64(inst.index)
        for j, sst in enumerate(states):
            if sst is None or sst.truncated:
                continue
            if inst.mode != "all" and not (rows[slots[j]] & bit):
                continue
            t0, n = int(starts[j]), int(counts[j])
            win = sst.options.window
            mask[t0 : t0 + n] = True if win is None else win.mask(pos[t0 : t0 + n], sst.prompt_len)
        return None if mask.all() else np.flatnonzero(mask)
