// CUDA graphs (cuda/graph.h): stream capture into the caching allocator's private pool of the graph,
// replay hooks, random draws whose seed and base offset each replay writes to the device.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <set>
#include <string_view>
#include <vector>

#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>

namespace kiln::cuda {

namespace {

thread_local Graph* t_capturing = nullptr;
std::atomic<int> next_pool{1};  // the allocator's pool ids; 0 is the general cache

struct Words {
  uint64_t v[8];
};

__global__ void write_words_kernel(uint64_t* dst, Words w, int n) {
  if (int(threadIdx.x) < n) dst[threadIdx.x] = w.v[threadIdx.x];
}

// A memset node's fill done by a kernel: `height` rows `pitch` bytes apart, each of `width` elements of
// `elem` bytes (1, 2 or 4) set to the low bytes of `value`.
__global__ void fill_rows_kernel(char* dst, size_t pitch, unsigned value, unsigned elem, size_t width, size_t height) {
  const size_t n = width * height;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    char* p = height == 1 ? dst + i * elem : dst + (i / width) * pitch + (i % width) * elem;
    if (elem == 4) *reinterpret_cast<unsigned*>(p) = value;
    else if (elem == 2) *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(value);
    else *p = static_cast<char>(value);
  }
}

// Memsets up to this size become kernel nodes (larger ones are bandwidth, where the memset node does well).
constexpr size_t kKernelMemsetBytes = size_t(64) << 10;

// Replaces each small memset node of a captured graph by a kernel node doing the same fill, with the same
// dependencies. cuBLASLt clears a few bytes of its workspace (cudaMemsetAsync) before most of its Hopper
// kernels; captured, each clear is a memset node, and the graph leaves the GPU idle around it: 2-5 us a
// node in GPT-2's step on one H200 (0.32 ms a step), 5-10 us under DDP (0.53 ms), where a kernel node
// follows the one before it as any kernel does (docs/performance.md, session 25).
// Returns how many it replaced. A graph with memory allocation nodes is left as it is (a node of such a
// graph cannot be destroyed).
size_t memset_nodes_to_kernels(cudaGraph_t graph) {
  size_t n = 0, replaced = 0;
  KILN_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  std::vector<cudaGraphNodeType> types(n);
  KILN_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  for (size_t i = 0; i < n; ++i) {
    KILN_CUDA_CHECK(cudaGraphNodeGetType(nodes[i], &types[i]));
    if (types[i] == cudaGraphNodeTypeMemAlloc || types[i] == cudaGraphNodeTypeMemFree) return 0;
  }
  for (size_t i = 0; i < n; ++i) {
    cudaGraphNode_t node = nodes[i];
    if (types[i] != cudaGraphNodeTypeMemset) continue;
    cudaMemsetParams m{};
    KILN_CUDA_CHECK(cudaGraphMemsetNodeGetParams(node, &m));
    const size_t count = m.width * m.height;
    if (count * m.elementSize > kKernelMemsetBytes || count == 0) continue;
    // its edges, with their data (a query without it fails on edges that carry any)
    size_t nin = 0, nout = 0;
    KILN_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &nin));
    KILN_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &nout));
    std::vector<cudaGraphNode_t> in(nin), out(nout), fills;
    std::vector<cudaGraphEdgeData> in_edges(nin), out_edges(nout);
    KILN_CUDA_CHECK(cudaGraphNodeGetDependencies(node, in.data(), in_edges.data(), &nin));
    KILN_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, out.data(), out_edges.data(), &nout));
    char* dst = static_cast<char*>(m.dst);
    void* args[] = {&dst, &m.pitch, &m.value, &m.elementSize, &m.width, &m.height};
    cudaKernelNodeParams k{};
    k.func = reinterpret_cast<void*>(fill_rows_kernel);
    k.blockDim = dim3(256);
    k.gridDim = dim3(unsigned(std::min<size_t>((count + 255) / 256, 64)));
    k.kernelParams = args;
    cudaGraphNode_t fill;
    KILN_CUDA_CHECK(cudaGraphAddKernelNode(&fill, graph, nullptr, 0, &k));
    fills.assign(std::max(nin, nout), fill);
    if (nin) KILN_CUDA_CHECK(cudaGraphAddDependencies(graph, in.data(), fills.data(), in_edges.data(), nin));
    if (nout) KILN_CUDA_CHECK(cudaGraphAddDependencies(graph, fills.data(), out.data(), out_edges.data(), nout));
    KILN_CUDA_CHECK(cudaGraphDestroyNode(node));
    ++replaced;
  }
  return replaced;
}

}  // namespace

// One generator the capture drew from: where its replay base lives and how many blocks the graph draws.
struct GeneratorDraws {
  Generator* gen;
  uint64_t* base;  // 2 replay words: {seed, first block} of this replay's draws
  uint64_t blocks = 0;
};

constexpr int kSlabWords = 512;  // replay words come from 4 KiB slabs of their own

struct Graph::Impl {
  int device = -1;
  int pool = 0;
  uint64_t id = 0;                // Graph::id: the first pool id it captured into
  cudaStream_t stream = nullptr;  // the capturing stream
  bool capturing = false;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  size_t nodes = 0;
  size_t fills_as_kernels = 0;  // memset nodes replaced by kernel nodes (memset_nodes_to_kernels)
  std::vector<std::function<void()>> hooks, after_hooks;
  // replay_bumps_version_of, once each (by owner: a storage freed during the capture leaves its entry
  // expired, and one made later at the same address gets its own)
  std::set<std::weak_ptr<Storage>, std::owner_less<std::weak_ptr<Storage>>> bumped;
  std::vector<GeneratorDraws> draws;
  std::vector<uint64_t*> slabs;  // replay words (cudaMalloc'ed, outside the caching allocator)
  int slab_used = kSlabWords;
  cudaStream_t last_replay = nullptr;
  cudaEvent_t replayed = nullptr;  // recorded after each launch: a replay on another stream waits for it

  // Everything the capture made, dropped; the pool back to the general cache.
  void release() noexcept {
    hooks.clear();
    after_hooks.clear();
    bumped.clear();
    draws.clear();
    for (uint64_t* s : slabs) cudaFree(s);
    slabs.clear();
    slab_used = kSlabWords;
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (replayed) cudaEventDestroy(replayed);
    exec = nullptr;
    graph = nullptr;
    replayed = nullptr;
    if (pool) {
      try {
        allocator(device).release_pool(pool);
      } catch (...) {
      }
      pool = 0;
    }
  }
};

Graph::Graph() : impl_(std::make_unique<Impl>()) {}

Graph::~Graph() {
  if (!impl_) return;
  if (impl_->capturing) capture_abort();
  if (impl_->last_replay) {
    DeviceGuard guard(impl_->device);
    cudaStreamSynchronize(impl_->last_replay);  // its replays still use the pool's memory
    cudaGetLastError();
  }
  impl_->release();
}

// A graph moved while it captures stays the thread's capturing graph under its new address.
Graph::Graph(Graph&& o) noexcept : impl_(std::move(o.impl_)) {
  if (t_capturing == &o) t_capturing = this;
}
Graph& Graph::operator=(Graph&& o) noexcept {
  if (this != &o) {
    Graph dying(std::move(*this));  // this graph's replays finish and its pool is released
    impl_ = std::move(o.impl_);
    if (t_capturing == &o) t_capturing = this;
  }
  return *this;
}

void Graph::capture_begin() {
  KILN_CHECK(impl_, "cuda::Graph: use of a moved-from graph");
  KILN_CHECK(!t_capturing, "cuda::Graph::capture_begin: this thread is already capturing a graph (captures do not nest)");
  KILN_CHECK(!impl_->exec && !impl_->capturing, "cuda::Graph::capture_begin: this graph was captured already; make a new one");
  Impl& g = *impl_;
  g.device = current_device();
  g.stream = current_stream();
  g.pool = next_pool.fetch_add(1);
  g.id = uint64_t(g.pool);
  allocator(g.device).begin_capture_pool(g.pool, uintptr_t(g.stream));
  // Thread-local mode: what this thread does that a capture cannot hold fails loudly. The capture takes
  // whatever is queued on this stream, so other threads must not queue work on it meanwhile (a GPU monitor
  // or a host-side data loader does not; a thread on a stream of its own that allocates is refused).
  cudaError_t e = cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    allocator(g.device).end_capture_pool();
    allocator(g.device).release_pool(g.pool);
    g.pool = 0;
    KILN_CUDA_CHECK(e);
  }
  g.capturing = true;
  t_capturing = this;
}

void Graph::capture_end() {
  KILN_CHECK(impl_ && impl_->capturing && t_capturing == this,
             "cuda::Graph::capture_end: this graph is not being captured on this thread");
  Impl& g = *impl_;
  DeviceGuard guard(g.device);
  cudaGraph_t graph = nullptr;
  const cudaError_t e = cudaStreamEndCapture(g.stream, &graph);
  t_capturing = nullptr;
  g.capturing = false;
  allocator(g.device).end_capture_pool();
  if (e != cudaSuccess || !graph) {
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    g.release();
    KILN_FAIL("cuda::Graph::capture_end: the capture failed (CUDA error '", cudaGetErrorString(e),
              "'): an operation inside it was not capturable (a synchronization, a copy to or from pageable host "
              "memory, work on another stream that did not join the capture)");
  }
  g.graph = graph;
  // KILN_GRAPH_KEEP_MEMSETS=1 keeps them (for an A/B, or should a driver ever run them better)
  const char* keep = std::getenv("KILN_GRAPH_KEEP_MEMSETS");
  if (!keep || std::string_view(keep) != "1") g.fills_as_kernels = memset_nodes_to_kernels(graph);
  KILN_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &g.nodes));
  KILN_CUDA_CHECK(cudaGraphInstantiate(&g.exec, graph, 0));
}

void Graph::capture_abort() {
  if (!impl_ || !impl_->capturing) return;
  Impl& g = *impl_;
  DeviceGuard guard(g.device);
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(g.stream, &graph);  // an invalidated capture still ends here
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
  if (t_capturing == this) t_capturing = nullptr;
  g.capturing = false;
  allocator(g.device).end_capture_pool();
  g.release();
}

void Graph::replay() {
  KILN_CHECK(impl_ && impl_->exec, "cuda::Graph::replay: nothing captured (capture_begin ... capture_end first)");
  KILN_CHECK(!t_capturing, "cuda::Graph::replay: called while this thread captures a graph");
  Impl& g = *impl_;
  DeviceGuard guard(g.device);
  const cudaStream_t stream = current_stream();
  // the hooks write this replay's words on this stream: a replay still running on another stream must be
  // done with the previous ones first
  if (g.last_replay && g.last_replay != stream) KILN_CUDA_CHECK(cudaStreamWaitEvent(stream, g.replayed, 0));
  for (auto& hook : g.hooks) hook();
  for (GeneratorDraws& d : g.draws) {
    const GeneratorState s = d.gen->reserve_blocks(d.blocks);  // advances the generator as the step would
    const uint64_t words[2] = {s.seed, s.offset};
    write_words(d.base, words, 2);
  }
  KILN_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
  if (!g.replayed) KILN_CUDA_CHECK(cudaEventCreateWithFlags(&g.replayed, cudaEventDisableTiming));
  KILN_CUDA_CHECK(cudaEventRecord(g.replayed, stream));
  g.last_replay = stream;
  for (const std::weak_ptr<Storage>& w : g.bumped)
    if (const std::shared_ptr<Storage> s = w.lock()) ++s->version;
  for (auto& hook : g.after_hooks) hook();
}

bool Graph::captured() const { return impl_ && impl_->exec; }
size_t Graph::num_nodes() const { return impl_ ? impl_->nodes : 0; }
size_t Graph::num_fills_as_kernels() const { return impl_ ? impl_->fills_as_kernels : 0; }
int Graph::device() const { return impl_ ? impl_->device : -1; }

uint64_t Graph::id() const { return impl_ ? impl_->id : 0; }

void Graph::replay_bumps_version_of(const std::shared_ptr<Storage>& storage) {
  KILN_CHECK(impl_ && impl_->capturing, "cuda::Graph::replay_bumps_version_of: only during capture");
  impl_->bumped.insert(storage);
}

void Graph::after_replay(std::function<void()> hook) {
  KILN_CHECK(impl_ && impl_->capturing, "cuda::Graph::after_replay: only during capture");
  impl_->after_hooks.push_back(std::move(hook));
}

void Graph::on_replay(std::function<void()> hook) {
  KILN_CHECK(impl_ && impl_->capturing, "cuda::Graph::on_replay: only during capture");
  impl_->hooks.push_back(std::move(hook));
}

uint64_t* Graph::replay_words(int n) {
  KILN_CHECK(impl_ && impl_->capturing, "cuda::Graph::replay_words: only during capture");
  KILN_CHECK(n >= 1 && n <= kSlabWords, "cuda::Graph::replay_words: 1 to ", kSlabWords, " words, got ", n);
  Impl& g = *impl_;
  if (g.slab_used + n > kSlabWords) {
    DeviceGuard guard(g.device);
    void* p = nullptr;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;  // cudaMalloc is not captured: allowed here
    cudaThreadExchangeStreamCaptureMode(&mode);
    const cudaError_t e = cudaMalloc(&p, kSlabWords * sizeof(uint64_t));
    cudaThreadExchangeStreamCaptureMode(&mode);
    KILN_CUDA_CHECK(e);
    g.slabs.push_back(static_cast<uint64_t*>(p));
    g.slab_used = 0;
  }
  uint64_t* words = g.slabs.back() + g.slab_used;
  g.slab_used += n;
  return words;
}

PhiloxDraw Graph::draw(Generator& gen, uint64_t blocks) {
  KILN_CHECK(impl_ && impl_->capturing, "cuda::Graph::draw: only during capture");
  GeneratorDraws* d = nullptr;
  for (auto& x : impl_->draws)
    if (x.gen == &gen) d = &x;
  if (!d) {
    impl_->draws.push_back({&gen, replay_words(2), 0});
    d = &impl_->draws.back();
  }
  const uint64_t offset = d->blocks;
  d->blocks += blocks;
  return {gen.seed(), offset, d->base};
}

uint64_t Graph::draw_position(const Generator& gen) const {
  if (impl_)
    for (const auto& x : impl_->draws)
      if (x.gen == &gen) return x.blocks;
  return 0;
}

void Graph::set_draw_position(Generator& gen, uint64_t position) {
  KILN_CHECK(impl_ && impl_->capturing, "cuda::Graph::set_draw_position: only during capture");
  draw(gen, 0);  // the generator's entry, made if it has none
  for (auto& x : impl_->draws)
    if (x.gen == &gen) x.blocks = position;
}

Graph* capturing_graph() { return t_capturing; }

void check_not_capturing(const char* what) {
  if (t_capturing)
    KILN_FAIL(what, " cannot run while a CUDA graph is being captured: it waits for the device or moves data "
              "through host memory, which a replay cannot repeat. Move it out of the captured code (after "
              "replay() the graph's outputs hold their values)");
}

Graph capture(const std::function<void()>& step, int warmup) {
  KILN_CHECK(warmup >= 0, "cuda::capture: warmup must be >= 0, got ", warmup);
  for (int i = 0; i < warmup; ++i) step();
  synchronize();  // the warm-up's frees settle before the capture (no event may be polled during it)
  Graph graph;
  graph.capture_begin();
  try {
    step();
  } catch (...) {
    graph.capture_abort();
    throw;
  }
  graph.capture_end();
  return graph;
}

void write_words(uint64_t* dst, const uint64_t* words, int n) {
  KILN_CHECK(n >= 0 && n <= 8, "cuda::write_words: at most 8 words, got ", n);
  KILN_CHECK(dst || n == 0, "cuda::write_words: null destination");
  if (n == 0) return;
  Words w{};
  for (int i = 0; i < n; ++i) w.v[i] = words[i];
  write_words_kernel<<<1, 32, 0, current_stream()>>>(dst, w, n);
  KILN_LAUNCH_CHECK("write_words_kernel", "cuda::write_words");
}

}  // namespace kiln::cuda
