"""The commit protocol of a save, seen from the system calls (docs/FORMAT.md, "Commit
protocol"): one save of `train` runs under strace, and the order of its fsyncs, opens and
renames is checked against the documented steps:

  data file rank-00000.bin written in the temp folder and fsynced
    -> manifest.json opened for writing (there)
    -> manifest.json fsynced -> temp folder fsynced
    -> temp folder renamed to step-000000004
    -> the snapshot folder <dir> fsynced;

and nothing is ever opened for writing (or created) under the final name. "A before B" means
A's system call returned before B's was entered, whatever thread made them: strace -f logs
calls of concurrent threads as "<unfinished ...>" / "<... resumed>" pairs, and both ends are
kept. rename, renameat and renameat2 are all accepted, as are paths relative to a directory
fd (strace -y prints the fd's path).

Note: only fsync(2)/fdatasync(2) calls are visible to strace; an fsync submitted through
io_uring (IORING_OP_FSYNC) is not, and would make this test fail as if it were missing."""
import os
import re
import shutil
import subprocess

import harness as h

STEP = 4
FINAL_NAME = f"step-{STEP:09d}"
SYSCALLS = ("fsync,fdatasync,rename,renameat,renameat2,open,openat,creat,unlink,unlinkat,"
            "mkdir,mkdirat")
WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")

LINE_RE = re.compile(r"^(\d+)\s+(.*)$")
CALL_RE = re.compile(r"^(\w+)\((.*)$")
RESUMED_RE = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
FD_RE = re.compile(r"^(AT_FDCWD|-?\d+)<(.*)>$")
STR_RE = re.compile(r'^"((?:[^"\\]|\\.)*)"(\.\.\.)?$')


def split_args(text):
    """Split strace's argument list at top-level commas (outside quotes and brackets)."""
    out, cur, depth, quoted, i = [], [], 0, False, 0
    while i < len(text):
        c = text[i]
        if quoted:
            cur.append(c)
            if c == "\\" and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
            cur.append(c)
        elif c in "([{<":
            depth += 1
            cur.append(c)
        elif c in ")]}>":
            depth -= 1
            cur.append(c)
        elif c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def unquote(arg):
    m = STR_RE.match(arg)
    if not m:
        raise AssertionError(f"not a string argument: {arg}")
    if m.group(2):
        raise AssertionError(f"string truncated by strace: {arg}")
    return m.group(1).encode("latin-1").decode("unicode_escape")


def fd_path(arg):
    m = FD_RE.match(arg)
    return m.group(2) if m else None


class Call:
    def __init__(self, pid, name, args, ret, start, end):
        self.pid, self.name, self.args, self.ret = pid, name, split_args(args), ret
        self.start, self.end = start, end  # log lines where it was entered and returned
        self.ok = not ret.lstrip().startswith("-")

    def path_at(self, dirfd_index, path_index):
        """Absolute path named by (dirfd, path) arguments; dirfd_index None: cwd-relative."""
        p = unquote(self.args[path_index])
        if not p.startswith("/"):
            base = fd_path(self.args[dirfd_index]) if dirfd_index is not None else None
            if base is None:
                raise AssertionError(f"relative path without a known folder: {self}")
            p = os.path.join(base, p)
        return os.path.normpath(p)

    def __repr__(self):
        return f"[{self.start}-{self.end}] {self.pid} {self.name}({', '.join(self.args)}) = {self.ret}"


def parse(log_text):
    """The system calls of an strace -f -y log, unfinished/resumed pairs joined."""
    calls, pending = [], {}
    for lineno, line in enumerate(log_text.splitlines()):
        m = LINE_RE.match(line)
        if not m:
            continue
        pid, rest = int(m.group(1)), m.group(2)
        r = RESUMED_RE.match(rest)
        if r:
            name, start, head = pending.pop(pid)
            assert name == r.group(1), (name, line)
            rest = head + r.group(2)
        else:
            c = CALL_RE.match(rest)
            if not c:
                continue  # signals and the like
            if rest.endswith("<unfinished ...>"):
                pending[pid] = (c.group(1), lineno, rest[:-len("<unfinished ...>")].rstrip())
                continue
            start = lineno
        c = CALL_RE.match(rest)
        args, sep, ret = c.group(2).rpartition(") = ")
        if not sep:
            continue  # a call that never returned (process killed)
        calls.append(Call(pid, c.group(1), args, ret, start, lineno))
    return calls


class CommitOrder(h.TempDirTest):
    def test_commit_protocol_order(self):
        if not shutil.which("strace"):
            self.skipTest("no strace")
        ckpt = os.path.join(self.tmp, "ckpt")
        log = os.path.join(self.tmp, "strace.log")
        cmd = ["strace", "-f", "-y", "-qq", "-s", "4096", "-e", "trace=" + SYSCALLS, "-o", log,
               h.TRAIN] + h.data_args() + h.SMALL + ["--steps", str(STEP), "--ckpt-every",
                                                     str(STEP), "--ckpt-dir", ckpt]
        p = subprocess.run(cmd, capture_output=True, text=True, env=h.env(), timeout=300)
        if p.returncode != 0 and "ptrace" in p.stderr.lower():
            self.skipTest(f"strace cannot trace here: {p.stderr.strip()[-200:]}")
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        self.assertEqual(h.final(p)["step"], STEP)
        self.assertEqual(h.snapshot_dirs(ckpt), [FINAL_NAME])
        self.assertEqual(h.temp_dirs(ckpt), [])
        v = h.run([h.INSPECT, "verify", os.path.join(ckpt, FINAL_NAME)])
        self.assertEqual(v.returncode, 0, v.stderr)
        with open(log) as f:
            text = f.read()
        d = os.path.realpath(ckpt)
        self.check(parse(text), d)
        self.checker_catches_violations(text, d)

    def checker_catches_violations(self, text, d):
        """The checks fail on the same trace with one step of the protocol out of order, and
        still pass on equivalent traces (renameat2, a call split across threads)."""
        lines = text.splitlines()
        final = os.path.join(d, FINAL_NAME)

        def find(pattern):
            hits = [i for i, ln in enumerate(lines) if re.search(pattern, ln)]
            self.assertEqual(len(hits), 1, f"{pattern}: {hits}")
            return hits[0]

        data_sync = find(r"\b(fsync|fdatasync)\(\d+<[^>]*/\.tmp-step-[^>]*/rank-00000\.bin>\)")
        man_open = find(r"open\w*\(.*\.tmp-step-[^\"]*/manifest\.json\".*O_CREAT")
        man_sync = find(r"\b(fsync|fdatasync)\(\d+<[^>]*/\.tmp-step-[^>]*/manifest\.json>\)")
        tmp_sync = find(r"\b(fsync|fdatasync)\(\d+<[^>]*/\.tmp-step-[^>/]*>\)")
        ren = find(r"rename\w*\(.*" + re.escape(FINAL_NAME))
        parent_sync = [i for i, ln in enumerate(lines)
                       if re.search(r"\b(fsync|fdatasync)\(\d+<" + re.escape(d) + r">\)", ln)
                       and i > ren][0]

        def moved(i, to):
            """The trace with line i moved to just after original line `to`."""
            out = list(lines)
            out[i] = None
            out.insert(to + 1, lines[i])
            return [ln for ln in out if ln is not None]

        def added(after, line):
            return lines[:after + 1] + [line] + lines[after + 1:]

        def must_fail(mut, expect):
            with self.assertRaises(AssertionError, msg=f"checker missed: {expect}") as cm:
                self.check(parse("\n".join(mut)), d)
            self.assertIn(expect, str(cm.exception))

        pid = lines[ren].split()[0]
        must_fail(moved(data_sync, man_open), "rank-00000.bin before the manifest is opened")
        must_fail(moved(man_sync, ren), "manifest.json before the rename")
        must_fail(moved(tmp_sync, ren), "before the rename")
        must_fail(moved(tmp_sync, man_sync - 1), "temp folder fsynced before the manifest")
        must_fail(lines[:parent_sync] + lines[parent_sync + 1:], f"no fsync of {d} after")
        must_fail(moved(parent_sync, ren - 1), f"no fsync of {d} after")
        must_fail(added(ren, f'{pid} openat(AT_FDCWD</>, "{final}/manifest.json", '
                             f'O_WRONLY|O_TRUNC) = 5<{final}/manifest.json>'),
                  "opened for writing under the final name")
        must_fail(added(man_open, f'{pid} openat(AT_FDCWD<{d}>, "{FINAL_NAME}/rank-00000.bin", '
                                  f'O_WRONLY|O_CREAT|O_EXCL, 0644) = -1 ENOENT (No such file)'),
                  "opened for writing under the final name")
        must_fail(added(0, f'{pid} mkdir("{final}", 0755) = 0'),
                  "folder created under the final name")

        # equivalent traces still pass
        mut = list(lines)
        m = re.match(r'^(\d+)\s+rename\("([^"]*)", "([^"]*)"\) = 0$', mut[ren])
        if m:
            mut[ren] = (f'{m.group(1)} renameat2(AT_FDCWD<{d}>, "{os.path.basename(m.group(2))}", '
                        f'AT_FDCWD</>, "{m.group(3)}", RENAME_NOREPLACE) = 0')
            self.check(parse("\n".join(mut)), d)
        mut = list(lines)
        pid, rest = mut[man_sync].split(None, 1)
        call, ret = rest.rsplit(") = ", 1)
        mut[man_sync:man_sync + 1] = [f"{pid} {call} <unfinished ...>",
                                      "99999 openat(AT_FDCWD</>, \"/x\", O_RDONLY) = 9</x>",
                                      f"{pid} <... {call.split('(')[0]} resumed>) = {ret}"]
        self.check(parse("\n".join(mut)), d)
        self.assertIn(final, "\n".join(lines))

    def check(self, calls, d):
        final = os.path.join(d, FINAL_NAME)

        def under(path, folder):
            return path == folder or path.startswith(folder + "/")

        renames, opens_w, mkdirs, syncs = [], [], [], []
        for c in calls:
            if c.name == "rename":
                renames.append((c, c.path_at(None, 0), c.path_at(None, 1)))
            elif c.name in ("renameat", "renameat2"):
                renames.append((c, c.path_at(0, 1), c.path_at(2, 3)))
            elif c.name in ("open", "openat", "creat"):
                dirfd, pidx = (0, 1) if c.name == "openat" else (None, 0)
                flags = c.args[pidx + 1] if c.name != "creat" else "O_CREAT|O_WRONLY|O_TRUNC"
                if any(f in flags for f in WRITE_FLAGS):
                    opens_w.append((c, c.path_at(dirfd, pidx)))
            elif c.name in ("mkdir", "mkdirat"):
                mkdirs.append((c, c.path_at(0, 1) if c.name == "mkdirat" else c.path_at(None, 0)))
            elif c.name in ("fsync", "fdatasync") and c.ok:
                path = fd_path(c.args[0])
                if path is not None:
                    syncs.append((c, os.path.normpath(path)))

        # the one commit: a temp folder renamed to the final name
        commits = [(c, old) for c, old, new in renames if new == final and c.ok]
        self.assertEqual(len(commits), 1, f"renames to {final}: {renames}")
        rename, tmp = commits[0]
        self.assertEqual(os.path.dirname(tmp), d)
        self.assertTrue(os.path.basename(tmp).startswith(f".tmp-step-{STEP:09d}-"), tmp)
        data, manifest = os.path.join(tmp, "rank-00000.bin"), os.path.join(tmp, "manifest.json")

        def first(events, what):
            self.assertTrue(events, f"no {what} in the trace")
            return min(events, key=lambda c: c.start)

        def synced_before(path, limit, what):
            """The last fsync of path that returned before `limit` was entered."""
            done = [c for c, p in syncs if p == path and c.end < limit.start]
            self.assertTrue(done, f"no fsync of {path} before {what} ({limit}); fsyncs: "
                                  f"{[(c, p) for c, p in syncs]}")
            return max(done, key=lambda c: c.end)

        data_open = first([c for c, p in opens_w if p == data and c.ok],
                          f"open for writing of {data}")
        man_open = first([c for c, p in opens_w if p == manifest and c.ok],
                         f"open for writing of {manifest}")
        self.assertLess(data_open.end, man_open.start, "manifest created before the data file")
        # 2 -> 3: the data file is durable before the manifest exists
        data_sync = synced_before(data, man_open, "the manifest is opened for writing")
        self.assertGreater(data_sync.start, data_open.end)
        # 3: manifest fsynced, then the temp folder fsynced, both before the rename (4)
        man_sync = synced_before(manifest, rename, "the rename")
        self.assertGreater(man_sync.start, man_open.end)
        tmp_sync = synced_before(tmp, rename, "the rename")
        self.assertGreater(tmp_sync.start, man_sync.end,
                           "temp folder fsynced before the manifest was fsynced")
        # 5: the parent folder fsynced after the rename
        after = [c for c, p in syncs if p == d and c.start > rename.end]
        self.assertTrue(after, f"no fsync of {d} after the rename {rename}")

        # nothing written or created under the final name, ever
        for c, p in opens_w:
            self.assertFalse(under(p, final), f"opened for writing under the final name: {c}")
        for c, p in mkdirs:
            self.assertFalse(under(p, final), f"folder created under the final name: {c}")
        for c, old, new in renames:
            if c is not rename:
                self.assertFalse(under(new, final), f"renamed into the final name: {c}")


if __name__ == "__main__":
    h.main()
