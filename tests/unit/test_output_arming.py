"""vLLM's own OutputProcessor, patched as in a server, fed engine-core outputs by hand:
xmix's per-token layer of ``RequestState`` (``make_request_output`` /
``_new_completion_output``) runs only for a request that needs it, and every way a request
can finish still gives its finishing output the provenance (issue 29: a class-wide wrapper
cost every token of every request a Python call in the API server, bench/api_calls.py).

Expected values are written out: the provenance of a request admitted with no app is
``{"apps": [], "changed": []}``; a read's values are the ones packed into the carrier."""

from __future__ import annotations

import numpy as np
import pytest
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import (
    OutputProcessor,
    RequestOutputCollector,
    RequestState,
)

from xmix.integrations.vllm import plugin
from xmix.integrations.vllm.result_keys import CARRIER
from xmix.lang.results_codec import ReadResult, pack_results
from xmix.models.tiny import tiny_model_path

NO_APP = {"apps": [], "changed": []}


@pytest.fixture(scope="module")
def tok():
    from vllm.tokenizers.registry import get_tokenizer

    plugin.register()
    return get_tokenizer(str(tiny_model_path("tiny-llama")))


def _request(rid: str, xmix: bool = True, **sp) -> EngineCoreRequest:
    extra = {"xmix": {"applied": {"apps": []}}} if xmix else None
    params = SamplingParams(
        max_tokens=8, output_kind=RequestOutputKind.DELTA, extra_args=extra, **sp
    )
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=f"ext-{rid}",
    )


def _step(op, rid: str, token: int, **eco) -> list:
    return op.process_outputs([EngineCoreOutput(request_id=rid, new_token_ids=[token], **eco)])


def test_a_request_without_results_runs_vllms_own_state_until_it_finishes(tok):
    op = OutputProcessor(tok, log_stats=False)
    op.add_request(_request("a"), None)
    op.add_request(_request("plain", xmix=False), None)
    st, plain = op.request_states["a"], op.request_states["plain"]
    for t in (5, 6, 7):
        (out,) = _step(op, "a", t).request_outputs
        assert type(st) is RequestState  # no xmix layer on its tokens
        assert not hasattr(out, "xmix_applied") and not hasattr(out.outputs[0], "xmix")
    (out,) = _step(op, "a", 8, finish_reason=FinishReason.LENGTH).request_outputs
    assert out.finished and out.xmix_applied == NO_APP
    # a request xmix did not admit never gets the layer, finishing or not
    _step(op, "plain", 5)
    (out,) = _step(op, "plain", 6, finish_reason=FinishReason.LENGTH).request_outputs
    assert type(plain) is RequestState and not hasattr(out, "xmix_applied")


def test_a_stop_string_finishes_in_the_frontend_with_the_provenance(tok):
    op = OutputProcessor(tok, log_stats=False)
    stop = tok.decode([6])
    op.add_request(_request("s", stop=[stop]), None)
    (first,) = _step(op, "s", 5).request_outputs
    assert first.outputs[0].finish_reason is None and not hasattr(first, "xmix_applied")
    # the engine does not know the stop string: its output does not finish the request
    (out,) = _step(op, "s", 6).request_outputs
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.xmix_applied == NO_APP


def test_an_aborted_request_gets_the_provenance_in_its_final_output(tok):
    op = OutputProcessor(tok, log_stats=False)
    q = RequestOutputCollector(RequestOutputKind.DELTA, "ext-c")
    op.add_request(_request("c"), None, queue=q)
    _step(op, "c", 5)
    q.get_nowait()
    op.abort_requests(["ext-c"], internal=False)  # by the client's id, as AsyncLLM.abort
    out = q.get_nowait()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.xmix_applied == NO_APP
    # by the engine's own id, as a cancelled stream aborts it
    q2 = RequestOutputCollector(RequestOutputKind.DELTA, "ext-d")
    op.add_request(_request("d"), None, queue=q2)
    op.abort_requests(["d"], internal=True)
    out = q2.get_nowait()
    assert out.finished and out.xmix_applied == NO_APP


def test_results_ride_every_output_once_the_first_arrives(tok):
    op = OutputProcessor(tok, log_stats=False)
    op.add_request(_request("r"), None)
    (out,) = _step(op, "r", 5).request_outputs
    assert not hasattr(out.outputs[0], "xmix")
    packed = pack_results(
        {"probe": {"p": ReadResult.of("scalar", [3], np.array([0.25], dtype=np.float32))}}
    )
    (out,) = _step(op, "r", 6, kv_transfer_params={CARRIER: packed}).request_outputs
    got = out.outputs[0].xmix["probe"]["p"]
    assert list(got["positions"]) == [3] and list(got["values"]) == [0.25]
    assert out.xmix is out.outputs[0].xmix
    # no new reads in this step: an empty delta, still an attribute
    (out,) = _step(op, "r", 7).request_outputs
    assert out.outputs[0].xmix == {} and not hasattr(out, "xmix_applied")
    (out,) = _step(op, "r", 8, finish_reason=FinishReason.LENGTH).request_outputs
    assert out.xmix_applied == NO_APP and out.outputs[0].xmix == {}
