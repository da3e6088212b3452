#!/usr/bin/env python3
"""kernel_check_selftest - does tests/gpu/kernel_check catch what it is meant to catch?

kernel_check_cpu is kernel_check built on the CPU table (kernel_check_cpu.h): with no planted
defect every check must pass (the CPU table against itself: the harness adds no error of its
own, the two runs of each op give the same bits, the references are right); with each defect
of KERNEL_CHECK_INJECT the run must fail, on exactly the checks named below and no others -
each defect one that a weaker harness (random gradient starts only, a 1e-2 tolerance for the
bf16 GEMMs, uninitialised outputs, no N above 256, no length above one grid) let through.

Usage: kernel_check_selftest.py KERNEL_CHECK_CPU_BINARY [--short]
  --short  leave out the defects checked on the two long shapes (2: N=515, V=50257; 4: the
           length above one grid): the sanitizer builds' run; the normal build runs all
"""
import os
import re
import subprocess
import sys

# defect -> (shapes to run, the checks that must fail: regular expressions on the whole name
# and shape columns)
INJECT = {
    "ce_backward_scaled": ("0", [r"softmax_crossentropy_backward \(from 0\) +B2 T64"]),
    "mm16_unrounded_dout": ("0", [r"matmul_backward_bf16( \(from 0\))? +B2 T64",
                                  r"matmul_backward_bf16 \((dinp, no dbias|dbias, no dinp|dW only)\) +B2 T64"]),
    "gelu_last_unwritten": ("0", [r"gelu_forward +B2 T64"]),
    "colsum_first_chunk": ("2", [r"matmul_backward( \(from 0\)| \(dbias, no dinp\))? +B5 T103"]),
    "adamw_one_grid": ("4", [r"adamw \(bits vs train/optim.c\) +n=16789563"]),
}
LINE = re.compile(r"^(?P<name>.+?)\s+max_rel_err (?P<err>\S+)\s+tol \S+(?: \(bits\))?\s+(?P<verdict>PASS|FAIL)")


def run(binary, shapes=None, inject=None):
    # freed buffers stay in the heap: without this the tens of 64 MiB buffers of the long
    # shape are mmap()ed and page-faulted afresh each time (35 s instead of 6 s here)
    env = dict(os.environ, KERNEL_CHECK_SEED="12345", MALLOC_MMAP_THRESHOLD_="4294967296",
               MALLOC_TRIM_THRESHOLD_="4294967296", MALLOC_TOP_PAD_="268435456")
    env.pop("KERNEL_CHECK_INJECT", None)
    if shapes is not None:
        env["KERNEL_CHECK_SHAPES"] = shapes
    if inject:
        env["KERNEL_CHECK_INJECT"] = inject
    p = subprocess.run([binary], env=env, capture_output=True, text=True, timeout=600)
    checks = []
    for line in p.stdout.splitlines():
        m = LINE.match(line)
        if m:
            checks.append((m.group("name"), m.group("verdict"), line))
    return p, checks


def main():
    binary = sys.argv[1]
    short = "--short" in sys.argv[2:]
    failures = []

    # 1. no defect: every check passes, exit 0 (the two long shapes, 2 and 4, run below, where
    # every check but the defect's must pass too)
    p, checks = run(binary, "013")
    bad = [c[2] for c in checks if c[1] != "PASS"]
    print(f"clean run: exit {p.returncode}, {len(checks)} checks, {len(bad)} not passing")
    if p.returncode != 0 or bad or len(checks) < 140:
        failures.append(f"clean run: exit {p.returncode}, {len(checks)} checks; "
                        f"not passing: {bad[:5]}; stderr: {p.stderr[-500:]}")
    for shape in ("B2 T64", "B3 T37", "B2 T96"):
        if not any(shape in c[0] for c in checks):
            failures.append(f"clean run: no check on shape {shape}")

    # 2. each planted defect fails the run, on exactly the checks meant to catch it
    for inj, (shapes, expect) in INJECT.items():
        if short and ("2" in shapes or "4" in shapes):
            print(f"{inj}: left out (--short: shape {shapes} runs on the normal build)")
            continue
        p, checks = run(binary, shapes, inj)
        failed = [c[0] for c in checks if c[1] == "FAIL"]
        print(f"{inj}: exit {p.returncode}, {len(checks)} checks, {len(failed)} failing: {failed}")
        if len(checks) < 12:
            failures.append(f"{inj}: only {len(checks)} checks ran")
        if p.returncode != 1:
            failures.append(f"{inj}: exit {p.returncode}, expected 1; stderr {p.stderr[-300:]}")
        for rx in expect:
            if not any(re.fullmatch(rx, f.strip()) or re.match(rx, f) for f in failed):
                failures.append(f"{inj}: no failing check matches /{rx}/ (failing: {failed})")
        for f in failed:
            if not any(re.match(rx, f) for rx in expect):
                failures.append(f"{inj}: check '{f}' failed, which this defect should not touch")

    for f in failures:
        print("FAIL:", f)
    print("kernel_check_selftest:", "PASS" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
