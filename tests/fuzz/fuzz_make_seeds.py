#!/usr/bin/env python3
"""fuzz_make_seeds.py BUILD_FUZZ_DIR - (re)write the seed corpora of tests/fuzz/corpus/.

Seeds are small, named inputs that start the fuzzers at the interesting places: a valid
snapshot manifest and the malformed ones of issue 9 (duplicate names, overlapping chunks,
stored_bytes far over raw, a raw chunk whose sizes differ, step 2^62, checksum member with
17 digits or members after it, non-UTF-8 names, huge arrays, ...), chunks of every codec and
filter, and store protocol exchanges (valid hello, bad token, truncated frame, len
0xffffffff, a 1-byte key, WAIT with count 2^32-1, ...).

The valid manifest comes from the harness itself (FUZZ_MANIFEST_TEMPLATE), since it has to
match the data files the harness writes; the malformed ones are edits of it. Their checksum
member holds zeros: the harness reseals every input. Chunk seeds use the zstd program.
Files named crash-* (findings not fixed yet, kept for the replay test) are never touched;
fixed-* are findings that were fixed: ordinary seeds now, kept so that they stay fixed.
"""
import json
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
KEY = ',"manifest_xxh3":"'


def put(harness, name, data):
    os.makedirs(os.path.join(CORPUS, harness), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(CORPUS, harness, name), "wb") as f:
        f.write(data)


def seal(obj, tail='"}\n'):
    """The writer's serialisation (compact, sorted keys) with a checksum member of zeros."""
    text = json.dumps(obj, separators=(",", ":"), sort_keys=True)
    return text[:-1] + KEY + "0" * 16 + tail


# ------------------------------------------------------------------ manifests

def manifests(build):
    tmpl = os.path.join(CORPUS, "fuzz_manifest", "valid-two-ranks.json")
    os.makedirs(os.path.dirname(tmpl), exist_ok=True)
    env = dict(os.environ, FUZZ_MANIFEST_TEMPLATE=tmpl)
    subprocess.run([os.path.join(build, "tests", "fuzz", "fuzz_manifest"), "-runs=0"], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    valid = open(tmpl).read()
    valid = valid[: valid.rindex(KEY)] + "}"  # the body without its checksum member
    base = json.loads(valid)

    def edit(name, fn, tail='"}\n'):
        m = json.loads(valid)
        fn(m)
        put("fuzz_manifest", name, seal(m, tail))

    def buf(m, name):
        return next(b for b in m["buffers"] if b["name"] == name)

    def params(m):
        return buf(m, "params")

    def chunk(m, b="params", s=0, c=0):
        return buf(m, b)["shards"][s]["chunks"][c]

    edit("dup-buffer-names.json", lambda m: m["buffers"].append(dict(params(m))))
    edit("dup-file-names.json", lambda m: m["files"].append(dict(m["files"][0])))
    edit("overlap-chunks.json", lambda m: chunk(m, "params", 0, 1).update(offset=4000))
    edit("overlap-shards.json", lambda m: buf(m, "adam_m")["shards"].append(
        dict(buf(m, "adam_m")["shards"][0])))
    edit("gap-between-shards.json", lambda m: buf(m, "adam_m").update(total_bytes=8193))

    def overlap_tensors(m):
        m["trainer"]["tensors"][1]["offset"] = 100  # inside wte.weight (opaque to the reader)
    edit("overlap-tensor-table.json", overlap_tensors)
    edit("stored-4gib.json", lambda m: chunk(m).update(stored_bytes=4 << 30))
    edit("stored-far-over-raw.json", lambda m: chunk(m, "params", 0, 2).update(stored_bytes=7169 - 4109))
    edit("raw-none-stored-ne-bytes.json", lambda m: chunk(m, "params", 0, 1).update(stored_bytes=4095))
    edit("raw-none-shuffle.json", lambda m: chunk(m, "params", 0, 1).update(filter="shuffle"))

    def step62(m):
        m["step"] = 1 << 62
        m["trainer"]["step"] = 1 << 62
        m["trainer"]["optimizer"]["t"] = 1 << 62
        m["trainer"]["data"]["samples_consumed"] = 1 << 62  # step x global_batch overflows
    edit("step-2p62-samples.json", step62)

    def samples_overflow(m):
        step62(m)
        m["trainer"]["data"]["samples_consumed"] = (1 << 62) * 8  # past int64: JSON parse
    edit("step-2p62-samples-over-int64.json", samples_overflow)
    edit("step-other-folder.json", lambda m: m.update(step=2))  # the listing: corrupt
    # findings (docs/FORMAT.md: 16 digits, then '"}'): the reader accepts them, and no
    # checksum covers what follows the 16th digit
    edit("fixed-checksum-17-digits.json", lambda m: None, tail='0"}\n')
    put("fuzz_manifest", "checksum-15-digits.json",
        seal(base).replace("0" * 16 + '"}', "0" * 15 + '"}'))
    edit("fixed-member-after-checksum.json", lambda m: None, tail='","extra":1}\n')
    # the trainer record moved behind the checksum: no checksum covers it
    m = json.loads(valid)
    trainer = m.pop("trainer")
    text = seal(m).rstrip("\n")
    put("fuzz_manifest", "fixed-trainer-after-checksum.json",
        text[:-1] + ',"trainer":' + json.dumps(trainer, separators=(",", ":")) + "}\n")
    # the sequence inside a nested object that comes last: the reader checks that one (the
    # top-level member's value is then never looked at) and nothing covers the rest
    m = json.loads(valid)
    trainer = m.pop("trainer")
    trainer["manifest_xxh3"] = "0" * 16
    m["manifest_xxh3"] = "ffffffffffffffff"
    text = json.dumps(m, separators=(",", ":"))[:-1] + ',"trainer":' + \
        json.dumps(trainer, separators=(",", ":")) + "}\n"
    put("fuzz_manifest", "fixed-nested-checksum-last.json", text)
    # finding: with an empty buffer last, verify never runs the last partial batch of chunks:
    # a corrupt chunk there (a wrong xxh3_stored on adam_m's last one) passes verify
    def empty_buffer_last(m):
        m["buffers"].append(m["buffers"].pop(m["buffers"].index(buf(m, "flags"))))
        chunk(m, "adam_m", 1, 1)["xxh3_stored"] = "0123456789abcdef"
    edit("fixed-verify-skips-chunks-after-empty-last-buffer.json", empty_buffer_last)
    # finding: "." passes the name check and stat(), so a directory is taken for a data file
    # (where a directory's size is 4096, as on ext4); verify then fails with -EISDIR, which
    # ckpt.h does not document and which does not say "corrupt" (I7)
    def data_file_is_a_directory(m):
        m["files"].append({"name": ".", "rank": 0, "bytes": 4096})
        shard = buf(m, "adam_m")["shards"][0]
        shard["file"] = "."
        shard["chunks"][0]["file_offset"] = 0
    edit("fixed-data-file-is-a-directory.json", data_file_is_a_directory)
    put("fuzz_manifest", "trailing-bytes.json", seal(base) + "garbage")
    put("fuzz_manifest", "trailing-space.json", seal(base) + "  \n\n")
    put("fuzz_manifest", "no-checksum-member.json",
        json.dumps(base, separators=(",", ":")).replace(KEY, ',"other":"') + "x")
    put("fuzz_manifest", "checksum-cut-short.json", seal(base)[: -(4 + 8)])
    edit("checksum-uppercase-chunk.json", lambda m: chunk(m).update(
        xxh3_raw=chunk(m)["xxh3_raw"].upper()))

    # names: not UTF-8, UTF-8 outside the name set, overlong encodings, NUL escapes
    v = seal(base).encode()
    put("fuzz_manifest", "non-utf8-buffer-name.json",
        v.replace(b'"name":"params"', b'"name":"par\xff\xfems"', 1))
    put("fuzz_manifest", "overlong-utf8-run-id.json",
        v.replace(b'"run_id":"fuzz-run"', b'"run_id":"fuzz\xc0\xafrun"', 1))
    edit("utf8-buffer-name.json", lambda m: params(m).update(name="p\u00e4rams"))
    edit("nul-in-file-name.json", lambda m: m["files"][0].update(name="rank-00000.bin\u0000x"))
    put("fuzz_manifest", "surrogate-escape.json",
        v.replace(b'"dtype":"f32"', b'"dtype":"\\ud800"', 1))
    edit("name-dotdot.json", lambda m: m["files"][0].update(name=".."))
    edit("name-manifest.json", lambda m: m["files"][1].update(name="manifest.json"))
    edit("empty-data-file.json", lambda m: m["files"].append(
        {"name": "rank-00002.bin", "rank": 1, "bytes": 0}))

    # huge arrays (within a few KiB), deep nesting, wrong types
    def many_buffers(m):
        m["buffers"][1:1] = [{"name": "b%d" % i, "dtype": "u8", "elem_bytes": 1, "total_bytes": 0,
                          "shards": []} for i in range(40)]
    edit("huge-buffer-array.json", many_buffers)
    edit("huge-trainer-array.json", lambda m: m["trainer"].update(pad=[0] * 1500))
    edit("huge-chunk-count.json", lambda m: buf(m, "flags")["shards"].append(
        {"rank": 0, "file": "rank-00000.bin", "offset": 0, "bytes": 0,
         "chunks": [{}] * 300}))
    put("fuzz_manifest", "deep-nesting.json",
        seal(base).replace('"trainer":{', '"trainer":{"deep":' + "[" * 1000 + "]" * 1000 + ",", 1))
    put("fuzz_manifest", "deep-nesting-over-limit.json",
        seal(base).replace('"trainer":{', '"trainer":{"deep":' + "[" * 2100 + "]" * 2100 + ",", 1))
    edit("world-size-0.json", lambda m: m.update(world_size=0))
    edit("world-size-huge.json", lambda m: m.update(world_size=(1 << 20) + 1))
    edit("rank-out-of-world.json", lambda m: m["files"][1].update(rank=2))
    edit("chunk-bytes-4095.json", lambda m: m.update(chunk_bytes=4095))
    edit("chunk-bytes-1gib.json", lambda m: m.update(chunk_bytes=1 << 30))
    edit("chunk-over-chunk-bytes.json", lambda m: chunk(m).update(bytes=4097))
    edit("format-version-2.json", lambda m: m.update(format_version=2))
    edit("trainer-not-object.json", lambda m: m.update(trainer=[1, 2]))
    edit("file-size-mismatch.json", lambda m: m["files"][0].update(bytes=7168))
    put("fuzz_manifest", "duplicate-key.json", seal(base).replace('"step":1,', '"step":1,"step":1,', 1))
    put("fuzz_manifest", "empty.json", "")


# ------------------------------------------------------------------ chunks

def zstd(data, *args):
    return subprocess.run(["zstd", "-q", "-c", *args], input=data, stdout=subprocess.PIPE,
                          check=True).stdout


def shuffle(raw, e):
    c = len(raw) // e
    return bytes(raw[i * e + k] for k in range(e) for i in range(c)) + raw[c * e:]


def hdr(flags, mode=1, hint=0, sel=0x40002000):
    return struct.pack("<BBHI", flags, mode, hint, sel)


def chunks():
    ZSTD, SHUF, TAIL, T2, BADST, BADRAW = 1, 2, 0x40, 0x80, 0x10, 0x20

    def eb(n):
        return {1: 0, 2: 1, 4: 2, 8: 3}[n] << 2
    floats = struct.pack("<1024f", *[(i % 97) * 0.125 - 3.0 for i in range(1024)])
    put("fuzz_chunk", "zstd-shuffle-f32.bin", hdr(ZSTD | SHUF | eb(4)) + zstd(shuffle(floats, 4), "-19"))
    put("fuzz_chunk", "zstd-f32-tail-2threads.bin",
        hdr(ZSTD | eb(4) | TAIL | T2) + zstd(floats, "-1"))
    put("fuzz_chunk", "zstd-no-content-size.bin",
        hdr(ZSTD | eb(1), mode=0, hint=4095) + zstd(floats[:4096], "--no-content-size"))
    put("fuzz_chunk", "zstd-hint-too-small.bin", hdr(ZSTD | eb(4), mode=0, hint=99) + zstd(floats))
    text = b"the quick brown fox jumps over the lazy dog " * 40
    put("fuzz_chunk", "zstd-two-frames.bin", hdr(ZSTD, mode=0, hint=2 * len(text) - 1) +
        zstd(text) + zstd(text))
    skippable = struct.pack("<II", 0x184D2A50, 5) + b"skip!"
    put("fuzz_chunk", "zstd-skippable-then-frame.bin", hdr(ZSTD, mode=0, hint=len(text) - 1) +
        skippable + zstd(text))
    framed = zstd(text, "--check")
    put("fuzz_chunk", "zstd-truncated.bin", hdr(ZSTD) + framed[:-7])
    bad = bytearray(framed)
    bad[-1] ^= 0xFF  # the frame's content checksum
    put("fuzz_chunk", "zstd-bad-content-checksum.bin", hdr(ZSTD) + bytes(bad))
    # one RLE block (hand-built frame, RFC 8878) declaring 128 KiB of 0x00
    n = 128 << 10
    rle = b"\x28\xb5\x2f\xfd\xa0" + struct.pack("<I", n) + (1 | 1 << 1 | n << 3).to_bytes(3, "little") + b"\x00"
    put("fuzz_chunk", "zstd-rle-128k.bin", hdr(ZSTD | SHUF | eb(8) | TAIL) + rle)
    raw = bytes((i * 131 + 7) & 0xFF for i in range(1021))  # 1021 % 8 != 0: a shuffle tail
    put("fuzz_chunk", "zstd-shuffle-e8-tail.bin", hdr(ZSTD | SHUF | eb(8)) + zstd(shuffle(raw, 8)))
    put("fuzz_chunk", "zstd-shuffle-e2.bin", hdr(ZSTD | SHUF | eb(2) | T2 | TAIL) + zstd(shuffle(raw, 2)))
    put("fuzz_chunk", "raw-none.bin", hdr(0, sel=0x12345678) + raw)
    put("fuzz_chunk", "raw-none-shuffle.bin", hdr(SHUF | eb(4) | TAIL) + raw)
    put("fuzz_chunk", "raw-bad-stored-checksum.bin", hdr(BADST | TAIL) + raw)
    put("fuzz_chunk", "zstd-bad-raw-checksum.bin", hdr(ZSTD | BADRAW | TAIL | T2) + zstd(raw))
    put("fuzz_chunk", "zstd-empty-frame.bin", hdr(ZSTD, mode=0, hint=0) + zstd(b""))
    put("fuzz_chunk", "not-a-frame.bin", hdr(ZSTD, mode=0, hint=63) + b"\x00" * 64)


# ------------------------------------------------------------------ store

TOKEN = b"fuzz-token-5b3e"


def frame(op, fid, body):
    return struct.pack("<IBI", 5 + len(body), op, fid) + body


def bts(b):
    return struct.pack("<I", len(b)) + b


def hello(token=TOKEN, version=1, magic=b"ESTR"):
    return frame(1, 1, magic + struct.pack("<H", version) + bts(token))


def store():
    SET, GET, WAIT, ADD, CAS, DEL = 2, 3, 4, 5, 6, 7
    put("fuzz_store", "raw-valid-hello-set-get.bin", b"\x00" + hello() +
        frame(SET, 2, bts(b"k0") + bts(b"v")) + frame(GET, 3, struct.pack("<I", 0) + bts(b"k0")))
    put("fuzz_store", "raw-bad-token.bin", b"\x00" + hello(b"wrong-token") + frame(SET, 2, bts(b"k") + bts(b"")))
    put("fuzz_store", "raw-no-token.bin", b"\x04" + hello(b""))
    put("fuzz_store", "raw-bad-version.bin", b"\x00" + hello(version=2))
    put("fuzz_store", "raw-bad-magic.bin", b"\x00" + hello(magic=b"HTTP"))
    put("fuzz_store", "raw-first-frame-not-hello.bin", b"\x00" + frame(SET, 1, bts(b"k") + bts(b"v")))
    put("fuzz_store", "raw-hello-too-long.bin", b"\x00" + struct.pack("<I", 5000) + b"\x01" * 64)
    put("fuzz_store", "raw-truncated-frame.bin", b"\x00" + hello()[:-3])
    put("fuzz_store", "raw-len-ffffffff.bin", b"\x00" + b"\xff\xff\xff\xff\x01\x00\x00\x00\x00")
    put("fuzz_store", "raw-http.bin", b"\x00GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    after = b"\x01" + hello()
    put("fuzz_store", "hello-len-ffffffff.bin", after + b"\xff\xff\xff\xff" + b"\x02" * 16)
    put("fuzz_store", "hello-len-4.bin", after + struct.pack("<I", 4) + b"\x02\x00\x00\x00")
    put("fuzz_store", "hello-len-over-limit.bin", after + struct.pack("<I", 64 + 512 + 8192 + 1) + b"\x02" * 32)
    put("fuzz_store", "hello-truncated-set.bin", after + frame(SET, 2, bts(b"k0") + bts(b"value"))[:-2])
    put("fuzz_store", "hello-1-byte-key.bin", after + frame(SET, 2, bts(b"x") + bts(b"1")) +
        frame(GET, 3, struct.pack("<I", 0) + bts(b"x")) + frame(DEL, 4, bts(b"x")))
    put("fuzz_store", "hello-empty-key.bin", after + frame(SET, 2, bts(b"") + bts(b"v")))
    put("fuzz_store", "hello-key-over-limit.bin", after + frame(GET, 2, struct.pack("<I", 0) + bts(b"K" * 513)))
    put("fuzz_store", "hello-value-over-limit.bin", after + frame(SET, 2, bts(b"k1") + bts(b"V" * 4097)))
    put("fuzz_store", "hello-wait-count-2p32-1.bin", after +
        frame(WAIT, 2, struct.pack("<II", 0, 0xFFFFFFFF) + bts(b"k0")))
    put("fuzz_store", "hello-wait-count-0.bin", after + frame(WAIT, 2, struct.pack("<II", 5, 0)))
    put("fuzz_store", "hello-wait-3-keys.bin", after + frame(SET, 2, bts(b"k1") + bts(b"")) +
        frame(WAIT, 3, struct.pack("<II", 10, 3) + bts(b"k1") + bts(b"k2") + bts(b"k1")))
    put("fuzz_store", "hello-parked-get-then-set.bin", after +
        frame(GET, 2, struct.pack("<I", 30) + bts(b"k7")) + frame(SET, 3, bts(b"k7") + bts(b"late")))
    put("fuzz_store", "hello-add-overflow.bin", after +
        frame(ADD, 2, struct.pack("<q", (1 << 63) - 1) + bts(b"k3")) +
        frame(ADD, 3, struct.pack("<q", 1) + bts(b"k3")) + frame(DEL, 4, bts(b"k3")))
    put("fuzz_store", "hello-add-not-a-number.bin", after + frame(SET, 2, bts(b"k4") + bts(b"12a")) +
        frame(ADD, 3, struct.pack("<q", 1) + bts(b"k4")))
    put("fuzz_store", "hello-cas.bin", after + frame(CAS, 2, bts(b"k5") + bts(b"") + bts(b"a")) +
        frame(CAS, 3, bts(b"k5") + bts(b"a") + bts(b"b")) + frame(CAS, 4, bts(b"k6") + bts(b"x") + bts(b"y")))
    put("fuzz_store", "hello-inner-length-lies.bin", after + frame(SET, 2, struct.pack("<I", 100) + b"k0" + bts(b"v")))
    put("fuzz_store", "hello-second-hello-unknown-op.bin", after + hello() + frame(0x42, 9, b"junk"))
    # mode 2: records the harness turns into frames (see send_ops in fuzz_store.c)
    put("fuzz_store", "ops-mixed.bin", b"\x02" +
        bytes([1, 0x60, 4, 0, 0x41, 0x42, 0x43, 0x44]) +  # SET k0 = "ABCD"
        bytes([2, 5, 0x61]) +                            # GET k1, wait 5 ms
        bytes([3, 7, 0x83, 0x60, 0x61, 0x62]) +          # WAIT count 2^32-1
        bytes([4]) + struct.pack("<q", -5) + bytes([0x62]) +  # ADD
        bytes([5, 0x60, 0, 0, 1, 0, 0x5a]) +             # CAS
        bytes([6, 0x60]) + bytes([0x0a, 0x60]) + bytes([0, 3, 1, 2, 3]))
    put("fuzz_store", "ops-limits.bin", b"\x06" + bytes([1, 0x20, 0x10, 0x10]) +
        bytes([2, 0, 0x00]) + bytes([1, 0x40, 3, 0x61, 0x62, 0x63, 0x02, 0x00, 0x00]))
    put("fuzz_store", "hello-from-input-version.bin", b"\x03" + bytes([1]) + struct.pack("<H", 0xFFFF))
    put("fuzz_store", "hello-from-input-token.bin", b"\x03" + bytes([0x08, 5]) + b"fuzz-" +
        frame(SET, 2, bts(b"k") + bts(b"")))
    put("fuzz_store", "hello-from-input-magic.bin", b"\x07" + bytes([0x02]))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    manifests(sys.argv[1])
    chunks()
    store()
