"""The server's stream patch (``openai_results._with_results``) on hand-made vLLM chunks, no
engine: chunks without xmix data come back as the same string; reads and provenance are spliced
into the chunk of their choice (n > 1: each choice's reads in its own chunks, each finishing
chunk with its prompt's provenance); shapes the splice does not know (several choices in a
chunk, tool-call deltas with their own "index") take the parse path with the same result; an
error chunk says what failed."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from xmix.integrations.vllm.http.openai_results import _with_results
from xmix.lang.results_codec import DEFAULT_OPTIONS, ReadResult


def _chunk(choices: list[dict]) -> str:
    body = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": choices,
    }
    return "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"


def _c(i: int, text: str, finish=None, **kw) -> dict:
    return {
        "index": i,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        **kw,
    }


def _read(pos: int, v: float) -> dict:
    return {"a": {"p": ReadResult.of("scalar", [pos], np.array([v], np.float32))}}


def _run(items, applied, n):
    """items: (chunk, reads to append to the sink before it, as (choice, reads) pairs)."""
    sink: list = []

    async def src():
        for chunk, new in items:
            sink.extend(new)
            yield chunk

    async def go():
        return [c async for c in _with_results(src(), sink, applied, n, DEFAULT_OPTIONS)]

    return asyncio.run(go())


PROV0 = {"apps": [{"name": "a", "version": 1, "mode": "request", "params": {}}], "changed": []}
PROV1 = {"apps": [], "changed": ["a"]}


def test_n2_reads_and_provenance_per_choice():
    plain = _chunk([_c(1, " x")])
    items = [
        (_chunk([_c(0, " a")]), [(0, _read(3, 0.5))]),
        (plain, []),  # nothing for choice 1 yet: passes through
        (_chunk([_c(1, " b")]), [(1, _read(3, 1.5)), (0, _read(4, 0.25))]),
        (_chunk([_c(0, " c", "length")]), []),
        (_chunk([_c(3, " d", "stop")]), []),  # prompt 1 of a 2-prompt, n=2 completion
        ("data: [DONE]\n\n", []),
    ]
    out = _run(items, {0: PROV0, 1: PROV1}, 2)
    assert out[1] is plain and out[5] == "data: [DONE]\n\n"
    got = [json.loads(c[6:]) for c in out[:5]]
    assert got[0]["xmix"] == {"a": {"p": {"positions": [3], "values": [0.5]}}}
    assert "xmix_applied" not in got[0]
    assert got[2]["xmix"] == {"a": {"p": {"positions": [3], "values": [1.5]}}}
    # choice 0's later read waited for choice 0's next chunk, which also finishes it
    assert got[3]["xmix"] == {"a": {"p": {"positions": [4], "values": [0.25]}}}
    assert got[3]["xmix_applied"] == PROV0
    assert got[4]["xmix_applied"] == PROV1 and "xmix" not in got[4]
    assert got[3]["choices"] == [_c(0, " c", "length")]  # vLLM's own fields unchanged


def test_unknown_shapes_take_the_parse_path():
    two = _chunk([_c(0, " a"), _c(1, " b", "stop")])
    tool = _chunk([_c(0, "", "tool_calls", delta={"tool_calls": [{"index": 0, "id": "t"}]})])
    out = _run([(two, [(0, _read(1, 2.0)), (1, _read(1, 3.0))]), (tool, [])], {0: PROV0}, 2)
    a, b = json.loads(out[0][6:]), json.loads(out[1][6:])
    assert a["xmix"] == {"a": {"p": {"positions": [1, 1], "values": [2.0, 3.0]}}}
    assert a["xmix_applied"] == PROV0
    assert b["xmix_applied"] == PROV0 and b["choices"][0]["delta"]["tool_calls"][0]["index"] == 0


def test_error_chunk_says_what_failed():
    err = 'data: {"error":{"message":"Internal server error","type":"InternalServerError","code":500}}\n\n'
    out = _run([(err, [(0, _read(0, 1.0))])], {"error": "xmix: kernel failed"}, 1)
    assert json.loads(out[0][6:])["error"]["message"] == "xmix: kernel failed"
    assert _run([(err, [])], {}, 1)[0] is err
