"""An app file: one safetensors file whose header carries the app's JSON spec
(``App.save`` / ``App.to_bytes`` write it). Reading one is the path every untrusted app takes
(HTTP deploys, the state directory, ``App.load``), so nothing is trusted before it is checked:
the header length, the JSON's size before it is parsed, every tensor entry against the bytes
it claims, the spec's op count and artifact bytes against the limits (``XMIX_MAX_APP_*``);
only then are the tensors the spec names read, and the App built op by op through its own
builder (``app_from_spec``), which checks the rest.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

import torch

from xmix import settings
from xmix.lang.api import FORMAT, OP_NAME, SHOWN, App, AppError, LimitError
from xmix.lang.catalog import SAE_KERNELS

if TYPE_CHECKING:
    from xmix.lang.sae import SAE

# An app file's JSON (safetensors header, xmix spec) is refused before it is parsed when it
# could build more Python objects than this: every value costs at least one separator or
# bracket, so counting those bytes bounds the parse's memory (~100 bytes an object).
MAX_JSON_VALUES = 1 << 20
MAX_TENSORS = 1 << 16
MAX_TENSOR_DIMS = 8
# safetensors dtype -> (torch dtype, bytes per element); others (BOOL, U8, F8_*, complex) are
# refused: an artifact is a float (or integer) tensor.
SAFETENSORS_DTYPES = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
}
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def max_app_header_bytes() -> int:
    """Largest safetensors header (the JSON with the xmix spec) an app file may have
    (``XMIX_MAX_APP_HEADER_BYTES``, default 16 MiB)."""
    return int(settings.get("XMIX_MAX_APP_HEADER_BYTES"))


def max_app_ops() -> int:
    """Ops one app may declare (``XMIX_MAX_APP_OPS``); checked in the spec before any
    artifact is copied. Lowered ops (one per layer) are bounded by the control block."""
    return int(settings.get("XMIX_MAX_APP_OPS"))


def max_artifact_bytes() -> int:
    """Bytes of one app's distinct artifacts as fp32, the form every process keeps
    (``XMIX_MAX_ARTIFACT_BYTES``, default 1 GiB); checked before any artifact is copied."""
    return int(settings.get("XMIX_MAX_ARTIFACT_BYTES"))


def safetensors_header(
    data: bytes,
    source: str,
    kind: str,
    error: type[Exception] = AppError,
    limit_error: type[Exception] = LimitError,
) -> tuple[dict[str, Any], int]:
    """The JSON header of safetensors bytes (an app file, a lowered program) and its length.
    Every claim of the framing is checked against the bytes and the JSON is bounded before it
    is parsed; ``kind`` names what the bytes should be in the errors."""
    if len(data) < 8:
        raise error(f"{source}: not {kind} (too short for safetensors)")
    hlen = int.from_bytes(data[:8], "little")
    if hlen == 0 or hlen > len(data) - 8:
        raise error(
            f"{source}: not {kind} (its header claims {hlen} bytes; the "
            f"file has {len(data) - 8} after the length)"
        )
    if hlen > max_app_header_bytes():
        raise limit_error(
            f"{source}: header of {hlen} bytes; at most {max_app_header_bytes()} "
            f"(XMIX_MAX_APP_HEADER_BYTES)"
        )
    _json_budget(data, source, "header", 8, 8 + hlen)
    try:
        header = json.loads(data[8 : 8 + hlen])
    except RecursionError:
        raise error(f"{source}: not {kind} (header nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{source}: not {kind} (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise error(f"{source}: not {kind} (header is not an object)")
    return header, hlen


def _json_budget(
    text: bytes | str, source: str, what: str, start: int = 0, end: int | None = None
) -> None:
    """Refuse JSON that could build more than MAX_JSON_VALUES objects, before parsing it
    (``text[start:end]``, counted in place)."""
    end = len(text) if end is None else end
    if isinstance(text, bytes):
        n = sum(text.count(c, start, end) for c in (b"{", b"[", b",", b":"))
    else:
        n = sum(text.count(c, start, end) for c in ("{", "[", ",", ":"))
    if n > MAX_JSON_VALUES:
        raise LimitError(
            f"{source}: the {what} has {n} JSON separators; at most {MAX_JSON_VALUES} "
            f"(an app's spec is far smaller)"
        )


def _tensor_entries(header: dict[str, Any], n_data: int, source: str) -> dict[str, tuple[Any, ...]]:
    """Check a safetensors header's tensor entries against the data they claim, without
    reading the data: name -> (torch dtype, shape, begin, end)."""
    if len(header) > MAX_TENSORS:
        raise LimitError(f"{source}: {len(header)} tensors; at most {MAX_TENSORS}")
    out: dict[str, tuple[Any, ...]] = {}
    spans = []
    for name, info in header.items():
        if not isinstance(name, str) or not name or len(name) > 256 or _CONTROL_CHARS.search(name):
            raise AppError(
                f"{source}: tensor name {SHOWN.repr(name)} is not valid (1 to 256 "
                f"characters, no control characters)"
            )
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise AppError(f"{source}: tensor {name!r}: entry must have dtype, shape, data_offsets")
        dt = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dt is None:
            raise AppError(
                f"{source}: tensor {name!r} has dtype {SHOWN.repr(info['dtype'])}; "
                f"artifacts are one of {sorted(SAFETENSORS_DTYPES)}"
            )
        shape, offs = info["shape"], info["data_offsets"]
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_TENSOR_DIMS
            or not all(type(n) is int and n >= 0 for n in shape)
        ):
            raise AppError(
                f"{source}: tensor {name!r}: shape must be a list of at most "
                f"{MAX_TENSOR_DIMS} non-negative ints"
            )
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1] <= n_data
        ):
            raise AppError(
                f"{source}: tensor {name!r}: data_offsets {SHOWN.repr(offs)} are outside "
                f"the file's {n_data} data bytes (truncated file?)"
            )
        numel = math.prod(shape)
        if numel * dt[1] != offs[1] - offs[0]:
            raise AppError(
                f"{source}: tensor {name!r}: shape {shape} of {info['dtype']} is "
                f"{numel * dt[1]} bytes, its data_offsets span {offs[1] - offs[0]}"
            )
        out[name] = (dt[0], shape, offs[0], offs[1])
        spans.append((offs[0], offs[1], name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise AppError(f"{source}: tensors {n0!r} and {n1!r} overlap in the file")
    return out


class _Sized:
    """A tensor entry not read yet: what the size checks need (numel)."""

    def __init__(self, shape: list[int]):
        self.shape = shape

    def numel(self) -> int:
        return math.prod(self.shape)


def _materialise(
    data: bytes, base: int, entries: dict[str, tuple[Any, ...]], names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """Zero-copy views of the named tensors in ``data`` (the app copies what it keeps)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer on read-only bytes: nothing writes them
        for name in names:
            dtype, shape, b, e = entries[name]
            n = math.prod(shape)
            t = (
                torch.frombuffer(data, dtype=dtype, count=n, offset=base + b)
                if n
                else torch.empty(0, dtype=dtype)
            )
            out[name] = t.reshape(shape)
    return out


def _referenced(spec: Any, names: Collection[str]) -> list[str]:
    """Tensor names an app spec uses: op artifacts and every tensor of a named SAE."""
    if not isinstance(spec, dict):
        return []
    keys: set[str] = set()
    ops = spec.get("ops")
    for o in ops if isinstance(ops, list) else []:
        arts = o.get("artifacts") if isinstance(o, dict) else None
        if isinstance(arts, dict):
            keys.update(k for k in arts.values() if isinstance(k, str))
    saes = spec.get("saes")
    if isinstance(saes, dict):
        prefixes = tuple(f"{k}." for k in saes if isinstance(k, str))
        keys.update(n for n in names if n.startswith(prefixes))
    return [k for k in keys if k in names]


def _check_spec_size(
    spec: dict[str, Any], tensors: dict[str, torch.Tensor] | dict[str, _Sized], source: str
) -> None:
    """Op count and artifact bytes of a spec, before any op is built or artifact copied.
    Artifacts are counted once per distinct file key (ops naming one key share it)."""
    ops = spec.get("ops") or []
    if not isinstance(ops, list):
        raise AppError(f"{source}: malformed app spec (ops must be a list)")
    limit = max_app_ops()
    if len(ops) > limit:
        raise LimitError(f"{source}: {len(ops)} ops; at most {limit} per app (XMIX_MAX_APP_OPS)")
    keys: set[str] = set()
    for o in ops:
        arts = o.get("artifacts") if isinstance(o, dict) else None
        if isinstance(arts, dict):
            keys.update(k for k in arts.values() if isinstance(k, str) and k in tensors)
    saes = spec.get("saes")
    if isinstance(saes, dict):
        prefixes = tuple(f"{k}." for k in saes if isinstance(k, str))
        keys.update(k for k in tensors if k.startswith(prefixes))
    total = sum(4 * tensors[k].numel() for k in keys)
    limit = max_artifact_bytes()
    if total > limit:
        raise LimitError(
            f"{source}: artifacts take {total} bytes as fp32; at most {limit} per app "
            f"(XMIX_MAX_ARTIFACT_BYTES)"
        )


def _saes_from_spec(saes: Any, tensors: dict[str, torch.Tensor], source: str) -> dict[str, SAE]:
    from xmix.lang.sae import SAE, SAEError

    if not isinstance(saes, dict):
        raise AppError(f"{source}: 'saes' must be an object of name: SAE config")
    out = {}
    for key, cfg in saes.items():
        if not isinstance(key, str) or not OP_NAME.match(key):
            raise AppError(f"{source}: SAE name {key!r} is not valid")
        prefix = key + "."
        parts = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
        try:
            out[key] = SAE.from_parts(cfg, parts, source=f"{source}, SAE {key!r}")
        except SAEError as e:
            raise AppError(str(e)) from None
    return out


def app_from_bytes(data: bytes, source: str = "<bytes>", allow_custom: bool = False) -> App:
    """Parse an app file. ``allow_custom=False`` (the network path) refuses apps that
    would load code (custom kernels)."""
    # Parsed here rather than by safetensors.torch.load, which copies every tensor of the
    # file before anything is checked: each claim of the header is checked against the
    # bytes first, the JSON is bounded before it is parsed, and only the tensors the spec
    # names are read (once the spec's sizes passed the limits).
    header, hlen = safetensors_header(data, source, "an xmix app file")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise AppError(f"{source}: not an xmix app file (__metadata__ must map names to strings)")
    entries = _tensor_entries(header, len(data) - 8 - hlen, source)
    if "xmix.spec" not in meta:
        raise AppError(f"{source}: safetensors file without an xmix spec (metadata 'xmix.spec')")
    _json_budget(meta["xmix.spec"], source, "xmix spec")
    try:
        spec = json.loads(meta["xmix.spec"])
    except json.JSONDecodeError as e:
        raise AppError(f"{source}: the xmix spec is not valid JSON ({e})") from None
    except RecursionError:
        raise AppError(f"{source}: the xmix spec is nested too deeply") from None
    if isinstance(spec, dict):
        _check_spec_size(spec, {k: _Sized(v[1]) for k, v in entries.items()}, source)
    tensors = _materialise(data, 8 + hlen, entries, _referenced(spec, entries))
    return app_from_spec(spec, tensors, source=source, allow_custom=allow_custom)


def app_from_spec(
    spec: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    source: str = "<spec>",
    allow_custom: bool = False,
) -> App:
    """An App from its spec and the tensors the spec names (checked, then copied)."""
    if not isinstance(spec, dict) or spec.get("format") != FORMAT:
        raise AppError(
            f"{source}: unknown app format {spec.get('format') if isinstance(spec, dict) else spec!r}; "
            f"expected {FORMAT!r}"
        )
    try:
        _check_spec_size(spec, tensors, source)
        app = App(spec["name"], metadata=spec.get("metadata") or {})
        for k, v in (spec.get("params") or {}).items():
            app.param(k, v)
        for ts in spec.get("token_sets") or []:
            app.token_set(
                ts["name"],
                ids=ts.get("ids"),
                strings=ts.get("strings"),
                contains=ts.get("contains"),
            )
        saes = _saes_from_spec(spec.get("saes") or {}, tensors, source)
        for i, o in enumerate(spec.get("ops") or []):
            kwargs: dict[str, Any] = {}
            for a, key in (o.get("artifacts") or {}).items():
                if key not in tensors:
                    raise AppError(
                        f"{source}: op #{i} names artifact {key!r} that the file does not contain"
                    )
                kwargs[a] = tensors[key]
            if o["kernel"] == "custom":
                if not allow_custom:
                    raise AppError(
                        f"{source}: op #{i} is a custom kernel; apps with custom "
                        f"kernels load code and are only accepted from local files "
                        f"(xmix serve --app), never over the network"
                    )
                c = dict(o.get("custom") or {})
                c.pop("primitive", None)
                kwargs.update(c)
            else:
                kwargs.update(o.get("params") or {})
                kwargs.update(o.get("options") or {})
            if o["kernel"] in SAE_KERNELS:
                if o.get("sae") not in saes:
                    raise AppError(
                        f"{source}: op #{i} names SAE {o.get('sae')!r} that the "
                        f"file does not contain"
                    )
                kwargs["sae"] = saes[o["sae"]]
            op = app._op(o["primitive"], o["kernel"], kwargs)
            if o.get("layers") is not None:
                op.layers(o["layers"])
            if o.get("site") is not None:
                op.at(o["site"])
            if o.get("name"):
                op.named(o["name"])
            cond = o.get("cond") or {}
            if cond:
                op.cond(cond.get("expr"), when=cond.get("when"), gate=cond.get("gate"))
    except AppError:
        raise
    except (
        KeyError,
        TypeError,
        AttributeError,
        ValueError,
        OverflowError,
        RecursionError,
    ) as e:
        raise AppError(f"{source}: malformed app spec ({type(e).__name__}: {e})") from None
    return app
