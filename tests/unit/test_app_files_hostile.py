"""Hostile app files (issue 18): truncated files, header lengths that lie, huge, deeply
nested or bomb-like JSON, tensors whose dtype or shape lie, names with path or control
characters. Each is refused with an AppError (HTTP 400; LimitError: 413) naming what is wrong,
before anything large is allocated: the peak memory of parsing is measured in a fresh
process against the size of the file."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import xmix
from xmix.lang.api import AppError, LimitError

D = 16


def _good() -> xmix.App:
    app = xmix.App("ok")
    app.write("add", vector=torch.arange(D, dtype=torch.float32)).layers([0]).at("residual.pre")
    return app


def _file(header: dict | bytes, data: bytes = b"", hlen: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + data


def _spec(name="ok", artifact="v") -> str:
    return json.dumps(
        {
            "format": "xmix.app/1",
            "name": name,
            "metadata": {},
            "params": {},
            "token_sets": [],
            "ops": [
                {
                    "primitive": "write",
                    "kernel": "add",
                    "site": "residual.pre",
                    "layers": [0],
                    "params": {},
                    "artifacts": {"vector": artifact},
                }
            ],
        }
    )


def _header(tensors: dict, spec: str | None = None, meta: dict | None = None) -> dict:
    h = dict(tensors)
    h["__metadata__"] = meta if meta is not None else {"xmix.spec": spec or _spec()}
    return h


VEC = {"v": {"dtype": "F32", "shape": [D], "data_offsets": [0, 4 * D]}}
DATA = torch.arange(D, dtype=torch.float32).numpy().tobytes()


def cases() -> list[tuple[str, bytes, str]]:
    good = _good().to_bytes()
    hlen = struct.unpack("<Q", good[:8])[0]
    deep = b"[" * 100_000 + b"]" * 100_000
    bomb = b'{"__metadata__": {"xmix.spec": "{}"}, "x": [' + b"[]," * 2_000_000 + b"[]]}"
    return [
        ("empty", b"", "too short"),
        ("truncated in the header", good[: 8 + hlen // 2], "header claims"),
        ("truncated in the data", good[:-5], "outside the file's"),
        (
            "header length larger than the file",
            _file(_header(VEC), DATA, hlen=10**12),
            "header claims",
        ),
        (
            "header length shorter than the JSON",
            _file(_header(VEC), DATA, hlen=20),
            "header is not JSON",
        ),
        ("header nested 100 000 deep", _file(deep), "nested too deeply"),
        ("JSON bomb of 2 000 000 empty lists", _file(bomb), "JSON separators"),
        (
            "spec nested 100 000 deep",
            _file(_header(VEC, spec="[" * 100_000 + "]" * 100_000), DATA),
            "nested too deeply",
        ),
        (
            "spec bomb",
            _file(_header(VEC, spec="[" + "0," * 1_100_000 + "0]"), DATA),
            "JSON separators",
        ),
        ("header not an object", _file(b"[1, 2]"), "not an object"),
        (
            "metadata not strings",
            _file(_header(VEC, meta={"xmix.spec": {"a": 1}}), DATA),
            "__metadata__",
        ),
        ("no spec", _file(_header(VEC, meta={}), DATA), "without an xmix spec"),
        (
            "shape that lies",
            _file(
                _header({"v": {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 4 * D]}}),
                DATA,
            ),
            "data_offsets span",
        ),
        (
            "shape with 2^62 elements",
            _file(
                _header(
                    {"v": {"dtype": "F32", "shape": [1 << 31, 1 << 31], "data_offsets": [0, 4 * D]}}
                ),
                DATA,
            ),
            "data_offsets span",
        ),
        (
            "negative dimension",
            _file(
                _header({"v": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4 * D]}}), DATA
            ),
            "shape must be",
        ),
        (
            "offsets past the end",
            _file(
                _header({"v": {"dtype": "F32", "shape": [D], "data_offsets": [4, 4 + 4 * D]}}), DATA
            ),
            "outside the file's",
        ),
        (
            "overlapping tensors",
            _file(
                _header(
                    {
                        **VEC,
                        "w": {"dtype": "F32", "shape": [D // 2], "data_offsets": [8, 8 + 2 * D]},
                    }
                ),
                DATA,
            ),
            "overlap",
        ),
        (
            "bool tensor",
            _file(
                _header({"v": {"dtype": "BOOL", "shape": [4 * D], "data_offsets": [0, 4 * D]}}),
                DATA,
            ),
            "has dtype 'BOOL'",
        ),
        (
            "fp8 tensor",
            _file(
                _header({"v": {"dtype": "F8_E4M3", "shape": [4 * D], "data_offsets": [0, 4 * D]}}),
                DATA,
            ),
            "has dtype",
        ),
        (
            "uint8 tensor",
            _file(
                _header({"v": {"dtype": "U8", "shape": [4 * D], "data_offsets": [0, 4 * D]}}), DATA
            ),
            "has dtype",
        ),
        (
            "entry with extra keys",
            _file(_header({"v": {**VEC["v"], "evil": 1}}), DATA),
            "entry must have",
        ),
        (
            "tensor name with a NUL",
            _file(
                _header(
                    {"v\x00../../etc/passwd": VEC["v"]},
                    spec=_spec(artifact="v\x00../../etc/passwd"),
                ),
                DATA,
            ),
            "tensor name",
        ),
        (
            "tensor name with a newline",
            _file(_header({"v\nINFO fake log line": VEC["v"]}), DATA),
            "tensor name",
        ),
        (
            "app name with a path",
            _file(_header(VEC, spec=_spec(name="../../etc/passwd")), DATA),
            "app name",
        ),
        (
            "app name with control characters",
            _file(_header(VEC, spec=_spec(name="a\x1b[2Jb")), DATA),
            "app name",
        ),
        (
            "app name of a megabyte",
            _file(_header(VEC, spec=_spec(name="x" * (1 << 20))), DATA),
            "app name",
        ),
        (
            "artifact the file lacks",
            _file(_header(VEC, spec=_spec(artifact="w")), DATA),
            "does not contain",
        ),
    ]


@pytest.mark.parametrize("what,data,msg", cases(), ids=[c[0] for c in cases()])
def test_hostile_app_file_is_refused_with_the_reason(what, data, msg):
    with pytest.raises(AppError, match=msg):
        xmix.App.from_bytes(data)


def test_wrong_shape_is_refused_at_deploy_and_a_huge_header_is_a_limit(monkeypatch):
    from xmix.lang.lowering import DeployError, lower
    from xmix.lang.sites import ModelShape

    app = xmix.App.from_bytes(_good().to_bytes())  # a well-formed file still parses
    assert torch.equal(app.ops[0].artifacts["vector"], torch.arange(D, dtype=torch.float32))
    with pytest.raises(DeployError, match="hidden size"):
        lower(app, ModelShape(n_layers=1, hidden_size=D + 1, vocab_size=32))
    monkeypatch.setenv("XMIX_MAX_APP_HEADER_BYTES", "1024")
    big = _file(_header(VEC, meta={"xmix.spec": _spec(), "pad": "x" * 4096}), DATA)
    with pytest.raises(LimitError, match="XMIX_MAX_APP_HEADER_BYTES"):
        xmix.App.from_bytes(big)


PEAK = textwrap.dedent("""
    import gc, json, struct, sys
    import torch, xmix

    def kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])

    kind = sys.argv[1]
    if kind == "unused-tensors":   # 256 MiB of tensors no op names, and a tiny spec
        n = 64 << 20
        spec = json.dumps({"format": "xmix.app/1", "name": "ok", "metadata": {}, "params": {},
                           "token_sets": [], "ops": [{"primitive": "write", "kernel": "add",
                           "site": "residual.pre", "layers": [0], "params": {}, "artifacts": {"vector": "v"}}]})
        header = json.dumps({"v": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
                             "junk": {"dtype": "F32", "shape": [n], "data_offsets": [64, 64 + 4 * n]},
                             "__metadata__": {"xmix.spec": spec}}).encode()
        data = bytearray(8 + len(header) + 64 + 4 * n)
        data[:8] = struct.pack("<Q", len(header))
        data[8:8 + len(header)] = header
        data = bytes(data)
    else:                          # a 16 MiB header of empty lists
        body = b'{"x": [' + b"[]," * ((16 << 20) // 3 - 4) + b'[]]}'
        data = bytearray(8 + len(body))
        data[:8] = struct.pack("<Q", len(body))
        data[8:] = body
        data = bytes(data)
    gc.collect()
    base = kib("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")   # VmHWM := VmRSS
    try:
        xmix.App.from_bytes(data)
        outcome = "parsed"
    except xmix.lang.api.AppError as e:
        outcome = type(e).__name__
    print(json.dumps({"grew_kib": kib("VmHWM") - base, "file_kib": len(data) >> 10, "outcome": outcome}))
""")


def _peak(kind: str) -> dict:
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pytest.skip("needs /proc/self/clear_refs to measure peak memory")
    out = subprocess.run(
        [sys.executable, "-c", PEAK, kind], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_parsing_never_copies_tensors_the_app_does_not_use():
    """Before: safetensors.torch.load copied every tensor of the file (256 MiB here) before
    any check. Now only the tensors the spec names are read."""
    r = _peak("unused-tensors")
    assert r["outcome"] == "parsed" and r["file_kib"] >= 256 * 1024
    assert r["grew_kib"] < 16 * 1024, r


def test_a_json_bomb_header_is_refused_before_it_is_parsed():
    """Before: json.loads of 16 MiB of "[]," built ~5.6 M lists (~400 MB). Now the
    separators are counted first."""
    r = _peak("bomb")
    assert r["outcome"] == "LimitError"
    assert r["grew_kib"] < 4 * 1024, r
