// The vector reader (kvbench.fused's "simd"; its runs carry attention_reader: fused-simd).
//
// Why a second kernel: the first (fused_attend.cpp) scores one token at a time (a row decoded into scratch, a
// reduction per row and query), so it takes the same time per token over int8 as over bfloat16: bound by its own
// per-token work, not by the bytes (results/perf/reader.md). This one works on blocks of 32 tokens:
// - keys are scored 8 at a time (8 independent sums per query row, one horizontal reduction per 8 tokens); rows
//   of formats without an integer path are decoded once into an 8-row scratch that stays in L1;
// - one vectorized exponential per block and query row, the online softmax (Milakov & Gimelshein 2018) merged
//   per block of 32 rather than per token;
// - int8 keys with one scale per token (the default int8 layout) are scored by integer dot products against the
//   query rounded to integers per row: the key made unsigned by flipping its sign bit (k + 128, a correction of
//   128 sum(q) per row), each key vector loaded once for up to four query rows, vpmaddubsw + vpmaddwd on AVX2
//   (the query in +-63 so the pair sums fit int16), vpdpbusd where the CPU has VNNI (+-127); the key's scale
//   folds into the score (KIVI's fold, Liu et al. 2024). int8 values are summed against each row's block weights
//   (probability times the value's scale) rounded to 7 bits of the block's largest, by vpmaddubsw over the block's
//   rows interleaved by 4 tokens (interleaved once for every query row), the scale folded back per block; with
//   AVX-512 and VNNI (head_dim % 64 == 0) 64 channels a vector, the same integer sums (values_i8_wide);
// - KIVI's layouts (Liu et al. 2024) of unsigned 4- or 2-bit codes with zero points, rows a whole number of 16-byte
//   pieces (int4: head_dim % 32 == 0, int2: % 64): keys quantized per channel over groups of tokens score as
//   q . k_t = sum_c (q_c s_c) code_tc + sum_c q_c z_c: the scales fold into the query once per token group (rounded
//   to integers of at most kP = 127 per row), the zero points into one float constant per group and row; the
//   codes are unpacked in registers by shifts, masks and byte unpacking (int4 rows of whole 32-byte pieces: only
//   split into low and high nibbles, even and odd channels), the query permuted once per group into the unpacked
//   order, and unsigned codes times the signed query is vpmaddubsw's (vpdpbusd's) operand pair as it
//   is (pair sums <= 2 * 15 * 127 add in int16 before one vpmaddwd; at 64 and 128 channels they stay int16 through
//   the sum over 8 tokens' lanes, one vpmaddwd per 2 or 4 tokens). Values quantized per token over groups of
//   channels sum as sum_t p_t v_tc = sum_t (p_t s_tg) code_tc + sum_t p_t z_tg: the weights p_t s_tg rounded per
//   block and channel group to 7 bits of their largest, against the codes interleaved by 4 tokens (int4 rows of
//   whole 32-byte pieces: interleaved while packed, then split into even and odd channels); the zero points' sum
//   in float. Both roundings are centred on the mid-range code: their error's sum times
//   (2^bits - 1) / 2 is added back exactly, so what remains multiplies code - mid, not code.
// - dense bfloat16 / float16 rows (full's cache, a store's full-precision residual) are read where they lie, 16
//   channels a load: bfloat16 widened by a shift and a mask into its even and odd channels (no shuffle per row; the
//   query put in that order once per task, the values' sums back in channel order once per block), float16 by F16C;
//   each row piece widened once for up to four query rows. Decoding them into the scratch first took 20 ns per
//   token and KV head at 4K against 13-17 so (results/perf/simd/reader.md);
// - every other format is decoded by the first kernel's decoders (this file includes it: those stay one copy)
//   and read by float block products. FP8 (E4M3 / E5M2) has no integer path: each byte carries its own exponent,
//   and on one integer grid its values need 18 bits (E4M3: multiples of 2^-9 up to 448), beyond vpmaddubsw's and
//   vpdpbusd's 8-bit operands. BFP's mantissas are integers under an exponent per block of channels, so a score is
//   a sum of per-block integer dots each times its power of two: possible with per-block partial sums (as KIVI's
//   token-axis keys would need), not built.
// - the next block's rows and their scales are prefetched while a block is read (Task::prefetch_block): from
//   memory, the int8 reader otherwise took as long per token as bfloat16's (results/perf/simd/*/30-layers).
// Ablation builds (scripts/bench_reader_parts.py, timing only: their outputs are wrong by design, and the harness
// never builds them): KVBENCH_ABLATE_SCORE leaves every score 0, KVBENCH_ABLATE_SOFTMAX every weight 1 / kB,
// KVBENCH_ABLATE_VALUES adds nothing, KVBENCH_ABLATE_PREFETCH issues no prefetch; what a build without a part saves
// is that part's time, with the loop, the call and the rows' traffic left when all four are off.
// Flash-decoding's split over chunks and the final merge are the first kernel's. The first kernel is kept as it
// is (its runs must reproduce); without AVX2 and FMA this module's attend is the first kernel's.
//
// The integer paths are not bit-exact against float attention. int8: the query's rounding moves a score by at most
// 0.5 / kQ of the row's largest |q| times the key row's L1 norm; the weights' 7-bit rounding moves an output by at
// most 32 / 254 of max|v| (half a step of the block's largest weight per token; measured: about 0.1% of max|v|
// over hundreds of tokens). KIVI int4 / int2: a score moves by at most half the folded query's step times
// sum_c |code_tc - mid|, an output by at most 32 * mid * max(s_v) / 254 from the weights (measured: 0.07-0.17% of
// max|v| over 512 tokens). tests/test_fused.py bounds them all.
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

#include <type_traits>

namespace simd {

constexpr int kB = 32;  // tokens per block: the softmax merged, and int8 weights rounded, once per block
constexpr int kS = 8;   // tokens per sub-block: one vector of scores per query row
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr int kQ = 127;  // the query's integers: vpdpbusd sums (k + 128) * q in int32, no saturation
#else
constexpr int kQ = 63;  // |q| <= 63: vpmaddubsw's pair sums of (k + 128) * q fit int16 (2 * 255 * 63 < 2^15)
#endif
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

// The sums of eight vectors of int16 (lane t: the sum of v[t]'s sixteen lanes, as int32) whose lanes are sums of
// NV pair sums of at most 3810 each (dots_packed_rows): summed in int16 while they fit (2 lanes: 2 NV 3810 <= 30480
// for NV <= 4; 4 lanes for NV <= 2), then by vpmaddwd once per pair or quad of tokens, not once per token.
template <int NV>
inline __m256i hsum8w(const __m256i* v) {
  static_assert(NV >= 1 && NV <= 4, "int16 sums of at most 4 * 3810 per lane");
  const __m256i one = _mm256_set1_epi16(1);
  const __m256i x01 = _mm256_hadd_epi16(v[0], v[1]), x23 = _mm256_hadd_epi16(v[2], v[3]);
  const __m256i x45 = _mm256_hadd_epi16(v[4], v[5]), x67 = _mm256_hadd_epi16(v[6], v[7]);
  __m256i z0, z1;  // per 128 bits: tokens 0 .. 3 and 4 .. 7
  if constexpr (NV <= 2) {
    z0 = _mm256_madd_epi16(_mm256_hadd_epi16(x01, x23), one);
    z1 = _mm256_madd_epi16(_mm256_hadd_epi16(x45, x67), one);
  } else {
    z0 = _mm256_hadd_epi32(_mm256_madd_epi16(x01, one), _mm256_madd_epi16(x23, one));
    z1 = _mm256_hadd_epi32(_mm256_madd_epi16(x45, one), _mm256_madd_epi16(x67, one));
  }
  return _mm256_add_epi32(_mm256_permute2x128_si256(z0, z1, 0x20), _mm256_permute2x128_si256(z0, z1, 0x31));
}

inline __m256i load8(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// acc + the sums of four adjacent products of unsigned bytes u and signed bytes v, per int32 lane: one vpdpbusd
// with VNNI; on AVX2 vpmaddubsw (pairs into int16; the callers' operands cannot saturate) then vpmaddwd.
inline __m256i dp(__m256i acc, __m256i u, __m256i v) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  return _mm256_dpbusd_epi32(acc, u, v);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1)));
#endif
}

// AVX-512 with VNNI: int8 values summed 64 channels a vector (Task::values_i8_wide).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVBENCH_I8_WIDE 1
#else
#define KVBENCH_I8_WIDE 0
#endif

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

// The largest lane and the lanes' sum, in every lane (each lane's operations the same pairs in the same order:
// every lane holds the same value).
inline __m256 allmax(__m256 v) {
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, 0x4E));
  return _mm256_max_ps(v, _mm256_permute_ps(v, 0xB1));
}

inline __m256 allsum(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_add_ps(v, _mm256_permute_ps(v, 0x4E));
  return _mm256_add_ps(v, _mm256_permute_ps(v, 0xB1));
}

// The maxima of four vectors (lane i: the largest of the i-th's lanes), and their sums: one reduction for four rows
// or groups instead of four (each a chain of shuffles the next step waits on).
inline __m128 hmax4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_max_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));  // [a02 b02 a13 b13]
  const __m256 cd = _mm256_max_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256 x = _mm256_max_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));  // [a b c d]
  return _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

// int8 keys with one scale per token (scale over the whole row, no zero point): the integer path.
inline bool int8_folded(const Part& p, int64_t d) {
  return p.bits == 8 && p.mode == 1 && p.scale.type != kNone && p.zero.type == kNone && p.cg >= d && d % 32 == 0;
}

inline float token_factor(const Part& p, int64_t b, int64_t h, int64_t j) {
  const int64_t r = p.tg > 0 ? j / p.tg : 0;
  return p.scale.at(b * p.scale.sb + h * p.scale.sh + r * p.scale.sr);
}

// KIVI's layouts (Liu et al. 2024), unsigned 4- or 2-bit codes packed along the row (the first code of a byte in
// its low bits), rows a whole number of 16-byte pieces. Keys: one scale and zero point per channel and group of tg
// tokens, so q . k_t = sum_c (q_c s_c) code_tc + sum_c q_c z_c: the scale folds into the query once per token
// group, the zero point into one constant per group and query row.
inline bool packed_keys(const Part& p, int64_t d) {
  return (p.bits == 4 || p.bits == 2) && p.mode == 0 && p.scale.type != kNone && p.tg > 0 && p.cg == 1 &&
         d * p.bits % 128 == 0;
}

// Values: one scale and zero point per token and group of cg channels, so sum_t p_t v_tc =
// sum_t (p_t s_tg) code_tc + sum_t p_t z_tg: the weights p_t s_tg rounded per channel group, the zero points'
// sum in float.
inline bool packed_values(const Part& p, int64_t d) {
  return (p.bits == 4 || p.bits == 2) && p.mode == 0 && p.scale.type != kNone && p.tg == 1 && p.cg % 16 == 0 &&
         d * p.bits % 128 == 0;
}

constexpr int kMaxV = 512 / 32;  // code vectors per row (32 codes each) at the widest head
constexpr int kMaxG = 512 / 16;  // value channel groups per row (groups of 16 channels or more)
constexpr int kP = 127;          // the packed paths' integers (query, weights): codes <= 15 keep pair sums in int16

// Where a packed row's codes land once unpacked (unpack_row): code vector v holds 32 codes as bytes, its low 16
// those of channels cb[2v] .. cb[2v] + 15, its high 16 those of cb[2v + 1] .. + 15. Each 32-byte piece of the row
// (32 * per channels) gives per vectors: the low and high 128 bits' fields s, interleaved back into channel order by
// unpacking; a 16-byte tail gives per / 2 vectors of 32 consecutive channels. Returns the number of vectors.
inline int code_layout(int bits, int64_t d, int16_t* cb) {
  const int per = 8 / bits;
  const int64_t bytes = d / per;
  int nv = 0;
  int64_t o = 0;
  for (; o + 32 <= bytes; o += 32, nv += per) {
    for (int f = 0; f < per; ++f) {
      cb[2 * (nv + f)] = static_cast<int16_t>(o * per + 16 * f);
      cb[2 * (nv + f) + 1] = static_cast<int16_t>(o * per + 16 * f + 16 * per);
    }
  }
  if (o < bytes) {
    for (int f = 0; f < per / 2; ++f, ++nv) {
      cb[2 * nv] = static_cast<int16_t>(o * per + 32 * f);
      cb[2 * nv + 1] = static_cast<int16_t>(o * per + 32 * f + 16);
    }
  }
  return nv;
}

// A packed row of `bytes` bytes as code vectors (code_layout's order), by shifts, masks and byte unpacking.
template <int Bits>
inline void unpack_row(const uint8_t* x, int64_t bytes, __m256i* V) {
  int64_t o = 0;
  if constexpr (Bits == 4) {
    const __m256i m = _mm256_set1_epi8(15);
    for (; o + 32 <= bytes; o += 32) {
      const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + o));
      const __m256i lo = _mm256_and_si256(r, m), hi = _mm256_and_si256(_mm256_srli_epi16(r, 4), m);
      *V++ = _mm256_unpacklo_epi8(lo, hi);
      *V++ = _mm256_unpackhi_epi8(lo, hi);
    }
    if (o < bytes) {
      const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + o));
      const __m128i m1 = _mm_set1_epi8(15);
      const __m128i lo = _mm_and_si128(r, m1), hi = _mm_and_si128(_mm_srli_epi16(r, 4), m1);
      *V++ = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    }
  } else {
    const __m256i m = _mm256_set1_epi8(3);
    for (; o + 32 <= bytes; o += 32) {
      const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + o));
      const __m256i f0 = _mm256_and_si256(r, m), f1 = _mm256_and_si256(_mm256_srli_epi16(r, 2), m);
      const __m256i f2 = _mm256_and_si256(_mm256_srli_epi16(r, 4), m);
      const __m256i f3 = _mm256_and_si256(_mm256_srli_epi16(r, 6), m);
      const __m256i a = _mm256_unpacklo_epi8(f0, f1), b = _mm256_unpacklo_epi8(f2, f3);
      const __m256i c = _mm256_unpackhi_epi8(f0, f1), e = _mm256_unpackhi_epi8(f2, f3);
      *V++ = _mm256_unpacklo_epi16(a, b);
      *V++ = _mm256_unpackhi_epi16(a, b);
      *V++ = _mm256_unpacklo_epi16(c, e);
      *V++ = _mm256_unpackhi_epi16(c, e);
    }
    if (o < bytes) {
      const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + o));
      const __m128i m1 = _mm_set1_epi8(3);
      const __m128i f0 = _mm_and_si128(r, m1), f1 = _mm_and_si128(_mm_srli_epi16(r, 2), m1);
      const __m128i f2 = _mm_and_si128(_mm_srli_epi16(r, 4), m1), f3 = _mm_and_si128(_mm_srli_epi16(r, 6), m1);
      const __m128i a = _mm_unpacklo_epi8(f0, f1), b = _mm_unpacklo_epi8(f2, f3);
      const __m128i c = _mm_unpackhi_epi8(f0, f1), e = _mm_unpackhi_epi8(f2, f3);
      *V++ = _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
      *V++ = _mm256_set_m128i(_mm_unpackhi_epi16(c, e), _mm_unpacklo_epi16(c, e));
    }
  }
}

// int4 key rows of whole 32-byte pieces as scored (Task::nib): piece k's low nibbles (channels 64k + 2i, byte i)
// as vector 2k, its high ones (64k + 2i + 1) as 2k + 1: one shift and two masks a piece, no byte unpacking (the
// query is put in this order once per token group instead).
inline void unpack_nibbles(const uint8_t* x, int64_t bytes, __m256i* V) {
  const __m256i m = _mm256_set1_epi8(15);
  for (int64_t o = 0; o < bytes; o += 32) {
    const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + o));
    *V++ = _mm256_and_si256(r, m);
    *V++ = _mm256_and_si256(_mm256_srli_epi16(r, 4), m);
  }
}

// sum_v of the products of unsigned codes V[v] (<= 15) and signed bytes W[v] (|w| <= 127), as eight int32 partial
// sums: vpdpbusd with VNNI; on AVX2 vpmaddubsw's pair sums (<= 2 * 15 * 127) added in int16 for up to eight
// vectors (<= 30480 < 2^15), then one vpmaddwd.
inline __m256i dot_codes(const __m256i* V, const __m256i* W, int nv) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  __m256i a = _mm256_setzero_si256();
  for (int v = 0; v < nv; ++v) a = _mm256_dpbusd_epi32(a, V[v], W[v]);
  return a;
#else
  __m256i a = _mm256_setzero_si256();
  for (int v0 = 0; v0 < nv; v0 += 8) {
    __m256i s16 = _mm256_maddubs_epi16(V[v0], W[v0]);
    for (int v = v0 + 1; v < std::min(nv, v0 + 8); ++v) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(V[v], W[v]));
    a = _mm256_add_epi32(a, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
  }
  return a;
#endif
}

// n entries of a scale or zero point from offset `off` with stride `step` as floats (0 where there is none).
inline void side_row(const Side& s, int64_t off, int64_t step, int64_t n, float* out) {
  if (s.type == kNone) {
    std::fill(out, out + n, 0.f);
    return;
  }
  int64_t c = 0;
#if defined(__F16C__)
  if (s.type == kF16 && step == 1) {
    const uint16_t* x = static_cast<const uint16_t*>(s.ptr) + off;
    for (; c + 8 <= n; c += 8) {
      _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + c))));
    }
  }
#endif
  for (; c < n; ++c) out[c] = s.at(off + c * step);
}

// Dense 16-bit rows with no scale or zero point (full's cache, a quantized store's full-precision residual), rows a
// whole number of 16 channels: read where they lie, not decoded into scratch first. 16 channels a load, as two
// vectors of float32: bfloat16 by a shift and a mask (a 32-bit lane's low half shifted up is the even channel's
// float32, its high half masked the odd one's; no shuffle per row), float16 by two conversions (F16C), in order.
inline bool dense16(const Part& p, int64_t d) {
#if defined(__F16C__)
  const bool half = p.bits == -16;
#else
  const bool half = false;
#endif
  return (p.bits == 16 || half) && p.scale.type == kNone && p.zero.type == kNone && d % 16 == 0;
}

template <bool BF>
inline void pair16(const uint16_t* x, __m256& a, __m256& c) {
  if constexpr (BF) {
    const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
    c = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
#if defined(__F16C__)
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8)));
#endif
  }
}

// One task: query rows q [M, D] (D % 8 == 0) over tokens n0 <= n < n1, leaving the chunk's running maximum,
// denominator and unnormalized sum in mx, l, acc [M, D] (as the first kernel's tasks do).
struct Task {
  const std::vector<Part>* kp;  // the task's row's parts (every row's the same, or each its own: attend_rows)
  const std::vector<Part>* vp;
  int64_t b, h, M, D;
  const float* q;
  float scl;
  const float* mrow0;  // mask rows (nullptr: none), row m at mrow0 + (m / q_len) * ms2 + (m % q_len) * ms3
  int64_t q_len, ms2, ms3, ms4;
  float* mx;
  float* l;
  float* acc;
  // scratch
  float* rows;  // [kS, D]: a sub-block's decoded rows (formats without an integer path)
  float* sbuf;
  float* zbuf;
  int8_t* qi;   // [M, D] the query as integers of at most kQ (made when an int8 part is first met)
  __m256i* X;   // [D / 32][kB / 4][4]: an int8 value block (or a packed one's code vectors) interleaved by 4 tokens
  __m256i* qk;  // [M][kMaxV]: the query folded with a packed key group's scales, as bytes in code_layout's order
  __m256* q16;  // [M][D / 8]: the query in the order 16-bit rows are read (place_query16)
  float qa[kMaxM];
  int32_t qsum[kMaxM];  // 128 times the sum of qi's row: what (k xor 0x80) = k + 128 adds to the dot product
  bool quantized = false;
  int q16_kind = 0;  // what q16 holds: 0 nothing yet, 16 bfloat16's order, -16 float16's
  alignas(32) float s[kMaxM][kB];
  alignas(32) float f[kB];
  __m256 lv[kMaxM];  // each row's denominator as eight partial sums (one reduction per task, not per block)
  float fs[kS];
  __m256i ibuf[kMaxM][kS];  // int8 keys: per query row and token, eight partial sums of the dot product
  // packed keys: the token group qk was folded for, each row's integer step and constant sum_c q_c z_c
  const Part* kq_part = nullptr;
  int64_t kq_r = -1;
  __m256 ka[kMaxM], kz[kMaxM];  // in every lane (the scores' operands as they are)
  int16_t cb[2 * kMaxV];  // code_layout of cb_bits-bit rows
  int nv = 0, cb_bits = 0;
  bool nib = false;  // int4 keys of whole 32-byte pieces: scored in nibble order (unpack_nibbles), not cb's
  __m256 fbuf[kMaxM][kS];  // dense 16-bit keys: per query row and token, eight partial sums of the dot product
  alignas(32) float vs[kMaxG][kB], vz[kMaxG][kB];  // packed values: a block's scales and zero points by group
  // packed values' weights for every (row, channel group) pair at once where there are at most kWB pairs
  static constexpr int kWB = 16;
  alignas(32) int32_t wqb[kWB][kB / 4];
  float gvb[kWB], zsb[kWB];
  bool anyb[kMaxM];

  // The next task: its batch row, KV head, query rows, mask rows and results; what was cached for the last one's
  // query (its int8 rounding, a key group's folded query) is dropped.
  void start(const std::vector<Part>* kp_, const std::vector<Part>* vp_, int64_t b_, int64_t h_, const float* q_,
             const float* mrow0_, float* mx_, float* l_, float* acc_) {
    kp = kp_, vp = vp_, b = b_, h = h_, q = q_, mrow0 = mrow0_, mx = mx_, l = l_, acc = acc_;
    quantized = false;
    q16_kind = 0;
    kq_part = nullptr;
    kq_r = -1;
  }
  void layout(int bits) {
    if (cb_bits != bits) nv = code_layout(bits, D, cb), cb_bits = bits, nib = bits == 4 && D % 64 == 0;
  }

  // out[t] = the scale of token j0 + t for t < n, 0 for n <= t < len: float16 scales 8 at a time where there is one
  // per token (side_row), not one call per token.
  void token_factors(const Part& p, int64_t j0, int n, int len, float* out) {
    if (p.tg == 1) {
      side_row(p.scale, b * p.scale.sb + h * p.scale.sh + j0 * p.scale.sr, p.scale.sr, n, out);
    } else {
      for (int t = 0; t < n; ++t) out[t] = token_factor(p, b, h, j0 + t);
    }
    std::fill(out + n, out + len, 0.f);
  }

  // qk and ka, kz for key token group r of part p: q_c s_rc rounded per row to integers of at most kP (a step
  // ka = max_c |q_c s_rc| / kP), and kz = sum_c q_c z_rc in float plus the rounding's error against a mid-range
  // code (ka * mid * sum_c (q_c s_rc / ka - round(q_c s_rc / ka)), from the rounded integers' sum). At 64 and 128
  // channels the group's scales, zero points and each row's products stay in registers (one pass per row).
  __attribute__((noinline)) void fold_query(const Part& p, int64_t r) {
    if (D == 64) fold_rows<8>(p, r);
    else if (D == 128) fold_rows<16>(p, r);
    else fold_rows<0>(p, r);
    kq_part = &p;
    kq_r = r;
  }

  // n = 8 ND (ND > 0) or D entries of side s (token group r, channel stride sc) as vectors: float16 with unit
  // stride converted 8 at a time, others through buf.
  template <int ND>
  void side_vectors(const Side& sd, int64_t r, float* buf, __m256* out) {
#if defined(__F16C__)
    if (ND > 0 && sd.type == kF16 && sd.sc == 1) {
      const uint16_t* x = static_cast<const uint16_t*>(sd.ptr) + b * sd.sb + h * sd.sh + r * sd.sr;
      for (int i = 0; i < ND; ++i) out[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * i)));
      return;
    }
#endif
    side_row(sd, b * sd.sb + h * sd.sh + r * sd.sr, sd.sc, D, buf);
    for (int i = 0; i < ND; ++i) out[i] = _mm256_loadu_ps(buf + 8 * i);
  }

  // Row m's rounded query (bytes[k]: channels 32k .. 32k + 31 in order) into qk in the order the keys are scored:
  // nibble order (nib: per 64 channels the even ones, then the odd ones) or code_layout's.
  void place_query(int64_t m, const __m256i* bytes) {
    if (nib) {
      const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                             0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
      for (int64_t k = 0; k < D / 64; ++k) {
        // per 128 bits: 8 even channels, then 8 odd; then the quarters gathered into channel order
        const __m256i a = _mm256_shuffle_epi8(bytes[2 * k], split), c = _mm256_shuffle_epi8(bytes[2 * k + 1], split);
        qk[m * kMaxV + 2 * k] = _mm256_permute4x64_epi64(_mm256_unpacklo_epi64(a, c), 0xD8);
        qk[m * kMaxV + 2 * k + 1] = _mm256_permute4x64_epi64(_mm256_unpackhi_epi64(a, c), 0xD8);
      }
      return;
    }
    auto half = [&](int64_t c) {
      const __m256i w = bytes[c / 32];
      return c % 32 ? _mm256_extracti128_si256(w, 1) : _mm256_castsi256_si128(w);
    };
    for (int v = 0; v < nv; ++v) qk[m * kMaxV + v] = _mm256_set_m128i(half(cb[2 * v + 1]), half(cb[2 * v]));
  }

  template <int ND>
  void fold_rows(const Part& p, int64_t r) {
    constexpr int NR = ND > 0 ? ND : 512 / 8;
    const int nd = ND > 0 ? ND : static_cast<int>(D / 8);
    const float mid = ((1 << p.bits) - 1) / 2.f;
    __m256 sv[NR], zv[NR];  // ND > 0: registers
    side_vectors<ND>(p.scale, r, sbuf, sv);
    side_vectors<ND>(p.zero, r, zbuf, zv);
    if constexpr (ND == 0) {
      for (int i = 0; i < nd; ++i) sv[i] = _mm256_loadu_ps(sbuf + 8 * i), zv[i] = _mm256_loadu_ps(zbuf + 8 * i);
    }
    const __m256 sign = set1(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the two packs' lane order undone
    const __m256i one = _mm256_set1_epi16(1);
    for (int64_t m = 0; m < M; ++m) {
      const float* qm = q + m * D;
      __m256 qs[NR];
      __m256 top = _mm256_setzero_ps(), zs = _mm256_setzero_ps(), tot = _mm256_setzero_ps();
      for (int i = 0; i < nd; ++i) {
        const __m256 qv = _mm256_loadu_ps(qm + 8 * i);
        qs[i] = _mm256_mul_ps(qv, sv[i]);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, qs[i]));
        zs = _mm256_fmadd_ps(qv, zv[i], zs);
        tot = _mm256_add_ps(tot, qs[i]);
      }
      // the largest in every lane, the step and its inverse as vectors: no round trip through a scalar (and the
      // compare, division and broadcasts it took) on the chain the rounding waits on
      const __m256 t = allmax(top);
      const __m256 inv = _mm256_and_ps(_mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_div_ps(set1(kP), t));
      // x / step rounded (ties to even) and packed to bytes; the integers' sum in int16 (|.| <= 127 D / 16)
      __m256i bytes[kMaxV], isum = _mm256_setzero_si256();
      for (int c = 0; c < nd / 4; ++c) {
        __m256i ii[4];
        for (int i = 0; i < 4; ++i) ii[i] = _mm256_cvtps_epi32(_mm256_mul_ps(qs[4 * c + i], inv));
        const __m256i p0 = _mm256_packs_epi32(ii[0], ii[1]), p1 = _mm256_packs_epi32(ii[2], ii[3]);
        isum = _mm256_add_epi16(isum, _mm256_add_epi16(p0, p1));
        bytes[c] = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p0, p1), order);
      }
      place_query(m, bytes);
      ka[m] = _mm256_div_ps(t, set1(kP));
      // sum_c (x_c / step - round): the rounding's error against a mid-range code, folded into kz with one reduction
      const __m256 res = _mm256_sub_ps(_mm256_mul_ps(tot, inv), _mm256_cvtepi32_ps(_mm256_madd_epi16(isum, one)));
      kz[m] = allsum(_mm256_fmadd_ps(res, _mm256_mul_ps(ka[m], set1(mid)), zs));
    }
  }

  // ibuf[m][t]: qk_m . codes of row r[t], as eight int32 partial sums; each row unpacked once for every query row.
  // For the common widths (NV > 0) isum[m] (lane t: the whole dot product of token t) directly: the query rows'
  // vectors held in registers, up to four rows a pass; on AVX2 the products stay in int16 through the reduction
  // (hsum8w: no vpmaddwd per token).
  template <int Bits, int NV>
  void dots_packed(const uint8_t* const* r, __m256i* isum) {
    if constexpr (NV > 0) {
      row_groups([&](auto g, int64_t m0) { dots_packed_rows<Bits, NV, decltype(g)::value>(r, m0, isum); });
    } else {
      for (int t = 0; t < kS; ++t) {
        __m256i V[kMaxV];
        if (Bits == 4 && nib) unpack_nibbles(r[t], D / 2, V);
        else unpack_row<Bits>(r[t], D * Bits / 8, V);
        for (int64_t m = 0; m < M; ++m) ibuf[m][t] = dot_codes(V, qk + m * kMaxV, nv);
      }
      for (int64_t m = 0; m < M; ++m) isum[m] = hsum8i(ibuf[m]);
    }
  }

  template <int Bits, int NV, int G>
  void dots_packed_rows(const uint8_t* const* r, int64_t m0, __m256i* isum) {
    __m256i qv[G][NV];
    for (int g = 0; g < G; ++g) {
      for (int v = 0; v < NV; ++v) qv[g][v] = qk[(m0 + g) * kMaxV + v];
    }
    for (int t = 0; t < kS; ++t) {
      __m256i V[NV];
      if constexpr (Bits == 4) unpack_nibbles(r[t], NV * 16, V);  // NV = 2, 4: 64 or 128 channels (nib)
      else unpack_row<Bits>(r[t], NV * 4 * Bits, V);
      for (int g = 0; g < G; ++g) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
        ibuf[m0 + g][t] = dot_codes(V, qv[g], NV);
#else
        // pair sums <= 2 * 15 * 127 = 3810, NV <= 4 of them per lane: int16 (hsum8w's bound)
        __m256i s16 = _mm256_maddubs_epi16(V[0], qv[g][0]);
        for (int v = 1; v < NV; ++v) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(V[v], qv[g][v]));
        ibuf[m0 + g][t] = s16;
#endif
      }
    }
    for (int g = 0; g < G; ++g) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
      isum[m0 + g] = hsum8i(ibuf[m0 + g]);
#else
      isum[m0 + g] = hsum8w<NV>(ibuf[m0 + g]);
#endif
    }
  }

  // f(G, m0) for the query rows in groups of up to four (rows m0 .. m0 + G - 1), G a compile-time constant: the
  // paths that load a row of the cache once for several query rows keep that many rows' sums in registers.
  template <typename F>
  void row_groups(F&& f) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: f(std::integral_constant<int, 4>{}, m0); break;
        case 3: f(std::integral_constant<int, 3>{}, m0); break;
        case 2: f(std::integral_constant<int, 2>{}, m0); break;
        default: f(std::integral_constant<int, 1>{}, m0);
      }
    }
  }

  // f(bits, code vectors) with both as compile-time constants for the common widths (64 and 128 channels), the
  // number of vectors left to run time (0) for the others: the loops over a row's vectors unroll into registers.
  template <typename F>
  void packed_kind(int bits, F&& f) {
    using I2 = std::integral_constant<int, 2>;
    using I4 = std::integral_constant<int, 4>;
    using I0 = std::integral_constant<int, 0>;
    if (bits == 4) {
      if (nv == 2) f(I4{}, I2{});
      else if (nv == 4) f(I4{}, I4{});
      else f(I4{}, I0{});
    } else {
      if (nv == 2) f(I2{}, I2{});
      else if (nv == 4) f(I2{}, I4{});
      else f(I2{}, I0{});
    }
  }

  // s[m][0:n] for a block of packed keys, 8 tokens a pass: ka * (qk . codes) + kz per token group (a pass that
  // straddles two groups is scored once per group, each token's lane kept from its own). Not inlined (nor
  // fold_query): inlined into run, it cost the int8 path ~15% (measured), through the register allocation of the
  // loop they share.
  __attribute__((noinline)) void score_packed(const Part& p, int64_t j0, int n) {
    layout(p.bits);
    const uint8_t* base = static_cast<const uint8_t*>(p.data) + b * p.sb + h * p.sh;
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t gf = j0 / p.tg, gs = gf * p.tg;  // the group of the sub-block's first token and that group's first token
    // one dispatch per block, the sub-blocks' groups followed without a division each
    packed_kind(p.bits, [&](auto bits, auto vecs) {
      for (int o = 0; o < n; o += kS) {
        const int k = std::min(kS, n - o);
        const int64_t j = j0 + o;
        const uint8_t* r[kS];
        for (int t = 0; t < kS; ++t) r[t] = base + (j + std::min(t, k - 1)) * p.sn;  // past k: masked later
        while (j >= gs + p.tg) ++gf, gs += p.tg;
        int64_t g1 = gf;
        for (int64_t e = gs + p.tg; j + k - 1 >= e; e += p.tg) ++g1;
        for (int64_t g = gf; g <= g1; ++g) {
          if (kq_part != &p || kq_r != g) fold_query(p, g);
          __m256i isum[kMaxM];
          dots_packed<decltype(bits)::value, decltype(vecs)::value>(r, isum);
          const __m256 lanes = _mm256_and_ps(
              _mm256_cmp_ps(iota, set1(static_cast<float>(g * p.tg - j)), _CMP_GE_OQ),
              _mm256_cmp_ps(iota, set1(static_cast<float>((g + 1) * p.tg - j)), _CMP_LT_OQ));
          for (int64_t m = 0; m < M; ++m) {
            const __m256 sc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), ka[m], kz[m]);
            _mm256_store_ps(s[m] + o, gf == g1 ? sc : _mm256_blendv_ps(_mm256_load_ps(s[m] + o), sc, lanes));
          }
        }
      }
    });
  }

  // qi, qa, qsum for every query row, 32 channels a pass: q / qa rounded (ties to even) and packed to bytes.
  void quantize_query() {
    const __m256 sign = set1(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the two packs' lane order undone
    for (int64_t m = 0; m < M; ++m) {
      const float* qm = q + m * D;
      __m256 mv = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) mv = _mm256_max_ps(mv, _mm256_andnot_ps(sign, _mm256_loadu_ps(qm + c)));
      const float top = hmax(mv);
      const float a = top > 0.f ? top / kQ : 1.f;
      qa[m] = a;
      const __m256 inv = set1(1.f / a);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t c = 0; c < D; c += 32) {
        __m256i ii[4];
        for (int i = 0; i < 4; ++i) {
          ii[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qm + c + 8 * i), inv));
          sum = _mm256_add_epi32(sum, ii[i]);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + m * D + c), _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(ii[0], ii[1]), _mm256_packs_epi32(ii[2], ii[3])), order));
      }
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
      qsum[m] = 128 * (lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7]);
    }
    quantized = true;
  }

  // ibuf[m0 + g][t] for g < G: qi_(m0+g) . (key_t + 128) as eight int32 partial sums. Each key vector is loaded
  // and made unsigned (its sign bit flipped) once for the G rows.
  template <int G, int NC>
  void dots_i8(const int8_t* const* r, int64_t m0) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    if constexpr (NC > 0) {  // the common widths: the query rows' vectors held in registers across the 8 tokens
      __m256i qv[G][NC];
      for (int g = 0; g < G; ++g) {
        for (int k = 0; k < NC; ++k) qv[g][k] = load8(qi + (m0 + g) * D + 32 * k);
      }
      for (int t = 0; t < kS; ++t) {
        __m256i ku[NC];
        for (int k = 0; k < NC; ++k) ku[k] = _mm256_xor_si256(load8(r[t] + 32 * k), flip);
        for (int g = 0; g < G; ++g) {
          __m256i a = _mm256_setzero_si256();
          for (int k = 0; k < NC; ++k) a = dp(a, ku[k], qv[g][k]);
          ibuf[m0 + g][t] = a;
        }
      }
    } else {
      for (int t = 0; t < kS; ++t) {
        __m256i a[G];
        for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_si256();
        for (int64_t c = 0; c < D; c += 32) {
          const __m256i ku = _mm256_xor_si256(load8(r[t] + c), flip);
          for (int g = 0; g < G; ++g) a[g] = dp(a[g], ku, load8(qi + (m0 + g) * D + c));
        }
        for (int g = 0; g < G; ++g) ibuf[m0 + g][t] = a[g];
      }
    }
  }

  template <int NC>
  void dots_i8_rows(const int8_t* const* r) {
    // each key vector loaded once for up to four query rows
    row_groups([&](auto g, int64_t m0) { dots_i8<decltype(g)::value, NC>(r, m0); });
  }

  // Decoded rows j0 <= j < j0 + n (n <= kS) of part p into rows[0:n] (zeros after), their factors into fs.
  void decode(const Part& p, int64_t j0, int n) {
    auto keep = [&](const float*, const float* fac, const int64_t* col, int k) {
      for (int i = 0; i < k; ++i) fs[col[i]] = fac[i];
    };
    Tile<decltype(keep)> tile{keep, D, rows};
    dispatch_rows(p, b, h, j0, j0 + n, D, -j0, sbuf, zbuf, tile);
    tile.flush();
    for (int t = n; t < kS; ++t) {
      std::fill(rows + t * D, rows + (t + 1) * D, 0.f);
      fs[t] = 0.f;
    }
  }

  // s[m][0:n] for a block of int8 keys with one scale per token, 8 tokens a pass (not inlined into run, as
  // score_packed: the bf16 path's loop keeps its registers).
  __attribute__((noinline)) void score_i8(const Part& p, int64_t j0, int n) {
    if (!quantized) quantize_query();
    const int8_t* base = static_cast<const int8_t*>(p.data) + b * p.sb + h * p.sh;
    for (int o = 0; o < n; o += kS) {
      const int k = std::min(kS, n - o);
      const int8_t* r[kS];
      for (int t = 0; t < kS; ++t) r[t] = base + (j0 + o + std::min(t, k - 1)) * p.sn;  // past k: masked later
      token_factors(p, j0 + o, k, kS, fs);
      if (D == 64) dots_i8_rows<2>(r);
      else if (D == 128) dots_i8_rows<4>(r);
      else dots_i8_rows<0>(r);
      const __m256 fv = _mm256_loadu_ps(fs);
      for (int64_t m = 0; m < M; ++m) {
        const __m256i d = _mm256_sub_epi32(hsum8i(ibuf[m]), _mm256_set1_epi32(qsum[m]));
        _mm256_store_ps(s[m] + o, _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(fv, set1(qa[m]))));
      }
    }
  }

  // q16 for every query row: per 16 channels the two vectors pair16 gives a row as (bfloat16: the even channels,
  // then the odd; float16: in order), once per task and width.
  template <bool BF>
  void place_query16() {
    if (q16_kind == (BF ? 16 : -16)) return;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t c = 0; c < D; c += 16) {
        const float* x = q + m * D + c;
        alignas(32) float a[8], e[8];
        for (int i = 0; i < 8; ++i) a[i] = BF ? x[2 * i] : x[i], e[i] = BF ? x[2 * i + 1] : x[8 + i];
        q16[m * (D / 8) + c / 8] = _mm256_load_ps(a);
        q16[m * (D / 8) + c / 8 + 1] = _mm256_load_ps(e);
      }
    }
    q16_kind = BF ? 16 : -16;
  }

  // fbuf[m0 + g][t] for g < G: q_(m0+g) . key_t as eight partial sums; each row's 16-channel pieces loaded and
  // widened once for the G query rows (NP pieces a row: a constant for the common widths, 0 = D / 16).
  template <bool BF, int G, int NP>
  void dots16(const uint16_t* const* r, int64_t m0) {
    const int np = NP ? NP : static_cast<int>(D / 16);
    const __m256* qv = q16 + m0 * (D / 8);
    for (int t = 0; t < kS; ++t) {
      __m256 ae[G], ao[G];
      for (int g = 0; g < G; ++g) ae[g] = ao[g] = _mm256_setzero_ps();
      for (int k = 0; k < np; ++k) {
        __m256 e, o;
        pair16<BF>(r[t] + 16 * k, e, o);
        for (int g = 0; g < G; ++g) {
          ae[g] = _mm256_fmadd_ps(qv[g * (D / 8) + 2 * k], e, ae[g]);
          ao[g] = _mm256_fmadd_ps(qv[g * (D / 8) + 2 * k + 1], o, ao[g]);
        }
      }
      for (int g = 0; g < G; ++g) fbuf[m0 + g][t] = _mm256_add_ps(ae[g], ao[g]);
    }
  }

  template <bool BF, int NP>
  void dots16_rows(const uint16_t* const* r) {
    // each row piece widened once for up to four query rows
    row_groups([&](auto g, int64_t m0) { dots16<BF, decltype(g)::value, NP>(r, m0); });
  }

  // s[m][0:n] for a block of dense 16-bit keys, 8 tokens a pass (not inlined, as score_i8).
  template <bool BF>
  __attribute__((noinline)) void score_dense16(const Part& p, int64_t j0, int n) {
    place_query16<BF>();
    const uint16_t* base = static_cast<const uint16_t*>(p.data) + b * p.sb + h * p.sh;
    for (int o = 0; o < n; o += kS) {
      const int k = std::min(kS, n - o);
      const uint16_t* r[kS];
      for (int t = 0; t < kS; ++t) r[t] = base + (j0 + o + std::min(t, k - 1)) * p.sn;  // past k: masked later
      if (D == 64) dots16_rows<BF, 4>(r);
      else if (D == 128) dots16_rows<BF, 8>(r);
      else dots16_rows<BF, 0>(r);
      for (int64_t m = 0; m < M; ++m) _mm256_store_ps(s[m] + o, hsum8(fbuf[m]));
    }
  }

  // acc[m0 + g] += sum_t s[m0 + g][t] value_t for g < G over dense 16-bit values: P pieces of 16 channels a pass
  // (2 G chains of sums each, so that enough are in flight for the FMA units' latency), each row piece widened
  // once for the G rows; bfloat16's even and odd channels put back in order once per piece and block.
  template <bool BF, int G, int P>
  void vals16(const uint16_t* const* r, int n, int64_t m0, int k0) {
    __m256 ae[P][G], ao[P][G];
    for (int i = 0; i < P; ++i) {
      for (int g = 0; g < G; ++g) ae[i][g] = ao[i][g] = _mm256_setzero_ps();
    }
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < P; ++i) {
        __m256 e, o;
        pair16<BF>(r[t] + 16 * (k0 + i), e, o);
        for (int g = 0; g < G; ++g) {
          const __m256 w = _mm256_broadcast_ss(s[m0 + g] + t);
          ae[i][g] = _mm256_fmadd_ps(w, e, ae[i][g]);
          ao[i][g] = _mm256_fmadd_ps(w, o, ao[i][g]);
        }
      }
    }
    for (int i = 0; i < P; ++i) {
      for (int g = 0; g < G; ++g) {
        float* dst = acc + (m0 + g) * D + 16 * (k0 + i);
        __m256 c0 = ae[i][g], c1 = ao[i][g];
        if constexpr (BF) {  // [0 2 4 6 | 8 10 12 14] and [1 3 5 7 | 9 11 13 15] to [0 .. 7] and [8 .. 15]
          const __m256 lo = _mm256_unpacklo_ps(c0, c1), hi = _mm256_unpackhi_ps(c0, c1);
          c0 = _mm256_permute2f128_ps(lo, hi, 0x20);
          c1 = _mm256_permute2f128_ps(lo, hi, 0x31);
        }
        _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), c0));
        _mm256_storeu_ps(dst + 8, _mm256_add_ps(_mm256_loadu_ps(dst + 8), c1));
      }
    }
  }

  template <bool BF, int G>
  void vals16_rows(const uint16_t* const* r, int n, int64_t m0) {
    constexpr int P = G <= 3 ? 2 : 1;  // 4 P G accumulators: at most 12 of the 16 vector registers
    const int np = static_cast<int>(D / 16);
    int k = 0;
    for (; k + P <= np; k += P) vals16<BF, G, P>(r, n, m0, k);
    for (; k < np; ++k) vals16<BF, G, 1>(r, n, m0, k);
  }

  template <bool BF>
  __attribute__((noinline)) void values_dense16(const Part& p, int64_t j0, int n) {
    const uint16_t* base = static_cast<const uint16_t*>(p.data) + b * p.sb + h * p.sh;
    const uint16_t* r[kB];
    for (int t = 0; t < n; ++t) r[t] = base + (j0 + t) * p.sn;
    row_groups([&](auto g, int64_t m0) { vals16_rows<BF, decltype(g)::value>(r, n, m0); });
  }

  // s[m][o:o+8] = q_m . key_t for the sub-block's tokens j0 <= j < j0 + n (n <= kS; the rest masked later).
  void score_sub(const Part& p, int64_t j0, int n, int o) {
    decode(p, j0, n);
    const __m256 fv = _mm256_loadu_ps(fs);
    for (int64_t m = 0; m < M; ++m) {
      __m256 a[kS];
      for (int t = 0; t < kS; ++t) a[t] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + m * D + c);
        for (int t = 0; t < kS; ++t) a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + t * D + c), a[t]);
      }
      _mm256_store_ps(s[m] + o, _mm256_mul_ps(hsum8(a), fv));
    }
  }

  void score(const Part& p, int64_t j0, int n) {
#if KVBENCH_ABLATE_SCORE
    for (int64_t m = 0; m < M; ++m) std::fill(s[m], s[m] + kB, 0.f);
    return;
#endif
    if (packed_keys(p, D)) return score_packed(p, j0, n);
    if (int8_folded(p, D)) return score_i8(p, j0, n);
    if (dense16(p, D)) return p.bits == 16 ? score_dense16<true>(p, j0, n) : score_dense16<false>(p, j0, n);
    for (int o = 0; o < n; o += kS) score_sub(p, j0 + o, std::min(kS, n - o), o);
  }

  // The block's scores to probabilities, merged into each row's running maximum, denominator and sum.
  // Returns whether any row has a nonzero probability (else the values need not be read).
  bool softmax(int64_t n_abs, int n) {
#if KVBENCH_ABLATE_SOFTMAX
    for (int64_t m = 0; m < M; ++m) std::fill(s[m], s[m] + kB, 1.f / kB);
    return true;
#endif
    bool any = false;
    const __m256 ninf = set1(-std::numeric_limits<float>::infinity());
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 lanes[kB / 8];  // the block's tokens (once for every row)
    for (int v = 0; v < kB / 8; ++v) {
      lanes[v] = _mm256_cmp_ps(_mm256_add_ps(iota, set1(8.f * v)), set1(static_cast<float>(n)), _CMP_LT_OQ);
    }
    for (int64_t m = 0; m < M; ++m) {
      __m256 sv[kB / 8];
      const float* mr = mrow0 ? mrow0 + (m / q_len) * ms2 + (m % q_len) * ms3 + n_abs * ms4 : nullptr;
      for (int v = 0; v < kB / 8; ++v) {
        sv[v] = _mm256_mul_ps(_mm256_load_ps(s[m] + 8 * v), set1(scl));
        if (mr) {
          alignas(32) float add[8];
          for (int t = 0; t < 8; ++t) add[t] = 8 * v + t < n ? mr[(8 * v + t) * ms4] : 0.f;
          sv[v] = _mm256_add_ps(sv[v], _mm256_load_ps(add));
        }
        if (n < kB) sv[v] = _mm256_blendv_ps(ninf, sv[v], lanes[v]);  // a short block's tail
      }
      __m256 mv = sv[0];
      for (int v = 1; v < kB / 8; ++v) mv = _mm256_max_ps(mv, sv[v]);
      const float top = hmax(mv);
      if (!(top > -std::numeric_limits<float>::infinity())) {  // masked everywhere in the block (or NaN)
        for (int v = 0; v < kB / 8; ++v) _mm256_store_ps(s[m] + 8 * v, _mm256_setzero_ps());
        continue;
      }
      if (top > mx[m]) {  // a new maximum: what was summed so far is scaled to it
        const float corr = std::isinf(mx[m]) ? 0.f : std::exp(mx[m] - top);
        lv[m] = _mm256_mul_ps(lv[m], set1(corr));
        float* am = acc + m * D;
        const __m256 cv = set1(corr);
        for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(am + c, _mm256_mul_ps(_mm256_loadu_ps(am + c), cv));
        mx[m] = top;
      }
      __m256 total = _mm256_setzero_ps();
      for (int v = 0; v < kB / 8; ++v) {
        const __m256 pv = exp256(_mm256_sub_ps(sv[v], set1(mx[m])));
        total = _mm256_add_ps(total, pv);
        _mm256_store_ps(s[m] + 8 * v, pv);
      }
      lv[m] = _mm256_add_ps(lv[m], total);
      any = true;
    }
    return any;
  }

  // Row m's block weights (probability times the token's scale, f) rounded to 7-bit unsigned integers of the
  // block's largest, token quad qd's four as the bytes of wq[qd]; returns that largest (not above 0: the row adds
  // nothing this block, and wq is left as it was).
  float quad_weights(int64_t m, int32_t* wq) {
    __m256 w[kB / 8];
    __m256 mv = _mm256_setzero_ps();
    for (int v = 0; v < kB / 8; ++v) {
      w[v] = _mm256_mul_ps(_mm256_load_ps(s[m] + 8 * v), _mm256_load_ps(f + 8 * v));
      mv = _mm256_max_ps(mv, w[v]);
    }
    const float top = hmax(mv);
    if (!(top > 0.f)) return top;
    const __m256 inv = set1(127.f / top);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the two packs' lane order undone
    __m256i wi[4];
    for (int v = 0; v < 4; ++v) wi[v] = _mm256_cvtps_epi32(_mm256_mul_ps(w[v], inv));
    _mm256_store_si256(reinterpret_cast<__m256i*>(wq), _mm256_permutevar8x32_epi32(_mm256_packus_epi16(
        _mm256_packs_epi32(wi[0], wi[1]), _mm256_packs_epi32(wi[2], wi[3])), order));
    return top;
  }

#if KVBENCH_I8_WIDE
  // values_i8 with 64 channels a vector (AVX-512 with VNNI, head_dim % 64 == 0): the same weights and the same
  // integer sums (exact), so the same outputs, in half the interleaving and half the vpdpbusd. Each 128-bit lane
  // of a 64-channel piece's four vectors holds 4 channels of its 16; they are put back in channel order once per
  // row and block (a 4 x 4 transpose of 128-bit lanes), not per token.
  void values_i8_wide(const int8_t* const* r, int quads) {
    __m512i* X5 = reinterpret_cast<__m512i*>(X);  // [D / 64][kB / 4][4], the same bytes as X's [D / 32][kB / 4][4]
    for (int64_t c = 0, k = 0; c < D; c += 64, ++k) {
      for (int qd = 0; qd < quads; ++qd) {
        const __m512i r0 = _mm512_loadu_si512(r[4 * qd] + c), r1 = _mm512_loadu_si512(r[4 * qd + 1] + c);
        const __m512i r2 = _mm512_loadu_si512(r[4 * qd + 2] + c), r3 = _mm512_loadu_si512(r[4 * qd + 3] + c);
        const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1), hi01 = _mm512_unpackhi_epi8(r0, r1);
        const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3), hi23 = _mm512_unpackhi_epi8(r2, r3);
        __m512i* x = X5 + (k * (kB / 4) + qd) * 4;  // per 128-bit lane L: channels 16 L + 4 i .. + 3 in x[i]
        _mm512_storeu_si512(x, _mm512_unpacklo_epi16(lo01, lo23));
        _mm512_storeu_si512(x + 1, _mm512_unpackhi_epi16(lo01, lo23));
        _mm512_storeu_si512(x + 2, _mm512_unpacklo_epi16(hi01, hi23));
        _mm512_storeu_si512(x + 3, _mm512_unpackhi_epi16(hi01, hi23));
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      alignas(32) int32_t wq[kB / 4];
      const float top = quad_weights(m, wq);
      if (!(top > 0.f)) continue;
      const __m512 gv = _mm512_set1_ps(top / 127.f);
      float* am = acc + m * D;
      for (int64_t c = 0, k = 0; c < D; c += 64, ++k) {
        const __m512i* x = X5 + k * (kB / 4) * 4;
        __m512i a[4];
        for (int i = 0; i < 4; ++i) a[i] = _mm512_setzero_si512();
        for (int qd = 0; qd < quads; ++qd) {
          const __m512i wv = _mm512_set1_epi32(wq[qd]);
          for (int i = 0; i < 4; ++i) a[i] = _mm512_dpbusd_epi32(a[i], wv, _mm512_loadu_si512(x + qd * 4 + i));
        }
        // out[L] = lane L of a[0..3]: channels 16 L .. 16 L + 15 in order
        const __m512i t0 = _mm512_shuffle_i32x4(a[0], a[1], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i t1 = _mm512_shuffle_i32x4(a[2], a[3], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i t2 = _mm512_shuffle_i32x4(a[0], a[1], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i t3 = _mm512_shuffle_i32x4(a[2], a[3], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i out[4] = {_mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)),
                                _mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(3, 1, 3, 1))};
        for (int i = 0; i < 4; ++i) {
          _mm512_storeu_ps(am + c + 16 * i,
                           _mm512_fmadd_ps(_mm512_cvtepi32_ps(out[i]), gv, _mm512_loadu_ps(am + c + 16 * i)));
        }
      }
    }
  }
#endif

  // acc[m] += sum_t s[m][t] * value_t over int8 values with one scale per token: per query row, the block's
  // weights (probability times the token's scale) rounded to 7-bit unsigned integers of the block's largest,
  // vpmaddubsw's unsigned operand (pair sums cannot saturate: 2 * 127 * 128 < 2^15), against the values
  // interleaved by 4 tokens (interleaved once for every row).
  void values_i8(const Part& p, int64_t j0, int n) {
    const int8_t* base = static_cast<const int8_t*>(p.data) + b * p.sb + h * p.sh;
    const int8_t* r[kB];
    for (int t = 0; t < kB; ++t) r[t] = base + (j0 + std::min(t, n - 1)) * p.sn;  // past n: weight 0
    token_factors(p, j0, n, kB, f);
    const int quads = (n + 3) / 4;
#if KVBENCH_I8_WIDE
    if (D % 64 == 0) return values_i8_wide(r, quads);
#endif
    // X[k][qd][i] holds, per channel, the bytes of tokens 4 qd .. 4 qd + 3, for channels 32k + 4i .. +3 (low
    // 128 bits) and 32k + 16 + 4i .. +3 (high).
    for (int64_t c = 0, k = 0; c < D; c += 32, ++k) {
      for (int qd = 0; qd < quads; ++qd) {
        const __m256i r0 = load8(r[4 * qd] + c), r1 = load8(r[4 * qd + 1] + c);
        const __m256i r2 = load8(r[4 * qd + 2] + c), r3 = load8(r[4 * qd + 3] + c);
        const __m256i lo01 = _mm256_unpacklo_epi8(r0, r1), hi01 = _mm256_unpackhi_epi8(r0, r1);
        const __m256i lo23 = _mm256_unpacklo_epi8(r2, r3), hi23 = _mm256_unpackhi_epi8(r2, r3);
        __m256i* x = X + (k * (kB / 4) + qd) * 4;
        x[0] = _mm256_unpacklo_epi16(lo01, lo23);
        x[1] = _mm256_unpackhi_epi16(lo01, lo23);
        x[2] = _mm256_unpacklo_epi16(hi01, hi23);
        x[3] = _mm256_unpackhi_epi16(hi01, hi23);
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      alignas(32) int32_t wq[kB / 4];
      const float top = quad_weights(m, wq);
      if (!(top > 0.f)) continue;
      const __m256 gv = set1(top / 127.f);
      float* am = acc + m * D;
      for (int64_t c = 0, k = 0; c < D; c += 32, ++k) {
        const __m256i* x = X + k * (kB / 4) * 4;
        __m256i a[4];
        for (int i = 0; i < 4; ++i) a[i] = _mm256_setzero_si256();
        for (int qd = 0; qd < quads; ++qd) {
          const __m256i wv = _mm256_set1_epi32(wq[qd]);
          for (int i = 0; i < 4; ++i) a[i] = dp(a[i], wv, x[qd * 4 + i]);
        }
        const __m256i out[4] = {_mm256_permute2x128_si256(a[0], a[1], 0x20),   // channels 0-7
                                _mm256_permute2x128_si256(a[2], a[3], 0x20),   // 8-15
                                _mm256_permute2x128_si256(a[0], a[1], 0x31),   // 16-23
                                _mm256_permute2x128_si256(a[2], a[3], 0x31)};  // 24-31
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(am + c + 8 * i,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(out[i]), gv, _mm256_loadu_ps(am + c + 8 * i)));
        }
      }
    }
  }

  // X[v][qd][i]: code vector v of the block's rows 4 qd .. 4 qd + 3, interleaved as values_i8 does its int8 rows.
  template <int Bits, int NV>
  void interleave_packed(const uint8_t* const* r, int quads) {
    const int n_v = NV ? NV : nv;
    const int64_t bytes = NV ? NV * 4 * Bits : D * Bits / 8;
    for (int qd = 0; qd < quads; ++qd) {
      __m256i R[4][NV ? NV : kMaxV];
      for (int i = 0; i < 4; ++i) unpack_row<Bits>(r[4 * qd + i], bytes, R[i]);
      for (int v = 0; v < n_v; ++v) {
        const __m256i lo01 = _mm256_unpacklo_epi8(R[0][v], R[1][v]), hi01 = _mm256_unpackhi_epi8(R[0][v], R[1][v]);
        const __m256i lo23 = _mm256_unpacklo_epi8(R[2][v], R[3][v]), hi23 = _mm256_unpackhi_epi8(R[2][v], R[3][v]);
        __m256i* x = X + (v * (kB / 4) + qd) * 4;
        x[0] = _mm256_unpacklo_epi16(lo01, lo23);
        x[1] = _mm256_unpackhi_epi16(lo01, lo23);
        x[2] = _mm256_unpacklo_epi16(hi01, hi23);
        x[3] = _mm256_unpackhi_epi16(hi01, hi23);
      }
    }
  }

  // out[g][t] = side s of token t < n (rows from offset off) and channel group g < G, 0 for t >= n: float16
  // [token][group] rows of 1, 2 or 4 groups converted 8 tokens at a time and transposed in registers, others
  // one entry at a time.
  void side_block(const Side& sd, int64_t off, int64_t G, int n, float (*out)[kB]) {
    int t = 0;
    if (sd.type == kNone) n = 0;
#if defined(__F16C__)
    if (sd.type == kF16 && sd.sc == 1 && sd.sr == G && (G == 1 || G == 2 || G == 4)) {
      const uint16_t* x = static_cast<const uint16_t*>(sd.ptr) + off;
      auto half8 = [](const uint16_t* y) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y)));
      };
      for (; t + 8 <= n; t += 8) {
        const uint16_t* y = x + t * G;
        if (G == 1) {
          _mm256_store_ps(out[0] + t, half8(y));
        } else if (G == 2) {  // [t0g0 t0g1 t1g0 ...]: each vector's groups apart, then the two halves joined
          const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
          const __m256 a = _mm256_permutevar8x32_ps(half8(y), idx), c = _mm256_permutevar8x32_ps(half8(y + 8), idx);
          _mm256_store_ps(out[0] + t, _mm256_permute2f128_ps(a, c, 0x20));
          _mm256_store_ps(out[1] + t, _mm256_permute2f128_ps(a, c, 0x31));
        } else {  // two tokens per vector: pairs of tokens per group, then a 4 x 4 transpose of the pairs
          const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
          __m256d v[4];
          for (int i = 0; i < 4; ++i) v[i] = _mm256_castps_pd(_mm256_permutevar8x32_ps(half8(y + 8 * i), idx));
          const __m256d l01 = _mm256_unpacklo_pd(v[0], v[1]), h01 = _mm256_unpackhi_pd(v[0], v[1]);
          const __m256d l23 = _mm256_unpacklo_pd(v[2], v[3]), h23 = _mm256_unpackhi_pd(v[2], v[3]);
          _mm256_store_ps(out[0] + t, _mm256_castpd_ps(_mm256_permute2f128_pd(l01, l23, 0x20)));
          _mm256_store_ps(out[1] + t, _mm256_castpd_ps(_mm256_permute2f128_pd(h01, h23, 0x20)));
          _mm256_store_ps(out[2] + t, _mm256_castpd_ps(_mm256_permute2f128_pd(l01, l23, 0x31)));
          _mm256_store_ps(out[3] + t, _mm256_castpd_ps(_mm256_permute2f128_pd(h01, h23, 0x31)));
        }
      }
    }
#endif
    for (int64_t g = 0; g < G; ++g) {
      for (int u = t; u < n; ++u) out[g][u] = sd.at(off + u * sd.sr + g * sd.sc);
      if (n < kB) std::fill(out[g] + std::max(t, n), out[g] + kB, 0.f);  // a short block only (a memset call)
    }
  }

  // packed_weights for every row and channel group (M G <= kWB pairs) into wqb, gvb, zsb and anyb, four pairs
  // at a time: their maxima and sums reduced together (hmax4, hsum4), the weights recomputed in the second pass
  // rather than held. zsb = sum_t p_t z_tg + mid (sum_t w_t - gv sum_t wi_t): the same residual as packed_weights'.
  void packed_weights_all(int64_t G, float mid) {
    const int np = static_cast<int>(M * G);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the two packs' lane order undone
    for (int64_t m = 0; m < M; ++m) anyb[m] = false;
    int64_t mn = 0, gn = 0;  // the next pair's row and group (no division per pair: a 64-bit one costs ~20 cycles)
    for (int p0 = 0; p0 < np; p0 += 4) {
      const int k = std::min(4, np - p0);
      int64_t pm[4], pg[4];
      for (int i = 0; i < k; ++i) {
        pm[i] = mn, pg[i] = gn;
        if (++gn == G) gn = 0, ++mn;
      }
      __m256 mv[4], zv[4];
      for (int i = 0; i < 4; ++i) {
        mv[i] = zv[i] = _mm256_setzero_ps();
        if (i >= k) continue;
        const int64_t m = pm[i], g = pg[i];
        __m256 ws = _mm256_setzero_ps(), zs = _mm256_setzero_ps();
        for (int v = 0; v < kB / 8; ++v) {
          const __m256 pv = _mm256_load_ps(s[m] + 8 * v);
          const __m256 w = _mm256_mul_ps(pv, _mm256_load_ps(vs[g] + 8 * v));
          mv[i] = _mm256_max_ps(mv[i], w);
          ws = _mm256_add_ps(ws, w);
          zs = _mm256_fmadd_ps(pv, _mm256_load_ps(vz[g] + 8 * v), zs);
        }
        zv[i] = _mm256_fmadd_ps(ws, set1(mid), zs);
      }
      alignas(16) float top[4], zpart[4], isum[4];
      _mm_store_ps(top, hmax4(mv[0], mv[1], mv[2], mv[3]));
      _mm_store_ps(zpart, hsum4(zv[0], zv[1], zv[2], zv[3]));
      __m256 iv[4];
      for (int i = 0; i < 4; ++i) {
        iv[i] = _mm256_setzero_ps();
        if (i >= k) continue;
        const int pr = p0 + i;
        const int64_t m = pm[i], g = pg[i];
        const float t = top[i];
        gvb[pr] = t > 0.f ? t / kP : 0.f;
        anyb[m] |= t > 0.f;
        const __m256 inv = set1(t > 0.f ? kP / t : 0.f);
        __m256i wi[4];
        for (int v = 0; v < 4; ++v) {
          wi[v] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(s[m] + 8 * v),
                                                                 _mm256_load_ps(vs[g] + 8 * v)), inv));
        }
        iv[i] = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(wi[0], wi[1]), _mm256_add_epi32(wi[2], wi[3])));
        _mm256_store_si256(reinterpret_cast<__m256i*>(wqb[pr]), _mm256_permutevar8x32_epi32(_mm256_packus_epi16(
            _mm256_packs_epi32(wi[0], wi[1]), _mm256_packs_epi32(wi[2], wi[3])), order));
      }
      _mm_store_ps(isum, hsum4(iv[0], iv[1], iv[2], iv[3]));  // integers <= 32 * 127: exact in float
      for (int i = 0; i < k; ++i) zsb[p0 + i] = zpart[i] - mid * gvb[p0 + i] * isum[i];
    }
  }

  // Row m's weights (wq, gv, zsum): packed_weights_all's where it ran (batched), else packed_weights into the
  // caller's arrays. Returns whether any weight is nonzero.
  bool row_weights(int64_t m, int64_t G, float mid, bool batched, int32_t (*&wq)[kB / 4], float*& gv, float*& zsum) {
    if (!batched) return packed_weights(m, G, mid, wq, gv, zsum);
    wq = wqb + m * G, gv = gvb + m * G, zsum = zsb + m * G;
    return anyb[m];
  }

  // Query row m's weights p_t s_tg for each channel group g < G rounded to 7-bit integers of the group's largest
  // (step gv[g]), as bytes per token quad (wq[g][qd]), and zsum[g] = sum_t p_t z_tg plus the rounding's error times
  // the mid-range code. Returns whether any weight is nonzero.
  bool packed_weights(int64_t m, int64_t G, float mid, int32_t (*wq)[kB / 4], float* gv, float* zsum) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the two packs' lane order undone
    bool any = false;
    for (int64_t g = 0; g < G; ++g) {
      __m256 w[kB / 8];
      __m256 mv = _mm256_setzero_ps(), zs = _mm256_setzero_ps();
      for (int v = 0; v < kB / 8; ++v) {
        const __m256 pv = _mm256_load_ps(s[m] + 8 * v);
        w[v] = _mm256_mul_ps(pv, _mm256_load_ps(vs[g] + 8 * v));
        mv = _mm256_max_ps(mv, w[v]);
        zs = _mm256_fmadd_ps(pv, _mm256_load_ps(vz[g] + 8 * v), zs);
      }
      const float top = hmax(mv);
      gv[g] = top > 0.f ? top / kP : 0.f;
      any |= top > 0.f;
      const __m256 inv = set1(top > 0.f ? kP / top : 0.f);
      __m256i wi[4];
      __m256 res = _mm256_setzero_ps();  // sum_t (w_t - gv wi_t): the rounding's error against a mid-range code
      for (int v = 0; v < 4; ++v) {
        wi[v] = _mm256_cvtps_epi32(_mm256_mul_ps(w[v], inv));
        res = _mm256_add_ps(res, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(wi[v]), set1(gv[g]), w[v]));
      }
      zsum[g] = hadd(_mm256_fmadd_ps(res, set1(mid), zs));  // one reduction
      _mm256_store_si256(reinterpret_cast<__m256i*>(wq[g]), _mm256_permutevar8x32_epi32(_mm256_packus_epi16(
          _mm256_packs_epi32(wi[0], wi[1]), _mm256_packs_epi32(wi[2], wi[3])), order));
    }
    return any;
  }

  // acc[m] (its channels of group g) += zsum[g] for each group.
  void add_zero_sums(float* am, int64_t G, int64_t cg, const float* zsum) {
    for (int64_t g = 0; g < G; ++g) {
      if (zsum[g] == 0.f) continue;
      const __m256 zv = set1(zsum[g]);
      for (int64_t c = g * cg; c < std::min(D, (g + 1) * cg); c += 8) {
        _mm256_storeu_ps(am + c, _mm256_add_ps(_mm256_loadu_ps(am + c), zv));
      }
    }
  }

  // int4 values with rows a whole number of 32-byte pieces and channel groups of 32 or more: the block's rows are
  // interleaved by 4 tokens while still packed (half the shuffles of interleaving unpacked codes), then split into
  // their low nibbles (even channels) and high ones (odd channels); the two sums are put back in channel order per
  // row. A piece's low 128 bits hold channels 64k .. 64k + 31, its high ones 64k + 32 .. 64k + 63: one group each.
  // X[k][qd][i]: piece k of tokens 4 qd .. 4 qd + 3, i < 4 the even channels 8i + 2j (int32 lane j < 4; lanes 4 .. 7
  // the same + 32), i >= 4 the odd ones.
  void values_int4(const Part& p, const uint8_t* const* r, int quads, int64_t G) {
    const __m256i m15 = _mm256_set1_epi8(15);
    const int64_t pieces = D / 64;
    for (int64_t k = 0; k < pieces; ++k) {
      for (int qd = 0; qd < quads; ++qd) {
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[4 * qd] + 32 * k));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[4 * qd + 1] + 32 * k));
        const __m256i r2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[4 * qd + 2] + 32 * k));
        const __m256i r3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[4 * qd + 3] + 32 * k));
        const __m256i lo01 = _mm256_unpacklo_epi8(r0, r1), hi01 = _mm256_unpackhi_epi8(r0, r1);
        const __m256i lo23 = _mm256_unpacklo_epi8(r2, r3), hi23 = _mm256_unpackhi_epi8(r2, r3);
        const __m256i y[4] = {_mm256_unpacklo_epi16(lo01, lo23), _mm256_unpackhi_epi16(lo01, lo23),
                              _mm256_unpacklo_epi16(hi01, hi23), _mm256_unpackhi_epi16(hi01, hi23)};
        __m256i* x = X + (k * (kB / 4) + qd) * 8;
        for (int i = 0; i < 4; ++i) {
          x[i] = _mm256_and_si256(y[i], m15);
          x[4 + i] = _mm256_and_si256(_mm256_srli_epi16(y[i], 4), m15);
        }
      }
    }
    const float mid = 7.5f;
    const bool batched = M * G <= kWB;
    if (batched) packed_weights_all(G, mid);
    int64_t gl[512 / 64], gh[512 / 64];  // each piece's two channel groups (divided once per block, not per row)
    for (int64_t k = 0; k < pieces; ++k) gl[k] = 64 * k / p.cg, gh[k] = (64 * k + 32) / p.cg;
    for (int64_t m = 0; m < M; ++m) {
      alignas(32) int32_t wql[kMaxG][kB / 4];
      float gvl[kMaxG], zsl[kMaxG];
      int32_t (*wq)[kB / 4] = wql;
      float *gv = gvl, *zsum = zsl;
      const bool any = row_weights(m, G, mid, batched, wq, gv, zsum);  // none: only the zero points' sums remain
      float* am = acc + m * D;
      for (int64_t k = 0; any && k < pieces; ++k) {
        const int64_t glo = gl[k], ghi = gh[k];
        const __m256i* x = X + k * (kB / 4) * 8;
        __m256i a[8];
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_si256();
        for (int qd = 0; qd < quads; ++qd) {
          const __m256i wv = _mm256_set_m128i(_mm_set1_epi32(wq[ghi][qd]), _mm_set1_epi32(wq[glo][qd]));
          for (int i = 0; i < 8; ++i) a[i] = _mm256_dpbusd_epi32(a[i], wv, x[qd * 8 + i]);
        }
#else
        // int16 sums over the block: 8 quads of pair sums <= 2 * 15 * 127 stay below 2^15
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_si256();
        for (int qd = 0; qd < quads; ++qd) {
          const __m256i wv = _mm256_set_m128i(_mm_set1_epi32(wq[ghi][qd]), _mm_set1_epi32(wq[glo][qd]));
          for (int i = 0; i < 8; ++i) a[i] = _mm256_add_epi16(a[i], _mm256_maddubs_epi16(wv, x[qd * 8 + i]));
        }
        for (int i = 0; i < 8; ++i) a[i] = _mm256_madd_epi16(a[i], _mm256_set1_epi16(1));
#endif
        const __m256 sl = set1(gv[glo]), sh = set1(gv[ghi]);
        for (int i = 0; i < 4; ++i) {  // even and odd channels back in order: 8i .. 8i + 7 and 32 + 8i .. + 7
          const __m256i u0 = _mm256_unpacklo_epi32(a[i], a[4 + i]), u1 = _mm256_unpackhi_epi32(a[i], a[4 + i]);
          float* dlo = am + 64 * k + 8 * i;
          float* dhi = dlo + 32;
          _mm256_storeu_ps(dlo, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(u0, u1, 0x20)), sl,
                                                _mm256_loadu_ps(dlo)));
          _mm256_storeu_ps(dhi, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(u0, u1, 0x31)), sh,
                                                _mm256_loadu_ps(dhi)));
        }
      }
      add_zero_sums(am, G, p.cg, zsum);
    }
  }

  // acc[m] += sum_t s[m][t] * value_t over packed values with a scale and zero point per token and channel group:
  // per query row and channel group, the weights p_t s_tg rounded to 7-bit integers of the block's largest
  // (vpmaddubsw's unsigned operand; the codes, interleaved by 4 tokens once for every row, its signed one), the
  // step folded back per group; sum_t p_t z_tg added in float.
  void values_packed(const Part& p, int64_t j0, int n) {
    layout(p.bits);
    const int64_t G = (D + p.cg - 1) / p.cg;
    const uint8_t* base = static_cast<const uint8_t*>(p.data) + b * p.sb + h * p.sh;
    const uint8_t* r[kB];
    for (int t = 0; t < kB; ++t) r[t] = base + (j0 + std::min(t, n - 1)) * p.sn;  // past n: weight 0
    side_block(p.scale, b * p.scale.sb + h * p.scale.sh + j0 * p.scale.sr, G, n, vs);
    side_block(p.zero, b * p.zero.sb + h * p.zero.sh + j0 * p.zero.sr, G, n, vz);
    const int quads = (n + 3) / 4;
    const float mid = ((1 << p.bits) - 1) / 2.f;
    if (p.bits == 4 && D % 64 == 0 && p.cg % 32 == 0) return values_int4(p, r, quads, G);
    packed_kind(p.bits, [&](auto bits, auto vecs) {
      interleave_packed<decltype(bits)::value, decltype(vecs)::value>(r, quads);
    });
    const bool batched = M * G <= kWB;
    if (batched) packed_weights_all(G, mid);
    for (int64_t m = 0; m < M; ++m) {
      alignas(32) int32_t wql[kMaxG][kB / 4];  // group g's weights of token quad qd as bytes
      float gvl[kMaxG], zsl[kMaxG];
      int32_t (*wq)[kB / 4] = wql;
      float *gv = gvl, *zsum = zsl;
      const bool any = row_weights(m, G, mid, batched, wq, gv, zsum);
      float* am = acc + m * D;
      __m256i wv[kB / 4];  // the weights of each token quad for a vector's two channel groups (low, high 128 bits)
      int64_t wlo = -1, whi = -1;
      for (int v = 0; any && v < nv; ++v) {
        const int64_t clo = cb[2 * v], chi = cb[2 * v + 1];
        if (clo / p.cg != wlo || chi / p.cg != whi) {  // built once per pair of groups (vectors share them)
          wlo = clo / p.cg, whi = chi / p.cg;
          for (int qd = 0; qd < quads; ++qd) {
            wv[qd] = _mm256_set_m128i(_mm_set1_epi32(wq[whi][qd]), _mm_set1_epi32(wq[wlo][qd]));
          }
        }
        const __m256i* x = X + v * (kB / 4) * 4;
        // The weights (0 .. 127) as the unsigned operand, the codes (0 .. 15) as the signed one, read from memory.
        __m256i a[4];
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
        for (int i = 0; i < 4; ++i) a[i] = _mm256_setzero_si256();
        for (int qd = 0; qd < quads; ++qd) {
          for (int i = 0; i < 4; ++i) a[i] = _mm256_dpbusd_epi32(a[i], wv[qd], x[qd * 4 + i]);
        }
#else
        // int16 sums over the block: 8 quads of pair sums <= 2 * 15 * 127 stay below 2^15
        __m256i a16[4];
        for (int i = 0; i < 4; ++i) a16[i] = _mm256_setzero_si256();
        for (int qd = 0; qd < quads; ++qd) {
          for (int i = 0; i < 4; ++i) a16[i] = _mm256_add_epi16(a16[i], _mm256_maddubs_epi16(wv[qd], x[qd * 4 + i]));
        }
        for (int i = 0; i < 4; ++i) a[i] = _mm256_madd_epi16(a16[i], _mm256_set1_epi16(1));
#endif
        const __m256 glo = set1(gv[clo / p.cg]), ghi = set1(gv[chi / p.cg]);
        const __m256i out[4] = {_mm256_permute2x128_si256(a[0], a[1], 0x20),   // channels clo .. clo + 7
                                _mm256_permute2x128_si256(a[2], a[3], 0x20),   // clo + 8 .. clo + 15
                                _mm256_permute2x128_si256(a[0], a[1], 0x31),   // chi .. chi + 7
                                _mm256_permute2x128_si256(a[2], a[3], 0x31)};  // chi + 8 .. chi + 15
        float* dst[4] = {am + clo, am + clo + 8, am + chi, am + chi + 8};
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(dst[i], _mm256_fmadd_ps(_mm256_cvtepi32_ps(out[i]), i < 2 ? glo : ghi,
                                                   _mm256_loadu_ps(dst[i])));
        }
      }
      add_zero_sums(am, G, p.cg, zsum);
    }
  }

  // acc[m] += sum_t s[m][o + t] * value_t for a sub-block of decoded rows.
  void values_sub(const Part& p, int64_t j0, int n, int o) {
    decode(p, j0, n);
    for (int64_t m = 0; m < M; ++m) {
      __m256 w[kS];
      bool any = false;
      for (int t = 0; t < kS; ++t) {
        const float wt = s[m][o + t] * fs[t];
        any |= wt != 0.f;
        w[t] = set1(wt);
      }
      if (!any) continue;
      float* am = acc + m * D;
      for (int64_t c = 0; c < D; c += 8) {
        __m256 a = _mm256_loadu_ps(am + c);
        for (int t = 0; t < kS; ++t) a = _mm256_fmadd_ps(w[t], _mm256_loadu_ps(rows + t * D + c), a);
        _mm256_storeu_ps(am + c, a);
      }
    }
  }

  void values(const Part& p, int64_t j0, int n) {
#if KVBENCH_ABLATE_VALUES
    return;
#endif
    if (packed_values(p, D)) return values_packed(p, j0, n);
    if (int8_folded(p, D)) return values_i8(p, j0, n);
    if (dense16(p, D)) return p.bits == 16 ? values_dense16<true>(p, j0, n) : values_dense16<false>(p, j0, n);
    for (int o = 0; o < n; o += kS) values_sub(p, j0 + o, std::min(kS, n - o), o);
  }

  // Prefetch into L1 the rows of tokens j0 .. j0 + kB - 1 held by parts ps[i], ps[i + 1], ... and their scales
  // and zero points, one block before the block is read. The hardware prefetcher alone left the int8 reader
  // waiting on its row loads once the stores outgrow the caches (30 layers: as long per token as bfloat16's, for
  // half the bytes; results/perf/simd/avx512-vnni/30-layers). Inline assembly, not __builtin_prefetch: GCC counts
  // a prefetch as no side effect, so under C++'s forward-progress rule (-ffinite-loops, on from -O2) it deletes a
  // loop that does nothing else; with that rule off it keeps the loop but finds prefetch_block pure and deletes
  // the calls (GCC 12: no prefetch executed either way, and no faster than none; linear_rows.cpp's builtins live in
  // loops that do work). A prefetch changes no result.
  static void prefetch_lines(const char* lo, const char* hi) {
    for (const char* a = lo; a < hi; a += 64) asm volatile("prefetcht0 %0" : : "m"(*a));
  }
  void prefetch_side(const Side& sd, const Part& p, int64_t a, int64_t z) {
    if (sd.type == kNone) return;
    // no division where a side has one row per token or one column (int8's scale): this runs once per block
    const int64_t r0 = p.tg > 1 ? a / p.tg : a, r1 = p.tg > 1 ? (z - 1) / p.tg : z - 1;
    const int64_t last = p.cg >= D ? 0 : (D - 1) / p.cg;
    const int e = sd.type == kF32 ? 4 : sd.type == kF16 ? 2 : 1;
    const char* base = static_cast<const char*>(sd.ptr) + (b * sd.sb + h * sd.sh) * e;
    const char* lo = base + r0 * sd.sr * e;
    const char* hi = base + (r1 * sd.sr + last * sd.sc + 1) * e;
    prefetch_lines(lo, std::min(hi, lo + 2048));  // a side's rows are small; a strided layout is not chased
  }
  void prefetch_block(const std::vector<Part>& ps, size_t i, int64_t j0) {
    const int64_t j1 = j0 + kB;
    for (; i < ps.size() && ps[i].first < j1; ++i) {
      const Part& p = ps[i];
      const int64_t a = std::max(j0, p.first) - p.first, z = std::min(j1, p.first + p.n) - p.first;
      if (a >= z) continue;
      const int e = p.bits == 0 ? 4 : (p.bits == 16 || p.bits == -16) ? 2 : 1;  // bytes per element as stored
      const int64_t row = p.bits == 0 ? 4 * D : D * std::abs(p.bits) / 8;    // bytes per row
      // rows under half a line (KIVI int2 at 64 channels): the reader is bound by its arithmetic there, and the
      // prefetches cost more than they saved (measured)
      if (row < 32) continue;
      const char* base = static_cast<const char*>(p.data) + (b * p.sb + h * p.sh) * e;
      if (p.sn * e == row) {
        prefetch_lines(base + a * row, base + z * row);
      } else {
        for (int64_t j = a; j < z; ++j) prefetch_lines(base + j * p.sn * e, base + j * p.sn * e + row);
      }
      prefetch_side(p.scale, p, a, z);
      prefetch_side(p.zero, p, a, z);
    }
  }

  void run(int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m) {
      mx[m] = -std::numeric_limits<float>::infinity();
      lv[m] = _mm256_setzero_ps();
    }
    std::fill(acc, acc + M * D, 0.f);
    size_t ki = 0, vi = 0;
    for (int64_t n = n0; n < n1;) {
      while ((*kp)[ki].first + (*kp)[ki].n <= n) ++ki;
      while ((*vp)[vi].first + (*vp)[vi].n <= n) ++vi;
      const Part &k = (*kp)[ki], &v = (*vp)[vi];
      const int64_t end = std::min({n + kB, n1, k.first + k.n, v.first + v.n});
      const int cnt = static_cast<int>(end - n);
#if !KVBENCH_ABLATE_PREFETCH
      prefetch_block(*kp, ki, end);  // the next block's keys and values (past n1: the next task's, as a rule)
      prefetch_block(*vp, vi, end);
#endif
      score(k, n - k.first, cnt);
      if (softmax(n, cnt)) values(v, n - v.first, cnt);
      n = end;
    }
    for (int64_t m = 0; m < M; ++m) l[m] = hadd(lv[m]);
  }
};

}  // namespace simd
#endif

#if defined(__AVX2__) && defined(__FMA__)
namespace simd {
// Attention of q [B, H, M, D] (float32, contiguous) over batch row b's parts rows[b] (keys, values), rows of N[b]
// tokens each; every (row, head, chunk of tokens) is one task, merged per row and head at the end.
torch::Tensor attend_tasks(const torch::Tensor& q, const std::vector<std::pair<const std::vector<Part>*,
                           const std::vector<Part>*>>& rows, const std::vector<int64_t>& N, const float* mk,
                           const int64_t* ms, int64_t q_len, double scaling, int64_t chunk) {
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  TORCH_CHECK(chunk > 0, "chunk > 0");
  // task offsets per batch row: rows hold different numbers of tokens, so different numbers of chunks
  std::vector<int64_t> chunks(B), first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    chunks[b] = std::max<int64_t>(1, (N[b] + chunk - 1) / chunk);
    first[b + 1] = first[b] + H * chunks[b];
  }
  const int64_t tasks = first[B];
  auto pmax = torch::empty({tasks, M});
  auto psum = torch::empty({tasks, M});
  auto pacc = torch::empty({tasks, M, D});
  float* pm = pmax.data_ptr<float>();
  float* ps = psum.data_ptr<float>();
  float* pa = pacc.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float scl = static_cast<float>(scaling);

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> rowbuf(kS * D), sbuf(D), zbuf(D);
    std::vector<int8_t> qi(M * D);
    std::vector<__m256i> xs(D / 32 * kB), qks(M * kMaxV);
    std::vector<__m256> q16(M * D / 8);
    // One Task per thread, its scratch reused by every task (an aggregate built per task zeroes ~20 KB each time)
    Task task{nullptr, nullptr, 0, 0, M, D, nullptr, scl, nullptr, q_len, ms[2], ms[3], ms[4], nullptr, nullptr,
              nullptr, rowbuf.data(), sbuf.data(), zbuf.data(), qi.data(), xs.data(), qks.data(), q16.data()};
    int64_t b = std::upper_bound(first.begin(), first.end(), t0) - first.begin() - 1;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first[b + 1]) ++b;
      const int64_t h = (t - first[b]) / chunks[b], c = (t - first[b]) % chunks[b];
      const int64_t n0 = c * chunk, n1 = std::min(N[b], n0 + chunk);
      task.start(rows[b].first, rows[b].second, b, h, qp + (b * H + h) * M * D,
                 mk ? mk + b * ms[0] + h * ms[1] : nullptr, pm + t * M, ps + t * M, pa + t * M * D);
      if (N[b] > 0) task.run(n0, n1);
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
      const int64_t bh = r / M, m = r % M, b = bh / H, h = bh % H;
      const int64_t t0 = first[b] + h * chunks[b];
      float top = ninf;
      for (int64_t c = 0; c < chunks[b]; ++c) top = std::max(top, pm[(t0 + c) * M + m]);
      const float safe = std::isinf(top) ? 0.f : top;
      float total = 0.f;
      float* o = op + r * D;
      std::fill(o, o + D, 0.f);
      for (int64_t c = 0; c < chunks[b]; ++c) {
        const int64_t t = t0 + c;
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
}
}  // namespace simd
#endif

// Same arguments and result as the first kernel's attend.
torch::Tensor attend_simd(const torch::Tensor& q, const std::vector<torch::Tensor>& kt,
                          const std::vector<int64_t>& ki, const std::vector<torch::Tensor>& vt,
                          const std::vector<int64_t>& vi, const torch::Tensor& mask, int64_t q_len, double scaling,
                          int64_t chunk) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [B, H, M, D] float32");
  const int64_t B = q.size(0), M = q.size(2), D = q.size(3);
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
  // every batch row reads the same parts (their batch strides pick its row)
  return simd::attend_tasks(q, std::vector<std::pair<const std::vector<Part>*, const std::vector<Part>*>>(
                                   B, {&kp, &vp}), std::vector<int64_t>(B, N), mk, ms, q_len, scaling, chunk);
#else
  return attend(q, kt, ki, vt, vi, mask, q_len, scaling, chunk);
#endif
}

// Several sequences' attention in one call (a batch of rows decoding together, each over its own stored parts):
// q [R, H, M, D] float32, row r's key parts the next kn[r] of kt/ki's, its value parts the next vn[r] of vt/vi's,
// every part of batch 1; no mask (each row reads all its tokens). kc / vc: per part, the tokens read of it (its
// first ones; -1: all its data holds), so a part with reserved slots past its filled ones (a store's open tail) is
// read without a view cut to its length at every step. Row r's result is what attend gives for q[r] over its
// parts (cut to those tokens) alone, bit for bit: the same tasks, in one parallel loop instead of R calls.
torch::Tensor attend_rows(const torch::Tensor& q, const std::vector<torch::Tensor>& kt,
                          const std::vector<int64_t>& ki, const std::vector<torch::Tensor>& vt,
                          const std::vector<int64_t>& vi, const std::vector<int64_t>& kn,
                          const std::vector<int64_t>& vn, const std::vector<int64_t>& kc,
                          const std::vector<int64_t>& vc, int64_t q_len, double scaling, int64_t chunk) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [R, H, M, D] float32");
  const int64_t R = q.size(0), M = q.size(2), D = q.size(3);
  TORCH_CHECK(static_cast<int64_t>(kn.size()) == R && static_cast<int64_t>(vn.size()) == R, "parts per row: R each");
  TORCH_CHECK(3 * kc.size() == kt.size() && 3 * vc.size() == vt.size(), "one token count per part");
  // the next n parts of ts / is, from part off on, each cut to its count in cs
  auto take = [](const std::vector<torch::Tensor>& ts, const std::vector<int64_t>& is,
                 const std::vector<int64_t>& cs, size_t& off, int64_t n) {
    TORCH_CHECK(n >= 0 && 3 * (off + n) <= ts.size(), "more parts named than given");
    auto out = parts(std::vector<torch::Tensor>(ts.begin() + 3 * off, ts.begin() + 3 * (off + n)),
                     std::vector<int64_t>(is.begin() + 4 * off, is.begin() + 4 * (off + n)));
    int64_t first = 0;
    for (size_t j = 0; j < out.size(); ++j) {
      const int64_t c = cs[off + j];
      if (c >= 0) {
        TORCH_CHECK(c <= out[j].n, "a part's token count exceeds the tokens its data holds");
        out[j].n = c;
      }
      out[j].first = first;
      first += out[j].n;
    }
    off += n;
    return out;
  };
  std::vector<std::vector<Part>> kps(R), vps(R);
  std::vector<int64_t> N(R, 0);
  size_t ko = 0, vo = 0;
  for (int64_t r = 0; r < R; ++r) {
    kps[r] = take(kt, ki, kc, ko, kn[r]);
    vps[r] = take(vt, vi, vc, vo, vn[r]);
    int64_t NV = 0;
    for (const auto& p : kps[r]) N[r] += p.n;
    for (const auto& p : vps[r]) NV += p.n;
    for (const auto* ps : {&kps[r], &vps[r]})
      for (const auto& p : *ps)  // a row's parts are indexed as batch row 0 of their own
        TORCH_CHECK(p.sb == 0 && p.scale.sb == 0 && p.zero.sb == 0, "attend_rows: every part is of batch 1");
    TORCH_CHECK(N[r] == NV, "keys and values hold different numbers of tokens");
  }
  TORCH_CHECK(3 * ko == kt.size() && 3 * vo == vt.size(), "parts given but not named");
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0 && D <= 512 && M <= simd::kMaxM) {
    std::vector<std::pair<const std::vector<Part>*, const std::vector<Part>*>> rows(R);
    for (int64_t r = 0; r < R; ++r) rows[r] = {&kps[r], &vps[r]};
    const int64_t ms[5] = {0, 0, 0, 0, 0};
    return simd::attend_tasks(q, rows, N, nullptr, ms, q_len, scaling, chunk);
  }
#endif
  // no vector path: each row through the first kernel, as attend_simd falls back; it reads all a part's data
  // holds, so a part read short of that is cut first (its sides are indexed by token: reading fewer reads fewer)
  auto cut = [](const std::vector<torch::Tensor>& ts, const std::vector<int64_t>& cs, size_t off, int64_t n) {
    std::vector<torch::Tensor> out(ts.begin() + 3 * off, ts.begin() + 3 * (off + n));
    for (int64_t j = 0; j < n; ++j)
      if (cs[off + j] >= 0) out[3 * j] = out[3 * j].narrow(2, 0, cs[off + j]);
    return out;
  };
  std::vector<torch::Tensor> outs;
  ko = vo = 0;
  for (int64_t r = 0; r < R; ++r) {
    outs.push_back(attend(q.narrow(0, r, 1).contiguous(), cut(kt, kc, ko, kn[r]),
                          std::vector<int64_t>(ki.begin() + 4 * ko, ki.begin() + 4 * (ko + kn[r])),
                          cut(vt, vc, vo, vn[r]),
                          std::vector<int64_t>(vi.begin() + 4 * vo, vi.begin() + 4 * (vo + vn[r])),
                          torch::Tensor(), q_len, scaling, chunk));
    ko += kn[r], vo += vn[r];
  }
  return torch::cat(outs, 0);
}

// quantize_int8_token_into (the first kernel's source, included above) for a batch of sequences in one call: row r
// of x [R, H, m, D] into codes[r] / scales[r] (row r's own store's tail reserve) from token starts[r] on, each row's
// values what the single call gives, bit for bit. A decode step of R sequences otherwise pays a call and its Python
// per row, stream and layer. Here rather than beside the single call so the first kernel's source stays as its runs
// built it. Returns the largest float32 scale before rounding over the rows (NaN if any element is not finite).
double quantize_int8_token_rows_into(const torch::Tensor& x_in, int64_t group, const std::vector<torch::Tensor>& codes,
                                     const std::vector<torch::Tensor>& scales, const std::vector<int64_t>& starts) {
  TORCH_CHECK(x_in.dim() == 4, "x: [R, H, m, D]");
  const int64_t R = x_in.size(0);
  TORCH_CHECK(static_cast<int64_t>(codes.size()) == R && static_cast<int64_t>(scales.size()) == R &&
              static_cast<int64_t>(starts.size()) == R, "one destination per row");
  const torch::Tensor x = x_in.contiguous().to(torch::kFloat32);
  double peak = 0.0;
  bool bad = false;
  for (int64_t r = 0; r < R; ++r) {
    const double p = quantize_int8_token_into(x.narrow(0, r, 1), group, codes[r], scales[r], starts[r]);
    if (std::isnan(p)) bad = true;
    else peak = p > peak ? p : peak;
  }
  return bad ? std::numeric_limits<double>::quiet_NaN() : peak;
}

// The instruction sets this build's integer path uses (for the benchmarks' record).
std::string isa() {
#if defined(__AVX2__) && defined(__FMA__)
#if KVBENCH_I8_WIDE
  return "avx2+fma+vnni, avx512 for int8 values";
#elif defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  return "avx2+fma+vnni";
#else
  return "avx2+fma";
#endif
#else
  return "scalar (the first kernel)";
#endif
}

// The largest integer of the query's int8 rounding on this build (the error bound's denominator).
// The largest integer of the packed (KIVI int4 / int2) paths' query and weight rounding (0: no such path).
int64_t packed_levels() {
#if defined(__AVX2__) && defined(__FMA__)
  return simd::kP;
#else
  return 0;
#endif
}

int64_t query_levels() {
#if defined(__AVX2__) && defined(__FMA__)
  return simd::kQ;
#else
  return 0;  // no integer path
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("query_levels", &query_levels, "the query's integer range on the integer path (0: none)");
  m.def("packed_levels", &packed_levels, "the integer range of the packed paths' query and weights (0: none)");
  m.def("attend", &attend_simd, "Block-vector attention over stored parts (kvbench.fused, reader simd)");
  m.def("attend_rows", &attend_rows, "attend for several sequences' rows, each over its own parts, in one call");
  m.def("isa", &isa, "the instruction sets the reader was built for");
  m.def("quantize_int8_token_rows_into", &quantize_int8_token_rows_into,
        "quantize_int8_token_into for several sequences' rows, each into its own chunk, in one call");
}
