"""A monitor's stop in vLLM's own scheduler (no model, no workers): the engine-core patch
finishes the request in the update of the step whose results carry the stop, frees its KV
blocks there, drops the token sampled in that step, and, with async scheduling, drops the
output of the step already scheduled before the stop was seen. Oracles: vLLM's own counters
(free blocks, requests, queues) and the outputs it returns."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from xmix.integrations.vllm.result_keys import CARRIER  # noqa: E402
from xmix.integrations.vllm.worker import engine_core  # noqa: E402
from xmix.lang.results_codec import STOPPED_KEY, unpack_results  # noqa: E402
from xmix.models.tiny import tiny_model_path  # noqa: E402

BLOCK = 16


def scheduler(async_: bool):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    engine_core.patch_scheduler(Scheduler)  # what the plugin does in the engine core
    mc = ModelConfig(
        model=str(tiny_model_path("tiny-llama")), dtype="float32", max_model_len=256, seed=0
    )
    sc = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    vc.cache_config.num_gpu_blocks = 64
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32
                ),
            )
        ],
    )
    cls = AsyncScheduler if async_ else Scheduler
    return cls(
        vllm_config=vc,
        kv_cache_config=kv,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK,
    )


def add(s, rid: str, n_prompt: int):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    s.add_request(Request(rid, list(range(3, 3 + n_prompt)), sp, None))


def runner_output(sched_out, tokens: dict[str, int], results: dict | None = None):
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(sched_out.num_scheduled_tokens)
    out = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[tokens[r]] if r in tokens else [] for r in ids],
    )
    if results:
        setattr(out, CARRIER, results)
    return out


def outputs(eco_by_client) -> dict[str, object]:
    return {o.request_id: o for batch in eco_by_client.values() for o in batch.outputs}


STOP = {"app": "mon", "read": "p", "position": 12, "value": 0.75}


@pytest.mark.parametrize("async_", [False, True])
def test_a_stop_frees_the_request_in_the_update_that_sees_it(async_):
    from vllm.v1.engine import FinishReason

    s = scheduler(async_)
    free0 = s.kv_cache_manager.block_pool.get_num_free_blocks()
    add(s, "a", 12)
    add(s, "b", 12)
    step1 = s.schedule()  # both prompts
    assert set(step1.num_scheduled_tokens) == {"a", "b"}
    step2 = s.schedule() if async_ else None  # async: the next step is under way already
    if async_:
        assert set(step2.num_scheduled_tokens) == {"a", "b"}
    used = free0 - s.kv_cache_manager.block_pool.get_num_free_blocks()
    got = outputs(
        s.update_from_output(
            step1, runner_output(step1, {"a": 100, "b": 200}, {"a": {STOPPED_KEY: STOP}})
        )
    )
    a = got["a"]
    assert a.finish_reason == FinishReason.STOP and a.new_token_ids == []  # 100 dropped
    assert unpack_results(a.kv_transfer_params[CARRIER])[STOPPED_KEY] == STOP
    assert got["b"].new_token_ids == [200] and got["b"].finish_reason is None
    # freed in this update: its slot (the request) and its KV blocks
    assert "a" not in s.requests and all(r.request_id != "a" for r in s.running)
    freed = s.kv_cache_manager.block_pool.get_num_free_blocks() - (free0 - used)
    assert freed == 1  # a's 12 tokens (+1 placeholder under async) fit one block of 16
    if async_:
        # the step scheduled before the stop was seen: its token for "a" is dropped
        got = outputs(s.update_from_output(step2, runner_output(step2, {"a": 101, "b": 201})))
        assert "a" not in got and got["b"].new_token_ids == [201]
    nxt = s.schedule()
    assert "a" in nxt.finished_req_ids and set(nxt.num_scheduled_tokens) == {"b"}
    assert list(s.requests["b"].output_token_ids) == ([200, 201] if async_ else [200])


def test_a_stop_inside_a_prefill_chunk_ends_the_request_without_a_token():
    from vllm.v1.engine import FinishReason

    s = scheduler(False)
    add(s, "long", 100)  # 64 tokens, then 36
    step1 = s.schedule()
    assert step1.num_scheduled_tokens == {"long": 64}
    got = outputs(
        s.update_from_output(
            step1, runner_output(step1, {}, {"long": {STOPPED_KEY: {**STOP, "position": 40}}})
        )
    )
    assert got["long"].finish_reason == FinishReason.STOP and got["long"].new_token_ids == []
    assert not s.requests and s.schedule().num_scheduled_tokens == {}
    # a stop for a request finished meanwhile changes nothing
    late = s.update_from_output(step1, runner_output(step1, {}, {"long": {STOPPED_KEY: STOP}}))
    assert "long" not in outputs(late)
