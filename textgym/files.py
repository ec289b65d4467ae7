"""File-system helpers: atomic folder and file writes, their crash recovery, a folder lock, own-file checks."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "FolderInUseError",
    "check_own_file",
    "check_writable_folder",
    "lock_folder",
    "open_own_file",
    "recover_folder",
    "link_files",
    "save_folder_atomically",
    "write_file_atomically",
    "write_text_atomically",
]


class FolderInUseError(RuntimeError):
    """Another process holds the lock of a folder (see :func:`lock_folder`)."""


# ---------------------------------------------------------------- atomic folders
# Names beside OUT during a save: `.OUT.<32 hex>` is being written (an orphan is incomplete), `.OUT.new`
# is complete and waits for the swap, `.OUT.old` is the previous version during the swap. At every
# instant a complete copy exists under one of OUT, `.OUT.new`, `.OUT.old`.


def _sibling(out: Path, tag: str) -> Path:
    return out.with_name(f".{out.name}.{tag}")


def save_folder_atomically(out: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp_dir)``, then swap ``tmp_dir`` in for ``out``: no half-written folder is ever at ``out``.

    A crash at any point leaves a complete copy that :func:`recover_folder` (also run here first)
    puts back at ``out``. Files get the modes the umask gives (some writers create theirs 0600),
    and are fsynced before the swap so that a power cut cannot leave a renamed but empty file.
    One writer per folder: a trainer holds :func:`lock_folder` on its run folder.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_folder(out)
    tmp = _sibling(out, uuid.uuid4().hex)
    tmp.mkdir()  # a plain mkdir (not mkdtemp, whose 0700 would make the saved folder private): the umask applies
    try:
        write(tmp)
        _follow_umask(tmp)
        _fsync_tree(tmp)
        os.rename(tmp, _sibling(out, "new"))
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err, out.parent):
            raise _disk_full_error(out, err) from err
        raise
    _swap_in(out)


def _disk_full_error(out: Path, err: BaseException) -> OSError:
    """One ENOSPC error naming the folder being saved, the disk (mount point and free space) and what is kept."""
    kept = f"the previous {out.name} is kept" if out.exists() else "nothing of it is left"
    return OSError(errno.ENOSPC, f"no space left on the device holding {out} (the file system mounted at "
                   f"{_mount_point(out.parent)}, {_free_bytes(out.parent) / 2**20:.1f} MiB free) while saving it; "
                   f"{kept}: free some space and run again ({type(err).__name__}: {err})")  # fmt: skip


# Rust's io::Error ends its text with "(os error N)": how safetensors' and tokenizers' writers report ENOSPC/EDQUOT
_RUST_DISK_FULL = re.compile(rf"\(os error (?:{errno.ENOSPC}|{errno.EDQUOT})\)")


def _disk_full(err: BaseException, folder: Path) -> bool:
    """Whether ``err`` of a write into ``folder`` means the disk is full.

    Why three tests: ``open``/``write`` say ENOSPC; Rust writers (safetensors, tokenizers) raise their
    own exception type whose text carries the OS error number; and torch's zip writer reports a short
    write as a RuntimeError ("enforce fail at inline_container.cc ... unexpected pos"), which only a
    nearly empty disk explains.
    """
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(err, OSError) and _RUST_DISK_FULL.search(str(err)):
        return True
    return isinstance(err, RuntimeError) and "unexpected pos" in str(err) and _free_bytes(folder) < 64 * 2**20


def _mount_point(folder: Path) -> Path:
    """The mount point of the file system holding ``folder`` (the disk a full-disk error names)."""
    path = folder.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _free_bytes(folder: Path) -> int:
    """Bytes this process may still write on the file system holding ``folder``."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 1 << 62  # unknown: never blame the disk without seeing it


def link_files(src: str | Path, dst: str | Path) -> None:
    """Hard-link every file of folder ``src`` into folder ``dst`` (copy where links are not possible).

    Why: a run keeps its weights in ``checkpoint/`` and as plain HF folders (``policy/``,
    ``value/``); a link stores them once on disk. Saved files are never rewritten in place (a
    save writes a new folder and swaps it in), so a linked file cannot change under the other name.
    """
    src, dst = Path(src), Path(dst)
    for path in src.iterdir():
        if path.is_file():
            try:
                os.link(path, dst / path.name)
            except OSError:  # another file system, or one without hard links
                shutil.copy2(path, dst / path.name)


def _swap_in(out: Path) -> None:
    """``.OUT.new`` becomes ``out``; the previous ``out`` waits as ``.OUT.old`` until the new one is in place."""
    if out.exists():
        os.rename(out, _sibling(out, "old"))
    os.rename(_sibling(out, "new"), out)
    _fsync_dir(out.parent)
    shutil.rmtree(_sibling(out, "old"), ignore_errors=True)


def recover_folder(out: str | Path) -> str | None:
    """Finish or undo a save of ``out`` that a crash interrupted; remove incomplete temp folders.

    Returns:
        What was done (for the caller to report), or None when there was nothing to do.
    """
    out = Path(out)
    new, old = _sibling(out, "new"), _sibling(out, "old")
    done = []
    for orphan in _orphans(out):
        shutil.rmtree(orphan, ignore_errors=True)
        done.append(f"removed the incomplete {orphan.name}")
    if new.is_dir():
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
        _swap_in(out)
        done.append(f"finished the interrupted swap: the complete {new.name} is now {out.name}")
    elif old.is_dir() and not out.exists():
        os.rename(old, out)
        done.append(f"restored the previous version {old.name} as {out.name} (the newer one was never complete)")
    elif old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
        done.append(f"removed the leftover {old.name}")
    return "; ".join(done) or None


def _orphans(out: Path) -> list[Path]:
    """``.OUT.<32 hex>`` folders: writes that never finished."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.[0-9a-f]{{32}}")
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir())


def _follow_umask(folder: Path) -> None:
    """Give every entry the mode a plain ``mkdir``/``open`` would: safetensors writes its files 0600."""
    dir_mode = folder.stat().st_mode & 0o777  # ``folder`` comes from a plain mkdir: 0o777 minus the umask
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod(dir_mode if path.is_dir() else dir_mode & 0o666)


def _fsync_tree(folder: Path) -> None:
    for path in (*folder.rglob("*"), folder):
        if path.is_file() or path.is_dir():
            _fsync_path(path)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a directory
        _fsync_path(folder)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomically(path: str | Path, text: str, argument: str = "folder") -> None:
    """Write ``text`` (UTF-8) through ``.NAME.tmp`` and a rename (:func:`write_file_atomically`)."""
    write_file_atomically(path, lambda f: f.write(text.encode("utf-8")), argument)


def write_file_atomically(path: str | Path, write: Callable[[BinaryIO], object], argument: str = "folder") -> None:
    """Call ``write(f)`` on a binary file ``.NAME.tmp`` beside ``path``, then rename it to ``path``: a crash or an
    error in ``write`` leaves the old file or the new one, never half of one (the temp is removed).

    The temp file is created anew (``O_EXCL``) after any stale one is removed: a link planted at its
    name is unlinked (never its target), so the bytes cannot go into a file outside the folder. ``write`` gets
    the open file, not the name, for the same reason (``datasets``' ``to_parquet`` takes a buffer).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # a stale temp, or a link at its name: unlink removes the name alone
    except IsADirectoryError:
        try:
            check_own_file(tmp, argument)  # raises, naming it
        except ValueError as refusal:
            raise refusal from None
        raise
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or a failed writer: no half-written temp is left
        raise


# ---------------------------------------------------------------- a folder's own files
def open_own_file(path: str | Path, flags: int, argument: str = "folder", role: str = "file") -> int:
    """``os.open`` of a regular file that is the folder's own: never through a link into a file elsewhere.

    Why: a writer of ``folder/NAME`` must change that file alone. ``O_NOFOLLOW`` stops a symlink at
    the name, ``fstat`` a hard link (another name for the same file), a FIFO or a device;
    ``O_NONBLOCK`` keeps the open of a FIFO from waiting for a reader.

    Raises:
        ValueError: naming ``argument``, the folder, the path, what it is and how to remove it.
    """
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o666)
    except OSError:
        try:
            check_own_file(path, argument, role)  # ELOOP (a symlink), EISDIR, ENXIO (a FIFO): say what it is
        except ValueError as refusal:
            raise refusal from None  # the one error: what the name is, not the errno it gave
        raise
    what = _not_own(path, os.fstat(fd))
    if what is not None:
        os.close(fd)
        raise _refusal(path, argument, role, what)
    return fd


def check_own_file(path: str | Path, argument: str = "folder", role: str = "file", hard_links: bool = False) -> None:
    """Refuse ``path`` unless it is missing or a plain file (``role="folder"``: a real directory) of its folder.

    ``hard_links=True`` allows a file with other names: one the caller replaces by a rename, never writes in place.

    Raises:
        ValueError: naming ``argument``, the folder, the path, what it is and how to remove it.
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if role == "folder":
        what = None if stat.S_ISDIR(st.st_mode) else _not_own(path, st) or "a file, not a folder"
    else:
        what = _not_own(path, st, hard_links)
    if what is not None:
        raise _refusal(path, argument, role, what)


def _not_own(path: Path, st: os.stat_result, hard_links: bool = False) -> str | None:
    """What makes ``path`` (``st``: its lstat or fstat) no plain file of its own, or None."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to {os.readlink(path)!r}), which textgym never writes through"
    if stat.S_ISDIR(mode):
        return "a directory, not a file"
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return f"a {'FIFO (named pipe)' if stat.S_ISFIFO(mode) else 'socket'}, not a regular file"
    if not stat.S_ISREG(mode):
        return "a device, not a regular file"
    if st.st_nlink > 1 and not hard_links:
        return f"a hard link ({st.st_nlink} names share its contents): writing it would change another file"
    return None


def _refusal(path: Path, argument: str, role: str, what: str) -> ValueError:
    remove = f"rm -r {path}" if path.is_dir() and not path.is_symlink() else f"rm {path}"
    return ValueError(f"{argument}={str(path.parent)!r}: its {role} {path} is {what}; remove it ({remove}) and run "
                      "again")  # fmt: skip


def check_writable_folder(folder: str | Path, argument: str = "folder") -> None:
    """Create ``folder`` if needed and check that this process can write into it.

    Raises:
        PermissionError: naming ``argument``, the folder and why (no permission, a read-only file system).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PermissionError(err.errno, f"{argument}={str(folder)!r} cannot be created ({err.strerror}); "
                              "give a folder you can write") from None  # fmt: skip
    if not os.access(folder, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only_mount(folder) else "no write permission for this user"
        raise PermissionError(errno.EACCES, f"{argument}={str(folder)!r} is not writable ({why}); give a folder "
                              "you can write")  # fmt: skip


def _read_only_mount(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------- lock
@contextlib.contextmanager
def lock_folder(folder: str | Path, argument: str = "folder", wait: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` for the ``with`` block, or fail at once naming the holder.

    The lock is ``flock`` on ``folder/.lock`` (which holds the holder's pid): the kernel releases it
    when its process dies, so a crash never leaves a stale lock. POSIX only. ``wait=True`` waits for
    the holder instead of failing (a shared cache filled once, by whichever process comes first).

    Raises:
        FolderInUseError: another process (or another ``lock_folder`` in this one) holds it, and ``wait`` is False.
    """
    path = Path(folder) / ".lock"
    fd = _acquire(path, argument, wait)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before the unlock: a waiter then sees a removed file and retries
        os.close(fd)


def _acquire(path: Path, argument: str, wait: bool = False) -> int:
    import fcntl

    while True:
        fd = _open_lock_file(path, argument)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderInUseError(
                f"{argument}={str(path.parent)!r} is in use by another process (pid {holder}, lock {path}); "
                "wait for it to finish or use another folder"
            ) from None
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)  # the holder removed the file between our open and our lock: lock the new one


def _open_lock_file(path: Path, argument: str) -> int:
    """Open (or create) the lock file itself, never a file elsewhere that a link at its name reaches.

    Why :func:`open_own_file`: the holder truncates the lock and writes its pid into it; through a
    symlink or a hard link that would overwrite another file the user can write.

    Raises:
        ValueError: the lock's name is taken by a link, a directory, a FIFO or a device (naming what to remove).
    """
    return open_own_file(path, os.O_RDWR | os.O_CREAT, argument, role="lock")


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
