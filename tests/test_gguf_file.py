"""The GGUF header parser against gguf-py's ``GGUFReader`` (the independent reference) on the
embedded SmolLM2 GGUF and on files written here, and its errors on cut or corrupted files."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from test_llama_model import random_hf_weights
from test_loader import PLAIN, write_gguf

from tokenspeed_jax.models.gguf_file import GGUFFile
from tokenspeed_jax.models.loader import default_model_path

# One key per value type, arrays of each element type; values at the edges of their ranges.
EVERY_VALUE_TYPE = {
    "t.u8": (255, GGUFValueType.UINT8, None),
    "t.i8": (-128, GGUFValueType.INT8, None),
    "t.u16": (65535, GGUFValueType.UINT16, None),
    "t.i16": (-32768, GGUFValueType.INT16, None),
    "t.u32": (2**32 - 1, GGUFValueType.UINT32, None),
    "t.i32": (-(2**31), GGUFValueType.INT32, None),
    "t.f32": (1e-5, GGUFValueType.FLOAT32, None),
    "t.bool": (True, GGUFValueType.BOOL, None),
    "t.str": ("héllo 日本", GGUFValueType.STRING, None),
    "t.empty_str": ("", GGUFValueType.STRING, None),
    "t.u64": (2**64 - 1, GGUFValueType.UINT64, None),
    "t.i64": (-(2**63), GGUFValueType.INT64, None),
    "t.f64": (0.1, GGUFValueType.FLOAT64, None),
    "t.strs": (["a", "", "Ġb", "<|im_end|>"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    "t.bools": ([True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL),
    "t.u8s": ([0, 7, 255], GGUFValueType.ARRAY, GGUFValueType.UINT8),
    "t.i16s": ([-1, 2], GGUFValueType.ARRAY, GGUFValueType.INT16),
    "t.i32s": ([3, -1, 4], GGUFValueType.ARRAY, GGUFValueType.INT32),
    "t.u64s": ([2**64 - 1, 0], GGUFValueType.ARRAY, GGUFValueType.UINT64),
    "t.f32s": ([0.5, -2.25], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    "t.f64s": ([1e-300, 3.5], GGUFValueType.ARRAY, GGUFValueType.FLOAT64),
}


def write_metadata_gguf(path: Path, fields: dict) -> Path:
    """A GGUF with no tensors and ``fields``: key -> (value, value type, array element type)."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, (value, value_type, element_type) in fields.items():
        writer.add_key_value(key, value, value_type, sub_type=element_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def model_gguf(tmp_path_factory) -> Path:
    """A small llama GGUF with F32 norms and Q8_0 matrices."""
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    return write_gguf(path, PLAIN, random_hf_weights(PLAIN), GGMLQuantizationType.Q8_0)


def assert_matches_reader(path: Path) -> None:
    parsed = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    header = {"GGUF.version": parsed.version, "GGUF.tensor_count": len(parsed.tensors),
              "GGUF.kv_count": len(parsed.metadata)}
    expected = {key: field.contents() for key, field in reader.fields.items()}
    assert list(header | parsed.metadata) == list(expected)
    assert header | parsed.metadata == expected
    assert parsed.data_start == reader.data_offset
    assert [(t.name, t.dims, t.ggml_type, t.offset, t.nbytes) for t in parsed.tensors] == [
        (t.name, tuple(t.shape.tolist()), t.tensor_type, t.data_offset, t.n_bytes)
        for t in reader.tensors
    ]
    for ours, theirs in zip(parsed.tensors, reader.tensors):
        raw = parsed.tensor_bytes(ours)  # the reader's F32/F16 data is typed, the rest bytes
        row_bytes = theirs.data.shape[-1] * theirs.data.itemsize
        assert raw.shape == (*theirs.data.shape[:-1], row_bytes), ours.name
        assert raw.tobytes() == theirs.data.tobytes(), ours.name


def test_embedded_smollm2_header_matches_gguf_reader():
    assert_matches_reader(default_model_path())


def test_model_gguf_header_matches_gguf_reader(model_gguf: Path):
    assert_matches_reader(model_gguf)


def test_every_value_type_matches_gguf_reader(tmp_path: Path):
    path = write_metadata_gguf(tmp_path / "values.gguf", EVERY_VALUE_TYPE)
    assert_matches_reader(path)
    parsed = GGUFFile(path)
    assert parsed.metadata["t.bool"] is True and parsed.metadata["t.bools"] == [True, False]
    assert parsed.metadata["t.f32"] == float(np.float32(1e-5))  # float32 widened exactly


def test_nested_arrays_are_lists_of_lists(tmp_path: Path):
    nested = ([[1, 2], [3]], GGUFValueType.ARRAY, GGUFValueType.ARRAY)
    path = write_metadata_gguf(tmp_path / "nested.gguf", {"t.nested": nested})
    assert GGUFFile(path).metadata["t.nested"] == [[1, 2], [3]]


def test_every_cut_of_a_gguf_names_the_file(tmp_path: Path, model_gguf: Path):
    data = model_gguf.read_bytes()
    parsed = GGUFFile(model_gguf)
    data_end = max(t.offset + t.nbytes for t in parsed.tensors)
    header_cuts = range(parsed.data_start + 1)
    data_cuts = range(parsed.data_start + 1, data_end, 997)
    for size in [*header_cuts, *data_cuts, data_end - 1]:
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f"cut{size}.gguf: "):
            GGUFFile(cut)
        cut.unlink()


def patched(tmp_path: Path, source: Path, offset: int, fmt: str, value) -> Path:
    data = bytearray(source.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path = tmp_path / "patched.gguf"
    path.write_bytes(bytes(data))
    return path


def first_tensor_info_offset(path: Path) -> int:
    """Where the first tensor's ``n_dims`` lies: just after its name."""
    name = GGUFFile(path).tensors[0].name.encode()
    return path.read_bytes().index(name) + len(name)


# The metadata-only file starts: magic, version, tensor count, kv count (offset 16), then
# general.architecture: key length (24), 20 key bytes (32), value type (52).
@pytest.mark.parametrize(("offset", "fmt", "value", "message"), [
    (0, "<4s", b"GGML", "not a GGUF file: magic b'GGML'"),
    (4, "<I", 1, "GGUF version 1 is not supported"),
    (4, "<I", 3 << 24, "GGUF version 50331648 is not supported"),  # a big-endian v3 file
    (8, "<Q", 2**40, "1099511627776 tensor infos"),
    (16, "<Q", 2**40, "1099511627776 metadata entries"),
    (24, "<Q", 2**40, "string 0 of metadata key at offset 24 runs past the end"),
    (32, "<B", 0xFF, "metadata key is not UTF-8"),
    (52, "<I", 99, "general.architecture has unknown value type 99"),
])
def test_corrupt_header_is_a_clear_error(tmp_path: Path, offset, fmt, value, message):
    source = write_metadata_gguf(tmp_path / "values.gguf", EVERY_VALUE_TYPE)
    with pytest.raises(ValueError, match=f"patched.gguf: .*{message}"):
        GGUFFile(patched(tmp_path, source, offset, fmt, value))


def test_alignment_must_be_a_power_of_two(tmp_path: Path):
    path = write_metadata_gguf(
        tmp_path / "a.gguf", {"general.alignment": (48, GGUFValueType.UINT32, None)})
    with pytest.raises(ValueError, match="a.gguf: general.alignment=48 is not a power of two"):
        GGUFFile(path)


# A tensor info after its name: n_dims (+0), dims (+4, +12 for a matrix), ggml type (+20), offset.
@pytest.mark.parametrize(("delta", "fmt", "value", "message"), [
    (0, "<I", 5, "has 5 dimensions; at most 4"),
    (4, "<Q", 2**40, "truncated or corrupt: tensor .* needs bytes"),
    (4, "<Q", 33, "rows of 33 are not whole Q8_0 blocks of 32"),
    (20, "<I", 200, "has unknown ggml type 200"),
    (24, "<Q", 1, "data offset 1 is not a multiple of the alignment 32"),
    (24, "<Q", 2**40, "truncated or corrupt: tensor .* needs bytes"),
])
def test_corrupt_tensor_info_is_a_clear_error(tmp_path: Path, model_gguf: Path, delta, fmt, value,
                                              message):
    assert len(GGUFFile(model_gguf).tensors[0].dims) == 2
    offset = first_tensor_info_offset(model_gguf) + delta
    with pytest.raises(ValueError, match=f"patched.gguf: .*{message}"):
        GGUFFile(patched(tmp_path, model_gguf, offset, fmt, value))
