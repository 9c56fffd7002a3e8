"""Where a kernel's warps wait on a global load before issuing its next one, without a GPU.

    python tools/sass_waits.py [DIR] [--arch 90a] [--source FILE.cu ...] [-k REGEX]

DIR: a kernel source folder (default kernels). Each of its .cu files (or the --source
ones, names of files in DIR) is compiled and disassembled as tools/sass_diff.py does,
so it needs nvcc ($CUDA_HOME/bin) and cuobjdump ($CUOBJDUMP, PATH or $CUDA_HOME/bin);
-k matches mangled names. Each instruction's encoding carries its scheduling controls
in bits 105-125 of its 128 bits (sm_70 and later): stall count, yield, the write and
read scoreboard barriers it sets, and the mask of barriers it waits on (Jia et al.,
"Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018, on control
information). A global load (LDG) sets a write barrier that stays pending until its
data arrives; an instruction that waits on that barrier stalls the warp until then.
Where such a wait comes before a later load of the kernel's load phase (its
instructions before the first shuffle, warp sync or block barrier; later by address,
so a loop's next iteration does not count), that load starts a memory latency late. A
16-bit conversion placed right after its load was such a wait (docs/perf-notes.md
#186).

For each kernel whose mangled name matches -k it prints the loads of its load phase
and each such wait: the waiting instruction's address and text, and the loads it
waits for. A CALL's wait is listed too (a subroutine waits on every pending load) but
costs only where the call runs. Exits 0, or 2 on a usage error or when nvcc or
cuobjdump cannot run or fails.
"""
import argparse
import importlib.util
import os
import re
import sys
import tempfile

_spec = importlib.util.spec_from_file_location("sass_diff", os.path.join(os.path.dirname(__file__), "sass_diff.py"))
sass_diff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_diff)

_NO_BARRIER = 7  # a write or read barrier field of 7 sets none
_PHASE_END = ("SHFL", "WARPSYNC", "BAR", "SYNCS")


def controls(encoding):
    """(write barrier or None, wait mask) of an instruction's encoding, two hex words
    (the second holds bits 64-127): the 3-bit write barrier at bit 110, the 6-bit
    wait mask at bit 116."""
    high = int(encoding.split()[1], 16)
    write_barrier = (high >> 46) & 7
    return (None if write_barrier == _NO_BARRIER else write_barrier), (high >> 52) & 0x3F


def opcode(instruction):
    """The opcode of an instruction's text, past its predicate."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def load_phase_waits(instructions):
    """(loads, waits) of one kernel's [(instruction, encoding)] (sass_diff.sass_by_kernel):
    the number of LDGs before the first shuffle, warp sync or block barrier, and
    [(index, instruction, [indices of the loads it waits for])] for each instruction
    of that phase that waits on a pending load while a later load follows it."""
    end = next((i for i, (text, _) in enumerate(instructions) if opcode(text).startswith(_PHASE_END)),
               len(instructions))
    phase = instructions[:end]
    load_indices = [i for i, (text, _) in enumerate(phase) if opcode(text).startswith("LDG")]
    pending, waits = {}, []  # pending: barrier -> indices of the loads that set it
    for i, (text, encoding) in enumerate(phase):
        write_barrier, wait_mask = controls(encoding)
        waited = [barrier for barrier in pending if wait_mask >> barrier & 1]
        if waited and any(j > i for j in load_indices):
            waits.append((i, text, sorted(j for barrier in waited for j in pending[barrier])))
        for barrier in waited:
            del pending[barrier]
        if opcode(text).startswith("LDG") and write_barrier is not None:
            pending.setdefault(write_barrier, []).append(i)
    return len(load_indices), waits


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", default="kernels")
    parser.add_argument("--arch", default="90a", help="compute capability digits, e.g. 90a (default) or 80")
    parser.add_argument("--source", action="append", default=None, help="compile only this .cu file (repeatable)")
    parser.add_argument("-k", dest="pattern", default="", help="only kernels whose mangled name matches this regex")
    args = parser.parse_args()
    if not os.path.isdir(args.directory):
        parser.error(f"{args.directory} is not a directory")
    sources = args.source or sorted(name for name in os.listdir(args.directory) if name.endswith(".cu"))
    for name in sources:
        if not name.endswith(".cu") or not os.path.isfile(os.path.join(args.directory, name)):
            parser.error(f"--source {name}: not the name of a .cu file in {args.directory} (a name, no folder)")
    try:
        pick = re.compile(args.pattern)
    except re.error as error:
        parser.error(f"-k {args.pattern!r}: {error}")
    sass_diff.cuobjdump()  # exits now, not after the compile, where it is missing
    with tempfile.TemporaryDirectory() as out_dir:
        for source in sources:
            print(f"sass_waits: compiling {source} (a minute or more)", file=sys.stderr, flush=True)
            ((sass, _),) = sass_diff.compile_both((args.directory,), source, args.arch, out_dir)
            kernels = {name: code for name, code in sass.items() if pick.search(name)}
            names = sass_diff.demangle(sorted(kernels))
            print(f"{source} (sm_{args.arch}): {len(kernels)} kernels")
            for name in sorted(kernels, key=names.get):
                code = kernels[name]
                loads, waits = load_phase_waits(code)
                print(f"  {names[name]}: {loads} loads in the load phase, {len(waits)} "
                      f"wait{'' if len(waits) == 1 else 's'} before a later load")
                for index, text, waited in waits:
                    print(f"    {index * 16:04x} {text} waits for the loads at "
                          + ", ".join(f"{j * 16:04x}" for j in waited))
    return 0


if __name__ == "__main__":
    sys.exit(main())
