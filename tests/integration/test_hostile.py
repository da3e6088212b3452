"""Hardening (issue 9), as a new user or a hostile folder meets the programs:

- transient errors never cost a snapshot: with too few file descriptors (the issue's
  `ulimit -n 6` reproducer) or an injected read EIO, `--resume auto` exits 1 naming the file
  and the error and renames nothing, and the next run resumes; `ckpt-inspect verify` exits 3
  ("could not read"), not 1 ("corrupt"), and `list` says "unreadable";
- hostile folders: a `.lock` link is never written through (exit 2); a FIFO as manifest or
  data file never hangs list/verify/export/resume; a folder, a FIFO or `..` as a data file is
  a corrupt snapshot (set aside, fall back), not an exit 1 on every resume;
- names that are not UTF-8 or hold escape sequences: `--json` output stays valid JSON, text
  output carries no control characters;
- numbers from a record are checked with overflow in mind (step 2^62);
- documented commands: a relative --ckpt-dir that does not exist yet at W = 2, --run-id next
  to a foreign run's later snapshots, DeepSpeed "auto" in optimizer/scheduler params, SIGTERM
  then SIGINT (the first decides: 143), a group that refuses a snapshot one rank loaded.
"""
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import time

import harness as h


def nofile(n):
    """preexec_fn: a soft limit of n open files in the child."""
    def set_limit():
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    return set_limit


def manifest_of(snap):
    return os.path.join(snap, b"manifest.json" if isinstance(snap, bytes) else "manifest.json")


def reseal(snap):
    h.run([h.RESEAL, manifest_of(snap)], check=True)


def edit_manifest(snap, old, new, count=1):
    """Replace text in a manifest and reseal its checksum (the checks behind it are tested)."""
    mp = manifest_of(snap)
    with open(mp, "rb") as f:
        text = f.read()
    assert old in text, (old, text[:300])
    with open(mp, "wb") as f:
        f.write(text.replace(old, new, count))
    reseal(snap)


class Hostile(h.TempDirTest):
    def setUp(self):
        super().setUp()
        self.ckpt = os.path.join(self.tmp, "ckpt")

    def make_snapshots(self, every="20", steps="60", extra=()):
        h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", every, "--steps", steps] + list(extra))
        return h.snapshot_dirs(self.ckpt)

    def aside(self):
        return [d for d in os.listdir(self.ckpt) if ".corrupt-" in d]

    # -------------------------------------------------------------- transient is not corrupt

    def test_too_few_file_descriptors_rename_nothing(self):
        """The issue's reproducer: with `ulimit -n 6` every good snapshot was set aside and the
        run started from step 0. Now each limit gives exit 1 naming what could not be read, or
        a normal resume; nothing is ever renamed, and a run with enough descriptors resumes
        from the newest snapshot."""
        names = self.make_snapshots(every="5", steps="20")
        self.assertEqual(len(names), 4)
        failed_on_snapshot = 0
        for limit in range(5, 14):
            r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "5", "--steps", "22",
                         "--resume", "auto"], check=False, preexec_fn=nofile(limit))
            self.assertEqual(self.aside(), [], f"ulimit -n {limit}: a snapshot was set aside\n"
                             + r.stderr[-2000:])
            self.assertEqual(h.snapshot_dirs(self.ckpt)[:4], names)
            self.assertNotRegex(r.stderr, r"fresh start", f"ulimit -n {limit}")
            if r.returncode == 0:
                self.assertRegex(r.stderr, r"resumed from \S+step-000000020 at step 20")
                break
            self.assertEqual(r.returncode, 1, f"ulimit -n {limit}: {r.stderr[-1500:]}")
            self.assertIn("Too many open files", r.stderr)
            if re.search(r"cannot read \S+step-0000000\d\d: .*Too many open files.*nothing was "
                         r"renamed", r.stderr):
                failed_on_snapshot += 1
        self.assertGreater(failed_on_snapshot, 0, "no limit reached the snapshot reader")
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "5", "--steps", "24",
                     "--resume", "auto"])
        self.assertRegex(r.stderr, r"resumed from \S+step-0000000(20|22) at step (20|22)")
        self.assertEqual(self.aside(), [])

    def test_read_error_stops_the_resume_and_renames_nothing(self):
        names = self.make_snapshots()
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--resume", "auto"],
                    extra_env={"CKPT_FAULT_STORE": "eio-read:1"}, check=False)
        self.assertEqual(r.returncode, 1, r.stderr[-2000:])
        self.assertRegex(r.stderr, r"cannot read \S+step-000000060: .*Input/output error")
        self.assertEqual(self.aside(), [])
        self.assertEqual(h.snapshot_dirs(self.ckpt), names)
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--resume", "auto"])
        self.assertRegex(r.stderr, r"resumed from \S+step-000000060 at step 60")

    def test_inspect_tells_unreadable_from_corrupt(self):
        self.make_snapshots()
        snap = os.path.join(self.ckpt, "step-000000060")
        v = h.run([h.INSPECT, "verify", snap, "--json"], preexec_fn=nofile(4))
        self.assertEqual(v.returncode, 3, v.stderr)
        self.assertIn("could not read; the snapshot may be fine", v.stderr)
        self.assertEqual(json.loads(v.stdout)["status"], "unreadable")
        v = h.run([h.INSPECT, "verify", snap], extra_env={"CKPT_FAULT_STORE": "eio-read:1"})
        self.assertEqual(v.returncode, 3, v.stderr)
        self.assertIn("Input/output error", v.stderr)
        lst = h.run([h.INSPECT, "list", self.ckpt, "--json"], preexec_fn=nofile(4))
        self.assertEqual(lst.returncode, 0, lst.stderr)
        st = {e["name"]: e for e in json.loads(lst.stdout)["snapshots"]}
        self.assertEqual(st["step-000000060"]["status"], "unreadable")
        self.assertIn("Too many open files", st["step-000000060"]["error"])
        with open(os.path.join(snap, "rank-00000.bin"), "r+b") as f:
            f.seek(200)
            b = f.read(1)
            f.seek(200)
            f.write(bytes([b[0] ^ 0x10]))
        v = h.run([h.INSPECT, "verify", snap, "--json"])
        self.assertEqual(v.returncode, 1)
        self.assertEqual(json.loads(v.stdout)["status"], "corrupt")
        self.assertEqual(h.run([h.INSPECT, "verify", os.path.join(self.ckpt, "step-000000040")])
                         .returncode, 0)

    # -------------------------------------------------------------- hostile folders

    def test_lock_link_is_not_followed(self):
        os.makedirs(self.ckpt)
        victim = os.path.join(self.tmp, "precious.txt")
        with open(victim, "w") as f:
            f.write("precious\n")
        os.symlink(victim, os.path.join(self.ckpt, ".lock"))
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--steps", "5"], check=False)
        self.assertEqual(r.returncode, 2, r.stderr[-1000:])
        self.assertRegex(r.stderr, r"its \.lock is a symbolic link, not a regular file")
        self.assertEqual(len([l for l in r.stderr.splitlines() if "ERROR" in l]), 1, r.stderr)
        with open(victim) as f:
            self.assertEqual(f.read(), "precious\n")

    def check_tools_finish_and_fall_back(self, bad, expect):
        """ckpt-inspect list/verify/export finish on `bad` (a snapshot of self.ckpt), and resume
        sets it aside and falls back to the next older snapshot."""
        for args in (["list", self.ckpt], ["verify", bad],
                     ["export", bad, os.path.join(self.tmp, "out.safetensors")],
                     ["show", bad, "--json"], ["plan", bad, "--world-size", "2"]):
            p = h.run([h.INSPECT] + args, timeout=30)  # a hang is a TimeoutExpired failure
            if args[0] == "list":
                self.assertEqual(p.returncode, 0)
                step = int(os.path.basename(bad)[5:])
                self.assertRegex(p.stdout, rf"(?m)^{step} .*corrupt: .*{expect}")
            else:
                self.assertEqual(p.returncode, 1, (args, p.stderr))
                self.assertRegex(p.stderr, expect)
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--resume", "auto"],
                    timeout=120)
        self.assertRegex(r.stderr, rf"set \S+{os.path.basename(bad)} aside")
        self.assertRegex(r.stderr, r"resumed from \S+step-000000040 at step 40")
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])

    def test_fifo_manifest_does_not_hang(self):
        self.make_snapshots()
        bad = os.path.join(self.ckpt, "step-000000060")
        os.unlink(os.path.join(bad, "manifest.json"))
        os.mkfifo(os.path.join(bad, "manifest.json"))
        self.check_tools_finish_and_fall_back(bad, r"not a regular file")

    def test_fifo_data_file_does_not_hang(self):
        self.make_snapshots()
        bad = os.path.join(self.ckpt, "step-000000060")
        os.unlink(os.path.join(bad, "rank-00000.bin"))
        os.mkfifo(os.path.join(bad, "rank-00000.bin"))
        self.check_tools_finish_and_fall_back(bad, r"rank-00000\.bin is not a regular file")

    def test_folder_as_data_file_falls_back(self):
        self.make_snapshots()
        bad = os.path.join(self.ckpt, "step-000000060")
        os.unlink(os.path.join(bad, "rank-00000.bin"))
        os.mkdir(os.path.join(bad, "rank-00000.bin"))
        self.check_tools_finish_and_fall_back(bad, r"rank-00000\.bin is not a regular file")

    def test_dotdot_as_data_file_falls_back(self):
        """`..` as a data file name made every resume exit 1 with EISDIR."""
        self.make_snapshots()
        bad = os.path.join(self.ckpt, "step-000000060")
        edit_manifest(bad, b'"name":"rank-00000.bin"', b'"name":".."')
        edit_manifest(bad, b'"file":"rank-00000.bin"', b'"file":".."', count=-1)
        self.check_tools_finish_and_fall_back(bad, r"file entry 0 is malformed")

    def test_non_utf8_and_escape_names(self):
        """--json with a path that is not UTF-8 crashed (json_pack returned NULL); show printed
        escape sequences from tensor names."""
        self.make_snapshots(every="60")
        src = os.path.join(self.ckpt, "step-000000060")
        # a snapshot folder under a non-UTF-8 path, and an odd set-aside name in the listing
        odd = os.path.join(os.fsencode(self.tmp), b"caf\xe9-\x1b[2J")
        shutil.copytree(os.fsencode(self.ckpt), odd)
        os.mkdir(os.path.join(odd, b"step-000000001.corrupt-\xff\x1b]0;pwned\x07"))
        snap = os.path.join(odd, b"step-000000060")
        # a tensor named with an escape sequence (valid JSON, valid UTF-8)
        edit_manifest(snap, b'"name":"wte.weight"', b'"name":"wte\\u001b[31m\\u009b2J"')
        out = os.path.join(odd, b"out.safetensors")
        for args in ([b"list", odd], [b"show", snap], [b"verify", snap], [b"plan", snap,
                     b"--world-size", b"3"], [b"export", snap, out]):
            for json_flag in ([b"--json"], []):
                p = subprocess.run([os.fsencode(h.INSPECT)] + args + json_flag,
                                   capture_output=True, env=h.env())
                self.assertEqual(p.returncode, 0, (args, p.stderr))
                for stream in (p.stdout, p.stderr):
                    self.assertNotIn(b"\x1b", stream, args)
                    self.assertNotIn(b"\xc2\x9b", stream, args)  # C1 CSI
                    self.assertNotIn(b"\x07", stream, args)
                    stream.decode("utf-8")  # valid UTF-8
                if json_flag:
                    doc = json.loads(p.stdout)
                    self.assertIsInstance(doc, dict)
                    # no JSON escape of a control character either: a consumer decodes
                    # \u001b back into ESC (names and trainer strings are \xNN text)
                    self.assertNotIn(b"\\u001b", p.stdout.lower(), args)
                    self.assertNotIn(b"\\u009b", p.stdout.lower(), args)
                if args[0] == b"export":
                    os.unlink(out)
        lst = json.loads(subprocess.run([os.fsencode(h.INSPECT), b"list", odd, b"--json"],
                                        capture_output=True, env=h.env()).stdout)
        self.assertIn("\\xe9", lst["dir"])
        self.assertTrue(any("\\xff\\x1b" in e["name"] for e in lst["snapshots"]), lst)
        show = subprocess.run([os.fsencode(h.INSPECT), b"show", snap], capture_output=True,
                              env=h.env()).stdout.decode()
        self.assertIn("wte\\x1b[31m\\xc2\\x9b2J", show)

    def test_overflowing_record_is_corrupt(self):
        """samples_consumed = step x global_batch overflowed for step 2^62 and was accepted."""
        self.make_snapshots(every="60")
        snap = os.path.join(self.tmp, "snap")  # a folder name that names no step
        shutil.copytree(os.path.join(self.ckpt, "step-000000060"), snap)
        big = str(1 << 62).encode()
        edit_manifest(snap, b'"step":60,', b'"step":' + big + b',', count=-1)
        edit_manifest(snap, b'"t":60', b'"t":' + big)
        edit_manifest(snap, b'"samples_consumed":480', b'"samples_consumed":0')
        r = h.train(["--resume", snap], check=False)
        self.assertEqual(r.returncode, 2, r.stderr[-1500:])
        self.assertRegex(r.stderr, r"trainer record is inconsistent: 0 samples consumed after "
                                   r"4611686018427387904 steps of 8")
        self.assertNotIn("final step", r.stdout)

    def test_export_of_overlapping_tensors_is_refused(self):
        self.make_snapshots(every="60")
        snap = os.path.join(self.ckpt, "step-000000060")
        with open(os.path.join(snap, "manifest.json"), "rb") as f:
            text = f.read()
        offs = re.findall(rb'"name":"h\.0\.attn\.c_attn\.weight","offset":(\d+)', text)
        self.assertEqual(len(offs), 1, text[:2000])
        edit_manifest(snap, b'"name":"h.0.attn.c_attn.weight","offset":' + offs[0],
                      b'"name":"h.0.attn.c_attn.weight","offset":0')
        out = os.path.join(self.tmp, "out.safetensors")
        p = h.run([h.INSPECT, "export", snap, out])
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertRegex(p.stderr, r"tensors \S+ and \S+ overlap in buffer params")
        self.assertFalse(os.path.exists(out))

    # -------------------------------------------------------------- documented commands

    def test_relative_ckpt_dir_at_two_ranks(self):
        """4 runs in 10 failed: rank 0 created the folder, rank 1 compared 'ck' with
        '/abs/ck'."""
        for i in range(4):
            name = f"ck{i}"
            ranks = h.Ranks(2, ["--ckpt-dir", name, "--ckpt-every", "5", "--steps", "5"],
                            self.tmp, cwd=self.tmp)
            codes = ranks.wait(120)
            self.assertEqual(codes, [0, 0], ranks.stderr(1)[-1500:] + ranks.stderr(0)[-1500:])
            self.assertTrue(os.path.isdir(os.path.join(self.tmp, name, "step-000000005")))

    def test_run_id_refuses_only_steps_it_would_write(self):
        self.make_snapshots(extra=["--run-id", "A"])  # steps 20, 40, 60 of run A
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "25", "--steps", "50",
                     "--run-id", "B", "--resume", "auto"])  # writes 25 and 50
        self.assertRegex(r.stderr, r"skipping \S+step-000000060: it belongs to run A")
        self.assertEqual(h.snapshot_dirs(self.ckpt), ["step-000000020", "step-000000025",
                                                      "step-000000040", "step-000000050",
                                                      "step-000000060"])
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--steps", "40",
                     "--run-id", "C", "--resume", "auto"], check=False)
        self.assertEqual(r.returncode, 2)
        self.assertRegex(r.stderr, r"already holds step-000000040 \(run A, committed\), a step "
                                   r"this run \(C\) would save; continue run A with --run-id A "
                                   r"--resume auto")
        # without --run-id the lineages cannot be told apart: any later snapshot is refused
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "7", "--steps", "3"], check=False)
        self.assertEqual(r.returncode, 2)

    def test_deepspeed_auto_in_optimizer_and_scheduler(self):
        cfg = os.path.join(self.tmp, "ds.json")
        with open(cfg, "w") as f:
            json.dump({"train_micro_batch_size_per_gpu": "auto",
                       "optimizer": {"type": "AdamW", "params": {
                           "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
                       "scheduler": {"type": "WarmupCosineLR", "params": {
                           "warmup_num_steps": "auto", "total_num_steps": "auto",
                           "warmup_max_lr": "auto", "cos_min_ratio": "auto"}}}, f)
        r = h.train(["--config", cfg])
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"],
                         "auto takes the flags' values")

    def test_sigterm_then_sigint_exits_143(self):
        """Both signals arrive during one step (steps of a few hundred ms); the SIGINT came
        last and used to decide the exit status (130) and the log line."""
        p = subprocess.Popen([h.TRAIN] + h.data_args() + h.SMALL +
                             ["--steps", "100000", "--micro-batch", "48", "--ckpt-dir", self.ckpt,
                              "--ckpt-every", "1000"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=h.env())
        try:
            while True:
                line = p.stderr.readline()
                self.assertTrue(line, "train ended before its first step")
                if re.search(r"step 3/", line):
                    break
            p.send_signal(signal.SIGTERM)
            time.sleep(0.03)  # delivered and handled: the kernel would hand SIGINT over first
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertEqual(p.returncode, 143, err[-1500:])
        self.assertRegex(err, r"stop requested \(Terminated\): stopping after step 4 ")
        self.assertNotRegex(err, r"stop requested \(Interrupt\)")

    def test_group_refused_snapshot_is_not_half_loaded(self):
        """W = 2, rank 1's shard of the only snapshot is corrupt: rank 0 had loaded its own
        ranges and its step, then trained from them while rank 1 started from 0 (the ranks fell
        out of step). Now both refuse (no restorable snapshot) or, allowed, start fresh alike
        and end at the uninterrupted digest."""
        # the global batch of the reference (8) at W = 2: one micro-batch of 4 per rank
        base = [a for a in h.SMALL]
        i = base.index("--grad-accum")
        base[i:i + 2] = ["--global-batch", "8"]
        ranks = h.Ranks(2, ["--ckpt-dir", self.ckpt, "--ckpt-every", "30", "--steps", "30"],
                        self.tmp, base=base)
        self.assertEqual(ranks.wait(120), [0, 0])
        shard = os.path.join(self.ckpt, "step-000000030", "rank-00001.bin")
        with open(shard, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0x40]))
        ranks = h.Ranks(2, ["--ckpt-dir", self.ckpt, "--ckpt-every", "30", "--resume", "auto"],
                        self.tmp, base=base)
        self.assertEqual(ranks.wait(120), [2, 2], ranks.stderr(0)[-2000:])
        self.assertRegex(ranks.stderr(0), r"refusing to start from step 0")
        ranks = h.Ranks(2, ["--ckpt-dir", self.ckpt, "--ckpt-every", "30", "--resume", "auto",
                            "--allow-fresh-start"], self.tmp, base=base)
        self.assertEqual(ranks.wait(180), [0, 0], ranks.stderr(0)[-2000:] + ranks.stderr(1)[-2000:])
        self.assertEqual(ranks.final()["digest"], h.reference()["digest"])


class Review(h.TempDirTest):
    """Cases a break-it review found after the first round of hardening."""

    def setUp(self):
        super().setUp()
        self.ckpt = os.path.join(self.tmp, "ckpt")

    def snapshots(self, every="20", steps="60", extra=()):
        h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", every, "--steps", steps] + list(extra))
        return h.snapshot_dirs(self.ckpt)

    def test_ranks_in_other_folders_share_a_relative_ckpt_dir(self):
        """Rank 0 sent the snapshot's path as typed; rank 1, started in another folder, could
        not find it, and rank 0 set every valid snapshot aside as corrupt."""
        for d in ("a/b", "c"):
            os.makedirs(os.path.join(self.tmp, d))
        base = list(h.SMALL)
        i = base.index("--grad-accum")
        base[i:i + 2] = ["--global-batch", "8"]
        common = ["--ckpt-every", "20", "--resume", "auto"]
        args = {0: ["--ckpt-dir", "../../D"], 1: ["--ckpt-dir", "../D"]}
        cwd = {0: os.path.join(self.tmp, "a/b"), 1: os.path.join(self.tmp, "c")}
        r = h.Ranks(2, common, self.tmp, base=base, rank_args=args, rank_cwd=cwd)
        self.assertEqual(r.wait(180), [0, 0], r.stderr(0)[-1500:] + r.stderr(1)[-1500:])
        shutil.rmtree(os.path.join(self.tmp, "D", "step-000000060"))
        r = h.Ranks(2, common, self.tmp, base=base, rank_args=args, rank_cwd=cwd)
        self.assertEqual(r.wait(180), [0, 0], r.stderr(0)[-1500:] + r.stderr(1)[-1500:])
        self.assertRegex(r.stderr(0), r"resumed from \S+/D/step-000000040 at step 40")
        self.assertEqual([d for d in os.listdir(os.path.join(self.tmp, "D")) if "corrupt" in d], [])
        self.assertNotIn("rank 1: rank 1:", r.stderr(1))
        self.assertEqual(r.final()["digest"], h.reference()["digest"])

    def test_a_rank_that_cannot_see_the_snapshot_renames_nothing(self):
        """A rank that cannot see rank 0's snapshot folder (here: rank 1 runs in a mount
        namespace of its own, with an empty tmpfs over the snapshot folder, as on a node
        without the shared file system, or with node-local folders under one path) says
        nothing about the snapshot's bytes: its ENOENT was once taken for corruption, and rank
        0 set every valid snapshot aside. Now the start-up check finds it before any resume or
        save (rank 0's probe file is not there): exit 2 on both ranks (a configuration error,
        which elastic does not retry), rank 1 naming the folder, nothing renamed, no probe
        file left."""
        base = list(h.SMALL)
        i = base.index("--grad-accum")
        base[i:i + 2] = ["--global-batch", "8"]
        r = h.Ranks(2, ["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--steps", "40"], self.tmp,
                    base=base)
        self.assertEqual(r.wait(180), [0, 0])
        names = h.snapshot_dirs(self.ckpt)
        port = h.free_port()
        argv = [h.TRAIN] + h.data_args() + base + ["--ckpt-dir", self.ckpt, "--ckpt-every", "20",
                                                   "--resume", "auto"]
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        inner = "mount -t tmpfs none \"$0\" && exec \"$@\""
        p1 = subprocess.Popen(["unshare", "-m", "sh", "-c", inner, self.ckpt] + argv,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=h.env(dict(env, RANK="1")))
        p0 = subprocess.run(argv, capture_output=True, text=True, env=h.env(dict(env, RANK="0")),
                            timeout=180)
        err1 = p1.communicate(timeout=60)[1]
        self.assertEqual((p0.returncode, p1.returncode), (2, 2), p0.stderr[-2000:] + err1[-1000:])
        self.assertRegex(p0.stderr, r"rank\(s\) 1 do not see the snapshot folder \S+ that rank 0 "
                                    r"writes to")
        self.assertRegex(err1, r"the snapshot folder \S+ here is not the one rank 0 writes to: its "
                               r"probe file \.probe-[0-9a-f]{16} is No such file or directory")
        self.assertNotIn("resumed from", p0.stderr)
        self.assertEqual(h.snapshot_dirs(self.ckpt), names)
        self.assertEqual([d for d in os.listdir(self.ckpt) if d.startswith(".probe-")], [])
        self.assertEqual([d for d in os.listdir(self.ckpt) if "corrupt" in d], [])

    def test_config_and_sample_log_fifos_do_not_hang(self):
        fifo = os.path.join(self.tmp, "cfg.fifo")
        os.mkfifo(fifo)
        r = h.train(["--config", fifo, "--steps", "2"], check=False, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)  # nobody writes it: an empty config
        r = h.train(["--sample-log", fifo, "--steps", "2"], check=False, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--sample-log", r.stderr)
        self.assertIn("not a regular file", r.stderr)
        # a pipe with a writer, as `--config <(...)` makes, is read
        cmd = ("exec " + " ".join(f"'{a}'" for a in [h.TRAIN] + h.data_args() + h.SMALL) +
               " --config <(echo '{\"gradient_clipping\": \"auto\"}')")
        p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=h.env(),
                           timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr[-1500:])
        self.assertEqual(h.final(p)["digest"], h.reference()["digest"])

    def test_ckpt_dir_inside_a_snapshot_is_refused(self):
        self.snapshots()
        snap = os.path.join(self.ckpt, "step-000000060")
        before = sorted(os.listdir(snap))
        for d in (snap, snap + "/", os.path.join(snap, "sub")):
            r = h.train(["--ckpt-dir", d, "--ckpt-every", "20", "--resume", "auto"], check=False)
            self.assertEqual(r.returncode, 2, r.stderr[-1000:])
            self.assertIn("is a snapshot folder", r.stderr)
        self.assertEqual(sorted(os.listdir(snap)), before)
        self.assertEqual(h.run([h.INSPECT, "verify", snap]).returncode, 0)

    def test_hard_linked_lock_is_refused(self):
        os.makedirs(self.ckpt)
        victim = os.path.join(self.tmp, "victim")
        with open(victim, "w") as f:
            f.write("precious\n")
        os.link(victim, os.path.join(self.ckpt, ".lock"))
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "5", "--steps", "5"], check=False)
        self.assertEqual(r.returncode, 2, r.stderr[-1000:])
        self.assertIn("other hard links", r.stderr)
        with open(victim) as f:
            self.assertEqual(f.read(), "precious\n")

    def test_sigterm_and_sigint_sent_together_exit_143(self):
        for _ in range(2):
            p = subprocess.Popen([h.TRAIN] + h.data_args() + h.SMALL + ["--steps", "100000"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                 env=h.env())
            try:
                while "step 3/" not in p.stderr.readline():
                    self.assertIsNone(p.poll())
                os.kill(p.pid, signal.SIGTERM)
                os.kill(p.pid, signal.SIGINT)
                err = p.communicate(timeout=120)[1]
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.assertEqual(p.returncode, 143, err[-1000:])

    def test_inspect_statuses_and_json_on_failures(self):
        self.snapshots(every="60")
        snap = os.path.join(self.ckpt, "step-000000060")
        out = os.path.join(self.tmp, "o.safetensors")
        # export: transient read errors are 3, with a status in JSON
        p = h.run([h.INSPECT, "export", snap, out, "--json"],
                  extra_env={"CKPT_FAULT_STORE": "eio-read:1"})
        self.assertEqual(p.returncode, 3, p.stderr)
        self.assertEqual(json.loads(p.stdout)["status"], "unreadable")
        # export onto a dangling link: exists, a usage error
        os.symlink("/nonexistent/x", out)
        p = h.run([h.INSPECT, "export", snap, out])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--force replaces it", p.stderr)
        os.unlink(out)
        # export under a snapshot's name into the folder of snapshots
        p = h.run([h.INSPECT, "export", snap, os.path.join(self.ckpt, "step-000000070")])
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("refusing a snapshot folder's name", p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.ckpt, "step-000000070")))
        # list of a missing folder: JSON with a status
        p = h.run([h.INSPECT, "--json", "list", os.path.join(self.tmp, "nope")])
        self.assertEqual(p.returncode, 1)
        self.assertEqual(json.loads(p.stdout)["status"], "missing")
        # options anywhere, abbreviations, "--" before a path that starts with '-'
        for args in (["list", self.ckpt, "-j"], ["list", self.ckpt, "--jso"],
                     ["-j", "list", self.ckpt]):
            p = h.run([h.INSPECT] + args)
            self.assertEqual(p.returncode, 0, (args, p.stderr))
            json.loads(p.stdout)
        dash = os.path.join(self.tmp, "-odd")
        shutil.copytree(self.ckpt, dash)
        p = h.run([h.INSPECT, "list", "--json", "--", "-odd"], cwd=self.tmp)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(len(json.loads(p.stdout)["snapshots"]), 1)
        p = h.run([h.INSPECT, "list", "--bogus", self.ckpt])
        self.assertEqual(p.returncode, 2)
        # a creation time past any calendar: shown as "-", never garbage
        edit_manifest(snap, b'"created_unix":', b'"created_unix":9223372036854775807,"x_":', 1)
        edit_manifest(snap, b',"x_":', b',"y_":')
        t = open(os.path.join(snap, "manifest.json"), "rb").read()
        t = re.sub(rb',"y_":\d+', b"", t)
        open(os.path.join(snap, "manifest.json"), "wb").write(t)
        reseal(snap)
        p = h.run([h.INSPECT, "list", self.ckpt])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertRegex(p.stdout, r"(?m)^60 +- ")

    def test_trainer_record_defects_are_corrupt(self):
        """A record without its model, or with a moments_digest that is not 16 hex digits, is
        corrupt (the resume falls back), not incompatible (exit 2) or silently unchecked."""
        self.snapshots()
        snap = os.path.join(self.ckpt, "step-000000060")
        edit_manifest(snap, b'"model":{', b'"model_":{')
        snap40 = os.path.join(self.ckpt, "step-000000040")
        edit_manifest(snap40, b'"moments_digest":{"adam_m":"', b'"moments_digest":{"adam_m":"zz')
        t = open(os.path.join(snap40, "manifest.json"), "rb").read()
        self.assertIn(b'"adam_m":"zz', t)
        r = h.train(["--ckpt-dir", self.ckpt, "--ckpt-every", "20", "--resume", "auto"])
        self.assertRegex(r.stderr, r"skipping corrupt snapshot \S+step-000000060: trainer record "
                                   r"lacks its model")
        self.assertRegex(r.stderr, r"skipping corrupt snapshot \S+step-000000040: trainer record "
                                   r"has a malformed moments_digest")
        self.assertRegex(r.stderr, r"resumed from \S+step-000000020 at step 20")
        self.assertEqual(h.final(r)["digest"], h.reference()["digest"])


if __name__ == "__main__":
    h.main()
