// CHECK(cond, printf-args...) for the C++ unit tests: a failed check prints its file, line and
// message to stderr and counts in `check_failures()`; main returns `check_failures() ? 1 : 0`.
#pragma once

#include <cstdio>

inline int& check_failures() {
  static int failures = 0;
  return failures;
}

#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                        \
      std::fprintf(stderr, "\n");                               \
      ++check_failures();                                       \
    }                                                           \
  } while (0)
