"""What every app's artifacts must look like, as data, and the check against it.

``SCHEMAS`` describes every app's artifacts (names, shapes, dtypes, constraints);
``validate_artifacts`` checks a set of artifacts against it (the app factories call it, and
``xmix derive`` before it writes an app). The math that makes the artifacts is
``xmix.apps.derive``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from xmix.lang.api import AppError


class ArtifactError(AppError):
    """Activations or artifacts that the derivation or an app cannot use."""


@dataclass(frozen=True)
class Artifact:
    """One artifact (tensor) or scalar of an app.

    ``shapes``: accepted shapes, each a tuple of dimension names (``()`` for a scalar). Names
    bind across artifacts: d (hidden size), n_layers (model layers), L_sel (the layers the op
    is placed on), n_moe (MoE layers), E (experts), k (centroids).
    """

    name: str
    shapes: tuple[tuple[str, ...], ...]
    doc: str
    check: str | None = None  # nonzero | unit_rows | ternary | symmetric | nonnegative
    optional: bool = False
    dtype: str = "float32"


@dataclass(frozen=True)
class AppSchema:
    app: str
    title: str
    source: dict[str, str]
    artifacts: tuple[Artifact, ...]
    collect: str
    derive: str


SCHEMAS: dict[str, AppSchema] = {
    s.app: s
    for s in (
        AppSchema(
            "refusal",
            "Refusal direction",
            {
                "paper": "Arditi et al. 2024, Refusal in Language Models Is Mediated by a Single Direction",
                "arxiv": "2406.11717",
                "repo": "https://github.com/andyrdt/refusal_direction",
            },
            (
                Artifact(
                    "direction",
                    (("d",),),
                    "difference-in-means refusal direction r (unnormalised; "
                    "the ablate kernel normalises it, add uses it as is)",
                    check="nonzero",
                ),
            ),
            collect="residual.pre at every layer, at the post-instruction template positions (the "
            "last tokens of the chat-formatted prompt), harmful vs harmless instructions",
            derive="mean_difference(harmful, harmless) -> candidates [P, L, d]; "
            "select_refusal_direction(candidates, bypass, induce, kl)",
        ),
        AppSchema(
            "harm_monitor",
            "Harm monitor (probe that stops or switches refusal steering on)",
            {
                "paper": "Arditi et al. 2024, Refusal in Language Models Is Mediated by a Single "
                "Direction (the steering direction); the probe: logistic regression",
                "arxiv": "2406.11717",
                "repo": "https://github.com/andyrdt/refusal_direction",
            },
            (
                Artifact("weight", (("d",),), "probe weight w of sigma(w.x + b), harmful = 1"),
                Artifact("bias", ((),), "probe bias b"),
                Artifact(
                    "direction",
                    (("d",),),
                    "refusal direction r = mean(harmful) - mean(harmless), added from the "
                    "first flagged token on",
                    check="nonzero",
                ),
            ),
            collect="residual.pre at the probe layer at the last prompt token, harmful vs "
            "harmless instructions",
            derive="probe_from_sets(harmful, harmless); mean_difference(harmful, harmless)",
        ),
        AppSchema(
            "seal",
            "SEAL reasoning calibration",
            {
                "paper": "Chen et al. 2025, SEAL: Steerable Reasoning Calibration of Large Language Models for Free",
                "arxiv": "2504.07986",
                "repo": "https://github.com/VITA-Group/SEAL",
            },
            (
                Artifact(
                    "vector",
                    (("d",),),
                    "S = mean(H_execution) - mean(H_reflection ∪ H_transition)",
                    check="nonzero",
                ),
            ),
            collect='residual.pre of the steering layer at the "\\n\\n" tokens of generated reasoning '
            "traces, grouped by the kind of thought that follows",
            derive="seal_vector(execution, reflection, transition)",
        ),
        AppSchema(
            "cast",
            "Conditional activation steering (CAST)",
            {
                "paper": "Lee et al. 2025, Programming Refusal with Conditional Activation Steering",
                "arxiv": "2409.05907",
                "repo": "https://github.com/IBM/activation-steering",
            },
            (
                Artifact(
                    "condition_vector",
                    (("d",),),
                    "condition direction v (first PC)",
                    check="nonzero",
                ),
                Artifact(
                    "behavior_vectors",
                    (("d",), ("L_sel", "d"), ("n_layers", "d")),
                    "behaviour directions u_l, one per behaviour layer (or shared)",
                ),
                Artifact("threshold", ((),), "θ compared with cos(h̄, tanh(P h̄))"),
            ),
            collect="condition: mean over all prompt tokens of residual.pre at the condition layer, "
            "paired prompts with / without the condition; behaviour: residual.pre at the "
            "behaviour layers at the last tokens of paired prompt+response examples",
            derive="pca_direction(pos, neg, method='pairwise'); cast_similarity(means, v); "
            "cast_threshold(pos_scores, neg_scores)",
        ),
        AppSchema(
            "truth_probe",
            "Truthfulness probe",
            {
                "paper": "Orgad et al. 2025, LLMs Know More Than They Show: On the Intrinsic "
                "Representation of LLM Hallucinations",
                "arxiv": "2410.02707",
                "repo": "https://github.com/technion-cs-nlp/LLMsKnow",
            },
            (
                Artifact("weight", (("d",),), "probe weight w"),
                Artifact("bias", ((),), "probe bias b"),
            ),
            collect="mlp.post at the probe layer at the (last) token of the exact answer, answers "
            "labelled correct (1) / incorrect (0)",
            derive="fit_logistic(x, y) or probe_from_sets(true, false)",
        ),
        AppSchema(
            "sake",
            "SAKE knowledge editing",
            {
                "paper": "Scialanga et al. 2025, SAKE: Steering Activations for Knowledge Editing",
                "arxiv": "2503.01751",
                "repo": "https://github.com/axa-rev-research/knowledge-editing",
            },
            (
                Artifact("A", (("d", "d"),), "symmetric PSD transport matrix", check="symmetric"),
                Artifact("mu_s", (("d",),), "source mean"),
                Artifact("mu_t", (("d",),), "target mean"),
                Artifact(
                    "threshold",
                    ((),),
                    "edit when min_k ||h - c_k|| <= threshold",
                    check="nonnegative",
                ),
                Artifact(
                    "centroids",
                    (("k", "d"),),
                    "in-scope centroids c_k (default mu_s)",
                    optional=True,
                ),
            ),
            collect="final.post at the last prompt token: source prompts (paraphrases and "
            "implications of the fact) and target prompts (the same, made to produce the "
            "new object)",
            derive="gaussian_transport(source, target); min_distance(x, centroids); "
            "distance_threshold(in_scope, out_of_scope)",
        ),
        AppSchema(
            "kl_then_steer",
            "KL-then-steer (KTS)",
            {
                "paper": "Stickland et al. 2024, Steering Without Side Effects: Improving "
                "Post-Deployment Control of Language Models",
                "arxiv": "2406.15518",
                "repo": "https://github.com/AsaCooperStickland/kl-then-steer",
            },
            (
                Artifact(
                    "directions",
                    (("L_sel", "d"),),
                    "unit steering directions û_l",
                    check="unit_rows",
                ),
                Artifact("scales", (("L_sel",),), "per-layer magnitudes s_l"),
                Artifact("probe_weight", (("d",),), "prompt probe weight"),
                Artifact("probe_bias", ((),), "prompt probe bias"),
                Artifact(
                    "threshold", ((),), "steer when the prompt-level probe score >= threshold"
                ),
            ),
            collect="residual.post at the steering layers (last token of contrastive pairs) for "
            "the directions; residual.post at the probe layer over prompt tokens "
            "(mean, or last token) of problematic vs benign prompts for the probe",
            derive="kts_directions(pos, neg); probe_from_sets(problematic, benign)",
        ),
        AppSchema(
            "steer_moe",
            "SteerMoE expert (de)activation",
            {
                "paper": "Fayyaz et al. 2026, Steering MoE LLMs via Expert (De)Activation",
                "arxiv": "2509.09660",
                "repo": "https://github.com/adobe-research/SteerMoE",
            },
            (
                Artifact(
                    "mask",
                    (("n_moe", "E"), ("n_layers", "E"), ("E",)),
                    "+1 force on, -1 force off, 0 leave",
                    check="ternary",
                ),
            ),
            collect="router.logits top-k selections at every MoE layer, every token of paired "
            "prompts showing / not showing the behaviour",
            derive="expert_counts(selected, E) -> routing_difference(...) -> steer_moe_mask(delta, ...)",
        ),
    )
}


def _check(app: str, a: Artifact, t: torch.Tensor) -> None:
    where = f"app {app!r}: artifact {a.name!r}"
    if a.check == "nonzero" and not float(t.norm()) > 0:
        raise ArtifactError(f"{where} has zero norm")
    if a.check == "nonnegative" and not bool((t >= 0).all()):
        raise ArtifactError(f"{where} must be >= 0")
    if a.check == "ternary" and not bool(((t == -1) | (t == 0) | (t == 1)).all()):
        bad = sorted(set(t[(t != -1) & (t != 0) & (t != 1)].tolist()))[:5]
        raise ArtifactError(f"{where} must hold only -1, 0 and 1 (found {bad})")
    if a.check == "unit_rows":
        norms = t.reshape(-1, t.shape[-1]).norm(dim=1)
        off = (norms - 1).abs()
        if bool((off > 1e-3).any()):
            i = int(off.argmax())
            raise ArtifactError(
                f"{where}: row {i} has norm {float(norms[i]):.6g}; rows must be unit "
                f"vectors (put magnitudes in the scales)"
            )
    if a.check == "symmetric":
        asym = float((t - t.T).abs().max())
        if asym > 1e-4 * max(1.0, float(t.abs().max())):
            raise ArtifactError(
                f"{where} is not symmetric (max |A - Aᵀ| = {asym:.3g}); the Gaussian "
                f"transport map is symmetric PSD"
            )


def validate_artifacts(
    app: str, artifacts: Mapping[str, Any], dims: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Check ``artifacts`` (name -> tensor or number) against ``SCHEMAS[app]``.

    ``dims`` fixes dimension names (e.g. ``{"d": 4096, "L_sel": 9}``); the others bind to the
    first artifact that uses them and must agree afterwards. Returns the bound dimensions.
    Raises ArtifactError naming the app, the artifact and what was expected.
    """
    if app not in SCHEMAS:
        raise ArtifactError(f"unknown app {app!r}; apps are {', '.join(SCHEMAS)}")
    schema = SCHEMAS[app]
    known = {a.name: a for a in schema.artifacts}
    extra = sorted(set(artifacts) - set(known))
    if extra:
        raise ArtifactError(f"app {app!r}: unknown artifact(s) {extra}; expected {list(known)}")
    bound: dict[str, int] = dict(dims or {})
    for a in schema.artifacts:
        if a.name not in artifacts or artifacts[a.name] is None:
            if a.optional:
                continue
            raise ArtifactError(f"app {app!r}: missing artifact {a.name!r} ({a.doc})")
        value = artifacts[a.name]
        where = f"app {app!r}: artifact {a.name!r}"
        try:
            t = torch.as_tensor(value)
        except Exception:
            raise ArtifactError(
                f"{where} is not a tensor or number ({type(value).__name__})"
            ) from None
        if t.dtype == torch.bool or t.is_complex():
            raise ArtifactError(f"{where} has dtype {t.dtype}; expected {a.dtype}")
        t = t.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(t).all()):
            raise ArtifactError(f"{where} contains NaN or Inf")
        shape = tuple(t.shape)
        match = None
        for alt in a.shapes:
            if len(alt) != len(shape):
                continue
            trial = dict(bound)
            if all(trial.setdefault(nm, n) == n for nm, n in zip(alt, shape)):
                match = trial
                break
        if match is None:

            def show(alt, bound=bound):
                return (
                    "[" + ", ".join(f"{nm}={bound[nm]}" if nm in bound else nm for nm in alt) + "]"
                )

            want = " or ".join(show(alt) for alt in a.shapes)
            raise ArtifactError(f"{where} has shape {list(shape)}; expected {want}")
        bound = match
        _check(app, a, t)
    return bound
