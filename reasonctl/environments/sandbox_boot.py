"""Starts one confined Python run; executed as a script by :mod:`.sandbox` (stdlib only).

``python -I -B sandbox_boot.py`` with the JSON spec on stdin (a clean environment and no
inherited file descriptors, as :class:`~reasonctl.environments.sandbox.Sandbox` starts it):

1. With ``drop_to`` (the trainer runs as root) it builds the new root as root, in a
   mount namespace of its own, then switches to that unprivileged user and group for good
   (root is exempt from the process limit, and no code should run as root).
2. It unshares the user, PID, IPC and UTS namespaces, the network namespace (``network``
   false: no interface but a down loopback) and the mount namespace (``private_fs``),
   mapping its user to itself inside; without ``drop_to`` it builds the new root now.
   The new root (``private_fs``) is a small read-only tmpfs holding the interpreter and
   system libraries (read-only binds at their own paths), ``/dev/null``, ``/dev/zero``,
   ``/dev/random``, ``/dev/urandom`` and mountpoints.
3. It forks the namespace's first process, which dies with this one (parent-death signal)
   and starts a session of its own; it mounts a tmpfs of ``disk_mb`` as ``/sandbox``
   (also ``/tmp``: the only writable place) with the code and its files, and a ``/proc``
   of the new PID namespace, and changes root into the tree.
4. It sets the resource limits (CPU seconds, address space, processes, file size, open
   files, no core dumps), forbids gaining privileges, closes every other descriptor and
   forks the code: the interpreter on ``main.py`` with a fixed minimal environment, which
   starts without capabilities (a non-root user of its namespace). The first process
   reaps orphans until the code ends; when it exits, the kernel kills every process left
   in the namespace.

The starter waits and exits with the code's status (128 + the signal that killed it).
A setup step that fails exits with :data:`SETUP_FAILED` after printing ``sandbox setup
failed: ...`` on stderr, which the caller reports as the host's inability to confine.
"""

import ctypes
import errno
import json
import os
import resource
import signal
import sys

SETUP_FAILED = 125
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
# statvfs flags of a mount -> the mount flags a read-only remount must keep (locked flags)
KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
              (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
              (os.ST_RELATIME, MS_RELATIME))
DEVICES = ("null", "zero", "random", "urandom")
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_char_p]


def fail(message):
    os.write(2, f"sandbox setup failed: {message}\n".encode())
    os._exit(SETUP_FAILED)


def call(result, what):
    if result != 0:
        code = ctypes.get_errno()
        fail(f"{what}: {os.strerror(code)} (errno {errno.errorcode.get(code, code)})")


def mount(source, target, fstype, flags, data=None):
    call(libc.mount(source.encode() if source else None, target.encode(),
                    fstype.encode() if fstype else None, flags,
                    data.encode() if data else None),
         f"mount {source or ''} on {target} (flags {flags:#x})")


def write_file(path, text):
    try:
        with open(path, "w") as handle:
            handle.write(text)
    except OSError as exc:
        fail(f"writing {path}: {exc.strerror}")


def kept_flags(path):
    flags = os.statvfs(path).f_flag
    return sum(mount_flag for stat_flag, mount_flag in KEPT_FLAGS if flags & stat_flag)


def make_mountpoint(target, is_dir):
    os.makedirs(target if is_dir else os.path.dirname(target), exist_ok=True)
    if not is_dir and not os.path.exists(target):
        open(target, "w").close()


def bind_read_only(source, target):
    """Bind the directory or file ``source`` at ``target``, read-only."""
    make_mountpoint(target, os.path.isdir(source))
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None,
          MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | kept_flags(target))


def build_tree(spec):
    """The new root at ``spec["root"]`` in this (private) mount namespace: read-only
    binds, devices and mountpoints, the root itself read-only at the end."""
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for link, target in spec["links"]:  # /bin -> usr/bin on merged-/usr systems
        os.makedirs(os.path.dirname(root + link), exist_ok=True)
        os.symlink(target, root + link)
    for path in spec["read_only"]:
        bind_read_only(path, root + path)
    os.makedirs(root + "/sandbox")
    os.symlink("sandbox", root + "/tmp")
    os.makedirs(root + "/proc")
    os.makedirs(root + "/dev")
    for name in DEVICES:
        target = f"{root}/dev/{name}"
        make_mountpoint(target, False)
        mount(f"/dev/{name}", target, None, MS_BIND)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter_tree(spec):
    """In the namespace's first process: the private writable directory and ``/proc`` of
    the new PID namespace on the tree, then change root into it."""
    root = spec["root"]
    work = root + "/sandbox"
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk_mb']}m,mode=700")
    write_files(work, spec)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    call(libc.chroot(b"."), "chroot")
    os.chdir("/sandbox")


def write_files(directory, spec):
    for name, text in spec["files"].items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)


def limit(kind, value):
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError) as exc:
        fail(f"setting resource limit {kind} to {value}: {exc}")


def start_code(spec):
    """In the namespace's first process: confine, start the code in a child and wait."""
    # until setsid this process is in the starter's process group, which the caller kills
    # as a whole; from then on the parent-death signal takes it down with the starter
    call(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    os.setsid()
    if spec["private_fs"]:
        enter_tree(spec)
        home = "/sandbox"
    else:
        home = spec["work"]
        os.chdir(home)
        write_files(home, spec)
    cpu = max(1, int(spec["cpu_seconds"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    limit(resource.RLIMIT_AS, spec["memory_bytes"])
    limit(resource.RLIMIT_NPROC, spec["max_processes"])
    limit(resource.RLIMIT_FSIZE, spec["max_file_bytes"])
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_CORE, 0)
    call(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.closerange(3, 65536)
    # the code is not the namespace's init, so signals (the CPU limit's SIGXCPU included)
    # act on it as on any process; init reaps orphans until the code has ended
    code = os.fork()
    if code == 0:
        python = spec["python"]
        try:
            os.execve(python, [python, "-I", "-B", "main.py"],
                      {**ENVIRONMENT, "HOME": home, "TMPDIR": home})
        except OSError as exc:
            fail(f"starting {python}: {exc.strerror}")
    os._exit(wait_for(code))


def wait_for(child):
    """Reap processes until ``child`` has ended; its exit status (128 + the signal)."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            return SETUP_FAILED
        if pid == child:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)


def main():
    spec = json.loads(sys.stdin.buffer.read())
    null = os.open("/dev/null", os.O_RDONLY)  # the code reads no input
    os.dup2(null, 0)
    os.close(null)
    flags = CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if not spec["network"]:
        flags |= CLONE_NEWNET
    if spec["private_fs"]:
        flags |= CLONE_NEWNS
    if spec["drop_to"] is not None:  # root builds the tree, then runs nothing as root
        if spec["private_fs"]:
            call(libc.unshare(CLONE_NEWNS), "unshare (mount namespace)")
            build_tree(spec)
        uid, gid = spec["drop_to"]
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:
            fail(f"switching to user {uid}: {exc.strerror}")
        # changing user made /proc/self root's; this user must write its namespace maps
        call(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    uid, gid = os.getuid(), os.getgid()
    call(libc.unshare(flags), "unshare (are user namespaces enabled? see "
                              "/proc/sys/user/max_user_namespaces)")
    write_file("/proc/self/setgroups", "deny")
    write_file("/proc/self/uid_map", f"{uid} {uid} 1")
    write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    if spec["private_fs"] and spec["drop_to"] is None:
        build_tree(spec)
    child = os.fork()
    if child == 0:
        try:
            start_code(spec)
        except BaseException as exc:  # any surprise is a setup failure, never a live shell
            fail(f"{type(exc).__name__}: {exc}")
    os._exit(wait_for(child))

if __name__ == "__main__":
    main()
