"""Scheduling trace for bench/serve_overhead.py --trace (issue 34): loaded by every process of a
server through PYTHONPATH; records, per process, when a request reaches the API server's engine
client, when it is sent to the engine core, when the engine core adds it, what each scheduler
step holds, and when the API server learns of finished requests. Wall-clock seconds, so that
the processes' lines can be merged. Bench tooling only: nothing in xmix reads it."""

import atexit
import functools
import json
import os
import time

_DIR = os.environ.get("BENCH_SCHED_TRACE")
_lines: list[str] = []


def _log(ev: str, **kw) -> None:
    _lines.append(json.dumps({"t": time.time(), "ev": ev, **kw}))
    if len(_lines) >= 256:
        _flush()


def _flush() -> None:
    if not _lines:
        return
    with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as f:
        f.write("\n".join(_lines) + "\n")
    _lines.clear()


def _run_delay() -> float:
    """Seconds this thread has waited on a run queue (Linux's schedstat; 0 where absent)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except OSError:
        return 0.0


def _install() -> None:
    from vllm.v1.core.sched import scheduler
    from vllm.v1.engine import async_llm, core, core_client, output_processor

    def wrap(cls, name, before=None, after=None):
        orig = getattr(cls, name)
        if getattr(orig, "_sched_trace", False):
            return
        flags = orig.__code__.co_flags if hasattr(orig, "__code__") else 0
        if flags & 0x200:  # async generator function: `after` sees each item

            async def f(self, *a, **kw):
                if before:
                    before(self, *a, **kw)
                async for item in orig(self, *a, **kw):
                    if after:
                        after(self, item)
                    yield item
        elif flags & 0x80:  # coroutine function

            async def f(self, *a, **kw):
                if before:
                    before(self, *a, **kw)
                return await orig(self, *a, **kw)
        else:

            def f(self, *a, **kw):
                if before:
                    before(self, *a, **kw)
                r = orig(self, *a, **kw)
                if after:
                    after(self, r)
                return r

        f = functools.wraps(orig)(f)  # xmix's fence checks the patched methods' signatures
        f._sched_trace = True
        setattr(cls, name, f)

    from vllm.entrypoints.openai.completion import serving

    # the HTTP side: a completion request reaching vLLM's handler (after the body is parsed),
    # and the last chunk of a stream leaving it
    wrap(
        serving.OpenAIServingCompletion,
        "create_completion",
        before=lambda s, *a, **k: _log("http_in"),
    )

    def chunk(s, item):
        if isinstance(item, str) and "[DONE]" in item:
            _log("http_done")

    wrap(serving.OpenAIServingCompletion, "completion_stream_generator", after=chunk)
    wrap(async_llm.AsyncLLM, "add_request", before=lambda s, rid, *a, **k: _log("api_add", rid=rid))
    wrap(
        core_client.AsyncMPClient,
        "add_request_async",
        before=lambda s, req, *a, **k: _log("sent", rid=req.request_id),
    )
    wrap(
        core.EngineCore,
        "add_request",
        before=lambda s, req, *a, **k: _log("core_add", rid=req.request_id),
    )

    def step(s, out):
        _log(
            "step",
            new=[r.req_id for r in out.scheduled_new_reqs],
            n=len(out.num_scheduled_tokens),
            tokens=out.total_num_scheduled_tokens,
        )

    wrap(scheduler.Scheduler, "schedule", after=step)

    def before_out(s, engine_core_outputs, *a, **k):
        fin = [o.request_id for o in engine_core_outputs if o.finish_reason is not None]
        _log("out", n=len(engine_core_outputs), finished=fin)

    wrap(output_processor.OutputProcessor, "process_outputs", before=before_out)

    # the legs of a step: the worker's forward (execute_model) and sampling, the engine core's
    # update from the worker's output (which splits a slower step between them)
    from vllm.v1.worker import gpu_model_runner

    def timed(cls, name, ev):
        orig = getattr(cls, name)

        def f(self, *a, **kw):
            t0, c0, w0 = time.time(), time.process_time(), _run_delay()
            r = orig(self, *a, **kw)
            first = a[0] if a else kw.get("scheduler_output", kw.get("input_ids"))
            tokens = getattr(first, "total_num_scheduled_tokens", None)
            if tokens is None and hasattr(first, "shape"):  # the forward's input ids
                tokens = int(first.shape[0])
            # cpu: the process's CPU time in the leg (all its threads); wait: the time this
            # thread was runnable but not running (the kernel's run delay). A leg that is
            # longer on one server for the same work is either more work (cpu) or the
            # machine's other processes taking the cores (wait).
            _log(
                ev,
                t0=t0,
                dt=time.time() - t0,
                cpu=time.process_time() - c0,
                wait=_run_delay() - w0,
                tokens=tokens,
            )
            return r

        f = functools.wraps(orig)(f)
        f._sched_trace = True
        setattr(cls, name, f)

    timed(gpu_model_runner.GPUModelRunner, "execute_model", "exec")
    # the model's forward alone (the compiled graph, with xmix's sites where xmix serves),
    # inside execute_model: the rest of execute_model is the runner's own host work
    timed(gpu_model_runner.GPUModelRunner, "_model_forward", "fwd")
    timed(gpu_model_runner.GPUModelRunner, "sample_tokens", "sample")
    timed(scheduler.Scheduler, "update_from_output", "update")


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    atexit.register(_flush)
    try:
        _install()
    except Exception as e:  # a trace must not stop a server: say so and serve untraced
        _log("trace_not_installed", error=repr(e))
