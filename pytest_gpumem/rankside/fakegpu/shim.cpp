// pytest-gpumem's fake GPU: a CUDA device guard and CUDA hooks for torch's CPU build, and for a CUDA
// build on a machine without a CUDA driver.
//
// Loaded (RTLD_GLOBAL) before torch is imported: torch caches its CUDA hooks at the first call, and
// without a CUDA device guard every copy into a fake CUDA tensor fails ("PyTorch is not linked with
// support for cuda devices"), as does backward ("Cannot access accelerator device when none is
// available"). c10's own FakeGuardImpl is the guard; the hooks say CUDA is built and available, with
// no primary context, so nothing tries to start a real one; pinned memory is plain host memory.
// A CUDA build's own guard and hooks ask the driver ("CUDA driver version is insufficient"): there the
// shim is linked against libc10_cuda and libtorch_cuda, whose registrations run first, and replaces
// them (a guard's registration is a plain store; the hooks' preferred priority wins over theirs).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
#if __has_include(<torch/csrc/distributed/c10d/reducer_timer.hpp>)
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>
#define GPUMEM_DDP_TIMER 1
#endif

namespace at {
struct GpumemFakeCUDAHooks final : CUDAHooksInterface {
  explicit GpumemFakeCUDAHooks(CUDAHooksArgs /*unused*/) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex /*device_index*/) const override { return false; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  // Pinned host memory (pin_memory=True, a DataLoader's pinning thread) is host memory: plain CPU
  // allocations here, and every host pointer reads as pinned (DDP's reducer asserts it of its own).
  Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  bool isPinnedPtr(const void* /*data*/) const override { return true; }
};
C10_REGISTER_CLASS_WITH_PRIORITY(CUDAHooksRegistry, CUDAHooks, c10::REGISTRY_PREFERRED, GpumemFakeCUDAHooks)
}  // namespace at

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

#ifdef GPUMEM_DDP_TIMER
// DDP's reducer times its first iterations on the parameters' device: a CUDA build's timer records CUDA
// events, which ask the driver ("CUDA driver version is insufficient" at the first forward). On a fake
// GPU it keeps host times, as the CPU build's reducer does.
namespace c10d {
struct GpumemHostTimer final : Timer {
  explicit GpumemHostTimer(c10::Device /*unused*/) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    int64_t begin = getTimeRef(start);
    int64_t finish = getTimeRef(end);
    if (begin == kUnsetTime || finish == kUnsetTime || finish < begin) {
      return std::nullopt;
    }
    return finish - begin;
  }
};
C10_REGISTER_TYPED_CLASS_WITH_PRIORITY(TimerRegistry, c10::kCUDA, c10::REGISTRY_PREFERRED, GpumemHostTimer)
}  // namespace c10d
#endif
