// c2f python — one template that binds any layer through the layer contract
// (include/c2f/layers/support/layer_base.hpp): the constructor from its sizes and options as keyword arguments, forward
// /
// __call__ with the masks, and — when the layer has them — cross-attention, the attention weights, the
// chunk selection, a coarse context (FineAttention), a grid (C2FAttention2D) and decoding. What differs
// between layers is found from the layer's type; an entry (layers.hpp) names only its sizes and its own
// options.
#pragma once

#include "convert.hpp"

#include <pybind11/pybind11.h>

#include <chrono>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace c2f_py {

/// One option of a layer: its Python name, and how to set it from and read it as a Python value.
template <class Options>
struct OptionSpec {
  const char* name;
  void (*set)(Options&, py::handle, const std::string& what);
  py::object (*get)(const Options&);
};

/// The OptionSpec of option `name` of `Options` (a type in scope where it is used).
#define C2F_PY_OPTION(name)                                                                          \
  ::c2f_py::OptionSpec<Options> {                                                                    \
#name,                                                                                             \
        [](Options& o, ::pybind11::handle v, const std::string& what) {                                \
          o.name(::c2f_py::from_py<std::decay_t<decltype(o.name())>>(v, what + ": " #name));            \
        },                                                                                             \
        [](const Options& o) { return ::c2f_py::to_py(o.name()); } \
  }

/// The options every layer of the option groups of c2f/options.hpp has, then the entry's own.
template <class Entry>
std::vector<OptionSpec<typename Entry::Options>> all_options() {
  using Options = typename Entry::Options;
  std::vector<OptionSpec<Options>> all = {C2F_PY_OPTION(num_threads), C2F_PY_OPTION(seed)};
  if constexpr (std::is_base_of<c2f::BiasOption<Options>, Options>::value) all.push_back(C2F_PY_OPTION(bias));
  if constexpr (std::is_base_of<c2f::CausalOption<Options>, Options>::value) all.push_back(C2F_PY_OPTION(causal));
  if constexpr (std::is_base_of<c2f::ComputeOption<Options>, Options>::value) all.push_back(C2F_PY_OPTION(compute));
  if constexpr (std::is_base_of<c2f::AttnKernelOptions<Options>, Options>::value) {
    all.insert(all.end(), {C2F_PY_OPTION(kernel), C2F_PY_OPTION(query_block), C2F_PY_OPTION(key_block)});
  }
  for (const OptionSpec<Options>& own : Entry::options()) all.push_back(own);
  return all;
}

/// A bound layer: the C++ layer, and the sizes it was built with.
template <class Entry>
struct Held {
  static constexpr std::size_t kSizes = Entry::sizes().size();
  typename Entry::Layer layer;
  std::array<Index, kSizes> sizes;
};

template <class Entry, std::size_t... I>
typename Entry::Layer make_layer(const std::array<Index, sizeof...(I)>& sizes, const typename Entry::Options& o,
                                 std::index_sequence<I...>) {
  return typename Entry::Layer(sizes[I]..., o);
}

/// Layer(sizes..., options) from Python's arguments: the sizes positionally or by name, the options by
/// name; an unknown, missing or repeated argument is a TypeError as in a Python function.
template <class Entry>
Held<Entry> construct(py::args args, py::kwargs kwargs) {
  constexpr auto names = Entry::sizes();
  constexpr std::size_t n = names.size();
  const std::string layer = std::string(Entry::name) + "()";
  std::string size_list;
  for (const char* s : names) size_list += std::string(size_list.empty() ? "" : ", ") + s;
  if (args.size() > n) {
    throw py::type_error(layer + " takes " + std::to_string(n) + " positional arguments (" + size_list + "), got " +
                         std::to_string(args.size()));
  }
  std::array<Index, n> sizes{};
  std::array<bool, n> given{};
  for (std::size_t i = 0; i < args.size(); ++i) {
    sizes[i] = from_py<Index>(args[i], layer + ": " + names[i]);
    given[i] = true;
  }
  typename Entry::Options options;
  const auto specs = all_options<Entry>();
  for (const auto item : kwargs) {
    const std::string k = py::str(item.first);
    const py::handle value = item.second;
    bool done = false;
    for (std::size_t i = 0; i < n && !done; ++i) {
      if (k != names[i]) continue;
      if (given[i]) throw py::type_error(layer + " got multiple values for argument '" + k + "'");
      sizes[i] = from_py<Index>(value, layer + ": " + k);
      given[i] = done = true;
    }
    for (std::size_t i = 0; i < specs.size() && !done; ++i) {
      if (k == specs[i].name) {
        specs[i].set(options, value, layer);
        done = true;
      }
    }
    if (!done) {
      std::string option_list;
      for (const auto& s : specs) option_list += std::string(option_list.empty() ? "" : ", ") + s.name;
      throw py::type_error(layer + " got an unexpected keyword argument '" + k + "' (sizes: " + size_list +
                           "; options: " + option_list + ", dtype)");
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (!given[i]) throw py::type_error(layer + " missing required argument '" + std::string(names[i]) + "'");
  }
  return Held<Entry>{make_layer<Entry>(sizes, options, std::make_index_sequence<n>{}), sizes};
}

// ------------------------------------------------------------------------------------------------
// What a layer has, beyond the contract.

template <class S>
using Ref3 = c2f::ConstTensor3Ref<S>;

template <class L, class S, class = void>
struct HasForward : std::false_type {};  // forward(x, masks): the contract's form
template <class L, class S>
struct HasForward<L, S,
                  std::void_t<decltype(std::declval<const L&>().forward(std::declval<Ref3<S>>(), c2f::Masks<S>()))>>
    : std::true_type {};

template <class L, class S, class = void>
struct HasCross : std::false_type {};  // forward(query, key, value, masks)
template <class L, class S>
struct HasCross<L, S,
                std::void_t<decltype(std::declval<const L&>().forward(std::declval<Ref3<S>>(), std::declval<Ref3<S>>(),
                                                                      std::declval<Ref3<S>>(), c2f::Masks<S>()))>>
    : std::true_type {};

template <class L, class S, class = void>
struct HasGrid : std::false_type {};  // forward(x, height, width, masks)
template <class L, class S>
struct HasGrid<
    L, S,
    std::void_t<decltype(std::declval<const L&>().forward(std::declval<Ref3<S>>(), Index(), Index(), c2f::Masks<S>()))>>
    : std::true_type {};

template <class L, class S, class = void>
struct HasChunked : std::false_type {};  // forward(x [B, m, k, d], coarse_context, masks) and forward_chunked
template <class L, class S>
struct HasChunked<L, S,
                  std::void_t<decltype(std::declval<const L&>().forward_chunked(
                      std::declval<Ref3<S>>(), Index(), std::declval<Ref3<S>>(), c2f::Masks<S>()))>> : std::true_type {
};

template <class L, class S, class = void>
struct HasWeights : std::false_type {};
template <class L, class S>
struct HasWeights<L, S, std::void_t<decltype(&L::forward_with_weights)>> : std::true_type {};

template <class L, class S, class = void>
struct HasSelection : std::false_type {};
template <class L, class S>
struct HasSelection<L, S, std::void_t<decltype(&L::forward_with_selection)>> : std::true_type {};

template <class L, class = void>
struct HasDecode : std::false_type {};
template <class L>
struct HasDecode<L, std::void_t<decltype(std::declval<const L&>().new_decode_state(1))>> : std::true_type {};

// ------------------------------------------------------------------------------------------------
// Methods with the mask keywords.

/// The mask keywords every forward takes (the layer refuses the ones it has no use for).
inline auto mask_kwargs() {
  return std::make_tuple(py::kw_only(), py::arg("attn_mask") = py::none(), py::arg("key_padding_mask") = py::none(),
                         py::arg("fine_attn_mask") = py::none(), py::arg("causal") = false);
}

/// cls.def(name, fn, positional..., masks..., keywords..., doc) with tuples of pybind11 arguments.
template <class Cls, class Fn, class... Positional, class... Keywords>
void def_masked(Cls& cls, const char* name, Fn fn, const char* doc, std::tuple<Positional...> positional,
                std::tuple<Keywords...> keywords = {}) {
  std::apply([&](auto&&... args) { cls.def(name, fn, args..., doc); },
             std::tuple_cat(positional, mask_kwargs(), keywords));
}

/// forward and __call__ alike.
template <class Cls, class Fn, class... Positional>
void def_forward(Cls& cls, Fn fn, const char* doc, std::tuple<Positional...> positional) {
  def_masked(cls, "forward", fn, doc, positional);
  def_masked(cls, "__call__", fn, doc, positional);
}

#define C2F_PY_MASK_PARAMS py::handle attn_mask, py::handle key_padding_mask, py::handle fine_attn_mask, bool causal
#define C2F_PY_MASKS(S, Entry) c2f_py::masks<S>(Entry::name, attn_mask, key_padding_mask, fine_attn_mask, causal)

constexpr const char* kTokens = "[batch, seq, features]";

template <class Entry, class Cls>
void bind_decode(Cls& cls) {
  using Layer = typename Entry::Layer;
  using S = typename Entry::Scalar;
  using State = typename Layer::DecodeState;
  py::class_<State>(cls, "DecodeState",
                    "The keys and values a decoding layer has seen (new_decode_state); copy() forks it. One call at a "
                    "time uses a state.")
      .def_property_readonly("batch", &State::batch)
      .def_property_readonly("length", &State::length, "tokens decoded so far, per sequence")
      .def_property_readonly("memory_bytes", &State::memory_bytes)
      .def_property_readonly("made_by", &State::made_by)
      .def("reserve", &State::reserve, py::arg("tokens"), "room for `tokens` tokens per sequence without reallocation")
      .def("copy", [](const State& s) { return State(s); })
      .def("__copy__", [](const State& s) { return State(s); })
      .def("__deepcopy__", [](const State& s, py::handle) { return State(s); });
  cls.def(
      "new_decode_state",
      [](const Held<Entry>& h, Index batch, Index reserve) { return h.layer.new_decode_state(batch, reserve); },
      py::arg("batch"), py::arg("reserve") = 0,
      "an empty decoding state for `batch` sequences (the layer must be causal)");
  using Step = c2f::Output<S> (Layer::*)(Ref3<S>, State&) const;
  for (const auto& [name, step, doc] :
       {std::make_tuple("decode", static_cast<Step>(&Layer::template decode<State>),
                        "appends x [batch, n, features] to the state; returns their outputs [batch, n, features]"),
        std::make_tuple("prefill", static_cast<Step>(&Layer::template prefill<State>),
                        "appends x like decode(); returns only the last token's output [batch, 1, features]")}) {
    cls.def(
        name,
        [step = step](const Held<Entry>& h, py::handle x, State& state) {
          const In<S, 3> in(x, std::string(Entry::name) + ": x", kTokens);
          return to_numpy(without_gil([&] { return (h.layer.*step)(in.view(), state); }));
        },
        py::arg("x"), py::arg("state"), doc);
  }
  // The same step repeated in C++ (python_bench.py: the binding's overhead is the difference).
  cls.def("_decode_loop", [](const Held<Entry>& h, py::handle x, State& state, int steps) {
    const In<S, 3> in(x, std::string(Entry::name) + ": x", kTokens);
    return without_gil([&] {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) h.layer.decode(in.view(), state);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  });
}

/// "c2f.<Name> (float32): <Name>(sizes..., *, options...)": the class's docstring.
template <class Entry>
std::string class_doc() {
  std::string doc =
      std::string("c2f's ") + Entry::name + " in " + dtype_name<typename Entry::Scalar>() + ": " + Entry::name + "(";
  for (const char* s : Entry::sizes()) doc += std::string(s) + ", ";
  doc += "*";
  for (const auto& spec : all_options<Entry>()) doc += std::string(", ") + spec.name + "=...";
  return doc + "). Semantics: docs/layers.md; the Python API: docs/python.md.";
}

/// Binds Entry's layer as the Python class `<name>_<dtype>` of module m.
template <class Entry>
void bind_layer(py::module_& module) {
  using Layer = typename Entry::Layer;
  using S = typename Entry::Scalar;
  using H = Held<Entry>;
  const std::string cls_name = std::string(Entry::name) + "_" + dtype_name<S>();
  py::class_<H> cls(module, cls_name.c_str(), class_doc<Entry>().c_str());
  cls.def(py::init(&construct<Entry>));
  for (std::size_t i = 0; i < H::kSizes; ++i) {
    cls.def_property_readonly(Entry::sizes()[i], [i](const H& h) { return h.sizes[i]; });
  }
  cls.def_property_readonly("dtype", [](const H&) { return py::dtype::of<S>(); });
  cls.def_property_readonly("options", [](const H& h) {
    py::dict d;
    for (const auto& spec : all_options<Entry>()) d[spec.name] = spec.get(h.layer.options());
    return d;
  });
  cls.def_property(
      "num_threads", [](const H& h) { return h.layer.options().num_threads(); },
      [](H& h, py::handle n) { h.layer.set_num_threads(from_py<int>(n, std::string(Entry::name) + ": num_threads")); },
      "worker threads of one call (0 = c2f.get_num_threads()); results are the same for any count");
  cls.def_property_readonly("mask_fields", [](const H&) {
    py::list fields;
    for (const auto& [field, name] : {std::pair(c2f::MaskFields::AttnMask, "attn_mask"),
                                      std::pair(c2f::MaskFields::KeyPaddingMask, "key_padding_mask"),
                                      std::pair(c2f::MaskFields::FineAttnMask, "fine_attn_mask")}) {
      if (c2f::takes(Layer::mask_fields, field)) fields.append(name);
    }
    return py::tuple(fields);
  });
  cls.def("__repr__", [](const H& h) {
    std::string r = std::string(Entry::name) + "(";
    for (std::size_t i = 0; i < H::kSizes; ++i)
      r += std::string(Entry::sizes()[i]) + "=" + std::to_string(h.sizes[i]) + ", ";
    r += std::string("dtype='") + dtype_name<S>() + "'";
    for (const auto& spec : all_options<Entry>())
      r += std::string(", ") + spec.name + "=" + std::string(py::repr(spec.get(h.layer.options())));
    return r + ")";
  });
  cls.def("__copy__", [](const H& h) { return H(h); });
  cls.def(
      "__deepcopy__", [](const H& h, py::handle) { return H(h); }, py::arg("memo"));
  cls.def(
      "state_dict", [](const H& h, const std::string& prefix) { return to_dict(h.layer.state_dict(prefix)); },
      py::arg("prefix") = "", "PyTorch's names → numpy arrays (copies)");
  cls.def(
      "load_state_dict",
      [](H& h, py::handle d, const std::string& prefix) { h.layer.load_state_dict(from_mapping(d), prefix); },
      py::arg("state_dict"), py::arg("prefix") = "",
      "strict load from a dict of numpy arrays or torch tensors (e.g. module.state_dict()); all or nothing");

  if constexpr (HasCross<Layer, S>::value) {
    // query alone is self-attention; key and value given: cross-attention (torch's forward(query, key, value)).
    const auto qkv = [](const H& h, py::handle query, py::handle key, py::handle value, const c2f::Masks<S>& masks,
                        auto&& call) {
      const std::string n(Entry::name);
      const In<S, 3> q(query, n + ": query", kTokens);
      if (key.is_none() != value.is_none()) throw py::type_error(n + ": give both key and value, or neither");
      const In<S, 3> k(key.is_none() ? query : key, n + ": key", kTokens);
      const In<S, 3> v(value.is_none() ? query : value, n + ": value", kTokens);
      return without_gil([&] { return call(h.layer, q.view(), k.view(), v.view(), masks); });
    };
    const auto positional =
        std::make_tuple(py::arg("query"), py::arg("key") = py::none(), py::arg("value") = py::none());
    def_forward(
        cls,
        [qkv](const H& h, py::handle query, py::handle key, py::handle value, C2F_PY_MASK_PARAMS) {
          return to_numpy(
              qkv(h, query, key, value, C2F_PY_MASKS(S, Entry),
                  [](const Layer& l, auto q, auto k, auto v, const auto& m) { return l.forward(q, k, v, m); }));
        },
        "query [batch, Lq, embed_dim] (key [batch, Lk, kdim], value [batch, Lk, vdim]; default: query) → [batch, Lq, "
        "embed_dim]",
        positional);
    if constexpr (HasWeights<Layer, S>::value) {
      def_masked(
          cls, "forward_with_weights",
          [qkv](const H& h, py::handle query, py::handle key, py::handle value, C2F_PY_MASK_PARAMS, bool average) {
            c2f::AttnOutput<S> r =
                qkv(h, query, key, value, C2F_PY_MASKS(S, Entry),
                    [&](const Layer& l, auto q, auto k, auto v, const auto& m) {
                      return l.forward_with_weights(q, k, v, m,
                                                    average ? c2f::AttnWeights::Averaged : c2f::AttnWeights::PerHead);
                    });
            py::array weights = to_numpy(std::move(r.weights));
            // torch's shapes: [batch, Lq, Lk] averaged, [batch, heads, Lq, Lk] per head.
            if (average)
              weights = py::array(weights.attr("reshape")(weights.shape(0), weights.shape(2), weights.shape(3)));
            return py::make_tuple(to_numpy(std::move(r.output)), weights);
          },
          "forward() and the attention weights (torch's need_weights=True): (output, weights)", positional,
          std::make_tuple(py::arg("average_attn_weights") = true));
    }
  } else if constexpr (HasForward<Layer, S>::value) {
    def_forward(
        cls,
        [](const H& h, py::handle x, C2F_PY_MASK_PARAMS) {
          const c2f::Masks<S> masks = C2F_PY_MASKS(S, Entry);
          const In<S, 3> in(x, std::string(Entry::name) + ": x", kTokens);
          return to_numpy(without_gil([&] { return h.layer.forward(in.view(), masks); }));
        },
        "x [batch, seq, features] → [batch, seq', features']", std::make_tuple(py::arg("x")));
  }
  if constexpr (HasSelection<Layer, S>::value) {
    def_masked(
        cls, "forward_with_selection",
        [](const H& h, py::handle x, C2F_PY_MASK_PARAMS) {
          const c2f::Masks<S> masks = C2F_PY_MASKS(S, Entry);
          const In<S, 3> in(x, std::string(Entry::name) + ": x", kTokens);
          auto r = without_gil([&] { return h.layer.forward_with_selection(in.view(), masks); });
          const c2f::kernels::ChunkSelection& s = r.selection;
          py::array_t<std::int64_t> selection({s.batch, s.heads, s.queries, s.top_k});
          std::copy(s.index.begin(), s.index.end(), selection.mutable_data());
          return py::make_tuple(to_numpy(std::move(r.output)), selection);
        },
        "forward() and the selected key chunks [batch, heads, query rows, top_k] (-1 = none): (output, selection)",
        std::make_tuple(py::arg("x")));
  }
  if constexpr (HasGrid<Layer, S>::value) {
    def_forward(
        cls,
        [](const H& h, py::handle x, Index height, Index width, C2F_PY_MASK_PARAMS) {
          const c2f::Masks<S> masks = C2F_PY_MASKS(S, Entry);
          const In<S, 3> in(x, std::string(Entry::name) + ": x", "[batch, height·width, embed_dim]");
          return to_numpy(without_gil([&] { return h.layer.forward(in.view(), height, width, masks); }));
        },
        "x [batch, height·width, embed_dim] (a grid flattened row-major) → the same shape",
        std::make_tuple(py::arg("x"), py::arg("height"), py::arg("width")));
  }
  if constexpr (HasChunked<Layer, S>::value) {
    def_forward(
        cls,
        [](const H& h, py::handle x, py::handle context, C2F_PY_MASK_PARAMS) {
          const c2f::Masks<S> masks = C2F_PY_MASKS(S, Entry);
          const std::string n(Entry::name);
          const In<S, 4> in(x, n + ": x", "[batch, chunks, chunk, embed_dim]");
          const In<S, 3> c(context, n + ": coarse_context", "[batch, chunks, embed_dim]");
          return to_numpy(without_gil([&] { return h.layer.forward(in.view(), c.view(), masks); }));
        },
        "x [batch, chunks, chunk, embed_dim], coarse_context [batch, chunks, embed_dim] → x's shape (the article's "
        "FineAttention.forward)",
        std::make_tuple(py::arg("x"), py::arg("coarse_context")));
    def_masked(
        cls, "forward_chunked",
        [](const H& h, py::handle x, Index chunk, py::handle context, C2F_PY_MASK_PARAMS) {
          const c2f::Masks<S> masks = C2F_PY_MASKS(S, Entry);
          const std::string n(Entry::name);
          const In<S, 3> in(x, n + ": x", kTokens);
          const In<S, 3> c(context, n + ": coarse_context", "[batch, ceil(seq / chunk), embed_dim]");
          return to_numpy(without_gil([&] { return h.layer.forward_chunked(in.view(), chunk, c.view(), masks); }));
        },
        "x [batch, seq, embed_dim] in chunks of `chunk` (the last may be partial) → [batch, seq, embed_dim]",
        std::make_tuple(py::arg("x"), py::arg("chunk"), py::arg("coarse_context")));
  }
  if constexpr (HasDecode<Layer>::value) bind_decode<Entry>(cls);
}

}  // namespace c2f_py
