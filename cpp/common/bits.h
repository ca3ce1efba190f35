// The IEEE-754 bit pattern of a float / double and back (memcpy: no aliasing UB).
#pragma once

#include <cstdint>
#include <cstring>

namespace llmq_bits {

template <typename To, typename From>
inline To bit_cast(From value) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To out;
  std::memcpy(&out, &value, sizeof(To));
  return out;
}

inline uint32_t float_to_bits(float f) { return bit_cast<uint32_t>(f); }
inline float bits_to_float(uint32_t u) { return bit_cast<float>(u); }
inline int64_t double_to_bits(double d) { return bit_cast<int64_t>(d); }
inline double bits_to_double(int64_t b) { return bit_cast<double>(b); }

}  // namespace llmq_bits
