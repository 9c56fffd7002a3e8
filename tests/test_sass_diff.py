"""CPU tests of tools/sass_diff.py's parsing and comparison (no compiler run; GNU diff)."""
import importlib.util
import os

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("sass_diff", os.path.join(ROOT, "tools", "sass_diff.py"))
sass_diff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_diff)

# The shape of `cuobjdump -sass` output: a header per function, one instruction per
# line with its address and encoding in comments.
CUOBJDUMP = """
	code for sm_90a
		Function : _Z3onev
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                     /* 0x00000a00ff017b82 */
                                                                              /* 0x000fe40000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                         /* 0x0000000000007919 */
        /*0020*/                   EXIT ;                                     /* 0x000000000000794d */
		Function : _Z3twov
        /*0000*/                   STG.E.128 desc[UR4][R2.64], R4 ;            /* 0x0000000402007986 */
        /*0010*/                   EXIT ;                                     /* 0x000000000000794d */
"""

PTXAS = """ptxas info    : Compiling entry function '_Z3onev' for 'sm_90a'
ptxas info    : Function properties for __internal_0
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Function properties for _Z3onev
    8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 256 bytes smem
ptxas info    : Compiling entry function '_Z3twov' for 'sm_90a'
ptxas info    : Function properties for _Z3twov
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers
"""


def test_instructions_per_kernel_without_addresses_or_encodings():
    kernels = sass_diff.sass_by_kernel(CUOBJDUMP)
    assert kernels == {"_Z3onev": ["LDC R1, c[0x0][0x28] ;", "S2R R0, SR_TID.X ;", "EXIT ;"],
                       "_Z3twov": ["STG.E.128 desc[UR4][R2.64], R4 ;", "EXIT ;"]}


def test_masking_keeps_opcodes_and_widths():
    assert sass_diff.masked("@!P1 LDG.E.128 R4, desc[UR6][R2.64+0x10] ;") == "@!P LDG.E.128 R, desc[UR][R.64+N] ;"
    assert sass_diff.masked("STG.E.128 desc[UR4][R6.64], R8 ;") != sass_diff.masked("STG.E.64 desc[UR4][R6.64], R8 ;")
    assert sass_diff.masked("BSSY B0, `(.L_x_12) ;") == "BSSY B, `(L) ;"


def test_register_renaming_is_a_change_with_no_masked_lines():
    a = {"k": ["FFMA R3, R2, 1.5, -R3 ;", "EXIT ;"], "same": ["EXIT ;"]}
    b = {"k": ["FFMA R7, R6, 1.5, -R7 ;", "EXIT ;"], "same": ["EXIT ;"]}
    assert sass_diff.compare(a, b) == [("k", 2, 2, 0, 0)]


def test_an_added_instruction_and_a_kernel_on_one_side_are_counted():
    a = {"k": ["S2R R0, SR_TID.X ;", "EXIT ;"]}
    b = {"k": ["S2R R0, SR_TID.X ;", "LDS R1, [R0] ;", "EXIT ;"], "new": ["EXIT ;"]}
    assert sass_diff.compare(a, b) == [("k", 2, 3, 0, 1), ("new", 0, 1, 0, 1)]


def test_ptxas_resources_take_the_entry_functions_own_spills():
    assert sass_diff.ptxas_resources(PTXAS) == {"_Z3onev": (128, 4, 8), "_Z3twov": (40, 0, 0)}


def test_sources_to_compile(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for directory in (a, b):
        directory.mkdir()
        for name in ("one.cu", "two.cu", "common.cuh"):
            (directory / name).write_text(f"// {name}\n")
    assert sass_diff.sources_to_compile(str(a), str(b)) == []
    (b / "two.cu").write_text("// changed\n")
    assert sass_diff.sources_to_compile(str(a), str(b)) == ["two.cu"]
    (b / "common.cuh").write_text("// changed\n")
    assert sass_diff.sources_to_compile(str(a), str(b)) == ["one.cu", "two.cu"]
