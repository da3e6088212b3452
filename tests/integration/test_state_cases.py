"""Re-sharding and state completeness (cases C07, C08, C09, C10 of ../shared/cases/CASES.md):
a snapshot saved at one world size restores at others with the whole optimizer state, the
Adam step counter and its moments, and the run goes on as if it had not stopped.

The models are tiny (34816 padded parameters = 17 blocks of 2048, so that every one of up to
16 ranks owns part of the optimizer state) and snapshots are stored raw (--no-compress
--no-shuffle) so that this file reads the saved buffers itself: raw_buffer gathers a buffer
from every rank's shard, the way a restore at W = 1 would.

What proves that a restore at W' got exactly the saved state: the trainer checks, on every
restore, the all-gathered parameters against the record's params_digest and the moments
(adam_m, adam_v, digested over fixed blocks of the flat space, so independent of W) against
the record's moments_digest; a shard put back at the wrong place fails the restore
(test_distributed.py test_moments_at_the_wrong_place_are_caught). These tests assert the
restore happened, was re-sharded, and set nothing aside, then compare what followed.
"""
import json
import os
import shutil
import struct

import harness
from harness import Ranks, TempDirTest, run, snapshot_dirs

# 2 layers x 32: 34176 parameters, 34816 padded (17 blocks); 16 tokens a sequence
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--micro-batch", "1",
        "--lr", "3e-3", "--warmup", "2", "--seed", "3", "--log-every", "1", "--comm-timeout", "30",
        "--no-compress", "--no-shuffle"]


def launch(test, world, args):
    ranks = Ranks(world, args, test.tmp, base=TINY)
    codes = ranks.wait(300)
    test.assertEqual(codes, [0] * world, f"W={world} {args}: exits {codes}\n" +
                     "\n".join(ranks.stderr(r)[-1500:] for r in range(min(world, 3))))
    return ranks


def manifest(snap):
    with open(os.path.join(snap, "manifest.json")) as f:
        return json.load(f)


def raw_buffer(snap, name):
    """The whole buffer `name` of a snapshot stored raw, gathered from every rank's shard, as a
    tuple of floats."""
    m = manifest(snap)
    buf = next(b for b in m["buffers"] if b["name"] == name)
    out = bytearray(buf["total_bytes"])
    covered = 0
    for sh in buf["shards"]:
        if not sh["bytes"]:
            continue
        with open(os.path.join(snap, sh["file"]), "rb") as f:
            for c in sh["chunks"]:
                assert c["codec"] == "none" and c["filter"] == "none", c
                f.seek(c["file_offset"])
                data = f.read(c["bytes"])
                assert len(data) == c["bytes"]
                at = c["offset"]  # in the buffer (docs/FORMAT.md)
                assert sh["offset"] <= at and at + len(data) <= sh["offset"] + sh["bytes"], c
                out[at:at + len(data)] = data
                covered += len(data)
    assert covered == buf["total_bytes"] and len(out) == covered, (name, covered)
    return struct.unpack(f"<{len(out) // 4}f", bytes(out))


class StateCases(TempDirTest):
    def ck(self, name):
        return os.path.join(self.tmp, name)

    def only(self, src, step, name):
        """A copy of snapshot folder src holding only step-<step>."""
        d = self.ck(name)
        os.mkdir(d)
        s = f"step-{step:09d}"
        shutil.copytree(os.path.join(src, s), os.path.join(d, s))
        return d

    def assert_resumed(self, ranks, step, saved_by, world):
        err = ranks.stderr(0)
        self.assertRegex(err, rf"resumed from \S+step-{step:09d} at step {step} ")
        if saved_by != world:
            self.assertIn(f"re-sharding: the snapshot was saved by {saved_by} ranks, this run has "
                          f"{world}", err)
        self.assertNotIn("skipping corrupt", err)
        self.assertNotIn("digest", err.replace("params_digest", ""))  # no digest mismatch line

    def test_c07_zero_sharded_state_w8_resumes_at_w12_and_w6(self):
        """C07: ZeRO-2 (optimizer state and gradients sharded) at W=8, 24 micro-batches (3 a
        rank), snapshot at step 2; resumed at W=12 (2 a rank) and W=6 (4 a rank, not a power of
        two as a world size): both load, the restore's params and moments digests equal the
        record's (the gathered state is the saved one exactly), the saved moments are non-zero,
        and training goes on: at step 4 loss, parameters and Adam moments agree with the
        uninterrupted W=8 run within 1e-4 (other micro-batch splits round differently)."""
        args = ["--global-batch", "24", "--steps", "4", "--zero-stage", "2", "--ckpt-every", "2"]
        ref_dir = self.ck("w8")
        ref = launch(self, 8, args + ["--ckpt-dir", ref_dir]).final()
        step2 = os.path.join(ref_dir, "step-000000002")
        man = manifest(step2)
        self.assertEqual(man["world_size"], 8)
        for name in ("adam_m", "adam_v"):
            shards = next(b for b in man["buffers"] if b["name"] == name)["shards"]
            self.assertEqual(len([s for s in shards if s["bytes"]]), 8, f"{name}: owned by 8 ranks")
            x = raw_buffer(step2, name)
            self.assertGreater(sum(1 for v in x if v != 0.0), len(x) // 2, f"{name} mostly zero")
        want = {n: raw_buffer(os.path.join(ref_dir, "step-000000004"), n)
                for n in ("params", "adam_m", "adam_v")}
        for world in (12, 6):
            d = self.only(ref_dir, 2, f"w{world}")
            ranks = launch(self, world, args + ["--ckpt-dir", d, "--resume", "auto"])
            self.assert_resumed(ranks, 2, 8, world)
            got = ranks.final()
            self.assertAlmostEqual(got["loss"], ref["loss"], delta=1e-4, msg=f"W={world}")
            snap = os.path.join(d, "step-000000004")
            self.assertEqual(manifest(snap)["world_size"], world)
            self.assertEqual(manifest(snap)["trainer"]["optimizer"]["t"], 4)
            for n, w in want.items():
                g = raw_buffer(snap, n)
                worst = max(abs(a - b) for a, b in zip(g, w))
                # Adam's update divides by sqrt(v): compare the moments relative to their size
                scale = max(abs(b) for b in w)
                self.assertLess(worst, 1e-4 * max(1.0, scale) if n == "params" else 1e-3 * scale,
                                f"W={world} {n}: worst difference {worst} (largest value {scale})")

    def test_c08_w8_resumes_at_w16_same_digest(self):
        """C08: ZeRO-3 (parameters sharded too) at W=8, snapshot at step 2, resumed at W=16 (one
        micro-batch a rank): it loads, re-sharded, the restored parameters' digest equals the
        record's, and the final params digest equals the uninterrupted W=8 and W=1 runs' (16
        micro-batches: 2 and 1 a rank are powers of two, DESIGN section 4)."""
        args = ["--global-batch", "16", "--steps", "4", "--zero-stage", "3", "--ckpt-every", "2"]
        one = launch(self, 1, args[:-2]).final()
        ref_dir = self.ck("w8")
        ref = launch(self, 8, args + ["--ckpt-dir", ref_dir]).final()
        self.assertEqual(ref["digest"], one["digest"])
        d = self.only(ref_dir, 2, "w16")
        ranks = launch(self, 16, args + ["--ckpt-dir", d, "--resume", "auto"])
        self.assert_resumed(ranks, 2, 8, 16)
        self.assertEqual(ranks.final()["digest"], ref["digest"])
        self.assertEqual(manifest(os.path.join(d, "step-000000004"))["trainer"]["params_digest"],
                         manifest(os.path.join(ref_dir, "step-000000004"))["trainer"]["params_digest"])

    def test_c09_adam_step_counter_survives_w4_to_w2(self):
        """C09: W=4 saves step 100 (record: Adam t = 100); resumed at W=2 it goes on with t = 101:
        the first update after the resume equals the uninterrupted run's bit for bit (params
        digest, Adam moments and loss of step 101), which a bias correction restarted at t = 1
        could not give."""
        args = ["--global-batch", "8", "--steps", "101", "--ckpt-every", "100"]
        ref_dir = self.ck("w4")
        ref = launch(self, 4, args + ["--ckpt-dir", ref_dir]).final()
        self.assertEqual(snapshot_dirs(ref_dir), ["step-000000100", "step-000000101"])
        rec = manifest(os.path.join(ref_dir, "step-000000100"))["trainer"]
        self.assertEqual((rec["step"], rec["optimizer"]["t"]), (100, 100))
        d = self.only(ref_dir, 100, "w2")
        ranks = launch(self, 2, args + ["--ckpt-dir", d, "--resume", "auto"])
        self.assert_resumed(ranks, 100, 4, 2)
        self.assertEqual(ranks.final()["digest"], ref["digest"])
        a = os.path.join(ref_dir, "step-000000101")
        b = os.path.join(d, "step-000000101")
        ra, rb = manifest(a)["trainer"], manifest(b)["trainer"]
        self.assertEqual(rb["optimizer"]["t"], 101)
        self.assertEqual(repr(rb["loss"]), repr(ra["loss"]))
        self.assertEqual(rb["moments_digest"], ra["moments_digest"])
        for n in ("adam_m", "adam_v"):
            self.assertEqual(raw_buffer(b, n), raw_buffer(a, n), n)

    def test_c10_adam_moments_restored_in_a_fresh_process(self):
        """C10: one process saves after step 50; a fresh process restores it: the saved Adam m and
        v are non-zero (almost everywhere), and the step-51 loss (the trainer record's double),
        the params digest and m and v after step 51 equal the uninterrupted run's bit for bit
        (m and v restored as zeros would change all of them)."""
        args = ["--global-batch", "4", "--steps", "51", "--ckpt-every", "50"]
        ref_dir = self.ck("ref")
        p = harness.run([harness.TRAIN] + harness.data_args() + TINY + args + ["--ckpt-dir", ref_dir],
                        check=True)
        ref = harness.final(p)
        s50 = os.path.join(ref_dir, "step-000000050")
        for n in ("adam_m", "adam_v"):
            x = raw_buffer(s50, n)
            # the padding past the last parameter stays 0
            self.assertGreater(sum(1 for v in x if v != 0.0), 0.9 * 34176, n)
        d = self.only(ref_dir, 50, "fresh")
        p = harness.run([harness.TRAIN] + harness.data_args() + TINY + args +
                        ["--ckpt-dir", d, "--resume", "auto"], check=True)
        self.assertRegex(p.stderr, r"resumed from \S+step-000000050 at step 50 ")
        self.assertEqual(harness.final(p)["digest"], ref["digest"])
        a, b = os.path.join(ref_dir, "step-000000051"), os.path.join(d, "step-000000051")
        self.assertEqual(repr(manifest(b)["trainer"]["loss"]), repr(manifest(a)["trainer"]["loss"]))
        for n in ("params", "adam_m", "adam_v"):
            self.assertEqual(raw_buffer(b, n), raw_buffer(a, n), n)


if __name__ == "__main__":
    harness.main()
