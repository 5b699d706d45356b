"""The lowered program on the wire: a ``LoweredApp`` as data, so an app is lowered once.

The API server that receives a deploy parses and lowers the app (``lowering.lower``, with the
model's tokenizer: token sets are resolved there) and sends this encoding to every worker of
every engine and, through the engines' ledger, to every other API server. They decode it;
none lowers it again (docs/architecture.md, "Deploy path").

Format ``xmix.program/1``: safetensors bytes (8-byte header length, JSON header with the
tensor entries, raw little-endian arrays), never pickle. ``__metadata__["xmix.program"]``
holds the program's JSON: the app's name, metadata and content digest, the model shape it
was lowered for, app parameters, spans, and per lowered op its kernel, site, layer, site id,
result key, parameters (name, default), condition (postfix, below), the kernel's sizes
(``n``, ``m``, state and capture widths, SAE flags, features, top-K), a user kernel's
description, and the names of its artifacts. Arrays: the ops' fp32 artifacts (one entry
per distinct tensor, shared by the ops that name it) and each token set's int32 ids.

An engine does not trust these bytes: ``decode`` checks everything a worker relies on before
anything is placed, and refuses with a ``ProgramError`` naming the field:

- the format tag, the header's size and JSON budget, every tensor entry against the bytes it
  claims (``api._tensor_entries``), no tensor unnamed or missing, dtypes (F32 artifacts, I32
  token ids), and fp32 artifacts finite;
- the model shape equals this engine's (layers, hidden size, vocabulary, experts and MoE
  layers): site ids, artifact lengths and token ids are read against it;
- per op: a known kernel and primitive; site name, layer and site id agree and exist on this
  model (``router.logits`` on an MoE layer only, sites the kernel allows); each artifact's
  exact shape for its kernel (a kernel reads ``d``, ``n * d``, ``F * d`` ... floats from
  these pointers, so a short array would be read past its end); ``n``, ``m``, widths and
  flags as lowering makes them (capture dims within ``d``, SAE features within ``F`` and the
  kernel's bounds, a known SAE architecture and normalisation, the TopK ``k`` within ``F``);
  parameter names in the kernel's ``ParamIndex`` order with values finite and within the
  kernel's and the write bound's ranges (``param_bounds``);
- conditions: known node kinds, comparisons and reductions, the kernel's stack depth,
  token sets, spans, app parameters and reads the app has, ``since(...)`` terms with their
  deciding op, gate order and cycles (``lowering._check_gate_order`` / ``_check_since_order``);
- ops sorted as lowering sorts them, result keys unique, at most one stop.

What is not carried but derived on the engine, so it cannot be forged: parameter columns and
offsets (``param_columns``, the arena places them), result channels, SAE feature aliases,
condition code (``link.emit_cond``), ``OpDesc`` records. A user kernel's library or source
is loaded as the frontend's checked app names it: the frontend refuses custom kernels from
the network (``allow_custom``), and only the frontend's control plane reaches the workers.

A decoded ``LoweredApp.app`` is the app's declaration without its ops (name, metadata,
parameters, token sets as ids); its ops are the lowered ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

import torch

from xmix.lang import conditions as C
from xmix.lang import deploy_work
from xmix.lang.api import App, AppError, CustomKernel, check_json_value
from xmix.lang.app_file import _materialise, _tensor_entries, safetensors_header
from xmix.lang.catalog import KERNELS, MAX_SAE_FEATURES, MAX_TOP_K
from xmix.lang.lowering import (
    DeployError,
    LoweredApp,
    LoweredOp,
    _check_gate_order,
    _check_since_order,
    lower,
    param_bounds,
)
from xmix.lang.lowering.pack import _K, SAE_ARCH, SAE_NORM
from xmix.lang.sites import SITE_NAMES, ModelShape, n_sites, site_id

FORMAT = "xmix.program/1"
META_KEY = "xmix.program"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")
_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_TEXT_MAX = 4 * C.MAX_TEXT  # a label, key or since text
MAX_COND_ITEMS = 4 * C.MAX_TERMS  # postfix items of one condition (atoms and operators)
SHAPE_FIELDS = ("n_layers", "hidden_size", "vocab_size", "n_experts", "moe_layers")
_CUSTOM_FIELDS = ("cpu_library", "cpu_symbol", "cuda_source", "cuda_fatbin", "cuda_symbol")


class ProgramError(DeployError):
    """A lowered program an engine refuses (malformed, forged, or lowered for another
    model); the message names the field."""


# ---------------------------------------------------------------------- the app's digest
def app_digest(app: App) -> str:
    """SHA-256 of an app's content (spec without token sets, which a deployed copy may hold
    resolved to ids, and every tensor's name, dtype, shape and bytes): the same for the same
    app however its file was written (safetensors orders its metadata freely)."""
    spec = app.spec()
    spec.pop("token_sets", None)
    h = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode())
    for name, t in sorted(app.tensors().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------- encode
def program_of(app: App, shape: ModelShape, tokenizer: Any = None) -> bytes:
    """Lower ``app`` for ``shape`` and encode it: what the frontend sends a worker (the
    Registry does the same with its checks of the engine's room; tests call this to reach a
    worker's install path directly)."""
    lw = lower(app, shape, tokenizer)
    lw.digest = app_digest(app)
    return encode(lw)


def _cond_items(node: C.Node | None) -> list[list[Any]] | None:
    """A condition in postfix order (children first): decoded with a stack, no recursion."""
    if node is None:
        return None
    out: list[list[Any]] = []
    stack: list[tuple[C.Node, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        if isinstance(n, (C.And, C.Or)):
            if done:
                out.append(["and" if isinstance(n, C.And) else "or"])
            else:
                stack += [(n, True), (n.b, False), (n.a, False)]
        elif isinstance(n, (C.Not, C.Since)):
            if done:
                out.append(["not" if isinstance(n, C.Not) else "since"])
            else:
                stack += [(n, True), (n.a, False)]
        elif isinstance(n, C.Flag):
            out.append(["flag", n.name])
        elif isinstance(n, C.TokenIn):
            out.append(["token_in", n.set])
        elif isinstance(n, C.InSpan):
            out.append(["in_span", n.open, n.close])
        elif isinstance(n, C.Gate):
            out.append(["gate", n.read, n.cmp, n.value])
        else:
            out.append(["latch", n.reduce, n.read, n.cmp, n.value])
    return out


def encode(lw: LoweredApp) -> bytes:
    """The program of ``lw`` as bytes (``decode`` reads them back), with ``lw.digest``."""
    tensors: dict[str, torch.Tensor] = {}
    keys: dict[tuple[Any, ...], str] = {}

    def key_of(t: torch.Tensor) -> str:
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ident not in keys:
            keys[ident] = f"t{len(keys)}"
            tensors[keys[ident]] = t.detach().to("cpu", torch.float32).contiguous()
        return keys[ident]

    ops = []
    for o in lw.ops:
        ops.append(
            {
                "op_index": o.op_index,
                "label": o.label,
                "primitive": o.primitive,
                "kernel": o.kernel,
                "site": o.site,
                "layer": o.layer,
                "site_id": o.site_id,
                "result_key": o.result_key,
                "artifacts": {slot: key_of(t) for slot, t in o.artifacts.items()},
                "params": [[p, float(v)] for p, v in o.params],
                "cond": _cond_items(o.cond),
                "n": o.n,
                "m": o.m,
                "state_width": o.state_width,
                "capture_width": o.capture_width,
                "custom": o.custom.to_json() if o.custom is not None else None,
                "name": o.name,
                "flags": o.flags,
                "n_channels": o.n_channels,
                "features": [int(f) for f in o.features],
                "top_k": o.top_k,
                "monitor_read": o.monitor_read,
                "sticky": o.sticky,
            }
        )
    token_keys = {}
    for i, (name, ids) in enumerate(lw.token_sets.items()):
        token_keys[name] = f"tokens{i}"
        tensors[f"tokens{i}"] = torch.tensor(ids, dtype=torch.int32)
    s = lw.shape
    program = {
        "format": FORMAT,
        "name": lw.name,
        "digest": lw.digest,
        "metadata": lw.app.metadata,
        "model": {
            "n_layers": s.n_layers,
            "hidden_size": s.hidden_size,
            "vocab_size": s.vocab_size,
            "n_experts": s.n_experts,
            "moe_layers": list(s.moe_layers),
        },
        "app_params": {k: float(v) for k, v in lw.app_params.items()},
        "token_sets": token_keys,
        "spans": [list(sp) for sp in lw.spans],
        # the order the engine numbers result channels and since(...) terms in
        "reads": list(lw.reads),
        "sinces": list(lw.sinces),
        "ops": ops,
    }
    # key order kept: token sets, app parameters and a user kernel's parameters are numbered in it
    return _safetensors(tensors, json.dumps(program, allow_nan=False))


_ST_DTYPES = {torch.float32: "F32", torch.int32: "I32"}


def _safetensors(tensors: dict[str, torch.Tensor], meta: str) -> bytes:
    """safetensors layout, written here: the encoder's tensors may share storage (rows of
    one per-layer array), which safetensors.torch.save refuses."""
    header: dict[str, Any] = {"__metadata__": {META_KEY: meta}}
    blobs, off = [], 0
    for name, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [off, off + len(raw)],
        }
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


# ---------------------------------------------------------------------- decode
class _Reader:
    """Typed access to one JSON object of the program; every miss names the field."""

    def __init__(self, obj: Any, where: str):
        if not isinstance(obj, dict):
            raise ProgramError(f"{where}: expected an object, got {type(obj).__name__}")
        self.obj, self.where = obj, where

    def fail(self, key: str, what: str) -> ProgramError:
        return ProgramError(f"{self.where}: {key!r} {what}")

    def get(self, key: str) -> Any:
        if key not in self.obj:
            raise self.fail(key, "is missing")
        return self.obj[key]

    def int(self, key: str, lo: int = 0, hi: int = 1 << 31) -> int:
        v = self.get(key)
        if type(v) is not int or not lo <= v < hi:
            raise self.fail(key, f"must be an int in [{lo}, {hi}), got {_short(v)}")
        return v

    def text(self, key: str, pattern: re.Pattern[str] | None = None, none: bool = False) -> Any:
        v = self.get(key)
        if v is None and none:
            return None
        if not isinstance(v, str) or len(v) > _TEXT_MAX or (pattern and not pattern.match(v)):
            raise self.fail(key, f"is not a valid name, got {_short(v)}")
        return v

    def number(self, key: str) -> float:
        return _finite(self.get(key), f"{self.where}: {key!r}")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _finite(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ProgramError(f"{what} must be a finite number, got {_short(v)}")
    return float(v)


def decode(data: bytes, shape: ModelShape, source: str = "lowered program") -> LoweredApp:
    """The ``LoweredApp`` of a program, every check above passed; raises ProgramError."""
    deploy_work.count("program_decodes")
    try:
        return _decode(bytes(data), shape, source)
    except ProgramError:
        raise
    except AppError as e:  # the safetensors checks shared with app files
        raise ProgramError(f"{source}: {e}") from None
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RecursionError) as e:
        raise ProgramError(f"{source}: malformed ({type(e).__name__}: {e})") from None


def _decode(data: bytes, shape: ModelShape, source: str) -> LoweredApp:
    header, hlen = safetensors_header(data, source, "an xmix program", ProgramError, ProgramError)
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get(META_KEY), str):
        raise ProgramError(f"{source}: not an xmix program (no {META_KEY!r} in its metadata)")
    entries = _tensor_entries(header, len(data) - 8 - hlen, source)
    try:
        prog = json.loads(meta[META_KEY])
    except (ValueError, RecursionError) as e:
        raise ProgramError(f"{source}: the program is not JSON ({e})") from None
    _Reader(prog, source)  # an object
    named = prog.get("name")
    where = f"{source} (app {named!r})" if isinstance(named, str) and _NAME.match(named) else source
    top = _Reader(prog, where)
    if prog.get("format") != FORMAT:
        raise top.fail("format", f"must be {FORMAT!r}, got {_short(prog.get('format'))}")
    name = top.text("name", _NAME)
    model = _Reader(top.get("model"), f"{where}, model")
    for f in SHAPE_FIELDS:
        want = list(getattr(shape, f)) if f == "moe_layers" else getattr(shape, f)
        if model.get(f) != want:
            raise ProgramError(
                f"{where}: lowered for a model with {f}={_short(model.get(f))}; this engine's "
                f"is {want} (a program is lowered for one model)"
            )
    digest = top.get("digest")
    if not isinstance(digest, str) or not re.fullmatch(r"(?:[0-9a-f]{64})?", digest):
        raise top.fail("digest", "must be a SHA-256 in hex")
    metadata = top.get("metadata")
    try:
        check_json_value(metadata, f"{where}: metadata")
    except AppError as e:
        raise ProgramError(str(e)) from None
    if not isinstance(metadata, dict):
        raise top.fail("metadata", "must be an object")

    # Arrays: each entry named by the program, each checked once.
    used: set[str] = set()

    def array(key: Any, dtype: torch.dtype, what: str) -> torch.Tensor:
        if not isinstance(key, str) or key not in entries:
            raise ProgramError(f"{what} names array {_short(key)}, which the program lacks")
        if entries[key][0] != dtype:
            raise ProgramError(f"{what}: array {key!r} has dtype {entries[key][0]}; needs {dtype}")
        if key not in arrays:
            t = _materialise(data, 8 + hlen, entries, [key])[key].clone()
            if dtype == torch.float32 and not torch.isfinite(t).all():
                raise ProgramError(f"{what}: array {key!r} holds NaN or Inf")
            arrays[key] = t
        used.add(key)
        return arrays[key]

    arrays: dict[str, torch.Tensor] = {}
    app_params: dict[str, float] = {}
    ap = _Reader(top.get("app_params"), f"{where}, app_params")
    for k in ap.obj:
        if not isinstance(k, str) or not _OP_NAME.match(k):
            raise ap.fail(str(k), "is not a valid parameter name")
        app_params[k] = ap.number(k)
    token_sets: dict[str, list[int]] = {}
    ts = _Reader(top.get("token_sets"), f"{where}, token_sets")
    if len(ts.obj) > _K["MAX_TOKEN_SETS"]:
        raise ts.fail("token_sets", f"holds {len(ts.obj)}; at most {_K['MAX_TOKEN_SETS']}")
    for k, key in ts.obj.items():
        if not _NAME.match(k):
            raise ts.fail(k, "is not a valid token set name")
        ids = array(key, torch.int32, f"{where}, token set {k!r}")
        if ids.dim() != 1 or (
            ids.numel()
            and (
                int(ids.min()) < 0
                or int(ids.max()) >= shape.vocab_size
                or bool((ids[1:] <= ids[:-1]).any())
            )
        ):
            raise ProgramError(
                f"{where}, token set {k!r}: ids must be sorted, distinct and in "
                f"[0, {shape.vocab_size}) (the vocabulary)"
            )
        token_sets[k] = ids.tolist()
    spans: list[tuple[str, str]] = []
    raw_spans = top.get("spans")
    if not isinstance(raw_spans, list) or len(raw_spans) > _K["MAX_SPANS"]:
        raise top.fail("spans", f"must be a list of at most {_K['MAX_SPANS']} pairs")
    for sp in raw_spans:
        if not (isinstance(sp, list) and len(sp) == 2 and all(s in token_sets for s in sp)):
            raise ProgramError(f"{where}: span {_short(sp)} is not a pair of its token sets")
        spans.append((sp[0], sp[1]))

    raw_ops = top.get("ops")
    if not isinstance(raw_ops, list):
        raise top.fail("ops", "must be a list")
    ops = [_op(r, i, name, where, shape, app_params, array) for i, r in enumerate(raw_ops)]
    unused = set(entries) - used
    if unused:
        raise ProgramError(f"{where}: arrays {sorted(unused)[:4]} are named by no op")
    order = {k: top.get(k) for k in ("reads", "sinces")}
    for k, v in order.items():
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise top.fail(k, "must be a list of names")
    lw = _assemble(name, where, metadata, shape, ops, token_sets, spans, app_params, digest)
    for k, v in order.items():
        got = getattr(lw, k)
        if sorted(v) != sorted(got) or len(set(v)) != len(v):
            raise top.fail(k, f"must name the app's {k}: {sorted(got)[:8]}")
        setattr(lw, k, {x: got[x] for x in v})
    # an SAE read's features are named in the order of the reads
    lw.aliases = {a: lw.aliases[a] for r in lw.reads for a in lw.aliases if lw.aliases[a][0] == r}
    return lw


def _op(
    raw: Any,
    i: int,
    app: str,
    where: str,
    shape: ModelShape,
    app_params: dict[str, float],
    array: Any,
) -> LoweredOp:
    r = _Reader(raw, f"{where}, op #{i}")
    label = r.text("label")
    r = _Reader(raw, f"{where}, op #{i} ({label})")
    kernel = r.get("kernel")
    if kernel not in KERNELS:
        raise r.fail("kernel", f"is not a kernel xmix has, got {_short(kernel)}")
    spec = KERNELS[kernel]
    primitive = r.get("primitive")
    allowed = ("read", "write") if spec.primitive == "either" else (spec.primitive,)
    if primitive not in allowed:
        raise r.fail("primitive", f"must be {' or '.join(allowed)} for kernel {kernel!r}")
    d, L = shape.hidden_size, shape.n_layers
    site = r.get("site")
    if site not in SITE_NAMES:
        raise r.fail("site", f"is not a site, got {_short(site)}")
    layer = r.get("layer")
    if site == "final.post":
        if layer is not None:
            raise r.fail("layer", "must be null at final.post")
    elif type(layer) is not int or not 0 <= layer < L:
        raise r.fail("layer", f"must be a layer of the model's {L}, got {_short(layer)}")
    sid = r.int("site_id", 0, n_sites(L))
    if sid != site_id(site, layer, L):
        raise r.fail("site_id", f"is {sid}; {site} of layer {layer} is {site_id(site, layer, L)}")
    if spec.sites is not None and site not in spec.sites:
        raise r.fail("site", f"{site!r}: kernel {kernel!r} runs only at {', '.join(spec.sites)}")
    if site == "router.logits":
        if spec.sites is None and kernel != "custom":
            raise r.fail("site", f"router.logits: kernel {kernel!r} does not run on router logits")
        if layer not in shape.moe_layers:
            raise r.fail("layer", f"{layer} has no router (MoE layers: {list(shape.moe_layers)})")
    result_key = r.text("result_key", none=True)
    if (result_key is not None) != (primitive == "read"):
        raise r.fail("result_key", "must be given for a read and only for a read")
    name = r.text("name", _OP_NAME, none=True)
    op_index = r.int("op_index")
    n, m = r.int("n"), r.int("m")
    state_width, capture_width = r.int("state_width"), r.int("capture_width")
    flags, top_k, n_channels = r.int("flags"), r.int("top_k"), r.int("n_channels", 1)
    feats = r.get("features")
    if not isinstance(feats, list) or len(feats) > MAX_SAE_FEATURES:
        raise r.fail("features", f"must be a list of at most {MAX_SAE_FEATURES} ids")
    if not all(type(f) is int and f >= 0 for f in feats) or len(set(feats)) != len(feats):
        raise r.fail("features", "must be distinct non-negative ints")

    # artifacts, by the shape each kernel reads
    slots = _Reader(r.get("artifacts"), f"{r.where}, artifacts")
    arts = {s: array(k, torch.float32, f"{r.where}, artifact {s}") for s, k in slots.obj.items()}
    want: dict[str, tuple[int, ...]] = {}
    E = shape.n_experts
    expect = {"n": 0, "m": 0, "state_width": 0, "capture_width": 0, "flags": 0, "top_k": 0}
    if kernel in ("probe", "add", "ablate", "clamp", "sae_steer"):
        want = {"a0": (d,)}
    elif kernel == "cosine":
        want, expect["state_width"] = {"a0": (d,), "a1": (1,)}, d + 1
    elif kernel == "distance":
        if n < 1:
            raise r.fail("n", "must be at least 1 (centroids)")
        want, expect["n"] = {"a0": (n * d,)}, n
    elif kernel == "affine":
        want = {"a0": (d, d), "a1": (d,), "a2": (d,)}
    elif kernel == "router":
        want, expect["n"] = {"a0": (E,)}, E
    elif kernel == "capture":
        if n < 1 or m + n > d:
            raise r.fail(
                "n", f"capture dims [{m}, {m + n}) must lie within [0, {d}) and be non-empty"
            )
        expect.update(n=n, m=m, capture_width=n)
    elif kernel == "custom":
        if set(arts) - {"a0"} or ("a0" in arts and arts["a0"].dim() != 1):
            raise r.fail("artifacts", "a user kernel takes one 1-D artifact a0 at most")
        want = {"a0": (m,)} if "a0" in arts else {}
        expect["m"] = m if "a0" in arts else 0
    elif kernel in ("sae", "sae_clamp"):
        F = m
        if F < 1:
            raise r.fail("m", "must be the SAE's feature count (at least 1)")
        want = {"a0": (F, d), "a1": (F, d), "a2": (2 * F + d + 1,)}
        if feats:
            want["a3"] = (len(feats),)
        expect.update(m=F, flags=flags)
        arch, norm = flags & _K["SAE_ARCH_MASK"], (flags >> _K["SAE_NORM_SHIFT"]) & 0xF
        known = _K["SAE_ARCH_MASK"] | 0xF << _K["SAE_NORM_SHIFT"] | _K["SAE_B_DEC_IN"]
        known |= _K["SAE_FEATURES"]
        if arch not in SAE_ARCH.values() or norm not in SAE_NORM.values() or flags & ~known:
            raise r.fail("flags", f"{flags:#x} names no SAE architecture/normalisation xmix has")
        if any(f >= F for f in feats):
            raise r.fail("features", f"must be SAE features below {F}")
        listed = bool(flags & _K["SAE_FEATURES"])
        if kernel == "sae_clamp":
            if not feats or listed:
                raise r.fail("features", "a clamp lists its features (and no read flag)")
            expect["n"] = len(feats)
        elif feats:
            if not listed or top_k:
                raise r.fail("features", "a features read has the features flag and no top_k")
            expect.update(n=len(feats))
        else:
            if listed or not 1 <= top_k <= MAX_TOP_K:
                raise r.fail("top_k", f"must be in [1, {MAX_TOP_K}] for a top-K read")
            expect.update(n=top_k, top_k=top_k, capture_width=2 * top_k)
    elif kernel in ("stop", "since"):
        if primitive != "control":
            raise r.fail("primitive", "must be control")
    if set(arts) != set(want):
        raise r.fail(
            "artifacts", f"must be {sorted(want)} for kernel {kernel!r}, got {sorted(arts)}"
        )
    for s, shp in want.items():
        if tuple(arts[s].shape) != shp:
            raise r.fail(
                "artifacts",
                f"{s} has shape {list(arts[s].shape)}; kernel {kernel!r} reads {list(shp)}",
            )
    if kernel == "router" and not torch.isin(arts["a0"], torch.tensor([-1.0, 0.0, 1.0])).all():
        raise r.fail("artifacts", "a router mask holds only -1, 0 and 1")
    if kernel in ("sae", "sae_clamp"):
        if feats and not torch.equal(arts["a3"], torch.tensor(feats, dtype=torch.float32)):
            raise r.fail("artifacts", "a3 must list the op's features")
        k = float(arts["a2"][2 * m + d])
        if k != int(k) or not 0 <= k <= m:
            raise r.fail("artifacts", f"the SAE's k ({k}) must be an int in [0, {m}]")
    got = {"n": n, "m": m, "state_width": state_width, "capture_width": capture_width}
    got.update(flags=flags, top_k=top_k)
    for f, v in expect.items():
        if got[f] != v:
            raise r.fail(f, f"is {got[f]}; kernel {kernel!r} here needs {v}")
    if kernel != "sae" and feats and kernel not in ("sae_clamp", "sae_steer"):
        raise r.fail("features", f"kernel {kernel!r} has none")
    want_channels = len(feats) if kernel == "sae" and feats else 1
    if n_channels != want_channels:
        raise r.fail("n_channels", f"is {n_channels}; needs {want_channels}")

    # parameters: the kernel's, in its ParamIndex order (a user kernel's: its own)
    raw_params = r.get("params")
    if not isinstance(raw_params, list) or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in raw_params
    ):
        raise r.fail("params", "must be a list of [name, default]")
    params = [(p, _finite(v, f"{r.where}, parameter {p!r}")) for p, v in raw_params]
    custom = None
    if kernel == "custom":
        custom = _custom(_Reader(r.get("custom"), f"{r.where}, custom"), primitive, params)
    else:
        if r.get("custom") is not None:
            raise r.fail("custom", f"must be null for kernel {kernel!r}")
        if [p for p, _ in params] != list(spec.params):
            raise r.fail("params", f"must be {list(spec.params)} for kernel {kernel!r}")
        for p, value in params:
            ps = spec.params[p]
            if not ps.lo <= value <= ps.hi:
                raise r.fail("params", f"{p}={value} is outside [{ps.lo}, {ps.hi}]")
        if kernel == "clamp" and params[0][1] > params[1][1]:
            raise r.fail("params", "min is greater than max")

    cond = _cond(r, app_params)
    if kernel in ("stop", "since") and cond is None:
        raise r.fail("cond", f"a {kernel} needs a condition")
    monitor_read = r.text("monitor_read", none=True)
    sticky = r.text("sticky", none=True)
    if kernel == "since":
        if cond is None or sticky != C.to_text(C.Since(cond)):
            raise r.fail("sticky", "must be the text of since(<its condition>)")
    elif sticky is not None:
        raise r.fail("sticky", "is only a since's")
    if monitor_read is not None and kernel not in ("stop", "since"):
        raise r.fail("monitor_read", "is only a monitor's")
    if monitor_read is not None and monitor_read not in C.reads_named(cond):
        raise r.fail("monitor_read", "must be a read its condition names")
    op = LoweredOp(
        app=app,
        op_index=op_index,
        label=label,
        primitive=primitive,
        kernel=kernel,
        site=site,
        layer=layer,
        site_id=sid,
        result_key=result_key,
        artifacts=arts,
        params=params,
        cond=cond,
        n=n,
        m=m,
        state_width=state_width,
        capture_width=capture_width,
        custom=custom,
        name=name,
        flags=flags,
        n_channels=n_channels,
        features=list(feats),
        top_k=top_k,
        monitor_read=monitor_read,
        sticky=sticky,
    )
    for p, (lo, hi) in param_bounds(op).items():
        v = dict(params)[p]
        if not lo <= v <= hi:
            raise r.fail("params", f"{p}={v} would write beyond the write bound: [{lo:g}, {hi:g}]")
    return op


def _custom(c: _Reader, primitive: str, params: list[tuple[str, float]]) -> CustomKernel:
    unknown = set(c.obj) - {"primitive", "params", *_CUSTOM_FIELDS}
    if unknown:
        raise c.fail(sorted(unknown)[0], "is not a field of a user kernel")
    fields: dict[str, Any] = {}
    for f in _CUSTOM_FIELDS:
        v = c.obj.get(f)
        if v is not None and not isinstance(v, str):
            raise c.fail(f, "must be a string")
        fields[f] = v
    if c.obj.get("primitive") != primitive:
        raise c.fail("primitive", f"must be the op's ({primitive})")
    own = c.obj.get("params") or {}
    if not isinstance(own, dict) or [[k, v] for k, v in own.items()] != [list(p) for p in params]:
        raise c.fail("params", "must be the op's parameters")
    return CustomKernel(primitive=primitive, params=dict(params), **fields)


def _cond(r: _Reader, app_params: dict[str, float]) -> C.Node | None:
    items = r.get("cond")
    if items is None:
        return None
    if not isinstance(items, list) or not 0 < len(items) <= MAX_COND_ITEMS:
        raise r.fail("cond", f"must be a list of 1 to {MAX_COND_ITEMS} postfix items")
    stack: list[C.Node] = []

    def value(v: Any) -> float | str:
        if isinstance(v, str):
            if v not in app_params:
                raise r.fail("cond", f"compares with {v!r}, which is not an app parameter")
            return v
        return _finite(v, f"{r.where}: a condition's constant")

    for it in items:
        if not isinstance(it, list) or not it or not isinstance(it[0], str):
            raise r.fail("cond", f"item {_short(it)} is not [kind, ...]")
        kind, args = it[0], it[1:]
        arity = {"flag": 1, "token_in": 1, "in_span": 2, "gate": 3, "latch": 4}
        if kind in arity:
            if len(args) != arity[kind] or not all(
                isinstance(a, str) for a in args[: arity[kind] - (kind in ("gate", "latch"))]
            ):
                raise r.fail("cond", f"item {_short(it)} is malformed")
        if kind == "flag" and args[0] in C.FLAGS:
            stack.append(C.Flag(args[0]))
        elif kind == "token_in":
            stack.append(C.TokenIn(args[0]))
        elif kind == "in_span":
            stack.append(C.InSpan(args[0], args[1]))
        elif kind == "gate" and args[1] in C.CMPS:
            stack.append(C.Gate(args[0], args[1], value(args[2])))
        elif kind == "latch" and args[0] in C.REDUCES and args[2] in C.CMPS:
            stack.append(C.Latch(args[0], args[1], args[2], value(args[3])))
        elif kind in ("and", "or") and len(args) == 0 and len(stack) >= 2:
            b, a = stack.pop(), stack.pop()
            stack.append(C.And(a, b) if kind == "and" else C.Or(a, b))
        elif kind in ("not", "since") and len(args) == 0 and stack:
            a = stack.pop()
            if kind == "since" and any(isinstance(x, C.Since) for x in C.walk(a)):
                raise r.fail("cond", "a since(...) cannot contain another")
            stack.append(C.Not(a) if kind == "not" else C.Since(a))
        else:
            raise r.fail("cond", f"item {_short(it)} is not a condition node xmix has")
    if len(stack) != 1:
        raise r.fail("cond", f"leaves {len(stack)} nodes, not one")
    if C.stack_depth(stack[0]) > _K["MAX_COND_STACK"]:
        raise r.fail("cond", f"needs a stack deeper than {_K['MAX_COND_STACK']}")
    return stack[0]


def _assemble(
    name: str,
    where: str,
    metadata: dict,
    shape: ModelShape,
    ops: list[LoweredOp],
    token_sets: dict[str, list[int]],
    spans: list[tuple[str, str]],
    app_params: dict[str, float],
    digest: str,
) -> LoweredApp:
    """The app-level tables, derived from the ops as lowering derives them, and the checks
    across ops."""
    order = [(o.site_id, o.is_control, o.op_index) for o in ops]
    if order != sorted(order) or len(set(order)) != len(ops):
        raise ProgramError(f"{where}: ops are not in site order, one per op and site")
    reads: dict[str, LoweredOp] = {}
    aliases: dict[str, tuple[str, int]] = {}
    sinces: dict[str, LoweredOp] = {}
    for o in ops:
        if o.result_key is not None:
            if o.result_key in reads:
                raise ProgramError(f"{where}: result key {o.result_key!r} is used twice")
            reads[o.result_key] = o
            if o.kernel == "sae" and o.features:
                for i, f in enumerate(o.features):
                    aliases[f"{o.result_key}.f{f}"] = (o.result_key, i)
        if o.kernel == "since":
            assert o.sticky is not None  # _op checks it
            if o.sticky in sinces:
                raise ProgramError(f"{where}: {o.sticky} is decided twice")
            sinces[o.sticky] = o
    if set(aliases) & set(reads):
        raise ProgramError(f"{where}: a result key is also an SAE feature's name")
    if sum(o.kernel == "stop" for o in ops) > 1:
        raise ProgramError(f"{where}: more than one stop")
    for o in ops:
        for node in C.walk(o.cond) if o.cond is not None else ():
            what = f"{where}, op {o.label}"
            if isinstance(node, C.TokenIn) and node.set not in token_sets:
                raise ProgramError(f"{what}: token set {node.set!r} is not the app's")
            if isinstance(node, C.InSpan) and (node.open, node.close) not in spans:
                raise ProgramError(f"{what}: in_span({node.open}, {node.close}) is not a span")
            if isinstance(node, C.Since) and C.to_text(node) not in sinces:
                raise ProgramError(f"{what}: {C.to_text(node)} has no op deciding it")
        if (
            o.monitor_read is not None
            and o.monitor_read not in reads
            and o.monitor_read not in aliases
        ):
            raise ProgramError(f"{where}, op {o.label}: monitor_read names no read of the app")
    app = App(name, metadata=metadata)
    for k, v in app_params.items():
        app.param(k, v)
    for k, ids in token_sets.items():
        app.token_set(k, ids=ids)
    try:
        _check_gate_order(name, ops, reads, aliases)
        _check_since_order(name, ops, sinces, shape)
    except DeployError as e:
        raise ProgramError(f"{where}: {e}") from None
    return LoweredApp(
        name=name,
        app=app,
        shape=shape,
        ops=ops,
        token_sets=token_sets,
        spans=spans,
        app_params=app_params,
        reads=reads,
        aliases=aliases,
        sinces=sinces,
        digest=digest,
    )
