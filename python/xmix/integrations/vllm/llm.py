"""``xmix.LLM``: a ``vllm.LLM`` with xmix asked for and apps deployed; ``llm.xmix`` on any
``vllm.LLM`` that asked for xmix (``additional_config={"xmix": True}``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

from xmix import settings
from xmix.integrations.vllm import enable, fence
from xmix.integrations.vllm.frontend.controller import _load_app
from xmix.integrations.vllm.frontend.offline import controller  # noqa: F401  (kept importable from here)
from xmix.integrations.vllm.frontend.restore import log_app_kept
from xmix.integrations.vllm.plugin import register
from xmix.integrations.vllm.state_dir import StateDir, StateError
from xmix.lang.architectures import check_architecture
from xmix.lang.lowering import DeployError

logger = logging.getLogger("vllm.xmix")


@contextlib.contextmanager
def _state_dir_env(path):
    """``XMIX_STATE_DIR`` while the engine starts (its processes inherit it; the writer reads
    it at load_model) and the state is restored; the process's own value afterwards."""
    if path is None:
        yield
        return
    path = os.path.abspath(os.fspath(path))
    try:
        StateDir.check(path)  # before any engine process: a corrupt state stops here, named
    except StateError as e:
        raise StateError(
            f"{e}. To start clean, move the directory away (its apps/ keeps every app file)"
        ) from None
    with settings.overridden("XMIX_STATE_DIR", path):
        yield


@functools.cache
def llm_class():
    """``xmix.LLM``: made on first use (vLLM is imported only then), one class per process."""
    return _make_llm_class()


def _make_llm_class():
    register()  # also gives every vllm.LLM its .xmix property
    import vllm

    class LLM(vllm.LLM):
        """``vllm.LLM`` with xmix asked for (``additional_config["xmix"]``, options kept) plus
        ``apps=[App | path, ...]`` deployed at start (mode "request").

        ``xmix_state_dir=DIR`` keeps the control plane's changes in DIR and restores them at
        the next start, as ``xmix serve --xmix-state-dir`` does (state_dir.py,
        docs/serving.md "State directory"); an app of ``apps`` whose name DIR holds is not
        deployed again."""

        xmix: Any  # the Controller, a property register() gives every vllm.LLM

        def __init__(
            self,
            model: str,
            apps: list[Any] | None = None,
            xmix_state_dir: str | os.PathLike | None = None,
            **kwargs,
        ):
            kwargs["additional_config"] = enable.with_xmix(kwargs.get("additional_config"))
            fence.check()  # a vLLM xmix does not match stops here, before any engine process
            settings.check_environment()  # so does a bad XMIX_* variable, named
            check_architecture(model, **kwargs)
            with _state_dir_env(xmix_state_dir):
                super().__init__(model=model, **kwargs)
                self.xmix  # noqa: B018  (made now: the state directory is restored first)
            restored = self.__dict__.get("_xmix_restored")
            for app in apps or []:
                try:
                    self.xmix.deploy(app)
                except DeployError as e:
                    loaded = _load_app(app, True)
                    if restored is None or loaded.name not in restored["apps"]:
                        raise
                    if "already deployed" not in str(e):
                        raise
                    log_app_kept(self.xmix, loaded, str(app), restored["dir"])

    return LLM
