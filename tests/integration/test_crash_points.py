"""Crash consistency of the save path (cases C01, C02, C03, C04): the process is killed at
each named fault point of a save (ckpt/ckpt_internal.h), or the disk returns ENOSPC; the next
`--resume auto` lands on the new or the previous snapshot, never fails, never loses a
committed snapshot, leaves no temp folder, and the final weights equal the uninterrupted
run's."""
import os
import re

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
        # mid-upload: test_s3.py (armed through CKPT_FAULT_DIR)
        self.assertEqual(names - {"during-retention", "after-part", "mid-upload"}, set(POINTS))

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


if __name__ == "__main__":
    h.main()
