"""Regression corpus of tests/test_fuzz.py: explicit cases replayed before any random one.

Each entry is a dict read by ``test_fuzz.FuzzCase.from_dict``:

- ``name``: a short identifier (the pytest id);
- any field of ``nvfp4_mla.testing.Case`` (``entry``, ``num_tokens``, ``num_heads``, ``q_head_padded``,
  ``q_inplace``, ``apply_q_rope``, ``compress_ratio``, ``page_size``, ``layout``, ``pad``, ``pages``,
  ``slots``, ``bad_slots``, ``bad_positions``, ``table``, ``max_position``); ``slot_dtype`` is
  written "int32" or "int64"; fields left out keep Case's defaults;
- ``seed``: seeds torch's CPU generator, which draws every input not given explicitly;
- ``values``: the value kinds of the q and kv rows (test_fuzz.VALUE_KINDS; default "normal") and
  ``specials``: the fraction of elements replaced by +-0, +-inf or NaN (default 0);
- ``edits``: explicit values written after the random draw, as ``(input name, index, values)``:
  ``index`` gives the leading indices and, last, the first position in the innermost dimension
  that ``values`` fill. ``("kv", (1, 32), [...16 values])`` sets row 1's NoPE group 2;
  ``("positions", (0,), [7, 8])`` sets positions[0:2]. Edits must keep valid slots unique.

Every entry runs twice: through the reference's invariants (CPU, test_reference_corpus) and
through the kernel against the reference, byte for byte (GPU, test_kernel_corpus).

Adding a failure found by the fuzzer
------------------------------------
A failing hypothesis test prints its falsifying example, and a note line
``corpus entry: {...}``. Paste that dict into CORPUS below, give it a ``name`` that says what
broke, and commit it with the fix. Seeded entries reproduce only while the input generators of
test_fuzz.py and nvfp4_mla.testing stay unchanged: once the failure is understood, prefer turning
the values that matter into ``edits`` (and shrinking ``num_tokens``) so the entry survives later
changes. To replay the exact hypothesis run instead, use the ``@reproduce_failure`` line hypothesis
prints (print_blob is on) temporarily on the failing test.
"""

import math

NAN, INF = math.nan, math.inf
SUB = 2.0**-133  # the smallest BF16 subnormal

CORPUS = [
    # NaN at element 7 of a group: the last of half 0's odd lane, so it survives that lane's max
    # chain and half 0's scale becomes NaN (0x7F) while half 1 keeps a finite scale.
    dict(
        name="nan_at_group_element_7",
        entry="main",
        num_tokens=3,
        num_heads=5,
        q_head_padded=8,
        page_size=16,
        bad_slots=False,
        seed=1,
        edits=[
            ("kv", (1, 32), [0.5, -1.0, 2.0, 3.0, -0.25, 1.5, 4.0, NAN, 1.0, -6.0, 0.75, 2.5, -3.5, 5.0, 0.0, -0.0])
        ],
    ),
    # Group maxima whose amax/6 falls exactly halfway between two E4M3 values: 6.375/6 = 1.0625
    # (1.0 | 1.125, to even 1.0), 7.125/6 = 1.1875 (1.125 | 1.25, to even 1.25), and the subnormal
    # tie 6 * 1.5 * 2^-9 (2^-9 | 2^-8, to even 2^-8); group 0 also holds E2M1 ties at scale 1.
    dict(
        name="e4m3_scale_ties",
        entry="append",
        num_tokens=2,
        page_size=3,
        layout="NHD",
        bad_slots=False,
        seed=2,
        edits=[
            (
                "kv",
                (0, 0),
                [6.375, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0],
            ),
            (
                "kv",
                (0, 16),
                [7.125, -7.125, 1.0, -2.0, 3.0, 0.5, 0.0, -0.0, 6.0, 4.5, 1.5, 2.25, 0.125, -0.375, 5.5, -1.0],
            ),
            ("kv", (0, 32), [6 * 1.5 * 2.0**-9] + [k * 2.0**-10 for k in range(-7, 8)]),
        ],
    ),
    # A group of BF16 subnormals only (both signs): all flushed, so scale 0 and codes 0/8; RoPE dims
    # of subnormals are kept (no flush) through the rotation.
    dict(
        name="subnormal_only_group",
        entry="kv",
        num_tokens=2,
        page_size=16,
        bad_slots=False,
        seed=3,
        edits=[
            (
                "kv",
                (0, 80),
                [k * SUB * (-1) ** k for k in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 127, 64, 32, 16, 4, 127)],
            ),
            ("kv", (0, 448), [SUB, -SUB, 127 * SUB, -127 * SUB, 0.0, -0.0, 3 * SUB, 64 * SUB]),
        ],
    ),
    # compress_ratio 2 with an odd table of 7 rows: position 7 is inserted with RoPE row 6; 8 fails
    # the ratio test; 9 needs row 8 (outside); -1 and -(2^63 - 1) are negative; 2^40 + 1 is huge.
    dict(
        name="ratio2_positions_outside_table",
        entry="kv",
        compress_ratio=2,
        max_position=7,
        num_tokens=8,
        page_size=16,
        bad_slots=False,
        seed=4,
        edits=[("positions", (0,), [7, 8, 9, -1, 5, 2**40 + 1, -(2**63) + 1, 3])],
    ),
    # Page size 1 in a padded NHD pool of 6 pages: the last slot (5), slot 0, the first slot past
    # the pool (6) and -1.
    dict(
        name="page_size_1_last_slot",
        entry="main",
        num_tokens=4,
        num_heads=8,
        q_head_padded=8,
        page_size=1,
        pages=6,
        layout="NHD",
        pad=16,
        slot_dtype="int32",
        seed=5,
        edits=[("slot_mapping", (0,), [5, 0, 6, -1])],
    ),
    # In place with DP padding and positions outside the table, wild values everywhere.
    dict(
        name="inplace_dp_padding_wild",
        entry="main",
        num_tokens=12,
        slots=9,
        num_heads=16,
        q_head_padded=16,
        q_inplace=True,
        page_size=7,
        pad=48,
        bad_positions=True,
        table="wild",
        seed=6,
        values=["huge", "tiny", "crafted"],
        specials=0.05,
    ),
]
