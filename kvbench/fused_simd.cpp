// The vector reader (kvbench.fused's "simd"; its runs carry attention_reader: fused-simd).
//
// Why a second kernel: the first (fused_attend.cpp) scores one token at a time (a row decoded into scratch, a
// reduction per row and query), so it takes the same time per token over int8 as over bfloat16: bound by its own
// per-token work, not by the bytes (results/perf/reader.md). This one works on blocks of 8 tokens:
// - a block's 8 rows are decoded once into an 8-row scratch that stays in L1, scored against each query row held
//   in registers (8 independent sums, one horizontal reduction per block: one vector of 8 scores per query row);
// - one vectorized exponential per block and query row, the online softmax (Milakov & Gimelshein 2018) merged
//   per block rather than per token;
// - int8 keys with one scale per token (the default int8 layout) are scored by integer dot products against the
//   query quantized to int8 per row (sign trick + vpmaddubsw/vpmaddwd on AVX2, vpdpbusd where the CPU has
//   VNNI), their scale folded into the score (KIVI's fold, Liu et al. 2024); int8 values are summed by 16-bit
//   integer products (vpmaddwd over token pairs) against the block's probabilities quantized to 15 bits, the
//   values' scale folded into those weights;
// - every other format is decoded by the first kernel's decoders (this file includes it: those stay one copy)
//   and read by the same float block products.
// Flash-decoding's split over chunks and the final merge are the first kernel's. The first kernel is kept as it
// is (its runs must reproduce); without AVX2 and FMA this module's attend is the first kernel's.
//
// The integer paths are not bit-exact against float attention: the query's int8 rounding moves a score by at
// most 0.5 / 127 of the row's largest |q| times the key row's L1 norm; the weights' 15-bit rounding moves an
// output by at most 0.5 / 32767 of the block's largest weight per value. tests/test_fused.py bounds both.
#include <torch/extension.h>

#pragma push_macro("PYBIND11_MODULE")
#undef PYBIND11_MODULE
// The first kernel's module definition becomes an unused function: this module binds its own.
#define PYBIND11_MODULE(name, variable) [[maybe_unused]] static void kvbench_first_bindings(::pybind11::module_& variable)
#include "fused_attend.cpp"
#undef PYBIND11_MODULE
#pragma pop_macro("PYBIND11_MODULE")

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace simd {

constexpr int kB = 8;       // tokens per block: one vector of scores per query row
constexpr int kMaxM = 32;   // query rows per KV head (kvbench.fused.MAX_ROWS)

inline __m256 set1(float x) { return _mm256_set1_ps(x); }

// exp(x) for x <= 0, NaN and -inf lanes giving 0: exp_nonpos's Cephes polynomial, eight lanes at once.
inline __m256 exp256(__m256 x) {
  const __m256 lo = set1(-87.3f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, set1(1.44269504088896341f), set1(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
  __m256 p = set1(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, set1(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, set1(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, set1(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, set1(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, set1(5.0000001201e-1f));
  const __m256 e = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, set1(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(e, _mm256_castsi256_ps(two_n)), keep);
}

// The sums of eight vectors, as one vector (lane t: the sum of v[t]).
inline __m256 hsum8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline __m256i hsum8i(const __m256i* v) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hadd(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// int8 keys with one scale per token (scale over the whole row, no zero point): the integer path.
inline bool int8_folded(const Part& p, int64_t d) {
  return p.bits == 8 && p.mode == 1 && p.scale.type != kNone && p.zero.type == kNone && p.cg >= d && d % 32 == 0;
}

inline float token_factor(const Part& p, int64_t b, int64_t h, int64_t j) {
  const int64_t r = p.tg > 0 ? j / p.tg : 0;
  return p.scale.at(b * p.scale.sb + h * p.scale.sh + r * p.scale.sr);
}

// One task: query rows q [M, D] (D % 8 == 0) over tokens n0 <= n < n1, leaving the chunk's running maximum,
// denominator and unnormalized sum in mx, l, acc [M, D] (as the first kernel's tasks do).
struct Task {
  const std::vector<Part>& kp;
  const std::vector<Part>& vp;
  int64_t b, h, M, D;
  const float* q;
  float scl;
  const float* mrow0;  // mask rows (nullptr: none), row m at mrow0 + (m / q_len) * ms2 + (m % q_len) * ms3
  int64_t q_len, ms2, ms3, ms4;
  float* mx;
  float* l;
  float* acc;
  // scratch
  float* rows;  // [kB, D]
  float* sbuf;
  float* zbuf;
  int8_t* qi;   // [M, D] the query as int8 (made when an int8 part is first met)
  float qa[kMaxM];
  bool quantized = false;
  alignas(32) float s[kMaxM][kB];
  float f[kB];

  void quantize_query() {
    for (int64_t m = 0; m < M; ++m) {
      const float* qm = q + m * D;
      float top = 0.f;
      for (int64_t c = 0; c < D; ++c) top = std::max(top, std::fabs(qm[c]));
      const float a = top > 0.f ? top / 127.f : 1.f;
      qa[m] = a;
      for (int64_t c = 0; c < D; ++c) qi[m * D + c] = static_cast<int8_t>(std::nearbyint(qm[c] / a));
    }
    quantized = true;
  }

  // Decoded rows j0 <= j < j0 + n of part p into rows[0:n] (zeros after), their factors into f.
  void decode(const Part& p, int64_t j0, int n) {
    auto keep = [&](const float*, const float* fac, const int64_t* col, int k) {
      for (int i = 0; i < k; ++i) f[col[i]] = fac[i];
    };
    Tile<decltype(keep)> tile{keep, D, rows};
    dispatch_rows(p, b, h, j0, j0 + n, D, -j0, sbuf, zbuf, tile);
    tile.flush();
    for (int t = n; t < kB; ++t) {
      std::fill(rows + t * D, rows + (t + 1) * D, 0.f);
      f[t] = 0.f;
    }
  }

  // s[m][0:8] = q_m . key_t (times the row's factor), tokens past n left for the caller to mask.
  void score(const Part& p, int64_t j0, int n) {
    if (int8_folded(p, D)) {
      if (!quantized) quantize_query();
      const int8_t* base = static_cast<const int8_t*>(p.data) + b * p.sb + h * p.sh;
      const int8_t* r[kB];
      for (int t = 0; t < kB; ++t) {
        r[t] = base + (j0 + std::min(t, n - 1)) * p.sn;  // past n: the last row again, masked below
        f[t] = t < n ? token_factor(p, b, h, j0 + t) : 0.f;
      }
      const __m256 fv = _mm256_loadu_ps(f);
      const __m256i ones = _mm256_set1_epi16(1);
      for (int64_t m = 0; m < M; ++m) {
        __m256i a[kB];
        for (int t = 0; t < kB; ++t) a[t] = _mm256_setzero_si256();
        for (int64_t c = 0; c < D; c += 32) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qi + m * D + c));
          for (int t = 0; t < kB; ++t) {
            const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[t] + c));
            // |k| times q with k's sign: the products of q and k with an unsigned first operand.
            const __m256i ak = _mm256_sign_epi8(kv, kv), sq = _mm256_sign_epi8(qv, kv);
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
            a[t] = _mm256_dpbusd_epi32(a[t], ak, sq);
#else
            a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(_mm256_maddubs_epi16(ak, sq), ones));
#endif
          }
        }
        (void)ones;
        const __m256 dots = _mm256_cvtepi32_ps(hsum8i(a));
        _mm256_store_ps(s[m], _mm256_mul_ps(dots, _mm256_mul_ps(fv, set1(qa[m]))));
      }
      return;
    }
    decode(p, j0, n);
    const __m256 fv = _mm256_loadu_ps(f);
    for (int64_t m = 0; m < M; ++m) {
      __m256 a[kB];
      for (int t = 0; t < kB; ++t) a[t] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + m * D + c);
        for (int t = 0; t < kB; ++t) a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + t * D + c), a[t]);
      }
      _mm256_store_ps(s[m], _mm256_mul_ps(hsum8(a), fv));
    }
  }

  // The block's scores to probabilities, merged into each row's running maximum, denominator and sum.
  // Returns whether any row has a nonzero probability (else the values need not be read).
  bool softmax(int64_t n_abs, int n) {
    bool any = false;
    const __m256 lanes = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), set1(static_cast<float>(n)),
                                       _CMP_LT_OQ);
    const __m256 ninf = set1(-std::numeric_limits<float>::infinity());
    for (int64_t m = 0; m < M; ++m) {
      __m256 sv = _mm256_mul_ps(_mm256_load_ps(s[m]), set1(scl));
      if (mrow0) {
        const float* mr = mrow0 + (m / q_len) * ms2 + (m % q_len) * ms3 + n_abs * ms4;
        alignas(32) float add[kB];
        for (int t = 0; t < kB; ++t) add[t] = t < n ? mr[t * ms4] : 0.f;
        sv = _mm256_add_ps(sv, _mm256_load_ps(add));
      }
      sv = _mm256_blendv_ps(ninf, sv, lanes);
      const float top = hmax(sv);
      if (!(top > -std::numeric_limits<float>::infinity())) {  // masked everywhere in the block (or NaN)
        _mm256_store_ps(s[m], _mm256_setzero_ps());
        continue;
      }
      if (top > mx[m]) {  // a new maximum: what was summed so far is scaled to it
        const float corr = std::isinf(mx[m]) ? 0.f : std::exp(mx[m] - top);
        l[m] *= corr;
        float* am = acc + m * D;
        const __m256 cv = set1(corr);
        for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(am + c, _mm256_mul_ps(_mm256_loadu_ps(am + c), cv));
        mx[m] = top;
      }
      const __m256 pv = exp256(_mm256_sub_ps(sv, set1(mx[m])));
      l[m] += hadd(pv);
      _mm256_store_ps(s[m], pv);
      any = true;
    }
    return any;
  }

  // acc[m] += sum_t s[m][t] * value_t.
  void values(const Part& p, int64_t j0, int n) {
    if (int8_folded(p, D)) {
      const int8_t* base = static_cast<const int8_t*>(p.data) + b * p.sb + h * p.sh;
      const int8_t* r[kB];
      for (int t = 0; t < kB; ++t) {
        r[t] = base + (j0 + std::min(t, n - 1)) * p.sn;  // past n: weight 0
        f[t] = t < n ? token_factor(p, b, h, j0 + t) : 0.f;
      }
      // Each row's weights (probability times the token's scale) as 15-bit integers, in token pairs.
      int32_t pair[kMaxM][kB / 2];
      float gamma[kMaxM];
      for (int64_t m = 0; m < M; ++m) {
        float w[kB], top = 0.f;
        for (int t = 0; t < kB; ++t) top = std::max(top, w[t] = s[m][t] * f[t]);
        gamma[m] = top / 32767.f;
        for (int t = 0; t < kB; t += 2) {
          const int32_t lo = top > 0.f ? static_cast<int32_t>(std::nearbyint(w[t] / gamma[m])) : 0;
          const int32_t hi = top > 0.f ? static_cast<int32_t>(std::nearbyint(w[t + 1] / gamma[m])) : 0;
          pair[m][t / 2] = (lo & 0xFFFF) | (hi << 16);
        }
      }
      constexpr int G = 4;  // query rows per pass: 2 accumulators each in registers
      for (int64_t m0 = 0; m0 < M; m0 += G) {
        const int g = static_cast<int>(std::min<int64_t>(G, M - m0));
        for (int64_t c = 0; c < D; c += 16) {
          __m256i a[G][2];
          for (int i = 0; i < G; ++i) a[i][0] = a[i][1] = _mm256_setzero_si256();
          for (int t = 0; t < kB; t += 2) {
            const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r[t] + c)));
            const __m256i y = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r[t + 1] + c)));
            const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
            for (int i = 0; i < g; ++i) {
              const __m256i pw = _mm256_set1_epi32(pair[m0 + i][t / 2]);
              a[i][0] = _mm256_add_epi32(a[i][0], _mm256_madd_epi16(lo, pw));
              a[i][1] = _mm256_add_epi32(a[i][1], _mm256_madd_epi16(hi, pw));
            }
          }
          for (int i = 0; i < g; ++i) {  // lanes [c0-3 | c8-11] and [c4-7 | c12-15] back in channel order
            float* am = acc + (m0 + i) * D + c;
            const __m256 gv = set1(gamma[m0 + i]);
            const __m256 f0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a[i][0], a[i][1], 0x20));
            const __m256 f1 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(a[i][0], a[i][1], 0x31));
            _mm256_storeu_ps(am, _mm256_fmadd_ps(f0, gv, _mm256_loadu_ps(am)));
            _mm256_storeu_ps(am + 8, _mm256_fmadd_ps(f1, gv, _mm256_loadu_ps(am + 8)));
          }
        }
      }
      return;
    }
    decode(p, j0, n);
    for (int64_t m = 0; m < M; ++m) {
      __m256 w[kB];
      bool any = false;
      for (int t = 0; t < kB; ++t) {
        const float wt = s[m][t] * f[t];
        any |= wt != 0.f;
        w[t] = set1(wt);
      }
      if (!any) continue;
      float* am = acc + m * D;
      for (int64_t c = 0; c < D; c += 8) {
        __m256 a = _mm256_loadu_ps(am + c);
        for (int t = 0; t < kB; ++t) a = _mm256_fmadd_ps(w[t], _mm256_loadu_ps(rows + t * D + c), a);
        _mm256_storeu_ps(am + c, a);
      }
    }
  }

  void run(int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m) {
      mx[m] = -std::numeric_limits<float>::infinity();
      l[m] = 0.f;
    }
    std::fill(acc, acc + M * D, 0.f);
    size_t ki = 0, vi = 0;
    for (int64_t n = n0; n < n1;) {
      while (kp[ki].first + kp[ki].n <= n) ++ki;
      while (vp[vi].first + vp[vi].n <= n) ++vi;
      const Part &k = kp[ki], &v = vp[vi];
      const int64_t end = std::min({n + kB, n1, k.first + k.n, v.first + v.n});
      const int cnt = static_cast<int>(end - n);
      score(k, n - k.first, cnt);
      if (softmax(n, cnt)) values(v, n - v.first, cnt);
      n = end;
    }
  }
};

}  // namespace simd
#endif

// Same arguments and result as the first kernel's attend.
torch::Tensor attend_simd(const torch::Tensor& q, const std::vector<torch::Tensor>& kt,
                          const std::vector<int64_t>& ki, const std::vector<torch::Tensor>& vt,
                          const std::vector<int64_t>& vi, const torch::Tensor& mask, int64_t q_len, double scaling,
                          int64_t chunk) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [B, H, M, D] float32");
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  if (D % 8 != 0 || D > 512 || M > simd::kMaxM) return attend(q, kt, ki, vt, vi, mask, q_len, scaling, chunk);
  const auto kp = parts(kt, ki), vp = parts(vt, vi);
  int64_t N = 0, NV = 0;
  for (const auto& p : kp) N += p.n;
  for (const auto& p : vp) NV += p.n;
  TORCH_CHECK(N == NV, "keys and values hold different numbers of tokens");
  const bool masked = mask.defined() && mask.numel() > 0;
  const float* mk = nullptr;
  int64_t ms[5] = {0, 0, 0, 0, 0};
  if (masked) {
    TORCH_CHECK(mask.dim() == 5 && mask.scalar_type() == torch::kFloat32, "mask: [B, H, G, Q, N] float32");
    mk = mask.data_ptr<float>();
    for (int i = 0; i < 5; ++i) ms[i] = mask.size(i) == 1 ? 0 : mask.stride(i);
  }
  TORCH_CHECK(chunk > 0, "chunk > 0");
  const int64_t chunks = std::max<int64_t>(1, (N + chunk - 1) / chunk);
  const int64_t tasks = B * H * chunks;
  auto pmax = torch::empty({tasks, M});
  auto psum = torch::empty({tasks, M});
  auto pacc = torch::empty({tasks, M, D});
  float* pm = pmax.data_ptr<float>();
  float* ps = psum.data_ptr<float>();
  float* pa = pacc.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float scl = static_cast<float>(scaling);

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> rows(simd::kB * D), sbuf(D), zbuf(D);
    std::vector<int8_t> qi(M * D);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (H * chunks), h = (t / chunks) % H, c = t % chunks;
      const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
      simd::Task task{kp, vp, b, h, M, D, qp + (b * H + h) * M * D, scl,
                      masked ? mk + b * ms[0] + h * ms[1] : nullptr, q_len, ms[2], ms[3], ms[4],
                      pm + t * M, ps + t * M, pa + t * M * D, rows.data(), sbuf.data(), zbuf.data(), qi.data()};
      if (N > 0) task.run(n0, n1);
      else {
        for (int64_t m = 0; m < M; ++m) pm[t * M + m] = -std::numeric_limits<float>::infinity(), ps[t * M + m] = 0.f;
        std::fill(pa + t * M * D, pa + (t + 1) * M * D, 0.f);
      }
    }
  });

  const float ninf = -std::numeric_limits<float>::infinity();
  auto out = torch::empty({B, H, M, D});
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H * M, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bh = r / M, m = r % M;
      float top = ninf;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, pm[(bh * chunks + c) * M + m]);
      const float safe = std::isinf(top) ? 0.f : top;
      float total = 0.f;
      float* o = op + r * D;
      std::fill(o, o + D, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t t = bh * chunks + c;
        const float mc = pm[t * M + m];
        const float w = std::isinf(mc) ? 0.f : std::exp(mc - safe);
        if (w == 0.f) continue;
        total += w * ps[t * M + m];
        const float* a = pa + (t * M + m) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= total;  // 0 / 0 for a row that sees no token, as blockattn gives
    }
  });
  return out;
#else
  return attend(q, kt, ki, vt, vi, mask, q_len, scaling, chunk);
#endif
}

// The instruction sets this build's integer path uses (for the benchmarks' record).
std::string isa() {
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  return "avx2+fma+vnni";
#else
  return "avx2+fma";
#endif
#else
  return "scalar (the first kernel)";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend_simd, "Block-vector attention over stored parts (kvbench.fused, reader simd)");
  m.def("isa", &isa, "the instruction sets the reader was built for");
}
