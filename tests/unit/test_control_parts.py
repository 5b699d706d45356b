"""The control block's host side keeps one job per module (issue 30): the parts
``ControlBlock`` is composed of never hold the block (they share the block's memory,
``BlockMemory``). The size limits (no class over 400 lines, no module over 900) are
test_module_sizes.py's, for the whole package."""

from __future__ import annotations

from xmix.lang.sites import ModelShape
from xmix.runtime.control import ControlBlock


def test_parts_share_the_memory_and_never_hold_the_block():
    cb = ControlBlock(ModelShape(n_layers=2, hidden_size=16, vocab_size=64), "cpu")
    parts = [cb.slots, cb.deploy, cb.step, cb.sites, cb.reads, cb.custom]
    for part in parts:
        assert part.mem is cb.mem, type(part).__name__
        held = [v for v in vars(part).values() if v is cb]
        assert not held, f"{type(part).__name__} holds the ControlBlock"
    # the common operations are the parts' own bound methods: no forwarding layer
    assert cb.begin_step.__self__ is cb.step and cb.drain.__self__ is cb.reads
    assert cb.install.__self__ is cb.deploy and cb.admit.__self__ is cb.slots
