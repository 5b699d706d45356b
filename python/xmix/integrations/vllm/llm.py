"""``xmix.LLM``: a ``vllm.LLM`` with xmix asked for and apps deployed; ``llm.xmix`` on any
``vllm.LLM`` that asked for xmix (``additional_config={"xmix": True}``)."""

from __future__ import annotations

import logging
from typing import Any

from xmix.architectures import check_architecture

from . import enable, fence
from .offline import controller  # noqa: F401  (kept importable from here)
from .plugin import register

logger = logging.getLogger("vllm.xmix")


def _make_llm_class():
    register()  # also gives every vllm.LLM its .xmix property
    import vllm

    class LLM(vllm.LLM):
        """``vllm.LLM`` with xmix asked for (``additional_config["xmix"]``, options kept) plus
        ``apps=[App | path, ...]`` deployed at start (mode "request")."""

        def __init__(self, model: str, apps: list[Any] | None = None, **kwargs):
            kwargs["additional_config"] = enable.with_xmix(kwargs.get("additional_config"))
            fence.check()  # a vLLM xmix does not match stops here, before any engine process
            check_architecture(model, **kwargs)
            super().__init__(model=model, **kwargs)
            for app in apps or []:
                self.xmix.deploy(app)

    return LLM
