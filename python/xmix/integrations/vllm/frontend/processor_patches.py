"""xmix's patches of vLLM's frontend processors (LLM / AsyncLLM), declared in fence.PATCHES:
``InputProcessor.process_inputs`` admits each request's xmix control (admission.py) and sets
its cache salt; ``OutputProcessor`` / ``RequestState`` / ``RequestOutput`` attach read results
and provenance to the outputs.

Results come back per step inside ``EngineCoreOutput.kv_transfer_params[CARRIER]``
(``CARRIER``; set by the engine core, engine_core.py, as packed arrays, on a copy of a KV
connector's dict that keeps its keys; engine_core.py says why that channel and why it cannot
collide with a connector); ``OutputProcessor.process_outputs`` takes them out before vLLM sees
them (the dict left is exactly the connector's, or None) and attaches them as ``.xmix``
({app: {read: ReadResult}}) to each sequence's ``CompletionOutput`` and to the
``RequestOutput`` (the reads of its first sequence). A request a worker could not serve
carries an error marker there instead; it is finished with ``finish_reason="error"``.
"""

from __future__ import annotations

import logging

from xmix.integrations.vllm import fence
from xmix.integrations.vllm.errors import _validation_error
from xmix.integrations.vllm.frontend import admission
from xmix.integrations.vllm.frontend.registry import Registry, registered
from xmix.integrations.vllm.request_controls import CONTROL_KEY, control_from_args
from xmix.integrations.vllm.result_keys import CARRIER, OUTPUT_ATTR
from xmix.lang.results_codec import (
    DROPPED_KEY,
    STOPPED_KEY,
    SWITCHED_KEY,
    TRUNCATED_KEY,
    copy_results,
    unpack_results,
)

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply


def _prompt_len(req) -> int:
    ids = getattr(req, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    emb = getattr(req, "prompt_embeds", None)
    return len(emb) if emb is not None else 0


def patch_input_processor(cls) -> None:
    found = fence.to_wrap("processor_patches", (cls, "process_inputs"))
    if found is None:
        return
    (orig,) = found

    def process_inputs(self, *args, **kwargs):
        req = orig(self, *args, **kwargs)
        reg: Registry | None = getattr(self, "_xmix_registry", None)
        sp = getattr(req, "sampling_params", None)
        if sp is None:
            if reg is not None and getattr(req, "cache_salt", None) is not None:
                req.cache_salt = reg.keys.cache_salt(req.cache_salt, None)  # see below
            return req
        raw = control_from_args(sp.extra_args, _validation_error)
        if reg is None:
            if raw is not None:
                raise _validation_error(
                    "this request asks for xmix apps, but xmix is not enabled "
                    "on this engine (use xmix.LLM / xmix serve)"
                )
            return req
        n_prompt = _prompt_len(req)
        max_tokens = sp.max_tokens
        if max_tokens is None:
            max_tokens = max(self.model_config.max_model_len - n_prompt, 0)
        adm = admission.admit(
            reg,
            raw,
            n_prompt,
            max_tokens,
            sp.n or 1,
            remote_prefill=admission.remote_prefill(
                (sp.extra_args or {}).get("kv_transfer_params")
            ),
        )
        if adm.control is not None:
            # A new dict on the request's own copy: the caller's SamplingParams stays as given.
            sp.extra_args = {**(sp.extra_args or {}), CONTROL_KEY: adm.control}
        # Every salt on an xmix engine goes through the keyed MAC, the client's own too, so
        # no client can send the salt of another configuration (keyed.py).
        req.cache_salt = admission.cache_salt(reg, req.cache_salt, adm)
        if adm.skip_cache:
            sp.skip_reading_prefix_cache = True
        return req

    fence.replace(cls, "process_inputs", process_inputs, by="processor_patches")


def patch_output_processor(out_cls, state_cls, request_output_cls) -> None:
    """Results live on each CompletionOutput (``.xmix``: one sequence's reads, so ``n > 1``
    keeps its sequences apart) and on the RequestOutput (``.xmix``: those of ``outputs[0]``,
    the only sequence when ``n == 1``). One replacement per patched method, each made from
    vLLM's own by the function of the same name below.

    ``RequestState.make_request_output`` and ``_new_completion_output`` run per token of every
    request; xmix's layer is needed only by a request whose results, error or monitors came
    back, and by any admitted request's finishing output (its provenance). So they are armed
    per request state (``fence.per_instance``): when the first result, error or monitor
    arrives, when an engine output finishes the request, when it is aborted, and from the
    start for a request with stop strings (the output processor finishes those itself)."""
    found = fence.to_wrap(
        "processor_patches",
        (out_cls, "process_outputs"),
        (state_cls, "make_request_output"),
        (state_cls, "_new_completion_output"),
        (request_output_cls, "add"),
        (state_cls, "from_new_request"),
        (out_cls, "abort_requests"),
    )
    if found is None:
        return
    orig_process, orig_make, orig_new_completion, orig_add, from_new, orig_abort = found
    by = "processor_patches"
    global _Armed
    _Armed = fence.per_instance(
        state_cls,
        {
            "make_request_output": _make_request_output(orig_make),
            "_new_completion_output": _new_completion_output(orig_new_completion),
        },
        by=by,
    )
    fence.replace(out_cls, "process_outputs", _process_outputs(orig_process), by=by)
    fence.replace(
        state_cls,
        "from_new_request",
        classmethod(_from_new_request(from_new.__func__)),
        by=by,
    )
    fence.replace(request_output_cls, "add", _add(orig_add), by=by)
    fence.replace(out_cls, "abort_requests", _abort_requests(orig_abort), by=by)


# RequestState with xmix's two per-token wrappers (fence.per_instance), made when the patch
# is applied; a state moves into it when it first needs them (``_arm``)
_Armed: type | None = None


def _arm(st) -> None:
    assert _Armed is not None  # made by the patch that installs every caller of this
    fence.arm(st, _Armed)


def _arm_if_admitted(st) -> None:
    """A state that is finishing (or may be): its final output carries the provenance if
    xmix admitted the request; a state xmix did not admit keeps vLLM's own methods."""
    if st is not None and "_xmix_applied" in st.__dict__:
        _arm(st)


def _from_new_request(orig_from_new):
    """RequestState.from_new_request: the state keeps what admission applied (provenance)."""

    def from_new_request(cls, tokenizer, request, *args, **kwargs):
        st = orig_from_new(cls, tokenizer, request, *args, **kwargs)
        sp = getattr(request, "sampling_params", None)
        ctl = (getattr(sp, "extra_args", None) or {}).get(CONTROL_KEY) if sp is not None else None
        if isinstance(ctl, dict) and "applied" in ctl:
            st.__dict__["_xmix_applied"] = ctl["applied"]
            if sp.stop:  # a stop string finishes it in this process, unseen by the engine
                _arm(st)
        return st

    return from_new_request


def _process_outputs(orig_process):
    """OutputProcessor.process_outputs: each engine core output's results taken out of its
    kv_transfer_params before vLLM sees them (``_take_engine_results``); requests a worker
    could not serve are finished with an error and aborted."""

    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        failed: list[str] = []
        for eco in engine_core_outputs:
            # the carrier's check inline: most outputs carry no results, and a call per
            # output per token is the API server's largest cost of xmix (bench/api_calls.py)
            kvp = eco.kv_transfer_params
            if kvp and CARRIER in kvp:
                _take_engine_results(self, eco, failed)
            if eco.finish_reason is not None:
                _arm_if_admitted(self.request_states.get(eco.request_id))
        out = orig_process(self, engine_core_outputs, *args, **kwargs)
        if failed:
            out.reqs_to_abort.extend(r for r in failed if r not in out.reqs_to_abort)
        return out

    return process_outputs


def _abort_requests(orig_abort):
    """OutputProcessor.abort_requests: an aborted request's final output carries its
    provenance like any finishing one (ids internal or external, as vLLM takes them)."""

    def abort_requests(self, request_ids, *args, **kwargs):
        states = self.request_states
        for rid in request_ids:
            # an id is a state's own or a client's, which names all of its states; a
            # parent's children are aborted through this method again
            for iid in (rid, *self.external_req_ids.get(rid, ())):
                _arm_if_admitted(states.get(iid))
        return orig_abort(self, request_ids, *args, **kwargs)

    return abort_requests


def _take_engine_results(processor, eco, failed: list[str]) -> None:
    """One EngineCoreOutput whose kv_transfer_params hold the carrier (the caller checks):
    its results, monitors, dropped versions and a worker's error onto the request's state
    (``failed`` gets the request if the error finishes it)."""
    kvp = eco.kv_transfer_params
    from vllm.v1.engine import FinishReason

    from xmix.integrations.vllm.worker.worker import ERROR_KEY, merge_results

    kvp = dict(kvp)
    res = unpack_results(kvp.pop(CARRIER) or {})
    eco.kv_transfer_params = kvp or None
    err = res.pop(ERROR_KEY, None)
    dropped = res.pop(DROPPED_KEY, None)
    stopped = res.pop(STOPPED_KEY, None)
    switched = res.pop(SWITCHED_KEY, None)
    st = processor.request_states.get(eco.request_id)
    if st is None:
        return
    if stopped is not None or switched:
        # monitors: named in the request's provenance when it finishes
        _arm(st)
        mon = st.__dict__.setdefault("_xmix_monitors", {})
        if stopped is not None:
            mon.setdefault("stopped", stopped)
        if switched:
            mon.setdefault("switched", []).extend(switched)
    applied = st.__dict__.get("_xmix_applied")
    if dropped and applied is not None:
        # the engine no longer held the version admitted (a change through another
        # API server this one had not seen yet): named under "changed"
        st.__dict__["_xmix_applied"] = {
            **applied,
            "_dropped": sorted(set(applied.get("_dropped", ())) | set(dropped)),
        }
    if not res and err is None:
        return
    st.__dict__["_xmix_seen"] = True
    _arm(st)
    if TRUNCATED_KEY in res:
        _count_truncated(st)
    if res:
        have = st.__dict__.get("_xmix_new")
        if have is None:
            st.__dict__["_xmix_new"] = res  # decoded here: moved, not copied
        else:
            merge_results(have, res)
    if err is not None:
        # A worker could not serve this request: it ends here with an error (the
        # OpenAI server answers 500 / an error event); the engine core drops it.
        logger.warning("xmix: request %s finished with an error: %s", eco.request_id, err)
        st.__dict__["_xmix_error"] = str(err)
        if eco.finish_reason is None:
            failed.append(eco.request_id)
        eco.finish_reason = FinishReason.ERROR


def _take_results(state) -> dict:
    # Results since the last output (DELTA) or all so far; steps that produced no output
    # (FINAL_ONLY, stream_interval) keep accumulating in _xmix_new until one does.
    from vllm.sampling_params import RequestOutputKind

    from xmix.integrations.vllm.worker.worker import merge_results

    new = state.__dict__.pop("_xmix_new", None)
    if state.output_kind == RequestOutputKind.DELTA:
        return new or {}
    acc = state.__dict__.setdefault("_xmix_all", {})
    if new:
        merge_results(acc, new)
    return copy_results(acc)


# Only requests that ever carried reads get an ``.xmix`` attribute: outputs of an engine
# without xmix (or of a request without reads) are vLLM's objects untouched, and
# ``xmix.results`` reads a missing attribute as {}.
def _new_completion_output(orig_new_completion):
    def _new_completion_output(self, *args, **kwargs):
        co = orig_new_completion(self, *args, **kwargs)
        if self.__dict__.get("_xmix_seen"):
            co.xmix = _take_results(self)
        mon = self.__dict__.get("_xmix_monitors")
        if mon and co.finish_reason is not None:
            # this sequence's stop and switches (with n > 1 each choice has its own)
            co.xmix_monitors = mon
        return co

    return _new_completion_output


def _make_request_output(orig_make):
    def make_request_output(self, *args, **kwargs):
        out = orig_make(self, *args, **kwargs)
        if out is None:
            return out
        # Provenance is set at admission, so a request xmix admitted carries it even when no
        # result ever came back (no apps, or apps without reads). It is built when this
        # state's sequence finishes, once (its ``changed`` covers the whole run); outputs
        # before that carry none (the server sends it in the chunk that finishes a choice).
        applied = self.__dict__.get("_xmix_applied")
        done = False
        if applied is not None:
            # a loop, not any(<genexpr>): this runs for every token of a request with reads,
            # and a generator is two more Python frames per token (bench/api_calls.py)
            done = getattr(out, "finished", False)
            if not done:
                for c in getattr(out, "outputs", None) or ():
                    if getattr(c, "finish_reason", None) is not None:
                        done = True
                        break
        if done:
            prov = self.__dict__.get("_xmix_prov")
            if prov is None:
                prov = self.__dict__["_xmix_prov"] = {
                    **provenance(applied),
                    **self.__dict__.get("_xmix_monitors", {}),
                }
            out.xmix_applied = prov
        if not self.__dict__.get("_xmix_seen"):
            return out
        err = self.__dict__.get("_xmix_error")
        if err is not None:
            out.xmix_error = err
        outs = getattr(out, "outputs", None)
        if isinstance(outs, list) and outs:
            out.xmix = getattr(outs[0], OUTPUT_ATTR, None) or {}
        else:  # pooling output: one per request
            out.xmix = _take_results(self)
        return out

    return make_request_output


def _add(orig_add):
    def add(self, next_output, aggregate: bool) -> None:
        from xmix.integrations.vllm.worker.worker import merge_results

        before = {c.index: c for c in self.outputs} if aggregate else {}
        orig_add(self, next_output, aggregate)
        for nc in next_output.outputs:
            c = before.get(nc.index)
            nxt = getattr(nc, OUTPUT_ATTR, None)
            if c is not None and c is not nc and nxt:  # vLLM merged nc into c in place
                c.xmix = merge_results(getattr(c, OUTPUT_ATTR, None) or {}, nxt)
        if self.outputs and hasattr(self.outputs[0], OUTPUT_ATTR):
            self.xmix = getattr(self.outputs[0], OUTPUT_ATTR, None) or {}
        # When the consumer falls behind, vLLM's RequestOutputCollector merges the finishing
        # output into an earlier one: provenance and a worker's error come only with the
        # output that finishes, so they move over with it or the response loses them.
        for key in ("xmix_applied", "xmix_error"):
            val = getattr(next_output, key, None)
            if val is not None:
                setattr(self, key, val)

    return add


def provenance(applied: dict) -> dict:
    """What was applied to a request (``xmix_applied``): each app with its deployment version,
    how it applied ("request": named by it; "all": the deployment's mode) and the parameter
    values it ran with at admission, its tenant under a policy, and ``changed``: the apps
    whose mode, parameters or deployment changed while it ran (they took effect at a step
    boundary; docs/serving.md) or that came to apply to it."""
    out = {k: v for k, v in applied.items() if not k.startswith("_")}
    reg = registered(applied.get("_reg"))
    changed = set(reg.changed_since(applied)) if reg is not None else set()
    out["changed"] = sorted(changed | set(applied.get("_dropped", ())))
    return out


def _count_truncated(state) -> None:
    """One sequence cut at its byte cap, counted on the registry that admitted it."""
    reg = registered((state.__dict__.get("_xmix_applied") or {}).get("_reg"))
    if reg is not None:
        reg.count("results_truncated")
