"""Run one hook site of deployed apps outside any engine: the kernel tests' driver.

A step is a list of requests, each (n_tokens, start_pos, prompt_len, apps); their tokens are
contiguous rows of h in that order, as in vLLM's batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xmix.lang.lowering import lower
from xmix.lang.sites import ModelShape, site_id
from xmix.runtime import ops
from xmix.runtime.control import Capacity, ControlBlock

SMALL = Capacity(
    max_tokens=64,
    max_slots=8,
    max_apps=8,
    max_params=64,
    max_channels=16,
    max_ops=64,
    max_cond=128,
    capture_floats=64 * 64,
)


@dataclass
class Req:
    n: int
    start: int
    prompt_len: int
    apps: tuple[str, ...] = ()
    params: dict | None = None


class Harness:
    def __init__(self, shape: ModelShape, apps, device="cpu", tokenizer=None, capacity=SMALL):
        self.shape = shape
        self.device = torch.device(device)
        self.cb = ControlBlock(shape, self.device, capacity)
        self.lowered = {}
        for app in apps:
            lw = lower(app, shape, tokenizer)
            self.cb.install(lw)
            self.lowered[app.name] = lw
        self.slots: dict[str, int] = {}

    def step(
        self, reqs: dict[str, Req], input_ids: torch.Tensor | None = None, pad_to: int | None = None
    ):
        for name, q in reqs.items():
            if name not in self.slots:
                self.slots[name] = self.cb.admit(name, list(q.apps), q.params, q.prompt_len)
        rows = list(reqs.values())
        slots = np.array([self.slots[n] for n in reqs], dtype=np.int32)
        self.cb.begin_step(
            slots,
            np.array([q.n for q in rows]),
            np.array([q.start for q in rows]),
            np.array([q.prompt_len for q in rows]),
            pad_to,
        )
        n_tok = sum(q.n for q in rows)
        if input_ids is None:
            input_ids = torch.zeros(max(n_tok, pad_to or 0), dtype=torch.int32)
        self.cb.prologue(input_ids.to(self.device))
        ops.set_control(self.cb)

    def run(
        self, submodule: str, layer: int | None, h: torch.Tensor, r: torch.Tensor | None = None
    ):
        sid = site_id(submodule, layer, self.shape.n_layers)
        torch.ops.xmix.site(h, r, sid)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run_reference(
        self, submodule: str, layer: int | None, h: torch.Tensor, r: torch.Tensor | None = None
    ):
        """The site through the Python reference kernel (xmix.runtime.ops._site_cpu) instead of the
        dispatcher's, which on the CPU is the native one."""
        ops._site_cpu(h, r, site_id(submodule, layer, self.shape.n_layers))

    def drain(self):
        return self.cb.drain()

    def finish(self, name: str):
        self.cb.release(name)
        self.slots.pop(name, None)


def build_user_kernels(directory, source: str) -> str:
    """A shared library of user kernels (C++ against xmix's shipped custom.h), built with the
    system compiler; the test skips, saying why, where there is none."""
    import shutil
    import subprocess

    import pytest

    import xmix

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler to build a user kernel")
    src, out = directory / "kernels.cpp", directory / "libkernels.so"
    src.write_text(source)
    subprocess.run(
        [
            cxx,
            "-shared",
            "-fPIC",
            "-O1",
            "-I",
            str(xmix.custom_include_dir()),
            "-o",
            str(out),
            str(src),
        ],
        check=True,
    )
    return str(out)


def program_parts(data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """A lowered program (xmix.lang.program_codec) taken apart without its checks: the JSON and
    the arrays, for tests that forge one (``program_from_parts`` puts it back together)."""
    import json

    from xmix.lang.app_file import _materialise, _tensor_entries
    from xmix.lang.program_codec import META_KEY

    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    prog = json.loads(header.pop("__metadata__")[META_KEY])
    entries = _tensor_entries(header, len(data) - 8 - n, "program")
    arrays = {k: v.clone() for k, v in _materialise(data, 8 + n, entries, entries).items()}
    return prog, arrays


def program_from_parts(prog: dict, arrays: dict[str, torch.Tensor]) -> bytes:
    import json

    from xmix.lang.program_codec import _safetensors

    return _safetensors(arrays, json.dumps(prog))
