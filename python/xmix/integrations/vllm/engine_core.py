"""xmix in vLLM's engine core: carry each step's read results from the workers to the
frontend on the request's next EngineCoreOutput.

The workers put a step's results on the ModelRunnerOutput (rank 0 only). The scheduler keeps
them per request until it emits an output for that request (partial prefill chunks emit
none), then rides them in ``kv_transfer_params["xmix"]``, which the frontend takes out again
before anything else in vLLM looks at it. They stay arrays (``ReadResult``) all the way: on
the output each read is packed as raw bytes with its dtype and shape
(``results_codec.pack_results``), which vLLM's msgpack encoder carries as binary, where a bare
numpy array in an untyped field would not survive decoding.
"""

from __future__ import annotations

from xmix.results_codec import pack_results

from . import fence
from .frontend import XMIX_KEY
from .worker import RESULTS_ATTR, merge_results


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
                        o.kv_transfer_params = {**(o.kv_transfer_params or {}), XMIX_KEY: pack_results(res)}
            for rid in scheduler_output.finished_req_ids:
                store.pop(rid, None)
        return outs

    def finish_requests(self, request_ids, finished_status):
        store = self.__dict__.get("_xmix_results")
        if store:
            ids = [request_ids] if isinstance(request_ids, str) else (
                list(store) if request_ids is None else list(request_ids))
            for rid in ids:
                store.pop(rid, None)
        return orig_finish(self, request_ids, finished_status)

    fence.replace(cls, "update_from_output", update_from_output, by="engine_core")
    fence.replace(cls, "finish_requests", finish_requests, by="engine_core")
