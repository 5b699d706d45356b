"""``llm.xmix`` on an offline ``vllm.LLM``: its xmix control plane. Its own module so that
the plugin (which adds the property) and ``llm.py`` (which imports the plugin) do not import
each other."""

from __future__ import annotations

from xmix.integrations.vllm import enable
from xmix.integrations.vllm.frontend import restore
from xmix.integrations.vllm.frontend.controller import Controller


def controller(llm) -> Controller:
    """The xmix control plane of an offline ``vllm.LLM`` (made on first use)."""
    ctl = llm.__dict__.get("_xmix_controller")
    if ctl is None:
        engine = llm.llm_engine
        if not enable.requested(engine.vllm_config):
            raise RuntimeError(
                "xmix is not enabled on this engine: use xmix.LLM, or pass "
                "additional_config={'xmix': True} to vllm.LLM (or set XMIX_ENABLE=1 "
                "before it starts)"
            )

        def rpc(method: str, args: tuple):
            return engine.collective_rpc(method, None, args, {})

        ctl = Controller(engine.input_processor, rpc)
        ctl.sync()
        # A state directory (XMIX_STATE_DIR; xmix.LLM(xmix_state_dir=...)): its apps first.
        llm.__dict__["_xmix_restored"] = restore.restore(ctl)
        llm.__dict__["_xmix_controller"] = ctl
    return ctl
