"""Command-line contract: --help, exit status 0 / 1 / 2, one clear line for bad input (I5),
JSON output of ckpt-inspect, and refusal to resume a different model configuration."""
import json
import os
import pty
import re
import shutil
import struct
import subprocess

import harness as h


class Cli(h.TempDirTest):
    def test_help(self):
        for prog in (h.TRAIN, h.INSPECT, h.PREPARE):
            p = h.run([prog, "--help"])
            self.assertEqual(p.returncode, 0, prog)
            self.assertIn("usage:", p.stdout)

    def test_usage_errors_exit_2(self):
        cases = [
            ([h.TRAIN], "--data GLOB is required"),
            ([h.TRAIN, "--data", "x", "--bogus"], "see --help"),
            ([h.TRAIN, "--data", "x", "--steps", "ten"], "--steps: 'ten' is not an integer"),
            ([h.TRAIN, "--data", "x", "--n-embd", "30", "--n-head", "4"], "n_embd must be a multiple of n_head"),
            ([h.TRAIN, "--data", "x", "--ckpt-every", "5"], "--ckpt-every needs --ckpt-dir"),
            ([h.TRAIN, "--data", os.path.join(self.tmp, "none_*.bin")], "no file matches"),
            ([h.INSPECT], "missing command"),
            ([h.INSPECT, "frobnicate", "x"], "unknown command"),
            ([h.PREPARE, "--out", self.tmp], "no input files"),
            ([h.PREPARE, "--out", self.tmp, "--val-fraction", "0.9", "x"], "not a number in [0, 0.5]"),
            ([h.PREPARE, "--out", "/etc/passwd", "x"], "--out /etc/passwd: not a folder"),
            ([h.PREPARE, "--out", "", "x"], "--out DIR is required"),
            ([h.TRAIN, "--data", "x", "--config", "/dev/zero"], "/dev/zero: cannot read: not a regular file or a pipe"),
            # a folder too long for the names beneath it: a usage error at start, not an
            # engine failure (exit 1, retried) with its reason cut off
            ([h.TRAIN] + h.data_args() + h.SMALL + ["--ckpt-dir", os.path.join(self.tmp, *["d" * 200] * 20), "--ckpt-every", "1"],
             "more than the 3584 a snapshot folder may have"),
        ]
        for args, msg in cases:
            p = h.run(args)
            self.assertEqual(p.returncode, 2, f"{args}: {p.stderr}")
            self.assertIn(msg, p.stderr, args)

    def test_bad_shards_are_named(self):
        bad = os.path.join(self.tmp, "bad_000000.bin")
        with open(bad, "wb") as f:
            f.write(struct.pack("<3i", 12345, 1, 10) + bytes(1012) + bytes(20))
        # bad inputs found before the first step exit 2: a restart would read the same files
        p = h.run([h.TRAIN, "--data", bad])
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"{bad}: bad magic 12345", p.stderr)
        short = os.path.join(self.tmp, "short_000000.bin")
        with open(short, "wb") as f:
            f.write(struct.pack("<3i", 20240520, 1, 1000) + bytes(1012) + bytes(10))
        p = h.run([h.TRAIN, "--data", short])
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"{short}: header says 1000 tokens", p.stderr)
        empty = os.path.join(self.tmp, "empty.txt")
        open(empty, "w").close()
        p = h.run([h.PREPARE, "--out", os.path.join(self.tmp, "out"), empty])
        self.assertEqual(p.returncode, 2)
        self.assertIn("no training text", p.stderr)

    def test_resume_with_other_model_is_refused(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20", "--steps", "20"])
        p = h.train(["--ckpt-dir", ckpt, "--resume", "auto", "--n-layer", "3", "--n-embd", "32"], check=False)
        self.assertEqual(p.returncode, 2, p.stderr[-1000:])
        self.assertRegex(p.stderr, r"refusing to resume from \S+step-000000020: model configuration differs: "
                                   r"n_layer \(snapshot 2, now 3\), n_embd \(snapshot 64, now 32\)")
        # nothing was deleted or written
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020"])

    def test_c15_changed_dataset_file_is_refused(self):
        """C15: the record holds a hash of every training token (data_hash) beside the sample
        order's seed; one token changed in the data file (same size, same sample count): the
        resume is refused before the first step, exit 2, naming the snapshot and both hashes;
        there is no flag that continues anyway (--allow-fresh-start is for corrupt snapshots:
        an incompatible one is never skipped). Nothing is set aside, nothing written; the
        unchanged file resumes."""
        data = os.path.join(self.tmp, "data")
        os.mkdir(data)
        shard = os.path.join(data, "train_000000.bin")
        shutil.copy(os.path.join(h.DATA, "train_000000.bin"), shard)
        argv = [h.TRAIN, "--data", shard] + h.SMALL
        ckpt = os.path.join(self.tmp, "ckpt")
        h.run(argv + ["--ckpt-dir", ckpt, "--ckpt-every", "10", "--steps", "10"], check=True)
        with open(shard, "r+b") as f:
            f.seek(4096)
            b = f.read(2)
            f.seek(4096)
            f.write(bytes([b[0] ^ 1, b[1]]))
        for extra in ([], ["--allow-fresh-start"]):
            p = h.run(argv + ["--ckpt-dir", ckpt, "--ckpt-every", "10", "--steps", "20",
                              "--resume", "auto"] + extra)
            self.assertEqual(p.returncode, 2, p.stderr[-1000:])
            self.assertRegex(p.stderr, r"refusing to resume from \S+step-000000010: training data "
                                       r"differs from the snapshot's \(data hash [0-9a-f]{16}, now "
                                       r"[0-9a-f]{16}\)")
            self.assertNotIn("step 11/", p.stderr)
            self.assertEqual([x for x in os.listdir(ckpt) if not x.startswith(".lock")],
                             ["step-000000010"])
        with open(shard, "r+b") as f:
            f.seek(4096)
            f.write(b)
        p = h.run(argv + ["--ckpt-dir", ckpt, "--ckpt-every", "10", "--steps", "20", "--resume", "auto"],
                  check=True)
        self.assertRegex(p.stderr, r"resumed from \S+step-000000010 at step 10 ")

    def test_inspect_json_and_show(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        h.train(["--ckpt-dir", ckpt, "--ckpt-every", "30"])
        lst = json.loads(h.run([h.INSPECT, "list", ckpt, "--json"], check=True).stdout)
        self.assertEqual([s["step"] for s in lst["snapshots"]], [30, 60])
        for s in lst["snapshots"]:
            self.assertEqual(s["status"], "committed")
            self.assertGreater(s["raw_bytes"], s["stored_bytes"] * 0.5)
        snap = os.path.join(ckpt, "step-000000060")
        show = json.loads(h.run([h.INSPECT, "--json", "show", snap], check=True).stdout)
        self.assertEqual(show["step"], 60)
        self.assertEqual({b["name"] for b in show["buffers"]}, {"params", "adam_m", "adam_v"})
        tr = show["trainer"]
        self.assertEqual(tr["optimizer"]["t"], 60)
        self.assertEqual(tr["data"]["samples_consumed"], 60 * 8)
        self.assertEqual(tr["model"]["n_layer"], 2)
        names = [t["name"] for t in tr["tensors"]]
        self.assertEqual(names[:3], ["wte.weight", "wpe.weight", "h.0.ln_1.weight"])
        self.assertEqual(tr["params_digest"], h.reference()["digest"])
        text = h.run([h.INSPECT, "show", snap], check=True).stdout
        self.assertIn("h.1.mlp.c_proj.weight", text)
        v = json.loads(h.run([h.INSPECT, "verify", snap, "--json"], check=True).stdout)
        self.assertTrue(v["ok"])
        p = h.run([h.INSPECT, "show", os.path.join(ckpt, "step-000000099")])
        self.assertEqual(p.returncode, 1)
        self.assertIn("no such snapshot folder", p.stderr)

    def test_inspect_plan(self):
        """ckpt-inspect plan: each rank of a new world size needs exactly its range of the
        trainer's even partition and decodes only the chunks overlapping it (case C11)."""
        ckpt = os.path.join(self.tmp, "ckpt")
        mib = 1 << 20
        # buffers of 6.3 MiB in 1 MiB chunks, so that a rank's range is a few chunks
        h.train(["--ckpt-dir", ckpt, "--ckpt-every", "2", "--steps", "2", "--n-embd", "256",
                 "--chunk-mib", "1"])
        snap = os.path.join(ckpt, "step-000000002")
        show = json.loads(h.run([h.INSPECT, "show", snap, "--json"], check=True).stdout)
        total = sum(b["raw_bytes"] for b in show["buffers"])
        nbuf = len(show["buffers"])
        blocks = show["trainer"]["num_params"] // 2048  # units of the partition: 8192 bytes
        for world in (1, 3, 4):
            plan = json.loads(h.run([h.INSPECT, "plan", snap, "--world-size", str(world), "--json"],
                                    check=True).stdout)
            self.assertEqual((plan["world_size"], plan["saved_world_size"]), (world, 1))
            self.assertEqual(plan["need_bytes"], total)
            self.assertEqual(len(plan["ranks"]), world)
            for r, x in enumerate(plan["ranks"]):
                units = blocks // world + (1 if r < blocks % world else 0)
                self.assertEqual(x["need_bytes"], nbuf * units * 8192, (world, r))
                self.assertGreaterEqual(x["read_raw_bytes"], x["need_bytes"])
                self.assertLessEqual(x["read_raw_bytes"], x["need_bytes"] + nbuf * 2 * mib)
                self.assertLessEqual(x["read_stored_bytes"], x["read_raw_bytes"])
                self.assertEqual(x["files"], 1)
                if world > 1:
                    self.assertLess(x["read_raw_bytes"], total / 2, (world, r))
        text = h.run([h.INSPECT, "plan", snap, "--world-size=4"], check=True).stdout
        self.assertIn("restored by 4", text)
        self.assertRegex(text, r"\n  3 +\S+ MiB")
        self.assertRegex(text, r"\n  total +%.2f MiB" % (total / mib))
        for args, msg in ((["plan", snap], "plan needs --world-size N"),
                          (["plan", snap, "--world-size", "0"], "--world-size wants 1..65536")):
            p = h.run([h.INSPECT] + args)
            self.assertEqual(p.returncode, 2, args)
            self.assertIn(msg, p.stderr)
        p = h.run([h.INSPECT, "plan", os.path.join(ckpt, "step-000000099"), "--world-size", "2"])
        self.assertEqual(p.returncode, 1)
        self.assertIn("no such snapshot folder", p.stderr)

    def test_progress_of_long_work(self):
        """Work that takes more than 2 s shows its progress (issue 12): on a terminal one line
        redrawn in place (percent, bytes, rate, time left) and erased at the end; otherwise a
        plain line every 10 s; nothing with --quiet; train's restore as log lines. The reads are
        slowed down (CKPT_FAULT_STORE=slow-read) to make the work long."""
        ckpt = os.path.join(self.tmp, "ckpt")
        big = ["--n-layer", "4", "--n-embd", "128", "--chunk-mib", "1"]  # 10 MB in 1 MiB chunks
        h.train(["--ckpt-dir", ckpt, "--ckpt-every", "2", "--steps", "2"] + big)
        snap = os.path.join(ckpt, "step-000000002")
        slow = {"CKPT_FAULT_STORE": "slow-read:600"}
        master, slave = pty.openpty()
        p = subprocess.Popen([h.INSPECT, "verify", snap], stdout=subprocess.PIPE, stderr=slave,
                             env=h.env(slow))
        os.close(slave)
        out = p.communicate(timeout=120)[0]
        tty = b""
        try:
            while True:
                c = os.read(master, 4096)
                if not c:
                    break
                tty += c
        except OSError:
            pass
        os.close(master)
        self.assertEqual(p.returncode, 0, tty)
        self.assertIn(b"OK ", out)
        self.assertRegex(tty, rb"\r\x1b\[Kverify: \d+\.\d% \([0-9.]+ \w?i?B of 9\.6 MiB, "
                              rb"[0-9.]+ \w?i?B/s, \d+ s left\)")
        self.assertTrue(tty.endswith(b"\r\x1b[K"), tty[-40:])  # erased at the end
        p = h.run([h.INSPECT, "verify", snap], extra_env=slow)
        self.assertEqual(p.returncode, 0)
        self.assertRegex(p.stderr, r"(?m)^verify: \d+\.\d% \(.* of 9\.6 MiB, .*/s, \d+ s left\)$")
        self.assertNotIn("\x1b", p.stderr)
        p = h.run([h.INSPECT, "verify", "-q", snap], extra_env=slow)
        self.assertEqual((p.returncode, p.stderr), (0, ""))
        p = h.train(["--ckpt-dir", ckpt, "--ckpt-every", "2", "--steps", "3", "--resume", "auto"]
                    + big, extra_env=slow)
        self.assertRegex(p.stderr, r"INFO  \[progress\] restore: \d+\.\d% \(.* of 9\.6 MiB")
        quick = h.run([h.INSPECT, "verify", snap])
        self.assertEqual((quick.returncode, quick.stderr), (0, ""), "quick work shows nothing")


if __name__ == "__main__":
    h.main()
