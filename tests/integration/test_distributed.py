"""Data-parallel training over W processes (issue 4): bit-identical results across world sizes
and ZeRO stages, sharded snapshots with a two-phase commit, re-sharding on restore, dead and
stopped ranks, the sampler across a world-size change, and the batch rules.

Processes are started the torchrun way by harness.Ranks (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); rank 0 hosts the store.
"""
import json
import os
import re
import shutil
import signal
import struct
import time

import harness
from harness import Ranks, TempDirTest, run, snapshot_dirs, temp_dirs

# 24 sequences per step: 8 micro-batches of 3 at W=1, 4 of 3 at W=2, 2 of 3 at W=4.
DIST = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
        "--global-batch", "24", "--steps", "6", "--lr", "3e-3", "--warmup", "2", "--seed", "7",
        "--val-samples", "12", "--log-every", "1"]
MB3 = ["--micro-batch", "3"]


def launch(test, world, args, rank_env=None, extra_env=None, base=None, timeout=300):
    ranks = Ranks(world, args, test.tmp, rank_env=rank_env, extra_env=extra_env,
                  base=DIST if base is None else base)
    codes = ranks.wait(timeout)
    return ranks, codes


def ok(test, world, args, **kw):
    ranks, codes = launch(test, world, args, **kw)
    test.assertEqual(codes, [0] * world, f"W={world} {args}: exits {codes}\n" +
                     "\n".join(ranks.stderr(r)[-1500:] for r in range(world)))
    return ranks.final()


def safetensors(path):
    """{name: list of floats} of a safetensors file (fp32 only)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = struct.unpack(f"<{(b - a) // 4}f", data[a:b])
    return out


class Distributed(TempDirTest):
    def ckpt(self, name="ck"):
        return os.path.join(self.tmp, name)

    def test_digest_equal_across_world_sizes_and_stages(self):
        """DESIGN section 4: W = 1, 2, 4 and ZeRO stages 0-3 give identical bits."""
        ref = ok(self, 1, MB3)
        for world, stage in [(2, 1), (2, 3), (4, 0), (4, 2), (4, 3)]:
            got = ok(self, world, MB3 + ["--zero-stage", str(stage)])
            self.assertEqual(got["digest"], ref["digest"], f"W={world} stage {stage}")
            self.assertEqual(got["loss"], ref["loss"])
            self.assertEqual(got["val_loss"], ref["val_loss"])
        self.assertTrue(ref["val_loss"] < 5.6)

    def test_zero3_validation_with_uneven_chunks(self):
        """ZeRO-3 with 3 ranks and 4 validation chunks (1, 1, 2 per rank): evaluation gathers the
        parameters once instead of per layer, so the ranks' unequal work does not desynchronise
        the collectives; loss, val_loss and digest equal one process's (4 micro-batches a rank)."""
        args = ["--micro-batch", "2", "--val-samples", "8", "--steps", "4", "--eval-every", "2",
                "--comm-timeout", "10"]
        ref = ok(self, 1, args)
        got = ok(self, 3, args + ["--zero-stage", "3"])
        self.assertEqual((got["digest"], got["val_loss"]), (ref["digest"], ref["val_loss"]))

    def test_world_size_8_tiny_model_with_empty_shards(self):
        """W = 8 on a model of 4 blocks (8192 floats): ranks 4-7 own nothing; the digest still
        equals W = 1, their shards are empty in the manifest, and W = 2 resumes from it."""
        tiny = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq-len", "16",
                "--micro-batch", "1", "--global-batch", "8", "--steps", "4", "--seed", "3",
                "--val-samples", "8"]
        ref = ok(self, 1, [], base=tiny)
        d = self.ckpt()
        got = ok(self, 8, ["--zero-stage", "3", "--ckpt-dir", d, "--ckpt-every", "2"], base=tiny)
        self.assertEqual(got["digest"], ref["digest"])
        with open(os.path.join(d, "step-000000004", "manifest.json")) as f:
            shards = json.load(f)["buffers"][0]["shards"]
        self.assertEqual([s["bytes"] for s in shards], [8192] * 4 + [0] * 4)
        shutil.rmtree(os.path.join(d, "step-000000004"))
        got2 = ok(self, 2, ["--ckpt-dir", d, "--ckpt-every", "2", "--resume", "auto"], base=tiny)
        self.assertEqual(got2["digest"], ref["digest"])

    def test_save_at_4_resume_at_2_1_and_3(self):
        ref_dir = self.ckpt("ref")
        ref = ok(self, 1, MB3 + ["--ckpt-dir", ref_dir, "--ckpt-every", "3"])
        four = self.ckpt("four")
        got4 = ok(self, 4, MB3 + ["--ckpt-dir", four, "--ckpt-every", "3"])
        self.assertEqual(got4["digest"], ref["digest"])
        with open(os.path.join(four, "step-000000003", "manifest.json")) as f:
            man = json.load(f)
        self.assertEqual(man["world_size"], 4)
        self.assertEqual(sorted(x["name"] for x in man["files"]),
                         [f"rank-0000{r}.bin" for r in range(4)])
        self.assertEqual([s["rank"] for s in man["buffers"][0]["shards"]], [0, 1, 2, 3])
        shutil.rmtree(os.path.join(four, "step-000000006"))
        for world in (2, 1):
            d = self.ckpt(f"w{world}")
            shutil.copytree(four, d)
            ranks, codes = launch(self, world, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3",
                                                      "--resume", "auto"])
            self.assertEqual(codes, [0] * world, ranks.stderr(0)[-2000:])
            self.assertIn("resumed from", ranks.stderr(0))
            self.assertIn("saved by 4 ranks", ranks.stderr(0))
            self.assertEqual(ranks.final()["digest"], ref["digest"], f"resume at W={world}")
            with open(os.path.join(d, "step-000000006", "manifest.json")) as f:
                self.assertEqual(json.load(f)["world_size"], world)
        # W = 3 cannot split 24 into micro-batches of 3 on 3 ranks: refused, then with 2
        d = self.ckpt("w3")
        shutil.copytree(four, d)
        ranks, codes = launch(self, 3, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3", "--resume", "auto"])
        self.assertEqual(codes, [2, 2, 2])
        self.assertIn("multiple of 9", ranks.stderr(0))
        got3 = ok(self, 3, ["--micro-batch", "2", "--ckpt-dir", d, "--ckpt-every", "3",
                            "--resume", "auto"])
        self.assertNotEqual(got3["digest"], ref["digest"])  # other micro-batches: other rounding
        self.assertAlmostEqual(got3["loss"], ref["loss"], delta=1e-3)
        a, b = os.path.join(self.tmp, "a.st"), os.path.join(self.tmp, "b.st")
        run([harness.INSPECT, "export", os.path.join(ref_dir, "step-000000006"), a], check=True)
        run([harness.INSPECT, "export", os.path.join(d, "step-000000006"), b], check=True)
        ta, tb = safetensors(a), safetensors(b)
        self.assertEqual(sorted(ta), sorted(tb))
        worst = max(abs(x - y) for n in ta for x, y in zip(ta[n], tb[n]))
        self.assertLess(worst, 1e-4)

    def test_staged_restore_reshards_and_finds_corruption(self):
        """CKPT_RESTORE_STAGED=1 runs the resume's GPU path on the CPU device (issue 11,
        section 4): each slice is read and decompressed into a pinned bounce buffer while the
        copy of the previous one runs on the copy stream into the device state, which is then
        gathered and checked against the record. A ZeRO-3 snapshot of 4 ranks restores at 2
        and 1 to the bits of the uninterrupted run; a flipped byte is found through that path
        and the older snapshot used."""
        # slices of an odd size: many per buffer, none on a chunk or element boundary
        staged = {"CKPT_RESTORE_STAGED": "1", "CKPT_RESTORE_SLICE_BYTES": "40009"}
        ref = ok(self, 1, MB3)
        four = self.ckpt("four")
        ok(self, 4, MB3 + ["--zero-stage", "3", "--ckpt-dir", four, "--ckpt-every", "3"])
        shutil.rmtree(os.path.join(four, "step-000000006"))
        for world in (2, 1):
            d = self.ckpt(f"w{world}")
            shutil.copytree(four, d)
            ranks, codes = launch(self, world, MB3 + ["--zero-stage", "3", "--ckpt-dir", d,
                                                      "--ckpt-every", "3", "--resume", "auto"],
                                  extra_env=staged)
            err = ranks.stderr(0)
            self.assertEqual(codes, [0] * world, err[-2000:])
            self.assertRegex(err, r"resumed from \S+step-000000003 at step 3")
            self.assertRegex(err, r"restore into cpu\S*: [0-9.]+ MiB through pinned bounce "
                                  r"buffers and the copy stream \(slices of 40009 bytes\)")
            # 40009 bytes is less than a chunk of this model's shards: said once, by rank 0
            self.assertEqual(err.count("restore slices of 40009 bytes (CKPT_RESTORE_SLICE_BYTES) "
                                       "are smaller than the snapshot's chunks"), 1, err[-2000:])
            self.assertEqual(ranks.final()["digest"], ref["digest"], f"staged resume at W={world}")
        # a read error in the middle of a staged restore (the 3rd read of snapshot data) says
        # nothing about the bytes: the resume stops, nothing is set aside
        d = self.ckpt("direct")
        shutil.copytree(four, d)
        ranks, codes = launch(self, 1, MB3 + ["--zero-stage", "3", "--ckpt-dir", d, "--ckpt-every",
                                              "3", "--resume", "auto"],
                              extra_env=dict(staged, CKPT_FAULT_STORE="eio-read:3"))
        self.assertEqual(codes, [1], ranks.stderr(0)[-2000:])
        self.assertRegex(ranks.stderr(0), r"cannot read \S+step-000000003: .*Input/output error")
        self.assertEqual(snapshot_dirs(d), ["step-000000003"])
        self.assertEqual([x for x in os.listdir(d) if "corrupt" in x], [])
        # the default on the CPU device decodes in place, in 64 MiB windows whatever the
        # slice: neither line
        ranks, codes = launch(self, 2, MB3 + ["--zero-stage", "3", "--ckpt-dir", d, "--ckpt-every",
                                              "3", "--resume", "auto"],
                              extra_env={"CKPT_RESTORE_SLICE_BYTES": "40009"})
        self.assertEqual(codes, [0, 0], ranks.stderr(0)[-2000:])
        self.assertNotIn("bounce buffers", ranks.stderr(0))
        self.assertNotIn("restore slices of", ranks.stderr(0))
        self.assertEqual(ranks.final()["digest"], ref["digest"])
        # a flipped byte in the newest snapshot: found by the staged reads, the snapshot set
        # aside, the older one restored
        d = self.ckpt("flip")
        ok(self, 2, MB3 + ["--zero-stage", "3", "--ckpt-dir", d, "--ckpt-every", "3"])
        shard = os.path.join(d, "step-000000006", "rank-00001.bin")
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
        ranks, codes = launch(self, 2, MB3 + ["--zero-stage", "3", "--ckpt-dir", d, "--ckpt-every",
                                              "3", "--resume", "auto"], extra_env=staged)
        err = ranks.stderr(0)
        self.assertEqual(codes, [0, 0], err[-2000:])
        self.assertRegex(err, r"skipping corrupt snapshot \S+step-000000006")
        self.assertRegex(err, r"resumed from \S+step-000000003 at step 3")
        self.assertEqual(ranks.final()["digest"], ref["digest"])
        # bad values are refused before anything starts
        for var, val, line in (("CKPT_RESTORE_STAGED", "yes", "is not 0 or 1"),
                               ("CKPT_RESTORE_SLICE_BYTES", "4095", "is not a number of bytes"),
                               ("CKPT_RESTORE_SLICE_BYTES", "64M", "is not a number of bytes"),
                               ("CKPT_RESTORE_SLICE_BYTES", "-8192", "is not a number of bytes"),
                               ("CKPT_RESTORE_SLICE_BYTES", " 8192", "is not a number of bytes"),
                               ("CKPT_RESTORE_SLICE_BYTES", "+8192", "is not a number of bytes")):
            p = run([harness.TRAIN] + harness.data_args() + ["--steps", "1"], extra_env={var: val})
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(f"{var}='{val}' {line}", p.stderr)
        # on one rank only: the start-up agreement stops both at once (not after the join
        # timeout)
        t0 = time.time()
        ranks, codes = launch(self, 2, MB3 + ["--steps", "1"],
                              rank_env={1: {"CKPT_RESTORE_STAGED": "yes"}})
        self.assertEqual(codes, [2, 2], ranks.stderr(0)[-2000:])
        self.assertLess(time.time() - t0, 60)
        self.assertIn("CKPT_RESTORE_STAGED='yes' is not 0 or 1", ranks.stderr(1))

    def test_record_digests_on_the_digest_thread(self):
        """The trainer record's digests of a staged snapshot are hashed on the digest thread
        while the next step computes (train/train_digest.c), except on the CPU device at ZeRO-3
        with W > 1, where the next forward pass's all-gathers write into the hashed memory;
        either way the records are right: resuming from each snapshot checks its digests and
        ends with the uninterrupted run's bits."""
        ref = ok(self, 1, MB3)
        for stage, where in (("2", "digest thread"), ("3", "training thread")):
            d = self.ckpt(f"z{stage}")
            ranks, codes = launch(self, 2, MB3 + ["--zero-stage", stage, "--ckpt-dir", d,
                                                  "--ckpt-every", "3"],
                                  extra_env={"CKPT_LOG_LEVEL": "debug"})
            err = ranks.stderr(0)
            self.assertEqual(codes, [0, 0], err[-2000:])
            hashed = re.findall(r"snapshot step (\d+): digests hashed on the (digest|training) "
                                r"thread \([0-9.]+ ms of hashing\)", err)
            self.assertEqual(hashed, [("3", where.split()[0]), ("6", where.split()[0])], err[-3000:])
            self.assertEqual(ranks.final()["digest"], ref["digest"])
            shutil.rmtree(os.path.join(d, "step-000000006"))
            ranks, codes = launch(self, 2, MB3 + ["--zero-stage", stage, "--ckpt-dir", d,
                                                  "--ckpt-every", "3", "--resume", "auto"])
            err = ranks.stderr(0)
            self.assertEqual(codes, [0, 0], err[-2000:])
            # a wrong record digest would set the snapshot aside and start fresh
            self.assertRegex(err, r"resumed from \S+step-000000003 at step 3")
            self.assertNotIn("differs from the recorded", err)
            self.assertEqual(ranks.final()["digest"], ref["digest"], f"resumed at ZeRO-{stage}")

    def test_moments_at_the_wrong_place_are_caught(self):
        """Two equal-sized shards of adam_m swapped in a resealed manifest pass every chunk
        checksum; the moments digest in the trainer record catches it, the snapshot is set
        aside and the previous one used."""
        ref = ok(self, 1, MB3)
        d = self.ckpt()
        ok(self, 4, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3"])
        self.assertEqual(snapshot_dirs(d), ["step-000000003", "step-000000006"])
        man = os.path.join(d, "step-000000006", "manifest.json")
        with open(man) as f:
            m = json.load(f)
        buf = next(b for b in m["buffers"] if b["name"] == "adam_m")
        a, b = buf["shards"][1], buf["shards"][2]
        self.assertEqual(a["bytes"], b["bytes"])
        for x, delta in ((a, b["offset"] - a["offset"]), (b, a["offset"] - b["offset"])):
            x["offset"] += delta
            for c in x["chunks"]:
                c["offset"] += delta
        harness.write_manifest(man, m)
        p = run([harness.INSPECT, "verify", os.path.join(d, "step-000000006")])
        self.assertEqual(p.returncode, 0, "the chunks themselves are intact")
        ranks, codes = launch(self, 2, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3", "--resume",
                                              "auto"])
        self.assertEqual(codes, [0, 0], ranks.stderr(0)[-2000:])
        err = ranks.stderr(0)
        self.assertIn("adam_m digest", err)
        self.assertIn("resumed from", err)
        self.assertRegex(err, r"resumed from \S+step-000000003 at step 3")
        self.assertEqual(ranks.final()["digest"], ref["digest"])

    def test_c12_sampler_continuity_across_world_change(self):
        """C12: no sample repeated or skipped when W changes on a resume; same order as W=1."""
        ref_log = os.path.join(self.tmp, "ref.samples")
        ok(self, 1, MB3 + ["--sample-log", ref_log])
        d, log1, log2 = self.ckpt(), os.path.join(self.tmp, "a.samples"), os.path.join(self.tmp, "b.samples")
        ok(self, 4, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3", "--sample-log", log1])
        shutil.rmtree(os.path.join(d, "step-000000006"))
        ok(self, 2, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3", "--resume", "auto",
                           "--sample-log", log2])

        def load(path):
            with open(path) as f:
                return [tuple(map(int, line.split())) for line in f]
        ref = dict(load(ref_log))
        self.assertEqual(sorted(ref), list(range(6 * 24)))
        first = [x for x in load(log1) if x[0] < 3 * 24]  # the steps the snapshot kept
        second = load(log2)
        kths = sorted(k for k, _ in first + second)
        self.assertEqual(kths, list(range(6 * 24)), "a sample repeated or skipped")
        for k, idx in first + second:
            self.assertEqual(idx, ref[k], f"sample {k}")
        self.assertEqual(min(k for k, _ in second), 3 * 24)

    def test_c13_sampler_exactly_once_across_kills_and_epochs(self):
        """C13 at W = 2: a small corpus (about 11 steps an epoch) trained for 40 steps, killed
        at three random steps and resumed each time: along the committed timeline every sample
        of every epoch is consumed exactly once, in the uninterrupted run's order."""
        import random
        text = os.path.join(self.tmp, "small.txt")
        with open(os.path.join(os.path.dirname(__file__), "../../README.md")) as f:
            body = f.read()[:6000]
        with open(text, "w") as f:
            f.write(body)
        data = os.path.join(self.tmp, "small")
        run([harness.PREPARE, "--out", data, "--val-fraction", "0", text], check=True)
        base = ["--data", os.path.join(data, "train_*.bin"), "--n-layer", "2", "--n-embd", "64",
                "--n-head", "4", "--seq-len", "64", "--micro-batch", "2", "--global-batch", "8",
                "--steps", "40", "--seed", "5", "--log-every", "1"]
        ref_log = os.path.join(self.tmp, "ref.samples")
        p = run([harness.TRAIN] + base + ["--sample-log", ref_log], check=True)
        n_samples = int(re.search(r"\((\d+) samples\)", p.stderr).group(1))
        self.assertLess(n_samples * 3, 40 * 8, "the run must cross several epochs")
        with open(ref_log) as f:
            ref = dict(tuple(map(int, line.split())) for line in f)
        d = self.ckpt()
        args = ["--ckpt-dir", d, "--ckpt-every", "3", "--resume", "auto"]
        rnd = random.Random()
        runs = []  # (sample-log lines, step the next run resumed from)
        for k in range(4):
            log = os.path.join(self.tmp, f"run{k}.samples")
            ranks = Ranks(2, args + ["--sample-log", log], self.tmp, base=base)
            if k < 3:
                target = rnd.randint(2, 30)
                self.assertTrue(ranks.wait_for_step(target), ranks.stderr(0)[-2000:])
                ranks.kill()
                self.assertEqual(ranks.procs[0].returncode, -signal.SIGKILL,
                                 "the run ended before the kill")
            else:
                codes = ranks.wait(300)
                self.assertEqual(codes, [0, 0], ranks.stderr(0)[-2000:])
            err = ranks.stderr(0)
            m = re.search(r"resumed from \S+ at step (\d+)", err)
            start = int(m.group(1)) if m else 0
            if runs:
                runs[-1][1] = start
            lines = []
            if os.path.exists(log):
                with open(log) as f:
                    lines = [tuple(map(int, line.split())) for line in f]
            runs.append([lines, None])
        self.assertEqual(len(runs), 4)
        timeline = []
        for lines, next_start in runs:
            cut = next_start * 8 if next_start is not None else None
            timeline += [x for x in lines if cut is None or x[0] < cut]
        kths = sorted(k for k, _ in timeline)
        self.assertEqual(kths, list(range(40 * 8)), "a sample repeated or skipped")
        for k, idx in timeline:
            self.assertEqual(idx, ref[k], f"sample number {k}")
        # every epoch is a permutation of the corpus
        for e in range(40 * 8 // n_samples):
            epoch = sorted(ref[k] for k in range(e * n_samples, (e + 1) * n_samples))
            self.assertEqual(epoch, list(range(n_samples)))

    def test_c16_dead_rank_fails_every_survivor_fast(self):
        """C16: SIGKILL rank 2 of 4 mid-run: every survivor exits non-zero within 5 s."""
        ranks = Ranks(4, MB3 + ["--steps", "100000", "--comm-timeout", "60"], self.tmp, base=DIST)
        try:
            self.assertTrue(ranks.wait_for_step(3), ranks.stderr(0)[-2000:])
            t0 = time.time()
            ranks.procs[2].send_signal(signal.SIGKILL)
            for r in (0, 1, 3):
                ranks.procs[r].wait(timeout=30)
                self.assertLess(time.time() - t0, 5.0, f"rank {r} took too long")
                self.assertNotEqual(ranks.procs[r].returncode, 0)
        finally:
            ranks.kill()
        died = [r for r in (0, 1, 3) if "died" in ranks.stderr(r) or "is gone" in ranks.stderr(r)]
        self.assertTrue(died, ranks.stderr(0)[-2000:])

    def test_c17_stopped_rank_times_out(self):
        """C17 at the trainer: a SIGSTOPped rank turns into an error at --comm-timeout."""
        ranks = Ranks(2, MB3 + ["--steps", "100000", "--comm-timeout", "2"], self.tmp, base=DIST)
        try:
            self.assertTrue(ranks.wait_for_step(2))
            t0 = time.time()
            ranks.procs[1].send_signal(signal.SIGSTOP)
            ranks.procs[0].wait(timeout=30)
            self.assertLess(time.time() - t0, 2.0 + 5.0)
            self.assertEqual(ranks.procs[0].returncode, 1)
            self.assertIn("stopped answering", ranks.stderr(0))
        finally:
            ranks.procs[1].send_signal(signal.SIGKILL)
            ranks.kill()

    def test_rank_failing_before_its_vote_means_no_commit(self):
        """Two-phase commit: rank 1 dies with its shard durable but before voting, at the last
        step: nothing is committed for that step, rank 0 fails fast, and the next start
        resumes from the previous snapshot to the uninterrupted result."""
        ref = ok(self, 1, MB3)
        d = self.ckpt()
        t0 = time.time()
        ranks, codes = launch(self, 2, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3"],
                              rank_env={1: {"CKPT_FAULT_POINT": "after-part@6"}})
        self.assertLess(time.time() - t0, 60)
        self.assertEqual(codes[1], -signal.SIGKILL)
        self.assertNotEqual(codes[0], 0)
        self.assertEqual(snapshot_dirs(d), ["step-000000003"])
        got = ok(self, 2, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3", "--resume", "auto"])
        self.assertEqual(got["digest"], ref["digest"])
        self.assertEqual(temp_dirs(d), [])
        self.assertEqual(snapshot_dirs(d), ["step-000000003", "step-000000006"])

    def test_c18_slow_snapshot_writes_do_not_time_out_training(self):
        """C18: rank 0's snapshot writes take longer than the collective timeout; persisting is
        off the training path, so no timeout fires and the result is unchanged."""
        ref = ok(self, 1, MB3)
        d = self.ckpt()
        t0 = time.time()
        ranks, codes = launch(self, 2, MB3 + ["--ckpt-dir", d, "--ckpt-every", "2",
                                              "--comm-timeout", "1", "--no-direct-io"],
                              rank_env={0: {"CKPT_FAULT_STORE": "slow:2500"}})
        self.assertEqual(codes, [0, 0], ranks.stderr(0)[-2000:] + ranks.stderr(1)[-2000:])
        self.assertGreater(time.time() - t0, 2.5)
        self.assertEqual(ranks.final()["digest"], ref["digest"])
        persists = [int(x) for x in __import__("re").findall(r"persist (\d+) ms", ranks.stderr(0))]
        self.assertTrue(persists and max(persists) > 2000, persists)
        self.assertEqual(snapshot_dirs(d), ["step-000000002", "step-000000004", "step-000000006"])

    def test_rank_failing_mid_shard_means_no_commit(self):
        d = self.ckpt()
        ranks, codes = launch(self, 4, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3"],
                              rank_env={3: {"CKPT_FAULT_POINT": "mid-data@3"}})
        self.assertEqual(codes[3], -signal.SIGKILL)
        self.assertTrue(all(c not in (0, None) for c in codes[:3]), codes)
        self.assertEqual(snapshot_dirs(d), [])

    def test_sigterm_to_one_rank_stops_all_at_the_same_step(self):
        d = self.ckpt()
        ranks = Ranks(2, MB3 + ["--steps", "100000", "--ckpt-dir", d, "--ckpt-every", "1000"],
                      self.tmp, base=DIST)
        try:
            self.assertTrue(ranks.wait_for_step(3))
            ranks.procs[1].send_signal(signal.SIGTERM)
            codes = ranks.wait(120)
        finally:
            ranks.kill()
        self.assertEqual(codes, [128 + signal.SIGTERM] * 2, ranks.stderr(0)[-2000:])
        fin = ranks.final()
        self.assertEqual(snapshot_dirs(d), [f"step-{fin['step']:09d}"])
        p = run([harness.INSPECT, "verify", os.path.join(d, snapshot_dirs(d)[0])])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)

    def test_deepspeed_config(self):
        """--config FILE (DeepSpeed JSON) sets batch, ZeRO stage, optimizer, schedule, clipping
        and snapshots; flags override it; unknown keys are named in one warning."""
        ref = ok(self, 1, MB3)
        cfg = {
            "train_batch_size": 24, "train_micro_batch_size_per_gpu": 3,
            "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "seed": 7,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                                                      "eps": 1e-8, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupCosineLR",
                          "params": {"warmup_num_steps": 2, "total_num_steps": 6,
                                     "cos_min_ratio": 0.1}},
            "checkpoint": {"dir": self.ckpt(), "every": 3, "keep_last": 1},
            "wall_clock_breakdown": False,
        }
        path = os.path.join(self.tmp, "ds.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        model = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
                 "--val-samples", "12"]
        ranks, codes = launch(self, 2, ["--config", path], base=model)
        self.assertEqual(codes, [0, 0], ranks.stderr(0)[-2000:])
        self.assertEqual(ranks.final()["digest"], ref["digest"])
        err = ranks.stderr(0)
        self.assertIn("ZeRO stage 3", err)
        self.assertIn("zero_optimization.offload_optimizer", err)
        self.assertIn("wall_clock_breakdown", err)
        self.assertEqual(snapshot_dirs(self.ckpt()), ["step-000000006"])  # keep_last 1
        # a flag overrides the file; the file's batch rule is checked against W
        ranks, codes = launch(self, 1, ["--config", path, "--zero-stage", "1", "--steps", "2",
                                        "--ckpt-every", "0"], base=model)
        self.assertEqual(codes, [2], ranks.stderr(0)[-2000:])
        self.assertIn("gradient_accumulation_steps 4 x world size 1", ranks.stderr(0))
        bad = os.path.join(self.tmp, "bad.json")
        with open(bad, "w") as f:
            f.write('{"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}')
        p = run([harness.TRAIN] + harness.data_args() + ["--config", bad])
        self.assertEqual(p.returncode, 2)
        self.assertIn("optimizer.params.lr", p.stderr)

    def test_ranks_must_share_settings(self):
        """A rank started with another learning rate, seed, data, snapshot folder, dtype,
        reduction or memory snapshot mode would train something else and save shards that do not fit: every rank exits
        2 at start, the line names the setting, nothing is saved."""
        d = self.ckpt()
        for extra, key in [(["--lr", "0.01"], "lr (rank 0: 0.003, rank 2: 0.01)"),
                           (["--seed", "99"], "seed (rank 0: 7, rank 2: 99)"),
                           (["--data", os.path.join(harness.DATA, "val_*.bin")], "data"),
                           (["--ckpt-dir", self.ckpt("other")], "ckpt-dir"),
                           (["--dtype", "bf16"], "dtype (rank 0: fp32, rank 2: bf16)"),
                           (["--reduce", "ring"], "reduce (rank 0: tree, rank 2: ring)"),
                           (["--mem-snapshot-mode", "async"], "mem-mode (rank 0: default, rank 2: async)")]:
            t0 = time.time()
            ranks = Ranks(4, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3"], self.tmp, base=DIST,
                          rank_args={2: extra})
            codes = ranks.wait(60)
            self.assertEqual(codes, [2] * 4, f"{extra}: {codes}")
            self.assertLess(time.time() - t0, 30)
            self.assertIn(f"rank 2 was started with other settings than rank 0: {key}",
                          ranks.stderr(0))
            self.assertEqual(snapshot_dirs(d), [])

    def test_a_rank_that_cannot_start_stops_all(self):
        t0 = time.time()
        ranks = Ranks(4, MB3, self.tmp, base=DIST,
                      rank_args={3: ["--data", "/nonexistent/train_*.bin"]})
        self.assertEqual(ranks.wait(60), [2] * 4)
        self.assertLess(time.time() - t0, 20)
        self.assertIn("rank(s) 3 could not start", ranks.stderr(0))
        self.assertIn("no file matches", ranks.stderr(3))
        # rank 0 refuses (a global batch that does not split over 3 ranks): all exit 2 at once
        t0 = time.time()
        ranks, codes = launch(self, 3, MB3)
        self.assertEqual(codes, [2] * 3)
        self.assertLess(time.time() - t0, 20)

    def test_duplicated_rank_is_refused(self):
        """A second process claiming rank 1 (a duplicated RANK, or another job on the same
        MASTER_PORT) is refused at once instead of taking the first one's place; a second
        rank 0 cannot host the store on a port in use."""
        import subprocess
        port = harness.free_port()
        env = {"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        args = [harness.TRAIN] + harness.data_args() + DIST + MB3 + ["--join-timeout", "20"]
        procs, logs = [], []
        try:
            for rank in ("0", "1"):
                logs.append(os.path.join(self.tmp, f"first-rank{rank}.err"))
                with open(logs[-1], "w") as err:
                    procs.append(subprocess.Popen(
                        args, stdout=subprocess.DEVNULL, stderr=err,
                        env=harness.env(dict(env, RANK=rank, CKPT_LOG_LEVEL="debug"))))
            # both have joined (rank 0 hosts the store) before the duplicates start: a fixed
            # sleep was too short on a loaded machine, and the "duplicate" then joined first
            def joined(r):
                with open(logs[r]) as f:
                    return f"rank {r} published its address" in f.read()
            deadline = time.time() + 60
            while time.time() < deadline and not (joined(0) and joined(1)):
                time.sleep(0.05)
            self.assertTrue(joined(0) and joined(1), "ranks 0 and 1 did not join in 60 s")
            for rank in ("1", "0"):
                p = subprocess.run(args, capture_output=True, text=True, timeout=30,
                                   env=harness.env(dict(env, RANK=rank)))
                self.assertEqual(p.returncode, 1)
                self.assertIn("rank 1 has already joined this group" if rank == "1" else
                              "cannot host the rendezvous store", p.stderr)
        finally:
            for p in procs:
                p.kill()
                p.wait()

    def test_master_addr_not_of_this_host_is_a_configuration_error(self):
        """Rank 0 with a MASTER_ADDR that is not an address of this host (192.0.2.1, TEST-NET-1)
        cannot host the store: one line naming the address, exit 2 (a configuration error no
        restart mends), where a port in use is exit 1 (test_duplicated_rank_is_refused)."""
        import subprocess
        env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "192.0.2.1",
               "MASTER_PORT": str(harness.free_port())}
        p = subprocess.run([harness.TRAIN] + harness.data_args() + DIST + MB3, capture_output=True,
                           text=True, timeout=60, env=harness.env(env))
        self.assertEqual(p.returncode, 2, p.stderr[-1500:])
        self.assertRegex(p.stderr, r"rank 0 cannot host the rendezvous store at 192\.0\.2\.1:\d+ "
                         r"\(MASTER_ADDR:MASTER_PORT\): Cannot assign requested address")

    def test_stray_clients_do_not_flood_the_log(self):
        """Garbage connections to the store port while the ranks join: the job still trains,
        and at most 10 refusals a 10 s window are logged one by one."""
        import socket
        ranks = Ranks(2, MB3 + ["--steps", "4"], self.tmp, base=DIST)
        try:
            deadline = time.time() + 10
            sent = 0
            while sent < 60 and time.time() < deadline:
                try:
                    with socket.create_connection(("127.0.0.1", ranks.port), timeout=1) as c:
                        c.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
                        sent += 1
                except OSError:
                    time.sleep(0.01)
            codes = ranks.wait(120)
        finally:
            ranks.kill()
        self.assertEqual(codes, [0, 0], ranks.stderr(0)[-2000:])
        self.assertGreaterEqual(sent, 30)
        lines = [x for x in ranks.stderr(0).splitlines() if "store: closing connection" in x or
                 "store: refused client" in x]
        self.assertLessEqual(len(lines), 10, "\n".join(lines[:20]))
        self.assertGreaterEqual(len(lines), 1)

    def test_batch_rules(self):
        # an explicit global batch that differs from the snapshot's is refused
        d = self.ckpt()
        ok(self, 2, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3", "--steps", "3"])
        ranks, codes = launch(self, 2, ["--micro-batch", "3", "--ckpt-dir", d, "--ckpt-every", "3",
                                        "--resume", "auto", "--global-batch", "12"])
        self.assertEqual(codes, [2, 2])
        self.assertIn("global batch differs", ranks.stderr(0))
        # without a batch flag the snapshot's global batch is kept (24 = 1 rank x 8 x 3)
        args = [a for a in DIST if a not in ("--global-batch", "24")]
        ranks, codes = launch(self, 1, MB3 + ["--ckpt-dir", d, "--ckpt-every", "3", "--resume",
                                              "auto"], base=args)
        self.assertEqual(codes, [0], ranks.stderr(0)[-2000:])
        self.assertIn("global batch 24 = 1 ranks x 8 micro-batches", ranks.stderr(0))
        # --global-batch and --grad-accum together are a usage error
        p = run([harness.TRAIN] + harness.data_args() + ["--global-batch", "8", "--grad-accum", "2"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("not both", p.stderr)


if __name__ == "__main__":
    harness.main()
