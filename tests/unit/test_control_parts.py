"""The control block's host side keeps one job per module (issue 30): no class in
``xmix.control`` over 400 lines, no module over 900, and the parts ``ControlBlock`` is
composed of never hold the block (they share the block's memory, ``BlockMemory``)."""

from __future__ import annotations

import ast
from pathlib import Path

import xmix.control
from xmix.control import ControlBlock
from xmix.hooks import ModelShape

PKG = Path(xmix.control.__file__).parent


def test_no_class_over_400_lines_no_module_over_900():
    big = []
    for f in sorted(PKG.glob("*.py")):
        text = f.read_text()
        if text.count("\n") > 900:
            big.append(f"{f.name}: {text.count(chr(10))} lines")
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if n > 400:
                    big.append(f"{f.name}: class {node.name} {n} lines")
    assert not big, big


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
