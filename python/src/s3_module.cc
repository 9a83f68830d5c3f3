// ckptfs._writer.S3Client: the S3 calls the writer uploads with
// (source/s3_client.h), for Python. Configuration is resolved as
// `ckptfs mount s3://` resolves it (source/s3_config.h: environment,
// profiles, endpoint, CA bundle, path style). Keys are full keys of the
// URL's bucket. Every call releases the GIL.
#include "python/src/s3_module.h"

#include <pybind11/stl.h>

#include "core/crc32c.h"
#include "core/digest.h"
#include "source/s3_client.h"
#include "source/s3_config.h"
#include "writer/dcp_file_writer.h"
#include "writer/s3_stager.h"
#include "writer/safetensors_file_writer.h"

namespace py = pybind11;

namespace ckptfs {
namespace {

[[noreturn]] void RaiseS3(const Status& s) {
  switch (s.code()) {
    case Status::Code::kNotFound: throw py::key_error(s.ToString());
    case Status::Code::kPermissionDenied: PyErr_SetString(PyExc_PermissionError, s.ToString().c_str()); break;
    case Status::Code::kInvalidArgument: throw py::value_error(s.ToString());
    default: PyErr_SetString(PyExc_OSError, s.ToString().c_str()); break;
  }
  throw py::error_already_set();
}

template <typename F>
auto NoGil(F f) {
  py::gil_scoped_release nogil;
  return f();
}

void CheckS3(const Status& s) {
  if (!s.ok()) RaiseS3(s);
}
template <typename T>
T TakeS3(Result<T> r) {
  if (!r.ok()) RaiseS3(r.status());
  return std::move(r).value();
}

const char* CheckName(S3PartCheck c) { return c == S3PartCheck::kCrc32c ? "crc32c" : "md5"; }
S3PartCheck CheckFrom(const std::string& s) {
  if (s == "crc32c") return S3PartCheck::kCrc32c;
  if (s == "md5") return S3PartCheck::kMd5;
  throw py::value_error("check must be 'crc32c' or 'md5', not '" + s + "'");
}

S3Body BodyOf(const py::buffer_info& info) {
  return S3Body{{{static_cast<const char*>(info.ptr), uint64_t(info.size) * uint64_t(info.itemsize)}}};
}

std::shared_ptr<S3Client> MakeClient(const std::string& url, const std::string& endpoint_url, const std::string& region,
                                     bool force_path_style, bool no_sign_request) {
  S3Flags flags;
  flags.endpoint_url = endpoint_url;
  flags.region = region;
  flags.force_path_style = force_path_style;
  flags.no_sign_request = no_sign_request;
  return std::make_shared<S3Client>(TakeS3(ResolveS3Config(url, flags)));
}

py::tuple CreateUpload(const S3Client& c, const std::string& key, bool ask_crc32c) {
  auto [id, check] = TakeS3(NoGil([&] { return c.CreateMultipartUpload(key, ask_crc32c); }));
  return py::make_tuple(id, CheckName(check));
}

// The part's checksum is computed here, over the bytes sent.
std::string UploadPart(const S3Client& c, const std::string& key, const std::string& id, int number,
                       const py::buffer& data, const std::string& check) {
  const py::buffer_info info = data.request();
  const S3Body body = BodyOf(info);
  const S3PartCheck how = CheckFrom(check);
  return TakeS3(NoGil([&] {
    const auto& [p, n] = body.spans[0];
    std::string md5;
    if (how == S3PartCheck::kMd5) {
      Md5 m;
      m.Update(p, n);
      const auto d = m.Final();
      md5 = Base64(d.data(), d.size());
    }
    return c.UploadPart(key, id, number, body, how, Crc32c(0, p, n), md5);
  }));
}

void Complete(const S3Client& c, const std::string& key, const std::string& id,
              const std::vector<std::tuple<int, std::string, uint32_t>>& parts, const std::string& check) {
  std::vector<S3CompletedPart> done;
  for (const auto& [n, etag, crc] : parts) done.push_back({n, etag, crc});
  const S3PartCheck how = CheckFrom(check);
  CheckS3(NoGil([&] { return c.CompleteMultipartUpload(key, id, done, how); }));
}

py::list ListUploads(const S3Client& c, const std::string& prefix) {
  py::list out;
  for (const S3MultipartUploadInfo& u : TakeS3(NoGil([&] { return c.ListMultipartUploads(prefix); })))
    out.append(py::make_tuple(u.key, u.upload_id));
  return out;
}

struct PyS3Stager {
  std::unique_ptr<S3Stager> stager;
};

struct PyS3DcpFile {
  std::unique_ptr<DcpFileWriter> file;
};

struct PyS3SafetensorsFile {
  std::unique_ptr<SafetensorsFileWriter> file;
};

py::tuple UploadTuple(const S3ObjectUpload& u) {
  py::list parts;
  for (const S3CompletedPart& p : u.parts) parts.append(py::make_tuple(p.number, p.etag, p.crc32c));
  return py::make_tuple(u.key, u.upload_id, CheckName(u.check), parts);
}

// The calls every rank file uploaded through an S3Stager answers alike
// (DcpFileWriter and SafetensorsFileWriter): write, upload, abort, size.
template <typename PyFile>
void BindS3FileCalls(py::class_<PyFile>& c, const char* write_doc) {
  c.def("write", [](PyFile& f, uint32_t item, uintptr_t ptr, uint64_t nbytes, int device, uint64_t stream,
                    bool copy_host) {
         CheckS3(NoGil([&] {
           return f.file->Write(item, Slice{reinterpret_cast<const void*>(ptr), nbytes, device, stream}, copy_host);
         }));
       }, py::arg("item"), py::arg("ptr"), py::arg("nbytes"), py::arg("device") = kHostDevice,
       py::arg("stream") = 0, py::arg("copy_host") = true, write_doc)
      .def_property_readonly("upload", [](const PyFile& f) { return UploadTuple(f.file->upload()); },
                             "(key, upload_id, check, [(number, etag, crc32c)]) after finish().")
      .def("abort", [](PyFile& f) { CheckS3(NoGil([&] { return f.file->Abort(); })); },
           "Abort the multipart upload (after a failure).")
      .def_property_readonly("size", [](const PyFile& f) { return f.file->file_size(); });
}

void BindS3Writer(py::module_& m) {
  py::class_<PyS3Stager>(m, "S3Stager")
      .def(py::init([](std::shared_ptr<S3Client> client, uint64_t part_bytes, int buffers, int upload_threads,
                       bool zip_crc32, bool use_cuda) {
             S3StagerOptions o{part_bytes, buffers, upload_threads, zip_crc32};
             auto engine = use_cuda ? MakeDefaultCopyEngine(buffers) : MakeHostCopyEngine();
             return PyS3Stager{TakeS3(S3Stager::Create(o, std::move(client), std::move(engine)))};
           }),
           py::arg("client"), py::arg("part_bytes"), py::arg("buffers"), py::arg("upload_threads"),
           py::arg("zip_crc32") = true, py::arg("use_cuda") = true,
           "A ring of `buffers` parts of `part_bytes`, uploaded by `upload_threads` threads.")
      .def("close", [](PyS3Stager& s) { CheckS3(NoGil([&] { return s.stager->Close(); })); },
           "Wait for the uploads in flight, then stop and join the threads.")
      .def("fence_producer", [](PyS3Stager& s, int device, uint64_t stream) {
             CheckS3(s.stager->FenceProducer(device, stream));
           }, py::arg("device"), py::arg("stream"));
  m.def("part_bytes_for", &PartBytesFor, py::arg("largest_object"), py::arg("preferred"),
        "The part size (>= preferred, >= 5 MiB, a MiB multiple) that keeps an object within 10,000 parts.");

  py::class_<PyS3DcpFile> dcp(m, "S3DcpFile");
  dcp.def(py::init([](PyS3Stager& s, const std::string& key) {
             return PyS3DcpFile{TakeS3(DcpFileWriter::CreateS3(s.stager.get(), key))};
           }),
           py::keep_alive<1, 2>(), py::arg("stager"), py::arg("key"))
      .def("add_tensor", [](PyS3DcpFile& f, const std::string& dtype, const std::vector<uint64_t>& shape, uint64_t nbytes,
                            bool force_zip64) { return TakeS3(f.file->AddTensor(dtype, shape, nbytes, force_zip64)); },
           py::arg("dtype"), py::arg("shape"), py::arg("nbytes"), py::arg("force_zip64") = false)
      .def("add_bytes", [](PyS3DcpFile& f, uint64_t n) { return TakeS3(f.file->AddBytes(n)); })
      .def("seal", [](PyS3DcpFile& f) { CheckS3(NoGil([&] { return f.file->Seal(); })); },
           "After the last add_*: open the multipart upload and plan the framing.")
      .def("finish", [](PyS3DcpFile& f) {
             auto r = NoGil([&] { return f.file->Finish(); });
             py::list out;
             for (const DcpItemResult& i : TakeS3(std::move(r)))
               out.append(py::make_tuple(i.offset, i.length, i.data_offset, i.data_length, i.crc32c));
             return out;
           }, "Every part uploaded (not completed): [(offset, length, data_offset, data_length, crc32c)] per item.");
  BindS3FileCalls(dcp, "Queue the item's next bytes (always copied into the ring).");
}

// One rank's shard of the HF layout as a multipart upload (safetensors_file_writer.h).
void BindS3Safetensors(py::module_& m) {
  py::class_<PyS3SafetensorsFile> st(m, "S3SafetensorsFile");
  st.def(py::init([](PyS3Stager& s, const std::string& key) {
             return PyS3SafetensorsFile{TakeS3(SafetensorsFileWriter::CreateS3(s.stager.get(), key))};
           }),
           py::keep_alive<1, 2>(), py::arg("stager"), py::arg("key"))
      .def("add_tensor", [](PyS3SafetensorsFile& f, const std::string& name, const std::string& dtype,
                            const std::vector<uint64_t>& shape, uint64_t nbytes) {
             return TakeS3(f.file->AddTensor(name, dtype, shape, nbytes));
           }, py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("nbytes"))
      .def("seal", [](PyS3SafetensorsFile& f, const std::map<std::string, std::string>& metadata) {
             CheckS3(NoGil([&] { return f.file->Seal(metadata); }));
           }, py::arg("metadata"), "Lay the file out with `metadata` as __metadata__, open the upload, queue the header.")
      .def_property_readonly("data_begins", [](const PyS3SafetensorsFile& f) { return f.file->DataBegins(); },
                             "After seal: where each tensor's bytes begin, in add_tensor order (write in this order).")
      .def("finish", [](PyS3SafetensorsFile& f) {
             auto r = NoGil([&] { return f.file->Finish(); });
             py::list out;
             for (const SafetensorsItemResult& i : TakeS3(std::move(r)))
               out.append(py::make_tuple(i.offset, i.length, i.crc32c));
             return out;
           }, "Every part uploaded (not completed): [(offset, length, crc32c)] of each tensor's raw bytes.");
  BindS3FileCalls(st, "Queue the tensor's next bytes (always copied into the ring).");
}

}  // namespace

void BindS3(py::module_& m) {
  BindS3Writer(m);
  BindS3Safetensors(m);
  py::class_<S3Client, std::shared_ptr<S3Client>>(m, "S3Client")
      .def(py::init(&MakeClient), py::arg("url"), py::arg("endpoint_url") = "", py::arg("region") = "",
           py::arg("force_path_style") = false, py::arg("no_sign_request") = false,
           "A client for the bucket of `url` (s3://BUCKET/PREFIX), configured as `ckptfs mount` is.")
      .def_property_readonly("bucket", [](const S3Client& c) { return c.config().location.bucket; })
      .def_property_readonly("root", [](const S3Client& c) { return c.config().Root(); })
      .def_property_readonly("prefix", [](const S3Client& c) { return c.config().location.prefix; })
      .def("create_multipart_upload", &CreateUpload, py::arg("key"), py::arg("ask_crc32c") = true,
           "CreateMultipartUpload: (upload_id, 'crc32c' or 'md5': how the server checks parts). "
           "ask_crc32c=False asks for no checksum algorithm, as a server that takes none answers.")
      .def("upload_part", &UploadPart, py::arg("key"), py::arg("upload_id"), py::arg("number"), py::arg("data"),
           py::arg("check"), "UploadPart with the part's CRC32C (or Content-MD5); its ETag.")
      .def("complete_multipart_upload", &Complete, py::arg("key"), py::arg("upload_id"), py::arg("parts"),
           py::arg("check"), "CompleteMultipartUpload of [(number, etag, crc32c)], ascending.")
      .def("abort_multipart_upload",
           [](const S3Client& c, const std::string& key, const std::string& id) {
             CheckS3(NoGil([&] { return c.AbortMultipartUpload(key, id); }));
           }, py::arg("key"), py::arg("upload_id"))
      .def("list",
           [](const S3Client& c, const std::string& prefix) {
             py::list out;
             for (const S3ObjectInfo& o : TakeS3(NoGil([&] { return c.List(prefix); })).objects)
               out.append(py::make_tuple(o.key, o.size, o.etag));
             return out;
           }, py::arg("prefix"), "[(key, size, etag)] of the objects directly under prefix (delimiter '/').")
      .def("list_multipart_uploads", &ListUploads, py::arg("prefix"), "[(key, upload_id)] in progress under prefix.")
      .def("put",
           [](const S3Client& c, const std::string& key, const py::buffer& data) {
             const py::buffer_info info = data.request();
             const S3Body body = BodyOf(info);
             CheckS3(NoGil([&] { return c.Put(key, body); }));
           }, py::arg("key"), py::arg("data"), "PutObject with Content-MD5 and x-amz-checksum-crc32c.")
      .def("delete", [](const S3Client& c, const std::string& key) { CheckS3(NoGil([&] { return c.Delete(key); })); },
           py::arg("key"), "DeleteObject (a missing key is not an error).");
}

}  // namespace ckptfs
