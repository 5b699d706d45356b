"""Ray as vLLM's executor (``--distributed-executor-backend ray``), as far as this CPU machine
can test it.

vLLM 0.32's CPU platform has no Ray device key (``CpuPlatform.ray_device_key == ""``), so
``initialize_ray_cluster`` refuses the engine ("current platform cpu does not support ray")
before any worker exists: an engine comparison (Ray TP=2 against mp) cannot run here and runs
nowhere in CI. What runs here:

- the worker side of xmix loads in a process Ray starts, the way vLLM's ``RayWorkerProc``
  actors load it: ``vllm.plugins.load_general_plugins()`` (``WorkerWrapperBase.init_worker``)
  runs the ``vllm.general_plugins`` entry point and every worker patch of ``fence.PATCHES``
  is applied in that process, against that process's vLLM (``fence.problems()`` empty);
- the refusal on CPU, so the day vLLM's CPU platform gains Ray this test fails and the engine
  comparison (docs/serving.md, "Ray (multi-node)") is what to add.

One local Ray (1 CPU, no dashboard, the smallest object store Ray accepts), stopped at the end.
"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

_OBJECT_STORE = 80 * 1024**2  # Ray refuses less than 75 MiB


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        pytest.skip("a Ray runtime is already up in this process")
    # The test process must not pass XMIX_DISABLE to the actor (Ray copies the driver's env).
    env = {k: v for k, v in os.environ.items() if k == "XMIX_DISABLE"}
    assert not env, "XMIX_DISABLE is set: the plugin would not load in Ray workers"
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        object_store_memory=_OBJECT_STORE,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _worker_side() -> dict:
    """Runs inside a Ray worker process: what vLLM's worker does before load_model. (Shipped
    by value: the worker cannot import this test module.)"""
    import os

    from vllm.plugins import load_general_plugins

    from xmix.integrations.vllm import fence, plugin

    before = plugin._done
    load_general_plugins()
    load_general_plugins()  # vLLM calls it more than once per process: must be idempotent
    missing, checked = [], []
    for p in fence.PATCHES:
        if p.by != "worker":
            continue
        cls = fence._resolve(p.target)
        if cls is None:  # an optional target absent from this vLLM build (runner V2)
            continue
        checked.append(f"{p.target}.{p.method}")
        if not fence.applied(cls, p.method, "worker"):
            missing.append(f"{p.target}.{p.method}")
    return {
        "pid": os.getpid(),
        "before": before,
        "done": plugin._done,
        "checked": checked,
        "missing": missing,
        "problems": fence.problems(),
    }


def test_worker_patches_load_in_a_ray_worker_process(local_ray):
    import sys

    from ray import cloudpickle  # Ray pickles tasks with its own copy

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    out = ray.get(ray.remote(num_cpus=1)(_worker_side).remote(), timeout=120)
    assert out["pid"] != os.getpid(), "the check must run in a process Ray started"
    assert out["before"] is False, "a fresh Ray worker must start without xmix's patches"
    assert out["done"] is True
    assert out["problems"] == []
    # Every worker patch the fence declares for this vLLM (runner step, load_model on the
    # GPU and CPU runners, the worker's RPC methods) is in place in the Ray process.
    # (23 with vLLM 0.32; XMIX_DISABLE=1 in the actor's runtime_env leaves all of them missing.)
    for must in (
        "cpu_model_runner:CPUModelRunner.load_model",
        "gpu_model_runner:GPUModelRunner.execute_model",
        "worker_base:WorkerBase.xmix_deploy",
        "worker_base:WorkerBase.xmix_describe",
    ):
        assert any(c.endswith(must) for c in out["checked"]), (must, out["checked"])
    assert out["missing"] == [], out["missing"]


def test_vllm_cpu_platform_refuses_ray(local_ray):
    from vllm.config import ParallelConfig
    from vllm.platforms import current_platform
    from vllm.v1.executor.ray_utils import initialize_ray_cluster

    if current_platform.device_type != "cpu":
        pytest.skip("this records the CPU platform's limit")
    assert current_platform.ray_device_key == ""
    cfg = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="does not support ray"):
        initialize_ray_cluster(cfg, require_gpu_on_driver=False)
