"""Run model-written Python with bounded time, memory, processes, files and output, no network, in
a fresh working directory, away from the caller's process and files.

    result = run_python("print(1 + 1)", timeout_s=5.0)            # SandboxResult(stdout="2\\n", ...)
    result = await arun_python(code, timeout_s=5.0)                # same, never blocks the event loop

A resource and accident sandbox, not a security boundary: see docs/sandbox.md for each limit, how it
is enforced, and what is and is not prevented. In short, each run gets new mount, PID, IPC and
network namespaces (not as root, inside a user namespace, where the kernel allows it) and, as root,
an unprivileged uid of its own; every mount is read-only but /tmp, a fresh size-bounded tmpfs that
is the working directory; rlimits bound memory, processes, file size and CPU time. Without
namespaces, only the rlimits, a new session and a temporary directory remain (`isolation` says).

How a run starts: a warm interpreter (this file run as a script, `--server`) is started once per
calling process and forks once per run; the caller hands it the code and the pipes over a Unix
socket, whose EOF (the caller ended, however) ends it: it belongs to the process, not to the thread
that happened to start it. `warm=False` starts a fresh interpreter per run instead (about 5x slower,
same guarantees; bench/bench_sandbox.py measures both). The caller's own process is never forked, so
it may have threads.

Processes of one run (with namespaces):
    C       the run's session leader (caller's uid); waits for the caller to release it, then kills
            and reaps init, then kills its own process group. The caller kills that group itself
            only while C or init still holds the status pipe (so never a reused pid).
    init    pid 1 of the run's PID namespace: mounts, then waits for the user process and reports
            its exit status; when it exits the kernel kills every process left in the namespace.
    user    the code, as the run's uid (as root) or the caller's with no capabilities, with rlimits,
            cwd /tmp, stdin at EOF.
Without namespaces C forks the user process itself and reports its exit status.
"""
import atexit
import dataclasses
import fcntl
import json
import math
import os
import resource
import selectors
import signal
import socket
import sys
import threading
import time
import types

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38

# Each concurrent run as root gets a uid of its own, so RLIMIT_NPROC (a per-uid count) bounds that
# run alone. Slots are claimed with a lock file, so concurrent callers on one machine do not share.
SANDBOX_UID_BASE = 1_900_000_000
NUM_UID_SLOTS = 256
UID_WAIT_S = 30.0  # a run finding every slot held waits this long for one, then is a failed result ("not run")
UID_POLL_S = 0.05
FALLBACK_UID = 65534  # nobody, where the kernel refuses uids past the base (a user namespace's map)
UID_LOCK_DIR = "/tmp/agentrl-sandbox-uids"
MAX_CODE_BYTES = 1 << 20
# One thread per BLAS/OpenMP pool: a pool as wide as a big machine's cores would hit RLIMIT_NPROC.
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DRAIN_S = 1.0  # after the run ends, how long to wait for the rest of its output already in the pipes


@dataclasses.dataclass
class SandboxResult:
    stdout: str  # decoded utf-8 with errors="replace", cut at max_output_bytes
    stderr: str  # same
    returncode: int | None  # None when killed for time; -N when killed by signal N
    timed_out: bool
    output_truncated: bool
    wall_s: float
    error: str | None  # None, or what the sandbox enforced: "timed out after 2 s", "memory limit ..."
    network_isolated: bool = False  # the code ran in a network namespace of its own (no interfaces up)
    isolation: str = ""  # "namespaces+uid", "namespaces", "rlimits+uid" or "rlimits"; docs/sandbox.md


# --- the child side: runs in the warm interpreter's forks (or a fresh interpreter with --one) ---

def _libc():
    import ctypes  # imported here: the caller never needs it, the server imports it once
    libc = ctypes.CDLL(None, use_errno=True)

    def check(name, value):
        if value != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{name}: {os.strerror(e)}")
    return libc, check


def _unshare(flags):
    libc, check = _libc()
    check("unshare", libc.unshare(flags))


def _mount(source, target, fstype, flags, data=None):
    libc, check = _libc()
    enc = lambda s: None if s is None else s.encode()
    check(f"mount {target}", libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)))


def _prctl(option, arg):
    libc, check = _libc()
    check("prctl", libc.prctl(option, arg, 0, 0, 0))


def _unreachable_ancestor(path: str) -> str | None:
    """The first directory above `path` that a stranger (not owner, not group) cannot enter."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _python_paths(extra_paths: list[str]) -> list[str]:
    """The directories the interpreter imports from: the run's uid must be able to read them."""
    paths = {os.path.realpath(p) for p in extra_paths if os.path.isdir(p)}
    paths |= {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix)}
    paths |= {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    return sorted(p for p in paths if not any(p.startswith(q + "/") for q in paths))


def _remount_read_only():
    """Every mount read-only (in this namespace only), so that world-writable directories such as
    /run/lock are not: the run's only writable place is its /tmp. /dev is left (/dev/null must stay
    writable), as is /proc (replaced next)."""
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1 << 10,
            "nodiratime": 1 << 11, "relatime": 1 << 21, "strictatime": 1 << 24}
    with open("/proc/self/mountinfo") as f:
        mounts = [(line.split()[4], line.split()[5].split(",")) for line in f]
    for point, options in mounts:
        for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            point = point.replace(escaped, char)
        if point.split("/")[1] in ("dev", "proc"):
            continue
        try:
            # the flags it had are kept: in a user namespace, dropping one is refused
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | sum(keep.get(o, 0) for o in set(options))
            _mount(None, point, None, flags)
        except OSError:
            pass  # a mount that cannot be remounted (hidden under another): its permissions still apply


def _bind_read_only(paths_fds: list):
    for path, fd in paths_fds:
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)


FRESH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # replaced by an empty tmpfs in every run


def _setup_mounts(uid: int, gid: int, dir_mb: int, extra_paths: list[str]):
    """In the run's new mount namespace (nothing here reaches the host's): directories the uid cannot
    enter that hold the interpreter (root's 0700 home with pyenv, say) replaced by an empty one with
    just the interpreter's directories bound in; every mount read-only; a fresh /proc for the new
    PID namespace; a fresh tmpfs on /tmp owned by the run's uid (its working directory, bounded in
    size); empty read-only /var/tmp and /dev/shm; the interpreter's directories that lay under
    those (a virtual environment in /tmp) bound back in, read-only."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    hide, under_fresh = {}, []
    for path in _python_paths(extra_paths):
        if path in FRESH_DIRS:
            continue
        ancestor = _unreachable_ancestor(path)
        if any(path.startswith(d + "/") for d in FRESH_DIRS):
            under_fresh.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
        elif ancestor is not None:
            hide.setdefault(ancestor, []).append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
    for ancestor, keep in hide.items():
        _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        _bind_read_only(keep)
    _remount_read_only()
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # a locked-down /proc (some containers): the host's stays, showing host processes
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={dir_mb}m,mode=0700,uid={uid},gid={gid}")
    others = [d for d in FRESH_DIRS[1:] if os.path.isdir(d)]
    for path in others:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    _bind_read_only(under_fresh)
    for path in others:  # read-only only now: the binds above may have needed directories in them
        _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _set_limits(req: dict, nproc: int):
    cpu_s = math.ceil(req["timeout_s"]) + 1  # wall time kills first; this bounds a runaway thread pool
    mem = req["memory_mb"] << 20
    for name, soft, hard in [("RLIMIT_CPU", cpu_s, cpu_s + 1), ("RLIMIT_AS", mem, mem),
                             ("RLIMIT_FSIZE", req["max_file_mb"] << 20, req["max_file_mb"] << 20),
                             ("RLIMIT_NPROC", nproc, nproc), ("RLIMIT_NOFILE", 256, 256), ("RLIMIT_CORE", 0, 0),
                             ("RLIMIT_MSGQUEUE", 0, 0)]:
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _count_tasks(uid: int) -> int:
    """Threads and processes of `uid` now: RLIMIT_NPROC counts them all, the caller's included."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return count


def _become_user(req: dict, fds: dict, uid: int | None, nproc: int, namespaces: bool) -> str:
    """In the user process: std streams, uid, limits; returns the code to run."""
    code = b""
    while chunk := os.read(fds["code"], 1 << 16):
        code += chunk
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds["out"], 1)
    os.dup2(fds["err"], 2)
    views = {}
    if uid is not None and not namespaces:  # nothing hides or rebinds anything: see _fd_views
        views = _fd_views(req["site_paths"])
    _libc()  # ctypes, imported while the stdlib is surely reachable
    os.closerange(3, min(views.values(), default=1 << 16))
    os.closerange(256, 1 << 16)
    if namespaces:  # a session of its own in its PID namespace, so that killpg(0) cannot reach C
        os.setsid()
    os.chdir("/tmp" if namespaces else req["work_dir"])
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.umask(0o077)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _drop_capabilities()
    if views:
        _prctl(PR_SET_DUMPABLE, 1)  # /proc/self/fd is root's after a change of uid, unless dumpable
        sys.path = [_through_views(p, views) for p in sys.path]
        for module in list(sys.modules.values()):  # packages already imported find their submodules
            if isinstance(getattr(module, "__path__", None), list):
                module.__path__[:] = [_through_views(p, views) for p in module.__path__]
    _set_limits(req, nproc)
    sys.path += [_through_views(p, views) for p in req["site_paths"]]
    return code.decode("utf-8", "surrogatepass")


def _fd_views(extra_paths: list[str]) -> dict[str, int]:
    """Without namespaces, as root: the interpreter's directories that the run's uid cannot reach
    (pyenv under root's 0700 home) stay importable through /proc/self/fd/N, a link that does not
    check the directories above N. Opened now, as root, at the top fd numbers (below RLIMIT_NOFILE)."""
    views = {}
    for path in _python_paths(extra_paths):
        if _unreachable_ancestor(path) is not None:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
            views[path] = os.dup2(fd, 255 - len(views))
            os.close(fd)
    return views


def _through_views(path: str, views: dict[str, int]) -> str:
    for root, fd in views.items():
        if path == root or path.startswith(root + "/"):
            return f"/proc/self/fd/{fd}" + path[len(root):]
    return path


def _drop_capabilities():
    """None left: not as root, the process has every capability in its new user namespace, with
    which it could unmount the read-only views and the tmpfs set up for it."""
    import ctypes
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    libc, check = _libc()
    check("capset", libc.capset(header, (ctypes.c_uint32 * 6)()))


_NAMESPACES_WORK = None  # set once by the warm interpreter; None: found out per run


def _enter_namespaces(network: bool):
    """New mount, PID (for the children), IPC and network namespaces; not as root, inside a new user
    namespace in which the caller's uid and gid map to themselves (files keep their owners)."""
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | (0 if network else CLONE_NEWNET)
    _unshare(flags if root else flags | CLONE_NEWUSER)
    if not root:
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def _namespaces_work() -> bool:
    """Whether this kernel and container let us create the namespaces and mount in them (containers
    without CAP_SYS_ADMIN, kernels that forbid unprivileged user namespaces, or AppArmor rules that
    strip their capabilities do not). Tried in a throwaway child."""
    pid = os.fork()
    if pid == 0:
        try:
            _enter_namespaces(network=False)
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=4k")
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _report(status_fd: int, wait_status: int):
    if os.WIFSIGNALED(wait_status):
        os.write(status_fd, f"signal {os.WTERMSIG(wait_status)}\n".encode())
    else:
        os.write(status_fd, f"exit {os.waitstatus_to_exitcode(wait_status)}\n".encode())


def _run_child(req: dict, fds: dict) -> str | None:
    """C: the run's session leader. Returns the code in the user process; never returns elsewhere."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it; waitpid needs it back
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader (started by Popen with start_new_session)
    status_fd = fds["status"]
    try:
        os.write(status_fd, f"pid {os.getpid()}\n".encode())
        root = os.geteuid() == 0
        namespaces = req["namespaces"] and (_NAMESPACES_WORK if _NAMESPACES_WORK is not None else _namespaces_work())
        net = False
        if namespaces:
            _enter_namespaces(req["network"])
            net = not req["network"]
        elif not req["network"]:
            try:  # an unprivileged user may still get a network namespace inside a user namespace
                _unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET)
                net = True
            except OSError:
                pass
        uid = None
        if root:
            uid = req["uid"]
            try:
                os.setresuid(uid, uid, 0)  # probe: does this kernel (user namespace map) allow the uid?
                os.setresuid(0, 0, 0)
            except OSError:
                uid = FALLBACK_UID
        isolation = ("namespaces" if namespaces else "rlimits") + ("+uid" if root else "")
        os.write(status_fd, f"net {int(net)} {isolation}\n".encode())
        # RLIMIT_NPROC counts the tasks of the uid: not as root, in a user namespace that includes C
        # and init (2); without one, every task of the caller's user
        nproc = req["max_processes"]
        if not root:
            nproc += 2 if namespaces else _count_tasks(os.getuid())
        if not namespaces and root:
            os.chown(req["work_dir"], uid, uid)
        pid = os.fork()
        if pid == 0:
            if not namespaces:
                return _become_user(req, fds, uid, nproc, namespaces=False)
            # init: pid 1 of the new PID namespace
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            _setup_mounts(*((os.getuid(), os.getgid()) if uid is None else (uid, uid)), req["max_dir_mb"],
                          req["site_paths"])
            user_pid = os.fork()
            if user_pid == 0:
                return _become_user(req, fds, uid, nproc, namespaces=True)
            for fd in ("code", "out", "err", "release"):
                os.close(fds[fd])
            while True:  # reap orphans until the user process exits; then the kernel kills the rest
                reaped, wait_status = os.waitpid(-1, 0)
                if reaped == user_pid:
                    _report(status_fd, wait_status)
                    os._exit(0)
        for fd in ("code", "out", "err"):
            os.close(fds[fd])
        reaped = False
        if not namespaces:  # C itself reports the user process's exit, unless released first
            pidfd = os.pidfd_open(pid)
            ready = selectors.DefaultSelector()
            ready.register(pidfd, selectors.EVENT_READ)
            ready.register(fds["release"], selectors.EVENT_READ)
            if any(key.fd == pidfd for key, _ in ready.select()):
                _report(status_fd, os.waitpid(pid, 0)[1])
                reaped = True
        os.read(fds["release"], 1)  # blocks until the caller is done (or dead)
        if not reaped:
            # Kill and reap our child here, so that no zombie is left to an init that may not reap
            # (a container whose pid 1 is the trainer). With namespaces it is the namespace's init:
            # waiting for it returns once the kernel has killed and reaped every process in there.
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except BaseException as e:
        try:
            os.write(status_fd, f"fail {type(e).__name__}: {e}\n".encode(errors="replace"))
        except OSError:  # the user process had closed it already: say it on its stderr
            try:
                os.write(2, f"sandbox: {type(e).__name__}: {e}\n".encode(errors="replace"))
            except OSError:
                pass
    os.killpg(0, signal.SIGKILL)
    os._exit(1)


def _exec_user_code(code: str):
    """Runs the code as `python -c` would: in a fresh __main__, tracebacks without this file's frames,
    sys.exit's code, then what the interpreter's exit does that the code can see (non-daemon threads
    joined, atexit functions, streams flushed), but not the teardown of every module, which would
    cost a warm interpreter's fork 20 ms."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    exit_code = 0
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        exit_code = _exit_code(e)
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        try:
            sys.excepthook(type(e), e.with_traceback(tb), tb)
        except BaseException:
            pass
        exit_code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        exit_code = _exit_code(e)
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            exit_code = exit_code or 120  # as python does when it cannot flush stdout at exit
    os._exit(exit_code)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except BaseException:
        pass
    return 1


FD_NAMES = ("code", "out", "err", "status", "release")


def _serve(sock_fd: int) -> str:
    """The warm interpreter: forks a run per request; returns the code only in a run's user process."""
    global _NAMESPACES_WORK
    # Not PR_SET_PDEATHSIG: it fires when the *thread* that started us ends (asyncio.to_thread's
    # worker, which ends with its event loop; a pool thread), and would kill us while the caller
    # lives on and sends us runs. The caller's death closes its end of the socket: recvmsg's EOF.
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # a run's orphans come to us, and SIG_IGN below reaps them
    _NAMESPACES_WORK = _namespaces_work()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # runs are reaped by the kernel
    _libc()  # ctypes imported once here, not in each run
    sock = socket.socket(fileno=sock_fd)
    while True:
        msg, ancdata, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(len(FD_NAMES) * 4))
        if not msg:
            os._exit(0)  # the caller closed its end (it exited)
        fds = []
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(memoryview(data).cast("i")[:len(data) // 4])
        if len(fds) == len(FD_NAMES) and os.fork() == 0:
            sock.detach()  # so that no socket object can close an fd number the code reuses
            os.close(sock_fd)
            return _run_child(json.loads(msg), dict(zip(FD_NAMES, fds)))
        for fd in fds:
            os.close(fd)



# --- the caller side ---

_server_lock = threading.Lock()
_server = {"owner_pid": None, "sock": None, "process": None}
_slot_lock = threading.Lock()
_next_slot = 0


def _server_socket(replace: socket.socket | None = None) -> socket.socket:
    """The warm interpreter's socket, started on first use, and again if it died, after a fork of
    the caller, or when `replace` (its socket) failed."""
    import subprocess  # here and below, caller-only modules are imported where used: a fresh
    # interpreter per run (warm=False) runs this file and would pay for them (asyncio: ~20-60 ms)
    with _server_lock:
        if _server["owner_pid"] == os.getpid():
            if _server["process"].poll() is None and _server["sock"] is not replace:
                return _server["sock"]
            _server["sock"].close()  # the old one, if still alive, sees EOF and exits
            _server["process"].kill()
            _server["process"].wait()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _server["process"] = subprocess.Popen(
            [sys.executable, "-I", "-S", __file__, "--server", str(theirs.fileno())], pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=SANDBOX_ENV,
            cwd="/", start_new_session=True)
        theirs.close()
        _server.update(owner_pid=os.getpid(), sock=ours)
        return ours


def _after_fork_in_child():
    """In a fork of the caller (multiprocessing, say): its copy of the warm interpreter's socket is
    closed, else that interpreter would live until the fork exits, not just the caller; the fork
    starts its own on first use. The locks are new: a thread of the caller may have held them."""
    global _server_lock, _slot_lock
    _server_lock, _slot_lock = threading.Lock(), threading.Lock()
    if _server["sock"] is not None:
        _server["sock"].close()
    _server.update(owner_pid=None, sock=None)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _claim_uid() -> tuple[int, int] | None:
    """(uid, lock fd): a uid no other run holds now (a lock file per slot; the lock goes with the
    process); None when every slot is held."""
    global _next_slot
    os.makedirs(UID_LOCK_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(UID_LOCK_DIR)
    if not (os.path.stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and st.st_mode & 0o077 == 0):
        raise RuntimeError(f"{UID_LOCK_DIR} is not a directory owned by root with mode 0700 (someone else made "
                           "it?); remove it and run again")
    with _slot_lock:
        for i in range(NUM_UID_SLOTS):
            slot = (_next_slot + i) % NUM_UID_SLOTS  # round robin: a just-freed uid is reused last
            fd = os.open(f"{UID_LOCK_DIR}/{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _next_slot = slot + 1
            return SANDBOX_UID_BASE + slot, fd
    return None


def _no_uid(start_s: float) -> SandboxResult:
    """The result of a run that found every uid slot held for UID_WAIT_S: not run, and says why."""
    return SandboxResult(stdout="", stderr="", returncode=None, timed_out=False, output_truncated=False,
                         wall_s=time.monotonic() - start_s,
                         error=f"not run: all {NUM_UID_SLOTS} sandbox uids ({UID_LOCK_DIR}) stayed in use for "
                               f"{UID_WAIT_S:g} s: too many concurrent runs on this machine; run fewer at once")


def _check_args(code, timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_dir_mb):
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
        raise ValueError(f"code is longer than {MAX_CODE_BYTES} bytes; cut it before running it")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and 0 < timeout_s <= 3600):
        raise ValueError(f"timeout_s must be a number of seconds in (0, 3600], got {timeout_s!r}")
    for name, value, low in [("memory_mb", memory_mb, 32), ("max_output_bytes", max_output_bytes, 1),
                             ("max_processes", max_processes, 1), ("max_file_mb", max_file_mb, 1),
                             ("max_dir_mb", max_dir_mb, 1)]:
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= 1 << 40):
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


class _Run:
    """One run's pipes, output and state, driven by run_python (selectors) or arun_python (the loop)."""

    def __init__(self, code, timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_dir_mb,
                 network, warm, site_packages, namespaces, uid_claim):
        """The arguments checked by _check_args; `uid_claim` (uid, lock fd) from _claim_uid as root, else
        None: the run owns it from here."""
        import tempfile  # not at the top: the warm interpreter must not import random (its forks share it)
        self.timeout_s, self.memory_mb, self.max_output_bytes = timeout_s, memory_mb, max_output_bytes
        self.max_processes, self.max_file_mb, self.max_dir_mb, self.warm = max_processes, max_file_mb, max_dir_mb, warm
        self.start_s = time.monotonic()
        self.deadline = self.start_s + timeout_s
        self.out, self.err, self.status = bytearray(), bytearray(), bytearray()
        self.truncated = self.timed_out = self.killed = False
        self.pgid, self.process, self.drain_deadline = None, None, None
        self.uid, self.uid_lock_fd = uid_claim or (None, None)
        self.fds_to_close = []
        self.work_dir = None
        try:
            self.work_dir = tempfile.mkdtemp(prefix="agentrl-sandbox-")
            os.chmod(self.work_dir, 0o700)
            code_fd = os.memfd_create("agentrl-sandbox-code", os.MFD_CLOEXEC)
            self.fds_to_close.append(code_fd)
            os.write(code_fd, code.encode("utf-8", "surrogatepass"))
            os.lseek(code_fd, 0, os.SEEK_SET)
            pipes = [os.pipe() for _ in range(4)]  # out, err, status: they write; release: we hold the write end
            self.out_r, self.err_r, self.status_r = pipes[0][0], pipes[1][0], pipes[2][0]
            self.release_w = pipes[3][1]
            self.child_fds = [code_fd, pipes[0][1], pipes[1][1], pipes[2][1], pipes[3][0]]
            self.fds_to_close += [self.out_r, self.err_r, self.status_r, self.release_w] + self.child_fds[1:]
            for fd in (self.out_r, self.err_r, self.status_r):
                os.set_blocking(fd, False)
            self.open_fds = {self.out_r, self.err_r, self.status_r}
            self.request = {"timeout_s": timeout_s, "memory_mb": memory_mb, "max_file_mb": max_file_mb,
                            "max_processes": max_processes, "max_dir_mb": max_dir_mb, "network": bool(network),
                            "uid": self.uid, "work_dir": self.work_dir, "site_paths": [],
                            "namespaces": bool(namespaces)}
            if site_packages:
                import sysconfig
                self.request["site_paths"] = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
        except BaseException:  # out of fds or disk: give back what was taken, then raise
            for fd in self.fds_to_close + ([self.uid_lock_fd] if self.uid_lock_fd is not None else []):
                os.close(fd)
            if self.work_dir is not None:
                os.rmdir(self.work_dir)
            raise

    def start(self):
        import subprocess
        if self.warm:
            message = json.dumps(self.request).encode()
            ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, memoryview(bytearray(
                b"".join(fd.to_bytes(4, sys.byteorder) for fd in self.child_fds))))]
            sock = _server_socket()
            try:
                sock.sendmsg([message], ancdata)
            except OSError:  # the warm interpreter died (killed by someone): start another, once
                _server_socket(replace=sock).sendmsg([message], ancdata)
        else:
            request = dict(self.request, fds=dict(zip(FD_NAMES, self.child_fds)))
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, "--one", json.dumps(request)], pass_fds=self.child_fds,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=SANDBOX_ENV,
                cwd="/", start_new_session=True)
            self.pgid = self.process.pid
        for fd in self.child_fds:  # the child has its copies; ours would hide the pipes' EOF
            os.close(fd)
            if fd in self.fds_to_close:
                self.fds_to_close.remove(fd)

    def read(self, fd) -> bool:
        """Reads what `fd` has; False at its EOF."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            self.open_fds.discard(fd)
            return False
        if fd == self.status_r:
            self.status += chunk
            if self.pgid is None and self.status.startswith(b"pid ") and b"\n" in self.status:
                self.pgid = int(self.status[4:self.status.index(b"\n")])
            return True
        buf = self.out if fd == self.out_r else self.err
        room = self.max_output_bytes - len(buf)
        buf += chunk[:max(room, 0)]
        if len(chunk) > room:
            self.truncated = True
        return True

    def _status_lines(self) -> dict:
        lines = self.status.decode(errors="replace").splitlines()
        return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines if " " in line}

    def _ended(self) -> bool:
        # The status pipe's EOF without a status: C and init are gone (killed by the code itself,
        # where it runs as the caller's uid); nothing is left to report, so the run ends now.
        return self.status_r not in self.open_fds or any(k in self._status_lines() for k in ("exit", "signal", "fail"))

    def next_wake(self) -> float | None:
        """The monotonic time to wake at, or None when the run is over and its output read."""
        now = time.monotonic()
        if not self.killed:
            if not (self._ended() or self.truncated or now >= self.deadline):
                return self.deadline
            self.timed_out = not self._ended() and not self.truncated
            self.kill()
            self.drain_deadline = now + DRAIN_S
        if not self.open_fds or now >= self.drain_deadline:  # status EOF too: C and init are gone
            return None
        return self.drain_deadline

    def kill(self):
        """Releases C, which kills and reaps init (the kernel then kills every process in the PID
        namespace) or, without namespaces, the code's process, then kills its own process group.
        Should the caller die first, the release pipe closes all the same."""
        self.killed = True
        if self.release_w in self.fds_to_close:
            os.close(self.release_w)
            self.fds_to_close.remove(self.release_w)

    def cleanup(self):
        if not self.killed:
            self.kill()
        if self.status_r in self.open_fds and self.pgid is not None:
            # C or init still holds the status pipe (a cancelled arun_python, or a C stuck past the
            # drain time), so the group's pid is still theirs: kill it from here as well.
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for fd in self.fds_to_close:
            os.close(fd)
        self.fds_to_close = []
        if self.process is not None:
            self.process.wait()  # killed above: SIGKILL cannot be ignored, so this returns
        import shutil
        shutil.rmtree(self.work_dir, ignore_errors=True)
        if self.uid_lock_fd is not None:
            os.close(self.uid_lock_fd)  # frees the uid slot
            self.uid_lock_fd = None

    def result(self) -> SandboxResult:
        status = self._status_lines()
        returncode, error = None, None
        if "exit" in status:
            returncode = int(status["exit"])
        elif "signal" in status:
            returncode = -int(status["signal"])
        stderr = self.err.decode("utf-8", "replace")
        # An exception's last line names a limit the code hit (anywhere: forked processes interleave)
        raised = lambda prefix: returncode != 0 and any(line.startswith(prefix) for line in stderr.splitlines())
        if self.timed_out:
            returncode, error = None, f"timed out after {self.timeout_s:g} s"
        elif self.truncated:
            error = f"output cut at {self.max_output_bytes} bytes"
        elif "fail" in status:
            error = f"sandbox failed to start the code: {status['fail']}"
        elif returncode is None:
            error = "the sandbox's process ended without reporting the code's exit status"
        elif returncode == -signal.SIGXCPU:
            error = f"CPU time limit {math.ceil(self.timeout_s) + 1} s exceeded"
        elif returncode < 0:
            error = f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        elif returncode != 0 and any(line.split(":")[0].endswith("MemoryError") for line in stderr.splitlines()):
            error = f"memory limit {self.memory_mb} MB exceeded"
        elif raised("OSError: [Errno 27] File too large"):
            error = f"file size limit {self.max_file_mb} MB exceeded"
        elif raised("OSError: [Errno 28] No space left on device"):
            error = f"working directory limit {self.max_dir_mb} MB exceeded"
        elif raised("BlockingIOError: [Errno 11] Resource temporarily unavailable"):
            error = f"process limit {self.max_processes} reached"
        net = status.get("net", "0 unknown").split()
        return SandboxResult(stdout=self.out.decode("utf-8", "replace"), stderr=stderr, returncode=returncode,
                             timed_out=self.timed_out, output_truncated=self.truncated,
                             wall_s=time.monotonic() - self.start_s, error=error, network_isolated=net[0] == "1",
                             isolation=net[1] if len(net) > 1 else "unknown")


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 65536,
               max_processes: int = 16, max_file_mb: int = 16, network: bool = False, max_dir_mb: int = 64,
               site_packages: bool = False, warm: bool = True, namespaces: bool = True) -> SandboxResult:
    """Runs `code` as `python -I -S -c code` would, bounded (docs/sandbox.md). Never raises for what the
    code does; raises ValueError/TypeError for bad arguments. `max_dir_mb` bounds the working
    directory's total size (as root); `site_packages=True` lets the code import this environment's
    installed packages (sympy, numpy; read-only); `warm=False` starts a fresh interpreter for this run;
    `namespaces=False` runs without namespaces even where they work (weaker: docs/sandbox.md). As root,
    a run waits up to UID_WAIT_S for a uid of its own while every slot is held; past it the result's
    `error` says "not run: ..." (no exit status, not timed out)."""
    _check_args(code, timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_dir_mb)
    claim, start_s = None, time.monotonic()
    if os.geteuid() == 0:
        while (claim := _claim_uid()) is None and time.monotonic() < start_s + UID_WAIT_S:
            time.sleep(UID_POLL_S)
        if claim is None:
            return _no_uid(start_s)
    run = _Run(code, timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_dir_mb, network, warm,
               site_packages, namespaces, claim)
    ready = selectors.DefaultSelector()
    try:
        run.start()
        for fd in run.open_fds:
            ready.register(fd, selectors.EVENT_READ)
        while (wake := run.next_wake()) is not None:
            for key, _ in ready.select(max(wake - time.monotonic(), 0)):
                if not run.read(key.fd):
                    ready.unregister(key.fd)
        return run.result()
    finally:
        ready.close()
        run.cleanup()


async def arun_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 65536,
                      max_processes: int = 16, max_file_mb: int = 16, network: bool = False, max_dir_mb: int = 64,
                      site_packages: bool = False, warm: bool = True, namespaces: bool = True) -> SandboxResult:
    """run_python on the event loop: the pipes are watched by the loop, nothing blocks it but the few
    milliseconds of starting the run. Cancelling the awaiting task kills the run."""
    import asyncio
    loop = asyncio.get_running_loop()
    if warm and not (_server["owner_pid"] == os.getpid() and _server["process"].poll() is None):
        await asyncio.to_thread(_server_socket)  # the first call starts the warm interpreter (~50 ms)
    _check_args(code, timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_dir_mb)
    claim, start_s = None, time.monotonic()
    if os.geteuid() == 0:
        while (claim := _claim_uid()) is None and time.monotonic() < start_s + UID_WAIT_S:
            await asyncio.sleep(UID_POLL_S)
        if claim is None:
            return _no_uid(start_s)
    run = _Run(code, timeout_s, memory_mb, max_output_bytes, max_processes, max_file_mb, max_dir_mb, network, warm,
               site_packages, namespaces, claim)
    woken = asyncio.Event()
    watched = set()

    def on_readable(fd):
        if not run.read(fd):
            loop.remove_reader(fd)
            watched.discard(fd)
        woken.set()
    try:
        run.start()
        for fd in list(run.open_fds):
            loop.add_reader(fd, on_readable, fd)
            watched.add(fd)
        while (wake := run.next_wake()) is not None:
            woken.clear()
            try:
                await asyncio.wait_for(woken.wait(), max(wake - time.monotonic(), 0))
            except asyncio.TimeoutError:
                pass
        return run.result()
    finally:
        for fd in watched:
            loop.remove_reader(fd)
        run.cleanup()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--server":
        user_code = _serve(int(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--one":
        one_request = json.loads(sys.argv[2])
        user_code = _run_child(one_request, one_request["fds"])
    else:
        raise SystemExit(f"usage: python -I -S {__file__} --server FD | --one REQUEST_JSON (lib.sandbox starts these)")
    _exec_user_code(user_code)
