"""One forward pass on the host: which apps run, the step's per-token and per-row maps
(``_C.fill_step_maps``), the prologue before the forward and the empty step after it.

This is the per-step path (the worker calls ``run`` or ``begin`` + ``prologue``, and ``end``,
every step). On an unstaged (CPU) engine it is one native call before the forward and one
after (``_C.HostStep``: request ids to slots, the restart check, which apps run, the maps, the
header, the active sites, the monitors' extents, the prologue); staged (GPU) engines fill the
next staging set here, one native call for the maps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import xmix._C as _C
from xmix.runtime.control.layout import CTRL_SIZE
from xmix.runtime.control.memory import STEP_MAPS

if TYPE_CHECKING:
    from xmix.runtime.control.memory import BlockMemory
    from xmix.runtime.control.slots import Slots

Arr = np.ndarray[Any, Any]


class Step:
    def __init__(self, mem: BlockMemory, slots: Slots):
        self.mem = mem
        self.slots = slots
        # Which sites have an op of an app running this step: one fixed buffer, rewritten in
        # place each step, since the native site kernel (xmix.runtime.ops) reads it by address.
        self.site_active: Arr = np.zeros(mem.n_sites, dtype=bool)
        self.any_active = False
        self.reads = False  # an app with reads runs this step
        self.monitors = False  # an app with a stop or a since(...) term runs this step
        self.rows: tuple[Arr, int] | None = None  # (slots of the step's rows, rows)
        self.tokens = 0
        self.active = 0  # bitmask of the apps that run this step
        # Per slot: its request ran a step since admission (a step at position 0 after that
        # is a restart: the worker's restart check; admission clears it)
        self.started: Arr = np.zeros(mem.cap.max_slots, dtype=bool)
        # The step's slots in batch order (first ``rows[1]``), rewritten each step
        self.row_slots: Arr = np.zeros(mem.cap.max_slots, dtype=np.int32)
        self.native: Any = None
        if not mem.staged:
            addrs = {k: mem.host[k].ctypes.data for k in STEP_MAPS}
            addrs.update(
                block=mem.block.data_ptr(),
                block_host=mem.block_host.data_ptr(),
                slot_apps=mem.host["slot_apps"].ctypes.data,
                slot_floor=mem.host["slot_floor"].ctypes.data,
                site_app_mask=mem.site_app_mask.ctypes.data,
                site_active=self.site_active.ctypes.data,
                started=self.started.ctypes.data,
                extent=slots.extent.ctypes.data,
                floor=slots.floor.ctypes.data,
                row_slots=self.row_slots.ctypes.data,
            )
            self.native = _C.HostStep(
                addrs, CTRL_SIZE, mem.cap.max_tokens, mem.cap.max_slots, mem.n_sites
            )

    def begin(
        self,
        row_slots: Arr,
        row_n_tok: Arr,
        row_start_pos: Arr,
        row_prompt_len: Arr,
        n_rows_padded: int | None = None,
    ) -> bool:
        """Fill the per-token and per-row maps for one forward pass; False (and nothing
        written) when no app can run this step.

        rows are the scheduled requests in batch order; their tokens are contiguous in the
        batch. ``n_rows_padded`` is the padded token count of the forward (CUDA graphs); rows
        beyond the real tokens are padding and stay inert.
        """
        m = self.mem
        if self.native is not None:
            got = self.native.begin(
                row_slots,
                row_n_tok,
                row_start_pos,
                row_prompt_len,
                n_rows_padded or 0,
                m.step_masks,
                0,
                0,
                False,
            )
            return self._took(got, len(row_slots))
        n_req = len(row_slots)
        # Which apps run: those in mode "all" plus those of the batch's requests (not off).
        active = m.all_mask
        if self.slots.n_app_slots and n_req:
            active |= int(np.bitwise_or.reduce(m.host["slot_apps"][row_slots]))
        active &= m.on_mask
        if not active and not m.span_mask:
            self.site_active.fill(False)
            self.any_active = False
            self.reads = False
            self.monitors = False
            return False
        slots = np.ascontiguousarray(row_slots, dtype=np.int32)
        n_tok_a = np.ascontiguousarray(row_n_tok, dtype=np.int64)
        start = np.ascontiguousarray(row_start_pos, dtype=np.int64)
        plen = np.ascontiguousarray(row_prompt_len, dtype=np.int64)
        n_tok = int(n_tok_a.sum())
        cap = m.cap
        if n_tok > cap.max_tokens or n_req > cap.max_slots or (n_rows_padded or 0) > cap.max_tokens:
            raise RuntimeError(
                f"xmix: step of {max(n_tok, n_rows_padded or 0)} rows / {n_req} requests "
                f"exceeds capacity ({cap.max_tokens} / {cap.max_slots})"
            )
        padded = max(n_tok, n_rows_padded or 0)
        stage = m.stage
        # the maps go to the next staging set (device) or straight into the block (CPU)
        st = None
        if stage is not None:
            st = stage.step_set = stage.ring.next()
        _C.fill_step_maps(
            n_req,
            slots.ctypes.data,
            n_tok_a.ctypes.data,
            start.ctypes.data,
            plen.ctypes.data,
            padded,
            st.ptrs if st is not None else m.map_ptrs,
        )
        if stage is not None and st is not None:
            st.np["header"][:] = (n_tok, n_req)
            after = None
            if m.readback is not None:
                after, m.readback.event = m.readback.event, None
            stage.stage_step(st, padded, n_req, m.param_width(), after)
        else:
            m.set_step_header(n_tok, n_req)
            m.sync_block()
        np.not_equal(m.site_app_mask & np.uint64(active), 0, out=self.site_active)
        self.rows = (slots, n_req)
        self.tokens = n_tok
        self.active = active
        self.any_active = bool(active)
        self.reads = bool(active & m.read_mask)
        self.monitors = bool(active & m.monitor_mask)
        if m.monitor_mask:
            # positions only grow within a request (a restart resets its floor first), so
            # the last step's end is the extent
            self.slots.extent[slots] = start + n_tok_a
        return True

    def run(
        self,
        req_ids: list[str],
        n_tok: Arr,
        start: Arr,
        plen: Arr,
        input_ids: torch.Tensor,
        padded: int,
    ) -> tuple[bool, int] | None:
        """The worker's step on an unstaged engine, in one native call: the requests' slots
        (``slot_of``), the restart check (a request at position 0 again in the slot it holds:
        its monitors keep what they decided, the prologue resets the rest), ``begin``, and the
        prologue when an app runs. Returns (whether an app runs, restarts), or None (nothing
        done) when a request has no slot yet or this is a staged engine: the caller goes the
        long way (``begin_slots``, or ``begin`` and ``prologue``)."""
        if self.native is None:
            return None
        ids = input_ids if input_ids.ndim == 1 else input_ids.reshape(-1)
        got = self.native.begin_ids(
            req_ids,
            self.slots.slot_of,
            n_tok,
            start,
            plen,
            padded,
            self.mem.step_masks,
            ids.data_ptr(),
            ids.element_size(),
        )
        if got is None:
            return None
        return self._took(got, len(req_ids)), got[3]

    def begin_slots(
        self,
        slots: Arr,
        n_tok: Arr,
        start: Arr,
        plen: Arr,
        input_ids: torch.Tensor,
        padded: int,
    ) -> tuple[bool, int]:
        """``run`` with the rows' slots given (the caller resolved them), unstaged engines:
        (whether an app runs, restarts)."""
        ids = input_ids if input_ids.ndim == 1 else input_ids.reshape(-1)
        got = self.native.begin(
            slots,
            n_tok,
            start,
            plen,
            padded,
            self.mem.step_masks,
            ids.data_ptr(),
            ids.element_size(),
            True,
        )
        return self._took(got, len(slots)), got[3]

    def _took(self, got: tuple[bool, int, int, int], n_req: int) -> bool:
        """The native call's (ran, tokens, active apps, restarts) into the step's state."""
        ran, n_tok, active, _ = got
        if not ran:
            self.any_active = self.reads = self.monitors = False
            return False
        m = self.mem
        self.rows = (self.row_slots, n_req)
        self.tokens = n_tok
        self.active = active
        self.any_active = bool(active)
        self.reads = bool(active & m.read_mask)
        self.monitors = bool(active & m.monitor_mask)
        return True

    def could_run(self) -> bool:
        """Whether any app could run in a step (cheap; before the step's maps are built)."""
        m = self.mem
        return bool(
            ((m.all_mask | (m.on_mask if self.slots.n_app_slots else 0)) & m.on_mask) or m.span_mask
        )

    def end(self) -> None:
        """After the forward: an empty step, so forwards outside the runner's step (dummy
        runs, graph captures) find every row inert."""
        m = self.mem
        if self.native is not None:
            self.native.end(bool(self.any_active or m.span_mask))
            self.any_active = self.reads = self.monitors = False
            return
        if m.stage is not None:
            m.stage.end_step()
        elif self.any_active or m.span_mask:
            m.set_step_header(0, 0)
            m.sync_block()
        self.site_active.fill(False)
        self.any_active = False
        self.reads = False
        self.monitors = False

    def prologue(self, input_ids: torch.Tensor) -> None:
        """Per-slot resets, token-set and span bits for this step (before the forward)."""
        m = self.mem
        if not m.apps:
            return
        ids = input_ids.reshape(-1)
        if m.on_gpu:
            _C.launch_prologue(
                m.ptr,
                ids.data_ptr(),
                ids.element_size(),
                m.cap.max_slots,
                torch.cuda.current_stream(ids.device).cuda_stream,
            )
        elif m.xfer is not None:
            ptr = m.ptr
            m.xfer.launch(lambda: _C.run_prologue_cpu(ptr, ids.data_ptr(), ids.element_size()))
        else:
            _C.run_prologue_cpu(m.ptr, ids.data_ptr(), ids.element_size())

    def no_sites(self) -> None:
        """No site program runs this step (the worker found nothing to run)."""
        self.site_active.fill(False)
