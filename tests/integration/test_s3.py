"""The S3 tier end to end against a real server (Ceph RGW, tests/integration/s3env.py): upload
from W ranks, restore from the bucket at other world sizes to the uninterrupted run's digest,
awscli's view of the objects, a corrupt local copy replaced by the S3 one, wrong and rotated
credentials, remote retention, both signatures, and the failures of cases C23-C26 and C31
through a fault-injecting proxy and a weak server (s3rver)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import s3env  # noqa: E402
from harness import Ranks, TempDirTest, run  # noqa: E402

# 24 sequences per step: 8 micro-batches of 3 at W=1, 4 at W=2, 2 at W=4 (as test_distributed)
DIST = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
        "--global-batch", "24", "--steps", "6", "--lr", "3e-3", "--warmup", "2", "--seed", "7",
        "--val-samples", "12", "--log-every", "1", "--micro-batch", "3"]
SANITIZED = os.environ.get("CKPT_SANITIZED") == "1"


def launch(test, world, args, env, timeout=300, base=None):
    ranks = Ranks(world, args, test.tmp, extra_env=env, base=DIST if base is None else base)
    codes = ranks.wait(timeout)
    logs = "\n".join(ranks.stderr(r) for r in range(world))
    test.all_logs.append(logs)
    return ranks, codes, logs


def ok(test, world, args, env, **kw):
    ranks, codes, logs = launch(test, world, args, env, **kw)
    test.assertEqual(codes, [0] * world, f"W={world} {args}: exits {codes}\n{logs[-4000:]}")
    return ranks.final(), logs


def inspect(*args, env=None, check=False):
    return run([harness.INSPECT] + list(args), extra_env=env, check=check)


class S3(TempDirTest):
    @classmethod
    def setUpClass(cls):
        cls.rgw = s3env.shared_rgw()

    def setUp(self):
        super().setUp()
        harness.require_data(self)
        self.all_logs = []
        self.bucket = self.rgw.make_bucket()
        self.env = self.rgw.env({"CKPT_LOG_LEVEL": "info"})

    def tearDown(self):
        # DESIGN I6: no secret in any log line of any rank
        for text in self.all_logs:
            self.assertNotIn(self.rgw.secret_key, text)
        super().tearDown()

    def url(self, prefix="job"):
        return f"s3://{self.bucket}/{prefix}"

    def s3_steps(self, prefix="job", env=None):
        """{step: status} of ckpt-inspect list --json s3://..."""
        p = inspect("--json", "list", self.url(prefix), env=env or self.env)
        self.assertEqual(p.returncode, 0, p.stderr)
        return {e["step"]: e["status"] for e in json.loads(p.stdout)["snapshots"]}

    def keys(self, prefix):
        p = self.rgw.aws("s3api", "list-objects-v2", "--bucket", self.bucket, "--prefix", prefix)
        return sorted(o["Key"] for o in json.loads(p.stdout or "{}").get("Contents", []))

    # ------------------------------------------------------------------ upload and restore

    def test_w2_upload_restore_from_s3_at_w2_w1_w4(self):
        ref, _ = ok(self, 1, ["--ckpt-dir", os.path.join(self.tmp, "ref"), "--ckpt-every", "3"],
                    self.env)
        d = os.path.join(self.tmp, "w2")
        got, logs = ok(self, 2, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url()], self.env)
        self.assertEqual(got["digest"], ref["digest"])
        self.assertIn("step 3 is on S3", logs)
        self.assertIn("step 6 is on S3", logs)
        self.assertEqual(self.s3_steps(), {3: "committed", 6: "committed"})
        # awscli sees every object; the bytes equal the local files
        keys = self.keys("job/step-000000003/")
        self.assertEqual(keys, ["job/step-000000003/manifest.json", "job/step-000000003/rank-00000.bin",
                                "job/step-000000003/rank-00001.bin"])
        dl = os.path.join(self.tmp, "dl")
        self.rgw.aws("s3", "cp", "--recursive", f"s3://{self.bucket}/job/step-000000003", dl)
        for name in ("manifest.json", "rank-00000.bin", "rank-00001.bin"):
            with open(os.path.join(dl, name), "rb") as a, \
                    open(os.path.join(d, "step-000000003", name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
        self.assertEqual(inspect("verify", dl).returncode, 0)  # a download is a snapshot
        # ckpt-inspect list of the local folder shows the upload state and the lag
        p = inspect("list", d, check=True)
        self.assertRegex(p.stdout, r"\n3 .*uploaded")
        self.assertIn("newest complete step 6", p.stdout)
        p = inspect("--json", "list", d, check=True)
        self.assertEqual(json.loads(p.stdout)["s3"]["remote_step"], 6)
        self.assertEqual(inspect("verify", self.url() + "/step-000000003", env=self.env).returncode, 0)
        p = inspect("--json", "show", self.url() + "/step-000000003", env=self.env, check=True)
        self.assertEqual(json.loads(p.stdout)["world_size"], 2)
        p = inspect("--json", "plan", self.url() + "/step-000000003", "--world-size", "4",
                    env=self.env, check=True)
        self.assertEqual(len(json.loads(p.stdout)["ranks"]), 4)
        # the local folder is lost; resume from the bucket at W = 2, 1, 4 from step 3
        shutil.rmtree(d)
        for world in (2, 1, 4):
            prefix = f"w{world}"
            self.rgw.aws("s3", "cp", "--recursive", f"s3://{self.bucket}/job/step-000000003",
                         f"s3://{self.bucket}/{prefix}/step-000000003")
            dw = os.path.join(self.tmp, f"d{world}")
            got, logs = ok(self, world, ["--ckpt-dir", dw, "--ckpt-every", "3", "--s3",
                                         self.url(prefix), "--resume", "auto"], self.env)
            self.assertIn(f"resumed from {self.url(prefix)}/step-000000003 at step 3", logs)
            self.assertEqual(got["digest"], ref["digest"], f"restored from S3 at W={world}")
            self.assertIn("left a verified local copy", logs)
            # every chunk came once: what the restore fetched completes rank 0's share
            self.assertIn("rank 0 fetched 0 bytes again", logs)
            # the local copy is a snapshot of the 2 ranks that saved it
            self.assertEqual(inspect("verify", os.path.join(dw, "step-000000003")).returncode, 0)
            with open(os.path.join(dw, "step-000000003", "manifest.json")) as f:
                self.assertEqual(json.load(f)["world_size"], 2)
            self.assertEqual(self.s3_steps(prefix), {3: "committed", 6: "committed"})

    def test_corrupt_local_newest_restored_from_s3(self):
        """DESIGN I1: the S3 copy of the same step replaces a corrupt local one."""
        d = os.path.join(self.tmp, "ck")
        ref, _ = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url()], self.env)
        shutil.rmtree(os.path.join(d, "step-000000006"))
        self.rgw.aws("s3", "rm", "--recursive", f"s3://{self.bucket}/job/step-000000006")
        data = os.path.join(d, "step-000000003", "rank-00000.bin")
        with open(data, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0x40]))
        got, logs = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url(),
                                 "--resume", "auto"], self.env)
        self.assertIn("skipping corrupt snapshot", logs)
        self.assertIn(f"resumed from {self.url()}/step-000000003", logs)
        self.assertEqual(got["digest"], ref["digest"])
        self.assertTrue(any(n.startswith("step-000000003.corrupt") for n in os.listdir(d)))
        self.assertEqual(inspect("verify", os.path.join(d, "step-000000003")).returncode, 0)

    def test_v2_signature(self):
        d = os.path.join(self.tmp, "ck")
        args = ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url(), "--s3-signature", "v2"]
        ref, logs = ok(self, 1, args, self.env)
        self.assertIn("signature v2", logs)
        p = inspect("--s3-signature", "v2", "verify", self.url() + "/step-000000006", env=self.env)
        self.assertEqual(p.returncode, 0, p.stderr)
        shutil.rmtree(d)
        # from step 6 nothing is left to train; restore it anyway (the digest is recorded)
        got, logs = ok(self, 1, args + ["--resume", "auto"], self.env)
        self.assertIn("resumed from s3://", logs)
        self.assertEqual(got["digest"], ref["digest"])

    # ------------------------------------------------------------------ credentials

    def test_wrong_credentials_exit_2_before_the_first_step(self):
        d = os.path.join(self.tmp, "ck")
        wrong = "Wr0ngSecretWr0ngSecretWr0ngSecret000000"
        for extra, what in (({"AWS_SECRET_ACCESS_KEY": wrong}, "403"),
                            ({"AWS_ACCESS_KEY_ID": "NOSUCHKEY0000000000"}, "403")):
            e = dict(self.env, **extra)
            ranks, codes, logs = launch(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3",
                                                  self.url()], e)
            self.assertEqual(codes, [2], logs[-2000:])
            self.assertNotIn("step 1/", logs)
            self.assertIn(self.rgw.endpoint, logs)
            self.assertIn(self.bucket, logs)
            self.assertNotIn(wrong, logs)
        ranks, codes, logs = launch(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3",
                                              f"s3://nosuchbucket-{self.bucket}/job"], self.env)
        self.assertEqual(codes, [2], logs[-2000:])
        self.assertIn("nosuchbucket", logs)


    def test_control_characters_in_keys_exit_2(self):
        """DESIGN I5/I8: a key or session token with a line break (from the environment or the
        credentials file) exits 2 before the first step naming the variable, never its value;
        it was sent as it is, injecting a header into every request."""
        d = os.path.join(self.tmp, "ck")
        inj = "X-Injected: 1"
        for extra, name in (({"AWS_SESSION_TOKEN": "tok\r\n" + inj}, "AWS_SESSION_TOKEN"),
                            ({"AWS_ACCESS_KEY_ID": self.rgw.access_key + "\r\n" + inj}, "AWS_ACCESS_KEY_ID"),
                            ({"AWS_SECRET_ACCESS_KEY": self.rgw.secret_key + "\n" + inj},
                             "AWS_SECRET_ACCESS_KEY")):
            with self.subTest(name=name):
                _, codes, logs = launch(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3",
                                                  self.url()], dict(self.env, **extra))
                self.assertEqual(codes, [2], logs[-2000:])
                self.assertIn(f"{name} has a control character", logs)
                self.assertNotIn(inj, logs)
                self.assertNotIn("step 1/", logs)
        cred = os.path.join(self.tmp, "credentials")
        with open(cred, "w") as f:
            f.write(f"[default]\naws_access_key_id = {self.rgw.access_key}\r{inj}\n"
                    f"aws_secret_access_key = {self.rgw.secret_key}\n")
        e = dict(self.env, AWS_SHARED_CREDENTIALS_FILE=cred)
        e.pop("AWS_ACCESS_KEY_ID")
        e.pop("AWS_SECRET_ACCESS_KEY")
        _, codes, logs = launch(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url()], e)
        self.assertEqual(codes, [2], logs[-2000:])
        self.assertIn("has a control character", logs)
        self.assertNotIn(inj, logs)

    def test_rotated_credentials_file_c25(self):
        """C25: a new key in the credentials file, the old one revoked, uploads go on."""
        d = os.path.join(self.tmp, "ck")
        creds = os.path.join(self.tmp, "credentials")
        new_access, new_secret = "CKPTROTATEDKEY000001", "rotated-secret-000000000000000000000001"

        def write(access, secret):
            tmp = creds + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"[default]\naws_access_key_id = {access}\naws_secret_access_key = {secret}\n")
            os.replace(tmp, creds)

        write(self.rgw.access_key, self.rgw.secret_key)
        e = {k: v for k, v in self.env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        e["AWS_SHARED_CREDENTIALS_FILE"] = creds
        ranks = Ranks(1, ["--ckpt-dir", d, "--ckpt-every", "2", "--steps", "12", "--s3", self.url()],
                      self.tmp, extra_env=e, base=DIST)
        try:
            deadline = time.time() + 120
            while "step 2 is on S3" not in ranks.stderr(0) and time.time() < deadline:
                time.sleep(0.05)
            os.kill(ranks.procs[0].pid, signal.SIGSTOP)  # hold training while the key changes
            self.rgw.add_key(new_access, new_secret)
            write(new_access, new_secret)
            self.rgw.remove_key(self.rgw.access_key)
            os.kill(ranks.procs[0].pid, signal.SIGCONT)
            codes = ranks.wait(300)
        finally:
            if ranks.procs[0].poll() is None:
                os.kill(ranks.procs[0].pid, signal.SIGCONT)
            self.rgw.add_key(self.rgw.access_key, self.rgw.secret_key)  # for the other tests
        logs = ranks.stderr(0)
        self.all_logs.append(logs)
        self.assertEqual(codes, [0], logs[-3000:])
        self.assertIn("step 12 is on S3", logs)
        self.assertNotIn(new_secret, logs)
        self.assertEqual(self.s3_steps()[12], "committed")

    def test_a_prefix_holding_later_snapshots_is_refused(self):
        """A run that would upload steps another run (or its own later history) already holds
        on S3 exits 2 before the first step, as for a local folder; nothing is overwritten."""
        ok(self, 1, ["--ckpt-dir", os.path.join(self.tmp, "a"), "--ckpt-every", "3", "--steps", "9",
                     "--s3", self.url()], self.env)
        def objects():
            c = self.rgw.client()
            return {k: (h["etag"], h.get("last-modified")) for k in self.keys("job/")
                    for h in [c.head(self.bucket, k)]}
        before = objects()
        for args in (["--ckpt-dir", os.path.join(self.tmp, "b"), "--seed", "99"],
                     ["--ckpt-dir", os.path.join(self.tmp, "c"), "--resume",
                      self.url() + "/step-000000003"]):
            ranks, codes, logs = launch(self, 1, args + ["--ckpt-every", "3", "--steps", "9",
                                                         "--s3", self.url()], self.env)
            self.assertEqual(codes, [2], logs[-2000:])
            self.assertIn("refusing to start at step", logs)
            self.assertIn("step-000000009", logs)
            self.assertNotIn("step 1/", logs)
        self.assertEqual(objects(), before)  # not one object replaced
        # with its own --run-id, a run may share the prefix when its steps do not collide
        ok(self, 1, ["--ckpt-dir", os.path.join(self.tmp, "d"), "--ckpt-every", "2", "--steps", "2",
                     "--run-id", "other", "--s3", self.url()], self.env)

    def test_a_bucket_that_does_not_answer_at_start_delays_little(self):
        """The start-up check has its own short limits: a hanging listing costs seconds, the
        run trains, and its uploads go through once the server answers."""
        d = os.path.join(self.tmp, "ck")
        with s3env.FaultProxy(self.rgw.endpoint) as proxy:
            e = dict(self.env, AWS_ENDPOINT_URL=proxy.endpoint)
            rule = proxy.add_rule("hang", method="GET", match="delimiter", count=2)
            t0 = time.time()
            got, logs = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url(),
                                     "--resume", "auto"], e)
            self.assertEqual(rule.hits, 2)
        first = re.search(r"^(\d+):(\d+):(\d+\.\d+) .*step 1/6", logs, re.M)
        start = re.search(r"^(\d+):(\d+):(\d+\.\d+) ", logs, re.M)
        secs = lambda m: int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
        self.assertLess(secs(first) - secs(start), 30, logs[:3000])
        self.assertIn("cannot be reached now", logs)
        self.assertIn("does not look at the bucket this time", logs)
        self.assertEqual(self.s3_steps(), {3: "committed", 6: "committed"})

    # ------------------------------------------------------------------ retention

    def test_remote_retention_under_a_partial_newer_upload(self):
        d = os.path.join(self.tmp, "ck")
        # a newer step's objects without a manifest: an upload in progress elsewhere
        junk = os.path.join(self.tmp, "junk")
        with open(junk, "wb") as f:
            f.write(b"x" * 1000)
        self.rgw.aws("s3", "cp", junk, f"s3://{self.bucket}/job/step-000000100/rank-00000.bin")
        ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "2", "--s3", self.url(), "--s3-keep-last", "2",
                     "--s3-part-mib", "1"], self.env)
        self.assertEqual(self.s3_steps(), {4: "committed", 6: "committed", 100: "incomplete"})
        # the data file is over 1 MiB: parts of exactly 1 MiB
        size = os.path.getsize(os.path.join(d, "step-000000006", "rank-00000.bin"))
        self.assertGreater(size, 1 << 20)
        keys = self.keys("job/step-000000006/")
        parts = [k for k in keys if ".part-" in k]
        self.assertEqual(len(parts), (size + (1 << 20) - 1) >> 20, keys)
        self.assertEqual(self.keys("job/step-000000002/"), [])


    def test_remote_retention_leaves_a_nested_prefix_alone(self):
        """Retention removes a step's own objects, not everything below its folder: another
        job whose --s3 prefix lies inside it (named like a step folder) keeps its snapshots
        (they were all deleted with the outer job's step)."""
        nested = "job/step-000000003"
        ok(self, 1, ["--ckpt-dir", os.path.join(self.tmp, "inner"), "--ckpt-every", "3",
                     "--s3", self.url(nested)], self.env)
        self.assertEqual(self.s3_steps(nested), {3: "committed", 6: "committed"})
        ok(self, 1, ["--ckpt-dir", os.path.join(self.tmp, "outer"), "--ckpt-every", "3", "--steps", "9",
                     "--s3", self.url(), "--s3-keep-last", "1"], self.env)
        # the outer step 3 is gone; its folder stays as long as the inner job's keys do
        self.assertEqual(self.s3_steps(), {3: "incomplete", 9: "committed"})
        self.assertEqual(self.s3_steps(nested), {3: "committed", 6: "committed"})
        self.assertFalse([k for k in self.keys(f"{nested}/") if k.count("/") == 2], "outer step 3 left")
        self.assertEqual(inspect("-q", "verify", f"{self.url(nested)}/step-000000006",
                                 env=self.env).returncode, 0)

    def test_killed_during_remote_retention(self):
        """A process killed while remote retention removes a step (fault point
        during-remote-retention: the step's manifest object deleted, its other objects not
        yet) has said which step it was removing before the first DELETE, so that its log
        accounts for the step; the step is left incomplete, never listed as committed, and
        the next run's retention removes the rest of it."""
        d = os.path.join(self.tmp, "ck")
        args = ["--ckpt-dir", d, "--ckpt-every", "2", "--s3", self.url(), "--s3-keep-last", "2"]
        _, codes, logs = launch(self, 1, args,
                                dict(self.env, CKPT_FAULT_POINT="during-remote-retention@2"))
        self.assertEqual(codes, [-signal.SIGKILL], logs[-4000:])
        self.assertIn("remote retention: removing step-000000002 (committed) from "
                      f"{self.url()}", logs)
        self.assertIn("fault point during-remote-retention reached at step 2", logs)
        self.assertNotIn("remote retention: removed step-000000002", logs)
        self.assertEqual(self.s3_steps(), {2: "incomplete", 4: "committed", 6: "committed"})
        self.assertNotIn("job/step-000000002/manifest.json", self.keys("job/step-000000002/"))
        self.assertIn("job/step-000000002/rank-00000.bin", self.keys("job/step-000000002/"))
        # the next run (no fault) resumes from step 6, saves step 8 and removes steps 2 and 4
        got, logs = ok(self, 1, args + ["--steps", "8", "--resume", "auto"], self.env)
        self.assertEqual(got["step"], 8)
        self.assertIn("remote retention: removing step-000000002 (incomplete)", logs)
        self.assertIn("remote retention: removed step-000000002", logs)
        self.assertIn("remote retention: removed step-000000004", logs)
        self.assertEqual(self.s3_steps(), {6: "committed", 8: "committed"})
        self.assertEqual(self.keys("job/step-000000002/"), [])

    def test_interrupted_upload_then_the_same_step_saved_again_c32(self):
        """C32: the job dies after rank 0 uploaded its objects of step 6 (rank 1's hang); the
        local folder is lost; the restart restores step 3 from S3 and saves step 6 again: the
        leftovers are overwritten, the manifest comes last, every rank agrees."""
        ref, _ = ok(self, 1, ["--ckpt-dir", os.path.join(self.tmp, "ref"), "--ckpt-every", "3"],
                    self.env)
        d = os.path.join(self.tmp, "ck")
        with s3env.FaultProxy(self.rgw.endpoint) as proxy:
            e = dict(self.env, AWS_ENDPOINT_URL=proxy.endpoint)
            rule = proxy.add_rule("hang", method="PUT", match="step-000000006/rank-00001")
            ranks = Ranks(2, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url()], self.tmp,
                          extra_env=e, base=DIST)
            deadline = time.time() + 120
            while (rule.hits < 1 or "job/step-000000006/rank-00000.bin" not in
                   " ".join(self.keys("job/step-000000006/"))) and time.time() < deadline:
                time.sleep(0.05)
            ranks.kill()
            self.all_logs.append("\n".join(ranks.stderr(r) for r in range(2)))
        self.assertEqual(self.s3_steps(), {3: "committed", 6: "incomplete"})
        shutil.rmtree(d)
        got, logs = ok(self, 2, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url(),
                                 "--resume", "auto"], self.env)
        self.assertIn(f"resumed from {self.url()}/step-000000003", logs)
        self.assertEqual(got["digest"], ref["digest"])
        self.assertEqual(self.s3_steps(), {3: "committed", 6: "committed"})
        p = inspect("verify", self.url() + "/step-000000006", env=self.env)
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_mid_upload_armed_in_fault_dir_c32(self):
        """The "mid-upload" point armed through CKPT_FAULT_DIR: the first rank to finish
        uploading its objects of step 3 dies (SIGKILL) before the group's decision and the
        manifest; step 3 is never listed complete; with the local folder lost, the restart
        (same environment: the point does not fire again) saves step 3 again and uploads it
        completely over the leftovers (C32), and verify of the S3 copy passes."""
        ref, _ = ok(self, 1, ["--ckpt-dir", os.path.join(self.tmp, "ref"), "--ckpt-every", "3"],
                    self.env)
        d = os.path.join(self.tmp, "ck")
        faults = os.path.join(self.tmp, "faults")
        os.mkdir(faults)
        open(os.path.join(faults, "mid-upload"), "w").close()
        e = dict(self.env, CKPT_FAULT_DIR=faults)
        args = ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url()]
        ranks = Ranks(2, args, self.tmp, extra_env=e, base=DIST)
        # The survivor is not waited for: when the peer dies after the last step, rank 0
        # waits in its final drain for the dead rank's vote (up to --s3-snapshot-timeout);
        # under elastic or torchrun the launcher stops it, here the test does.
        deadline = time.time() + 120
        while -signal.SIGKILL not in [p.poll() for p in ranks.procs] and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1)
        codes = [p.poll() for p in ranks.procs]
        ranks.kill()
        logs = "\n".join(ranks.stderr(r) for r in range(2))
        self.all_logs.append(logs)
        self.assertEqual(os.listdir(faults), [], "the point fired: its file is gone")
        died = [r for r in range(2) if "fault point mid-upload reached at step 3: killing this "
                "process (armed in CKPT_FAULT_DIR)" in ranks.stderr(r)]
        self.assertEqual(len(died), 1, f"exits {codes}\n{logs[-4000:]}")
        self.assertEqual(codes[died[0]], -signal.SIGKILL, codes)
        # the dead rank's objects are there, the manifest is not
        keys = self.keys("job/step-000000003/")
        self.assertIn(f"job/step-000000003/rank-0000{died[0]}.bin", keys)
        self.assertNotIn("job/step-000000003/manifest.json", keys)
        self.assertNotIn("step 3 is on S3", logs)
        steps = self.s3_steps()
        self.assertEqual(steps.get(3), "incomplete", steps)
        self.assertNotIn("committed", steps.values())
        shutil.rmtree(d)
        got, logs = ok(self, 2, args + ["--resume", "auto"], e)
        self.assertNotIn("fault point", logs, "a one-shot point fired twice")
        self.assertIn("step 3 is on S3", logs)
        self.assertEqual(got["digest"], ref["digest"])
        self.assertEqual(self.s3_steps(), {3: "committed", 6: "committed"})
        p = inspect("verify", self.url() + "/step-000000003", env=self.env)
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_full_backlog_drops_the_oldest_and_the_lag_warns(self):
        """Slow uploads, a snapshot every step, a backlog of 1: older waiting snapshots are
        dropped (logged, counted), the newest always goes; the lag warning fires."""
        d = os.path.join(self.tmp, "ck")
        with s3env.FaultProxy(self.rgw.endpoint) as proxy:
            e = dict(self.env, AWS_ENDPOINT_URL=proxy.endpoint)
            proxy.add_rule("delay:0.5", method="PUT")
            got, logs = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "1", "--steps", "8",
                                     "--s3", self.url(), "--s3-backlog", "1",
                                     "--s3-lag-warn", "0.5"], e)
        skipped = [int(x) for x in re.findall(r"upload of step (\d+) skipped", logs)]
        self.assertTrue(skipped, logs[-3000:])
        self.assertNotIn(8, skipped)
        self.assertIn("S3 lags behind", logs)
        m = re.search(r"S3 uploads: (\d+) complete, (\d+) failed, (\d+) skipped", logs)
        self.assertEqual(int(m.group(3)), len(skipped))
        self.assertEqual(int(m.group(1)) + int(m.group(3)), 8)
        steps = self.s3_steps()
        self.assertEqual(steps.get(8), "committed")
        for s in skipped:
            self.assertNotIn(s, steps)
        with open(os.path.join(d, ".s3-upload-state.json")) as f:
            state = json.load(f)
        self.assertEqual(state["remote_step"], 8)
        self.assertEqual(sorted(x["step"] for x in state["steps"] if x["state"] == "skipped"),
                         sorted(skipped))

    # ------------------------------------------------------------------ faults

    def test_proxy_hang_c23(self):
        """C23: a server that accepts and never answers: the request times out, retries back
        off, the failure is reported; training does not wait; nothing is marked complete."""
        d = os.path.join(self.tmp, "ck")
        with s3env.FaultProxy(self.rgw.endpoint) as proxy:
            e = dict(self.env, AWS_ENDPOINT_URL=proxy.endpoint)
            rule = proxy.add_rule("hang", method="PUT", match="step-000000002/")
            t0 = time.time()
            got, logs = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "2", "--s3", self.url(),
                                     "--s3-timeout", "1", "--s3-attempts", "2",
                                     "--s3-snapshot-timeout", "8"], e)
            self.assertGreaterEqual(rule.hits, 2)
        self.assertLess(time.time() - t0, 120)
        self.assertRegex(logs, r"upload of step 2 failed")
        steps = self.s3_steps()
        self.assertNotIn(2, steps)  # nothing under a hung PUT, not even a folder
        self.assertEqual(steps.get(6), "committed")
        for s in (2, 4, 6):
            self.assertEqual(inspect("verify", os.path.join(d, f"step-00000000{s}")).returncode, 0)

    def test_503_for_two_of_four_ranks_c24(self):
        """C24: ranks 1 and 3 get 503 SlowDown: bounded retries, the snapshot is not uploaded
        on any rank, training goes on, the next one is tried and succeeds."""
        d = os.path.join(self.tmp, "ck")
        with s3env.FaultProxy(self.rgw.endpoint) as proxy:
            e = dict(self.env, AWS_ENDPOINT_URL=proxy.endpoint)
            rule = proxy.add_rule("status:503:SlowDown", method="PUT",
                                  regex=r"step-000000003/rank-0000[13]")
            got, logs = ok(self, 4, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url(),
                                     "--s3-attempts", "3"], e)
            self.assertGreaterEqual(rule.hits, 6)  # 2 ranks x 3 attempts
        self.assertIn("step 3: not every rank uploaded its objects", logs)
        self.assertIn("step 6 is on S3", logs)
        steps = self.s3_steps()
        self.assertEqual(steps.get(3), "incomplete")
        self.assertEqual(steps.get(6), "committed")

    def test_every_rank_throttled_for_a_while_c33(self):
        """C33: 503 SlowDown on every upload request of 4 ranks for 6 s: the retries are spread
        by the jitter (no synchronised bursts), training does not wait, uploads recover."""
        d = os.path.join(self.tmp, "ck")
        with s3env.FaultProxy(self.rgw.endpoint) as proxy:
            e = dict(self.env, AWS_ENDPOINT_URL=proxy.endpoint)
            rule = proxy.add_rule("status:503:SlowDown", method="PUT", seconds=6)
            got, logs = ok(self, 4, ["--ckpt-dir", d, "--ckpt-every", "3", "--steps", "9",
                                     "--s3", self.url(), "--s3-attempts", "12"], e)
            refused = sorted(ev["time"] for ev in proxy.events if ev["fault"])
        self.assertGreaterEqual(rule.hits, 8, logs[-3000:])
        # full jitter: the retries do not come in lockstep; most 100 ms windows hold at most a
        # few of them. The first attempts come together by nature (the ranks commit the same
        # snapshot at the same moment: 4 ranks x their objects within ~100 ms), so they are
        # left out: only what comes 200 ms after the first refusal is judged
        retries = [t for t in refused if t > refused[0] + 0.2]
        self.assertGreaterEqual(len(retries), 4, refused)
        windows = {}
        for t in retries:
            windows[int(t * 10)] = windows.get(int(t * 10), 0) + 1
        self.assertLessEqual(max(windows.values()), max(3, len(retries) // 3), refused)
        self.assertEqual(self.s3_steps().get(9), "committed")
        times = [float(x) for x in re.findall(r"step \d+/9 loss \S+ lr \S+ grad_norm \S+ (\d+) ms", logs)]
        self.assertLess(max(times), 5000, "a training step waited for S3")

    def test_cut_reset_and_error_documents_c31(self):
        """A body cut short, a reset mid-body, a 200 with an error document: each retried, never
        taken as uploaded or as data; the snapshot verifies and restores."""
        d = os.path.join(self.tmp, "ck")
        with s3env.FaultProxy(self.rgw.endpoint) as proxy:
            e = dict(self.env, AWS_ENDPOINT_URL=proxy.endpoint)
            r1 = proxy.add_rule("error200", method="PUT", match="rank-00000.bin", count=1)
            ref, logs = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url()], e)
            self.assertEqual(r1.hits, 1)
            self.assertEqual(self.s3_steps(env=e), {3: "committed", 6: "committed"})
            shutil.rmtree(d)
            r2 = proxy.add_rule("cut", method="GET", match="rank-00000.bin", count=1)
            r3 = proxy.add_rule("reset", method="GET", match="rank-00000.bin", count=1)
            got, logs = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url(),
                                     "--resume", "auto"], e)
            self.assertEqual((r2.hits, r3.hits), (1, 1))
        self.assertEqual(got["digest"], ref["digest"])


    def test_error_document_in_a_200_to_a_get_is_transient(self):
        """DESIGN I7: a 200 whose body is an error document, to the GET of a manifest or of a
        chunk, is retried; when it never stops, the snapshot is "could not read" (exit 3, and
        --resume auto exits 1 skipping nothing), never corrupt (it was listed as corrupt and
        --resume auto fell back to the older step)."""
        d = os.path.join(self.tmp, "ck")
        ref, _ = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url()], self.env)
        shutil.rmtree(d)
        newest = f"{self.url()}/step-000000006"
        with s3env.FaultProxy(self.rgw.endpoint) as proxy:
            e = dict(self.env, AWS_ENDPOINT_URL=proxy.endpoint)
            for match in ("step-000000006/manifest.json", "step-000000006/rank-00000.bin"):
                with self.subTest(match=match):
                    rule = proxy.add_rule("error200:InternalError", method="GET", match=match, count=1)
                    self.assertEqual(inspect("-q", "verify", newest, env=e).returncode, 0)
                    self.assertEqual(rule.hits, 1)
                    rule = proxy.add_rule("error200:InternalError", method="GET", match=match)
                    p = inspect("-q", "verify", newest, env=e)
                    self.assertEqual(p.returncode, 3, p.stderr)
                    self.assertIn("error document", p.stderr)
                    _, codes, logs = launch(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3",
                                                      self.url(), "--resume", "auto", "--s3-attempts", "2"], e)
                    self.assertEqual(codes, [1], logs[-3000:])
                    self.assertNotIn("resumed from", logs)
                    proxy.remove_rule(rule)
            self.assertEqual(self.s3_steps(env=e), {3: "committed", 6: "committed"})
            got, _ = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url(),
                                  "--resume", "auto"], e)
        self.assertEqual(got["digest"], ref["digest"])


    def test_no_snapshot_on_s3_is_named_none(self):
        """With S3 unreachable the whole run, the summary and ckpt-inspect list say there is no
        complete snapshot on S3 (they printed "none -1")."""
        d = os.path.join(self.tmp, "ck")
        port = s3env.free_port()
        e = dict(self.env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        got, logs = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", self.url(),
                                 "--s3-attempts", "1"], e)
        self.assertIn("newest on S3: none;", logs)
        self.assertNotIn("none -1", logs)
        p = inspect("list", d, env=e)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(f"S3 {self.url()}: no complete snapshot, lag 6 steps", p.stdout)

    def test_rgw_killed_mid_upload_and_restarted_a_minute_later_c26(self):
        """C26: radosgw SIGKILLed while snapshots upload, back a minute later: training never
        waits, the upload completes or is counted failed, nothing partial is taken as complete.
        CKPT_TEST_RGW_OUTAGE_S shortens the outage (the sanitizer run of scripts/test: the same
        code paths, for memory errors, without a second idle minute)."""
        outage = float(os.environ.get("CKPT_TEST_RGW_OUTAGE_S", "60"))
        d = os.path.join(self.tmp, "ck")
        with s3env.FaultProxy(self.rgw.endpoint) as proxy:
            e = dict(self.env, AWS_ENDPOINT_URL=proxy.endpoint)
            proxy.add_rule("delay:0.3", method="PUT")  # slow uploads: the kill lands mid-upload
            ranks = Ranks(2, ["--ckpt-dir", d, "--ckpt-every", "2", "--steps", "10", "--s3",
                              self.url(), "--s3-part-mib", "1", "--s3-timeout", "5",
                              "--s3-attempts", "100", "--s3-snapshot-timeout", "150",
                              "--s3-drain-timeout", "200"], self.tmp, extra_env=e, base=DIST)
            killed_at = None
            try:
                deadline = time.time() + 120
                while proxy.count("PUT") < 2 and time.time() < deadline:
                    time.sleep(0.02)
                self.rgw.kill_rgw()
                killed_at = time.time()
                while time.time() < killed_at + outage and ranks.procs[0].poll() is None:
                    time.sleep(0.2)
                self.rgw.start_rgw()
                codes = ranks.wait(300)
            finally:
                if not self.rgw.rgw_running():
                    self.rgw.start_rgw()
            logs = "\n".join(ranks.stderr(r) for r in range(2))
            self.all_logs.append(logs)
        self.assertEqual(codes, [0, 0], logs[-4000:])
        times = [float(x) for x in re.findall(r"step \d+/10 loss \S+ lr \S+ grad_norm \S+ (\d+) ms", logs)]
        self.assertEqual(len(times), 10)
        self.assertLess(max(times), 5000, "a training step waited for S3")
        self.assertIn("step 10 is on S3", logs)
        steps = self.s3_steps()
        self.assertEqual(steps.get(10), "committed")
        for step, status in steps.items():
            if status == "committed":  # whatever completed verifies
                p = inspect("verify", f"{self.url()}/step-{step:09d}", env=self.env)
                self.assertEqual(p.returncode, 0, p.stderr)
            else:
                self.assertEqual(status, "incomplete")

    def test_s3rver_partial_put_never_accepted(self):
        """s3rver leaves a partial object after an interrupted PUT: the HEAD check sees it, the
        uploader retries; a partial object under a manifest makes the S3 copy corrupt."""
        d = os.path.join(self.tmp, "ck")
        with s3env.S3rver() as srv:
            bucket = srv.make_bucket()
            url = f"s3://{bucket}/job"
            with s3env.FaultProxy(srv.endpoint) as proxy:
                e = srv.env({"AWS_ENDPOINT_URL": proxy.endpoint})
                rule = proxy.add_rule("cut-upload", method="PUT", match="rank-00000.bin", count=1)
                ref, logs = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", url], e)
                self.assertEqual(rule.hits, 1)
            e = srv.env()
            for step in (3, 6):
                p = inspect("verify", f"{url}/step-{step:09d}", env=e)
                self.assertEqual(p.returncode, 0, p.stderr)
            # tear the newest S3 copy's data object (as an interrupted overwrite would)
            with open(os.path.join(d, "step-000000006", "rank-00000.bin"), "rb") as f:
                half = f.read()[:5000]
            torn = os.path.join(self.tmp, "torn")
            with open(torn, "wb") as f:
                f.write(half)
            srv.aws("s3", "cp", torn, f"{url}/step-000000006/rank-00000.bin")
            p = inspect("verify", f"{url}/step-000000006", env=e)
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            shutil.rmtree(d)
            got, logs = ok(self, 1, ["--ckpt-dir", d, "--ckpt-every", "3", "--s3", url,
                                     "--resume", "auto"], e)
            self.assertIn("skipping corrupt snapshot " + url + "/step-000000006", logs)
            self.assertIn("resumed from " + url + "/step-000000003", logs)
            self.assertEqual(got["digest"], ref["digest"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
