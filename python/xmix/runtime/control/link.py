"""Linking: after lowering, where an app's data goes in the control block, and the op list.

``link_app`` takes room for one app in the shared tables (``Arena``) and makes device copies
of its artifacts; the result, ``InstalledApp``, records for every op of ``lowered.ops`` (by its
position there, the stable op index) where its parameters, state, capture rows, artifacts and
user kernel are. ``build_tables`` then turns a set of installed apps into a complete op list:
per-site tables, packed ``OpDesc`` records, condition code, token-set bitmaps and spans, in
arrays of its own that the control block swaps in as one change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from xmix.lang import conditions as C
from xmix.lang.catalog import KERNELS
from xmix.lang.lowering import DeployError, LoweredApp, LoweredOp, latch_from_generated
from xmix.runtime.control.arena import Arena, Claims
from xmix.runtime.control.layout import CMP_CODES, FLAG_BITS, OP_DTYPE, OP_FIELDS, OP_SIZE, K
from xmix.runtime.control.params import ParamCol, op_param_offsets, param_columns

I32 = np.ndarray[Any, np.dtype[np.int32]]
U32 = np.ndarray[Any, np.dtype[np.uint32]]
U64 = np.ndarray[Any, np.dtype[np.uint64]]
Bytes = np.ndarray[Any, np.dtype[np.uint8]]


@dataclass
class LinkedOp:
    """Where one lowered op's data lives in the control block."""

    op: LoweredOp
    param_col: int  # its first parameter's column in a slot's row (absolute)
    state_base: int = -1  # per-slot vector state (cosine), -1: none
    capture_offset: int = -1  # capture buffer, in floats (capture and top-K SAE reads)
    artifacts: dict[str, torch.Tensor] = field(default_factory=dict)  # OpDesc a0..a3: device fp32
    fn: int = 0  # user kernel: CPU function pointer or CUDA kernel handle

    def artifact_ptr(self, slot: str) -> int:
        t = self.artifacts.get(slot)
        return t.data_ptr() if t is not None else 0


@dataclass
class InstalledApp:
    lowered: LoweredApp
    index: int  # bit in slot_apps
    seq: int  # deployment order
    mode: str
    param_base: int
    param_cols: list[ParamCol]
    channels: dict[str, int]  # read key -> channel
    token_sets: dict[str, int]  # set name -> global set index
    spans: dict[tuple[str, str], int]
    sinces: dict[str, int]  # since(...) text -> since index (slot_sticky column)
    linked: list[LinkedOp]  # by position in lowered.ops
    consts: dict[float, int]  # a condition's constant -> its column (relative)
    read_ops: dict[str, int]  # read key -> position in lowered.ops
    artifacts: list[torch.Tensor] = field(default_factory=list)  # host sources of the copies
    version: int = 0  # the frontend's deployment version: requests are pinned to it

    @property
    def name(self) -> str:
        return self.lowered.name

    def defaults(self) -> dict[str, float]:
        return {c.key: c.default for c in self.param_cols if c.public}

    def read(self, key: str) -> LinkedOp:
        return self.linked[self.read_ops[key]]


class SiteOp(NamedTuple):
    """One op of a site's program, in execution order."""

    inst: InstalledApp
    linked: LinkedOp

    @property
    def op(self) -> LoweredOp:
        return self.linked.op


@dataclass
class Tables:
    """A complete op list for a set of apps, built aside from the live control block."""

    ops: Bytes  # n_ops * OP_SIZE bytes
    cond: I32  # n_cond * 4 int32
    site_first: I32
    site_count: I32
    tokset_bits: U32  # the whole table
    span_def: I32
    site_app_mask: U64
    site_ops: list[list[SiteOp]]
    site_custom: dict[int, list[tuple[int, SiteOp]]]  # site -> (index in the site, op)
    n_ops: int
    n_cond: int
    n_sets: int
    n_spans: int


def link_app(
    lw: LoweredApp,
    index: int,
    seq: int,
    mode: str,
    arena: Arena,
    claims: Claims,
    device: torch.device,
    max_tokens: int,
) -> InstalledApp:
    """Room for ``lw`` in the shared tables (into ``claims``) and device copies of its
    artifacts; raises DeployError when something does not fit."""
    name = lw.name
    cols = param_columns(lw)
    consts = {c.default: k for k, c in enumerate(cols) if not c.public}
    base = arena.take("params", len(cols), "parameters", name, claims)
    channels: dict[str, int] = {}
    for key, o in lw.reads.items():
        channels[key] = arena.take("channels", o.n_channels, "result channels", name, claims)
    for alias, (key, i) in lw.aliases.items():  # one feature of an SAE features read
        channels[alias] = channels[key] + i
    sets = {
        s: arena.take("token_sets", 1, "token sets (16 in all)", name, claims)
        for s in lw.token_sets
    }
    spans = {sp: arena.take("spans", 1, "spans (8 in all)", name, claims) for sp in lw.spans}
    sinces = {
        text: arena.take("sinces", 1, f"since(...) terms ({K['MAX_STICKY']} in all)", name, claims)
        for text in lw.sinces
    }
    linked = [LinkedOp(o, base + off) for o, off in zip(lw.ops, op_param_offsets(lw))]
    for lo in linked:
        o = lo.op
        if o.state_width:
            lo.state_base = arena.take(
                "state", o.state_width, "per-request vector state", name, claims
            )
        if o.capture_width:
            lo.capture_offset = arena.take(
                "capture",
                o.capture_width * max_tokens,
                "capture buffer (XMIX_CAPTURE_MB)",
                name,
                claims,
            )
    # One device copy per distinct artifact: ops sharing a tensor (an app whose ops name one
    # file key, a vector used on every layer) share its copy.
    sources: list[torch.Tensor] = []
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    for lo in linked:
        for k, t in lo.op.artifacts.items():
            ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if ident not in copies:
                sources.append(t)
                copies[ident] = t.to(device, torch.float32).contiguous()
            lo.artifacts[k] = copies[ident]
    position = {id(o): k for k, o in enumerate(lw.ops)}  # identity, only while linking
    read_ops = {key: position[id(o)] for key, o in lw.reads.items()}
    return InstalledApp(
        lowered=lw,
        index=index,
        seq=seq,
        mode=mode,
        param_base=base,
        param_cols=cols,
        channels=channels,
        token_sets=sets,
        spans=spans,
        sinces=sinces,
        linked=linked,
        consts=consts,
        read_ops=read_ops,
        artifacts=sources,
    )


def unlink_app(inst: InstalledApp, arena: Arena, max_tokens: int) -> None:
    """Give an undeployed app's room back."""
    arena.free("params", inst.param_base, len(inst.param_cols))
    for key, c in inst.channels.items():
        if key in inst.lowered.reads:  # aliases share their read's channels
            arena.free("channels", c, inst.lowered.reads[key].n_channels)
    for s in inst.token_sets.values():
        arena.free("token_sets", s, 1)
    for s in inst.spans.values():
        arena.free("spans", s, 1)
    for s in inst.sinces.values():
        arena.free("sinces", s, 1)
    for lo in inst.linked:
        if lo.state_base >= 0:
            arena.free("state", lo.state_base, lo.op.state_width)
        if lo.capture_offset >= 0:
            arena.free("capture", lo.capture_offset, lo.op.capture_width * max_tokens)


def build_tables(
    apps: dict[str, InstalledApp], n_sites: int, max_ops: int, max_cond: int, vocab_words: int
) -> Tables:
    """Site tables, op descriptors, condition code, token sets and spans for ``apps``, in
    arrays of their own; raises DeployError when they do not fit."""
    per_site: list[list[SiteOp]] = [[] for _ in range(n_sites)]
    for inst in sorted(apps.values(), key=lambda a: a.seq):
        for lo in inst.linked:
            per_site[lo.op.site_id].append(SiteOp(inst, lo))
    total = sum(len(lst) for lst in per_site)
    if total > max_ops:
        raise DeployError(
            f"{total} ops would be deployed; the control block holds {max_ops} (max_ops)"
        )
    recs = np.zeros(total, dtype=OP_DTYPE)
    codes: list[list[int]] = []
    n_ops = n_cond = 0
    first = np.zeros(n_sites, dtype=np.int32)
    count = np.zeros(n_sites, dtype=np.int32)
    site_app_mask = np.zeros(n_sites, dtype=np.uint64)
    site_custom: dict[int, list[tuple[int, SiteOp]]] = {}
    for s, lst in enumerate(per_site):
        first[s] = n_ops
        count[s] = len(lst)
        for so in lst:
            o = so.op
            k = C.n_instructions(o.cond) if o.cond is not None else 0
            if n_cond + k > max_cond:
                raise DeployError(
                    f"{n_cond + k}+ condition instructions would be deployed; the "
                    f"control block holds {max_cond} (max_cond)"
                )
            code = emit_cond(so.inst, o) if k else []
            codes.append(code)
            recs[n_ops] = op_record(so.inst, so.linked, n_cond if code else -1, k)
            if o.kernel == "custom":
                site_custom.setdefault(s, []).append((n_ops - int(first[s]), so))
            n_cond += k
            n_ops += 1
            site_app_mask[s] |= np.uint64(1) << np.uint64(so.inst.index)
    cond = np.fromiter((x for c in codes for x in c), dtype=np.int32, count=4 * n_cond)
    bits = np.zeros(K["MAX_TOKEN_SETS"] * vocab_words, dtype=np.uint32)
    span_def = np.full(K["MAX_SPANS"] * 2, -1, dtype=np.int32)
    n_sets = n_spans = 0
    for inst in apps.values():
        for sname, g in inst.token_sets.items():
            ids = np.asarray(inst.lowered.token_sets[sname], dtype=np.int64)
            row = bits[g * vocab_words : (g + 1) * vocab_words]
            np.bitwise_or.at(row, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
            n_sets = max(n_sets, g + 1)
        for (a, b), g in inst.spans.items():
            span_def[2 * g] = inst.token_sets[a]
            span_def[2 * g + 1] = inst.token_sets[b]
            n_spans = max(n_spans, g + 1)
    ops_bytes: Bytes = recs.view(np.uint8).reshape(-1)
    assert len(ops_bytes) == total * OP_SIZE
    return Tables(
        ops_bytes,
        cond,
        first,
        count,
        bits,
        span_def,
        site_app_mask,
        per_site,
        site_custom,
        n_ops,
        n_cond,
        n_sets,
        n_spans,
    )


def op_record(inst: InstalledApp, lo: LinkedOp, cond_begin: int, cond_len: int) -> tuple[int, ...]:
    """One OpDesc, as a record of OP_DTYPE (fields in control.h's order)."""
    o = lo.op
    vals = {
        "kind": K[KERNELS[o.kernel].code],
        "app": inst.index,
        "cond_begin": cond_begin,
        "cond_len": cond_len,
        "param_base": lo.param_col,
        "channel": inst.channels.get(o.result_key, -1) if o.result_key else -1,
        "state_base": lo.state_base,
        "n": _op_n(inst, o),
        "m": o.m,
        "flags": o.flags,
        "a0": lo.artifact_ptr("a0"),
        "a1": lo.artifact_ptr("a1"),
        "a2": lo.artifact_ptr("a2"),
        "fn": lo.fn,
        "capture_offset": max(lo.capture_offset, 0),
        "a3": lo.artifact_ptr("a3"),
    }
    return tuple(vals[n] for n, _ in OP_FIELDS)


def _op_n(inst: InstalledApp, o: LoweredOp) -> int:
    """OpDesc.n: a since term's index for its OP_SINCE, the channel of the read a stop reports
    (-1: none) for OP_STOP, the lowered value for every other kind."""
    if o.kernel == "since":
        assert o.sticky is not None
        return inst.sinces[o.sticky]
    if o.kernel == "stop":
        return inst.channels.get(o.monitor_read, -1) if o.monitor_read else -1
    return o.n


def emit_cond(inst: InstalledApp, op: LoweredOp) -> list[int]:
    """The postfix condition program of ``op`` (4 int32 words per instruction)."""
    code: list[int] = []

    def param_col(value: Any) -> int:
        if isinstance(value, float):
            return inst.param_base + inst.consts[value]
        for i, c in enumerate(inst.param_cols):
            if c.name == value and c.op is None:
                return inst.param_base + i
        raise DeployError(f"app {inst.name!r}: unknown parameter {value!r}")

    def emit(n: Any) -> None:
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
            code.extend(
                [
                    K["C_LATCH"],
                    inst.channels[n.read],
                    CMP_CODES[n.cmp] | (red << 8) | late,
                    param_col(n.value),
                ]
            )
        elif isinstance(n, C.Since):
            code.extend([K["C_SINCE"], inst.sinces[C.to_text(n)], 0, 0])
        elif isinstance(n, C.Not):
            emit(n.a)
            code.extend([K["C_NOT"], 0, 0, 0])
        else:
            emit(n.a)
            emit(n.b)
            code.extend([K["C_AND"] if isinstance(n, C.And) else K["C_OR"], 0, 0, 0])

    emit(op.cond)
    return code
