// c2f dist — the MPI communicator the sequence-parallel layers run on, and the one rule every one of them
// follows: a call either succeeds on every rank or throws the same exception on every rank.
//
// c2f/dist adds no transport of its own: every byte crosses ranks through MPI collectives or MPI
// point-to-point calls on the communicator given (MPI_COMM_WORLD by default). MPI must be initialised
// before a layer is built and finalised after the last call; only the thread that calls a layer calls
// MPI (c2f's worker threads never do), so MPI_Init_thread with MPI_THREAD_FUNNELED is enough. Two calls
// must not run at the same time on one communicator from two threads (MPI's rule for collectives).
//
// Failure model (docs/distributed.md):
// - Bad input on any rank (a shape, a length that is not chunk-aligned, ranks that disagree on the
//   batch, the width, the chunk size or the scalar type): every rank throws the same
//   std::invalid_argument, which names the rank and what it was given. Each call first exchanges one
//   small record per rank (MPI_Allgather), so no rank is left waiting in a collective the others skip.
// - A rank that dies (a crash, a kill): MPI's default error handler (MPI_ERRORS_ARE_FATAL) aborts the
//   whole job; c2f does not change it, and nothing hangs.
#pragma once

#include "c2f/core.hpp"
#include "c2f/mask.hpp"
#include "c2f/output.hpp"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace c2f {
namespace dist {

/// A communicator (not owned): its rank and size, read once.
class Comm {
 public:
  /// MPI_COMM_WORLD.
  Comm() : Comm(MPI_COMM_WORLD) {}
  /// Throws std::logic_error when MPI is not initialised (or already finalised).
  explicit Comm(MPI_Comm comm) : comm_(comm) {
    int initialised = 0, finalised = 0;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalised);
    if (!initialised || finalised)
      throw std::logic_error("c2f::dist::Comm: MPI is not initialised (call MPI_Init first)");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

namespace detail {

/// The MPI datatype of a c2f scalar.
template <class Scalar>
MPI_Datatype mpi_type() {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "c2f::dist runs on float and double");
  return std::is_same<Scalar, float>::value ? MPI_FLOAT : MPI_DOUBLE;
}

/// An MPI count (an int), or std::invalid_argument naming what overflowed.
inline int mpi_count(Index n, const char* layer, const char* what) {
  if (n < 0 || n > INT_MAX) c2f::detail::fail(layer, ": ", what, " = ", n, " exceeds MPI's int count");
  return static_cast<int>(n);
}

/// The MPI datatype of one row of `width` scalars, committed, freed with the object.
template <class Scalar>
class RowType {
 public:
  RowType(Index width, const char* layer) {
    MPI_Type_contiguous(mpi_count(width, layer, "a row's width"), mpi_type<Scalar>(), &type_);
    MPI_Type_commit(&type_);
  }
  ~RowType() { MPI_Type_free(&type_); }
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_;
};

/// One value a rank reports before a call: `agreed` ones must be equal on every rank.
struct Field {
  const char* name;
  std::int64_t value;
  bool agreed;
};

/// What one rank sends: whether its local part went well (else the exception's kind and message), and
/// its fields.
struct Report {
  static constexpr int kMaxFields = 24;
  static constexpr int kMessage = 480;
  std::int32_t failed = 0;  ///< 0 ok, 1 std::invalid_argument, 2 another exception
  std::int32_t fields = 0;
  std::int64_t values[kMaxFields] = {};
  char message[kMessage] = {};
};

/// Runs `local` on this rank (it may throw), then every rank exchanges its Report (one MPI_Allgather).
/// If some rank failed, every rank throws the same exception: the lowest failing rank's, as
/// "<layer>: rank r of P: <message>" (std::invalid_argument when it was one, else std::runtime_error).
/// Else, unless every rank reported the same value for every agreed field, every rank throws the same
/// std::invalid_argument naming the field and two ranks' values. Returns every rank's values, by rank.
template <class Local>
std::vector<std::vector<std::int64_t>> exchange(const Comm& comm, const char* layer, const std::vector<Field>& fields,
                                                Local&& local) {
  if (fields.size() > static_cast<std::size_t>(Report::kMaxFields)) {
    throw std::logic_error("c2f::dist: too many fields in one exchange");
  }
  Report mine;
  try {
    local();
  } catch (const std::invalid_argument& e) {
    mine.failed = 1;
    std::strncpy(mine.message, e.what(), Report::kMessage - 1);
  } catch (const std::exception& e) {
    mine.failed = 2;
    std::strncpy(mine.message, e.what(), Report::kMessage - 1);
  }
  mine.fields = static_cast<std::int32_t>(fields.size());
  for (std::size_t i = 0; i < fields.size(); ++i) mine.values[i] = fields[i].value;

  std::vector<Report> all(static_cast<std::size_t>(comm.size()));
  MPI_Allgather(&mine, static_cast<int>(sizeof(Report)), MPI_BYTE, all.data(), static_cast<int>(sizeof(Report)),
                MPI_BYTE, comm.get());
  for (int r = 0; r < comm.size(); ++r) {
    const Report& rep = all[static_cast<std::size_t>(r)];
    if (rep.failed == 0) continue;
    std::string why(rep.message, strnlen(rep.message, Report::kMessage));
    if (why.rfind("c2f: ", 0) == 0) why.erase(0, 5);
    const std::string msg = std::string("c2f: ") + layer + ": rank " + std::to_string(r) + " of " +
                            std::to_string(comm.size()) + ": " + why;
    if (rep.failed == 1) throw std::invalid_argument(msg);
    throw std::runtime_error(msg);
  }
  for (int r = 1; r < comm.size(); ++r) {
    const Report& rep = all[static_cast<std::size_t>(r)];
    if (rep.fields != mine.fields) {
      c2f::detail::fail(layer, ": rank ", r, " called with ", rep.fields, " fields, rank 0 with ", all[0].fields,
                        " (the ranks run different calls)");
    }
    for (std::size_t i = 0; i < fields.size(); ++i) {
      if (fields[i].agreed && rep.values[i] != all[0].values[i]) {
        c2f::detail::fail(layer, ": the ranks disagree on ", fields[i].name, ": rank 0 has ", all[0].values[i],
                          ", rank ", r, " has ", rep.values[i], " (every rank must pass the same)");
      }
    }
  }
  std::vector<std::vector<std::int64_t>> values(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) values[r].assign(all[r].values, all[r].values + fields.size());
  return values;
}

/// A dist layer's forward(): a fresh [B, n, width] output filled by fill(out [B·n, width]) (the layer's
/// forward_into), sized only for an x of that width (a wrong x is reported by forward_into on every
/// rank, not here).
template <class Scalar, class Fill>
Output<Scalar> fresh_forward(const ConstTensor3Ref<Scalar>& x, Index width, Fill&& fill) {
  const bool fits = x.features() == width;
  Output<Scalar> out({fits ? x.batch() : 0, fits ? x.seq() : 0, width});
  fill(Eigen::Map<RowMatrix<Scalar>>(out.data(), out.dimension(0) * out.dimension(1), width));
  return out;
}

/// What every sequence-parallel layer has: its communicator and the single-process layer whose weights
/// and options it runs (module(): load the same state dict on every rank); its constructors — from the
/// single-process layer's own constructor arguments, (comm, sizes…, options), or wrapping a built (e.g.
/// loaded) one, (comm, module) — which a layer takes with `using Base::Base;`; the fields every rank's
/// call must agree on (call_fields); and, for the layers whose input is one [B, n_r, width] tensor,
/// forward() — Derived::forward_into on a fresh output.
template <class Derived, class ModuleType, class Scalar>
class DistLayer {
 public:
  using Module = ModuleType;
  /// The single-process layer's options (a layer with options of its own, as dist::MultiHeadAttention,
  /// declares its own Options).
  using Options = typename Module::Options;

  /// Wraps a built (e.g. loaded) single-process layer.
  DistLayer(Comm comm, Module module) : comm_(comm), module_(std::move(module)) {}
  /// Builds the single-process layer from its constructor's arguments: (comm, sizes…, options).
  template <class First, class... Rest, class = std::enable_if_t<!std::is_same<std::decay_t<First>, Module>::value>>
  DistLayer(Comm comm, First&& first, Rest&&... rest)
      : DistLayer(comm, Module(std::forward<First>(first), std::forward<Rest>(rest)...)) {}

  const Comm& comm() const { return comm_; }
  Module& module() { return module_; }
  const Module& module() const { return module_; }

  /// This rank's output rows [B, n_r, width] for its input rows x.
  Output<Scalar> forward(ConstTensor3Ref<Scalar> x, const Masks<Scalar>& masks = {}) const {
    return fresh_forward<Scalar>(x, module_.embed_dim(), [&](RowMatrixRef<Scalar> out) {
      static_cast<const Derived&>(*this).forward_into(x, out, masks);
    });
  }

 protected:
  /// The fields of one call that exchange() compares across the ranks, in this order: the batch size, the
  /// input's feature size, embed_dim and num_heads; the layer's own sizes and options (`own`); the scalar
  /// size; the masks' kinds and sizes (`masks`); and last `shard`, this rank's share, which may differ.
  std::vector<Field> call_fields(Index batch, Index features, std::initializer_list<Field> own,
                                 std::initializer_list<Field> masks, Field shard) const {
    std::vector<Field> fields = {{"the batch size", batch, true},
                                 {"the input's feature size", features, true},
                                 {"embed_dim", module_.embed_dim(), true},
                                 {"num_heads", module_.num_heads(), true}};
    fields.insert(fields.end(), own);
    fields.push_back({"the scalar size (float or double)", static_cast<std::int64_t>(sizeof(Scalar)), true});
    fields.insert(fields.end(), masks);
    fields.push_back(shard);
    return fields;
  }

  Comm comm_;
  Module module_;
};

/// The declarations a sequence-parallel layer `Name` opens its class with, after `class Name : public
/// detail::DistLayer<Name<Scalar>, c2f::Name<Scalar>, Scalar> {`: Base, the members it reads (comm_,
/// module_), the public Module type and type_name "dist::Name". The class goes on in its public part.
#define C2F_DIST_LAYER_BASICS(Name)                                                       \
 private:                                                                                 \
  using Base = ::c2f::dist::detail::DistLayer<Name<Scalar>, ::c2f::Name<Scalar>, Scalar>; \
  using Base::comm_;                                                                      \
  using Base::module_;                                                                    \
                                                                                          \
 public:                                                                                  \
  using Module = typename Base::Module;                                                   \
  static constexpr const char* type_name = "dist::" #Name

/// exchange() without fields: runs `local` here and throws the same on every rank if it threw on one.
template <class Local>
void all_or_none(const Comm& comm, const char* layer, Local&& local) {
  exchange(comm, layer, {}, std::forward<Local>(local));
}

}  // namespace detail
}  // namespace dist
}  // namespace c2f
