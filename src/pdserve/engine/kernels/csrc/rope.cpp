#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "vec.h"

namespace pdserve {
namespace {

// out[d] = x[d] * c[d] + x[d + shift] * s[d] for d in [0, n), vectorised.
void rotate_half(const float* x, const float* x_shifted, const float* c, const float* s,
                 float* out, int64_t n) {
  for (int64_t d = 0; d < n; d += kVec) {
    if (n - d >= kVec) {
      (Vec::loadu(x + d) * Vec::loadu(c + d) + Vec::loadu(x_shifted + d) * Vec::loadu(s + d))
          .store(out + d);
    } else {
      const int64_t k = n - d;
      (Vec::loadu(x + d, k) * Vec::loadu(c + d, k) +
       Vec::loadu(x_shifted + d, k) * Vec::loadu(s + d, k)).store(out + d, k);
    }
  }
}

}  // namespace

void check_mla_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t t, int64_t half,
                      const char* rows) {
  const auto table = [&](const at::Tensor& z) {
    return z.scalar_type() == at::kFloat && z.is_contiguous() && z.dim() == 2 &&
           z.size(0) == t && z.size(1) == half;
  };
  TORCH_CHECK(table(cos) && table(sin), "cos and sin must be contiguous fp32 [", t, ", ", half,
              "]: one row per row of ", rows);
}

void rotate_mla_row(const bf16* in, bf16* out, const float* c, const float* s, int64_t half,
                    bool interleave, float* a, float* b) {
  for (int64_t i = 0; i < half; ++i) {  // the pairs: adjacent, or the two halves
    a[i] = static_cast<float>(interleave ? in[2 * i] : in[i]);
    b[i] = static_cast<float>(interleave ? in[2 * i + 1] : in[half + i]);
  }
  for (int64_t i = 0; i < half; ++i) {  // RoFormer eq. 34, written de-interleaved
    out[i] = static_cast<bf16>(a[i] * c[i] - b[i] * s[i]);
    out[half + i] = static_cast<bf16>(b[i] * c[i] + a[i] * s[i]);
  }
}

void rope_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin_signed, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.scalar_type() == at::kBFloat16,
              "qkv must be bf16 [T, width] with contiguous rows");
  TORCH_CHECK(qkv.size(1) >= heads * head_dim && head_dim % 2 == 0, "bad head layout");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.size(1) == head_dim &&
                  sin_signed.sizes() == cos.sizes() && sin_signed.is_contiguous() &&
                  sin_signed.scalar_type() == at::kFloat,
              "cos and sin_signed must be contiguous fp32 [positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == qkv.size(0),
              "one int64 position per row");
  const int64_t t = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position ", pos[r], " is outside the ",
                cos.size(0), "-row rope table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  bf16* base = qkv.data_ptr<bf16>();
  at::parallel_for(0, t, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> x(head_dim), y(head_dim);
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cp + pos[r] * head_dim;
      const float* s = sp + pos[r] * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        bf16* head = base + r * row_stride + h * head_dim;
        to_float(head, x.data(), head_dim);
        // x * cos + roll(x, D/2) * sin_signed: the roll pairs d with d + D/2 (mod D)
        rotate_half(x.data(), x.data() + half, c, s, y.data(), half);
        rotate_half(x.data() + half, x.data(), c + half, s + half, y.data() + half, half);
        to_bf16(y.data(), head, head_dim);
      }
    }
  });
}

void mla_rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.scalar_type() == at::kBFloat16 &&
                  x.size(2) % 2 == 0,
              "x must be bf16 [T, heads, d] with contiguous heads and d even");
  const int64_t t = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  check_mla_tables(cos, sin, t, half, "x");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  bf16* base = x.data_ptr<bf16>();
  at::parallel_for(0, t, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> a(half), b(half);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        bf16* p = base + r * x.stride(0) + h * x.stride(1);
        rotate_mla_row(p, p, cp + r * half, sp + r * half, half, interleave, a.data(), b.data());
      }
  });
}

}  // namespace pdserve
