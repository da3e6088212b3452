"""Test fixtures for a real S3 server (Python standard library only).

  RGW         a single-node Ceph cluster (one mon, one bluestore OSD on a sparse file, no
              mgr, auth none) plus radosgw, started without systemd in a temp folder on free
              loopback ports. A strong server: atomic PUTs, data kept across restarts.
  S3rver      the npm package s3rver (tests/.npm, installed by scripts/lib.sh install_s3rver):
              a deliberately weak server (an interrupted PUT leaves a partial object).
  FaultProxy  a fault-injecting HTTP/1.1 reverse proxy in front of either (hang, error
              status, error in a 200, body cut short, connection reset, interrupted upload,
              delay), rules chosen at run time, thread-safe, counted.
  S3Client    a tiny SigV4 client (http.client) for quick puts/gets/lists without awscli's
              half-second start-up.

Starting RGW costs seconds: tests should share one cluster with shared_rgw() (started once
per process, stopped atexit) and use their own buckets (rgw.make_bucket() makes a unique one).

    import s3env
    rgw = s3env.shared_rgw()
    bucket = rgw.make_bucket()
    rgw.aws("s3", "cp", path, f"s3://{bucket}/k")          # /usr/bin/aws, exit status checked
    with s3env.FaultProxy(rgw.endpoint) as proxy:
        rule = proxy.add_rule("status:503:SlowDown", method="PUT", match="rank-00001", count=2)
        subprocess.run([...], env=rgw.env({"AWS_ENDPOINT_URL": proxy.endpoint}))
        assert rule.hits == 2 and proxy.count("PUT") >= 3

Every wait has a timeout; every server listens on a free 127.0.0.1 port; every process is
stopped by its pid (after checking /proc/PID/stat and comm). Daemons started from the main
thread get PR_SET_PDEATHSIG=SIGKILL (util-linux setpriv), so they die with the test process
even when it is SIGKILLed.

Measured on Debian 12, 2 cores (Ceph 16.2.15, awscli 2.9.19): RGW's first start (mkfs) to a
signed request 2.0-2.5 s, a restart on kept data 1.1 s, radosgw alone 0.1 s; stop() 0.1 s
(0.5 s with keep); 130 MiB resident at start, 230 MiB after 80 MiB of PUTs. After a
kill_rgw(), the first radosgw-admin change (add_key/remove_key) takes up to 5 s: it waits for
the dead radosgw's watches to time out. awscli crashes on some RGW error
bodies (empty Message): check exit statuses, not text. awscli 2.9 ignores AWS_ENDPOINT_URL
(aws() passes --endpoint-url). libs3 refuses one-character bucket names.
"""
import atexit
import datetime
import hashlib
import hmac
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
import xml.etree.ElementTree as ET

AWS = "/usr/bin/aws"  # not the pyenv shim named aws that may come first on PATH
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NPM_PREFIX = os.path.join(REPO, "tests", ".npm")  # scripts/lib.sh install_s3rver
S3RVER_JS = os.path.join(NPM_PREFIX, "node_modules", "s3rver", "bin", "s3rver.js")
REGION = "us-east-1"

# Variables that would make awscli (or a client) use something other than what env() says.
_AWS_SCRUB = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
              "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CA_BUNDLE", "AWS_ENDPOINT_URL_S3",
              "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


class S3EnvError(RuntimeError):
    """A fixture could not start (the message carries the daemons' log tails) or stop."""


# ---------------------------------------------------------------------------------------
# small helpers: ports, processes


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port):
    """True when nothing listens on 127.0.0.1:port (TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def proc_state(pid):
    """(state letter, comm) of a pid from /proc, or (None, None) when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return None, None
    return stat[stat.rfind(")") + 2:].split(" ", 1)[0], comm


def signal_proc(proc, sig, comms):
    """Send sig to a subprocess.Popen we started, only if it is alive (not a zombie) and its
    comm is one of comms. Returns True when signalled."""
    if proc is None or proc.poll() is not None:
        return False
    state, comm = proc_state(proc.pid)
    if state is None or state in ("Z", "X") or comm not in comms:
        return False
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop_proc(proc, comms, term_timeout=10.0, sig=signal.SIGTERM):
    """Stop a Popen: sig (SIGTERM by default), wait up to term_timeout, then SIGKILL and
    wait (bounded). Returns the exit status (None if it would not die)."""
    if proc is None:
        return None
    if signal_proc(proc, sig, comms) and sig != signal.SIGKILL:
        try:
            return proc.wait(term_timeout)
        except subprocess.TimeoutExpired:
            pass
    signal_proc(proc, signal.SIGKILL, comms)
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        return None


def _tail(path, lines=30):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _spawn(argv, log_path, env, cwd):
    """Popen with stdout+stderr appended to log_path; PR_SET_PDEATHSIG=SIGKILL (via setpriv,
    which execs, so the pid is the daemon's) when called from the main thread."""
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
    if setpriv and threading.current_thread() is threading.main_thread():
        argv = [setpriv, "--pdeathsig", "KILL", "--"] + list(argv)
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, close_fds=True)


def _proc_start(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # starttime
    except (OSError, IndexError):
        return None


def _claim_dir(path):
    """Write the owner (this process) into a temp folder we made, for sweep_stale()."""
    with open(os.path.join(path, "s3env-owner"), "w") as f:
        f.write(f"{os.getpid()} {_proc_start(os.getpid())}\n")


def sweep_stale(prefixes=("s3env-rgw-", "s3env-s3rver-")):
    """Remove the temp folders of RGW/S3rver instances whose owning process is gone (a test
    SIGKILLed before its atexit ran) and that no running process names on its command line.
    Called when an instance makes its own temp folder."""
    base = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(base) if n.startswith(tuple(prefixes))]
    except OSError:
        return
    if not names:
        return
    cmdlines = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmdlines.append(f.read())
            except OSError:
                pass
    for n in names:
        d = os.path.join(base, n)
        try:
            with open(os.path.join(d, "s3env-owner")) as f:
                pid, start = f.read().split()
        except (OSError, ValueError):
            continue  # not claimed (yet): leave it alone
        if _proc_start(int(pid)) == start:
            continue
        if any(d.encode() in c for c in cmdlines):
            continue
        shutil.rmtree(d, ignore_errors=True)


def _write_aws_config(path):
    # path-style addressing (virtual hosts of 127.0.0.1 do not resolve)
    with open(path, "w") as f:
        f.write(f"[default]\nregion = {REGION}\ns3 =\n    addressing_style = path\n")


def _aws_env(endpoint, access, secret, config_file, extra=None, base=None):
    e = dict(os.environ if base is None else base)
    for k in _AWS_SCRUB:
        e.pop(k, None)
    host = urllib.parse.urlsplit(endpoint).netloc
    e.update({
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": access,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": config_file,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_PAGER": "",
        "AWS_CLI_AUTO_PROMPT": "off",
        # the names libs3's tool reads
        "S3_HOSTNAME": host,
        "S3_ACCESS_KEY_ID": access,
        "S3_SECRET_ACCESS_KEY": secret,
    })
    if extra:
        e.update(extra)
    return e


class AwsError(subprocess.CalledProcessError):
    def __str__(self):
        return (f"aws {' '.join(self.cmd[3:])} exited with {self.returncode}\n"
                f"stdout: {self.stdout[-2000:] if self.stdout else ''}\n"
                f"stderr: {self.stderr[-2000:] if self.stderr else ''}")


def run_aws(endpoint, env, args, check=True, timeout=120, **kw):
    """Run /usr/bin/aws --endpoint-url ENDPOINT ARGS with env; CompletedProcess (text)."""
    cmd = [AWS, "--endpoint-url", endpoint] + [str(a) for a in args]
    env = dict(env)
    for k in ("PYTHONPATH", "PYTHONHOME"):  # /usr/bin/aws runs Debian's python3
        env.pop(k, None)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AwsError(p.returncode, cmd, p.stdout, p.stderr)
    return p


_bucket_seq = [0]


def unique_bucket(prefix="t"):
    """A bucket name unique in this process (3-63 lowercase characters)."""
    _bucket_seq[0] += 1
    return f"{prefix}-{os.getpid()}-{_bucket_seq[0]}-{uuid.uuid4().hex[:6]}"[:63]


# ---------------------------------------------------------------------------------------
# a small SigV4 client


class S3Error(Exception):
    def __init__(self, status, code, body, method, path):
        self.status, self.code, self.body = status, code, body
        super().__init__(f"{method} {path}: HTTP {status} {code}")


def _q(s, safe="-_.~"):
    return urllib.parse.quote(s, safe=safe)


class S3Client:
    """Minimal path-style S3 client signing with AWS Signature V4 (one connection a request).

    request() returns (status, headers as a dict with lowercase names, body bytes) and raises
    only for transport errors; the helpers raise S3Error for non-2xx answers."""

    def __init__(self, endpoint, access_key, secret_key, region=REGION, timeout=30.0):
        u = urllib.parse.urlsplit(endpoint)
        self.endpoint, self.host, self.port = endpoint, u.hostname, u.port or 80
        self.netloc = u.netloc
        self.access_key, self.secret_key, self.region, self.timeout = access_key, secret_key, region, timeout

    def _sign(self, method, path, query, headers, payload_hash):
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = dict(headers)
        headers["host"] = self.netloc
        headers["x-amz-date"] = amz_date
        headers["x-amz-content-sha256"] = payload_hash
        lower = {k.lower(): str(v).strip() for k, v in headers.items()}
        names = sorted(lower)
        canonical_query = "&".join(f"{_q(k)}={_q(v)}" for k, v in sorted(query))
        canonical = "\n".join([method, _q(path, safe="/-_.~"), canonical_query,
                               "".join(f"{n}:{lower[n]}\n" for n in names), ";".join(names), payload_hash])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key = ("AWS4" + self.secret_key).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                                    f"SignedHeaders={';'.join(names)}, Signature={sig}")
        return headers

    def request(self, method, bucket=None, key=None, body=b"", query=None, headers=None):
        path = "/" + (bucket or "") + ("/" + key if key is not None else "")
        query = list((query or {}).items()) if isinstance(query, dict) else list(query or [])
        body = body or b""
        h = self._sign(method, path, query, headers or {}, hashlib.sha256(body).hexdigest())
        url = _q(path, safe="/-_.~")
        if query:
            url += "?" + "&".join(f"{_q(k)}={_q(v)}" for k, v in query)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, url, body=body if body or method in ("PUT", "POST") else None, headers=h)
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            conn.close()

    def _ok(self, method, bucket=None, key=None, **kw):
        status, headers, data = self.request(method, bucket, key, **kw)
        if not 200 <= status < 300:
            m = re.search(rb"<Code>([^<]*)</Code>", data)
            raise S3Error(status, m.group(1).decode() if m else "", data, method,
                          f"/{bucket or ''}/{key or ''}")
        return status, headers, data

    def make_bucket(self, bucket):
        self._ok("PUT", bucket)

    def put(self, bucket, key, data, headers=None):
        """PUT an object; returns its ETag."""
        return self._ok("PUT", bucket, key, body=data, headers=headers)[1].get("etag", "").strip('"')

    def get(self, bucket, key, range=None):
        """The object's bytes; range=(first, last) inclusive for a ranged GET."""
        h = {"Range": f"bytes={range[0]}-{range[1]}"} if range else None
        return self._ok("GET", bucket, key, headers=h)[2]

    def head(self, bucket, key):
        """The object's headers (dict, lowercase names), or None when it does not exist."""
        status, headers, _ = self.request("HEAD", bucket, key)
        if status == 404:
            return None
        if not 200 <= status < 300:
            raise S3Error(status, "", b"", "HEAD", f"/{bucket}/{key}")
        return headers

    def delete(self, bucket, key):
        self._ok("DELETE", bucket, key)

    def list(self, bucket, prefix=""):
        """All keys under prefix (ListObjectsV2, following continuation tokens)."""
        keys, token = [], None
        while True:
            q = [("list-type", "2"), ("prefix", prefix)] + ([("continuation-token", token)] if token else [])
            data = self._ok("GET", bucket, query=q)[2]
            root = ET.fromstring(data)
            ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            keys += [c.findtext(f"{ns}Key") for c in root.iter(f"{ns}Contents")]
            if root.findtext(f"{ns}IsTruncated") != "true":
                return keys
            token = root.findtext(f"{ns}NextContinuationToken")

    def list_buckets(self):
        data = self._ok("GET")[2]
        return re.findall(r"<Name>([^<]*)</Name>", data.decode())


# ---------------------------------------------------------------------------------------
# RGW: Ceph mon + OSD + radosgw

CEPH_CONF = """\
[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
mon initial members = a
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
# without these radosgw waits 300 s for cephx
ms mon client mode = crc
ms client mode = crc
ms cluster mode = crc
ms service mode = crc
ms bind msgr1 = false
ms bind msgr2 = true
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
# a mon below 5 % free disk shuts itself down: the host's disk is not ours to judge
mon data avail warn = 1
mon data avail crit = 0
osd crush chooseleaf type = 0
# pool creation 9 s -> 0.5 s
paxos propose interval = 0.05
run dir = {d}/run
log file = {d}/log/$name.log
admin socket = {d}/run/$name.asok
pid file = {d}/run/$name.pid
keyring = /dev/null
log to stderr = false
# a SIGKILLed radosgw's watches on its control objects live this long, and every
# radosgw-admin change (key create/rm) waits for them: 30 s by default. Clients ping their
# watches every objecter tick.
osd client watch timeout = 5
objecter tick interval = 1
[mon]
mon data = {d}/mon/$name
[osd]
osd data = {d}/osd/$name
osd objectstore = bluestore
# mkfs creates the sparse block file (setting bluestore block path to it fails with ELOOP)
bluestore block create = true
bluestore block size = {block_size}
bluestore fsck on mkfs = false
bluestore cache autotune = false
bluestore cache size = 134217728
bdev aio poll ms = 20
osd op num shards = 1
osd op num threads per shard = 2
[client.rgw]
rgw data = {d}/rgw
rgw enable apis = s3, admin
rgw thread pool size = 64
rgw enable usage log = false
rgw dynamic resharding = false
"""


class RGW:
    """A single-node Ceph cluster + radosgw in tmpdir (a new temp folder when None).

    start() makes the file systems on the first start (tmpdir without ceph.conf), starts
    mon, OSD and radosgw, creates the user `uid` with the fixed access/secret key and returns
    once a signed S3 request succeeds; on failure (or after `timeout` seconds) it raises
    S3EnvError with the daemons' log tails. With keep=True, stop() leaves tmpdir, and a
    later RGW(tmpdir).start() finds the data (and the ports) again."""

    DAEMONS = (("mon", "ceph-mon"), ("osd", "ceph-osd"), ("rgw", "radosgw"))

    def __init__(self, tmpdir=None, keep=False, access_key="CKPTTESTACCESSKEY001",
                 secret_key="ckpt-test-secret-key-0000000000000000001", uid="ckpt-test",
                 port=None, timeout=60.0, block_size=16 << 30):
        self.own_dir = tmpdir is None
        if tmpdir is None:
            sweep_stale()
            self.dir = tempfile.mkdtemp(prefix="s3env-rgw-")
            _claim_dir(self.dir)
        else:
            self.dir = os.path.abspath(tmpdir)
            os.makedirs(self.dir, exist_ok=True)
        self.keep, self.uid, self.timeout, self.block_size = keep, uid, timeout, block_size
        self.access_key, self.secret_key = access_key, secret_key
        self.conf = os.path.join(self.dir, "ceph.conf")
        self.state_path = os.path.join(self.dir, "s3env-state.json")
        self.aws_config = os.path.join(self.dir, "aws-config")
        self.port = port
        self.procs = {}  # "mon"/"osd"/"rgw" -> Popen
        self.stopped = False
        self.timings = {}
        self._state = {}

    # -- public API
    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def __repr__(self):
        return f"RGW({self.endpoint}, dir={self.dir})"

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        if any(p.poll() is None for p in self.procs.values()):
            raise S3EnvError(f"{self!r} is already started")
        self.stopped = False
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        for prog in ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool"):
            if not shutil.which(prog, path="/usr/bin:/bin:/usr/sbin:/sbin"):
                raise S3EnvError(f"{prog} is not installed (scripts/test installs the Debian packages "
                                 "ceph-mon ceph-osd radosgw ceph-common)")
        try:
            fresh = not os.path.exists(self.state_path)
            if fresh:
                self._mkfs_mon()
            else:
                with open(self.state_path) as f:
                    self._state = json.load(f)
                if self.port is None:
                    self.port = self._state.get("rgw_port")
            self._start_daemon("mon", ["ceph-mon", "-f", "-c", self.conf, "-i", "a"])
            self.timings["mon"] = time.monotonic() - t0
            if fresh:
                self._mkfs_osd(deadline)
            self._start_daemon("osd", ["ceph-osd", "-f", "-c", self.conf, "-i", "0"])
            self._wait_osd_up(deadline)
            self.timings["osd"] = time.monotonic() - t0
            self._start_rgw(deadline)
            if not self._state.get("user"):
                self.admin("user", "create", f"--uid={self.uid}", f"--display-name={self.uid}",
                           f"--access-key={self.access_key}", f"--secret-key={self.secret_key}",
                           deadline=deadline)
                self._state["user"] = self.uid
                self._save_state()
            else:
                self.uid = self._state["user"]
            self._wait_s3(self.access_key, self.secret_key, True, deadline)
            self.timings["ready"] = time.monotonic() - t0
            _write_aws_config(self.aws_config)
        except BaseException:
            logs = self.logs()
            self._stop_daemons(signal.SIGKILL)
            self.stopped = True
            if self.own_dir and not self.keep:  # the log tails go into the exception
                shutil.rmtree(self.dir, ignore_errors=True)
            if isinstance(sys.exc_info()[1], S3EnvError):
                raise S3EnvError(f"{sys.exc_info()[1]}\n{logs}") from None
            raise
        return self

    def env(self, extra=None, base=None):
        """os.environ (or base) with the S3 variables for this server (AWS_ENDPOINT_URL,
        AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION=us-east-1, AWS_CONFIG_FILE
        with path-style addressing, AWS_EC2_METADATA_DISABLED=true, AWS_PAGER='',
        S3_HOSTNAME/S3_ACCESS_KEY_ID/S3_SECRET_ACCESS_KEY for libs3) and extra on top."""
        return _aws_env(self.endpoint, self.access_key, self.secret_key, self.aws_config, extra, base)

    def aws(self, *args, check=True, timeout=120, endpoint=None, extra_env=None, **kw):
        """Run /usr/bin/aws --endpoint-url ENDPOINT ARGS (endpoint: this server's unless
        given, e.g. a FaultProxy's); raises AwsError when check and the exit status is not 0."""
        return run_aws(endpoint or self.endpoint, self.env(extra_env), args, check, timeout, **kw)

    def client(self, access_key=None, secret_key=None, endpoint=None, timeout=30.0):
        """An S3Client for this server (or endpoint), with this user's keys unless given."""
        return S3Client(endpoint or self.endpoint, access_key or self.access_key,
                        secret_key or self.secret_key, timeout=timeout)

    def make_bucket(self, name=None):
        """Create a bucket (a unique name when None); returns its name."""
        name = name or unique_bucket("rgw")
        self.client().make_bucket(name)
        return name

    def admin(self, *args, deadline=None, timeout=30.0):
        """Run radosgw-admin ARGS on this cluster; returns its stdout (raises S3EnvError)."""
        return self._run(["radosgw-admin", "-c", self.conf] + list(args), deadline, timeout)

    def add_user(self, uid, access_key, secret_key):
        self.admin("user", "create", f"--uid={uid}", f"--display-name={uid}",
                   f"--access-key={access_key}", f"--secret-key={secret_key}")
        self._wait_s3(access_key, secret_key, True, time.monotonic() + 15)

    def add_key(self, access_key, secret_key, uid=None, wait=True):
        """Give the user (this RGW's unless uid) one more S3 key; with wait, returns once
        radosgw accepts it."""
        self.admin("key", "create", f"--uid={uid or self.uid}", "--key-type=s3",
                   f"--access-key={access_key}", f"--secret-key={secret_key}")
        if wait:
            self._wait_s3(access_key, secret_key, True, time.monotonic() + 15)

    def remove_key(self, access_key, uid=None, wait=True):
        """Revoke an S3 key; with wait, returns once radosgw refuses it (403)."""
        secret = None
        if wait:
            info = json.loads(self.admin("user", "info", f"--uid={uid or self.uid}"))
            secret = next((k["secret_key"] for k in info.get("keys", []) if k["access_key"] == access_key), None)
        self.admin("key", "rm", f"--uid={uid or self.uid}", "--key-type=s3", f"--access-key={access_key}")
        if wait and secret is not None:
            self._wait_s3(access_key, secret, False, time.monotonic() + 15)

    def kill_rgw(self):
        """SIGKILL radosgw only (mon and OSD keep running); waits for it to exit."""
        stop_proc(self.procs.pop("rgw", None), ("radosgw", "setpriv"), sig=signal.SIGKILL)

    def start_rgw(self, timeout=None):
        """(Re)start radosgw on the same port; returns when a signed request succeeds."""
        self.kill_rgw()
        deadline = time.monotonic() + (timeout or self.timeout)
        try:
            self._start_rgw(deadline)
            self._wait_s3(self.access_key, self.secret_key, True, deadline)
        except S3EnvError as e:
            raise S3EnvError(f"{e}\n{self.logs()}") from None

    def rgw_running(self):
        p = self.procs.get("rgw")
        return p is not None and p.poll() is None

    def stop(self):
        """Stop radosgw, OSD and mon (SIGKILL, or SIGTERM first when keep), wait for them,
        and remove tmpdir unless keep. Safe to call twice."""
        self._stop_daemons(signal.SIGTERM if self.keep else signal.SIGKILL)
        self.stopped = True
        if not self.keep and os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)

    def pids(self):
        return {n: p.pid for n, p in self.procs.items() if p.poll() is None}

    def memory_kib(self):
        """Resident memory (VmRSS, KiB) of each running daemon."""
        out = {}
        for n, pid in self.pids().items():
            try:
                with open(f"/proc/{pid}/status") as f:
                    out[n] = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
            except (OSError, AttributeError):
                pass
        return out

    def logs(self, lines=25):
        """The tails of the daemons' logs (for error messages)."""
        parts = []
        for name in sorted(os.listdir(os.path.join(self.dir, "log"))) if os.path.isdir(
                os.path.join(self.dir, "log")) else []:
            t = _tail(os.path.join(self.dir, "log", name), lines)
            if t.strip():
                parts.append(f"--- {name} (last {lines} lines)\n{t}")
        return "\n".join(parts)

    # -- internals
    def _env(self):
        e = dict(os.environ)
        for k in ("CEPH_ARGS", "CEPH_CONF", "PYTHONPATH", "PYTHONHOME"):
            e.pop(k, None)
        return e

    def _save_state(self):
        with open(self.state_path + ".tmp", "w") as f:
            json.dump(self._state, f)
        os.replace(self.state_path + ".tmp", self.state_path)

    def _run(self, argv, deadline=None, timeout=30.0):
        if deadline is not None:
            timeout = max(1.0, min(timeout, deadline - time.monotonic()))
        try:
            p = subprocess.run(argv, env=self._env(), capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL, cwd=self.dir)
        except subprocess.TimeoutExpired:
            raise S3EnvError(f"{' '.join(argv)}: no answer in {timeout:.0f} s") from None
        if p.returncode != 0:
            raise S3EnvError(f"{' '.join(argv)} exited with {p.returncode}: {p.stderr.strip()[-2000:]}")
        return p.stdout

    def _mkfs_mon(self):
        for sub in ("mon", "osd/osd.0", "run", "log", "rgw"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        mon_port = free_port()
        fsid = str(uuid.uuid4())
        with open(self.conf, "w") as f:
            f.write(CEPH_CONF.format(fsid=fsid, mon_port=mon_port, d=self.dir, block_size=self.block_size))
        monmap = os.path.join(self.dir, "monmap")
        self._run(["monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{mon_port}]", monmap])
        self._run(["ceph-mon", "--mkfs", "-c", self.conf, "-i", "a", "--monmap", monmap])
        self._state = {"fsid": fsid, "mon_port": mon_port}

    def _mkfs_osd(self, deadline):
        osd_uuid = str(uuid.uuid4())
        while True:  # the first command after the mon starts may wait for its quorum
            try:
                self._run(["ceph", "-c", self.conf, "--connect-timeout", "10", "osd", "new", osd_uuid, "0"],
                          deadline, 15)
                break
            except S3EnvError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self._run(["ceph-osd", "--mkfs", "-c", self.conf, "-i", "0", "--osd-uuid", osd_uuid], deadline, 60)
        self._state["osd_uuid"] = osd_uuid
        self._save_state()

    def _start_daemon(self, name, argv):
        if name == "mon" and not port_is_free(self._state["mon_port"]):
            raise S3EnvError(f"the mon's port {self._state['mon_port']} (fixed at mkfs) is in use")
        self.procs[name] = _spawn(argv, os.path.join(self.dir, "log", name + ".out"), self._env(), self.dir)

    def _check_alive(self, name):
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            raise S3EnvError(f"{name} exited with status {None if p is None else p.returncode}")

    def _wait_osd_up(self, deadline):
        while True:
            self._check_alive("mon")
            self._check_alive("osd")
            try:
                out = self._run(["ceph", "-c", self.conf, "--connect-timeout", "5", "osd", "stat", "-f", "json"],
                                deadline, 10)
                if json.loads(out).get("num_up_osds", 0) >= 1:
                    return
            except (S3EnvError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise S3EnvError("the OSD did not come up in time")
            time.sleep(0.1)

    def _start_rgw(self, deadline):
        if self.port is None:
            self.port = free_port()
        if not port_is_free(self.port):  # radosgw would start anyway and serve nothing
            raise S3EnvError(f"port {self.port} for radosgw is in use")
        self._state["rgw_port"] = self.port
        self._save_state()
        init_timeout = max(5, int(deadline - time.monotonic()))
        self.procs["rgw"] = _spawn(
            ["radosgw", "-f", "-c", self.conf, "-n", "client.rgw", f"--rgw-init-timeout={init_timeout}",
             f"--rgw-frontends=beast endpoint=127.0.0.1:{self.port}"],
            os.path.join(self.dir, "log", "rgw.out"), self._env(), self.dir)
        while True:  # until it answers HTTP (anonymous ListBuckets)
            self._check_alive("rgw")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/")
                r = c.getresponse()
                r.read()
                c.close()
                if r.status < 500:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise S3EnvError(f"radosgw did not answer HTTP on port {self.port} in time")
            time.sleep(0.05)

    def _wait_s3(self, access, secret, accepted, deadline):
        """Until a signed ListBuckets with these keys succeeds (accepted) or gets 403."""
        c = S3Client(self.endpoint, access, secret, timeout=5)
        status = None
        while True:
            self._check_alive("rgw")
            try:
                status = c.request("GET")[0]
                if (status == 200) == accepted and (accepted or status == 403):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise S3EnvError(f"radosgw: ListBuckets with key {access} gave {status}, "
                                 f"waited for {'200' if accepted else '403'}")
            time.sleep(0.05)

    def _stop_daemons(self, sig):
        for name, comm in reversed(self.DAEMONS):
            stop_proc(self.procs.pop(name, None), (comm, "setpriv"), sig=sig)


_shared = {}


def shared_rgw():
    """One RGW for the whole test process: started on the first call, stopped atexit (and on
    SIGTERM, when the process had the default SIGTERM handler). If a test killed its radosgw,
    it is restarted here; if a test stopped it, a new one starts. Use your own buckets
    (make_bucket())."""
    rgw = _shared.get("rgw")
    if rgw is None or rgw.stopped:
        rgw = RGW()
        rgw.start()
        _shared["rgw"] = rgw
        atexit.register(rgw.stop)
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    elif not rgw.rgw_running():
        rgw.start_rgw()
    return rgw


# ---------------------------------------------------------------------------------------
# s3rver (npm)


class S3rver:
    """The npm package s3rver (a weak S3 server) on a free port with a temp directory.

    Keys: S3RVER / S3RVER (its defaults). Needs node and tests/.npm (scripts/lib.sh
    install_s3rver; S3RVER_JS in the environment overrides the path of bin/s3rver.js)."""

    access_key = "S3RVER"
    secret_key = "S3RVER"

    def __init__(self, tmpdir=None, keep=False, timeout=20.0, buckets=()):
        self.own_dir = tmpdir is None
        if tmpdir is None:
            sweep_stale()
            self.dir = tempfile.mkdtemp(prefix="s3env-s3rver-")
            _claim_dir(self.dir)
        else:
            self.dir = os.path.abspath(tmpdir)
            os.makedirs(self.dir, exist_ok=True)
        self.keep, self.timeout, self.buckets = keep, timeout, list(buckets)
        self.port = None
        self.proc = None
        self.aws_config = os.path.join(self.dir, "aws-config")
        self.log = os.path.join(self.dir, "s3rver.log")

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        js = os.environ.get("S3RVER_JS", S3RVER_JS)
        node = shutil.which("node") or shutil.which("nodejs")
        if not node or not os.path.exists(js):
            raise S3EnvError(f"s3rver is not installed ({js}; node={node}): scripts/test installs it "
                             "(scripts/lib.sh install_s3rver)")
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=True)
        _write_aws_config(self.aws_config)
        argv = [node, js, "--directory", data, "--port", "0", "--address", "127.0.0.1", "--silent"]
        for b in self.buckets:
            argv += ["--configure-bucket", b]
        open(self.log, "wb").close()
        self.proc = _spawn(argv, self.log, dict(os.environ), self.dir)
        deadline = time.monotonic() + self.timeout
        # port 0: it prints "S3rver listening on 127.0.0.1:PORT" (no race for the port)
        while self.port is None:
            m = re.search(r"S3rver listening on [^:\s]+:(\d+)", _tail(self.log, 50))
            if m:
                self.port = int(m.group(1))
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = _tail(self.log, 30)
                self.stop()
                raise S3EnvError(f"s3rver did not start (exit status {self.proc.returncode}):\n{out}")
            time.sleep(0.05)
        c = self.client(timeout=2)
        while True:
            try:
                if c.request("GET")[0] == 200:
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = _tail(self.log, 30)
                self.stop()
                raise S3EnvError(f"s3rver does not answer on port {self.port}:\n{out}")
            time.sleep(0.05)

    def env(self, extra=None, base=None):
        return _aws_env(self.endpoint, self.access_key, self.secret_key, self.aws_config, extra, base)

    def aws(self, *args, check=True, timeout=120, endpoint=None, extra_env=None, **kw):
        return run_aws(endpoint or self.endpoint, self.env(extra_env), args, check, timeout, **kw)

    def client(self, access_key=None, secret_key=None, endpoint=None, timeout=30.0):
        return S3Client(endpoint or self.endpoint, access_key or self.access_key,
                        secret_key or self.secret_key, timeout=timeout)

    def make_bucket(self, name=None):
        name = name or unique_bucket("s3rver")
        self.client().make_bucket(name)
        return name

    def stop(self):
        comms = ("node", "nodejs", "setpriv", "MainThread")
        stop_proc(self.proc, comms, term_timeout=5)
        self.proc = None
        if not self.keep and os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# FaultProxy

S3_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "TooManyRequests": "Too many requests.",
    "AccessDenied": "Access Denied",
    "NoSuchKey": "The specified key does not exist.",
    "RequestTimeout": "Your socket connection to the server was not read from or written to within "
                      "the timeout period.",
    "BadRequest": "Bad request.",
}
DEFAULT_CODES = {500: "InternalError", 503: "SlowDown", 429: "TooManyRequests", 403: "AccessDenied",
                 404: "NoSuchKey", 400: "BadRequest", 408: "RequestTimeout", 502: "BadGateway",
                 504: "GatewayTimeout"}
REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 408: "Request Timeout",
           429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout"}

FAULTS = ("hang", "status:CODE[:S3Code]", "error200[:S3Code]", "cut", "reset", "cut-upload",
          "drop-request-body", "delay:SECONDS")


class Rule:
    """One fault rule. Fires for requests whose method equals `method` (any when None) and
    whose target (path?query, URL-decoded) contains `match` / matches `regex` (re.search),
    at most `count` times and only within `seconds` of its creation (no limit when None).
    hits: how many times it fired (read it any time)."""

    def __init__(self, fault, method=None, match=None, regex=None, count=None, seconds=None):
        self.fault = fault
        parts = fault.split(":")
        self.kind = parts[0]
        if self.kind == "drop-request-body":
            self.kind = "cut-upload"
        if self.kind not in ("hang", "status", "error200", "cut", "reset", "cut-upload", "delay"):
            raise ValueError(f"unknown fault {fault!r} (one of {', '.join(FAULTS)})")
        self.status, self.code, self.delay = 200, "InternalError", 0.0
        if self.kind == "status":
            if len(parts) < 2 or not parts[1].isdigit():
                raise ValueError(f"fault {fault!r}: status:CODE[:S3Code]")
            self.status = int(parts[1])
            self.code = parts[2] if len(parts) > 2 and parts[2] else DEFAULT_CODES.get(self.status, "InternalError")
        elif self.kind == "error200" and len(parts) > 1 and parts[1]:
            self.code = parts[1]
        elif self.kind == "delay":
            self.delay = float(parts[1]) if len(parts) > 1 else 1.0
        self.method = method.upper() if method else None
        self.match = match
        self.regex = re.compile(regex) if isinstance(regex, str) else regex
        self.count, self.seconds = count, seconds
        self.created = time.monotonic()
        self.hits = 0

    def active(self, now=None):
        if self.count is not None and self.hits >= self.count:
            return False
        return self.seconds is None or (now or time.monotonic()) < self.created + self.seconds

    def matches(self, method, target):
        if self.method and method != self.method:
            return False
        if self.match is not None and self.match not in target:
            return False
        return self.regex is None or self.regex.search(target) is not None

    def __repr__(self):
        return (f"Rule({self.fault!r}, method={self.method}, match={self.match!r}, count={self.count}, "
                f"seconds={self.seconds}, hits={self.hits})")


class _Conn:
    """A socket with a read buffer (readline / exact reads) for HTTP framing."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def fill(self):
        data = self.sock.recv(256 * 1024)
        if not data:
            raise EOFError
        self.buf += data

    def readline(self, limit=65536):
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                line, self.buf = self.buf[:i + 1], self.buf[i + 1:]
                return line
            if len(self.buf) > limit:
                raise ValueError("header line too long")
            self.fill()

    def read_some(self, n):
        if not self.buf:
            self.fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def read_head(self):
        """(raw bytes, first line, [(name, value)]) of a request/response head."""
        first = self.readline()
        while first in (b"\r\n", b"\n"):  # stray CRLF between messages
            first = self.readline()
        raw, headers = [first], []
        while True:
            line = self.readline()
            raw.append(line)
            if line in (b"\r\n", b"\n"):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers.append((name.strip().lower(), value.strip()))
            if len(raw) > 200:
                raise ValueError("too many header lines")
        return b"".join(raw), first.decode("latin-1").rstrip("\r\n"), headers


def _hget(headers, name):
    for k, v in headers:
        if k == name:
            return v
    return None


def _framing(headers):
    """('chunked', None) / ('length', n) / ('none', 0) for a request's body."""
    te = _hget(headers, "transfer-encoding")
    if te and "chunked" in te.lower():
        return "chunked", None
    cl = _hget(headers, "content-length")
    return ("length", int(cl)) if cl and int(cl) > 0 else ("none", 0)


class _Dropped(Exception):
    """The exchange ended by a fault: close the client connection (and the upstream one)."""


class FaultProxy:
    """A fault-injecting HTTP/1.1 reverse proxy in front of upstream ("http://host:port"),
    on a free 127.0.0.1 port. Without a matching rule it passes everything through (keep-alive,
    Content-Length and chunked bodies both ways, Expect: 100-continue relayed to upstream).

    Faults (add_rule(fault, ...)):
      hang          read the request (answering 100 Continue when asked), never answer; the
                    socket stays open until the client closes it or the proxy stops
      status:C[:X]  answer HTTP C with an S3 <Error><Code>X</Code> document, not forwarded
                    (X defaults by C: 503 SlowDown, 500 InternalError, 429 TooManyRequests..)
      error200[:X]  answer 200 with an S3 <Error> document (body read, nothing forwarded)
      cut           forward; send the response head and half the body (half the head when the
                    body is empty), then close (FIN)
      reset         the same, then close with SO_LINGER 0 (RST)
      cut-upload    (alias drop-request-body) forward the head and half the request body (half
                    the head when there is no body) upstream, then close both sides, no answer
      delay:S       wait S seconds, then forward
    When upstream refuses the connection (radosgw killed), the client's connection is closed
    without an answer, as the server's own would be.
    Counters: count(method, match), events (list of dicts), rule.hits."""

    def __init__(self, upstream, upstream_timeout=120.0, continue_wait=1.0):
        u = urllib.parse.urlsplit(upstream)
        self.upstream = (u.hostname, u.port or 80)
        self.upstream_timeout, self.continue_wait = upstream_timeout, continue_wait
        self.lock = threading.Lock()
        self.rules = []
        # every request seen: {"method", "target" (URL-decoded), "fault" (None when passed
        # through), "expect" (it asked for 100-continue), "time"}
        self.events = []
        self.port = None
        self._lsock = None
        self._stopping = threading.Event()
        self._threads = set()
        self._socks = set()
        self._seq = 0

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(128)
        s.settimeout(0.2)
        self._lsock, self.port = s, s.getsockname()[1]
        t = threading.Thread(target=self._accept_loop, name=f"faultproxy-{self.port}", daemon=True)
        self._threads.add(t)
        t.start()
        return self

    def stop(self, timeout=5.0):
        """Close the listening socket and every connection, join the threads (bounded)."""
        self._stopping.set()
        with self.lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for t in list(self._threads):
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if self._lsock:
            self._lsock.close()

    # -- rules and counters
    def add_rule(self, fault, method=None, match=None, regex=None, count=None, seconds=None):
        """Add a fault rule (see the class doc); rules are tried in the order added, the first
        active matching one fires. Returns the Rule (its .hits counts firings)."""
        rule = Rule(fault, method, match, regex, count, seconds)
        with self.lock:
            self.rules.append(rule)
        return rule

    def remove_rule(self, rule):
        with self.lock:
            if rule in self.rules:
                self.rules.remove(rule)

    def clear(self):
        """Remove every rule (counters stay; reset_counts() clears them)."""
        with self.lock:
            self.rules.clear()

    def reset_counts(self):
        with self.lock:
            self.events.clear()

    def count(self, method=None, match=None, fault=None):
        """How many requests the proxy saw (with that method / target substring / fault kind;
        fault="" counts the ones passed through untouched)."""
        with self.lock:
            return sum(1 for e in self.events
                       if (method is None or e["method"] == method.upper())
                       and (match is None or match in e["target"])
                       and (fault is None or (e["fault"] or "") == fault
                            or (e["fault"] or "").split(":")[0] == fault))

    def injected(self):
        """How many faults were injected in all."""
        with self.lock:
            return sum(1 for e in self.events if e["fault"])

    def _pick(self, method, target, expect=False):
        now = time.monotonic()
        with self.lock:
            self._seq += 1
            rule = next((r for r in self.rules if r.active(now) and r.matches(method, target)), None)
            if rule:
                rule.hits += 1
            self.events.append({"method": method, "target": target, "fault": rule.fault if rule else None,
                                "expect": expect, "time": time.time()})
            return rule, self._seq

    # -- connections
    def _track(self, s):
        with self.lock:
            self._socks.add(s)
        if self._stopping.is_set():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _close(self, s, reset=False):
        if s is None:
            return
        with self.lock:
            self._socks.discard(s)
        try:
            if reset:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def _accept_loop(self):
        while not self._stopping.is_set():
            try:
                cs, _ = self._lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            cs.settimeout(None)
            cs.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._track(cs)
            t = threading.Thread(target=self._serve, args=(cs,), daemon=True)
            with self.lock:
                self._threads.add(t)
            t.start()
        with self.lock:
            self._threads.discard(threading.current_thread())

    def _serve(self, cs):
        client = _Conn(cs)
        ctx = {"up": None}  # the upstream connection, kept across keep-alive requests
        reset = False
        try:
            while not self._stopping.is_set():
                try:
                    keep = self._exchange(client, ctx)
                except (EOFError, ConnectionError):
                    break
                except _Dropped as d:
                    reset = d.args[0] if d.args else False
                    break
                if not keep:
                    break
        except (OSError, ValueError):
            pass
        finally:
            self._close(cs, reset)
            if ctx["up"] is not None:
                self._close(ctx["up"].sock)
            with self.lock:
                self._threads.discard(threading.current_thread())

    def _connect_upstream(self, up):
        if up is not None:  # reuse unless upstream closed it while idle
            r, _, _ = select.select([up.sock], [], [], 0)
            if not r and not up.buf:
                return up
            self._close(up.sock)
        s = socket.create_connection(self.upstream, timeout=self.upstream_timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._track(s)
        return _Conn(s)

    def _body(self, src, framing, out, limit=None):
        """Copy a body from src to out (a callable; None discards). limit: stop after that
        many raw bytes. Returns the raw bytes copied."""
        kind, n = framing
        done = 0

        def emit(b):
            nonlocal done
            if out is not None and b:
                out(b)
            done += len(b)

        if kind == "length":
            left = n if limit is None else min(n, limit)
            while left > 0:
                b = src.read_some(min(left, 256 * 1024))
                emit(b)
                left -= len(b)
        elif kind == "chunked":
            while True:
                line = src.readline()
                emit(line)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers
                        t = src.readline()
                        emit(t)
                        if t in (b"\r\n", b"\n"):
                            return done
                left = size + 2
                while left > 0:
                    if limit is not None and done >= limit:
                        return done
                    take = left if limit is None else min(left, limit - done)
                    b = src.read_some(min(take, 256 * 1024))
                    emit(b)
                    left -= len(b)
        elif kind == "eof":
            while limit is None or done < limit:
                try:
                    b = src.read_some(256 * 1024 if limit is None else min(256 * 1024, limit - done))
                except EOFError:
                    break
                emit(b)
        return done

    def _error_doc(self, code, target, seq):
        msg = S3_MESSAGES.get(code, code)
        resource = urllib.parse.unquote(target.split("?")[0])
        return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{msg}</Message><Resource>{resource}</Resource>"
                f"<RequestId>faultproxy-{seq}</RequestId><HostId>faultproxy</HostId></Error>").encode()

    def _answer(self, cs, method, status, body, close):
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
                "Content-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\n"
                f"x-amz-request-id: faultproxy\r\n"
                f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}\r\n"
                f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n").encode()
        cs.sendall(head + (b"" if method == "HEAD" else body))

    def _exchange(self, client, ctx):
        """One request/response. Returns whether to keep the client connection open."""
        raw, first, headers = client.read_head()
        parts = first.split(" ")
        if len(parts) != 3:
            raise ValueError(f"bad request line {first!r}")
        method, target, version = parts
        target_dec = urllib.parse.unquote(target)
        framing = _framing(headers)
        has_body = framing[0] != "none"
        expect = (_hget(headers, "expect") or "").lower() == "100-continue"
        conn_hdr = (_hget(headers, "connection") or "").lower()
        keep = "close" not in conn_hdr if version == "HTTP/1.1" else "keep-alive" in conn_hdr
        rule, seq = self._pick(method, target_dec, expect)
        kind = rule.kind if rule else None
        cs = client.sock

        if kind == "hang":
            if has_body and expect:
                cs.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                if has_body:
                    self._body(client, framing, None)
                while not self._stopping.is_set():
                    r, _, _ = select.select([cs], [], [], 0.2)
                    if r and not cs.recv(65536):
                        break
            except (OSError, EOFError):
                pass
            raise _Dropped(False)

        if kind == "status":
            body = self._error_doc(rule.code, target, seq)
            if has_body and expect:  # final answer instead of 100: the body never comes
                self._answer(cs, method, rule.status, body, close=True)
                raise _Dropped(False)
            if has_body:
                self._body(client, framing, None)
            self._answer(cs, method, rule.status, body, close=not keep)
            return keep

        if kind == "error200":
            if has_body:
                if expect:
                    cs.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                self._body(client, framing, None)
            self._answer(cs, method, 200, self._error_doc(rule.code, target, seq), close=not keep)
            return keep

        if kind == "delay":
            if self._stopping.wait(rule.delay):
                raise _Dropped(False)

        up = ctx["up"] = self._connect_upstream(ctx["up"])
        usock = up.sock
        if kind == "cut-upload":
            if not has_body:
                usock.sendall(raw[:max(1, len(raw) // 2)])
                self._close(usock, reset=True)
                raise _Dropped(False)
            usock.sendall(raw)
            if expect:
                # relay upstream's 100 Continue so that the client sends its body
                r, _, _ = select.select([usock], [], [], self.continue_wait)
                if r:
                    head, line, _ = up.read_head()
                    if line.split(" ")[1:2] != ["100"]:  # refused: the body will not come
                        self._close(usock, reset=True)
                        raise _Dropped(False)
                    cs.sendall(head)
            half = (framing[1] // 2) if framing[0] == "length" else 32 * 1024
            self._body(client, framing, usock.sendall, limit=max(1, half))
            self._close(usock, reset=True)
            raise _Dropped(False)

        usock.sendall(raw)
        final = None
        if has_body:
            if expect:
                r, _, _ = select.select([usock], [], [], self.continue_wait)
                if r:
                    head, line, rh = up.read_head()
                    st = int(line.split(" ")[1])
                    if st == 100:
                        cs.sendall(head)
                    else:
                        final = (head, line, rh)  # upstream refused before the body
            if final is None:
                self._body(client, framing, usock.sendall)
        return self._relay_response(client, ctx, method, final, keep, kind)

    def _relay_response(self, client, ctx, method, final, keep, kind):
        cs, up = client.sock, ctx["up"]
        # upstream answered instead of 100 Continue: the client may still send the body
        final_refused = final is not None
        while True:
            head, line, rh = final if final else up.read_head()
            final = None
            st = int(line.split(" ")[1])
            if 100 <= st < 200:  # interim answers (a late 100 Continue): pass them on
                cs.sendall(head)
                continue
            break
        te = (_hget(rh, "transfer-encoding") or "").lower()
        cl = _hget(rh, "content-length")
        if method == "HEAD" or st in (204, 304):
            framing = ("none", 0)
        elif "chunked" in te:
            framing = ("chunked", None)
        elif cl is not None:
            framing = ("length", int(cl))
        else:
            framing = ("eof", None)
        up_close = "close" in (_hget(rh, "connection") or "").lower() or framing[0] == "eof"

        if kind in ("cut", "reset"):
            if framing[0] == "none" or framing == ("length", 0):
                cs.sendall(head[:max(1, len(head) // 2)])
            else:
                cs.sendall(head)
                if framing[0] == "length":
                    limit = framing[1] // 2
                else:  # chunked/eof: the size is unknown: the first few KiB
                    limit = 4096
                if limit > 0:
                    self._body(up, framing, cs.sendall, limit=limit)
            self._close(up.sock)
            raise _Dropped(kind == "reset")

        cs.sendall(head)
        if framing[0] != "none":
            self._body(up, framing, cs.sendall)
        if up_close or final_refused:
            self._close(up.sock)
            ctx["up"] = None
        return keep and not up_close and not final_refused


# ---------------------------------------------------------------------------------------
# command line: one RGW for a shell script (bench/s3_bench.sh, scripts/demo)

def _main(argv):
    """python3 tests/integration/s3env.py rgw [--block-gib N] [--timeout S]

    Starts one RGW (a new temp folder, removed at the end), creates a bucket, prints the
    settings as shell assignments (S3ENV_ENDPOINT, S3ENV_BUCKET, S3ENV_DIR, S3ENV_PID and the
    AWS_* variables of RGW.env()) and a last line "S3ENV_READY=1", then waits. SIGTERM,
    SIGINT or SIGHUP stop it (daemons killed, folder removed); the daemons also die with
    this process (PR_SET_PDEATHSIG), even when it is SIGKILLed. Exit status 0, 1 when it could not start."""
    import argparse
    import shlex
    ap = argparse.ArgumentParser(prog="s3env.py", description=_main.__doc__.split("\n\n")[1])
    ap.add_argument("what", choices=["rgw"])
    ap.add_argument("--block-gib", type=float, default=16, help="OSD block file (sparse), GiB")
    ap.add_argument("--timeout", type=float, default=60, help="start-up bound, seconds")
    a = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    rgw = RGW(timeout=a.timeout, block_size=int(a.block_gib * (1 << 30)))
    try:
        rgw.start()
    except (S3EnvError, OSError) as e:
        print(f"s3env: RGW did not start: {e}", file=sys.stderr)
        return 1
    try:
        env = rgw.env(base={})
        env.update(S3ENV_ENDPOINT=rgw.endpoint, S3ENV_BUCKET=rgw.make_bucket("bench"),
                   S3ENV_DIR=rgw.dir, S3ENV_PID=str(os.getpid()))
        for k in sorted(env):
            print(f"{k}={shlex.quote(env[k])}")
        print("S3ENV_READY=1", flush=True)
        while not stop.wait(0.5):
            if not rgw.rgw_running():
                print("s3env: radosgw exited", file=sys.stderr)
                return 1
    finally:
        rgw.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
