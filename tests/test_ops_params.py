"""The kernels' parameter blocks and sources, declared once: a field list (nvfp4_mla.params) gives
both the host's packer and the C declaration the kernel compiles against, whose offsets NVRTC
checks against the packer's; the layout and every header a kernel includes are in its key."""

from typing import NamedTuple

import pytest

from nvfp4_mla import jit, launch, params
from nvfp4_mla.ops import decode, registry
from nvfp4_mla.ops.decode_backend import ATTEND_PARAMS, POOL
from nvfp4_mla.ops.reader import READ_PARAMS, ReaderSpec

SPECS = [spec for arch in jit.ARCHS for spec in registry.catalogue(arch)]
LAYOUTS = list({id(s.template.params): s.template.params for s in SPECS}.values())
READER = ReaderSpec(64, True, False, True)


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
    for f, at in zip(layout.fields, layout._offsets):
        assert at == offset + -offset % f.align
        offset = at + f.size
    assert layout.size == offset + -offset % layout.align == layout.struct.size
    header = layout.header()
    assert f"static_assert(sizeof(Params) == {layout.size}," in header
    for name, at in layout.offsets.items():
        assert f"static_assert(offsetof(Params, {name}) == {at}," in header


def test_the_attention_layout():
    assert POOL.size == 72 and ATTEND_PARAMS.size == 232
    assert ATTEND_PARAMS.offsets["swa.k"] == 48 + 48 and ATTEND_PARAMS.offsets["extra.cache"] == 48 + 72
    hopper = decode.BACKENDS["wgmma_sm90"].specs("sm_90")[0].template.params
    assert hopper.offsets["q_map"] == 256 and hopper.size == 384 and hopper.names[-1] == "q_map"
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


def test_a_decode_launch_packs_each_value_into_its_named_field(monkeypatch):
    """decode.launch passes the attention Params by position: each value lands in its field."""
    import torch

    packed: list[tuple] = []

    class Recorder:
        shared_bytes = 0

        def launch(self, gx, gy, gz, shared_bytes, stream, *values):
            packed.append(values)

    monkeypatch.setattr(decode, "current_raw_stream", lambda device: 0)
    plan = decode.DecodePlan("test", Recorder(), 64, 3, 1, 7, 1, None, None)  # type: ignore[arg-type]
    q = torch.zeros(2, 1, 5, 512, dtype=torch.bfloat16)
    swa_cache, slots = torch.zeros(4, 64, 384, dtype=torch.uint8), torch.zeros(2, 1, 9, dtype=torch.int64)
    lens = torch.zeros(2, 1, dtype=torch.int32)
    swa = (swa_cache, slots, lens, (4, 64, 64 * 384))
    out, lse = torch.empty_like(q), torch.empty(2, 1, 5)
    decode.launch(plan, q, out, lse, 0.5, None, swa, (None, None, None, None))
    (values,) = packed
    got = dict(zip(ATTEND_PARAMS.names, values))
    assert len(values) == len(ATTEND_PARAMS.names)
    assert got["q"] == q.data_ptr() and got["out"] == out.data_ptr() and got["lse"] == lse.data_ptr()
    assert got["sinks"] == got["partial_o"] == got["partial_ml"] == 0
    assert (got["swa.cache"], got["swa.slots"], got["swa.lens"]) == (
        swa_cache.data_ptr(),
        slots.data_ptr(),
        lens.data_ptr(),
    )
    assert (got["swa.page_stride"], got["swa.page_size"], got["swa.capacity"], got["swa.k"]) == (64 * 384, 64, 256, 9)
    assert (got["swa.slot_int64"], got["swa.lens_int64"], got["extra.k"]) == (1, 0, 0)
    assert (got["rows"], got["num_heads"], got["num_splits"], got["tiles_per_split"]) == (2, 5, 1, 7)
    assert got["score_scale"] == pytest.approx(0.5 / 0.6931471805599453)
