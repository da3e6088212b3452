"""What users get wrong, from a review that tried to break the tools: two runs on one snapshot
folder, a run that would overwrite another run's later steps, an unusable folder, a
preemption signal, a data file truncated under a running job, and manifests whose checksum is
valid but whose contents are inconsistent (tampered and resealed)."""
import json
import os
import re
import stat
import signal
import subprocess
import time

import harness as h


def reseal(manifest):
    h.run([h.RESEAL, manifest], check=True)


def edit_manifest(path, fn):
    with open(path) as f:
        text = f.read()
    new = fn(text)
    assert new != text, "edit changed nothing"
    with open(path, "w") as f:
        f.write(new)
    reseal(path)


class Misuse(h.TempDirTest):
    def test_two_runs_one_folder(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        first = subprocess.Popen([h.TRAIN] + h.data_args() + h.SMALL +
                                 ["--steps", "100000", "--ckpt-dir", ckpt, "--ckpt-every", "50"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=h.env(), text=True)
        try:
            deadline = time.time() + 60
            while not os.path.exists(os.path.join(ckpt, ".lock")) and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            p = h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"], check=False)
            self.assertEqual(p.returncode, 2, p.stderr[-1000:])
            self.assertRegex(p.stderr, rf"snapshot folder {re.escape(ckpt)} is in use by another run "
                                       rf"\(pid {first.pid}\)")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        # the lock dies with its process: the folder is usable again
        p = h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"])
        self.assertEqual(h.final(p)["step"], 60)

    def test_lost_lock_stops_the_saves(self):
        """The folder's .lock removed under a running train (a cleanup, an rm -rf) and then
        taken by a second run: the first saves nothing more there (one error per snapshot
        naming the lost lock, no recreated folder, no retention) and exits non-zero; the second
        run's snapshots are all its own. Once the first recreated the folder without a lock at
        each save and the two wrote into it side by side."""
        ckpt = os.path.join(self.tmp, "ckpt")
        lock = os.path.join(ckpt, ".lock")
        first = subprocess.Popen([h.TRAIN] + h.data_args() + h.SMALL +
                                 ["--steps", "400", "--ckpt-dir", ckpt, "--ckpt-every", "10",
                                  "--keep-last", "2", "--log-every", "1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=h.env(), text=True)
        try:
            deadline = time.time() + 60
            while not h.snapshot_dirs(ckpt) and time.time() < deadline:
                time.sleep(0.05)
            self.assertTrue(h.snapshot_dirs(ckpt), "no first snapshot")
            os.unlink(lock)
            second = h.train(["--ckpt-dir", ckpt, "--ckpt-every", "5", "--steps", "60",
                              "--resume", "auto"], check=False)
            out, err = first.communicate(timeout=300)
        finally:
            if first.poll() is None:
                first.kill()
                first.communicate()
        self.assertEqual(second.returncode, 0, second.stderr[-1500:])
        self.assertNotEqual(first.returncode, 0, err[-1500:])
        self.assertRegex(err, rf"snapshot folder {re.escape(ckpt)}: this run's lock on it is gone")
        self.assertIn("the snapshot of the last step 400 failed", err)
        # after the lock was lost, no snapshot of the first run was committed
        committed = [int(m) for m in re.findall(r"snapshot step (\d+) committed", err)]
        lost = int(re.search(r"not saving step (\d+) there", err).group(1))
        self.assertTrue(all(c < lost for c in committed), (committed, lost))
        self.assertNotIn("Stale file handle", second.stderr)
        self.assertTrue(os.path.exists(lock))

    def test_lock_of_an_earlier_round_of_the_same_job_is_waited_for(self):
        """A rank of an earlier round of the same job (ELASTIC_RUN_ID) that still holds the
        folder's lock (stopping slowly, or on a node cut off from the store: the chaos suite's
        partition scenario hit it) is waited for, within half of --comm-timeout, then exit 1
        (a restart), never exit 2; the lock names its job. Another job's lock is still exit 2
        at once."""
        ckpt = os.path.join(self.tmp, "ckpt")
        env = {"ELASTIC_RUN_ID": "job-a"}
        first = subprocess.Popen([h.TRAIN] + h.data_args() + h.SMALL +
                                 ["--steps", "100000", "--ckpt-dir", ckpt, "--ckpt-every", "100000"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 env=h.env(env), text=True)
        try:
            lock = os.path.join(ckpt, ".lock")
            deadline = time.time() + 60
            while not (os.path.exists(lock) and open(lock).read().endswith(" job-a\n")) and \
                    time.time() < deadline:
                time.sleep(0.05)
            self.assertEqual(open(lock).read(), f"{first.pid} job-a\n")
            # another job: refused at once
            t0 = time.time()
            p = h.train(["--ckpt-dir", ckpt, "--resume", "auto"], check=False,
                        extra_env={"ELASTIC_RUN_ID": "job-b"})
            self.assertEqual(p.returncode, 2, p.stderr[-1000:])
            self.assertLess(time.time() - t0, 20)
            self.assertRegex(p.stderr, rf"is in use by another run \(pid {first.pid}\)")
            # the same job, the holder never lets go: waits --comm-timeout / 2, then exit 1
            t0 = time.time()
            p = h.train(["--ckpt-dir", ckpt, "--resume", "auto", "--comm-timeout", "4"],
                        check=False, extra_env=env)
            took = time.time() - t0
            self.assertEqual(p.returncode, 1, p.stderr[-1000:])
            self.assertGreaterEqual(took, 2.0)
            self.assertRegex(p.stderr, rf"still locked by pid {first.pid} of an earlier round of "
                                       rf"this job \(job-a\) after 2 s; exiting 1")
            # the same job, the holder exits meanwhile: the new run goes on
            second_log = os.path.join(self.tmp, "second.err")
            with open(second_log, "w") as second_err:
                second = subprocess.Popen([h.TRAIN] + h.data_args() + h.SMALL +
                                          ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume",
                                           "auto"],
                                          stdout=subprocess.PIPE, stderr=second_err,
                                          env=h.env(env), text=True)

            def second_waits():
                with open(second_log) as f:
                    return "waiting up to 30 s for it to exit" in f.read()
            # the holder is killed once the new run waits for it (a fixed sleep was too short
            # on a loaded machine: the new run then found the lock already free)
            deadline = time.time() + 60
            while time.time() < deadline and second.poll() is None and not second_waits():
                time.sleep(0.05)
            first.send_signal(signal.SIGKILL)
            first.wait()
            out, _ = second.communicate(timeout=120)
            with open(second_log) as f:
                err = f.read()
            self.assertEqual(second.returncode, 0, err[-1500:])
            self.assertRegex(err, r"waiting up to 30 s for it to exit")
            self.assertRegex(err, r"the earlier round's lock was released after")
            self.assertIn("final step=60 ", out)
        finally:
            if first.poll() is None:
                first.send_signal(signal.SIGKILL)
                first.wait()

    def test_refuse_to_overwrite_later_steps(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20"])
        # rewinding into the same folder would save 40 and 60 again: refused, nothing touched
        p = h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume",
                     os.path.join(ckpt, "step-000000020")], check=False)
        self.assertEqual(p.returncode, 2, p.stderr[-1000:])
        self.assertRegex(p.stderr, r"refusing to start at step 20: \S+ already holds step-000000060 "
                                   r"\(run run-[0-9a-f]+, committed\)")
        # a fresh run into a folder with snapshots: refused the same way
        p = h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20"], check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("refusing to start at step 0", p.stderr)
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000040", "step-000000060"])
        # rewinding into another folder works and reproduces the run
        p = h.train(["--ckpt-dir", os.path.join(self.tmp, "branch"), "--ckpt-every", "20",
                     "--resume", os.path.join(ckpt, "step-000000020")])
        self.assertEqual(h.final(p)["digest"], h.reference()["digest"])

    def test_unusable_folder_fails_at_start(self):
        afile = os.path.join(self.tmp, "afile")
        open(afile, "w").close()
        p = h.train(["--ckpt-dir", afile, "--ckpt-every", "20"], check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"cannot use {afile} as the snapshot folder: Not a directory", p.stderr)
        self.assertNotIn("step 1/", p.stderr, "no training before the folder is known to be usable")

    def test_sigterm_takes_a_final_snapshot(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        log = os.path.join(self.tmp, "log")
        with open(log, "w") as f:
            p = subprocess.Popen([h.TRAIN] + h.data_args() + h.SMALL +
                                 ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"],
                                 stdout=subprocess.PIPE, stderr=f, env=h.env(), text=True)
            deadline = time.time() + 60
            while time.time() < deadline and "step 25/" not in h.read(log):
                time.sleep(0.005)
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=60)
        text = h.read(log)
        self.assertEqual(p.returncode, 128 + signal.SIGTERM, text[-1500:])
        m = re.search(r"stop requested \(Terminated\): stopping after step (\d+) with a final snapshot", text)
        self.assertIsNotNone(m, text[-1500:])
        stop = int(m.group(1))
        self.assertRegex(out, rf"final step={stop} ")
        self.assertIn(f"step-{stop:09d}", h.snapshot_dirs(ckpt))
        r = h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"])
        self.assertRegex(r.stderr, rf"resumed from \S+step-{stop:09d} at step {stop}")
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])

    def test_data_truncated_while_training(self):
        data = os.path.join(self.tmp, "data")
        os.mkdir(data)
        shard = os.path.join(data, "train_000000.bin")
        with open(os.path.join(h.DATA, "train_000000.bin"), "rb") as src, open(shard, "wb") as dst:
            dst.write(src.read())
        log = os.path.join(self.tmp, "log")
        with open(log, "w") as f:
            p = subprocess.Popen([h.TRAIN, "--data", shard] + h.SMALL + ["--steps", "100000"],
                                 stdout=subprocess.DEVNULL, stderr=f, env=h.env())
            deadline = time.time() + 60
            while time.time() < deadline and "step 3/" not in h.read(log):
                time.sleep(0.005)
            os.truncate(shard, 2000)
            p.wait(timeout=60)
        text = h.read(log)
        self.assertEqual(p.returncode, 1, text[-1000:])
        self.assertRegex(text, rf"training data for step \d+: {re.escape(shard)}: short read reading sample \d+: "
                               r"the file changed while training")


class Tampered(h.TempDirTest):
    """Manifests with a valid checksum whose contents do not hold together are not restored."""

    def setUp(self):
        super().setUp()
        self.ckpt = os.path.join(self.tmp, "ckpt")
        h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20"])
        self.newest = os.path.join(self.ckpt, "step-000000060")
        self.manifest = os.path.join(self.newest, "manifest.json")

    def falls_back(self, pattern):
        r = h.train(["--ckpt-dir", self.ckpt, "--resume", "auto", "--steps", "60"])
        self.assertRegex(r.stderr, pattern)
        self.assertRegex(r.stderr, r"resumed from \S+step-000000040 at step 40")
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])

    def test_trainer_step_differs(self):
        edit_manifest(self.manifest, lambda t: t.replace('"step":60,"tensor_buffer"', '"step":70,"tensor_buffer"'))
        self.falls_back(r"skipping corrupt snapshot \S+step-000000060: trainer record is inconsistent: "
                        r"step 70 and Adam step 60 in a snapshot of step 60")

    def test_samples_consumed_differs(self):
        edit_manifest(self.manifest, lambda t: re.sub(r'"samples_consumed":\d+', '"samples_consumed":4611686018427387904', t))
        self.falls_back(r"trainer record is inconsistent: 4611686018427387904 samples consumed after 60 steps of 8")

    def test_params_digest_differs(self):
        edit_manifest(self.manifest, lambda t: re.sub(r'"params_digest":"[0-9a-f]{32}"',
                                                      '"params_digest":"' + "0" * 32 + '"', t))
        self.falls_back(r"params digest [0-9a-f]{32} differs from the recorded 0{32}")

    def test_dtype_differs(self):
        edit_manifest(self.manifest, lambda t: t.replace('"dtype":"f32","elem_bytes":4,"name":"params"',
                                                         '"dtype":"bf16","elem_bytes":4,"name":"params"'))
        self.falls_back(r"state buffers are not f32")

    def test_folder_and_manifest_step_differ(self):
        edit_manifest(self.manifest, lambda t: t.replace(',"step":60,"trainer"', ',"step":61,"trainer"'))
        v = h.run([h.INSPECT, "verify", self.newest])
        self.assertEqual(v.returncode, 1)
        self.assertIn("manifest says step 61 but the folder is step-000000060", v.stderr)

    def test_bad_run_id(self):
        edit_manifest(self.manifest, lambda t: re.sub(r'"run_id":"[^"]+"', '"run_id":"../../etc"', t))
        v = h.run([h.INSPECT, "show", self.newest])
        self.assertEqual(v.returncode, 1)
        self.assertIn("run_id or config_hash is not 1-63 characters", v.stderr)

    def test_export_never_writes_into_a_snapshot(self):
        out = os.path.join(self.newest, "manifest.json")
        p = h.run([h.INSPECT, "export", "--force", self.newest, out])
        self.assertEqual(p.returncode, 1)
        self.assertIn("refusing to write inside a snapshot folder", p.stderr)
        self.assertEqual(h.run([h.INSPECT, "verify", self.newest]).returncode, 0)

    def test_export_never_replaces_what_is_not_a_file(self):
        """OUT a folder, a FIFO or a character device: refused with or without --force (exit 2,
        one line saying what it is, no advice to force it), left as it was. Once --force
        replaced a device node with a regular file (as root: /dev/null) and a folder failed
        with exit 3 (retry) after the whole export."""
        d = os.path.join(self.tmp, "adir")
        os.mkdir(d)
        fifo = os.path.join(self.tmp, "afifo")
        os.mkfifo(fifo)
        dev = os.path.join(self.tmp, "anull")
        targets = [(d, "a folder"), (fifo, "a FIFO")]
        try:
            os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            targets.append((dev, "a device"))
        except PermissionError:
            targets.append(("/dev/null", "a device"))  # not root: /dev/null itself, not writable
        for path, what in targets:
            for force in ([], ["--force"]):
                p = h.run([h.INSPECT, "export"] + force + [self.newest, path])
                self.assertEqual(p.returncode, 2, (path, force, p.stderr))
                self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
                self.assertIn(f"exists and is not a regular file ({what})", p.stderr)
                self.assertNotIn("--force replaces it", p.stderr)
        self.assertTrue(os.path.isdir(d) and os.listdir(d) == [])
        self.assertTrue(stat.S_ISFIFO(os.lstat(fifo).st_mode))
        if os.path.exists(dev):
            self.assertTrue(stat.S_ISCHR(os.lstat(dev).st_mode))
        self.assertTrue(stat.S_ISCHR(os.lstat("/dev/null").st_mode))
        self.assertEqual([n for n in os.listdir(self.tmp) if ".tmp-" in n], [])


if __name__ == "__main__":
    h.main()
