"""One ``xmix serve`` process on the tiny Llama for a test module (soak, faults, fuzz,
tenants): started with the given flags and environment, stopped with its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from serve_util import free_port, wait_until_healthy
from xmix.models.tiny import tiny_model_path

MODEL_NAME = "tiny"


class Server:
    def __init__(self, proc: subprocess.Popen, base: str, log: Path):
        self.proc, self.base, self.log = proc, base, log

    def client(self, key: str | None, timeout: float = 120) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def tracebacks(self) -> int:
        return self.log_text().count("Traceback (most recent call last)")

    def alive(self) -> bool:
        return (
            self.proc.poll() is None
            and httpx.get(f"{self.base}/health", timeout=10).status_code == 200
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise


@contextlib.contextmanager
def xmix_serve(tmp: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    """``xmix serve`` with ``args`` after the model (apps, keys, vLLM flags)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "xmix.cli",
        "serve",
        str(tiny_model_path("tiny-llama")),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",  # tests/engine_util.py: compiled serving is tests/server/test_server.py
        "--served-model-name",
        MODEL_NAME,
        *args,
    ]
    log_path = tmp / "serve.log"
    log = open(log_path, "w")
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    for k in [k for k, v in full_env.items() if v is None]:
        full_env.pop(k)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=full_env
    )
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_until_healthy(proc, server.base, log_path, timeout)
        yield server
    finally:
        if proc.poll() is None:
            server.stop()
        log.close()
