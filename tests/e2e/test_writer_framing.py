"""The C++ writer's torch.save framing and rank file, through ckptfs._writer
without torch.distributed: torch.load reads each item (zip and zip64), and
the stager's bookkeeping matches what was written."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

import writer_util
from ckptfs import _writer

# Every dtype torch's FileSystemWriter saves.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.complex64, torch.complex128, torch.complex32]


def _tensor(dtype, shape, seed):
    """Random bytes viewed as `dtype` (bool: 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    esize = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (*shape, esize), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def _raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("zip64", [False, True])
def test_every_item_torch_loads_to_the_written_tensor(tmp_path, zip64):
    stager = _writer.Stager(buffer_bytes=1024, buffers=2, io_threads=2)
    f = _writer.DcpFile(stager, str(tmp_path / "__0_0.distcp"))
    tensors = [_tensor(dt, (3, 5) if i % 3 else (17,), i) for i, dt in enumerate(DTYPES)]
    tensors.append(torch.tensor(2.5))          # 0-d
    tensors.append(torch.zeros(0, 4))          # empty
    ids = [f.add_tensor(str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size(),
                        force_zip64=zip64) for t in tensors]
    blob = b"a BYTE_IO item"
    bid = f.add_bytes(len(blob))
    keep = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    for t, i in zip(tensors, ids):
        if t.numel():
            f.write(i, t.data_ptr(), t.numel() * t.element_size(), -1, 0, False)
    f.write(bid, keep.data_ptr(), len(blob), -1, 0, True)
    results = f.finish()
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert len(data) == f.size
    for t, (off, length, doff, dlen, crc) in zip(tensors, results):
        item = data[off:off + length]
        got = torch.load(io.BytesIO(item), weights_only=True)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(_raw(got), _raw(t))
        assert zipfile.ZipFile(io.BytesIO(item)).testzip() is None
        assert doff % 64 == 0 and dlen == t.numel() * t.element_size()
        assert data[doff:doff + dlen] == t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert crc == writer_util.crc32c(data[doff:doff + dlen])
    off, length, doff, dlen, crc = results[-1]
    assert data[off:off + length] == blob and (doff, dlen) == (off, length)
    assert crc == writer_util.crc32c(blob)


def test_crc32c_binding_matches_the_definition():
    assert _writer.crc32c(b"123456789") == 0xE3069283
    buf = bytes(range(256)) * 7
    assert _writer.crc32c(buf) == writer_util.crc32c(buf)
    assert _writer.crc32c(buf[100:], _writer.crc32c(buf[:100])) == writer_util.crc32c(buf)


def test_a_short_item_fails_finish_with_its_sizes(tmp_path):
    stager = _writer.Stager(buffer_bytes=4096)
    f = _writer.DcpFile(stager, str(tmp_path / "x.distcp"))
    t = torch.arange(10, dtype=torch.float32)
    i = f.add_tensor("float32", [10], 40)
    f.write(i, t.data_ptr(), 20, -1, 0, True)
    with pytest.raises(ValueError, match="got 20 of its 40 bytes"):
        f.finish()


def test_device_pointers_need_cuda(tmp_path):
    stager = _writer.Stager(buffer_bytes=4096, use_cuda=False)
    f = _writer.DcpFile(stager, str(tmp_path / "d.distcp"))
    i = f.add_tensor("float32", [1], 4)
    with pytest.raises(TypeError, match="host memory only"):
        f.write(i, 4096, 4, 0, 0, True)
