// Fused attention over a stored (compressed) cache, for short queries: kvbench.fused's kernel.
//
// Why a kernel of our own: attention that reads codes without a dense copy needs the decode of a key or value
// row next to the products that use it. Composed of PyTorch ops, every block is decoded into a float tensor in
// memory and read back by a matmul, several times the bytes SDPA reads from a dense cache (blockattn's reader,
// kept as the reference and the fallback). No library we may depend on reads these formats on CPU: PyTorch's
// int8 weight-only GEMV takes one layout of one format, and fused attention kernels (SDPA, vLLM's paged FP8
// reader) read dense or their own pages only. Here each row is decoded once into registers-sized scratch
// (one head_dim of float32) and used at once by every query row of its KV head.
//
// Shape of the computation: flash-decoding (Dao et al. 2023): the tokens are cut into chunks, each chunk of
// each (batch row, KV head) is one task computing its own softmax maximum, denominator and weighted sum, and
// the chunks are merged with the online-softmax correction (Milakov & Gimelshein 2018). A scale shared by a whole
// row folds into that row's score and probability (KIVI, Liu et al. 2024); per-group scales and zero points are
// applied to the decoded row, as dequantize-then-attend does.
//
// A part is a run of tokens in one format: dense (float32, bfloat16, float16) or codes of 8, 4 or 2 bits
// (packed along head_dim, first code in the low bits) read as unsigned or two's-complement integers, as FP8
// (E4M3, E5M2), times an optional scale and plus an optional zero point, each indexed by
// (token / tg, channel / cg) (tg = 0: one row for every token).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <bit>
#include <cmath>
#if defined(__F16C__) || defined(__SSE4_1__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

enum Meta { kNone = 0, kF32 = 1, kF16 = 2, kE8M0 = 3 };

struct Side {  // a scale or a zero point
  int type = kNone;
  const void* ptr = nullptr;
  int64_t sb = 0, sh = 0, sr = 0, sc = 0;

  inline float at(int64_t off) const {
    switch (type) {
      case kF32: return static_cast<const float*>(ptr)[off];
      case kF16: {
#if defined(__F16C__)
        return _cvtsh_ss(static_cast<const uint16_t*>(ptr)[off]);  // one instruction, not c10's bit arithmetic
#else
        return static_cast<float>(static_cast<const c10::Half*>(ptr)[off]);
#endif
      }
      default: {  // E8M0: 2^(e - 127), built from its bits (e = 0 is the float32 subnormal 2^-127)
        const uint32_t e = static_cast<const uint8_t*>(ptr)[off];
        union { uint32_t i; float f; } u;
        u.i = e ? e << 23 : 1u << 22;
        return u.f;
      }
    }
  }
};

struct Part {
  int64_t first = 0, n = 0;
  int bits = 0;  // 0 float32, 16 bfloat16, -16 float16, or 8/4/2-bit codes
  int mode = 0;  // codes: 0 unsigned, 1 two's complement, 2 FP8 E4M3, 3 FP8 E5M2 (8-bit only)
  const void* data = nullptr;
  int64_t sb = 0, sh = 0, sn = 0;  // element strides along batch, head, token (the last dim is contiguous)
  int64_t tg = 1, cg = 1;
  Side scale, zero;
};

Side side(const torch::Tensor& t) {
  Side s;
  if (!t.defined() || t.numel() == 0) return s;
  TORCH_CHECK(t.dim() == 4, "a scale or zero point is [batch, heads, rows, cols]");
  if (t.scalar_type() == torch::kFloat32) s.type = kF32;
  else if (t.scalar_type() == torch::kFloat16) s.type = kF16;
  else if (t.scalar_type() == torch::kUInt8) s.type = kE8M0;
  else TORCH_CHECK(false, "scale dtype must be float32, float16 or uint8 (E8M0)");
  s.ptr = t.data_ptr();
  s.sb = t.size(0) == 1 ? 0 : t.stride(0);
  s.sh = t.size(1) == 1 ? 0 : t.stride(1);
  s.sr = t.stride(2);
  s.sc = t.stride(3);
  return s;
}

std::vector<Part> parts(const std::vector<torch::Tensor>& ts, const std::vector<int64_t>& is) {
  TORCH_CHECK(ts.size() % 3 == 0 && is.size() == ts.size() / 3 * 4, "3 tensors and 4 ints per part");
  std::vector<Part> out;
  int64_t first = 0;
  for (size_t j = 0; j < ts.size() / 3; ++j) {
    Part p;
    const auto& data = ts[3 * j];
    const size_t i = 4 * j;
    TORCH_CHECK(data.dim() == 4 && data.stride(3) == 1, "part data is [batch, heads, tokens, width], rows contiguous");
    p.bits = static_cast<int>(is[i]);
    p.mode = static_cast<int>(is[i + 1]);
    TORCH_CHECK(p.mode >= 0 && p.mode <= 3 && (p.mode < 2 || p.bits == 8), "unknown code mode ", p.mode);
    p.tg = is[i + 2];
    p.cg = is[i + 3];
    p.data = data.data_ptr();
    p.sb = data.size(0) == 1 ? 0 : data.stride(0);
    p.sh = data.size(1) == 1 ? 0 : data.stride(1);
    p.sn = data.stride(2);
    p.n = data.size(2);
    p.first = first;
    first += p.n;
    p.scale = side(ts[3 * j + 1]);
    p.zero = side(ts[3 * j + 2]);
    out.push_back(p);
  }
  return out;
}

// Exact-enough exp for x <= 0 (a score minus its row maximum), written so the compiler vectorizes it:
// Cephes' expf (range reduction by ln 2 in two parts, a degree-6 polynomial), about 1 ulp; 0 below -87.3
// (-inf included), where float32's exp underflows anyway.
inline float exp_nonpos(float x) {
  const float keep = x < -87.3f ? 0.f : 1.f;  // a select, not a branch: the loop over a row vectorizes
  const float xc = x < -87.3f ? -87.3f : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);  // 2^n, n in [-126, 0]
  return e * two_n * keep;
}

enum Kind { kDenseF32, kDenseBF16, kDenseF16, kU8, kS8, kE4M3, kE5M2, kU4, kS4, kU2, kS2 };

inline int kind_of(const Part& p) {
  switch (p.bits) {
    case 0: return kDenseF32;
    case 16: return kDenseBF16;
    case -16: return kDenseF16;
    case 8: return p.mode == 0 ? kU8 : p.mode == 1 ? kS8 : p.mode == 2 ? kE4M3 : kE5M2;
    case 4: return p.mode ? kS4 : kU4;
    case 2: return p.mode ? kS2 : kU2;
    default: TORCH_CHECK(false, "unsupported part width ", p.bits);
  }
  return 0;
}

// An FP8 byte as float32, exactly, without a table: its 7 magnitude bits placed at the top of a float32's exponent
// and mantissa fields give the same value times 2^(127 - bias) (subnormals included: the float32 is then
// subnormal too, and the product is exact), and the sign bit moves to the float's.
template <int Shift, int Bias>
inline float fp8_value(uint8_t b) {
  union { uint32_t i; float f; } u;
  u.i = (static_cast<uint32_t>(b & 0x80) << 24) | (static_cast<uint32_t>(b & 0x7F) << Shift);
  return u.f * (Bias == 7 ? 0x1p120f : 0x1p112f);
}

#if defined(__SSE4_1__)
// Sixteen code bytes (unsigned, or two's complement already sign-extended to 8 bits) as sixteen floats.
template <bool Signed>
inline void bytes16_to_float(__m128i v, float* out) {
#if defined(__AVX512F__)
  const __m512i w = Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
  _mm512_storeu_ps(out, _mm512_cvtepi32_ps(w));
#elif defined(__AVX2__)
  const __m128i hi = _mm_unpackhi_epi64(v, v);
  _mm256_storeu_ps(out, _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v)));
  _mm256_storeu_ps(out + 8, _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi)));
#else
  alignas(16) int8_t b[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(b), v);
  for (int i = 0; i < 16; ++i) {
    out[i] = Signed ? static_cast<float>(b[i]) : static_cast<float>(static_cast<uint8_t>(b[i]));
  }
#endif
}

// Two's complement of `bits`-bit fields held in bytes: (v ^ h) - h with h = 2^(bits-1).
template <bool Signed>
inline __m128i sign_fields(__m128i v, int half) {
  if (!Signed) return v;
  const __m128i h = _mm_set1_epi8(static_cast<char>(half));
  return _mm_sub_epi8(_mm_xor_si128(v, h), h);
}

// 16 packed bytes of 4-bit codes (32 channels, the first code of a byte in its low bits) as floats.
template <bool Signed>
inline void nibbles32(const uint8_t* x, float* out) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  const __m128i m = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
  bytes16_to_float<Signed>(sign_fields<Signed>(_mm_unpacklo_epi8(lo, hi), 8), out);
  bytes16_to_float<Signed>(sign_fields<Signed>(_mm_unpackhi_epi8(lo, hi), 8), out + 16);
}

// 16 packed bytes of 2-bit codes (64 channels) as floats.
template <bool Signed>
inline void crumbs64(const uint8_t* x, float* out) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  const __m128i m = _mm_set1_epi8(3);
  const __m128i f0 = _mm_and_si128(v, m), f1 = _mm_and_si128(_mm_srli_epi16(v, 2), m);
  const __m128i f2 = _mm_and_si128(_mm_srli_epi16(v, 4), m), f3 = _mm_and_si128(_mm_srli_epi16(v, 6), m);
  const __m128i a = _mm_unpacklo_epi8(f0, f1), b = _mm_unpacklo_epi8(f2, f3);
  const __m128i c = _mm_unpackhi_epi8(f0, f1), e = _mm_unpackhi_epi8(f2, f3);
  bytes16_to_float<Signed>(sign_fields<Signed>(_mm_unpacklo_epi16(a, b), 2), out);
  bytes16_to_float<Signed>(sign_fields<Signed>(_mm_unpackhi_epi16(a, b), 2), out + 16);
  bytes16_to_float<Signed>(sign_fields<Signed>(_mm_unpacklo_epi16(c, e), 2), out + 32);
  bytes16_to_float<Signed>(sign_fields<Signed>(_mm_unpackhi_epi16(c, e), 2), out + 48);
}
#endif

// The 8 / Bits codes of every byte value as floats, unsigned or two's complement (built once; 2 KB for 4-bit
// codes, 4 KB for 2-bit): a byte's codes are one small copy, for the bytes the vector unpacking leaves.
template <int Bits>
inline const float (*code_table(bool is_signed))[8 / Bits] {
  constexpr int per = 8 / Bits, mask = (1 << Bits) - 1, half = 1 << (Bits - 1);
  struct Tables {
    float t[2][256][per];
    Tables() {
      for (int b = 0; b < 256; ++b) {
        for (int k = 0; k < per; ++k) {
          const int v = (b >> (Bits * k)) & mask;
          t[0][b][k] = static_cast<float>(v);
          t[1][b][k] = static_cast<float>((v ^ half) - half);
        }
      }
    }
  };
  static const Tables tables;
  return tables.t[is_signed ? 1 : 0];
}

// A row of packed Bits-bit codes (the first code of a byte in its low bits) as floats: 16 bytes at a time with
// vector shuffles, the rest a byte at a time from the table.
template <int Bits, bool Signed>
inline void packed_row(const uint8_t* x, int64_t d, float* out) {
  constexpr int per = 8 / Bits;
  int64_t c = 0;
#if defined(__SSE4_1__)
  for (; c + 16 <= d / per; c += 16) {
    if constexpr (Bits == 4) {
      nibbles32<Signed>(x + c, out + per * c);
    } else {
      crumbs64<Signed>(x + c, out + per * c);
    }
  }
#endif
  const float(*table)[per] = code_table<Bits>(Signed);
  for (; c < d / per; ++c) std::memcpy(out + per * c, table[x[c]], sizeof(float[per]));
}

// The raw values (codes as integers or FP8 values; dense rows as they are) into out[0:d].
template <int K>
inline void raw_row(const Part& p, int64_t off, int64_t d, float* out) {
  const uint8_t* x = static_cast<const uint8_t*>(p.data) + (K <= kDenseF16 ? 0 : off);
  if constexpr (K == kDenseF32) {
    const float* v = static_cast<const float*>(p.data) + off;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] = v[c];
  } else if constexpr (K == kDenseBF16) {
    const uint16_t* v = static_cast<const uint16_t*>(p.data) + off;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) {
      union { uint32_t i; float f; } u;
      u.i = static_cast<uint32_t>(v[c]) << 16;
      out[c] = u.f;
    }
  } else if constexpr (K == kDenseF16) {
    const c10::Half* v = static_cast<const c10::Half*>(p.data) + off;
    for (int64_t c = 0; c < d; ++c) out[c] = static_cast<float>(v[c]);
  } else if constexpr (K == kU8) {
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] = static_cast<float>(x[c]);
  } else if constexpr (K == kS8) {
    const int8_t* v = reinterpret_cast<const int8_t*>(x);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] = static_cast<float>(v[c]);
  } else if constexpr (K == kE4M3) {
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] = fp8_value<20, 7>(x[c]);
  } else if constexpr (K == kE5M2) {
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] = fp8_value<21, 15>(x[c]);
  } else if constexpr (K == kU4 || K == kS4) {
    packed_row<4, K == kS4>(x, d, out);
  } else {
    packed_row<2, K == kS2>(x, d, out);
  }
}

// Decoded rows are used eight at a time: one pass over a query row (or an accumulator) for eight keys (values),
// with eight independent sums, instead of one latency-bound reduction per row.
constexpr int kTile = 8;

template <typename F>
struct Tile {
  F use;  // use(rows, factors, positions, count)
  int64_t d;
  float* rows;  // [kTile, d]
  float factor[kTile];
  int64_t col[kTile];
  int n = 0;
  float* slot() { return rows + n * d; }
  void push(float f, int64_t c) {
    factor[n] = f;
    col[n] = c;
    if (++n == kTile) flush();
  }
  void flush() {
    if (n) use(rows, factor, col, n);
    n = 0;
  }
};

// Rows j0 <= j < j1 of part p (batch b, head h), each decoded into the tile's next slot and pushed with its
// factor and position (j + shift): the row times `factor` is the stored value. One scale per token over the whole
// row (int8's default, a per-tensor FP8 scale) is not multiplied in but handed over as the factor, to fold into the
// score or the probability (KIVI's fold); other scales and zero points are applied to the row, a product then a
// sum, as the stores' dequantize does.
template <int K, typename T>
inline void rows_of(const Part& p, int64_t b, int64_t h, int64_t j0, int64_t j1, int64_t d, int64_t shift,
                    float* sbuf, float* zbuf, T& tile) {
  const bool has_scale = p.scale.type != kNone, has_zero = p.zero.type != kNone;
  const bool fold = has_scale && !has_zero && p.cg >= d;
  int64_t cached = -1;  // the token-group row whose scales sbuf / zbuf hold (channel groups of width 1)
  for (int64_t j = j0; j < j1; ++j) {
    float* row = tile.slot();
    raw_row<K>(p, b * p.sb + h * p.sh + j * p.sn, d, row);
    float factor = 1.f;
    if (has_scale || has_zero) {
      const int64_t r = p.tg > 0 ? j / p.tg : 0;
      if (fold) {
        factor = p.scale.at(b * p.scale.sb + h * p.scale.sh + r * p.scale.sr);
      } else if (p.cg > 1) {
        const int64_t sbase = b * p.scale.sb + h * p.scale.sh + r * p.scale.sr;
        const int64_t zbase = b * p.zero.sb + h * p.zero.sh + r * p.zero.sr;
        for (int64_t g = 0; g * p.cg < d; ++g) {
          float* o = row + g * p.cg;
          const float sv = has_scale ? p.scale.at(sbase + g * p.scale.sc) : 1.f;
          const float zv = has_zero ? p.zero.at(zbase + g * p.zero.sc) : 0.f;
#pragma omp simd
          for (int64_t c = 0; c < p.cg; ++c) o[c] = o[c] * sv + zv;
        }
      } else {
        if (r != cached) {  // a new token group: its per-channel scale and zero, once
          for (int64_t c = 0; c < d; ++c) {
            sbuf[c] = has_scale ? p.scale.at(b * p.scale.sb + h * p.scale.sh + r * p.scale.sr + c * p.scale.sc) : 1.f;
            zbuf[c] = has_zero ? p.zero.at(b * p.zero.sb + h * p.zero.sh + r * p.zero.sr + c * p.zero.sc) : 0.f;
          }
          cached = r;
        }
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) row[c] *= sbuf[c];
        if (has_zero) {
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) row[c] += zbuf[c];
        }
      }
    }
    tile.push(factor, j + shift);
  }
}

template <typename T>
inline void dispatch_rows(const Part& p, int64_t b, int64_t h, int64_t j0, int64_t j1, int64_t d, int64_t shift,
                          float* sbuf, float* zbuf, T& f) {
  switch (kind_of(p)) {
#define KV_CASE(K) \
  case K:          \
    return rows_of<K>(p, b, h, j0, j1, d, shift, sbuf, zbuf, f);
    KV_CASE(kDenseF32) KV_CASE(kDenseBF16) KV_CASE(kDenseF16) KV_CASE(kU8) KV_CASE(kS8) KV_CASE(kE4M3)
    KV_CASE(kE5M2) KV_CASE(kU4) KV_CASE(kS4) KV_CASE(kU2) KV_CASE(kS2)
#undef KV_CASE
  }
}

template <int DC>
inline float dot_fixed(const float* a, const float* b) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int c = 0; c < DC; ++c) acc += a[c] * b[c];
  return acc;
}

// The common head widths as compile-time constants: the loop unrolls into whole vectors with one reduction.
inline float dot(const float* a, const float* b, int64_t d) {
  if (d == 64) return dot_fixed<64>(a, b);
  if (d == 128) return dot_fixed<128>(a, b);
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t c = 0; c < d; ++c) acc += a[c] * b[c];
  return acc;
}

inline void axpy(float w, const float* x, float* y, int64_t d) {
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) y[c] += w * x[c];
}

// Every token n0 <= n < n1 of the parts, in order, through the tile (flushed at the end).
template <typename T>
inline void each_row(const std::vector<Part>& ps, int64_t b, int64_t h, int64_t n0, int64_t n1, int64_t d,
                     float* sbuf, float* zbuf, T& tile) {
  for (const Part& p : ps) {
    const int64_t lo = std::max(n0, p.first), hi = std::min(n1, p.first + p.n);
    if (lo < hi) dispatch_rows(p, b, h, lo - p.first, hi - p.first, d, p.first - n0, sbuf, zbuf, tile);
  }
  tile.flush();
}

// Eight dot products of q with rows r[0..7] (each DC wide, consecutive).
template <int DC>
inline void dots8(const float* q, const float* r, float* out) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f, a4 = 0.f, a5 = 0.f, a6 = 0.f, a7 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, a4, a5, a6, a7)
  for (int c = 0; c < DC; ++c) {
    const float x = q[c];
    a0 += x * r[c];
    a1 += x * r[DC + c];
    a2 += x * r[2 * DC + c];
    a3 += x * r[3 * DC + c];
    a4 += x * r[4 * DC + c];
    a5 += x * r[5 * DC + c];
    a6 += x * r[6 * DC + c];
    a7 += x * r[7 * DC + c];
  }
  out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7;
}

// y += sum_t w[t] * r[t] over eight rows.
template <int DC>
inline void axpy8(const float* w, const float* r, float* y) {
#pragma omp simd
  for (int c = 0; c < DC; ++c) {
    y[c] += w[0] * r[c] + w[1] * r[DC + c] + w[2] * r[2 * DC + c] + w[3] * r[3 * DC + c] +
            w[4] * r[4 * DC + c] + w[5] * r[5 * DC + c] + w[6] * r[6 * DC + c] + w[7] * r[7 * DC + c];
  }
}

inline void tile_dots(const float* q, const float* rows, int n, int64_t d, float* out) {
  if (n == kTile && d == 64) return dots8<64>(q, rows, out);
  if (n == kTile && d == 128) return dots8<128>(q, rows, out);
  for (int t = 0; t < n; ++t) out[t] = dot(q, rows + t * d, d);
}

inline void tile_axpy(const float* w, const float* rows, int n, int64_t d, float* y) {
  if (n == kTile && d == 64) return axpy8<64>(w, rows, y);
  if (n == kTile && d == 128) return axpy8<128>(w, rows, y);
  for (int t = 0; t < n; ++t) axpy(w[t], rows + t * d, y, d);
}

}  // namespace

// q: [B, H, M, D] float32 contiguous (M = group * q_len query rows per KV head, row m = g * q_len + i);
// mask: empty or additive float32 [B, H, G, Q, N] (strides may be 0); chunk: tokens per task; returns
// [B, H, M, D] float32.
torch::Tensor attend(const torch::Tensor& q, const std::vector<torch::Tensor>& kt, const std::vector<int64_t>& ki,
                     const std::vector<torch::Tensor>& vt, const std::vector<int64_t>& vi, const torch::Tensor& mask,
                     int64_t q_len, double scaling, int64_t chunk) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [B, H, M, D] float32");
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  TORCH_CHECK(D <= 512 && D % 4 == 0, "head_dim must be a multiple of 4 up to 512");  // packed rows' scratch
  const auto kp = parts(kt, ki), vp = parts(vt, vi);
  int64_t N = 0;
  for (const auto& p : kp) N += p.n;
  int64_t NV = 0;
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
  const float ninf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(M * chunk), rows(kTile * D), sbuf(D), zbuf(D);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (H * chunks), h = (t / chunks) % H, c = t % chunks;
      const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk), L = n1 - n0;
      const float* qb = qp + (b * H + h) * M * D;
      auto score = [&](const float* r, const float* f, const int64_t* col, int n) {
        float out[kTile];
        for (int64_t m = 0; m < M; ++m) {
          tile_dots(qb + m * D, r, n, D, out);
          for (int i = 0; i < n; ++i) s[m * L + col[i]] = out[i] * f[i] * scl;
        }
      };
      Tile<decltype(score)> keys{score, D, rows.data()};
      each_row(kp, b, h, n0, n1, D, sbuf.data(), zbuf.data(), keys);
      float* accs = pa + t * M * D;
      for (int64_t m = 0; m < M; ++m) {
        float* sm = s.data() + m * L;
        if (masked) {
          const float* mrow = mk + b * ms[0] + h * ms[1] + (m / q_len) * ms[2] + (m % q_len) * ms[3];
          for (int64_t col = 0; col < L; ++col) sm[col] += mrow[(n0 + col) * ms[4]];
        }
        float top = ninf;
        for (int64_t col = 0; col < L; ++col) top = std::max(top, sm[col]);
        // A row masked everywhere in this chunk keeps max -inf: its probabilities are 0, its sums 0.
        const float safe = std::isinf(top) ? 0.f : top;
#pragma omp simd
        for (int64_t col = 0; col < L; ++col) sm[col] = exp_nonpos(sm[col] - safe);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t col = 0; col < L; ++col) sum += sm[col];
        pm[t * M + m] = top;
        ps[t * M + m] = sum;
        std::fill(accs + m * D, accs + (m + 1) * D, 0.f);
      }
      auto weigh = [&](const float* r, const float* f, const int64_t* col, int n) {
        float w[kTile];
        for (int64_t m = 0; m < M; ++m) {
          bool any = false;
          for (int i = 0; i < n; ++i) any |= (w[i] = s[m * L + col[i]] * f[i]) != 0.f;
          if (any) tile_axpy(w, r, n, D, accs + m * D);
        }
      };
      Tile<decltype(weigh)> values{weigh, D, rows.data()};
      each_row(vp, b, h, n0, n1, D, sbuf.data(), zbuf.data(), values);
    }
  });

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
}

namespace {

// x as float32 in groups of `group` channels, with int8 codes shaped like it and one metadata entry per group
// ([..., D / group, 1]), for the two group quantizers below.
struct Grouped {
  torch::Tensor x, codes, meta;
  int64_t groups;
};

Grouped grouped(const torch::Tensor& x_in, int64_t group, torch::ScalarType meta_type) {
  Grouped g;
  g.x = x_in.contiguous().to(torch::kFloat32);
  const int64_t d = g.x.size(-1);
  TORCH_CHECK(group > 0 && d % group == 0, "the group must divide the last dimension");
  g.codes = torch::empty(g.x.sizes(), g.x.options().dtype(torch::kInt8));
  auto sizes = g.x.sizes().vec();
  sizes.back() = d / group;
  sizes.push_back(1);
  g.meta = torch::empty(sizes, g.x.options().dtype(meta_type));
  g.groups = g.x.numel() / group;
  return g;
}

// The largest |v[c]|; `nonfinite` set when some element is NaN or infinite.
inline float absmax(const float* v, int64_t n, bool& nonfinite) {
  float m = 0.f;
  for (int64_t c = 0; c < n; ++c) {
    const float a = std::fabs(v[c]);
    if (!std::isfinite(a)) nonfinite = true;
    m = a > m ? a : m;
  }
  return m;
}

inline int8_t clamp127(float q) { return static_cast<int8_t>(q < -127.f ? -127.f : (q > 127.f ? 127.f : q)); }

// One group of quantize_int8_token: the scale (absmax / 127 rounded to float16) into *scale, the codes into out.
inline void int8_group(const float* v, int64_t group, int8_t* out, c10::Half* scale, float& peak, bool& bad) {
  const float s32 = absmax(v, group, bad) / 127.0f;
  peak = s32 > peak ? s32 : peak;
  const c10::Half h(s32);
  *scale = h;
  const float s = static_cast<float>(h);
  const float denom = s > 0.f ? s : 1.0f;
  for (int64_t c = 0; c < group; ++c) out[c] = clamp127(std::nearbyint(v[c] / denom));
}

}  // namespace

// Symmetric int8 with one float16 scale per group of `group` channels of a token: kvbench.quantizers.quantize_int8's
// token axis, bit for bit (the same float32 operations in the same order: absmax / 127, rounded to float16, the
// codes rounded half to even from x / scale and clamped to +-127), in one pass instead of a dozen tensor ops per
// decode step and layer. Returns the codes, the scales [..., D / group, 1] and the largest float32 scale before
// rounding (NaN if any element is not finite), which the caller checks as _check_metadata does.
std::vector<torch::Tensor> quantize_int8_token(const torch::Tensor& x_in, int64_t group) {
  Grouped g = grouped(x_in, group, torch::kFloat16);
  const float* xp = g.x.data_ptr<float>();
  int8_t* cp = g.codes.data_ptr<int8_t>();
  c10::Half* sp = g.meta.data_ptr<c10::Half>();
  float peak = 0.f;
  bool bad = false;
  for (int64_t i = 0; i < g.groups; ++i) int8_group(xp + i * group, group, cp + i * group, sp + i, peak, bad);
  return {g.codes, g.meta, torch::full({}, bad ? std::numeric_limits<float>::quiet_NaN() : peak)};
}

// quantize_int8_token of x [B, H, m, D] written straight into tokens `start` .. start + m - 1 of a chunk's storage:
// codes [B, H, T, D] int8 and scales [B, H, T, D / group, 1] float16 (a ChunkList tail's reserve), the same values
// bit for bit, with no tensor made per decode step. Returns the largest float32 scale before rounding (NaN if any
// element is not finite).
double quantize_int8_token_into(const torch::Tensor& x_in, int64_t group, torch::Tensor codes, torch::Tensor scales,
                                int64_t start) {
  const torch::Tensor x = x_in.contiguous().to(torch::kFloat32);
  TORCH_CHECK(x.dim() == 4 && codes.dim() == 4 && scales.dim() == 5, "x, codes: [B, H, T, D]; scales: 5 dims");
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && scales.scalar_type() == torch::kFloat16, "int8 codes, half scales");
  const int64_t B = x.size(0), H = x.size(1), M = x.size(2), D = x.size(3);
  TORCH_CHECK(group > 0 && D % group == 0, "the group must divide the last dimension");
  TORCH_CHECK(codes.size(0) == B && codes.size(1) == H && codes.size(3) == D && codes.stride(3) == 1,
              "codes: [B, H, T, D] with unit channel stride");
  TORCH_CHECK(scales.size(0) == B && scales.size(1) == H && scales.size(2) == codes.size(2) &&
              scales.size(3) == D / group && scales.size(4) == 1, "scales: [B, H, T, D / group, 1]");
  TORCH_CHECK(start >= 0 && start + M <= codes.size(2), "the tokens must fit the storage");
  const float* xp = x.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  c10::Half* sp = scales.data_ptr<c10::Half>();
  float peak = 0.f;
  bool bad = false;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < M; ++t) {
        const float* v = xp + ((b * H + h) * M + t) * D;
        int8_t* out = cp + b * codes.stride(0) + h * codes.stride(1) + (start + t) * codes.stride(2);
        c10::Half* sc = sp + b * scales.stride(0) + h * scales.stride(1) + (start + t) * scales.stride(2);
        for (int64_t i = 0; i < D / group; ++i) {
          int8_group(v + i * group, group, out + i * group, sc + i * scales.stride(3), peak, bad);
        }
      }
    }
  }
  return bad ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(peak);
}

// Block floating point with 8-bit mantissas, kvbench.quantizers.quantize_bfp bit for bit: per block of `block`
// channels the shared exponent floor(log2(absmax)) - 6 (frexp's, exactly), clamped to +-127, and mantissas
// round(x * 2^-e) (half to even) clamped to +-127. Returns mantissas (int8), exponents + 127 (uint8, [..., D/block,
// 1]) and a flag tensor: 1 when some element is not finite (the caller raises as check_finite does).
std::vector<torch::Tensor> quantize_bfp8(const torch::Tensor& x_in, int64_t block) {
  Grouped g = grouped(x_in, block, torch::kUInt8);
  const float* xp = g.x.data_ptr<float>();
  int8_t* mp = g.codes.data_ptr<int8_t>();
  uint8_t* ep = g.meta.data_ptr<uint8_t>();
  bool bad = false;
  for (int64_t i = 0; i < g.groups; ++i) {
    const float* v = xp + i * block;
    const float amax = absmax(v, block, bad);
    int k = 0;
    std::frexp(amax, &k);
    int e = amax > 0.f ? k - 1 - 6 : -127;
    e = e < -127 ? -127 : (e > 127 ? 127 : e);
    ep[i] = static_cast<uint8_t>(e + 127);
    const float f = std::ldexp(1.0f, -e);
    for (int64_t c = 0; c < block; ++c) mp[i * block + c] = clamp127(std::nearbyint(v[c] * f));
  }
  return {g.codes, g.meta, torch::full({}, bad ? 1 : 0, torch::kInt32)};
}

// FP8 encoding, kvbench.quantizers.quantize_fp8 bit for bit: y = x / scale (scale [1 or B, 1 or H, 1, 1 or D]),
// clamped to +-fmax and rounded to the format by c10's conversion (PyTorch's own). Returns the payload, the count
// of elements beyond fmax * (1 + 4 eps) and a flag tensor: 1 when some |y| is not finite.
std::vector<torch::Tensor> quantize_fp8(const torch::Tensor& x_in, const torch::Tensor& scale_in, bool e4m3) {
  const auto x = x_in.contiguous().to(torch::kFloat32);
  TORCH_CHECK(x.dim() == 4 && scale_in.dim() == 4, "x: [B, H, T, D], scale: 4-D");
  const auto scale = scale_in.to(torch::kFloat32).expand({x.size(0), x.size(1), 1, x.size(3)});
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  auto payload = torch::empty(x.sizes(), x.options().dtype(e4m3 ? torch::kFloat8_e4m3fn : torch::kFloat8_e5m2));
  const float fmax = e4m3 ? 448.f : 57344.f;
  const float limit = fmax * (1 + 4 * std::numeric_limits<float>::epsilon());
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  int64_t saturated = 0;
  bool bad = false;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const float* srow = sp + b * scale.stride(0) + h * scale.stride(1);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t off = ((b * H + h) * T + t) * D;
        for (int64_t c = 0; c < D; ++c) {
          float y = xp[off + c] / srow[c * scale.stride(3)];
          const float a = std::fabs(y);
          if (!std::isfinite(a)) bad = true;
          if (a > limit) ++saturated;
          y = y < -fmax ? -fmax : (y > fmax ? fmax : y);
          if (e4m3) {
            static_cast<c10::Float8_e4m3fn*>(payload.data_ptr())[off + c] = c10::Float8_e4m3fn(y);
          } else {
            static_cast<c10::Float8_e5m2*>(payload.data_ptr())[off + c] = c10::Float8_e5m2(y);
          }
        }
      }
    }
  }
  return {payload, torch::full({}, saturated, torch::kInt64), torch::full({}, bad ? 1 : 0, torch::kInt32)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_bfp8", &quantize_bfp8, "bfp with 8-bit mantissas (kvbench.quantizers)");
  m.def("quantize_fp8", &quantize_fp8, "fp8 encoding (kvbench.quantizers)");
  m.def("attend", &attend, "Fused block attention over stored parts (kvbench.fused)");
  m.def("quantize_int8_token", &quantize_int8_token, "int8 token-axis quantization (kvbench.quantizers)");
  m.def("quantize_int8_token_into", &quantize_int8_token_into,
        "int8 token-axis quantization into a chunk's storage (kvbench.quantizers)");
}
