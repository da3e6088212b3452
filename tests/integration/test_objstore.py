"""objstore (storage/objstore.h) against a real S3 server (Ceph radosgw), both signers, through
build/tests/objstore-cli: put / get (parallel parts and ranged) / head / list (several pages)
/ delete; a wrong secret and a missing bucket refused with one clear line that never shows
the secret; a credentials file rotated while a process runs; and faults from a proxy in
front of radosgw: a hang (per-attempt timeout, bounded total), 503 SlowDown (retried with
backoff), a GET body cut short or reset (retried, short data never returned), and a 200
carrying an error document on PUT (retried, object verified by HEAD) and on GET (retried,
never taken for the object's bytes).

The fixtures come from s3env.py beside this file (S3ENV_PATH may name another folder).
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if not os.path.exists(os.path.join(HERE, "s3env.py")) and os.environ.get("S3ENV_PATH"):
    sys.path.insert(0, os.environ["S3ENV_PATH"])
import s3env  # noqa: E402

BUILD = os.environ.get("CKPT_BUILD", os.path.join(HERE, "../../build"))
CLI = os.path.join(BUILD, "tests", "objstore-cli")
SANITIZED = os.environ.get("CKPT_SANITIZED") == "1"
SIGS = ("v4", "v2")
BIG = 32 << 20
REPEAT = 40  # HEADs of the rotation test, 0.1 s apart

rgw = None
bucket = None
figures = []


def setUpModule():
    global rgw, bucket
    rgw = s3env.shared_rgw()
    bucket = rgw.make_bucket()


def note(text):
    figures.append(text)
    print(text, flush=True)


def cli_env(extra=None, endpoint=None):
    e = rgw.env(extra)
    e.pop("AWS_ENDPOINT_URL_S3", None)
    if endpoint:
        e["AWS_ENDPOINT_URL"] = endpoint
    e.setdefault("CKPT_LOG_LEVEL", "info")
    return e


def cli(args, env=None, timeout=120, endpoint=None):
    """Run objstore-cli; (exit status, [JSON lines of stdout], stderr)."""
    p = subprocess.run([CLI] + [str(a) for a in args], env=env or cli_env(endpoint=endpoint),
                       capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    return p.returncode, lines, p.stderr


class ObjstoreTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="t-objstore-")
        self.t0 = time.monotonic()

    def tearDown(self):
        subprocess.run(["rm", "-rf", self.tmp], check=False)
        print(f"  ({self.id().split('.')[-1]}: {time.monotonic() - self.t0:.1f} s)", flush=True)

    def path(self, name):
        return os.path.join(self.tmp, name)

    def last(self, args, **kw):
        rc, lines, err = cli(args, **kw)
        self.assertTrue(lines, f"no output from {args}: {err}")
        return rc, lines[-1], err

    def ok(self, args, **kw):
        rc, line, err = self.last(args, **kw)
        self.assertEqual(rc, 0, f"{args}: {line} {err}")
        self.assertEqual(line["rc"], 0, line)
        return line

    # ---- the basics, both signers

    def test_roundtrip_big(self):
        data = os.urandom(BIG)
        src = self.path("big.bin")
        with open(src, "wb") as f:
            f.write(data)
        for sig in SIGS:
            with self.subTest(sig=sig):
                url = f"s3://{bucket}/rt-{sig}/big.bin"
                put = self.ok(["--sig", sig, "put", url, src, "--meta", "step=17"])
                self.assertEqual(put["size"], BIG)
                self.assertEqual(put["attempts"], 1)
                head = self.ok(["--sig", sig, "head", url, "--meta", "step"])
                self.assertEqual((head["size"], head["etag"], head["meta"]), (BIG, put["etag"], "17"))
                out = self.path(f"out-{sig}.bin")
                get = self.ok(["--sig", sig, "--part", 8 << 20, "get", url, out])
                with open(out, "rb") as f:
                    self.assertTrue(f.read() == data, "the object read back differs")
                note(f"{sig}: 32 MiB PUT {put['seconds']:.3f} s, GET (4 parts of 8 MiB) "
                     f"{get['seconds']:.3f} s")
                # an odd range, and four threads reading it through one handle at once
                off, n = 12345677, 3 * 1000 * 1000 + 7
                self.ok(["--sig", sig, "--threads", 4, "get", url, out, "--range", off, n])
                with open(out, "rb") as f:
                    self.assertTrue(f.read() == data[off:off + n], "ranged read differs")
                # a range past the end is refused, not returned short
                rc, line, _ = self.last(["--sig", sig, "get", url, out, "--range", BIG - 10, 20])
                self.assertEqual(rc, 1)
                self.assertEqual((line["errno"], line["attempts"]), ("ERANGE", 1), line)
                # independent check with another client
                self.assertEqual(rgw.client().head(bucket, f"rt-{sig}/big.bin")["etag"].strip('"'), put["etag"])
                self.ok(["--sig", sig, "rm", url])
                rc, line, _ = self.last(["--sig", sig, "head", url])
                self.assertEqual((rc, line["errno"]), (1, "ENOENT"))
                self.ok(["--sig", sig, "rm", url])  # deleting a missing key is success

    def test_listing_pages(self):
        for sig in SIGS:
            with self.subTest(sig=sig):
                pre = f"ls-{sig}/"
                many = self.ok(["--sig", sig, "--jobs", 16, "put-many", f"s3://{bucket}/{pre}k", 25, 100])
                self.assertEqual(many["count"], 25)
                src = self.path("one")
                with open(src, "wb") as f:
                    f.write(b"x" * 10)
                for k in ("sub/a", "sub/b"):
                    self.ok(["--sig", sig, "put", f"s3://{bucket}/{pre}{k}", src])
                # 27 keys in pages of 4: 7 pages
                rc, lines, err = cli(["--sig", sig, "--page", 4, "ls", f"s3://{bucket}/{pre}"])
                self.assertEqual(rc, 0, err)
                keys = [x["key"] for x in lines if "key" in x]
                want = [f"{pre}k{i:06d}" for i in range(25)] + [f"{pre}sub/a", f"{pre}sub/b"]
                self.assertEqual(sorted(keys), sorted(want))
                self.assertEqual(len(keys), len(set(keys)), "a key listed twice")
                self.assertEqual(sorted(keys), sorted(rgw.client().list(bucket, pre)))
                self.assertTrue(all(x["size"] == 100 for x in lines if x.get("key", "").startswith(pre + "k")))
                # with the delimiter: 25 keys and one common prefix, still paged
                rc, lines, err = cli(["--sig", sig, "--page", 4, "ls", f"s3://{bucket}/{pre}",
                                      "--delimiter", "/"])
                self.assertEqual(rc, 0, err)
                prefixes = [x["key"] for x in lines if x.get("prefix")]
                self.assertEqual(prefixes, [f"{pre}sub/"])
                self.assertEqual(len([x for x in lines if x.get("prefix") is False]), 25)

    # ---- refusals: one clear line, no secret

    def test_wrong_secret_and_missing_bucket(self):
        wrong = "WrongSecret-" + "z" * 28
        src = self.path("one")
        with open(src, "wb") as f:
            f.write(b"payload")
        for sig in SIGS:
            with self.subTest(sig=sig):
                env = cli_env({"AWS_SECRET_ACCESS_KEY": wrong})
                rc, lines, err = cli(["--sig", sig, "put", f"s3://{bucket}/denied", src], env=env)
                self.assertEqual(rc, 1)
                self.assertEqual(lines[-1]["errno"], "EACCES", lines)
                self.assertEqual(lines[-1]["attempts"], 1, "a refused key is not retried")
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertIn(bucket, err)
                self.assertIn(rgw.endpoint, err)
                for text in (err, json.dumps(lines)):
                    self.assertNotIn(wrong, text)
                    self.assertNotIn(rgw.secret_key, text)
                rc, lines, err = cli(["--sig", sig, "put", "s3://no-such-bucket-here/k", src])
                self.assertEqual((rc, lines[-1]["errno"]), (1, "ENXIO"), lines)
                self.assertIn("NoSuchBucket", err)
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertNotIn(rgw.secret_key, err)

    # ---- credentials rotated while a process runs

    def test_credential_rotation(self):
        src = self.path("one")
        with open(src, "wb") as f:
            f.write(b"rotate me")
        self.ok(["put", f"s3://{bucket}/rot/obj", src])
        for i, sig in enumerate(SIGS):
            with self.subTest(sig=sig):
                old = (f"CKPTROTOLD{i}{os.getpid() % 100000:05d}", f"old-secret-{i}-" + "o" * 24)
                new = (f"CKPTROTNEW{i}{os.getpid() % 100000:05d}", f"new-secret-{i}-" + "n" * 24)
                rgw.add_key(*old)
                cred = self.path(f"credentials-{sig}")

                def write(k):
                    with open(cred + ".tmp", "w") as f:
                        f.write(f"[default]\naws_access_key_id = {k[0]}\naws_secret_access_key = {k[1]}\n")
                    os.replace(cred + ".tmp", cred)
                write(old)
                env = cli_env()
                for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                    env.pop(k)
                env["AWS_SHARED_CREDENTIALS_FILE"] = cred
                errf = open(self.path(f"stderr-{sig}"), "w+")
                p = subprocess.Popen([CLI, "--sig", sig, "--attempts", "2", "--repeat", str(REPEAT),
                                      "--interval", "0.1", "head", f"s3://{bucket}/rot/obj"], env=env,
                                     stdout=subprocess.PIPE, stderr=errf, text=True)
                seen = []
                reader = threading.Thread(target=lambda: seen.extend(
                    (time.monotonic(), json.loads(x)) for x in p.stdout if x.startswith("{")))
                reader.start()
                try:
                    time.sleep(0.3)
                    rgw.add_key(*new)
                    write(new)
                    time.sleep(0.2)
                    rgw.remove_key(old[0])  # returns once radosgw refuses the old key
                    revoked = time.monotonic()
                    p.wait(timeout=60)
                finally:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                    reader.join(10)
                    p.stdout.close()
                    errf.seek(0)
                    err = errf.read()
                    errf.close()
                    try:
                        rgw.remove_key(new[0], wait=False)
                    except s3env.S3EnvError:
                        pass
                after = [line for t, line in seen if t > revoked + 0.2]
                self.assertEqual(p.returncode, 0, f"some HEAD failed: {[x for _, x in seen if x['rc']]}\n{err}")
                self.assertEqual(len(seen), REPEAT)
                self.assertGreaterEqual(len(after), 3, "too few requests after the old key was revoked")
                self.assertTrue(all(x["rc"] == 0 for x in after))
                self.assertIn(f"key id {new[0]}", err)
                self.assertNotIn(new[1], err + json.dumps([x for _, x in seen]))

    # ---- faults from a proxy in front of radosgw

    def put_file(self, name, n):
        data = os.urandom(n)
        path = self.path(name)
        with open(path, "wb") as f:
            f.write(data)
        return path, data

    def test_fault_hang(self):
        with s3env.FaultProxy(rgw.endpoint) as proxy:
            src, data = self.put_file("h", 1000)
            self.ok(["put", f"s3://{bucket}/fault/hang", src])
            proxy.add_rule("hang", method="GET", match="fault/hang")
            for sig in SIGS:
                with self.subTest(sig=sig):
                    t0 = time.monotonic()
                    rc, line, err = self.last(["--sig", sig, "--timeout", 0.5, "--attempts", 3, "--backoff", 0.1,
                                               "get", f"s3://{bucket}/fault/hang", self.path("o"),
                                               "--range", 0, 1000], endpoint=proxy.endpoint)
                    dt = time.monotonic() - t0
                    self.assertEqual((rc, line["errno"], line["attempts"]), (1, "ETIMEDOUT", 3), line)
                    # three attempts of 0.5 s, backoff under 0.2 + 0.4 s
                    self.assertTrue(1.5 <= dt < 1.5 + 0.6 + 1.5, f"took {dt:.2f} s")
                    note(f"{sig}: hang: -ETIMEDOUT after 3 attempts of 0.5 s in {dt:.2f} s")
                    # the call's deadline bounds it harder
                    t0 = time.monotonic()
                    rc, line, err = self.last(["--sig", sig, "--timeout", 5, "--deadline", 0.8, "get",
                                               f"s3://{bucket}/fault/hang", self.path("o"), "--range", 0, 1000],
                                              endpoint=proxy.endpoint)
                    dt = time.monotonic() - t0
                    self.assertEqual((rc, line["errno"]), (1, "ETIMEDOUT"), line)
                    self.assertLess(dt, 0.8 + 1.0)
                    self.assertIn("deadline", err)

    def test_fault_slowdown(self):
        with s3env.FaultProxy(rgw.endpoint) as proxy:
            src, data = self.put_file("s", 200000)
            for sig in SIGS:
                with self.subTest(sig=sig):
                    key = f"fault/slow-{sig}"
                    rule = proxy.add_rule("status:503:SlowDown", method="PUT", match=key, count=3)
                    put = self.ok(["--sig", sig, "--backoff", 0.1, "put", f"s3://{bucket}/{key}", src],
                                  endpoint=proxy.endpoint)
                    self.assertEqual((rule.hits, put["attempts"]), (3, 4))
                    self.assertEqual(rgw.client().get(bucket, key), data)
                    note(f"{sig}: 3 x 503 SlowDown then success: 4 attempts in {put['seconds']:.3f} s "
                         f"(backoff caps 0.2, 0.4, 0.8 s)")
                    rule = proxy.add_rule("status:503:SlowDown", method="HEAD", match=key)
                    rc, line, err = self.last(["--sig", sig, "--backoff", 0.05, "--attempts", 4, "head",
                                               f"s3://{bucket}/{key}"], endpoint=proxy.endpoint)
                    proxy.remove_rule(rule)
                    self.assertEqual((rc, line["errno"], line["attempts"], rule.hits), (1, "EIO", 4, 4), line)
                    self.assertEqual(len(err.strip().splitlines()), 1, err)

    def test_fault_cut_and_reset(self):
        with s3env.FaultProxy(rgw.endpoint) as proxy:
            src, data = self.put_file("c", 1 << 20)
            key = "fault/cut"
            self.ok(["put", f"s3://{bucket}/{key}", src])
            out = self.path("o")
            for sig in SIGS:
                for fault in ("cut", "reset"):
                    with self.subTest(sig=sig, fault=fault):
                        rule = proxy.add_rule(fault, method="GET", match=key, count=2)
                        get = self.ok(["--sig", sig, "--backoff", 0.05, "get", f"s3://{bucket}/{key}", out,
                                       "--range", 0, 1 << 20], endpoint=proxy.endpoint)
                        self.assertEqual((rule.hits, get["attempts"]), (2, 3))
                        with open(out, "rb") as f:
                            self.assertTrue(f.read() == data)
                        # always cut: fails, never returns short data as success
                        rule = proxy.add_rule(fault, method="GET", match=key)
                        rc, line, err = self.last(["--sig", sig, "--backoff", 0.05, "--attempts", 3, "get",
                                                   f"s3://{bucket}/{key}", out, "--whole"],
                                                  endpoint=proxy.endpoint)
                        proxy.remove_rule(rule)
                        self.assertEqual((rc, line["attempts"]), (1, 3), line)
                        self.assertIn(line["errno"], ("EIO", "ECONNRESET"), line)
                        self.assertEqual(os.path.getsize(out), 0)

    def test_fault_error200_on_put(self):
        with s3env.FaultProxy(rgw.endpoint) as proxy:
            src, data = self.put_file("e", 300000)
            for sig in SIGS:
                with self.subTest(sig=sig):
                    key = f"fault/e200-{sig}"
                    rule = proxy.add_rule("error200:InternalError", method="PUT", match=key, count=1)
                    put = self.ok(["--sig", sig, "--backoff", 0.05, "put", f"s3://{bucket}/{key}", src],
                                  endpoint=proxy.endpoint)
                    self.assertEqual((rule.hits, put["attempts"]), (1, 2))
                    self.assertEqual(proxy.count("HEAD", key), 1, "the PUT was checked by HEAD")
                    self.assertEqual(rgw.client().get(bucket, key), data)


    def test_fault_error200_on_get(self):
        """A 200 whose body is an S3 error document instead of the object, on a ranged GET
        (a chunk) or a whole one (a manifest): retried like a 5xx, and when it never stops,
        EIO (transient), not ERANGE or the error document returned as the object's bytes."""
        with s3env.FaultProxy(rgw.endpoint) as proxy:
            src, data = self.put_file("g", 300000)
            key = "fault/e200-get"
            self.ok(["put", f"s3://{bucket}/{key}", src])
            out = self.path("o")
            for sig in SIGS:
                for how in (["--range", 1000, 200000], ["--whole"]):
                    with self.subTest(sig=sig, how=how[0]):
                        want = data[1000:201000] if how[0] == "--range" else data
                        rule = proxy.add_rule("error200:InternalError", method="GET", match=key, count=1)
                        get = self.ok(["--sig", sig, "--backoff", 0.05, "get", f"s3://{bucket}/{key}", out]
                                      + how, endpoint=proxy.endpoint)
                        self.assertEqual((rule.hits, get["attempts"]), (1, 2))
                        with open(out, "rb") as f:
                            self.assertTrue(f.read() == want, "the bytes read back differ")
                        rule = proxy.add_rule("error200:InternalError", method="GET", match=key)
                        rc, line, err = self.last(["--sig", sig, "--backoff", 0.05, "--attempts", 3, "get",
                                                   f"s3://{bucket}/{key}", out] + how,
                                                  endpoint=proxy.endpoint)
                        proxy.remove_rule(rule)
                        self.assertEqual((rc, line["errno"], line["attempts"]), (1, "EIO", 3), line)
                        self.assertIn("error document", err)

if __name__ == "__main__":
    t0 = time.monotonic()
    r = unittest.main(exit=False, verbosity=2).result
    print(f"test_objstore: {time.monotonic() - t0:.1f} s", flush=True)
    sys.exit(0 if r.wasSuccessful() else 1)
