#!/usr/bin/env python3
"""Chaos driver (issue 14): real training jobs under elastic, faults of every kind drawn
from a seed, and checks after each scenario (tests/chaos/README.md, "The driver").

    tests/chaos/chaos.py [--profile ci|soak] [--faults N] [--seed S] [--scenario NAME]
                         [--only KIND] [--build DIR] [--data DIR] [--keep] [--list]

A scenario is one job (layout, S3 or not, a tmpfs snapshot folder or not) and a schedule
of faults drawn from random.Random("SEED:NAME"): the same seed and name give the same
schedule of kinds (timing is real). Before each fault the driver waits until the job
recovered from the previous one. After the scenario chaoslib.checks compares the final
params_digest with an uninterrupted one-process run of the same config, verifies every
snapshot left on every tier and looks for leftovers. The output ends with a table (kind |
injected), restarts, snapshots verified per tier, restore sources, the seed, and the lines
`faults=N` and `digest_equal=yes|no`. Exit 0 only when every scenario is ok and (ci) every
kind was injected at least once; a failure prints the seed and the scenario's schedule and
keeps its work folder.
"""
import argparse
import atexit
import collections
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

from chaoslib import checks, faults  # noqa: E402
from chaoslib import job as jobmod  # noqa: E402
from chaoslib.result import ScenarioResult, Summary  # noqa: E402

KINDS = dict(faults.KINDS)
NEEDS = dict(faults.NEEDS)
MISSING = []
try:
    from chaoslib import faults_io  # noqa: E402
    KINDS.update(faults_io.KINDS)
    NEEDS.update(faults_io.NEEDS)
except ImportError:
    MISSING += ["s3_kill_restart", "s3_hang", "s3_503", "flip_local", "truncate_local",
                "flip_s3", "truncate_s3", "flip_memory"]
try:
    from chaoslib import netns  # noqa: E402
except ImportError:
    netns = None
    MISSING.append("partition")

ALL_KINDS = ["kill_rank", "kill_ranks", "kill_agent", "kill_store_host", "stop_rank",
             "stop_agent", "fault_point", "store_enospc", "store_eio", "disk_full",
             "world_size_change", "s3_kill_restart", "s3_hang", "s3_503", "flip_local",
             "truncate_local", "flip_s3", "truncate_s3", "flip_memory", "partition"]
STORAGE = {"store_enospc", "store_eio", "disk_full", "s3_hang", "s3_503", "flip_local",
           "truncate_local", "flip_s3", "truncate_s3", "flip_memory", "s3_kill_restart"}
PROCESS = {"kill_rank", "kill_ranks", "stop_rank", "fault_point"}

STEPS = 1000          # every ci scenario: one reference run serves them all
# scenario templates: name -> (layout (nodes, ranks per node), s3, tmpfs, faults, favoured kinds)
TEMPLATES = [
    ("two-nodes-s3", (2, 1), True, False, 13, ["kill_agent", "kill_store_host", "stop_agent",
                                               "kill_ranks", "s3_kill_restart", "flip_s3"]),
    ("tmpfs-storage", (1, 2), False, True, 13, ["disk_full", "store_enospc", "store_eio",
                                                "stop_rank", "flip_local", "truncate_local"]),
    ("resize-s3", (1, 2), True, False, 12, ["world_size_change", "fault_point", "s3_503",
                                            "truncate_s3", "kill_rank"]),
    ("mixed", (2, 1), True, True, 13, ["fault_point", "flip_memory", "s3_hang", "kill_rank",
                                       "stop_agent", "world_size_change"]),
    ("wide", (1, 4), False, True, 11, ["fault_point", "kill_ranks", "stop_rank", "store_eio",
                                      "kill_store_host"]),
]


class Ctx:
    """What scenarios share: paths, the seed, the reference runs, the one RGW."""

    def __init__(self, a, seed):
        self.build, self.data, self.seed, self.keep = a.build, a.data, seed, a.keep
        self.rnd = random.Random(seed)
        self.work_root = tempfile.mkdtemp(prefix=f"chaos-{seed}-")
        self._rgw = None
        self._refs = {}
        self._ref_lock = threading.Lock()
        self._cache = os.path.join(a.build, "chaos-reference-cache.json")

    def rgw(self):
        if self._rgw is None:
            import s3env
            self._rgw = s3env.shared_rgw()
        return self._rgw

    def _train_hash(self):
        h = hashlib.sha256()
        with open(os.path.join(self.build, "train"), "rb") as f:
            for b in iter(lambda: f.read(1 << 20), b""):
                h.update(b)
        return h.hexdigest()

    def reference(self, steps):
        """(digest, loss) of the uninterrupted one-process run of the chaos config at
        `steps`; cached by config (in memory, and on disk keyed by the train binary)."""
        with self._ref_lock:
            if steps in self._refs:
                return self._refs[steps]
            args = [os.path.join(self.build, "train"), "--data",
                    os.path.join(self.data, "train_*.bin")] + jobmod.MODEL + ["--steps", str(steps)]
            key = self._train_hash() + " " + " ".join(args[1:])
            try:
                with open(self._cache) as f:
                    cache = json.load(f)
            except (OSError, ValueError):
                cache = {}
            if key in cache:
                self._refs[steps] = tuple(cache[key])
                return self._refs[steps]
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
            env.pop("CKPT_FAULT_DIR", None)
            p = subprocess.run(["nice"] + args, capture_output=True, text=True, env=env, timeout=900)
            m = jobmod.FINAL_RE.search(p.stdout)
            if not m:
                print(f"chaos: the reference run failed (exit {p.returncode}): "
                      f"{p.stderr[-500:]}", file=sys.stderr)
                self._refs[steps] = None
                return None
            self._refs[steps] = (m.group(4), float(m.group(2)))
            cache[key] = list(self._refs[steps])
            try:
                with open(self._cache + ".tmp", "w") as f:
                    json.dump(cache, f)
                os.replace(self._cache + ".tmp", self._cache)
            except OSError:
                pass
            return self._refs[steps]


def caps(template):
    _, layout, s3, tmpfs, _, _ = template
    c = {"retention"}
    if s3:
        c.add("s3")
    if tmpfs:
        c.add("tmpfs")
    if layout[0] > 1:
        c.add("two_nodes")
    return c


def usable(kind, c):
    return kind in KINDS and NEEDS.get(kind, set()) <= c


def schedule(template, rnd, nfaults, only=None):
    """The scenario's schedule: a list of entries, each a list of 1 or 2 kinds (two: a
    storage fault and a process fault at once). Favoured kinds come first, the rest is
    random among the kinds the scenario can take."""
    c = caps(template)
    pool = [k for k in ALL_KINDS if usable(k, c)]
    if only:
        return [[only] for _ in range(nfaults)] if only in pool else []
    fav = [k for k in template[5] if k in pool]
    out = [[k] for k in fav]
    while sum(len(e) for e in out) < nfaults:
        if rnd.random() < 0.25:
            st = [k for k in pool if k in STORAGE]
            pr = [k for k in pool if k in PROCESS]
            if st and pr:
                out.append([rnd.choice(st), rnd.choice(pr)])
                continue
        out.append([rnd.choice(pool)])
    # the favoured kinds first (each scenario covers its own: the ci profile's "every
    # kind" rule), in a random order, then the random rest
    head, tail = out[:len(fav)], out[len(fav):]
    rnd.shuffle(head)
    return head + tail


def describe(name, template, sched):
    _, layout, s3, tmpfs, _, _ = template
    return (f"{name}: layout {layout[0]}x{layout[1]}, s3 {'on' if s3 else 'off'}, tmpfs "
            f"{'on' if tmpfs else 'off'}, schedule " +
            " ; ".join("+".join(e) for e in sched))


def run_scenario(ctx, name, template, sched, rnd, verbose=True):
    _, layout, s3, tmpfs, _, _ = template
    r = ScenarioResult(name=name, seed=ctx.seed, description=describe(name, template, sched))
    t0 = time.monotonic()
    job = None
    c = caps(template)
    pool = [k for k in ALL_KINDS if usable(k, c)]
    favoured = set(template[5])
    deferred = collections.Counter()
    sched = list(sched)

    def inject(k, how=""):
        """Run kind k's injector once: recorded, counted and printed when it acted; an
        injector that raises is a problem of the scenario. Returns whether it acted."""
        try:
            detail = KINDS[k](job)
        except Exception as e:  # noqa: BLE001 - an injector bug is a failure
            r.problems.append(f"injector {k} raised {e!r}")
            return False
        if not detail:
            return False
        job.record(k, detail)
        r.faults[k] += 1
        if verbose:
            print(f"chaos: {name} +{time.monotonic() - t0:5.1f}s step {job.last_step()}: "
                  f"{k}{how}: {detail}", flush=True)
        return True
    try:
        job = jobmod.Job(ctx, name, rnd, layout=layout, steps=STEPS, s3=s3, tmpfs=tmpfs)
        r.work = job.work
        _ACTIVE.add(job)
        job.launch()
        if not job.wait_steps(1, 90):
            r.problems.append("the job trained no step within 90 s of its launch")
        i = 0
        while i < len(sched):
            entry = sched[i]
            i += 1
            job.poll()
            st = job.last_step() or 0
            if job.ended() or st > 0.9 * STEPS:
                r.notes.append(f"the job reached step {st} of {STEPS}: "
                               f"{len(sched) - i + 1} entries not injected")
                break
            # a random moment: up to half a second of training
            pause = time.monotonic() + rnd.uniform(0.0, 0.3)
            while time.monotonic() < pause:
                job.poll()
                time.sleep(0.02)
            # while a kind that needs two nodes is still to come and has not acted, a world
            # size change keeps two nodes (else that kind could never act in this scenario,
            # and the ci profile would miss it)
            later = [x for e in sched[i - 1:] for x in e]
            job.keep_two_nodes = any("two_nodes" in NEEDS.get(x, set()) and not r.faults[x]
                                     for x in later)
            did = []
            for kind in entry:
                tried = [kind] + rnd.sample(pool, min(3, len(pool)))
                for k in tried:
                    if k not in KINDS or (k in did and len(entry) > 1):
                        continue
                    if inject(k):
                        did.append(k)
                        break
                    else:
                        if verbose:
                            print(f"chaos: {name}: {k} cannot act now", flush=True)
                        # a favoured kind (the ci profile counts on it) that cannot act yet
                        # (no complete upload, no two committed snapshots, ...) comes again
                        # after the next entry, up to five times: not at the end of the
                        # schedule, which a fast job may never reach (seed 544903471 lost
                        # truncate_local, tried once at step 30, when the job passed step
                        # 900 with its retry still queued last)
                        if k == kind and k in favoured and not r.faults[k] and deferred[k] < 5:
                            deferred[k] += 1
                            sched.insert(min(i + 1, len(sched)), [k])
            if did and not job.wait_recovered(90):
                r.problems.append(f"no recovery within 90 s after {'+'.join(did)} "
                                  f"(a hang?): live agents {job.live_nodes()}")
                break
        # last chance for a favoured kind that never could act (an S3 corruption needs a
        # complete upload, which a scenario full of restarts may not have had yet): try it
        # every half second while the job trains, for up to 30 s (seed 752683811 lost
        # flip_s3 after five tries that came too early)
        for k in [k for k in template[5] if k in KINDS and k in pool and not r.faults[k]]:
            until = time.monotonic() + 30.0
            while not r.problems and time.monotonic() < until:
                job.poll()
                if job.ended() or (job.last_step() or 0) > 0.95 * STEPS:
                    break
                if inject(k, " (last chance)"):
                    if not job.wait_recovered(90):
                        r.problems.append(f"no recovery within 90 s after {k} (a hang?): "
                                          f"live agents {job.live_nodes()}")
                    break
                time.sleep(0.5)
        remaining = STEPS - (job.last_step() or 0)
        if not r.problems and not job.wait_end(120 + remaining * 0.1):
            r.problems.append(f"the job did not end (step {job.last_step()} of {STEPS})")
        ref = ctx.reference(STEPS)
        r.problems += job.problems
        r.notes += job.notes
        checks.after_run(job, r, ref)
    except Exception as e:  # noqa: BLE001 - reported as the scenario's failure
        import traceback
        r.problems.append(f"driver error: {e!r}\n{traceback.format_exc()}")
    finally:
        if job is not None:
            r.log = list(job.faults)
            job.close(keep=ctx.keep or bool(r.problems) or not r.ok)
            checks.after_close(job, r)
            _ACTIVE.discard(job)
    r.seconds = time.monotonic() - t0
    return r


_ACTIVE = set()


def _cleanup():
    for j in list(_ACTIVE):
        try:
            j.close(keep=True)
        except Exception:  # noqa: BLE001
            pass


def plan(a, seed):
    """[(name, template, schedule, rnd)] of the profile."""
    out = []
    if a.profile == "ci":
        templates = [(t[0], t) for t in TEMPLATES]
    else:
        templates, i = [], 0
        while sum(t[4] for _, t in templates) < a.faults:
            t = TEMPLATES[i % len(TEMPLATES)]
            templates.append((f"{t[0]}-{i // len(TEMPLATES)}", t))
            i += 1
    for name, t in templates:
        if a.scenario and name != a.scenario:
            continue
        rnd = random.Random(f"{seed}:{name}")
        if a.only:
            if a.only not in KINDS or not usable(a.only, caps(t)):
                continue
            sched = schedule(t, rnd, 3, only=a.only)
        else:
            sched = schedule(t, rnd, t[4])
        out.append((name, t, sched, rnd))
        if a.only:
            break
    return out


def main():
    global STEPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--profile", choices=["ci", "soak"], default="ci")
    ap.add_argument("--faults", type=int, default=1000, help="soak: faults to inject in all")
    ap.add_argument("--seed", type=int, default=None, help="seed of the schedules")
    ap.add_argument("--scenario", default=None, help="run only this scenario")
    ap.add_argument("--only", default=None, help="run only this fault kind (3 faults)")
    ap.add_argument("--build", default=os.environ.get("CKPT_BUILD", os.path.join(ROOT, "build")))
    ap.add_argument("--data", default=os.environ.get("CKPT_DATA", os.path.join(ROOT, "data", "brown")))
    ap.add_argument("--keep", action="store_true", help="keep every work folder")
    ap.add_argument("--steps", type=int, default=1000, help="steps of every job (default %(default)s)")
    ap.add_argument("--list", action="store_true", help="print the scenarios and schedules")
    ap.add_argument("--quiet", action="store_true", help="no line per fault")
    a = ap.parse_args()
    a.build, a.data = os.path.abspath(a.build), os.path.abspath(a.data)
    STEPS = a.steps
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    for p in ("train", "elastic/elastic", "ckpt-inspect"):
        if not os.access(os.path.join(a.build, p), os.X_OK):
            print(f"chaos: {os.path.join(a.build, p)} is missing; build first", file=sys.stderr)
            return 2
    if a.only and a.only not in ALL_KINDS:
        print(f"chaos: unknown kind {a.only}; kinds: {' '.join(ALL_KINDS)}", file=sys.stderr)
        return 2
    scen = plan(a, seed)
    # "partition" (ci) or "partition-N" (the soak's N-th) reruns one partition scenario
    m_part = re.fullmatch(r"partition(?:-(\d+))?", a.scenario or "")
    run_netns = netns is not None and not a.only and (a.scenario is None or bool(m_part))
    if a.only == "partition":
        run_netns = netns is not None
    if a.list:
        for name, t, sched, _ in scen:
            print(describe(name, t, sched))
        if run_netns:
            print("partition: netns.run_partition_scenario")
        return 0
    if not scen and not run_netns:
        print("chaos: nothing to run (unknown scenario, or a kind no scenario can take; "
              f"missing modules: {' '.join(MISSING) or 'none'})", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))
    atexit.register(_cleanup)
    ctx = Ctx(a, seed)
    print(f"chaos: seed {seed}, profile {a.profile}, {len(scen)} scenario(s), work "
          f"{ctx.work_root}" + (f"; missing kinds (modules not merged): {' '.join(MISSING)}"
                                if MISSING else ""), flush=True)
    # the reference run overlaps RGW's start and the first scenario
    threading.Thread(target=ctx.reference, args=(STEPS,), daemon=True).start()
    summary = Summary(seed, ALL_KINDS)
    def partition(i):
        # its own random stream from the seed; the ci profile makes two cuts (a long one and
        # a short one), the soak profile 1..3 each time
        ctx.rnd = random.Random(f"{seed}:partition-{i}")
        ctx.cuts = 2 if a.profile == "ci" else None
        r = netns.run_partition_scenario(ctx)
        r.name = f"partition-{i}" if a.profile == "soak" else "partition"
        summary.add(r)
        print(f"chaos: {r.name}: {'ok' if r.ok else 'FAILED'} in {r.seconds:.0f} s, "
              f"{sum(r.faults.values())} cuts, {r.restarts} restarts", flush=True)
        if not r.ok:
            _report_failure(r)

    try:
        for k, (name, t, sched, rnd) in enumerate(scen):
            if run_netns and a.profile == "soak" and k and k % len(TEMPLATES) == 0:
                partition(k // len(TEMPLATES) - 1)  # one partition scenario per round of templates
            print(f"chaos: scenario {describe(name, t, sched)}", flush=True)
            r = run_scenario(ctx, name, t, sched, rnd, verbose=not a.quiet)
            summary.add(r)
            for n in r.notes:
                print(f"chaos: {name}: note: {n}", flush=True)
            print(f"chaos: {name}: {'ok' if r.ok else 'FAILED'} in {r.seconds:.0f} s, "
                  f"{sum(r.faults.values())} faults, {r.restarts} restarts", flush=True)
            if not r.ok:
                _report_failure(r)
        if run_netns:
            if m_part and m_part.group(1):
                partition(int(m_part.group(1)))
            else:
                partition(len(scen) // len(TEMPLATES) if a.profile == "soak" else 0)
    finally:
        _cleanup()
    print(summary.table(), flush=True)
    ok = bool(summary.results) and all(r.ok for r in summary.results)
    if a.profile == "ci" and not a.scenario and not a.only:
        got = summary.total("faults")
        missing = [k for k in ALL_KINDS if not got.get(k)]
        if missing:
            print(f"chaos: ci profile: kinds never injected: {' '.join(missing)}", file=sys.stderr)
            ok = False
        if sum(got.values()) < 50:
            print(f"chaos: ci profile: only {sum(got.values())} faults (at least 50)", file=sys.stderr)
            ok = False
    if ok and not a.keep:
        shutil.rmtree(ctx.work_root, ignore_errors=True)
    elif not ok:
        print(f"chaos: FAILED with seed {seed}; work kept in {ctx.work_root}", file=sys.stderr)
    return 0 if ok else 1


def _report_failure(r):
    print(f"chaos: FAILED scenario (rerun: tests/chaos/chaos.py --seed {r.seed} --scenario "
          f"{r.name})\n  {r.description}\n  work folder kept: {r.work}", file=sys.stderr)
    for f in r.log:
        print(f"  fault at +{f[2]:.1f}s: {f[0]}: {f[1]}", file=sys.stderr)
    for p in r.problems:
        print(f"  problem: {p}", file=sys.stderr)
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
