#!/usr/bin/env python3
"""Chaos driver (issue 5): run a training job under `elastic`, SIGKILL random ranks at random
moments, and check that the final weights equal those of an uninterrupted run.

    tests/chaos/chaos.py [--kills N] [--nproc N] [--steps S] [--seed X] [--build DIR]
                         [--data DIR] [--keep]

Each kill waits until the current group has trained at least one step since its launch, then
a random delay, then SIGKILLs one random rank (a child of the agent running train; not
the agent's guardian). The agent must notice,
stop the group and restart it with --resume auto. At the end the driver runs the same
training uninterrupted (one process: the contract of DESIGN section 4 makes the world size
irrelevant) and compares params_digest. It prints one summary line

    kills=<n> restarts=<n> resumed_from=<steps> digest_equal=<yes|no>

and exits 0 only when the job succeeded, every kill happened and the digests are equal.
"""
import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def workers(pid, exe):
    """Live children of the agent `pid` that run `exe` (its ranks; not its guardian)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] == "Z":
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
            if os.path.realpath(argv0) == os.path.realpath(exe):
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1200,
                    help="long enough that the kills end well before the job")
    ap.add_argument("--seed", type=int, default=None, help="seed of the kill schedule")
    ap.add_argument("--build", default=os.environ.get("CKPT_BUILD", os.path.join(ROOT, "build")))
    ap.add_argument("--data", default=os.environ.get("CKPT_DATA", os.path.join(ROOT, "data", "brown")))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rnd = random.Random(seed)
    # CKPT_ELASTIC: another agent binary (tests/integration/harness.py: a ThreadSanitizer build)
    elastic = os.environ.get("CKPT_ELASTIC") or os.path.join(a.build, "elastic", "elastic")
    train = os.path.join(a.build, "train")
    for p in (elastic, train):
        if not os.access(p, os.X_OK):
            print(f"chaos: {p} is missing; build first", file=sys.stderr)
            return 2
    work = tempfile.mkdtemp(prefix="chaos-")
    ckpt = os.path.join(work, "ckpt")
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    # 8 sequences per step: a power-of-two number of micro-batches per rank at W = 1, 2, 4
    job = ["--data", os.path.join(a.data, "train_*.bin"), "--n-layer", "2", "--n-embd", "64",
           "--n-head", "4", "--seq-len", "64", "--micro-batch", "2", "--global-batch", "8",
           "--steps", str(a.steps), "--lr", "3e-3", "--warmup", "10", "--seed", "11",
           "--log-every", "1"]
    cmd = [elastic, "--nproc-per-node", str(a.nproc), "--max-restarts", str(a.kills + 5),
           "--monitor-interval", "0.1", "--stop-grace", "5", "--", train] + job + \
          ["--ckpt-dir", ckpt, "--ckpt-every", "10", "--resume", "auto"]
    log_path = os.path.join(work, "elastic.log")
    print(f"chaos: seed {seed}, {a.kills} kills, {a.nproc} ranks, {a.steps} steps; log {log_path}",
          flush=True)
    t_start = time.time()
    with open(log_path, "w") as log:
        agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    # "resumed from DIR/step-N at step N" (disk, S3) or "resumed from memory (own|replica|peer) at
    # step N" (the memory tier, on by default under elastic)
    launch_re = re.compile(r"(fresh start|resumed from (?:memory \(\w+\)|\S+) at step (\d+))")
    step_re = re.compile(r"\] .*step (\d+)/")
    kills, resumed = 0, []
    try:
        seen_launches = 0
        while kills < a.kills and agent.poll() is None and time.time() - t_start < a.timeout:
            # wait for a step logged after the newest launch of the group
            text = open(log_path).read()
            launches = list(launch_re.finditer(text))
            if len(launches) <= seen_launches or not step_re.search(text, launches[-1].end()):
                time.sleep(0.02)
                continue
            time.sleep(rnd.uniform(0.0, 0.6))
            pids = workers(agent.pid, train)
            if not pids or agent.poll() is not None:
                continue
            victim = rnd.choice(pids)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills += 1
            seen_launches = len(launches)
            print(f"chaos: kill {kills}: SIGKILL pid {victim} after "
                  f"{time.time() - t_start:.1f} s", flush=True)
        out, _ = agent.communicate(timeout=max(1.0, a.timeout - (time.time() - t_start)))
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    text = open(log_path).read()
    resumed = [int(m.group(2)) for m in launch_re.finditer(text) if m.group(2)]
    from_mem = len(re.findall(r"resumed from memory \(", text))
    launches = len(launch_re.findall(text))
    m = re.search(r"params_digest=([0-9a-f]{32})", out)
    got = m.group(1) if m else None
    ref = subprocess.run([train] + job, capture_output=True, text=True, env=env)
    m = re.search(r"params_digest=([0-9a-f]{32})", ref.stdout)
    want = m.group(1) if m else None
    equal = got is not None and got == want
    print(f"kills={kills} restarts={max(0, launches - 1)} "
          f"resumed_from={','.join(map(str, resumed)) or '-'} from_memory={from_mem} "
          f"digest_equal={'yes' if equal else 'no'}", flush=True)
    # every kill lands in a running round, so each must have caused exactly one restart
    ok = agent.returncode == 0 and kills == a.kills and launches - 1 == kills and equal
    if not ok:
        print(f"chaos: agent exit {agent.returncode}, {kills} kills, {launches - 1} restarts, "
              f"digest {got} vs uninterrupted {want}; log kept in {work}", file=sys.stderr)
    elif not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
