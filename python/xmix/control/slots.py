"""Request slots: which running request holds which row of the per-slot tables, and what each
request asked for (apps, parameters, result options) and has reported so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from xmix.lowering import RequestError
from xmix.results_codec import (
    DEFAULT_OPTIONS,
    TRUNCATED_KEY,
    ResultOptions,
    max_result_bytes,
    position_bytes,
)

if TYPE_CHECKING:
    from xmix.control.link import InstalledApp

Index = np.ndarray[Any, np.dtype[np.intp]]


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
    ) -> Index:
        """The tokens of ``sel`` (positions ``pos``) this request reports: those in its window,
        up to its byte budget. Past the budget nothing more is reported, and the step's
        results carry the marker."""
        if self.truncated:
            return sel[:0]
        win = self.options.window
        if win is not None:
            keep = win.mask(pos, self.prompt_len)
            sel, pos = sel[keep], pos[keep]
        budget = self.options.max_bytes
        if budget is None:
            budget = max_result_bytes()
        per = position_bytes(shape, self.options)
        fit = (budget - self.spent) // per
        if len(sel) > fit:
            sel = sel[: max(fit, 0)]
            self.truncated = True
            out.setdefault(self.req_id, {})[TRUNCATED_KEY] = (
                f"truncated at {budget} bytes: this sequence's read results reached its cap "
                f"(max_result_bytes / XMIX_MAX_RESULT_BYTES); later results were dropped"
            )
        self.spent += len(sel) * per
        return sel


class SlotTable:
    """Slots of running requests, free slots, and preempted requests' records."""

    def __init__(self, n_slots: int):
        self.slots: dict[str, int] = {}  # req id -> slot
        self.slot_req: dict[int, SlotState] = {}  # slot -> request
        self.free = list(range(n_slots - 1, -1, -1))
        self.suspended: dict[str, SlotState] = {}

    def occupy(self, st: SlotState) -> int:
        if not self.free:
            raise RequestError(
                "no free xmix request slot (more running requests than max_num_seqs)"
            )
        slot = self.free.pop()
        self.slots[st.req_id] = slot
        self.slot_req[slot] = st
        return slot

    def release(self, req_id: str) -> tuple[int, SlotState] | None:
        self.suspended.pop(req_id, None)
        slot = self.slots.pop(req_id, None)
        if slot is None:
            return None
        st = self.slot_req.pop(slot)
        self.free.append(slot)
        return slot, st

    def every_request(self) -> list[SlotState]:
        """Running and preempted requests."""
        return [*self.slot_req.values(), *self.suspended.values()]
