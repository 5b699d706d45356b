"""The ``vllm.general_plugins`` entry point: vLLM calls ``register()`` in every process (the
frontend, the engine core, each worker before it loads the model), for every engine, also
for people who never use xmix. It only patches classes, once per process, so loading it
twice is harmless; and every patch passes straight through on an engine that did not ask
for xmix (``enable.requested``): no hook sites, no control block, no compile-cache key.
``XMIX_DISABLE=1`` skips even the class patches.

Every other ``XMIX_*`` variable is checked here, at each call (settings.check_environment):
vLLM calls ``register()`` from ``EngineArgs`` (``vllm serve``, ``vllm.LLM``), before any engine
process starts, and again in each engine process, so a bad value stops the start, named. The
check comes after the patches: vLLM calls the plugins once per process even when one raised,
so an engine started again in this process once the variable is fixed is still patched.
"""

from __future__ import annotations

import logging
import os
import threading

from xmix import settings

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply
_lock = threading.Lock()
_done = False


def register() -> None:
    global _done
    with _lock:
        if settings.get("XMIX_DISABLE"):
            # Not marked done: a later call without the variable (in this process) patches.
            if not _done:
                logger.info("xmix: XMIX_DISABLE=1, plugin not loaded")
            return
        if not _done:
            _patch_all()
            _done = True
    settings.check_environment()


def _patch_all() -> None:
    from vllm.outputs import RequestOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    import xmix.runtime.ops  # noqa: F401  (the torch op must exist before any model is traced)
    from xmix.integrations.vllm.frontend import processor_patches
    from xmix.integrations.vllm.worker import engine_core, worker

    worker.patch_model_runner(GPUModelRunner)
    worker.patch_load_model(GPUModelRunner)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        worker.patch_load_model(CPUModelRunner)
    except ImportError:  # a CUDA build without the CPU runner
        pass
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2

        worker.patch_model_runner_v2(GPUModelRunnerV2)
        worker.patch_load_model(GPUModelRunnerV2)
    except ImportError:  # a vLLM without model runner V2
        logger.debug("xmix: model runner V2 not found", exc_info=True)
    worker.patch_worker_base(WorkerBase)
    engine_core.patch_scheduler(Scheduler)
    processor_patches.patch_input_processor(InputProcessor)
    processor_patches.patch_output_processor(OutputProcessor, RequestState, RequestOutput)
    from vllm.entrypoints.llm import LLM

    from xmix.integrations.vllm import fence
    from xmix.integrations.vllm.frontend.offline import controller

    # llm.xmix on any offline vllm.LLM: deploy, modes, params, status
    fence.add(
        LLM,
        "xmix",
        property(controller, doc="xmix control plane (deploy, modes, params)"),
        by="plugin",
    )
    try:
        from xmix.integrations.vllm.http import openai_precheck, openai_results

        openai_precheck.patch_openai_prechecks()
        openai_results.patch_openai_results()
    except ImportError:  # vLLM without the OpenAI server extras
        logger.debug("xmix: OpenAI serving not patched", exc_info=True)
    # No CUDA here: register() also runs in the process that forks vLLM's engine core, and
    # CUDA initialised before a fork is unusable in the child. The CUDA-graph capture hook is
    # installed by each worker's load_model (worker.patch_load_model).
    logger.debug("xmix: vLLM patched in process %d", os.getpid())
