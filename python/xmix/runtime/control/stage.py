"""Staged engines (GPU, or a CPU with a device queue standing in for one): how a step's host
data reaches the device.

Per-step host data goes through a ring of pinned sets (xmix.runtime.device_queue), never through the host
mirrors: a non-blocking copy reads its source when the stream reaches it, and vLLM queues the
next step before the device has run this one. Slot rows changed since the last step
(admission, release, set_params, deploy) go with the next step as (index, app mask, used
parameter columns) and are scattered on the device in stream order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from xmix.runtime.control.layout import CTRL_LAYOUT, ROW_BUFFERS, ROW_MAPS, TOK_MAPS, Capacity
from xmix.runtime.device_queue import DeviceQueue, PinnedRing, PinnedSet


class StepStaging:
    def __init__(
        self,
        xfer: DeviceQueue,
        cap: Capacity,
        device: torch.device,
        block: torch.Tensor,
        dev: dict[str, torch.Tensor],
        host: dict[str, np.ndarray[Any, Any]],
        host_t: dict[str, torch.Tensor],
        stats: dict[str, int],
    ):
        T, S, P = cap.max_tokens, cap.max_slots, cap.max_params
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        self.xfer, self.cap, self.dev, self.host, self.host_t = xfer, cap, dev, host, host_t
        self.stats = stats
        self.param_stage = max(1, min(S * P, cap.staging_param_floats))
        spec = {n: (T, i32) for n in TOK_MAPS}
        spec.update({n: (S, i32) for n in ROW_MAPS})
        spec.update(
            {
                "header": (2, i32),
                "dirty_idx": (S, i64),
                "dirty_apps": (S, i64),
                "dirty_params": (self.param_stage, f32),
            }
        )
        self.ring = PinnedRing(xfer, cap.staging_depth, spec)
        self.rows_dev = {
            "idx": torch.zeros(S, dtype=i64, device=device),
            "apps": torch.zeros(S, dtype=i64, device=device),
            "params": torch.zeros(self.param_stage, dtype=f32, device=device),
        }
        off = CTRL_LAYOUT["n_tokens"]
        assert CTRL_LAYOUT["n_rows"] == off + 4 and off % 4 == 0
        self.step_header = block[off : off + 8].view(torch.int32)  # n_tokens, n_rows
        self.dirty: set[int] = set()
        self.step_set: PinnedSet | None = None
        self.begun = False

    def mark_row(self, slot: int) -> None:
        self.dirty.add(slot)

    def stage_step(
        self, s: PinnedSet, padded: int, n_req: int, param_width: int, after: Any
    ) -> None:
        """Queue one step's copies from its staging set (after the event ``after``, the
        previous step's result copy, when given), then the event that frees the set."""
        x = self.xfer
        if after is not None:
            # This step's forward rewrites the results buffer: after the previous step's
            # results were copied out on the side stream (a device-side wait, no host wait).
            x.wait(after)
        rt, rr = max(padded, 1), max(n_req, 1)
        for n in TOK_MAPS:
            x.copy(self.dev[n][:rt], s.t[n][:rt])
        for n in ROW_MAPS:
            x.copy(self.dev[n][:rr], s.t[n][:rr])
        if self.dirty:
            self.stage_rows(s, param_width)
        x.copy(self.step_header, s.t["header"])
        PinnedRing.hold(s, x.record())
        self.begun = True

    def stage_rows(self, s: PinnedSet, width: int) -> None:
        """Changed slot rows, ``width`` parameter columns of each (the columns any deployed
        app uses), instead of all of slot_params every step."""
        x = self.xfer
        S, P = self.cap.max_slots, self.cap.max_params
        idx = np.fromiter(self.dirty, dtype=np.int64, count=len(self.dirty))
        self.dirty.clear()
        n, W = len(idx), width
        if n * W > self.param_stage:
            # More than a staging set holds (a burst of admissions with wide rows): the host
            # mirrors are current, one blocking copy of both buffers.
            self.stats["full_param_copies"] += 1
            for name in ROW_BUFFERS:
                x.copy(self.dev[name], self.host_t[name])
            x.synchronize()
            return
        s.np["dirty_idx"][:n] = idx
        s.np["dirty_apps"][:n] = self.host["slot_apps"][idx]
        d = self.rows_dev
        x.copy(d["idx"][:n], s.t["dirty_idx"][:n])
        x.copy(d["apps"][:n], s.t["dirty_apps"][:n])
        if W:
            s.np["dirty_params"][: n * W].reshape(n, W)[:] = self.host["slot_params"].reshape(S, P)[
                idx, :W
            ]
            x.copy(d["params"][: n * W], s.t["dirty_params"][: n * W])
        dev = self.dev

        def scatter() -> None:
            rows = d["idx"][:n]
            dev["slot_apps"].index_copy_(0, rows, d["apps"][:n])
            if W:
                dev["slot_params"].view(S, P)[:, :W].index_copy_(
                    0, rows, d["params"][: n * W].view(n, W)
                )

        x.launch(scatter)

    def end_step(self) -> None:
        if self.begun:
            # On the device, after this step's forward and before anything queued later;
            # the host header is never rewritten while a copy of it may be queued.
            zero: Callable[[], Any] = self.step_header.zero_
            self.xfer.launch(zero)
            self.begun = False
