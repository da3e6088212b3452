"""Corrupt snapshots (case C05 and friends): verify and resume detect a truncated shard file,
a flipped byte, a missing or garbage manifest; they name the file (and chunk); resume falls
back to the next older snapshot and still ends bit-identical to the uninterrupted run. A
snapshot is never accepted just because its manifest exists (I1)."""
import json
import os
import re
import shutil

import harness as h


class Corruption(h.TempDirTest):
    def setUp(self):
        super().setUp()
        self.ckpt = os.path.join(self.tmp, "ckpt")
        h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20"])
        self.newest = os.path.join(self.ckpt, "step-000000060")
        self.shard = os.path.join(self.newest, "rank-00000.bin")

    def flip_middle_byte(self):
        """Flip one bit of the byte in the middle of the newest snapshot's shard."""
        size = os.path.getsize(self.shard)
        with open(self.shard, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x01]))

    def resume_falls_back(self, pattern):
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--resume", "auto"])
        self.assertRegex(r.stderr, pattern)
        self.assertRegex(r.stderr, r"set \S+step-000000060 aside as \S+step-000000060\.corrupt-\d+")
        self.assertRegex(r.stderr, r"resumed from \S+step-000000040 at step 40")
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])

    def test_set_aside_name_taken(self):
        """The names a corrupt snapshot would be set aside as are taken (the same step found
        corrupt twice within a second; here made by hand, non-empty and empty, for the next
        seconds): it goes aside under .corrupt-<seconds>-<k>, none of the taken ones is
        touched, and the resume falls back as usual. Once the rename failed ('Directory not
        empty') and the run was refused as if the corrupt snapshot were committed."""
        import time
        now = int(time.time())
        taken = []
        for t in range(now, now + 60):  # a minute: also on a slow sanitizer build
            d = os.path.join(self.ckpt, f"step-000000060.corrupt-{t}")
            os.mkdir(d)
            if t % 2 == 0:
                with open(os.path.join(d, "keep"), "w") as f:
                    f.write(str(t))
            taken.append(d)
        self.flip_middle_byte()
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--resume", "auto"])
        m = re.search(r"set \S+step-000000060 aside as \S+(step-000000060\.corrupt-\d+-\d+)", r.stderr)
        self.assertTrue(m, r.stderr[-2000:])
        self.assertRegex(r.stderr, r"resumed from \S+step-000000040 at step 40")
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])
        for d in taken:
            t = int(d.rsplit("-", 1)[1])
            self.assertEqual(os.listdir(d), ["keep"] if t % 2 == 0 else [], d)
        self.assertTrue(os.path.exists(os.path.join(self.ckpt, m.group(1), "manifest.json")))

    def test_set_aside_refused_stops_the_resume(self):
        """The folder refuses the rename that sets a corrupt snapshot aside (immutable as root,
        read-only otherwise): the resume stops there, exit 1, one error line with the cause -
        not a resume from an older snapshot that then refused the run (exit 2) as if the
        corrupt one were committed, advising the --resume auto that had just failed."""
        self.flip_middle_byte()
        import subprocess
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i", self.ckpt], check=True)
            self.addCleanup(subprocess.run, ["chattr", "-i", self.ckpt], check=True)
        else:
            os.chmod(self.ckpt, 0o555)
            self.addCleanup(os.chmod, self.ckpt, 0o755)
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--resume", "auto"], check=False)
        self.assertEqual(r.returncode, 1, r.stderr[-2000:])
        self.assertRegex(r.stderr, r"ERROR .*cannot set the corrupt snapshot \S+step-000000060 aside: "
                                   r"(Operation not permitted|Permission denied); not resuming from an older one")
        self.assertNotIn("resumed from", r.stderr)
        self.assertNotIn("already holds", r.stderr)
        self.assertTrue(os.path.isdir(self.newest))

    def test_c05_flipped_byte(self):
        self.flip_middle_byte()
        v = h.run([h.INSPECT, "verify", self.newest])
        self.assertEqual(v.returncode, 1)
        self.assertRegex(v.stderr, r"rank-00000\.bin: chunk \d+ of \w+ .*checksum mismatch")
        self.resume_falls_back(r"skipping corrupt snapshot \S+step-000000060: \S+rank-00000\.bin: chunk \d+ of \w+")
        # the corrupt snapshot was set aside, not deleted: its bytes stay for inspection,
        # and the step was saved again under its own name
        aside = [d for d in os.listdir(self.ckpt) if d.startswith("step-000000060.corrupt-")]
        self.assertEqual(len(aside), 1, os.listdir(self.ckpt))
        self.assertEqual(h.run([h.INSPECT, "verify", os.path.join(self.ckpt, aside[0])]).returncode, 1)
        self.assertEqual(h.run([h.INSPECT, "verify", self.newest]).returncode, 0)
        lst = json.loads(h.run([h.INSPECT, "list", self.ckpt, "--json"], check=True).stdout)
        self.assertEqual([(s["step"], s["status"]) for s in lst["snapshots"]],
                         [(20, "committed"), (40, "committed"), (60, "committed"), (60, "set-aside")])

    def test_c05_truncated_by_one_byte(self):
        size = os.path.getsize(self.shard)
        os.truncate(self.shard, size - 1)
        v = h.run([h.INSPECT, "verify", self.newest])
        self.assertEqual(v.returncode, 1)
        self.assertIn("rank-00000.bin", v.stderr)
        lst = h.run([h.INSPECT, "list", self.ckpt, "--json"], check=True)
        status = {s["step"]: s["status"] for s in json.loads(lst.stdout)["snapshots"]}
        self.assertEqual(status, {20: "committed", 40: "committed", 60: "corrupt"})
        self.resume_falls_back(r"skipping \S+step-000000060: corrupt \(data file \S+rank-00000\.bin has \d+ bytes")

    def test_c01_missing_manifest(self):
        os.unlink(os.path.join(self.newest, "manifest.json"))
        self.resume_falls_back(r"skipping \S+step-000000060: corrupt \(no manifest\.json\)")

    def test_garbage_manifest(self):
        with open(os.path.join(self.newest, "manifest.json"), "wb") as f:
            f.write(os.urandom(300))
        self.resume_falls_back(r"skipping \S+step-000000060: corrupt \(")

    def test_manifest_digit_changed(self):
        path = os.path.join(self.newest, "manifest.json")
        text = open(path).read()
        changed = re.sub(r'"samples_consumed":(\d+)', lambda m: f'"samples_consumed":{int(m.group(1)) + 1}', text)
        self.assertNotEqual(text, changed)
        open(path, "w").write(changed)
        v = h.run([h.INSPECT, "verify", self.newest])
        self.assertEqual(v.returncode, 1)
        self.assertIn("manifest checksum mismatch", v.stderr)
        self.resume_falls_back(r"skipping \S+step-000000060: corrupt \(manifest checksum mismatch")

    def test_all_snapshots_corrupt_is_refused_without_allow_fresh_start(self):
        """Snapshots exist and none can be restored: a silent start from step 0 would lose the
        run's work (issue 9). Exit 2 listing each and why; a retry (the agent's restart, with
        the snapshots now set aside) refuses the same; --allow-fresh-start starts over."""
        names = h.snapshot_dirs(self.ckpt)
        self.assertGreaterEqual(len(names), 2)
        for d in names:
            os.unlink(os.path.join(self.ckpt, d, "manifest.json"))
        for attempt in range(2):
            r = h.train(["--ckpt-dir", self.ckpt, "--resume", "auto"], check=False)
            self.assertEqual(r.returncode, 2, r.stderr[-2000:])
            self.assertRegex(r.stderr, r"refusing to start from step 0: \S+ holds %d snapshots and "
                                       r"none can be restored" % len(names))
            for d in names:
                self.assertIn(d, r.stderr)
            self.assertIn("--allow-fresh-start", r.stderr)
            self.assertNotRegex(r.stdout, r"final step=")
            left = os.listdir(self.ckpt)
            self.assertEqual([d for d in names if d in left], [], "set aside on the first attempt")
            self.assertEqual(len([d for d in left if ".corrupt-" in d]), len(names))
        r = h.train(["--ckpt-dir", self.ckpt, "--resume", "auto", "--allow-fresh-start"])
        self.assertRegex(r.stderr, r"no restorable snapshot in \S+: fresh start as "
                                   r"--allow-fresh-start permits")
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])

    def test_empty_folder_is_a_fresh_start(self):
        empty = os.path.join(self.tmp, "empty")
        r = h.train(["--ckpt-dir", empty, "--resume", "auto", "--steps", "5"])
        self.assertRegex(r.stderr, r"no usable snapshot in \S+: fresh start")

    def test_explicit_resume_of_corrupt_snapshot_fails(self):
        with open(self.shard, "r+b") as f:
            f.seek(100)
            f.write(b"\xff\xff\xff\xff")
        r = h.train(["--resume", self.newest], check=False)
        self.assertEqual(r.returncode, 2, "a corrupt snapshot named explicitly is an input error")
        self.assertRegex(r.stderr, r"cannot resume from \S+step-000000060: \S+rank-00000\.bin: chunk 0 of params")


if __name__ == "__main__":
    h.main()
