"""The first-replay check (``XMIX_GRAPH_CHECK``; the package docstring says what it compares):
snapshots of the graph's memory pool and of the control block's stateful buffers, the two
replays, and putting a graph back as captured for good when they differ."""

from __future__ import annotations

import weakref
from typing import Any

from xmix import settings
from xmix.runtime.graphs.splice import exec_of, instantiate_captured
from xmix.runtime.graphs.state import G, check_enabled, count, logger, nvtx_range


class _Unverifiable(Exception):
    pass


class _TensorRegion:
    """A tensor the check snapshots, restores and compares: ``exact`` bit for bit, else as
    floats (NaN equal to NaN; atomics make latch sums and CAST means vary in rounding)."""

    def __init__(self, name: str, t, exact: bool):
        self.name, self.t, self.exact = name, t, exact
        self.nbytes = t.numel() * t.element_size()

    def save_into(self, buf) -> None:
        """Copy into ``buf`` (uint8, nbytes, preallocated: nothing is allocated here)."""
        buf.view(self.t.dtype).copy_(self.t.detach().reshape(-1))

    def load_from(self, buf) -> None:
        self.t.copy_(buf.view(self.t.dtype).view(self.t.shape))

    def view(self, buf):
        return buf.view(self.t.dtype)


class _RawRegion:
    """Device memory the check knows only by address (a segment of the graph's pool):
    compared bit for bit."""

    exact = True

    def __init__(self, name: str, addr: int, nbytes: int):
        self.name, self.addr, self.nbytes = name, addr, nbytes

    def save_into(self, buf) -> None:
        import torch

        G.copy_device(
            buf.data_ptr(), self.addr, self.nbytes, torch.cuda.current_stream().cuda_stream
        )

    def load_from(self, buf) -> None:
        import torch

        G.copy_device(
            self.addr, buf.data_ptr(), self.nbytes, torch.cuda.current_stream().cuda_stream
        )

    def view(self, buf):
        return buf


_CB_STATE = (
    ("results", False),
    ("result_valid", True),
    ("capture", False),
    ("read_state", False),
    ("vec_state", False),
    ("counters", True),
)


def _check_limit_bytes() -> int:
    return int(settings.get("XMIX_GRAPH_CHECK_MAX_MB") * 2**20)


def _check_graphs() -> int:
    """Graphs checked per control block and deploy (ops_generation): once that many passed,
    the others of the same deploy replay unchecked (``check_skipped``); a failure checks
    every graph of the deploy."""
    return int(settings.get("XMIX_GRAPH_CHECK_GRAPHS"))


def _pool_regions(g) -> list:
    """Every segment of the graph's memory pool: its outputs and intermediates, and the
    outputs of other graphs sharing the pool that it reads (vLLM's piecewise graphs). The
    whole pool, not only the graph's outputs: vLLM's piecewise graphs update their inputs in
    place (the fused add + RMSNorm on the residual), so a second replay from the same state
    needs everything the graph may read restored."""
    import torch

    pool = tuple(g.pool())
    regions = []
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", ())) == pool:
            regions.append(
                _RawRegion(
                    f"graph pool segment {seg['address']:#x} (+{seg['total_size']} B)",
                    int(seg["address"]),
                    int(seg["total_size"]),
                )
            )
    return regions


def _check_regions(g, cb) -> list:
    regions = [_TensorRegion(n, cb.dev[n], exact) for n, exact in _CB_STATE]
    for name, t, exact in (
        ("custom_select", cb.custom.select, True),
        ("custom_out", cb.custom.out, False),
    ):
        if t is not None:
            regions.append(_TensorRegion(name, t, exact))
    pool = _pool_regions(g)
    if not pool:
        # its outputs are somewhere the check cannot see, or restore
        raise _Unverifiable("no segment of its memory pool was found")
    total = sum(r.nbytes for r in regions + pool)
    if 3 * total > _check_limit_bytes():
        raise _Unverifiable(
            f"three snapshots of its memory pool and the control block's state "
            f"({3 * total / 2**20:.0f} MiB) exceed XMIX_GRAPH_CHECK_MAX_MB"
        )
    return regions + pool


class _Snapshots:
    """The check's device memory, allocated at once before any replay (an allocation that
    fails then leaves nothing half done): three sets of the regions (before, patched,
    anchors), one flat uint8 buffer each."""

    def __init__(self, regions: list, device):
        import torch

        self.regions = regions
        self.offsets = []
        off = 0
        for r in regions:  # 16-byte aligned, so every part can be viewed as its dtype
            self.offsets.append(off)
            off += (r.nbytes + 15) // 16 * 16
        self.sets = [torch.empty(off, dtype=torch.uint8, device=device) for _ in range(3)]

    def _parts(self, k: int):
        for r, off in zip(self.regions, self.offsets):
            yield r, self.sets[k][off : off + r.nbytes]

    def save(self, k: int) -> None:
        for r, buf in self._parts(k):
            r.save_into(buf)

    def load(self, k: int) -> None:
        for r, buf in self._parts(k):
            r.load_from(buf)

    def first_difference(self, a: int, b: int) -> str | None:
        """None when set a holds what set b holds (per region's rule), else the first
        difference. Compares the saved copies: nothing is allocated but small temporaries for
        the control block's float regions."""
        import torch

        for (r, x), (_, y) in zip(self._parts(a), self._parts(b)):
            if r.exact:
                if not torch.equal(x, y):
                    n = int((x != y).sum())
                    return f"{r.name}: {n} of {x.numel()} bytes differ"
                continue
            got, want = r.view(x), r.view(y)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-6, equal_nan=True):
                d = (got - want).abs().nan_to_num(nan=float("inf"))
                d[got.isnan() & want.isnan()] = 0
                i = int(d.argmax())
                return (
                    f"{r.name}: element {i} is {float(got[i])!r}, the anchors give "
                    f"{float(want[i])!r}"
                )
        return None


def _check_due(g, cb) -> bool:
    return (
        cb is not None
        and cb.ptr == g._xmix_cb
        and cb.step.any_active
        and bool(cb.step.active & g._xmix_check_apps)
    )


# Per control block: (ops_generation, checks passed, a check failed) of the current deploy.
_check_budget: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()


def _budget(cb) -> list:
    b = _check_budget.get(cb)
    if b is None or b[0] != cb.mem.ops_generation:
        b = _check_budget[cb] = [cb.mem.ops_generation, 0, False]
    return b


def replay(g, base_replay) -> None:
    """XmixCUDAGraph.replay: the first replay of a patched graph in a step that runs one of
    its spliced apps is the checked one, until enough graphs of the deploy have passed."""
    if g.__dict__.get("_xmix_check_due"):
        from xmix.runtime import ops

        cb = ops.get_control()
        if _check_due(g, cb):
            b = _budget(cb)
            if not check_enabled():
                g._xmix_check_due = False
            elif b[1] >= _check_graphs() and not b[2]:
                g._xmix_check_due = False
                count("check_skipped")
            else:
                _first_replay_check(g, cb, base_replay)
                return
    base_replay()


def _first_replay_check(g, cb, base_replay) -> None:
    """Replays the graph patched and then in its anchor configuration from the same state and
    serves the anchors' result; a difference puts the graph back as captured. All the check's
    device memory is allocated before the first replay, and a failure of the snapshot or of
    the patched replay still serves the anchors' replay: the check never fails a step that
    the graph without xmix would have served."""
    g._xmix_check_due = False
    count("checks")
    rec = g._xmix
    exec_ = exec_of(g)
    sync = _sync_fn(cb)
    budget = _budget(cb)

    def serve_anchors(restore: _Snapshots | None) -> None:
        if restore is not None:
            restore.load(0)
        rec.set_anchor_config(exec_, True)
        base_replay()
        sync()  # _refuse replaces the executable graph

    with nvtx_range("xmix.graph first-replay check"):
        try:
            snaps = _Snapshots(_check_regions(g, cb), cb.device)
            snaps.save(0)  # before
        except (_Unverifiable, RuntimeError) as e:  # RuntimeError: out of device memory
            budget[2] = True
            serve_anchors(None)
            _refuse(g, "check_unverifiable", f"the check could not snapshot the graph: {e}")
            return
        try:
            base_replay()  # patched
        except RuntimeError as e:
            budget[2] = True
            serve_anchors(snaps)
            _refuse(g, "check_failed", f"the patched graph's replay failed: {e}")
            return
        try:
            snaps.save(1)
        except RuntimeError as e:
            budget[2] = True
            serve_anchors(snaps)
            _refuse(g, "check_unverifiable", f"the check could not snapshot the replay: {e}")
            return
        serve_anchors(snaps)  # what is served; an error here is the captured graph's own
        snaps.save(2)
        diff = snaps.first_difference(1, 2)
        if diff is None:
            rec.set_anchor_config(exec_, False)
            budget[1] += 1
            count("check_passed")
            logger.debug("xmix: first-replay check passed (%d regions)", len(snaps.regions))
            return
        budget[2] = True
        snaps.load(0)
        base_replay()  # anchors again: is the graph deterministic?
        sync()
        snaps.save(1)
        noise = snaps.first_difference(1, 2)
        snaps.load(2)  # the served replay's state
        sync()
    if noise is not None:
        _refuse(
            g,
            "check_unverifiable",
            f"two replays with the anchors differ ({noise}): the "
            "graph is not deterministic, so its patched form cannot be checked",
        )
    else:
        _refuse(g, "check_failed", f"the patched graph differs from its anchors: {diff}")


def _sync_fn(cb):
    if not cb.on_gpu:
        return lambda: None
    import torch

    return torch.cuda.synchronize


def _refuse(g, key: str, reason: str) -> None:
    """Put a graph back as captured for good (re-plans leave it alone). The anchors' replay
    has run and been waited for, so the executable graph can be replaced now."""
    count(key)
    count("fallback")
    if g._xmix_state == "patched":
        count("patched", -1)
    g._xmix_refused = reason
    g._xmix_state = "fallback"
    rec = g._xmix
    rec.apply(G.fallback_plan(rec.read(), reason), 0)
    instantiate_captured(g, rec)
    logger.error("xmix: CUDA graph put back as captured (anchors kept from now on): %s", reason)
