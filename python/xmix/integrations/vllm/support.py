"""Engine configurations xmix refuses at start, because with them apps would act on the wrong
rows, silently not run, or lose their results. Each entry says what vLLM does (0.32) that
xmix's per-step maps do not follow; the worker calls ``check`` where xmix attaches
(``worker.patch_load_model``), so the engine does not start and the message says why.

Everything checked is in the VllmConfig every worker receives, so no check needs the
frontend. Several API servers (``--api-server-count``) and data parallelism are served: the
registry follows the engines' ledger (ledger.py) and control changes fan out to every engine
(engine_rpc.fan_out); docs/serving.md, "Scale-out".
"""

from __future__ import annotations

from typing import Any


class UnsupportedConfig(ValueError):
    """The engine's configuration cannot serve xmix apps correctly; the message lists why."""


def problems(vllm_config: Any) -> list[str]:
    """What in ``vllm_config`` xmix cannot serve correctly (empty: supported)."""
    out: list[str] = []
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and (getattr(spec, "num_speculative_tokens", None) or 0) > 0:
        out.append(
            f"speculative decoding ({getattr(spec, 'method', '?')}, --speculative-config): a step's "
            "scheduled tokens include draft tokens the verifier may reject, so reads would "
            "report rejected positions and writes, latches and spans would act on them"
        )
    par = getattr(vllm_config, "parallel_config", None)
    if par is not None:
        if getattr(par, "enable_dbo", False) or (getattr(par, "ubatch_size", 0) or 0) > 1:
            out.append(
                "dual-batch overlap / micro-batching (--enable-dbo, ubatch_size): the model "
                "runs on micro-batch slices (v1/worker/gpu/model_runner.py: ubatch_runner, "
                "gpu_ubatch_wrapper.py) whose rows xmix's sites would index from the step's "
                "first token"
            )
        if (getattr(par, "prefill_context_parallel_size", 1) or 1) > 1:
            out.append(
                "prefill context parallelism (--prefill-context-parallel-size > 1): each rank "
                "runs a reordered share of the prompt tokens (v1/worker/gpu/pcp_manager.py), not "
                "the scheduler's batch order the step maps are built from"
            )
        pp = getattr(par, "pipeline_parallel_size", 1) or 1
        tp = getattr(par, "tensor_parallel_size", 1) or 1
        if pp > 1 and tp > 1:
            out.append(
                f"pipeline parallel ({pp} stages) together with tensor parallel ({tp} ranks): "
                "vLLM splits each tensor a stage sends across its TP ranks (isend_tensor_dict's "
                "all_gather_group), and the reads xmix sends on from a stage exist on its first "
                "TP rank only; use one of the two (docs/serving.md, Pipeline parallel)"
            )
    model = getattr(vllm_config, "model_config", None)
    if model is not None and getattr(model, "enable_prompt_embeds", False):
        out.append(
            "prompt embeddings (--enable-prompt-embeds): model runner V1 then calls the model "
            "with input_ids=None (v1/worker/gpu_model_runner.py: _preprocess), so token "
            "conditions, spans and the step maps cannot be built and apps would silently not run"
        )
    # A KV connector (--kv-transfer-config) is served: results ride a private key the connector
    # never sees (engine_core.py), and the requests whose prompt state an externally loaded KV
    # would bypass are refused or recompute their prompt at admission (admission.admit:
    # _kv_connector_rules; docs/serving.md "KV connectors").
    return out


def check(vllm_config: Any) -> None:
    """Raise UnsupportedConfig naming every problem, or return."""
    found = problems(vllm_config)
    if found:
        raise UnsupportedConfig(
            "xmix cannot serve this engine configuration correctly:\n  - "
            + "\n  - ".join(found)
            + "\nStart the engine without these options, or with the xmix plugin off."
        )
