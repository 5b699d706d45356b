"""xmix in vLLM's engine core: carry each step's read results from the workers to the
frontend on the request's next EngineCoreOutput.

The workers put a step's results on the ModelRunnerOutput (rank 0 only). The scheduler keeps
them per request until it emits an output for that request (partial prefill chunks emit
none), then rides them under the key ``RESULTS_KEY`` ("_xmix_results") of that output's
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
third-party connector that did would be logged and left alone. They stay arrays (``ReadResult``) all the way: on
the output each read is packed as raw bytes with its dtype and shape
(``results_codec.pack_results``), which vLLM's msgpack encoder carries as binary, where a bare
numpy array in an untyped field would not survive decoding.
"""

from __future__ import annotations

import logging

from xmix.results_codec import pack_results

from . import fence
from .frontend import RESULTS_KEY
from .worker import RESULTS_ATTR, merge_results

logger = logging.getLogger("vllm.xmix")


def patch_scheduler(cls) -> None:
    if fence.applied(cls, "update_from_output", "engine_core"):
        return
    orig_update = fence.current(cls, "update_from_output")
    orig_finish = fence.current(cls, "finish_requests")

    def update_from_output(self, scheduler_output, model_runner_output):
        store: dict = self.__dict__.setdefault("_xmix_results", {})
        new = getattr(model_runner_output, RESULTS_ATTR, None)
        if new:
            for rid, apps in new.items():
                merge_results(store.setdefault(rid, {}), apps)
        outs = orig_update(self, scheduler_output, model_runner_output)
        if store:
            for eco_batch in outs.values():
                for o in eco_batch.outputs:
                    res = store.pop(o.request_id, None)
                    if res:
                        kvp = o.kv_transfer_params
                        if kvp and RESULTS_KEY in kvp:
                            logger.error(
                                "xmix: the KV connector's kv_transfer_params use the key "
                                "%r; request %s's read results are dropped",
                                RESULTS_KEY,
                                o.request_id,
                            )
                            continue
                        o.kv_transfer_params = {**(kvp or {}), RESULTS_KEY: pack_results(res)}
            for rid in scheduler_output.finished_req_ids:
                store.pop(rid, None)
        return outs

    def finish_requests(self, request_ids, finished_status):
        store = self.__dict__.get("_xmix_results")
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
