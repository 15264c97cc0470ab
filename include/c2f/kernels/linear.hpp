// c2f kernels — affine maps on row blocks: y = x Wᵀ + b (torch.nn.Linear), fast and naive, and their
// gradients (linear_backward).
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/cpu/packed_gemm.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/kernels/kernel_options.hpp"
#include "c2f/kernels/weight_cache.hpp"

#include <algorithm>
#include <vector>

namespace c2f {
namespace kernels {

/// Rows per task of matmul_rows() and linear(). Fixed (not derived from the thread count) so that each
/// row's arithmetic, and hence every output bit, is the same for any number of threads.
constexpr Index kLinearTaskRows = 128;
/// With fewer than kLinearMinRowTasks row tasks, the columns are split too, into tasks of
/// kLinearTaskCols columns: the products of few rows (a coarse stage over a few hundred chunk summaries, a
/// decoding step) would otherwise be one or two tasks and leave threads idle. The split depends only on
/// the shape, so the bits still do not depend on the thread count.
constexpr Index kLinearMinRowTasks = 4;
constexpr Index kLinearTaskCols = 256;
/// From cpu::kPackedGemmMinRows rows on, matmul_rows packs the right-hand side once and runs
/// cpu::packed_gemm (where the build has it: cpu::kPackedGemm); below, Eigen's product.
/// Rows per task of the packed path: a multiple of the micro-kernel's 6 or 12 rows.
constexpr Index kPackedTaskRows = 120;
/// Below kPackedMinRowTasks row tasks the packed path splits the columns too, into tasks of
/// kPackedTaskCols columns (a multiple of every build's panel width, 4 … 32), so that each task streams a slice
/// of B that stays in L2 — except where the packed B takes at most kPackedWholeColsBytes (half of a
/// 2 MiB L2) and the rows make more row tasks than there are threads (so at least two per thread after
/// evening out): each task then takes whole rows, reading its rows of A once while all of B stays in L2.
/// [1024, 512] × [512, 512] ran 3.6–4.5 % faster whole than in 128-column tasks on 2 threads; a B of
/// 2 MiB no faster, of 3 MiB 2 % slower; with one row task per thread (MHA at L ≤ 128), a thread that
/// woke late left its task to the other, up to 1.6× slower ("Whole columns for short
/// products, and the tile in registers" in git show 9944106:docs/benchmarks.md).
/// Every element is the same sum whatever task computes it (cpu/packed_gemm.hpp), so the split
/// changes no bit.
constexpr Index kPackedMinRowTasks = 16;
constexpr Index kPackedTaskCols = 128;
constexpr std::size_t kPackedWholeColsBytes = std::size_t(1) << 20;
/// Rows per task of the bfloat16 path (KernelOptions::compute), at most: whole 32-row blocks of the tile
/// engine; impl::bf16_split halves it for products of few rows.
constexpr Index kBf16TaskRows = 128;

namespace impl {
/// The tasks of matmul_rows over an [n, out_cols] output: row tasks of `task_rows` rows — with
/// `row_step` > 0 (a divisor of task_rows), of at most task_rows rows, as many as a multiple of the
/// threads the loop runs on takes, evened out in whole steps of row_step rows, so that the threads get
/// equal shares: 2048 rows on 2 threads are 9 tasks of 120 rows and 9 of 108, not 17 of 120 and one of 8,
/// which left one thread idle for most of a task — and, with fewer than `min_row_tasks` row tasks, column
/// tasks of `task_cols` columns, unless `whole_fits` (with row_step: the right-hand side stays in L2
/// whole) and the rows make more tasks of task_rows than there are threads; fn(r0, rows, c0, cols) per task. With
/// row_step, the split depends on the thread count: the caller's products must give every element the
/// same bits whatever task computes it.
template <class Fn>
void row_col_tasks(Index n, Index out_cols, Index task_rows, Index min_row_tasks, Index task_cols,
                   const kernels::KernelOptions& options, double work, Fn&& fn, Index row_step = 0,
                   bool whole_fits = false) {
  Index row_tasks = (n + task_rows - 1) / task_rows;
  // Without row_step the step is a whole task: one step per row task, the fixed split.
  const Index step = row_step > 0 ? row_step : task_rows, steps = (n + step - 1) / step;  // steps ≥ row_tasks
  bool whole = false;
  if (row_step > 0) {
    const Index workers = detail::resolve_threads(options.num_threads(), row_tasks);
    whole = whole_fits && row_tasks > workers;
    row_tasks = std::min(steps, (row_tasks + workers - 1) / workers * workers);
  }
  const Index width = whole || row_tasks >= min_row_tasks ? std::max<Index>(out_cols, 1) : task_cols;
  const Index col_tasks = std::max<Index>(1, (out_cols + width - 1) / width);
  // The first steps % row_tasks row tasks take one step more than the others.
  const Index base = row_tasks > 0 ? steps / row_tasks : 0, extra = row_tasks > 0 ? steps % row_tasks : 0;
  detail::parallel_for(row_tasks * col_tasks, options.num_threads(), work, [&](Index task, int) {
    const Index row_task = task / col_tasks, c0 = (task % col_tasks) * width;
    const Index r0 = step * (row_task * base + std::min(row_task, extra));
    const Index r1 = std::min(n, r0 + step * (base + (row_task < extra ? 1 : 0)));
    fn(r0, r1 - r0, c0, std::min(width, out_cols - c0));
  });
}
/// The tasks of matmul_rows's bfloat16 path over an [n, out] product of depth k on `workers` threads.
/// Column tasks as wide as fit an L2-sized slice of packed B (kBf16SliceBytes: each 32-row block of A
/// streams its slice), split evenly in multiples of 32; row tasks of kBf16TaskRows rows, halved (down
/// to 32) until there are two tasks per worker. Narrow column tasks measured slower: each one rounds its
/// rows of A again and streams a short run of B (the bfloat16 C2FAttention section of
/// git show 9944106:docs/benchmarks.md). Every element is one sum over the
/// whole depth whatever task computes it, so the split, which depends on `workers`, changes no bit.
struct Bf16Split {
  Index task_rows, task_cols, row_tasks, col_tasks;
  /// More than four column tasks: the rows of every row task of x are rounded once, before the tasks that share them.
  bool rows_shared() const { return col_tasks > 4; }
};
inline Bf16Split bf16_split(Index n, Index k, Index out, int workers) {
  constexpr Index kBf16SliceBytes = 768 * 1024, kStep = 32;
  const Index widest = std::max<Index>(4 * kStep, kBf16SliceBytes / (2 * std::max<Index>(k, 1)) / kStep * kStep);
  const Index col_tasks = std::max<Index>(1, (out + widest - 1) / widest);
  const Index task_cols = std::max<Index>(1, (out + col_tasks - 1) / col_tasks + kStep - 1) / kStep * kStep;
  Index task_rows = kernels::kBf16TaskRows;
  while (task_rows > kStep && ((n + task_rows - 1) / task_rows) * col_tasks < 2 * static_cast<Index>(workers))
    task_rows /= 2;
  return {task_rows, task_cols, (n + task_rows - 1) / task_rows, std::max<Index>(1, (out + task_cols - 1) / task_cols)};
}
/// True when matmul_rows in bfloat16 packs its right-hand side for an [n, ·] left side (the products a
/// layer can serve from its WeightCache); false for the few rows (a decode step) that read B in place
/// where it is a weight's transpose (`b_in_place`: a row stride of 1), unless `rows_independent`
/// (KernelOptions) asks for the packed path on every row count. matmul_rows_workspace_bytes counts by it.
inline bool bf16_packs(Index n, bool rows_independent, bool b_in_place) {
  return !(b_in_place && n < cpu::kBf16PackedMinRows && !cpu::honoured_rows_independent(rows_independent));
}

/// matmul_rows's micro-kernel path on a right-hand side packed already: y = x · B (+ bias), the tasks of
/// row_col_tasks (every element the same sum whatever task computes it).
template <class Scalar>
void matmul_rows_packed(const ConstRowMatrixRef<Scalar>& x, const cpu::PackedB<Scalar>& packed, const Scalar* bias,
                        RowMatrixRef<Scalar> y, const kernels::KernelOptions& options) {
  const Index n = x.rows(), out_cols = packed.cols();
  const double work = 2.0 * static_cast<double>(n) * static_cast<double>(x.cols()) * static_cast<double>(out_cols);
  const std::size_t b_bytes = static_cast<std::size_t>(packed.rows() * out_cols) * sizeof(Scalar);
  row_col_tasks(
      n, out_cols, kernels::kPackedTaskRows, kernels::kPackedMinRowTasks, kernels::kPackedTaskCols, options, work,
      [&](Index r0, Index rows, Index c0, Index cols) {
        cpu::packed_gemm<Scalar>(x.data() + r0 * x.outerStride(), x.outerStride(), rows, packed, c0, cols,
                                 bias != nullptr ? bias + c0 : nullptr, y.data() + r0 * y.outerStride() + c0,
                                 y.outerStride());
      },
      cpu::GemmBlocking<Scalar>::kMR, b_bytes <= kernels::kPackedWholeColsBytes);
}

/// matmul_rows's bfloat16 path on a right-hand side packed already: y = x · B (+ bias), every element one
/// sum over the whole depth, the tasks of bf16_split.
inline void matmul_rows_packed_bf16(const ConstRowMatrixRef<float>& x, const cpu::Bf16PackedB& packed,
                                    const float* bias, RowMatrixRef<float> y, const kernels::KernelOptions& options) {
  if (x.cols() != packed.rows() || y.rows() != x.rows() || y.cols() != packed.cols()) {
    detail::fail("matmul_rows: x ", detail::shape_string({x.rows(), x.cols()}), " times the packed ",
                 detail::shape_string({packed.rows(), packed.cols()}), " does not fit y ",
                 detail::shape_string({y.rows(), y.cols()}));
  }
  const Index n = x.rows(), out_cols = packed.cols();
  if (n == 0) return;
  const double work = 2.0 * static_cast<double>(n) * static_cast<double>(x.cols()) * static_cast<double>(out_cols);
  const Bf16Split split = bf16_split(n, x.cols(), out_cols, detail::resolve_threads(options.num_threads(), n));
  const auto tasks = [&](auto&& fn) {
    detail::parallel_for(split.row_tasks * split.col_tasks, options.num_threads(), work, [&](Index task, int) {
      const Index r = task / split.col_tasks, r0 = r * split.task_rows, c0 = (task % split.col_tasks) * split.task_cols;
      const cpu::Bf16Tiles tile_registers(packed.engine());
      fn(r, r0, std::min(split.task_rows, n - r0), c0, std::min(split.task_cols, out_cols - c0));
    });
  };
  if (split.rows_shared()) {
    std::vector<cpu::Bf16A> rounded(static_cast<std::size_t>(split.row_tasks));
    detail::parallel_for(
        split.row_tasks, options.num_threads(),
        detail::kElementWork * static_cast<double>(n) * static_cast<double>(x.cols()), [&](Index r, int) {
          const Index r0 = r * split.task_rows;
          rounded[static_cast<std::size_t>(r)].prepare(x.data() + r0 * x.outerStride(), x.outerStride(),
                                                       std::min(split.task_rows, n - r0), x.cols(), packed.engine());
        });
    tasks([&](Index r, Index r0, Index, Index c0, Index cols) {
      cpu::bf16_gemm(rounded[static_cast<std::size_t>(r)], packed, 0, x.cols(), c0, cols,
                     bias != nullptr ? bias + c0 : nullptr, false, y.data() + r0 * y.outerStride() + c0,
                     y.outerStride());
    });
    return;
  }
  tasks([&](Index, Index r0, Index rows, Index c0, Index cols) {
    cpu::bf16_gemm_range(x.data() + r0 * x.outerStride(), x.outerStride(), rows, packed, 0, x.cols(), c0, cols,
                         bias != nullptr ? bias + c0 : nullptr, false, y.data() + r0 * y.outerStride() + c0,
                         y.outerStride());
  });
}
}  // namespace impl

/// y = x · rhs (+ bias on every row), overwritten, for x [n, k], rhs any [k, out] Eigen matrix expression
/// (e.g. a transposed weight), bias [out] or nullptr, y [n, out]. Tasks of rows (and, for few rows, of
/// columns too) run on options.num_threads() threads (0 = all).
template <class Scalar, class Rhs>
void matmul_rows(const ConstRowMatrixRef<Scalar>& x, const Rhs& rhs, const Scalar* bias, RowMatrixRef<Scalar> y,
                 const KernelOptions& options) {
  if (x.cols() != rhs.rows() || y.rows() != x.rows() || y.cols() != rhs.cols()) {
    detail::fail("matmul_rows: x ", detail::shape_string({x.rows(), x.cols()}), " times ",
                 detail::shape_string({rhs.rows(), rhs.cols()}), " does not fit y ",
                 detail::shape_string({y.rows(), y.cols()}));
  }
  const Index n = x.rows(), out_cols = rhs.cols();
  const double work = 2.0 * static_cast<double>(n) * static_cast<double>(x.cols()) * static_cast<double>(out_cols);
  if (options.compute() == Compute::BFloat16) {
    if constexpr (std::is_same<Scalar, float>::value) {
      // Every element is one sum over the whole depth whatever task computes it: the bits depend on the
      // shape and the engine only.
      if (n == 0) return;
      // Few rows (a decode step): B read in place where it is a weight's transpose, [out, in] row-major.
      if constexpr ((Eigen::internal::traits<Rhs>::Flags & Eigen::DirectAccessBit) != 0) {
        if (!impl::bf16_packs(n, options.rows_independent(), rhs.rowStride() == 1)) {
          // Work: the multiply-adds and the rounding of every weight in registers (a few operations each).
          const double rounding =
              4.0 * detail::kElementWork * static_cast<double>(x.cols()) * static_cast<double>(out_cols);
          impl::row_col_tasks(n, out_cols, kBf16TaskRows, kPackedMinRowTasks, kPackedTaskCols, options, work + rounding,
                              [&](Index r0, Index rows, Index c0, Index cols) {
                                cpu::bf16_gemm_rows(x.data() + r0 * x.outerStride(), x.outerStride(), rows,
                                                    rhs.data() + c0 * rhs.colStride(), rhs.colStride(), x.cols(), cols,
                                                    bias != nullptr ? bias + c0 : nullptr,
                                                    y.data() + r0 * y.outerStride() + c0, y.outerStride());
                              });
          return;
        }
      }
      cpu::Bf16PackedB packed;
      packed.pack(rhs, options.num_threads(), true, work);
      impl::matmul_rows_packed_bf16(x, packed, bias, y, options);
      return;
    } else {
      detail::fail("matmul_rows: compute BFloat16 needs float, got double");
    }
  }
  if (cpu::packed_gemm_for(n, options.rows_independent())) {
    cpu::PackedB<Scalar> packed;
    packed.pack(rhs, options.num_threads(), work);
    impl::matmul_rows_packed(x, packed, bias, y, options);
    return;
  }
  impl::row_col_tasks(n, out_cols, kLinearTaskRows, kLinearMinRowTasks, kLinearTaskCols, options, work,
                      [&](Index r0, Index rows, Index c0, Index cols) {
                        typename RowMatrixRef<Scalar>::BlockXpr out = y.block(r0, c0, rows, cols);
                        if (cols == out_cols) {
                          out.noalias() = x.middleRows(r0, rows) * rhs;
                        } else {
                          out.noalias() = x.middleRows(r0, rows) * rhs.middleCols(c0, cols);
                        }
                        if (bias != nullptr) {
                          out.rowwise() += Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(bias + c0, cols);
                        }
                      });
}

/// Heap bytes matmul_rows() (and linear()) hold while they run for an [n, k] · [k, out] product: the
/// packed right-hand side on the packed path (cpu::kPackedGemm builds with n ≥ kPackedGemmMinRows, or
/// KernelOptions::rows_independent), else nothing (Eigen's product blocks on the stack at these sizes).
/// Compute::BFloat16: the bfloat16 packing of the engine in use (none below kBf16PackedMinRows rows of a
/// weight's transpose without rows_independent), and the rounded rows of A: of one task per worker of
/// `threads` (KernelOptions::num_threads), or all of them when they are shared by more than four
/// column tasks (impl::bf16_split). `cached`: the packing (fp32 or bfloat16) comes from a layer's
/// WeightCache (matmul_rows_cached), which keeps it between calls — not counted.
template <class Scalar>
std::size_t matmul_rows_workspace_bytes(Index n, Index k, Index out, bool rows_independent = false,
                                        Compute compute = Compute::Float32, int threads = 0, bool cached = false) {
  if (compute == Compute::BFloat16) {
    if (n == 0) return 0;
    // The few rows of a decode step read a weight's transpose in place: the case this formula assumes.
    const bool few = !impl::bf16_packs(n, rows_independent, /*b_in_place=*/true);
    const Bf16Engine engine = few ? Bf16Engine::Fallback : bf16_engine();
    const int workers = detail::resolve_threads(threads, n);
    const impl::Bf16Split split = impl::bf16_split(n, k, out, workers);
    if (!few && split.rows_shared()) {  // every row task's rows rounded at once
      const Index full = n / split.task_rows, rest = n - full * split.task_rows;
      return static_cast<std::size_t>(full) * cpu::Bf16A::bytes(split.task_rows, k, engine) +
             (rest > 0 ? cpu::Bf16A::bytes(rest, k, engine) : 0) +
             (cached ? 0 : cpu::Bf16PackedB::bytes(k, out, engine));
    }
    const std::size_t rows = static_cast<std::size_t>(workers) *
                             cpu::Bf16A::bytes(std::min(n, few ? kBf16TaskRows : split.task_rows), k, engine);
    return few || cached ? rows : rows + cpu::Bf16PackedB::bytes(k, out, engine);
  }
  return cpu::packed_gemm_for(n, rows_independent) && !cached ? cpu::PackedB<Scalar>::bytes(k, out) : 0;
}

/// y = x · wᵀ + bias (overwritten) for x [n, in], w [out, in] (PyTorch's Linear.weight layout), bias
/// [out] or nullptr, y [n, out].
template <class Scalar>
void linear(const ConstRowMatrixRef<Scalar>& x, const ConstRowMatrixRef<Scalar>& w, const Scalar* bias,
            RowMatrixRef<Scalar> y, const KernelOptions& options) {
  detail::check_linear_shapes("linear", x, w, y);
  matmul_rows<Scalar>(x, w.transpose(), bias, y, options);
}

/// linear_backward() computes the weight's gradient in tiles of kGradTile × kGradTile weights, one task
/// each (fixed by the shape, so the bits do not depend on the thread count).
constexpr Index kGradTile = 64;

/// The gradients of y = x wᵀ + b (linear()) for the output's gradient dy [n, out], all overwritten:
/// dx = dy w [n, in] (matmul_rows), dw = dyᵀ x [out, in] — each tile of kGradTile × kGradTile weights one
/// task summing over the n rows — and db = the column sums of dy [out], added in double (db nullptr: a layer
/// without bias).
/// The bits depend on the shapes only. Twin: linear_backward_naive().
template <class Scalar>
void linear_backward(const ConstRowMatrixRef<Scalar>& x, const ConstRowMatrixRef<Scalar>& w,
                     const ConstRowMatrixRef<Scalar>& dy, RowMatrixRef<Scalar> dx, RowMatrixRef<Scalar> dw, Scalar* db,
                     const KernelOptions& options) {
  detail::check_linear_backward("linear_backward", x, w, dy, dx, dw);
  matmul_rows<Scalar>(dy, w, nullptr, dx, options);
  const Index n = x.rows(), out = w.rows(), in = w.cols();
  if (n == 0) {
    dw.setZero();
    if (db != nullptr) Eigen::Map<Vector<Scalar>>(db, out).setZero();
    return;
  }
  const Index row_tiles = detail::ceil_div(out, kGradTile), col_tiles = detail::ceil_div(in, kGradTile);
  const double work = 2.0 * static_cast<double>(n) * static_cast<double>(out) * static_cast<double>(in);
  detail::parallel_for(row_tiles * col_tiles, options.num_threads(), work, [&](Index task, int) {
    const Index o0 = (task / col_tiles) * kGradTile, i0 = (task % col_tiles) * kGradTile;
    const Index no = std::min(kGradTile, out - o0), ni = std::min(kGradTile, in - i0);
    dw.block(o0, i0, no, ni).noalias() = dy.middleCols(o0, no).transpose() * x.middleCols(i0, ni);
    if (db != nullptr && i0 == 0) {  // summed in double: a bias gradient is a long sum that cancels
      for (Index o = o0; o < o0 + no; ++o) db[o] = static_cast<Scalar>(dy.col(o).template cast<double>().sum());
    }
  });
}

/// Twin of linear_backward(): one sum per gradient element, in index order.
template <class Scalar>
void linear_backward_naive(const ConstRowMatrixRef<Scalar>& x, const ConstRowMatrixRef<Scalar>& w,
                           const ConstRowMatrixRef<Scalar>& dy, RowMatrixRef<Scalar> dx, RowMatrixRef<Scalar> dw,
                           Scalar* db) {
  detail::check_linear_backward("linear_backward_naive", x, w, dy, dx, dw);
  for (Index i = 0; i < x.rows(); ++i) {
    for (Index k = 0; k < w.cols(); ++k) {
      Scalar acc = 0;
      for (Index o = 0; o < w.rows(); ++o) acc += dy(i, o) * w(o, k);
      dx(i, k) = acc;
    }
  }
  for (Index o = 0; o < w.rows(); ++o) {
    for (Index k = 0; k < w.cols(); ++k) {
      Scalar acc = 0;
      for (Index i = 0; i < x.rows(); ++i) acc += dy(i, o) * x(i, k);
      dw(o, k) = acc;
    }
    if (db != nullptr) {
      Scalar acc = 0;
      for (Index i = 0; i < x.rows(); ++i) acc += dy(i, o);
      db[o] = acc;
    }
  }
}

/// Reference twin of linear(): one dot product per output element, in index order.
template <class Scalar>
void linear_naive(const ConstRowMatrixRef<Scalar>& x, const ConstRowMatrixRef<Scalar>& w, const Scalar* bias,
                  RowMatrixRef<Scalar> y) {
  detail::check_linear_shapes("linear_naive", x, w, y);
  for (Index i = 0; i < x.rows(); ++i) {
    for (Index o = 0; o < w.rows(); ++o) {
      Scalar acc = bias != nullptr ? bias[o] : Scalar(0);
      for (Index k = 0; k < x.cols(); ++k) acc += x(i, k) * w(o, k);
      y(i, o) = acc;
    }
  }
}

/// kernels::matmul_rows for a layer that keeps its weights' packings (WeightCache): wherever matmul_rows
/// would pack `rhs` — on the micro-kernel path in fp32, or for the engine in Compute::BFloat16 — slot
/// `slot` of `cache` serves it, packed from `rhs` on the first call and whenever `stamp` changes, with
/// the same bits. Otherwise (few rows, Eigen's product) matmul_rows itself.
template <class Scalar, class Rhs>
void matmul_rows_cached(const ConstRowMatrixRef<Scalar>& x, const Rhs& rhs, const Scalar* bias, RowMatrixRef<Scalar> y,
                        const KernelOptions& options, const WeightCache<Scalar>& cache, std::size_t slot,
                        std::uint64_t stamp) {
  const bool fits = x.cols() == rhs.rows() && y.rows() == x.rows() && y.cols() == rhs.cols();
  const Index n = x.rows();
  const double work = 2.0 * static_cast<double>(n) * static_cast<double>(x.cols()) * static_cast<double>(rhs.cols());
  if (options.compute() == Compute::BFloat16) {
    if constexpr (std::is_same<Scalar, float>::value) {
      bool in_place = false;
      if constexpr ((Eigen::internal::traits<Rhs>::Flags & Eigen::DirectAccessBit) != 0)
        in_place = rhs.rowStride() == 1;
      if (fits && n > 0 && impl::bf16_packs(n, options.rows_independent(), in_place)) {
        const std::shared_ptr<const cpu::Bf16PackedB> packed =
            cache.bf16(slot, stamp, [&](cpu::Bf16PackedB& b) { b.pack(rhs, options.num_threads(), true, work); });
        impl::matmul_rows_packed_bf16(x, *packed, bias, y, options);
        return;
      }
    }
  } else if (fits && cpu::packed_gemm_for(n, options.rows_independent())) {
    const std::shared_ptr<const cpu::PackedB<Scalar>> packed =
        cache.packed(slot, stamp, [&](cpu::PackedB<Scalar>& b) { b.pack(rhs, options.num_threads(), work); });
    impl::matmul_rows_packed(x, *packed, bias, y, options);
    return;
  }
  matmul_rows<Scalar>(x, rhs, bias, y, options);  // also every shape error
}

/// kernels::linear (y = x wᵀ + bias) with matmul_rows_cached's packings.
template <class Scalar>
void linear_cached(const ConstRowMatrixRef<Scalar>& x, const ConstRowMatrixRef<Scalar>& w, const Scalar* bias,
                   RowMatrixRef<Scalar> y, const KernelOptions& options, const WeightCache<Scalar>& cache,
                   std::size_t slot, std::uint64_t stamp) {
  detail::check_linear_shapes("linear", x, w, y);
  matmul_rows_cached<Scalar>(x, w.transpose(), bias, y, options, cache, slot, stamp);
}

/// A weight [out, in] in nn.Linear's layout, its bias (or nullptr) and where a layer keeps its packings
/// (slot `slot` of `cache`, current while `stamp` is): what linear_cached reads (Linear::cached()).
template <class Scalar>
struct CachedLinear {
  ConstRowMatrixRef<Scalar> weight;
  const Scalar* bias;
  const WeightCache<Scalar>& cache;
  std::size_t slot;
  std::uint64_t stamp;
};

/// linear_cached on a CachedLinear: y = x wᵀ + bias.
template <class Scalar>
void linear_cached(const ConstRowMatrixRef<Scalar>& x, const CachedLinear<Scalar>& w, RowMatrixRef<Scalar> y,
                   const KernelOptions& options) {
  linear_cached<Scalar>(x, w.weight, w.bias, y, options, w.cache, w.slot, w.stamp);
}

}  // namespace kernels
}  // namespace c2f
