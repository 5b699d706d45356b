"""Read results as arrays, from the drain to the response, and their encodings.

A read's results for one request are a ``ReadResult``: positions and values as numpy arrays
(plus feature ids for SAE reads), kept as arrays through the worker, the engine core and the
frontend; only the response (or ``xmix.results(out)``) turns them into what the client asked
for. Nothing on the way builds a Python list per value.

A ``ReadResult`` is also a read-only mapping with the keys ``positions`` and ``values`` in the
default JSON shape of the results (lists; a list per position for ``capture``; an object of
``ids`` and ``acts`` per position for SAE reads), so code written against that shape keeps
working.

Per request (keys of the xmix control, parsed by ``parse_options``):
    "encoding": "json" (default) | "base64"   raw little-endian values, base64
    "compression": "zstd"                      with "base64": each array zstd-compressed
    "dtype": "float32" | "bfloat16" | "float16"  values (and SAE activations) rounded to it
    "positions": which positions a read reports, on top of its condition: "prompt",
        "generated", "last_token" (the positions whose logits are sampled: the last prompt
        token and every generated token fed back), [start, stop] ranges (stop exclusive,
        null = open; a negative bound makes the range a Python slice of the prompt:
        [-1, null] is the last prompt token), or a list of those (their union)
    "max_result_bytes": a cap on the request's result bytes, at most the server's
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from xmix import settings

ERROR_KEY = "!error"  # a worker could not serve the request (the frontend ends it)
TRUNCATED_KEY = "!truncated"  # the request's results were cut at its byte cap
# apps the engine left out of the request because the version it was admitted with is gone
# there (a change through another API server, or between admission and scheduling): the
# frontend names them in the request's provenance (``xmix_applied.changed``)
DROPPED_KEY = "!dropped"
# monitors: the stop that ended the request ({app, read, position, value}) and the since(...)
# terms that started to hold ([{app, read, position, condition}]); the frontend moves both to
# the request's provenance (``xmix_applied.stopped`` / ``.switched``)
STOPPED_KEY = "!stopped"
SWITCHED_KEY = "!switched"
SPECIAL_KEYS = (ERROR_KEY, TRUNCATED_KEY, DROPPED_KEY, STOPPED_KEY, SWITCHED_KEY)

KINDS = ("scalar", "vector", "topk", "features")
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
ENCODINGS = ("json", "base64")
COMPRESSIONS = ("zstd",)
OPTION_KEYS = {"encoding", "compression", "dtype", "positions", "max_result_bytes"}
WINDOW_NAMES = ("prompt", "generated", "last_token")
MAX_WINDOW_ITEMS = 64

# Bytes a number is accounted at in a JSON response (the longest the encoder writes,
# "-1.2345678901234567e-308", plus ", "), and an SAE position's {"ids": , "acts": } wrapper.
JSON_BYTES_PER_NUMBER = 26
JSON_BYTES_PER_SAE_POSITION = 24


def max_result_bytes() -> int:
    """The server's cap on one request's read results (``XMIX_MAX_RESULT_BYTES``)."""
    return int(settings.get("XMIX_MAX_RESULT_BYTES"))


def max_response_bytes() -> int:
    """The server's cap on the read results of one HTTP response, all its prompts and choices
    together (``XMIX_MAX_RESPONSE_BYTES``; a key's policy may set its own)."""
    return int(settings.get("XMIX_MAX_RESPONSE_BYTES"))


# ---------------------------------------------------------------------- dtypes
def to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in the storage form of ``dtype``: float32, float16, or bfloat16 as
    uint16 bit patterns (rounded to nearest even, as torch and the kernels round)."""
    if dtype == "float32":
        return np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "float16":
        return np.asarray(values, dtype=np.float32).astype(np.float16)
    import torch

    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)


def to_tensor(values: np.ndarray, dtype: str):
    import torch

    a = np.ascontiguousarray(values)
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


# ---------------------------------------------------------------------- one read
class ReadResult(Mapping):
    """One read's results for one request (one sequence), in position order.

    kind: "scalar" (values (n,)), "vector" (capture: values (n, width)), "topk" (SAE top-K:
    values = activations (n, K) and ids (n, K), -1 where fewer features were active),
    "features" (SAE listed features: values (n, F), ``features`` the F feature ids)."""

    __slots__ = ("kind", "dtype", "features", "_parts")
    _KEYS = ("positions", "values")

    def __init__(self, kind: str, dtype: str = "float32", features: tuple[int, ...] = ()):
        self.kind = kind
        self.dtype = dtype
        self.features = tuple(features)
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []

    @classmethod
    def of(
        cls,
        kind: str,
        positions,
        values,
        ids=None,
        dtype: str = "float32",
        features: Iterable[int] = (),
    ) -> ReadResult:
        r = cls(kind, dtype, tuple(features))
        r.add(positions, values, ids)
        return r

    @classmethod
    def views(
        cls,
        kind: str,
        positions: np.ndarray,
        values: np.ndarray,
        ids: np.ndarray | None,
        dtype: str,
        features: Iterable[int],
    ) -> ReadResult:
        """``of`` for arrays already in their stored types (positions int32, values in
        ``dtype``'s storage form, ids int32) and not empty: the drain's per-request views of
        its per-step arrays, kept as they are."""
        r = cls.__new__(cls)
        r.kind, r.dtype, r.features = kind, dtype, tuple(features)
        r._parts = [(positions, values, ids)]
        return r

    def add(self, positions, values, ids=None) -> None:
        pos = np.asarray(positions, dtype=np.int32)
        if len(pos):
            self._parts.append(
                (pos, np.asarray(values), None if ids is None else np.asarray(ids, dtype=np.int32))
            )

    def extend(self, other: ReadResult) -> ReadResult:
        if other.kind != self.kind or other.dtype != self.dtype:
            raise ValueError(
                f"cannot append {other.kind}/{other.dtype} results to {self.kind}/{self.dtype}"
            )
        self._parts.extend(other._parts)
        return self

    def copy(self) -> ReadResult:
        r = ReadResult(self.kind, self.dtype, self.features)
        r._parts = list(self._parts)  # arrays are never written after they are made
        return r

    def _joined(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if len(self._parts) != 1:
            if not self._parts:
                return np.zeros(0, np.int32), np.zeros(0, np.float32), None
            ps, vs, ids = zip(*self._parts)
            self._parts = [
                (
                    np.concatenate(ps),
                    np.concatenate(vs),
                    None if ids[0] is None else np.concatenate(ids),
                )
            ]
        return self._parts[0]

    # arrays
    @property
    def n(self) -> int:
        return sum(len(p) for p, _, _ in self._parts)

    @property
    def positions(self) -> np.ndarray:
        return self._joined()[0]

    @property
    def values(self) -> np.ndarray:  # type: ignore[override]  # the array; r["values"] is the JSON list
        """In the storage form of ``dtype`` (bfloat16 as uint16 bit patterns)."""
        return self._joined()[1]

    @property
    def ids(self) -> np.ndarray | None:
        if self.kind == "features":
            return np.asarray(self.features, dtype=np.int32)
        return self._joined()[2]

    def topk_ids(self) -> np.ndarray:
        """The ids of a top-k SAE read (every top-k read holds them)."""
        ids = self.ids
        if ids is None:
            raise ValueError(f"a {self.kind} read has no feature ids")
        return ids

    def values_f32(self) -> np.ndarray:
        return to_float32(self.values, self.dtype)

    def head(self, k: int) -> ReadResult:
        """The first k positions."""
        pos, val, ids = self._joined()
        return ReadResult.of(
            self.kind, pos[:k], val[:k], None if ids is None else ids[:k], self.dtype, self.features
        )

    def nbytes(self) -> int:
        return sum(p.nbytes + v.nbytes + (0 if i is None else i.nbytes) for p, v, i in self._parts)

    # the default (JSON) shape, as a mapping
    def __getitem__(self, key: str):
        if key == "positions":
            return self.positions.tolist()
        if key == "values":
            return self.json_values()
        raise KeyError(key)

    def __iter__(self):
        return iter(self._KEYS)

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"ReadResult({self.kind}, {self.dtype}, n={self.n})"

    def json_values(self) -> list:
        v = self.values_f32()
        if self.kind == "topk":
            ids = self.topk_ids()
            counts = np.count_nonzero(ids >= 0, axis=1).tolist()
            return [
                {"ids": i[:c], "acts": a[:c]} for i, a, c in zip(ids.tolist(), v.tolist(), counts)
            ]
        if self.kind == "features":
            feats = list(self.features)
            return [{"ids": list(feats), "acts": a} for a in v.tolist()]
        return v.tolist()

    def to_lists(self) -> dict:
        return {"positions": self["positions"], "values": self["values"]}

    def tensors(self) -> dict:
        """{"positions": int64 (n,), "values": (n,) / (n, width) / (n, K) in ``dtype``,
        "ids": int64 (n, K) of SAE reads (-1 = no feature; listed features on every row)}."""
        import torch

        out = {
            "positions": torch.from_numpy(self.positions.astype(np.int64)),
            "values": to_tensor(self.values, self.dtype),
        }
        if self.kind == "topk":
            out["ids"] = torch.from_numpy(self.topk_ids().astype(np.int64))
        elif self.kind == "features":
            out["ids"] = (
                torch.tensor(self.features, dtype=torch.int64).expand(self.n, -1).contiguous()
            )
        return out

    # between processes (msgpack carries bytes, not arrays of unknown types)
    def pack(self) -> dict:
        pos, val, ids = self._joined()
        d = {
            "k": self.kind,
            "dt": self.dtype,
            "p": pos.tobytes(),
            "v": val.tobytes(),
            "s": list(val.shape[1:]),
        }
        if ids is not None:
            d["i"] = ids.tobytes()
        if self.features:
            d["f"] = list(self.features)
        return d

    @classmethod
    def unpack(cls, d: dict) -> ReadResult:
        dtype = d["dt"]
        store = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]
        pos = np.frombuffer(d["p"], dtype=np.int32)
        val = np.frombuffer(d["v"], dtype=store).reshape(len(pos), *d["s"])
        ids = np.frombuffer(d["i"], dtype=np.int32).reshape(val.shape) if "i" in d else None
        r = cls.__new__(cls)  # the arrays are already in their stored types
        r.kind, r.dtype, r.features = d["k"], dtype, tuple(d.get("f", ()))
        r._parts = [(pos, val, ids)] if len(pos) else []
        return r


# ---------------------------------------------------------------------- a request's results
# {app: {read: ReadResult}}, plus SPECIAL_KEYS -> str


def merge_results(into: dict, new: dict) -> dict:
    """Append ``new`` to ``into`` in step order (``into`` is changed; ``new``'s results are
    shared, never changed)."""
    for app, reads in new.items():
        if app == SWITCHED_KEY:  # one entry per since(...) term, in step order
            into[app] = [*into.get(app, ()), *reads]
            continue
        if app in SPECIAL_KEYS:
            into.setdefault(app, reads)
            continue
        dst = into.setdefault(app, {})
        for key, r in reads.items():
            have = dst.get(key)
            if have is None:
                dst[key] = r.copy() if isinstance(r, ReadResult) else r
            elif isinstance(have, ReadResult):
                have.extend(r)
            else:  # a plain {positions, values} mapping (results made outside the drain)
                have["positions"].extend(r["positions"])
                have["values"].extend(r["values"])
    return into


def copy_results(res: dict) -> dict:
    return {
        app: (
            reads
            if app in SPECIAL_KEYS
            else {k: (r.copy() if isinstance(r, ReadResult) else r) for k, r in reads.items()}
        )
        for app, reads in res.items()
    }


def pack_results(res: dict) -> dict:
    return {
        app: (reads if app in SPECIAL_KEYS else {k: r.pack() for k, r in reads.items()})
        for app, reads in res.items()
    }


def merge_packed(have: dict, new: dict) -> dict:
    """Two steps' packed results of one request as one packed result, in step order (neither
    is changed)."""
    return pack_results(merge_results(unpack_results(have), unpack_results(new)))


def unpack_results(d: dict) -> dict:
    return {
        app: (reads if app in SPECIAL_KEYS else {k: ReadResult.unpack(r) for k, r in reads.items()})
        for app, reads in d.items()
    }


def as_lists(res: dict) -> dict:
    """The default shape: {app: {read: {"positions": [...], "values": [...]}}} (plain lists;
    non-finite values as they are)."""
    return {
        app: (
            reads
            if app in SPECIAL_KEYS
            else {k: (r.to_lists() if isinstance(r, ReadResult) else r) for k, r in reads.items()}
        )
        for app, reads in res.items()
    }


def as_tensors(res: dict) -> dict:
    """{app: {read: {"positions": tensor, "values": tensor[, "ids": tensor]}}}."""
    return {
        app: (reads if app in SPECIAL_KEYS else {k: r.tensors() for k, r in reads.items()})
        for app, reads in res.items()
    }


# ---------------------------------------------------------------------- options
@dataclass(frozen=True)
class Window:
    """Positions a read reports. Items: "prompt", "generated", "last_token", or (start,
    stop) with stop None = open; negative bounds slice the prompt as Python does."""

    items: tuple

    def intervals(self, prompt_len: int) -> list[tuple[int, float]]:
        p = prompt_len
        out: list[tuple[int, float]] = []
        for it in self.items:
            if it == "prompt":
                out.append((0, p))
            elif it == "generated":
                out.append((p, math.inf))
            elif it == "last_token":
                out.append((max(p - 1, 0), math.inf))
            else:
                a, b = it
                if (a is not None and a < 0) or (b is not None and b < 0):
                    lo, hi, _ = slice(a, b).indices(p)
                    out.append((lo, hi))
                else:
                    out.append((a or 0, math.inf if b is None else b))
        return [(lo, hi) for lo, hi in out if hi > lo]

    def mask(self, positions: np.ndarray, prompt_len: int) -> np.ndarray:
        m = np.zeros(len(positions), dtype=bool)
        for lo, hi in self.intervals(prompt_len):
            m |= (positions >= lo) & (positions < hi)
        return m

    def count(self, lo: int, hi: float, prompt_len: int) -> float:
        """Positions of [lo, hi) in the window (inf when unbounded)."""
        spans = sorted((max(a, lo), min(b, hi)) for a, b in self.intervals(prompt_len))
        total, end = 0.0, -math.inf
        for a, b in spans:
            start = max(a, end)
            if b > start:
                total += b - start
                end = b
        return total

    def to_control(self) -> list:
        return [it if isinstance(it, str) else list(it) for it in self.items]


@dataclass(frozen=True)
class ResultOptions:
    encoding: str = "json"
    compression: str | None = None
    dtype: str = "float32"
    window: Window | None = None  # None: every position
    max_bytes: int | None = None  # this sequence's budget (set by the frontend)

    def to_control(self) -> dict:
        """The canonical form carried to the workers (only what differs from the defaults)."""
        d: dict[str, Any] = {}
        if self.encoding != "json":
            d["encoding"] = self.encoding
        if self.compression:
            d["compression"] = self.compression
        if self.dtype != "float32":
            d["dtype"] = self.dtype
        if self.window is not None:
            d["positions"] = self.window.to_control()
        if self.max_bytes is not None:
            d["max_bytes"] = self.max_bytes
        return d

    @staticmethod
    def from_control(d: Any) -> ResultOptions:
        """From the canonical form (already checked by the frontend)."""
        if not isinstance(d, dict) or not d:
            return DEFAULT_OPTIONS
        win = d.get("positions")
        return ResultOptions(
            d.get("encoding", "json"),
            d.get("compression"),
            d.get("dtype", "float32"),
            _window(win) if win is not None else None,
            d.get("max_bytes"),
        )


DEFAULT_OPTIONS = ResultOptions()


def _window(spec: Any) -> Window:
    """A checked Window from the "positions" value of a control; ValueError naming what is
    wrong."""
    items = (
        [spec]
        if isinstance(spec, str)
        or (
            isinstance(spec, list)
            and len(spec) == 2
            and all(x is None or _is_int(x) for x in spec)
            and not all(x is None for x in spec)
        )
        else spec
    )
    if not isinstance(items, list) or not items:
        raise ValueError(
            f'"positions" must be "prompt", "generated", "last_token", a [start, stop] '
            f"range or a non-empty list of those, got {_shown(spec)}"
        )
    if len(items) > MAX_WINDOW_ITEMS:
        raise ValueError(f'"positions" lists {len(items)} items; at most {MAX_WINDOW_ITEMS}')
    out: list[str | tuple[int | None, int | None]] = []
    for it in items:
        if isinstance(it, str):
            if it not in WINDOW_NAMES:
                raise ValueError(
                    f'"positions": unknown window {_shown(it)}; known: {list(WINDOW_NAMES)} '
                    f"or [start, stop] ranges"
                )
            out.append(it)
        elif isinstance(it, list) and len(it) == 2 and all(x is None or _is_int(x) for x in it):
            a, b = it
            if a is not None and b is not None and (a >= 0) == (b >= 0) and b <= a:
                raise ValueError(f'"positions": the range {it} is empty (stop must be above start)')
            if (
                (a is not None and a >= 0 and b is not None and b < 0)
                or (a is not None and abs(a) > 2**31)
                or (b is not None and abs(b) > 2**31)
            ):
                raise ValueError(
                    f'"positions": the range {it} mixes an absolute start with a stop '
                    f"counted from the prompt's end, or is out of range"
                )
            out.append((a, b))
        else:
            raise ValueError(
                f'"positions": each item must be "prompt", "generated", "last_token" or '
                f"[start, stop] (integers or null), got {_shown(it)}"
            )
    return Window(tuple(out))


def positions_from_text(spec: Any) -> Any:
    """The "positions" of a control from its text form (the ``xmix capture --positions`` and
    flat ``xmix_positions`` syntax): "prompt", "generated", "last_token" and "START:STOP"
    ranges (Python slice syntax: empty = open, negative bounds count from the prompt's end),
    comma-separated, or a list of such strings; anything else is returned as it is (the JSON
    form). ValueError for a range that is not two integers."""
    if isinstance(spec, str):
        spec = [spec]
    if not isinstance(spec, list) or not spec or not all(isinstance(x, str) for x in spec):
        return spec
    items: list = []
    for part in (p.strip() for x in spec for p in x.split(",")):
        if ":" in part:
            a, _, b = part.partition(":")
            try:
                items.append([int(a) if a.strip() else None, int(b) if b.strip() else None])
            except ValueError:
                raise ValueError(f'"positions": {_shown(part)} is not a START:STOP range') from None
        else:
            items.append(part)
    return items


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _shown(v: Any) -> str:
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlist = 2, 60, 60, 6
    return r.repr(v)


def parse_options(raw: dict, n: int = 1, server_cap: int | None = None) -> ResultOptions:
    """The result options of a request's control (the keys in OPTION_KEYS); ValueError with
    a message naming what is wrong. ``n`` sequences share the request's byte cap."""
    cap = max_result_bytes() if server_cap is None else server_cap
    enc = raw.get("encoding", "json")
    if enc not in ENCODINGS:
        raise ValueError(f'"encoding" must be one of {list(ENCODINGS)}, got {_shown(enc)}')
    comp = raw.get("compression")
    if comp is not None and comp not in COMPRESSIONS:
        raise ValueError(f'"compression" must be "zstd" (or absent), got {_shown(comp)}')
    if comp is not None and enc != "base64":
        raise ValueError(
            '"compression": "zstd" needs "encoding": "base64" (JSON numbers are not compressed)'
        )
    if comp is not None:
        _zstd()  # refused now, not when the response is built
    dt = raw.get("dtype", "float32")
    if dt not in DTYPES:
        raise ValueError(f'"dtype" must be one of {list(DTYPES)}, got {_shown(dt)}')
    win = _window(raw["positions"]) if "positions" in raw else None
    asked = raw.get("max_result_bytes")
    if asked is not None:
        if not _is_int(asked) or asked <= 0:
            raise ValueError(f'"max_result_bytes" must be a positive integer, got {_shown(asked)}')
        if asked > cap:
            raise ValueError(
                f'"max_result_bytes" is {asked}; the server allows at most {cap} per '
                f"request (XMIX_MAX_RESULT_BYTES)"
            )
    total = cap if asked is None else asked
    return ResultOptions(enc, comp, dt, win, max(total // max(n, 1), 0))


def _zstd():
    try:
        import zstandard
    except ImportError:  # pragma: no cover - a dependency of xmix
        raise ValueError(
            '"compression": "zstd" needs the zstandard package on the server'
        ) from None
    return zstandard


# ---------------------------------------------------------------------- accounting
@dataclass(frozen=True)
class ReadShape:
    kind: str
    width: int  # values per position (1, capture width, K, F)
    once: bool = False  # reports once per request (CAST), at the last prompt token


def read_shape(op) -> ReadShape:
    """The shape of a lowered read's results."""
    if op.kernel == "capture":
        return ReadShape("vector", op.capture_width)
    if op.kernel == "sae":
        return (
            ReadShape("features", len(op.features)) if op.features else ReadShape("topk", op.top_k)
        )
    return ReadShape("scalar", 1, once=op.kernel == "cosine")


def position_bytes(shape: ReadShape, opts: ResultOptions) -> int:
    """Bytes one position of a read is accounted at in the response (an upper bound for JSON;
    base64 before compression)."""
    w = shape.width
    if opts.encoding == "json":
        if shape.kind in ("topk", "features"):
            return (1 + 2 * w) * JSON_BYTES_PER_NUMBER + JSON_BYTES_PER_SAE_POSITION
        return (1 + w) * JSON_BYTES_PER_NUMBER
    raw = 4 + w * DTYPES[opts.dtype] + (4 * w if shape.kind == "topk" else 0)
    return (raw * 4 + 2) // 3 + 1


# ---------------------------------------------------------------------- responses
def _nonfinite_to_none(v: np.ndarray) -> tuple[list, int]:
    """v.tolist() with every non-finite number None, and how many there were."""
    bad = ~np.isfinite(v)
    k = int(bad.sum())
    if not k:
        return v.tolist(), 0
    if v.ndim == 1:
        out = v.tolist()
        for i in np.flatnonzero(bad).tolist():
            out[i] = None
        return out, k
    out = v.tolist()
    for i, j in zip(*np.nonzero(bad)):
        out[i][j] = None
    return out, k


def _one_value_entry(r: ReadResult) -> dict | None:
    """``_json_entry`` of a scalar read with one position (a streamed chunk's usual entry)
    without numpy's array functions: the two numbers are read as Python scalars. None for
    any other result."""
    if r.kind != "scalar" or len(r._parts) != 1:
        return None
    pos, val, _ = r._parts[0]
    if len(pos) != 1:
        return None
    raw = val.item(0)
    if r.dtype == "bfloat16":  # uint16 bit pattern: the high half of a float32
        raw = struct.unpack("<f", struct.pack("<I", raw << 16))[0]
    x = float(raw)
    if math.isfinite(x):
        return {"positions": [pos.item(0)], "values": [x]}
    return {"positions": [pos.item(0)], "values": [None], "nonfinite": 1}


def _json_entry(r: ReadResult) -> dict:
    one = _one_value_entry(r)
    if one is not None:
        return one
    v = r.values_f32()
    if r.kind == "topk":
        ids = r.topk_ids()
        counts = np.count_nonzero(ids >= 0, axis=1).tolist()
        acts, bad = _nonfinite_to_none(v)
        values = [{"ids": i[:c], "acts": a[:c]} for i, a, c in zip(ids.tolist(), acts, counts)]
    elif r.kind == "features":
        acts, bad = _nonfinite_to_none(v)
        feats = list(r.features)
        values = [{"ids": list(feats), "acts": a} for a in acts]
    else:
        values, bad = _nonfinite_to_none(v)
    e = {"positions": r.positions.tolist(), "values": values}
    if bad:
        e["nonfinite"] = bad
    return e


_STORE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _b64_array(a: np.ndarray, dtype: str, zc) -> dict:
    raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    if zc is not None:
        raw = zc.compress(raw)
    return {"dtype": dtype, "shape": list(a.shape), "data": base64.b64encode(raw).decode("ascii")}


def _b64_entry(r: ReadResult, opts: ResultOptions) -> dict:
    zc = _zstd().ZstdCompressor(level=3) if opts.compression == "zstd" else None
    e: dict[str, Any] = {"encoding": "base64"}
    if zc is not None:
        e["compression"] = "zstd"
    e["positions"] = _b64_array(r.positions, "int32", zc)
    e["values"] = _b64_array(r.values, r.dtype, zc)
    if r.kind == "topk":
        e["ids"] = _b64_array(r.topk_ids(), "int32", zc)
    elif r.kind == "features":
        e["ids"] = list(r.features)
    bad = int((~np.isfinite(r.values_f32())).sum())
    if bad:
        e["nonfinite"] = bad
    return e


def encode_results(res: dict, opts: ResultOptions = DEFAULT_OPTIONS) -> dict:
    """Read results as strict JSON for a response or a stream chunk, in the request's
    encoding. JSON: {"positions": [...], "values": [...]} with every non-finite value null and
    the entry's ``"nonfinite"`` count. base64: each array as {"dtype", "shape", "data"} (raw
    little-endian values, zstd-compressed first with "compression": "zstd"; positions and
    SAE feature ids int32), non-finite values kept (and counted)."""
    out: dict = {}
    for app, reads in res.items():
        if app in SPECIAL_KEYS:
            out[app] = reads
            continue
        dst = out[app] = {}
        for key, r in reads.items():
            if not isinstance(r, ReadResult):
                r = from_lists(r)
            if r.dtype != opts.dtype:  # results made before the options applied
                r = ReadResult.of(
                    r.kind,
                    r.positions,
                    to_dtype(r.values_f32(), opts.dtype),
                    r._joined()[2],
                    opts.dtype,
                    r.features,
                )
            dst[key] = _json_entry(r) if opts.encoding == "json" else _b64_entry(r, opts)
    return out


def from_lists(entry: Mapping) -> ReadResult:
    """A ReadResult of a {positions, values} mapping in the default shape."""
    pos, vals = list(entry["positions"]), list(entry["values"])
    if vals and isinstance(vals[0], dict):
        k = max((len(v["ids"]) for v in vals), default=0)
        ids = np.full((len(vals), k), -1, dtype=np.int32)
        acts = np.zeros((len(vals), k), dtype=np.float32)
        for i, v in enumerate(vals):
            c = len(v["ids"])
            ids[i, :c] = v["ids"]
            acts[i, :c] = [math.nan if a is None else a for a in v["acts"]]
        return ReadResult.of("topk", pos, acts, ids)
    if vals and isinstance(vals[0], list):
        arr = np.array(
            [[math.nan if x is None else x for x in row] for row in vals], dtype=np.float32
        )
        return ReadResult.of("vector", pos, arr)
    return ReadResult.of(
        "scalar", pos, np.array([math.nan if x is None else x for x in vals], dtype=np.float32)
    )


# ---------------------------------------------------------------------- clients
_DECODE_STORE = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "int32": np.int32,
}


def _decode_array(a: dict, compressed: bool):
    import torch

    raw = base64.b64decode(a["data"])
    if compressed:
        raw = _zstd().ZstdDecompressor().decompress(raw)
    dt = a["dtype"]
    arr = np.frombuffer(raw, dtype=np.dtype(_DECODE_STORE[dt]).newbyteorder("<")).reshape(
        a["shape"]
    )
    if dt == "int32":
        return torch.from_numpy(arr.astype(np.int64))
    return to_tensor(arr.astype(_DECODE_STORE[dt]), dt)


def _decode_entry(e: Mapping) -> dict:
    import torch

    if e.get("encoding") == "base64":
        z = e.get("compression") == "zstd"
        out = {
            "positions": _decode_array(e["positions"], z),
            "values": _decode_array(e["values"], z),
        }
        if isinstance(e.get("ids"), dict):
            out["ids"] = _decode_array(e["ids"], z)
        elif "ids" in e:  # listed SAE features: the same on every row
            out["ids"] = (
                torch.tensor(e["ids"], dtype=torch.int64)
                .expand(len(out["positions"]), -1)
                .contiguous()
            )
        return out
    return from_lists(e).tensors()


def _concat(have: dict, t: dict) -> None:
    import torch

    for name, fill in (("positions", 0), ("values", 0.0), ("ids", -1)):
        if name not in t:
            continue
        a, b = have[name], t[name]
        if a.dim() == 2 and a.shape[1] != b.shape[1]:
            # SAE top-K from JSON: each payload is as wide as its most active position
            k = max(a.shape[1], b.shape[1])
            a = torch.nn.functional.pad(a, (0, k - a.shape[1]), value=fill)
            b = torch.nn.functional.pad(b, (0, k - b.shape[1]), value=fill)
        have[name] = torch.cat([a, b])


def decode_results(payload) -> dict:
    """The ``"xmix"`` payload of a response (or a list of stream chunks' payloads, in order)
    as tensors: {app: {read: {"positions": int64, "values": float (n,) / (n, w) / (n, K),
    ["ids": int64 (n, K), SAE reads, -1 = no feature]}}}. JSON and base64 (zstd or not) payloads alike; nulls (non-finite values
    in JSON) come back as NaN. Markers (``"!truncated"``) are kept as they are."""
    if isinstance(payload, list):
        out: dict = {}
        for part in (decode_results(p) for p in payload if p):
            for app, reads in part.items():
                if app in SPECIAL_KEYS:
                    out.setdefault(app, reads)
                    continue
                for key, t in reads.items():
                    have = out.setdefault(app, {}).get(key)
                    if have is None:
                        out[app][key] = dict(t)
                    else:
                        _concat(have, t)
        return out
    out = {}
    for app, reads in (payload or {}).items():
        if app in SPECIAL_KEYS:
            out[app] = reads
            continue
        out[app] = {key: _decode_entry(e) for key, e in reads.items()}
    return out


def options_of_control(raw: Any) -> ResultOptions:
    """The encoding options of a request's xmix control as a client sent it (a dict or a JSON
    string), for building its response; the control was checked at admission, so anything
    unreadable here means the defaults."""
    import json

    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            return DEFAULT_OPTIONS
    if not isinstance(raw, dict):
        return DEFAULT_OPTIONS
    try:
        return parse_options(
            {k: raw[k] for k in ("encoding", "compression", "dtype") if k in raw},
            server_cap=1 << 62,
        )
    except ValueError:
        return DEFAULT_OPTIONS
