"""The site kernels' shared memory, read from the compiled sm_90 cubin: at hidden size 5 120 the
static arrays plus two rows of floats pass 48 KB, so the launch must opt in (xmix/smem.h). The
static size comes from cuobjdump (shipped in the triton wheel vLLM pulls in); the decision is
_C's own (smem_plan), the numbers are the cubin's and the CUDA limits'."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from xmix import _C

OPTIN_SM90 = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100 / H200 (227 KB)
DEFAULT = 48 * 1024


def _cuobjdump() -> str | None:
    try:
        import triton

        p = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        if p.exists() and os.access(p, os.X_OK):
            return str(p)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def _static_smem_sm90() -> dict[str, int]:
    if not _C.built_with_cuda():
        pytest.skip("xmix._C was built without CUDA: no cubin to read")
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (neither the triton wheel's nor on PATH)")
    out = subprocess.run(
        [tool, "--dump-resource-usage", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    found: dict[str, int] = {}
    arch = kernel = None
    for line in out.splitlines():
        if m := re.match(r"\s*arch = (sm_\d+)", line):
            arch = m.group(1)
        elif m := re.search(r"Function \S*?(xmix_site_anchor|xmix_op_kernel)\S*:", line):
            kernel = m.group(1) if arch == "sm_90" else None
        elif "Function" in line:
            kernel = None
        elif kernel and (m := re.search(r"SHARED:(\d+)", line)):
            found[kernel], kernel = int(m.group(1)), None
    if len(found) != 2:
        pytest.skip(f"no sm_90 cubin of the site kernels in {_C.__file__} ({found})")
    return found


def test_hidden_size_5120_needs_the_opt_in_on_sm90():
    static = _static_smem_sm90()
    for kernel, bytes_ in static.items():
        assert 4096 < bytes_ < DEFAULT, (kernel, bytes_)
        p = _C.smem_plan(bytes_, 5120, OPTIN_SM90)
        # two rows of 5 120 floats are under 48 KB on their own (the rule that skipped the
        # opt-in); with the static arrays the block is over it
        assert p["dynamic"] == 40960 < DEFAULT < p["static"] + p["dynamic"]
        assert p["opt_in"] and p["fits"] and p["refusal"] == ""
        assert not _C.smem_plan(bytes_, 4096, OPTIN_SM90)["opt_in"]


def test_a_hidden_size_beyond_the_opt_in_is_refused_by_name():
    static = max(_static_smem_sm90().values())
    p = _C.smem_plan(static, 28672, OPTIN_SM90)
    assert not p["fits"] and "hidden size 28672" in p["refusal"]
    # the largest dense models served today fit
    for d in (8192, 12288, 16384):
        assert _C.smem_plan(static, d, OPTIN_SM90)["fits"], d


def test_without_a_gpu_the_start_check_says_nothing():
    # the check needs the device's limit; without CUDA it has nothing to refuse
    if _C.cuda_available():
        pytest.skip("a GPU is here: tests/gpu cover the device check")
    if _C.built_with_cuda():
        with pytest.raises(RuntimeError, match="reading the site kernels' shared memory"):
            _C.site_smem_check(5120)
    else:
        assert _C.site_smem_check(5120) == ""


@pytest.mark.gpu
def test_a_gpu_control_block_refuses_a_hidden_size_its_kernels_cannot_serve():
    from xmix.lang.sites import ModelShape
    from xmix.runtime.control import ControlBlock

    with pytest.raises(ValueError, match="hidden size 40000"):
        ControlBlock(ModelShape(n_layers=1, hidden_size=40000, vocab_size=64), "cuda")
    ControlBlock(ModelShape(n_layers=1, hidden_size=5120, vocab_size=64), "cuda")
