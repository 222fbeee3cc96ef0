"""The code recipe's sandbox (examples/code/sandbox.py): each way out is contained, and a normal program runs
after it. The containment tests need what CI has (root, util-linux `unshare`, Landlock ABI >= 6); elsewhere
they skip, naming what is missing."""

import asyncio
import dataclasses
import importlib.util
import os
import socket
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAME = "instar_code_sandbox"  # the name examples/code/task.py loads it under: one copy per process
if NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(NAME, ROOT / "examples/code/sandbox.py")
    sys.modules[NAME] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[NAME])
sandbox = sys.modules[NAME]
SMALL = sandbox.Limits(timeout=3.0, cpu_seconds=1, memory_mb=256, file_mb=1, processes=8, output_bytes=2000)


def run(code: str, **changes) -> "sandbox.Output":
    return asyncio.run(sandbox.run(code, dataclasses.replace(SMALL, **changes)))


def assert_still_runs() -> None:
    assert run("print(6 * 7)") == sandbox.Output("42\n", "", 0)


def run_processes(zombies: bool = True) -> list[int]:
    """Pids of the processes of this test process's sandbox runs (their users), read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text() if entry.isdigit() else ""
        except OSError:  # it ended while we looked
            continue
        uid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:")), -1)
        if uid in sandbox.run_uids() and (zombies or "State:\tZ" not in status):
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def contained():
    found = sandbox.containment()
    if not found.complete:
        pytest.skip(f"needs root, unshare and Landlock ABI >= 6: {found.describe()}")
    return found


def test_output_text_says_how_the_run_ended():
    assert sandbox.Output("a\n", "b", 0).text() == "a\nb\nexit status 0"
    assert sandbox.Output("", "", 152).text() == "exit status 152 (killed by SIGXCPU)"
    assert sandbox.Output("x", "", None).text() == "x\ntimed out"


def test_a_program_runs_in_a_temp_dir_of_its_own_and_its_output_is_cut(contained):
    out = run("import os, sys\nopen('f', 'w').write('kept')\nprint(open('f').read(), os.getuid(), "
              "os.getpid(), os.getcwd())\nsys.stderr.write('x' * 5000 + '\\n')", output_bytes=200)
    kept, uid, pid, cwd = out.stdout.split()
    # its own user, under the namespace's init (the launcher, pid 1), in a temp dir removed afterwards
    assert (kept, int(uid) in sandbox.run_uids(), pid, out.returncode) == ("kept", True, "2", 0)
    assert cwd.startswith("/") and "instar-sandbox-" in cwd and not os.path.exists(cwd)
    assert out.stderr == "x" * 100 + "\n[... 4801 bytes cut ...]\n" + "x" * 99 + "\n"  # the first and last 100 bytes


def test_an_endless_loop_stops_at_the_cpu_limit(contained):
    start = time.monotonic()
    out = run("while True:\n    pass", timeout=20.0)
    assert out.returncode == 128 + 24  # SIGXCPU, long before the wall timeout
    assert time.monotonic() - start < 10
    assert_still_runs()


def test_a_sleeping_program_stops_at_the_wall_timeout(contained):
    start = time.monotonic()
    out = run("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout=1.0)
    assert (out.stdout, out.returncode) == ("started\n", None)
    assert time.monotonic() - start < 3
    assert_still_runs()


def test_a_fork_bomb_is_capped_killed_whole_and_never_blocks_the_event_loop(contained):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"

    async def watch() -> tuple["sandbox.Output", int, float]:
        task = asyncio.create_task(sandbox.run(bomb, dataclasses.replace(SMALL, timeout=2.0)))
        most, worst_lag = 0, 0.0  # the run's processes at most at once; the event loop's longest stall
        while not task.done():
            tick = time.monotonic()
            await asyncio.sleep(0.05)
            worst_lag = max(worst_lag, time.monotonic() - tick - 0.05)
            most = max(most, len(set(run_processes()) - before))
        return task.result(), most, worst_lag

    before = set(run_processes())  # none, unless another run left some
    out, most, worst_lag = asyncio.run(watch())
    assert out.returncode is None  # it ran to the wall timeout
    assert 4 <= most <= SMALL.processes  # it forked, up to the limit (the launcher counts too)
    assert worst_lag < 1.0  # the event loop kept turning
    assert set(run_processes()) <= before  # every one of its processes is gone, none waits as a zombie
    assert_still_runs()


def test_without_namespaces_a_process_that_leaves_the_group_is_still_killed(contained, monkeypatch):
    """Where `unshare` fails (a container without CAP_SYS_ADMIN), the run's own user is swept instead."""
    monkeypatch.setattr(sandbox, "containment", lambda: dataclasses.replace(contained, namespaces=()))
    before = set(run_processes(zombies=False))
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('left')"
    assert run(escape) == sandbox.Output("left\n", "", 0)
    assert set(run_processes(zombies=False)) <= before  # killed: its zombie waits for the host's init to reap it
    assert_still_runs()


def test_a_huge_allocation_fails_and_a_modest_one_works(contained):
    out = run("x = bytearray(64 << 20)\nprint(len(x) >> 20)\ny = bytearray(1 << 30)")
    assert out.stdout == "64\n" and out.returncode == 1 and out.stderr.rstrip().endswith("MemoryError")
    assert_still_runs()


def test_writes_outside_the_temp_dir_fail(contained):
    # /tmp and /dev/shm are writable by anyone: there only Landlock stands in the way
    targets = [f"/tmp/instar-sandbox-escape-{os.getpid()}", f"/dev/shm/instar-escape-{os.getpid()}",
               str(ROOT / "sandbox-escape.txt")]
    code = "".join(f"try:\n    open({t!r}, 'w')\n    print('wrote')\nexcept OSError as e:\n"
                   f"    print(type(e).__name__)\n" for t in targets)
    out = run(code)
    written = [t for t in targets if os.path.exists(t)]
    for path in written:  # a failing run leaves nothing behind either
        os.unlink(path)
    assert out.stdout == "PermissionError\n" * len(targets) and written == []
    out = run("open('big', 'wb').write(b'x' * (2 << 20))")  # beyond the file-size limit (1 MB)
    assert out.stderr.endswith("OSError: [Errno 27] File too large\n")  # Python ignores SIGXFSZ
    assert_still_runs()


def test_no_connection_reaches_a_listener_on_the_host(contained):
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        udp.bind(("127.0.0.1", 0))
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), timeout=2)\n"
                f"except OSError as e:\n    print(type(e).__name__)\n"
                f"try:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hi', "
                f"('127.0.0.1', {udp.getsockname()[1]}))\nexcept OSError as e:\n    print(e.strerror)")
        out = run(code)
        # TCP: Landlock refuses the connect; UDP (which Landlock leaves open): the namespace has no network
        assert out.stdout == "PermissionError\nNetwork is unreachable\n"
        tcp.setblocking(False)
        udp.setblocking(False)
        with pytest.raises(BlockingIOError):
            tcp.accept()
        with pytest.raises(BlockingIOError):
            udp.recv(16)
    assert_still_runs()
