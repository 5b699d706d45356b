"""The control block on the Python side: fixed-address buffers, their layout for _C, and the
host operations between steps (install/remove apps, modes, request slots, per-step maps,
draining results).

Every buffer is allocated once, at its capacity, on the engine's device; deploys and
parameter changes rewrite contents, never addresses, so captured CUDA graphs stay valid.
On a CPU engine the host views are the buffers themselves; on a GPU each buffer has a pinned
host mirror and changes are copied on the current stream before the next forward.
"""

from __future__ import annotations

import logging
import math
import reprlib
import shutil
import subprocess
import tempfile
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xmix import _C
from xmix import conditions as C
from xmix.catalog import FLT_MAX, KERNELS
from xmix.hooks import ModelShape, n_sites
from xmix.lowering import (APP_MODES, DeployError, LoweredApp, LoweredOp, RequestError,
                           latch_from_generated, param_bounds)
from xmix.results_codec import (DEFAULT_OPTIONS, TRUNCATED_KEY, ReadResult, ResultOptions,
                                max_result_bytes, position_bytes, read_shape, to_dtype)
from xmix.staging import CudaQueue, DeviceQueue, PinnedRing, PinnedSet

logger = logging.getLogger("xmix")

K = _C.constants()
CTRL_LAYOUT = _C.control_layout()
OP_LAYOUT = _C.op_layout()
OP_SIZE = OP_LAYOUT["__size__"]
MODES = {m: K[f"MODE_{m.upper()}"] for m in APP_MODES}
CMP_CODES = {">=": K["CMP_GE"], ">": K["CMP_GT"], "<=": K["CMP_LE"], "<": K["CMP_LT"],
             "==": K["CMP_EQ"], "!=": K["CMP_NE"]}
FLAG_BITS = {"prompt": 1, "generated": 2, "last_token": 3}
_INT32_FIELDS = {"max_tokens", "max_slots", "max_apps", "n_params", "n_channels", "n_sites",
                 "vec_state_width", "vocab_words", "n_tokens", "n_rows", "n_spans", "n_token_sets"}
_INT32_OP_FIELDS = {"kind", "app", "cond_begin", "cond_len", "param_base", "channel",
                    "state_base", "n", "m", "flags"}
TOK_MAPS = ("tok_slot", "tok_pos", "tok_flags", "tok_row")
GATHER_ROWS = 4  # staged read-back: row indices per token of a step, for windowed capture copies
ROW_MAPS = ("row_slot", "row_tok_start", "row_n_tok", "row_reset", "row_n_prompt", "row_done")
ROW_BUFFERS = ("slot_apps", "slot_params")  # per slot, sent as changed rows with the next step


@dataclass
class Capacity:
    """Fixed sizes of the control block, chosen at engine start."""

    max_tokens: int = 8192        # rows per step (vLLM's max_num_batched_tokens)
    max_slots: int = 256          # concurrently running requests (max_num_seqs)
    max_apps: int = 64
    max_params: int = 4096
    max_channels: int = 256
    max_ops: int = 4096
    max_cond: int = 4096          # condition instructions
    vec_state_floats: int = 0     # per slot; 0 = 4 * (hidden + 1)
    capture_floats: int = 1 << 22  # 16 MiB of captured vectors per step
    # Staged (GPU) only: host staging sets per direction, at least the steps vLLM keeps in
    # flight + 1 (VllmConfig.max_concurrent_batches: 2 with async scheduling), and the
    # parameter floats one step can send as changed rows (more: one blocking full copy).
    staging_depth: int = 3
    staging_param_floats: int = 1 << 18


@dataclass
class InstalledApp:
    lowered: LoweredApp
    index: int                    # bit in slot_apps
    seq: int                      # deployment order
    mode: str
    param_base: int
    param_cols: list["ParamCol"]
    channels: dict[str, int]      # read key -> channel
    token_sets: dict[str, int]    # set name -> global set index
    spans: dict[tuple[str, str], int]
    state: dict[int, int]         # id(LoweredOp) -> vec_state offset
    captures: dict[int, int]      # id(LoweredOp) -> capture offset (floats)
    artifacts: list[torch.Tensor] = field(default_factory=list)  # device copies (kept alive)
    custom_fns: dict[int, int] = field(default_factory=dict)     # id(LoweredOp) -> fn
    version: int = 0              # the frontend's deployment version: requests are pinned to it

    @property
    def name(self) -> str:
        return self.lowered.name

    def defaults(self) -> dict[str, float]:
        return {c.key: c.default for c in self.param_cols if c.public}


@dataclass
class ParamCol:
    name: str
    op: str | None          # None: app-level parameter
    default: float
    public: bool = True     # False: a constant of a condition
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
            cols.append(ParamCol(p, o.name or f"#{o.op_index}", v, True, max(lo, b_lo), min(hi, b_hi)))
    seen: set[float] = set()
    for o in lw.ops:
        for node in C.walk(o.cond) if o.cond is not None else ():
            if isinstance(node, (C.Gate, C.Latch)) and isinstance(node.value, float) and node.value not in seen:
                seen.add(node.value)
                cols.append(ParamCol(f"__const{len(seen)}", None, node.value, False))
    return cols


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
            finite = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v))
        except OverflowError:  # an int beyond any float
            finite = False
        if not finite:
            shown = ("an integer too large for a float" if isinstance(v, int) and not isinstance(v, bool)
                     else _short_repr(v))
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
                raise RequestError(f"{who}: parameter {key!r}={v} out of range [{c.lo:g}, {c.hi:g}]")
            out[i] = float(v)
    return out


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 60, 60


def _short_repr(v: Any) -> str:
    """A bounded repr of a value a client sent (deep nesting is not recursed into)."""
    return _REPR.repr(v)


def _np_view(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


@dataclass
class _Tables:
    """A complete op list for a set of apps, built aside from the live control block."""

    ops: np.ndarray               # n_ops * OP_SIZE bytes
    cond: np.ndarray              # n_cond * 4 int32
    site_first: np.ndarray
    site_count: np.ndarray
    tokset_bits: np.ndarray       # uint32, the whole table
    span_def: np.ndarray
    site_app_mask: np.ndarray
    site_ops: list
    site_custom: dict
    n_ops: int
    n_cond: int
    n_sets: int
    n_spans: int


@dataclass
class _Staged:
    """A deploy that passed every check, waiting for its commit."""

    inst: InstalledApp
    tables: _Tables
    claims: list
    generation: int               # the ops_generation it was built against


def _release(claims) -> None:
    for arr, where in claims:
        arr[where] = False


class ControlBlock:
    def __init__(self, shape: ModelShape, device: torch.device | str = "cpu",
                 capacity: Capacity | None = None, queue: DeviceQueue | None = None):
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
        # Staged: host mirrors apart from the device buffers, everything sent through a device
        # queue (always on a GPU; on a CPU only with a queue given, which tests use to stand
        # in for a GPU stream).
        self.xfer = queue if queue is not None else (CudaQueue(self.device) if self.on_gpu else None)
        self.staged = self.xfer is not None
        T, S, A, P, R = cap.max_tokens, cap.max_slots, cap.max_apps, cap.max_params, cap.max_channels
        i32, f32 = torch.int32, torch.float32
        spec = {
            "tok_slot": (T, i32), "tok_pos": (T, i32), "tok_flags": (T, i32), "tok_row": (T, i32),
            "row_slot": (S, i32), "row_tok_start": (S, i32), "row_n_tok": (S, i32),
            "row_reset": (S, i32), "row_n_prompt": (S, i32), "row_done": (S, i32),
            "slot_apps": (S, torch.int64), "slot_params": (S * P, f32), "slot_span": (S, i32),
            "read_state": (S * R * K["READ_STATE_WIDTH"], f32), "vec_state": (S * self.vec_width, f32),
            "counters": (S * R, i32), "app_nonfinite": (A, i32), "app_mode": (A, i32),
            "site_first": (self.n_sites, i32),
            "site_count": (self.n_sites, i32), "ops": (cap.max_ops * OP_SIZE, torch.uint8),
            "cond_code": (cap.max_cond * 4, i32),
            "tokset_bits": (K["MAX_TOKEN_SETS"] * self.vocab_words, i32),
            "span_def": (K["MAX_SPANS"] * 2, i32), "results": (T * R, f32),
            "result_valid": (T * R, torch.uint8), "capture": (max(cap.capture_floats, 1), f32),
        }
        self.dev: dict[str, torch.Tensor] = {}
        self.host: dict[str, np.ndarray] = {}
        self._host_t: dict[str, torch.Tensor] = {}
        for name, (n, dt) in spec.items():
            t = torch.zeros(n, dtype=dt, device=self.device)
            self.dev[name] = t
            if self.staged:
                h = self.xfer.pinned(n, dt)
                self._host_t[name] = h
                self.host[name] = _np_view(h)
            else:
                self.host[name] = _np_view(t)
        self.host["tok_slot"][:] = -1
        self.host["tok_row"][:] = -1
        self.host["span_def"][:] = -1
        self.host["read_state"].reshape(-1, K["READ_STATE_WIDTH"])[:, 2] = np.nan
        self.host["results"][:] = np.nan  # and result_valid 0: nothing reported yet
        self.block = torch.zeros(CTRL_LAYOUT["__size__"], dtype=torch.uint8, device=self.device)
        self._block_host = (self.xfer.pinned(CTRL_LAYOUT["__size__"], torch.uint8) if self.staged
                            else torch.zeros(CTRL_LAYOUT["__size__"], dtype=torch.uint8))
        self.apps: dict[str, InstalledApp] = {}
        self.stats = {"full_param_copies": 0}
        if self.staged:
            self._init_staging()
        self._seq = 0
        self._param_used = np.zeros(P, dtype=bool)
        self._chan_used = np.zeros(R, dtype=bool)
        self._set_used = np.zeros(K["MAX_TOKEN_SETS"], dtype=bool)
        self._span_used = np.zeros(K["MAX_SPANS"], dtype=bool)
        self._state_used = np.zeros(self.vec_width, dtype=bool)
        self._capture_used = np.zeros(max(cap.capture_floats, 1), dtype=bool)
        self.slots: dict[str, int] = {}
        self.slot_req: dict[int, "SlotState"] = {}
        self._free_slots = list(range(S - 1, -1, -1))
        self._suspended: dict[str, SlotState] = {}
        self.site_app_mask = np.zeros(self.n_sites, dtype=np.uint64)
        self._no_site = np.zeros(self.n_sites, dtype=bool)
        self.site_active = self._no_site  # this step
        self.any_active = False
        self._step_reads = False
        self._n_app_slots = 0
        self._all_mask = self._on_mask = self._read_mask = self._span_mask = 0
        self._map_ptrs = {k: self.host[k].ctypes.data for k in (
            "tok_slot", "tok_pos", "tok_flags", "tok_row", "row_slot", "row_tok_start",
            "row_n_tok", "row_reset", "row_n_prompt", "row_done")}
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
        self.graph_hook = None           # set by the CUDA-graph capture hook
        self._site_custom: dict[int, list[tuple[int, InstalledApp, LoweredOp]]] = {}
        if self.on_gpu:
            self._custom_select = torch.zeros(cap.max_tokens, dtype=torch.uint8, device=self.device)
            self._custom_out = torch.zeros(cap.max_tokens, dtype=torch.float32, device=self.device)
        self._write_header(n_tokens=0, n_rows=0)
        self._sync_all()

    # ------------------------------------------------------------------ staging (GPU)
    def _init_staging(self) -> None:
        """Per-step host data goes through a ring of pinned sets (xmix.staging), never through
        the host mirrors: a non-blocking copy reads its source when the stream reaches it, and
        vLLM queues the next step before the device has run this one."""
        cap, dev = self.cap, self.device
        T, S, P, R = cap.max_tokens, cap.max_slots, cap.max_params, cap.max_channels
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        self._param_stage = max(1, min(S * P, cap.staging_param_floats))
        spec = {n: (T, i32) for n in TOK_MAPS}
        spec.update({n: (S, i32) for n in ROW_MAPS})
        spec.update({"header": (2, i32), "dirty_idx": (S, i64), "dirty_apps": (S, i64),
                     "dirty_params": (self._param_stage, f32)})
        self._ring = PinnedRing(self.xfer, cap.staging_depth, spec)
        self._readback = PinnedRing(self.xfer, cap.staging_depth,
                                    {"results": (T * R, f32), "valid": (T * R, torch.uint8),
                                     "capture": (cap.capture_floats, f32),
                                     "gather_idx": (GATHER_ROWS * T, i64)},
                                    eager=False)
        self._gather_dev: dict[str, torch.Tensor] = {}  # made when a window first narrows a copy
        self._rows_dev = {"idx": torch.zeros(S, dtype=i64, device=dev),
                          "apps": torch.zeros(S, dtype=i64, device=dev),
                          "params": torch.zeros(self._param_stage, dtype=f32, device=dev)}
        off = CTRL_LAYOUT["n_tokens"]
        assert CTRL_LAYOUT["n_rows"] == off + 4 and off % 4 == 0
        self._step_header = self.block[off:off + 8].view(torch.int32)  # n_tokens, n_rows
        self._dirty: set[int] = set()
        self._step_set: PinnedSet | None = None
        self._begun = False
        self._readback_event = None
        self._pending_reads: deque[PendingReads] = deque()
        self._reads_lock = threading.Lock()

    def staging_stats(self) -> dict[str, int]:
        """Host waits for a staging or read-back set (more steps queued than sets) and
        blocking full copies of the slot rows; all zero in steady state."""
        if not self.staged:
            return {}
        return {"staging_waits": self._ring.waits, "readback_waits": self._readback.waits,
                "full_param_copies": self.stats["full_param_copies"]}

    def _mark_row(self, slot: int) -> None:
        if self.staged:
            self._dirty.add(slot)

    def _stage_step(self, s: PinnedSet, padded: int, n_req: int) -> None:
        """Queue one step's copies from its staging set, then the event that frees the set."""
        x = self.xfer
        if self._readback_event is not None:
            # This step's forward rewrites the results buffer: after the previous step's
            # results were copied out on the side stream (a device-side wait, no host wait).
            x.wait(self._readback_event)
            self._readback_event = None
        rt, rr = max(padded, 1), max(n_req, 1)
        for n in TOK_MAPS:
            x.copy(self.dev[n][:rt], s.t[n][:rt])
        for n in ROW_MAPS:
            x.copy(self.dev[n][:rr], s.t[n][:rr])
        if self._dirty:
            self._stage_rows(s)
        x.copy(self._step_header, s.t["header"])
        PinnedRing.hold(s, x.record())

    def _param_width(self) -> int:
        """Columns of a parameter row any deployed app uses (first fit keeps them low)."""
        return max((a.param_base + len(a.param_cols) for a in self.apps.values()), default=0)

    def _stage_rows(self, s: PinnedSet) -> None:
        """Slot rows changed since the last step (admission, release, set_params, deploy) go
        as (index, app mask, used parameter columns) and are scattered on the device in
        stream order, instead of all of slot_params every step."""
        x = self.xfer
        S, P = self.cap.max_slots, self.cap.max_params
        idx = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
        self._dirty.clear()
        n, W = len(idx), self._param_width()
        if n * W > self._param_stage:
            # More than a staging set holds (a burst of admissions with wide rows): the host
            # mirrors are current, one blocking copy of both buffers.
            self.stats["full_param_copies"] += 1
            for name in ROW_BUFFERS:
                x.copy(self.dev[name], self._host_t[name])
            x.synchronize()
            return
        s.np["dirty_idx"][:n] = idx
        s.np["dirty_apps"][:n] = self.host["slot_apps"][idx]
        d = self._rows_dev
        x.copy(d["idx"][:n], s.t["dirty_idx"][:n])
        x.copy(d["apps"][:n], s.t["dirty_apps"][:n])
        if W:
            s.np["dirty_params"][:n * W].reshape(n, W)[:] = self.host["slot_params"].reshape(S, P)[idx, :W]
            x.copy(d["params"][:n * W], s.t["dirty_params"][:n * W])

        def scatter() -> None:
            rows = d["idx"][:n]
            self.dev["slot_apps"].index_copy_(0, rows, d["apps"][:n])
            if W:
                self.dev["slot_params"].view(S, P)[:, :W].index_copy_(0, rows, d["params"][:n * W].view(n, W))

        x.launch(scatter)

    # ------------------------------------------------------------------ low level
    @property
    def ptr(self) -> int:
        return self.block.data_ptr()

    def _write_header(self, **fields) -> None:
        hb = self._block_host.numpy()
        values = {
            "max_tokens": self.cap.max_tokens, "max_slots": self.cap.max_slots,
            "max_apps": self.cap.max_apps, "n_params": self.cap.max_params,
            "n_channels": self.cap.max_channels, "n_sites": self.n_sites,
            "vec_state_width": self.vec_width, "vocab_words": self.vocab_words,
            "n_spans": int(np.flatnonzero(self._span_used).max() + 1) if self._span_used.any() else 0,
            "n_token_sets": int(np.flatnonzero(self._set_used).max() + 1) if self._set_used.any() else 0,
            "capture_size": self.cap.capture_floats,
        }
        for name, t in self.dev.items():
            values[name] = t.data_ptr()
        values.update(fields)
        for name, v in values.items():
            off = CTRL_LAYOUT[name]
            if name in _INT32_FIELDS:
                hb[off:off + 4] = np.frombuffer(np.int32(v).tobytes(), dtype=np.uint8)
            else:
                hb[off:off + 8] = np.frombuffer(np.int64(v).tobytes(), dtype=np.uint8)
        self._header_cache = values

    def _set_step_header(self, n_tokens: int, n_rows: int) -> None:
        hb = self._block_host.numpy()
        hb[CTRL_LAYOUT["n_tokens"]:CTRL_LAYOUT["n_tokens"] + 4] = np.frombuffer(np.int32(n_tokens).tobytes(), np.uint8)
        hb[CTRL_LAYOUT["n_rows"]:CTRL_LAYOUT["n_rows"] + 4] = np.frombuffer(np.int32(n_rows).tobytes(), np.uint8)

    def _sync(self, *names: str, rows: int | None = None) -> None:
        """Host -> device for the named buffers after a control change (no-op on CPU).

        Control changes are rare, so this waits for the copies (and the steps queued before
        them): a host mirror is never rewritten while a queued copy may still read it, and
        the change reaches the steps queued after it, never those before. Per-slot rows
        (slot_apps, slot_params) go with the next step as changed rows instead."""
        if not self.staged:
            return
        for n in names:
            if n in ROW_BUFFERS:
                if n == "slot_apps":  # e.g. remove() cleared an app's bit in every slot
                    self._dirty.update(self.slot_req)
                continue
            src, dst = self._host_t[n], self.dev[n]
            if rows is not None:
                src, dst = src[:rows], dst[:rows]
            self.xfer.copy(dst, src)
        self.xfer.synchronize()

    def _sync_block(self) -> None:
        if self.staged:
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
                raise DeployError(f"app {name!r} is already deployed; undeploy it first "
                                  f"or deploy under another name")
            if mode not in MODES:
                raise DeployError(f"app {name!r}: mode must be one of {list(MODES)}, got {mode!r}")
            taken = {a.index for a in self.apps.values()} | {s.inst.index for s in self._staged.values()}
            free_idx = [i for i in range(self.cap.max_apps) if i not in taken]
            if not free_idx:
                raise DeployError(f"app {name!r}: {self.cap.max_apps} apps are deployed already")
            claims: list[tuple[np.ndarray, slice]] = []
            try:
                inst = self._allocate(lowered, free_idx[0], mode, claims)
                inst.version = version
                inst.custom_fns = self._load_custom(lowered)
                tables = self._build_tables({**self.apps, name: inst})
            except Exception:
                _release(claims)
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
                _release(st.claims)
                raise DeployError(f"app {name!r}: the deployed apps changed since it was prepared")
            inst = st.inst
            self._seq += 1
            self._zero_counter(inst.index)
            self._swap({**self.apps, name: inst}, st.tables)
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
            _release(st.claims)
            return True

    def _take(self, used: np.ndarray, n: int, what: str, app: str, claims) -> int:
        """First fit of n contiguous free entries; recorded in claims for rollback."""
        if n == 0:
            return 0
        if n <= len(used):
            # window sums of the used flags: a window summing to 0 is free
            cs = np.concatenate(([0], np.cumsum(used, dtype=np.int64)))
            free = np.flatnonzero(cs[n:] - cs[:-n] == 0)
            if len(free):
                start = int(free[0])
                used[start:start + n] = True
                claims.append((used, slice(start, start + n)))
                return start
        raise DeployError(f"app {app!r}: not enough room for {what} ({n} needed); raise the "
                          f"xmix capacity or undeploy other apps")

    def _allocate(self, lw: LoweredApp, index: int, mode: str, claims) -> InstalledApp:
        name = lw.name
        # params: app params, then each op's params, then constants used by conditions
        cols = param_columns(lw)
        op_param_col: dict[int, int] = {}
        i = len(lw.app_params)
        for o in lw.ops:
            op_param_col[id(o)] = i
            i += len(o.params)
        consts = {c.default: k for k, c in enumerate(cols) if not c.public}
        base = self._take(self._param_used, len(cols), "parameters", name, claims)
        channels = {}
        for key, o in lw.reads.items():
            channels[key] = self._take(self._chan_used, o.n_channels, "result channels", name, claims)
        for alias, (key, i) in lw.aliases.items():  # one feature of an SAE features read
            channels[alias] = channels[key] + i
        sets = {}
        for s in lw.token_sets:
            sets[s] = self._take(self._set_used, 1, "token sets (16 in all)", name, claims)
        spans = {}
        for sp in lw.spans:
            spans[sp] = self._take(self._span_used, 1, "spans (8 in all)", name, claims)
        state, captures = {}, {}
        for o in lw.ops:
            if o.state_width:
                state[id(o)] = self._take(self._state_used, o.state_width, "per-request vector state", name, claims)
            if o.capture_width:
                captures[id(o)] = self._take(self._capture_used, o.capture_width * self.cap.max_tokens,
                                             "capture buffer (XMIX_CAPTURE_MB)", name, claims)
        inst = InstalledApp(lowered=lw, index=index, seq=self._seq, mode=mode, param_base=base,
                            param_cols=cols, channels=channels, token_sets=sets, spans=spans,
                            state=state, captures=captures)
        inst._op_param_col = op_param_col  # type: ignore[attr-defined]
        inst._consts = consts  # type: ignore[attr-defined]
        # One device copy per distinct artifact: ops sharing a tensor (an app whose ops name
        # one file key, a vector used on every layer) share its copy.
        copies: dict[tuple, torch.Tensor] = {}
        dev_artifacts: dict[tuple[int, str], torch.Tensor] = {}
        for o in lw.ops:
            for k, t in o.artifacts.items():
                key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
                if key not in copies:
                    inst.artifacts.append(t)
                    copies[key] = t.to(self.device, torch.float32).contiguous()
                dev_artifacts[(id(o), k)] = copies[key]
        inst._dev_artifacts = dev_artifacts  # type: ignore[attr-defined]
        return inst

    def _load_custom(self, lw: LoweredApp) -> dict[int, int]:
        fns: dict[int, int] = {}
        for o in lw.ops:
            if o.kernel != "custom":
                continue
            ck = o.custom
            if self.on_gpu:
                fns[id(o)] = _load_custom_cuda(lw.name, o, ck)
            else:
                if not ck.cpu_library or not ck.cpu_symbol:
                    raise DeployError(f"app {lw.name!r}, op {o.label}: a custom kernel on a CPU engine "
                                      f"needs cpu_library and cpu_symbol")
                try:
                    fns[id(o)] = _C.load_custom_cpu(str(ck.cpu_library), ck.cpu_symbol)
                except RuntimeError as e:
                    raise DeployError(f"app {lw.name!r}, op {o.label}: {e}") from None
        return fns

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
            for st in [*self.slot_req.values(), *self._suspended.values()]:
                st.apps.discard(name)
                st.overrides.pop(name, None)
            cols = len(inst.param_cols)
            self._param_used[inst.param_base:inst.param_base + cols] = False
            for key, c in inst.channels.items():
                n = inst.lowered.reads[key].n_channels if key in inst.lowered.reads else 1
                self._chan_used[c:c + n] = False
            for s in inst.token_sets.values():
                self._set_used[s] = False
            for s in inst.spans.values():
                self._span_used[s] = False
            for o in inst.lowered.ops:
                if id(o) in inst.state:
                    b = inst.state[id(o)]
                    self._state_used[b:b + o.state_width] = False
                if id(o) in inst.captures:
                    b = inst.captures[id(o)]
                    self._capture_used[b:b + o.capture_width * self.cap.max_tokens] = False
            self._sync("slot_apps")

    def set_mode(self, name: str, mode: str) -> None:
        self.patch(name, mode=mode)

    def set_params(self, name: str, params: dict[str, Any]) -> None:
        """Change an app's defaults; running requests that did not override a parameter see
        the new value from the next step."""
        self.patch(name, params=params)

    def patch(self, name: str, mode: str | None = None, params: dict[str, Any] | None = None) -> None:
        """Mode and/or default parameters of a deployed app, as one change: both are
        checked before either is applied."""
        with self.lock:
            if name not in self.apps:
                raise DeployError(f"app {name!r} is not deployed")
            if mode is not None and mode not in MODES:
                raise DeployError(f"mode must be one of {list(MODES)}, got {mode!r}")
            inst = self.apps[name]
            cols = self._resolve_params(inst, params, who=f"app {name!r}") if params is not None else {}
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

        self.xfer.launch(zero) if self.staged else zero()

    def nonfinite_writes(self) -> dict[str, int]:
        """Per deployed app: elements of the stream its writes would have made non-finite,
        left as they were (built-in kernels) or set to 0 (user kernels). On a GPU this reads
        the device (control-plane calls only, never per step)."""
        with self.lock:
            counts = self.dev["app_nonfinite"].cpu().numpy() if self.staged or self.on_gpu \
                else self.host["app_nonfinite"]
            return {inst.name: int(counts[inst.index]) for inst in self.apps.values()}

    def site_failed(self, site: int, failures) -> None:
        """Ops of a site program failed this step (``failures``: (app index, message), or
        app index None: the whole site). The requests of the step that used those apps are
        recorded for the worker to finish with an error; every other request is untouched."""
        with self.lock:
            by_index = {inst.index: inst for inst in self.apps.values()}
            slots = self.step_rows[0][:self.step_rows[1]].tolist() if getattr(self, "step_rows", None) else []
            for index, msg in failures:
                if isinstance(msg, bytes):
                    msg = msg.decode("utf-8", "replace")
                if index is None:
                    hit = [by_index[i] for i in by_index
                           if (int(self.site_app_mask[site]) >> i) & 1]
                else:
                    hit = [by_index[index]] if index in by_index else []
                if index is None:
                    self._clear_reads(hit)
                for inst in hit:
                    self.site_errors[inst.name] = self.site_errors.get(inst.name, 0) + 1
                    for slot in slots:
                        st = self.slot_req.get(slot)
                        if st is None or st.req_id in self.failed:
                            continue
                        uses = (inst.mode == "all" and not st.bit(inst)) or \
                            (inst.mode == "request" and inst.name in st.apps)
                        if uses:
                            self.failed[st.req_id] = (f"app {inst.name!r} failed in its site program "
                                                      f"at site {site}: {msg[:500]}")

    def _clear_reads(self, insts) -> None:
        """These apps report nothing this step: a site program that did not run leaves an
        earlier step's flags in their channels, which the drain would report for whichever
        request holds those rows now. Every request of the step that used them fails, so
        clearing all their channels drops nothing another request should get."""
        chans = sorted({ch for inst in insts for ch in inst.channels.values()})
        n_tok, R = getattr(self, "step_tokens", 0), self.cap.max_channels
        if chans and n_tok:
            self.dev["result_valid"][: n_tok * R].view(n_tok, R)[:, chans] = 0

    def take_failed(self) -> dict[str, str]:
        with self.lock:
            out, self.failed = self.failed, {}
            return out

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

    def _resolve_params(self, inst: InstalledApp, params: Any, who: str) -> dict[int, float]:
        return resolve_params(inst.param_cols, params, who)

    def _write_slot_params(self, slot: int, inst: InstalledApp) -> None:
        self._mark_row(slot)
        row = self.host["slot_params"][slot * self.cap.max_params:(slot + 1) * self.cap.max_params]
        overrides = self.slot_req[slot].overrides.get(inst.name, {}) if slot in self.slot_req else {}
        for i, c in enumerate(inst.param_cols):
            row[inst.param_base + i] = overrides.get(i, c.default)

    def _rebuild(self) -> None:
        """Rebuild the live tables from the deployed apps (a new op list goes live)."""
        with self.lock:
            self._swap(dict(self.apps), self._build_tables(self.apps))

    def _build_tables(self, apps: dict[str, InstalledApp]) -> "_Tables":
        """Site tables, op descriptors, condition code, token sets and spans for ``apps``,
        in arrays of their own; raises DeployError when they do not fit."""
        per_site: list[list[tuple[InstalledApp, LoweredOp]]] = [[] for _ in range(self.n_sites)]
        for inst in sorted(apps.values(), key=lambda a: a.seq):
            for o in inst.lowered.ops:
                per_site[o.site_id].append((inst, o))
        total = sum(len(lst) for lst in per_site)
        if total > self.cap.max_ops:
            raise DeployError(f"{total} ops would be deployed; the control block holds "
                              f"{self.cap.max_ops} (max_ops)")
        ops_bytes = np.zeros(total * OP_SIZE, dtype=np.uint8)
        codes: list[list[int]] = []
        n_ops = n_cond = 0
        first = np.zeros(self.n_sites, dtype=np.int32)
        count = np.zeros(self.n_sites, dtype=np.int32)
        site_app_mask = np.zeros(self.n_sites, dtype=np.uint64)
        site_custom: dict[int, list[tuple[int, InstalledApp, LoweredOp]]] = {}
        for s, lst in enumerate(per_site):
            first[s] = n_ops
            count[s] = len(lst)
            for inst, o in lst:
                k = C.n_instructions(o.cond) if o.cond is not None else 0
                if n_cond + k > self.cap.max_cond:
                    raise DeployError(f"{n_cond + k}+ condition instructions would be deployed; the "
                                      f"control block holds {self.cap.max_cond} (max_cond)")
                code = self._emit_cond(inst, o) if k else []
                codes.append(code)
                self._pack_op(ops_bytes, n_ops, inst, o, n_cond if code else -1, k)
                if o.kernel == "custom":
                    site_custom.setdefault(s, []).append((n_ops - int(first[s]), inst, o))
                n_cond += k
                n_ops += 1
                site_app_mask[s] |= np.uint64(1) << np.uint64(inst.index)
        cond = np.fromiter((x for c in codes for x in c), dtype=np.int32, count=4 * n_cond)
        bits = np.zeros(K["MAX_TOKEN_SETS"] * self.vocab_words, dtype=np.uint32)
        span_def = np.full(K["MAX_SPANS"] * 2, -1, dtype=np.int32)
        n_sets = n_spans = 0
        for inst in apps.values():
            for sname, g in inst.token_sets.items():
                ids = np.asarray(inst.lowered.token_sets[sname], dtype=np.int64)
                row = bits[g * self.vocab_words:(g + 1) * self.vocab_words]
                np.bitwise_or.at(row, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
                n_sets = max(n_sets, g + 1)
            for (a, b), g in inst.spans.items():
                span_def[2 * g] = inst.token_sets[a]
                span_def[2 * g + 1] = inst.token_sets[b]
                n_spans = max(n_spans, g + 1)
        return _Tables(ops_bytes, cond, first, count, bits, span_def, site_app_mask, per_site,
                       site_custom, n_ops, n_cond, n_sets, n_spans)

    def _swap(self, apps: dict[str, InstalledApp], t: "_Tables") -> None:
        """Make a new op list live. The only place the tables are written; every check
        happened before. Staged (GPU), ``_sync`` waits for its copies: the host mirrors are
        never rewritten while a queued copy may still read them."""
        h = self.host
        h["ops"][:t.n_ops * OP_SIZE] = t.ops
        h["cond_code"][:t.n_cond * 4] = t.cond
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
        self._sync("ops", "cond_code", "site_first", "site_count", "tokset_bits", "span_def", "app_mode")
        self._sync_block()
        self._refresh_masks()
        self.ops_generation += 1

    def _emit_cond(self, inst: InstalledApp, op: LoweredOp) -> list[int]:
        code: list[int] = []

        def param_col(value) -> int:
            if isinstance(value, float):
                return inst.param_base + inst._consts[value]  # type: ignore[attr-defined]
            for i, c in enumerate(inst.param_cols):
                if c.name == value and c.op is None:
                    return inst.param_base + i
            raise DeployError(f"app {inst.name!r}: unknown parameter {value!r}")

        def emit(n) -> None:
            if isinstance(n, C.Flag):
                if n.name == "all":
                    code.extend([K["C_TRUE"], 0, 0, 0])
                else:
                    code.extend([K["C_FLAG"], FLAG_BITS[n.name], 0, 0])
            elif isinstance(n, C.TokenIn):
                code.extend([K["C_FLAG"], K["TOKEN_SET_BIT0"] + inst.token_sets[n.set], 0, 0])
            elif isinstance(n, C.InSpan):
                code.extend([K["C_FLAG"], K["SPAN_BIT0"] + inst.spans[(n.open, n.close)], 0, 0])
            elif isinstance(n, C.Gate):
                code.extend([K["C_GATE"], inst.channels[n.read], CMP_CODES[n.cmp], param_col(n.value)])
            elif isinstance(n, C.Latch):
                red = K["RED_MEAN"] if n.reduce == "prompt_mean" else K["RED_LAST"]
                late = K["LATCH_FROM_GENERATED"] if latch_from_generated(inst.lowered, op, n) else 0
                code.extend([K["C_LATCH"], inst.channels[n.read],
                             CMP_CODES[n.cmp] | (red << 8) | late, param_col(n.value)])
            elif isinstance(n, C.Not):
                emit(n.a)
                code.extend([K["C_NOT"], 0, 0, 0])
            else:
                emit(n.a)
                emit(n.b)
                code.extend([K["C_AND"] if isinstance(n, C.And) else K["C_OR"], 0, 0, 0])

        emit(op.cond)
        return code

    def _pack_op(self, buf: np.ndarray, i: int, inst: InstalledApp, o: LoweredOp, cb: int, cl: int) -> None:
        rec = np.zeros(OP_SIZE, dtype=np.uint8)
        arts = inst._dev_artifacts  # type: ignore[attr-defined]
        vals = {
            "kind": K[KERNELS[o.kernel].code], "app": inst.index, "cond_begin": cb, "cond_len": cl,
            "param_base": inst.param_base + inst._op_param_col[id(o)],  # type: ignore[attr-defined]
            "channel": inst.channels.get(o.result_key, -1) if o.result_key else -1,
            "state_base": inst.state.get(id(o), -1), "n": o.n, "m": o.m, "flags": o.flags,
            "a0": arts[(id(o), "a0")].data_ptr() if (id(o), "a0") in arts else 0,
            "a1": arts[(id(o), "a1")].data_ptr() if (id(o), "a1") in arts else 0,
            "a2": arts[(id(o), "a2")].data_ptr() if (id(o), "a2") in arts else 0,
            "fn": inst.custom_fns.get(id(o), 0),
            "capture_offset": inst.captures.get(id(o), 0),
            "a3": arts[(id(o), "a3")].data_ptr() if (id(o), "a3") in arts else 0,
        }
        for name, v in vals.items():
            off = OP_LAYOUT[name]
            if name in _INT32_OP_FIELDS:
                rec[off:off + 4] = np.frombuffer(np.int32(v).tobytes(), np.uint8)
            else:
                rec[off:off + 8] = np.frombuffer(np.uint64(v).tobytes(), np.uint8)
        buf[i * OP_SIZE:(i + 1) * OP_SIZE] = rec

    def launch_custom_ops(self, site: int, h, r, n, d, sh, sr, dt, stream) -> None:
        """GPU: user kernels of a site, after its built-in ops (the anchor skips them)."""
        for k, inst, o in self._site_custom.get(site, ()):
            art = inst._dev_artifacts.get((id(o), "a0"))  # type: ignore[attr-defined]
            _C.launch_custom(self.ptr, site, k, inst.custom_fns[id(o)], h.data_ptr(),
                             r.data_ptr() if r is not None else 0, sh, sr, n, d, dt,
                             self.cap.max_params, self.dev["tok_slot"].data_ptr(),
                             self.dev["tok_pos"].data_ptr(), self.dev["slot_params"].data_ptr(),
                             inst.param_base + inst._op_param_col[id(o)],  # type: ignore[attr-defined]
                             art.data_ptr() if art is not None else 0,
                             int(art.numel()) if art is not None else 0,
                             self._custom_select.data_ptr(), self._custom_out.data_ptr(), stream)

    # ------------------------------------------------------------------ requests
    def admit(self, req_id: str, apps: list[str], params: dict[str, dict[str, Any]] | None = None,
              prompt_len: int = 0, results: ResultOptions | None = None) -> int:
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
                    raise RequestError(f"params for unknown app {a!r}; deployed: {sorted(self.apps)}")
                overrides[a] = self._resolve_params(self.apps[a], p, who=f"app {a!r}")
            st = SlotState(req_id=req_id, apps=set(apps), overrides=overrides, prompt_len=prompt_len,
                           options=results or DEFAULT_OPTIONS)
            return self._occupy(st)

    def admit_pinned(self, req_id: str, apps: list[str], pins: dict[str, Any],
                     prompt_len: int = 0, forced: list[str] | None = None,
                     results: ResultOptions | None = None) -> tuple[int, list[str]]:
        """Give a request a slot from the control the frontend checked and resolved: each
        app pinned to the deployment version it was checked against (``pins``: {app:
        [version, [[column, value], ...]]}), parameters as column values. An app that is
        gone, or deployed again under its name at another version, is left out: the request
        runs without it, as after an undeploy. Nothing a request carries raises here; the
        slot and the names of the apps left out are returned."""
        with self.lock:
            if req_id in self.slots:
                return self.slots[req_id], []

            def pinned(a: str):
                inst, pin = self.apps.get(a), pins.get(a)
                ok = (inst is not None and isinstance(pin, (list, tuple)) and len(pin) == 2
                      and pin[0] == inst.version)
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
                overrides[a] = {int(c): float(v) for c, v in pin[1]
                                if isinstance(c, int) and 0 <= c < n and isinstance(v, float)
                                and math.isfinite(v)}
            st = SlotState(req_id=req_id, apps={a for a in apps if a not in dropped},
                           overrides=overrides, prompt_len=prompt_len,
                           forced=frozenset(forced) if forced is not None else None,
                           options=results or DEFAULT_OPTIONS)
            return self._occupy(st), dropped

    def _occupy(self, st: "SlotState") -> int:
        if not self._free_slots:
            raise RequestError("no free xmix request slot (more running requests than max_num_seqs)")
        slot = self._free_slots.pop()
        self.slots[st.req_id] = slot
        self.slot_req[slot] = st
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
        return slot

    def suspend(self, req_id: str) -> None:
        """A preempted request gives its slot back and keeps its record (apps, parameters,
        what it has reported): slots never outnumber the running requests."""
        with self.lock:
            st = self.release(req_id)
            if st is not None:
                self._suspended[req_id] = st

    def resume(self, req_id: str) -> int | None:
        """The slot of a request coming back after preemption (it recomputes, so its state
        starts over), or None if it was never suspended."""
        with self.lock:
            st = self._suspended.pop(req_id, None)
            return None if st is None else self._occupy(st)

    def _reset_slot_state(self, slot: int) -> None:
        """A new request starts with empty latch sums, spans and CAST means, whatever the
        previous occupant of its slot left (the prologue also resets a request that restarts
        at position 0, e.g. after preemption)."""
        R, W = self.cap.max_channels, K["READ_STATE_WIDTH"]

        def reset() -> None:
            rs = self.dev["read_state"][slot * R * W:(slot + 1) * R * W].view(R, W)
            rs[:, :2] = 0.0
            rs[:, 2] = float("nan")
            self.dev["vec_state"][slot * self.vec_width:(slot + 1) * self.vec_width] = 0.0
            self.dev["slot_span"][slot] = 0

        # in stream order: steps still in flight may use the slot's previous occupant
        self.xfer.launch(reset) if self.staged else reset()

    def release(self, req_id: str) -> "SlotState | None":
        with self.lock:
            self._suspended.pop(req_id, None)
            slot = self.slots.pop(req_id, None)
            if slot is None:
                return None
            st = self.slot_req.pop(slot)
            self._n_app_slots -= int(self.host["slot_apps"][slot] != 0)
            self.host["slot_apps"][slot] = 0
            self._mark_row(slot)
            self._free_slots.append(slot)
            return st

    def effective_apps(self, slot: int) -> list[InstalledApp]:
        st = self.slot_req[slot]
        return [a for a in self.apps.values()
                if (a.mode == "all" and not st.bit(a)) or (a.mode == "request" and a.name in st.apps)]

    # ------------------------------------------------------------------ per step
    def begin_step(self, row_slots: np.ndarray, row_n_tok: np.ndarray, row_start_pos: np.ndarray,
                   row_prompt_len: np.ndarray, n_rows_padded: int | None = None) -> bool:
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
            self.site_active = self._no_site
            self.any_active = False
            self._step_reads = False
            return False
        slots = np.ascontiguousarray(row_slots, dtype=np.int32)
        n_tok_a = np.ascontiguousarray(row_n_tok, dtype=np.int64)
        start = np.ascontiguousarray(row_start_pos, dtype=np.int64)
        plen = np.ascontiguousarray(row_prompt_len, dtype=np.int64)
        n_tok = int(n_tok_a.sum())
        if n_tok > self.cap.max_tokens or n_req > self.cap.max_slots or (n_rows_padded or 0) > self.cap.max_tokens:
            raise RuntimeError(f"xmix: step of {max(n_tok, n_rows_padded or 0)} rows / {n_req} requests "
                               f"exceeds capacity ({self.cap.max_tokens} / {self.cap.max_slots})")
        padded = max(n_tok, n_rows_padded or 0)
        if self.staged:
            st = self._step_set = self._ring.next()
            _C.fill_step_maps(n_req, slots.ctypes.data, n_tok_a.ctypes.data, start.ctypes.data,
                              plen.ctypes.data, padded, st.ptrs)
            st.np["header"][:] = (n_tok, n_req)
            self._stage_step(st, padded, n_req)
            self._begun = True
        else:
            _C.fill_step_maps(n_req, slots.ctypes.data, n_tok_a.ctypes.data, start.ctypes.data,
                              plen.ctypes.data, padded, self._map_ptrs)
            self._set_step_header(n_tok, n_req)
            self._sync_block()
        self.site_active = (self.site_app_mask & np.uint64(active)) != 0
        self.step_rows = (slots, n_req)
        self.step_tokens = n_tok
        self.step_active = active
        self.any_active = bool(active)
        self._step_reads = bool(active & self._read_mask)
        return True

    def could_run(self) -> bool:
        """Whether any app could run in a step (cheap; before the step's maps are built)."""
        return bool(((self._all_mask | (self._on_mask if self._n_app_slots else 0)) & self._on_mask)
                    or self._span_mask)

    def _refresh_masks(self) -> None:
        """Bitmasks of apps by mode and kind, kept current on every control change so the
        per-step path is a few integer operations."""
        self._all_mask = self._on_mask = self._read_mask = self._span_mask = 0
        for inst in self.apps.values():
            bit = 1 << inst.index
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
        if self.staged:
            if self._begun:
                # On the device, after this step's forward and before anything queued later;
                # the host header is never rewritten while a copy of it may be queued.
                self.xfer.launch(self._step_header.zero_)
                self._begun = False
        elif self.any_active or self._span_mask:
            self._set_step_header(0, 0)
            self._sync_block()
        self.site_active = self._no_site
        self.any_active = False
        self._step_reads = False

    def prologue(self, input_ids: torch.Tensor) -> None:
        """Per-slot resets, token-set and span bits for this step (before the forward)."""
        if not self.apps:
            return
        ids = input_ids.reshape(-1)
        if self.on_gpu:
            _C.launch_prologue(self.ptr, ids.data_ptr(), ids.element_size(), self.cap.max_slots,
                               torch.cuda.current_stream(ids.device).cuda_stream)
        elif self.staged:
            ptr = self.ptr
            self.xfer.launch(lambda: _C.run_prologue_cpu(ptr, ids.data_ptr(), ids.element_size()))
        else:
            _C.run_prologue_cpu(self.ptr, ids.data_ptr(), ids.element_size())

    def _read_plan(self) -> list[tuple[str, str, int, tuple[int, int] | None, LoweredOp]]:
        """(app, read, channel, (capture offset, row width) or None, op) of this step's active
        reads; rows in the capture buffer are a capture read's vectors or a top-K SAE read's
        ids and activations."""
        plan = []
        for inst in self.apps.values():
            if not (self.step_active >> inst.index) & 1 or not inst.channels:
                continue
            for key, ch in inst.channels.items():
                if key not in inst.lowered.reads:
                    continue  # one feature of an SAE read, reported with the read
                op = inst.lowered.reads[key]
                if op.kernel == "capture":
                    cap = (inst.captures[id(op)], op.capture_width)
                elif op.kernel == "sae" and not op.features:
                    cap = (inst.captures[id(op)], 2 * op.top_k)
                else:
                    cap = None
                plan.append((inst.name, key, ch, cap, op))
        return plan

    def drain(self) -> dict[str, dict[str, dict[str, ReadResult]]]:
        """Read results of this step: {req_id: {app: {read: ReadResult}}} (arrays; each
        ReadResult reads as {positions, values} in the default shape), and a request's
        ``TRUNCATED_KEY`` marker in the step its byte cap was reached.

        Only rank 0 drains (hidden states are replicated across tensor-parallel ranks). Staged
        (GPU), this waits for the device; the engine path uses drain_async instead."""
        if not self._step_reads:
            return {}
        if self.staged:
            return self.drain_async().result()
        n_tok = self.step_tokens
        R, T = self.cap.max_channels, self.cap.max_tokens
        res = self.host["results"][: n_tok * R].reshape(n_tok, R)
        valid = self.host["result_valid"][: n_tok * R].reshape(n_tok, R)
        slots, _ = self.step_rows
        capture = self.host["capture"]

        def captured(cap, idx):
            base, w = cap
            return capture[base:base + T * w].reshape(-1, w)[idx]

        return self._collect(res, valid, self.host["tok_pos"][:n_tok], self.host["tok_row"][:n_tok],
                             lambda row: self.slot_req.get(int(slots[row])), self._read_plan(), captured)

    def drain_async(self) -> "PendingReads | None":
        """Staged: queue this step's results (and captured rows) to pinned host memory on a
        side stream; the host waits only when the returned handle's result() is asked for,
        which the worker does where vLLM resolves its own async output (get_output).

        A capture read's rows are copied whole unless the requests' windows (or requests
        without the app) leave some out: then only the rows that can be reported are gathered
        on the device first, and only those cross to the host."""
        if not self._step_reads or not self.staged:
            return None
        n_tok, R = self.step_tokens, self.cap.max_channels
        plan = self._read_plan()
        s = self._readback.next()
        st = self._step_set
        slots, n_req = self.step_rows
        states = [self.slot_req.get(int(x)) for x in slots[:n_req]]
        pos, rows = st.np["tok_pos"][:n_tok].copy(), st.np["tok_row"][:n_tok].copy()
        pairs = [(s.buf("results")[: n_tok * R], self.dev["results"][: n_tok * R]),
                 (s.buf("valid")[: n_tok * R], self.dev["result_valid"][: n_tok * R])]
        placed, off, used = [], 0, 0
        for app, key, ch, cap, op in plan:
            if cap is not None:
                base, w = cap
                src = self.dev["capture"][base:base + n_tok * w]
                take = self._rows_to_copy(app, pos, st, slots[:n_req], states)
                if take is None or used + len(take) > GATHER_ROWS * self.cap.max_tokens:
                    pairs.append((s.buf("capture")[off:off + n_tok * w], src))
                    cap = (off, w, None)
                    off += n_tok * w
                else:
                    k = len(take)
                    if k:
                        self._queue_gather(s, src.view(n_tok, w), take, used, off, w)
                        pairs.append((s.buf("capture")[off:off + k * w], self._gather_dev["rows"][off:off + k * w]))
                    rowmap = np.full(n_tok, -1, dtype=np.int64)
                    rowmap[take] = np.arange(k)
                    cap = (off, w, rowmap)
                    off += k * w
                    used += k
            placed.append((app, key, ch, cap, op))
        ev = self._readback_event = self.xfer.side_copy(pairs)
        p = PendingReads(self, ev, s, n_tok, pos, rows, states, placed)
        PinnedRing.hold(s, p)
        self._pending_reads.append(p)
        return p

    def _rows_to_copy(self, app: str, pos: np.ndarray, st: PinnedSet, slots: np.ndarray,
                      states: list) -> np.ndarray | None:
        """The tokens of this step whose capture rows a read of ``app`` can report (in the
        window of a request that uses the app), or None when that is every token."""
        inst = self.apps[app]
        n_tok = len(pos)
        mask = np.zeros(n_tok, dtype=bool)
        bit = np.int64(1) << np.int64(inst.index)
        starts, counts = st.np["row_tok_start"], st.np["row_n_tok"]
        for j, sst in enumerate(states):
            if sst is None or sst.truncated:
                continue
            if inst.mode != "all" and not (self.host["slot_apps"][slots[j]] & bit):
                continue
            t0, n = int(starts[j]), int(counts[j])
            win = sst.options.window
            mask[t0:t0 + n] = True if win is None else win.mask(pos[t0:t0 + n], sst.prompt_len)
        return None if mask.all() else np.flatnonzero(mask)

    def _queue_gather(self, s: PinnedSet, src: torch.Tensor, take: np.ndarray, used: int, off: int,
                      w: int) -> None:
        """Rows ``take`` of ``src`` into the device gather buffer at ``off``, in stream order
        (the indices go through the read-back set, which nothing rewrites before it resolves)."""
        if not self._gather_dev:
            self._gather_dev = {
                "rows": torch.empty(max(self.cap.capture_floats, 1), dtype=torch.float32, device=self.device),
                "idx": torch.empty(GATHER_ROWS * self.cap.max_tokens, dtype=torch.int64, device=self.device)}
        k = len(take)
        s.buf("gather_idx")
        s.np["gather_idx"][used:used + k] = take
        idx = self._gather_dev["idx"][used:used + k]
        dst = self._gather_dev["rows"][off:off + k * w].view(k, w)
        self.xfer.copy(idx, s.t["gather_idx"][used:used + k])
        self.xfer.launch(lambda: torch.index_select(src, 0, idx, out=dst))

    def _resolve_reads(self, p: "PendingReads") -> dict:
        """Steps resolve in order (a position a preempted request already reported is
        skipped by comparing with the last one reported), whichever thread asks."""
        with self._reads_lock:
            while p.out is None:
                head = self._pending_reads.popleft()
                head.event.synchronize()
                n, R = head.n_tok, self.cap.max_channels
                res = head.set.np["results"][: n * R].reshape(n, R)
                valid = head.set.np["valid"][: n * R].reshape(n, R)

                def captured(cap, idx, head=head, n=n):
                    off, w, rowmap = cap
                    buf = head.set.np["capture"]
                    if rowmap is None:
                        return buf[off:off + n * w].reshape(n, w)[idx]
                    k = int(rowmap.max()) + 1
                    return buf[off:off + k * w].reshape(k, w)[rowmap[idx]]

                head.out = self._collect(res, valid, head.pos, head.rows, head.states.__getitem__,
                                         head.plan, captured)
                head.set = None
            return p.out

    def _collect(self, res, valid, pos, rows, state_of_row, plan, captured) -> dict[str, dict]:
        """Per request, the hits of each planned read as arrays: ``res`` and ``valid`` the
        step's result channels and their flags, ``captured(cap, idx)`` the capture-buffer rows
        of the tokens idx (only those are copied). Each request's window and byte budget
        apply here, so nothing it does not report leaves the worker."""
        out: dict[str, dict] = {}
        for app, key, ch, cap, op in plan:
            idx = np.flatnonzero(valid[:, ch])
            if not len(idx):
                continue
            shape = read_shape(op)
            # tokens of one request are contiguous: split the hits at row changes
            r = rows[idx]
            cuts = np.flatnonzero(np.diff(r)) + 1
            bounds = [0, *cuts.tolist(), len(idx)]
            picks: list[tuple[SlotState, np.ndarray]] = []
            for j in range(len(bounds) - 1):
                st = state_of_row(int(r[bounds[j]]))
                if st is None:
                    continue
                sel = idx[bounds[j]:bounds[j + 1]]
                p = pos[sel]
                # A preempted request recomputes positions it already reported (with the
                # same values): report each position once.
                done = st.reported.get((app, key), -1)
                if p[0] <= done:
                    sel = sel[p > done]
                    if not len(sel):
                        continue
                st.reported[(app, key)] = int(pos[sel[-1]])
                sel = st.admit(sel, pos[sel], shape, app, out)
                if len(sel):
                    picks.append((st, sel))
            if not picks:
                continue
            if cap is not None and len(cap) == 3 and cap[2] is not None:
                picks = _copied_only(picks, cap[2], app, key)
            if not picks:
                continue
            every = np.concatenate([sel for _, sel in picks])
            values, ids = _gather(op, shape, res, ch, every, captured(cap, every) if cap is not None else None)
            at = 0
            for st, sel in picks:
                k = len(sel)
                rr = ReadResult.of(shape.kind, pos[sel], to_dtype(values[at:at + k], st.options.dtype),
                                   None if ids is None else ids[at:at + k], st.options.dtype, op.features)
                at += k
                out.setdefault(st.req_id, {}).setdefault(app, {})[key] = rr
        return out

    # ------------------------------------------------------------------ introspection
    def describe(self) -> list[dict[str, Any]]:
        out = []
        for inst in sorted(self.apps.values(), key=lambda a: a.seq):
            lw = inst.lowered
            out.append({
                "name": inst.name, "mode": inst.mode, "sites": lw.sites, "version": inst.version,
                "reads": sorted(lw.reads), "params": inst.defaults(),
                "writes": lw.writes, "stateful": lw.stateful,
                "metadata": lw.app.metadata,
            })
        return out


def _copied_only(picks, rowmap, app, key):
    out = []
    for st, sel in picks:
        ok = rowmap[sel] >= 0
        if not ok.all():  # a read ran where no request's window asked for it: a bug, said aloud
            logger.error("xmix: %d rows of read %s.%s for request %s were not copied to the host; "
                         "they are left out", int((~ok).sum()), app, key, st.req_id)
            sel = sel[ok]
        if len(sel):
            out.append((st, sel))
    return out


def _gather(op: LoweredOp, shape, res: np.ndarray, ch: int, idx: np.ndarray,
            rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(values, ids) of the tokens idx: a scalar read's channel, a capture read's rows, an SAE
    read's listed features (consecutive channels) or its top-K rows (ids, activations;
    unused places hold id -1)."""
    if shape.kind == "features":
        return res[idx, ch:ch + op.n_channels], None
    if shape.kind == "topk":
        K = op.top_k
        return rows[:, K:], rows[:, :K].astype(np.int32)
    if shape.kind == "vector":
        return rows, None
    return res[idx, ch], None


class PendingReads:
    """One step's reads on their way to the host (staged engines). Also what keeps its pinned
    read-back set busy: query() is whether it was resolved, synchronize() resolves it."""

    def __init__(self, cb: ControlBlock, event, pinned: PinnedSet, n_tok: int, pos: np.ndarray,
                 rows: np.ndarray, states: list, plan: list):
        self.cb, self.event, self.set, self.n_tok = cb, event, pinned, n_tok
        self.pos, self.rows, self.states, self.plan = pos, rows, states, plan
        self.out: dict | None = None

    def result(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self.out if self.out is not None else self.cb._resolve_reads(self)

    def query(self) -> bool:
        return self.out is not None

    def synchronize(self) -> None:
        self.result()


@dataclass
class SlotState:
    req_id: str
    apps: set[str]
    overrides: dict[str, dict[int, float]]
    prompt_len: int = 0
    reported: dict = field(default_factory=dict)  # (app, read) -> last position reported
    # Apps in mode "all" that may apply to this request (a server's per-key policy); None:
    # every one. An app in mode "all" not listed is opted out: its bit in slot_apps is set.
    forced: frozenset | None = None
    options: ResultOptions = DEFAULT_OPTIONS       # encoding, window, byte budget
    spent: int = 0                                 # result bytes accounted so far
    truncated: bool = False

    def bit(self, inst: "InstalledApp") -> bool:
        """This request's bit of an app in slot_apps: for mode "all" it opts the request
        out (control.h: app_active), otherwise it says the request uses the app."""
        if inst.mode == "all":  # named apps always apply
            return self.forced is not None and inst.name not in self.forced and inst.name not in self.apps
        return inst.name in self.apps

    def admit(self, sel: np.ndarray, pos: np.ndarray, shape, app: str, out: dict) -> np.ndarray:
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
            sel = sel[:max(fit, 0)]
            self.truncated = True
            out.setdefault(self.req_id, {})[TRUNCATED_KEY] = (
                f"truncated at {budget} bytes: this sequence's read results reached its cap "
                f"(max_result_bytes / XMIX_MAX_RESULT_BYTES); later results were dropped")
        self.spent += len(sel) * per
        return sel


def _load_custom_cuda(app: str, o: LoweredOp, ck) -> int:
    """Compile (nvcc) or read the user's fatbin and load it; returns the kernel handle."""
    if not ck.cuda_symbol:
        raise DeployError(f"app {app!r}, op {o.label}: a custom kernel on a GPU needs cuda_symbol")
    if ck.cuda_fatbin:
        image = Path(ck.cuda_fatbin).read_bytes()
    elif ck.cuda_source:
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            raise DeployError(f"app {app!r}, op {o.label}: cuda_source needs nvcc on PATH to compile")
        major, minor = torch.cuda.get_device_capability()
        from xmix import custom_include_dir

        inc = custom_include_dir()
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "kernel.cu"
            src.write_text(ck.cuda_source)
            out = Path(d) / "kernel.fatbin"
            cmd = [nvcc, "-fatbin", f"-arch=sm_{major}{minor}", "-I", str(inc), "-o", str(out), str(src)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise DeployError(f"app {app!r}, op {o.label}: nvcc failed:\n{r.stderr[-2000:]}")
            image = out.read_bytes()
    else:
        raise DeployError(f"app {app!r}, op {o.label}: a custom kernel on a GPU needs cuda_source or cuda_fatbin")
    try:
        return _C.load_custom_cuda(image, ck.cuda_symbol)
    except (RuntimeError, AttributeError) as e:
        raise DeployError(f"app {app!r}, op {o.label}: {e}") from None
