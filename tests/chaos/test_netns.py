"""The network-partition scenario (chaoslib/netns.py) as a unittest: one short run (one cut of
each length class the seed picks, about a minute), plus NetPair's own clean-up. Needs root
(ip netns) and the build; skipped otherwise.

    python3 tests/chaos/test_netns.py            # CKPT_BUILD, CKPT_DATA, CHAOS_SEED override
"""
import os
import random
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from chaoslib import netns  # noqa: E402

BUILD = os.environ.get("CKPT_BUILD", os.path.join(ROOT, "build"))
DATA = os.environ.get("CKPT_DATA", os.path.join(ROOT, "data", "brown"))


def can_netns():
    if os.geteuid() != 0:
        return False
    return subprocess.run(["ip", "netns", "list"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


class Ctx:
    def __init__(self, seed, cuts, layout):
        self.build, self.data, self.seed = BUILD, DATA, seed
        self.rnd = random.Random(seed)
        self.keep, self.work_root, self.reference = False, None, None
        self.cuts, self.netns_layout = cuts, layout


@unittest.skipUnless(can_netns(), "needs root and ip netns")
class NetPairTest(unittest.TestCase):
    def test_cut_heal_and_nothing_left(self):
        with netns.NetPair(random.Random(1)) as p:
            srv = p.popen(0, ["python3", "-c", "import socket,sys; s=socket.socket(); "
                              f"s.bind(('{p.addr[0]}', 5000)); s.listen(); print('up', flush=True); "
                              "c, _ = s.accept(); print(c.recv(10).decode())"],
                          stdout=subprocess.PIPE, text=True)
            self.assertEqual(srv.stdout.readline().strip(), "up")
            c = p.run(1, ["python3", "-c", "import socket; s=socket.create_connection(("
                          f"'{p.addr[0]}', 5000), timeout=5); s.sendall(b'hi')"])
            self.assertEqual(c.returncode, 0, c.stderr)
            self.assertEqual(srv.communicate(timeout=10)[0].strip(), "hi")
            p.cut(1)
            self.assertFalse(p.link_up())
            c = p.run(1, ["python3", "-c", "import socket; socket.create_connection(("
                          f"'{p.addr[0]}', 5001), timeout=1)"])
            self.assertNotEqual(c.returncode, 0)  # silent (timeout) or no route: nothing crosses
            p.heal()
            sleeper = p.popen(0, ["sleep", "60"])
            names = p.ns
        self.assertEqual(p.leftovers(), [])
        self.assertEqual(sleeper.wait(5), -9)  # killed by close(), by pid
        out = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
        for n in names:
            self.assertNotIn(n, out)


@unittest.skipUnless(can_netns(), "needs root and ip netns")
@unittest.skipUnless(os.path.exists(os.path.join(BUILD, "train")), "no build")
class PartitionScenarioTest(unittest.TestCase):
    def test_one_cut(self):
        seed = int(os.environ.get("CHAOS_SEED", "5"))
        r = netns.run_partition_scenario(Ctx(seed, 1, os.environ.get("CHAOS_LAYOUT", "shared")))
        for ob in r.observations:
            print(f"\n  {ob}", file=sys.stderr)
        self.assertEqual(r.faults["partition"], 1, r.problems)
        self.assertTrue(r.ok, f"seed {seed}: {r.problems} (work folder {r.work})")
        self.assertTrue(r.digest_equal)
        self.assertGreater(r.verified["local"], 0)


if __name__ == "__main__":
    unittest.main()
