// What the watched backend goes by on an NCCL-like group where torch's backend hands back no
// work: ProcessGroupNCCL runs a synchronous op (asyncOp false) on the caller's current stream and
// returns a null work (`return asyncOp ? work : nullptr;` in its collective()), so fastdist
// records an event of its own on that stream right after the call, and the op has run when the
// event has. Also: whether the current stream is capturing a CUDA graph (nothing is watched
// then), and the capture mode of fastdist's polling thread.
#include "internal.h"
#include "nccl_double.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <dlfcn.h>

#include <initializer_list>

namespace fastdist::watched {

namespace {

// An event on a device's current stream: complete once everything issued on that stream before
// it ran. isCompleted() is the event's query, which never blocks; it has no future.
class EventMarker : public c10d::Work {
 public:
  EventMarker(int rank, c10::Device device, std::vector<at::Tensor> tensors)
      : c10d::Work(rank), event_(device.type()), tensors_(std::move(tensors)) {
    c10::impl::VirtualGuardImpl impl(device.type());
    event_.record(impl.getStream(device));
  }
  bool isCompleted() override { return event_.query(); }
  bool isSuccess() const override { return true; }
  std::exception_ptr exception() const override { return nullptr; }
  std::vector<at::Tensor> result() override { return tensors_; }
  bool wait(std::chrono::milliseconds) override { return true; }

 private:
  c10::Event event_;
  std::vector<at::Tensor> tensors_;
};

c10::Device device_of(c10::ArrayRef<at::Tensor> ins) {
  for (const auto& t : ins) {
    if (t.defined() && !t.is_cpu()) return t.device();
  }
  // A barrier, or an op with no input: the device CUDA uses on this thread.
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getDevice();
}

// A symbol of a library the process has loaded already (fastdist links no CUDA library: where
// none is loaded, there is nothing to ask). `libs`: where to look when the global scope lacks it.
void* loaded_symbol(const char* name, std::initializer_list<const char*> libs) {
  void* sym = dlsym(RTLD_DEFAULT, name);
  for (const char* lib : libs) {
    if (sym) break;
    if (void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD)) sym = dlsym(h, name);
  }
  return sym;
}

void* cudart_symbol(const char* name) {
  return loaded_symbol(name, {"libcudart.so.13", "libcudart.so.12", "libcudart.so"});
}

// torch before 2.13 has no isStreamCapturing: the CUDA runtime is asked itself, with the stream's
// handle from c10's CUDAStream::stream() (c10::cuda::CUDAStream holds just its c10::Stream, so a
// c10::Stream stands for one as `this`).
bool runtime_capturing(const c10::Stream& s) {
  using ToHandle = void* (*)(const c10::Stream*);
  using IsCapturing = int (*)(void*, int*);
  static auto to_handle =
      reinterpret_cast<ToHandle>(loaded_symbol("_ZNK3c104cuda10CUDAStream6streamEv", {"libc10_cuda.so"}));
  static auto is_capturing = reinterpret_cast<IsCapturing>(cudart_symbol("cudaStreamIsCapturing"));
  if (!to_handle || !is_capturing) return false;
  int status = 0;  // cudaStreamCaptureStatusNone
  return is_capturing(to_handle(&s), &status) == 0 && status != 0;
}

// torch 2.13 asks the device's guard whether a stream captures (isStreamCapturing); an older one
// has no such question (the runtime is asked instead).
template <typename Impl>
auto stream_capturing(const Impl& impl, const c10::Stream& s, int) -> decltype(impl.isStreamCapturing(s)) {
  return impl.isStreamCapturing(s);
}
template <typename Impl>
bool stream_capturing(const Impl&, const c10::Stream& s, long) {
  return runtime_capturing(s);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> stream_marker(c10d::Backend& inner, c10::ArrayRef<at::Tensor> ins) {
  if (auto* d = dynamic_cast<NcclDouble*>(&inner)) return d->current_stream_marker();
  return c10::make_intrusive<EventMarker>(inner.getRank(), device_of(ins), ins.vec());
}

bool capturing(c10::ArrayRef<at::Tensor> ins) {
  for (const auto& t : ins) {
    if (!t.defined() || !t.is_cuda()) continue;
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    return stream_capturing(*impl, impl->getStream(t.device()), 0);
  }
  return false;
}

void relax_capture_mode() {
  // cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureModeRelaxed) for this thread, as torch's
  // NCCL watchdog does for its own: an event query from any thread while another captures a graph
  // in the default (global) mode would fail and invalidate that capture. Looked up at run time:
  // fastdist links no CUDA library (nothing to do where none is loaded).
  using Fn = int (*)(int*);
  static auto fn = reinterpret_cast<Fn>(cudart_symbol("cudaThreadExchangeStreamCaptureMode"));
  if (fn) {
    int mode = 2;  // cudaStreamCaptureModeRelaxed
    fn(&mode);
  }
}

}  // namespace fastdist::watched
