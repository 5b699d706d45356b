"""``torch.library.opcheck`` on ``xmix::site`` (issue 12 §6): the schema's mutation annotations
(``h`` written in place, ``r`` only read), the fake (meta) kernel torch.compile traces with,
and AOT dispatch, with a control block that makes the op really write (an ``add`` app on one
request's rows), so a write to an undeclared argument would be caught. CPU here; the CUDA
variant is marked ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xmix
from harness import SMALL
from xmix.lang.lowering import lower
from xmix.lang.sites import ModelShape
from xmix.runtime import ops
from xmix.runtime.control import ControlBlock

D = 32
SHAPE = ModelShape(n_layers=1, hidden_size=D, vocab_size=64)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def writing_control(request):
    dev = request.param
    v = torch.linspace(-1, 1, D)
    app = xmix.App("push")
    app.write("add", vector=v, scale=2.0).layers([0]).at("residual.pre")
    cb = ControlBlock(SHAPE, dev, SMALL)
    cb.install(lower(app, SHAPE), "request", 1)
    slot, left_out = cb.slots.admit_pinned("r0", ["push"], {"push": [1, []]}, 3)
    assert left_out == []
    other = cb.slots.admit_pinned("r1", [], {}, 3)[0]
    cb.begin_step(
        np.array([slot, other], dtype=np.int32),
        np.array([3, 3]),
        np.array([0, 0]),
        np.array([3, 3]),
    )
    cb.prologue(torch.zeros(6, dtype=torch.int32, device=dev))
    ops.set_control(cb)
    yield dev, v
    ops.set_control(None)
    cb.end_step()


def test_the_site_op_writes_what_the_app_says(writing_control):
    dev, v = writing_control
    h = torch.zeros(6, D, device=dev)
    torch.ops.xmix.site(h, None, 0)
    # hand-computed: rows 0-2 are the app's request (+2 v), rows 3-5 are left alone
    assert torch.allclose(h[:3].cpu(), (2 * v).expand(3, D)) and not h[3:].any()


@pytest.mark.parametrize("with_residual", [False, True])
def test_opcheck_site(writing_control, with_residual):
    dev, _ = writing_control
    h = torch.randn(6, D, device=dev)
    r = torch.randn(6, D, device=dev) if with_residual else None
    torch.library.opcheck(
        torch.ops.xmix.site.default,
        (h, r, 0),
        test_utils=(
            "test_schema",
            "test_faketensor",
            "test_aot_dispatch_static",
            "test_aot_dispatch_dynamic",
        ),
    )
