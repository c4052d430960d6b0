#!/usr/bin/python3
"""Corruption probe of the .qkv model file (include/qkv/train.hpp documents the format).

Trains a tiny model and a tiny checkpoint with `qkv train`, then writes seeded variants of them
(bits flipped, truncated, padded, config and header fields rewritten, tensor values made NaN or
infinite, converted to format version 1; with and without the CRC-32C resealed, so that changes
reach the parser behind the checksum) and special files (a folder, a FIFO, a device), and loads
each with `qkv generate --model FILE --tokens 1` under a timeout. Every load must be a success
or a clean error: exit 0, or exit 2 with "qkv: error:" naming the file. A signal, a hang, exit 1
("internal error") or any other exit fails the probe. Some classes must end one way: a flipped bit
without resealing, a non-finite weight and a bad config are errors; a version 1 file loads with
the warning that it carries no checksum.

  /usr/bin/python3 tests/probes/probe_model_files.py --qkv build/release/tools/qkv/qkv \
      --work /tmp/probe --variants 300 --seed 1
"""
import argparse
import os
import random
import shutil
import struct
import subprocess
import sys

CONFIG_OFFSET = 16  # 5 x i64: vocab_size, max_len, d_model, num_heads, num_layers
CONFIG_NAMES = ["vocab_size", "max_len", "d_model", "num_heads", "num_layers"]
INTERESTING_I64 = [0, 1, 2, 3, -1, -(2**63), 2**63 - 1, 2**31, 2**32, 2**16, 2**16 + 1, 2**20, 2**20 + 1,
                   2**40, 1028, 4096, 16384, 16385]
INTERESTING_U32 = [0, 1, 2, 3, 4, 7, 255, 4096, 4097, 65535, 2**31, 2**32 - 1]


def crc32c(data):
    """CRC-32C (Castagnoli), reflected, as src/core/crc32c.hpp computes it."""
    table = crc32c.table
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


crc32c.table = _crc_table()


def reseal(data):
    data = bytearray(data)
    if len(data) >= 4:
        data[-4:] = struct.pack("<I", crc32c(bytes(data[:-4])))
    return bytes(data)


def tensor_value_range(data):
    """Offsets of the float values of the first tensor after the mask (a v3 file)."""
    mask_len = struct.unpack_from("<I", data, 64)[0]
    at = 68 + mask_len + 4  # the tensor count
    name_len = struct.unpack_from("<I", data, at)[0]
    at += 4 + name_len
    rank = struct.unpack_from("<I", data, at)[0]
    at += 4
    dims = struct.unpack_from("<%dq" % rank, data, at)
    at += 8 * rank
    count = 1
    for d in dims:
        count *= d
    return at, count


def to_version1(data):
    """A version 3 file with an empty mask as version 1: no flags, no v3 fields, no checksum."""
    data = bytearray(data[:-4])
    del data[56:68]
    del data[12:16]
    data[8:12] = struct.pack("<I", 1)
    return bytes(data)


def variants(base, rng, count):
    """(kind, bytes, expectation) triples; expectation: None (either), "error", "warning"."""
    out = []
    kinds = ["flip", "flip-resealed", "truncate", "pad", "pad-resealed", "config", "u32-field", "non-finite",
             "overwrite-resealed", "version1", "version1-flip"]
    for i in range(count):
        kind = kinds[i % len(kinds)]
        data = bytearray(base)
        expect = None
        if kind == "flip":
            at = rng.randrange(len(data) - 4)
            data[at] ^= 1 << rng.randrange(8)
            expect = "error"
        elif kind == "flip-resealed":
            at = rng.randrange(len(data) - 4)
            data[at] ^= 1 << rng.randrange(8)
            data = reseal(data)
        elif kind == "truncate":
            data = data[:rng.randrange(len(data))]
            expect = "error"
        elif kind in ("pad", "pad-resealed"):
            data += bytes(rng.randrange(256) for _ in range(rng.choice([1, 3, 4, 8, 100, 5000])))
            if kind == "pad-resealed":
                data = reseal(data)
            expect = "error"
        elif kind == "config":
            field = rng.randrange(5)
            value = rng.choice(INTERESTING_I64 + [rng.randrange(-2**63, 2**63)])
            struct.pack_into("<q", data, CONFIG_OFFSET + 8 * field, value)
            data = reseal(data)
            original = struct.unpack_from("<q", base, CONFIG_OFFSET + 8 * field)[0]
            # max_len may change (the table is not in the file), num_heads too (no shape depends on it).
            expect = "error" if value != original and field not in (1, 3) else None
            kind = "config-" + CONFIG_NAMES[field]
        elif kind == "u32-field":
            at = rng.choice([8, 12, 56, 60, 64, 68])
            struct.pack_into("<I", data, at, rng.choice(INTERESTING_U32))
            data = reseal(data)
        elif kind == "non-finite":
            start, n = tensor_value_range(data)
            struct.pack_into("<f", data, start + 4 * rng.randrange(n), rng.choice([float("nan"), float("inf"),
                                                                                   float("-inf")]))
            data = reseal(data)
            expect = "error"
        elif kind == "overwrite-resealed":
            at = rng.randrange(len(data) - 4)
            width = rng.choice([1, 4, 8])
            for j in range(at, min(at + width, len(data) - 4)):
                data[j] = rng.randrange(256)
            data = reseal(data)
        elif kind == "version1":
            data = to_version1(data)
            expect = "warning"
        elif kind == "version1-flip":
            data = bytearray(to_version1(data))
            at = rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
        out.append((kind, bytes(data), expect))
    return out


def run_load(qkv, path, timeout):
    """(status, stdout, stderr); status is the exit code, or "timeout"."""
    try:
        p = subprocess.run([qkv, "generate", "--model", path, "--tokens", "1"], capture_output=True, text=True,
                           errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", ""
    return p.returncode, p.stdout, p.stderr


def judge(status, err, expect, path):
    """None when the outcome is acceptable, else why not."""
    if status == "timeout":
        return "hung (timeout)"
    if status < 0:
        return "killed by signal %d" % -status
    if status == 0:
        if expect == "error":
            return "loaded, but this variant must be refused"
        if expect == "warning" and "carries no checksum" not in err:
            return "a version 1 file loaded without the no-checksum warning"
        return None
    if status != 2 or "qkv: error:" not in err or "internal error" in err:
        return "exit %s without a clean qkv::Error" % status
    if expect == "error" and path not in err:
        return "the error does not name the file"
    if expect == "warning":
        return "a version 1 file was refused"
    return None


def train_base(qkv, work, name, extra):
    path = os.path.join(work, name)
    cmd = [qkv, "train", "--task", "copy", "--length", "3", "--symbols", "4", "--steps", "3", "--eval", "4",
           "--d-model", "8", "--heads", "2", "--layers", "1"] + extra
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, cwd=work)
    with open(path, "rb") as f:
        return f.read()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qkv", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--variants", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30)
    a = ap.parse_args()
    if not 1 <= a.variants <= 100000:
        sys.exit("--variants must be in [1, 100000]")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    model = train_base(a.qkv, a.work, "base.qkv", ["--save", "base.qkv"])
    checkpoint = train_base(a.qkv, a.work, "base.ckpt", ["--checkpoint", "base.ckpt", "--checkpoint-every", "3"])
    rng = random.Random(a.seed)
    cases = []
    for base_name, base in (("model", model), ("checkpoint", checkpoint)):
        share = a.variants // 2 if base_name == "model" else a.variants - a.variants // 2
        for kind, data, expect in variants(base, rng, share):
            if base_name == "checkpoint" and kind.startswith("version1"):
                continue  # a version 1 file has no flags: it cannot be a checkpoint
            cases.append((base_name + ":" + kind, data, expect))
    failures = []
    counts = {"loaded": 0, "refused": 0}
    path = os.path.join(a.work, "variant.qkv")
    for i, (kind, data, expect) in enumerate(cases):
        with open(path, "wb") as f:
            f.write(data)
        status, _, err = run_load(a.qkv, path, a.timeout)
        why = judge(status, err, expect, path)
        if why:
            keep = os.path.join(a.work, "failure-%d.qkv" % i)
            shutil.copy(path, keep)
            failures.append("%s (%s): %s\n  stderr: %s" % (kind, keep, why, err.strip()[-400:]))
        else:
            counts["loaded" if status == 0 else "refused"] += 1
    # Files that are not model files at all.
    specials = [os.path.join(a.work, "folder"), os.path.join(a.work, "fifo"), "/dev/null"]
    os.makedirs(specials[0])
    os.mkfifo(specials[1])
    for path in specials:
        status, _, err = run_load(a.qkv, path, a.timeout)
        why = judge(status, err, "error", path)
        if why:
            failures.append("%s: %s\n  stderr: %s" % (path, why, err.strip()[-400:]))
        else:
            counts["refused"] += 1
    total = len(cases) + len(specials)
    print("probe_model_files: %d loads (seed %d): %d loaded, %d refused with a clear error, %d failures"
          % (total, a.seed, counts["loaded"], counts["refused"], len(failures)))
    for f in failures:
        print("FAIL " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
