#!/usr/bin/env python3
"""A stand-in worker for the elastic launcher's tests (tests/integration/test_elastic.py).

It behaves like a training rank without training: prints what it was given, writes progress
lines to ELASTIC_HEARTBEAT_FD, and exits, fails, hangs or ignores SIGTERM on request.

  --beats N             progress lines to write before exiting 0 (0 = forever)
  --interval S          seconds between progress lines (default 0.05)
  --fail R:G:CODE[:K]   rank R (or *) in round G (ELASTIC_RESTART_COUNT, or *) exits CODE after
                        K progress lines (default 0); may repeat
  --forever R:G         rank R (or *) in round G (or *) writes progress lines until stopped
  --spam N              print N lines of 1 KiB on stdout at start (a flood for slow readers)
  --silent R:G[:K]      rank R in round G stops writing progress lines after K lines (hangs)
  --ignore-term         ignore SIGTERM (the launcher must SIGKILL us)
  --term-sleep S        on SIGTERM, print "term", then go on writing progress lines for S
                        seconds before the exit (a graceful stop that takes a final snapshot)
  --on-term R:G:ACTION  rank R (or *) in round G (or *) on SIGTERM: exit ACTION (a status)
                        after the "term" line instead of 143, or ignore it (ACTION "ignore")
  --child MARKER        start a grandchild (same process group) that sleeps with
                        "MARKER-g<round>-child" in its argv, ignoring SIGTERM when --ignore-term
                        is given; in round G > 0 first print "stale=<n>", the number of
                        processes left from round G-1 ("MARKER-g<G-1>-child")
  --token-check FILE    connect to the store with ELASTIC_STORE_TOKEN and with a wrong token;
                        write "ok=<status> wrong=<status> token=<token>" to FILE
  --marker M            ignored (a tag in argv for pgrep)
Memory tier (elastic --mem-dir; test_mem_agent.py):
  --mem-touch           create an empty file $CKPT_MEM_PATH.own-$LOCAL_RANK (0600) at start:
                        what makes the agent run a flush after a failure
  --mem-segment TOOL:SLOT_BYTES:NBYTES
                        write a real segment $CKPT_MEM_PATH.own-$LOCAL_RANK with TOOL
                        (build/tests/shmseg-tool write, step 100 x round + rank, seed = rank)
                        at start and print "seg rank=.. <the tool's line>"
  --flush-marker FILE   with CKPT_MEM_FLUSH=1 (the agent's flush command): append
                        "flush rank=.. world=.. local=.. path=.. gen=.." to FILE (a missing
                        variable is "none"), print "flushing", sleep --flush-sleep seconds
                        (default 0), then exit --flush-exit (default 0) or, with --flush-hang,
                        sleep until killed
Lines on stdout: "start rank=.. gen=.. pid=.. world=.. local=.. group=.. groups=.. addr=.. ...
mem=.. mflush=.." (CKPT_MEM_PATH and CKPT_MEM_FLUSH, "None" when unset),
"term rank=.." on SIGTERM (then exit 143), "done rank=.." at a clean end; "err rank=.." and a
partial line without newline on stderr.
"""
import argparse
import os
import signal
import socket
import struct
import subprocess
import sys
import time


def env_int(name, default=-1):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def match(spec, rank, gen):
    parts = spec.split(":")
    r, g = parts[0], parts[1]
    return (r == "*" or int(r) == rank) and (g == "*" or int(g) == gen), parts[2:]


def store_hello(host, port, token):
    """HELLO with token; returns the status byte (0 OK, 2 DENIED) or -1 on a closed socket."""
    tok = token.encode()
    body = b"ESTR" + struct.pack("<H", 1) + struct.pack("<I", len(tok)) + tok
    frame = struct.pack("<IBI", 5 + len(body), 0x01, 1) + body
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(frame)
        hdr = b""
        while len(hdr) < 10:
            chunk = s.recv(10 - len(hdr))
            if not chunk:
                return -1
            hdr += chunk
        return hdr[9]


def stale(marker):
    me = os.getpid()
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    n += 1
        except OSError:
            pass
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--beats", type=int, default=5)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--fail", action="append", default=[])
    ap.add_argument("--silent", action="append", default=[])
    ap.add_argument("--forever", action="append", default=[])
    ap.add_argument("--spam", type=int, default=0)
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--on-term", action="append", default=[])
    ap.add_argument("--term-sleep", type=float, default=0)
    ap.add_argument("--child")
    ap.add_argument("--token-check")
    ap.add_argument("--marker")
    ap.add_argument("--mem-touch", action="store_true")
    ap.add_argument("--mem-segment")
    ap.add_argument("--flush-marker")
    ap.add_argument("--flush-exit", type=int, default=0)
    ap.add_argument("--flush-hang", action="store_true")
    ap.add_argument("--flush-sleep", type=float, default=0)
    a = ap.parse_args()

    if os.environ.get("CKPT_MEM_FLUSH") == "1":
        if a.flush_marker:
            with open(a.flush_marker, "a") as f:
                f.write(" ".join(f"{k}={os.environ.get(v, 'none')}" for k, v in
                                 [("rank", "RANK"), ("world", "WORLD_SIZE"), ("local", "LOCAL_RANK"),
                                  ("path", "CKPT_MEM_PATH"), ("gen", "ELASTIC_RESTART_COUNT"),
                                  ("token", "ELASTIC_STORE_TOKEN")]) + "\n")
        print("flushing", flush=True)
        time.sleep(a.flush_sleep)
        if a.flush_hang:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(1)
        return a.flush_exit

    rank, gen = env_int("RANK"), env_int("ELASTIC_RESTART_COUNT")
    out = sys.stdout

    term_action = "ignore" if a.ignore_term else "143"
    for spec in a.on_term:
        hit, rest = match(spec, rank, gen)
        if hit:
            term_action = rest[0]

    def on_term(sig, frame):
        print(f"term rank={rank} gen={gen}", flush=True)
        end = time.time() + a.term_sleep
        while time.time() < end:
            time.sleep(min(0.05, max(0.0, end - time.time())))
        print(f"exit rank={rank} gen={gen}", flush=True)
        os._exit(int(term_action))

    signal.signal(signal.SIGTERM, signal.SIG_IGN if term_action == "ignore" else on_term)
    print(f"start rank={rank} gen={gen} pid={os.getpid()} world={env_int('WORLD_SIZE')} "
          f"local={env_int('LOCAL_RANK')} lworld={env_int('LOCAL_WORLD_SIZE')} "
          f"group={env_int('GROUP_RANK')} groups={env_int('GROUP_WORLD_SIZE')} "
          f"addr={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
          f"hosted={os.environ.get('ELASTIC_STORE_HOSTED')} run={os.environ.get('ELASTIC_RUN_ID')} "
          f"tgen={os.environ.get('TORCHELASTIC_RESTART_COUNT')} pgid={os.getpgid(0)} "
          f"mem={os.environ.get('CKPT_MEM_PATH')} mflush={os.environ.get('CKPT_MEM_FLUSH')}",
          file=out, flush=True)
    mem = os.environ.get("CKPT_MEM_PATH")
    own = f"{mem}.own-{env_int('LOCAL_RANK')}" if mem else None
    if a.mem_touch and own:
        os.close(os.open(own, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    if a.mem_segment and own:
        tool, slot_bytes, nbytes = a.mem_segment.split(":")
        line = subprocess.run([tool, "write", own, slot_bytes, str(100 * gen + rank), nbytes,
                               str(rank)], check=True, capture_output=True, text=True).stdout
        print(f"seg rank={rank} {line.strip()}", flush=True)
    if a.child and gen > 0:
        print(f"stale={stale(f'{a.child}-g{gen - 1}-child')}", flush=True)
    if a.child:
        code = ("import signal, time, sys\n"
                + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if a.ignore_term else "")
                + "time.sleep(1000)\n")
        subprocess.Popen([sys.executable, "-c", code, f"{a.child}-g{gen}-child"], close_fds=True,
                         stdin=subprocess.DEVNULL)
    if a.token_check:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        token = os.environ.get("ELASTIC_STORE_TOKEN", "")
        ok = store_hello(host, port, token)
        wrong = store_hello(host, port, token + "x")
        with open(a.token_check, "w") as f:
            f.write(f"ok={ok} wrong={wrong} token={token}\n")

    fd = env_int("ELASTIC_HEARTBEAT_FD")
    fail = None
    for spec in a.fail:
        hit, rest = match(spec, rank, gen)
        if hit:
            fail = (int(rest[0]), int(rest[1]) if len(rest) > 1 else 0)
    silent_after = None
    for spec in a.silent:
        hit, rest = match(spec, rank, gen)
        if hit:
            silent_after = int(rest[0]) if rest else 0
    beats = a.beats
    for spec in a.forever:
        if match(spec, rank, gen)[0]:
            beats = 0
    line = "x" * 1023
    for i in range(a.spam):
        print(f"{i:08d} {line}")
    sys.stdout.flush()
    n = 0
    while beats == 0 or n < beats:
        if fail and n >= fail[1]:
            print(f"err rank={rank} failing with {fail[0]}", file=sys.stderr, flush=True)
            sys.exit(fail[0])
        if silent_after is None or n < silent_after:
            if fd >= 0:
                try:
                    os.write(fd, f"step {n + 1}\n".encode())
                except OSError:
                    pass
        n += 1
        time.sleep(a.interval)
    print(f"done rank={rank} gen={gen}", flush=True)
    sys.stderr.write(f"err rank={rank} partial")
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
