"""GPU streams as the host sees them, on the CPU: the stand-in for ``xmix.runtime.device_queue.CudaStreams``
under the real ``xmix.runtime.device_queue.StreamQueue``.

What matters for the control block is when things happen, not where: on a GPU a
``copy_(non_blocking=True)`` from pinned memory and every kernel are only queued, and the copy
reads the host buffer when its stream reaches it. ``FakeDevice`` is a ``StreamQueue`` (the
class a GPU engine uses, so its decisions about which stream waits for which are the ones under
test) over fake streams: the model's stream and the side stream the results are copied out on,
each its own queue. An operation runs only when the test lets the device run (``run``) or the
host waits (``synchronize``, an event's ``synchronize``), and a stream that waits for an event
(``wait_event``, ``wait_stream``) runs nothing past the wait until the event has fired. Which
runnable stream goes first is the device's ``order``: "main" runs the model's stream as far as
it can before the side stream, "side" runs the side stream whenever it can; an ordering bug
between the read-back stream and the next forward shows under one of them. Copies snapshot
host memory when they execute. It counts the bytes each copy moves and every host wait, so
tests can prove what a step sends and that the step path never waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from xmix.runtime.device_queue import StreamQueue, Streams


class FakeEvent:
    def __init__(self, dev: FakeDevice):
        self.dev = dev
        self.done = False

    def record(self, stream: FakeStream) -> None:
        self.done = False
        stream.ops.append(("fire", self))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.dev.host_waits += 1
            while not self.done:
                if not self.dev.run(1):
                    raise RuntimeError("fake device: an event waited for can never fire")


class FakeStream:
    def __init__(self, dev: FakeDevice, name: str):
        self.dev, self.name = dev, name
        self.ops: deque = deque()  # ("run", fn) | ("fire", event) | ("wait", event)

    def wait_event(self, event: FakeEvent) -> None:
        self.ops.append(("wait", event))

    def wait_stream(self, other: FakeStream) -> None:
        ev = FakeEvent(self.dev)
        ev.record(other)
        self.wait_event(ev)

    def synchronize(self) -> None:
        if self.ops:
            self.dev.host_waits += 1
        while self.ops:
            if not self.dev.run(1):
                raise RuntimeError(f"fake device: the {self.name} stream can never finish")

    def runnable(self) -> bool:
        return bool(self.ops) and not (self.ops[0][0] == "wait" and not self.ops[0][1].done)

    def step(self) -> None:
        kind, what = self.ops.popleft()
        if kind == "run":
            what()
        elif kind == "fire":
            what.done = True


class FakeStreams(Streams):
    def __init__(self, dev: FakeDevice):
        self.dev = dev
        self.main = FakeStream(dev, "main")
        self.others: list[FakeStream] = []

    def current(self) -> FakeStream:
        return self.main

    def new_stream(self) -> FakeStream:
        s = FakeStream(self.dev, f"side{len(self.others)}")
        self.others.append(s)
        return s

    def event(self) -> FakeEvent:
        return FakeEvent(self.dev)

    def copy(self, dst, src, stream) -> None:
        n = dst.numel() * dst.element_size()
        if stream is self.main:
            self.dev.h2d_bytes += n
        else:
            self.dev.d2h_bytes += n
        stream.ops.append(("run", lambda: dst.copy_(src)))

    def launch(self, fn: Callable[[], Any], stream) -> None:
        stream.ops.append(("run", fn))

    def pinned(self, n, dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype)

    def all(self) -> list[FakeStream]:
        return [self.main, *self.others]


class FakeDevice(StreamQueue):
    def __init__(self, order: str = "main"):
        if order not in ("main", "side"):
            raise ValueError(f"order is 'main' or 'side', not {order!r}")
        self.order = order
        self.h2d_bytes = 0  # bytes queued by copy (host -> device in the control block)
        self.d2h_bytes = 0  # bytes queued by side_copy (results to the host)
        self.host_waits = 0  # times the host had to wait for queued work
        self.executed = 0
        self.fake = FakeStreams(self)
        super().__init__(self.fake)

    @property
    def queue(self) -> list:
        """Every operation queued and not run yet, on any stream."""
        return [op for s in self.fake.all() for op in s.ops]

    def synchronize(self) -> None:
        # the host waits for everything it queued (torch.cuda.synchronize on the worker)
        if self.queue:
            self.host_waits += 1
        self.run()
        if self.queue:
            raise RuntimeError(
                "fake device: queued work can never run (a wait on an event never recorded)"
            )

    # ---------------------------------------------------------------- test control
    def _next(self) -> FakeStream | None:
        streams = self.fake.all()
        if self.order == "side":
            streams = streams[1:] + streams[:1]
        for s in streams:
            if s.runnable():
                return s
        return None

    def run(self, n: int | None = None) -> int:
        """Execute up to n queued operations (all that can run when None) in the device's
        order; returns how many ran."""
        k = 0
        while n is None or k < n:
            s = self._next()
            if s is None:
                break
            s.step()
            k += 1
        self.executed += k
        return k

    def take_bytes(self) -> tuple[int, int]:
        out = (self.h2d_bytes, self.d2h_bytes)
        self.h2d_bytes = self.d2h_bytes = 0
        return out
