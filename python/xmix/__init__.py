"""xmix: serving-native mechanistic-interpretability apps for vLLM.

    app = xmix.App("steer")
    app.write("add", vector=v, scale=4.0).layers([2]).submodule("residual.post")
    llm = xmix.LLM(model=path, apps=[app])
    outs = llm.generate(prompts, SamplingParams(extra_args={"xmix": {"apps": ["steer"]}}))
    xmix.results(outs[0])
"""

from xmix.api import App, AppError
from xmix.lowering import DeployError
from xmix.sae import SAE

__version__ = "0.1.0"
__all__ = ["App", "AppError", "DeployError", "LLM", "SAE", "custom_include_dir", "results", "__version__"]


def results(output) -> dict:
    """Read results of a request: {app: {read: {"positions": [...], "values": [...]}}}."""
    return getattr(output, "xmix", None) or {}


def custom_include_dir() -> str:
    """Include directory for user kernels: ``#include "xmix/custom.h"`` (the fixed ABI)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for cand in (here / "include", here.parent.parent / "csrc" / "include"):
        if (cand / "xmix" / "custom.h").is_file():
            return str(cand)
    raise FileNotFoundError("xmix/custom.h not found next to the package or in the source tree")


def __getattr__(name):
    # vLLM is imported only when the engine side is used.
    if name == "LLM":
        from xmix.integrations.vllm.llm import _make_llm_class

        cls = _make_llm_class()
        globals()["LLM"] = cls
        return cls
    raise AttributeError(name)
