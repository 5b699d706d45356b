"""xmix inside a vLLM worker: the control block, per-step maps, results, control RPCs.

Per step (model runner V1, which the CPU engine uses; all of it outside any graph):
  execute_model     admit new requests into slots, release finished ones
  _model_forward    before: fill token/row maps + prologue; after: drain reads (rank 0)
  sample_tokens     hand the drained reads to the scheduler on the ModelRunnerOutput

Control changes arrive as collective RPCs, which vLLM's engine core runs between steps, so
every change takes effect at a step boundary.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import torch

import xmix._C as _C
from xmix import settings
from xmix.integrations.vllm import enable, fence
from xmix.integrations.vllm.result_keys import CARRIER
from xmix.integrations.vllm.worker.model_wrap import place_sites
from xmix.lang import deploy_work, program_codec
from xmix.lang.architectures import Family, architecture_of, require_family
from xmix.lang.results_codec import (  # noqa: F401 (merge_results re-exported)
    DROPPED_KEY,
    ERROR_KEY,
    ResultOptions,
    merge_packed,
    merge_results,
    pack_results,
)
from xmix.lang.sites import ModelShape, n_sites
from xmix.runtime import ops
from xmix.runtime.control import Capacity, ControlBlock, PendingReads

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply


def merge_packed_into(into: dict[str, dict], new: dict[str, dict]) -> None:
    """Packed results of later steps after those ``into`` holds, by request (a request's
    first ones moved, not copied)."""
    for rid, apps in new.items():
        have = into.get(rid)
        into[rid] = apps if have is None else merge_packed(have, apps)


K_STOP_BITS = _C.constants()["STOP_POSITION_BITS"]
# ERROR_KEY in a request's results: the worker could not serve it; the frontend ends it


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:
        return 0


class WorkerXmix:
    """One per model runner (one engine per process)."""

    def __init__(self, runner, family: Family):
        cfg = runner.vllm_config
        hf = cfg.model_config.hf_config
        self.family = family
        self.shape = ModelShape.from_hf_config(hf, cfg.model_config.model)
        sched = cfg.scheduler_config
        # Staging sets: one more than the steps vLLM keeps in flight (config/vllm.py:
        # VllmConfig.max_concurrent_batches), so the host never waits for a set in steady state.
        depth = max(3, int(getattr(cfg, "max_concurrent_batches", 2)) + 1)
        cap = Capacity(
            max_tokens=max(int(sched.max_num_batched_tokens), 512),
            max_slots=max(int(sched.max_num_seqs), 1) + 8,
            staging_depth=depth,
            capture_floats=capture_floats(),
        )
        self._attach(ControlBlock(self.shape, runner.device, cap), _tp_rank() == 0)
        self.max_model_len = int(getattr(cfg.model_config, "max_model_len", 0) or 0)
        self.pp = _stage_link(cfg, self.shape.n_layers)
        opts = enable.options(enable.config_value(cfg))
        self.sites, self.placed = place_sites(
            runner.model, self.shape.n_layers, family, opts.get("sites"), opts.get("layers")
        )
        _warn_lost_fusion(cfg, family, runner.model, self.sites)
        logger.info(
            "xmix: control block ready on %s (%d layers, d=%d, %d tokens x %d slots)",
            runner.device,
            self.shape.n_layers,
            self.shape.hidden_size,
            cap.max_tokens,
            cap.max_slots,
        )

    @classmethod
    def for_control_block(cls, cb: ControlBlock, rank0: bool = True) -> WorkerXmix:
        """The per-step path without a model runner (tests drive it with stand-ins)."""
        x = cls.__new__(cls)
        x.shape = cb.shape
        x._attach(cb, rank0)
        x.sites = {}
        x.placed = frozenset(range(n_sites(cb.shape.n_layers)))  # no model: every site id counts
        x.pp = None
        x.max_model_len = 0
        return x

    def _attach(self, cb: ControlBlock, rank0: bool) -> None:
        self.cb = cb
        ops.set_control(cb)
        self.rank0 = rank0
        # reads drained on the host (CPU engine), packed (results_codec.pack_results: the form
        # they leave the worker in), by request
        self.pending: dict[str, dict] = {}
        self.pending_reads: list[PendingReads] = []  # reads still on their way (GPU)
        self.sched = None
        self.stats = {"steps": 0, "steps_with_apps": 0, "admit_errors": 0, "restarts": 0}
        # xmix's own host time in this worker, seconds: the per-step bookkeeping around the
        # forward (admission, step maps, prologue, drain) and the active site programs inside
        # it (runtime/ops.py). Operators and bench/serve_paired.py read them as a share of the step.
        self.host_seconds = 0.0
        self._started = cb.step.started  # the restart check's (the step's native call reads it)
        # (row slots, tokens) of a step that ran apps, for the next stage
        self._pp_step: tuple[np.ndarray, int] | None = None

    # ------------------------------------------------------------------ requests
    def on_schedule(self, sched) -> None:
        """V1: before the step; finished requests leave, new ones get slots."""
        self.sched = sched
        self.release(sched.finished_req_ids)
        for rid in getattr(sched, "preempted_req_ids", None) or ():
            self.cb.slots.suspend(rid)  # back in the waiting queue; resumed when scheduled again
        self.admit_new(sched.scheduled_new_reqs)

    def release(self, req_ids) -> None:
        for rid in req_ids:
            self.cb.release(rid)

    def admit_new(self, new_reqs) -> None:
        """Slots for the step's new requests. The frontend checked each control and pinned
        its apps to deployment versions, so admission cannot fail on what a request carries;
        an app undeployed or redeployed since is left out (counted as ``stale_apps``).
        Anything that still fails is contained to its request: it runs without apps and
        finishes with an error (``ERROR_KEY`` in its results); nothing escapes the step."""
        cb = self.cb
        slots = cb.slots
        for nr in new_reqs:
            n_prompt = 0
            try:
                n_prompt = _prompt_len(nr)
                slot = slots.resume(nr.req_id)  # V2 adds a preempted request again when it resumes
                if slot is not None:
                    self.stats["restarts"] += 1
                    self._started[slot] = False
                    continue
                apps, pins, params, forced, opts = _control(nr.sampling_params)
                dropped: list = []
                if pins is None:  # not resolved by xmix's frontend: by name, checked here
                    slot = cb.admit(nr.req_id, apps, params, n_prompt, opts)
                else:
                    slot, dropped = slots.admit_pinned(
                        nr.req_id, apps, pins, n_prompt, forced, opts
                    )
                self._started[slot] = False
                if dropped:
                    self.stats["stale_apps"] = self.stats.get("stale_apps", 0) + 1
                    self.pending.setdefault(nr.req_id, {})[DROPPED_KEY] = sorted(map(str, dropped))
                    logger.info(
                        "xmix: request %s runs without %s (undeployed or redeployed since "
                        "it was admitted)",
                        nr.req_id,
                        dropped,
                    )
            except Exception as e:
                self._contain(nr.req_id, n_prompt, e)

    def _contain(self, req_id: str, n_prompt: int, e: Exception) -> None:
        self.stats["admit_errors"] += 1
        logger.warning(
            "xmix: request %s failed at admission on the worker (%s: %s); it is "
            "finished with an error",
            req_id,
            type(e).__name__,
            e,
        )
        self.pending.setdefault(req_id, {})[ERROR_KEY] = (
            f"xmix could not admit this request on a worker ({type(e).__name__}: {e})"
        )
        if req_id not in self.cb.slots.slot_of:
            try:  # a plain slot, so the step's maps still place its tokens (inert)
                self._started[self.cb.admit(req_id, [], None, n_prompt)] = False
            except Exception:
                logger.exception("xmix: no slot for request %s", req_id)

    def before_forward(self, runner, input_ids: torch.Tensor | None) -> None:
        """V1: the runner's persistent input batch describes this step."""
        sched, self.sched = self.sched, None
        if sched is None or input_ids is None or not self.cb.step.could_run():
            self.begin(None, None, None, None, None, 0)
            return
        ib = runner.input_batch
        n = ib.num_reqs
        self.begin(
            ib.req_ids[:n],
            sched.num_scheduled_tokens,  # {req id: tokens}: read per request where it is used
            ib.num_computed_tokens_cpu[:n],
            ib.num_prompt_tokens[:n],
            input_ids,
            int(input_ids.shape[0]),
        )

    def begin(self, req_ids, n_tok, start, plen, input_ids, padded: int) -> None:
        """Per-step maps and prologue for the scheduled requests (batch order). ``n_tok``:
        token counts in batch order, or vLLM's {req id: scheduled tokens}. ``plen`` may be
        None: the prompt lengths recorded at admission are used."""
        cb = self.cb
        if cb.on_gpu:
            # Kept CUDA graphs follow deploys and mode changes before the next replay.
            from xmix.runtime import graphs

            graphs.ensure_current(cb)
        self.stats["steps"] += 1
        self._pp_step = None
        step = cb.step
        if req_ids is None or not cb.apps or not step.could_run():
            # No request holds an app, none is in mode "all", no span to follow: this step
            # pays nothing more.
            step.no_sites()
            return
        if plen is not None:
            # unstaged (CPU) engines: slots, restart check, maps and prologue in one native call
            got = step.run(req_ids, n_tok, start, plen, input_ids, padded)
            if got is not None:
                self._begun(got[0], got[1])
                return
        n = len(req_ids)
        if isinstance(n_tok, dict):
            n_tok = np.fromiter((n_tok[r] for r in req_ids), dtype=np.int64, count=n)
        slots = np.empty(n, dtype=np.int32)
        slot_of = cb.slots.slot_of
        for i, rid in enumerate(req_ids):
            slot = slot_of.get(rid)
            if slot is None:
                slot = cb.slots.resume(rid)
                if slot is not None:  # back from preemption: recomputes from its KV
                    self.stats["restarts"] += 1
                    self._started[slot] = False
                else:  # not admitted through the scheduler output: no apps
                    slot = cb.admit(rid, [], {}, int(plen[i]) if plen is not None else 0)
            slots[i] = slot
        if plen is None:
            slot_req = cb.slots.slot_req
            plen = np.fromiter(
                (slot_req[s].prompt_len for s in slots.tolist()), dtype=np.int64, count=n
            )
        if step.native is not None:
            self._begun(*step.begin_slots(slots, n_tok, start, plen, input_ids, padded), slots)
            return
        start = np.asarray(start)
        # A request that starts again at position 0 without having been preempted (V1 keeps
        # such a request's slot) recomputes too; the prologue resets its state.
        again = self._started[slots] & (start == 0)
        if again.any():
            self.stats["restarts"] += int(again.sum())
            for s in slots[again].tolist():
                cb.slots.recompute(s)  # its monitors keep what they decided
        self._started[slots] = True
        ran = step.begin(slots, np.asarray(n_tok), start, np.asarray(plen), padded)
        if ran:
            step.prologue(input_ids)
        self._begun(ran, 0, slots)

    def _begun(self, ran: bool, restarts: int, slots: np.ndarray | None = None) -> None:
        if restarts:
            self.stats["restarts"] += restarts
        if ran:
            self.stats["steps_with_apps"] += 1
            if self.pp is not None:
                # after the prologue (which resets restarted requests' read state), before the forward
                step = self.cb.step
                if slots is None:
                    assert step.rows is not None
                    slots = step.rows[0][: step.rows[1]]
                n_all = step.tokens
                self.pp.inject(self.cb, slots, n_all)
                self._pp_step = (slots, n_all)

    def after_forward(self) -> None:
        cb = self.cb
        if not cb.step.any_active and not cb.mem.span_mask:
            return
        sites = cb.sites
        sites.collect()  # before the drain (a failed site clears its reads)
        if self.rank0:
            if cb.staged:
                # No host wait here: the results are copied on a side stream and read where
                # vLLM reads its own sampled tokens (get_output), after sampling is queued.
                p = cb.reads.drain_async()
                if p is not None:
                    self.pending_reads.append(p)
            else:
                pending, drained = self.pending, cb.drain(packed=True)
                if not pending:  # taken every step (sample_tokens): the drain's dict, moved
                    self.pending = drained
                else:
                    merge_packed_into(pending, drained)
        if sites.failed:
            # An app failed inside a site program: its requests of this step end with the
            # error (the frontend finishes them); the step and every other request go on.
            for rid, msg in sites.take_failed().items():
                self.stats["site_errors"] = self.stats.get("site_errors", 0) + 1
                logger.warning("xmix: request %s finished with an error: %s", rid, msg)
                if self.rank0:
                    self.pending.setdefault(rid, {})[ERROR_KEY] = f"xmix: {msg}"
        cb.step.end()

    def has_results(self) -> bool:
        return bool(self.pending or self.pending_reads)

    def take_results(self):
        """A function returning the reads of the steps since the last call, packed:
        {req_id: {app: {read: packed ReadResult}}}. Calling it waits for reads still on their
        way to the host."""
        direct, reads = self.pending, self.pending_reads
        self.pending, self.pending_reads = {}, []

        def resolve() -> dict[str, dict]:
            for p in reads:
                merge_packed_into(
                    direct, {rid: pack_results(apps) for rid, apps in p.result().items()}
                )
            return direct

        return resolve

    # ------------------------------------------------------------------ control RPCs
    def deploy(
        self, data: bytes, mode: str, version: int = 0, commit: bool = True
    ) -> dict[str, Any]:
        """Check and stage an app's lowered program (the frontend lowered it; it is decoded
        and checked here, never lowered again: lang/program_codec.py); ``commit`` swaps it in at
        once, else ``xmix_deploy_commit`` does."""
        lowered = program_codec.decode(data, self.shape, "deploy")
        name = lowered.name
        if lowered.stop is not None and self.max_model_len > 1 << K_STOP_BITS:
            from xmix.lang.lowering import DeployError

            raise DeployError(
                f"app {name!r}: a stop records positions below 2^{K_STOP_BITS}; this "
                f"engine's max_model_len is {self.max_model_len}"
            )
        if self.pp is not None:
            from xmix.integrations.vllm.worker.pp import check_deploy

            check_deploy(lowered, self.pp.stages)
        missing = sorted({op.site_id for op in lowered.ops} - self.placed)
        if missing:
            from xmix.lang.lowering import DeployError
            from xmix.lang.sites import site_name

            names = ", ".join(site_name(s, self.shape.n_layers) for s in missing[:8])
            raise DeployError(
                f"app {name!r} needs site(s) {names}{' ...' if len(missing) > 8 else ''}, "
                f"which this engine did not place (additional_config['xmix'] sites / "
                f"layers chose the placed sites at start)"
            )
        self.cb.deploy.prepare_install(lowered, mode, version)
        if commit:
            self.cb.deploy.commit_install(lowered.name)
        return {"name": lowered.name, "sites": lowered.sites}

    def describe(self) -> list[dict]:
        return self.cb.deploy.describe()


def _stage_link(cfg, n_layers: int):
    """The pipeline-parallel link of this worker's stage, or None without PP."""
    size = int(getattr(cfg.parallel_config, "pipeline_parallel_size", 1) or 1)
    if size < 2:
        return None
    from vllm.distributed import get_pp_group

    from xmix.integrations.vllm.worker.pp import StageLink, Stages

    return StageLink(Stages.of(n_layers, get_pp_group().rank_in_group, size))


def capture_floats() -> int:
    """Room for captured vectors per step (``XMIX_CAPTURE_MB``, default 16 MiB): a capture
    read of width w takes w x max_num_batched_tokens floats of it."""
    return max(int(settings.get("XMIX_CAPTURE_MB") * 2**20) // 4, 1)


def _prompt_len(nr) -> int:
    n = getattr(nr, "prompt_len", None)
    if isinstance(n, int):
        return n
    if nr.prompt_token_ids is not None:
        return len(nr.prompt_token_ids)
    return len(nr.prompt_embeds) if nr.prompt_embeds is not None else 0


def _control(sp) -> tuple[list[str], dict | None, dict, list[str] | None, ResultOptions | None]:
    """(apps, pins, named params, mode-"all" apps allowed, result options) of the control
    on a request's SamplingParams; pins is None when the control did not come through
    xmix's frontend (which always pins); the allowed list is None when every mode-"all"
    app applies."""
    cfg = (sp.extra_args or {}).get("xmix") if sp is not None else None
    if not isinstance(cfg, dict):
        return [], {}, {}, None, None
    pins = cfg.get("pin")
    forced = cfg.get("forced")
    return (
        list(cfg.get("apps") or []),
        dict(pins) if pins is not None else None,
        dict(cfg.get("params") or {}),
        [a for a in forced if isinstance(a, str)] if isinstance(forced, list) else None,
        ResultOptions.from_control(cfg.get("results")),
    )


def _warn_lost_fusion(cfg, family: Family, model, counts: dict[str, int]) -> None:
    """At tensor_parallel_size >= 2 with vLLM's all-reduce + RMSNorm fusion on, say at start
    which placed sites keep it from applying (EngineMap.fusion_gaps)."""
    from xmix.lang.architectures import engine_map

    tp = int(getattr(cfg.parallel_config, "tensor_parallel_size", 1) or 1)
    pc = getattr(getattr(cfg, "compilation_config", None), "pass_config", None)
    if tp < 2 or not getattr(pc, "fuse_allreduce_rms", False):
        return
    gaps = [s for s in engine_map(family, model).fusion_gaps if counts.get(s)]
    if gaps:
        logger.warning(
            "xmix: tensor_parallel_size=%d: the hook sites %s sit between an all-reduce "
            "and the RMSNorm vLLM fuses it with, so the all-reduce + RMSNorm fusion does not "
            "apply where they are placed; place fewer with additional_config['xmix'] "
            "sites / layers (docs/models.md)",
            tp,
            ", ".join(gaps),
        )


# ---------------------------------------------------------------------- patches
def _runner_xmix(runner) -> WorkerXmix | None:
    return getattr(runner, "_xmix", None)


def patch_model_runner(cls) -> None:
    """Wrap the V1 GPUModelRunner (and so the CPU runner that subclasses it)."""
    found = fence.to_wrap(
        "worker", (cls, "execute_model"), (cls, "_model_forward"), (cls, "sample_tokens")
    )
    if found is None:
        return
    orig_execute, orig_forward, orig_sample = found

    def execute_model(self, scheduler_output, *args, **kwargs):
        x = _runner_xmix(self)
        if x is None:
            return orig_execute(self, scheduler_output, *args, **kwargs)
        t0 = time.perf_counter()
        x.on_schedule(scheduler_output)
        x.host_seconds += time.perf_counter() - t0
        if x.pp is None:
            return orig_execute(self, scheduler_output, *args, **kwargs)
        return _execute_stage(self, x, orig_execute, scheduler_output, args, kwargs)

    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        x = _runner_xmix(self)
        if x is None:
            return orig_forward(self, input_ids, positions, *args, **kwargs)
        t0 = time.perf_counter()
        x.before_forward(self, input_ids)
        t1 = time.perf_counter()
        try:
            return orig_forward(self, input_ids, positions, *args, **kwargs)
        finally:
            t2 = time.perf_counter()
            x.after_forward()
            x.host_seconds += (t1 - t0) + (time.perf_counter() - t2)

    def sample_tokens(self, *args, **kwargs):
        return _attach_results(self, orig_sample(self, *args, **kwargs))

    for name, fn in (
        ("execute_model", execute_model),
        ("_model_forward", _model_forward),
        ("sample_tokens", sample_tokens),
    ):
        fence.replace(cls, name, fn, by="worker")


def _execute_stage(runner, x: WorkerXmix, orig_execute, scheduler_output, args, kwargs):
    """One step of a pipeline stage (pp.py): xmix's tensors come off what the previous stage
    sent before vLLM's runner sees it, and go onto what this stage sends."""
    it = args[0] if args else kwargs.get("intermediate_tensors")
    _, reads = x.pp.take_inbox(it)
    if reads:
        merge_packed_into(x.pending, reads)
    out = orig_execute(runner, scheduler_output, *args, **kwargs)
    from vllm.sequence import IntermediateTensors

    if isinstance(out, IntermediateTensors):
        # Not the last stage: vLLM returns no output from this worker, so its reads (and the
        # earlier stages' it received) go on with the hidden states.
        mine = x.take_results()() if x.rank0 and x.has_results() else None
        out.tensors.update(x.pp.outbox(x.cb, x._pp_step, mine))
    x._pp_step = None
    return out


def _attach_results(self, out):
    """Put the reads on the step's output. An async output (V2's
    ``v1/worker/gpu/async_utils.py:AsyncOutput``, V1's ``gpu_model_runner.py:
    AsyncGPUModelRunnerOutput``) gets them when vLLM resolves it: ``get_output`` runs in the
    executor's output thread (``v1/executor/multiproc_executor.py:WorkerProc.enqueue_output``,
    ``uniproc_executor.py:AsyncOutputFuture.result``) after waiting for its own copy event, and
    is where xmix waits for its read-back too. A plain ModelRunnerOutput (no async scheduling)
    gets them now: sampling is already queued, and vLLM waits for its tokens here as well."""
    x = _runner_xmix(self)
    if x is None or out is None or not x.has_results():
        return out
    taken = x.take_results()

    def results() -> dict:
        # Packed (by the drain, in the worker): the output crosses to the engine core by
        # pickle (vLLM's shm MessageQueue), where a request's bytes cost a fraction of its
        # ReadResult objects and numpy arrays, and the engine core passes them on as they are.
        return taken()  # type: ignore[no-any-return]

    if hasattr(out, "get_output") and not hasattr(out, "req_ids"):
        orig_get = out.get_output

        def get_output():
            o = orig_get()
            setattr(o, CARRIER, results())
            return o

        out.get_output = get_output
    else:
        setattr(out, CARRIER, results())
    return out


def patch_model_runner_v2(cls) -> None:
    """Model runner V2 (vllm/v1/worker/gpu/model_runner.py). Its FULL CUDA graphs replay
    without the model's Python forward, so the per-step maps are written right after
    ``prepare_inputs`` (the step's InputBatch: requests, token counts, computed tokens,
    input ids on the device), before the forward or replay on the same stream. Written
    against vLLM 0.32's source; the CPU engine runs V1, so this path has not run here."""
    found = fence.to_wrap(
        "worker",
        (cls, "execute_model"),
        (cls, "finish_requests"),
        (cls, "add_requests"),
        (cls, "prepare_inputs"),
        (cls, "sample_tokens"),
    )
    if found is None:
        return
    orig_execute, orig_finish, orig_add, orig_prepare, orig_sample = found

    def finish_requests(self, scheduler_output):
        orig_finish(self, scheduler_output)
        x = _runner_xmix(self)
        if x is not None:
            x.release(scheduler_output.finished_req_ids)
            # V2 drops preempted requests and adds them again when they resume.
            for rid in scheduler_output.preempted_req_ids or ():
                x.cb.slots.suspend(rid)

    def add_requests(self, scheduler_output):
        orig_add(self, scheduler_output)
        x = _runner_xmix(self)
        if x is not None:
            x.admit_new(scheduler_output.scheduled_new_reqs)

    def prepare_inputs(self, scheduler_output, *args, **kwargs):
        ib = orig_prepare(self, scheduler_output, *args, **kwargs)
        x = _runner_xmix(self)
        if x is not None:
            t0 = time.perf_counter()
            n = ib.num_reqs
            x.begin(
                ib.req_ids[:n],
                ib.num_scheduled_tokens[:n],
                ib.num_computed_tokens_np[:n],
                None,
                ib.input_ids,
                int(ib.num_tokens_after_padding),
            )
            x.host_seconds += time.perf_counter() - t0
        return ib

    def execute_model(self, scheduler_output, *args, **kwargs):
        try:
            return orig_execute(self, scheduler_output, *args, **kwargs)
        finally:
            x = _runner_xmix(self)
            if x is not None and not kwargs.get("dummy_run", False):
                t0 = time.perf_counter()
                x.after_forward()
                x.host_seconds += time.perf_counter() - t0

    def sample_tokens(self, *args, **kwargs):
        return _attach_results(self, orig_sample(self, *args, **kwargs))

    for name, fn in (
        ("finish_requests", finish_requests),
        ("add_requests", add_requests),
        ("prepare_inputs", prepare_inputs),
        ("execute_model", execute_model),
        ("sample_tokens", sample_tokens),
    ):
        fence.replace(cls, name, fn, by="worker")


def _key_compile_cache(vllm_config) -> None:
    """Set the canonical ``additional_config["xmix"]`` (options + site placement version,
    enable.canonical) before torch.compile runs: the compile cache is keyed by the config
    hash, so graphs compiled with hook sites are never loaded by a plain engine and the
    reverse. An engine that asked through XMIX_ENABLE=1 gets the entry here."""
    extra = vllm_config.additional_config
    if isinstance(extra, dict):
        extra[enable.CONFIG_KEY] = enable.canonical(extra.get(enable.CONFIG_KEY))
    else:  # a platform-specific config object: do not share compiled graphs at all
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"


def patch_load_model(cls) -> None:
    # Only a class with its own load_model: a subclass inheriting a wrapped one is covered.
    if "load_model" not in cls.__dict__:
        return
    found = fence.to_wrap("worker", (cls, "load_model"))
    if found is None:
        return
    (orig,) = found

    def load_model(self, *args, **kwargs):
        if _runner_xmix(self) is not None or not enable.requested(self.vllm_config):
            return orig(self, *args, **kwargs)  # not asked for: vLLM exactly as without xmix
        from xmix.integrations.vllm import support
        from xmix.runtime import graphs

        # Before loading anything: the engine does not start and the message says why (a vLLM
        # the fence does not describe, a configuration xmix cannot serve, a family without a
        # site table, bad options).
        fence.check()
        support.check(self.vllm_config)
        mc = self.vllm_config.model_config
        family = require_family(architecture_of(mc.hf_config), mc.model)
        enable.options(enable.config_value(self.vllm_config))
        # Here, not in the plugin's register(): the worker has initialised its device (vLLM's
        # init_device runs before load_model), and graphs are captured after load_model.
        graphs.install_capture_hook()
        r = orig(self, *args, **kwargs)
        _key_compile_cache(self.vllm_config)
        t0 = time.perf_counter()
        self._xmix = WorkerXmix(self, family)
        # A state directory is read now: a corrupt one stops the engine's start.
        _ledger(self._xmix, self.vllm_config)
        logger.info(
            "xmix: attached to %s (%s) in %.2fs",
            type(self).__name__,
            family.title,
            time.perf_counter() - t0,
        )
        return r

    fence.replace(cls, "load_model", load_model, by="worker")


def _wx(worker) -> WorkerXmix:
    x = _runner_xmix(getattr(worker, "model_runner", None))
    if x is None:
        raise RuntimeError(
            "xmix is not enabled on this engine (start it with xmix.LLM / xmix serve, "
            "or additional_config={'xmix': true})"
        )
    return x


def xmix_capacity(self) -> dict:
    """The control block's fixed sizes, for the frontend's checks before a deploy."""
    cb = _wx(self).cb
    return {
        "max_ops": cb.cap.max_ops,
        "max_cond": cb.cap.max_cond,
        "max_apps": cb.cap.max_apps,
        "max_params": cb.cap.max_params,
        "max_channels": cb.cap.max_channels,
    }


def xmix_deploy(self, data: bytes, mode: str = "request", version: int = 0) -> dict:
    return _wx(self).deploy(data, mode, version)


def xmix_deploy_prepare(self, data: bytes, mode: str = "request", version: int = 0) -> dict:
    """Phase one of a deploy: every check, the new tables built aside; nothing live."""
    return _wx(self).deploy(data, mode, version, commit=False)


def xmix_deploy_commit(self, name: str) -> None:
    _wx(self).cb.deploy.commit_install(name)


def xmix_deploy_abort(self, name: str) -> bool:
    return _wx(self).cb.deploy.abort_install(name)


def xmix_undeploy(self, name: str) -> None:
    _wx(self).cb.remove(name)


def xmix_undeploy_if_present(self, name: str) -> bool:
    """Rollback of a deploy committed on some workers only: remove it where it is."""
    x = _wx(self)
    x.cb.deploy.abort_install(name)
    if name in x.cb.apps:
        x.cb.remove(name)
        return True
    return False


def xmix_patch(self, name: str, mode: str | None = None, params: dict | None = None) -> None:
    _wx(self).cb.patch(name, mode, params)


def xmix_set_mode(self, name: str, mode: str) -> None:
    _wx(self).cb.patch(name, mode=mode)


def xmix_set_params(self, name: str, params: dict) -> None:
    _wx(self).cb.patch(name, params=params)


def xmix_describe(self) -> dict:
    from xmix.runtime import graphs

    x = _wx(self)
    return {
        "apps": x.describe(),
        "sites": x.sites,
        "stats": {
            **x.stats,
            **x.cb.mem.staging_stats(),
            "host_seconds_step": x.host_seconds,
            "host_seconds_sites": x.cb.sites.seconds,
            # which CPU site kernel serves: "native" makes no Python call per site
            "site_kernel": "native" if ops.NATIVE is not None else "python",
            "python_site_calls": ops.python_site_calls[0],
            # app files parsed, apps lowered, programs decoded in this process (a deploy
            # decodes one program here and lowers nothing: lang/deploy_work.py)
            "deploy_work": deploy_work.snapshot(),
        },
        "graphs": graphs.stats(),
        "ops_generation": x.cb.mem.ops_generation,
        "nonfinite_writes": x.cb.sites.nonfinite_writes(),
        "site_errors": dict(x.cb.sites.site_errors),
        "slots_in_use": len(x.cb.slots.slot_of),
        "where": _where(self),
        "ledger": _ledger_summary(x),
    }


def _first_worker(vllm_config) -> bool:
    """The first worker of the first engine: the one whose ledger every server reads
    (``results[0]`` of a fan-out), as state_dir.for_worker decides it."""
    from xmix.integrations.vllm.state_dir import _model_parallel_rank

    par = getattr(vllm_config, "parallel_config", None)
    dp = getattr(par, "data_parallel_index", None)
    if dp is None:
        dp = getattr(par, "data_parallel_rank", 0)
    return int(dp or 0) == 0 and _model_parallel_rank() == 0


def _where(worker) -> dict:
    """Which host, process and ranks a worker is (with several hosts, the status says where
    each answer came from)."""
    import socket

    out: dict[str, Any] = {
        "host": socket.gethostname(),
        "address": os.environ.get("VLLM_HOST_IP") or None,
        "pid": os.getpid(),
        "rank": getattr(worker, "rank", None),
    }
    par = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    if par is not None:
        # data_parallel_index keeps the engine's rank after vLLM makes a dense model's
        # engines independent (reconfigure_for_independent_dp_rank zeroes data_parallel_rank)
        out["dp_rank"] = getattr(par, "data_parallel_index", None)
        out["node_rank"] = getattr(par, "node_rank", None)
    try:
        from vllm.distributed import get_pp_group, get_tp_group

        out["pp_rank"] = get_pp_group().rank_in_group
        out["tp_rank"] = get_tp_group().rank_in_group
    except Exception:  # not initialised (stand-ins in unit tests)
        pass
    return out


def _ledger_summary(x: WorkerXmix) -> dict | None:
    led = x.__dict__.get("ledger")
    return led.summary() if led is not None else None


def xmix_ledger(self, op: str, owner: str = "", since: int = 0, entry: dict | None = None):
    """The engine-side record of control changes and the lease that serialises them across
    API servers (ledger.py)."""
    return _ledger(_wx(self), getattr(self, "vllm_config", None)).call(op, owner, since, entry)


def _ledger(x: WorkerXmix, vllm_config):
    led = x.__dict__.get("ledger")
    if led is None:
        from xmix.integrations.vllm.state_dir import for_worker
        from xmix.integrations.vllm.worker.ledger import Ledger

        led = x.__dict__["ledger"] = Ledger(
            for_worker(vllm_config), replica=not _first_worker(vllm_config)
        )
    return led


def xmix_deployment_secret(self) -> bytes:
    """The deployment's secret (keyed.py): the operator's XMIX_DEPLOYMENT_SECRET, else the one
    kept in the state directory (drawn there once), else random bytes drawn on first use and
    kept for the engine's life. Every API server keys cache salts, audit fingerprints and
    hidden metric labels with the first worker's."""
    x = _wx(self)
    s = x.__dict__.get("deployment_secret")
    if s is None:
        from xmix.integrations.vllm.keyed import engine_secret, secret_from_env

        state = _ledger(x, getattr(self, "vllm_config", None)).state
        if secret_from_env() is None and state is not None:
            s = state.secret()
        else:
            s = engine_secret()
        x.__dict__["deployment_secret"] = s
    return s


def xmix_call(self, method: str, args: list | tuple = ()) -> tuple[str, Any]:
    """Every control RPC of xmix's frontend comes through here, and a failure is an answer,
    ``("error", "<Type>: <message>")``, never an exception (else ``("ok", result)``).

    vLLM's ``MultiprocExecutor.collective_rpc`` (``v1/executor/multiproc_executor.py``) reads
    the workers' replies in rank order and raises at the first one that failed: the replies
    of the ranks after it stay in their queues, and the next collective RPC reads them as its
    own answers. With tensor parallelism a deploy refused on every rank would have shifted
    every later control answer by one call (a status, a ledger entry, a commit taken for
    another call's reply). Answering instead of raising keeps each call's replies its own."""
    fn = WORKER_METHODS.get(method) if method != "xmix_call" else None
    if fn is None:
        return ("error", f"RuntimeError: no xmix worker method {method!r}")
    try:
        return ("ok", fn(self, *args))
    except Exception as e:
        logger.info("xmix: worker method %s refused: %s: %s", method, type(e).__name__, e)
        return ("error", f"{type(e).__name__}: {e}")


WORKER_METHODS = {
    f.__name__: f
    for f in (
        xmix_call,
        xmix_ledger,
        xmix_deployment_secret,
        xmix_capacity,
        xmix_deploy,
        xmix_deploy_prepare,
        xmix_deploy_commit,
        xmix_deploy_abort,
        xmix_undeploy,
        xmix_undeploy_if_present,
        xmix_patch,
        xmix_set_mode,
        xmix_set_params,
        xmix_describe,
    )
}


def patch_worker_base(cls) -> None:
    for name, fn in WORKER_METHODS.items():
        fence.add(cls, name, fn, by="worker")
