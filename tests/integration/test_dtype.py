"""The backend options on the CPU: --dtype bf16 (the CPU table's emulation of bf16 GEMM
operands) is deterministic, differs from fp32 with a close loss, survives SIGKILL and
--resume auto bit for bit, and snapshots fp32 state that ckpt-inspect verifies and that an
fp32 run restores; the DeepSpeed config's bf16.enabled selects it; --device cuda without a
usable GPU (or without a CUDA build) is one line and exit 2; --reduce ring on the CPU is
logged as tree."""
import json
import os
import random
import re
import subprocess

import harness as h

BF16 = ["--dtype", "bf16"]


def has_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=20).stdout.count("GPU ") > 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_bf16_ref = {}


def bf16_reference():
    if "r" not in _bf16_ref:
        _bf16_ref["r"] = h.final(h.train(BF16))
    return _bf16_ref["r"]


class Dtype(h.TempDirTest):
    def test_bf16_deterministic_differs_from_fp32_loss_close(self):
        a = bf16_reference()
        b = h.final(h.train(BF16))
        self.assertEqual(a["digest"], b["digest"], "two bf16 runs differ")
        f = h.reference()
        self.assertNotEqual(a["digest"], f["digest"], "bf16 gave the fp32 bits")
        print(f"fp32 loss {f['loss']} val {f['val_loss']}; bf16 loss {a['loss']} val {a['val_loss']}")
        self.assertLess(abs(a["loss"] - f["loss"]), 0.05)
        self.assertLess(abs(a["val_loss"] - f["val_loss"]), 0.05)

    def test_startup_line_names_device_dtype_reduce(self):
        p = h.train(BF16 + ["--steps", "1"])
        self.assertRegex(p.stderr, r"backend: device cpu, dtype bf16 \(fp32 master state\), "
                                   r"kernels cpu, reduce tree")
        p = h.train(["--steps", "1", "--reduce", "ring"])
        self.assertIn("--reduce ring needs NCCL", p.stderr)
        self.assertRegex(p.stderr, r"backend: device cpu, dtype fp32, kernels cpu, reduce tree")

    def test_config_bf16_enabled(self):
        cfg = os.path.join(self.tmp, "ds.json")
        with open(cfg, "w") as f:
            json.dump({"bf16": {"enabled": True}}, f)
        p = h.train(["--config", cfg])
        self.assertNotIn("keys not used", p.stderr)
        self.assertEqual(h.final(p)["digest"], bf16_reference()["digest"])
        # the flag overrides the config
        p = h.train(["--config", cfg, "--dtype", "fp32"])
        self.assertEqual(h.final(p)["digest"], h.reference()["digest"])

    def test_bf16_kill_resume_same_digest_and_fp32_snapshot(self):
        ref = bf16_reference()
        ckpt = os.path.join(self.tmp, "ckpt")
        args = BF16 + ["--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume", "auto"]
        kill_step = random.Random().randint(21, 58)
        print(f"kill at step {kill_step}")
        rc, killed_at, log = h.train_and_kill_at(args, kill_step)
        self.assertEqual(rc, -9, f"the run was not killed (rc {rc}):\n{log[-2000:]}")
        p = h.train(args)
        m = re.search(r"resumed from \S+step-(\d+) at step (\d+)", p.stderr)
        # the newest snapshot committed before the kill is resumed; a kill soon after step 20
        # may come before its persist ends (a slow machine): then a fresh start is right
        # (unless the kill fell between its rename and its log line: resumed at 20 then)
        committed = [int(x) for x in re.findall(r"snapshot step (\d+) committed", log)]
        if committed:
            self.assertIsNotNone(m, p.stderr[-2000:])
            self.assertEqual(int(m.group(1)), max(committed), p.stderr[-2000:])
        else:
            self.assertTrue(m is None and "fresh start" in p.stderr or m and m.group(1) == "20",
                            p.stderr[-2000:])
        self.assertNotIn("dtype differs", p.stderr)
        self.assertEqual(h.final(p)["digest"], ref["digest"])
        self.assertEqual(h.snapshot_dirs(ckpt), ["step-000000020", "step-000000040", "step-000000060"])
        for d in h.snapshot_dirs(ckpt):
            v = h.run([h.INSPECT, "verify", os.path.join(ckpt, d)])
            self.assertEqual(v.returncode, 0, v.stderr)
        with open(os.path.join(ckpt, "step-000000040", "manifest.json")) as f:
            man = json.load(f)
        self.assertEqual([(b["name"], b["dtype"]) for b in man["buffers"]],
                         [("params", "f32"), ("adam_m", "f32"), ("adam_v", "f32")])
        self.assertEqual(man["trainer"]["dtype"], "bf16")
        # the bf16 snapshot is fp32 state: an fp32 run restores it (with a warning), and its
        # end differs from the bf16 run's
        p = h.train(["--resume", os.path.join(ckpt, "step-000000040")])
        self.assertIn("resumed from", p.stderr)
        self.assertIn("dtype differs from the snapshot's (bf16 -> fp32)", p.stderr)
        self.assertNotEqual(h.final(p)["digest"], ref["digest"])

    def test_fp32_snapshot_restores_into_bf16(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        h.train(["--ckpt-dir", ckpt, "--ckpt-every", "20", "--steps", "20"])
        p = h.train(BF16 + ["--resume", os.path.join(ckpt, "step-000000020")])
        self.assertIn("dtype differs from the snapshot's (fp32 -> bf16)", p.stderr)
        self.assertEqual(h.final(p)["step"], 60)

    def test_device_cuda_without_gpu_one_line_exit_2(self):
        if has_gpu():
            self.skipTest("a GPU is present")
        for dev in ["cuda", "cuda:0", "cuda:3"]:
            p = h.train(["--device", dev], check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            lines = [x for x in p.stderr.splitlines() if x.strip()]
            self.assertEqual(len(lines), 1, p.stderr)
            self.assertRegex(lines[0], r"^train: --device cuda(:\d+)?: (no CUDA device|this build "
                                       r"has no CUDA|.*CUDA)")
            self.assertEqual(p.stdout, "")

    def test_bad_values_exit_2(self):
        for flag, val in [("--device", "gpu"), ("--dtype", "fp16"), ("--reduce", "fast")]:
            p = h.train([flag, val], check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(flag, p.stderr)


if __name__ == "__main__":
    h.main()
