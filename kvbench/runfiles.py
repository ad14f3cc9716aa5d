"""The files of run directories, written so that no fault leaves them wrong, and read so that no damage
stops a reader: atomic writes that leave no temporary file behind, an in-place rewrite for a folder
that takes no new file, tolerant readers that say what is wrong (:func:`read_json`,
:func:`read_config`), the signals a run turns into a recorded stop, and the run directory's lock
(:class:`RunLock`). :mod:`kvbench.results` builds run directories on these."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once (a reader sees the old file or the new one). When the write
    fails (a full disk, a read-only folder, a signal) the temporary file goes: none is left behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        _write_file(tmp, text)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def _write_file(path: Path, text: str) -> None:
    """Write a new file and flush it to the disk (the one place a new file's bytes are written)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _overwrite(path: Path, text: str) -> None:
    """Rewrite an existing small file in place: no new file and no new block, so it still works on a full
    disk or in a read-only folder (a writable file), where :func:`write_atomic` cannot."""
    data = text.encode()
    with open(path, "r+b") as handle:
        handle.write(data)
        handle.truncate(len(data))
        handle.flush()
        os.fsync(handle.fileno())


#: what a failed write's ``errno`` says about the output folder (not a bug: the same command resumes)
OUTPUT_FAULTS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EFBIG: "file too large",
}


def output_fault(exc: BaseException) -> str | None:
    """A short name for an output-folder fault (``disk full``, ``permission denied``), else None."""
    return OUTPUT_FAULTS.get(exc.errno) if isinstance(exc, OSError) and exc.errno is not None else None


def read_json(path: Path) -> tuple[dict[str, Any], str | None]:
    """A JSON object file's content and what is wrong with it: ``({}, None)`` when it does not exist,
    ``({}, "metrics.json is not JSON")`` when it cannot be used. Never raises, never writes."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        return {}, f"{path.name} unreadable ({exc.strerror})"
    if not raw.strip():
        return {}, f"{path.name} is empty"
    try:
        data = json.loads(raw)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return {}, f"{path.name} is not JSON"
    if not isinstance(data, dict):
        return {}, f"{path.name} is not a JSON object"
    return data, None


def read_config(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A run's ``config.yaml`` and what is wrong with it (``None, "config.yaml missing"``). Never raises."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, f"{path.name} missing"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path.name} unreadable ({getattr(exc, 'strerror', None) or 'not UTF-8'})"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None, f"{path.name} is not YAML"
    if not isinstance(data, dict) or not all(isinstance(data.get(g), dict) for g in ("model", "method", "task")):
        return None, f"{path.name} is not a run config (no model, method and task)"
    return data, None


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def warn(message: str) -> None:
    print(f"kvbench: warning: {message}", file=sys.stderr, flush=True)


class RunLocked(KvbenchError):
    """Another process is writing this run directory."""


def _append_line(path: Path, line: str) -> None:
    """Append one line and flush it to the disk (a failure part-way leaves a torn last line, which the
    next writer drops: :meth:`RunDir.repair_tail`)."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


class Stopped(BaseException):
    """The process was asked to stop (SIGTERM: a scheduler's time limit, ``kill``): like Ctrl-C, every
    finished sample is saved and the same command resumes."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into :class:`Stopped` for the body (a run then records why it stopped), instead of
    the default of dying on the spot with ``status.json`` still saying ``running``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back while the body runs (an append must not be cut in half), then
    deliver them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    watched = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum)) for signum in watched}
    try:
        yield
    finally:
        for signum in watched:
            signal.signal(signum, previous[signum])
        for number in dict.fromkeys(received):
            handler = previous[signal.Signals(number)]
            if callable(handler):
                handler(number, None)
            elif handler == signal.SIG_DFL and number == signal.SIGINT:
                raise KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), number)


class OutputError(KvbenchError):
    """The output folder takes no more writes (full, read-only): the saved samples stay, and the same
    command resumes once it does."""


# ---------------------------------------------------------------------- the lock
class RunLock:
    """An exclusive ``flock`` on ``<output_dir>/.<run-id>.lock`` for the run directory ``run_path``; the
    file holds who took it.

    The file is removed on release. A process that opened it just before (and then got the lock on the
    removed inode) notices that the path no longer names the file it locked and tries again, so two
    holders are impossible. The kernel drops the lock when a holder dies, even by SIGKILL.
    """

    def __init__(self, run_path: Path) -> None:
        self.run_path = Path(run_path)
        self.path = self.run_path.parent / f".{self.run_path.name}.lock"
        self.fd: int | None = None

    def holder(self) -> dict[str, Any] | None:
        """The holder's ``pid``, ``host``, ``started`` and ``command`` (None when nobody wrote them)."""
        holder, _ = read_json(self.path)
        return holder or None

    def probe(self) -> str | None:
        """``held`` when a process holds the lock, ``stale`` when the lock file outlived its writer
        (killed, or a host that went away), None when there is no lock file. Asks the kernel (a shared
        ``flock`` tried and dropped at once, which modifies nothing), so a lock taken on another host of
        a shared file system counts as held exactly when that host's writer still holds it."""
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError:
            return "held" if self._pid_alive() else "stale"
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "held"
        except OSError:  # no flock on this file system: the recorded pid decides
            return "held" if self._pid_alive() else "stale"
        finally:
            os.close(fd)  # closing drops a lock taken here
        return "stale"

    def _pid_alive(self) -> bool:
        """Whether the recorded holder may be alive: a live pid on this host, or any other host's."""
        holder = self.holder()
        if not holder or holder.get("host") != socket.gethostname():
            return bool(holder)
        try:
            os.kill(int(holder["pid"]), 0)
        except (ProcessLookupError, ValueError, KeyError, TypeError):
            return False
        except PermissionError:
            return True
        return True

    def held_by_live_process(self) -> bool:
        """Whether a live process holds the lock — without touching the lock (readers never write)."""
        return self.probe() == "held"

    def stale_note(self) -> str:
        """One line on a lock file nobody holds: whose it was, and that the next run replaces it."""
        holder = self.holder() or {}
        who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}" if holder else "nobody"
        dead = "" if not holder else " (another host)" if holder.get("host") != socket.gethostname() else " (exited)"
        return f"stale lock {self.path}: written by {who}{dead}, held by no process; the next run replaces it"

    def acquire(self, *, wait: bool, command: str | None = None) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            stale = self.probe() == "stale" and self.holder() is not None
            fd = self._locked_fd(wait)
        except OSError as exc:
            if not output_fault(exc):
                raise
            raise OutputError(
                f"cannot take the lock {self.path}: {exc.strerror}",
                f"make {self.path.parent} writable, or set output_dir=<a writable folder>",
            ) from None
        if stale:
            warn(self.stale_note().replace("the next run replaces it", "replaced"))
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": now(), "command": command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd

    def _locked_fd(self, wait: bool) -> int:
        """An open descriptor of the lock file, flocked exclusively (waiting, or refused with the holder)."""
        import fcntl

        announced = False
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _flock_soon(fd):
                if not wait:
                    os.close(fd)
                    raise RunLocked(
                        f"{self.run_path} is being written by {self.describe()}",
                        "wait for that run to finish, or pass --wait to start when it does",
                    ) from None
                if not announced:
                    print(f"kvbench: waiting for {self.describe()} to finish", file=sys.stderr, flush=True)
                    announced = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # the previous holder removed the file we locked: lock the new one

    def describe(self) -> str:
        holder = self.holder()
        if not holder:
            return "another process (starting up)"
        text = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"
        return text + (f" (`{holder['command']}`)" if holder.get("command") else "")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None


def _flock_soon(fd: int, tries: int = 10) -> bool:
    """An exclusive flock of ``fd`` without waiting for a writer — a reader's probe (:meth:`RunLock.probe`)
    holds a shared one for a moment, so a few short retries tell the two apart."""
    import fcntl

    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.01 * (attempt + 1))
    return False
