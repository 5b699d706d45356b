import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    import xmix._C as C

    if not C.built_with_cuda():
        return "xmix._C was built without CUDA"
    if not C.cuda_available():
        return f"xmix._C cannot use the GPU: {C.cuda_status()}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test skipped: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
