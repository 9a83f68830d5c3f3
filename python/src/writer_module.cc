// ckptfs._writer: the writer's C++ API for Python (python/ckptfs/torch.py).
// No torch headers: tensors arrive as data pointers, byte sizes, device
// ordinals (-1 = host) and CUDA stream handles, all plain ints. Blocking
// calls release the GIL so the training thread and torch's own threads run
// while the ring drains.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "source/s3_client.h"
#include "source/s3_source.h"
#include "writer/commit_rows.h"
#include "writer/copy_engine.h"
#include "core/crc32c.h"
#include "python/src/s3_module.h"
#include "writer/dcp_file_writer.h"
#include "writer/safetensors_file_writer.h"
#include "writer/stager.h"
#include "indexer/torch_save_framing.h"

namespace py = pybind11;
using namespace ckptfs;

namespace {

[[noreturn]] void Raise(const Status& s) {
  switch (s.code()) {
    case Status::Code::kIOError:
      PyErr_SetString(PyExc_OSError, s.ToString().c_str());
      throw py::error_already_set();
    case Status::Code::kNotFound:  // a file the save wrote is not there
      PyErr_SetString(PyExc_FileNotFoundError, s.ToString().c_str());
      throw py::error_already_set();
    case Status::Code::kInvalidArgument: throw py::value_error(s.ToString());
    case Status::Code::kNotSupported: throw py::type_error(s.ToString());
    default: throw std::runtime_error(s.ToString());
  }
}
void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}
template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(r).value();
}

// A stager the Python side keeps across saves, so the ring (pinned memory
// on GPUs, slow to allocate) is allocated once per process.
struct PyStager {
  std::unique_ptr<Stager> stager;
};

struct PyDcpFile {
  std::unique_ptr<DcpFileWriter> file;
};

struct PySafetensorsFile {
  std::unique_ptr<SafetensorsFileWriter> file;
};

py::dict RowsSummary(const Checkpoint& rows) {
  py::list tensors;
  for (size_t t = 0; t < rows.tensors.size(); ++t) {
    const TensorMeta& tm = *rows.tensors[t];
    py::list chunks;
    for (size_t c = 0; c < tm.chunks.size(); ++c) {
      const Chunk& ch = tm.chunks[c];
      chunks.append(py::dict(py::arg("offsets") = Shape(ch.box().offsets),
                             py::arg("sizes") = Shape(ch.box().lengths),
                             py::arg("file") = rows.files[ch.file()].path, py::arg("offset") = ch.offset(),
                             py::arg("length") = ch.length(), py::arg("crc32c") = ch.crc32c()));
    }
    tensors.append(py::dict(py::arg("fqn") = tm.fqn, py::arg("path") = tm.path,
                            py::arg("dtype") = std::string(DTypeName(tm.dtype)), py::arg("shape") = tm.shape,
                            py::arg("chunks") = chunks));
  }
  py::dict bytes;
  for (const auto& [k, b] : rows.byte_items)
    bytes[py::str(k)] = py::make_tuple(rows.files[b.file].path, b.offset, b.length);
  return py::dict(py::arg("dir") = rows.dir, py::arg("format") = rows.format, py::arg("tensors") = tensors,
                  py::arg("bytes") = bytes, py::arg("problems") = rows.problems);
}

WrittenCheckpoint ToWritten(const std::string& dir, const std::string& format, const py::list& tensors,
                             const py::list& chunks, const py::list& bytes) {
  WrittenCheckpoint w;
  w.dir = dir;
  w.format = format;
  for (auto t : tensors) {
    auto tt = t.cast<py::tuple>();
    w.tensors.push_back({tt[0].cast<std::string>(), tt[1].cast<std::vector<std::string>>(), tt[2].cast<std::string>(),
                         tt[3].cast<std::vector<uint64_t>>()});
  }
  for (auto c : chunks) {
    auto ct = c.cast<py::tuple>();
    w.chunks.push_back({ct[0].cast<std::string>(), ct[1].cast<std::vector<uint64_t>>(), ct[2].cast<std::vector<uint64_t>>(),
                        ct[3].cast<std::string>(), ct[4].cast<uint64_t>(), ct[5].cast<uint64_t>(), ct[6].cast<uint32_t>()});
  }
  for (auto b : bytes) {
    auto bt = b.cast<py::tuple>();
    w.bytes.push_back({bt[0].cast<std::string>(), bt[1].cast<std::string>(), bt[2].cast<uint64_t>(), bt[3].cast<uint64_t>()});
  }
  return w;
}

// A rank file's `write`: queue the item's next bytes (the GIL released).
template <typename PyFile>
void WriteSlice(PyFile& f, uint32_t item, uintptr_t ptr, uint64_t nbytes, int device, uint64_t stream,
                bool copy_host) {
  Status s;
  {
    py::gil_scoped_release nogil;
    s = f.file->Write(item, Slice{reinterpret_cast<const void*>(ptr), nbytes, device, stream}, copy_host);
  }
  Check(s);
}

// A rank file's `finish` (drain, fsync) with the GIL released; its results.
template <typename PyFile>
auto FinishFile(PyFile& f) {
  decltype(f.file->Finish()) r = Status::Incomplete("not run");
  {
    py::gil_scoped_release nogil;
    r = f.file->Finish();
  }
  return Take(std::move(r));
}

template <typename PyFile, typename Class>
void DefWrite(Class& cls, const char* doc) {
  cls.def("write", &WriteSlice<PyFile>, py::arg("item"), py::arg("ptr"), py::arg("nbytes"),
          py::arg("device") = kHostDevice, py::arg("stream") = 0, py::arg("copy_host") = false, doc);
}

void BindStager(py::module_& m) {
  py::class_<PyStager>(m, "Stager")
      .def(py::init([](uint64_t buffer_bytes, int buffers, int io_threads, bool zip_crc32, bool use_cuda) {
             StagerOptions o;
             o.buffer_bytes = buffer_bytes;
             o.buffers = buffers;
             o.io_threads = io_threads;
             o.zip_crc32 = zip_crc32;
             auto engine = use_cuda ? MakeDefaultCopyEngine(buffers) : MakeHostCopyEngine();
             return PyStager{Take(Stager::Create(o, std::move(engine)))};
           }),
           py::arg("buffer_bytes") = 256ull << 20, py::arg("buffers") = 2, py::arg("io_threads") = 2,
           py::arg("zip_crc32") = true, py::arg("use_cuda") = true)
      .def_property_readonly("engine", [](const PyStager& s) { return std::string(s.stager->engine_name()); })
      .def("close", [](PyStager& s) {
             Status st;
             {
               py::gil_scoped_release nogil;
               st = s.stager->Close();
             }
             Check(st);
           },
           "Drain, then stop and join the I/O threads (later writes fail). Safe to call again; raises the "
           "first write error, if any.")
      .def("fence_producer", [](PyStager& s, int device, uint64_t stream) { Check(s.stager->FenceProducer(device, stream)); },
           py::arg("device"), py::arg("stream"),
           "Make later work on a producer stream wait for the copies issued so far (non-blocking).")
      .def("stats", [](const PyStager& s) {
        StagerStats st = s.stager->stats();
        return py::dict(py::arg("staged_bytes") = st.staged_bytes, py::arg("direct_bytes") = st.direct_bytes,
                        py::arg("producer_wait_ns") = st.producer_wait_ns);
      });
}

void BindDcpFile(py::module_& m) {
  py::class_<PyDcpFile> cls(m, "DcpFile");
  cls.def(py::init([](PyStager& s, const std::string& path) { return PyDcpFile{Take(DcpFileWriter::Create(s.stager.get(), path))}; }),
          py::keep_alive<1, 2>(), py::arg("stager"), py::arg("path"))
      .def("add_tensor", [](PyDcpFile& f, const std::string& dtype, const std::vector<uint64_t>& shape, uint64_t nbytes,
                            bool force_zip64) { return Take(f.file->AddTensor(dtype, shape, nbytes, force_zip64)); },
           py::arg("dtype"), py::arg("shape"), py::arg("nbytes"), py::arg("force_zip64") = false)
      .def("add_bytes", [](PyDcpFile& f, uint64_t n) { return Take(f.file->AddBytes(n)); })
      .def("finish", [](PyDcpFile& f) {
        py::list out;
        for (const DcpItemResult& i : FinishFile(f))
          out.append(py::make_tuple(i.offset, i.length, i.data_offset, i.data_length, i.crc32c));
        return out;
      }, "Drain, write framing, fsync: [(offset, length, data_offset, data_length, crc32c)] per item.")
      .def_property_readonly("size", [](const PyDcpFile& f) { return f.file->file_size(); });
  DefWrite<PyDcpFile>(cls, "Queue the item's next bytes. With copy_host=False host memory must stay unchanged until finish().");
}

void BindSafetensorsFile(py::module_& m) {
  py::class_<PySafetensorsFile> cls(m, "SafetensorsFile");
  cls.def(py::init([](PyStager& s, const std::string& path) {
            return PySafetensorsFile{Take(SafetensorsFileWriter::Create(s.stager.get(), path))};
          }),
          py::keep_alive<1, 2>(), py::arg("stager"), py::arg("path"))
      .def("add_tensor", [](PySafetensorsFile& f, const std::string& name, const std::string& dtype,
                            const std::vector<uint64_t>& shape, uint64_t nbytes) {
             return Take(f.file->AddTensor(name, dtype, shape, nbytes));
           }, py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("nbytes"))
      .def("seal", [](PySafetensorsFile& f, const std::map<std::string, std::string>& metadata) {
             Check(f.file->Seal(metadata));
           }, py::arg("metadata"), "Lay the file out (every tensor added) with `metadata` as __metadata__.")
      .def("finish", [](PySafetensorsFile& f) {
        py::list out;
        for (const SafetensorsItemResult& i : FinishFile(f)) out.append(py::make_tuple(i.offset, i.length, i.crc32c));
        return out;
      }, "Drain, fsync: [(offset, length, crc32c)] of each tensor's raw bytes, in add_tensor order.");
  DefWrite<PySafetensorsFile>(cls, "Queue the tensor's next bytes. With copy_host=False host memory must stay unchanged until finish().");
}

// What each layout's files can hold, asked while planning (before a byte is written).
void BindDTypes(py::module_& m) {
  m.def("torch_save_element_size", [](const std::string& dtype) { return TorchSaveFraming::ElementSize(dtype); },
        py::arg("dtype"), "Bytes per element of torch dtype name `dtype` in a DcpFile archive; 0: not framed.");
  m.def("safetensors_type", [](const std::string& dtype, const std::vector<uint64_t>& shape) {
    SafetensorsType t = Take(SafetensorsTypeOf(dtype, shape));
    return py::make_tuple(std::string(DTypeName(t.dtype)), t.shape);
  }, py::arg("dtype"), py::arg("shape"),
     "(safetensors dtype, header shape) of a torch tensor, as safetensors.torch.save stores it; "
     "TypeError naming the dtype when safetensors cannot hold it.");
}

void BindCommit(py::module_& m) {
  m.def("commit_rows", [](const std::string& abs_root, const std::string& dir, const py::list& tensors,
                          const py::list& chunks, const py::list& bytes, const std::string& format) {
    return RowsSummary(Take(BuildCommitRows(abs_root, ToWritten(dir, format, tensors, chunks, bytes))));
  }, py::arg("abs_root"), py::arg("dir"), py::arg("tensors"), py::arg("chunks"), py::arg("bytes"),
     py::arg("format") = "dcp",
     "The rows a commit record would carry (a summary dict), checked like a commit.");

  m.def("commit", [](const std::string& abs_root, const std::string& dir, const py::list& tensors,
                     const py::list& chunks, const py::list& bytes, const std::string& format) {
    Checkpoint ckpt = Take(BuildCommitRows(abs_root, ToWritten(dir, format, tensors, chunks, bytes)));
    Status s;
    {
      py::gil_scoped_release nogil;
      s = WriteCommitRecordFile(abs_root, ckpt);
    }
    Check(s);
    return RowsSummary(ckpt);
  }, py::arg("abs_root"), py::arg("dir"), py::arg("tensors"), py::arg("chunks"), py::arg("bytes"),
     py::arg("format") = "dcp",
     "Builds the rows like commit_rows, then writes <abs_root>/<dir>/.ckptfs/commit.sst (durably, last).");

  m.def("commit_s3", [](const std::shared_ptr<S3Client>& client, const std::string& dir, const py::list& tensors,
                        const py::list& chunks, const py::list& bytes, const std::string& format) {
    WrittenCheckpoint written = ToWritten(dir, format, tensors, chunks, bytes);
    Result<Checkpoint> ckpt = Status::Incomplete("not run");
    Status s;
    {
      py::gil_scoped_release nogil;
      S3Source source(client->config());
      ckpt = BuildCommitRows(source, written);
      if (ckpt.ok()) s = PutCommitRecord(*client, *ckpt);
    }
    Checkpoint rows = Take(std::move(ckpt));
    Check(s);
    return RowsSummary(rows);
  }, py::arg("client"), py::arg("dir"), py::arg("tensors"), py::arg("chunks"), py::arg("bytes"),
     py::arg("format") = "dcp",
     "As commit, for the objects under the client's root: identified and read back through S3, the record "
     "PUT last as <root>/<dir>/.ckptfs/commit.sst.");
}

}  // namespace

PYBIND11_MODULE(_writer, m) {
  m.doc() = "ckptfs writer: stager, DCP and safetensors rank files, commit rows (C++)";
  m.attr("built_with_cuda") = BuiltWithCuda();

  m.def("crc32c", [](py::buffer b, uint32_t crc) {
    py::buffer_info info = b.request();
    const uint64_t n = uint64_t(info.size) * uint64_t(info.itemsize);
    py::gil_scoped_release nogil;
    return Crc32c(crc, info.ptr, n);
  }, py::arg("data"), py::arg("crc") = 0, "CRC32C of a contiguous buffer (continues `crc`).");

  m.def("sync_dir", [](const std::string& d) {
    py::gil_scoped_release nogil;
    Status s = SyncDir(d);
    py::gil_scoped_acquire gil;
    Check(s);
  }, "fsync a directory so entries made in it are durable.");

  BindStager(m);
  BindDcpFile(m);
  BindSafetensorsFile(m);
  BindDTypes(m);
  BindCommit(m);
  BindS3(m);
}
