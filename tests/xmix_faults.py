"""Fault injection for the engine tests: a vLLM worker extension (``worker_extension_cls``)
whose method, reached by ``llm.collective_rpc``, makes the worker's xmix admission fail for
requests whose id starts with a prefix. Test code only: it is loaded by the test engine's
worker processes and never by xmix itself."""

from __future__ import annotations


class AdmissionFaults:
    def xmix_test_fail_admission(self, prefix: str | None) -> None:
        slots = self.model_runner._xmix.cb.slots
        slots.__dict__.pop("admit_pinned", None)
        if prefix is None:
            return
        real = slots.admit_pinned

        def failing(req_id, *args, **kwargs):
            if req_id.startswith(prefix):
                raise RuntimeError("injected admission fault")
            return real(req_id, *args, **kwargs)

        slots.admit_pinned = failing
