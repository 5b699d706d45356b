"""ControlBlock: the control block's fixed-address buffers and the host operations between
steps, composed from the parts in this package (layout, arena, link, slots, stage, drain,
custom).

Every buffer is allocated once, at its capacity, on the engine's device; deploys and
parameter changes rewrite contents, never addresses, so captured CUDA graphs stay valid.
On a CPU engine the host views are the buffers themselves; on a GPU each buffer has a pinned
host mirror and changes are copied on the current stream before the next forward.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from xmix import _C
from xmix.control import site_state
from xmix.control.arena import Arena, Claims
from xmix.control.custom import load_custom
from xmix.control.drain import (
    MonitorPlan,
    PendingReads,
    PlannedRead,
    ReadBack,
    Results,
    collect,
    collect_monitors,
    monitor_plan,
    read_plan,
)
from xmix.control.layout import (
    CTRL_DTYPE,
    CTRL_LAYOUT,
    CTRL_SIZE,
    MODES,
    ROW_BUFFERS,
    Capacity,
    K,
    buffer_spec,
)
from xmix.control.link import InstalledApp, SiteOp, Tables, build_tables, link_app, unlink_app
from xmix.control.params import resolve_params
from xmix.control.slots import SlotState, SlotTable
from xmix.control.stage import StepStaging
from xmix.hooks import ModelShape, n_sites
from xmix.lowering import DeployError, LoweredApp, RequestError
from xmix.results_codec import DEFAULT_OPTIONS, ResultOptions
from xmix.staging import CudaQueue, DeviceQueue

Arr = np.ndarray[Any, Any]


class GraphHook(Protocol):
    def note_anchor(
        self,
        site: int,
        h: torch.Tensor,
        r: torch.Tensor | None,
        n: int,
        d: int,
        sh: int,
        sr: int,
        dt: int,
    ) -> None: ...


@dataclass
class _Staged:
    """A deploy that passed every check, waiting for its commit."""

    inst: InstalledApp
    tables: Tables
    claims: Claims
    generation: int  # the ops_generation it was built against


class ControlBlock:
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
        self._host_t: dict[str, torch.Tensor] = {}
        for name, (n, dt) in buffer_spec(
            cap, self.n_sites, self.vec_width, self.vocab_words
        ).items():
            t = torch.zeros(n, dtype=dt, device=self.device)
            self.dev[name] = t
            if self.xfer is not None:
                h = self.xfer.pinned(n, dt)
                self._host_t[name] = h
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
        self._block_host = (
            self.xfer.pinned(CTRL_SIZE, torch.uint8)
            if self.xfer is not None
            else torch.zeros(CTRL_SIZE, dtype=torch.uint8)
        )
        self._header = self._block_host.numpy().view(CTRL_DTYPE)
        off = CTRL_LAYOUT["n_tokens"]
        assert CTRL_LAYOUT["n_rows"] == off + 4 and off % 4 == 0
        self._step_counts = self._block_host.numpy()[off : off + 8].view(
            np.int32
        )  # n_tokens, n_rows
        self.apps: dict[str, InstalledApp] = {}
        self.stats = {"full_param_copies": 0}
        self._stage: StepStaging | None = None
        self._readback: ReadBack | None = None
        if self.xfer is not None:
            self._stage = StepStaging(
                self.xfer,
                cap,
                self.device,
                self.block,
                self.dev,
                self.host,
                self._host_t,
                self.stats,
            )
            self._readback = ReadBack(self.xfer, cap, self.device)
        self._seq = 0
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
        self._slots = SlotTable(cap.max_slots)
        self.site_app_mask = np.zeros(self.n_sites, dtype=np.uint64)
        # Which sites have an op of an app running this step: one fixed buffer, rewritten in
        # place each step, since the native site kernel (xmix.ops) reads it by address.
        self.site_active: Arr = np.zeros(self.n_sites, dtype=bool)
        # What the native site kernel reports back: host seconds, failed ops (site_state.py)
        self.site_state = site_state.new_state()
        self.any_active = False
        self._step_reads = False
        self._step_monitors = False
        self._n_app_slots = 0
        self._all_mask = self._on_mask = self._read_mask = self._span_mask = 0
        self._monitor_mask = 0  # apps with a stop or a since(...) term
        self._mplan: tuple[tuple[int, int], MonitorPlan] | None = None
        # Per slot: one past the last position a step with apps ran on; a preempted request's
        # monitors do not decide the positions below it again when it recomputes.
        self._extent = np.zeros(cap.max_slots, dtype=np.int64)
        self._floor = np.zeros(cap.max_slots, dtype=np.int64)  # what the device's floor holds
        self.step_rows: tuple[Arr, int] | None = None  # (slots of the step's rows, rows)
        self.step_tokens = 0
        self.step_active = 0
        self._map_ptrs = {
            k: self.host[k].ctypes.data
            for k in (
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
        }
        self.n_ops = 0
        self.n_cond = 0
        # Bumped each time a new op list goes live (a commit or an undeploy): kept CUDA
        # graphs compare it to know when their spliced op nodes are stale
        # (xmix.graphs.ensure_current).
        self.ops_generation = 0
        self._staged: dict[str, _Staged] = {}
        # Requests whose app failed inside a site program this step: req id -> message
        # (the worker finishes them with an error); failures per app name.
        self.failed: dict[str, str] = {}
        self.site_errors: dict[str, int] = {}
        # Host seconds in active site programs of the Python reference kernel (ops.py); the
        # native kernel's are in site_state; the worker reports both (site_seconds).
        self.py_site_seconds = 0.0
        self.graph_hook: GraphHook | None = None  # set by the CUDA-graph capture hook
        self._site_ops: list[list[SiteOp]] = [[] for _ in range(self.n_sites)]
        self._site_custom: dict[int, list[tuple[int, SiteOp]]] = {}
        if self.on_gpu:
            self._custom_select = torch.zeros(cap.max_tokens, dtype=torch.uint8, device=self.device)
            self._custom_out = torch.zeros(cap.max_tokens, dtype=torch.float32, device=self.device)
        self._write_header(n_tokens=0, n_rows=0)
        self._sync_all()

    # ------------------------------------------------------------------ views
    @property
    def ptr(self) -> int:
        return self.block.data_ptr()

    @property
    def slots(self) -> dict[str, int]:
        """Running requests' slots by request id."""
        return self._slots.slots

    @property
    def slot_req(self) -> dict[int, SlotState]:
        """Running requests by slot."""
        return self._slots.slot_req

    def staging_stats(self) -> dict[str, int]:
        """Host waits for a staging or read-back set (more steps queued than sets) and
        blocking full copies of the slot rows; all zero in steady state."""
        if self._stage is None or self._readback is None:
            return {}
        return {
            "staging_waits": self._stage.ring.waits,
            "readback_waits": self._readback.ring.waits,
            "full_param_copies": self.stats["full_param_copies"],
        }

    # ------------------------------------------------------------------ host -> device
    def _mark_row(self, slot: int) -> None:
        if self._stage is not None:
            self._stage.mark_row(slot)

    def _param_width(self) -> int:
        """Columns of a parameter row any deployed app uses (first fit keeps them low)."""
        return max((a.param_base + len(a.param_cols) for a in self.apps.values()), default=0)

    def _write_header(self, **fields: int) -> None:
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

    def _set_step_header(self, n_tokens: int, n_rows: int) -> None:
        self._step_counts[0] = n_tokens
        self._step_counts[1] = n_rows

    def _launch(self, fn: Any) -> None:
        """Device work in stream order when staged (steps in flight may still read what it
        changes), at once otherwise."""
        if self.xfer is not None:
            self.xfer.launch(fn)
        else:
            fn()

    def _sync(self, *names: str, rows: int | None = None) -> None:
        """Host -> device for the named buffers after a control change (no-op on CPU).

        Control changes are rare, so this waits for the copies (and the steps queued before
        them): a host mirror is never rewritten while a queued copy may still read it, and
        the change reaches the steps queued after it, never those before. Per-slot rows
        (slot_apps, slot_params) go with the next step as changed rows instead."""
        if self.xfer is None or self._stage is None:
            return
        for n in names:
            if n in ROW_BUFFERS:
                if n == "slot_apps":  # e.g. remove() cleared an app's bit in every slot
                    self._stage.dirty.update(self.slot_req)
                continue
            src, dst = self._host_t[n], self.dev[n]
            if rows is not None:
                src, dst = src[:rows], dst[:rows]
            self.xfer.copy(dst, src)
        self.xfer.synchronize()

    def _sync_block(self) -> None:
        if self.xfer is not None:
            self.xfer.copy(self.block, self._block_host)  # n_tokens = 0 there: no step is on
            self.xfer.synchronize()
        else:
            self.block.copy_(self._block_host)

    def _sync_all(self) -> None:
        self._sync(*self.dev)
        self._sync_block()

    # ------------------------------------------------------------------ apps
    # A control change is a transaction: every check, allocation and the complete new op
    # list (site tables, op descriptors, condition code, token sets, spans) is built aside;
    # only then is it swapped in (``_swap``), between two steps. A refusal leaves the live
    # control block untouched: no step ever runs on a half-written table.
    def install(self, lowered: LoweredApp, mode: str = "request", version: int = 0) -> InstalledApp:
        """Place a lowered app (prepare, then commit); nothing changes when this raises."""
        with self.lock:
            self.prepare_install(lowered, mode, version)
            return self.commit_install(lowered.name)

    def prepare_install(self, lowered: LoweredApp, mode: str = "request", version: int = 0) -> None:
        """Every check of a deploy and the new tables, built aside; the live state is not
        touched. ``commit_install`` makes it live, ``abort_install`` drops it."""
        with self.lock:
            name = lowered.name
            self.abort_install(name)
            if name in self.apps:
                raise DeployError(
                    f"app {name!r} is already deployed; undeploy it first "
                    f"or deploy under another name"
                )
            if mode not in MODES:
                raise DeployError(f"app {name!r}: mode must be one of {list(MODES)}, got {mode!r}")
            taken = {a.index for a in self.apps.values()} | {
                s.inst.index for s in self._staged.values()
            }
            free_idx = [i for i in range(self.cap.max_apps) if i not in taken]
            if not free_idx:
                raise DeployError(f"app {name!r}: {self.cap.max_apps} apps are deployed already")
            claims = Claims()
            try:
                inst = link_app(
                    lowered,
                    free_idx[0],
                    self._seq,
                    mode,
                    self.arena,
                    claims,
                    self.device,
                    self.cap.max_tokens,
                )
                inst.version = version
                for k, fn in load_custom(lowered, self.on_gpu).items():
                    inst.linked[k].fn = fn
                tables = self._build_tables({**self.apps, name: inst})
            except Exception:
                claims.release()
                raise
            self._staged[name] = _Staged(inst, tables, claims, self.ops_generation)

    def commit_install(self, name: str) -> InstalledApp:
        """Swap a prepared app in. Refused (and dropped) if the deployed apps changed since
        it was prepared; the frontend serialises control changes, so that is a bug there."""
        with self.lock:
            st = self._staged.pop(name, None)
            if st is None:
                raise DeployError(f"app {name!r}: nothing prepared to commit")
            if st.generation != self.ops_generation or name in self.apps:
                st.claims.release()
                raise DeployError(f"app {name!r}: the deployed apps changed since it was prepared")
            inst = st.inst
            self._seq += 1
            self._zero_counter(inst.index)
            self._swap({**self.apps, name: inst}, st.tables)
            if inst.sinces:  # an undeployed app's since terms may have held in these columns
                self._clear_sinces(list(inst.sinces.values()))
            self._rewrite_bits(inst)  # requests running opted out of it (mode "all")
            # Requests already running see the app's defaults in their param rows.
            for slot in self.slot_req:
                self._write_slot_params(slot, inst)
            self._sync("slot_params")
            return inst

    def abort_install(self, name: str) -> bool:
        """Drop a prepared app (its allocations return to the free lists)."""
        with self.lock:
            st = self._staged.pop(name, None)
            if st is None:
                return False
            st.claims.release()
            return True

    def remove(self, name: str) -> None:
        with self.lock:
            inst = self.apps.get(name)
            if inst is None:
                raise DeployError(f"app {name!r} is not deployed")
            rest = {k: v for k, v in self.apps.items() if k != name}
            self._swap(rest, self._build_tables(rest))  # fewer ops: cannot overflow
            bit = np.int64(1) << np.int64(inst.index)
            self.host["slot_apps"][:] &= ~bit
            self._n_app_slots = int(np.count_nonzero(self.host["slot_apps"]))
            # Running and preempted requests forget the app and its parameter columns: an
            # app deployed later under the same name is another app.
            for st in self._slots.every_request():
                st.apps.discard(name)
                st.overrides.pop(name, None)
            unlink_app(inst, self.arena, self.cap.max_tokens)
            self._sync("slot_apps")

    def set_mode(self, name: str, mode: str) -> None:
        self.patch(name, mode=mode)

    def set_params(self, name: str, params: dict[str, Any]) -> None:
        """Change an app's defaults; running requests that did not override a parameter see
        the new value from the next step."""
        self.patch(name, params=params)

    def patch(
        self, name: str, mode: str | None = None, params: dict[str, Any] | None = None
    ) -> None:
        """Mode and/or default parameters of a deployed app, as one change: both are
        checked before either is applied."""
        with self.lock:
            if name not in self.apps:
                raise DeployError(f"app {name!r} is not deployed")
            if mode is not None and mode not in MODES:
                raise DeployError(f"mode must be one of {list(MODES)}, got {mode!r}")
            inst = self.apps[name]
            cols = (
                resolve_params(inst.param_cols, params, who=f"app {name!r}")
                if params is not None
                else {}
            )
            if cols:
                for col, v in cols.items():
                    inst.param_cols[col].default = v
                for slot in self.slot_req:
                    self._write_slot_params(slot, inst)
                self._sync("slot_params")
            if mode is not None:
                inst.mode = mode
                self.host["app_mode"][inst.index] = MODES[mode]
                self._sync("app_mode")
                self._rewrite_bits(inst)
                self._refresh_masks()

    def _zero_counter(self, index: int) -> None:
        def zero() -> None:
            self.dev["app_nonfinite"][index] = 0

        self._launch(zero)

    def nonfinite_writes(self) -> dict[str, int]:
        """Per deployed app: elements of the stream its writes would have made non-finite,
        left as they were (built-in kernels) or set to 0 (user kernels). On a GPU this reads
        the device (control-plane calls only, never per step)."""
        with self.lock:
            counts = (
                self.dev["app_nonfinite"].cpu().numpy()
                if self.staged or self.on_gpu
                else self.host["app_nonfinite"]
            )
            return {inst.name: int(counts[inst.index]) for inst in self.apps.values()}

    def site_failed(self, site: int, failures: Sequence[tuple[int | None, str | bytes]]) -> None:
        """Ops of a site program failed this step (``failures``: (app index, message), or
        app index None: the whole site). The requests of the step that used those apps are
        recorded for the worker to finish with an error; every other request is untouched."""
        with self.lock:
            by_index = {inst.index: inst for inst in self.apps.values()}
            slots = self.step_rows[0][: self.step_rows[1]].tolist() if self.step_rows else []
            for index, raw in failures:
                msg = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
                if index is None:
                    hit = [
                        by_index[i] for i in by_index if (int(self.site_app_mask[site]) >> i) & 1
                    ]
                    self._clear_reads(hit)
                else:
                    hit = [by_index[index]] if index in by_index else []
                for inst in hit:
                    self.site_errors[inst.name] = self.site_errors.get(inst.name, 0) + 1
                    for slot in slots:
                        st = self.slot_req.get(slot)
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
        n_tok, R = self.step_tokens, self.cap.max_channels
        if chans and n_tok:
            self.dev["result_valid"][: n_tok * R].view(n_tok, R)[:, chans] = 0

    def take_failed(self) -> dict[str, str]:
        self.collect_site_failures()
        with self.lock:
            out, self.failed = self.failed, {}
            return out

    @property
    def site_seconds(self) -> float:
        """Host seconds spent in active site programs (CPU engine), both kernels."""
        return self.py_site_seconds + float(self.site_state["seconds"][0])

    def collect_site_failures(self) -> None:
        """Hand what the native site kernel recorded during the forward to site_failed
        (before the drain: a site that did not run must clear its apps' reads first)."""
        if not self.site_state["n_failed"][0]:
            return
        by_site, overflow = site_state.take_failures(self.site_state)
        if overflow:  # not every failure was kept: every app that ran fails
            for site in np.flatnonzero(self.site_active).tolist():
                by_site.setdefault(site, []).append((None, b"too many site failures to keep"))
        for site, failures in by_site.items():
            self.site_failed(site, failures)

    def no_sites_this_step(self) -> None:
        self.site_active.fill(False)

    def _rewrite_bits(self, inst: InstalledApp) -> None:
        """Each running request's bit of one app after its mode changed (the bit means
        "uses it" in mode request, "opted out" in mode all)."""
        bit = np.int64(1) << np.int64(inst.index)
        rows = self.host["slot_apps"]
        changed = False
        for slot, st in self.slot_req.items():
            want = st.bit(inst)
            if bool(rows[slot] & bit) != want:
                rows[slot] = (rows[slot] | bit) if want else (rows[slot] & ~bit)
                self._mark_row(slot)
                changed = True
        if changed:
            self._n_app_slots = int(np.count_nonzero(rows))
            self._sync("slot_apps")

    def _write_slot_params(self, slot: int, inst: InstalledApp) -> None:
        self._mark_row(slot)
        row = self.host["slot_params"][
            slot * self.cap.max_params : (slot + 1) * self.cap.max_params
        ]
        overrides = (
            self.slot_req[slot].overrides.get(inst.name, {}) if slot in self.slot_req else {}
        )
        for i, c in enumerate(inst.param_cols):
            row[inst.param_base + i] = overrides.get(i, c.default)

    def _build_tables(self, apps: dict[str, InstalledApp]) -> Tables:
        return build_tables(
            apps, self.n_sites, self.cap.max_ops, self.cap.max_cond, self.vocab_words
        )

    def _swap(self, apps: dict[str, InstalledApp], t: Tables) -> None:
        """Make a new op list live. The only place the tables are written; every check
        happened before. Staged (GPU), ``_sync`` waits for its copies: the host mirrors are
        never rewritten while a queued copy may still read them."""
        h = self.host
        h["ops"][: len(t.ops)] = t.ops
        h["cond_code"][: t.n_cond * 4] = t.cond
        h["site_first"][:] = t.site_first
        h["site_count"][:] = t.site_count
        h["tokset_bits"].view(np.uint32)[:] = t.tokset_bits
        h["span_def"][:] = t.span_def
        h["app_mode"][:] = K["MODE_OFF"]
        for inst in apps.values():
            h["app_mode"][inst.index] = MODES[inst.mode]
        self.apps.clear()
        self.apps.update(apps)
        self.site_app_mask[:] = t.site_app_mask
        self._site_ops = t.site_ops
        self._site_custom = t.site_custom
        self.n_ops, self.n_cond = t.n_ops, t.n_cond
        self._write_header(n_token_sets=t.n_sets, n_spans=t.n_spans)
        self._sync(
            "ops", "cond_code", "site_first", "site_count", "tokset_bits", "span_def", "app_mode"
        )
        self._sync_block()
        self._refresh_masks()
        self.ops_generation += 1

    def launch_custom_ops(
        self,
        site: int,
        h: torch.Tensor,
        r: torch.Tensor | None,
        n: int,
        d: int,
        sh: int,
        sr: int,
        dt: int,
        stream: int,
    ) -> None:
        """GPU: user kernels of a site, after its built-in ops (the anchor skips them)."""
        for k, so in self._site_custom.get(site, ()):
            lo = so.linked
            art = lo.artifacts.get("a0")
            _C.launch_custom(
                self.ptr,
                site,
                k,
                lo.fn,
                h.data_ptr(),
                r.data_ptr() if r is not None else 0,
                sh,
                sr,
                n,
                d,
                dt,
                self.cap.max_params,
                self.dev["tok_slot"].data_ptr(),
                self.dev["tok_pos"].data_ptr(),
                self.dev["slot_params"].data_ptr(),
                lo.param_col,
                art.data_ptr() if art is not None else 0,
                int(art.numel()) if art is not None else 0,
                self._custom_select.data_ptr(),
                self._custom_out.data_ptr(),
                stream,
            )

    # ------------------------------------------------------------------ requests
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
        with self.lock:
            if req_id in self.slots:
                return self.slots[req_id]
            overrides: dict[str, dict[int, float]] = {}
            for a in apps:
                if a not in self.apps:
                    raise RequestError(f"unknown app {a!r}; deployed: {sorted(self.apps)}")
            for a, p in (params or {}).items():
                if a not in self.apps:
                    raise RequestError(
                        f"params for unknown app {a!r}; deployed: {sorted(self.apps)}"
                    )
                overrides[a] = resolve_params(self.apps[a].param_cols, p, who=f"app {a!r}")
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
        with self.lock:
            if req_id in self.slots:
                return self.slots[req_id], []

            def pinned(a: str) -> InstalledApp | None:
                inst, pin = self.apps.get(a), pins.get(a)
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
        slot = self._slots.occupy(st)
        self._extent[slot] = self._floor[slot] = st.floor
        st.apps &= set(self.apps)  # an app undeployed while the request waited
        mask = 0
        for inst in self.apps.values():
            if st.bit(inst):
                mask |= 1 << inst.index
        self.host["slot_apps"][slot] = np.uint64(mask).astype(np.int64)
        self._mark_row(slot)
        self._n_app_slots += mask != 0
        for inst in self.apps.values():
            self._write_slot_params(slot, inst)
        self._reset_slot_state(slot)
        if st.floor or st.sinces is not None:
            self._restore_monitors(slot, st)
        return slot

    def suspend(self, req_id: str) -> None:
        """A preempted request gives its slot back and keeps its record (apps, parameters,
        what it has reported): slots never outnumber the running requests."""
        with self.lock:
            slot = self.slots.get(req_id)
            if slot is not None and self._monitor_mask:
                # what its monitors decided so far survives the recompute
                st0 = self.slot_req[slot]
                st0.floor = int(max(self._extent[slot], self._floor[slot]))
                st0.sinces = self._read_sinces(slot)
            st = self.release(req_id)
            if st is not None:
                self._slots.suspended[req_id] = st

    def resume(self, req_id: str) -> int | None:
        """The slot of a request coming back after preemption (it recomputes, so its state
        starts over), or None if it was never suspended."""
        with self.lock:
            st = self._slots.suspended.pop(req_id, None)
            return None if st is None else self._occupy(st)

    # ------------------------------------------------------------------ monitors
    def recompute(self, slot: int) -> None:
        """A request that starts again at position 0 in the slot it holds: its monitors keep
        what they decided and do not decide those positions again."""
        if self._monitor_mask:
            floor = int(max(self._extent[slot], self._floor[slot]))
            self._floor[slot] = floor
            self._launch(lambda: self.dev["slot_floor"][slot].fill_(floor))

    def _read_sinces(self, slot: int) -> Arr:
        """A slot's since terms (first positions) from the device: on a GPU this waits for
        the steps queued before (preemption only, never per step)."""
        M = K["MAX_STICKY"]
        if self.xfer is not None:
            self.xfer.synchronize()
        row: Arr = self.dev["slot_sticky"][slot * M : (slot + 1) * M].cpu().numpy().copy()
        return row

    def _restore_monitors(self, slot: int, st: SlotState) -> None:
        M = K["MAX_STICKY"]
        floor = st.floor
        sinces = (
            torch.from_numpy(st.sinces.copy()).to(self.device) if st.sinces is not None else None
        )

        def restore() -> None:
            self.dev["slot_floor"][slot].fill_(floor)
            if sinces is not None:
                self.dev["slot_sticky"][slot * M : (slot + 1) * M].copy_(sinces)

        self._launch(restore)

    def _clear_sinces(self, cols: list[int]) -> None:
        """Since columns handed to a new app start unset in every slot (and in the records of
        preempted requests)."""
        M, S = K["MAX_STICKY"], self.cap.max_slots
        idx = torch.tensor(cols, dtype=torch.int64)
        for st in self._slots.suspended.values():
            if st.sinces is not None:
                st.sinces[cols] = K["NO_POSITION"]

        def clear() -> None:
            self.dev["slot_sticky"].view(S, M)[:, idx.to(self.device)] = K["NO_POSITION"]

        self._launch(clear)

    def _reset_slot_state(self, slot: int) -> None:
        """A new request starts with empty latch sums, spans and CAST means, whatever the
        previous occupant of its slot left (the prologue also resets a request that restarts
        at position 0, e.g. after preemption)."""
        R, W = self.cap.max_channels, K["READ_STATE_WIDTH"]

        M = K["MAX_STICKY"]

        def reset() -> None:
            rs = self.dev["read_state"][slot * R * W : (slot + 1) * R * W].view(R, W)
            rs[:, :2] = 0.0
            rs[:, 2] = float("nan")
            self.dev["vec_state"][slot * self.vec_width : (slot + 1) * self.vec_width] = 0.0
            self.dev["slot_span"][slot] = 0
            self.dev["slot_sticky"][slot * M : (slot + 1) * M] = K["NO_POSITION"]
            self.dev["slot_floor"][slot] = 0

        # in stream order: steps still in flight may use the slot's previous occupant
        self._launch(reset)

    def release(self, req_id: str) -> SlotState | None:
        with self.lock:
            got = self._slots.release(req_id)
            if got is None:
                return None
            slot, st = got
            self._n_app_slots -= int(self.host["slot_apps"][slot] != 0)
            self.host["slot_apps"][slot] = 0
            self._mark_row(slot)
            return st

    # ------------------------------------------------------------------ per step
    def begin_step(
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
        n_req = len(row_slots)
        # Which apps run: those in mode "all" plus those of the batch's requests (not off).
        active = self._all_mask
        if self._n_app_slots and n_req:
            active |= int(np.bitwise_or.reduce(self.host["slot_apps"][row_slots]))
        active &= self._on_mask
        if not active and not self._span_mask:
            self.site_active.fill(False)
            self.any_active = False
            self._step_reads = False
            self._step_monitors = False
            return False
        slots = np.ascontiguousarray(row_slots, dtype=np.int32)
        n_tok_a = np.ascontiguousarray(row_n_tok, dtype=np.int64)
        start = np.ascontiguousarray(row_start_pos, dtype=np.int64)
        plen = np.ascontiguousarray(row_prompt_len, dtype=np.int64)
        n_tok = int(n_tok_a.sum())
        if (
            n_tok > self.cap.max_tokens
            or n_req > self.cap.max_slots
            or (n_rows_padded or 0) > self.cap.max_tokens
        ):
            raise RuntimeError(
                f"xmix: step of {max(n_tok, n_rows_padded or 0)} rows / {n_req} requests "
                f"exceeds capacity ({self.cap.max_tokens} / {self.cap.max_slots})"
            )
        padded = max(n_tok, n_rows_padded or 0)
        if self._stage is not None:
            st = self._stage.step_set = self._stage.ring.next()
            _C.fill_step_maps(
                n_req,
                slots.ctypes.data,
                n_tok_a.ctypes.data,
                start.ctypes.data,
                plen.ctypes.data,
                padded,
                st.ptrs,
            )
            st.np["header"][:] = (n_tok, n_req)
            after = None
            if self._readback is not None:
                after, self._readback.event = self._readback.event, None
            self._stage.stage_step(st, padded, n_req, self._param_width(), after)
        else:
            _C.fill_step_maps(
                n_req,
                slots.ctypes.data,
                n_tok_a.ctypes.data,
                start.ctypes.data,
                plen.ctypes.data,
                padded,
                self._map_ptrs,
            )
            self._set_step_header(n_tok, n_req)
            self._sync_block()
        np.not_equal(self.site_app_mask & np.uint64(active), 0, out=self.site_active)
        self.step_rows = (slots, n_req)
        self.step_tokens = n_tok
        self.step_active = active
        self.any_active = bool(active)
        self._step_reads = bool(active & self._read_mask)
        self._step_monitors = bool(active & self._monitor_mask)
        if self._monitor_mask:
            # positions only grow within a request (a restart resets its floor first), so
            # the last step's end is the extent
            self._extent[slots] = start + n_tok_a
        return True

    def could_run(self) -> bool:
        """Whether any app could run in a step (cheap; before the step's maps are built)."""
        return bool(
            ((self._all_mask | (self._on_mask if self._n_app_slots else 0)) & self._on_mask)
            or self._span_mask
        )

    def _refresh_masks(self) -> None:
        """Bitmasks of apps by mode and kind, kept current on every control change so the
        per-step path is a few integer operations."""
        self._all_mask = self._on_mask = self._read_mask = self._span_mask = 0
        self._monitor_mask = 0
        for inst in self.apps.values():
            bit = 1 << inst.index
            if inst.sinces or inst.lowered.stop is not None:
                self._monitor_mask |= bit
            if inst.mode == "all":
                self._all_mask |= bit
            if inst.mode != "off":
                self._on_mask |= bit
            if inst.channels:
                self._read_mask |= bit
            if inst.spans:
                self._span_mask |= bit

    def end_step(self) -> None:
        """After the forward: an empty step, so forwards outside the runner's step (dummy
        runs, graph captures) find every row inert."""
        if self._stage is not None:
            self._stage.end_step()
        elif self.any_active or self._span_mask:
            self._set_step_header(0, 0)
            self._sync_block()
        self.site_active.fill(False)
        self.any_active = False
        self._step_reads = False
        self._step_monitors = False

    def prologue(self, input_ids: torch.Tensor) -> None:
        """Per-slot resets, token-set and span bits for this step (before the forward)."""
        if not self.apps:
            return
        ids = input_ids.reshape(-1)
        if self.on_gpu:
            _C.launch_prologue(
                self.ptr,
                ids.data_ptr(),
                ids.element_size(),
                self.cap.max_slots,
                torch.cuda.current_stream(ids.device).cuda_stream,
            )
        elif self.xfer is not None:
            ptr = self.ptr
            self.xfer.launch(lambda: _C.run_prologue_cpu(ptr, ids.data_ptr(), ids.element_size()))
        else:
            _C.run_prologue_cpu(self.ptr, ids.data_ptr(), ids.element_size())

    # ------------------------------------------------------------------ results
    def _read_plan(self) -> list[PlannedRead]:
        return read_plan(self.apps.values(), self.step_active)

    def drain(self) -> Results:
        """Read results of this step: {req_id: {app: {read: ReadResult}}} (arrays; each
        ReadResult reads as {positions, values} in the default shape), and a request's
        ``TRUNCATED_KEY`` marker in the step its byte cap was reached.

        Only rank 0 drains (hidden states are replicated across tensor-parallel ranks). Staged
        (GPU), this waits for the device; the engine path uses drain_async instead.
        Monitors report under ``STOPPED_KEY`` / ``SWITCHED_KEY`` (drain.collect_monitors)."""
        self.collect_site_failures()
        if not (self._step_reads or self._step_monitors):
            return {}
        if self.staged:
            p = self.drain_async()
            return p.result() if p is not None else {}
        assert self.step_rows is not None
        slots, n_req = self.step_rows
        out: Results = self._drain_reads() if self._step_reads else {}
        if self._step_monitors:
            keys, bits = self.host["row_stop"][:n_req], self.host["row_switched"][:n_req]
            if (keys != -1).any() or bits.any():  # most steps: nothing fired
                mon = collect_monitors(
                    self._monitor_plan(),
                    keys,
                    bits,
                    self.host["slot_sticky"],
                    slots[:n_req],
                    [self.slot_req.get(int(x)) for x in slots[:n_req]],
                )
                for rid, got in mon.items():
                    out.setdefault(rid, {}).update(got)
        return out

    def _monitor_plan(self) -> MonitorPlan:
        key = (self.ops_generation, self.step_active)
        if self._mplan is None or self._mplan[0] != key:
            self._mplan = (key, monitor_plan(self.apps.values(), self.step_active))
        return self._mplan[1]

    def _drain_reads(self) -> Results:
        n_tok = self.step_tokens
        R, T = self.cap.max_channels, self.cap.max_tokens
        res = self.host["results"][: n_tok * R].reshape(n_tok, R)
        valid = self.host["result_valid"][: n_tok * R].reshape(n_tok, R)
        assert self.step_rows is not None
        slots = self.step_rows[0]
        capture = self.host["capture"]

        def captured(cap: tuple[Any, ...], idx: Arr) -> Arr:
            base, w = cap
            return capture[base : base + T * w].reshape(-1, w)[idx]

        return collect(
            res,
            valid,
            self.host["tok_pos"][:n_tok],
            self.host["tok_row"][:n_tok],
            lambda row: self.slot_req.get(int(slots[row])),
            self._read_plan(),
            captured,
        )

    def drain_async(self) -> PendingReads | None:
        """Staged: queue this step's results (and captured rows) to pinned host memory on a
        side stream; the host waits only when the returned handle's result() is asked for,
        which the worker does where vLLM resolves its own async output (get_output)."""
        if (
            not (self._step_reads or self._step_monitors)
            or self._readback is None
            or self._stage is None
        ):
            return None
        st = self._stage.step_set
        assert st is not None and self.step_rows is not None
        slots, n_req = self.step_rows
        states = [self.slot_req.get(int(x)) for x in slots[:n_req]]
        return self._readback.queue(
            self.dev,
            self._read_plan() if self._step_reads else [],
            self.step_tokens,
            st,
            slots[:n_req],
            states,
            lambda app, pos: self._rows_to_copy(
                app, pos, st.np["row_tok_start"], st.np["row_n_tok"], slots[:n_req], states
            ),
            self._monitor_plan() if self._step_monitors else None,
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
        inst = self.apps[app]
        mask = np.zeros(len(pos), dtype=bool)
        bit = np.int64(1) << np.int64(inst.index)
        for j, sst in enumerate(states):
            if sst is None or sst.truncated:
                continue
            if inst.mode != "all" and not (self.host["slot_apps"][slots[j]] & bit):
                continue
            t0, n = int(starts[j]), int(counts[j])
            win = sst.options.window
            mask[t0 : t0 + n] = True if win is None else win.mask(pos[t0 : t0 + n], sst.prompt_len)
        return None if mask.all() else np.flatnonzero(mask)

    # ------------------------------------------------------------------ introspection
    def describe(self) -> list[dict[str, Any]]:
        out = []
        for inst in sorted(self.apps.values(), key=lambda a: a.seq):
            lw = inst.lowered
            out.append(
                {
                    "name": inst.name,
                    "mode": inst.mode,
                    "sites": lw.sites,
                    "version": inst.version,
                    "reads": sorted(lw.reads),
                    "params": inst.defaults(),
                    "writes": lw.writes,
                    "stateful": lw.stateful,
                    "metadata": lw.app.metadata,
                }
            )
        return out
