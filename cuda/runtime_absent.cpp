// Device discovery for builds without the CUDA backend (KILN_CUDA=OFF): there are no CUDA devices.
#ifndef KILN_WITH_CUDA
#include <kiln/core/error.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/stream.h>

namespace kiln::cuda {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  KILN_FAIL("cuda::", what, ": this build of Kiln has no CUDA backend (configure with -DKILN_CUDA=ON)");
}
}  // namespace

int device_count() { return 0; }
bool is_available() { return false; }
int current_device() { no_cuda("current_device"); }
void set_device(int) { no_cuda("set_device"); }
void synchronize() { no_cuda("synchronize"); }
void* current_stream_handle() { no_cuda("current_stream_handle"); }
DeviceProperties properties(int) { no_cuda("properties"); }
bool has_tensor_core_support(int) { return false; }
LibraryVersions library_versions() { return {}; }
MemoryStats memory_stats(int) { no_cuda("memory_stats"); }
void reset_peak_memory_stats(int) { no_cuda("reset_peak_memory_stats"); }
std::string memory_summary(int) { no_cuda("memory_summary"); }
void empty_cache(int) { no_cuda("empty_cache"); }
Tensor empty_pinned(const Shape&, DType) { no_cuda("empty_pinned"); }
Tensor pin_memory(const Tensor&) { no_cuda("pin_memory"); }
void set_sync_check(bool) {}
bool sync_check() { return false; }
void set_allow_tf32(bool) {}
bool allow_tf32() { return false; }
void set_sm_carveout(int) {}
int sm_carveout() { return 0; }
void set_cudnn_benchmark(bool) {}
bool cudnn_benchmark() { return false; }
void set_matmul_benchmark(bool) {}
bool matmul_benchmark() { return false; }
size_t matmul_plans_benchmarked() { return 0; }
size_t conv_algorithm_cache_size() { return 0; }


Stream make_stream(int device, void* handle) { return Stream(device, handle); }
Stream Stream::current(int) { no_cuda("Stream::current"); }
Stream Stream::default_stream(int) { no_cuda("Stream::default_stream"); }
Stream Stream::create(int, int) { no_cuda("Stream::create"); }
void Stream::synchronize() const { no_cuda("Stream::synchronize"); }
bool Stream::query() const { no_cuda("Stream::query"); }
void Stream::wait(const Event&) const { no_cuda("Stream::wait"); }
void Stream::wait(const Stream&) const { no_cuda("Stream::wait"); }
void set_current_stream(const Stream&) { no_cuda("set_current_stream"); }
StreamGuard::StreamGuard(const Stream&) { no_cuda("StreamGuard"); }
StreamGuard::~StreamGuard() = default;
Event::~Event() = default;
Event::Event(Event&& o) noexcept : timing_(o.timing_), device_(o.device_), handle_(o.handle_) {}
Event& Event::operator=(Event&& o) noexcept {
  timing_ = o.timing_;
  return *this;
}
void Event::record(const Stream&) { no_cuda("Event::record"); }
void Event::synchronize() const { no_cuda("Event::synchronize"); }
bool Event::query() const { no_cuda("Event::query"); }
double Event::elapsed_ms(const Event&) const { no_cuda("Event::elapsed_ms"); }
void record_stream(const Tensor&, const Stream&) { no_cuda("record_stream"); }

struct Graph::Impl {};
Graph::Graph() : impl_(std::make_unique<Impl>()) {}
Graph::~Graph() = default;
Graph::Graph(Graph&&) noexcept = default;
Graph& Graph::operator=(Graph&&) noexcept = default;
void Graph::capture_begin() { no_cuda("Graph::capture_begin"); }
void Graph::capture_end() { no_cuda("Graph::capture_end"); }
void Graph::capture_abort() {}
void Graph::replay() { no_cuda("Graph::replay"); }
bool Graph::captured() const { return false; }
size_t Graph::num_nodes() const { return 0; }
size_t Graph::num_fills_as_kernels() const { return 0; }
int Graph::device() const { return -1; }
uint64_t Graph::id() const { return 0; }
void Graph::replay_bumps_version_of(const std::shared_ptr<Storage>&) { no_cuda("Graph::replay_bumps_version_of"); }
void Graph::on_replay(std::function<void()>) { no_cuda("Graph::on_replay"); }
void Graph::after_replay(std::function<void()>) { no_cuda("Graph::after_replay"); }
PhiloxDraw Graph::draw(Generator&, uint64_t) { no_cuda("Graph::draw"); }
uint64_t Graph::draw_position(const Generator&) const { return 0; }
void Graph::set_draw_position(Generator&, uint64_t) { no_cuda("Graph::set_draw_position"); }
Graph* capturing_graph() { return nullptr; }
void check_not_capturing(const char*) {}
Graph capture(const std::function<void()>&, int) { no_cuda("capture"); }
void write_words(uint64_t*, const uint64_t*, int) { no_cuda("write_words"); }
uint64_t* Graph::replay_words(int) { no_cuda("Graph::replay_words"); }

}  // namespace kiln::cuda
#endif
