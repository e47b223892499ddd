"""Run folders: how every command that writes a folder (train, convert, train-drafter, eval, demo)
claims it, so that nothing is overwritten and one folder holds one run at a time.

A run folder holds

- a marker, ``.msakit-run.json``: the command that started the run (``{"command": "train",
  "msakit": VERSION, "started": ISO time}``; a command may add fields), written when the run
  starts;
- while a command runs, a lock file, ``.msakit-lock``, on which it holds an OS-level lock
  (``fcntl.flock``); it is removed when the command ends.  The kernel drops the lock when the process ends,
  however it ends (exit, exception, SIGKILL), so a killed run never leaves its folder locked.

The rules (`claim`, and the checks without writing `check_fresh` / `check_resume`):

- a fresh run takes a folder that does not exist or is empty (an unheld lock file alone counts as
  empty);
- ``--resume`` takes only a folder whose marker names a command that the resuming command
  continues (``accepts``); a folder without a marker is taken only where `legacy` recognises it
  (runs written before markers existed; their folders stay without one);
- a folder whose lock another process holds is refused (`FolderBusy`), naming that process.

Every refusal is a `RunFolderError` (a ValueError) with a one-line message, raised before
anything is written.  Standard library only (a leaf module).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from msakit.version import __version__

__all__ = ["MARKER", "LOCK", "RunFolderError", "FolderBusy", "FolderLock", "RunClaim", "read_marker", "write_marker",
           "check_fresh", "check_resume", "claim", "first_missing_ancestor", "remove_created"]

MARKER = ".msakit-run.json"
LOCK = ".msakit-lock"

Legacy = Callable[[Path], bool]


class RunFolderError(ValueError):
    """A folder a command may not write (one line)."""


class FolderBusy(RunFolderError):
    """A folder another process holds."""


# ----------------------------------------------------------------------------- the marker
def read_marker(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker of run folder `folder` (None when it has none); RunFolderError for a marker that
    is not a JSON object naming its command."""
    p = Path(folder) / MARKER
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunFolderError(f"{p} is unreadable ({type(e).__name__}); this folder's run cannot be identified") from None
    if not isinstance(d, dict) or not isinstance(d.get("command"), str):
        raise RunFolderError(f"{p} does not name the command that wrote the folder")
    return d


def write_marker(folder: Path, command: str, extra: dict[str, Any] | None = None) -> None:
    """Write `folder`'s marker (beside it first, then renamed into place)."""
    d = {"command": command, "msakit": __version__,
         "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **(extra or {})}
    tmp = folder / f"{MARKER}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(d, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, folder / MARKER)


def _cmd(command: str) -> str:
    return f"`msakit {command}`"


# ----------------------------------------------------------------------------- the lock
@dataclass
class FolderLock:
    """An exclusive ``flock`` on FOLDER/.msakit-lock, held until `release` (or the process ends).
    The lock file records who holds it (command and pid), for the message of a refused second
    command."""

    folder: Path
    fd: int | None = field(default=None, repr=False)

    @classmethod
    def acquire(cls, folder: Path, command: str) -> "FolderLock":
        """Lock `folder` (which must exist) for `command`; FolderBusy when another process holds it."""
        path = Path(folder) / LOCK
        tries = 0
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                tries += 1
                if _holder(folder) is None and tries < 20:  # a passing check (`_holder`'s shared lock)
                    time.sleep(0.01)
                    continue
                raise FolderBusy(_busy_message(folder)) from None
            # the holder before us may have removed the folder's files (a failed fresh run) after we
            # opened the file: the lock then sits on a file no longer in the folder; take it again
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"command": command, "pid": os.getpid()}).encode())
        return cls(Path(folder), fd)

    def release(self) -> None:
        """Remove the lock file and drop the lock (a process that opened the old file meanwhile
        finds it gone in `acquire` and takes a new one)."""
        if self.fd is not None:
            try:
                if os.path.samestat(os.fstat(self.fd), os.stat(self.folder / LOCK)):
                    os.unlink(self.folder / LOCK)
            except FileNotFoundError:
                pass
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _holder(folder: Path) -> str | None:
    """Who holds `folder`'s lock ("`msakit train` (pid N)", "another process"), None when nobody does."""
    path = Path(folder) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            pass
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        try:
            d = json.loads(os.read(fd, 4096) or b"{}")
            return f"{_cmd(d['command'])} (pid {int(d['pid'])})"
        except (ValueError, KeyError, TypeError):
            return "another process"
    finally:
        os.close(fd)


def _busy_message(folder: Path, who: str | None = None) -> str:
    who = who or _holder(folder) or "another process"
    return f"{folder} is in use by {who}: one run per folder; wait for it to end or choose another --out"


def _check_not_busy(folder: Path) -> None:
    who = _holder(folder)
    if who is not None:
        raise FolderBusy(_busy_message(folder, who))


# ----------------------------------------------------------------------------- the checks
def _entries(folder: Path) -> list[str]:
    """The folder's entries, without an unheld lock file."""
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK)


def check_fresh(out: str | os.PathLike[str], *, legacy: Legacy | None = None) -> None:
    """RunFolderError unless `out` may take a fresh run: missing, or an empty folder that no other
    process holds.  `legacy` recognises a run written without a marker (for the message)."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise RunFolderError(f"--out {out} exists and is not a folder")
    _check_not_busy(out)
    entries = _entries(out)
    if not entries:
        return
    marker = read_marker(out)
    if marker is not None:
        raise RunFolderError(f"--out {out} already holds a run of {_cmd(marker['command'])}: choose another --out "
                             "(a run is continued by its own command with --resume)")
    if legacy is not None and legacy(out):
        raise RunFolderError(f"--out {out} already holds a run: pass --resume to continue it or choose another --out")
    n = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
    raise RunFolderError(f"--out {out} is not empty ({n}, e.g. {entries[0]!r}) and holds no run to continue; a "
                         "fresh run needs a new or empty folder: choose another --out or empty it")


def check_resume(out: str | os.PathLike[str], command: str, accepts: Sequence[str] | None = None, *,
                 legacy: Legacy | None = None) -> bool:
    """RunFolderError unless `command` may continue the run in `out`: a folder no other process
    holds, whose marker names one of `accepts` (default: `command`) or, without a marker, that
    `legacy` recognises.  Returns whether the folder is such a legacy run (without a marker)."""
    out = Path(out)
    if not out.is_dir():
        raise RunFolderError(f"--out {out}: no such run folder to resume" if not out.exists()
                             else f"--out {out} is not a folder")
    _check_not_busy(out)
    return _resumable(out, command, accepts, legacy)


def _resumable(out: Path, command: str, accepts: Sequence[str] | None, legacy: Legacy | None) -> bool:
    """`check_resume` without the lock's check (for the holder of the lock)."""
    accepts = tuple(accepts or (command,))
    marker = read_marker(out)
    if marker is None:
        if legacy is not None and legacy(out):
            return True
        raise RunFolderError(f"--out {out} holds no run of {_cmd(command)} to resume (no {MARKER}); a fresh run "
                             "needs a new or empty --out")
    if marker["command"] not in accepts:
        raise RunFolderError(f"--out {out} holds a run of {_cmd(marker['command'])}, not of {_cmd(command)}: "
                             "nothing of it is continued or overwritten; choose another --out")
    return False


# ----------------------------------------------------------------------------- claiming
def first_missing_ancestor(path: Path) -> Path | None:
    """The topmost of `path` and its parents that does not exist (what creating `path` creates)."""
    p = Path(os.path.abspath(path))
    top = None
    while not p.exists():
        top = p
        if p.parent == p:
            break
        p = p.parent
    return top


def remove_created(out: Path, created: Path | None) -> None:
    """Undo a fresh run's writes: remove `created` (the folders the run created) or, when `out`
    already existed (empty), everything inside it."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    elif out.is_dir():
        for e in out.iterdir():
            if e.is_dir() and not e.is_symlink():
                shutil.rmtree(e, ignore_errors=True)
            else:
                e.unlink(missing_ok=True)


@dataclass
class RunClaim:
    """A claimed run folder: its path, whether the run is fresh, and the lock held on it."""

    folder: Path
    fresh: bool
    lock: FolderLock


@contextmanager
def claim(out: str | os.PathLike[str], command: str, *, resume: bool = False, accepts: Sequence[str] | None = None,
          legacy: Legacy | None = None, keep: Callable[[Path], bool] | None = None,
          marker: dict[str, Any] | None = None) -> Iterator[RunClaim]:
    """Hold run folder `out` for `command` while the body runs: checked (`check_fresh`, or with
    `resume` `check_resume(accepts, legacy)`), created, locked, checked again under the lock and
    marked (`marker`: extra fields of a fresh run's marker).  When the body of a fresh run fails
    (or is interrupted) and `keep(out)` is not true (default: never), everything the run created
    is removed; a resumed run's folder is left as it is.  The lock is released at the end."""
    out = Path(out)
    if resume:
        check_resume(out, command, accepts, legacy=legacy)
        created = None
    else:
        check_fresh(out, legacy=legacy)
        created = first_missing_ancestor(out)
        out.mkdir(parents=True, exist_ok=True)
    try:
        lock = FolderLock.acquire(out, command)
    except BaseException:
        if created is not None and created.is_dir() and not any(created.rglob("*")):
            shutil.rmtree(created, ignore_errors=True)  # nothing of another run is in it
        raise
    ok = False
    try:
        if resume:  # again under the lock: another process may have finished with the folder meanwhile
            _resumable(out, command, accepts, legacy)
        else:
            if _entries(out):
                raise FolderBusy(f"{out} was taken by another run as this one started; choose another --out")
            write_marker(out, command, marker)
        ok = True
    finally:
        if not ok:
            lock.release()
    try:
        yield RunClaim(out, not resume, lock)
    except BaseException:
        if not resume and not (keep is not None and keep(out)):
            remove_created(out, created)
        raise
    finally:
        lock.release()
