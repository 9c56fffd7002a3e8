"""Which kernels' machine code a change of the kernel sources moves, without a GPU.

    python tools/sass_diff.py DIR_A DIR_B [--arch 90a] [--source FILE.cu ...] [-k REGEX]

DIR_A, DIR_B: kernel source folders (e.g. kernels and a copy made with
`git archive REV kernels | tar -x -C ab/REV`). Each .cu file of DIR_B that differs
from DIR_A's, or every one where a header differs (of those, only the --source files
where given), is compiled in both folders with the extension's nvcc flags for one GPU
(-O3 and the -gencode of solution._gencode: sm_90a by default, --arch 80 for an A100)
and disassembled (cuobjdump -sass). For every kernel whose machine code differs it
prints the registers, the spill bytes (ptxas -v) and the instruction count of each
side, and how many instruction lines differ once register, predicate and barrier
numbers and immediates are masked, as GNU diff counts them (a reordering shows as
lines removed and added at the same count). Kernels with identical machine code are
counted, not listed: they run as before. One that moved must be timed on every problem it serves, not only on the one
the change was for: edits elsewhere in the resident forward laid its code out anew
and changed its time by up to 12% (docs/perf-notes.md #138, #154).

Each .cu file is compiled on its own, as tests/test_build.py does, not in the
extension's single translation unit with torch's extra nvcc flags: compare two
folders with each other, not with a built extension. cuobjdump is taken from $CUOBJDUMP, else PATH, else
$CUDA_HOME/bin; nvcc from $CUDA_HOME/bin (default /usr/local/cuda). Exits 0 when
every compiled kernel is identical, 1 when some differ, 2 on a usage error or when nvcc
or cuobjdump fails.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
# One instruction line of `cuobjdump -sass`: /*0a30*/  INSTRUCTION ;  /* encoding */
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?;)")
_FUNCTION = re.compile(r"^\s*Function : (\S+)")
# Register, uniform register, predicate and barrier numbers; immediate operands (not
# the widths in opcodes such as STG.E.128); branch labels.
_MASKS = [(re.compile(r"\bUR[0-9]+\b"), "UR"), (re.compile(r"\bR[0-9]+\b"), "R"), (re.compile(r"\bUP[0-6]\b"), "UP"),
          (re.compile(r"\bP[0-6]\b"), "P"), (re.compile(r"\bB[0-9]+\b"), "B"),
          (re.compile(r"(?<=[\s\[+\-,(|])(0x[0-9a-f]+|[0-9]+(\.[0-9]+)?(e[+-]?[0-9]+)?)\b"), "N"),
          (re.compile(r"\.L_x_[0-9]+"), "L")]


def sass_by_kernel(text):
    """{kernel name: [instruction, ...]} of `cuobjdump -sass` output (addresses and
    encodings dropped)."""
    kernels, current = {}, None
    for line in text.splitlines():
        match = _FUNCTION.match(line)
        if match:
            current = kernels.setdefault(match.group(1), [])
            continue
        match = _INSTRUCTION.match(line)
        if match and current is not None:
            current.append(" ".join(match.group(1).split()))
    return kernels


def masked(instruction):
    """An instruction with register, predicate and barrier numbers, immediates and
    labels replaced by placeholders: equal for two schedules of the same code."""
    for pattern, placeholder in _MASKS:
        instruction = pattern.sub(placeholder, instruction)
    return instruction


def ptxas_resources(text):
    """{kernel name: (registers, spill bytes stored, spill bytes loaded)} from `ptxas -v` output."""
    resources, spills, entry, properties = {}, {}, None, None
    for line in text.splitlines():
        match = re.search(r"Compiling entry function '(\S+)'", line)
        if match:
            entry = match.group(1)
        match = re.search(r"Function properties for (\S+)", line)
        if match:
            properties = match.group(1)
        match = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if match and properties is not None:
            spills[properties] = (int(match.group(1)), int(match.group(2)))
        match = re.search(r"Used (\d+) registers", line)
        if match and entry is not None:
            resources[entry] = (int(match.group(1)), *spills.get(entry, (0, 0)))
    return resources


def compare(a, b):
    """(kernel, instructions a, instructions b, masked lines removed, masked lines
    added) for each kernel whose instructions differ between the {kernel:
    [instruction]} maps a and b, the masked lines as GNU diff matches them (a kernel
    on one side only counts all its lines)."""
    changed = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in sorted(set(a) | set(b)):
            left, right = a.get(name, []), b.get(name, [])
            if left == right:
                continue
            paths = [os.path.join(scratch, side) for side in ("a", "b")]
            for path, lines in zip(paths, (left, right)):
                with open(path, "w", encoding="utf-8") as f:
                    f.write("".join(masked(line) + "\n" for line in lines))
            diff = subprocess.run(["diff", *paths], capture_output=True, text=True).stdout.splitlines()
            removed = sum(1 for line in diff if line.startswith("<"))
            added = sum(1 for line in diff if line.startswith(">"))
            changed.append((name, len(left), len(right), removed, added))
    return changed


def fail(message):
    """Exit with status 2 (a usage or tool error, not a difference) and `message`."""
    print(f"sass_diff: {message}", file=sys.stderr)
    sys.exit(2)


def cuobjdump():
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), os.path.join(CUDA_HOME, "bin", "cuobjdump")]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate):
            return candidate
    fail("cuobjdump not found ($CUOBJDUMP, PATH, $CUDA_HOME/bin); set CUOBJDUMP")


def compile_both(directories, source, arch, out_dir):
    """[(sass by kernel, ptxas resources)] of one .cu file in each of `directories`,
    the nvcc runs side by side."""
    flags = ["-c", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v"]
    objects = [os.path.join(out_dir, f"{side}-{source}.o") for side in range(len(directories))]
    runs = [subprocess.Popen([os.path.join(CUDA_HOME, "bin", "nvcc"), *flags, os.path.join(directory, source), "-o", obj],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for directory, obj in zip(directories, objects)]
    logs = [run.communicate()[0] for run in runs]
    results = []
    for directory, obj, run, log in zip(directories, objects, runs, logs):
        if run.returncode != 0:
            fail(f"nvcc failed on {os.path.join(directory, source)}:\n{log[-3000:]}")
        sass = subprocess.run([cuobjdump(), "-sass", obj], capture_output=True, text=True)
        if sass.returncode != 0:
            fail(f"cuobjdump failed on {obj}:\n{sass.stderr[-3000:]}")
        results.append((sass_by_kernel(sass.stdout), ptxas_resources(log)))
    return results


def sources_to_compile(dir_a, dir_b):
    """The .cu files of dir_b to compile: every one if a header differs, else those that differ."""
    def text(directory, name):
        path = os.path.join(directory, name)
        return open(path, encoding="utf-8").read() if os.path.isfile(path) else None

    names = sorted(set(os.listdir(dir_a)) | set(os.listdir(dir_b)))
    differing = [name for name in names if text(dir_a, name) != text(dir_b, name)]
    cuda = [name for name in names if name.endswith(".cu") and os.path.isfile(os.path.join(dir_b, name))]
    if any(name.endswith((".h", ".cuh")) for name in differing):
        return cuda
    return [name for name in cuda if name in differing]


def demangle(names):
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return dict(zip(names, names))
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else dict(zip(names, names))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir_a")
    parser.add_argument("dir_b")
    parser.add_argument("--arch", default="90a", help="compute capability digits, e.g. 90a (default) or 80")
    parser.add_argument("--source", action="append", default=None,
                        help="compile only this .cu file (repeatable; default: every one that may have changed)")
    parser.add_argument("-k", dest="pattern", default="", help="only kernels whose mangled name matches this regex")
    args = parser.parse_args()
    for directory in (args.dir_a, args.dir_b):
        if not os.path.isdir(directory):
            parser.error(f"{directory} is not a directory")
    sources = sources_to_compile(args.dir_a, args.dir_b)
    if args.source:
        sources = [name for name in sources if name in args.source]
    if not sources:
        print("sass_diff: no .cu file differs and no header differs: nothing to compile")
        return 0
    any_changed = False
    with tempfile.TemporaryDirectory() as out_dir:
        for source in sources:
            (sass_a, res_a), (sass_b, res_b) = compile_both((args.dir_a, args.dir_b), source, args.arch, out_dir)
            pick = re.compile(args.pattern)
            sass_a = {k: v for k, v in sass_a.items() if pick.search(k)}
            sass_b = {k: v for k, v in sass_b.items() if pick.search(k)}
            changed = compare(sass_a, sass_b)
            total = len(set(sass_a) | set(sass_b))
            print(f"{source} (sm_{args.arch}): {total} kernels, {total - len(changed)} identical, {len(changed)} differ")
            names = demangle([name for name, *_ in changed])
            for name, count_a, count_b, removed, added in changed:
                ra, rb = res_a.get(name, ("-", "-", "-")), res_b.get(name, ("-", "-", "-"))
                print(f"  {names[name]}\n    registers {ra[0]} -> {rb[0]}, spill stores {ra[1]} -> {rb[1]}, "
                      f"instructions {count_a} -> {count_b}, masked lines {removed} removed and {added} added")
            any_changed = any_changed or bool(changed)
    return 1 if any_changed else 0


if __name__ == "__main__":
    sys.exit(main())
