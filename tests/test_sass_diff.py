"""CPU tests of tools/sass_diff.py's parsing and comparison (GNU diff; no compiler run)."""
import importlib.util
import os

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("sass_diff", os.path.join(ROOT, "tools", "sass_diff.py"))
sass_diff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_diff)

# The shape of `cuobjdump -sass` output: a header per function, each instruction with
# its address and the first half of its encoding, the second half on the next line;
# NOPs pad a kernel's end.
CUOBJDUMP = """
	code for sm_90a
		Function : _Z3onev
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                     /* 0x00000a00ff017b82 */
                                                                              /* 0x000fe40000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                         /* 0x0000000000007919 */
                                                                              /* 0x000e220000002100 */
        /*0020*/                   EXIT ;                                     /* 0x000000000000794d */
                                                                              /* 0x000fea0003800000 */
        /*0030*/                   NOP ;                                      /* 0x0000000000007918 */
                                                                              /* 0x000fc00000000000 */
		Function : _Z3twov
        /*0000*/                   STG.E.128 desc[UR4][R2.64], R4 ;            /* 0x0000000402007986 */
                                                                              /* 0x000fe2000c101d04 */
        /*0010*/                   EXIT ;                                     /* 0x000000000000794d */
                                                                              /* 0x000fea0003800000 */
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


def code(*texts, encoding="0x0 0x0"):
    return [(text, encoding) for text in texts]


def test_instructions_and_encodings_per_kernel_without_the_padding():
    kernels = sass_diff.sass_by_kernel(CUOBJDUMP)
    assert kernels == {
        "_Z3onev": [("LDC R1, c[0x0][0x28] ;", "0x00000a00ff017b82 0x000fe40000000800"),
                    ("S2R R0, SR_TID.X ;", "0x0000000000007919 0x000e220000002100"),
                    ("EXIT ;", "0x000000000000794d 0x000fea0003800000")],
        "_Z3twov": [("STG.E.128 desc[UR4][R2.64], R4 ;", "0x0000000402007986 0x000fe2000c101d04"),
                    ("EXIT ;", "0x000000000000794d 0x000fea0003800000")]}


def test_masking_renumbers_registers_and_labels_only():
    assert sass_diff.masked("@!P1 LDG.E.128 R4, desc[UR6][R2.64+0x10] ;") == "@!P LDG.E.128 R, desc[UR][R.64+0x10] ;"
    assert sass_diff.masked("BSSY B0, `(.L_x_12) ;") == "BSSY B, `(L) ;"
    # Opcodes, widths, LOP3 tables and offsets stay.
    assert sass_diff.masked("STG.E.128 desc[UR4][R6.64], R8 ;") != sass_diff.masked("STG.E.64 desc[UR4][R6.64], R8 ;")
    assert sass_diff.masked("LOP3.LUT R0, R1, R2, R3, 0x78, !PT ;") != sass_diff.masked("LOP3.LUT R0, R1, R2, R3, 0xe0, !PT ;")


def test_register_renaming_and_scheduling_alone_are_changes_with_no_masked_lines():
    a = {"k": code("FFMA R3, R2, 1.5, -R3 ;", "EXIT ;"), "same": code("EXIT ;")}
    renamed = {"k": code("FFMA R7, R6, 1.5, -R7 ;", "EXIT ;"), "same": code("EXIT ;")}
    rescheduled = {"k": code("FFMA R3, R2, 1.5, -R3 ;", "EXIT ;", encoding="0x0 0x1"), "same": code("EXIT ;")}
    assert sass_diff.compare(a, renamed) == [("k", 2, 2, 0, 0)]
    assert sass_diff.compare(a, rescheduled) == [("k", 2, 2, 0, 0)]
    assert sass_diff.compare(a, a) == []


def test_changed_operations_added_instructions_and_one_sided_kernels_are_counted():
    a = {"k": code("S2R R0, SR_TID.X ;", "LOP3.LUT R1, R0, R2, R3, 0x78, !PT ;", "EXIT ;")}
    b = {"k": code("S2R R0, SR_TID.X ;", "LOP3.LUT R1, R0, R2, R3, 0xe0, !PT ;", "LDS R1, [R0] ;", "EXIT ;"),
         "new": code("EXIT ;")}
    assert sass_diff.compare(a, b) == [("k", 3, 4, 1, 2), ("new", 0, 1, 0, 1)]


def test_ptxas_resources_take_the_entry_functions_own_properties():
    assert sass_diff.ptxas_resources(PTXAS) == {
        "_Z3onev": {"registers": 128, "usage": "used 1 barriers, 256 bytes smem", "stack": 8, "spill_stores": 4,
                    "spill_loads": 8},
        "_Z3twov": {"registers": 40, "usage": "", "stack": 0, "spill_stores": 0, "spill_loads": 0}}


def test_sources_to_compile(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for directory in (a, b):
        directory.mkdir()
        for name in ("one.cu", "two.cu", "common.cuh"):
            (directory / name).write_text(f"// {name}\n")
    assert sass_diff.sources_to_compile(str(a), str(b)) == []
    (b / "two.cu").write_text("// changed\n")
    (b / "three.cu").write_text("// new\n")
    assert sass_diff.sources_to_compile(str(a), str(b)) == ["three.cu", "two.cu"]
    (b / "common.cuh").write_text("// changed\n")
    assert sass_diff.sources_to_compile(str(a), str(b)) == ["one.cu", "three.cu", "two.cu"]


def test_a_kernel_renamed_by_an_empty_parameter_pack_is_compared_under_its_old_name():
    old = "_ZN13instance_norm14forward_detail20forward_block_kernelIfLi128EEEvNS_14ForwardProblemE"
    plain = "_ZN13instance_norm14forward_detail20forward_block_kernelIfLi128EJEEEvNS_14ForwardProblemEDpT1_"
    padded = ("_ZN13instance_norm14forward_detail20forward_block_kernelIfLi128EJNS_13ReflectionPadEEEEvNS_"
              "14ForwardProblemEDpT1_")
    assert sass_diff.without_empty_packs(plain) == old
    assert sass_diff.matched_names({old: []}, {plain: [], padded: []}) == {plain: old, padded: padded}
    assert sass_diff.matched_names({old: []}, {old: [], plain: []}) == {old: old, plain: plain}
