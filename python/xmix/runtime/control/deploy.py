"""Deploying, changing and undeploying apps on the control block: each a transaction.

Every check, allocation and the complete new op list (site tables, op descriptors, condition
code, token sets, spans) is built aside; only then is it swapped in (``Deployer._swap``),
between two steps. A refusal leaves the live control block untouched: no step ever runs on a
half-written table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from xmix.lang.lowering import DeployError, LoweredApp
from xmix.runtime.control.arena import Claims
from xmix.runtime.control.custom import load_custom
from xmix.runtime.control.layout import MODES, K
from xmix.runtime.control.link import InstalledApp, Tables, build_tables, link_app, unlink_app
from xmix.runtime.control.params import resolve_params

if TYPE_CHECKING:
    from xmix.runtime.control.memory import BlockMemory
    from xmix.runtime.control.slots import Slots


@dataclass
class _Staged:
    """A deploy that passed every check, waiting for its commit."""

    inst: InstalledApp
    tables: Tables
    claims: Claims
    generation: int  # the ops_generation it was built against


class Deployer:
    def __init__(self, mem: BlockMemory, slots: Slots):
        self.mem = mem
        self.slots = slots
        self.staged: dict[str, _Staged] = {}
        self._seq = 0

    def install(self, lowered: LoweredApp, mode: str = "request", version: int = 0) -> InstalledApp:
        """Place a lowered app (prepare, then commit); nothing changes when this raises."""
        with self.mem.lock:
            self.prepare_install(lowered, mode, version)
            return self.commit_install(lowered.name)

    def prepare_install(self, lowered: LoweredApp, mode: str = "request", version: int = 0) -> None:
        """Every check of a deploy and the new tables, built aside; the live state is not
        touched. ``commit_install`` makes it live, ``abort_install`` drops it."""
        mem = self.mem
        with mem.lock:
            name = lowered.name
            self.abort_install(name)
            if name in mem.apps:
                raise DeployError(
                    f"app {name!r} is already deployed; undeploy it first "
                    f"or deploy under another name"
                )
            if mode not in MODES:
                raise DeployError(f"app {name!r}: mode must be one of {list(MODES)}, got {mode!r}")
            taken = {a.index for a in mem.apps.values()} | {
                s.inst.index for s in self.staged.values()
            }
            free_idx = [i for i in range(mem.cap.max_apps) if i not in taken]
            if not free_idx:
                raise DeployError(f"app {name!r}: {mem.cap.max_apps} apps are deployed already")
            claims = Claims()
            try:
                inst = link_app(
                    lowered,
                    free_idx[0],
                    self._seq,
                    mode,
                    mem.arena,
                    claims,
                    mem.device,
                    mem.cap.max_tokens,
                )
                inst.version = version
                for k, fn in load_custom(lowered, mem.on_gpu).items():
                    inst.linked[k].fn = fn
                tables = self._build_tables({**mem.apps, name: inst})
            except Exception:
                claims.release()
                raise
            self.staged[name] = _Staged(inst, tables, claims, mem.ops_generation)

    def commit_install(self, name: str) -> InstalledApp:
        """Swap a prepared app in. Refused (and dropped) if the deployed apps changed since
        it was prepared; the frontend serialises control changes, so that is a bug there."""
        mem, slots = self.mem, self.slots
        with mem.lock:
            st = self.staged.pop(name, None)
            if st is None:
                raise DeployError(f"app {name!r}: nothing prepared to commit")
            if st.generation != mem.ops_generation or name in mem.apps:
                st.claims.release()
                raise DeployError(f"app {name!r}: the deployed apps changed since it was prepared")
            inst = st.inst
            self._seq += 1
            self._zero_counter(inst.index)
            self._swap({**mem.apps, name: inst}, st.tables)
            if inst.sinces:  # an undeployed app's since terms may have held in these columns
                slots.clear_sinces(list(inst.sinces.values()))
            slots.rewrite_bits(inst)  # requests running opted out of it (mode "all")
            # Requests already running see the app's defaults in their param rows.
            for slot in slots.slot_req:
                slots.write_params(slot, inst)
            mem.sync("slot_params")
            return inst

    def abort_install(self, name: str) -> bool:
        """Drop a prepared app (its allocations return to the free lists)."""
        with self.mem.lock:
            st = self.staged.pop(name, None)
            if st is None:
                return False
            st.claims.release()
            return True

    def remove(self, name: str) -> None:
        mem = self.mem
        with mem.lock:
            inst = mem.apps.get(name)
            if inst is None:
                raise DeployError(f"app {name!r} is not deployed")
            rest = {k: v for k, v in mem.apps.items() if k != name}
            self._swap(rest, self._build_tables(rest))  # fewer ops: cannot overflow
            self.slots.forget(inst)
            unlink_app(inst, mem.arena, mem.cap.max_tokens)
            mem.sync("slot_apps", running=self.slots.slot_req)

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
        mem, slots = self.mem, self.slots
        with mem.lock:
            if name not in mem.apps:
                raise DeployError(f"app {name!r} is not deployed")
            if mode is not None and mode not in MODES:
                raise DeployError(f"mode must be one of {list(MODES)}, got {mode!r}")
            inst = mem.apps[name]
            cols = (
                resolve_params(inst.param_cols, params, who=f"app {name!r}")
                if params is not None
                else {}
            )
            if cols:
                for col, v in cols.items():
                    inst.param_cols[col].default = v
                for slot in slots.slot_req:
                    slots.write_params(slot, inst)
                mem.sync("slot_params")
            if mode is not None:
                inst.mode = mode
                mem.host["app_mode"][inst.index] = MODES[mode]
                mem.sync("app_mode")
                slots.rewrite_bits(inst)
                mem.refresh_masks()

    def _zero_counter(self, index: int) -> None:
        dev = self.mem.dev

        def zero() -> None:
            dev["app_nonfinite"][index] = 0

        self.mem.launch(zero)

    def _build_tables(self, apps: dict[str, InstalledApp]) -> Tables:
        mem = self.mem
        return build_tables(apps, mem.n_sites, mem.cap.max_ops, mem.cap.max_cond, mem.vocab_words)

    def _swap(self, apps: dict[str, InstalledApp], t: Tables) -> None:
        """Make a new op list live. The only place the tables are written; every check
        happened before. Staged (GPU), ``sync`` waits for its copies: the host mirrors are
        never rewritten while a queued copy may still read them."""
        mem = self.mem
        h = mem.host
        h["ops"][: len(t.ops)] = t.ops
        h["cond_code"][: t.n_cond * 4] = t.cond
        h["site_first"][:] = t.site_first
        h["site_count"][:] = t.site_count
        h["tokset_bits"].view(np.uint32)[:] = t.tokset_bits
        h["span_def"][:] = t.span_def
        h["app_mode"][:] = K["MODE_OFF"]
        for inst in apps.values():
            h["app_mode"][inst.index] = MODES[inst.mode]
        mem.apps.clear()
        mem.apps.update(apps)
        mem.site_app_mask[:] = t.site_app_mask
        mem.site_ops = t.site_ops
        mem.site_custom = t.site_custom
        mem.n_ops, mem.n_cond = t.n_ops, t.n_cond
        mem.write_header(n_token_sets=t.n_sets, n_spans=t.n_spans)
        mem.sync(
            "ops", "cond_code", "site_first", "site_count", "tokset_bits", "span_def", "app_mode"
        )
        mem.sync_block()
        mem.refresh_masks()
        mem.ops_generation += 1

    def describe(self) -> list[dict[str, Any]]:
        """The deployed apps, in deploy order (the control plane's listing)."""
        out = []
        for inst in sorted(self.mem.apps.values(), key=lambda a: a.seq):
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
