"""The worker's per-step host path on a CPU engine (issue 29, item 2): before the forward one
native call (``_C.HostStep``: request ids to slots, restart check, which apps run, step maps,
header, active sites, monitors' extents, prologue), after it one more (the empty step). The
expected maps, extents and floors are worked out by hand from the rules in control.h and
step.py; the Python ``Step.begin``/``prologue`` must not run at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xmix
from xmix.integrations.vllm.worker.worker import WorkerXmix
from xmix.lang.lowering import lower
from xmix.lang.sites import ModelShape, site_id
from xmix.runtime.control import Capacity, ControlBlock
from xmix.runtime.control.layout import CTRL_LAYOUT
from xmix.runtime.control.step import Step

SHAPE = ModelShape(n_layers=2, hidden_size=8, vocab_size=64)


def _block() -> tuple[ControlBlock, WorkerXmix]:
    cb = ControlBlock(SHAPE, "cpu", Capacity(max_tokens=16, max_slots=4))
    app = xmix.App("mon")  # a read used as a monitor: its stop keeps extents and floors
    app.read("probe", weight=torch.ones(8)).layers([0]).at("residual.post").named("p")
    app.stop(when="p > 1000.0")
    cb.install(lower(app, SHAPE))
    return cb, WorkerXmix.for_control_block(cb)


def _header(cb: ControlBlock) -> tuple[int, int]:
    """n_tokens, n_rows as the site kernels read them: the block itself, not its image."""
    off = CTRL_LAYOUT["n_tokens"]
    n_tok, n_rows = cb.block.numpy()[off : off + 8].view(np.int32).tolist()
    return n_tok, n_rows


def _no_python_step(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("the Python step path ran on a CPU engine")

    monkeypatch.setattr(Step, "begin", refuse)
    monkeypatch.setattr(Step, "prologue", refuse)


def test_one_native_call_per_step_maps_extents_and_the_restart_check(monkeypatch):
    cb, x = _block()
    _no_python_step(monkeypatch)
    sa = cb.admit("a", ["mon"], {}, 3)
    sb = cb.admit("b", [], {}, 4)
    ids = torch.arange(4, dtype=torch.int64)

    # a: its 3 prompt tokens; b: one decode at position 5 (no app: inert but mapped)
    x.begin(["a", "b"], np.array([3, 1]), np.array([0, 5], np.int32), np.array([3, 4]), ids, 6)
    h = cb.host
    assert h["tok_slot"][:6].tolist() == [sa, sa, sa, sb, -1, -1]
    assert h["tok_pos"][:4].tolist() == [0, 1, 2, 5]
    assert h["tok_row"][:6].tolist() == [0, 0, 0, 1, -1, -1]
    assert h["row_done"][:2].tolist() == [1, 0] and h["row_reset"][:2].tolist() == [1, 0]
    assert _header(cb) == (4, 2)
    on = {s for s in np.flatnonzero(cb.step.site_active).tolist()}
    # the read at layer 0, and the stop, decided where the last layer ends
    assert on == {site_id("residual.post", 0, 2), site_id("final.post", None, 2)}
    assert cb.slots.extent[[sa, sb]].tolist() == [3, 6]
    assert x.stats["steps_with_apps"] == 1 and x.stats.get("restarts", 0) == 0
    x.after_forward()
    assert _header(cb) == (0, 0) and not cb.step.site_active.any()

    # token counts as vLLM's scheduler gives them: {req id: tokens}, read per request natively
    x.begin(["a"], {"a": 1, "gone": 5}, np.array([3]), np.array([3]), ids[:1], 1)
    assert cb.host["tok_pos"][0] == 3 and _header(cb) == (1, 1)
    assert cb.slots.extent[sa] == 4
    x.after_forward()

    # a starts again at position 0 in the slot it holds (vLLM V1 recomputes it): a restart;
    # its monitors keep what they decided, up to position 4
    x.begin(["a"], np.array([4]), np.array([0]), np.array([3]), ids, 4)
    assert x.stats["restarts"] == 1
    assert cb.slots.floor[sa] == 4 and cb.host["slot_floor"][sa] == 4
    assert cb.slots.extent[sa] == 4
    x.after_forward()


def test_a_request_without_a_slot_goes_the_long_way_and_is_admitted():
    cb, x = _block()
    sa = cb.admit("a", ["mon"], {}, 2)
    ids = torch.arange(3, dtype=torch.int64)
    # "c" was never admitted through the scheduler output: it gets a slot without apps
    x.begin(["a", "c"], np.array([2, 1]), np.array([0, 0]), np.array([2, 1]), ids, 3)
    sc = cb.slots.slot_of["c"]
    assert sc != sa and cb.host["slot_apps"][sc] == 0
    assert cb.host["tok_slot"][:3].tolist() == [sa, sa, sc]
    assert _header(cb) == (3, 2)
    x.after_forward()


def test_a_step_over_capacity_is_refused_naming_the_sizes():
    cb, x = _block()
    cb.admit("a", ["mon"], {}, 20)
    with pytest.raises(
        RuntimeError, match=r"step of 20 rows / 1 requests exceeds capacity \(16 / 4\)"
    ):
        x.begin(["a"], np.array([20]), np.array([0]), np.array([20]), torch.zeros(20), 20)


def test_a_request_missing_from_the_token_counts_is_a_key_error_and_nothing_runs():
    cb, x = _block()
    cb.admit("a", ["mon"], {}, 2)
    with pytest.raises(KeyError, match="'a'"):
        x.begin(["a"], {"b": 1}, np.array([0]), np.array([2]), torch.arange(1), 1)
    assert _header(cb) == (0, 0) and not cb.step.started.any()
