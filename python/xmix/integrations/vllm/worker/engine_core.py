"""xmix in vLLM's engine core: carry each step's read results from the workers to the
frontend on the request's next EngineCoreOutput.

The workers put a step's results on the ModelRunnerOutput (rank 0 only). The scheduler keeps
them per request until it emits an output for that request (partial prefill chunks emit
none), then rides them under the key ``result_keys.CARRIER`` ("_xmix_results") of that output's
``kv_transfer_params``, which the frontend takes out again before anything else in vLLM
looks at it.

Why that dict, and why it cannot collide with a KV connector (vLLM 0.32 source):
``EngineCoreOutput`` / ``EngineCoreOutputs`` are msgspec Structs with a fixed, positional
(``array_like``) field list, decoded by a typed decoder in the frontend
(``v1/engine/core_client.py``: ``MsgpackDecoder(EngineCoreOutputs)``), so a field of xmix's
own would need two more patches (encoder and decoder types) and an attribute set on the
object is dropped on the wire; ``kv_transfer_params`` is the only free-form per-request
field of an output. A connector produces its dict once, in ``request_finished`` (the
scheduler's ``_free_request``, inside ``update_from_output``); this wrapper runs after that and
puts its key on a new dict, so the connector's keys are never changed and its own dict object
never mutated; no connector reads an output's ``kv_transfer_params`` (they read the
*request's*, ``Request.kv_transfer_params``); the frontend strips the key in
``OutputProcessor.process_outputs`` before vLLM builds the RequestOutput, so the P/D proxy
and API clients see exactly the connector's dict (or None). No connector shipped with vLLM
0.32 uses a key starting with "_xmix" (tests/engine/test_kv_connector.py scans their source); a
third-party connector that did would be logged and left alone. The results travel as bytes:
each read is packed as raw bytes with its dtype and shape
(``results_codec.pack_results``), which vLLM's msgpack encoder carries as binary, where a bare
numpy array in an untyped field would not survive decoding. The worker packs them (pickling a
step's bytes to the engine core costs a fifth of pickling its arrays and objects) and the
engine core passes them on unless two steps' results of a request meet before it emits one.

Monitors that stop a request (``App.stop``): a step's results carry the stop under
``STOPPED_KEY``. The request is finished with ``FINISHED_STOPPED`` before vLLM's own
``update_from_output`` looks at the step, through the scheduler's ``finish_requests`` (the
path vLLM takes for requests it ends itself, e.g. grammar errors), so its slot and KV blocks
are freed in this update, as for a stop token, and vLLM's loop skips it as finished: the
token sampled in the step that saw the trigger is never appended, and under async scheduling
the output of the step already under way (it was scheduled before the trigger was seen) is
dropped the same way. The request's last output (no new tokens, ``finish_reason`` STOP, its
results with the stop record, prompt logprobs of this step if any) is added here.
"""

from __future__ import annotations

import logging

from xmix.integrations.vllm import fence
from xmix.integrations.vllm.result_keys import CARRIER
from xmix.lang.results_codec import STOPPED_KEY, merge_packed

logger = logging.getLogger("vllm.xmix")


def patch_scheduler(cls) -> None:
    found = fence.to_wrap("engine_core", (cls, "update_from_output"), (cls, "finish_requests"))
    if found is None:
        return
    orig_update, orig_finish = found

    def update_from_output(self, scheduler_output, model_runner_output):
        store: dict = self.__dict__.setdefault(CARRIER, {})
        new = getattr(model_runner_output, CARRIER, None)
        stopped: list = []
        if new:
            for rid, apps in new.items():
                have = store.get(rid)
                # Packed by the worker (_attach_results). A request's results usually go out
                # with the step that made them, as they came; steps that emit no output for
                # it (prefill chunks) are merged here.
                store[rid] = apps if have is None else merge_packed(have, apps)
            stops = [rid for rid, apps in new.items() if STOPPED_KEY in apps]
            if stops:
                stopped = _stop(self, orig_finish, stops, store, model_runner_output)
        outs = orig_update(self, scheduler_output, model_runner_output)
        if stopped:
            _stopped_outputs(outs, stopped)
        if store:
            for eco_batch in outs.values():
                for o in eco_batch.outputs:
                    res = store.pop(o.request_id, None)
                    if res:
                        kvp = o.kv_transfer_params
                        if kvp and CARRIER in kvp:
                            logger.error(
                                "xmix: the KV connector's kv_transfer_params use the key "
                                "%r; request %s's read results are dropped",
                                CARRIER,
                                o.request_id,
                            )
                            continue
                        o.kv_transfer_params = {**(kvp or {}), CARRIER: res}
            for rid in scheduler_output.finished_req_ids:
                store.pop(rid, None)
        return outs

    def finish_requests(self, request_ids, finished_status):
        store = self.__dict__.get(CARRIER)
        if store:
            ids = (
                [request_ids]
                if isinstance(request_ids, str)
                else (list(store) if request_ids is None else list(request_ids))
            )
            for rid in ids:
                store.pop(rid, None)
        return orig_finish(self, request_ids, finished_status)

    fence.replace(cls, "update_from_output", update_from_output, by="engine_core")
    fence.replace(cls, "finish_requests", finish_requests, by="engine_core")


def _stop(sched, orig_finish, req_ids: list[str], store: dict, model_runner_output) -> list:
    """Finish the requests a monitor stopped in this step, before vLLM's update sees it:
    [(request, its results, its prompt logprobs of this step)]."""
    from vllm.v1.request import RequestStatus

    live = []
    for rid in req_ids:
        req = sched.requests.get(rid)
        if req is None or req.is_finished():
            continue  # finished or aborted meanwhile: nothing more is sent for it
        live.append(rid)
    if not live:
        return []
    plp = getattr(model_runner_output, "prompt_logprobs_dict", None) or {}
    kept = {rid: (store.pop(rid, None), plp.pop(rid, None)) for rid in live}
    done = orig_finish(sched, live, RequestStatus.FINISHED_STOPPED)
    return [(req, *kept[req.request_id]) for req in done]


def _stopped_outputs(outs: dict, stopped: list) -> None:
    """The last output of each stopped request, in the outputs of its client."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    for req, res, plp in stopped:
        eco = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[],
            new_prompt_logprobs_tensors=plp,
            finish_reason=req.get_finished_reason(),
            stop_reason=None,
            events=req.take_events(),
            kv_transfer_params={CARRIER: res} if res else None,
            trace_headers=req.trace_headers,
            num_nans_in_logits=req.num_nans_in_logits,
        )
        batch = outs.get(req.client_index)
        if batch is None:
            outs[req.client_index] = EngineCoreOutputs(outputs=[eco])
        else:
            batch.outputs.append(eco)
