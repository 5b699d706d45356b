"""vLLM's RequestOutputCollector merges a request's outputs when the consumer (the OpenAI
server's stream) falls behind the engine: the finishing output is added into an earlier one
(``RequestOutput.add``). Provenance (``xmix_applied``) and a worker's error come only with
the output that finishes, so the merged output must carry them, or the response loses them
(seen in the CI soak on a loaded machine: "no xmix_applied in the response"). The collector
and RequestOutput here are vLLM's own, patched as in a server."""

from __future__ import annotations

import asyncio

import pytest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.output_processor import RequestOutputCollector

from xmix.integrations.vllm import plugin

PROV = {"apps": [{"name": "steer", "version": 3, "how": "request"}], "changed": []}


def _out(index: int, tokens: list[int], finish: str | None, **attrs) -> RequestOutput:
    co = CompletionOutput(
        index=index,
        text="x" * len(tokens),
        token_ids=list(tokens),
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=finish,
    )
    out = RequestOutput(
        request_id="r1",
        prompt="p",
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=[co],
        finished=finish is not None,
    )
    for k, v in attrs.items():
        setattr(out, k, v)
    return out


def _collect(kind: RequestOutputKind, outputs: list[RequestOutput]) -> RequestOutput:
    col = RequestOutputCollector(kind, "r1")
    for o in outputs:
        col.put(o)  # nobody reads in between: the consumer is behind
    return asyncio.run(col.get())


@pytest.fixture(scope="module", autouse=True)
def patched():
    plugin.register()


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_merged_finishing_output_keeps_its_provenance(kind):
    got = _collect(
        kind,
        [_out(0, [5], None), _out(0, [6], None), _out(0, [7], "length", xmix_applied=PROV)],
    )
    assert got.finished
    assert got.xmix_applied == PROV
    if kind == RequestOutputKind.DELTA:  # vLLM's own merge still ran
        assert list(got.outputs[0].token_ids) == [5, 6, 7]


def test_a_merged_output_keeps_the_error_of_the_worker():
    got = _collect(
        RequestOutputKind.DELTA,
        [_out(0, [5], None), _out(0, [], "error", xmix_applied=PROV, xmix_error="sae: nan")],
    )
    assert (got.xmix_error, got.xmix_applied) == ("sae: nan", PROV)


def test_n_2_one_choice_finishing_in_a_merge():
    """n = 2: outputs of both sequences merge into one; the provenance of the one finishing
    stays, an earlier output without provenance does not erase it."""
    got = _collect(
        RequestOutputKind.DELTA,
        [
            _out(0, [5], None),
            _out(1, [8], "length", xmix_applied=PROV),
            _out(0, [6], None),
        ],
    )
    assert got.xmix_applied == PROV
    assert {c.index: list(c.token_ids) for c in got.outputs} == {0: [5, 6], 1: [8]}


def test_without_xmix_nothing_is_added():
    got = _collect(RequestOutputKind.DELTA, [_out(0, [5], None), _out(0, [6], "length")])
    assert not hasattr(got, "xmix_applied") and not hasattr(got, "xmix_error")
