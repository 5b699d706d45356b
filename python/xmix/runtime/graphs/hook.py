"""Where xmix meets torch and vLLM: ``XmixCUDAGraph`` (a ``torch.cuda.CUDAGraph`` that keeps its
cudaGraph_t and is patched at the end of capture), and the redirect that makes vLLM's capture
sites build it (``install_capture_hook``)."""

from __future__ import annotations

import importlib
import types
from typing import Any

import xmix._C as _C
from xmix.runtime.graphs import state
from xmix.runtime.graphs.check import replay
from xmix.runtime.graphs.splice import after_capture, begin_capture, bind, end_capture
from xmix.runtime.graphs.state import count, cuda_patching_available, lock, logger, registry

# vLLM modules that construct torch.cuda.CUDAGraph for model graphs: CUDAGraphWrapper
# (model runner V1, piecewise and full), CudaGraphManager (model runner V2), the breakable
# piecewise capture and the micro-batch wrapper.
VLLM_CAPTURE_MODULES = (
    "vllm.compilation.cuda_graph",
    "vllm.v1.worker.gpu.cudagraph_utils",
    "vllm.compilation.breakable_cudagraph",
    "vllm.v1.worker.gpu_ubatch_wrapper",
)


# Graph states that replay the self-dispatching anchors: they run every built-in op, never a
# user kernel (those run only from spliced nodes).
_ANCHORS_ONLY = ("fallback", "disabled")


def _replay_own(g) -> None:
    import torch

    g._xmix.launch_own(torch.cuda.current_stream().cuda_stream)


def _custom_not_run(g) -> None:
    """A graph replaying its anchors (patching off, a refused patch) cannot run user kernels:
    the step's requests that use an app with one at a site of this graph fail, saying so,
    rather than get an answer without it."""
    from xmix.runtime import ops

    cb = ops.get_control()
    if cb is None or not cb.step.any_active:
        return
    custom = cb.mem.site_custom
    if not custom:
        return
    for site in g._xmix_sites & custom.keys():
        hit = sorted(
            {so.inst.index for _, so in custom[site] if (cb.step.active >> so.inst.index) & 1}
        )
        if not hit:
            continue
        count("custom_not_run")
        why = (
            "its user kernel cannot run in this CUDA graph, which replays its anchors "
            f"({'XMIX_GRAPH_PATCH=0' if g._xmix_state == 'disabled' else g._xmix_refused or 'its patch was refused, see the log'})"
        )
        cb.sites.site_failed(site, [(index, why) for index in hit])


def _make_graph_class(base: type) -> type:
    class XmixCUDAGraph(base):  # type: ignore[misc, valid-type]
        """A torch.cuda.CUDAGraph that keeps its cudaGraph_t (keep_graph=True, whatever the
        caller asks) and patches it at the end of capture."""

        def __new__(cls, keep_graph: bool = True, *args, **kwargs):
            return super().__new__(cls, True)

        def __init__(self, keep_graph: bool = True, *args, **kwargs):
            super().__init__(True)
            self._xmix = None
            self._xmix_state = "new"
            self._xmix_anchors = 0
            self._xmix_counted = True
            self._xmix_expected = -1
            self._xmix_cb = None
            self._xmix_check_due = False
            self._xmix_check_apps = 0
            self._xmix_refused = None
            self._xmix_own_exec = 0
            self._xmix_sites: set[int] = set()

        def capture_begin(self, *args, **kwargs):
            begin_capture(self)
            try:
                return super().capture_begin(*args, **kwargs)
            except BaseException:
                end_capture(self)
                raise

        def capture_end(self):
            try:
                super().capture_end()
            finally:
                end_capture(self)
            after_capture(self)

        def instantiate(self):
            super().instantiate()
            bind(self)

        def replay(self):
            if self._xmix_own_exec:
                _replay_own(self)
            elif self._xmix_check_due:
                replay(self, super().replay)
            else:
                super().replay()
            if self._xmix_state in _ANCHORS_ONLY and self._xmix_sites:
                _custom_not_run(self)

        def reset(self):
            with lock:
                registry.discard(self)
            self._xmix = None  # destroys the applier's own executable graph, if any
            self._xmix_own_exec = 0
            self._xmix_check_due = False
            return super().reset()

        @property
        def xmix_state(self) -> str:
            """new | plain | patched | fallback | disabled"""
            return self._xmix_state

        def xmix_ir(self):
            """The patched graph as IR (None when xmix does not manage it)."""
            return self._xmix.read() if self._xmix is not None else None

    return XmixCUDAGraph


def graph_class() -> type | None:
    """The keep-graph CUDAGraph subclass, or None where graphs cannot be patched."""
    if state.graph_cls is None:
        why = cuda_patching_available()
        if why is not None:
            logger.info("xmix: CUDA graph patching unavailable: %s", why)
            return None
        import torch

        # Every xmix kernel loaded now, not lazily in the middle of the first capture.
        n = _C.preload_kernels()
        logger.debug("xmix: %d kernels loaded", n)
        state.graph_cls = _make_graph_class(torch.cuda.CUDAGraph)
    return state.graph_cls


class _ModuleView(types.ModuleType):
    """A stand-in for a module as seen from one importer: a few names replaced, every other
    attribute read through to the real module (and cached)."""

    def __init__(self, real: types.ModuleType, overrides: dict[str, Any]):
        super().__init__(real.__name__, real.__doc__)
        self.__dict__["_xmix_real"] = real
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__dict__["_xmix_real"], name)
        if not name.startswith("__"):
            self.__dict__[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["_xmix_real"], name, value)
        self.__dict__.pop(name, None)


def _torch_view(real_torch, graph_cls: type) -> types.ModuleType:
    cuda = _ModuleView(real_torch.cuda, {"CUDAGraph": graph_cls})
    return _ModuleView(real_torch, {"cuda": cuda})


def _redirect(module_names, graph_cls: type) -> list[str]:
    """Make `torch.cuda.CUDAGraph` mean graph_cls inside the named modules only."""
    done = []
    for name in module_names:
        if name in _installed:
            done.append(name)
            continue
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a module this vLLM does not have
            logger.debug("xmix: %s not importable (%s); not hooked", name, e)
            continue
        real = getattr(mod, "torch", None)
        if real is None or not hasattr(real, "cuda"):
            continue
        _installed[name] = real
        setattr(mod, "torch", _torch_view(real, graph_cls))  # noqa: B010 (a module's global)
        done.append(name)
    return done


_installed: dict[str, Any] = {}  # module name -> the module's original `torch`


def install_capture_hook() -> bool:
    """Make vLLM's CUDA-graph capture sites build XmixCUDAGraph. Called by the worker's
    ``load_model`` (after vLLM's ``init_device``, before the runner captures graphs), never
    from the plugin's ``register()``: that also runs in the parent process, where touching
    CUDA before vLLM forks its engine core breaks the child; idempotent. A no-op returning False where graphs cannot
    be patched (CPU, torch without keep_graph, xmix._C without CUDA) or vLLM is absent."""
    with lock:
        cls = graph_class()
        if cls is None:
            return False
        try:
            importlib.import_module("vllm")
        except ImportError:
            return False
        hooked = _redirect(VLLM_CAPTURE_MODULES, cls)
    if hooked:
        logger.info("xmix: CUDA graph capture hooked in %s", ", ".join(hooked))
    return bool(hooked)


def uninstall_capture_hook() -> None:
    with lock:
        for name, real in list(_installed.items()):
            mod = importlib.import_module(name)
            setattr(mod, "torch", real)  # noqa: B010
            del _installed[name]
