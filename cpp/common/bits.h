// The IEEE-754 binary32 bit pattern of a float and back (memcpy: no aliasing UB).
#pragma once

#include <cstdint>
#include <cstring>

namespace llmq_bits {

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace llmq_bits
