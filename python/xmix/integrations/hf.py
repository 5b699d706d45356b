"""Run xmix apps on a transformers model through PyTorch hooks: the research path and the
oracle for the serving integration.

    attachment = attach(model, [app], tokenizer=tok)
    ids, reads = attachment.generate(prompt_ids, max_new_tokens=8, apps=["guarded_steer"])

    with attachment.session(apps=["guarded_steer"]) as s:    # transformers' own calls
        out = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=8)
        model(input_ids)                                      # plain forwards too
    s.results[i]                                              # reads of row i
    attachment.detach()

Where the hooks go comes from the model family's site table (``xmix.lang.architectures``, the
same table the vLLM integration reads); a family without an entry is refused.

Only ``xmix.lang.lowering`` (validation, per-layer fp32 artifacts, resolved token sets, op order)
and ``xmix.lang.reference`` (the math of every primitive) are shared with the engine. Conditions,
token flags, spans, latches, request parameters and result reporting are implemented again
here, in plain Python, from their documented semantics (xmix.lang.conditions, xmix.lang.reference,
csrc/include/xmix/control.h), so that a disagreement between this module and the engine
points at a bug instead of being reproduced by both.

Semantics in short (one request at a time, batch size 1):

- Sites, in forward order inside decoder layer l: residual.pre (the layer's input),
  attention.post (what attention adds to the stream), residual.mid (the stream between
  attention and MLP), router.logits (MoE router logits before softmax / top-k), mlp.post
  (what the MLP / MoE block adds), residual.post (the layer's output); then final.post
  (output of the final norm). Which module and tensor each is, per family: the site table
  and docs/models.md. The stream at a site is the tensor HF holds there; writes change it in
  place so that every later use sees the change.
- Inside a session, each row of a batch is one request: its tokens are the positions its
  attention mask keeps (left or right padding), the first forward without a KV cache holds
  the prompts, every later forward's tokens are generated tokens fed back.
- At one site: apps in attachment order, then ops in declaration order; user (custom)
  kernels of a site run after its built-in ops, as in the engine (on a GPU they are separate
  launches after the site's anchor kernel).
- Token flags per position p of a request with prompt length P: prompt (p < P), generated
  (p >= P), last_token (its logits are sampled: the last prompt token and every generated
  token fed back), token_in(set), in_span(open, close) (opener inclusive, closer exclusive,
  state carried across forward passes), all.
- A read that did not run on a token has no value there (NaN); a gate on it is false.
- Latches are decided at the last prompt token (for ops at later sites than the read, in
  that same forward) and held for every generated token; false before. Ops at the read's
  site or before it see the latch from the first generated token.
- ``since(cond)`` holds from the first position where ``cond`` held (at the site deciding it:
  the site of the last read ``cond`` names) to the end of the request; ops using it are at
  later sites, so within a pass they see it from that token on.
- A stop (``App.stop``) ends the request at the first position where its condition holds: the
  pass that saw it is the last, and its sampled token is dropped (``generate`` returns the
  tokens before; a trigger in the prompt returns none). Results carry ``"!stopped"``
  ({app, read, position, value}) and ``"!switched"`` (one {app, read, position, condition}
  per since(...) term that started to hold), the engine's ``xmix_applied.stopped`` /
  ``.switched``. In a session the stop is recorded but transformers' generate goes on.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from xmix.integrations.hf_request import (
    AttachedApp,
    Pass,
    Request,
    Rows,
    load_custom,
    resolve_params,
)
from xmix.integrations.hf_routers import ROUTERS
from xmix.lang.api import App
from xmix.lang.architectures import Tap, require_family, resolve
from xmix.lang.lowering import APP_MODES, DeployError, LoweredOp, RequestError, lower
from xmix.lang.sites import ModelShape


class Attachment:
    """xmix apps attached to one transformers model; see ``attach``."""

    def __init__(
        self, model, apps: Iterable[App], enabled: dict[str, str] | None = None, tokenizer=None
    ):
        self.model = model
        self.device = next(model.parameters()).device
        # The model's class decides its modules (a config built in code may declare none).
        self.family = require_family(type(model).__name__, "transformers model class")
        self.shape = ModelShape.from_hf_config(model.config)
        self.attached: list[AttachedApp] = []
        self.by_name: dict[str, AttachedApp] = {}
        enabled = dict(enabled or {})
        for app in apps:
            if app.name in self.by_name:
                raise DeployError(
                    f"app {app.name!r} is attached twice; attach it under another name"
                )
            lw = lower(app, self.shape, tokenizer)
            att = AttachedApp(lw, "request")
            for op in lw.ops:
                if op.kernel == "custom":
                    att.custom_fns[id(op)] = load_custom(lw.name, op)
            self.attached.append(att)
            self.by_name[app.name] = att
        for name, mode in enabled.items():
            self.set_mode(name, mode)
        # The requests of the forward pass under way, each with its rows in the site tensors:
        # set by Request._forward (its own passes) or by an open session (transformers' calls).
        self._own: list[tuple[Pass, Rows]] | None = None
        self._session: Session | None = None
        self._warned = False
        self._detached = False
        self._handles: list = []
        self._patched: list[tuple[torch.nn.Module, Any]] = []
        self._site_ops = self._order_sites()
        try:
            self._install()
        except Exception:
            self.detach()  # nothing half-attached
            raise

    # -- control ---------------------------------------------------------------------------
    def set_mode(self, name: str, mode: str) -> None:
        if name not in self.by_name:
            raise DeployError(f"app {name!r} is not attached; attached: {sorted(self.by_name)}")
        if mode not in APP_MODES:
            raise DeployError(f"app {name!r}: mode must be one of {list(APP_MODES)}, got {mode!r}")
        self.by_name[name].mode = mode

    def _order_sites(self) -> dict[int, list[tuple[AttachedApp, LoweredOp]]]:
        built_in: dict[int, list] = {}
        custom: dict[int, list] = {}
        for att in self.attached:
            for op in att.lowered.ops:  # sorted by (site_id, op_index)
                (custom if op.kernel == "custom" else built_in).setdefault(op.site_id, []).append(
                    (att, op)
                )
        return {s: built_in.get(s, []) + custom.get(s, []) for s in set(built_in) | set(custom)}

    def _run_site(self, sid: int, tensor: torch.Tensor) -> None:
        active = (
            self._own
            if self._own is not None
            else (self._session.current if self._session is not None else None)
        )
        if active is None:
            # The model called outside a request or session: the apps do not run. Said once,
            # so that a forgotten session is not a silent no-op.
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "xmix: this model has apps attached, but it ran outside "
                    "attachment.session(...) / attachment.generate(...): the apps did not "
                    "run (this warning is given once per attachment)",
                    stacklevel=3,
                )
            return
        with torch.no_grad():
            for step, rows in active:
                view = rows.take(tensor)
                for att, op in self._site_ops.get(sid, ()):
                    step.run_op(att, op, view)
                rows.put(tensor, view)

    # -- hooks -----------------------------------------------------------------------------
    def _install(self) -> None:
        emap = self.family.hf
        layers = resolve(self.model, emap.layers)
        norm = resolve(self.model, emap.final_norm)
        L = self.shape.n_layers
        if layers is None or norm is None or len(layers) != L:
            raise TypeError(
                f"xmix.integrations.hf: {type(self.model).__name__} does not have the "
                f"{self.family.title} layout ({emap.layers} with {L} layers, {emap.final_norm})"
            )
        wanted = set(self._site_ops)
        for sid in sorted(wanted):
            name = site_id_name(sid, L)
            if name == "final.post":
                self._handles.append(norm.register_forward_hook(self._out_hook(sid)))
                continue
            layer_idx, site = name
            tap = emap.sites.get(site)
            if tap is None:
                raise DeployError(f"{self.family.title} has no {site} site")
            mod = resolve(layers[layer_idx], tap.module)
            if mod is None:
                raise TypeError(
                    f"xmix.integrations.hf: decoder layer {layer_idx} has no "
                    f"{tap.module!r} ({self.family.title} site table, {site})"
                )
            if tap.router:
                self._patch_router(mod, sid, layer_idx, tap)
            elif tap.io == "in":
                self._handles.append(
                    mod.register_forward_pre_hook(self._pre_hook(sid, tap), with_kwargs=True)
                )
            else:
                self._handles.append(mod.register_forward_hook(self._out_hook(sid)))

    def _pre_hook(self, sid: int, tap: Tap):
        pos, name = tap.arg

        def hook(module, args, kwargs):
            self._run_site(sid, args[pos] if len(args) > pos else kwargs[name])
            return None

        return hook

    def _out_hook(self, sid: int):
        def hook(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            self._run_site(sid, h)
            return None

        return hook

    def _patch_router(self, gate: torch.nn.Module, sid: int, layer: int, tap: Tap) -> None:
        want, logits_of, tail = ROUTERS[tap.router]
        if type(gate).__name__ != want:
            raise TypeError(
                f"xmix.integrations.hf: router.logits at layer {layer} needs a {want} "
                f"at {tap.module}, found {type(gate).__name__}"
            )
        method = getattr(gate, "topk_method", None)
        if tap.router == "deepseek_v2" and method not in ("greedy", "group_limited_greedy"):
            raise DeployError(
                f"xmix.integrations.hf: DeepSeek-V2 router at layer {layer} uses "
                f"topk_method {method!r}; the router.logits site follows 'greedy' and "
                f"'group_limited_greedy' (transformers 5.19's)"
            )
        attachment = self

        def forward(hidden_states):
            router_logits = logits_of(gate, hidden_states)
            attachment._run_site(sid, router_logits)
            return tail(gate, router_logits)

        self._patched.append((gate, gate.__dict__.get("forward", _MISSING)))
        gate.forward = forward

    def detach(self) -> None:
        """Remove every hook and patch; the model computes exactly what it did before."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module, prev in reversed(self._patched):
            if prev is _MISSING:
                del module.forward
            else:
                module.forward = prev
        self._patched.clear()
        self._site_ops = {}
        if self._session is not None:
            self._session.close()
        self._detached = True

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- requests --------------------------------------------------------------------------
    def session(
        self, apps: list[str] | None = None, params: dict[str, dict[str, float]] | None = None
    ) -> Session:
        """A context in which transformers' own ``model.generate(...)`` and ``model(...)``
        run the apps: each row of a batch is one request using ``apps`` with ``params``
        (see ``Session``). Outside it the model runs as if nothing were attached."""
        if self._detached:
            raise RuntimeError("xmix: this attachment has been detached; attach the apps again")
        if self._session is not None:
            raise RuntimeError("xmix: a session is already open on this attachment")
        self._check(apps or [], params or {})
        for name, p in (params or {}).items():
            resolve_params(self.by_name[name], p)  # bad parameters fail here, not mid-generate
        return Session(self, list(apps or []), dict(params or {}))

    def _check(self, apps: list[str], params: dict) -> None:
        for a in apps:
            if a not in self.by_name:
                raise RequestError(f"unknown app {a!r}; attached: {sorted(self.by_name)}")
        for a in params:
            if a not in self.by_name:
                raise RequestError(
                    f"params for unknown app {a!r}; attached: {sorted(self.by_name)}"
                )

    def request(
        self,
        prompt_ids: list[int],
        apps: list[str] | None = None,
        params: dict[str, dict[str, float]] | None = None,
    ) -> Request:
        if self._detached:
            raise RuntimeError("xmix: this attachment has been detached; attach the apps again")
        apps = list(apps or [])
        params = dict(params or {})
        self._check(apps, params)
        return Request(self, prompt_ids, apps, params)

    def forward(
        self,
        prompt_ids: list[int],
        apps: list[str] | None = None,
        params: dict[str, dict[str, float]] | None = None,
        chunk: int | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """The prompt pass alone: returns (logits of the last prompt token, read results)."""
        req = self.request(prompt_ids, apps, params)
        logits = req.prefill(chunk)
        return logits, req.report()

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        apps: list[str] | None = None,
        params: dict[str, dict[str, float]] | None = None,
        stop_at_eos: bool = False,
        chunk: int | None = None,
    ) -> tuple[list[int], dict]:
        """Greedy decoding of one request with a KV cache: the prompt (in passes of ``chunk``
        tokens, all at once by default), then one pass per generated token fed back. The
        last generated token is never fed back. Returns (generated ids, read results)."""
        if max_new_tokens < 1:
            raise RequestError("max_new_tokens must be at least 1")
        req = self.request(prompt_ids, apps, params)
        eos = self.model.config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        logits = req.prefill(chunk)
        out: list[int] = []
        # A stop seen while reading a token ends the request there: the token sampled in that
        # pass is dropped (in the prompt: no token at all).
        while req.stopped is None:
            tok = int(torch.argmax(logits))
            out.append(tok)
            if len(out) >= max_new_tokens or (stop_at_eos and tok in eos):
                break
            logits = req.decode(tok)
        return out, req.report()


_MISSING = object()


def site_id_name(sid: int, n_layers: int):
    """ "final.post", or (layer, site name) of a per-layer site id."""
    from xmix.lang.sites import site_of

    layer, name = site_of(sid, n_layers)
    return name if layer is None else (layer, name)


class Session:
    """transformers' own calls with apps: ``with attachment.session(apps, params) as s:``.

    Every forward of the model inside the context is read from its arguments
    (``input_ids``, ``attention_mask``, the KV cache): a forward without a cache (or with an
    empty one) starts a new batch of requests, one per row, whose prompt is the tokens the
    row's attention mask keeps (left padding, as ``generate`` needs, or right padding); a
    forward with a cache continues them, its kept tokens being generated tokens fed back.
    Semantics per request are the engine's (flags, latches, spans, parameters), so
    ``model.generate(batch)`` gives each row what ``attachment.generate(row)`` gives.

    ``s.results[i]``: the reads of row i of the latest batch ({app: {read: {positions,
    values}}}, positions counted over the row's own tokens). Beam search and other
    strategies that reorder the KV cache rows are not followed (rows would swap requests).
    """

    def __init__(self, attachment: Attachment, apps: list[str], params: dict):
        self.attachment = attachment
        self.apps = apps
        self.params = params
        self.requests: list[Request] = []
        self.current: list[tuple[Pass, Rows]] | None = None
        self._handles: list = []

    def __enter__(self) -> Session:
        att = self.attachment
        if att._session is not None:
            raise RuntimeError("xmix: a session is already open on this attachment")
        att._session = self
        self._handles = [
            att.model.register_forward_pre_hook(self._before, with_kwargs=True),
            att.model.register_forward_hook(self._after, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.current = None
        if self.attachment._session is self:
            self.attachment._session = None

    @property
    def results(self) -> list[dict]:
        return [r.report() for r in self.requests]

    def _before(self, module, args, kwargs):
        if self.attachment._own is not None:
            return None  # attachment.generate/forward inside the session drive their own passes
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise RequestError(
                "xmix: a session needs input_ids (inputs_embeds alone carry no tokens)"
            )
        ids = ids.detach().to("cpu")
        if ids.dim() == 1:
            ids = ids[None]
        B, T = ids.shape
        mask = kwargs.get("attention_mask")
        keep = (
            torch.ones(B, T, dtype=torch.bool)
            if mask is None
            else mask.detach().to("cpu")[:, -T:].bool()
        )
        cache = kwargs.get("past_key_values")
        past = (
            int(cache.get_seq_length())
            if cache is not None and hasattr(cache, "get_seq_length")
            else 0
        )
        current = []
        if past == 0:
            self.requests = []
            for b in range(B):
                cols = [t for t in range(T) if keep[b, t]]
                req = Request(self.attachment, ids[b, cols].tolist(), self.apps, self.params)
                self.requests.append(req)
                current.append((Pass(req, req.prompt, start=0), Rows(b, cols, B, T)))
        else:
            if len(self.requests) != B:
                raise RequestError(
                    f"xmix: a forward with a KV cache of {B} rows continues a batch of "
                    f"{len(self.requests)} requests (beam search and batch changes are "
                    f"not followed)"
                )
            for b, req in enumerate(self.requests):
                cols = [t for t in range(T) if keep[b, t]]
                if cols:
                    current.append(
                        (Pass(req, ids[b, cols].tolist(), start=req.n_done), Rows(b, cols, B, T))
                    )
        self.current = current
        return None

    def _after(self, module, args, output):
        if self.current is not None:
            for step, _ in self.current:
                step.req.n_done += step.n
        self.current = None
        return None


def attach(
    model, apps: Iterable[App], enabled: dict[str, str] | None = None, tokenizer=None
) -> Attachment:
    """Lower ``apps`` for ``model`` (a transformers *ForCausalLM of a family in xmix.lang.architectures)
    and hook them in. ``enabled``: app name -> "off" | "request" | "all" (default
    "request": an app runs for the requests that list it)."""
    return Attachment(model, list(apps), enabled, tokenizer)


__all__ = ["attach", "Attachment", "Request", "RequestError"]
