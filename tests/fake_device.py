"""A GPU stream as the host sees it, on the CPU: the stand-in for ``xmix.staging.CudaQueue``.

What matters for the control block is when things happen, not where: on a GPU a
``copy_(non_blocking=True)`` from pinned memory and every kernel are only queued, and the copy
reads the host buffer when the stream reaches it. ``FakeDevice`` queues every copy and launch
and runs them in order only when told to (``run``) or when the host waits (``synchronize``,
an event's ``synchronize``), so a copy snapshots host memory at the moment it "executes" and a
test decides how far behind the host the device is. It counts the bytes each copy moves and
every host wait, so tests can prove what a step sends and that the step path never waits.
"""

from __future__ import annotations

from collections import deque

import torch

from xmix.staging import DeviceQueue


class FakeEvent:
    def __init__(self, dev: FakeDevice):
        self.dev = dev
        self.done = False

    def _fire(self) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.dev.host_waits += 1
            while not self.done:
                self.dev.run(1)


class FakeDevice(DeviceQueue):
    def __init__(self):
        self.queue: deque = deque()
        self.h2d_bytes = 0  # bytes queued by copy (host -> device in the control block)
        self.d2h_bytes = 0  # bytes queued by side_copy (results to the host)
        self.host_waits = 0  # times the host had to wait for queued work
        self.executed = 0

    # ---------------------------------------------------------------- DeviceQueue
    def copy(self, dst, src) -> None:
        self.h2d_bytes += dst.numel() * dst.element_size()
        self.queue.append(lambda: dst.copy_(src))

    def launch(self, fn) -> None:
        self.queue.append(fn)

    def record(self) -> FakeEvent:
        ev = FakeEvent(self)
        self.queue.append(ev._fire)
        return ev

    def wait(self, event) -> None:
        pass  # one in-order queue: later work runs after the event anyway

    def side_copy(self, pairs) -> FakeEvent:
        for dst, src in pairs:
            self.d2h_bytes += dst.numel() * dst.element_size()
            self.queue.append(lambda dst=dst, src=src: dst.copy_(src))
        return self.record()

    def synchronize(self) -> None:
        if self.queue:
            self.host_waits += 1
        self.run()

    def pinned(self, n, dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype)

    # ---------------------------------------------------------------- test control
    def run(self, n: int | None = None) -> int:
        """Execute the next n queued operations (all when None); returns how many ran."""
        k = 0
        while self.queue and (n is None or k < n):
            self.queue.popleft()()
            k += 1
        self.executed += k
        return k

    def take_bytes(self) -> tuple[int, int]:
        out = (self.h2d_bytes, self.d2h_bytes)
        self.h2d_bytes = self.d2h_bytes = 0
        return out
