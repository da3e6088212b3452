#!/usr/bin/env python3
"""Tests of chaoslib/faults_io.py: each io fault kind injected into a real job, and its effect.

The job is a stand-in for chaoslib/job.py's Job (written in parallel; CONTRACT.md fixes the
attributes used here): one `build/elastic/elastic` node with 2 ranks of `build/train`
(--ckpt-dir, --ckpt-every, --keep-last, --s3 to a bucket of the shared RGW through a
FaultProxy, CKPT_FAULT_DIR, --mem-dir under /dev/shm). For every kind the test checks that
the job still ends with the params_digest of the uninterrupted one-process run of the same
flags (8 sequences per step, micro-batches of 2), that the fault did what it says (the proxy
rule fired, radosgw came back, the damaged item is corrupt by `ckpt-inspect verify`), and that
faults_io.verify_expectations(job) is empty.

    python3 tests/chaos/test_faults_io.py [-v] [Test.test_flip_memory]

Environment: CKPT_BUILD (default build/), CKPT_DATA (default data/brown), CHAOS_SEED,
CHAOS_KEEP=1 (keep each test's work folder).
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
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import s3env  # noqa: E402
from chaoslib import faults_io  # noqa: E402

BUILD = os.environ.get("CKPT_BUILD", os.path.join(ROOT, "build"))
DATA = os.environ.get("CKPT_DATA", os.path.join(ROOT, "data", "brown"))
KEEP = os.environ.get("CHAOS_KEEP") == "1"
SEED = int(os.environ.get("CHAOS_SEED", "0")) or random.randrange(1 << 30)

STEPS = int(os.environ.get("CHAOS_STEPS", "200"))
# 8 sequences per step: micro-batches of 2, 2 per rank at W = 2, 4 at W = 1 (same bits)
MODEL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
         "--global-batch", "8", "--micro-batch", "2", "--steps", str(STEPS), "--lr", "3e-3",
         "--warmup", "5", "--seed", "7", "--log-every", "1"]
FINAL_RE = re.compile(r"^\[rank 0\] final step=(\d+) loss=\S+ val_loss=\S+ params_digest=([0-9a-f]{32})$",
                      re.M)
COMMITTED_RE = re.compile(r"\[rank 0\] .*snapshot step (\d+) committed")
STEP_RE = re.compile(r"\[rank 0\] .*\bstep (\d+)/\d+ loss")
LAUNCH_RE = re.compile(r"(fresh start|resumed from (?:memory \(\w+\)|\S+) at step (\d+))")
ON_S3_RE = re.compile(r"\[rank 0\] .*step (\d+) is on S3")


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def children_running(pid, exe):
    """Live (not zombie) children of pid whose argv[0] is exe."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] in ("Z", "X"):
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
            if os.path.realpath(argv0) == os.path.realpath(exe):
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return sorted(out)


class S3Target:
    def __init__(self, rgw, proxy, bucket, prefix):
        self.rgw, self.proxy, self.bucket, self.prefix = rgw, proxy, bucket, prefix
        self.url = f"s3://{bucket}/{prefix}"
        self.client = rgw.client()


class Node:
    def __init__(self, index, proc, log_path, out_path, train):
        self.index, self.proc, self.log_path, self.out_path = index, proc, log_path, out_path
        self.netns = None
        self._train = train

    def workers(self):
        return children_running(self.proc.pid, self._train) if self.alive() else []

    def alive(self):
        return self.proc.poll() is None


class Job:
    """The stand-in: one node, 2 ranks, S3 through a FaultProxy, memory tier, retention."""

    def __init__(self, rgw, rnd, nproc=2, keep_last=3, ckpt_every=5, s3_keep_last=0):
        self.work = tempfile.mkdtemp(prefix="chaos-io-")
        self.build = BUILD
        self.train = os.path.join(BUILD, "train")
        self.elastic = os.path.join(BUILD, "elastic", "elastic")
        self.inspect = os.path.join(BUILD, "ckpt-inspect")
        self.ckpt_dir = os.path.join(self.work, "ckpt")
        self.fault_dir = os.path.join(self.work, "faults")
        os.makedirs(self.fault_dir)
        self.mem_dir = tempfile.mkdtemp(prefix="chaos-io-", dir="/dev/shm")
        self.rnd = rnd
        self.corrupted = {"local": set(), "s3": set(), "memory": set()}
        self.faults = []
        self.nodes = []
        proxy = s3env.FaultProxy(rgw.endpoint)
        proxy.start()
        bucket = rgw.make_bucket()
        self.s3 = S3Target(rgw, proxy, bucket, "job")
        self.nproc, self.keep_last, self.ckpt_every, self.s3_keep_last = nproc, keep_last, ckpt_every, s3_keep_last
        self._t_fault = None

    def command(self):
        return [self.train, "--data", os.path.join(DATA, "train_*.bin")] + MODEL + [
            "--ckpt-dir", self.ckpt_dir, "--ckpt-every", str(self.ckpt_every),
            "--keep-last", str(self.keep_last), "--s3", self.s3.url,
            "--s3-keep-last", str(self.s3_keep_last), "--s3-timeout", "3",
            "--s3-drain-timeout", "60", "--resume", "auto"]

    def start(self):
        i = len(self.nodes)
        log_path = os.path.join(self.work, f"node{i}.err")
        out_path = os.path.join(self.work, f"node{i}.out")
        env = self.s3.rgw.env({"AWS_ENDPOINT_URL": self.s3.proxy.endpoint, "CKPT_FAULT_DIR": self.fault_dir,
                               "OPENBLAS_NUM_THREADS": "1", "CKPT_LOG_LEVEL": "info"})
        argv = [self.elastic, "--nproc-per-node", str(self.nproc), "--max-restarts", "12",
                "--stop-grace", "5", "--mem-dir", self.mem_dir, "--"] + self.command()
        with open(out_path, "w") as out, open(log_path, "w") as err:
            p = subprocess.Popen(argv, stdout=out, stderr=err, env=env, stdin=subprocess.DEVNULL)
        self.nodes.append(Node(i, p, log_path, out_path, self.train))

    # -- the Job interface of CONTRACT.md
    def log_text(self):
        return "\n".join(_read(n.log_path) for n in self.nodes)

    def committed_steps(self):
        return sorted({int(m.group(1)) for m in COMMITTED_RE.finditer(self.log_text())})

    def last_step(self):
        steps = STEP_RE.findall(self.log_text())
        return int(steps[-1]) if steps else None

    def wait_steps(self, n, timeout):
        start = len(STEP_RE.findall(self.log_text()))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(STEP_RE.findall(self.log_text())) >= start + n:
                return True
            if not any(x.alive() for x in self.nodes):
                return False
            time.sleep(0.02)
        return False

    def wait_recovered(self, timeout):
        deadline = time.monotonic() + timeout
        t0 = self._t_fault or 0
        while time.monotonic() < deadline:
            if not any(x.alive() for x in self.nodes):
                return True
            text = self.log_text()
            launches = list(LAUNCH_RE.finditer(text))
            if launches and STEP_RE.search(text, launches[-1].end()) and time.time() > t0:
                return True
            time.sleep(0.02)
        return False

    def record(self, kind, detail):
        self._t_fault = time.time()
        self.faults.append((kind, detail))

    # -- for the tests
    def wait_for(self, pred, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            if not any(x.alive() for x in self.nodes):
                raise AssertionError(f"the job ended before {what}:\n{self.log_text()[-3000:]}")
            time.sleep(0.02)
        raise AssertionError(f"no {what} within {timeout} s:\n{self.log_text()[-3000:]}")

    def s3_steps(self):
        return sorted({int(m.group(1)) for m in ON_S3_RE.finditer(self.log_text())})

    def wait_end(self, timeout):
        node = self.nodes[-1]
        try:
            rc = node.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout} s:\n{self.log_text()[-3000:]}")
        m = FINAL_RE.search(_read(node.out_path))
        return rc, (int(m.group(1)), m.group(2)) if m else None

    def close(self, keep=False):
        for n in self.nodes:
            pids = n.workers()
            if n.alive():
                n.proc.kill()
                n.proc.wait(10)
            for p in pids:  # the guardian kills them too; make sure, by pid
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.s3.proxy.stop()
        shutil.rmtree(self.mem_dir, ignore_errors=True)
        if not keep:
            shutil.rmtree(self.work, ignore_errors=True)


class Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(os.path.join(DATA, "train_000000.bin")):
            raise unittest.SkipTest(f"no corpus shards in {DATA}")
        cls.rgw = s3env.shared_rgw()
        p = subprocess.run([os.path.join(BUILD, "train"), "--data", os.path.join(DATA, "train_*.bin")] + MODEL,
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        m = re.search(r"^final step=(\d+) .*params_digest=([0-9a-f]{32})$", p.stdout, re.M)
        assert m, p.stderr[-2000:]
        cls.ref = (int(m.group(1)), m.group(2))
        print(f"\nseed {SEED} (CHAOS_SEED={SEED} reruns it); reference digest {cls.ref[1]}", file=sys.stderr)

    def setUp(self):
        self.rnd = random.Random(f"{SEED}-{self.id()}")
        self.job = Job(self.rgw, self.rnd)

    def tearDown(self):
        faults_io.finish(self.job)
        self.job.close(keep=KEEP)
        if KEEP:
            print(f"  kept {self.job.work}", file=sys.stderr)
        self.assertTrue(self.rgw.rgw_running(), "radosgw is not running after the test")

    # -- helpers
    def start_and_wait(self, commits=3, on_s3=2):
        j = self.job
        j.start()
        j.wait_for(lambda: len(j.committed_steps()) >= commits and len(j.s3_steps()) >= on_s3, 60,
                   f"{commits} commits and {on_s3} snapshots on S3")

    def inject(self, kind, tries=20):
        """Inject kind (retrying a few times while it returns None: nothing to hit yet)."""
        for _ in range(tries):
            detail = faults_io.KINDS[kind](self.job)
            if detail:
                self.job.record(kind, detail)
                print(f"\n  {kind}: {detail}", file=sys.stderr)
                return detail
            time.sleep(0.2)
        self.fail(f"{kind} could not be injected:\n{self.job.log_text()[-3000:]}")

    def end(self, timeout=120):
        j = self.job
        rc, final = j.wait_end(timeout)
        log = j.log_text()
        self.assertEqual(rc, 0, log[-4000:])
        self.assertEqual(final, self.ref, "params_digest differs from the uninterrupted run's")
        self.assertEqual(faults_io.finish(j), [])
        problems = faults_io.verify_expectations(j)
        self.assertEqual(problems, [], "\n".join(problems))
        self.assertNotIn(self.rgw.secret_key, log)
        return log

    def assert_verify(self, target, status, env=None):
        p = subprocess.run([self.job.inspect, "--json", "verify", target], capture_output=True, text=True,
                           env=env, timeout=60)
        self.assertIn(f'"status": "{status}"', p.stdout, p.stdout + p.stderr)

    # -- the kinds
    def test_contract(self):
        kinds = {"s3_kill_restart", "s3_hang", "s3_503", "flip_local", "truncate_local", "flip_s3",
                 "truncate_s3", "flip_memory"}
        self.assertEqual(set(faults_io.KINDS), kinds)
        self.assertEqual(set(faults_io.NEEDS), kinds)
        for k in kinds:
            self.assertTrue(callable(faults_io.KINDS[k]))
            self.assertLessEqual(faults_io.NEEDS[k], {"s3", "two_nodes", "tmpfs", "retention"})

    def test_s3_kill_restart(self):
        self.start_and_wait()
        self.inject("s3_kill_restart")
        self.assertFalse(self.rgw.rgw_running())
        log = self.end()
        self.assertTrue(self.rgw.rgw_running())
        self.assertIn(f"step {STEPS} is on S3", log)

    def test_s3_hang(self):
        self.start_and_wait()
        self.inject("s3_hang")
        rule = faults_io._state(self.job).rules[-1]
        log = self.end()
        self.assertGreaterEqual(rule.hits, 1, rule)
        self.assertIn(f"step {STEPS} is on S3", log)

    def test_s3_503(self):
        self.start_and_wait()
        self.inject("s3_503")
        rule = faults_io._state(self.job).rules[-1]
        log = self.end()
        self.assertGreaterEqual(rule.hits, 1, rule)
        self.assertIn(f"step {STEPS} is on S3", log)

    def _local(self, kind):
        self.start_and_wait(commits=4)
        self.inject(kind)
        (step, what), = self.job.corrupted["local"]
        folder = os.path.join(self.job.ckpt_dir, f"step-{step:09d}")
        if os.path.isdir(folder):  # retention may have removed it already
            self.assert_verify(folder, "corrupt")
        self.end()

    def test_flip_local(self):
        self._local("flip_local")

    def test_truncate_local(self):
        self._local("truncate_local")

    def _s3(self, kind):
        self.job.s3_keep_last = 4  # remote retention: a damaged copy may be removed
        self.start_and_wait(commits=3, on_s3=3)
        self.inject(kind)
        (step, what), = self.job.corrupted["s3"]
        # it is damaged now (unless retention removed it within this moment)
        d = faults_io._state(self.job).damage[-1]
        if self.job.s3.client.head(self.job.s3.bucket, d["key"]) is not None:
            self.assert_verify(f"{self.job.s3.url}/step-{step:09d}", "corrupt", env=self.rgw.env())
        self.end()

    def test_flip_s3(self):
        self._s3("flip_s3")

    def test_truncate_s3(self):
        self._s3("truncate_s3")

    def test_flip_memory(self):
        self.start_and_wait(commits=2, on_s3=0)
        self.inject("flip_memory")
        (step, what), = self.job.corrupted["memory"]
        log = self.end()
        self.assertRegex(log, rf"memory snapshot mem:\S+/{step}/2 not (restored|flushed)|"
                              rf"memory slot .* \(step {step}\) is corrupt")
        m = re.search(r"resumed from (memory \(\w+\)|\S+) at step (\d+)", log)
        self.assertIsNotNone(m, log[-3000:])
        self.assertNotEqual(int(m.group(2)), step, m.group(0))
        self.assertEqual(os.listdir(self.job.mem_dir), [], "segments left after the job")

    def test_both_copies_damaged_restore_goes_older(self):
        """flip_local and truncate_s3 on the same step S (the second newest), the agent killed,
        the newer snapshots lost (local and S3): the new agent's resume finds S corrupt on disk
        (set aside) and on S3, restores the next older one; the damaged items are still found
        corrupt afterwards (the set-aside folder; the S3 copy unless a re-save replaced it)."""
        j = self.job
        j.keep_last = 0
        self.start_and_wait(commits=4, on_s3=3)
        deadline = time.monotonic() + 30
        detail_l = detail_s = None
        while not (detail_l and detail_s) and time.monotonic() < deadline:
            steps = [s for s in j.committed_steps() if s in j.s3_steps()]
            if len(steps) >= 3:
                target = steps[-2]
                detail_l = faults_io.flip_local(j, step=target)
                detail_s = detail_l and faults_io.truncate_s3(j, step=target)
            if not (detail_l and detail_s):
                time.sleep(0.1)
        self.assertTrue(detail_l and detail_s, (detail_l, detail_s, j.log_text()[-2000:]))
        j.record("flip_local", detail_l)
        j.record("truncate_s3", detail_s)
        print(f"\n  {detail_l}\n  {detail_s}", file=sys.stderr)
        node = j.nodes[-1]
        node.proc.kill()
        node.proc.wait(30)
        gone_by = time.monotonic() + 10  # the guardian kills the workers
        while children_running(node.proc.pid, j.train) and time.monotonic() < gone_by:
            time.sleep(0.05)
        for step, name in faults_io._local_steps(j):
            if step > target:
                shutil.rmtree(os.path.join(j.ckpt_dir, name))
                j.s3.client.delete(j.s3.bucket, f"job/{name}/manifest.json")
        j.start()
        self.end()
        new = _read(j.nodes[-1].log_path)
        self.assertRegex(new, rf"skipping corrupt snapshot \S+/step-0*{target}: ")
        self.assertRegex(new, rf"skipping (corrupt snapshot )?s3://\S+/step-0*{target}")
        m = re.search(r"resumed from (\S+) at step (\d+)", new)
        self.assertIsNotNone(m, new[-3000:])
        self.assertLess(int(m.group(2)), target, m.group(0))
        self.assertTrue([n for n in os.listdir(j.ckpt_dir) if n.startswith(f"step-{target:09d}.corrupt-")],
                        os.listdir(j.ckpt_dir))

    def test_flip_memory_every_region(self):
        """One job, one flip per checksummed region of the payload (header, a shard, the
        trainer record, the chunk checksums) of each local rank's segment (the trainer record:
        rank 0's, the only one a restore reads), each followed by the kill and the resume:
        every one is found, none restored."""
        j = self.job
        self.start_and_wait(commits=2, on_s3=0)
        for region in ("payload header", "shard of params", "trainer record", "chunk checksums"):
            for L in ((0,) if region == "trainer record" else (0, 1)):  # only rank 0's is read
                for _ in range(50):
                    detail = faults_io.flip_memory(j, region=region, local_rank=L)
                    if detail:
                        break
                    time.sleep(0.05)
                self.assertIsNotNone(detail, f"{region} of local rank {L}: not injected")
                j.record("flip_memory", detail)
                print(f"\n  {detail}", file=sys.stderr)
                self.assertTrue(j.wait_recovered(60), j.log_text()[-3000:])
                self.assertTrue(j.wait_steps(3, 60), j.log_text()[-3000:])
                self.assertEqual(faults_io.verify_expectations(j), [])
        self.end(timeout=180)


class VerifyExpectations(unittest.TestCase):
    """verify_expectations reports what it must: a damaged item that verify passes, a
    committed folder changed in place, a memory slot restored and never reported; and not
    what retention removed."""

    def test_misses_are_problems(self):
        work = tempfile.mkdtemp(prefix="chaos-io-ve-")
        try:
            ck = os.path.join(work, "ckpt")
            subprocess.run([os.path.join(BUILD, "train"), "--data", os.path.join(DATA, "train_*.bin")] +
                           MODEL + ["--steps", "10", "--ckpt-dir", ck, "--ckpt-every", "5"],
                           check=True, capture_output=True, timeout=120,
                           env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
            log = os.path.join(work, "node0.err")
            with open(log, "w") as f:
                f.write("before\n")

            class FakeNode:
                log_path = log

            class FakeJob:
                inspect = os.path.join(BUILD, "ckpt-inspect")
                ckpt_dir = ck
                nodes = [FakeNode()]
                s3 = None
                corrupted = {}

            job = FakeJob()
            st = faults_io._state(job)
            f5 = os.path.join(ck, "step-000000005")
            ino = os.stat(f5).st_ino
            sha = faults_io._file_sha(os.path.join(f5, "rank-00000.bin"))
            # verify passes an intact snapshot recorded as damaged
            st.damage.append({"tier": "local", "step": 5, "what": "rank-00000.bin", "name": "step-000000005",
                              "sha": sha, "dir_ino": ino, "how": "flip"})
            # the same folder, its file no longer the damaged bytes: changed in place
            st.damage.append({"tier": "local", "step": 5, "what": "rank-00000.bin", "name": "step-000000005",
                              "sha": "0" * 64, "dir_ino": ino, "how": "truncate"})
            # removed by retention: no problem
            st.damage.append({"tier": "local", "step": 3, "what": "rank-00000.bin", "name": "step-000000003",
                              "sha": sha, "dir_ino": 1, "how": "flip"})
            # a memory slot restored after the damage, never reported
            st.damage.append({"tier": "memory", "step": 7, "what": "x.own-0 slot 1", "logs": {log: 7}})
            with open(log, "a") as f:
                f.write("[rank 0] INFO [train] rank 0: resumed from memory (own) at step 7 (run r, saved by 2 ranks)\n")
            # a truncated copy set aside by a resume, the step saved again: the set-aside one counts
            aside = os.path.join(ck, "step-000000010.corrupt-1")
            shutil.copytree(os.path.join(ck, "step-000000010"), aside)
            with open(os.path.join(aside, "rank-00000.bin"), "r+b") as f:
                f.truncate(os.path.getsize(os.path.join(aside, "rank-00000.bin")) - 1)
            st.damage.append({"tier": "local", "step": 10, "what": "rank-00000.bin", "name": "step-000000010",
                              "sha": faults_io._file_sha(os.path.join(aside, "rank-00000.bin")), "dir_ino": 1,
                              "how": "truncate"})
            problems = faults_io.verify_expectations(job)
            self.assertEqual(len(problems), 4, "\n".join(problems))
            self.assertIn("verify passes", problems[0])
            self.assertIn("changed in place", problems[1])
            self.assertIn("restored step 7 from memory (own)", problems[2])
            self.assertIn("no log line reports", problems[3])
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
