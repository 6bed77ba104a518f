"""The kernels' parameter blocks and sources, declared once: a field list (nvfp4_mla.params) gives
both the host's packer and the C declaration the kernel compiles against, whose offsets NVRTC
checks against the packer's; the layout and every header a kernel includes are in its key."""

from typing import NamedTuple

import pytest

from nvfp4_mla import jit, launch, params
from nvfp4_mla.ops import decode, decode_launch, registry
from nvfp4_mla.ops.decode_backend import ATTEND_PARAMS, POOL
from nvfp4_mla.ops.reader import READ_PARAMS, ReaderSpec

SPECS = [spec for arch in jit.ARCHS for spec in registry.catalogue(arch)]
LAYOUTS = list({id(s.template.params): s.template.params for s in SPECS}.values())
READER = ReaderSpec(64, True, False, True)
COSTS = (3, 5)  # a plan's segment and combine costs: distinct, so that fields swapped in packing show


class _Reordered(NamedTuple):
    """The reader's spec on a template whose Params lists two fields the other way round."""

    page_size: int

    @property
    def template(self) -> jit.Template:
        fields = list(READ_PARAMS.fields)
        fields[4], fields[5] = fields[5], fields[4]  # capacity and num_rows
        return READER.template._replace(params=params.ParamsLayout("Params", fields))

    def defines(self) -> dict[str, int]:
        return READER.defines()

    def describe(self) -> str:
        return "reader, two Params fields swapped"


def test_every_kernel_family_has_one_layout():
    """The writer, the reader, the attention kernels (the Hopper one's adds a tensor map), the
    combine and the decode scheduler: six layouts over the catalogue, each fitting the launch
    buffer."""
    assert len(LAYOUTS) == 6 and all(layout.size <= launch.PARAMS_CAPACITY for layout in LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(layout.names[:2]))
def test_the_packer_lays_fields_out_as_c_does(layout):
    """Each member at the next multiple of its alignment, the size a multiple of the largest one;
    the header declares every member and checks each offset and the size."""
    offset = 0
    for f, at in zip(layout.fields, layout.member_offsets):
        assert at == offset + -offset % f.align
        offset = at + f.size
    assert layout.size == offset + -offset % layout.align == layout.struct.size
    header = layout.header()
    assert f"static_assert(sizeof(Params) == {layout.size}," in header
    for name, at in layout.offsets.items():
        assert f"static_assert(offsetof(Params, {name}) == {at}," in header


def test_the_attention_layout():
    assert POOL.size == 72 and ATTEND_PARAMS.size == 288
    assert ATTEND_PARAMS.offsets["swa.k"] == 48 + 48 and ATTEND_PARAMS.offsets["extra.cache"] == 48 + 72
    hopper = decode.BACKENDS["wgmma_sm90"].specs("sm_90")[0].template.params
    assert hopper.offsets["q_map"] == 320 and hopper.size == 448 and hopper.names[-1] == "q_map"
    assert "struct Pool {" in hopper.header() and hopper.header().count("struct Pool {") == 1
    assert "    alignas(64) u8 q_map[128];" in hopper.header()


def test_reordering_a_field_changes_the_key():
    assert jit.kernel_key(_Reordered(64), "sm_80") != jit.kernel_key(READER, "sm_80")


def test_nvrtc_checks_every_offset_against_the_packer():
    """The shipped header compiles, so does a reordered layout's (the kernel names its fields),
    and a header whose check disagrees with the C layout by one field's offset does not."""
    pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install 'nvfp4-mla[cu12]')")
    jit.compile_kernel(READER, "sm_80")
    jit.compile_kernel(_Reordered(64), "sm_80")
    header = READ_PARAMS.header()
    at = READ_PARAMS.offsets["num_rows"]
    wrong = header.replace(f"offsetof(Params, num_rows) == {at}", f"offsetof(Params, num_rows) == {at + 8}")
    assert wrong != header
    with pytest.raises(RuntimeError, match=r"Params\.num_rows: the host packs it"):
        jit.compile_kernel(READER, "sm_80", sources={params.HEADER: wrong})


def test_a_template_lists_every_header_its_source_includes():
    """So the key covers every file a kernel is built from; and every file in kernels/ is built."""
    used = set()
    for spec in SPECS:
        template = spec.template
        assert template.headers == jit.included_headers(template.file), spec.describe()
        used |= {template.file, *template.headers}
    assert used == {path.name for path in jit.kernel_dir().iterdir() if path.suffix in (".cu", ".cuh")}


@pytest.mark.parametrize("hopper", [True, False])
@pytest.mark.parametrize(("lengths", "own_list"), [(True, False), (True, True), (False, False)])
def test_a_decode_launch_packs_each_value_into_its_named_field(monkeypatch, lengths, own_list, hopper):
    """decode.launch passes three Params by position: with lengths the list is dealt at the start
    of the call's workspace, by the attention's blocks (own_list) or the scheduler launched before
    them; without lengths the plan holds it. The attention Params end with the list and how it is
    dealt (and on the Hopper backends q's tensor map), the combine's with the list's split rows;
    the partial slots follow the list, 16-byte aligned; the list counts the backend's tiles (64
    tokens on Hopper, 32 on mma.sync)."""
    import torch

    from nvfp4_mla.ops import decode_combine, decode_scheduler, decode_sm90

    packed: dict[str, tuple] = {}

    class Recorder:
        shared_bytes = 0

        def __init__(self, name: str):
            self.name = name

        def launch(self, gx, gy, gz, shared_bytes, stream, *values):
            assert self.name not in packed, "one launch each"
            packed[self.name] = ((gx, gy, gz), values)

    allocated: list[torch.Tensor] = []

    def new_output(like, shape, strides, dtype, device):
        allocated.append(torch.empty(shape, dtype=dtype))
        return allocated[-1]

    monkeypatch.setattr(decode_launch, "current_raw_stream", lambda device: 0)
    monkeypatch.setattr(decode_launch, "new_output", new_output)
    parts, heads, split_rows = 3, 5, 2  # 2 query rows (q below), both cut
    slots = parts - 1 + split_rows
    list_values = 32 if lengths else 0  # work_ints(3) = 30 int32, rounded up to 16 bytes
    work = None if lengths else torch.zeros(decode_scheduler.work_ints(parts), dtype=torch.int32)
    tile_tokens = 64 if hopper else 32
    plan = decode.DecodePlan(
        "test",
        Recorder("attend"),  # type: ignore[arg-type]
        64,
        parts * 4,
        1 if lengths else 3,  # without lengths, the list may deal the width split's splits
        2,
        Recorder("combine"),  # type: ignore[arg-type]
        (lambda address: address.to_bytes(8, "little") * 16) if hopper else None,
        parts=parts,
        scheduler=Recorder("scheduler") if lengths else None,  # type: ignore[arg-type]
        combine_blocks=decode_combine.PACKED.blocks(split_rows, heads),
        workspace=list_values + slots * heads * 514,
        slots=slots,
        work=work,
        own_list=own_list,
        schedule=decode_scheduler.schedule_fields(parts, tile_tokens, *COSTS, False),
    )
    q = torch.zeros(2, 1, heads, 512, dtype=torch.bfloat16)
    swa_cache, slot_table = torch.zeros(4, 64, 384, dtype=torch.uint8), torch.zeros(2, 1, 9, dtype=torch.int64)
    lens = torch.zeros(2, 1, dtype=torch.int32) if lengths else None
    swa = (swa_cache, slot_table, lens, (4, 64, 64 * 384))
    out, lse = torch.empty_like(q), torch.empty(2, 1, heads)
    decode.launch(plan, q, out, lse, 0.5, None, swa, (None, None, None, None))
    (workspace,) = allocated
    assert workspace.dtype == torch.float32 and workspace.shape == (plan.workspace,)
    start = workspace.data_ptr()
    at = start if work is None else work.data_ptr()  # the list
    by_scheduler = lengths and not own_list
    assert list(packed) == (["scheduler", "attend", "combine"] if by_scheduler else ["attend", "combine"])  # in order

    attend_grid, values = packed["attend"]
    names = decode_sm90.PARAMS.names if hopper else ATTEND_PARAMS.names
    got = dict(zip(names, values))
    assert len(values) == len(names) and attend_grid == (parts * 4, 1, 1)
    assert got["work"] == at and got["static_list"] == int(not lengths) and got["own_list"] == int(own_list)
    shift = tile_tokens.bit_length() - 1
    schedule = [got[f"schedule.{name}"] for name in decode_scheduler.SCHEDULE.names]
    assert schedule == [parts, shift, *COSTS, 0]
    assert not hopper or got["q_map"] == q.data_ptr().to_bytes(8, "little") * 16
    assert got["partial_o"] == start + 4 * list_values and got["partial_o"] % 16 == start % 16
    assert got["partial_ml"] == got["partial_o"] + slots * heads * 512 * 4
    assert got["partial_ml"] + slots * heads * 2 * 4 == start + 4 * plan.workspace  # the workspace's end
    assert (got["rows"], got["num_heads"], got["num_splits"]) == (2, heads, plan.num_splits)
    assert (got["swa.lens"], got["swa.k"], got["extra.k"]) == (0 if lens is None else lens.data_ptr(), 9, 0)

    combine_grid, values = packed["combine"]
    combined = dict(zip(decode_combine.COMBINE_PARAMS.names, values))
    assert len(values) == len(decode_combine.COMBINE_PARAMS.names)
    assert combine_grid == (decode_combine.PACKED.blocks(split_rows, heads), 1, 1)
    assert (combined["partial_o"], combined["partial_ml"]) == (got["partial_o"], got["partial_ml"])
    assert (combined["out"], combined["lse"], combined["num_heads"], combined["static_list"]) == (
        out.data_ptr(),
        lse.data_ptr(),
        heads,
        int(not lengths),
    )
    assert combined["split_rows"] == at + parts * decode_scheduler.PART_INTS * 4  # after the parts' records

    if by_scheduler:
        scheduler_grid, values = packed["scheduler"]
        scheduled = dict(zip(decode_scheduler.SCHEDULER_PARAMS.names, values))
        assert len(values) == len(decode_scheduler.SCHEDULER_PARAMS.names) and scheduler_grid == (1, 1, 1)
        assert (scheduled["swa_lens"], scheduled["extra_lens"], scheduled["swa_k"], scheduled["extra_k"]) == (
            lens.data_ptr(),  # type: ignore[union-attr]
            0,
            9,
            0,
        )
        assert (scheduled["rows"], scheduled["schedule.parts"], scheduled["schedule.tile_shift"]) == (2, parts, shift)
        costs = tuple(scheduled[f"schedule.{name}"] for name in ("segment_cost", "combine_cost", "whole_rows"))
        assert costs == (*COSTS, 0)
        assert scheduled["parts_out"] == at and scheduled["split_rows"] == combined["split_rows"]
