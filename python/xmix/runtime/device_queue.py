"""How the control block's host data reaches the device, and the device work that must stay in
stream order with it.

On a GPU the host only *queues* work: a ``copy_(non_blocking=True)`` from pinned memory reads
the host buffer when the stream gets to it, not when it is called, and vLLM keeps more than
one step in flight (async scheduling: ``vllm/v1/engine/core.py:EngineCore.step_with_batch_queue``
with ``vllm/config/vllm.py:VllmConfig.max_concurrent_batches`` = 2, or pp_size + 1 with model
runner V2). Everything the control block sends to the device therefore goes through a
``DeviceQueue``: the CUDA implementation is a thin layer over torch's current stream, and tests
substitute a fake that defers every queued operation the way a busy GPU does
(``tests/fake_device.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class DeviceQueue:
    """The stream the control block's device work is ordered on.

    ``copy``/``launch`` queue work; ``record`` marks the point reached so far; ``synchronize``
    makes the host wait for all of it. ``side_copy`` copies device data to the host on a side
    stream after the work queued so far, and ``wait`` makes later work on this stream wait for
    such a copy without the host waiting."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        raise NotImplementedError

    def launch(self, fn: Callable[[], Any]) -> None:
        raise NotImplementedError

    def record(self) -> Any:
        raise NotImplementedError

    def wait(self, event) -> None:
        raise NotImplementedError

    def side_copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class Streams:
    """The device's streams as a StreamQueue uses them: on a GPU torch.cuda's (CudaStreams);
    in tests a fake whose streams run late and in an order the test chooses
    (tests/fake_device.py), so that the ordering logic of StreamQueue itself is what runs."""

    def current(self) -> Any:
        """The stream of the thread that runs the model."""
        raise NotImplementedError

    def new_stream(self) -> Any:
        raise NotImplementedError

    def event(self) -> Any:
        """An event: record(stream), query(), synchronize()."""
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue a copy on ``stream`` (it reads src when the stream gets to it)."""
        raise NotImplementedError

    def launch(self, fn: Callable[[], Any], stream: Any) -> None:
        raise NotImplementedError

    def pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class StreamQueue(DeviceQueue):
    """The control block's device work on the model's stream, and result copies on one side
    stream, as vLLM's own ``v1/worker/gpu/async_utils.py:AsyncOutput`` does: which stream waits
    for which is decided here, whatever the streams are."""

    def __init__(self, streams: Streams):
        self.streams = streams
        self._side: Any = None

    def copy(self, dst, src) -> None:
        self.streams.copy(dst, src, self.streams.current())

    def launch(self, fn) -> None:
        self.streams.launch(fn, self.streams.current())

    def record(self):
        ev = self.streams.event()
        ev.record(self.streams.current())
        return ev

    def wait(self, event) -> None:
        self.streams.current().wait_event(event)

    def side_copy(self, pairs):
        main = self.streams.current()
        if self._side is None:
            self._side = self.streams.new_stream()
        side = self._side
        # the copies read what the work queued so far on the model's stream writes (the
        # step's forward): they may start only after it
        side.wait_stream(main)
        for dst, src in pairs:
            self.streams.copy(dst, src, side)
        ev = self.streams.event()
        ev.record(side)
        return ev

    def synchronize(self) -> None:
        self.streams.current().synchronize()

    def pinned(self, n, dtype) -> torch.Tensor:
        return self.streams.pinned(n, dtype)


class CudaStreams(Streams):
    """torch.cuda's: the current stream of the thread that runs the model (vLLM runs copies,
    prologue, forward or replay and sampling on one stream: ``v1/worker/gpu/model_runner.py:
    GPUModelRunner.main_stream`` is the current stream)."""

    def __init__(self, device: torch.device):
        self.device = device

    def current(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def event(self):
        # blocking=True: a host wait sleeps instead of spinning on the driver lock (as vLLM's
        # AsyncOutput.copy_event)
        return torch.cuda.Event(blocking=True)

    def copy(self, dst, src, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def launch(self, fn, stream) -> None:
        with torch.cuda.stream(stream):
            fn()  # CUDA work queues itself on the current stream

    def pinned(self, n, dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, pin_memory=True)


class CudaQueue(StreamQueue):
    """The StreamQueue of a GPU engine."""

    def __init__(self, device: torch.device):
        super().__init__(CudaStreams(device))
        self.device = device


class PinnedSet:
    """One set of pinned host buffers, allocated on first use of each name."""

    def __init__(self, queue: DeviceQueue, spec: dict[str, tuple[int, torch.dtype]]):
        self._queue = queue
        self._spec = spec
        self.t: dict[str, torch.Tensor] = {}
        self.np: dict[str, Any] = {}
        self.ptrs: dict[str, int] = {}
        self.busy = None  # what the device (or a consumer) still does with this set

    def buf(self, name: str) -> torch.Tensor:
        t = self.t.get(name)
        if t is None:
            n, dtype = self._spec[name]
            t = self.t[name] = self._queue.pinned(max(n, 1), dtype)
            self.np[name] = t.numpy()
            self.ptrs[name] = self.np[name].ctypes.data
        return t

    def alloc_all(self) -> PinnedSet:
        for name in self._spec:
            self.buf(name)
        return self


class PinnedRing:
    """Round-robin sets of pinned host buffers, as vLLM stages its own per-step inputs
    (``v1/worker/gpu/buffer_utils.py:UvaBufferPool``: depth >= the steps in flight). The pool
    leaves it to its callers to "retire a slot's GPU readers before reuse"; here each set keeps
    what still uses it (an event recorded after its copies, or a pending read-back) and the
    host waits on that before writing the set again. With depth above the steps vLLM keeps in
    flight the wait is already over when it is checked."""

    def __init__(
        self,
        queue: DeviceQueue,
        depth: int,
        spec: dict[str, tuple[int, torch.dtype]],
        eager: bool = True,
    ):
        if depth < 2:
            raise ValueError("a staging ring needs at least 2 sets")
        self.sets = [PinnedSet(queue, spec) for _ in range(depth)]
        if eager:
            for s in self.sets:
                s.alloc_all()
        self._i = -1
        self.waits = 0  # times the host had to wait for a set (more steps queued than sets)

    def next(self) -> PinnedSet:
        self._i = (self._i + 1) % len(self.sets)
        s = self.sets[self._i]
        if s.busy is not None:
            if not s.busy.query():
                self.waits += 1
                s.busy.synchronize()
            s.busy = None
        return s

    @staticmethod
    def hold(s: PinnedSet, busy) -> None:
        """``busy`` (anything with query() and synchronize()) keeps the set until it is done."""
        s.busy = busy
