#include "core/coverage.h"

#include <algorithm>
#include <set>

namespace ckptfs {
namespace {

// The chunks' boxes, unpacked once for the pairwise checks.
std::vector<Box> BoxesOf(const TensorMeta& t) {
  std::vector<Box> boxes;
  boxes.reserve(t.chunks.size());
  for (const Chunk& c : t.chunks) boxes.push_back(c.box());
  return boxes;
}

// Bytes a chunk's stored layout spans: the last element's offset + 1;
// nullopt when that overflows (hostile strides).
std::optional<uint64_t> StoredBytes(const Chunk& c, DType dtype) {
  const Box b = c.box();
  if (b.numel() == 0) return 0;
  if (c.strides().empty()) return ByteSize(dtype, b.numel());
  uint64_t last = 0;
  for (size_t i = 0; i < b.rank(); ++i) {
    const uint64_t step = b.lengths[i] - 1, stride = c.strides()[i];
    if (stride != 0 && step > (UINT64_MAX - last) / stride) return std::nullopt;
    last += step * stride;
  }
  if (last == UINT64_MAX) return std::nullopt;
  return ByteSize(dtype, last + 1);
}

// Finds an uncovered cell of the grid formed by all chunk edges. The cells
// partition the tensor, and each is either wholly inside a chunk or wholly
// outside all of them, so checking one point per cell is exact. The grid can
// be large for pathological inputs, so the search is capped.
std::optional<Box> FindHole(const TensorMeta& t) {
  const std::vector<Box> boxes = BoxesOf(t);
  size_t rank = t.shape.size();
  std::vector<std::vector<uint64_t>> edges(rank);
  for (size_t d = 0; d < rank; ++d) {
    std::set<uint64_t> e{0, t.shape[d]};
    for (const Box& b : boxes) {
      e.insert(b.offsets[d]);
      e.insert(b.offsets[d] + b.lengths[d]);
    }
    for (uint64_t x : e)
      if (x <= t.shape[d]) edges[d].push_back(x);
  }
  std::vector<size_t> idx(rank, 0);
  for (size_t visited = 0; visited < 1'000'000; ++visited) {
    Box cell;
    for (size_t d = 0; d < rank; ++d) {
      cell.offsets.push_back(edges[d][idx[d]]);
      cell.lengths.push_back(edges[d][idx[d] + 1] - edges[d][idx[d]]);
    }
    if (!cell.empty()) {
      bool covered = std::any_of(boxes.begin(), boxes.end(), [&](const Box& b) { return Contains(b, cell); });
      if (!covered) return cell;
    }
    size_t d = rank;
    while (d > 0) {
      --d;
      if (++idx[d] + 1 < edges[d].size()) break;
      idx[d] = 0;
      if (d == 0) return std::nullopt;
    }
    if (rank == 0) return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> ChunkBytesProblem(const Chunk& c, DType dtype) {
  auto need = StoredBytes(c, dtype);
  if (need && *need <= c.length()) return std::nullopt;
  return " needs " + (need ? std::to_string(*need) : std::string("overflowing")) + " bytes but its item holds " +
         std::to_string(c.length());
}

std::vector<std::string> CheckCoverage(const TensorMeta& t) {
  std::vector<std::string> problems;
  const std::string who = "tensor '" + t.fqn + "' " + ShapeToString(t.shape);
  auto numel = CheckedNumel(t.shape);
  if (!numel || !ByteSize(t.dtype, *numel)) {
    problems.push_back(who + ": size overflows or is not a whole number of bytes");
    return problems;
  }
  uint64_t covered = 0;
  const std::vector<Box> boxes = BoxesOf(t);
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const Chunk& c = t.chunks[i];
    const std::string where = who + ": chunk " + ToString(boxes[i]);
    if (!InBounds(boxes[i], t.shape)) {
      problems.push_back(where + " lies outside the tensor");
      continue;
    }
    if (c.dtype() != t.dtype) {
      problems.push_back(where + " has dtype " + std::string(DTypeName(c.dtype())) +
                         ", tensor has " + std::string(DTypeName(t.dtype)));
    }
    if (auto short_by = ChunkBytesProblem(c, t.dtype)) problems.push_back(where + *short_by);
    covered += boxes[i].numel();
  }
  if (!problems.empty()) return problems;
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    for (size_t j = i + 1; j < t.chunks.size(); ++j) {
      const Box& a = boxes[i];
      const Box& b = boxes[j];
      if (a.offsets == b.offsets && a.lengths != b.lengths) {
        problems.push_back(who + ": replicas at offsets " + ToString(a) + " and " + ToString(b) +
                           " disagree in shape");
        return problems;
      }
      if (auto o = Intersect(a, b)) {
        problems.push_back(who + ": chunks " + ToString(a) + " and " + ToString(b) + " overlap in " + ToString(*o));
        return problems;
      }
    }
  }
  if (covered != *numel) {
    std::string msg = who + ": " + std::to_string(*numel - covered) + " of " +
                      std::to_string(*numel) + " elements are in no chunk (missing shard?)";
    if (auto hole = FindHole(t)) msg += ", e.g. " + ToString(*hole);
    problems.push_back(msg);
  }
  return problems;
}

size_t DropReplicas(TensorMeta& t) {
  size_t before = t.chunks.size();
  std::vector<Chunk> kept;
  std::vector<Box> kept_boxes;
  for (Chunk& c : t.chunks) {
    Box b = c.box();
    if (std::find(kept_boxes.begin(), kept_boxes.end(), b) != kept_boxes.end()) continue;
    kept_boxes.push_back(std::move(b));
    kept.push_back(std::move(c));
  }
  t.chunks = std::move(kept);
  return before - t.chunks.size();
}

}  // namespace ckptfs
