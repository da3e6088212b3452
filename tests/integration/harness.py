"""Shared helpers of the integration tests: paths, a small training config, runs that
can be killed at a chosen step, and parsing of the `final ...` line.

Environment (set by tests/integration/meson.build):
  CKPT_BUILD  the build folder (build/train, build/ckpt-inspect, ...)
  CKPT_DATA   the folder with the Brown corpus shards (train_*.bin, val_*.bin), made by
              scripts/test (scripts/lib.sh prepare_brown)
  CKPT_ELASTIC  (optional) the agent to run instead of $CKPT_BUILD/elastic/elastic:
              scripts/test runs agent tests with build-tsan/'s (ThreadSanitizer) while
              train comes from build/
"""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

BUILD = os.environ.get("CKPT_BUILD", os.path.join(os.path.dirname(__file__), "../../build"))
DATA = os.environ.get("CKPT_DATA", os.path.join(os.path.dirname(__file__), "../../data/brown"))
TRAIN = os.path.join(BUILD, "train")
INSPECT = os.path.join(BUILD, "ckpt-inspect")
PREPARE = os.path.join(BUILD, "train-prepare")
RESEAL = os.environ.get("CKPT_RESEAL", os.path.join(BUILD, "tests", "reseal_manifest"))
ELASTIC = os.environ.get("CKPT_ELASTIC") or os.path.join(BUILD, "elastic", "elastic")

# What a sanitizer prints when it reports (TSan, ASan, UBSan); tests that read a program's
# stderr fail on it even when the exit status was not checked.
SANITIZER_RE = re.compile(r"^(WARNING: ThreadSanitizer:|==\d+==ERROR: AddressSanitizer|"
                          r"\S+: runtime error: |SUMMARY: \w+Sanitizer)", re.M)


def sanitizer_reports(text):
    """The lines of text that start a sanitizer report (empty list: none)."""
    return [m.group(0) for m in SANITIZER_RE.finditer(text)]

# A small model that trains 60 steps in a few seconds on one core.
SMALL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
         "--micro-batch", "4", "--grad-accum", "2", "--steps", "60", "--lr", "3e-3",
         "--warmup", "5", "--seed", "7", "--eval-every", "20", "--val-samples", "32"]

FINAL_RE = re.compile(r"^final step=(\d+) loss=(\S+) val_loss=(\S+) params_digest=([0-9a-f]{32})$",
                      re.M)


def read(path):
    with open(path) as f:
        return f.read()


def require_data(test):
    if not os.path.exists(os.path.join(DATA, "train_000000.bin")):
        test.fail(f"no corpus shards in {DATA}: run scripts/test (it prepares data/brown)")


def data_args():
    return ["--data", os.path.join(DATA, "train_*.bin"), "--val-data", os.path.join(DATA, "val_*.bin")]


def env(extra=None):
    e = dict(os.environ)
    e.setdefault("OPENBLAS_NUM_THREADS", "1")
    if extra:
        e.update(extra)
    return e


def run(args, extra_env=None, timeout=300, check=False, **kw):
    """Run a program; returns CompletedProcess with text stdout/stderr. kw goes to
    subprocess.run (cwd, preexec_fn, ...)."""
    p = subprocess.run(args, capture_output=True, text=True, env=env(extra_env), timeout=timeout,
                       **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{args[0]} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def train(extra, extra_env=None, timeout=300, check=True, **kw):
    return run([TRAIN] + data_args() + SMALL + list(extra), extra_env, timeout, check, **kw)


def final(p):
    m = FINAL_RE.search(p.stdout)
    if not m:
        raise AssertionError(f"no final line in output:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return {"step": int(m.group(1)), "loss": float(m.group(2)), "val_loss": float(m.group(3)),
            "digest": m.group(4)}


def train_and_kill_at(extra, kill_step, timeout=300):
    """Start train, SIGKILL it once it has logged step kill_step. Returns (returncode, log)."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    p = subprocess.Popen([TRAIN] + data_args() + SMALL + list(extra), stdout=subprocess.DEVNULL,
                         stderr=log, env=env())
    deadline = time.time() + timeout
    step_re = re.compile(r"step (\d+)/")
    killed_at = None
    try:
        while p.poll() is None and time.time() < deadline:
            with open(log.name) as f:
                steps = [int(x) for x in step_re.findall(f.read())]
            if steps and steps[-1] >= kill_step:
                p.send_signal(signal.SIGKILL)
                killed_at = steps[-1]
                break
            time.sleep(0.005)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    with open(log.name) as f:
        text = f.read()
    os.unlink(log.name)
    return p.returncode, killed_at, text


def write_manifest(path, m):
    """Write manifest object m as FORMAT.md lays it out (compact, sorted keys, the checksum
    member last) and reseal its checksum."""
    import json
    body = {k: v for k, v in m.items() if k != "manifest_xxh3"}
    text = json.dumps(body, separators=(",", ":"), sort_keys=True)
    with open(path, "w") as f:
        f.write(text[:-1] + ',"manifest_xxh3":"0000000000000000"}\n')
    run([RESEAL, path], check=True)


def free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Ranks:
    """W train processes started the torchrun way (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
    rank 0 hosts the store. Each rank's stderr goes to a file; rank_env maps a rank to extra
    environment for that rank only, rank_args a rank to extra arguments for it only."""

    def __init__(self, world, args, tmp, rank_env=None, extra_env=None, base=None, rank_args=None,
                 cwd=None, rank_cwd=None):
        self.world = world
        self.port = free_port()
        self.procs, self.errs = [], []
        base = SMALL if base is None else base
        for r in range(world):
            e = {"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(self.port)}
            e.update(extra_env or {})
            e.update((rank_env or {}).get(r, {}))
            err = open(os.path.join(tmp, f"rank{r}-{self.port}.err"), "w+")
            out = subprocess.PIPE if r == 0 else subprocess.DEVNULL
            argv = [TRAIN] + data_args() + base + list(args) + list((rank_args or {}).get(r, []))
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=err, text=True,
                                               env=env(e), cwd=(rank_cwd or {}).get(r, cwd)))
            self.errs.append(err)
        self.stdout = ""

    def wait(self, timeout=300):
        """Wait for every rank; returns the list of exit statuses."""
        deadline = time.time() + timeout
        try:
            self.stdout = self.procs[0].communicate(timeout=max(1, deadline - time.time()))[0]
            for p in self.procs[1:]:
                p.wait(timeout=max(1, deadline - time.time()))
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.close()
        return [p.returncode for p in self.procs]

    def close(self):
        for f in self.errs:
            f.close()
        for p in self.procs:
            if p.stdout:
                p.stdout.close()

    def stderr(self, r):
        if not self.errs[r].closed:
            self.errs[r].flush()
        with open(self.errs[r].name) as f:
            return f.read()

    def wait_for_step(self, step, timeout=120):
        """Block until rank 0 has logged `step N/`; returns False on timeout or exit."""
        step_re = re.compile(r"step (\d+)/")
        deadline = time.time() + timeout
        while time.time() < deadline and self.procs[0].poll() is None:
            steps = [int(x) for x in step_re.findall(self.stderr(0))]
            if steps and steps[-1] >= step:
                return True
            time.sleep(0.01)
        return False

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.close()

    def final(self):
        return final(subprocess.CompletedProcess([], 0, self.stdout, self.stderr(0)))


class TempDirTest(unittest.TestCase):
    """A test case with a fresh temporary folder in self.tmp."""

    def setUp(self):
        require_data(self)
        self.tmp = tempfile.mkdtemp(prefix="ckpt-it-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


_reference = {}


def reference():
    """The uninterrupted run of SMALL (computed once per test program)."""
    if "r" not in _reference:
        _reference["r"] = final(train([]))
    return _reference["r"]


def snapshot_dirs(ckpt):
    return sorted(d for d in os.listdir(ckpt) if d.startswith("step-")) if os.path.isdir(ckpt) else []


def temp_dirs(ckpt):
    return sorted(d for d in os.listdir(ckpt) if d.startswith(".tmp-")) if os.path.isdir(ckpt) else []


def main():
    unittest.main(verbosity=2)
