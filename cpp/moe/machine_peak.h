// Measured peak arithmetic rates (for the benchmark's "fraction of the machine" columns).
#pragma once

#include <cstdint>
#include <string>

namespace llmq_moe {

// Giga-ops per second (2 per multiply-accumulate) of `kind` in {"fp32_fma", "bf16_dot",
// "int8_vnni"} on `threads` threads, running for about `seconds`. Throws if the CPU lacks it.
double measure_peak_gops(const std::string& kind, int threads, double seconds);

// Best GB/s of `repeats` sequential reads of a `bytes` buffer split across `threads`
// threads (AVX-512 loads, 4 streams per thread).
double measure_read_gbps(int threads, int64_t bytes, int repeats);

}  // namespace llmq_moe
