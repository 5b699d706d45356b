"""xmix's admission of a request on vLLM's OpenAI routes, run once its prompts are rendered
and before any generator exists, so a refusal is an HTTP 4xx before a stream starts; and
the catch-up with the engines' ledger for a request naming an app this API server does not
know yet. The patches of vLLM's render methods (declared in fence.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from xmix.integrations.vllm import tenants
from xmix.integrations.vllm.errors import _validation_error
from xmix.integrations.vllm.frontend import admission
from xmix.integrations.vllm.request_controls import control_from_args
from xmix.lang.results_codec import max_response_bytes

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply


# to (their formats have no place for them): a request naming an app that reads is refused
# there, rather than computing reads nobody receives.
RESULT_ROUTES = "/v1/completions or /v1/chat/completions"


def _precheck(serving, request, engine_inputs, max_tokens_field: str, route: str | None = None):
    """The xmix admission of a request, run once its prompts are rendered and before any
    generator exists: a refusal is an HTTP 4xx before a stream starts (vLLM admits requests
    lazily, inside the stream, where a refusal could only be an error event after an
    HTTP 200). The engine's own admission still runs and decides. ``route``: a route whose
    responses carry no read results (named in the refusal of apps that read)."""
    reg = getattr(getattr(serving.engine_client, "input_processor", None), "_xmix_registry", None)
    if reg is None or not isinstance(engine_inputs, list):
        return None
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    asked = getattr(request, max_tokens_field, None)
    if asked is None:
        asked = getattr(request, "max_tokens", None)
    prompts = []
    for ei in engine_inputs:
        n_prompt = serving._extract_prompt_len(ei)
        try:
            max_tokens = get_max_tokens(
                serving.model_config.max_model_len,
                asked,
                n_prompt,
                serving.default_sampling_params,
                serving.override_max_tokens,
                truncate_prompt_tokens=getattr(request, "truncate_prompt_tokens", None),
            )
        except Exception:  # vLLM refuses it itself, with its own message
            return None
        prompts.append((n_prompt, max_tokens))
    return _check_ahead(
        serving,
        reg,
        getattr(request, "vllm_xargs", None) or {},
        prompts,
        getattr(request, "n", None) or 1,
        getattr(request, "kv_transfer_params", None),
        beam=bool(getattr(request, "use_beam_search", False)),
        route=route,
    )


def _check_ahead(
    serving,
    reg,
    xargs: dict,
    prompts: list[tuple[int, int]],
    n: int,
    kv_transfer_params: Any = None,
    beam: bool = False,
    route: str | None = None,
):
    """Admit every prompt of one request ahead of vLLM (``count=False``): None when it may
    go on (the response budget and the pre-stream mark set in the request's context), else
    the error response. ``prompts``: (prompt length, max tokens) per prompt."""
    from http import HTTPStatus

    def refuse(msg: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        logger.info("xmix: request refused at admission: %s", msg)
        if status == HTTPStatus.FORBIDDEN:
            return serving.create_error_response(
                msg, err_type="PermissionDeniedError", status_code=status, param="vllm_xargs.xmix"
            )
        return serving.create_error_response(msg, param="vllm_xargs.xmix")

    try:
        raw = control_from_args(xargs, _validation_error)
    except ValueError as e:
        return refuse(str(e))
    checked_at = None
    known = 0  # bytes the reads of the whole response return over its prompts
    applied: list[str] = []
    named: list[str] = []
    for n_prompt, max_tokens in prompts:
        try:
            adm = admission.admit(
                reg,
                raw,
                n_prompt,
                max_tokens,
                n,
                count=False,
                remote_prefill=admission.remote_prefill(kv_transfer_params),
            )
        except ValueError as e:
            return refuse(
                str(e), HTTPStatus.FORBIDDEN if tenants.is_forbidden(e) else HTTPStatus.BAD_REQUEST
            )
        control = adm.control
        assert control is not None  # admit resolves a control for every request it admits
        checked_at = control["applied"]["_rev"]
        known += adm.prompt_bytes
        applied = [a["name"] for a in control["applied"]["apps"]]
        named = control.get("apps") or []
    if beam and applied:
        # vLLM's beam search sends every step as a new request of one token whose prompt is
        # the beam so far: the apps would take generated tokens for prompt tokens (conditions
        # on generated tokens, latches and spans would not hold as when sampling), their
        # reads and provenance would not come back, and the steps would not carry the
        # request's parameters. Refused rather than run differently from what was asked.
        return refuse(
            f"xmix: beam search (use_beam_search) cannot run with apps; this request would use "
            f"{', '.join(applied)}. vLLM runs each beam step as a new one-token request whose "
            "prompt is the beam so far, so the apps would see generated tokens as prompt "
            "tokens (conditions on generated tokens, latches and spans would not hold as when "
            "sampling) and return no reads or provenance: sample instead (n, temperature), or "
            "send the request without apps"
        )
    if route is not None and prompts:
        with reg.lock:
            readers = [a for a in named if a in reg.apps and reg.apps[a].lowered.reads]
        if readers:
            return refuse(
                f"xmix: app(s) {', '.join(readers)} read, and {route} responses do not carry "
                f"xmix read results: use {RESULT_ROUTES} for apps that read"
            )
    cap, source = response_cap(reg)
    if known > cap:
        reg.count("result_cap_refusals")
        return refuse(
            f"xmix: the reads of this request return {known} bytes over the prompts of its "
            f"{len(prompts)} prompt(s){f' x {n} choices' if n > 1 else ''}; one response may "
            f"carry {cap} bytes ({source}): send fewer or shorter prompts, or report fewer "
            f'positions ("positions"), fewer or narrower reads, "encoding": "base64"'
        )
    slots = max(len(prompts) * n, 1)
    admission.set_response_budget(admission.ResponseBudget(cap, (cap - known) // slots, source))
    if raw is not None and checked_at is not None:
        admission.mark_prechecked(checked_at)
    return None


def response_cap(reg) -> tuple[int, str]:
    """The cap on the read results of one response for the caller of the request being
    served, and where it comes from: its policy's ``max_response_bytes``, else the server's
    ``XMIX_MAX_RESPONSE_BYTES``."""
    caller = tenants.current()
    t = caller.tenant if caller is not None else (reg.policy.default if reg.policy else None)
    if t is not None and t.max_response_bytes is not None:
        return t.max_response_bytes, f"max_response_bytes of tenant {t.name!r} in the policy"
    return max_response_bytes(), "XMIX_MAX_RESPONSE_BYTES"


def _named_apps(raw: Any) -> list[str]:
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError, UnicodeDecodeError):
            return []
    apps = raw.get("apps") if isinstance(raw, dict) else None
    return [a for a in apps if isinstance(a, str)] if isinstance(apps, list) else []


async def _catch_up(serving, request) -> None:
    """A request naming an app this API server does not know yet (deployed through another
    server since its last sync) first brings the registry up to the engines' ledger, so a
    deploy anywhere is usable everywhere as soon as its answer returned."""
    reg = getattr(getattr(serving.engine_client, "input_processor", None), "_xmix_registry", None)
    if reg is None or reg.sync is None:
        return
    if reg.stale():  # not heard from the ledger for seconds: catch up before admitting
        try:
            await asyncio.to_thread(reg.sync)
        except Exception:
            logger.warning("xmix: following the engines' ledger failed", exc_info=True)
        return
    try:
        raw = control_from_args(getattr(request, "vllm_xargs", None) or {})
    except ValueError:
        return  # refused with its message by the check that follows
    if any(a not in reg.apps for a in _named_apps(raw)):
        try:
            await asyncio.to_thread(reg.sync)
        except Exception:
            logger.warning("xmix: following the engines' ledger failed", exc_info=True)


def patch_openai_prechecks() -> None:
    """vLLM's chat and completion render methods run xmix's admission once the prompts are
    rendered (``_precheck``); the other routes that take an xmix control too
    (``_patch_other_routes``)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from xmix.integrations.vllm import fence

    found = fence.to_wrap(
        "openai_precheck",
        (OpenAIServingChat, "render_chat_request"),
        (OpenAIServingCompletion, "render_completion_request"),
    )
    if found is None:
        return
    render_chat, render_cmpl = found

    no_results = _routes_without_results()

    async def render_chat_request(self, request, *args, **kwargs):
        await _catch_up(self, request)
        result = await render_chat(self, request, *args, **kwargs)
        if isinstance(result, tuple) and len(result) == 2:
            refused = _precheck(
                self,
                request,
                result[1],
                "max_completion_tokens",
                route=next((r for c, r in no_results if isinstance(self, c)), None),
            )
            if refused is not None:
                return refused
        return result

    async def render_completion_request(self, request, *args, **kwargs):
        await _catch_up(self, request)
        result = await render_cmpl(self, request, *args, **kwargs)
        if isinstance(result, list):
            refused = _precheck(self, request, result, "max_tokens")
            if refused is not None:
                return refused
        return result

    by = "openai_precheck"
    fence.replace(OpenAIServingChat, "render_chat_request", render_chat_request, by=by)
    fence.replace(
        OpenAIServingCompletion, "render_completion_request", render_completion_request, by=by
    )
    _patch_other_routes()


def _routes_without_results() -> list[tuple[type, str]]:
    """Subclasses of vLLM's chat serving whose responses carry no xmix read results."""
    try:
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    except ImportError:  # pragma: no cover - a vLLM without the Messages API
        return []
    return [(AnthropicServingMessages, "/v1/messages")]


def _patch_other_routes() -> None:
    """The other routes of vLLM 0.32 that take an xmix control (``vllm_xargs``, or
    ``sampling_params.extra_args`` on the tokens route) get the same check before any
    generator exists, so a refusal is an HTTP error before a stream starts: /v1/responses,
    /v1/chat/completions/batch, /inference/v1/generate (``--enable-scale-out`` /
    ``--tokens-only``). /v1/messages goes through the chat route's check, /invocations through
    the completions and chat routes. Their responses have no place for read results: apps
    that read are refused there, naming the routes that return them."""
    _patch_responses()
    _patch_chat_batch()
    _patch_tokens()


def _patch_responses() -> None:
    """/v1/responses."""
    from xmix.integrations.vllm import fence

    try:
        from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    except ImportError:  # pragma: no cover
        return
    render_resp = fence.current(OpenAIServingResponses, "_render_resolved_response_inputs")

    async def render_responses(self, request, *args, **kwargs):
        await _catch_up(self, request)
        result = await render_resp(self, request, *args, **kwargs)
        ei = getattr(result, "engine_input", None)
        if ei is not None:
            refused = _precheck(self, request, [ei], "max_output_tokens", "/v1/responses")
            if refused is not None:
                return refused
        return result

    fence.replace(
        OpenAIServingResponses,
        "_render_resolved_response_inputs",
        render_responses,
        by="openai_precheck",
    )


def _patch_chat_batch() -> None:
    """/v1/chat/completions/batch."""
    from xmix.integrations.vllm import fence

    try:
        from vllm.entrypoints.openai.chat_completion.batch_serving import (
            OpenAIServingChatBatch,
        )
    except ImportError:  # pragma: no cover
        return
    render_batch = fence.current(OpenAIServingChatBatch, "render_batch_chat_request")

    async def render_batch_chat_request(self, request, *args, **kwargs):
        await _catch_up(self, request)
        result = await render_batch(self, request, *args, **kwargs)
        if isinstance(result, tuple) and len(result) == 3:
            refused = _precheck(
                self, request, result[2], "max_completion_tokens", "/v1/chat/completions/batch"
            )
            if refused is not None:
                return refused
        return result

    fence.replace(
        OpenAIServingChatBatch,
        "render_batch_chat_request",
        render_batch_chat_request,
        by="openai_precheck",
    )


def _patch_tokens() -> None:
    """/inference/v1/generate (the tokens route)."""
    from xmix.integrations.vllm import fence

    try:
        from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
    except ImportError:  # pragma: no cover
        return
    serve_tokens = fence.current(ServingTokens, "serve_tokens")

    async def serve_tokens_checked(self, request, *args, **kwargs):
        reg = getattr(getattr(self.engine_client, "input_processor", None), "_xmix_registry", None)
        sp = getattr(request, "sampling_params", None)
        ids = getattr(request, "token_ids", None)
        if reg is not None and sp is not None and isinstance(ids, list):
            n_prompt = len(ids)
            max_tokens = (
                sp.max_tokens
                if request.is_sampling_param_provided("max_tokens")
                else max(self.model_config.max_model_len - n_prompt, 0)
            )
            refused = _check_ahead(
                self,
                reg,
                sp.extra_args or {},
                [(n_prompt, max_tokens or 0)],
                sp.n or 1,
                getattr(request, "kv_transfer_params", None),
                route="/inference/v1/generate",
            )
            if refused is not None:
                return refused
        return await serve_tokens(self, request, *args, **kwargs)

    fence.replace(ServingTokens, "serve_tokens", serve_tokens_checked, by="openai_precheck")
