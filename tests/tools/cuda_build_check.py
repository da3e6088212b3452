#!/usr/bin/env python3
"""The CUDA build test (meson suites unit and build): checks what CI can check without a GPU.

1. The fatbin of a binary that links the CUDA kernel library holds sm_80 and sm_90 SASS and
   sm_90 PTX (fatbin_ls.py; cuobjdump is not in this toolkit).
2. Each .cu file of kernels/cuda compiled again with `nvcc --ptxas-options=-v`, the build's
   flags: prints registers, stack frame and spills of every kernel per architecture, and fails
   on any nonzero "bytes spill stores" / "bytes spill loads".

Usage: cuda_build_check.py --no-cuda            (exit 77: the build has no CUDA)
       cuda_build_check.py --nvcc NVCC --fatbin-ls PY --binary BIN --src DIR --build DIR
Exit 0 pass, 1 fail, 77 skip."""
import argparse, os, re, subprocess, sys, tempfile

GENCODE = ["-gencode=arch=compute_80,code=sm_80",
           "-gencode=arch=compute_90,code=[sm_90,compute_90]"]
# the file's own extra flags (kernels/meson.build)
EXTRA = {"kern_cuda_optim.cu": ["-fmad=false"]}


def demangle(names):
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        out = r.stdout.splitlines()
        if len(out) == len(names):
            return dict(zip(names, out))
    except OSError:
        pass
    return {n: n for n in names}


def ptxas_report(nvcc, src, build, path):
    with tempfile.TemporaryDirectory() as d:
        cmd = [nvcc, "-c", "-O3", "--ptxas-options=-v", *GENCODE, *EXTRA.get(os.path.basename(path), []),
               "-I" + os.path.join(src, "kernels"), "-I" + os.path.join(src, "kernels", "cuda"),
               "-I" + os.path.join(src, "common"), "-I" + build, path, "-o", os.path.join(d, "k.o")]
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        print(" ".join(cmd))
        print(r.stdout + r.stderr)
        return None
    rows, cur, arch = [], None, None
    for line in (r.stdout + r.stderr).splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
        if m:
            cur, arch = m.group(1), m.group(2)
            rows.append({"fn": cur, "arch": arch, "regs": None, "stack": 0, "st": 0, "ld": 0})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and rows:
            rows[-1].update(stack=int(m.group(1)), st=int(m.group(2)), ld=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and rows:
            rows[-1]["regs"] = int(m.group(1))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-cuda", action="store_true")
    ap.add_argument("--nvcc"); ap.add_argument("--fatbin-ls"); ap.add_argument("--binary")
    ap.add_argument("--src"); ap.add_argument("--build")
    a = ap.parse_args()
    if a.no_cuda:
        print("SKIP: the build has no CUDA (have_cuda false)")
        return 77
    ok = True
    r = subprocess.run([sys.executable, a.fatbin_ls, a.binary, "--require", "ELF:90",
                        "--require", "PTX:90", "--require", "ELF:80"], capture_output=True, text=True)
    print(r.stdout, end="")
    print(f"fatbin of {os.path.basename(a.binary)}: sm_80 SASS, sm_90 SASS, sm_90 PTX: "
          + ("PASS" if r.returncode == 0 else "FAIL"))
    ok &= r.returncode == 0
    cudir = os.path.join(a.src, "kernels", "cuda")
    files = sorted(f for f in os.listdir(cudir) if f.endswith(".cu"))
    rows_all = []
    for f in files:
        rows = ptxas_report(a.nvcc, a.src, a.build, os.path.join(cudir, f))
        if rows is None:
            print(f"{f}: nvcc --ptxas-options=-v failed: FAIL")
            ok = False
            continue
        if not rows:
            print(f"{f}: no kernels reported by ptxas: FAIL")
            ok = False
        rows_all += [dict(x, file=f) for x in rows]
    names = demangle([x["fn"] for x in rows_all])
    print(f"{'kernel':44s} {'arch':6s} {'regs':>4s} {'stack':>5s} {'spill st':>8s} {'spill ld':>8s}")
    for x in rows_all:
        nm = names.get(x["fn"], x["fn"]).split("(")[0]
        bad = x["st"] or x["ld"]
        print(f"{nm:44s} {x['arch']:6s} {x['regs'] if x['regs'] is not None else '?':>4} "
              f"{x['stack']:5d} {x['st']:8d} {x['ld']:8d}{'  SPILL: FAIL' if bad else ''}")
        ok &= not bad
    print("zero spill stores/loads in every kernel: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
