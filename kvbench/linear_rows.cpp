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
// Every y[m, n] is summed in one order, whatever M, N and the instruction set: eight float32 lanes, lane j taking
// x[m, k] * W[n, k] for k = j (mod 8) by fused multiply-adds in increasing k, then the lanes added as hsum does
// (K % 8 != 0: one scalar sum in increasing k). The loops around that only choose how many outputs are summed at
// once, so results are bit-identical across row counts, blocks and vector widths (tests/test_linear.py).
//
// Threads split the output rows n (OpenMP) in blocks of weight rows. Within a block, a group of up to 8 input
// rows is read 8 values at a time, each load used for every weight row of the block, and every (m, n) has an
// accumulator of its own: independent chains of multiply-adds. The first version summed one weight row at a time,
// a single chain per input row: bound by the multiply-add's latency at one or two rows and by reloading x at six
// (one Zen 5 core: 25 and 92 GFLOP/s; scripts/bench_linear.py). With AVX-512 one 512-bit register holds two weight
// rows' 8 lanes side by side (the same lanes in the same order), the input row's 8 values broadcast to both halves;
// with AVX2 alone, one weight row at a time as before (kOneCol says why). Without AVX2 and FMA the same sums run
// in scalar C++.
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
// Weight rows per OpenMP block: a multiple of every AVX-512 block width below (16, 12, 8, 6), so only a weight's last
// rows (N % 48) are summed one at a time.
constexpr int64_t kBlock = 48;

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

inline __m256 bf16x8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// R rows of x (float32, stride K) times one bf16 weight row w (K % 8 == 0) into out[r * N]: the first version's
// loop, and the order every path sums in.
template <int R>
inline void dot_rows(const float* x, const uint16_t* w, int64_t K, float* out, int64_t N) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 wv = bf16x8(w + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r * N] = hsum(acc[r]);
}

#if defined(__AVX512F__)
#define KVB_ROWS_AVX512 1
// Two weight rows per 512-bit register: lanes 0-7 row n's, 8-15 row n + 1's, each lane the same sum as above.
template <int R, int P>
inline void dot_pairs(const float* x, const uint16_t* w, int64_t K, float* out, int64_t N) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  // The next block's rows (contiguous after this block's) are prefetched in address order, a few lines per step of
  // k: read 2P rows at a time, the weight is no longer one stream to the hardware prefetcher, and from memory one or
  // two rows took longer than the first version's single-row loop (a decode step of SmolLM2-135M, one thread: 15.5
  // against 13.3 ms of linear layers at one sequence; with these prefetches 10.7; scripts/profile_step.py).
  // __builtin_prefetch: GCC keeps it in this file (tests/test_linear.py checks the build), and inline assembly
  // here (fused_simd.cpp's way) cost the in-cache products half their speed by hampering register allocation. A
  // prefetch past the weight's end is harmless (it never faults).
  const char* next = reinterpret_cast<const char*>(w + 2 * P * K);
  const int64_t lines = (2 * P * K * 2 + 63) / 64, per = (lines + K / 8 - 1) / (K / 8);
  int64_t line = 0;
  for (int64_t k = 0; k < K; k += 8) {
    for (int64_t j = 0; j < per && line < lines; ++j, ++line)
      __builtin_prefetch(next + 64 * line, 0, 3);
    __m512 wv[P];
    for (int p = 0; p < P; ++p) {
      const uint16_t* a = w + 2 * p * K + k;
      const __m256i h = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + K)), 1);
      wv[p] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * K + k));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(wv[p], xv, acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      out[r * N + 2 * p] = hsum(_mm512_castps512_ps256(acc[r][p]));
      out[r * N + 2 * p + 1] = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][p]), 1)));
    }
}

// Weight rows per block for R input rows: at most 24 accumulators of the 32 registers.
constexpr int kPairs[kGroup + 1] = {0, 8, 8, 8, 6, 4, 4, 3, 3};
template <int R>
inline void block_rows(const float* x, const uint16_t* w, int64_t K, float* out, int64_t N) {
  dot_pairs<R, kPairs[R]>(x, w, K, out, N);
}
#endif

using BlockRows = void (*)(const float*, const uint16_t*, int64_t, float*, int64_t);
#ifdef KVB_ROWS_AVX512
constexpr BlockRows kBlockRows[kGroup + 1] = {nullptr, block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>,
                                              block_rows<5>, block_rows<6>, block_rows<7>, block_rows<8>};
#endif
// One weight row at a time: AVX2's loop, and AVX-512's for a weight's rows past its last full block. AVX2 keeps the
// first version's loop because blocks of two or four ymm weight rows, twice as fast from the caches, ran at half the
// speed from memory on the one CPU measured (a Zen 5 built with AVX-512 switched off; no AVX2-only CPU was at hand).
constexpr BlockRows kOneCol[kGroup + 1] = {nullptr, dot_rows<1>, dot_rows<2>, dot_rows<3>, dot_rows<4>,
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
  const int64_t blocks = (N + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const int64_t n0 = bi * kBlock, n1 = std::min(N, n0 + kBlock);
    for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
      const int rows = static_cast<int>(std::min<int64_t>(kGroup, M - m0));
      const float* xm = xp + m0 * K;
      float* om = op + m0 * N;
#ifdef KVB_ROWS_AVX2
      if (K % 8 == 0) {
        int64_t n = n0;
#ifdef KVB_ROWS_AVX512
        for (const int64_t step = 2 * kPairs[rows]; n + step <= n1; n += step)
          kBlockRows[rows](xm, wp + n * K, K, om + n, N);
#endif
        for (; n < n1; ++n) kOneCol[rows](xm, wp + n * K, K, om + n, N);
        continue;
      }
#endif
      for (int64_t n = n0; n < n1; ++n) scalar_rows(xm, wp + n * K, K, rows, om + n, N);
    }
    if (bp != nullptr)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) op[m * N + n] += bp[n];
  }
  return out;
}

int64_t max_rows() { return kMaxRows; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "x [M<=16, K] float32 times bf16 W [N, K]^T, each weight read once");
  m.def("max_rows", &max_rows, "the most rows linear_rows takes");
}
