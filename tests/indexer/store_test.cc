// The store (schema 2): round trips, per-checkpoint commits, atomicity,
// refusals of directories that are not ours, v1 rebuild, the writer lock,
// read-only catch-up, and writers' commit records.
#include "indexer/dcp_item.h"
#include "indexer/index_store.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "indexer/commit_record.h"
#include "indexer/store_rows.h"
#include "tests/indexer/test_dirs.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;
using Access = Store::Access;

// Every field of a Checkpoint, compared one by one.
void ExpectSameCheckpoint(const Checkpoint& a, const Checkpoint& b) {
  EXPECT_EQ(a.dir, b.dir);
  EXPECT_EQ(a.format, b.format);
  ASSERT_EQ(a.files.size(), b.files.size());
  for (size_t i = 0; i < a.files.size(); ++i) {
    const SourceFile &x = a.files[i], &y = b.files[i];
    EXPECT_EQ(x.path, y.path);
    EXPECT_EQ(x.size, y.size);
    EXPECT_EQ(x.mtime_ns, y.mtime_ns);
    EXPECT_EQ(x.ctime_ns, y.ctime_ns);
    EXPECT_EQ(x.inode, y.inode);
    EXPECT_EQ(x.version, y.version);
    EXPECT_EQ(x.transform, y.transform);
    EXPECT_EQ(x.base, y.base);
    EXPECT_EQ(x.base_offset, y.base_offset);
    EXPECT_EQ(x.base_length, y.base_length);
  }
  EXPECT_EQ(a.sidecars, b.sidecars);
  EXPECT_EQ(a.file_index, b.file_index);
  ASSERT_EQ(a.byte_items.size(), b.byte_items.size());
  for (const auto& [k, v] : a.byte_items) {
    ASSERT_TRUE(b.byte_items.count(k)) << k;
    EXPECT_EQ(v.file, b.byte_items.at(k).file);
    EXPECT_EQ(v.offset, b.byte_items.at(k).offset);
    EXPECT_EQ(v.length, b.byte_items.at(k).length);
  }
  EXPECT_EQ(a.problems, b.problems);
  EXPECT_EQ(a.incomplete, b.incomplete);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const TensorMeta &s = *a.tensors[i], &t = *b.tensors[i];
    EXPECT_EQ(s.fqn, t.fqn);
    EXPECT_EQ(s.path, t.path);
    EXPECT_EQ(s.dtype, t.dtype);
    EXPECT_EQ(s.shape, t.shape);
    EXPECT_EQ(s.problem, t.problem);
    ASSERT_EQ(s.chunks.size(), t.chunks.size()) << s.fqn;
    for (size_t k = 0; k < s.chunks.size(); ++k) {
      const Chunk &c = s.chunks[k], &d = t.chunks[k];
      EXPECT_EQ(c.box(), d.box());
      EXPECT_EQ(c.file(), d.file());
      EXPECT_EQ(c.offset(), d.offset());
      EXPECT_EQ(c.length(), d.length());
      EXPECT_EQ(c.dtype(), d.dtype());
      EXPECT_EQ(c.strides(), d.strides());
      EXPECT_EQ(c.unavailable(), d.unavailable());
      EXPECT_EQ(c.has_crc32c(), d.has_crc32c());
      EXPECT_EQ(c.crc32c(), d.crc32c());
      ASSERT_EQ(bool(c.item_check()), bool(d.item_check())) << s.fqn;
      if (c.item_check()) {
        // A predicted chunk comes back with its item, to be checked again.
        EXPECT_EQ(c.item_check()->item, d.item_check()->item);
        EXPECT_EQ(d.item_check()->predicted, d.bytes());
        EXPECT_EQ(d.item_check()->shape, d.box().lengths);
        EXPECT_EQ(d.item_check()->state(), ItemCheck::kUnchecked);
        EXPECT_TRUE(d.item_check()->verify);
        EXPECT_FALSE(d.item_check()->windows.empty());
      }
    }
  }
}

std::shared_ptr<const TensorMeta> Tensor(const std::string& fqn, DType dtype, Shape shape,
                                         std::vector<Chunk> chunks, std::vector<std::string> path = {}) {
  auto t = std::make_shared<TensorMeta>();
  t->fqn = fqn;
  t->dtype = dtype;
  t->shape = std::move(shape);
  t->path = std::move(path);
  for (Chunk& c : chunks) {
    c.set_dtype(dtype);
  }
  t->chunks = std::move(chunks);
  return t;
}

Chunk MakeChunk(Box box, FileId file, uint64_t offset, uint64_t length) {
  Chunk c;
  c.set_box(std::move(box));
  c.set_bytes({file, offset, length});
  return c;
}

SourceFile File(const std::string& path, uint64_t size, uint64_t inode) {
  SourceFile f;
  f.path = path;
  f.size = size;
  f.mtime_ns = 1'700'000'000'123'456'789 + int64_t(inode);
  f.ctime_ns = 1'700'000'001'000'000'000 + int64_t(inode);
  f.inode = inode;
  return f;
}

// A checkpoint using every field the rows carry.
Checkpoint FullCheckpoint(const std::string& dir) {
  const std::string p = dir.empty() ? "" : dir + "/";
  Checkpoint c;
  c.dir = dir;
  c.format = "dcp";
  c.files = {File(p + "__0_0.distcp", 4096, 11), File(p + "__1_0.distcp", 4096, 12), File(p + ".metadata", 300, 13),
             File(p + "config.json", 20, 14)};
  c.files[0].version = "\"9b2cf535f27731c974343645a3985328-2\"";  // an object's ETag
  SourceFile derived = c.files[1];
  derived.path += "@128";
  derived.size = 64;
  derived.transform = "zstd";
  derived.base = 1;
  derived.base_offset = 128;
  derived.base_length = 40;
  c.files.push_back(derived);
  Chunk strided = MakeChunk({{0, 2}, {4, 2}}, 1, 100, 32);
  strided.set_strides({1, 4});
  Chunk broken = MakeChunk({{2, 0}, {2, 4}}, 0, 700, 32);
  broken.set_unavailable("__0_0.distcp is truncated");
  Chunk crc = MakeChunk({{2, 2}, {2, 2}}, 4, 0, 16);
  crc.set_crc32c(0xdeadbeef);
  Chunk predicted = MakeChunk({{0}, {8}}, 0, 1216, 16);  // placed by prediction, its item at 512
  predicted.set_item_check(ItemCheckOf(predicted, {0, 512, 1700}, DType::kBF16));
  c.tensors = {
      Tensor("model.embed", DType::kBF16, {8}, {predicted}, {"model", "embed"}),
      Tensor("model.w", DType::kF32, {4, 4},
             {MakeChunk({{0, 0}, {2, 2}}, 0, 0, 16), strided, broken, crc}, {"model", "w"}),
      Tensor(std::string("odd\x01name", 8), DType::kI64, {}, {MakeChunk({{}, {}}, 1, 8, 8)}),
  };
  auto with_problem = std::make_shared<TensorMeta>(*c.tensors[0]);
  with_problem->fqn = "z.hole";
  with_problem->problem = "hole in [4:8]";
  c.tensors.push_back(with_problem);
  c.sidecars = {{"config.json", 3}};
  c.file_index = {{"model.embed", 1}, {"model.w", 2}};
  c.byte_items = {{"extra_state", {2, 10, 20}}};
  c.problems = {"__0_0.distcp is truncated"};
  c.incomplete = "";
  return c;
}

// A directory tree as {relative path: contents}; directories map to "/".
std::map<std::string, std::string> Snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  if (!fs::is_directory(dir)) {
    std::ifstream f(dir, std::ios::binary);
    out[""] = std::string(std::istreambuf_iterator<char>(f), {});
    return out;
  }
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string rel = fs::relative(e.path(), dir).string();
    if (e.is_directory()) {
      out[rel] = "/";
      continue;
    }
    std::ifstream f(e.path(), std::ios::binary);
    out[rel] = std::string(std::istreambuf_iterator<char>(f), {});
  }
  return out;
}

class StoreTest : public RootAndIndexTest {
 protected:
  StoreTest() : RootAndIndexTest("store") {}

  std::unique_ptr<Store> OpenOk(Access access, const std::string& index = "") {
    auto s = Store::Open(index.empty() ? index_ : index, root_, access);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(*s) : nullptr;
  }
};

TEST_F(StoreTest, CommitThenLoadGivesBackEveryField) {
  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store);
  const Checkpoint ckpt = FullCheckpoint("run/step_100");
  ASSERT_TRUE(store->Commit(ckpt).ok());
  auto loaded = store->Load("run/step_100");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ExpectSameCheckpoint(ckpt, *loaded);

  auto list = store->List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].dir, "run/step_100");
  EXPECT_EQ(list[0].format, "dcp");
  EXPECT_EQ(list[0].source, "scan");
  EXPECT_EQ(list[0].tensors, 4u);
  EXPECT_EQ(list[0].chunks, 7u);
  EXPECT_EQ(list[0].files, 5u);
  EXPECT_GT(list[0].committed_at_ns, 0);
}

TEST_F(StoreTest, RootCheckpointAndFilesOutsideTheDirectoryRoundTrip) {
  auto store = OpenOk(Access::kReadWrite);
  Checkpoint root = FullCheckpoint("");
  Checkpoint outside = FullCheckpoint("a/b");
  outside.files[3].path = "shared/config.json";  // a file the reader found outside a/b
  ASSERT_TRUE(store->Commit(root).ok());
  ASSERT_TRUE(store->Commit(outside).ok());
  auto a = store->Load("");
  auto b = store->Load("a/b");
  ASSERT_TRUE(a.ok() && b.ok());
  ExpectSameCheckpoint(root, *a);
  ExpectSameCheckpoint(outside, *b);
}

TEST(StoreRows, AVersionThatCouldNotGoOutInARequestHeaderIsRefused) {
  CheckpointEntry e;
  e.dir = "s";
  e.format = "dcp";
  e.files = 1;
  const std::string key = rows::FilesPrefix("s") + "a.distcp";
  auto row = [](const std::string& version) {
    return nlohmann::json{{"id", 0}, {"size", 1}, {"mtime_ns", 0}, {"ctime_ns", 0}, {"inode", 1}, {"version", version}}
        .dump();
  };
  rows::CheckpointDecoder plain(e, false);
  ASSERT_TRUE(plain.Add(key, row("\"abc\"")).ok());
  EXPECT_EQ(plain.TakeFiles().at(0).version, "\"abc\"");
  const std::vector<std::string> bad_versions = {"\"abc\"\r\nX-Injected: 1", std::string("\"a\0b\"", 5),
                                                 "\"caf\xc3\xa9\""};
  for (const std::string& bad : bad_versions) {
    rows::CheckpointDecoder d(e, false);
    EXPECT_EQ(d.Add(key, row(bad)).code(), Status::Code::kCorruption) << bad;
  }
}

// A predicted chunk's row carries its own layout number, so that a binary
// that predates predictions refuses the row instead of misreading the item
// that follows the chunk; a tensor with none keeps layout 1.
TEST(StoreRows, APredictedChunkIsWrittenUnderItsOwnRowLayout) {
  auto rows_or = rows::EncodeCheckpoint(FullCheckpoint("s"), rows::kSourceScan, 1);
  ASSERT_TRUE(rows_or.ok()) << rows_or.status().ToString();
  auto entry = rows::DecodeCheckpointRow(rows_or->back().key, rows_or->back().value);
  ASSERT_TRUE(entry.ok()) << entry.status().ToString();
  auto tensor_row = [&](const std::string& fqn) -> rows::Row& {
    const std::string tail = std::string(1, '\0') + "t" + fqn;
    for (rows::Row& r : *rows_or)
      if (r.key.size() >= tail.size() && r.key.compare(r.key.size() - tail.size(), tail.size(), tail) == 0) return r;
    ADD_FAILURE() << "no row for " << fqn;
    return rows_or->front();
  };
  EXPECT_EQ(tensor_row("model.w").value[0], char(1));
  rows::Row& predicted = tensor_row("model.embed");
  EXPECT_EQ(predicted.value[0], char(2));
  // The same bytes under layout 1 (what a writer that forgot the number
  // would leave): the flag is unknown there, and the row is refused.
  predicted.value[0] = char(1);
  rows::CheckpointDecoder d(*entry, false);
  Status st;
  for (const rows::Row& r : *rows_or)
    if (st.ok() && &r != &rows_or->back()) st = d.Add(r.key, r.value);
  EXPECT_EQ(st.code(), Status::Code::kCorruption);
  EXPECT_NE(st.message().find("unknown to row layout 1"), std::string::npos) << st.message();
}

TEST_F(StoreTest, DataReachesSstFilesAndSurvivesReopen) {
  {
    auto store = OpenOk(Access::kReadWrite);
    ASSERT_TRUE(store->Commit(FullCheckpoint("s1")).ok());
  }
  size_t ssts = 0;
  for (const auto& e : fs::directory_iterator(index_))
    if (e.path().extension() == ".sst") ++ssts;
  EXPECT_GE(ssts, 1u);  // not only in the write-ahead log
  auto store = OpenOk(Access::kReadOnly);
  ASSERT_TRUE(store);
  auto loaded = store->Load("s1");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ExpectSameCheckpoint(FullCheckpoint("s1"), *loaded);
}

TEST_F(StoreTest, ReindexingOneCheckpointLeavesOthersRowsUntouched) {
  auto store = OpenOk(Access::kReadWrite);
  for (const char* d : {"step_1", "step_10", "step_2"}) ASSERT_TRUE(store->Commit(FullCheckpoint(d)).ok());
  auto before1 = store->RawRows("step_1"), before2 = store->RawRows("step_2");
  ASSERT_TRUE(before1.ok() && before2.ok());
  ASSERT_GT(before1->size(), 5u);

  Checkpoint changed = FullCheckpoint("step_10");
  changed.tensors.pop_back();
  changed.tensors.erase(changed.tensors.begin());
  ASSERT_TRUE(store->Commit(changed).ok());

  auto after1 = store->RawRows("step_1"), after2 = store->RawRows("step_2");
  ASSERT_TRUE(after1.ok() && after2.ok());
  ASSERT_EQ(after1->size(), before1->size());
  ASSERT_EQ(after2->size(), before2->size());
  for (size_t i = 0; i < before1->size(); ++i) {
    EXPECT_EQ((*after1)[i].key, (*before1)[i].key);
    EXPECT_EQ((*after1)[i].value, (*before1)[i].value);
  }
  for (size_t i = 0; i < before2->size(); ++i) {
    EXPECT_EQ((*after2)[i].key, (*before2)[i].key);
    EXPECT_EQ((*after2)[i].value, (*before2)[i].value);
  }
  // The re-indexed one holds exactly its new rows: nothing left of the old.
  auto loaded = store->Load("step_10");
  ASSERT_TRUE(loaded.ok());
  ExpectSameCheckpoint(changed, *loaded);
}

TEST_F(StoreTest, RemoveDropsOnlyThatCheckpoint) {
  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store->Commit(FullCheckpoint("a")).ok());
  ASSERT_TRUE(store->Commit(FullCheckpoint("a/b")).ok());
  ASSERT_TRUE(store->Remove("a").ok());
  auto list = store->List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].dir, "a/b");
  EXPECT_EQ(store->Load("a").status().code(), Status::Code::kNotFound);
  auto raw = store->RawRows("a");
  ASSERT_TRUE(raw.ok());
  EXPECT_TRUE(raw->empty());
  EXPECT_TRUE(store->Load("a/b").ok());
}

TEST_F(StoreTest, RowsWithoutTheirCheckpointRowAreAbsent) {
  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store->Commit(FullCheckpoint("kept")).ok());
  ASSERT_TRUE(store->WriteRowsWithoutCheckpointRowForTesting(FullCheckpoint("new")).ok());
  // A checkpoint committed before, then rewritten by a commit that died
  // before its checkpoint row: absent, neither old nor mixed.
  ASSERT_TRUE(store->Commit(FullCheckpoint("old")).ok());
  Checkpoint newer = FullCheckpoint("old");
  newer.tensors.resize(1);
  ASSERT_TRUE(store->WriteRowsWithoutCheckpointRowForTesting(newer).ok());

  auto raw = store->RawRows("new");
  ASSERT_TRUE(raw.ok());
  EXPECT_GT(raw->size(), 3u);  // the rows are there...
  auto list = store->List();
  ASSERT_EQ(list.size(), 1u);  // ...but only "kept" exists
  EXPECT_EQ(list[0].dir, "kept");
  EXPECT_EQ(store->Load("new").status().code(), Status::Code::kNotFound);
  EXPECT_EQ(store->Load("old").status().code(), Status::Code::kNotFound);
}

TEST_F(StoreTest, DuplicateFqnOrPathIsRefusedNotMerged) {
  auto store = OpenOk(Access::kReadWrite);
  Checkpoint twice = FullCheckpoint("x");
  twice.tensors.push_back(twice.tensors[0]);
  EXPECT_EQ(store->Commit(twice).code(), Status::Code::kInvalidArgument);
  Checkpoint bad_file = FullCheckpoint("y");
  bad_file.files.push_back(bad_file.files[0]);
  EXPECT_EQ(store->Commit(bad_file).code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(store->List().empty());
}

// --- Directories that are not ours (issue: `--index` deleted a checkpoint) ---

TEST_F(StoreTest, RefusesANonEmptyDirectoryAndLeavesItByteIdentical) {
  fs::create_directories(dir_ / "ckpt" / "sub");
  std::ofstream(dir_ / "ckpt" / "model.safetensors") << "weights";
  std::ofstream(dir_ / "ckpt" / "sub" / "x") << "x";
  const auto before = Snapshot(dir_ / "ckpt");
  for (Access a : {Access::kReadWrite, Access::kReadOnly}) {
    auto s = Store::Open((dir_ / "ckpt").string(), root_, a);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), Status::Code::kInvalidArgument);
    EXPECT_NE(s.status().message().find("not a ckptfs index"), std::string::npos) << s.status().message();
  }
  EXPECT_EQ(Snapshot(dir_ / "ckpt"), before);
}

TEST_F(StoreTest, RefusesTheSourceRootItself) {
  std::ofstream(fs::path(root_) / "model.safetensors") << "weights";
  const auto before = Snapshot(root_);
  auto s = Store::Open(root_, root_, Access::kReadWrite);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(Snapshot(root_), before);
}

TEST_F(StoreTest, RefusesAFile) {
  std::ofstream(dir_ / "file") << "not an index";
  auto s = Store::Open((dir_ / "file").string(), root_, Access::kReadWrite);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.status().message().find("is a file"), std::string::npos) << s.status().message();
  EXPECT_EQ(Snapshot(dir_ / "file").at(""), "not an index");
}

TEST_F(StoreTest, RefusesTheStoreOfAnotherRoot) {
  { ASSERT_TRUE(OpenOk(Access::kReadWrite)); }
  auto s = Store::Open(index_, root_ + "-other", Access::kReadWrite);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(s.status().message().find("belongs to " + root_), std::string::npos) << s.status().message();
}

TEST_F(StoreTest, EmptyDirectoryBecomesAStoreWithItsMarker) {
  fs::create_directories(index_);
  { ASSERT_TRUE(OpenOk(Access::kReadWrite)); }
  std::ifstream marker(fs::path(index_) / kStoreMarker);
  auto j = nlohmann::json::parse(marker);
  EXPECT_EQ(j.at("schema"), 2);
  EXPECT_EQ(j.at("root"), root_);
  // Closed cleanly: nobody holds it.
  EXPECT_EQ(fs::file_size(fs::path(index_) / kStorePidFile), 0u);
}

TEST_F(StoreTest, ReadOnlyOpenOfNothingIsNotFoundAndCreatesNothing) {
  auto s = Store::Open(index_, root_, Access::kReadOnly);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), Status::Code::kNotFound);
  EXPECT_FALSE(fs::exists(index_));
}

TEST_F(StoreTest, DamagedDatabaseInsideAMarkedStoreIsRebuilt) {
  {
    auto store = OpenOk(Access::kReadWrite);
    ASSERT_TRUE(store->Commit(FullCheckpoint("a")).ok());
  }
  std::ofstream(fs::path(index_) / "CURRENT", std::ios::trunc) << "MANIFEST-999999\n";
  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store);
  ASSERT_EQ(store->notices().size(), 1u);
  EXPECT_NE(store->notices()[0].find("rebuilt"), std::string::npos) << store->notices()[0];
  EXPECT_TRUE(store->List().empty());
  ASSERT_TRUE(store->Commit(FullCheckpoint("a")).ok());
  EXPECT_TRUE(store->Load("a").ok());
}

// Damage inside a data block: Open reads only the tables' footers and
// indexes, so only a full checksum scan finds it.
TEST_F(StoreTest, DamagedBlockIsFoundByVerifyAndTheStoreRebuiltEmpty) {
  {
    auto store = OpenOk(Access::kReadWrite);
    for (int i = 0; i < 200; ++i) ASSERT_TRUE(store->Commit(FullCheckpoint("s" + std::to_string(i))).ok());
    EXPECT_TRUE(store->VerifyChecksums().ok());
    auto rebuilt = store->RebuildIfDamaged();
    ASSERT_TRUE(rebuilt.ok());
    EXPECT_FALSE(*rebuilt);  // a sound store is left alone
  }
  fs::path sst;
  for (const auto& e : fs::directory_iterator(index_))
    if (e.path().extension() == ".sst" && (sst.empty() || fs::file_size(e) > fs::file_size(sst))) sst = e.path();
  ASSERT_FALSE(sst.empty());
  const uint64_t size = fs::file_size(sst);
  ASSERT_GT(size, 16u * 1024);  // several data blocks before the index block
  {
    std::fstream f(sst, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(size / 4);
    f.write(std::string(64, '\xa5').data(), 64);
  }
  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store);
  EXPECT_TRUE(store->notices().empty());  // the open saw nothing
  EXPECT_EQ(store->VerifyChecksums().code(), Status::Code::kCorruption);
  auto rebuilt = store->RebuildIfDamaged();
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().ToString();
  EXPECT_TRUE(*rebuilt);
  ASSERT_EQ(store->notices().size(), 1u);
  EXPECT_NE(store->notices()[0].find("damaged"), std::string::npos) << store->notices()[0];
  EXPECT_TRUE(store->List().empty());
  EXPECT_TRUE(fs::exists(fs::path(index_) / kStoreMarker));
  ASSERT_TRUE(store->Commit(FullCheckpoint("s7")).ok());
  EXPECT_TRUE(store->VerifyChecksums().ok());
  auto loaded = store->Load("s7");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ExpectSameCheckpoint(FullCheckpoint("s7"), *loaded);
}

TEST_F(StoreTest, ReadOnlyStoreIsNeverRebuilt) {
  ASSERT_TRUE(OpenOk(Access::kReadWrite)->Commit(FullCheckpoint("a")).ok());
  auto store = OpenOk(Access::kReadOnly);
  EXPECT_EQ(store->RebuildIfDamaged().status().code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(store->VerifyChecksums().ok());
}

// --- Schema 1 ---

// tests/indexer/testdata/v1_index: an index written by ckptfs at 9d655c2
// (schema 1: meta/format, meta/root, meta/complete, file/, ckpt/, tensor/)
// for a one-tensor checkpoint; its LOG and LOCK files left out.
fs::path V1Fixture() { return fs::path(CKPTFS_SOURCE_DIR) / "tests/indexer/testdata/v1_index"; }

TEST_F(StoreTest, SchemaOneIndexIsRecognisedAndRebuilt) {
  fs::copy(V1Fixture(), index_, fs::copy_options::recursive);
  auto identity = [&] { return Snapshot(fs::path(index_) / "IDENTITY").at(""); };
  const std::string v1_identity = identity();
  auto ro = Store::Open(index_, root_, Access::kReadOnly);
  ASSERT_FALSE(ro.ok());
  EXPECT_EQ(ro.status().code(), Status::Code::kNotFound);
  EXPECT_NE(ro.status().message().find("schema 1"), std::string::npos) << ro.status().message();

  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store);
  EXPECT_TRUE(store->rebuilt_from_v1());
  ASSERT_EQ(store->notices().size(), 1u);
  EXPECT_NE(store->notices()[0].find("schema 1"), std::string::npos);
  EXPECT_TRUE(store->List().empty());
  EXPECT_TRUE(fs::exists(fs::path(index_) / kStoreMarker));
  EXPECT_NE(identity(), v1_identity);  // a new database, not the v1 one reopened
  ASSERT_TRUE(store->Commit(FullCheckpoint("a")).ok());
}

TEST_F(StoreTest, StaleSchemaOneTempDirsOfDeadProcessesAreRemoved) {
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // now a dead pid
  const fs::path dead = index_ + ".tmp." + std::to_string(child);
  const fs::path alive = index_ + ".tmp." + std::to_string(::getpid());
  fs::copy(V1Fixture(), dead, fs::copy_options::recursive);
  fs::copy(V1Fixture(), alive, fs::copy_options::recursive);
  const fs::path foreign = index_ + ".tmp.1x";
  fs::create_directories(foreign);
  std::ofstream(foreign / "keep") << "k";

  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(alive / "CURRENT"));  // its writer may still be running
  EXPECT_TRUE(fs::exists(foreign / "keep"));
  ASSERT_EQ(store->notices().size(), 1u);
  EXPECT_NE(store->notices()[0].find(dead.string()), std::string::npos) << store->notices()[0];
}

// --- One writer, many readers ---

TEST_F(StoreTest, SecondWriterIsBusyAndNamesTheHolder) {
  auto writer = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(writer);
  std::ifstream pidfile(fs::path(index_) / kStorePidFile);
  int pid = 0;
  pidfile >> pid;
  EXPECT_EQ(pid, ::getpid());
  auto second = Store::Open(index_, root_, Access::kReadWrite);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Status::Code::kBusy);
  EXPECT_NE(second.status().message().find("process " + std::to_string(::getpid())), std::string::npos)
      << second.status().message();
  writer.reset();
  EXPECT_TRUE(OpenOk(Access::kReadWrite));  // released on close
}

TEST_F(StoreTest, ReaderBesideAWriterSeesNewCommitsAfterCatchUp) {
  auto writer = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(writer->Commit(FullCheckpoint("step_100")).ok());
  auto reader = OpenOk(Access::kReadOnly);
  ASSERT_TRUE(reader);
  ASSERT_EQ(reader->List().size(), 1u);

  ASSERT_TRUE(writer->Commit(FullCheckpoint("step_200")).ok());
  ASSERT_TRUE(writer->Remove("step_100").ok());
  EXPECT_EQ(reader->List().size(), 1u);  // its view is the one it opened
  EXPECT_TRUE(reader->Load("step_100").ok());
  ASSERT_TRUE(reader->CatchUp().ok());
  auto list = reader->List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].dir, "step_200");
  auto loaded = reader->Load("step_200");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ExpectSameCheckpoint(FullCheckpoint("step_200"), *loaded);
  EXPECT_EQ(reader->Commit(FullCheckpoint("x")).code(), Status::Code::kInvalidArgument);
}

TEST_F(StoreTest, ReadOnlyOpensRacingCompactionsAllSucceed) {
  // A live mount ingests a record per saved step; every few ingests RocksDB
  // compacts and deletes the files a reader opening at that moment has just
  // read from the manifest. `ckptfs check` beside the mount must still open.
  auto writer = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(writer->Commit(FullCheckpoint("step_0")).ok());
  std::atomic<bool> done{false};
  std::thread saves([&] {
    for (int i = 1; i <= 120; ++i) {
      const std::string sst = (dir_ / ("r" + std::to_string(i) + ".sst")).string();
      if (!WriteCommitRecord(root_, FullCheckpoint("step_" + std::to_string(i)), sst).ok() ||
          !writer->Ingest(sst).ok())
        break;
    }
    done = true;
  });
  int opens = 0;
  std::string failure;
  while (!done && failure.empty()) {
    auto reader = Store::Open(index_, root_, Access::kReadOnly);
    if (!reader.ok()) failure = reader.status().ToString();
    ++opens;
  }
  saves.join();
  EXPECT_EQ(failure, "") << "after " << opens << " opens";
  EXPECT_EQ(writer->List().size(), 121u);
}

// --- Writers' commit records ---

TEST_F(StoreTest, IngestedCommitRecordEqualsWhatCommitStores) {
  const Checkpoint ckpt = FullCheckpoint("step_7");
  const std::string sst = (dir_ / "commit.sst").string();
  ASSERT_TRUE(WriteCommitRecord(root_, ckpt, sst).ok());

  auto ingested = OpenOk(Access::kReadWrite);
  auto committed = OpenOk(Access::kReadWrite, (dir_ / "index2").string());
  ASSERT_TRUE(ingested->Ingest(sst).ok());
  ASSERT_TRUE(committed->Commit(ckpt).ok());
  auto a = ingested->Load("step_7"), b = committed->Load("step_7");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok());
  ExpectSameCheckpoint(ckpt, *a);
  ExpectSameCheckpoint(*b, *a);
  EXPECT_EQ(ingested->List().at(0).source, "writer");

  // Same data rows, byte for byte; the checkpoint rows differ in source and time.
  auto ra = ingested->RawRows("step_7"), rb = committed->RawRows("step_7");
  ASSERT_TRUE(ra.ok() && rb.ok());
  ASSERT_EQ(ra->size(), rb->size());
  for (size_t i = 1; i < ra->size(); ++i) {
    EXPECT_EQ((*ra)[i].key, (*rb)[i].key);
    EXPECT_EQ((*ra)[i].value, (*rb)[i].value);
  }
  EXPECT_TRUE(fs::exists(sst));  // the record stays with its checkpoint
}

TEST_F(StoreTest, IngestReplacesTheCheckpointsOldRows) {
  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store->Commit(FullCheckpoint("s")).ok());
  Checkpoint smaller = FullCheckpoint("s");
  smaller.tensors.resize(1);
  smaller.file_index.clear();
  const std::string sst = (dir_ / "commit.sst").string();
  ASSERT_TRUE(WriteCommitRecord(root_, smaller, sst).ok());
  ASSERT_TRUE(store->Ingest(sst).ok());
  auto loaded = store->Load("s");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ExpectSameCheckpoint(smaller, *loaded);
}

TEST_F(StoreTest, CommitRecordInsideACheckpointTakesThatCheckpointsPlace) {
  // The writer saw root_/run1 as its root; this store indexes root_.
  const std::string writer_root = root_ + "/run1";
  fs::create_directories(writer_root + "/step_5/.ckptfs");
  Checkpoint ckpt = FullCheckpoint("step_5");
  ASSERT_TRUE(WriteCommitRecord(writer_root, ckpt, writer_root + "/step_5/.ckptfs/commit.sst").ok());
  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store->Ingest(writer_root + "/step_5/.ckptfs/commit.sst").ok());
  auto list = store->List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].dir, "run1/step_5");
  auto loaded = store->Load("run1/step_5");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  Checkpoint expected = FullCheckpoint("run1/step_5");
  ExpectSameCheckpoint(expected, *loaded);
}

TEST_F(StoreTest, CommitRecordNamingFilesOutsideItsCheckpointIsRefused) {
  auto store = OpenOk(Access::kReadWrite);
  Checkpoint escape = FullCheckpoint("a");
  escape.files[0].path = "a/../../../etc/passwd";
  ASSERT_TRUE(WriteCommitRecord(root_, escape, (dir_ / "1.sst").string()).ok());
  Status s = store->Ingest((dir_ / "1.sst").string());
  EXPECT_EQ(s.code(), Status::Code::kCorruption);
  EXPECT_NE(s.message().find("not a plain path"), std::string::npos) << s.message();

  Checkpoint sibling = FullCheckpoint("a");
  sibling.files[0].path = "b/__0_0.distcp";
  ASSERT_TRUE(WriteCommitRecord(root_, sibling, (dir_ / "2.sst").string()).ok());
  EXPECT_EQ(store->Ingest((dir_ / "2.sst").string()).code(), Status::Code::kCorruption);
  EXPECT_TRUE(store->List().empty());
}

TEST_F(StoreTest, DumpPrintsEveryRowDecoded) {
  auto store = OpenOk(Access::kReadWrite);
  ASSERT_TRUE(store->Commit(FullCheckpoint("d")).ok());
  std::ostringstream out;
  ASSERT_TRUE(store->Dump(out).ok());
  std::istringstream lines(out.str());
  std::string line;
  std::map<std::string, nlohmann::json> rows;
  while (std::getline(lines, line)) {
    auto j = nlohmann::json::parse(line);
    rows[j.at("key").get<std::string>()] = j.at("value");
  }
  EXPECT_EQ(rows.at("meta/root"), root_);
  EXPECT_EQ(rows.at("meta/format").at("schema"), 2);
  EXPECT_EQ(rows.at("c/d").at("tensors"), 4);
  const auto& w = rows.at(std::string("d/d\0tmodel.w", 12));
  EXPECT_EQ(w.at("dtype"), "F32");
  EXPECT_EQ(w.at("chunks").size(), 4u);
  EXPECT_EQ(w.at("chunks")[1].at("strides"), nlohmann::json({1, 4}));
  EXPECT_EQ(w.at("chunks")[3].at("crc32c"), 0xdeadbeefu);
  EXPECT_TRUE(rows.count(std::string("d/d\0v00000002/model.w", 21)));
}

}  // namespace
}  // namespace ckptfs
