"""The torch custom op behind every hook site: ``torch.ops.xmix.site(h, r, site_id)``.

It mutates ``h`` in place (a write changes the stream ``h + r`` by changing ``h``) and
returns nothing, so torch.compile sees one opaque in-place op per site. The op finds the
process's control block (``set_control``) and runs the site program:

- CPU: ``_C.run_site_cpu`` (skipped without a call into _C when no app of the batch has an
  op at this site);
- CUDA, eager: the site anchor kernel, skipped the same way;
- CUDA, while a graph is being captured: always the anchor kernel (it dispatches itself from
  the control block, so the captured graph is correct whatever is deployed later).
"""

from __future__ import annotations

from time import perf_counter

import torch

from xmix import _C

_K = _C.constants()
DTYPES = {torch.float32: _K["DT_F32"], torch.bfloat16: _K["DT_BF16"], torch.float16: _K["DT_F16"]}

_CONTROL = None  # the process's ControlBlock (one engine per process)

lib = torch.library.Library("xmix", "DEF")
lib.define("site(Tensor(a!) h, Tensor? r, int site) -> ()")


def set_control(cb) -> None:
    global _CONTROL
    _CONTROL = cb


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
    if cb is None or not cb.site_active[site]:
        return
    t0 = perf_counter()
    try:
        n, d, sh, sr, rp, dt = _args(h, r)
        failed = _C.run_site_cpu(cb.ptr, site, h.data_ptr(), rp, n, d, sh, sr, dt)
    except Exception as e:  # nothing of the site ran: its apps' requests fail, not the step
        failed = [(None, f"{type(e).__name__}: {e}")]
    if failed:
        cb.site_failed(site, failed)
    cb.site_seconds += perf_counter() - t0


def _site_cuda(h: torch.Tensor, r: torch.Tensor | None, site: int) -> None:
    cb = _CONTROL
    if cb is None:
        return
    capturing = torch.cuda.is_current_stream_capturing()
    if not capturing and not cb.site_active[site]:
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
        cb.launch_custom_ops(site, h, r, n, d, sh, sr, dt, stream)
    except RuntimeError as e:  # a launch refused: the site's apps' requests fail, not the step
        cb.site_failed(site, [(None, str(e))])


lib.impl("site", _site_cpu, "CPU")
lib.impl("site", _site_cuda, "CUDA")


@torch.library.register_fake("xmix::site", lib=lib)
def _site_fake(h, r, site) -> None:
    return None


def site(h: torch.Tensor, r: torch.Tensor | None, site_id: int) -> None:
    torch.ops.xmix.site(h, r, site_id)
