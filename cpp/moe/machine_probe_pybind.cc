// pybind11 module `_machine_probe` for bench_moe.py only: the machine's measured peak
// arithmetic rates and read bandwidth (the benchmark's "fraction of the machine" columns).
// Kept out of the production extension `_moe_kernel.so`. The GIL is released while probing.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "machine_peak.h"

namespace py = pybind11;

PYBIND11_MODULE(_machine_probe, m) {
  m.doc() = "Machine probes for the MoE benchmark (not part of the llmq library).";
  m.def(
      "measure_peak_gops",
      [](const std::string& kind, int threads, double seconds) {
        py::gil_scoped_release release;
        return llmq_moe::measure_peak_gops(kind, threads, seconds);
      },
      "Measured peak Gop/s of fp32_fma, bf16_dot or int8_vnni on `threads` threads.");
  m.def(
      "measure_read_gbps",
      [](int threads, int64_t bytes, int repeats) {
        py::gil_scoped_release release;
        return llmq_moe::measure_read_gbps(threads, bytes, repeats);
      },
      "Measured sequential read bandwidth (GB/s) on `threads` threads.");
}
