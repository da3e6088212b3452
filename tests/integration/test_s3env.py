"""Smoke test of the S3 fixtures (s3env.py) through awscli: RGW put/list/get/ranged get,
a wrong secret refused, data kept across a radosgw restart, key rotation, the FaultProxy
passing a 20 MiB object through unchanged and each of its faults failing the request it
should, and s3rver answering awscli."""
import hashlib
import os
import shutil
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import s3env  # noqa: E402

# awscli: one attempt, short timeouts (the hang fault must fail fast)
FAST = {"AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}
TIMEOUTS = ["--cli-read-timeout", "2", "--cli-connect-timeout", "2"]

rgw = None


def setUpModule():
    global rgw
    rgw = s3env.shared_rgw()


def tearDownModule():
    pids = list(rgw.pids().values())
    rgw.stop()
    for pid in pids:  # stop() waited for them: none may be left, not even as a zombie
        if os.path.exists(f"/proc/{pid}"):
            raise AssertionError(f"RGW daemon {pid} still there after stop()")
    if os.path.exists(rgw.dir):
        raise AssertionError(f"{rgw.dir} left behind")


class Base(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test-s3env-")
        self.addCleanup(lambda: shutil.rmtree(self.tmp, ignore_errors=True))

    def file(self, name, data):
        path = os.path.join(self.tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def read(self, name):
        with open(os.path.join(self.tmp, name), "rb") as f:
            return f.read()


class Rgw(Base):
    def test_1_put_list_get_range(self):
        b = rgw.make_bucket()
        data = os.urandom(100_000)
        rgw.aws("s3", "cp", self.file("a", data), f"s3://{b}/ckpt/rank-00000.bin")
        ls = rgw.aws("s3", "ls", f"s3://{b}/ckpt/")
        self.assertIn("rank-00000.bin", ls.stdout)
        rgw.aws("s3", "cp", f"s3://{b}/ckpt/rank-00000.bin", os.path.join(self.tmp, "back"))
        self.assertEqual(self.read("back"), data)
        rgw.aws("s3api", "get-object", "--bucket", b, "--key", "ckpt/rank-00000.bin",
                "--range", "bytes=1000-1999", os.path.join(self.tmp, "part"))
        self.assertEqual(self.read("part"), data[1000:2000])
        self.assertEqual(rgw.client().get(b, "ckpt/rank-00000.bin", (5, 9)), data[5:10])
        self.assertEqual(rgw.client().list(b, "ckpt/"), ["ckpt/rank-00000.bin"])

    def test_2_wrong_secret_refused(self):
        b = rgw.make_bucket()
        p = rgw.aws("s3", "ls", f"s3://{b}", check=False, extra_env={"AWS_SECRET_ACCESS_KEY": "wrong", **FAST})
        self.assertNotEqual(p.returncode, 0)
        self.assertEqual(rgw.client(secret_key="wrong").request("GET", b)[0], 403)

    def test_3_key_rotation(self):
        b = rgw.make_bucket()
        ak, sk = "CKPTROTATEDKEY000001", "rotated-secret-1"
        rgw.add_key(ak, sk)
        keys = {"AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk, **FAST}
        rgw.aws("s3", "cp", self.file("r", b"rotated"), f"s3://{b}/r", extra_env=keys)
        rgw.remove_key(ak)
        p = rgw.aws("s3", "cp", f"s3://{b}/r", os.path.join(self.tmp, "r2"), check=False, extra_env=keys)
        self.assertNotEqual(p.returncode, 0, "a removed key still works")
        rgw.aws("s3", "cp", f"s3://{b}/r", os.path.join(self.tmp, "r3"))  # the main key still does
        self.assertEqual(self.read("r3"), b"rotated")

    def test_4_data_survives_radosgw_restart(self):
        b = rgw.make_bucket()
        data = os.urandom(300_000)
        rgw.client().put(b, "keep/me", data)
        port, old = rgw.port, rgw.pids()["rgw"]
        rgw.kill_rgw()
        self.assertFalse(os.path.exists(f"/proc/{old}"))
        with self.assertRaises(OSError):  # nothing listens while it is down
            rgw.client(timeout=2).request("GET")
        rgw.start_rgw()
        self.assertEqual(rgw.port, port)
        rgw.aws("s3", "cp", f"s3://{b}/keep/me", os.path.join(self.tmp, "k"))
        self.assertEqual(self.read("k"), data)


class Proxy(Base):
    def setUp(self):
        super().setUp()
        self.proxy = s3env.FaultProxy(rgw.endpoint).start()
        self.addCleanup(self.proxy.stop)
        self.b = rgw.make_bucket()

    def aws(self, *args, check=False):
        return rgw.aws(*TIMEOUTS, *args, endpoint=self.proxy.endpoint, check=check, extra_env=FAST, timeout=60)

    def test_large_object_passes_through(self):
        data = os.urandom(20 << 20)
        src = self.file("big", data)
        self.aws("s3", "cp", src, f"s3://{self.b}/big/rank-00000", check=True)  # multipart, 100-continue
        self.assertGreaterEqual(self.proxy.count("PUT", "big/rank-00000"), 3)
        self.assertTrue(all(e["expect"] for e in self.proxy.events if e["method"] == "PUT"))
        self.aws("s3", "cp", f"s3://{self.b}/big/rank-00000", os.path.join(self.tmp, "back"), check=True)
        self.assertEqual(hashlib.sha256(self.read("back")).digest(), hashlib.sha256(data).digest())
        c = rgw.client(endpoint=self.proxy.endpoint)  # single PUT, then a ranged GET, through
        c.put(self.b, "one", data[:5 << 20])
        self.assertEqual(c.get(self.b, "one", (4 << 20, (5 << 20) - 1)), data[4 << 20:5 << 20])
        self.assertEqual(self.proxy.injected(), 0)

    def put_one(self, key, data=b"x" * 50_000):
        return self.aws("s3api", "put-object", "--bucket", self.b, "--key", key, "--body", self.file("obj", data))

    def get_one(self, key):
        return self.aws("s3api", "get-object", "--bucket", self.b, "--key", key, os.path.join(self.tmp, "out"))

    def test_hang(self):
        rgw.client().put(self.b, "h", b"y" * 1000)
        rule = self.proxy.add_rule("hang", method="GET")
        t0 = time.monotonic()
        self.assertNotEqual(self.get_one("h").returncode, 0)
        self.assertLess(time.monotonic() - t0, 20)
        self.assertEqual(rule.hits, 1)

    def test_status_faults(self):
        rgw.client().put(self.b, "s", b"y" * 1000)
        for fault, method in (("status:503:SlowDown", "PUT"), ("status:500:InternalError", "GET"),
                              ("status:429", "GET")):
            with self.subTest(fault=fault):
                rule = self.proxy.add_rule(fault, method=method, count=1)
                p = self.put_one("s2") if method == "PUT" else self.get_one("s")
                self.assertNotEqual(p.returncode, 0)
                self.assertEqual(rule.hits, 1)
        self.proxy.add_rule("status:503", count=1)
        st, _, body = rgw.client(endpoint=self.proxy.endpoint).request("GET", self.b, "s")
        self.assertEqual(st, 503)
        self.assertIn(b"<Code>SlowDown</Code>", body)

    def test_error200_stores_nothing(self):
        rule = self.proxy.add_rule("error200", method="PUT", match="e200")
        self.put_one("e200")  # awscli does not look into PutObject's 200 body: its exit status is moot
        st, _, body = rgw.client(endpoint=self.proxy.endpoint).request("PUT", self.b, "e200", body=b"z" * 10)
        self.assertEqual(st, 200)
        self.assertIn(b"<Error><Code>InternalError</Code>", body)
        self.assertEqual(rule.hits, 2)
        self.assertIsNone(rgw.client().head(self.b, "e200"))

    def test_cut_and_reset(self):
        data = os.urandom(200_000)
        rgw.client().put(self.b, "c", data)
        for fault in ("cut", "reset"):
            with self.subTest(fault=fault):
                rule = self.proxy.add_rule(fault, method="GET", count=1)
                self.assertNotEqual(self.get_one("c").returncode, 0)
                self.assertEqual(rule.hits, 1)
        self.assertEqual(self.get_one("c").returncode, 0)  # the rules are used up
        self.assertEqual(self.read("out"), data)

    def test_cut_upload(self):
        rule = self.proxy.add_rule("cut-upload", method="PUT", match="rank-00001")
        self.assertNotEqual(self.put_one("u/rank-00001", os.urandom(300_000)).returncode, 0)
        self.assertEqual(self.put_one("u/rank-00000").returncode, 0)  # other keys pass
        self.assertEqual(rule.hits, 1)
        self.assertIsNone(rgw.client().head(self.b, "u/rank-00001"))  # RGW's PUTs are atomic
        self.assertIsNotNone(rgw.client().head(self.b, "u/rank-00000"))

    def test_delay_and_duration(self):
        self.proxy.add_rule("delay:1", method="PUT", seconds=30)
        c = rgw.client(endpoint=self.proxy.endpoint)
        t0 = time.monotonic()
        c.put(self.b, "d", b"d")
        self.assertGreaterEqual(time.monotonic() - t0, 1.0)
        self.proxy.clear()
        rule = self.proxy.add_rule("status:503", seconds=0.3)
        self.assertEqual(c.request("GET", self.b, "d")[0], 503)
        time.sleep(0.4)
        self.assertEqual(c.get(self.b, "d"), b"d")
        self.assertEqual(rule.hits, 1)


class ProxyFraming(Base):
    """Pass-through of what RGW seldom sends: chunked bodies both ways, on one kept-alive
    connection (a local http.server upstream)."""

    def test_chunked_both_ways_keep_alive(self):
        import http.client
        import http.server
        import threading

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_PUT(self):
                body = b""
                while True:  # a chunked request body
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(0, len(body), 7000):
                    part = body[i:i + 7000]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        self.addCleanup(srv.server_close)
        self.addCleanup(srv.shutdown)
        with s3env.FaultProxy(f"http://127.0.0.1:{srv.server_address[1]}") as proxy:
            c = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            for n in (100_000, 3):
                data = os.urandom(n)
                c.request("PUT", "/b/k", body=iter([data[:n // 2], data[n // 2:]]),
                          encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
                r = c.getresponse()
                self.assertEqual(r.getheader("Transfer-Encoding"), "chunked")
                self.assertEqual(r.read(), data)
            c.close()
            self.assertEqual(proxy.count("PUT"), 2)


class S3rverTest(Base):
    def test_s3rver_answers_awscli(self):
        with s3env.S3rver() as s:
            b = s.make_bucket()
            data = os.urandom(50_000)
            s.aws("s3", "cp", self.file("a", data), f"s3://{b}/x/rank-00000")
            self.assertIn("rank-00000", s.aws("s3", "ls", f"s3://{b}/x/").stdout)
            s.aws("s3", "cp", f"s3://{b}/x/rank-00000", os.path.join(self.tmp, "back"))
            self.assertEqual(self.read("back"), data)
            pid = s.proc.pid
        self.assertFalse(os.path.exists(f"/proc/{pid}"))

    def test_s3rver_keeps_an_interrupted_put(self):
        """The weak server: an upload cut short by the proxy leaves a (partial) object."""
        with s3env.S3rver() as s, s3env.FaultProxy(s.endpoint) as proxy:
            b = s.make_bucket()
            proxy.add_rule("cut-upload", method="PUT")
            c = s.client(endpoint=proxy.endpoint, timeout=5)
            try:
                c.request("PUT", b, "partial", body=os.urandom(1 << 20))
            except OSError:
                pass
            deadline = time.monotonic() + 5
            while s.client().head(b, "partial") is None and time.monotonic() < deadline:
                time.sleep(0.05)
            h = s.client().head(b, "partial")
            self.assertIsNotNone(h, "s3rver no longer keeps an interrupted PUT")
            self.assertLess(int(h["content-length"]), 1 << 20)


if __name__ == "__main__":
    unittest.main(verbosity=2)
