"""One ``xmix serve`` process on the tiny Llama for a test module (tests/server/test_console.py,
tests/server/test_openai_client.py): started with the given app files, stopped with its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from xmix.models.tiny import tiny_model_path

KEY = "console-test-key"
MODEL_NAME = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout: float) -> None:
    """Until the server answers /health; its log's tail in the error if it dies or is late."""
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError("xmix serve died:\n" + log_path.read_text()[-4000:])
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() - t0 > timeout:
            raise TimeoutError("xmix serve did not start:\n" + log_path.read_text()[-4000:])
        time.sleep(1)


@contextlib.contextmanager
def xmix_server(tmp: Path, app_paths: list[Path], *extra: str, timeout: float = 400):
    port = free_port()
    model = tiny_model_path("tiny-llama")
    cmd = [
        sys.executable,
        "-m",
        "xmix.cli",
        "serve",
        str(model),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",  # tests/engine_util.py: compiled serving is tests/server/test_server.py
        "--api-key",
        KEY,
        "--xmix-admin-key",
        KEY,
        "--served-model-name",
        MODEL_NAME,
        *extra,
    ]
    for p in app_paths:
        cmd += ["--app", str(p)]
    log_path = tmp / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base, log_path, timeout)
        client = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
        )
        yield {
            "base": base,
            "port": port,
            "client": client,
            "model": model,
            "log": log_path,
            "key": KEY,
            "name": MODEL_NAME,
        }
        client.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
