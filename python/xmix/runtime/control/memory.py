"""The control block's memory: its fixed-address buffers, the header, the host -> device sync,
and the live tables every other part reads (the deployed apps, their per-site op lists and the
bitmasks derived from them).

Every buffer is allocated once, at its capacity, on the engine's device; deploys and
parameter changes rewrite contents, never addresses, so captured CUDA graphs stay valid.
On a CPU engine the host views are the buffers themselves; on a GPU each buffer has a pinned
host mirror and changes are copied on the current stream before the next forward.

This is the one object the parts of ``ControlBlock`` share (deploy, slots, step, drain,
site reports): each part holds it, none holds the block.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

import xmix._C as _C
from xmix.lang.sites import ModelShape, n_sites
from xmix.runtime.control.arena import Arena
from xmix.runtime.control.drain import ReadBack
from xmix.runtime.control.layout import (
    CTRL_DTYPE,
    CTRL_LAYOUT,
    CTRL_SIZE,
    ROW_BUFFERS,
    Capacity,
    K,
    buffer_spec,
)
from xmix.runtime.control.link import InstalledApp, SiteOp
from xmix.runtime.control.stage import StepStaging
from xmix.runtime.device_queue import CudaQueue, DeviceQueue

Arr = np.ndarray[Any, Any]

# The per-token and per-row maps _C.fill_step_maps writes on an unstaged engine
STEP_MAPS = (
    "tok_slot",
    "tok_pos",
    "tok_flags",
    "tok_row",
    "row_slot",
    "row_tok_start",
    "row_n_tok",
    "row_reset",
    "row_n_prompt",
    "row_done",
)


class BlockMemory:
    def __init__(
        self,
        shape: ModelShape,
        device: torch.device | str = "cpu",
        capacity: Capacity | None = None,
        queue: DeviceQueue | None = None,
    ):
        self.shape = shape
        self.device = torch.device(device)
        self.cap = cap = capacity or Capacity()
        if cap.max_apps > 64:
            raise ValueError("max_apps is at most 64 (slot_apps is a 64-bit mask)")
        self.n_sites = n_sites(shape.n_layers)
        self.vec_width = cap.vec_state_floats or 4 * (shape.hidden_size + 1)
        self.vocab_words = (shape.vocab_size + 31) // 32
        self.lock = threading.RLock()
        self.on_gpu = self.device.type == "cuda"
        if self.on_gpu:
            # a hidden size whose site kernels cannot launch would fail the first capture and
            # take the engine down with a launch error: refuse it now, naming it
            why = _C.site_smem_check(shape.hidden_size)
            if why:
                raise ValueError(why)
        # Staged: host mirrors apart from the device buffers, everything sent through a device
        # queue (always on a GPU; on a CPU only with a queue given, which tests use to stand
        # in for a GPU stream).
        self.xfer: DeviceQueue | None = (
            queue if queue is not None else (CudaQueue(self.device) if self.on_gpu else None)
        )
        self.staged = self.xfer is not None
        self.dev: dict[str, torch.Tensor] = {}
        self.host: dict[str, Arr] = {}
        self.host_t: dict[str, torch.Tensor] = {}
        for name, (n, dt) in buffer_spec(
            cap, self.n_sites, self.vec_width, self.vocab_words
        ).items():
            t = torch.zeros(n, dtype=dt, device=self.device)
            self.dev[name] = t
            if self.xfer is not None:
                h = self.xfer.pinned(n, dt)
                self.host_t[name] = h
                self.host[name] = h.numpy()
            else:
                self.host[name] = t.numpy()
        self.host["tok_slot"][:] = -1
        self.host["tok_row"][:] = -1
        self.host["span_def"][:] = -1
        self.host["read_state"].reshape(-1, K["READ_STATE_WIDTH"])[:, 2] = np.nan
        self.host["results"][:] = np.nan  # and result_valid 0: nothing reported yet
        self.host["slot_sticky"][:] = K["NO_POSITION"]
        self.host["row_stop"][:] = -1  # kNoStop: every bit set
        self.block = torch.zeros(CTRL_SIZE, dtype=torch.uint8, device=self.device)
        self.ptr: int = self.block.data_ptr()  # allocated once: the address never changes
        self.block_host = (
            self.xfer.pinned(CTRL_SIZE, torch.uint8)
            if self.xfer is not None
            else torch.zeros(CTRL_SIZE, dtype=torch.uint8)
        )
        self._header = self.block_host.numpy().view(CTRL_DTYPE)
        off = CTRL_LAYOUT["n_tokens"]
        assert CTRL_LAYOUT["n_rows"] == off + 4 and off % 4 == 0
        self._step_counts = self.block_host.numpy()[off : off + 8].view(
            np.int32
        )  # n_tokens, n_rows
        self.stats = {"full_param_copies": 0}
        self.stage: StepStaging | None = None
        self.readback: ReadBack | None = None
        if self.xfer is not None:
            self.stage = StepStaging(
                self.xfer,
                cap,
                self.device,
                self.block,
                self.dev,
                self.host,
                self.host_t,
                self.stats,
            )
            self.readback = ReadBack(self.xfer, cap, self.device)
        self.map_ptrs = {k: self.host[k].ctypes.data for k in STEP_MAPS}
        self.arena = Arena(
            {
                "params": cap.max_params,
                "channels": cap.max_channels,
                "token_sets": K["MAX_TOKEN_SETS"],
                "spans": K["MAX_SPANS"],
                "sinces": K["MAX_STICKY"],
                "state": self.vec_width,
                "capture": max(cap.capture_floats, 1),
            }
        )
        # ---- the live tables: written only by Deployer (a swap or a mode change)
        self.apps: dict[str, InstalledApp] = {}
        # rewritten in place (the step's native call reads it by address)
        self.site_app_mask = np.zeros(self.n_sites, dtype=np.uint64)
        self.site_ops: list[list[SiteOp]] = [[] for _ in range(self.n_sites)]
        self.site_custom: dict[int, list[tuple[int, SiteOp]]] = {}
        self.n_ops = 0
        self.n_cond = 0
        # Bumped each time a new op list goes live (a commit or an undeploy): kept CUDA
        # graphs compare it to know when their spliced op nodes are stale
        # (xmix.runtime.graphs.ensure_current).
        self.ops_generation = 0
        # Bitmasks of apps by mode and kind (refresh_masks), so the per-step path is a few
        # integer operations.
        self.all_mask = self.on_mask = self.read_mask = self.span_mask = 0
        self.monitor_mask = 0  # apps with a stop or a since(...) term
        self.step_masks = _C.HostStepMasks(0, 0, 0, 0, 0)  # the same, for _C.HostStep
        self.write_header(n_tokens=0, n_rows=0)
        self.sync_all()

    def refresh_masks(self) -> None:
        """The bitmasks, after every control change."""
        all_m = on_m = read_m = span_m = mon_m = 0
        for inst in self.apps.values():
            bit = 1 << inst.index
            if inst.sinces or inst.lowered.stop is not None:
                mon_m |= bit
            if inst.mode == "all":
                all_m |= bit
            if inst.mode != "off":
                on_m |= bit
            if inst.channels:
                read_m |= bit
            if inst.spans:
                span_m |= bit
        self.all_mask, self.on_mask, self.read_mask = all_m, on_m, read_m
        self.span_mask, self.monitor_mask = span_m, mon_m
        self.step_masks = _C.HostStepMasks(all_m, on_m, span_m, mon_m, read_m)

    # ------------------------------------------------------------------ host -> device
    def staging_stats(self) -> dict[str, int]:
        """Host waits for a staging or read-back set (more steps queued than sets) and
        blocking full copies of the slot rows; all zero in steady state."""
        if self.stage is None or self.readback is None:
            return {}
        return {
            "staging_waits": self.stage.ring.waits,
            "readback_waits": self.readback.ring.waits,
            "full_param_copies": self.stats["full_param_copies"],
        }

    def mark_row(self, slot: int) -> None:
        if self.stage is not None:
            self.stage.mark_row(slot)

    def param_width(self) -> int:
        """Columns of a parameter row any deployed app uses (first fit keeps them low)."""
        return max((a.param_base + len(a.param_cols) for a in self.apps.values()), default=0)

    def write_header(self, **fields: int) -> None:
        values: dict[str, int] = {
            "max_tokens": self.cap.max_tokens,
            "max_slots": self.cap.max_slots,
            "max_apps": self.cap.max_apps,
            "n_params": self.cap.max_params,
            "n_channels": self.cap.max_channels,
            "n_sites": self.n_sites,
            "vec_state_width": self.vec_width,
            "vocab_words": self.vocab_words,
            "n_spans": self.arena.extent("spans"),
            "n_token_sets": self.arena.extent("token_sets"),
            "capture_size": self.cap.capture_floats,
        }
        for name, t in self.dev.items():
            values[name] = t.data_ptr()
        values.update(fields)
        for name, v in values.items():
            self._header[name][0] = v

    def set_step_header(self, n_tokens: int, n_rows: int) -> None:
        self._step_counts[0] = n_tokens
        self._step_counts[1] = n_rows

    def launch(self, fn: Any) -> None:
        """Device work in stream order when staged (steps in flight may still read what it
        changes), at once otherwise."""
        if self.xfer is not None:
            self.xfer.launch(fn)
        else:
            fn()

    def sync(self, *names: str, rows: int | None = None, running: Any = ()) -> None:
        """Host -> device for the named buffers after a control change (no-op on CPU).

        Control changes are rare, so this waits for the copies (and the steps queued before
        them): a host mirror is never rewritten while a queued copy may still read it, and
        the change reaches the steps queued after it, never those before. Per-slot rows
        (slot_apps, slot_params) go with the next step as changed rows instead; a change of
        slot_apps in every row (e.g. remove() cleared an app's bit) names the ``running``
        slots."""
        if self.xfer is None or self.stage is None:
            return
        for n in names:
            if n in ROW_BUFFERS:
                if n == "slot_apps":
                    self.stage.dirty.update(running)
                continue
            src, dst = self.host_t[n], self.dev[n]
            if rows is not None:
                src, dst = src[:rows], dst[:rows]
            self.xfer.copy(dst, src)
        self.xfer.synchronize()

    def sync_block(self) -> None:
        if self.xfer is not None:
            self.xfer.copy(self.block, self.block_host)  # n_tokens = 0 there: no step is on
            self.xfer.synchronize()
        else:
            self.block.copy_(self.block_host)

    def sync_all(self) -> None:
        self.sync(*self.dev)
        self.sync_block()
