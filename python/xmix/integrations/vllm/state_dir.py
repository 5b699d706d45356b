"""The state directory (``xmix serve --xmix-state-dir DIR``, ``xmix.LLM(xmix_state_dir=DIR)``):
the control plane's changes on disk, so that deployments survive a restart or a crash
(docs/serving.md, "State directory").

One writer. The engines hold the truth (ledger.py): every change goes through the ledger's
lease on the first worker of the first engine, whichever API server makes it. That worker
is also the one process that writes DIR; API servers never do. It writes a change *before*
any engine applies it (``Ledger.call("save")``, from ``Controller._save``): a change that
could not be written is refused with nothing changed, and a change that reached an engine,
let alone one acknowledged with an HTTP 200, is already on disk. A restart reads DIR in that
same worker and an API server deploys what it holds again (restore.py) before the server
takes requests.

Layout (every file 0600, the directory 0700; a directory others can write is refused: who
writes it chooses the apps, custom kernels included, of the next start)::

    DIR/LOCK              held (flock) by the writer while it runs: one writer per directory
    DIR/state.json        the state at revision R: apps (file, mode, parameters, locks,
                          version) in deployment order, the epoch and version floors
    DIR/journal.jsonl     the changes after R, one JSON object a line ("rev" R+1, R+2, ...)
    DIR/apps/SHA256.xmix  app files as they were deployed (safetensors + JSON spec; never
                          pickle), named by their SHA-256; not the lowered programs the
                          engines got: a restore lowers each app again (restore.py)

Every record (state.json, each journal line) carries ``"sum"``: the SHA-256 of its own
canonical JSON without that key. Writes are atomic: a new file is written under a temporary
name, fsynced, renamed over its name, and the directory fsynced; a journal line is one
append, fsynced before the change goes on. A journal whose last line has no newline was cut
by a crash or a full disk before that change went on: it is dropped (logged). Anything else
that does not verify (a record's sum, an app file's digest or format, a revision out of
order, a change of an app the state does not hold) refuses the start with the file named.

The journal is folded into state.json at every start and every ``COMPACT_EVERY`` changes
(state.json first, then an empty journal; a crash between the two leaves journal lines the
new state.json already holds, which the load skips by revision).

Test-only: ``XMIX_TEST_STATE_CRASH=FILE`` arms named crash points. At each point the writer
reads FILE; when it holds that point's name (``kind:point`` or ``point``, e.g.
``patch:journal.synced``) FILE is removed and the writer SIGKILLs its own process group
(the whole server when it was started in a session of its own), which is ``kill -9`` of the
server at exactly that point. Never set it in production.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import signal
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmix import settings

logger = logging.getLogger("vllm.xmix")

FORMAT = 1
COMPACT_EVERY = 64
STATE = "state.json"
JOURNAL = "journal.jsonl"
LOCK = "LOCK"
APPS = "apps"
SECRET = "secret"  # the deployment's secret (keyed.py) when the operator gives none: 0600
TMP = ".tmp-"
MODES = ("off", "request", "all")
# Points where a crash can be placed (``XMIX_TEST_STATE_CRASH``), in the order a change
# passes them: writing an app file, the journal line, the engines applying the change
# (``applied``: the ledger entry, after every engine applied it, before the HTTP answer),
# and folding the journal into state.json.
POINTS = (
    "app.tmp",
    "app.renamed",
    "journal.before",
    "journal.written",
    "journal.synced",
    "applied",
    "snapshot.tmp",
    "snapshot.renamed",
    "reset.tmp",
    "reset.renamed",
    "gc",
)


class StateError(RuntimeError):
    """A state directory that cannot be used (corrupt, in use, unsafe) or a change that could
    not be written to it; the message names the file."""


def _canon(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _sealed(obj: dict) -> bytes:
    """``obj`` as one JSON line with its own digest under ``"sum"``."""
    body = {k: v for k, v in obj.items() if k != "sum"}
    return _canon({**body, "sum": hashlib.sha256(_canon(body)).hexdigest()}) + b"\n"


def _unseal(raw: bytes, where: str) -> dict:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise StateError(f"{where}: not JSON ({e})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("sum"), str):
        raise StateError(f"{where}: not a state record (no checksum)")
    want = obj.pop("sum")
    if hashlib.sha256(_canon(obj)).hexdigest() != want:
        raise StateError(f"{where}: checksum mismatch (the record was changed or damaged)")
    return obj


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - os.write raises rather than return 0 on a regular file
            raise OSError(errno.EIO, "short write")
        view = view[n:]


def _crash_from_env() -> Callable[[str, str], None] | None:
    trigger = settings.get("XMIX_TEST_STATE_CRASH")
    if not trigger:
        return None

    def crash(kind: str, point: str) -> None:
        try:
            want = Path(trigger).read_text().strip()
        except OSError:
            return
        if want not in (point, f"{kind}:{point}"):
            return
        os.unlink(trigger)  # once: the restarted server runs with the same environment
        logger.warning("xmix: test crash point %s:%s: SIGKILL to the process group", kind, point)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    return crash


@dataclass
class AppState:
    name: str
    file: str  # under DIR/apps
    mode: str
    version: int
    locked: Any = False  # true, false, or parameter names (canonical, as the ledger has them)
    params: dict[str, float] = field(default_factory=dict)  # defaults changed since the deploy

    def record(self) -> dict:
        return {
            "name": self.name,
            "file": self.file,
            "mode": self.mode,
            "version": self.version,
            "locked": self.locked,
            "params": self.params,
        }


def _check_app_record(a: Any, where: str) -> AppState:
    ok = (
        isinstance(a, dict)
        and isinstance(a.get("name"), str)
        and isinstance(a.get("file"), str)
        and a.get("mode") in MODES
        and isinstance(a.get("version"), int)
        and isinstance(a.get("params", {}), dict)
        and (isinstance(a.get("locked"), bool) or isinstance(a.get("locked"), list))
    )
    if not ok or "/" in a["file"] or not a["file"].endswith(".xmix"):
        raise StateError(f"{where}: not an app record: {str(a)[:200]}")
    return AppState(
        a["name"], a["file"], a["mode"], a["version"], a["locked"], dict(a.get("params", {}))
    )


class StateDir:
    """The state of one directory and, opened as the writer (``open``), the one process that
    changes it. ``check`` reads it without writing (the launcher's check before a start)."""

    def __init__(self, path: str | Path, crash: Callable[[str, str], None] | None = None):
        self.path = Path(path)
        self.apps: dict[str, AppState] = {}  # in deployment order
        self.rev = 0
        # Bounds the frontends' control epoch and app versions (registry.Registry) ever
        # reached on this directory: a restart starts above them (restore.py).
        self.epoch = 0
        self.version = 0
        self.journal_lines = 0
        self.dropped_tail = 0  # bytes of a cut last journal line dropped at load
        self.broken: str | None = None  # a write failed and could not be undone: no more writes
        self._crash = crash
        self._lock_fd: int | None = None
        self._kind = ""  # the change being written (names the crash points)
        # What a restarted server's registry starts above (set by ``open``; restore.py).
        self.epoch_floor = 0
        self.version_floor = 0

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | Path, crash: Callable[[str, str], None] | None = None) -> StateDir:
        """The writer: creates DIR if needed, takes its lock, loads and verifies it, raises the
        floors past everything before this start, and folds the journal into state.json."""
        st = cls(path, crash if crash is not None else _crash_from_env())
        st._prepare_dir()
        st._take_lock()
        try:
            st._load()
            # The previous run may have used every epoch and version up to these bounds;
            # restoring the apps (a deploy and a patch each) moves the epoch by at most 2 a app.
            st.epoch_floor, st.version_floor = st.epoch + 1, st.version
            st.epoch += 1 + 2 * len(st.apps)
            st.compact()
        except BaseException:
            st.close()
            raise
        return st

    @classmethod
    def check(cls, path: str | Path) -> StateDir:
        """Verify DIR as a start would (nothing written; a missing DIR is an empty state)."""
        st = cls(path)
        if not st.path.exists():
            return st
        st._check_safe()
        st._take_lock(write_pid=False)
        try:
            st._load()
        finally:
            st.close()
        return st

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _prepare_dir(self) -> None:
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.path / APPS).mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            raise StateError(f"state directory {self.path}: cannot create it ({e})") from None
        self._check_safe()

    def _check_safe(self) -> None:
        for p in (self.path, self.path / APPS):
            try:
                s = p.stat()
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(s.st_mode):
                raise StateError(f"state directory {p}: not a directory")
            if s.st_mode & 0o022:
                raise StateError(
                    f"state directory {p}: writable by group or others (mode "
                    f"{stat.S_IMODE(s.st_mode):o}); whoever writes it chooses the apps of the "
                    f"next start. chmod 700 it"
                )

    def _take_lock(self, write_pid: bool = True) -> None:
        lock = self.path / LOCK
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StateError(
                f"state directory {self.path} is in use by another process (pid {holder}, "
                f"{lock}); one server per state directory"
            ) from None
        if write_pid:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    # ------------------------------------------------------------------ reading
    def _load(self) -> None:
        state = self.path / STATE
        if state.exists():
            snap = _unseal(state.read_bytes(), str(state))
            if snap.get("format") != FORMAT:
                raise StateError(
                    f"{state}: format {snap.get('format')!r}, this xmix reads format {FORMAT}"
                )
            for k in ("rev", "epoch", "version"):
                if not isinstance(snap.get(k), int) or snap[k] < 0:
                    raise StateError(f"{state}: bad {k!r}: {snap.get(k)!r}")
            if not isinstance(snap.get("apps"), list):
                raise StateError(f"{state}: bad 'apps'")
            self.rev, self.epoch, self.version = snap["rev"], snap["epoch"], snap["version"]
            for a in snap["apps"]:
                app = _check_app_record(a, str(state))
                if app.name in self.apps:
                    raise StateError(f"{state}: app {app.name!r} twice")
                self.apps[app.name] = app
        journal = self.path / JOURNAL
        if journal.exists():
            raw = journal.read_bytes()
            lines = raw.split(b"\n")
            tail = lines.pop()  # after the last newline: empty, or a line cut by a crash
            if tail:
                self.dropped_tail = len(tail)
                logger.warning(
                    "xmix: %s ends in a cut line (%d bytes, a write a crash or a full disk "
                    "interrupted before its change went on): dropped",
                    journal,
                    len(tail),
                )
            for n, line in enumerate(lines, 1):
                where = f"{journal} line {n}"
                rec = _unseal(line, where)
                rev = rec.get("rev")
                if not isinstance(rev, int):
                    raise StateError(f"{where}: no revision")
                if rev <= self.rev and self.journal_lines == 0:
                    continue  # already in state.json (a crash between its write and the reset)
                if rev != self.rev + 1:
                    raise StateError(f"{where}: revision {rev}, expected {self.rev + 1}")
                self._apply(rec, where)
        for app in self.apps.values():
            self._verify_app(app)

    def _verify_app(self, app: AppState) -> None:
        p = self.path / APPS / app.file
        try:
            data = p.read_bytes()
        except OSError as e:
            raise StateError(f"{p} (app {app.name!r}): cannot be read ({e})") from None
        if hashlib.sha256(data).hexdigest() + ".xmix" != app.file:
            raise StateError(f"{p} (app {app.name!r}): its SHA-256 does not match its name")
        from xmix.lang.api import App, AppError

        try:
            parsed = App.from_bytes(data, str(p), allow_custom=True)
        except AppError as e:
            raise StateError(f"{p} (app {app.name!r}): not an app file ({e})") from None
        if parsed.name != app.name:
            raise StateError(f"{p}: holds app {parsed.name!r}, the state names {app.name!r}")

    def _apply(self, rec: dict, where: str) -> None:
        """One journal record onto the state in memory (load and write alike)."""
        kind, name = rec.get("kind"), rec.get("name")
        if not isinstance(name, str):
            raise StateError(f"{where}: no app name")
        if kind == "deploy":
            if name in self.apps:
                raise StateError(f"{where}: deploy of {name!r}, which the state holds")
            new = _check_app_record({**rec, "params": {}}, where)
            self.apps[name] = new
            self.version = max(self.version, new.version)
        elif kind == "patch":
            app = self.apps.get(name)
            if app is None:
                raise StateError(f"{where}: patch of {name!r}, which the state does not hold")
            if "mode" in rec:
                if rec["mode"] not in MODES:
                    raise StateError(f"{where}: bad mode {rec['mode']!r}")
                app.mode = rec["mode"]
            if "params" in rec:
                if not isinstance(rec["params"], dict):
                    raise StateError(f"{where}: bad params")
                app.params.update(rec["params"])
            if "locked" in rec:
                app.locked = rec["locked"]
        elif kind == "undeploy":
            if self.apps.pop(name, None) is None:
                raise StateError(f"{where}: undeploy of {name!r}, which the state does not hold")
        else:
            raise StateError(f"{where}: unknown change {kind!r}")
        self.rev += 1
        self.epoch += 1  # a change moves a frontend's epoch by at most one
        self.journal_lines += 1

    # ------------------------------------------------------------------ writing
    def _point(self, point: str) -> None:
        if self._crash is not None:
            self._crash(self._kind, point)

    def point(self, kind: str, point: str) -> None:
        """A crash point outside the writer's own steps (``applied``: ledger.py)."""
        self._kind = kind
        self._point(point)

    def save(self, entry: dict) -> bool:
        """Write one control change (a ledger entry: ``deploy`` with the app's bytes,
        ``patch``, ``undeploy``) before any engine applies it. False: the state already held
        it (an app the restore deploys again, a patch to the values it has); nothing written.
        Raises StateError when it cannot be written; then nothing was."""
        if self.broken is not None:
            raise StateError(
                f"state directory {self.path}: writes stopped after a failure that could not "
                f"be undone ({self.broken}); restart the server"
            )
        kind, name = entry.get("kind"), entry.get("name")
        self._kind = str(kind)
        rec: dict[str, Any] = {"kind": kind, "name": name}
        cur = self.apps.get(name) if isinstance(name, str) else None
        data = None
        if kind == "deploy":
            if cur is not None and cur.version == entry.get("version"):
                return False  # the restore deploying what the state holds
            data = entry.get("data")
            if not isinstance(data, (bytes, bytearray)):
                raise StateError(f"state directory {self.path}: a deploy without app bytes")
            rec.update(
                file=hashlib.sha256(data).hexdigest() + ".xmix",
                mode=entry.get("mode", "request"),
                version=entry.get("version"),
                locked=entry.get("locked") or False,
            )
        elif kind == "patch" and cur is not None:
            if entry.get("mode") is not None and entry["mode"] != cur.mode:
                rec["mode"] = entry["mode"]
            changed = {
                k: v for k, v in (entry.get("params") or {}).items() if cur.params.get(k) != v
            }
            if changed:
                rec["params"] = changed
            if entry.get("locked") is not None and entry["locked"] != cur.locked:
                rec["locked"] = entry["locked"]
            if len(rec) == 2:
                return False
        elif kind == "undeploy" and cur is None:
            return False
        rec["rev"] = self.rev + 1
        self._check_change(rec)
        if data is not None:
            self._write_app(rec["file"], bytes(data))
        self._append(_sealed(rec))
        self._apply(rec, "save")
        if self.journal_lines >= COMPACT_EVERY:
            try:
                self.compact()
            except OSError as e:  # the change is written; folding waits for the next one
                logger.warning("xmix: folding the journal of %s failed: %s", self.path, e)
        return True

    def _check_change(self, rec: dict) -> None:
        """The change is applied to a copy first: a record the load would refuse (a patch of
        an app the state does not hold, a bad mode, values JSON cannot carry) is never
        written."""
        probe = StateDir(self.path)
        probe.apps = {
            k: AppState(**{**vars(v), "params": dict(v.params)}) for k, v in self.apps.items()
        }
        probe.rev = self.rev
        try:
            probe._apply(json.loads(_canon(rec)), "change")
        except (StateError, ValueError) as e:
            raise StateError(f"state directory {self.path}: refused to write {e}") from None

    def _append(self, line: bytes) -> None:
        fd = os.open(self.path / JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        size = os.fstat(fd).st_size
        try:
            self._point("journal.before")
            _write_all(fd, line)
            self._point("journal.written")
            os.fsync(fd)
        except BaseException as e:
            try:  # take the cut line back, so later lines never follow it
                os.ftruncate(fd, size)
                os.fsync(fd)
            except OSError as e2:
                self.broken = f"{self.path / JOURNAL}: {e2}"
            if isinstance(e, OSError):
                raise StateError(f"{self.path / JOURNAL}: cannot write ({e})") from None
            raise
        finally:
            os.close(fd)
        self._point("journal.synced")

    def _write_app(self, file: str, data: bytes) -> None:
        p = self.path / APPS / file
        try:
            if p.exists() and hashlib.sha256(p.read_bytes()).hexdigest() + ".xmix" == file:
                return  # the same bytes (deployed before, or left by a crash): content-addressed
            self._write_atomic(p, data, "app")
        except OSError as e:
            raise StateError(f"{p}: cannot write ({e})") from None

    def _write_atomic(self, p: Path, data: bytes, what: str) -> None:
        tmp = p.with_name(f"{TMP}{p.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._point(f"{what}.tmp")
            os.replace(tmp, p)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        self._point(f"{what}.renamed")
        _fsync_dir(p.parent)

    def secret(self) -> bytes:
        """The deployment's secret kept here (keyed.py): drawn and written (0600, atomically)
        the first time, read at every later start, so cache salts, audit fingerprints and
        hidden metric labels stay the same across restarts. A file others can read, or one
        that is not 32 bytes of hex, is refused, naming it."""
        p = self.path / SECRET
        if not p.exists():
            raw = secrets.token_bytes(32)
            self._write_atomic(p, raw.hex().encode() + b"\n", "secret")
            return raw
        mode = p.stat().st_mode & 0o777
        if mode & 0o077:
            raise StateError(
                f"{p}: the deployment secret may be read by others (mode {mode:o}); "
                "make it 0600 or remove it (a new one is drawn)"
            )
        try:
            raw = bytes.fromhex(p.read_text().strip())
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise StateError(
                f"{p}: not a deployment secret (32 bytes as hex); remove it to draw one"
            )
        return raw

    def compact(self) -> None:
        """Fold the journal into state.json, then drop the journal, unused app files and
        temporary files a crash left."""
        self._kind = "compact"
        snap = {
            "format": FORMAT,
            "rev": self.rev,
            "epoch": self.epoch,
            "version": self.version,
            "apps": [a.record() for a in self.apps.values()],
        }
        self._write_atomic(self.path / STATE, _sealed(snap), "snapshot")
        self._write_atomic(self.path / JOURNAL, b"", "reset")
        self.journal_lines = 0
        keep = {a.file for a in self.apps.values()}
        for d in (self.path, self.path / APPS):
            for p in d.iterdir():
                stale = p.name.startswith(TMP) or (d != self.path and p.name not in keep)
                if stale and p.is_file():
                    p.unlink()
        self._point("gc")

    # ------------------------------------------------------------------ for the restore
    def plan(self) -> dict:
        """What a restarted server deploys again, in deployment order (restore.py)."""
        apps = []
        for a in self.apps.values():
            p = self.path / APPS / a.file
            apps.append({**a.record(), "data": p.read_bytes(), "path": str(p)})
        return {
            "dir": str(self.path),
            "apps": apps,
            "epoch": self.epoch_floor,
            "version": self.version_floor,
            "dropped_tail": self.dropped_tail,
        }

    def summary(self) -> str:
        return f"{len(self.apps)} app(s) ({', '.join(self.apps) or 'none'}) at revision {self.rev}"


def for_worker(vllm_config) -> StateDir | None:
    """The state directory, opened as its writer, on the worker that holds the ledger every
    API server reads (the first worker of the first engine: tensor- and pipeline-parallel
    rank 0 of data-parallel index 0); None on every other worker and without one."""
    path = settings.get("XMIX_STATE_DIR")
    if not path:
        return None
    par = getattr(vllm_config, "parallel_config", None)
    dp = getattr(par, "data_parallel_index", None)
    if dp is None:
        dp = getattr(par, "data_parallel_rank", 0)
    if int(dp or 0) != 0 or _model_parallel_rank() != 0:
        return None
    st = StateDir.open(path)
    logger.info("xmix: state directory %s: %s (this worker writes it)", st.path, st.summary())
    return st


def _model_parallel_rank() -> int:
    """This worker's rank within its engine (0 for the first worker; 0 without vLLM's groups)."""
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() + get_pp_group().rank_in_group
    except Exception:  # noqa: BLE001 - not initialised: one worker
        return 0
