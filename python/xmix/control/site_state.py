"""The host struct the native ``xmix::site`` CPU kernel writes (``csrc/include/xmix/site_op.h``,
``SiteOpState``): host seconds spent in site programs and the ops that failed since Python
last looked. The ControlBlock owns one (numpy, fixed address); ``xmix.ops`` binds it and checks
this layout's size against the library's own ``sizeof``."""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_FAILURES = 256  # kSiteOpMaxFailures
MAX_MESSAGES = 16  # kSiteOpMaxMessages
FAILURE_LEN = 240  # kSiteOpFailureLen

SITE_STATE = np.dtype(
    [
        ("seconds", "<f8"),
        ("n_failed", "<i8"),
        ("failed_site", "<i4", (MAX_FAILURES,)),
        ("failed_app", "<i4", (MAX_FAILURES,)),
        ("failed_what", f"S{FAILURE_LEN}", (MAX_MESSAGES,)),
    ]
)


def new_state() -> np.ndarray[Any, Any]:
    return np.zeros(1, dtype=SITE_STATE)


def take_failures(
    state: np.ndarray[Any, Any],
) -> tuple[dict[int, list[tuple[int | None, bytes]]], bool]:
    """The failures recorded since the last call, by site: (app index, or None for the whole
    site; message), and whether more were recorded than the struct keeps (then every app that
    ran this step must be taken as failed)."""
    n = int(state["n_failed"][0])
    if not n:
        return {}, False
    s = state[0]
    out: dict[int, list[tuple[int | None, bytes]]] = {}
    unkept = f"one of {n} site failures in this step (its message was not kept)".encode()
    for i in range(min(n, MAX_FAILURES)):
        app = int(s["failed_app"][i])
        msg = bytes(s["failed_what"][i]) if i < MAX_MESSAGES else unkept
        out.setdefault(int(s["failed_site"][i]), []).append((None if app < 0 else app, msg))
    state["n_failed"][0] = 0
    return out, n > MAX_FAILURES
