"""The torch custom op behind every hook site: ``torch.ops.xmix.site(h, r, site_id)``.

It mutates ``h`` in place (a write changes the stream ``h + r`` by changing ``h``) and
returns nothing, so torch.compile sees one opaque in-place op per site. The op finds the
process's control block (``set_control``) and runs the site program:

- CPU: the native kernel in ``xmix/_site_op.so`` (csrc/site/site_op_cpu.cpp, registered with
  the dispatcher: no Python per site), which returns at once when no app of the batch has an
  op at this site and records a failing op in the block's ``site_state`` for
  ``SiteReports.collect`` (runtime/control/site_state.py) after the forward. ``_site_cpu`` below is its Python
  reference (same checks, same calls, failures handed over at once); it serves where the
  native library was not built (a torch without the stable ABI headers at build time) and
  in the tests that hold both kernels to one behaviour;
- CUDA, eager: the site anchor kernel, skipped the same way;
- CUDA, while a graph is being captured: always the anchor kernel (it dispatches itself from
  the control block, so the captured graph is correct whatever is deployed later).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from pathlib import Path
from time import perf_counter

import torch

import xmix._C as _C
from xmix.runtime.control import site_state

logger = logging.getLogger(__name__)

_K = _C.constants()
DTYPES = {torch.float32: _K["DT_F32"], torch.bfloat16: _K["DT_BF16"], torch.float16: _K["DT_F16"]}

_CONTROL = None  # the process's ControlBlock (one engine per process)

lib = torch.library.Library("xmix", "DEF")
lib.define("site(Tensor(a!) h, Tensor? r, int site) -> ()")


def set_control(cb) -> None:
    global _CONTROL
    _CONTROL = cb
    if NATIVE is not None:
        if cb is None:
            NATIVE.xmix_site_bind(0, 0, 0, 0)
        else:
            NATIVE.xmix_site_bind(
                cb.ptr, cb.step.site_active.ctypes.data, cb.n_sites, cb.sites.state.ctypes.data
            )


def get_control():
    return _CONTROL


def _args(h: torch.Tensor, r: torch.Tensor | None):
    # Every active site calls this each step: one shape and one stride() per tensor (each
    # torch attribute is a call; this form costs ~1 us against ~1.8 us with one per check).
    dt = DTYPES.get(h.dtype)
    if dt is None:
        raise TypeError(f"xmix: hook site on a {h.dtype} tensor; supported: fp32, bf16, fp16")
    shape, st = h.shape, h.stride()
    d = shape[-1]
    n = h.numel() // d if d else 0
    if st[-1] != 1 or (len(st) > 1 and st[-2] != d and n > 1):
        raise ValueError("xmix: hook site needs rows of contiguous elements")
    sh = d if len(st) == 1 else st[-2]
    if r is None:
        return n, d, sh, 0, 0, dt
    if r.dtype != h.dtype or r.shape != shape:
        raise ValueError("xmix: residual must match hidden states in shape and dtype")
    rst = r.stride()
    return n, d, sh, (d if len(rst) == 1 else rst[-2]), r.data_ptr(), dt


def _site_cpu(h: torch.Tensor, r: torch.Tensor | None, site: int) -> None:
    cb = _CONTROL
    if cb is None or not cb.step.site_active[site]:
        return
    t0 = perf_counter()
    try:
        n, d, sh, sr, rp, dt = _args(h, r)
        failed = _C.run_site_cpu(cb.ptr, site, h.data_ptr(), rp, n, d, sh, sr, dt)
    except Exception as e:  # nothing of the site ran: its apps' requests fail, not the step
        failed = [(None, f"{type(e).__name__}: {e}")]
    if failed:
        cb.sites.site_failed(site, failed)
    cb.sites.py_seconds += perf_counter() - t0
    python_site_calls[0] += 1


def _site_cuda(h: torch.Tensor, r: torch.Tensor | None, site: int) -> None:
    cb = _CONTROL
    if cb is None:
        return
    capturing = torch.cuda.is_current_stream_capturing()
    if not capturing and not cb.step.site_active[site]:
        return
    n, d, sh, sr, rp, dt = _args(h, r)
    stream = torch.cuda.current_stream(h.device).cuda_stream
    if capturing and cb.graph_hook is not None:
        cb.graph_hook.note_anchor(site, h, r, n, d, sh, sr, dt)
    if capturing:
        _C.launch_site_anchor(cb.ptr, site, h.data_ptr(), rp, n, d, sh, sr, dt, stream)
        return
    try:
        _C.launch_site_anchor(cb.ptr, site, h.data_ptr(), rp, n, d, sh, sr, dt, stream)
        cb.custom.launch(site, h, r, n, d, sh, sr, dt, stream)
    except RuntimeError as e:  # a launch refused: the site's apps' requests fail, not the step
        cb.sites.site_failed(site, [(None, str(e))])


# Calls of the Python reference kernel in this process (the worker reports it: a served CPU
# step with the native kernel makes none).
python_site_calls = [0]


def _load_native() -> ctypes.CDLL | None:
    """The native CPU kernel, registered with the dispatcher as the library loads; None (the
    Python kernel serves, said once in the log) where it was not built or does not load."""
    path = Path(_C.__file__).with_name("_site_op.so")  # installed beside _C (editable too)
    if not path.exists():
        logger.warning("xmix: %s was not built; the Python site kernel serves the CPU", path.name)
        return None
    try:
        native = ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning(
            "xmix: %s does not load (%s); the Python site kernel serves the CPU", path.name, e
        )
        return None
    native.xmix_site_bind.argtypes = [
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_int32,
        ctypes.c_uint64,
    ]
    native.xmix_site_bind.restype = ctypes.c_int32
    native.xmix_site_state_size.restype = ctypes.c_int64
    if native.xmix_site_state_size() != site_state.SITE_STATE.itemsize:
        raise ImportError(
            f"xmix: {path.name}'s SiteOpState is {native.xmix_site_state_size()} bytes, "
            f"xmix.runtime.control.site_state spells {site_state.SITE_STATE.itemsize}: rebuild xmix"
        )
    return native


@contextlib.contextmanager
def reference_site_kernel():
    """The Python reference kernel in the dispatcher's CPU slot while open (benchmarks measure
    both kernels through the same call); the native one comes back when the library object
    is destroyed."""
    override = torch.library.Library("xmix", "IMPL")
    override.impl("site", _site_cpu, "CPU")
    try:
        yield
    finally:
        override._destroy()


lib.impl("site", _site_cuda, "CUDA")
NATIVE = _load_native()
if NATIVE is None:
    lib.impl("site", _site_cpu, "CPU")


@torch.library.register_fake("xmix::site", lib=lib)
def _site_fake(h, r, site) -> None:
    return None


def site(h: torch.Tensor, r: torch.Tensor | None, site_id: int) -> None:
    torch.ops.xmix.site(h, r, site_id)
