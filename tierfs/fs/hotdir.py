"""The hot dir as the FUSE front touches it: every call relative to one directory fd (the *at syscalls).

A path through the mount is shorter than PATH_MAX, but the same path under a hot dir whose own path is longer
than the mountpoint's would not be: prefixing the hot dir made such operations fail with ENAMETOOLONG where the
native filesystem succeeds. Working relative to an fd of the hot dir keeps every syscall's path exactly as long
as the path the caller used below the mountpoint. (It also keeps serving the same directory if the hot dir's
path is renamed while mounted.)

Paths are the mount-relative paths of the inode table: "" is the hot dir itself, never with a leading "/".
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

PINNED_DIR = ".tierfs/unlinked"  # below the hot dir; the root's .tierfs is the control dir through the mount


def pin_path(st_ino: int) -> str:
    """Where a file or directory that lost its last name keeps its link (and so its st_ino): fs/inodes.py."""
    return f"{PINNED_DIR}/{st_ino}"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)


def set_size(fd: int, size: int, reserve: bool) -> None:
    """ftruncate, with a grown range allocated first. A broker sizes its CommitLog and ConsumeQueue files with
    ftruncate and fills them through a shared mapping; through FUSE's writeback cache nothing reserves the disk
    space when a page is dirtied, so on a full hot disk the writeback failed (ENOSPC), the kernel dropped the
    pages, and messages the broker had acknowledged were lost. Allocated here, the space is the file's: a full
    disk refuses the ftruncate (ENOSPC, before the size changes; the broker then refuses sends) instead of the
    data (mount.reserve_on_truncate; off, the file stays sparse as on a native disk). A file system that cannot
    allocate ahead (EOPNOTSUPP) keeps the file sparse."""
    if reserve and size > (cur := os.fstat(fd).st_size):
        try:
            os.posix_fallocate(fd, cur, size - cur)  # unwritten extents: no bytes written, ~1 ms per GiB on ext4
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise
    os.ftruncate(fd, size)


def _at(rel: str) -> str:
    return rel or "."


class HotDir:
    """Relative access to the hot dir through an O_PATH directory fd held for the daemon's life."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.fd = os.open(self.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self.fd)

    def lstat(self, rel: str) -> os.stat_result:
        return os.stat(_at(rel), dir_fd=self.fd, follow_symlinks=False)

    def open(self, rel: str, flags: int, mode: int = 0o777) -> int:
        return os.open(_at(rel), flags, mode, dir_fd=self.fd)

    def open_dir(self, rel: str) -> int:
        return os.open(_at(rel), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)

    def listdir(self, rel: str) -> list[str]:
        fd = self.open_dir(rel)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def mkdir(self, rel: str, mode: int) -> None:
        os.mkdir(rel, mode, dir_fd=self.fd)

    def mknod(self, rel: str, mode: int, device: int) -> None:
        os.mknod(rel, mode, device, dir_fd=self.fd)

    def symlink(self, target: str, rel: str) -> None:
        os.symlink(target, rel, dir_fd=self.fd)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, rel: str) -> None:
        os.unlink(rel, dir_fd=self.fd)

    def rmdir(self, rel: str) -> None:
        os.rmdir(rel, dir_fd=self.fd)

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        """rename, or renameat2 with RENAME_NOREPLACE / RENAME_EXCHANGE flags."""
        if not flags:
            os.rename(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            return
        if _libc.renameat2(self.fd, os.fsencode(old), self.fd, os.fsencode(new), flags) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), old, None, new)

    def remove_pinned(self, rel: str) -> os.stat_result | None:
        """Blocking: remove the name `rel`; a file's last link moves to its pin instead. Its stat (None if it was
        not there)."""
        try:
            st = self.lstat(rel)
            if st.st_nlink <= 1:
                self.rename(rel, pin_path(st.st_ino))
            else:
                self.unlink(rel)
        except FileNotFoundError:
            return None
        return st

    def empty_pinned(self, pin: str) -> None:
        """Blocking: cut a pinned regular file to size 0, giving its blocks back while its link (and so its
        st_ino) stays until the kernel forgets it. Anything but a regular file is left alone."""
        if not stat.S_ISREG(self.lstat(pin).st_mode):  # the pin dir is the daemon's: nothing else renames in it
            return
        fd = os.open(pin, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)

    def replace_pinned(self, src: str, rel: str) -> os.stat_result | None:
        """Blocking: rename file `src` over `rel`; if that was the last name of another file, that one gets a
        second link at its pin first (the rename stays one atomic step). The stat of what `rel` named, if any."""
        try:
            old = self.lstat(rel)
        except FileNotFoundError:
            old = None
        pin = pin_path(old.st_ino) if old is not None and old.st_nlink <= 1 else None
        if pin is not None:
            try:
                self.link(rel, pin)
            except FileExistsError:  # left by a dropped inode of the same st_ino whose pin could not be removed
                self.unlink(pin)
                self.link(rel, pin)
        try:
            self.rename(src, rel)
        except BaseException:
            if pin is not None:
                self.unlink(pin)
            raise
        return old

    def chmod(self, rel: str, mode: int) -> None:
        os.chmod(_at(rel), mode, dir_fd=self.fd)

    def lchown(self, rel: str, uid: int, gid: int) -> None:
        os.chown(_at(rel), uid, gid, dir_fd=self.fd, follow_symlinks=False)

    def utime(self, rel: str, ns: tuple[int, int]) -> None:
        os.utime(_at(rel), ns=ns, dir_fd=self.fd, follow_symlinks=False)

    def readlink(self, rel: str) -> str:
        return os.readlink(rel, dir_fd=self.fd)

    def truncate(self, rel: str, size: int, reserve: bool = False) -> None:
        """truncate(2) has no *at form: open for writing (what truncate checks too), ftruncate, close."""
        fd = os.open(_at(rel), os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd)
        try:
            set_size(fd, size, reserve)
        finally:
            os.close(fd)
