"""Run untrusted Python in a contained subprocess: its own temp dir as cwd, time, memory, file-size and
process limits, no network, output captured and cut to a bound. Each layer is used where the OS allows it:

* an unprivileged user of its own (when we are root): a fresh uid per run, so the per-user process limit
  (RLIMIT_NPROC, which never binds root) counts this run's processes alone;
* pid, network and IPC namespaces (util-linux `unshare`): killing the namespace's first process kills every
  process in it, and the network has no interface but a loopback that is down;
* Landlock (Linux >= 5.13): writes only in the temp dir (and /dev/null), reads only of system directories,
  no TCP bind or connect (kernel ABI >= 4), no signals or abstract Unix sockets outside (ABI >= 6);
* rlimits on CPU seconds, address space, file size, processes and open files; a wall-clock timeout.

`containment()` says which are in force; the first `run` logs one line when any is missing. Running this file
is the launcher: it applies the limits to itself, drops to the run's user, forks the interpreter and waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import typing
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)
UID_BASE = 1 << 30  # run users are UID_BASE + n: far above the ids of real users and container ranges
NAMESPACES = ("--pid", "--net", "--ipc", "--fork", "--kill-child")
READ_ROOTS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/etc", "/dev")  # plus the interpreter's prefix
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class Limits:
    """Bounds of one run. Memory and CPU are per process: a run may hold `processes` of them."""

    timeout: float = 10.0
    """Wall-clock seconds before every process of the run is killed."""
    cpu_seconds: int = 5
    """CPU time of each process: SIGXCPU when it is spent, SIGKILL a second later."""
    memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS)."""
    file_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE)."""
    processes: int = 16
    """Processes and threads of the run's user (RLIMIT_NPROC); binds only when the run has a user of its own."""
    open_files: int = 64
    """File descriptors of each process (RLIMIT_NOFILE)."""
    output_bytes: int = 8192
    """Bytes kept of stdout and of stderr each: the first and the last half, the middle cut."""


@dataclass
class Output:
    stdout: str
    stderr: str
    returncode: int | None
    """The exit status (128 + N: killed by signal N, as in a shell), or None when the wall timeout struck."""

    def text(self) -> str:
        """The output as a tool observation: stdout, then stderr, then how the run ended."""
        code, signals = self.returncode, {s.value: s.name for s in signal.Signals}
        status = "timed out" if code is None else f"exit status {code}" + (
            f" (killed by {signals[code - 128]})" if code - 128 in signals else "")
        return "".join(s if s.endswith("\n") or not s else s + "\n" for s in (self.stdout, self.stderr)) + status


@dataclass(frozen=True)
class Containment:
    """What the OS allows here, found once per process (see `containment`)."""

    own_user: bool
    namespaces: tuple[str, ...]
    """The `unshare ...` prefix of the command, or () without namespaces."""
    landlock_abi: int
    python: str
    """An interpreter the run's user can execute (this one, else the system's)."""
    read_roots: tuple[str, ...]
    problem: str = ""
    """Why no interpreter could run contained; non-empty means `run` refuses."""

    def describe(self) -> str:
        have = [("own user per run" if self.own_user else "no user of its own (not root): no process limit, "
                 "the run may write wherever this user can (except under Landlock)"),
                ("pid+net+ipc namespaces" if self.namespaces else "no namespaces (unshare failed): the network is "
                 "open but for TCP under Landlock ABI>=4" + ("" if self.own_user else
                                                             ", processes that leave the group outlive the run")),
                (f"Landlock ABI {self.landlock_abi}" if self.landlock_abi else "no Landlock: reads and writes "
                 "bounded by file permissions only")]
        return f"sandbox: {'; '.join(have)}; rlimits and wall timeout; python {self.python}"

    @property
    def complete(self) -> bool:
        return self.own_user and bool(self.namespaces) and self.landlock_abi >= 6


_uid_counter = itertools.count()
_found: list[Containment] = []
_finding = threading.Lock()


def containment() -> Containment:
    """Probe once (blocking, ~0.3 s): root, `unshare`, Landlock, and which interpreter runs contained."""
    with _finding:
        if not _found:
            _found.append(_probe())
            if not _found[0].complete or _found[0].problem:
                log.warning(_found[0].describe() + (f"; {_found[0].problem}" if _found[0].problem else ""))
        return _found[0]


def _probe() -> Containment:
    unshare = shutil.which("unshare")
    namespaces: tuple[str, ...] = ()
    if unshare:
        for extra in ((), ("--user", "--map-root-user")):  # a user namespace lets a non-root user unshare
            command = (unshare, *extra, *NAMESPACES)
            if subprocess.run([*command, "true"], capture_output=True).returncode == 0:
                namespaces = command
                break
    base = Containment(os.geteuid() == 0, namespaces, landlock_abi(), "", ())
    problems = []
    for python in dict.fromkeys([os.path.realpath(sys.executable), shutil.which("python3", path=ENV["PATH"])]):
        if not python:
            continue
        prefix = os.path.dirname(os.path.dirname(python))
        found = replace(base, python=python, read_roots=tuple(dict.fromkeys((*READ_ROOTS, prefix))))
        command, workdir, _ = _prepare(found, Limits(), "import sys")
        try:
            probe = subprocess.run(command, capture_output=True, timeout=30, env=ENV, stdin=subprocess.DEVNULL)
            if probe.returncode == 0:
                return found
            problems.append(f"{python}: {probe.stderr.decode(errors='replace').strip()[-300:]}")
        except subprocess.TimeoutExpired:
            problems.append(f"{python}: no answer in 30 s")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return replace(base, problem="no interpreter runs contained: " + " | ".join(problems))


def run_uids() -> range:
    """The users this process gives its runs, in turn: a block of its own (unless process ids collide mod 65536)."""
    start = UID_BASE + (os.getpid() % 65536) * 4096
    return range(start, start + 4096)


def _prepare(found: Containment, limits: Limits, code: str) -> tuple[list[str], str, int | None]:
    """The launcher's command line, the run's temp dir holding `main.py`, and the run's user (None: ours)."""
    workdir = tempfile.mkdtemp(prefix="instar-sandbox-")
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(code)
    # CPU: SIGXCPU at the limit (a program may report it), SIGKILL a second later
    rlimits = {"RLIMIT_CPU": (limits.cpu_seconds, limits.cpu_seconds + 1)}
    for name, value in (("RLIMIT_AS", limits.memory_mb << 20), ("RLIMIT_FSIZE", limits.file_mb << 20),
                        ("RLIMIT_NOFILE", limits.open_files), ("RLIMIT_CORE", 0)):
        rlimits[name] = (value, value)
    uid = None
    if found.own_user:
        uids = run_uids()
        uid = uids[next(_uid_counter) % len(uids)]
        rlimits["RLIMIT_NPROC"] = (limits.processes, limits.processes)
        for path in (workdir, os.path.join(workdir, "main.py")):
            os.chown(path, uid, uid)
    spec = {"uid": uid, "cwd": workdir, "landlock_abi": found.landlock_abi, "read_roots": found.read_roots,
            "rlimits": rlimits, "argv": [found.python, "-I", "-S", "-B", "main.py"],
            "env": {**ENV, "HOME": workdir, "TMPDIR": workdir}}
    return [*found.namespaces, *_launcher(spec)], workdir, uid


def _launcher(spec: dict) -> list[str]:
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(spec)]


async def run(code: str, limits: Limits = Limits(), stdin: str = "") -> Output:
    """Run ``code`` as a Python program in the sandbox, without blocking the event loop."""
    found = await asyncio.to_thread(containment)
    if found.problem:
        raise RuntimeError(f"the code sandbox cannot run here: {found.problem}")
    command, workdir, uid = await asyncio.to_thread(_prepare, found, limits, code)
    # Files, not pipes: a process that outlives the run cannot hold it open, and the file-size limit bounds them.
    with tempfile.TemporaryFile() as given, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        given.write(stdin.encode())
        given.seek(0)
        try:
            proc = await asyncio.create_subprocess_exec(*command, stdin=given, stdout=out, stderr=err,
                                                        start_new_session=True, env=ENV)
            try:
                returncode = await asyncio.wait_for(proc.wait(), limits.timeout)
            except TimeoutError:
                returncode = None
                # The launcher kills every process of the run and exits; `unshare` holds the signal until it
                # has reaped the launcher (killed outright, the launcher would wait as a zombie for the host's init).
                _signal_group(proc.pid, signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 2.0)
            finally:
                _signal_group(proc.pid, signal.SIGKILL)  # what is left: without namespaces, the rest of the group
                await proc.wait()
                if uid is not None and not found.namespaces:  # and the processes that left the group
                    await (await asyncio.create_subprocess_exec(*_launcher({"kill_uid": uid}), env=ENV)).wait()
        finally:
            await asyncio.to_thread(shutil.rmtree, workdir, True)
        stdout, stderr = await asyncio.to_thread(lambda: [_kept(f, limits.output_bytes) for f in (out, err)])
    return Output(stdout, stderr, returncode)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _kept(file: typing.BinaryIO, limit: int) -> str:
    """A file's text, or its first and last ``limit // 2`` bytes with the size of the cut between them."""
    size, half = file.seek(0, os.SEEK_END), limit // 2
    file.seek(0)
    if size <= 2 * half:
        return file.read().decode(errors="replace")
    head = file.read(half)
    file.seek(size - half)
    return (head + f"\n[... {size - 2 * half} bytes cut ...]\n".encode() + file.read(half)).decode(errors="replace")


# Landlock (linux/landlock.h): the syscalls are numbered alike on every architecture.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF, _PATH_BENEATH = 444, 445, 446, 1
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR, _TRUNCATE = 1, 2, 4, 8, 1 << 14
_READ = _EXECUTE | _READ_FILE | _READ_DIR
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (or it is turned off)."""
    return max(_libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)), 0)


def _check(value: int, what: str) -> int:
    if value < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return value


def _landlock(abi: int, workdir: str, read_roots: list[str]) -> int:
    """A ruleset: read and execute under ``read_roots``, read and write under ``workdir``, write /dev/null."""
    write = _WRITE_FILE | sum(1 << bit for bit in range(4, 13))  # remove and make files, dirs, links...
    write |= (1 << 13 if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)  # refer (move between dirs), truncate
    # net: TCP bind and connect (no rule allows either); scoped: signals and abstract Unix sockets
    attr = _RulesetAttr(fs=_READ | write, net=3 if abi >= 4 else 0, scoped=3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct as this ABI knows it
    ruleset = _check(_libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0), "landlock")
    rules = [(root, _READ) for root in read_roots] + [(workdir, _READ | write)]
    rules.append(("/dev/null", _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)))
    for path, allowed in rules:
        if not os.path.exists(path):
            continue
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            rule = _PathBeneath(allowed=allowed, parent_fd=fd)
            _check(_libc.syscall(_ADD_RULE, ruleset, _PATH_BENEATH, ctypes.byref(rule), 0), f"landlock {path}")
        finally:
            os.close(fd)
    return ruleset


def _end_run(signum: int, frame: object) -> None:
    """The wall timeout: kill every process of the run. As the namespace's init, kill(-1) reaches each process
    in the namespace and no other; without namespaces, the launcher's process group (itself included)."""
    with contextlib.suppress(ProcessLookupError):  # the group's signal may have ended them all already
        if os.getpid() == 1:
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(0, signal.SIGKILL)


def _launch(spec: dict) -> int:
    """In the child, as root: limits, the run's user, Landlock; then fork the interpreter on main.py and wait.
    This process is the pid namespace's init: the program under it gets ordinary signals (an init ignores
    SIGXCPU and everything it has no handler for), and when it ends the namespace ends with it."""
    signal.signal(signal.SIGTERM, _end_run)
    for name, (soft, hard) in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    ruleset = _landlock(spec["landlock_abi"], spec["cwd"], spec["read_roots"]) if spec["landlock_abi"] else -1
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    # Changing user cleared the parent-death signal `unshare --kill-child` set: set it again.
    _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
    if ruleset >= 0:
        _check(_libc.syscall(_RESTRICT_SELF, ruleset, 0), "landlock restrict")
        os.close(ruleset)
    os.chdir(spec["cwd"])
    child = os.fork()
    if child == 0:
        try:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except OSError as e:
            print(f"sandbox: cannot run {spec['argv'][0]}: {e}", file=sys.stderr)
        os._exit(127)
    while True:  # as init it also reaps the orphans the program leaves
        pid, status = os.wait()
        if pid == child:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _kill_user(uid: int) -> None:
    """As the run's user, kill every other process of that user (a run without namespaces leaves no other trace)."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    sys.exit(_kill_user(_spec["kill_uid"]) if "kill_uid" in _spec else _launch(_spec))
