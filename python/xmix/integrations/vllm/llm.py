"""``xmix.LLM``: a ``vllm.LLM`` with xmix apps deployed, and ``llm.xmix`` on any vllm.LLM."""

from __future__ import annotations

from typing import Any

from .frontend import Controller
from .plugin import register


def controller(llm) -> Controller:
    """The xmix control plane of an offline ``vllm.LLM`` (made on first use)."""
    ctl = llm.__dict__.get("_xmix_controller")
    if ctl is None:
        engine = llm.llm_engine

        def rpc(method: str, args: tuple):
            return engine.collective_rpc(method, None, args, {})

        ctl = Controller(engine.input_processor, rpc)
        llm.__dict__["_xmix_controller"] = ctl
    return ctl


def _make_llm_class():
    register()  # also gives every vllm.LLM its .xmix property
    import vllm

    class LLM(vllm.LLM):
        """``vllm.LLM`` plus ``apps=[App | path, ...]`` deployed at start (mode "request")."""

        def __init__(self, model: str, apps: list[Any] | None = None, **kwargs):
            super().__init__(model=model, **kwargs)
            for app in apps or []:
                self.xmix.deploy(app)

    return LLM
