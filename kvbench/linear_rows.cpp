// A linear layer of a few rows over 16-bit (bfloat16) weights, for engine.linear=upcast (kvbench/linear.py).
//
// y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for m < M <= kMaxRows: each weight row is read from memory once for
// all M rows and converted to float32 in registers (a bfloat16 is the top half of a float32: the conversion is a
// shift, exact). A decode step of a batch of sequences is such a product, and on a CPU without bf16 instructions
// PyTorch computes a bf16 one as a matrix-vector product per row, reading every weight M times; float32 copies of
// the weights read them once but hold twice the bytes. Here the bytes read are the bf16 weights, once, and nothing
// is held. The float32 sums run in another order than PyTorch's (8 lanes, then across them): rounding-level
// differences, which is why engine.linear=upcast is a run identity of its own.
//
// Threads split the output rows n (OpenMP); within a thread, each weight row is loaded 8 values at a time and
// multiplied into up to 8 input rows' accumulators (9 of the 16 AVX2 registers), the weight row re-read from L1
// for further groups of 8 input rows. Without AVX2 and FMA the same loops run in scalar C++ (the compiler
// vectorises what the target allows).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVB_ROWS_AVX2 1
#endif

namespace {

constexpr int64_t kMaxRows = 16;
constexpr int kGroup = 8;  // input rows whose accumulators stay in registers together

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef KVB_ROWS_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// rows of x (float32, stride K) times one bf16 weight row w (K % 8 == 0) into out[r * N] for r < rows <= kGroup.
template <int R>
inline void dot_rows(const float* x, const uint16_t* w, int64_t K, float* out, int64_t N) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
    const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r * N] = hsum(acc[r]);
}

using DotRows = void (*)(const float*, const uint16_t*, int64_t, float*, int64_t);
constexpr DotRows kDot[kGroup + 1] = {nullptr, dot_rows<1>, dot_rows<2>, dot_rows<3>, dot_rows<4>,
                                      dot_rows<5>, dot_rows<6>, dot_rows<7>, dot_rows<8>};
#endif

void scalar_rows(const float* x, const uint16_t* w, int64_t K, int rows, float* out, int64_t N) {
  for (int r = 0; r < rows; ++r) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += x[r * K + k] * bf16_to_float(w[k]);
    out[r * N] = acc;
  }
}

}  // namespace

// x: float32 [M, K] contiguous, M <= kMaxRows; w: bfloat16 [N, K] contiguous; bias: float32 [N] or None.
// Returns float32 [M, N].
torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.is_cpu(),
              "x: contiguous float32 [M, K] on CPU");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.is_cpu(),
              "w: contiguous bfloat16 [N, K] on CPU");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "1 <= rows <= ", kMaxRows);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == N, "bias: [N]");
    bp = b.data_ptr<float>();
  }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint16_t* wn = wp + n * K;
    for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
      const int rows = static_cast<int>(std::min<int64_t>(kGroup, M - m0));
#ifdef KVB_ROWS_AVX2
      if (K % 8 == 0) {
        kDot[rows](xp + m0 * K, wn, K, op + m0 * N + n, N);
        continue;
      }
#endif
      scalar_rows(xp + m0 * K, wn, K, rows, op + m0 * N + n, N);
    }
    if (bp != nullptr)
      for (int64_t m = 0; m < M; ++m) op[m * N + n] += bp[n];
  }
  return out;
}

int64_t max_rows() { return kMaxRows; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "x [M<=16, K] float32 times bf16 W [N, K]^T, each weight read once");
  m.def("max_rows", &max_rows, "the most rows linear_rows takes");
}
