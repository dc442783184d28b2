// CPU tensors allocated with malloc and aligned by hand, in place of PyTorch's posix_memalign.
//
// PyTorch's CPU allocator asks glibc for 64-byte-aligned blocks (posix_memalign). glibc before
// 2.38 does not reuse a freed aligned block of 1-32 MiB once smaller allocations sit between such
// blocks (glibc bug 14581): each new aligned block comes from the top of the heap, and an
// executor step, which frees and allocates the same activations and device-tier copies every
// step, grows the heap by what it frees (96 MiB of 24 MiB blocks freed and allocated again four
// times left 313 MiB resident; with malloc, 97). A block from plain malloc is reused as glibc
// reuses any free chunk. Here each block is malloc(n + 64), the tensor starts at the next
// 64-byte boundary past malloc's pointer (at least 16 bytes on: malloc aligns to 16), and the
// 8 bytes before it keep malloc's pointer for free.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>

namespace {

constexpr std::size_t kAlign = 64;  // c10's alignment of CPU tensors (gAlignment)

void release(void* data) {
  if (data != nullptr) std::free(static_cast<void**>(data)[-1]);
}

struct MallocAligned final : c10::Allocator {
  c10::DataPtr allocate(std::size_t nbytes) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (nbytes == 0) return {nullptr, nullptr, &release, cpu};
    void* raw = std::malloc(nbytes + kAlign);
    TORCH_CHECK_WITH(OutOfMemoryError, raw != nullptr, "tensorstow host allocator: out of memory allocating ",
                     nbytes, " bytes");
    void* data = reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(raw) + kAlign) & ~(kAlign - 1));
    static_cast<void**>(data)[-1] = raw;
    return {data, data, &release, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

MallocAligned allocator;

// Makes it the CPU allocator of every tensor allocated from now on (those allocated before keep
// theirs, and their deleters). Priority 1: over the default allocator's 0.
int64_t install() {
  c10::SetCPUAllocator(&allocator, /*priority=*/1);
  return c10::GetCPUAllocator() == &allocator ? 1 : 0;
}

}  // namespace

TORCH_LIBRARY(tensorstow_alloc, m) { m.def("install() -> int", &install); }
