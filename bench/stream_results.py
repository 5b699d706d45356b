"""Cost of the server's stream patch (``openai_results._with_results``) per SSE chunk, before
and after issue 17's change, on a fake stream shaped like vLLM's completion stream.

``python bench/stream_results.py [--chunks 20000] [--rounds 5]``

Three streams of N chunks each (one choice, n=1): "plain" (a request without reads: no chunk
gets anything), "probe" (one scalar read per generated token: every chunk gets its reads), and
"capture" (a 64-wide vector read per token). The last chunk finishes the choice and gets the
request's provenance. "before" is main's ``_with_results`` at 8dd0db9 (each chunk that gets
something parsed with json.loads and dumped again; copied below verbatim); "after" is the
installed one. Prints chunks/s per stream and the after/before ratio (median of rounds); the
outputs of both are checked equal as JSON first."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np

from xmix.integrations.vllm.http.openai_results import APPLIED_KEY, _with_results, json_results
from xmix.integrations.vllm.result_keys import OUTPUT_ATTR
from xmix.lang.results_codec import DEFAULT_OPTIONS, ReadResult, ResultOptions


async def _before(stream, sink: list, applied: dict, n_choices: int, opts: ResultOptions):
    from xmix.integrations.vllm.worker.worker import merge_results

    async for chunk in stream:
        if isinstance(chunk, str) and chunk.startswith('data: {"error"') and applied.get("error"):
            body = json.loads(chunk[len("data: ") :])
            if isinstance(body.get("error"), dict):
                body["error"]["message"] = applied["error"]
                chunk = f"data: {json.dumps(body)}\n\n"
        elif (
            isinstance(chunk, str)
            and chunk.startswith("data: {")
            and (sink or '"finish_reason":"' in chunk)
        ):
            body = json.loads(chunk[len("data: ") :])
            choices = body.get("choices") or []
            indices = {c.get("index") for c in choices}
            mine = [r for i, r in sink if i in indices]
            touched = False
            if mine:
                sink[:] = [(i, r) for i, r in sink if i not in indices]
                merged: dict = {}
                for r in mine:
                    merge_results(merged, r)
                body[OUTPUT_ATTR] = json_results(merged, opts)
                touched = True
            done = [c.get("index") for c in choices if c.get("finish_reason")]
            prov = [applied.get((i or 0) // max(n_choices, 1)) for i in done]
            if prov and prov[0] is not None:
                body[APPLIED_KEY] = prov[0]
                touched = True
            if touched:
                chunk = f"data: {json.dumps(body, allow_nan=False)}\n\n"
        yield chunk


def _chunk(i: int, last: bool) -> str:
    # vLLM's CompletionStreamResponse.model_dump_json(exclude_unset=True), one choice
    choice = {
        "index": 0,
        "text": f" tok{i}",
        "logprobs": None,
        "finish_reason": "length" if last else None,
        "stop_reason": None,
    }
    body = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1764580000,
        "model": "tiny",
        "choices": [choice],
    }
    return "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"


APPLIED = {
    "apps": [
        {"name": "probe", "version": 3, "mode": "request", "params": {"scale": 1.0, "bias": 0.0}}
    ],
    "changed": [],
}


def _reads(kind: str, i: int) -> dict | None:
    if kind == "plain":
        return None
    if kind == "probe":
        return {"probe": {"p": ReadResult.of("scalar", [i], np.array([0.25 * i], np.float32))}}
    return {"cap": {"h": ReadResult.of("vector", [i], np.full((1, 64), 0.5, np.float32))}}


async def _drive(fn, kind: str, n: int) -> tuple[float, list[str]]:
    sink: list = []
    applied = {0: APPLIED}
    chunks = [_chunk(i, i == n - 1) for i in range(n)]
    reads = [_reads(kind, i) for i in range(n)]

    async def source():
        for i, c in enumerate(chunks):
            r = reads[i]
            if r is not None:  # what _tap appends for the output this chunk comes from
                sink.append((0, r))
            yield c

    out = []
    t0 = time.perf_counter()
    async for c in fn(source(), sink, applied, 1, DEFAULT_OPTIONS):
        out.append(c)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print(f"{'stream':8} {'before chunks/s':>16} {'after chunks/s':>15} {'after/before':>13}")
    for kind in ("plain", "probe", "capture"):
        _, ob = asyncio.run(_drive(_before, kind, 200))
        _, oa = asyncio.run(_drive(_with_results, kind, 200))
        assert [json.loads(c[6:]) for c in ob] == [json.loads(c[6:]) for c in oa], kind
        tb, ta = [], []
        for _ in range(a.rounds):  # interleaved
            tb.append(asyncio.run(_drive(_before, kind, a.chunks))[0])
            ta.append(asyncio.run(_drive(_with_results, kind, a.chunks))[0])
        b, f = a.chunks / statistics.median(tb), a.chunks / statistics.median(ta)
        print(f"{kind:8} {b:16.0f} {f:15.0f} {f / b:12.2f}x")


if __name__ == "__main__":
    main()
