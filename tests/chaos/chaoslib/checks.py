"""The checks after a scenario (CONTRACT.md; tests/chaos/README.md, "The driver").

after_run(job, result, ref) once the job ended (or was given up on):
  finished   every agent of the last group that was not stopped on purpose exited 0, and
             the final line names the last step
  digest     params_digest equals the uninterrupted one-process run's (W in {1, 2, 4}), or
             the final loss is within LOSS_TOL of it (another W ran: digest_equal None)
  snapshots  every committed local snapshot (`ckpt-inspect verify DIR/step-N`) and every
             complete S3 one (`ckpt-inspect verify s3://bucket/prefix/step-N`) verifies,
             except those damaged on purpose (job.corrupted), which must be reported
             corrupt or be gone by retention; none that the logs call committed ("snapshot
             step N committed", "flushed the memory snapshot of step N", "step N is on S3")
             is missing unless retention removed it later ("retention: removed",
             "remote retention: removing", said before the first DELETE); none was set
             aside that was not damaged
  leftovers  no .tmp-* folder in the snapshot folder, no file in the job's memory folder,
             no process with CHAOS_JOB=<job id> in its environment
after_close(job, result): no mount of the job's left.
"""
import json
import os
import re
import subprocess
import time

from . import job as jobmod

# seconds after a stop_rank in which another fault's restart reaches the stopped rank first
# (--hang-timeout 5 and a grace)
HANG_COVER_S = 7.0
LOSS_TOL = 2e-3   # relative, for a world size outside 1, 2, 4 (README.md: W = 3 agrees to 1e-4)


def _inspect(job, args, env=None, timeout=60):
    try:
        return subprocess.run([job.inspect] + args, capture_output=True, text=True,
                              timeout=timeout, env=env or job.env)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"ckpt-inspect {' '.join(args)}: "
                                           f"no answer in {timeout} s")


def _listing(job, where, env=None):
    p = _inspect(job, ["--json", "list", where], env)
    if p.returncode != 0:
        return None, f"ckpt-inspect --json list {where}: exit {p.returncode}: {p.stderr.strip()[-300:]}"
    try:
        snaps = json.loads(p.stdout).get("snapshots", [])
    except ValueError as e:
        return None, f"ckpt-inspect --json list {where}: not JSON ({e})"
    return snaps, None


def _expected(job, add_kinds, remove_kinds):
    """{step: last event} from the logs, in time order: which steps must still exist."""
    state = {}
    for t, kind, g, line in job.events():
        if kind in add_kinds:
            state[int(next(x for x in g if x))] = "committed"
        elif kind in remove_kinds:
            state[int(next(x for x in g if x))] = kind
    return state


def _check_tier(job, r, tier, where, env, add_kinds, remove_kinds):
    snaps, err = _listing(job, where, env)
    if err:
        r.problems.append(f"{tier}: {err}")
        return
    damaged = {s for s, _ in job.corrupted.get(tier, set())}
    listed = {}
    for s in snaps:
        listed.setdefault(int(s["step"]), []).append(s)
    state = _expected(job, add_kinds, remove_kinds)
    for step, what in sorted(state.items()):
        if what != "committed":
            continue
        entries = listed.get(step, [])
        if not entries and step not in damaged:
            r.problems.append(f"{tier}: snapshot step {step} was committed and never removed "
                              f"by retention, but it is gone (lost)")
    for step, entries in sorted(listed.items()):
        for s in entries:
            name, status = s.get("name", ""), s.get("status")
            if tier == "local" and (status == "set-aside" or ".corrupt-" in name):
                if step not in damaged:
                    r.problems.append(f"{tier}: {name} was set aside as corrupt but was not "
                                      f"damaged on purpose")
                continue
            if status == "incomplete":
                if tier == "local":
                    r.problems.append(f"{tier}: {name} left behind (incomplete)")
                continue
            if status != "committed":
                if step not in damaged:
                    r.problems.append(f"{tier}: {name} is {status}, not damaged on purpose")
                continue
            path = f"{where}/{name}"
            p = _inspect(job, ["verify", path], env, timeout=120)
            if step in damaged:
                if p.returncode == 0:
                    r.problems.append(f"{tier}: {path} was damaged on purpose but verifies")
                elif p.returncode != 1:
                    r.problems.append(f"{tier}: {path} (damaged on purpose): verify exit "
                                      f"{p.returncode}, not 1 (corrupt): {p.stderr.strip()[-200:]}")
                continue
            if p.returncode == 0:
                r.verified[tier] += 1
            else:
                r.problems.append(f"{tier}: verify {path} exit {p.returncode}: "
                                  f"{(p.stdout + p.stderr).strip()[-300:]}")


def after_run(job, r, ref):
    job.poll()
    # the job finished
    if not job.ended():
        r.problems.append(f"the job did not end: agents {job.live_nodes()} still running")
    for n in job.nodes:
        rc = n.proc.poll()
        if n.expected is None and rc != 0:
            r.problems.append(f"{n} exited {rc}: {job.tail(n, 3)}")
    fin = job.final()
    if fin is None:
        r.problems.append("no final line from the last group")
    elif fin[0] != job.steps:
        r.problems.append(f"the final line says step {fin[0]}, not {job.steps}")
    # digest or loss
    launches = job.launches()
    r.restarts = max(0, len(launches) - 1)
    for _, _, g, line in launches:
        if g[0] == "fresh start":
            continue
        src = g[0]
        r.restore_sources[src if src.startswith("memory") else
                          "s3" if src.startswith("s3://") else "disk"] += 1
    r.verified["memory"] += sum(1 for e in launches if e[2][0].startswith("memory"))
    if fin is not None and ref is not None:
        if job.worlds <= {1, 2, 4}:
            r.digest_equal = fin[3] == ref[0]
            if not r.digest_equal:
                r.problems.append(f"params_digest {fin[3]} != uninterrupted {ref[0]} "
                                  f"(worlds {sorted(job.worlds)})")
        else:
            r.digest_equal = None
            r.loss_ok = abs(fin[1] - ref[1]) <= LOSS_TOL * max(1.0, abs(ref[1]))
            if not r.loss_ok:
                r.problems.append(f"final loss {fin[1]} vs uninterrupted {ref[1]}: beyond "
                                  f"{LOSS_TOL:g} (worlds {sorted(job.worlds)})")
    elif fin is not None:
        r.digest_equal = False
        r.problems.append("no reference run to compare with")
    # the hang watchdog acted for the stopped ranks; a stopped rank that another fault's
    # restart reached first (within the hang timeout and a grace) needs no watchdog
    alone = [at for k, _, at in job.faults if k == "stop_rank" and
             not any(k2 != "stop_rank" and at <= at2 <= at + HANG_COVER_S for k2, _, at2 in job.faults)]
    if alone and not job.events("hang"):
        r.problems.append(f"stop_rank: the hang watchdog never fired (no 'hang watchdog' line) for "
                          f"{len(alone)} stopped rank(s) no other fault's restart reached")
    # snapshots of every tier
    _check_tier(job, r, "local", job.ckpt_dir, None, {"committed", "flushed"},
                {"removed", "set_aside"})
    if job.s3:
        _check_tier(job, r, "s3", job.s3.url, job.s3.direct_env(job.env), {"on_s3"},
                    {"s3_removed"})
    # leftovers
    try:
        tmps = [n for n in os.listdir(job.ckpt_dir) if n.startswith(".tmp-")]
    except OSError:
        tmps = []
    if tmps:
        r.problems.append(f"temp folders left in {job.ckpt_dir}: {' '.join(sorted(tmps))}")
    try:
        mem = sorted(os.listdir(job.mem_dir))
    except OSError:
        mem = []
    if mem:
        r.problems.append(f"{len(mem)} file(s) left in the memory folder {job.mem_dir}: "
                          f"{' '.join(mem[:6])}")
    deadline = time.monotonic() + 5
    pids = jobmod.job_pids(job.id)
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = jobmod.job_pids(job.id)
    for pid in pids:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:120]
        except OSError:
            cmd = "?"
        r.problems.append(f"process {pid} of the job still runs after its end: {cmd}")


def after_close(job, r):
    try:
        with open("/proc/mounts") as f:
            mounts = [ln.split()[1] for ln in f]
    except OSError:
        mounts = []
    left = [m for m in mounts if m.startswith(job.work) or m.startswith(job.mem_dir)]
    if left:
        r.problems.append(f"mounts left: {' '.join(left)}")
    if os.path.exists(job.mem_dir):
        r.problems.append(f"memory folder {job.mem_dir} left")
