"""Room in the control block's shared tables: parameter columns, result channels, token sets,
spans, per-slot vector state and the capture buffer.

Each table is a free list of fixed size, allocated first fit (contiguous runs, so an app's
columns and a read's channels are ranges). A deploy takes its room into ``Claims`` while it is
checked and built aside; a refusal releases the claims and leaves every table as it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from xmix.lang.lowering import DeployError

Flags = np.ndarray[Any, np.dtype[np.bool_]]


class Claims:
    """Runs taken for one deploy, released together if it does not go live."""

    def __init__(self) -> None:
        self._runs: list[tuple[Flags, int, int]] = []

    def add(self, used: Flags, start: int, n: int) -> None:
        self._runs.append((used, start, n))

    def release(self) -> None:
        for used, start, n in self._runs:
            used[start : start + n] = False
        self._runs.clear()


class Arena:
    """The free lists of the control block's shared tables, by table name."""

    TABLES = ("params", "channels", "token_sets", "spans", "sinces", "state", "capture")

    def __init__(self, sizes: dict[str, int]):
        self.used: dict[str, Flags] = {t: np.zeros(sizes[t], dtype=bool) for t in self.TABLES}

    def take(self, table: str, n: int, what: str, app: str, claims: Claims) -> int:
        """First fit of n contiguous free entries of ``table``; recorded in claims for
        rollback. Raises DeployError naming ``what`` when there is no such run."""
        if n == 0:
            return 0
        used = self.used[table]
        if n <= len(used):
            # window sums of the used flags: a window summing to 0 is free
            cs = np.concatenate(([0], np.cumsum(used, dtype=np.int64)))
            free = np.flatnonzero(cs[n:] - cs[:-n] == 0)
            if len(free):
                start = int(free[0])
                used[start : start + n] = True
                claims.add(used, start, n)
                return start
        raise DeployError(
            f"app {app!r}: not enough room for {what} ({n} needed); raise the "
            f"xmix capacity or undeploy other apps"
        )

    def free(self, table: str, start: int, n: int) -> None:
        self.used[table][start : start + n] = False

    def extent(self, table: str) -> int:
        """One past the last entry in use (0 when none): the count the kernels loop over."""
        used = self.used[table]
        return int(np.flatnonzero(used).max() + 1) if used.any() else 0
