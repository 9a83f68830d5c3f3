// The format registry (indexer/format_reader.h): the one list of formats.
#include <string>

#include "indexer/format_reader.h"

namespace ckptfs {

// Each defined in its reader's .cc (indexer/<format>_reader.cc).
std::unique_ptr<FormatReader> MakeByteCheckpointReader();
std::unique_ptr<FormatReader> MakeSafetensorsReader();
std::unique_ptr<FormatReader> MakeDcpReader();
std::unique_ptr<FormatReader> MakeTorchSaveReader();

const std::vector<FormatEntry>& Formats() {
  // Order matters: a folder with both safetensors and .bin files (common on
  // the Hub) is read as safetensors; a DCP folder's common.pt is not a
  // torch.save checkpoint of its own.
  static const std::vector<FormatEntry> kFormats = {
      {"bytecheckpoint", "ByteCheckpoint (model/ or optimizer/ with its .metadata)", MakeByteCheckpointReader},
      {"safetensors", "*.safetensors folders", MakeSafetensorsReader},
      {"dcp", "PyTorch DCP and Megatron torch_dist (.metadata + *.distcp)", MakeDcpReader},
      {"torch-save", "torch.save files (pytorch_model*.bin, *.pt, *.pth, *.ckpt)", MakeTorchSaveReader},
  };
  return kFormats;
}

std::vector<std::unique_ptr<FormatReader>> AllReaders() {
  std::vector<std::unique_ptr<FormatReader>> readers;
  for (const FormatEntry& f : Formats()) readers.push_back(f.make());
  return readers;
}

std::string DescribeRecognised() {
  std::string out;
  for (const FormatEntry& f : Formats()) out += (out.empty() ? "" : "; ") + std::string(f.recognises);
  return out;
}

}  // namespace ckptfs
