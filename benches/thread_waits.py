"""What each thread of a benchmark is waiting in, sampled: runs a command, and after ``--after``
seconds reads, about every millisecond for ``--seconds``, the system call each thread of the
processes whose command line contains ``--match`` is in (``/proc/<pid>/task/<tid>/syscall``).
For a ``futex`` (a lock or a condition variable), the mapping that holds its address says whose
lock it is: a library's data (``libcuda.so``, ``libpython``...), the heap, or anonymous memory.
With ``--callers N``, also the libraries of the first N return addresses on the waiting
thread's stack (read from ``/proc/<pid>/mem``): whose call is waiting for that lock.

Prints, per thread with at least ``--min-waits`` of its samples in a system call, the share of
samples running (not in a system call) and the most common waits. The command runs as a child
of this script (its standard output discarded), so that Linux lets it read the threads' system
calls (with ptrace restricted to descendants, as Ubuntu has it). On the GPU machine::

    python3 benches/thread_waits.py --after 22 -- env $SOCK torchrun --standalone \\
        --nproc_per_node=2 benches/ddp_step_time.py --sequential --steps 500 cfc
"""

import argparse
import bisect
import os
import struct
import subprocess
import sys
import time
from collections import Counter, defaultdict
from typing import List

from host_threads import matching_pids  # (benches/ is the script's folder, on sys.path)

# x86-64 system call numbers a waiting thread is usually in
_SYSCALLS = {0: "read", 1: "write", 7: "poll", 16: "ioctl", 23: "select", 24: "sched_yield", 35: "nanosleep",
             45: "recvfrom", 44: "sendto", 46: "sendmsg", 47: "recvmsg", 202: "futex", 230: "clock_nanosleep",
             232: "epoll_wait", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 441: "epoll_pwait2"}


def _maps(pid: str):
    """Sorted (start, end, name, executable) of the process's mappings."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            a, b = (int(x, 16) for x in parts[0].split("-"))
            name = parts[5].strip() if len(parts) > 5 else "[anonymous]"
            out.append((a, b, os.path.basename(name) if name.startswith("/") else name, "x" in parts[1]))
    out.sort()
    return out


def _where(maps, starts, addr: int) -> str:
    i = bisect.bisect_right(starts, addr) - 1
    if i >= 0 and maps[i][0] <= addr < maps[i][1]:
        return maps[i][2]
    return "?"


def _read_syscall(path: str):
    """(name, first argument, stack pointer) of the system call the thread is in, or
    ("running", None, None)."""
    with open(path) as f:
        fields = f.read().split()
    if not fields or fields[0] == "running" or fields[0] == "-1":
        return "running", None, None
    nr = int(fields[0])
    arg = int(fields[1], 16) if len(fields) > 1 else None
    sp = int(fields[-2], 16) if len(fields) >= 9 else None
    return _SYSCALLS.get(nr, f"syscall {nr}"), arg, sp


def _callers(mem_fd: int, sp: int, code, code_starts, depth: int, scan: int = 8192) -> str:
    """The libraries of the first ``depth`` return addresses found on a waiting thread's stack
    (words from its stack pointer up that point into executable mappings; the C library's
    own frames left out), innermost first: which library's call is waiting. A word that only
    looks like a return address can slip in; the innermost few are the telling ones."""
    try:
        raw = os.pread(mem_fd, scan, sp)
    except OSError:
        return ""
    seen: List[str] = []
    for (word,) in struct.iter_unpack("<Q", raw[: len(raw) // 8 * 8]):
        lib = _where(code, code_starts, word)
        if lib in ("?", "libc.so.6") or (seen and seen[-1] == lib):
            continue
        seen.append(lib)
        if len(seen) == depth:
            break
    return " < ".join(seen)


def sample(match: str, seconds: float, period: float, callers: int = 0):
    """{(pid, tid): (name, Counter of waits, samples)}. ``callers``: name the libraries of that
    many return addresses on the stack of a thread waiting on a futex (:func:`_callers`)."""
    pids = matching_pids(match)
    maps = {pid: _maps(pid) for pid in pids}
    starts = {pid: [m[0] for m in maps[pid]] for pid in pids}
    code = {pid: [m for m in maps[pid] if m[3]] for pid in pids} if callers else {}
    code_starts = {pid: [m[0] for m in code[pid]] for pid in code}
    mem = {}
    for pid in code:
        try:
            mem[pid] = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except OSError:  # not allowed: the waits are still counted, without their callers
            pass
    names, counts, totals = {}, defaultdict(Counter), Counter()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                base = f"/proc/{pid}/task/{tid}"
                try:
                    call, arg, sp = _read_syscall(f"{base}/syscall")
                    if (pid, tid) not in names:
                        with open(f"{base}/comm") as f:
                            names[(pid, tid)] = f.read().strip()
                except (OSError, ValueError):
                    continue
                if call == "futex" and arg is not None:
                    call = f"futex in {_where(maps[pid], starts[pid], arg)}"
                    if pid in mem and sp is not None:
                        via = _callers(mem[pid], sp, code[pid], code_starts[pid], callers)
                        call += f" (from {via})" if via else ""
                counts[(pid, tid)][call] += 1
                totals[(pid, tid)] += 1
        time.sleep(period)
    for fd in mem.values():
        os.close(fd)
    return {k: (names[k], counts[k], totals[k]) for k in totals}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--match", default="ddp_step_time.py", help="a piece of the processes' command line")
    p.add_argument("--after", type=float, default=20.0, help="seconds from the command's start to the sampling")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--period", type=float, default=0.001, help="seconds between rounds of samples")
    p.add_argument("--min-waits", type=float, default=0.05, help="leave out threads in a call less often")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--callers", type=int, default=0,
                   help="for a futex, the libraries of this many return addresses on the thread's stack")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = p.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL) if cmd else None
    try:
        time.sleep(args.after if child else 0)
        found = sample(args.match, args.seconds, args.period, args.callers)
    finally:
        if child is not None:
            child.wait()
    if not found:
        sys.exit(f"no readable thread of a process matching {args.match!r}")
    print("| pid | tid | name | samples | running | waits (share of samples) |")
    print("|---|---|---|---|---|---|")
    for (pid, tid), (name, c, n) in sorted(found.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
        waiting = n - c["running"]
        if waiting < args.min_waits * n:
            continue
        top = ", ".join(f"{k} {v / n:.0%}" for k, v in c.most_common() if k != "running")
        top = ", ".join(top.split(", ")[: args.top])
        print(f"| {pid} | {tid} | {name} | {n} | {c['running'] / n:.0%} | {top} |")


if __name__ == "__main__":
    main()
