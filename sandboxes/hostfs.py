"""Host-side access to files in a folder the agent writes to (a local sandbox's workspace): regular
files only, never through a link, never blocking.

rollway reads and writes workspace files from the host (the search tool, the editor, graders through
`Sandbox.read_file`), often as root. The agent decides what each name is: a FIFO makes a plain `open`
block a host thread forever, a device or socket is no file, and a link anywhere on the path leads
out of the workspace. So every host-side access goes through this module: each folder of the path
is opened relative to its parent with O_NOFOLLOW, the file itself with O_NOFOLLOW|O_NONBLOCK, and
`fstat` after the open decides (race-free: what was checked is what is read). Anything but a
regular file raises `NotARegularFile`, which says what the path is."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class NotARegularFile(OSError):
    """The path is a FIFO, socket, device, link or folder (or a folder on its way is a link): rollway
    does not open it from the host. The message names what it is; tools show it to the agent."""


def kind_of(mode: int) -> str:
    """A file type in words, for messages."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or rel.startswith("/"):
        raise NotARegularFile(errno.EINVAL, f"{rel!r} is not a file path inside the folder")
    return parts


@contextlib.contextmanager
def _parent_fd(root: str, parts: list[str], create: bool = False, owner: int | None = None) -> Iterator[int]:
    """A descriptor of the folder holding `parts[-1]`, each step opened without following links;
    `create`: make missing folders on the way (mode 0755), given to `owner` (uid = gid) through
    their descriptors."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            made = False
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass
            try:
                inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotARegularFile(err.errno, f"{'/'.join(parts)}: {part} on its way is not a plain folder "
                                                     "(a link?); rollway does not follow links in the workspace") from None
                raise
            os.close(fd)
            fd = inner
            if made and owner is not None:
                os.fchown(fd, owner, owner)
        yield fd
    finally:
        os.close(fd)


def _checked(fd: int, rel: str) -> int:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotARegularFile(errno.EINVAL, f"{rel} is {kind_of(mode)}, not a regular file; rollway reads and "
                                            "writes only regular files in the workspace")
    return fd


def open_regular(root: str, rel: str) -> int:
    """A read-only descriptor of the regular file `rel` inside the folder `root` (the caller closes
    it). Raises NotARegularFile for anything else, FileNotFoundError when it is missing."""
    parts = _parts(rel)
    with _parent_fd(root, parts) as folder:
        try:
            before = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{rel} does not exist") from None
        if not stat.S_ISREG(before.st_mode):  # never open a FIFO or device at all (opening one can act)
            raise NotARegularFile(errno.EINVAL, f"{rel} is {kind_of(before.st_mode)}, not a regular file; "
                                                "rollway reads only regular files in the workspace")
        try:
            fd = os.open(parts[-1], os.O_RDONLY | _FILE_FLAGS, dir_fd=folder)
        except OSError as err:
            if err.errno == errno.ELOOP:  # swapped for a link since the stat
                raise NotARegularFile(err.errno, f"{rel} is a symbolic link; rollway does not follow it") from None
            raise
    return _checked(fd, rel)


def read_regular(root: str, rel: str, max_bytes: int) -> bytes:
    """At most `max_bytes + 1` bytes of the regular file `rel` (one more than allowed tells the caller
    it is too large, without reading it all)."""
    fd = open_regular(root, rel)
    with os.fdopen(fd, "rb") as handle:
        return handle.read(max_bytes + 1)


def write_regular(root: str, rel: str, data: bytes, mode: int | None = None, owner: int | None = None) -> None:
    """Write `data` to `rel` inside `root`, creating it (and missing folders) or truncating a regular
    file; never through a link, never onto a FIFO or device. `mode`: set on the file (None: a new
    file gets 0644, an existing one keeps its own). `owner`: the uid (and gid) that gets what this
    creates, through descriptors (the sandbox's user must be able to edit what rollway wrote)."""
    parts = _parts(rel)
    with _parent_fd(root, parts, create=True, owner=owner) as folder:
        try:
            before = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            before = None
        if before is not None and not stat.S_ISREG(before.st_mode):
            raise NotARegularFile(errno.EINVAL, f"{rel} is {kind_of(before.st_mode)}, not a regular file; "
                                                "rollway writes only regular files in the workspace")
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | _FILE_FLAGS, 0o644, dir_fd=folder)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENXIO):  # a link, or a FIFO made since the stat
                raise NotARegularFile(err.errno, f"{rel} is not a regular file; rollway does not write it") from None
            raise
    fd = _checked(fd, rel)
    if mode is not None:
        os.fchmod(fd, mode)
    if before is None and owner is not None:
        os.fchown(fd, owner, owner)
    with os.fdopen(fd, "wb") as handle:
        handle.truncate(0)
        handle.write(data)


def inside(root: str, rel: str) -> str:
    """`rel` with the links it passes through resolved, as a path relative to `root`; links that stay
    inside the folder are followed (a task's repository may hold some), one that leads out is refused.
    Open the result with `open_regular`/`read_regular`/`write_regular`: a link made after this
    resolution is then refused, never followed."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, rel))
    if real == real_root or not real.startswith(real_root + os.sep):
        raise NotARegularFile(errno.EINVAL, f"{rel} is not a file inside the workspace (a link that leads out?)")
    return os.path.relpath(real, real_root)
