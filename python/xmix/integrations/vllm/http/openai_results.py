"""Read results and provenance in vLLM's OpenAI responses: non-streaming responses carry
the request's reads under ``"xmix"`` (per choice with ``n > 1``) and ``"xmix_applied"``;
stream chunks carry the reads produced since the previous chunk of their choice, the chunk
that finishes a choice its provenance. The patches of vLLM's chat and completion response
methods (declared in fence.py)."""

from __future__ import annotations

import json
import re
from typing import Any

from xmix.integrations.vllm.request_controls import control_from_args
from xmix.integrations.vllm.result_keys import OUTPUT_ATTR
from xmix.lang.results_codec import (
    DEFAULT_OPTIONS,
    ResultOptions,
    encode_results,
    options_of_control,
)


# ---------------------------------------------------------------------- responses
def json_results(res: dict, opts: ResultOptions = DEFAULT_OPTIONS) -> dict:
    """Read results as strict JSON in the request's encoding (``results_codec.encode_results``:
    JSON numbers with non-finite values as null and counted under ``"nonfinite"``, or
    base64 arrays)."""
    return encode_results(res, opts)


def _options(request) -> ResultOptions:
    """The request's result encoding, from either form of its control (checked at admission:
    anything unreadable here means the defaults)."""
    try:
        raw = control_from_args(getattr(request, "vllm_xargs", None))
    except ValueError:
        return DEFAULT_OPTIONS
    return options_of_control(raw)


APPLIED_KEY = "xmix_applied"


def _applied_of(outputs: list) -> Any:
    """Provenance of each request of a response (one per prompt): an object, or a list."""
    got = [getattr(o, APPLIED_KEY, None) for o in outputs if o is not None]
    got = [a for a in got if a is not None]
    if not got:
        return None
    return got[0] if len(got) == 1 else got


def _results_of(outputs: list, opts: ResultOptions) -> Any:
    res = [
        json_results(getattr(o, OUTPUT_ATTR, None) or {}, opts) for o in outputs if o is not None
    ]
    if not res:
        return None
    return res[0] if len(res) == 1 else res


def _per_choice(choices: list, completions: list, opts: ResultOptions) -> bool:
    """With n > 1 every choice carries its own sequence's reads (pairs in response order);
    True when it did (the top level then carries none)."""
    if len(completions) <= 1 or len(choices) != len(completions):
        return False
    for choice, co in zip(choices, completions):
        res = getattr(co, OUTPUT_ATTR, None)
        if res:
            setattr(choice, OUTPUT_ATTR, json_results(res, opts))
    return True


def _choice_monitors(choices: list, completions: list) -> None:
    """With n > 1 each choice names its own sequence's stop and switches (``xmix_monitors``:
    the request's ``xmix_applied`` can name only one sequence's)."""
    if len(completions) <= 1 or len(choices) != len(completions):
        return
    for choice, co in zip(choices, completions):
        mon = getattr(co, "xmix_monitors", None)
        if mon:
            choice.xmix_monitors = mon


async def _tap(gen, sink: list, n_choices: int | None, applied: dict):
    """Collect (choice index, new reads) per output and each prompt's provenance;
    ``n_choices`` given: completions, whose items are (prompt index, output) and whose choice
    index is prompt * n + sequence."""
    async for item in gen:
        if n_choices is None:
            base, out, prompt = 0, item, 0
        else:
            base, out, prompt = item[0] * n_choices, item[1], item[0]
        applied[prompt] = getattr(out, APPLIED_KEY, None) or applied.get(prompt)
        if getattr(out, "xmix_error", None):
            applied["error"] = out.xmix_error
        for co in getattr(out, "outputs", None) or []:
            new = getattr(co, OUTPUT_ATTR, None)
            if new:
                sink.append((base + co.index, new))
            mon = getattr(co, "xmix_monitors", None)
            if mon:  # this sequence's stop and switches, for its finishing chunk (n > 1)
                applied.setdefault("monitors", {})[base + co.index] = mon
        yield item


_CHOICE_INDEX = re.compile(r'"choices":\[\{"index":(\d+)')


async def _with_results(stream, sink: list, applied: dict, n_choices: int, opts: ResultOptions):
    """Put the reads produced since the previous chunk of a choice into that choice's next
    data chunk (vLLM streams one choice per chunk), as the chunk's top-level "xmix" in the
    request's encoding; the chunk that finishes a choice carries its request's provenance
    as "xmix_applied".

    A chunk with nothing to add passes through as the same string. One that gets something
    is not parsed: vLLM writes ``data: {...,"choices":[{"index":N,...}]...}\n\n``
    (pydantic ``model_dump_json``, fields in declaration order), so the choice index is read
    with a pattern and the new keys are spliced in before the closing brace; a chunk of any
    other shape takes the slow path (parse, add, dump). Provenance is serialised once per
    prompt."""
    from xmix.integrations.vllm.worker.worker import merge_results

    prov_json: dict = {}
    async for chunk in stream:
        if not isinstance(chunk, str) or not chunk.startswith("data: {"):
            yield chunk
            continue
        if chunk.startswith('data: {"error"'):
            if applied.get("error"):
                # vLLM reports a failed request as "Internal server error": say what failed
                body = json.loads(chunk[len("data: ") :])
                if isinstance(body.get("error"), dict):
                    body["error"]["message"] = applied["error"]
                    chunk = f"data: {json.dumps(body)}\n\n"
            yield chunk
            continue
        finishing = '"finish_reason":"' in chunk
        if not sink and not finishing:
            yield chunk
            continue
        m = _CHOICE_INDEX.search(chunk)
        if m is not None and chunk.endswith("}\n\n") and chunk.count('"index":') == 1:
            indices = {int(m.group(1))}
            body = None
        else:  # not the one-choice shape: parse it
            body = json.loads(chunk[len("data: ") :])
            indices = {c.get("index") for c in body.get("choices") or []}
        extra: list[tuple[str, Any]] = []
        mine = [r for i, r in sink if i in indices] if sink else []
        if mine:
            sink[:] = [(i, r) for i, r in sink if i not in indices] if len(mine) < len(sink) else []
            merged: dict = mine[0] if len(mine) == 1 else {}  # encoded, never changed
            if len(mine) > 1:
                for r in mine:
                    merge_results(merged, r)
            extra.append((OUTPUT_ATTR, json_results(merged, opts)))
        if finishing:
            if body is None:
                done = list(indices)
            else:
                done = [c.get("index") for c in body.get("choices") or [] if c.get("finish_reason")]
            if done:
                prompt = (done[0] or 0) // max(n_choices, 1)
                prov = applied.get(prompt)
                if prov is not None:
                    if prompt not in prov_json:
                        prov_json[prompt] = json.dumps(prov, allow_nan=False)
                    extra.append((APPLIED_KEY, prov_json[prompt]))
                mons = applied.get("monitors")
                if n_choices > 1 and mons and done[0] in mons:
                    # with n > 1 the request's provenance names one sequence's stop: the
                    # finishing chunk of each choice names its own, as non-streamed choices do
                    extra.append(("xmix_monitors", mons.pop(done[0])))
        if not extra:
            yield chunk
            continue
        if body is None:
            parts = [chunk[:-3]]
            for k, v in extra:
                parts.append(
                    f',"{k}":' + (v if k == APPLIED_KEY else json.dumps(v, allow_nan=False))
                )
            parts.append("}\n\n")
            yield "".join(parts)
        else:
            for k, v in extra:
                body[k] = json.loads(v) if k == APPLIED_KEY else v
            yield f"data: {json.dumps(body, allow_nan=False)}\n\n"


# Routes that can carry an xmix control but whose responses xmix does not add read results


def _said(e: Exception, outputs: list) -> Exception:
    """vLLM's GenerationError for a request xmix finished with an error ("Internal server
    error") made to say what failed; any other exception unchanged."""
    msg = next((o.xmix_error for o in outputs if getattr(o, "xmix_error", None)), None)
    if msg is None or type(e).__name__ != "GenerationError":
        return e
    return type(e)(msg)


def patch_openai_results() -> None:
    """vLLM's chat and completion response methods, full and streamed, carry the reads and
    the provenance."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from xmix.integrations.vllm import fence

    found = fence.to_wrap(
        "openai_results",
        (OpenAIServingChat, "chat_completion_full_generator"),
        (OpenAIServingChat, "chat_completion_stream_generator"),
        (OpenAIServingCompletion, "request_output_to_completion_response"),
        (OpenAIServingCompletion, "completion_stream_generator"),
    )
    if found is None:
        return
    full, stream, to_resp, cstream = found

    async def chat_full(self, request, result_generator, *args, **kwargs):
        seen: list = []

        async def last(gen):
            async for out in gen:
                seen[:] = [out]
                yield out

        try:
            resp = await full(self, request, last(result_generator), *args, **kwargs)
        except Exception as e:
            raise _said(e, seen) from None
        if (
            getattr(resp, "error", None) is not None
            and seen
            and getattr(seen[0], "xmix_error", None)
        ):
            resp.error.message = seen[0].xmix_error
        opts = _options(request)
        res = _results_of(seen, opts)
        if res and hasattr(resp, "choices"):
            if not _per_choice(
                resp.choices, sorted(seen[0].outputs, key=lambda co: co.index), opts
            ):
                setattr(resp, OUTPUT_ATTR, res)
        applied = _applied_of(seen)
        if applied is not None and hasattr(resp, "choices"):
            setattr(resp, APPLIED_KEY, applied)
            if seen:
                _choice_monitors(resp.choices, sorted(seen[0].outputs, key=lambda co: co.index))
        return resp

    def chat_stream(self, request, result_generator, *args, **kwargs):
        sink: list = []
        applied: dict = {}
        return _with_results(
            stream(self, request, _tap(result_generator, sink, None, applied), *args, **kwargs),
            sink,
            applied,
            request.n or 1,
            _options(request),
        )

    def completion_response(self, final_res_batch, request, *args, **kwargs):
        try:
            resp = to_resp(self, final_res_batch, request, *args, **kwargs)
        except Exception as e:
            raise _said(e, final_res_batch) from None
        opts = _options(request)
        res = _results_of(final_res_batch, opts)
        if res:
            done = [r for r in final_res_batch if r is not None]
            if not (
                any(len(r.outputs) > 1 for r in done)
                and _per_choice(resp.choices, [co for r in done for co in r.outputs], opts)
            ):
                setattr(resp, OUTPUT_ATTR, res)
        applied = _applied_of(final_res_batch)
        if applied is not None and hasattr(resp, "choices"):
            setattr(resp, APPLIED_KEY, applied)
            done = [r for r in final_res_batch if r is not None]
            _choice_monitors(resp.choices, [co for r in done for co in r.outputs])
        return resp

    def completion_stream(self, request, engine_inputs, result_generator, *args, **kwargs):
        sink: list = []
        applied: dict = {}
        n = request.n or 1
        return _with_results(
            cstream(
                self,
                request,
                engine_inputs,
                _tap(result_generator, sink, n, applied),
                *args,
                **kwargs,
            ),
            sink,
            applied,
            n,
            _options(request),
        )

    by = "openai_results"
    fence.replace(OpenAIServingChat, "chat_completion_full_generator", chat_full, by=by)
    fence.replace(OpenAIServingChat, "chat_completion_stream_generator", chat_stream, by=by)
    fence.replace(
        OpenAIServingCompletion, "request_output_to_completion_response", completion_response, by=by
    )
    fence.replace(OpenAIServingCompletion, "completion_stream_generator", completion_stream, by=by)
