"""The control block's binary layout, as Python writes it, and the numbers shared with the kernels.

csrc/include/xmix/control.h is the source of every number here: ``_C.constants()`` exports
its enums and ``_C.control_layout()`` / ``_C.op_layout()`` the field offsets and struct sizes.
What Python declares itself is only the type of each field (which the packers need);
tests/unit/test_abi.py holds those declarations to the header's ``sizeof`` of every field, so a
field added, moved or widened on one side fails there rather than as a corrupted op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import xmix._C as _C
from xmix.lang.lowering import APP_MODES

K: dict[str, int] = _C.constants()
CTRL_LAYOUT: dict[str, int] = _C.control_layout()
OP_LAYOUT: dict[str, int] = _C.op_layout()
OP_SIZE: int = OP_LAYOUT["__size__"]
CTRL_SIZE: int = CTRL_LAYOUT["__size__"]

MODES: dict[str, int] = {m: K[f"MODE_{m.upper()}"] for m in APP_MODES}
CMP_CODES: dict[str, int] = {
    ">=": K["CMP_GE"],
    ">": K["CMP_GT"],
    "<=": K["CMP_LE"],
    "<": K["CMP_LT"],
    "==": K["CMP_EQ"],
    "!=": K["CMP_NE"],
}
# Condition flags by name -> bit index in tok_flags (control.h: TokenFlag).
FLAG_BITS: dict[str, int] = {
    name: K[tf].bit_length() - 1
    for name, tf in (
        ("prompt", "TF_PROMPT"),
        ("generated", "TF_GENERATED"),
        ("last_token", "TF_LAST"),
    )
}

# Field types, in struct order (control.h). i4: int32, i8: int64, u8: uint64 (pointers).
CONTROL_FIELDS: tuple[tuple[str, str], ...] = (
    ("max_tokens", "i4"),
    ("max_slots", "i4"),
    ("max_apps", "i4"),
    ("n_params", "i4"),
    ("n_channels", "i4"),
    ("n_sites", "i4"),
    ("vec_state_width", "i4"),
    ("vocab_words", "i4"),
    ("n_tokens", "i4"),
    ("n_rows", "i4"),
    ("tok_slot", "u8"),
    ("tok_pos", "u8"),
    ("tok_flags", "u8"),
    ("tok_row", "u8"),
    ("row_slot", "u8"),
    ("row_tok_start", "u8"),
    ("row_n_tok", "u8"),
    ("row_reset", "u8"),
    ("row_n_prompt", "u8"),
    ("row_done", "u8"),
    ("slot_apps", "u8"),
    ("slot_params", "u8"),
    ("slot_span", "u8"),
    ("read_state", "u8"),
    ("vec_state", "u8"),
    ("counters", "u8"),
    ("app_nonfinite", "u8"),
    ("app_mode", "u8"),
    ("site_first", "u8"),
    ("site_count", "u8"),
    ("ops", "u8"),
    ("cond_code", "u8"),
    ("tokset_bits", "u8"),
    ("span_def", "u8"),
    ("n_spans", "i4"),
    ("n_token_sets", "i4"),
    ("results", "u8"),
    ("capture", "u8"),
    ("capture_size", "i8"),
    ("result_valid", "u8"),
    ("slot_sticky", "u8"),
    ("slot_floor", "u8"),
    ("row_stop", "u8"),
    ("row_switched", "u8"),
)
OP_FIELDS: tuple[tuple[str, str], ...] = (
    ("kind", "i4"),
    ("app", "i4"),
    ("cond_begin", "i4"),
    ("cond_len", "i4"),
    ("param_base", "i4"),
    ("channel", "i4"),
    ("state_base", "i4"),
    ("n", "i4"),
    ("m", "i4"),
    ("flags", "i4"),
    ("a0", "u8"),
    ("a1", "u8"),
    ("a2", "u8"),
    ("fn", "u8"),
    ("capture_offset", "u8"),
    ("a3", "u8"),
)


def struct_dtype(fields: tuple[tuple[str, str], ...], offsets: dict[str, int]) -> np.dtype[Any]:
    """A numpy record type with Python's field types at the header's offsets and size."""
    return np.dtype(
        {
            "names": [n for n, _ in fields],
            "formats": [f for _, f in fields],
            "offsets": [offsets[n] for n, _ in fields],
            "itemsize": offsets["__size__"],
        }
    )


CTRL_DTYPE = struct_dtype(CONTROL_FIELDS, CTRL_LAYOUT)
OP_DTYPE = struct_dtype(OP_FIELDS, OP_LAYOUT)

# Per-step maps (host written before every forward) and per-slot rows.
TOK_MAPS = ("tok_slot", "tok_pos", "tok_flags", "tok_row")
ROW_MAPS = ("row_slot", "row_tok_start", "row_n_tok", "row_reset", "row_n_prompt", "row_done")
ROW_BUFFERS = ("slot_apps", "slot_params")  # per slot, sent as changed rows with the next step
GATHER_ROWS = 4  # staged read-back: row indices per token of a step, for windowed capture copies


@dataclass
class Capacity:
    """Fixed sizes of the control block, chosen at engine start."""

    max_tokens: int = 8192  # rows per step (vLLM's max_num_batched_tokens)
    max_slots: int = 256  # concurrently running requests (max_num_seqs)
    max_apps: int = 64
    max_params: int = 4096
    max_channels: int = 256
    max_ops: int = 4096
    max_cond: int = 4096  # condition instructions
    vec_state_floats: int = 0  # per slot; 0 = 4 * (hidden + 1)
    capture_floats: int = 1 << 22  # 16 MiB of captured vectors per step
    # Staged (GPU) only: host staging sets per direction, at least the steps vLLM keeps in
    # flight + 1 (VllmConfig.max_concurrent_batches: 2 with async scheduling), and the
    # parameter floats one step can send as changed rows (more: one blocking full copy).
    staging_depth: int = 3
    staging_param_floats: int = 1 << 18


def buffer_spec(
    cap: Capacity, n_sites: int, vec_width: int, vocab_words: int
) -> dict[str, tuple[int, torch.dtype]]:
    """Every buffer the control block points to: (elements, dtype), at its capacity."""
    T, S, A, P, R = cap.max_tokens, cap.max_slots, cap.max_apps, cap.max_params, cap.max_channels
    i32, f32 = torch.int32, torch.float32
    return {
        "tok_slot": (T, i32),
        "tok_pos": (T, i32),
        "tok_flags": (T, i32),
        "tok_row": (T, i32),
        "row_slot": (S, i32),
        "row_tok_start": (S, i32),
        "row_n_tok": (S, i32),
        "row_reset": (S, i32),
        "row_n_prompt": (S, i32),
        "row_done": (S, i32),
        "slot_apps": (S, torch.int64),
        "slot_params": (S * P, f32),
        "slot_span": (S, i32),
        "read_state": (S * R * K["READ_STATE_WIDTH"], f32),
        "vec_state": (S * vec_width, f32),
        "counters": (S * R, i32),
        "app_nonfinite": (A, i32),
        "app_mode": (A, i32),
        "site_first": (n_sites, i32),
        "site_count": (n_sites, i32),
        "ops": (cap.max_ops * OP_SIZE, torch.uint8),
        "cond_code": (cap.max_cond * 4, i32),
        "tokset_bits": (K["MAX_TOKEN_SETS"] * vocab_words, i32),
        "span_def": (K["MAX_SPANS"] * 2, i32),
        "results": (T * R, f32),
        "result_valid": (T * R, torch.uint8),
        "capture": (max(cap.capture_floats, 1), f32),
        "slot_sticky": (S * K["MAX_STICKY"], i32),
        "slot_floor": (S, i32),
        "row_stop": (S, torch.int64),  # uint64 keys, compared as such by the kernels
        "row_switched": (S, i32),
    }
