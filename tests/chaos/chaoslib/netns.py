#!/usr/bin/env python3
"""Network partitions for the chaos suite (issue 14, CONTRACT.md "netns").

NetPair: two network namespaces joined by a veth pair, for one training job of two agents
(one per namespace) that talk only over that link. cut() takes one end of the link down
inside its namespace: no reset, no FIN, no ICMP reaches the other side; every peer there
looks alive and silent. heal() brings it back; TCP connections that were not given up
resume where they were.

Everything made here (namespaces, the veth, processes inside the namespaces) is removed by
close(), at interpreter exit (atexit) and when the driver gets SIGINT/SIGTERM.
"""
import atexit
import ipaddress
import os
import random
import signal
import subprocess
import threading
import time

_LIVE = []  # NetPair objects not yet closed
_LIVE_MU = threading.Lock()
_HANDLERS = {}  # signal -> the handler we replaced


def _ip(*args, ns=None, check=True, timeout=10):
    argv = ["ip"] + (["-n", ns] if ns else []) + list(args)
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def _namespaces():
    p = _ip("netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _used_subnets():
    """The /30 subnets held by the chaos namespaces of this machine (any driver's)."""
    out = set()
    for ns in _namespaces():
        if not ns.startswith("chaos-"):
            continue
        p = _ip("-4", "-o", "addr", "show", ns=ns, check=False)
        for line in p.stdout.splitlines():
            f = line.split()
            if "inet" in f:
                out.add(ipaddress.ip_interface(f[f.index("inet") + 1]).network)
    return out


def _cleanup_all():
    with _LIVE_MU:
        pairs = list(_LIVE)
    for p in pairs:
        p.close()


def _on_signal(sig, frame):
    _cleanup_all()
    prev = _HANDLERS.get(sig)
    if callable(prev):
        prev(sig, frame)
    elif sig == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        raise SystemExit(128 + sig)


def _install_handlers():
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still runs
    for sig in (signal.SIGINT, signal.SIGTERM):
        if sig in _HANDLERS:
            continue
        prev = signal.getsignal(sig)
        _HANDLERS[sig] = prev if prev not in (signal.SIG_DFL, signal.SIG_IGN, None,
                                               signal.default_int_handler) else None
        signal.signal(sig, _on_signal)


atexit.register(_cleanup_all)


class NetPair:
    """Two namespaces <name>-a and <name>-b (name = chaos-<pid>-<random>), veth devices
    dev[0] in a and dev[1] in b, addresses addr[0] and addr[1] of a private /30 unique among
    the chaos namespaces of this machine, lo up in both. Sides are 0 (a) and 1 (b)."""

    def __init__(self, rnd=None, prefix="chaos"):
        rnd = rnd or random.Random()
        tag = f"{os.getpid()}-{rnd.randrange(16 ** 6):06x}"
        self.name = f"{prefix}-{tag}"
        self.ns = (f"{self.name}-a", f"{self.name}-b")
        short = f"{rnd.randrange(16 ** 8):08x}"  # IFNAMSIZ: at most 15 characters
        self.dev = (f"cha{short}", f"chb{short}")
        self.closed = False
        self.cut_side = None
        used = _used_subnets()
        for _ in range(1000):  # 10.64.0.0/10 (shared address space) has 2^20 /30s
            net = ipaddress.ip_network((int(ipaddress.ip_address("100.64.0.0")) +
                                        4 * rnd.randrange(1 << 20), 30))
            if net not in used:
                break
        self.net = net
        hosts = list(net.hosts())
        self.addr = (str(hosts[0]), str(hosts[1]))
        with _LIVE_MU:
            _LIVE.append(self)
        _install_handlers()
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
                _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "add", self.dev[0], "netns", self.ns[0], "type", "veth", "peer", "name",
                self.dev[1], "netns", self.ns[1])
            for side in (0, 1):
                _ip("addr", "add", f"{self.addr[side]}/30", "dev", self.dev[side], ns=self.ns[side])
                _ip("link", "set", self.dev[side], "up", ns=self.ns[side])
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def argv(self, side, argv):
        """argv run inside namespace `side` (ip netns exec execs it: the pid is the program's)."""
        return ["ip", "netns", "exec", self.ns[side]] + list(argv)

    def popen(self, side, argv, **kw):
        return subprocess.Popen(self.argv(side, argv), **kw)

    def run(self, side, argv, timeout=30, **kw):
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        return subprocess.run(self.argv(side, argv), text=True, timeout=timeout, **kw)

    def cut(self, side=0):
        """Take the link down at `side`'s end: from then on nothing crosses, and neither side
        is told anything that a real switch failure would not tell it (no RST, no FIN)."""
        _ip("link", "set", self.dev[side], "down", ns=self.ns[side])
        self.cut_side = side

    def heal(self):
        if self.cut_side is None:
            return
        _ip("link", "set", self.dev[self.cut_side], "up", ns=self.ns[self.cut_side])
        # the connected route comes back with the address when the device is up again
        self.cut_side = None

    def link_up(self):
        """True when both ends report carrier (the link passes packets)."""
        for side in (0, 1):
            p = _ip("-o", "link", "show", self.dev[side], ns=self.ns[side], check=False)
            if "LOWER_UP" not in p.stdout or "NO-CARRIER" in p.stdout:
                return False
        return True

    def pids(self, side):
        """Processes living in namespace `side` (ip netns pids)."""
        p = _ip("netns", "pids", self.ns[side], check=False)
        return [int(x) for x in p.stdout.split() if x.isdigit()]

    def leftovers(self):
        """What of this pair still exists (namespaces, veth devices in the root namespace):
        empty after close()."""
        left = [ns for ns in _namespaces() if ns in self.ns]
        p = _ip("-o", "link", "show", check=False)
        left += [d for d in self.dev if f" {d}@" in p.stdout or f" {d}:" in p.stdout]
        return left

    def close(self, grace=5.0):
        """Kill whatever still runs in the namespaces (SIGKILL, by pid), then delete them; the
        veth goes with its namespace. Idempotent; bounded by about grace + a few seconds."""
        if self.closed:
            return
        self.closed = True
        existing = _namespaces()
        for ns, side in zip(self.ns, (0, 1)):
            if ns not in existing:
                continue
            deadline = time.time() + grace
            while True:
                pids = [p for p in self.pids(side) if p != os.getpid()]
                if not pids or time.time() > deadline:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                time.sleep(0.05)
            _ip("link", "del", self.dev[side], ns=ns, check=False)
            _ip("netns", "del", ns, check=False)
        with _LIVE_MU:
            if self in _LIVE:
                _LIVE.remove(self)


# ---------------------------------------------------------------------------------------------
# The partition scenario

import argparse  # noqa: E402
import calendar  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
if HERE not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))
try:
    from chaoslib.result import ScenarioResult
except ImportError:  # run as a file from elsewhere
    sys.path.insert(0, os.path.dirname(HERE))
    from chaoslib.result import ScenarioResult

# tiny model, 8 sequences a step as 4 micro-batches of 2: W = 1, 2, 4 give identical bits
MODEL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
         "--global-batch", "8", "--micro-batch", "2", "--lr", "3e-3", "--warmup", "2",
         "--seed", "11"]
HB = 2.0          # --heartbeat-timeout of the agents, seconds
STOP_GRACE = 2.0  # --stop-grace
PORT = 29400      # the store's port on node A's veth address (a namespace of our own)
FINAL_RE = re.compile(r"^\[rank 0\] final step=(\d+) loss=(\S+) val_loss=(\S+) "
                      r"params_digest=([0-9a-f]{32})$", re.M)
STEP_RE = re.compile(r"\[rank 0\] .*\[train\] (?:rank 0: )?step (\d+)/")  # W=1: no "rank 0: "
ROUND_RE = re.compile(r"round (\d+): started ranks (\d+)\.\.(\d+) of (\d+)")
TS_RE = re.compile(r"^(?:\[\S+ \d+\] |\[flush\] )?(\d\d):(\d\d):(\d\d\.\d+) ", re.M)


def _line_time(line, t_ref):
    """The wall-clock time of a log line (its HH:MM:SS.mmm, UTC like the logger), on the day
    of t_ref; None when the line has no time stamp."""
    m = TS_RE.match(line)
    if not m:
        return None
    day = calendar.timegm(time.gmtime(t_ref)[:3] + (0, 0, 0))
    t = day + int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    if t - t_ref > 43200:  # the line is from before midnight
        t -= 86400
    return t


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class Node:
    """One elastic agent = one node (CONTRACT.md, Job/Node), here in a namespace of its own."""

    def __init__(self, index, side, proc, log_path, out_path, netns):
        self.index, self.side, self.proc = index, side, proc
        self.log_path, self.out_path, self.netns = log_path, out_path, netns
        self.t_start = time.time()

    def alive(self):
        return self.proc.poll() is None

    def log(self):
        return _read(self.log_path)

    def out(self):
        return _read(self.out_path)

    def workers(self):
        """Live children of the agent that run train (its ranks; not the guardian or a flush)."""
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) != self.proc.pid or fields[0] == "Z":
                    continue
                with open(f"/proc/{name}/environ", "rb") as f:
                    if b"\0RANK=" not in b"\0" + f.read():
                        continue
                out.append(int(name))
            except (OSError, IndexError, ValueError):
                pass
        return out


class PartitionJob:
    """One training job of two nodes: A (side 0) hosts the store on its veth address, B (side 1)
    joins it. One snapshot folder for both (layout "shared", the default: sharded snapshots
    need one folder every rank sees) or one per node mounted at the same path (layout "local",
    as node-local disks are: train refuses it at start, exit 2 naming the folder) and a segment
    folder per node."""

    def __init__(self, ctx, work, net, nproc, steps, layout, log):
        self.ctx, self.work, self.net, self.nproc, self.steps = ctx, work, net, nproc, steps
        self.layout, self.say = layout, log
        self.t0 = time.time()
        self.build = os.path.abspath(ctx.build)
        self.train = os.path.join(self.build, "train")
        self.elastic = os.path.join(self.build, "elastic", "elastic")
        self.inspect = os.path.join(self.build, "ckpt-inspect")
        self.ckpt_dir = os.path.join(work, "ck")  # the path every rank is given
        self.node_ckpt = {0: os.path.join(work, "ck-a"), 1: os.path.join(work, "ck-b")}
        if layout == "shared":
            self.node_ckpt = {0: self.ckpt_dir, 1: self.ckpt_dir}
        for d in set(self.node_ckpt.values()) | {self.ckpt_dir}:
            os.makedirs(d, exist_ok=True)
        self.mem_dir = {s: tempfile.mkdtemp(prefix=f"chaos-netns-{'ab'[s]}-", dir="/dev/shm")
                        for s in (0, 1)}
        self.fault_dir = os.path.join(work, "faults")
        os.makedirs(self.fault_dir, exist_ok=True)
        self.token = f"chaos-{os.getpid()}-{ctx.rnd.randrange(1 << 48):012x}"
        self.run_id = f"chaos-netns-{ctx.seed}"
        self.nodes = []
        self.rnd = ctx.rnd
        self.faults = collections.Counter()
        self.events = []  # (kind, detail)
        self.cut_windows = []  # (t_cut, t_settled) of each cut

    def record(self, kind, detail):
        self.faults[kind] += 1
        self.events.append((kind, detail))
        self.say(f"fault {kind}: {detail}")

    def train_cmd(self):
        data = os.path.join(os.path.abspath(self.ctx.data), "train_*.bin")
        return [self.train, "--data", data] + MODEL + [
            "--steps", str(self.steps), "--log-every", "1", "--ckpt-dir", self.ckpt_dir,
            "--ckpt-every", "250", "--resume", "auto", "--mem-budget", "64M",
            "--comm-timeout", "30", "--join-timeout", "30"]

    def start_node(self, side):
        index = len(self.nodes)
        name = f"node{index}-{'ab'[side]}"
        log_path = os.path.join(self.work, name + ".err")
        out_path = os.path.join(self.work, name + ".out")
        argv = [self.elastic, "--nnodes", "1:2", "--nproc-per-node", str(self.nproc),
                "--rdzv-endpoint", f"{self.net.addr[0]}:{PORT}", "--rdzv-id", self.run_id,
                "--heartbeat-timeout", str(HB), "--last-call", "1", "--stop-grace",
                str(STOP_GRACE), "--max-restarts", "20", "--join-timeout", "60",
                "--mem-dir", self.mem_dir[side], "--"] + self.train_cmd()
        # node-local disk: this node's folder is mounted on the common path, in the mount
        # namespace of `ip netns exec` (gone with the agent: nothing to unmount)
        if self.node_ckpt[side] != self.ckpt_dir:
            argv = ["sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"',
                    self.node_ckpt[side], self.ckpt_dir] + argv
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", ELASTIC_STORE_TOKEN=self.token,
                   CKPT_FAULT_DIR=self.fault_dir)
        with open(out_path, "w") as out, open(log_path, "w") as err:
            proc = self.net.popen(side, ["nice", "-n", "5"] + argv, stdout=out, stderr=err,
                                  env=env, stdin=subprocess.DEVNULL)
        node = Node(index, side, proc, log_path, out_path, self.net.ns[side])
        self.nodes.append(node)
        self.say(f"started {name} (pid {proc.pid}) in {self.net.ns[side]}")
        return node

    def log_text(self):
        return "".join(n.log() for n in self.nodes)

    def last_step(self):
        steps = [int(m.group(1)) for n in self.nodes for m in STEP_RE.finditer(n.log())]
        return max(steps) if steps else None

    def max_round(self):
        rounds = [int(m.group(1)) for n in self.nodes for m in ROUND_RE.finditer(n.log())]
        return max(rounds) if rounds else -1

    def wait(self, cond, timeout, poll=0.05):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return True
            time.sleep(poll)
        return cond()

    def steps_after(self, t0):
        """rank 0 steps logged at or after wall time t0 (any node)."""
        n = 0
        for node in self.nodes:
            for line in node.log().splitlines():
                if STEP_RE.search(line):
                    t = _line_time(line, t0)
                    if t is not None and t >= t0:
                        n += 1
        return n

    def first_line_after(self, node, regex, t0):
        rx = re.compile(regex)
        for line in node.log().splitlines():
            if rx.search(line):
                t = _line_time(line, t0)
                if t is not None and t >= t0 - 0.05:
                    return t, line
        return None, None

    def finished(self):
        """rank 0 printed its final line at the last step (a stopped rank prints one too)."""
        return any(int(m.group(1)) == self.steps for n in self.nodes
                   for m in FINAL_RE.finditer(n.out()))

    def close(self):
        for n in self.nodes:
            if n.alive():
                try:
                    n.proc.kill()
                except OSError:
                    pass
        for n in self.nodes:
            try:
                n.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


def _default_reference(ctx, steps, work):
    """(digest, loss) of the uninterrupted one-process run of the scenario's config."""
    data = os.path.join(os.path.abspath(ctx.data), "train_*.bin")
    p = subprocess.run(["nice", os.path.join(os.path.abspath(ctx.build), "train"), "--data", data]
                       + MODEL + ["--steps", str(steps), "--log-every", "1000"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1"), cwd=work)
    m = re.search(r"final step=\d+ loss=(\S+) val_loss=\S+ params_digest=([0-9a-f]{32})",
                  p.stdout)
    if p.returncode != 0 or not m:
        raise RuntimeError(f"reference run failed ({p.returncode}): {p.stderr[-2000:]}")
    return m.group(2), float(m.group(1))


# cut lengths in heartbeat timeouts: short (a stall, the heartbeats survive), medium (the store
# host declares the other node dead, but it is back before a smaller round can form), long
# (longer than detection + --stop-grace + --last-call: the survivor goes on smaller)
CUT_RANGE = {"short": (0.25, 0.6), "medium": (1.3, 2.0), "long": (4.0, 5.0)}


def _cut_once(job, net, k, kind, dur, side, nproc, say):
    """One cut of dur seconds at `side`'s end, the heal, and what followed; returns the
    observation dict (times in seconds from the cut) with a "problems" list."""
    problems = []
    a = job.nodes[0]
    b = [n for n in job.nodes if n.side == 1][-1]
    step0, round0 = job.last_step(), job.max_round()
    t_cut = time.time()
    net.cut(side)
    job.record("partition", f"cut {k}: {kind}, {dur:.2f} s at {'AB'[side]}'s end, step {step0}, "
                            f"round {round0}")
    time.sleep(dur)
    net.heal()
    t_heal = time.time()
    ob = {"cut": k, "kind": kind, "seconds": round(dur, 2), "side": "AB"[side], "step": step0,
          "round_before": round0}
    full = 2 * nproc

    def rounds_after():
        """(round, world, time) of every round started after round0, any node."""
        out = []
        for n in job.nodes:
            for line in n.log().splitlines():
                m = ROUND_RE.search(line)
                if m and int(m.group(1)) > round0:
                    out.append((int(m.group(1)), int(m.group(4)), _line_time(line, t_cut)))
        first = {}
        for g, w, t in sorted(out, key=lambda x: (x[0], x[2] or 0)):
            first.setdefault(g, (g, w, t))
        return sorted(first.values())

    def settled():
        """B is gone, or the job runs at full size again (a round after the cut, or the old
        one when nothing was restarted) and trains."""
        if not b.alive():
            return True
        r = rounds_after()
        if r and r[-1][1] == full:
            return job.steps_after(max(t_heal, r[-1][2] or t_heal)) >= 10 or job.finished()
        return not r and job.steps_after(t_heal) >= 10 and (
            kind == "short" or job.first_line_after(a, r"missed its heartbeats", t_cut)[0] is None)

    bound = 4 * HB + STOP_GRACE + 60 + 30  # detection + stop + a flush's limit + rejoin
    if not job.wait(settled, bound) and b.alive():
        problems.append(f"cut {k} ({kind}, {dur:.2f} s): B neither exited nor was back in a "
                        f"training round of {full} ranks {bound:.0f} s after the heal (hang)")
    t_det, _ = job.first_line_after(a, r"missed its heartbeats", t_cut)
    t_bdet, _ = job.first_line_after(b, r"missed its heartbeats", t_cut)
    t_lost, _ = job.first_line_after(b, r"lost the rendezvous store", t_cut)
    ob["a_declares_b_dead_s"] = None if t_det is None else round(t_det - t_cut, 2)
    ob["b_declares_a_dead_s"] = None if t_bdet is None else round(t_bdet - t_cut, 2)
    ob["b_lost_store_s"] = None if t_lost is None else round(t_lost - t_cut, 2)
    ob["b_exit"] = b.proc.poll()
    if kind != "short" and t_det is None:
        problems.append(f"cut {k} ({kind}, {dur:.2f} s > --heartbeat-timeout {HB} s): A never "
                        f"declared B dead")
    if not a.alive():
        problems.append(f"cut {k} ({kind}, {dur:.2f} s): agent A (store host) exited "
                        f"{a.proc.returncode}: {_last_error(a.log())}")
        return dict(ob, problems=problems)
    if not b.alive():
        nb = job.start_node(1)  # grow back: a replacement agent on B's side
        ob["replacement"] = nb.index
        if not job.wait(lambda: job.finished() or not nb.alive() or
                        any(w == full for _, w, _ in rounds_after()), 60):
            problems.append(f"cut {k}: the replacement agent did not get into a round of {full} "
                            f"ranks within 60 s")
        t_back = time.time()
        job.wait(lambda: job.steps_after(t_back) >= 10 or job.finished(), 60)
    job.cut_windows.append((t_cut, time.time()))
    r = rounds_after()
    ob["rounds"] = [(g, w, None if t is None else round(t - t_cut, 2)) for g, w, t in r]
    ob["went_smaller"] = any(w < full for _, w, _ in r)
    grown = [t for _, w, t in r if w == full and t is not None]
    ob["full_size_again_s"] = round(grown[0] - t_cut, 2) if grown else None
    # the stall: the longest gap between rank 0's steps from the cut on
    times = []
    for n in job.nodes:
        for line in n.log().splitlines():
            if STEP_RE.search(line):
                t = _line_time(line, t_cut)
                if t is not None and t >= t_cut - 0.5:
                    times.append(t)
    times.sort()
    gaps = [y - x for x, y in zip(times, times[1:])]
    ob["stall_s"] = round(max(gaps), 2) if gaps else None
    if not job.finished() and job.steps_after(t_heal) < 10:
        problems.append(f"cut {k} ({kind}, {dur:.2f} s): no training after the heal")
    return dict(ob, problems=problems)


def run_partition_scenario(ctx, cuts=None, layout=None, log=None):
    """The network-partition scenario (CONTRACT.md): one job of two agents, one per namespace,
    1 or 2 ranks each, memory tier with replicas over the veth; K times (ctx.cuts, else cuts,
    else 1..3 from ctx.rnd) cut the link at a random moment for a random while (short: below
    the heartbeat timeout; long: above it) at a random end, heal it, and start a replacement
    agent where one exited. Then the checks. Returns a ScenarioResult (faults["partition"] =
    cuts made); result.observations holds one dict per cut (what elastic did, with times)."""
    t_start = time.time()
    rnd = ctx.rnd
    say = log or (lambda msg: print(f"  [netns {time.time() - t_start:6.1f} s] {msg}",
                                    file=sys.stderr, flush=True))
    K = getattr(ctx, "cuts", None) or cuts or rnd.randint(1, 3)
    layout = layout or getattr(ctx, "netns_layout", None) or "shared"
    nproc = rnd.choice([1, 2])
    # long enough that the job outlasts the cuts (a long one stalls it ~10 s); the guard in the
    # loop below stops cutting near the end
    steps = 2000 + 2500 * K
    kinds = ["long", "short", "medium"][:K]  # each kind once when K >= 3, then at random
    rnd.shuffle(kinds)
    kinds += [rnd.choice(sorted(CUT_RANGE)) for _ in range(K - len(kinds))]
    res = ScenarioResult(name="partition", seed=ctx.seed,
                         description=f"netns partition: 2 nodes x {nproc} rank(s), {steps} steps, "
                                     f"snapshot folders {layout}, cuts {kinds}",
                         faults=collections.Counter(), verified=collections.Counter(),
                         restore_sources=collections.Counter(), problems=[])
    res.observations = []
    problems = res.problems
    work_root = getattr(ctx, "work_root", None) or tempfile.gettempdir()
    os.makedirs(work_root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"netns-{ctx.seed}-", dir=work_root)
    res.work = work
    net = job = None
    # the uninterrupted run of this scenario's config (its own MODEL: not the core's
    # ctx.reference), computed beside the scenario: the cuts leave the CPUs idle
    ref_box = {}

    def reference():
        try:
            ref_box["ref"] = _default_reference(ctx, steps, work)
        except Exception as e:  # noqa: BLE001 - reported by the check
            ref_box["error"] = e
    ref_thread = threading.Thread(target=reference, name="netns-reference", daemon=True)
    ref_thread.start()
    res.reference_thread = (ref_thread, ref_box)
    try:
        net = NetPair(rnd)
        say(f"{net.ns[0]} ({net.addr[0]}, {net.dev[0]}) <-> {net.ns[1]} ({net.addr[1]}, "
            f"{net.dev[1]}); {res.description}; work {work}")
        job = PartitionJob(ctx, work, net, nproc, steps, layout, say)
        a = job.start_node(0)
        if not job.wait(lambda: "hosting the rendezvous store" in a.log() or not a.alive(), 20):
            problems.append("agent A did not host the store within 20 s")
        b = job.start_node(1)
        if not job.wait(lambda: job.last_step() is not None or not a.alive(), 60):
            problems.append("no training step within 60 s of the start")
        for k, kind in enumerate(kinds):
            if problems or not a.alive():
                break
            t_ready = time.time()
            # the group trains (at least 20 steps since the last recovery), then a random delay
            job.wait(lambda: job.steps_after(t_ready) >= 20 or job.finished(), 30)
            time.sleep(rnd.uniform(0.2, 1.5))
            if job.finished() or (job.last_step() or 0) > 0.85 * steps:
                say(f"cut {k}: the job is (nearly) done at step {job.last_step()}: no more cuts")
                break
            dur = rnd.uniform(*CUT_RANGE[kind]) * HB
            side = rnd.choice([0, 1])
            ob = _cut_once(job, net, k, kind, dur, side, nproc, say)
            res.observations.append(ob)
            problems.extend(ob.pop("problems"))
            say(f"cut {k}: {ob}")
            a = job.nodes[0]
        # the end: every agent exits, bounded
        left = max(0, steps - (job.last_step() or 0))
        end_bound = 120 + left * 0.02
        if not job.wait(lambda: not any(n.alive() for n in job.nodes), end_bound, poll=0.2):
            problems.append(f"agents still running {end_bound:.0f} s after the last cut "
                            f"(step {job.last_step()} of {steps})")
        _check(job, res, ctx, steps, say)
    except Exception as e:  # a broken scenario is a failed check, with the reason
        problems.append(f"scenario error: {type(e).__name__}: {e}")
    finally:
        if job is not None:
            job.close()
        if net is not None:
            left = []
            for side in (0, 1):
                pids = net.pids(side)
                if pids:
                    left.append(f"processes in {net.ns[side]}: {pids}")
            net.close()
            left += net.leftovers()
            if left:
                problems.append(f"left behind: {left}")
        if job is not None:
            for d in job.mem_dir.values():
                try:
                    segs = os.listdir(d)
                except OSError:
                    segs = []
                if segs:
                    problems.append(f"left behind in {d}: {sorted(segs)}")
                shutil.rmtree(d, ignore_errors=True)
        res.faults = job.faults if job is not None else collections.Counter()
        res.seconds = time.time() - t_start
        if not problems and not getattr(ctx, "keep", False):
            shutil.rmtree(work, ignore_errors=True)
    return res


def _check(job, res, ctx, steps, say):
    problems = res.problems
    logs = {n.index: n.log() for n in job.nodes}
    text = "".join(logs.values())
    res.restarts = max(0, job.max_round())
    for m in re.finditer(r"\[rank 0\] .*resumed from (memory \((?:own|replica|peer)\)|\S*step-\d+)"
                         r" at step", text):
        res.restore_sources["disk" if "step-" in m.group(1) else m.group(1)] += 1
    # exits: every agent that was not cut off ends 0; a cut-off one 1 (lost the store)
    for n in job.nodes:
        rc = n.proc.poll()
        if rc == 0:
            continue
        if n.side == 1 and rc == 1 and "lost the rendezvous store" in n.log():
            continue
        problems.append(f"agent {n.index} ({'AB'[n.side]}) exited {rc}: "
                        f"{_last_error(n.log())}")
    # a rank stopped by its agent (SIGTERM) prints a final line too: the job's is the last step's
    finals = [m for n in job.nodes for m in FINAL_RE.finditer(n.out())]
    finals = [m for m in finals if int(m.group(1)) == steps] or finals
    if not finals:
        problems.append("the job did not finish (no final line)")
        res.digest_equal = False
    else:
        m = finals[-1]
        if int(m.group(1)) != steps:
            problems.append(f"final step {m.group(1)}, expected {steps}")
        th, box = getattr(res, "reference_thread", (None, {}))
        if th is not None:
            th.join(600)
        if "ref" not in box:
            raise RuntimeError(f"no reference run: {box.get('error', 'it did not finish in 600 s')}")
        ref = box["ref"]
        res.digest_equal = m.group(4) == ref[0]
        res.final_digest, res.reference_digest = m.group(4), ref[0]
        if not res.digest_equal:
            problems.append(f"params_digest {m.group(4)} differs from the uninterrupted run's "
                            f"{ref[0]}")
    # snapshots: every committed one (rank 0's line, on the node that ran rank 0) and every
    # flushed one is in that node's folder and verifies
    expected = collections.defaultdict(set)
    for n in job.nodes:
        for m in re.finditer(r"\[rank 0\] .*snapshot step (\d+) committed", logs[n.index]):
            expected[job.node_ckpt[n.side]].add(int(m.group(1)))
        for m in re.finditer(r"\[flush\] .*flushed the memory snapshot of step (\d+) ", logs[n.index]):
            expected[job.node_ckpt[n.side]].add(int(m.group(1)))
    # a snapshot may fail while a cut lasts (a rank is stopped mid-vote); any other failure is
    # a finding
    failed, outside = [], collections.Counter()
    for line in text.splitlines():
        m = re.search(r"\[rank \d+\] .*snapshot step (\d+) failed: (.*?); it is not committed", line)
        if not m:
            continue
        failed.append((int(m.group(1)), m.group(2)))
        t = _line_time(line, job.t0)
        if t is None or not any(a - 0.5 <= t <= b + 1.0 for a, b in job.cut_windows):
            outside[m.group(2)] += 1
    res.snapshot_failures = failed
    if failed:
        say(f"disk snapshots not committed (all ranks' lines): {len(failed)} "
            f"({dict(collections.Counter(w for _, w in failed))})")
    if outside:
        problems.append(f"{sum(outside.values())} disk snapshot failure line(s) outside the cuts: "
                        f"{dict(outside)} (snapshot folders {job.layout})")
    for folder in sorted(set(job.node_ckpt.values())):
        have = {}
        for name in sorted(os.listdir(folder)):
            mm = re.fullmatch(r"step-(\d+)", name)
            if mm and os.path.exists(os.path.join(folder, name, "manifest.json")):
                have[int(mm.group(1))] = os.path.join(folder, name)
        for step in sorted(expected[folder] - set(have)):
            problems.append(f"snapshot step {step} was committed into {folder} but is not there")
        for step, path in sorted(have.items()):
            p = subprocess.run([job.inspect, "verify", path], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=120)
            if p.returncode == 0:
                res.verified["local"] += 1
            else:
                problems.append(f"ckpt-inspect verify {path}: exit {p.returncode}: "
                                f"{p.stdout.strip()[-300:]}")
        if not have:
            problems.append(f"no committed snapshot in {folder}")


def _last_error(text):
    errs = [line for line in text.splitlines() if " ERROR " in line]
    return errs[-1][:300] if errs else "(no error line)"


def main(argv=None):
    ap = argparse.ArgumentParser(description="the network-partition chaos scenario")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "brown"))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cuts", type=int, default=None, help="K cuts (default 1..3 from the seed)")
    ap.add_argument("--layout", choices=["local", "shared"], default="shared",
                    help="snapshot folders: one shared by both (shared, default) or one per "
                         "node at the same path (local: train refuses it at start, exit 2)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--work-root", default=None)
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)

    class Ctx:
        pass
    ctx = Ctx()
    ctx.build, ctx.data, ctx.seed, ctx.rnd = a.build, a.data, seed, random.Random(seed)
    ctx.keep, ctx.work_root, ctx.reference, ctx.cuts = a.keep, a.work_root, None, a.cuts
    ctx.netns_layout = a.layout
    r = run_partition_scenario(ctx)
    print(f"{r.name}: {r.description}")
    for ob in getattr(r, "observations", []):
        print(f"  {ob}")
    print(f"kind | injected\npartition | {r.faults['partition']}")
    print(f"restarts={r.restarts} verified={dict(r.verified)} "
          f"restore_sources={dict(r.restore_sources)} seconds={r.seconds:.1f}")
    for p in r.problems:
        print(f"PROBLEM: {p}")
    print(f"seed={seed}\nfaults={sum(r.faults.values())}\n"
          f"digest_equal={'yes' if r.digest_equal else 'no'}")
    if not r.ok:
        print(f"rerun: {sys.argv[0]} --seed {seed} --layout {a.layout}"
              + (f" --cuts {a.cuts}" if a.cuts else "") + f"; work folder {r.work}")
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
