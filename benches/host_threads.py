"""What the host's threads do while a benchmark runs: for every thread of the processes whose
command line contains ``--match`` (default ``ddp_step_time.py``, torchrun itself left out), its
CPU use over ``--seconds``, the CPU it ran on last, and how often it was switched out (voluntary:
it blocked or slept; involuntary: another thread took its CPU); and the machine's interrupts per
second of each kind (``/proc/interrupts``), those at 50 or more.

Linux only (``/proc``); it reads, never changes, anything. Threads inherit their creator's name,
so cfc's comm thread and NCCL's threads, made from the autograd thread, show as
``pt_autograd_N``. On the GPU machine, beside a run::

    torchrun --standalone --nproc_per_node=2 benches/ddp_step_time.py --sequential --steps 500 cfc &
    sleep 22; python3 benches/host_threads.py --seconds 2
"""

import argparse
import os
import time


def matching_pids(match: str) -> list:
    """The processes whose command line contains ``match``, less torchrun's and this one (whose
    own arguments may name the same script). ``thread_waits.py`` finds its processes here too."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        if match in cmd and "torchrun" not in cmd and int(pid) != os.getpid():
            out.append(pid)
    return out


def _threads(match: str) -> dict:
    """(pid, tid) -> (name, CPU ticks, last CPU, voluntary switches, involuntary switches)."""
    out = {}
    for pid in matching_pids(match):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # the process ended meanwhile
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{base}/stat") as f:
                    stat = f.read()
                with open(f"{base}/comm") as f:
                    name = f.read().strip()
                with open(f"{base}/status") as f:
                    status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # field 3 (state) onwards: 14, 15, 39 at 11, 12, 36
            out[(pid, tid)] = (name, int(fields[11]) + int(fields[12]), int(fields[36]),
                               int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
    return out


def _interrupts() -> dict:
    """Kind -> count summed over the CPUs."""
    out = {}
    with open("/proc/interrupts") as f:
        lines = f.read().splitlines()[1:]
    for line in lines:
        kind, _, rest = line.partition(":")
        total = 0
        for x in rest.split():
            if not x.isdigit():
                break
            total += int(x)
        out[kind.strip()] = total
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--match", default="ddp_step_time.py", help="a piece of the processes' command line")
    p.add_argument("--seconds", type=float, default=2.0, help="how long to sample")
    p.add_argument("--min-cpu", type=float, default=5.0, help="leave out threads below this CPU %%")
    args = p.parse_args()
    irq0, t0 = _interrupts(), _threads(args.match)
    time.sleep(args.seconds)
    t1, irq1 = _threads(args.match), _interrupts()
    hz, dt = os.sysconf("SC_CLK_TCK"), args.seconds
    rows = []
    for key, (name, ticks, cpu, vol, invol) in t1.items():
        if key in t0:
            busy = 100.0 * (ticks - t0[key][1]) / hz / dt
            if busy >= args.min_cpu:
                rows.append((busy, key, name, cpu, (vol - t0[key][3]) / dt, (invol - t0[key][4]) / dt))
    print("| CPU % | pid | tid | name | last CPU | voluntary switches/s | involuntary switches/s |")
    print("|---|---|---|---|---|---|---|")
    for busy, (pid, tid), name, cpu, vol, invol in sorted(rows, reverse=True):
        print(f"| {busy:.0f} | {pid} | {tid} | {name} | {cpu} | {vol:.0f} | {invol:.0f} |")
    rates = {k: (irq1[k] - irq0.get(k, 0)) / dt for k in irq1}
    print("interrupts/s: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items() if v >= 50))


if __name__ == "__main__":
    main()
