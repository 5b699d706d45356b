"""Request slots: which running request holds which row of the per-slot tables, what each
request asked for (apps, parameters, result options) and has reported so far, and the
per-slot state a request starts with, keeps across preemption, and gives back (``Slots``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from xmix.lang.lowering import RequestError
from xmix.lang.results_codec import (
    DEFAULT_OPTIONS,
    TRUNCATED_KEY,
    ResultOptions,
    max_result_bytes,
    position_bytes,
)
from xmix.runtime.control.layout import K
from xmix.runtime.control.params import resolve_params

if TYPE_CHECKING:
    from xmix.runtime.control.link import InstalledApp
    from xmix.runtime.control.memory import BlockMemory

Index = np.ndarray[Any, np.dtype[np.intp]]
Arr = np.ndarray[Any, Any]


@dataclass
class SlotState:
    req_id: str
    apps: set[str]
    overrides: dict[str, dict[int, float]]
    prompt_len: int = 0
    reported: dict[tuple[str, str], int] = field(
        default_factory=dict
    )  # (app, read) -> last position
    # Apps in mode "all" that may apply to this request (a server's per-key policy); None:
    # every one. An app in mode "all" not listed is opted out: its bit in slot_apps is set.
    forced: frozenset[str] | None = None
    options: ResultOptions = DEFAULT_OPTIONS  # encoding, window, byte budget
    spent: int = 0  # result bytes accounted so far
    truncated: bool = False
    # Monitors of a preempted request: positions below ``floor`` were decided before, and
    # ``sinces`` is its row of since terms (first positions) as it was (control.h)
    floor: int = 0
    sinces: np.ndarray[Any, np.dtype[np.int32]] | None = None

    def bit(self, inst: InstalledApp) -> bool:
        """This request's bit of an app in slot_apps: for mode "all" it opts the request
        out (control.h: app_active), otherwise it says the request uses the app."""
        if inst.mode == "all":  # named apps always apply
            return (
                self.forced is not None
                and inst.name not in self.forced
                and inst.name not in self.apps
            )
        return inst.name in self.apps

    def uses(self, inst: InstalledApp) -> bool:
        """Whether the app runs for this request (its mode and this request's bit)."""
        return (inst.mode == "all" and not self.bit(inst)) or (
            inst.mode == "request" and inst.name in self.apps
        )

    def admit(
        self,
        sel: Index,
        pos: np.ndarray[Any, Any],
        shape: Any,
        app: str,
        out: dict[str, dict[str, Any]],
        server_cap: list[int] | None = None,
    ) -> Index:
        """The tokens of ``sel`` (positions ``pos``) this request reports: those in its window,
        up to its byte budget (``fit``)."""
        if self.truncated:
            return sel[:0]
        win = self.options.window
        if win is not None:
            keep = win.mask(pos, self.prompt_len)
            sel = sel[keep]
        k = self.fit(len(sel), shape, out, server_cap)
        return sel if k == len(sel) else sel[:k]

    def fit(
        self,
        n: int,
        shape: Any,
        out: dict[str, dict[str, Any]],
        server_cap: list[int] | None = None,
    ) -> int:
        """How many of the next ``n`` positions of a read fit in this request's byte budget
        (accounted here). Past the budget nothing more is reported, and the step's results
        carry the marker. ``server_cap``: where the server's cap, once read, is kept for the
        rest of the drain (read here when empty)."""
        if self.truncated:
            return 0
        budget = self.options.max_bytes
        if budget is None:
            if server_cap is None:
                budget = max_result_bytes()
            else:
                if not server_cap:
                    server_cap.append(max_result_bytes())
                budget = server_cap[0]
        per = position_bytes(shape, self.options)
        fit = (budget - self.spent) // per
        if n > fit:
            n = max(fit, 0)
            self.truncated = True
            out.setdefault(self.req_id, {})[TRUNCATED_KEY] = (
                f"truncated at {budget} bytes: this sequence's read results reached its cap "
                f"(max_result_bytes / XMIX_MAX_RESULT_BYTES); later results were dropped"
            )
        self.spent += n * per
        return n


class Slots:
    """Slots of running requests, free slots and preempted requests' records; admitting,
    preempting and releasing a request, and what its slot's rows hold meanwhile."""

    def __init__(self, mem: BlockMemory):
        self.mem = mem
        n_slots = mem.cap.max_slots
        self.slot_of: dict[str, int] = {}  # req id -> slot
        self.slot_req: dict[int, SlotState] = {}  # slot -> request
        self.free = list(range(n_slots - 1, -1, -1))
        self.suspended: dict[str, SlotState] = {}
        self.n_app_slots = 0  # slots whose slot_apps row is not 0
        # Per slot: one past the last position a step with apps ran on (the step writes it);
        # a preempted request's monitors do not decide the positions below it again when it
        # recomputes.
        self.extent = np.zeros(n_slots, dtype=np.int64)
        self.floor = np.zeros(n_slots, dtype=np.int64)  # what the device's floor holds

    def every_request(self) -> list[SlotState]:
        """Running and preempted requests."""
        return [*self.slot_req.values(), *self.suspended.values()]

    # ------------------------------------------------------------------ admission
    def admit(
        self,
        req_id: str,
        apps: list[str],
        params: dict[str, dict[str, Any]] | None = None,
        prompt_len: int = 0,
        results: ResultOptions | None = None,
    ) -> int:
        """Give a request a slot by app names and named parameters, checked here (raises
        RequestError). The engine admits through ``admit_pinned``, which cannot fail on
        what a request carries."""
        deployed = self.mem.apps
        with self.mem.lock:
            if req_id in self.slot_of:
                return self.slot_of[req_id]
            overrides: dict[str, dict[int, float]] = {}
            for a in apps:
                if a not in deployed:
                    raise RequestError(f"unknown app {a!r}; deployed: {sorted(deployed)}")
            for a, p in (params or {}).items():
                if a not in deployed:
                    raise RequestError(
                        f"params for unknown app {a!r}; deployed: {sorted(deployed)}"
                    )
                overrides[a] = resolve_params(deployed[a].param_cols, p, who=f"app {a!r}")
            st = SlotState(
                req_id=req_id,
                apps=set(apps),
                overrides=overrides,
                prompt_len=prompt_len,
                options=results or DEFAULT_OPTIONS,
            )
            return self._occupy(st)

    def admit_pinned(
        self,
        req_id: str,
        apps: list[str],
        pins: dict[str, Any],
        prompt_len: int = 0,
        forced: list[str] | None = None,
        results: ResultOptions | None = None,
    ) -> tuple[int, list[str]]:
        """Give a request a slot from the control the frontend checked and resolved: each
        app pinned to the deployment version it was checked against (``pins``: {app:
        [version, [[column, value], ...]]}), parameters as column values. An app that is
        gone, or deployed again under its name at another version, is left out: the request
        runs without it, as after an undeploy. Nothing a request carries raises here; the
        slot and the names of the apps left out are returned."""
        deployed = self.mem.apps
        with self.mem.lock:
            if req_id in self.slot_of:
                return self.slot_of[req_id], []

            def pinned(a: str) -> InstalledApp | None:
                inst, pin = deployed.get(a), pins.get(a)
                ok = (
                    inst is not None
                    and isinstance(pin, (list, tuple))
                    and len(pin) == 2
                    and pin[0] == inst.version
                )
                return inst if ok else None

            dropped = [a for a in apps if pinned(a) is None]
            overrides: dict[str, dict[int, float]] = {}
            for a, pin in pins.items():
                inst = pinned(a)
                if inst is None:
                    if a not in apps:
                        dropped.append(a)
                    continue
                n = len(inst.param_cols)
                overrides[a] = {
                    int(c): float(v)
                    for c, v in pin[1]
                    if isinstance(c, int)
                    and 0 <= c < n
                    and isinstance(v, float)
                    and math.isfinite(v)
                }
            st = SlotState(
                req_id=req_id,
                apps={a for a in apps if a not in dropped},
                overrides=overrides,
                prompt_len=prompt_len,
                forced=frozenset(forced) if forced is not None else None,
                options=results or DEFAULT_OPTIONS,
            )
            return self._occupy(st), dropped

    def _occupy(self, st: SlotState) -> int:
        if not self.free:
            raise RequestError(
                "no free xmix request slot (more running requests than max_num_seqs)"
            )
        slot = self.free.pop()
        self.slot_of[st.req_id] = slot
        self.slot_req[slot] = st
        m = self.mem
        self.extent[slot] = self.floor[slot] = st.floor
        st.apps &= set(m.apps)  # an app undeployed while the request waited
        mask = 0
        for inst in m.apps.values():
            if st.bit(inst):
                mask |= 1 << inst.index
        m.host["slot_apps"][slot] = np.uint64(mask).astype(np.int64)
        m.mark_row(slot)
        self.n_app_slots += mask != 0
        for inst in m.apps.values():
            self.write_params(slot, inst)
        self._reset_state(slot)
        if st.floor or st.sinces is not None:
            self._restore_monitors(slot, st)
        return slot

    def release(self, req_id: str) -> SlotState | None:
        with self.mem.lock:
            self.suspended.pop(req_id, None)
            slot = self.slot_of.pop(req_id, None)
            if slot is None:
                return None
            st = self.slot_req.pop(slot)
            self.free.append(slot)
            rows = self.mem.host["slot_apps"]
            self.n_app_slots -= int(rows[slot] != 0)
            rows[slot] = 0
            self.mem.mark_row(slot)
            return st

    # ------------------------------------------------------------------ preemption
    def suspend(self, req_id: str) -> None:
        """A preempted request gives its slot back and keeps its record (apps, parameters,
        what it has reported): slots never outnumber the running requests."""
        with self.mem.lock:
            slot = self.slot_of.get(req_id)
            if slot is not None and self.mem.monitor_mask:
                # what its monitors decided so far survives the recompute
                st0 = self.slot_req[slot]
                st0.floor = int(max(self.extent[slot], self.floor[slot]))
                st0.sinces = self._read_sinces(slot)
            st = self.release(req_id)
            if st is not None:
                self.suspended[req_id] = st

    def resume(self, req_id: str) -> int | None:
        """The slot of a request coming back after preemption (it recomputes, so its state
        starts over), or None if it was never suspended."""
        with self.mem.lock:
            st = self.suspended.pop(req_id, None)
            return None if st is None else self._occupy(st)

    def recompute(self, slot: int) -> None:
        """A request that starts again at position 0 in the slot it holds: its monitors keep
        what they decided and do not decide those positions again."""
        if self.mem.monitor_mask:
            floor = int(max(self.extent[slot], self.floor[slot]))
            self.floor[slot] = floor
            dev = self.mem.dev
            self.mem.launch(lambda: dev["slot_floor"][slot].fill_(floor))

    def _read_sinces(self, slot: int) -> Arr:
        """A slot's since terms (first positions) from the device: on a GPU this waits for
        the steps queued before (preemption only, never per step)."""
        M = K["MAX_STICKY"]
        if self.mem.xfer is not None:
            self.mem.xfer.synchronize()
        row: Arr = self.mem.dev["slot_sticky"][slot * M : (slot + 1) * M].cpu().numpy().copy()
        return row

    def _restore_monitors(self, slot: int, st: SlotState) -> None:
        M = K["MAX_STICKY"]
        floor = st.floor
        dev = self.mem.dev
        sinces = (
            torch.from_numpy(st.sinces.copy()).to(self.mem.device)
            if st.sinces is not None
            else None
        )

        def restore() -> None:
            dev["slot_floor"][slot].fill_(floor)
            if sinces is not None:
                dev["slot_sticky"][slot * M : (slot + 1) * M].copy_(sinces)

        self.mem.launch(restore)

    def _reset_state(self, slot: int) -> None:
        """A new request starts with empty latch sums, spans and CAST means, whatever the
        previous occupant of its slot left (the prologue also resets a request that restarts
        at position 0, e.g. after preemption)."""
        R, W = self.mem.cap.max_channels, K["READ_STATE_WIDTH"]
        M, V = K["MAX_STICKY"], self.mem.vec_width
        dev = self.mem.dev

        def reset() -> None:
            rs = dev["read_state"][slot * R * W : (slot + 1) * R * W].view(R, W)
            rs[:, :2] = 0.0
            rs[:, 2] = float("nan")
            dev["vec_state"][slot * V : (slot + 1) * V] = 0.0
            dev["slot_span"][slot] = 0
            dev["slot_sticky"][slot * M : (slot + 1) * M] = K["NO_POSITION"]
            dev["slot_floor"][slot] = 0

        # in stream order: steps still in flight may use the slot's previous occupant
        self.mem.launch(reset)

    # ------------------------------------------------------------------ after a control change
    def write_params(self, slot: int, inst: InstalledApp) -> None:
        """A slot's parameter columns of one app: the request's overrides, else the app's
        defaults."""
        m = self.mem
        m.mark_row(slot)
        P = m.cap.max_params
        row = m.host["slot_params"][slot * P : (slot + 1) * P]
        overrides = (
            self.slot_req[slot].overrides.get(inst.name, {}) if slot in self.slot_req else {}
        )
        for i, c in enumerate(inst.param_cols):
            row[inst.param_base + i] = overrides.get(i, c.default)

    def rewrite_bits(self, inst: InstalledApp) -> None:
        """Each running request's bit of one app after its mode changed (the bit means
        "uses it" in mode request, "opted out" in mode all)."""
        bit = np.int64(1) << np.int64(inst.index)
        rows = self.mem.host["slot_apps"]
        changed = False
        for slot, st in self.slot_req.items():
            want = st.bit(inst)
            if bool(rows[slot] & bit) != want:
                rows[slot] = (rows[slot] | bit) if want else (rows[slot] & ~bit)
                self.mem.mark_row(slot)
                changed = True
        if changed:
            self.n_app_slots = int(np.count_nonzero(rows))
            self.mem.sync("slot_apps", running=self.slot_req)

    def forget(self, inst: InstalledApp) -> None:
        """An undeployed app: its bit leaves every slot, and running and preempted requests
        forget it and its parameter columns (an app deployed later under the same name is
        another app)."""
        bit = np.int64(1) << np.int64(inst.index)
        rows = self.mem.host["slot_apps"]
        rows[:] &= ~bit
        self.n_app_slots = int(np.count_nonzero(rows))
        for st in self.every_request():
            st.apps.discard(inst.name)
            st.overrides.pop(inst.name, None)

    def clear_sinces(self, cols: list[int]) -> None:
        """Since columns handed to a new app start unset in every slot (and in the records of
        preempted requests)."""
        M, S = K["MAX_STICKY"], self.mem.cap.max_slots
        idx = torch.tensor(cols, dtype=torch.int64)
        for st in self.suspended.values():
            if st.sinces is not None:
                st.sinces[cols] = K["NO_POSITION"]
        dev, device = self.mem.dev, self.mem.device

        def clear() -> None:
            dev["slot_sticky"].view(S, M)[:, idx.to(device)] = K["NO_POSITION"]

        self.mem.launch(clear)
