#include "core/planner.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

namespace ckptfs {
namespace {

// Sorts v by `less`, cheaply when it is a few ascending runs, as the
// planner's lists are (one run per chunk of a tensor, or per source file):
// the natural runs are found and merged pairwise, O(n log runs) instead of
// std::sort's O(n log n) (planning was ~19 % of the daemon's CPU on a
// DCP-sourced file cut in rows of a few KiB, docs/BENCHMARKS.md).
template <typename T, typename Less>
void SortRuns(std::vector<T>& v, Less less) {
  std::vector<size_t> bounds{0};
  for (size_t i = 1; i < v.size(); ++i)
    if (less(v[i], v[i - 1])) bounds.push_back(i);
  bounds.push_back(v.size());
  while (bounds.size() > 2) {
    std::vector<size_t> next{0};
    for (size_t k = 2; k < bounds.size(); k += 2) {
      std::inplace_merge(v.begin() + bounds[k - 2], v.begin() + bounds[k - 1], v.begin() + bounds[k], less);
      next.push_back(bounds[k]);
    }
    if (bounds.size() % 2 == 0) next.push_back(bounds.back());  // an odd run out
    bounds = std::move(next);
  }
}

// Where a chunk's bytes are, as this plan uses them: a predicted chunk
// (ItemCheck) whose item was found otherwise is planned as found, and one
// not checked yet as predicted, its copies marked speculative. Taken once
// per chunk and plan: the check may settle meanwhile.
struct Placement {
  uint64_t offset = 0;
  const std::vector<uint64_t>* strides = nullptr;
  const std::string* unavailable = nullptr;
  ItemCheck* speculative = nullptr;
};

Placement PlacementOf(const Chunk& c) {
  ItemCheck* k = c.item_check().get();
  const ItemCheck::State state = k ? k->state() : ItemCheck::kVerified;
  if (state == ItemCheck::kWrong) return {k->actual().offset, &k->actual_strides(), &k->why(), nullptr};
  return {c.offset(), &c.strides(), &c.unavailable(), state == ItemCheck::kUnchecked ? k : nullptr};
}

// A tensor region re-expressed in "units": the smallest whole-byte groups of
// elements (one element for byte-sized dtypes, 2 for F4, 4 for F6_*).
struct UnitGeometry {
  uint64_t unit_bytes = 0;
  Box target;
  std::vector<Box> chunks;                      // parallel to TensorMeta::chunks
  std::vector<std::vector<uint64_t>> strides;   // unit strides per chunk
  std::vector<Placement> placed;                // parallel to TensorMeta::chunks
};

bool IsSlab(const Box& b, const Shape& shape) {
  for (size_t d = 1; d < shape.size(); ++d)
    if (b.offsets[d] != 0 || b.lengths[d] != shape[d]) return false;
  return true;
}

Result<UnitGeometry> ToUnits(const TensorMeta& t, const Box& target) {
  UnitGeometry u;
  const uint64_t g = PackGroup(t.dtype);
  u.unit_bytes = PackBytes(t.dtype);
  for (const Chunk& c : t.chunks) u.placed.push_back(PlacementOf(c));
  if (g == 1) {
    u.target = target;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      u.chunks.push_back(t.chunks[i].box());
      const std::vector<uint64_t>& s = *u.placed[i].strides;
      u.strides.push_back(s.empty() ? RowMajorStrides(u.chunks.back().lengths) : s);
    }
    return u;
  }
  // Packed sub-byte dtype: only row-major chunks whose edges fall on byte
  // boundaries can be sliced.
  for (const Placement& p : u.placed)
    if (!p.strides->empty())
      return Status::NotSupported("strided chunk of packed dtype " + std::string(DTypeName(t.dtype)));
  std::vector<Box> boxes{target};
  for (const Chunk& c : t.chunks) boxes.push_back(c.box());
  const size_t n = t.shape.size();
  auto divisible = [&](const Box& b, size_t d) {
    return b.offsets[d] % g == 0 && b.lengths[d] % g == 0;
  };
  bool inner_ok = n > 0 && t.shape[n - 1] % g == 0 &&
                  std::all_of(boxes.begin(), boxes.end(), [&](const Box& b) { return divisible(b, n - 1); });
  if (inner_ok) {
    for (Box& b : boxes) {
      b.offsets[n - 1] /= g;
      b.lengths[n - 1] /= g;
    }
  } else {
    // Row slabs of the flattened tensor: view it as 1-d.
    bool slabs = n > 0 && std::all_of(boxes.begin(), boxes.end(),
                                      [&](const Box& b) { return IsSlab(b, t.shape); });
    uint64_t inner = 1;
    for (size_t d = 1; d < n; ++d) inner *= t.shape[d];
    for (Box& b : boxes) {
      if (!slabs) break;
      b = Box{{b.offsets[0] * inner}, {b.lengths[0] * inner}};
      slabs = divisible(b, 0);
      b.offsets[0] /= g;
      b.lengths[0] /= g;
    }
    if (!slabs)
      return Status::NotSupported("tensor '" + t.fqn + "' of packed dtype " +
                                  std::string(DTypeName(t.dtype)) +
                                  " is sharded or sliced off byte boundaries");
  }
  u.target = boxes[0];
  for (size_t i = 1; i < boxes.size(); ++i) {
    u.chunks.push_back(boxes[i]);
    u.strides.push_back(RowMajorStrides(boxes[i].lengths));
  }
  return u;
}

// Appends the copies that fill bytes [a, b) of the region `target` (region
// byte coordinates) from one chunk. `dst_base` maps region byte p to
// destination offset p + dst_base (may wrap; only differences are used).
Status PlanChunk(const UnitGeometry& g, size_t ci, const std::vector<uint64_t>& tstride,
                 const Chunk& chunk, uint64_t a, uint64_t b, uint64_t dst_base,
                 std::vector<CopyOp>& out) {
  const Box& T = g.target;
  const Box& C = g.chunks[ci];
  const std::vector<uint64_t>& cs = g.strides[ci];
  const Placement& place = g.placed[ci];
  auto I = Intersect(T, C);
  if (!I && T.rank() > 0) return Status::OK();
  const size_t n = T.rank();
  const uint64_t unit = g.unit_bytes;

  // Merge trailing dimensions while the run stays contiguous in both target
  // and source.
  size_t nd = n;
  uint64_t run = 1;
  if (n > 0 && cs[n - 1] == 1) {
    nd = n - 1;
    run = I->lengths[n - 1];
    while (nd > 0 && tstride[nd - 1] == run && cs[nd - 1] == run) {
      run *= I->lengths[nd - 1];
      --nd;
    }
  }
  uint64_t tbase = 0, sbase = 0, nruns = 1;
  for (size_t j = 0; j < n; ++j) {
    tbase += (I->offsets[j] - T.offsets[j]) * tstride[j];
    sbase += (I->offsets[j] - C.offsets[j]) * cs[j];
  }
  for (size_t j = 0; j < nd; ++j) nruns *= I->lengths[j];

  std::vector<uint64_t> m(nd, 0);
  auto position = [&](uint64_t r, uint64_t* ts, uint64_t* ss) {
    *ts = tbase;
    *ss = sbase;
    for (size_t j = nd; j-- > 0;) {
      m[j] = r % I->lengths[j];
      r /= I->lengths[j];
      *ts += m[j] * tstride[j];
      *ss += m[j] * cs[j];
    }
  };
  // First run whose end lies past `a` (runs are increasing in the target).
  uint64_t lo = 0, hi = nruns, ts, ss;
  while (lo < hi) {
    uint64_t mid = lo + (hi - lo) / 2;
    position(mid, &ts, &ss);
    if ((ts + run) * unit <= a) lo = mid + 1; else hi = mid;
  }
  if (lo == nruns) return Status::OK();
  position(lo, &ts, &ss);
  for (uint64_t r = lo; r < nruns; ++r) {
    uint64_t rb = ts * unit, re = (ts + run) * unit;
    if (rb >= b) break;
    if (!place.unavailable->empty())
      return Status::Incomplete("chunk " + ToString(chunk.box()) + ": " + *place.unavailable);
    uint64_t from = std::max(a, rb), to = std::min(b, re);
    out.push_back({chunk.file(), place.offset + ss * unit + (from - rb), from + dst_base, to - from, false,
                   place.speculative});
    // Odometer step over the outer dimensions.
    for (size_t j = nd; j-- > 0;) {
      if (++m[j] < I->lengths[j]) {
        ts += tstride[j];
        ss += cs[j];
        break;
      }
      m[j] = 0;
      ts -= (I->lengths[j] - 1) * tstride[j];
      ss -= (I->lengths[j] - 1) * cs[j];
    }
  }
  return Status::OK();
}

Status PlanTensor(const Segment& seg, uint64_t a, uint64_t b, uint64_t dst_base,
                  std::vector<CopyOp>& out) {
  const TensorMeta& t = *seg.tensor;
  if (!t.problem.empty()) return Status::Incomplete(t.problem);
  ASSIGN_OR_RETURN(UnitGeometry g, ToUnits(t, seg.box));
  const std::vector<uint64_t> tstride = RowMajorStrides(g.target.lengths);
  for (size_t i = 0; i < t.chunks.size(); ++i)
    RETURN_IF_ERROR(PlanChunk(g, i, tstride, t.chunks[i], a, b, dst_base, out));
  return Status::OK();
}

// Bytes [a, b) of a tensor segment whose dtype is converted on read
// (s.convert): the whole packed units of the source dtype under those
// output elements are gathered into scratch and decoded there into `dst`.
Status PlanConverted(const Segment& s, uint64_t a, uint64_t b, uint64_t dst, ReadPlan& plan) {
  const uint64_t out_size = DTypeBits(s.as) / 8;
  const uint64_t g = PackGroup(s.tensor->dtype), pb = PackBytes(s.tensor->dtype);
  const uint64_t ea = a / out_size, eb = (b + out_size - 1) / out_size;
  const uint64_t ua = ea / g, ub = (eb + g - 1) / g;
  const uint64_t sa = ua * pb, sb = ub * pb;
  const size_t first_new = plan.copies.size();
  Status st = PlanTensor(s, sa, sb, plan.scratch_size - sa, plan.copies);
  for (size_t i = first_new; i < plan.copies.size(); ++i) plan.copies[i].to_scratch = true;
  plan.converts.push_back({s.tensor->dtype, plan.scratch_size, ea - ua * g, eb - ea, dst, a - ea * out_size, b - a});
  plan.scratch_size += sb - sa;
  return st;
}

// Bytes [a, b) of segment `s`, landing at `dst` of the plan's output.
Status PlanSegment(const Segment& s, uint64_t a, uint64_t b, uint64_t dst, ReadPlan& plan) {
  switch (s.kind) {
    case Segment::Kind::kLiteral:
      plan.literals.push_back({s.literal->data() + a, dst, b - a});
      return Status::OK();
    case Segment::Kind::kSource:
      plan.copies.push_back({s.file, s.file_offset + a, dst, b - a});
      return Status::OK();
    case Segment::Kind::kComputed:
      plan.computes.push_back({s.computed.get(), a, dst, b - a});
      return Status::OK();
    case Segment::Kind::kTensor: {
      Status st = s.convert ? PlanConverted(s, a, b, dst, plan) : PlanTensor(s, a, b, dst - a, plan.copies);
      return st.ok() ? st : st.WithContext("tensor '" + s.tensor->fqn + "'");
    }
  }
  return Status::OK();
}

// Copies in destination order (scratch last), neighbours in both source
// and destination joined into one.
std::vector<CopyOp> MergeCopies(std::vector<CopyOp> copies) {
  SortRuns(copies, [](const CopyOp& x, const CopyOp& y) {
    return x.to_scratch != y.to_scratch ? y.to_scratch : x.dst_offset < y.dst_offset;
  });
  std::vector<CopyOp> merged;
  for (const CopyOp& c : copies) {
    if (!merged.empty()) {
      CopyOp& p = merged.back();
      if (p.file == c.file && p.to_scratch == c.to_scratch && p.speculative == c.speculative &&
          p.src_offset + p.length == c.src_offset &&
          p.dst_offset + p.length == c.dst_offset) {
        p.length += c.length;
        continue;
      }
    }
    merged.push_back(c);
  }
  return merged;
}

// The plan must fill every byte of the output ([offset, end) of the
// layout), and of scratch, exactly once.
Status CheckCoverage(const ReadPlan& plan, uint64_t offset, uint64_t end) {
  std::vector<std::pair<uint64_t, uint64_t>> spans, scratch;
  for (const auto& c : plan.copies) (c.to_scratch ? scratch : spans).emplace_back(c.dst_offset, c.length);
  for (const auto& l : plan.literals) spans.emplace_back(l.dst_offset, l.length);
  for (const auto& v : plan.converts) spans.emplace_back(v.dst_offset, v.length);
  for (const auto& c : plan.computes) spans.emplace_back(c.dst_offset, c.length);
  for (auto* list : {&spans, &scratch}) {
    SortRuns(*list, std::less<std::pair<uint64_t, uint64_t>>());
    const uint64_t want = list == &spans ? plan.length : plan.scratch_size;
    uint64_t at = 0;
    for (const auto& [d, l] : *list) {
      if (d != at) break;
      at += l;
    }
    if (at != want)
      return Status::Incomplete("bytes " + std::to_string(offset + at) + ".." + std::to_string(end) +
                                " are in no chunk, or in two");
  }
  return Status::OK();
}

}  // namespace

Result<ReadPlan> Plan(const Layout& layout, uint64_t offset, uint64_t length) {
  ReadPlan plan;
  if (offset >= layout.size()) return plan;
  length = std::min(length, layout.size() - offset);
  plan.length = length;
  const uint64_t end = offset + length;
  const auto& segs = layout.segments();
  for (auto it = segs.begin() + layout.SegmentAt(offset); it != segs.end() && it->offset < end; ++it) {
    const Segment& s = *it;
    uint64_t a = std::max(offset, s.offset) - s.offset;
    uint64_t b = std::min(end, s.offset + s.length) - s.offset;
    if (a < b) RETURN_IF_ERROR(PlanSegment(s, a, b, s.offset + a - offset, plan));
  }
  plan.copies = MergeCopies(std::move(plan.copies));
  RETURN_IF_ERROR(CheckCoverage(plan, offset, end));
  return plan;
}

std::vector<SourceRead> GroupReads(const std::vector<CopyOp>& copies, const GroupPolicy& policy) {
  // By file, then source offset. A plan's copies come in destination order,
  // which interleaves the files of a column-sharded tensor row by row but
  // keeps each file's copies ascending: grouped by file first (stably), they
  // are a few runs.
  std::vector<CopyOp> sorted = copies;
  std::stable_sort(sorted.begin(), sorted.end(), [](const CopyOp& x, const CopyOp& y) { return x.file < y.file; });
  SortRuns(sorted, [](const CopyOp& x, const CopyOp& y) {
    return x.file != y.file ? x.file < y.file : x.src_offset < y.src_offset;
  });
  std::vector<SourceRead> reads;
  for (const CopyOp& c : sorted) {
    if (!reads.empty()) {
      SourceRead& r = reads.back();
      uint64_t r_end = r.offset + r.length;
      uint64_t c_end = c.src_offset + c.length;
      if (r.file == c.file && c.src_offset <= r_end + policy.max_gap &&
          std::max(r_end, c_end) - r.offset <= policy.max_span) {
        r.length = std::max(r_end, c_end) - r.offset;
        r.gathers.push_back({c.src_offset - r.offset, c.dst_offset, c.length, c.to_scratch});
        continue;
      }
    }
    reads.push_back({c.file, c.src_offset, c.length, {{0, c.dst_offset, c.length, c.to_scratch}}});
  }
  return reads;
}

}  // namespace ckptfs
