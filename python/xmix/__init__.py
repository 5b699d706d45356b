"""xmix: serving-native mechanistic-interpretability apps for vLLM.

app = xmix.App("steer")
app.write("add", vector=v, scale=4.0).layers([2]).at("residual.post")
llm = xmix.LLM(model=path, apps=[app])
outs = llm.generate(prompts, SamplingParams(extra_args={"xmix": {"apps": ["steer"]}}))
xmix.results(outs[0])
"""

from xmix.lang.api import App, AppError
from xmix.lang.lowering import DeployError
from xmix.lang.sae import SAE
from xmix.version import __version__

__all__ = [
    "App",
    "AppError",
    "DeployError",
    "LLM",
    "SAE",
    "capture",
    "custom_include_dir",
    "decode_results",
    "monitors",
    "results",
    "__version__",
]


def results(output, as_tensors: bool = False) -> dict:
    """Read results of a request: {app: {read: {"positions": [...], "values": [...]}}}; with
    ``as_tensors`` {app: {read: {"positions", "values"[, "ids"]}}} as torch tensors (values
    in the request's "dtype"). A request cut at its byte cap carries ``"!truncated"``."""
    from xmix.lang.results_codec import as_lists
    from xmix.lang.results_codec import as_tensors as tensors_of

    res = getattr(output, "xmix", None) or {}
    return tensors_of(res) if as_tensors else as_lists(res)


def monitors(output) -> dict:
    """What an app's monitors did to one sequence (a ``CompletionOutput``, or a
    ``RequestOutput``: its first sequence), once it finished: ``{"stopped": {app, read,
    position, value}, "switched": [{app, read, position, condition}, ...]}``, each key only
    when it happened (``App.stop``, ``since(...)``); {} otherwise. The request's provenance
    (``xmix_applied``) names the same for a request of one sequence."""
    outs = getattr(output, "outputs", None)
    if isinstance(outs, list):
        output = outs[0] if outs else None
    return dict(getattr(output, "xmix_monitors", None) or {})


def decode_results(payload) -> dict:
    """The ``"xmix"`` payload of a server response (or the payloads of a stream's chunks, in
    order) as torch tensors, whatever its encoding (JSON, base64, zstd)."""
    from xmix.lang.results_codec import decode_results as decode

    return decode(payload)


def custom_include_dir() -> str:
    """Include directory for user kernels: ``#include "xmix/custom.h"`` (the fixed ABI)."""
    from xmix.runtime.control.custom import include_dir

    return include_dir()


def __getattr__(name):
    # vLLM is imported only when the engine side is used.
    if name == "LLM":
        from xmix.integrations.vllm.llm import llm_class

        cls = llm_class()
        globals()["LLM"] = cls
        return cls
    if name == "capture":
        from xmix.capture_run import capture

        globals()["capture"] = capture
        return capture
    raise AttributeError(name)
