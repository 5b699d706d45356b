"""Sparse autoencoders as xmix artifacts: ``xmix.SAE``.

An SAE holds the tensors and the encoder semantics of one sparse autoencoder, with SAELens's
names and conventions (``sae_lens.SAE``, v6):

    W_enc [d, F]   b_enc [F]   W_dec [F, d]   b_dec [d]   threshold [F] (JumpReLU)

    x_in = norm(x) - b_dec * apply_b_dec_to_input
    pre  = x_in @ W_enc + b_enc
    acts = relu(pre)                           architecture "relu" (SAELens "standard")
         = relu(pre) * (pre > threshold)       "jumprelu"
         = relu(pre) on the k largest pre, 0   "topk" (ties: the lower feature id first)

``norm`` is SAELens's ``normalize_activations`` at inference: "none" (identity),
"constant_norm_rescale" (x * sqrt(d) / ||x||), "layer_norm" ((x - mean) / (std + 1e-5), std
unbiased). SAELens's "expected_average_only_in" is the identity at inference once the
dataset scaling factor is folded into the weights, which is what ``fold_scaling_factor`` and
the importers do (W_enc * s, W_dec / s, b_dec / s), so an xmix SAE never carries it.

The decoder maps activations back to the stream: ``x_hat = denorm(acts @ W_dec + b_dec)``;
``denorm`` undoes a per-token normalisation (divides by the rescale coefficient, or
multiplies by std and adds the mean). ``decoder_scale(x)`` is the factor by which one unit of
a decoder row appears in the stream at x (1 without a per-token normalisation).

An SAE is stored as one safetensors file (its tensors, the config as JSON in the metadata
key ``xmix.sae``; no pickle) and, inside an app file, once per app however many ops use it.
``hook`` names the xmix site it was trained on (``layers.12.residual.post``), when known:
``read("sae", sae=...)`` places the op there unless told otherwise.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("relu", "jumprelu", "topk")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
FORMAT = "xmix.sae/1"
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
MAX_FEATURES = 1 << 24  # feature ids travel as fp32 in the capture buffer: exact below 2^24
_HOOK = re.compile(
    r"^(?:layers\.(\d+)\.(residual\.pre|attention\.post|residual\.mid|mlp\.post|residual\.post)|final\.post)$"
)


class SAEError(ValueError):
    """An SAE that cannot be built, loaded or used; the message names what is wrong."""


def parse_hook(hook: str) -> tuple[str, int | None]:
    """``"layers.12.residual.post"`` -> ("residual.post", 12); ``"final.post"`` -> (.., None)."""
    m = _HOOK.match(hook) if isinstance(hook, str) else None
    if not m:
        raise SAEError(
            f"SAE hook {hook!r} is not an xmix site; expected 'layers.<L>.<site>' with "
            f"site one of residual.pre, attention.post, residual.mid, mlp.post, "
            f"residual.post, or 'final.post'"
        )
    if hook == "final.post":
        return "final.post", None
    return m.group(2), int(m.group(1))


def _tensor(name: str, value, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except Exception:
            raise SAEError(f"SAE tensor {name!r} is not a tensor") from None
    if not value.is_floating_point():
        raise SAEError(f"SAE tensor {name!r} has dtype {value.dtype}; expected a float tensor")
    if tuple(value.shape) != shape:
        raise SAEError(
            f"SAE tensor {name!r} has shape {tuple(value.shape)}; expected {list(shape)}"
        )
    t = value.detach().to("cpu", torch.float32).contiguous()
    if not torch.isfinite(t).all():
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise SAEError(f"SAE tensor {name!r} contains NaN or Inf in fp32 (first at index {bad})")
    return t


class SAE:
    """One sparse autoencoder: tensors, encoder architecture, input normalisation, hook."""

    def __init__(
        self,
        W_enc,
        b_enc,
        W_dec,
        b_dec,
        *,
        architecture: str = "relu",
        threshold=None,
        k: int | None = None,
        apply_b_dec_to_input: bool = False,
        normalize_activations: str = "none",
        hook: str | None = None,
        metadata: dict[str, Any] | None = None,
    ):
        if architecture not in ARCHITECTURES:
            raise SAEError(
                f"SAE architecture {architecture!r} is not supported; xmix runs "
                f"{', '.join(ARCHITECTURES)}"
            )
        if normalize_activations not in NORMALIZATIONS:
            raise SAEError(
                f"SAE normalize_activations {normalize_activations!r} is not supported; "
                f"xmix runs {', '.join(NORMALIZATIONS)} (fold a constant scaling factor "
                f"into the weights with SAE.fold_scaling_factor)"
            )
        if not isinstance(W_enc, torch.Tensor):
            W_enc = torch.as_tensor(W_enc)
        if W_enc.dim() != 2:
            raise SAEError(
                f"SAE tensor 'W_enc' has shape {tuple(W_enc.shape)}; expected [d_in, d_sae]"
            )
        d, F = int(W_enc.shape[0]), int(W_enc.shape[1])
        if d < 1 or F < 1:
            raise SAEError(
                f"SAE tensor 'W_enc' has shape {tuple(W_enc.shape)}; expected [d_in, d_sae]"
            )
        if F >= MAX_FEATURES:
            raise SAEError(f"SAE has {F} features; xmix supports fewer than {MAX_FEATURES}")
        self.W_enc = _tensor("W_enc", W_enc, (d, F))
        self.b_enc = _tensor("b_enc", b_enc, (F,))
        self.W_dec = _tensor("W_dec", W_dec, (F, d))
        self.b_dec = _tensor("b_dec", b_dec, (d,))
        self.architecture = architecture
        self.threshold = None
        if architecture == "jumprelu":
            if threshold is None:
                raise SAEError("a jumprelu SAE needs a per-feature 'threshold' tensor [d_sae]")
            self.threshold = _tensor("threshold", threshold, (F,))
        elif threshold is not None:
            raise SAEError(f"a {architecture} SAE takes no threshold")
        self.k = None
        if architecture == "topk":
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= F:
                raise SAEError(f"a topk SAE needs k with 1 <= k <= d_sae ({F}), got {k!r}")
            self.k = int(k)
        elif k is not None:
            raise SAEError(f"a {architecture} SAE takes no k")
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)
        self.normalize_activations = normalize_activations
        self.hook = hook
        if hook is not None:
            parse_hook(hook)
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._w_enc_t: torch.Tensor | None = None

    # -- shape -----------------------------------------------------------------------------
    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    def __repr__(self) -> str:
        extra = f", k={self.k}" if self.k else ""
        return (
            f"SAE({self.architecture}, d_in={self.d_in}, d_sae={self.d_sae}{extra}, "
            f"hook={self.hook!r})"
        )

    def encoder_rows(self) -> torch.Tensor:
        """W_enc transposed, [F, d] contiguous: one encoder row per feature (kernel layout)."""
        if self._w_enc_t is None:
            self._w_enc_t = self.W_enc.t().contiguous()
        return self._w_enc_t

    def check_features(self, features, what: str = "feature") -> list[int]:
        lst = (
            [features] if isinstance(features, int) and not isinstance(features, bool) else features
        )
        try:
            lst = list(lst)
        except TypeError:
            raise SAEError(f"{what} must be an int or a list of ints, got {features!r}") from None
        if not lst or not all(isinstance(f, int) and not isinstance(f, bool) for f in lst):
            raise SAEError(f"{what} must be an int or a non-empty list of ints, got {features!r}")
        for f in lst:
            if not 0 <= f < self.d_sae:
                raise SAEError(f"{what} {f} is out of range: the SAE has {self.d_sae} features")
        if len(set(lst)) != len(lst):
            raise SAEError(f"{what} list {lst} names a feature twice")
        return [int(f) for f in lst]

    # -- transformations -------------------------------------------------------------------
    def fold_scaling_factor(self, s: float) -> SAE:
        """SAELens's ``fold_activation_norm_scaling_factor``: an SAE trained on x * s becomes
        one that takes x (W_enc * s, W_dec / s, b_dec / s)."""
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise SAEError(f"scaling factor must be a positive finite number, got {s!r}")
        self.W_enc = self.W_enc * s
        self.W_dec = self.W_dec / s
        self.b_dec = self.b_dec / s
        self._w_enc_t = None
        return self

    # -- storage ---------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "d_in": self.d_in,
            "d_sae": self.d_sae,
            "architecture": self.architecture,
            "k": self.k,
            "apply_b_dec_to_input": self.apply_b_dec_to_input,
            "normalize_activations": self.normalize_activations,
            "hook": self.hook,
            "metadata": self.metadata,
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"W_enc": self.W_enc, "b_enc": self.b_enc, "W_dec": self.W_dec, "b_dec": self.b_dec}
        if self.threshold is not None:
            out["threshold"] = self.threshold
        return out

    @staticmethod
    def from_parts(config: Any, tensors: dict[str, torch.Tensor], source: str = "<sae>") -> SAE:
        if not isinstance(config, dict) or config.get("format") != FORMAT:
            got = config.get("format") if isinstance(config, dict) else config
            raise SAEError(f"{source}: unknown SAE format {got!r}; expected {FORMAT!r}")
        missing = [t for t in ("W_enc", "b_enc", "W_dec", "b_dec") if t not in tensors]
        if missing:
            raise SAEError(f"{source}: SAE tensors missing: {missing}")
        try:
            sae = SAE(
                tensors["W_enc"],
                tensors["b_enc"],
                tensors["W_dec"],
                tensors["b_dec"],
                architecture=config.get("architecture", "relu"),
                threshold=tensors.get("threshold"),
                k=config.get("k"),
                apply_b_dec_to_input=bool(config.get("apply_b_dec_to_input", False)),
                normalize_activations=config.get("normalize_activations", "none"),
                hook=config.get("hook"),
                metadata=config.get("metadata") or {},
            )
        except SAEError as e:
            raise SAEError(f"{source}: {e}") from None
        for key in ("d_in", "d_sae"):
            if key in config and config[key] != getattr(sae, key):
                raise SAEError(
                    f"{source}: config says {key}={config[key]}, the tensors "
                    f"have {getattr(sae, key)}"
                )
        return sae

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        save_file(
            self.tensors(),
            str(path),
            metadata={"xmix.sae": json.dumps(self.config(), sort_keys=True)},
        )
        return path

    @staticmethod
    def load(path: str | Path) -> SAE:
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, SafetensorError) as e:
            raise SAEError(f"{path}: not a safetensors SAE file ({e})") from None
        if "xmix.sae" not in meta:
            raise SAEError(
                f"{path}: safetensors file without an xmix SAE config (metadata "
                f"'xmix.sae'); import it with `xmix import sae ...` first"
            )
        try:
            config = json.loads(meta["xmix.sae"])
        except (json.JSONDecodeError, RecursionError) as e:
            raise SAEError(f"{path}: the SAE config is not valid JSON ({e})") from None
        return SAE.from_parts(config, tensors, source=str(path))

    # -- semantics (the reference; the kernels compute the same) -------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations [n, F] of stream rows x [n, d] (fp32)."""
        from xmix.lang import reference as R

        return R.sae_encode(x, self)

    def decoder_scale(self, x: torch.Tensor) -> torch.Tensor:
        from xmix.lang import reference as R

        return R.sae_decoder_scale(x, self)


__all__ = ["SAE", "SAEError", "parse_hook", "ARCHITECTURES", "NORMALIZATIONS"]
