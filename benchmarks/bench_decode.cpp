// Token-by-token decoding: the latency of one decode step (n = 1 new token per sequence) at a
// growing context, for the three layers that decode, next to the machine's memory rooflines of the run.
//
//   bench_decode [--decode_sweep=full|quick] [Google Benchmark flags]
//
// full (default): contexts 1k, 2k, …, 128k tokens (powers of two) at batch 1 and 8; quick: to 16k.
// Every entry: d = 512, 8 heads, float caches unless the name says otherwise, C2F_BENCH_THREADS threads
// (default 2), causal layers.
//
// Entries (name/batch/context):
//   copy             STREAM copy over 2 × 256 MiB (bytes = 2 × size) — the roofline of the decode targets
//   read             the sum of one 512 MiB buffer (bytes = size) — the roofline of a read-only scan
//   mha              MultiHeadAttention::decode, the cache holds the projected K and V
//   mha_bf16         the same with an Eigen::bfloat16 cache (batch 1)
//   mha_bf16_compute the same with a bfloat16 cache and Compute::BFloat16 (docs/bf16.md; batch 1)
//   sparse           SparseC2FAttention::decode, chunk 64, top_k 8 (per-token gating)
//   hmha             HMHA::decode, window 64 (all three levels)
//
// Each (layer, batch) keeps one decoding state across its entries, which run in order of context: an
// entry first prefills the state up to its context (untimed; prefill() computes one output per call),
// reserving room for the steps it will time, then times decode() of one token per sequence. Every timed
// step appends a token, so an entry's context grows by its iterations × repetitions (≤ 3 %; counter
// `context` is the context of the first timed step).
//
// Counters:
//   context       tokens in the state before the first timed step
//   state_bytes   state.memory_bytes() (keys, values and summaries at capacity = context + the timed steps)
//   kv_bytes      mha: the cached key and value bytes one step reads, B · context · 2 · d · sizeof(cache)
//   GB/s          mha: kv_bytes per second of a step — its achieved bandwidth
//   tokens/s      new tokens per second over the batch (B per step)
//   new_threads   threads the process gained during the timed steps (the pool is made once: 0)
#include "benchmarks/csv_reporter.hpp"
#include "benchmarks/rooflines.hpp"
#include "c2f/layers/hmha.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/layers/sparse_c2f_attention.hpp"

#include <dirent.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

using c2f_bench::bench_threads;
using Eigen::Index;

constexpr Index kEmbed = 512;
constexpr Index kHeads = 8;
constexpr Index kChunk = 64;
constexpr Index kTopK = 8;
constexpr Index kWindow = 64;
constexpr Index kPrefillPiece = 2048;  // tokens per prefill call while growing a state
constexpr int kRepetitions = 3;

enum class Kind { Mha, MhaBf16, MhaBf16Compute, Sparse, Hmha };

const char* name_of(Kind kind) {
  switch (kind) {
    case Kind::Mha:
      return "mha";
    case Kind::MhaBf16:
      return "mha_bf16";
    case Kind::MhaBf16Compute:
      return "mha_bf16_compute";
    case Kind::Sparse:
      return "sparse";
    case Kind::Hmha:
      return "hmha";
  }
  return "?";
}

int thread_count() {
  int n = 0;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (dirent* entry = readdir(dir)) n += entry->d_name[0] != '.';
    closedir(dir);
  }
  return n;
}

// One layer and its decoding state, grown entry by entry.
struct Decoding {
  virtual ~Decoding() = default;
  virtual Index length() const = 0;
  virtual std::size_t memory_bytes() const = 0;
  virtual void reserve(Index tokens) = 0;
  virtual void prefill(const c2f::Tensor3<float>& x) = 0;
  virtual float step(const c2f::Tensor3<float>& x) = 0;  // returns one output value (kept alive)
  int finished_repetitions = 0;                          // of the group's last entry
};

template <class Layer, class Cache>
struct DecodingOf : Decoding {
  DecodingOf(Layer l, Index batch) : layer(std::move(l)), state(layer.template new_decode_state<Cache>(batch)) {}
  Index length() const override { return state.length(); }
  std::size_t memory_bytes() const override { return state.memory_bytes(); }
  void reserve(Index tokens) override { state.reserve(tokens); }
  void prefill(const c2f::Tensor3<float>& x) override { layer.prefill(x, state); }
  float step(const c2f::Tensor3<float>& x) override { return layer.decode(x, state).data()[0]; }
  Layer layer;
  typename Layer::template DecodeStateOf<Cache> state;
};

std::unique_ptr<Decoding> make(Kind kind, Index batch) {
  const int t = bench_threads();
  switch (kind) {
    case Kind::Mha:
    case Kind::MhaBf16:
    case Kind::MhaBf16Compute: {
      const c2f::Compute compute = kind == Kind::MhaBf16Compute ? c2f::Compute::BFloat16 : c2f::Compute::Float32;
      c2f::MultiHeadAttention<float> mha(
          kEmbed, kHeads, c2f::MultiHeadAttention<float>::Options().causal(true).num_threads(t).compute(compute));
      if (kind == Kind::Mha)
        return std::make_unique<DecodingOf<c2f::MultiHeadAttention<float>, float>>(std::move(mha), batch);
      return std::make_unique<DecodingOf<c2f::MultiHeadAttention<float>, Eigen::bfloat16>>(std::move(mha), batch);
    }
    case Kind::Sparse:
      return std::make_unique<DecodingOf<c2f::SparseC2FAttention<float>, float>>(
          c2f::SparseC2FAttention<float>(kEmbed, kHeads, kChunk, kTopK,
                                         c2f::SparseC2FAttention<float>::Options().causal(true).num_threads(t)),
          batch);
    case Kind::Hmha:
      return std::make_unique<DecodingOf<c2f::HMHA<float>, float>>(
          c2f::HMHA<float>(kEmbed, kHeads, kWindow, c2f::HMHA<float>::Options().causal(true).num_threads(t)), batch);
  }
  return nullptr;
}

// The states of the sweep, one per (layer, batch); an entry that is the last of its group frees it.
std::map<std::pair<int, Index>, std::unique_ptr<Decoding>>& states() {
  static std::map<std::pair<int, Index>, std::unique_ptr<Decoding>> s;
  return s;
}

c2f::Tensor3<float> tokens(Index batch, Index n, std::uint64_t seed) {
  c2f::Tensor3<float> x(batch, n, kEmbed);
  c2f_bench::fill(x.data(), x.size(), seed);
  return x;
}

// Timed steps of one entry: about 0.3 s of a repetition at an estimated 8 GB/s for the cache scan
// (mha) or 0.5 ms per step (the others), at least 4 and at most 200.
Index steps_for(Kind kind, Index batch, Index context) {
  const double cache = kind != Kind::Mha ? 2.0 : 4.0;
  const double seconds = (kind == Kind::Mha || kind == Kind::MhaBf16 || kind == Kind::MhaBf16Compute)
                             ? 2e-4 + double(batch) * double(context) * 2.0 * kEmbed * cache / 8e9
                             : 5e-4 * double(batch);
  return std::clamp<Index>(Index(0.3 / seconds), 4, 200);
}

void BM_Decode(benchmark::State& state, Kind kind, bool last) {
  const Index batch = state.range(0), context = state.range(1);
  std::unique_ptr<Decoding>& slot = states()[{int(kind), batch}];
  if (!slot) slot = make(kind, batch);
  Decoding& d = *slot;
  // Grow to the context (first repetition) with room for the timed steps of every repetition.
  d.reserve(context + kRepetitions * steps_for(kind, batch, context));
  while (d.length() < context) {
    const Index n = std::min(kPrefillPiece, context - d.length());
    d.prefill(tokens(batch, n, std::uint64_t(d.length())));
  }
  const c2f::Tensor3<float> x = tokens(batch, 1, 7);
  const Index first = d.length();
  const int threads_before = thread_count();
  float sink = 0.0f;
  for (auto _ : state) {
    sink += d.step(x);
    benchmark::DoNotOptimize(sink);
  }
  const Index steps = d.length() - first;
  state.counters["context"] = double(first);
  state.counters["state_bytes"] = double(d.memory_bytes());
  state.counters["tokens/s"] = benchmark::Counter(double(batch), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["new_threads"] = double(thread_count() - threads_before);
  state.counters["threads"] = bench_threads();
  state.counters["steps"] = double(steps);
  if (kind == Kind::Mha || kind == Kind::MhaBf16 || kind == Kind::MhaBf16Compute) {
    const double cache = kind != Kind::Mha ? 2.0 : 4.0;
    const double bytes = double(batch) * (double(first) + 0.5 * double(steps)) * 2.0 * kEmbed * cache;
    state.counters["kv_bytes"] = bytes;
    state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  }
  if (last && ++d.finished_repetitions == kRepetitions) slot.reset();
}

void register_sweep(bool quick) {
  const Index max_context = quick ? (Index(1) << 14) : (Index(1) << 17);
  benchmark::RegisterBenchmark("copy", c2f_bench::BM_Copy)
      ->Arg(Index(256) << 20)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->MinTime(0.2)
      ->Repetitions(5)
      ->ReportAggregatesOnly(true);
  benchmark::RegisterBenchmark("read", c2f_bench::BM_Read)
      ->Arg(Index(512) << 20)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->MinTime(0.2)
      ->Repetitions(5)
      ->ReportAggregatesOnly(true);
  for (Kind kind : {Kind::Mha, Kind::Sparse, Kind::Hmha, Kind::MhaBf16, Kind::MhaBf16Compute}) {
    for (Index batch : {Index(1), Index(8)}) {
      if ((kind == Kind::MhaBf16 || kind == Kind::MhaBf16Compute) && batch != 1) continue;
      for (Index context = 1024; context <= max_context; context *= 2) {
        const bool last = context * 2 > max_context;
        benchmark::RegisterBenchmark(name_of(kind), BM_Decode, kind, last)
            ->Args({batch, context})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime()
            ->Iterations(steps_for(kind, batch, context))
            ->Repetitions(kRepetitions)
            ->ReportAggregatesOnly(true);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--decode_sweep=quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--decode_sweep=full") != 0) {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  register_sweep(quick);
  c2f_bench::Runner runner(&n, args.data());  // before Initialize: it takes out the CSV flags
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("decode_sweep", quick ? "quick" : "full");
  benchmark::AddCustomContext("c2f_threads", std::to_string(bench_threads()));
  benchmark::AddCustomContext("c2f_isa", Eigen::SimdInstructionSetsInUse());
  runner.run();
  benchmark::Shutdown();
  return 0;
}
