"""The first code a sandboxed execution runs (trusted; standard library only).

`tiderl.envs.code.sandbox` starts it as `python -E -s -c <this file's text> <json spec>`, already
as the execution's unprivileged user when the caller is root. It tightens the process before
the untrusted program starts, and fails closed: when a step the spec asks for does not work it
prints `SETUP_FAILED` and the reason to stderr and exits with `SETUP_EXIT` without running
anything.

Steps, in order:
1. resource limits (core files off, CPU seconds, address space, file size, open files,
   processes) and no_new_privs (a setuid binary gains nothing);
2. with `namespaces`: new user, mount, network, PID and IPC namespaces (the user keeps its own
   uid inside), then a fork so that the program is PID 1 of the new PID namespace; when PID 1
   ends the kernel kills every process left in it, and the child dies with this process
   (parent-death signal);
3. with `readonly`: every mount read-only (`mount_setattr`, recursive) except a bind mount of
   the working directory; fresh size-limited tmpfs over /tmp, /var/tmp and /dev/shm, and a
   fresh /proc of the new PID namespace (so the caller's processes are not visible);
4. chdir to the working directory and exec the program with the given clean environment.
"""

import ctypes
import json
import os
import resource
import signal
import sys

SETUP_EXIT = 125
SETUP_FAILED = "tiderl-sandbox: setup failed:"

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
CLONE_NEWNET, CLONE_NEWIPC = 0x40000000, 0x08000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(why):
    sys.stderr.write(f"{SETUP_FAILED} {why}\n")
    sys.stderr.flush()
    os._exit(SETUP_EXIT)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        _fail(f"{what}: {os.strerror(err)} (errno {err})")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _mount(source, target, fstype, flags, data):
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), f"mount {target}")


def _mount_setattr(path, flags, attr_set, attr_clr):
    attr = (ctypes.c_uint64 * 4)(attr_set, attr_clr, 0, 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), ctypes.c_uint(flags), ctypes.byref(attr),
                         ctypes.c_size_t(ctypes.sizeof(attr))), f"mount_setattr {path}")


def _limits(spec):
    for name, value in spec["rlimits"].items():
        which = getattr(resource, name)
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError) as exc:
            _fail(f"setrlimit {name}={value}: {exc}")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _enter_namespaces(uid, gid):
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC), "unshare")
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as exc:
        _fail(f"user namespace id maps: {exc}")


def _readonly_world(workdir, tmpfs_mb):
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    keep = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    _mount_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_mb}m,mode=1777")
    # The working directory may lie below a tmpfs just mounted: bind it back at its own path
    # (through the descriptor opened before), writable.
    os.makedirs(workdir, exist_ok=True)
    _mount(f"/proc/self/fd/{keep}", workdir, None, MS_BIND, None)
    _mount_setattr(workdir, 0, 0, MOUNT_ATTR_RDONLY)
    os.close(keep)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV, None)


def _wait_and_forward(child):
    """Wait for the program (PID 1 of the namespace) and exit as it did."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: (os.kill(child, signal.SIGKILL), os._exit(137)))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(SETUP_EXIT)
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def main():
    spec = json.loads(sys.argv[1])
    _limits(spec)
    if spec["namespaces"]:
        _enter_namespaces(os.getuid(), os.getgid())
        child = os.fork()
        if child:
            _wait_and_forward(child)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")
        if spec["readonly"]:
            _readonly_world(spec["workdir"], spec["tmpfs_mb"])
    os.chdir(spec["workdir"])
    argv = spec["argv"]
    try:
        os.execve(argv[0], argv, spec["env"])
    except OSError as exc:
        _fail(f"exec {argv[0]}: {exc}")


if __name__ == "__main__":
    main()
