"""End to end on the Brown corpus: the loss falls, and a run killed with SIGKILL at a random
step and restarted with --resume auto ends with the same params_digest as an uninterrupted
run (DESIGN section 4, I3)."""
import os
import random
import re

import harness as h


class EndToEnd(h.TempDirTest):
    def test_loss_falls_below_uniform(self):
        ref = h.reference()
        self.assertEqual(ref["step"], 60)
        # uniform bytes: ln 256 = 5.55 nats; a 60-step run of the small model gets near 3
        self.assertLess(ref["val_loss"], 3.5, ref)
        self.assertLess(ref["loss"], 3.5, ref)

    def test_same_config_same_bits(self):
        again = h.final(h.train([]))
        self.assertEqual(again["digest"], h.reference()["digest"])

    def test_kill_at_random_step_then_resume_auto(self):
        ref = h.reference()
        ckpt = os.path.join(self.tmp, "ckpt")
        args = ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"]
        kill_step = random.Random().randint(21, 58)
        print(f"kill at step {kill_step}")
        rc, killed_at, log = h.train_and_kill_at(args, kill_step)
        self.assertEqual(rc, -9, f"the run was not killed (rc {rc}):\n{log[-2000:]}")
        self.assertIsNotNone(killed_at)
        # snapshots persist in the background: the run resumes from the newest snapshot that
        # had committed when the kill came (at least the newest one logged as committed; one
        # that committed in the instant before the kill may not be logged yet), or starts
        # fresh when none had
        committed = [int(x) for x in re.findall(r"snapshot step (\d+) committed", log)]
        p = h.train(args)
        m = re.search(r"resumed from \S+step-(\d+) at step (\d+)", p.stderr)
        if m is None:
            self.assertRegex(p.stderr, r"no usable snapshot in \S+: fresh start")
        resumed = int(m.group(2)) if m else 0
        print(f"killed after step {killed_at}; logged commits {committed}; resumed at {resumed}")
        self.assertEqual(resumed % 20, 0)
        self.assertGreaterEqual(resumed, max(committed, default=0))
        self.assertLessEqual(resumed, killed_at)
        self.assertEqual(h.final(p)["digest"], ref["digest"])
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000040", "step-000000060"])
        self.assertEqual(h.temp_dirs(ckpt), [])
        for d in h.snapshot_dirs(ckpt):
            v = h.run([h.INSPECT, "verify", os.path.join(ckpt, d)])
            self.assertEqual(v.returncode, 0, v.stderr)

    def test_resume_from_explicit_path(self):
        ref = h.reference()
        ckpt = os.path.join(self.tmp, "ckpt")
        h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20"])
        p = h.train(["--resume", os.path.join(ckpt, "step-000000040")])
        self.assertIn("resumed from", p.stderr)
        self.assertEqual(h.final(p)["digest"], ref["digest"])

    def test_resume_auto_without_snapshots_starts_fresh(self):
        ckpt = os.path.join(self.tmp, "empty")
        p = h.train(["--ckpt-dir", ckpt, "--resume", "auto"])
        self.assertRegex(p.stderr, r"no usable snapshot in .*: fresh start")
        self.assertEqual(h.final(p)["digest"], h.reference()["digest"])

    def test_resume_at_final_step_trains_nothing(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20"])
        p = h.train(["--ckpt-dir", ckpt, "--resume", "auto"])
        self.assertIn("nothing to train", p.stderr)
        self.assertEqual(h.final(p)["digest"], h.reference()["digest"])


if __name__ == "__main__":
    h.main()
