"""Run xmix apps on a transformers model through PyTorch hooks: the research path and the
oracle for the serving integration.

    attachment = attach(model, [app], tokenizer=tok)
    ids, reads = attachment.generate(prompt_ids, max_new_tokens=8, apps=["guarded_steer"])

    with attachment.session(apps=["guarded_steer"]) as s:    # transformers' own calls
        out = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=8)
        model(input_ids)                                      # plain forwards too
    s.results[i]                                              # reads of row i
    attachment.detach()

Where the hooks go comes from the model family's site table (``xmix.architectures``, the
same table the vLLM integration reads); a family without an entry is refused.

Only ``xmix.lowering`` (validation, per-layer fp32 artifacts, resolved token sets, op order)
and ``xmix.reference`` (the math of every primitive) are shared with the engine. Conditions,
token flags, spans, latches, request parameters and result reporting are implemented again
here, in plain Python, from their documented semantics (xmix.conditions, xmix.reference,
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

import copy
import ctypes
import math
import struct
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from xmix import conditions as C
from xmix import reference as R
from xmix.api import App
from xmix.architectures import Tap, require_family, resolve
from xmix.catalog import FLT_MAX, KERNELS
from xmix.hooks import ModelShape
from xmix.lowering import (
    APP_MODES,
    DeployError,
    LoweredApp,
    LoweredOp,
    RequestError,
    latch_from_generated,
    lower,
)

NAN = float("nan")

# Routers whose forward this module reproduces around the hook (site table name -> module
# class and the router's forward from its logits on). transformers computes a router's logits,
# scores and top-k in one forward; the site sits right after the logits. Each tail below is
# the rest of that class's forward in transformers 5.19, line for line.


def _mixtral_tail(gate, router_logits):
    router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, gate.top_k, dim=-1)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def _qwen3_moe_tail(gate, router_logits):
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, gate.top_k, dim=-1)
    if gate.norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    return router_logits, router_top_value, router_indices


def _deepseek_v2_tail(gate, router_logits):
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if gate.topk_method == "greedy":
        topk_weights, topk_indices = torch.topk(scores, k=gate.top_k, dim=-1, sorted=False)
    else:  # "group_limited_greedy" (_patch_router refuses any other method at attach)
        group_scores = (
            scores.view(-1, gate.num_group, gate.num_experts // gate.num_group).max(dim=-1).values
        )
        group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, gate.num_group, gate.num_experts // gate.num_group)
            .reshape(-1, gate.num_experts)
        )
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
        topk_weights, topk_indices = torch.topk(scores, k=gate.top_k, dim=-1, sorted=False)
    topk_weights = topk_weights * gate.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _gpt_oss_tail(gate, router_logits):
    router_top_value, router_indices = torch.topk(router_logits, gate.top_k, dim=-1)
    router_scores = torch.nn.functional.softmax(
        router_top_value, dim=1, dtype=router_top_value.dtype
    )
    return router_logits, router_scores, router_indices


def _linear_logits(gate, hidden_states):
    return F.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)


def _deepseek_v2_logits(gate, hidden_states):
    hidden_states = hidden_states.view(-1, gate.hidden_dim)
    return F.linear(hidden_states.type(torch.float32), gate.weight.type(torch.float32))


def _gpt_oss_logits(gate, hidden_states):
    return F.linear(hidden_states, gate.weight, gate.bias)


_ROUTERS = {
    "mixtral": ("MixtralTopKRouter", _linear_logits, _mixtral_tail),
    "qwen3_moe": ("Qwen3MoeTopKRouter", _linear_logits, _qwen3_moe_tail),
    "deepseek_v2": ("DeepseekV2TopkRouter", _deepseek_v2_logits, _deepseek_v2_tail),
    "gpt_oss": ("GptOssTopKRouter", _gpt_oss_logits, _gpt_oss_tail),
}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _f32(x: float) -> float:
    # The engine keeps thresholds and parameters as fp32; comparing against the fp32-rounded
    # value keeps a read that lands exactly on a threshold on the same side in both.
    return struct.unpack("f", struct.pack("f", x))[0]


# ------------------------------------------------------------------------------ user kernels
class _CustomArgs(ctypes.Structure):
    """``xmix_custom_args`` of csrc/include/xmix/custom.h (the public ABI of user kernels)."""

    _fields_ = [
        ("h", ctypes.c_void_p),
        ("r", ctypes.c_void_p),
        ("stride_h", ctypes.c_int64),
        ("stride_r", ctypes.c_int64),
        ("n_rows", ctypes.c_int32),
        ("d", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("n_params", ctypes.c_int32),
        ("select", ctypes.c_void_p),
        ("tok_slot", ctypes.c_void_p),
        ("tok_pos", ctypes.c_void_p),
        ("slot_params", ctypes.c_void_p),
        ("param_base", ctypes.c_int32),
        ("artifact_numel", ctypes.c_int32),
        ("artifact", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
    ]


def _load_custom(app: str, op: LoweredOp):
    ck = op.custom
    if not ck or not ck.cpu_library or not ck.cpu_symbol:
        raise DeployError(
            f"app {app!r}, op {op.label}: the transformers path runs user kernels on "
            f"the CPU and needs cpu_library and cpu_symbol"
        )
    try:
        lib = ctypes.CDLL(str(ck.cpu_library))
        fn = getattr(lib, ck.cpu_symbol)
    except (OSError, AttributeError) as e:
        raise DeployError(
            f"app {app!r}, op {op.label}: cannot load {ck.cpu_symbol!r} from "
            f"{ck.cpu_library!r}: {e}"
        ) from None
    fn.argtypes = [ctypes.POINTER(_CustomArgs)]
    fn.restype = None
    return fn


# ------------------------------------------------------------------------------ apps, requests
@dataclass
class _Attached:
    lowered: LoweredApp
    mode: str
    custom_fns: dict[int, Any] = field(default_factory=dict)  # id(LoweredOp) -> ctypes fn

    @property
    def name(self) -> str:
        return self.lowered.name


def _op_key(op: LoweredOp) -> str:
    # How "op.param" names an op in request parameters: its .named() name, else "#index".
    return op.name or f"#{op.op_index}"


def _param_range(op: LoweredOp, pname: str) -> tuple[float, float]:
    spec = KERNELS[op.kernel].params.get(pname)
    return (spec.lo, spec.hi) if spec else (-FLT_MAX, FLT_MAX)


def _resolve_params(
    att: _Attached, given: Any
) -> tuple[dict[str, float], dict[tuple[int, str], float]]:
    """Request parameters of one app -> (app-level values, {(op_index, param): value}).

    A bare name is the app-level parameter of that name if there is one, else every op
    parameter of that name; "op.param" names one op (by its name, or "#index")."""
    lw = att.lowered
    who = f"app {lw.name!r}"
    if not isinstance(given, dict):
        raise RequestError(f"{who}: params must be a dict of name: number")
    app_vals: dict[str, float] = {}
    op_vals: dict[tuple[int, str], float] = {}
    for key, v in given.items():
        if not isinstance(key, str):
            raise RequestError(f"{who}: parameter names must be strings, got {key!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise RequestError(f"{who}: parameter {key!r} must be a finite number, got {v!r}")
        v = float(v)
        targets: list[LoweredOp] = []
        if "." in key:
            opname, pname = key.rsplit(".", 1)
            targets = [o for o in lw.ops if _op_key(o) == opname and pname in dict(o.params)]
        elif key in lw.app_params:
            app_vals[key] = v
            continue
        else:
            pname = key
            targets = [o for o in lw.ops if pname in dict(o.params)]
        if not targets:
            raise RequestError(f"{who}: unknown parameter {key!r}")
        for o in targets:
            lo, hi = _param_range(o, pname)
            if not lo <= v <= hi:
                raise RequestError(f"{who}: parameter {key!r}={v} out of range [{lo}, {hi}]")
            op_vals[(o.op_index, pname)] = v
    return app_vals, op_vals


class Request:
    """One request through an attachment: the prompt, its KV cache and its per-request state
    (apps used, parameters, span state, latched read statistics, CAST sums, read results).

    Drive it with ``prefill()`` then ``decode(token)`` per generated token, or use
    ``Attachment.generate``."""

    def __init__(
        self,
        attachment: Attachment,
        prompt_ids: list[int],
        apps: list[str],
        params: dict[str, dict[str, float]],
    ):
        self.attachment = attachment
        self.prompt = [int(t) for t in prompt_ids]
        if not self.prompt:
            raise RequestError("the prompt is empty")
        self.apps = list(apps)
        self.n_done = 0  # positions processed so far
        self.cache = None  # its own KV cache (made on the first pass)
        self.app_params: dict[str, dict[str, float]] = {}
        self.op_params: dict[str, dict[tuple[int, str], float]] = {}
        for att in attachment.attached:
            self.app_params[att.name] = dict(att.lowered.app_params)
            self.op_params[att.name] = {}
        for name, p in params.items():
            av, ov = _resolve_params(attachment.by_name[name], p)
            self.app_params[name].update(av)
            self.op_params[name].update(ov)
        self.spans: dict[tuple[str, str, str], bool] = {}  # (app, open, close) -> inside
        # (app, read key) -> [sum, count, value at the last prompt token] over prompt tokens
        self.read_stats: dict[tuple[str, str], list[float]] = {}
        self.cast_sums: dict[tuple[str, str], list] = {}  # (app, key) -> [sum (fp64), count]
        self.results: dict[str, dict[str, dict[str, list]]] = {}
        # (app, since(...) text) -> the first position where its condition held
        self.sticky: dict[tuple[str, str], int] = {}
        self.stopped: dict[str, Any] | None = None  # {app, read, position, value}
        self.switched: list[dict[str, Any]] = []  # {app, read, position, condition}

    def report(self) -> dict:
        """The results so far, with the stop and the switches under "!stopped"/"!switched"."""
        out: dict[str, Any] = copy.deepcopy(self.results)
        if self.stopped is not None:
            out["!stopped"] = dict(self.stopped)
        if self.switched:
            out["!switched"] = [dict(x) for x in self.switched]
        return out

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def uses(self, att: _Attached) -> bool:
        return att.mode == "all" or (att.mode == "request" and att.name in self.apps)

    def param(self, att: _Attached, op: LoweredOp, pname: str) -> float:
        default = dict(op.params)[pname]
        return self.op_params[att.name].get((op.op_index, pname), default)

    def prefill(self, chunk: int | None = None) -> torch.Tensor:
        """Run the rest of the prompt, in forward passes of ``chunk`` tokens (all at once by
        default); returns the logits of the last prompt token."""
        if self.n_done >= self.prompt_len:
            raise RequestError("the prompt has been processed already")
        if chunk is not None and chunk < 1:
            raise RequestError("chunk must be at least 1")
        logits = None
        while self.n_done < self.prompt_len:
            end = self.prompt_len if chunk is None else min(self.prompt_len, self.n_done + chunk)
            logits = self._forward(self.prompt[self.n_done : end])
            if self.stopped is not None:
                break  # the request ends in this chunk: nothing more is computed
        return logits[-1]

    def decode(self, token: int) -> torch.Tensor:
        """Feed back one sampled token; returns its logits."""
        if self.n_done < self.prompt_len:
            raise RequestError("prefill the prompt first")
        return self._forward([int(token)])[-1]

    def _forward(self, ids: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        att = self.attachment
        if self.cache is None:
            self.cache = DynamicCache(config=att.model.config)
        step = _Step(self, ids, start=self.n_done)
        model = att.model
        input_ids = torch.tensor([ids], dtype=torch.long, device=att.device)
        att._own = [(step, _Rows(0, list(range(len(ids))), 1, len(ids)))]
        try:
            with torch.no_grad():
                out = model(input_ids=input_ids, past_key_values=self.cache, use_cache=True)
        finally:
            att._own = None
        self.n_done += len(ids)
        return out.logits[0].float()

    def record(self, app: str, key: str, pos: int, value: Any) -> None:
        entry = self.results.setdefault(app, {}).setdefault(key, {"positions": [], "values": []})
        entry["positions"].append(pos)
        entry["values"].append(value)


class _Step:
    """One forward pass of a request: its tokens, their flags, and the values of every read
    that ran in this pass (for per-token gates)."""

    def __init__(self, req: Request, ids: list[int], start: int):
        self.req = req
        self.ids = ids
        self.n = len(ids)
        self.pos = [start + t for t in range(self.n)]
        P = req.prompt_len
        self.prompt = [p < P for p in self.pos]
        self.generated = [p >= P for p in self.pos]
        # Logits are sampled for the last token of a pass that reaches the end of the prompt.
        sampled = start + self.n >= P
        self.last = [sampled and t == self.n - 1 for t in range(self.n)]
        self.values: dict[tuple[str, str], list[float]] = {}
        self.span_flags: dict[tuple[str, str, str], list[bool]] = {}
        # Spans are followed for every attached app, used or not, as the engine's prologue
        # does: an app switched on in the middle of a request sees the right span state.
        for att in req.attachment.attached:
            lw = att.lowered
            for open_, close in lw.spans:
                k = (att.name, open_, close)
                flags, state = R.span_flags(
                    ids,
                    set(lw.token_sets[open_]),
                    set(lw.token_sets[close]),
                    req.spans.get(k, False),
                )
                self.span_flags[k] = flags
                req.spans[k] = state

    # -- conditions ---------------------------------------------------------------------
    def threshold(self, att: _Attached, value: float | str) -> float:
        v = self.req.app_params[att.name][value] if isinstance(value, str) else value
        return _f32(float(v))

    def holds(self, att: _Attached, op: LoweredOp, node, t: int) -> bool:
        if node is None:
            return True
        if isinstance(node, C.Flag):
            return {
                "all": True,
                "prompt": self.prompt[t],
                "generated": self.generated[t],
                "last_token": self.last[t],
            }[node.name]
        if isinstance(node, C.TokenIn):
            return self.ids[t] in att.lowered.token_sets[node.set]
        if isinstance(node, C.InSpan):
            return self.span_flags[(att.name, node.open, node.close)][t]
        if isinstance(node, C.Gate):
            v = self.values.get((att.name, node.read), [NAN] * self.n)[t]
            return R.compare(v, node.cmp, self.threshold(att, node.value))
        if isinstance(node, C.Latch):
            if latch_from_generated(att.lowered, op, node):
                decided = self.generated[t]
            else:
                decided = self.generated[t] or (self.prompt[t] and self.last[t])
            if not decided:
                return False
            s = self.req.read_stats.get((att.name, node.read))
            if s is None:
                return False
            if node.reduce == "prompt_last":
                v = s[2]
            elif s[1] > 0:
                v = s[0] / s[1]
            else:
                return False
            return R.compare(v, node.cmp, self.threshold(att, node.value))
        if isinstance(node, C.Since):
            start = self.req.sticky.get((att.name, C.to_text(node)))
            return R.since_holds(self.pos[t], start)
        if isinstance(node, C.And):
            return self.holds(att, op, node.a, t) and self.holds(att, op, node.b, t)
        if isinstance(node, C.Or):
            return self.holds(att, op, node.a, t) or self.holds(att, op, node.b, t)
        if isinstance(node, C.Not):
            return not self.holds(att, op, node.a, t)
        raise TypeError(f"unknown condition node {node!r}")

    # -- ops ----------------------------------------------------------------------------
    def run_op(self, att: _Attached, op: LoweredOp, rows: torch.Tensor) -> None:
        """Run one op on this request's rows ([n tokens, d], changed in place by writes)."""
        if rows.shape[0] != self.n:
            raise RuntimeError(
                f"xmix: site {op.site} has {rows.shape[0]} rows for a pass of {self.n} tokens"
            )
        if not self.req.uses(att):
            return
        mask_list = [self.holds(att, op, op.cond, t) for t in range(self.n)]
        mask = torch.tensor(mask_list, dtype=torch.bool, device=rows.device)
        arts = {k: v.to(rows.device) for k, v in op.artifacts.items()}
        p = lambda name: self.req.param(att, op, name)  # noqa: E731
        if op.kernel == "custom":
            self._run_custom(att, op, rows, mask_list)
            return
        if op.is_control:
            self._monitor(att, op, mask_list)
            return
        if op.is_read:
            self._read(att, op, rows, mask, mask_list, arts, p)
            return
        if op.kernel == "add":
            new = R.add(rows, None, mask, arts["a0"], p("scale"))
        elif op.kernel == "ablate":
            new = R.ablate(rows, None, mask, arts["a0"])
        elif op.kernel == "clamp":
            new = R.clamp(rows, None, mask, arts["a0"], p("min"), p("max"))
        elif op.kernel == "affine":
            new = R.affine(rows, None, mask, arts["a0"], arts["a1"], arts["a2"])
        elif op.kernel == "router":
            new = R.router(rows, mask, arts["a0"], p("delta"))
        elif op.kernel == "sae_steer":
            new = R.add(
                rows, None, mask, op.sae.W_dec[op.features].sum(0).to(rows.device), p("scale")
            )
        elif op.kernel == "sae_clamp":
            new = R.sae_clamp(rows, None, mask, op.sae, op.features, p("value"))
        else:
            raise DeployError(
                f"app {att.name!r}, op {op.label}: no oracle for kernel {op.kernel!r}"
            )
        rows.copy_(new.reshape(rows.shape))

    def _read(self, att, op, rows, mask, mask_list, arts, p) -> None:
        n = self.n
        values = [NAN] * n  # the scalar a gate or latch sees
        reported: dict[int, Any] = {}
        if op.kernel == "probe":
            v = R.probe(rows, arts["a0"], p("bias"))
            for t in range(n):
                if mask_list[t]:
                    values[t] = reported[t] = float(v[t])
        elif op.kernel == "distance":
            v = R.distance(rows, arts["a0"].reshape(op.n, -1))
            for t in range(n):
                if mask_list[t]:
                    values[t] = reported[t] = float(v[t])
        elif op.kernel == "capture":
            for t in range(n):
                if mask_list[t]:
                    # The engine's result channel holds 1.0 for a captured token; a gate
                    # on a capture read therefore means "it was captured".
                    values[t] = 1.0
                    reported[t] = rows[t, op.m : op.m + op.n].float().cpu().tolist()
        elif op.kernel == "cosine":
            # CAST: mean of the stream over the prompt tokens where the condition holds;
            # one value, at the last prompt token, once at least one token was summed.
            acc = self.req.cast_sums.setdefault(
                (att.name, op.result_key), [torch.zeros(rows.shape[-1], dtype=torch.float64), 0]
            )
            for t in range(n):
                if mask_list[t] and self.prompt[t]:
                    acc[0] += rows[t].double().cpu()
                    acc[1] += 1
                if self.prompt[t] and self.last[t] and acc[1] > 0:
                    mean = (acc[0] / acc[1]).float()
                    values[t] = reported[t] = float(R.cast_cosine(mean, arts["a0"].cpu()))
        elif op.kernel == "sae":
            acts = R.sae_encode(rows, op.sae)
            if op.features:
                sub = acts[:, op.features].cpu()
                for i, f in enumerate(op.features):  # each feature is a read of its own for gates
                    self._note_values(
                        att,
                        f"{op.result_key}.f{f}",
                        [float(sub[t, i]) if mask_list[t] else NAN for t in range(n)],
                    )
                for t in range(n):
                    if mask_list[t]:
                        values[t] = float(sub[t, 0])
                        reported[t] = {"ids": list(op.features), "acts": sub[t].tolist()}
            else:
                top = R.sae_top(acts, op.top_k)
                for t in range(n):
                    if mask_list[t]:
                        ids, a = top[t]
                        values[t] = a[0] if a else 0.0  # the largest activation
                        reported[t] = {"ids": ids, "acts": a}
        else:
            raise DeployError(f"app {att.name!r}, op {op.label}: no oracle for read {op.kernel!r}")
        self._note_read(att, op, values, reported)

    def _monitor(self, att: _Attached, op: LoweredOp, mask_list: list[bool]) -> None:
        """A stop or a since(...) term: the first position of this pass where its condition
        held, if none before it did."""
        req = self.req
        first = R.first_held(mask_list, self.pos)
        if first is None:
            return
        if op.kernel == "since":
            key = (att.name, op.sticky)
            if key not in req.sticky:
                req.sticky[key] = first
                req.switched.append(
                    {
                        "app": att.name,
                        "read": op.monitor_read,
                        "position": first,
                        "condition": op.sticky,
                    }
                )
            return
        if req.stopped is None:
            value = None
            if op.monitor_read is not None:
                v = self.values.get((att.name, op.monitor_read), [NAN] * self.n)[
                    self.pos.index(first)
                ]
                value = v if v == v else None
            req.stopped = {
                "app": att.name,
                "read": op.monitor_read,
                "position": first,
                "value": value,
            }

    def _note_values(self, att, key: str, values: list[float]) -> None:
        self.values[(att.name, key)] = values
        stats = self.req.read_stats.setdefault((att.name, key), [0.0, 0, NAN])
        for t, v in enumerate(values):
            if v == v and self.prompt[t]:
                stats[0] += v
                stats[1] += 1
                if self.last[t]:
                    stats[2] = v

    def _note_read(self, att, op, values: list[float], reported: dict[int, Any]) -> None:
        self.values[(att.name, op.result_key)] = values
        stats = self.req.read_stats.setdefault((att.name, op.result_key), [0.0, 0, NAN])
        for t, v in enumerate(values):
            if v != v or not self.prompt[t]:
                continue
            stats[0] += v
            stats[1] += 1
            if self.last[t]:
                stats[2] = v
        for t in sorted(reported):
            self.req.record(att.name, op.result_key, self.pos[t], reported[t])

    def _run_custom(self, att, op, rows, mask_list) -> None:
        if rows.dtype not in _DTYPE_CODES:
            raise RuntimeError(f"xmix: user kernel on a {rows.dtype} stream")
        n, d = rows.shape
        h = rows.detach().cpu().contiguous().clone()
        select = torch.tensor(mask_list, dtype=torch.uint8)
        slot = torch.zeros(n, dtype=torch.int32)
        pos = torch.tensor(self.pos, dtype=torch.int32)
        pnames = [k for k, _ in op.params]
        prm = torch.tensor(
            [self.req.param(att, op, k) for k in pnames] or [0.0], dtype=torch.float32
        )
        art = op.artifacts.get("a0")
        art = art.float().contiguous() if art is not None else None
        out = torch.full((n,), NAN, dtype=torch.float32) if op.is_read else None
        args = _CustomArgs(
            h=h.data_ptr(),
            r=None,
            stride_h=d,
            stride_r=0,
            n_rows=n,
            d=d,
            dtype=_DTYPE_CODES[rows.dtype],
            n_params=len(pnames),
            select=select.data_ptr(),
            tok_slot=slot.data_ptr(),
            tok_pos=pos.data_ptr(),
            slot_params=prm.data_ptr(),
            param_base=0,
            artifact_numel=int(art.numel()) if art is not None else 0,
            artifact=art.data_ptr() if art is not None else None,
            out=out.data_ptr() if out is not None else None,
        )
        att.custom_fns[id(op)](ctypes.byref(args))
        if op.is_read:
            values = [float(out[t]) if mask_list[t] else NAN for t in range(n)]
            reported = {t: v for t, v in enumerate(values) if v == v}
            self._note_read(att, op, values, reported)
        else:
            rows.copy_(h.to(rows.device).reshape(rows.shape))


# ------------------------------------------------------------------------------ attachment
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
        self.attached: list[_Attached] = []
        self.by_name: dict[str, _Attached] = {}
        enabled = dict(enabled or {})
        for app in apps:
            if app.name in self.by_name:
                raise DeployError(
                    f"app {app.name!r} is attached twice; attach it under another name"
                )
            lw = lower(app, self.shape, tokenizer)
            att = _Attached(lw, "request")
            for op in lw.ops:
                if op.kernel == "custom":
                    att.custom_fns[id(op)] = _load_custom(lw.name, op)
            self.attached.append(att)
            self.by_name[app.name] = att
        for name, mode in enabled.items():
            self.set_mode(name, mode)
        # The requests of the forward pass under way, each with its rows in the site tensors:
        # set by Request._forward (its own passes) or by an open session (transformers' calls).
        self._own: list[tuple[_Step, _Rows]] | None = None
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

    def _order_sites(self) -> dict[int, list[tuple[_Attached, LoweredOp]]]:
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
        want, logits_of, tail = _ROUTERS[tap.router]
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
            _resolve_params(self.by_name[name], p)  # bad parameters fail here, not mid-generate
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
    from xmix.hooks import site_of

    layer, name = site_of(sid, n_layers)
    return name if layer is None else (layer, name)


class _Rows:
    """One request's rows in a site tensor of a batch: row ``b`` of B, token columns ``cols``
    of T (the positions its attention mask keeps). Site tensors are [B, T, ...] or, for
    routers, [B*T, ...]."""

    def __init__(self, b: int, cols: list[int], B: int, T: int):
        self.b, self.cols, self.B, self.T = b, cols, B, T
        lo = cols[0] if cols else 0
        self.span = (lo, lo + len(cols)) if cols == list(range(lo, lo + len(cols))) else None
        self._idx = None if self.span else torch.tensor(cols, dtype=torch.long)

    def _grid(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() != self.B * self.T * tensor.shape[-1]:
            raise RuntimeError(
                f"xmix: a site tensor of shape {list(tensor.shape)} in a pass of "
                f"{self.B} x {self.T} tokens"
            )
        return tensor.view(self.B, self.T, tensor.shape[-1])

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        g = self._grid(tensor)
        if self.span is not None:
            return g[self.b, self.span[0] : self.span[1]]  # a view: writes land in place
        return g[self.b, self._idx.to(tensor.device)]

    def put(self, tensor: torch.Tensor, rows: torch.Tensor) -> None:
        if self.span is None:
            self._grid(tensor)[self.b, self._idx.to(tensor.device)] = rows


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
        self.current: list[tuple[_Step, _Rows]] | None = None
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
                current.append((_Step(req, req.prompt, start=0), _Rows(b, cols, B, T)))
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
                        (_Step(req, ids[b, cols].tolist(), start=req.n_done), _Rows(b, cols, B, T))
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
    """Lower ``apps`` for ``model`` (a transformers *ForCausalLM of a family in xmix.architectures)
    and hook them in. ``enabled``: app name -> "off" | "request" | "all" (default
    "request": an app runs for the requests that list it)."""
    return Attachment(model, list(apps), enabled, tokenizer)


__all__ = ["attach", "Attachment", "Request", "RequestError"]
