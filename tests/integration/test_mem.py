"""The memory tier (issue 13), trainer side, always under a real `elastic --mem-dir` with a
private segment folder under /dev/shm:

- SIGKILL of a rank: the group restores from memory (the log says so), loses at most the
  memory interval of steps (the disk interval is much larger), ends on the uninterrupted
  run's digest; the agent's flush after the failure leaves a disk snapshot newer than the
  newest one the run had written (ckpt-inspect list shows it); no segment outlives the job.
- A flipped byte in the newest memory slot's payload: found by the chunk checksums, the
  restore falls back to an older memory snapshot or to disk, digest still equal.
- A kill during a memory copy (CKPT_FAULT_POINT=mid-mem-copy@S on one rank of the first
  round only): the half-written slot is never used, the other slot (step S-1) is (C35).
- The newest tier wins (C34): memory at least as new as disk, or newer (a rank killed while
  persisting a disk snapshot from its memory copy); the log names the tier.
- Node loss (two agents on loopback, one killed with its worker): the survivor restores the
  lost node's shard from the peer replica, re-sharded to W=1, same digest.
- An explicit --mem-budget too small: exit 2 with one line naming the need and the budget,
  not retried; the default budget too small turns the tier off with one warning; a bad
  --mem-budget value is a usage error; without CKPT_MEM_PATH there is no tier (one info
  line); the flush mode's exit statuses.

Synchronisation is by log lines, never by sleeping.
"""
import json
import os
import re
import shutil
import signal
import struct
import sys
import tempfile
import time

import harness
from harness import TempDirTest
from test_elastic import Agent, FINAL_RE, procs_with

ELASTIC = harness.ELASTIC
SLOW = os.environ.get("CKPT_SANITIZED") == "1"

# the same model and batch as test_elastic's WithTrain (24 sequences per step, W=1 and W=2
# give identical bits)
TRAIN_ARGS = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
              "--global-batch", "24", "--micro-batch", "3", "--steps", "30", "--lr", "3e-3",
              "--warmup", "2", "--seed", "7", "--log-every", "1"]
RESUMED_MEM_RE = re.compile(r"\[rank 0\] .*resumed from memory \((own|replica)\) at step (\d+) "
                            r"\(run \S+, saved by \d+ ranks?\): loaded and checked in (\S+) ms")
RESUMED_DISK_RE = re.compile(r"\[rank 0\] .*resumed from \S*step-(\d+) at step (\d+) .*in (\d+) ms")

# common/shmseg.h: segment header 4096 bytes (magic, version, header_bytes, slot_bytes u64 at
# offset 16, nslots u32 at 24: 2, or 3 for a sync-mode worker's own segment); slot i's header at 4096 + i * (4096 + slot_bytes): state u32 (2 complete),
# pad u32, seq u64, payload_bytes u64, payload_xxh3 u64, step u64; its payload 4096 bytes on
SEG_HDR = 4096


def slots_of(path, building_ok=False):
    """[(slot, state, seq, payload_bytes, step, payload_offset)] of a segment file. A segment
    still being created has no magic yet (shmseg stores it last): [] with building_ok."""
    with open(path, "rb") as f:
        hdr = f.read(SEG_HDR)
        if building_ok and hdr[:8] == bytes(8):
            return []
        assert hdr[:8] == b"CKPTSEG1", (path, hdr[:8])
        slot_bytes, nslots = struct.unpack_from("<QI", hdr, 16)
        assert nslots in (2, 3), (path, nslots)
        out = []
        for i in range(nslots):
            base = SEG_HDR + i * (4096 + slot_bytes)
            f.seek(base)
            st, _, seq, pb, _, step = struct.unpack("<IIQQQQ", f.read(40))
            out.append((i, st, seq, pb, step, base + 4096))
        return out


class MemTest(TempDirTest):
    def setUp(self):
        super().setUp()
        self.marker = f"mem-test-{os.getpid()}-{self.id().split('.')[-1]}"
        self.ckpt = os.path.join(self.tmp, "ck")
        self.mem = tempfile.mkdtemp(prefix="ckpttest-", dir="/dev/shm")
        self.agents = []

    def tearDown(self):
        for a in self.agents:
            a.kill()
        deadline = time.time() + 5
        while procs_with(self.marker) and time.time() < deadline:
            time.sleep(0.05)
        for pid in procs_with(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.mem, ignore_errors=True)
        super().tearDown()

    def agent(self, args, cmd, extra_env=None):
        a = Agent(self.tmp, ["--mem-dir", self.mem] + list(args), cmd, extra_env)
        self.agents.append(a)
        return a

    def train_cmd(self, extra=(), wrap_env=None):
        """train under elastic; wrap_env: env set only for rank 1 of round 0 (through sh)."""
        argv = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + [
            "--ckpt-dir", self.ckpt, "--resume", "auto"] + list(extra)
        if not wrap_env:
            return ["/bin/sh", "-c", 'exec "$@"', self.marker] + argv
        exports = " ".join(f"{k}={v}" for k, v in wrap_env.items())
        script = (f'if [ "$ELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then export {exports}; '
                  f'fi; exec "$@"')
        return ["/bin/sh", "-c", script, self.marker] + argv

    def reference(self):
        p = harness.run([harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS, check=True)
        return harness.final(p)["digest"]

    def final(self, a):
        m = FINAL_RE.search(a.out())
        self.assertIsNotNone(m, a.out()[-2000:] + a.err()[-3000:])
        return int(m.group(1)), m.group(4)

    def segments(self):
        return sorted(os.listdir(self.mem))

    def listing(self):
        return json.loads(harness.run([harness.INSPECT, "list", self.ckpt, "--json"],
                                      check=True).stdout)["snapshots"]

    def last_step(self, a):
        steps = [int(x) for x in re.findall(r"\[rank 0\] .*step (\d+)/", a.err())]
        return steps[-1] if steps else 0

    def test_kill_rank_restores_from_memory(self):
        """SIGKILL rank 1 at step >= 16 with disk snapshots every 7 steps and memory ones every
        step: the restart restores from memory, at most 1 step behind the step rank 0 had
        logged; the flush wrote a disk snapshot newer than step 14; same digest; no segment
        left after the job."""
        self.kill_rank_restores_from_memory([])

    def test_async_kill_rank_restores_from_memory(self):
        """The same with --mem-snapshot-mode async (the default on CUDA): the memory snapshots
        are copied on the copy stream while the next step computes and committed at its
        optimizer update (a disk snapshot from the engine's own copy). A kill before that commit
        loses the slot, but rank 0 finishes no step without rank 1 past its commit of the step
        before (the parameter all-gather follows the update), so the restore is still at most 1
        step behind the step rank 0 had logged; same digest."""
        err = self.kill_rank_restores_from_memory(["--mem-snapshot-mode", "async"])
        self.assertRegex(err, r"\[rank 0\] .*memory snapshots are asynchronous")
        self.assertRegex(err, r"\[rank 0\] .*snapshot step 7 staged: .*copies from cpu queued, and "
                              r"into memory slot \d")

    def kill_rank_restores_from_memory(self, mode):
        """The kill test under the memory snapshot mode flags `mode`. Returns the first job's
        log."""
        ref = self.reference()
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                       self.train_cmd(["--ckpt-every", "7", "--mem-snapshot-every", "1"] + mode))
        a.wait_for(r"\[rank 0\] .*step 16/", timeout=120)
        pids = a.pids(0)
        self.assertEqual(len(pids), 2, a.err())
        self.assertTrue(any(s.endswith(".own-0") for s in self.segments()), self.segments())
        os.kill(pids[1], signal.SIGKILL)
        killed_at = self.last_step(a)
        self.assertEqual(a.wait(180), 0, a.err()[-4000:])
        err = a.err()
        m = RESUMED_MEM_RE.search(err)
        self.assertIsNotNone(m, err[-4000:])
        resumed = int(m.group(2))
        self.assertGreaterEqual(resumed, killed_at - 1, f"killed at {killed_at}, resumed at {resumed}")
        self.assertEqual(self.final(a), (30, ref))
        # the flush after the failure: a disk snapshot newer than 14, not on the 7-step grid
        steps = [s["step"] for s in self.listing() if s["status"] == "committed"]
        flushed = [s for s in steps if s > 14 and s % 7 and s != 30]
        self.assertTrue(flushed, f"no flushed snapshot in {steps}:\n{err[-3000:]}")
        self.assertGreaterEqual(max(flushed), killed_at - 1)
        self.assertEqual(self.segments(), [], "segments left after the job")
        # figures: the memory restore vs a disk restore of the same state (a new job: its
        # segment folder is empty, so --resume auto reads step 30 from disk)
        b = self.agent(["--nproc-per-node", "2"], self.train_cmd(["--ckpt-every", "7"]))
        self.assertEqual(b.wait(120), 0, b.err()[-3000:])
        d = RESUMED_DISK_RE.search(b.err())
        self.assertIsNotNone(d, b.err()[-3000:])
        stalls = [float(x) for x in re.findall(r"memory snapshot step \d+ in slot \d of \S+: stall (\S+) ms",
                                               err)]
        print(f"\n  {' '.join(mode) or 'sync'}: killed at step {killed_at}, resumed from memory at "
              f"{resumed} ({m.group(1)}) in {m.group(3)} ms; a disk restore of step 30 took "
              f"{d.group(3)} ms; first memory snapshot stall {stalls[0] if stalls else '?'} ms; "
              f"flushed steps {flushed}", file=sys.stderr)
        return err

    def test_flipped_byte_in_newest_slot_is_detected(self):
        """Stop both ranks, flip one payload byte (in rank 0's params shard) of the newest
        memory snapshot both segments hold, kill both: the flush and the restore find it
        corrupt by checksum and use an older memory snapshot or a disk one; same digest."""
        ref = self.reference()
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                       self.train_cmd(["--ckpt-every", "5", "--mem-snapshot-every", "1"]))
        a.wait_for(r"\[rank 0\] .*step 12/", timeout=120)
        pids = a.pids(0)
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        segs = {L: os.path.join(self.mem, s) for s in self.segments() for L in (0, 1)
                if s.endswith(f".own-{L}")}
        self.assertEqual(sorted(segs), [0, 1], self.segments())
        complete = {L: {s[4]: s for s in slots_of(segs[L]) if s[1] == 2} for L in (0, 1)}
        both = set(complete[0]) & set(complete[1])
        self.assertTrue(both, complete)
        bad_step = max(both)  # the newest memory snapshot complete on the node
        _, _, _, pbytes, _, poff = complete[0][bad_step]
        self.assertGreater(pbytes, 3 * 4096)
        with open(segs[0], "r+b") as f:
            f.seek(poff + 4096 + 123)  # in the first buffer's shard, past the payload header
            b = f.read(1)
            f.seek(poff + 4096 + 123)
            f.write(bytes([b[0] ^ 0x5A]))
        for p in reversed(pids):  # frozen: neither finishes a copy in progress
            os.kill(p, signal.SIGKILL)
        self.assertEqual(a.wait(180), 0, a.err()[-4000:])
        err = a.err()
        self.assertRegex(err, rf"memory snapshot mem:\S+/{bad_step}/2 not restored: "
                              rf".*(corrupt|mismatch|checksum)")
        m = RESUMED_MEM_RE.search(err)
        d = RESUMED_DISK_RE.search(err)
        self.assertTrue(m or d, err[-4000:])
        got = int(m.group(2)) if m else int(d.group(2))
        self.assertLess(got, bad_step, err[-3000:])
        self.assertEqual(self.final(a), (30, ref))
        self.assertEqual(self.segments(), [])
        # the flush did not write the corrupt step to disk either (unless the run saved it
        # itself later, on its 5-step grid)
        if bad_step % 5:
            self.assertNotIn(bad_step, [s["step"] for s in self.listing()])
        print(f"\n  flipped a byte of step {bad_step}'s slot: restored step {got} from "
              f"{'memory' if m else 'disk'}", file=sys.stderr)

    def test_c35_kill_during_memory_copy_uses_the_other_slot(self):
        """C35: rank 1 of round 0 dies half-way through copying step 12 into a slot: that slot
        stays 'writing' and is never used: neither the agent's flush (no disk snapshot of step
        12: the disk interval is 25) nor the restore, which takes step 11 from memory (the other
        slot); same digest."""
        self.kill_during_memory_copy([])

    def test_c35_async_kill_before_the_commit_uses_the_other_slot(self):
        """C35 with --mem-snapshot-mode async: rank 1 dies committing step 12's slot at step
        13's optimizer update, the copies and checksums done on the copy stream, the header not
        written: the slot stays 'writing' and is never used; step 11 from memory; same
        digest."""
        self.kill_during_memory_copy(["--mem-snapshot-mode", "async"])

    def test_c35_async_zero0_kill_before_the_commit_uses_the_other_slot(self):
        """C35 async at ZeRO-0, whose steps have no collective after the optimizer update: rank
        1 dies committing step 12's slot, after the moments digest; rank 0 has committed step
        12 and would begin step 13's slot over its step-11 slot at once, leaving step 12 on
        rank 0 only and step 11 on rank 1 only (no complete memory snapshot: a fresh start).
        The barrier before a memory-only snapshot keeps rank 0's step 11: step 11 from
        memory; same digest."""
        self.kill_during_memory_copy(["--mem-snapshot-mode", "async", "--zero-stage", "0"])

    def kill_during_memory_copy(self, mode):
        ref = self.reference()
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                       self.train_cmd(["--ckpt-every", "25", "--mem-snapshot-every", "1"] + mode,
                                      wrap_env={"CKPT_FAULT_POINT": "mid-mem-copy@12"}))
        self.assertEqual(a.wait(180), 0, a.err()[-4000:])
        err = a.err()
        self.assertIn("fault point mid-mem-copy reached at step 12", err)
        m = RESUMED_MEM_RE.search(err)
        self.assertIsNotNone(m, err[-4000:])
        self.assertEqual(int(m.group(2)), 11, err[-3000:])
        self.assertNotRegex(err, r"resumed from \S* ?\S*at step 12 ")
        self.assertEqual(self.final(a), (30, ref))
        self.assertEqual(self.segments(), [])
        steps = [x["step"] for x in self.listing()]
        self.assertNotIn(12, steps, "the half-written step reached the disk")
        self.assertIn(11, steps, "the flush wrote the newest complete memory snapshot")

    def test_sync_third_slot_keeps_the_step_before_a_kill_during_a_long_persist(self):
        """Sync mode (the CPU default): a disk persist reads its step's slot for as long as it
        lasts. Rank 1's data writes take 20 s each (CKPT_FAULT_STORE=slow:20000, a stalled
        disk), so its persist of step 10 lasts past step 13, and rank 1 dies half-way through
        the memory copy of step 13. With three slots the copies of steps 11..13 alternate
        between the two slots the persist does not read, so step 12 is still complete beside
        step 10 (with two, every copy rewrote the one other slot and only step 10 survived):
        the flush writes step 12 to disk and the restart resumes from step 12; same digest."""
        ref = self.reference()
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                       self.train_cmd(["--ckpt-every", "10", "--mem-snapshot-every", "1",
                                       "--mem-budget", "1G"],
                                      wrap_env={"CKPT_FAULT_STORE": "slow:20000",
                                                "CKPT_FAULT_POINT": "mid-mem-copy@13"}))
        self.assertEqual(a.wait(180), 0, a.err()[-4000:])
        err = a.err()
        self.assertRegex(err, r"\[rank 0\] .*memory tier: a snapshot every 1 step into \S+ \(3 slots each\)")
        self.assertNotIn("two slots per segment, not three", err)
        self.assertIn("fault point mid-mem-copy reached at step 13", err)
        self.assertNotRegex(err, r"\[rank 1\] .*snapshot step 10 committed", "the persist was not slow")
        self.assertRegex(err, r"flushed the memory snapshot of step 12 ")
        m = RESUMED_MEM_RE.search(err)
        d = RESUMED_DISK_RE.search(err)
        self.assertTrue(m or d, err[-4000:])
        self.assertEqual(int((m or d).group(2)), 12, err[-3000:])
        self.assertEqual(self.final(a), (30, ref))
        self.assertEqual(self.segments(), [])
        steps = [x["step"] for x in self.listing() if x["status"] == "committed"]
        self.assertIn(12, steps)
        self.assertNotIn(13, steps, "the half-written step reached the disk")
        print(f"\n  slow disk on rank 1, killed copying step 13: resumed at step 12 from "
              f"{'memory' if m else 'disk (the flush)'}; disk holds {steps}", file=sys.stderr)

    def test_budget_for_two_slots_only(self):
        """Sync mode with a --mem-budget that holds two slots per segment but not three: one
        warning that names the budget three need, segments of two slots, training goes on and
        resumes from memory; with that budget, three slots and no warning."""
        base = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + [
            "--steps", "3", "--ckpt-dir", self.ckpt, "--ckpt-every", "0", "--mem-snapshot-every", "1"]
        env = {"CKPT_MEM_PATH": os.path.join(self.mem, "ckptmem-byhand")}
        seg = os.path.join(self.mem, "ckptmem-byhand.own-0")
        p = harness.run(base + ["--mem-budget", "64K"], extra_env=env)
        self.assertEqual(p.returncode, 2, p.stderr[-2000:])
        need2 = int(re.search(r"it needs (\d+) bytes", p.stderr).group(1))
        slot_bytes = (need2 - 4096) // 2 - 4096  # one local rank: 4096 + 2 x (4096 + slot)
        need3 = 4096 + 3 * (4096 + slot_bytes)
        p = harness.run(base + ["--mem-budget", str(need2)], extra_env=env, check=True)
        warn = re.findall(r"WARN .*memory tier: two slots per segment, not three: .*give "
                          r"--mem-budget (\d+) or more for the third slot", p.stderr)
        self.assertEqual(warn, [str(need3)], p.stderr[-2000:])
        self.assertIn("(2 slots each)", p.stderr)
        self.assertEqual(os.path.getsize(seg), need2)
        self.assertEqual(sorted(x[4] for x in slots_of(seg) if x[1] == 2), [2, 3])
        p = harness.run(base + ["--mem-budget", str(need3), "--steps", "6", "--resume", "auto"],
                        extra_env=env, check=True)
        self.assertRegex(p.stderr, r"resumed from memory \(own\) at step 3 ")
        self.assertNotIn("two slots per segment", p.stderr)
        self.assertIn("(3 slots each)", p.stderr)
        self.assertEqual(os.path.getsize(seg), need3)
        self.assertEqual(len(slots_of(seg)), 3)  # rebuilt with three after the resume read it
        self.assertEqual(sorted(x[4] for x in slots_of(seg) if x[1] == 2), [4, 5, 6])

    def test_c34_newest_tier_wins_and_the_log_names_it(self):
        """C34, both orders, memory snapshots every 10 steps. (a) Disk every 3: rank 1 is
        SIGKILLed as soon as step 12 is committed on disk. Disk snapshots are persisted from a
        memory copy of the same step, so memory holds 12 too (not only 10): the restore takes
        a step at least as new as the newest on disk, and the log names the tier and why the
        other lost (the flush: memory 'not newer than' disk; or memory 'older than the newest
        on disk'). A memory copy strictly older than disk is what a restarted agent finds:
        test_mem_agent test_stale_segments_of_a_dead_agent_of_this_job_are_removed. (b) Memory
        newer than disk (disk every 7): rank 1 dies writing its shard of step 21
        (before-chunk-write@21), after the memory copy of step 21 that disk snapshot persists
        from: disk holds 14 and memory 21: the restore is from memory at step 21, 'resumed
        from memory (own)'. Same digest in both."""
        ref = self.reference()
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                       self.train_cmd(["--ckpt-every", "3", "--mem-snapshot-every", "10",
                                       "--mem-budget", "1G"]))
        a.wait_for(r"\[rank 0\] .*snapshot step 12 committed", timeout=120)
        os.kill(a.pids(0)[1], signal.SIGKILL)
        committed = [int(x) for x in re.findall(r"\[rank 0\] .*snapshot step (\d+) committed", a.err())]
        self.assertEqual(a.wait(180), 0, a.err()[-4000:])
        err = a.err()
        m = RESUMED_MEM_RE.search(err)
        d = RESUMED_DISK_RE.search(err)
        self.assertTrue(m or d, err[-4000:])
        got = int((m or d).group(2))
        self.assertGreaterEqual(got, max(committed), "an older tier won:\n" + err[-3000:])
        if m:  # disk snapshots persist from the memory copy: the newest disk step is in memory
            # Either the kill came before the next disk step was staged (memory is not newer
            # than disk: nothing to flush) or during its persist (on a loaded machine the
            # training runs ahead of the test's kill: memory holds a newer step than disk, and
            # the flush writes it to disk first); either way the newest step wins.
            self.assertRegex(err, rf"(nothing to flush: the newest memory snapshot \(step {got}\) "
                                  r"is not newer than the newest committed snapshot in \S+ "
                                  rf"\(step-{got:09d}|flushed the memory snapshot of step {got} )")
        else:
            self.assertRegex(err, r"memory snapshot \S+: older than the newest on disk or S3 "
                                  rf"\(step {got}\); not used")
        self.assertEqual(self.final(a), (30, ref))
        # (b)
        shutil.rmtree(self.ckpt)
        b = self.agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                       self.train_cmd(["--ckpt-every", "7", "--mem-snapshot-every", "10",
                                       "--mem-budget", "1G"],
                                      wrap_env={"CKPT_FAULT_POINT": "before-chunk-write@21"}))
        self.assertEqual(b.wait(180), 0, b.err()[-4000:])
        err = b.err()
        self.assertIn("fault point before-chunk-write reached at step 21", err)
        m = RESUMED_MEM_RE.search(err)
        self.assertIsNotNone(m, err[-4000:])
        self.assertEqual((m.group(1), int(m.group(2))), ("own", 21), err[-3000:])
        self.assertIsNone(RESUMED_DISK_RE.search(err), "disk (step 14) restored over memory")
        self.assertEqual(self.final(b), (30, ref))
        print(f"\n  (a) step {got} from {'memory' if m else 'disk'}; (b) memory 21 over disk 14", file=sys.stderr)

    def test_c34_memory_older_than_a_corrupt_newest_disk_snapshot(self):
        """C34, the newest snapshot corrupt in both tiers: memory snapshots every 10 steps and
        at every disk step, disk every 7, so the slots hold steps 20 and 21 from step 21 to 27;
        rank 0 is SIGKILLed right after it renamed step 21 into place (after-rename@21, during
        step 22 or 23), and before round 1 starts one byte is flipped in step 21's rank-0 data
        file and in rank 0's memory slot of step 21. Memory 21 is corrupt, so is disk 21 (set
        aside); then memory step 20 wins over disk step 14: the newest complete, verified step
        of any tier, even one older than the newest disk snapshot. Same digest."""
        ref = self.reference()
        flipped = os.path.join(self.tmp, "flipped")
        data = os.path.join(self.ckpt, "step-000000021", "rank-00000.bin")
        flip = os.path.join(self.tmp, "flip.py")
        with open(flip, "w") as f:
            f.write(f"""import os, struct, sys
def flip(path, off):
    with open(path, "r+b") as f:
        f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0x10]))
flip({data!r}, os.path.getsize({data!r}) // 2)
seg = os.environ["CKPT_MEM_PATH"] + ".own-0"
with open(seg, "rb") as f:
    hdr = f.read({SEG_HDR})
slot_bytes, = struct.unpack_from("<Q", hdr, 16)
for i in range(2):
    base = {SEG_HDR} + i * (4096 + slot_bytes)
    with open(seg, "rb") as f:
        f.seek(base); st, _, seq, pb, _, step = struct.unpack("<IIQQQQ", f.read(40))
    if st == 2 and step == 21:
        flip(seg, base + 4096 + 4096 + 123)
        open({flipped!r}, "w").close()
""")
        argv = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + [
            "--ckpt-dir", self.ckpt, "--resume", "auto", "--ckpt-every", "7",
            "--mem-snapshot-every", "10", "--mem-budget", "1G"]
        script = (f'if [ "$ELASTIC_RESTART_COUNT" = 0 ]; then '
                  f'[ "$RANK" = 0 ] && export CKPT_FAULT_POINT=after-rename@21; '
                  f'elif [ "$RANK" = 0 ] && [ -z "$CKPT_MEM_FLUSH" ] && [ ! -e {flipped} ]; then '
                  f'python3 {flip} || exit 97; fi; exec "$@"')
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                       ["/bin/sh", "-c", script, self.marker] + argv)
        self.assertEqual(a.wait(180), 0, a.err()[-4000:])
        err = a.err()
        self.assertIn("fault point after-rename reached at step 21", err)
        self.assertTrue(os.path.exists(flipped), "no complete slot of step 21:\n" + err[-3000:])
        self.assertRegex(err, r"memory snapshot mem:\S+/21/2 not restored")
        self.assertRegex(err, r"skipping corrupt snapshot \S*step-000000021")
        m = RESUMED_MEM_RE.search(err)
        self.assertIsNotNone(m, "memory step 20 not restored:\n" + err[-4000:])
        self.assertEqual(int(m.group(2)), 20, err[-3000:])
        self.assertIsNone(RESUMED_DISK_RE.search(err), "an older disk snapshot won:\n" + err[-3000:])
        self.assertEqual(self.final(a), (30, ref))

    def test_memory_interval(self):
        """--mem-snapshot-every 4 with an explicit budget that fits (1G): the restore is from a
        step on that grid, at most 4 steps behind; same digest."""
        ref = self.reference()
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                       self.train_cmd(["--ckpt-every", "25", "--mem-snapshot-every", "4",
                                       "--mem-budget", "1G"]))
        a.wait_for(r"\[rank 0\] .*step 14/", timeout=120)
        pids = a.pids(0)
        os.kill(pids[0], signal.SIGKILL)
        killed_at = self.last_step(a)
        self.assertEqual(a.wait(180), 0, a.err()[-4000:])
        self.assertRegex(a.err(), r"memory tier: a snapshot every 4 steps into \S+ \(3 slots each\), \S+ \S+ per "
                                  r"node of a budget of 1\.0 GiB\n")
        m = RESUMED_MEM_RE.search(a.err())
        self.assertIsNotNone(m, a.err()[-4000:])
        resumed = int(m.group(2))
        self.assertEqual(resumed % 4, 0)
        self.assertGreaterEqual(resumed, killed_at - 4)
        self.assertEqual(self.final(a), (30, ref))

    def test_node_loss_restores_from_the_peer_replica(self):
        """Two agents on loopback (--nnodes 1:2, one rank each, their own segment folders);
        SIGKILL of agent B and its worker: A goes on alone (W=1) and restores B's shard from the
        replica B sent it (memory (replica), saved by 2 ranks, re-sharded); the digest is the
        uninterrupted run's (24 sequences per step: W=2 and W=1 give the same bits)."""
        ref = self.reference()
        mem_b = tempfile.mkdtemp(prefix="ckpttest-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, mem_b, True)
        port = harness.free_port()

        def node(mem, name):
            args = ["--mem-dir", mem, "--nnodes", "1:2", "--nproc-per-node", "1",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "memjob",
                    "--heartbeat-timeout", "2", "--last-call", "3", "--stop-grace", "3"]
            # memory snapshots every 4 steps: the replica (polled every 100 ms) keeps up
            x = Agent(self.tmp, args, self.train_cmd(["--ckpt-every", "25",
                                                      "--mem-snapshot-every", "4"]), name=name)
            self.agents.append(x)
            return x

        a = node(self.mem, "A")
        a.wait_for(r"hosting the rendezvous store")
        b = node(mem_b, "B")
        for x in (a, b):
            x.wait_for(r"round 0: node \d of 2", timeout=60)
        deadline = time.time() + 120
        rep = []
        while time.time() < deadline:
            rep = [os.path.join(self.mem, s) for s in self.segments() if ".rep-" in s]
            steps = [sl[4] for sl in slots_of(rep[0], True) if sl[1] == 2] if rep else []
            if steps and max(steps) >= 8:
                break
            time.sleep(0.05)
        self.assertTrue(rep, f"no replica in A's folder: {self.segments()}\n{a.err()[-2000:]}")
        wpid = b.pids(0)
        b.p.kill()  # the node: its agent and its worker
        b.p.wait()
        for p in wpid:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        self.assertEqual(a.wait(180), 0, a.err()[-4000:])
        err = a.err()
        m = RESUMED_MEM_RE.search(err)
        self.assertIsNotNone(m, err[-4000:])
        self.assertEqual(m.group(1), "replica", m.group(0))
        self.assertRegex(m.group(0), r"saved by 2 ranks")
        self.assertRegex(err, r"re-sharding: the snapshot was saved by 2 ranks, this run has 1")
        self.assertEqual(self.final(a), (30, ref))
        self.assertEqual(self.segments(), [])
        print(f"\n  node lost: restored step {m.group(2)} from the peer replica in {m.group(3)} ms",
              file=sys.stderr)

    def test_explicit_budget_too_small(self):
        """--mem-budget 64K cannot hold two slots of the state: exit 2 before the first step,
        one line per node naming the need and the budget, not retried; nothing left."""
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "3"],
                       self.train_cmd(["--ckpt-every", "5", "--mem-budget", "64K"]))
        self.assertEqual(a.wait(60), 2, a.err()[-3000:])
        err = a.err()
        lines = re.findall(r".*--mem-budget 65536 \(64\.0 KiB\) is too small for the memory tier: "
                           r"it needs (\d+) bytes .*", err)
        self.assertEqual(len(lines), 1, err[-3000:])
        self.assertGreater(int(lines[0]), 65536)
        self.assertNotRegex(err, r"rank \d+: rank \d+:")  # the logger prefixes the rank once
        self.assertIn("a usage or configuration error, not restarting", err)
        self.assertNotRegex(err, r"step 1/")
        self.assertEqual(self.segments(), [])

    def test_budget_values_and_no_tier_without_elastic(self):
        """A malformed --mem-budget is a usage error (2, one line); suffixes are accepted;
        without CKPT_MEM_PATH train says once that there is no memory tier and trains."""
        base = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + ["--steps", "2"]
        for bad in ["12Q", "0", "-1", "G", "99999999999T", " 1G", "1G ", "+1G", "\t1G"]:
            p = harness.run(base + ["--mem-budget", bad])
            self.assertEqual(p.returncode, 2, (bad, p.stderr))
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
            self.assertIn("--mem-budget", p.stderr)
        for good in ["512m", "1g", "1GiB", "64k"]:  # either case, documented
            p = harness.run(base + ["--mem-budget", good, "--steps", "1"], extra_env={"CKPT_MEM_PATH": ""})
            self.assertEqual(p.returncode, 0, (good, p.stderr[-2000:]))
        p = harness.run(base + ["--mem-budget", "512M", "--mem-snapshot-every", "1"],
                        extra_env={"CKPT_MEM_PATH": ""})
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertEqual(p.stderr.count("no memory tier: CKPT_MEM_PATH is not set"), 1, p.stderr)
        self.assertIsNotNone(harness.FINAL_RE.search(p.stdout))


    def test_async_memory_only_commits_the_last_step(self):
        """--mem-snapshot-mode async without disk snapshots (--ckpt-every 0, train by hand with
        CKPT_MEM_PATH): every step's slot is committed, the last one before the exit; a second
        run resumes from memory at the last step with the uninterrupted run's digest; a bad
        mode is a usage error (2, one line)."""
        base = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + [
            "--steps", "6", "--ckpt-dir", self.ckpt, "--ckpt-every", "0"]
        env = {"CKPT_MEM_PATH": os.path.join(self.mem, "ckptmem-byhand")}
        p = harness.run(base + ["--mem-snapshot-mode", "fast"], extra_env=env)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertEqual(p.stderr.strip().splitlines(), [
            "train: --mem-snapshot-mode: 'fast' is not sync or async"])
        p = harness.run(base + ["--mem-snapshot-mode", "async"], extra_env=env, check=True)
        self.assertIn("memory snapshots are asynchronous", p.stderr)
        self.assertIn("memory snapshots: 6 taken", p.stderr)
        first = harness.final(p)["digest"]
        complete = sorted(x[4] for x in slots_of(os.path.join(self.mem, "ckptmem-byhand.own-0"))
                          if x[1] == 2)
        self.assertEqual(complete, [5, 6])
        p = harness.run(base + ["--resume", "auto"], extra_env=env, check=True)
        self.assertRegex(p.stderr, r"resumed from memory \(own\) at step 6 ")
        self.assertEqual(harness.final(p)["digest"], first)
        ref = harness.run([harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + ["--steps", "6"],
                          check=True)
        self.assertEqual(first, harness.final(ref)["digest"])

    def test_default_budget_too_small_turns_the_tier_off(self):
        """No --mem-budget and a node whose need exceeds half the free space of the segment
        folder (LOCAL_WORLD_SIZE as a launcher of 20000 local ranks would set it): one warning,
        no segment, and training goes on with disk snapshots only (exit 0)."""
        base = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + ["--steps", "3"]
        p = harness.run(base + ["--ckpt-dir", self.ckpt, "--ckpt-every", "3"],
                        extra_env={"CKPT_MEM_PATH": os.path.join(self.mem, "p"), "LOCAL_RANK": "0",
                                   "LOCAL_WORLD_SIZE": "20000"})
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        warn = re.findall(r"WARN .*memory tier off: it needs (\S+ \S+) per node \(20000 local "
                          r"ranks x .*more than the default budget of .*", p.stderr)
        self.assertEqual(len(warn), 1, p.stderr[-2000:])
        self.assertNotIn("memory snapshot step", p.stderr)
        self.assertEqual(self.segments(), [])
        self.assertEqual(harness.snapshot_dirs(self.ckpt), ["step-000000003"])

    def test_segment_refused_disk_snapshots_go_on(self):
        """The segment cannot be made (its name is a link: shmseg refuses it) in sync mode with
        disk snapshots: one warning, then every disk snapshot through the fallback path (the
        device stager without a memory copy) commits, exit 0, and the weights are those of a
        run without the memory tier. Once a silent exit 1 after the first disk snapshot: the
        fallback has no trainer record, which the copies' wait took for a failed encoding."""
        base = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + ["--steps", "8"]
        os.symlink("/dev/null", os.path.join(self.mem, "p.own-0"))
        p = harness.run(base + ["--ckpt-dir", self.ckpt, "--ckpt-every", "3",
                                "--mem-snapshot-mode", "sync"],
                        extra_env={"CKPT_MEM_PATH": os.path.join(self.mem, "p"), "LOCAL_RANK": "0"})
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertEqual(len(re.findall(r"no memory snapshots on this rank", p.stderr)), 1,
                         p.stderr[-2000:])
        self.assertNotRegex(p.stderr, r"memory snapshot step \d+ in slot")
        self.assertEqual(harness.snapshot_dirs(self.ckpt),
                         ["step-000000003", "step-000000006", "step-000000008"])
        self.assertTrue(os.path.islink(os.path.join(self.mem, "p.own-0")))
        ref = harness.run(base, check=True)
        self.assertEqual(harness.final(p)["digest"], harness.final(ref)["digest"])

    def test_unusable_prefix_is_a_usage_error(self):
        """A CKPT_MEM_PATH the readers refuse ('/', a folder with a trailing '/', too long) is
        refused at start by the writer too: exit 2 with one line naming CKPT_MEM_PATH, before
        any segment (no hidden '.own-0' that nobody lists or removes); the flush mode too."""
        base = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS + ["--steps", "2"]
        for hidden in ["/.own-0", "/dev/shm/.own-0"]:
            if not os.path.exists(hidden):
                self.addCleanup(lambda h=hidden: os.path.exists(h) and os.unlink(h))
        for mp in [self.mem + "/", "/", "/dev/shm/", os.path.join(self.mem, "a" * 4100)]:
            for env in [{}, {"CKPT_MEM_FLUSH": "1"}]:
                p = harness.run(base + ["--ckpt-dir", self.ckpt, "--mem-snapshot-every", "1"],
                                extra_env=dict(env, CKPT_MEM_PATH=mp, LOCAL_RANK="0"))
                self.assertEqual((p.returncode, len(p.stderr.strip().splitlines())), (2, 1),
                                 (mp[:80], env, p.stderr[-2000:]))
                self.assertIn("CKPT_MEM_PATH", p.stderr)
                self.assertLess(len(p.stderr), 600)
                self.assertNotIn("Invalid argument", p.stderr)
            self.assertEqual(self.segments(), [], mp[:80])
        self.assertFalse(os.path.exists("/dev/shm/.own-0"))
        self.assertFalse(os.path.exists("/.own-0"))

    def test_second_writer_of_a_segment(self):
        """Two trains with the same CKPT_MEM_PATH and LOCAL_RANK: the first holds its segment
        (shmseg_create's flock); the second says so in one line and trains without its memory
        copy (exit 0, no memory snapshot); the first's slots are untouched by it."""
        import subprocess
        base = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS
        env = {"CKPT_MEM_PATH": os.path.join(self.mem, "p"), "LOCAL_RANK": "0"}
        first = subprocess.Popen(base + ["--steps", "100000", "--mem-snapshot-every", "1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                 env=harness.env(env))
        self.addCleanup(lambda: (first.kill(), first.wait(), first.stderr.close()))
        deadline = time.time() + 60
        line = ""
        while "memory snapshot step" not in line and time.time() < deadline:
            line = first.stderr.readline()
            self.assertTrue(line or first.poll() is None, "the first train ended")
        self.assertIn("memory snapshot step", line)
        p = harness.run(base + ["--steps", "3", "--mem-snapshot-every", "1"], extra_env=env)
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertEqual(len(re.findall(r"another process writes the segment \S+\.own-0", p.stderr)), 1,
                         p.stderr[-2000:])
        self.assertNotRegex(p.stderr, r"memory snapshot step \d+ in slot")
        self.assertIsNone(first.poll())
        self.assertEqual(self.segments(), ["p.own-0"])
        steps = [sl[4] for sl in slots_of(os.path.join(self.mem, "p.own-0")) if sl[1] == 2]
        self.assertTrue(steps and min(steps) > 0, steps)

    def test_default_budget_counts_the_own_segments(self):
        """A segment folder with room for the tier once (a 6500K tmpfs: half is just over the
        2.9 MiB two local ranks need) and no --mem-budget: after SIGKILL of rank 1 the next
        round measures its own reusable segments as available, keeps the tier on and restores
        from memory (it used to say 'memory tier off: ... more than the default budget')."""
        import subprocess
        if os.geteuid() != 0:
            self.skipTest("mounting a tmpfs needs root")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6500k,mode=0700", "tmpfs", self.mem],
                           capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest(f"cannot mount a tmpfs: {r.stderr.strip()}")
        # cleanups run last first: unmount, then remove the folder (tearDown's rmtree cannot
        # remove a mount point; it only empties it)
        self.addCleanup(shutil.rmtree, self.mem, True)
        self.addCleanup(subprocess.run, ["umount", "-l", self.mem], capture_output=True)
        ref = self.reference()
        a = self.agent(["--nproc-per-node", "2", "--max-restarts", "2"],
                       self.train_cmd(["--ckpt-every", "25", "--mem-snapshot-every", "1"]))
        a.wait_for(r"\[rank 0\] .*step 10/", timeout=120)
        self.assertIn("memory tier: a snapshot every 1 step", a.err())
        pids = a.pids(0)
        self.assertEqual(len(pids), 2, a.err())
        os.kill(pids[1], signal.SIGKILL)
        self.assertEqual(a.wait(180), 0, a.err()[-4000:])
        err = a.err()
        self.assertNotIn("memory tier off", err)
        self.assertEqual(err.count("memory tier: a snapshot every 1 step"), 2, err[-4000:])
        self.assertIsNotNone(RESUMED_MEM_RE.search(err), err[-4000:])
        self.assertEqual(self.final(a), (30, ref))

    def test_flush_checks_what_a_restore_checks(self):
        """The flush commits only a memory snapshot that the restore would accept: one whose
        trainer record is not this job's (another seed, model or data) is logged and skipped,
        never written; with the job's own flags it is flushed and restorable."""
        base = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS
        mp = os.path.join(self.mem, "p")
        env = {"CKPT_MEM_PATH": mp, "LOCAL_RANK": "0"}
        harness.run(base + ["--steps", "5", "--mem-snapshot-every", "1"], extra_env=env, check=True)
        flush = dict(env, CKPT_MEM_FLUSH="1")
        val = os.path.join(harness.DATA, "val_*.bin")
        for flags, why in [(["--seed", "8"], "seed differs"),
                           (["--n-layer", "1"], "model configuration differs"),
                           (["--data", val], "training data differs")]:
            p = harness.run(base + ["--ckpt-dir", self.ckpt] + flags, extra_env=flush)
            self.assertNotEqual(p.returncode, 0, (flags, p.stderr))
            self.assertIn(why, p.stderr, flags)
            self.assertRegex(p.stderr, r"mem:\S+/5/1 not flushed: .*rejected", flags)
            self.assertEqual(harness.snapshot_dirs(self.ckpt), [], (flags, p.stderr))
        # forged and resealed (every checksum holds): a record of step 12 in a slot that
        # says step 29; params and adam_m swapped by name. The flush must skip both.
        tool = os.environ.get("CKPT_SHMSEG_TOOL", os.path.join(harness.BUILD, "tests", "shmseg-tool"))
        forged = os.path.join(self.mem, "f")
        fenv = {"CKPT_MEM_PATH": forged, "LOCAL_RANK": "0"}
        for forge, why in [(["step", "29"], r"trainer record is inconsistent: step 12 .* snapshot of step 29"),
                           (["swap"], r"params digest \S+ differs from the recorded")]:
            shutil.rmtree(self.ckpt, ignore_errors=True)
            for f in os.listdir(self.mem):
                if f.startswith("f."):
                    os.unlink(os.path.join(self.mem, f))
            harness.run(base + ["--steps", "12", "--mem-snapshot-every", "12"], extra_env=fenv, check=True)
            harness.run([tool, "forge", forged + ".own-0"] + forge, check=True)
            p = harness.run(base + ["--ckpt-dir", self.ckpt], extra_env=dict(fenv, CKPT_MEM_FLUSH="1"))
            self.assertNotEqual(p.returncode, 0, (forge, p.stderr))
            self.assertRegex(p.stderr, r"not flushed: .*rejected by the caller's check: " + why, forge)
            self.assertEqual(harness.snapshot_dirs(self.ckpt) if os.path.isdir(self.ckpt) else [], [],
                             (forge, p.stderr))
        p = harness.run(base + ["--ckpt-dir", self.ckpt], extra_env=flush)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(harness.snapshot_dirs(self.ckpt), ["step-000000005"], p.stderr)
        p = harness.run(base + ["--ckpt-dir", self.ckpt, "--resume", "auto", "--steps", "6"],
                        extra_env={"CKPT_MEM_PATH": ""})
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertRegex(p.stderr, r"resumed from \S+step-000000005 at step 5")

    def test_flush_mode_exit_statuses(self):
        """CKPT_MEM_FLUSH=1 (what the agent runs): one line and 2 without CKPT_MEM_PATH, 0 when
        there is nothing to flush, 1 when the flush fails (a --ckpt-dir that is a file)."""
        base = [harness.TRAIN] + harness.data_args()[:2] + TRAIN_ARGS
        f = {"CKPT_MEM_FLUSH": "1"}
        p = harness.run(base + ["--ckpt-dir", self.ckpt], extra_env=dict(f, CKPT_MEM_PATH=""))
        self.assertEqual((p.returncode, len(p.stderr.strip().splitlines())), (2, 1), p.stderr)
        self.assertIn("CKPT_MEM_PATH is not set", p.stderr)
        mp = os.path.join(self.mem, "p")
        p = harness.run(base + ["--ckpt-dir", self.ckpt], extra_env=dict(f, CKPT_MEM_PATH=mp))
        self.assertEqual((p.returncode, len(p.stderr.strip().splitlines())), (0, 1), p.stderr)
        self.assertIn("nothing to do", p.stderr)
        self.assertEqual(harness.snapshot_dirs(self.ckpt), [])
        file = os.path.join(self.tmp, "file")
        open(file, "w").close()
        p = harness.run(base + ["--ckpt-dir", file], extra_env=dict(f, CKPT_MEM_PATH=mp))
        self.assertEqual((p.returncode, len(p.stderr.strip().splitlines())), (1, 1), p.stderr)
        self.assertRegex(p.stderr, r"flush of \S+ into \S+ failed: .*Not a directory")
        # any value but unset, "", "0" and "1" is a usage error, never a full training run
        for v in ["2", "yes", "true", " 1"]:
            p = harness.run(base + ["--ckpt-dir", self.ckpt, "--steps", "2"],
                            extra_env={"CKPT_MEM_FLUSH": v, "CKPT_MEM_PATH": mp})
            self.assertEqual((p.returncode, len(p.stderr.strip().splitlines())), (2, 1), (v, p.stderr))
            self.assertIn("CKPT_MEM_FLUSH", p.stderr)
            self.assertIsNone(harness.FINAL_RE.search(p.stdout), v)
        self.assertEqual(harness.snapshot_dirs(self.ckpt), [])

if __name__ == "__main__":
    harness.main()
