"""The sandbox's guarantees, each tested with hostile code (docs/env_code.md, "The sandbox").

Every hostile program is bounded by construction (a fork loop of at most 200 forks, a memory
bomb of 1 GiB, loops under a wall-clock limit), so a broken guarantee fails its test without
harming the machine. A guarantee that needs a feature this machine lacks (`Sandbox.features`)
is skipped with the reason; the ones that need nothing always run.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import gather_watching
from tiderl.envs.code.sandbox import Limits, Sandbox, SandboxError, run_sync

FAST = Limits(cpu_s=2, wall_s=5, memory_mb=512, max_procs=16, max_output_bytes=10_000)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(FAST, concurrency=4)


def run(sandbox: Sandbox, code: str, **kw):
    return run_sync(sandbox.run_python(code, **kw))


def needs(sandbox: Sandbox, *any_of: str) -> None:
    if not any(sandbox.features[f] for f in any_of):
        pytest.skip(f"this machine gives the sandbox none of {any_of} (features: {sandbox.features})")


def test_runs_a_program_with_files_and_stdin(sandbox):
    r = run(sandbox, "import helper, sys\nprint(helper.X + int(sys.stdin.read()))\nsys.exit(3)",
            files={"helper.py": "X = 40"}, stdin="2")
    assert (r.status, r.exit_code, r.stdout) == ("error", 3, "42\n")
    ok = run(sandbox, "print('fine')")
    assert ok.ok and ok.stdout == "fine\n" and ok.exit_code == 0


def test_the_working_directory_is_fresh_and_removed(sandbox):
    first = run(sandbox, "import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())")
    second = run(sandbox, "import os\nprint(sorted(os.listdir('.')))")
    assert second.stdout.strip() == "['main.py']"
    assert not os.path.exists(first.stdout.strip())


def test_infinite_loop_is_stopped_by_the_cpu_limit(sandbox):
    # The loop ends by itself after 20 s, whatever the limits do, and then says so: a program the
    # limit stopped never prints "finished".
    r = run(sandbox, "import time\nend = time.time() + 20\nwhile time.time() < end:\n    pass\n"
                     "print('finished')", limits=Limits(cpu_s=1, wall_s=4))
    assert r.status in ("cpu_limit", "timeout") and not r.ok
    assert "finished" not in r.stdout


def test_sleeping_program_is_stopped_by_the_wall_clock_limit(sandbox):
    # Killed in its sleep: it printed what came before, never what comes after.
    r = run(sandbox, "import time\nprint('started', flush=True)\ntime.sleep(60)\nprint('woke')",
            limits=Limits(wall_s=1))
    assert r.status == "timeout" and r.exit_code is None and r.stdout == "started\n"


def test_memory_bomb_fails_inside_the_sandbox(sandbox):
    r = run(sandbox, "b = bytearray(1 << 30)\nprint('allocated')", limits=Limits(memory_mb=256))
    assert not r.ok and "allocated" not in r.stdout and "MemoryError" in r.stderr


def test_file_size_limit(sandbox):
    code = ("try:\n    open('big', 'wb').write(b'x' * (4 << 20))\nexcept OSError as e:\n    print('refused', e.errno)\n"
            "import os\nprint(os.path.getsize('big'))")
    r = run(sandbox, code, limits=Limits(file_size_mb=1))
    assert "refused" in r.stdout and int(r.stdout.split()[-1]) <= 1 << 20


def test_fork_bomb_is_capped_by_the_process_limit(sandbox):
    # At most 200 forks however the limits behave; each child sleeps so all of them count.
    code = ("import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        break\n    if pid == 0:\n        time.sleep(2)\n        os._exit(0)\n    n += 1\nprint(n, os.getuid())")
    r = run(sandbox, code)
    forks = int(r.stdout.split()[0])
    assert forks < FAST.max_procs, r.stdout


def test_background_processes_die_with_the_execution(sandbox):
    needs(sandbox, "own_uid", "namespaces")
    marker = f"tiderl-orphan-{uuid.uuid4().hex}"
    code = ("import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', '{marker}'], start_new_session=True)\n"
            "print('spawned')")
    r = run(sandbox, code)
    assert r.stdout == "spawned\n"
    time.sleep(0.2)
    survivors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    survivors.append(pid)
        except OSError:
            continue
    for pid in survivors:  # clean up before failing
        os.kill(int(pid), 9)
    assert not survivors


def test_writes_outside_the_directory_do_not_land(sandbox, tmp_path):
    needs(sandbox, "readonly")
    target = tmp_path / "escape.txt"
    name = f"tiderl-escape-{uuid.uuid4().hex}"
    code = ("import os\nfor p in [%r, '/tmp/%s', '../%s', os.path.expanduser('~/../%s')]:\n"
            "    try:\n        open(p, 'w').write('x')\n        print('wrote', p)\n"
            "    except OSError as e:\n        print('refused', p, e.errno)\n") % (str(target), name, name, name)
    run(sandbox, code)
    assert not target.exists()
    assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(os.path.join(os.getcwd(), "..", name))


def test_files_of_the_caller_cannot_be_changed(sandbox):
    needs(sandbox, "own_uid", "readonly")
    here = os.path.abspath(__file__)
    before = os.path.getmtime(here)
    r = run(sandbox, f"open({here!r}, 'a').write('# tampered')\nprint('tampered')")
    assert "tampered" not in r.stdout and os.path.getmtime(here) == before


def test_no_network(sandbox):
    needs(sandbox, "namespaces")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = ("import socket\nfor addr in [('127.0.0.1', %d), ('1.1.1.1', 80), ('localhost', %d)]:\n"
            "    try:\n        socket.create_connection(addr, timeout=1)\n        print('connected', addr)\n"
            "    except OSError as e:\n        print('refused', addr, e)\n") % (port, port)
    r = run(sandbox, code)
    assert "connected" not in r.stdout and r.stdout.count("refused") == 3
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()


def test_the_parent_environment_is_not_visible(sandbox, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("TIDERL_TEST_SECRET", secret)
    code = ("import os\nprint(dict(os.environ))\n"
            f"for p in ['/proc/{os.getpid()}/environ', '/proc/1/environ', '/proc/self/environ']:\n"
            "    try:\n        print(open(p, 'rb').read())\n    except OSError as e:\n        print('refused', p)\n")
    r = run(sandbox, code)
    assert "TIDERL_TEST_SECRET" not in r.stdout
    if sandbox.features["own_uid"] or sandbox.features["readonly"]:
        assert secret not in r.stdout  # also not through the caller's /proc/<pid>/environ
    else:
        assert secret not in r.stdout.splitlines()[0]


def test_the_parent_cannot_be_signalled(sandbox):
    needs(sandbox, "own_uid", "namespaces")
    bystander = subprocess.Popen(["sleep", "30"])  # a process of the caller's user
    try:
        # The caller gets signal 0 (a permission check that delivers nothing), so a broken
        # guarantee fails this test instead of killing the test run; the bystander gets SIGKILL.
        code = ("import os, signal\n"
                f"for pid, sig in [({os.getpid()}, 0), ({bystander.pid}, signal.SIGKILL)]:\n"
                "    try:\n        os.kill(pid, sig)\n        print('killed', pid)\n"
                "    except OSError as e:\n        print('refused', pid, e.errno)\n")
        r = run(sandbox, code)
        assert "killed" not in r.stdout and r.stdout.count("refused") == 2
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_huge_output_is_capped(sandbox):
    # 26 MB at most, whatever the cap does; the status shows the program was killed at the cap.
    r = run(sandbox, "import sys\nfor _ in range(400):\n    sys.stdout.write('x' * 65536)")
    assert r.status == "output_limit" and r.truncated and len(r.stdout) == FAST.max_output_bytes


def test_output_is_valid_text(sandbox):
    r = run(sandbox, "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe \\xed\\xa0\\x80 end')")
    assert r.stdout.startswith("ok ") and r.stdout.endswith(" end")
    r.stdout.encode("utf-8")  # no lone surrogates


@pytest.mark.slow
def test_executions_run_concurrently_without_blocking_the_loop():
    box = Sandbox(Limits(wall_s=5), concurrency=4)

    # 8 sleeps of 0.6 s, at most 4 at a time: a sampler on the event loop sees 4 running at
    # once (so the loop ran while they slept), never more.
    results, peak = asyncio.run(gather_watching(
        box, *(box.run_python("import time\ntime.sleep(0.6)") for _ in range(8))))
    assert all(r.ok for r in results)
    assert peak == 4


def test_a_loop_blocked_while_another_runs_executions_does_not_deadlock():
    """A held-out evaluation inside a training observer: the training loop blocks, with an
    execution of its own in flight, while a helper thread's loop runs executions on the same
    sandbox (one slot). Counted per sandbox, the helper waited forever for the blocked loop's slot."""
    box = Sandbox(Limits(wall_s=5), concurrency=1)

    async def training_loop():
        in_flight = asyncio.ensure_future(box.run_python("import time\ntime.sleep(0.3)\nprint(1)"))
        await asyncio.sleep(0.1)  # it holds the only slot
        with ThreadPoolExecutor(1) as pool:  # this loop blocks, as an observer's evaluation does
            evaluated = pool.submit(asyncio.run, asyncio.wait_for(box.run_python("print(2)"), 15)).result()
        return evaluated, await in_flight

    evaluated, trained = asyncio.run(training_loop())
    assert (evaluated.stdout, trained.stdout) == ("2\n", "1\n")


def test_required_features_are_checked():
    with pytest.raises(SandboxError, match="needs namespaces"):
        Sandbox(isolation="process", require=("namespaces",))
    with pytest.raises(ValueError, match="known features"):
        Sandbox(require=("magic",))
    with pytest.raises(ValueError, match="must be > 0"):
        Limits(cpu_s=0)


# Run in a fresh interpreter made a child subreaper, as a trainer running as PID 1 is: every
# orphan of the execution comes back to it, and nothing but the sandbox would collect it.
_REAPER_SCRIPT = r"""
import ctypes, json, os, sys, time
from tiderl.envs.code.sandbox import Limits, Sandbox, run_sync
PR_SET_CHILD_SUBREAPER = 36
assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
code = ("import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.fork()\n"  # a grandchild too
        "        time.sleep(20)\n"
        "        os._exit(0)\n"
        "time.sleep(20)\n")
sandbox = Sandbox(Limits(cpu_s=5, wall_s=1, max_procs=32), concurrency=1, isolation=sys.argv[1])
result = run_sync(sandbox.run_python(code))

def children():
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            found[int(entry)] = fields[0].decode()
    return found

deadline = time.monotonic() + 1.0  # a short bound: a collected process is gone at once
while children() and time.monotonic() < deadline:
    time.sleep(0.02)
left = children()
for pid in left:  # clean up before reporting
    try:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except OSError:
        pass
print(json.dumps({"status": result.status, "left": left, "features": sandbox.features}))
"""


@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_a_timed_out_execution_leaves_no_zombie_under_a_pid1_like_parent(isolation):
    """After the wall-clock kill of a program that forked children and grandchildren, no process
    of it is left as a child of the caller (zombie or alive), even when the caller collects
    orphans (PID 1, or a child subreaper): the sandbox reaps what it killed."""
    import json
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _REAPER_SCRIPT, isolation], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == "timeout", report
    assert report["left"] == {}, report
