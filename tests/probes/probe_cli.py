#!/usr/bin/python3
"""Random-flag probe of the qkv command line.

Runs seeded random flag sets of `qkv train`, `generate`, `viz`, `memory`, `scaling` and `bench`:
each flag given a value from its own small valid set or from a list of bad ones (zero, negative,
huge, NaN, inf, not a number, empty), under a timeout, with the sizes that make a command slow kept
small unless the value drawn is out of range (which must then be refused before any work). Every
run must end with exit 0 or a clean error: exit 2 with "qkv: error:", or one of CLI11's usage
exits (100-120) with a message on stderr. A signal, a hang, exit 1 ("internal error") or output
without a message fails the probe.

  /usr/bin/python3 tests/probes/probe_cli.py --qkv build/release/tools/qkv/qkv --work /tmp/probe \
      --runs 150 --seed 1
"""
import argparse
import os
import random
import shutil
import subprocess
import sys

BAD = ["0", "-1", "-100000", "100000", "1000000000", "99999999999999999999", "nan", "inf", "-inf", "1e30",
       "abc", "", "0x10", "1.5"]
BAD_REAL = ["0", "-1", "1e30", "nan", "inf", "-inf", "abc", "", "1e-30"]


def flags_for(command, work, model):
    """{flag: valid values} of a command; each valid set keeps the run small."""
    if command == "train":
        return {
            "--task": ["copy", "reverse", "recall"], "--steps": ["0", "1", "3"], "--batch": ["1", "2", "8"],
            "--lr": ["1e-3", "3e-3", "0.1"], "--warmup": ["0", "2"], "--symbols": ["2", "4", "26"],
            "--pairs": ["1", "2", "4"], "--length": ["1", "3", "5"], "--d-model": ["4", "8", "12"],
            "--heads": ["1", "2", "4"], "--layers": ["1", "2"], "--eval": ["1", "8"], "--eval-every": ["1", "2"],
            "--threads": ["1", "2"], "--checkpoint-every": ["0", "1"], "--seed": ["0", "7"],
            "--attention": ["softmax", "sparse", "linear"], "--positions": ["sinusoidal", "rotary"],
            "--mask": ["window(2)", "strided(2)", "causal & window(1)"],
            # Never a real device here: a qkv that renamed over it would replace it.
            "--save": [os.path.join(work, "out.qkv"), os.path.join(work, "fifo"), os.path.join(work, "null-link"),
                       work],
            "--checkpoint": [os.path.join(work, "probe.ckpt")],
        }
    if command == "generate":
        return {
            "--model": [model], "--prompt": ["a b", "0 1", "a |"], "--tokens": ["0", "1", "2"],
            "--kv-dtype": ["f32", "bf16", "f16"], "--sweep": ["32", "40"], "--repeats": ["1", "2"],
            "--seed": ["0", "3"], "--threads": ["1", "2"],
        }
    if command == "viz":
        return {
            "--text": ["a b c", "The cat sat"], "--heads": ["1", "2", "4"], "--embed": ["8", "16"],
            "--temperature": ["1", "0.5,2"], "--head": ["0", "1"], "--compare-heads": ["1,2", "2"],
            "--seed": ["1"], "--mask": ["causal", "window(1)"],
            "-o": [os.path.join(work, "viz.svg"), os.path.join(work, "viz.png")],
        }
    if command == "memory":
        return {"--seq": ["16", "2048"], "--layers": ["1", "96"], "--heads": ["1", "8"], "--batch": ["1", "4"],
                "--head-dim": ["8", "128"], "--dtype": ["f32", "bf16", "f64"]}
    if command == "scaling":
        return {"--min-seq": ["16", "32"], "--max-seq": ["32", "64"], "--heads": ["1", "2"], "--head-dim": ["8"],
                "--repeats": ["1"], "--sparse-window": ["4", "8"], "--kernels": ["flash", "reference,flash"],
                "-o": [os.path.join(work, "scaling.svg")]}
    if command == "bench":
        # bench's real runs take minutes: only bad values, which must be refused before any work.
        return {"--threads": [], "--runs": [], "--reference-runs": []}
    raise ValueError(command)


# Flags whose valid values must always be given, small, unless the flag drew a bad value.
SMALL = {
    "train": {"--steps": "2", "--eval": "4", "--length": "3", "--symbols": "4", "--d-model": "8", "--heads": "2",
              "--layers": "1", "--pairs": "2"},
    "generate": {"--tokens": "1"},
    "viz": {"-o": "viz.svg", "--heads": "2", "--embed": "8"},
    "memory": {},
    "scaling": {"--min-seq": "16", "--max-seq": "32", "--heads": "1", "--head-dim": "8", "--repeats": "1",
                "-o": "scaling.svg"},
    "bench": {},
}
REAL_FLAGS = {"--lr", "--temperature"}
# Values of BAD that are in range for these flags and would make the run long: not drawn for them.
SLOW_IF_VALID = {("train", "--steps"): {"100000", "1000000000"}, ("train", "--eval"): {"100000"},
                 ("scaling", "--max-seq"): {"100000"}, ("scaling", "--min-seq"): {"100000"},
                 ("bench", "--threads"): {"0x10"}, ("bench", "--runs"): {"0x10"},
                 ("bench", "--reference-runs"): {"0x10"}}
WORD_FLAGS = {"--task", "--attention", "--positions", "--mask", "--save", "--checkpoint", "--model", "--prompt",
              "--kv-dtype", "--text", "--kernels", "--dtype", "-o"}


def random_args(rng, command, work, model):
    table = flags_for(command, work, model)
    chosen = rng.sample(sorted(table), k=min(len(table), rng.randint(1, 5)))
    args = {}
    for flag in chosen:
        valid = table[flag]
        if valid and (flag in WORD_FLAGS or rng.random() < 0.5):
            args[flag] = rng.choice(valid)
        else:
            skip = SLOW_IF_VALID.get((command, flag), set())
            args[flag] = rng.choice([v for v in (BAD_REAL if flag in REAL_FLAGS else BAD) if v not in skip])
    for flag, value in SMALL[command].items():
        if flag not in args:
            args[flag] = os.path.join(work, value) if flag == "-o" else value
    if command == "generate":
        args.setdefault("--model", model)
    out = [command]
    for flag, value in args.items():
        out += [flag, value]
    return out


def judge(status, err):
    if status == "timeout":
        return "hung (timeout)"
    if status < 0:
        return "killed by signal %d" % -status
    if status == 0:
        return None
    if status == 2 and "qkv: error:" in err and "internal error" not in err:
        return None
    if 100 <= status <= 120 and err.strip():
        return None  # CLI11's usage errors (conversion, validation, extras, ...)
    return "exit %d without a clean error" % status


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qkv", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--runs", type=int, default=150)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60)
    a = ap.parse_args()
    if not 1 <= a.runs <= 10000:
        sys.exit("--runs must be in [1, 10000]")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    model = os.path.join(a.work, "model.qkv")
    subprocess.run([a.qkv, "train", "--task", "copy", "--length", "3", "--symbols", "4", "--steps", "3", "--eval",
                    "4", "--d-model", "8", "--heads", "2", "--layers", "1", "--save", model],
                   check=True, capture_output=True, timeout=120)
    os.mkfifo(os.path.join(a.work, "fifo"))
    os.symlink("/dev/null", os.path.join(a.work, "null-link"))
    rng = random.Random(a.seed)
    commands = ["train", "generate", "viz", "memory", "scaling", "bench"]
    weights = [5, 4, 3, 2, 2, 1]
    failures, outcomes = [], {"ok": 0, "error": 0}
    for i in range(a.runs):
        args = random_args(rng, rng.choices(commands, weights)[0], a.work, model)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            p = subprocess.run([a.qkv] + args, capture_output=True, text=True, errors="replace", timeout=a.timeout,
                               cwd=a.work, env=env, stdin=subprocess.DEVNULL)
            status, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired:
            status, err = "timeout", ""
        why = judge(status, err)
        if why:
            failures.append("qkv %s: %s\n  stderr: %s" % (" ".join(repr(x) for x in args), why, err.strip()[-400:]))
        else:
            outcomes["ok" if status == 0 else "error"] += 1
    print("probe_cli: %d random flag sets (seed %d): %d succeeded, %d refused with a clear error, %d failures"
          % (a.runs, a.seed, outcomes["ok"], outcomes["error"], len(failures)))
    for f in failures:
        print("FAIL " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
