"""The elastic launcher (issue 5): spawning, output relay, restarts, the restart budget, usage
errors, the store token, bounded stops (C19, C29), the hang watchdog (C17), preemption (and the
ranks whose final snapshot may be missing), a busy store port, the orphan guardian (SIGKILL of
the agent leaves no worker's child behind), several agents on one machine (C27 dead node,
scale-up, C28 leave/rejoin cycles, C30 store host killed, agents with other settings or of
another job refused, a flood of silent sockets on the store during rendezvous and restart) and,
with train, kill-a-rank and preempt-and-resume with the digest of an uninterrupted run.

Most tests run tests/tools/elastic_worker.py, a stand-in worker that prints its environment,
writes progress lines and fails, hangs or ignores SIGTERM on request. Every worker carries a
marker unique to the test in its argv; tearDown checks that no process with it is left.
Synchronisation is by log lines (the agent's and the workers'), never by sleeping.
"""
import os
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import harness
from harness import TempDirTest

ELASTIC = harness.ELASTIC
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "elastic_worker.py")
SLOW = os.environ.get("CKPT_SANITIZED") == "1"
T = 3.0 if SLOW else 1.0  # time scale for bounds

# 24 sequences per step; W=1 and W=2 give identical bits (4 micro-batches of 3 per rank at W=2).
TRAIN_ARGS = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
              "--global-batch", "24", "--micro-batch", "3", "--steps", "30", "--lr", "3e-3",
              "--warmup", "2", "--seed", "7", "--log-every", "1"]
FINAL_RE = re.compile(r"^\[rank 0\] final step=(\d+) loss=(\S+) val_loss=(\S+) "
                      r"params_digest=([0-9a-f]{32})$", re.M)
STARTED_RE = re.compile(r"round (\d+): started ranks (\d+)\.\.(\d+) of (\d+) \(pids ([0-9 ]+)\)")


def free_port():
    return harness.free_port()


def procs_with(marker):
    """pids of processes whose command line holds marker."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def stat_of(pid):
    """(state, ppid, pgid) from /proc/<pid>/stat, None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[2])


def alive(pid):
    st = stat_of(pid)
    return st is not None and st[0] != "Z"


def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            st = stat_of(int(p))
            if st and st[1] == pid:
                out.append(int(p))
    return out


def hello_status(port, token):
    """Speak the store's HELLO (store.h) with token; returns the status byte (2 = DENIED)."""
    tok = token.encode()
    body = b"ESTR" + struct.pack("<H", 1) + struct.pack("<I", len(tok)) + tok
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(struct.pack("<IBI", 5 + len(body), 0x01, 1) + body)
        hdr = b""
        while len(hdr) < 10:
            chunk = s.recv(10 - len(hdr))
            if not chunk:
                return -1
            hdr += chunk
        return hdr[9]


class RawStore:
    """A bare client of the store's wire protocol (elastic/store.h: HELLO, then SET and ADD),
    for tests that write keys no agent would: a joiner that never writes its descriptor, a
    malformed value. Every reply's status must be OK (0)."""

    def __init__(self, port, token=""):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.id = 0
        tok = token.encode()
        self.call(0x01, b"ESTR" + struct.pack("<H", 1) + struct.pack("<I", len(tok)) + tok)

    def call(self, op, body):
        self.id += 1
        self.s.sendall(struct.pack("<IBI", 5 + len(body), op, self.id) + body)
        n = struct.unpack("<I", self.recv(4))[0]
        reply = self.recv(n)
        assert reply[5] == 0, f"store status {reply[5]} for op {op}"
        return reply[6:]

    def recv(self, n):
        d = b""
        while len(d) < n:
            chunk = self.s.recv(n - len(d))
            if not chunk:
                raise ConnectionError("store closed the connection")
            d += chunk
        return d

    def add(self, key, delta=1):
        k = key.encode()
        return struct.unpack("<q", self.call(0x05, struct.pack("<q", delta) +
                                             struct.pack("<I", len(k)) + k)[:8])[0]

    def set(self, key, value):
        k, v = key.encode(), value.encode()
        self.call(0x02, struct.pack("<I", len(k)) + k + struct.pack("<I", len(v)) + v)

    def close(self):
        self.s.close()


class Flood(threading.Thread):
    """n silent TCP connections to the store at port, opened as fast as this thread can and
    held; every one the server closes is replaced at once, until stop(). Nothing is ever sent,
    so a readable socket is one the server closed."""

    def __init__(self, port, n=1100):
        super().__init__(daemon=True)
        self.port, self.n = port, n
        self.halt = threading.Event()
        self.opened = self.failed = self.peak = 0
        self.t0 = self.t1 = None
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 2 * n + 256  # the flood's sockets plus the test's own files
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))

    def connect(self):
        s = socket.socket()
        s.settimeout(1.0)  # a full listen backlog drops SYNs: never block the flood for long
        try:
            s.connect(("127.0.0.1", self.port))
        except OSError:
            s.close()
            self.failed += 1
            return None
        self.opened += 1
        return s

    def run(self):
        socks, poller = {}, select.poll()
        self.t0 = time.time()
        try:
            while not self.halt.is_set():
                while len(socks) < self.n and not self.halt.is_set():
                    s = self.connect()
                    if s is None:
                        break
                    socks[s.fileno()] = s
                    poller.register(s, select.POLLIN)
                self.peak = max(self.peak, len(socks))
                for fd, _ in poller.poll(10):
                    poller.unregister(fd)
                    socks.pop(fd).close()
        finally:
            self.t1 = time.time()
            for s in socks.values():
                s.close()

    def stop(self):
        self.halt.set()
        self.join(10)

    def rate(self):
        return self.opened / max(1e-9, (self.t1 or time.time()) - self.t0)


class Agent:
    """One elastic process; stdout and stderr go to files in tmp."""
    count = 0

    def __init__(self, tmp, args, cmd, extra_env=None, name=None, session=False):
        Agent.count += 1
        self.name = name or f"agent{Agent.count}"
        self.out_path = os.path.join(tmp, self.name + ".out")
        self.err_path = os.path.join(tmp, self.name + ".err")
        self.t0 = time.time()
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.p = subprocess.Popen([ELASTIC] + list(args) + ["--"] + list(cmd), stdout=out,
                                      stderr=err, env=harness.env(extra_env),
                                      start_new_session=session)

    def out(self):
        return harness.read(self.out_path)

    def err(self):
        return harness.read(self.err_path)

    def wait_for(self, regex, timeout=30, stream="err", start=0):
        """Block until regex matches the stream (from offset start); returns the match."""
        rx = re.compile(regex, re.M)
        deadline = time.time() + timeout * T
        while time.time() < deadline:
            m = rx.search((self.err() if stream == "err" else self.out())[start:])
            if m:
                return m
            if self.p.poll() is not None:
                m = rx.search((self.err() if stream == "err" else self.out())[start:])
                if m:
                    return m
                raise AssertionError(f"{self.name} exited {self.p.returncode} before /{regex}/:\n"
                                     f"{self.err()[-3000:]}")
            time.sleep(0.01)
        raise AssertionError(f"{self.name}: no /{regex}/ within {timeout * T} s:\n{self.err()[-3000:]}")

    def pids(self, gen):
        """pids of this node's workers in round gen (from the agent's log)."""
        for m in STARTED_RE.finditer(self.err()):
            if int(m.group(1)) == gen:
                return [int(x) for x in m.group(5).split()]
        return []

    def wait(self, timeout=60):
        try:
            return self.p.wait(timeout=timeout * T)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise AssertionError(f"{self.name} did not exit within {timeout * T} s:\n"
                                 f"{self.err()[-3000:]}")

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


class ElasticTest(TempDirTest):
    def setUp(self):
        super().setUp()
        self.marker = f"elastic-test-{os.getpid()}-{self.id().split('.')[-1]}"
        self.agents = []

    def tearDown(self):
        for a in self.agents:
            a.kill()
        # A sanitizer report in any agent's log fails the test (scripts/test runs some of these
        # tests with CKPT_ELASTIC from build-tsan/ and TSAN_OPTIONS=halt_on_error=1: the agent
        # also exits 66, which a test that kills the agent would not see).
        reports = {a.name: harness.sanitizer_reports(a.err()) for a in self.agents}
        reports = {k: v for k, v in reports.items() if v}
        deadline = time.time() + 5
        left = procs_with(self.marker)
        while left and time.time() < deadline:
            time.sleep(0.05)
            left = procs_with(self.marker)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        errs = {a.name: a.err()[-6000:] for a in self.agents if a.name in reports}
        super().tearDown()
        self.assertEqual(left, [], "worker processes left behind")
        self.assertEqual(reports, {}, "sanitizer report in an agent's log:\n" +
                         "\n".join(f"--- {k}\n{v}" for k, v in errs.items()))

    def stub(self, *args):
        return [sys.executable, WORKER, "--marker", self.marker] + list(args)

    def agent(self, args, cmd, extra_env=None, name=None, session=False):
        a = Agent(self.tmp, args, cmd, extra_env, name, session)
        self.agents.append(a)
        return a

    def run_agent(self, args, cmd, timeout=60, extra_env=None):
        a = self.agent(args, cmd, extra_env)
        rc = a.wait(timeout)
        return rc, a.out(), a.err()

    def rounds(self, err):
        return [int(m.group(1)) for m in STARTED_RE.finditer(err)]


class Cli(ElasticTest):
    def test_help_and_usage_errors(self):
        p = harness.run([ELASTIC, "--help"])
        self.assertEqual(p.returncode, 0)
        for word in ["--nproc-per-node", "--hang-timeout", "--resume auto", "Exit status", "143"]:
            self.assertIn(word, p.stdout)
        bad = [
            [],
            ["--nproc-per-node", "2"],
            ["--", "true"],
            ["--nproc-per-node", "0", "--", "true"],
            ["--nproc-per-node", "x", "--", "true"],
            ["--nproc-per-node", "1", "--nnodes", "3:2", "--", "true"],
            ["--nproc-per-node", "1", "--nnodes", "2:3", "--", "true"],
            ["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400",
             "--", "true"],
            ["--nproc-per-node", "1", "--rdzv-id", "a/b", "--", "true"],
            ["--nproc-per-node", "1", "--rdzv-endpoint", "nohostport", "--", "true"],
            ["--nproc-per-node", "1", "--rdzv-endpoint", "no-such-host.invalid:29400", "--",
             "true"],
            ["--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-id", "j", "--rdzv-endpoint",
             "no-such-host.invalid:29400", "--", "true"],
            ["--nproc-per-node", "1", "--hang-timeout", "-1", "--", "true"],
            ["--nproc-per-node", "1", "--bogus", "--", "true"],
            ["--nproc-per-node"],
            ["--nproc-per-node", "1", "--", "/no/such/program"],
            ["--nproc-per-node", "1", "--", "no-such-program-in-path-xyz"],
        ]
        for args in bad:
            p = harness.run([ELASTIC] + args, timeout=30)
            self.assertEqual(p.returncode, 2, f"{args}: {p.stderr}")
            lines = [l for l in p.stderr.splitlines() if l.strip()]
            self.assertEqual(len(lines), 1, f"{args}: one line expected:\n{p.stderr}")

    def test_train_without_resume_warns(self):
        rc, out, err = self.run_agent(["--nproc-per-node", "1"], [harness.TRAIN, "--help"])
        self.assertEqual(rc, 0, err)
        self.assertIn("has no --resume", err)
        rc, out, err = self.run_agent(["--nproc-per-node", "1"],
                                      [harness.TRAIN, "--help", "--resume", "auto"])
        self.assertEqual(rc, 0, err)
        self.assertNotIn("has no --resume", err)


class SingleNode(ElasticTest):
    def test_environment_and_output_relay(self):
        rc, out, err = self.run_agent(["--nproc-per-node", "3"], self.stub("--beats", "2"))
        self.assertEqual(rc, 0, err)
        port = re.search(r"store on 127\.0\.0\.1:(\d+)", err).group(1)
        for r in range(3):
            self.assertRegex(out, rf"(?m)^\[rank {r}\] start rank={r} gen=0 pid=\d+ world=3 local={r} "
                             rf"lworld=3 group=0 groups=1 addr=127\.0\.0\.1:{port} hosted=1 run=none "
                             rf"tgen=0 pgid=(\d+)")
            self.assertRegex(out, rf"(?m)^\[rank {r}\] done rank={r} gen=0$")
            # stderr, and the partial last line flushed at exit
            self.assertRegex(err, rf"(?m)^\[rank {r}\] err rank={r} partial$")
        # each worker leads its own process group
        for m in re.finditer(r"start rank=\d+ gen=0 pid=(\d+) .* pgid=(\d+)", out):
            self.assertEqual(m.group(1), m.group(2))
        self.assertEqual(self.rounds(err), [0])

    def test_failure_restarts_the_whole_group(self):
        # rank 0 runs until stopped in round 0: with a fixed number of beats it could finish
        # before rank 1's failure was handled (rank 1's interpreter starting late on a busy
        # machine), and then it gets no SIGTERM
        rc, out, err = self.run_agent(["--nproc-per-node", "2"],
                                      self.stub("--beats", "4", "--fail", "1:0:1:2",
                                                "--forever", "0:0"))
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.rounds(err), [0, 1])
        self.assertIn("rank 1 (pid", err)
        self.assertRegex(err, r"round 0: rank 1 \(pid \d+\) exited with status 1")
        self.assertIn("[rank 0] term rank=0 gen=0", out)  # the survivor got SIGTERM
        self.assertIn("restart 1 of at most 3", err)
        for r in range(2):
            self.assertRegex(out, rf"\[rank {r}\] start rank={r} gen=1 .* tgen=1 ")
            self.assertIn(f"[rank {r}] done rank={r} gen=1", out)

    def test_restart_budget_exhausted(self):
        rc, out, err = self.run_agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                                      self.stub("--beats", "4", "--fail", "1:*:1:1"))
        self.assertEqual(rc, 1, err)
        self.assertEqual(self.rounds(err), [0, 1, 2])
        # the last line before the goodput report the agent prints at every exit
        last = [l for l in err.strip().splitlines() if "[elastic] goodput" not in l][-1]
        self.assertRegex(last, r"ERROR .*giving up: restart budget exhausted: 2 restart\(s\) used of "
                         r"--max-restarts 2; last failure: rank 1 \(pid \d+\) exited with status 1")

    def test_usage_error_is_not_retried(self):
        rc, out, err = self.run_agent(["--nproc-per-node", "2"],
                                      self.stub("--beats", "4", "--fail", "0:*:2:1"))
        self.assertEqual(rc, 2, err)
        self.assertEqual(self.rounds(err), [0])
        self.assertNotIn("restart 1", err)
        self.assertRegex(err, r"rank 0 \(pid \d+\) exited with status 2: a usage or configuration "
                         r"error, not restarting")

    def test_store_token(self):
        """Workers get the random token; the store refuses a wrong or missing one; never logged."""
        check = os.path.join(self.tmp, "token.txt")
        a = self.agent(["--nproc-per-node", "1"],
                       self.stub("--beats", "0", "--token-check", check))
        port = int(a.wait_for(r"store on 127\.0\.0\.1:(\d+)").group(1))
        a.wait_for(r"first progress")
        self.assertEqual(hello_status(port, ""), 2)         # DENIED: no token
        self.assertEqual(hello_status(port, "0" * 32), 2)   # DENIED: wrong token
        a.p.send_signal(signal.SIGTERM)
        self.assertEqual(a.wait(), 143)
        with open(check) as f:
            m = re.match(r"ok=(\S+) wrong=(\S+) token=([0-9a-f]+)$", f.read().strip())
        self.assertIsNotNone(m)
        self.assertEqual(m.group(1), "0")   # OK with the worker's token
        self.assertEqual(m.group(2), "2")   # DENIED with a wrong one
        token = m.group(3)
        self.assertEqual(len(token), 32)
        self.assertNotIn(token, a.out() + a.err())

    def test_c19_c29_ignored_sigterm_is_killed_after_grace_and_groups_are_gone(self):
        """C19 and C29: rank 0 ignores SIGTERM and runs on; its group, grandchildren included,
        is SIGKILLed after --stop-grace (pid logged) and gone before round 1 starts."""
        t0 = time.time()
        rc, out, err = self.run_agent(
            ["--nproc-per-node", "2", "--stop-grace", "1"],
            self.stub("--beats", "6", "--forever", "*:0", "--fail", "1:0:1:3", "--ignore-term",
                      "--child", self.marker))
        elapsed = time.time() - t0
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.rounds(err), [0, 1])
        pid0 = self.pids_of(err, 0)[0]
        self.assertRegex(err, rf"rank 0 \(pid {pid0}\) still running 1\.\d s after SIGTERM: SIGKILL "
                         r"to its process group")
        self.assertRegex(err, r"processes of its group \d+ are still running")
        # round 1's workers found nothing of round 0 (the grandchildren of both ranks)
        self.assertEqual(re.findall(r"\[rank \d\] stale=(\d+)", out), ["0", "0"])
        self.assertLess(elapsed, 15 * T)
        self.assertEqual(procs_with(self.marker + "-g"), [])

    def pids_of(self, err, gen):
        for m in STARTED_RE.finditer(err):
            if int(m.group(1)) == gen:
                return [int(x) for x in m.group(5).split()]
        return []

    def test_c17_hang_watchdog_restarts_a_stopped_rank(self):
        """C17: rank 1 is SIGSTOPped; the watchdog names it, stops the group (SIGCONT lets the
        stopped one take SIGTERM) and restarts."""
        a = self.agent(["--nproc-per-node", "2", "--hang-timeout", "1", "--stop-grace", "2"],
                       self.stub("--beats", "30", "--forever", "*:0", "--interval", "0.05"))
        a.wait_for(r"round 0: first progress")
        pid1 = a.pids(0)[1]
        os.kill(pid1, signal.SIGSTOP)
        t_stop = time.time()
        a.wait_for(r"2 worker\(s\) per node, 1\.\.1 node\(s\), --max-restarts 3, hang timeout 1 s$")
        m = a.wait_for(r"hang watchdog \(--hang-timeout 1 s\): (.*)")
        noticed = time.time() - t_stop
        self.assertRegex(m.group(1), rf"^rank 1 \(pid {pid1}, (last step \d+|no progress line yet)\) "
                         r"silent for 1\.\d s$")
        self.assertEqual(a.wait(), 0, a.err())
        self.assertEqual(self.rounds(a.err()), [0, 1])
        self.assertIn("restart 1 of at most 3", a.err())
        self.assertLess(noticed, 3 * T)

    def test_preemption_forwards_sigterm(self):
        a = self.agent(["--nproc-per-node", "2"], self.stub("--beats", "0"))
        for r in range(2):  # each has its SIGTERM handler once it printed this
            a.wait_for(rf"^\[rank {r}\] start rank={r} ", stream="out")
        a.p.send_signal(signal.SIGTERM)
        self.assertEqual(a.wait(10), 143)
        for r in range(2):
            self.assertIn(f"[rank {r}] term rank={r} gen=0", a.out())
        self.assertIn("preempted", a.err())
        self.assertEqual(self.rounds(a.err()), [0])

    def test_preemption_names_ranks_without_final_snapshot(self):
        """SIGTERM to the agent while rank 1 exits 1 on SIGTERM and rank 2 ignores it (SIGKILLed
        after --preempt-grace): still 143, and one WARN line for each of the two."""
        a = self.agent(["--nproc-per-node", "3", "--preempt-grace", "0.5"],
                       self.stub("--beats", "0", "--on-term", "1:*:1", "--on-term", "2:*:ignore"))
        for r in range(3):
            a.wait_for(rf"^\[rank {r}\] start rank={r} ", stream="out")
        a.p.send_signal(signal.SIGTERM)
        self.assertEqual(a.wait(10), 143, a.err())
        tail = ("during the preemption stop: its final snapshot may be missing; the next launch "
                "resumes from the newest committed one")
        warns = re.findall(r"WARN  \[elastic\] (rank \d exited with .*)", a.err())
        self.assertEqual(sorted(warns), [f"rank 1 exited with status 1 {tail}",
                                         f"rank 2 exited with signal 9 (Killed) {tail}"], a.err())

    def test_agent_killed_leaves_no_orphans(self):
        """SIGKILL of the agent: the workers die by their parent-death signal, and the guardian
        SIGKILLs the rest of their process groups (children that ignore SIGTERM)."""
        a = self.agent(["--nproc-per-node", "2"],
                       self.stub("--beats", "0", "--ignore-term", "--child", self.marker))
        a.wait_for(r"round 0: first progress")
        deadline = time.time() + 10 * T
        while len(procs_with(self.marker + "-g0-child")) < 2 and time.time() < deadline:
            time.sleep(0.01)
        self.assertEqual(len(procs_with(self.marker + "-g0-child")), 2)
        a.p.kill()
        a.p.wait()
        t0 = time.time()
        left = procs_with(self.marker)  # workers, their children, the guardian (agent's argv)
        while left and time.time() - t0 < 3 * T:
            time.sleep(0.01)
            left = procs_with(self.marker)
        self.assertEqual(left, [], "processes left after SIGKILL of the agent")
        print(f"\n  agent killed: its process tree was gone after {time.time() - t0:.3f} s",
              file=sys.stderr)

    def test_guardian_keeps_out_of_the_terminal_group(self):
        """The guardian has its own process group, only its pipe and /dev/null open, SIGINT and
        SIGTERM blocked: ^C to the agent's group is a preemption, the guardian serves on (no
        warning about it) and leaves with the agent."""
        a = self.agent(["--nproc-per-node", "1"], self.stub("--beats", "0"), session=True)
        a.wait_for(r"round 0: first progress")
        worker = a.pids(0)[0]
        guards = [c for c in children(a.p.pid) if c != worker]
        self.assertEqual(len(guards), 1, children(a.p.pid))
        g = guards[0]
        self.assertEqual(stat_of(g)[2], g)  # leads its own group
        fds = {int(fd): os.readlink(f"/proc/{g}/fd/{fd}") for fd in os.listdir(f"/proc/{g}/fd")}
        self.assertEqual(sorted(fds), [0, 1, 2, 3], fds)
        self.assertEqual({fds[0], fds[1], fds[2]}, {"/dev/null"})
        self.assertTrue(fds[3].startswith("pipe:"), fds)
        with open(f"/proc/{g}/status") as f:
            blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", f.read(), re.M).group(1), 16)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.assertTrue(blocked & (1 << (sig - 1)), f"{sig!r} not blocked")
        os.killpg(a.p.pid, signal.SIGINT)
        self.assertEqual(a.wait(10), 143, a.err())
        self.assertIn("[rank 0] term rank=0 gen=0", a.out())
        self.assertNotIn("guardian", a.err())
        self.assertFalse(alive(g), "the guardian outlived the agent")

    def test_busy_store_port_is_replaced(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
            busy = s.getsockname()[1]
            rc, out, err = self.run_agent(
                ["--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{busy}"],
                self.stub("--beats", "2"))
        self.assertEqual(rc, 0, err)
        self.assertIn(f"store port {busy} on 127.0.0.1 is busy: hosting the store on a free port", err)
        port = int(re.search(r"store on 127\.0\.0\.1:(\d+)", err).group(1))
        self.assertNotEqual(port, busy)
        self.assertNotRegex(err, r"restart \d")

    def test_slow_output_reader_does_not_block_the_agent(self):
        """A worker floods stdout (4 MiB) while nobody reads the agent's stdout pipe: the agent
        waits a bounded time, then drops lines (and says so) and still serves the workers."""
        err_path = os.path.join(self.tmp, "slow.err")
        with open(err_path, "w") as errf:
            p = subprocess.Popen([ELASTIC, "--nproc-per-node", "1", "--"] +
                                 self.stub("--beats", "2", "--spam", "4096"),
                                 stdout=subprocess.PIPE, stderr=errf, env=harness.env())
        try:
            t0 = time.time()
            while time.time() - t0 < 30 * T and "every worker exited 0" not in harness.read(err_path):
                time.sleep(0.02)
            took = time.time() - t0
            err = harness.read(err_path)
        finally:
            out = p.stdout.read()
            p.wait(timeout=30)
            p.stdout.close()
        self.assertEqual(p.returncode, 0, err[-2000:])
        self.assertIn("every worker exited 0", err[-2000:])
        self.assertLess(took, 15 * T)
        self.assertRegex(err, r"output to the agent's stdout is blocked: dropping worker lines")
        self.assertRegex(err, r"\d+ lines of worker output were dropped")
        self.assertLess(out.count(b"\n"), 4096)


class WithTrain(ElasticTest):
    def setUp(self):
        super().setUp()
        self.ckpt = os.path.join(self.tmp, "ck")

    def train_cmd(self, extra=()):
        return [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + [
            "--ckpt-dir", self.ckpt, "--ckpt-every", "5", "--resume", "auto"] + list(extra)

    def reference(self):
        p = harness.run([harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS, check=True)
        return harness.final(p)["digest"]

    def final(self, out):
        m = FINAL_RE.search(out)
        self.assertIsNotNone(m, out[-2000:])
        return int(m.group(1)), m.group(4)

    def test_c16_kill_one_rank_one_restart_same_digest(self):
        """C16: W=4, SIGKILL rank 2 mid-run, while the others are in a collective: every survivor
        fails at once, no process of the round is left, the agent restarts the group, the job
        resumes from the newest snapshot and ends with the uninterrupted run's digest."""
        ref = self.reference()
        a = self.agent(["--nproc-per-node", "4", "--hang-timeout", "60"], self.train_cmd())
        a.wait_for(r"\[rank 0\] .*step 12/")
        old = a.pids(0)
        t_kill = time.time()
        os.kill(old[2], signal.SIGKILL)
        # WARN when the agent reaps rank 2 first; INFO when a survivor's exit (it noticed the
        # dead peer within milliseconds) was reaped first and the group is already stopping
        m = a.wait_for(rf"(\d\d):(\d\d):(\d\d\.\d+) (?:WARN|INFO)  \[elastic\] rank 2 "
                       rf"\(pid {old[2]}\) was killed by signal 9")
        a.wait_for(r"round 1: started")
        for pid in old:  # the whole round is gone before round 1 starts
            self.assertRaises(ProcessLookupError, os.kill, pid, 0)
        self.assertEqual(a.wait(120), 0, a.err())
        self.assertEqual(self.rounds(a.err()), [0, 1])
        for r in (0, 1, 3):
            self.assertRegex(a.err(), rf"rank {r} \(pid {old[r]}\) exited with status 1 ")
        step, digest = self.final(a.out())
        self.assertEqual(step, 30)
        self.assertEqual(digest, ref)
        # from memory (the memory tier, on under elastic: step 11 or 12, the last one every
        # rank had copied; its sync mode's third slot keeps it even while step 10 still
        # persists from its slot, test_mem test_sync_third_slot_...) or, where the default
        # budget holds only two slots, from the newest disk snapshot
        self.assertRegex(a.err(), r"\[rank 0\] .*resumed from (?:\S*step-0000000(05|10) at step (5|10)|"
                                  r"memory \(own\) at step 1[0-2])\b")
        lt = time.gmtime(t_kill)
        noticed = (int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))) - \
            (lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec + (t_kill % 1))
        first = re.search(r"round 1: first progress after (\S+) s", a.err())
        print(f"\n  dead rank noticed after {noticed * 1000:.1f} ms; round 1 first step after "
              f"{first.group(1) if first else '?'} s", file=sys.stderr)

    def test_train_usage_error_is_not_retried(self):
        rc, out, err = self.run_agent(["--nproc-per-node", "2"], self.train_cmd(["--bogus-flag"]))
        self.assertEqual(rc, 2, err)
        self.assertEqual(self.rounds(err), [0])
        self.assertIn("a usage or configuration error, not restarting", err)

    def test_malformed_data_is_not_retried(self):
        """Issue 9 item 5: a bad data file (bad magic, empty, truncated, fewer tokens than one
        sample) made train exit 1, and the agent burned its whole restart budget on it; an
        input error found before the first step is exit 2, never retried."""
        shards = {"magic": struct.pack("<3i", 12345, 1, 10) + bytes(1012) + bytes(20),
                  "empty": b"",
                  "truncated": struct.pack("<3i", 20240520, 1, 1000) + bytes(1012) + bytes(10),
                  "tiny": struct.pack("<3i", 20240520, 1, 10) + bytes(1012) + bytes(20)}
        for what, content in shards.items():
            bad = os.path.join(self.tmp, f"{what}_000000.bin")
            with open(bad, "wb") as f:
                f.write(content)
            cmd = [harness.TRAIN, "--data", bad] + TRAIN_ARGS
            rc, out, err = self.run_agent(["--nproc-per-node", "2", "--max-restarts", "3"], cmd)
            self.assertEqual(rc, 2, (what, err[-2000:]))
            self.assertEqual(self.rounds(err), [0], what)
            self.assertIn("a usage or configuration error, not restarting", err)
            self.assertIn(bad, err)

    def test_folder_moved_away_no_rank_makes_it_again(self):
        """The snapshot folder moved away under a 2-rank job (lost lock): no rank makes it
        again or writes there - rank 1 used to recreate it at its next save and go on writing
        its parts into it; rank 0 names the lost lock, and the job ends non-zero (no restart:
        --max-restarts 0)."""
        cmd = self.train_cmd(["--steps", "400", "--keep-last", "2"])
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "0"], cmd)
        a.wait_for(r"snapshot step 5 committed")
        os.rename(self.ckpt, self.ckpt + ".moved")
        # while the ranks train on (and try to save every 5 steps), the folder stays gone
        deadline = time.time() + 3
        seen = 0
        while time.time() < deadline and a.p.poll() is None:
            self.assertFalse(os.path.exists(self.ckpt), os.listdir(self.ckpt) if os.path.isdir(self.ckpt) else "")
            seen += 1
            time.sleep(0.02)
        rc = a.wait(300)
        self.assertGreater(seen, 10)
        self.assertNotEqual(rc, 0, a.err()[-2000:])
        self.assertRegex(a.err(), r"\[rank 0\] .*this run's lock on it is gone")
        self.assertRegex(a.err(), r"\[rank 1\] .*is gone or has no \.lock")
        # after the failed round the agent's flush writes the newest memory snapshot there,
        # under a new lock of its own (a folder another run held would be refused): nothing else
        if os.path.exists(self.ckpt):
            self.assertEqual([n for n in os.listdir(self.ckpt) if n.startswith(".tmp-")], [])

    def test_preempt_final_snapshot_then_resume(self):
        """SIGTERM to the agent: the ranks finish the step, take a final snapshot and exit 143;
        the agent exits 143; the relaunch resumes from that snapshot to the same digest."""
        ref = self.reference()
        a = self.agent(["--nproc-per-node", "2"], self.train_cmd())
        a.wait_for(r"\[rank 0\] .*step 8/")
        a.p.send_signal(signal.SIGTERM)
        self.assertEqual(a.wait(60), 143, a.err())
        m = re.search(r"stopping after step (\d+) with a final snapshot", a.out() + a.err())
        self.assertIsNotNone(m, a.out()[-2000:])
        last = int(m.group(1))
        self.assertIn(f"step-{last:09d}", harness.snapshot_dirs(self.ckpt))
        b = self.agent(["--nproc-per-node", "2"], self.train_cmd())
        self.assertEqual(b.wait(120), 0, b.err())
        self.assertRegex(b.err(), rf"resumed from \S*step-{last:09d} at step {last}\b")
        self.assertEqual(self.final(b.out()), (30, ref))


class MultiNode(ElasticTest):
    def multi(self, port, nnodes, nproc, cmd, extra=(), env=None, name=None, rdzv_id="job", hb="1"):
        return self.agent(["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-endpoint",
                           f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--heartbeat-timeout", hb,
                           "--last-call", "0.5", "--stop-grace", "3"] + list(extra), cmd,
                          extra_env=env, name=name)

    def test_two_nodes_ranks_and_success(self):
        port = free_port()
        a = self.multi(port, "2", 2, self.stub("--beats", "3"), name="A")
        a.wait_for(r"hosting the rendezvous store")
        b = self.multi(port, "2", 2, self.stub("--beats", "3"), name="B")
        self.assertEqual(a.wait(), 0, a.err())
        self.assertEqual(b.wait(), 0, b.err())
        out = a.out() + b.out()
        ranks = sorted(int(x) for x in re.findall(r"start rank=(\d+) gen=0 pid=\d+ world=4 ", out))
        self.assertEqual(ranks, [0, 1, 2, 3])
        self.assertRegex(out, rf"addr=127\.0\.0\.1:{port} hosted=1 run=job ")
        self.assertIn("job finished", a.err())
        self.assertIn("joining the rendezvous store", b.err())

    def test_wrong_token_agent_is_refused(self):
        port = free_port()
        a = self.multi(port, "1:2", 1, self.stub("--beats", "0"), env={"ELASTIC_STORE_TOKEN": "right"},
                       name="A")
        a.wait_for(r"round 0: first progress")
        b = self.multi(port, "1:2", 1, self.stub("--beats", "0"), env={"ELASTIC_STORE_TOKEN": "wrong"},
                       name="B")
        self.assertEqual(b.wait(30), 1)
        self.assertRegex(b.err(), rf"ERROR .*the rendezvous store at 127\.0\.0\.1:{port} refused "
                         r"this agent's token: ELASTIC_STORE_TOKEN differs from the one of the "
                         r"agent hosting the store")
        self.assertEqual(len(re.findall(r"ERROR", b.err())), 1, b.err())
        self.assertNotIn("wrong", b.err().replace("wrong token", ""))
        a.p.send_signal(signal.SIGTERM)
        self.assertEqual(a.wait(), 143)

    def test_agents_with_other_settings_are_refused(self):
        """An agent whose --nproc-per-node or --nnodes differ from those of the agent hosting
        the store is refused (exit 2, one line naming the difference) and disturbs nothing: a
        matching agent then forms the job with the host."""
        port = free_port()
        cmd = self.stub("--beats", "2")
        a = self.multi(port, "2", 2, cmd, name="A")
        a.wait_for(r"registered with the rendezvous store")
        for nnodes, nproc, diff in [("2", 1, "--nproc-per-node 1 here, 2 in the job"),
                                    ("1:2", 2, "--nnodes 1:2 here, 2 in the job"),
                                    ("2:3", 3, "--nproc-per-node 3 here, 2 in the job; "
                                               "--nnodes 2:3 here, 2 in the job")]:
            b = self.multi(port, nnodes, nproc, cmd, name=f"bad{nproc}")
            self.assertEqual(b.wait(30), 2, b.err())
            errors = re.findall(r"ERROR .*", b.err())
            self.assertEqual(len(errors), 1, b.err())
            self.assertRegex(errors[0], rf"refusing to join job job at 127\.0\.0\.1:{port}: "
                             rf"{re.escape(diff)} \(")
            self.assertNotIn("started ranks", b.err())
        d = self.multi(port, "2", 2, cmd, name="D")
        self.assertEqual(a.wait(), 0, a.err())
        self.assertEqual(d.wait(), 0, d.err())
        ranks = sorted(int(x) for x in re.findall(r"start rank=(\d+) gen=0 pid=\d+ world=4 ",
                                                  a.out() + d.out()))
        self.assertEqual(ranks, [0, 1, 2, 3])

    def test_another_job_on_the_store_is_refused(self):
        """Two jobs (--rdzv-id) on one endpoint: the second job's agent is refused at once (exit
        2) instead of depending on the first job's store; the first job runs on untouched."""
        port = free_port()
        cmd = self.stub("--beats", "0")
        a = self.multi(port, "1:2", 1, cmd, name="A", rdzv_id="jobA")
        a.wait_for(r"round 0: first progress")
        t0 = time.time()
        b = self.multi(port, "1:2", 1, cmd, name="B", rdzv_id="jobB")
        self.assertEqual(b.wait(30), 2, b.err())
        self.assertLess(time.time() - t0, 5 * T)
        errors = re.findall(r"ERROR .*", b.err())
        self.assertEqual(len(errors), 1, b.err())
        self.assertIn(f"the store at 127.0.0.1:{port} serves job jobA; give this job its own "
                      "--rdzv-endpoint", errors[0])
        self.assertNotIn("started ranks", b.err())
        a.p.send_signal(signal.SIGTERM)
        self.assertEqual(a.wait(), 143, a.err())
        self.assertEqual(self.rounds(a.err()), [0])  # no scale-up, no stop because of B

    def test_worker_usage_error_ends_every_agent(self):
        port = free_port()
        a = self.multi(port, "2", 1, self.stub("--beats", "0"), name="A")
        a.wait_for(r"hosting the rendezvous store")
        b = self.multi(port, "2", 1, self.stub("--beats", "0", "--fail", "1:0:2:2"), name="B")
        self.assertEqual(b.wait(), 2, b.err())
        self.assertEqual(a.wait(), 2, a.err())
        self.assertIn("usage or configuration error", a.err())
        self.assertEqual(self.rounds(a.err()), [0])

    def test_c27_kill_one_agent_of_three_finishes_smaller(self):
        """C27: three agents (2:3), one rank each, train; SIGKILL the third agent: the other two
        re-rendezvous as W=2, resume from the newest snapshot (re-sharded) and finish."""
        port = free_port()
        args = [harness.TRAIN] + harness.data_args()[:2] + [
            "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
            "--global-batch", "12", "--micro-batch", "2", "--steps", "80", "--seed", "3",
            "--log-every", "1", "--ckpt-dir", os.path.join(self.tmp, "ck"), "--ckpt-every", "4",
            "--resume", "auto"]
        # three busy ranks on two cores: a generous heartbeat timeout (the dead rank is what
        # the survivors notice first anyway)
        a = self.multi(port, "2:3", 1, args, name="A", hb="5")
        a.wait_for(r"hosting the rendezvous store")
        b = self.multi(port, "2:3", 1, args, name="B", hb="5")
        b.wait_for(r"registered")
        c = self.multi(port, "2:3", 1, args, name="C", hb="5")
        for x in (a, b, c):
            x.wait_for(r"round 0: node \d of 3")
        deadline = time.time() + 60 * T  # rank 0 (step lines) is on whichever agent is node 0
        while (not any(re.search(r"\[rank 0\] .*step 9/80", x.err()) for x in (a, b, c))
               and time.time() < deadline):
            time.sleep(0.01)
        self.assertIsNone(c.p.poll())
        c.p.kill()
        c.p.wait()
        self.assertEqual(a.wait(120), 0, a.err())
        self.assertEqual(b.wait(120), 0, b.err())
        errs = a.err() + b.err()
        self.assertRegex(errs, r"round 1: node \d of 2, ranks \d\.\.\d of world size 2")
        self.assertRegex(errs, r"world size 2, ZeRO")
        self.assertRegex(errs, r"resumed from (?:\S*step-\d+|memory \((?:own|replica|peer)\)) at step \d+")
        self.assertRegex(a.out() + b.out(), r"\[rank 0\] final step=80 ")

    def test_scale_up_when_an_agent_joins(self):
        port = free_port()
        cmd = self.stub("--beats", "5", "--forever", "*:0")
        a = self.multi(port, "1:3", 1, cmd, name="A")
        a.wait_for(r"hosting the rendezvous store")
        b = self.multi(port, "1:3", 1, cmd, name="B")
        a.wait_for(r"round 0: node \d of 2")
        a.wait_for(r"round 0: first progress")
        b.wait_for(r"round 0: first progress")
        c = self.multi(port, "1:3", 1, cmd, name="C")
        for x in (a, b, c):
            self.assertEqual(x.wait(), 0, x.err())
        self.assertIn("scale-up", a.err())
        for x in (a, b, c):
            self.assertRegex(x.err(), r"round 1: node \d of 3, ranks \d\.\.\d of world size 3")
            self.assertNotIn("restart 1", x.err())  # a scale-up is not a failure
        # C joined round 1 first (it was waiting), yet A and B keep their node ranks: sticky
        self.assertEqual(self.node_of(a, 1), self.node_of(a, 0))
        self.assertEqual(self.node_of(b, 1), self.node_of(b, 0))
        self.assertEqual(self.node_of(c, 1), 2)

    @staticmethod
    def node_of(agent, gen):
        m = re.search(rf"round {gen}: node (\d+) of \d+, ranks", agent.err())
        assert m, agent.err()
        return int(m.group(1))

    def test_node_ranks_are_sticky_across_a_restart(self):
        """Three agents, one rank each; rank 2 fails in round 0. Its agent sees the failure first
        and joins round 1 first (the join order), yet every agent keeps its node rank, so each
        rank comes back on the node whose memory tier holds its own slot."""
        port = free_port()
        cmd = self.stub("--beats", "4", "--fail", "2:0:1:2")
        agents = []
        for name in "ABC":
            x = self.multi(port, "3", 1, cmd, name=name, extra=["--max-restarts", "2"])
            agents.append(x)
            if name == "A":
                x.wait_for(r"hosting the rendezvous store")
        for x in agents:
            self.assertEqual(x.wait(60), 0, x.err())
        self.assertEqual(sorted(self.node_of(x, 0) for x in agents), [0, 1, 2])
        for x in agents:
            self.assertEqual(self.node_of(x, 1), self.node_of(x, 0), x.err())
        # and the ranks the workers saw
        for x in agents:
            r0 = re.findall(r"start rank=(\d+) gen=0 ", x.out())
            r1 = re.findall(r"start rank=(\d+) gen=1 ", x.out())
            self.assertEqual((r0, r1), ([str(self.node_of(x, 0))],) * 2, x.out())

    def test_scale_up_waits_for_the_members_still_stopping(self):
        """A runs alone (--nnodes 1:2, --last-call 0.5); B joins, so A's round stops (scale-up)
        and A's worker takes 3 s to stop (a final snapshot, an upload drain). Round 1 must not
        close with B alone after the last call while A's worker still holds its snapshot
        folder (B's rank then met A's lock and the job ended with exit 2): it waits for A, and
        round 1 has both nodes; B's worker starts after A's exited."""
        port = free_port()
        cmd = self.stub("--beats", "5", "--forever", "*:0", "--term-sleep", "3")
        a = self.multi(port, "1:2", 1, cmd, name="A")
        a.wait_for(r"round 0: first progress")
        b = self.multi(port, "1:2", 1, cmd, name="B")
        for x in (a, b):
            self.assertEqual(x.wait(60), 0, x.err())
        self.assertIn("scale-up", a.err())
        self.assertRegex(b.err(), r"round 1: waiting for 1 agent\(s\) of round 0 to finish stopping")
        for x in (a, b):
            self.assertRegex(x.err(), r"round 1: node \d of 2, ranks \d\.\.\d of world size 2")
            self.assertNotIn("round 1: node 0 of 1", x.err())
        self.assertIn("exit rank=0 gen=0", a.out())
        self.assertRegex(b.out(), r"start rank=\d gen=1 .*world=2 ")

    def test_c28_leave_and_rejoin_cycles_are_counted(self):
        """C28: node B leaves (SIGKILL) and rejoins at once, again and again; with
        --max-restarts 3 the fourth departure ends the job with a clear message."""
        port = free_port()
        cmd = self.stub("--beats", "0")
        extra = ["--max-restarts", "3"]
        a = self.multi(port, "1:2", 1, cmd, extra, name="A")
        a.wait_for(r"hosting the rendezvous store")
        b = self.multi(port, "1:2", 1, cmd, extra, name="B0")
        cycles = 0
        while cycles < 5 and a.p.poll() is None:
            # B is running a worker, or A has given up meanwhile
            deadline = time.time() + 30 * T
            while (a.p.poll() is None and b.p.poll() is None and
                   not re.search(r"round \d+: first progress", b.err()) and time.time() < deadline):
                time.sleep(0.01)
            if a.p.poll() is not None or b.p.poll() is not None:
                break
            b.p.kill()  # leave ...
            b.p.wait()
            cycles += 1
            b = self.multi(port, "1:2", 1, cmd, extra, name=f"B{cycles}")  # ... and rejoin at once
        self.assertEqual(a.wait(60), 1, a.err())
        err = a.err()
        for k in (1, 2, 3):
            self.assertIn(f"restart {k} of at most 3", err)
        self.assertNotIn("restart 4", err)
        self.assertRegex(err, r"giving up: restart budget exhausted: 3 restart\(s\) used of "
                         r"--max-restarts 3")
        self.assertEqual(cycles, 4)
        self.assertEqual(b.wait(30), 1, b.err())
        self.assertRegex(b.err(), r"job ended by another node \(exit 1\): .*restart budget exhausted")

    def ranks_per_round(self, agents):
        """{round: sorted ranks the workers started with}, from the stub's start lines."""
        out = {}
        for x in agents:
            for r, g in re.findall(r"start rank=(\d+) gen=(\d+) ", x.out()):
                out.setdefault(int(g), []).append(int(r))
        return {g: sorted(v) for g, v in out.items()}

    def test_ghost_joiner_takes_a_placeholder_rank(self):
        """A joiner that ADDs its number for round 1 and dies before writing its descriptor:
        round 1 (a scale-up) closes with it as "?<k>" in the node ranks, A and B keep theirs
        and the ghost gets the free rank 2; its heartbeats never come, so round 1 fails and
        round 2 runs with A and B, who finish."""
        port = free_port()
        cmd = self.stub("--beats", "20", "--forever", "*:0")
        ex = ["--max-restarts", "3"]
        a = self.multi(port, "2:3", 1, cmd, ex, name="A")
        a.wait_for(r"hosting the rendezvous store")
        b = self.multi(port, "2:3", 1, cmd, ex, name="B")
        a.wait_for(r"round 0: first progress")
        b.wait_for(r"round 0: first progress")
        st = RawStore(port)
        self.assertEqual(st.add("rdzv/job/r/1/n"), 1)
        st.close()
        for x in (a, b):
            self.assertEqual(x.wait(60), 0, x.err())
        for x in (a, b):
            self.assertRegex(x.err(), r"round 1: node \d of 3")
            self.assertEqual(self.node_of(x, 1), self.node_of(x, 0), x.err())
            self.assertRegex(x.err(), r"node 2 \(\(never registered\)\) of round 1 missed its "
                             r"heartbeats")
        rounds = self.ranks_per_round([a, b])
        self.assertEqual(rounds[0], [0, 1])
        self.assertEqual(rounds[1], [0, 1])  # rank 2 is the ghost's: nobody started it
        self.assertEqual(rounds[max(rounds)], [0, 1])

    def test_malformed_node_ranks_fail_with_one_line(self):
        """r/0/ranks written by someone else before the round closes (one entry for two nodes):
        both agents exit 1 naming the key, not "lost the rendezvous store"; no worker starts."""
        port = free_port()
        cmd = self.stub("--beats", "3")
        a = self.multi(port, "2", 1, cmd, name="A")
        a.wait_for(r"registered with the rendezvous store")
        st = RawStore(port)
        st.set("rdzv/job/r/0/ranks", "garbage")
        st.close()
        b = self.multi(port, "2", 1, cmd, name="B")
        for x in (a, b):
            self.assertEqual(x.wait(60), 1, x.err())
            errors = re.findall(r"ERROR .*", x.err())
            self.assertEqual(len(errors), 1, x.err())
            self.assertRegex(errors[0], r"round 0: the node ranks in the store \(key "
                             r"rdzv/job/r/0/ranks\) are malformed or do not name this agent")
            self.assertNotIn("start rank=", x.out())

    def test_seventeen_agents_in_one_round_keep_the_host_alive(self):
        """The host A meets 17 and more distinct agents: 17 ghost joiners (numbers and
        descriptors written through a bare store client, no heartbeats) and B join round 0 of
        a 2:20 job. A's watcher used to keep pointers into its peer table while adding the
        round's members, and the table moves when it grows past 16: A read freed memory (the
        sticky ranks then named nobody it knew, and A left with "lost the rendezvous store (Bad
        message)", ending the job; found with 15 replacement cycles of B under ASan). Now the
        ghosts miss their heartbeats, round 0 fails, and round 1 runs with A and B only."""
        port = free_port()
        cmd = self.stub("--beats", "3", "--forever", "*:0")
        extra = ["--max-restarts", "3"]
        a = self.multi(port, "2:20", 1, cmd, extra, name="A")
        a.wait_for(r"hosting the rendezvous store")
        st = RawStore(port)
        for k in range(17):
            n = st.add("rdzv/job/r/0/n")
            st.set(f"rdzv/job/r/0/a/{n}", f"{0xfeed0000 + k:016x} ghost{k}:1 {1000 + k}")
        st.close()
        b = self.multi(port, "2:20", 1, cmd, extra, name="B")
        for x in (a, b):
            self.assertEqual(x.wait(60), 0, x.err())
            self.assertRegex(x.err(), r"round 0: node \d+ of 19, ranks")
            self.assertRegex(x.err(), r"round 1: node \d of 2, ranks")
            self.assertNotIn("lost the rendezvous store", x.err())
        self.assertRegex(a.err(), r"node \d+ \(ghost\d+:1 \d+\) of round 0 missed its heartbeats")
        rounds = self.ranks_per_round([a, b])
        self.assertEqual(len(rounds[0]), 2, rounds)  # the ghosts' 17 ranks never started
        self.assertEqual(len(set(rounds[0])), 2, rounds)
        self.assertEqual(rounds[1], [0, 1], rounds)

    def test_store_flood_during_rendezvous_and_restart(self):
        """Issue 9 item 4: a flood of silent sockets (1100, more than max_clients, each replaced
        as soon as the store closes it) on the store of agent A while agent B joins, the ranks
        build their mesh through the store, rank 1 is SIGKILLed after a committed snapshot and
        both agents re-rendezvous and restart the ranks through the store: the job resumes and
        finishes (exit 0). The store evicts the flood's oldest silent sockets (its pre-hello
        quota) and lets the job's clients in; before, the flood held max_clients."""
        port = free_port()
        cmd = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS[:-4] + [
            "--steps", "60", "--log-every", "1", "--ckpt-dir", os.path.join(self.tmp, "ck"),
            "--ckpt-every", "5", "--resume", "auto"]
        # the flood competes for the cores: a generous heartbeat timeout
        a = self.multi(port, "2", 1, cmd, name="A", hb="5")
        a.wait_for(r"hosting the rendezvous store")
        flood = Flood(port)
        flood.start()
        try:
            deadline = time.time() + 10 * T
            while flood.opened < flood.n and time.time() < deadline:
                time.sleep(0.01)
            self.assertGreaterEqual(flood.opened, flood.n, "the flood did not get going")
            t0 = time.time()
            b = self.multi(port, "2", 1, cmd, name="B", hb="5")
            b.wait_for(r"round 0: node \d of 2", timeout=20)
            joined = time.time() - t0
            for x in (a, b):
                x.wait_for(r"round 0: started ranks")
            victim = next(x for x in (a, b)
                          if re.search(r"round 0: started ranks 1\.\.1", x.err()))
            victim.wait_for(r"\[rank 1\] .*snapshot step \d+ committed", timeout=30)
            os.kill(victim.pids(0)[0], signal.SIGKILL)
            t_kill = time.time()
            for x in (a, b):
                x.wait_for(r"round 1: first progress", timeout=30)
            restarted = time.time() - t_kill
            self.assertEqual(a.wait(60), 0, a.err())
            self.assertEqual(b.wait(60), 0, b.err())
        finally:
            flood.stop()
        errs = a.err() + b.err()
        self.assertEqual(self.rounds(a.err()), [0, 1])
        self.assertRegex(errs, r"rank 1 \(pid \d+\) was killed by signal 9")
        self.assertRegex(errs, r"resumed from (?:\S*step-\d+|memory \((?:own|replica|peer)\)) at step \d+")
        self.assertRegex(a.out() + b.out(), r"\[rank 0\] final step=60 ")
        self.assertIn("connections without a hello (max_unauthed)", a.err())  # evictions logged
        print(f"\n  store flood: {flood.opened} silent connections in {flood.t1 - flood.t0:.1f} s "
              f"({flood.rate():.0f}/s, up to {flood.peak} held, {flood.failed} failed); agent B "
              f"joined after {joined:.2f} s; round 1 made progress {restarted:.2f} s after the "
              f"kill", file=sys.stderr)

    def test_c30_store_host_killed_others_fail_fast(self):
        """C30: SIGKILL the agent that hosts the store: the others stop their workers and exit 1
        within seconds, naming the endpoint."""
        port = free_port()
        cmd = self.stub("--beats", "0")
        a = self.multi(port, "2:3", 1, cmd, name="A")
        a.wait_for(r"hosting the rendezvous store")
        b = self.multi(port, "2:3", 1, cmd, name="B")
        c = self.multi(port, "2:3", 1, cmd, name="C")
        for x in (b, c):
            x.wait_for(r"round 0: first progress")
        t0 = time.time()
        a.p.kill()
        a.p.wait()
        for x in (b, c):
            self.assertEqual(x.wait(20), 1, x.err())
            self.assertIn(f"lost the rendezvous store at 127.0.0.1:{port}", x.err())
        took = time.time() - t0
        self.assertLess(took, 5 * T)
        print(f"\n  store host killed: the other agents exited after {took:.2f} s", file=sys.stderr)


if __name__ == "__main__":
    harness.main()
