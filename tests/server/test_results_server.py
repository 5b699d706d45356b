"""Read results over HTTP (``xmix serve``): encodings per request in responses and in every
stream chunk, windows, a NaN read as null, and the byte cap (refused before the stream,
or cut with a marker; counted on /metrics)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest
import torch
from test_results_engine import NAN_KERNEL

import xmix
from serve_util import xmix_serve

pytestmark = pytest.mark.engine

D = 256
SERVER_CAP = 400_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler to build a user kernel")
    tmp = tmp_path_factory.mktemp("serve_results")
    (tmp / "k.cpp").write_text(NAN_KERNEL)
    subprocess.run(
        [
            cxx,
            "-shared",
            "-fPIC",
            "-O1",
            "-I",
            str(xmix.custom_include_dir()),
            "-o",
            str(tmp / "libk.so"),
            str(tmp / "k.cpp"),
        ],
        check=True,
    )
    g = torch.Generator().manual_seed(3)
    cap = xmix.App("cap")
    cap.read("capture").layers([1]).at("residual.post").named("h")
    cap.read("probe", weight=torch.randn(D, generator=g) / 16, bias=0.0).layers([2]).at(
        "residual.post"
    ).named("p")
    nan = xmix.App("nan")
    nan.read("custom", cpu_library=str(tmp / "libk.so"), cpu_symbol="nan_at_even").layers([0]).at(
        "residual.pre"
    ).named("n")
    paths = [cap.save(tmp / "cap.xmix"), nan.save(tmp / "nan.xmix")]
    from transformers import AutoTokenizer

    args = ["--xmix-max-result-bytes", str(SERVER_CAP)]
    with xmix_serve(tmp, *args, apps=paths) as s, s.client(None) as client:
        yield dict(client=client, tok=AutoTokenizer.from_pretrained(str(s.model)))


PROMPT = "Once upon a time there was"


def complete(s, control, **kw):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "vllm_xargs": {"xmix": json.dumps(control)},
        **kw,
    }
    return s["client"].post("/v1/completions", json=body)


def stream_payloads(s, control, **kw) -> list:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": {"xmix": json.dumps(control)},
        **kw,
    }
    out = []
    with s["client"].stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                x = json.loads(line[6:], parse_constant=lambda c: pytest.fail(f"{c} in a chunk"))
                if "xmix" in x:
                    out.append(x["xmix"])
    return out


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    m = ~a.isnan()
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[m], b[m])


def test_every_encoding_gives_the_same_numbers_over_http(server):
    got = {}
    for name, extra in (
        ("json", {}),
        ("base64", {"encoding": "base64"}),
        ("zstd", {"encoding": "base64", "compression": "zstd"}),
    ):
        r = complete(server, {"apps": ["cap"], "dtype": "bfloat16", **extra})
        assert r.status_code == 200, r.text
        got[name] = xmix.decode_results(r.json()["xmix"])
    assert r.json()["xmix"]["cap"]["h"]["values"]["dtype"] == "bfloat16"
    assert r.json()["xmix"]["cap"]["h"]["compression"] == "zstd"
    for key in ("h", "p"):
        ref = got["base64"]["cap"][key]
        assert ref["values"].dtype == torch.bfloat16
        _same(got["zstd"]["cap"][key]["values"], ref["values"])
        _same(got["json"]["cap"][key]["values"].to(torch.bfloat16), ref["values"])
        for g in got.values():
            assert torch.equal(g["cap"][key]["positions"], ref["positions"])
    # the float32 result rounded is the bfloat16 result
    f32 = xmix.decode_results(
        complete(server, {"apps": ["cap"], "encoding": "base64"}).json()["xmix"]
    )
    assert torch.equal(
        f32["cap"]["h"]["values"].to(torch.bfloat16), got["base64"]["cap"]["h"]["values"]
    )


def test_streams_carry_the_encoding_in_every_chunk(server):
    ctl = {"apps": ["cap"], "encoding": "base64", "compression": "zstd", "dtype": "float16"}
    chunks = stream_payloads(server, ctl)
    assert len(chunks) > 1
    for c in chunks:
        assert all(
            e["encoding"] == "base64" and e["compression"] == "zstd" for e in c["cap"].values()
        )
    whole = xmix.decode_results(complete(server, ctl).json()["xmix"])
    got = xmix.decode_results(chunks)
    for key in ("h", "p"):
        assert torch.equal(got["cap"][key]["positions"], whole["cap"][key]["positions"])
        _same(got["cap"][key]["values"], whole["cap"][key]["values"])


def test_windows_over_http(server):
    p = len(server["tok"].encode(PROMPT))
    for spec, want in (
        ("last_token", list(range(p - 1, p + 5))),
        ([[-1, None]], [p - 1]),
        ([[1, 3], "generated"], [1, 2, *range(p, p + 5)]),
    ):
        r = complete(server, {"apps": ["cap"], "positions": spec})
        assert r.status_code == 200, r.text
        res = r.json()["xmix"]["cap"]
        assert res["h"]["positions"] == want and res["p"]["positions"] == want
        assert len(res["h"]["values"]) == len(want) and len(res["h"]["values"][0]) == D


def test_result_options_in_the_flat_form(server):
    """xmix_<option> keys are the JSON form's options: same positions and numbers, and the
    response and every stream chunk in the encoding they ask for."""
    p = len(server["tok"].encode(PROMPT))
    flat = {
        "xmix_apps": "cap",
        "xmix_encoding": "base64",
        "xmix_dtype": "bfloat16",
        "xmix_positions": "1:3,generated",
    }
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "vllm_xargs": flat,
    }
    r = server["client"].post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert all(e["encoding"] == "base64" for e in r.json()["xmix"]["cap"].values())
    got = xmix.decode_results(r.json()["xmix"])
    ref = xmix.decode_results(
        complete(
            server,
            {
                "apps": ["cap"],
                "encoding": "base64",
                "dtype": "bfloat16",
                "positions": [[1, 3], "generated"],
            },
        ).json()["xmix"]
    )
    for key in ("h", "p"):
        assert got["cap"][key]["positions"].tolist() == [1, 2, *range(p, p + 5)]
        assert torch.equal(got["cap"][key]["positions"], ref["cap"][key]["positions"])
        _same(got["cap"][key]["values"], ref["cap"][key]["values"])
    chunks = []
    with server["client"].stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        chunks = [
            json.loads(line[6:])["xmix"]
            for line in s.iter_lines()
            if line.startswith("data: {") and '"xmix"' in line
        ]
    assert chunks and all(e["encoding"] == "base64" for c in chunks for e in c["cap"].values())
    r = server["client"].post(
        "/v1/completions", json={**body, "vllm_xargs": {**flat, "xmix_positions": "a:b"}}
    )
    assert r.status_code == 400 and "'xmix_positions'" in r.json()["error"]["message"]


def test_a_nan_read_is_null_and_counted(server):
    p = len(server["tok"].encode(PROMPT))
    r = complete(server, {"apps": ["nan"]}, max_tokens=4)
    e = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{c} in the response"))["xmix"][
        "nan"
    ]["n"]
    assert e["positions"] == list(range(p + 3))
    assert e["values"] == [None if q % 2 == 0 else float(q) for q in range(p + 3)]
    assert e["nonfinite"] == sum(q % 2 == 0 for q in range(p + 3))
    # base64 keeps the NaN itself
    b = xmix.decode_results(
        complete(server, {"apps": ["nan"], "encoding": "base64"}, max_tokens=4).json()["xmix"]
    )
    v = b["nan"]["n"]["values"]
    assert all(math.isnan(v[q]) == (q % 2 == 0) for q in range(p + 3))


def _metric(s, name: str) -> float:
    for line in s["client"].get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_byte_cap_over_http(server):
    p = len(server["tok"].encode(PROMPT))
    per_pos = (1 + D) * 26 + 2 * 26
    refusals = _metric(server, "vllm:xmix_result_cap_refusals_total")
    for stream in (False, True):
        r = complete(server, {"apps": ["cap"], "max_result_bytes": p * per_pos - 1}, stream=stream)
        assert r.status_code == 400, r.text
        assert f"over its {p} prompt tokens" in r.json()["error"]["message"]
    r = complete(server, {"apps": ["cap"], "max_result_bytes": SERVER_CAP + 1})
    assert r.status_code == 400 and "at most 400000" in r.json()["error"]["message"]
    assert _metric(server, "vllm:xmix_result_cap_refusals_total") == refusals + 2
    # generated positions past the cap: cut, with the marker (response and stream alike)
    truncated = _metric(server, "vllm:xmix_results_truncated_total")
    cap = (p + 2) * per_pos + 5
    r = complete(server, {"apps": ["cap"], "max_result_bytes": cap}, max_tokens=11)
    body = r.json()["xmix"]
    assert body["!truncated"].startswith(f"truncated at {cap} bytes")
    assert body["cap"]["h"]["positions"] == list(range(p + 2))
    chunks = stream_payloads(server, {"apps": ["cap"], "max_result_bytes": cap}, max_tokens=11)
    assert sum("!truncated" in c for c in chunks) == 1
    assert xmix.decode_results(chunks)["cap"]["h"]["positions"].tolist() == list(range(p + 2))
    assert _metric(server, "vllm:xmix_results_truncated_total") == truncated + 2
    # without a cap of its own the request gets the server's: a long generation is cut there
    r = complete(server, {"apps": ["cap"]}, max_tokens=120)
    assert r.status_code == 200 and r.json()["xmix"]["!truncated"].startswith(
        f"truncated at {SERVER_CAP} bytes"
    )
