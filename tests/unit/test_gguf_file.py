"""model_loader/gguf_file.py (the one-pass GGUF header reader) against gguf's own GGUFReader, the oracle: every
metadata value and every tensor view equal, in either byte order; bad headers are refused with a ValueError."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from kvserve.model_loader.gguf_file import GGUFFile


def _write(path, endianess=gguf.GGUFEndian.LITTLE) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_block_count(2)
    writer.add_bool("test.flag", True)
    writer.add_int8("test.int8", -5)
    writer.add_float64("test.float64", 0.1)
    writer.add_string("test.text", "naïve ✓")
    writer.add_array("test.strings", ["a", "", "ünï", "<|im_end|>"])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.bools", [True, False])
    writer.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    blocks = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_same(path) -> None:
    ours, reader = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(ours.tensors, reader.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_matches_gguf_reader(tmp_path, endianess):
    path = tmp_path / "t.gguf"
    _write(path, endianess)
    _assert_same(path)
    assert GGUFFile(str(path)).field("test.missing", 7) == 7


def test_matches_gguf_reader_on_the_builtin_model():
    from kvserve.model_loader.gguf_loader import builtin_model_path

    try:
        path = builtin_model_path()
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))
    _assert_same(path)


def test_bad_headers_are_value_errors(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path)
    data = path.read_bytes()
    cases = {"no magic": b"GGML" + data[4:], "version": data[:4] + (9).to_bytes(4, "little") + data[8:],
             "cut in the metadata": data[:60], "cut in the tensors": data[:-64], "empty": b""}
    for what, raw in cases.items():
        bad = tmp_path / f"{what}.gguf"
        bad.write_bytes(raw)
        with pytest.raises(ValueError):
            GGUFFile(str(bad))
