"""What site programs report back: host seconds, the ops that failed (and so the requests that
must finish with an error), and the writes left non-finite.

The native ``xmix::site`` CPU kernel writes a host struct (``csrc/include/xmix/site_op.h``,
``SiteOpState``): host seconds spent in site programs and the ops that failed since Python
last looked. ``SiteReports`` owns one (numpy, fixed address); ``xmix.runtime.ops`` binds it and checks
this layout's size against the library's own ``sizeof``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from xmix.runtime.control.link import InstalledApp
    from xmix.runtime.control.memory import BlockMemory
    from xmix.runtime.control.slots import Slots
    from xmix.runtime.control.step import Step

MAX_FAILURES = 256  # kSiteOpMaxFailures
MAX_MESSAGES = 16  # kSiteOpMaxMessages
FAILURE_LEN = 240  # kSiteOpFailureLen

SITE_STATE = np.dtype(
    [
        ("seconds", "<f8"),
        ("n_failed", "<i8"),
        ("failed_site", "<i4", (MAX_FAILURES,)),
        ("failed_app", "<i4", (MAX_FAILURES,)),
        ("failed_what", f"S{FAILURE_LEN}", (MAX_MESSAGES,)),
    ]
)


def new_state() -> np.ndarray[Any, Any]:
    return np.zeros(1, dtype=SITE_STATE)


def take_failures(
    state: np.ndarray[Any, Any],
) -> tuple[dict[int, list[tuple[int | None, bytes]]], bool]:
    """The failures recorded since the last call, by site: (app index, or None for the whole
    site; message), and whether more were recorded than the struct keeps (then every app that
    ran this step must be taken as failed)."""
    n = int(state["n_failed"][0])
    if not n:
        return {}, False
    s = state[0]
    out: dict[int, list[tuple[int | None, bytes]]] = {}
    unkept = f"one of {n} site failures in this step (its message was not kept)".encode()
    for i in range(min(n, MAX_FAILURES)):
        app = int(s["failed_app"][i])
        msg = bytes(s["failed_what"][i]) if i < MAX_MESSAGES else unkept
        out.setdefault(int(s["failed_site"][i]), []).append((None if app < 0 else app, msg))
    state["n_failed"][0] = 0
    return out, n > MAX_FAILURES


class SiteReports:
    def __init__(self, mem: BlockMemory, slots: Slots, step: Step):
        self.mem, self.slots, self.step = mem, slots, step
        self.state = new_state()  # the native kernel's
        self._n_failed = self.state["n_failed"]  # a view: checked after every forward
        # Requests whose app failed inside a site program this step: req id -> message
        # (the worker finishes them with an error); failures per app name.
        self.failed: dict[str, str] = {}
        self.site_errors: dict[str, int] = {}
        # Host seconds in active site programs of the Python reference kernel (runtime/ops.py); the
        # native kernel's are in ``state``; the worker reports both (``seconds``).
        self.py_seconds = 0.0

    @property
    def seconds(self) -> float:
        """Host seconds spent in active site programs (CPU engine), both kernels."""
        return self.py_seconds + float(self.state["seconds"][0])

    def site_failed(self, site: int, failures: Sequence[tuple[int | None, str | bytes]]) -> None:
        """Ops of a site program failed this step (``failures``: (app index, message), or
        app index None: the whole site). The requests of the step that used those apps are
        recorded for the worker to finish with an error; every other request is untouched."""
        mem = self.mem
        with mem.lock:
            rows = self.step.rows
            by_index = {inst.index: inst for inst in mem.apps.values()}
            slots = rows[0][: rows[1]].tolist() if rows else []
            for index, raw in failures:
                msg = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                if index is None:
                    hit = [by_index[i] for i in by_index if (int(mem.site_app_mask[site]) >> i) & 1]
                    self._clear_reads(hit)
                else:
                    hit = [by_index[index]] if index in by_index else []
                for inst in hit:
                    self.site_errors[inst.name] = self.site_errors.get(inst.name, 0) + 1
                    for slot in slots:
                        st = self.slots.slot_req.get(slot)
                        if st is None or st.req_id in self.failed:
                            continue
                        if st.uses(inst):
                            self.failed[st.req_id] = (
                                f"app {inst.name!r} failed in its site program "
                                f"at site {site}: {msg[:500]}"
                            )

    def _clear_reads(self, insts: list[InstalledApp]) -> None:
        """These apps report nothing this step: a site program that did not run leaves an
        earlier step's flags in their channels, which the drain would report for whichever
        request holds those rows now. Every request of the step that used them fails, so
        clearing all their channels drops nothing another request should get."""
        chans = sorted({ch for inst in insts for ch in inst.channels.values()})
        n_tok, R = self.step.tokens, self.mem.cap.max_channels
        if chans and n_tok:
            self.mem.dev["result_valid"][: n_tok * R].view(n_tok, R)[:, chans] = 0

    def collect(self) -> None:
        """Hand what the native site kernel recorded during the forward to site_failed
        (before the drain: a site that did not run must clear its apps' reads first)."""
        if not self._n_failed[0]:
            return
        by_site, overflow = take_failures(self.state)
        if overflow:  # not every failure was kept: every app that ran fails
            for site in np.flatnonzero(self.step.site_active).tolist():
                by_site.setdefault(site, []).append((None, b"too many site failures to keep"))
        for site, failures in by_site.items():
            self.site_failed(site, failures)

    def take_failed(self) -> dict[str, str]:
        """The requests to finish with an error (req id -> message), once."""
        self.collect()
        with self.mem.lock:
            out, self.failed = self.failed, {}
            return out

    def nonfinite_writes(self) -> dict[str, int]:
        """Per deployed app: elements of the stream its writes would have made non-finite,
        left as they were (built-in kernels) or set to 0 (user kernels). On a GPU this reads
        the device (control-plane calls only, never per step)."""
        mem = self.mem
        with mem.lock:
            counts = (
                mem.dev["app_nonfinite"].cpu().numpy()
                if mem.staged or mem.on_gpu
                else mem.host["app_nonfinite"]
            )
            return {inst.name: int(counts[inst.index]) for inst in mem.apps.values()}
