// The merge Computation of core/lora.h: W + scaling * B @ A in float32,
// a block of output rows at a time.
#include <cmath>
#include <cstring>

#include <Eigen/Core>

#include "core/cast.h"
#include "core/convert.h"
#include "core/lora.h"

namespace ckptfs {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// What one block of a merge may need, in fp32 (see CheckShapes).
constexpr uint64_t kMaxMergeRowBytes = 256ull << 20;

std::string ShapeText(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Matrix Decode(const TensorMeta& t, const BlockBytes& bytes, uint64_t rows, uint64_t cols) {
  Matrix m(rows, cols);
  DecodeToFloat32(t.dtype, reinterpret_cast<const uint8_t*>(bytes.data()), 0, rows * cols, m.data());
  return m;
}

// `w` stored as `to`.
BlockBytes Encode(const Matrix& w, DType to) {
  const uint64_t n = uint64_t(w.size());
  BlockBytes out(ByteSize(to, n).value_or(0));
  if (to == DType::kF32) {
    std::memcpy(out.data(), w.data(), out.size());
  } else {
    CastElements(DType::kF32, to, reinterpret_cast<const uint8_t*>(w.data()), n, reinterpret_cast<uint8_t*>(out.data()));
  }
  return out;
}

class LoraMerge : public Computation {
 public:
  LoraMerge(LoraTerm t, DType to) : t_(std::move(t)), to_(to) {
    rows_ = t_.base->shape[0];
    cols_ = t_.base->shape.size() > 1 ? t_.base->shape[1] : 1;
    rank_ = t_.a ? t_.a->shape[0] : 0;
  }
  DType dtype() const override { return to_; }
  const Shape& shape() const override { return t_.base->shape; }
  std::string what() const override {
    return "LoRA merge of '" + t_.base->fqn + "' with '" + t_.b->fqn + "'";
  }

  // DoRA normalises whole rows; CheckShapes bounds a row's inputs.
  bool KeepsRowsWhole() const override { return true; }

  std::vector<ComputeInput> InputsOf(uint64_t blk) const override {
    uint64_t first, count;
    Rows(blk, &first, &count);
    std::vector<ComputeInput> in;
    if (!t_.a) {  // a bias: base + scaling * lora_B.bias
      in.push_back({t_.base, Box{{first}, {count}}});
      in.push_back({t_.b, Box{{first}, {count}}});
      return in;
    }
    in.push_back({t_.base, Box{{first, 0}, {count, cols_}}});
    if (t_.transposed) {
      // Output row i is input feature i: column i of A, all of B.
      in.push_back({t_.a, Box{{0, first}, {rank_, count}}});
      in.push_back({t_.b, Box::Whole(t_.b->shape)});
    } else {
      in.push_back({t_.a, Box::Whole(t_.a->shape)});
      in.push_back({t_.b, Box{{first, 0}, {count, rank_}}});
    }
    if (t_.magnitude) in.push_back({t_.magnitude, Box{{first}, {count}}});
    return in;
  }

  Result<BlockBytes> Compute(uint64_t blk, const std::vector<BlockBytes>& inputs) const override {
    uint64_t first, count;
    Rows(blk, &first, &count);
    const size_t want = t_.a ? (t_.magnitude ? 4 : 3) : 2;
    if (inputs.size() != want) return Status::Corruption(what() + ": block got " + std::to_string(inputs.size()) +
                                                         " inputs, wants " + std::to_string(want));
    const float s = float(t_.scaling);
    Matrix w = Decode(*t_.base, inputs[0], count, cols_);
    if (!t_.a) {
      w += s * Decode(*t_.b, inputs[1], count, 1);
    } else if (t_.transposed) {  // W += s (B A)^T = s A^T B^T
      Matrix a = Decode(*t_.a, inputs[1], rank_, count);
      Matrix b = Decode(*t_.b, inputs[2], cols_, rank_);
      w.noalias() += s * a.transpose() * b.transpose();
    } else {
      // Accumulated into W by the product itself: no block-sized temporary.
      Matrix a = Decode(*t_.a, inputs[1], rank_, cols_);
      Matrix b = Decode(*t_.b, inputs[2], count, rank_);
      w.noalias() += s * b * a;
    }
    if (t_.magnitude) {
      Matrix m = Decode(*t_.magnitude, inputs[3], count, 1);
      for (uint64_t i = 0; i < count; ++i) w.row(i) *= m(i, 0) / w.row(i).norm();
    }
    return Encode(w, to_);
  }

 private:
  // Rows [first, first + count) of the output make block `blk`.
  void Rows(uint64_t blk, uint64_t* first, uint64_t* count) const {
    const Box box = BlockBox(blk);
    *first = box.offsets[0];
    *count = box.lengths[0];
  }

  LoraTerm t_;
  DType to_;
  uint64_t rows_ = 0, cols_ = 0, rank_ = 0;
};

Status CheckShapes(const LoraTerm& t) {
  const Shape& w = t.base->shape;
  auto refuse = [&](const std::string& why) {
    return Status::InvalidArgument("adapter tensor '" + t.b->fqn + "' does not fit base tensor '" + t.base->fqn +
                                   "' " + ShapeText(w) + ": " + why +
                                   "; is base_model_name_or_path the model this adapter was trained on?");
  };
  for (const auto* p : {&t.base, &t.a, &t.b, &t.magnitude})
    if (*p && !IsCastable((*p)->dtype))
      return Status::InvalidArgument("tensor '" + (*p)->fqn + "' has dtype " + std::string(DTypeName((*p)->dtype)) +
                                     ": a LoRA merge needs floating tensors");
  if (!t.a) {
    if (w.size() != 1 || t.b->shape != w) return refuse("lora_B.bias is " + ShapeText(t.b->shape));
    return Status::OK();
  }
  if (w.size() != 2) return refuse("only 2-d weights (Linear, Conv1D, Embedding) are merged on read");
  const Shape& a = t.a->shape;
  const Shape& b = t.b->shape;
  const uint64_t in = t.transposed ? w[0] : w[1], out = t.transposed ? w[1] : w[0];
  if (a.size() != 2 || b.size() != 2 || a[1] != in || b[0] != out || b[1] != a[0])
    return refuse("A is " + ShapeText(a) + ", B is " + ShapeText(b) + (t.transposed ? " (transposed: ΔW = (B @ A)^T)" : ""));
  // A block is at least one whole row, and needs all of A (or, transposed,
  // B): rank + 1 rows of fp32 the width of W's rows.
  const uint64_t one_row = 4 * w[1] * (a[0] + 1);
  if (one_row > kMaxMergeRowBytes)
    return Status::NotSupported("LoRA merge of '" + t.base->fqn + "' " + ShapeText(w) + " with rank " +
                                std::to_string(a[0]) + " needs " + std::to_string(one_row >> 20) +
                                " MiB for one row of output, more than the " + std::to_string(kMaxMergeRowBytes >> 20) +
                                " MiB merged on read; merge it with peft's PeftModel.merge_and_unload()");
  if (t.magnitude) {
    if (t.transposed)
      return Status::NotSupported("DoRA on '" + t.base->fqn + "' (fan_in_fan_out or embedding) is not merged on read; "
                                  "merge it with peft's PeftModel.merge_and_unload()");
    if (t.magnitude->shape != Shape{out}) return refuse("lora_magnitude_vector is " + ShapeText(t.magnitude->shape));
  }
  return Status::OK();
}

// W [E, d1, d2] + ΔW, ΔW[e] = s * B_e @ A_e ([d1, d2] = [out, in]) or, transposed,
// s * (B_e @ A_e)^T ([d1, d2] = [in, out]); A_e = A's rows e*r .. e*r+r-1,
// B_e = B's columns e, E + e, ..., (r-1)*E + e (peft's reshape of B to
// [out, r, E]). A block is a box of the output: several whole experts, or
// rows of one expert, or part of one row; its rows are contiguous. A 2-d
// base is one expert's rows from row0 on (never transposed).
class LoraExpertMerge : public Computation {
 public:
  LoraExpertMerge(LoraExpertTerm t, DType to) : t_(std::move(t)), to_(to) {
    width_ = t_.rank * t_.experts;  // A's rows, B's columns
  }
  DType dtype() const override { return to_; }
  const Shape& shape() const override { return t_.base->shape; }
  std::string what() const override {
    return "LoRA merge of expert parameter '" + t_.base->fqn + "' with '" + t_.b->fqn + "'";
  }

  std::vector<ComputeInput> InputsOf(uint64_t blk) const override {
    const Box out = BlockBox(blk);
    const Fused f = InFused(out);
    // A's rows for the block's experts and columns for its in-features; B's
    // rows for its out-features, all columns (its experts are interleaved).
    const uint64_t in_at = t_.transposed ? 1 : 2, out_at = t_.transposed ? 2 : 1;
    return {{t_.base, out},
            {t_.a, Box{{f.e0 * t_.rank, f.offsets[in_at]}, {f.ne * t_.rank, f.lengths[in_at]}}},
            {t_.b, Box{{f.offsets[out_at], 0}, {f.lengths[out_at], width_}}}};
  }

  Result<BlockBytes> Compute(uint64_t blk, const std::vector<BlockBytes>& inputs) const override {
    const Fused f = InFused(BlockBox(blk));
    if (inputs.size() != 3)
      return Status::Corruption(what() + ": block got " + std::to_string(inputs.size()) + " inputs, wants 3");
    const uint64_t nx = f.lengths[1], ny = f.lengths[2];
    const uint64_t in_n = t_.transposed ? nx : ny, out_n = t_.transposed ? ny : nx;
    Matrix w = Decode(*t_.base, inputs[0], f.ne * nx, ny);
    const Matrix a = Decode(*t_.a, inputs[1], f.ne * t_.rank, in_n);
    const Matrix b = Decode(*t_.b, inputs[2], out_n, width_);
    const float s = float(t_.scaling);
    using Stride = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;
    for (uint64_t j = 0; j < f.ne; ++j) {
      // B_e: column k*E + e of B for k < r.
      const Matrix be = Eigen::Map<const Matrix, 0, Stride>(b.data() + f.e0 + j, out_n, t_.rank,
                                                            Stride(width_, t_.experts));
      auto ae = a.middleRows(j * t_.rank, t_.rank);
      auto we = w.middleRows(j * nx, nx);
      if (t_.transposed) {
        we.noalias() += s * ae.transpose() * be.transpose();
      } else {
        we.noalias() += s * be * ae;
      }
    }
    return Encode(w, to_);
  }

 private:
  // A block's box in the fused [E, d1, d2] parameter: experts e0 .. e0+ne-1.
  struct Fused {
    uint64_t e0 = 0, ne = 0;
    std::vector<uint64_t> offsets, lengths;  // dims 1 and 2 at [1], [2]
  };
  Fused InFused(const Box& out) const {
    if (out.rank() == 3) return {out.offsets[0], out.lengths[0], out.offsets, out.lengths};
    return {t_.expert, 1, {t_.expert, t_.row0 + out.offsets[0], out.offsets[1]}, {1, out.lengths[0], out.lengths[1]}};
  }

  LoraExpertTerm t_;
  DType to_;
  uint64_t width_ = 0;
};

// The float32 inputs of one expert-merge block above this are refused: B's
// whole rows are read for each output row (see MakeLoraExpertMerge).
constexpr uint64_t kMaxExpertBlockInputBytes = 64ull << 20;

Status CheckExpertShapes(const LoraExpertTerm& t) {
  const Shape& w = t.base->shape;
  const Shape &a = t.a->shape, &b = t.b->shape;
  for (const auto* p : {&t.base, &t.a, &t.b})
    if (!IsCastable((*p)->dtype))
      return Status::InvalidArgument("tensor '" + (*p)->fqn + "' has dtype " + std::string(DTypeName((*p)->dtype)) +
                                     ": a LoRA merge needs floating tensors");
  // A 2-d base: expert `expert`'s rows row0 .. of a fused [E, out, in].
  const bool piece = w.size() == 2 && !t.transposed && t.expert < t.experts;
  const uint64_t in = w.size() == 3 ? (t.transposed ? w[1] : w[2]) : piece ? w[1] : 0;
  const uint64_t out = w.size() == 3 ? (t.transposed ? w[2] : w[1]) : 0;
  auto fits = [&] {
    if ((w.size() != 3 && !piece) || t.rank == 0 || a.size() != 2 || b.size() != 2) return false;
    if (a[0] != t.rank * t.experts || b[1] != a[0] || a[1] != in) return false;
    return w.size() == 3 ? b[0] == out && t.experts == w[0] : t.row0 + w[0] <= b[0];
  };
  if (!fits())
    return Status::InvalidArgument("adapter tensor '" + t.b->fqn + "' does not fit expert parameter '" + t.base->fqn +
                                   "' " + ShapeText(w) + ": A is " + ShapeText(a) + ", B is " + ShapeText(b) +
                                   ", want [r * E, in] and [out, r * E] with r = " + std::to_string(t.rank) +
                                   (t.transposed ? " ([E, in, out]: is_transposed)" : " ([E, out, in])") +
                                   "; is base_model_name_or_path the model this adapter was trained on?");
  return Status::OK();
}

}  // namespace

Result<std::shared_ptr<const Computation>> MakeLoraExpertMerge(LoraExpertTerm term, DType to) {
  if (!term.base || !term.a || !term.b) return Status::InvalidArgument("a LoRA merge needs a base tensor, lora_A and lora_B");
  if (term.base->shape.size() == 3) term.experts = term.base->shape[0];
  RETURN_IF_ERROR(CheckExpertShapes(term));
  auto merge = std::make_shared<const LoraExpertMerge>(std::move(term), to);
  // Block 0 is as large as any: its float32 inputs bound them all.
  uint64_t bytes = 0;
  for (const ComputeInput& in : merge->InputsOf(0)) {
    uint64_t n = 4;
    for (uint64_t l : in.box.lengths) n *= l;
    bytes += n;
  }
  if (bytes > kMaxExpertBlockInputBytes)
    return Status::NotSupported(merge->what() + " needs " + std::to_string(bytes >> 20) + " MiB of float32 inputs for "
                                "one block, more than the " + std::to_string(kMaxExpertBlockInputBytes >> 20) +
                                " MiB merged on read; merge it with peft's PeftModel.merge_and_unload()");
  return std::shared_ptr<const Computation>(std::move(merge));
}

Result<std::shared_ptr<const Computation>> MakeLoraMerge(LoraTerm term, DType to) {
  if (!term.base || !term.b) return Status::InvalidArgument("a LoRA merge needs a base tensor and lora_B");
  RETURN_IF_ERROR(CheckShapes(term));
  return std::shared_ptr<const Computation>(std::make_shared<const LoraMerge>(std::move(term), to));
}

}  // namespace ckptfs
