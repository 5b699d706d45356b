"""User kernels, loaded at deploy: a shared library's symbol on a CPU engine; on a GPU a fatbin,
or CUDA source compiled with nvcc for the device's architecture. (They run after a site's
built-in ops: ``CustomOps.launch`` on a GPU, the interpreter on a CPU.)"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import xmix._C as _C
from xmix.lang.lowering import DeployError, LoweredApp, LoweredOp

if TYPE_CHECKING:
    from xmix.runtime.control.memory import BlockMemory


def load_custom(lw: LoweredApp, on_gpu: bool) -> dict[int, int]:
    """The user kernels of ``lw``: {position in lw.ops: function pointer or kernel handle}."""
    fns: dict[int, int] = {}
    for k, o in enumerate(lw.ops):
        if o.kernel != "custom":
            continue
        ck = o.custom
        if on_gpu:
            fns[k] = load_custom_cuda(lw.name, o, ck)
        else:
            if not ck.cpu_library or not ck.cpu_symbol:
                raise DeployError(
                    f"app {lw.name!r}, op {o.label}: a custom kernel on a CPU engine "
                    f"needs cpu_library and cpu_symbol"
                )
            try:
                fns[k] = int(_C.load_custom_cpu(str(ck.cpu_library), ck.cpu_symbol))
            except RuntimeError as e:
                raise DeployError(f"app {lw.name!r}, op {o.label}: {e}") from None
    return fns


def load_custom_cuda(app: str, o: LoweredOp, ck: Any) -> int:
    """Compile (nvcc) or read the user's fatbin and load it; returns the kernel handle."""
    if not ck.cuda_symbol:
        raise DeployError(f"app {app!r}, op {o.label}: a custom kernel on a GPU needs cuda_symbol")
    if ck.cuda_fatbin:
        image = Path(ck.cuda_fatbin).read_bytes()
    elif ck.cuda_source:
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            raise DeployError(
                f"app {app!r}, op {o.label}: cuda_source needs nvcc on PATH to compile"
            )
        major, minor = torch.cuda.get_device_capability()
        inc = include_dir()
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "kernel.cu"
            src.write_text(ck.cuda_source)
            out = Path(d) / "kernel.fatbin"
            cmd = [
                nvcc,
                "-fatbin",
                f"-arch=sm_{major}{minor}",
                "-I",
                str(inc),
                "-o",
                str(out),
                str(src),
            ]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise DeployError(f"app {app!r}, op {o.label}: nvcc failed:\n{r.stderr[-2000:]}")
            image = out.read_bytes()
    else:
        raise DeployError(
            f"app {app!r}, op {o.label}: a custom kernel on a GPU needs cuda_source or cuda_fatbin"
        )
    try:
        return int(_C.load_custom_cuda(image, ck.cuda_symbol))
    except (RuntimeError, AttributeError) as e:
        raise DeployError(f"app {app!r}, op {o.label}: {e}") from None


class CustomOps:
    """GPU: the launches of a site's user kernels, after its built-in ops (the anchor skips
    them), with the scratch buffers they share."""

    def __init__(self, mem: BlockMemory):
        self.mem = mem
        self.select: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        if mem.on_gpu:
            T, device = mem.cap.max_tokens, mem.device
            self.select = torch.zeros(T, dtype=torch.uint8, device=device)
            self.out = torch.zeros(T, dtype=torch.float32, device=device)

    def launch(
        self,
        site: int,
        h: torch.Tensor,
        r: torch.Tensor | None,
        n: int,
        d: int,
        sh: int,
        sr: int,
        dt: int,
        stream: int,
    ) -> None:
        mem = self.mem
        for k, so in mem.site_custom.get(site, ()):
            assert self.select is not None and self.out is not None  # on a GPU
            lo = so.linked
            art = lo.artifacts.get("a0")
            _C.launch_custom(
                mem.ptr,
                site,
                k,
                lo.fn,
                h.data_ptr(),
                r.data_ptr() if r is not None else 0,
                sh,
                sr,
                n,
                d,
                dt,
                mem.cap.max_params,
                mem.dev["tok_slot"].data_ptr(),
                mem.dev["tok_pos"].data_ptr(),
                mem.dev["slot_params"].data_ptr(),
                lo.param_col,
                art.data_ptr() if art is not None else 0,
                int(art.numel()) if art is not None else 0,
                self.select.data_ptr(),
                self.out.data_ptr(),
                stream,
            )


def include_dir() -> str:
    """Include directory for user kernels (``xmix.custom_include_dir``): the headers installed
    in the package, or the source tree's in an editable install."""
    pkg = Path(__file__).resolve().parents[2]  # xmix/runtime/control/custom.py -> xmix/
    for cand in (pkg / "include", pkg.parent.parent / "csrc" / "include"):
        if (cand / "xmix" / "custom.h").is_file():
            return str(cand)
    raise FileNotFoundError("xmix/custom.h not found next to the package or in the source tree")
