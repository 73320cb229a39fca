// The devices Intel's SYCL runtime sees, one line each in sycl-ls's concise form
//   [backend:type][backend:N] platform, device version [driver]
// (no PyPI wheel ships sycl-ls). Host code only, so plain g++ builds it against the intel-sycl-rt wheel's
// headers and libsycl. An error the runtime raises, such as a malformed ONEAPI_DEVICE_SELECTOR, is printed
// to stderr with exit 1. Used by tests/test_sycl_runtime.py.
#define SYCL_DISABLE_FSYCL_SYCLHPP_WARNING
#include <sycl/sycl.hpp>
#include <iostream>
#include <map>

static const char *type_name(sycl::info::device_type t) {
  switch (t) {
  case sycl::info::device_type::cpu: return "cpu";
  case sycl::info::device_type::gpu: return "gpu";
  case sycl::info::device_type::accelerator: return "fpga";
  default: return "unknown";
  }
}

static std::string backend_name(sycl::backend b) {
  switch (b) {
  case sycl::backend::opencl: return "opencl";
  case sycl::backend::ext_oneapi_level_zero: return "level_zero";
  case sycl::backend::ext_oneapi_cuda: return "cuda";
  case sycl::backend::ext_oneapi_hip: return "hip";
  default: return "unknown";
  }
}

int main() {
  try {
    std::map<std::string, int> next;
    for (const auto &p : sycl::platform::get_platforms()) {
      std::string be = backend_name(p.get_backend());
      for (const auto &d : p.get_devices()) {
        std::cout << "[" << be << ":" << type_name(d.get_info<sycl::info::device::device_type>()) << "]"
                  << "[" << be << ":" << next[be]++ << "] " << p.get_info<sycl::info::platform::name>() << ", "
                  << d.get_info<sycl::info::device::name>() << " " << d.get_info<sycl::info::device::version>()
                  << " [" << d.get_info<sycl::info::device::driver_version>() << "]\n";
      }
    }
  } catch (const std::exception &e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
