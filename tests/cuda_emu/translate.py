#!/usr/bin/env python3
"""translate.py IN.cu OUT.cpp - prepare a CUDA source for the CUDA emulator (tests/cuda_emu).

The one piece of CUDA syntax that is not C++ is the launch: `kernel<<<grid, block, smem,
stream>>>(args)` becomes `::emu::launcher("kernel", grid, block, smem, stream).run(kernel,
args)` (cuda_runtime.h). Everything else is left as it is; line breaks are kept and a #line
directive names IN.cu, so that compiler messages point at the original lines.
"""
import re
import sys

LAUNCH = re.compile(r"([A-Za-z_]\w*(?:\s*<[^<>;(){}]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)


def translate(src: str) -> str:
    out, pos = [], 0
    for m in LAUNCH.finditer(src):
        name, cfg = m.group(1), m.group(2)
        if "," in name:
            sys.exit(f"translate.py: a template kernel name with a comma is not handled: {name}")
        out.append(src[pos:m.start()])
        no_args = re.match(r"\s*\)", src[m.end():]) is not None
        out.append(f"::emu::launcher(EMU_STR_({name}), {cfg}).run({name}" + ("" if no_args else ", "))
        pos = m.end()
    out.append(src[pos:])
    return "".join(out)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: translate.py IN.cu OUT.cpp")
    with open(sys.argv[1], encoding="utf-8") as f:
        src = f.read()
    body = translate(src)
    if "<<<" in body:
        sys.exit(f"translate.py: {sys.argv[1]}: a launch left untranslated")
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        f.write(f'#line 1 "{sys.argv[1]}"\n' + body)


if __name__ == "__main__":
    main()
