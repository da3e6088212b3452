"""A training job under elastic for the chaos suite (tests/chaos/CONTRACT.md, "Job").

One Job = one snapshot folder, one memory-tier folder under /dev/shm, one fault folder
(CKPT_FAULT_DIR), optionally an S3 prefix behind a FaultProxy, and one or more launch
groups of agents (`elastic --nnodes 1:2 --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID`) on
loopback. Every process the job starts carries CHAOS_JOB=<id> in its environment, so the
leftover check can find it in /proc/*/environ.

The agents' stderr is read incrementally (poll()): each line becomes an event with its
time of day, so that waits do not re-read megabytes of log.
"""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import s3env  # noqa: E402

FINAL_RE = re.compile(r"final step=(\d+) loss=(\S+) val_loss=(\S+) params_digest=([0-9a-f]{32})")
TS_RE = re.compile(r"(?:\[(?:rank (\d+)|flush)\] )?(\d\d):(\d\d):(\d\d)\.(\d\d\d) ")
# what the agents' logs say (train, ckpt and elastic lines)
R0 = r"(?:rank 0: )?"   # W = 1 logs without a rank prefix; other ranks do not match
EVENT_RES = [
    ("step", re.compile(r"\[train\] " + R0 + r"step (\d+)/")),
    ("launch", re.compile(r"\[train\] " + R0 + r"(?:no usable snapshot in \S+: )?(fresh start) \(")),
    ("launch", re.compile(r"\[train\] " + R0 + r"resumed from (memory \((\w+)\)|s3://\S+|\S+) at step (\d+)")),
    ("committed", re.compile(r"\[ckpt\] " + R0 + r"snapshot step (\d+) committed")),
    ("removed", re.compile(r"\[ckpt\] " + R0 + r"retention: removed \S*step-0*(\d+)$")),
    # a removal by retention that a crash interrupted, finished by the next start
    ("removed", re.compile(r"\] " + R0 + r"removed leftover temp folder \S*\.tmp-step-0*(\d+)-retired")),
    ("flushed", re.compile(r"flushed the memory snapshot of step (\d+) from")),
    ("on_s3", re.compile(r"\[s3\] " + R0 + r"step (\d+) is on S3")),
    # said before the first DELETE (ckpt/ckpt_s3.c): a kill during the removal loses no step
    ("s3_removed", re.compile(r"\] " + R0 + r"remote retention: removing step-0*(\d+)")),
    ("failed", re.compile(r"\] " + R0 + r"snapshot step (\d+) failed")),
    ("set_aside", re.compile(r"set aside .*step-0*(\d+)|step-0*(\d+)\.corrupt-")),
    ("store_on", re.compile(r"\[elastic\] (?:hosting the rendezvous store at|store on) (\S+)")),
    ("round", re.compile(r"\[elastic\] round (\d+): started ranks")),
    ("hang", re.compile(r"\[elastic\] .*(hang watchdog) \(--hang-timeout")),
]
# fault kinds after which the group must launch again before the job counts as recovered
RESTARTING = {"kill_rank", "kill_ranks", "kill_agent", "kill_store_host", "stop_rank",
              "fault_point", "world_size_change"}

# the model and schedule of every chaos job: 8 sequences per step, so W = 1, 2, 4 all run a
# power-of-two number of micro-batches per rank (DESIGN section 4: equal digests)
MODEL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
         "--micro-batch", "2", "--global-batch", "8", "--lr", "3e-3", "--warmup", "10",
         "--seed", "11", "--log-every", "5"]


def tod(t=None):
    """Seconds since local midnight (the agents' log timestamps)."""
    lt = time.localtime(t if t is not None else time.time())
    frac = (t if t is not None else time.time()) % 1
    return lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec + frac


def children(pid):
    """Live (not zombie) child pids of pid."""
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            cand = [int(x) for x in f.read().split()]
    except OSError:
        return out
    for c in cand:
        try:
            with open(f"/proc/{c}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    out.append(c)
        except (OSError, IndexError):
            pass
    return out


def proc_environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def job_pids(job_id):
    """Every live process whose environment carries CHAOS_JOB=job_id."""
    tag = f"CHAOS_JOB={job_id}".encode()
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid() and tag in proc_environ(int(p)):
            try:
                with open(f"/proc/{p}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        continue
            except (OSError, IndexError):
                continue
            out.append(int(p))
    return out


class Node:
    """One elastic agent = one node of a launch group."""

    def __init__(self, job, index, group, nproc, argv, env, log_path, out_path):
        self.job, self.index, self.group, self.nproc = job, index, group, nproc
        self.log_path, self.out_path = log_path, out_path
        self.netns = None
        self.events = []          # (tod, kind, match groups)
        self._off = 0
        self._partial = b""
        self.expected = None      # None: must exit 0; else a reason why another status is fine
        self.stopped = False      # SIGSTOPped by stop_agent right now
        self.started = time.monotonic()
        self.exit_seen = None
        with open(log_path, "wb") as err, open(out_path, "wb") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env=env, start_new_session=True)

    def __repr__(self):
        return f"node {self.index} (group {self.group}, pid {self.proc.pid})"

    def alive(self):
        return self.proc.poll() is None

    @property
    def store_host(self):
        return self.index == 0

    def workers(self):
        """Live train pids that are children of the agent (its ranks; not its guardian, not
        a flush run)."""
        out = []
        for c in children(self.proc.pid):
            try:
                argv0 = open(f"/proc/{c}/cmdline", "rb").read().split(b"\0")[0].decode()
            except (OSError, UnicodeDecodeError):
                continue
            if os.path.basename(argv0) != "train":
                continue
            if b"CKPT_MEM_FLUSH=1" in proc_environ(c):
                continue
            out.append(c)
        return out

    def read(self):
        """Parse what the agent wrote since the last call into events."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._off)
                data = f.read()
        except OSError:
            return
        if not data:
            return
        self._off += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        last_t = self.events[-1][0] if self.events else tod()
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            m = TS_RE.match(line)
            t = (int(m.group(2)) * 3600 + int(m.group(3)) * 60 + int(m.group(4)) +
                 int(m.group(5)) / 1000) if m else last_t
            last_t = t
            for kind, rx in EVENT_RES:
                mm = rx.search(line)
                if mm:
                    self.events.append((t, kind, mm.groups(), line))
                    break

    def final(self):
        try:
            with open(self.out_path, errors="replace") as f:
                ms = FINAL_RE.findall(f.read())
        except OSError:
            return None
        return ms[-1] if ms else None


class S3Target:
    def __init__(self, rgw, prefix):
        self.rgw = rgw
        self.proxy = s3env.FaultProxy(rgw.endpoint)
        self.proxy.start()
        self.bucket = rgw.make_bucket()
        self.prefix = prefix
        self.url = f"s3://{self.bucket}/{prefix}"
        self.client = rgw.client()

    def env(self, base):
        """The job's S3 variables: the proxy is its endpoint."""
        return self.rgw.env({"AWS_ENDPOINT_URL": self.proxy.endpoint}, base=base)

    def direct_env(self, base):
        """Straight to RGW (for the checks)."""
        return self.rgw.env(base=base)

    def close(self):
        try:
            self.proxy.clear()
            self.proxy.stop()
        except Exception:  # noqa: BLE001 - best effort at the end
            pass


class Job:
    """A training job: see the module doc and CONTRACT.md."""

    def __init__(self, ctx, name, rnd, layout=(1, 2), steps=2000, ckpt_every=20, keep_last=3,
                 s3=False, tmpfs=False, hang_timeout=5.0, extra=()):
        self.ctx, self.name, self.rnd = ctx, name, rnd
        self.build = ctx.build
        self.train = os.path.join(self.build, "train")
        # CKPT_ELASTIC: another agent binary (tests/integration/harness.py: a ThreadSanitizer build)
        self.elastic = os.environ.get("CKPT_ELASTIC") or os.path.join(self.build, "elastic", "elastic")
        self.inspect = os.path.join(self.build, "ckpt-inspect")
        self.steps, self.ckpt_every, self.keep_last = steps, ckpt_every, keep_last
        self.hang_timeout = hang_timeout
        self.layout = tuple(layout)             # (nodes, nproc per node) of the current group
        self.id = re.sub(r"[^A-Za-z0-9_.-]", "-", f"chaos-{os.getpid()}-{name}")[:64]
        self.work = os.path.join(ctx.work_root, name)
        os.makedirs(self.work)
        self.fault_dir = os.path.join(self.work, "faults")
        os.makedirs(self.fault_dir)
        self.tmpfs = None
        if tmpfs:
            self.tmpfs = os.path.join(self.work, "ckptfs")
            os.makedirs(self.tmpfs)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "chaos-ckpt",
                            self.tmpfs], check=True, capture_output=True)
            self.ckpt_dir = os.path.join(self.tmpfs, "ckpt")
        else:
            self.ckpt_dir = os.path.join(self.work, "ckpt")
        self.mem_dir = tempfile.mkdtemp(prefix=f"chaos-mem-{os.getpid()}-", dir="/dev/shm")
        self.s3 = S3Target(ctx.rgw(), name) if s3 else None
        self.corrupted = {"local": set(), "s3": set(), "memory": set()}
        self.extra = list(extra)
        self.nodes = []            # the current group's agents (replacements appended)
        self.all_nodes = []        # every agent this job ever started
        self.groups = 0            # launch groups started (relaunches of the whole job)
        self.worlds = set()        # the world sizes launched (nodes x nproc)
        self.faults = []           # (kind, detail, monotonic time)
        self.problems = []         # found while it ran (a hang, an agent that did not fail fast)
        self.notes = []            # observations that are not failures
        self.pending = []          # [due monotonic, fn, what]
        self.relaunch = None       # (new layout, why, deadline) while the whole job restarts
        self.marker = None         # {node: event count} at the last fault
        self.marker_restart = False
        self.t0 = time.monotonic()
        self._seq = 0
        self.token = uuid.uuid4().hex
        self.port = None
        e = dict(os.environ)
        e.update({"OPENBLAS_NUM_THREADS": "1", "CKPT_FAULT_DIR": self.fault_dir,
                  "CHAOS_JOB": self.id, "ELASTIC_STORE_TOKEN": self.token,
                  "CKPT_LOG_LEVEL": "info"})
        if self.s3:
            e = self.s3.env(e)
        self.env = e

    # -- command lines
    def train_args(self):
        a = [self.train, "--data", os.path.join(self.ctx.data, "train_*.bin")] + MODEL + [
            "--steps", str(self.steps), "--ckpt-dir", self.ckpt_dir,
            "--ckpt-every", str(self.ckpt_every), "--resume", "auto", "--comm-timeout", "30",
            "--join-timeout", "60"]
        if self.keep_last:
            a += ["--keep-last", str(self.keep_last)]
        if self.s3:
            a += ["--s3", self.s3.url, "--s3-keep-last", "3", "--s3-timeout", "5",
                  "--s3-attempts", "3", "--s3-drain-timeout", "30", "--s3-backlog", "1"]
        return a + self.extra

    def agent_args(self, nproc):
        return [self.elastic, "--nnodes", "1:2", "--nproc-per-node", str(nproc),
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.id,
                "--max-restarts", "200", "--monitor-interval", "0.1", "--stop-grace", "3",
                "--hang-timeout", str(self.hang_timeout), "--heartbeat-timeout", "2",
                "--last-call", "2", "--preempt-grace", "30", "--join-timeout", "60",
                "--mem-dir", self.mem_dir, "--"] + self.train_args()

    # -- agents
    def _start_node(self, index, nproc):
        self._seq += 1
        base = os.path.join(self.work, f"agent-{self._seq:02d}-g{self.groups}n{index}")
        n = Node(self, index, self.groups, nproc, self.agent_args(nproc), self.env,
                 base + ".err", base + ".out")
        self.nodes.append(n)
        self.all_nodes.append(n)
        return n

    def launch(self, layout=None):
        """Start a launch group: node 0 first (it hosts the store), the others once it
        listens. Returns False when node 0 did not come up."""
        if layout is not None:
            self.layout = tuple(layout)
        nodes, nproc = self.layout
        self.groups += 1
        self.port = s3env.free_port()
        self.nodes = []
        self.worlds.add(nodes * nproc)
        n0 = self._start_node(0, nproc)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and n0.alive():
            n0.read()
            if any(e[1] == "store_on" for e in n0.events):
                break
            time.sleep(0.02)
        else:
            self.problems.append(f"group {self.groups}: node 0 did not host the store "
                                 f"within 15 s (exit {n0.proc.poll()})")
            return False
        for i in range(1, nodes):
            self._start_node(i, nproc)
        return True

    def add_node(self):
        """A replacement agent joining the running group (a scale-up)."""
        nproc = self.layout[1]
        idx = max(n.index for n in self.nodes) + 1 if self.nodes else 0
        n = self._start_node(idx, nproc)
        self.worlds.add(nproc * len([x for x in self.nodes if x.alive()]))
        return n

    def live_nodes(self):
        return [n for n in self.nodes if n.alive()]

    def store_host(self):
        return next((n for n in self.nodes if n.store_host), None)

    def later(self, delay, fn, what):
        """Run fn() from poll() after delay seconds (a SIGCONT, a filler removed, ...)."""
        self.pending.append([time.monotonic() + delay, fn, what])

    def relaunch_when_down(self, layout, why, timeout=20.0):
        """The whole job was stopped (store host killed, preempted, every agent killed):
        relaunch it with layout once every agent of the group has exited."""
        self.relaunch = (tuple(layout), why, time.monotonic() + timeout, time.monotonic())

    # -- the event loop
    def poll(self):
        now = time.monotonic()
        for n in self.all_nodes:
            n.read()
        for p in list(self.pending):
            if p[0] <= now:
                self.pending.remove(p)
                try:
                    p[1]()
                except Exception as e:  # noqa: BLE001 - a scheduled action must not kill the driver
                    self.problems.append(f"scheduled action '{p[2]}' failed: {e!r}")
        for n in self.nodes:
            if n.exit_seen is None and not n.alive():
                n.exit_seen = now
                self._node_exited(n)
        if self.relaunch:
            layout, why, deadline, since = self.relaunch
            if not self.live_nodes():
                if why == "store host killed":
                    took = now - since
                    codes = [n.proc.returncode for n in self.nodes if n.expected is None]
                    if any(c != 1 for c in codes):
                        self.problems.append(f"store host killed: the other agents exited "
                                             f"{codes}, not 1")
                    self.notes.append(f"store host killed: the others were down after {took:.1f} s")
                    for n in self.nodes:
                        if n.expected is None:
                            n.expected = "store host lost"
                self.relaunch = None
                self.launch(layout)
                self.set_marker(True)
            elif now > deadline:
                live = self.live_nodes()
                self.problems.append(f"{why}: agents {live} still running {now - since:.0f} s "
                                     f"later (not failing fast): SIGKILLed")
                for n in live:
                    n.expected = n.expected or "killed after a hang"
                    self.kill_node(n, signal.SIGKILL)

    def _node_exited(self, n):
        rc = n.proc.returncode
        if n.expected is not None or self.relaunch:
            return
        others = [x for x in self.nodes if x is not n and x.alive()]
        if rc == 0 and not others:
            return  # the job's end
        if n.stopped or getattr(n, "was_stopped", False):
            # stop_agent's victim: the others went on without it (heartbeat); replace it
            n.expected = f"exited {rc} after SIGSTOP/SIGCONT"
            self.notes.append(f"{n} exited {rc} after it was stopped and continued: "
                              f"{self.tail(n, 1)}; replaced")
            if others:
                self.later(0.2, self.add_node, "replace the continued agent")
            return
        if rc == 0 and others:
            return  # a node of the final round that finished first
        host = [x for x in self.nodes if x is not n and x.store_host]
        if (rc == 1 and host and (host[0].stopped or getattr(host[0], "was_stopped", False))
                and "lost the rendezvous store" in self.tail(n, 40)):
            # stop_agent stopped the store host longer than the store client waits: to this
            # agent the store is gone (no replicated store): exit 1 is right; replace it
            n.expected = "store host was stopped (SIGSTOP): store lost"
            self.notes.append(f"{n} lost the stopped store host and exited 1; replaced")
            if others:
                self.later(0.2, self.add_node, "replace the agent that lost the store")
            return
        if others:
            self.problems.append(f"{n} exited {rc} while the job ran: {self.tail(n, 3)}")

    def tail(self, n, lines=3):
        try:
            with open(n.log_path, errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-lines:])
        except OSError:
            return ""

    def kill_node(self, n, sig):
        if n.alive():
            try:
                os.kill(n.proc.pid, sig)
            except ProcessLookupError:
                pass

    # -- the contract's API
    def events(self, kind=None, after=None):
        out = []
        for n in self.all_nodes:
            start = 0 if after is None else after.get(n, 0)
            out += [e for e in n.events[start:] if kind is None or e[1] == kind]
        return sorted(out, key=lambda e: e[0])

    def log_text(self):
        parts = []
        for n in self.all_nodes:
            try:
                with open(n.log_path, errors="replace") as f:
                    parts.append(f"==== {n} {n.log_path}\n" + f.read())
            except OSError:
                pass
        return "\n".join(parts)

    def committed_steps(self):
        self.poll()
        return sorted({int(e[2][0]) for e in self.events("committed")})

    def last_step(self):
        self.poll()
        st = [int(e[2][0]) for e in self.events("step")]
        return st[-1] if st else None

    def ended(self):
        return not self.live_nodes() and self.relaunch is None and not any(
            p[2].startswith("replace") for p in self.pending)

    def wait_steps(self, n, timeout):
        deadline = time.monotonic() + timeout
        self.poll()
        start = len(self.events("step"))
        while time.monotonic() < deadline:
            self.poll()
            if len(self.events("step")) - start >= n:
                return True
            if self.ended():
                return False
            time.sleep(0.05)
        return False

    def set_marker(self, restart):
        self.marker = {n: len(n.events) for n in self.all_nodes}
        self.marker_restart = restart

    def recovered(self):
        if self.relaunch is not None or any(not p[2].startswith("late:") for p in self.pending):
            return False
        return self._trained_since_marker()

    def _trained_since_marker(self):
        ev = self.events(after=self.marker or {})
        if self.marker_restart:
            i = next((k for k, e in enumerate(ev) if e[1] == "launch"), None)
            return i is not None and any(e[1] == "step" for e in ev[i + 1:])
        return any(e[1] == "step" for e in ev)

    def wait_recovered(self, timeout):
        """A launch after the last fault trained a step (for a fault that stops no process:
        a step after it), no scheduled action is due (a SIGCONT, a relaunch), or the job
        ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if self.ended() or self.recovered():
                return True
            time.sleep(0.05)
        return False

    def record(self, kind, detail):
        """Count one injected fault (the driver calls it when an injector returned a detail)."""
        self.poll()
        self.faults.append((kind, detail, time.monotonic() - self.t0))
        # a fault whose relaunch or restart is already scheduled keeps the stronger condition
        self.set_marker(kind in RESTARTING or (self.marker_restart and
                                               not self._trained_since_marker()))

    def wait_end(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if self.ended():
                return True
            time.sleep(0.1)
        return False

    def final(self):
        """(step, loss, val_loss, digest) of the final line of the newest step any agent
        printed (an agent that stopped early, e.g. one that lost the store, prints the step it
        stopped at), the last agent's on a tie; None when there is none."""
        best = None
        for n in self.nodes:
            f = n.final()
            if f and (best is None or int(f[0]) >= best[0]):
                best = (int(f[0]), float(f[1]), f[2], f[3])
        return best

    def launches(self):
        return [e for e in self.events("launch")]

    # -- the end
    def stop_all(self):
        """SIGKILL every agent still running (their guardians kill the ranks) and wait."""
        for n in self.all_nodes:
            if n.alive():
                try:
                    os.kill(n.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                self.kill_node(n, signal.SIGKILL)
        for n in self.all_nodes:
            try:
                n.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def close(self, keep=False):
        """Stop everything the job started and remove what it made (the work folder unless
        keep). Safe to call twice."""
        for p in list(self.pending):   # a filler to remove, a stopped agent to continue
            if p[2].startswith("late:") or "SIGCONT" in p[2] or "filler" in p[2]:
                try:
                    p[1]()
                except Exception:  # noqa: BLE001
                    pass
        self.pending.clear()
        self.stop_all()
        deadline = time.monotonic() + 5
        while job_pids(self.id) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in job_pids(self.id):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.s3:
            self.s3.close()
        if self.tmpfs and os.path.ismount(self.tmpfs):
            subprocess.run(["umount", "-l", self.tmpfs], capture_output=True)
        shutil.rmtree(self.mem_dir, ignore_errors=True)
        if not keep:
            shutil.rmtree(self.work, ignore_errors=True)
