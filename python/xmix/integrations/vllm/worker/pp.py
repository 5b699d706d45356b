"""Pipeline parallel (``--pipeline-parallel-size N``): what crosses from one stage to the next.

Each stage's workers hold a full control block with the same deployed apps (every control
RPC reaches every worker, in the same order relative to the steps), but only the sites of the
layers the stage owns are placed (``model_wrap.place_sites``: a ``PPMissingLayer`` gets none),
so an op on another stage's layer is a no-op here. Two things must still cross stages, and
both ride the ``IntermediateTensors`` vLLM sends from stage k to stage k+1
(``v1/worker/gpu_worker.py: Worker.execute_model``, ``isend_tensor_dict``; the tensor dict's
metadata travels with it, so extra keys need no change on the receiving side's buffers):

- **Gate and latch values.** A gate reads ``results[token][channel]`` and a latch the
  request's ``read_state[slot][channel]`` (sum, count, last over the prompt) in the control
  block of the stage that runs the gated op. When the read is on an earlier stage, that stage
  sends, for each channel some later stage's op conditions on, the step's per-token values
  (``xmix_gate_values``, float32 [tokens, k]) and each scheduled request's read state
  (``xmix_latch_state``, float32 [requests, k, 3]) with the channel numbers
  (``xmix_gate_channels``). The receiver writes them into its own block after its prologue
  (which resets the read state of requests starting again) and before its forward, so its
  gates and latches see exactly what one engine's would. Channel numbers agree across stages
  because every stage's block took the same deploys in the same order. Token rows and request
  rows agree because every stage builds its step from the same scheduler output. A middle
  stage forwards the values it received (they sit in its block like its own reads).
  Result flags (``result_valid``) are never sent: only the stage that ran a read reports it.
- **Read results.** vLLM returns a step's output from one worker only, the first tensor-parallel
  rank of the last stage (``v1/executor/multiproc_executor.py: _get_output_rank``). So each
  earlier stage's first TP rank drains its own reads after its forward and sends them on,
  packed as arrays (``results_codec.pack_results``) and msgpack-encoded into a uint8 tensor
  (``xmix_reads``; no pickle: what a stage decodes is data, never code); the last stage merges them into its own
  before the step's output leaves, so they reach the engine core with the step's tokens.

An op conditioned on a read made on a *later* stage (a latch whose op sits before its read,
``kLatchFromGenerated``) would need the value to travel backwards, which nothing in vLLM's
pipeline does between a stage's steps: such an app is refused at deploy, naming the app, the
op, the read and both stages.

Cost: nothing is sent when no app conditions across stages and no read ran on the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from xmix.lang import conditions as C
from xmix.lang.sites import SITES_PER_LAYER

KEY_CHANNELS = "xmix_gate_channels"
KEY_VALUES = "xmix_gate_values"
KEY_STATE = "xmix_latch_state"
KEY_READS = "xmix_reads"
KEYS = (KEY_CHANNELS, KEY_VALUES, KEY_STATE, KEY_READS)


@dataclass(frozen=True)
class Stages:
    """The layer range of every pipeline stage, as vLLM splits the decoder
    (``vllm.distributed.utils.get_pp_indices``, which honours VLLM_PP_LAYER_PARTITION)."""

    rank: int
    size: int
    ranges: tuple[tuple[int, int], ...]
    n_layers: int

    @classmethod
    def of(cls, n_layers: int, rank: int, size: int) -> Stages:
        from vllm.distributed.utils import get_pp_indices

        return cls(
            rank, size, tuple(get_pp_indices(n_layers, r, size) for r in range(size)), n_layers
        )

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def of_site(self, sid: int) -> int:
        """The stage that runs site ``sid`` (final.post: the last stage, which owns the norm)."""
        layer = sid // SITES_PER_LAYER
        if layer >= self.n_layers:
            return self.size - 1
        for r, (a, b) in enumerate(self.ranges):
            if a <= layer < b:
                return r
        raise ValueError(f"layer {layer} is on no pipeline stage ({self.ranges})")


def _cond_reads(node) -> list:
    if isinstance(node, (C.Gate, C.Latch)):
        return [node]
    if isinstance(node, C.Not):
        return _cond_reads(node.a)
    if isinstance(node, (C.And, C.Or)):
        return _cond_reads(node.a) + _cond_reads(node.b)
    return []


def crossings(lowered, stages: Stages) -> list[tuple[str, int, int, object]]:
    """(read key, stage of the read, stage of the op, op) for every gate or latch whose op
    and read are on different stages."""
    out = []
    for op in lowered.ops:
        if op.cond is None:
            continue
        s_op = stages.of_site(op.site_id)
        for node in _cond_reads(op.cond):
            src = lowered.read_op(node.read)
            s_read = stages.of_site(src.site_id)
            if s_read != s_op:
                out.append((node.read, s_read, s_op, op))
    return out


def check_deploy(lowered, stages: Stages) -> None:
    """Refuse an app whose op is conditioned on a read a later stage makes, or on a
    since(...) term another stage decides (its per-request state stays on that stage), and a
    stop off the last stage (the stage whose output vLLM returns)."""
    from xmix.lang.lowering import DeployError

    for op in lowered.ops:
        s_op = stages.of_site(op.site_id)
        if op.kernel == "stop" and s_op != stages.size - 1:
            raise DeployError(
                f"app {lowered.name!r}: its stop runs on pipeline stage {s_op}; with pipeline "
                f"parallelism a stop runs on the last stage (leave it at final.post)"
            )
        for t in C.sinces(op.cond):
            s_dec = stages.of_site(lowered.sinces[C.to_text(t)].site_id)
            if s_dec != s_op:
                raise DeployError(
                    f"app {lowered.name!r}: op {getattr(op, 'label', op)} runs on pipeline "
                    f"stage {s_op} and uses {C.to_text(t)}, which stage {s_dec} decides; a "
                    f"since(...) term is used on the stage that decides it (stage layer "
                    f"ranges {list(stages.ranges)})"
                )

    back = [(k, sr, so, op) for k, sr, so, op in crossings(lowered, stages) if sr > so]
    if back:
        k, sr, so, op = back[0]
        raise DeployError(
            f"app {lowered.name!r}: op {getattr(op, 'label', op)} runs on pipeline stage {so} but is conditioned on "
            f"read {k!r}, which runs on the later stage {sr}; a value cannot travel back to an "
            f"earlier stage (stage layer ranges {list(stages.ranges)}). Move the read to a layer "
            f"at or before the op's, or the op after the read"
        )


def forwarded_channels(apps, stages: Stages) -> np.ndarray:
    """The channels this stage must send on: read on this or an earlier stage, used by an
    op's gate or latch on a later stage."""
    chans = set()
    for inst in apps.values():
        for key, sr, so, _ in crossings(inst.lowered, stages):
            if sr <= stages.rank < so:
                chans.add(inst.channels[key])
    return np.array(sorted(chans), dtype=np.int64)


class StageLink:
    """Per worker: what the stage received before its forward, and what it sends after."""

    def __init__(self, stages: Stages):
        self.stages = stages
        self._inbox: dict[str, torch.Tensor] | None = None
        self._chans_gen = -1
        self._chans = np.zeros(0, dtype=np.int64)
        self.stats = {"gate_steps_sent": 0, "gate_steps_received": 0, "read_bytes_sent": 0}

    # ---------------------------------------------------------------- receive
    def take_inbox(self, intermediate_tensors) -> tuple[dict | None, dict | None]:
        """Pop xmix's keys off the received tensors (vLLM's runner copies every key into
        buffers of its own model's keys, so none of ours may stay); returns (gate data,
        packed reads of earlier stages)."""
        self._inbox = None
        if intermediate_tensors is None:
            return None, None
        t = intermediate_tensors.tensors
        if not any(k in t for k in KEYS):
            return None, None
        gates = None
        if KEY_CHANNELS in t:
            gates = {k: t.pop(k) for k in (KEY_CHANNELS, KEY_VALUES, KEY_STATE)}
            self.stats["gate_steps_received"] += 1
        reads = None
        if KEY_READS in t:  # packed, as they leave the last stage's worker
            reads = msgspec.msgpack.decode(t.pop(KEY_READS).cpu().numpy().tobytes())
        self._inbox = gates
        return gates, reads

    def inject(self, cb, row_slots: np.ndarray, n_tok: int) -> None:
        """Write the received gate values and read state into this stage's block, after the
        prologue and before the forward."""
        g, self._inbox = self._inbox, None
        if g is None:
            return
        ch = g[KEY_CHANNELS].to(torch.int64).to(cb.device)
        vals, state = g[KEY_VALUES], g[KEY_STATE]
        R, W = cb.cap.max_channels, state.shape[-1] if state.dim() == 3 else 3
        if vals.shape[0] != n_tok or state.shape[0] != len(row_slots):
            raise RuntimeError(
                f"xmix: pipeline stage {self.stages.rank} received gate values for "
                f"{vals.shape[0]} tokens / {state.shape[0]} requests, its step has "
                f"{n_tok} / {len(row_slots)}"
            )
        slots = torch.as_tensor(np.asarray(row_slots, dtype=np.int64), device=cb.device)
        res = cb.dev["results"].view(cb.cap.max_tokens, R)
        rs = cb.dev["read_state"].view(cb.cap.max_slots, R, W)

        def run():
            res[:n_tok].index_copy_(1, ch, vals.to(cb.device, torch.float32))
            sub = rs[slots]
            sub[:, ch] = state.to(cb.device, torch.float32)
            rs[slots] = sub

        cb.mem.launch(run)  # in stream order when staged

    # ---------------------------------------------------------------- send
    def outbox(self, cb, step, reads: dict | None) -> dict[str, torch.Tensor]:
        """xmix's tensors for the next stage: gate values and read state of the channels a
        later stage's ops condition on (when this step ran apps), and the reads of this and
        earlier stages."""
        out: dict[str, torch.Tensor] = {}
        if cb.mem.ops_generation != self._chans_gen:
            self._chans = forwarded_channels(cb.apps, self.stages)
            self._chans_gen = cb.mem.ops_generation
        if len(self._chans) and step is not None:
            slots, n_tok = step
            R = cb.cap.max_channels
            ch = torch.as_tensor(self._chans, device=cb.device)
            res = cb.dev["results"].view(cb.cap.max_tokens, R)
            rs = cb.dev["read_state"].view(cb.cap.max_slots, R, -1)
            idx = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=cb.device)
            out[KEY_CHANNELS] = ch.clone()
            out[KEY_VALUES] = res[:n_tok].index_select(1, ch).contiguous()
            out[KEY_STATE] = rs[idx][:, ch].contiguous()
            self.stats["gate_steps_sent"] += 1
        if reads:  # packed (the worker's take_results)
            data = msgspec.msgpack.encode(reads)
            out[KEY_READS] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.stats["read_bytes_sent"] += len(data)
        return out
