"""The local sandboxes' supervisor: spawns their commands and reaps their orphans.

Run as ``python -I -S _init.py SOCKET_FD``, one per ``LocalSandboxProvider``. A process of its
own because:

* **Orphans** are re-parented to the nearest child subreaper, else to PID 1, and many PID 1s
  never reap (a worker as PID 1 in a container); the zombies would count against the sandbox
  uid's ``RLIMIT_NPROC`` and ``pids.max``. The supervisor is a subreaper and reaps them all.
* **Containment needs an order**, done in a small single-threaded process where ``fork`` is
  safe: network namespace (``setns``, or a new one with loopback up for a namespace holder),
  cgroups (needs root, so first), rlimits (``RLIMIT_NPROC`` before ``setuid``), the sandbox
  uid/gid without supplementary groups, ``no_new_privs`` (setuid binaries cannot regain
  privileges), the signal dispositions Python ignores, ``chdir``, exec.

Protocol on the Unix socket pair: a request is a 4-byte big-endian length and a JSON object
``{"id", "argv", "env", "spec"}``, its ``sendmsg`` carrying four descriptors (stdin, stdout,
stderr, an error pipe). A setup failure is written to the error pipe (exit 125); a successful
exec closes it empty; a command that cannot be executed gets a shell's message and status
(127 not found, else 126). Replies are JSON lines: ``{"id", "pid"}`` once forked (the pid leads
a new session), ``{"id", "status"}`` at its end (``os.waitstatus_to_exitcode``), or
``{"id", "error"}``. Once the worker's end closes, the supervisor reaps until no child is left.

Standalone (stdlib only, no ``engine``) and run with ``-I -S``: nothing from the worker's
environment runs as root, and children drop privileges before they could read a root-only
Python installation.
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import json
import os
import resource
import select
import signal
import socket
import struct
import sys

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_FDS_PER_REQUEST = 4
_LIBC = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _LIBC.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}): {os.strerror(err)}")


def _loopback_up() -> None:
    """Bring ``lo`` up in a new network namespace: 127.0.0.1 and nothing else."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def _network(spec: dict[str, object]) -> None:
    """``new_netns``: unshare a network namespace; ``netns``: join the one a holder keeps."""
    if spec.get("new_netns"):
        if _LIBC.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
        _loopback_up()
        return
    netns = spec.get("netns")
    if not isinstance(netns, dict):
        return
    path = f"/proc/{int(netns['pid'])}/ns/net"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(exc.errno, f"the sandbox's network namespace ({path}) is gone") from exc
    try:
        # The holder's pid could have been reused by a process in another namespace (the
        # host's): only the namespace recorded at creation, by inode, may be joined.
        if os.fstat(fd).st_ino != int(netns["ino"]):
            raise OSError(errno.ESRCH, f"the sandbox's network namespace ({path}) is gone")
        if _LIBC.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _setup(spec: dict[str, object]) -> None:
    _network(spec)
    cgroup_procs = spec.get("cgroup_procs", [])
    assert isinstance(cgroup_procs, list)
    for path in cgroup_procs:
        try:
            with open(str(path), "w") as handle:
                handle.write(str(os.getpid()))
        except OSError as exc:
            raise OSError(exc.errno, f"joining cgroup {path}: {exc.strerror}") from exc
    rlimits = spec.get("rlimits", {})
    assert isinstance(rlimits, dict)
    for name, (soft, hard) in rlimits.items():
        try:
            resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
        except (OSError, ValueError) as exc:
            raise OSError(errno.EINVAL, f"setrlimit({name}, {soft}, {hard}): {exc}") from exc
    uid = spec.get("uid")
    gid = spec.get("gid")
    if isinstance(uid, int) and isinstance(gid, int):
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:
            raise OSError(exc.errno, f"switching to uid {uid} gid {gid}: {exc.strerror}") from exc
    if spec.get("no_new_privs", True):
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
    cwd = str(spec["cwd"])
    try:
        os.chdir(cwd)
    except OSError as exc:
        raise OSError(exc.errno, f"chdir({cwd}): {exc.strerror}") from exc
    os.umask(0o022)


def _exec(argv: list[str], env: dict[str, str]) -> OSError:
    """``execvpe`` without the standard library's lazy imports; returns why it failed."""
    name = argv[0]
    if "/" in name:
        candidates = [name]
    else:
        path = env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        candidates = [os.path.join(entry or ".", name) for entry in path.split(":")]
    denied: OSError | None = None
    last: OSError = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
    for candidate in candidates:
        try:
            os.execve(candidate, argv, env)
        except OSError as exc:
            if exc.errno == errno.EACCES and denied is None:
                denied = exc
            elif exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                return exc
            last = exc
    return denied or last


def _child(request: dict[str, object], fds: list[int]) -> None:
    """The forked child; never returns."""
    stdin, stdout, stderr, errfd = fds
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(signum, signal.SIG_DFL)
        for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
            os.dup2(fd, target)
        os.set_inheritable(errfd, False)
        _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
        os.closerange(3, errfd)
        os.closerange(errfd + 1, most if 0 < most < 2**20 else 2**20)
        spec, raw_argv, raw_env = request["spec"], request["argv"], request["env"]
        assert isinstance(spec, dict) and isinstance(raw_argv, list) and isinstance(raw_env, dict)
        argv = [str(arg) for arg in raw_argv]
        env = {str(key): str(value) for key, value in raw_env.items()}
        _setup(spec)
    except BaseException as exc:
        try:
            os.write(errfd, f"sandbox supervisor: {exc}".encode("utf-8", "replace"))
        finally:
            os._exit(125)
    error = _exec(argv, env)
    os.close(errfd)
    code = 127 if error.errno in (errno.ENOENT, errno.ENOTDIR) else 126
    os.write(2, f"sandbox: cannot run {argv[0]!r}: {error.strerror}\n".encode())
    os._exit(code)


class _Supervisor:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.pending_fds: list[int] = []
        self.commands: dict[int, object] = {}  # pid of each command -> request id
        self.closed = False

    def reply(self, message: dict[str, object]) -> None:
        if self.closed:
            return
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            self.closed = True  # the worker is gone; keep reaping

    def reap(self) -> bool:
        """Collect every exited child; False once there are no children at all."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            request_id = self.commands.pop(pid, None)
            if request_id is not None:
                self.reply({"id": request_id, "status": os.waitstatus_to_exitcode(status)})

    def read(self) -> None:
        fds = array.array("i")
        try:
            data, ancdata, _, _ = self.sock.recvmsg(
                65536, socket.CMSG_SPACE(16 * _FDS_PER_REQUEST * fds.itemsize)
            )
        except OSError:
            data, ancdata = b"", []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % fds.itemsize
                fds.frombytes(payload[:usable])
        self.pending_fds.extend(fds)
        if not data:
            self.closed = True
            return
        self.buffer += data
        while len(self.buffer) >= 4:
            size = int.from_bytes(self.buffer[:4], "big")
            if len(self.buffer) < 4 + size:
                break
            frame, self.buffer = self.buffer[4 : 4 + size], self.buffer[4 + size :]
            request_fds = self.pending_fds[:_FDS_PER_REQUEST]
            del self.pending_fds[:_FDS_PER_REQUEST]
            self.spawn(json.loads(frame), request_fds)

    def spawn(self, request: dict[str, object], fds: list[int]) -> None:
        request_id = request.get("id")
        try:
            if len(fds) != _FDS_PER_REQUEST:
                raise OSError(errno.EINVAL, f"expected {_FDS_PER_REQUEST} descriptors")
            pid = os.fork()
        except OSError as exc:
            self.reply({"id": request_id, "error": str(exc)})
        else:
            if pid == 0:
                self.sock.close()
                _child(request, fds)
            self.commands[pid] = request_id
            self.reply({"id": request_id, "pid": pid})
        finally:
            for fd in fds:
                os.close(fd)

    def run(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # poll, not select: the socket keeps the worker's descriptor number, which can be
        # above select()'s 1024 in a busy worker.
        poller = select.poll()
        poller.register(wake_r, select.POLLIN)
        poller.register(self.sock.fileno(), select.POLLIN)
        while True:
            has_children = self.reap()
            if self.closed and not has_children:
                return
            for fd, _ in poller.poll(1000):
                if fd == wake_r:
                    os.read(wake_r, 4096)
                elif not self.closed:
                    self.read()
                    if self.closed:
                        poller.unregister(self.sock.fileno())


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.set_inheritable(False)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _Supervisor(sock).run()


if __name__ == "__main__":
    main()
