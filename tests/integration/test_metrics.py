"""The agent's Prometheus metrics and goodput report (issue 12), checked by a real Prometheus
(Debian's `prometheus`, scripts/lib.sh installs it).

One job: `elastic --metrics-port P` runs 2 train ranks with snapshots; Prometheus scrapes the
agent every second (its own config, storage in a temp folder, a free loopback port). Once it
has seen round 0 progress, rank 1 is SIGKILLed: the group restarts and resumes. Once it has seen
round 1 progress and a commit of round 1, the test asks Prometheus's HTTP API (query,
query_range and raw samples): every series exists, train_step moved, `up` was 1 at every scrape,
elastic_restarts_total went from 0 to 1 (exactly one), no counter and no
ckpt_last_committed_step ever went down, the histograms have counts; every panel expression of
docs/grafana-dashboard.json returns data. /metrics is also read directly: content type, HELP and
TYPE for every family, no duplicate series, and promtool's lint. Then SIGTERM to the agent (a
preemption: exit 143) and the goodput report block is checked. The job has far more steps than
it runs, so the test does not depend on the machine's speed; every process is stopped by pid.
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import harness
from harness import TempDirTest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DASHBOARD = os.path.join(ROOT, "docs", "grafana-dashboard.json")
SLOW = os.environ.get("CKPT_SANITIZED") == "1"
T = 3.0 if SLOW else 1.0

TRAIN_ARGS = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
              "--global-batch", "24", "--micro-batch", "3", "--steps", "1000000", "--lr", "3e-3",
              "--warmup", "2", "--seed", "7", "--log-every", "1", "--eval-every", "20",
              "--val-samples", "24"]
STARTED_RE = re.compile(r"round (\d+): started ranks \d+\.\.\d+ of \d+ \(pids ([0-9 ]+)\)")

COUNTERS = ["elastic_restarts_total", "ckpt_snapshots_committed_total",
            "ckpt_snapshot_failures_total", "ckpt_snapshots_skipped_total",
            "ckpt_persist_bytes_total", "elastic_report_lines_total",
            "ckpt_snapshot_uploads_total", "ckpt_upload_bytes_total"]
HISTOGRAMS = ["train_step_seconds", "ckpt_snapshot_stall_seconds", "ckpt_persist_seconds"]
GAUGES = ["train_step", "train_loss", "train_val_loss", "train_learning_rate", "train_grad_norm",
          "train_tokens_per_second", "train_samples", "train_goodput_ratio", "elastic_world_size",
          "elastic_round", "elastic_rank_up", "ckpt_last_committed_step",
          "ckpt_last_commit_timestamp_seconds", "ckpt_restore_seconds"]
# the S3 uploader's gauges (train --s3): their families only, no sample in a job without S3
S3_GAUGES = ["ckpt_upload_lag_steps", "ckpt_upload_lag_seconds", "ckpt_last_uploaded_step"]
S3_SERIES = re.compile(r"\b(ckpt_upload_lag_\w+|ckpt_last_uploaded_step)\b")
GOODPUT_RE = re.compile(
    r"goodput: wall time (?P<wall>\S+) s\n.*goodput: productive steps (?P<prod>\S+) s .*?(?P<kept>\d+) "
    r"steps\)\n.*goodput: recomputed steps (?P<rec>\S+) s .*?(?P<recsteps>\d+) steps after "
    r"(?P<resumes>\d+) resume\(s\)\)\n.*goodput: lost to restarts (?P<lost>\S+) s .*?(?P<windows>\d+) "
    r"restart window\(s\), (?P<interrupts>\d+) interrupted round\(s\)\)\n.*goodput: snapshot stall "
    r"(?P<stall>\S+) s .*\n.*goodput: other (?P<other>\S+) s .*\n.*goodput: ratio (?P<ratio>\S+) ")


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def parse_exposition(text):
    """{series: value} of a text exposition; raises AssertionError on a sample before its
    family's HELP and TYPE, a duplicate series or a bad line."""
    families, series, help_of = {}, {}, {}
    fam = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in help_of, f"HELP of {name} twice"
            help_of[name] = True
            fam = name
            continue
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            assert name == fam and name not in families, f"TYPE {name} without its HELP"
            assert typ in ("counter", "gauge", "histogram", "summary", "untyped"), line
            families[name] = typ
            continue
        assert line and not line.startswith("#"), f"bad line {line!r}"
        key, value = line.rsplit(" ", 1)
        name = key.split("{", 1)[0]
        base = fam
        ok = name == base or (families.get(base) == "histogram" and
                              name in (base + "_bucket", base + "_sum", base + "_count"))
        assert ok, f"sample {key} outside its family {base}"
        assert key not in series, f"duplicate series {key}"
        series[key] = float(value)
    return families, series


class Prometheus:
    """Debian's prometheus on 127.0.0.1:port scraping target every second."""

    def __init__(self, tmp, target):
        self.port = harness.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cfg = os.path.join(tmp, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: elastic\n    static_configs:\n"
                    f"      - targets: ['{target}']\n")
        self.log_path = os.path.join(tmp, "prometheus.log")
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen(
            ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/prom-data",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp)

    def wait_ready(self, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.p.poll() is not None:
                raise AssertionError(f"prometheus exited {self.p.returncode}:\n"
                                     f"{harness.read(self.log_path)[-3000:]}")
            try:
                if http_get(self.base + "/-/ready", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"prometheus not ready within {timeout} s")

    def api(self, path, **params):
        url = f"{self.base}/api/v1/{path}?" + urllib.parse.urlencode(params)
        status, _, body = http_get(url, timeout=10)
        doc = json.loads(body)
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr, at=None):
        return self.api("query", query=expr, **({"time": at} if at else {}))["result"]

    def scalar(self, expr, at=None):
        """The value of a one-series instant query, None when there is none."""
        r = self.query(expr, at)
        return float(r[0]["value"][1]) if r else None

    def samples(self, selector, window="10m", at=None):
        """Raw samples [(t, v)] of each series of selector over window: {labels: list}."""
        out = {}
        for s in self.query(f"{selector}[{window}]", at):
            key = tuple(sorted(s["metric"].items()))
            out[key] = [(float(t), float(v)) for t, v in s["values"]]
        return out

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


class Metrics(TempDirTest):
    def setUp(self):
        super().setUp()
        if not shutil.which("prometheus") or not shutil.which("promtool"):
            self.fail("prometheus and promtool are needed (Debian package prometheus; "
                      "scripts/lib.sh installs it)")
        self.agent = self.prom = None
        self.agent_err = os.path.join(self.tmp, "agent.err")

    def tearDown(self):
        if self.agent and self.agent.poll() is None:
            self.agent.kill()  # its guardian kills the workers' process groups
            self.agent.wait()
        if self.prom:
            self.prom.stop()
        super().tearDown()

    def err(self):
        return harness.read(self.agent_err)

    def wait_for(self, regex, timeout):
        rx = re.compile(regex, re.M)
        deadline = time.time() + timeout * T
        while time.time() < deadline:
            m = rx.search(self.err())
            if m:
                return m
            if self.agent.poll() is not None:
                raise AssertionError(f"elastic exited {self.agent.returncode} before /{regex}/:\n"
                                     f"{self.err()[-3000:]}")
            time.sleep(0.02)
        raise AssertionError(f"no /{regex}/ within {timeout * T} s:\n{self.err()[-3000:]}")

    def until(self, what, fn, timeout):
        """Poll fn (a Prometheus question) until it returns a true value."""
        deadline = time.time() + timeout * T
        while time.time() < deadline:
            v = fn()
            if v:
                return v
            if self.agent.poll() is not None:
                raise AssertionError(f"elastic exited {self.agent.returncode} while waiting for "
                                     f"{what}:\n{self.err()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"Prometheus did not see {what} within {timeout * T} s:\n"
                             f"{self.err()[-2000:]}")

    def scrape_directly(self, mport):
        status, ctype, text = http_get(f"http://127.0.0.1:{mport}/metrics")
        self.assertEqual(status, 200)
        self.assertTrue(ctype.startswith("text/plain; version=0.0.4"), ctype)
        families, series = parse_exposition(text)
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=30)
        self.assertEqual(lint.returncode, 0, lint.stdout + lint.stderr)
        self.assertEqual((lint.stdout + lint.stderr).strip(), "", "promtool lint findings")
        return families, series

    def test_job_with_a_restart_seen_by_prometheus(self):
        t_start = time.time()
        mport = harness.free_port()
        ckpt = os.path.join(self.tmp, "ck")
        cmd = [harness.TRAIN] + harness.data_args() + TRAIN_ARGS + [
            "--ckpt-dir", ckpt, "--ckpt-every", "10", "--resume", "auto"]
        with open(os.path.join(self.tmp, "agent.out"), "w") as out, \
                open(self.agent_err, "w") as err:
            self.agent = subprocess.Popen(
                [harness.ELASTIC, "--nproc-per-node", "2", "--metrics-port", str(mport),
                 "--hang-timeout", "120", "--preempt-grace", "60", "--"] + cmd,
                stdout=out, stderr=err, env=harness.env())
        self.wait_for(rf"metrics on http://127\.0\.0\.1:{mport}/metrics", 10)
        self.prom = Prometheus(self.tmp, f"127.0.0.1:{mport}")
        self.prom.wait_ready(30 * T)
        p = self.prom

        # round 0 as Prometheus sees it: three scrapes with progress, no restart yet
        self.until("three scrapes of round 0",
                   lambda: (p.scalar("count_over_time(train_step[10m])") or 0) >= 3 and
                   p.scalar("elastic_round") == 0 and p.scalar("ckpt_last_committed_step"), 30)
        families, series = self.scrape_directly(mport)
        self.assertEqual(series['elastic_restarts_total'], 0)
        pids = [int(x) for x in STARTED_RE.search(self.err()).group(2).split()]
        os.kill(pids[1], signal.SIGKILL)
        t_kill = time.time()
        self.wait_for(r"round 1: started", 30)
        # from memory under elastic's memory tier (disk when the memory copy is not usable)
        resumed = int(self.wait_for(r"\[rank 0\] .*resumed from (?:\S+|memory \(\w+\)) at step (\d+)",
                                    30).group(1))
        # round 1: progress past the resume point and a commit of its own, three scrapes
        self.until("round 1 progress and a commit",
                   lambda: p.scalar("elastic_round") == 1 and
                   (p.scalar("count_over_time((elastic_round == 1)[10m:1s])") or 0) >= 3 and
                   (p.scalar("ckpt_last_committed_step") or 0) > resumed and
                   (p.scalar("train_step") or 0) > resumed + 5 and
                   (p.scalar('ckpt_restore_seconds{source="memory"}') is not None or
                    p.scalar('ckpt_restore_seconds{source="disk"}') is not None), 40)
        at = time.time()

        # every series exists
        for name in COUNTERS + GAUGES:
            self.assertTrue(p.query(name, at), f"no series {name}")
        for name in HISTOGRAMS:
            for suffix in ("_bucket", "_sum", "_count"):
                self.assertTrue(p.query(name + suffix, at), f"no series {name}{suffix}")
        for stage in ("stage", "persist"):
            self.assertEqual(p.scalar(f'ckpt_snapshot_failures_total{{stage="{stage}"}}', at), 0)
        for rank in (0, 1):
            self.assertEqual(p.scalar(f'elastic_rank_up{{rank="{rank}"}}', at), 1)
        self.assertEqual(p.scalar("elastic_world_size", at), 2)
        self.assertEqual(p.scalar('elastic_report_lines_total{outcome="malformed"}', at), 0)
        self.assertIsNotNone(p.scalar('ckpt_restore_seconds{source="none"}', at))

        # up was 1 at every scrape: no scrape failed, Prometheus parsed every text
        ups = p.samples('up{job="elastic"}', at=at)
        self.assertEqual(len(ups), 1, ups)
        up = list(ups.values())[0]
        self.assertGreaterEqual(len(up), 6, up)
        self.assertEqual({v for _, v in up}, {1.0}, up)
        self.assertGreater(p.scalar('min_over_time(scrape_samples_scraped{job="elastic"}[10m])',
                                    at), 60)  # the histograms alone have 63

        # train_step moved, and went back at the resume
        steps = [v for _, v in list(p.samples("train_step", at=at).values())[0]]
        self.assertLess(min(steps), max(steps))
        self.assertGreater(steps[-1], resumed)

        # the restart counter went up by exactly one; counters never went down
        restarts = [v for _, v in list(p.samples("elastic_restarts_total", at=at).values())[0]]
        self.assertEqual((restarts[0], restarts[-1]), (0.0, 1.0), restarts)
        for name in COUNTERS + [h + s for h in HISTOGRAMS for s in ("_count", "_sum")]:
            for labels, vals in p.samples(name, at=at).items():
                vs = [v for _, v in vals]
                self.assertEqual(vs, sorted(vs), f"{name}{dict(labels)} went down: {vs}")
        self.assertEqual(p.scalar("resets(ckpt_snapshots_committed_total[10m])", at), 0)
        committed = [v for _, v in list(p.samples("ckpt_snapshots_committed_total",
                                                  at=at).values())[0]]
        self.assertGreater(committed[-1], committed[0])

        # the last committed step never went down
        last = [v for _, v in list(p.samples("ckpt_last_committed_step", at=at).values())[0]]
        self.assertEqual(last, sorted(last), last)
        self.assertGreater(last[-1], last[0])

        # the histograms have counts, and +Inf equals the count
        for name in HISTOGRAMS:
            n = p.scalar(f"sum({name}_count)", at)
            self.assertGreater(n, 0, name)
            self.assertEqual(p.scalar(f'sum({name}_bucket{{le="+Inf"}})', at), n, name)
            self.assertGreater(p.scalar(f"sum({name}_sum)", at), 0, name)
        q = p.scalar("histogram_quantile(0.99, sum by (le) "
                     "(rate(ckpt_snapshot_stall_seconds_bucket[10m])))", at)
        self.assertTrue(q is not None and 0 < q <= 600, q)

        goodput = p.scalar("train_goodput_ratio", at)
        self.assertTrue(0 < goodput <= 1, goodput)

        # every panel of the dashboard has data in this Prometheus; the S3 lag's gauges have
        # no sample without train --s3: there the query must only be valid (p.query checks)
        with open(DASHBOARD) as f:
            dash = json.load(f)
        exprs = [(panel["title"], t["expr"]) for panel in dash["panels"]
                 for t in panel.get("targets", [])]
        self.assertGreaterEqual(len(exprs), 12)
        for title, expr in exprs:
            e = expr.replace("$__rate_interval", "1m").replace("${instance:regex}", ".+") \
                    .replace("$instance", ".+")
            self.assertNotIn("$", e, f"{title}: a variable the test cannot fill in: {expr}")
            r = p.query(e, at)
            if S3_SERIES.search(e):
                self.assertEqual(r, [], f"panel {title!r}: data without --s3: {e}")
                continue
            vals = [float(s["value"][1]) for s in r]
            self.assertTrue(vals and any(math.isfinite(v) for v in vals),
                            f"panel {title!r}: no data for {e}: {r}")

        # the direct scrape again, after the restart
        families, series = self.scrape_directly(mport)
        for name in COUNTERS + GAUGES + HISTOGRAMS:
            self.assertIn(name, families)
        self.assertEqual(series["elastic_restarts_total"], 1)
        self.assertEqual(series['elastic_round{node="0"}'], 1)
        # no --s3: the upload counters at 0, the lag gauges without a sample
        for result in ("done", "failed", "skipped"):
            self.assertEqual(series[f'ckpt_snapshot_uploads_total{{result="{result}"}}'], 0)
        self.assertEqual(series["ckpt_upload_bytes_total"], 0)
        for name in S3_GAUGES:
            self.assertEqual(families.get(name), "gauge", name)
            self.assertFalse([k for k in series if k.split("{")[0] == name], name)

        # preemption: the ranks take a final snapshot, the agent exits 143 with its report
        self.agent.send_signal(signal.SIGTERM)
        self.assertEqual(self.agent.wait(timeout=90 * T), 143, self.err()[-3000:])
        err = self.err()
        m = GOODPUT_RE.search(err)
        self.assertIsNotNone(m, err[-3000:])
        g = {k: float(v) for k, v in m.groupdict().items()}
        self.assertGreater(g["wall"], 0)
        self.assertGreater(g["prod"], 0)
        self.assertGreater(g["lost"], 0)  # kill -> first step of round 1
        self.assertLess(g["lost"], time.time() - t_kill)
        self.assertEqual(g["windows"], 1)
        self.assertEqual(g["interrupts"], 2)  # the failure, then the preemption
        self.assertEqual(g["resumes"], 1 if g["recsteps"] > 0 else 0)
        self.assertGreaterEqual(g["recsteps"], 0)
        # at most the steps since the newest commit (one interval, two while one persists)
        self.assertLessEqual(g["recsteps"], 2 * 10 + 2)
        total = g["prod"] + g["rec"] + g["lost"] + g["stall"] + g["other"]
        self.assertAlmostEqual(total, g["wall"], delta=0.01)
        self.assertAlmostEqual(g["ratio"], g["prod"] / g["wall"], delta=1e-3)
        report = "\n".join(l for l in err.splitlines() if "] goodput" in l)
        print(f"\n  seen by Prometheus: steps {min(steps):.0f}..{max(steps):.0f}, restarts "
              f"{restarts[0]:.0f}->{restarts[-1]:.0f}, last committed {last[0]:.0f}->"
              f"{last[-1]:.0f}, commits {committed[0]:.0f}->{committed[-1]:.0f}, goodput "
              f"{goodput:.3f}, {len(up)} scrapes, test {time.time() - t_start:.1f} s\n{report}",
              file=sys.stderr)


# A worker that writes hostile progress lines, then waits (bounded) for the test to scrape.
HOSTILE_WORKER = r"""
import os, sys, time
fd = int(os.environ["ELASTIC_HEARTBEAT_FD"])
lines = [b"step 3 seconds=0.25 loss=2.5", b"\x00\x01\xff garbage", b"step 5\r",
         b"x" * 10000, b"step 99999999999999999999999", b"step 4 seconds=nan",
         b"snapshot_done step=1 result=7", b"restore step=1 seconds=1 source=../../etc",
         b"val step=1 loss", b"", b"   ", b"future_event step=3 colour=blue",
         b"step 7 seconds=0.5 loss=inf tokens_per_second=1e999 samples=18446744073709551615",
         b"snapshot_done step=7 result=0 persist_seconds=0.1 stored_bytes=18446744073709551615"]
for l in lines:
    os.write(fd, l + b"\n")
os.write(fd, b"step 8 seconds=0.5 partial line never ended")
print("written", flush=True)
deadline = time.time() + 60
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.02)
"""


# Two ranks reporting the S3 uploader's outcomes as train --s3 writes them (train/report.c
# train_report_upload): rank 0 with its lag view, rank 1 with the placeholders; then waits.
UPLOAD_WORKER = r"""
import os, sys, time
fd = int(os.environ["ELASTIC_HEARTBEAT_FD"])
rank = int(os.environ["RANK"])
def up(kind, step, nbytes, secs, result, lag_steps, lag_seconds, remote):
    if rank != 0:
        lag_steps, lag_seconds, remote = 0, 0, -1
    os.write(fd, (f"upload_{kind} step={step} bytes={nbytes} seconds={secs:.9g} result={result} "
                  f"lag_steps={lag_steps} lag_seconds={lag_seconds:.9g} remote_step={remote}\n")
             .encode())
os.write(fd, b"step 10 seconds=0.25\n")
up("failed", 10, 0, 30.5, -110, 10, 31, -1)
up("done", 20, 1000 + rank, 2.5, 0, 0, 0, 20)
up("done", 30, 2000 + rank, 2.5, 0, 0, 0, 30)
up("skipped", 40, 0, 0, -125, 10, 4.5, 30)
os.write(fd, b"upload_done step=50 result=0 remote_step=-7\n")  # malformed
print("written", flush=True)
deadline = time.time() + 60
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.02)
"""


class Uploads(TempDirTest):
    def test_upload_lines_become_series(self):
        """The uploader's report lines (no S3 server: a stand-in worker writes them): one count
        per snapshot and outcome from the first rank, the bytes of both ranks, the lag gauges
        from rank 0's lines only, and a text promtool accepts."""
        mport = harness.free_port()
        release = os.path.join(self.tmp, "release")
        worker = os.path.join(self.tmp, "upload.py")
        with open(worker, "w") as f:
            f.write(UPLOAD_WORKER)
        err_path = os.path.join(self.tmp, "agent.err")
        out_path = os.path.join(self.tmp, "agent.out")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            agent = subprocess.Popen([harness.ELASTIC, "--nproc-per-node", "2", "--metrics-port",
                                      str(mport), "--", sys.executable, worker, release],
                                     stdout=out, stderr=err, env=harness.env())
        try:
            deadline = time.time() + 30 * T
            while harness.read(out_path).count("written") < 2 and time.time() < deadline:
                self.assertIsNone(agent.poll(), harness.read(err_path))
                time.sleep(0.02)
            while time.time() < deadline:  # until the agent has read all 2 x 6 lines
                status, ctype, text = http_get(f"http://127.0.0.1:{mport}/metrics")
                families, series = parse_exposition(text)
                if sum(v for k, v in series.items()
                       if k.startswith("elastic_report_lines_total")) >= 12:
                    break
                time.sleep(0.02)
            lint = subprocess.run(["promtool", "check", "metrics"], input=text,
                                  capture_output=True, text=True, timeout=30)
            self.assertEqual(lint.returncode, 0, lint.stdout + lint.stderr)
            self.assertEqual((lint.stdout + lint.stderr).strip(), "", "promtool lint findings")
            self.assertEqual(series['elastic_report_lines_total{outcome="malformed"}'], 2)
            self.assertEqual(series['elastic_report_lines_total{outcome="ok"}'], 10)
            self.assertEqual(families["ckpt_snapshot_uploads_total"], "counter")
            self.assertEqual(series['ckpt_snapshot_uploads_total{result="done"}'], 2)
            self.assertEqual(series['ckpt_snapshot_uploads_total{result="failed"}'], 1)
            self.assertEqual(series['ckpt_snapshot_uploads_total{result="skipped"}'], 1)
            self.assertEqual(series["ckpt_upload_bytes_total"], 1000 + 1001 + 2000 + 2001)
            self.assertEqual(series['ckpt_upload_lag_steps{node="0"}'], 10)
            self.assertEqual(series['ckpt_upload_lag_seconds{node="0"}'], 4.5)
            self.assertEqual(series['ckpt_last_uploaded_step{node="0"}'], 30)
            with open(release, "w"):
                pass
            self.assertEqual(agent.wait(timeout=30 * T), 0, harness.read(err_path))
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


class Lines(TempDirTest):
    def test_hostile_lines_neither_crash_nor_block(self):
        """Malformed, huge, binary and unknown lines from a worker are counted and ignored;
        the valid ones in between are taken (NaN/Inf kept, huge counters exact), the text
        stays valid, and the agent runs on to a normal exit."""
        mport = harness.free_port()
        release = os.path.join(self.tmp, "release")
        worker = os.path.join(self.tmp, "hostile.py")
        with open(worker, "w") as f:
            f.write(HOSTILE_WORKER)
        err_path = os.path.join(self.tmp, "agent.err")
        out_path = os.path.join(self.tmp, "agent.out")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            agent = subprocess.Popen([harness.ELASTIC, "--nproc-per-node", "1", "--metrics-port",
                                      str(mport), "--", sys.executable, worker, release],
                                     stdout=out, stderr=err, env=harness.env())
        try:
            deadline = time.time() + 30 * T
            while "written" not in harness.read(out_path) and time.time() < deadline:
                self.assertIsNone(agent.poll(), harness.read(err_path))
                time.sleep(0.02)
            while time.time() < deadline:  # until the agent has read all 14 lines
                status, ctype, text = http_get(f"http://127.0.0.1:{mport}/metrics")
                families, series = parse_exposition(text)
                if sum(v for k, v in series.items()
                       if k.startswith("elastic_report_lines_total")) >= 14:
                    break
                time.sleep(0.02)
            lint = subprocess.run(["promtool", "check", "metrics"], input=text,
                                  capture_output=True, text=True, timeout=30)
            self.assertEqual(lint.returncode, 0, lint.stdout + lint.stderr)
            self.assertEqual(series['train_step{node="0"}'], 7)
            self.assertEqual(series['train_loss{node="0"}'], math.inf)
            self.assertEqual(series['train_tokens_per_second{node="0"}'], math.inf)
            self.assertEqual(series['train_samples{node="0"}'], float(2 ** 64))  # a double
            self.assertIn("ckpt_persist_bytes_total 18446744073709551615\n", text)
            self.assertEqual(series["ckpt_snapshots_committed_total"], 1)
            self.assertEqual(series['ckpt_last_committed_step{node="0"}'], 7)
            self.assertEqual(series['elastic_report_lines_total{outcome="ok"}'], 3)
            self.assertEqual(series['elastic_report_lines_total{outcome="unknown"}'], 1)
            # garbage, \r, the long line, the huge step, nan seconds, result 7, the bad
            # source, val without a value, the empty and the blank line
            self.assertEqual(series['elastic_report_lines_total{outcome="malformed"}'], 10)
            self.assertNotIn("etc", text)
            with open(release, "w"):
                pass
            self.assertEqual(agent.wait(timeout=30 * T), 0, harness.read(err_path))
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        self.assertIn("goodput: ratio", harness.read(err_path))


class Cli(TempDirTest):
    def test_metrics_flags(self):
        """--metrics-port is in --help; a bad port or address is a usage error (one line); a
        busy port fails before any worker starts (exit 1, one line naming it)."""
        p = harness.run([harness.ELASTIC, "--help"])
        self.assertIn("--metrics-port", p.stdout)
        self.assertIn("--metrics-addr", p.stdout)
        for args in (["--metrics-port", "x"], ["--metrics-port", "65536"],
                     ["--metrics-port", "-1"], ["--metrics-addr", ""], ["--metrics-port"]):
            p = harness.run([harness.ELASTIC, "--nproc-per-node", "1"] + args + ["--", "true"],
                            timeout=30)
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        p = harness.run([harness.ELASTIC, "--nproc-per-node", "1", "--metrics-port", "1",
                         "--metrics-addr", "no-such-host.invalid", "--", "true"], timeout=30)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--metrics-addr no-such-host.invalid", p.stderr)
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
            port = s.getsockname()[1]
            marker = os.path.join(self.tmp, "ran")
            p = harness.run([harness.ELASTIC, "--nproc-per-node", "1", "--metrics-port",
                             str(port), "--", "touch", marker], timeout=30)
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertIn(f"cannot serve metrics on 127.0.0.1:{port}: Address already in use",
                          p.stderr)
            self.assertEqual(len(re.findall("ERROR", p.stderr)), 1, p.stderr)
            self.assertFalse(os.path.exists(marker), "a worker ran")


if __name__ == "__main__":
    harness.main()
