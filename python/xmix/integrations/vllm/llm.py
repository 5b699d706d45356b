"""``xmix.LLM``: a ``vllm.LLM`` with xmix asked for and apps deployed; ``llm.xmix`` on any
``vllm.LLM`` that asked for xmix (``additional_config={"xmix": True}``)."""

from __future__ import annotations

import logging
from typing import Any

from . import enable, fence
from .offline import controller  # noqa: F401  (kept importable from here)
from .plugin import register

logger = logging.getLogger("vllm.xmix")


def check_architecture(model: str, **kwargs) -> None:
    """Refuse a model family without a site table before any engine process starts (the
    workers check again: this is only the early, readable error). A config that cannot be
    read here (a format only vLLM reads) is left to the workers."""
    from xmix.architectures import architecture_of, require_family

    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(
            model,
            trust_remote_code=bool(kwargs.get("trust_remote_code")),
            revision=kwargs.get("revision"),
        )
    except Exception as e:  # noqa: BLE001 - any failure: the workers decide
        logger.debug("xmix: config of %s not read here (%s); the workers check it", model, e)
        return
    require_family(architecture_of(cfg), model)


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
