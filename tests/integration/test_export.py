"""ckpt-inspect export: a snapshot's weights as one safetensors file.

The file is parsed here with struct and json only (8-byte little-endian header length, a
JSON header padded with spaces to a multiple of 8, then the data), and every tensor's bytes
are compared with the raw `params` buffer decoded independently of our reader: the chunks
listed in manifest.json, cut out of rank-00000.bin and decoded with the system `zstd`.
Also: a corrupt params chunk fails the export naming the chunk and leaves nothing behind;
a corrupt chunk of another buffer does not matter (only the chunks read are checked); an
existing output is refused without --force and kept intact."""
import glob
import json
import os
import re
import shutil
import struct
import subprocess

import harness as h

# Params of this model (about 1.7 MB) span two 1 MiB chunks, so tensors straddle a chunk
# boundary and --window-mib 1 sweeps two windows.
MODEL = ["--n-embd", "128", "--steps", "2", "--ckpt-every", "2", "--chunk-mib", "1"]
STEP_DIR = "step-000000002"


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def read_manifest(snap):
    with open(os.path.join(snap, "manifest.json")) as f:
        return json.load(f)


def raw_buffer(snap, name):
    """Bytes of buffer `name` of snapshot folder `snap`, decoded from the data files by hand."""
    manifest = read_manifest(snap)
    (buf,) = [b for b in manifest["buffers"] if b["name"] == name]
    chunks = []
    for shard in buf["shards"]:
        for c in shard["chunks"]:
            chunks.append((shard["file"], c))
    chunks.sort(key=lambda fc: fc[1]["offset"])
    out = bytearray()
    for fname, c in chunks:
        assert c["filter"] in ("none", "shuffle"), c["filter"]
        assert c["offset"] == len(out), f"chunk at {c['offset']}, expected {len(out)}"
        with open(os.path.join(snap, fname), "rb") as f:
            f.seek(c["file_offset"])
            stored = f.read(c["stored_bytes"])
        assert len(stored) == c["stored_bytes"]
        if c["codec"] == "zstd":
            raw = subprocess.run(["zstd", "-d", "-c", "-q"], input=stored, capture_output=True,
                                 check=True).stdout
        else:
            assert c["codec"] == "none", c["codec"]
            raw = stored
        assert len(raw) == c["bytes"], (len(raw), c["bytes"])
        if c["filter"] == "shuffle":  # byte planes back to elements (docs/FORMAT.md)
            size, count = buf["elem_bytes"], len(raw) // buf["elem_bytes"]
            plain = bytearray(len(raw))
            for k in range(size):
                plain[k:count * size:size] = raw[k * count:(k + 1) * count]
            plain[count * size:] = raw[count * size:]
            raw = bytes(plain)
        out += raw
    assert len(out) == buf["total_bytes"]
    return bytes(out), manifest


def parse_safetensors(test, path):
    """(metadata, {name: entry} in file order, data section) of a safetensors file."""
    blob = read_bytes(path)
    test.assertGreaterEqual(len(blob), 8)
    (n,) = struct.unpack("<Q", blob[:8])
    test.assertEqual(n % 8, 0, "header length not a multiple of 8")
    test.assertLessEqual(8 + n, len(blob))
    text = blob[8:8 + n].decode("utf-8")
    test.assertTrue(text.startswith("{"), text[:40])
    body = text.rstrip(" ")
    test.assertTrue(body.endswith("}"), "header padded with something other than spaces")
    test.assertLess(len(text) - len(body), 8, "more padding than needed")
    header = json.loads(text, object_pairs_hook=lambda kv: kv)  # keep order, catch duplicates
    names = [k for k, _ in header]
    test.assertEqual(len(names), len(set(names)), "duplicate keys in the header")
    header = dict((k, dict(v) if isinstance(v, list) else v) for k, v in header)
    meta = header.pop("__metadata__")
    return meta, header, blob[8 + n:]


class Export(h.TempDirTest):
    def setUp(self):
        super().setUp()
        if not shutil.which("zstd"):
            self.fail("no zstd program (scripts/lib.sh installs it)")
        self.ckpt = os.path.join(self.tmp, "ckpt")
        self.run_ = h.train(["--ckpt-dir", self.ckpt] + MODEL)
        self.snap = os.path.join(self.ckpt, STEP_DIR)
        self.out_dir = os.path.join(self.tmp, "out")
        os.mkdir(self.out_dir)
        self.out = os.path.join(self.out_dir, "model.safetensors")

    def export(self, *extra, out=None):
        return h.run([h.INSPECT, "export", self.snap, out or self.out] + list(extra))

    def leftovers(self):
        return sorted(glob.glob(os.path.join(self.out_dir, "*.tmp-*")))

    def check_file(self, path):
        raw, manifest = raw_buffer(self.snap, "params")
        trainer = manifest["trainer"]
        self.assertEqual(trainer.get("tensor_buffer", "params"), "params")
        (pbuf,) = [b for b in manifest["buffers"] if b["name"] == "params"]
        self.assertEqual((pbuf["dtype"], pbuf["elem_bytes"]), ("f32", 4))
        self.assertGreaterEqual(sum(len(s["chunks"]) for s in pbuf["shards"]), 2)
        self.assertTrue(any(raw), "params buffer is all zeros")

        meta, tensors, data = parse_safetensors(self, path)
        self.assertTrue(all(isinstance(v, str) for v in meta.values()), meta)
        self.assertEqual(meta["format"], "pt")
        self.assertEqual(meta["step"], "2")
        self.assertEqual(meta["run_id"], manifest["run_id"])
        self.assertEqual(meta["params_digest"], trainer["params_digest"])
        self.assertEqual(meta["params_digest"], h.final(self.run_)["digest"])
        self.assertEqual(meta["source_snapshot"], os.path.realpath(self.snap))

        table = trainer["tensors"]
        self.assertGreater(len(table), 4)
        # the same tensors, in table order in the header and in the data
        self.assertEqual(list(tensors), [t["name"] for t in table])
        pos = 0
        for t in table:
            e = tensors[t["name"]]
            self.assertEqual(set(e), {"dtype", "shape", "data_offsets"}, t["name"])
            self.assertEqual(e["dtype"], "F32", t["name"])
            self.assertEqual(e["shape"], t["shape"], t["name"])
            numel = 1
            for d in t["shape"]:
                numel *= d
            begin, end = e["data_offsets"]
            self.assertEqual(begin, pos, f"{t['name']}: not contiguous")
            self.assertEqual(end - begin, 4 * numel, t["name"])
            src = raw[4 * t["offset"]:4 * (t["offset"] + numel)]
            self.assertEqual(len(src), 4 * numel, f"{t['name']}: outside the params buffer")
            self.assertTrue(data[begin:end] == src, f"{t['name']}: bytes differ from params")
            pos = end
        self.assertEqual(pos, len(data), "data section not covered exactly")
        return meta

    def test_export_matches_raw_params(self):
        r = self.export()
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"exported \d+ tensors \(\d+ bytes of data, \d+ bytes in all\)"
                                   r" from \S+ to \S+ in [\d.]+ s")
        self.check_file(self.out)
        self.assertEqual(self.leftovers(), [])
        self.assertEqual(os.stat(self.out).st_mode & 0o777, 0o644)

    def test_json_summary_and_small_window(self):
        r = self.export("--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertTrue(j["ok"])
        self.assertEqual(j["file_bytes"], os.path.getsize(self.out))
        manifest = read_manifest(self.snap)
        self.assertEqual(j["tensors"], len(manifest["trainer"]["tensors"]))
        # windows smaller than the buffer: the same bytes
        other = os.path.join(self.out_dir, "small-window.safetensors")
        r = self.export("--window-mib", "1", out=other)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_file(other)
        self.assertEqual(read_bytes(other), read_bytes(self.out))

    def flip(self, buffer_name, chunk_index):
        manifest = read_manifest(self.snap)
        (buf,) = [b for b in manifest["buffers"] if b["name"] == buffer_name]
        c = buf["shards"][0]["chunks"][chunk_index]
        path = os.path.join(self.snap, buf["shards"][0]["file"])
        at = c["file_offset"] + c["stored_bytes"] // 2
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x10]))

    def test_corrupt_params_chunk_fails_cleanly(self):
        self.flip("params", 1)
        r = self.export()
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertRegex(lines[0], r"^ckpt-inspect: export \S*" + STEP_DIR + r" failed: \S*"
                                   + STEP_DIR + r"/rank-00000\.bin: chunk 1 of params .*checksum")
        self.assertFalse(os.path.exists(self.out))
        self.assertEqual(self.leftovers(), [])
        self.assertEqual(os.listdir(self.out_dir), [])
        j = json.loads(self.export("--json").stdout)
        self.assertFalse(j["ok"])
        self.assertIn("chunk 1 of params", j["error"])

    def test_corrupt_optimizer_chunk_not_read(self):
        self.flip("adam_m", 0)
        self.assertEqual(h.run([h.INSPECT, "verify", self.snap]).returncode, 1)
        r = self.export()
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_file(self.out)

    def test_existing_output_refused_without_force(self):
        with open(self.out, "wb") as f:
            f.write(b"precious")
        r = self.export()
        self.assertEqual(r.returncode, 2, "an existing OUT without --force is a usage error")
        self.assertRegex(r.stderr, re.escape(self.out) + r": exists")
        self.assertEqual(read_bytes(self.out), b"precious")
        self.assertEqual(self.leftovers(), [])
        r = self.export("--force")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_file(self.out)
        self.assertEqual(self.leftovers(), [])

    def test_errors(self):
        r = h.run([h.INSPECT, "export", self.snap])
        self.assertEqual(r.returncode, 2)
        r = h.run([h.INSPECT, "export", self.snap, self.out, "extra"])
        self.assertEqual(r.returncode, 2)
        r = self.export("--window-mib", "0")
        self.assertEqual(r.returncode, 2)
        missing = os.path.join(self.ckpt, "step-000000099")
        r = h.run([h.INSPECT, "export", missing, self.out])
        self.assertEqual(r.returncode, 1)
        self.assertIn(missing, r.stderr)
        nodir = os.path.join(self.tmp, "no-such-folder", "model.safetensors")
        r = self.export(out=nodir)
        self.assertEqual(r.returncode, 1)
        self.assertIn("no-such-folder", r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertFalse(os.path.exists(self.out))


if __name__ == "__main__":
    h.main()
