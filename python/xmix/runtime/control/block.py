"""ControlBlock: the control block of one engine, composed from its parts.

Each part does one job and shares state only through the block's memory (``BlockMemory``:
the buffers and the live tables). None holds the block, and each holds only parts built
before it (an arrow: "is given"):

    mem ─► slots ─► deploy
            └─────► step ─► sites ─► reads
    mem ─► custom

- ``mem``: buffers, header, host -> device sync, deployed apps and their tables (memory.py)
- ``deploy``: install (prepare/commit/abort), patch, remove, describe (deploy.py)
- ``slots``: admit, preempt, resume and release requests (slots.py)
- ``step``: the step's maps, prologue and empty step (step.py)
- ``sites``: what site programs report: failures, seconds, non-finite writes (site_state.py)
- ``reads``: the step's results to per-request results (drain.py)
- ``custom``: GPU launches of user kernels (custom.py)

The operations most callers use (a test, a bench, the worker's step) are also attributes of
the block: the parts' bound methods themselves (``cb.install`` is ``cb.deploy.install``,
bound once), so the per-step path costs no call more than the part's own method. Everything
else is called on its part (``cb.slots.admit_pinned``, ``cb.deploy.prepare_install``,
``cb.sites.collect``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from xmix.lang.sites import ModelShape
from xmix.runtime.control.custom import CustomOps
from xmix.runtime.control.deploy import Deployer
from xmix.runtime.control.drain import Drain
from xmix.runtime.control.layout import Capacity
from xmix.runtime.control.memory import BlockMemory
from xmix.runtime.control.site_state import SiteReports
from xmix.runtime.control.slots import Slots
from xmix.runtime.control.step import Step
from xmix.runtime.device_queue import DeviceQueue


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


class ControlBlock:
    def __init__(
        self,
        shape: ModelShape,
        device: torch.device | str = "cpu",
        capacity: Capacity | None = None,
        queue: DeviceQueue | None = None,
    ):
        self.mem = mem = BlockMemory(shape, device, capacity, queue)
        self.slots = Slots(mem)
        self.deploy = Deployer(mem, self.slots)
        self.step = Step(mem, self.slots)
        self.sites = SiteReports(mem, self.slots, self.step)
        self.reads = Drain(mem, self.slots, self.step, self.sites)
        self.custom = CustomOps(mem)
        self.graph_hook: GraphHook | None = None  # set by the CUDA-graph capture hook

        # What the block is, for every caller (fixed for its life: none is ever rebound)
        self.shape, self.device, self.cap = mem.shape, mem.device, mem.cap
        self.n_sites, self.on_gpu, self.staged = mem.n_sites, mem.on_gpu, mem.staged
        self.lock, self.block, self.ptr = mem.lock, mem.block, mem.ptr
        self.dev, self.host = mem.dev, mem.host
        self.apps = mem.apps  # the deployed apps by name (rewritten in place by a swap)

        # The common operations: the parts' bound methods (no forwarding layer)
        self.install = self.deploy.install
        self.remove = self.deploy.remove
        self.patch = self.deploy.patch
        self.set_mode = self.deploy.set_mode
        self.set_params = self.deploy.set_params
        self.admit = self.slots.admit
        self.release = self.slots.release
        self.begin_step = self.step.begin
        self.prologue = self.step.prologue
        self.end_step = self.step.end
        self.drain = self.reads.drain
        self.take_failed = self.sites.take_failed
