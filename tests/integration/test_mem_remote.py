"""The memory tier's remote reads (issue 13): a rank whose restore needs slots that are not on
its node reads them from the other nodes' memory through their agents (elastic/mem_client.h),
with every chunk checksum checked, and the log names that source ("memory (peer agent
host:port)"). Three agents on loopback, one rank each, each with its own segment folder under
/dev/shm, memory snapshots every 4 steps, disk snapshots far apart (so memory is newer):

- Node loss with a world-size change: agent C and its worker are SIGKILLed; A and B go on with
  W=2 and restore the snapshot saved by 3 ranks: a survivor holds its own slot and its
  predecessor's replica, and reads the missing rank's slot through the other survivor's agent
  (unless the replicas the senders re-send to their round-1 peers arrived first: which ranks
  need a peer is a race, that at least one does is not); the final digest is that of the same
  schedule from disk: W=1 (the same bits as W=3 with 24 sequences per step, micro-batch 2) to
  the resumed step, then W=2 from that disk snapshot.
- A rank SIGKILLed, the group restarts with W=3: a node holds 2 of the 3 slots and reads the
  third's header and checksums (and its trainer record) through a peer agent; the digest is the
  uninterrupted run's.

Synchronisation is by log lines and segment headers, never by sleeping for a guess.
"""
import os
import re
import shutil
import signal
import sys
import tempfile
import time

import harness
from harness import TempDirTest
from test_elastic import Agent, FINAL_RE, procs_with
from test_mem import slots_of

ARGS = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
        "--global-batch", "24", "--micro-batch", "2", "--steps", "80", "--lr", "3e-3",
        "--warmup", "2", "--seed", "7", "--log-every", "1"]
RESUMED_RE = re.compile(r"\[rank 0\] .*resumed from memory \((own|replica|peer)\) at step (\d+) "
                        r"\(run \S+, saved by (\d+) ranks?\): loaded and checked in (\S+) ms")
PEER_RE = re.compile(r"\[rank (\d+)\] .*memory snapshot mem:\S+: the slots? of saved ranks? "
                     r"([0-9,]+) from memory \(peer agent (127\.0\.0\.1:\d+)\)")
RATE_RE = re.compile(r"\[rank (\d+)\] .*read (\S+) MiB of memory slots from memory \(peer agent "
                     r"(\S+)\): (\S+) ms in the reads, (\d+) MB/s")


def relevant(err):
    """The resume's lines of a log, for failure messages."""
    return "\n".join(l for l in err.splitlines()
                     if re.search(r"resum|memory snapshot mem|peer|memory slot|fresh start|round \d+:", l))[-6000:]


class MemRemoteTest(TempDirTest):
    def setUp(self):
        super().setUp()
        self.marker = f"mem-remote-{os.getpid()}-{self.id().split('.')[-1]}"
        self.ckpt = os.path.join(self.tmp, "ck")
        self.mems = [tempfile.mkdtemp(prefix="ckpttest-", dir="/dev/shm") for _ in range(3)]
        self.agents = []

    def tearDown(self):
        for a in self.agents:
            a.kill()
        deadline = time.time() + 5
        while procs_with(self.marker) and time.time() < deadline:
            time.sleep(0.05)
        for pid in procs_with(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for m in self.mems:
            shutil.rmtree(m, ignore_errors=True)
        super().tearDown()

    def reference(self):
        p = harness.run([harness.TRAIN] + harness.data_args()[:2] + ARGS, check=True)
        return harness.final(p)["digest"]

    def reference_resharded(self, step):
        """The digest of a run that does what the node-loss test does, from disk: W=1 (the same
        bits as W=3 here) to `step` with a disk snapshot there, then W=2 from it to the end
        (W=2 does not give W=1's bits with this batch, so the plain run is no reference)."""
        d1, d2 = os.path.join(self.tmp, "ref1"), os.path.join(self.tmp, "ref2")
        harness.run([harness.TRAIN] + harness.data_args()[:2] + ARGS +
                    ["--ckpt-dir", d1, "--ckpt-every", str(step)], check=True)
        snap = os.path.join(d1, "step-%09d" % step)
        self.assertTrue(os.path.isdir(snap), os.listdir(d1))
        mem = tempfile.mkdtemp(prefix="ckpttest-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, mem, True)
        p = harness.run([harness.ELASTIC, "--nproc-per-node", "2", "--mem-dir", mem, "--",
                         harness.TRAIN] + harness.data_args()[:2] + ARGS +
                        ["--ckpt-dir", d2, "--resume", snap], check=True)
        m = FINAL_RE.search(p.stdout)
        self.assertIsNotNone(m, p.stdout[-2000:] + p.stderr[-2000:])
        return m.group(4)

    def final(self, agents):
        """(step, digest) of the final line of rank 0, whichever agent ran it."""
        for a in agents:
            m = FINAL_RE.search(a.out())
            if m:
                return int(m.group(1)), m.group(4)
        self.fail("no final line: " + "".join(a.err()[-2000:] for a in agents))

    def start(self, nnodes):
        port = harness.free_port()
        cmd = ["/bin/sh", "-c", 'exec "$@"', self.marker, harness.TRAIN] + \
            harness.data_args()[:2] + ARGS + ["--ckpt-dir", self.ckpt, "--resume", "auto",
                                              "--ckpt-every", "75", "--mem-snapshot-every", "4"]
        agents = []
        for i, name in enumerate("ABC"):
            args = ["--mem-dir", self.mems[i], "--nnodes", nnodes, "--nproc-per-node", "1",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "memremote",
                    "--heartbeat-timeout", "2", "--last-call", "3", "--stop-grace", "3",
                    "--max-restarts", "3"]
            a = Agent(self.tmp, args, cmd, name=name)
            self.agents.append(a)
            agents.append(a)
            if i == 0:
                a.wait_for(r"hosting the rendezvous store")
        for a in agents:
            a.wait_for(r"round 0: node \d of 3", timeout=60)
        return agents

    def wait_replicas(self, at_least):
        """Until every folder holds a replica with a complete slot of step >= at_least."""
        deadline = time.time() + 120
        while time.time() < deadline:
            ok = 0
            for m in self.mems:
                reps = [os.path.join(m, s) for s in os.listdir(m) if ".rep-" in s]
                try:
                    steps = [sl[4] for r in reps for sl in slots_of(r) if sl[1] == 2]
                except (OSError, AssertionError):
                    steps = []
                ok += bool(steps) and max(steps) >= at_least
            if ok == 3:
                return
            time.sleep(0.02)
        self.fail("replicas did not arrive: " + " ".join(str(os.listdir(m)) for m in self.mems) +
                  "\n" + self.agents[0].err()[-3000:])

    def check_peer_reads(self, a):
        err = "".join(x.err() for x in a)
        peers = PEER_RE.findall(err)
        self.assertTrue(peers, relevant(err))
        for r, _, addr in peers:
            # the address is one of the live agents' replica servers
            self.assertTrue(any(f"replica server on {addr}" in x.err() for x in a), addr)
        for r, mib, addr, ms, rate in RATE_RE.findall(err):
            print(f"\n  rank {r}: {mib} MiB from memory (peer agent {addr}) in {ms} ms "
                  f"({rate} MB/s per reading thread)", file=sys.stderr)
        return peers

    def test_node_loss_world_change_reads_through_peer_agents(self):
        a, b, c = self.start("2:3")
        self.wait_replicas(8)
        wpid = c.pids(0)
        c.p.kill()  # the node: its agent and its worker
        c.p.wait()
        for p in wpid:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        self.assertEqual(a.wait(240), 0, a.err()[-5000:])
        self.assertEqual(b.wait(60), 0, b.err()[-5000:])
        err = a.err() + b.err()
        m = RESUMED_RE.search(err)
        self.assertIsNotNone(m, relevant(err))
        # rank 0's own listing may be complete (the survivors' senders re-send their slots to
        # the new peers of round 1 while it lists): the source is whatever it found; the
        # ranks that missed a slot read it through a peer agent (check_peer_reads)
        self.assertEqual(m.group(3), "3", m.group(0))
        self.assertGreaterEqual(int(m.group(2)), 8)
        self.assertRegex(err, r"re-sharding: the snapshot was saved by 3 ranks, this run has 2")
        self.check_peer_reads([a, b])
        self.assertEqual(self.final([a, b]), (80, self.reference_resharded(int(m.group(2)))))
        for mdir in self.mems[:2]:  # the survivors removed theirs; C's wait for a later agent
            self.assertEqual(os.listdir(mdir), [], mdir)
        print(f"\n  node lost, W 3 -> 2: restored step {m.group(2)} from memory (peer) in "
              f"{m.group(4)} ms", file=sys.stderr)

    def test_rank_killed_same_world_reads_through_peer_agents(self):
        ref = self.reference()
        a, b, c = self.start("3")
        self.wait_replicas(8)
        os.kill(c.pids(0)[0], signal.SIGKILL)  # a rank; its agent stays
        self.assertEqual(a.wait(240), 0, a.err()[-5000:])
        for x in (b, c):
            self.assertEqual(x.wait(60), 0, x.err()[-5000:])
        err = a.err() + b.err() + c.err()
        m = RESUMED_RE.search(err)
        self.assertIsNotNone(m, relevant(err))
        self.assertEqual(m.group(3), "3", relevant(err))
        # a node holds 2 of the 3 slots (its own and its predecessor's replica): a rank that
        # misses the third asks a peer agent for it
        self.check_peer_reads([a, b, c])
        self.assertEqual(self.final([a, b, c]), (80, ref))


if __name__ == "__main__":
    harness.main()
