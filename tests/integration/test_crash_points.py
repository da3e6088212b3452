"""Crash consistency of the save path (cases C01, C02, C03, C04): the process is killed at
each named fault point of a save (ckpt/ckpt_internal.h), or the disk returns ENOSPC; the next
`--resume auto` lands on the new or the previous snapshot, never fails, never loses a
committed snapshot, leaves no temp folder, and the final weights equal the uninterrupted
run's. Faults armed at run time by touching a file in CKPT_FAULT_DIR (what tests/chaos
does) fire once, in one process, and then never again.
"""
import os
import re
import subprocess
import signal
import tempfile
import time

import harness as h

# fault point -> whether step 40 is committed after the crash
POINTS = {
    "before-chunk-write": False,
    "mid-chunk": False,
    "mid-data": False,
    "after-data-fsync": False,
    "after-manifest": False,
    "after-rename": True,
}


def stopped(pid):
    """True once the process is stopped (state T in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def train_arming(args, fault_dir, name, point, timeout=300):
    """Run train with CKPT_FAULT_DIR=fault_dir and touch fault_dir/name: before the start when
    point is None, else once the process has stopped itself at CKPT_FAULT_POINT=point (a
    "<name>@<step>:stop" point), then send SIGCONT. Either way the fault is armed at a known
    instant of the run, whatever the machine's load (a test that armed it on seeing a log
    line lost that race on a loaded CI machine). Returns a CompletedProcess."""
    if point is None:
        open(os.path.join(fault_dir, name), "w").close()
        p = subprocess.run([h.TRAIN] + h.data_args() + h.SMALL + list(args),
                           capture_output=True, text=True, timeout=timeout,
                           env=h.env({"CKPT_FAULT_DIR": fault_dir}))
        return p
    err = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([h.TRAIN] + h.data_args() + h.SMALL + list(args), stdout=subprocess.PIPE,
                         stderr=err, text=True,
                         env=h.env({"CKPT_FAULT_DIR": fault_dir, "CKPT_FAULT_POINT": point}))
    armed = False
    try:
        deadline = time.time() + timeout
        while p.poll() is None and time.time() < deadline:
            if stopped(p.pid):
                open(os.path.join(fault_dir, name), "w").close()
                armed = True
                os.kill(p.pid, signal.SIGCONT)
                break
            time.sleep(0.005)
        out = p.communicate(timeout=max(1, deadline - time.time()))[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err.seek(0)
    text = err.read()
    err.close()
    if not armed:
        raise AssertionError(f"the run never stopped at {point} (exit {p.returncode}):\n"
                             + text[-1500:])
    return subprocess.CompletedProcess(p.args, p.returncode, out, text)


class CrashPoints(h.TempDirTest):
    def crash_then_resume(self, point, committed):
        ref = h.reference()
        ckpt = os.path.join(self.tmp, point)
        args = ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"]
        p = h.train(args, extra_env={"CKPT_FAULT_POINT": f"{point}@40"}, check=False)
        self.assertEqual(p.returncode, -9, f"{point}: expected SIGKILL, got {p.returncode}\n{p.stderr[-1500:]}")
        self.assertIn(f"fault point {point} reached at step 40", p.stderr)
        snaps = h.snapshot_dirs(ckpt)
        want = ["step-000000020", "step-000000040"] if committed else ["step-000000020"]
        self.assertEqual(snaps, want, f"{point}: final names after the crash")
        if not committed:
            self.assertEqual(len(h.temp_dirs(ckpt)), 1, f"{point}: the interrupted save's temp folder")
        # no truncated or half-written file is ever visible under a final name
        for d in snaps:
            v = h.run([h.INSPECT, "verify", os.path.join(ckpt, d)])
            self.assertEqual(v.returncode, 0, f"{point}: {d}: {v.stderr}")
        r = h.train(args)
        m = re.search(r"resumed from \S+step-(\d+) at step (\d+)", r.stderr)
        self.assertIsNotNone(m, r.stderr[-1500:])
        self.assertEqual(int(m.group(2)), 40 if committed else 20, point)
        if not committed:
            self.assertRegex(r.stderr, r"removed leftover temp folder \S+\.tmp-step-000000040-")
        self.assertEqual(h.temp_dirs(ckpt), [], f"{point}: temp folders left after the restart")
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000040", "step-000000060"])
        self.assertEqual(h.final(r)["digest"], ref["digest"], point)

    def test_c01_kill_with_half_the_bytes_written(self):
        self.crash_then_resume("mid-data", False)

    def test_kill_in_the_middle_of_a_chunk(self):
        self.crash_then_resume("mid-chunk", False)

    def test_every_point_is_tested(self):
        """The list above names every fault point of the save path (ckpt/ckpt_internal.h)."""
        header = h.read(os.path.join(os.path.dirname(__file__), "../../ckpt/ckpt_internal.h"))
        block = header[header.index("Names along the save path"):header.index("void ckpt_fault_point")]
        names = set(re.findall(r"^ \*   ([a-z-]+) ", block, re.M))
        # during-retention: test_retention.py; after-part (ranks != 0 only): test_distributed.py;
        # mid-upload: test_s3.py test_mid_upload_armed_in_fault_dir_c32 (armed through
        # CKPT_FAULT_DIR; the arming itself: test_fault_dir_* below); during-remote-retention:
        # test_s3.py test_killed_during_remote_retention
        self.assertEqual(names - {"during-retention", "after-part", "mid-upload",
                                  "during-remote-retention"}, set(POINTS))

    def test_kill_before_first_chunk(self):
        self.crash_then_resume("before-chunk-write", False)

    def test_kill_after_data_fsync(self):
        self.crash_then_resume("after-data-fsync", False)

    def test_c03_kill_after_manifest_before_rename(self):
        self.crash_then_resume("after-manifest", False)

    def test_c04_kill_after_rename(self):
        self.crash_then_resume("after-rename", True)

    def test_c02_enospc_during_save(self):
        """A snapshot whose write fails is not committed, leaves nothing behind, and training
        goes on; the next snapshot commits; a resume never sees the failed step."""
        ckpt = os.path.join(self.tmp, "enospc")
        args = ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"]
        # each save of the small model is two 1 MiB writes: write 3 is the first of step 40
        p = h.train(args, extra_env={"CKPT_FAULT_STORE": "enospc:3"})
        self.assertRegex(p.stderr, r"snapshot step 40 failed: No space left on device; it is not committed")
        self.assertRegex(p.stderr, r"snapshot step 60 committed")
        self.assertEqual(h.final(p)["digest"], h.reference()["digest"])
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000060"])
        self.assertEqual(h.temp_dirs(ckpt), [], "a failed save removes its temp folder")
        for root, _, files in os.walk(ckpt):
            for f in files:
                self.assertGreater(os.path.getsize(os.path.join(root, f)), 0, f"zero-length {f}")

    def test_c02_enospc_on_last_snapshot_fails_the_run(self):
        ckpt = os.path.join(self.tmp, "enospc-last")
        args = ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"]
        p = h.train(args, extra_env={"CKPT_FAULT_STORE": "eio:5"}, check=False)
        self.assertEqual(p.returncode, 1, p.stderr[-1500:])
        self.assertIn("the snapshot of the last step 60 failed: Input/output error", p.stderr)
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000040"])
        self.assertEqual(h.temp_dirs(ckpt), [])
        r = h.train(args)
        self.assertRegex(r.stderr, r"resumed from \S+step-000000040 at step 40")
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])

    # ------------------------------------------------------------------ CKPT_FAULT_DIR

    def fault_dir_point(self, point, committed):
        """A point armed while the run trains (stopped once step 20 is renamed) fires once: at the
        save of step 40, SIGKILL, its file gone; the resume with the same environment passes
        the point again (saves of 40 and 60) without dying and ends on the reference."""
        ckpt = os.path.join(self.tmp, point)
        faults = os.path.join(self.tmp, "faults-" + point)
        os.mkdir(faults)
        args = ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"]
        p = train_arming(args, faults, point, "after-rename@20:stop")
        self.assertEqual(p.returncode, -9, f"{point}: expected SIGKILL, got {p.returncode}\n{p.stderr[-1500:]}")
        self.assertIn(f"fault point {point} reached at step 40: killing this process (armed in "
                      "CKPT_FAULT_DIR)", p.stderr)
        self.assertEqual(os.listdir(faults), [], "a point that fired removes its file")
        want = ["step-000000020", "step-000000040"] if committed else ["step-000000020"]
        self.assertEqual(h.snapshot_dirs(ckpt), want, point)
        r = h.train(args, extra_env={"CKPT_FAULT_DIR": faults})
        self.assertNotIn("fault point", r.stderr, "a one-shot point fired twice")
        self.assertRegex(r.stderr, r"resumed from \S+step-0000000%d at step %d" %
                         ((40, 40) if committed else (20, 20)))
        self.assertEqual(h.temp_dirs(ckpt), [])
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000040", "step-000000060"])
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"], point)

    def test_fault_dir_after_rename_fires_once(self):
        self.fault_dir_point("after-rename", True)

    def test_fault_dir_mid_data_fires_once(self):
        self.fault_dir_point("mid-data", False)

    def test_fault_dir_armed_before_the_start_and_unarmed_points(self):
        """A file touched before the start fires at the first save; a file of another name
        (an unknown point) is left alone and never fires."""
        ckpt = os.path.join(self.tmp, "early")
        faults = os.path.join(self.tmp, "faults")
        os.mkdir(faults)
        open(os.path.join(faults, "no-such-point"), "w").close()
        args = ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"]
        p = train_arming(args, faults, "before-chunk-write", None)
        self.assertEqual(p.returncode, -9, p.stderr[-1500:])
        self.assertIn("fault point before-chunk-write reached at step 20", p.stderr)
        self.assertEqual(os.listdir(faults), ["no-such-point"])
        self.assertEqual(h.snapshot_dirs(ckpt), [])
        r = h.train(args, extra_env={"CKPT_FAULT_DIR": faults})
        self.assertNotIn("fault point", r.stderr)
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000040", "step-000000060"])
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])

    def test_fault_point_with_an_unknown_action_never_fires(self):
        """CKPT_FAULT_POINT="after-rename@20:bogus": one line says the variable is ignored and
        the run neither dies nor stops there."""
        ckpt = os.path.join(self.tmp, "bogus")
        r = h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20"],
                    extra_env={"CKPT_FAULT_POINT": "after-rename@20:bogus"}, timeout=300)
        self.assertIn('ignoring CKPT_FAULT_POINT="after-rename@20:bogus": unknown action', r.stderr)
        self.assertNotIn("fault point", r.stderr)
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000040", "step-000000060"])

    def fault_dir_store(self, name, error):
        """store-enospc / store-eio armed once step 20 is renamed to its final name (the run
        stopped there): the first data write of step 40 fails, step 40 alone is not
        committed, training goes on to the reference."""
        ckpt = os.path.join(self.tmp, name)
        faults = os.path.join(self.tmp, "faults-" + name)
        os.mkdir(faults)
        args = ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"]
        p = train_arming(args, faults, name, "after-rename@20:stop")
        self.assertEqual(p.returncode, 0, p.stderr[-1500:])
        self.assertIn("fault point after-rename reached at step 20: stopping this process", p.stderr)
        self.assertIn(f"snapshot step 40 failed: {error}; it is not committed", p.stderr)
        self.assertEqual(len(re.findall(r"snapshot step \d+ failed", p.stderr)), 1, p.stderr[-2000:])
        self.assertIn("snapshot step 60 committed", p.stderr)
        self.assertEqual(os.listdir(faults), [])
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000060"])
        self.assertEqual(h.temp_dirs(ckpt), [], "a failed save removes its temp folder")
        self.assertEqual(h.final(p)["digest"], h.reference()["digest"])

    def test_fault_dir_store_enospc_costs_one_snapshot(self):
        self.fault_dir_store("store-enospc", "No space left on device")

    def test_fault_dir_store_eio_costs_one_snapshot(self):
        self.fault_dir_store("store-eio", "Input/output error")

    def test_fault_dir_store_eio_read_during_resume_is_transient(self):
        """store-eio-read: the resume's read fails once; that is no verdict on the bytes (no
        snapshot called corrupt, nothing renamed aside), the run exits 1, and the next run
        with the same environment resumes from the same snapshot."""
        ckpt = os.path.join(self.tmp, "eio-read")
        faults = os.path.join(self.tmp, "faults")
        os.mkdir(faults)
        args = ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"]
        p = h.train(args, extra_env={"CKPT_FAULT_POINT": "after-rename@40"}, check=False)
        self.assertEqual(p.returncode, -9, p.stderr[-1500:])
        before = sorted(os.listdir(ckpt))
        open(os.path.join(faults, "store-eio-read"), "w").close()
        r = h.train(args, extra_env={"CKPT_FAULT_DIR": faults}, check=False)
        self.assertEqual(r.returncode, 1, r.stderr[-2000:])
        self.assertRegex(r.stderr, r"cannot read \S+step-000000040: .*Input/output error.*nothing "
                         r"was renamed")
        self.assertNotIn("corrupt", r.stderr)
        self.assertEqual(os.listdir(faults), [])
        self.assertEqual(sorted(os.listdir(ckpt)), before, "nothing renamed aside")
        r = h.train(args, extra_env={"CKPT_FAULT_DIR": faults})
        self.assertRegex(r.stderr, r"resumed from \S+step-000000040 at step 40")
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])


if __name__ == "__main__":
    h.main()
