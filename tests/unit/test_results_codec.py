"""Read results as arrays and their encodings, without an engine: every encoding gives back
the same numbers (dtype-exact), windows select exactly the positions they name, the byte
accounting bounds what is encoded, and bad options are refused with a message.

Oracles: torch's own float -> bfloat16 / float16 conversion, hand-built default shapes, and
hand-counted windows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import xmix
from xmix.lang.results_codec import (
    DEFAULT_OPTIONS,
    TRUNCATED_KEY,
    ReadResult,
    ReadShape,
    ResultOptions,
    encode_results,
    merge_results,
    pack_results,
    parse_options,
    position_bytes,
    to_dtype,
    unpack_results,
)

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _values(n, w, seed=0):
    g = np.random.default_rng(seed)
    v = (g.standard_normal((n, w)) * 10.0 ** g.integers(-3, 4, (n, w))).astype(np.float32)
    v[1, 0] = np.nan
    v[2, min(1, w - 1)] = np.inf
    v[3, 0] = -np.inf
    return v


def _results(dtype):
    """One read of each kind, values already in ``dtype`` (as the drain makes them)."""
    vec = _values(6, 5)
    sc = _values(6, 1)[:, 0]
    k = 4
    ids = np.array(
        [[7, 3, -1, -1], [2, -1, -1, -1], [9, 8, 1, 0], [-1] * 4, [5, 6, -1, -1], [4, -1, -1, -1]],
        dtype=np.int32,
    )
    acts = np.where(ids >= 0, np.abs(_values(6, k, 1)), 0).astype(np.float32)
    feats = np.abs(_values(6, 3, 2))
    pos = np.array([0, 1, 2, 5, 6, 9], dtype=np.int32)
    return {
        "app": {
            "h": ReadResult.of("vector", pos, to_dtype(vec, dtype), dtype=dtype),
            "p": ReadResult.of("scalar", pos, to_dtype(sc, dtype), dtype=dtype),
            "top": ReadResult.of("topk", pos, to_dtype(acts, dtype), ids, dtype=dtype),
            "f": ReadResult.of(
                "features", pos, to_dtype(feats, dtype), dtype=dtype, features=(11, 4, 30)
            ),
        },
    }, dict(vec=vec, sc=sc, ids=ids, acts=acts, feats=feats, pos=pos)


def _rounded(a, dtype):
    """The oracle: torch's conversion of the float32 values."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(DT[dtype])


def _same(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point():
        assert torch.equal(a.isnan(), b.isnan())
        m = ~a.isnan()
        assert torch.equal(a[m], b[m])
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_encoding_gives_back_the_same_numbers(dtype):
    res, src = _results(dtype)
    payloads = {
        "json": encode_results(res, ResultOptions(dtype=dtype)),
        "base64": encode_results(res, ResultOptions(encoding="base64", dtype=dtype)),
        "zstd": encode_results(
            res, ResultOptions(encoding="base64", compression="zstd", dtype=dtype)
        ),
    }
    # strict JSON on the wire: nothing a JSON parser would refuse
    for p in payloads.values():
        json.loads(json.dumps(p, allow_nan=False))
    dec = {k: xmix.decode_results(json.loads(json.dumps(p))) for k, p in payloads.items()}
    pos = torch.from_numpy(src["pos"].astype(np.int64))
    vec, sc = _rounded(src["vec"], dtype), _rounded(src["sc"], dtype)
    for name, d in dec.items():
        a = d["app"]
        for key in ("h", "p", "top", "f"):
            assert torch.equal(a[key]["positions"], pos), (name, key)
        if name == "json":
            # JSON carries numbers: non-finite ones are null (NaN once decoded), values are the
            # dtype's values exactly, as float32
            fin = lambda t: torch.where(t.isfinite(), t, torch.nan)  # noqa: E731
            _same(a["h"]["values"], fin(vec.float()))
            _same(a["p"]["values"], fin(sc.float()))
        else:
            _same(a["h"]["values"], vec)
            _same(a["p"]["values"], sc)
            assert torch.equal(a["top"]["ids"], torch.from_numpy(src["ids"].astype(np.int64)))
            _same(a["top"]["values"], _rounded(src["acts"], dtype))
        want_f = _rounded(src["feats"], dtype).float()
        if name == "json":
            want_f = torch.where(want_f.isfinite(), want_f, torch.nan)
        else:
            a["f"]["values"] = a["f"]["values"].float()
        _same(a["f"]["values"].float(), want_f)
        assert a["f"]["ids"].tolist() == [[11, 4, 30]] * 6
    # the JSON SAE top-K read: each position's active features, in order
    j = payloads["json"]["app"]["top"]["values"]
    assert [v["ids"] for v in j] == [[7, 3], [2], [9, 8, 1, 0], [], [5, 6], [4]]
    # non-finite values: null in JSON and counted; kept (and counted) in base64
    n_bad = int(
        (
            ~np.isfinite(
                to_dtype(src["vec"], dtype).astype(np.float32)
                if dtype != "bfloat16"
                else _rounded(src["vec"], dtype).float().numpy()
            )
        ).sum()
    )
    assert payloads["json"]["app"]["h"]["nonfinite"] == n_bad
    assert payloads["base64"]["app"]["h"]["nonfinite"] == n_bad
    assert sum(x is None for row in payloads["json"]["app"]["h"]["values"] for x in row) == n_bad


def test_base64_is_raw_little_endian_values_with_dtype_and_shape():
    res, src = _results("bfloat16")
    e = encode_results(res, ResultOptions(encoding="base64", dtype="bfloat16"))["app"]["h"]
    assert e["values"]["dtype"] == "bfloat16" and e["values"]["shape"] == [6, 5]
    import base64

    raw = base64.b64decode(e["values"]["data"])
    want = _rounded(src["vec"], "bfloat16").view(torch.int16).numpy().astype("<i2").tobytes()
    assert raw == want
    assert base64.b64decode(e["positions"]["data"]) == src["pos"].astype("<i4").tobytes()
    z = encode_results(res, ResultOptions(encoding="base64", compression="zstd", dtype="bfloat16"))[
        "app"
    ]["h"]
    import zstandard

    assert zstandard.ZstdDecompressor().decompress(base64.b64decode(z["values"]["data"])) == want


def test_default_shape_is_unchanged():
    """The JSON shape of today: {positions: [...], values: [...]}, lists per position for
    capture, {ids, acts} objects for SAE reads; also what a ReadResult reads as."""
    r = ReadResult.of("vector", [3, 4], np.array([[1.5, 2.0], [0.25, -1.0]], np.float32))
    assert r == {"positions": [3, 4], "values": [[1.5, 2.0], [0.25, -1.0]]}
    assert encode_results({"a": {"h": r}}) == {
        "a": {"h": {"positions": [3, 4], "values": [[1.5, 2.0], [0.25, -1.0]]}}
    }
    s = ReadResult.of("scalar", [0, 1], np.array([0.5, math.nan], np.float32))
    assert encode_results({"a": {"p": s}}) == {
        "a": {"p": {"positions": [0, 1], "values": [0.5, None], "nonfinite": 1}}
    }
    t = ReadResult.of("topk", [2], np.array([[3.0, 1.0, 0.0]], np.float32), np.array([[4, 9, -1]]))
    assert t["values"] == [{"ids": [4, 9], "acts": [3.0, 1.0]}]
    f = ReadResult.of("features", [2], np.array([[0.0, 2.5]], np.float32), features=(8, 1))
    assert f["values"] == [{"ids": [8, 1], "acts": [0.0, 2.5]}]


def test_results_travel_packed_and_merge_in_step_order():
    res, _ = _results("float16")
    res[TRUNCATED_KEY] = "truncated at 10 bytes"
    back = unpack_results(pack_results(res))
    for key, r in res["app"].items():
        b = back["app"][key]
        assert (b.kind, b.dtype, b.features) == (r.kind, r.dtype, r.features)
        assert np.array_equal(b.positions, r.positions)
        assert np.array_equal(b.values, r.values, equal_nan=True)
    assert back[TRUNCATED_KEY] == "truncated at 10 bytes"
    # merge: later steps append; the step's own results are never changed by it
    a = ReadResult.of("scalar", [0, 1], np.array([1, 2], np.float32))
    b = ReadResult.of("scalar", [2], np.array([3], np.float32))
    acc: dict = {}
    merge_results(acc, {"x": {"p": a}})
    merge_results(acc, {"x": {"p": b}})
    assert acc["x"]["p"] == {"positions": [0, 1, 2], "values": [1.0, 2.0, 3.0]}
    assert a == {"positions": [0, 1], "values": [1.0, 2.0]}


def test_stream_chunks_decode_to_the_whole():
    """Chunks carry the results produced since the previous one; decoded together they equal
    the whole (SAE top-K chunks of different widths included)."""
    res, _ = _results("float32")
    whole = xmix.decode_results(encode_results(res, ResultOptions(encoding="base64")))
    for enc in ("json", "base64"):
        chunks = []
        for lo, hi in ((0, 2), (2, 3), (3, 6)):
            part = {
                "app": {
                    k: ReadResult.of(
                        r.kind,
                        r.positions[lo:hi],
                        r.values[lo:hi],
                        None if r.kind != "topk" else r.ids[lo:hi],
                        r.dtype,
                        r.features,
                    )
                    for k, r in res["app"].items()
                }
            }
            chunks.append(encode_results(part, ResultOptions(encoding=enc)))
        got = xmix.decode_results(chunks)
        for k in ("h", "p", "f"):
            _same(got["app"][k]["positions"], whole["app"][k]["positions"])
            if enc == "base64":
                _same(got["app"][k]["values"], whole["app"][k]["values"])
        if enc == "base64":
            assert torch.equal(got["app"]["top"]["ids"], whole["app"]["top"]["ids"])


WINDOWS = [
    ("prompt", 5, list(range(0, 5))),
    ("generated", 5, [5, 6, 7, 8, 9]),
    ("last_token", 5, [4, 5, 6, 7, 8, 9]),
    ([2, 4], 5, [2, 3]),
    ([[-1, None]], 5, [4]),  # the last prompt token
    ([[-2, None]], 5, [3, 4]),
    ([[None, -3]], 5, [0, 1]),
    ([[7, None], "prompt"], 5, [0, 1, 2, 3, 4, 7, 8, 9]),
    ([[3, 6]], 5, [3, 4, 5]),
    (["last_token", [0, 1]], 1, list(range(10))),
]


@pytest.mark.parametrize("spec,prompt_len,want", WINDOWS)
def test_windows_select_exactly_the_positions_named(spec, prompt_len, want):
    opts = parse_options({"positions": spec})
    pos = np.arange(10)
    assert pos[opts.window.mask(pos, prompt_len)].tolist() == want
    assert opts.window.count(0, 10, prompt_len) == len(want)
    # the options travel to the workers in their canonical form
    assert ResultOptions.from_control(opts.to_control()) == opts


@pytest.mark.parametrize(
    "raw,msg",
    [
        ({"encoding": "msgpack"}, '"encoding" must be one of'),
        ({"compression": "zstd"}, 'needs "encoding": "base64"'),
        ({"encoding": "base64", "compression": "gzip"}, '"compression" must be "zstd"'),
        ({"dtype": "float64"}, '"dtype" must be one of'),
        ({"positions": "all"}, "unknown window 'all'"),
        ({"positions": [5, 2]}, "is empty"),
        ({"positions": [[1, 2, 3]]}, "each item must be"),
        ({"positions": []}, '"positions" must be'),
        ({"positions": [2, -1]}, "mixes an absolute start"),
        ({"max_result_bytes": 0}, "positive integer"),
        ({"max_result_bytes": True}, "positive integer"),
        ({"max_result_bytes": 1 << 40}, "the server allows at most"),
    ],
)
def test_bad_options_are_refused_with_a_message(raw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        parse_options(raw)


def test_byte_accounting_bounds_the_encoded_size():
    res, _ = _results("float32")
    shapes = {
        "h": ReadShape("vector", 5),
        "p": ReadShape("scalar", 1),
        "top": ReadShape("topk", 4),
        "f": ReadShape("features", 3),
    }
    for opts in (
        DEFAULT_OPTIONS,
        ResultOptions(encoding="base64"),
        ResultOptions(encoding="base64", dtype="bfloat16"),
    ):
        enc = encode_results(res, opts)["app"]
        for k, shape in shapes.items():
            r = res["app"][k]
            if opts.encoding == "json" and r.kind in ("vector", "scalar"):
                # the worst case of a number: full precision everywhere
                r = ReadResult.of(
                    r.kind,
                    r.positions,
                    np.full(r.values.shape, -1.2345678901234567e-30, np.float32),
                )
                enc_k = encode_results({"app": {k: r}}, opts)["app"][k]
            else:
                enc_k = enc[k]
            size = len(json.dumps(enc_k["values"])) + len(json.dumps(enc_k["positions"]))
            # per position, plus a fixed overhead per entry (keys, dtype, shape)
            assert size <= r.n * position_bytes(shape, opts) + 160, (k, opts)


def test_options_per_request_budget_is_split_between_sequences():
    assert parse_options({}, n=4, server_cap=1000).max_bytes == 250
    assert parse_options({"max_result_bytes": 600}, n=2, server_cap=1000).max_bytes == 300


def test_gate_counters_read_the_packed_results_the_engine_core_sends():
    """The per-app gate counters (/metrics, the console's Live view) see each output's results
    as the engine core packs them (raw arrays), not as lists. Hand count: gate p >= 0.5 over
    0.2, 0.9, NaN, 0.7 ran on 4 positions and held on 2 (NaN compares false)."""
    import threading
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from xmix.integrations.vllm.frontend import metrics
    from xmix.integrations.vllm.frontend.usage import Usage
    from xmix.integrations.vllm.result_keys import CARRIER
    from xmix.lang.lowering import lower
    from xmix.lang.sites import ModelShape

    shape = ModelShape(n_layers=2, hidden_size=8, vocab_size=50, model_name="m")
    app = xmix.App("a")
    app.read("probe", weight=torch.ones(8), bias=0.0).layers([0]).at("residual.post").named("p")
    app.write("add", vector=torch.ones(8), scale=1.0).layers([1]).at("residual.post").cond(
        gate="p >= 0.5"
    )
    reg = SimpleNamespace(
        apps={"a": SimpleNamespace(mode="request", lowered=lower(app, shape, None), defaults={})},
        lock=threading.RLock(),
        shape=shape,
    )
    m = metrics._make(CollectorRegistry())
    u = Usage(reg, m)
    u.admitted("r", {"apps": ["a"]})
    vals = np.array([0.2, 0.9, np.nan, 0.7], dtype=np.float32)
    packed = pack_results({"a": {"p": ReadResult.of("scalar", [0, 1, 2, 3], vals)}})
    u.outputs(
        [
            SimpleNamespace(
                request_id="r",
                kv_transfer_params={CARRIER: packed},
                new_token_ids=[7],
                finish_reason="stop",
            )
        ]
    )
    ran = m["gate_tokens"].labels(model_name="m", app="a", gate="p >= 0.5")._value.get()
    held = m["gate_fired"].labels(model_name="m", app="a", gate="p >= 0.5")._value.get()
    assert (ran, held) == (4, 2)


def test_flat_result_options_become_the_json_forms_keys():
    from xmix.integrations.vllm.request_controls import control_from_args

    got = control_from_args(
        {
            "xmix_apps": "cap",
            "xmix_encoding": "base64",
            "xmix_compression": "zstd",
            "xmix_dtype": "float16",
            "xmix_positions": "prompt, -8:, 0:4",
            "xmix_max_result_bytes": 4096,
        }
    )
    assert got == {
        "apps": ["cap"],
        "params": {},
        "encoding": "base64",
        "compression": "zstd",
        "dtype": "float16",
        "positions": ["prompt", [-8, None], [0, 4]],
        "max_result_bytes": 4096,
    }
    assert parse_options(got).window.mask(np.arange(12), 10).tolist() == [True] * 10 + [False] * 2
    assert control_from_args({"xmix_positions": ["last_token", "generated"]})["positions"] == [
        "last_token",
        "generated",
    ]
    with pytest.raises(ValueError, match="'xmix_positions'.*not a START:STOP range"):
        control_from_args({"xmix_positions": "1:x"})
    with pytest.raises(ValueError, match="unknown flat control 'xmix_encodings'"):
        control_from_args({"xmix_encodings": "base64"})


def test_one_value_chunks_are_encoded_without_numpys_array_functions(monkeypatch):
    """A streamed chunk's usual entry, one position of a scalar read, is written from the two
    Python numbers (issue 29): the same JSON as the general path, hand-computed here for each
    stored dtype, non-finite values null and counted."""
    import xmix.lang.results_codec as rc

    def refuse(*a, **k):
        raise AssertionError("numpy's array path ran for a one-value entry")

    monkeypatch.setattr(rc, "to_float32", refuse)
    monkeypatch.setattr(rc, "_nonfinite_to_none", refuse)

    def one(dtype: str, value: float, pos: int = 7) -> dict:
        stored = rc.to_dtype(np.array([value], np.float32), dtype)
        res = {"a": {"p": ReadResult.of("scalar", [pos], stored, None, dtype)}}
        return encode_results(res, ResultOptions(dtype=dtype))

    # float32 0.1 is 13421773 * 2^-27; float16 0.1 is 1638 * 2^-14; bfloat16 0.1 is 0x3dcd
    assert one("float32", 0.1) == {"a": {"p": {"positions": [7], "values": [13421773 / 2**27]}}}
    assert one("float16", 0.1) == {"a": {"p": {"positions": [7], "values": [1638 / 2**14]}}}
    assert one("bfloat16", 0.1) == {"a": {"p": {"positions": [7], "values": [205 / 2**11]}}}
    assert one("bfloat16", -1.5, 0) == {"a": {"p": {"positions": [0], "values": [-1.5]}}}
    for dtype in ("float32", "float16", "bfloat16"):
        for bad in (float("nan"), float("inf"), float("-inf")):
            got = one(dtype, bad)["a"]["p"]
            assert got == {"positions": [7], "values": [None], "nonfinite": 1}, (dtype, bad)
