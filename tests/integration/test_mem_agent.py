"""The agent's side of the memory tier (issue 13, elastic/agent_mem.c): the segment folder,
the prefix and its lease, stale clean-up (a killed agent of the same job, not another job, not
a live agent), CKPT_MEM_PATH for every worker, 0600 files and none left after the job, the
flush (the worker command with CKPT_MEM_FLUSH=1) after a failure and on preemption, and the
peer replica between two agents on loopback (same payload, complete; a wrong token refused).

The workers are tests/tools/elastic_worker.py; real segments are written by
build/tests/shmseg-tool (common/shmseg.c), so the replica carries what a worker committed.
Every segment folder is a private one under /dev/shm (ckpttest-*). Synchronisation is by log
lines and files, never by sleeping.
"""
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

import harness
from test_elastic import ELASTIC, ElasticTest, T, alive, free_port

TOOL = os.environ.get("CKPT_SHMSEG_TOOL", os.path.join(harness.BUILD, "tests", "shmseg-tool"))
PREFIX_RE = re.compile(r"memory tier: segments in (\S+), prefix (ckptmem-([0-9a-f]{16})-[0-9a-f]{16})")


def wait_until(cond, timeout, what):
    deadline = time.time() + timeout * T
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def tool_info(path):
    p = subprocess.run([TOOL, "info", path], capture_output=True, text=True)
    return p.returncode, p.stdout


class MemAgent(ElasticTest):
    def setUp(self):
        super().setUp()
        self.shm = tempfile.mkdtemp(prefix="ckpttest-", dir="/dev/shm")

    def tearDown(self):
        try:
            super().tearDown()
        finally:
            for n in os.listdir(self.shm):
                os.unlink(os.path.join(self.shm, n))
            os.rmdir(self.shm)

    def files(self, d=None):
        return sorted(os.listdir(d or self.shm))

    def prefix(self, a):
        m = a.wait_for(PREFIX_RE.pattern)
        return m.group(2), m.group(3)

    # ------------------------------------------------------------------ names, env, removal

    def test_env_modes_and_removal(self):
        """Every worker gets CKPT_MEM_PATH=<dir>/<prefix> (an inherited CKPT_MEM_FLUSH is not
        passed on), the lease and the segments are 0600 while the job runs, and nothing is left
        after it."""
        a = self.agent(["--nproc-per-node", "2", "--mem-dir", self.shm],
                       self.stub("--beats", "0", "--mem-segment", f"{TOOL}:8192:5000"),
                       extra_env={"CKPT_MEM_FLUSH": "1", "CKPT_MEM_PATH": "/elsewhere"})
        prefix, _ = self.prefix(a)
        path = os.path.join(os.path.realpath(self.shm), prefix)
        a.wait_for(r"seg rank=0 .*\n(.|\n)*seg rank=1 |seg rank=1 .*\n(.|\n)*seg rank=0 ", stream="out")
        names = self.files()
        self.assertEqual(names, sorted([prefix + ".lease", prefix + ".own-0", prefix + ".own-1"]))
        for n in names:
            st = os.lstat(os.path.join(self.shm, n))
            self.assertTrue(stat.S_ISREG(st.st_mode), n)
            self.assertEqual(st.st_mode & 0o777, 0o600, n)
        mems = re.findall(r"^\[rank \d\] start .* mem=(\S+) mflush=(\S+)$", a.out(), re.M)
        self.assertEqual(mems, [(path, "None")] * 2)
        self.assertEqual(tool_info(path + ".own-1")[0], 0)
        a.p.send_signal(signal.SIGTERM)
        self.assertEqual(a.wait(), 143, a.err())
        self.assertEqual(self.files(), [], a.err())
        self.assertIn("removed this agent's 2 segment file(s)", a.err())

    def test_unusable_mem_dir_is_a_usage_error(self):
        rc, _, err = self.run_agent(["--nproc-per-node", "1", "--mem-dir",
                                     os.path.join(self.shm, "missing")], self.stub("--beats", "1"))
        self.assertEqual(rc, 2, err)
        self.assertRegex(err, r"ERROR .*memory tier: cannot use the segment folder .*missing: No such "
                         r"file or directory")

    def test_mem_dir_too_long_for_the_workers_prefix_is_a_usage_error(self):
        """A folder whose prefix "<dir>/ckptmem-<16>-<16>" (dir + 42 bytes) would fail the
        readers' rule (ckpt_mem_prefix_ok: under 4032 bytes) is refused at start in one line,
        exit 2; one byte shorter is taken."""
        base = os.path.realpath(self.shm)
        def deep(total):  # a folder under self.shm whose real path is `total` bytes
            d = base
            while len(d) < total:
                d = os.path.join(d, "d" * min(200, total - len(d) - 1))
            os.makedirs(d, exist_ok=True)
            self.assertEqual(len(d), total)
            return d
        try:
            ok = deep(3989)
            rc, _, err = self.run_agent(["--nproc-per-node", "1", "--mem-dir", ok],
                                        self.stub("--beats", "1"))
            self.assertEqual(rc, 0, err)
            os.makedirs(ok + "x")
            rc, _, err = self.run_agent(["--nproc-per-node", "1", "--mem-dir", ok + "x"],
                                        self.stub("--beats", "1"))
            self.assertEqual(rc, 2, err)
            lines = [l for l in err.splitlines() if "ERROR" in l]
            self.assertEqual(len(lines), 1, err)
            self.assertRegex(lines[0], r"memory tier: cannot use the segment folder .*: its path "
                             r"is 3990 bytes long, .* at most 4031 \(the folder at most 3989 bytes\)")
            self.assertEqual(os.listdir(ok + "x"), [])
        finally:
            top = os.path.join(base, "d" * 200)
            if os.path.isdir(top):
                subprocess.run(["rm", "-rf", top])

    def test_mem_clean_removes_dead_agents_files_of_every_job(self):
        """elastic --mem-clean: the files of SIGKILLed agents of any job of this uid (lease not
        held) and a prefix without a lease go, one line per prefix with files and bytes; a live
        agent's files stay; exit 0. A folder that cannot be opened: exit 1, one line."""
        seg = ["--beats", "0", "--mem-segment", f"{TOOL}:8192:4096"]
        dead = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm], self.stub(*seg), name="dead")
        other = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm, "--rdzv-id", "other"],
                           self.stub(*seg), name="other")
        live = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm], self.stub(*seg), name="live")
        prefixes = {}
        for name, a in (("dead", dead), ("other", other), ("live", live)):
            prefixes[name] = self.prefix(a)[0]
            a.wait_for(r"seg rank=0 ", stream="out")
        dead.kill()
        other.kill()
        pids = dead.pids(0) + other.pids(0)
        wait_until(lambda: not any(alive(p) for p in pids), 10, "the killed agents' workers")
        orphan = "ckptmem-00000000000000ab-00000000000000cd"  # a removal cut short: no lease
        with open(os.path.join(self.shm, orphan + ".own-0"), "wb") as f:
            f.write(b"x" * 100)
        before = self.files()
        size = lambda p: sum(os.path.getsize(os.path.join(self.shm, n)) for n in before
                             if n.startswith(p + "."))
        want = {p: (len([n for n in before if n.startswith(p + ".")]), size(p))
                for p in (prefixes["dead"], prefixes["other"], orphan)}
        p = subprocess.run([ELASTIC, "--mem-clean", "--mem-dir", self.shm], capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(p.returncode, 0, p.stderr)
        real = os.path.realpath(self.shm)
        got = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in
               re.finditer(rf"^removed {re.escape(real)}/(\S+): (\d+) file\(s\), (\d+) bytes$",
                           p.stdout, re.M)}
        self.assertEqual(got, want, p.stdout)
        self.assertEqual(len(p.stdout.splitlines()), 3, p.stdout)
        after = self.files()
        self.assertEqual(after, [n for n in before if n.startswith(prefixes["live"] + ".")])
        # again: nothing to remove, exit 0, no line
        p = subprocess.run([ELASTIC, "--mem-clean", "--mem-dir", self.shm], capture_output=True,
                           text=True, timeout=30)
        self.assertEqual((p.returncode, p.stdout), (0, ""), p.stderr)
        live.p.send_signal(signal.SIGTERM)
        self.assertEqual(live.wait(), 143)
        p = subprocess.run([ELASTIC, "--mem-clean", "--mem-dir", os.path.join(self.shm, "missing")],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertEqual(len(p.stderr.splitlines()), 1, p.stderr)
        self.assertIn("cannot open the segment folder", p.stderr)

    def test_stale_segments_of_a_dead_agent_of_this_job_are_removed(self):
        """An agent SIGKILLed with its segments leaves them; the next agent of the same job
        removes them (one line with count and bytes), but neither those of a live agent of the
        same job nor those of another job."""
        seg = ["--beats", "0", "--mem-segment", f"{TOOL}:8192:4096"]
        dead = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm], self.stub(*seg),
                          name="dead")
        dead_prefix, job = self.prefix(dead)
        dead.wait_for(r"seg rank=0 ", stream="out")
        other = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm, "--rdzv-id", "other"],
                           self.stub(*seg), name="other")
        other_prefix, other_job = self.prefix(other)
        self.assertNotEqual(job, other_job)
        other.wait_for(r"seg rank=0 ", stream="out")
        live = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm], self.stub(*seg),
                          name="live")
        live_prefix, live_job = self.prefix(live)
        self.assertEqual(live_job, job)
        live.wait_for(r"seg rank=0 ", stream="out")
        dead.kill()
        other.kill()
        pids = dead.pids(0) + other.pids(0)
        self.assertEqual(len(pids), 2)
        wait_until(lambda: not any(alive(p) for p in pids), 10, "the killed agents' workers")
        before = self.files()
        for p in (dead_prefix, other_prefix, live_prefix):
            self.assertIn(p + ".lease", before)
            self.assertIn(p + ".own-0", before)
        dead_bytes = sum(os.path.getsize(os.path.join(self.shm, n)) for n in before
                         if n.startswith(dead_prefix + "."))
        new = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm], self.stub("--beats", "1"),
                         name="new")
        self.assertEqual(new.wait(), 0, new.err())
        self.assertRegex(new.err(), rf"memory tier: removed 2 stale file\(s\) \({dead_bytes} bytes\) "
                         r"of 1 dead agent\(s\) of this job in ")
        after = self.files()
        self.assertFalse([n for n in after if n.startswith(dead_prefix)], after)
        self.assertIn(other_prefix + ".own-0", after)   # another job: never touched
        self.assertIn(live_prefix + ".own-0", after)    # a live agent of this job: kept
        live.p.send_signal(signal.SIGTERM)
        self.assertEqual(live.wait(), 143)
        self.assertEqual([n for n in self.files() if n.startswith(live_prefix)], [])

    # ------------------------------------------------------------------ flush

    def test_flush_after_a_worker_failure(self):
        """A worker that made a segment fails: the agent runs the command with CKPT_MEM_FLUSH=1,
        CKPT_MEM_PATH and no RANK/WORLD_SIZE/store token, relays "[flush] ", logs the result, and
        restarts; a job whose workers made no segment gets no flush."""
        marker = os.path.join(self.tmp, "flushed")
        a = self.agent(["--nproc-per-node", "2", "--mem-dir", self.shm, "--max-restarts", "1"],
                       self.stub("--beats", "3", "--mem-touch", "--fail", "1:0:1:1",
                                 "--flush-marker", marker))
        prefix, _ = self.prefix(a)
        self.assertEqual(a.wait(), 0, a.err())
        lines = harness.read(marker).splitlines()
        path = os.path.join(os.path.realpath(self.shm), prefix)
        self.assertEqual(lines, [f"rank=none world=none local=none path={path} gen=0 token=none"])
        err, out = a.err(), a.out()
        self.assertIn("[flush] flushing", out)
        self.assertRegex(err, r"flush after the failure: .*\n(.|\n)*flush finished: exited with "
                         r"status 0 after ")
        self.assertLess(err.index("flush finished"), err.index("round 1: started"))
        self.assertEqual(self.rounds(err), [0, 1])   # the flush's start is not a round
        self.assertEqual(self.files(), [])
        # no segment: no flush
        b = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm, "--max-restarts", "1"],
                       self.stub("--beats", "3", "--fail", "0:0:1:1", "--flush-marker", marker),
                       name="nomem")
        self.assertEqual(b.wait(), 0, b.err())
        self.assertEqual(len(harness.read(marker).splitlines()), 1)
        self.assertNotIn("flush", b.err())
        # the budget spent: one flush per failed round, none more at the exit
        marker2 = os.path.join(self.tmp, "flushed2")
        c = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm, "--max-restarts", "1"],
                       self.stub("--beats", "3", "--mem-touch", "--fail", "0:*:1:1",
                                 "--flush-marker", marker2), name="budget")
        self.assertEqual(c.wait(), 1, c.err())
        self.assertEqual([l.split()[-2] for l in harness.read(marker2).splitlines()],
                         ["gen=0", "gen=1"])
        self.assertEqual(len(re.findall(r"flush finished", c.err())), 2, c.err())
        self.assertEqual(self.files(), [])

    def test_sigterm_during_a_failure_flush_lets_it_finish(self):
        """A SIGTERM while the flush after a failure runs: the flush finishes (no second
        flush), then the agent exits 143 instead of restarting."""
        marker = os.path.join(self.tmp, "flushed")
        a = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm],
                       self.stub("--beats", "3", "--mem-touch", "--fail", "0:0:1:1",
                                 "--flush-marker", marker, "--flush-sleep", str(1.5 * T)))
        a.wait_for(r"\[flush\] flushing", stream="out")
        a.p.send_signal(signal.SIGTERM)
        self.assertEqual(a.wait(), 143, a.err())
        err = a.err()
        self.assertRegex(err, r"flush: Terminated received: letting the flush finish(.|\n)*"
                         r"flush finished: exited with status 0")
        self.assertEqual(self.rounds(err), [0])
        self.assertEqual(len(harness.read(marker).splitlines()), 1)
        self.assertEqual(self.files(), [])

    def test_flush_on_preemption_and_second_signal(self):
        """SIGTERM to the agent: the workers stop, the flush runs, then the files go and the
        agent exits 143. A flush that hangs is killed by a second signal."""
        marker = os.path.join(self.tmp, "flushed")
        a = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm],
                       self.stub("--beats", "0", "--mem-touch", "--flush-marker", marker),
                       name="pre")
        a.wait_for(r"round 0: first progress")
        a.p.send_signal(signal.SIGTERM)
        self.assertEqual(a.wait(), 143, a.err())
        self.assertEqual(len(harness.read(marker).splitlines()), 1)
        self.assertRegex(a.err(), r"flush on preemption: (.|\n)*flush finished: exited with status 0")
        self.assertEqual(self.files(), [])

        b = self.agent(["--nproc-per-node", "1", "--mem-dir", self.shm],
                       self.stub("--beats", "0", "--mem-touch", "--flush-marker", marker,
                                 "--flush-hang"), name="hang")
        b.wait_for(r"round 0: first progress")
        b.p.send_signal(signal.SIGTERM)
        b.wait_for(r"\[flush\] flushing", stream="out")
        t0 = time.time()
        b.p.send_signal(signal.SIGTERM)
        self.assertEqual(b.wait(), 143, b.err())
        self.assertLess(time.time() - t0, 5 * T)
        self.assertRegex(b.err(), r"flush killed after .* by a second signal")
        # said once: not "SIGKILL, SIGKILL after 0.0 s"
        self.assertRegex(b.err(), r"stopping 1 worker group\(s\) \(flush\): SIGKILL\n")
        self.assertNotIn("SIGKILL, SIGKILL", b.err())
        self.assertEqual(self.files(), [])

    # ------------------------------------------------------------------ replica

    def test_replica_between_two_agents_and_wrong_token(self):
        """Two agents on loopback, each with one worker that writes a real segment: each agent's
        folder gets the other node's slot as <prefix>.rep-<agent id>-0 (the sender's prefix's
        random part), complete, with the same
        bytes; the metrics count them; a connection with a wrong token is refused (answer 1,
        logged without the token) and one with the right token is kept."""
        port, mport = free_port(), free_port()
        token = "sekrit-token-123"
        dirs = [tempfile.mkdtemp(prefix="ckpttest-", dir="/dev/shm") for _ in range(2)]
        try:
            agents = []
            for i, d in enumerate(dirs):
                extra = ["--mem-dir", d] + (["--metrics-port", str(mport)] if i == 0 else [])
                agents.append(self.agent(
                    ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
                     f"127.0.0.1:{port}", "--rdzv-id", "memjob", "--heartbeat-timeout", "2",
                     "--last-call", "0.5"] + extra,
                    self.stub("--beats", "0", "--mem-segment", f"{TOOL}:1048576:1000003"),
                    extra_env={"ELASTIC_STORE_TOKEN": token}, name=f"N{i}"))
                if i == 0:
                    agents[0].wait_for(r"hosting the rendezvous store")
            segs = {}
            prefixes = []
            for a in agents:
                prefixes.append(self.prefix(a)[0])
                m = a.wait_for(r"seg rank=(\d+) slot=\d+ seq=\d+ step=(\d+) bytes=(\d+) xxh=(\S+)",
                               stream="out")
                segs[int(m.group(1))] = (m.group(2), m.group(3), m.group(4))
            for i, a in enumerate(agents):
                a.wait_for(r"memory tier: replica of node \d local slot 0 .* received")
                reps = [n for n in os.listdir(dirs[i]) if n.startswith(prefixes[i] + ".rep-")]
                self.assertEqual(len(reps), 1, os.listdir(dirs[i]))
                src_id = reps[0].split(".rep-")[1].split("-")[0]
                self.assertEqual(src_id, prefixes[1 - i][-16:])  # the other agent's id
                node = int(a.wait_for(r"round 0: node (\d) of 2").group(1))
                src = 1 - node
                rc, info = tool_info(os.path.join(dirs[i], reps[0]))
                self.assertEqual(rc, 0, info)
                self.assertNotIn("writing", info)
                m = re.search(r"step=(\d+) bytes=(\d+) xxh=(\S+)", info)
                # the worker of node src is global rank src (one worker per node)
                self.assertEqual(m.groups(), segs[src], (info, segs))
                self.assertEqual(os.stat(os.path.join(dirs[i], reps[0])).st_mode & 0o777, 0o600)
                a.wait_for(r"memory tier: replica of local slot 0 .* sent to node \d")
            self.assertEqual(sorted(n.split(".rep-")[1].split("-")[0] for d, p in zip(dirs, prefixes)
                                    for n in os.listdir(d) if ".rep-" in n),
                             sorted(p[-16:] for p in prefixes))
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
            self.assertRegex(text, r"(?m)^ckpt_mem_replica_bytes_total 1000003$")
            self.assertRegex(text, r"(?m)^ckpt_mem_replica_step\{node=\"\d\"\} \d+$")

            # the replica server of agent 0, as it logged it
            m = agents[0].wait_for(r"memory tier: replica server on 127\.0\.0\.1:(\d+)")
            rport = int(m.group(1))

            AGENT = 0x7777000000000007

            def frame(tok, src, slot, slot_bytes, payload, step, version=2):
                t = tok.encode()
                return (b"CKMR" + struct.pack("<II", version, len(t)) + t +
                        struct.pack("<IIQQQQQ", src, slot, slot_bytes, len(payload), step, 1, AGENT))

            with socket.create_connection(("127.0.0.1", rport), timeout=10) as s:
                s.sendall(frame(token + "x", 7, 0, 4096, b"", 5))
                self.assertEqual(s.recv(1), b"\x01")     # DENIED
                self.assertEqual(s.recv(1), b"")         # and closed
            agents[0].wait_for(r"refused a replica connection from 127\.0\.0\.1:\d+: wrong job token")
            self.assertFalse([n for n in os.listdir(dirs[0]) if f".rep-{AGENT:016x}-" in n])
            # version 1 (replicas named by node rank) is refused
            with socket.create_connection(("127.0.0.1", rport), timeout=10) as s:
                s.sendall(frame(token, 7, 0, 4096, b"", 5, version=1)[:-8])
                self.assertEqual(s.recv(1), b"\x02")     # BAD
            rep73 = os.path.join(dirs[0], prefixes[0] + f".rep-{AGENT:016x}-3")
            payload = bytes(range(256)) * 20
            with socket.create_connection(("127.0.0.1", rport), timeout=10) as s:
                s.sendall(frame(token, 7, 3, 8192, payload, 42))
                self.assertEqual(s.recv(1), b"\x00")
                s.sendall(payload)
                self.assertEqual(s.recv(1), b"\x00")
            rc, info = tool_info(rep73)
            self.assertEqual(rc, 0, info)
            self.assertRegex(info, rf"step=42 bytes={len(payload)} ")
            # a transfer cut short commits nothing: the slot stays "writing"
            with socket.create_connection(("127.0.0.1", rport), timeout=10) as s:
                s.sendall(frame(token, 7, 3, 8192, payload, 43))
                self.assertEqual(s.recv(1), b"\x00")
                s.sendall(payload[:1000])
            wait_until(lambda: "state=writing" in tool_info(
                rep73)[1], 20, "the cut transfer")
            rc, info = tool_info(rep73)
            self.assertRegex(info, r"step=42 ")          # the previous one is still the newest

            for a in agents:
                self.assertNotIn(token, a.err())
            for a in agents:
                a.p.send_signal(signal.SIGTERM)
            for a in agents:
                self.assertEqual(a.wait(), 143, a.err())
            for d in dirs:
                self.assertEqual(os.listdir(d), [])
        finally:
            for d in dirs:
                for n in os.listdir(d):
                    os.unlink(os.path.join(d, n))
                os.rmdir(d)


if __name__ == "__main__":
    harness.main()
