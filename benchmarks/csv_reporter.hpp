// CSV output that every run of c2f's benchmark binaries can write.
//
// Google Benchmark 1.7's CSV reporter takes its header from the first entry's counters and aborts the
// process when a later entry carries one the header lacks ("All counters must be present in each run").
// c2f's binaries mix entries with different counters (a copy has no FLOP, a GEMM no bytes), so
// `--benchmark_format=csv` used to end in that abort. CsvReporter keeps the runs and writes them when the
// run ends, the union of the counters as columns (sorted by name, as Google Benchmark sorts them) and an
// empty cell where an entry has none; the other columns are Google Benchmark's.
#pragma once

#include <benchmark/benchmark.h>

#include <cstring>
#include <ostream>
#include <set>
#include <string>
#include <vector>

namespace c2f_bench {

class CsvReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context& context) override {
    PrintBasicContext(&GetErrorStream(), context);
    return true;
  }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      for (const auto& counter : run.counters) {
        if (counter.first != "bytes_per_second" && counter.first != "items_per_second") names_.insert(counter.first);
      }
      runs_.push_back(run);
    }
  }
  void Finalize() override {
    std::ostream& out = GetOutputStream();
    out << "name,iterations,real_time,cpu_time,time_unit,bytes_per_second,items_per_second,label,error_occurred,"
           "error_message";
    for (const std::string& name : names_) out << ",\"" << quoted(name) << '"';
    out << '\n';
    for (const Run& run : runs_) {
      out << '"' << quoted(run.benchmark_name()) << "\",";
      if (run.error_occurred) {
        out << std::string(7, ',') << "true,\"" << quoted(run.error_message) << '"';
        out << std::string(names_.size(), ',') << '\n';
        continue;
      }
      out << run.iterations << ',' << run.GetAdjustedRealTime() << ',' << run.GetAdjustedCPUTime() << ','
          << benchmark::GetTimeUnitString(run.time_unit) << ',';
      for (const char* rate : {"bytes_per_second", "items_per_second"}) {
        const auto it = run.counters.find(rate);
        if (it != run.counters.end()) out << it->second.value;
        out << ',';
      }
      if (!run.report_label.empty()) out << '"' << quoted(run.report_label) << '"';
      out << ",,";
      for (const std::string& name : names_) {
        out << ',';
        const auto it = run.counters.find(name);
        if (it != run.counters.end()) out << it->second.value;
      }
      out << '\n';
    }
    out.flush();
  }

 private:
  // A CSV field's text: every double quote doubled (RFC 4180).
  static std::string quoted(const std::string& text) {
    std::string escaped;
    for (const char c : text) {
      escaped += c;
      if (c == '"') escaped += '"';
    }
    return escaped;
  }

  std::set<std::string> names_;
  std::vector<Run> runs_;
};

/// Runs the registered benchmarks as benchmark::RunSpecifiedBenchmarks does, with CsvReporter where the
/// command line asks for CSV: `--benchmark_format=csv` (the screen) and `--benchmark_out_format=csv` (the
/// `--benchmark_out` file). Construct it on the arguments before benchmark::Initialize: it takes those two
/// flags out of them.
class Runner {
 public:
  Runner(int* argc, char** argv) {
    int kept = 0;
    bool out_file = false;
    for (int i = 0; i < *argc; ++i) {
      if (std::strcmp(argv[i], "--benchmark_format=csv") == 0) {
        screen_csv_ = true;
        continue;
      }
      if (std::strcmp(argv[i], "--benchmark_out_format=csv") == 0) {
        file_csv_ = true;
        continue;
      }
      out_file = out_file || std::strncmp(argv[i], "--benchmark_out=", 16) == 0;
      argv[kept++] = argv[i];
    }
    // Without --benchmark_out there is no file, and Google Benchmark refuses a file reporter.
    file_csv_ = file_csv_ && out_file;
    *argc = kept;
  }
  std::size_t run() {
    return benchmark::RunSpecifiedBenchmarks(screen_csv_ ? &screen_ : nullptr, file_csv_ ? &file_ : nullptr);
  }

 private:
  bool screen_csv_ = false, file_csv_ = false;
  CsvReporter screen_, file_;
};

}  // namespace c2f_bench
