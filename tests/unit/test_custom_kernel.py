"""User kernels with the fixed ABI (csrc/include/xmix/custom.h) through the engine path:
a C++ shared library compiled here against the shipped header, loaded by _C, run by the site
interpreter. Expected values are hand-computed."""

from __future__ import annotations

import pytest
import torch

import xmix
from harness import Harness, Req, build_user_kernels
from xmix.lang.sites import ModelShape

D = 16
SHAPE = ModelShape(n_layers=2, hidden_size=D, vocab_size=64)

KERNELS_CPP = r"""
#include "xmix/custom.h"

// read: k * x[0] + artifact[0], where x = h + r (the stream)
extern "C" void scaled_first(const xmix_custom_args* a) {
  const float* h = static_cast<const float*>(a->h);
  const float* r = static_cast<const float*>(a->r);
  for (int t = 0; t < a->n_rows; ++t) {
    if (!a->select[t]) continue;
    const float k = a->slot_params[a->tok_slot[t] * a->n_params + a->param_base];
    const float x0 = h[t * a->stride_h] + (r ? r[t * a->stride_r] : 0.f);
    a->out[t] = k * x0 + a->artifact[0];
  }
}

// write: h[t][1] = position of the token
extern "C" void stamp_position(const xmix_custom_args* a) {
  float* h = static_cast<float*>(a->h);
  for (int t = 0; t < a->n_rows; ++t)
    if (a->select[t]) h[t * a->stride_h + 1] = static_cast<float>(a->tok_pos[t]);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_user_kernels(tmp_path_factory.mktemp("kernel"), KERNELS_CPP)


def test_custom_read_and_write_on_cpu(lib):
    app = xmix.App("user")
    app.read(
        "custom",
        cpu_library=lib,
        cpu_symbol="scaled_first",
        artifact=torch.tensor([0.5]),
        params={"k": 2.0},
    ).layers([0]).at("residual.pre").named("c")
    app.write("custom", cpu_library=lib, cpu_symbol="stamp_position").layers([1]).at(
        "residual.pre"
    ).cond("not last_token")
    hs = Harness(SHAPE, [app])
    hs.step({"a": Req(3, 0, 3, ("user",), {"user": {"k": 3.0}}), "b": Req(2, 0, 2, ())})
    h = torch.arange(5 * D, dtype=torch.float32).reshape(5, D) / 10
    r = torch.ones(5, D)
    h0 = h.clone()
    hs.run("residual.pre", 0, h, r)
    assert torch.equal(h, h0)  # a read leaves the stream alone
    res = hs.drain()
    # request a uses the app with k = 3: value = 3 * (h[t][0] + 1) + 0.5 at positions 0..2
    assert res["a"]["user"]["c"]["positions"] == [0, 1, 2]
    expect = [3.0 * (float(h0[t, 0]) + 1.0) + 0.5 for t in range(3)]
    assert res["a"]["user"]["c"]["values"] == pytest.approx(expect, rel=1e-6)
    assert "b" not in res
    hs.run("residual.pre", 1, h, r)
    # the write: rows 0 and 1 of a (not the last token), never b's rows
    assert h[0, 1].item() == 0.0 and h[1, 1].item() == 1.0
    assert h[2, 1].item() == h0[2, 1].item()
    assert torch.equal(h[3:], h0[3:])


def test_missing_symbol_is_a_deploy_error(lib):
    app = xmix.App("bad")
    app.write("custom", cpu_library=lib, cpu_symbol="no_such_kernel").layers([0]).at("residual.pre")
    with pytest.raises(xmix.DeployError, match="no_such_kernel"):
        Harness(SHAPE, [app])
    app2 = xmix.App("bad2")
    app2.write("custom", cpu_library="/nonexistent/lib.so", cpu_symbol="k").layers([0]).at(
        "residual.pre"
    )
    with pytest.raises(xmix.DeployError, match="cannot load"):
        Harness(SHAPE, [app2])
