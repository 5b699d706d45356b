"""The semantics of every primitive and condition in plain PyTorch: the oracle in tests.

Written for clarity, not speed; never used on the serving path. Activations at a site are
``h`` (and ``r``, the residual, where the stream is split); the stream is ``x = h + r``
computed in fp32. A write returns the new ``h`` in h's dtype; only rows selected by ``mask``
change, the others are returned bit-identical.
"""

from __future__ import annotations

import math

import torch

NAN = float("nan")


def stream(h: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    x = h.float()
    return x + r.float() if r is not None else x


# ---------------------------------------------------------------------------- reads
def probe(x: torch.Tensor, weight: torch.Tensor, bias: float) -> torch.Tensor:
    """sigmoid(w . x + b) per row."""
    return torch.sigmoid(x.float() @ weight.float() + bias)


def distance(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """min_k ||x - mu_k|| per row."""
    diff = x.float()[:, None, :] - centroids.float()[None, :, :]
    return diff.pow(2).sum(-1).sqrt().min(dim=1).values


def cast_cosine(mean: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """CAST's condition score: cos(m, tanh(P m)) with P = v v^T / (v^T v)."""
    v = v.float()
    proj = v * (v @ mean.float()) / (v @ v)
    u = torch.tanh(proj)
    den = mean.float().norm() * u.norm()
    return (mean.float() @ u) / den if den > 0 else torch.tensor(0.0)


# ---------------------------------------------------------------------------- writes
def written(h, new, mask):
    """A write's result: selected rows take the new values, except elements whose new value is
    not finite in h's dtype, which keep their old value (an Inf/NaN in the stream would reach
    the KV cache; control.h: store_finite)."""
    new = new.to(h.dtype)
    return torch.where(mask[:, None] & torch.isfinite(new), new, h)


def add(h, r, mask, vector, scale):
    new = h.float() + scale * vector.float()
    return written(h, new, mask)


def ablate(h, r, mask, direction):
    u = direction.float() / direction.float().norm()
    proj = stream(h, r) @ u
    new = h.float() - proj[:, None] * u
    return written(h, new, mask)


def clamp(h, r, mask, direction, lo, hi):
    u = direction.float() / direction.float().norm()
    proj = stream(h, r) @ u
    delta = proj.clamp(min=lo, max=hi) - proj
    new = h.float() + delta[:, None] * u
    return written(h, new, mask)


def affine(h, r, mask, matrix, mu_s, mu_t):
    x = stream(h, r)
    new_x = (x - mu_s.float()) @ matrix.float().T + mu_t.float()
    new = new_x - (r.float() if r is not None else 0.0)
    return written(h, new, mask)


def router(logits, mask, expert_mask, delta):
    """SteerMoE: log-softmax over experts; forced-on experts get max + delta, forced-off
    min - delta (max and min of the unmodified log-softmax), before the model's top-k."""
    ls = torch.log_softmax(logits.float(), dim=-1)
    lmax = ls.max(dim=-1, keepdim=True).values
    lmin = ls.min(dim=-1, keepdim=True).values
    em = expert_mask.float()[None, :].expand_as(ls)
    new = torch.where(em > 0, lmax + delta, torch.where(em < 0, lmin - delta, ls))
    return written(logits, new, mask)


# ---------------------------------------------------------------------------- SAEs
# SAELens's encoder conventions (sae_lens.SAE.process_sae_in / encode, v6); see xmix.lang.sae.
def sae_normalise(x: torch.Tensor, sae) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised rows, decoder scale per row): the SAE's input normalisation and the factor
    by which decoder output appears in the stream (1 without a per-token normalisation)."""
    x = x.float()
    ones = torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
    if sae.normalize_activations == "constant_norm_rescale":
        norm = x.norm(dim=-1)
        coeff = torch.where(norm > 0, math.sqrt(x.shape[-1]) / norm, torch.zeros_like(norm))
        return x * coeff[:, None], torch.where(
            norm > 0, norm / math.sqrt(x.shape[-1]), torch.zeros_like(norm)
        )
    if sae.normalize_activations == "layer_norm":
        mu = x.mean(dim=-1, keepdim=True)
        xc = x - mu
        std = xc.std(dim=-1, keepdim=True)
        return xc / (std + 1e-5), std[:, 0]
    return x, ones


def sae_pre(x: torch.Tensor, sae) -> torch.Tensor:
    """Encoder pre-activations [n, F]."""
    xn, _ = sae_normalise(x, sae)
    if sae.apply_b_dec_to_input:
        xn = xn - sae.b_dec.to(xn.device)
    return xn @ sae.W_enc.to(xn.device) + sae.b_enc.to(xn.device)


def sae_encode(x: torch.Tensor, sae) -> torch.Tensor:
    """Feature activations [n, F]: relu / jumprelu / topk (ties: lower feature id first)."""
    pre = sae_pre(x, sae)
    acts = torch.relu(pre)
    if sae.architecture == "jumprelu":
        acts = acts * (pre > sae.threshold.to(pre.device))
    elif sae.architecture == "topk":
        order = torch.sort(pre, dim=-1, descending=True, stable=True).indices[:, : sae.k]
        keep = torch.zeros_like(pre, dtype=torch.bool).scatter_(1, order, True)
        acts = torch.where(keep, acts, torch.zeros_like(acts))
    return acts


def sae_decoder_scale(x: torch.Tensor, sae) -> torch.Tensor:
    return sae_normalise(x, sae)[1]


def sae_top(acts: torch.Tensor, k: int) -> list[tuple[list[int], list[float]]]:
    """Per row: the ids and activations of its active features (activation > 0), largest
    first (ties: lower id first), at most k."""
    out = []
    for row in acts.float().cpu():
        order = torch.sort(row, descending=True, stable=True).indices[:k]
        ids = [int(i) for i in order if row[i] > 0]
        out.append((ids, [float(row[i]) for i in ids]))
    return out


def sae_clamp(h, r, mask, sae, features: list[int], value: float):
    """Set the listed features' activations to value: x += sum_f (value - a_f(x)) W_dec[f]
    (scaled into the stream), everything else of x, the SAE's error term included, kept."""
    x = stream(h, r)
    acts = sae_encode(x, sae)[:, features]
    scale = sae_decoder_scale(x, sae)
    delta = ((value - acts) * scale[:, None]) @ sae.W_dec[features].to(x.device)
    new = h.float() + delta
    return written(h, new, mask)


# ---------------------------------------------------------------------------- conditions
def span_flags(ids: list[int], open_ids: set[int], close_ids: set[int], state: bool = False):
    """In-span flag per token: the opener is inside, the closer is not. Returns (flags, state)."""
    out = []
    for t in ids:
        if t in open_ids:
            state = True
        if t in close_ids:
            state = False
        out.append(state)
    return out, state


def compare(v: float, cmp: str, t: float) -> bool:
    if v != v:  # the read did not run on this token
        return False
    return {">=": v >= t, ">": v > t, "<=": v <= t, "<": v < t, "==": v == t, "!=": v != t}[cmp]


# ---------------------------------------------------------------------------- monitors
def first_held(holds: list[bool], positions: list[int]) -> int | None:
    """The position of the first token (in position order) at which a condition held, or
    None: where a stop ends a request, and where a since(...) term starts to hold."""
    return next((p for h, p in sorted(zip(holds, positions), key=lambda x: x[1]) if h), None)


def since_holds(position: int, start: int | None) -> bool:
    """since(cond) at a token: cond held at this token or an earlier one of the request
    (``start``: the first position where it held, None while it never has)."""
    return start is not None and position >= start
