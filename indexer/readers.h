// Helpers the format readers (one .cc each, registered in
// indexer/formats.cc) share.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/meta.h"
#include "indexer/format_reader.h"

namespace ckptfs {

// Registers every file of the checkpoint's model folder that is not a weight
// as out.sidecars (config, tokenizer, sentencepiece models, chat templates,
// remote-code *.py, sentence-transformers' modules.json and 1_Pooling/...),
// named by their path below the folder: `<dir>/.hf_metadata/` (NeMo) first,
// then `<dir>/`. Left out: hidden entries, weight files and shard indexes
// (consolidated/ serves its own), and subfolders holding weights (another
// checkpoint), except the module folders modules.json names, which pass
// through whole.
void AddSidecarFiles(const DirListing& dir, FileTable& files, Checkpoint& out);

// Records a problem on `out`; `incomplete` also marks the tensor list
// untrustworthy (views fail) when nothing has yet.
void AddProblem(Checkpoint& out, const std::string& message, bool incomplete);

// True, and kept on `files` (FileTable::NoteReadFailure: it fails this
// indexing of the checkpoint), when `st` says a source could not be read
// now (I/O, a server's failure after its retries, a change while indexing,
// a refusal) rather than something about the checkpoint's bytes: retried
// later, it may read.
bool NoteReadFailure(FileTable& files, const Status& st);

// A failed read of the checkpoint's sources, with `context`: a read
// failure goes to `files` (NoteReadFailure) and
// fails this indexing of the checkpoint, so that it is never stored as a
// lasting problem; any other failure is a problem, as AddProblem records.
void AddReadProblem(Checkpoint& out, FileTable& files, const std::string& context, const Status& st,
                    bool incomplete);

// Strides matching the row-major layout of `shape` (ignoring dims of length
// 1, whose stride never matters) come back empty, so the planner can merge
// rows into long runs; others are kept.
std::vector<uint64_t> NormalizeStrides(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& strides);

// The distinct file names a Hugging Face index (`model.safetensors.index.json`,
// `pytorch_model.bin.index.json`) maps tensors to; fills *weight_map when
// given. A missing or malformed weight_map is recorded on `out` as making the
// checkpoint incomplete.
std::vector<std::string> IndexedFiles(FileTable& files, const DirListing& dir, const std::string& index_name,
                                      Checkpoint& out, std::map<std::string, std::string>* weight_map = nullptr);

// Drops replicated chunks, runs the coverage check (recording each tensor's
// problem on it and on `out`), and moves the tensors into out.tensors; a
// tensor whose byte size overflows 64 bits is left out instead, and `out`
// is incomplete.
void FinishTensors(std::map<std::string, TensorMeta>& tensors, Checkpoint& out);

// Reads {fqn: 1-based file index} (NeMo's fqn_to_file_index_mapping.json, or
// a mapping given on the command line) into out.file_index: from the local
// file `path`, or from `text` (named `what` in errors).
Status LoadFileIndexMapping(const std::string& path, Checkpoint& out);
Status ParseFileIndexMapping(const std::string& text, const std::string& what, Checkpoint& out);

}  // namespace ckptfs
