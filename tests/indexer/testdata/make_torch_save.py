#!/usr/bin/env python3
"""Regenerates the torch.save archives tests/indexer/torch_zip_test.cc reads,
and prints the values the test expects (paste them there if they change).

    python3 tests/indexer/testdata/make_torch_save.py [outdir]

Written with the real torch (2.13 CPU when these were made), so the tests
check the reader against what torch actually writes, not against our idea of
it. Each file stays well under 20 KB.

Files:
  dtypes.pt   one small tensor per dtype, incl. bf16 (typed storage),
              float8_e4m3fn and uint16 (_rebuild_tensor_v3 + UntypedStorage)
  views.pt    a transposed (non-contiguous) tensor, a view with a storage
              offset, a column view, and two views sharing one storage
  nested.pt   a trainer-style dict: model/optim nesting, int keys, lists,
              tuples, an nn.Parameter, plain Python values
  bare.pt     a single tensor as the whole object
  rezipped.pt bare.pt rewritten by Python's zipfile (no zip64, no padding,
              an archive comment)
  deflated.pt bare.pt rewritten compressed (torch.load reads it; we refuse)
  evil.pt     a dict whose extra value reduces to os.system(...): reading it
              must find the tensor and must not run anything
  dcp/        a DCP checkpoint (FileSystemWriter): .metadata + __0_0.distcp,
              whose items are torch.save archives at offsets
"""
import os
import sys
import warnings

import torch

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
EVIL_PATH = "/tmp/ckptfs_torch_zip_test_pwned"


class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + EVIL_PATH,))


def hexbytes(t):
    """The tensor's elements in logical row-major order, as hex bytes."""
    c = t.detach().contiguous()
    return c.reshape(-1).view(torch.uint8).numpy().tobytes().hex() if c.numel() else ""


def report(name, obj, prefix=()):
    if isinstance(obj, torch.Tensor):
        ints = lambda xs: "{" + ", ".join(str(x) for x in xs) + "}"
        path = "{" + ", ".join('"' + str(p) + '"' for p in prefix) + "}"
        dtype = str(obj.dtype).replace("torch.", "")
        print(f'  {{{path}, "{dtype}", {ints(obj.shape)}, {ints(obj.stride())}, '
              f'{obj.storage_offset()}, "{hexbytes(obj)}"}},')
    elif isinstance(obj, dict):
        for k, v in obj.items():
            report(name, v, prefix + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            report(name, v, prefix + (i,))


def save(name, obj):
    path = os.path.join(OUT, name)
    torch.save(obj, path)
    print(f"// {name}: {os.path.getsize(path)} bytes")
    report(name, torch.load(path, weights_only=False) if name != "evil.pt" else obj)


def main():
    torch.manual_seed(0)
    os.makedirs(OUT, exist_ok=True)

    save("dtypes.pt", {
        "bf16": torch.tensor([1.5, -2.25, 3.0e5], dtype=torch.bfloat16),
        "f16": torch.tensor([[0.5, -1.0], [65504.0, 2.0 ** -24]], dtype=torch.float16),
        "f32": torch.tensor([1.0, -0.1, 3.25]),
        "f64": torch.tensor([2.0 ** 0.5], dtype=torch.float64),
        "f8_e4m3": torch.tensor([0.5, -2.0, 448.0, 0.0]).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.tensor([1.0, -57344.0]).to(torch.float8_e5m2),
        "u16": torch.tensor([0, 1, 65535], dtype=torch.uint16),
        "u32": torch.tensor([4000000000], dtype=torch.uint32),
        "i64": torch.tensor([-1, 2 ** 40], dtype=torch.int64),
        "i32": torch.tensor([-7], dtype=torch.int32),
        "i16": torch.tensor([-300, 300], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
        "scalar": torch.tensor(7.0),
        "empty": torch.zeros(0, 3),
    })

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    shared = torch.arange(8, dtype=torch.int32)
    save("views.pt", {
        "transposed": base.t(),          # shape [4, 3], strides [1, 4]
        "offset": torch.arange(10.0)[3:7],  # storage_offset 3
        "column": base[:, 1],            # strides [4], offset 1
        "shared_a": shared[:4],
        "shared_b": shared[4:],          # same storage as shared_a
    })

    save("nested.pt", {
        "model": {"layer.weight": torch.ones(2, 3, dtype=torch.bfloat16),
                  "layer.bias": torch.zeros(2, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), 0.25)}},
                  "param_groups": [{"lr": 0.001, "params": [0], "name": "default"}]},
        "list": [torch.tensor([1, 2], dtype=torch.int8), (torch.tensor([3], dtype=torch.int8),)],
        "param": torch.nn.Parameter(torch.tensor([0.5, 1.5])),
        "epoch": 3,
        "loss": 0.125,
        "note": "hi",
    })

    save("bare.pt", torch.tensor([[1, 2, 3]], dtype=torch.int16))

    # The same archive rewritten by Python's zipfile: no zip64 records, no
    # alignment padding, sizes in the local headers, and an archive comment.
    import zipfile
    with zipfile.ZipFile(os.path.join(OUT, "bare.pt")) as src, \
            zipfile.ZipFile(os.path.join(OUT, "rezipped.pt"), "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
        dst.comment = b"rewritten by zipfile"
    # ... and compressed, which torch never writes and the reader refuses.
    with zipfile.ZipFile(os.path.join(OUT, "bare.pt")) as src, \
            zipfile.ZipFile(os.path.join(OUT, "deflated.pt"), "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    print(f"// rezipped.pt: {os.path.getsize(os.path.join(OUT, 'rezipped.pt'))} bytes")
    report("rezipped.pt", torch.load(os.path.join(OUT, "rezipped.pt")))

    save("evil.pt", {"w": torch.tensor([9.0]), "payload": Evil()})
    assert not os.path.exists(EVIL_PATH)

    import torch.distributed.checkpoint as dcp
    warnings.filterwarnings("ignore")
    dcp_dir = os.path.join(OUT, "dcp")
    for f in os.listdir(dcp_dir) if os.path.isdir(dcp_dir) else []:
        os.remove(os.path.join(dcp_dir, f))
    sd = {"w": base.to(torch.bfloat16), "nested": {"b": torch.tensor([5, 6], dtype=torch.int64)},
          "step": 7}
    dcp.save(sd, checkpoint_id=dcp_dir, no_dist=True)
    print("// dcp: " + ", ".join(f"{f} {os.path.getsize(os.path.join(dcp_dir, f))} bytes"
                                 for f in sorted(os.listdir(dcp_dir))))
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(dcp_dir).read_metadata()
    for idx, info in md.storage_data.items():
        print(f"//   {idx.fqn}: offset {info.offset} length {info.length}")
    report("dcp", sd)


if __name__ == "__main__":
    main()
