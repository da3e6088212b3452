"""S3 faults and corruption of every tier (the "io" kinds of tests/chaos/CONTRACT.md).

Injectors `inject(job) -> str | None` in KINDS, their requirements in NEEDS:

  s3_kill_restart  SIGKILL radosgw (the shared RGW's, job.s3.rgw.kill_rgw()) while an upload
                   is likely in flight (right after the proxy saw a data-object PUT, waited for
                   at most UPLOAD_WAIT_S), restart it 1-5 s later from a background thread
                   (rgw.start_rgw()). finish(job) joins that thread and makes sure radosgw runs.
  s3_hang          proxy rule "hang" on the job's PUTs, for a count of requests or a few seconds
                   (each hung request lasts until the client's --s3-timeout).
  s3_503           proxy rule "status:503:SlowDown" on some PUTs (a count or a few seconds),
                   possibly only on some ranks' data objects.
  flip_local       one byte XORed in a data file of a committed local snapshot that is not
  truncate_local   the newest / the data file one byte shorter (every byte of a data file
                   belongs to a chunk: no padding, FORMAT.md), fsynced.
  flip_s3          the same to a data object of a complete uploaded snapshot (its manifest
  truncate_s3      object exists), through job.s3.client straight to RGW (get + put).
  flip_memory      SIGSTOP one node's workers, XOR one byte inside a checksummed region of a
                   complete slot's payload (of the newest step complete in every own segment
                   of that node, under the agents' CKPT_MEM_PATH prefix) and SIGKILL the
                   workers: the next resume must meet the damaged slot (a slot is rewritten
                   every memory interval, so an unflushed flip would be overwritten unseen).

Which snapshot a corruption hits, and what a restore must then do (DESIGN I1):
  - local: the second newest committed snapshot most of the time (the one a disk restore
    falls back to when the newest is lost or set aside), else an older one; with --s3 only a
    step whose upload is complete (its manifest object exists), so that the uploader never
    copies the damage. A restore that meets it sets it aside (step-N.corrupt-<unix>) and
    uses the S3 copy of the same step, or an older snapshot.
  - s3: the S3 copy of a step already damaged locally when there is one (both copies bad:
    the restore must go older), else the newest complete one (what a restore after a lost
    disk picks), else an older one. A restore marks it corrupt and goes on; a re-save may
    replace it.
  - memory: the restore and the agent's flush find it by checksum, log
    "memory snapshot mem:.../S/W not restored|not flushed" or "memory slot ... (step S) is
    corrupt", and use the other slot, disk or S3; the damaged slot is never restored.

Everything injected is recorded in job.corrupted[tier] as (step, what) and, with what the
checks need to recognise it later (the damaged bytes' hash, the folder's inode, the log
offsets at injection), in this module's state on the job; verify_expectations(job) turns
that into problem lines. Python standard library only.
"""
import hashlib
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import s3env  # noqa: E402

UPLOAD_WAIT_S = 4.0      # s3_kill_restart: how long to wait for a PUT of a data object
RESTART_MIN_S, RESTART_MAX_S = 1.0, 5.0
JOIN_TIMEOUT_S = 90.0    # finish(): bound for the restart thread (start_rgw has its own)
VERIFY_TIMEOUT_S = 120.0

STEP_DIR_RE = re.compile(r"^step-(\d{9,})$")
DATA_RE = re.compile(r"^rank-\d{5,}\.bin(\.part-\d{5})?$")

# common/shmseg.h, docs/FORMAT.md "Memory tier"
SEG_HDR = 4096
SLOT_HDR = 4096
PAYLOAD_HDR = 4096
SLOT_COMPLETE = 2


# ---------------------------------------------------------------------------------------
# per-job state of this module


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.threads = []        # s3_kill_restart's restart threads
        self.errors = []         # what a restart thread could not do
        self.rules = []          # proxy rules added (cleared by finish)
        self.damage = []         # dicts: tier, step, what, ... (see the injectors)


def _state(job):
    st = getattr(job, "_faults_io", None)
    if st is None:
        st = _State()
        job._faults_io = st
    return st


def _corrupted(job, tier, step, what):
    c = getattr(job, "corrupted", None)
    if c is None:
        c = job.corrupted = {}
    c.setdefault(tier, set()).add((step, what))


def _log_sizes(job):
    out = {}
    for n in getattr(job, "nodes", []):
        try:
            out[n.log_path] = os.path.getsize(n.log_path)
        except OSError:
            out[n.log_path] = 0
    return out


def _log_after(job, sizes):
    """Every node's stderr written after the offsets in sizes (whole logs of nodes added
    since), concatenated."""
    parts = []
    for n in getattr(job, "nodes", []):
        try:
            with open(n.log_path, "rb") as f:
                f.seek(sizes.get(n.log_path, 0))
                parts.append(f.read().decode("utf-8", "replace"))
        except OSError:
            pass
    return "\n".join(parts)


def _sha(data):
    return hashlib.sha256(data).hexdigest()


def _file_sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# S3 faults


def _job_path(job):
    """The URL-decoded path prefix of the job's objects as the proxy sees them."""
    return f"/{job.s3.bucket}/{job.s3.prefix.strip('/')}/"


def s3_kill_restart(job):
    s3 = job.s3
    if s3 is None:
        return None
    st = _state(job)
    with st.lock:
        if any(t.is_alive() for t in st.threads):
            return None  # the previous kill's restart is still pending
    if not s3.rgw.rgw_running():
        return None
    # wait (bounded) for a PUT of a data object: the upload of a snapshot is then in flight
    # (data objects first, the manifest last); kill a random few ms after it was seen
    base = job_puts = len(_data_puts(job))
    deadline = time.monotonic() + UPLOAD_WAIT_S
    while time.monotonic() < deadline:
        job_puts = len(_data_puts(job))
        if job_puts > base:
            break
        time.sleep(0.005)
    seen = job_puts > base
    if seen:
        time.sleep(job.rnd.uniform(0.0, 0.05))
    after_s = job.rnd.uniform(RESTART_MIN_S, RESTART_MAX_S)
    s3.rgw.kill_rgw()
    t = threading.Thread(target=_restart_later, args=(job, st, after_s), name="s3-restart", daemon=True)
    with st.lock:
        st.threads.append(t)
    t.start()
    return (f"radosgw SIGKILLed {'with a data-object PUT in flight' if seen else 'with no upload seen in flight'}"
            f" ({job_puts} data-object PUTs so far); restart in {after_s:.1f} s")


def _data_puts(job):
    prefix = _job_path(job)
    with job.s3.proxy.lock:
        return [e for e in job.s3.proxy.events
                if e["method"] == "PUT" and e["target"].startswith(prefix) and "/rank-" in e["target"]]


def _restart_later(job, st, after_s):
    time.sleep(after_s)
    try:
        job.s3.rgw.start_rgw()
    except Exception as e:  # noqa: BLE001 - reported by finish() and verify_expectations()
        with st.lock:
            st.errors.append(f"s3_kill_restart: radosgw did not restart: {e}")


def _add_rule(job, fault, regex, count, seconds):
    rule = job.s3.proxy.add_rule(fault, method="PUT", regex=regex, count=count, seconds=seconds)
    st = _state(job)
    with st.lock:
        st.rules.append(rule)
    return rule


def _limit(job, counts, seconds):
    """A count of requests or a number of seconds, chosen at random."""
    if job.rnd.random() < 0.5:
        return job.rnd.choice(counts), None, None
    s = round(job.rnd.uniform(*seconds), 1)
    return None, s, f"{s} s"


def s3_hang(job):
    if job.s3 is None:
        return None
    count, seconds, _ = _limit(job, (1, 2, 3), (2.0, 6.0))
    regex = "^" + re.escape(_job_path(job))
    _add_rule(job, "hang", regex, count, seconds)
    what = f"the next {count} PUT(s)" if count else f"every PUT for {seconds} s"
    return f"proxy hangs {what} under {job.s3.url}"


def s3_503(job):
    if job.s3 is None:
        return None
    count, seconds, _ = _limit(job, (1, 2, 4, 8), (1.0, 4.0))
    prefix = re.escape(_job_path(job))
    ranks = _ranks(job)
    pick = job.rnd.random()
    if pick < 0.4 and ranks > 1:
        chosen = sorted(job.rnd.sample(range(ranks), job.rnd.randint(1, ranks - 1)))
        alts = "|".join(f"{r:05d}" for r in chosen)
        regex = f"^{prefix}step-\\d+/rank-({alts})\\.bin"
        scope = f"rank {','.join(map(str, chosen))}'s data objects"
    elif pick < 0.55:
        regex = f"^{prefix}step-\\d+/manifest\\.json"
        scope = "manifest objects"
    else:
        regex = "^" + prefix
        scope = "all objects"
    _add_rule(job, "status:503:SlowDown", regex, count, seconds)
    what = f"the next {count} PUT(s)" if count else f"PUTs for {seconds} s"
    return f"proxy answers 503 SlowDown to {what} of {scope} under {job.s3.url}"


def _ranks(job):
    """World size as the newest local manifest says, else the live workers, else 1."""
    try:
        steps = _local_steps(job)
        if steps:
            with open(os.path.join(job.ckpt_dir, steps[-1][1], "manifest.json")) as f:
                return int(json.load(f)["world_size"])
    except (OSError, ValueError, KeyError):
        pass
    n = sum(len(node.workers()) for node in getattr(job, "nodes", []) if node.alive())
    return max(1, n)


# ---------------------------------------------------------------------------------------
# local corruption


def _local_steps(job):
    """[(step, name)] of the committed snapshot folders (final name + manifest.json), oldest
    first."""
    out = []
    try:
        names = os.listdir(job.ckpt_dir)
    except OSError:
        return out
    for n in names:
        m = STEP_DIR_RE.match(n)
        if m and os.path.isfile(os.path.join(job.ckpt_dir, n, "manifest.json")):
            out.append((int(m.group(1)), n))
    return sorted(out)


def _s3_complete(job, step):
    try:
        return job.s3.client.head(job.s3.bucket, f"{_s3_prefix(job)}{_step_name(step)}/manifest.json") is not None
    except OSError:
        return False


def _step_name(step):
    return f"step-{step:09d}"


def _s3_prefix(job):
    p = job.s3.prefix.strip("/")
    return p + "/" if p else ""


def _damaged_steps(job, tier):
    return {d["step"] for d in _state(job).damage if d["tier"] == tier}


def _pick_weighted(job, cands):
    """The newest candidate with probability 0.7, else a random older one."""
    if len(cands) == 1 or job.rnd.random() < 0.7:
        return cands[-1]
    return job.rnd.choice(cands[:-1])


def _corrupt_local(job, how, step=None):
    steps = _local_steps(job)
    if len(steps) < 2:
        return None
    damaged = _damaged_steps(job, "local")
    cands = [s for s in steps[:-1] if s[0] not in damaged]
    if job.s3 is not None:
        cands = [s for s in cands if _s3_complete(job, s[0])]
    if step is not None:
        cands = [s for s in cands if s[0] == step]
    if not cands:
        return None
    step, name = _pick_weighted(job, cands)
    folder = os.path.join(job.ckpt_dir, name)
    try:
        files = sorted(f for f in os.listdir(folder) if DATA_RE.match(f))
        if not files:
            return None
        fname = job.rnd.choice(files)
        path = os.path.join(folder, fname)
        dir_ino = os.stat(folder).st_ino
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < 1:
                return None
            if how == "flip":
                off = job.rnd.randrange(size)
                mask = job.rnd.randint(1, 255)
                b = os.pread(fd, 1, off)
                os.pwrite(fd, bytes([b[0] ^ mask]), off)
                detail = f"flipped byte {off} of {size} (xor 0x{mask:02x})"
            else:
                os.ftruncate(fd, size - 1)
                detail = f"truncated from {size} to {size - 1} bytes"
            os.fsync(fd)
        finally:
            os.close(fd)
        digest = _file_sha(path)
    except OSError:
        return None  # removed by retention meanwhile: nothing damaged that counts
    newest = steps[-1][0]
    _state(job).damage.append({"tier": "local", "step": step, "what": fname, "name": name,
                               "sha": digest, "dir_ino": dir_ino, "how": how})
    _corrupted(job, "local", step, fname)
    return f"{name}/{fname}: {detail} (newest committed step {newest})"


def flip_local(job, step=None):
    """step: damage that snapshot (None: chosen as the module doc says)."""
    return _corrupt_local(job, "flip", step)


def truncate_local(job, step=None):
    return _corrupt_local(job, "truncate", step)


# ---------------------------------------------------------------------------------------
# S3 corruption


def _s3_snapshots(job):
    """{step: [data object keys]} of the snapshots whose manifest object exists."""
    prefix = _s3_prefix(job)
    keys = job.s3.client.list(job.s3.bucket, prefix)
    by = {}
    for k in keys:
        rest = k[len(prefix):].split("/")
        if len(rest) != 2:
            continue
        m = STEP_DIR_RE.match(rest[0])
        if m:
            by.setdefault(int(m.group(1)), []).append(rest[1])
    return {s: sorted(n for n in names if DATA_RE.match(n))
            for s, names in by.items() if "manifest.json" in names}


def _corrupt_s3(job, how, step=None):
    if job.s3 is None:
        return None
    try:
        snaps = _s3_snapshots(job)
    except (OSError, s3env.S3Error):
        return None  # RGW down (s3_kill_restart): try another kind
    damaged = _damaged_steps(job, "s3")
    cands = sorted(s for s, objs in snaps.items() if objs and s not in damaged and step in (None, s))
    if not cands:
        return None
    both = [s for s in cands if s in _damaged_steps(job, "local")]
    if both and job.rnd.random() < 0.5:
        step = job.rnd.choice(both)
        why = "its local copy is damaged too"
    else:
        step = _pick_weighted(job, cands)
        why = "newest complete on S3" if step == cands[-1] else "an older one"
    obj = job.rnd.choice(snaps[step])
    key = f"{_s3_prefix(job)}{_step_name(step)}/{obj}"
    c = job.s3.client
    try:
        data = c.get(job.s3.bucket, key)
        if not data:
            return None
        if how == "flip":
            off = job.rnd.randrange(len(data))
            mask = job.rnd.randint(1, 255)
            bad = data[:off] + bytes([data[off] ^ mask]) + data[off + 1:]
            detail = f"flipped byte {off} of {len(data)} (xor 0x{mask:02x})"
        else:
            bad = data[:-1]
            detail = f"truncated from {len(data)} to {len(bad)} bytes"
        c.put(job.s3.bucket, key, bad)
    except (OSError, s3env.S3Error):
        return None  # deleted by retention meanwhile, RGW down or restarting
    _state(job).damage.append({"tier": "s3", "step": step, "what": obj, "key": key,
                               "md5": hashlib.md5(bad).hexdigest(), "how": how})
    _corrupted(job, "s3", step, obj)
    return f"{job.s3.url}/{_step_name(step)}/{obj}: {detail} ({why})"


def flip_s3(job, step=None):
    """step: damage that snapshot's S3 copy (None: chosen as the module doc says)."""
    return _corrupt_s3(job, "flip", step)


def truncate_s3(job, step=None):
    return _corrupt_s3(job, "truncate", step)


# ---------------------------------------------------------------------------------------
# memory corruption


def _environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    out = {}
    for it in items:
        k, sep, v = it.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def slots_of(path):
    """[(slot, state, seq, payload_bytes, step, payload_offset)] of a segment file, [] when
    it has no magic (being built)."""
    with open(path, "rb") as f:
        hdr = f.read(SEG_HDR)
        if hdr[:8] != b"CKPTSEG1":
            return []
        slot_bytes, = struct.unpack_from("<Q", hdr, 16)
        nslots, = struct.unpack_from("<I", hdr, 24)
        out = []
        for i in range(nslots):
            base = SEG_HDR + i * (SLOT_HDR + slot_bytes)
            f.seek(base)
            st, _, seq, pb, _, step = struct.unpack("<IIQQQQ", f.read(40))
            out.append((i, st, seq, pb, step, base + SLOT_HDR))
        return out


def payload_regions(head, payload_bytes):
    """[(name, start, end)] of the payload bytes a checksum covers, from its 4096-byte
    header (FORMAT.md "Payload of a memory snapshot"): the header itself (the slot header's
    payload_xxh3), each shard's bytes (chunk checksums), the trainer record (trainer_xxh3;
    rank 0's only: a restore reads and checks rank 0's record and no other, so a flip in
    another rank's record is neither found nor harmful), the chunk checksums. The padding
    between them is covered by nothing."""
    regions = [("payload header", 0, 2200)]
    if head[:8] != b"CKPTMEM1":
        return regions
    nbufs, = struct.unpack_from("<I", head, 12)
    for i in range(min(nbufs, 16)):
        e = 280 + 120 * i
        name = head[e:e + 64].split(b"\0")[0].decode(errors="replace")
        nbytes, data_off = struct.unpack_from("<QQ", head, e + 104)
        if nbytes:
            regions.append((f"shard of {name}", data_off, data_off + nbytes))
    trainer_off, trainer_len, sums_off, nsums = struct.unpack_from("<QQQQ", head, 240)
    rank, = struct.unpack_from("<I", head, 28)
    if trainer_len and rank == 0:
        regions.append(("trainer record", trainer_off, trainer_off + trainer_len))
    if nsums:
        regions.append(("chunk checksums", sums_off + 8, min(payload_bytes, sums_off + 8 + 8 * nsums)))
    return [r for r in regions if r[1] < r[2] <= payload_bytes]


def flip_memory(job, region=None, local_rank=None):
    """region: a name prefix of payload_regions ("payload header", "shard", "shard of params",
    "trainer record", "chunk checksums") to aim at, local_rank: the segment; None = random."""
    nodes = [n for n in getattr(job, "nodes", []) if n.alive() and n.workers()]
    if not nodes:
        return None
    node = job.rnd.choice(nodes)
    pids = node.workers()
    envs = {p: _environ(p) for p in pids}
    prefixes = {e.get("CKPT_MEM_PATH") for e in envs.values()} - {None, ""}
    if len(prefixes) != 1:
        return None
    prefix = prefixes.pop()
    stopped = []
    try:
        for p in pids:
            try:
                os.kill(p, signal.SIGSTOP)
                stopped.append(p)
            except ProcessLookupError:
                pass
        _wait_stopped(stopped)
        locals_ = sorted({int(e["LOCAL_RANK"]) for e in envs.values() if e.get("LOCAL_RANK", "").isdigit()})
        segs = {L: f"{prefix}.own-{L}" for L in locals_}
        complete = {}
        for L, path in segs.items():
            try:
                complete[L] = {s[4]: s for s in slots_of(path) if s[1] == SLOT_COMPLETE}
            except (OSError, struct.error):
                complete[L] = {}
        common = set.intersection(*(set(c) for c in complete.values())) if complete else set()
        if not common:
            return None
        step = max(common)  # the newest memory snapshot complete on this node: tried first
        L = job.rnd.choice(locals_) if local_rank is None else local_rank
        if L not in complete:
            return None
        slot, _, _, pbytes, _, poff = complete[L][step]
        with open(segs[L], "r+b") as f:
            f.seek(poff)
            head = f.read(PAYLOAD_HDR)
            regions = payload_regions(head, pbytes)
            shards = [r for r in regions if r[0].startswith("shard")]
            others = [r for r in regions if not r[0].startswith("shard")]
            if region is not None:
                aimed = [r for r in regions if r[0].startswith(region)]
                if not aimed:
                    return None
                region = job.rnd.choice(aimed)
            elif shards and (job.rnd.random() < 0.7 or not others):
                region = job.rnd.choice(shards)
            else:
                region = job.rnd.choice(others)
            off = job.rnd.randrange(region[1], region[2])
            mask = job.rnd.randint(1, 255)
            f.seek(poff + off)
            b = f.read(1)
            f.seek(poff + off)
            f.write(bytes([b[0] ^ mask]))
            f.flush()
        sizes = _log_sizes(job)
        what = f"{os.path.basename(segs[L])} slot {slot}"
        _state(job).damage.append({"tier": "memory", "step": step, "what": what, "segment": segs[L],
                                   "slot": slot, "region": region[0], "logs": sizes,
                                   "t": time.time()})
        _corrupted(job, "memory", step, what)
        for p in reversed(stopped):  # frozen: none finishes a copy in progress
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stopped = []
        return (f"{what} (step {step}, local rank {L}): flipped byte {off} of its {region[0]} "
                f"(xor 0x{mask:02x}); SIGKILLed node {node.index}'s {len(pids)} worker(s) so that "
                f"the next resume meets it")
    finally:
        for p in stopped:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _wait_stopped(pids, timeout=2.0):
    deadline = time.monotonic() + timeout
    for p in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{p}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state in ("T", "t", "Z", "X"):
                break
            time.sleep(0.002)


# ---------------------------------------------------------------------------------------
# end of a scenario, and the checks


def finish(job):
    """Join the restart threads (bounded), make sure radosgw runs, remove this module's proxy
    rules. Returns problem lines (a radosgw that would not come back). Safe to call twice."""
    st = _state(job)
    problems = []
    with st.lock:
        threads = list(st.threads)
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        if t.is_alive():
            problems.append("s3_kill_restart: the restart thread did not finish within "
                            f"{JOIN_TIMEOUT_S:.0f} s")
    with st.lock:
        st.threads = [t for t in st.threads if t.is_alive()]
        problems.extend(st.errors)
        st.errors = []
        rules, st.rules = st.rules, []
    s3 = getattr(job, "s3", None)
    if s3 is not None:
        for r in rules:
            s3.proxy.remove_rule(r)
        if not s3.rgw.rgw_running():
            try:
                s3.rgw.start_rgw()
            except Exception as e:  # noqa: BLE001
                problems.append(f"radosgw could not be restarted at the end: {e}")
    return problems


def _inspect(job, args, env=None, timeout=VERIFY_TIMEOUT_S):
    """(exit status, parsed --json output or None, stderr)."""
    try:
        p = subprocess.run([job.inspect, "--json", "-q"] + list(args), capture_output=True, text=True,
                           env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, None, f"timed out after {timeout:.0f} s"
    try:
        doc = json.loads(p.stdout) if p.stdout.strip() else None
    except ValueError:
        doc = None
    return p.returncode, doc, p.stderr.strip()


def _expect_corrupt(job, target, label, env=None):
    """A problem line unless `ckpt-inspect verify target` calls it corrupt (exit 1, status
    corrupt)."""
    rc, doc, err = _inspect(job, ["verify", target], env=env)
    status = (doc or {}).get("status")
    if rc == 1 and status == "corrupt":
        return None
    if rc == 3:
        return f"{label}: verify could not read {target} (exit 3: {err[-300:]}); that is no pass"
    if rc == 0:
        return f"{label}: verify passes {target}, which was damaged on purpose"
    return f"{label}: verify {target} exited {rc} (status {status}): {err[-300:]}"


def verify_expectations(job):
    """One problem line for every item damaged on purpose that `ckpt-inspect verify` does not
    report as corrupt (exit 1), unless retention removed it (local: the folder is gone; S3:
    the step is not in `ckpt-inspect --json list s3://...`) or a newer save replaced it (a
    restore set the damaged local folder aside and the step was saved again: the set-aside
    folder is verified instead; an S3 object whose bytes are no longer the damaged ones was
    uploaded again). A memory slot: the first resume after the damage must not restore that
    step from it (own segment), and the log must name it as not restored / corrupt."""
    problems = []
    damage = list(_state(job).damage)
    s3_listing = None
    for d in damage:
        label = f"{d['tier']} step {d['step']} {d['what']} ({d.get('how', 'flip')})"
        if d["tier"] == "local":
            problems.extend(_check_local(job, d, label))
        elif d["tier"] == "s3":
            if s3_listing is None:
                s3_listing = _s3_listing(job)
            p = _check_s3(job, d, label, s3_listing)
            if p:
                problems.append(p)
        elif d["tier"] == "memory":
            problems.extend(_check_memory(job, d, label))
    return problems


def _holds_damage(folder, d):
    try:
        return _file_sha(os.path.join(folder, d["what"])) == d["sha"]
    except OSError:
        return False


def _check_local(job, d, label):
    folder = os.path.join(job.ckpt_dir, d["name"])
    try:
        same = os.stat(folder).st_ino == d["dir_ino"]
    except OSError:
        same = False
    if same:
        if not _holds_damage(folder, d):
            return [f"{label}: {folder} is the damaged folder but its {d['what']} changed in place "
                    "(a committed snapshot was rewritten)"]
        p = _expect_corrupt(job, folder, label)
        return [p] if p else []
    # set aside by a restore (step-N.corrupt-<unix>), perhaps re-saved since
    try:
        names = os.listdir(job.ckpt_dir)
    except OSError as e:
        return [f"{label}: cannot list {job.ckpt_dir}: {e}"]
    aside = [n for n in names if n.startswith(d["name"] + ".corrupt-")
             and _holds_damage(os.path.join(job.ckpt_dir, n), d)]
    out = []
    for n in aside:
        p = _expect_corrupt(job, os.path.join(job.ckpt_dir, n), label + " (set aside)")
        if p:
            out.append(p)
    return out  # no folder holds it: removed by retention


def _s3_listing(job):
    """{step: status} of `ckpt-inspect --json list s3://...`, or a problem string."""
    if getattr(job, "s3", None) is None:
        return "no S3 target"
    rc, doc, err = _inspect(job, ["list", job.s3.url], env=job.s3.rgw.env())
    if rc != 0 or not doc:
        return f"ckpt-inspect list {job.s3.url} exited {rc}: {err[-300:]}"
    return {e["step"]: e["status"] for e in doc.get("snapshots", [])}


def _check_s3(job, d, label, listing):
    if isinstance(listing, str):
        return f"{label}: {listing}"
    if d["step"] not in listing:
        return None  # removed by retention (or a re-save in progress removed it)
    try:
        h = job.s3.client.head(job.s3.bucket, d["key"])
    except (OSError, s3env.S3Error) as e:
        return f"{label}: HEAD {d['key']}: {e}"
    if h is not None and h.get("etag", "").strip('"') != d["md5"]:
        return None  # uploaded again since (a re-save of the step)
    if listing[d["step"]] != "committed":
        return None  # listed corrupt already, or its manifest object is gone (not a snapshot)
    url = f"{job.s3.url}/{_step_name(d['step'])}"
    return _expect_corrupt(job, url, label, env=job.s3.rgw.env())


RESUMED_RE = re.compile(r"resumed from (memory \((own|replica|peer)\)|\S+) at step (\d+)")


def _check_memory(job, d, label):
    text = _log_after(job, d["logs"])
    step = d["step"]
    first = RESUMED_RE.search(text)
    if first is None:
        return []  # no resume after the damage (the job ended): nothing read it
    out = []
    if int(first.group(3)) == step and first.group(2) in ("own", "peer"):
        out.append(f"{label}: the first resume after the damage restored step {step} from memory "
                   f"({first.group(2)}): {first.group(0)}")
    seen = re.search(rf"memory snapshot mem:\S+/{step}/\d+ not (restored|flushed)", text) or \
        re.search(rf"memory slot .* \(step {step}\) is corrupt", text)
    if not seen:
        out.append(f"{label}: no log line reports the damaged memory snapshot of step {step} as "
                   "not restored or corrupt")
    return out


KINDS = {
    "s3_kill_restart": s3_kill_restart,
    "s3_hang": s3_hang,
    "s3_503": s3_503,
    "flip_local": flip_local,
    "truncate_local": truncate_local,
    "flip_s3": flip_s3,
    "truncate_s3": truncate_s3,
    "flip_memory": flip_memory,
}

# What the job must have. The local and memory kinds need only what every job has (a snapshot
# folder, the memory tier under elastic); their injectors return None until there is
# something to damage (two committed snapshots; a complete slot on a node with workers).
NEEDS = {
    "s3_kill_restart": {"s3"},
    "s3_hang": {"s3"},
    "s3_503": {"s3"},
    "flip_local": set(),
    "truncate_local": set(),
    "flip_s3": {"s3"},
    "truncate_s3": {"s3"},
    "flip_memory": set(),
}
