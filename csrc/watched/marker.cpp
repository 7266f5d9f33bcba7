// What the watched backend goes by on an NCCL-like group where torch's backend hands back no
// work: ProcessGroupNCCL runs a synchronous op (asyncOp false) on the caller's current stream and
// returns a null work (`return asyncOp ? work : nullptr;` in its collective()), so fastdist
// records an event of its own on that stream right after the call, and the op has run when the
// event has. Also: whether the current stream is capturing a CUDA graph (nothing is watched
// then), and the capture mode of fastdist's polling thread.
#include "internal.h"

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

// The CUDA device this thread uses now; none where no GPU is there (a CUDA build of torch on a
// CPU machine, or a CPU build).
std::optional<c10::Device> current_cuda_device() {
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return std::nullopt;
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  if (impl.deviceCount() == 0) return std::nullopt;
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
// handle (c10::Stream::native_handle(): a cudaStream_t for a CUDA stream).
bool runtime_capturing(const c10::Stream& s) {
  using IsCapturing = int (*)(void*, int*);
  static auto is_capturing = reinterpret_cast<IsCapturing>(cudart_symbol("cudaStreamIsCapturing"));
  if (!is_capturing || s.device_type() != c10::DeviceType::CUDA) return false;
  int status = 0;  // cudaStreamCaptureStatusNone
  try {
    return is_capturing(s.native_handle(), &status) == 0 && status != 0;
  } catch (const std::exception&) {
    return false;  // a stream without a native handle captures nothing
  }
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

std::optional<c10::Device> device_of(c10::ArrayRef<at::Tensor> ins, std::optional<c10::Device> bound) {
  for (const auto& t : ins) {
    if (t.defined() && !t.is_cpu()) return t.device();
  }
  if (bound && !bound->is_cpu()) return bound;
  return std::nullopt;
}

c10::intrusive_ptr<c10d::Work> stream_marker(c10d::Backend& inner, c10::ArrayRef<at::Tensor> ins) {
  // A barrier, or an op with no input: the device CUDA uses on this thread.
  auto device = device_of(ins, inner.getBoundDeviceId());
  if (!device) device = current_cuda_device();
  TORCH_CHECK(device, "fastdist: ", inner.getBackendName(),
              " handed back no work for an op and no CUDA device is there to record an event on");
  return c10::make_intrusive<EventMarker>(inner.getRank(), *device, ins.vec());
}

bool capturing(c10::ArrayRef<at::Tensor> ins, std::optional<c10::Device> bound) {
  // An op with no CUDA tensor (a barrier, endCoalescing) is captured when the stream it would be
  // issued on is: the bound device's, else the current device's (where a GPU is there at all).
  auto device = device_of(ins, bound);
  if (!device) device = current_cuda_device();
  if (!device || device->type() != c10::DeviceType::CUDA) return false;
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return stream_capturing(*impl, impl->getStream(*device), 0);
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
