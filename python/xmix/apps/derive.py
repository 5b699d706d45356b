"""The math that turns collected activations into the artifacts of the seven apps.

Pure torch over tensors; nothing here runs a model. Collecting the activations (which site,
which tokens, which prompts) is the caller's job (``xmix derive``); ``artifacts.SCHEMAS[app].collect``
says what each app needs. Every function computes in float64 and returns float32 artifacts
(the dtype the kernels use), so results do not depend on the dtype activations were stored in.

Shapes: a set of examples is ``[N, d]``, or ``[N, L, d]`` when collected at L layers (the
functions that make one vector per layer accept both and keep the extra dimensions).

    app             artifact                       function
    refusal         direction r                    mean_difference, select_refusal_direction
    seal            steering vector S              seal_vector
    cast            condition v, behaviour u_l, θ  pca_direction, cast_similarity, cast_threshold
    truth_probe     w, b                           fit_logistic
    sake            A, mu_s, mu_t, t               gaussian_transport, min_distance, distance_threshold
    kl_then_steer   u_l, s_l, probe w, b           kts_directions, fit_logistic
    steer_moe       mask M                         expert_counts, routing_difference, steer_moe_mask

What each artifact must look like (names, shapes, dtypes, constraints) is
``xmix.apps.artifacts``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from xmix.apps.artifacts import ArtifactError


def _f64(x: Any, what: str, min_dim: int = 1) -> torch.Tensor:
    try:
        # Python numbers straight to float64: via torch's default float32 they would round.
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)
    except Exception:
        raise ArtifactError(f"{what}: not a tensor ({type(x).__name__})") from None
    if t.dtype == torch.bool or t.is_complex():
        raise ArtifactError(f"{what}: dtype {t.dtype} is not real")
    t = t.detach().to("cpu", torch.float64)
    if t.dim() < min_dim:
        raise ArtifactError(
            f"{what}: expected at least {min_dim} dimension(s), got shape {tuple(t.shape)}"
        )
    if not torch.isfinite(t).all():
        raise ArtifactError(f"{what}: contains NaN or Inf")
    return t


def _pair(pos: Any, neg: Any, what: str, paired: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    p, n = _f64(pos, f"{what}: positive set", 2), _f64(neg, f"{what}: negative set", 2)
    if p.shape[1:] != n.shape[1:]:
        raise ArtifactError(
            f"{what}: positive examples have shape {tuple(p.shape[1:])} but negative "
            f"ones {tuple(n.shape[1:])}; they must come from the same site(s)"
        )
    if p.shape[0] == 0 or n.shape[0] == 0:
        raise ArtifactError(f"{what}: both sets need at least one example")
    if paired and p.shape[0] != n.shape[0]:
        raise ArtifactError(
            f"{what}: the method pairs example i of the positive set with example i "
            f"of the negative set, but there are {p.shape[0]} and {n.shape[0]}"
        )
    return p, n


# ============================================================================ #1, #2, #6
def mean_difference(pos: Any, neg: Any) -> torch.Tensor:
    """mean(pos) - mean(neg) over the first dimension: ``[N, ..., d], [M, ..., d] -> [..., d]``.

    #1 refusal: harmful minus harmless at residual.pre, giving candidates ``[P, L, d]`` from
    ``[N, P, L, d]`` (P post-instruction positions, L layers), as in Arditi et al.
    """
    p, n = _pair(pos, neg, "mean_difference")
    return (p.mean(0) - n.mean(0)).float()


def seal_vector(execution: Any, reflection: Any, transition: Any | None = None) -> torch.Tensor:
    """SEAL's steering vector S = mean(H_E) - mean(H_R ∪ H_T).

    Rows are hidden states of the "\\n\\n" tokens that end thoughts, grouped by the thought that
    follows them (execution, reflection, transition; SEAL classifies by keywords). Reflection
    and transition are pooled into one set before the mean, as in the paper, so a large
    transition set weighs by its size. Adding +S (coefficient > 0) pushes toward execution.
    """
    e = _f64(execution, "seal_vector: execution set", 2)
    rt = _f64(reflection, "seal_vector: reflection set", 2)
    if transition is not None:
        t = _f64(transition, "seal_vector: transition set", 2)
        if t.shape[1:] != rt.shape[1:]:
            raise ArtifactError("seal_vector: reflection and transition sets differ in shape")
        rt = torch.cat([rt, t])
    return mean_difference(e, rt)


def select_refusal_direction(
    candidates: Any,
    bypass_scores: Any,
    induce_scores: Any,
    kl_scores: Any,
    *,
    kl_threshold: float | None = 0.1,
    induce_threshold: float | None = 0.0,
    prune_layer_fraction: float | None = 0.2,
) -> tuple[int, int, torch.Tensor]:
    """Arditi et al.'s choice among candidate directions ``[P, L, d]`` (position, layer).

    Scores are ``[P, L]``, measured with the model (by the caller): ``bypass`` = refusal
    score on harmful prompts with the candidate ablated everywhere (lower is better),
    ``induce`` = refusal score on harmless prompts with the candidate added at its layer,
    ``kl`` = KL on harmless prompts under ablation. A candidate is dropped if any score is
    NaN, its layer is in the last ``prune_layer_fraction`` of the model, its KL exceeds
    ``kl_threshold`` or its induce score is below ``induce_threshold``; the lowest bypass
    score wins, ties going to the earlier position, then the lower layer. Returns
    ``(position index, layer, direction)``.
    """
    cand = _f64(candidates, "select_refusal_direction: candidates", 3)
    P, L = cand.shape[:2]
    scores = []
    for nm, s in (
        ("bypass_scores", bypass_scores),
        ("induce_scores", induce_scores),
        ("kl_scores", kl_scores),
    ):
        t = torch.as_tensor(s).detach().to("cpu", torch.float64)
        if tuple(t.shape) != (P, L):
            raise ArtifactError(
                f"select_refusal_direction: {nm} has shape {tuple(t.shape)}; expected [{P}, {L}]"
            )
        scores.append(t)
    bypass, induce, kl = scores
    best: tuple[float, int, int] | None = None
    for p in range(P):
        for layer in range(L):
            b, i, k = float(bypass[p, layer]), float(induce[p, layer]), float(kl[p, layer])
            if math.isnan(b) or math.isnan(i) or math.isnan(k):
                continue
            if prune_layer_fraction is not None and layer >= int(L * (1.0 - prune_layer_fraction)):
                continue
            if kl_threshold is not None and k > kl_threshold:
                continue
            if induce_threshold is not None and i < induce_threshold:
                continue
            if best is None or b < best[0]:
                best = (b, p, layer)
    if best is None:
        raise ArtifactError(
            "select_refusal_direction: every candidate was filtered out; relax "
            "kl_threshold / induce_threshold / prune_layer_fraction"
        )
    _, p, layer = best
    return p, layer, cand[p, layer].float()


# ============================================================================ #3 CAST
PCA_METHODS = ("pairwise", "diff", "center")


def _first_pc(x: torch.Tensor) -> torch.Tensor:
    x = x - x.mean(0)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    if not float(s[0]) > 0:
        raise ArtifactError("pca_direction: the examples do not vary (zero first singular value)")
    v = vh[0]
    # SVD's sign is arbitrary; pin it so that a tie in the sign vote below is still deterministic.
    return v if v[v.abs().argmax()] > 0 else -v


def pca_direction(pos: Any, neg: Any, *, method: str = "pairwise") -> torch.Tensor:
    """First principal component of paired examples, as a unit vector with CAST's sign.

    ``pos[i]`` and ``neg[i]`` are a contrastive pair. ``method`` follows IBM's
    activation-steering ``read_representations``: ``"pairwise"`` (their default,
    ``pca_pairwise``) centres each pair on its own mean, ``"diff"`` (``pca_diff``) uses the
    differences ``pos[i] - neg[i]``, ``"center"`` (``pca_center``) centres all examples on the
    global mean; the PC is then taken of that data after the usual mean removal. Sign: the
    direction is flipped when, over the pairs, ``pos[i]·v < neg[i]·v`` happens more often than
    ``>`` (CAST's rule); on a tie we keep the orientation for which the mean difference
    projects positively. ``[N, d] -> [d]``; ``[N, L, d] -> [L, d]`` (one PC per layer).
    """
    if method not in PCA_METHODS:
        raise ArtifactError(f"pca_direction: method must be one of {PCA_METHODS}, got {method!r}")
    p, n = _pair(pos, neg, "pca_direction", paired=True)
    if p.dim() == 3:
        return torch.stack(
            [pca_direction(p[:, l], n[:, l], method=method) for l in range(p.shape[1])]
        )
    if p.dim() != 2:
        raise ArtifactError(f"pca_direction: expected [N, d] or [N, L, d], got {tuple(p.shape)}")
    if method == "pairwise":
        c = (p + n) / 2
        train = torch.cat([p - c, n - c])
    elif method == "diff":
        train = p - n
    else:
        both = torch.cat([p, n])
        train = both - both.mean(0)
    if method == "diff" and train.shape[0] < 2:
        raise ArtifactError("pca_direction: method 'diff' needs at least two pairs")
    v = _first_pc(train)
    proj_p, proj_n = p @ v, n @ v
    larger = int((proj_p > proj_n).sum())
    smaller = int((proj_p < proj_n).sum())
    if smaller > larger or (smaller == larger and float(proj_p.mean() - proj_n.mean()) < 0):
        v = -v
    return v.float()


def cast_similarity(means: Any, vector: Any) -> torch.Tensor:
    """CAST's condition score cos(m, tanh(P m)), P = v vᵀ / vᵀv, for each row m of ``means``.

    ``means`` are per-prompt means of the hidden states over all prompt tokens at the
    condition site (CAST's "mean" comparison mode), ``[N, d]`` or ``[d]``. A zero mean gives 0.
    """
    m = _f64(means, "cast_similarity: means")
    v = _f64(vector, "cast_similarity: vector")
    single = m.dim() == 1
    m = m.reshape(-1, m.shape[-1])
    if v.shape != (m.shape[1],):
        raise ArtifactError(
            f"cast_similarity: vector has shape {tuple(v.shape)}; expected [{m.shape[1]}]"
        )
    vv = float(v @ v)
    if not vv > 0:
        raise ArtifactError("cast_similarity: vector has zero norm")
    u = torch.tanh((m @ v / vv)[:, None] * v[None, :])
    den = m.norm(dim=1) * u.norm(dim=1)
    out = torch.where(
        den > 0,
        (m * u).sum(1) / torch.where(den > 0, den, torch.ones_like(den)),
        torch.zeros_like(den),
    )
    return out[0] if single else out


@dataclass(frozen=True)
class ThresholdFit:
    """A condition threshold: fire when ``score <comparator> threshold``."""

    threshold: float
    comparator: str  # xmix comparator: ">" or "<"
    f1: float
    cast_direction: (
        str  # the same choice in CAST's words: "smaller" (score > θ) or "larger" (score < θ)
    )


def _f1(pred: torch.Tensor, truth: torch.Tensor) -> float:
    tp = int((pred & truth).sum())
    fp = int((pred & ~truth).sum())
    fn = int((~pred & truth).sum())
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def cast_threshold(
    pos_scores: Any, neg_scores: Any, *, lo: float = 0.0, hi: float = 1.0, step: float = 0.01
) -> ThresholdFit:
    """CAST's ``find_best_condition_point`` for one layer: grid search of the threshold.

    Prompts in ``pos_scores`` should trigger the behaviour, those in ``neg_scores`` should
    not. For θ = lo, lo+step, ... < hi and both directions, predict "fire" when
    ``score > θ`` (CAST's "smaller": the threshold is smaller than the score) or ``score < θ``
    ("larger"); keep the first best F1 (θ ascending, "larger" before "smaller", as CAST
    iterates). CAST's comparator names are the reverse of what one may expect; ``comparator``
    gives the xmix spelling.
    """
    ps = _f64(pos_scores, "cast_threshold: positive scores").reshape(-1)
    ns = _f64(neg_scores, "cast_threshold: negative scores").reshape(-1)
    if not step > 0 or not hi > lo:
        raise ArtifactError(f"cast_threshold: need lo < hi and step > 0, got {lo}, {hi}, {step}")
    scores = torch.cat([ps, ns])
    truth = torch.cat(
        [torch.ones_like(ps, dtype=torch.bool), torch.zeros_like(ns, dtype=torch.bool)]
    )
    best: ThresholdFit | None = None
    n_steps = int(math.ceil((hi - lo) / step - 1e-9))
    for i in range(n_steps):
        # lo + i*step, rounded so that the grid hits values like 0.07 exactly.
        th = round(lo + i * step, 12)
        for direction, cmp in (("larger", "<"), ("smaller", ">")):
            pred = scores < th if cmp == "<" else scores > th
            f1 = _f1(pred, truth)
            if f1 > (best.f1 if best else 0.0):
                best = ThresholdFit(th, cmp, f1, direction)
    if best is None:
        raise ArtifactError(
            "cast_threshold: no threshold in the grid separates the sets (F1 = 0 "
            "everywhere); widen [lo, hi)"
        )
    return best


# ============================================================================ #4, #6 probes
def fit_logistic(
    x: Any, y: Any, *, C: float = 1.0, max_iter: int = 500, tol: float = 1e-10
) -> tuple[torch.Tensor, float]:
    """L2-regularised logistic regression, the objective of scikit-learn's default
    ``LogisticRegression`` (what Orgad et al. use):

        minimise  C · Σ_i log(1 + exp(-s_i (w·x_i + b)))  +  ½ ||w||²     (s_i = ±1, b unpenalised)

    solved in float64 with L-BFGS (strong Wolfe line search) from zero, so the result is
    deterministic. ``x: [N, d]``, ``y: [N]`` in {0, 1}. Returns ``(w float32 [d], b)`` for the
    probe σ(w·x + b) = P(y = 1 | x).
    """
    X = _f64(x, "fit_logistic: x", 2)
    Y = _f64(y, "fit_logistic: y").reshape(-1)
    if X.dim() != 2 or Y.shape[0] != X.shape[0]:
        raise ArtifactError(
            f"fit_logistic: x must be [N, d] and y [N]; got {tuple(X.shape)} and {tuple(Y.shape)}"
        )
    if not bool(((Y == 0) | (Y == 1)).all()):
        raise ArtifactError("fit_logistic: labels must be 0 or 1")
    if int(Y.sum()) in (0, Y.shape[0]):
        raise ArtifactError("fit_logistic: both classes need at least one example")
    if not (isinstance(C, (int, float)) and C > 0 and math.isfinite(C)):
        raise ArtifactError(f"fit_logistic: C must be a positive number, got {C!r}")
    n, d = X.shape
    # Dividing the objective by C·n leaves the minimiser unchanged and keeps the scale of the
    # loss independent of N, which makes L-BFGS' tolerances meaningful.
    lam = 1.0 / (C * n)
    theta = torch.zeros(d + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [theta],
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=tol,
        tolerance_change=1e-15,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        z = X @ theta[:d] + theta[d]
        loss = F.binary_cross_entropy_with_logits(z, Y) + 0.5 * lam * theta[:d].dot(theta[:d])
        loss.backward()
        return loss

    for _ in range(4):  # L-BFGS may stop early on a flat line search; restarts are cheap
        opt.step(closure)
        if theta.grad is not None and float(theta.grad.abs().max()) <= tol * 10:
            break
    w = theta.detach()
    if not torch.isfinite(w).all():
        raise ArtifactError("fit_logistic: the optimisation diverged")
    return w[:d].float(), float(w[d])


def probe_from_sets(pos: Any, neg: Any, **kwargs) -> tuple[torch.Tensor, float]:
    """``fit_logistic`` with ``pos`` labelled 1 and ``neg`` labelled 0 (``[N, d]`` each)."""
    p, n = _pair(pos, neg, "probe_from_sets")
    if p.dim() != 2:
        raise ArtifactError(f"probe_from_sets: expected [N, d] examples, got {tuple(p.shape)}")
    x = torch.cat([p, n])
    y = torch.cat(
        [torch.ones(p.shape[0], dtype=torch.float64), torch.zeros(n.shape[0], dtype=torch.float64)]
    )
    return fit_logistic(x, y, **kwargs)


def kts_directions(
    pos: Any, neg: Any, *, method: str = "mean", scale: str = "norm"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer steering directions for KL-then-steer: ``[N, L, d] -> (u [L, d], s [L])``.

    ``method="mean"``: u_l = normalised mean(pos) - mean(neg). ``method="pca"``: u_l is the
    first PC of the pair differences with the majority sign: RepE's PCA reader, which KTS
    uses, on pairs in random order; we take both orders of every pair, which is that reader
    made deterministic (``pca_direction(method="pairwise")``). Needs pairs. ``scale="norm"``: s_l = ||mean(pos_l) - mean(neg_l)||, so that
    s_l·u_l is the mean difference for ``"mean"``; ``scale="unit"``: s_l = 1 (RepE's
    normalised directions, KTS's default). The steering added is ``coeff · s_l · u_l``.
    """
    if method not in ("mean", "pca") or scale not in ("norm", "unit"):
        raise ArtifactError(
            f"kts_directions: method must be 'mean' or 'pca' and scale 'norm' or "
            f"'unit'; got {method!r}, {scale!r}"
        )
    p, n = _pair(pos, neg, "kts_directions", paired=(method == "pca"))
    if p.dim() != 3:
        raise ArtifactError(f"kts_directions: expected [N, L, d] examples, got {tuple(p.shape)}")
    diff = p.mean(0) - n.mean(0)
    norms = diff.norm(dim=1)
    if method == "mean":
        if not bool((norms > 0).all()):
            raise ArtifactError("kts_directions: the two sets have the same mean at some layer")
        u = diff / norms[:, None]
    else:
        u = pca_direction(p, n, method="pairwise").double()
    s = norms if scale == "norm" else torch.ones_like(norms)
    return u.float(), s.float()


# ============================================================================ #5 SAKE
def _sym_eig(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.linalg.eigh((S + S.T) / 2)


def _sqrtm_psd(S: torch.Tensor) -> torch.Tensor:
    e, V = _sym_eig(S)
    return (V * e.clamp(min=0).sqrt()) @ V.T


def gaussian_transport(
    source: Any, target: Any, *, reg: float = 1e-2, shrinkage: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The optimal-transport (Monge) map between Gaussians fitted to two activation sets.

    For N(mu_s, S_s) -> N(mu_t, S_t) the W2-optimal map is T(x) = A (x - mu_s) + mu_t with

        A = S_s^{-1/2} (S_s^{1/2} S_t S_s^{1/2})^{1/2} S_s^{-1/2}     (symmetric PSD, A S_s A = S_t)

    which is what SAKE fits with POT's ``ot.da.LinearTransport``. Covariances are the biased
    (1/N) estimates, as in POT. With N < d they are singular, so each is first shrunk toward
    the scaled identity, S <- (1 - λ) S + λ (tr S / d) I (``shrinkage`` = λ in [0, 1]), then
    ``reg · I`` is added (POT's ``reg``; SAKE's notebook uses 1e-2). Returns float32
    ``(A [d, d], mu_s [d], mu_t [d])``.
    """
    Xs = _f64(source, "gaussian_transport: source", 2)
    Xt = _f64(target, "gaussian_transport: target", 2)
    if Xs.dim() != 2 or Xt.dim() != 2 or Xs.shape[1] != Xt.shape[1]:
        raise ArtifactError(
            f"gaussian_transport: expected [N, d] and [M, d], got {tuple(Xs.shape)} "
            f"and {tuple(Xt.shape)}"
        )
    if not 0.0 <= shrinkage <= 1.0 or not reg >= 0.0:
        raise ArtifactError(
            f"gaussian_transport: need 0 <= shrinkage <= 1 and reg >= 0, got {shrinkage}, {reg}"
        )
    d = Xs.shape[1]
    eye = torch.eye(d, dtype=torch.float64)

    def cov(X: torch.Tensor) -> torch.Tensor:
        Z = X - X.mean(0)
        S = Z.T @ Z / X.shape[0]
        if shrinkage:
            S = (1 - shrinkage) * S + shrinkage * (torch.trace(S) / d) * eye
        return S + reg * eye

    mu_s, mu_t = Xs.mean(0), Xt.mean(0)
    Ss, St = cov(Xs), cov(Xt)
    e, V = _sym_eig(Ss)
    if not float(e.min()) > 1e-12 * max(1.0, float(e.max())):
        raise ArtifactError(
            "gaussian_transport: the source covariance is singular (fewer examples "
            "than dimensions?); raise reg or shrinkage"
        )
    Ss_half = (V * e.sqrt()) @ V.T
    Ss_ihalf = (V / e.sqrt()) @ V.T
    A = Ss_ihalf @ _sqrtm_psd(Ss_half @ St @ Ss_half) @ Ss_ihalf
    A = (A + A.T) / 2
    return A.float(), mu_s.float(), mu_t.float()


def min_distance(x: Any, centroids: Any) -> torch.Tensor:
    """min_k ||x_i - mu_k|| per row (the ``distance`` read): ``[N, d], [k, d] -> [N]`` (float64)."""
    X = _f64(x, "min_distance: x")
    M = _f64(centroids, "min_distance: centroids")
    X = X.reshape(-1, X.shape[-1])
    M = M.reshape(-1, M.shape[-1])
    if X.shape[1] != M.shape[1]:
        raise ArtifactError(f"min_distance: x has width {X.shape[1]}, centroids {M.shape[1]}")
    return torch.cdist(X, M).min(dim=1).values


def distance_threshold(
    in_scope: Any, out_of_scope: Any | None = None, *, quantile: float = 0.95
) -> float:
    """SAKE's activation threshold t (edit when min distance <= t) from distances.

    ``in_scope``: distances of prompts the edit must cover (paraphrases, implications) to the
    centroid(s). Without ``out_of_scope``: the ``quantile`` of the in-scope distances. With
    it: the in-scope distance that maximises TPR - FPR (Youden's J) for ``d <= t``; ties go to
    the smallest t, which edits the fewest unrelated prompts.
    """
    din = _f64(in_scope, "distance_threshold: in_scope").reshape(-1)
    if out_of_scope is None:
        if not 0.0 < quantile <= 1.0:
            raise ArtifactError(f"distance_threshold: quantile must be in (0, 1], got {quantile}")
        return float(torch.quantile(din, quantile))
    dout = _f64(out_of_scope, "distance_threshold: out_of_scope").reshape(-1)
    best_t, best_j = None, -math.inf
    for t in torch.unique(din).tolist():  # ascending
        j = float((din <= t).double().mean() - (dout <= t).double().mean())
        if j > best_j + 1e-12:  # equal J up to rounding keeps the smaller t
            best_t, best_j = t, j
    if best_t is None:
        raise ArtifactError("distance_threshold: in_scope holds no distance")
    return float(best_t)


# ============================================================================ #7 SteerMoE
def expert_counts(selected: Any, n_experts: int) -> torch.Tensor:
    """Routing counts ``[L, E]`` from the experts each token selected: ``[T, L, k]`` ints."""
    s = torch.as_tensor(selected)
    if s.dtype.is_floating_point or s.dtype == torch.bool or s.dim() != 3:
        raise ArtifactError(
            f"expert_counts: expected integer ids [T, L, k], got {s.dtype} {tuple(s.shape)}"
        )
    if s.numel() and (int(s.min()) < 0 or int(s.max()) >= n_experts):
        raise ArtifactError(f"expert_counts: expert ids must be in [0, {n_experts})")
    return F.one_hot(s.long(), n_experts).sum(dim=(0, 2))


def routing_difference(
    pos_counts: Any, pos_tokens: Any, neg_counts: Any, neg_tokens: Any
) -> torch.Tensor:
    """SteerMoE's risk difference Δ[l, e] = A⁺[l, e] / N⁺ - A⁻[l, e] / N⁻ (activation rates).

    ``*_counts``: ``[L, E]`` tokens routed to expert e at layer l; ``*_tokens``: the number
    of tokens seen (a number, or ``[L]``). Positive Δ: the expert is more active on the
    behaviour to promote (the positive prompts).
    """
    pc = _f64(pos_counts, "routing_difference: pos_counts", 2)
    nc = _f64(neg_counts, "routing_difference: neg_counts", 2)
    if pc.shape != nc.shape or pc.dim() != 2:
        raise ArtifactError(
            f"routing_difference: counts must both be [L, E], got {tuple(pc.shape)} "
            f"and {tuple(nc.shape)}"
        )
    rates = []
    for c, n, nm in ((pc, pos_tokens, "pos_tokens"), (nc, neg_tokens, "neg_tokens")):
        nt = _f64(n, f"routing_difference: {nm}", 0)
        if nt.dim() == 1 and nt.shape[0] == c.shape[0]:
            nt = nt[:, None]
        elif nt.dim() != 0:
            raise ArtifactError(f"routing_difference: {nm} must be a number or [{c.shape[0]}]")
        if not bool((nt > 0).all()):
            raise ArtifactError(f"routing_difference: {nm} must be positive")
        rates.append(c / nt)
    return rates[0] - rates[1]


def steer_moe_mask(
    delta: Any,
    *,
    n_activate: int,
    n_deactivate: int,
    top_k: int | None = None,
    per_layer: bool = False,
) -> torch.Tensor:
    """SteerMoE's expert mask ``[L, E]`` in {-1, 0, 1} from the risk difference Δ.

    Promote (+1) the ``n_activate`` (layer, expert) pairs with the largest Δ > 0 and demote
    (-1) the ``n_deactivate`` with the most negative Δ: SteerMoE's ranking by |Δ|, split by
    sign. Ranked over all layers at once, or within each layer (``per_layer``, counts then
    per layer). Ties go to the lower (layer, expert) index. With the model's ``top_k``, at
    most top_k experts per layer are forced on and at most E - top_k forced off: beyond that
    the forced experts tie among themselves and the router's top-k picks by index instead.
    """
    D = _f64(delta, "steer_moe_mask: delta", 2)
    if D.dim() != 2:
        raise ArtifactError(f"steer_moe_mask: delta must be [L, E], got {tuple(D.shape)}")
    for nm, v in (("n_activate", n_activate), ("n_deactivate", n_deactivate)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ArtifactError(f"steer_moe_mask: {nm} must be a non-negative int, got {v!r}")
    L, E = D.shape
    if top_k is not None and not (isinstance(top_k, int) and 0 < top_k <= E):
        raise ArtifactError(f"steer_moe_mask: top_k must be in [1, {E}], got {top_k!r}")
    cap_on = top_k if top_k is not None else E
    cap_off = E - top_k if top_k is not None else E
    mask = torch.zeros(L, E, dtype=torch.float32)

    def pick(values: torch.Tensor, rows: list[int], sign: int, budget: int, cap: int) -> None:
        flat = torch.stack([values[r] for r in rows]).reshape(-1)
        order = torch.sort(-sign * flat, stable=True).indices.tolist()
        used = {r: 0 for r in rows}
        taken = 0
        for idx in order:
            if taken >= budget:
                break
            r, e = rows[idx // E], idx % E
            if sign * float(flat[idx]) <= 0:
                break
            if used[r] >= cap or mask[r, e] != 0:
                continue
            mask[r, e] = sign
            used[r] += 1
            taken += 1

    groups = [[l] for l in range(L)] if per_layer else [list(range(L))]
    for rows in groups:
        pick(D, rows, +1, n_activate, cap_on)
        pick(D, rows, -1, n_deactivate, cap_off)
    return mask
