"""CPU tests of tools/sass_waits.py's reading of scheduling controls (no compiler run)."""
import importlib.util
import os

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("sass_waits", os.path.join(ROOT, "tools", "sass_waits.py"))
sass_waits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_waits)

# Instructions and encodings as `cuobjdump -sass` printed them (sm_90a) for a 16-bit
# warp kernel: the slice's 16-byte load sets write barrier 5, the conversion of its
# first value waits on 5, the weight's 16-bit load sets 2 and its conversion waits on 2.
SLICE_LOAD = ("@P3 LDG.E.128.CONSTANT R4, desc[UR10][R8.64] ;", "0x0000000a08043981 0x000162000c1e9d00")
FIRST_VALUE = ("SHF.L.U32 R15, R4, 0x10, RZ ;", "0x00000010040f7819 0x020fe200000006ff")
WEIGHT_LOAD = ("@P2 LDG.E.U16.CONSTANT R16, desc[UR10][R2.64] ;", "0x0000000a02102981 0x000ea4000c1e9500")
WEIGHT_VALUE = ("@P2 IMAD.U32 R16, R16, 0x10000, RZ ;", "0x0001000010102824 0x004fcc00078e00ff")
FLOAT_WEIGHT_LOAD = ("@!P2 LDG.E.CONSTANT R16, desc[UR10][R2.64] ;", "0x0000000a0210a981 0x000164000c1e9900")
SHUFFLE = ("SHFL.IDX PT, R0, R15, RZ, 0x1f ;", "0x00001fff0f007589 0x000e2200000e0000")


def test_controls_read_the_write_barrier_and_the_wait_mask():
    assert sass_waits.controls(SLICE_LOAD[1]) == (5, 0)
    assert sass_waits.controls(FIRST_VALUE[1]) == (None, 1 << 5)
    assert sass_waits.controls(WEIGHT_LOAD[1]) == (2, 0)
    assert sass_waits.controls(WEIGHT_VALUE[1]) == (None, 1 << 2)


def test_waits_before_a_later_load_are_listed_with_the_loads_they_wait_for():
    kernel = [SLICE_LOAD, FIRST_VALUE, WEIGHT_LOAD, WEIGHT_VALUE, FLOAT_WEIGHT_LOAD, SHUFFLE]
    loads, waits = sass_waits.load_phase_waits(kernel)
    assert loads == 3
    assert waits == [(1, FIRST_VALUE[0], [0]), (3, WEIGHT_VALUE[0], [2])]


def test_waits_after_the_last_load_or_the_phase_do_not_count():
    # Every load issued before the first wait: nothing to report.
    loads, waits = sass_waits.load_phase_waits([SLICE_LOAD, WEIGHT_LOAD, FIRST_VALUE, WEIGHT_VALUE, SHUFFLE])
    assert (loads, waits) == (2, [])
    # A load after the shuffle lies outside the load phase.
    loads, waits = sass_waits.load_phase_waits([SLICE_LOAD, FIRST_VALUE, SHUFFLE, WEIGHT_LOAD])
    assert (loads, waits) == (1, [])


def test_opcode_skips_the_predicate():
    assert sass_waits.opcode(WEIGHT_LOAD[0]) == "LDG.E.U16.CONSTANT"
    assert sass_waits.opcode(SHUFFLE[0]) == "SHFL.IDX"
