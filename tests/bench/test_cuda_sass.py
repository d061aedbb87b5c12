"""bench/cuda_sass.py: a cuobjdump listing's loops are its backward branches, measured in
instructions; the family's source it renders is the bare b1 / 32768 form, whose q goes straight
into registers (no block barrier before the key loop: session 27 measured ~2 µs a launch for
staging it through shared memory)."""

from __future__ import annotations

from cuda_sass import family_source, loops

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   ISETP.NE.AND P0, PT, R2, R3, PT ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/                   BRA 0x60 ;
        /*0050*/                   NOP ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70 ;
"""


def test_loops_are_backward_branches_counted_in_instructions():
    count, lengths = loops(LISTING)
    assert count == 8
    assert lengths == [2]  # 0x30 back to 0x10; the forward branch and the self-branch are no loops


def test_the_bare_family_source_reaches_its_loop_without_a_block_barrier():
    for chunk in (16, 32):
        source = family_source(chunk)
        assert f"#define CHUNK {chunk}" in source and "k_new" not in source and "q_cos" not in source
        before_loop = source[:source.index("for (int i = 0; i < mine; ++i)")]
        assert "__syncthreads" not in before_loop and "q_shared" not in source
