"""The core fault kinds (CONTRACT.md, "Injectors"): process faults, save-path fault points
and storage faults. Each injector `inject(job) -> str | None` acts now (details drawn from
job.rnd), schedules what must happen later on the job (job.later, job.relaunch_when_down)
and returns a one-line detail, or None when it cannot act right now. None of them waits
for recovery; fault_point and the store faults wait (bounded) for the armed fault to fire.
"""
import os
import signal
import time

# the save-path points of CKPT_FAULT_DIR (ckpt/ckpt_internal.h) and what each needs
POINTS = {
    "before-chunk-write": set(), "mid-chunk": set(), "mid-data": set(),
    "after-data-fsync": set(), "after-part": {"multi_rank"}, "after-manifest": set(),
    "after-rename": set(), "during-retention": {"retention"}, "mid-upload": {"s3"},
    "mid-mem-copy": set(),
}
FIRE_TIMEOUT = 8.0
LAYOUTS = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)]   # (nodes, ranks per node): W 1, 2, 4


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _all_workers(job):
    return [(n, w) for n in job.live_nodes() if not n.stopped for w in n.workers()]


def _running(job):
    """The job trains right now: every node of the group up, not stopped, ranks running."""
    job.poll()
    live = job.live_nodes()
    members = [n for n in job.nodes if n.expected is None]
    return (job.relaunch is None and live and len(live) == len(members) and
            not any(n.stopped for n in live) and all(n.workers() for n in live))


def _signal_random_worker(job, sig):
    """(node, pid) of a random live worker that got `sig`, or None."""
    if not _running(job):
        return None
    ws = _all_workers(job)
    if not ws:
        return None
    n, pid = job.rnd.choice(ws)
    return (n, pid) if _signal(pid, sig) else None


def kill_rank(job):
    got = _signal_random_worker(job, signal.SIGKILL)
    if not got:
        return None
    n, pid = got
    return f"SIGKILL rank pid {pid} of node {n.index}"


def kill_ranks(job):
    if not _running(job):
        return None
    ws = _all_workers(job)
    if len(ws) < 2:
        return None
    k = job.rnd.randint(2, min(3, len(ws)))
    victims = job.rnd.sample(ws, k)
    done = [f"{pid}@node{n.index}" for n, pid in victims if _signal(pid, signal.SIGKILL)]
    return f"SIGKILL {len(done)} ranks at once: {' '.join(done)}" if done else None


def kill_agent(job):
    """SIGKILL a non-store-host agent; the others go on smaller; a replacement joins later."""
    if not _running(job):
        return None
    cand = [n for n in job.live_nodes() if not n.store_host]
    if not cand:
        return None
    n = job.rnd.choice(cand)
    n.expected = "SIGKILLed by kill_agent"
    job.kill_node(n, signal.SIGKILL)
    delay = job.rnd.uniform(3.0, 6.0)

    def replace():
        job.add_node()
        job.set_marker(True)
    job.later(delay, replace, "replace the killed agent")
    return f"SIGKILL agent {n}; a replacement joins after {delay:.1f} s"


def kill_store_host(job):
    """SIGKILL node 0's agent: the others must exit 1 at once; relaunch the whole job."""
    if not _running(job):
        return None
    n = job.store_host()
    if n is None or not n.alive():
        return None
    n.expected = "SIGKILLed by kill_store_host"
    job.kill_node(n, signal.SIGKILL)
    job.relaunch_when_down(job.layout, "store host killed", timeout=20.0)
    return f"SIGKILL store host {n} ({len(job.nodes)} node(s)); relaunch with --resume auto"


def stop_rank(job):
    """SIGSTOP a worker: the hang watchdog (--hang-timeout) must restart the group."""
    got = _signal_random_worker(job, signal.SIGSTOP)
    if not got:
        return None
    n, pid = got
    job.hang_watch = (n, pid, time.monotonic())
    return f"SIGSTOP rank pid {pid} of node {n.index} (hang timeout {job.hang_timeout:g} s)"


def stop_agent(job):
    """SIGSTOP an agent for a random while, then SIGCONT. Stopped longer than the heartbeat
    timeout (2 s) on a job of two nodes, the others go on without it; what it does after the
    SIGCONT is observed (job._node_exited replaces an agent that exits)."""
    if not _running(job):
        return None
    n = job.rnd.choice(job.live_nodes())
    secs = job.rnd.uniform(0.5, 4.0)
    if not _signal(n.proc.pid, signal.SIGSTOP):
        return None
    n.stopped = True

    def cont():
        n.stopped = False
        n.was_stopped = True
        _signal(n.proc.pid, signal.SIGCONT)
        job.set_marker(False)
    job.later(secs, cont, f"SIGCONT {n}")
    return f"SIGSTOP agent {n} for {secs:.1f} s"


def _arm(job, name, timeout=FIRE_TIMEOUT):
    """Touch fault_dir/name and wait until a process took it; None when it did not fire (the
    file is removed again)."""
    path = os.path.join(job.fault_dir, name)
    with open(path, "w"):
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(path):
            return True
        job.poll()
        if job.ended():
            break
        time.sleep(0.02)
    try:
        os.unlink(path)
        return False
    except FileNotFoundError:
        return True   # taken at the last moment


def fault_point(job):
    if not _running(job):
        return None
    have = {"retention"} if job.keep_last else set()
    if job.s3:
        have.add("s3")
    if job.layout[0] * job.layout[1] > 1:
        have.add("multi_rank")
    pts = sorted(p for p, need in POINTS.items() if need <= have)
    p = job.rnd.choice(pts)
    if not _arm(job, p):
        return None
    return f"point {p} fired"


def _store(job, name):
    if not _running(job):
        return None
    if not _arm(job, name):
        return None
    return f"{name} fired on the next data write (that snapshot must not commit)"


def store_enospc(job):
    return _store(job, "store-enospc")


def store_eio(job):
    return _store(job, "store-eio")


def disk_full(job):
    """Fill the snapshot folder's tmpfs with a filler for a few seconds."""
    if not _running(job) or not job.tmpfs:
        return None
    filler = os.path.join(job.tmpfs, "chaos-filler")
    if os.path.exists(filler):
        return None
    written = 0
    try:
        with open(filler, "wb") as f:
            block = b"\0" * (1 << 20)
            while True:
                f.write(block)
                f.flush()
                written += len(block)
    except OSError:
        pass
    secs = job.rnd.uniform(1.0, 3.0)

    def remove():
        try:
            os.unlink(filler)
        except FileNotFoundError:
            pass
    job.later(secs, remove, "remove the filler")
    return f"filled the snapshot tmpfs ({written >> 20} MiB filler) for {secs:.1f} s"


def world_size_change(job):
    """Stop the job (SIGTERM preemption or SIGKILL of every agent) and relaunch it with
    another world size."""
    if not _running(job):
        return None
    w = job.layout[0] * job.layout[1]
    choices = [lo for lo in LAYOUTS if lo[0] * lo[1] != w]
    if getattr(job, "keep_two_nodes", False) and job.layout[0] >= 2:
        choices = [lo for lo in choices if lo[0] >= 2] or choices  # see chaos.py
    layout = job.rnd.choice(choices)
    how = job.rnd.choice(["SIGTERM", "SIGKILL"])
    for n in job.live_nodes():
        n.expected = f"{how} by world_size_change"
        job.kill_node(n, signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
    job.relaunch_when_down(layout, f"world_size_change ({how})", timeout=45.0)
    old = f"{job.layout[0]}x{job.layout[1]}"
    return f"{how} every agent; relaunch {old} -> {layout[0]}x{layout[1]} (W {w} -> {layout[0] * layout[1]})"


KINDS = {
    "kill_rank": kill_rank,
    "kill_ranks": kill_ranks,
    "kill_agent": kill_agent,
    "kill_store_host": kill_store_host,
    "stop_rank": stop_rank,
    "stop_agent": stop_agent,
    "fault_point": fault_point,
    "store_enospc": store_enospc,
    "store_eio": store_eio,
    "disk_full": disk_full,
    "world_size_change": world_size_change,
}
NEEDS = {
    "kill_rank": set(), "kill_ranks": set(), "kill_agent": {"two_nodes"},
    "kill_store_host": set(), "stop_rank": set(), "stop_agent": set(), "fault_point": set(),
    "store_enospc": set(), "store_eio": set(), "disk_full": {"tmpfs"},
    "world_size_change": set(),
}
