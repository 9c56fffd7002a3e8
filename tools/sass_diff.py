"""Which kernels' machine code a change of the kernel sources moves, without a GPU.

    python tools/sass_diff.py DIR_A DIR_B [--arch 90a] [--source FILE.cu ...] [-k REGEX]

DIR_A, DIR_B: kernel source folders (e.g. kernels and a copy made with
`git archive REV kernels | tar -x -C ab/REV`). Each .cu file that differs between
them (or exists in one only), or every one where a header differs (of those, only the
--source files where given), is compiled in both folders with the extension's nvcc
flags for one GPU (-O3 and the -gencode of solution._gencode: sm_90a by default,
--arch 80 for an A100) and disassembled (cuobjdump -sass). A kernel is identical when
its instructions, their encodings (which hold the scheduling controls) and ptxas's
resources (registers, spills, stack, barriers, shared memory) all match; identical
kernels are counted, not listed: they run as before. A kernel template that gains an
optional trailing parameter pack renames its plain kernels (an empty pack is
mangled in); those are compared with the old names' kernels. For every other kernel it prints
the resources and the instruction count of each side (the padding NOPs at the end not
counted) and the lines GNU diff finds removed and added once register, predicate and
barrier numbers and branch labels are masked: 0 and 0 where only the allocation or the
scheduling changed, equal counts for a reordering, more added than removed for new
work. A kernel that moved must be timed on every problem it serves, not only on the
one the change was for: edits elsewhere in the resident forward laid its code out
anew and changed its time by up to 13% (docs/perf-notes.md #138, #154).

Each .cu file is compiled on its own, as tests/test_build.py does, not in the
extension's single translation unit with torch's extra nvcc flags: compare two
folders with each other, not with a built extension. cuobjdump is taken from
$CUOBJDUMP, else PATH, else $CUDA_HOME/bin; nvcc from $CUDA_HOME/bin (default
/usr/local/cuda). Exits 0 when every compiled kernel is identical, 1 when some differ,
2 on a usage error or when nvcc, cuobjdump or diff cannot run or fails.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
# `cuobjdump -sass` lines: an instruction with its address and the first 64 bits of its
# encoding, then a line with the other 64 (which hold the scheduling controls).
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?;)\s*/\* (0x[0-9a-f]+) \*/")
_ENCODING = re.compile(r"^\s*/\* (0x[0-9a-f]+) \*/\s*$")
_FUNCTION = re.compile(r"^\s*Function : (\S+)")
# Register, uniform register, predicate and barrier numbers and branch labels: what
# register allocation and code placement renumber. Opcodes and immediates (LOP3
# tables, address offsets, constants) are kept.
_MASKS = [(re.compile(r"\bUR[0-9]+\b"), "UR"), (re.compile(r"\bR[0-9]+\b"), "R"), (re.compile(r"\bUP[0-6]\b"), "UP"),
          (re.compile(r"\bP[0-6]\b"), "P"), (re.compile(r"\bB[0-9]+\b"), "B"), (re.compile(r"\.L_x_[0-9]+"), "L")]


def sass_by_kernel(text):
    """{kernel name: [(instruction, encoding), ...]} of `cuobjdump -sass` output: the
    instruction text without its address, the encoding's 128 bits as two hex words;
    the NOPs that pad the end of a kernel dropped."""
    kernels, current = {}, None
    for line in text.splitlines():
        match = _FUNCTION.match(line)
        if match:
            current = kernels.setdefault(match.group(1), [])
            continue
        match = _INSTRUCTION.match(line)
        if match and current is not None:
            current.append((" ".join(match.group(1).split()), match.group(2)))
            continue
        match = _ENCODING.match(line)
        if match and current:
            instruction, encoding = current[-1]
            current[-1] = (instruction, encoding + " " + match.group(1))
    for instructions in kernels.values():
        while instructions and instructions[-1][0].replace(" ", "") == "NOP;":
            instructions.pop()
    return kernels


def masked(instruction):
    """An instruction's text with register, predicate and barrier numbers and labels
    replaced by placeholders: equal for two register allocations of the same code."""
    for pattern, placeholder in _MASKS:
        instruction = pattern.sub(placeholder, instruction)
    return instruction


def ptxas_resources(text):
    """{kernel name: {"registers", "spill_stores", "spill_loads", "stack", "usage"}} from
    `ptxas -v` output; usage is the rest of ptxas's "Used ..." line (barriers, shared
    and constant memory)."""
    resources, properties_of, entry, properties = {}, {}, None, None
    for line in text.splitlines():
        match = re.search(r"Compiling entry function '(\S+)'", line)
        if match:
            entry = match.group(1)
        match = re.search(r"Function properties for (\S+)", line)
        if match:
            properties = match.group(1)
        match = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if match and properties is not None:
            properties_of[properties] = dict(zip(("stack", "spill_stores", "spill_loads"), map(int, match.groups())))
        match = re.search(r"Used (\d+) registers(.*)", line)
        if match and entry is not None:
            resources[entry] = {"registers": int(match.group(1)), "usage": match.group(2).strip(", "),
                                **properties_of.get(entry, {"stack": 0, "spill_stores": 0, "spill_loads": 0})}
    return resources


def compare(a, b):
    """(kernel, instructions a, instructions b, masked lines removed, masked lines
    added) for each kernel whose machine code (instructions or encodings) differs
    between the {kernel: [(instruction, encoding)]} maps a and b, the masked lines as
    GNU diff matches them; a kernel on one side only counts all its lines. A change
    of scheduling controls or register numbers alone shows as 0 removed and 0 added."""
    changed = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in sorted(set(a) | set(b)):
            left, right = a.get(name, []), b.get(name, [])
            if left == right:
                continue
            paths = [os.path.join(scratch, side) for side in ("a", "b")]
            for path, lines in zip(paths, (left, right)):
                with open(path, "w", encoding="utf-8") as f:
                    f.write("".join(masked(text) + "\n" for text, _ in lines))
            diff = run(["diff", *paths]).stdout.splitlines()
            removed = sum(1 for line in diff if line.startswith("<"))
            added = sum(1 for line in diff if line.startswith(">"))
            changed.append((name, len(left), len(right), removed, added))
    return changed


def run(command, **kwargs):
    """subprocess.run with text output captured; a missing program exits with status 2."""
    try:
        return subprocess.run(command, capture_output=True, text=True, **kwargs)
    except OSError as error:
        fail(f"cannot run {command[0]}: {error}")


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
    """[(sass by kernel, ptxas resources)] of one .cu file in each of `directories`
    (({}, {}) where a folder lacks it), the nvcc runs side by side."""
    flags = ["-c", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v"]
    jobs = {}
    for side, directory in enumerate(directories):
        path, obj = os.path.join(directory, source), os.path.join(out_dir, f"{side}-{source}.o")
        if os.path.isfile(path):
            try:
                jobs[side] = (path, obj, subprocess.Popen([os.path.join(CUDA_HOME, "bin", "nvcc"), *flags, path, "-o", obj],
                                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            except OSError as error:
                fail(f"cannot run nvcc ($CUDA_HOME={CUDA_HOME}): {error}")
    logs = {side: job[2].communicate()[0] for side, job in jobs.items()}
    results = []
    for side in range(len(directories)):
        if side not in jobs:
            results.append(({}, {}))
            continue
        path, obj, process = jobs[side]
        if process.returncode != 0:
            fail(f"nvcc failed on {path}:\n{logs[side][-3000:]}")
        sass = run([cuobjdump(), "-sass", obj])
        if sass.returncode != 0:
            fail(f"cuobjdump failed on {obj}:\n{sass.stderr[-3000:]}")
        results.append((sass_by_kernel(sass.stdout), ptxas_resources(logs[side])))
    return results


def sources_to_compile(dir_a, dir_b):
    """The .cu files of either folder to compile: every one if a header differs, else
    those that differ (or exist on one side only)."""
    def text(directory, name):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return f.read()

    names = sorted(set(os.listdir(dir_a)) | set(os.listdir(dir_b)))
    differing = [name for name in names if text(dir_a, name) != text(dir_b, name)]
    cuda = [name for name in names if name.endswith(".cu")]
    if any(name.endswith((".h", ".cuh")) for name in differing):
        return cuda
    return [name for name in cuda if name in differing]


def demangle(names):
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return dict(zip(names, names))
    out = run([tool], input="\n".join(names)).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else dict(zip(names, names))


def without_empty_packs(name):
    """A mangled kernel name without empty template argument packs (`JE`) and without the
    expansion of an empty trailing function parameter pack (`DpT<n>_`): the name a
    kernel template had before it gained an optional trailing parameter pack."""
    return re.sub(r"EDpT\d*_$", "E", name).replace("JE", "")


def matched_names(kernels_a, kernels_b):
    """{name in B: the name of A to compare it with}: its own, or, for a kernel of B
    not in A, the one of A it has without empty packs (without_empty_packs)."""
    names = {}
    for name in kernels_b:
        plain = without_empty_packs(name)
        names[name] = plain if name not in kernels_a and plain in kernels_a and plain not in kernels_b else name
    return names


def describe(resources_a, resources_b, count_a, count_b, removed, added):
    """The report line of one kernel that changed."""
    def pair(key):
        return f"{resources_a.get(key, '-')} -> {resources_b.get(key, '-')}"

    line = (f"registers {pair('registers')}, spills (stores) {pair('spill_stores')}, (loads) {pair('spill_loads')}, "
            f"stack {pair('stack')}; instructions {count_a} -> {count_b}, masked lines {removed} removed and {added} added")
    if resources_a.get("usage") != resources_b.get("usage"):
        line += f"; ptxas: '{resources_a.get('usage', '-')}' -> '{resources_b.get('usage', '-')}'"
    return line


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
    for name in args.source or []:
        if not any(os.path.isfile(os.path.join(d, name)) for d in (args.dir_a, args.dir_b)) or not name.endswith(".cu"):
            parser.error(f"--source {name}: no such .cu file in either folder")
    try:
        pick = re.compile(args.pattern)
    except re.error as error:
        parser.error(f"-k {args.pattern!r}: {error}")
    sources = sources_to_compile(args.dir_a, args.dir_b)
    if args.source:
        sources = [name for name in sources if name in args.source]
    if not sources:
        print("sass_diff: no .cu file to compile differs (nor any header)")
        return 0
    any_changed = False
    with tempfile.TemporaryDirectory() as out_dir:
        for source in sources:
            (sass_a, res_a), (sass_b, res_b) = compile_both((args.dir_a, args.dir_b), source, args.arch, out_dir)
            sass_a = {k: v for k, v in sass_a.items() if pick.search(k)}
            sass_b = {k: v for k, v in sass_b.items() if pick.search(k)}
            names_b = matched_names(sass_a, sass_b)
            sass_b = {names_b[k]: v for k, v in sass_b.items()}
            res_b = {names_b.get(k, k): v for k, v in res_b.items()}
            changed = {name: rest for name, *rest in compare(sass_a, sass_b)}
            for name in set(sass_a) & set(sass_b):  # same code, other shared memory, barriers, ...
                if name not in changed and res_a.get(name) != res_b.get(name):
                    changed[name] = [len(sass_a[name]), len(sass_b[name]), 0, 0]
            total = len(set(sass_a) | set(sass_b))
            print(f"{source} (sm_{args.arch}): {total} kernels, {total - len(changed)} identical, {len(changed)} differ")
            names = demangle(sorted(changed))
            for name in sorted(changed):
                print(f"  {names[name]}\n    {describe(res_a.get(name, {}), res_b.get(name, {}), *changed[name])}")
            any_changed = any_changed or bool(changed)
    return 1 if any_changed else 0


if __name__ == "__main__":
    sys.exit(main())
