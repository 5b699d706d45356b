"""User kernels, loaded at deploy: a shared library's symbol on a CPU engine; on a GPU a fatbin,
or CUDA source compiled with nvcc for the device's architecture. (They run after a site's
built-in ops: ControlBlock.launch_custom_ops on a GPU, the interpreter on a CPU.)"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from xmix import _C
from xmix.lowering import DeployError, LoweredApp, LoweredOp


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
        from xmix import custom_include_dir

        inc = custom_include_dir()
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
